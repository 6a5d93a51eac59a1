//! Host block-layer probes (`bpf/block.bpf.c`).

use std::{collections::BTreeMap, os::fd::AsFd};

use aya::{
    maps::{Array, HashMap, MapData, PerCpuArray, PerCpuHashMap, RingBuf},
    programs::{
        uprobe::{UProbeLinkId, UProbeScope},
        TracePoint, UProbe,
    },
    Btf, Ebpf, EbpfLoader,
};
use serde::{Deserialize, Serialize};

use super::{attach, map_mut_of, map_of, Attachment, Flavour, LoadError};
use crate::{
    abi::{
        counter, BlkStats, DiskSlot, RqSlot, VmCounts, VmKey, BLK_NR_OPS, DEFAULT_MAX_DISKS,
        MAX_STREAM_DEVS, NR_DIO_END_IO, RQ_F_DONE, RQ_F_REQUEUE_PENDING,
    },
    discover::disks::Dev,
    discover::vms::VmMaps,
    model::{DiskOpStats, Op},
};

/// The hash tables whose fill /metrics shows.
const FILL_MAPS: &[&str] = &[
    "vm_pids",
    "vm_counts",
    "vm_undelivered",
    "vdisk_files",
    "vm_latency",
    "vm_latency_nested",
    "vm_disks",
    "pending_kicks",
    "vq_notifiers",
    "thread_picks",
    "vm_last_pick",
    "vhost_kicks",
    "vhost_kick_files",
    "kvm_notify_addrs",
    "vm_started",
    "vm_open_notifiers",
];

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/block.bpf.o"));

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
        }
    }
}

/// Lost or degraded events, summed over CPUs. Every one of them is shown.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Per-request records the ring buffer had no room for.
    pub ringbuf_drops: u64,
    /// Requests of a disk whose slot another disk owns (raise --max-disks).
    pub disk_conflicts: u64,
    /// Requests whose in-flight slot was taken by another request.
    pub slot_conflicts: u64,
    /// Requests with no start time: queue unknown, total measured from issue.
    pub no_start: u64,
    /// Requests with no issue time (e.g. in flight when tracing began).
    pub no_issue: u64,
    /// Program invocations the kernel skipped because the program was
    /// already running on that CPU.
    pub bpf_recursion_misses: u64,
    /// Requests the kernel's own disk accounting completed but no
    /// completion tracepoint delivered to us (filled in by the run).
    #[serde(default)]
    pub unseen: u64,
    /// Issued requests whose completion never reached our program (seen
    /// when their tag came back in use): the kernel ran the tracepoint's
    /// other listeners but not ours, and counted it nowhere.
    #[serde(default)]
    pub undelivered: u64,
    /// Not losses: partial-completion pieces, requeue events and records
    /// streamed, for context.
    pub partial_pieces: u64,
    pub requeue_events: u64,
    pub records_streamed: u64,
    /// Requests of VMs whose (VM, disk, op) found the VM table full.
    #[serde(default)]
    pub vm_table_full: u64,
    /// VM requests whose host window could not be split (filled in by the run).
    #[serde(default)]
    pub host_split: crate::model::SplitCounters,
}

impl Counters {
    /// Every loss and degradation: (key, what it means, count). The key
    /// is the metric label and the JSON field; `unseen` is known only at a
    /// run's end.
    pub fn losses(&self) -> [(&'static str, &'static str, u64); 13] {
        let h = &self.host_split;
        [
            ("ringbuf_drops", "ring buffer drops", self.ringbuf_drops),
            (
                "disk_conflicts",
                "disk table conflicts",
                self.disk_conflicts,
            ),
            (
                "slot_conflicts",
                "in-flight slot conflicts",
                self.slot_conflicts,
            ),
            ("no_issue", "no issue time", self.no_issue),
            ("no_start", "no start time", self.no_start),
            (
                "bpf_recursion_misses",
                "skipped by the kernel (recursion)",
                self.bpf_recursion_misses,
            ),
            (
                "unseen",
                "completed but never delivered by the tracepoints",
                self.unseen,
            ),
            (
                "undelivered",
                "issued, completion never delivered",
                self.undelivered,
            ),
            ("vm_table_full", "VM table full", self.vm_table_full),
            ("no_kick", "VM requests without a kick", h.no_kick),
            ("no_signal", "VM requests without a signal", h.no_signal),
            ("unordered", "VM requests out of order", h.unordered),
            (
                "not_followed",
                "VM requests of disks not followed",
                h.not_followed,
            ),
        ]
    }
}

