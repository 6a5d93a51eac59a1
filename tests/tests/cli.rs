//! The `iospan` binary as users meet it: doctor, errors that name the cause
//! and the fix, the JSON contract, the per-request stream (root).

use std::{path::Path, process::Command, time::Instant};

use agent_integration::{iospan_bin, run};
use iospan::cmd::scratch::ScratchLoop;
use serde_json::Value;

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn doctor_tries_each_program_type_and_names_what_is_missing() {
    let out = run(Command::new(iospan_bin()).args(["doctor", "--json"]));
    assert!(out.status.success(), "{}", stderr(&out));
    let d: Value = serde_json::from_slice(&out.stdout).unwrap();
    let probe = |name: &str| {
        d["probes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["probe"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("{name} not probed: {d:#}"))
    };
    // What this kernel has and lacks (see the brief: no kprobe PMU, fentry EPERM).
    for ok in ["tp_btf", "raw_tp", "tracepoint", "uprobe"] {
        assert_eq!(probe(ok)["works"], true, "{ok}: {}", probe(ok));
    }
    for missing in ["kprobe", "fentry"] {
        let p = probe(missing);
        assert_eq!(p["works"], false, "{missing}: {p}");
        assert!(
            p["reason"].as_str().is_some_and(|r| !r.is_empty()),
            "{missing} has no reason: {p}"
        );
    }
    let seg = |name: &str| {
        d["segments"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["segment"] == name)
            .cloned()
            .unwrap()
    };
    assert_eq!(seg("device")["measurable"], "yes");
    assert_eq!(seg("guest")["measurable"], "no");
    assert!(
        seg("hypervisor")["how"]
            .as_str()
            .unwrap()
            .contains("kprobe"),
        "{}",
        seg("hypervisor")
    );

    // No vhost module on this kernel: said, with why.
    let vhost = d["paths"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["path"] == "vhost-scsi")
        .unwrap_or_else(|| panic!("no vhost-scsi path: {d:#}"));
    assert_eq!(vhost["measurable"], "no", "{vhost}");
    assert!(
        vhost["how"]
            .as_str()
            .is_some_and(|h| h.contains("no vhost_scsi")),
        "{vhost}"
    );

    // What a uprobe hit costs here, measured on probes of iospan itself:
    // single-stepping an instruction costs more than emulating a push.
    let costs = d["uprobe_costs"]
        .as_array()
        .unwrap_or_else(|| panic!("{d:#}"));
    let cost = |k: &str| {
        costs
            .iter()
            .find(|c| c["prologue"].as_str().unwrap().starts_with(k))
            .unwrap()["ns_per_hit"]
            .as_f64()
            .unwrap()
    };
    assert!(
        cost("push") > 0.0 && cost("single") > cost("push"),
        "{costs:?}"
    );

    let text = run(Command::new(iospan_bin()).arg("doctor"));
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("kprobe") && text.contains("segments this host can measure"),
        "{text}"
    );
}

#[test]
fn unknown_disk_is_named_with_the_choices() {
    let out =
        run(Command::new(iospan_bin()).args(["run", "--disk", "nosuchdisk0", "--duration", "1s"]));
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains("nosuchdisk0") && e.contains("block devices here"),
        "{e}"
    );
}

#[test]
fn missing_command_is_named() {
    let out = run(Command::new(iospan_bin()).args(["run", "--", "no-such-benchmark-tool", "-x"]));
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains("no-such-benchmark-tool") && e.contains("not found"),
        "{e}"
    );
}

#[test]
fn without_privileges_it_says_which_and_how() {
    // Root with an empty capability bounding set has no CAP_BPF/CAP_PERFMON.
    let out = run(Command::new("setpriv")
        .args(["--bounding-set=-all", "--inh-caps=-all"])
        .arg(iospan_bin())
        .args(["run", "--duration", "1s"]));
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(e.contains("CAP_BPF") && e.contains("hint"), "{e}");
}

#[test]
fn sampling_without_an_output_is_refused() {
    let out = run(Command::new(iospan_bin()).args(["run", "--sample", "10", "--duration", "1s"]));
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--events-out"), "{}", stderr(&out));
}

#[test]
fn duration_bounds_a_run_and_progress_is_shown() {
    let t = Instant::now();
    let out = run(Command::new(iospan_bin()).args(["run", "--duration", "1500ms"]));
    assert!(out.status.success(), "{}", stderr(&out));
    let secs = t.elapsed().as_secs_f64();
    assert!((1.4..10.0).contains(&secs), "took {secs} s");
    assert!(
        stderr(&out).contains("I/Os"),
        "no progress line: {}",
        stderr(&out)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("SEGMENT"),
        "no table"
    );
}

