//! QEMU's own counters of each VM over a run, read as it runs: a VM
//! running when the run began is read at its start, a VM started during
//! it counts from zero (QEMU's counters start with the process); each is
//! read again every tick while it lives (a short QMP session each time:
//! the monitor stays free for the VM's manager), so the last read of a VM that exits within the run is at most a
//! tick before its end, and our own count of its requests is taken with
//! each read: what it did after QEMU's last read is known, not guessed.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tokio::sync::watch;

use crate::{
    discover::monitors::Monitors,
    discover::qemu_counts::{self, Counts, Source},
    discover::qmp::EXCHANGE,
    discover::vms::{self, Registry, Vm},
    output::qemu_check::VmQemu,
    probes::host::VmCountsReader,
};

/// Between reads of a QMP monitor (a session of about a millisecond).
const TICK: Duration = Duration::from_millis(100);
/// libvirt's client is a process per read: every few ticks.
const LIBVIRT_EVERY: u64 = 3;
/// After a failed read, the ticks until the next try double up to this.
const MAX_BACKOFF_TICKS: u64 = 20;
/// Failures in a row before the reason is logged (once a run per source).
const LOG_AFTER: u32 = 3;

/// One source of a VM's counts over the run.
struct Watched {
    source: Source,
    first: Option<Counts>,
    last: Option<Counts>,
    /// The VM's submitted requests (ours) just after the last good read.
    submitted_at_last: Option<u64>,
    /// Of those, the ones not finished when it began: QEMU's or not.
    unfinished_at_last: Option<u64>,
    /// The same just after the first: what ours counted before QEMU's
    /// counting for the run began.
    submitted_at_first: Option<u64>,
    last_at: Option<Instant>,
    failures: u32,
    next_try: u64,
    logged: bool,
    error: Option<String>,
}

/// One VM's sources.
struct WatchedVm {
    name: String,
    predates_run: bool,
    sources: Vec<Watched>,
    /// When it was first seen gone (it exited within the run).
    gone_at: Option<Instant>,
}

#[derive(Default)]
struct State {
    vms: BTreeMap<u32, WatchedVm>,
    at_start: BTreeSet<u32>,
    ticks: u64,
}

impl WatchedVm {
    /// Sources not found yet (QEMU still starting, an engine not yet
    /// named) are looked for again each tick; one found is kept.
    fn refresh_sources(&mut self, vm: &Vm) {
        let usable = |s: &Source| !matches!(s, Source::None { .. });
        if self.sources.is_empty() || self.sources.iter().any(|s| !usable(&s.source)) {
            let mut kept: Vec<Watched> = std::mem::take(&mut self.sources)
                .into_iter()
                .filter(|s| usable(&s.source))
                .collect();
            for f in qemu_counts::sources_of(vm) {
                if !kept.iter().any(|k| same_place(&k.source, &f)) {
                    kept.push(Watched {
                        source: f,
                        first: None,
                        last: None,
                        submitted_at_last: None,
                        unfinished_at_last: None,
                        submitted_at_first: None,
                        last_at: None,
                        failures: 0,
                        next_try: 0,
                        logged: false,
                        error: None,
                    });
                }
            }
            // The unusable ones stay only while nothing else says why.
            self.sources = kept;
        }
    }

    /// Each of its sources due at tick `ticks` read once.
    fn read(
        &mut self,
        slot: u32,
        vm: &Vm,
        (ticks, last): (u64, bool),
        ours: Option<&VmCountsReader>,
    ) {
        let predates_run = self.predates_run;
        for src in &mut self.sources {
            match &src.source {
                Source::None { .. } => continue,
                Source::Libvirt { .. } if !last && ticks % LIBVIRT_EVERY != 1 => continue,
                _ => {}
            }
            if !last && ticks < src.next_try {
                continue;
            }
            // What QEMU has counted at least: it counts a request as
            // it completes, and its read may take tens of ms.
            let finished_before = ours.and_then(|o| o.finished(slot));
            // A domain libvirt already counts as stopped (its process
            // still exiting) answers with no disk at all: no reading.
            let read = qemu_counts::read(&src.source, vm, EXCHANGE).and_then(|c| {
                if c.is_empty() && !vm.disks.is_empty() {
                    anyhow::bail!("the answer names none of its disks (stopping?)")
                }
                Ok(c)
            });
            match read {
                Ok(c) => src.answered(
                    c,
                    predates_run,
                    ours.and_then(|o| o.submitted(slot)),
                    finished_before,
                ),
                Err(e) => src.failed(&e, ticks, &self.name),
            }
        }
    }
}

impl Watched {
    fn answered(
        &mut self,
        c: Counts,
        predates_run: bool,
        submitted: Option<u64>,
        finished_before: Option<u64>,
    ) {
        self.failures = 0;
        self.error = None;
        if self.first.is_none() {
            // Started within the run: from zero, as QEMU began.
            self.first = Some(if predates_run {
                c.clone()
            } else {
                Counts::new()
            });
        }
        // Disk by disk: one missing from an answer keeps its last reading.
        let mut last = self.last.take().unwrap_or_default();
        last.extend(c);
        self.last = Some(last);
        self.last_at = Some(Instant::now());
        self.submitted_at_last = submitted.or(Some(0));
        self.unfinished_at_last = self
            .submitted_at_last
            .zip(finished_before)
            .map(|(s, f)| s.saturating_sub(f));
        if self.submitted_at_first.is_none() {
            self.submitted_at_first = self.submitted_at_last;
        }
    }

