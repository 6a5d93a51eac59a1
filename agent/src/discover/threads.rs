//! A VM's threads as the kernel's scheduler keeps them: what each is
//! (vCPU, iothread, main loop, worker), which CPUs it may run on, the one
//! it last ran on, and how long it has run and waited runnable for a CPU
//! (`/proc/PID/task/TID/schedstat`: the scheduler's own per-thread
//! accounting, kept whether iospan runs or not). Two samples give each
//! thread's load over the time between them, at no cost to the I/O path.

use std::{collections::BTreeMap, path::Path};

use serde::{Deserialize, Serialize};

/// What a thread of a VM process does, by the name QEMU gives it
/// (`-name …,debug-threads=on`, as libvirt runs it).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// `CPU N/KVM`, `CPU N/TCG`.
    Vcpu(u32),
    /// `IO ID`: an iothread.
    Iothread(String),
    /// The process's first thread: QEMU's main loop (or a storage daemon's).
    Main,
    /// `vhost-PID`: the kernel's vhost worker.
    Vhost,
    /// `worker`, `iou-wrk-*`: QEMU's thread pool, io_uring's workers.
    Worker,
    Other,
}

impl Role {
    pub fn of(comm: &str, is_main: bool) -> Self {
        if let Some(n) = comm
            .strip_prefix("CPU ")
            .and_then(|r| r.split_once('/'))
            .and_then(|(n, _)| n.parse().ok())
        {
            return Role::Vcpu(n);
        }
        if let Some(id) = comm.strip_prefix("IO ") {
            return Role::Iothread(id.to_string());
        }
        if comm.starts_with("vhost-") {
            return Role::Vhost;
        }
        if is_main {
            return Role::Main;
        }
        if comm == "worker" || comm.starts_with("iou-wrk-") || comm.starts_with("iou-sqp-") {
            return Role::Worker;
        }
        Role::Other
    }
}

/// One thread at one moment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThreadSample {
    pub tid: u32,
    pub comm: String,
    pub role: Role,
    /// The CPUs it may run on (`Cpus_allowed_list`).
    pub cpus: String,
    /// The CPU it last ran on.
    pub last_cpu: Option<u32>,
    /// Time on a CPU and time runnable waiting for one, ns, since it began.
    pub run_ns: u64,
    pub wait_ns: u64,
}

/// A process's threads at one moment, by tid.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sample {
    /// CLOCK_MONOTONIC, ns.
    pub at_ns: u64,
    pub threads: BTreeMap<u32, ThreadSample>,
}

/// A thread's load between two samples.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ThreadLoad {
    pub tid: u32,
    pub name: String,
    pub role: Role,
    pub cpus: String,
    pub last_cpu: Option<u32>,
    /// Of the wall time between the samples, the share it ran on a CPU
    /// (1.0: one CPU's worth) ...
    pub busy: f64,
    /// ... and the share it waited runnable for one.
    pub waiting: f64,
    pub seconds: f64,
}

pub fn now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec as u64).saturating_mul(1_000_000_000) + t.tv_nsec as u64
}

/// The threads of `pid` now (empty when it is gone). A thread `prev`
/// holds is read in full (its name, last CPU) only when `full`; otherwise
/// only what moves between looks: its scheduler times and the CPUs it
/// may run on. A look at a VM of many threads, four times a second, is
/// then one small read and one system call per thread.
pub fn sample(pid: u32, prev: Option<&Sample>, full: bool) -> Sample {
    sample_in(Path::new("/proc"), pid, now_ns(), prev.filter(|_| !full))
}

/// The threads of `pid` under a procfs mounted at `proc` (tests give a
/// recorded tree); those in `prev` read light.
pub fn sample_in(proc: &Path, pid: u32, at_ns: u64, prev: Option<&Sample>) -> Sample {
    let mut threads = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir(proc.join(pid.to_string()).join("task")) else {
        return Sample { at_ns, threads };
    };
    for e in dir.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        let known = prev.and_then(|p| p.threads.get(&tid));
        let t = match known {
            Some(k) => light(&e.path(), k, tid == pid),
            None => thread(&e.path(), tid, tid == pid),
        };
        if let Some(t) = t {
            threads.insert(tid, t);
        }
    }
    Sample { at_ns, threads }
}

fn read(p: &Path) -> Option<String> {
    crate::discover::procfs::read_regular(p, 64 << 10)
        .ok()
        .map(|b| String::from_utf8_lossy(&b).into_owned())
}

