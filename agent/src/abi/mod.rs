//! The records and map layouts shared with the eBPF programs. The records
//! are generated from `bpf/include/agent_abi.h` (`generated.rs`, written by
//! `cargo xtask abi`; the suite's `abi` test fails when the header changed
//! without it); the constants are typed here for their users.
//!
//! The agent-integration test `abi_layout` also compiles the header
//! natively and compares every size and offset with the C compiler's; the
//! const asserts catch the rest at build time.

use std::mem::size_of;

use zerocopy::FromBytes;

mod generated;

pub use generated::{
    BlkIoEvent, BlkStats, DiskSlot, DoneEnt, DoneRing, FileKey, GuestIoEvent, GuestReapEvent,
    RqCompletion, RqOutcome, RqSlot, TierState, VdiskKey, VmCounts, VmDevKey, VmIoEvent, VmKey,
    VmProc, VmPushesEvent, VmSignalEvent, VmSplitEvent, VmSplitKey, VmSplitStats, VmUnsplit,
};

pub const HIST_SUB_BITS: u32 = 3;
pub const HIST_SUB: u32 = 1 << HIST_SUB_BITS;
pub const HIST_MAX_LOG2: u32 = 38;
pub const HIST_BUCKETS: usize = ((HIST_MAX_LOG2 - HIST_SUB_BITS + 2) * HIST_SUB) as usize;

pub const BLK_NR_OPS: usize = 5;
pub const BLK_NR_SEGS: usize = 3;
pub const DEFAULT_MAX_DISKS: u32 = 32;
pub const MAX_STREAM_DEVS: usize = 16;
pub const RQ_SLOTS: u32 = 1 << 15;

pub const RQ_F_REQUEUE_PENDING: u16 = 1 << 0;
pub const RQ_F_PARTIAL: u8 = 1 << 1;
pub const RQ_F_REQUEUED: u8 = 1 << 2;
pub const RQ_F_NO_START: u8 = 1 << 3;
pub const RQ_F_NO_ISSUE: u8 = 1 << 4;
pub const RQ_F_ERROR: u8 = 1 << 5;
pub const RQ_F_DONE: u16 = 1 << 6;
/// A VM's request its engine found by polling its queue: no kick of its own.
pub const RQ_F_POLLED: u8 = 1 << 7;

/// How a VM request's `queue` names its guest queue (`VQ_*` in the header).
pub const VQ_HOW_SHIFT: u16 = 14;
pub const VQ_VALUE_MASK: u16 = (1 << VQ_HOW_SHIFT) - 1;
pub const VQ_BY_INDEX: u16 = 1 << VQ_HOW_SHIFT;
pub const VQ_BY_ADDR: u16 = 2 << VQ_HOW_SHIFT;
pub const VQ_BY_ORDER: u16 = 3 << VQ_HOW_SHIFT;
/// With `VQ_BY_ADDR`: a notifier at offset 0 of its page, learnt from a
/// KVM exit; the value is its page number's low bits.
pub const VQ_ADDR_PAGE: u16 = 1 << 13;

pub const EVENT_BLK_IO: u16 = 1;
pub const EVENT_VM_IO: u16 = 2;
pub const EVENT_VM_SIGNAL: u16 = 3;
pub const EVENT_GUEST_IO: u16 = 4;
pub const EVENT_GUEST_REAP: u16 = 5;
pub const EVENT_VM_PUSHES: u16 = 6;
pub const EVENT_VM_SPLIT: u16 = 7;
/// Used-ring pushes per `VmPushesEvent`.
pub const PUSH_BATCH: usize = 8;

pub const GUEST_F_NO_KICK: u8 = 1 << 0;
pub const GUEST_F_NO_IRQ: u8 = 1 << 1;
pub const GUEST_F_NVME: u8 = 1 << 2;
pub const GUEST_F_SYSCALL: u8 = 1 << 3;
pub const GUEST_F_SYNC: u8 = 1 << 4;
pub const GUEST_F_STACKED: u8 = 1 << 5;
pub const GUEST_F_REAPED: u8 = 1 << 6;
pub const GUEST_REAP_SYNC: u8 = 1 << 0;

