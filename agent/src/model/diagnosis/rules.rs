//! The rules: one function per cause, each returning a finding only with
//! its evidence, and `diagnose`, which names the cause that explains most
//! of the latency (docs/diagnosis.md gives each threshold's source).

use super::causes::{engine_cpu_wait, shared_engine, throttle};
use super::queues::{guest_queue, host_queue, slow_device};
use super::vcpu::{vcpu_cpu_wait, vcpu_notify};
use super::*;

/// A throttle binds when the disk runs at this share of its limit or more:
/// QEMU's leaky bucket holds the average at the limit.
pub const THROTTLE_AT: f64 = 0.9;
/// Above this many times its limit, a limit read earlier no longer holds
/// the disk (its bucket's bursts stay well under it over a run).
pub const THROTTLE_OVER: f64 = 1.5;
/// A thread busy this share of a CPU or more has no time to spare.
pub const SATURATED: f64 = 0.8;
/// A wait for a CPU this long per I/O or less is a wake-up, not a
/// starvation (a quiet host's: 10–35 µs measured under TCG here).
pub const CPU_WAIT_FLOOR_US: f64 = 20.0;
/// A non-rotational device serving requests slower than this on average is
/// slow (ten times a SATA SSD's read).
pub const SLOW_FLASH_US: f64 = 2_000.0;
/// Any device whose mean (rotational) or p99 is past this is slow: esxtop's
/// DAVG threshold for the array.
pub const SLOW_ANY_US: f64 = 20_000.0;
/// A host queue is full when its mean depth is this share of its
/// `nr_requests` or more.
pub const QUEUE_FULL: f64 = 0.9;
/// A guest's queue is full when the requests at the host reach this share
/// of what its queues hold. Not all of it: a descriptor is the guest's
/// again from the interrupt to its next submission (the guest's own
/// completion and submission work, guest segment), so a queue held full
/// shows at the host as about 0.8 of its size on an emulated guest (QD 16
/// behind queue-size 4, 5 ms device, by `IOPS × host time`: 0.82-0.87, and
/// under 0.8 in the runs a threshold of 0.8 missed). What tells a
/// full queue from a busy one is the guest holding 1.5 times as many.
pub const GUEST_QUEUE_FULL: f64 = 0.6;

/// The diagnosis of one disk and op: the cause that explains most of the
/// latency, when one explains at least `CAUSE_MIN_SHARE`; else none, or a
/// dominant segment no rule explains.
pub fn diagnose(f: &Figures, vm: Option<&VmDisk>, host: Option<&HostDisk>) -> Diagnosis {
    let hd = vm.and_then(|d| d.host_disk.as_ref()).or(host);
    if f.ios == 0 || f.total.mean_us <= 0.0 {
        return no_cause(f, vm, hd);
    }
    let mut found: Vec<Finding> = Vec::new();
    if let Some(d) = vm {
        found.extend(throttle(f, d));
        found.extend(engine_cpu_wait(f, d));
        found.extend(vcpu_cpu_wait(f, d));
        found.extend(shared_engine(f, d));
        found.extend(vcpu_notify(f, d));
        found.extend(guest_queue(f, d));
    }
    found.extend(host_queue(f, hd));
    found.extend(slow_device(f, hd));
    let best = found
        .into_iter()
        .filter(|x| x.explains >= CAUSE_MIN_SHARE)
        .max_by(|a, b| a.explains.total_cmp(&b.explains));
    match best {
        Some(x) => from_finding(f, x),
        None => no_cause(f, vm, hd),
    }
}

pub(super) fn basis(f: &Figures) -> Basis {
    f.basis.unwrap_or(Basis::HostWindow)
}

fn from_finding(f: &Figures, x: Finding) -> Diagnosis {
    let mut evidence = x.evidence;
    evidence.push(split_line(f));
    Diagnosis {
        segment: Some(x.segment),
        basis: basis(f),
        share_mean: f.share(x.segment),
        share_p99: f.tail_share(x.segment),
        cause: x.cause,
        summary: x.summary,
        evidence,
        knob: x.knob,
        confidence: x.confidence,
        to_know: x.to_know,
    }
}

