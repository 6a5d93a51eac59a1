//! Which QEMU and engine functions are probed for a VM, and which of them
//! are hit per request.

use super::*;

impl Vm {
    /// The QEMU functions probed in this VM, each with whether it is hit
    /// per request (hot): with the host-window split, those whose hits end
    /// its windows (the used-ring push for virtio disks, the interrupt for
    /// NVMe); always, virtio-blk's accounting of requests it merged, hit
    /// only when it merges.
    pub fn uprobe_symbols(&self, split: bool) -> Vec<(&'static str, bool)> {
        let mut v = Vec::new();
        let model = |d: &VDisk, p: &str| d.model.as_deref().is_some_and(|m| m.starts_with(p));
        let virtio = self.disks.iter().any(|d| model(d, "virtio-blk"));
        if split && virtio {
            v.push(("virtqueue_flush", true));
        }
        if split && self.disks.iter().any(|d| model(d, "nvme")) {
            v.push(("msix_notify", true));
        }
        if virtio {
            v.push(("block_acct_merge_done", false));
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
    pub fn uprobe_symbols(&self, split: bool) -> Vec<(&'static str, bool)> {
        if split && self.followed() {
            vec![("vu_queue_push", true)]
        } else {
            Vec::new()
        }
    }
}
