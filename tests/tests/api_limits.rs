//! The API under abuse from whoever reaches its port: thousands of
//! half-sent requests, ten thousand runs started, oversized labels, and a
//! Host naming another site (DNS rebinding). Real requests keep answering,
//! memory stays bounded, every refusal is counted (root: the probes load).

use std::{
    io::{ErrorKind, Read, Write},
    net::TcpStream,
    time::{Duration, Instant},
};

use agent_integration::api::{
    bearer, raise_open_files, refused, request, rss_kib, sockets, start_agent, start_tls_agent,
};

#[test]
fn half_open_connections_and_run_floods_leave_the_api_answering_and_bounded() {
    raise_open_files(4096);
    let (port, agent) = start_agent();
    half_open_requests_are_closed(port);
    bad_requests_are_refused(port);
    let too_many = run_floods_are_bounded(port, agent.0.id());
    let (_, metrics) = request(port, "GET", "/metrics", "127.0.0.1");
    assert_eq!(refused(&metrics, "runs"), too_many);
    assert!(refused(&metrics, "bad_request") >= 5);
    assert_eq!(refused(&metrics, "unauthorized"), 1);
}

/// 2,000 requests whose headers never finish: a real one still answers at
/// once, and they are closed at the header deadline.
fn half_open_requests_are_closed(port: u16) {
    let half: Vec<TcpStream> = (0..2000)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                .unwrap();
            s
        })
        .collect();
    let t = Instant::now();
    let (status, _) = request(port, "GET", "/healthz", "127.0.0.1");
    let took = t.elapsed();
    assert_eq!(status, 200);
    assert!(
        took < Duration::from_secs(1),
        "a real request took {took:?} beside 2000 half-open ones"
    );
    // Their headers are due within 5 s: by then the agent closes them.
    let closed = closed_within(&half, DEADLINE + Duration::from_secs(2));
    assert_eq!(
        closed,
        half.len(),
        "half-open connections left open past the header deadline"
    );
    drop(half);
}

/// A label too long, or with a control character; a Host from elsewhere;
/// no token.
fn bad_requests_are_refused(port: u16) {
    let long = "x".repeat(200);
    assert_eq!(
        request(
            port,
            "POST",
            &format!("/api/v1/runs?label={long}"),
            "127.0.0.1"
        )
        .0,
        400
    );
    // Past the HTTP server's own bound on a request line: refused before us.
    let huge = "x".repeat(64 << 10);
    let (status, _) = request(
        port,
        "POST",
        &format!("/api/v1/runs?label={huge}"),
        "127.0.0.1",
    );
    assert!((400..500).contains(&status), "a 64 KiB label: {status}");
    assert_eq!(
        request(port, "POST", "/api/v1/runs?label=a%0Ab", "127.0.0.1").0,
        400
    );
    // A right-to-left override would reorder the label where it is shown.
    assert_eq!(
        request(port, "POST", "/api/v1/runs?label=a%E2%80%AEb", "127.0.0.1").0,
        400
    );
    assert_eq!(request(port, "GET", "/metrics", "rebind.example:80").0, 403);
    // A Host that is not text is not "no Host" (a fuzzing finding).
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: rebind.example\xff\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    assert!(
        out.starts_with(b"HTTP/1.1 403"),
        "{}",
        String::from_utf8_lossy(&out)
    );
    // Without the token, no run starts (and the refusal is counted).
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "POST /api/v1/runs?label=anon HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    assert!(out.starts_with("HTTP/1.1 401"), "{out}");
}

/// 10,000 runs started (none stopped), a thousand at a time: the agent
/// keeps its bound of runs and its memory. The refusals, counted.
fn run_floods_are_bounded(port: u16, pid: u32) -> u64 {
    let before = rss_kib(pid);
    let mut created = 0;
    let mut too_many = 0;
    let auth = bearer();
    for batch in 0..10 {
        let mut socks: Vec<TcpStream> = (0..1000)
            .map(|i| {
                let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                write!(
                    s,
                    "POST /api/v1/runs?label=flood-{batch}-{i} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{auth}Content-Length: 0\r\n\r\n"
                )
                .unwrap();
                s
            })
            .collect();
        for s in &mut socks {
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            match out.split(' ').nth(1) {
                Some("201") => created += 1,
                Some("429") => too_many += 1,
                other => panic!("start run answered {other:?}: {out}"),
            }
        }
    }
    assert_eq!(created + too_many, 10_000);
    assert_eq!(created, 1024, "runs kept: the bound");
    let (_, list) = request(port, "GET", "/api/v1/runs", "127.0.0.1");
    let runs: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert_eq!(runs.as_array().map(Vec::len), Some(1024));
    let grew = rss_kib(pid).saturating_sub(before);
    assert!(
        grew < 64 << 10,
        "10,000 run requests grew the agent by {grew} KiB"
    );
    too_many
}

