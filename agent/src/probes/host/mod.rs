//! The host's probes, one object (`host.bpf.o`) linked from one program
//! file per concern. Here: `block` (block accounting), `vm` (VM
//! attribution and its maps), `tier` (what the tier of the moment
//! attaches), `split` (the host window's split read back), `nesting` (the
//! wake-up tracepoints' second programs). This module loads the object and
//! reads what all of them share.

use std::{collections::BTreeMap, os::fd::AsFd};

use aya::{
    maps::{Array, HashMap, MapData, PerCpuArray, PerCpuHashMap, RingBuf},
    programs::uprobe::UProbeLinkId,
    Btf, Ebpf, EbpfLoader,
};
use serde::Serialize;

use super::{attach, map_mut_of, map_of, Attachment, Flavour, LoadError, RawLink};
use crate::{
    abi::{
        counter, BlkStats, DiskSlot, VmCounts, VmKey, VmProc, BLK_NR_OPS, DEFAULT_MAX_DISKS,
        MAX_STREAM_DEVS, MAX_VM_COUNTS, VM_GEN_AGENT_STEP, VM_PROC_RUNNING, VM_PROC_STARTING,
    },
    discover::disks::Dev,
    discover::vms::VmMaps,
    model::{
        block::{BlockSnapshot, Counters, VmStatKey},
        DiskOpStats, Op,
    },
};

mod block;
mod nesting;
mod scsi_target;
mod split;
mod tier;
mod vm;

pub use block::disks_without_start_time;
pub use scsi_target::VhostScsiProbes;
pub use split::KernelSplits;
pub use tier::{KickPath, TierProbes};
pub use vm::{io_uring_tracepoints, kvm_tracepoints};

/// Each VM's request counts, read from handles of its own.
pub struct VmCountsReader {
    counts: PerCpuArray<MapData, VmCounts>,
    latency: PerCpuHashMap<MapData, VmKey, BlkStats>,
    nested: HashMap<MapData, VmKey, BlkStats>,
    undelivered: HashMap<MapData, VmKey, u64>,
}

impl VmCountsReader {
    /// Requests of VM `slot`'s virtual disks submitted so far (None: none
    /// yet, or the VM has gone).
    pub fn submitted(&self, slot: u32) -> Option<u64> {
        self.counts
            .get(&(slot % MAX_VM_COUNTS), 0)
            .ok()
            .map(|per_cpu| per_cpu.iter().map(|c| c.submitted).sum())
            .filter(|&n| n > 0)
    }

    /// Requests of VM `slot` finished so far, timed or known undelivered:
    /// read before a read of QEMU's counters, what QEMU can have counted
    /// at least (it counts a request when it completes). None: not read.
    pub fn finished(&self, slot: u32) -> Option<u64> {
        let mut n = 0;
        for item in self.latency.iter() {
            let (k, per_cpu) = item.ok()?;
            if k.vm == slot {
                n += per_cpu.iter().map(|s| s.ios).sum::<u64>();
            }
        }
        for item in self.nested.iter() {
            let (k, s) = item.ok()?;
            n += if k.vm == slot { s.ios } else { 0 };
        }
        for item in self.undelivered.iter() {
            let (k, u) = item.ok()?;
            n += if k.vm == slot { u } else { 0 };
        }
        Some(n)
    }
}

/// A per-CPU value of zeroes, for every possible CPU.
fn zero_per_cpu<T: aya::Pod + Default>(
    map: &'static str,
) -> Result<aya::maps::PerCpuValues<T>, LoadError> {
    let io = |e: std::io::Error| LoadError::Map {
        map,
        source: Some(aya::maps::MapError::SyscallError(aya::sys::SyscallError {
            call: "possible CPUs",
            io_error: e,
        })),
    };
    let n = aya::util::nr_cpus().map_err(|(_, e)| io(e))?;
    aya::maps::PerCpuValues::try_from(vec![T::default(); n]).map_err(io)
}

/// One VM's counts summed over CPUs.
fn sum_counts(per_cpu: &aya::maps::PerCpuValues<VmCounts>) -> VmCounts {
    per_cpu.iter().fold(VmCounts::default(), |mut a, c| {
        a.add(c);
        a
    })
}
use crate::probes::features::mount_tracefs;
use vm::{add_vm_maps, dio_end_io_addresses};

