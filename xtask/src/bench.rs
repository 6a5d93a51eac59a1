//! `cargo xtask bench overhead`: what tracing costs per I/O, three arms
//! interleaved in one run — no tracing, `iospan run`, and a biolatency-style
//! bpftrace one-liner as the reference — on a scratch loop device over
//! /dev/shm driven to saturation by fio. Medians of the repetitions.

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::Value;

use crate::sh;

#[derive(clap::Args, Clone)]
pub struct OverheadArgs {
    /// Repetitions of each arm (the table shows medians).
    #[arg(long, default_value_t = 3)]
    reps: u32,
    /// Seconds of fio per arm and repetition.
    #[arg(long, default_value_t = 5)]
    seconds: u32,
    /// fio queue depth per job.
    #[arg(long, default_value_t = 64)]
    iodepth: u32,
    /// fio jobs.
    #[arg(long, default_value_t = 2)]
    jobs: u32,
}

const BPFTRACE_BIOLATENCY: &str = "tracepoint:block:block_rq_issue { @start[args->dev, args->sector] = nsecs; } \
tracepoint:block:block_rq_complete /@start[args->dev, args->sector]/ { \
@usecs = hist((nsecs - @start[args->dev, args->sector]) / 1000); delete(@start[args->dev, args->sector]); }";

#[derive(clap::Args, Clone)]
pub struct GuestArgs {
    /// Boots per arm (the table shows medians).
    #[arg(long, default_value_t = 5)]
    reps: u32,
    /// I/Os per boot.
    #[arg(long, default_value_t = 3000)]
    ios: u64,
    /// Guest queue depth.
    #[arg(long, default_value_t = 1)]
    qd: u32,
}

/// What a guest bench boot runs besides the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GuestArm {
    /// No tracing at all.
    Untraced,
    /// `iospan run` on the host, no guest agent.
    Host,
    /// `iospan run` on the host and the guest agent inside.
    HostAndGuest,
}

impl GuestArm {
    const ALL: [GuestArm; 3] = [GuestArm::Untraced, GuestArm::Host, GuestArm::HostAndGuest];

    fn label(self) -> &'static str {
        match self {
            GuestArm::Untraced => "no tracing",
            GuestArm::Host => "iospan (host)",
            GuestArm::HostAndGuest => "iospan + guest agent",
        }
    }

    fn key(self) -> &'static str {
        match self {
            GuestArm::Untraced => "no_tracing",
            GuestArm::Host => "iospan",
            GuestArm::HostAndGuest => "iospan_and_guest_agent",
        }
    }
}

/// The guest arm: the rig guest's own latency untraced, with iospan on the
/// host (VM attribution on), and with the guest agent too, boots
/// interleaved; and what iospan costs per guest I/O.
pub fn guest(a: &GuestArgs) -> Result<()> {
    use crate::guest as rig;
    sh::cargo(&["build", "--release", "-p", "iospan"])?;
    let out_dir = sh::target_dir().join("bench");
    std::fs::create_dir_all(&out_dir)?;
    let built = rig::build()?;
    let image = rig::dir().join("disk.img");
    rig::ensure_image(&image, 256)?;
    let mut rows: Vec<GuestRow> = Vec::new();
    for rep in 0..a.reps {
        // Rotated, so no arm always boots first (a cold page cache, a warm CPU).
        let mut arms = GuestArm::ALL;
        arms.rotate_left(rep as usize % GuestArm::ALL.len());
        for arm in arms {
            let row = guest_boot(a, arm, &built, &image, &out_dir)?;
            eprintln!(
                "xtask: bench guest: rep {} {}: p50 {} µs, mean {} µs",
                rep + 1,
                arm.label(),
                row.p50,
                row.mean
            );
            rows.push(row);
        }
    }
    render_guest(a, &rows, &out_dir)
}

/// One boot of the guest arm: its workload's latency, and iospan's cost.
struct GuestRow {
    arm: GuestArm,
    p50: f64,
    mean: f64,
    p99: f64,
    bpf_ns: Option<f64>,
    uprobe_hits: Option<f64>,
}

