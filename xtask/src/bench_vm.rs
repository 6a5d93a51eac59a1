//! `cargo xtask bench vm`: iospan's cost on the VM path at production
//! rates. N VMs of tests/native/vm_load.c (processes named as QEMU's, each
//! with Q virtqueues kicked through KVM's ioeventfd, an io_uring engine at
//! depth D on a loop device over /dev/shm, completions signalled through
//! irqfds) run under four arms, interleaved and rotated per repetition:
//! untraced, `iospan run --no-vms` (block layer only), `iospan run` (the VM
//! split), and the split with OTLP export to a local sink. Beside the VMs a
//! process that is no VM makes 8-byte reads and writes (the system calls
//! the VM path's tracepoints see): its throughput is the tax on the host's
//! other work. Medians of the repetitions.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{TcpListener, TcpStream},
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
    /// Seconds of load per arm and repetition.
    #[arg(long, default_value_t = 5)]
    seconds: u32,
    /// Repetitions of each arm (the table shows medians).
    #[arg(long, default_value_t = 3)]
    reps: u32,
    /// Engines poll their queues this long (ns) before sleeping, as QEMU's
    /// iothreads do (poll-max-ns; 32768 is QEMU's default); 0: event-driven.
    #[arg(long, default_value_t = 0)]
    poll_ns: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Arm {
    Off,
    BlockOnly,
    Split,
    SplitOtlp,
}

impl Arm {
    fn label(self) -> &'static str {
        match self {
            Arm::Off => "untraced",
            Arm::BlockOnly => "block-only",
            Arm::Split => "VM split",
            Arm::SplitOtlp => "split+OTLP",
        }
    }
}

#[derive(Clone, Debug, Serialize)]
struct Sample {
    arm: Arm,
    rep: u32,
    /// Guest requests the VMs completed.
    guest_ios: u64,
    guest_iops: f64,
    /// Busy CPU of the whole machine per guest I/O.
    cpu_ns_per_io: f64,
    bpf_ns_per_io: Option<f64>,
    agent_ns_per_io: Option<f64>,
    /// Per program: its kernel-measured run time per guest I/O.
    bpf_by_program: Option<Vec<(String, f64)>>,
    /// Records lost, requests the split could not use, and guest requests
    /// iospan did not count (made − counted − merged).
    lost: Option<u64>,
    unsplit: Option<u64>,
    uncounted: Option<i64>,
    agent_rss_mib: Option<f64>,
    /// The non-VM process's 8-byte read+write pairs per second.
    syscall_pairs_per_s: f64,
    otlp_requests: Option<u64>,
}

#[derive(Serialize)]
struct Summary {
    arm: Arm,
    guest_iops: f64,
    iops_vs_untraced: f64,
    cpu_ns_per_io: f64,
    added_ns_per_io: f64,
    bpf_ns_per_io: Option<f64>,
    agent_ns_per_io: Option<f64>,
    tracer_ns_per_io: Option<f64>,
    lost: Option<u64>,
    unsplit: Option<u64>,
    uncounted: Option<i64>,
    agent_rss_mib: Option<f64>,
    syscalls_vs_untraced: f64,
}