/// Time on a CPU and runnable waiting for one, ns (`schedstat`).
fn sched_times(dir: &Path) -> Option<(u64, u64)> {
    let s = read(&dir.join("schedstat"))?;
    let mut v = s.split_whitespace().map(|v| v.parse::<u64>().unwrap_or(0));
    Some((v.next()?, v.next()?))
}

fn thread(dir: &Path, tid: u32, is_main: bool) -> Option<ThreadSample> {
    let comm = crate::model::text::printable(read(&dir.join("comm"))?.trim_end()).into_owned();
    let (run_ns, wait_ns) = sched_times(dir)?;
    let stat = read(&dir.join("stat")).unwrap_or_default();
    let status = read(&dir.join("status")).unwrap_or_default();
    Some(ThreadSample {
        tid,
        role: Role::of(&comm, is_main),
        comm,
        cpus: status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .map(|v| v.trim().to_string())
            .unwrap_or_default(),
        last_cpu: last_cpu(&stat),
        run_ns,
        wait_ns,
    })
}

/// A thread already known: its times, and its CPUs from the scheduler
/// (a pin since the last look shows at once); the rest as it was.
fn light(dir: &Path, known: &ThreadSample, is_main: bool) -> Option<ThreadSample> {
    let (run_ns, wait_ns) = sched_times(dir)?;
    // Times gone backwards: another thread took the tid.
    if run_ns < known.run_ns || wait_ns < known.wait_ns {
        return thread(dir, known.tid, is_main);
    }
    let cpus = rustix::process::Pid::from_raw(known.tid as i32)
        .and_then(|pid| rustix::thread::sched_getaffinity(Some(pid)).ok())
        .map(|set| cpu_ranges((0..rustix::thread::CpuSet::MAX_CPU).filter(|c| set.is_set(*c))))
        .unwrap_or_else(|| known.cpus.clone());
    Some(ThreadSample {
        cpus,
        run_ns,
        wait_ns,
        ..known.clone()
    })
}

/// CPUs as the kernel lists them (`Cpus_allowed_list`): `0-3,8`.
fn cpu_ranges(cpus: impl Iterator<Item = usize>) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut run: Option<(usize, usize)> = None;
    let flush = |out: &mut Vec<String>, (a, b): (usize, usize)| {
        out.push(if a == b {
            a.to_string()
        } else {
            format!("{a}-{b}")
        });
    };
    for c in cpus {
        run = match run {
            Some((a, b)) if c == b + 1 => Some((a, c)),
            Some(r) => {
                flush(&mut out, r);
                Some((c, c))
            }
            None => Some((c, c)),
        };
    }
    if let Some(r) = run {
        flush(&mut out, r);
    }
    out.join(",")
}

/// `processor` (field 39) of a `stat` line; the name in parentheses may
/// hold spaces and parentheses of its own.
fn last_cpu(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(36)?.parse().ok()
}

impl Sample {
    /// Each thread's load from `earlier` to this sample (threads in both).
    pub fn since(&self, earlier: &Sample) -> Vec<ThreadLoad> {
        let secs = self.at_ns.saturating_sub(earlier.at_ns) as f64 / 1e9;
        if secs <= 0.0 {
            return Vec::new();
        }
        self.threads
            .values()
            .filter_map(|t| {
                let e = earlier.threads.get(&t.tid)?;
                Some(ThreadLoad {
                    tid: t.tid,
                    name: t.comm.clone(),
                    role: t.role.clone(),
                    cpus: t.cpus.clone(),
                    last_cpu: t.last_cpu,
                    busy: t.run_ns.saturating_sub(e.run_ns) as f64 / 1e9 / secs,
                    waiting: t.wait_ns.saturating_sub(e.wait_ns) as f64 / 1e9 / secs,
                    seconds: secs,
                })
            })
            .collect()
    }
}

/// What else ran on some CPUs over a short spell: the busiest threads of
/// other processes there, as (process name, pid, share of a CPU).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Neighbour {
    pub name: String,
    pub pid: u32,
    pub busy: f64,
}

/// One host thread as `HostThreads` holds it.
#[derive(Clone, Debug)]
struct HostThread {
    pid: u32,
    name: String,
    run_ns: u64,
    last_cpu: Option<u32>,
}

/// Every thread of the host at one moment, by tid.
#[derive(Clone, Debug, Default)]
pub struct HostThreads {
    at_ns: u64,
    threads: BTreeMap<u32, HostThread>,
}

