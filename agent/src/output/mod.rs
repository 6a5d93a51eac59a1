//! Everything that reads the model and shows or ships it; nothing here calls
//! back into the pipeline.

pub mod diagnose;
pub mod export;
pub mod html;
pub mod live;
pub mod metrics;
pub mod qemu_check;
pub mod report;
pub mod store;
