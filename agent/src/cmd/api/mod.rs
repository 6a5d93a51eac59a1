//! The agent's HTTP API (axum), for `iospan run --metrics-listen` and the
//! `iospan agent` service.
//!
//! `/metrics` (Prometheus text or OpenMetrics),
//! `/healthz`, `/api/v1/snapshot` (the current frame, JSON),
//! `/api/v1/stream` (frames as server-sent events, for `top --connect`),
//! `/api/v1/runs` (labelled benchmark runs: start, stop, report).

pub mod conns;

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

/// What the API serves, kept up to date by the run that measures.
#[derive(Debug)]
pub struct Shared {
    /// The last /metrics refresh, in each format, and whether a scrape
    /// asked since it was made.
    pub prometheus: Mutex<String>,
    pub openmetrics: Mutex<String>,
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
    /// The frame streams' places (`MAX_STREAMS`).
    pub streams: Arc<tokio::sync::Semaphore>,
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
/// so streams may hold only a quarter of the slots.
pub const MAX_STREAMS: usize = MAX_CONNECTIONS / 4;
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
            prometheus: Mutex::new(String::new()),
            openmetrics: Mutex::new(String::new()),
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
            "Connections the API closed while they held no request: evicted for a new one \
             (every slot taken) or past their deadline, by what they waited for.",
        );
        for (reason, waiting, n) in self.slots.closed.each() {
            out.push_str(&format!(
                "iospan_api_connections_closed_total{{{}}} {n}\n",
                labels(&[("reason", reason), ("waiting", waiting.as_str())])
            ));
        }
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
mod server {
    use std::{
        convert::Infallible,
        net::SocketAddr,
        sync::Arc,
        time::{Duration, Instant},
    };

    use anyhow::{Context, Result};
    use axum::{
        extract::{Path, Query, State},
        http::{header, HeaderMap, Method, StatusCode},
        middleware::{self, Next},
        response::{
            sse::{Event, KeepAlive, Sse},
            IntoResponse, Response,
        },
        routing::{get, post},
        Json, Router,
    };
    use futures_util::stream;

    use super::{
        bench_report,
        conns::{self, Waiting},
        BenchRun, Shared, MAX_CONNECTIONS, MAX_LABEL, MAX_RUNS, MAX_STREAMS,
    };
    use crate::{output::live::Frame, output::metrics::Format};
    use hyper_util::rt::TokioIo;
    use subtle::ConstantTimeEq;

    /// Binds `addr` and serves in the background, over TLS when `tls`
    /// names a certificate and key.
    pub async fn serve(
        addr: SocketAddr,
        tls: Option<&crate::cmd::config::Tls>,
        shared: Arc<Shared>,
    ) -> Result<()> {
        raise_open_files();
        let acceptor = tls.map(acceptor).transpose()?;
        // Bound here, not in the background: a taken port fails the start.
        let listener = listen(addr).with_context(|| format!("binding the HTTP API to {addr}"))?;
        let app = router(shared.clone(), addr);
        tokio::spawn(accept_loop(listener, acceptor, app, shared));
        Ok(())
    }

    /// A listening socket whose queue holds a burst of `MAX_CONNECTIONS`
    /// new connections (the kernel caps it at net.core.somaxconn): with
    /// the usual 128, a burst of connects fills it between two wake-ups
    /// of the accept loop and the rest wait a second for their SYN's
    /// retry, real requests among them.
    fn listen(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
        let socket = match addr {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
        };
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        socket.listen(u32::try_from(MAX_CONNECTIONS).unwrap_or(u32::MAX))
    }