/// VM slots kept for QEMUs exec'd while the probes load.
const LATE_VM_SLOTS: u32 = 16;

/// `BPF_NOEXIST`: insert only where the key is absent.
const BPF_NOEXIST: u64 = 1;

/// The hash tables whose fill /metrics shows.
const FILL_MAPS: &[&str] = &[
    "vm_pids",
    "vm_flags",
    "ioeventfd_calls",
    "vm_counts",
    "vm_undelivered",
    "vdisk_files",
    "vm_latency",
    "vm_latency_nested",
    "vm_disks",
    "vm_split",
    "vm_unsplit",
    "file_kicks",
    "thread_kicks",
    "kvm_notifiers",
    "vq_notifiers",
    "thread_picks",
    "vm_last_pick",
    "vhost_kicks",
    "vhost_kick_files",
    "kvm_notify_addrs",
    "vm_open_notifiers",
    "notifiers_made",
    "thread_waits",
    "vm_signal_due",
    "vdisk_slow_ns",
];

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/host.bpf.o"));

#[derive(Clone, Debug)]
pub struct BlockConfig {
    /// Disk slots in the kernel tables; more disks than this are counted
    /// as `disk_conflicts`, not measured.
    pub max_disks: u32,
    /// Stream one request in N through the ring buffer (0: none).
    pub sample_every: u32,
    /// Stream every request at least this slow (0: off).
    pub slower_than_ns: u64,
    /// Stream only these disks' requests (all when empty).
    pub stream_devs: Vec<Dev>,
    /// Stamp request starts ourselves even if every disk's requests carry
    /// the kernel's start time.
    pub start_stamps: bool,
    /// Attribute requests to the VMs that submitted them — these running
    /// ones (tgids, given slots 1..) and any started later — and split
    /// their host windows (records through the ring buffer).
    pub track_vms: bool,
    pub vm_pids: Vec<u32>,
    /// What the kernel side needs to resolve those VMs' virtual disks.
    pub vm_maps: VmMaps,
    /// The tier to start in (`set_tier` changes it while loaded).
    pub tier: crate::model::Tier,
    /// Joined VM requests the kernel streams besides those of VMs that
    /// stream all: one in N (0: none), and every one at least this slow
    /// (0: none by this rule).
    pub vm_one_in: u32,
    pub vm_slower_than_ns: u64,
    /// Program flavours never to use (tp_btf, fentry, kprobe): what a
    /// kernel without them gets instead.
    pub avoid: Vec<Flavour>,
}

impl Default for BlockConfig {
    fn default() -> Self {
        Self {
            max_disks: DEFAULT_MAX_DISKS,
            sample_every: 0,
            slower_than_ns: 0,
            stream_devs: Vec::new(),
            start_stamps: false,
            track_vms: false,
            vm_pids: Vec::new(),
            vm_maps: VmMaps::default(),
            tier: crate::model::Tier::AlwaysOn,
            vm_one_in: 0,
            vm_slower_than_ns: 0,
            avoid: Vec::new(),
        }
    }
}

