//! One read of the kernel's block aggregates, and what was lost or
//! degraded on the way: what the probes give and the outputs show.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{
    abi::VmCounts,
    model::{Dev, DiskOpStats, Op},
};

/// Lost or degraded events, summed over CPUs. Every one of them is shown.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Per-request records the ring buffer had no room for.
    pub ringbuf_drops: u64,
    /// Requests of a disk whose slot another disk owns (raise --max-disks).
    pub disk_conflicts: u64,
    /// Requests whose in-flight slot was taken by another request.
    pub slot_conflicts: u64,
    /// Requests with no start time: queue unknown, total measured from issue.
    pub no_start: u64,
    /// Requests with no issue time (e.g. in flight when tracing began).
    pub no_issue: u64,
    /// Program invocations the kernel skipped because the program was
    /// already running on that CPU.
    pub bpf_recursion_misses: u64,
    /// The same, by program (those with any): which measurement lost them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub bpf_recursion_misses_by_program: BTreeMap<String, u64>,
    /// Requests the kernel's own disk accounting completed but no
    /// completion tracepoint delivered to us (filled in by the run).
    #[serde(default)]
    pub unseen: u64,
    /// Issued requests whose completion never reached our program (seen
    /// when their tag came back in use): the kernel ran the tracepoint's
    /// other listeners but not ours, and counted it nowhere.
    #[serde(default)]
    pub undelivered: u64,
    /// Not losses: partial-completion pieces, requeue events and records
    /// streamed, for context.
    pub partial_pieces: u64,
    pub requeue_events: u64,
    pub records_streamed: u64,
    /// Not lost: VM completions an interrupt left for the next one (its
    /// drain was busy on that CPU, or had settled its most).
    #[serde(default)]
    pub join_deferred: u64,
    /// Requests of VMs whose (VM, disk, op) found the VM table full.
    #[serde(default)]
    pub vm_table_full: u64,
    /// A VM's SCSI commands LIO ran while the table of tasks acting for
    /// VMs was full: their requests are counted as the executing task's.
    #[serde(default)]
    pub scsi_cmds_unfollowed: u64,
    /// VM disk entries whose count differs from QEMU's own by more than
    /// merges and the requests in flight at the edges (filled in by the run).
    #[serde(default)]
    pub qemu_mismatch: u64,
    /// VM requests whose host window could not be split (filled in by the run).
    #[serde(default)]
    pub host_split: crate::model::SplitCounters,
}

impl Counters {
    /// Every loss and degradation: (key, what it means, count). The key
    /// is the metric label and the JSON field; `unseen` is known only at a
    /// run's end.
    pub fn losses(&self) -> [(&'static str, &'static str, u64); 16] {
        let h = &self.host_split;
        [
            ("ringbuf_drops", "ring buffer drops", self.ringbuf_drops),
            (
                "disk_conflicts",
                "disk table conflicts",
                self.disk_conflicts,
            ),
            (
                "slot_conflicts",
                "in-flight slot conflicts",
                self.slot_conflicts,
            ),
            ("no_issue", "no issue time", self.no_issue),
            ("no_start", "no start time", self.no_start),
            (
                "bpf_recursion_misses",
                "skipped by the kernel (recursion)",
                self.bpf_recursion_misses,
            ),
            (
                "unseen",
                "completed but never delivered by the tracepoints",
                self.unseen,
            ),
            (
                "undelivered",
                "issued, completion never delivered",
                self.undelivered,
            ),
            ("vm_table_full", "VM table full", self.vm_table_full),
            (
                "scsi_cmds_unfollowed",
                "VM SCSI commands not followed to their submitter",
                self.scsi_cmds_unfollowed,
            ),
            (
                "qemu_mismatch",
                "VM disks whose count differs from QEMU's",
                self.qemu_mismatch,
            ),
            ("no_kick", "VM requests without a kick", h.no_kick),
            ("no_signal", "VM requests without a signal", h.no_signal),
            ("unordered", "VM requests out of order", h.unordered),
            (
                "not_followed",
                "VM requests of disks not followed",
                h.not_followed,
            ),
            (
                "polled",
                "VM requests found by polling, no kick to time",
                h.polled,
            ),
        ]
    }
}

/// One read of the kernel's aggregates: cumulative since load.
#[derive(Clone, Debug, Default)]
pub struct BlockSnapshot {
    pub stats: BTreeMap<(Dev, Op), DiskOpStats>,
    /// Requests VMs submitted, by VM, host disk, op and virtual disk.
    pub vm_stats: BTreeMap<VmStatKey, DiskOpStats>,
    /// VM slot -> its guest requests merged into others, and how many it
    /// started.
    pub vm_counts: BTreeMap<u32, VmCounts>,
    pub counters: Counters,
}

/// A VM's requests that have finished, over its disks and ops.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VmFinished {
    /// Completed, timed or not.
    pub done: u64,
    /// Of those, the ones whose completion never reached us.
    pub undelivered: u64,
}

impl BlockSnapshot {
    /// Per VM slot: its finished requests (see `VmFinished`).
    pub fn vm_finished(&self) -> BTreeMap<u32, VmFinished> {
        let mut out: BTreeMap<u32, VmFinished> = BTreeMap::new();
        for (k, s) in &self.vm_stats {
            let f = out.entry(k.vm).or_default();
            f.done = f.done.saturating_add(s.ios.saturating_add(s.undelivered));
            f.undelivered = f.undelivered.saturating_add(s.undelivered);
        }
        out
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct VmStatKey {
    /// VM slot (see `BlockProbes::vm_pids`).
    pub vm: u32,
    pub dev: Dev,
    pub op: Op,
    /// Virtual disk slot; 0 for the VM process's other I/O.
    pub vdisk: u32,
}
