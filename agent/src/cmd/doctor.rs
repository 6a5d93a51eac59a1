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
    /// Data paths served by the kernel rather than a VM's own threads.
    pub paths: Vec<PathSupport>,
    /// What a uprobe hit costs here, emulated and single-stepped.
    pub uprobe_costs: Vec<features::UprobeCost>,
    /// Why they were not measured, when not.
    pub uprobe_costs_error: Option<String>,
    /// How each tier sees a VM request's events here.
    pub tiers: TierPlan,
    /// QEMU processes running now, as iospan names them.
    pub vms: Vec<crate::discover::vms::Vm>,
}

/// The probes each tier uses on this host for the events of a VM
/// request's window (what `probes::host` attaches, by the same tests).
#[derive(Debug, Serialize)]
pub struct TierPlan {
    /// The tier `iospan agent` and `iospan run` run here.
    pub default: &'static str,
    pub always_on: Vec<EventProbe>,
    /// What the deep tier (`iospan run --deep`, an API run with
    /// `tier=deep`) attaches besides, while it runs.
    pub deep_adds: Vec<EventProbe>,
}

#[derive(Debug, Serialize)]
pub struct EventProbe {
    pub event: &'static str,
    pub probe: String,
}

/// `fn_probe`: "fentry" or "kprobe" where either works here.
fn tier_plan(fn_probe: Option<&'static str>, kvm: bool, io_uring: bool, block: &str) -> TierPlan {
    let e = |event, probe: String| EventProbe { event, probe };
    let always_on = vec![
        e("new VM", "sched_process_exec (a process named as QEMU's); its queue notifiers are learnt from its kicks' wake-ups, no system call is traced".into()),
        e("kick, KVM guest", if kvm {
            "kvm:kvm_mmio / kvm:kvm_fast_mmio at a queue's notify address".into()
        } else {
            "not seen: no kvm tracepoints (the kvm module is not loaded)".into()
        }),
        e("kick, TCG guest", match fn_probe {
            Some(f) => format!("{f} on eventfd_write"),
            None => "not seen here (needs fentry or kprobes on eventfd_write): such VMs' windows are counted unsplit, the deep tier splits them".into(),
        }),
        e("pickup", match fn_probe {
            Some(f) => format!("{f} on eventfd_read: the engine's read of the kick"),
            None => "the engine thread switched in after the kick woke it (sched_waking, sched_switch), or, already running, its next submitting call: no fentry or kprobes on eventfd_read here, so the pickup is up to one scheduling delay late (the deep tier reads it from the read system call)".into(),
        }),
        e("host request", format!("block:block_io_start, block_rq_issue, block_rq_complete ({block})")),
        e("io_uring hand-off", if io_uring {
            "io_uring:io_uring_queue_async_work".into()
        } else {
            "not seen: no io_uring tracepoints (requests handed to io-wq workers are unsplit)".into()
        }),
        e("interrupt", if kvm {
            "kvm:kvm_msi_set_irq in the thread raising it (irqfd, KVM_SIGNAL_MSI); TCG guests: uprobe on QEMU's msix_notify where their kicks are seen".into()
        } else {
            "uprobe on QEMU's msix_notify where kicks are seen".into()
        }),
        e("join", "in the kernel: a VM's interrupt ends the window of every request of it completed before; per-CPU histograms per VM, disk, queue, op and segment".into()),
    ];
    let deep_adds = vec![
        e("kick, pickup", "syscalls:sys_enter_write, sys_enter_read on eventfds; the notifiers' registration (sys_exit_eventfd2, sys_enter_ioctl, sys_exit_ioctl, sys_enter_close); the submitting calls (sys_enter_io_uring_enter, sys_enter_io_submit): every process of the host takes the slow system-call path while it runs".into()),
        e("used-ring push", "uprobes on QEMU's virtqueue_flush (virtio), msix_notify (NVMe), an engine's vu_queue_push (vhost-user)".into()),
        e("CPU waits", "sched_wakeup, sched_switch".into()),
        e("records", "every VM request through the ring buffer, split by the agent".into()),
    ];
    TierPlan {
        default: "always-on",
        always_on,
        deep_adds,
    }
}

#[derive(Debug, Serialize)]
pub struct SegmentSupport {
    pub segment: &'static str,
    pub measurable: Support,
    pub how: String,
}

