//! `iospan run`: trace while a command runs (or for a duration, or until
//! Ctrl-C), show progress, then report per disk and op.

use std::{
    io::{IsTerminal, Write},
    path::PathBuf,
    process::ExitStatus,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use tokio::{
    io::unix::AsyncFd,
    process::Command,
    signal::unix::{signal, SignalKind},
    sync::watch,
};

use crate::{
    abi::{BlkIoEvent, Record, RQ_F_NO_ISSUE, RQ_F_NO_START},
    discover::disks::{self, Dev},
    discover::diskstats,
    discover::vms::{self, Registry, VmMaps},
    model::IoSpan,
    model::Op,
    output::export::{ExportCounters, Names, TraceOpts, Tracer},
    output::report::{self, AgentCost, RunReport, SCHEMA},
    pipeline::channel,
    pipeline::correlate::Correlator,
    probes::block::{BlockConfig, BlockProbes},
    probes::preflight,
};

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
    for (slot, vm) in known.lock().unwrap_or_else(|p| p.into_inner()).vms.iter() {
        attach_vm_probes(&mut probes, vm);
        add_engines(&mut probes, *slot, vm);
    }
    for a in &probes.attachments {
        log::info!("attached {} via {}", a.tracepoint, a.flavour.as_str());
    }

    let (stop_tx, stop_rx) = watch::channel(false);
    // VM requests' host windows are split from records in the ring buffer;
    // a request waits up to 50 ms of stream time for the guest's signal.
    let correlator = Arc::new(Mutex::new(Correlator::new(50_000_000)));
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
                    send_frame(feed, t0.elapsed().as_secs_f64(), &probes, &correlator, &known);
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
    let report = RunReport {
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
                &corr.splits,
                &corr.stitch.stitched,
                &corr.stitch.queues,
                &known.lock().unwrap_or_else(|p| p.into_inner()),
                &only,
                elapsed,
            ));
            e
        },
    };
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

/// Names VM slots the kernel side handed out since the last look, and
/// tells it their backing files. A QEMU process that runs no guest (a
/// capability probe), or is gone before it could be named, is let go: its
/// requests are the host's, and it is counted, not shown.
/// Returns the guest channels of the VMs it named.
fn name_new_vms(probes: &mut BlockProbes, known: &Mutex<Registry>) -> Vec<GuestChannel> {
    let mut channels = Vec::new();
    let Ok(pids) = probes.vm_pids() else {
        return channels;
    };
    let mut known = known.lock().unwrap_or_else(|p| p.into_inner());
    for (tgid, slot) in pids {
        if known.vms.contains_key(&slot) || known.not_vms.contains_key(&slot) {
            continue;
        }
        let mut vm = match vms::identify(tgid) {
            Some(vm) if vm.not_vm.is_none() => vm,
            other => {
                let why = other
                    .and_then(|v| v.not_vm)
                    .unwrap_or_else(|| "gone before it could be named".to_string());
                log::debug!("QEMU pid {tgid} is not a VM: {why}");
                if let Err(e) = probes.forget_vm(tgid, slot) {
                    log::warn!("QEMU pid {tgid}: {}", crate::probes::error_chain(&e));
                }
                known.not_vms.insert(slot, vms::NotVm { pid: tgid, why });
                continue;
            }
        };
        // A VM's requests need their submitter taken at their start, and
        // its notifications followed.
        if let Err(e) = probes.ensure_vm_probes() {
            log::warn!("VM attribution off: {}", crate::probes::error_chain(&e));
        }
        {
            // Exec'd while the probes ran: its notifiers were seen created.
            vm.kicks = vms::KickSource::QueueNotifiers;
            if !vm.named_threads {
                // No vCPU to see start the guest: its requests are the
                // guest's from here (QEMU's own start-up reads included).
                if let Err(e) = probes.mark_started(tgid) {
                    log::warn!("VM pid {tgid}: {}", crate::probes::error_chain(&e));
                }
            }
            log::info!(
                "VM {} (pid {tgid}) with disks {:?}",
                vm.name,
                vm.disks.iter().map(|d| &d.id).collect::<Vec<_>>()
            );
            attach_vm_probes(probes, &vm);
            if let Some(src) = &vm.channel {
                channels.push((slot, vm.pid, src.clone()));
            }
            let maps = known.add(slot, vm);
            if let Err(e) = probes.add_vm_maps(&maps) {
                log::warn!("VM pid {tgid}: {}", crate::probes::error_chain(&e));
            }
            if let Some(vm) = known.vms.get(&slot) {
                add_engines(probes, slot, vm);
            }
        }
    }
    channels
}

