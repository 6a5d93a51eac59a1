//! QEMU as distributions install it: RHEL's and Fedora's
//! `/usr/libexec/qemu-kvm`, Proxmox's `/usr/bin/kvm`. Debian's binary, run
//! under those names (its comm is then `qemu-kvm` or `kvm`), booting the
//! rig: a VM with its virtual disk, split like any other (root).

use std::process::Command;

use agent_integration::{host_disk_of, iospan_bin, rig_and_image, run_guest};
use serde_json::Value;
use xtask::guest::{self, RunArgs};

fn as_program(name: &str, vm: &str, bare_name: bool) {
    let (rig, image) = rig_and_image();
    let host = host_disk_of(&image);
    let a = RunArgs {
        qd: 1,
        ios: 500,
        name: vm.into(),
        no_guest_agent: true,
        ..Default::default()
    };
    let (qemu, guest_dev) = guest::qemu_command(&rig, &a, &image);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let real = which("qemu-system-x86_64");
    let program = dir.join(name);
    std::os::unix::fs::symlink(&real, &program).unwrap();
    let mut args: Vec<String> = qemu
        .get_args()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    if bare_name {
        // Proxmox's form: `-name NAME,debug-threads=on`, no `guest=`.
        let i = args.iter().position(|a| a == "-name").unwrap();
        args[i + 1] = format!("{vm},debug-threads=on");
    }
    let report = dir.join("report.json");
    let (console, secs) = run_guest(
        Command::new(iospan_bin())
            .args(["run", "--quiet", "--disk", &host])
            .args(agent_integration::rig_split_args())
            .arg("--json-out")
            .arg(&report)
            .arg("--")
            .arg(&program)
            .args(&args),
    );
    let r = guest::parse(&console, &a, guest_dev, secs).unwrap_or_else(|e| panic!("{e:#}"));
    let rep: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let vms = rep["vms"].as_array().unwrap();
    assert_eq!(vms.len(), 1, "{:#}", rep["vms"]);
    assert_eq!(vms[0]["name"], vm, "{}", vms[0]);
    assert_eq!(vms[0]["disks"][0], "vd0", "{}", vms[0]);
    let e = rep["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["vm"] == vm && e["disk"] == "vd0" && e["op"] == "read")
        .unwrap_or_else(|| panic!("no vd0 reads of {vm}: {rep:#}"));
    let n = |v: &Value, k: &str| v[k].as_u64().unwrap();
    let merged = n(&vms[0], "engine_merged") + n(&vms[0], "host_merged");
    assert_eq!(
        n(e, "ios") + n(e, "undelivered") + merged,
        r.guest_reads,
        "{e}\n{}",
        vms[0]
    );
    let w = &e["segments"]["host_window"];
    assert!(
        n(w, "count") + merged + n(e, "undelivered") >= r.guest_reads,
        "split {w}"
    );
    for k in ["hypervisor", "engine", "device"] {
        assert_eq!(e["segments"][k]["count"], w["count"], "{k}: {e}");
    }
}

fn which(tool: &str) -> std::path::PathBuf {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join(tool))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("{tool} not on PATH"))
}

#[test]
fn debian_qemu_run_as_rhel_qemu_kvm_is_a_vm_with_its_disk() {
    as_program("qemu-kvm", "as-qemu-kvm", false);
}

#[test]
fn debian_qemu_run_as_proxmox_kvm_is_a_vm_with_its_disk() {
    as_program("kvm", "as-pve-kvm", true);
}
