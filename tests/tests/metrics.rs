//! /metrics of a run tracing a real guest, scraped by a real Prometheus:
//! PromQL percentiles from the histograms agree with iospan's own report,
//! and the buckets' exemplars are traces a real Jaeger has.

use std::{
    process::Command,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use agent_integration::{host_disk_of, iospan_bin, rig_and_image, run, run_around};
use serde_json::Value;
use xtask::{
    backends::{free_port, http_get, Collector, Jaeger, Prometheus},
    guest::{self, RunArgs},
};

/// The classic bucket `[lo, hi)` (seconds) holding `v`.
fn bucket_of(v: f64) -> (f64, f64) {
    let ns = (v * 1e9) as u64;
    let bounds = iospan::output::metrics::bounds_ns();
    let hi = bounds.iter().copied().find(|&b| b > ns).unwrap_or(u64::MAX);
    let lo = bounds.iter().copied().rev().find(|&b| b <= ns).unwrap_or(0);
    (lo as f64 / 1e9, hi as f64 / 1e9)
}

#[test]
fn prometheus_percentiles_match_the_report() {
    let port = free_port().unwrap();
    let target = format!("127.0.0.1:{port}");
    let prom = Prometheus::start(&target).expect("prometheus");
    let jaeger = Jaeger::start().expect("jaeger");
    let started = unix_now();
    let tmp = tempfile::tempdir().unwrap();
    let report = tmp.path().join("prom.json");
    let ended = scraped_run(&target, &jaeger, &report);
    let rep: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let entry = rep["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["vm"] == "prom-rig" && e["disk"] == "vd0" && e["op"] == "read")
        .unwrap_or_else(|| panic!("{rep:#}"))
        .clone();

    // A moment before the run ended: the series are current there.
    let p = PromAt {
        prom: &prom,
        at: ended - 1.0,
    };
    let ios = p.scalar(&format!("iospan_vm_ios_total{{{SEL}}}"));
    assert_eq!(ios as u64, entry["ios"].as_u64().unwrap(), "{entry}");
    check_percentiles(&p, &entry);
    check_tables_and_export(&p, &rep);
    let exported = rep["export"]["exported_traces"].as_u64().unwrap();
    check_exemplars(&prom, &jaeger, (started, ended), exported);
}

/// The series of the rig VM's reads.
const SEL: &str = "vm=\"prom-rig\",vdisk=\"vd0\",op=\"read\"";

/// A rig guest traced with /metrics served on `target` while Prometheus
/// scrapes it and traces go to Jaeger; the report in `report`. The time
/// it ended (Unix seconds).
fn scraped_run(target: &str, jaeger: &Jaeger, report: &std::path::Path) -> f64 {
    let (rig, image) = rig_and_image();
    let host = host_disk_of(&image);
    let a = RunArgs {
        qd: 4,
        ios: 3000,
        name: "prom-rig".into(),
        ..Default::default()
    };
    let (qemu, _) = guest::qemu_command(&rig, &a, &image);
    // The VM, then three seconds more of serving: the last scrapes see the
    // finished run.
    let mut shell = format!("'{}'", qemu.get_program().to_string_lossy());
    for arg in qemu.get_args() {
        shell.push_str(&format!(
            " '{}'",
            arg.to_string_lossy().replace('\'', "'\\''")
        ));
    }
    shell.push_str(" && sleep 3");
    let out = run(Command::new(iospan_bin())
        .args(["run", "--quiet", "--disk", &host])
        .args(agent_integration::rig_split_args())
        .arg("--json-out")
        .arg(report)
        .args(["--metrics-listen", target])
        .args(["--otlp-endpoint", &format!("http://{}", jaeger.otlp_http)])
        // Traces through the run, not only its slowest: exemplars in
        // several buckets.
        .args(["--trace-one-in", "20"])
        .args(["--", "sh", "-c", &shell]));
    let ended = unix_now();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        http_get(target, "/metrics", &[]).is_err(),
        "the endpoint goes with the run"
    );
    ended
}

/// Prometheus queried at one instant.
struct PromAt<'p> {
    prom: &'p Prometheus,
    at: f64,
}

impl PromAt<'_> {
    /// The value of a query answered by one series.
    fn scalar(&self, q: &str) -> f64 {
        let v = self
            .prom
            .query(q, self.at)
            .unwrap_or_else(|e| panic!("{e:#}\n{}", self.prom.server.log()));
        let r = &v["data"]["result"];
        assert_eq!(r.as_array().map(Vec::len), Some(1), "{q}: {v}");
        r[0]["value"][1].as_str().unwrap().parse().unwrap()
    }
}