pub fn vm(a: &VmArgs) -> Result<()> {
    if a.vms == 0 || a.queues == 0 || a.queues > 64 || a.qd == 0 || a.qd > 512 || a.seconds == 0 {
        bail!("--vms and --seconds must be at least 1, --queues 1-64, --qd 1-512");
    }
    if !Path::new("/dev/kvm").exists() {
        bail!("bench vm runs its VMs on KVM: /dev/kvm is missing (load kvm_intel or kvm_amd)");
    }
    sh::cargo(&["build", "--release", "-p", "iospan"])?;
    let iospan = sh::root().join("target/release/iospan");
    let out_dir = sh::root().join("target/bench");
    let vm_exe = build_vm_load(&out_dir)?;
    let dev = LoopDev::create(256)?;
    let _stats = BpfStats::enable()?;
    let sink = OtlpSink::start()?;

    let arms = [Arm::Off, Arm::BlockOnly, Arm::Split, Arm::SplitOtlp];
    let mut samples = Vec::new();
    for rep in 0..a.reps {
        for i in 0..arms.len() {
            let arm = arms[(i + rep as usize) % arms.len()];
            eprintln!(
                "xtask: bench vm: rep {}/{} arm {}",
                rep + 1,
                a.reps,
                arm.label()
            );
            let s = measure(arm, rep, a, &dev, &iospan, &vm_exe, &out_dir, &sink)?;
            eprintln!(
                "        {:.0} guest IOPS, {:.0} ns CPU/IO, tracer {} ns/IO, lost {:?}, uncounted {:?}",
                s.guest_iops,
                s.cpu_ns_per_io,
                s.bpf_ns_per_io
                    .map(|b| format!("{:.0}", b + s.agent_ns_per_io.unwrap_or(0.0)))
                    .unwrap_or_else(|| "-".into()),
                s.lost,
                s.uncounted,
            );
            samples.push(s);
        }
    }

    let of = |arm: Arm| samples.iter().filter(move |s| s.arm == arm);
    let base = |rep: u32| samples.iter().find(|s| s.arm == Arm::Off && s.rep == rep);
    let per_rep = |arm: Arm, f: &dyn Fn(&Sample, &Sample) -> f64| {
        median(of(arm).filter_map(|s| base(s.rep).map(|b| f(s, b))))
    };
    let summaries: Vec<Summary> = arms
        .iter()
        .map(|&arm| {
            let bpf = median_of_some(of(arm).map(|s| s.bpf_ns_per_io));
            let agent = median_of_some(of(arm).map(|s| s.agent_ns_per_io));
            Summary {
                arm,
                guest_iops: median(of(arm).map(|s| s.guest_iops)),
                iops_vs_untraced: per_rep(arm, &|s, b| s.guest_iops / b.guest_iops),
                cpu_ns_per_io: median(of(arm).map(|s| s.cpu_ns_per_io)),
                added_ns_per_io: per_rep(arm, &|s, b| s.cpu_ns_per_io - b.cpu_ns_per_io),
                bpf_ns_per_io: bpf,
                agent_ns_per_io: agent,
                tracer_ns_per_io: bpf.map(|b| b + agent.unwrap_or(0.0)),
                lost: of(arm).map(|s| s.lost).sum(),
                unsplit: of(arm).map(|s| s.unsplit).sum(),
                uncounted: of(arm).map(|s| s.uncounted).sum(),
                agent_rss_mib: median_of_some(of(arm).map(|s| s.agent_rss_mib)),
                syscalls_vs_untraced: per_rep(arm, &|s, b| {
                    s.syscall_pairs_per_s / b.syscall_pairs_per_s
                }),
            }
        })
        .collect();
    // Where the split's BPF time goes: each program's median per guest I/O.
    let programs = by_program(of(Arm::Split));
    let table = render(&summaries, &programs, a);
    print!("{table}");
    let json = serde_json::json!({
        "date": chrono_free_date(),
        "machine": machine(),
        "params": {
            "vms": a.vms, "queues": a.queues, "qd": a.qd, "seconds": a.seconds,
            "reps": a.reps, "poll_ns": a.poll_ns,
            "device": "loop over /dev/shm, direct-io; 4 KiB random reads, io_uring",
        },
        "summary": summaries,
        "split_bpf_ns_per_io_by_program": programs,
        "samples": samples,
    });
    std::fs::create_dir_all(&out_dir)?;
    let path = out_dir.join("vm.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json)? + "\n")?;
    eprintln!("xtask: wrote {}", path.display());
    Ok(())
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

#[allow(clippy::too_many_arguments)]
fn measure(
    arm: Arm,
    rep: u32,
    a: &VmArgs,
    dev: &LoopDev,
    iospan: &Path,
    vm_exe: &Path,
    out_dir: &Path,
    sink: &OtlpSink,
) -> Result<Sample> {
    let report = out_dir.join("vm-iospan.json");
    let _ = std::fs::remove_file(&report);
    let mut tracer = if arm == Arm::Off {
        None
    } else {
        let mut cmd = Command::new(iospan);
        cmd.args(["-v", "run", "--quiet", "--bpf-stats", "--duration", "1h"])
            .arg("--json-out")
            .arg(&report)
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
        if arm == Arm::BlockOnly {
            cmd.arg("--no-vms");
        }
        if arm == Arm::SplitOtlp {
            cmd.arg("--otlp-endpoint").arg(sink.endpoint());
        }
        let mut c = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting iospan")?;
        wait_for_line(&mut c, false, "attached block_rq_complete")?;
        Some(c)
    };
    std::thread::sleep(Duration::from_millis(500));
    let otlp0 = sink.requests.load(Ordering::Relaxed);

    let stop = Arc::new(AtomicBool::new(false));
    let tax = {
        let stop = stop.clone();
        std::thread::spawn(move || syscall_pairs(&stop))
    };
    let cpu0 = busy_cpu_ns()?;
    let vms: Vec<Child> = (0..a.vms)
        .map(|i| {
            Command::new(vm_exe)
                .args(["-name", &format!("guest=bench{i:02},debug-threads=on")])
                .arg("-drive")
                .arg(format!(
                    "file={},if=none,id=d0,format=raw,cache=none,aio=io_uring",
                    dev.path()
                ))
                .args([
                    "-device",
                    &format!("virtio-blk-pci,drive=d0,num-queues={}", a.queues),
                ])
                .env("IOSPAN_VM_QUEUES", a.queues.to_string())
                .env("IOSPAN_VM_QD", a.qd.to_string())
                .env("IOSPAN_VM_SECONDS", a.seconds.to_string())
                .env("IOSPAN_VM_POLL_NS", a.poll_ns.to_string())
                .stdout(Stdio::piped())
                .spawn()
                .context("starting a VM")
        })
        .collect::<Result<_>>()?;
    let mut guest_ios = 0u64;
    let mut guest_iops = 0.0;
    for vm in vms {
        let out = vm.wait_with_output()?;
        let line = String::from_utf8_lossy(&out.stdout).to_string();
        if !out.status.success() {
            bail!("a VM failed ({}): {line}", out.status);
        }
        guest_ios += field(&line, "requests")? as u64;
        guest_iops += field(&line, "iops")?;
    }
    let cpu1 = busy_cpu_ns()?;
    stop.store(true, Ordering::Relaxed);
    let syscall_pairs_per_s = tax.join().map_err(|_| anyhow::anyhow!("tax thread"))?;

    let per_io = |ns: f64| ns / guest_ios.max(1) as f64;
    let mut s = Sample {
        arm,
        rep,
        guest_ios,
        guest_iops,
        cpu_ns_per_io: per_io(cpu1.saturating_sub(cpu0) as f64),
        bpf_ns_per_io: None,
        agent_ns_per_io: None,
        bpf_by_program: None,
        lost: None,
        unsplit: None,
        uncounted: None,
        agent_rss_mib: None,
        syscall_pairs_per_s,
        otlp_requests: None,
    };
    if let Some(mut c) = tracer.take() {
        s.agent_rss_mib = peak_rss_mib(c.id());
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(c.id() as i32, libc::SIGINT) };
        let st = c.wait()?;
        if !st.success() {
            bail!("iospan exited with {st}");
        }
        let r: Value = serde_json::from_slice(&std::fs::read(&report).context("iospan's report")?)?;
        let progs: Vec<(String, f64)> = r["agent"]["bpf"]
            .as_array()
            .context("bpf stats")?
            .iter()
            .filter_map(|p| {
                Some((
                    p["name"].as_str()?.to_string(),
                    per_io(p["run_time_ns"].as_u64()? as f64),
                ))
            })
            .collect();
        s.bpf_ns_per_io = Some(progs.iter().map(|p| p.1).sum());
        s.bpf_by_program = Some(progs);
        s.agent_ns_per_io = Some(per_io(agent_cpu_ns(&r)));
        s.lost = Some(lost_requests(&r));
        if arm != Arm::BlockOnly {
            let split = &r["lost"]["host_split"];
            s.unsplit = Some(
                [
                    "no_kick",
                    "no_signal",
                    "unordered",
                    "not_followed",
                    "polled",
                ]
                .iter()
                .filter_map(|k| split[k].as_u64())
                .sum(),
            );
            // Every guest request is a VM entry's I/O or a merge.
            let counted: u64 = r["entries"]
                .as_array()
                .context("entries")?
                .iter()
                .filter(|e| e["vm"].as_str().is_some_and(|v| v.starts_with("bench")))
                .filter_map(|e| e["ios"].as_u64())
                .sum();
            let merged: u64 = r["vms"]
                .as_array()
                .context("vms")?
                .iter()
                .filter(|v| v["name"].as_str().is_some_and(|n| n.starts_with("bench")))
                .map(|v| {
                    v["host_merged"].as_u64().unwrap_or(0)
                        + v["engine_merged"].as_u64().unwrap_or(0)
                })
                .sum();
            s.uncounted = Some(guest_ios as i64 - (counted + merged) as i64);
        }
        if arm == Arm::SplitOtlp {
            s.otlp_requests = Some(sink.requests.load(Ordering::Relaxed) - otlp0);
        }
    }
    Ok(s)
}

/// `key=value` from the load generator's closing line.
fn field(line: &str, key: &str) -> Result<f64> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
        .with_context(|| format!("no {key}= in the VM's line {line:?}"))
}

