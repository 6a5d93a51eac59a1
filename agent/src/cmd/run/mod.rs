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
    model::Tier,
    output::export::{TraceOpts, Tracer},
    output::report::RunReport,
    pipeline::channel,
    pipeline::correlate::Correlator,
    probes::host::{BlockConfig, BlockProbes},
    probes::preflight,
};

mod events;
mod execs;
mod finish;
mod follow;
mod live;
mod observe;
mod progress;
mod qemu;
mod session;

use events::*;
use follow::*;
use live::*;
use progress::*;
use session::*;

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
    /// What the run measures of VMs, and so what it costs.
    pub tier: Tier,
    /// Program flavours never to use (`--avoid`).
    pub avoid: Vec<crate::probes::Flavour>,
    pub quiet: bool,
    pub command: Vec<String>,
    /// Per-I/O traces over OTLP (when an endpoint is set).
    pub traces: TraceOpts,
    /// Serve the HTTP API (/metrics and the rest, see `api`) on ADDR.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Or keep an API served elsewhere (the agent service's) up to date.
    pub api: Option<Arc<crate::api::Shared>>,
    /// A live view's feed: a frame of the figures so far at each interval.
    pub live: Option<LiveFeed>,
    /// Ends the run when it turns true (a live view quitting).
    pub stop: Option<watch::Receiver<bool>>,
    /// No report is made of the run (a live view's): QEMU's own counters,
    /// which a report sets beside ours, are not read.
    pub no_report: bool,
    /// Keep every request's segments for the run's tails (a labelled
    /// benchmark run: `RunOutcome::tails`).
    pub tails: bool,
    /// Ends the run once the VM of this name has been followed and has
    /// exited (`verify --vm`): what it did is all in by then.
    pub until_exit_of: Option<String>,
}

/// From a VM's exit to the end of a run waiting for it: the ring buffer's
/// last records read, the exit's own bookkeeping done.
const AFTER_EXIT: Duration = Duration::from_secs(1);

/// How often a VM waiting for its guest to run is looked at: a few reads
/// of /proc per vCPU, only while one waits.
const START_LOOK: Duration = Duration::from_millis(5);

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
    // Taken before the seconds of loading: a Ctrl-C or SIGTERM then ends
    // the run as soon as it starts, with its report, not the process.
    let mut signals = Signals::take()?;
    preflight::require_bpf_privileges()?;
    let only = resolve_disks(&opts.disks)?;
    check_options(&opts)?;
    let tracer = if opts.traces.any_enabled() {
        Some(Tracer::start(&opts.traces)?)
    } else {
        None
    };
    let (known, cfg) = discover(&opts, &only, tracer.as_ref());
    let _stats = opts
        .bpf_stats
        .then(crate::probes::progstats::keep_run_times)
        .transpose()
        .context("enabling BPF run-time statistics")?;
    let probes = BlockProbes::load(&cfg).context("loading the block-layer probes")?;
    let mut s = Session::new(probes, known, &opts, only, tracer.as_ref());
    s.follow_running_vms();
    let (stop_tx, stop_rx) = watch::channel(false);
    s.spawn_running_channels(&stop_rx);
    // The event writer stops after the guest channels: guest records still
    // on their way must be joined before it settles the rest as unmatched.
    let (events_stop_tx, events_stop_rx) = watch::channel(false);
    let events_task = s.spawn_events(&opts, events_stop_rx, tracer)?;
    // Baseline after attaching (and a moment for completions already under
    // way to land): any request the kernel counts from here on has passed
    // our completion tracepoint first.
    tokio::time::sleep(Duration::from_millis(5)).await;
    s.metrics = match (&opts.api, opts.metrics_listen) {
        (Some(shared), _) => Some(shared.clone()),
        (None, Some(addr)) => {
            let shared = serve_metrics(addr).await?;
            // `--deep` is this run's own tier: its API's runs may deepen
            // it, never take it back to always-on.
            if opts.tier.is_deep() {
                shared
                    .deep_runs
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            Some(shared)
        }
        (None, None) => None,
    };
    let start = Start::now();
    // QEMU's own counters, beside ours at the end. The agent service reads
    // them at its API runs' edges instead (see `send_frame`): not every
    // 100 ms for its whole life.
    let qemu_task = (opts.vms && opts.api.is_none() && !opts.no_report).then(|| {
        // Without its own handle on our counts, a VM that exits within
        // the run has its last requests taken for a mismatch.
        let ours = s
            .probes
            .vm_counts_reader()
            .map_err(|e| log::warn!("{}", crate::probes::error_chain(&e)))
            .ok();
        tokio::spawn(qemu::watch(s.known.clone(), stop_rx.clone(), ours))
    });
    // What the diagnosis reads beside the I/O: the VMs' threads, throttles
    // and busy spans; the live feed takes it window by window.
    let observe_task = opts.vms.then(|| {
        let ours = s.probes.vm_counts_reader().ok();
        let observer = s
            .diagnoses
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .observer
            .clone();
        let every = if opts.api.is_some() {
            observe::AGENT_EVERY
        } else {
            observe::RUN_EVERY
        };
        tokio::spawn(observe::watch(
            s.known.clone(),
            stop_rx.clone(),
            ours,
            (observer, s.monitors.clone()),
            every,
        ))
    });
    let child = spawn_command(&opts.command)?;
    let child_status = s
        .trace(&opts, child, &start, &stop_rx, &mut signals)
        .await?;
    let mut ended = s.end(&start)?;
    let _ = stop_tx.send(true);
    let qemu = match qemu_task {
        Some(t) => t.await.unwrap_or_default(),
        None => Default::default(),
    };
    let watched = match observe_task {
        Some(t) => t.await.unwrap_or_default(),
        None => Default::default(),
    };
    // Guest records still on their way first: the stitcher must see them
    // before the ring's last records settle it.
    for t in std::mem::take(&mut s.channel_tasks) {
        let _ = t.await;
    }
    let _ = events_stop_tx.send(true);
    if let Some(t) = events_task {
        let drained = t
            .await
            .context("event writer")?
            .context("writing --events-out")?;
        (ended.events_written, ended.export) = (drained.written, drained.export);
    }
    finish::report(&s, &opts, ended, child_status, &start, (&qemu, &watched))
}

