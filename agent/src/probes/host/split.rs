//! The always-on tier's joined host windows, as the kernel keeps them:
//! `vm_split` (per VM, virtual disk, host disk, op and guest queue),
//! `vm_unsplit` (per virtual disk, the requests that could not be split),
//! and the per-VM settings the join reads (`vm_flags`, `vdisk_slow_ns`).

use super::*;
use crate::{
    abi::{DoneRing, VdiskKey, VmSplitKey, VmSplitStats, VmUnsplit},
    model::JoinedWindows,
    probes::LoadError,
};

/// Cumulative since load: every VM's joined windows and unsplit requests,
/// exited VMs' included.
#[derive(Clone, Debug, Default)]
pub struct KernelSplits {
    pub splits: BTreeMap<VmSplitKey, JoinedWindows>,
    pub unsplit: BTreeMap<VdiskKey, VmUnsplit>,
}

impl KernelSplits {
    fn merge(&mut self, o: &KernelSplits) {
        for (k, w) in &o.splits {
            self.splits.entry(*k).or_default().merge(w);
        }
        for (k, u) in &o.unsplit {
            add_unsplit(self.unsplit.entry(*k).or_default(), u);
        }
    }
}

/// The requests of ring `r` published and not yet settled, per virtual
/// disk.
fn count_waiting(r: &DoneRing, out: &mut BTreeMap<VdiskKey, u64>) {
    if r.vm == 0 {
        return;
    }
    for idx in r.head
        ..r.tail
            .min(r.head.saturating_add(crate::abi::DONE_RING as u64))
    {
        let e = &r.ent[idx as usize % crate::abi::DONE_RING];
        if e.seq == idx + 1 {
            let vdisk = e.vdisk;
            *out.entry(VdiskKey { vm: r.vm, vdisk }).or_default() += 1;
        }
    }
}

fn add_unsplit(a: &mut VmUnsplit, b: &VmUnsplit) {
    a.no_kick += b.no_kick;
    a.no_signal += b.no_signal;
    a.polled += b.polled;
    a.unordered += b.unordered;
}

impl BlockProbes {
    /// Reads the joined windows and unsplit counts (a few system calls per
    /// entry: at a frame, a scrape or a run's end, not per request).
    pub fn kernel_splits(&self) -> Result<KernelSplits, LoadError> {
        let mut out = KernelSplits::default();
        if !self.vm_segments {
            return Ok(out);
        }
        let splits: PerCpuHashMap<_, VmSplitKey, VmSplitStats> = map_of(&self.ebpf, "vm_split")?;
        for item in splits.iter() {
            let (k, per_cpu) = item.map_err(LoadError::map_op("vm_split"))?;
            let w = out.splits.entry(k).or_default();
            for cpu in per_cpu.iter() {
                w.add_cpu(cpu);
            }
        }
        let unsplit: HashMap<_, VdiskKey, VmUnsplit> = map_of(&self.ebpf, "vm_unsplit")?;
        for item in unsplit.iter() {
            let (k, u) = item.map_err(LoadError::map_op("vm_unsplit"))?;
            add_unsplit(out.unsplit.entry(k).or_default(), &u);
        }
        out.merge(&self.retired.splits);
        Ok(out)
    }

    /// Requests still waiting for their VM's interrupt (`vm_done`), per
    /// virtual disk: at a run's end, or their VM gone, none will come.
    pub fn waiting_for_signals(&self) -> Result<BTreeMap<VdiskKey, u64>, LoadError> {
        let mut out = BTreeMap::new();
        if !self.vm_segments {
            return Ok(out);
        }
        let rings: Array<_, DoneRing> = map_of(&self.ebpf, "vm_done")?;
        for i in 0..rings.len() {
            if let Ok(r) = rings.get(&i, 0) {
                count_waiting(&r, &mut out);
            }
        }
        Ok(out)
    }

    /// A VM gone: its joined windows move to the agent (`keep`), its
    /// settings and its ring of waiting completions are freed.
    pub(super) fn retire_splits(&mut self, slot: u32, keep: bool) -> Result<(), LoadError> {
        if !self.vm_segments {
            return Ok(());
        }
        let mut gone = KernelSplits::default();
        {
            let mut splits: PerCpuHashMap<_, VmSplitKey, VmSplitStats> =
                map_mut_of(&mut self.ebpf, "vm_split")?;
            let keys: Vec<VmSplitKey> = splits
                .keys()
                .filter_map(Result::ok)
                .filter(|k| k.vm == slot)
                .collect();
            for k in keys {
                if let Ok(per_cpu) = splits.get(&k, 0) {
                    let w = gone.splits.entry(k).or_default();
                    for cpu in per_cpu.iter() {
                        w.add_cpu(cpu);
                    }
                }
                splits.remove(&k).map_err(LoadError::map_op("vm_split"))?;
            }
        }
        {
            let mut unsplit: HashMap<_, VdiskKey, VmUnsplit> =
                map_mut_of(&mut self.ebpf, "vm_unsplit")?;
            let keys: Vec<VdiskKey> = unsplit
                .keys()
                .filter_map(Result::ok)
                .filter(|k| k.vm == slot)
                .collect();
            for k in keys {
                if let Ok(u) = unsplit.get(&k, 0) {
                    add_unsplit(gone.unsplit.entry(k).or_default(), &u);
                }
                unsplit
                    .remove(&k)
                    .map_err(LoadError::map_op("vm_unsplit"))?;
            }
        }
        if keep {
            self.retired.splits.merge(&gone);
        }
        let mut flags: HashMap<_, u32, u32> = map_mut_of(&mut self.ebpf, "vm_flags")?;
        let _ = flags.remove(&slot);
        let mut rings: Array<_, DoneRing> = map_mut_of(&mut self.ebpf, "vm_done")?;
        let idx = slot % rings.len();
        if let Some(r) = rings.get(&idx, 0).ok().filter(|r| r.vm == slot) {
            if keep {
                let mut waiting = BTreeMap::new();
                count_waiting(&r, &mut waiting);
                for (k, n) in waiting {
                    self.retired.splits.unsplit.entry(k).or_default().no_signal += n;
                }
            }
            rings
                .set(idx, DoneRing::default(), 0)
                .map_err(LoadError::map_op("vm_done"))?;
        }
        Ok(())
    }

    /// A VM's `VMF_*` flags.
    pub fn set_vm_flags(&mut self, slot: u32, flags: u32) -> Result<(), LoadError> {
        let mut m: HashMap<_, u32, u32> = map_mut_of(&mut self.ebpf, "vm_flags")?;
        if flags == 0 {
            let _ = m.remove(&slot);
            return Ok(());
        }
        m.insert(slot, flags, 0)
            .map_err(LoadError::map_op("vm_flags"))
    }

    /// A virtual disk's streaming threshold (ns; 0 takes it away).
    pub fn set_vdisk_slow_ns(&mut self, vdisk: u32, ns: u64) -> Result<(), LoadError> {
        let mut m: HashMap<_, u32, u64> = map_mut_of(&mut self.ebpf, "vdisk_slow_ns")?;
        if ns == 0 {
            let _ = m.remove(&vdisk);
            return Ok(());
        }
        m.insert(vdisk, ns, 0)
            .map_err(LoadError::map_op("vdisk_slow_ns"))
    }
}
