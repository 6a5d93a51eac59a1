//! The kernel matrix: the release binary inside Debian's cloud kernels of
//! bullseye (5.10), bookworm (6.1) and trixie (6.12), booted under QEMU
//! (`xtask::matrix`). On each: `iospan doctor`'s verdicts against what then
//! loads; the block split exact against the disk's own counters; the VM
//! split of a VM-shaped process (vm_load under -accel tcg: vCPU threads
//! kicking eventfds, an io_uring engine, interrupts raised in user space)
//! exact and tiling in every flavour iospan may choose there — fentry and
//! kprobes on eventfd_read/eventfd_write, which this machine's kernel
//! lacks, among them — and in the deep tier; the guest agent recording;
//! the kernel's vhost-scsi worker serving a VM process from LIO (iblock and
//! fileio), LIO's and the disk's own counts held.
//! A kernel iospan does not support is refused with one line.

use std::collections::BTreeSet;

use serde_json::Value;
use xtask::matrix::{self, Outcome};

fn boot(series: &str) -> Outcome {
    let r = matrix::release(series).unwrap();
    let o = matrix::run(r).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!(
        "Debian {} ({}): {:.0} s",
        r.suite,
        o.file("kernel").unwrap().trim(),
        o.seconds
    );
    o
}

fn works(doctor: &Value, probe: &str) -> bool {
    doctor["probes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["probe"] == probe)
        .unwrap_or_else(|| panic!("doctor did not try {probe}: {doctor:#}"))["works"]
        == true
}

/// The flavour of each attachment in a report: tracepoint (or function)
/// name → flavour.
fn flavours(rep: &Value) -> Vec<(String, String)> {
    rep["probes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["tracepoint"].as_str().unwrap().to_string(),
                p["flavour"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn field(text: &str, key: &str) -> u64 {
    text.split_whitespace()
        .find_map(|w| w.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key} in {text}"))
        .parse()
        .unwrap()
}

/// Reads and writes the disk completed between two /sys/block/*/stat lines.
fn stat_ios(before: &str, after: &str) -> u64 {
    let d = stat_ops(before, after);
    d.read + d.write
}

/// Requests a disk completed, per op.
#[derive(Debug, Default, PartialEq, Eq)]
struct Ops {
    read: u64,
    write: u64,
    flush: u64,
}

/// A disk's requests completed between two readings of its
/// /sys/block/*/stat (flushes: its 16th field).
fn stat_ops(before: &str, after: &str) -> Ops {
    let f = |s: &str| -> Vec<u64> { s.split_whitespace().map(|v| v.parse().unwrap()).collect() };
    let (b, a) = (f(before), f(after));
    let at = |i: usize| a.get(i).copied().unwrap_or(0) - b.get(i).copied().unwrap_or(0);
    Ops {
        read: at(0),
        write: at(4),
        flush: at(15),
    }
}

/// iospan's count of the rows `pick` selects, per op.
fn ops_of(rep: &Value, pick: impl Fn(&Value) -> bool) -> Ops {
    let mut o = Ops::default();
    for e in rep["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| pick(e))
    {
        let n = e["ios"].as_u64().unwrap();
        match e["op"].as_str() {
            Some("read") => o.read += n,
            Some("write") => o.write += n,
            Some("flush") => o.flush += n,
            _ => {}
        }
    }
    o
}

/// The block split: every request the disk completed, counted.
fn block_split_exact(o: &Outcome, doctor: &Value) {
    assert_eq!(
        o.rc("block").unwrap(),
        0,
        "{}",
        o.file("block.err").unwrap()
    );
    let rep = o.json("block.json").unwrap();
    let ios: u64 = rep["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["disk"] == "vda" && e["vm"].is_null())
        .map(|e| e["ios"].as_u64().unwrap())
        .sum();
    let disk = stat_ios(
        &o.file("block.before").unwrap(),
        &o.file("block.after").unwrap(),
    );
    assert_eq!(
        ios + rep["lost"]["unseen"].as_u64().unwrap(),
        disk,
        "{}",
        rep["lost"]
    );
    assert!(disk >= 3000, "the workload's 3000 reads: {disk}");
    let want = if works(doctor, "tp_btf") {
        "tp_btf"
    } else {
        "raw_tp"
    };
    for (tp, f) in flavours(&rep) {
        if tp.starts_with("block_") {
            assert_eq!(
                f,
                want,
                "{tp}: doctor says tp_btf works: {}",
                want == "tp_btf"
            );
        }
    }
}

/// Linux 6.10 on: with the iblock backstore's `submit_type` 1 (direct) the
/// vhost worker, a thread of the VM's process, submits its commands itself:
/// every read of the disk is the VM's.
fn vhost_scsi_direct_submission_is_the_vms(o: &Outcome) {
    let name = "vhost-0-read-direct";
    assert_eq!(
        o.rc(name).unwrap(),
        0,
        "{}",
        o.file(&format!("{name}.err")).unwrap()
    );
    let disk = stat_ios(
        &o.file(&format!("{name}.stat.before")).unwrap(),
        &o.file(&format!("{name}.stat.after")).unwrap(),
    );
    assert_eq!(disk, 500, "{name}: vdc's own count");
    vm_counts_its_lun(
        o,
        name,
        &o.json(&format!("{name}.json")).unwrap(),
        "0",
        disk,
    );
}

/// The VM's requests on its vhost-scsi LUN `lun`: all of its backing
/// disk's (`disk` of them), whichever task submitted them (LIO's workqueue
/// by default, followed from the worker by kprobes on target_core_mod; the
/// always-on tier attaches no system-call tracepoint), at least 95 % split
/// (kick, the worker's pop, submission, completion, the worker's signal:
/// kprobes on vhost) and the rest counted by cause, the segments tiling
/// each window.
fn vm_counts_its_lun(o: &Outcome, name: &str, rep: &Value, lun: &str, disk: u64) {
    let id = format!("scsi0/lun_{lun}");
    let entries: Vec<&Value> = rep["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["vm"] == "matrix-vhost" && e["disk"] == id.as_str())
        .collect();
    let ios: u64 = entries.iter().map(|e| e["ios"].as_u64().unwrap()).sum();
    assert_eq!(
        ios, disk,
        "{name}: the VM's count of its LUN: {:#}",
        rep["entries"]
    );
    let seg = |e: &Value, s: &str, k: &str| e["segments"][s][k].as_f64().unwrap_or(0.0);
    let split: u64 = entries
        .iter()
        .map(|e| seg(e, "host_window", "count") as u64)
        .sum();
    let unsplit = agent_integration::unsplit(rep);
    assert_eq!(
        split + unsplit.counted + unsplit.polled,
        ios,
        "{name}: every request split or counted: {}",
        rep["lost"]["host_split"]
    );
    // The run's own log (the agent's warnings, and its attachments where
    // the run is verbose) says why a disk's requests went unsplit.
    assert!(
        split * 100 >= ios * 95,
        "{name}: {split} of {ios} split: {}\nthe run's log:\n{}",
        rep["lost"]["host_split"],
        o.file(&format!("{name}.err")).unwrap_or_default()
    );
    for e in &entries {
        let window = seg(e, "host_window", "mean_us");
        let tiled: f64 = ["hypervisor", "engine", "device"]
            .iter()
            .map(|s| seg(e, s, "mean_us"))
            .sum();
        assert!(
            window > 0.0 && (tiled - window).abs() <= window / 100.0,
            "{name}: the segments ({tiled} µs) tile the window ({window} µs): {:#}",
            e["segments"]
        );
    }
    let attached: Vec<(String, String)> = flavours(rep);
    for f in [
        "target_init_cmd",
        "__target_execute_cmd",
        "vhost_poll_wakeup",
        "vhost_disable_notify",
        "vhost_signal",
    ] {
        assert!(
            attached.iter().any(|(tp, fl)| tp == f && fl == "kprobe"),
            "{name}: no kprobe on {f}: {attached:?}"
        );
    }
    if rep["tier"] == "always-on" {
        assert!(
            !attached.iter().any(|(tp, _)| tp.starts_with("syscalls:")),
            "{name}: a system-call tracepoint in the always-on tier: {attached:?}"
        );
    }
}

/// LIO's command count of one backstore (`HBA/NAME`) in a `lio_cmds`
/// listing.
fn lio_cmds(listing: &str, backstore: &str) -> u64 {
    listing
        .lines()
        .find_map(|l| l.strip_prefix(backstore)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {backstore} in LIO's listing:\n{listing}"))
}

/// The kernel's own vhost-scsi worker serving a VM process of the suite's
/// (tests/native/vhost_scsi.c) from LIO: an iblock LUN on vdc and a fileio
/// LUN on vda (through its page cache), reads and writes. Every command the
/// VM had answered is LIO's count of that backstore; each LUN's backing
/// disk's own count is iospan's count of it and the VM's of its LUN (the
/// iblock LUN's one request per command), the other disk untouched; the
/// VM, its vhost-scsi disks, the worker and the target's export are named.
fn vhost_scsi_counts_exact(o: &Outcome, series: &str) {
    assert_eq!(o.rc("lio").unwrap(), 0, "{}", o.file("lio.err").unwrap());
    let runs = [
        ("0", "read", "iblock_0/vdc"),
        ("0", "write", "iblock_0/vdc"),
        ("1", "read", "fileio_1/vda"),
        ("1", "write", "fileio_1/vda"),
    ];
    for (lun, op, backstore) in runs {
        let name = format!("vhost-{lun}-{op}");
        let out = vhost_run_answered(o, &name);
        let (before, after) = (
            o.file(&format!("{name}.cmds.before")).unwrap(),
            o.file(&format!("{name}.cmds.after")).unwrap(),
        );
        for b in ["iblock_0/vdc", "fileio_1/vda"] {
            let lio = lio_cmds(&after, b) - lio_cmds(&before, b);
            let want = if b == backstore {
                field(&out, "commands=")
            } else {
                0
            };
            assert_eq!(lio, want, "{name}: LIO's count of {b}");
        }
        let stat = |disk: &str| {
            let file = if disk == "vdc" { "stat" } else { disk };
            stat_ops(
                &o.file(&format!("{name}.{file}.before")).unwrap(),
                &o.file(&format!("{name}.{file}.after")).unwrap(),
            )
        };
        let (backing, other) = if lun == "0" {
            ("vdc", "vda")
        } else {
            ("vda", "vdc")
        };
        assert_eq!(stat(other), Ops::default(), "{name}: {other}'s own count");
        let own = stat(backing);
        let rep = o.json(&format!("{name}.json")).unwrap();
        let counted = ops_of(&rep, |e| e["host_disk"] == backing && e["vm"].is_null());
        assert_eq!(counted, own, "{name}: iospan's count of {backing}");
        if lun == "0" {
            let want = Ops {
                read: if op == "read" { 500 } else { 0 },
                write: if op == "write" { 500 } else { 0 },
                flush: 0,
            };
            assert_eq!(own, want, "{name}: vdc's own count, a request a command");
        }
        // LIO's file backstore writes through (O_DSYNC): each write's
        // flush is an empty pre-flush write the block layer serves with a
        // flush request of its own, lending it the write's tag; the disk
        // counts both. iospan counts the VM's once, as the flush, where the
        // kernel starts requests in their submitter (block_io_start, 6.5
        // on); before, the flush request starts nowhere and both are the
        // host's.
        let vm = ops_of(&rep, |e| {
            e["vm"] == "matrix-vhost" && e["disk"] == format!("scsi0/lun_{lun}").as_str()
        });
        let want = Ops {
            write: own.write - own.flush,
            flush: if series == "6.1" { 0 } else { own.flush },
            ..own
        };
        assert_eq!(
            vm, want,
            "{name}: the VM's count of its LUN, the disk's {own:?}"
        );
        let disk = vm.read + vm.write + vm.flush;
        vm_counts_its_lun(o, &name, &rep, lun, disk);
        vhost_vm_named(&rep);
    }
}

/// A vhost run's driver answered all its 500 requests: its output.
fn vhost_run_answered(o: &Outcome, name: &str) -> String {
    vhost_run_answered_of(o, name, 500)
}

/// A vhost run's driver answered all its `ios` requests: its output.
fn vhost_run_answered_of(o: &Outcome, name: &str, ios: u64) -> String {
    let err = o.file(&format!("{name}.err")).unwrap();
    assert_eq!(o.rc(name).unwrap(), 0, "{name}: {err}");
    let out = o.file(&format!("{name}.out")).unwrap();
    assert_eq!(field(&out, "requests="), ios, "{name}: {out}");
    assert_eq!(field(&out, "errors="), 0, "{name}: {out}");
    out
}

/// The verdict line of a compare at `at` ("mean", "p99"): the segment it
/// names and its share of the change, in %.
fn verdict(cmp: &str, at: &str) -> (String, f64) {
    let line = cmp
        .lines()
        .find(|l| l.contains(&format!("→ at {at}: ")))
        .unwrap_or_else(|| panic!("no verdict at {at}:\n{cmp}"));
    let rest = line.split(&format!("→ at {at}: ")).nth(1).unwrap();
    let segment = rest.split(" explains ").next().unwrap().to_string();
    let share = rest
        .split(" explains ")
        .nth(1)
        .and_then(|s| s.split('%').next())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("no share in {line}"));
    (segment, share)
}

/// In-kernel against user-space, and a delayed backstore: the same 500
/// reads of vdc through the vhost-scsi worker and through an io_uring
/// engine, stored as labelled runs, compared segment by segment (both
/// split whole); the vhost-scsi reads of vdd, which the host delays, differ
/// from vdc's in the device segment.
fn vhost_scsi_compared(o: &Outcome) {
    let err = o.file("uring.err").unwrap();
    assert_eq!(o.rc("uring").unwrap(), 0, "{err}");
    let uring = o.json("uring.json").unwrap();
    let split: u64 = uring["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["vm"] == "matrix-uring")
        .filter_map(|e| e["segments"]["host_window"]["count"].as_u64())
        .sum();
    assert_eq!(
        split, 500,
        "the io_uring run split whole: {}",
        uring["lost"]
    );
    let slow = "vhost-2-read";
    vhost_run_answered(o, slow);
    let rep = o.json(&format!("{slow}.json")).unwrap();
    vm_counts_its_lun(o, slow, &rep, "2", 500);

    for (name, b) in [("engines", "io_uring"), ("delay", "vhost-scsi-delayed")] {
        let cmp = o.file(&format!("compare-{name}.out")).unwrap();
        assert_eq!(o.rc(&format!("compare-{name}")).unwrap(), 0, "{cmp}");
        assert!(
            cmp.contains(&format!(
                "vhost-scsi vs {b} — scsi0/lun_0 read (A: matrix-vhost 500 I/Os, host window; B: "
            )),
            "{cmp}"
        );
        assert!(cmp.contains("500 I/Os, host window)"), "{cmp}");
        let (segment, _) = verdict(&cmp, "mean");
        assert!(
            ["hypervisor", "engine", "device"].contains(&segment.as_str()),
            "{cmp}"
        );
    }
    // QEMU's throttle holds each of vdd's requests some 40 ms (8 in
    // flight at 200 IOPS): the device segment is the change.
    let cmp = o.file("compare-delay.out").unwrap();
    let (segment, share) = verdict(&cmp, "mean");
    assert_eq!(segment, "device", "{cmp}");
    assert!(share >= 90.0, "{cmp}");
}

/// The deep tier (which times CPU waits) on vhost-scsi, Linux 6.4 on: the
/// reads split as in the always-on tier; with the worker starved of CPU
/// (pinned beside a busy loop), the worker's CPU waits are what grew, in
/// the hypervisor and engine segments, and the diagnosis names the worker
/// and where to pin it.
fn vhost_scsi_starved(o: &Outcome) {
    let mean = |rep: &Value, seg: &str| -> f64 {
        rep["entries"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["vm"] == "matrix-vhost")
            .and_then(|e| e["segments"][seg]["mean_us"].as_f64())
            .unwrap_or_else(|| panic!("no {seg} in {:#}", rep["entries"]))
    };
    let waits = |rep: &Value| mean(rep, "hypervisor_cpu_wait") + mean(rep, "engine_cpu_wait");
    let mut reps = Vec::new();
    for (name, ios) in [("vhost-0-read-deep", 500), ("vhost-0-read-starved", 200)] {
        let out = vhost_run_answered_of(o, name, ios);
        let rep = o.json(&format!("{name}.json")).unwrap();
        assert_eq!(rep["tier"], "deep");
        let disk = stat_ios(
            &o.file(&format!("{name}.stat.before")).unwrap(),
            &o.file(&format!("{name}.stat.after")).unwrap(),
        );
        assert_eq!(disk, ios, "{name}: vdc's own count: {out}");
        vm_counts_its_lun(o, name, &rep, "0", disk);
        reps.push(rep);
    }
    // Woken by a kick, the starved worker waits for its CPU before it
    // pops: most of the hypervisor segment. (Its wait to run the completion
    // work is in the engine segment, not timed as a CPU wait.)
    let (free, starved) = (&reps[0], &reps[1]);
    assert!(
        waits(starved) >= 10.0 * waits(free).max(1.0)
            && mean(starved, "hypervisor_cpu_wait") >= 0.5 * mean(starved, "hypervisor"),
        "the starved worker's CPU waits ({} µs; {} µs of the hypervisor's {} µs) against {} µs",
        waits(starved),
        mean(starved, "hypervisor_cpu_wait"),
        mean(starved, "hypervisor"),
        waits(free)
    );
    let d = &starved["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["vm"] == "matrix-vhost")
        .unwrap()["diagnosis"];
    assert_eq!(d["cause"], "engine_cpu_wait", "{d:#}");
    assert!(d["summary"].as_str().unwrap().contains("vhost-"), "{d:#}");
    assert!(
        d["knob"]["qemu"].as_str().is_some_and(
            |k| k.starts_with("taskset -pc 0 ") && k.ends_with("(the disk's vhost worker)")
        ),
        "{d:#}"
    );
}

/// The vhost VM, its LUN on vdc, the worker and the export, named.
fn vhost_vm_named(rep: &Value) {
    let vm = &rep["vms"][0];
    assert_eq!(vm["name"], "matrix-vhost", "{vm}");
    let lun0 = vm["vdisks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["id"] == "scsi0/lun_0")
        .unwrap_or_else(|| panic!("no vhost-scsi LUN 0: {vm}"));
    assert_eq!(lun0["model"], "vhost-scsi-pci");
    assert_eq!(lun0["backing"], "/dev/vdc");
    let engine = vm["engines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["disk"] == "scsi0/lun_0")
        .unwrap_or_else(|| panic!("no engine of LUN 0: {vm}"));
    assert_eq!(engine["export"], "naa.5001405c0ffee001/lun_0", "{engine}");
    assert!(
        engine["program"]
            .as_str()
            .is_some_and(|p| p.starts_with("vhost-")),
        "{engine}"
    );
}

/// The guest agent on this kernel as a guest's: its probes attached and
/// every I/O of the workload recorded (sent over the channel, held, or
/// dropped and counted).
fn guest_agent_records(o: &Outcome) {
    let err = o.file("guest.err").unwrap();
    assert_eq!(o.rc("guest").unwrap(), 0, "{err}");
    let line = err
        .lines()
        .find(|l| l.contains("records sent"))
        .unwrap_or_else(|| panic!("no account from the guest agent: {err}"));
    let n = |after: &str| -> u64 {
        let words: Vec<&str> = line.split_whitespace().collect();
        let i = words
            .iter()
            .position(|w| w.trim_end_matches(',') == after)
            .unwrap_or_else(|| panic!("no {after} in the guest agent's account: {line}"));
        words[i - 1]
            .parse()
            .unwrap_or_else(|_| panic!("no count before {after}: {line}"))
    };
    let recorded = n("records") + n("dropped") + n("undelivered");
    assert!(
        recorded >= 2000,
        "the workload's 2000 reads, {recorded} recorded: {line}"
    );
    let channel = std::fs::metadata(o.out.join("channel.bin"))
        .map(|m| m.len())
        .unwrap_or(0);
    assert!(channel > 0, "nothing written to the guest channel");
}

/// Programs that may rightly not run in a short run (requeues, merges,
/// io-wq hand-offs of a device that never refused a request).
const MAY_NOT_FIRE: &[&str] = &[
    "block_rq_requeue",
    // Requests issued directly (no I/O scheduler) are never inserted.
    "block_rq_insert",
    "block_bio_backmerge",
    "block_bio_frontmerge",
    "block_rq_merge",
    "io_uring_queue_async_work",
    "sys_enter_io_submit",
    "sys_enter_close",
    // The old eventfd(2): C libraries make eventfd2.
    "sys_exit_eventfd",
    "block_acct_merge_done",
];

/// A VM run: its requests counted exactly, split, the segments tiling the
/// window, every program it attached run.
fn vm_split_exact(o: &Outcome, mode: &str) -> Value {
    let err = o.file(&format!("vm-{mode}.err")).unwrap();
    assert_eq!(o.rc(&format!("vm-{mode}")).unwrap(), 0, "{mode}: {err}");
    let rep = o.json(&format!("vm-{mode}.json")).unwrap();
    let made = field(&o.file(&format!("vm-{mode}.out")).unwrap(), "requests=");
    assert_eq!(made, 2000, "{mode}");
    let vm = format!("matrix-{mode}");
    let e = rep["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["vm"] == vm.as_str() && e["disk"] == "d0" && e["op"] == "read")
        .unwrap_or_else(|| panic!("{mode}: no entry of {vm}/d0: {:#}", rep["entries"]));
    let v = rep["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == vm.as_str())
        .unwrap();
    let merged = v["host_merged"].as_u64().unwrap() + v["engine_merged"].as_u64().unwrap();
    let ios = e["ios"].as_u64().unwrap();
    assert_eq!(
        ios + merged + e["undelivered"].as_u64().unwrap_or(0),
        made,
        "{mode}: {e}"
    );
    let split = &rep["lost"]["host_split"];
    let unsplit = agent_integration::unsplit(&rep);
    let unsplit = unsplit.counted + unsplit.polled;
    let seg = |k: &str| e["segments"][k].clone();
    let count = seg("host_window")["count"].as_u64().unwrap();
    assert_eq!(
        count + unsplit,
        ios,
        "{mode}: every request split or counted unsplit: {split}"
    );
    assert!(
        count * 100 >= ios * 95,
        "{mode}: {count} of {ios} split: {split}"
    );
    let mean = |k: &str| seg(k)["mean_us"].as_f64().unwrap();
    let tiled = mean("hypervisor") + mean("engine") + mean("device");
    assert!(
        (tiled - mean("host_window")).abs() <= 0.01 * mean("host_window"),
        "{mode}: segments {tiled} vs window {}",
        mean("host_window")
    );
    let fired: BTreeSet<String> = rep["agent"]["bpf"]
        .as_array()
        .unwrap_or_else(|| panic!("{mode}: no program statistics: {:#}", rep["agent"]))
        .iter()
        .filter(|p| p["run_count"].as_u64().unwrap_or(0) > 0)
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect();
    // Loaded is not attached: each attached program must have run.
    for p in rep["probes"].as_array().unwrap() {
        let name = p["program"].as_str().unwrap();
        let base = name
            .trim_end_matches("_btf")
            .trim_end_matches("_fentry")
            .trim_end_matches("_kprobe");
        assert!(
            fired.contains(name) || MAY_NOT_FIRE.contains(&base),
            "{mode}: {name} attached and never ran (ran: {fired:?})"
        );
    }
    rep
}

/// The eventfd probes the always-on tier chose: their flavour, if any.
fn eventfd_flavour(rep: &Value) -> Option<String> {
    let f = flavours(rep);
    let of = |name: &str| {
        f.iter()
            .find(|(tp, _)| tp == name)
            .map(|(_, fl)| fl.clone())
    };
    let (r, w) = (of("eventfd_read"), of("eventfd_write"));
    assert_eq!(
        r, w,
        "eventfd_read and eventfd_write in different flavours: {f:?}"
    );
    r
}

fn supported_kernel(series: &str) {
    let o = boot(series);
    assert_eq!(
        o.rc("doctor").unwrap(),
        0,
        "{}",
        o.file("doctor.err").unwrap()
    );
    let doctor = o.json("doctor.json").unwrap();
    assert!(works(&doctor, "atomics"), "doctor: {doctor:#}");
    block_split_exact(&o, &doctor);
    guest_agent_records(&o);
    vhost_scsi_counts_exact(&o, series);
    vhost_scsi_compared(&o);
    if series == "6.12" {
        vhost_scsi_direct_submission_is_the_vms(&o);
        vhost_scsi_starved(&o);
    }
    let vhost = &doctor["paths"][0];
    assert_eq!(vhost["path"], "vhost-scsi", "{doctor:#}");
    assert_eq!(vhost["measurable"], "yes", "{vhost}");

    // The flavours iospan picks: doctor's verdicts are what then loads.
    let always_on = vm_split_exact(&o, "always-on");
    let rep = &always_on;
    let want = if works(&doctor, "fentry") {
        Some("fentry")
    } else if works(&doctor, "kprobe") {
        Some("kprobe")
    } else {
        None
    };
    assert_eq!(
        eventfd_flavour(rep).as_deref(),
        want,
        "doctor: fentry {}, kprobe {}",
        works(&doctor, "fentry"),
        works(&doctor, "kprobe")
    );
    assert!(
        !flavours(rep)
            .iter()
            .any(|(tp, _)| tp.starts_with("syscalls:")),
        "the always-on tier attached a system-call tracepoint: {:?}",
        flavours(rep)
    );
    assert_eq!(
        rep["vms"][0]["kicks"], "any-vcpu-eventfd",
        "{}",
        rep["vms"][0]
    );

    // Told to avoid tp_btf and fentry: raw_tp, and kprobes where they work.
    let rep = vm_split_exact(&o, "avoiding");
    let want = works(&doctor, "kprobe").then_some("kprobe");
    assert_eq!(eventfd_flavour(&rep).as_deref(), want);
    for (tp, f) in flavours(&rep) {
        assert!(f != "tp_btf" && f != "fentry", "{tp} on {f} though avoided");
    }

    let deep = vm_split_exact(&o, "deep");
    assert_eq!(deep["tier"], "deep");
    assert!(flavours(&deep)
        .iter()
        .any(|(tp, _)| tp == "syscalls:sys_enter_read"));

    // Doctor's verdicts, type by type, are what the three runs loaded.
    let loaded: BTreeSet<String> = [&always_on, &rep, &deep]
        .iter()
        .flat_map(|r| flavours(r))
        .map(|(_, f)| f)
        .collect();
    let said: BTreeSet<String> = doctor["probes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["works"] == true && p["probe"] != "atomics")
        .map(|p| p["probe"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        said, loaded,
        "doctor's working program types vs what the runs attached: {doctor:#}"
    );
}

#[test]
fn kernel_5_10_bullseye_is_refused_with_one_line() {
    let o = boot("5.10");
    let doctor = o.json("doctor.json").unwrap();
    // Doctor says so, and never "ok" for what then fails to load.
    assert!(!works(&doctor, "atomics"), "{doctor:#}");
    let seg = doctor["segments"].as_array().unwrap();
    assert!(seg.iter().all(|s| s["measurable"] == "no"), "{seg:#?}");
    for step in ["block", "vm-always-on", "guest"] {
        assert_ne!(o.rc(step).unwrap(), 0, "{step} ran on 5.10");
        let err = o.file(&format!("{step}.err")).unwrap();
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{step}: {err}");
        assert!(
            lines[0].contains("atomic") && lines[0].contains("5.12"),
            "{step}: {}",
            lines[0]
        );
    }
}

#[test]
fn kernel_6_1_bookworm() {
    supported_kernel("6.1");
}

#[test]
fn kernel_6_12_trixie() {
    supported_kernel("6.12");
}
