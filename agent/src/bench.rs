//! Benchmark runs: what a labelled run keeps beyond its report — where its
//! slowest I/Os spend their time (the tail's composition, per segment), a
//! time series per interval, fio's own figures — stored under a runs
//! directory, then rendered (`report`), put side by side (`compare`) and
//! held to thresholds (`Check`).

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::{
    live::{Frame, SEGMENTS},
    model::Op,
    report::RunReport,
    stitch::IoSpan,
    vms::Registry,
};

pub const SCHEMA: &str = "iospan.bench/v1";

/// Where labelled runs go unless told: IOSPAN_RUNS_DIR, else the agent's
/// state directory.
pub fn default_runs_dir() -> PathBuf {
    std::env::var_os("IOSPAN_RUNS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/iospan/runs"))
}

/// The segments of one I/O as the tail keeps them: total, guest,
/// hypervisor, engine, device (ns; the guest's 0 without a guest agent,
/// the total then the host window).
type Parts = [u32; 5];

pub const PARTS: [&str; 5] = ["total", "guest", "hypervisor", "engine", "device"];

/// I/Os kept per (VM, virtual disk, op) before the rest are sampled.
const KEEP: usize = 1 << 20;

#[derive(Default)]
struct Reservoir {
    kept: Vec<Parts>,
    seen: u64,
    rng: u64,
    /// The first kick and the last signal seen (host clock, ns).
    first_ns: u64,
    last_ns: u64,
}

impl Reservoir {
    fn add(&mut self, p: Parts) {
        self.seen += 1;
        if self.kept.len() < KEEP {
            self.kept.push(p);
            return;
        }
        // Beyond KEEP, each I/O replaces a kept one with probability
        // KEEP/seen: the kept ones stay a uniform sample.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let j = self.rng % self.seen;
        if (j as usize) < KEEP {
            self.kept[j as usize] = p;
        }
    }
}

/// Every joined (or host-window) I/O of a run, by (VM, vdisk, op) slot.
#[derive(Default)]
pub struct Tails {
    per: BTreeMap<(u32, u32, Op), Reservoir>,
}

impl Tails {
    pub fn record(&mut self, sp: &IoSpan) {
        let c = |ns: u64| ns.min(u64::from(u32::MAX)) as u32;
        let r = self
            .per
            .entry((sp.vm, sp.vdisk, sp.op))
            .or_insert_with(|| Reservoir {
                rng: 0x9e37_79b9_7f4a_7c15,
                ..Default::default()
            });
        if r.first_ns == 0 || sp.kick_ns < r.first_ns {
            r.first_ns = sp.kick_ns;
        }
        r.last_ns = r.last_ns.max(sp.signal_ns);
        r.add([
            c(sp.total_ns),
            c(sp.guest_ns),
            c(sp.hypervisor_ns),
            c(sp.engine_ns),
            c(sp.device_ns),
        ]);
    }

    /// Per (VM, virtual disk, op), named.
    pub fn entries(&self, known: &Registry) -> Vec<TailEntry> {
        self.per
            .iter()
            .filter_map(|((vm, vdisk, op), r)| {
                Some(TailEntry {
                    vm: known.name(*vm),
                    disk: known.vdisk(*vdisk)?.to_string(),
                    op: *op,
                    ios: r.seen,
                    // Over the disk's busy span (first kick to last signal),
                    // not the whole run: boots and pauses do not count.
                    iops: {
                        let span = r.last_ns.saturating_sub(r.first_ns) as f64 / 1e9;
                        if span > 0.0 {
                            r.seen as f64 / span
                        } else {
                            0.0
                        }
                    },
                    sampled: r.seen > r.kept.len() as u64,
                    guest_observed: r.kept.iter().any(|p| p[1] > 0),
                    bands: bands(&r.kept),
                    cdf: cdf(&r.kept),
                })
            })
            .collect()
    }
}

/// The percentiles whose tails are kept: everything, then the slowest
/// half, tenth, hundredth and thousandth.
pub const BAND_FROM: [f64; 5] = [0.0, 50.0, 90.0, 99.0, 99.9];

/// The I/Os at or above a percentile of total latency, and where their
/// time went on average.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Band {
    pub from_pct: f64,
    pub ios: u64,
    /// The total latency at the percentile (the band's fastest I/O).
    pub threshold_us: f64,
    /// Mean per part, in `PARTS` order.
    pub mean_us: [f64; 5],
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TailEntry {
    pub vm: String,
    pub disk: String,
    pub op: Op,
    pub ios: u64,
    /// I/Os per second from the first I/O to the last.
    #[serde(default)]
    pub iops: f64,
    /// More I/Os than kept: the bands are of a uniform sample.
    pub sampled: bool,
    /// Totals are guest-observed (guest agent), else host windows.
    pub guest_observed: bool,
    pub bands: Vec<Band>,
    /// Per part, (latency µs, fraction at or below) at log-spaced points.
    pub cdf: Vec<Vec<(f64, f64)>>,
}

impl TailEntry {
    pub fn band(&self, from_pct: f64) -> Option<&Band> {
        self.bands
            .iter()
            .find(|b| (b.from_pct - from_pct).abs() < 1e-9)
    }
}

fn bands(kept: &[Parts]) -> Vec<Band> {
    let mut sorted = kept.to_vec();
    sorted.sort_unstable_by_key(|p| p[0]);
    let n = sorted.len();
    BAND_FROM
        .iter()
        .filter_map(|&pct| {
            let first = ((pct / 100.0) * n as f64).floor() as usize;
            let tail = sorted.get(first.min(n)..)?;
            if tail.is_empty() {
                return None;
            }
            let mut mean_us = [0.0; 5];
            for p in tail {
                for (m, v) in mean_us.iter_mut().zip(p) {
                    *m += f64::from(*v);
                }
            }
            for m in &mut mean_us {
                *m /= tail.len() as f64 * 1e3;
            }
            Some(Band {
                from_pct: pct,
                ios: tail.len() as u64,
                threshold_us: f64::from(tail[0][0]) / 1e3,
                mean_us,
            })
        })
        .collect()
}