fn guest_boot(
    a: &GuestArgs,
    arm: GuestArm,
    built: &crate::guest::Rig,
    image: &Path,
    out_dir: &Path,
) -> Result<GuestRow> {
    use crate::guest::{self as rig, RunArgs};
    let report = out_dir.join("guest-iospan.json");
    let args = RunArgs {
        qd: a.qd,
        ios: a.ios,
        name: "bench-guest".into(),
        no_guest_agent: arm != GuestArm::HostAndGuest,
        ..Default::default()
    };
    let (qemu, dev) = rig::qemu_command(built, &args, image);
    let mut cmd = if arm == GuestArm::Untraced {
        qemu
    } else {
        let mut c = Command::new(sh::target_dir().join("release/iospan"));
        c.args(["run", "--quiet", "--bpf-stats", "--json-out"])
            .arg(&report)
            .arg("--")
            .arg(qemu.get_program())
            .args(qemu.get_args());
        c
    };
    let t = Instant::now();
    let out = cmd.output().context("booting the rig guest")?;
    let console: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    let r = rig::parse(&console, &args, dev, t.elapsed().as_secs_f64())?;
    let cost = if arm == GuestArm::Untraced {
        None
    } else {
        Some(bpf_cost_per_io(&report, r.guest_reads)?)
    };
    let num = |k: &str| r.workload[k].as_f64().unwrap_or(f64::NAN);
    Ok(GuestRow {
        arm,
        p50: num("p50_us"),
        mean: num("mean_us"),
        p99: num("p99_us"),
        bpf_ns: cost.map(|c| c.0),
        uprobe_hits: cost.map(|c| c.1),
    })
}

