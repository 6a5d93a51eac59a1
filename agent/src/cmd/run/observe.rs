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
        monitors::Monitors,
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
    fn add(&mut self, loads: &[threads::ThreadLoad], requests: u64) {
        let w = requests as f64;
        for l in loads {
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

/// A process's last look, kept by the looker alone.
#[derive(Default)]
struct Looked {
    prev: Option<Sample>,
    looks: u32,
}

impl Looked {
    /// Its threads now: in full at the first look and every
    /// `FULL_EVERY`th, light between; their loads since the last look.
    fn look(&mut self, pid: u32) -> Vec<threads::ThreadLoad> {
        let full = self.looks.is_multiple_of(FULL_EVERY);
        self.looks = self.looks.wrapping_add(1);
        let now = threads::sample(pid, self.prev.as_ref(), full);
        if now.threads.is_empty() {
            return Vec::new();
        }
        let loads = self.prev.as_ref().map(|p| now.since(p)).unwrap_or_default();
        self.prev = Some(now);
        loads
    }
}

/// What one look at a VM saw, handed to the observer.
struct Seen {
    name: String,
    /// Per process: its threads' loads since the last look.
    loads: BTreeMap<u32, Vec<threads::ThreadLoad>>,
    /// Its requests since the last look, and the time between the looks.
    requests: u64,
    spell_s: Option<f64>,
    throttles: Option<BTreeMap<String, qemu_counts::Throttle>>,
}

/// One VM as the looker follows it: its processes' last looks, its
/// requests at the last look.
#[derive(Default)]
struct Followed {
    procs: BTreeMap<u32, Looked>,
    passes: u32,
    submitted: Option<u64>,
    last_look: Option<Instant>,
}

impl Followed {
    /// A look at `vm`: /proc, and a QMP exchange every `THROTTLES_EVERY`
    /// looks, under no lock anyone else takes.
    fn look(
        &mut self,
        vm: &Vm,
        ours: Option<&VmCountsReader>,
        slot: u32,
        monitors: &Monitors,
    ) -> Seen {
        let now = Instant::now();
        let first = self.last_look.is_none();
        // Its requests since the last look: that spell was busy.
        let submitted = ours.and_then(|o| o.submitted(slot));
        let requests = match (submitted, self.submitted, self.last_look) {
            (Some(n), before, Some(_)) => n.saturating_sub(before.unwrap_or(0)),
            _ => 0,
        };
        let spell_s = self
            .last_look
            .map(|then| now.duration_since(then).as_secs_f64());
        self.submitted = submitted.or(self.submitted);
        self.last_look = Some(now);
        let mut loads = BTreeMap::new();
        // A VM with no I/O since the last look is not read: its threads'
        // loads would weigh nothing.
        if requests > 0 || first {
            let pids = std::iter::once(vm.pid).chain(
                vm.disks
                    .iter()
                    .filter_map(|d| d.engine.as_ref().map(|e| e.pid)),
            );
            for pid in pids {
                let l = self.procs.entry(pid).or_default().look(pid);
                if requests > 0 && !l.is_empty() {
                    loads.insert(pid, l);
                }
            }
        }
        let mut throttles = None;
        if self.passes.is_multiple_of(THROTTLES_EVERY) {
            for src in qemu_counts::sources_of(vm) {
                match monitors.throttles(&src, vm, crate::discover::qmp::EXCHANGE) {
                    Some(Ok(t)) => throttles = Some(t),
                    Some(Err(e)) => log::debug!("{}: its throttles: {e:#}", vm.name),
                    None => {}
                }
            }
        }
        self.passes = self.passes.wrapping_add(1);
        Seen {
            name: vm.name.clone(),
            loads,
            requests,
            spell_s,
            throttles,
        }
    }
}

/// One VM as watched: the sums each reader has still to take.
#[derive(Default)]
struct Watched {
    name: String,
    /// Its process and the engines serving its disks, by pid.
    procs: BTreeMap<u32, Samples>,
    throttles: Option<BTreeMap<String, qemu_counts::Throttle>>,
    /// Per reader, how long, of the time between looks, its request count
    /// grew ...
    busy_s: [f64; READERS],
    /// ... and in how many looks.
    io_looks: [u32; READERS],
}

impl Watched {
    fn add(&mut self, seen: Seen) {
        self.name = seen.name;
        if let (true, Some(spell)) = (seen.requests > 0, seen.spell_s) {
            self.busy_s.iter_mut().for_each(|b| *b += spell);
            self.io_looks
                .iter_mut()
                .for_each(|n| *n = n.saturating_add(1));
        }
        for (pid, loads) in &seen.loads {
            self.procs
                .entry(*pid)
                .or_default()
                .add(loads, seen.requests);
        }
        if seen.throttles.is_some() {
            self.throttles = seen.throttles;
        }
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

/// What the looks saw, shared by the task that looks and whoever takes
/// it (the report at a run's end, the live feed every window). Only sums
/// are kept here: a look's reads of /proc and QMP happen before its lock
/// is taken, so a slow monitor never holds up a frame.
#[derive(Default)]
pub(super) struct Observer {
    vms: BTreeMap<u32, Watched>,
}

impl Observer {
    fn add(&mut self, seen: Vec<(u32, Seen)>) {
        for (slot, s) in seen {
            self.vms.entry(slot).or_default().add(s);
        }
    }

    /// What was watched since `reader`'s last take.
    pub(super) fn take(&mut self, reader: Reader) -> Watch {
        Watch {
            vms: self
                .vms
                .values_mut()
                .map(|v| (v.name.clone(), v.take(reader)))
                .collect(),
            host_cpus: threads::online_cpus(),
        }
    }

    /// VMs gone from the registry let go (their last window was taken).
    fn forget_gone(&mut self, known: &Mutex<Registry>) {
        let k = known.lock().unwrap_or_else(|p| p.into_inner());
        self.vms.retain(|slot, _| k.vms.contains_key(slot));
    }
}

/// The looks themselves: each VM's last looks, owned by the watching task.
#[derive(Default)]
struct Looker {
    vms: BTreeMap<u32, Followed>,
}

impl Looker {
    fn look(
        &mut self,
        live: &[(u32, Vm)],
        ours: Option<&VmCountsReader>,
        monitors: &Monitors,
    ) -> Vec<(u32, Seen)> {
        self.vms
            .retain(|slot, _| live.iter().any(|(s, _)| s == slot));
        live.iter()
            .map(|(slot, vm)| {
                let seen = self
                    .vms
                    .entry(*slot)
                    .or_default()
                    .look(vm, ours, *slot, monitors);
                (*slot, seen)
            })
            .collect()
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
    (observer, monitors): (Arc<Mutex<Observer>>, Arc<Monitors>),
    every: Duration,
) -> Watch {
    let ours = ours.map(Arc::new);
    let mut looker = Looker::default();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let done = tokio::select! {
            _ = tick.tick() => false,
            r = stop.wait_for(|s| *s) => { let _ = r; true }
        };
        let live = alive(&known);
        let (ours, observer, known, monitors) = (
            ours.clone(),
            observer.clone(),
            known.clone(),
            monitors.clone(),
        );
        // /proc and QMP reads: off the runtime's threads, and outside the
        // observer's lock.
        let pass = tokio::task::spawn_blocking(move || {
            let seen = looker.look(&live, ours.as_deref(), &monitors);
            let mut o = observer.lock().unwrap_or_else(|p| p.into_inner());
            o.add(seen);
            if done {
                let mut w = o.take(Reader::Run);
                drop(o);
                look_beside(&mut w);
                return (looker, Some(w));
            }
            o.forget_gone(&known);
            (looker, None)
        })
        .await;
        match pass {
            Ok((l, None)) => looker = l,
            Ok((_, Some(w))) => return w,
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

    /// `sample`'s loads since `prev`, as a look hands them over.
    fn add(s: &mut Samples, prev: &Sample, now: &Sample, requests: u64) {
        if requests > 0 {
            s.add(&now.since(prev), requests);
        }
    }

    #[test]
    fn a_window_taken_leaves_the_runs_sums_whole() {
        let mut s = Samples::default();
        // 1 s: busy a tenth, waiting half; then 1 s busy a tenth, waiting none.
        add(&mut s, &sample(0, 0, 0), &sample(1, 100, 500), 10);
        let window = s.take(Reader::Window);
        assert_eq!(window.len(), 1);
        assert!((window[0].waiting - 0.5).abs() < 1e-9);
        add(&mut s, &sample(1, 100, 500), &sample(2, 200, 500), 10);
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
        add(&mut s, &sample(0, 0, 0), &sample(1, 900, 0), 0);
        assert!(s.take(Reader::Run).is_empty());
        add(&mut s, &sample(1, 900, 0), &sample(2, 1000, 0), 5);
        let run = s.take(Reader::Run);
        assert!((run[0].busy - 0.1).abs() < 1e-9, "{run:?}");
    }
}
