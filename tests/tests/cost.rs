//! The always-on tier's cost where there is no VM: `iospan agent` left
//! running on such a host attaches the block layer's programs and the
//! watch for new VMs (exec), and no system-call tracepoint, so a process
//! that lives on system calls runs at its untraced rate.

use std::{
    collections::BTreeSet,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use agent_integration::{agent_config, iospan_bin, run, Reap};
use serde_json::Value;
use xtask::backends::{free_port, http_get};

/// What an idle agent may attach: the block layer's accounting and the
/// events that tell it a VM appeared or went.
const IDLE_PROGRAMS: &[&str] = &[
    "block_rq_issue",
    "block_rq_complete",
    "block_rq_requeue",
    "block_io_start",
    "block_io_done",
    "block_rq_insert",
    "block_bio_backmerge",
    "block_bio_frontmerge",
    "block_rq_merge",
    "sched_process_exec",
    "sched_process_exit",
    "sched_process_fork",
];

fn bpftool_json(args: &[&str]) -> Value {
    let out = run(Command::new("bpftool").arg("-j").args(args));
    assert!(
        out.status.success(),
        "bpftool {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Array(vec![]))
}

/// The names of the programs process `pid` has attached: through links
/// (tp_btf, raw tracepoints, fentry) and perf events (tracepoints, kprobes,
/// uprobes), as the kernel lists them.
fn attached_programs(pid: u32) -> BTreeSet<String> {
    let of_pid = |v: &Value| {
        v["pids"]
            .as_array()
            .is_some_and(|ps| ps.iter().any(|p| p["pid"] == pid))
            || v["pid"] == pid
    };
    let mut ids: BTreeSet<u64> = BTreeSet::new();
    for list in [
        bpftool_json(&["link", "show"]),
        bpftool_json(&["perf", "show"]),
    ] {
        for v in list.as_array().into_iter().flatten().filter(|v| of_pid(v)) {
            if let Some(id) = v["prog_id"].as_u64() {
                ids.insert(id);
            }
        }
    }
    ids.iter()
        .map(|id| {
            let p = bpftool_json(&["prog", "show", "id", &id.to_string()]);
            p["name"].as_str().unwrap_or("?").to_string()
        })
        .collect()
}

/// The best of `slices` short runs of the syscall loop: interference
/// (another task's cache traffic, the host's neighbours) only ever slows
/// a run, while the slow system-call path slows every one.
fn rate(slices: usize) -> f64 {
    (0..slices)
        .map(|_| xtask::tax::syscall_pairs_per_cpu_s(Duration::from_millis(150)).unwrap())
        .fold(0.0, f64::max)
}

/// The same for two threads handing a byte back and forth: a wake-up and
/// a context switch each way, where the scheduler's tracepoints run.
fn trip_rate(slices: usize) -> f64 {
    (0..slices)
        .map(|_| xtask::tax::round_trips_per_cpu_s(Duration::from_millis(100)).unwrap())
        .fold(0.0, f64::max)
}

/// A slice's rates of a syscall-bound and a switch-bound process.
#[derive(Clone, Copy)]
struct Rates {
    syscalls: f64,
    trips: f64,
}

fn rates() -> Rates {
    Rates {
        syscalls: rate(2),
        trips: trip_rate(2),
    }
}

/// Whether the kernel's name for a program is `wanted` (either flavour:
/// `NAME_btf` or the raw tracepoint's `NAME`), in full or cut to the
/// kernel's 15 characters.
fn names(kernel: &str, wanted: &str) -> bool {
    let full = kernel.trim_end_matches("_btf");
    full == wanted || (kernel.len() == 15 && wanted.starts_with(kernel))
}

/// `iospan agent` with `conf`, once its API answers healthy.
fn start_idle_agent(conf: &std::path::Path, addr: &str) -> Reap {
    let agent = Reap(
        Command::new(iospan_bin())
            .args(["agent", "--config"])
            .arg(conf)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let t0 = Instant::now();
    while http_get(addr, "/healthz", &[]).ok().map(|(s, _)| s) != Some(200) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the agent never became healthy"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    settle(agent.0.id());
    agent
}

/// Waits until the agent is idle: healthy is not yet idle, it still loads
/// and verifies the VM path's programs and makes its first scans. Idle is
/// at most one clock tick (10 ms) of CPU in half a second; an agent never
/// idle within 20 s is measured as it is.
fn settle(pid: u32) {
    let cpu = || xtask::sh::cpu_time_of(pid).unwrap_or_default();
    let t0 = Instant::now();
    let mut last = cpu();
    while t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(500));
        let now = cpu();
        if now.saturating_sub(last) <= Duration::from_millis(10) {
            return;
        }
        last = now;
    }
}

/// Context switches of all of process `pid`'s threads so far: each is the
/// agent waking on some CPU, another process's caches and time slice.
fn switches_of(pid: u32) -> u64 {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .flat_map(|status| {
            status
                .lines()
                .filter(|l| l.starts_with("voluntary_ctxt") || l.starts_with("nonvoluntary_ctxt"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// The most an idle agent may wake per second (its threads' context
/// switches): its once-a-second figures and tenth-of-a-second VM look
/// make ~60 here; a look for new VMs or a ring drain on a timer of
/// milliseconds makes hundreds.
const IDLE_SWITCHES_PER_S: f64 = 150.0;

/// Slices of the syscall loop with the agent stopped and running, in
/// turn (~0.6 s a pair).
const PAIRS: usize = 120;

fn no_vm_runs() -> bool {
    let out = run(Command::new("pgrep").args(["-f", "qemu-system|qemu-storage-daemon"]));
    out.stdout.is_empty()
}

/// Sends `sig` to the agent, our own child.
fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) on a child this test started and still holds.
    let r = unsafe { libc::kill(pid as libc::pid_t, sig) };
    assert_eq!(
        r,
        0,
        "kill({pid}, {sig}): {}",
        std::io::Error::last_os_error()
    );
}

/// Slices with the agent stopped and running, in turn, and what the agent
/// itself did while it ran.
struct Slices {
    /// `PAIRS + 1`: one before each running slice and one after the last.
    stopped: Vec<Rates>,
    running: Vec<Rates>,
    /// The agent's context switches a second while it ran.
    switches_per_s: f64,
    /// The agent's CPU time while it ran, as a share of one CPU.
    cpu_share: f64,
}

/// The syscall loop's and the round trips' rates with the agent stopped
/// (SIGSTOP) and running, in turn, `PAIRS` times.
fn stopped_and_running(pid: u32) -> Slices {
    let stopped_rate = || {
        signal(pid, libc::SIGSTOP);
        let r = rates();
        signal(pid, libc::SIGCONT);
        r
    };
    let cpu = || xtask::sh::cpu_time_of(pid).unwrap_or_default();
    let (mut stopped, mut running) = (vec![stopped_rate()], Vec::new());
    let (mut switches, mut used, mut ran) = (0, Duration::ZERO, Duration::ZERO);
    for _ in 0..PAIRS {
        let (before, cpu0, t0) = (switches_of(pid), cpu(), Instant::now());
        running.push(rates());
        switches += switches_of(pid) - before;
        used += cpu().saturating_sub(cpu0);
        ran += t0.elapsed();
        stopped.push(stopped_rate());
    }
    Slices {
        stopped,
        running,
        switches_per_s: switches as f64 / ran.as_secs_f64(),
        cpu_share: used.as_secs_f64() / ran.as_secs_f64(),
    }
}

/// The median of the running slices' rates (`of` them) against the
/// stopped ones either side of each, with its lower and upper bounds at
/// 99 % confidence.
struct Ratio {
    low: f64,
    median: f64,
    high: f64,
}

/// A slice's rate moves by ~7 % (one standard deviation) on this machine
/// whatever the agent does, so a median of 120 is known to ~0.8 %: a cost
/// is only called one where the data rule out one of at most 1 %. The
/// bounds are order statistics (no assumption on the noise's shape): the
/// median lies below the k-th smallest of n with probability given by the
/// binomial, ~n/2 + 1.17·√n at 99 % one-sided.
fn median_ratio(s: &Slices, of: fn(&Rates) -> f64) -> Ratio {
    let mut ratios: Vec<f64> = s
        .running
        .iter()
        .zip(s.stopped.windows(2))
        .map(|(r, around)| of(r) / ((of(&around[0]) + of(&around[1])) / 2.0))
        .collect();
    ratios.sort_by(f64::total_cmp);
    let n = ratios.len();
    let k = ((n as f64 / 2.0 + 1.17 * (n as f64).sqrt()).ceil() as usize).min(n);
    Ratio {
        low: ratios[n - k],
        median: (ratios[(n - 1) / 2] + ratios[n / 2]) / 2.0,
        high: ratios[k - 1],
    }
}

/// The most of one CPU an idle agent may use. Measured here: 0.46–0.55 %,
/// ~50 wake-ups a second (its timers and the runtime's parking), a tenth
/// of it reading the counters of the host's 38 disks once a second.
const IDLE_CPU_SHARE: f64 = 0.01;

#[test]
fn an_idle_agent_attaches_no_system_call_probe_and_costs_no_process_anything() {
    assert!(
        no_vm_runs(),
        "a VM process runs on this host: this test measures an agent with none"
    );
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("idle-agent");
    std::fs::create_dir_all(&dir).unwrap();
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let (conf, _token) = agent_config(&dir, "", &addr);
    // Every disk of the host, as a service is usually set up.
    std::fs::write(&conf, format!("[api]\nlisten = \"{addr}\"\n")).unwrap();

    // What an idle agent costs a process that lives on system calls is
    // what its programs add to them and what its own wake-ups take from
    // the process's CPUs and caches. The first is ruled out by what it
    // attaches: no program on any system call's path (listed below), only
    // the block layer's and exec's, which this loop never reaches. The
    // second is measured against the same agent stopped (its programs
    // still attached, waking for nothing), in slices of a fraction of a
    // second in turn: this machine's own rate moves by a quarter for
    // seconds at a time with its neighbours' load, so an agent started
    // and stopped per slice (seconds apart, 24 cycles) read anywhere
    // from 90 % to 101 % for the same agent (one run's 24 ratios, 9 %
    // apart on average).
    let agent = start_idle_agent(&conf, &addr);
    let pid = agent.0.id();
    let mut programs = attached_programs(pid);
    let slices = stopped_and_running(pid);
    programs.extend(attached_programs(pid));
    drop(agent);
    eprintln!("pairs and round trips per CPU-second, the agent stopped and running, in turn:");
    for (s, r) in slices.stopped.iter().zip(&slices.running) {
        eprintln!(
            "  {:>9.0} {:>9.0}   {:>9.0} {:>9.0}",
            s.syscalls, r.syscalls, s.trips, r.trips
        );
    }
    let last = &slices.stopped[PAIRS];
    eprintln!("  {:>9.0} {:>9} {:>11.0}", last.syscalls, "", last.trips);
    eprintln!("attached: {programs:?}");
    eprintln!(
        "the idle agent: {:.0} context switches a second, {:.3} % of a CPU",
        slices.switches_per_s,
        slices.cpu_share * 100.0
    );
    assert!(
        programs.iter().any(|p| names(p, "block_rq_complete")),
        "the block layer is not traced: {programs:?}"
    );
    let unexpected: Vec<_> = programs
        .iter()
        .filter(|p| !IDLE_PROGRAMS.iter().any(|ok| names(p, ok)))
        .collect();
    assert!(
        unexpected.is_empty(),
        "an idle agent attached {unexpected:?} (all: {programs:?})"
    );
    assert!(
        slices.switches_per_s <= IDLE_SWITCHES_PER_S,
        "an idle agent wakes {:.0} times a second (at most {IDLE_SWITCHES_PER_S})",
        slices.switches_per_s
    );
    assert!(
        slices.cpu_share <= IDLE_CPU_SHARE,
        "an idle agent uses {:.2} % of a CPU (at most {:.1} %)",
        slices.cpu_share * 100.0,
        IDLE_CPU_SHARE * 100.0
    );
    for (kind, of) in [
        (
            "syscall-bound",
            (|r: &Rates| r.syscalls) as fn(&Rates) -> f64,
        ),
        ("switch-bound", |r: &Rates| r.trips),
    ] {
        let r = median_ratio(&slices, of);
        eprintln!(
            "{kind}: the agent running against the stopped slices around it, median of {PAIRS}: \
             {:.1} % (99 % bounds {:.1}–{:.1} %)",
            r.median * 100.0,
            r.low * 100.0,
            r.high * 100.0
        );
        assert!(
            r.high >= 0.99,
            "an idle agent costs a {kind} process {:.1} % (at least {:.1} %, at 99 % confidence)",
            (1.0 - r.median) * 100.0,
            (1.0 - r.high) * 100.0
        );
    }
}

/// The instructions the kernel's verifier walked for each program process
/// `pid` holds loaded (`verified_insns` in each program descriptor's fdinfo,
/// kernels 5.16 and later): what a start of the agent costs before it
/// measures anything.
fn verified_instructions(pid: u32) -> Vec<u64> {
    std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .filter(|info| info.contains("prog_id:"))
        .filter_map(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix("verified_insns:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .collect()
}

/// Every program an agent loads at its start (the block layer's, and the VM
/// path's, verified ahead of a VM) is walked by the kernel's verifier in
/// well under its limit of a million instructions, and all of them in under
/// a million together: at about a microsecond each, that is the agent's
/// start. (Inlined loops over a thread's slots and a drain settling 16
/// requests per call once took 2.1 million, 1.7 s of every start.)
#[test]
fn an_agent_starts_with_under_a_million_instructions_to_verify() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("verify-cost");
    std::fs::create_dir_all(&dir).unwrap();
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let (conf, _token) = agent_config(&dir, "", &addr);
    std::fs::write(&conf, format!("[api]\nlisten = \"{addr}\"\n")).unwrap();
    let agent = start_idle_agent(&conf, &addr);
    let counts = verified_instructions(agent.0.id());
    drop(agent);
    let total: u64 = counts.iter().sum();
    let largest = counts.iter().copied().max().unwrap_or(0);
    eprintln!(
        "{} programs, {total} instructions verified, the largest {largest}",
        counts.len()
    );
    // The VM path's programs are among them (more than the block layer's
    // handful), each of them counted.
    assert!(counts.len() >= 15, "{} programs loaded", counts.len());
    assert!(
        total < 1_000_000 && largest < 250_000,
        "{total} instructions verified in all, {largest} in one program: {counts:?}"
    );
}
