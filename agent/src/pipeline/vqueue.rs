//! Which guest queue a VM's request came through, host-side: the notifier
//! its kick came by names it (`VmIoEvent::queue`, `VQ_*`), and the virtual
//! disk's device model says how a notifier maps to an index.
//!
//! - A KVM ioeventfd with a datamatch waits for the virtqueue's index
//!   (virtio's legacy and PIO notify): the index itself, less virtio-scsi's
//!   control and event queues. So does one of virtio's page-per-vq notify
//!   pages, numbered from the page below it.
//! - One on an address: the address's offset in its page, notify regions
//!   and doorbells being page-aligned. virtio-pci spaces its queues' notify
//!   addresses 4 bytes apart (QEMU's default `page-per-vq=off`), and
//!   virtio-scsi's request queues follow its control and event queues;
//!   NVMe's submission doorbells are 8 bytes apart from the admin queue's.
//! - No address (QEMU's user-space ioeventfds under TCG): the notifier's
//!   order of creation in its VM. A device's queue notifiers are made
//!   together, in index order, so the index is the order less that of the
//!   disk's first notifier, which is known once its queue 0 kicked: until
//!   then the lowest seen stands for it (see [`QueueIndex::rebased`]).

use crate::abi::{VQ_ADDR_PAGE, VQ_BY_ADDR, VQ_BY_INDEX, VQ_BY_ORDER, VQ_VALUE_MASK};

/// How a virtual disk's notifiers are laid out, by its device model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// virtio-blk, vhost-user-blk, a bare `-drive` (virtio's notify
    /// stride, queue 0 first).
    Virtio,
    /// A disk behind virtio-scsi: its request queues start at the third.
    VirtioScsi,
    /// NVMe: submission queue doorbells, I/O queue 1 the guest's first.
    Nvme,
}

impl Layout {
    /// By QEMU's device model name.
    pub fn of_model(model: Option<&str>) -> Self {
        match model {
            Some(m) if m.starts_with("nvme") => Self::Nvme,
            Some(m) if m.starts_with("scsi-") => Self::VirtioScsi,
            _ => Self::Virtio,
        }
    }
}

/// What a notifier says of a request's queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueIndex {
    /// The guest's queue index.
    Known(u32),
    /// The notifier's order of creation in its VM (no address to go by).
    Order(u16),
    /// A notifier learnt from a KVM exit at offset 0 of its page: its page
    /// number. Queue 0 where the disk's other notifiers are offsets within
    /// a page; with a page per queue (virtio's `page-per-vq`), counted from
    /// the disk's lowest page.
    Page(u16),
    /// None: no kick, a notifier that is no submission queue's (an NVMe
    /// completion doorbell), or one iospan did not see registered.
    Unknown,
}

impl QueueIndex {
    pub fn of(hint: u16, layout: Layout) -> Self {
        let value = u32::from(hint & VQ_VALUE_MASK);
        match hint & !VQ_VALUE_MASK {
            VQ_BY_INDEX => match layout {
                Layout::VirtioScsi => value.checked_sub(2).map_or(Self::Unknown, Self::Known),
                Layout::Virtio | Layout::Nvme => Self::Known(value),
            },
            VQ_BY_ADDR if value & u32::from(VQ_ADDR_PAGE) != 0 => {
                Self::Page((value & u32::from(VQ_ADDR_PAGE - 1)) as u16)
            }
            VQ_BY_ADDR => match layout {
                Layout::Virtio => Self::Known(value / 4),
                Layout::VirtioScsi => (value / 4)
                    .checked_sub(2)
                    .map_or(Self::Unknown, Self::Known),
                // Submission doorbells only (a completion doorbell's offset
                // is 4 past one); the admin queue's is at offset 0.
                Layout::Nvme if value % 8 == 0 => (value / 8)
                    .checked_sub(1)
                    .map_or(Self::Unknown, Self::Known),
                Layout::Nvme => Self::Unknown,
            },
            VQ_BY_ORDER => Self::Order(value as u16),
            _ => Self::Unknown,
        }
    }

    /// An order-named queue's index against the disk's first notifier
    /// (`base`: the lowest order seen carrying the disk's requests).
    pub fn rebased(self, base: u16) -> Option<u32> {
        match self {
            Self::Known(i) => Some(i),
            Self::Order(o) | Self::Page(o) => o.checked_sub(base).map(u32::from),
            Self::Unknown => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_index_is_the_virtqueues() {
        assert_eq!(
            QueueIndex::of(VQ_BY_INDEX | 3, Layout::Virtio),
            QueueIndex::Known(3)
        );
        // virtio-scsi's request queues follow its control and event queues.
        assert_eq!(
            QueueIndex::of(VQ_BY_INDEX | 3, Layout::VirtioScsi),
            QueueIndex::Known(1)
        );
        assert_eq!(
            QueueIndex::of(VQ_BY_INDEX | 1, Layout::VirtioScsi),
            QueueIndex::Unknown
        );
    }

    #[test]
    fn addresses_follow_the_device_model() {
        // virtio-pci: notify_off_multiplier 4.
        assert_eq!(
            QueueIndex::of(VQ_BY_ADDR | 0x00c, Layout::Virtio),
            QueueIndex::Known(3)
        );
        // virtio-scsi: control, event, then request queue 0.
        assert_eq!(
            QueueIndex::of(VQ_BY_ADDR | 0x008, Layout::VirtioScsi),
            QueueIndex::Known(0)
        );
        assert_eq!(
            QueueIndex::of(VQ_BY_ADDR | 0x004, Layout::VirtioScsi),
            QueueIndex::Unknown
        );
        // NVMe: SQ y tail doorbell at 0x1000 + 8y; I/O queue 1 is the
        // guest's first, a CQ head doorbell (4 past) is no submission.
        assert_eq!(
            QueueIndex::of(VQ_BY_ADDR | 0x008, Layout::Nvme),
            QueueIndex::Known(0)
        );
        assert_eq!(
            QueueIndex::of(VQ_BY_ADDR | 0x018, Layout::Nvme),
            QueueIndex::Known(2)
        );
        assert_eq!(
            QueueIndex::of(VQ_BY_ADDR | 0x00c, Layout::Nvme),
            QueueIndex::Unknown
        );
        assert_eq!(
            QueueIndex::of(VQ_BY_ADDR, Layout::Nvme),
            QueueIndex::Unknown
        );
    }

    #[test]
    fn an_order_counts_from_the_disks_first_notifier() {
        let q = QueueIndex::of(VQ_BY_ORDER | 7, Layout::Virtio);
        assert_eq!(q, QueueIndex::Order(7));
        assert_eq!(q.rebased(6), Some(1));
        assert_eq!(q.rebased(8), None);
        assert_eq!(QueueIndex::of(0, Layout::Virtio), QueueIndex::Unknown);
    }

    #[test]
    fn models_name_layouts() {
        assert_eq!(Layout::of_model(Some("nvme")), Layout::Nvme);
        assert_eq!(Layout::of_model(Some("scsi-hd")), Layout::VirtioScsi);
        assert_eq!(Layout::of_model(Some("vhost-user-blk-pci")), Layout::Virtio);
        assert_eq!(Layout::of_model(None), Layout::Virtio);
    }
}
