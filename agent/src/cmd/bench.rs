//! Labelled runs and sweeps: `iospan run --label` and `iospan sweep` run the
//! command under a traced run and keep what the run store holds.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::output::store::{
    check_label, curves, fio::fio_json_output, new_run_dir, parse_fio, series::SeriesBuilder,
    HostInfo, StoredRun, SweepResult, SCHEMA,
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
    std::fs::write(&path, serde_json::to_vec_pretty(&result)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok((result, path))
}
