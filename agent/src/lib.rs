//! iospan: where each guest I/O's latency goes.
//!
//! Layers, bottom up; a module uses only the layers below its own (checked by
//! `cargo xtask layers`, see docs/architecture.md):
//!
//! - `abi`: the records and map layouts shared with the eBPF programs.
//! - `model`: what is measured — operations, segments, histograms, spans, loss
//!   counters. Plain data: no I/O, no async.
//! - `discover`: the host's VMs, virtual disks, host disks and storage engines,
//!   from command lines, /proc, /sys and libvirt's status files.
//! - `probes`: loading and attaching the eBPF programs; the only aya user.
//! - `pipeline`: kernel records and guest frames in, model values out (decode,
//!   correlate, stitch).
//! - `output`: what reads the model — report, metrics, live frames, OTLP, HTML,
//!   the run store.
//! - `api`: the HTTP API the service, `run --metrics-listen` and `top
//!   --connect` share.
//! - `cmd`: the commands, wiring the layers; `main.rs` parses arguments only.

pub mod abi;
pub mod api;
pub mod cmd;
pub mod discover;
// What a guest, a local user or the kernel's records make of the figures
// never panics here: no indexing, no arithmetic that can overflow or divide
// by zero (tests aside).
#[cfg_attr(
    not(test),
    deny(clippy::indexing_slicing, clippy::arithmetic_side_effects)
)]
pub mod model;
pub mod output;
#[cfg_attr(
    not(test),
    deny(clippy::indexing_slicing, clippy::arithmetic_side_effects)
)]
pub mod pipeline;
pub mod probes;