/// Where the latency went, segment by segment, at the mean and in the tail.
fn split_line(f: &Figures) -> String {
    let parts: Vec<String> = Segment::ALL
        .iter()
        .filter(|s| f.segment(**s).is_some())
        .map(|s| {
            let tail = f
                .tail_share(*s)
                .map_or(String::new(), |t| format!(" (p99+ tail {})", pct(t)));
            format!("{} {}{tail}", s.as_str(), pct(f.share(*s)))
        })
        .collect();
    format!(
        "of {} mean ({} p99, {}): {}",
        us(f.total.mean_us),
        us(f.total.p99_us),
        match basis(f) {
            Basis::GuestObserved => "guest-observed",
            Basis::HostWindow => "the host window",
            Basis::HostDisk => "the host disk's",
        },
        parts.join(", ")
    )
}

/// No cause explains enough: healthy, no single layer, or a dominant
/// segment with no explanation (and what it would take to find one).
fn no_cause(f: &Figures, vm: Option<&VmDisk>, hd: Option<&HostDisk>) -> Diagnosis {
    let (seg, share) = Segment::ALL
        .iter()
        .map(|s| (*s, f.share(*s)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or((Segment::Device, 0.0));
    let mut d = Diagnosis {
        segment: None,
        basis: basis(f),
        share_mean: share,
        share_p99: f.tail_share(seg),
        cause: Cause::None,
        summary: String::new(),
        evidence: vec![split_line(f)],
        knob: None,
        confidence: Confidence::High,
        to_know: None,
    };
    if f.ios == 0 || f.total.mean_us <= 0.0 {
        d.summary = "none: no I/O timed".into();
        d.confidence = Confidence::Low;
    } else if share < NO_SINGLE_LAYER {
        d.summary = format!(
            "none: no single layer dominates (the largest, {}, is {})",
            seg.as_str(),
            pct(share)
        );
    } else if seg == Segment::Device {
        let name = hd.map_or("the host disk", |h| h.name.as_str());
        d.summary = format!(
            "none: the device's own service sets the latency ({} of it, {} per request on {name}) \
             and nothing waits in front of it: healthy",
            pct(share),
            us(f.segment(seg).map_or(0.0, |s| s.mean_us)),
        );
    } else if seg == Segment::Guest {
        // The guest's own path with its queue not full: its CPU's work
        // (its block layer, driver and wake-ups), not a wait.
        d.confidence = Confidence::Medium;
        d.summary = format!(
            "none: the guest's own path is the largest part ({}) and its queue is not full: the \
             guest's CPU work, not a wait{}",
            pct(share),
            if vm.is_some_and(|d| !d.kvm) {
                " (its CPU is emulated here, by QEMU's TCG)"
            } else {
                ""
            }
        );
        d.to_know = Some(to_know(f, seg));
    } else {
        d.cause = Cause::Unexplained;
        d.segment = Some(seg);
        d.confidence = Confidence::Low;
        d.summary = format!(
            "{} is {} of the latency and no rule here explains why",
            seg.as_str(),
            pct(share)
        );
        d.to_know = Some(to_know(f, seg));
    }
    d
}

/// What would tell more about a segment no rule explained.
fn to_know(f: &Figures, seg: Segment) -> String {
    match seg {
        Segment::Hypervisor | Segment::Engine if !f.tier.is_deep() => {
            "each I/O's CPU waits in the hypervisor and engine segments: the deep tier \
             (iospan run --deep, or an API run with tier=deep)"
                .into()
        }
        Segment::Hypervisor | Segment::Engine => {
            "the engine's own profile (perf record -t on its thread): its time is spent, \
             not waited"
                .into()
        }
        Segment::Guest => "the guest's own block layer, scheduler and stacked devices: \
                           iostat and blktrace inside the guest"
            .into(),
        Segment::Device => "the device's own statistics (smartctl, the array's)".into(),
    }
}
