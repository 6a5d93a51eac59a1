//! iospan: where each guest I/O's latency goes.
//!
//! Layers, bottom up: `abi` (records shared with the eBPF programs), `bpf`
//! (the only module using aya), `model` (what is measured, no I/O), then the
//! commands: `run`, `doctor`, `demo`, with `report` rendering results.

pub mod abi;
pub mod api;
pub mod bench;
pub mod bpf;
pub mod channel;
pub mod config;
pub mod correlate;
pub mod demo;
pub mod disks;
pub mod diskstats;
pub mod doctor;
pub mod export;
pub mod guest_agent;
pub mod html;
pub mod libvirt;
pub mod live;
pub mod metrics;
pub mod model;
pub mod preflight;
pub mod procfs;
pub mod reap;
#[cfg(feature = "otlp")]
pub mod replay;
pub mod report;
pub mod run;
pub mod scratch;
#[cfg(feature = "serve")]
pub mod service;
pub mod stitch;
#[cfg(any(feature = "serve", feature = "tui"))]
pub mod tls;
#[cfg(feature = "tui")]
pub mod top;
pub mod transport;
pub mod vms;
