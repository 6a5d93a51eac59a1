//! `iospan run`: trace while a command runs (or for a duration, or until
//! Ctrl-C), show progress, then report per disk and op.

use std::{
    path::PathBuf,
    process::ExitStatus,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use tokio::{
    process::Command,
    signal::unix::{signal, SignalKind},
    sync::watch,
};

use crate::{
    discover::disks::{self, Dev},
    discover::diskstats,
    discover::vms::{self, Registry, VmMaps},
    output::export::{TraceOpts, Tracer},
    output::report::{self, AgentCost, RunReport, SCHEMA},
    pipeline::channel,
    pipeline::correlate::Correlator,
    probes::host::{BlockConfig, BlockProbes},
    probes::preflight,
};

mod events;
mod follow;
mod live;
mod progress;
mod qemu;

use events::*;
use follow::*;
use live::*;
use progress::*;

#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    pub duration: Option<Duration>,
    pub disks: Vec<String>,
    pub json_out: Option<PathBuf>,
    pub events_out: Option<PathBuf>,
    pub sample_every: u32,
    pub slower_than: Option<Duration>,
    pub max_disks: u32,
    pub bpf_stats: bool,
    pub start_stamps: bool,
    /// Attribute requests to the VMs that submitted them.
    pub vms: bool,
    pub quiet: bool,
    pub command: Vec<String>,
    /// Per-I/O traces over OTLP (when an endpoint is set).
    pub traces: TraceOpts,
    /// Serve the HTTP API (/metrics and the rest, see `api`) on ADDR.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Or keep an API served elsewhere (the agent service's) up to date.
    pub api: Option<Arc<crate::cmd::api::Shared>>,
    /// A live view's feed: a frame of the figures so far at each interval.
    pub live: Option<LiveFeed>,
    /// Ends the run when it turns true (a live view quitting).
    pub stop: Option<watch::Receiver<bool>>,
    /// Keep every request's segments for the run's tails (a labelled
    /// benchmark run: `RunOutcome::tails`).
    pub tails: bool,
}

/// Where and how often a run sends its frames.
#[derive(Clone, Debug)]
pub struct LiveFeed {
    pub tx: watch::Sender<Option<Arc<crate::output::live::Frame>>>,
    pub every: Duration,
}

pub struct RunOutcome {
    pub report: RunReport,
    pub child_status: Option<ExitStatus>,
    /// Where each VM disk's slowest requests spent their time (`tails`).
    pub tails: Vec<crate::output::store::TailEntry>,
}

