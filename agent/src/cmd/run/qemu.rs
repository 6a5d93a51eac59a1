//! QEMU's own counters of each VM over a run, read as it runs: a VM
//! running when the run began is read at its start, a VM started during
//! it counts from zero (QEMU's counters start with the process); each is
//! read again every tick while it lives, so the last read of a VM that
//! exits within the run is at most a tick before its end.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::sync::watch;

use crate::{
    discover::qemu_counts::{self, Counts, Source},
    discover::vms::{self, Registry, Vm},
    output::qemu_check::VmQemu,
};

/// Between reads of a QMP monitor (a round trip of a millisecond or two).
const TICK: Duration = Duration::from_millis(100);
/// libvirt's client is a process per read: every few ticks.
const LIBVIRT_EVERY: u64 = 3;
/// A VM whose counters failed this many times in a row is not asked again.
const GIVE_UP: u32 = 3;

#[derive(Default)]
struct Watched {
    source: Option<Source>,
    first: Option<Counts>,
    last: Option<Counts>,
    failures: u32,
    error: Option<String>,
    name: String,
    predates_run: bool,
}

#[derive(Default)]
struct State {
    vms: BTreeMap<u32, Watched>,
    at_start: BTreeSet<u32>,
    ticks: u64,
}

impl State {
    /// One pass over the VMs alive now; `last`: the run's closing one, which
    /// reads every VM whatever its pace.
    fn pass(&mut self, live: Vec<(u32, Vm)>, last: bool) {
        self.ticks += 1;
        for (slot, vm) in live {
            let w = self.vms.entry(slot).or_insert_with(|| Watched {
                name: vm.name.clone(),
                predates_run: self.at_start.contains(&slot),
                ..Default::default()
            });
            if w.failures >= GIVE_UP {
                continue;
            }
            // A monitor not listening yet (QEMU still starting) is looked
            // for again each tick; one found is kept.
            if matches!(w.source, None | Some(Source::None { .. })) {
                w.source = Some(qemu_counts::source_of(&vm));
            }
            let Some(source) = w.source.clone() else {
                continue;
            };
            match &source {
                Source::None { .. } => continue,
                Source::Libvirt { .. } if !last && self.ticks % LIBVIRT_EVERY != 1 => continue,
                _ => {}
            }
            match qemu_counts::read(&source, &vm) {
                Ok(c) => {
                    w.failures = 0;
                    w.error = None;
                    if w.first.is_none() {
                        // Started within the run: from zero, as QEMU began.
                        w.first = Some(if w.predates_run {
                            c.clone()
                        } else {
                            Counts::new()
                        });
                    }
                    w.last = Some(c);
                }
                Err(e) => {
                    w.failures += 1;
                    w.error = Some(format!("{e:#}"));
                    if w.failures == GIVE_UP {
                        log::info!(
                            "QEMU's own counts of {}: {} (not asked again this run)",
                            w.name,
                            w.error.as_deref().unwrap_or("")
                        );
                    }
                }
            }
        }
    }

    fn finish(self) -> BTreeMap<String, VmQemu> {
        self.vms
            .into_values()
            .filter_map(|w| {
                let source = w.source?;
                let counts = match (&w.first, &w.last) {
                    (Some(f), Some(l)) => l
                        .iter()
                        .map(|(id, c)| {
                            (
                                id.clone(),
                                f.get(id).map_or(*c, |before| c.since(before)),
                            )
                        })
                        .collect(),
                    _ => BTreeMap::new(),
                };
                let error = match (&source, &w.last) {
                    (Source::None { .. }, _) => None,
                    (_, None) => Some(w.error.unwrap_or_else(|| "never read".into())),
                    _ => None,
                };
                Some((
                    w.name,
                    VmQemu {
                        source,
                        counts,
                        error,
                        predates_run: w.predates_run,
                    },
                ))
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

/// Reads every VM's counters until `stop`, then once more; QEMU's counts
/// over the run, by VM name.
pub(super) async fn watch(
    known: Arc<Mutex<Registry>>,
    mut stop: watch::Receiver<bool>,
) -> BTreeMap<String, VmQemu> {
    let at_start: BTreeSet<u32> = known
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .vms
        .keys()
        .copied()
        .collect();
    let mut state = State {
        at_start,
        ..Default::default()
    };
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let done = tokio::select! {
            _ = tick.tick() => false,
            r = stop.wait_for(|s| *s) => { let _ = r; true }
        };
        let live = alive(&known);
        // Sockets and a process per read: off the runtime's threads.
        state = match tokio::task::spawn_blocking(move || {
            state.pass(live, done);
            state
        })
        .await
        {
            Ok(s) => s,
            Err(_) => return BTreeMap::new(),
        };
        if done {
            return state.finish();
        }
    }
}
