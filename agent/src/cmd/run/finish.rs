//! The run's report, from what the trace ended with.

use std::collections::BTreeMap;

use super::*;
use crate::output::report::{self, AgentCost, SCHEMA};

pub(super) fn report(
    s: &Session,
    opts: &RunOptions,
    ended: Ended,
    child_status: Option<ExitStatus>,
    start: &Start,
    (qemu, watched): (
        &BTreeMap<String, crate::output::qemu_check::VmQemu>,
        &crate::output::diagnose::Watch,
    ),
) -> Result<RunOutcome> {
    let Ended {
        mut snap,
        kernel,
        elapsed,
        events_written,
        export,
    } = ended;
    let cpu1 = preflight::self_cpu();
    snap.counters.host_split = s.corr().counters.clone();
    let mut report = RunReport {
        schema: SCHEMA.into(),
        tier: opts.vms.then_some(s.probes.tier.tier),
        duration_s: (elapsed * 1000.0).round() / 1000.0,
        command: (!opts.command.is_empty()).then(|| opts.command.clone()),
        exit_code: child_status.and_then(|s| s.code()),
        lost: snap.counters.clone(),
        probes: s.probes.attachments.clone(),
        agent: AgentCost {
            cpu_user_s: cpu1.0 - start.cpu.0,
            cpu_sys_s: cpu1.1 - start.cpu.1,
            bpf: opts.bpf_stats.then(|| s.probes.program_stats()),
            ..Default::default()
        },
        export,
        ..Default::default()
    };
    {
        // The correlator, then the registry: the order every task takes them in.
        let corr = s.corr();
        let known = s.known();
        report.vms = report::vms(&known, &snap.vm_counts, &snap.vm_finished());
        report.guests = report::guests(&known, &corr.stitch);
        report.not_vms = known.not_vms.len() as u64;
        report.stitch = corr.stitch.counters.clone();
        let mut e = report::entries(&snap.stats, &kernel, &s.only, elapsed);
        e.extend(report::vm_entries(
            &snap.vm_stats,
            &corr,
            &known,
            &s.only,
            elapsed,
        ));
        report.entries = e;
    }
    report.agent.per_io = report::agent_per_io(&report);
    // Each VM's requests still in flight at the end (by how many QEMU's
    // count may honestly differ from ours) and submitted over the run.
    let (inflight, submitted) = {
        let finished = snap.vm_finished();
        let known = s.known();
        let mut inflight = BTreeMap::new();
        let mut submitted = BTreeMap::new();
        for (slot, c) in &snap.vm_counts {
            let done = finished.get(slot).map_or(0, |f| f.done);
            inflight.insert(known.name(*slot), c.submitted.saturating_sub(done));
            submitted.insert(known.name(*slot), c.submitted);
        }
        (inflight, submitted)
    };
    crate::output::qemu_check::compare(&mut report, qemu, &inflight, &submitted);
    let tails = {
        let corr = s.corr();
        let known = s.known();
        corr.stitch
            .tails
            .as_ref()
            .map(|t| t.entries(&known))
            .unwrap_or_default()
    };
    let depths = kernel_depths(&kernel);
    crate::output::diagnose::attach(
        &mut report,
        &crate::output::diagnose::Inputs {
            known: &s.known(),
            tails: &tails,
            watch: watched,
            depths: &depths,
        },
    );
    if let Some(path) = &opts.json_out {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("writing --json-out {}", path.display()))?;
    }
    if opts.events_out.is_some() {
        log::info!("{events_written} per-request records written");
    }
    Ok(RunOutcome {
        report,
        child_status,
        tails,
    })
}

/// Each host disk's mean depth while busy over the run, by name, from
/// the kernel's counts over it.
fn kernel_depths(over_run: &BTreeMap<Dev, diskstats::DiskStat>) -> crate::output::diagnose::Depths {
    over_run
        .iter()
        .filter_map(|(dev, s)| Some((crate::discover::disks::name_of(*dev), s.depth()?)))
        .collect()
}
