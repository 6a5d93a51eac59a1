//! Each disk's diagnosis in a run's report: its figures from the report's
//! entries and tails, its settings from the VM (its command line, QMP,
//! libvirt's domain) and what the run watched of its threads, named by
//! `model::diagnosis`.

use std::collections::BTreeMap;

use crate::{
    discover::{
        disks,
        qemu_counts::Throttle,
        threads::{Neighbour, Role, ThreadLoad},
        vms::{Registry, VDisk, Vm},
    },
    model::{
        diagnosis::{
            self, Basis, Beside, CpuWait, Figures, FrameDiagnosis, HostDisk, Peer, Stat, Thread,
            VcpuWaits, VmDisk,
        },
        tails::TailEntry,
        Summary, Tier,
    },
    output::report::{Entry, RunReport},
};

/// What a run watched of its VMs beside their I/O.
#[derive(Clone, Debug, Default)]
pub struct Watch {
    pub vms: BTreeMap<String, VmWatch>,
    pub host_cpus: Vec<u32>,
}

/// One VM as watched: its processes' threads' loads (the VM's and its
/// engines', by pid), its throttles as QEMU holds them, the span its I/O
/// was busy, and what ran beside its waiting threads.
#[derive(Clone, Debug, Default)]
pub struct VmWatch {
    pub threads: BTreeMap<u32, Vec<ThreadLoad>>,
    pub throttles: Option<BTreeMap<String, Throttle>>,
    pub busy_s: Option<f64>,
    pub beside: Vec<Neighbour>,
}

/// A host disk's mean depth while busy over the run, by name.
pub type Depths = BTreeMap<String, f64>;

/// Everything the diagnoses of one report read besides its entries.
pub struct Inputs<'a> {
    pub known: &'a Registry,
    pub tails: &'a [TailEntry],
    pub watch: &'a Watch,
    pub depths: &'a Depths,
}

fn stat(s: Option<&Summary>) -> Option<Stat> {
    s.filter(|s| s.count > 0).map(|s| Stat {
        mean_us: s.mean_us,
        p99_us: s.p99_us,
    })
}

fn mean(e: &Entry, k: &str) -> Option<f64> {
    e.segments.get(k).filter(|s| s.count > 0).map(|s| s.mean_us)
}

/// An entry's figures: guest-observed where a guest agent joined it, else
/// its host window's split, else its host disk's.
pub fn figures(e: &Entry, tail: Option<&TailEntry>, tier: Tier) -> Figures {
    let mut f = Figures {
        op: Some(e.op),
        ios: e.ios,
        iops: e.iops,
        bytes_per_s: e.mb_per_s * 1e6,
        host_queue_us: mean(e, "queue"),
        host_service_us: mean(e, "service"),
        tier,
        ..Default::default()
    };
    let seg = |m: &BTreeMap<String, Summary>, k: &str| stat(m.get(k));
    if let Some(st) = e.stitched.as_ref().filter(|s| s.count > 0) {
        f.basis = Some(Basis::GuestObserved);
        f.total = seg(&st.segments, "total").unwrap_or_default();
        f.segments = ["guest", "hypervisor", "engine", "device"].map(|k| seg(&st.segments, k));
    } else if let Some(w) = seg(&e.segments, "host_window") {
        f.basis = Some(Basis::HostWindow);
        f.total = w;
        f.segments = [
            None,
            seg(&e.segments, "hypervisor"),
            seg(&e.segments, "engine"),
            seg(&e.segments, "device"),
        ];
    } else {
        f.basis = Some(Basis::HostDisk);
        f.total = stat(Some(&e.total)).unwrap_or_default();
        f.segments = [None, None, None, seg(&e.segments, "service")];
    }
    if tier.is_deep() && f.basis != Some(Basis::HostDisk) {
        f.cpu_wait = Some(CpuWait {
            hypervisor_us: mean(e, "hypervisor_cpu_wait").unwrap_or(0.0),
            engine_us: mean(e, "engine_cpu_wait").unwrap_or(0.0),
        });
    }
    if let Some(t) = tail {
        if let Some(b) = t.band(99.0) {
            f.tail = Some([b.mean_us[1], b.mean_us[2], b.mean_us[3], b.mean_us[4]]);
            f.tail_total_us = Some(b.mean_us[0]);
        }
    }
    f
}

