//! Per-I/O traces: which I/Os are exported (a tail sampler) and what became
//! of them; `otlp` sends them.
//!
//! The agent knows each I/O's latency before it decides. How one becomes a trace and goes out over OTLP is `otlp`; the span model is
//! docs/spans.md.

use std::{
    cmp::Reverse,
    collections::{BTreeMap, BinaryHeap, HashMap},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use serde::{Deserialize, Serialize};

use crate::model::IoSpan;

#[cfg(feature = "otlp")]
pub mod otlp;
#[cfg(feature = "otlp")]
pub mod otlp_metrics;
#[cfg(feature = "otlp")]
pub mod tls;

/// Where and how traces go (flags first, then the OTel environment).
#[derive(Clone, Debug, Default)]
pub struct TraceOpts {
    /// OTLP endpoint; `None`: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT.
    pub endpoint: Option<String>,
    /// "grpc" or "http/protobuf"; `None`: OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL.
    pub protocol: Option<String>,
    /// PEM CA to trust for an https:// collector; `None`:
    /// OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE, else the system's roots.
    pub ca_cert: Option<std::path::PathBuf>,
    pub policy: Policy,
    /// A label for the run (e.g. the benchmark's name), on every span.
    pub run_label: Option<String>,
}

impl TraceOpts {
    /// Whether anything goes out over OTLP: traces or metrics.
    pub fn any_enabled(&self) -> bool {
        self.enabled() || self.metrics_enabled()
    }

    /// Whether metrics go out over OTLP: an endpoint given here or in the
    /// environment (OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT), and
    /// OTEL_METRICS_EXPORTER not "none".
    pub fn metrics_enabled(&self) -> bool {
        if std::env::var("OTEL_METRICS_EXPORTER").is_ok_and(|v| v.trim() == "none") {
            return false;
        }
        self.endpoint.is_some()
            || [
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
            ]
            .iter()
            .any(|k| std::env::var(k).is_ok_and(|v| !v.is_empty()))
    }

    /// Whether traces are wanted at all: an endpoint given here or in the
    /// environment, and OTEL_TRACES_EXPORTER not "none".
    pub fn enabled(&self) -> bool {
        if std::env::var("OTEL_TRACES_EXPORTER").is_ok_and(|v| v.trim() == "none") {
            return false;
        }
        self.endpoint.is_some()
            || [
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            ]
            .iter()
            .any(|k| std::env::var(k).is_ok_and(|v| !v.is_empty()))
    }
}

/// A latency threshold for one virtual disk (of one VM, or of any VM
/// with a disk of that id).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskThreshold {
    pub vm: Option<String>,
    pub vdisk: String,
    pub ns: u64,
}

impl std::str::FromStr for DiskThreshold {
    type Err = String;

    /// `[VM/]VDISK=DURATION`, e.g. `vd0=2ms` or `db1/vd0=500us`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (target, d) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?}: expected [VM/]VDISK=DURATION, e.g. vd0=2ms"))?;
        let ns = humantime::parse_duration(d)
            .map_err(|e| format!("{s:?}: duration {d:?}: {e} (e.g. 2ms, 500us)"))?
            .as_nanos() as u64;
        let (vm, vdisk) = match target.split_once('/') {
            Some((vm, vdisk)) => (Some(vm.to_string()), vdisk.to_string()),
            None => (None, target.to_string()),
        };
        if vdisk.is_empty() || vm.as_deref() == Some("") {
            return Err(format!(
                "{s:?}: name the virtual disk (its QEMU drive id), e.g. vd0=2ms or myvm/vd0=2ms"
            ));
        }
        Ok(Self { vm, vdisk, ns })
    }
}

/// Which I/Os become traces. Histograms count every I/O whatever this says.
#[derive(Clone, Debug)]
pub struct Policy {
    /// The slowest this many per virtual disk and interval.
    pub slowest: usize,
    /// Every I/O at least this long (0: none by this rule) ...
    pub slower_than_ns: u64,
    /// ... or at least its disk's own threshold, where one is set (the
    /// VM's own first, then any VM's disk of that id).
    pub per_disk: Vec<DiskThreshold>,
    /// One I/O in this many, whatever its latency (0: none by this rule).
    pub one_in: u64,
    pub interval: Duration,
    /// Traces waiting for the exporter; beyond it they are dropped, counted.
    pub queue: usize,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            slowest: 5,
            slower_than_ns: 0,
            per_disk: Vec::new(),
            one_in: 0,
            interval: Duration::from_secs(1),
            queue: 4096,
        }
    }
}