/// Lets go of VMs whose process has exited: their probes are detached and
/// their pid no longer names them. They stay in the registry: the report
/// still names their requests.
fn forget_exited_vms(
    probes: &mut BlockProbes,
    known: &Mutex<Registry>,
    exited: &mut std::collections::BTreeSet<u32>,
) {
    let mut known = known.lock().unwrap_or_else(|p| p.into_inner());
    let known = &mut *known;
    for (slot, vm) in known.vms.iter() {
        if exited.contains(slot) {
            continue;
        }
        let vm_alive = vms::alive(vm);
        // An engine goes with its VM, or alone when it exits first (its
        // pid must not name the VM for whoever is given it next).
        for e in vm.engines() {
            if known.engines.get(&e.pid) != Some(slot) || (vm_alive && vms::engine_alive(e)) {
                continue;
            }
            known.engines.remove(&e.pid);
            match probes.forget_vm(e.pid, *slot) {
                Ok(()) => log::info!(
                    "{} (pid {}) no longer serves VM {}: its probes detached",
                    e.program,
                    e.pid,
                    vm.name
                ),
                Err(err) => log::warn!(
                    "{} (pid {}): {}",
                    e.program,
                    e.pid,
                    crate::probes::error_chain(&err)
                ),
            }
        }
        if vm_alive {
            continue;
        }
        exited.insert(*slot);
        known.exited.insert(*slot);
        match probes.forget_vm(vm.pid, *slot) {
            Ok(()) => log::info!(
                "VM {} (pid {}) exited: its probes detached",
                vm.name,
                vm.pid
            ),
            Err(e) => log::warn!("VM {} exited: {}", vm.name, crate::probes::error_chain(&e)),
        }
    }
}

/// Registers the engine processes serving a VM's disks from outside QEMU
/// under its slot (those not also serving another VM: `Registry::add`).
fn add_engines(probes: &mut BlockProbes, slot: u32, vm: &vms::Vm) {
    for d in vm.disks.iter().filter(|d| d.engine_shared) {
        log::warn!(
            "VM {} disk {}: {}",
            vm.name,
            d.id,
            d.split_support().err().unwrap_or_default()
        );
    }
    for e in vm.engines() {
        match probes.add_engine(e, slot) {
            Ok(()) => log::info!(
                "VM {}: disks served by {} (pid {}, export {})",
                vm.name,
                e.program,
                e.pid,
                e.export
            ),
            Err(err) => log::warn!(
                "VM {}: {} (pid {}) not followed: {}",
                vm.name,
                e.program,
                e.pid,
                crate::probes::error_chain(&err)
            ),
        }
    }
}

/// A VM's guest channel: its slot, its process, the chardev's socket.
type GuestChannel = (u32, u32, vms::SocketSource);

/// The guest channels of the VMs known now.
fn guest_channels(known: &Registry) -> Vec<GuestChannel> {
    known
        .vms
        .iter()
        .filter_map(|(slot, vm)| Some((*slot, vm.pid, vm.channel.clone()?)))
        .collect()
}

