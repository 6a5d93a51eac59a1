//! Block accounting (`bpf/block.bpf.c`): the start-stamp probe for disks
//! whose requests the kernel does not stamp.

use super::*;
use crate::probes::LoadError;

/// Request-based (blk-mq) disks whose requests get no start_time_ns from
/// the kernel: it is kept when iostats is on or an I/O scheduler (or
/// blk-stat) is in use (blk_mq_need_time_stamp), so these have iostats off
/// and no scheduler. Bio-based disks (zram, dm-linear) have no requests.
pub fn disks_without_start_time() -> Vec<String> {
    let read = |d: &str, f: &str| {
        std::fs::read_to_string(format!("/sys/block/{d}/queue/{f}")).unwrap_or_default()
    };
    crate::discover::disks::whole_disks()
        .into_iter()
        .filter(|d| {
            if !std::path::Path::new(&format!("/sys/block/{d}/mq")).exists() {
                return false;
            }
            let sched = read(d, "scheduler");
            read(d, "iostats").trim() == "0"
                && (sched.trim().is_empty() || sched.contains("[none]"))
        })
        .collect()
}

impl BlockProbes {
    /// Attaches the per-request start probe if it is not yet: stamps where
    /// the kernel keeps no start time, and the submitter for VM attribution.
    /// block_io_start appeared in v6.5 (5a80bd075f3b); before it the insert
    /// is the closest point.
    pub fn ensure_start_probe(&mut self) -> Result<(), LoadError> {
        if self.start_probe_since.is_some() {
            return Ok(());
        }
        if let Err(e) = self.attach_raw("block_io_start") {
            log::info!(
                "{}; using block_rq_insert for start stamps and block_getrq for VMs' requests",
                crate::probes::error_chain(&e)
            );
            // Requests issued directly (no scheduler, an idle queue) are
            // never inserted: a VM's is taken by its bio as it gets its
            // request, and joined to the request at its issue.
            self.attach_raw("block_rq_insert")?;
            if self.vm_segments {
                self.attach_raw("block_getrq")?;
            }
        }
        self.start_probe_since = Some(crate::discover::vms::since_boot());
        Ok(())
    }

    /// Whether a process started after the start probe was attached: its
    /// first request (a VM's first, which marks its guest running) was
    /// then seen.
    pub fn saw_start_of(&self, pid: u32) -> bool {
        let started = crate::discover::vms::started_since_boot(pid);
        matches!((self.start_probe_since, started), (Some(probe), Some(proc)) if probe <= proc)
    }
}
