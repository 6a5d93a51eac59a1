//! The agent's HTTP API (axum), for `iospan run --metrics-listen` and the
//! `iospan agent` service.
//!
//! `/metrics` (Prometheus text or OpenMetrics),
//! `/healthz`, `/api/v1/snapshot` (the current frame, JSON),
//! `/api/v1/stream` (frames as server-sent events, for `top --connect`),
//! `/api/v1/runs` (labelled benchmark runs: start, stop, report).

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
    /// The current frame (cumulative figures).
    pub frames: watch::Sender<Option<Arc<Frame>>>,
    #[cfg_attr(not(feature = "serve"), allow(dead_code))]
    runs: Mutex<Vec<BenchRun>>,
    /// Clients must send `Authorization: Bearer TOKEN` when set.
    #[cfg_attr(not(feature = "serve"), allow(dead_code))]
    token: Option<String>,
}

impl Shared {
    pub fn new(token: Option<String>) -> Arc<Self> {
        Arc::new(Self {
            prometheus: Mutex::new(String::new()),
            openmetrics: Mutex::new(String::new()),
            wanted: AtomicBool::new(true),
            frames: watch::channel(None).0,
            runs: Mutex::new(Vec::new()),
            token,
        })
    }
}

/// A labelled benchmark run: the figures between its start and its stop.
#[derive(Clone, Debug, Serialize)]
pub struct BenchRun {
    pub id: u64,
    pub label: String,
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
    /// Losses counted during the run.
    pub lost: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchEntry {
    #[serde(skip_serializing_if = "String::is_empty")]
    pub vm: String,
    pub disk: String,
    pub op: crate::model::Op,
    pub ios: u64,
    pub bytes: u64,
    pub iops: f64,
    /// Whether `segments.total` is guest-observed (guest agent) or the host
    /// window.
    pub guest_observed: bool,
    pub segments: BTreeMap<String, Summary>,
}

/// The figures of `end` less those of `start`.
pub fn bench_report(start: &Frame, end: &Frame) -> BenchReport {
    let seconds = (end.at_s - start.at_s).max(1e-9);
    let side = |rows: &[Row], before: &[Row]| -> Vec<BenchEntry> {
        rows.iter()
            .map(|r| {
                let d = r.since(before.iter().find(|b| b.same(r)));
                BenchEntry {
                    vm: d.vm,
                    disk: d.disk,
                    op: d.op,
                    ios: d.ios,
                    bytes: d.bytes,
                    iops: d.ios as f64 / seconds,
                    guest_observed: d.guest_observed,
                    segments: d
                        .segs
                        .iter()
                        .map(|(k, h)| (k.clone(), h.summary()))
                        .collect(),
                }
            })
            .filter(|e| e.ios > 0)
            .collect()
    };
    BenchReport {
        seconds,
        entries: side(&end.vdisks, &start.vdisks),
        disks: side(&end.disks, &start.disks),
        lost: end.lost.saturating_sub(start.lost),
    }
}

#[cfg(feature = "serve")]
pub use server::serve;

#[cfg(feature = "serve")]
mod server {
    use std::{convert::Infallible, net::SocketAddr, sync::Arc, time::Duration};

    use anyhow::{Context, Result};
    use axum::{
        extract::{Path, Query, State},
        http::{header, HeaderMap, StatusCode},
        middleware::{self, Next},
        response::{
            sse::{Event, KeepAlive, Sse},
            IntoResponse, Response,
        },
        routing::{get, post},
        Json, Router,
    };
    use futures_util::stream::{self, Stream};

    use super::{bench_report, BenchRun, Shared};
    use crate::{output::live::Frame, output::metrics::Format};