fn cdf(kept: &[Parts]) -> Vec<Vec<(f64, f64)>> {
    (0..5)
        .map(|i| {
            let mut v: Vec<u32> = kept.iter().map(|p| p[i]).collect();
            v.sort_unstable();
            let n = v.len();
            if n == 0 {
                return Vec::new();
            }
            // 200 points spread over the ranks, plus the last.
            let step = (n / 200).max(1);
            let mut pts: Vec<(f64, f64)> = (0..n)
                .step_by(step)
                .map(|k| (f64::from(v[k]) / 1e3, (k + 1) as f64 / n as f64))
                .collect();
            pts.push((f64::from(v[n - 1]) / 1e3, 1.0));
            pts
        })
        .collect()
}

/// One interval of a (VM, virtual disk, op).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Point {
    pub t_s: f64,
    pub iops: f64,
    /// p99 per live segment name (total, guest, hv, engine, device, queue).
    pub p99_us: BTreeMap<String, f64>,
    pub mean_us: BTreeMap<String, f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Series {
    pub vm: String,
    pub disk: String,
    pub op: Op,
    pub points: Vec<Point>,
}

/// Builds the time series from a run's frames, one interval at a time
/// (frames are not kept).
#[derive(Default)]
pub struct SeriesBuilder {
    t0: Option<f64>,
    prev: Option<Frame>,
    series: BTreeMap<(String, String, Op), Vec<Point>>,
}

impl SeriesBuilder {
    pub fn add(&mut self, f: &Frame) {
        let t0 = *self.t0.get_or_insert(f.at_s);
        if let Some(prev) = &self.prev {
            let secs = (f.at_s - prev.at_s).max(1e-3);
            for r in &f.vdisks {
                let d = r.since(prev.vdisks.iter().find(|p| p.same(r)));
                let mut p = Point {
                    t_s: f.at_s - t0,
                    iops: d.ios as f64 / secs,
                    p99_us: BTreeMap::new(),
                    mean_us: BTreeMap::new(),
                };
                for name in SEGMENTS {
                    if let Some(h) = d.segs.get(name).filter(|h| h.count > 0) {
                        p.p99_us.insert(name.into(), h.quantile_ns(0.99) / 1e3);
                        p.mean_us.insert(name.into(), h.mean_ns() / 1e3);
                    }
                }
                self.series
                    .entry((r.vm.clone(), r.disk.clone(), r.op))
                    .or_default()
                    .push(p);
            }
        }
        self.prev = Some(f.clone());
    }

    pub fn finish(self) -> Vec<Series> {
        self.series
            .into_iter()
            .map(|((vm, disk, op), points)| Series {
                vm,
                disk,
                op,
                points,
            })
            .collect()
    }
}

/// fio's own figures for a job and direction (from its JSON output).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FioFigures {
    pub job: String,
    pub op: Op,
    pub ios: u64,
    pub iops: f64,
    /// Total latency (submission to completion, fio's lat_ns).
    pub mean_us: f64,
    pub p99_us: Option<f64>,
    pub p999_us: Option<f64>,
}

/// fio's JSON output (`--output-format=json`), per job and direction.
pub fn parse_fio(text: &str) -> Result<Vec<FioFigures>> {
    // fio may print notes before the JSON document.
    let start = text.find('{').context("no JSON document in fio's output")?;
    let v: serde_json::Value = serde_json::from_str(&text[start..]).context("fio's JSON output")?;
    let jobs = v["jobs"].as_array().context("fio's JSON has no jobs")?;
    let mut out = Vec::new();
    for j in jobs {
        for (key, op) in [("read", Op::Read), ("write", Op::Write)] {
            let d = &j[key];
            let ios = d["total_ios"].as_u64().unwrap_or(0);
            if ios == 0 {
                continue;
            }
            let lat = &d["lat_ns"];
            let pct = |p: &str| {
                lat["percentile"][p]
                    .as_f64()
                    .or_else(|| d["clat_ns"]["percentile"][p].as_f64())
                    .map(|ns| ns / 1e3)
            };
            out.push(FioFigures {
                job: j["jobname"].as_str().unwrap_or("").to_string(),
                op,
                ios,
                iops: d["iops"].as_f64().unwrap_or(0.0),
                mean_us: lat["mean"].as_f64().unwrap_or(0.0) / 1e3,
                p99_us: pct("99.000000"),
                p999_us: pct("99.900000"),
            });
        }
    }
    Ok(out)
}

/// The file fio writes its JSON to, when its command line says so
/// (`--output-format` with json, and `--output=FILE`).
pub fn fio_json_output(command: &[String]) -> Option<PathBuf> {
    let prog = command.first()?;
    if Path::new(prog).file_name()? != "fio" {
        return None;
    }
    let mut format = None;
    let mut output = None;
    let mut it = command.iter().skip(1);
    while let Some(a) = it.next() {
        let (k, v) = match a.split_once('=') {
            Some((k, v)) => (k.to_string(), Some(v.to_string())),
            None => (a.clone(), None),
        };
        let mut value = || v.clone().or_else(|| it.next().cloned());
        match k.as_str() {
            "--output-format" => format = value(),
            "--output" => output = value(),
            _ => {}
        }
    }
    format
        .filter(|f| f.split(',').any(|f| f.starts_with("json")))
        .and(output)
        .map(PathBuf::from)
}

/// A stored run: `RUNS/LABEL/run.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StoredRun {
    pub schema: String,
    pub label: String,
    /// Seconds since the epoch at its end.
    pub finished_unix_s: u64,
    pub report: RunReport,
    pub tails: Vec<TailEntry>,
    pub series: Vec<Series>,
    #[serde(default)]
    pub fio: Vec<FioFigures>,
    /// Why fio's figures are missing, for a fio command.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fio_note: Option<String>,
    /// Where it ran: runs from several hosts are compared side by side.
    #[serde(default)]
    pub host: HostInfo,
}

