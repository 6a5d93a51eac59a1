//! Running commands, loudly: every command is echoed, failures name it.

use std::{
    path::PathBuf,
    process::{Command, Output},
};

use anyhow::{bail, Context, Result};

/// The workspace root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().expect("workspace root")
}

pub fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: {}", show(cmd));
    let status = cmd.status().with_context(|| format!("starting `{}`", show(cmd)))?;
    if !status.success() {
        bail!("`{}` failed ({status})", show(cmd));
    }
    Ok(())
}

pub fn output(cmd: &mut Command) -> Result<Output> {
    cmd.output().with_context(|| format!("starting `{}`", show(cmd)))
}

pub fn cargo(args: &[&str]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run(Command::new(cargo).args(args).current_dir(root()))
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
