//! The guest channel across guest agent restarts, host agent restarts and
//! guest reboots.

use std::process::Command;

use agent_integration::{host_disk_of, iospan_bin, rig_and_image};
use serde_json::Value;
use xtask::guest::{self, RunArgs};

use super::*;

/// The guest agent stopped and started again mid-run (as an upgrade or a
/// crash would): the host counts the sender starting over, loses no frame,
/// and joins the requests of both runs; those the guest saw with no agent
/// are counted as unmatched, not dropped.
#[test]
fn the_host_follows_a_guest_agent_restart() {
    let a = RunArgs {
        ios: 12000,
        agent_restart_s: Some(1),
        name: "restarted".into(),
        ..Default::default()
    };
    let run = accounted_run(&a, "agent-restart", "IOSPAN-AGENT-RESTART");
    let ch = &run.channel;
    assert!(ch["sender_restarts"].as_u64().unwrap() >= 1, "{ch}");
    assert_eq!(ch["lost_frames"].as_u64(), Some(0), "{ch}");
    assert_eq!(ch["decode_errors"].as_u64(), Some(0), "{ch}");
    // A good part of the run had an agent (how much depends on how long
    // the new one takes to load: 1-3 s under TCG); every workload read is
    // joined or counted: no guest record (the agent was down), or the
    // host's own reasons.
    assert!(run.joined * 4 >= run.reads, "{run}");
    assert!(
        run.joined + run.unmatched + run.host_reasons() >= run.reads,
        "{run}"
    );
}

/// A guest agent that reports seconds late, as one running only when a
/// busy guest is idle does: suspended for five seconds as the workload
/// starts, it sends those seconds' records when it runs again, while the
/// workload goes on. The host holds its requests for them (longer than its
/// hold, than its wall-clock wait) and joins every read.
#[test]
fn a_guest_agent_reporting_late_still_has_every_read_joined() {
    let a = RunArgs {
        ios: 12000,
        agent_stall_s: Some(5),
        name: "stalled".into(),
        ..Default::default()
    };
    let run = accounted_run(&a, "agent-stall", "IOSPAN-AGENT-STALLED 5");
    assert_eq!(
        run.channel["sender"]["ring_lost"].as_u64(),
        Some(0),
        "{run}"
    );
    assert!(run.joined + run.host_reasons() >= run.reads, "{run}");
    assert!(run.unmatched * 100 <= run.reads, "{run}");
}

/// A rig boot's workload reads and what became of them.
struct Accounted {
    reads: u64,
    joined: u64,
    /// Host requests no guest record came for.
    unmatched: u64,
    /// Joins refused as inconsistent.
    refused: u64,
    /// Completions the kernel ran no program for, known one by one (the
    /// disk-wide `lost.unseen` nets them against the host's other I/O).
    undelivered: u64,
    /// Host requests the split could not order.
    unsplit: u64,
    channel: Value,
    stitch: Value,
    lost: Value,
}

impl Accounted {
    /// Reads the host could not join for reasons of its own, counted.
    fn host_reasons(&self) -> u64 {
        self.refused + self.undelivered + self.unsplit
    }
}

impl std::fmt::Display for Accounted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "of {} reads: joined {}, unmatched {}, refused {}, undelivered {}, unsplit {}\n\
             stitch: {}\nlost: {}\nchannel: {}",
            self.reads,
            self.joined,
            self.unmatched,
            self.refused,
            self.undelivered,
            self.unsplit,
            self.stitch,
            self.lost,
            self.channel
        )
    }
}

/// Boots the rig guest `a` under `iospan run`, holds its console to show
/// `marker`, and accounts for its workload's reads.
fn accounted_run(a: &RunArgs, tag: &str, marker: &str) -> Accounted {
    let (rig, image) = rig_and_image();
    let host = host_disk_of(&image);
    let (qemu, dev) = guest::qemu_command(&rig, a, &image);
    let t = std::time::Instant::now();
    let (console, rep, _kept) = traced_run(&qemu, &host, tag);
    assert!(
        console.iter().any(|l| l.contains(marker)),
        "{}",
        console.join("\n")
    );
    let r = guest::parse(&console, a, dev, t.elapsed().as_secs_f64()).unwrap();
    let vm = vd0_reads(&rep, &a.name);
    let stitch = rep["stitch"].clone();
    Accounted {
        reads: r.workload_reads,
        joined: vm["stitched"]["count"].as_u64().unwrap_or(0),
        unmatched: stitch["unmatched_host"].as_u64().unwrap(),
        refused: stitch["inconsistent"].as_u64().unwrap(),
        undelivered: vm["undelivered"].as_u64().unwrap_or(0),
        unsplit: agent_integration::unsplit(&rep).counted,
        channel: guest_channel(&rep, &a.name),
        stitch,
        lost: rep["lost"].clone(),
    }
}

