//! Monitors of our own that misbehave as a local user's fake QEMU may:
//! each session ends by its deadline with the reason, never later.

use std::{
    io::{BufRead, BufReader, Write},
    os::unix::net::{UnixListener, UnixStream},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use super::*;

const WITHIN: Duration = Duration::from_millis(600);

fn socket_in(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("m.sock")
}

fn me() -> u32 {
    std::process::id()
}

/// A listener that serves each connection with `f`, on a thread of its own.
fn serve(path: &Path, f: fn(UnixStream)) {
    let l = UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        for c in l.incoming().flatten() {
            std::thread::spawn(move || f(c));
        }
    });
}

fn greet(c: &mut UnixStream) -> BufReader<UnixStream> {
    let _ = writeln!(c, "{{\"QMP\": {{\"version\": {{}}}}}}");
    BufReader::new(c.try_clone().unwrap())
}

/// Answers every command like QEMU, `query-blockstats` with `n` entries.
fn answer_with(mut c: UnixStream, entries: usize) {
    let mut r = greet(&mut c);
    let mut line = String::new();
    while r.read_line(&mut line).unwrap_or(0) > 0 {
        let _ = if line.contains("blockstats") {
            let list = vec!["{}"; entries].join(",");
            writeln!(c, "{{\"return\": [{list}]}}")
        } else {
            writeln!(c, "{{\"return\": {{}}}}")
        };
        line.clear();
    }
}

fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let out = f();
    (out, t.elapsed())
}

fn within_deadline(took: Duration) {
    assert!(took < WITHIN + Duration::from_millis(300), "took {took:?}");
}

#[test]
fn a_monitor_that_answers_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket_in(&dir);
    serve(&path, |c| answer_with(c, 3));
    let mut s = Session::open(&path, me(), WITHIN).unwrap();
    let got: Capped<IgnoredAny> = s.execute("{\"execute\":\"query-blockstats\"}").unwrap();
    assert_eq!(got.0.len(), 3);
}

#[test]
fn a_monitor_that_never_accepts_answers_busy_at_once() {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketType};
    let dir = tempfile::tempdir().unwrap();
    let path = socket_in(&dir);
    let l = rustix::net::socket(AddressFamily::UNIX, SocketType::STREAM, None).unwrap();
    rustix::net::bind(&l, &SocketAddrUnix::new(&path).unwrap()).unwrap();
    rustix::net::listen(&l, 0).unwrap();
    // The first waits in the backlog, unheard, until the deadline ...
    let (first, took) = timed(|| Session::open(&path, me(), WITHIN));
    assert!(
        matches!(first, Err(QmpError::Timeout(..))),
        "{:?}",
        first.err()
    );
    within_deadline(took);
    // ... the backlog is then full (the first's end is still queued): the
    // next is refused without waiting.
    let (next, took) = timed(|| Session::open(&path, me(), WITHIN));
    assert!(matches!(next, Err(QmpError::Busy(_))), "{:?}", next.err());
    assert!(took < Duration::from_millis(50), "took {took:?}");
    drop(l);
}

#[test]
fn a_monitor_streaming_events_ends_by_the_deadline_or_the_event_cap() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket_in(&dir);
    serve(&path, |mut c| {
        let _r = greet(&mut c);
        while writeln!(c, "{{\"event\": \"RESUME\", \"data\": {{}}}}").is_ok() {}
    });
    let (s, took) = timed(|| Session::open(&path, me(), WITHIN));
    assert!(
        matches!(s, Err(QmpError::TooManyEvents(_) | QmpError::Timeout(..))),
        "{:?}",
        s.err()
    );
    within_deadline(took);
}

#[test]
fn a_monitor_dripping_a_byte_at_a_time_ends_by_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket_in(&dir);
    serve(&path, |mut c| {
        // A byte every 100 ms: each read is answered within any per-read
        // timeout, the whole never.
        for b in "{\"QMP\": {\"version\": {}}}".bytes().cycle() {
            if c.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let (s, took) = timed(|| Session::open(&path, me(), WITHIN));
    assert!(matches!(s, Err(QmpError::Timeout(..))), "{:?}", s.err());
    within_deadline(took);
}

#[test]
fn an_answer_of_millions_of_entries_is_refused_as_it_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket_in(&dir);
    // 4 MiB of `{},`: 1.4 million entries, each a stats record once read.
    serve(&path, |c| answer_with(c, (4 << 20) / 3 - 8));
    let mut s = Session::open(&path, me(), Duration::from_secs(5)).unwrap();
    let got = s.execute::<Capped<IgnoredAny>>("{\"execute\":\"query-blockstats\"}");
    let e = got.expect_err("over the entry cap");
    assert!(format!("{e}").contains("more than 4096 entries"), "{e}");
}

#[test]
fn a_line_past_the_message_cap_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket_in(&dir);
    serve(&path, |mut c| {
        let big = vec![b'x'; MAX_MESSAGE + 10];
        let _ = c.write_all(&big);
    });
    let s = Session::open(&path, me(), Duration::from_secs(5));
    assert!(matches!(s, Err(QmpError::TooLong(..))), "{:?}", s.err());
}

#[test]
fn a_monitor_of_another_process_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket_in(&dir);
    serve(&path, |c| answer_with(c, 1));
    let s = Session::open(&path, 1, WITHIN);
    assert!(matches!(s, Err(QmpError::NotServedBy(..))), "{:?}", s.err());
}
