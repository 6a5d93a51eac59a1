//! `cargo xtask fuzz`: the fuzz targets of `tests/fuzz` (cargo-fuzz,
//! libFuzzer, on the nightly toolchain), each for a while over its inputs:
//! the seeds (`tests/fuzz/seeds/TARGET`) and named regressions
//! (`tests/fuzz/regressions/TARGET`) kept in git, and the working corpus
//! the runs grow, kept outside the tree (`~/.cache/iospan/fuzz-corpus/TARGET`)
//! so a run leaves the checkout as it was. A finding is saved under
//! `tests/fuzz/artifacts/TARGET` (ignored) and fails the command: once
//! fixed, it is kept as a named regression.

use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::sh;

/// Every target in tests/fuzz/Cargo.toml.
pub const TARGETS: [&str; 5] = [
    "guest_stream",
    "qemu_cmdline",
    "config",
    "replay_events",
    "api_request",
];

#[derive(clap::Args, Debug)]
pub struct FuzzArgs {
    /// Seconds per target.
    #[arg(long, default_value_t = 60)]
    pub seconds: u64,
    /// Only these targets (default: all).
    #[arg(value_name = "TARGET")]
    pub targets: Vec<String>,
}

/// Installs what fuzzing needs when missing: the nightly toolchain and
/// cargo-fuzz.
fn ensure_tools() -> Result<()> {
    let nightly = Command::new("rustup")
        .args(["run", "nightly", "rustc", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !nightly {
        sh::run(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
        ]))
        .context("installing the nightly toolchain (cargo-fuzz needs it)")?;
    }
    let fuzz = Command::new("cargo")
        .args(["fuzz", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !fuzz {
        sh::run(Command::new("cargo").args(["install", "cargo-fuzz", "--locked"]))
            .context("installing cargo-fuzz")?;
    }
    Ok(())
}

pub fn run(a: &FuzzArgs) -> Result<()> {
    ensure_tools()?;
    let targets: Vec<&str> = if a.targets.is_empty() {
        TARGETS.to_vec()
    } else {
        for t in &a.targets {
            if !TARGETS.contains(&t.as_str()) {
                bail!("fuzz target {t:?}: use one of {}", TARGETS.join(", "));
            }
        }
        a.targets.iter().map(String::as_str).collect()
    };
    for t in targets {
        one(t, a.seconds, None, Build::Fast)?;
    }
    Ok(())
}

/// Each target for `seconds` over its corpus, as the test suite runs them:
/// what a run finds new goes to a scratch directory, not the checkout.
/// Returns the targets that passed and failed.
pub fn smoke(seconds: u64) -> Result<(u64, u64)> {
    crate::phases::time("fuzz tools", ensure_tools)?;
    let scratch_held = tempfile::Builder::new().prefix("iospan-fuzz-").tempdir()?;
    let scratch = scratch_held.path().to_path_buf();
    let (mut passed, mut failed) = (0, 0);
    for t in TARGETS {
        let new = scratch.join(t);
        std::fs::create_dir_all(&new)?;
        match crate::phases::time(&format!("fuzz {t}"), || {
            one(t, seconds, Some(&new), Build::Quick)
        }) {
            Ok(()) => passed += 1,
            Err(e) => {
                eprintln!("xtask: fuzz: {t} FAILED: {e:#}");
                failed += 1;
            }
        }
    }
    Ok((passed, failed))
}

/// How the targets are built.
#[derive(Clone, Copy)]
enum Build {
    /// Optimised (with debug assertions): for long runs.
    Fast,
    /// Unoptimised: built in half the time, for the suite's short runs.
    Quick,
}

/// The working corpus of target `t`: what runs found, outside the tree.
pub fn working_corpus(t: &str) -> std::path::PathBuf {
    crate::backends::cache_dir().join("fuzz-corpus").join(t)
}

/// One target: its working corpus, seeds and regressions read, new inputs
/// written to `new` (default: the working corpus).
fn one(t: &str, seconds: u64, new: Option<&std::path::Path>, build: Build) -> Result<()> {
    let dir = sh::root().join("tests/fuzz");
    let corpus = working_corpus(t);
    std::fs::create_dir_all(&corpus)?;
    let kept: Vec<std::path::PathBuf> = ["seeds", "regressions"]
        .iter()
        .map(|k| dir.join(k).join(t))
        .filter(|d| d.is_dir())
        .collect();
    eprintln!("xtask: fuzz: {t} for {seconds} s");
    let mut cmd = Command::new("cargo");
    sh::without_run_env(&mut cmd);
    cmd.args(["+nightly", "fuzz", "run", "--fuzz-dir"])
        .arg(&dir)
        .args(match build {
            Build::Fast => &["--release", "--debug-assertions"][..],
            Build::Quick => &["--dev"][..],
        })
        // Outside the clone and reused: the instrumented build of the
        // agent takes minutes, the runs in CI seconds.
        .arg("--target-dir")
        .arg(crate::backends::cache_dir().join("fuzz-target"))
        .arg(t);
    // libFuzzer writes what it finds new into the first directory.
    if let Some(n) = new {
        cmd.arg(n);
    }
    cmd.arg(&corpus)
        .args(&kept)
        .arg("--")
        .arg(format!("-max_total_time={seconds}"))
        // A leak is not a finding here; memory is: 2 GiB.
        .args(["-rss_limit_mb=2048", "-timeout=10", "-detect_leaks=0"])
        .current_dir(sh::root());
    let artifacts = sh::root().join("tests/fuzz/artifacts").join(t);
    sh::run(&mut cmd).with_context(|| {
        let found = std::fs::read_dir(&artifacts).is_ok_and(|mut d| d.next().is_some());
        if found {
            format!("fuzz target {t}: a finding is in {}", artifacts.display())
        } else {
            format!("fuzz target {t} did not build or run (no finding written): see cargo's output above")
        }
    })
}
