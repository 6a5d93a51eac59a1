//! Host block-layer attribution against fio and the kernel's own counters,
//! on a scratch loop device over /dev/shm (root).

use std::{path::Path, process::Command};

use agent_integration::{fio_numbers, fio_total_latency, iospan_bin, run};
use iospan::cmd::scratch::ScratchLoop;
use serde_json::Value;

const IOS: u64 = 5000;

struct Case {
    report: Value,
    entry: Value,
    /// fio's count and completion latency: (I/Os, mean, p50, p99) µs.
    fio: (u64, f64, f64, f64),
    /// fio's total latency: (mean, p50, p99) µs.
    fio_lat: (f64, f64, f64),
    /// fio's completion latency p90, µs.
    fio_p90: f64,
}

fn traced_fio(rw: &str, qd: u32) -> Case {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let dev = ScratchLoop::create(Path::new("/dev/shm"), 256).expect("scratch loop device");
    let report_path = dir.join("report.json");
    let fio_path = dir.join("fio.json");
    let out = run(Command::new(iospan_bin())
        .args(["run", "--quiet", "--disk", &dev.name, "--json-out"])
        .arg(&report_path)
        .args([
            "--",
            "fio",
            "--name=t",
            "--ioengine=io_uring",
            "--direct=1",
            "--bs=4k",
            "--size=200M",
            "--lat_percentiles=1",
        ])
        .arg(format!("--filename={}", dev.dev_path()))
        .arg(format!("--rw={rw}"))
        .arg(format!("--iodepth={qd}"))
        .arg(format!("--number_ios={IOS}"))
        .arg("--output-format=json")
        .arg(format!("--output={}", fio_path.display())));
    assert!(
        out.status.success(),
        "iospan run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&std::fs::read(&report_path).unwrap()).unwrap();
    let fio: Value = serde_json::from_slice(&std::fs::read(&fio_path).unwrap()).unwrap();
    let op = if rw.contains("read") { "read" } else { "write" };
    let entries = report["entries"].as_array().expect("entries");
    assert_eq!(
        entries.len(),
        1,
        "one (disk, op) entry on the scratch disk: {entries:#?}"
    );
    let entry = entries[0].clone();
    assert_eq!(entry["disk"], dev.name.as_str());
    assert_eq!(entry["op"], op);
    assert!(entry["vm"].is_null());
    Case {
        fio: fio_numbers(&fio, op),
        fio_lat: fio_total_latency(&fio, op),
        fio_p90: agent_integration::fio_clat_percentile(&fio, op, "90.000000"),
        report,
        entry,
    }
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

fn check(rw: &str, qd: u32) {
    let Case {
        report,
        entry,
        fio,
        fio_lat: (lat_mean, lat_p50, lat_p99),
        fio_p90,
    } = traced_fio(rw, qd);
    let (fio_ios, _, fio_p50, _) = fio;
    let ios = entry["ios"].as_u64().unwrap();
    let ctx = format!("{rw} QD{qd}: {entry:#}");

    // Counts: fio's, and the kernel's own, with nothing lost silently. This
    // kernel now and then completes a request without its completion
    // tracepoint reaching any BPF program (a bpftrace probe misses the same
    // ones); iospan sees that shortfall in the kernel's own accounting and
    // reports it as `unseen`, so traced + unseen is exact, always.
    let unseen = report["lost"]["unseen"].as_u64().unwrap();
    assert_eq!(fio_ios, IOS);
    assert_eq!(entry["kernel"]["ios"].as_u64(), Some(IOS), "{ctx}");
    assert_eq!(ios + unseen, IOS, "{ctx}\nlost: {}", report["lost"]);
    assert!(
        unseen <= IOS / 1000,
        "{unseen} unseen of {IOS}: {}",
        report["lost"]
    );
    if unseen > 0 {
        eprintln!("note: {rw} QD{qd}: {unseen} completion(s) not delivered by the kernel, counted as unseen");
    }
    assert_eq!(entry["bytes"].as_u64(), Some(ios * 4096), "{ctx}");
    for k in [
        "ringbuf_drops",
        "disk_conflicts",
        "slot_conflicts",
        "no_start",
        "no_issue",
        "bpf_recursion_misses",
    ] {
        assert_eq!(
            report["lost"][k].as_u64(),
            Some(0),
            "lost.{k} in {}",
            report["lost"]
        );
    }

    // Every request has both segments, and they tile the total.
    let total = &entry["total"];
    let (q, s) = (&entry["segments"]["queue"], &entry["segments"]["service"]);
    for seg in [total, q, s] {
        assert_eq!(seg["count"].as_u64(), Some(ios), "{ctx}");
        let (p50, p90, p99, p999, max) = (
            f(&seg["p50_us"]),
            f(&seg["p90_us"]),
            f(&seg["p99_us"]),
            f(&seg["p999_us"]),
            f(&seg["max_us"]),
        );
        assert!(
            p50 <= p90 && p90 <= p99 && p99 <= p999 && p999 <= max,
            "percentiles out of order: {seg}"
        );
    }
    let tiled = f(&q["mean_us"]) + f(&s["mean_us"]);
    assert!(
        (tiled - f(&total["mean_us"])).abs() < 0.01,
        "queue + service = {tiled} vs total {total}"
    );

    // The mean against the kernel's own accounting of the same requests
    // (ms resolution). The kernel's span ends after bio completion, which
    // on this two-CPU machine can wait for a CPU: the bio's completion wakes
    // fio, which may run its whole reap-and-resubmit before the completing
    // thread gets the CPU back to close the kernel's span. Never shorter
    // than ours, most often a few µs longer (in CI runs, 30.2 µs against its
    // 40.4, and 49.2 against 73.0), so it bounds ours from above, and at
    // least half of it is ours.
    let k_mean = f(&entry["kernel"]["time_ms"]) * 1000.0 / IOS as f64;
    let mean = f(&total["mean_us"]);
    assert!(
        mean <= k_mean * 1.05 + 1.0 && mean >= 0.5 * k_mean,
        "{ctx}\nmean {mean} µs vs the kernel's {k_mean} µs"
    );

    // Against fio: the block layer's part of what fio sees is never more
    // than fio's total latency (its clat alone misses the part of a
    // request's life spent inside the submission call: once, a QD1 p99 of
    // 155 µs against a clat p99 of 116, a total p99 above both). Request by
    // request ours is inside fio's, so the medians keep that order too (up
    // to our histogram's 12.5% buckets).
    assert!(
        mean <= lat_mean * 1.15 + 10.0,
        "{ctx}\nmean {mean} above fio's latency {lat_mean}"
    );
    let p50 = f(&total["p50_us"]);
    assert!(
        p50 <= lat_p50 * 1.15 + 1.0,
        "{ctx}\np50 {p50} above fio's latency p50 {lat_p50}"
    );
    if qd == 1 {
        // At QD1 it is most of fio's clat, which adds fio's own wakeup
        // after the completion: 1-3 µs on an idle host, over 10 µs on a busy
        // one (a CI run: our mean 49.2 µs against clat 61.5, a 12 µs gap
        // that is all fio's). Medians, as a preempted wakeup inflates the
        // means; when the completion runs inside the submission call, clat
        // is under a µs and the bound is the kernel's above.
        assert!(
            p50 >= 0.5 * fio_p50,
            "{ctx}\np50 {p50} vs fio's clat p50 {fio_p50}"
        );
    }
    // At depth fio's clat has no floor to give ours: its sixteen requests
    // spend most of their life outside the block layer, in io_uring's
    // submission and completion paths and fio's reap loop (fio alone
    // on this loop device, QD16: clat mean 50 µs while the kernel's own
    // accounting of the same reads says 11 µs; a CI run: ours 19.7 µs,
    // the kernel's 20.2, fio's 72.9). The kernel's accounting above bounds
    // ours from both sides there.
    let p99 = f(&total["p99_us"]);
    assert!(
        p99 <= lat_p99 * 1.25,
        "{ctx}\np99 {p99} above fio's total latency p99 {lat_p99}"
    );
    // A floor on the tail only at QD1 (at depth fio's tail is its own reap
    // queue on this two-CPU machine: once, a QD16 block-layer p99 of 181 µs
    // against fio's 1188), and at p90: fio's p99 also holds its wakeups
    // after completion, which wait for a CPU whenever the machine is busy
    // (a CI run beside a compile: fio's clat p99 1433.6 µs against a
    // block-layer p99 of 203 and p90 of 28.7, all of the gap fio's).
    if qd == 1 {
        let p90 = f(&total["p90_us"]);
        assert!(
            p90 >= 0.3 * fio_p90,
            "{ctx}\np90 {p90} implausibly below fio's clat p90 {fio_p90}"
        );
    }
}

#[test]
fn randread_qd1() {
    check("randread", 1);
}

#[test]
fn randwrite_qd1() {
    check("randwrite", 1);
}

#[test]
fn randread_qd16() {
    check("randread", 16);
}

#[test]
fn randwrite_qd16() {
    check("randwrite", 16);
}