/// The host agent stopped and another started while the guest runs: each
/// hears the guest agent; what the guest wrote between them waits in its
/// queue and reaches the second, so nothing is dropped.
#[test]
fn the_guest_channel_survives_a_host_agent_restart() {
    let (rig, image) = rig_and_image();
    let a = RunArgs {
        // 15-25 s of workload: the first host agent hears its first
        // seconds, the second (after seconds of loading its programs) the
        // rest and the guest agent's exit.
        ios: 60000,
        name: "hostrestart".into(),
        ..Default::default()
    };
    let (mut qemu, dev) = guest::qemu_command(&rig, &a, &image);
    let t = std::time::Instant::now();
    let mut child = qemu
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("qemu");
    // The console, read as it comes: the first host agent starts once the
    // guest agent runs (before, there is nothing to hear).
    let (reader, rx) = console_of(&mut child);
    wait_for_console(&rx, "iospan: guest agent:");
    let runs = HostRuns::new(host_disk_of(&image));
    let first = runs.first_until_joined();
    // The second until the VM is gone, then stopped as an operator would.
    let second = runs
        .spawn(2)
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("iospan");
    let _ = child.wait();
    std::thread::sleep(std::time::Duration::from_secs(1));
    stop(&second);
    let second = runs.load(2, second.wait_with_output().expect("iospan"));
    let console = reader.join().expect("console reader");
    let r = guest::parse(&console, &a, dev, t.elapsed().as_secs_f64())
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(
        first["vms"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["name"] == "hostrestart"),
        "the first host agent did not find the VM: {}",
        first["vms"]
    );
    check_handover(&first, &second, &console, r.workload_reads);
}

/// A child's stdout read line by line as it comes: every line kept (the
/// thread's result) and sent to the receiver.
fn console_of(
    child: &mut std::process::Child,
) -> (
    std::thread::JoinHandle<Vec<String>>,
    std::sync::mpsc::Receiver<String>,
) {
    let stdout = child.stdout.take().expect("qemu stdout");
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .inspect(|l| {
                let _ = tx.send(l.clone());
            })
            .collect::<Vec<String>>()
    });
    (reader, rx)
}

fn wait_for_console(rx: &std::sync::mpsc::Receiver<String>, needle: &str) {
    let started = std::time::Instant::now();
    loop {
        let line = rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .unwrap_or_else(|e| {
                panic!(
                    "no {needle:?} on the console after {:?}: {e}",
                    started.elapsed()
                )
            });
        if line.contains(needle) {
            return;
        }
    }
}

fn stop(c: &std::process::Child) {
    // SAFETY: signalling a child we spawned and have not reaped.
    unsafe { libc::kill(c.id() as i32, libc::SIGINT) };
}

/// The two host agents of the restart, each with its report.
struct HostRuns {
    host: String,
    kept: Reports,
}

impl HostRuns {
    fn new(host: String) -> Self {
        let kept = Reports::in_temp(
            &[1, 2].map(|i| format!("iospan-host-restart-{}-{i}.json", std::process::id())),
        );
        Self { host, kept }
    }

    fn report(&self, i: u32) -> &std::path::Path {
        self.kept.path(i as usize - 1)
    }

    fn spawn(&self, i: u32) -> Command {
        let mut c = Command::new(iospan_bin());
        c.args([
            "run",
            "--quiet",
            "--disk",
            &self.host,
            "-d",
            "5m",
            "--json-out",
        ])
        .arg(self.report(i))
        .args(agent_integration::rig_split_args());
        c
    }