/// A storage data path and what iospan gives of it on this host.
#[derive(Debug, Serialize)]
pub struct PathSupport {
    pub path: &'static str,
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
    let segments = segments(&probes, kvm_tracepoints);
    let uprobe_costs = if privileged && works(ProbeType::Uprobe) {
        features::uprobe_costs().map_err(|e| format!("not measured: {e}"))
    } else {
        Err("not measured: uprobes do not work here".into())
    };
    let fn_probe = if works(ProbeType::Fentry) {
        Some("fentry")
    } else if works(ProbeType::Kprobe) {
        Some("kprobe")
    } else {
        None
    };
    let kprobes = works(ProbeType::Kprobe);
    let tiers = tier_plan(
        fn_probe,
        kvm_tracepoints,
        crate::probes::host::io_uring_tracepoints(),
        if works(ProbeType::TpBtf) {
            "tp_btf"
        } else {
            "raw_tp"
        },
    );
    Ok(Doctor {
        tiers,
        kernel: kernel_release(),
        btf: Path::new("/sys/kernel/btf/vmlinux").exists(),
        privileged,
        probes,
        kvm_tracepoints,
        segments,
        paths: vec![vhost_scsi_path(&release(), kprobes)],
        uprobe_costs_error: uprobe_costs.as_ref().err().cloned(),
        uprobe_costs: uprobe_costs.unwrap_or_default(),
        vms: crate::discover::vms::scan(),
    })
}

/// What each segment needs, and whether this host has it.
fn segments(probes: &[features::ProbeResult], kvm_tracepoints: bool) -> Vec<SegmentSupport> {
    let works = |t: ProbeType| probes.iter().any(|p| p.probe == t && p.works);
    // Without the atomics every program uses, nothing iospan has loads.
    let tp = (works(ProbeType::TpBtf) || works(ProbeType::RawTp)) && works(ProbeType::Atomics);
    let fn_probes = works(ProbeType::Kprobe) || works(ProbeType::Fentry);
    let mut segments = Vec::new();
    segments.push(SegmentSupport {
        segment: "device",
        measurable: if tp { Support::Yes } else { Support::No },
        how: if !works(ProbeType::Atomics) && !probes.is_empty() {
            "none: this kernel lacks the BPF atomic operations iospan's programs use (Linux 5.12 and later)".into()
        } else if tp {
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
            "the pickup → host block start, and host completion → the VM's next interrupt (always-on: see tiers) or \
             → QEMU's used-ring push for that request (the deep tier's uprobes, one hit per request on that VM's \
             process only); a kernel vhost worker's from its switch-in after the kick to its submission, and from the \
             completion to the MSI it raises through the irqfd"
                .into()
        } else {
            "no uprobes: the engine's completion half ends at KVM's interrupt only (guests on KVM)".into()
        },
    });
    segments.push(SegmentSupport {
        segment: "hypervisor",
        measurable: if tp { Support::Partial } else { Support::No },
        how: {
            let mut s = String::from("kick → the engine's pickup (always-on: see tiers; the deep tier from the eventfd system calls)");
            if !kvm_tracepoints {
                s.push_str("; no kvm tracepoints (kvm module not loaded): kicks of KVM guests are not visible");
            }
            s.push_str("; interrupt raised → injected is not measured (the host window ends when QEMU raises it)");
            if !fn_probes {
                s.push_str(
                    "; no kprobe or fentry here: the always-on pickup is the engine's wake-up, not its read, \
                     and TCG guests' kicks are the deep tier's only",
                );
            }
            s
        },
    });
    segments.push(SegmentSupport {
        segment: "guest",
        measurable: Support::No,
        how: "not visible from the host: needs iospan running inside the guest".into(),
    });
    segments
}