/// 8-byte reads of /dev/zero and writes to /dev/null until told to stop:
/// pairs per second.
fn syscall_pairs(stop: &AtomicBool) -> f64 {
    let (Ok(mut zero), Ok(mut null)) = (
        std::fs::File::open("/dev/zero"),
        std::fs::OpenOptions::new().write(true).open("/dev/null"),
    ) else {
        return f64::NAN;
    };
    let mut buf = [0u8; 8];
    let t = Instant::now();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        if zero.read_exact(&mut buf).is_err() || null.write_all(&buf).is_err() {
            return f64::NAN;
        }
        n += 1;
    }
    n as f64 / t.elapsed().as_secs_f64()
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

fn by_program<'a>(samples: impl Iterator<Item = &'a Sample>) -> Vec<(String, f64)> {
    let mut all: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    for s in samples {
        for (p, ns) in s.bpf_by_program.iter().flatten() {
            all.entry(p.clone()).or_default().push(*ns);
        }
    }
    let mut v: Vec<(String, f64)> = all.into_iter().map(|(p, ns)| (p, median(ns))).collect();
    v.retain(|p| p.1 >= 0.5);
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v
}

fn render(summaries: &[Summary], programs: &[(String, f64)], a: &VmArgs) -> String {
    use std::fmt::Write;
    let mut t = String::new();
    let o = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
    let _ = writeln!(
        t,
        "{} VMs x {} queues x QD{}, 4 KiB random reads (io_uring) on a loop device over /dev/shm, {}, {} s per arm, medians of {}\n",
        a.vms,
        a.queues,
        a.qd,
        if a.poll_ns > 0 {
            format!("engines polling {} ns", a.poll_ns)
        } else {
            "event-driven engines".to_string()
        },
        a.seconds,
        a.reps
    );
    let _ = writeln!(
        t,
        "{:<11} {:>9} {:>7} {:>9} {:>9} {:>8} {:>8} {:>9} {:>6} {:>8} {:>10} {:>8} {:>9}",
        "arm",
        "guest IOPS",
        "IOPS %",
        "CPU ns/IO",
        "added",
        "BPF ns",
        "agent ns",
        "tracer ns",
        "lost",
        "unsplit",
        "uncounted",
        "RSS MiB",
        "syscalls %"
    );
    for s in summaries {
        let _ = writeln!(
            t,
            "{:<11} {:>10.0} {:>7.1} {:>9.0} {:>9.0} {:>8} {:>8} {:>9} {:>6} {:>8} {:>10} {:>8} {:>9.1}",
            s.arm.label(),
            s.guest_iops,
            s.iops_vs_untraced * 100.0,
            s.cpu_ns_per_io,
            s.added_ns_per_io,
            o(s.bpf_ns_per_io),
            o(s.agent_ns_per_io),
            o(s.tracer_ns_per_io),
            s.lost.map_or("-".into(), |v| v.to_string()),
            s.unsplit.map_or("-".into(), |v| v.to_string()),
            s.uncounted.map_or("-".into(), |v| v.to_string()),
            s.agent_rss_mib.map_or("-".into(), |v| format!("{v:.1}")),
            s.syscalls_vs_untraced * 100.0,
        );
    }
    let _ = writeln!(t, "\nVM split, BPF run time per guest I/O by program (ns):");
    for (p, ns) in programs {
        let _ = writeln!(t, "  {p:<28} {ns:>8.0}");
    }
    t
}

