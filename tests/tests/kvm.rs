//! The KVM kick path on a real KVM virtual machine: a minimal VM
//! (tests/native/kvm_vm.c) whose guest writes a queue's notify address,
//! which KVM signals to an eventfd in the kernel (no write syscall). The
//! host window must start at that MMIO write (kvm:kvm_mmio), matched to
//! the eventfd through QEMU-style KVM_IOEVENTFD registration (root, /dev/kvm).

use std::{path::PathBuf, process::Command};

use agent_integration::{iospan_bin, run};
use serde_json::Value;

/// The helper VM, built into a directory of its own under a name QEMU's
/// processes have (iospan recognises VMs by their command).
fn kvm_vm() -> PathBuf {
    agent_integration::kvm_vm(std::path::Path::new(env!("CARGO_TARGET_TMPDIR")))
}

/// The helper VM run under `iospan run` for `n` requests, with `vm_args`
/// (`{image}`: the image's path) and `envs` for iospan and the VM: its
/// report.
fn traced_vm(name: &str, n: u64, vm_args: &[&str], envs: &[(&str, &std::path::Path)]) -> Value {
    traced_vm_with(name, n, &[], vm_args, envs)
}

/// The same, with `run_args` for `iospan run` (`--deep`).
fn traced_vm_with(
    name: &str,
    n: u64,
    run_args: &[&str],
    vm_args: &[&str],
    envs: &[(&str, &std::path::Path)],
) -> Value {
    assert!(
        std::path::Path::new("/dev/kvm").exists(),
        "this test needs /dev/kvm (the kvm module)"
    );
    let exe = kvm_vm();
    let dir = exe.parent().unwrap();
    let report = dir.join(format!("{name}.json"));
    let image = image(dir).display().to_string();
    let mut cmd = Command::new(iospan_bin());
    cmd.args(["run", "--quiet"])
        .args(run_args)
        .arg("--json-out")
        .arg(&report)
        .arg("--")
        .arg(&exe)
        .args(["-name", "guest=kvm-probe,debug-threads=on"])
        .args(vm_args.iter().map(|a| a.replace("{image}", &image)))
        .env("IOSPAN_KVM_IOS", n.to_string());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = run(&mut cmd);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!("kvm_vm: {n} requests")),
        "{stdout}"
    );
    serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap()
}

fn image(dir: &std::path::Path) -> PathBuf {
    agent_integration::kvm_image(dir)
}