pub struct BlockProbes {
    ebpf: Ebpf,
    pub attachments: Vec<Attachment>,
    max_disks: u32,
    flavour: Flavour,
    btf: Option<Btf>,
    /// When the start probe was attached (time since boot): a VM started
    /// before then may have made its first request unseen.
    start_probe_since: Option<std::time::Duration>,
    vm_segments: bool,
    vm_probes: bool,
    switch_probe: bool,
    /// What the VM path has attached, by tier (`tier.rs`).
    pub tier: TierProbes,
    /// Each VM process's uprobe links: (program, link).
    vm_links: std::collections::HashMap<u32, Vec<(&'static str, UProbeLinkId)>>,
    /// Exited VMs' figures, taken out of the kernel's tables so that VMs
    /// coming and going never fill them (`retire_vm`).
    retired: Retired,
}

/// What exited VMs left in the kernel's per-VM tables.
#[derive(Default)]
struct Retired {
    vm_stats: BTreeMap<VmStatKey, DiskOpStats>,
    vm_counts: BTreeMap<u32, VmCounts>,
    splits: KernelSplits,
}

/// Whether the kernel has block_io_start (v6.5, 5a80bd075f3b): the one
/// tracepoint every request passes in its submitter's context. Before it,
/// VMs' requests are taken at block_getrq (by bio) instead.
fn has_block_io_start(btf: Option<&Btf>) -> bool {
    match btf {
        Some(b) => b
            .id_by_type_name_kind("btf_trace_block_io_start", aya_obj::btf::BtfKind::Typedef)
            .is_ok(),
        None => [
            "/sys/kernel/tracing/events/block/block_io_start",
            "/sys/kernel/debug/tracing/events/block/block_io_start",
        ]
        .iter()
        .any(|p| std::path::Path::new(p).exists()),
    }
}

impl BlockProbes {
    /// Loads and attaches every block program on tp_btf, or, if any of
    /// them will not, all of them on raw_tp: the two flavours key in-flight
    /// requests the same way, but one flavour for all keeps cost and
    /// behaviour uniform.
    pub fn load(cfg: &BlockConfig) -> Result<Self, LoadError> {
        crate::probes::features::check_atomics().map_err(LoadError::UnsupportedKernel)?;
        let btf = Btf::from_sys_fs().ok();
        if cfg.avoid.contains(&Flavour::TpBtf) {
            log::info!("tp_btf avoided (--avoid): block probes on raw_tp");
            return Self::load_flavour(cfg, btf.as_ref(), Flavour::RawTp);
        }
        match Self::load_flavour(cfg, btf.as_ref(), Flavour::TpBtf) {
            Ok(p) => Ok(p),
            Err(e) => {
                log::info!(
                    "tp_btf block probes unavailable ({}); using raw_tp",
                    crate::probes::error_chain(&e)
                );
                Self::load_flavour(cfg, btf.as_ref(), Flavour::RawTp)
            }
        }
    }

    fn load_flavour(
        cfg: &BlockConfig,
        btf: Option<&Btf>,
        flavour: Flavour,
    ) -> Result<Self, LoadError> {
        let max_disks = cfg.max_disks.max(1);
        if cfg.stream_devs.len() > MAX_STREAM_DEVS {
            return Err(LoadError::TooManyStreamDisks {
                given: cfg.stream_devs.len(),
                max: MAX_STREAM_DEVS,
            });
        }
        let mut stream_devs = [0u32; MAX_STREAM_DEVS];
        for (slot, d) in stream_devs.iter_mut().zip(&cfg.stream_devs) {
            *slot = d.0;
        }
        let nr_stream_devs = cfg.stream_devs.len() as u32;
        let track_vms = u32::from(cfg.track_vms);
        let vm_segments = track_vms;
        // Slots after the running VMs' are kept for QEMUs exec'd between
        // the caller's scan and the exec watch (see `adopt_late_vms`).
        let next_vm = cfg.vm_pids.len() as u32 + LATE_VM_SLOTS;
        let dio_end_io = dio_end_io_addresses();
        let getrq = u32::from(!has_block_io_start(btf));
        let scsi_target = u32::from(
            cfg.track_vms && !cfg.avoid.contains(&Flavour::Kprobe) && scsi_target::lio_loaded(),
        );
        let mut ebpf = EbpfLoader::new()
            .btf(btf)
            .override_global("targ_max_disks", &max_disks, true)
            .override_global("targ_sample_every", &cfg.sample_every, true)
            .override_global("targ_slower_than_ns", &cfg.slower_than_ns, true)
            .override_global("targ_nr_stream_devs", &nr_stream_devs, true)
            .override_global("targ_stream_devs", &stream_devs[..], true)
            .override_global("targ_track_vms", &track_vms, true)
            .override_global("targ_vm_segments", &vm_segments, true)
            .override_global("next_vm", &next_vm, true)
            .override_global("targ_dio_end_io", &dio_end_io[..], true)
            .override_global("targ_getrq", &getrq, true)
            .override_global("targ_scsi_target", &scsi_target, true)
            .map_max_entries("blk_latency", max_disks * BLK_NR_OPS as u32)
            .map_max_entries("blk_latency_nested", max_disks * BLK_NR_OPS as u32)
            .map_max_entries("disk_queues", max_disks)
            .map_max_entries(
                "events",
                events_ring_bytes(cfg.tier.is_deep(), nr_stream_devs),
            )
            .load(OBJECT)
            .map_err(|source| LoadError::Object {
                object: "host.bpf.o",
                source,
            })?;

        if cfg.track_vms {
            add_running_vms(&mut ebpf, cfg)?;
        }
        let probes = Self {
            ebpf,
            attachments: Vec::new(),
            max_disks,
            flavour,
            btf: btf.cloned(),
            start_probe_since: None,
            vm_segments: vm_segments != 0,
            vm_probes: false,
            switch_probe: false,
            tier: TierProbes::new(cfg.tier, &cfg.avoid),
            vm_links: Default::default(),
            retired: Retired::default(),
        };
        probes.attach_at_load(cfg)
    }