/// The host a run ran on, as compare names it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HostInfo {
    pub name: String,
    pub kernel: String,
    pub cpu: String,
    pub cpus: usize,
    pub memory_gib: f64,
}

impl HostInfo {
    /// This host (fields it cannot read are left empty).
    pub fn this() -> Self {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let cpuinfo = read("/proc/cpuinfo");
        let meminfo = read("/proc/meminfo");
        Self {
            name: read("/proc/sys/kernel/hostname").trim().to_string(),
            kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
            cpu: cpuinfo
                .lines()
                .find_map(|l| {
                    l.strip_prefix("model name")?
                        .split_once(':')
                        .map(|(_, v)| v.trim().to_string())
                })
                .unwrap_or_default(),
            cpus: cpuinfo
                .lines()
                .filter(|l| l.starts_with("processor"))
                .count(),
            memory_gib: meminfo
                .lines()
                .find_map(|l| {
                    l.strip_prefix("MemTotal:")?
                        .trim()
                        .strip_suffix("kB")?
                        .trim()
                        .parse::<f64>()
                        .ok()
                })
                .map_or(0.0, |kb| kb / (1024.0 * 1024.0)),
        }
    }

    pub fn describe(&self) -> String {
        if self.name.is_empty() {
            return "host not recorded".into();
        }
        format!(
            "{} (kernel {}, {} × {}, {:.1} GiB)",
            self.name, self.kernel, self.cpus, self.cpu, self.memory_gib
        )
    }
}

/// A label usable as a directory name.
pub fn check_label(label: &str) -> Result<()> {
    if label.is_empty()
        || label.len() > 100
        || label.starts_with('.')
        || !label
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '+' | '@'))
    {
        bail!(
            "--label {label:?}: use letters, digits and - _ . + @ (up to 100, not starting with .)"
        );
    }
    Ok(())
}

/// The directory a new run goes to; refused if one by that label exists.
pub fn new_run_dir(runs: &Path, label: &str) -> Result<PathBuf> {
    check_label(label)?;
    let dir = runs.join(label);
    if dir.join("run.json").exists() {
        bail!(
            "run {label:?} exists in {}: choose another --label, or remove {}",
            runs.display(),
            dir.display()
        );
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

impl StoredRun {
    pub fn save(&self, dir: &Path) -> Result<PathBuf> {
        let p = dir.join("run.json");
        let tmp = dir.join(".run.json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(self)?)
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &p).with_context(|| format!("writing {}", p.display()))?;
        Ok(p)
    }

    /// A run by label (in `runs`), or by its directory or run.json path.
    pub fn load(runs: &Path, name: &str) -> Result<Self> {
        let given = Path::new(name);
        let path = if given.is_file() {
            given.to_path_buf()
        } else if given.join("run.json").is_file() {
            given.join("run.json")
        } else {
            runs.join(name).join("run.json")
        };
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "run {name:?}: no {} (a label in --runs-dir {}, or a run's directory)",
                path.display(),
                runs.display()
            )
        })?;
        let r: Self =
            serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
        if r.schema != SCHEMA {
            bail!("{}: schema {:?}, not {SCHEMA}", path.display(), r.schema);
        }
        Ok(r)
    }

    /// The terminal summary: the report's table, then each virtual disk's
    /// tail and fio's own figures beside iospan's.
    pub fn summary(&self) -> String {
        let mut out = format!(
            "run {} — {:.1} s{}\n{}\n",
            self.label,
            self.report.duration_s,
            self.report
                .command
                .as_ref()
                .map(|c| format!(", {}", c.join(" ")))
                .unwrap_or_default(),
            if self.host.name.is_empty() {
                String::new()
            } else {
                format!("on {}\n", self.host.describe())
            }
        );
        out += &self.report.table();
        for t in &self.tails {
            let _ = writeln!(
                out,
                "\n{} {} {} — {} I/Os at {:.0} IOPS, {}: where the time goes, by tail (mean µs){}",
                t.vm,
                t.disk,
                t.op,
                t.ios,
                t.iops,
                if t.guest_observed {
                    "guest-observed"
                } else {
                    "host window only"
                },
                if t.sampled { ", a uniform sample" } else { "" }
            );
            let _ = writeln!(
                out,
                "  {:<8} {:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
                "I/Os", "count", "from µs", "total", "guest", "hv", "engine", "device"
            );
            for b in &t.bands {
                let _ = writeln!(
                    out,
                    "  {:<8} {:>7} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
                    band_name(b.from_pct),
                    b.ios,
                    b.threshold_us,
                    b.mean_us[0],
                    b.mean_us[1],
                    b.mean_us[2],
                    b.mean_us[3],
                    b.mean_us[4]
                );
            }
        }
        if !self.fio.is_empty() {
            let _ = writeln!(out, "\nfio's own figures (total latency, lat_ns):");
            for f in &self.fio {
                let _ = writeln!(
                    out,
                    "  {} {}: {} I/Os, {:.0} IOPS, mean {:.1} µs, p99 {}, p99.9 {}",
                    f.job,
                    f.op,
                    f.ios,
                    f.iops,
                    f.mean_us,
                    f.p99_us.map_or("-".into(), |v| format!("{v:.1} µs")),
                    f.p999_us.map_or("-".into(), |v| format!("{v:.1} µs"))
                );
            }
        }
        if let Some(n) = &self.fio_note {
            let _ = writeln!(out, "\nfio: {n}");
        }
        out
    }
}

pub fn band_name(from_pct: f64) -> String {
    if from_pct == 0.0 {
        "all".into()
    } else {
        format!("p{}+", trim(from_pct))
    }
}

fn trim(v: f64) -> String {
    let s = format!("{v:.1}");
    s.trim_end_matches(".0").to_string()
}

