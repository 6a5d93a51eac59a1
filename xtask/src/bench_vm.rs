//! `cargo xtask bench vm`: iospan's cost on the VM path at production
//! rates. N VMs of tests/native/vm_load.c (processes named as QEMU's, each
//! with Q virtqueues kicked through KVM's ioeventfd, an io_uring engine at
//! depth D on a disk of its own, a loop device over /dev/shm, completions
//! signalled through irqfds) run for the whole bench, and iospan is attached in turns: five
//! arms, untraced, `iospan run --no-vms` (block layer only), `iospan run`
//! (the always-on tier's VM split), the same with sampled traces to a local
//! OTLP sink, and `iospan run --deep`. Each traced slice of the load sits
//! between untraced ones and is compared with their mean: the load runs on,
//! so neither its start nor the host's drift over minutes moves the ratios.
//! Guest I/Os are the loop device's own count; CPU is the whole machine's
//! busy time (every cost: BPF, the agent, the slow system-call path). Beside
//! the VMs a process that is no VM makes 8-byte reads and writes: its
//! system calls per second of its own CPU are the tax on the host's other
//! work (a system-call tracepoint slows every task's system calls), free of
//! how much CPU the VMs leave it. The cost slices keep the kernel's BPF
//! statistics off (two clock reads per program run); in every repetition a
//! profile slice per traced arm measures each program's runs and time per
//! guest I/O. Medians of the repetitions.

use std::{
    io::{Read, Write},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::Value;

use crate::{
    bench::{
        agent_cpu_ns, busy_cpu_ns, chrono_free_date, lost_requests, machine, median,
        median_of_some, wait_for_line, BpfStats, LoopDev,
    },
    otlp_sink::OtlpSink,
    sh,
};

#[derive(clap::Args, Clone)]
pub struct VmArgs {
    /// VMs (processes named qemu-system-x86_64).
    #[arg(long, default_value_t = 16)]
    vms: u32,
    /// Virtqueues per VM, each with its own vCPU thread, notifier and irqfd.
    #[arg(long, default_value_t = 4)]
    queues: u32,
    /// Requests in flight per queue.
    #[arg(long, default_value_t = 32)]
    qd: u32,
    /// Seconds each slice of the load is measured.
    #[arg(long, default_value_t = 4)]
    seconds: u32,
    /// Traced slices of each arm per repetition, each between untraced ones.
    #[arg(long, default_value_t = 2)]
    slices: u32,
    /// Repetitions (the table shows medians).
    #[arg(long, default_value_t = 3)]
    reps: u32,
    /// Engines poll their queues this long (ns) before sleeping, as QEMU's
    /// iothreads do (poll-max-ns; 32768 is QEMU's default); 0: event-driven.
    #[arg(long, default_value_t = 0)]
    poll_ns: u64,
    /// Another build of iospan (a release binary, say of the commit before a
    /// change) measured in the same run as one more arm, its always-on tier:
    /// what the change did to the cost, as ratios of one run.
    #[arg(long, value_name = "IOSPAN")]
    against: Option<PathBuf>,
    /// Only these traced arms (comma-separated; all by default): a shorter
    /// run while working on one of them. The untraced slices are always run.
    #[arg(long, value_enum, value_delimiter = ',')]
    arms: Vec<Arm>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
enum Arm {
    #[value(skip)]
    Off,
    BlockOnly,
    AlwaysOn,
    AlwaysOnOtlp,
    Deep,
    /// `--against`'s build, always-on.
    Against,
    /// `iospan floor`: the always-on tier's hooks with programs that do
    /// only what cannot be avoided there.
    Floor,
}

impl Arm {
    const TRACED: [Arm; 5] = [
        Arm::Floor,
        Arm::BlockOnly,
        Arm::AlwaysOn,
        Arm::AlwaysOnOtlp,
        Arm::Deep,
    ];

    /// The traced arms of a run.
    fn traced(a: &VmArgs) -> Vec<Arm> {
        let mut arms = Arm::TRACED.to_vec();
        if a.against.is_some() {
            arms.push(Arm::Against);
        }
        if !a.arms.is_empty() {
            arms.retain(|arm| a.arms.contains(arm));
        }
        arms
    }

    fn label(self) -> &'static str {
        match self {
            Arm::Off => "untraced",
            Arm::BlockOnly => "block-only",
            Arm::AlwaysOn => "always-on",
            Arm::AlwaysOnOtlp => "always-on+OTLP",
            Arm::Deep => "deep",
            Arm::Against => "always-on (--against)",
            Arm::Floor => "floor",
        }
    }

    fn args(self) -> &'static [&'static str] {
        match self {
            Arm::BlockOnly => &["--no-vms"],
            Arm::Deep => &["--deep"],
            _ => &[],
        }
    }
}