/// BPF ns and uprobe hits per guest I/O, from a run's `--json-out` report.
fn bpf_cost_per_io(report: &Path, guest_reads: u64) -> Result<(f64, f64)> {
    let j: Value = serde_json::from_slice(&std::fs::read(report)?)?;
    let progs = j["agent"]["bpf"].as_array().cloned().unwrap_or_default();
    let ns: u64 = progs.iter().filter_map(|p| p["run_time_ns"].as_u64()).sum();
    // Hits of the programs attached as uprobes, from the kernel's run counts.
    let uprobes: Vec<String> = j["probes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["flavour"] == "uprobe")
        .filter_map(|p| p["program"].as_str().map(str::to_string))
        .collect();
    let hits: u64 = progs
        .iter()
        .filter(|p| {
            p["name"]
                .as_str()
                .is_some_and(|n| uprobes.iter().any(|u| u == n))
        })
        .filter_map(|p| p["run_count"].as_u64())
        .sum();
    let per_io = |v: u64| v as f64 / guest_reads.max(1) as f64;
    Ok((per_io(ns), per_io(hits)))
}

fn render_guest(a: &GuestArgs, rows: &[GuestRow], out_dir: &Path) -> Result<()> {
    let med = |arm: GuestArm, f: &dyn Fn(&GuestRow) -> Option<f64>| {
        median(rows.iter().filter(|r| r.arm == arm).filter_map(f))
    };
    println!(
        "rig guest (TCG, 1 vCPU), virtio-blk aio=io_uring, 4k randread QD{} x {} I/Os, {} boots per arm, medians",
        a.qd, a.ios, a.reps
    );
    println!(
        "{:<22} {:>10} {:>10} {:>10} {:>10}",
        "arm", "p50 µs", "mean µs", "p99 µs", "p50 added"
    );
    let base = med(GuestArm::Untraced, &|r| Some(r.p50));
    let mut json = serde_json::json!({
        "date": chrono_free_date(), "machine": machine(),
        "params": {"reps": a.reps, "ios": a.ios, "qd": a.qd, "disk": "virtio-blk", "aio": "io_uring"},
    });
    for arm in GuestArm::ALL {
        let (p50, mean, p99) = (
            med(arm, &|r| Some(r.p50)),
            med(arm, &|r| Some(r.mean)),
            med(arm, &|r| Some(r.p99)),
        );
        println!(
            "{:<22} {p50:>10.1} {mean:>10.1} {p99:>10.1} {:>+9.1}%",
            arm.label(),
            (p50 / base - 1.0) * 100.0
        );
        json[arm.key()] = serde_json::json!({
            "p50_us": p50, "mean_us": mean, "p99_us": p99, "p50_added": p50 / base - 1.0,
            "bpf_ns_per_guest_io": (arm != GuestArm::Untraced).then(|| med(arm, &|r| r.bpf_ns)),
            "uprobe_hits_per_io": (arm != GuestArm::Untraced).then(|| med(arm, &|r| r.uprobe_hits)),
        });
    }
    println!(
        "host iospan: BPF time per guest I/O {:.0} ns, uprobe hits per guest I/O {:.2}",
        med(GuestArm::Host, &|r| r.bpf_ns),
        med(GuestArm::Host, &|r| r.uprobe_hits)
    );
    let path = out_dir.join("guest.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json)? + "\n")?;
    eprintln!("xtask: wrote {}", path.display());
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Arm {
    None,
    Iospan,
    Bpftrace,
}

#[derive(Clone, Debug, Serialize)]
struct Sample {
    arm: Arm,
    rep: u32,
    ios: u64,
    iops: f64,
    /// Busy CPU (user+nice+system+irq+softirq, all CPUs) per I/O.
    cpu_ns_per_io: f64,
    /// Kernel-measured run time of the tracer's eBPF programs per I/O.
    bpf_ns_per_io: Option<f64>,
    /// The tracer's own process CPU per I/O (iospan only).
    agent_ns_per_io: Option<f64>,
    /// Records lost by iospan (must be 0).
    lost: Option<u64>,
}

#[derive(Serialize)]
struct Summary {
    arm: Arm,
    iops: f64,
    cpu_ns_per_io: f64,
    added_ns_per_io: f64,
    bpf_ns_per_io: Option<f64>,
    agent_ns_per_io: Option<f64>,
    /// iospan's measured cost (BPF run time + agent CPU) per I/O.
    tracer_ns_per_io: Option<f64>,
}

pub fn overhead(a: &OverheadArgs) -> Result<()> {
    sh::cargo(&["build", "--release", "-p", "iospan"])?;
    let iospan = sh::target_dir().join("release/iospan");
    let out_dir = sh::target_dir().join("bench");
    std::fs::create_dir_all(&out_dir)?;
    let dev = LoopDev::create(512)?;
    let _stats = BpfStats::enable()?;

    let arms = [Arm::None, Arm::Iospan, Arm::Bpftrace];
    let mut samples = Vec::new();
    for rep in 0..a.reps {
        // Rotate the order so no arm always follows another.
        for i in 0..arms.len() {
            let arm = arms[(i + rep as usize) % arms.len()];
            eprintln!(
                "xtask: bench overhead: rep {}/{} arm {arm:?}",
                rep + 1,
                a.reps
            );
            let s = measure(arm, rep, a, &dev, &iospan, &out_dir)?;
            eprintln!(
                "        {:.0} IOPS, {:.0} ns CPU/IO",
                s.iops, s.cpu_ns_per_io
            );
            samples.push(s);
        }
    }

    let of = |arm: Arm| samples.iter().filter(move |s| s.arm == arm);
    // Added cost per repetition against that repetition's untraced run.
    let added = |arm: Arm| {
        median((0..a.reps).filter_map(|r| {
            let base = samples.iter().find(|s| s.arm == Arm::None && s.rep == r)?;
            let s = samples.iter().find(|s| s.arm == arm && s.rep == r)?;
            Some(s.cpu_ns_per_io - base.cpu_ns_per_io)
        }))
    };
    let summaries: Vec<Summary> = arms
        .iter()
        .map(|&arm| {
            let bpf = median_of_some(of(arm).map(|s| s.bpf_ns_per_io));
            let agent = median_of_some(of(arm).map(|s| s.agent_ns_per_io));
            Summary {
                arm,
                iops: median(of(arm).map(|s| s.iops)),
                cpu_ns_per_io: median(of(arm).map(|s| s.cpu_ns_per_io)),
                added_ns_per_io: if arm == Arm::None { 0.0 } else { added(arm) },
                bpf_ns_per_io: bpf,
                agent_ns_per_io: agent,
                tracer_ns_per_io: bpf.map(|b| b + agent.unwrap_or(0.0)),
            }
        })
        .collect();

    let get = |arm: Arm| {
        summaries
            .iter()
            .find(|s| s.arm == arm)
            .expect("every arm measured")
    };
    let (io, bt) = (get(Arm::Iospan), get(Arm::Bpftrace));
    let lost: u64 = of(Arm::Iospan).filter_map(|s| s.lost).sum();
    let table = render(&summaries, io, bt, lost, a);
    print!("{table}");
    let machine = machine();
    let json = serde_json::json!({
        "date": chrono_free_date(),
        "machine": machine,
        "params": {"reps": a.reps, "seconds": a.seconds, "iodepth": a.iodepth, "jobs": a.jobs, "device": "loop over /dev/shm, direct-io"},
        "reference": BPFTRACE_BIOLATENCY,
        "summary": summaries,
        "ratios": {
            "added_cpu_iospan_over_bpftrace": io.added_ns_per_io / bt.added_ns_per_io,
            "bpf_run_time_iospan_over_bpftrace": io.bpf_ns_per_io.zip(bt.bpf_ns_per_io).map(|(a, b)| a / b),
        },
        "iospan_lost": lost,
        "samples": samples,
    });
    let path = out_dir.join("overhead.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json)? + "\n")?;
    eprintln!("xtask: wrote {}", path.display());
    Ok(())
}

fn render(
    summaries: &[Summary],
    io: &Summary,
    bt: &Summary,
    lost: u64,
    a: &OverheadArgs,
) -> String {
    use std::fmt::Write;
    let mut t = String::new();
    let o = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
    let _ = writeln!(
        t,
        "fio 4k randread io_uring QD{}x{} on a loop device over /dev/shm, {} s per arm, medians of {}\n",
        a.iodepth, a.jobs, a.seconds, a.reps
    );
    let _ = writeln!(
        t,
        "{:<10} {:>10} {:>12} {:>12} {:>12} {:>12} {:>12}",
        "arm", "IOPS", "CPU ns/IO", "added ns/IO", "BPF ns/IO", "agent ns/IO", "tracer ns/IO"
    );
    for s in summaries {
        let _ = writeln!(
            t,
            "{:<10} {:>10.0} {:>12.0} {:>12.0} {:>12} {:>12} {:>12}",
            format!("{:?}", s.arm).to_lowercase(),
            s.iops,
            s.cpu_ns_per_io,
            s.added_ns_per_io,
            o(s.bpf_ns_per_io),
            o(s.agent_ns_per_io),
            o(s.tracer_ns_per_io)
        );
    }
    let _ = writeln!(
        t,
        "\niospan / bpftrace: added CPU {:.2}x, BPF run time {}; iospan lost or unseen requests: {lost}",
        io.added_ns_per_io / bt.added_ns_per_io,
        io.bpf_ns_per_io.zip(bt.bpf_ns_per_io).map_or("-".into(), |(a, b)| format!("{:.2}x", a / b)),
    );
    t
}

fn measure(
    arm: Arm,
    rep: u32,
    a: &OverheadArgs,
    dev: &LoopDev,
    iospan: &Path,
    out_dir: &Path,
) -> Result<Sample> {
    let report = out_dir.join("overhead-iospan.json");
    let mut tracer = start_tracer(arm, dev, iospan, &report)?;
    // Let attach-time work settle before the window opens.
    std::thread::sleep(Duration::from_millis(500));
    let fio_json = out_dir.join("overhead-fio.json");
    let cpu0 = busy_cpu_ns()?;
    let status = run_fio(a, dev, &fio_json)?;
    let cpu1 = busy_cpu_ns()?;
    if !status.success() {
        bail!("fio failed ({status})");
    }
    let bpftrace_bpf_ns = if arm == Arm::Bpftrace {
        Some(bpf_run_time_ns("tracepoint")?)
    } else {
        None
    };
    if let Some(c) = tracer.as_mut() {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(c.id() as i32, libc::SIGINT) };
        c.wait()?;
    }
    let fio: Value = serde_json::from_slice(&std::fs::read(&fio_json)?)?;
    let ios = fio["jobs"][0]["read"]["total_ios"]
        .as_u64()
        .context("fio total_ios")?;
    let iops = fio["jobs"][0]["read"]["iops"]
        .as_f64()
        .context("fio iops")?;
    let per_io = |ns: f64| ns / ios as f64;
    let mut s = Sample {
        arm,
        rep,
        ios,
        iops,
        cpu_ns_per_io: per_io((cpu1 - cpu0) as f64),
        bpf_ns_per_io: bpftrace_bpf_ns.map(|n| per_io(n as f64)),
        agent_ns_per_io: None,
        lost: None,
    };
    if arm == Arm::Iospan {
        let r: Value = serde_json::from_slice(&std::fs::read(&report).context("iospan's report")?)?;
        let bpf: u64 = r["agent"]["bpf"]
            .as_array()
            .context("bpf stats")?
            .iter()
            .filter_map(|p| p["run_time_ns"].as_u64())
            .sum();
        let agent = agent_cpu_ns(&r);
        s.bpf_ns_per_io = Some(per_io(bpf as f64));
        s.agent_ns_per_io = Some(per_io(agent));
        s.lost = Some(lost_requests(&r));
    }
    Ok(s)
}

/// The arm's tracer, started and attached (None for the untraced arm).
fn start_tracer(arm: Arm, dev: &LoopDev, iospan: &Path, report: &Path) -> Result<Option<Child>> {
    Ok(match arm {
        Arm::None => None,
        Arm::Iospan => {
            let _ = std::fs::remove_file(report);
            let mut c = Command::new(iospan)
                .args([
                    "-v",
                    "run",
                    "--quiet",
                    "--no-vms",
                    "--bpf-stats",
                    "--disk",
                    &dev.name,
                    "--duration",
                    "1h",
                    "--json-out",
                ])
                .arg(report)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .context("starting iospan")?;
            wait_for_line(&mut c, false, "attached block_rq_complete")?;
            Some(c)
        }
        Arm::Bpftrace => {
            let mut c = Command::new("bpftrace")
                .args(["-e", BPFTRACE_BIOLATENCY])
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .context("starting bpftrace")?;
            wait_for_line(&mut c, true, "Attaching")?;
            Some(c)
        }
    })
}
fn run_fio(a: &OverheadArgs, dev: &LoopDev, fio_json: &Path) -> Result<std::process::ExitStatus> {
    Command::new("fio")
        .args([
            "--name=bench",
            "--ioengine=io_uring",
            "--direct=1",
            "--rw=randread",
            "--bs=4k",
            "--time_based",
            "--group_reporting",
        ])
        .arg(format!("--filename={}", dev.path()))
        .arg(format!("--iodepth={}", a.iodepth))
        .arg(format!("--numjobs={}", a.jobs))
        .arg(format!("--runtime={}", a.seconds))
        .arg("--output-format=json")
        .arg(format!("--output={}", fio_json.display()))
        .status()
        .context("running fio")
}

pub(crate) fn wait_for_line(c: &mut Child, stdout: bool, needle: &str) -> Result<()> {
    let pipe: Box<dyn std::io::Read + Send> = if stdout {
        Box::new(c.stdout.take().context("tracer stdout")?)
    } else {
        Box::new(c.stderr.take().context("tracer stderr")?)
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let needle = needle.to_string();
    std::thread::spawn(move || {
        let mut found = false;
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            if !found && line.contains(&needle) {
                found = true;
                let _ = tx.send(());
            }
        }
    });
    let t = Instant::now();
    rx.recv_timeout(Duration::from_secs(60))
        .with_context(|| format!("tracer not ready after {:?}", t.elapsed()))
}

/// Sum of run time of loaded programs of a type, while stats are on.
fn bpf_run_time_ns(prog_type: &str) -> Result<u64> {
    let out = sh::output(Command::new("bpftool").args(["-j", "prog", "show"]))?;
    let v: Value = serde_json::from_slice(&out.stdout).context("bpftool -j prog show")?;
    Ok(v.as_array()
        .context("program list")?
        .iter()
        .filter(|p| p["type"] == prog_type)
        .filter_map(|p| p["run_time_ns"].as_u64())
        .sum())
}

/// Busy CPU time of all CPUs, from /proc/stat.
pub(crate) fn busy_cpu_ns() -> Result<u64> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat.lines().next().context("/proc/stat is empty")?;
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq …
    let ticks =
        f[0] + f[1] + f[2] + f.get(5).copied().unwrap_or(0) + f.get(6).copied().unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok(ticks * 1_000_000_000 / hz)
}

pub(crate) struct LoopDev {
    file: PathBuf,
    pub(crate) name: String,
}

impl LoopDev {
    pub(crate) fn create(mib: u64) -> Result<Self> {
        let file = PathBuf::from(format!("/dev/shm/iospan-bench-{}.img", std::process::id()));
        let chunk = vec![0xa5u8; 1 << 20];
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&file)?;
            for _ in 0..mib {
                f.write_all(&chunk)?;
            }
        }
        let out = sh::output(
            Command::new("losetup")
                .args(["--find", "--show", "--direct-io=on"])
                .arg(&file),
        )?;
        if !out.status.success() {
            let _ = std::fs::remove_file(&file);
            bail!("losetup: {}", String::from_utf8_lossy(&out.stderr));
        }
        let name = String::from_utf8_lossy(&out.stdout)
            .trim()
            .trim_start_matches("/dev/")
            .to_string();
        Ok(Self { file, name })
    }
    pub(crate) fn path(&self) -> String {
        format!("/dev/{}", self.name)
    }

    /// Reads the kernel has completed on it (its /sys/block stat).
    pub(crate) fn reads(&self) -> Result<u64> {
        let path = format!("/sys/block/{}/stat", self.name);
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
        text.split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("{path}: {text:?}"))
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(self.path()).status();
        let _ = std::fs::remove_file(&self.file);
    }
}