/// The per-VM probes: the worker hand-off for aio=threads disks, the
/// worker switch-in and MSI for kernel vhost disks, and the
/// probes that end its host windows. A failure costs the VM its split,
/// not the run.
fn attach_vm_probes(probes: &mut BlockProbes, vm: &vms::Vm) {
    if !vm.disks.iter().any(|d| d.split_supported()) {
        if let Err(e) = probes.exempt_from_stop(vm.pid) {
            log::warn!("VM {}: {}", vm.name, crate::probes::error_chain(&e));
        }
    }
    // Probes some disks need, shared by every VM that has such a disk.
    let needs =
        |kind: fn(&vms::VDisk) -> bool| vm.disks.iter().any(|d| d.split_supported() && kind(d));
    let unsplit = |what: &str, e: crate::probes::LoadError| {
        log::warn!(
            "VM {}: {what} disks not split: {}",
            vm.name,
            crate::probes::error_chain(&e)
        )
    };
    if needs(vms::VDisk::worker_submitted) {
        if let Err(e) = probes.ensure_handoff_probe() {
            unsplit("aio=threads", e);
        }
    }
    if needs(vms::VDisk::kernel_vhost) {
        if let Err(e) = probes.ensure_vhost_probes() {
            unsplit("kernel vhost", e);
        }
    }
    if let Err(e) = probes.attach_vm_uprobes(vm) {
        log::warn!(
            "VM {}: no host-window split or merge count: {}",
            vm.name,
            crate::probes::error_chain(&e)
        );
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// SIGTERM, then SIGKILL if it has not gone after a grace period.
async fn terminate(child: &mut tokio::process::Child) {
    if let Some(pid) = child.id() {
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    }
    if tokio::time::timeout(Duration::from_secs(5), child.wait())
        .await
        .is_err()
    {
        let _ = child.kill().await;
    }
}

/// Drains the ring buffer into JSON lines until told to stop, then each
/// joined guest I/O (those at least `slower_than_ns` long). The kernel
/// side wakes us only past a backlog threshold, so a timer drains too.
async fn drain_events<W: Write>(
    ring: aya::maps::RingBuf<aya::maps::MapData>,
    mut out: Option<W>,
    known: Arc<Mutex<Registry>>,
    correlator: Arc<Mutex<Correlator>>,
    mut stop: watch::Receiver<bool>,
    slower_than_ns: u64,
    mut tracer: Option<Tracer>,
) -> Result<(u64, Option<ExportCounters>)> {
    // SAFETY: the ring buffer owns its fd and outlives the registration
    // (AsyncFd owns the ring buffer).
    let mut fd = unsafe { AsyncFd::register_with_interest(ring, tokio::io::Interest::READABLE) }
        .map_err(|e| anyhow::anyhow!("polling the ring buffer: {e}"))?;
    let mut timer = tokio::time::interval(Duration::from_millis(100));
    let mut written = 0u64;
    let mut malformed = 0u64;
    let mut disk_names = disks::Names::default();
    loop {
        let stopping = tokio::select! {
            r = fd.readable_mut() => { if let Ok(mut g) = r { g.clear_ready(); } false }
            _ = timer.tick() => false,
            _ = stop.changed() => true,
        };
        let ring = fd.get_mut();
        let mut corr = correlator.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(item) = ring.next() {
            match Record::from_bytes(&item) {
                Some(Record::BlkIo(ev)) => {
                    if let Some(out) = out.as_mut() {
                        let json = event_json(
                            &ev,
                            &known.lock().unwrap_or_else(|p| p.into_inner()),
                            &mut disk_names,
                        );
                        serde_json::to_writer(&mut *out, &json)?;
                        out.write_all(b"\n")?;
                        written += 1;
                    }
                }
                Some(Record::VmIo(ev)) => {
                    let followed = known
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .split
                        .contains(&ev.vdisk);
                    corr.on_io(ev, followed)
                }
                Some(Record::VmSignal(ev)) => corr.on_signal(ev.vm, ev.ts_ns),
                // Guest records travel the guest channel, never this ring.
                Some(Record::GuestIo(_) | Record::GuestReap(_)) | None => malformed += 1,
            }
        }
        if stopping {
            corr.finish();
        }
        let spans = corr.stitch.take_spans();
        drop(corr);
        {
            let known = known.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(out) = out.as_mut() {
                for sp in spans.iter().filter(|s| s.total_ns >= slower_than_ns) {
                    serde_json::to_writer(&mut *out, &span_json(sp, &known, &mut disk_names))?;
                    out.write_all(b"\n")?;
                    written += 1;
                }
            }
            if let Some(t) = tracer.as_mut() {
                for sp in spans {
                    t.offer(sp, |sp| names_of(sp, &known));
                }
                t.tick(|sp| names_of(sp, &known));
            }
        }
        if stopping {
            break;
        }
    }
    if let Some(out) = out.as_mut() {
        out.flush()?;
    }
    if malformed > 0 {
        log::warn!("{malformed} ring-buffer records of unexpected size or kind were dropped");
    }
    let export = match tracer {
        Some(t) => {
            let names =
                |sp: &IoSpan| names_of(sp, &known.lock().unwrap_or_else(|p| p.into_inner()));
            Some(t.finish(names, Duration::from_secs(10)).await)
        }
        None => None,
    };
    Ok((written, export))
}

/// What an I/O's VM, virtual disk and host disk are called.
fn names_of(sp: &IoSpan, known: &Registry) -> Names {
    Names {
        vm: known.name(sp.vm),
        vm_uuid: known.vms.get(&sp.vm).and_then(|v| v.uuid.clone()),
        vdisk: known.vdisk(sp.vdisk).unwrap_or_default().to_string(),
        host_disk: disks::name_of(Dev(sp.dev)),
        nvme: known
            .vdisk_model(sp.vdisk)
            .is_some_and(|m| m.starts_with("nvme")),
    }
}

fn event_json(
    ev: &BlkIoEvent,
    known: &Registry,
    disk_names: &mut disks::Names,
) -> serde_json::Value {
    let us = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1000.0;
    let start = (ev.flags & RQ_F_NO_START == 0).then_some(ev.start_ns);
    let issue = (ev.flags & RQ_F_NO_ISSUE == 0).then_some(ev.issue_ns);
    serde_json::json!({
        "kind": "host",
        "disk": disk_names.of(Dev(ev.dev)),
        "vm": (ev.vm != 0).then(|| known.name(ev.vm)),
        "vdisk": known.vdisk(ev.vdisk),
        "op": Op::from_index(ev.op as usize).unwrap_or(Op::Other),
        "sector": ev.sector,
        "bytes": ev.bytes,
        "start_ns": start,
        "issue_ns": issue,
        "done_ns": ev.done_ns,
        "total_us": start.or(issue).map(|s| us(s, ev.done_ns)),
        "queue_us": start.zip(issue).map(|(s, i)| us(s, i)),
        "service_us": issue.map(|i| us(i, ev.done_ns)),
        "requeues": ev.requeues,
        "flags": ev.flags,
    })
}

/// One joined guest I/O: its stamps (host clock) and four segments.
fn span_json(sp: &IoSpan, known: &Registry, disk_names: &mut disks::Names) -> serde_json::Value {
    let us = |ns: u64| ns as f64 / 1000.0;
    serde_json::json!({
        // A host window alone where the VM has no guest agent.
        "kind": if sp.has_guest { "guest_io" } else { "vm_io" },
        "vm": known.name(sp.vm),
        "vdisk": known.vdisk(sp.vdisk),
        "nvme": known.vdisk_model(sp.vdisk).is_some_and(|m| m.starts_with("nvme")),
        "host_disk": disk_names.of(Dev(sp.dev)),
        "queue": sp.queue,
        "op": sp.op,
        "pos": sp.pos,
        "bytes": sp.bytes,
        "begin_ns": sp.begin_ns,
        "guest_kick_ns": sp.guest_kick_ns,
        "kick_ns": sp.kick_ns,
        "pick_ns": sp.pick_ns,
        "start_ns": sp.start_ns,
        "issue_ns": sp.issue_ns,
        "done_ns": sp.done_ns,
        "signal_ns": sp.signal_ns,
        "guest_irq_ns": sp.guest_irq_ns,
        "end_ns": sp.end_ns,
        "clock_offset_ns": sp.clock_offset_ns,
        "total_us": us(sp.total_ns),
        "guest_us": us(sp.guest_ns),
        "hypervisor_us": us(sp.hypervisor_ns),
        "engine_us": us(sp.engine_ns),
        "device_us": us(sp.device_ns),
        "app_ends_from_block_layer": sp.app_ends_from_block_layer,
    })
}

struct Progress {
    tty: bool,
    quiet: bool,
    last_line: std::cell::Cell<Option<Instant>>,
}

impl Progress {
    fn new(quiet: bool) -> Self {
        Self {
            tty: std::io::stderr().is_terminal(),
            quiet,
            last_line: std::cell::Cell::new(None),
        }
    }

    fn show(&self, elapsed: Duration, ios: u64) {
        if self.quiet {
            return;
        }
        let secs = elapsed.as_secs_f64();
        let line = format!(
            "iospan: {secs:6.1} s  {ios:>12} I/Os  {:>10.0} IOPS",
            ios as f64 / secs.max(1e-9)
        );
        if self.tty {
            eprint!("\r{line}");
        } else if self
            .last_line
            .get()
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(10))
        {
            // Logs and CI get a line every ten seconds, not a carriage-return stream.
            eprintln!("{line}");
            self.last_line.set(Some(Instant::now()));
        }
    }

    fn done(&self) {
        if self.tty && !self.quiet {
            eprintln!();
        }
    }
}

#[cfg(feature = "serve")]
async fn serve_metrics(addr: std::net::SocketAddr) -> Result<Arc<crate::cmd::api::Shared>> {
    let shared = crate::cmd::api::Shared::new(None);
    crate::cmd::api::serve(addr, None, shared.clone())
        .await
        .with_context(|| format!("--metrics-listen {addr}"))?;
    Ok(shared)
}

#[cfg(not(feature = "serve"))]
async fn serve_metrics(addr: std::net::SocketAddr) -> Result<Arc<crate::cmd::api::Shared>> {
    bail!("--metrics-listen {addr}: this iospan was built without the HTTP server (the `serve` feature)")
}

/// The figures so far, to a live view.
fn send_frame(
    feed: &LiveFeed,
    at_s: f64,
    probes: &BlockProbes,
    correlator: &Mutex<Correlator>,
    known: &Mutex<Registry>,
) {
    let Ok(mut snap) = probes.snapshot() else {
        return;
    };
    let corr = correlator.lock().unwrap_or_else(|p| p.into_inner());
    snap.counters.host_split = corr.counters.clone();
    let known = known.lock().unwrap_or_else(|p| p.into_inner());
    let frame = crate::output::live::frame(at_s, &snap, &corr.splits, &corr.stitch, &known);
    let _ = feed.tx.send(Some(Arc::new(frame)));
}

fn refresh_metrics(
    m: &crate::cmd::api::Shared,
    probes: &BlockProbes,
    correlator: &Mutex<Correlator>,
    known: &Mutex<Registry>,
    export: Option<&crate::output::export::ExportShared>,
) {
    use crate::output::metrics::Format;
    let Ok(mut snap) = probes.snapshot() else {
        return;
    };
    let maps = probes.map_fill();
    let corr = correlator.lock().unwrap_or_else(|p| p.into_inner());
    snap.counters.host_split = corr.counters.clone();
    let known = known.lock().unwrap_or_else(|p| p.into_inner());
    let exemplars = export.map(|e| e.exemplars.lock().unwrap_or_else(|p| p.into_inner()));
    let view = crate::output::metrics::View {
        snap: &snap,
        splits: &corr.splits,
        stitched: &corr.stitch.stitched,
        known: &known,
        export: export.map(|e| e.stats.snapshot()),
        exemplars: exemplars.as_deref(),
        maps: &maps,
        cpu_s: preflight::self_cpu(),
    };
    let prometheus = crate::output::metrics::render(&view, Format::Prometheus);
    let openmetrics = crate::output::metrics::render(&view, Format::OpenMetrics);
    *m.prometheus.lock().unwrap_or_else(|p| p.into_inner()) = prometheus;
    *m.openmetrics.lock().unwrap_or_else(|p| p.into_inner()) = openmetrics;
}
