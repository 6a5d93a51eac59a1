//! One chosen I/O as an OTLP trace, and the exporter task behind a bounded
//! queue.

use std::{
    borrow::Cow,
    sync::atomic::Ordering,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{bail, Context, Result};
use opentelemetry::{
    trace::{Event, Link, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceState},
    InstrumentationScope, KeyValue,
};
use opentelemetry_sdk::{
    trace::{IdGenerator, RandomIdGenerator, SpanData, SpanEvents, SpanExporter as _, SpanLinks},
    Resource,
};
use rustix::time::ClockId;
use tokio::sync::mpsc;

use super::{Exemplar, ExportCounters, ExportShared, Names, Reason, SeriesKey, TraceOpts};
use crate::{model::IoSpan, model::Op};

/// The monotonic clock the kernel stamps with, mapped to wall time.
#[derive(Clone, Copy, Debug)]
pub struct WallClock {
    /// Wall time minus monotonic time, ns.
    offset_ns: i128,
}

impl WallClock {
    pub fn now() -> Self {
        let mono = clock_ns(ClockId::Monotonic);
        let wall = clock_ns(ClockId::Realtime);
        Self {
            offset_ns: i128::from(wall) - i128::from(mono),
        }
    }

    pub fn at(&self, mono_ns: u64) -> SystemTime {
        let wall = (i128::from(mono_ns) + self.offset_ns).max(0);
        UNIX_EPOCH + Duration::from_nanos(u64::try_from(wall).unwrap_or(u64::MAX))
    }
}

fn clock_ns(clock: ClockId) -> u64 {
    let ts = rustix::time::clock_gettime(clock);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The root span's name for an operation.
pub fn root_name(op: Op) -> &'static str {
    match op {
        Op::Read => "vdisk.read",
        Op::Write => "vdisk.write",
        Op::Flush => "vdisk.flush",
        Op::Discard => "vdisk.discard",
        Op::Other => "vdisk.other",
    }
}

/// One segment child: name, the four-segment class it belongs to, length.
struct Piece {
    name: &'static str,
    segment: &'static str,
    ns: u64,
}

/// The children of an I/O, in time order; their lengths add up to the
/// root's exactly. With a guest side the hypervisor's time is the rest of
/// the guest-observed total (the clocks' offset is an estimate); the part
/// before the pickup is the host-measured kick-to-pickup plus the
/// guest-kick-to-host-kick gap where the offset puts it in range.
fn pieces(s: &IoSpan) -> Vec<Piece> {
    let p = |name, segment, ns| Piece { name, segment, ns };
    // Saturating: the pipeline's I/Os have their stamps in order, a
    // replayed file's need not; an out-of-order one is a short segment.
    let queue = s.issue_ns.saturating_sub(s.start_ns);
    let service = s.done_ns.saturating_sub(s.issue_ns);
    let submit = s.start_ns.saturating_sub(s.pick_ns);
    let complete = s.signal_ns.saturating_sub(s.done_ns);
    if !s.has_guest {
        return vec![
            p(
                "hypervisor.notify",
                "hypervisor",
                s.pick_ns.saturating_sub(s.kick_ns),
            ),
            p("engine.submit", "engine", submit),
            p("host.queue", "device", queue),
            p("device", "device", service),
            p("engine.complete", "engine", complete),
        ];
    }
    let guest_submit = s.guest_kick_ns.saturating_sub(s.begin_ns).min(s.guest_ns);
    let guest_complete = s.guest_ns - guest_submit;
    let notify = if s.clock_offset_ns.is_some() && s.guest_kick_ns <= s.pick_ns {
        s.pick_ns - s.guest_kick_ns
    } else {
        s.pick_ns.saturating_sub(s.kick_ns)
    }
    .min(s.hypervisor_ns);
    vec![
        p("guest.submit", "guest", guest_submit),
        p("hypervisor.notify", "hypervisor", notify),
        p("engine.submit", "engine", submit),
        p("host.queue", "device", queue),
        p("device", "device", service),
        p("engine.complete", "engine", complete),
        p(
            "hypervisor.interrupt",
            "hypervisor",
            s.hypervisor_ns - notify,
        ),
        p("guest.complete", "guest", guest_complete),
    ]
}

/// What every trace of a run shares: its clock, ids, scope and label.
pub struct Traces {
    clock: WallClock,
    ids: RandomIdGenerator,
    scope: InstrumentationScope,
    run_label: Option<String>,
}

impl Traces {
    pub fn new(clock: WallClock, run_label: Option<String>) -> Self {
        Self {
            clock,
            ids: RandomIdGenerator::default(),
            scope: InstrumentationScope::builder("iospan")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
            run_label,
        }
    }

    /// A new trace's root, drawn before the trace is built: I/Os exported
    /// together can link to one another.
    pub fn new_root(&self) -> SpanContext {
        SpanContext::new(
            self.ids.new_trace_id(),
            self.ids.new_span_id(),
            TraceFlags::SAMPLED,
            false,
            TraceState::NONE,
        )
    }

    /// One I/O as a trace under `root`: the root span first, then its
    /// children. `same_signal`: the roots of other exported I/Os the same
    /// engine signal completed (a batched completion, a coalesced
    /// interrupt), linked from this root.
    pub fn of(
        &self,
        s: &IoSpan,
        names: &Names,
        reason: Reason,
        root: &SpanContext,
        same_signal: &[SpanContext],
    ) -> Vec<SpanData> {
        let root_id = root.span_id();
        let start_ns = if s.has_guest {
            guest_at(s, s.begin_ns)
        } else {
            s.kick_ns
        };
        let mut out = vec![self.span(
            root,
            root_id,
            SpanId::INVALID,
            Cow::Borrowed(root_name(s.op)),
            (start_ns, start_ns.saturating_add(s.total_ns)),
            self.attributes(s, names, reason),
            self.events(s),
            same_signal
                .iter()
                .map(|c| {
                    Link::new(
                        c.clone(),
                        vec![KeyValue::new("iospan.link", "same_signal")],
                        0,
                    )
                })
                .collect(),
        )];
        let mut at = start_ns;
        for piece in pieces(s) {
            out.push(self.span(
                root,
                self.ids.new_span_id(),
                root_id,
                Cow::Borrowed(piece.name),
                (at, at.saturating_add(piece.ns)),
                vec![KeyValue::new("iospan.segment", piece.segment)],
                vec![],
                vec![],
            ));
            at = at.saturating_add(piece.ns);
        }
        out
    }

    /// The root span's attributes: the I/O, its names and its segments.
    fn attributes(&self, s: &IoSpan, names: &Names, reason: Reason) -> Vec<KeyValue> {
        let mut attrs = vec![
            KeyValue::new("virt.vm.name", names.vm.clone()),
            KeyValue::new("virt.vm.uuid", names.vm_uuid.clone().unwrap_or_default()),
            KeyValue::new("virt.disk.id", names.vdisk.clone()),
            KeyValue::new("system.device", names.host_disk.clone()),
            KeyValue::new("disk.io.direction", direction(s.op)),
            KeyValue::new("iospan.io.offset", s.pos as i64),
            KeyValue::new("iospan.io.bytes", i64::from(s.bytes)),
            KeyValue::new("iospan.has_guest", s.has_guest),
            KeyValue::new("iospan.sampled_by", reason.as_str()),
            KeyValue::new("iospan.guest_ns", s.guest_ns as i64),
            KeyValue::new("iospan.hypervisor_ns", s.hypervisor_ns as i64),
            KeyValue::new("iospan.engine_ns", s.engine_ns as i64),
            KeyValue::new("iospan.device_ns", s.device_ns as i64),
            // Of the hypervisor and engine time, the owning thread's wait
            // for a CPU.
            KeyValue::new(
                "iospan.hypervisor_cpu_wait_ns",
                s.cpu_wait.hypervisor_ns as i64,
            ),
            KeyValue::new("iospan.engine_cpu_wait_ns", s.cpu_wait.engine_ns as i64),
        ];
        if let Some(l) = self.run_label.as_deref() {
            attrs.push(KeyValue::new("iospan.run.label", l.to_string()));
        }
        // The guest's queue (its block layer's hardware context): the
        // virtqueue's index, or for NVMe the I/O queue's id (1-based).
        if let Some(q) = s.queue {
            attrs.push(KeyValue::new("virt.queue.index", i64::from(q)));
            if names.nvme {
                attrs.push(KeyValue::new("nvme.qid", i64::from(q) + 1));
            }
        }
        if let Some(o) = s.clock_offset_ns {
            attrs.push(KeyValue::new("iospan.clock_offset_ns", o));
        }
        attrs
    }

    fn events(&self, s: &IoSpan) -> Vec<Event> {
        let clock = &self.clock;
        // Instants on the host clock: the kick seen, the interrupt raised.
        let mut events = vec![
            Event::new("kick", clock.at(s.kick_ns), vec![], 0),
            Event::new("interrupt.raised", clock.at(s.signal_ns), vec![], 0),
        ];
        if s.has_guest {
            events.push(Event::new(
                "interrupt.received",
                clock.at(guest_at(s, s.guest_irq_ns)),
                vec![],
                0,
            ));
        }
        events
    }

    /// A span of the trace `root` heads, `from` and `to` on the host clock.
    #[allow(clippy::too_many_arguments)]
    fn span(
        &self,
        root: &SpanContext,
        id: SpanId,
        parent: SpanId,
        name: Cow<'static, str>,
        (from, to): (u64, u64),
        attributes: Vec<KeyValue>,
        events: Vec<Event>,
        links: Vec<Link>,
    ) -> SpanData {
        let clock = &self.clock;
        SpanData {
            span_context: SpanContext::new(
                root.trace_id(),
                id,
                TraceFlags::SAMPLED,
                false,
                TraceState::NONE,
            ),
            parent_span_id: parent,
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name,
            start_time: clock.at(from),
            end_time: clock.at(to),
            attributes,
            dropped_attributes_count: 0,
            events: {
                let mut e = SpanEvents::default();
                e.events = events;
                e
            },
            links: {
                let mut l = SpanLinks::default();
                l.links = links;
                l
            },
            status: Status::Unset,
            instrumentation_scope: self.scope.clone(),
        }
    }
}

/// Guest stamps are on the host clock once the VM's clock offset is
/// known; before that they are the guest's own, and this I/O's kick (seen
/// on both sides within the hypervisor's notification time) places them.
fn guest_at(s: &IoSpan, g: u64) -> u64 {
    match s.clock_offset_ns {
        Some(_) => g,
        None => g.saturating_add(s.kick_ns).saturating_sub(s.guest_kick_ns),
    }
}

fn direction(op: Op) -> &'static str {
    match op {
        Op::Read => "read",
        Op::Write => "write",
        _ => op.as_str(),
    }
}

