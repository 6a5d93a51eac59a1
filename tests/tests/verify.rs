//! `iospan verify` on a live host: a rig guest started inside the window
//! (its QMP monitor on the command line, as hosts give one), checked
//! against QEMU's own accounting; and a VM with no monitor said so.

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use agent_integration::{iospan_bin, rig_and_image, run, Reap, RunStderr};
use xtask::guest::{self, RunArgs};

/// `iospan verify` around a rig guest started inside its window: a pass,
/// and QEMU's count of the VM's reads equal to iospan's (its first request,
/// the firmware's where it reads, included). Returns QEMU's count and the
/// guest kernel's own.
fn verify_passes(a: RunArgs) -> (u64, u64) {
    let (rig, image) = rig_and_image();
    let tmp = tempfile::tempdir().unwrap();
    let report = tmp.path().join(format!("verify-{}.json", a.name));
    let mut verify = Command::new(iospan_bin())
        .args(["verify", "--vm", &a.name, "--duration", "45s", "--json-out"])
        .arg(&report)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The guest inside the window: booted after the probes are attached.
    let mut stderr = RunStderr::of(&mut verify);
    stderr.attached(Duration::from_secs(60));
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
    let exited = Instant::now();
    let out = verify.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", stderr.finish());
    // The window ends with the VM it was asked about, not 45 s in.
    assert!(
        exited.elapsed() < Duration::from_secs(10),
        "verify ended {:?} after its VM exited",
        exited.elapsed()
    );
    let line = text
        .lines()
        .find(|l| l.starts_with(a.name.as_str()))
        .unwrap_or_else(|| panic!("no line for the VM: {text}"));
    assert!(line.contains(" ok"), "{text}");
    assert!(text.contains("PASS: 1 VM disk entry"), "{text}");
    // Its count is the guest's own.
    let rep: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let e = rep["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["vm"] == a.name.as_str() && e["op"] == "read")
        .unwrap_or_else(|| panic!("{rep:#}"));
    let qemu_ops = e["qemu"]["ops"].as_u64().unwrap_or_else(|| panic!("{e:#}"));
    // iospan's count is QEMU's; the requests whose completion never
    // reached the probes (now and then on this kernel) are counted, not
    // timed, and named in `lost`.
    assert_eq!(e["qemu"]["iospan_ops"].as_u64(), Some(qemu_ops), "{e:#}");
    let timed = e["ios"].as_u64().unwrap_or_else(|| panic!("{e:#}"));
    let named = ["undelivered", "unseen"]
        .iter()
        .map(|k| rep["lost"][k].as_u64().unwrap_or(0))
        .sum::<u64>();
    assert!(
        timed <= qemu_ops && qemu_ops - timed <= named,
        "{timed} timed of {qemu_ops}, {named} named lost: {e:#}\n{}",
        rep["lost"]
    );
    (qemu_ops, r.guest_reads)
}

fn verify_rig(name: &str) -> RunArgs {
    RunArgs {
        qd: 4,
        ios: 2000,
        name: name.into(),
        no_guest_agent: true,
        ..Default::default()
    }
}

#[test]
fn verify_passes_a_guest_against_qemus_own_count() {
    let (qemu, guest) = verify_passes(verify_rig("verify-rig"));
    // qboot reads no disk: QEMU's count is the guest kernel's own.
    assert_eq!(qemu, guest);
}

/// A guest booted through SeaBIOS, whose first read is its firmware's,
/// made before the agent could name the VM: counted as the VM's.
#[test]
fn verify_counts_a_fresh_vms_first_request() {
    let (qemu, guest) = verify_passes(RunArgs {
        seabios: true,
        ..verify_rig("verify-seabios")
    });
    assert!(
        qemu > guest,
        "QEMU counted {qemu}, the guest {guest}: no firmware read"
    );
}

/// The same on the newer QEMU release, unpacked beside the installed one.
#[test]
fn qemu_10_0_verify_passes() {
    let q = xtask::qemu_release::unpacked("10.0").unwrap_or_else(|e| panic!("{e:#}"));
    let (qemu, guest) = verify_passes(RunArgs {
        qemu: Some(q.binary),
        qemu_data: Some(q.data),
        ..verify_rig("verify-qemu10")
    });
    assert_eq!(qemu, guest);
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
    let mut verify = Command::new(iospan_bin())
        .args(["verify", "--vm", "verify-nomon", "--duration", "30s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    RunStderr::of(&mut verify).attached(Duration::from_secs(60));
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

/// An API run on the agent service around a VM that runs before it starts
/// and after it stops (its I/O crossing both edges, as a benchmark's
/// does): `/api/v1/runs/N/stop` puts QEMU's own count beside the VM disk's,
/// read with the run's first and last figures.
/// An `iospan agent` on `host`'s disk, answering: the process, its
/// address and its API token.
fn agent(dir: &std::path::Path, host: &str) -> (Reap, String, String) {
    let addr = format!("127.0.0.1:{}", xtask::backends::free_port().unwrap());
    let (conf, token_file) = agent_integration::agent_config(dir, host, &addr);
    let agent = Reap(
        Command::new(iospan_bin())
            .args(["agent", "--config"])
            .arg(&conf)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let t = Instant::now();
    while xtask::backends::http_get(&addr, "/healthz", &[]).map_or(0, |r| r.0) != 200 {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the agent never became healthy"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let token = std::fs::read_to_string(&token_file).unwrap();
    (agent, addr, token.trim().to_string())
}

/// POST to an agent's API with its token: the answer's JSON.
fn post(addr: &str, token: &str, path: &str) -> serde_json::Value {
    let (status, text) = xtask::backends::http_post(addr, path, Some(token))
        .unwrap_or_else(|e| panic!("POST {path}: {e:#}"));
    assert!((200..300).contains(&status), "POST {path}: {status} {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

#[test]
fn an_api_run_carries_qemus_own_count() {
    let (rig, image) = rig_and_image();
    let host = agent_integration::host_disk_of(&image);
    let tmp = tempfile::tempdir().unwrap();
    let (_agent, addr, token) = agent(tmp.path(), &host);
    let post = |path: &str| post(&addr, &token, path);
    // A guest reading for long enough to hold the run inside its workload.
    let a = RunArgs {
        qd: 4,
        ios: 400_000,
        name: "api-rig".into(),
        no_guest_agent: true,
        ..Default::default()
    };
    let (mut qemu, _) = guest::qemu_command(&rig, &a, &image);
    let _vm = Reap(
        qemu.stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // Running and reading: its disk shows in the agent's figures.
    let t = Instant::now();
    loop {
        let snap = xtask::backends::http_get(&addr, "/api/v1/snapshot", &[])
            .map_or_else(|_| String::new(), |r| r.1);
        if snap.contains("api-rig") && snap.contains("\"ios\"") {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(90),
            "the guest never read: {snap}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    std::thread::sleep(Duration::from_secs(1));
    let id = post(&format!(
        "/api/v1/runs?label=qemu{}",
        agent_integration::rig_split_query()
    ))["id"]
        .as_u64()
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let run = post(&format!("/api/v1/runs/{id}/stop"));
    let report = &run["report"];
    let said = report["qemu_counts"]["api-rig"]
        .as_str()
        .unwrap_or_else(|| panic!("{report:#}"));
    assert!(said.starts_with("QMP at"), "{said}");
    let e = report["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["vm"] == "api-rig" && e["op"] == "read")
        .unwrap_or_else(|| panic!("no entry for the VM: {report:#}"));
    let q = &e["qemu"];
    let ops = q["ops"]
        .as_u64()
        .unwrap_or_else(|| panic!("no QEMU count: {e:#}"));
    eprintln!("the API run's check: {q}");
    assert!(ops > 100, "{q:#}");
    assert_eq!(q["mismatch"], false, "{q:#}");
    // Busy at both edges: the two counts differ by no more than the
    // requests in flight at them and those merged on the way.
    let allowed = q["edge_allowance"].as_i64().unwrap() + q["merged_allowance"].as_i64().unwrap();
    assert!(q["diff"].as_i64().unwrap().abs() <= allowed, "{q:#}");
    assert_eq!(
        q["iospan_ops"].as_u64(),
        Some(e["ios"].as_u64().unwrap() + e["undelivered"].as_u64().unwrap())
    );
}

/// The agent names what limits a disk as it runs: a guest behind QEMU's
/// throttle, diagnosed in the API's frames (`diagnoses`), in `/metrics`
/// (`iospan_diagnosis_info`) and in an API run's report.
#[test]
fn the_agent_names_a_throttled_disk_in_its_frames_metrics_and_runs() {
    let (rig, image) = rig_and_image();
    let host = agent_integration::host_disk_of(&image);
    let tmp = tempfile::tempdir().unwrap();
    let (_agent, addr, token) = agent(tmp.path(), &host);
    let a = RunArgs {
        qd: 4,
        ios: 400_000,
        name: "api-diag".into(),
        no_guest_agent: true,
        throttle_iops: Some(200),
        ..Default::default()
    };
    let (mut qemu, _) = guest::qemu_command(&rig, &a, &image);
    let _vm = Reap(
        qemu.stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // The host window split as the rig's kernel allows.
    let id = post(
        &addr,
        &token,
        &format!(
            "/api/v1/runs?label=diag{}",
            agent_integration::rig_split_query()
        ),
    )["id"]
        .as_u64()
        .unwrap();
    let throttled = |d: &serde_json::Value| {
        d["vm"] == "api-diag" && d["op"] == "read" && d["diagnosis"]["cause"] == "throttle"
    };
    let t = Instant::now();
    let named = loop {
        let snap = xtask::backends::http_get(&addr, "/api/v1/snapshot", &[])
            .map_or_else(|_| String::new(), |r| r.1);
        let v: serde_json::Value = serde_json::from_str(&snap).unwrap_or_default();
        if let Some(d) = v["diagnoses"]
            .as_array()
            .and_then(|ds| ds.iter().find(|d| throttled(d)))
        {
            break d.clone();
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "no frame named the throttle: {:#}",
            v["diagnoses"]
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    let dg = &named["diagnosis"];
    assert_eq!(dg["segment"], "engine", "{dg:#}");
    assert!(
        dg["knob"]["now"]
            .as_str()
            .unwrap_or("")
            .contains("throttling.iops-total=200"),
        "{dg:#}"
    );
    let (_, metrics) = xtask::backends::http_get(&addr, "/metrics", &[]).unwrap();
    let info = metrics
        .lines()
        .find(|l| l.starts_with("iospan_diagnosis_info{") && l.contains("vm=\"api-diag\""))
        .unwrap_or_else(|| panic!("no diagnosis of api-diag in /metrics"));
    for label in ["op=\"read\"", "segment=\"engine\"", "cause=\"throttle\""] {
        assert!(info.contains(label), "{label} not in {info}");
    }
    assert!(info.ends_with(" 1"), "{info}");
    let run = post(&addr, &token, &format!("/api/v1/runs/{id}/stop"));
    let e = run["report"]["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["vm"] == "api-diag" && e["op"] == "read")
        .cloned()
        .unwrap_or_else(|| panic!("no entry for the VM: {run:#}"));
    assert_eq!(e["diagnosis"]["cause"], "throttle", "{e:#}");
}
