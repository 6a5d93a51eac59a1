//! The host as it is: VMs and their virtual disks, host disks, storage
//! engines. Parsers are pure functions over recorded input; scanners read /proc.

pub mod child;
pub mod disks;
pub mod diskstats;
pub mod libvirt;
pub mod monitors;
pub mod procfs;
pub mod qemu_counts;
pub mod qmp;
pub mod threads;
pub mod vms;
