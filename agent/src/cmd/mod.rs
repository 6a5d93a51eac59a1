//! The commands: each wires the layers below for one job.

pub mod bench;
pub mod config;
pub mod demo;
pub mod doctor;
pub mod floor;
pub mod guest;
#[cfg(feature = "otlp")]
pub mod replay;
pub mod run;
pub mod scratch;
#[cfg(feature = "serve")]
pub mod service;
pub mod token;
#[cfg(feature = "tui")]
pub mod top;
pub mod verify;