/// The service's resource: `service.name` iospan, `host.name` the
/// kernel's hostname and the agent's version, under what the SDK's
/// detectors find: OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME name
/// them otherwise (a fleet may know its hosts by other names).
pub fn resource() -> Resource {
    use opentelemetry_sdk::resource::{
        EnvResourceDetector, ResourceDetector, SdkProvidedResourceDetector,
        TelemetryResourceDetector,
    };
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    let mut detectors: Vec<Box<dyn ResourceDetector>> = vec![
        Box::new(TelemetryResourceDetector),
        Box::new(EnvResourceDetector::new()),
    ];
    // The SDK's own service detector says "unknown_service" when no
    // variable names one: ours stands then.
    if std::env::var("OTEL_SERVICE_NAME").is_ok_and(|v| !v.trim().is_empty()) {
        detectors.push(Box::new(SdkProvidedResourceDetector));
    }
    Resource::builder_empty()
        .with_service_name("iospan")
        .with_attribute(KeyValue::new("host.name", host))
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .with_detectors(&detectors)
        .build()
}

/// A trace on its way, with what makes it an exemplar once exported.
type Queued = (Vec<SpanData>, (SeriesKey, Exemplar));

/// The exporter's side of the queue: a task that batches traces and sends
/// them, counting what the backend took and what it did not.
pub struct Exporter {
    tx: Option<mpsc::Sender<Queued>>,
    task: tokio::task::JoinHandle<()>,
    pub shared: ExportShared,
    traces: Traces,
}