/// Indices of the per-CPU array `counters` (enum counter).
pub mod counter {
    pub const RINGBUF_DROPS: u32 = 0;
    pub const DISK_CONFLICTS: u32 = 1;
    pub const SLOT_CONFLICTS: u32 = 2;
    pub const NO_START: u32 = 3;
    pub const NO_ISSUE: u32 = 4;
    pub const PARTIAL_PIECES: u32 = 5;
    pub const REQUEUES: u32 = 6;
    pub const SAMPLED: u32 = 7;
    pub const VM_TABLE_FULL: u32 = 8;
    pub const GUEST_RING_LOST: u32 = 9;
    pub const GUEST_INFLIGHT_FULL: u32 = 10;
    pub const UNDELIVERED: u32 = 11;
    pub const JOIN_DEFERRED: u32 = 12;
    pub const NESTED_WAKING: u32 = 13;
    pub const NESTED_WAKEUP: u32 = 14;
    pub const ACTING_FULL: u32 = 15;
    pub const NR: u32 = 16;
}

/// The always-on tier's segments of a VM request's host window
/// (`enum vm_segment`), in `VmSplitStats`' order.
pub const VM_NR_SEGS: usize = 5;
pub mod vm_seg {
    pub const HYPERVISOR: usize = 0;
    pub const ENGINE: usize = 1;
    pub const DEVICE: usize = 2;
    pub const WINDOW: usize = 3;
    pub const PICKUP_TO_DONE: usize = 4;
}

/// How long a completed VM request waits for its signal (ns).
pub const SIGNAL_HOLD_NS: u64 = 50_000_000;

/// Completions waiting for their VM's interrupt, per VM (`vm_done`).
pub const DONE_RING: usize = 256;
pub const DONE_ENT_SIZE: usize = 72;

/// `vm_flags` bits, per VM slot.
pub const VMF_STREAM_ALL: u32 = 1 << 0;
pub const VMF_VHOST: u32 = 1 << 1;
pub const VMF_VHOST_SIGNAL: u32 = 1 << 2;

/// Why a joined request was streamed (`VmSplitEvent::sampled_by`).
pub const SAMPLED_ALL: u32 = 1 << 0;
pub const SAMPLED_SLOW: u32 = 1 << 1;
pub const SAMPLED_ONE_IN: u32 = 1 << 2;

/// `vm_counts` is an array by VM slot modulo this.
pub const MAX_VM_COUNTS: u32 = 1024;
/// How far the agent moves `vm_gen` (the kernel side moves it by one).
pub const VM_GEN_AGENT_STEP: u32 = 1000;

pub const VM_PROC_STARTING: u32 = 0;
pub const VM_PROC_RUNNING: u32 = 1;
pub const VM_PROC_STOPPED: u32 = 2;

impl VmCounts {
    /// Another share added (a CPU's, a retired entry's).
    pub fn add(&mut self, o: &VmCounts) {
        self.engine_merges += o.engine_merges;
        self.bio_merges += o.bio_merges;
        self.submitted += o.submitted;
        self.raises += o.raises;
        self.vcpu_waits += o.vcpu_waits;
        self.vcpu_wait_ns += o.vcpu_wait_ns;
    }
}

/// The direct-I/O completion functions (enum dio_kind), in order.
pub const DIO_END_IO: [&str; NR_DIO_END_IO] = [
    "iomap_dio_bio_end_io",
    "blkdev_bio_end_io_async",
    "blkdev_bio_end_io",
    "submit_bio_wait_endio",
    "clone_endio",
];
pub const NR_DIO_END_IO: usize = 5;

/// `vdisk_files` key for a block device: dev = this, ino = its dev_t.
pub const VDISK_FILE_BDEV: u32 = u32::MAX;

/// `vm_disks` value: several of the VM's disks share the host disk.
pub const VDISK_SEVERAL: u32 = u32::MAX;

const _: () = assert!(size_of::<BlkIoEvent>() == 56);
const _: () = assert!(size_of::<RqSlot>() == 80);
const _: () = assert!(size_of::<VmIoEvent>() == 80);
const _: () = assert!(size_of::<VmSignalEvent>() == 48);
const _: () = assert!(size_of::<VmPushesEvent>() == 104);
const _: () = assert!(size_of::<VmKey>() == 16);
const _: () = assert!(size_of::<FileKey>() == 16);
const _: () = assert!(size_of::<VmCounts>() == 48);
const _: () = assert!(size_of::<VmProc>() == 8);
const _: () = assert!(size_of::<VmDevKey>() == 8);
const _: () = assert!(size_of::<DiskSlot>() == 16);
const _: () = assert!(size_of::<VmSplitKey>() == 16);
const _: () =
    assert!(size_of::<VmSplitStats>() == 8 * (2 + 2 * VM_NR_SEGS + VM_NR_SEGS * HIST_BUCKETS));