    /// The TLS side of the API from its PEM certificate chain and key.
    fn acceptor(t: &crate::cmd::config::Tls) -> Result<tokio_rustls::TlsAcceptor> {
        use rustls::pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer};
        crate::cmd::tls::install_provider();
        let named = || {
            format!(
                "api.tls_cert = {}, api.tls_key = {}: PEM certificate chain and private key",
                t.cert.display(),
                t.key.display()
            )
        };
        let certs = CertificateDer::pem_file_iter(&t.cert)
            .and_then(Iterator::collect::<Result<Vec<_>, _>>)
            .with_context(named)?;
        let key = PrivateKeyDer::from_pem_file(&t.key).with_context(named)?;
        let mut cfg = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .with_context(named)?;
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(tokio_rustls::TlsAcceptor::from(Arc::new(cfg)))
    }

    /// The API's routes over `shared`, as served on `addr` (its Host check
    /// depends on whether `addr` is loopback).
    pub fn router(shared: Arc<Shared>, addr: SocketAddr) -> Router {
        Router::new()
            .route("/metrics", get(metrics))
            .route("/api/v1/snapshot", get(snapshot))
            .route("/api/v1/stream", get(stream_frames))
            .route("/api/v1/runs", get(list_runs).post(start_run))
            .route("/api/v1/runs/{id}", get(one_run))
            .route("/api/v1/runs/{id}/stop", post(stop_run))
            .layer(middleware::from_fn_with_state(shared.clone(), authorize))
            // Health answers everyone: supervisors carry no token.
            .route("/healthz", get(healthz))
            // On loopback, a page in a browser may reach us through a name
            // that resolves here (DNS rebinding): only our own names count.
            .layer(middleware::from_fn_with_state(
                (shared.clone(), addr),
                host_is_ours,
            ))
            .with_state(shared)
    }

    /// Lets the process open as many files as its hard limit allows (the
    /// unit's LimitNOFILE): `MAX_CONNECTIONS` sockets beside the probes'.
    fn raise_open_files() {
        use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
        let lim = getrlimit(Resource::Nofile);
        if lim.current < lim.maximum {
            let raised = Rlimit {
                current: lim.maximum,
                maximum: lim.maximum,
            };
            if let Err(e) = setrlimit(Resource::Nofile, raised) {
                log::warn!("raising the open-file limit to its maximum: {e}");
            }
        }
    }

    /// Serves each connection, plain or TLS alike, in one of
    /// `MAX_CONNECTIONS` slots (`conns`): a connection that holds no
    /// request is closed past its deadline, or evicted when a new one
    /// needs its slot, so connections that never speak neither stay nor
    /// keep real requests out.
    async fn accept_loop(
        listener: tokio::net::TcpListener,
        tls: Option<tokio_rustls::TlsAcceptor>,
        app: Router,
        shared: Arc<Shared>,
    ) {
        use std::sync::atomic::Ordering::Relaxed;
        let mut http = hyper::server::conn::http1::Builder::new();
        // A backstop only: the slots' sweep closes a connection waiting
        // for its headers first, and counts it.
        http.timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(conns::IDLE_DEADLINE * 2);
        tokio::spawn(sweep(shared.clone()));
        let first = match tls {
            Some(_) => Waiting::Handshake,
            None => Waiting::Headers,
        };
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors, most likely: back off, do not spin.
                    log::debug!("HTTP API: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Some(admitted) = shared.slots.admit(first, Instant::now()) else {
                shared.refused.connections.fetch_add(1, Relaxed);
                drop(stream);
                continue;
            };
            if admitted.evicted {
                shared.refused.connections.fetch_add(1, Relaxed);
            }
            let conn = Connection {
                slot: Arc::new(admitted.slot),
                app: app.clone(),
                http: http.clone(),
            };
            let tls = tls.clone();
            tokio::spawn(async move {
                tokio::select! {
                    _ = admitted.closed => {}
                    () = conn.serve(stream, tls) => {}
                }
            });
        }
    }

    /// Closes connections past their deadline every 100 ms, and says in
    /// the log, at most every 10 s, what a flood made it close: evictions,
    /// refusals, and connections that never sent a request in time.
    async fn sweep(shared: Arc<Shared>) {
        const SAY_EVERY: Duration = Duration::from_secs(10);
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        let mut said = Flooded::of(&shared);
        let mut last_said = Instant::now();
        loop {
            tick.tick().await;
            let now = Instant::now();
            shared.slots.sweep(now);
            if now.duration_since(last_said) < SAY_EVERY {
                continue;
            }
            let seen = Flooded::of(&shared);
            if seen != said {
                let open = shared.slots.open();
                log::warn!(
                    "HTTP API under a connection flood: in the last {}s {} connections evicted \
                     for new ones, {} closed before their first request was due, {} turned \
                     away in all; {open} of {} open, a connection may now wait {:?} for a request",
                    now.duration_since(last_said).as_secs(),
                    seen.evicted - said.evicted,
                    seen.unheard - said.unheard,
                    seen.turned_away - said.turned_away,
                    shared.slots.cap(),
                    conns::deadline(open, shared.slots.cap()),
                );
                said = seen;
            }
            last_said = now;
        }
    }

    /// What a flood makes the API close, so far.
    #[derive(Clone, Copy, PartialEq, Eq)]
    struct Flooded {
        evicted: u64,
        unheard: u64,
        turned_away: u64,
    }

    impl Flooded {
        fn of(s: &Shared) -> Self {
            Self {
                evicted: s.slots.closed.evicted(),
                unheard: s.slots.closed.timed_out_unheard(),
                turned_away: s
                    .refused
                    .connections
                    .load(std::sync::atomic::Ordering::Relaxed),
            }
        }
    }

    /// One connection: its slot, the routes, the HTTP server.
    struct Connection {
        slot: Arc<conns::Slot>,
        app: Router,
        http: hyper::server::conn::http1::Builder,
    }

    impl Connection {
        async fn serve(
            self,
            stream: tokio::net::TcpStream,
            tls: Option<tokio_rustls::TlsAcceptor>,
        ) {
            // Nothing is kept for a connection before it speaks (the TLS
            // state, the HTTP server and its buffers, boxed apart from
            // this task): a flood that never does costs the agent little
            // more than its sockets. A peek, not `readable`, which a new
            // socket passes at once.
            if !matches!(stream.peek(&mut [0u8; 1]).await, Ok(1)) {
                return;
            }
            Box::pin(self.speak(stream, tls)).await;
        }

        async fn speak(
            self,
            stream: tokio::net::TcpStream,
            tls: Option<tokio_rustls::TlsAcceptor>,
        ) {
            let routes = Answering {
                app: self.app,
                slot: self.slot.clone(),
            };
            let Some(tls) = tls else {
                let _ = self
                    .http
                    .serve_connection(TokioIo::new(stream), routes)
                    .await;
                return;
            };
            match tls.accept(stream).await {
                Ok(stream) => {
                    self.slot.handshaken(Instant::now());
                    let _ = self
                        .http
                        .serve_connection(TokioIo::new(stream), routes)
                        .await;
                }
                Err(e) => log::debug!("HTTP API: TLS handshake: {e}"),
            }
        }
    }

    /// The routes, holding the connection's slot busy from a request's
    /// headers until its response has been sent whole.
    struct Answering {
        app: Router,
        slot: Arc<conns::Slot>,
    }

    impl hyper::service::Service<hyper::Request<hyper::body::Incoming>> for Answering {
        type Response = hyper::Response<Answered>;
        type Error = Infallible;
        type Future = std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<Self::Response, Infallible>> + Send>,
        >;

        fn call(&self, req: hyper::Request<hyper::body::Incoming>) -> Self::Future {
            use tower_service::Service as _;
            let busy = self.slot.busy();
            let mut app = self.app.clone();
            Box::pin(async move {
                let resp = app.call(req).await?;
                Ok(resp.map(|body| Answered { body, _busy: busy }))
            })
        }
    }

    /// A response's body, and the connection's busy mark until it is sent
    /// (or the connection drops it).
    struct Answered {
        body: axum::body::Body,
        _busy: conns::Busy,
    }

    impl hyper::body::Body for Answered {
        type Data = axum::body::Bytes;
        type Error = axum::Error;

        fn poll_frame(
            self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
            std::pin::Pin::new(&mut self.get_mut().body).poll_frame(cx)
        }

        fn is_end_stream(&self) -> bool {
            self.body.is_end_stream()
        }

        fn size_hint(&self) -> hyper::body::SizeHint {
            self.body.size_hint()
        }
    }

    /// `localhost`, or a loopback address, with or without a port; nothing
    /// else (a bracket left open, a port that is not a number).
    pub(super) fn host_is_loopback(host: &str) -> bool {
        let (name, rest) = match host.strip_prefix('[') {
            Some(r) => match r.split_once(']') {
                Some(parts) => parts,
                None => return false,
            },
            None => host.split_at(host.find(':').unwrap_or(host.len())),
        };
        let port_ok = rest.is_empty()
            || rest
                .strip_prefix(':')
                .is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
        port_ok
            && (name.eq_ignore_ascii_case("localhost")
                || name
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback()))
    }

    /// On a loopback address, the Host header must name it (`127.0.0.1`,
    /// `localhost`, `[::1]`, with or without the port).
    async fn host_is_ours(
        State((s, addr)): State<(Arc<Shared>, SocketAddr)>,
        headers: HeaderMap,
        req: axum::extract::Request,
        next: Next,
    ) -> Response {
        if !addr.ip().is_loopback() {
            return next.run(req).await;
        }
        // A Host that is not plain text is no name of ours either.
        let host = match headers.get(header::HOST).map(|v| v.to_str()) {
            None => "",
            Some(Ok(h)) => h,
            Some(Err(_)) => "\u{fffd}",
        };
        if host.is_empty() || host_is_loopback(host) {
            return next.run(req).await;
        }
        s.refused
            .bad_requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        (
            StatusCode::FORBIDDEN,
            format!("Host {host:?} is not this agent's loopback address\n"),
        )
            .into_response()
    }

    async fn authorize(
        State(s): State<Arc<Shared>>,
        headers: HeaderMap,
        req: axum::extract::Request,
        next: Next,
    ) -> Response {
        use super::Access;
        let changes = !matches!(*req.method(), Method::GET | Method::HEAD);
        let needed = match &s.access {
            Access::Open => None,
            Access::Token(t) => Some(t),
            Access::TokenToChange(t) => changes.then_some(t),
        };
        if let Some(token) = needed {
            let given = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            // In time that does not depend on where they differ.
            if !given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(token.as_bytes()))) {
                s.refused
                    .unauthorized
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let hint = match &s.access {
                    Access::TokenToChange(_) => {
                        "starting and stopping runs needs the agent's token: send \
                         \"Authorization: Bearer TOKEN\" with the token from its api.token_file \
                         (/var/lib/iospan/api-token by default, root's)\n"
                    }
                    _ => "send the agent's api.token as \"Authorization: Bearer TOKEN\"\n",
                };
                return (StatusCode::UNAUTHORIZED, hint).into_response();
            }
        }
        next.run(req).await
    }

    async fn metrics(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
        s.wanted.store(true, std::sync::atomic::Ordering::Relaxed);
        let accept = headers
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let f = Format::from_accept(accept);
        let text = match f {
            Format::Prometheus => &s.prometheus,
            Format::OpenMetrics => &s.openmetrics,
        };
        let mut body = text.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut ours = s.api_exposition(f);
        if let Some(frame) = current(&s) {
            crate::output::metrics::diagnoses(&mut ours, f, &frame.diagnoses);
        }
        // OpenMetrics ends with `# EOF`: the API's own lines go before it.
        match body.strip_suffix("# EOF\n") {
            Some(head) => body = format!("{head}{ours}# EOF\n"),
            None => body.push_str(&ours),
        }
        ([(header::CONTENT_TYPE, f.content_type())], body).into_response()
    }

    fn current(s: &Shared) -> Option<Arc<Frame>> {
        s.frames.borrow().clone()
    }

    async fn healthz(State(s): State<Arc<Shared>>) -> Response {
        match current(&s) {
            Some(_) => (StatusCode::OK, "ok\n").into_response(),
            None => (StatusCode::SERVICE_UNAVAILABLE, "probes not attached yet\n").into_response(),
        }
    }

    async fn snapshot(State(s): State<Arc<Shared>>) -> Response {
        match current(&s) {
            Some(f) => Json(f.as_ref().clone()).into_response(),
            None => (StatusCode::SERVICE_UNAVAILABLE, "no figures yet\n").into_response(),
        }
    }

    /// Frames as server-sent events, while one of `MAX_STREAMS` places is
    /// free: each stream keeps its connection busy for as long as it runs.
    async fn stream_frames(State(s): State<Arc<Shared>>) -> Response {
        let Ok(place) = s.streams.clone().try_acquire_owned() else {
            s.refused
                .streams
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "{MAX_STREAMS} frame streams are open, the most served at once: try again\n"
                ),
            )
                .into_response();
        };
        let mut rx = s.frames.subscribe();
        rx.mark_changed();
        let frames = stream::unfold((rx, place), |(mut rx, place)| async move {
            loop {
                rx.changed().await.ok()?;
                let frame = rx.borrow_and_update().clone();
                if let Some(f) = frame {
                    let ev = match serde_json::to_string(f.as_ref()) {
                        Ok(json) => Event::default().event("frame").data(json),
                        Err(e) => Event::default().comment(format!("unencodable frame: {e}")),
                    };
                    return Some((Ok::<_, Infallible>(ev), (rx, place)));
                }
            }
        });
        Sse::new(frames)
            .keep_alive(KeepAlive::default())
            .into_response()
    }

    /// The next frame with QEMU's own counters beside it. Asked for anew
    /// at each try: a frame may take the ask and be published before the
    /// try subscribes (a second tick's frame under way), or be replaced by
    /// a later frame before the try reads it.
    async fn fresh_with_qemu(s: &Shared) -> Option<Arc<Frame>> {
        for _ in 0..3 {
            let f = fresh(s, true).await?;
            if f.qemu.is_some() {
                return Some(f);
            }
        }
        s.qemu_wanted
            .store(false, std::sync::atomic::Ordering::Relaxed);
        fresh(s, false).await
    }

    /// The next frame made after this call, asked for now: a run's edges
    /// are never earlier than the request that set them. The ask for
    /// QEMU's counters follows the subscription, so the frame that takes
    /// it is one this call sees.
    async fn fresh(s: &Shared, with_qemu: bool) -> Option<Arc<Frame>> {
        let mut rx = s.frames.subscribe();
        rx.borrow_and_update();
        if with_qemu {
            s.qemu_wanted
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        s.frame_asked.notify_one();
        tokio::time::timeout(Duration::from_secs(5), rx.changed())
            .await
            .ok()?
            .ok()?;
        let f = rx.borrow().clone();
        f
    }

    /// Waits for a look at the wanted tier that began after the call: the
    /// one under way may have read the tier before it was asked. False
    /// when none comes within 5 s (the agent's loop is stalled).
    async fn tier_looked_since(s: &Shared) -> bool {
        let mut rx = s.tier_looks.subscribe();
        let from = *rx.borrow_and_update();
        tokio::time::timeout(
            Duration::from_secs(5),
            rx.wait_for(|n| n.wrapping_sub(from) >= 2),
        )
        .await
        .is_ok_and(|r| r.is_ok())
    }

    #[derive(serde::Deserialize)]
    struct StartQuery {
        label: Option<String>,
        /// `always-on` (the default) or `deep`.
        tier: Option<String>,
    }

    async fn start_run(State(s): State<Arc<Shared>>, Query(q): Query<StartQuery>) -> Response {
        use std::sync::atomic::Ordering::Relaxed;
        let label = q.label.unwrap_or_default();
        if label.len() > MAX_LABEL || label.chars().any(crate::model::text::hidden) {
            s.refused.bad_requests.fetch_add(1, Relaxed);
            return (
                StatusCode::BAD_REQUEST,
                format!(
                    "label: at most {MAX_LABEL} bytes, no control characters or \
                     bidirectional overrides\n"
                ),
            )
                .into_response();
        }
        let tier = match q.tier.as_deref().map(str::parse::<crate::model::Tier>) {
            None => crate::model::Tier::AlwaysOn,
            Some(Ok(t)) => t,
            Some(Err(e)) => {
                s.refused.bad_requests.fetch_add(1, Relaxed);
                return (StatusCode::BAD_REQUEST, format!("tier: {e}\n")).into_response();
            }
        };
        // The deep tier is attached before the run's first figures, and
        // before the run is answered: a VM its caller starts next is then
        // followed from its exec by the deep tier's probes. The agent
        // switches at its next look (within 100 ms); the figures come at
        // the next frame.
        let deep = DeepGuard::new(&s, tier);
        if tier.is_deep() && !tier_looked_since(&s).await {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                "the agent did not look at the deep tier within 5 s: try again\n",
            )
                .into_response();
        }
        let Some(start) = fresh_with_qemu(&s).await else {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                "no figures yet: the probes are not attached\n",
            )
                .into_response();
        };
        let mut runs = s.runs.lock().unwrap_or_else(|p| p.into_inner());
        if runs.len() >= MAX_RUNS {
            match runs.iter().position(|r| r.stopped_s.is_some()) {
                Some(i) => {
                    runs.remove(i);
                    s.refused.runs_evicted.fetch_add(1, Relaxed);
                }
                None => {
                    s.refused.runs.fetch_add(1, Relaxed);
                    return (
                        StatusCode::TOO_MANY_REQUESTS,
                        format!("{MAX_RUNS} runs are running: stop one first\n"),
                    )
                        .into_response();
                }
            }
        }
        let run = BenchRun {
            id: runs.last().map_or(1, |r| r.id + 1),
            label,
            tier,
            started_s: start.at_s,
            stopped_s: None,
            start,
            report: None,
        };
        runs.push(run.clone());
        deep.keep();
        (StatusCode::CREATED, Json(run)).into_response()
    }

    /// A deep run's hold on the deep tier: let go if the run does not
    /// start, kept (until it stops) if it does.
    struct DeepGuard<'a> {
        s: &'a Shared,
        deep: bool,
    }

    impl<'a> DeepGuard<'a> {
        fn new(s: &'a Shared, tier: crate::model::Tier) -> Self {
            let deep = tier.is_deep();
            if deep {
                s.deep_runs
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            Self { s, deep }
        }

        fn keep(mut self) {
            self.deep = false;
        }
    }

    impl Drop for DeepGuard<'_> {
        fn drop(&mut self) {
            if self.deep {
                self.s
                    .deep_runs
                    .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
    }

    async fn stop_run(State(s): State<Arc<Shared>>, Path(id): Path<u64>) -> Response {
        let Some(end) = fresh_with_qemu(&s).await else {
            return (StatusCode::SERVICE_UNAVAILABLE, "the probes have stopped\n").into_response();
        };
        let mut runs = s.runs.lock().unwrap_or_else(|p| p.into_inner());
        let Some(run) = runs.iter_mut().find(|r| r.id == id) else {
            return (StatusCode::NOT_FOUND, format!("no run {id}\n")).into_response();
        };
        if run.stopped_s.is_some() {
            return (
                StatusCode::CONFLICT,
                format!("run {id} has already stopped\n"),
            )
                .into_response();
        }
        run.stopped_s = Some(end.at_s);
        run.report = Some(bench_report(&run.start, &end));
        if run.tier.is_deep() {
            s.deep_runs
                .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
        Json(run.clone()).into_response()
    }

    async fn list_runs(State(s): State<Arc<Shared>>) -> Response {
        Json(s.runs.lock().unwrap_or_else(|p| p.into_inner()).clone()).into_response()
    }

    async fn one_run(State(s): State<Arc<Shared>>, Path(id): Path<u64>) -> Response {
        let runs = s.runs.lock().unwrap_or_else(|p| p.into_inner());
        match runs.iter().find(|r| r.id == id) {
            Some(r) => Json(r.clone()).into_response(),
            None => (StatusCode::NOT_FOUND, format!("no run {id}\n")).into_response(),
        }
    }
}

#[cfg(all(test, feature = "serve"))]
mod tests {
    #[test]
    fn the_apis_counters_are_named_as_the_runs_in_each_format() {
        use crate::output::metrics::Format;
        let r = super::Refused::default();
        r.connections
            .fetch_add(3, std::sync::atomic::Ordering::Relaxed);
        let prom = r.exposition(Format::Prometheus);
        assert!(
            prom.contains("# TYPE iospan_api_refused_total counter\n"),
            "{prom}"
        );
        assert!(
            prom.contains("iospan_api_refused_total{reason=\"connections\"} 3\n"),
            "{prom}"
        );
        // OpenMetrics names the family without the samples' `_total`.
        let om = r.exposition(Format::OpenMetrics);
        assert!(om.contains("# TYPE iospan_api_refused counter\n"), "{om}");
        assert!(
            om.contains("iospan_api_refused_total{reason=\"runs\"} 0\n"),
            "{om}"
        );
    }

    #[test]
    fn only_loopback_names_pass_the_host_check() {
        for ok in [
            "127.0.0.1",
            "127.0.0.1:9464",
            "localhost:9464",
            "LOCALHOST",
            "[::1]:9464",
            "[::1]",
            "127.1.2.3:80",
        ] {
            assert!(super::server::host_is_loopback(ok), "{ok}");
        }
        for bad in [
            "evil.example:9464",
            "127.0.0.1.evil.example",
            "10.0.0.1:9464",
            "[::2]:9464",
            "localhost.evil:1",
            "[::1",
            "[::1]x",
            "localhost:",
            "localhost:80x",
            "::1",
        ] {
            assert!(!super::server::host_is_loopback(bad), "{bad}");
        }
    }
}

#[cfg(test)]
mod qemu_tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::{
        discover::qemu_counts::DiskCounts,
        model::{Hist, Op},
        output::live::FrameQemu,
    };

    fn frame(at_s: f64, ios: u64, inflight: u64, qemu_ops: Option<u64>) -> Frame {
        let mut segs = BTreeMap::new();
        let mut h = Hist::fine();
        for _ in 0..ios {
            h.record(100_000);
        }
        segs.insert("total".to_string(), h);
        Frame {
            at_s,
            vdisks: vec![Row {
                vm: "db01".into(),
                disk: "vd0".into(),
                queue: None,
                op: Op::Read,
                ios,
                bytes: ios * 4096,
                inflight,
                undelivered: 0,
                guest_observed: false,
                segs,
            }],
            qemu: qemu_ops.map(|ops| {
                BTreeMap::from([(
                    "db01".to_string(),
                    FrameQemu {
                        source: "QMP at /run/q.sock".into(),
                        counts: BTreeMap::from([(
                            "vd0".to_string(),
                            DiskCounts {
                                rd_ops: ops,
                                rd_ns: ops * 90_000,
                                ..Default::default()
                            },
                        )]),
                        ..Default::default()
                    },
                )])
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_run_puts_qemus_count_beside_each_vm_disk() {
        // Ours: 1,000 over the run; QEMU's: 996, 4 in flight at its end.
        let r = bench_report(
            &frame(1.0, 500, 2, Some(498)),
            &frame(3.0, 1500, 4, Some(1494)),
        );
        let q = r.entries[0].qemu.as_ref().expect("compared");
        assert_eq!(
            (q.ops, q.iospan_ops, q.diff, q.edge_allowance),
            (996, 1000, 4, 6)
        );
        assert!(!q.mismatch);
        assert_eq!(q.mean_us, Some(90.0));
        assert_eq!(r.qemu_counts["db01"], "QMP at /run/q.sock");
        // Beyond the requests in flight at the edges: flagged.
        let r = bench_report(
            &frame(1.0, 500, 0, Some(498)),
            &frame(3.0, 1500, 0, Some(1400)),
        );
        assert!(r.entries[0].qemu.as_ref().unwrap().mismatch);
        // Without QEMU's counters at both ends: nothing beside it.
        let r = bench_report(&frame(1.0, 500, 0, None), &frame(3.0, 1500, 0, Some(1400)));
        assert!(r.entries[0].qemu.is_none() && r.qemu_counts.is_empty());
    }
}