/// Why an I/O was exported (the span attribute `iospan.sampled_by`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    Slowest,
    SlowerThan,
    Uniform,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Slowest => "slowest",
            Self::SlowerThan => "slower_than",
            Self::Uniform => "uniform",
        }
    }
}

/// The tail sampler. Offered every finished I/O; at each interval's end
/// hands over the chosen ones.
#[derive(Debug, Default)]
pub struct Sampler {
    policy: Policy,
    offered: u64,
    chosen: Vec<(IoSpan, Reason)>,
    /// Per (VM, virtual disk): the slowest so far this interval, a min-heap
    /// by total (ties by arrival) of at most `policy.slowest`.
    slowest: HashMap<(u32, u32), SlowestHeap>,
    /// Per (VM, virtual disk): its threshold (0: none), resolved by name
    /// once.
    thresholds: HashMap<(u32, u32), u64>,
}

/// The slowest so far, smallest total on top.
type SlowestHeap = BinaryHeap<Reverse<Slow>>;

/// An I/O in a slowest-K heap, ordered by total, then arrival.
#[derive(Debug)]
struct Slow {
    seq: u64,
    span: IoSpan,
}

impl Slow {
    fn key(&self) -> (u64, u64) {
        (self.span.total_ns, self.seq)
    }
}
impl PartialEq for Slow {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}
impl Eq for Slow {}
impl PartialOrd for Slow {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Slow {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.key().cmp(&other.key())
    }
}

impl Sampler {
    pub fn new(policy: Policy) -> Self {
        Self {
            policy,
            ..Default::default()
        }
    }

    /// `names` is asked the first time an I/O's disk is seen.
    pub fn offer(&mut self, span: IoSpan, names: impl FnOnce(&IoSpan) -> Names) {
        self.offered += 1;
        let p = &self.policy;
        let threshold = *self
            .thresholds
            .entry((span.vm, span.vdisk))
            .or_insert_with(|| {
                let n = names(&span);
                let of = |vm: bool| {
                    p.per_disk.iter().find(|t| {
                        t.vdisk == n.vdisk
                            && (t.vm.as_deref() == Some(n.vm.as_str())) == vm
                            && (vm || t.vm.is_none())
                    })
                };
                of(true)
                    .or_else(|| of(false))
                    .map_or(p.slower_than_ns, |t| t.ns)
            });
        if threshold > 0 && span.total_ns >= threshold {
            self.chosen.push((span, Reason::SlowerThan));
        } else if p.one_in > 0 && self.offered.is_multiple_of(p.one_in) {
            self.chosen.push((span, Reason::Uniform));
        } else if p.slowest > 0 {
            let heap = self.slowest.entry((span.vm, span.vdisk)).or_default();
            // Most I/Os are not among the slowest: compared, never moved.
            let full = heap.len() >= p.slowest;
            if full
                && heap
                    .peek()
                    .is_some_and(|min| span.total_ns <= min.0.span.total_ns)
            {
                return;
            }
            if full {
                heap.pop();
            }
            heap.push(Reverse(Slow {
                seq: self.offered,
                span,
            }));
        }
    }

    /// The interval's chosen I/Os; starts the next interval.
    pub fn take(&mut self) -> Vec<(IoSpan, Reason)> {
        let mut out = std::mem::take(&mut self.chosen);
        for (_, heap) in self.slowest.drain() {
            out.extend(
                heap.into_iter()
                    .map(|Reverse(slow)| (slow.span, Reason::Slowest)),
            );
        }
        out
    }

    pub fn offered(&self) -> u64 {
        self.offered
    }
}

