//! Lost completions and VMs coming and going: counts stay exact, the next
//! VM is picked up, doctor names what runs.

use std::process::Command;

use agent_integration::{host_disk_of, iospan_bin, rig_and_image, run};
use serde_json::Value;
use xtask::guest::{self, Aio, DiskModel, RunArgs};

use super::*;

/// Some completions reach no eBPF program at all (docs/lost.md), more
/// of them while the host is busy with small system calls. Under such a
/// storm the VM's count stays exact: its disk's timed requests, those whose
/// completion never reached us, and those merged into others are the
/// guest's requests.
#[test]
fn counts_stay_exact_while_completions_go_missing() {
    let (rig, image) = rig_and_image();
    let host = host_disk_of(&image);
    let a = RunArgs {
        disk: DiskModel::VirtioBlk,
        aio: Aio::Native,
        qd: 16,
        ios: 4000,
        no_guest_agent: true,
        ..Default::default()
    };
    let (qemu, dev) = guest::qemu_command(&rig, &a, &image);
    let mut storm = Command::new("dd")
        .args(["if=/dev/zero", "of=/dev/null", "bs=1"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("dd");
    // Completions are lost a softirq's batch at a time: host reads of the
    // same image beside the guest's make more batches, and fuller ones.
    let mut reads = Command::new("fio")
        .args([
            "--name=beside",
            "--readonly",
            "--direct=1",
            "--rw=randread",
            "--bs=4k",
        ])
        .args([
            "--iodepth=8",
            "--ioengine=io_uring",
            "--time_based",
            "--runtime=90",
        ])
        // A thread, not a forked job: killing fio ends its I/O.
        .arg("--thread")
        .arg(format!("--filename={}", image.display()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("fio");
    let t = std::time::Instant::now();
    let (console, rep, _kept) = traced_run(&qemu, &host, "storm");
    for p in [&mut storm, &mut reads] {
        let _ = p.kill();
        let _ = p.wait();
    }
    let r = guest::parse(&console, &a, dev, t.elapsed().as_secs_f64())
        .unwrap_or_else(|e| panic!("{e:#}"));
    let vm = vd0_reads(&rep, &a.name);
    let summary = vm_summary(&rep, &a.name);
    let n = |v: &Value, k: &str| v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v}"));
    let (ios, undelivered) = (n(&vm, "ios"), n(&vm, "undelivered"));
    let merged = n(&summary, "engine_merged") + n(&summary, "host_merged");
    eprintln!(
        "storm: guest {}, timed {ios}, undelivered {undelivered} (host-wide {}), merged {merged}",
        r.guest_reads, rep["lost"]["undelivered"]
    );
    assert_eq!(
        ios + undelivered + merged,
        r.guest_reads,
        "VM {vm}\n{summary}\nlost {}",
        rep["lost"]
    );
    assert!(
        undelivered <= n(&rep["lost"], "undelivered"),
        "{}",
        rep["lost"]
    );
}

/// No host agent on the other end of the guest channel: the guest agent
/// neither blocks the guest's I/O nor fails; it keeps what it can and says
/// what it could not deliver.
#[test]
fn the_guest_agent_survives_an_absent_host() {
    let (rig, image) = rig_and_image();
    let a = RunArgs {
        ios: 1000,
        name: "alone".into(),
        ..Default::default()
    };
    let (mut qemu, dev) = guest::qemu_command(&rig, &a, &image);
    let t = std::time::Instant::now();
    let out = run(&mut qemu);
    let console: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    let r = guest::parse(&console, &a, dev, t.elapsed().as_secs_f64())
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        (r.workload["ios"].as_u64(), r.workload["errors"].as_u64()),
        (Some(1000), Some(0))
    );
    // "iospan: guest agent: S records sent, D dropped, U undelivered at exit"
    let last = console
        .iter()
        .find(|l| l.contains("iospan: guest agent:") && l.contains("undelivered"))
        .unwrap_or_else(|| panic!("the guest agent's closing line: {}", console.join("\n")));
    let n = |word: &str| -> u64 {
        let w: Vec<&str> = last.split_whitespace().collect();
        let i = w
            .iter()
            .position(|x| x.starts_with(word))
            .unwrap_or_else(|| panic!("{word} in {last}"));
        w[i - 1]
            .trim_end_matches(',')
            .parse()
            .unwrap_or_else(|_| panic!("{last}"))
    };
    assert_eq!(n("records"), 0, "{last}");
    assert!(n("undelivered") + n("dropped") >= a.ios, "{last}");
}

#[test]
fn doctor_names_a_running_vm_and_its_disks() {
    let (rig, image) = rig_and_image();
    let a = RunArgs {
        ios: 10_000_000,
        name: "doctor-vm".into(),
        disk_id: "sys0".into(),
        ..Default::default()
    };
    let (mut qemu, _) = guest::qemu_command(&rig, &a, &image);
    let mut child = qemu
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("qemu");
    // The process is there at once; its name and disks come from its argv.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let out = run(Command::new(iospan_bin()).args(["doctor", "--json"]));
    let text = run(Command::new(iospan_bin()).arg("doctor"));
    let _ = child.kill();
    let _ = child.wait();
    assert!(out.status.success());
    let d: Value = serde_json::from_slice(&out.stdout).unwrap();
    let vm = d["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "doctor-vm")
        .unwrap_or_else(|| panic!("{:#}", d["vms"]));
    assert_eq!(vm["pid"].as_u64(), Some(child.id() as u64));
    let disk = &vm["disks"][0];
    assert_eq!(disk["id"], "sys0");
    assert_eq!(disk["model"], "virtio-blk-pci");
    assert_eq!(disk["file"].as_str(), image.to_str());
    assert_eq!(vm["named_threads"], true, "{vm}");
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("completion probe: virtqueue_flush, entered with a push")
            && text.contains("host window split")
            && text.contains("guest channel: /"),
        "{text}"
    );
}

/// A VM killed mid-run leaves its partial counts in the report; the next
/// VM started during the same run is picked up, named, and counted.
#[test]
fn a_killed_vm_is_reported_and_the_next_one_picked_up() {
    let (rig, image) = rig_and_image();
    let host = host_disk_of(&image);
    let kept = Reports::in_temp(&[format!("iospan-rig-kill-{}.json", std::process::id())]);
    let report = kept.path(0);
    let mut agent = Command::new(iospan_bin())
        .args([
            "run",
            "--quiet",
            "--disk",
            &host,
            "--duration",
            "60s",
            "--json-out",
        ])
        .arg(report)
        .args(agent_integration::rig_split_args())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_secs(1));

    // A: endless workload, killed once it is well into it.
    let a = RunArgs {
        ios: 10_000_000,
        name: "victim".into(),
        disk_id: "va".into(),
        ..Default::default()
    };
    let (mut qa, _) = guest::qemu_command(&rig, &a, &image);
    let mut va = qa.stdout(std::process::Stdio::piped()).spawn().unwrap();
    well_into_its_workload(&mut va, 200);
    let probes_with_victim = bpf_links(agent.id());
    va.kill().unwrap();
    va.wait().unwrap();
    // Its probes in QEMU go with it: a virtio-blk VM has three (the used-ring
    // push, the merge accounting and the device model taking each request),
    // each a link the agent holds.
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(
        bpf_links(agent.id()) + 3,
        probes_with_victim,
        "the exited VM's uprobes are still attached"
    );

    // B: a normal run to completion.
    let b = RunArgs {
        ios: 1000,
        name: "successor".into(),
        disk_id: "vb".into(),
        ..Default::default()
    };
    let (mut qb, dev) = guest::qemu_command(&rig, &b, &image);
    let t = std::time::Instant::now();
    let out = run(&mut qb);
    let console: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    let rb = guest::parse(&console, &b, dev, t.elapsed().as_secs_f64()).unwrap();

    // SAFETY: kill(2) on our own child: the agent reports on SIGINT.
    unsafe { libc::kill(agent.id() as i32, libc::SIGINT) };
    let status = agent_integration::wait_limited(&mut agent, agent_integration::RUN_LIMIT)
        .expect("the agent did not end after SIGINT");
    assert!(status.success());
    let rep: Value = serde_json::from_slice(&std::fs::read(report).unwrap()).unwrap();
    let entry = |vm: &str, disk: &str| {
        rep["entries"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["vm"] == vm && e["disk"] == disk && e["op"] == "read")
            .cloned()
            .unwrap_or_else(|| panic!("no {vm}/{disk} entry: {rep:#}"))
    };
    let victim = entry("victim", "va");
    assert!(
        victim["ios"].as_u64().unwrap() > 100,
        "the killed VM's partial run: {victim}"
    );
    let successor = entry("successor", "vb");
    // Timed, untimed (completion never delivered) or merged into another.
    let ios = successor["ios"].as_u64().unwrap() + successor["undelivered"].as_u64().unwrap();
    let merged: u64 = rep["vms"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["name"] == "successor")
        .map(|v| v["engine_merged"].as_u64().unwrap() + v["host_merged"].as_u64().unwrap())
        .sum();
    assert!(
        ios + merged >= rb.guest_reads && ios <= rb.guest_reads + 16,
        "successor {successor} + merged {merged} vs guest {}",
        rb.guest_reads
    );
    for k in [
        "disk_conflicts",
        "slot_conflicts",
        "vm_table_full",
        "bpf_recursion_misses",
    ] {
        assert_eq!(
            rep["lost"][k].as_u64(),
            Some(0),
            "lost.{k}: {}",
            rep["lost"]
        );
    }
}

/// Waits until the guest of `qemu` has started its workload and QEMU has
/// read `ios` of its 4 KiB blocks since (its own block-layer reads, from
/// /proc/PID/io): however slowly this host boots it.
fn well_into_its_workload(qemu: &mut std::process::Child, ios: u64) {
    use std::io::{BufRead, BufReader};
    let out = qemu.stdout.take().expect("piped");
    let (started, seen) = std::sync::mpsc::channel();
    // The console is read to its end: a full pipe would stop the guest.
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if line.starts_with("IOSPAN-BEFORE") {
                let _ = started.send(());
            }
        }
    });
    seen.recv_timeout(std::time::Duration::from_secs(120))
        .expect("the victim's workload did not start within 120 s");
    let read_bytes = || {
        std::fs::read_to_string(format!("/proc/{}/io", qemu.id()))
            .ok()
            .and_then(|io| {
                io.lines()
                    .find_map(|l| l.strip_prefix("read_bytes: "))
                    .and_then(|v| v.trim().parse::<u64>().ok())
            })
            .expect("QEMU's /proc/PID/io")
    };
    let from = read_bytes();
    let until = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while read_bytes() < from + ios * 4096 {
        assert!(
            std::time::Instant::now() < until,
            "the victim read fewer than {ios} blocks in 120 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}