fn resolve_disks(names: &[String]) -> Result<Vec<Dev>> {
    names
        .iter()
        .map(|d| disks::resolve(d).with_context(|| format!("--disk {d}")))
        .collect()
}

fn check_options(opts: &RunOptions) -> Result<()> {
    if let Some(cmd) = opts.command.first() {
        preflight::require_command(cmd)?;
    }
    if opts.traces.any_enabled() && !opts.vms {
        bail!("traces are of VM I/O: drop --no-vms, or unset OTEL_EXPORTER_OTLP_ENDPOINT and --otlp-endpoint");
    }
    if opts.events_out.is_none() && (opts.sample_every > 0 || opts.slower_than.is_some()) {
        bail!("--sample and --slower-than choose which requests go to --events-out FILE; add --events-out");
    }
    if opts.tier.is_deep() && !opts.vms {
        bail!("--deep is about VMs' host windows: drop --no-vms, or --deep");
    }
    Ok(())
}

/// The VMs running now (slots 1..; later ones are named as they appear,
/// while their /proc entry exists) and the kernel side's settings.
fn discover(
    opts: &RunOptions,
    only: &[Dev],
    tracer: Option<&Tracer>,
) -> (Arc<Mutex<Registry>>, BlockConfig) {
    let mut known = Registry::default();
    let running = if opts.vms { vms::scan() } else { Vec::new() };
    let vm_pids: Vec<u32> = running.iter().map(|v| v.pid).collect();
    let mut vm_maps = VmMaps::default();
    for (i, vm) in running.into_iter().enumerate() {
        vm_maps.extend(known.add(i as u32 + 1, vm));
    }
    let streams = Streams::of(opts, tracer);
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
        stream_devs: only.to_vec(),
        start_stamps: opts.start_stamps,
        track_vms: opts.vms,
        vm_pids,
        vm_maps,
        tier: opts.tier,
        vm_one_in: streams.one_in,
        vm_slower_than_ns: streams.slower_than_ns,
        avoid: opts.avoid.clone(),
    };
    // Shared with the per-request writer, which names VMs and vdisks.
    (Arc::new(Mutex::new(known)), cfg)
}