/// What the exporter did, for the report and the metrics.
#[derive(Debug, Default)]
pub struct ExportStats {
    /// Updated once per interval (the sampler's own count is the truth).
    pub offered: AtomicU64,
    pub chosen: AtomicU64,
    pub dropped_queue_full: AtomicU64,
    pub exported_traces: AtomicU64,
    pub exported_spans: AtomicU64,
    pub failed_traces: AtomicU64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportCounters {
    /// I/Os the sampler saw (joined guest I/Os and VM host windows).
    pub offered: u64,
    /// Chosen by the policy.
    pub chosen: u64,
    /// Chosen, but the queue to the exporter was full: not exported.
    pub dropped_queue_full: u64,
    /// Traces (and their spans) the backend accepted.
    pub exported_traces: u64,
    pub exported_spans: u64,
    /// Traces in batches the backend refused or never answered.
    pub failed_traces: u64,
}

impl ExportStats {
    pub fn snapshot(&self) -> ExportCounters {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ExportCounters {
            offered: g(&self.offered),
            chosen: g(&self.chosen),
            dropped_queue_full: g(&self.dropped_queue_full),
            exported_traces: g(&self.exported_traces),
            exported_spans: g(&self.exported_spans),
            failed_traces: g(&self.failed_traces),
        }
    }
}

/// A latency series of /metrics that exported traces are exemplars of:
/// the guest-observed total where the guest agent joined the I/O, else
/// the host window (what a trace's root spans).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeriesKey {
    pub vm: String,
    pub vdisk: String,
    pub op: &'static str,
    pub segment: &'static str,
}

impl SeriesKey {
    pub fn of(span: &IoSpan, names: &Names) -> Self {
        Self {
            vm: names.vm.clone(),
            vdisk: names.vdisk.clone(),
            op: span.op.as_str(),
            segment: if span.has_guest {
                "g_total"
            } else {
                "host_window"
            },
        }
    }
}

/// An exported trace as an exemplar of a latency bucket.
#[derive(Clone, Debug, PartialEq)]
pub struct Exemplar {
    /// 32 hex digits, as the trace backends show it.
    pub trace_id: String,
    pub value_ns: u64,
    /// When the I/O ended, seconds since the epoch.
    pub unix_s: f64,
}

/// The latest exported trace per bucket of each series: a bucket's count
/// leads to a trace the backend has.
#[derive(Debug, Default)]
pub struct Exemplars {
    /// Series -> bucket upper bound (ns, `u64::MAX` for +Inf) -> exemplar.
    by_series: HashMap<SeriesKey, BTreeMap<u64, Exemplar>>,
}

impl Exemplars {
    pub fn record(&mut self, key: SeriesKey, ex: Exemplar) {
        let le = crate::model::hist::bounds_ns()
            .into_iter()
            .find(|&b| ex.value_ns <= b)
            .unwrap_or(u64::MAX);
        self.by_series.entry(key).or_default().insert(le, ex);
    }

    /// The exemplar of the bucket with upper bound `le_ns`, if any.
    pub fn get(&self, key: &SeriesKey, le_ns: u64) -> Option<&Exemplar> {
        self.by_series.get(key)?.get(&le_ns)
    }
}

/// What the exporter shares while it runs: its counters, and exemplars.
#[derive(Clone, Debug, Default)]
pub struct ExportShared {
    pub stats: Arc<ExportStats>,
    pub exemplars: Arc<Mutex<Exemplars>>,
}

/// Names of what an I/O's numbers refer to, resolved when it is chosen.
#[derive(Clone, Debug, Default)]
pub struct Names {
    pub vm: String,
    /// The VM's UUID, where it has one (`virt.vm.uuid`).
    pub vm_uuid: Option<String>,
    pub vdisk: String,
    pub host_disk: String,
    /// The virtual disk is an NVMe controller's namespace.
    pub nvme: bool,
}

/// What goes out over OTLP: traces (the sampler and the exporter behind
/// it) and segment metrics, each where enabled.
pub struct Tracer {
    sampler: Sampler,
    interval: Duration,
    last: std::time::Instant,
    #[cfg(feature = "otlp")]
    exporter: Option<otlp::Exporter>,
    #[cfg(feature = "otlp")]
    meters: Option<otlp_metrics::Meters>,
}

