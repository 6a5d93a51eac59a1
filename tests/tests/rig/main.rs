//! The guest rig (a real guest kernel under QEMU) traced from the host:
//! the guest's exact counts, and the host's block window inside the
//! guest-observed latency (root).
//!
//! One binary, its tests by subject: `boot` (a traced boot per disk model,
//! engine and aio mode), `always_on` (the default tier's exact counts),
//! `lifecycle` (lost completions, VMs coming and going), `segments` (a
//! delay put in one place shows in its segment), `channel` (the guest
//! channel across restarts and reboots).

use std::process::Command;

use agent_integration::{iospan_bin, run_around, Reports};
use serde_json::Value;

mod always_on;
mod boot;
mod channel;
mod diagnosis;
mod lifecycle;
mod segments;

/// `iospan run` around one rig boot (a report under `tag`): the guest's
/// console, iospan's JSON report, and its file, kept if the test fails.
fn traced_run(qemu: &Command, host: &str, tag: &str) -> (Vec<String>, Value, Reports) {
    let kept = Reports::in_temp(&[format!("iospan-{tag}-{}.json", std::process::id())]);
    let report = kept.path(0);
    let out = run_around(
        Command::new(iospan_bin())
            .args(["run", "--quiet", "--disk", host])
            .args(agent_integration::rig_split_args())
            .arg("--json-out")
            .arg(report),
        qemu,
    );
    let console = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    let rep = serde_json::from_slice(&std::fs::read(report).unwrap()).unwrap();
    (console, rep, kept)
}

/// The report's entry for the VM's reads on its virtual disk vd0.
fn vd0_reads(rep: &Value, vm: &str) -> Value {
    rep["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["vm"] == vm && e["disk"] == "vd0" && e["op"] == "read")
        .cloned()
        .unwrap_or_else(|| panic!("no entry for VM {vm}: {rep:#}"))
}

/// The VM's summary in the report (its merges, undelivered completions,
/// engines).
fn vm_summary(rep: &Value, vm: &str) -> Value {
    rep["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == vm)
        .cloned()
        .unwrap_or_else(|| panic!("no VM {vm} in {:#}", rep["vms"]))
}

/// The VM's guest channel, as the report has it.
fn guest_channel(rep: &Value, vm: &str) -> Value {
    rep["guests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["vm"] == vm)
        .map(|g| g["channel"].clone())
        .unwrap_or_else(|| panic!("no guest agent heard from: {:#}", rep["guests"]))
}

/// The BPF links a process holds open: one per attached probe.
fn bpf_links(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy() == "anon_inode:bpf_link")
        })
        .count()
}
