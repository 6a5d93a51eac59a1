//! The causes in the vCPUs: a vCPU waiting for a CPU (esxtop's %RDY), and a
//! notify path that is the vCPU's own exit.

use super::causes::*;
use super::rules::*;
use super::*;

/// (h) The VM's vCPU starved of CPU: after the engine raises an I/O's
/// interrupt the vCPU that takes it waits, runnable, for a CPU another
/// process holds — hypervisor time (the interrupt's injection) that the
/// host window does not hold.
pub(super) fn vcpu_cpu_wait(f: &Figures, d: &VmDisk) -> Option<Finding> {
    let (wait, measured) = vcpu_wait_per_io(d)?;
    if wait < CPU_WAIT_FLOOR_US {
        return None;
    }
    let t = d
        .vcpu_threads
        .iter()
        .max_by(|a, b| a.waiting.total_cmp(&b.waiting))
        .cloned()
        .unwrap_or_default();
    // The host window ends at the interrupt's raise: there the wait is
    // outside what was measured, and explains its share of the whole.
    let explains = match basis(f) {
        Basis::GuestObserved => wait / f.total.mean_us.max(1e-9),
        _ => wait / (f.total.mean_us + wait).max(1e-9),
    }
    .min(1.0);
    let mut evidence = vec![format!(
        "{} per I/O: {measured}{}",
        us(wait),
        if basis(f) == Basis::GuestObserved {
            ", within the guest-observed hypervisor segment"
        } else {
            "; after the interrupt's raise, outside the host window"
        }
    )];
    if t.tid != 0 {
        evidence.push(thread_line(&t));
    }
    evidence.push(format!("beside it on those CPUs: {}", beside(d)));
    Some(Finding {
        cause: Cause::VcpuCpuWait,
        segment: Segment::Hypervisor,
        explains,
        summary: format!(
            "the vCPU waits for a CPU: {} per I/O before it takes the completion's interrupt, \
             beside {}",
            us(wait),
            d.beside.first().map_or("other work", |b| b.name.as_str())
        ),
        evidence,
        knob: Some(vcpu_pin_knob(d, &t, wait)),
        confidence: if d.vcpu_waits.is_some() {
            Confidence::High
        } else {
            Confidence::Medium
        },
        to_know: d.vcpu_waits.is_none().then(|| {
            "each interrupt's own wait for its vCPU: the deep tier (iospan run --deep)".into()
        }),
    })
}

/// The vCPUs' wait per I/O, and how it was had: measured at each
/// interrupt's raise (the deep tier), else their wait over the run spread
/// over the VM's I/Os (each completion's interrupt wakes a vCPU).
fn vcpu_wait_per_io(d: &VmDisk) -> Option<(f64, String)> {
    if let Some(VcpuWaits {
        per_io_us: per_io,
        raises,
        waited,
    }) = d.vcpu_waits
    {
        return Some((
            per_io,
            format!(
                "its vCPUs' wait for a CPU after the interrupts' raises, measured at each \
                 ({waited} of {raises} raises waited)"
            ),
        ));
    }
    let waiting: f64 = d.vcpu_threads.iter().map(|t| t.waiting).sum();
    (d.vm_iops > 0.0).then(|| {
        (
            waiting * 1e6 / d.vm_iops,
            format!(
                "the vCPUs' wait for a CPU over the run ({}) over the VM's {:.0} IOPS",
                pct(waiting),
                d.vm_iops
            ),
        )
    })
}

/// Pin the vCPU apart from what it waits beside, in QEMU's and libvirt's
/// words, or lower the host's overcommit.
fn vcpu_pin_knob(d: &VmDisk, t: &Thread, wait: f64) -> Knob {
    let pin = apart(d, t);
    let (dom, _) = libvirt_names(d);
    let vcpu = t
        .name
        .strip_prefix("CPU ")
        .and_then(|r| r.split('/').next())
        .map_or_else(
            || "N".into(),
            |v| crate::model::text::shell_word(v).into_owned(),
        );
    Knob {
        now: format!("{} may run on CPUs {}", t.name, t.cpus),
        qemu: pin
            .as_ref()
            .map(|cpus| format!("taskset -pc {cpus} {} (and each vCPU thread so)", t.tid)),
        libvirt: pin.as_ref().map(|cpus| {
            format!(
                "virsh vcpupin {dom} {vcpu} {cpus} --live, or \
                 <cputune><vcpupin vcpu='{vcpu}' cpuset='{cpus}'/></cputune>"
            )
        }),
        host: Some(
            "or lower the host's overcommit: fewer runnable threads than CPUs where the vCPUs run"
                .into(),
        ),
        live: true,
        expect: format!("the vCPU's wait ({} per I/O) goes", us(wait)),
    }
}

/// Whether a disk's notify path is the vCPU's exit: virtio with
/// `ioeventfd=off`, NVMe without `ioeventfd=on` (its default).
fn notify_in_vcpu(d: &VmDisk) -> bool {
    let model = d.model.as_deref().unwrap_or("");
    match d.ioeventfd {
        Some(on) => !on,
        None => model == "nvme",
    }
}

/// (d) The notify path served by the vCPU thread: with no ioeventfd each
/// kick is a full exit into QEMU, the vCPU thread does the engine's pickup
/// under QEMU's lock, and the guest's vCPU runs none of its own work
/// meanwhile. Under KVM only: QEMU's emulation (TCG) runs the notify in the
/// vCPU thread either way.
pub(super) fn vcpu_notify(f: &Figures, d: &VmDisk) -> Option<Finding> {
    if !notify_in_vcpu(d) || !d.kvm {
        return None;
    }
    let busiest = d
        .vcpu_threads
        .iter()
        .max_by(|a, b| a.busy.total_cmp(&b.busy))?;
    let explains = f.share(Segment::Guest) + f.share(Segment::Hypervisor);
    if busiest.busy < SATURATED {
        return None;
    }
    let (dom, dev) = libvirt_names(d);
    let nvme = d.model.as_deref() == Some("nvme");
    Some(Finding {
        cause: Cause::VcpuNotify,
        segment: Segment::Hypervisor,
        explains,
        summary: format!(
            "{} has no ioeventfd: each kick exits into QEMU on the vCPU thread, which is busy {} \
             of a CPU",
            d.disk,
            pct(busiest.busy)
        ),
        evidence: vec![
            thread_line(busiest),
            "the kicks reach no eventfd: the host window cannot start at them (counted \
             not_followed or no_kick)"
                .into(),
        ],
        knob: Some(Knob {
            now: format!(
                "ioeventfd={} on {}",
                if nvme { "off (NVMe's default)" } else { "off" },
                d.disk
            ),
            qemu: Some(format!(
                "-device {},…,ioeventfd=on",
                d.model.as_deref().unwrap_or("…")
            )),
            libvirt: (!nvme).then(|| {
                format!("<driver … ioeventfd='on'/> on {dev} in {dom}'s XML (its default)")
            }),
            host: None,
            live: false,
            expect: "the kick becomes an eventfd signal in the kernel: the vCPU returns to the \
                     guest at once and the engine's thread picks the request up"
                .into(),
        }),
        confidence: Confidence::Low,
        to_know: Some(
            "the exits' own time: on a kernel with fentry or kprobes, KVM's exit to user space \
             per kick"
                .into(),
        ),
    })
}
