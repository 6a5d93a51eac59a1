//! `iospan verify` on a live host: a rig guest started inside the window
//! (its QMP monitor on the command line, as hosts give one), checked
//! against QEMU's own accounting; and a VM with no monitor said so.

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use agent_integration::{iospan_bin, rig_and_image, run};
use xtask::guest::{self, RunArgs};

#[test]
fn verify_passes_a_guest_against_qemus_own_count() {
    let (rig, image) = rig_and_image();
    let a = RunArgs {
        qd: 4,
        ios: 2000,
        name: "verify-rig".into(),
        no_guest_agent: true,
        ..Default::default()
    };
    let report = std::env::temp_dir().join(format!("iospan-verify-{}.json", std::process::id()));
    let verify = Command::new(iospan_bin())
        .args(["verify", "--vm", "verify-rig", "--duration", "45s", "--json-out"])
        .arg(&report)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The guest inside the window: booted after the probes are attached.
    std::thread::sleep(Duration::from_secs(3));
    let (mut qemu, dev) = guest::qemu_command(&rig, &a, &image);
    let t = Instant::now();
    let out = run(&mut qemu);
    let console: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    let r = guest::parse(&console, &a, dev, t.elapsed().as_secs_f64()).unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(40),
        "the guest outlived the window"
    );
    let out = verify.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = text
        .lines()
        .find(|l| l.starts_with("verify-rig"))
        .unwrap_or_else(|| panic!("no line for the VM: {text}"));
    assert!(line.contains(" ok"), "{text}");
    assert!(text.contains("PASS: 1 VM disk entry"), "{text}");
    // Its count is the guest's own.
    let rep: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let e = rep["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["vm"] == "verify-rig" && e["op"] == "read")
        .unwrap_or_else(|| panic!("{rep:#}"));
    assert_eq!(e["qemu"]["ops"].as_u64(), Some(r.guest_reads), "{e:#}");
}

#[test]
fn a_vm_without_a_monitor_is_said_so_and_fails_verify() {
    let (rig, image) = rig_and_image();
    let a = RunArgs {
        qd: 1,
        ios: 200,
        name: "verify-nomon".into(),
        no_guest_agent: true,
        ..Default::default()
    };
    let verify = Command::new(iospan_bin())
        .args(["verify", "--vm", "verify-nomon", "--duration", "30s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let (qemu, _) = guest::qemu_command(&rig, &a, &image);
    // The same guest without its QMP monitor.
    let args: Vec<String> = qemu
        .get_args()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    let mut stripped = Vec::new();
    let mut i = 0;
    while i < args.len() {
        if args[i] == "-qmp" {
            i += 2;
            continue;
        }
        stripped.push(args[i].clone());
        i += 1;
    }
    let out = run(Command::new(qemu.get_program()).args(&stripped));
    assert!(out.status.success());
    let out = verify.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("verify-nomon: QEMU's own counts: none: no QMP monitor"),
        "{text}"
    );
    assert!(text.contains("FAIL: no VM disk"), "{text}");
}