impl Exporter {
    pub fn start(opts: &TraceOpts) -> Result<Self> {
        let mut exporter = build_exporter(opts)?;
        exporter.set_resource(&resource());
        let (tx, mut rx) = mpsc::channel(opts.policy.queue.max(1));
        let shared = ExportShared::default();
        let (st, exemplars) = (shared.stats.clone(), shared.exemplars.clone());
        let task = tokio::spawn(async move {
            const BATCH_SPANS: usize = 512;
            while let Some((first, seed)) = rx.recv().await {
                let mut traces = 1u64;
                let mut batch: Vec<SpanData> = first;
                let mut seeds = vec![seed];
                while batch.len() < BATCH_SPANS {
                    match rx.try_recv() {
                        Ok((more, seed)) => {
                            batch.extend(more);
                            seeds.push(seed);
                            traces += 1;
                        }
                        Err(_) => break,
                    }
                }
                let spans = batch.len() as u64;
                match exporter.export(batch).await {
                    Ok(()) => {
                        st.exported_traces.fetch_add(traces, Ordering::Relaxed);
                        st.exported_spans.fetch_add(spans, Ordering::Relaxed);
                        // Only traces the backend took become exemplars.
                        let mut ex = exemplars.lock().unwrap_or_else(|p| p.into_inner());
                        for (key, e) in seeds {
                            ex.record(key, e);
                        }
                    }
                    Err(e) => {
                        log::debug!("OTLP export of {traces} traces failed: {e}");
                        st.failed_traces.fetch_add(traces, Ordering::Relaxed);
                    }
                }
            }
            let _ = exporter.shutdown();
        });
        Ok(Self {
            tx: Some(tx),
            task,
            shared,
            traces: Traces::new(WallClock::now(), opts.run_label.clone()),
        })
    }