const _: () = assert!(size_of::<VdiskKey>() == 8);
const _: () = assert!(size_of::<DoneRing>() == 24 + DONE_ENT_SIZE * DONE_RING);
const _: () = assert!(size_of::<VmUnsplit>() == 32);
const _: () = assert!(size_of::<TierState>() == 24);
const _: () = assert!(size_of::<VmSplitEvent>() == 96);
const _: () =
    assert!(size_of::<BlkStats>() == 8 * (6 + 2 * BLK_NR_SEGS + BLK_NR_SEGS * HIST_BUCKETS));

// SAFETY: plain-old-data, `repr(C)`, no padding the kernel could leave
// uninitialised that we would read as anything but integers.
unsafe impl aya::Pod for BlkStats {}
unsafe impl aya::Pod for DiskSlot {}
unsafe impl aya::Pod for RqSlot {}
unsafe impl aya::Pod for BlkIoEvent {}
unsafe impl aya::Pod for VmKey {}
unsafe impl aya::Pod for FileKey {}
unsafe impl aya::Pod for VmCounts {}
unsafe impl aya::Pod for VmProc {}
unsafe impl aya::Pod for VmDevKey {}
unsafe impl aya::Pod for VmIoEvent {}
unsafe impl aya::Pod for VmSignalEvent {}
unsafe impl aya::Pod for VmPushesEvent {}
unsafe impl aya::Pod for VmSplitKey {}
unsafe impl aya::Pod for VmSplitStats {}
unsafe impl aya::Pod for VdiskKey {}
unsafe impl aya::Pod for DoneRing {}
unsafe impl aya::Pod for VmUnsplit {}
unsafe impl aya::Pod for TierState {}
unsafe impl aya::Pod for VmSplitEvent {}

impl VmPushesEvent {
    /// Its pushes (at most `PUSH_BATCH`, whatever `n` says).
    pub fn pushes(&self) -> &[u64] {
        &self.ts[..usize::from(self.n).min(PUSH_BATCH)]
    }
}

/// One ring-buffer record, by its leading kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Record {
    BlkIo(BlkIoEvent),
    VmIo(VmIoEvent),
    VmSignal(VmSignalEvent),
    VmPushes(VmPushesEvent),
    VmSplit(VmSplitEvent),
    GuestIo(GuestIoEvent),
    GuestReap(GuestReapEvent),
}

const _: () = assert!(size_of::<GuestIoEvent>() == 88);

const _: () = assert!(size_of::<GuestReapEvent>() == 16);

impl GuestIoEvent {
    pub const SIZE: usize = size_of::<Self>();
}

impl Record {
    /// `None` for a record whose kind is unknown or whose length does not
    /// match its kind (the caller counts those).
    pub fn from_bytes(buf: &[u8]) -> Option<Self> {
        // Any length but the record's own is refused; any alignment taken.
        fn read<T: FromBytes>(buf: &[u8]) -> Option<T> {
            T::read_from_bytes(buf).ok()
        }
        let kind = u16::from_ne_bytes([*buf.first()?, *buf.get(1)?]);
        match kind {
            EVENT_BLK_IO => read(buf).map(Record::BlkIo),
            EVENT_VM_IO => read(buf).map(Record::VmIo),
            EVENT_VM_SIGNAL => read(buf).map(Record::VmSignal),
            EVENT_VM_PUSHES => read(buf).map(Record::VmPushes),
            EVENT_VM_SPLIT => read(buf).map(Record::VmSplit),
            EVENT_GUEST_IO => read(buf).map(Record::GuestIo),
            EVENT_GUEST_REAP => read(buf).map(Record::GuestReap),
            _ => None,
        }
    }
}

/// The virtio-serial port the guest agent writes to: the name by which both
/// agents, and the host's discovery of a VM's channel, know it.
pub const PORT_NAME: &str = "org.iospan.0";
