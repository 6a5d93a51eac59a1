//! An OTLP/HTTP endpoint that takes every export and keeps nothing, for the
//! bench (an exporting arm pays for building and sending its exports, not
//! for a collector's work) and for the tests that need a collector to go
//! away and come back. Exports to `/v1/traces`, `/v1/metrics` and
//! `/v1/logs` are answered 200 with an empty (valid) response and counted;
//! any other path is answered 404.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{TcpListener, TcpStream},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::Duration,
};

use anyhow::{Context, Result};

/// Exports taken so far, by signal.
#[derive(Default)]
struct Taken {
    traces: AtomicU64,
    metrics: AtomicU64,
    logs: AtomicU64,
}

/// The sink on its port: up (listening) or down (connections refused, and
/// kept-alive connections closed unanswered, as a collector that went away
/// leaves them).
pub struct OtlpSink {
    pub port: u16,
    up: Arc<AtomicBool>,
    taken: Arc<Taken>,
    thread: Option<JoinHandle<()>>,
}

impl OtlpSink {
    /// Listening on a port of its own choosing.
    pub fn start() -> Result<Self> {
        let l = TcpListener::bind("127.0.0.1:0").context("binding the OTLP sink")?;
        let port = l.local_addr()?.port();
        let mut s = Self::down(port);
        s.listen(l)?;
        Ok(s)
    }

    /// Not yet listening, on `port` (bring it up with [`OtlpSink::up`]).
    pub fn down(port: u16) -> Self {
        Self {
            port,
            up: Arc::new(AtomicBool::new(false)),
            taken: Arc::new(Taken::default()),
            thread: None,
        }
    }

    /// Listens on its port again (or for the first time).
    pub fn up(&mut self) -> Result<()> {
        let l = TcpListener::bind(("127.0.0.1", self.port))
            .with_context(|| format!("binding the OTLP sink to port {}", self.port))?;
        self.listen(l)
    }

    fn listen(&mut self, l: TcpListener) -> Result<()> {
        // Non-blocking, so that the accept loop sees `stop` within 20 ms.
        l.set_nonblocking(true)?;
        self.up.store(true, Ordering::SeqCst);
        let (up, taken) = (self.up.clone(), self.taken.clone());
        self.thread = Some(std::thread::spawn(move || {
            while up.load(Ordering::SeqCst) {
                match l.accept() {
                    Ok((s, _)) => {
                        let (up, taken) = (up.clone(), taken.clone());
                        std::thread::spawn(move || serve(s, &up, &taken));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
            // The listener closes here: connections are refused.
        }));
        Ok(())
    }

    /// Stops listening; connections are refused until [`OtlpSink::up`].
    pub fn stop(&mut self) {
        self.up.store(false, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Trace exports taken so far.
    pub fn traces(&self) -> u64 {
        self.taken.traces.load(Ordering::SeqCst)
    }

    /// Exports of every signal taken so far.
    pub fn exports(&self) -> u64 {
        let t = &self.taken;
        [&t.traces, &t.metrics, &t.logs]
            .iter()
            .map(|n| n.load(Ordering::SeqCst))
            .sum()
    }
}

impl Drop for OtlpSink {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One HTTP/1.1 request's line and body; `None` once the connection ends.
fn read_request(r: &mut BufReader<TcpStream>) -> Option<(String, Vec<u8>)> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut len = 0usize;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).ok()? == 0 {
            return None;
        }
        if h == "\r\n" {
            break;
        }
        if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).ok()?;
    Some((line, body))
}

/// Answers each export on the connection while the sink is up.
fn serve(s: TcpStream, up: &AtomicBool, taken: &Taken) {
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    let Ok(mut w) = s.try_clone() else { return };
    let mut r = BufReader::new(s);
    while let Some((line, _body)) = read_request(&mut r) {
        if !up.load(Ordering::SeqCst) {
            return;
        }
        let path = line.split_whitespace().nth(1).unwrap_or("");
        let counter = match (line.starts_with("POST "), path) {
            (true, "/v1/traces") => Some(&taken.traces),
            (true, "/v1/metrics") => Some(&taken.metrics),
            (true, "/v1/logs") => Some(&taken.logs),
            _ => None,
        };
        let status = match counter {
            Some(n) => {
                n.fetch_add(1, Ordering::SeqCst);
                "200 OK"
            }
            None => "404 Not Found",
        };
        let reply = format!(
            "HTTP/1.1 {status}\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n"
        );
        if w.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn post(port: u16, path: &str) -> std::io::Result<String> {
        let mut s = TcpStream::connect(("127.0.0.1", port))?;
        s.write_all(
            format!("POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc").as_bytes(),
        )?;
        let mut r = BufReader::new(s);
        let mut line = String::new();
        r.read_line(&mut line)?;
        Ok(line)
    }

    #[test]
    fn exports_are_taken_and_counted_by_signal_until_the_sink_goes_down() {
        let mut sink = OtlpSink::start().unwrap();
        assert!(post(sink.port, "/v1/traces").unwrap().contains("200"));
        assert!(post(sink.port, "/v1/metrics").unwrap().contains("200"));
        assert!(post(sink.port, "/v1/other").unwrap().contains("404"));
        assert_eq!((sink.traces(), sink.exports()), (1, 2));
        sink.stop();
        assert!(post(sink.port, "/v1/traces").is_err(), "taken while down");
        sink.up().unwrap();
        assert!(post(sink.port, "/v1/traces").unwrap().contains("200"));
        assert_eq!(sink.traces(), 2);
    }
}