/// The tails of two runs for the same virtual disk and op: by VM, disk and
/// op; else by disk and op when each run has one VM (one workload on two
/// platforms, its VMs named differently).
pub fn pairs<'a>(a: &'a StoredRun, b: &'a StoredRun) -> Vec<(&'a TailEntry, &'a TailEntry)> {
    let mut out = Vec::new();
    for x in &a.tails {
        if let Some(y) = b
            .tails
            .iter()
            .find(|y| y.vm == x.vm && y.disk == x.disk && y.op == x.op)
        {
            out.push((x, y));
        }
    }
    if out.is_empty() {
        for x in &a.tails {
            let mut ys = b.tails.iter().filter(|y| y.disk == x.disk && y.op == x.op);
            let xs = a
                .tails
                .iter()
                .filter(|z| z.disk == x.disk && z.op == x.op)
                .count();
            if let (Some(y), None, 1) = (ys.next(), ys.next(), xs) {
                out.push((x, y));
            }
        }
    }
    // One workload on two platforms: the disk's name is the platform's
    // (vd0 here, drive-virtio-disk0 there); one disk per op on each side
    // pairs by op.
    if out.is_empty() {
        for x in &a.tails {
            let one = |r: &'a StoredRun| {
                let mut it = r.tails.iter().filter(|z| z.op == x.op);
                match (it.next(), it.next()) {
                    (Some(z), None) => Some(z),
                    _ => None,
                }
            };
            if let (Some(_), Some(y)) = (one(a), one(b)) {
                out.push((x, y));
            }
        }
    }
    out
}

/// Where a difference between two runs lies at one statistic.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Difference {
    /// "mean", "p99", "p99.9".
    pub at: String,
    pub a_us: [f64; 5],
    pub b_us: [f64; 5],
    /// The I/Os behind each side's figures.
    pub a_ios: u64,
    pub b_ios: u64,
    /// The segment whose change is the largest, and its share of the
    /// total's change.
    pub segment: &'static str,
    pub share: f64,
}

/// Fewer I/Os than this in a tail and its mean is a handful of I/Os, not
/// the run's tail: one stall anywhere decides the verdict.
pub const FEW_IOS: u64 = 10;

impl Difference {
    pub fn few(&self) -> bool {
        self.a_ios.min(self.b_ios) < FEW_IOS
    }
}

/// Mean, p99 tail and p99.9 tail of two runs' I/Os on one disk, and the
/// segment that explains each difference.
pub fn differences(x: &TailEntry, y: &TailEntry) -> Vec<Difference> {
    [("mean", 0.0), ("p99", 99.0), ("p99.9", 99.9)]
        .iter()
        .filter_map(|&(at, pct)| {
            let (a, b) = (x.band(pct)?, y.band(pct)?);
            let d: Vec<f64> = (0..5).map(|i| b.mean_us[i] - a.mean_us[i]).collect();
            let (i, di) = (1..5)
                .map(|i| (i, d[i]))
                .max_by(|p, q| p.1.abs().total_cmp(&q.1.abs()))?;
            Some(Difference {
                at: at.into(),
                a_us: a.mean_us,
                b_us: b.mean_us,
                a_ios: a.ios,
                b_ios: b.ios,
                segment: PARTS[i],
                share: if d[0].abs() > 0.0 { di / d[0] } else { 0.0 },
            })
        })
        .collect()
}

/// The run length whose tail at `at` holds `FEW_IOS` I/Os.
fn tail_needs(at: &str) -> u64 {
    let pct: f64 = at.trim_start_matches('p').parse().unwrap_or(99.0);
    (FEW_IOS as f64 / (1.0 - pct / 100.0)).round() as u64
}

/// `iospan compare`'s text: each pair of runs against the first.
pub fn compare_text(runs: &[StoredRun]) -> Result<String> {
    let Some((base, rest)) = runs.split_first() else {
        bail!("give two runs or more");
    };
    if rest.is_empty() {
        bail!("give two runs or more (one given: {})", base.label);
    }
    // Runs of one label from several hosts (one workload, two platforms)
    // are told apart by their host.
    let name = |r: &StoredRun| {
        if runs
            .iter()
            .any(|o| o.label == r.label && o.host.name != r.host.name)
        {
            format!("{}@{}", r.label, r.host.name)
        } else {
            r.label.clone()
        }
    };
    let mut out = String::new();
    if runs.iter().any(|r| r.host != base.host) {
        for r in runs {
            let _ = writeln!(out, "{}: {}", name(r), r.host.describe());
        }
        out.push('\n');
    }
    for other in rest {
        let ps = pairs(base, other);
        if ps.is_empty() {
            bail!(
                "runs {} and {} have no virtual disk in common to compare (by VM, disk and op; or by disk and op with one VM each)",
                name(base),
                name(other)
            );
        }
        for (x, y) in ps {
            let _ = writeln!(
                out,
                "{} vs {} — {} {} (A: {} {} I/Os{}; B: {} {} I/Os{})",
                name(base),
                name(other),
                x.disk,
                x.op,
                x.vm,
                x.ios,
                if x.guest_observed {
                    ""
                } else {
                    ", host window"
                },
                y.vm,
                y.ios,
                if y.guest_observed {
                    ""
                } else {
                    ", host window"
                },
            );
            let _ = writeln!(
                out,
                "  {:<14} {:>10} {:>10} {:>10} {:>10} {:>10}",
                "µs", "total", "guest", "hv", "engine", "device"
            );
            for d in differences(x, y) {
                let row = |name: &str, v: [f64; 5]| {
                    format!(
                        "  {:<14} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}\n",
                        name, v[0], v[1], v[2], v[3], v[4]
                    )
                };
                let label = if d.at == "mean" {
                    "mean".to_string()
                } else {
                    format!("{}+ tail", d.at)
                };
                out += &row(&format!("{label} A"), d.a_us);
                out += &row(&format!("{label} B"), d.b_us);
                let delta: [f64; 5] = std::array::from_fn(|i| d.b_us[i] - d.a_us[i]);
                out += &row("  B − A", delta);
                let _ = writeln!(
                    out,
                    "  → at {}: {} explains {:.0}% of the change ({:+.1} of {:+.1} µs){}",
                    d.at,
                    d.segment,
                    d.share * 100.0,
                    delta[PARTS.iter().position(|p| *p == d.segment).unwrap_or(0)],
                    delta[0],
                    if d.at == "mean" {
                        String::new()
                    } else {
                        format!(
                            "; {} and {} I/Os{}",
                            d.a_ios,
                            d.b_ios,
                            if d.few() {
                                format!(
                                    ": too few to speak for the runs' tails (at {} they need {} I/Os or more each)",
                                    d.at,
                                    tail_needs(&d.at)
                                )
                            } else {
                                String::new()
                            }
                        )
                    }
                );
            }
            out.push('\n');
        }
    }
    Ok(out)
}

