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
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kvm-vm");
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("qemu-system-x86_64");
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/native/kvm_vm.c");
    let out = run(Command::new("cc")
        .args(["-O1", "-rdynamic", "-pthread", "-o"])
        .arg(&exe)
        .arg(src));
    assert!(
        out.status.success(),
        "building {src}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

#[test]
fn kvm_kicks_start_the_host_window() {
    assert!(
        std::path::Path::new("/dev/kvm").exists(),
        "this test needs /dev/kvm (the kvm module)"
    );
    let exe = kvm_vm();
    let dir = exe.parent().unwrap();
    // On a real disk (not tmpfs), fully written, so O_DIRECT reads reach it.
    let image = dir.join("disk.img");
    let chunk: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8)
        .collect();
    std::fs::write(&image, chunk.repeat(16)).unwrap();
    let report = dir.join("report.json");
    let n = 400u64;
    let out = run(Command::new(iospan_bin())
        .args(["run", "--quiet", "--json-out"])
        .arg(&report)
        .arg("--")
        .arg(&exe)
        .args(["-name", "guest=kvm-probe,debug-threads=on", "-drive"])
        .arg(format!(
            "file={},if=none,id=kd0,format=raw,cache=none,aio=native",
            image.display()
        ))
        .args(["-device", "virtio-blk-pci,drive=kd0"])
        .env("IOSPAN_KVM_IOS", n.to_string()));
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

    let rep: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let probes: Vec<&str> = rep["probes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["tracepoint"].as_str())
        .collect();
    assert!(
        probes.contains(&"kvm:kvm_mmio") && probes.contains(&"syscalls:sys_enter_ioctl"),
        "{probes:?}"
    );
    let vm = rep["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "kvm-probe")
        .unwrap_or_else(|| panic!("{:#}", rep["vms"]));
    assert_eq!(vm["kicks"], "queue-notifiers", "{vm}");

    let e = rep["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["vm"] == "kvm-probe" && e["disk"] == "kd0" && e["op"] == "read")
        .unwrap_or_else(|| panic!("no kvm-probe/kd0 entry: {rep:#}"));
    assert_eq!(e["ios"].as_u64(), Some(n), "{e}");
    // Every request split: its kick from the MMIO write, picked up by the
    // engine's read of the registered eventfd; its end at virtqueue_flush (the used-ring push).
    let split = &rep["lost"]["host_split"];
    for k in ["no_kick", "no_signal", "unordered", "not_followed"] {
        assert_eq!(split[k].as_u64(), Some(0), "host_split.{k}: {split}");
    }
    let seg = |k: &str| e["segments"][k].clone();
    let mean = |k: &str| seg(k)["mean_us"].as_f64().unwrap();
    for k in ["hypervisor", "engine", "device", "host_window"] {
        assert_eq!(seg(k)["count"].as_u64(), Some(n), "{k}: {e}");
    }
    let tiled = mean("hypervisor") + mean("engine") + mean("device");
    assert!(
        (tiled - mean("host_window")).abs() < 0.01,
        "segments {tiled} vs window {}",
        mean("host_window")
    );
    // The device segment is the request's own block-layer lifetime.
    let total = e["total"]["mean_us"].as_f64().unwrap();
    assert!(
        (mean("device") - total).abs() <= 0.01 * total,
        "device {} vs total {total}",
        mean("device")
    );
    // Kick to pickup is a wake-up of the engine's loop, not a request's
    // lifetime: a kick matched to the wrong notification (a previous
    // request's) would put a whole request period here.
    assert!(
        mean("hypervisor") > 0.0 && mean("hypervisor") < mean("host_window") / 2.0,
        "{e}"
    );
}
