//! VM attribution and the host window (`bpf/vms.bpf.c` and the files of its path): the VM tables the
//! agent fills, the notification probes, QEMU's and engines' uprobes.

use std::collections::BTreeMap;

use aya::{
    maps::{Array, HashMap},
    programs::{
        uprobe::{UProbeLinkId, UProbeScope},
        UProbe,
    },
    Ebpf,
};

use super::*;
use crate::probes::{map_mut_of, map_of, Attachment, Flavour, LoadError};
use crate::{
    abi::{
        BlkStats, FileKey, RqSlot, VmCounts, VmDevKey, VmKey, VmProc, NR_DIO_END_IO, RQ_F_DONE,
        RQ_F_REQUEUE_PENDING, VM_PROC_RUNNING, VM_PROC_STARTING,
    },
    discover::disks::Dev,
    discover::vms::VmMaps,
    model::Op,
};

/// Kernel addresses of the direct-I/O completion functions whose bios lead
/// to their file (0 where a symbol is absent: those requests stay
/// unresolved, never misattributed).
pub(super) fn dio_end_io_addresses() -> [u64; NR_DIO_END_IO] {
    const NAMES: [&str; NR_DIO_END_IO] = crate::abi::DIO_END_IO;
    let mut out = [0u64; NR_DIO_END_IO];
    if let Ok(text) = std::fs::read_to_string("/proc/kallsyms") {
        for line in text.lines() {
            let mut f = line.split_whitespace();
            let (Some(addr), Some(_), Some(name)) = (f.next(), f.next(), f.next()) else {
                continue;
            };
            if let Some(i) = NAMES.iter().position(|n| *n == name) {
                out[i] = u64::from_str_radix(addr, 16).unwrap_or(0);
            }
        }
    }
    out
}

/// Whether the kvm tracepoints exist (the kvm module is loaded).
pub fn kvm_tracepoints() -> bool {
    mount_tracefs();
    [
        "/sys/kernel/tracing/events/kvm/kvm_mmio",
        "/sys/kernel/debug/tracing/events/kvm/kvm_mmio",
    ]
    .iter()
    .any(|p| std::path::Path::new(p).exists())
}

pub fn io_uring_tracepoints() -> bool {
    mount_tracefs();
    [
        "/sys/kernel/tracing/events/io_uring/io_uring_queue_async_work",
        "/sys/kernel/debug/tracing/events/io_uring/io_uring_queue_async_work",
    ]
    .iter()
    .any(|p| std::path::Path::new(p).exists())
}

pub(super) fn insert_all<K: aya::Pod>(
    ebpf: &mut Ebpf,
    name: &'static str,
    items: &[(K, u32)],
) -> Result<(), LoadError> {
    let mut map: HashMap<_, K, u32> = map_mut_of(ebpf, name)?;
    for (k, v) in items {
        map.insert(k, v, 0).map_err(LoadError::map_op(name))?;
    }
    Ok(())
}

pub(super) fn add_vm_maps(ebpf: &mut Ebpf, maps: &VmMaps) -> Result<(), LoadError> {
    insert_all(ebpf, "vdisk_files", &maps.files)?;
    insert_all(ebpf, "vm_disks", &maps.disks)
}

impl BlockProbes {
    /// VMs' requests still open in the request table whose VM has exited
    /// (`exited(slot)`): a process does not exit with direct I/O in
    /// flight, so the kernel completed them, and their completion never
    /// reached us — those whose tag was not used again, which is how the
    /// rest are found. Per (VM, host disk, op, virtual disk); read-only, so
    /// call once, at the end of a run.
    pub fn open_requests_of_exited(
        &self,
        exited: impl Fn(u32) -> bool,
    ) -> Result<BTreeMap<VmStatKey, u64>, LoadError> {
        let slots: Array<_, RqSlot> = map_of(&self.ebpf, "inflight")?;
        let mut out = BTreeMap::new();
        for item in slots.iter() {
            let s = item.map_err(LoadError::map_op("inflight"))?;
            let open =
                s.rq != 0 && s.issue_ns != 0 && s.flags & (RQ_F_DONE | RQ_F_REQUEUE_PENDING) == 0;
            if open && s.vm != 0 && exited(s.vm) {
                let k = VmStatKey {
                    vm: s.vm,
                    dev: Dev(s.dev),
                    op: Op::from_index(s.op as usize).unwrap_or(Op::Other),
                    vdisk: s.vdisk,
                };
                *out.entry(k).or_default() += 1;
            }
        }
        Ok(out)
    }