    /// The programs a run starts with, in the order that loses no VM's
    /// first request.
    fn attach_at_load(mut self, cfg: &BlockConfig) -> Result<Self, LoadError> {
        let probes = &mut self;
        if cfg.track_vms {
            // The exec watch first: a QEMU started after the start-up scan,
            // while the rest is verified (seconds on a busy host), is
            // followed from its exec, not missed.
            probes.attach_raw("sched_process_exec")?;
            probes.adopt_late_vms(&cfg.vm_pids);
            // Verified before the block programs are attached, and attached
            // when the first VM appears: a VM's first requests must not
            // wait for the verifier, nor the run's figures start before the
            // run.
            probes.preload_vm_programs();
        }
        for tp in ["block_rq_issue", "block_rq_requeue", "block_rq_complete"] {
            probes.attach_raw(tp)?;
        }
        // The start probe takes each request's submitter, in the submitting
        // task (completions run under unrelated tasks), and stamps starts
        // where the kernel keeps none. Attached from the start when VMs are
        // followed: a VM is followed from its exec, and its first request
        // (its firmware's) comes before the agent could name it. Without
        // VMs or such disks each request costs one program run less.
        // Disks without start times added later are counted as `no_start`.
        if cfg.track_vms || cfg.start_stamps || !disks_without_start_time().is_empty() {
            probes.ensure_start_probe()?;
        }
        if probes.vm_segments {
            probes.write_tier(cfg.vm_one_in, cfg.vm_slower_than_ns)?;
            // The deep tier sees a new VM create its queue notifiers,
            // possibly before the agent notices it: watched from the start.
            if cfg.tier.is_deep() {
                probes.attach_notifier_watch()?;
            }
        }
        if !cfg.vm_pids.is_empty() {
            probes.ensure_vm_probes()?;
        }
        Ok(self)
    }

    /// QEMU processes exec'd after the caller's scan of running VMs but
    /// before the exec watch was attached: neither saw them. Given the
    /// slots kept for them, as starting VMs (the agent names them as it
    /// names exec'd ones).
    fn adopt_late_vms(&mut self, scanned: &[u32]) {
        let late: Vec<u32> = crate::discover::vms::qemu_pids()
            .into_iter()
            .filter(|p| !scanned.contains(p))
            .collect();
        let Ok(mut pids) = map_mut_of::<HashMap<_, u32, VmProc>>(&mut self.ebpf, "vm_pids") else {
            return;
        };
        let first = scanned.len() as u32 + 1;
        for (i, pid) in late.iter().enumerate() {
            let Some(slot) = u32::try_from(i)
                .ok()
                .filter(|&i| i < LATE_VM_SLOTS)
                .map(|i| first + i)
            else {
                log::warn!(
                    "{} QEMU processes started while the probes loaded: pid {pid} and later \
                     ones not followed (their requests are the host's)",
                    late.len()
                );
                break;
            };
            let p = VmProc {
                slot,
                state: VM_PROC_STARTING,
            };
            // An exec the watch saw already has its slot.
            let _ = pids.insert(pid, p, BPF_NOEXIST);
        }
    }

    /// The kernel side's generation of what processes' requests are
    /// attributed to: it moves at each exec of a VM (among other changes),
    /// so a look at it tells whether `vm_pids` may hold a new VM.
    pub fn vm_gen(&self) -> Result<u32, LoadError> {
        let gen: Array<_, u32> = map_of(&self.ebpf, "vm_gen")?;
        gen.get(&0, 0).map_err(LoadError::map_op("vm_gen"))
    }

    /// What a process's requests are attributed to has changed (`vm_pids`,
    /// a VM's state, its disks): the kernel side's caches of it go.
    pub(super) fn bump_gen(&mut self) -> Result<(), LoadError> {
        let mut gen: Array<_, u32> = map_mut_of(&mut self.ebpf, "vm_gen")?;
        let g = gen.get(&0, 0).map_err(LoadError::map_op("vm_gen"))?;
        gen.set(0, g.wrapping_add(VM_GEN_AGENT_STEP), 0)
            .map_err(LoadError::map_op("vm_gen"))
    }

