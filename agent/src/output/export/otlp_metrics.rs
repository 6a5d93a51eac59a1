//! Segment latency over OTLP: exponential histograms per VM, virtual disk,
//! op and segment, from every per-I/O record.
//!
//! Recorded from the same per-I/O records the traces come from (every one,
//! not only the exported), pushed every
//! OTEL_METRIC_EXPORT_INTERVAL (default 60 s) and once more at the end.

use std::{
    collections::HashMap,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use anyhow::{bail, Context, Result};
use opentelemetry::{
    metrics::{Histogram, MeterProvider as _},
    KeyValue,
};
use opentelemetry_sdk::{
    error::OTelSdkResult,
    metrics::{
        data::ResourceMetrics, exporter::PushMetricExporter,
        periodic_reader_with_async_runtime::PeriodicReader, Aggregation, InstrumentKind,
        SdkMeterProvider, Stream, Temporality,
    },
    runtime,
};

use super::{Names, TraceOpts};
use crate::{model::IoSpan, model::Op};

pub struct Meters {
    provider: SdkMeterProvider,
    latency: Histogram<f64>,
    /// The attributes every record of a (VM, virtual disk, op) shares.
    base: HashMap<(u32, u32, Op), Vec<KeyValue>>,
}

impl Meters {
    pub fn start(opts: &TraceOpts) -> Result<Self> {
        let exporter = OffWhenRefused {
            inner: build_exporter(opts)?,
            off: AtomicBool::new(false),
        };
        let reader = PeriodicReader::builder(exporter, runtime::Tokio).build();
        let provider = SdkMeterProvider::builder()
            .with_reader(reader)
            .with_resource(super::otlp::resource())
            // Latency spans decades: exponential buckets, the resolution
            // following the data.
            .with_view(|i: &opentelemetry_sdk::metrics::Instrument| {
                (i.kind() == InstrumentKind::Histogram)
                    .then(|| {
                        Stream::builder()
                            .with_aggregation(Aggregation::Base2ExponentialHistogram {
                                max_size: 160,
                                max_scale: 20,
                                record_min_max: true,
                            })
                            .build()
                            .ok()
                    })
                    .flatten()
            })
            .build();
        let latency = provider
            .meter("iospan")
            .f64_histogram("iospan.vm.latency")
            .with_unit("s")
            .with_description(
                "Latency of VMs' I/O per virtual disk, op and segment (host window: \
                 hypervisor/engine/device/host_window; guest-observed: \
                 g_total/g_guest/g_hypervisor/g_engine/g_device)",
            )
            .build();
        Ok(Self {
            provider,
            latency,
            base: HashMap::new(),
        })
    }

    /// One I/O's segments; `names` is asked once per (VM, disk, op).
    pub fn record(&mut self, s: &IoSpan, names: impl Fn(&IoSpan) -> Names) {
        let base = self.base.entry((s.vm, s.vdisk, s.op)).or_insert_with(|| {
            let n = names(s);
            vec![
                KeyValue::new("virt.vm.name", n.vm),
                KeyValue::new("virt.disk.id", n.vdisk),
                KeyValue::new("disk.io.direction", s.op.as_str()),
            ]
        });
        let segs: [(&'static str, u64); 5] = if s.has_guest {
            [
                ("g_total", s.total_ns),
                ("g_guest", s.guest_ns),
                ("g_hypervisor", s.hypervisor_ns),
                ("g_engine", s.engine_ns),
                ("g_device", s.device_ns),
            ]
        } else {
            [
                ("host_window", s.total_ns),
                ("hypervisor", s.hypervisor_ns),
                ("engine", s.engine_ns),
                ("device", s.device_ns),
                ("", 0),
            ]
        };
        let mut attrs = base.clone();
        attrs.push(KeyValue::new("iospan.segment", ""));
        for (seg, ns) in segs.into_iter().filter(|(seg, _)| !seg.is_empty()) {
            if let Some(last) = attrs.last_mut() {
                *last = KeyValue::new("iospan.segment", seg);
            }
            self.latency.record(ns as f64 / 1e9, &attrs);
        }
    }

    /// Pushes what is recorded and stops, within `grace`.
    pub async fn finish(self, grace: Duration) -> Result<()> {
        let provider = self.provider;
        let done = tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(grace));
        match tokio::time::timeout(grace + Duration::from_secs(1), done).await {
            Ok(Ok(r)) => r.context("pushing the last OTLP metrics"),
            Ok(Err(e)) => bail!("pushing the last OTLP metrics: {e}"),
            Err(_) => bail!("pushing the last OTLP metrics: no answer within {grace:?}"),
        }
    }
}

/// The OTLP metric exporter, off for the rest of the run from the first
/// answer that says the endpoint takes no metrics (HTTP 404, gRPC
/// Unimplemented: a traces-only backend such as Jaeger), with one line
/// saying so instead of a failure at every push.
struct OffWhenRefused {
    inner: opentelemetry_otlp::MetricExporter,
    off: AtomicBool,
}

/// Whether an export error means "no metrics here" rather than "not now".
pub fn takes_no_metrics(error: &str) -> bool {
    let http_404 = error.split("status code: ").skip(1).any(|rest| {
        let code: String = rest.chars().take_while(char::is_ascii_digit).collect();
        code == "404"
    });
    http_404 || error.contains("gRPC code: Unimplemented")
}

impl PushMetricExporter for OffWhenRefused {
    async fn export(&self, metrics: &ResourceMetrics) -> OTelSdkResult {
        if self.off.load(Ordering::Relaxed) {
            return Ok(());
        }
        match self.inner.export(metrics).await {
            Err(e) if takes_no_metrics(&e.to_string()) => {
                if !self.off.swap(true, Ordering::Relaxed) {
                    log::warn!(
                        "OTLP metrics: the endpoint takes no metrics ({e}): metrics export off \
                         for this run, traces go on. Point OTEL_EXPORTER_OTLP_METRICS_ENDPOINT at \
                         a metrics backend, or set OTEL_METRICS_EXPORTER=none"
                    );
                }
                Ok(())
            }
            r => r,
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn temporality(&self) -> Temporality {
        self.inner.temporality()
    }
}

fn build_exporter(opts: &TraceOpts) -> Result<opentelemetry_otlp::MetricExporter> {
    super::otlp::otlp_exporter!(
        opentelemetry_otlp::MetricExporter::builder(),
        opts,
        "metrics"
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_a_missing_metrics_service_turns_metrics_off() {
        assert!(super::takes_no_metrics(
            "HTTP export failed with status code: 404"
        ));
        assert!(super::takes_no_metrics(
            "TonicMetricsClient export failed with gRPC code: Unimplemented"
        ));
        for passing in [
            "HTTP export failed with status code: 503",
            "HTTP export failed with status code: 4040",
            "connection refused",
            "TonicMetricsClient export failed with gRPC code: Unavailable",
        ] {
            assert!(!super::takes_no_metrics(passing), "{passing}");
        }
    }
}
