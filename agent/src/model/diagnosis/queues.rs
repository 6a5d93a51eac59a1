//! The causes in the queues and the device: the guest's own queue, the
//! host's queue in front of the device, and the device itself.

use super::causes::*;
use super::rules::*;
use super::*;

/// What a disk's queues hold at once: its queue size (virtio's 256 by
/// default) times its queues.
fn guest_capacity(d: &VmDisk) -> Option<f64> {
    let model = d.model.as_deref().unwrap_or("");
    let size = match d.queue_size {
        Some(s) => s,
        None if model.starts_with("virtio") => 256,
        None => return None,
    };
    Some(f64::from(size) * f64::from(d.queues.unwrap_or(1).max(1)))
}

/// The queue size (per queue) with room for the workload's depth and half
/// again, as a power of two: at least twice today's, at most virtio's 1024.
/// Whatever the figures (a guest's stamps make `in_guest`), never out of
/// that range.
fn larger_queue_size(cap: f64, queues: Option<u32>, in_guest: f64) -> u32 {
    const VIRTIO_MAX: f64 = 1024.0;
    let queues = f64::from(queues.unwrap_or(1).max(1));
    let size = cap / queues;
    let wanted = (1.5 * in_guest / queues).ceil();
    // f64's max and min pass NaN over: the bounds hold for any figure.
    let want = wanted.max(size * 2.0).min(VIRTIO_MAX).max(1.0);
    (want as u32).next_power_of_two().min(VIRTIO_MAX as u32)
}

/// (g) The guest's own queueing: more requests in flight in the guest than
/// its queues let reach the host, so they wait in the guest before its
/// driver kicks (the guest segment; the guest agent sees it).
pub(super) fn guest_queue(f: &Figures, d: &VmDisk) -> Option<Finding> {
    if basis(f) != Basis::GuestObserved {
        return None;
    }
    let guest = f.share(Segment::Guest);
    let cap = guest_capacity(d)?;
    let in_guest = f.in_flight();
    let at_host = f.iops * (f.total.mean_us - f.segment(Segment::Guest)?.mean_us) / 1e6;
    if at_host < GUEST_QUEUE_FULL * cap || in_guest < 1.5 * at_host {
        return None;
    }
    let (dom, dev) = libvirt_names(d);
    let want = larger_queue_size(cap, d.queues, in_guest);
    let now = match d.queue_size {
        Some(s) => format!("queue-size={s}"),
        None => "queue-size 256 (QEMU's default)".into(),
    };
    Some(Finding {
        cause: Cause::GuestQueue,
        segment: Segment::Guest,
        explains: guest,
        summary: format!(
            "the guest's queue is full: {now} × {} queue{} lets {cap:.0} requests reach the host \
             at once, the workload keeps {in_guest:.1} in flight, and the rest wait in the guest \
             ({} of the latency)",
            d.queues.unwrap_or(1),
            if d.queues.unwrap_or(1) == 1 { "" } else { "s" },
            pct(guest)
        ),
        evidence: vec![
            format!(
                "{in_guest:.1} requests in flight in the guest ({:.0} IOPS × {}), \
                 {at_host:.1} of them past its driver",
                f.iops,
                us(f.total.mean_us)
            ),
            format!(
                "guest segment {} per I/O",
                us(f.segment(Segment::Guest).map_or(0.0, |s| s.mean_us))
            ),
        ],
        knob: Some(Knob {
            now: format!("{now} on {}", d.disk),
            qemu: Some(format!(
                "-device {},…,queue-size={want}",
                d.model.as_deref().unwrap_or("…")
            )),
            libvirt: Some(format!(
                "<driver … queue_size='{want}'/> on {dev} in {dom}'s XML"
            )),
            host: None,
            live: false,
            expect: "the requests waiting in the guest reach the host: the guest segment falls \
                     and the host serves the workload's depth (faster where the device has \
                     parallelism to spare)"
                .into(),
        }),
        confidence: Confidence::High,
        to_know: None,
    })
}

