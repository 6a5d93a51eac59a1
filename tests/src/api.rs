//! The agent's HTTP API from outside, as clients and floods reach it: an
//! agent serving it, requests plain and over TLS, the agent's sockets and
//! memory, and floods of connections that never send a request.

use std::{
    io::{ErrorKind, Read, Write},
    net::{SocketAddr, TcpStream},
    path::Path,
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use crate::iospan_bin;

/// A free loopback port.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The Authorization header line: starting runs needs the agent's token
/// (`iospan run` made it in the default file when it started).
pub fn bearer() -> String {
    let t = std::fs::read_to_string("/var/lib/iospan/api-token").unwrap_or_default();
    format!("Authorization: Bearer {}\r\n", t.trim())
}

/// One request on a new connection: (status, body).
pub fn request(port: u16, method: &str, path: &str, host: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n{}Content-Length: 0\r\n\r\n",
        bearer()
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    crate::status_and_body(&out)
}

pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// A sample of /metrics: the value of the line starting `key `.
pub fn sample(metrics: &str, key: &str) -> u64 {
    let key = format!("{key} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no {key}in /metrics:\n{metrics}")) as u64
}

pub fn refused(metrics: &str, reason: &str) -> u64 {
    sample(
        metrics,
        &format!("iospan_api_refused_total{{reason=\"{reason}\"}}"),
    )
}

/// Connections the agent closed while they held no request, every reason.
pub fn closed_idle(metrics: &str) -> u64 {
    let mut n = 0;
    for reason in ["evicted", "deadline"] {
        for waiting in ["handshake", "headers", "kept_alive"] {
            n += sample(
                metrics,
                &format!(
                    "iospan_api_connections_closed_total{{reason=\"{reason}\",waiting=\"{waiting}\"}}"
                ),
            );
        }
    }
    n
}

/// The agent's open sockets.
pub fn sockets(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    std::fs::read_link(e.path())
                        .is_ok_and(|l| l.to_string_lossy().starts_with("socket:"))
                })
                .count()
        })
        .unwrap_or(0)
}

