//! The fleet collector (collector/): the distribution the builder makes
//! from collector/builder.yaml accepts every shipped pipeline.

use std::process::Command;

use agent_integration::run;
use xtask::backends;

#[test]
fn every_shipped_collector_config_validates() {
    let bin = backends::ensure(backends::Backend::Otelcol).unwrap_or_else(|e| panic!("{e:#}"));
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../collector");
    let mut configs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.extension().is_some_and(|x| x == "yaml")
                && !["builder.yaml", "tls.yaml"]
                    .iter()
                    .any(|n| p.file_name() == Some(n.as_ref()))
        })
        .collect();
    configs.sort();
    assert!(configs.len() >= 2, "{configs:?}");
    // Each tier alone (loopback, plain), and each with the TLS overlay.
    let tls = dir.join("tls.yaml");
    for c in &configs {
        for overlay in [None, Some(&tls)] {
            let mut cmd = Command::new(&bin);
            cmd.arg("validate")
                .arg(format!("--config={}", c.display()))
                .env("IOSPAN_TLS_CERT", "/etc/iospan/collector.crt")
                .env("IOSPAN_TLS_KEY", "/etc/iospan/collector.key")
                .env("IOSPAN_TOKEN_FILE", "/etc/iospan/collector-token");
            if let Some(o) = overlay {
                cmd.arg(format!("--config={}", o.display()));
            }
            let out = run(&mut cmd);
            assert!(
                out.status.success(),
                "{} {overlay:?}: {}{}",
                c.display(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        // Plain OTLP listens on loopback only.
        let text = std::fs::read_to_string(c).unwrap();
        for l in text
            .lines()
            .filter(|l| l.contains("OTLP_") && l.contains("ENDPOINT"))
        {
            assert!(l.contains(":-127.0.0.1:"), "{}: {l}", c.display());
        }
    }
    // And a broken one is refused, naming what is wrong.
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("bad-collector.yaml");
    let text = std::fs::read_to_string(dir.join("gateway.yaml"))
        .unwrap()
        .replace("threshold_ms:", "threshold_mss:");
    std::fs::write(&bad, text).unwrap();
    let out = run(Command::new(&bin)
        .arg("validate")
        .arg(format!("--config={}", bad.display())));
    assert!(!out.status.success(), "a broken policy was accepted");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("threshold_mss"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_file(&bad);
}

/// Two agents (two rig guests, each under its own `iospan run` exporting
/// every joined I/O, each naming its own host) through the gateway: Jaeger holds exactly what the
/// tail-sampling policy keeps — every trace of the watched VM, only the
/// slow ones of the other — and the span metrics of both reach Prometheus
/// with their VM and disk labels.
#[test]
fn the_gateway_keeps_what_its_policy_says_and_derives_span_metrics() {
    let jaeger = backends::Jaeger::start().unwrap_or_else(|e| panic!("{e:#}"));
    let gw = backends::Collector::start(
        "gateway",
        &[
            ("IOSPAN_TRACES_ENDPOINT", jaeger.otlp_grpc.as_str()),
            ("IOSPAN_SLOW_MS", "2"),
            ("IOSPAN_WATCH_VMS", "^keep-vm$"),
            ("IOSPAN_BASELINE_PERCENT", "0"),
            ("IOSPAN_DECISION_WAIT", "1s"),
        ],
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    let prom = backends::Prometheus::start(&gw.prometheus).unwrap_or_else(|e| panic!("{e:#}"));
    let (rig, image) = agent_integration::rig_and_image();
    let host = agent_integration::host_disk_of(&image);

    // Per VM: the totals (µs) of the I/Os its agent exported.
    let mut exported: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    for vm in ["keep-vm", "other-vm"] {
        let totals = export_through(&gw, &rig, &image, &host, vm);
        exported.insert(vm.to_string(), totals);
    }
    let keep_n = exported["keep-vm"].len();
    let other = &exported["other-vm"];
    let slow_lo = other.iter().filter(|t| **t > SLOW_US + 1.0).count();
    let slow_hi = other.iter().filter(|t| **t >= SLOW_US - 1.0).count();
    let (kept_keep, kept_other) = kept_traces(&jaeger, keep_n, slow_lo);
    let ctx = format!(
        "keep-vm: {} exported, {} kept; other-vm: {} exported, {slow_lo}..={slow_hi} slower than {SLOW_US} µs, {} kept\n{}",
        keep_n,
        kept_keep.len(),
        other.len(),
        kept_other.len(),
        gw.server.log()
    );
    assert_eq!(
        kept_keep.len(),
        keep_n,
        "every trace of the watched VM: {ctx}"
    );
    assert!(
        (slow_lo..=slow_hi).contains(&kept_other.len()),
        "only the other VM's slow traces: {ctx}"
    );
    assert!(kept_other.len() < other.len(), "{ctx}");
    for d in &kept_other {
        assert!(*d >= SLOW_US - 1.0, "a kept trace of {d} µs: {ctx}");
    }
    eprintln!("{}", ctx.lines().next().unwrap_or(""));

    check_span_metrics(&prom, &gw, keep_n, other.len());
}

/// The latency policy counts whole milliseconds and keeps those above
/// its threshold: IOSPAN_SLOW_MS=2 keeps traces of 3.0 ms and more.
const SLOW_US: f64 = 3000.0;

/// A rig guest traced by its own agent (its own host, as in a fleet), every
/// I/O exported to the gateway: the totals (µs) of those it exported.
fn export_through(
    gw: &backends::Collector,
    rig: &xtask::guest::Rig,
    image: &std::path::Path,
    host: &str,
    vm: &str,
) -> Vec<f64> {
    let a = xtask::guest::RunArgs {
        ios: 400,
        name: vm.into(),
        ..Default::default()
    };
    let (qemu, _) = xtask::guest::qemu_command(rig, &a, image);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (rep, ev) = (dir.join("report.json"), dir.join("events.jsonl"));
    agent_integration::run_around(
        Command::new(agent_integration::iospan_bin())
            .args(["run", "--quiet", "--disk", host])
            .args(agent_integration::rig_split_args())
            .arg("--json-out")
            .arg(&rep)
            .arg("--events-out")
            .arg(&ev)
            .args(["--otlp-endpoint", &format!("http://{}", gw.otlp_http)])
            .args([
                "--otlp-protocol",
                "http/protobuf",
                "--trace-one-in",
                "1",
                "--trace-slowest",
                "0",
            ])
            // Each agent its own host, as in a fleet.
            .env("OTEL_RESOURCE_ATTRIBUTES", format!("host.name=hv-{vm}")),
        &qemu,
    );
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&rep).unwrap()).unwrap();
    let ex = &report["export"];
    assert_eq!(ex["exported_traces"], ex["offered"], "{vm}: {ex}");
    let totals: Vec<f64> = std::fs::read_to_string(&ev)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["kind"] == "guest_io" && r["vm"] == vm)
        .map(|r| r["total_us"].as_f64().unwrap())
        .collect();
    assert_eq!(
        totals.len() as u64,
        ex["exported_traces"].as_u64().unwrap(),
        "{vm}"
    );
    totals
}

/// What Jaeger holds of each VM's traces (their durations, µs) once the
/// gateway has decided: every one of the watched VM, the slow ones of the
/// other.
fn kept_traces(jaeger: &backends::Jaeger, keep_n: usize, slow_lo: usize) -> (Vec<f64>, Vec<f64>) {
    let traces_of = |vm: &str| -> Vec<f64> {
        jaeger_traces(jaeger, "virt.vm.name", vm)
            .iter()
            .map(|t| {
                let hosts: Vec<_> = t["processes"]
                    .as_object()
                    .unwrap()
                    .values()
                    .flat_map(|p| p["tags"].as_array().cloned().unwrap_or_default())
                    .filter(|tag| tag["key"] == "host.name")
                    .map(|tag| tag["value"].clone())
                    .collect();
                assert_eq!(hosts, [format!("hv-{vm}")], "the host of a {vm} trace");
                root_of(t)["duration"].as_f64().unwrap()
            })
            .collect()
    };
    let t0 = std::time::Instant::now();
    let (mut kept_keep, mut kept_other) = (Vec::new(), Vec::new());
    while t0.elapsed() < std::time::Duration::from_secs(60) {
        kept_keep = traces_of("keep-vm");
        kept_other = traces_of("other-vm");
        if kept_keep.len() >= keep_n && kept_other.len() >= slow_lo {
            // Decisions come a wait after the last span: one more wait for stragglers.
            std::thread::sleep(std::time::Duration::from_secs(3));
            kept_keep = traces_of("keep-vm");
            kept_other = traces_of("other-vm");
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    (kept_keep, kept_other)
}

/// Span metrics of every exported span (before sampling), by VM and disk.
fn check_span_metrics(
    prom: &backends::Prometheus,
    gw: &backends::Collector,
    keep_n: usize,
    other_n: usize,
) {
    let t0 = std::time::Instant::now();
    loop {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let q = prom
            .query(
                "sum by (virt_vm_name, virt_disk_id) (traces_span_metrics_calls_total{span_name=\"vdisk.read\"})",
                now,
            )
            .unwrap();
        let series = q["data"]["result"].as_array().cloned().unwrap_or_default();
        let calls = |vm: &str| {
            series
                .iter()
                .find(|s| s["metric"]["virt_vm_name"] == vm && s["metric"]["virt_disk_id"] == "vd0")
                .and_then(|s| s["value"][1].as_str()?.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        if calls("keep-vm") as usize == keep_n && calls("other-vm") as usize == other_n {
            break;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "span metrics {q:#} vs {keep_n} and {} exported\n{}",
            other_n,
            gw.server.log()
        );
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

/// A recorded run (`run --events-out`) replayed over OTLP: the backend
/// holds every I/O of it, each time through, with its recorded latency and
/// its segments, on new trace ids.
#[test]
fn a_replayed_run_reaches_the_backend_as_recorded() {
    let jaeger = backends::Jaeger::start().unwrap_or_else(|e| panic!("{e:#}"));
    let dir_held = tempfile::Builder::new()
        .prefix("iospan-replay-")
        .tempdir()
        .unwrap();
    let dir = dir_held.path().to_path_buf();
    let ev = record_events("replayed-vm", &dir);
    let mut recorded: Vec<f64> = std::fs::read_to_string(&ev)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["kind"] == "guest_io" && r["vm"] == "replayed-vm")
        .map(|r| r["total_us"].as_f64().unwrap())
        .collect();
    assert!(recorded.len() > 150, "{} recorded", recorded.len());

    let out = run(Command::new(agent_integration::iospan_bin())
        .arg("replay")
        .arg(&ev)
        .args([
            "--quiet", "--speed", "0", "--repeat", "2", "--label", "replayed",
        ])
        .args(["--otlp-endpoint", &format!("http://{}", jaeger.otlp_http)]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let n = recorded.len() as u64;
    assert_eq!(s["exported_traces"], 2 * n, "{s}");
    assert_eq!(s["failed_traces"], 0, "{s}");

    // Each root's duration is a recorded total (Jaeger keeps whole µs).
    let t0 = std::time::Instant::now();
    let roots = loop {
        let traces = jaeger_traces(&jaeger, "iospan.run.label", "replayed");
        if traces.len() as u64 >= 2 * n || t0.elapsed() > std::time::Duration::from_secs(30) {
            break traces
                .iter()
                .map(|t| {
                    let root = root_of(t);
                    assert!(
                        t["spans"].as_array().unwrap().len() >= 5,
                        "a root and its segments: {t}"
                    );
                    (
                        root["operationName"].as_str().unwrap().to_string(),
                        root["duration"].as_f64().unwrap(),
                    )
                })
                .collect::<Vec<_>>();
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    };
    assert_eq!(roots.len() as u64, 2 * n);
    assert!(
        roots.iter().all(|(name, _)| name.starts_with("vdisk.")),
        "{roots:?}"
    );
    let mut got: Vec<f64> = roots.iter().map(|(_, d)| *d).collect();
    got.sort_by(f64::total_cmp);
    recorded.extend(recorded.clone());
    recorded.sort_by(f64::total_cmp);
    for (g, r) in got.iter().zip(&recorded) {
        assert!(
            (g - r).abs() <= 1.0,
            "a replayed root of {g} µs for a recorded {r} µs"
        );
    }
}

/// Agents on other hosts reach the gateway only over TLS with its token
/// (tls.yaml): a replayed run's traces, over http/protobuf and gRPC, are
/// all taken with the token and the CA, and all refused (and counted)
/// without the token or without TLS.
#[test]
fn spans_reach_the_gateway_over_tls_with_a_token_and_not_without() {
    let dir_held = tempfile::Builder::new()
        .prefix("iospan-otlp-tls-")
        .tempdir()
        .unwrap();
    let dir = dir_held.path().to_path_buf();
    let (ca, cert, key) = agent_integration::test_ca(&dir, "collector");
    let token_file = dir.join("token");
    std::fs::write(&token_file, "c0llect0r-t0ken\n").unwrap();
    let gw = backends::Collector::start_with(
        &["gateway", "tls"],
        &[
            ("IOSPAN_TLS_CERT", cert.to_str().unwrap()),
            ("IOSPAN_TLS_KEY", key.to_str().unwrap()),
            ("IOSPAN_TOKEN_FILE", token_file.to_str().unwrap()),
            ("IOSPAN_BASELINE_PERCENT", "0"),
        ],
    )
    .unwrap_or_else(|e| panic!("{e:#}"));

    // A short recorded run to send.
    let ev = record_events("tls-vm", &dir);
    let n = std::fs::read_to_string(&ev)
        .unwrap()
        .lines()
        .filter(|l| l.contains("\"guest_io\""))
        .count() as u64;
    assert!(n > 150, "{n} recorded");

    let replay =
        |protocol: &str, endpoint: &str, token: Option<&str>, ca: Option<&std::path::Path>| {
            let mut c = Command::new(agent_integration::iospan_bin());
            c.arg("replay")
                .arg(&ev)
                .args(["--quiet", "--speed", "0", "--otlp-protocol", protocol])
                .args(["--otlp-endpoint", endpoint])
                .env_remove("OTEL_EXPORTER_OTLP_HEADERS");
            if let Some(ca) = ca {
                c.arg("--otlp-ca-cert").arg(ca);
            }
            if let Some(t) = token {
                c.env(
                    "OTEL_EXPORTER_OTLP_HEADERS",
                    format!("authorization=Bearer {t}"),
                );
            }
            let out = run(&mut c);
            let err = String::from_utf8_lossy(&out.stderr).to_string();
            let s: serde_json::Value = serde_json::from_slice(&out.stdout)
                .unwrap_or_else(|e| panic!("{protocol} {endpoint}: {e}: {err}"));
            (s, err)
        };
    for (protocol, addr) in [("http/protobuf", &gw.otlp_http), ("grpc", &gw.otlp_grpc)] {
        let https = format!("https://{addr}");
        let (s, err) = replay(protocol, &https, Some("c0llect0r-t0ken"), Some(&ca));
        assert_eq!(s["exported_traces"], n, "{protocol}: {s} {err}");
        assert_eq!(s["failed_traces"], 0, "{protocol}: {s} {err}");
        // A wrong token, no token, no TLS: nothing taken, all counted.
        for (what, endpoint, token) in [
            ("a wrong token", https.as_str(), Some("guess")),
            ("no token", https.as_str(), None),
        ] {
            let (s, err) = replay(protocol, endpoint, token, Some(&ca));
            assert_eq!(s["exported_traces"], 0, "{protocol}, {what}: {s} {err}");
            assert_eq!(s["failed_traces"], n, "{protocol}, {what}: {s} {err}");
        }
        let (s, err) = replay(
            protocol,
            &format!("http://{addr}"),
            Some("c0llect0r-t0ken"),
            None,
        );
        assert_eq!(s["exported_traces"], 0, "{protocol}, plain: {s} {err}");
    }
    // The gateway's span metrics count what it took: both protocols'.
    let t0 = std::time::Instant::now();
    loop {
        let (_, body) = backends::http_get(&gw.prometheus, "/metrics", &[]).unwrap_or_default();
        let calls: f64 = body
            .lines()
            .filter(|l| {
                l.starts_with("traces_span_metrics_calls_total")
                    && l.contains("virt_vm_name=\"tls-vm\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        if calls >= 2.0 * n as f64 {
            break;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(30),
            "span metrics show {calls} calls of tls-vm, want ≥ {}",
            2 * n
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
}

/// A rig guest named `vm` doing 200 reads under `iospan run
/// --events-out`: the events file, in `dir`.
fn record_events(vm: &str, dir: &std::path::Path) -> std::path::PathBuf {
    let (rig, image) = agent_integration::rig_and_image();
    let host = agent_integration::host_disk_of(&image);
    let a = xtask::guest::RunArgs {
        ios: 200,
        name: vm.into(),
        ..Default::default()
    };
    let (qemu, _) = xtask::guest::qemu_command(&rig, &a, &image);
    let ev = dir.join("events.jsonl");
    agent_integration::run_around(
        Command::new(agent_integration::iospan_bin())
            .args(["run", "--quiet", "--disk", &host])
            .args(agent_integration::rig_split_args())
            .arg("--events-out")
            .arg(&ev),
        &qemu,
    );
    ev
}

/// What Jaeger holds of service iospan with the tag KEY=VALUE.
fn jaeger_traces(jaeger: &backends::Jaeger, key: &str, value: &str) -> Vec<serde_json::Value> {
    let (code, body) = jaeger
        .get(&format!(
            "/api/traces?service=iospan&limit=100000&lookback=1h&tags=%7B%22{key}%22%3A%22{value}%22%7D"
        ))
        .unwrap();
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["data"].as_array().cloned().unwrap_or_default()
}

/// A Jaeger trace's root span: the one with no parent.
fn root_of(trace: &serde_json::Value) -> &serde_json::Value {
    let roots: Vec<_> = trace["spans"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| {
            s["references"]
                .as_array()
                .is_none_or(|r| r.iter().all(|r| r["refType"] != "CHILD_OF"))
        })
        .collect();
    assert_eq!(roots.len(), 1, "one root: {trace}");
    roots[0]
}
