//! The always-on tier (`iospan run` without `--deep`) around a rig boot per
//! disk model and engine: where it cannot split a TCG guest (no kick to
//! see), its count of the virtual disk is still exactly the guest's, and
//! QEMU's own count beside it agrees.

use std::process::Command;

use agent_integration::{host_disk_of, iospan_bin, rig_and_image, run_guest, Reports};
use serde_json::Value;
use xtask::guest::{self, Aio, DiskModel, RigResult, RunArgs};

/// One boot of `a` under the always-on tier: its report and what the guest
/// counted.
fn always_on_boot(a: &RunArgs) -> (Value, RigResult) {
    let (rig, image) = rig_and_image();
    let host = host_disk_of(&image);
    let daemon = (a.disk == DiskModel::VhostUser)
        .then(|| guest::storage_daemon(a, &image).unwrap_or_else(|e| panic!("{e:#}")));
    let (qemu, guest_dev) = guest::qemu_command(&rig, a, &image);
    let kept = Reports::in_temp(&[format!(
        "iospan-always-on-{}-{:?}-{:?}-qd{}{}.json",
        std::process::id(),
        a.disk,
        a.aio,
        a.qd,
        if a.iothread { "-iothread" } else { "" },
    )]);
    let mut cmd = Command::new(iospan_bin());
    cmd.args(["run", "--quiet", "--disk", &host, "--json-out"])
        .arg(kept.path(0))
        .arg("--")
        .arg(qemu.get_program())
        .args(qemu.get_args());
    let (console, secs) = run_guest(&mut cmd);
    drop(daemon);
    let r = guest::parse(&console, a, guest_dev, secs).unwrap_or_else(|e| panic!("{e:#}"));
    let rep: Value = serde_json::from_slice(&std::fs::read(kept.path(0)).unwrap()).unwrap();
    (rep, r)
}

/// The guest's requests, every one on its virtual disk (timed, undelivered
/// or merged into another on the way), none of QEMU's own; QEMU's count
/// (the daemon's for vhost-user) the guest's, and no mismatch said.
fn counts_hold(a: RunArgs) {
    let (rep, r) = always_on_boot(&a);
    assert_eq!(rep["tier"], "always-on", "{rep:#}");
    assert_eq!(r.workload["ios"].as_u64(), Some(a.ios), "{r:#?}");
    assert_eq!(r.workload["errors"].as_u64(), Some(0), "{r:#?}");
    // Every case's one disk is vd0 (RunArgs' default).
    let (vm, summary) = (
        super::vd0_reads(&rep, &a.name),
        super::vm_summary(&rep, &a.name),
    );
    let n = |v: &Value, k: &str| v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v:#}"));
    let (ios, undelivered) = (n(&vm, "ios"), n(&vm, "undelivered"));
    let merged = n(&summary, "engine_merged") + n(&summary, "host_merged");
    let ctx = format!(
        "entry {vm:#}\nVM {summary:#}\nlost {:#}\nguest {r:#?}",
        rep["lost"]
    );
    // A device with no queue notifiers (NVMe's default doorbells) gives no
    // sign of stopping: QEMU's closing probe (512 B + 4 KiB) stays on it.
    let closing = if a.disk == DiskModel::Nvme && !a.ioeventfd {
        2
    } else {
        0
    };
    let ours = ios + undelivered + merged;
    assert!(
        ours >= r.guest_reads && ours <= r.guest_reads + closing,
        "ours {ours} (timed {ios} + undelivered {undelivered} + merged {merged}) vs the guest's {}: {ctx}",
        r.guest_reads
    );
    let q = &vm["qemu"];
    let ops = q["ops"]
        .as_u64()
        .unwrap_or_else(|| panic!("no QEMU count beside the entry: {ctx}"));
    if a.disk == DiskModel::VhostUser {
        // The daemon's export keeps no count: said so, never a mismatch.
        assert_eq!(q["counted_by"], "engine", "{q:#}");
        assert!(ops == 0 || ops == r.guest_reads, "{q:#}\n{ctx}");
    } else {
        assert_eq!(
            ops, r.guest_reads,
            "QEMU's count vs the guest's: {q:#}\n{ctx}"
        );
        assert_eq!(q["iospan_ops"].as_u64(), Some(ios + undelivered), "{q:#}");
    }
    assert_eq!(q["mismatch"], false, "{q:#}\n{ctx}");
    assert_eq!(rep["lost"]["qemu_mismatch"], 0, "{ctx}");
    assert_eq!(rep["lost"]["ringbuf_drops"], 0, "{ctx}");
}

macro_rules! always_on_case {
    ($name:ident, $disk:ident, $aio:ident, $qd:expr $(, $field:ident: $value:expr)*) => {
        #[test]
        fn $name() {
            counts_hold(RunArgs {
                disk: DiskModel::$disk,
                aio: Aio::$aio,
                qd: $qd,
                ios: 1000,
                no_guest_agent: true,
                $($field: $value,)*
                ..Default::default()
            });
        }
    };
}

// QEMU's start-up reads come from its main thread (io_uring, native) or a
// pool worker (threads) before the guest runs; the guest's from a vCPU
// (TCG serves the device in the vCPU's exit), a worker or an iothread.
always_on_case!(always_on_virtio_blk_io_uring_qd1, VirtioBlk, IoUring, 1);
always_on_case!(always_on_virtio_blk_native_qd16, VirtioBlk, Native, 16);
always_on_case!(always_on_virtio_blk_threads_qd1, VirtioBlk, Threads, 1);
always_on_case!(always_on_virtio_blk_threads_qd16, VirtioBlk, Threads, 16);
always_on_case!(always_on_virtio_blk_threads_iothread_qd16, VirtioBlk, Threads, 16, iothread: true);
always_on_case!(always_on_virtio_blk_io_uring_two_queues_qd16, VirtioBlk, IoUring, 16, cpus: 2);
always_on_case!(always_on_nvme_io_uring_qd1, Nvme, IoUring, 1);
always_on_case!(always_on_nvme_ioeventfd_native_qd16, Nvme, Native, 16, ioeventfd: true);
always_on_case!(always_on_vhost_user_io_uring_qd16, VhostUser, IoUring, 16);
