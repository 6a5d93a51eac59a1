//! Per-I/O traces: which I/Os are exported (a tail sampler: the agent knows
//! each I/O's latency before it decides) and what was done with them. How
//! one becomes a trace and goes out over OTLP is `otlp`; the span model is
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

use crate::stitch::IoSpan;

#[cfg(feature = "otlp")]
pub mod otlp;

/// Where and how traces go (flags first, then the OTel environment).
#[derive(Clone, Debug, Default)]
pub struct TraceOpts {
    /// OTLP endpoint; `None`: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT.
    pub endpoint: Option<String>,
    /// "grpc" or "http/protobuf"; `None`: OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL.
    pub protocol: Option<String>,
    pub policy: Policy,
    /// A label for the run (e.g. the benchmark's name), on every span.
    pub run_label: Option<String>,
}

impl TraceOpts {
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

/// Which I/Os become traces. Histograms count every I/O whatever this says.
#[derive(Clone, Debug)]
pub struct Policy {
    /// The slowest this many per virtual disk and interval.
    pub slowest: usize,
    /// Every I/O at least this long (0: none by this rule).
    pub slower_than_ns: u64,
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

    pub fn offer(&mut self, span: IoSpan) {
        self.offered += 1;
        let p = &self.policy;
        if p.slower_than_ns > 0 && span.total_ns >= p.slower_than_ns {
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
        let le = crate::metrics::bounds_ns()
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
    pub vdisk: String,
    pub host_disk: String,
}

/// The sampler and, where built in, the OTLP exporter behind it.
pub struct Tracer {
    sampler: Sampler,
    interval: Duration,
    last: std::time::Instant,
    #[cfg(feature = "otlp")]
    exporter: otlp::Exporter,
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
            exporter: otlp::Exporter::start(opts)?,
        })
    }

    pub fn offer(&mut self, span: IoSpan) {
        self.sampler.offer(span);
    }

    /// Counters and exemplars, live, for /metrics.
    pub fn shared(&self) -> ExportShared {
        #[cfg(feature = "otlp")]
        return self.exporter.shared.clone();
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
        {
            self.exporter
                .shared
                .stats
                .offered
                .store(self.sampler.offered(), Ordering::Relaxed);
            for (span, reason) in &chosen {
                self.exporter.send(span, &names(span), *reason);
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
        let done = self.exporter.finish(grace).await;
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
            engine_ns: total_ns - 30,
            device_ns: 20,
            total_ns,
            app_ends_from_block_layer: false,
            has_guest: false,
        }
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
            s.offer(io(d, t));
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
            s.offer(io(1, t));
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