/// A threshold: `[VDISK:]OP.STAT[.SEGMENT]<DURATION`, e.g. `read.p99<20ms`,
/// `vd1:write.p99<10ms`, `read.mean.device<2ms`.
#[derive(Clone, Debug, PartialEq)]
pub struct Check {
    pub text: String,
    pub disk: Option<String>,
    pub op: Op,
    pub stat: String,
    pub segment: String,
    pub limit_us: f64,
}

impl std::str::FromStr for Check {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |why: &str| {
            format!("{s:?}: {why} (e.g. read.p99<20ms, vd1:write.p99<10ms, read.mean.device<2ms)")
        };
        let (lhs, limit) = s.split_once('<').ok_or_else(|| bad("no '<'"))?;
        let limit_us = humantime::parse_duration(limit.trim())
            .map_err(|e| bad(&format!("{limit}: {e}")))?
            .as_nanos() as f64
            / 1e3;
        let (disk, rest) = match lhs.split_once(':') {
            Some((d, r)) => (Some(d.to_string()), r),
            None => (None, lhs),
        };
        let mut parts = rest.trim().split('.');
        let op = match parts.next() {
            Some("read") => Op::Read,
            Some("write") => Op::Write,
            _ => return Err(bad("the op is read or write")),
        };
        let stat = parts.next().unwrap_or("");
        // p99.9 is written p999 (or p99.9, whose ".9" is taken back here).
        let (stat, mut next) = match (stat, parts.next()) {
            ("p99", Some("9")) => ("p999".to_string(), parts.next()),
            (st, n) => (st.to_string(), n),
        };
        if !matches!(
            stat.as_str(),
            "mean" | "p50" | "p90" | "p99" | "p999" | "max"
        ) {
            return Err(bad("the statistic is mean, p50, p90, p99, p999 or max"));
        }
        let segment = next.take().unwrap_or("total").to_string();
        if !PARTS.contains(&segment.as_str()) || parts.next().is_some() {
            return Err(bad(
                "the segment is total, guest, hypervisor, engine or device",
            ));
        }
        Ok(Self {
            text: s.to_string(),
            disk,
            op,
            stat,
            segment,
            limit_us,
        })
    }
}

/// One check against one VM disk: its value and whether it passed.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    pub check: String,
    pub vm: String,
    pub disk: String,
    pub value_us: f64,
    pub pass: bool,
}

impl Check {
    /// The check against every matching VM entry of the report: the
    /// guest-observed figures where joined, else the host's (window and
    /// split). Error when nothing matches.
    pub fn evaluate(&self, report: &RunReport) -> Result<Vec<Verdict>> {
        let mut out = Vec::new();
        for e in &report.entries {
            let Some(vm) = &e.vm else { continue };
            if e.op != self.op || self.disk.as_ref().is_some_and(|d| *d != e.disk) {
                continue;
            }
            let seg = match (&e.stitched, self.segment.as_str()) {
                (Some(s), name) => s.segments.get(name),
                (None, "total") => e.segments.get("host_window"),
                (None, name) => e.segments.get(name),
            };
            let Some(sum) = seg else { continue };
            let value_us = match self.stat.as_str() {
                "mean" => sum.mean_us,
                "p50" => sum.p50_us,
                "p90" => sum.p90_us,
                "p99" => sum.p99_us,
                "p999" => sum.p999_us,
                _ => sum.max_us,
            };
            out.push(Verdict {
                check: self.text.clone(),
                vm: vm.clone(),
                disk: e.disk.clone(),
                value_us,
                pass: value_us < self.limit_us,
            });
        }
        if out.is_empty() {
            bail!(
                "check {}: no VM {} entry{} with that segment in the run",
                self.text,
                self.op,
                self.disk
                    .as_ref()
                    .map(|d| format!(" on disk {d}"))
                    .unwrap_or_default()
            );
        }
        Ok(out)
    }
}

/// Verdicts as lines, and whether all passed.
pub fn verdict_text(v: &[Verdict]) -> (String, bool) {
    let mut out = String::new();
    for x in v {
        let _ = writeln!(
            out,
            "{} {}  ({} {}: {:.1} µs)",
            if x.pass { "PASS" } else { "FAIL" },
            x.check,
            x.vm,
            x.disk,
            x.value_us
        );
    }
    (out, v.iter().all(|x| x.pass))
}

/// What `iospan run --label` adds to a run.
pub struct Labelled {
    pub label: String,
    pub runs_dir: PathBuf,
}