/// kernel.bpf_stats_enabled on for the run, restored after.
pub struct BpfStats(String);

impl BpfStats {
    const PATH: &'static str = "/proc/sys/kernel/bpf_stats_enabled";
    pub fn enable() -> Result<Self> {
        let old = std::fs::read_to_string(Self::PATH).unwrap_or_else(|_| "0".into());
        std::fs::write(Self::PATH, "1")
            .context("enabling kernel.bpf_stats_enabled (needs root)")?;
        Ok(Self(old.trim().to_string()))
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        let _ = std::fs::write(Self::PATH, &self.0);
    }
}

pub(crate) fn machine() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|c| {
        c.lines().find_map(|l| {
            l.strip_prefix("model name")
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
    });
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    serde_json::json!({
        "kernel": kernel.trim(),
        "cpu": cpu,
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
    })
}

pub(crate) fn chrono_free_date() -> String {
    let out = Command::new("date").args(["-u", "+%Y-%m-%d"]).output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

#[derive(clap::Args, Clone)]
pub struct CollectorArgs {
    /// Replays (the table shows medians).
    #[arg(long, default_value_t = 3)]
    reps: u32,
    /// I/Os the rig guest records (QD16), replayed --repeat times per rep.
    #[arg(long, default_value_t = 3000)]
    ios: u64,
    /// Times through the recording per replay.
    #[arg(long, default_value_t = 20)]
    repeat: u64,
    /// OTLP protocol the replay sends with: grpc or http/protobuf.
    #[arg(long, default_value = "grpc")]
    protocol: String,
}

/// What one gateway (the shipped collector/gateway.yaml: memory limiter,
/// tail sampling at its defaults, span metrics) takes of iospan's own
/// spans: a rig run's I/Os recorded once, then replayed at full speed.
/// The replay shares this machine's CPUs with the collector, so the
/// portable figure is spans per second of the collector's own CPU time.
pub fn collector(a: &CollectorArgs) -> Result<()> {
    use crate::backends::{self, Collector, Jaeger};
    sh::cargo(&["build", "--release", "-p", "iospan"])?;
    let iospan = sh::target_dir().join("release/iospan");
    let out_dir = sh::target_dir().join("bench");
    std::fs::create_dir_all(&out_dir)?;
    backends::ensure(backends::Backend::Otelcol)?;
    let events = out_dir.join("collector-events.jsonl");
    record_rig_events(a, &iospan, &events)?;
    let jaeger = Jaeger::start()?;
    // The gateway at its shipped defaults (slow 5 ms, 1% baseline).
    let gw = Collector::start(
        "gateway",
        &[("IOSPAN_TRACES_ENDPOINT", jaeger.otlp_grpc.as_str())],
    )?;
    let endpoint = if a.protocol == "grpc" {
        format!("http://{}", gw.otlp_grpc)
    } else {
        format!("http://{}", gw.otlp_http)
    };
    let mut rows = Vec::new();
    for rep in 0..a.reps {
        let cpu0 = gw.server.cpu_time()?;
        let out = Command::new(&iospan)
            .arg("replay")
            .arg(&events)
            .args(["--quiet", "--speed", "0", "--repeat", &a.repeat.to_string()])
            .args(["--otlp-endpoint", &endpoint, "--otlp-protocol", &a.protocol])
            .output()
            .context("running iospan replay")?;
        // Whatever the gateway still holds is part of this replay's work.
        std::thread::sleep(Duration::from_secs(3));
        let cpu_s = (gw.server.cpu_time()? - cpu0).as_secs_f64();
        let s: Value = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("iospan replay: {}", String::from_utf8_lossy(&out.stderr)))?;
        let row = ReplayRow {
            spans: s["exported_spans"].as_f64().unwrap_or(0.0),
            wall_s: s["elapsed_s"].as_f64().unwrap_or(f64::NAN),
            cpu_s,
            failed: s["failed_traces"].as_u64().unwrap_or(0)
                + s["dropped_queue_full"].as_u64().unwrap_or(0),
        };
        eprintln!(
            "xtask: bench collector: rep {}: {:.0} spans in {:.1} s, gateway CPU {:.1} s, {} traces failed",
            rep + 1,
            row.spans,
            row.wall_s,
            row.cpu_s,
            row.failed
        );
        rows.push(row);
    }
    render_collector(a, &rows, &out_dir)
}

