//! `iospan demo`: the built-in default job. Traces fio on a scratch loop
//! device and prints the table, so a fresh machine shows what iospan does
//! with nothing set up.

use std::{path::Path, time::Duration};

use anyhow::{Context, Result};

use crate::{
    cmd::run::{self, RunOptions},
    cmd::scratch::ScratchLoop,
    probes::preflight,
};

pub async fn demo(json_out: Option<std::path::PathBuf>) -> Result<run::RunOutcome> {
    preflight::require_bpf_privileges()?;
    preflight::require_command("fio").context("the demo drives fio (`apt-get install fio`)")?;
    let dev = ScratchLoop::create(Path::new("/dev/shm"), 256)
        .context("creating the demo's scratch disk")?;
    eprintln!(
        "iospan demo: 4 KiB random reads and writes with fio on {} (a loop device over /dev/shm)",
        dev.dev_path()
    );
    let fio = [
        "fio",
        "--name=demo",
        "--ioengine=io_uring",
        "--direct=1",
        "--rw=randrw",
        "--rwmixread=70",
        "--bs=4k",
        "--iodepth=16",
        "--time_based",
        "--runtime=5",
        "--output-format=terse",
        "--output=/dev/null",
    ];
    let mut command: Vec<String> = fio.iter().map(|s| s.to_string()).collect();
    command.push(format!("--filename={}", dev.dev_path()));
    let outcome = run::run(RunOptions {
        disks: vec![dev.name.clone()],
        json_out,
        max_disks: crate::abi::DEFAULT_MAX_DISKS,
        duration: Some(Duration::from_secs(30)),
        vms: true,
        command,
        ..Default::default()
    })
    .await?;
    Ok(outcome)
}

/// `iospan demo`.
pub fn main(json_out: Option<std::path::PathBuf>) -> Result<std::process::ExitCode> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let outcome = rt.block_on(demo(json_out))?;
    print!("{}", outcome.report.table());
    Ok(std::process::ExitCode::SUCCESS)
}
