//! What a run watches of its VMs beside their I/O, for the diagnosis: each
//! VM's threads (their time on a CPU and waiting for one, from the
//! scheduler's own accounting), its disks' throttles as QEMU holds them
//! (QMP), and the span its I/O was busy. Read off the I/O path — /proc and
//! a QMP session — in a task of its own.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tokio::sync::watch;

use crate::{
    discover::{
        qemu_counts,
        threads::{self, Sample},
        vms::{self, Registry, Vm},
    },
    output::diagnose::{VmWatch, Watch},
    probes::host::VmCountsReader,
};

/// Between looks at the VMs in a run (a benchmark's burst may last a
/// second or two) ...
pub(super) const RUN_EVERY: Duration = Duration::from_millis(250);
/// ... and in the agent, measuring continuously (a VM with no I/O since
/// the last look is not read at all).
pub(super) const AGENT_EVERY: Duration = Duration::from_secs(2);
/// Looks between reads of a VM's throttles over QMP (settings change
/// seldom).
const THROTTLES_EVERY: u32 = 20;
/// Looks at a process between full reads of its threads (names, last
/// CPUs); the looks between read each thread's times and CPUs alone.
const FULL_EVERY: u32 = 8;
/// A thread waiting for a CPU this share of the time has what ran beside
/// it looked for at the end.
const LOOK_BESIDE: f64 = 0.05;
/// How long that look takes.
const BESIDE_SPELL: Duration = Duration::from_millis(250);

/// Who takes what was watched: the run's report at its end, and the live
/// feed window by window. Each keeps sums of its own: a window taken must
/// not empty the run's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reader {
    Run,
    Window,
}

impl Reader {
    fn index(self) -> usize {
        self as usize
    }
}

const READERS: usize = 2;

/// One process's threads' loads as its VM's I/O saw them: each look's
/// load since the one before, weighted by the requests the VM submitted
/// between them (so a boot or an idle spell, with no I/O, weighs nothing).
#[derive(Default)]
struct Samples {
    prev: Option<Sample>,
    looks: u32,
    /// Per reader, by tid.
    sums: [BTreeMap<u32, Weighted>; READERS],
}

/// A thread's load summed over looks, each weighted by its requests.
struct Weighted {
    last: threads::ThreadLoad,
    busy: f64,
    waiting: f64,
    weight: f64,
}

impl Samples {
    /// Its threads now: in full at the first look and every
    /// `FULL_EVERY`th, light between.
    fn look(&mut self, pid: u32, requests: u64) {
        let full = self.looks.is_multiple_of(FULL_EVERY);
        self.looks = self.looks.wrapping_add(1);
        let now = threads::sample(pid, self.prev.as_ref(), full);
        self.add(now, requests);
    }

    fn add(&mut self, s: Sample, requests: u64) {
        if s.threads.is_empty() {
            return;
        }
        if let (Some(prev), true) = (&self.prev, requests > 0) {
            let w = requests as f64;
            for l in s.since(prev) {
                for sums in &mut self.sums {
                    let acc = sums.entry(l.tid).or_insert_with(|| Weighted {
                        last: l.clone(),
                        busy: 0.0,
                        waiting: 0.0,
                        weight: 0.0,
                    });
                    acc.busy += l.busy * w;
                    acc.waiting += l.waiting * w;
                    acc.weight += w;
                    acc.last = l.clone();
                }
            }
        }
        self.prev = Some(s);
    }

    /// The loads `reader` has not taken yet, its sums started afresh.
    fn take(&mut self, reader: Reader) -> Vec<threads::ThreadLoad> {
        std::mem::take(&mut self.sums[reader.index()])
            .values()
            .filter(|a| a.weight > 0.0)
            .map(|a| threads::ThreadLoad {
                busy: a.busy / a.weight,
                waiting: a.waiting / a.weight,
                ..a.last.clone()
            })
            .collect()
    }
}

/// One VM as watched.
#[derive(Default)]
struct Watched {
    name: String,
    /// Its process and the engines serving its disks, by pid.
    procs: BTreeMap<u32, Samples>,
    throttles: Option<BTreeMap<String, qemu_counts::Throttle>>,
    passes: u32,
    /// Its requests submitted at the last look, and per reader how long,
    /// of the time between looks, that count grew ...
    submitted: Option<u64>,
    busy_s: [f64; READERS],
    last_look: Option<Instant>,
    /// ... and in how many looks.
    io_looks: [u32; READERS],
}