    fn load(&self, i: u32, out: std::process::Output) -> Value {
        assert!(
            out.status.success(),
            "host run {i}: {}\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
        serde_json::from_slice(&std::fs::read(self.report(i)).unwrap()).unwrap()
    }

    /// The first runs until it has joined a guest record to its request
    /// (its per-request stream shows one), however long this host takes to
    /// load its programs and follow the VM: a fixed 2 s once ended before
    /// the guest agent had sent it anything.
    fn first_until_joined(&self) -> Value {
        let stream = tempfile::NamedTempFile::new().expect("a temporary file");
        let first = self
            .spawn(1)
            .arg("--events-out")
            .arg(stream.path())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("iospan");
        let until = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while !std::fs::read_to_string(stream.path())
            .unwrap_or_default()
            .contains("\"kind\":\"guest_io\"")
        {
            if std::time::Instant::now() >= until {
                stop(&first);
                panic!("the first host agent joined no guest record in 120 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        stop(&first);
        self.load(1, first.wait_with_output().expect("iospan"))
    }
}

/// Nothing lost at the handover between the two host agents.
fn check_handover(first: &Value, second: &Value, console: &[String], workload_reads: u64) {
    let (c1, c2) = (
        guest_channel(first, "hostrestart"),
        guest_channel(second, "hostrestart"),
    );
    for c in [&c1, &c2] {
        assert!(c["records"].as_u64().unwrap() > 0, "{c}");
        assert_eq!(c["lost_frames"].as_u64(), Some(0), "{c}");
    }
    // The first host agent's stream ends where it stopped reading; the
    // second may start on the tail of a frame the guest agent was writing
    // then (skipped to the next frame, counted as one decode error).
    assert_eq!(c1["decode_errors"].as_u64(), Some(0), "{c1}");
    assert!(c2["decode_errors"].as_u64().unwrap() <= 1, "{c2}");
    // What the first host agent did not acknowledge, the guest agent sent
    // again to the second (which may thus also hear a few the first
    // handled). Every workload read reached one of them; the guest agent
    // dropped nothing and had nothing left undelivered when it exited.
    let records = c1["records"].as_u64().unwrap() + c2["records"].as_u64().unwrap();
    assert!(
        records >= workload_reads,
        "{c1} {c2} vs {workload_reads} workload reads"
    );
    let last = console
        .iter()
        .find(|l| l.contains("iospan: guest agent:") && l.contains("undelivered"))
        .unwrap_or_else(|| panic!("the guest agent's closing line: {}", console.join("\n")));
    assert!(
        last.contains(" 0 dropped, 0 unconfirmed, 0 undelivered"),
        "{last}"
    );
    let joined = vd0_reads(second, "hostrestart")["stitched"]["count"]
        .as_u64()
        .unwrap_or(0);
    assert!(
        joined > 0,
        "the second host agent joined nothing: {}",
        second["stitch"]
    );
}

/// The guest reboots mid-run: its new agent starts over on the same
/// channel, the host counts the restart and joins the second boot's
/// requests too.
#[test]
fn the_host_follows_a_guest_reboot() {
    let (rig, image) = rig_and_image();
    let host = host_disk_of(&image);
    let a = RunArgs {
        ios: 1000,
        reboot: true,
        name: "rebooted".into(),
        ..Default::default()
    };
    let (qemu, _) = guest::qemu_command(&rig, &a, &image);
    let (console, rep, _kept) = traced_run(&qemu, &host, "reboot");
    let console = console.join("\n");
    assert!(console.contains("IOSPAN-REBOOTING"), "{console}");
    let runs: Vec<Value> = console
        .lines()
        .filter_map(|l| l.split_once("IOSPAN-WORKLOAD ").map(|(_, j)| j))
        .map(|j| serde_json::from_str(j).unwrap())
        .collect();
    assert_eq!(runs.len(), 2, "one workload per boot: {console}");
    for w in &runs {
        assert_eq!(
            (w["ios"].as_u64(), w["errors"].as_u64()),
            (Some(a.ios), Some(0)),
            "{w}"
        );
    }
    let ch = guest_channel(&rep, "rebooted");
    assert!(ch["sender_restarts"].as_u64().unwrap() >= 1, "{ch}");
    assert_eq!(ch["lost_frames"].as_u64(), Some(0), "{ch}");
    assert_eq!(ch["decode_errors"].as_u64(), Some(0), "{ch}");
    assert!(ch["records"].as_u64().unwrap() >= 2 * a.ios, "{ch}");
    let vm = vd0_reads(&rep, "rebooted");
    let joined = vm["stitched"]["count"].as_u64().unwrap_or(0);
    let stitch = &rep["stitch"];
    // Both boots' requests are the virtual disk's and are joined.
    assert!(
        joined * 100 >= 2 * a.ios * 95,
        "joined {joined} of {} over two boots: {stitch} {ch}",
        2 * a.ios
    );
}