/// The kernel's vhost-scsi: a worker of the kernel's serves the VM's
/// virtqueues and LIO its commands.
fn vhost_scsi_path(release: &str, kprobes: bool) -> PathSupport {
    if !has_vhost_scsi(release) {
        return PathSupport {
            path: "vhost-scsi",
            measurable: Support::No,
            how: format!(
                "no vhost_scsi in this kernel (not loaded, not built in, none under /lib/modules/{release}): \
                 no kernel vhost worker serves a VM here"
            ),
        };
    }
    let named = "the VM, its vhost-scsi disks (its target's LUNs in LIO's configfs), the worker vhost-<pid> and \
                 the export are named";
    if kprobes {
        PathSupport {
            path: "vhost-scsi",
            measurable: Support::Yes,
            how: format!(
                "{named}; split by kprobes: the guest's kick (vhost_poll_wakeup), the worker's batch \
                 (vhost_disable_notify) and pop of each command (target_init_cmd), the task executing it \
                 (__target_execute_cmd: LIO's workqueue by default, or the worker), the worker's signal \
                 (vhost_signal); requests popped with no kick of their own are counted as polled"
            ),
        }
    } else {
        PathSupport {
            path: "vhost-scsi",
            measurable: Support::Partial,
            how: format!(
                "{named}; no kprobes here: the commands LIO's workqueue submits (the default) are counted on the \
                 backing disk as the host's, and none is split"
            ),
        }
    }
}

/// vhost_scsi loaded or built in (/sys/module), or a module file of this
/// release (vhost_scsi.ko, compressed or not).
fn has_vhost_scsi(release: &str) -> bool {
    if Path::new("/sys/module/vhost_scsi").exists() {
        return true;
    }
    let dir = Path::new("/lib/modules")
        .join(release)
        .join("kernel/drivers/vhost");
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("vhost_scsi.ko"))
    })
}

fn release() -> String {
    rustix::system::uname()
        .release()
        .to_string_lossy()
        .into_owned()
}

fn kernel_release() -> String {
    let u = rustix::system::uname();
    let field = |f: &std::ffi::CStr| f.to_string_lossy().into_owned();
    format!(
        "{} {} {}",
        field(u.sysname()),
        release(),
        field(u.machine())
    )
}

/// One line of what this host can measure: name, verdict, how.
fn support_row(out: &mut String, name: &str, measurable: Support, how: &str) {
    let _ = writeln!(out, "  {name:<11} {:<8} {how}", measurable.as_str());
}

impl Doctor {
    pub fn render(&self) -> String {
        let mut out = String::new();
        self.render_host(&mut out);
        self.render_tiers(&mut out);
        let _ = writeln!(out, "\nQEMU processes ({}):", self.vms.len());
        for vm in &self.vms {
            render_vm(&mut out, vm);
        }
        out
    }

    /// The kernel, privileges, program types and measurable segments.
    fn render_host(&self, out: &mut String) {
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
            support_row(out, s.segment, s.measurable, &s.how);
        }
        let _ = writeln!(out, "\nkernel data paths:");
        for p in &self.paths {
            support_row(out, p.path, p.measurable, &p.how);
        }
    }

    /// The tiers' probes and what a uprobe costs here.
    fn render_tiers(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "\ntiers: {} runs by default (`iospan agent`, `iospan run`); deep: `iospan run --deep`, an API run with tier=deep",
            self.tiers.default
        );
        let _ = writeln!(out, "  always-on, per event of a VM request:");
        for p in &self.tiers.always_on {
            let _ = writeln!(out, "    {:<18} {}", p.event, p.probe);
        }
        let _ = writeln!(out, "  deep adds, while it runs:");
        for p in &self.tiers.deep_adds {
            let _ = writeln!(out, "    {:<18} {}", p.event, p.probe);
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
    }
}

/// A QEMU process: its identity, uprobe sites, kicks, guest channel,
/// QEMU's own counts and virtual disks.
fn render_vm(out: &mut String, vm: &crate::discover::vms::Vm) {
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
    for (symbol, role) in vm.uprobe_symbols(crate::discover::vms::ProbeChoice {
        split: true,
        deep: true,
        interrupts_in_qemu: !vm.kvm,
    }) {
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
        crate::discover::qemu_counts::describe_all(&crate::discover::qemu_counts::sources_of(vm))
    );
    for d in &vm.disks {
        render_vdisk(out, d, vm.kvm);
    }
}

/// A virtual disk: its host disk, engine, iothread and whether its host
/// window splits.
fn render_vdisk(out: &mut String, d: &crate::discover::vms::VDisk, on_kvm: bool) {
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
                    match d.split_support(on_kvm) {
                        Ok(()) => "split (hypervisor, engine, device)".to_string(),
                        Err(why) => format!("not split: {why}"),
                    }
                );
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