fn spawn_command(command: &[String]) -> Result<Option<tokio::process::Child>> {
    let Some((prog, args)) = command.split_first() else {
        return Ok(None);
    };
    Command::new(prog)
        .args(args)
        .kill_on_drop(true)
        .spawn()
        .map(Some)
        .with_context(|| format!("starting `{}`", command.join(" ")))
}

/// What the run measures from: the kernel's own disk counters, our CPU
/// time, the clock.
pub(super) struct Start {
    kernel: std::collections::BTreeMap<Dev, diskstats::DiskStat>,
    cpu: (f64, f64),
    at: Instant,
}

impl Start {
    fn now() -> Self {
        Self {
            kernel: diskstats::read_all(),
            cpu: preflight::self_cpu(),
            at: Instant::now(),
        }
    }
}

/// Why the traced loop ends, other than the command's exit.
enum Ending {
    /// Ctrl-C: the command (if any) finishes its own way.
    Interrupt,
    /// The deadline, SIGTERM, or a live view quitting: the command is
    /// stopped.
    Stop,
}

/// The signals that end a run.
pub(crate) struct Signals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl Signals {
    fn take() -> Result<Self> {
        Ok(Self {
            interrupt: signal(SignalKind::interrupt()).context("handling SIGINT")?,
            terminate: signal(SignalKind::terminate()).context("handling SIGTERM")?,
        })
    }
}

impl Session {
    /// Traces until the command exits, the deadline passes, or a signal or
    /// a live view ends the run. Returns the command's exit status.
    async fn trace(
        &mut self,
        opts: &RunOptions,
        mut child: Option<tokio::process::Child>,
        start: &Start,
        stop_rx: &watch::Receiver<bool>,
        signals: &mut Signals,
    ) -> Result<Option<ExitStatus>> {
        let progress = Progress::new(opts.quiet, child.is_some());
        let deadline = opts.duration.map(|d| tokio::time::Instant::now() + d);
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        // Frames for a live view, or for the API's snapshot, stream and runs.
        let feed = opts.live.clone().or_else(|| {
            self.metrics.as_ref().map(|m| LiveFeed {
                tx: m.frames.clone(),
                every: Duration::from_secs(1),
            })
        });
        let mut live_tick =
            tokio::time::interval(feed.as_ref().map_or(Duration::from_secs(1), |l| l.every));
        // The API asks for a frame at once where a run starts or stops.
        let api = self.metrics.clone().filter(|_| feed.is_some());
        let mut stop = opts.stop.clone();
        let mut vm_gone: Option<tokio::time::Instant> = None;
        tick.tick().await;
        // Exited VMs let go, the tier an API run asks for applied.
        let mut vm_tick = tokio::time::interval(Duration::from_millis(100));
        // New VMs named: one just exec'd before its firmware's first read
        // (tens of milliseconds after its exec under TCG), which its disks'
        // files must be known by to be the virtual disk's. The kernel side
        // wakes us at each VM exec; the VM tick looks at its generation
        // too, for an exec whose wakeup found the ring full.
        let mut execs = execs::ExecWatch::new(&mut self.probes);
        // A VM whose guest's start no kick shows (TCG) is looked at often
        // while it waits: its firmware may read soon after its vCPUs run.
        let mut start_tick = tokio::time::interval(START_LOOK);
        start_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        // QEMU's counters being read for an API run's edge: its frame
        // waits for them, the loop does not.
        let mut edge: Option<tokio::task::JoinHandle<EdgeCounts>> = None;
        let ending = loop {
            tokio::select! {
                status = async { child.as_mut().expect("guarded").wait().await }, if child.is_some() => {
                    return Ok(Some(status.context("waiting for the traced command")?));
                }
                _ = signals.interrupt.recv() => break Ending::Interrupt,
                _ = signals.terminate.recv() => break Ending::Stop,
                _ = sleep_until(deadline) => break Ending::Stop,
                _ = async { stop.as_mut().expect("guarded").wait_for(|s| *s).await.ok() }, if stop.is_some() => break Ending::Stop,
                _ = sleep_until(vm_gone), if vm_gone.is_some() => break Ending::Stop,
                _ = vm_tick.tick() => {
                    if opts.vms {
                        if execs.moved(&self.probes) {
                            self.name_vms(stop_rx);
                        }
                        self.follow_vms();
                        if vm_gone.is_none() && opts.until_exit_of.as_deref().is_some_and(|n| self.has_exited(n)) {
                            vm_gone = Some(tokio::time::Instant::now() + AFTER_EXIT);
                        }
                    } else {
                        // No VM to follow, no tier to switch: the look is
                        // still counted, for a deep run waiting on it.
                        self.apply_wanted_tier();
                    }
                }
                _ = start_tick.tick(), if opts.vms && self.awaiting_run() => {
                    start_vms_that_ran(&mut self.probes, &self.known);
                }
                _ = execs.exec(), if opts.vms => {
                    if execs.moved(&self.probes) {
                        self.name_vms(stop_rx);
                    }
                }
                // While an edge's read is under way its frame is the next.
                _ = live_tick.tick(), if feed.is_some() && edge.is_none() => {
                    if let Some(feed) = feed.as_ref() {
                        self.frame_or_edge(feed, start, &mut edge);
                    }
                }
                _ = async { api.as_ref().expect("guarded").frame_asked.notified().await }, if api.is_some() && edge.is_none() => {
                    if let Some(feed) = feed.as_ref() {
                        self.frame_or_edge(feed, start, &mut edge);
                        live_tick.reset();
                    }
                }
                q = async { edge.as_mut().expect("guarded").await }, if edge.is_some() => {
                    edge = None;
                    if let Some(feed) = feed.as_ref() {
                        self.send_frame(feed, start.at.elapsed().as_secs_f64(), q.ok());
                        live_tick.reset();
                    }
                }
                _ = tick.tick() => self.each_second(&progress, start),
            }
        };
        progress.done();
        let Some(c) = child.as_mut() else {
            return Ok(None);
        };
        if !matches!(ending, Ending::Interrupt) {
            terminate(c).await;
        }
        Ok(c.wait().await.ok())
    }