/// A run stored under its label: the report, its tails, its time series
/// (a frame a second) and fio's figures when the command is fio writing
/// JSON. Returns the stored run and where it went.
pub async fn run_labelled(
    mut opts: crate::run::RunOptions,
    l: &Labelled,
) -> Result<(crate::run::RunOutcome, StoredRun, PathBuf)> {
    let dir = new_run_dir(&l.runs_dir, &l.label)?;
    let fio_out = fio_json_output(&opts.command);
    let is_fio = opts
        .command
        .first()
        .is_some_and(|p| Path::new(p).file_name().is_some_and(|n| n == "fio"));
    let (tx, mut rx) = tokio::sync::watch::channel(None);
    opts.live = Some(crate::run::LiveFeed {
        tx,
        every: std::time::Duration::from_secs(1),
    });
    opts.tails = true;
    if opts.traces.run_label.is_none() {
        opts.traces.run_label = Some(l.label.clone());
    }
    let collect = tokio::spawn(async move {
        let mut b = SeriesBuilder::default();
        while rx.changed().await.is_ok() {
            let f = rx.borrow_and_update().clone();
            if let Some(f) = f {
                b.add(&f);
            }
        }
        b.finish()
    });
    let outcome = crate::run::run(opts).await;
    let outcome = match outcome {
        Ok(o) => o,
        Err(e) => {
            // Nothing stored: the label stays free.
            let _ = std::fs::remove_dir(&dir);
            return Err(e);
        }
    };
    let series = collect.await.unwrap_or_default();
    let (fio, fio_note) = match (&fio_out, is_fio) {
        (Some(p), _) => match std::fs::read_to_string(p)
            .with_context(|| format!("reading fio's output {}", p.display()))
            .and_then(|t| {
                std::fs::write(dir.join("fio.json"), &t)?;
                parse_fio(&t)
            }) {
            Ok(f) => (f, None),
            Err(e) => (Vec::new(), Some(format!("{e:#}"))),
        },
        (None, true) => (
            Vec::new(),
            Some(
                "its output is not attached: run fio with --output-format=json --output=FILE"
                    .into(),
            ),
        ),
        (None, false) => (Vec::new(), None),
    };
    let stored = StoredRun {
        schema: SCHEMA.into(),
        label: l.label.clone(),
        finished_unix_s: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        report: outcome.report.clone(),
        tails: outcome.tails.clone(),
        series,
        fio,
        fio_note,
        host: HostInfo::this(),
    };
    let path = stored.save(&dir)?;
    Ok((outcome, stored, path))
}

