//! Which QEMU and engine functions are probed for a VM, and which of them
//! are hit per request.

use super::*;

/// What a probed function tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeRole {
    /// Its hits end host windows (the used-ring push, NVMe's interrupt):
    /// once per request.
    Completion,
    /// The device model took a request (QEMU's own clock for it starts):
    /// once per request; without it a request's engine time starts at its
    /// batch's pickup.
    Taken,
    /// virtio-blk's accounting of requests it merged: hit only when it
    /// merges.
    Merge,
}

impl ProbeRole {
    /// Hit once per request: its cost is per guest I/O.
    pub fn hot(self) -> bool {
        self != Self::Merge
    }

    /// Attached where the binary exports it, skipped (and said) where not:
    /// the split stands without it.
    pub fn optional(self) -> bool {
        self == Self::Taken
    }

    pub fn describe(self) -> &'static str {
        match self {
            Self::Completion => "completion probe",
            Self::Taken => "request-taken probe (each request's own pickup)",
            Self::Merge => "merge probe (hit only when QEMU merges requests)",
        }
    }

    /// What is missing where the binary does not export it.
    pub fn missing(self) -> &'static str {
        match self {
            Self::Completion => "no engine completion half",
            Self::Taken => "a request's engine time starts at its batch's pickup",
            Self::Merge => "requests QEMU merges are not counted",
        }
    }
}

/// What decides a VM's probes in QEMU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeChoice {
    /// Its host windows are split at all (not `--no-vms`).
    pub split: bool,
    /// The deep tier runs: each request's push and taking are probed.
    pub deep: bool,
    /// Its interrupts are raised in QEMU, where no kernel event shows them
    /// (no KVM), and its kicks are seen (fentry or kprobes on eventfd
    /// writes): the always-on tier ends its windows at QEMU's interrupt.
    pub interrupts_in_qemu: bool,
}

impl Vm {
    /// The QEMU functions probed in this VM. Always, virtio-blk's
    /// accounting of requests it merged (hit only when it merges). In the
    /// deep tier, those whose hits end its windows (the used-ring push for
    /// virtio disks, the interrupt for NVMe) and QEMU's device models
    /// taking each request (its accounting's start). In the always-on
    /// tier, QEMU's interrupt where no kernel event shows it.
    pub fn uprobe_symbols(&self, c: ProbeChoice) -> Vec<(&'static str, ProbeRole)> {
        let mut v = Vec::new();
        let model = |d: &VDisk, p: &str| d.model.as_deref().is_some_and(|m| m.starts_with(p));
        let virtio = self.disks.iter().any(|d| model(d, "virtio-blk"));
        let nvme = self.disks.iter().any(|d| model(d, "nvme"));
        let (deep, split) = (c.split && c.deep, c.split);
        if deep && virtio {
            v.push(("virtqueue_flush", ProbeRole::Completion));
        }
        if (deep && nvme) || (split && !deep && c.interrupts_in_qemu && (virtio || nvme)) {
            v.push(("msix_notify", ProbeRole::Completion));
        }
        if virtio {
            v.push(("block_acct_merge_done", ProbeRole::Merge));
        }
        if deep && (virtio || nvme) {
            v.push(("block_acct_start", ProbeRole::Taken));
        }
        v
    }
}

impl EngineRef {
    /// Whether its kick pickups and used-ring pushes are followed
    /// (qemu-storage-daemon's libvhost-user); other engines are only
    /// identified, their requests the VM's.
    pub fn followed(&self) -> bool {
        self.comm == STORAGE_DAEMON_COMM
    }

    /// The engine's probes, in the deep tier: its used-ring push ends its
    /// disks' host windows, as QEMU's does.
    pub fn uprobe_symbols(&self, deep: bool) -> Vec<(&'static str, ProbeRole)> {
        if deep && self.followed() {
            vec![("vu_queue_push", ProbeRole::Completion)]
        } else {
            Vec::new()
        }
    }
}