    /// A new trace's root (see `Traces::new_root`).
    pub fn new_root(&self) -> SpanContext {
        self.traces.new_root()
    }

    /// Queues one chosen I/O; a full queue drops it, counted.
    pub fn send(
        &self,
        s: &IoSpan,
        names: &Names,
        reason: Reason,
        root: &SpanContext,
        same_signal: &[SpanContext],
    ) {
        let Some((tx, queued)) = self.queued(s, names, reason, root, same_signal) else {
            return;
        };
        if tx.try_send(queued).is_err() {
            self.shared
                .stats
                .dropped_queue_full
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// One chosen I/O as a trace with its exemplar, counted as chosen.
    fn queued(
        &self,
        s: &IoSpan,
        names: &Names,
        reason: Reason,
        root: &SpanContext,
        same_signal: &[SpanContext],
    ) -> Option<(&mpsc::Sender<Queued>, Queued)> {
        self.shared.stats.chosen.fetch_add(1, Ordering::Relaxed);
        let tx = self.tx.as_ref()?;
        let trace = self.traces.of(s, names, reason, root, same_signal);
        let first = trace.first()?;
        let seed = Exemplar {
            trace_id: format!("{:032x}", first.span_context.trace_id()),
            value_ns: s.total_ns,
            unix_s: first
                .end_time
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
        };
        Some((tx, (trace, (SeriesKey::of(s, names), seed))))
    }

    /// Queues one I/O, waiting while the queue is full (a replay loses
    /// nothing: it goes at the backend's pace).
    pub async fn send_wait(&self, s: &IoSpan, names: &Names, reason: Reason) {
        let root = self.traces.new_root();
        let Some((tx, queued)) = self.queued(s, names, reason, &root, &[]) else {
            return;
        };
        if tx.send(queued).await.is_err() {
            self.shared
                .stats
                .dropped_queue_full
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Sends what is queued, waiting at most `grace` for the backend.
    pub async fn finish(mut self, grace: Duration) -> ExportCounters {
        self.tx = None;
        let abort = self.task.abort_handle();
        if tokio::time::timeout(grace, &mut self.task).await.is_err() {
            abort.abort();
        }
        let c = self.shared.stats.snapshot();
        // Whatever never got an answer is failed, not silently gone.
        let settled = c.exported_traces + c.failed_traces + c.dropped_queue_full;
        ExportCounters {
            failed_traces: c.failed_traces + c.chosen.saturating_sub(settled),
            ..c
        }
    }
}

/// How one signal ("traces", "metrics") reaches the collector.
pub enum Transport {
    Grpc,
    Http,
}

/// The protocol (flag, else OTEL_EXPORTER_OTLP_{SIGNAL}_PROTOCOL, else
/// OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf) and the endpoint from
/// the flag, if given: it names the collector, as the environment does,
/// so over HTTP the signal's path is added. Without the flag the exporter
/// reads the environment itself.
pub fn transport(opts: &TraceOpts, signal: &str) -> Result<(Transport, Option<String>)> {
    let protocol = opts.protocol.clone().or_else(|| {
        [
            format!("OTEL_EXPORTER_OTLP_{}_PROTOCOL", signal.to_uppercase()),
            "OTEL_EXPORTER_OTLP_PROTOCOL".to_string(),
        ]
        .iter()
        .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    });
    match protocol.as_deref().unwrap_or("http/protobuf") {
        "grpc" => Ok((Transport::Grpc, opts.endpoint.clone())),
        "http/protobuf" => {
            let path = format!("/v1/{signal}");
            let endpoint = opts.endpoint.as_deref().map(|e| {
                let e = e.trim_end_matches('/');
                if e.ends_with(&path) {
                    e.to_string()
                } else {
                    format!("{e}{path}")
                }
            });
            Ok((Transport::Http, endpoint))
        }
        other => bail!(
            "unknown OTLP protocol {other:?} (--otlp-protocol or OTEL_EXPORTER_OTLP_PROTOCOL): \
             use grpc or http/protobuf"
        ),
    }
}

/// How long one export may wait for the collector.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// An OTLP exporter of `$signal` ("traces" or "metrics") from its builder,
/// as the flags and the environment say: one recipe for both signals,
/// whose builders share no trait to write it once as a function.
macro_rules! otlp_exporter {
    ($builder:expr, $opts:expr, $signal:literal) => {{
        use super::otlp::{transport, Transport, EXPORT_TIMEOUT};
        use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
        let sec = super::tls::secure($opts, $signal)?;
        let built = match transport($opts, $signal)? {
            (Transport::Grpc, endpoint) => {
                let mut b = $builder.with_tonic().with_timeout(EXPORT_TIMEOUT);
                if let Some(tls) = super::tls::grpc_tls(&sec)? {
                    b = b.with_tls_config(tls);
                }
                match endpoint {
                    Some(e) => b.with_endpoint(e).build(),
                    None => b.build(),
                }
            }
            (Transport::Http, endpoint) => {
                let b = $builder
                    .with_http()
                    .with_timeout(EXPORT_TIMEOUT)
                    .with_http_client(super::tls::http_client(&sec, EXPORT_TIMEOUT)?);
                match endpoint {
                    Some(e) => b.with_endpoint(e).build(),
                    None => b.build(),
                }
            }
        };
        built.context(concat!("setting up the OTLP ", $signal, " exporter"))
    }};
}
pub(crate) use otlp_exporter;

fn build_exporter(opts: &TraceOpts) -> Result<opentelemetry_otlp::SpanExporter> {
    otlp_exporter!(opentelemetry_otlp::SpanExporter::builder(), opts, "traces")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The only test of this crate that sets these variables.
    #[test]
    fn the_resource_is_ours_unless_the_environment_names_it() {
        let get = |r: &Resource, k: &'static str| {
            r.get(&opentelemetry::Key::new(k)).map(|v| v.to_string())
        };
        std::env::remove_var("OTEL_SERVICE_NAME");
        std::env::remove_var("OTEL_RESOURCE_ATTRIBUTES");
        let r = resource();
        assert_eq!(get(&r, "service.name").as_deref(), Some("iospan"));
        assert_eq!(
            get(&r, "service.version").as_deref(),
            Some(env!("CARGO_PKG_VERSION"))
        );
        assert!(get(&r, "host.name").is_some_and(|h| !h.is_empty()));
        assert_eq!(get(&r, "telemetry.sdk.language").as_deref(), Some("rust"));
        std::env::set_var(
            "OTEL_RESOURCE_ATTRIBUTES",
            "host.name=hv-7,rack=r2,service.name=io",
        );
        let r = resource();
        assert_eq!(get(&r, "host.name").as_deref(), Some("hv-7"));
        assert_eq!(get(&r, "rack").as_deref(), Some("r2"));
        assert_eq!(get(&r, "service.name").as_deref(), Some("io"));
        std::env::set_var("OTEL_SERVICE_NAME", "iospan-lab");
        assert_eq!(
            get(&resource(), "service.name").as_deref(),
            Some("iospan-lab")
        );
        std::env::remove_var("OTEL_SERVICE_NAME");
        std::env::remove_var("OTEL_RESOURCE_ATTRIBUTES");
    }

    #[test]
    fn children_tile_the_root_with_and_without_the_guest() {
        let host = IoSpan {
            vm: 1,
            vdisk: 1,
            dev: 0,
            op: Op::Write,
            pos: 0,
            bytes: 512,
            begin_ns: 900,
            guest_kick_ns: 950,
            guest_irq_ns: 1460,
            end_ns: 1500,
            kick_ns: 1000,
            pick_ns: 1030,
            start_ns: 1100,
            issue_ns: 1120,
            done_ns: 1400,
            signal_ns: 1420,
            clock_offset_ns: Some(-7),
            guest_ns: 90,
            hypervisor_ns: 120,
            engine_ns: 90,
            device_ns: 300,
            total_ns: 600,
            app_ends_from_block_layer: false,
            has_guest: true,
            queue: Some(3),
            cpu_wait: Default::default(),
        };
        let clock = WallClock { offset_ns: 0 };
        let traces = Traces::new(clock, None);
        for s in [
            host.clone(),
            IoSpan {
                has_guest: false,
                total_ns: 420,
                ..host
            },
        ] {
            let t = traces.of(
                &s,
                &Names::default(),
                Reason::Slowest,
                &traces.new_root(),
                &[],
            );
            let root = &t[0];
            assert_eq!(root.name, "vdisk.write");
            let dur = |x: &SpanData| x.end_time.duration_since(x.start_time).unwrap();
            let mut at = root.start_time;
            for c in &t[1..] {
                assert_eq!(c.parent_span_id, root.span_context.span_id());
                assert_eq!(c.span_context.trace_id(), root.span_context.trace_id());
                assert_eq!(c.start_time, at, "{}", c.name);
                at = c.end_time;
            }
            assert_eq!(at, root.end_time);
            let total: Duration = t[1..].iter().map(dur).sum();
            if s.has_guest {
                assert_eq!(t.len(), 9);
                // Before the clock offset is known, the guest's own stamps
                // (here 10 s behind) are placed by the I/O's kick.
                let early = IoSpan {
                    clock_offset_ns: None,
                    begin_ns: s.begin_ns.wrapping_sub(10_000_000_000),
                    guest_kick_ns: s.guest_kick_ns.wrapping_sub(10_000_000_000),
                    guest_irq_ns: s.guest_irq_ns.wrapping_sub(10_000_000_000),
                    end_ns: s.end_ns.wrapping_sub(10_000_000_000),
                    ..s.clone()
                };
                let e = traces.of(
                    &early,
                    &Names::default(),
                    Reason::Slowest,
                    &traces.new_root(),
                    &[],
                );
                assert_eq!(e[0].start_time, clock.at(s.kick_ns - 50));
                assert_eq!(total.as_nanos(), 600);
            } else {
                // Kick to signal.
                assert_eq!(t.len(), 6);
                assert_eq!(total.as_nanos(), 420);
            }
        }
    }

    #[test]
    fn a_root_links_to_the_ios_its_signal_also_completed_and_names_its_queue() {
        let traces = Traces::new(WallClock { offset_ns: 0 }, None);
        let s = IoSpan {
            vm: 1,
            vdisk: 1,
            dev: 0,
            op: Op::Read,
            pos: 0,
            bytes: 4096,
            begin_ns: 0,
            guest_kick_ns: 0,
            guest_irq_ns: 0,
            end_ns: 0,
            kick_ns: 1000,
            pick_ns: 1030,
            start_ns: 1100,
            issue_ns: 1120,
            done_ns: 1400,
            signal_ns: 1420,
            clock_offset_ns: None,
            guest_ns: 0,
            hypervisor_ns: 30,
            engine_ns: 90,
            device_ns: 300,
            total_ns: 420,
            app_ends_from_block_layer: false,
            has_guest: false,
            queue: Some(2),
            cpu_wait: Default::default(),
        };
        let (root, a, b) = (traces.new_root(), traces.new_root(), traces.new_root());
        let names = Names {
            nvme: true,
            ..Default::default()
        };
        let t = traces.of(&s, &names, Reason::Slowest, &root, &[a.clone(), b.clone()]);
        assert_eq!(t[0].span_context, root);
        let linked: Vec<&SpanContext> = t[0].links.iter().map(|l| &l.span_context).collect();
        assert_eq!(linked, [&a, &b]);
        assert!(t[1..].iter().all(|c| c.links.is_empty()));
        let attr = |k: &str| {
            t[0].attributes
                .iter()
                .find(|kv| kv.key.as_str() == k)
                .map(|kv| kv.value.clone())
        };
        assert_eq!(attr("virt.queue.index"), Some(2i64.into()));
        assert_eq!(attr("nvme.qid"), Some(3i64.into()));
    }
}