/// A rig run's I/Os, recorded once as the events the replays send.
fn record_rig_events(a: &CollectorArgs, iospan: &Path, events: &Path) -> Result<()> {
    use crate::guest::{self as rig, RunArgs};
    let built = rig::build()?;
    let image = rig::dir().join("disk.img");
    rig::ensure_image(&image, 256)?;
    let args = RunArgs {
        qd: 16,
        ios: a.ios,
        name: "bench-guest".into(),
        ..Default::default()
    };
    let (qemu, _) = rig::qemu_command(&built, &args, &image);
    eprintln!("xtask: bench collector: recording {} rig I/Os", a.ios);
    let out = Command::new(iospan)
        .args(["run", "--quiet", "--events-out"])
        .arg(events)
        .arg("--")
        .arg(qemu.get_program())
        .args(qemu.get_args())
        .output()
        .context("recording the rig run")?;
    if !out.status.success() {
        bail!(
            "recording the rig run: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// One replay through the gateway.
struct ReplayRow {
    spans: f64,
    wall_s: f64,
    cpu_s: f64,
    failed: u64,
}

fn render_collector(a: &CollectorArgs, rows: &[ReplayRow], out_dir: &Path) -> Result<()> {
    let med = |f: &dyn Fn(&ReplayRow) -> f64| median(rows.iter().map(f));
    let wall = med(&|r| r.spans / r.wall_s);
    let per_cpu = med(&|r| r.spans / r.cpu_s);
    let cores = med(&|r| r.cpu_s / r.wall_s);
    let failed: u64 = rows.iter().map(|r| r.failed).sum();
    println!(
        "one gateway (collector/gateway.yaml at its defaults), iospan spans over OTLP {}, {} replays, medians",
        a.protocol, a.reps
    );
    println!(
        "  spans/s taken (replay and gateway on this {}-CPU machine): {wall:.0}",
        num_cpus()
    );
    println!("  gateway CPU: {cores:.2} cores; spans per gateway CPU-second: {per_cpu:.0}");
    println!("  traces not taken: {failed}");
    let json = serde_json::json!({
        "date": chrono_free_date(), "machine": machine(),
        "params": {"reps": a.reps, "ios": a.ios, "repeat": a.repeat, "protocol": a.protocol},
        "spans_per_s": wall, "gateway_cores": cores, "spans_per_gateway_cpu_s": per_cpu,
        "traces_not_taken": failed,
    });
    let path = out_dir.join("collector.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json)? + "\n")?;
    eprintln!("xtask: wrote {}", path.display());
    Ok(())
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// The median (the mean of the middle two for an even count); NaN of none.
/// The agent's own CPU time over an iospan run, from its report.
pub(crate) fn agent_cpu_ns(report: &Value) -> f64 {
    (report["agent"]["cpu_user_s"].as_f64().unwrap_or(0.0)
        + report["agent"]["cpu_sys_s"].as_f64().unwrap_or(0.0))
        * 1e9
}

/// Requests an iospan report counts as lost (`undelivered` are among the
/// `unseen`).
pub(crate) fn lost_requests(report: &Value) -> u64 {
    let lost = &report["lost"];
    [
        "ringbuf_drops",
        "disk_conflicts",
        "slot_conflicts",
        "no_issue",
        "bpf_recursion_misses",
        "unseen",
        "vm_table_full",
    ]
    .iter()
    .filter_map(|k| lost[k].as_u64())
    .sum()
}

/// The median of the values there are, if any.
pub(crate) fn median_of_some(v: impl IntoIterator<Item = Option<f64>>) -> Option<f64> {
    let v: Vec<f64> = v.into_iter().flatten().collect();
    (!v.is_empty()).then(|| median(v))
}

pub(crate) fn median(v: impl IntoIterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = v.into_iter().collect();
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}