impl HostThreads {
    /// The host's threads now.
    pub fn now() -> Self {
        Self::read_in(Path::new("/proc"), now_ns())
    }

    /// Under a procfs mounted at `proc` (tests give a recorded tree).
    pub fn read_in(proc: &Path, at_ns: u64) -> Self {
        let mut threads = BTreeMap::new();
        let Ok(procs) = std::fs::read_dir(proc) else {
            return Self { at_ns, threads };
        };
        for p in procs.flatten() {
            let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(tasks) = std::fs::read_dir(p.path().join("task")) else {
                continue;
            };
            for t in tasks.flatten() {
                let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                    continue;
                };
                if let Some(h) = host_thread(&t.path(), pid) {
                    threads.insert(tid, h);
                }
            }
        }
        Self { at_ns, threads }
    }

    /// The busiest threads of processes other than `not_pid` that ran on
    /// `cpus` between `earlier` and this moment: what a thread waiting
    /// for those CPUs waited beside. At most `top` of them, busiest
    /// first. Every set of CPUs is answered from the same two moments, so
    /// a host of many VMs is looked at once, not once per VM.
    pub fn neighbours_since(
        &self,
        earlier: &HostThreads,
        cpus: &[u32],
        not_pid: u32,
        top: usize,
    ) -> Vec<Neighbour> {
        let secs = (self.at_ns.saturating_sub(earlier.at_ns) as f64 / 1e9).max(1e-3);
        let mut by_pid: BTreeMap<u32, Neighbour> = BTreeMap::new();
        for (tid, t) in &self.threads {
            if t.pid == not_pid || !t.last_cpu.is_some_and(|c| cpus.contains(&c)) {
                continue;
            }
            let Some(e) = earlier.threads.get(tid) else {
                continue;
            };
            let busy = t.run_ns.saturating_sub(e.run_ns) as f64 / 1e9 / secs;
            let n = by_pid.entry(t.pid).or_insert_with(|| Neighbour {
                name: t.name.clone(),
                pid: t.pid,
                busy: 0.0,
            });
            n.busy += busy;
        }
        let mut v: Vec<Neighbour> = by_pid.into_values().filter(|n| n.busy >= 0.05).collect();
        v.sort_by(|a, b| b.busy.total_cmp(&a.busy));
        v.truncate(top);
        v
    }
}

fn host_thread(dir: &Path, pid: u32) -> Option<HostThread> {
    let stat = read(&dir.join("stat"))?;
    let name = stat
        .find('(')
        .zip(stat.rfind(')'))
        .map(|(a, b)| crate::model::text::printable(&stat[a + 1..b]).into_owned())
        .unwrap_or_default();
    let run_ns = sched_times(dir).map_or(0, |(run, _)| run);
    Some(HostThread {
        pid,
        name,
        run_ns,
        last_cpu: last_cpu(&stat),
    })
}

pub use crate::model::diagnosis::cpu_list;