/// (f) The host's queue in front of the device is full: requests wait for
/// one of its `nr_requests` tags before the host block layer starts them
/// (the engine segment, with io_uring's workers submitting), or in its
/// scheduler (the host queue, start → issue).
pub(super) fn host_queue(f: &Figures, hd: Option<&HostDisk>) -> Option<Finding> {
    let hd = hd?;
    let queue_us = f.host_queue_us.unwrap_or(0.0);
    let waiting = f.share(Segment::Engine) + queue_us / f.total.mean_us.max(1e-9);
    let (nr, depth) = (hd.nr_requests?, hd.in_flight?);
    if depth < QUEUE_FULL * f64::from(nr) {
        return None;
    }
    let want = (f.in_flight() * 2.0)
        .ceil()
        .max(f64::from(nr) * 4.0)
        .min(4096.0) as u32;
    let segment = if queue_us > f.segment(Segment::Engine).map_or(0.0, |s| s.mean_us) {
        Segment::Device
    } else {
        Segment::Engine
    };
    Some(Finding {
        cause: Cause::HostQueue,
        segment,
        explains: waiting.min(1.0),
        summary: format!(
            "the host's queue in front of {} is full: nr_requests={nr} and {depth:.1} in flight on \
             average, while these requests keep {:.1}; they wait for it ({} of the latency)",
            hd.name,
            f.in_flight(),
            pct(waiting.min(1.0))
        ),
        evidence: vec![
            format!(
                "{}: scheduler {}, nr_requests {nr}, {depth:.1} requests in flight on average",
                hd.name,
                hd.scheduler.as_deref().unwrap_or("?")
            ),
            format!(
                "before the device: engine {} per I/O (a request waits there for a tag before \
                 the host starts it), host queue {}",
                us(f.segment(Segment::Engine).map_or(0.0, |s| s.mean_us)),
                us(queue_us)
            ),
        ],
        knob: Some(Knob {
            now: format!("{}: nr_requests {nr}", hd.name),
            qemu: None,
            libvirt: None,
            host: Some(format!(
                "echo {want} > {} (a udev rule keeps it)",
                crate::model::text::shell_word(&format!(
                    "/sys/block/{}/queue/nr_requests",
                    hd.name
                ))
            )),
            live: true,
            expect: "the wait for a host tag goes: the device sees the workload's depth, and \
                     serves it as fast as its own parallelism allows"
                .into(),
        }),
        confidence: Confidence::High,
        to_know: None,
    })
}

/// Whether a device's service is slow for its kind.
fn slow(service_us: f64, p99_us: f64, rotational: Option<bool>) -> bool {
    let mean_limit = match rotational {
        Some(false) => SLOW_FLASH_US,
        _ => SLOW_ANY_US,
    };
    service_us >= mean_limit || p99_us >= SLOW_ANY_US
}

/// (e) A slow device behind the host disk: the device segment dominates,
/// nothing waits in front of it, and it serves slower than its kind does.
/// No setting of the VM moves it: it is the host's storage.
pub(super) fn slow_device(f: &Figures, hd: Option<&HostDisk>) -> Option<Finding> {
    let dev = f.segment(Segment::Device)?;
    let share = f.share(Segment::Device);
    let service = f.host_service_us.unwrap_or(dev.mean_us);
    let queue = f.host_queue_us.unwrap_or(0.0);
    if share < DOMINANT || queue > 0.2 * service {
        return None;
    }
    if !slow(service, dev.p99_us, hd.and_then(|h| h.rotational)) {
        return None;
    }
    let name = hd.map_or("the host disk".to_string(), |h| h.name.clone());
    let kind = match hd.and_then(|h| h.rotational) {
        Some(false) => format!(
            "a non-rotational device serves in well under {}",
            us(SLOW_FLASH_US)
        ),
        Some(true) => format!("even a rotational disk serves in under {}", us(SLOW_ANY_US)),
        None => format!("past {}, esxtop's mark for the array", us(SLOW_ANY_US)),
    };
    let stack = hd
        .filter(|h| !h.stack.is_empty())
        .map_or(String::new(), |h| format!(" (on {})", h.stack.join(" → ")));
    Some(Finding {
        cause: Cause::SlowDevice,
        segment: Segment::Device,
        explains: share,
        summary: format!(
            "the host's device is slow: {name}{stack} serves a request in {} on average, {} p99 \
             ({kind}); nothing waits in front of it. No setting of the VM moves it: it is the \
             host's storage",
            us(service),
            us(dev.p99_us)
        ),
        evidence: vec![format!(
            "host queue {} against service {} per request",
            us(queue),
            us(service)
        )],
        knob: Some(Knob {
            now: format!("{name}{stack}"),
            qemu: None,
            libvirt: None,
            host: Some(format!(
                "the storage under {name}: its own statistics (the array's, smartctl), its \
                 paths and its load from other hosts"
            )),
            live: false,
            expect: "the latency follows the device's service time: nothing in the VM or the \
                     host's queues will move it"
                .into(),
        }),
        confidence: if hd.and_then(|h| h.rotational).is_some() {
            Confidence::High
        } else {
            Confidence::Medium
        },
        to_know: None,
    })
}