/// A process killed when dropped.
pub struct Agent(pub Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `iospan run` serving the API on a free port, once it answers.
pub fn start_agent() -> (u16, Agent) {
    let port = free_port();
    let agent = Agent(
        Command::new(iospan_bin())
            .args(["run", "--quiet", "--duration", "120s", "--metrics-listen"])
            .arg(format!("127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err()
        || request(port, "GET", "/healthz", "127.0.0.1").0 != 200
    {
        assert!(Instant::now() < deadline, "the API never answered");
        std::thread::sleep(Duration::from_millis(200));
    }
    (port, agent)
}

/// `iospan agent` serving the API over TLS with `token` on a free port,
/// once it answers: (port, agent, the CA's certificate).
pub fn start_tls_agent(dir: &Path, token: &str) -> (u16, Agent, std::path::PathBuf) {
    let (ca, cert, key) = crate::test_ca(dir, "api");
    let port = free_port();
    let conf = dir.join("agent.toml");
    std::fs::write(
        &conf,
        format!(
            "[agent]\nmax_disks = 4\n[api]\nlisten = \"127.0.0.1:{port}\"\ntoken = \"{token}\"\n\
             tls_cert = {:?}\ntls_key = {:?}\n",
            cert.display().to_string(),
            key.display().to_string()
        ),
    )
    .unwrap();
    let agent = Agent(
        Command::new(iospan_bin())
            .args(["agent", "--config"])
            .arg(&conf)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let base = format!("https://127.0.0.1:{port}");
    let t = Instant::now();
    while crate::curl_tls(&format!("{base}/healthz"), &ca, Some(token)).0 != 200 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "never healthy over https"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    (port, agent, ca)
}

/// As many open files as the hard limit allows, at least `need`.
pub fn raise_open_files(need: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    assert!(
        lim.rlim_max >= need,
        "this test needs {need} open files (ulimit -Hn: {})",
        lim.rlim_max
    );
    lim.rlim_cur = lim.rlim_max;
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
}

/// A rustls client trusting only `ca`.
pub fn tls_client(ca: &Path) -> Arc<rustls::ClientConfig> {
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Arc::new(
        rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// A TLS connection to 127.0.0.1:`port` with its handshake done.
pub fn tls_connect(
    cfg: &Arc<rustls::ClientConfig>,
    port: u16,
    timeout: Duration,
) -> std::io::Result<rustls::StreamOwned<rustls::ClientConnection, TcpStream>> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut tcp = TcpStream::connect_timeout(&addr, timeout)?;
    tcp.set_read_timeout(Some(timeout))?;
    tcp.set_write_timeout(Some(timeout))?;
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let mut conn = rustls::ClientConnection::new(cfg.clone(), name)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    while conn.is_handshaking() {
        conn.complete_io(&mut tcp)?;
    }
    Ok(rustls::StreamOwned::new(conn, tcp))
}

/// How a client reaches the API: plain HTTP, or TLS trusting a CA.
#[derive(Clone)]
pub enum Client {
    Plain,
    Tls(Arc<rustls::ClientConfig>),
}

impl Client {
    /// One request on a new connection, with `token` where given: (status,
    /// body, how long from the connect to the whole answer).
    pub fn ask(
        &self,
        port: u16,
        method: &str,
        path: &str,
        token: Option<&str>,
    ) -> (u16, String, Duration) {
        let t = Instant::now();
        let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{auth}Content-Length: 0\r\n\r\n"
        );
        let timeout = Duration::from_secs(10);
        let mut out = Vec::new();
        let done = match self {
            Client::Plain => {
                TcpStream::connect_timeout(&SocketAddr::from(([127, 0, 0, 1], port)), timeout)
                    .and_then(|mut s| {
                        s.set_read_timeout(Some(timeout))?;
                        s.write_all(req.as_bytes())?;
                        s.read_to_end(&mut out)
                    })
            }
            Client::Tls(cfg) => tls_connect(cfg, port, timeout).and_then(|mut s| {
                s.write_all(req.as_bytes())?;
                match s.read_to_end(&mut out) {
                    // The agent closes without close_notify after the
                    // answer (Connection: close).
                    Err(e) if e.kind() == ErrorKind::UnexpectedEof => Ok(0),
                    other => other,
                }
            }),
        };
        let took = t.elapsed();
        if let Err(e) = done {
            return (0, format!("{method} {path}: {e}"), took);
        }
        let (status, body) = crate::status_and_body(&String::from_utf8_lossy(&out));
        (status, body, took)
    }
}

/// What a flood's connections do once connected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stall {
    /// Never send a byte (a scanner, or a TLS client that never says hello).
    Silent,
    /// Send half a request's headers and stop (slow-loris).
    HalfHeaders,
    /// Complete the TLS handshake, then send nothing.
    AfterHandshake,
}

/// A flood's own account of its connections.
#[derive(Clone, Debug, Default)]
pub struct FloodCount {
    pub opened: u64,
    /// Connects (or handshakes) that failed or timed out.
    pub failed: u64,
    /// Connections the agent closed.
    pub closed_by_agent: u64,
    /// Connections still open after `HOLD`: the agent kept them too long.
    pub outlived_hold: u64,
    /// The most connections the flood held at once.
    pub most_held: usize,
}

/// How long a flood keeps each connection, waiting for the agent to close
/// it: past any deadline the agent gives one that holds no request.
pub const HOLD: Duration = Duration::from_secs(7);

/// A flood of connections to 127.0.0.1:`port`, opened at a steady rate
/// from its own thread, each held until the agent closes it (at most
/// `HOLD`).
pub struct Flood {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<FloodCount>>,
}

/// One held connection: when it opened, and its socket (a TLS one's
/// underlying TCP stream).
struct Held {
    at: Instant,
    tcp: TcpStream,
}

impl Flood {
    /// Opens `rate` connections a second for `secs`, each stalling as
    /// `stall` says; `tls` for `Stall::AfterHandshake`.
    pub fn start(
        port: u16,
        rate: u32,
        secs: u64,
        stall: Stall,
        tls: Option<Arc<rustls::ClientConfig>>,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut count = FloodCount::default();
            let mut held = std::collections::VecDeque::new();
            let t0 = Instant::now();
            let end = t0 + Duration::from_secs(secs);
            let mut i = 0u64;
            while Instant::now() < end && !stopped.load(Ordering::Relaxed) {
                let due = t0 + Duration::from_secs_f64(i as f64 / f64::from(rate));
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
                i += 1;
                match open(port, stall, tls.as_ref()) {
                    Ok(tcp) => {
                        count.opened += 1;
                        held.push_back(Held {
                            at: Instant::now(),
                            tcp,
                        });
                    }
                    Err(_) => count.failed += 1,
                }
                if i.is_multiple_of(64) {
                    let_go(&mut held, &mut count);
                }
            }
            // The rest: each closed by the agent, or outliving `HOLD`.
            while !held.is_empty() {
                let_go(&mut held, &mut count);
                std::thread::sleep(Duration::from_millis(20));
            }
            count
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }

    /// Waits for its end (the last connection closed, or given up).
    pub fn join(mut self) -> FloodCount {
        self.thread
            .take()
            .expect("joined once")
            .join()
            .expect("the flood's thread")
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn open(
    port: u16,
    stall: Stall,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> std::io::Result<TcpStream> {
    let timeout = Duration::from_secs(1);
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let tcp = match stall {
        Stall::Silent => TcpStream::connect_timeout(&addr, timeout)?,
        Stall::HalfHeaders => {
            let mut s = TcpStream::connect_timeout(&addr, timeout)?;
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")?;
            s
        }
        Stall::AfterHandshake => {
            let cfg = tls.expect("a TLS client for a handshake flood");
            tls_connect(cfg, port, timeout)?.sock
        }
    };
    tcp.set_nonblocking(true)?;
    Ok(tcp)
}

/// Drops the oldest held connections the agent has closed (the agent
/// closes the oldest first), and those past `HOLD`; counts each.
fn let_go(held: &mut std::collections::VecDeque<Held>, count: &mut FloodCount) {
    count.most_held = count.most_held.max(held.len());
    while let Some(front) = held.front_mut() {
        if !closed(&mut front.tcp) {
            if front.at.elapsed() < HOLD {
                break;
            }
            count.outlived_hold += 1;
        } else {
            count.closed_by_agent += 1;
        }
        held.pop_front();
    }
}

/// Whether the agent closed `tcp` (non-blocking): its end of stream, or
/// an error; what it sent before (a TLS session ticket, a 408) is read
/// past.
fn closed(tcp: &mut TcpStream) -> bool {
    let mut b = [0u8; 4096];
    loop {
        match tcp.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => return true,
        }
    }
}
