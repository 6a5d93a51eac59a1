//! One function per cause: each returns a finding only with its evidence,
//! the setting that would move it, and how much of the latency it explains.

use super::rules::*;
use super::*;

/// The CPUs of a `Cpus_allowed_list` (`0-3,8`).
pub fn cpu_list(list: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) {
                    out.extend(a..=b.min(a.saturating_add(4096)));
                }
            }
            None => out.extend(part.parse::<u32>().ok()),
        }
    }
    out
}

/// The host's CPUs a thread may not run on now: where pinning it moves it
/// away from what it waits beside. None when it may run everywhere.
pub(super) fn apart(d: &VmDisk, t: &Thread) -> Option<String> {
    let mine = cpu_list(&t.cpus);
    let rest: Vec<String> = d
        .host_cpus
        .iter()
        .filter(|c| !mine.contains(c))
        .map(u32::to_string)
        .collect();
    (!rest.is_empty()).then(|| rest.join(","))
}

/// Who ran beside a waiting thread, in words.
pub(super) fn beside(d: &VmDisk) -> String {
    if d.beside.is_empty() {
        return "nothing else seen there at the run's end".into();
    }
    d.beside
        .iter()
        .map(|b| format!("{} (pid {}, {} of a CPU)", b.name, b.pid, pct(b.busy)))
        .collect::<Vec<_>>()
        .join(", ")
}

pub(super) fn thread_line(t: &Thread) -> String {
    format!(
        "{} (tid {}) may run on CPUs {}{}: on a CPU {} of the time, waiting runnable for one {}",
        t.name,
        t.tid,
        if t.cpus.is_empty() { "?" } else { &t.cpus },
        t.last_cpu
            .map_or(String::new(), |c| format!(", last on CPU {c}")),
        pct(t.busy),
        pct(t.waiting)
    )
}

/// libvirt's number of an iothread it made (`iothread3` → 3).
pub(super) fn libvirt_iothread(id: &str) -> Option<u32> {
    id.strip_prefix("iothread")?.parse().ok()
}

/// The disk as libvirt names it, and the domain.
pub(super) fn libvirt_names(d: &VmDisk) -> (String, String) {
    // Names another user may have chosen: each one shell word.
    let word = |s: &str| crate::model::text::shell_word(s).into_owned();
    (
        d.domain.as_deref().map_or_else(|| "DOMAIN".into(), word),
        word(d.target_dev.as_deref().unwrap_or(&d.disk)),
    )
}

/// QEMU's limit (by QMP's name) as libvirt's `<iotune>` and virsh name it.
fn iotune(name: &str) -> (&'static str, &'static str) {
    match name {
        "iops_rd" => ("read_iops_sec", "--read-iops-sec"),
        "iops_wr" => ("write_iops_sec", "--write-iops-sec"),
        "bps" => ("total_bytes_sec", "--total-bytes-sec"),
        "bps_rd" => ("read_bytes_sec", "--read-bytes-sec"),
        "bps_wr" => ("write_bytes_sec", "--write-bytes-sec"),
        _ => ("total_iops_sec", "--total-iops-sec"),
    }
}

/// QEMU's `-drive` option for a limit QMP names.
fn drive_option(name: &str) -> &'static str {
    match name {
        "iops_rd" => "throttling.iops-read",
        "iops_wr" => "throttling.iops-write",
        "bps" => "throttling.bps-total",
        "bps_rd" => "throttling.bps-read",
        "bps_wr" => "throttling.bps-write",
        _ => "throttling.iops-total",
    }
}

/// The limits that bind this op, with the rate they hold it at.
fn binding_limits(f: &Figures, d: &VmDisk) -> Vec<(String, u64, f64)> {
    d.throttle
        .iter()
        .filter(|(_, v)| *v > 0)
        .filter_map(|(name, v)| {
            let rate = match (name.as_str(), f.op) {
                ("iops", _) => f.disk_iops,
                ("bps", _) => f.disk_bytes_per_s,
                ("iops_rd", Some(Op::Read)) | ("iops_wr", Some(Op::Write)) => f.iops,
                ("bps_rd", Some(Op::Read)) | ("bps_wr", Some(Op::Write)) => f.bytes_per_s,
                _ => return None,
            };
            let limit = *v as f64;
            // Far above its limit, a disk is not held by it: the limit was
            // lifted since it was read (live, over QMP or virsh).
            (rate >= THROTTLE_AT * limit && rate <= THROTTLE_OVER * limit)
                .then(|| (name.clone(), *v, rate))
        })
        .collect()
}

