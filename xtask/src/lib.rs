//! The machinery behind `cargo xtask`, also used by the integration tests
//! (the guest rig). Depends on nothing of the agent, so it builds on a
//! machine that still lacks clang and libbpf.

pub mod abi;
pub mod backends;
pub mod bench;
pub mod bench_vm;
pub mod dashboards;
pub mod debian;
pub mod dist;
pub mod fuzz;
pub mod guest;
pub mod layers;
pub mod matrix;
pub mod otlp_sink;
pub mod phases;
pub mod pictures;
pub mod qemu_release;
pub mod setup;
pub mod sh;
pub mod tax;
pub mod tmux;
