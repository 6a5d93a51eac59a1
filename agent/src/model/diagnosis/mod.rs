//! From where to what: one virtual disk's (or host disk's) bottleneck — the
//! layer that limits it, the cause with its evidence in numbers, the
//! setting that would move it and how sure the finding is — from the
//! figures the tiers already keep and the settings read from the VM and the
//! host. Pure: everything it reads is handed to it. Every rule, threshold
//! and source is in docs/diagnosis.md.
//!
//! A bottleneck is a cause with evidence, not the largest segment: some
//! segment is always the largest, and a disk whose time is mostly its
//! device's, with nothing waiting in front of it, is healthy.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::{Op, Tier};

mod causes;
mod queues;
mod rules;
mod vcpu;

pub use causes::cpu_list;
pub use rules::diagnose;

/// The four segments of a guest I/O.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Segment {
    Guest,
    Hypervisor,
    Engine,
    Device,
}

impl Segment {
    pub const ALL: [Segment; 4] = [
        Segment::Guest,
        Segment::Hypervisor,
        Segment::Engine,
        Segment::Device,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Guest => "guest",
            Self::Hypervisor => "hypervisor",
            Self::Engine => "engine",
            Self::Device => "device",
        }
    }
}

/// What the latency a diagnosis divides is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Basis {
    /// The guest-observed latency, in four segments (a guest agent).
    GuestObserved,
    /// The host window: kick to interrupt (no guest agent).
    HostWindow,
    /// A host disk's requests: queue and service.
    HostDisk,
}

/// A latency's mean and 99th percentile, µs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Stat {
    pub mean_us: f64,
    pub p99_us: f64,
}

/// The figures of one disk and op over a window, as measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Figures {
    pub basis: Option<Basis>,
    pub op: Option<Op>,
    pub ios: u64,
    /// Over the disk's busy span: this op's ...
    pub iops: f64,
    pub bytes_per_s: f64,
    /// ... and every op's of the disk (a throttle's total limits bind
    /// these).
    pub disk_iops: f64,
    pub disk_bytes_per_s: f64,
    /// The latency the segments divide (guest-observed, or host window, or
    /// a host disk's total).
    pub total: Stat,
    /// Per segment, where measured (`Segment` order).
    pub segments: [Option<Stat>; 4],
    /// The p99+ tail's composition: each segment's mean over the slowest
    /// hundredth of the I/Os, µs (`Segment` order), where per-I/O records
    /// were kept (the deep tier).
    pub tail: Option<[f64; 4]>,
    pub tail_total_us: Option<f64>,
    /// The host block layer's queue (start → issue) and service (issue →
    /// completion) means of these requests, µs.
    pub host_queue_us: Option<f64>,
    pub host_service_us: Option<f64>,
    /// Per I/O, the owning threads' waits for a CPU within the hypervisor
    /// and engine segments, µs (the deep tier).
    pub cpu_wait: Option<CpuWait>,
    pub tier: Tier,
}

/// Per-I/O CPU waits, µs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CpuWait {
    pub hypervisor_us: f64,
    pub engine_us: f64,
}

impl Figures {
    pub fn segment(&self, s: Segment) -> Option<Stat> {
        self.segments.get(s as usize).copied().flatten()
    }

    /// A segment's share of the mean latency.
    pub fn share(&self, s: Segment) -> f64 {
        match self.segment(s) {
            Some(st) if self.total.mean_us > 0.0 => st.mean_us / self.total.mean_us,
            _ => 0.0,
        }
    }

    /// A segment's share of the p99+ tail's latency, where kept.
    pub fn tail_share(&self, s: Segment) -> Option<f64> {
        let (t, total) = (self.tail?, self.tail_total_us?);
        let part = t.get(s as usize)?;
        (total > 0.0).then(|| part / total)
    }

    /// Requests in flight on average (Little's law: rate × latency).
    pub fn in_flight(&self) -> f64 {
        self.iops * self.total.mean_us / 1e6
    }
}

/// A thread of the VM (or its engine) and its load over the window.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Thread {
    pub name: String,
    pub tid: u32,
    pub cpus: String,
    pub last_cpu: Option<u32>,
    /// Shares of the wall time: on a CPU, and runnable waiting for one.
    pub busy: f64,
    pub waiting: f64,
}

/// A process that ran beside a waiting thread, on its CPUs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Beside {
    pub name: String,
    pub pid: u32,
    /// Share of a CPU it used there.
    pub busy: f64,
}