    /// Whether VMs' host windows are split (the kernel side follows their
    /// notifications).
    pub fn vm_segments_on(&self) -> bool {
        self.vm_segments
    }

    /// The ring buffer of per-request records, for one consumer.
    pub fn take_events(&mut self) -> Result<super::ring::Ring, LoadError> {
        self.take_ring("events")
    }

    /// The ring buffer that wakes its one reader at each VM exec (a tgid
    /// per record).
    pub fn take_vm_execs(&mut self) -> Result<super::ring::Ring, LoadError> {
        self.take_ring("vm_execs")
    }

    fn take_ring(&mut self, name: &'static str) -> Result<super::ring::Ring, LoadError> {
        let map = self.ebpf.take_map(name).ok_or(LoadError::Map {
            map: name,
            source: None,
        })?;
        RingBuf::try_from(map)
            .map(super::ring::Ring::new)
            .map_err(LoadError::map_op(name))
    }

    pub fn snapshot(&self) -> Result<BlockSnapshot, LoadError> {
        let map_err = LoadError::map_op;
        let disks: Array<_, DiskSlot> = map_of(&self.ebpf, "disk_queues")?;
        let latency: PerCpuArray<_, BlkStats> = map_of(&self.ebpf, "blk_latency")?;
        let nested: Array<_, BlkStats> = map_of(&self.ebpf, "blk_latency_nested")?;

        let mut snap = BlockSnapshot::default();
        for slot in 0..self.max_disks {
            let d = disks.get(&slot, 0).map_err(map_err("disk_queues"))?;
            if d.queue == 0 || d.dev == 0 {
                continue;
            }
            for (i, op) in Op::ALL.iter().enumerate() {
                let idx = slot * BLK_NR_OPS as u32 + i as u32;
                let per_cpu = latency.get(&idx, 0).map_err(map_err("blk_latency"))?;
                let mut s = DiskOpStats::default();
                for cpu in per_cpu.iter() {
                    s.add_cpu(cpu);
                }
                s.add_cpu(&nested.get(&idx, 0).map_err(map_err("blk_latency_nested"))?);
                if s.ios > 0 || s.bytes > 0 {
                    snap.stats.insert((Dev(d.dev), *op), s);
                }
            }
        }
        let vm_latency: PerCpuHashMap<_, VmKey, BlkStats> = map_of(&self.ebpf, "vm_latency")?;
        let vm_nested: HashMap<_, VmKey, BlkStats> = map_of(&self.ebpf, "vm_latency_nested")?;
        let key = |k: &VmKey| VmStatKey {
            vm: k.vm,
            dev: Dev(k.dev),
            op: Op::from_index(k.op as usize).unwrap_or(Op::Other),
            vdisk: k.vdisk,
        };
        for item in vm_latency.iter() {
            let (k, per_cpu) = item.map_err(map_err("vm_latency"))?;
            let s = snap.vm_stats.entry(key(&k)).or_default();
            for cpu in per_cpu.iter() {
                s.add_cpu(cpu);
            }
        }
        for item in vm_nested.iter() {
            let (k, v) = item.map_err(map_err("vm_latency_nested"))?;
            snap.vm_stats.entry(key(&k)).or_default().add_cpu(&v);
        }
        let undelivered: HashMap<_, VmKey, u64> = map_of(&self.ebpf, "vm_undelivered")?;
        for item in undelivered.iter() {
            let (k, n) = item.map_err(map_err("vm_undelivered"))?;
            snap.vm_stats.entry(key(&k)).or_default().undelivered += n;
        }
        // The counts of the VMs known by their slots (an array by slot
        // modulo its size).
        let counts: PerCpuArray<_, VmCounts> = map_of(&self.ebpf, "vm_counts")?;
        let pids: HashMap<_, u32, VmProc> = map_of(&self.ebpf, "vm_pids")?;
        let mut slots: std::collections::BTreeSet<u32> = pids
            .iter()
            .filter_map(Result::ok)
            .map(|(_, p)| p.slot)
            .collect();
        slots.extend(snap.vm_stats.keys().map(|k| k.vm));
        for vm in slots {
            let per_cpu = counts
                .get(&(vm % MAX_VM_COUNTS), 0)
                .map_err(map_err("vm_counts"))?;
            let c = sum_counts(&per_cpu);
            if c != VmCounts::default() {
                snap.vm_counts.insert(vm, c);
            }
        }
        for (k, st) in &self.retired.vm_stats {
            snap.vm_stats.entry(*k).or_default().merge(st);
        }
        for (vm, c) in &self.retired.vm_counts {
            snap.vm_counts.entry(*vm).or_default().add(c);
        }
        snap.counters = self.counters()?;
        Ok(snap)
    }