/// One level of a sweep, for one VM disk and op.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Level {
    pub value: u32,
    pub label: String,
    /// Over the disk's busy span (`TailEntry::iops`).
    pub iops: f64,
    /// p99 of the total (guest-observed where joined, else the host window).
    pub p99_us: f64,
    /// Mean per part (`PARTS`), over all I/Os.
    pub mean_us: [f64; 5],
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Knee {
    /// The last level before IOPS stopped growing while latency rose.
    pub at: u32,
    pub iops: f64,
    pub next: u32,
    pub iops_gain: f64,
    pub p99_gain: f64,
    /// The segment whose mean grew most from the knee to the next level.
    pub segment: String,
    pub segment_growth_us: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SweepCurve {
    pub vm: String,
    pub disk: String,
    pub op: Op,
    pub levels: Vec<Level>,
    pub knee: Option<Knee>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SweepResult {
    pub schema: String,
    /// "qd" or "jobs".
    pub over: String,
    pub command: Vec<String>,
    pub curves: Vec<SweepCurve>,
}

/// From one level to the next, IOPS grew by less than this per doubling of
/// the level (queue depth or jobs)...
pub const KNEE_IOPS_PER_DOUBLING: f64 = 0.15;
/// ... while p99 latency grew by more than this: saturated.
pub const KNEE_P99_GAIN: f64 = 0.25;

/// The first level past which IOPS stops growing while latency rises.
pub fn knee(levels: &[Level]) -> Option<Knee> {
    levels.windows(2).find_map(|w| {
        let (a, b) = (&w[0], &w[1]);
        if a.iops <= 0.0 || a.p99_us <= 0.0 {
            return None;
        }
        let iops_gain = b.iops / a.iops - 1.0;
        let p99_gain = b.p99_us / a.p99_us - 1.0;
        let doublings = (f64::from(b.value) / f64::from(a.value.max(1))).log2();
        if doublings <= 0.0 {
            return None;
        }
        let per_doubling = (b.iops / a.iops).powf(1.0 / doublings) - 1.0;
        if per_doubling >= KNEE_IOPS_PER_DOUBLING || p99_gain <= KNEE_P99_GAIN {
            return None;
        }
        let (i, g) = (1..5)
            .map(|i| (i, b.mean_us[i] - a.mean_us[i]))
            .max_by(|x, y| x.1.total_cmp(&y.1))?;
        Some(Knee {
            at: a.value,
            iops: a.iops,
            next: b.value,
            iops_gain,
            p99_gain,
            segment: PARTS[i].to_string(),
            segment_growth_us: g,
        })
    })
}

/// The levels' figures per VM disk and op, from their stored runs.
pub fn curves(levels: &[(u32, StoredRun)]) -> Vec<SweepCurve> {
    let mut by: BTreeMap<(String, String, Op), Vec<Level>> = BTreeMap::new();
    for (value, run) in levels {
        for t in &run.tails {
            let Some(all) = t.band(0.0) else { continue };
            let entry = run.report.entries.iter().find(|e| {
                e.vm.as_deref() == Some(t.vm.as_str()) && e.disk == t.disk && e.op == t.op
            });
            let Some(e) = entry else { continue };
            let p99_us = e
                .stitched
                .as_ref()
                .and_then(|s| s.segments.get("total"))
                .or_else(|| e.segments.get("host_window"))
                .map_or(0.0, |s| s.p99_us);
            by.entry((t.vm.clone(), t.disk.clone(), t.op))
                .or_default()
                .push(Level {
                    value: *value,
                    label: run.label.clone(),
                    iops: t.iops,
                    p99_us,
                    mean_us: all.mean_us,
                });
        }
    }
    by.into_iter()
        .map(|((vm, disk, op), levels)| SweepCurve {
            knee: knee(&levels),
            vm,
            disk,
            op,
            levels,
        })
        .collect()
}

impl SweepResult {
    pub fn text(&self) -> String {
        let mut out = String::new();
        for c in &self.curves {
            let _ = writeln!(
                out,
                "{} {} {} — sweep over {}",
                c.vm, c.disk, c.op, self.over
            );
            let _ = writeln!(
                out,
                "  {:>6} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
                self.over, "IOPS", "p99 µs", "mean µs", "guest", "hv", "engine", "device"
            );
            for l in &c.levels {
                let mark = if c.knee.as_ref().is_some_and(|k| k.at == l.value) {
                    "  ← knee"
                } else {
                    ""
                };
                let _ = writeln!(
                    out,
                    "  {:>6} {:>9.0} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}{mark}",
                    l.value,
                    l.iops,
                    l.p99_us,
                    l.mean_us[0],
                    l.mean_us[1],
                    l.mean_us[2],
                    l.mean_us[3],
                    l.mean_us[4]
                );
            }
            match &c.knee {
                Some(k) => {
                    let _ = writeln!(
                        out,
                        "  knee at {} {}: {:.0} IOPS; at {} IOPS {:+.0}% while p99 {:+.0}%; {} grew most ({:+.1} µs mean)",
                        self.over,
                        k.at,
                        k.iops,
                        k.next,
                        k.iops_gain * 100.0,
                        k.p99_gain * 100.0,
                        k.segment,
                        k.segment_growth_us
                    );
                }
                None => {
                    let _ = writeln!(
                        out,
                        "  no knee: from each level to the next, IOPS grew by {:.0}% or more per doubling, or p99 by {:.0}% or less",
                        KNEE_IOPS_PER_DOUBLING * 100.0,
                        KNEE_P99_GAIN * 100.0
                    );
                }
            }
            out.push('\n');
        }
        out
    }
}

/// Runs the command once per value, `{qd}` (or `{jobs}`) in its arguments
/// replaced, each a labelled run `PREFIX-VALUE`; the curves and knees are
/// stored as `RUNS/PREFIX/sweep.json`.
pub async fn sweep(
    make: impl Fn(Vec<String>) -> crate::run::RunOptions,
    command: &[String],
    over: &str,
    values: &[u32],
    prefix: &str,
    runs_dir: &Path,
) -> Result<(SweepResult, PathBuf)> {
    check_label(prefix)?;
    let placeholder = format!("{{{over}}}");
    if !command.iter().any(|a| a.contains(&placeholder)) {
        bail!(
            "the command has no {placeholder}: put it where the {over} goes, e.g. fio --iodepth={placeholder} …"
        );
    }
    if values.len() < 2 {
        bail!("--{over}: give two values or more, e.g. 1,2,4,8,16,32");
    }
    let dir = runs_dir.join(prefix);
    if dir.join("sweep.json").exists() {
        bail!(
            "sweep {prefix:?} exists in {}: choose another --label, or remove {}",
            runs_dir.display(),
            dir.display()
        );
    }
    let mut levels = Vec::new();
    for (i, v) in values.iter().enumerate() {
        let cmd: Vec<String> = command
            .iter()
            .map(|a| a.replace(&placeholder, &v.to_string()))
            .collect();
        let label = format!("{prefix}-{over}{v}");
        eprintln!("sweep {}/{}: {over} {v} ({label})", i + 1, values.len());
        let l = Labelled {
            label: label.clone(),
            runs_dir: runs_dir.to_path_buf(),
        };
        let (outcome, stored, _) = run_labelled(make(cmd), &l).await?;
        if let Some(code) = outcome
            .child_status
            .and_then(|s| s.code())
            .filter(|c| *c != 0)
        {
            bail!("{over} {v}: the command exited with {code}; run {label} kept");
        }
        levels.push((*v, stored));
    }
    let result = SweepResult {
        schema: "iospan.sweep/v1".into(),
        over: over.into(),
        command: command.to_vec(),
        curves: curves(&levels),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("sweep.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&result)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok((result, path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(total: u32, g: u32, h: u32, e: u32, d: u32) -> Parts {
        [total, g, h, e, d]
    }

    #[test]
    fn bands_take_the_slowest_ios_at_each_percentile() {
        // 1000 I/Os: 990 of 100 µs (device), 10 of 1100 µs (engine +1000).
        let mut kept = vec![parts(100_000, 10_000, 10_000, 10_000, 70_000); 990];
        kept.extend(vec![
            parts(1_100_000, 10_000, 10_000, 1_010_000, 70_000);
            10
        ]);
        let b = bands(&kept);
        assert_eq!(b.len(), 5);
        assert_eq!(b[0].ios, 1000);
        assert!((b[0].mean_us[0] - 110.0).abs() < 1e-6);
        let p99 = b.iter().find(|b| b.from_pct == 99.0).unwrap();
        assert_eq!(p99.ios, 10);
        assert_eq!(p99.threshold_us, 1100.0);
        assert_eq!(p99.mean_us, [1100.0, 10.0, 10.0, 1010.0, 70.0]);
        let p999 = b.iter().find(|b| b.from_pct == 99.9).unwrap();
        assert_eq!(p999.ios, 1);
    }

    fn entry(vm: &str, engine_tail_us: f64) -> TailEntry {
        let band = |pct: f64, eng: f64| Band {
            from_pct: pct,
            ios: 10,
            threshold_us: 0.0,
            mean_us: [100.0 + eng, 10.0, 10.0, eng, 80.0],
        };
        TailEntry {
            vm: vm.into(),
            disk: "vd0".into(),
            op: Op::Read,
            ios: 1000,
            iops: 0.0,
            sampled: false,
            guest_observed: true,
            bands: vec![
                band(0.0, 5.0),
                band(99.0, engine_tail_us),
                band(99.9, engine_tail_us * 2.0),
            ],
            cdf: Vec::new(),
        }
    }

    fn stored(label: &str, host: &str, t: TailEntry) -> StoredRun {
        StoredRun {
            schema: SCHEMA.into(),
            label: label.into(),
            finished_unix_s: 0,
            report: RunReport {
                schema: crate::report::SCHEMA.into(),
                duration_s: 1.0,
                command: None,
                exit_code: None,
                lost: Default::default(),
                probes: Vec::new(),
                agent: Default::default(),
                guests: Vec::new(),
                stitch: Default::default(),
                export: None,
                vms: Vec::new(),
                not_vms: 0,
                entries: Vec::new(),
            },
            tails: vec![t],
            series: Vec::new(),
            fio: Vec::new(),
            fio_note: None,
            host: HostInfo {
                name: host.into(),
                kernel: "6.1.0".into(),
                cpu: "Some CPU".into(),
                cpus: 8,
                memory_gib: 31.2,
            },
        }
    }

    #[test]
    fn runs_of_one_label_from_two_hosts_are_told_apart_and_paired() {
        let a = stored("mailbox", "hv-a", entry("exch-1", 50.0));
        let mut other = entry("mbx01", 450.0);
        other.disk = "drive-virtio-disk0".into();
        let b = stored("mailbox", "hv-b", other);
        let text = compare_text(&[a.clone(), b]).unwrap();
        assert!(
            text.contains("mailbox@hv-a: hv-a (kernel 6.1.0, 8 × Some CPU, 31.2 GiB)"),
            "{text}"
        );
        assert!(
            text.contains("mailbox@hv-a vs mailbox@hv-b — vd0 read"),
            "{text}"
        );
        assert!(text.contains("at p99: engine explains 100%"), "{text}");
        // One host: no host lines, bare labels.
        let same = stored("other", "hv-a", entry("exch-1", 450.0));
        let text = compare_text(&[a, same]).unwrap();
        assert!(text.starts_with("mailbox vs other — vd0 read"), "{text}");
    }

    #[test]
    fn a_comparison_names_the_segment_that_moved() {
        let d = differences(&entry("a", 50.0), &entry("b", 450.0));
        let p99 = d.iter().find(|d| d.at == "p99").unwrap();
        assert_eq!(p99.segment, "engine");
        assert!((p99.share - 1.0).abs() < 1e-9);
        let mean = d.iter().find(|d| d.at == "mean").unwrap();
        assert_eq!(mean.share, 0.0, "no change at the mean");
    }

    #[test]
    fn a_tail_of_a_handful_of_ios_is_said_to_be_one() {
        let a = stored("a", "hv-a", entry("vm", 50.0));
        let mut t = entry("vm", 450.0);
        t.bands[2].ios = 1;
        let text = compare_text(&[a, stored("b", "hv-a", t)]).unwrap();
        let line = |at: &str| {
            text.lines()
                .find(|l| l.contains(&format!("→ at {at}:")))
                .unwrap_or_else(|| panic!("{text}"))
                .to_string()
        };
        assert!(line("p99").ends_with("µs); 10 and 10 I/Os"), "{text}");
        assert!(
            line("p99.9").ends_with(
                "; 10 and 1 I/Os: too few to speak for the runs' tails (at p99.9 they need 10000 I/Os or more each)"
            ),
            "{text}"
        );
        assert!(!line("mean").contains("I/Os"), "{text}");
    }

    #[test]
    fn checks_parse_and_say_what_is_wrong() {
        let c: Check = "read.p99<20ms".parse().unwrap();
        assert_eq!(
            (c.op, c.stat.as_str(), c.segment.as_str()),
            (Op::Read, "p99", "total")
        );
        assert_eq!(c.limit_us, 20_000.0);
        let c: Check = "vd1:write.p99.9.device<500us".parse().unwrap();
        assert_eq!(c.disk.as_deref(), Some("vd1"));
        assert_eq!((c.stat.as_str(), c.segment.as_str()), ("p999", "device"));
        for (bad, says) in [
            ("read.p99", "'<'"),
            ("trim.p99<1ms", "read or write"),
            ("read.p42<1ms", "statistic"),
            ("read.p99.disk<1ms", "segment"),
            ("read.p99<soon", "soon"),
        ] {
            let e = bad.parse::<Check>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn fio_output_is_found_on_its_command_line() {
        let cmd = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
        assert_eq!(
            fio_json_output(&cmd(
                "fio --name=x --output-format=json --output=/tmp/f.json"
            )),
            Some(PathBuf::from("/tmp/f.json"))
        );
        assert_eq!(
            fio_json_output(&cmd(
                "/usr/bin/fio --output-format normal,json+ --output o.json job.fio"
            )),
            Some(PathBuf::from("o.json"))
        );
        assert_eq!(fio_json_output(&cmd("fio --output=o.txt job.fio")), None);
        assert_eq!(
            fio_json_output(&cmd("dd --output-format=json --output=x")),
            None
        );
    }

    #[test]
    fn labels_are_directory_names() {
        assert!(check_label("virtio-qd16_2026.11").is_ok());
        for bad in ["", "../x", "a/b", ".hidden", "a b"] {
            assert!(check_label(bad).is_err(), "{bad:?}");
        }
    }

    fn level(value: u32, iops: f64, p99: f64, engine: f64) -> Level {
        Level {
            value,
            label: format!("s-qd{value}"),
            iops,
            p99_us: p99,
            mean_us: [100.0 + engine, 10.0, 10.0, engine, 80.0],
        }
    }

    #[test]
    fn the_knee_is_where_iops_stop_and_latency_climbs() {
        let levels = [
            level(1, 1000.0, 200.0, 10.0),
            level(2, 1900.0, 220.0, 12.0),
            level(4, 3000.0, 300.0, 20.0),
            level(8, 3100.0, 600.0, 300.0),
            level(16, 3150.0, 1200.0, 900.0),
        ];
        let k = knee(&levels).expect("a knee");
        assert_eq!((k.at, k.next), (4, 8));
        assert_eq!(k.segment, "engine");
        assert!((k.segment_growth_us - 280.0).abs() < 1e-9);
        // Still scaling: none.
        assert_eq!(knee(&levels[..3]), None);
    }
}
