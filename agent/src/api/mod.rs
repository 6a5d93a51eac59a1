//! The agent's HTTP API (axum), for `iospan run --metrics-listen` and the
//! `iospan agent` service.
//!
//! `/metrics` (Prometheus text or OpenMetrics),
//! `/healthz`, `/api/v1/snapshot` (the current frame, JSON),
//! `/api/v1/stream` (frames as server-sent events, for `top --connect`),
//! `/api/v1/runs` (labelled benchmark runs: start, stop, report).

#[cfg(feature = "serve")]
mod bodies;
pub mod conns;
#[cfg(feature = "serve")]
mod io;
pub mod peer;
#[cfg(any(feature = "serve", feature = "tui"))]
pub mod tls;

use std::{
    collections::BTreeMap,
    sync::{atomic::AtomicBool, Arc, Mutex},
};

use serde::Serialize;
use tokio::sync::watch;

use crate::{
    model::Summary,
    output::live::{Frame, Row},
};

/// The API's certificate chain and private key, PEM files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tls {
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
}

/// What the API serves, kept up to date by the run that measures.
#[derive(Debug)]
pub struct Shared {
    /// The last /metrics refresh, in each format, and whether a scrape
    /// asked since it was made.
    pub prometheus: Mutex<bytes::Bytes>,
    pub openmetrics: Mutex<bytes::Bytes>,
    pub wanted: AtomicBool,
    /// An API run starts or stops: the next frame carries QEMU's own
    /// counters.
    pub qemu_wanted: AtomicBool,
    /// API runs of the deep tier starting or running: while any is, the
    /// agent runs the deep tier.
    pub deep_runs: std::sync::atomic::AtomicU32,
    /// How many times the agent has looked at the tier the runs want (and
    /// switched to it where it could): a deep run starts after a look that
    /// began once it asked.
    pub tier_looks: watch::Sender<u64>,
    /// The current frame (cumulative figures).
    pub frames: watch::Sender<Option<Arc<Frame>>>,
    /// A frame wanted now, not at the next second: a run's edge is the
    /// moment its start or stop was asked.
    pub frame_asked: tokio::sync::Notify,
    #[cfg_attr(not(feature = "serve"), allow(dead_code))]
    runs: Mutex<Vec<BenchRun>>,
    /// Who may read and who may change what.
    #[cfg_attr(not(feature = "serve"), allow(dead_code))]
    access: Access,
    /// What the API turned away, by reason (shown in /metrics).
    pub refused: Refused,
    /// The open connections' slots, and those the agent closed.
    pub slots: Arc<conns::Slots>,
    /// The frame streams' places (`MAX_STREAMS`), and each peer's share
    /// of them (`MAX_STREAMS_A_PEER`).
    pub streams: Arc<tokio::sync::Semaphore>,
    pub streams_of: Arc<Mutex<std::collections::HashMap<peer::Peer, usize>>>,
    /// The current frame's JSON and the runs' list, rendered once for all.
    #[cfg(feature = "serve")]
    frame_json: bodies::FrameJson,
    #[cfg(feature = "serve")]
    runs_json: bodies::Cached,
}

/// Requests and connections the API turned away, counted.
#[derive(Debug, Default)]
pub struct Refused {
    /// Connections closed because `MAX_CONNECTIONS` were open: a new one
    /// refused (every slot served a request), or the oldest one holding
    /// no request evicted to let a new one in.
    pub connections: std::sync::atomic::AtomicU64,
    /// Runs not started: `MAX_RUNS` were stored and all still running.
    pub runs: std::sync::atomic::AtomicU64,
    /// Stopped runs let go, oldest first, to keep `MAX_RUNS`.
    pub runs_evicted: std::sync::atomic::AtomicU64,
    /// Requests with a bad label, or a Host header naming another site.
    pub bad_requests: std::sync::atomic::AtomicU64,
    /// Requests without the token they needed, or changes asked of a
    /// read-only API.
    pub unauthorized: std::sync::atomic::AtomicU64,
    /// Frame streams not started: `MAX_STREAMS` were open.
    pub streams: std::sync::atomic::AtomicU64,
}

/// Who may use the API. `/healthz` answers everyone in every case:
/// supervisors carry no token.
#[derive(Clone, Debug)]
pub enum Access {
    /// Everyone reads and changes (`api.open` with no token).
    Open,
    /// Every request carries `Authorization: Bearer TOKEN` (`api.token`).
    Token(String),
    /// Reads are open, changes carry the token: the default on loopback
    /// (`iospan agent`, `iospan run --metrics-listen`), with the token from
    /// the agent's 0600 token file.
    TokenToChange(String),
}

