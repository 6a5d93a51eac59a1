//! A local user's fake VMs whose QMP monitors misbehave — one never
//! accepts, one greets and then streams events, one sends a byte every
//! 1.9 s, two answer with millions of empty entries — beside a root
//! `iospan agent`: its frames keep coming, an authorised run starts and
//! stops within a second each time, the monitors are shown and counted,
//! the agent stays small and SIGTERM stops it within 5 s (root: the
//! probes load).

use std::{
    io::{Read, Write},
    net::TcpStream,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use agent_integration::{
    api::{free_port, rss_kib, sample},
    iospan_bin, run, status_and_body, Reap,
};

/// How long the agent is watched beside the fakes.
const WATCH: Duration = Duration::from_secs(14);
/// The agent's peak RSS beside them, at most (SECURITY.md's bound).
const MOST_RSS_KIB: u64 = 192 << 10;

fn open_dir(p: &Path) {
    std::fs::create_dir_all(p).unwrap();
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o777)).unwrap();
}

/// The fake, built under QEMU's name in `dir`.
fn fake_qemu(dir: &Path) -> PathBuf {
    open_dir(dir);
    let exe = dir.join("qemu-system-x86_64");
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/native/fake_qmp.c");
    let out = run(Command::new("cc").args(["-O1", "-o"]).arg(&exe).arg(src));
    assert!(
        out.status.success(),
        "building {src}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

/// A fake VM as nobody whose monitor behaves as `mode` says.
fn fake_vm(exe: &Path, base: &Path, mode: &str, n: usize) -> Reap {
    let dir = base.join(format!("{mode}-{n}"));
    open_dir(&dir);
    let disk = base.join("disk.img");
    let args = [
        "-name".to_string(),
        format!("fake-{mode}-{n}"),
        "-drive".into(),
        format!("file={},if=none,id=d0,format=raw", disk.display()),
        "-device".into(),
        "virtio-blk-pci,drive=d0,id=vd0".into(),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", dir.join("qmp.sock").display()),
    ];
    Reap(
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(exe)
            .args(&args)
            .env("FAKE_QMP", mode)
            .env("FAKE_QEMU_SECONDS", "90")
            .stdin(Stdio::null())
            .spawn()
            .expect("setpriv (util-linux)"),
    )
}

/// One request with `token`: (status, body, how long it took).
fn ask(port: u16, method: &str, path: &str, token: &str) -> (u16, String, Duration) {
    let t = Instant::now();
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return (0, String::new(), t.elapsed());
    };
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Authorization: Bearer {token}\r\nContent-Length: 0\r\n\r\n"
    );
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let (status, body) = status_and_body(&out);
    (status, body, t.elapsed())
}

fn at_s(port: u16, token: &str) -> Option<f64> {
    let (status, body, _) = ask(port, "GET", "/api/v1/snapshot", token);
    (status == 200)
        .then(|| serde_json::from_str::<serde_json::Value>(&body).ok()?["at_s"].as_f64())
        .flatten()
}

/// `iospan agent` on a free port with `token`, once it answers.
fn start_agent(dir: &Path, token: &str) -> (u16, Child) {
    let port = free_port();
    let conf = dir.join("iospan.toml");
    std::fs::write(
        &conf,
        format!(
            "[api]\nlisten = \"127.0.0.1:{port}\"\ntoken = \"{token}\"\ntoken_file = \"{}\"\n",
            dir.join("api-token").display()
        ),
    )
    .unwrap();
    let agent = Command::new(iospan_bin())
        .args(["agent", "--config"])
        .arg(&conf)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while at_s(port, token).is_none() {
        assert!(Instant::now() < deadline, "the agent never answered");
        std::thread::sleep(Duration::from_millis(200));
    }
    (port, agent)
}

/// What the agent did beside the fakes.
#[derive(Debug, Default)]
struct Seen {
    /// The longest the snapshot's clock stood still.
    longest_still: Duration,
    /// Run starts and stops not answered right within 1 s.
    slow: Vec<String>,
    runs: usize,
    peak_rss_kib: u64,
    monitors_shown: usize,
}