fn thread(t: &ThreadLoad) -> Thread {
    Thread {
        name: t.name.clone(),
        tid: t.tid,
        cpus: t.cpus.clone(),
        last_cpu: t.last_cpu,
        busy: t.busy,
        waiting: t.waiting,
    }
}

/// The thread serving a disk: the kernel's vhost worker of a vhost-scsi
/// disk (a thread of QEMU's since Linux 6.4: before, a kernel thread, not
/// one of the VM's), its iothread, else its engine process's (or QEMU's)
/// main loop.
fn engine_thread(vm: &Vm, d: &VDisk, w: &VmWatch) -> Option<Thread> {
    if d.kernel_vhost() {
        let loads = w.threads.get(&vm.pid)?;
        return loads.iter().find(|t| t.role == Role::Vhost).map(thread);
    }
    let pid = d.engine.as_ref().map_or(vm.pid, |e| e.pid);
    let loads = w.threads.get(&pid)?;
    let role = match (&d.iothread, &d.engine) {
        (Some(id), None) => Role::Iothread(id.clone()),
        _ => Role::Main,
    };
    loads.iter().find(|t| t.role == role).map(thread)
}

/// A host disk's settings and its depth over the run.
fn host_disk(name: &str, depths: &Depths) -> HostDisk {
    let q = disks::queue_settings(name);
    HostDisk {
        name: name.to_string(),
        scheduler: q.scheduler,
        nr_requests: q.nr_requests,
        device_depth: q.device_depth,
        rotational: q.rotational,
        in_flight: depths.get(name).copied(),
        stack: q.stack,
    }
}

/// An entry's rate over its busy span (IOPS, bytes a second): its tail's
/// (first kick to last completion) where kept, else over the VM's busy
/// span as the run watched it, else over the whole run.
fn rate(e: &Entry, tail: Option<&TailEntry>, busy_s: Option<f64>) -> (f64, f64) {
    let span = match (tail.filter(|t| t.iops > 0.0), busy_s.filter(|s| *s > 0.0)) {
        (Some(t), _) => e.ios as f64 / t.iops,
        (None, Some(s)) => s,
        (None, None) => return (e.iops, e.mb_per_s * 1e6),
    };
    (e.ios as f64 / span, e.bytes as f64 / span)
}

fn tail_of<'a>(tails: &'a [TailEntry], e: &Entry) -> Option<&'a TailEntry> {
    tails
        .iter()
        .find(|t| Some(&t.vm) == e.vm.as_ref() && t.disk == e.disk && t.op == e.op)
}

/// Each disk's rate (every op) in the report, by (VM, disk).
fn disk_rates(
    r: &RunReport,
    tails: &[TailEntry],
    busy: &BTreeMap<String, f64>,
) -> BTreeMap<(String, String), (f64, f64)> {
    let mut out: BTreeMap<(String, String), (f64, f64)> = BTreeMap::new();
    for e in &r.entries {
        let vm = e.vm.clone().unwrap_or_default();
        let (iops, bps) = rate(e, tail_of(tails, e), busy.get(&vm).copied());
        let x = out.entry((vm, e.disk.clone())).or_default();
        x.0 += iops;
        x.1 += bps;
    }
    out
}

/// A VM disk's settings and what was watched of it.
fn vm_disk(vm: &Vm, d: &VDisk, w: &VmWatch, host_cpus: &[u32]) -> VmDisk {
    let (throttle, from) = match w.throttles.as_ref().and_then(|t| t.get(&d.id)) {
        Some((limits, _)) => (limits.clone(), "QMP query-block"),
        None if vm.libvirt.is_some() && !d.knobs.throttle.is_empty() => {
            (d.knobs.throttle.clone(), "libvirt's <iotune>")
        }
        None => (d.knobs.throttle.clone(), "its command line"),
    };
    let vcpus = w
        .threads
        .get(&vm.pid)
        .map(|ts| {
            ts.iter()
                .filter(|t| matches!(t.role, Role::Vcpu(_)))
                .map(thread)
                .collect()
        })
        .unwrap_or_default();
    VmDisk {
        vm: vm.name.clone(),
        disk: d.id.clone(),
        domain: vm.libvirt.as_ref().map(|l| l.name.clone()),
        target_dev: d.target_dev.clone(),
        model: d.model.clone(),
        kvm: vm.kvm,
        vcpus: vm.vcpus,
        iothread: d.iothread.clone(),
        ioeventfd: d.knobs.ioeventfd,
        queues: d.queues,
        queue_size: d.knobs.queue_size,
        throttle_from: (!throttle.is_empty()).then(|| from.to_string()),
        throttle,
        engine: engine_thread(vm, d, w),
        vcpu_threads: vcpus,
        beside: w
            .beside
            .iter()
            .map(|n| Beside {
                name: n.name.clone(),
                pid: n.pid,
                busy: n.busy,
            })
            .collect(),
        host_cpus: host_cpus.to_vec(),
        ..Default::default()
    }
}

