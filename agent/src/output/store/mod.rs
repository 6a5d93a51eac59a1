//! The run store: labelled benchmark runs kept under a runs directory (report,
//! tails, time series, fio's figures), loaded and summarized.
//!
//! Rendered by `iospan report`, put side by side (`compare`), held to
//! thresholds (`check`); sweeps are stored here too (`sweep`).

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::output::report::RunReport;

mod check;
mod compare;
pub mod fio;
pub mod series;
mod sweep;

pub use check::{verdict_text, Check, Verdict};
pub use compare::{band_name, compare_text, differences, pairs, Difference, FEW_IOS};
pub use fio::{fio_json_output, parse_fio, FioFigures};
pub use series::{Point, Series, SeriesBuilder};
pub use sweep::{
    curves, knee, Knee, Level, SweepCurve, SweepResult, KNEE_IOPS_PER_DOUBLING, KNEE_P99_GAIN,
};
// What the store keeps of a run's tails is the model's.
pub use crate::model::tails::{Band, TailEntry, BAND_FROM, PARTS};

pub const SCHEMA: &str = "iospan.bench/v1";

/// Where labelled runs go unless told: IOSPAN_RUNS_DIR, else the agent's
/// state directory.
pub fn default_runs_dir() -> PathBuf {
    std::env::var_os("IOSPAN_RUNS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/iospan/runs"))
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

/// `bytes` as the file `path`, whole or not at all: written beside it,
/// synced, then renamed over it; what a failed write left is removed (a
/// full filesystem leaves no half a file to be read as a run).
pub fn write_whole(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let name = path.file_name().map_or_else(
        || std::ffi::OsString::from("file"),
        std::ffi::OsStr::to_os_string,
    );
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(&name);
    tmp_name.push(".tmp");
    let tmp = path.with_file_name(tmp_name);
    let written = std::fs::File::create(&tmp)
        .and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("writing {}", path.display()));
    }
    Ok(())
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
    // A run names the host's VMs and disks: root's to read.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("making {} private", dir.display()))?;
    Ok(dir)
}

impl StoredRun {
    pub fn save(&self, dir: &Path) -> Result<PathBuf> {
        let p = dir.join("run.json");
        write_whole(&p, &serde_json::to_vec_pretty(self)?)?;
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

#[cfg(test)]
mod tests;