    /// Binds `addr` and serves in the background, over TLS when `tls`
    /// names a certificate and key.
    pub async fn serve(
        addr: SocketAddr,
        tls: Option<&crate::cmd::config::Tls>,
        shared: Arc<Shared>,
    ) -> Result<()> {
        // Bound here, not in the background: a taken port fails the start.
        let listener = std::net::TcpListener::bind(addr)
            .with_context(|| format!("binding the HTTP API to {addr}"))?;
        listener.set_nonblocking(true).context("the API's socket")?;
        let app = Router::new()
            .route("/metrics", get(metrics))
            .route("/api/v1/snapshot", get(snapshot))
            .route("/api/v1/stream", get(stream_frames))
            .route("/api/v1/runs", get(list_runs).post(start_run))
            .route("/api/v1/runs/{id}", get(one_run))
            .route("/api/v1/runs/{id}/stop", post(stop_run))
            .layer(middleware::from_fn_with_state(shared.clone(), authorize))
            // Health answers everyone: supervisors carry no token.
            .route("/healthz", get(healthz))
            .with_state(shared);
        match tls {
            Some(t) => {
                crate::cmd::tls::install_provider();
                let cfg = axum_server::tls_rustls::RustlsConfig::from_pem_file(&t.cert, &t.key)
                    .await
                    .with_context(|| {
                        format!(
                            "api.tls_cert = {}, api.tls_key = {}: PEM certificate chain and \
                             private key",
                            t.cert.display(),
                            t.key.display()
                        )
                    })?;
                let server =
                    axum_server::from_tcp_rustls(listener, cfg).context("the API's socket")?;
                tokio::spawn(async move {
                    if let Err(e) = server.serve(app.into_make_service()).await {
                        log::warn!("HTTP API stopped: {e}");
                    }
                });
            }
            None => {
                let listener =
                    tokio::net::TcpListener::from_std(listener).context("the API's socket")?;
                tokio::spawn(async move {
                    if let Err(e) = axum::serve(listener, app).await {
                        log::warn!("HTTP API stopped: {e}");
                    }
                });
            }
        }
        Ok(())
    }

    async fn authorize(
        State(s): State<Arc<Shared>>,
        headers: HeaderMap,
        req: axum::extract::Request,
        next: Next,
    ) -> Response {
        if let Some(token) = &s.token {
            let given = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            if !given.is_some_and(|g| same(g.as_bytes(), token.as_bytes())) {
                return (
                    StatusCode::UNAUTHORIZED,
                    "send the agent's api.token as \"Authorization: Bearer TOKEN\"\n",
                )
                    .into_response();
            }
        }
        next.run(req).await
    }

    /// Equal, in time that does not depend on where they differ.
    fn same(a: &[u8], b: &[u8]) -> bool {
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
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
        let body = text.lock().unwrap_or_else(|p| p.into_inner()).clone();
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

    async fn stream_frames(
        State(s): State<Arc<Shared>>,
    ) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
        let mut rx = s.frames.subscribe();
        rx.mark_changed();
        let frames = stream::unfold(rx, |mut rx| async move {
            loop {
                rx.changed().await.ok()?;
                let frame = rx.borrow_and_update().clone();
                if let Some(f) = frame {
                    let ev = match serde_json::to_string(f.as_ref()) {
                        Ok(json) => Event::default().event("frame").data(json),
                        Err(e) => Event::default().comment(format!("unencodable frame: {e}")),
                    };
                    return Some((Ok(ev), rx));
                }
            }
        });
        Sse::new(frames).keep_alive(KeepAlive::default())
    }

    /// The next frame made after this call: a run's edges are never
    /// earlier than the request that set them.
    async fn fresh(s: &Shared) -> Option<Arc<Frame>> {
        let mut rx = s.frames.subscribe();
        rx.borrow_and_update();
        tokio::time::timeout(Duration::from_secs(5), rx.changed())
            .await
            .ok()?
            .ok()?;
        let f = rx.borrow().clone();
        f
    }

    #[derive(serde::Deserialize)]
    struct StartQuery {
        label: Option<String>,
    }

    async fn start_run(State(s): State<Arc<Shared>>, Query(q): Query<StartQuery>) -> Response {
        let Some(start) = fresh(&s).await else {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                "no figures yet: the probes are not attached\n",
            )
                .into_response();
        };
        let mut runs = s.runs.lock().unwrap_or_else(|p| p.into_inner());
        let run = BenchRun {
            id: runs.len() as u64 + 1,
            label: q.label.unwrap_or_default(),
            started_s: start.at_s,
            stopped_s: None,
            start,
            report: None,
        };
        runs.push(run.clone());
        (StatusCode::CREATED, Json(run)).into_response()
    }

    async fn stop_run(State(s): State<Arc<Shared>>, Path(id): Path<u64>) -> Response {
        let Some(end) = fresh(&s).await else {
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