/// One read of the kernel's aggregates: cumulative since load.
#[derive(Clone, Debug, Default)]
pub struct BlockSnapshot {
    pub stats: BTreeMap<(Dev, Op), DiskOpStats>,
    /// Requests VMs submitted, by VM, host disk, op and virtual disk.
    pub vm_stats: BTreeMap<VmStatKey, DiskOpStats>,
    /// VM slot -> its guest requests merged into others, and how many it
    /// started.
    pub vm_counts: BTreeMap<u32, VmCounts>,
    pub counters: Counters,
}

/// A VM's requests that have finished, over its disks and ops.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VmFinished {
    /// Completed, timed or not.
    pub done: u64,
    /// Of those, the ones whose completion never reached us.
    pub undelivered: u64,
}

impl BlockSnapshot {
    /// Per VM slot: its finished requests (see `VmFinished`).
    pub fn vm_finished(&self) -> BTreeMap<u32, VmFinished> {
        let mut out: BTreeMap<u32, VmFinished> = BTreeMap::new();
        for (k, s) in &self.vm_stats {
            let f = out.entry(k.vm).or_default();
            f.done += s.ios + s.undelivered;
            f.undelivered += s.undelivered;
        }
        out
    }
}

/// Request-based (blk-mq) disks whose requests get no start_time_ns from
/// the kernel: it is kept when iostats is on or an I/O scheduler (or
/// blk-stat) is in use (blk_mq_need_time_stamp), so these have iostats off
/// and no scheduler. Bio-based disks (zram, dm-linear) have no requests.
pub fn disks_without_start_time() -> Vec<String> {
    let read = |d: &str, f: &str| {
        std::fs::read_to_string(format!("/sys/block/{d}/queue/{f}")).unwrap_or_default()
    };
    crate::discover::disks::whole_disks()
        .into_iter()
        .filter(|d| {
            if !std::path::Path::new(&format!("/sys/block/{d}/mq")).exists() {
                return false;
            }
            let sched = read(d, "scheduler");
            read(d, "iostats").trim() == "0"
                && (sched.trim().is_empty() || sched.contains("[none]"))
        })
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct VmStatKey {
    /// VM slot (see `BlockProbes::vm_pids`).
    pub vm: u32,
    pub dev: Dev,
    pub op: Op,
    /// Virtual disk slot; 0 for the VM process's other I/O.
    pub vdisk: u32,
}

/// Kernel addresses of the direct-I/O completion functions whose bios lead
/// to their file (0 where a symbol is absent: those requests stay
/// unresolved, never misattributed).
fn dio_end_io_addresses() -> [u64; NR_DIO_END_IO] {
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

/// Syscall tracepoints are attached through tracefs; a host that has not
/// mounted it gets it mounted (as perf and bpftrace do).
/// Whether the kvm tracepoints exist (the kvm module is loaded).
fn kvm_tracepoints() -> bool {
    mount_tracefs();
    [
        "/sys/kernel/tracing/events/kvm/kvm_mmio",
        "/sys/kernel/debug/tracing/events/kvm/kvm_mmio",
    ]
    .iter()
    .any(|p| std::path::Path::new(p).exists())
}

fn mount_tracefs() {
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

fn insert_all<K: aya::Pod>(
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

fn add_vm_maps(ebpf: &mut Ebpf, maps: &VmMaps) -> Result<(), LoadError> {
    insert_all(ebpf, "vdisk_files", &maps.files)?;
    insert_all(ebpf, "vm_disks", &maps.disks)
}

pub struct BlockProbes {
    ebpf: Ebpf,
    pub attachments: Vec<Attachment>,
    max_disks: u32,
    flavour: Flavour,
    btf: Option<Btf>,
    start_probe: bool,
    vm_segments: bool,
    vm_probes: bool,
    handoff_probe: bool,
    vhost_probes: bool,
    /// Each VM process's uprobe links: (program, link).
    vm_links: std::collections::HashMap<u32, Vec<(&'static str, UProbeLinkId)>>,
}

impl BlockProbes {
    /// Loads and attaches every block program on tp_btf, or, if any of
    /// them will not, all of them on raw_tp: the two flavours key in-flight
    /// requests the same way, but one flavour for all keeps cost and
    /// behaviour uniform.
    pub fn load(cfg: &BlockConfig) -> Result<Self, LoadError> {
        let btf = Btf::from_sys_fs().ok();
        match Self::load_flavour(cfg, btf.as_ref(), Flavour::TpBtf) {
            Ok(p) => Ok(p),
            Err(e) => {
                log::info!(
                    "tp_btf block probes unavailable ({}); using raw_tp",
                    super::error_chain(&e)
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
        let next_vm = cfg.vm_pids.len() as u32;
        let dio_end_io = dio_end_io_addresses();
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
            .map_max_entries("blk_latency", max_disks * BLK_NR_OPS as u32)
            .map_max_entries("blk_latency_nested", max_disks * BLK_NR_OPS as u32)
            .map_max_entries("disk_queues", max_disks)
            .load(OBJECT)
            .map_err(|source| LoadError::Object {
                object: "block.bpf.o",
                source,
            })?;

        let mut attachments = Vec::new();
        // VMs running now get slots 1..; a QEMU exec'd later takes the next
        // slot itself, before its first request.
        if cfg.track_vms {
            let mut pids: HashMap<_, u32, u32> = map_mut_of(&mut ebpf, "vm_pids")?;
            for (i, pid) in cfg.vm_pids.iter().enumerate() {
                pids.insert(pid, i as u32 + 1, 0)
                    .map_err(LoadError::map_op("vm_pids"))?;
            }
            // Running VMs' guests have started: their requests are the guests'.
            let mut started: HashMap<_, u32, u8> = map_mut_of(&mut ebpf, "vm_started")?;
            for pid in &cfg.vm_pids {
                started
                    .insert(pid, 1, 0)
                    .map_err(LoadError::map_op("vm_started"))?;
            }
            attachments.push(attach(&mut ebpf, btf, "sched_process_exec", flavour)?);
            add_vm_maps(&mut ebpf, &cfg.vm_maps)?;
        }
        for tp in ["block_rq_issue", "block_rq_requeue", "block_rq_complete"] {
            attachments.push(attach(&mut ebpf, btf, tp, flavour)?);
        }
        let mut probes = Self {
            ebpf,
            attachments,
            max_disks,
            flavour,
            btf: btf.cloned(),
            start_probe: false,
            vm_segments: vm_segments != 0,
            vm_probes: false,
            handoff_probe: false,
            vhost_probes: false,
            vm_links: Default::default(),
        };
        // The start probe takes each request's submitter, in the submitting
        // task (completions run under unrelated tasks), and stamps starts
        // where the kernel keeps none. Needed once there is a VM (the run
        // attaches it when the first one appears) or such a disk; until
        // then each request costs one program run less. Disks without
        // start times added later are counted as `no_start`.
        if cfg.start_stamps || !disks_without_start_time().is_empty() {
            probes.ensure_start_probe()?;
        }
        // A new VM creates its queue notifiers possibly before the agent
        // notices it: watched from the start (rare; nothing per I/O).
        if probes.vm_segments {
            for name in [
                "sys_exit_eventfd2",
                "sys_exit_eventfd",
                "sys_enter_ioctl",
                "sys_enter_close",
            ] {
                probes.attach_syscall(name)?;
            }
            // KVM's own view of the kicks, where the kvm module is loaded.
            if kvm_tracepoints() {
                for name in ["kvm_mmio", "kvm_fast_mmio"] {
                    probes.attach_tracepoint("kvm", name)?;
                }
            } else {
                log::info!("no kvm tracepoints (kvm module not loaded): kicks of KVM guests are not followed");
            }
        }
        if !cfg.vm_pids.is_empty() {
            probes.ensure_vm_probes()?;
        }
        Ok(probes)
    }

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

    /// The ring buffer of per-request records, for one consumer.
    pub fn take_events(&mut self) -> Result<RingBuf<MapData>, LoadError> {
        let map = self.ebpf.take_map("events").ok_or(LoadError::Map {
            map: "events",
            source: None,
        })?;
        RingBuf::try_from(map).map_err(LoadError::map_op("events"))
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
        let counts: HashMap<_, u32, VmCounts> = map_of(&self.ebpf, "vm_counts")?;
        for item in counts.iter() {
            let (vm, c) = item.map_err(map_err("vm_counts"))?;
            snap.vm_counts.insert(vm, c);
        }
        snap.counters = self.counters()?;
        Ok(snap)
    }

    /// Attaches the per-request start probe if it is not yet: stamps where
    /// the kernel keeps no start time, and the submitter for VM attribution.
    /// block_io_start appeared in v6.5 (5a80bd075f3b); before it the insert
    /// is the closest point.
    pub fn ensure_start_probe(&mut self) -> Result<(), LoadError> {
        if self.start_probe {
            return Ok(());
        }
        if let Err(e) = self.attach_raw("block_io_start") {
            log::info!(
                "{}; using block_rq_insert for start stamps",
                super::error_chain(&e)
            );
            self.attach_raw("block_rq_insert")?;
        }
        self.start_probe = true;
        Ok(())
    }

    /// What a VM needs: the start probe (its requests' submitter) and, for
    /// the host-window split, the eventfd read/write tracepoints. Attached
    /// when the first VM appears; without VMs no request pays for them.
    pub fn ensure_vm_probes(&mut self) -> Result<(), LoadError> {
        self.ensure_start_probe()?;
        if self.vm_probes {
            return Ok(());
        }
        // Bios merged into a VM's requests: guest requests with no host
        // request of their own.
        for name in ["block_bio_backmerge", "block_bio_frontmerge"] {
            self.attach_tracepoint("block", name)?;
        }
        // Whole requests merged into others before issue.
        self.attach_raw("block_rq_merge")?;
        if self.vm_segments {
            for name in ["sys_enter_write", "sys_enter_read"] {
                self.attach_syscall(name)?;
            }
        }
        self.vm_probes = true;
        Ok(())
    }

    /// The hand-off of kicks from the engine thread to the worker threads
    /// it wakes (aio=threads). Costs a program run per wake-up on the whole
    /// host, so attached only once a VM needs it.
    pub fn ensure_handoff_probe(&mut self) -> Result<(), LoadError> {
        if !self.vm_segments || self.handoff_probe {
            return Ok(());
        }
        for tp in ["sched_waking", "sched_wakeup_new"] {
            self.attach_raw(tp)?;
        }
        self.handoff_probe = true;
        Ok(())
    }

    /// What a kernel vhost worker's disks need: the worker's switch-in
    /// after a kick (its pickup) and the MSI it raises through the irqfd
    /// (the end of its host windows). The switch costs a program run per
    /// context switch on the whole host, so attached only once a VM needs
    /// it.
    pub fn ensure_vhost_probes(&mut self) -> Result<(), LoadError> {
        if !self.vm_segments || self.vhost_probes {
            return Ok(());
        }
        self.attach_raw("sched_switch")?;
        self.attach_tracepoint("kvm", "kvm_msi_set_irq")?;
        self.vhost_probes = true;
        Ok(())
    }

    /// A raw tracepoint's program, in the probes' flavour (tp_btf or
    /// raw_tp), kept among the attachments.
    fn attach_raw(&mut self, tracepoint: &str) -> Result<(), LoadError> {
        let a = attach(&mut self.ebpf, self.btf.as_ref(), tracepoint, self.flavour)?;
        log::info!("attached {} via {}", a.tracepoint, a.flavour.as_str());
        self.attachments.push(a);
        Ok(())
    }

    /// A syscalls:NAME tracepoint program of the same name.
    fn attach_syscall(&mut self, name: &str) -> Result<(), LoadError> {
        self.attach_tracepoint("syscalls", name)
    }

    /// A CATEGORY:NAME tracepoint program of the same name.
    fn attach_tracepoint(&mut self, category: &str, name: &str) -> Result<(), LoadError> {
        mount_tracefs();
        let prog = self
            .ebpf
            .program_mut(name)
            .ok_or_else(|| LoadError::MissingProgram {
                program: name.into(),
            })?;
        let result = (|| -> Result<(), String> {
            let p: &mut TracePoint = prog.try_into().map_err(|e| format!("{e:#}"))?;
            p.load().map_err(|e| super::error_chain(&e))?;
            p.attach(category, name)
                .map_err(|e| super::error_chain(&e))?;
            Ok(())
        })();
        let tracepoint = format!("{category}:{name}");
        result.map_err(|reason| LoadError::Attach {
            tracepoint: tracepoint.clone(),
            flavour: "tracepoint",
            reason,
        })?;
        log::info!("attached {tracepoint} via tracepoint");
        self.attachments.push(Attachment {
            tracepoint,
            flavour: Flavour::Tracepoint,
            program: name.into(),
        });
        Ok(())
    }

    /// A VM's probes in QEMU (see `Vm::uprobe_symbols`), on its process
    /// only: other processes of the binary pay nothing. Kept per VM, to be
    /// detached when it exits (`forget_vm`).
    pub fn attach_vm_uprobes(&mut self, vm: &crate::discover::vms::Vm) -> Result<(), LoadError> {
        let symbols = vm.uprobe_symbols(self.vm_segments);
        self.attach_uprobes(vm.exe.as_deref(), vm.pid, &symbols)
    }

    /// An engine process serving VM `slot`'s disks from outside QEMU: its
    /// requests, kick pickups and used-ring pushes are the VM's from now
    /// on (it runs only to serve them). Undone by `forget_vm(pid, slot)`.
    pub fn add_engine(
        &mut self,
        e: &crate::discover::vms::EngineRef,
        slot: u32,
    ) -> Result<(), LoadError> {
        let mut pids: HashMap<_, u32, u32> = map_mut_of(&mut self.ebpf, "vm_pids")?;
        pids.insert(e.pid, slot, 0)
            .map_err(LoadError::map_op("vm_pids"))?;
        self.flag_vm("vm_started", e.pid)?;
        let symbols = e.uprobe_symbols(self.vm_segments);
        self.attach_uprobes(e.exe.as_deref(), e.pid, &symbols)
    }

    fn attach_uprobes(
        &mut self,
        exe: Option<&std::path::Path>,
        pid: u32,
        symbols: &[(&'static str, bool)],
    ) -> Result<(), LoadError> {
        let Some(exe) = exe else {
            return Ok(());
        };
        let Some(nz) = std::num::NonZeroU32::new(pid) else {
            return Ok(());
        };
        for &(symbol, hot) in symbols {
            let site = format!("{}:{symbol}", exe.display());
            let (offset, prologue) =
                crate::probes::uprobe::uprobe_site(exe, symbol).ok_or_else(|| {
                    LoadError::Attach {
                        tracepoint: format!("uprobe {site}"),
                        flavour: "uprobe",
                        reason: format!("{symbol} is not exported by {}", exe.display()),
                    }
                })?;
            if hot && prologue != crate::probes::uprobe::Prologue::Push {
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
                    p.load().map_err(|e| super::error_chain(&e))?;
                }
                p.attach(
                    aya::programs::uprobe::UProbeAttachLocation::SymbolOffset(symbol, offset),
                    exe,
                    UProbeScope::OneProcess(nz),
                )
                .map_err(|e| super::error_chain(&e))
            })();
            let link = result.map_err(|reason| LoadError::Attach {
                tracepoint: format!("uprobe {site}"),
                flavour: "uprobe",
                reason,
            })?;
            self.vm_links.entry(pid).or_default().push((symbol, link));
            log::info!("attached uprobe {site}+{offset} for pid {pid}");
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
        for (symbol, link) in self.vm_links.remove(&pid).unwrap_or_default() {
            if let Some(prog) = self.ebpf.program_mut(symbol) {
                let p: &mut UProbe = prog.try_into().map_err(|_| LoadError::MissingProgram {
                    program: symbol.into(),
                })?;
                p.detach(link).map_err(|e| LoadError::Attach {
                    tracepoint: format!("uprobe {symbol} of pid {pid}"),
                    flavour: "uprobe",
                    reason: super::error_chain(&e),
                })?;
            }
        }
        // Absent keys are fine: not every VM has every flag. A pid already
        // taken by a new VM (exec'd since) is that VM's.
        let mut pids: HashMap<_, u32, u32> = map_mut_of(&mut self.ebpf, "vm_pids")?;
        if pids.get(&pid, 0).ok() != Some(slot) {
            return Ok(());
        }
        let _ = pids.remove(&pid);
        for map in ["vm_started", "vm_notifiers_known", "vm_no_stop"] {
            let mut m: HashMap<_, u32, u8> = map_mut_of(&mut self.ebpf, map)?;
            let _ = m.remove(&pid);
        }
        let mut open: HashMap<_, u32, i64> = map_mut_of(&mut self.ebpf, "vm_open_notifiers")?;
        let _ = open.remove(&pid);
        Ok(())
    }

    /// Tells the kernel side about a new VM's virtual disks.
    pub fn add_vm_maps(&mut self, maps: &VmMaps) -> Result<(), LoadError> {
        add_vm_maps(&mut self.ebpf, maps)
    }

    /// Takes the VM's requests as its guest's from now on, for a VM whose
    /// vCPU threads cannot be told apart (no `debug-threads=on`).
    pub fn mark_started(&mut self, pid: u32) -> Result<(), LoadError> {
        self.flag_vm("vm_started", pid)
    }

    /// The VM stays running through its notifiers all closing (none of its
    /// disks is notified through one; see vm_no_stop).
    pub fn exempt_from_stop(&mut self, pid: u32) -> Result<(), LoadError> {
        self.flag_vm("vm_no_stop", pid)
    }

    /// Sets `pid` -> 1 in one of the per-VM flag maps.
    fn flag_vm(&mut self, map: &'static str, pid: u32) -> Result<(), LoadError> {
        let mut m: HashMap<_, u32, u8> = map_mut_of(&mut self.ebpf, map)?;
        m.insert(pid, 1, 0).map_err(LoadError::map_op(map))
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
            let n = super::count_keys(data.fd().as_fd(), info.key_size());
            out.push((known, n, info.max_entries()));
        }
        out.sort_unstable();
        out
    }

    /// (tgid, VM slot) of every process known as a VM so far.
    pub fn vm_pids(&self) -> Result<Vec<(u32, u32)>, LoadError> {
        let map: HashMap<_, u32, u32> = map_of(&self.ebpf, "vm_pids")?;
        map.iter()
            .map(|r| r.map_err(LoadError::map_op("vm_pids")))
            .collect()
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
        Ok(Counters {
            ringbuf_drops: sum(counter::RINGBUF_DROPS)?,
            disk_conflicts: sum(counter::DISK_CONFLICTS)?,
            slot_conflicts: sum(counter::SLOT_CONFLICTS)?,
            no_start: sum(counter::NO_START)?,
            no_issue: sum(counter::NO_ISSUE)?,
            bpf_recursion_misses: self
                .program_stats()
                .iter()
                .map(|p| p.recursion_misses)
                .sum(),
            unseen: 0,
            undelivered: sum(counter::UNDELIVERED)?,
            partial_pieces: sum(counter::PARTIAL_PIECES)?,
            requeue_events: sum(counter::REQUEUES)?,
            records_streamed: sum(counter::SAMPLED)?,
            vm_table_full: sum(counter::VM_TABLE_FULL)?,
            host_split: Default::default(),
        })
    }

    pub fn program_stats(&self) -> Vec<super::progstats::ProgStats> {
        super::program_stats(&self.ebpf)
    }
}
