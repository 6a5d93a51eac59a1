//! A run's moving parts while it traces: the probes, the VMs it knows, the
//! correlator, and what the kernel side streams.

use std::{
    collections::{BTreeSet, HashMap},
    sync::{Arc, Mutex},
};

use anyhow::{Context, Result};
use tokio::{sync::watch, task::JoinHandle};

use super::*;
use crate::{
    model::Hist,
    output::export::{DiskThreshold, ExportCounters, ExportShared},
    pipeline::reap::monotonic_ns,
};

/// Which joined VM requests the kernel streams (the always-on tier; the
/// deep tier streams every one): for `--events-out`, a labelled run's
/// tails, and traces.
#[derive(Clone, Debug, Default)]
pub(super) struct Streams {
    /// One in N (0: none by this rule; 1: every one).
    pub one_in: u32,
    /// Every one at least this slow (0: none by this rule).
    pub slower_than_ns: u64,
    /// The slowest K of each virtual disk a second, for traces: the kernel
    /// streams those above a threshold set each second from the last
    /// second's distribution (0: none by this rule).
    pub slowest: usize,
    /// Thresholds per virtual disk (`--trace-slower-than VDISK=D`).
    pub per_disk: Vec<DiskThreshold>,
}

impl Streams {
    pub(super) fn of(opts: &RunOptions, tracer: Option<&Tracer>) -> Self {
        let min_nonzero = |a: u64, b: u64| match (a, b) {
            (0, b) => b,
            (a, 0) => a,
            (a, b) => a.min(b),
        };
        let mut s = Streams::default();
        if opts.tails
            || (opts.events_out.is_some() && opts.sample_every == 0 && opts.slower_than.is_none())
        {
            s.one_in = 1;
            return s;
        }
        if opts.events_out.is_some() {
            s.one_in = opts.sample_every;
            s.slower_than_ns = opts.slower_than.map_or(0, |d| d.as_nanos() as u64);
        }
        if tracer.is_some() && opts.traces.enabled() {
            let p = &opts.traces.policy;
            s.one_in = min_nonzero(u64::from(s.one_in), p.one_in).min(u64::from(u32::MAX)) as u32;
            s.slower_than_ns = min_nonzero(s.slower_than_ns, p.slower_than_ns);
            s.slowest = p.slowest;
            s.per_disk = p.per_disk.clone();
        }
        s
    }
}

/// The adaptive part of `Streams::slowest`: each virtual disk's windows
/// as of the last second.
#[derive(Default)]
struct Thresholds {
    last: HashMap<u32, Hist>,
}

pub(super) struct Session {
    pub probes: BlockProbes,
    pub known: Arc<Mutex<Registry>>,
    pub correlator: Arc<Mutex<Correlator>>,
    pub only: Vec<Dev>,
    pub metrics: Option<Arc<crate::api::Shared>>,
    pub export_shared: Option<ExportShared>,
    pub channel_tasks: Vec<JoinHandle<()>>,
    pub exited: BTreeSet<u32>,
    pub streams: Streams,
    thresholds: Thresholds,
    /// Every disk's diagnosis for the live feed, window by window.
    pub diagnoses: Mutex<super::live::Diagnoses>,
    /// The VMs' monitors that misbehaved, tried again only after a back-off.
    pub monitors: Arc<crate::discover::monitors::Monitors>,
}

/// What the end of the trace hands the report.
pub(super) struct Ended {
    pub snap: crate::model::block::BlockSnapshot,
    pub kernel: std::collections::BTreeMap<Dev, diskstats::DiskStat>,
    pub elapsed: f64,
    pub events_written: u64,
    pub export: Option<ExportCounters>,
}