    /// A raw tracepoint's program, in the probes' flavour (tp_btf or
    /// raw_tp), kept among the attachments.
    fn attach_raw(&mut self, tracepoint: &str) -> Result<(), LoadError> {
        let a = attach(&mut self.ebpf, self.btf.as_ref(), tracepoint, self.flavour)?;
        log::info!("attached {} via {}", a.tracepoint, a.flavour.as_str());
        self.attachments.push(a);
        Ok(())
    }

    /// A wake-up tracepoint's program and the second one that runs what
    /// the kernel skipped of it (`bpf/include/nesting.bpf.h`), for the
    /// probes' lifetime.
    fn attach_wakeups(&mut self, tracepoint: &str) -> Result<(), LoadError> {
        self.attach_raw(tracepoint)?;
        self.attach_nested(tracepoint).map(drop)
    }

    /// The second program of a wake-up tracepoint, with its link.
    fn attach_nested(&mut self, tracepoint: &str) -> Result<RawLink, LoadError> {
        let (a, link) = crate::probes::attach_program_linked(
            &mut self.ebpf,
            self.btf.as_ref(),
            &nesting::second_program(tracepoint),
            tracepoint,
            self.flavour,
        )?;
        self.attachments.push(a);
        Ok(link)
    }

    /// A CATEGORY:NAME tracepoint program of the same name, attached for
    /// the probes' lifetime.
    fn attach_tracepoint(&mut self, category: &str, name: &str) -> Result<(), LoadError> {
        self.attach_tracepoint_linked(category, name).map(drop)
    }

    /// Fill of the kernel side's hash tables: (map, entries, capacity).
    /// Counted key by key: a few system calls per entry, so only at a
    /// /metrics refresh.
    pub fn map_fill(&self) -> Vec<(&'static str, u32, u32)> {
        use aya::maps::Map;
        let mut out = Vec::new();
        for (name, map) in self.ebpf.maps() {
            let data = match map {
                Map::HashMap(d)
                | Map::LruHashMap(d)
                | Map::PerCpuHashMap(d)
                | Map::PerCpuLruHashMap(d) => d,
                _ => continue,
            };
            let Ok(info) = data.info() else { continue };
            // Map names are the object's own: 'static in practice, but
            // borrowed here; keep the ones this agent knows.
            let Some(&known) = FILL_MAPS.iter().find(|m| **m == name) else {
                continue;
            };
            let n = crate::probes::count_keys(data.fd().as_fd(), info.key_size());
            out.push((known, n, info.max_entries()));
        }
        out.sort_unstable();
        out
    }

    fn counters(&self) -> Result<Counters, LoadError> {
        let counters: PerCpuArray<_, u64> = map_of(&self.ebpf, "counters")?;
        let sum = |i: u32| -> Result<u64, LoadError> {
            Ok(counters
                .get(&i, 0)
                .map_err(LoadError::map_op("counters"))?
                .iter()
                .sum())
        };
        let reruns = nesting::NESTED_WAKEUPS
            .iter()
            .map(|w| Ok((w.tracepoint, sum(w.rerun_counter)?)))
            .collect::<Result<Vec<_>, LoadError>>()?;
        let lost_runs = nesting::lost_program_runs(&self.program_stats(), &reruns);
        Ok(Counters {
            ringbuf_drops: sum(counter::RINGBUF_DROPS)?,
            disk_conflicts: sum(counter::DISK_CONFLICTS)?,
            slot_conflicts: sum(counter::SLOT_CONFLICTS)?,
            no_start: sum(counter::NO_START)?,
            no_issue: sum(counter::NO_ISSUE)?,
            bpf_recursion_misses: lost_runs.values().sum(),
            bpf_recursion_misses_by_program: lost_runs,
            unseen: 0,
            undelivered: sum(counter::UNDELIVERED)?,
            partial_pieces: sum(counter::PARTIAL_PIECES)?,
            requeue_events: sum(counter::REQUEUES)?,
            records_streamed: sum(counter::SAMPLED)?,
            join_deferred: sum(counter::JOIN_DEFERRED)?,
            vm_table_full: sum(counter::VM_TABLE_FULL)?,
            scsi_cmds_unfollowed: sum(counter::ACTING_FULL)?,
            host_split: Default::default(),
            qemu_mismatch: 0,
        })
    }

