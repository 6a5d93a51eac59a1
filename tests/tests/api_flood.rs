//! The API under a sustained flood from a local user: thousands of
//! connections a second that never send a request (silent, half a request's
//! headers, or a TLS handshake and then nothing), plain and TLS. Every
//! second of the flood a real client asks `/healthz` and an authorised one
//! starts and stops a run: each is answered, within 1 s; the agent's sockets
//! and memory stay bounded; every flood connection is closed by the agent
//! and counted (root: the probes load).

use std::time::{Duration, Instant};

use agent_integration::api::{
    closed_idle, raise_open_files, refused, rss_kib, sample, sockets, start_agent, start_tls_agent,
    tls_client, Client, Flood, FloodCount, Stall,
};

/// Connections the API keeps at once.
const CAP: usize = iospan::api::MAX_CONNECTIONS;
/// How long each flood lasts.
const FLOOD_SECS: u64 = 12;

/// What the real clients met during a flood.
#[derive(Debug, Default)]
struct Met {
    asked: usize,
    /// Requests not answered as they should be, or slower than 1 s.
    failures: Vec<String>,
    slowest: Duration,
    peak_sockets: usize,
    peak_rss_kib: u64,
}

/// Every second until `until`: `/healthz`, then a run started and stopped
/// with `token`, each timed; the agent's sockets sampled.
fn real_clients(client: &Client, port: u16, token: &str, pid: u32, until: Instant) -> Met {
    let mut met = Met::default();
    let mut i = 0;
    while Instant::now() < until {
        let next = Instant::now() + Duration::from_secs(1);
        let mut check = |what: &str, (status, body, took): (u16, String, Duration), want: u16| {
            met.asked += 1;
            met.slowest = met.slowest.max(took);
            if status != want || took > Duration::from_secs(1) {
                met.failures.push(format!(
                    "{what}: {status} after {took:?} (wanted {want}): {body}"
                ));
            }
            body
        };
        check("healthz", client.ask(port, "GET", "/healthz", None), 200);
        let label = format!("/api/v1/runs?label=during-flood-{i}");
        let run = check("start", client.ask(port, "POST", &label, Some(token)), 201);
        let id = serde_json::from_str::<serde_json::Value>(&run)
            .ok()
            .and_then(|v| v["id"].as_u64());
        if let Some(id) = id {
            let stop = format!("/api/v1/runs/{id}/stop");
            check("stop", client.ask(port, "POST", &stop, Some(token)), 200);
        }
        met.peak_sockets = met.peak_sockets.max(sockets(pid));
        met.peak_rss_kib = met.peak_rss_kib.max(rss_kib(pid));
        i += 1;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
    met
}

/// How much the agent may grow, KiB, holding its cap of connections that
/// stall so: a silent one holds its socket and a small task (~2 KiB); one
/// that sent part of a request, the HTTP server's connection and its 8 KiB
/// read and write buffers too (~24 KiB); a TLS one past its handshake, its
/// TLS state besides.
fn most_kib(stall: Stall) -> u64 {
    let per_connection = match stall {
        Stall::Silent => 4,
        Stall::HalfHeaders => 32,
        Stall::AfterHandshake => 48,
    };
    per_connection * CAP as u64
}

/// The floods' connections: what the agent must have closed and counted.
fn total(counts: &[FloodCount]) -> FloodCount {
    counts
        .iter()
        .fold(FloodCount::default(), |a, c| FloodCount {
            opened: a.opened + c.opened,
            failed: a.failed + c.failed,
            closed_by_agent: a.closed_by_agent + c.closed_by_agent,
            outlived_hold: a.outlived_hold + c.outlived_hold,
            most_held: a.most_held + c.most_held,
        })
}

/// Floods `port` with `threads` floods of `rate` connections a second
/// each while real clients ask every second; holds what the agent owes
/// them and the flood. `metrics` reads /metrics after.
fn flooded(
    port: u16,
    pid: u32,
    client: &Client,
    token: &str,
    (stall, rate, threads): (Stall, u32, u32),
    metrics: impl Fn() -> String,
) {
    let (base_sockets, base_rss) = (sockets(pid), rss_kib(pid));
    let before = metrics();
    let tls = match client {
        Client::Tls(cfg) => Some(cfg.clone()),
        Client::Plain => None,
    };
    let floods: Vec<Flood> = (0..threads)
        .map(|_| Flood::start(port, rate, FLOOD_SECS, stall, tls.clone()))
        .collect();
    let until = Instant::now() + Duration::from_secs(FLOOD_SECS);
    let met = real_clients(client, port, token, pid, until);
    let grew = met.peak_rss_kib.max(rss_kib(pid)).saturating_sub(base_rss);
    let flood = total(&floods.into_iter().map(Flood::join).collect::<Vec<_>>());
    let after = metrics();
    let ctx = format!("{stall:?} at {rate}/s × {threads}: {flood:?}; real clients {met:?}");
    eprintln!("{ctx}");
    assert!(met.failures.is_empty(), "{ctx}");
    assert!(met.asked >= 3 * (FLOOD_SECS as usize - 1), "{ctx}");
    // The flood kept its rate (a connect the agent's queue left waiting
    // would have slowed it) ...
    let wanted = u64::from(rate * threads) * FLOOD_SECS;
    assert!(flood.opened * 100 >= wanted * 95, "{ctx}");
    // ... the agent held at most its cap and grew little ...
    assert!(
        met.peak_sockets <= base_sockets + CAP + 16,
        "{} sockets, {base_sockets} before: {ctx}",
        met.peak_sockets
    );
    assert!(
        grew < most_kib(stall),
        "the agent grew by {grew} KiB (at most {} KiB for this flood): {ctx}",
        most_kib(stall)
    );
    // ... and closed every flood connection within the hold, each counted:
    // closed holding no request (evicted or past its deadline), or turned
    // away at once (refusals less the evictions, which both count).
    assert_eq!(flood.outlived_hold, 0, "{ctx}");
    assert_eq!(flood.closed_by_agent, flood.opened, "{ctx}");
    let delta = |f: fn(&str) -> u64| f(&after) - f(&before);
    let evicted = |m: &str| {
        ["handshake", "headers", "kept_alive"]
            .iter()
            .map(|w| {
                sample(
                    m,
                    &format!(
                        "iospan_api_connections_closed_total{{reason=\"evicted\",waiting=\"{w}\"}}"
                    ),
                )
            })
            .sum::<u64>()
    };
    let counted = delta(closed_idle) + delta(|m| refused(m, "connections")) - delta(evicted);
    assert!(
        counted >= flood.opened,
        "the agent counted {counted} of the flood's {} connections: {ctx}",
        flood.opened
    );
}

fn plain_flood(stall: Stall) {
    raise_open_files(16_384);
    let (port, agent) = start_agent();
    let token = std::fs::read_to_string("/var/lib/iospan/api-token").unwrap();
    let metrics = || agent_integration::api::request(port, "GET", "/metrics", "127.0.0.1").1;
    flooded(
        port,
        agent.0.id(),
        &Client::Plain,
        token.trim(),
        (stall, 2200, 1),
        metrics,
    );
}

fn tls_flood(stall: Stall, rate: u32, threads: u32) {
    raise_open_files(16_384);
    let dir = tempfile::tempdir().unwrap();
    let token = "fl00d-token";
    let (port, agent, ca) = start_tls_agent(dir.path(), token);
    let client = Client::Tls(tls_client(&ca));
    let metrics = || {
        let (status, body, _) = client.ask(port, "GET", "/metrics", Some(token));
        assert_eq!(status, 200, "{body}");
        body
    };
    flooded(
        port,
        agent.0.id(),
        &client,
        token,
        (stall, rate, threads),
        metrics,
    );
}

#[test]
fn a_flood_of_silent_connections_leaves_the_plain_api_answering() {
    plain_flood(Stall::Silent);
}

#[test]
fn a_flood_of_half_sent_requests_leaves_the_plain_api_answering() {
    plain_flood(Stall::HalfHeaders);
}

/// Connections that never begin their handshake.
#[test]
fn a_flood_of_silent_connections_leaves_the_tls_api_answering() {
    tls_flood(Stall::Silent, 2200, 1);
}

/// Clients that complete the TLS handshake, then stall: each costs the
/// flood a handshake too, so fewer a second.
#[test]
fn a_flood_of_clients_stalling_after_their_handshake_leaves_the_tls_api_answering() {
    tls_flood(Stall::AfterHandshake, 400, 2);
}

/// A local user holding frame streams open (a connection serving one is
/// never evicted): at most a quarter of the slots go to streams, the rest
/// refused with 503 and counted, and a silent flood beside them still
/// cannot keep a real client out.
#[test]
fn streams_held_open_take_at_most_their_share_of_the_slots() {
    use std::io::{Read, Write};
    raise_open_files(16_384);
    let (port, agent) = start_agent();
    let most = iospan::api::MAX_STREAMS;
    let mut answers = std::collections::BTreeMap::<String, usize>::new();
    let streams: Vec<std::net::TcpStream> = (0..most + 100)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s.write_all(b"GET /api/v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                .unwrap();
            let mut head = [0u8; 12];
            s.read_exact(&mut head).unwrap();
            *answers
                .entry(String::from_utf8_lossy(&head[9..12]).into_owned())
                .or_default() += 1;
            s
        })
        .collect();
    assert_eq!(answers.get("200"), Some(&most), "{answers:?}");
    assert_eq!(answers.get("503"), Some(&100), "{answers:?}");
    let token = std::fs::read_to_string("/var/lib/iospan/api-token").unwrap();
    let metrics = || agent_integration::api::request(port, "GET", "/metrics", "127.0.0.1").1;
    assert_eq!(refused(&metrics(), "streams"), 100);
    flooded(
        port,
        agent.0.id(),
        &Client::Plain,
        token.trim(),
        (Stall::Silent, 2200, 1),
        metrics,
    );
    drop(streams);
}