/// The disks of a VM its disk's engine thread serves too, with their rates.
fn peers(vm: &Vm, d: &VDisk, rates: &BTreeMap<(String, String), (f64, f64)>) -> Vec<Peer> {
    vm.disks
        .iter()
        .filter(|o| o.id != d.id && o.iothread == d.iothread && o.engine == d.engine)
        .filter_map(|o| {
            let (iops, _) = *rates.get(&(vm.name.clone(), o.id.clone()))?;
            (iops > 0.0).then(|| Peer {
                vm: vm.name.clone(),
                disk: o.id.clone(),
                iops,
            })
        })
        .collect()
}

/// Diagnoses every entry of `report`: each VM disk's, and each host
/// disk's.
pub fn attach(report: &mut RunReport, inputs: &Inputs<'_>) {
    let tier = report.tier.unwrap_or_default();
    let busy: BTreeMap<String, f64> = inputs
        .watch
        .vms
        .iter()
        .filter_map(|(n, w)| Some((n.clone(), w.busy_s?)))
        .collect();
    let rates = disk_rates(report, inputs.tails, &busy);
    // The VMs' measured vCPU waits, spread over their virtual disks'
    // requests (not the VM process's own).
    let is_vdisk = |vm: &str, disk: &str| {
        inputs
            .known
            .vms
            .values()
            .any(|v| v.name == vm && v.disks.iter().any(|d| d.id == disk))
    };
    let vm_ios: BTreeMap<String, u64> = report.entries.iter().fold(BTreeMap::new(), |mut m, e| {
        if let Some(v) = e.vm.as_ref().filter(|v| is_vdisk(v, &e.disk)) {
            *m.entry(v.clone()).or_default() += e.ios;
        }
        m
    });
    let vcpu_waits: BTreeMap<&str, VcpuWaits> = report
        .vms
        .iter()
        .filter_map(|v| {
            let w = v.vcpu_waits.as_ref()?;
            let ios = vm_ios.get(&v.name).copied().unwrap_or(0).max(1) as f64;
            let per_io = VcpuWaits {
                per_io_us: w.wait_us / ios,
                raises: w.raises,
                waited: w.waited,
            };
            Some((v.name.as_str(), per_io))
        })
        .collect();
    let vcpu_waits = &vcpu_waits;
    let no_watch = VmWatch::default();
    let diagnoses: Vec<Option<diagnosis::Diagnosis>> = report
        .entries
        .iter()
        .map(|e| {
            let tail = tail_of(inputs.tails, e);
            let mut f = figures(e, tail, tier);
            let hd = host_disk(&e.host_disk, inputs.depths);
            let Some(vm_name) = &e.vm else {
                f.basis = Some(Basis::HostDisk);
                return Some(diagnosis::diagnose(&f, None, Some(&hd)));
            };
            let (_, vm) = inputs.known.vms.iter().find(|(_, v)| &v.name == vm_name)?;
            // The VM process's own requests (no virtual disk): not a disk of its.
            let d = vm.disks.iter().find(|d| d.id == e.disk)?;
            let w = inputs.watch.vms.get(vm_name).unwrap_or(&no_watch);
            let (disk_iops, disk_bps) = rates
                .get(&(vm_name.clone(), d.id.clone()))
                .copied()
                .unwrap_or_default();
            (f.iops, f.bytes_per_s) = rate(e, tail, busy.get(vm_name).copied());
            f.disk_iops = disk_iops;
            f.disk_bytes_per_s = disk_bps;
            let mut vd = vm_disk(vm, d, w, &inputs.watch.host_cpus);
            vd.peers = peers(vm, d, &rates);
            vd.vm_iops = rates
                .iter()
                .filter(|((v, _), _)| v == vm_name)
                .map(|(_, (iops, _))| iops)
                .sum();
            vd.host_disk = Some(hd);
            vd.vcpu_waits = vcpu_waits.get(vm_name.as_str()).copied();
            Some(diagnosis::diagnose(&f, Some(&vd), None))
        })
        .collect();
    for (e, d) in report.entries.iter_mut().zip(diagnoses) {
        e.diagnosis = d;
    }
}