#[test]
fn the_commands_exit_status_is_the_runs() {
    let out = run(Command::new(iospan_bin()).args(["run", "--quiet", "--", "sh", "-c", "exit 7"]));
    assert_eq!(out.status.code(), Some(7));
}

#[test]
fn json_report_and_per_request_stream_agree() {
    let dev = ScratchLoop::create(Path::new("/dev/shm"), 64).unwrap();
    let dir_held = tempfile::Builder::new()
        .prefix("iospan-cli-")
        .tempdir()
        .unwrap();
    let dir = dir_held.path().to_path_buf();
    let (report, events) = (dir.join("r.json"), dir.join("ev.jsonl"));
    let out = run(Command::new(iospan_bin())
        .args([
            "run",
            "--quiet",
            "--disk",
            &dev.name,
            "--sample",
            "10",
            "--json-out",
        ])
        .arg(&report)
        .arg("--events-out")
        .arg(&events)
        .args([
            "--",
            "fio",
            "--name=s",
            "--ioengine=psync",
            "--direct=1",
            "--bs=4k",
            "--rw=randrw",
            "--number_ios=4000",
            "--size=32M",
            "--output=/dev/null",
        ])
        .arg(format!("--filename={}", dev.dev_path())));
    assert!(out.status.success(), "{}", stderr(&out));
    let r: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    check_run_report(&r);
    check_request_stream(&r, &events, &dev.name);
}

/// The report: its schema, BTF probes where they take it, every request
/// counted, every statistic of every entry.
fn check_run_report(r: &Value) {
    assert_eq!(r["schema"], "iospan.run/v1");
    assert!(r["duration_s"].as_f64().unwrap() > 0.0);
    assert!(
        r["probes"]
            .as_array()
            .unwrap()
            .iter()
            // Block and scheduler probes take BTF; syscall and kvm
            // tracepoints (VM notifications) are plain tracepoints.
            .all(|p| {
                let tp = p["tracepoint"].as_str().unwrap_or("");
                let plain = tp.starts_with("syscalls:") || tp.starts_with("kvm:");
                p["flavour"] == if plain { "tracepoint" } else { "tp_btf" }
            }),
        "{}",
        r["probes"]
    );
    let ios: u64 = r["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["ios"].as_u64().unwrap())
        .sum();
    assert_eq!(
        ios + r["lost"]["unseen"].as_u64().unwrap(),
        4000,
        "{}",
        r["lost"]
    );
    for e in r["entries"].as_array().unwrap() {
        for k in ["mean_us", "p50_us", "p90_us", "p99_us", "p999_us", "max_us"] {
            assert!(
                e["total"][k].is_number()
                    && e["segments"]["queue"][k].is_number()
                    && e["segments"]["service"][k].is_number(),
                "{k} in {e}"
            );
        }
        for k in ["iops", "mb_per_s", "bytes"] {
            assert!(e[k].is_number(), "{k} in {e}");
        }
    }
}

/// The per-request stream: every streamed record written, one in ten, each
/// tiled by its queue and service time.
fn check_request_stream(r: &Value, events: &Path, disk: &str) {
    let lines: Vec<Value> = std::fs::read_to_string(events)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let streamed = r["lost"]["records_streamed"].as_u64().unwrap();
    assert_eq!(
        lines.len() as u64,
        streamed,
        "every streamed record written"
    );
    // 1 in 10, at random: well inside 5%..15% of 4000.
    assert!(
        (200..=600).contains(&lines.len()),
        "{} sampled of 4000",
        lines.len()
    );
    for ev in &lines {
        assert_eq!(ev["disk"], disk);
        assert_eq!(ev["bytes"], 4096);
        let (t, q, s) = (
            ev["total_us"].as_f64().unwrap(),
            ev["queue_us"].as_f64().unwrap(),
            ev["service_us"].as_f64().unwrap(),
        );
        assert!((q + s - t).abs() < 0.01, "{ev}");
        assert!(ev["sector"].as_u64().unwrap() < 32 * 2048);
    }
}

#[test]
fn slower_than_streams_only_slow_requests() {
    let dev = ScratchLoop::create(Path::new("/dev/shm"), 64).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let events = tmp.path().join("slow.jsonl");
    let out = run(Command::new(iospan_bin())
        .args([
            "run",
            "--quiet",
            "--disk",
            &dev.name,
            "--slower-than",
            "20us",
            "--events-out",
        ])
        .arg(&events)
        .args([
            "--",
            "fio",
            "--name=s",
            "--ioengine=io_uring",
            "--direct=1",
            "--bs=4k",
            "--rw=randread",
            "--iodepth=16",
            "--number_ios=4000",
            "--size=32M",
            "--output=/dev/null",
        ])
        .arg(format!("--filename={}", dev.dev_path())));
    assert!(out.status.success(), "{}", stderr(&out));
    let lines: Vec<Value> = std::fs::read_to_string(&events)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(!lines.is_empty(), "at QD16 some requests take over 20 µs");
    assert!(lines.len() < 4000);
    for ev in &lines {
        assert!(ev["total_us"].as_f64().unwrap() >= 20.0, "{ev}");
    }
}

#[test]
fn demo_traces_fio_on_a_scratch_disk_and_prints_the_table() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("demo.json");
    let out = run(Command::new(iospan_bin())
        .args(["demo", "--json-out"])
        .arg(&json));
    assert!(out.status.success(), "{}", stderr(&out));
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("SEGMENT") && table.contains("service"),
        "{table}"
    );
    let r: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let entries = r["entries"].as_array().unwrap();
    let ops: Vec<&str> = entries.iter().map(|e| e["op"].as_str().unwrap()).collect();
    assert_eq!(ops, ["read", "write"], "the demo's 70/30 mix: {entries:#?}");
    for e in entries {
        assert!(e["ios"].as_u64().unwrap() > 1000, "{e}");
        assert!(table.contains(e["disk"].as_str().unwrap()));
    }
    // The scratch disk is gone afterwards.
    let disk = entries[0]["disk"].as_str().unwrap();
    let backing =
        std::fs::read_to_string(format!("/sys/block/{disk}/loop/backing_file")).unwrap_or_default();
    assert!(
        !backing.contains("iospan-scratch"),
        "{disk} still attached to {backing}"
    );
}

