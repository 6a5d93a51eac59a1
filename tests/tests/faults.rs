//! Faults around a running agent: an OTLP endpoint that goes away and comes
//! back while `iospan agent` exports, and a runs directory whose
//! filesystem is full when `iospan run --label` stores its run. (A QEMU
//! killed mid-request: `rig::lifecycle`; a guest agent restarting:
//! `rig::channel`; SIGHUP with a broken file: `service`.)

use std::{
    io::{Read, Write},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use agent_integration::{iospan_bin, kvm_image, kvm_vm, run, wait_limited};
use xtask::{backends::free_port, otlp_sink::OtlpSink};

struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn get(addr: &str, path: &str) -> (u16, String) {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return (0, String::new());
    };
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    );
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    agent_integration::status_and_body(&out)
}

/// A trace outcome's count; 0 before the first refresh of /metrics.
fn traces_total(metrics: &str, outcome: &str) -> u64 {
    let key = format!("iospan_traces_total{{outcome=\"{outcome}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// One helper VM (real KVM notifications, an engine reading its disk) for
/// `n` reads.
fn vm(exe: &Path, image: &Path, name: &str, n: u64) {
    let out = run(Command::new(exe)
        .args(["-name", &format!("guest={name},debug-threads=on")])
        .arg("-drive")
        .arg(format!(
            "file={},if=none,id=fd0,format=raw,cache=none,aio=native",
            image.display()
        ))
        .args(["-device", "virtio-blk-pci,drive=fd0"])
        .env("IOSPAN_KVM_IOS", n.to_string()));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_service_rides_out_a_collector_that_goes_away_and_comes_back() {
    let exe = kvm_vm(Path::new(env!("CARGO_TARGET_TMPDIR")));
    let image = kvm_image(exe.parent().unwrap());
    let mut collector = OtlpSink::down(free_port().unwrap());
    collector.up().unwrap();
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("faults-otlp");
    std::fs::create_dir_all(&dir).unwrap();
    let conf = dir.join("agent.toml");
    std::fs::write(
        &conf,
        format!(
            "[api]\nlisten = \"{addr}\"\ntoken_file = \"{}\"\n\
             [otlp]\nendpoint = \"http://127.0.0.1:{}\"\nprotocol = \"http/protobuf\"\n\
             [traces]\none_in = 1\n",
            dir.join("token").display(),
            collector.port
        ),
    )
    .unwrap();
    let mut agent = Agent(
        Command::new(iospan_bin())
            .args(["agent", "--config"])
            .arg(&conf)
            .env("OTEL_METRICS_EXPORTER", "none")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let t = Instant::now();
    while get(&addr, "/healthz").0 != 200 {
        assert!(t.elapsed() < Duration::from_secs(30), "never healthy");
        std::thread::sleep(Duration::from_millis(200));
    }
    let metrics = || get(&addr, "/metrics").1;
    // Exports flow, then stop with the collector, then flow again: each
    // phase's figures seen on /metrics before the next.
    let until = |what: &str, ok: &dyn Fn(&str) -> bool| {
        let t = Instant::now();
        loop {
            let m = metrics();
            if ok(&m) {
                return m;
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "{what}: never so\n{m}"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    };
    vm(&exe, &image, "flap-1", 200);
    until("exports taken", &|m| traces_total(m, "exported") > 0);
    assert!(collector.traces() > 0);

    collector.stop();
    let before = traces_total(&metrics(), "failed");
    let exported_up = traces_total(&metrics(), "exported");
    vm(&exe, &image, "flap-2", 200);
    let down = until("exports failing while the collector is down", &|m| {
        traces_total(m, "failed") > before
    });
    assert_eq!(
        get(&addr, "/healthz").0,
        200,
        "unhealthy with the collector down"
    );
    assert!(exported_up > 0, "{down}");

    collector.up().unwrap();
    let (exported, taken) = (traces_total(&down, "exported"), collector.traces());
    vm(&exe, &image, "flap-3", 200);
    until("exports taken again", &|m| {
        traces_total(m, "exported") > exported
    });
    assert!(
        collector.traces() > taken,
        "the collector took nothing after it came back"
    );

    // Every I/O offered is accounted for: exported, failed or dropped.
    let m = metrics();
    let offered = traces_total(&m, "chosen");
    let accounted = traces_total(&m, "exported")
        + traces_total(&m, "failed")
        + traces_total(&m, "dropped_queue_full");
    assert!(accounted <= offered, "{m}");

    unsafe { libc::kill(agent.0.id() as i32, libc::SIGTERM) };
    let status = wait_limited(&mut agent.0, Duration::from_secs(40))
        .expect("the agent did not stop on SIGTERM");
    let mut log = String::new();
    agent
        .0
        .stderr
        .as_mut()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert!(status.success(), "{log}");
    collector.stop();
}

/// A tmpfs of `size` at a new directory, filled to the last byte.
struct FullFs(PathBuf);

impl FullFs {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("iospan-full-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = run(Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=256k", "iospan-full"])
            .arg(&dir));
        assert!(
            out.status.success(),
            "mount: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let fs = Self(dir);
        fs.fill();
        fs
    }

    fn fill(&self) {
        let mut f = std::fs::File::create(self.0.join("filler")).unwrap();
        let block = [0u8; 4096];
        while f.write_all(&block).is_ok() {}
    }

    fn free(&self) {
        std::fs::remove_file(self.0.join("filler")).unwrap();
    }
}

impl Drop for FullFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[test]
fn a_full_runs_filesystem_leaves_no_partial_run_and_the_label_free() {
    let fs = FullFs::new("runs");
    let runs = fs.0.join("runs");
    let label = |extra: &[&str]| {
        run(Command::new(iospan_bin())
            .args([
                "run",
                "--quiet",
                "--no-vms",
                "--label",
                "full",
                "--runs-dir",
            ])
            .arg(&runs)
            .args(extra)
            .args(["--", "sh", "-c", "sleep 2"]))
    };
    // The directory is made (a directory takes no blocks on tmpfs), the
    // run's file cannot be: refused, naming the file and the cause.
    std::fs::create_dir_all(&runs).unwrap();
    let out = label(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a run stored on a full filesystem: {err}"
    );
    assert!(
        err.contains("No space left on device") && err.contains("run.json"),
        "{err}"
    );
    // Nothing half-written left behind.
    let left: Vec<String> = walk(&runs);
    assert!(
        left.iter()
            .all(|p| !p.ends_with(".json") && !p.ends_with(".tmp")),
        "{left:?}"
    );
    // With room again, the same label is free and stored whole.
    fs.free();
    let out = label(&[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stored: serde_json::Value =
        serde_json::from_slice(&std::fs::read(runs.join("full/run.json")).unwrap()).unwrap();
    assert_eq!(stored["label"], "full", "{stored:#}");
}

/// Every file under `dir`, as paths.
fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p.display().to_string());
        }
    }
    out
}
