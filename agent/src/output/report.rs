//! The run report: the `iospan.run/v1` JSON contract and its terminal table.

use std::{collections::BTreeMap, fmt::Write as _};

use serde::{Deserialize, Serialize};

use crate::{
    abi::VmCounts,
    discover::disks::{self, Dev},
    discover::diskstats::{DiskStat, KernelCount},
    discover::vms::{KickSource, Registry},
    model::block::{Counters, VmFinished, VmStatKey},
    model::ChannelStats,
    model::SplitWindow,
    model::{BlkSegment, DiskOpStats, Hist, Op, Summary},
    pipeline::clock::ClockEstimate,
    pipeline::correlate::{Correlator, SplitKey},
    pipeline::stitch::{StitchCounters, StitchKey, Stitcher},
    probes::{progstats::ProgStats, Attachment},
};

pub const SCHEMA: &str = "iospan.run/v1";

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RunReport {
    pub schema: String,
    /// The tier VMs were measured in (none without VM attribution).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<crate::model::Tier>,
    pub duration_s: f64,
    /// The traced command, when there was one, and how it ended.
    pub command: Option<Vec<String>>,
    pub exit_code: Option<i32>,
    /// Everything lost or degraded; see `Counters`.
    pub lost: Counters,
    pub probes: Vec<Attachment>,
    pub agent: AgentCost,
    /// Guest agents heard from, per VM.
    #[serde(default)]
    pub guests: Vec<GuestSummary>,
    /// Guest and host requests not joined (see `stitch::StitchCounters`).
    #[serde(default)]
    pub stitch: StitchCounters,
    /// Per-I/O traces: offered, chosen, exported, dropped, failed (when
    /// exporting).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub export: Option<crate::output::export::ExportCounters>,
    /// The VMs seen during the run.
    #[serde(default)]
    pub vms: Vec<VmSummary>,
    /// QEMU processes that were not VMs (capability probes, processes gone
    /// before they could be named): their requests are the host's.
    #[serde(default)]
    pub not_vms: u64,
    pub entries: Vec<Entry>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VmSummary {
    pub name: String,
    /// Its UUID (`-uuid`; libvirt's domain UUID).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    pub pid: u32,
    /// Virtual disk ids (libvirt's aliases).
    pub disks: Vec<String>,
    /// Per virtual disk, the names its users know it by and where it lives.
    #[serde(default)]
    pub vdisks: Vec<VDiskSummary>,
    /// The libvirt domain, when libvirt runs the VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub libvirt_domain: Option<String>,
    pub kicks: KickSource,
    /// Its requests whose completion never reached us (not in `entries`).
    #[serde(default)]
    pub undelivered: u64,
    /// Guest requests that reached the host inside another request, not
    /// as one of their own: merged by QEMU (virtio-blk merges adjacent
    /// requests of one batch) ...
    #[serde(default)]
    pub engine_merged: u64,
    /// ... or by the host block layer (a bio merged into a request).
    /// A VM's requests in `entries` plus these are its guest's requests.
    #[serde(default)]
    pub host_merged: u64,
    /// Per virtual disk, the process that serves it: QEMU itself, or an
    /// engine outside it (vhost-user: qemu-storage-daemon). Its engine
    /// segment is that process's time.
    #[serde(default)]
    pub engines: Vec<DiskEngine>,
    /// Where QEMU's own counters of its disks were read, or why not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qemu_counts: Option<String>,
    /// The deep tier: how long its vCPUs waited for a CPU to take the
    /// interrupts its engines raised.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpu_waits: Option<VcpuWaits>,
}

/// A VM's interrupts and its vCPUs' waits for a CPU to take them: from a
/// raise (or a vCPU's wake-up after it) to that vCPU's run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct VcpuWaits {
    /// Interrupts raised for the guest.
    pub raises: u64,
    /// Of those, the ones whose vCPU had to wait for a CPU.
    pub waited: u64,
    /// The waits in all, µs.
    pub wait_us: f64,
}

/// A virtual disk: its id (libvirt's alias), its target dev, its backing
/// and the host disks under it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VDiskSummary {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_dev: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backing: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iothread: Option<String>,
    /// A device-mapper backing's stack: the dm device, then the physical
    /// disks under it, whose block layer the device segment times.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub host_stack: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskEngine {
    pub disk: String,
    pub program: String,
    pub pid: u32,
    /// The engine's export serving it (outside QEMU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub export: Option<String>,
    /// Why its host windows are not split, where they are not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_split: Option<String>,
}

