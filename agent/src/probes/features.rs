//! What this kernel lets us attach, found by loading and attaching one
//! trivial program per type (`bpf/features.bpf.c`) and seeing it fire.

use std::{process::Command, time::Duration};

use aya::{
    maps::Array,
    programs::{BtfTracePoint, FEntry, KProbe, RawTracePoint, TracePoint, UProbe},
    Btf, Ebpf, EbpfLoader,
};
use serde::Serialize;

use super::error_chain;

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/features.bpf.o"));

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum ProbeType {
    TpBtf,
    RawTp,
    Tracepoint,
    Kprobe,
    Fentry,
    Uprobe,
    /// Not a program type: the atomic operations every iospan program
    /// uses (Linux 5.12), on a raw tracepoint.
    Atomics,
}

impl ProbeType {
    pub const ALL: [ProbeType; 7] = [
        Self::TpBtf,
        Self::RawTp,
        Self::Tracepoint,
        Self::Kprobe,
        Self::Fentry,
        Self::Uprobe,
        Self::Atomics,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::TpBtf => "tp_btf",
            Self::RawTp => "raw_tp",
            Self::Tracepoint => "tracepoint",
            Self::Kprobe => "kprobe",
            Self::Fentry => "fentry",
            Self::Uprobe => "uprobe",
            Self::Atomics => "atomics",
        }
    }

    fn program(self) -> &'static str {
        match self {
            Self::TpBtf => "probe_tp_btf",
            Self::RawTp => "probe_raw_tp",
            Self::Tracepoint => "probe_tracepoint",
            Self::Kprobe => "probe_kprobe",
            Self::Fentry => "probe_fentry",
            Self::Uprobe => "probe_uprobe",
            Self::Atomics => "probe_atomics",
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct ProbeResult {
    pub probe: ProbeType,
    pub works: bool,
    /// Why not, when it does not work: the failing step and the kernel's error.
    pub reason: Option<String>,
}

/// Target of the uprobe check: a function of this very binary, so the
/// check needs nothing else on the machine.
#[no_mangle]
#[inline(never)]
pub extern "C" fn iospan_uprobe_target(x: u64) -> u64 {
    std::hint::black_box(x.wrapping_mul(31))
}

/// Each type tried. Where the atomics fail, no type can carry iospan's
/// programs: each says so rather than "works" for what would not load.
pub fn probe_all() -> Vec<ProbeResult> {
    // As a run would: tracefs mounted where the host has not.
    mount_tracefs();
    let btf = Btf::from_sys_fs().ok();
    let mut results: Vec<ProbeResult> = ProbeType::ALL
        .iter()
        .map(|&probe| match probe_one(btf.as_ref(), probe) {
            Ok(()) => ProbeResult {
                probe,
                works: true,
                reason: None,
            },
            Err(reason) => ProbeResult {
                probe,
                works: false,
                reason: Some(explain(probe, reason)),
            },
        })
        .collect();
    let atomics = results
        .iter()
        .any(|r| r.probe == ProbeType::Atomics && r.works);
    if !atomics {
        for r in results.iter_mut().filter(|r| r.works) {
            r.works = false;
            r.reason = Some(
                "loads, but iospan's programs need the BPF atomic operations this kernel lacks (Linux 5.12)".into(),
            );
        }
    }
    results
}

fn probe_one(btf: Option<&Btf>, probe: ProbeType) -> Result<(), String> {
    // A fresh object per type: one type's failure cannot affect another.
    EbpfLoader::new()
        .btf(btf)
        .load(OBJECT)
        .map_err(|e| format!("loading the probe object: {}", error_chain(&e)))
        .and_then(|mut ebpf| try_probe(&mut ebpf, btf, probe))
}

/// Whether this kernel runs the atomic operations iospan's programs use:
/// the one thing below which it cannot run at all. The error is the one
/// line a user sees.
pub fn check_atomics() -> Result<(), String> {
    let btf = Btf::from_sys_fs().ok();
    probe_one(btf.as_ref(), ProbeType::Atomics).map_err(|e| {
        format!(
            "this kernel ({}) lacks the BPF atomic operations iospan's programs use \
             (fetch-and-add with its result, compare-and-exchange: Linux 5.12); \
             iospan supports Linux 5.12 and later ({})",
            kernel_release(),
            e.lines().next().unwrap_or("")
        )
    })
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// Puts the usual causes in words before the kernel's own message.
fn explain(probe: ProbeType, reason: String) -> String {
    let cause = match probe {
        ProbeType::Kprobe if reason.contains("devices/kprobe") => Some("no kprobe PMU in this kernel (perf_kprobe)"),
        ProbeType::Atomics if reason.contains("reserved fields") || reason.contains("invalid") => {
            Some("the verifier refuses BPF atomic operations (Linux 5.12): iospan cannot run on this kernel")
        }
        ProbeType::Fentry if reason.contains("not permitted") => {
            Some("the kernel refuses BPF trampolines here (EPERM at load; lockdown or no trampoline support)")
        }
        _ if reason.contains("Permission denied") => Some("not permitted (root or CAP_BPF + CAP_PERFMON needed)"),
        _ => None,
    };
    match cause {
        Some(c) => format!("{c}: {reason}"),
        None => reason,
    }
}

fn try_probe(ebpf: &mut Ebpf, btf: Option<&Btf>, probe: ProbeType) -> Result<(), String> {
    let name = probe.program();
    let prog = ebpf
        .program_mut(name)
        .ok_or_else(|| format!("program {name} missing"))?;
    let step = |what: &str, e: &dyn std::error::Error| format!("{what}: {}", error_chain(e));
    let no_btf = || "no kernel BTF (/sys/kernel/btf/vmlinux)".to_string();
    match probe {
        ProbeType::TpBtf => {
            let p: &mut BtfTracePoint = prog.try_into().map_err(|e| step("type", &e))?;
            p.load("sched_process_exec", btf.ok_or_else(no_btf)?)
                .map_err(|e| step("load", &e))?;
            p.attach().map_err(|e| step("attach", &e))?;
        }
        ProbeType::RawTp | ProbeType::Atomics => {
            let p: &mut RawTracePoint = prog.try_into().map_err(|e| step("type", &e))?;
            p.load().map_err(|e| step("load", &e))?;
            p.attach("sched_process_exec")
                .map_err(|e| step("attach", &e))?;
        }
        ProbeType::Tracepoint => {
            let p: &mut TracePoint = prog.try_into().map_err(|e| step("type", &e))?;
            p.load().map_err(|e| step("load", &e))?;
            p.attach("sched", "sched_process_exec")
                .map_err(|e| step("attach", &e))?;
        }
        ProbeType::Kprobe => {
            let p: &mut KProbe = prog.try_into().map_err(|e| step("type", &e))?;
            p.load().map_err(|e| step("load", &e))?;
            p.attach("do_nanosleep", 0)
                .map_err(|e| step("attach", &e))?;
        }
        ProbeType::Fentry => {
            let p: &mut FEntry = prog.try_into().map_err(|e| step("type", &e))?;
            p.load("do_nanosleep", btf.ok_or_else(no_btf)?)
                .map_err(|e| step("load", &e))?;
            p.attach().map_err(|e| step("attach", &e))?;
        }
        ProbeType::Uprobe => {
            let p: &mut UProbe = prog.try_into().map_err(|e| step("type", &e))?;
            p.load().map_err(|e| step("load", &e))?;
            let exe =
                std::env::current_exe().map_err(|e| format!("finding our own binary: {e}"))?;
            // By file offset, not symbol: a packaged binary is stripped.
            let offset = own_file_offset(iospan_uprobe_target as *const () as usize)?;
            p.attach(
                offset,
                &exe,
                aya::programs::uprobe::UProbeScope::CallingProcess,
            )
            .map_err(|e| step("attach", &e))?;
        }
    }
    trigger(probe);
    let hits = read_hits(ebpf)?;
    if hits == 0 {
        return Err("attached, but did not fire when triggered".into());
    }
    Ok(())
}

/// Where a code address of this process lies in its executable's file,
/// from the mapping that holds it.
fn own_file_offset(addr: usize) -> Result<u64, String> {
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| format!("reading /proc/self/maps: {e}"))?;
    maps.lines()
        .find_map(|line| {
            let mut f = line.split_whitespace();
            let (start, end) = f.next()?.split_once('-')?;
            let (start, end) = (
                usize::from_str_radix(start, 16).ok()?,
                usize::from_str_radix(end, 16).ok()?,
            );
            let _perms = f.next()?;
            let offset = u64::from_str_radix(f.next()?, 16).ok()?;
            (start..end)
                .contains(&addr)
                .then(|| offset + (addr - start) as u64)
        })
        .ok_or_else(|| format!("no mapping of this binary holds {addr:#x}"))
}

fn trigger(probe: ProbeType) {
    match probe {
        ProbeType::TpBtf | ProbeType::RawTp | ProbeType::Tracepoint | ProbeType::Atomics => {
            let _ = Command::new("/bin/true").status();
        }
        ProbeType::Kprobe | ProbeType::Fentry => std::thread::sleep(Duration::from_millis(1)),
        ProbeType::Uprobe => {
            iospan_uprobe_target(7);
        }
    }
}

fn read_hits(ebpf: &Ebpf) -> Result<u64, String> {
    let map = ebpf.map(".bss").ok_or("no .bss map")?;
    let bss: Array<_, u64> = Array::try_from(map).map_err(|e| error_chain(&e))?;
    bss.get(&0, 0).map_err(|e| error_chain(&e))
}

/// What one uprobe hit costs the probed thread here, by how the kernel
/// runs the probed instruction: emulated (a `push` prologue, QEMU's
/// `msix_notify`) or single-stepped out of line (most others, e.g. QEMU's
/// `virtqueue_pop`).
#[derive(Clone, Debug, Serialize)]
pub struct UprobeCost {
    pub prologue: &'static str,
    pub ns_per_hit: f64,
}

// Two probe targets whose first instruction is chosen: the kernel
// emulates `push`, and single-steps `mov`.
#[cfg(target_arch = "x86_64")]
std::arch::global_asm!(
    ".globl iospan_uprobe_push",
    ".type iospan_uprobe_push,@function",
    "iospan_uprobe_push:",
    "push rbp",
    "lea rax, [rdi + 1]",
    "pop rbp",
    "ret",
    ".size iospan_uprobe_push, .-iospan_uprobe_push",
    ".globl iospan_uprobe_stepped",
    ".type iospan_uprobe_stepped,@function",
    "iospan_uprobe_stepped:",
    "mov rax, rdi",
    "add rax, 1",
    "ret",
    ".size iospan_uprobe_stepped, .-iospan_uprobe_stepped",
);

#[cfg(target_arch = "x86_64")]
extern "C" {
    fn iospan_uprobe_push(x: u64) -> u64;
    fn iospan_uprobe_stepped(x: u64) -> u64;
}

/// Measures both kinds of hit: calls with the probe attached against the
/// same calls without, median of five rounds.
#[cfg(target_arch = "x86_64")]
pub fn uprobe_costs() -> Result<Vec<UprobeCost>, String> {
    const CALLS: u64 = 4000;
    type Target = unsafe extern "C" fn(u64) -> u64;
    let time = |f: Target| {
        let t = std::time::Instant::now();
        let mut x = 0;
        for _ in 0..CALLS {
            // SAFETY: both targets take and return a u64 and touch nothing else.
            x = unsafe { std::hint::black_box(f)(x) };
        }
        std::hint::black_box(x);
        t.elapsed().as_nanos() as f64
    };
    let step = |what: &str, e: &dyn std::error::Error| format!("{what}: {}", error_chain(e));
    let exe = std::env::current_exe().map_err(|e| format!("finding our own binary: {e}"))?;
    let targets: [(&'static str, &'static str, Target); 2] = [
        ("push (emulated)", "iospan_uprobe_push", iospan_uprobe_push),
        (
            "single-stepped",
            "iospan_uprobe_stepped",
            iospan_uprobe_stepped,
        ),
    ];
    let mut out = Vec::new();
    for (prologue, symbol, f) in targets {
        let mut rounds = Vec::new();
        for _ in 0..5 {
            let bare = time(f);
            let mut ebpf = EbpfLoader::new()
                .load(OBJECT)
                .map_err(|e| format!("loading the probe object: {}", error_chain(&e)))?;
            let prog = ebpf
                .program_mut("probe_uprobe")
                .ok_or("no uprobe program")?;
            let p: &mut UProbe = prog.try_into().map_err(|e| step("type", &e))?;
            p.load().map_err(|e| step("load", &e))?;
            p.attach(
                own_file_offset(f as *const () as usize)?,
                &exe,
                aya::programs::uprobe::UProbeScope::CallingProcess,
            )
            .map_err(|e| step("attach", &e))?;
            let probed = time(f);
            if read_hits(&ebpf)? < CALLS {
                return Err(format!("the uprobe on {symbol} missed calls"));
            }
            rounds.push((probed - bare) / CALLS as f64);
        }
        rounds.sort_by(f64::total_cmp);
        out.push(UprobeCost {
            prologue,
            ns_per_hit: rounds[rounds.len() / 2],
        });
    }
    Ok(out)
}

#[cfg(not(target_arch = "x86_64"))]
pub fn uprobe_costs() -> Result<Vec<UprobeCost>, String> {
    Err("measured on x86_64 only".into())
}

/// Classic tracepoints are attached through tracefs; a host that has not
/// mounted it gets it mounted (as perf and bpftrace do).
pub fn mount_tracefs() {
    if std::path::Path::new("/sys/kernel/tracing/events").exists()
        || std::path::Path::new("/sys/kernel/debug/tracing/events").exists()
    {
        return;
    }
    let ok = std::process::Command::new("mount")
        .args(["-t", "tracefs", "nodev", "/sys/kernel/tracing"])
        .status()
        .is_ok_and(|s| s.success());
    log::info!(
        "mounting tracefs at /sys/kernel/tracing: {}",
        if ok { "done" } else { "failed" }
    );
}
