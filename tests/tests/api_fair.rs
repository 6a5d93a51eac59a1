//! The API beside a local user who floods it from processes of their own
//! (as nobody): connections that never speak at 20,000 a second, heads
//! of 400 KB, `/metrics` and streams never read. A slow client of
//! another user (one that waits 300 ms between its connect and its
//! request) is answered every time; the user's streams leave root's
//! `top --connect` its place; the agent stays under the memory bound
//! SECURITY.md states; and with fake VMs' monitors misbehaving beside it
//! all, `/healthz` and an authorised run's start and stop are answered
//! within 1 s each time (root: the probes load).

use std::{
    io::{Read, Write},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use agent_integration::{
    api::{raise_open_files, request, rss_kib, sample, start_agent},
    build_native, status_and_body, Reap,
};

/// The agent's RSS beside any of these floods, at most (SECURITY.md).
const MOST_RSS_KIB: u64 = 192 << 10;

fn flooder(dir: &Path) -> PathBuf {
    build_native(dir, "api_flood.c", "api-flood", &["-O2"])
}

/// `api_flood PORT MODE RATE SECS` as nobody.
fn flood_as_nobody(exe: &Path, port: u16, mode: &str, rate: u32, secs: u64) -> Child {
    Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(exe)
        .args([
            port.to_string(),
            mode.into(),
            rate.to_string(),
            secs.to_string(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("setpriv (util-linux)")
}

/// A test directory nobody can read and run from.
fn open_tempdir(prefix: &str) -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    d
}

/// A request sent `wait` after the connect: (status, how long in all).
fn slow_request(port: u16, path: &str, wait: Duration) -> (u16, Duration) {
    let t = Instant::now();
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return (0, t.elapsed());
    };
    std::thread::sleep(wait);
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    if write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .is_err()
    {
        return (0, t.elapsed());
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    (status_and_body(&out).0, t.elapsed())
}

fn finish(floods: Vec<Child>) -> Vec<String> {
    floods
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        })
        .collect()
}

#[test]
fn a_slow_client_is_answered_beside_another_users_connect_flood() {
    raise_open_files(16_384);
    let dir = open_tempdir("iospan-fair-");
    let exe = flooder(dir.path());
    let (port, agent) = start_agent();
    // Four processes, 20,000 silent connects a second between them.
    let floods: Vec<Child> = (0..4)
        .map(|_| flood_as_nobody(&exe, port, "idle", 5000, 12))
        .collect();
    std::thread::sleep(Duration::from_secs(2));
    let mut failed = Vec::new();
    let mut asked = 0;
    let until = Instant::now() + Duration::from_secs(9);
    while Instant::now() < until {
        let (status, took) = slow_request(port, "/healthz", Duration::from_millis(300));
        asked += 1;
        if status != 200 {
            failed.push(format!("{status} after {took:?}"));
        }
    }
    let metrics = request(port, "GET", "/metrics", "127.0.0.1").1;
    let flooded = finish(floods);
    let evicted: u64 = ["handshake", "headers", "kept_alive"]
        .iter()
        .map(|w| {
            sample(
                &metrics,
                &format!(
                    "iospan_api_connections_closed_total{{reason=\"evicted\",waiting=\"{w}\"}}"
                ),
            )
        })
        .sum();
    eprintln!("{asked} slow requests, failed {failed:?}; floods {flooded:?}; evicted {evicted}");
    assert!(asked >= 15, "{asked}");
    assert!(failed.is_empty(), "{} of {asked}: {failed:?}", failed.len());
    // The house was full: the flood's connections were evicted for others.
    assert!(
        evicted > 10_000,
        "evicted {evicted}: the flood did not fill the house"
    );
    drop(agent);
}

#[test]
fn a_users_streams_leave_roots_their_place() {
    raise_open_files(16_384);
    let dir = open_tempdir("iospan-streams-");
    let exe = flooder(dir.path());
    let (port, agent) = start_agent();
    let flood = flood_as_nobody(&exe, port, "stream", 2000, 3);
    let flooded = finish(vec![flood]);
    let metrics = request(port, "GET", "/metrics", "127.0.0.1").1;
    let refused = sample(&metrics, "iospan_api_refused_total{reason=\"streams\"}");
    // Root's stream: its first frame comes.
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
                "root's stream gave no frame beside the user's {flooded:?}: {other:?} {}",
                String::from_utf8_lossy(&got)
            ),
        }
    }
    assert!(
        String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    // The user's 6,000 asks met its share: the rest refused, counted.
    assert!(refused >= 5000, "{refused} refused: {flooded:?}");
    drop(agent);
}

/// The agent's peak RSS (KiB) while `floods` run, sampled every 100 ms.
fn peak_rss_while(pid: u32, floods: &mut [Child]) -> u64 {
    let mut peak = 0;
    while floods.iter_mut().any(|c| matches!(c.try_wait(), Ok(None))) {
        peak = peak.max(rss_kib(pid));
        std::thread::sleep(Duration::from_millis(100));
    }
    peak
}