#[test]
fn more_disks_than_slots_are_counted_not_mixed() {
    // Two scratch disks, one disk slot: the second disk's requests must be
    // counted as conflicts, never added to the first disk's numbers.
    let a = ScratchLoop::create(Path::new("/dev/shm"), 32).unwrap();
    let b = ScratchLoop::create(Path::new("/dev/shm"), 32).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let report = tmp.path().join("slots.json");
    let script = format!(
        "dd if={} of=/dev/null bs=4k count=500 iflag=direct status=none && dd if={} of=/dev/null bs=4k count=300 iflag=direct status=none",
        a.dev_path(),
        b.dev_path()
    );
    let out = run(Command::new(iospan_bin())
        .args([
            "run",
            "--quiet",
            "--no-vms",
            "--max-disks",
            "1",
            "--disk",
            &a.name,
            "--disk",
            &b.name,
            "--json-out",
        ])
        .arg(&report)
        .args(["--", "sh", "-c", &script]));
    assert!(out.status.success(), "{}", stderr(&out));
    let r: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let entries = r["entries"].as_array().unwrap();
    let ios_of = |d: &str| {
        entries
            .iter()
            .filter(|e| e["disk"] == d)
            .map(|e| e["ios"].as_u64().unwrap())
            .sum::<u64>()
    };
    let (ta, tb) = (ios_of(&a.name), ios_of(&b.name));
    let conflicts = r["lost"]["disk_conflicts"].as_u64().unwrap();
    // Whichever disk took the slot first (perhaps another disk of this
    // machine), every other disk's requests are conflicts: a disk's count is
    // all of its requests or none, and nothing is unaccounted for.
    assert!(ta == 0 || ta == 500, "{entries:#?}");
    assert!(tb == 0 || tb == 300, "{entries:#?}");
    assert!(ta == 0 || tb == 0, "both disks in one slot: {entries:#?}");
    assert!(
        ta + tb + conflicts >= 800,
        "traced {ta}+{tb}, conflicts {conflicts}"
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("disk table conflicts"),
        "the table says so"
    );
}