/// Clients of the frame stream (`top --connect`) that never read: each
/// holds its latest frame and a socket's buffers, not a queue of frames;
/// real requests keep answering and the agent stays small.
#[test]
fn stream_clients_that_never_read_hold_no_queue() {
    raise_open_files(4096);
    let (port, agent) = start_agent();
    let before = rss_kib(agent.0.id());
    let idle: Vec<TcpStream> = (0..1000)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.write_all(
                b"GET /api/v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n",
            )
            .unwrap();
            s
        })
        .collect();
    // Frames go out every second: 15 of them to each client, unread.
    frames_published(port, 15);
    let t = Instant::now();
    let (status, _) = request(port, "GET", "/api/v1/snapshot", "127.0.0.1");
    assert_eq!(status, 200);
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "a snapshot took {:?} beside 1000 stalled streams",
        t.elapsed()
    );
    let grew = rss_kib(agent.0.id()).saturating_sub(before);
    assert!(
        grew < 64 << 10,
        "1000 stalled stream clients grew the agent by {grew} KiB"
    );
    // A reader among them gets the current frame at once.
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /api/v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("event: frame") {
        match s.read(&mut buf) {
            Ok(n) if n > 0 => got.extend_from_slice(&buf[..n]),
            other => panic!(
                "the stream gave no frame: {other:?} {}",
                String::from_utf8_lossy(&got)
            ),
        }
    }
    drop(idle);
}

/// Connections the API keeps at once.
const CAP: usize = iospan::api::MAX_CONNECTIONS;

/// Floods `port` with `CAP + 904` connections that never send a byte,
/// as a scanner or a slow-loris does: the agent holds at most `CAP` of
/// them, closes the rest at once, and the held ones by its deadline
/// (headers for plain HTTP, the handshake for TLS); then it answers
/// again. Returns how many the flood opened.
fn flood_to_the_cap(pid: u32, port: u16) -> usize {
    let n = CAP + 904;
    let base = sockets(pid);
    let held: Vec<TcpStream> = (0..n)
        .map(|i| {
            TcpStream::connect(("127.0.0.1", port))
                .unwrap_or_else(|e| panic!("connection {i} of the flood: {e}"))
        })
        .collect();
    // What it holds once the flood's accepts have been served (the count
    // right after the connects includes accepted ones not yet evicted).
    std::thread::sleep(Duration::from_secs(1));
    let peak = sockets(pid);
    assert!(
        peak <= base + CAP + 16,
        "the agent held {peak} sockets under a flood of {n} ({base} before): its cap is {CAP}"
    );
    let at_once = closed_within(&held, Duration::ZERO);
    assert!(
        at_once >= n - CAP,
        "{at_once} of {n} closed at once: those past the cap of {CAP} stay open"
    );
    let by_deadline = closed_within(&held, DEADLINE + Duration::from_secs(1));
    assert_eq!(by_deadline, n, "connections left open past the deadline");
    n
}

/// The API's deadline for a connection's handshake and request headers
/// (shorter as its slots fill).
const DEADLINE: Duration = Duration::from_secs(5);

/// How many of `held` the agent has closed (EOF, a reset, or a timeout
/// response and EOF) within `within`: waited for, each answering as soon
/// as it is closed.
fn closed_within(held: &[TcpStream], within: Duration) -> usize {
    let until = Instant::now() + within;
    held.iter()
        .filter(|&(mut s)| {
            let left = until.saturating_duration_since(Instant::now());
            s.set_read_timeout(Some(left.max(Duration::from_millis(20))))
                .unwrap();
            let mut b = [0u8; 256];
            match s.read(&mut b) {
                // EOF, or the start of a timeout response (then EOF).
                Ok(n) => n <= b.len(),
                Err(e) => e.kind() == ErrorKind::ConnectionReset,
            }
        })
        .count()
}

/// Waits until the agent has published `n` frames (one a second) from
/// now, read from its snapshot's clock (503 until its first).
fn frames_published(port: u16, n: u32) {
    let at = || -> Option<f64> {
        let (status, body) = request(port, "GET", "/api/v1/snapshot", "127.0.0.1");
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        (status == 200).then(|| v["at_s"].as_f64()).flatten()
    };
    let give_up = Duration::from_secs(u64::from(n) * 2 + 5);
    let until = Instant::now() + give_up;
    let mut first = None;
    loop {
        if let Some(t) = at() {
            let start = *first.get_or_insert(t);
            if t >= start + f64::from(n) {
                return;
            }
        }
        assert!(
            Instant::now() < until,
            "fewer than {n} frames in {give_up:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn the_plain_api_holds_its_connection_cap_under_a_flood() {
    raise_open_files(4096);
    let (port, agent) = start_agent();
    let n = flood_to_the_cap(agent.0.id(), port);
    let (status, metrics) = request(port, "GET", "/metrics", "127.0.0.1");
    assert_eq!(status, 200, "the API after the flood: {metrics}");
    assert!(
        refused(&metrics, "connections") >= (n - CAP) as u64,
        "{} refused of a flood of {n}",
        refused(&metrics, "connections")
    );
}

/// The API off the host (TLS) is served by the same stack as on it: the
/// same cap, and a deadline on the handshake as on the headers.
#[test]
fn the_tls_api_holds_the_same_connection_cap_under_a_flood() {
    raise_open_files(4096);
    let dir = tempfile::tempdir().unwrap();
    let token = "fl00d";
    let (port, agent, ca) = start_tls_agent(dir.path(), token);
    let base = format!("https://127.0.0.1:{port}");
    let n = flood_to_the_cap(agent.0.id(), port);
    let (status, metrics) =
        agent_integration::curl_tls(&format!("{base}/metrics"), &ca, Some(token));
    assert_eq!(status, 200, "the TLS API after the flood: {metrics}");
    assert!(
        refused(&metrics, "connections") >= (n - CAP) as u64,
        "{} refused of a flood of {n}",
        refused(&metrics, "connections")
    );
}