/// A disk of the same engine thread and its rate.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Peer {
    pub vm: String,
    pub disk: String,
    pub iops: f64,
}

/// A VM disk's settings, as read from the VM (its command line, QMP,
/// libvirt's domain XML) and its threads.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct VmDisk {
    pub vm: String,
    pub disk: String,
    /// The libvirt domain and the disk's target dev, when libvirt runs it.
    pub domain: Option<String>,
    pub target_dev: Option<String>,
    pub model: Option<String>,
    pub kvm: bool,
    pub vcpus: Option<u32>,
    /// `iothread=` (None: QEMU's main loop).
    pub iothread: Option<String>,
    pub ioeventfd: Option<bool>,
    pub queues: Option<u32>,
    pub queue_size: Option<u32>,
    /// Throttle limits by QMP's names (`iops`, `iops_rd`, …).
    pub throttle: Vec<(String, u64)>,
    /// Where the throttle was read: `QMP query-block`, `its command line`,
    /// `libvirt's <iotune>`.
    pub throttle_from: Option<String>,
    /// The thread serving the disk (iothread or main loop; a vhost worker;
    /// an engine process's thread).
    pub engine: Option<Thread>,
    /// Other busy disks that thread serves.
    pub peers: Vec<Peer>,
    pub vcpu_threads: Vec<Thread>,
    /// What ran on the waiting threads' CPUs.
    pub beside: Vec<Beside>,
    /// The VM's I/O rate over all its disks (its vCPUs take every
    /// completion's interrupt).
    pub vm_iops: f64,
    /// The deep tier: its vCPUs' waits for a CPU after its interrupts'
    /// raises, measured at each.
    pub vcpu_waits: Option<VcpuWaits>,
    /// The host's online CPUs.
    pub host_cpus: Vec<u32>,
    /// The host disk under the virtual disk.
    pub host_disk: Option<HostDisk>,
}

/// A host disk's queue settings (sysfs) and its load over the window.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HostDisk {
    pub name: String,
    pub scheduler: Option<String>,
    pub nr_requests: Option<u32>,
    /// The device's own queue depth (SCSI's `device/queue_depth`), where it
    /// has one.
    pub device_depth: Option<u32>,
    pub rotational: Option<bool>,
    /// Requests in flight on it on average over the window (the kernel's
    /// own weighted time in queue: iostat's aqu-sz).
    pub in_flight: Option<f64>,
    /// What it is stacked on, down to the device that serves it.
    pub stack: Vec<String>,
}

/// The cause a diagnosis names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// No bottleneck: no single layer limits it, or the device's own
    /// service sets the latency with nothing waiting in front of it.
    None,
    /// QEMU's throttle limit reached.
    Throttle,
    /// The engine thread waits for a CPU another process holds.
    EngineCpuWait,
    /// One engine thread busy serving several disks.
    SharedEngine,
    /// The notify path is the vCPU's own exit: no ioeventfd.
    VcpuNotify,
    /// The host's device is slow.
    SlowDevice,
    /// The host's queue in front of the device is full.
    HostQueue,
    /// Requests wait in the guest before its driver kicks.
    GuestQueue,
    /// The vCPU waits for a CPU another process holds.
    VcpuCpuWait,
    /// The workload's own concurrency is past the knee.
    PastKnee,
    /// A segment dominates and no rule explains why.
    Unexplained,
}

impl Cause {
    /// The short word `iospan top` shows.
    pub fn word(self) -> &'static str {
        match self {
            Self::None => "ok",
            Self::Throttle => "throttle",
            Self::EngineCpuWait => "eng-rdy",
            Self::SharedEngine => "eng-busy",
            Self::VcpuNotify => "vcpu-kick",
            Self::SlowDevice => "device",
            Self::HostQueue => "host-q",
            Self::GuestQueue => "guest-q",
            Self::VcpuCpuWait => "vcpu-rdy",
            Self::PastKnee => "knee",
            Self::Unexplained => "?",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Throttle => "throttle",
            Self::EngineCpuWait => "engine_cpu_wait",
            Self::SharedEngine => "shared_engine",
            Self::VcpuNotify => "vcpu_notify",
            Self::SlowDevice => "slow_device",
            Self::HostQueue => "host_queue",
            Self::GuestQueue => "guest_queue",
            Self::VcpuCpuWait => "vcpu_cpu_wait",
            Self::PastKnee => "past_knee",
            Self::Unexplained => "unexplained",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Confidence {
    Low,
    Medium,
    High,
}

impl Confidence {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Low => "low",
            Self::Medium => "medium",
            Self::High => "high",
        }
    }
}