#[test]
fn heads_responses_and_streams_never_read_stay_under_the_bound() {
    raise_open_files(16_384);
    let dir = open_tempdir("iospan-memory-");
    let exe = flooder(dir.path());
    let (port, agent) = start_agent();
    let pid = agent.0.id();
    let before = rss_kib(pid);
    let mut floods = vec![
        flood_as_nobody(&exe, port, "header", 1000, 3),
        flood_as_nobody(&exe, port, "metrics", 1000, 4),
        flood_as_nobody(&exe, port, "stream", 512, 2),
    ];
    let peak = peak_rss_while(pid, &mut floods);
    let flooded = finish(floods);
    let metrics = request(port, "GET", "/metrics", "127.0.0.1").1;
    eprintln!("RSS {before} KiB before, {peak} KiB at most; {flooded:?}");
    assert!(
        peak < MOST_RSS_KIB,
        "peak RSS {peak} KiB (bound {MOST_RSS_KIB} KiB): {flooded:?}"
    );
    // The agent answers still, its frames unhurt.
    assert!(metrics.contains("iospan_api_connections_open"), "{metrics}");
    drop(agent);
}

/// Fake VMs whose monitors misbehave, as `hostile_monitors` makes them.
fn fake_vms(dir: &Path) -> Vec<Reap> {
    use std::os::unix::fs::PermissionsExt;
    let exe = dir.join("bin").join("qemu-system-x86_64");
    std::fs::create_dir_all(exe.parent().unwrap()).unwrap();
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/native/fake_qmp.c");
    let out = agent_integration::run(Command::new("cc").args(["-O1", "-o"]).arg(&exe).arg(src));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    ["never", "events", "drip", "huge"]
        .iter()
        .map(|mode| {
            let d = dir.join(mode);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
            Reap(
                Command::new("setpriv")
                    .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
                    .arg(&exe)
                    .args(["-name", &format!("fake-{mode}"), "-drive"])
                    .arg(format!("file={}/disk.img,if=none,id=d0", dir.display()))
                    .args(["-device", "virtio-blk-pci,drive=d0,id=vd0", "-qmp"])
                    .arg(format!("unix:{}/qmp.sock,server=on,wait=off", d.display()))
                    .env("FAKE_QMP", mode)
                    .env("FAKE_QEMU_SECONDS", "60")
                    .stdin(Stdio::null())
                    .spawn()
                    .unwrap(),
            )
        })
        .collect()
}

#[test]
fn everything_at_once_leaves_a_real_client_answered_within_a_second() {
    raise_open_files(16_384);
    let dir = open_tempdir("iospan-all-");
    let exe = flooder(dir.path());
    let _vms = fake_vms(dir.path());
    std::thread::sleep(Duration::from_millis(300));
    let (port, agent) = start_agent();
    let pid = agent.0.id();
    let mut floods = vec![
        flood_as_nobody(&exe, port, "idle", 5000, 12),
        flood_as_nobody(&exe, port, "idle", 5000, 12),
        flood_as_nobody(&exe, port, "header", 250, 12),
        flood_as_nobody(&exe, port, "metrics", 300, 12),
        flood_as_nobody(&exe, port, "stream", 100, 12),
    ];
    std::thread::sleep(Duration::from_secs(1));
    let mut slow = Vec::new();
    let mut peak = 0;
    let mut rounds = 0;
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        let next = Instant::now() + Duration::from_secs(1);
        for (what, method, path, want) in [
            ("healthz", "GET", "/healthz".to_string(), 200),
            (
                "start",
                "POST",
                "/api/v1/runs?label=all-at-once".to_string(),
                201,
            ),
        ] {
            let t = Instant::now();
            let (status, body) = request(port, method, &path, "127.0.0.1");
            let took = t.elapsed();
            if status != want || took > Duration::from_secs(1) {
                slow.push(format!("{what}: {status} after {took:?}"));
            }
            if what == "start" {
                let id = serde_json::from_str::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|v| v["id"].as_u64());
                if let Some(id) = id {
                    let t = Instant::now();
                    let (status, _) = request(
                        port,
                        "POST",
                        &format!("/api/v1/runs/{id}/stop"),
                        "127.0.0.1",
                    );
                    if status != 200 || t.elapsed() > Duration::from_secs(1) {
                        slow.push(format!("stop: {status} after {:?}", t.elapsed()));
                    }
                }
            }
        }
        peak = peak.max(rss_kib(pid));
        rounds += 1;
        if let Some(w) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(w);
        }
    }
    peak = peak.max(peak_rss_while(pid, &mut floods));
    let flooded = finish(floods);
    eprintln!("{rounds} rounds, slow {slow:?}, peak RSS {peak} KiB; {flooded:?}");
    assert!(rounds >= 8, "{rounds}");
    assert!(slow.is_empty(), "{slow:?}");
    assert!(peak < MOST_RSS_KIB, "peak RSS {peak} KiB");
    drop(agent);
}
