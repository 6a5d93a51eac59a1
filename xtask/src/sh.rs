//! Running commands, loudly: every command is echoed, failures name it.

use std::{
    path::PathBuf,
    process::{Command, Output},
};

use anyhow::{bail, Context, Result};

/// The workspace root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("workspace root")
}

pub fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: {}", show(cmd));
    let status = cmd
        .status()
        .with_context(|| format!("starting `{}`", show(cmd)))?;
    if !status.success() {
        bail!("`{}` failed ({status})", show(cmd));
    }
    Ok(())
}

pub fn output(cmd: &mut Command) -> Result<Output> {
    cmd.output()
        .with_context(|| format!("starting `{}`", show(cmd)))
}

pub fn cargo(args: &[&str]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run(Command::new(cargo).args(args).current_dir(root()))
}

/// Runs `cargo test …`, passing its output through, and adds up the
/// harness's "test result" lines: (passed, failed).
pub fn cargo_test(args: &[&str]) -> Result<(u64, u64)> {
    use std::io::{BufRead, BufReader};
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(args)
        .current_dir(root())
        .stdout(std::process::Stdio::piped());
    eprintln!("xtask: {}", show(&cmd));
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting `{}`", show(&cmd)))?;
    let (mut passed, mut failed) = (0, 0);
    for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line?;
        println!("{line}");
        if let Some(rest) = line.strip_prefix("test result: ") {
            let num = |word: &str| {
                rest.split(';')
                    .find_map(|part| {
                        part.trim()
                            .trim_start_matches("ok. ")
                            .trim_start_matches("FAILED. ")
                            .strip_suffix(word)
                    })
                    .and_then(|n| n.trim().parse::<u64>().ok())
                    .unwrap_or(0)
            };
            passed += num(" passed");
            failed += num(" failed");
        }
    }
    let status = child.wait()?;
    if !status.success() && failed == 0 {
        bail!("`{}` failed ({status})", show(&cmd));
    }
    Ok((passed, failed))
}

pub fn which(tool: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        .unwrap_or(false)
}

pub fn show(cmd: &Command) -> String {
    std::iter::once(cmd.get_program().to_string_lossy().into_owned())
        .chain(cmd.get_args().map(|a| a.to_string_lossy().into_owned()))
        .collect::<Vec<_>>()
        .join(" ")
}