impl Tracer {
    pub fn start(opts: &TraceOpts) -> anyhow::Result<Self> {
        #[cfg(not(feature = "otlp"))]
        {
            let _ = opts;
            anyhow::bail!("this iospan was built without OTLP export (the `otlp` feature)");
        }
        #[allow(unreachable_code)]
        Ok(Self {
            sampler: Sampler::new(opts.policy.clone()),
            interval: opts.policy.interval,
            last: std::time::Instant::now(),
            #[cfg(feature = "otlp")]
            exporter: opts
                .enabled()
                .then(|| otlp::Exporter::start(opts))
                .transpose()?,
            #[cfg(feature = "otlp")]
            meters: opts
                .metrics_enabled()
                .then(|| otlp_metrics::Meters::start(opts))
                .transpose()?,
        })
    }

    pub fn offer(&mut self, span: IoSpan, names: impl Fn(&IoSpan) -> Names) {
        #[cfg(feature = "otlp")]
        {
            if let Some(m) = self.meters.as_mut() {
                m.record(&span, &names);
            }
            if self.exporter.is_none() {
                return;
            }
        }
        self.sampler.offer(span, names);
    }

    /// Counters and exemplars, live, for /metrics.
    pub fn shared(&self) -> ExportShared {
        #[cfg(feature = "otlp")]
        return self
            .exporter
            .as_ref()
            .map(|e| e.shared.clone())
            .unwrap_or_default();
        #[cfg(not(feature = "otlp"))]
        ExportShared::default()
    }

    /// At each interval's end, hands the chosen I/Os to the exporter.
    pub fn tick(&mut self, names: impl Fn(&IoSpan) -> Names) {
        if self.last.elapsed() >= self.interval {
            self.last = std::time::Instant::now();
            self.flush(names);
        }
    }

    fn flush(&mut self, names: impl Fn(&IoSpan) -> Names) {
        let chosen = self.sampler.take();
        #[cfg(feature = "otlp")]
        if let Some(exporter) = self.exporter.as_ref() {
            exporter
                .shared
                .stats
                .offered
                .store(self.sampler.offered(), Ordering::Relaxed);
            // I/Os one engine signal completed link to one another.
            let roots: Vec<_> = chosen.iter().map(|_| exporter.new_root()).collect();
            let mut by_signal: HashMap<(u32, u64), Vec<usize>> = HashMap::new();
            for (i, (span, _)) in chosen.iter().enumerate() {
                if span.signal_ns != 0 {
                    by_signal
                        .entry((span.vm, span.signal_ns))
                        .or_default()
                        .push(i);
                }
            }
            for (i, (span, reason)) in chosen.iter().enumerate() {
                let linked: Vec<_> = by_signal
                    .get(&(span.vm, span.signal_ns))
                    .into_iter()
                    .flatten()
                    .filter(|&&j| j != i)
                    .map(|&j| roots[j].clone())
                    .collect();
                exporter.send(span, &names(span), *reason, &roots[i], &linked);
            }
        }
        #[cfg(not(feature = "otlp"))]
        let _ = (chosen, names);
    }