    /// A frame now, or, where an API run asked for QEMU's counters, their
    /// read begun (its frame follows it).
    fn frame_or_edge(
        &self,
        feed: &LiveFeed,
        start: &Start,
        edge: &mut Option<tokio::task::JoinHandle<EdgeCounts>>,
    ) {
        match self.edge_read() {
            Some(read) => *edge = Some(read),
            None => self.send_frame(feed, start.at.elapsed().as_secs_f64(), None),
        }
    }

    /// Once a second: progress from the kernel's own counters (reading
    /// our per-CPU histograms every second would cost more than the
    /// tracing on a many-CPU host), /metrics when scraped, the trace
    /// thresholds.
    fn each_second(&mut self, progress: &Progress, start: &Start) {
        let ios: u64 = diskstats::delta(&start.kernel, &diskstats::read_all())
            .iter()
            .filter(|(d, _)| self.only.is_empty() || self.only.contains(d))
            .map(|(_, k)| k.reads + k.writes + k.discards + k.flushes)
            .sum();
        progress.show(start.at.elapsed(), ios);
        // Only when scraped since the last refresh: an agent nobody
        // scrapes reads no histograms.
        if let Some(m) = self.metrics.clone() {
            if m.wanted.swap(false, std::sync::atomic::Ordering::Relaxed) {
                self.refresh_metrics(&m);
            }
        }
        self.update_trace_thresholds();
    }

    /// Whether a VM of this name was followed and has exited.
    fn has_exited(&self, name: &str) -> bool {
        let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        self.exited
            .iter()
            .any(|slot| known.vms.get(slot).is_some_and(|vm| vm.name == name))
    }

    /// A VM tick: exited VMs let go, VMs that created their KVM VM since
    /// they were named learnt, the tier an API run asks for applied (new
    /// VMs are named at the exec tick: `name_vms`).
    fn follow_vms(&mut self) {
        forget_exited_vms(&mut self.probes, &self.known, &mut self.exited);
        learn_late_kvm(&mut self.probes, &self.known);
        start_vms_that_ran(&mut self.probes, &self.known);
        self.apply_wanted_tier();
    }

    /// Whether a VM waits for its vCPUs to be seen running.
    fn awaiting_run(&self) -> bool {
        let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        !known.awaiting_run.is_empty()
    }

    /// New VMs named, their guest channels followed.
    fn name_vms(&mut self, stop_rx: &watch::Receiver<bool>) {
        let named = name_new_vms(&mut self.probes, &self.known);
        for (slot, pid, src) in named {
            self.spawn_channel(slot, pid, src, stop_rx);
        }
    }
}