    /// Read-only handles of its own on each VM's request counts, for a
    /// thread beside the probes' owner (QEMU's counters are read there,
    /// and ours with them at the same moment).
    pub fn vm_counts_reader(&self) -> Result<VmCountsReader, LoadError> {
        let counts = PerCpuArray::try_from(self.dup_map("vm_counts")?);
        let latency = PerCpuHashMap::try_from(self.dup_map("vm_latency")?);
        let nested = HashMap::try_from(self.dup_map("vm_latency_nested")?);
        let undelivered = HashMap::try_from(self.dup_map("vm_undelivered")?);
        let err = |map| {
            move |e| LoadError::Map {
                map,
                source: Some(e),
            }
        };
        Ok(VmCountsReader {
            counts: counts.map_err(err("vm_counts"))?,
            latency: latency.map_err(err("vm_latency"))?,
            nested: nested.map_err(err("vm_latency_nested"))?,
            undelivered: undelivered.map_err(err("vm_undelivered"))?,
        })
    }

    /// A map of the object on a file descriptor of its own.
    fn dup_map(&self, name: &'static str) -> Result<aya::maps::Map, LoadError> {
        let err = |e| LoadError::Map {
            map: name,
            source: e,
        };
        let Some(map) = self.ebpf.map(name) else {
            return Err(err(None));
        };
        let (data, wrap): (&MapData, fn(MapData) -> aya::maps::Map) = match map {
            aya::maps::Map::PerCpuArray(d) => (d, aya::maps::Map::PerCpuArray),
            aya::maps::Map::PerCpuHashMap(d) => (d, aya::maps::Map::PerCpuHashMap),
            aya::maps::Map::HashMap(d) => (d, aya::maps::Map::HashMap),
            _ => return Err(err(None)),
        };
        let fd = data.fd().as_fd().try_clone_to_owned().map_err(|e| {
            err(Some(aya::maps::MapError::from(aya::sys::SyscallError {
                call: "dup",
                io_error: e,
            })))
        })?;
        Ok(wrap(MapData::from_fd(fd).map_err(|e| err(Some(e)))?))
    }

    pub fn program_stats(&self) -> Vec<crate::probes::progstats::ProgStats> {
        crate::probes::program_stats(&self.ebpf)
    }
}

/// The ring buffer's size. A record of every I/O (the deep tier, or
/// `--events-out`) at a loaded host's full rate (~30 MB/s) must ride out
/// the agent waiting for a CPU for half a second; the always-on tier's
/// sampled records (and the streams of VMs whose guest agent joins them)
/// need less, and every page of the ring becomes the
/// agent's resident memory (twice: it is mapped twice) as the producer
/// goes round. An always-on agent a deep API run switches later keeps the
/// small ring: what it cannot hold is counted as `ringbuf_drops`.
fn events_ring_bytes(deep: bool, stream_devs: u32) -> u32 {
    if deep || stream_devs > 0 {
        16 << 20
    } else {
        4 << 20
    }
}

/// VMs running now get slots 1..; a QEMU exec'd later takes the next slot
/// itself, before its first request. Running VMs' guests have started:
/// their requests are the guests'.
fn add_running_vms(ebpf: &mut Ebpf, cfg: &BlockConfig) -> Result<(), LoadError> {
    let mut pids: HashMap<_, u32, VmProc> = map_mut_of(ebpf, "vm_pids")?;
    for (i, pid) in cfg.vm_pids.iter().enumerate() {
        let p = VmProc {
            slot: i as u32 + 1,
            state: VM_PROC_RUNNING,
        };
        pids.insert(pid, p, 0)
            .map_err(LoadError::map_op("vm_pids"))?;
    }
    add_vm_maps(ebpf, &cfg.vm_maps)
}