/// Each segment's count, p50 and p99 in PromQL against the report's.
fn check_percentiles(p: &PromAt, entry: &Value) {
    let sel = SEL;
    let scalar = |q: &str| p.scalar(q);
    let mut checked = Vec::new();
    for (seg, summary) in [
        ("total", &entry["total"]),
        ("hypervisor", &entry["segments"]["hypervisor"]),
        ("engine", &entry["segments"]["engine"]),
        ("device", &entry["segments"]["device"]),
        ("host_window", &entry["segments"]["host_window"]),
        ("g_total", &entry["stitched"]["segments"]["total"]),
        ("g_guest", &entry["stitched"]["segments"]["guest"]),
    ] {
        let count = scalar(&format!(
            "iospan_vm_latency_seconds_count{{{sel},segment=\"{seg}\"}}"
        ));
        assert_eq!(
            count as u64,
            summary["count"].as_u64().unwrap(),
            "{seg}: {summary}"
        );
        for (q, key) in [(0.5, "p50_us"), (0.99, "p99_us")] {
            let promql = scalar(&format!(
                "histogram_quantile({q}, iospan_vm_latency_seconds_bucket{{{sel},segment=\"{seg}\"}})"
            ));
            let ours = summary[key].as_f64().unwrap() / 1e6;
            // Within the resolution of the classic bucket holding ours.
            let (lo, hi) = bucket_of(ours);
            assert!(
                (promql - ours).abs() <= hi - lo,
                "{seg} {key}: PromQL {promql} s vs report {ours} s (bucket {lo}..{hi})"
            );
            checked.push(format!(
                "{seg} {key}: {:.1} vs {:.1} µs",
                promql * 1e6,
                ours * 1e6
            ));
        }
    }
    eprintln!("{}", checked.join("\n"));
}

fn check_tables_and_export(p: &PromAt, rep: &Value) {
    let scalar = |q: &str| p.scalar(q);
    let at = p.at;
    let prom = p.prom;
    // In flight once the VM is gone: nothing. Every table has room.
    assert_eq!(scalar("iospan_vm_inflight_requests{vm=\"prom-rig\"}"), 0.0);
    let full = prom
        .query("iospan_map_entries >= iospan_map_capacity", at)
        .unwrap();
    assert_eq!(full["data"]["result"], Value::Array(vec![]), "{full}");
    // The VM was a table entry while it ran (and was let go once it exited).
    assert_eq!(
        scalar("max_over_time(iospan_map_entries{map=\"vm_pids\"}[1m])"),
        1.0
    );
    assert_eq!(scalar("iospan_map_entries{map=\"vm_pids\"}"), 0.0);
    let exported = rep["export"]["exported_traces"].as_u64().unwrap();
    assert_eq!(
        scalar("iospan_traces_total{outcome=\"exported\"}") as u64,
        exported,
        "live export counters: {}",
        rep["export"]
    );
}

fn check_exemplars(
    prom: &Prometheus,
    jaeger: &Jaeger,
    (started, ended): (f64, f64),
    exported: u64,
) {
    let sel = SEL;
    // Exemplars: each guest-observed bucket's latest exported trace.
    let ex = prom
        .exemplars(
            &format!("iospan_vm_latency_seconds_bucket{{{sel},segment=\"g_total\"}}"),
            started,
            ended,
        )
        .unwrap();
    let mut seen = 0;
    for series in ex["data"].as_array().unwrap() {
        let le: f64 = match series["seriesLabels"]["le"].as_str().unwrap() {
            "+Inf" => f64::INFINITY,
            v => v.parse().unwrap(),
        };
        for e in series["exemplars"].as_array().unwrap() {
            let value: f64 = e["value"].as_str().unwrap().parse().unwrap();
            let (lo, _) = bucket_of(le.min(1e6) - 1e-12);
            assert!(
                value <= le && (le.is_infinite() || value > lo),
                "exemplar {value} s outside its bucket le={le}"
            );
            let id = e["labels"]["trace_id"].as_str().unwrap();
            let (code, body) = jaeger.get(&format!("/api/traces/{id}")).unwrap();
            assert_eq!(code, 200, "exemplar trace {id} not in Jaeger: {body}");
            let v: Value = serde_json::from_str(&body).unwrap();
            let spans = v["data"][0]["spans"].as_array().map_or(0, Vec::len);
            assert_eq!(spans, 9, "exemplar trace {id}: {v:#}");
            seen += 1;
        }
    }
    assert!(
        seen >= 2 && seen as u64 <= exported,
        "{seen} exemplars of {exported} exported traces: {ex:#}"
    );
    eprintln!("{seen} exemplars, each a trace in Jaeger");
}