    /// A VM's probes in QEMU (see `Vm::uprobe_symbols`), on its process
    /// only: other processes of the binary pay nothing. Kept per VM, to be
    /// detached when it exits (`forget_vm`) or the tier changes (those of
    /// the other tier).
    pub fn attach_vm_uprobes(&mut self, vm: &crate::discover::vms::Vm) -> Result<(), LoadError> {
        let symbols = vm.uprobe_symbols(self.probe_choice(vm.kvm));
        self.sync_uprobes(vm.exe.as_deref(), vm.pid, &symbols)
    }

    /// What decides a VM's uprobes here: the tier, and whether the
    /// kernel shows its kicks and interrupts.
    fn probe_choice(&self, kvm: bool) -> crate::discover::vms::ProbeChoice {
        crate::discover::vms::ProbeChoice {
            split: self.vm_segments,
            deep: self.tier.tier.is_deep(),
            // Without KVM no kernel event shows its interrupts; its kicks
            // are seen in the always-on tier only where eventfd writes are.
            interrupts_in_qemu: !kvm && self.tier.sees_eventfd_writes(),
        }
    }

    /// Detaches the uprobes of `pid` not in `symbols`, attaches those
    /// missing.
    fn sync_uprobes(
        &mut self,
        exe: Option<&std::path::Path>,
        pid: u32,
        symbols: &[(&'static str, crate::discover::vms::ProbeRole)],
    ) -> Result<(), LoadError> {
        let links = self.vm_links.remove(&pid).unwrap_or_default();
        let (keep, stale): (Vec<_>, Vec<_>) = links
            .into_iter()
            .partition(|(sym, _)| symbols.iter().any(|(s, _)| s == sym));
        self.detach_uprobe_links(pid, stale)?;
        let missing: Vec<_> = symbols
            .iter()
            .filter(|(s, _)| !keep.iter().any(|(k, _)| k == s))
            .copied()
            .collect();
        self.vm_links.insert(pid, keep);
        self.attach_uprobes(exe, pid, &missing)
    }

    fn detach_uprobe_links(
        &mut self,
        pid: u32,
        links: Vec<(&'static str, UProbeLinkId)>,
    ) -> Result<(), LoadError> {
        for (symbol, link) in links {
            if let Some(prog) = self.ebpf.program_mut(symbol) {
                let p: &mut UProbe = prog.try_into().map_err(|_| LoadError::MissingProgram {
                    program: symbol.into(),
                })?;
                p.detach(link).map_err(|e| LoadError::Attach {
                    tracepoint: format!("uprobe {symbol} of pid {pid}"),
                    flavour: "uprobe",
                    reason: crate::probes::error_chain(&e),
                })?;
            }
        }
        Ok(())
    }

    /// An engine process serving VM `slot`'s disks from outside QEMU: its
    /// requests, kick pickups and used-ring pushes are the VM's from now
    /// on (it runs only to serve them). Undone by `forget_vm(pid, slot)`.
    pub fn add_engine(
        &mut self,
        e: &crate::discover::vms::EngineRef,
        slot: u32,
    ) -> Result<(), LoadError> {
        let mut pids: HashMap<_, u32, VmProc> = map_mut_of(&mut self.ebpf, "vm_pids")?;
        let p = VmProc {
            slot,
            state: VM_PROC_RUNNING,
        };
        pids.insert(e.pid, p, 0)
            .map_err(LoadError::map_op("vm_pids"))?;
        self.bump_gen()?;
        self.sync_engine_uprobes(e)
    }

    /// An engine's uprobes for the tier of the moment.
    pub fn sync_engine_uprobes(
        &mut self,
        e: &crate::discover::vms::EngineRef,
    ) -> Result<(), LoadError> {
        let symbols = e.uprobe_symbols(self.vm_segments && self.tier.tier.is_deep());
        self.sync_uprobes(e.exe.as_deref(), e.pid, &symbols)
    }

    pub(super) fn attach_uprobes(
        &mut self,
        exe: Option<&std::path::Path>,
        pid: u32,
        symbols: &[(&'static str, crate::discover::vms::ProbeRole)],
    ) -> Result<(), LoadError> {
        let Some(exe) = exe else {
            return Ok(());
        };
        let Some(nz) = std::num::NonZeroU32::new(pid) else {
            return Ok(());
        };
        for &(symbol, role) in symbols {
            let site = format!("{}:{symbol}", exe.display());
            // Read and attached through /proc/PID/exe: the file the process
            // runs, never what sits at its path now.
            let Some(found) = crate::probes::uprobe::uprobe_site(pid, symbol) else {
                if role.optional() {
                    log::warn!(
                        "{symbol} is not exported by {} (pid {pid}): {}",
                        exe.display(),
                        role.missing()
                    );
                    continue;
                }
                return Err(LoadError::Attach {
                    tracepoint: format!("uprobe {site}"),
                    flavour: "uprobe",
                    reason: format!("{symbol} is not exported by {}", exe.display()),
                });
            };
            let (offset, prologue) = (found.file_offset, found.prologue);
            if role.hot() && prologue != crate::probes::uprobe::Prologue::Push {
                log::warn!("{site} is not entered with a push: each hit is single-stepped (see iospan doctor)");
            }
            let prog = self
                .ebpf
                .program_mut(symbol)
                .ok_or_else(|| LoadError::MissingProgram {
                    program: symbol.into(),
                })?;
            let result = (|| -> Result<UProbeLinkId, String> {
                let p: &mut UProbe = prog.try_into().map_err(|e| format!("{e:#}"))?;
                if p.fd().is_err() {
                    p.load().map_err(|e| crate::probes::error_chain(&e))?;
                }
                p.attach(
                    aya::programs::uprobe::UProbeAttachLocation::AbsoluteOffset(offset),
                    crate::probes::uprobe::exe_path(pid),
                    UProbeScope::OneProcess(nz),
                )
                .map_err(|e| crate::probes::error_chain(&e))
            })();
            let link = result.map_err(|reason| LoadError::Attach {
                tracepoint: format!("uprobe {site}"),
                flavour: "uprobe",
                reason,
            })?;
            self.vm_links.entry(pid).or_default().push((symbol, link));
            log::info!("attached uprobe {site} (file offset {offset:#x}) for pid {pid}");
            if !self.attachments.iter().any(|a| a.tracepoint == site) {
                self.attachments.push(Attachment {
                    tracepoint: site,
                    flavour: Flavour::Uprobe,
                    program: symbol.into(),
                });
            }
        }
        Ok(())
    }

    /// A VM process has exited: its uprobes go (the kernel would keep them
    /// on the binary's inode for as long as we hold them), and its pid no
    /// longer names a VM (a new process may be given it).
    pub fn forget_vm(&mut self, pid: u32, slot: u32) -> Result<(), LoadError> {
        let links = self.vm_links.remove(&pid).unwrap_or_default();
        self.detach_uprobe_links(pid, links)?;
        // Absent keys are fine: not every VM has every flag. A pid already
        // taken by a new VM (exec'd since) is that VM's.
        let mut pids: HashMap<_, u32, VmProc> = map_mut_of(&mut self.ebpf, "vm_pids")?;
        if pids.get(&pid, 0).ok().map(|p| p.slot) != Some(slot) {
            return Ok(());
        }
        let _ = pids.remove(&pid);
        self.bump_gen()?;
        for map in ["vm_notifiers_known", "vm_no_stop"] {
            let mut m: HashMap<_, u32, u8> = map_mut_of(&mut self.ebpf, map)?;
            let _ = m.remove(&pid);
        }
        let mut open: HashMap<_, u32, i64> = map_mut_of(&mut self.ebpf, "vm_open_notifiers")?;
        let _ = open.remove(&pid);
        let mut made: HashMap<_, u32, u32> = map_mut_of(&mut self.ebpf, "notifiers_made")?;
        let _ = made.remove(&pid);
        Ok(())
    }

    /// Takes an exited VM (or a process found to run no guest) out of the
    /// kernel's per-VM tables, so VMs coming and going never fill them: its
    /// figures move to the agent (`keep`; a not-VM's are the host's and
    /// go), its virtual disks' entries are deleted. A completion that
    /// arrives later makes a new entry, read as usual.
    pub fn retire_vm(&mut self, slot: u32, vdisks: &[u32], keep: bool) -> Result<(), LoadError> {
        let key = |k: &VmKey| VmStatKey {
            vm: k.vm,
            dev: Dev(k.dev),
            op: Op::from_index(k.op as usize).unwrap_or(Op::Other),
            vdisk: k.vdisk,
        };
        let map_err = LoadError::map_op;
        {
            let mut lat: PerCpuHashMap<_, VmKey, BlkStats> =
                map_mut_of(&mut self.ebpf, "vm_latency")?;
            let keys: Vec<VmKey> = lat
                .keys()
                .filter_map(Result::ok)
                .filter(|k| k.vm == slot)
                .collect();
            for k in keys {
                if let Ok(per_cpu) = lat.get(&k, 0) {
                    let st = self.retired.vm_stats.entry(key(&k)).or_default();
                    for cpu in per_cpu.iter() {
                        st.add_cpu(cpu);
                    }
                }
                lat.remove(&k).map_err(map_err("vm_latency"))?;
            }
        }
        let retired = &mut self.retired;
        take_entries::<VmKey, BlkStats>(
            &mut self.ebpf,
            "vm_latency_nested",
            |k| k.vm == slot,
            |k, v| retired.vm_stats.entry(key(k)).or_default().add_cpu(&v),
        )?;
        take_entries::<VmKey, u64>(
            &mut self.ebpf,
            "vm_undelivered",
            |k| k.vm == slot,
            |k, n| retired.vm_stats.entry(key(k)).or_default().undelivered += n,
        )?;
        {
            let mut counts: PerCpuArray<_, VmCounts> = map_mut_of(&mut self.ebpf, "vm_counts")?;
            let idx = slot % crate::abi::MAX_VM_COUNTS;
            if let Ok(per_cpu) = counts.get(&idx, 0) {
                let c = super::sum_counts(&per_cpu);
                self.retired.vm_counts.entry(slot).or_default().add(&c);
                let zero = super::zero_per_cpu("vm_counts")?;
                counts.set(idx, zero, 0).map_err(map_err("vm_counts"))?;
            }
        }
        {
            let mut due: HashMap<_, u32, u32> = map_mut_of(&mut self.ebpf, "vm_signal_due")?;
            let _ = due.remove(&slot);
        }
        if !keep {
            self.retired.vm_stats.retain(|k, _| k.vm != slot);
            self.retired.vm_counts.remove(&slot);
        }
        self.retire_splits(slot, keep)?;
        take_entries::<VmDevKey, u32>(&mut self.ebpf, "vm_disks", |k| k.vm == slot, |_, _| {})?;
        {
            let mut files: HashMap<_, FileKey, u32> = map_mut_of(&mut self.ebpf, "vdisk_files")?;
            let keys: Vec<FileKey> = files
                .iter()
                .filter_map(Result::ok)
                .filter(|(_, v)| vdisks.contains(v))
                .map(|(k, _)| k)
                .collect();
            for k in keys {
                files.remove(&k).map_err(map_err("vdisk_files"))?;
            }
        }
        self.bump_gen()
    }

    /// Tells the kernel side about a new VM's virtual disks.
    pub fn add_vm_maps(&mut self, maps: &VmMaps) -> Result<(), LoadError> {
        add_vm_maps(&mut self.ebpf, maps)?;
        self.bump_gen()
    }

    /// Takes the VM's requests as its guest's from now on, for a VM whose
    /// guest's start the kernel side cannot see (no `debug-threads=on`, no
    /// kick). A VM already running, or stopped since, is left as it is.
    pub fn mark_started(&mut self, pid: u32) -> Result<(), LoadError> {
        let mut pids: HashMap<_, u32, VmProc> = map_mut_of(&mut self.ebpf, "vm_pids")?;
        let Ok(mut p) = pids.get(&pid, 0) else {
            return Ok(());
        };
        if p.state != VM_PROC_STARTING {
            return Ok(());
        }
        p.state = VM_PROC_RUNNING;
        pids.insert(pid, p, 0)
            .map_err(LoadError::map_op("vm_pids"))?;
        self.bump_gen()
    }

    /// The VM stays running through its notifiers all closing (none of its
    /// disks is notified through one; see vm_no_stop).
    pub fn exempt_from_stop(&mut self, pid: u32) -> Result<(), LoadError> {
        self.flag_vm("vm_no_stop", pid)
    }

    /// Sets `pid` -> 1 in one of the per-VM flag maps.
    pub(super) fn flag_vm(&mut self, map: &'static str, pid: u32) -> Result<(), LoadError> {
        let mut m: HashMap<_, u32, u8> = map_mut_of(&mut self.ebpf, map)?;
        m.insert(pid, 1, 0).map_err(LoadError::map_op(map))
    }

    /// (tgid, VM slot) of every process known as a VM so far.
    pub fn vm_pids(&self) -> Result<Vec<(u32, u32)>, LoadError> {
        let map: HashMap<_, u32, VmProc> = map_of(&self.ebpf, "vm_pids")?;
        map.iter()
            .map(|r| {
                r.map(|(pid, p)| (pid, p.slot))
                    .map_err(LoadError::map_op("vm_pids"))
            })
            .collect()
    }
}

/// Deletes the entries of the hash map `name` whose key `mine` picks,
/// handing each one's value to `take` first (a map read and written by the
/// kernel meanwhile: a key gone already is skipped).
fn take_entries<K: aya::Pod, V: aya::Pod>(
    ebpf: &mut Ebpf,
    name: &'static str,
    mine: impl Fn(&K) -> bool,
    mut take: impl FnMut(&K, V),
) -> Result<(), LoadError> {
    let mut map: HashMap<_, K, V> = map_mut_of(ebpf, name)?;
    let keys: Vec<K> = map
        .keys()
        .filter_map(Result::ok)
        .filter(|k| mine(k))
        .collect();
    for k in keys {
        if let Ok(v) = map.get(&k, 0) {
            take(&k, v);
        }
        map.remove(&k).map_err(LoadError::map_op(name))?;
    }
    Ok(())
}