/// (a) QEMU's throttle limit reached: requests wait in its block layer,
/// between the engine's pickup and the host — engine time.
pub(super) fn throttle(f: &Figures, d: &VmDisk) -> Option<Finding> {
    let (name, limit, rate) = binding_limits(f, d).into_iter().next()?;
    let engine = f.share(Segment::Engine);
    // A held request waits in QEMU between the kick and the host. Its
    // pickup is dated from its engine's last read of the ring, which for a
    // request the throttle held is a later one's: part of the wait shows
    // as hypervisor time.
    let hv = f.share(Segment::Hypervisor);
    let held = engine + hv;
    let shown_as_hv = if hv >= CAUSE_MIN_SHARE {
        format!(
            " ({} of it shows as hypervisor time: a held request's pickup is dated from its \
             engine's last read of the ring, a later request's)",
            pct(hv)
        )
    } else {
        String::new()
    };
    let unit = if name.starts_with("bps") {
        "B/s"
    } else {
        "IOPS"
    };
    let at = rate / limit as f64;
    let (dom, dev) = libvirt_names(d);
    let (tune, flag) = iotune(&name);
    let waited = f.cpu_wait.map_or(String::new(), |w| {
        format!(
            "; its threads waited {} per I/O for a CPU: the time is held, not spent",
            us(w.engine_us)
        )
    });
    Some(Finding {
        cause: Cause::Throttle,
        segment: Segment::Engine,
        explains: held.min(1.0),
        summary: format!(
            "QEMU's throttle holds {} at its limit: {name}={limit} ({rate:.0} {unit} measured, \
             {} of it); its requests wait in QEMU between the kick and the host, {} of the \
             latency{shown_as_hv}",
            d.disk,
            pct(at),
            pct(held)
        ),
        evidence: vec![
            format!(
                "limit {name}={limit} {unit} (read from {}), measured {rate:.0} {unit}",
                d.throttle_from.as_deref().unwrap_or("the VM")
            ),
            format!(
                "engine {} of {} per I/O{waited}",
                us(f.segment(Segment::Engine).map_or(0.0, |s| s.mean_us)),
                us(f.total.mean_us)
            ),
        ],
        knob: Some(Knob {
            now: match &d.domain {
                // A libvirt domain's setting, in its XML's words first.
                Some(_) => format!(
                    "<iotune><{tune}>{limit}</{tune}></iotune> on {dev} (QEMU's {}={limit})",
                    drive_option(&name)
                ),
                None => format!("{}={limit} on {}", drive_option(&name), d.disk),
            },
            qemu: Some(format!(
                "raise or lift it, live: QMP block_set_io_throttle (id {}, {name}: 0 for none, \
                 the other limits as they are), or -drive …,{}=N",
                d.disk,
                drive_option(&name)
            )),
            libvirt: Some(format!(
                "virsh blkdeviotune {dom} {dev} {flag} 0 --live (0: no limit), or \
                 <iotune><{tune}>N</{tune}></iotune> in the disk's XML"
            )),
            host: None,
            live: true,
            expect: format!(
                "the wait behind the throttle (most of the {} per I/O between the kick and the \
                 host) goes; the disk runs at what the next layer allows",
                us([Segment::Hypervisor, Segment::Engine]
                    .iter()
                    .filter_map(|s| f.segment(*s))
                    .map(|s| s.mean_us)
                    .sum())
            ),
        }),
        confidence: if held >= DOMINANT {
            Confidence::High
        } else {
            Confidence::Medium
        },
        to_know: None,
    })
}

/// The per-I/O CPU wait of the engine's threads: the deep tier's per
/// request, else the engine thread's wait over the window spread over the
/// I/Os it served (thread-level, not per request).
fn engine_wait_per_io(f: &Figures, d: &VmDisk) -> Option<(f64, Segment, Confidence)> {
    if let Some(w) = f.cpu_wait {
        let seg = if w.hypervisor_us >= w.engine_us {
            Segment::Hypervisor
        } else {
            Segment::Engine
        };
        return Some((w.hypervisor_us + w.engine_us, seg, Confidence::High));
    }
    let t = d.engine.as_ref()?;
    let served: f64 = f.disk_iops + d.peers.iter().map(|p| p.iops).sum::<f64>();
    (served > 0.0).then(|| {
        (
            t.waiting * 1e6 / served,
            Segment::Hypervisor,
            Confidence::Medium,
        )
    })
}