    fn failed(&mut self, e: &anyhow::Error, ticks: u64, vm: &str) {
        self.failures += 1;
        self.error = Some(format!("{e:#}"));
        // Kept trying while the VM lives, less and less often: a monitor
        // slow under load answers again.
        self.next_try = ticks + (1u64 << self.failures.min(5)).min(MAX_BACKOFF_TICKS);
        if self.failures >= LOG_AFTER && !self.logged {
            self.logged = true;
            log::info!(
                "QEMU's own counts of {vm}: {} (tried again less often)",
                self.error.as_deref().unwrap_or("")
            );
        }
    }
}

impl State {
    /// One pass over the VMs alive now; `last`: the run's closing one, which
    /// reads every VM whatever its pace or its failures. The VMs are read
    /// side by side: a monitor that answers late delays the pass by one
    /// exchange's deadline, however many VMs there are.
    fn pass(&mut self, live: Vec<(u32, Vm)>, last: bool, ours: Option<&VmCountsReader>) {
        self.ticks += 1;
        let now = Instant::now();
        let alive: BTreeSet<u32> = live.iter().map(|(s, _)| *s).collect();
        for (slot, w) in &mut self.vms {
            if !alive.contains(slot) && w.gone_at.is_none() {
                w.gone_at = Some(now);
            }
        }
        let mut due = Vec::new();
        for (slot, vm) in live {
            let predates_run = self.at_start.contains(&slot);
            let w = self.vms.entry(slot).or_insert_with(|| WatchedVm {
                name: vm.name.clone(),
                predates_run,
                sources: Vec::new(),
                gone_at: None,
            });
            // Seen again: not gone.
            w.gone_at = None;
            w.refresh_sources(&vm);
            due.push((slot, vm));
        }
        let ticks = self.ticks;
        let mut by_slot: BTreeMap<u32, &mut WatchedVm> =
            self.vms.iter_mut().map(|(s, w)| (*s, w)).collect();
        std::thread::scope(|scope| {
            for (slot, vm) in &due {
                if let Some(w) = by_slot.remove(slot) {
                    scope.spawn(move || w.read(*slot, vm, (ticks, last), ours));
                }
            }
        });
    }
    fn finish(self) -> BTreeMap<String, VmQemu> {
        self.vms
            .into_values()
            .map(|w| {
                let mut counts = BTreeMap::new();
                let mut errors = Vec::new();
                let mut engine_disks = BTreeSet::new();
                let mut submitted_at_last: Option<u64> = None;
                let mut unfinished_at_last: Option<u64> = None;
                let mut submitted_at_first: Option<u64> = None;
                let mut last_at: Option<Instant> = None;
                for src in &w.sources {
                    if let (Some(f), Some(l)) = (&src.first, &src.last) {
                        for (id, c) in l {
                            counts
                                .insert(id.clone(), f.get(id).map_or(*c, |before| c.since(before)));
                            if src.source.is_engine() {
                                engine_disks.insert(id.clone());
                            }
                        }
                        // The earliest of the last reads bounds what QEMU saw.
                        submitted_at_last = match (submitted_at_last, src.submitted_at_last) {
                            (Some(a), Some(b)) => Some(a.min(b)),
                            (a, b) => a.or(b),
                        };
                        unfinished_at_last = unfinished_at_last.max(src.unfinished_at_last);
                        // The latest of the first reads: where QEMU's window began.
                        submitted_at_first = submitted_at_first.max(src.submitted_at_first);
                        last_at = match (last_at, src.last_at) {
                            (Some(a), Some(b)) => Some(a.min(b)),
                            (a, b) => a.or(b),
                        };
                    } else if !matches!(src.source, Source::None { .. }) {
                        errors.push(format!(
                            "{}: {}",
                            src.source.describe(),
                            src.error.as_deref().unwrap_or("never read")
                        ));
                    }
                }
                let sources: Vec<Source> = w.sources.iter().map(|s| s.source.clone()).collect();
                (
                    w.name,
                    VmQemu {
                        sources,
                        counts,
                        engine_disks,
                        error: (!errors.is_empty()).then(|| errors.join("; ")),
                        predates_run: w.predates_run,
                        submitted_at_last_read: submitted_at_last,
                        unfinished_at_last_read: unfinished_at_last,
                        submitted_at_first_read: submitted_at_first.filter(|_| w.predates_run),
                        exited_ms_after_last_read: w
                            .gone_at
                            .zip(last_at)
                            .map(|(gone, t)| gone.saturating_duration_since(t).as_millis() as u64),
                    },
                )
            })
            .collect()
    }
}

/// How long a run's edge waits for QEMU's counters: an API run's start
/// and stop are answered within a second, whatever a VM's monitor does.
pub(super) const EDGE_WAIT: Duration = Duration::from_millis(750);

