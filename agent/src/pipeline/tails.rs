//! Every joined (or host-window) I/O of a run kept per (VM, vdisk, op), a
//! uniform sample past a million, for the tail's composition.

use std::collections::BTreeMap;

use crate::{
    discover::vms::Registry,
    model::{
        tails::{bands, cdf, Parts, TailEntry},
        IoSpan, Op,
    },
};

/// I/Os kept per (VM, virtual disk, op) before the rest are sampled.
const KEEP: usize = 1 << 20;

#[derive(Default)]
struct Reservoir {
    kept: Vec<Parts>,
    seen: u64,
    rng: u64,
    /// The first kick and the last signal seen (host clock, ns).
    first_ns: u64,
    last_ns: u64,
}

impl Reservoir {
    fn add(&mut self, p: Parts) {
        self.seen = self.seen.saturating_add(1);
        if self.kept.len() < KEEP {
            self.kept.push(p);
            return;
        }
        // Beyond KEEP, each I/O replaces a kept one with probability
        // KEEP/seen: the kept ones stay a uniform sample.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let j = self.rng.checked_rem(self.seen).unwrap_or(0);
        if let Some(slot) = usize::try_from(j).ok().and_then(|j| self.kept.get_mut(j)) {
            *slot = p;
        }
    }
}

/// Every joined (or host-window) I/O of a run, by (VM, vdisk, op) slot.
#[derive(Default)]
pub struct Tails {
    per: BTreeMap<(u32, u32, Op), Reservoir>,
}

impl Tails {
    pub fn record(&mut self, sp: &IoSpan) {
        let c = |ns: u64| ns.min(u64::from(u32::MAX)) as u32;
        let r = self
            .per
            .entry((sp.vm, sp.vdisk, sp.op))
            .or_insert_with(|| Reservoir {
                rng: 0x9e37_79b9_7f4a_7c15,
                ..Default::default()
            });
        if r.first_ns == 0 || sp.kick_ns < r.first_ns {
            r.first_ns = sp.kick_ns;
        }
        r.last_ns = r.last_ns.max(sp.signal_ns);
        r.add([
            c(sp.total_ns),
            c(sp.guest_ns),
            c(sp.hypervisor_ns),
            c(sp.engine_ns),
            c(sp.device_ns),
        ]);
    }

    /// Per (VM, virtual disk, op), named.
    pub fn entries(&self, known: &Registry) -> Vec<TailEntry> {
        self.per
            .iter()
            .filter_map(|((vm, vdisk, op), r)| {
                Some(TailEntry {
                    vm: known.name(*vm),
                    disk: known.vdisk(*vdisk)?.to_string(),
                    op: *op,
                    ios: r.seen,
                    // Over the disk's busy span (first kick to last signal),
                    // not the whole run: boots and pauses do not count.
                    iops: {
                        let span = r.last_ns.saturating_sub(r.first_ns) as f64 / 1e9;
                        if span > 0.0 {
                            r.seen as f64 / span
                        } else {
                            0.0
                        }
                    },
                    sampled: r.seen > r.kept.len() as u64,
                    guest_observed: r.kept.iter().any(|p| p[1] > 0),
                    bands: bands(&r.kept),
                    cdf: cdf(&r.kept),
                })
            })
            .collect()
    }
}