/// (b) The engine thread starved of CPU: runnable, waiting for a CPU that
/// another process holds, inside the hypervisor and engine segments.
pub(super) fn engine_cpu_wait(f: &Figures, d: &VmDisk) -> Option<Finding> {
    let (wait, segment, confidence) = engine_wait_per_io(f, d)?;
    if wait < CPU_WAIT_FLOOR_US {
        return None;
    }
    let explains = (wait / f.total.mean_us.max(1e-9)).min(1.0);
    let t = d.engine.clone().unwrap_or_default();
    let pin = apart(d, &t);
    let (dom, _) = libvirt_names(d);
    let vhost = d
        .model
        .as_deref()
        .is_some_and(|m| m.starts_with("vhost-scsi"));
    let (qemu, libvirt) = match (&d.iothread, &pin) {
        (_, None) => (None, None),
        (_, Some(cpus)) if vhost => (
            Some(format!("taskset -pc {cpus} {} (the disk's vhost worker)", t.tid)),
            Some(format!(
                "virsh emulatorpin {dom} {cpus} --live, or <cputune><emulatorpin cpuset='{cpus}'/></cputune> \
                 (the worker is one of QEMU's threads, made by its main loop)"
            )),
        ),
        (Some(id), Some(cpus)) => (
            Some(format!(
                "taskset -pc {cpus} {} (the iothread {})",
                t.tid,
                crate::model::text::shell_word(id)
            )),
            Some(match libvirt_iothread(id) {
                Some(n) => format!(
                    "virsh iothreadpin {dom} {n} {cpus} --live, or \
                     <cputune><iothreadpin iothread='{n}' cpuset='{cpus}'/></cputune>"
                ),
                None => format!(
                    "<cputune><iothreadpin iothread='N' cpuset='{cpus}'/></cputune> for the \
                     iothread serving it (virsh iothreadpin {dom} N {cpus} --live)"
                ),
            }),
        ),
        (None, Some(cpus)) => (
            Some(format!("taskset -pc {cpus} {} (QEMU's main loop)", t.tid)),
            Some(format!(
                "virsh emulatorpin {dom} {cpus} --live, or <cputune><emulatorpin cpuset='{cpus}'/></cputune>"
            )),
        ),
    };
    let mut evidence = vec![format!(
        "{} per I/O waiting for a CPU ({} of the latency){}",
        us(wait),
        pct(explains),
        if confidence == Confidence::High {
            ", measured per request"
        } else {
            ", from the thread's own wait over the run"
        }
    )];
    if t.tid != 0 {
        evidence.push(thread_line(&t));
    }
    evidence.push(format!("beside it on those CPUs: {}", beside(d)));
    Some(Finding {
        cause: Cause::EngineCpuWait,
        segment,
        explains,
        summary: format!(
            "the engine thread {} waits for a CPU: {} of {} per I/O, beside {}",
            if t.name.is_empty() { "?" } else { &t.name },
            us(wait),
            us(f.total.mean_us),
            d.beside.first().map_or("other work", |b| b.name.as_str())
        ),
        evidence,
        knob: Some(Knob {
            now: format!("{} may run on CPUs {}", t.name, t.cpus),
            qemu,
            libvirt,
            host: pin.is_none().then(|| {
                "it may already run on every CPU: lower the load beside it, or give it CPUs of \
                 its own (pin the other work off them)"
                    .to_string()
            }),
            live: true,
            expect: format!("its wait for a CPU ({} per I/O) goes", us(wait)),
        }),
        confidence,
        to_know: (confidence < Confidence::High)
            .then(|| "each request's own CPU waits: the deep tier (iospan run --deep)".to_string()),
    })
}

/// (c) One engine thread serving several busy disks, with no time to
/// spare: each disk's requests wait for the others'.
pub(super) fn shared_engine(f: &Figures, d: &VmDisk) -> Option<Finding> {
    let t = d.engine.as_ref()?;
    let busy_peers: Vec<&Peer> = d.peers.iter().filter(|p| p.iops > 0.0).collect();
    if t.busy < SATURATED || busy_peers.is_empty() {
        return None;
    }
    let explains = f.share(Segment::Hypervisor) + f.share(Segment::Engine);
    let segment = if f.share(Segment::Hypervisor) >= f.share(Segment::Engine) {
        Segment::Hypervisor
    } else {
        Segment::Engine
    };
    let peers: Vec<String> = busy_peers
        .iter()
        .map(|p| format!("{} {:.0} IOPS", p.disk, p.iops))
        .collect();
    let (dom, dev) = libvirt_names(d);
    let thread = match &d.iothread {
        Some(id) => format!("the iothread {id}"),
        None => "QEMU's main loop".into(),
    };
    Some(Finding {
        cause: Cause::SharedEngine,
        segment,
        explains,
        summary: format!(
            "one engine thread, {} ({thread}), serves {} and {} busy disk{} and is busy {} of a \
             CPU: hypervisor + engine are {} of the latency",
            t.name,
            d.disk,
            busy_peers.len(),
            if busy_peers.len() == 1 { "" } else { "s" },
            pct(t.busy),
            pct(explains)
        ),
        evidence: vec![
            thread_line(t),
            format!(
                "it also serves: {} (this disk {:.0} IOPS)",
                peers.join(", "),
                f.disk_iops
            ),
        ],
        knob: Some(Knob {
            now: format!("{} served by {thread} with {}", d.disk, peers.join(", ")),
            qemu: Some(format!(
                "an iothread of its own: -object iothread,id=io-{0} and -device …,drive=…,iothread=io-{0}",
                d.disk
            )),
            libvirt: Some(format!(
                "one more iothread (<iothreads>N+1</iothreads>) and <driver … iothread='N+1'/> on \
                 {dev} in {dom}'s XML"
            )),
            host: None,
            live: false,
            expect: "each disk's engine work on a thread (and a CPU) of its own: hypervisor + \
                     engine fall toward what the disk costs alone"
                .into(),
        }),
        confidence: if t.busy >= 0.9 {
            Confidence::High
        } else {
            Confidence::Medium
        },
        to_know: None,
    })
}