impl Watched {
    fn look(&mut self, vm: &Vm, ours: Option<&VmCountsReader>, slot: u32, first: bool) {
        let now = Instant::now();
        self.name.clone_from(&vm.name);
        // Its requests since the last look: that spell was busy.
        let submitted = ours.and_then(|o| o.submitted(slot));
        let requests = match (submitted, self.submitted, self.last_look) {
            (Some(n), before, Some(_)) => n.saturating_sub(before.unwrap_or(0)),
            _ => 0,
        };
        if let (true, Some(then)) = (requests > 0, self.last_look) {
            let spell = now.duration_since(then).as_secs_f64();
            self.busy_s.iter_mut().for_each(|b| *b += spell);
            self.io_looks.iter_mut().for_each(|n| *n += 1);
        }
        self.submitted = submitted.or(self.submitted);
        self.last_look = Some(now);
        // A VM with no I/O since the last look is not read: its threads'
        // loads would weigh nothing.
        if requests > 0 || first {
            let mut pids = vec![vm.pid];
            pids.extend(
                vm.disks
                    .iter()
                    .filter_map(|d| d.engine.as_ref().map(|e| e.pid)),
            );
            for pid in pids {
                self.procs.entry(pid).or_default().look(pid, requests);
            }
        }
        if self.passes.is_multiple_of(THROTTLES_EVERY) {
            for src in qemu_counts::sources_of(vm) {
                match qemu_counts::throttles(&src, vm) {
                    Some(Ok(t)) => self.throttles = Some(t),
                    Some(Err(e)) => log::debug!("{}: its throttles: {e:#}", vm.name),
                    None => {}
                }
            }
        }
        self.passes += 1;
    }

    /// What was watched since `reader`'s last take, its sums started
    /// afresh.
    fn take(&mut self, reader: Reader) -> VmWatch {
        let busy_s = std::mem::take(&mut self.busy_s[reader.index()]);
        let threads: BTreeMap<u32, Vec<threads::ThreadLoad>> = self
            .procs
            .iter_mut()
            .map(|(pid, s)| (*pid, s.take(reader)))
            .collect();
        log::debug!(
            "VM {} watched for the {reader:?}: {} looks with I/O over {busy_s:.2} s, {} threads",
            self.name,
            std::mem::take(&mut self.io_looks[reader.index()]),
            threads.values().map(Vec::len).sum::<usize>()
        );
        VmWatch {
            threads,
            throttles: self.throttles.clone(),
            busy_s: (busy_s > 0.0).then_some(busy_s),
            beside: Vec::new(),
        }
    }
}

/// The VMs as watched, shared by the task that looks and whoever takes
/// what it saw (the report at a run's end, the live feed every window).
#[derive(Default)]
pub(super) struct Observer {
    vms: BTreeMap<u32, Watched>,
}

impl Observer {
    fn look(&mut self, live: Vec<(u32, Vm)>, ours: Option<&VmCountsReader>) {
        for (slot, vm) in live {
            let first = !self.vms.contains_key(&slot);
            self.vms
                .entry(slot)
                .or_default()
                .look(&vm, ours, slot, first);
        }
    }

    /// What was watched since `reader`'s last take; with `beside`, what
    /// ran beside the threads that waited too (a quarter-second look at
    /// the host's CPUs: not on an async runtime's thread).
    pub(super) fn take(&mut self, reader: Reader, beside: bool) -> Watch {
        let mut w = Watch {
            vms: self
                .vms
                .values_mut()
                .map(|v| (v.name.clone(), v.take(reader)))
                .collect(),
            host_cpus: threads::online_cpus(),
        };
        if beside {
            look_beside(&mut w);
        }
        w
    }

    /// VMs gone from the registry let go (their last window was taken).
    fn forget_gone(&mut self, known: &Mutex<Registry>) {
        let k = known.lock().unwrap_or_else(|p| p.into_inner());
        self.vms.retain(|slot, _| k.vms.contains_key(slot));
    }
}

/// The VMs alive now, copied out of the registry.
fn alive(known: &Mutex<Registry>) -> Vec<(u32, Vm)> {
    let k = known.lock().unwrap_or_else(|p| p.into_inner());
    k.vms
        .iter()
        .filter(|(_, v)| v.not_vm.is_none() && vms::alive(v))
        .map(|(s, v)| (*s, v.clone()))
        .collect()
}

