//! From records to model values: host records correlated into split windows,
//! guest frames decoded and stitched onto them.

pub mod channel;
pub mod clock;
pub mod correlate;
pub mod reap;
pub mod stitch;
pub mod tails;
pub mod transport;
pub mod vqueue;
