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

impl Vm {
    /// The QEMU functions probed in this VM: with the host-window split,
    /// those whose hits end its windows (the used-ring push for virtio
    /// disks, the interrupt for NVMe) and QEMU's device models taking each
    /// request (its accounting's start); always, virtio-blk's accounting of
    /// requests it merged.
    pub fn uprobe_symbols(&self, split: bool) -> Vec<(&'static str, ProbeRole)> {
        let mut v = Vec::new();
        let model = |d: &VDisk, p: &str| d.model.as_deref().is_some_and(|m| m.starts_with(p));
        let virtio = self.disks.iter().any(|d| model(d, "virtio-blk"));
        let nvme = self.disks.iter().any(|d| model(d, "nvme"));
        if split && virtio {
            v.push(("virtqueue_flush", ProbeRole::Completion));
        }
        if split && nvme {
            v.push(("msix_notify", ProbeRole::Completion));
        }
        if virtio {
            v.push(("block_acct_merge_done", ProbeRole::Merge));
        }
        if split && (virtio || nvme) {
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

    /// The engine's probes: its used-ring push ends its disks' host
    /// windows, as QEMU's does.
    pub fn uprobe_symbols(&self, split: bool) -> Vec<(&'static str, ProbeRole)> {
        if split && self.followed() {
            vec![("vu_queue_push", ProbeRole::Completion)]
        } else {
            Vec::new()
        }
    }
}
