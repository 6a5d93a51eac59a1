//! Benchmark runs on the rig: labelled runs stored, put side by side
//! (`iospan compare` names the segment a change lives in), rendered as an
//! HTML report that a real browser draws, and held to thresholds.

use std::{path::Path, process::Command};

use agent_integration::{host_disk_of, iospan_bin, rig_and_image, run};
use xtask::guest::{self, DiskModel, RunArgs};

/// A labelled `iospan run` of one rig boot; its stdout.
fn labelled(runs: &Path, label: &str, a: &RunArgs, extra: &[&str]) -> (String, i32) {
    let (rig, image) = rig_and_image();
    let host = host_disk_of(&image);
    let _daemon = (a.disk == DiskModel::VhostUser)
        .then(|| guest::storage_daemon(a, &image).unwrap_or_else(|e| panic!("{e:#}")));
    let (qemu, _) = guest::qemu_command(&rig, a, &image);
    let out = run(Command::new(iospan_bin())
        .env("IOSPAN_RUNS_DIR", runs)
        .args(["run", "--quiet", "--disk", &host, "--label", label])
        .args(agent_integration::rig_split_args())
        .args(extra)
        .arg("--")
        .arg(qemu.get_program())
        .args(qemu.get_args()));
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.code().is_some(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (stdout, out.status.code().unwrap_or(-1))
}

fn iospan(runs: &Path, args: &[&str]) -> (String, String, i32) {
    let out = run(Command::new(iospan_bin())
        .env("IOSPAN_RUNS_DIR", runs)
        .args(args));
    (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
        out.status.code().unwrap_or(-1),
    )
}

/// The µs figures of a compare line ("  mean A  750.8  306.3 …").
fn figures(line: &str) -> Vec<f64> {
    line.split_whitespace()
        .filter_map(|w| w.parse::<f64>().ok())
        .collect()
}

#[test]
fn compare_names_the_segment_that_moved_and_the_report_draws() {
    let runs_held = tempfile::Builder::new()
        .prefix("iospan-runs-")
        .tempdir()
        .unwrap();
    let runs = runs_held.path().to_path_buf();
    let base = RunArgs {
        disk: DiskModel::VhostUser,
        // 1000: the p99 tail is ten I/Os, the p99.9 tail one.
        ios: 1000,
        name: "bench-vu".into(),
        no_guest_agent: true,
        ..Default::default()
    };
    labelled_runs_check_and_keep_their_labels(&runs, &base);
    // The same workload on QEMU's own virtio-blk and on vhost-user, the
    // same image: the comparison names, at each statistic, a segment and
    // its share, with the figures behind it.
    compare_two_engines(&runs, &base);
    compare_a_throttled_engine(&runs);
    // The HTML report, drawn by a real browser: each segment's colour is
    // on the page (the tail bars and the CDF).
    let html = report_with_a_failing_check(&runs);
    let png = screenshot(&runs, &html);
    check_segment_colours(&png, &html);
}

fn labelled_runs_check_and_keep_their_labels(runs: &Path, base: &RunArgs) {
    // The same workload, once as is and once behind a throttle in the
    // daemon (200 IOPS at QD1: ~5 ms per I/O spent in the engine).
    let (out, code) = labelled(runs, "vu-free", base, &["--check", "read.p99<10s"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("PASS read.p99<10s"), "{out}");
    assert!(
        out.contains("bench-vu vd0 read") && out.contains("p99+"),
        "the run's tail: {out}"
    );
    let slow = RunArgs {
        throttle_iops: Some(200),
        ..base.clone()
    };
    // A threshold the throttled run cannot meet: the run fails with 1.
    let (out, code) = labelled(runs, "vu-throttled", &slow, &["--check", "read.mean<1ms"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAIL read.mean<1ms"), "{out}");
    // The label is taken now.
    let (_, code) = labelled(runs, "vu-free", base, &[]);
    assert_ne!(code, 0, "a second run under a used label was stored");
}

fn compare_two_engines(runs: &Path, base: &RunArgs) {
    let virtio = RunArgs {
        disk: DiskModel::VirtioBlk,
        name: "bench-virtio".into(),
        ..base.clone()
    };
    let (out, code) = labelled(runs, "virtio-free", &virtio, &[]);
    assert_eq!(code, 0, "{out}");
    let (cmp, err, code) = iospan(runs, &["compare", "virtio-free", "vu-free"]);
    assert_eq!(code, 0, "{err}");
    eprintln!("{cmp}");
    assert!(
        cmp.contains("virtio-free vs vu-free — vd0 read (A: bench-virtio"),
        "{cmp}"
    );
    for at in ["mean", "p99", "p99.9"] {
        let line = cmp
            .lines()
            .find(|l| l.contains(&format!("→ at {at}:")))
            .unwrap_or_else(|| panic!("no verdict at {at}:\n{cmp}"));
        let named = iospan::output::store::PARTS[1..]
            .iter()
            .any(|p| line.contains(&format!("{p} explains")));
        assert!(named && line.contains("µs)"), "{line}");
    }
    for row in cmp.lines().filter(|l| l.contains("B − A")) {
        assert_eq!(figures(row).len(), 5, "{row}");
    }
}

/// At the mean and in the p99 tail (ten I/Os each), the engine is what
/// moved, and at the mean its change is nearly all of the total's.
fn compare_a_throttled_engine(runs: &Path) {
    let (cmp, err, code) = iospan(runs, &["compare", "vu-free", "vu-throttled"]);
    assert_eq!(code, 0, "{err}");
    eprintln!("{cmp}");
    let verdict = |at: &str| {
        cmp.lines()
            .find(|l| l.contains(&format!("→ at {at}:")))
            .unwrap_or_else(|| panic!("no verdict at {at}:\n{cmp}"))
    };
    for at in ["mean", "p99"] {
        let line = verdict(at);
        assert!(line.contains("engine explains"), "{line}\n{cmp}");
        assert!(!line.contains("too few"), "{line}\n{cmp}");
        let share: f64 = line
            .split("explains ")
            .nth(1)
            .and_then(|r| r.split('%').next())
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{line}"));
        if at == "mean" {
            assert!(share >= 80.0, "{line}\n{cmp}");
        }
    }
    // The p99.9 tail is the slowest I/O or two of each run: whichever stall
    // made it slowest decides the verdict, and the verdict says it is one
    // few. It still names the segment whose figures moved most.
    let line = verdict("p99.9");
    assert!(
        line.contains(" I/Os: too few to speak for"),
        "{line}\n{cmp}"
    );
    let delta = cmp
        .lines()
        .skip_while(|l| !l.contains("p99.9+ tail B"))
        .nth(1)
        .map(figures)
        .unwrap_or_else(|| panic!("no p99.9 change row:\n{cmp}"));
    let most = (1..5)
        .max_by(|&i, &j| delta[i].abs().total_cmp(&delta[j].abs()))
        .map(|i| iospan::output::store::PARTS[i])
        .unwrap_or_default();
    assert!(line.contains(&format!("{most} explains")), "{line}\n{cmp}");
    let rows: Vec<&str> = cmp
        .lines()
        .filter(|l| l.trim_start().starts_with("mean "))
        .collect();
    assert_eq!(rows.len(), 2, "{cmp}");
    let (a, b) = (figures(rows[0]), figures(rows[1]));
    assert!(b[0] > a[0] + 1000.0, "the throttle's ms: {cmp}");
}

fn report_with_a_failing_check(runs: &Path) -> std::path::PathBuf {
    let html = runs.join("vu-throttled.html");
    let (summary, err, code) = iospan(
        runs,
        &[
            "report",
            "vu-throttled",
            "--html",
            html.to_str().unwrap(),
            "--check",
            "read.p99.engine<1us",
        ],
    );
    assert_eq!(code, 1, "a failing check: {summary}{err}");
    assert!(summary.contains("FAIL read.p99.engine<1us"), "{summary}");
    html
}

/// The page as chromium draws it, headless.
fn screenshot(runs: &Path, html: &Path) -> std::path::PathBuf {
    let png = runs.join("vu-throttled.png");
    let shot = run(Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
        ])
        .args([
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ])
        .arg(format!(
            "--user-data-dir={}",
            runs.join("chromium").display()
        ))
        .args(["--hide-scrollbars", "--window-size=1000,1800"])
        .arg(format!("--screenshot={}", png.display()))
        .arg(format!("file://{}", html.display())));
    assert!(
        png.exists(),
        "no screenshot: {}",
        String::from_utf8_lossy(&shot.stderr)
    );
    png
}

fn check_segment_colours(png: &Path, html: &Path) {
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(png).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    let px = match info.color_type {
        png::ColorType::Rgba => 4,
        png::ColorType::Rgb => 3,
        c => panic!("colour type {c:?}"),
    };
    for (name, hex) in iospan::output::store::PARTS
        .iter()
        .zip(iospan::output::html::COLOURS)
        .skip(1)
    {
        let rgb: Vec<u8> = (0..3)
            .map(|i| u8::from_str_radix(&hex[1 + 2 * i..3 + 2 * i], 16).unwrap())
            .collect();
        let n = buf[..info.buffer_size()]
            .chunks(px)
            .filter(|p| p[..3] == rgb[..])
            .count();
        assert!(
            n >= 50,
            "{name} ({hex}): {n} pixels in the screenshot of {}",
            html.display()
        );
    }
}

#[test]
fn bad_runs_and_checks_are_refused_naming_them() {
    let runs_held = tempfile::Builder::new()
        .prefix("iospan-runs-bad-")
        .tempdir()
        .unwrap();
    let runs = runs_held.path().to_path_buf();
    let (_, err, code) = iospan(&runs, &["report", "nope"]);
    assert_ne!(code, 0);
    assert!(err.contains("nope") && err.contains("--runs-dir"), "{err}");
    let (_, err, code) = iospan(
        &runs,
        &[
            "run",
            "--check",
            "read.p42<1ms",
            "--label",
            "x",
            "--",
            "true",
        ],
    );
    assert_ne!(code, 0);
    assert!(
        err.contains("read.p42<1ms") && err.contains("statistic"),
        "{err}"
    );
    let (_, err, code) = iospan(&runs, &["run", "--check", "read.p99<1ms", "--", "true"]);
    assert_ne!(code, 0);
    assert!(err.contains("--label"), "{err}");
    let (_, err, code) = iospan(&runs, &["run", "--label", "../up", "--", "true"]);
    assert_ne!(code, 0);
    assert!(err.contains("--label"), "{err}");
    let (_, err, code) = iospan(&runs, &["compare", "only-one"]);
    assert_ne!(code, 0);
    assert!(err.contains("RUN"), "{err}");
}

/// A sweep over the rig's queue depth: one labelled run per level, and a
/// knee past which the IOPS stop scaling while the tail grows.
#[test]
fn a_sweep_finds_the_knee() {
    let runs_held = tempfile::Builder::new()
        .prefix("iospan-runs-sweep-")
        .tempdir()
        .unwrap();
    let runs = runs_held.path().to_path_buf();
    let (rig, image) = rig_and_image();
    let host = host_disk_of(&image);
    // A disk that saturates where it is told to: QEMU's throttle at 1000
    // IOPS, under what one request at a time reaches here (1,800-3,200
    // IOPS). At 4000 the guest's own emulated CPU stopped the IOPS first
    // (3,184 at qd 1, 3,313 at qd 4): a knee with no throttle reached,
    // rightly not diagnosed as one.
    let a = RunArgs {
        qd: 999_999,
        ios: 3000,
        name: "sweep".into(),
        no_guest_agent: true,
        throttle_iops: Some(1000),
        ..Default::default()
    };
    let (qemu, _) = guest::qemu_command(&rig, &a, &image);
    // The level goes where the guest's queue depth is set.
    let args: Vec<String> = qemu
        .get_args()
        .map(|s| {
            s.to_string_lossy()
                .replace("iospan.qd=999999", "iospan.qd={qd}")
        })
        .collect();
    assert!(args.iter().any(|s| s.contains("{qd}")));
    let out = run(Command::new(iospan_bin())
        .env("IOSPAN_RUNS_DIR", &runs)
        .args([
            "sweep",
            "--qd",
            "1,4,16,64",
            "--label",
            "sw",
            "--disk",
            &host,
        ])
        .args(agent_integration::rig_split_args())
        .arg("--")
        .arg(qemu.get_program())
        .args(&args));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    let sweep: serde_json::Value =
        serde_json::from_slice(&std::fs::read(runs.join("sw/sweep.json")).unwrap()).unwrap();
    let curve = &sweep["curves"][0];
    assert_eq!(curve["vm"], "sweep", "{sweep:#}");
    let levels = curve["levels"].as_array().unwrap();
    assert_eq!(levels.len(), 4, "{sweep:#}");
    let knee = &curve["knee"];
    let at = knee["at"]
        .as_u64()
        .unwrap_or_else(|| panic!("no knee: {text}"));
    assert!(at < 64, "{text}");
    // Past the knee: IOPS grew by less than 15% per doubling of the depth,
    // while the p99 rose; a segment grew.
    let iops = |v: u64| {
        levels
            .iter()
            .find(|l| l["value"].as_u64() == Some(v))
            .and_then(|l| l["iops"].as_f64())
            .unwrap()
    };
    let next = knee["next"].as_u64().unwrap();
    let doublings = (next as f64 / at as f64).log2();
    assert!(
        (iops(next) / iops(at)).powf(1.0 / doublings) - 1.0 < 0.15,
        "{text}"
    );
    assert!(knee["p99_gain"].as_f64().unwrap() > 0.25, "{text}");
    assert!(knee["segment_growth_us"].as_f64().unwrap() > 0.0, "{text}");
    assert!(
        text.contains("← knee") && text.contains("knee at qd"),
        "{text}"
    );
    // The level past the knee carries its run's diagnosis: the throttle
    // that made the knee, with the setting that moves it.
    assert_eq!(knee["diagnosis"]["cause"], "throttle", "{text}");
    assert!(
        text.contains("past the knee") && text.contains("what limits it: QEMU's throttle"),
        "{text}"
    );
    // Each level is a stored run of its own.
    let (summary, err, code) = iospan(&runs, &["report", &format!("sw-qd{at}")]);
    assert_eq!(code, 0, "{err}");
    assert!(summary.contains("sweep vd0 read"), "{summary}");
}