/// Connections the API keeps open at once. Past it a new connection
/// takes the slot of the oldest one that holds no request (`conns`).
pub const MAX_CONNECTIONS: usize = 4096;
/// Frame streams served at once: a connection serving one is never evicted,
/// so streams may hold only a quarter of the slots ...
pub const MAX_STREAMS: usize = MAX_CONNECTIONS / 4;
/// ... and one peer (a local user but root, a remote address) a quarter of
/// those: a user who opens streams without end leaves the others'
/// `top --connect` its place.
pub const MAX_STREAMS_A_PEER: usize = MAX_STREAMS / 4;
/// Labelled runs kept: past it the oldest stopped one goes.
pub const MAX_RUNS: usize = 1024;
/// A run label's length, at most.
pub const MAX_LABEL: usize = 128;

impl Refused {
    /// These counters in the scrape's format, written as the run's own
    /// families are.
    pub fn exposition(&self, f: crate::output::metrics::Format) -> String {
        use crate::output::metrics::{family, labels};
        use std::sync::atomic::Ordering::Relaxed;
        let mut out = String::new();
        family(
            &mut out,
            f,
            "iospan_api_refused_total",
            "counter",
            "Requests and connections the API turned away, by reason.",
        );
        for (reason, n) in [
            ("connections", &self.connections),
            ("runs", &self.runs),
            ("runs_evicted", &self.runs_evicted),
            ("bad_request", &self.bad_requests),
            ("unauthorized", &self.unauthorized),
            ("streams", &self.streams),
        ] {
            out.push_str(&format!(
                "iospan_api_refused_total{{{}}} {}\n",
                labels(&[("reason", reason)]),
                n.load(Relaxed)
            ));
        }
        out
    }
}

impl Shared {
    /// The tier the API's runs want now.
    pub fn wanted_tier(&self) -> crate::model::Tier {
        if self.deep_runs.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            crate::model::Tier::Deep
        } else {
            crate::model::Tier::AlwaysOn
        }
    }

    pub fn new(access: Access) -> Arc<Self> {
        Arc::new(Self {
            prometheus: Mutex::new(bytes::Bytes::new()),
            openmetrics: Mutex::new(bytes::Bytes::new()),
            wanted: AtomicBool::new(true),
            qemu_wanted: AtomicBool::new(false),
            deep_runs: std::sync::atomic::AtomicU32::new(0),
            tier_looks: watch::channel(0).0,
            frames: watch::channel(None).0,
            frame_asked: tokio::sync::Notify::new(),
            runs: Mutex::new(Vec::new()),
            access,
            refused: Refused::default(),
            slots: conns::Slots::new(MAX_CONNECTIONS),
            streams: Arc::new(tokio::sync::Semaphore::new(MAX_STREAMS)),
            streams_of: Arc::default(),
            #[cfg(feature = "serve")]
            frame_json: bodies::FrameJson::default(),
            #[cfg(feature = "serve")]
            runs_json: bodies::Cached::default(),
        })
    }

    /// The API's own figures for /metrics: what it refused, its
    /// connections and those it closed.
    pub fn api_exposition(&self, f: crate::output::metrics::Format) -> String {
        use crate::output::metrics::{family, labels};
        let mut out = self.refused.exposition(f);
        family(
            &mut out,
            f,
            "iospan_api_connections_closed_total",
            "counter",
            "Connections the API closed: while they held no request, evicted for a new one \
             (every slot taken) or past their deadline, by what they waited for; or because \
             their reader took nothing of a response for 10 s.",
        );
        for (reason, waiting, n) in self.slots.closed.each() {
            out.push_str(&format!(
                "iospan_api_connections_closed_total{{{}}} {n}\n",
                labels(&[("reason", reason), ("waiting", waiting.as_str())])
            ));
        }
        out.push_str(&format!(
            "iospan_api_connections_closed_total{{{}}} {}\n",
            labels(&[("reason", "slow_reader"), ("waiting", "response")]),
            self.slots.closed.slow_readers()
        ));
        let open = self.slots.open();
        for (name, help, v) in [
            (
                "iospan_api_connections_open",
                "Connections the API holds open.",
                open as f64,
            ),
            (
                "iospan_api_connections_max",
                "Connections the API holds at most.",
                self.slots.cap() as f64,
            ),
            (
                "iospan_api_idle_deadline_seconds",
                "How long a connection may hold no request now (it tightens as the slots fill).",
                conns::deadline(open, self.slots.cap()).as_secs_f64(),
            ),
        ] {
            family(&mut out, f, name, "gauge", help);
            out.push_str(&format!("{name} {v}\n"));
        }
        out
    }
}