pub fn guests(known: &Registry, stitch: &Stitcher) -> Vec<GuestSummary> {
    stitch
        .channels
        .iter()
        .map(|(slot, ch)| GuestSummary {
            vm: known.name(*slot),
            channel: ch.clone(),
            clock: stitch.clocks.get(slot).and_then(|c| c.estimate()),
        })
        .collect()
}

pub fn vms(
    known: &Registry,
    counts: &BTreeMap<u32, VmCounts>,
    finished: &BTreeMap<u32, VmFinished>,
) -> Vec<VmSummary> {
    known
        .vms
        .iter()
        .map(|(slot, v)| {
            let c = counts.get(slot).copied().unwrap_or_default();
            VmSummary {
                name: v.name.clone(),
                uuid: v.uuid.clone(),
                pid: v.pid,
                disks: v.disks.iter().map(|d| d.id.clone()).collect(),
                vdisks: v
                    .disks
                    .iter()
                    .map(|d| VDiskSummary {
                        id: d.id.clone(),
                        target_dev: d.target_dev.clone(),
                        model: d.model.clone(),
                        backing: d.file.as_ref().map(|f| f.display().to_string()),
                        iothread: d.iothread.clone(),
                        host_stack: d.host_stack.clone(),
                    })
                    .collect(),
                libvirt_domain: v.libvirt.as_ref().map(|d| d.name.clone()),
                kicks: v.kicks,
                undelivered: finished.get(slot).map_or(0, |f| f.undelivered),
                engine_merged: c.engine_merges,
                host_merged: c.bio_merges,
                engines: v
                    .disks
                    .iter()
                    .map(|d| {
                        let (program, pid, export) = match &d.engine {
                            Some(e) => (e.program.clone(), e.pid, Some(e.export.clone())),
                            // The kernel's workers, threads of QEMU's process.
                            None if d.kernel_vhost() => {
                                (format!("vhost-{}", v.pid), v.pid, d.target.clone())
                            }
                            _ => (
                                v.exe
                                    .as_deref()
                                    .and_then(std::path::Path::file_name)
                                    .map_or_else(
                                        || "qemu".into(),
                                        |n| n.to_string_lossy().into_owned(),
                                    ),
                                v.pid,
                                None,
                            ),
                        };
                        DiskEngine {
                            disk: d.id.clone(),
                            program,
                            pid,
                            export,
                            not_split: d.split_support(v.kvm).err().map(str::to_string),
                        }
                    })
                    .collect(),
                qemu_counts: None,
                vcpu_waits: (c.raises > 0).then(|| VcpuWaits {
                    raises: c.raises,
                    waited: c.vcpu_waits,
                    wait_us: c.vcpu_wait_ns as f64 / 1e3,
                }),
            }
        })
        .collect()
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AgentCost {
    /// The agent process's own CPU over the run.
    pub cpu_user_s: f64,
    pub cpu_sys_s: f64,
    /// Kernel-side cost of the eBPF programs, when run-time stats were on.
    pub bpf: Option<Vec<ProgStats>>,
    /// The run's own cost per I/O it measured (`agent_per_io`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_io: Option<CostPerIo>,
}

/// What the run cost per I/O: the agent's CPU and (with run-time stats)
/// its eBPF programs', over the host requests it counted and the VM
/// requests among them. Not in it: what attached tracepoints cost the
/// rest of the host (the kernel's slow system-call path, while the deep
/// tier runs), which only a comparison with an untraced run shows
/// (`cargo xtask bench vm`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CostPerIo {
    /// Host requests counted (every disk's).
    pub ios: u64,
    /// Of those, VMs' requests.
    pub vm_ios: u64,
    pub agent_ns_per_io: f64,
    /// The eBPF programs' run time per I/O, with run-time stats on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bpf_ns_per_io: Option<f64>,
}