pub async fn run(opts: RunOptions) -> Result<RunOutcome> {
    preflight::require_bpf_privileges()?;
    let only: Vec<Dev> = opts
        .disks
        .iter()
        .map(|d| disks::resolve(d).with_context(|| format!("--disk {d}")))
        .collect::<Result<_>>()?;
    if let Some(cmd) = opts.command.first() {
        preflight::require_command(cmd)?;
    }
    let tracer = if opts.traces.any_enabled() {
        if !opts.vms {
            bail!("traces are of VM I/O: drop --no-vms, or unset OTEL_EXPORTER_OTLP_ENDPOINT and --otlp-endpoint");
        }
        Some(Tracer::start(&opts.traces)?)
    } else {
        None
    };
    if opts.events_out.is_none() && (opts.sample_every > 0 || opts.slower_than.is_some()) {
        bail!("--sample and --slower-than choose which requests go to --events-out FILE; add --events-out");
    }

    // VM slots 1.. are the VMs running now; later ones are named as they
    // appear (while their /proc entry exists).
    let mut known = Registry::default();
    let running = if opts.vms { vms::scan() } else { Vec::new() };
    let vm_pids: Vec<u32> = running.iter().map(|v| v.pid).collect();
    let mut vm_maps = VmMaps::default();
    for (i, vm) in running.into_iter().enumerate() {
        vm_maps.extend(known.add(i as u32 + 1, vm));
    }
    // Shared with the per-request writer, which names VMs and vdisks.
    let known = Arc::new(Mutex::new(known));
    let cfg = BlockConfig {
        max_disks: opts.max_disks,
        // --events-out alone streams every request.
        sample_every: if opts.events_out.is_some()
            && opts.slower_than.is_none()
            && opts.sample_every == 0
        {
            1
        } else {
            opts.sample_every
        },
        slower_than_ns: opts.slower_than.map(|d| d.as_nanos() as u64).unwrap_or(0),
        stream_devs: only.clone(),
        start_stamps: opts.start_stamps,
        track_vms: opts.vms,
        vm_pids,
        vm_maps,
    };
    let _stats = if opts.bpf_stats {
        Some(
            aya::sys::enable_stats(aya::sys::Stats::RunTime)
                .context("enabling BPF run-time statistics")?,
        )
    } else {
        None
    };
    let mut probes = BlockProbes::load(&cfg).context("loading the block-layer probes")?;
    // VMs running now have their requests followed from the load, their
    // used-ring pushes only once their probes are attached: when each was.
    let mut pushes_live = Vec::new();
    for (slot, vm) in known.lock().unwrap_or_else(|p| p.into_inner()).vms.iter() {
        attach_vm_probes(&mut probes, vm);
        add_engines(&mut probes, *slot, vm);
        pushes_live.push((*slot, crate::pipeline::reap::monotonic_ns()));
    }
    for a in &probes.attachments {
        log::info!("attached {} via {}", a.tracepoint, a.flavour.as_str());
    }

    let (stop_tx, stop_rx) = watch::channel(false);
    // VM requests' host windows are split from records in the ring buffer;
    // a request waits up to 50 ms of stream time for the guest's signal.
    let correlator = Arc::new(Mutex::new(Correlator::new(50_000_000)));
    {
        let mut c = correlator.lock().unwrap_or_else(|p| p.into_inner());
        for (slot, ns) in pushes_live {
            c.pushes_live_from(slot, ns);
        }
    }
    // Guest channels of the VMs running now; later VMs' as they are named.
    let mut channel_tasks = Vec::new();
    for (slot, pid, src) in guest_channels(&known.lock().unwrap_or_else(|p| p.into_inner())) {
        channel_tasks.push(tokio::spawn(channel::follow(
            slot,
            pid,
            src,
            known.clone(),
            correlator.clone(),
            stop_rx.clone(),
        )));
    }
    // The event writer stops after the guest channels: guest records still
    // on their way must be joined before it settles the rest as unmatched.
    let (events_stop_tx, events_stop_rx) = watch::channel(false);
    if opts.events_out.is_some() || tracer.is_some() {
        correlator
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .stitch
            .keep_spans();
    }
    if opts.tails {
        correlator
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .stitch
            .keep_tails();
    }
    let export_shared = tracer.as_ref().map(Tracer::shared);
    let events_task = if opts.events_out.is_some() || opts.vms {
        let ring = probes.take_events()?;
        let out = match &opts.events_out {
            Some(path) => Some(std::io::BufWriter::new(
                std::fs::File::create(path)
                    .with_context(|| format!("creating --events-out {}", path.display()))?,
            )),
            None => None,
        };
        Some(tokio::spawn(drain_events(
            ring,
            out,
            known.clone(),
            correlator.clone(),
            events_stop_rx,
            opts.slower_than.map_or(0, |d| d.as_nanos() as u64),
            tracer,
        )))
    } else {
        None
    };

    // Baseline after attaching (and a moment for completions already under
    // way to land): any request the kernel counts from here on has passed
    // our completion tracepoint first.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let metrics = match (&opts.api, opts.metrics_listen) {
        (Some(shared), _) => Some(shared.clone()),
        (None, Some(addr)) => Some(serve_metrics(addr).await?),
        (None, None) => None,
    };
    let kernel0 = diskstats::read_all();
    let cpu0 = preflight::self_cpu();
    let t0 = Instant::now();
    // QEMU's own counters, beside ours at the end.
    // The agent service reads them at its API runs' edges instead (see
    // `send_frame`): not every 100 ms for its whole life.
    let qemu_task = (opts.vms && opts.api.is_none()).then(|| {
        // Without its own handle on our counts, a VM that exits within
        // the run has its last requests taken for a mismatch.
        let ours = probes
            .vm_counts_reader()
            .map_err(|e| log::warn!("{}", crate::probes::error_chain(&e)))
            .ok();
        tokio::spawn(qemu::watch(known.clone(), stop_rx.clone(), ours))
    });
    let mut child = match opts.command.split_first() {
        Some((prog, args)) => Some(
            Command::new(prog)
                .args(args)
                .kill_on_drop(true)
                .spawn()
                .with_context(|| format!("starting `{}`", opts.command.join(" ")))?,
        ),
        None => None,
    };

    let progress = Progress::new(opts.quiet);
    let deadline = opts.duration.map(|d| tokio::time::Instant::now() + d);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    // Frames for a live view, or for the API's snapshot, stream and runs.
    let feed = opts.live.clone().or_else(|| {
        metrics.as_ref().map(|m| LiveFeed {
            tx: m.frames.clone(),
            every: Duration::from_secs(1),
        })
    });
    let mut live_tick =
        tokio::time::interval(feed.as_ref().map_or(Duration::from_secs(1), |l| l.every));
    let mut stop = opts.stop.clone();
    tick.tick().await;
    // New VMs are named quickly, before a short-lived one can exit.
    let mut vm_tick = tokio::time::interval(Duration::from_millis(100));
    let mut child_status = None;
    let mut exited = std::collections::BTreeSet::new();
    let mut sigint = signal(SignalKind::interrupt()).context("handling SIGINT")?;
    let mut sigterm = signal(SignalKind::terminate()).context("handling SIGTERM")?;
    loop {
        tokio::select! {
            status = async { child.as_mut().expect("guarded").wait().await }, if child.is_some() && child_status.is_none() => {
                child_status = Some(status.context("waiting for the traced command")?);
                break;
            }
            _ = sigint.recv() => {
                // A terminal's Ctrl-C reaches the whole process group; let
                // the command finish its own way, then report.
                if let Some(c) = child.as_mut() {
                    child_status = c.wait().await.ok();
                }
                break;
            }
            _ = sigterm.recv() => {
                // Asked to stop by a supervisor: stop the command, report.
                if let Some(c) = child.as_mut() {
                    terminate(c).await;
                    child_status = c.wait().await.ok();
                }
                break;
            }
            _ = sleep_until(deadline) => {
                if let Some(c) = child.as_mut() {
                    terminate(c).await;
                    child_status = c.wait().await.ok();
                }
                break;
            }
            _ = vm_tick.tick(), if opts.vms => {
                forget_exited_vms(&mut probes, &known, &mut exited);
                for (slot, pid, src) in name_new_vms(&mut probes, &known) {
                    channel_tasks.push(tokio::spawn(channel::follow(slot, pid, src, known.clone(), correlator.clone(), stop_rx.clone())));
                }
            }
            _ = async { stop.as_mut().expect("guarded").wait_for(|s| *s).await.ok() }, if stop.is_some() => {
                if let Some(c) = child.as_mut() {
                    terminate(c).await;
                    child_status = c.wait().await.ok();
                }
                break;
            }
            _ = live_tick.tick(), if feed.is_some() => {
                if let Some(feed) = feed.as_ref() {
                    // An API run starting or stopping asks for QEMU's own
                    // counters beside this frame's figures.
                    let with_qemu = metrics.as_ref().is_some_and(|m| {
                        m.qemu_wanted.swap(false, std::sync::atomic::Ordering::Relaxed)
                    });
                    send_frame(feed, t0.elapsed().as_secs_f64(), &probes, &correlator, &known, with_qemu);
                }
            }
            _ = tick.tick() => {
                // Progress from the kernel's own counters: reading our
                // per-CPU histograms every second would cost more than the
                // tracing on a many-CPU host.
                let ios: u64 = diskstats::delta(&kernel0, &diskstats::read_all())
                    .iter()
                    .filter(|(d, _)| only.is_empty() || only.contains(d))
                    .map(|(_, k)| k.reads + k.writes + k.discards + k.flushes)
                    .sum();
                progress.show(t0.elapsed(), ios);
                // Only when scraped since the last refresh: an agent nobody
                // scrapes reads no histograms.
                if let Some(m) = metrics.as_ref() {
                    if m.wanted.swap(false, std::sync::atomic::Ordering::Relaxed) {
                        refresh_metrics(m, &probes, &correlator, &known, export_shared.as_ref());
                    }
                }
            }
        }
    }
    let elapsed = t0.elapsed().as_secs_f64();
    // The kernel's counters first, then ours: a request the kernel has
    // counted has already been through our tracepoint, so a shortfall is
    // real, never a race of the two reads.
    let kernel = diskstats::delta(&kernel0, &diskstats::read_all());
    let mut snap = probes
        .snapshot()
        .context("reading the block-layer statistics")?;
    // A VM named this late has finished: nothing left to read on its channel.
    let _ = name_new_vms(&mut probes, &known);
    // Completions never handed to us are found when their tag is used
    // again; the rest are still open in the table, and those of VMs that
    // have exited are finished.
    let open = {
        let k = known.lock().unwrap_or_else(|p| p.into_inner());
        probes.open_requests_of_exited(|slot| k.vms.get(&slot).is_some_and(|vm| !vms::alive(vm)))
    };
    match open {
        Ok(open) => {
            for (k, n) in open {
                snap.vm_stats.entry(k).or_default().undelivered += n;
                snap.counters.undelivered += n;
            }
        }
        Err(e) => log::warn!("{}", crate::probes::error_chain(&e)),
    }
    snap.counters.unseen = report::unseen(&snap.stats, &kernel, &only);
    progress.done();

    let _ = stop_tx.send(true);
    let qemu = match qemu_task {
        Some(t) => t.await.unwrap_or_default(),
        None => Default::default(),
    };
    // Guest records still on their way first: the stitcher must see them
    // before the ring's last records settle it.
    for t in channel_tasks {
        let _ = t.await;
    }
    let _ = events_stop_tx.send(true);
    let mut events_written = 0;
    let mut export = None;
    if let Some(t) = events_task {
        (events_written, export) = t
            .await
            .context("event writer")?
            .context("writing --events-out")?;
    }
    let cpu1 = preflight::self_cpu();
    snap.counters.host_split = correlator
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .counters
        .clone();
    // Guards taken in the literal below would live to its end: the
    // registry's and the correlator's are taken here, one at a time.
    let (vms, guests, not_vms) = {
        // The correlator, then the registry: the order every task takes them in.
        let corr = correlator.lock().unwrap_or_else(|p| p.into_inner());
        let known = known.lock().unwrap_or_else(|p| p.into_inner());
        (
            report::vms(&known, &snap.vm_counts, &snap.vm_finished()),
            report::guests(&known, &corr.stitch),
            known.not_vms.len() as u64,
        )
    };
    let stitch = correlator
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .stitch
        .counters
        .clone();
    let mut report = RunReport {
        schema: SCHEMA.into(),
        duration_s: (elapsed * 1000.0).round() / 1000.0,
        command: (!opts.command.is_empty()).then(|| opts.command.clone()),
        exit_code: child_status.and_then(|s| s.code()),
        lost: snap.counters.clone(),
        probes: probes.attachments.clone(),
        agent: AgentCost {
            cpu_user_s: cpu1.0 - cpu0.0,
            cpu_sys_s: cpu1.1 - cpu0.1,
            bpf: opts.bpf_stats.then(|| probes.program_stats()),
        },
        vms,
        not_vms,
        guests,
        stitch,
        export,
        entries: {
            let mut e = report::entries(&snap.stats, &kernel, &only, elapsed);
            let corr = correlator.lock().unwrap_or_else(|p| p.into_inner());
            e.extend(report::vm_entries(
                &snap.vm_stats,
                &corr,
                &known.lock().unwrap_or_else(|p| p.into_inner()),
                &only,
                elapsed,
            ));
            e
        },
    };
    // Each VM's requests still in flight at the end (by how many QEMU's
    // count may honestly differ from ours) and submitted over the run.
    let (inflight, submitted) = {
        let finished = snap.vm_finished();
        let known = known.lock().unwrap_or_else(|p| p.into_inner());
        let mut inflight = std::collections::BTreeMap::new();
        let mut submitted = std::collections::BTreeMap::new();
        for (slot, c) in &snap.vm_counts {
            let done = finished.get(slot).map_or(0, |f| f.done);
            inflight.insert(known.name(*slot), c.submitted.saturating_sub(done));
            submitted.insert(known.name(*slot), c.submitted);
        }
        (inflight, submitted)
    };
    crate::output::qemu_check::compare(&mut report, &qemu, &inflight, &submitted);
    if let Some(path) = &opts.json_out {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("writing --json-out {}", path.display()))?;
    }
    if opts.events_out.is_some() {
        log::info!("{events_written} per-request records written");
    }
    let tails = {
        let corr = correlator.lock().unwrap_or_else(|p| p.into_inner());
        let known = known.lock().unwrap_or_else(|p| p.into_inner());
        corr.stitch
            .tails
            .as_ref()
            .map(|t| t.entries(&known))
            .unwrap_or_default()
    };
    Ok(RunOutcome {
        report,
        child_status,
        tails,
    })
}