/// A labelled benchmark run: the figures between its start and its stop.
#[derive(Clone, Debug, Serialize)]
pub struct BenchRun {
    pub id: u64,
    pub label: String,
    /// The tier it asked for (the agent's is always-on otherwise).
    pub tier: crate::model::Tier,
    pub started_s: f64,
    pub stopped_s: Option<f64>,
    #[serde(skip)]
    #[cfg_attr(not(feature = "serve"), allow(dead_code))]
    start: Arc<Frame>,
    /// Filled when it stops.
    pub report: Option<BenchReport>,
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub seconds: f64,
    /// Per VM virtual disk and op.
    pub entries: Vec<BenchEntry>,
    /// Per host disk and op.
    pub disks: Vec<BenchEntry>,
    /// Requests or events lost during the run (not counted, or untimed).
    pub lost: u64,
    /// VM requests of the run counted whole but whose host window was not
    /// split (see the frame's `unsplit`).
    pub unsplit: u64,
    /// Per VM: where QEMU's own counters were read, or why not.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub qemu_counts: BTreeMap<String, String>,
    /// The entries' diagnoses are the agent's over its last window before
    /// the run's stop: this long, s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diagnosis_window_s: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchEntry {
    #[serde(skip_serializing_if = "String::is_empty")]
    pub vm: String,
    pub disk: String,
    pub op: crate::model::Op,
    pub ios: u64,
    /// The guest's requests of the run whose completion never reached the
    /// probes (VM entries): counted, not timed; `ios + undelivered` is the
    /// disk's count, merges aside.
    pub undelivered: u64,
    pub bytes: u64,
    pub iops: f64,
    /// Whether `segments.total` is guest-observed (guest agent) or the host
    /// window.
    pub guest_observed: bool,
    pub segments: BTreeMap<String, Summary>,
    /// QEMU's own count and mean of the same requests over the run (VM
    /// disks whose counters were read at its start and stop).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qemu: Option<crate::output::report::QemuCheck>,
    /// What limits it, over the agent's last window before the stop.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diagnosis: Option<crate::model::diagnosis::Diagnosis>,
}

/// The figures of `end` less those of `start`.
pub fn bench_report(start: &Frame, end: &Frame) -> BenchReport {
    let seconds = (end.at_s - start.at_s).max(1e-9);
    let side = |rows: &[Row], before: &[Row]| -> Vec<BenchEntry> {
        rows.iter()
            .map(|r| {
                let d = r.since(before.iter().find(|b| b.same(r)));
                let diagnosis = end
                    .diagnoses
                    .iter()
                    .find(|x| x.vm == d.vm && x.disk == d.disk && x.op == d.op)
                    .map(|x| x.diagnosis.clone());
                BenchEntry {
                    vm: d.vm,
                    disk: d.disk,
                    op: d.op,
                    ios: d.ios,
                    undelivered: d.undelivered,
                    bytes: d.bytes,
                    iops: d.ios as f64 / seconds,
                    guest_observed: d.guest_observed,
                    segments: d
                        .segs
                        .iter()
                        .map(|(k, h)| (k.clone(), h.summary()))
                        .collect(),
                    qemu: None,
                    diagnosis,
                }
            })
            .filter(|e| e.ios + e.undelivered > 0)
            .collect()
    };
    let mut entries = side(&end.vdisks, &start.vdisks);
    let mut qemu_counts = BTreeMap::new();
    if let (Some(qs), Some(qe)) = (&start.qemu, &end.qemu) {
        for (vm, e) in qe {
            let said = match (&e.error, qs.get(vm)) {
                (Some(err), _) => format!("{} (not read: {err})", e.source),
                (None, None) => format!("{} (the VM started within the run)", e.source),
                (None, Some(_)) => e.source.clone(),
            };
            qemu_counts.insert(vm.clone(), said);
        }
        // Requests in flight at either end, per VM, and those started
        // between QEMU's read and our figures: by how many the two counts
        // may honestly differ.
        let inflight = |rows: &[Row], q: &crate::output::live::FrameQemu, vm: &str| {
            rows.iter()
                .filter(|r| r.vm == vm)
                .map(|r| r.inflight)
                .max()
                .unwrap_or(0)
                + q.submitted.saturating_sub(q.submitted_before_read)
        };
        for entry in &mut entries {
            let (Some(s), Some(e)) = (qs.get(&entry.vm), qe.get(&entry.vm)) else {
                continue;
            };
            if s.error.is_some() || e.error.is_some() {
                continue;
            }
            let (Some(before), Some(after)) =
                (s.counts.get(&entry.disk), e.counts.get(&entry.disk))
            else {
                continue;
            };
            let allow = crate::output::qemu_check::Allowances {
                merged: e.merged.saturating_sub(s.merged),
                edge: inflight(&start.vdisks, s, &entry.vm) + inflight(&end.vdisks, e, &entry.vm),
                ..Default::default()
            };
            entry.qemu = crate::output::qemu_check::check(
                &after.since(before),
                entry.op,
                entry.ios + entry.undelivered,
                &entry.segments,
                e.engine_disks.contains(&entry.disk),
                allow,
            );
        }
    }
    BenchReport {
        seconds,
        entries,
        disks: side(&end.disks, &start.disks),
        lost: end.lost.saturating_sub(start.lost),
        unsplit: end.unsplit.saturating_sub(start.unsplit),
        qemu_counts,
        diagnosis_window_s: end.diagnoses.first().map(|d| d.seconds),
    }
}

#[cfg(feature = "serve")]
pub use server::{router, serve};

#[cfg(feature = "serve")]
mod server;

#[cfg(all(test, feature = "serve"))]
mod tests;

#[cfg(test)]
mod qemu_tests;