    /// The last interval's I/Os, then what is queued, within `grace`.
    pub async fn finish(
        mut self,
        names: impl Fn(&IoSpan) -> Names,
        grace: Duration,
    ) -> ExportCounters {
        self.flush(names);
        let offered = self.sampler.offered();
        #[cfg(feature = "otlp")]
        if let Some(m) = self.meters.take() {
            if let Err(e) = m.finish(grace).await {
                log::warn!("{e:#}");
            }
        }
        #[cfg(feature = "otlp")]
        let done = match self.exporter.take() {
            Some(e) => e.finish(grace).await,
            None => ExportCounters::default(),
        };
        #[cfg(not(feature = "otlp"))]
        let done = {
            let _ = grace;
            ExportCounters::default()
        };
        ExportCounters { offered, ..done }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Op;

    fn io(vdisk: u32, total_ns: u64) -> IoSpan {
        IoSpan {
            vm: 1,
            vdisk,
            dev: 0,
            op: Op::Read,
            pos: total_ns,
            bytes: 4096,
            begin_ns: 0,
            guest_kick_ns: 0,
            guest_irq_ns: 0,
            end_ns: 0,
            kick_ns: 100,
            pick_ns: 110,
            start_ns: 120,
            issue_ns: 130,
            done_ns: 140,
            signal_ns: 100 + total_ns,
            clock_offset_ns: None,
            guest_ns: 0,
            hypervisor_ns: 10,
            engine_ns: total_ns.saturating_sub(30),
            device_ns: 20,
            total_ns,
            app_ends_from_block_layer: false,
            has_guest: false,
            queue: None,
            cpu_wait: Default::default(),
        }
    }

    fn unnamed(_: &IoSpan) -> Names {
        Names::default()
    }

    #[test]
    fn a_disk_threshold_applies_to_its_disk_the_vms_own_first() {
        let p = Policy {
            slowest: 0,
            slower_than_ns: 1000,
            per_disk: ["vd1=100ns", "b/vd1=300ns", "vd2=5us"]
                .iter()
                .map(|t| t.parse().unwrap())
                .collect(),
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        let names = |sp: &IoSpan| Names {
            vm: if sp.vm == 1 { "a" } else { "b" }.into(),
            vdisk: format!("vd{}", sp.vdisk),
            host_disk: "sda".into(),
            nvme: false,
            ..Default::default()
        };
        for (vm, vdisk, t) in [
            (1, 1, 150),  // a/vd1: vd1's 100 ns -> chosen
            (2, 1, 150),  // b/vd1: b's own 300 ns -> not
            (2, 1, 350),  // -> chosen
            (1, 2, 2000), // vd2: 5 µs -> not, though above the global 1 µs
            (1, 3, 2000), // vd3: the global 1 µs -> chosen
        ] {
            let mut sp = io(vdisk, t);
            sp.vm = vm;
            s.offer(sp, names);
        }
        let mut got: Vec<(u32, u32, u64)> = s
            .take()
            .iter()
            .map(|(x, r)| {
                assert_eq!(*r, Reason::SlowerThan);
                (x.vm, x.vdisk, x.total_ns)
            })
            .collect();
        got.sort_unstable();
        assert_eq!(got, [(1, 1, 150), (1, 3, 2000), (2, 1, 350)]);
    }

    #[test]
    fn a_disk_threshold_that_cannot_be_read_says_how_to_write_it() {
        for bad in ["vd0", "vd0=fast", "=2ms", "/vd0=2ms"] {
            let e = bad.parse::<DiskThreshold>().unwrap_err();
            assert!(e.contains(bad) && e.contains("e.g."), "{bad}: {e}");
        }
        assert_eq!(
            "db/vd0=2ms".parse::<DiskThreshold>(),
            Ok(DiskThreshold {
                vm: Some("db".into()),
                vdisk: "vd0".into(),
                ns: 2_000_000
            })
        );
    }

    fn policy(slowest: usize, slower_than_ns: u64, one_in: u64) -> Policy {
        Policy {
            slowest,
            slower_than_ns,
            one_in,
            ..Default::default()
        }
    }

    #[test]
    fn the_slowest_k_of_each_disk_per_interval() {
        let mut s = Sampler::new(policy(2, 0, 0));
        for (d, t) in [
            (1, 50),
            (1, 90),
            (2, 40),
            (1, 70),
            (1, 60),
            (2, 30),
            (2, 80),
        ] {
            s.offer(io(d, t), unnamed);
        }
        let mut got: Vec<(u32, u64)> = s
            .take()
            .iter()
            .map(|(x, _)| (x.vdisk, x.total_ns))
            .collect();
        got.sort_unstable();
        assert_eq!(got, [(1, 70), (1, 90), (2, 40), (2, 80)]);
        assert!(s.take().is_empty(), "the next interval starts empty");
        assert_eq!(s.offered(), 7);
    }

    #[test]
    fn threshold_and_uniform_come_on_top_and_say_why() {
        let mut s = Sampler::new(policy(1, 100, 3));
        for t in [10, 200, 20, 30, 150, 40, 50] {
            s.offer(io(1, t), unnamed);
        }
        let mut got: Vec<(u64, Reason)> = s.take().iter().map(|(x, r)| (x.total_ns, *r)).collect();
        got.sort_unstable_by_key(|g| g.0);
        // 200 and 150 by threshold; the 3rd and 6th offered (20, 40) by
        // uniform; of the rest (10, 30, 50) the slowest.
        assert_eq!(
            got,
            [
                (20, Reason::Uniform),
                (40, Reason::Uniform),
                (50, Reason::Slowest),
                (150, Reason::SlowerThan),
                (200, Reason::SlowerThan)
            ]
        );
    }
}