/// The helper VM in the report's `vms`.
fn the_vm(rep: &Value) -> &Value {
    rep["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "kvm-probe")
        .unwrap_or_else(|| panic!("{:#}", rep["vms"]))
}

fn probes(rep: &Value) -> Vec<&str> {
    rep["probes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["tracepoint"].as_str())
        .collect()
}

/// The VM's entry for `disk`: every one of its `n` requests split, the
/// segments tiling the host window, the device segment the request's own
/// block-layer lifetime, and kick to pickup a wake-up, not a request's
/// lifetime (a kick matched to the wrong notification, a previous
/// request's, would put a whole request period there).
fn every_request_split<'a>(rep: &'a Value, disk: &str, n: u64) -> &'a Value {
    let e = rep["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["vm"] == "kvm-probe" && e["disk"] == disk && e["op"] == "read")
        .unwrap_or_else(|| panic!("no kvm-probe/{disk} entry: {rep:#}"));
    // Every request, timed or, its completion never having reached iospan
    // (a softirq completion the kernel ran no program for: see docs/lost.md,
    // "Nothing is lost silently"), counted as undelivered.
    let ios = e["ios"].as_u64().unwrap();
    assert_eq!(ios + e["undelivered"].as_u64().unwrap_or(0), n, "{e}");
    assert!(ios * 100 >= n * 99, "{e}");
    let split = &rep["lost"]["host_split"];
    for k in ["no_kick", "no_signal", "unordered", "not_followed"] {
        assert_eq!(split[k].as_u64(), Some(0), "host_split.{k}: {split}");
    }
    let seg = |k: &str| e["segments"][k].clone();
    let mean = |k: &str| seg(k)["mean_us"].as_f64().unwrap();
    for k in ["hypervisor", "engine", "device", "host_window"] {
        assert_eq!(seg(k)["count"].as_u64(), Some(ios), "{k}: {e}");
    }
    let tiled = mean("hypervisor") + mean("engine") + mean("device");
    assert!(
        (tiled - mean("host_window")).abs() < 0.01,
        "segments {tiled} vs window {}",
        mean("host_window")
    );
    let total = e["total"]["mean_us"].as_f64().unwrap();
    assert!(
        (mean("device") - total).abs() <= 0.01 * total,
        "device {} vs total {total}",
        mean("device")
    );
    assert!(
        mean("hypervisor") > 0.0 && mean("hypervisor") < mean("host_window") / 2.0,
        "{e}"
    );
    e
}

const KVM_DISK: [&str; 4] = [
    "-drive",
    "file={image},if=none,id=kd0,format=raw,cache=none,aio=native",
    "-device",
    "virtio-blk-pci,drive=kd0",
];

/// The always-on tier: the kick is KVM's exit at the notify address
/// (kvm:kvm_mmio), its notifier's engine learnt from the wake-up the kick
/// makes, the pickup that thread's run, the end KVM's interrupt — no
/// system-call tracepoint attached.
#[test]
fn kvm_kicks_start_the_host_window() {
    let n = 400u64;
    let rep = traced_vm("kvm", n, &KVM_DISK, &[]);
    let probes = probes(&rep);
    assert!(
        probes.contains(&"kvm:kvm_mmio") && probes.contains(&"kvm:kvm_msi_set_irq"),
        "{probes:?}"
    );
    assert!(
        !probes.iter().any(|p| p.starts_with("syscalls:")),
        "the always-on tier attached a system-call tracepoint: {probes:?}"
    );
    assert_eq!(rep["tier"], "always-on", "{}", rep["tier"]);
    let vm = the_vm(&rep);
    assert_eq!(vm["kicks"], "kvm-exits", "{vm}");
    every_request_split(&rep, "kd0", n);
}

/// QEMU's NVMe at its default doorbells (no `ioeventfd=on`): the guest's
/// doorbell write exits to user space, where QEMU's vCPU thread schedules
/// the queue's work in its loop — an eventfd write that wakes the engine.
/// Under TCG no kernel event shows such a doorbell; under KVM the exit
/// does (kvm:kvm_mmio, before KVM hands the write to user space), tied to
/// its engine by the wake-up that follows it: split like a virtio kick.
/// The VM creates its KVM VM 300 ms after its exec, as a QEMU whose
/// accelerator comes from its configuration is named before it holds one:
/// found to run on KVM afterwards, its doorbells are followed all the same.
#[test]
fn nvme_doorbells_through_mmio_exits_are_split() {
    let n = 400u64;
    let disk = [
        "-drive",
        "file={image},if=none,id=kn0,format=raw,cache=none,aio=native",
        "-device",
        "nvme,drive=kn0,serial=iospan",
    ];
    let late = [("KVM_VM_CREATE_DELAY_MS", std::path::Path::new("300"))];
    let rep = traced_vm("kvm-nvme", n, &disk, &late);
    assert_eq!(rep["tier"], "always-on", "{}", rep["tier"]);
    let vm = the_vm(&rep);
    assert_eq!(vm["kicks"], "kvm-exits", "{vm}");
    assert_eq!(vm["vdisks"][0]["model"], "nvme", "{vm}");
    every_request_split(&rep, "kn0", n);
}

/// The deep tier: the same VM's kicks on the eventfds QEMU registered
/// (KVM_IOEVENTFD, watched), picked up by the engine's read of the
/// eventfd; its end at virtqueue_flush (the used-ring push).
#[test]
fn kvm_kicks_in_the_deep_tier_come_from_the_registered_notifiers() {
    let n = 400u64;
    let rep = traced_vm_with("kvm-deep", n, &["--deep"], &KVM_DISK, &[]);
    let probes = probes(&rep);
    assert!(
        probes.contains(&"kvm:kvm_mmio") && probes.contains(&"syscalls:sys_enter_ioctl"),
        "{probes:?}"
    );
    assert_eq!(rep["tier"], "deep", "{}", rep["tier"]);
    let vm = the_vm(&rep);
    assert_eq!(vm["kicks"], "queue-notifiers", "{vm}");
    every_request_split(&rep, "kd0", n);
}

/// A vhost-scsi disk served the way the kernel's vhost worker serves it: a
/// thread `vhost-<pid>` of the VM's process woken by the kick's eventfd
/// signal inside the kernel, never reading it, submitting the I/O itself
/// and raising the interrupt through an irqfd (an MSI KVM injects in that
/// thread). Its LUN is found in a configfs tree laid out as LIO's.
#[test]
fn a_kernel_vhost_worker_is_the_engine_of_its_disk() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kvm-vm");
    std::fs::create_dir_all(&dir).unwrap();
    let configfs = dir.join("configfs");
    let _ = std::fs::remove_dir_all(&configfs);
    let wwpn = "naa.5001405c0ffee001";
    let store = configfs.join("target/core/fileio_0/vs0-data");
    let lun = configfs
        .join("target/vhost")
        .join(wwpn)
        .join("tpgt_1/lun/lun_0");
    std::fs::create_dir_all(&store).unwrap();
    std::fs::create_dir_all(&lun).unwrap();
    std::fs::write(store.join("udev_path"), image(&dir).to_str().unwrap()).unwrap();
    std::os::unix::fs::symlink(&store, lun.join("2b1c6a6f0e")).unwrap();

    let n = 400u64;
    // No -drive: QEMU does not open the LUN's backing (the worker reads
    // the image it is given, as the backstore's).
    let image = dir.join("disk.img");
    let _awake = agent_integration::bottlenecks::CpusAwake::start();
    let rep = traced_vm(
        "vhost",
        n,
        &["-device", &format!("vhost-scsi-pci,wwpn={wwpn},id=vs0")],
        &[("IOSPAN_CONFIGFS", &configfs), ("KVM_VM_BACKSTORE", &image)],
    );
    let probes = probes(&rep);
    for p in ["sched_switch", "kvm:kvm_msi_set_irq", "kvm:kvm_mmio"] {
        assert!(probes.contains(&p), "{p}: {probes:?}");
    }
    let vm = the_vm(&rep);
    let engine = vm["engines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["disk"] == "vs0")
        .unwrap_or_else(|| panic!("no engine for vs0: {vm}"));
    let pid = vm["pid"].as_u64().unwrap();
    assert_eq!(engine["program"], format!("vhost-{pid}"), "{engine}");
    assert_eq!(engine["export"], format!("{wwpn}/lun_0"), "{engine}");
    assert!(engine["not_split"].is_null(), "{engine}");
    // The worker's requests are the vhost disk's: the VM's only disk.
    let e = every_request_split(&rep, "vs0", n);
    // The engine segment is the worker's own time: from running after the
    // kick to submitting, and from the completion to its MSI.
    assert!(
        e["segments"]["engine"]["mean_us"].as_f64().unwrap() > 0.0,
        "{e}"
    );
}

/// VMs coming and going: 200 started and stopped in turn under one run.
/// Each exited VM is taken out of the kernel's per-VM tables (128 entries
/// each), so the last is traced as fully as the first, and every one's
/// figures stay in the report.
#[test]
fn the_two_hundredth_vm_of_a_run_is_traced() {
    let (vms, n) = (200u32, 8u64);
    let exe = kvm_vm();
    let dir = exe.parent().unwrap();
    let image = image(dir);
    let report = dir.join("churn.json");
    let script = format!(
        "for i in $(seq 1 {vms}); do \
         {exe} -name guest=churn-$i,debug-threads=on \
         -drive file={img},if=none,id=kd0,format=raw,cache=none,aio=native \
         -device virtio-blk-pci,drive=kd0 >/dev/null || exit 1; done",
        exe = exe.display(),
        img = image.display()
    );
    let out = run(Command::new(iospan_bin())
        .args(["run", "--quiet", "--json-out"])
        .arg(&report)
        .args(["--", "sh", "-c", &script])
        .env("IOSPAN_KVM_IOS", n.to_string()));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rep: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    // Every read of the VM, on its disk or, where the agent had not yet
    // read its command line when the read started (a loaded agent, 200
    // VMs in a row), on its unresolved row "-": the VM is traced either
    // way, which is what a full table would stop.
    let rows = |vm: &str| -> Vec<&Value> {
        rep["entries"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["vm"] == vm && e["op"] == "read")
            .collect()
    };
    // Timed, or issued with a completion the kernel never delivered (the
    // VM's own count, docs/lost.md): every workload read counted, on its
    // disk or on the row of the image's host disk; that row also holds
    // the VM process's other reads there (its binary's or a library's
    // page-ins on a loaded host: churn-128 read 4, churn-200 one), which
    // are the VM's too.
    let count =
        |e: &&Value| e["ios"].as_u64().unwrap_or(0) + e["undelivered"].as_u64().unwrap_or(0);
    for i in [1, 128, 129, vms] {
        let vm = format!("churn-{i}");
        let rows = rows(&vm);
        let on_disk: u64 = rows.iter().filter(|e| e["disk"] == "kd0").map(count).sum();
        let all: u64 = rows.iter().map(count).sum();
        assert!(
            on_disk <= n && all >= n,
            "{vm}'s reads: {on_disk} on kd0, {all} in all, of {n}: {rows:#?}\nlost: {}",
            rep["lost"]
        );
    }
    let named = rep["vms"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["name"].as_str().is_some_and(|s| s.starts_with("churn-")))
        .count();
    assert_eq!(named, vms as usize);
    assert_eq!(
        rep["lost"]["vm_table_full"].as_u64().unwrap_or(0),
        0,
        "{}",
        rep["lost"]
    );
}