/// The run's cost per host request it counted.
pub fn agent_per_io(r: &RunReport) -> Option<CostPerIo> {
    let host: u64 = r
        .entries
        .iter()
        .filter(|e| e.vm.is_none())
        .map(|e| e.ios)
        .sum();
    let vm_ios: u64 = r
        .entries
        .iter()
        .filter(|e| e.vm.is_some())
        .map(|e| e.ios)
        .sum();
    // VMs' entries are their host disks' requests too: count each once.
    let ios = host.max(vm_ios);
    if ios == 0 {
        return None;
    }
    let per = |ns: f64| (ns / ios as f64 * 10.0).round() / 10.0;
    let agent_ns = (r.agent.cpu_user_s + r.agent.cpu_sys_s) * 1e9;
    Some(CostPerIo {
        ios,
        vm_ios,
        agent_ns_per_io: per(agent_ns),
        bpf_ns_per_io: r
            .agent
            .bpf
            .as_ref()
            .map(|progs| per(progs.iter().map(|p| p.run_time_ns as f64).sum())),
    })
}

/// One (vm, disk, op).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Entry {
    pub vm: Option<String>,
    /// The virtual disk's id for a VM's entry (the host disk's name for the
    /// VM process's requests that are none of its disks' — firmware, kernel
    /// images, buffered I/O not resolved to a file); the host disk for a
    /// host entry.
    pub disk: String,
    /// The host disk the requests went to.
    #[serde(default)]
    pub host_disk: String,
    /// A VM's virtual disk's target dev (`vda`), where libvirt names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_dev: Option<String>,
    pub op: Op,
    pub ios: u64,
    pub bytes: u64,
    pub iops: f64,
    pub mb_per_s: f64,
    pub errors: u64,
    pub requeued: u64,
    pub partial: u64,
    /// Requests the kernel completed whose completion never reached us
    /// (a VM's, found one by one): counted here, not in `ios` or the
    /// latencies, which they have none of.
    #[serde(default)]
    pub undelivered: u64,
    /// The kernel's own count for this disk and op over the run, where it
    /// keeps one (iostats on); `ios` below it means requests went unseen.
    pub kernel: Option<KernelCount>,
    pub total: Summary,
    pub segments: BTreeMap<String, Summary>,
    /// The requests joined with the guest agent's records: guest-observed
    /// latency (`total`) split into guest, hypervisor, engine and device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stitched: Option<StitchedEntry>,
    /// The host window's split per guest queue (virtqueue or NVMe queue),
    /// where the notifier its kick came through names the queue: host-side,
    /// with or without a guest agent (`stitched.queues` has the guest's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub queues: Vec<QueueEntry>,
    /// QEMU's own count and mean of the same requests, where its counters
    /// were read (`output::qemu_check`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qemu: Option<QemuCheck>,
    /// What limits it, why, and the setting that would move it
    /// (`output::diagnose`, docs/diagnosis.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diagnosis: Option<crate::model::diagnosis::Diagnosis>,
}

/// One VM disk and op: QEMU's count and mean beside iospan's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QemuCheck {
    /// QEMU's operations of this op on this disk over the run.
    pub ops: u64,
    pub bytes: u64,
    /// QEMU's mean per request, µs (its device model's request to its
    /// completion callback: engine + device).
    pub mean_us: Option<f64>,
    /// iospan's count of the same requests: timed plus undelivered.
    pub iospan_ops: u64,
    /// iospan's count less QEMU's.
    pub diff: i64,
    /// Guest requests iospan saw inside others (the VM's merges, over all
    /// its disks): QEMU counts each of them.
    pub merged_allowance: u64,
    /// Requests in flight at the run's edges, by which the two counts may
    /// honestly differ.
    pub edge_allowance: u64,
    /// The VM's requests submitted after its counters were last read (it
    /// exited within the run): ours, not QEMU's.
    #[serde(default)]
    pub after_last_read: u64,
    /// Its requests in flight when that last read began (submitted before
    /// the read ended, not finished before it began): QEMU's or not.
    #[serde(default)]
    pub in_flight_at_last_read: u64,
    /// A VM running before the run: its requests between the probes'
    /// start and QEMU's first read: ours, not QEMU's.
    #[serde(default)]
    pub before_first_read: u64,
    /// Whose count this is: `qemu` (its device model) or `engine` (the
    /// storage daemon serving the disk over vhost-user).
    #[serde(default)]
    pub counted_by: String,
    /// The engine keeps no count of the disk's requests (it read zero while
    /// ours saw some): nothing to compare, not a mismatch.
    #[serde(default)]
    pub uncounted: bool,
    /// iospan's engine + device mean for the same requests, µs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_device_mean_us: Option<f64>,
    /// The longest engine plus the longest device time of them, µs: no
    /// request's engine + device is longer, nor a request QEMU merged into
    /// one of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_device_max_us: Option<f64>,
    /// iospan's pickup → host completion mean, µs: engine + device less
    /// the engine's completion side. QEMU's callback, where its time
    /// ends, comes before it signals the guest (NVMe, iothreads) or after
    /// (virtio-blk in the main loop): its mean lies between the two.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pickup_to_done_mean_us: Option<f64>,
    /// The counts differ by more than merges and the edges explain.
    pub mismatch: bool,
}

