//! What a run shows while it runs: frames for live views, /metrics.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use anyhow::Result;

use crate::{
    discover::{diskstats, vms::Registry},
    output::live::Frame,
    pipeline::correlate::Correlator,
    probes::host::BlockProbes,
    probes::preflight,
};

use super::*;

#[cfg(feature = "serve")]
pub(super) async fn serve_metrics(addr: std::net::SocketAddr) -> Result<Arc<crate::api::Shared>> {
    use anyhow::Context as _;
    // The agent's own token: labelled runs start and stop with it here too.
    let path = std::path::Path::new(crate::cmd::token::DEFAULT_FILE);
    let token = crate::cmd::token::load_or_create(path)
        .with_context(|| format!("--metrics-listen {addr}: the API token"))?;
    let shared = crate::api::Shared::new(crate::api::Access::TokenToChange(token));
    crate::api::serve(addr, None, shared.clone())
        .await
        .with_context(|| format!("--metrics-listen {addr}"))?;
    Ok(shared)
}

#[cfg(not(feature = "serve"))]
pub(super) async fn serve_metrics(addr: std::net::SocketAddr) -> Result<Arc<crate::api::Shared>> {
    bail!("--metrics-listen {addr}: this iospan was built without the HTTP server (the `serve` feature)")
}

/// QEMU's counters read at a run's edge, by VM name.
pub(super) type EdgeCounts = BTreeMap<String, crate::output::live::FrameQemu>;

/// The figures so far, to a live view; `qemu`: QEMU's counters read just
/// before (QEMU's first, then ours: a request QEMU counted has passed our
/// probes already).
pub(super) fn send_frame(
    feed: &LiveFeed,
    at_s: f64,
    probes: &BlockProbes,
    (correlator, known): (&Mutex<Correlator>, &Mutex<Registry>),
    qemu: Option<EdgeCounts>,
    (diagnoses, monitors): (&Mutex<Diagnoses>, &crate::discover::monitors::Monitors),
) {
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
    frame.monitors = monitors.misbehaving();
    let tier = probes.tier.tier;
    diagnoses
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .attach(&mut frame, &known, tier);
    // Stored even when no one watches yet (the API reads it on request).
    feed.tx.send_replace(Some(Arc::new(frame)));
}

/// How long a live diagnosis's window is: figures over less are a
/// handful of requests, and the VMs' threads are read every 2 s.
const DIAGNOSIS_WINDOW_S: f64 = 10.0;

/// The live feed's diagnoses: each `DIAGNOSIS_WINDOW_S`, every disk's over
/// that window (its frames' difference, what the observer watched, the
/// host disks' depth), carried in every frame until the next.
#[derive(Default)]
pub(super) struct Diagnoses {
    pub observer: Arc<Mutex<super::observe::Observer>>,
    /// The frame the window began with, and the host disks' counts then.
    from: Option<(
        Frame,
        BTreeMap<crate::discover::disks::Dev, diskstats::DiskStat>,
    )>,
    last: Vec<crate::model::diagnosis::FrameDiagnosis>,
}

impl Diagnoses {
    fn attach(&mut self, frame: &mut Frame, known: &Registry, tier: crate::model::Tier) {
        let due = match &self.from {
            None => {
                self.from = Some((frame.clone(), diskstats::read_all()));
                false
            }
            Some((f, _)) => frame.at_s - f.at_s >= DIAGNOSIS_WINDOW_S,
        };
        // Taken only when due: the window's start stays until then.
        if let Some((then, disks)) = self.from.take_if(|_| due) {
            let watch = self
                .observer
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(super::observe::Reader::Window);
            let now_disks = diskstats::read_all();
            let depths = diskstats::delta(&disks, &now_disks)
                .into_iter()
                .filter_map(|(dev, d)| Some((crate::discover::disks::name_of(dev), d.depth()?)))
                .collect();
            self.last = crate::output::diagnose::frame_diagnoses(
                (frame, &then),
                known,
                &watch,
                &depths,
                tier,
            );
            self.from = Some((frame.clone(), now_disks));
        }
        frame.diagnoses.clone_from(&self.last);
    }
}

pub(super) fn refresh_metrics(
    m: &crate::api::Shared,
    probes: &BlockProbes,
    (correlator, known): (&Mutex<Correlator>, &Mutex<Registry>),
    export: Option<&crate::output::export::ExportShared>,
    monitors: &crate::discover::monitors::Monitors,
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
        monitors: Some(monitors),
    };
    let prometheus = crate::output::metrics::render(&view, Format::Prometheus);
    let openmetrics = crate::output::metrics::render(&view, Format::OpenMetrics);
    *m.prometheus.lock().unwrap_or_else(|p| p.into_inner()) = prometheus.into();
    *m.openmetrics.lock().unwrap_or_else(|p| p.into_inner()) = openmetrics.into();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A window begins with the first frame and ends 10 s later, however
    /// many frames come between: each is diagnosed over the same start.
    #[test]
    fn a_diagnosis_window_spans_its_frames() {
        let mut d = Diagnoses::default();
        let known = Registry::default();
        let start_of = |d: &Diagnoses| d.from.as_ref().map(|(f, _)| f.at_s);
        for at_s in [0.0, 1.0, 5.0, 9.9] {
            let mut f = Frame {
                at_s,
                ..Default::default()
            };
            d.attach(&mut f, &known, crate::model::Tier::AlwaysOn);
            assert_eq!(start_of(&d), Some(0.0), "at {at_s} s");
        }
        let mut f = Frame {
            at_s: 10.0,
            ..Default::default()
        };
        d.attach(&mut f, &known, crate::model::Tier::AlwaysOn);
        assert_eq!(start_of(&d), Some(10.0));
    }
}