/// The VMs alive now, each with our count of its requests submitted so
/// far: what an edge's read of QEMU's counters is set beside.
pub(super) fn edge_vms(known: &Mutex<Registry>, ours: Option<&VmCountsReader>) -> Vec<(u64, Vm)> {
    alive(known)
        .into_iter()
        .map(|(slot, vm)| (ours.and_then(|o| o.submitted(slot)).unwrap_or(0), vm))
        .collect()
}

/// Every VM's counters now, each source read once: beside an API run's
/// first and last frames. The VMs are read side by side and waited for
/// `EDGE_WAIT` at most: a VM whose monitor has not answered by then is
/// said so (its own exchange ends by the same deadline), and one whose
/// monitor failed before is not asked until its back-off is over.
pub(super) fn read_all(
    vms: Vec<(u64, Vm)>,
    monitors: &Arc<Monitors>,
) -> BTreeMap<String, crate::output::live::FrameQemu> {
    let (tx, rx) = std::sync::mpsc::channel();
    for (i, (submitted, vm)) in vms.iter().cloned().enumerate() {
        let (tx, monitors) = (tx.clone(), monitors.clone());
        std::thread::spawn(move || {
            let _ = tx.send((i, read_one(&vm, submitted, &monitors)));
        });
    }
    drop(tx);
    let until = Instant::now() + EDGE_WAIT + Duration::from_millis(50);
    let mut got = BTreeMap::new();
    while got.len() < vms.len() {
        match rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
            Ok((i, f)) => {
                got.insert(i, f);
            }
            Err(_) => break,
        }
    }
    vms.iter()
        .enumerate()
        .map(|(i, (submitted, vm))| {
            let f = got
                .remove(&i)
                .unwrap_or_else(|| crate::output::live::FrameQemu {
                    source: qemu_counts::describe_all(&qemu_counts::sources_of(vm)),
                    submitted_before_read: *submitted,
                    error: Some(format!("its monitor gave no answer within {EDGE_WAIT:?}")),
                    ..Default::default()
                });
            (vm.name.clone(), f)
        })
        .collect()
}

/// One VM's counters from each of its sources.
fn read_one(
    vm: &Vm,
    submitted_before_read: u64,
    monitors: &Monitors,
) -> crate::output::live::FrameQemu {
    let sources = qemu_counts::sources_of(vm);
    let mut f = crate::output::live::FrameQemu {
        source: qemu_counts::describe_all(&sources),
        submitted_before_read,
        ..Default::default()
    };
    let mut errors = Vec::new();
    for s in sources {
        if matches!(s, Source::None { .. }) {
            continue;
        }
        match monitors.read(&s, vm, EDGE_WAIT) {
            Ok(c) => {
                if s.is_engine() {
                    f.engine_disks.extend(c.keys().cloned());
                }
                f.counts.extend(c);
            }
            Err(e) => errors.push(format!("{}: {e:#}", s.describe())),
        }
    }
    f.error = (!errors.is_empty()).then(|| errors.join("; "));
    f
}

/// Whether two sources read the same place.
fn same_place(a: &Source, b: &Source) -> bool {
    match (a, b) {
        (Source::Qmp { socket: x, .. }, Source::Qmp { socket: y, .. }) => x == y,
        (Source::Libvirt { domain: x }, Source::Libvirt { domain: y }) => x == y,
        (Source::Engine { pid: x, .. }, Source::Engine { pid: y, .. }) => x == y,
        (Source::None { why: x }, Source::None { why: y }) => x == y,
        _ => false,
    }
}

/// The VMs alive now, copied out of the registry.
fn alive(known: &Mutex<Registry>) -> Vec<(u32, Vm)> {
    let k = known.lock().unwrap_or_else(|p| p.into_inner());
    k.vms
        .iter()
        .filter(|(_, v)| v.not_vm.is_none() && vms::alive(v))
        .map(|(s, v)| (*s, v.clone()))
        .collect()
}

/// Reads every VM's counters until `stop`, then once more; QEMU's counts
/// over the run, by VM name. `ours`: our own count of each VM's requests,
/// read with QEMU's, so that requests after QEMU's last read of a VM that
/// exits are known.
pub(super) async fn watch(
    known: Arc<Mutex<Registry>>,
    mut stop: watch::Receiver<bool>,
    ours: Option<VmCountsReader>,
) -> BTreeMap<String, VmQemu> {
    let at_start: BTreeSet<u32> = known
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .vms
        .keys()
        .copied()
        .collect();
    let mut state = State {
        at_start,
        ..Default::default()
    };
    let ours = ours.map(Arc::new);
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let done = tokio::select! {
            _ = tick.tick() => false,
            r = stop.wait_for(|s| *s) => { let _ = r; true }
        };
        let live = alive(&known);
        let ours = ours.clone();
        // Sockets and a process per read: off the runtime's threads.
        state = match tokio::task::spawn_blocking(move || {
            state.pass(live, done, ours.as_deref());
            state
        })
        .await
        {
            Ok(s) => s,
            Err(_) => return BTreeMap::new(),
        };
        if done {
            return state.finish();
        }
    }
}
