//! Labelled runs and sweeps: `iospan run --label` and `iospan sweep` run the
//! command under a traced run and keep what the run store holds.

use std::path::{Path, PathBuf};

use std::process::ExitCode;

use anyhow::{bail, Context, Result};

use crate::abi::DEFAULT_MAX_DISKS;
use crate::cmd::run::{self, RunOptions};
use crate::output::store::{
    check_label, compare_text, curves, fio::fio_json_output, new_run_dir, parse_fio,
    series::SeriesBuilder, verdict_text, Check, HostInfo, StoredRun, SweepResult, SCHEMA,
};

/// What `iospan run --label` adds to a run.
pub struct Labelled {
    pub label: String,
    pub runs_dir: PathBuf,
}

/// A run stored under its label: the report, its tails, its time series
/// (a frame a second) and fio's figures when the command is fio writing
/// JSON. Returns the stored run and where it went.
pub async fn run_labelled(
    mut opts: crate::cmd::run::RunOptions,
    l: &Labelled,
) -> Result<(crate::cmd::run::RunOutcome, StoredRun, PathBuf)> {
    let dir = new_run_dir(&l.runs_dir, &l.label)?;
    let fio_out = fio_json_output(&opts.command);
    let is_fio = opts
        .command
        .first()
        .is_some_and(|p| Path::new(p).file_name().is_some_and(|n| n == "fio"));
    let (tx, mut rx) = tokio::sync::watch::channel(None);
    opts.live = Some(crate::cmd::run::LiveFeed {
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
    let outcome = crate::cmd::run::run(opts).await;
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
                crate::output::store::write_whole(&dir.join("fio.json"), t.as_bytes())?;
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
    let path = match stored.save(&dir) {
        Ok(p) => p,
        Err(e) => {
            // Nothing of a run that could not be stored: its label stays free.
            let _ = std::fs::remove_file(dir.join("fio.json"));
            let _ = std::fs::remove_dir(&dir);
            return Err(e);
        }
    };
    Ok((outcome, stored, path))
}

/// Runs the command once per value, `{qd}` (or `{jobs}`) in its arguments
/// replaced, each a labelled run `PREFIX-VALUE`; the curves and knees are
/// stored as `RUNS/PREFIX/sweep.json`.
pub async fn sweep(
    make: impl Fn(Vec<String>) -> crate::cmd::run::RunOptions,
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
    crate::output::store::write_whole(&path, &serde_json::to_vec_pretty(&result)?)?;
    Ok((result, path))
}

/// `iospan run`: a plain run's table, or a labelled run stored and held to
/// its checks. The traced command's failure is the run's (for scripts),
/// then a failed check.
pub fn run_command(
    opts: RunOptions,
    labelled: Option<Labelled>,
    checks: &[Check],
) -> Result<ExitCode> {
    if !checks.is_empty() && labelled.is_none() {
        bail!("--check needs a labelled run: add --label LABEL");
    }
    let rt = runtime()?;
    let (outcome, checked) = match &labelled {
        Some(l) => {
            let (outcome, stored, path) = rt.block_on(run_labelled(opts, l))?;
            print!("{}", stored.summary());
            eprintln!("run {:?} stored in {}", l.label, path.display());
            (outcome, held_to(&stored, checks)?)
        }
        None => {
            let outcome = rt.block_on(run::run(opts))?;
            print!("{}", outcome.report.table());
            (outcome, true)
        }
    };
    Ok(match outcome.child_status.and_then(|s| s.code()) {
        Some(0) | None if checked => ExitCode::SUCCESS,
        Some(0) | None => ExitCode::from(1),
        Some(c) => ExitCode::from(c.max(1).min(255) as u8),
    })
}

/// `iospan report`: a stored run's summary (and HTML page), held to checks.
pub fn report(
    run: &str,
    runs_dir: &Path,
    html: Option<&Path>,
    checks: &[Check],
) -> Result<ExitCode> {
    let stored = StoredRun::load(runs_dir, run)?;
    print!("{}", stored.summary());
    if let Some(p) = html {
        crate::output::store::write_whole(p, crate::output::html::render(&stored).as_bytes())
            .context("--html")?;
        eprintln!("HTML report: {}", p.display());
    }
    Ok(if held_to(&stored, checks)? {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `iospan compare`.
pub fn compare(runs: &[String], runs_dir: &Path) -> Result<ExitCode> {
    let stored = runs
        .iter()
        .map(|r| StoredRun::load(runs_dir, r))
        .collect::<Result<Vec<_>>>()?;
    print!("{}", compare_text(&stored)?);
    Ok(ExitCode::SUCCESS)
}

/// What `iospan sweep` sweeps, and how it traces.
pub struct Sweep {
    pub qd: Vec<u32>,
    pub jobs: Vec<u32>,
    pub label: String,
    pub disks: Vec<String>,
    pub tier: crate::model::Tier,
}

/// `iospan sweep`: over queue depths, or job counts when none are given.
pub fn sweep_command(s: Sweep, runs_dir: &Path, command: &[String]) -> Result<ExitCode> {
    let (over, values) = if s.qd.is_empty() {
        ("jobs", s.jobs)
    } else {
        ("qd", s.qd)
    };
    let make = |cmd: Vec<String>| RunOptions {
        disks: s.disks.clone(),
        max_disks: DEFAULT_MAX_DISKS,
        vms: true,
        quiet: true,
        command: cmd,
        tier: s.tier,
        ..Default::default()
    };
    let (result, path) =
        runtime()?.block_on(sweep(make, command, over, &values, &s.label, runs_dir))?;
    print!("{}", result.text());
    eprintln!("sweep stored in {}", path.display());
    Ok(ExitCode::SUCCESS)
}

/// Prints each check's verdict; whether all passed.
fn held_to(stored: &StoredRun, checks: &[Check]) -> Result<bool> {
    let mut verdicts = Vec::new();
    for c in checks {
        verdicts.extend(c.evaluate(&stored.report)?);
    }
    let (text, pass) = verdict_text(&verdicts);
    print!("{text}");
    Ok(pass)
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")
}