/// A live row's figures over a window (its frames' difference): the same
/// basis as a report's entry, from the segments a frame keeps.
fn row_figures(d: &crate::output::live::Row, seconds: f64, tier: Tier) -> Figures {
    let seg = |k: &str| {
        d.segs.get(k).filter(|h| h.count > 0).map(|h| {
            let s = h.summary();
            Stat {
                mean_us: s.mean_us,
                p99_us: s.p99_us,
            }
        })
    };
    let secs = seconds.max(1e-9);
    let mut f = Figures {
        op: Some(d.op),
        ios: d.ios,
        iops: d.ios as f64 / secs,
        bytes_per_s: d.bytes as f64 / secs,
        host_queue_us: seg("queue").map(|s| s.mean_us),
        total: seg("total").unwrap_or_default(),
        tier,
        ..Default::default()
    };
    if d.vm.is_empty() {
        f.basis = Some(Basis::HostDisk);
        f.segments = [None, None, None, seg("device")];
        f.host_service_us = seg("device").map(|s| s.mean_us);
        return f;
    }
    f.basis = Some(if d.guest_observed {
        Basis::GuestObserved
    } else if seg("hv").is_some() {
        Basis::HostWindow
    } else {
        Basis::HostDisk
    });
    f.segments = [seg("guest"), seg("hv"), seg("engine"), seg("device")];
    if tier.is_deep() && seg("hv_wait").is_some() {
        f.cpu_wait = Some(CpuWait {
            hypervisor_us: seg("hv_wait").map_or(0.0, |s| s.mean_us),
            engine_us: seg("engine_wait").map_or(0.0, |s| s.mean_us),
        });
    }
    f
}

/// Every disk's diagnosis over the window from frame `then` to `now`.
pub fn frame_diagnoses(
    (now, then): (&crate::output::live::Frame, &crate::output::live::Frame),
    known: &Registry,
    watch: &Watch,
    depths: &Depths,
    tier: Tier,
) -> Vec<FrameDiagnosis> {
    let seconds = now.at_s - then.at_s;
    let rows: Vec<crate::output::live::Row> = now
        .vdisks
        .iter()
        .chain(&now.disks)
        .map(|r| {
            let before = then.vdisks.iter().chain(&then.disks).find(|b| b.same(r));
            r.since(before)
        })
        .filter(|r| r.ios > 0)
        .collect();
    let mut rates: BTreeMap<(String, String), (f64, f64)> = BTreeMap::new();
    for r in rows.iter().filter(|r| !r.vm.is_empty()) {
        let x = rates.entry((r.vm.clone(), r.disk.clone())).or_default();
        x.0 += r.ios as f64 / seconds.max(1e-9);
        x.1 += r.bytes as f64 / seconds.max(1e-9);
    }
    let no_watch = VmWatch::default();
    rows.iter()
        .filter_map(|r| {
            let mut f = row_figures(r, seconds, tier);
            let d = if r.vm.is_empty() {
                diagnosis::diagnose(&f, None, Some(&host_disk(&r.disk, depths)))
            } else {
                let (_, vm) = known.vms.iter().find(|(_, v)| v.name == r.vm)?;
                let vd = vm.disks.iter().find(|d| d.id == r.disk)?;
                let w = watch.vms.get(&r.vm).unwrap_or(&no_watch);
                (f.disk_iops, f.disk_bytes_per_s) = rates
                    .get(&(r.vm.clone(), r.disk.clone()))
                    .copied()
                    .unwrap_or_default();
                let mut s = vm_disk(vm, vd, w, &watch.host_cpus);
                s.peers = peers(vm, vd, &rates);
                s.vm_iops = rates
                    .iter()
                    .filter(|((v, _), _)| *v == r.vm)
                    .map(|(_, (iops, _))| iops)
                    .sum();
                s.host_disk = vm_host_disk(vd, depths);
                diagnosis::diagnose(&f, Some(&s), None)
            };
            Some(FrameDiagnosis {
                vm: r.vm.clone(),
                disk: r.disk.clone(),
                op: r.op,
                seconds,
                diagnosis: d,
            })
        })
        .collect()
}

/// The host disk under a virtual disk, by name.
fn vm_host_disk(d: &VDisk, depths: &Depths) -> Option<HostDisk> {
    d.host_dev
        .map(|dev| host_disk(&disks::name_of(dev), depths))
}
