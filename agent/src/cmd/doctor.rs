//! `iospan doctor`: what this kernel lets iospan measure, found by trying.

use std::{fmt::Write as _, path::Path};

use anyhow::Result;
use serde::Serialize;

use crate::{
    probes::features::{self, ProbeResult, ProbeType},
    probes::preflight,
};

#[derive(Debug, Serialize)]
pub struct Doctor {
    pub kernel: String,
    pub btf: bool,
    pub privileged: bool,
    pub probes: Vec<ProbeResult>,
    pub kvm_tracepoints: bool,
    pub segments: Vec<SegmentSupport>,
    /// What a uprobe hit costs here, emulated and single-stepped.
    pub uprobe_costs: Vec<features::UprobeCost>,
    /// Why they were not measured, when not.
    pub uprobe_costs_error: Option<String>,
    /// QEMU processes running now, as iospan names them.
    pub vms: Vec<crate::discover::vms::Vm>,
}

#[derive(Debug, Serialize)]
pub struct SegmentSupport {
    pub segment: &'static str,
    pub measurable: Support,
    pub how: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Support {
    Yes,
    Partial,
    No,
}

impl Support {
    fn as_str(self) -> &'static str {
        match self {
            Support::Yes => "yes",
            Support::Partial => "partial",
            Support::No => "no",
        }
    }
}

pub fn examine() -> Result<Doctor> {
    let privileged = preflight::has_bpf_privileges();
    let probes = if privileged {
        features::probe_all()
    } else {
        Vec::new()
    };
    let works = |t: ProbeType| probes.iter().any(|p| p.probe == t && p.works);
    // The kvm tracepoints exist while the kvm module is loaded (or built in),
    // whether or not tracefs is mounted.
    let kvm_tracepoints = Path::new("/sys/module/kvm").exists()
        || Path::new("/sys/kernel/tracing/events/kvm").exists();
    let tp = works(ProbeType::TpBtf) || works(ProbeType::RawTp);
    let fn_probes = works(ProbeType::Kprobe) || works(ProbeType::Fentry);

    let mut segments = Vec::new();
    segments.push(SegmentSupport {
        segment: "device",
        measurable: if tp { Support::Yes } else { Support::No },
        how: if tp {
            format!(
                "host block tracepoints via {} (queue and service per request)",
                if works(ProbeType::TpBtf) {
                    "tp_btf"
                } else {
                    "raw_tp"
                }
            )
        } else {
            "needs tp_btf or raw_tp programs, neither loads here".into()
        },
    });
    segments.push(SegmentSupport {
        segment: "engine",
        measurable: match (works(ProbeType::Uprobe), tp) {
            (true, true) => Support::Yes,
            (false, true) => Support::Partial,
            _ => Support::No,
        },
        how: if works(ProbeType::Uprobe) {
            "the engine's eventfd read (syscall tracepoint) → host block start, and host completion → QEMU raising \
             the completion made visible (uprobe on virtqueue_flush for virtio, msix_notify for NVMe: one hit per request \
             at most, on that VM's process only); for the kernel's vhost-scsi workers, the worker switched in after a \
             kick (sched_switch) → host block start, and host completion → the MSI the worker raises through the \
             irqfd (kvm:kvm_msi_set_irq; the ring pop and push inside the worker need kprobes, not used)"
                .into()
        } else {
            "no uprobes: the interrupt QEMU raises is not visible, so the engine's completion half is not".into()
        },
    });
    segments.push(SegmentSupport {
        segment: "hypervisor",
        measurable: if tp { Support::Partial } else { Support::No },
        how: {
            let mut s = String::from(
                "kick → the engine's pickup: a vCPU's eventfd write (syscall tracepoints; TCG, or ioeventfd in user space), \
                 or, for a kernel vhost worker, a kick on an eventfd handed to vhost (VHOST_SET_VRING_KICK) → the worker switched \
                 in (sched_switch) or, already running, its next submission",
            );
            s.push_str(if kvm_tracepoints {
                " or KVM's MMIO exit at a registered notify address (kvm:kvm_mmio/kvm_fast_mmio, KVM_IOEVENTFD)"
            } else {
                "; no kvm tracepoints (kvm module not loaded): kicks of KVM guests are not visible"
            });
            s.push_str("; interrupt raised → injected is not measured (the host window ends when QEMU raises it)");
            if !fn_probes {
                s.push_str("; no kprobe/fentry for irqfd_wakeup");
            }
            s
        },
    });
    segments.push(SegmentSupport {
        segment: "guest",
        measurable: Support::No,
        how: "not visible from the host: needs iospan running inside the guest".into(),
    });

    let uprobe_costs = if privileged && works(ProbeType::Uprobe) {
        features::uprobe_costs().map_err(|e| format!("not measured: {e}"))
    } else {
        Err("not measured: uprobes do not work here".into())
    };
    Ok(Doctor {
        kernel: kernel_release(),
        btf: Path::new("/sys/kernel/btf/vmlinux").exists(),
        privileged,
        probes,
        kvm_tracepoints,
        segments,
        uprobe_costs_error: uprobe_costs.as_ref().err().cloned(),
        uprobe_costs: uprobe_costs.unwrap_or_default(),
        vms: crate::discover::vms::scan(),
    })
}