/// The same segments pushed over OTLP as exponential histograms into a
/// real OpenTelemetry Collector, whose Prometheus exporter a real
/// Prometheus scrapes (stored as native histograms): counts exact,
/// percentiles within the histogram's resolution.
#[test]
fn otlp_exponential_histograms_match_the_report() {
    let relay = Collector::metrics_relay().expect("collector");
    let prom = Prometheus::start_native(&relay.prometheus).expect("prometheus");
    let (rig, image) = rig_and_image();
    let host = host_disk_of(&image);
    let a = RunArgs {
        qd: 4,
        ios: 3000,
        name: "otlp-rig".into(),
        no_guest_agent: true,
        ..Default::default()
    };
    let (qemu, _) = guest::qemu_command(&rig, &a, &image);
    let tmp = tempfile::tempdir().unwrap();
    let report = tmp.path().join("otlpm.json");
    run_around(
        Command::new(iospan_bin())
            .args(["run", "--quiet", "--disk", &host])
            .args(agent_integration::rig_split_args())
            .arg("--json-out")
            .arg(&report)
            // Metrics only: Prometheus takes no traces.
            .env(
                "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                format!("http://{}/v1/metrics", relay.otlp_http),
            )
            .env("OTEL_METRIC_EXPORT_INTERVAL", "1000"),
        &qemu,
    );
    let rep: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(
        rep["export"]["chosen"].as_u64(),
        Some(0),
        "no traces asked for"
    );
    let entry = rep["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["vm"] == "otlp-rig" && e["disk"] == "vd0" && e["op"] == "read")
        .unwrap_or_else(|| panic!("{rep:#}"))
        .clone();
    let sel = "virt_vm_name=\"otlp-rig\",virt_disk_id=\"vd0\",disk_io_direction=\"read\"";
    // The run's last push reaches Prometheus at its next scrape of the
    // collector: asked until the last segment's count is the report's.
    let now = scraped(
        &prom,
        &format!(
            "histogram_count(iospan_vm_latency_seconds{{{sel},iospan_segment=\"host_window\"}})"
        ),
        entry["segments"]["host_window"]["count"].as_f64().unwrap(),
    );
    let scalar = |q: &str| -> f64 {
        let v = prom
            .query(q, now)
            .unwrap_or_else(|e| panic!("{e:#}\n{}\n{}", prom.server.log(), relay.server.log()));
        let r = &v["data"]["result"];
        assert_eq!(
            r.as_array().map(Vec::len),
            Some(1),
            "{q}: {v}\n{}\n{}",
            prom.server.log(),
            relay.server.log()
        );
        r[0]["value"][1].as_str().unwrap().parse().unwrap()
    };
    let mut checked = Vec::new();
    for seg in ["hypervisor", "engine", "device", "host_window"] {
        let summary = &entry["segments"][seg];
        let series = format!("iospan_vm_latency_seconds{{{sel},iospan_segment=\"{seg}\"}}");
        assert_eq!(
            scalar(&format!("histogram_count({series})")) as u64,
            summary["count"].as_u64().unwrap(),
            "{seg}: {summary}"
        );
        for (q, key) in [(0.5, "p50_us"), (0.99, "p99_us")] {
            let promql = scalar(&format!("histogram_quantile({q}, {series})"));
            let ours = summary[key].as_f64().unwrap() / 1e6;
            // Exponential buckets of at least 16 per power of two (160
            // buckets over these runs' few decades): a bucket is < 5 %;
            // the report's own histogram adds its 1/64 of an octave.
            assert!(
                (promql - ours).abs() <= 0.07 * ours,
                "{seg} {key}: PromQL {promql} s vs report {ours} s"
            );
            checked.push(format!(
                "{seg} {key}: {:.1} vs {:.1} µs",
                promql * 1e6,
                ours * 1e6
            ));
        }
    }
    eprintln!("{}", checked.join("\n"));
}

/// The Unix time at which `promql` first answers `want` (or 20 s on, for
/// the checks to tell what it answers instead).
fn scraped(prom: &Prometheus, promql: &str, want: f64) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = unix_now();
        let v = prom.query(promql, now).unwrap();
        let got = v["data"]["result"][0]["value"][1]
            .as_str()
            .and_then(|c| c.parse::<f64>().ok());
        if got == Some(want) || Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}