impl QemuCheck {
    /// What the two counts may differ by, in words.
    pub fn allowances(&self) -> String {
        format!(
            "{} merged, {} in flight at the edges, {} before the first read, {} in flight at the last and {} after it",
            self.merged_allowance,
            self.edge_allowance,
            self.before_first_read,
            self.in_flight_at_last_read,
            self.after_last_read
        )
    }
}

/// Whether a VM's `qemu_counts` is worth a line of its own: no source, a
/// failed read, or a VM whose last read came before it exited.
pub fn qemu_counts_worth_saying(s: &str) -> bool {
    s.contains("none:") || s.contains("not read") || s.contains("exited within")
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StitchedEntry {
    pub count: u64,
    /// guest, hypervisor, engine, device, total.
    pub segments: BTreeMap<String, Summary>,
    /// The same per guest queue (virtqueue or NVMe queue pair).
    #[serde(default)]
    pub queues: Vec<QueueEntry>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct QueueEntry {
    pub queue: u32,
    pub count: u64,
    pub segments: BTreeMap<String, Summary>,
}

/// A host window's segments, as entries name them.
fn host_summaries(h: &SplitWindow) -> BTreeMap<String, Summary> {
    let mut segs = vec![
        ("hypervisor", &h.hypervisor),
        ("engine", &h.engine),
        ("device", &h.device),
        ("host_window", &h.window),
    ];
    if let Some(x) = &h.host {
        segs.extend([
            ("pickup_to_done", &x.pickup_to_done),
            ("hypervisor_cpu_wait", &x.hypervisor_cpu_wait),
            ("engine_cpu_wait", &x.engine_cpu_wait),
        ]);
    }
    summaries(segs)
}

fn segment_summaries(s: &SplitWindow) -> BTreeMap<String, Summary> {
    let mut segs: Vec<(&str, &Hist)> = s.guest.iter().map(|g| ("guest", g)).collect();
    segs.extend([
        ("hypervisor", &s.hypervisor),
        ("engine", &s.engine),
        ("device", &s.device),
        ("total", &s.window),
    ]);
    summaries(segs)
}

fn summaries(segs: Vec<(&str, &Hist)>) -> BTreeMap<String, Summary> {
    segs.into_iter()
        .map(|(n, h)| (n.to_string(), h.summary()))
        .collect()
}

/// One VM's guest agent over the run: its channel and its clock.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GuestSummary {
    pub vm: String,
    pub channel: ChannelStats,
    /// host = guest + offset, estimated from the joined requests.
    pub clock: Option<ClockEstimate>,
}

impl Entry {
    /// An entry of no requests: a disk and op that another party counted
    /// and iospan did not.
    pub fn empty(vm: Option<String>, disk: String, op: Op) -> Self {
        Self::from_stats(vm, disk, op, &DiskOpStats::default(), 0.0)
    }

    pub fn from_stats(
        vm: Option<String>,
        disk: String,
        op: Op,
        s: &DiskOpStats,
        duration_s: f64,
    ) -> Self {
        let per_s = |v: f64| {
            if duration_s > 0.0 {
                round3(v / duration_s)
            } else {
                0.0
            }
        };
        let mut segments = BTreeMap::new();
        segments.insert("queue".to_string(), s.segment(BlkSegment::Queue).summary());
        segments.insert(
            "service".to_string(),
            s.segment(BlkSegment::Service).summary(),
        );
        Entry {
            vm,
            host_disk: disk.clone(),
            disk,
            op,
            ios: s.ios,
            bytes: s.bytes,
            iops: per_s(s.ios as f64),
            mb_per_s: per_s(s.bytes as f64 / 1e6),
            errors: s.errors,
            requeued: s.requeued,
            undelivered: s.undelivered,
            partial: s.partial,
            kernel: None,
            target_dev: None,
            total: s.segment(BlkSegment::Total).summary(),
            segments,
            stitched: None,
            queues: Vec::new(),
            diagnosis: None,
            qemu: None,
        }
    }
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// Entries for the disks asked for (all when `only` is empty), sorted by
/// disk name then op, each with the kernel's own count beside it.
pub fn entries(
    stats: &BTreeMap<(Dev, Op), DiskOpStats>,
    kernel: &BTreeMap<Dev, DiskStat>,
    only: &[Dev],
    duration_s: f64,
) -> Vec<Entry> {
    let mut v: Vec<Entry> = stats
        .iter()
        .filter(|((dev, _), _)| only.is_empty() || only.contains(dev))
        .map(|((dev, op), s)| {
            let mut e = Entry::from_stats(None, disks::name_of(*dev), *op, s, duration_s);
            e.kernel = kernel.get(dev).and_then(|k| k.for_op(*op));
            e
        })
        .collect();
    v.sort_by(|a, b| (&a.disk, a.op).cmp(&(&b.disk, b.op)));
    v
}

/// Entries for the requests VMs submitted, named by VM and virtual disk.
pub fn vm_entries(
    stats: &BTreeMap<VmStatKey, DiskOpStats>,
    corr: &Correlator,
    vms: &Registry,
    only: &[Dev],
    duration_s: f64,
) -> Vec<Entry> {
    let mut v: Vec<Entry> = stats
        .iter()
        .filter(|(k, _)| only.is_empty() || only.contains(&k.dev))
        // Slots of QEMU processes that were not VMs: the host's requests.
        .filter(|(k, _)| vms.is_vm(k.vm))
        .map(|(k, s)| {
            let host = disks::name_of(k.dev);
            let disk = vms
                .vdisk(k.vdisk)
                .map_or_else(|| host.clone(), str::to_string);
            let mut e = Entry::from_stats(Some(vms.name(k.vm)), disk, k.op, s, duration_s);
            e.host_disk = host;
            e.target_dev = vms.vdisk_target(k.vdisk).map(str::to_string);
            let split_key = SplitKey {
                vm: k.vm,
                dev: k.dev,
                op: k.op,
                vdisk: k.vdisk,
            };
            if let Some(h) = corr.splits.get(&split_key) {
                e.segments.extend(host_summaries(h));
            }
            e.queues = corr
                .queue_splits
                .range((split_key, 0)..=(split_key, u32::MAX))
                .map(|((_, q), h)| QueueEntry {
                    queue: *q,
                    count: h.window.count,
                    segments: host_summaries(h),
                })
                .collect();
            let key = StitchKey {
                vm: k.vm,
                vdisk: k.vdisk,
                op: k.op,
            };
            if let Some(s) = corr.stitch.stitched.get(&key) {
                e.stitched = Some(StitchedEntry {
                    count: s.window.count,
                    segments: segment_summaries(s),
                    queues: corr
                        .stitch
                        .queues
                        .range((key, 0)..=(key, u32::MAX))
                        .map(|((_, q), s)| QueueEntry {
                            queue: *q,
                            count: s.window.count,
                            segments: segment_summaries(s),
                        })
                        .collect(),
                });
            }
            e
        })
        .collect();
    v.sort_by(|a, b| (&a.vm, &a.disk, a.op).cmp(&(&b.vm, &b.disk, b.op)));
    v
}

/// Requests the kernel completed on the traced disks that no completion
/// event brought us, summed over (disk, op). Ops we never saw on a disk
/// count too.
pub fn unseen(
    stats: &BTreeMap<(Dev, Op), DiskOpStats>,
    kernel: &BTreeMap<Dev, DiskStat>,
    only: &[Dev],
) -> u64 {
    kernel
        .iter()
        .filter(|(dev, _)| only.is_empty() || only.contains(dev))
        .flat_map(|(dev, k)| {
            Op::ALL.iter().filter_map(move |op| {
                let theirs = k.for_op(*op)?.ios;
                let mut ours = stats.get(&(*dev, *op)).map_or(0, |s| s.ios);
                if *op == Op::Write {
                    // The kernel files write-zeroes under writes.
                    ours += stats.get(&(*dev, Op::Other)).map_or(0, |s| s.ios);
                }
                Some(theirs.saturating_sub(ours))
            })
        })
        .sum()
}

impl RunReport {
    /// The terminal table: a row per (disk, op, segment), latencies in µs.
    pub fn table(&self) -> String {
        let mut out = String::new();
        // A virtual disk by the names its users know: libvirt's alias and
        // target dev (`virtio-disk0 vda`).
        let disk_label = |e: &Entry| match &e.target_dev {
            Some(t) => format!("{} {t}", e.disk),
            None => e.disk.clone(),
        };
        let vw = self
            .entries
            .iter()
            .filter_map(|e| e.vm.as_ref().map(|v| v.chars().count()))
            .max()
            .unwrap_or(0)
            .max(14);
        let dw = self
            .entries
            .iter()
            .map(|e| disk_label(e).chars().count())
            .max()
            .unwrap_or(0)
            .max(10);
        let _ = writeln!(
            out,
            "{:<vw$} {:<dw$} {:<7} {:>9} {:>10} {:>8}  {:<11} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "VM",
            "DISK",
            "OP",
            "IOS",
            "IOPS",
            "MB/s",
            "SEGMENT",
            "MEAN",
            "P50",
            "P90",
            "P99",
            "P99.9",
            "MAX"
        );
        if self.entries.is_empty() {
            let _ = writeln!(out, "(no block I/O completed on the traced disks)");
        }
        for e in &self.entries {
            entry_rows(&mut out, e, &disk_label(e), vw, dw);
        }
        self.table_notes(&mut out);
        out += &qemu_table(self);
        out += &self.diagnoses_text();
        out
    }

    /// Each VM disk's diagnosis, and each host disk's that names a
    /// bottleneck: a line per disk and op, then its evidence and knob.
    pub fn diagnoses_text(&self) -> String {
        let mut out = String::new();
        let shown: Vec<&Entry> = self
            .entries
            .iter()
            .filter(|e| {
                e.diagnosis
                    .as_ref()
                    .is_some_and(|d| e.vm.is_some() || d.segment.is_some())
            })
            .collect();
        if shown.is_empty() {
            return out;
        }
        let _ = writeln!(out, "\nWhat limits each disk (docs/diagnosis.md):");
        for e in shown {
            let Some(d) = &e.diagnosis else { continue };
            let at = d.segment.map_or(String::new(), |s| {
                let tail = d
                    .share_p99
                    .map_or(String::new(), |t| format!(", p99+ tail {:.0} %", t * 100.0));
                format!(
                    "{} ({:.0} % of the mean{tail}), ",
                    s.as_str(),
                    d.share_mean * 100.0
                )
            });
            let _ = writeln!(
                out,
                "{} {} {} — {at}{} confidence: {}",
                e.vm.as_deref().unwrap_or("host"),
                e.disk,
                e.op,
                d.confidence.as_str(),
                d.text().replace('\n', "\n  ")
            );
        }
        out
    }

    /// Beneath the table: the run's time and losses, QEMU processes that
    /// were not VMs, VMs whose kicks were taken from any eventfd.
    fn table_notes(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "latencies in µs over {:.2} s; {}",
            self.duration_s,
            self.lost_line()
        );
        let guessed: Vec<&str> = self
            .vms
            .iter()
            .filter(|v| v.kicks == KickSource::AnyVcpuEventfd)
            .map(|v| v.name.as_str())
            .collect();
        if self.not_vms > 0 {
            let _ = writeln!(
                out,
                "{} QEMU process{} ran no guest (capability probes, or gone before named): not VMs, their requests the host's",
                self.not_vms,
                if self.not_vms == 1 { "" } else { "es" }
            );
        }
        if !guessed.is_empty() {
            let _ = writeln!(
                out,
                "kicks of {} taken from any eventfd their vCPUs write (their queue notifiers not seen made: \
                 the always-on tier, or started before the deep tier watched); a request held in the engine \
                 may be given a later kick",
                guessed.join(", ")
            );
        }
    }
}

/// An entry's rows: its total, block segments, the host window's split
/// (with the owning threads' waits for a CPU), the window, then the guest
/// agent's view.
fn entry_rows(out: &mut String, e: &Entry, label: &str, vw: usize, dw: usize) {
    const ORDER: [(&str, &str); 8] = [
        ("queue", "queue"),
        ("service", "service"),
        ("hypervisor", "hypervisor"),
        ("hypervisor_cpu_wait", " cpu wait"),
        ("engine", "engine"),
        ("engine_cpu_wait", " cpu wait"),
        ("device", "device"),
        ("host_window", "host_window"),
    ];
    let rows = std::iter::once(("total", &e.total)).chain(
        ORDER
            .iter()
            .filter_map(|(k, label)| e.segments.get(*k).map(|v| (*label, v))),
    );
    // The guest agent's view after the host's: guest-observed latency
    // and its four segments.
    const STITCHED: [&str; 5] = ["total", "guest", "hypervisor", "engine", "device"];
    let stitched: Vec<(String, &Summary)> = e
        .stitched
        .iter()
        .flat_map(|st| {
            STITCHED
                .iter()
                .filter_map(move |k| st.segments.get(*k).map(|v| (format!("g.{k}"), v)))
        })
        .collect();
    let rows = rows.map(|(k, v)| (k.to_string(), v)).chain(stitched);
    for (i, (seg, s)) in rows.enumerate() {
        let (vm, disk, op, ios, iops, mbs) = if i == 0 {
            (
                e.vm.as_deref().unwrap_or("-"),
                label,
                e.op.as_str(),
                e.ios.to_string(),
                format!("{:.1}", e.iops),
                format!("{:.2}", e.mb_per_s),
            )
        } else {
            ("", "", "", String::new(), String::new(), String::new())
        };
        let _ = writeln!(
            out,
            "{:<vw$} {:<dw$} {:<7} {:>9} {:>10} {:>8}  {:<11} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            vm,
            disk,
            op,
            ios,
            iops,
            mbs,
            seg,
            us(s.mean_us),
            us(s.p50_us),
            us(s.p90_us),
            us(s.p99_us),
            us(s.p999_us),
            us(s.max_us)
        );
    }
}

impl RunReport {
    pub fn lost_line(&self) -> String {
        let parts: Vec<String> = self
            .lost
            .losses()
            .iter()
            .filter(|(_, _, n)| *n > 0)
            .map(|(_, what, n)| format!("{what}: {n}"))
            .collect();
        if parts.is_empty() {
            "lost: none".to_string()
        } else {
            format!("lost/degraded: {}", parts.join(", "))
        }
    }
}

fn us(v: f64) -> String {
    if v >= 100_000.0 {
        format!("{v:.0}")
    } else if v >= 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// The side-by-side lines of the terminal report: one per VM disk and op
/// QEMU counted, and a line per VM whose counters could not be read.
fn qemu_table(report: &RunReport) -> String {
    let mut out = String::new();
    let checked: Vec<&Entry> = report.entries.iter().filter(|e| e.qemu.is_some()).collect();
    if !checked.is_empty() {
        let _ = writeln!(
            out,
            "QEMU's own count beside ours (its mean: engine + device)\n{:<16} {:<14} {:<6} {:>9} {:>9} {:>7} {:>11} {:>11}",
            "VM", "DISK", "OP", "QEMU", "IOSPAN", "DIFF", "QEMU MEAN", "ENG+DEV"
        );
        for e in checked {
            let Some(c) = &e.qemu else { continue };
            let opt = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"));
            let _ = writeln!(
                out,
                "{:<16} {:<14} {:<6} {:>9} {:>9} {:>7} {:>11} {:>11}  {}",
                e.vm.as_deref().unwrap_or("-"),
                e.disk,
                e.op.as_str(),
                c.ops,
                c.iospan_ops,
                c.diff,
                opt(c.mean_us),
                opt(c.engine_device_mean_us),
                if c.mismatch {
                    format!("MISMATCH (beyond {})", c.allowances())
                } else if c.uncounted {
                    "not counted by its engine (it keeps no count of an export's requests)".into()
                } else if c.after_last_read > 0 {
                    format!(
                        "{} after QEMU's last read (the VM exited), {} in flight at it",
                        c.after_last_read, c.in_flight_at_last_read
                    )
                } else {
                    String::new()
                }
            );
        }
    }
    for v in &report.vms {
        if let Some(s) = &v.qemu_counts {
            if qemu_counts_worth_saying(s) {
                let _ = writeln!(out, "QEMU's own counts of {}: {s}", v.name);
            }
        }
    }
    out
}