/// One slice of the load under one arm.
#[derive(Clone, Debug, Serialize)]
struct Slice {
    arm: Arm,
    rep: u32,
    /// Guest requests completed in the slice (the loop device's count).
    guest_ios: u64,
    guest_iops: f64,
    /// Busy CPU of the whole machine per guest I/O.
    cpu_ns_per_io: f64,
    /// The non-VM process's 8-byte read+write pairs per second of its own CPU.
    syscall_pairs_per_cpu_s: f64,
    /// Its two threads' one-byte round trips (a wake-up and a switch each
    /// way) per second of their CPU.
    switch_trips_per_cpu_s: f64,
}

/// What iospan's report says of a traced slice (its whole attachment).
#[derive(Clone, Debug, Serialize)]
struct Traced {
    arm: Arm,
    agent_ns_per_io: f64,
    agent_rss_mib: Option<f64>,
    /// Requests lost (ring-buffer drops, conflicts, completions the
    /// kernel's tracepoints never ran for).
    lost: u64,
    ringbuf_drops: u64,
    /// The report's own account of them, key by key.
    lost_by_kind: Value,
    /// VM requests counted but not split, and the loop device's requests
    /// iospan counted for no VM (those in flight as it attached or
    /// detached are among them), where VMs are followed.
    unsplit: Option<u64>,
    /// Those against the VM requests iospan counted.
    unsplit_share: Option<f64>,
    uncounted: Option<i64>,
    /// Per program (profile slices): runs and run time per guest I/O.
    programs: Option<Vec<Program>>,
    otlp_requests: Option<u64>,
}

/// An arm's profile slices, one per repetition, as medians.
#[derive(Debug, Serialize)]
struct ArmProfile {
    arm: Arm,
    reps: usize,
    /// The median over the repetitions of all its programs' ns per guest
    /// I/O (not the sum of the programs' medians).
    bpf_ns_per_io: f64,
    programs: Vec<Program>,
}

#[derive(Clone, Debug, Serialize)]
struct Program {
    name: String,
    runs_per_io: f64,
    ns_per_io: f64,
}

impl Program {
    fn ns_per_run(&self) -> f64 {
        self.ns_per_io / self.runs_per_io.max(1e-12)
    }
}

/// A traced slice against the untraced slices either side of it.
#[derive(Clone, Debug, Serialize)]
struct Paired {
    arm: Arm,
    rep: u32,
    iops_ratio: f64,
    added_ns_per_io: f64,
    syscalls_ratio: f64,
    switches_ratio: f64,
}

#[derive(Serialize)]
struct Summary {
    arm: Arm,
    guest_iops: f64,
    iops_vs_untraced: f64,
    cpu_ns_per_io: f64,
    added_ns_per_io: f64,
    agent_ns_per_io: Option<f64>,
    bpf_ns_per_io: Option<f64>,
    lost: Option<u64>,
    ringbuf_drops: Option<u64>,
    unsplit: Option<u64>,
    unsplit_share: Option<f64>,
    uncounted: Option<i64>,
    agent_rss_mib: Option<f64>,
    syscalls_vs_untraced: f64,
    switches_vs_untraced: f64,
}

/// What every slice needs.
struct Rig<'a> {
    a: &'a VmArgs,
    /// A disk per VM: one loop device's single worker thread serving all
    /// VMs makes their throughput swing by a fifth from one slice to the
    /// next; a disk each, by a fiftieth.
    devs: Vec<LoopDev>,
    iospan: PathBuf,
    out_dir: PathBuf,
    sink: OtlpSink,
    tax: Tax,
    /// A report of the always-on tier here: the hooks the floor mirrors.
    hooks: PathBuf,
}

impl Rig<'_> {
    /// Reads completed on the VMs' disks so far.
    fn reads(&self) -> Result<u64> {
        self.devs.iter().map(LoopDev::reads).sum()
    }
}

#[derive(Default)]
struct Results {
    slices: Vec<Slice>,
    paired: Vec<Paired>,
    traced: Vec<Traced>,
    /// A profile slice per traced arm and repetition.
    profiles: Vec<Traced>,
}