/// What ran beside each waiting thread: one spell over the host's
/// threads, read for each set of CPUs a waiting thread may run on.
fn look_beside(w: &mut Watch) {
    let waiting = |w: &Watch| {
        w.vms.values().any(|v| {
            v.threads
                .values()
                .flatten()
                .any(|t| t.waiting >= LOOK_BESIDE)
        })
    };
    if !waiting(w) {
        return;
    }
    let before = threads::HostThreads::now();
    std::thread::sleep(BESIDE_SPELL);
    let after = threads::HostThreads::now();
    let mut seen: BTreeMap<(String, u32), Vec<threads::Neighbour>> = BTreeMap::new();
    for v in w.vms.values_mut() {
        for (pid, loads) in &v.threads {
            for t in loads.iter().filter(|t| t.waiting >= LOOK_BESIDE) {
                let found = seen.entry((t.cpus.clone(), *pid)).or_insert_with(|| {
                    after.neighbours_since(&before, &threads::cpu_list(&t.cpus), *pid, 3)
                });
                for n in found.iter() {
                    if !v.beside.iter().any(|b| b.pid == n.pid) {
                        v.beside.push(n.clone());
                    }
                }
            }
        }
    }
}

/// Looks at every VM every `every` until `stop`, then once more; what
/// was watched since the last take, by VM name.
pub(super) async fn watch(
    known: Arc<Mutex<Registry>>,
    mut stop: watch::Receiver<bool>,
    ours: Option<VmCountsReader>,
    observer: Arc<Mutex<Observer>>,
    every: Duration,
) -> Watch {
    let ours = ours.map(Arc::new);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let done = tokio::select! {
            _ = tick.tick() => false,
            r = stop.wait_for(|s| *s) => { let _ = r; true }
        };
        let live = alive(&known);
        let (ours, observer, known) = (ours.clone(), observer.clone(), known.clone());
        // /proc and QMP reads: off the runtime's threads.
        let pass = tokio::task::spawn_blocking(move || {
            let mut o = observer.lock().unwrap_or_else(|p| p.into_inner());
            o.look(live, ours.as_deref());
            if done {
                return Some(o.take(Reader::Run, true));
            }
            o.forget_gone(&known);
            None
        })
        .await;
        match pass {
            Ok(None) => {}
            Ok(Some(w)) => return w,
            Err(_) => return Watch::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use threads::{Role, ThreadSample};

    fn sample(at_s: u64, run_ms: u64, wait_ms: u64) -> Sample {
        let t = ThreadSample {
            tid: 7,
            comm: "CPU 0/KVM".into(),
            role: Role::Vcpu(0),
            cpus: "1".into(),
            last_cpu: Some(1),
            run_ns: run_ms * 1_000_000,
            wait_ns: wait_ms * 1_000_000,
        };
        Sample {
            at_ns: at_s * 1_000_000_000,
            threads: [(7, t)].into(),
        }
    }

    #[test]
    fn a_window_taken_leaves_the_runs_sums_whole() {
        let mut s = Samples::default();
        s.add(sample(0, 0, 0), 0);
        // 1 s: busy a tenth, waiting half; then 1 s busy a tenth, waiting none.
        s.add(sample(1, 100, 500), 10);
        let window = s.take(Reader::Window);
        assert_eq!(window.len(), 1);
        assert!((window[0].waiting - 0.5).abs() < 1e-9);
        s.add(sample(2, 200, 500), 10);
        let window = s.take(Reader::Window);
        assert!(window[0].waiting.abs() < 1e-9, "{window:?}");
        let run = s.take(Reader::Run);
        assert_eq!(run.len(), 1);
        assert!((run[0].waiting - 0.25).abs() < 1e-9, "{run:?}");
        assert!((run[0].busy - 0.1).abs() < 1e-9, "{run:?}");
        assert!(s.take(Reader::Run).is_empty());
    }

    #[test]
    fn looks_without_io_weigh_nothing() {
        let mut s = Samples::default();
        s.add(sample(0, 0, 0), 0);
        s.add(sample(1, 900, 0), 0);
        assert!(s.take(Reader::Run).is_empty());
        s.add(sample(2, 1000, 0), 5);
        let run = s.take(Reader::Run);
        assert!((run[0].busy - 0.1).abs() < 1e-9, "{run:?}");
    }
}
