//! `iospan floor`: the floor programs on the hooks a run of the always-on
//! tier attached (its report's `probes`), until interrupted; then their
//! kernel statistics. `cargo xtask bench vm` measures it as an arm beside
//! the tiers: what each hook costs before any work of the tier's.

use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::probes::{floor::FloorProbes, preflight, Attachment};

/// The hooks a report's run attached.
fn hooks_of(report: &Path) -> Result<Vec<Attachment>> {
    let text = std::fs::read(report)
        .with_context(|| format!("--like {}: reading the report", report.display()))?;
    let v: serde_json::Value = serde_json::from_slice(&text).with_context(|| {
        format!(
            "--like {}: not a report of `iospan run --json-out`",
            report.display()
        )
    })?;
    let probes = v.get("probes").cloned().with_context(|| {
        format!(
            "--like {}: no `probes` (a report of `iospan run --json-out`)",
            report.display()
        )
    })?;
    let hooks: Vec<Attachment> = serde_json::from_value(probes)
        .with_context(|| format!("--like {}: unreadable `probes`", report.display()))?;
    if hooks.is_empty() {
        bail!("--like {}: its run attached nothing", report.display());
    }
    Ok(hooks)
}

pub fn main(like: &Path, json_out: &Path) -> Result<()> {
    let hooks = hooks_of(like)?;
    let cpu0 = preflight::self_cpu();
    let floor = FloorProbes::attach_like(&hooks).context("attaching the floor programs")?;
    for a in &floor.attached {
        eprintln!("floor: attached {} ({})", a.tracepoint, a.flavour.as_str());
    }
    for (a, why) in &floor.skipped {
        eprintln!(
            "floor: not mirrored {} ({}): {why}",
            a.tracepoint,
            a.flavour.as_str()
        );
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut int = signal(SignalKind::interrupt())?;
        let mut term = signal(SignalKind::terminate())?;
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        std::io::Result::Ok(())
    })
    .context("waiting for a signal")?;
    let cpu1 = preflight::self_cpu();
    let report = serde_json::json!({
        "tier": "floor",
        "probes": floor.attached,
        "not_mirrored": floor.skipped.iter().map(|(a, why)| serde_json::json!({
            "tracepoint": a.tracepoint, "flavour": a.flavour, "program": a.program, "why": why,
        })).collect::<Vec<_>>(),
        "agent": {
            "cpu_user_s": cpu1.0 - cpu0.0,
            "cpu_sys_s": cpu1.1 - cpu0.1,
            "bpf": floor.program_stats(),
        },
    });
    std::fs::write(json_out, serde_json::to_string_pretty(&report)? + "\n")
        .with_context(|| format!("--json-out {}", json_out.display()))?;
    Ok(())
}
