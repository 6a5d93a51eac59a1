//! What a run shows while it runs: frames for live views, /metrics.

use std::sync::{Arc, Mutex};

use anyhow::Result;

use crate::{
    discover::vms::Registry, pipeline::correlate::Correlator, probes::host::BlockProbes,
    probes::preflight,
};

use super::*;

#[cfg(feature = "serve")]
pub(super) async fn serve_metrics(
    addr: std::net::SocketAddr,
) -> Result<Arc<crate::cmd::api::Shared>> {
    use anyhow::Context as _;
    // The agent's own token: labelled runs start and stop with it here too.
    let path = std::path::Path::new(crate::cmd::token::DEFAULT_FILE);
    let token = crate::cmd::token::load_or_create(path)
        .with_context(|| format!("--metrics-listen {addr}: the API token"))?;
    let shared = crate::cmd::api::Shared::new(crate::cmd::api::Access::TokenToChange(token));
    crate::cmd::api::serve(addr, None, shared.clone())
        .await
        .with_context(|| format!("--metrics-listen {addr}"))?;
    Ok(shared)
}

#[cfg(not(feature = "serve"))]
pub(super) async fn serve_metrics(
    addr: std::net::SocketAddr,
) -> Result<Arc<crate::cmd::api::Shared>> {
    bail!("--metrics-listen {addr}: this iospan was built without the HTTP server (the `serve` feature)")
}

/// The figures so far, to a live view.
pub(super) fn send_frame(
    feed: &LiveFeed,
    at_s: f64,
    probes: &BlockProbes,
    correlator: &Mutex<Correlator>,
    known: &Mutex<Registry>,
    with_qemu: bool,
) {
    // QEMU's first, then ours: a request QEMU counted has passed our
    // probes already.
    let qemu = with_qemu.then(|| {
        let ours = probes
            .vm_counts_reader()
            .map_err(|e| log::warn!("{}", crate::probes::error_chain(&e)))
            .ok();
        super::qemu::read_all(known, ours.as_ref())
    });
    let Ok(mut snap) = probes.snapshot() else {
        return;
    };
    let corr = correlator.lock().unwrap_or_else(|p| p.into_inner());
    snap.counters.host_split = corr.counters.clone();
    let known = known.lock().unwrap_or_else(|p| p.into_inner());
    let mut frame = crate::output::live::frame(at_s, &snap, &corr, &known);
    if let Some(mut q) = qemu {
        for (slot, c) in &snap.vm_counts {
            if let Some(f) = q.get_mut(&known.name(*slot)) {
                f.merged = c.engine_merges + c.bio_merges;
                f.submitted = c.submitted;
            }
        }
        frame.qemu = Some(q);
    }
    // Stored even when no one watches yet (the API reads it on request).
    feed.tx.send_replace(Some(Arc::new(frame)));
}

pub(super) fn refresh_metrics(
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