/// The host's online CPUs.
pub fn online_cpus() -> Vec<u32> {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .map(|s| cpu_list(s.trim()))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_come_from_qemus_thread_names() {
        assert_eq!(Role::of("CPU 3/KVM", false), Role::Vcpu(3));
        assert_eq!(Role::of("CPU 0/TCG", false), Role::Vcpu(0));
        assert_eq!(Role::of("IO io0", false), Role::Iothread("io0".into()));
        assert_eq!(Role::of("qemu-system-x86", true), Role::Main);
        assert_eq!(Role::of("worker", false), Role::Worker);
        assert_eq!(Role::of("iou-wrk-4242", false), Role::Worker);
        assert_eq!(Role::of("vhost-4242", false), Role::Vhost);
        assert_eq!(Role::of("call_rcu", false), Role::Other);
    }

    #[test]
    fn the_last_cpu_is_read_past_a_name_with_spaces_and_parens() {
        let stat = "4242 (CPU 0/KVM) (x) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 \
                    22 23 24 25 26 27 28 29 30 31 32 33 34 35 7 0 0";
        assert_eq!(last_cpu(stat), Some(7));
    }

    #[test]
    fn cpu_lists_expand() {
        assert_eq!(cpu_list("0-3,8"), vec![0, 1, 2, 3, 8]);
        assert_eq!(cpu_list("1"), vec![1]);
        assert_eq!(cpu_list(""), Vec::<u32>::new());
    }

    #[test]
    fn loads_are_shares_of_the_wall_time_between_samples() {
        let t = |run_ns, wait_ns| ThreadSample {
            tid: 7,
            comm: "IO io0".into(),
            role: Role::Iothread("io0".into()),
            cpus: "1".into(),
            last_cpu: Some(1),
            run_ns,
            wait_ns,
        };
        let a = Sample {
            at_ns: 1_000_000_000,
            threads: [(7, t(0, 0))].into(),
        };
        let b = Sample {
            at_ns: 3_000_000_000,
            threads: [(7, t(500_000_000, 1_000_000_000))].into(),
        };
        let l = &b.since(&a)[0];
        assert!(
            (l.busy - 0.25).abs() < 1e-9 && (l.waiting - 0.5).abs() < 1e-9,
            "{l:?}"
        );
    }

    #[test]
    fn this_process_threads_are_sampled() {
        let s = sample(std::process::id(), None, true);
        let me = s.threads.get(&std::process::id()).expect("the main thread");
        assert_eq!(me.role, Role::Main);
        assert!(me.run_ns > 0);
        assert!(!me.cpus.is_empty());
    }

    #[test]
    fn a_light_look_reads_the_times_and_cpus_and_keeps_the_rest() {
        let pid = std::process::id();
        let full = sample(pid, None, true);
        let mut prev = full.clone();
        let me = prev.threads.get_mut(&pid).unwrap();
        // What only a full read would correct.
        me.comm = "was-named".into();
        me.cpus = "999".into();
        me.run_ns = 0;
        let light = sample(pid, Some(&prev), false);
        let l = &light.threads[&pid];
        assert_eq!(l.comm, "was-named");
        assert_eq!(
            l.cpus, full.threads[&pid].cpus,
            "the CPUs are the scheduler's"
        );
        assert!(l.run_ns > 0);
        // A full look reads everything again.
        let again = sample(pid, Some(&prev), true);
        assert_eq!(again.threads[&pid].comm, full.threads[&pid].comm);
    }

    #[test]
    fn cpu_ranges_read_back_as_the_same_cpus() {
        for cpus in [
            vec![],
            vec![1],
            vec![0, 1, 2, 3, 8],
            vec![0, 2, 4, 5, 6, 63, 64],
        ] {
            let text = cpu_ranges(cpus.iter().map(|c| *c as usize));
            assert_eq!(cpu_list(&text), cpus, "{text}");
        }
        assert_eq!(cpu_ranges([0, 1, 2, 3, 8].into_iter()), "0-3,8");
    }

    #[test]
    fn neighbours_are_other_processes_busy_on_the_cpus() {
        let dir = tempfile::tempdir().unwrap();
        let write = |pid: u32, tid: u32, name: &str, cpu: u32, run: u64| {
            let t = dir.path().join(format!("{pid}/task/{tid}"));
            std::fs::create_dir_all(&t).unwrap();
            let rest: Vec<String> = (0..35).map(|_| "0".to_string()).collect();
            std::fs::write(
                t.join("stat"),
                format!("{tid} ({name}) R {} {cpu} 0 0\n", rest.join(" ")),
            )
            .unwrap();
            std::fs::write(t.join("schedstat"), format!("{run} 0 0\n")).unwrap();
        };
        // The VM (pid 10), a hog on CPU 1 (pid 20), a quiet one on CPU 1
        // (pid 30), a busy one on CPU 0 (pid 40); a quarter second apart.
        let moment = |vm: u64, hog: u64, quiet: u64, at_ns: u64| {
            write(10, 11, "qemu", 1, vm);
            write(20, 20, "sh", 1, hog);
            write(30, 30, "quiet one", 1, quiet);
            write(40, 41, "other", 0, hog);
            HostThreads::read_in(dir.path(), at_ns)
        };
        let before = moment(0, 0, 0, 0);
        let after = moment(200_000_000, 250_000_000, 1_000_000, 250_000_000);
        let n = after.neighbours_since(&before, &[1], 10, 3);
        assert_eq!(n.len(), 1, "{n:?}");
        assert_eq!((n[0].name.as_str(), n[0].pid), ("sh", 20));
        assert!((n[0].busy - 1.0).abs() < 1e-9, "{n:?}");
        let both = after.neighbours_since(&before, &[0, 1], 10, 3);
        assert_eq!(both.len(), 2, "{both:?}");
    }
}