/// The setting that would move a bottleneck: what it is now, what to try in
/// QEMU's words and in libvirt's (or the host's), and what to expect.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Knob {
    /// The setting as it is now.
    pub now: String,
    /// What to try, in QEMU's words (a command line option, a QMP command).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qemu: Option<String>,
    /// The same in libvirt's (domain XML, virsh).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub libvirt: Option<String>,
    /// A setting of the host, not the VM's (sysfs, taskset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Whether it can be changed while the VM runs.
    pub live: bool,
    /// The effect expected.
    pub expect: String,
}

/// One disk's diagnosis.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Diagnosis {
    /// The limiting segment; None: no bottleneck.
    pub segment: Option<Segment>,
    pub basis: Basis,
    /// That segment's share of the latency at the mean and in the p99+
    /// tail (where per-I/O records give the tail's composition).
    pub share_mean: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_p99: Option<f64>,
    pub cause: Cause,
    /// One line: the finding.
    pub summary: String,
    /// The numbers it rests on.
    pub evidence: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub knob: Option<Knob>,
    pub confidence: Confidence,
    /// What it would take to know more (an option, a tier, an agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_know: Option<String>,
}

impl Diagnosis {
    /// The word `iospan top` shows.
    pub fn word(&self) -> &'static str {
        self.cause.word()
    }

    /// The whole diagnosis as lines of text.
    pub fn text(&self) -> String {
        let mut out = self.summary.clone();
        for e in &self.evidence {
            let _ = write!(out, "\n    {e}");
        }
        if let Some(k) = &self.knob {
            let _ = write!(out, "\n    now: {}", k.now);
            for (who, what) in [
                ("QEMU", &k.qemu),
                ("libvirt", &k.libvirt),
                ("host", &k.host),
            ] {
                if let Some(w) = what {
                    let _ = write!(out, "\n    try ({who}): {w}");
                }
            }
            let _ = write!(
                out,
                "\n    expect: {}{}",
                k.expect,
                if k.live { " (can be changed live)" } else { "" }
            );
        }
        if let Some(t) = &self.to_know {
            let _ = write!(out, "\n    to know more: {t}");
        }
        out
    }
}

/// A VM's vCPUs' waits for a CPU after its interrupts' raises, as the deep
/// tier measures them at each raise.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct VcpuWaits {
    /// The waits spread over the VM's virtual disks' I/Os, µs per I/O.
    pub per_io_us: f64,
    pub raises: u64,
    /// Raises after which the vCPU had waited.
    pub waited: u64,
}

/// One disk's diagnosis in a live frame, over the agent's last window
/// (`vm` empty: a host disk).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FrameDiagnosis {
    pub vm: String,
    pub disk: String,
    pub op: Op,
    /// The window it covers, s.
    pub seconds: f64,
    pub diagnosis: Diagnosis,
}

/// A cause a rule found, with how much of the latency it explains.
#[derive(Clone, Debug, PartialEq)]
pub struct Finding {
    pub cause: Cause,
    pub segment: Segment,
    /// The share of the latency the cause explains.
    pub explains: f64,
    pub summary: String,
    pub evidence: Vec<String>,
    pub knob: Option<Knob>,
    pub confidence: Confidence,
    pub to_know: Option<String>,
}

/// A segment holding at least this share of the mean latency dominates it.
pub const DOMINANT: f64 = 0.5;
/// A cause is named the bottleneck when it explains at least this share of
/// the latency: less, and moving it moves the result by less than a
/// benchmark's own run-to-run spread.
pub const CAUSE_MIN_SHARE: f64 = 0.2;
/// With no cause found, no segment at or above this share: no single layer
/// limits the disk.
pub const NO_SINGLE_LAYER: f64 = 0.5;

/// Reads as "µs" or "ms" with sensible precision.
pub fn us(v: f64) -> String {
    if v >= 10_000.0 {
        format!("{:.1} ms", v / 1000.0)
    } else if v >= 1000.0 {
        format!("{:.2} ms", v / 1000.0)
    } else {
        format!("{v:.0} µs")
    }
}

pub fn pct(v: f64) -> String {
    format!("{:.0} %", v * 100.0)
}

#[cfg(test)]
mod props;
#[cfg(test)]
mod tests;