/// An OTLP/HTTP endpoint that takes every export and keeps nothing: the
/// split+OTLP arm pays for building and sending its traces, not for a
/// collector's work.
struct OtlpSink {
    port: u16,
    requests: Arc<AtomicU64>,
}

impl OtlpSink {
    fn start() -> Result<Self> {
        let l = TcpListener::bind("127.0.0.1:0").context("binding the OTLP sink")?;
        let port = l.local_addr()?.port();
        let requests = Arc::new(AtomicU64::new(0));
        let n = requests.clone();
        std::thread::spawn(move || {
            for conn in l.incoming().flatten() {
                let n = n.clone();
                std::thread::spawn(move || serve(conn, &n));
            }
        });
        Ok(Self { port, requests })
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

/// HTTP/1.1 requests on one connection, each answered 200 with an empty
/// (valid) export response.
fn serve(conn: TcpStream, n: &AtomicU64) {
    let Ok(mut w) = conn.try_clone() else { return };
    let mut r = BufReader::new(conn);
    loop {
        let mut len = 0usize;
        let mut line = String::new();
        let mut first = true;
        loop {
            line.clear();
            match r.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            if line == "\r\n" && !first {
                break;
            }
            first = false;
            if let Some(v) = line
                .to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().to_string())
            {
                len = v.parse().unwrap_or(0);
            }
        }
        let mut body = vec![0u8; len];
        if r.read_exact(&mut body).is_err() {
            return;
        }
        n.fetch_add(1, Ordering::Relaxed);
        if w.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n",
        )
        .is_err()
        {
            return;
        }
    }
}
