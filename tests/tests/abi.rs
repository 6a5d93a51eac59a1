//! The records shared by the eBPF programs and the agent must not drift:
//! every size and offset the C compiler chose equals Rust's.

use std::mem::{offset_of, size_of};

use agent_integration::{c_consts, c_hist_bucket, c_layout, RqCompletion, RqOutcome};
use iospan::{
    abi::{
        self, BlkIoEvent, BlkStats, DiskSlot, DoneRing, FileKey, GuestIoEvent, GuestReapEvent,
        RqSlot, TierState, VdiskKey, VmDevKey, VmIoEvent, VmKey, VmProc, VmPushesEvent,
        VmSignalEvent, VmSplitEvent, VmSplitKey, VmSplitStats, VmUnsplit,
    },
    model::hist,
};

macro_rules! rust_layout {
    ($($cname:literal => $ty:ty { $($field:ident),* })*) => {{
        let mut v: Vec<(String, usize, usize)> = Vec::new();
        $(
            v.push(($cname.to_string(), 0, size_of::<$ty>()));
            $(
                let size = {
                    let probe = std::mem::MaybeUninit::<$ty>::uninit();
                    // SAFETY: only the field's address is taken, never read.
                    let p = unsafe { std::ptr::addr_of!((*probe.as_ptr()).$field) };
                    fn size_of_pointee<T>(_: *const T) -> usize { size_of::<T>() }
                    size_of_pointee(p)
                };
                v.push((format!("{}.{}", $cname, stringify!($field)), offset_of!($ty, $field), size));
            )*
        )*
        v
    }};
}

#[test]
fn abi_layout() {
    let rust = rust_layout! {
        "blk_io_event" => BlkIoEvent { kind, op, flags, dev, start_ns, issue_ns, done_ns, sector, bytes, requeues, cpu_lo, vdisk, vm }
        "rq_slot" => RqSlot { rq, start_ns, issue_ns, done_bytes, requeues, flags, vm, vdisk, kick_ns, pick_ns, pos, dev, op, queue, hv_wait_ns, eng_wait_ns }
        "disk_slot" => DiskSlot { queue, dev }
        "vm_key" => VmKey { vm, dev, op, vdisk }
        "file_key" => FileKey { dev, ino }
        "vm_dev_key" => VmDevKey { vm, dev }
        "vm_io_event" => VmIoEvent { kind, op, flags, dev, kick_ns, pick_ns, start_ns, issue_ns, done_ns, bytes, vm, vdisk, queue, pos, hv_wait_ns, eng_wait_ns }
        "vm_signal_event" => VmSignalEvent { kind, vm, ts_ns, wait_start, wait_end }
        "vm_pushes_event" => VmPushesEvent { kind, n, vm, ts, wait_start, wait_end }
        "vm_proc" => VmProc { slot, state }
        "vm_split_key" => VmSplitKey { vm, vdisk, dev, op, queue }
        "vm_split_stats" => VmSplitStats { count, bytes, sum_ns, max_ns, hist }
        "done_ring" => DoneRing { head, tail, vm, _pad, ent }
        "vdisk_key" => VdiskKey { vm, vdisk }
        "vm_unsplit" => VmUnsplit { no_kick, no_signal, polled, unordered }
        "tier_state" => TierState { deep, handoff, one_in, pick_at_read, slower_than_ns }
        "vm_split_event" => VmSplitEvent { io, signal_ns, sampled_by, _pad }
        "blk_stats" => BlkStats { busy, ios, bytes, errors, requeued, partial, sum_ns, max_ns, hist }
        "rq_completion" => RqCompletion { rq, kstart_ns, kissue_ns, now_ns, remaining, nr_bytes }
        "rq_outcome" => RqOutcome { start_ns, issue_ns, bytes, requeues, flags, vm, vdisk, kick_ns, pick_ns, pos, queue, hv_wait_ns, eng_wait_ns }
        "guest_io_event" => GuestIoEvent { kind, op, flags, dev, sector, start_ns, issue_ns, kick_ns, irq_ns, done_ns, bytes, queue, sys_ns, reap_ns, tgid, tid }
        "guest_reap_event" => GuestReapEvent { kind, flags, id, ts_ns }
    };
    let c = c_layout();
    assert_eq!(
        c.len(),
        rust.len(),
        "the C table and the Rust table list different fields"
    );
    for (c, r) in c.iter().zip(&rust) {
        assert_eq!(
            c, r,
            "layout drift (name, offset, size): C {c:?} vs Rust {r:?}"
        );
    }
}

