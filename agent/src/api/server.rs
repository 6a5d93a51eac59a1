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
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use bytes::Bytes;
use futures_util::{stream, StreamExt};

use super::{
    bench_report,
    conns::{self, Peer, Waiting},
    BenchRun, Shared, MAX_CONNECTIONS, MAX_LABEL, MAX_RUNS, MAX_STREAMS, MAX_STREAMS_A_PEER,
};
use crate::{output::live::Frame, output::metrics::Format};
use hyper_util::rt::TokioIo;
use subtle::ConstantTimeEq;

/// Binds `addr` and serves in the background, over TLS when `tls`
/// names a certificate and key.
pub async fn serve(addr: SocketAddr, tls: Option<&super::Tls>, shared: Arc<Shared>) -> Result<()> {
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
fn acceptor(t: &super::Tls) -> Result<tokio_rustls::TlsAcceptor> {
    use rustls::pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer};
    super::tls::install_provider();
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
    // for its headers first, and counts it. A request's head is at most
    // `MAX_HEAD` (hyper's own default, ~400 KiB, times the slots would be
    // gigabytes of half-sent heads).
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(conns::IDLE_DEADLINE * 2)
        .max_buf_size(MAX_HEAD)
        .max_headers(MAX_HEADERS);
    tokio::spawn(sweep(shared.clone()));
    let first = match tls {
        Some(_) => Waiting::Handshake,
        None => Waiting::Headers,
    };
    loop {
        let (stream, client) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors, most likely: back off, do not spin.
                log::debug!("HTTP API: accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let peer = stream
            .local_addr()
            .map_or(super::peer::Peer::Addr(client.ip()), |local| {
                super::peer::of(client, local)
            });
        let Some(admitted) = shared.slots.admit(first, Instant::now(), peer) else {
            shared.refused.connections.fetch_add(1, Relaxed);
            drop(stream);
            continue;
        };
        if admitted.evicted {
            shared.refused.connections.fetch_add(1, Relaxed);
        }
        let conn = Connection {
            slot: Arc::new(admitted.slot),
            slots: shared.slots.clone(),
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

/// A request's head (its line and headers), at most: a real client's
/// with its token is under 1 KiB.
const MAX_HEAD: usize = 16 << 10;
const MAX_HEADERS: usize = 64;

/// One connection: its slot, the routes, the HTTP server.
struct Connection {
    slot: Arc<conns::Slot>,
    slots: Arc<conns::Slots>,
    app: Router,
    http: hyper::server::conn::http1::Builder,
}

impl Connection {
    async fn serve(self, stream: tokio::net::TcpStream, tls: Option<tokio_rustls::TlsAcceptor>) {
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

    async fn speak(self, stream: tokio::net::TcpStream, tls: Option<tokio_rustls::TlsAcceptor>) {
        let stream = super::io::Watched::new(stream, self.slot.stall.clone(), self.slots);
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

    fn call(&self, mut req: hyper::Request<hyper::body::Incoming>) -> Self::Future {
        use tower_service::Service as _;
        let busy = self.slot.busy();
        req.extensions_mut().insert(self.slot.peer);
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
    // The run's exposition is the last refresh's, shared by every scrape;
    // only the API's own few lines are this request's.
    let run = text.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut ours = s.api_exposition(f);
    if let Some(frame) = current(&s) {
        crate::output::metrics::diagnoses(&mut ours, f, &frame.diagnoses);
    }
    // OpenMetrics ends with `# EOF`: the API's own lines go before it.
    const EOF: &[u8] = b"# EOF\n";
    let (head, tail) = match run.strip_suffix(EOF) {
        Some(head) => (run.slice(..head.len()), Bytes::from_static(EOF)),
        None => (run, Bytes::new()),
    };
    let chunks = [head, Bytes::from(ours), tail].map(Ok::<_, Infallible>);
    (
        [(header::CONTENT_TYPE, f.content_type())],
        axum::body::Body::from_stream(stream::iter(chunks)),
    )
        .into_response()
}

/// A body of shared bytes as JSON.
fn json_body(json: Bytes) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], json).into_response()
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
        Some(f) => json_body(s.frame_json.of(&f)),
        None => (StatusCode::SERVICE_UNAVAILABLE, "no figures yet\n").into_response(),
    }
}

/// A stream's place, given back when the stream ends: one of
/// `MAX_STREAMS`, and one of its peer's `MAX_STREAMS_A_PEER`.
struct StreamPlace {
    _place: tokio::sync::OwnedSemaphorePermit,
    peer: Peer,
    of: Arc<std::sync::Mutex<std::collections::HashMap<Peer, usize>>>,
}

impl StreamPlace {
    fn take(s: &Shared, peer: Peer) -> Result<Self, String> {
        let mut of = s.streams_of.lock().unwrap_or_else(|p| p.into_inner());
        let mine = of.entry(peer).or_default();
        // Root, who could stop the agent anyway, has no share to keep to.
        if *mine >= MAX_STREAMS_A_PEER && peer != Peer::Uid(0) {
            return Err(format!(
                "{MAX_STREAMS_A_PEER} frame streams of yours are open, the most served to one \
                 user or address: close one\n"
            ));
        }
        let place = s.streams.clone().try_acquire_owned().map_err(|_| {
            format!("{MAX_STREAMS} frame streams are open, the most served at once: try again\n")
        })?;
        *mine += 1;
        Ok(Self {
            _place: place,
            peer,
            of: s.streams_of.clone(),
        })
    }
}

impl Drop for StreamPlace {
    fn drop(&mut self) {
        let mut of = self.of.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = of.get_mut(&self.peer) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                of.remove(&self.peer);
            }
        }
    }
}

/// How often a quiet stream says it is alive (an SSE comment).
const STREAM_KEEP_ALIVE: Duration = Duration::from_secs(15);

/// Frames as server-sent events (`event: frame`, the frame's JSON as its
/// data), while a place is free: each stream keeps its connection busy for
/// as long as it runs. Every stream sends the same rendering of a frame.
async fn stream_frames(
    State(s): State<Arc<Shared>>,
    peer: Option<axum::Extension<Peer>>,
) -> Response {
    let peer = peer.map_or(Peer::Uid(u32::MAX), |p| p.0);
    let place = match StreamPlace::take(&s, peer) {
        Ok(p) => p,
        Err(why) => {
            s.refused
                .streams
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return (StatusCode::SERVICE_UNAVAILABLE, why).into_response();
        }
    };
    let mut rx = s.frames.subscribe();
    rx.mark_changed();
    let frames = stream::unfold((rx, place, s), |(mut rx, place, s)| async move {
        loop {
            match tokio::time::timeout(STREAM_KEEP_ALIVE, rx.changed()).await {
                Err(_) => return Some((vec![Bytes::from_static(b":\n\n")], (rx, place, s))),
                Ok(r) => r.ok()?,
            }
            let frame = rx.borrow_and_update().clone();
            if let Some(f) = frame {
                let event = vec![
                    Bytes::from_static(b"event: frame\ndata: "),
                    s.frame_json.of(&f),
                    Bytes::from_static(b"\n\n"),
                ];
                return Some((event, (rx, place, s)));
            }
        }
    })
    .flat_map(|chunks| stream::iter(chunks.into_iter().map(Ok::<_, Infallible>)));
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        axum::body::Body::from_stream(frames),
    )
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
    s.runs_json.forget();
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
    s.runs_json.forget();
    if run.tier.is_deep() {
        s.deep_runs
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
    Json(run.clone()).into_response()
}

async fn list_runs(State(s): State<Arc<Shared>>) -> Response {
    // Rendered once until a run starts or stops: a thousand runs' reports
    // are megabytes, not to be made again for every client that asks.
    json_body(s.runs_json.get_or(|| {
        let runs = s.runs.lock().unwrap_or_else(|p| p.into_inner());
        serde_json::to_vec(&*runs).map_or_else(|_| Bytes::from_static(b"[]"), Bytes::from)
    }))
}

async fn one_run(State(s): State<Arc<Shared>>, Path(id): Path<u64>) -> Response {
    let runs = s.runs.lock().unwrap_or_else(|p| p.into_inner());
    match runs.iter().find(|r| r.id == id) {
        Some(r) => Json(r.clone()).into_response(),
        None => (StatusCode::NOT_FOUND, format!("no run {id}\n")).into_response(),
    }
}