/// Every 250 ms the snapshot; every 2 s a run started and stopped.
fn watch(port: u16, pid: u32, token: &str) -> Seen {
    let mut seen = Seen::default();
    let until = Instant::now() + WATCH;
    let (mut last_at, mut moved) = (at_s(port, token).unwrap_or(0.0), Instant::now());
    let mut next_run = Instant::now();
    while Instant::now() < until {
        if let Some(a) = at_s(port, token).filter(|&a| a > last_at) {
            (last_at, moved) = (a, Instant::now());
        }
        seen.longest_still = seen.longest_still.max(moved.elapsed());
        seen.peak_rss_kib = seen.peak_rss_kib.max(rss_kib(pid));
        if Instant::now() >= next_run {
            next_run = Instant::now() + Duration::from_secs(2);
            one_run(port, token, &mut seen);
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    seen
}

fn one_run(port: u16, token: &str, seen: &mut Seen) {
    let mut check = |what: &str, (status, body, took): (u16, String, Duration), want: u16| {
        if status != want || took > Duration::from_secs(1) {
            seen.slow
                .push(format!("{what}: {status} after {took:?}: {body}"));
        }
        body
    };
    let started = check(
        "start",
        ask(port, "POST", "/api/v1/runs?label=beside-fakes", token),
        201,
    );
    let Some(id) = serde_json::from_str::<serde_json::Value>(&started)
        .ok()
        .and_then(|v| v["id"].as_u64())
    else {
        return;
    };
    let stopped = check(
        "stop",
        ask(port, "POST", &format!("/api/v1/runs/{id}/stop"), token),
        200,
    );
    seen.runs += 1;
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(&stopped) {
        let fakes = v["report"]["qemu_counts"]
            .as_object()
            .map_or(0, |m| m.keys().filter(|k| k.starts_with("fake-")).count());
        seen.monitors_shown = seen.monitors_shown.max(fakes);
    }
}

/// SIGTERM, then how long until it exited.
fn stop(agent: &mut Child) -> Option<Duration> {
    let t = Instant::now();
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    while t.elapsed() < Duration::from_secs(10) {
        if let Ok(Some(_)) = agent.try_wait() {
            return Some(t.elapsed());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = agent.kill();
    let _ = agent.wait();
    None
}

#[test]
fn fake_monitors_neither_stall_nor_bloat_the_agent() {
    let base_held = tempfile::Builder::new()
        .prefix("iospan-monitors-")
        .tempdir()
        .unwrap();
    let base = base_held.path();
    open_dir(base);
    std::fs::write(base.join("disk.img"), vec![0u8; 1 << 20]).unwrap();
    let exe = fake_qemu(&base.join("bin"));
    let _fakes: Vec<Reap> = ["never", "events", "drip", "huge", "huge"]
        .iter()
        .enumerate()
        .map(|(n, mode)| fake_vm(&exe, base, mode, n))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let token = "m0nitor-token";
    let (port, mut agent) = start_agent(base, token);
    let seen = watch(port, agent.id(), token);
    let (_, metrics, _) = ask(port, "GET", "/metrics", token);
    let (_, snapshot, _) = ask(port, "GET", "/api/v1/snapshot", token);
    let stopped = stop(&mut agent);
    eprintln!("{seen:?}; stopped after {stopped:?}");
    assert!(
        seen.longest_still < Duration::from_millis(2500),
        "the agent's frames stood still for {:?}: {seen:?}",
        seen.longest_still
    );
    assert!(seen.slow.is_empty(), "{seen:?}");
    assert!(seen.runs >= 5, "{seen:?}");
    assert_eq!(
        seen.monitors_shown, 5,
        "each fake VM in each run's report: {seen:?}"
    );
    assert!(seen.peak_rss_kib < MOST_RSS_KIB, "{seen:?}");
    // Each misbehaviour counted by its reason, the failing ones shown.
    for reason in ["timeout", "too_much"] {
        let n = sample(
            &metrics,
            &format!("iospan_qemu_monitor_failures_total{{reason=\"{reason}\"}}"),
        );
        assert!(n > 0, "no {reason} counted:\n{metrics}");
    }
    let failing = sample(&metrics, "iospan_qemu_monitors_failing");
    assert!(failing >= 4, "{failing} monitors failing:\n{metrics}");
    let shown: serde_json::Value = serde_json::from_str(&snapshot).unwrap();
    let monitors = shown["monitors"].as_array().map_or(0, Vec::len);
    assert!(monitors >= 4, "{monitors} monitors shown in the snapshot");
    let took = stopped.expect("SIGTERM did not stop the agent within 10 s");
    assert!(took < Duration::from_secs(5), "SIGTERM took {took:?}");
}