#[test]
fn abi_constants() {
    let c = c_consts();
    assert_eq!(c.hist_buckets as usize, abi::HIST_BUCKETS);
    assert_eq!(c.nr_ops as usize, abi::BLK_NR_OPS);
    assert_eq!(c.nr_segs as usize, abi::BLK_NR_SEGS);
    assert_eq!(c.default_max_disks, abi::DEFAULT_MAX_DISKS);
    assert_eq!(c.rq_slots, abi::RQ_SLOTS);
    assert_eq!(c.done_ring as usize, abi::DONE_RING);
    assert_eq!(c.done_ent_size as usize, abi::DONE_ENT_SIZE);
    assert_eq!(c.event_vm_split as u16, abi::EVENT_VM_SPLIT);
    assert_eq!(c.signal_hold_ns, abi::SIGNAL_HOLD_NS);
    assert_eq!(c.f_partial, abi::RQ_F_PARTIAL as u32);
    assert_eq!(c.f_requeued, abi::RQ_F_REQUEUED as u32);
    assert_eq!(c.f_no_start, abi::RQ_F_NO_START as u32);
    assert_eq!(c.f_no_issue, abi::RQ_F_NO_ISSUE as u32);
    assert_eq!(c.f_error, abi::RQ_F_ERROR as u32);
    assert_eq!(c.f_done, abi::RQ_F_DONE as u32);
    assert_eq!(c.f_requeue_pending, abi::RQ_F_REQUEUE_PENDING as u32);
    assert_eq!(c.nr_counters, abi::counter::NR);
    assert_eq!(c.event_blk_io, abi::EVENT_BLK_IO as u32);
    assert_eq!(c.vdisk_several, abi::VDISK_SEVERAL);
    assert_eq!(c.event_vm_io, abi::EVENT_VM_IO as u32);
    assert_eq!(c.event_vm_signal, abi::EVENT_VM_SIGNAL as u32);
    assert_eq!(c.nr_dio_end_io as usize, abi::NR_DIO_END_IO);
    assert_eq!(c.vdisk_file_bdev, abi::VDISK_FILE_BDEV);
    assert_eq!(c.vq_by_index, u32::from(abi::VQ_BY_INDEX));
    assert_eq!(c.vq_by_addr, u32::from(abi::VQ_BY_ADDR));
    assert_eq!(c.vq_by_order, u32::from(abi::VQ_BY_ORDER));
    assert_eq!(c.vq_value_mask, u32::from(abi::VQ_VALUE_MASK));
    assert_eq!(c.event_vm_pushes, u32::from(abi::EVENT_VM_PUSHES));
    assert_eq!(c.push_batch as usize, abi::PUSH_BATCH);
}

/// Histogram buckets: the kernel's `hist_bucket` and the agent's
/// `bucket_of` agree on every power of two, its neighbours, and a sweep.
#[test]
fn hist_buckets() {
    let mut values: Vec<u64> = (0..4096).collect();
    for e in 0..64 {
        let p = 1u64 << e;
        values.extend([p - 1, p, p + 1, p + p / 3, p.saturating_mul(3) / 2]);
    }
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for _ in 0..100_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        values.push(x >> (x % 40));
    }
    values.push(u64::MAX);
    for v in values {
        assert_eq!(c_hist_bucket(v), hist::bucket_of(v), "bucket of {v}");
        let (lo, hi) = hist::bucket_bounds(hist::bucket_of(v));
        assert!(
            v >= lo && (v < hi || hist::bucket_of(v) == abi::HIST_BUCKETS - 1),
            "{v} outside [{lo}, {hi})"
        );
    }
}

/// The records' Rust side is what bindgen makes of the header today: a
/// header changed without `cargo xtask abi` fails here.
#[test]
fn the_rust_records_are_generated_from_the_header() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let kept = std::fs::read_to_string(root.join(xtask::abi::GENERATED)).unwrap();
    let now = xtask::abi::generate().unwrap_or_else(|e| panic!("{e:#}"));
    assert!(
        kept == now,
        "{} differs from what bpf/include/agent_abi.h gives: run `cargo xtask abi`",
        xtask::abi::GENERATED
    );
}

/// The check above can fail: a field renamed in a record of a copy of the
/// headers gives other Rust, with the new name in it.
#[test]
fn a_header_changed_alone_is_a_drift() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let copy = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(root.join("bpf/include")).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), copy.path().join(e.file_name())).unwrap();
        }
    }
    let header = copy.path().join("agent_abi.h");
    let text = std::fs::read_to_string(&header).unwrap();
    let changed = text.replacen(
        "struct vm_proc {\n\t__u32 slot;",
        "struct vm_proc {\n\t__u32 drifted;",
        1,
    );
    assert_ne!(
        changed, text,
        "struct vm_proc's first field moved: update this test"
    );
    std::fs::write(&header, changed).unwrap();
    let drifted = xtask::abi::generate_from(copy.path()).unwrap_or_else(|e| panic!("{e:#}"));
    let kept = std::fs::read_to_string(root.join(xtask::abi::GENERATED)).unwrap();
    assert_ne!(drifted, kept);
    assert!(drifted.contains("pub drifted: __u32,"), "{drifted}");
}