fn kernel_release() -> String {
    // SAFETY: uname fills the struct we pass.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    if unsafe { libc::uname(&mut u) } != 0 {
        return "unknown".into();
    }
    let field = |f: &[libc::c_char]| {
        let bytes: Vec<u8> = f
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    format!(
        "{} {} {}",
        field(&u.sysname),
        field(&u.release),
        field(&u.machine)
    )
}

impl Doctor {
    pub fn render(&self) -> String {
        let mut out = String::new();
        let yes = |b: bool| if b { "yes" } else { "no" };
        let _ = writeln!(out, "kernel        {}", self.kernel);
        let _ = writeln!(
            out,
            "BTF           {}",
            if self.btf {
                "yes (/sys/kernel/btf/vmlinux)"
            } else {
                "no"
            }
        );
        let _ = writeln!(
            out,
            "privileges    {}",
            if self.privileged {
                "yes"
            } else {
                "no: run as root or grant CAP_BPF + CAP_PERFMON"
            }
        );
        let _ = writeln!(out, "kvm events    {}", yes(self.kvm_tracepoints));
        let _ = writeln!(out, "\nprogram types (loaded, attached and fired here):");
        if self.probes.is_empty() {
            let _ = writeln!(out, "  not tried: no privileges");
        }
        for p in &self.probes {
            let _ = writeln!(
                out,
                "  {:<11} {:<4} {}",
                p.probe.as_str(),
                if p.works { "ok" } else { "no" },
                p.reason.as_deref().unwrap_or("")
            );
        }
        let _ = writeln!(out, "\nsegments this host can measure:");
        for s in &self.segments {
            let _ = writeln!(
                out,
                "  {:<11} {:<8} {}",
                s.segment,
                s.measurable.as_str(),
                s.how
            );
        }
        match (&self.uprobe_costs_error, &self.uprobe_costs) {
            (None, costs) => {
                let parts: Vec<String> = costs
                    .iter()
                    .map(|c| format!("{} {:.2} µs", c.prologue, c.ns_per_hit / 1000.0))
                    .collect();
                let _ = writeln!(
                    out,
                    "\nuprobe cost per hit (measured here, median of 5): {}; iospan puts one per request at most \
                     on a VM's completion path",
                    parts.join(", ")
                );
            }
            (Some(e), _) => {
                let _ = writeln!(out, "\nuprobe cost per hit: {e}");
            }
        }
        let _ = writeln!(out, "\nQEMU processes ({}):", self.vms.len());
        for vm in &self.vms {
            let _ = writeln!(out, "  {} (pid {})", vm.name, vm.pid);
            if let Some(dom) = &vm.libvirt {
                let _ = writeln!(
                    out,
                    "    libvirt domain {}{}",
                    dom.name,
                    dom.uuid
                        .as_deref()
                        .map_or(String::new(), |u| format!(", uuid {u}"))
                );
            } else if let Some(u) = &vm.uuid {
                let _ = writeln!(out, "    uuid {u}");
            }
            for (symbol, role) in vm.uprobe_symbols(true) {
                let site = crate::probes::uprobe::uprobe_site(vm.pid, symbol).map(|s| s.prologue);
                let how = match site {
                    Some(crate::probes::uprobe::Prologue::Push) => {
                        "entered with a push: emulated, the cheap kind".to_string()
                    }
                    Some(crate::probes::uprobe::Prologue::SingleStepped) => {
                        "single-stepped: the expensive kind".to_string()
                    }
                    None => format!("not exported by this binary: {}", role.missing()),
                };
                let role = role.describe();
                let _ = writeln!(out, "    {role}: {symbol}, {how}");
            }
            if vm.vdisks_over_cap > 0 {
                let _ = writeln!(
                    out,
                    "    {} more virtual disks on its command line not followed (at most {} per VM)",
                    vm.vdisks_over_cap,
                    crate::discover::vms::MAX_VDISKS
                );
            }
            let _ = writeln!(
                out,
                "    kicks: {}",
                if vm.named_threads {
                    "running before iospan: any eventfd its vCPUs write counts (a VM started while iospan runs \
                     has its queue notifiers known)"
                } else {
                    "none: QEMU's threads are unnamed (add debug-threads=on to -name), vCPUs cannot be told apart"
                }
            );
            let _ = writeln!(
                out,
                "    guest channel: {}",
                match (&vm.guest_channel, &vm.channel) {
                    (Some(p), _) => format!("{} (guest segment from `iospan agent --guest` in the VM)", p.display()),
                    (None, Some(src)) => format!(
                        "{src:?} on the command line, but the VM's process holds no listening socket for it: not connected"
                    ),
                    (None, None) if vm.libvirt.is_some() => format!(
                        "none: no guest segment (add <channel type='unix'><target type='virtio' name='{}'/></channel> to the domain's <devices>)",
                        crate::pipeline::transport::PORT_NAME
                    ),
                    (None, None) => format!(
                        "none: no guest segment (add -device virtio-serial-pci -chardev socket,id=iospan,path=PATH,\
                         server=on,wait=off -device virtserialport,chardev=iospan,name={})",
                        crate::pipeline::transport::PORT_NAME
                    ),
                }
            );
            let _ = writeln!(
                out,
                "    QEMU's own counts: {}",
                crate::discover::qemu_counts::describe_all(
                    &crate::discover::qemu_counts::sources_of(vm)
                )
            );
            for d in &vm.disks {
                let host = d
                    .host_dev
                    .map(crate::discover::disks::name_of)
                    .unwrap_or_else(|| "no host disk".into());
                let served = d.engine.as_ref().map_or_else(String::new, |e| {
                    format!(" served by {} (pid {}, {})", e.program, e.pid, e.export)
                });
                let host = if d.host_stack.is_empty() {
                    host
                } else {
                    // Device-mapper: the dm device, then the disks under it.
                    format!("{} ({})", d.host_stack[0], d.host_stack[1..].join(", "))
                };
                let id = match &d.target_dev {
                    Some(t) => format!("{} {t}", d.id),
                    None => d.id.clone(),
                };
                let iothread = d
                    .iothread
                    .as_deref()
                    .map_or(String::new(), |t| format!(", iothread {t}"));
                let _ = writeln!(
                    out,
                    "    {:<16} {:<18} {} on {host}{served}{iothread}: host block requests attributed to the VM; host window {}",
                    id,
                    d.model.as_deref().unwrap_or("-"),
                    d.file
                        .as_ref()
                        .map_or("-".into(), |f| f.display().to_string()),
                    match d.split_support() {
                        Ok(()) => "split (hypervisor, engine, device)".to_string(),
                        Err(why) => format!("not split: {why}"),
                    }
                );
            }
        }
        out
    }
}

/// `iospan doctor`.
pub fn main(json: bool) -> Result<std::process::ExitCode> {
    let d = examine()?;
    if json {
        println!("{}", serde_json::to_string_pretty(&d)?);
    } else {
        print!("{}", d.render());
    }
    Ok(std::process::ExitCode::SUCCESS)
}