impl Session {
    pub(super) fn new(
        probes: BlockProbes,
        known: Arc<Mutex<Registry>>,
        opts: &RunOptions,
        only: Vec<Dev>,
        tracer: Option<&Tracer>,
    ) -> Self {
        // VM requests' host windows are split from records in the ring
        // buffer (the deep tier); a request waits up to 50 ms of stream
        // time for the guest's signal.
        let mut corr = Correlator::new(crate::abi::SIGNAL_HOLD_NS);
        if opts.events_out.is_some() || tracer.is_some() {
            corr.stitch.keep_spans();
        }
        if opts.tails {
            corr.stitch.keep_tails();
        }
        Self {
            probes,
            known,
            correlator: Arc::new(Mutex::new(corr)),
            only,
            metrics: None,
            export_shared: tracer.map(Tracer::shared),
            channel_tasks: Vec::new(),
            exited: BTreeSet::new(),
            streams: Streams::of(opts, tracer),
            thresholds: Thresholds::default(),
            diagnoses: Mutex::default(),
            monitors: Arc::default(),
        }
    }

    pub(super) fn known(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn corr(&self) -> std::sync::MutexGuard<'_, Correlator> {
        self.correlator.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// VMs running now have their requests followed from the load, their
    /// used-ring pushes (the deep tier) only once their probes are
    /// attached: when each was.
    pub(super) fn follow_running_vms(&mut self) {
        let known = self.known.clone();
        let mut known = known.lock().unwrap_or_else(|p| p.into_inner());
        let mut slots = Vec::new();
        for (slot, vm) in known.vms.iter_mut() {
            vm.kicks = kick_source(&self.probes, vm, false);
            attach_vm_probes(&mut self.probes, *slot, vm);
            add_engines(&mut self.probes, *slot, vm);
            slots.push(*slot);
        }
        drop(known);
        self.pushes_live_from(&slots);
        for a in &self.probes.attachments {
            log::info!("attached {} via {}", a.tracepoint, a.flavour.as_str());
        }
    }

    /// Guest channels of the VMs running now; later VMs' as they are named.
    pub(super) fn spawn_running_channels(&mut self, stop_rx: &watch::Receiver<bool>) {
        let channels = guest_channels(&self.known());
        for (slot, pid, src) in channels {
            self.spawn_channel(slot, pid, src, stop_rx);
        }
    }

    pub(super) fn spawn_channel(
        &mut self,
        slot: u32,
        pid: u32,
        src: vms::SocketSource,
        stop_rx: &watch::Receiver<bool>,
    ) {
        self.channel_tasks.push(tokio::spawn(channel::follow(
            slot,
            pid,
            src,
            self.known.clone(),
            self.correlator.clone(),
            stop_rx.clone(),
        )));
    }

    /// The ring buffer's reader: records to --events-out, the correlator
    /// and the tracer.
    pub(super) fn spawn_events(
        &mut self,
        opts: &RunOptions,
        stop: watch::Receiver<bool>,
        tracer: Option<Tracer>,
    ) -> Result<Option<JoinHandle<Result<Drained>>>> {
        if opts.events_out.is_none() && !opts.vms {
            return Ok(None);
        }
        let ring = self.probes.take_events()?;
        let out = match &opts.events_out {
            Some(path) => Some(std::io::BufWriter::new(
                std::fs::File::create(path)
                    .with_context(|| format!("creating --events-out {}", path.display()))?,
            )),
            None => None,
        };
        Ok(Some(tokio::spawn(drain_events(
            ring,
            out,
            self.known.clone(),
            self.correlator.clone(),
            stop,
            opts.slower_than.map_or(0, |d| d.as_nanos() as u64),
            tracer,
        ))))
    }

    /// The always-on tier's windows as the kernel has them now, into the
    /// correlator's view. A virtual disk is followed here where its
    /// windows can be split: a disk of a followed kind whose kicks this
    /// host sees in the tier (KVM's exits; a TCG guest's eventfd writes
    /// only through fentry or kprobes, or in the deep tier).
    pub(super) fn refresh_kernel(&self) {
        self.refresh_kernel_at(false)
    }

    /// The same; `end`: the run is over, so requests still waiting for an
    /// interrupt will get none in it (counted no_signal).
    fn refresh_kernel_at(&self, end: bool) {
        let mut ks = match self.probes.kernel_splits() {
            Ok(ks) => ks,
            Err(e) => {
                log::warn!("{}", crate::probes::error_chain(&e));
                return;
            }
        };
        if end {
            match self.probes.waiting_for_signals() {
                Ok(waiting) => {
                    for (k, n) in waiting {
                        ks.unsplit.entry(k).or_default().no_signal += n;
                    }
                }
                Err(e) => log::warn!("{}", crate::probes::error_chain(&e)),
            }
        }
        let sees_writes = self.probes.tier.sees_eventfd_writes() || self.probes.tier.tier.is_deep();
        // The registry is let go before the correlator is taken: the
        // event drain takes them the other way round.
        let followed: BTreeSet<u32> = {
            let known = self.known();
            known
                .split
                .iter()
                .copied()
                .filter(|vdisk| {
                    known
                        .vdisks
                        .get(vdisk)
                        .and_then(|(slot, _)| known.vms.get(slot))
                        .is_some_and(|vm| vm.kvm || sees_writes)
                })
                .collect()
        };
        self.corr()
            .set_kernel(&ks.splits, &ks.unsplit, |v| followed.contains(&v));
    }

    /// Each virtual disk's streaming threshold for the second to come: its
    /// `--trace-slower-than`, or where traces export the slowest K a
    /// second, the latency above which 2K of the last second's requests
    /// fell (the exporter picks its K among them).
    pub(super) fn update_trace_thresholds(&mut self) {
        if self.streams.slowest == 0 && self.streams.per_disk.is_empty() {
            return;
        }
        self.refresh_kernel();
        let windows = self.corr().vdisk_windows();
        let known = self.known.clone();
        let known = known.lock().unwrap_or_else(|p| p.into_inner());
        for (vdisk, now) in windows {
            let fixed = self.fixed_threshold(&known, vdisk);
            let adaptive = match self.thresholds.last.get(&vdisk) {
                Some(before) if self.streams.slowest > 0 => {
                    adaptive_threshold(&now.since(before), 2 * self.streams.slowest)
                }
                _ => 0,
            };
            self.thresholds.last.insert(vdisk, now);
            let ns = match (fixed, adaptive) {
                (0, a) => a,
                (f, 0) => f,
                (f, a) => f.min(a),
            };
            if let Err(e) = self.probes.set_vdisk_slow_ns(vdisk, ns) {
                log::warn!("{}", crate::probes::error_chain(&e));
            }
        }
    }

    fn fixed_threshold(&self, known: &Registry, vdisk: u32) -> u64 {
        let Some((slot, id)) = known.vdisks.get(&vdisk) else {
            return 0;
        };
        let vm = known.name(*slot);
        self.streams
            .per_disk
            .iter()
            .filter(|t| t.vdisk == *id && t.vm.as_deref().is_none_or(|v| v == vm))
            .map(|t| t.ns)
            .min()
            .unwrap_or(0)
    }

    /// The tier an API run asks for, applied: the deep tier's probes
    /// attached (and each VM's pushes seen from now), or detached again.
    pub(super) fn apply_wanted_tier(&mut self) {
        let Some(m) = self.metrics.clone() else {
            return;
        };
        self.switch_to(m.wanted_tier());
        m.tier_looks.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn switch_to(&mut self, want: crate::model::Tier) {
        if want == self.probes.tier.tier || !self.probes.vm_segments_on() {
            return;
        }
        if let Err(e) = self.probes.set_tier(want) {
            log::warn!(
                "switching to the {want} tier: {}",
                crate::probes::error_chain(&e)
            );
            return;
        }
        log::info!("the {want} tier runs");
        let known = self.known.clone();
        let known = known.lock().unwrap_or_else(|p| p.into_inner());
        let mut slots = Vec::new();
        for (slot, vm) in known.vms.iter().filter(|(s, _)| !known.exited.contains(s)) {
            if let Err(e) = self.probes.attach_vm_uprobes(vm) {
                log::warn!("VM {}: {}", vm.name, crate::probes::error_chain(&e));
            }
            for e in vm.engines() {
                if let Err(err) = self.probes.sync_engine_uprobes(e) {
                    log::warn!("VM {}: {}", vm.name, crate::probes::error_chain(&err));
                }
            }
            slots.push(*slot);
        }
        // Never the correlator under the registry: the event drain takes
        // them the other way round.
        drop(known);
        self.pushes_live_from(&slots);
    }

    fn pushes_live_from(&self, slots: &[u32]) {
        let now = monotonic_ns();
        let mut corr = self.corr();
        for slot in slots {
            corr.pushes_live_from(*slot, now);
        }
    }

    /// The figures so far, to a live view.
    pub(super) fn send_frame(&self, feed: &LiveFeed, at_s: f64, qemu: Option<EdgeCounts>) {
        self.refresh_kernel();
        send_frame(
            feed,
            at_s,
            &self.probes,
            (&self.correlator, &self.known),
            qemu,
            (&self.diagnoses, &self.monitors),
        );
    }

    /// Where an API run's start or stop asked for QEMU's counters: their
    /// read, off the loop (the frame follows when it is done, `EDGE_WAIT`
    /// at most).
    pub(super) fn edge_read(&self) -> Option<JoinHandle<EdgeCounts>> {
        let m = self.metrics.as_ref()?;
        if !m
            .qemu_wanted
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            return None;
        }
        let ours = self
            .probes
            .vm_counts_reader()
            .map_err(|e| log::warn!("{}", crate::probes::error_chain(&e)))
            .ok();
        let vms = super::qemu::edge_vms(&self.known, ours.as_ref());
        let monitors = self.monitors.clone();
        Some(tokio::task::spawn_blocking(move || {
            super::qemu::read_all(vms, &monitors)
        }))
    }

    pub(super) fn refresh_metrics(&self, m: &crate::api::Shared) {
        self.refresh_kernel();
        refresh_metrics(
            m,
            &self.probes,
            (&self.correlator, &self.known),
            self.export_shared.as_ref(),
            &self.monitors,
        );
    }

    /// The kernel's figures at the end: its own counters first, then ours
    /// (a request the kernel has counted has already been through our
    /// tracepoint, so a shortfall is real, never a race of the two reads).
    pub(super) fn end(&mut self, start: &Start) -> Result<Ended> {
        let elapsed = start.at.elapsed().as_secs_f64();
        let kernel = diskstats::delta(&start.kernel, &diskstats::read_all());
        let mut snap = self
            .probes
            .snapshot()
            .context("reading the block-layer statistics")?;
        // A VM named this late has finished: nothing left to read on its channel.
        let _ = name_new_vms(&mut self.probes, &self.known);
        // Completions never handed to us are found when their tag is used
        // again; the rest are still open in the table, and those of VMs
        // that have exited are finished.
        let open = {
            let k = self.known();
            self.probes
                .open_requests_of_exited(|slot| k.vms.get(&slot).is_some_and(|vm| !vms::alive(vm)))
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
        snap.counters.unseen = crate::output::report::unseen(&snap.stats, &kernel, &self.only);
        self.refresh_kernel_at(true);
        Ok(Ended {
            snap,
            kernel,
            elapsed,
            events_written: 0,
            export: None,
        })
    }
}

/// The latency above which about `n` of the values in `h` lie (1 ns, all
/// of them, when it holds no more than `n`).
pub(super) fn adaptive_threshold(h: &Hist, n: usize) -> u64 {
    if h.count <= n as u64 {
        return 1;
    }
    let q = 1.0 - n as f64 / h.count as f64;
    h.quantile_ns(q).max(1.0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threshold_keeps_about_the_slowest_n() {
        let mut h = Hist::default();
        for v in 1..=10_000u64 {
            h.record(v * 1_000);
        }
        let t = adaptive_threshold(&h, 10);
        let above = (1..=10_000u64).filter(|v| v * 1_000 >= t).count();
        assert!((8..=13).contains(&above), "{above} above {t}");
        let mut few = Hist::default();
        few.record(5_000);
        assert_eq!(adaptive_threshold(&few, 10), 1);
    }
}