pub fn vm(a: &VmArgs) -> Result<()> {
    if a.vms == 0 || a.queues == 0 || a.queues > 64 || a.qd == 0 || a.qd > 512 {
        bail!("--vms must be at least 1, --queues 1-64, --qd 1-512");
    }
    if a.seconds == 0 || a.slices == 0 || a.reps == 0 {
        bail!("--seconds, --slices and --reps must be at least 1");
    }
    if a.arms.contains(&Arm::Against) && a.against.is_none() {
        bail!("--arms against: give the other build with --against IOSPAN");
    }
    if let Some(other) = a.against.as_deref().filter(|p| !p.is_file()) {
        bail!(
            "--against {}: no such file (give a release build of iospan, e.g. a copy of target/release/iospan built at another commit)",
            other.display()
        );
    }
    if !Path::new("/dev/kvm").exists() {
        bail!("bench vm runs its VMs on KVM: /dev/kvm is missing (load kvm_intel or kvm_amd)");
    }
    sh::cargo(&["build", "--release", "-p", "iospan"])?;
    let out_dir = sh::target_dir().join("bench");
    let vm_exe = build_vm_load(&out_dir)?;
    let rig = Rig {
        a,
        devs: (0..a.vms)
            .map(|_| LoopDev::create(32))
            .collect::<Result<_>>()?,
        iospan: sh::target_dir().join("release/iospan"),
        hooks: out_dir.join("vm-always-on-hooks.json"),
        out_dir,
        sink: OtlpSink::start()?,
        tax: Tax::start(),
    };
    let vms = Vms::start(&rig, &vm_exe)?;
    // The guests' start-up and the engines' first batches are no slice's.
    std::thread::sleep(Duration::from_secs(2));
    learn_hooks(&rig)?;
    let mut res = Results::default();
    let run = (0..a.reps).try_for_each(|rep| {
        cost_slices(&rig, rep, &mut res)?;
        res.profiles.extend(profile_slices(&rig, rep)?);
        Ok::<_, anyhow::Error>(())
    });
    vms.stop();
    run?;
    let profiles = median_profiles(a, &res.profiles);
    let summaries = summarise(a, &res, &profiles);
    print!("{}", render(&summaries, &profiles, a));
    let json = serde_json::json!({
        "date": chrono_free_date(),
        "machine": machine(),
        "params": {
            "vms": a.vms, "queues": a.queues, "qd": a.qd, "seconds": a.seconds,
            "slices": a.slices, "reps": a.reps, "poll_ns": a.poll_ns,
            "against": a.against,
            "device": "a loop device over /dev/shm per VM, direct-io; 4 KiB random reads, io_uring",
        },
        "summary": summaries,
        "paired": res.paired,
        "traced": res.traced,
        "profiles": profiles,
        "profiles_per_rep": res.profiles,
        "slices": res.slices,
    });
    std::fs::create_dir_all(&rig.out_dir)?;
    let path = rig.out_dir.join("vm.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json)? + "\n")?;
    eprintln!("xtask: wrote {}", path.display());
    Ok(())
}

/// Per traced arm (rotated by repetition): an untraced slice, then per
/// traced slice the traced one and an untraced one; each traced slice
/// against the mean of its neighbours.
fn cost_slices(rig: &Rig, rep: u32, res: &mut Results) -> Result<()> {
    let arms = Arm::traced(rig.a);
    let n = arms.len();
    for i in 0..n {
        let arm = arms[(i + rep as usize) % n];
        eprintln!(
            "xtask: bench vm: rep {}/{} arm {}",
            rep + 1,
            rig.a.reps,
            arm.label()
        );
        let mut before = untraced_slice(rig, rep)?;
        res.slices.push(before.clone());
        for _ in 0..rig.a.slices {
            let (slice, traced) = traced_slice(rig, arm, rep, false)?;
            let after = untraced_slice(rig, rep)?;
            res.paired.push(pair(&slice, &before, &after));
            res.slices.push(slice);
            res.slices.push(after.clone());
            res.traced.push(traced);
            before = after;
        }
    }
    Ok(())
}

fn pair(t: &Slice, b: &Slice, a: &Slice) -> Paired {
    let mean = |f: fn(&Slice) -> f64| (f(b) + f(a)) / 2.0;
    Paired {
        arm: t.arm,
        rep: t.rep,
        iops_ratio: t.guest_iops / mean(|s| s.guest_iops),
        added_ns_per_io: t.cpu_ns_per_io - mean(|s| s.cpu_ns_per_io),
        syscalls_ratio: t.syscall_pairs_per_cpu_s / mean(|s| s.syscall_pairs_per_cpu_s),
        switches_ratio: t.switch_trips_per_cpu_s / mean(|s| s.switch_trips_per_cpu_s),
    }
}

/// One slice of each traced arm with the kernel's BPF statistics on (only
/// for these slices: they cost two clock reads a program run).
fn profile_slices(rig: &Rig, rep: u32) -> Result<Vec<Traced>> {
    let _stats = BpfStats::enable()?;
    Arm::traced(rig.a)
        .into_iter()
        .map(|arm| {
            eprintln!(
                "xtask: bench vm: rep {}/{} profile {}",
                rep + 1,
                rig.a.reps,
                arm.label()
            );
            traced_slice(rig, arm, rep, true).map(|(_, t)| t)
        })
        .collect()
}

/// Each arm's programs over its profile slices: per program, the median of
/// its runs and ns per guest I/O over the repetitions that ran it (a
/// program no repetition ran is not listed).
fn median_profiles(a: &VmArgs, per_rep: &[Traced]) -> Vec<ArmProfile> {
    Arm::traced(a)
        .into_iter()
        .filter_map(|arm| {
            let reps: Vec<&Vec<Program>> = per_rep
                .iter()
                .filter(|t| t.arm == arm)
                .filter_map(|t| t.programs.as_ref())
                .collect();
            if reps.is_empty() {
                return None;
            }
            let mut names: Vec<&str> = reps
                .iter()
                .flat_map(|ps| ps.iter().map(|p| p.name.as_str()))
                .collect();
            names.sort_unstable();
            names.dedup();
            let of = |name: &str, f: fn(&Program) -> f64| {
                median(
                    reps.iter()
                        .map(|ps| ps.iter().find(|p| p.name == name).map_or(0.0, f)),
                )
            };
            let mut programs: Vec<Program> = names
                .iter()
                .map(|&name| Program {
                    name: name.to_string(),
                    runs_per_io: of(name, |p| p.runs_per_io),
                    ns_per_io: of(name, |p| p.ns_per_io),
                })
                .collect();
            programs.sort_by(|x, y| y.ns_per_io.total_cmp(&x.ns_per_io));
            Some(ArmProfile {
                arm,
                reps: reps.len(),
                bpf_ns_per_io: median(reps.iter().map(|ps| ps.iter().map(|p| p.ns_per_io).sum())),
                programs,
            })
        })
        .collect()
}

fn summarise(a: &VmArgs, res: &Results, profiles: &[ArmProfile]) -> Vec<Summary> {
    let of = |arm: Arm| res.slices.iter().filter(move |s| s.arm == arm);
    let pairs = |arm: Arm| res.paired.iter().filter(move |p| p.arm == arm);
    let traced = |arm: Arm| res.traced.iter().filter(move |t| t.arm == arm);
    let mut out = vec![Summary {
        arm: Arm::Off,
        guest_iops: median(of(Arm::Off).map(|s| s.guest_iops)),
        iops_vs_untraced: 1.0,
        cpu_ns_per_io: median(of(Arm::Off).map(|s| s.cpu_ns_per_io)),
        added_ns_per_io: 0.0,
        agent_ns_per_io: None,
        bpf_ns_per_io: None,
        lost: None,
        ringbuf_drops: None,
        unsplit: None,
        unsplit_share: None,
        uncounted: None,
        agent_rss_mib: None,
        syscalls_vs_untraced: 1.0,
        switches_vs_untraced: 1.0,
    }];
    for arm in Arm::traced(a) {
        let bpf = profiles
            .iter()
            .find(|p| p.arm == arm)
            .map(|p| p.bpf_ns_per_io);
        out.push(Summary {
            arm,
            guest_iops: median(of(arm).map(|s| s.guest_iops)),
            iops_vs_untraced: median(pairs(arm).map(|p| p.iops_ratio)),
            cpu_ns_per_io: median(of(arm).map(|s| s.cpu_ns_per_io)),
            added_ns_per_io: median(pairs(arm).map(|p| p.added_ns_per_io)),
            agent_ns_per_io: median_of_some(traced(arm).map(|t| Some(t.agent_ns_per_io))),
            bpf_ns_per_io: bpf,
            lost: Some(traced(arm).map(|t| t.lost).sum()),
            ringbuf_drops: Some(traced(arm).map(|t| t.ringbuf_drops).sum()),
            unsplit: traced(arm).map(|t| t.unsplit).sum(),
            unsplit_share: median_of_some(traced(arm).map(|t| t.unsplit_share)),
            uncounted: traced(arm).map(|t| t.uncounted).sum(),
            agent_rss_mib: median_of_some(traced(arm).map(|t| t.agent_rss_mib)),
            syscalls_vs_untraced: median(pairs(arm).map(|p| p.syscalls_ratio)),
            switches_vs_untraced: median(pairs(arm).map(|p| p.switches_ratio)),
        });
    }
    out
}

/// The load generator, built under the name QEMU's processes have.
fn build_vm_load(out_dir: &Path) -> Result<PathBuf> {
    let dir = out_dir.join("vm-load");
    std::fs::create_dir_all(&dir)?;
    let exe = dir.join("qemu-system-x86_64");
    let src = sh::root().join("tests/native/vm_load.c");
    let out = sh::output(
        Command::new("cc")
            .args(["-O2", "-rdynamic", "-pthread", "-o"])
            .arg(&exe)
            .arg(&src),
    )?;
    if !out.status.success() {
        bail!(
            "building {}: {}",
            src.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(exe)
}

/// The VMs, running until stopped.
struct Vms(Vec<Child>);

impl Vms {
    fn start(rig: &Rig, exe: &Path) -> Result<Self> {
        let a = rig.a;
        let mut vms = Vms(Vec::new());
        for i in 0..a.vms {
            let child = Command::new(exe)
                .args(["-name", &format!("guest=bench{i:02},debug-threads=on")])
                .arg("-drive")
                .arg(format!(
                    "file={},if=none,id=d0,format=raw,cache=none,aio=io_uring",
                    rig.devs[i as usize].path()
                ))
                .args([
                    "-device",
                    &format!("virtio-blk-pci,drive=d0,num-queues={}", a.queues),
                ])
                .env("IOSPAN_VM_QUEUES", a.queues.to_string())
                .env("IOSPAN_VM_QD", a.qd.to_string())
                .env("IOSPAN_VM_SECONDS", "86400")
                .env("IOSPAN_VM_POLL_NS", a.poll_ns.to_string())
                .stdout(Stdio::null())
                .spawn()
                .context("starting a VM")?;
            vms.0.push(child);
        }
        Ok(vms)
    }

    fn stop(mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.0.clear();
    }
}

impl Drop for Vms {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// What a slice is measured from.
struct Mark {
    ios: u64,
    cpu_ns: u64,
    at: Instant,
}

impl Mark {
    fn now(rig: &Rig) -> Result<Self> {
        Ok(Self {
            ios: rig.reads()?,
            cpu_ns: busy_cpu_ns()?,
            at: Instant::now(),
        })
    }
}

/// `seconds` of the load, measured; then a second each of the non-VM
/// process's system calls and of its threads' round trips beside it (it
/// idles during the slice: a busy process beside the VMs moves their
/// throughput by several percent from one slice to the next).
fn measure(rig: &Rig, arm: Arm, rep: u32) -> Result<Slice> {
    let m0 = Mark::now(rig)?;
    std::thread::sleep(Duration::from_secs(u64::from(rig.a.seconds)));
    let m1 = Mark::now(rig)?;
    let ios = m1.ios.saturating_sub(m0.ios);
    let secs = (m1.at - m0.at).as_secs_f64();
    if ios == 0 {
        bail!("the VMs completed no request in {secs:.1} s");
    }
    let s = Slice {
        arm,
        rep,
        guest_ios: ios,
        guest_iops: ios as f64 / secs,
        cpu_ns_per_io: m1.cpu_ns.saturating_sub(m0.cpu_ns) as f64 / ios as f64,
        syscall_pairs_per_cpu_s: rig.tax.measure(Duration::from_secs(1))?,
        switch_trips_per_cpu_s: crate::tax::round_trips_per_cpu_s(Duration::from_secs(1))
            .context("the non-VM threads' round trips")?,
    };
    eprintln!(
        "        {}: {:.0} guest IOPS, {:.0} ns CPU/IO, non-VM {:.0} pairs and {:.0} round trips per CPU-second",
        arm.label(),
        s.guest_iops,
        s.cpu_ns_per_io,
        s.syscall_pairs_per_cpu_s,
        s.switch_trips_per_cpu_s
    );
    Ok(s)
}

fn untraced_slice(rig: &Rig, rep: u32) -> Result<Slice> {
    measure(rig, Arm::Off, rep)
}

/// iospan attached (and settled), a slice measured, iospan stopped and
/// its report read.
fn traced_slice(rig: &Rig, arm: Arm, rep: u32, profile: bool) -> Result<(Slice, Traced)> {
    let report = rig.out_dir.join("vm-iospan.json");
    let _ = std::fs::remove_file(&report);
    let ios0 = rig.reads()?;
    let tracer = start_tracer(rig, arm, profile, &report)?;
    // Its start-up (loading, naming the VMs) is no slice's.
    std::thread::sleep(SETTLE);
    let otlp0 = rig.sink.exports();
    let slice = measure(rig, arm, rep)?;
    let otlp = (arm == Arm::AlwaysOnOtlp).then(|| rig.sink.exports() - otlp0);
    let traced = stop_tracer(tracer, arm, &report, otlp)?;
    let attached_ios = rig.reads()?.saturating_sub(ios0);
    std::thread::sleep(SETTLE);
    let names: Vec<&str> = rig.devs.iter().map(|d| d.name.as_str()).collect();
    Ok((slice, traced.finish(&names, attached_ios)?))
}

/// iospan for an arm, attached and ready.
fn start_tracer(rig: &Rig, arm: Arm, profile: bool, report: &Path) -> Result<Child> {
    let exe = match (arm, &rig.a.against) {
        (Arm::Against, Some(other)) => other,
        _ => &rig.iospan,
    };
    let mut cmd = Command::new(exe);
    if arm == Arm::Floor {
        cmd.args(["floor", "--like"]).arg(&rig.hooks);
    } else {
        cmd.args(["-v", "run", "--quiet", "--duration", "1h"])
            .args(arm.args());
        if profile {
            cmd.arg("--bpf-stats");
        }
    }
    cmd.arg("--json-out")
        .arg(report)
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    if arm == Arm::AlwaysOnOtlp {
        cmd.arg("--otlp-endpoint").arg(rig.sink.endpoint());
    }
    let mut c = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting iospan")?;
    wait_for_line(&mut c, false, "attached block_rq_complete")?;
    Ok(c)
}

/// The always-on tier attached around the VMs once, its report kept: the
/// hooks the floor arm mirrors (those of VMs found running included).
fn learn_hooks(rig: &Rig) -> Result<()> {
    eprintln!("xtask: bench vm: the always-on tier's hooks, for the floor");
    let c = start_tracer(rig, Arm::AlwaysOn, false, &rig.hooks)?;
    std::thread::sleep(SETTLE);
    stop_tracer(c, Arm::AlwaysOn, &rig.hooks, None).map(|_| ())
}

/// How long the load settles after iospan starts or stops, before or after
/// a slice.
const SETTLE: Duration = Duration::from_secs(1);

/// A traced slice's report, before the loop devices' count of its
/// requests is known.
struct Stopped {
    arm: Arm,
    report: Value,
    agent_rss_mib: Option<f64>,
    otlp_requests: Option<u64>,
}

/// Stops iospan and reads its report.
fn stop_tracer(
    mut c: Child,
    arm: Arm,
    report: &Path,
    otlp_requests: Option<u64>,
) -> Result<Stopped> {
    let agent_rss_mib = peak_rss_mib(c.id());
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(c.id() as i32, libc::SIGINT) };
    let st = c.wait()?;
    if !st.success() {
        bail!("iospan exited with {st}");
    }
    let report = serde_json::from_slice(&std::fs::read(report).context("iospan's report")?)?;
    Ok(Stopped {
        arm,
        report,
        agent_rss_mib,
        otlp_requests,
    })
}

impl Stopped {
    /// Its figures per guest I/O of iospan's whole attachment: the requests
    /// it counted on the VMs' disks (`disks`); the floor counts none, and
    /// takes the disks' own count over its attachment (`attached_ios`).
    fn finish(self, disks: &[&str], attached_ios: u64) -> Result<Traced> {
        let r = &self.report;
        let run_ios = if self.arm == Arm::Floor {
            attached_ios
        } else {
            disk_ios(r, disks)
        }
        .max(1);
        let per_io = |ns: f64| ns / run_ios as f64;
        let programs = r["agent"]["bpf"].as_array().map(|progs| {
            let mut v: Vec<Program> = progs
                .iter()
                .filter_map(|p| {
                    Some(Program {
                        name: p["name"].as_str()?.to_string(),
                        runs_per_io: per_io(p["run_count"].as_u64()? as f64),
                        ns_per_io: per_io(p["run_time_ns"].as_u64()? as f64),
                    })
                })
                .filter(|p| p.runs_per_io > 0.0)
                .collect();
            v.sort_by(|a, b| b.ns_per_io.total_cmp(&a.ns_per_io));
            v
        });
        let followed = !matches!(self.arm, Arm::BlockOnly | Arm::Floor);
        Ok(Traced {
            arm: self.arm,
            agent_ns_per_io: per_io(agent_cpu_ns(r)),
            agent_rss_mib: self.agent_rss_mib,
            lost: lost_requests(r),
            ringbuf_drops: r["lost"]["ringbuf_drops"].as_u64().unwrap_or(0),
            lost_by_kind: r["lost"].clone(),
            unsplit: followed.then(|| unsplit(r)),
            unsplit_share: followed.then(|| unsplit(r) as f64 / run_ios as f64),
            uncounted: followed.then(|| uncounted(r, run_ios)).transpose()?,
            programs,
            otlp_requests: self.otlp_requests,
        })
    }
}

/// Requests iospan counted on these host disks (every process's).
fn disk_ios(r: &Value, disks: &[&str]) -> u64 {
    r["entries"].as_array().map_or(0, |es| {
        es.iter()
            .filter(|e| e["vm"].is_null() && e["disk"].as_str().is_some_and(|d| disks.contains(&d)))
            .filter_map(|e| e["ios"].as_u64())
            .sum()
    })
}

fn unsplit(r: &Value) -> u64 {
    let split = &r["lost"]["host_split"];
    [
        "no_kick",
        "no_signal",
        "unordered",
        "not_followed",
        "polled",
    ]
    .iter()
    .filter_map(|k| split[k].as_u64())
    .sum()
}

/// The VMs' disks' requests iospan counted for no VM: each of the VMs' is
/// a VM entry's I/O, an undelivered completion (counted, not timed) or a
/// merge, but for those in flight as iospan attached (as many as the VMs
/// keep in flight, started before its probes were).
fn uncounted(r: &Value, run_ios: u64) -> Result<i64> {
    let bench = |v: &Value, k: &str| v[k].as_str().is_some_and(|n| n.starts_with("bench"));
    let counted: u64 = r["entries"]
        .as_array()
        .context("entries")?
        .iter()
        .filter(|e| bench(e, "vm"))
        .map(|e| e["ios"].as_u64().unwrap_or(0) + e["undelivered"].as_u64().unwrap_or(0))
        .sum();
    let merged: u64 = r["vms"]
        .as_array()
        .context("vms")?
        .iter()
        .filter(|v| bench(v, "name"))
        .map(|v| v["host_merged"].as_u64().unwrap_or(0) + v["engine_merged"].as_u64().unwrap_or(0))
        .sum();
    Ok(run_ios as i64 - (counted + merged) as i64)
}

/// A thread that is no VM making 8-byte reads of /dev/zero and writes to
/// /dev/null when asked: its pairs, and its own CPU time.
struct Tax {
    pairs: Arc<AtomicU64>,
    tid: Arc<AtomicU64>,
    run: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl Tax {
    fn start() -> Self {
        let t = Tax {
            pairs: Arc::new(AtomicU64::new(0)),
            tid: Arc::new(AtomicU64::new(0)),
            run: Arc::new(AtomicBool::new(false)),
            stop: Arc::new(AtomicBool::new(false)),
        };
        let (pairs, tid, run, stop) = (
            t.pairs.clone(),
            t.tid.clone(),
            t.run.clone(),
            t.stop.clone(),
        );
        std::thread::spawn(move || {
            // SAFETY: gettid(2) has no preconditions.
            tid.store(unsafe { libc::gettid() } as u64, Ordering::Relaxed);
            while !stop.load(Ordering::Relaxed) {
                if run.load(Ordering::Relaxed) {
                    syscall_pairs(&run, &pairs);
                } else {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        });
        while t.tid.load(Ordering::Relaxed) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        t
    }

    /// Runs for `d`: its pairs per second of its own CPU.
    fn measure(&self, d: Duration) -> Result<f64> {
        let (p0, c0) = (self.pairs.load(Ordering::Relaxed), self.cpu_ns()?);
        self.run.store(true, Ordering::Relaxed);
        std::thread::sleep(d);
        self.run.store(false, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(20));
        let (p1, c1) = (self.pairs.load(Ordering::Relaxed), self.cpu_ns()?);
        let cpu_s = c1.saturating_sub(c0) as f64 / 1e9;
        Ok(p1.saturating_sub(p0) as f64 / cpu_s.max(1e-9))
    }

    /// Its CPU time so far (the scheduler's, in ns).
    fn cpu_ns(&self) -> Result<u64> {
        let tid = self.tid.load(Ordering::Relaxed);
        let path = format!("/proc/self/task/{tid}/schedstat");
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
        text.split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("{path}: {text:?}"))
    }
}

impl Drop for Tax {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Pairs of 8-byte reads and writes while `run` holds.
fn syscall_pairs(run: &AtomicBool, pairs: &AtomicU64) {
    let (Ok(mut zero), Ok(mut null)) = (
        std::fs::File::open("/dev/zero"),
        std::fs::OpenOptions::new().write(true).open("/dev/null"),
    ) else {
        return;
    };
    let mut buf = [0u8; 8];
    while run.load(Ordering::Relaxed) {
        if zero.read_exact(&mut buf).is_err() || null.write_all(&buf).is_err() {
            return;
        }
        pairs.fetch_add(1, Ordering::Relaxed);
    }
}

fn peak_rss_mib(pid: u32) -> Option<f64> {
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: f64 = st
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

fn render(summaries: &[Summary], profiles: &[ArmProfile], a: &VmArgs) -> String {
    use std::fmt::Write;
    let mut t = String::new();
    let o = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
    let n = |v: Option<u64>| v.map_or("-".into(), |v| v.to_string());
    let floor_bpf = summaries
        .iter()
        .find(|s| s.arm == Arm::Floor)
        .and_then(|s| s.bpf_ns_per_io);
    let _ = writeln!(
        t,
        "{} VMs x {} queues x QD{}, 4 KiB random reads (io_uring), a loop device over /dev/shm each, {}; slices of {} s, {} traced per arm and repetition, medians of {} repetitions (each traced slice against the untraced slices either side)\n",
        a.vms,
        a.queues,
        a.qd,
        if a.poll_ns > 0 {
            format!("engines polling {} ns", a.poll_ns)
        } else {
            "event-driven engines".to_string()
        },
        a.seconds,
        a.slices,
        a.reps
    );
    let _ = writeln!(
        t,
        "{:<15} {:>10} {:>7} {:>9} {:>8} {:>8} {:>7} {:>8} {:>6} {:>6} {:>8} {:>9} {:>9} {:>8} {:>10} {:>10}",
        "arm",
        "guest IOPS",
        "IOPS %",
        "CPU ns/IO",
        "added",
        "BPF ns",
        "x floor",
        "agent ns",
        "lost",
        "drops",
        "unsplit",
        "unsplit %",
        "uncounted",
        "RSS MiB",
        "syscalls %",
        "switches %"
    );
    for s in summaries {
        let _ = writeln!(
            t,
            "{:<15} {:>10.0} {:>7.1} {:>9.0} {:>8.0} {:>8} {:>7} {:>8} {:>6} {:>6} {:>8} {:>9} {:>9} {:>8} {:>10.1} {:>10.1}",
            s.arm.label(),
            s.guest_iops,
            s.iops_vs_untraced * 100.0,
            s.cpu_ns_per_io,
            s.added_ns_per_io,
            o(s.bpf_ns_per_io),
            s.bpf_ns_per_io
                .zip(floor_bpf)
                .map_or("-".into(), |(b, f)| format!("{:.2}", b / f.max(1e-9))),
            o(s.agent_ns_per_io),
            n(s.lost),
            n(s.ringbuf_drops),
            n(s.unsplit),
            s.unsplit_share
                .map_or("-".into(), |v| format!("{:.2}", v * 100.0)),
            s.uncounted.map_or("-".into(), |v| v.to_string()),
            s.agent_rss_mib.map_or("-".into(), |v| format!("{v:.1}")),
            s.syscalls_vs_untraced * 100.0,
            s.switches_vs_untraced * 100.0,
        );
    }
    render_profiles(&mut t, profiles);
    t
}

/// Each arm's programs beside the floor's on the same hook.
fn render_profiles(t: &mut String, profiles: &[ArmProfile]) {
    use std::fmt::Write;
    let floor = profiles
        .iter()
        .find(|p| p.arm == Arm::Floor)
        .map(|p| &p.programs);
    for p in profiles {
        let progs = &p.programs;
        let _ = writeln!(
            t,
            "\n{} (profile slices, BPF statistics on, medians of {}): per guest I/O, runs and ns; ns a run, and the floor's program on the same hook",
            p.arm.label(),
            p.reps
        );
        let _ = writeln!(
            t,
            "  {:<32} {:>7} {:>7} {:>8} {:>8} {:>9}",
            "program", "runs", "ns", "ns/run", "floor", "floor ns"
        );
        for pr in progs.iter().filter(|p| p.ns_per_io >= 0.5) {
            let floor = floor.and_then(|f| f.iter().find(|f| f.name == pr.name));
            let _ = writeln!(
                t,
                "  {:<32} {:>7.3} {:>7.0} {:>8.0} {:>8} {:>9}",
                pr.name,
                pr.runs_per_io,
                pr.ns_per_io,
                pr.ns_per_run(),
                floor.map_or("-".into(), |f| format!("{:.0}", f.ns_per_run())),
                floor.map_or("-".into(), |f| format!("{:.0}", f.ns_per_io)),
            );
        }
    }
}