/// A vhost-user disk served by a process that is not qemu-storage-daemon
/// (an SPDK vhost target, say): the process listening on the disk's socket
/// is named as its engine, and the disk as not split, saying why. Here the
/// server is this test process, and the VM a process named as QEMU's with
/// QEMU's arguments.
#[test]
fn doctor_names_the_process_listening_on_a_vhost_user_socket() {
    let dir_held = tempfile::Builder::new()
        .prefix("iospan-vu-engine-")
        .tempdir()
        .unwrap();
    let dir = dir_held.path().to_path_buf();
    let sock = dir.join("vhost.0");
    let _server = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    // A shell script's process takes the script's name: QEMU's, to iospan.
    let qemu = dir.join("qemu-system-x86_64");
    // (Not ending in the sleep: a shell may exec its last command.)
    std::fs::write(&qemu, "#!/bin/sh\nsleep 30\n:\n").unwrap();
    std::fs::set_permissions(&qemu, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut vm = Command::new(&qemu)
        .args(["-name", "guest=spdk-vm", "-chardev"])
        .arg(format!("socket,id=c0,path={}", sock.display()))
        .args(["-device", "vhost-user-blk-pci,chardev=c0,id=vu0"])
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));
    let json = run(Command::new(iospan_bin()).args(["doctor", "--json"]));
    let text = run(Command::new(iospan_bin()).arg("doctor"));
    let _ = vm.kill();
    let _ = vm.wait();
    let d: Value = serde_json::from_slice(&json.stdout).unwrap();
    let v = d["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "spdk-vm")
        .unwrap_or_else(|| panic!("{:#}", d["vms"]));
    let engine = &v["disks"][0]["engine"];
    assert_eq!(
        engine["pid"].as_u64(),
        Some(u64::from(std::process::id())),
        "{v}"
    );
    assert_eq!(engine["export"].as_str(), sock.to_str(), "{v}");
    let text = String::from_utf8_lossy(&text.stdout);
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("vu0 "))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        line.contains(&format!("(pid {}, {})", std::process::id(), sock.display()))
            && line.contains("not split: its engine is not qemu-storage-daemon"),
        "{line}"
    );
}

/// `iospan floor` (the bench's floor arm) mirrors the hooks of a run's
/// report in their flavours, says what it cannot mirror, and counts its
/// programs' runs; a report it cannot use is named with the fix.
#[test]
fn floor_mirrors_a_reports_hooks_and_counts_their_runs() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("floor");
    std::fs::create_dir_all(&dir).unwrap();
    let (like, out) = (dir.join("like.json"), dir.join("floor.json"));
    std::fs::write(
        &like,
        serde_json::json!({ "probes": [
            { "tracepoint": "block_rq_complete", "flavour": "tp_btf", "program": "block_rq_complete_btf" },
            { "tracepoint": "sched_switch", "flavour": "raw_tp", "program": "sched_switch" },
            { "tracepoint": "sched_waking", "flavour": "tp_btf", "program": "sched_waking_nested_btf" },
            { "tracepoint": "/usr/bin/qemu-system-x86_64:virtqueue_flush", "flavour": "uprobe", "program": "virtqueue_flush" },
        ]})
        .to_string(),
    )
    .unwrap();
    let bad = run(Command::new(iospan_bin())
        .args(["floor", "--like", "/nonexistent.json", "--json-out"])
        .arg(&out));
    assert!(!bad.status.success());
    assert!(
        stderr(&bad).contains("--like /nonexistent.json"),
        "{}",
        stderr(&bad)
    );

    let _stats = xtask::bench::BpfStats::enable().unwrap();
    let mut c = Command::new(iospan_bin())
        .args(["floor", "--like"])
        .arg(&like)
        .arg("--json-out")
        .arg(&out)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(c.stderr.take().unwrap());
    let mut said = String::new();
    while !said.contains("not mirrored") {
        let mut line = String::new();
        assert!(
            std::io::BufRead::read_line(&mut err, &mut line).unwrap() > 0,
            "{said}"
        );
        said += &line;
    }
    // Switches happen on their own; a sleep is one more.
    std::thread::sleep(std::time::Duration::from_millis(200));
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(c.id() as i32, libc::SIGINT) };
    assert!(c.wait().unwrap().success(), "{said}");
    let r: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(r["tier"], "floor");
    let attached: Vec<&str> = r["probes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["program"].as_str().unwrap())
        .collect();
    assert_eq!(
        attached,
        [
            "block_rq_complete_btf",
            "sched_switch",
            "sched_waking_nested_btf"
        ],
        "{r:#}"
    );
    assert_eq!(r["not_mirrored"][0]["flavour"], "uprobe", "{r:#}");
    let runs = |name: &str| {
        r["agent"]["bpf"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .and_then(|p| p["run_count"].as_u64())
    };
    assert!(runs("sched_switch").is_some_and(|n| n > 0), "{r:#}");
    assert!(
        runs("sched_waking_nested_btf").is_some_and(|n| n > 0),
        "{r:#}"
    );
    // Programs of the floor not asked for are not even loaded.
    assert_eq!(runs("sched_switch_btf"), None, "{r:#}");
}
