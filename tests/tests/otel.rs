//! Per-I/O traces of a real guest, exported over OTLP to a real Jaeger and
//! read back through its query API; and a run whose collector is down.

use std::{collections::BTreeMap, process::Command, time::Duration};

use agent_integration::{host_disk_of, iospan_bin, rig_and_image, run_around};
use serde_json::Value;
use xtask::{
    backends::{free_port, Jaeger},
    guest::{self, RunArgs},
};

const ONE_IN: u64 = 50;
const SLOWEST: usize = 3;

/// One rig boot under `iospan run` exporting to `endpoint`; the report.
fn traced(a: &RunArgs, endpoint: &str, protocol: &str, tag: &str) -> Value {
    traced_with_console(a, endpoint, protocol, tag).0
}

/// The report, and the guest's own account of its run (its console).
fn traced_with_console(
    a: &RunArgs,
    endpoint: &str,
    protocol: &str,
    tag: &str,
) -> (Value, guest::RigResult, String) {
    let (rig, image) = rig_and_image();
    let host = host_disk_of(&image);
    let (qemu, guest_dev) = guest::qemu_command(&rig, a, &image);
    let tmp = tempfile::tempdir().unwrap();
    let report = tmp.path().join(format!("otel-{tag}.json"));
    let t = std::time::Instant::now();
    let out = run_around(
        Command::new(iospan_bin())
            .args(["run", "--quiet", "--disk", &host])
            .args(agent_integration::rig_split_args())
            .arg("--json-out")
            .arg(&report)
            .args(["--otlp-endpoint", endpoint, "--otlp-protocol", protocol])
            .args(["--trace-slowest", &SLOWEST.to_string()])
            .args(["--trace-one-in", &ONE_IN.to_string()])
            .args(["--run-label", tag]),
        &qemu,
    );
    let console: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    let r = guest::parse(&console, a, guest_dev, t.elapsed().as_secs_f64())
        .unwrap_or_else(|e| panic!("{e:#}"));
    (
        serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap(),
        r,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn tag<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
    span["tags"]
        .as_array()?
        .iter()
        .find(|t| t["key"] == key)
        .map(|t| &t["value"])
}

fn check_jaeger(protocol: &str) {
    let jaeger = Jaeger::start().expect("jaeger");
    let endpoint = if protocol == "grpc" {
        format!("http://{}", jaeger.otlp_grpc)
    } else {
        format!("http://{}", jaeger.otlp_http)
    };
    let vm = format!("otel-{}", protocol.replace('/', "-"));
    let a = RunArgs {
        qd: 4,
        ios: 2000,
        name: vm.clone(),
        ..Default::default()
    };
    let (rep, _, log) = traced_with_console(&a, &endpoint, protocol, &vm);
    check_metrics_refused_once(&log, protocol);
    let ex = &rep["export"];
    let n = |k: &str| ex[k].as_u64().unwrap_or_else(|| panic!("{k}: {ex}"));
    let (offered, chosen, exported) = (n("offered"), n("chosen"), n("exported_traces"));
    assert!(offered >= 1900, "joined guest I/Os offered: {ex}");
    assert_eq!(n("dropped_queue_full") + n("failed_traces"), 0, "{ex}");
    assert_eq!(exported, chosen, "{ex}");

    // Everything the agent says it exported is in Jaeger, and nothing else.
    let traces = jaeger_traces(&jaeger, exported);
    let ids: std::collections::HashSet<&str> = traces
        .iter()
        .map(|t| t["traceID"].as_str().unwrap())
        .collect();
    let mut tally = Tally::default();
    for t in &traces {
        check_trace(t, &vm, &ids, &mut tally);
    }
    assert!(
        tally.single_block * 10 >= traces.len() as u64 * 9,
        "{} of {} traces of one 4 KiB read",
        tally.single_block,
        traces.len()
    );

    // The policy: one in ONE_IN of the offered, and at most SLOWEST per
    // second of the run (and the run's last part) for the one virtual disk.
    let by_reason = &tally.by_reason;
    let get = |k: &str| by_reason.get(k).copied().unwrap_or(0);
    assert_eq!(
        get("uniform"),
        offered / ONE_IN,
        "{by_reason:?} of {offered}"
    );
    let seconds = rep["duration_s"].as_f64().unwrap().ceil() as u64 + 1;
    assert!(
        get("slowest") >= SLOWEST as u64 && get("slowest") <= SLOWEST as u64 * seconds,
        "{by_reason:?} over {seconds} s"
    );
    assert_eq!(get("slower_than"), 0, "{by_reason:?}");
    eprintln!(
        "{protocol}: {} traces, {} links between I/Os one signal completed",
        traces.len(),
        tally.links
    );
}

/// Jaeger takes traces only: at most one line turns OTLP metrics off
/// (over HTTP its 404), and no failure is repeated at the end.
fn check_metrics_refused_once(log: &str, protocol: &str) {
    let said: Vec<&str> = log.lines().filter(|l| l.contains("metrics")).collect();
    assert!(
        !log.contains("pushing the last OTLP metrics") && said.len() <= 1,
        "{log}"
    );
    if protocol != "grpc" {
        assert!(
            said.len() == 1 && said[0].contains("takes no metrics"),
            "{log}"
        );
    }
}

/// The service's traces, once Jaeger holds as many as were exported (or
/// after 30 s, whatever it holds).
fn jaeger_traces(jaeger: &Jaeger, exported: u64) -> Vec<Value> {
    let mut traces = Vec::new();
    for _ in 0..60 {
        let (code, body) = jaeger
            .get("/api/traces?service=iospan&limit=100000&lookback=1h")
            .expect("query");
        assert_eq!(code, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        traces = v["data"].as_array().cloned().unwrap_or_default();
        if traces.len() as u64 >= exported {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(traces.len() as u64, exported, "{}", jaeger.server.log());
    traces
}

/// What the traces hold, over all of them.
#[derive(Default)]
struct Tally {
    by_reason: BTreeMap<String, u64>,
    links: u64,
    single_block: u64,
}

fn refs(s: &Value, kind: &str) -> Vec<Value> {
    s["references"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["refType"] == kind)
        .cloned()
        .collect()
}

/// One trace: its root names the I/O, its children tile it.
fn check_trace(t: &Value, vm: &str, ids: &std::collections::HashSet<&str>, tally: &mut Tally) {
    let spans = t["spans"].as_array().unwrap();
    let roots: Vec<&Value> = spans
        .iter()
        .filter(|s| refs(s, "CHILD_OF").is_empty())
        .collect();
    assert_eq!(roots.len(), 1, "{t:#}");
    let root = roots[0];
    // Links (I/Os one engine signal completed) lead to exported traces.
    for r in refs(root, "FOLLOWS_FROM") {
        let id = r["traceID"].as_str().unwrap();
        assert!(ids.contains(id), "link to {id}, not exported: {root:#}");
        tally.links += 1;
    }
    assert!(
        tag(root, "virt.queue.index").is_some_and(|q| q.as_i64() == Some(0)),
        "one virtqueue: {root:#}"
    );
    assert_eq!(root["operationName"], "vdisk.read", "{root:#}");
    assert_eq!(tag(root, "virt.vm.name"), Some(&Value::from(vm)));
    assert_eq!(tag(root, "virt.disk.id"), Some(&Value::from("vd0")));
    assert_eq!(tag(root, "disk.io.direction"), Some(&Value::from("read")));
    assert_eq!(tag(root, "iospan.has_guest"), Some(&Value::from(true)));
    assert_eq!(tag(root, "iospan.run.label"), Some(&Value::from(vm)));
    // 4 KiB reads; at depth the guest's block layer now and then merges
    // two that happen to be adjacent, and the trace is of its request.
    let bytes = tag(root, "iospan.io.bytes").and_then(Value::as_u64);
    assert!(bytes.is_some_and(|b| b > 0 && b % 4096 == 0), "{root:#}");
    if bytes == Some(4096) {
        tally.single_block += 1;
    }
    *tally
        .by_reason
        .entry(
            tag(root, "iospan.sampled_by")
                .unwrap()
                .as_str()
                .unwrap()
                .into(),
        )
        .or_default() += 1;
    let events: Vec<&str> = root["logs"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|l| l["fields"].as_array().unwrap())
        .filter(|f| f["key"] == "event")
        .map(|f| f["value"].as_str().unwrap())
        .collect();
    for e in ["kick", "interrupt.raised", "interrupt.received"] {
        assert!(events.contains(&e), "{e} not in {events:?}");
    }

    check_children(t, spans, root);
}

/// The children: every one the root's, back to back, in order,
/// tiling the root (Jaeger keeps microseconds: one of rounding each).
fn check_children(t: &Value, spans: &[Value], root: &Value) {
    let mut children: Vec<&Value> = spans.iter().filter(|s| !std::ptr::eq(*s, root)).collect();
    children.sort_by_key(|s| s["startTime"].as_u64().unwrap());
    let names: Vec<&str> = children
        .iter()
        .map(|s| s["operationName"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "guest.submit",
            "hypervisor.notify",
            "engine.submit",
            "host.queue",
            "device",
            "engine.complete",
            "hypervisor.interrupt",
            "guest.complete"
        ],
        "{t:#}"
    );
    for c in &children {
        let r = &c["references"][0];
        assert_eq!(r["refType"], "CHILD_OF");
        assert_eq!(r["spanID"], root["spanID"]);
        assert!(tag(c, "iospan.segment").is_some(), "{c:#}");
    }
    let us = |s: &Value, k: &str| s[k].as_u64().unwrap() as f64;
    let sum: f64 = children.iter().map(|c| us(c, "duration")).sum();
    let total = us(root, "duration");
    let slack = (0.01 * total).max(children.len() as f64);
    assert!(
        (sum - total).abs() <= slack,
        "children {sum} µs vs root {total} µs: {t:#}"
    );
    for w in children.windows(2) {
        let end = us(w[0], "startTime") + us(w[0], "duration");
        assert!((us(w[1], "startTime") - end).abs() <= 1.0, "gap: {t:#}");
    }
    assert!((us(children[0], "startTime") - us(root, "startTime")).abs() <= 1.0);
}

#[test]
fn traces_reach_jaeger_over_http() {
    check_jaeger("http/protobuf");
}

#[test]
fn traces_reach_jaeger_over_grpc() {
    check_jaeger("grpc");
}

#[test]
fn a_collector_that_is_down_loses_only_traces_and_counts_them() {
    let port = free_port().unwrap();
    let a = RunArgs {
        qd: 4,
        ios: 1000,
        name: "otel-down".into(),
        no_guest_agent: true,
        ..Default::default()
    };
    let (rep, guest, _) = traced_with_console(
        &a,
        &format!("http://127.0.0.1:{port}"),
        "http/protobuf",
        "down",
    );
    let ex = &rep["export"];
    let n = |k: &str| ex[k].as_u64().unwrap();
    // Host windows without a guest agent are offered too.
    assert!(n("offered") >= 900, "{ex}");
    assert!(n("chosen") > 0, "{ex}");
    assert_eq!(n("exported_traces"), 0, "{ex}");
    assert_eq!(
        n("chosen"),
        n("failed_traces") + n("dropped_queue_full"),
        "{ex}"
    );
    // The run's own measurements are whole.
    let vm = rep["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["vm"] == "otel-down" && e["disk"] == "vd0")
        .unwrap_or_else(|| panic!("{rep:#}"));
    // The run's own measurements are whole: every request the guest's
    // disk counted is the VM's, timed, or named as never delivered by the
    // tracepoints, or merged into another on the way.
    let summary = rep["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "otel-down")
        .unwrap_or_else(|| panic!("{:#}", rep["vms"]));
    let n = |v: &Value, k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{k}: {v}"));
    let merged = n(summary, "engine_merged") + n(summary, "host_merged");
    assert_eq!(
        n(vm, "ios") + n(vm, "undelivered") + merged,
        guest.guest_reads,
        "{vm}\n{summary}"
    );
}

/// A collector that takes connections and never answers (the worst kind
/// of down: every export waits out its timeout) while every I/O is chosen:
/// the queue's bound holds the agent's memory. Measured against the same
/// run with a queue large enough to hold every trace.
#[test]
fn a_collector_that_never_answers_costs_only_the_queue() {
    let blackhole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", blackhole.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in blackhole.incoming().flatten() {
            held.push(c);
        }
    });
    let (rig, image) = rig_and_image();
    let host = host_disk_of(&image);
    let mut growth = Vec::new();
    for queue in [64u64, 1_000_000] {
        let a = RunArgs {
            qd: 4,
            ios: 10_000,
            name: format!("otel-hole-{queue}"),
            no_guest_agent: true,
            ..Default::default()
        };
        let (qemu, _) = guest::qemu_command(&rig, &a, &image);
        let tmp = tempfile::tempdir().unwrap();
        let report = tmp.path().join(format!("otel-hole-{queue}.json"));
        let mut agent = Command::new(iospan_bin())
            .args(["run", "--quiet", "--disk", &host])
            .args(agent_integration::rig_split_args())
            .arg("--json-out")
            .arg(&report)
            .args(["--otlp-endpoint", &endpoint])
            .args(["--trace-one-in", "1", "--trace-queue", &queue.to_string()])
            .arg("--")
            .arg(qemu.get_program())
            .args(qemu.get_args())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let pid = agent.id();
        // Resident memory less the ring buffer's pages, which become
        // resident as its producer goes round whatever the exporter does (a
        // fixed cost, not the queue's). Both from one read of smaps: the
        // ring is unmapped at exit, and VmRSS read apart from it could count
        // the ring once in one read and subtract it in none.
        let heap_kb = || -> Option<u64> {
            let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
            let mut in_ring = false;
            let mut kb = 0;
            for line in smaps.lines() {
                if line
                    .split_whitespace()
                    .next()
                    .is_some_and(|f| f.contains('-') && !f.ends_with(':'))
                {
                    in_ring = line.contains("anon_inode:bpf");
                } else if !in_ring && line.starts_with("Rss:") {
                    kb += line
                        .split_whitespace()
                        .nth(1)
                        .and_then(|v| v.parse::<u64>().ok())
                        .unwrap_or(0);
                }
            }
            (kb > 0).then_some(kb)
        };
        // Loaded and attached, the guest still booting: the baseline.
        std::thread::sleep(Duration::from_millis(800));
        let base = heap_kb().expect("agent running");
        let mut peak = base;
        while agent.try_wait().unwrap().is_none() {
            if let Some(kb) = heap_kb() {
                peak = peak.max(kb);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let rep: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
        let ex = &rep["export"];
        let n = |k: &str| ex[k].as_u64().unwrap();
        assert!(n("chosen") >= 9000, "every I/O chosen: {ex}");
        assert_eq!(n("exported_traces"), 0, "{ex}");
        assert_eq!(
            n("chosen"),
            n("failed_traces") + n("dropped_queue_full"),
            "{ex}"
        );
        if queue == 64 {
            assert!(n("dropped_queue_full") > n("chosen") / 2, "{ex}");
        }
        growth.push((queue, peak.saturating_sub(base), n("chosen")));
    }
    eprintln!("agent memory growth (queue, KiB, traces chosen): {growth:?}");
    let (bounded, unbounded) = (growth[0].1, growth[1].1);
    assert!(
        unbounded >= 4096 && bounded * 4 <= unbounded,
        "a 64-trace queue grew {bounded} KiB, an unbounded one {unbounded} KiB"
    );
}

/// A search by the VM's name (the `virt.vm.name` attribute, as a trace
/// store indexes it) finds every trace exported for that VM and no other's,
/// each read back whole: the root and its eight children.
#[test]
fn traces_are_found_again_by_their_vms_name() {
    let jaeger = Jaeger::start().expect("jaeger");
    let vm = "otel-search".to_string();
    let a = RunArgs {
        qd: 4,
        ios: 1000,
        name: vm.clone(),
        ..Default::default()
    };
    let rep = traced(&a, &format!("http://{}", jaeger.otlp_grpc), "grpc", &vm);
    let ex = &rep["export"];
    let exported = ex["exported_traces"].as_u64().unwrap();
    assert!(
        exported > 0 && exported == ex["chosen"].as_u64().unwrap(),
        "{ex}"
    );
    let search = |vm: &str, op: Option<&str>| -> Vec<Value> {
        let tags = format!("{{\"virt.vm.name\":\"{vm}\"}}");
        let mut path = format!(
            "/api/traces?service=iospan&limit=100000&lookback=1h&tags={}",
            url_escape(&tags)
        );
        if let Some(op) = op {
            path += &format!("&operation={op}");
        }
        let (code, body) = jaeger.get(&path).expect("search");
        assert_eq!(code, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        v["data"].as_array().cloned().unwrap_or_default()
    };
    let mut found = Vec::new();
    for _ in 0..60 {
        found = search(&vm, Some("vdisk.read"));
        if found.len() as u64 >= exported {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(found.len() as u64, exported, "{}", jaeger.server.log());
    assert!(search("no-such-vm", None).is_empty());
    for t in found.iter().take(5) {
        let spans = t["spans"].as_array().unwrap();
        assert_eq!(spans.len(), 9, "{t}");
        let roots: Vec<&Value> = spans
            .iter()
            .filter(|s| {
                s["references"]
                    .as_array()
                    .is_none_or(|r| r.iter().all(|r| r["refType"] != "CHILD_OF"))
            })
            .collect();
        assert_eq!(roots.len(), 1, "{t}");
        assert_eq!(roots[0]["operationName"], "vdisk.read", "{t}");
        assert_eq!(
            tag(roots[0], "virt.vm.name"),
            Some(&Value::from(vm.as_str())),
            "{t}"
        );
    }
}

/// A query parameter's value, percent-encoded.
fn url_escape(v: &str) -> String {
    v.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `cargo xtask backends run jaeger` stops, and its Jaeger with it, on a
/// SIGINT or SIGTERM sent to its own process alone (not a terminal's
/// Ctrl-C, which reaches the whole group), and its Jaeger does not outlive
/// it even when it is killed outright. Stopped, it leaves no scratch directory.
#[test]
fn the_backends_runner_takes_its_jaeger_down_with_it() {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let xtask = iospan_bin().with_file_name("xtask");
    for (sig, code) in [
        (libc::SIGINT, Some(130)),
        (libc::SIGTERM, Some(143)),
        (libc::SIGKILL, None),
    ] {
        let mut child = Command::new(&xtask)
            .args(["backends", "run", "jaeger"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            // Its own group: nothing but our kill reaches it.
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", xtask.display()));
        let err = child.stderr.take().unwrap();
        let mut lines = std::io::BufReader::new(err).lines();
        let running = lines
            .by_ref()
            .map_while(Result::ok)
            .find(|l| l.contains(" running: "))
            .expect("a line saying where Jaeger runs");
        let query = running
            .rsplit("query http://")
            .next()
            .unwrap()
            .trim()
            .to_string();
        let scratch = std::path::PathBuf::from(
            running
                .split(", scratch ")
                .nth(1)
                .and_then(|r| r.split(", query ").next())
                .unwrap_or_else(|| panic!("no scratch directory in {running:?}")),
        );
        assert!(scratch.is_dir(), "{running}");
        assert!(std::net::TcpStream::connect(&query).is_ok(), "{running}");
        unsafe { libc::kill(child.id() as i32, sig) };
        let t = std::time::Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "signal {sig}: still running"
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        assert_eq!(status.code(), code, "signal {sig}: {status}");
        // Jaeger gone too: its query port closes.
        let t = std::time::Instant::now();
        while std::net::TcpStream::connect(&query).is_ok() {
            assert!(
                t.elapsed() < Duration::from_secs(15),
                "signal {sig}: Jaeger still answers at {query}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        // Stopped, it removes its scratch directory; killed outright, it
        // cannot, and the one who killed it does.
        if code.is_some() {
            assert!(
                !scratch.exists(),
                "signal {sig}: {} left",
                scratch.display()
            );
        } else {
            std::fs::remove_dir_all(&scratch).unwrap();
        }
    }
}
