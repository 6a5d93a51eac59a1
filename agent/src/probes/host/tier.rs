//! Which probes the VM path attaches, by tier (`model::Tier`).
//!
//! The always-on tier attaches no system-call tracepoint: KVM kicks from
//! the guest's exits (`kvm:kvm_mmio`, `kvm:kvm_fast_mmio`), pickups from
//! eventfd reads where fentry or kprobes reach `eventfd_read` (else the
//! engine thread's switch-in after the kick woke it), interrupts from
//! `kvm:kvm_msi_set_irq`; and the kernel joins each request's window
//! (`bpf/include/vm_join.bpf.h`). The deep tier adds, while it runs, the
//! system-call tracepoints of the VM path (eventfd reads and writes, their
//! creation, KVM_IOEVENTFD, the submitting calls), the CPU-wait
//! tracepoint and the per-request uprobes in QEMU (used-ring pushes, its
//! device models taking each request), and streams every VM request.

use aya::programs::{
    fentry::FEntryLinkId, kprobe::KProbeLinkId, trace_point::TracePointLinkId, FEntry, KProbe,
    TracePoint,
};

use super::*;
use crate::{
    abi::TierState,
    model::Tier,
    probes::{attach_linked, error_chain, Attachment, Flavour, LoadError, RawLink},
};

/// How the always-on tier sees kicks and pickups on this kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum KickPath {
    /// No VM yet: nothing of the VM path attached.
    #[default]
    None,
    /// KVM's exits and wake-ups: tracepoints only (no fentry, no kprobes).
    KvmTracepoints,
    /// KVM's exits, and eventfd reads and writes through fentry or a
    /// kprobe (a TCG guest's kicks are seen too).
    Eventfd(&'static str),
}

/// A link the deep tier made, to undo when it stops.
enum DeepLink {
    Tracepoint(String, TracePointLinkId),
    Raw(String, RawLink),
}

/// What the VM path has attached, and the tier of the moment.
pub struct TierProbes {
    pub tier: Tier,
    /// The deep tier's links (empty in the always-on tier).
    deep_links: Vec<DeepLink>,
    /// The deep tier's watch of notifiers being made (attached from the
    /// start of a deep run, or when the tier is switched on).
    notifier_watch: bool,
    pub kick_path: KickPath,
    /// Programs the always-on tier attached on KVM's events.
    kvm: bool,
    /// sched_waking attached (KVM notifiers, TCG kicks, hand-offs).
    waking: bool,
    /// fentry/kprobe links on eventfd_read and eventfd_write.
    eventfd_links: Vec<EventfdLink>,
    handoff: bool,
    one_in: u32,
    slower_than_ns: u64,
    /// Flavours the run was told never to use (`--avoid`).
    pub(super) avoid: Vec<Flavour>,
}

enum EventfdLink {
    Fentry(String, FEntryLinkId),
    Kprobe(String, KProbeLinkId),
}

impl TierProbes {
    pub fn new(tier: Tier, avoid: &[Flavour]) -> Self {
        Self {
            avoid: avoid.to_vec(),
            tier,
            deep_links: Vec::new(),
            notifier_watch: false,
            kick_path: KickPath::None,
            kvm: false,
            waking: false,
            eventfd_links: Vec::new(),
            handoff: false,
            one_in: 0,
            slower_than_ns: 0,
        }
    }

    fn state(&self) -> TierState {
        TierState {
            deep: u32::from(self.tier.is_deep()),
            handoff: u32::from(self.handoff),
            one_in: self.one_in,
            pick_at_read: u32::from(matches!(self.kick_path, KickPath::Eventfd(_))),
            slower_than_ns: self.slower_than_ns,
        }
    }

    /// Whether eventfd writes of TCG guests' vCPUs are seen (fentry or a
    /// kprobe on eventfd_write), so their windows can be split here
    /// without system-call tracepoints.
    pub fn sees_eventfd_writes(&self) -> bool {
        matches!(self.kick_path, KickPath::Eventfd(_))
    }
}

/// The system-call tracepoints of the deep tier's notifier watch: a new
/// VM's eventfds, their registration with KVM and vhost, their closing.
const NOTIFIER_WATCH: [&str; 5] = [
    "sys_exit_eventfd2",
    "sys_exit_eventfd",
    "sys_enter_ioctl",
    "sys_exit_ioctl",
    "sys_enter_close",
];

/// The deep tier's per-request system-call tracepoints: kicks and pickups
/// on eventfds, and the submitting calls that end a pickup's batch.
const DEEP_SYSCALLS: [&str; 4] = [
    "sys_enter_write",
    "sys_enter_read",
    "sys_enter_io_uring_enter",
    "sys_enter_io_submit",
];

impl BlockProbes {
    /// Tells the kernel side the tier and what it streams.
    pub(super) fn write_tier(&mut self, one_in: u32, slower_than_ns: u64) -> Result<(), LoadError> {
        self.tier.one_in = one_in;
        self.tier.slower_than_ns = slower_than_ns;
        self.store_tier()
    }

    fn store_tier(&mut self) -> Result<(), LoadError> {
        let state = self.tier.state();
        let mut m: Array<_, TierState> = map_mut_of(&mut self.ebpf, "tier")?;
        m.set(0, state, 0).map_err(LoadError::map_op("tier"))
    }

    /// Loads (verifies) the VM path's programs without attaching them:
    /// the verifier takes its time over the larger ones, and a VM started
    /// later must have its first requests followed. A program that does
    /// not load here fails again, and is reported, where it is attached.
    pub(super) fn preload_vm_programs(&mut self) {
        let t = std::time::Instant::now();
        // The start probe this kernel will use, not both: each is one of
        // the larger programs to verify.
        let start = if super::has_block_io_start(self.btf.as_ref()) {
            "block_io_start"
        } else {
            "block_rq_insert"
        };
        let raw = [
            start,
            "block_bio_backmerge",
            "block_bio_frontmerge",
            "block_rq_merge",
            "sched_waking",
            "sched_wakeup_new",
            "sched_switch",
            "sched_wakeup",
        ];
        for tp in raw {
            let name = match self.flavour {
                Flavour::TpBtf => format!("{tp}_btf"),
                _ => tp.to_string(),
            };
            let r = match (
                self.ebpf.program_mut(&name),
                self.flavour,
                self.btf.as_ref(),
            ) {
                (Some(p), Flavour::TpBtf, Some(btf)) => {
                    <&mut aya::programs::BtfTracePoint>::try_from(p)
                        .ok()
                        .map(|p| p.load(tp, btf))
                }
                (Some(p), Flavour::RawTp, _) => <&mut aya::programs::RawTracePoint>::try_from(p)
                    .ok()
                    .map(|p| p.load()),
                _ => None,
            };
            if let Some(Err(e)) = r {
                log::debug!("{name} not preloaded: {}", error_chain(&e));
            }
        }
        let tracepoints = [
            "kvm_mmio",
            "kvm_fast_mmio",
            "kvm_msi_set_irq",
            "io_uring_queue_async_work",
        ];
        let uprobes = [
            "virtqueue_flush",
            "msix_notify",
            "vu_queue_push",
            "block_acct_start",
            "block_acct_merge_done",
        ];
        for name in tracepoints {
            if let Some(Err(e)) = self
                .ebpf
                .program_mut(name)
                .and_then(|p| <&mut TracePoint>::try_from(p).ok())
                .map(|p| p.load())
            {
                log::debug!("{name} not preloaded: {}", error_chain(&e));
            }
        }
        for name in uprobes {
            if let Some(Err(e)) = self
                .ebpf
                .program_mut(name)
                .and_then(|p| <&mut aya::programs::UProbe>::try_from(p).ok())
                .map(|p| p.load())
            {
                log::debug!("{name} not preloaded: {}", error_chain(&e));
            }
        }
        log::debug!("VM programs verified in {:?}", t.elapsed());
    }

    /// The deep tier's watch of notifiers being made (system calls).
    pub(super) fn attach_notifier_watch(&mut self) -> Result<(), LoadError> {
        if self.tier.notifier_watch {
            return Ok(());
        }
        for name in NOTIFIER_WATCH {
            self.attach_deep_syscall(name)?;
        }
        self.tier.notifier_watch = true;
        Ok(())
    }

    /// What a VM needs, attached when the first one appears: without VMs no
    /// request pays for them. The start probe (its requests' submitter),
    /// merges, and the VM path of the tier.
    pub fn ensure_vm_probes(&mut self) -> Result<(), LoadError> {
        self.ensure_start_probe()?;
        if self.vm_probes {
            return Ok(());
        }
        // Bios merged into a VM's requests, and whole requests merged into
        // others before issue: guest requests with no host request of
        // their own.
        for name in [
            "block_bio_backmerge",
            "block_bio_frontmerge",
            "block_rq_merge",
        ] {
            self.attach_raw(name)?;
        }
        if self.vm_segments {
            self.attach_always_on()?;
            if self.tier.tier.is_deep() {
                self.attach_deep()?;
            }
        }
        self.vm_probes = true;
        Ok(())
    }

    /// The always-on tier's VM path: no system-call tracepoint.
    fn attach_always_on(&mut self) -> Result<(), LoadError> {
        self.tier.kick_path = KickPath::KvmTracepoints;
        if let Some(flavour) = self.attach_eventfd_probes() {
            self.tier.kick_path = KickPath::Eventfd(flavour);
        }
        if kvm_tracepoints() {
            for name in ["kvm_mmio", "kvm_fast_mmio", "kvm_msi_set_irq"] {
                self.attach_tracepoint("kvm", name)?;
            }
            self.tier.kvm = true;
        } else {
            log::info!(
                "no kvm tracepoints (kvm module not loaded): KVM guests' kicks are not followed"
            );
        }
        // Which thread a KVM notifier's kick is for, learnt from the
        // wake-up it makes; and where no eventfd read is seen, the pickup
        // at that thread's switch-in.
        if self.tier.kvm {
            self.attach_wakeups("sched_waking")?;
            self.tier.waking = true;
            if !self.tier.sees_eventfd_writes() {
                self.ensure_switch_probe()?;
            }
        }
        // io_uring requests a busy device refused without waiting are
        // issued by an io-wq worker: the submitter's pick goes with them.
        if io_uring_tracepoints() {
            self.attach_tracepoint("io_uring", "io_uring_queue_async_work")?;
        } else {
            log::info!(
                "no io_uring tracepoints: requests io_uring hands to its workers are not split"
            );
        }
        self.store_tier()
    }

    /// fentry (else a kprobe) on eventfd_read and eventfd_write: kicks of
    /// TCG guests and exact pickups, paid only by eventfd reads and
    /// writes. None where the kernel allows neither.
    fn attach_eventfd_probes(&mut self) -> Option<&'static str> {
        let btf = self.btf.clone();
        let mut fentry = Vec::new();
        let avoid_fentry = self.tier.avoid.contains(&Flavour::Fentry);
        let ok = !avoid_fentry
            && ["eventfd_read", "eventfd_write"].iter().all(|f| {
                match attach_fentry(&mut self.ebpf, btf.as_ref(), f) {
                    Ok(l) => {
                        fentry.push(l);
                        true
                    }
                    Err(e) => {
                        log::info!("fentry on {f}: {e}");
                        false
                    }
                }
            });
        if ok {
            self.note_eventfd(&fentry, Flavour::Fentry);
            self.tier.eventfd_links = fentry;
            return Some("fentry");
        }
        self.detach_eventfd(fentry);
        let mut kprobes = Vec::new();
        let avoid_kprobe = self.tier.avoid.contains(&Flavour::Kprobe);
        let ok = !avoid_kprobe
            && ["eventfd_read", "eventfd_write"].iter().all(|f| {
                match attach_kprobe(&mut self.ebpf, f) {
                    Ok(l) => {
                        kprobes.push(l);
                        true
                    }
                    Err(e) => {
                        log::info!("kprobe on {f}: {e}");
                        false
                    }
                }
            });
        if ok {
            self.note_eventfd(&kprobes, Flavour::Kprobe);
            self.tier.eventfd_links = kprobes;
            return Some("kprobe");
        }
        self.detach_eventfd(kprobes);
        log::info!("no fentry or kprobe on eventfd_read/eventfd_write: KVM guests' pickups come from their engine thread's wake-up, TCG guests' kicks are seen only by the deep tier");
        None
    }

    fn note_eventfd(&mut self, links: &[EventfdLink], flavour: Flavour) {
        for l in links {
            let (EventfdLink::Fentry(f, _) | EventfdLink::Kprobe(f, _)) = l;
            log::info!("attached {f} via {}", flavour.as_str());
            self.attachments.push(Attachment {
                tracepoint: f.clone(),
                flavour,
                program: format!("{f}_{}", flavour.as_str()),
            });
        }
    }

    fn detach_eventfd(&mut self, links: Vec<EventfdLink>) {
        for l in links {
            let r = match l {
                EventfdLink::Fentry(f, id) => self
                    .ebpf
                    .program_mut(&format!("{f}_fentry"))
                    .and_then(|p| <&mut FEntry>::try_from(p).ok())
                    .map(|p| p.detach(id)),
                EventfdLink::Kprobe(f, id) => self
                    .ebpf
                    .program_mut(&format!("{f}_kprobe"))
                    .and_then(|p| <&mut KProbe>::try_from(p).ok())
                    .map(|p| p.detach(id)),
            };
            if let Some(Err(e)) = r {
                log::warn!("detaching an eventfd probe: {}", error_chain(&e));
            }
        }
    }

    /// The hand-off of kicks from an engine thread to the worker threads
    /// it wakes (aio=threads): a program run per wake-up on the whole
    /// host, so only once a VM needs it.
    pub fn ensure_handoff_probe(&mut self) -> Result<(), LoadError> {
        if !self.vm_segments || self.tier.handoff {
            return Ok(());
        }
        if !self.tier.waking {
            self.attach_wakeups("sched_waking")?;
            self.tier.waking = true;
        }
        self.attach_raw("sched_wakeup_new")?;
        self.tier.handoff = true;
        self.store_tier()
    }

    /// The one program on context switches (`bpf/sched.bpf.c`).
    pub fn ensure_switch_probe(&mut self) -> Result<(), LoadError> {
        if !self.switch_probe {
            self.attach_raw("sched_switch")?;
            self.switch_probe = true;
        }
        Ok(())
    }

    /// Switches the tier while loaded (an API run of the deep tier): the
    /// deep tier's probes attached, or detached again.
    pub fn set_tier(&mut self, tier: Tier) -> Result<(), LoadError> {
        if tier == self.tier.tier || !self.vm_segments {
            self.tier.tier = tier;
            return Ok(());
        }
        self.tier.tier = tier;
        if tier.is_deep() {
            self.attach_notifier_watch()?;
            if self.vm_probes {
                self.attach_deep()?;
            }
            self.store_tier()?;
        } else {
            // The kernel side stops streaming first, then the probes go.
            self.store_tier()?;
            self.detach_deep();
        }
        Ok(())
    }

    /// The deep tier's per-request probes.
    fn attach_deep(&mut self) -> Result<(), LoadError> {
        for name in DEEP_SYSCALLS {
            self.attach_deep_syscall(name)?;
        }
        // The VM threads' waits for a CPU (`…_cpu_wait`).
        let (a, link) = attach_linked(
            &mut self.ebpf,
            self.btf.as_ref(),
            "sched_wakeup",
            self.flavour,
        )?;
        self.attachments.push(a);
        self.tier
            .deep_links
            .push(DeepLink::Raw("sched_wakeup".into(), link));
        let nested = self.attach_nested("sched_wakeup")?;
        self.tier.deep_links.push(DeepLink::Raw(
            super::nesting::second_program("sched_wakeup"),
            nested,
        ));
        self.ensure_switch_probe()
    }

    fn attach_deep_syscall(&mut self, name: &str) -> Result<(), LoadError> {
        let link = self.attach_tracepoint_linked("syscalls", name)?;
        self.tier
            .deep_links
            .push(DeepLink::Tracepoint(name.into(), link));
        Ok(())
    }

    /// Detaches the deep tier's tracepoints (its uprobes in VM processes
    /// follow each VM's `attach_vm_uprobes`, which the caller runs again).
    fn detach_deep(&mut self) {
        for link in std::mem::take(&mut self.tier.deep_links) {
            let (name, r) = match link {
                DeepLink::Tracepoint(name, id) => {
                    let r = self
                        .ebpf
                        .program_mut(&name)
                        .and_then(|p| <&mut TracePoint>::try_from(p).ok())
                        .map(|p| p.detach(id));
                    (format!("syscalls:{name}"), r)
                }
                DeepLink::Raw(name, RawLink::Btf(id)) => {
                    let r = self
                        .ebpf
                        .program_mut(&format!("{name}_btf"))
                        .and_then(|p| <&mut aya::programs::BtfTracePoint>::try_from(p).ok())
                        .map(|p| p.detach(id));
                    (name, r)
                }
                DeepLink::Raw(name, RawLink::Raw(id)) => {
                    let r = self
                        .ebpf
                        .program_mut(&name)
                        .and_then(|p| <&mut aya::programs::RawTracePoint>::try_from(p).ok())
                        .map(|p| p.detach(id));
                    (name, r)
                }
            };
            match r {
                Some(Ok(())) => self.attachments.retain(|a| a.tracepoint != name),
                Some(Err(e)) => log::warn!("detaching {name}: {}", error_chain(&e)),
                None => log::warn!("detaching {name}: program not found"),
            }
        }
        self.tier.notifier_watch = false;
    }

    /// A CATEGORY:NAME tracepoint program of the same name, with its link.
    pub(super) fn attach_tracepoint_linked(
        &mut self,
        category: &str,
        name: &str,
    ) -> Result<TracePointLinkId, LoadError> {
        mount_tracefs();
        let tracepoint = format!("{category}:{name}");
        let prog = self
            .ebpf
            .program_mut(name)
            .ok_or_else(|| LoadError::MissingProgram {
                program: name.into(),
            })?;
        let result = (|| -> Result<TracePointLinkId, String> {
            let p: &mut TracePoint = prog.try_into().map_err(|e| format!("{e:#}"))?;
            if p.fd().is_err() {
                p.load().map_err(|e| error_chain(&e))?;
            }
            p.attach(category, name).map_err(|e| error_chain(&e))
        })();
        let link = result.map_err(|reason| LoadError::Attach {
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
        Ok(link)
    }
}

fn attach_fentry(ebpf: &mut Ebpf, btf: Option<&Btf>, f: &str) -> Result<EventfdLink, String> {
    let name = format!("{f}_fentry");
    let btf = btf.ok_or("no kernel BTF")?;
    let p = ebpf
        .program_mut(&name)
        .ok_or_else(|| format!("program {name} missing"))?;
    let p: &mut FEntry = p.try_into().map_err(|e| format!("{e:#}"))?;
    if p.fd().is_err() {
        p.load(f, btf).map_err(|e| error_chain(&e))?;
    }
    p.attach()
        .map(|l| EventfdLink::Fentry(f.to_string(), l))
        .map_err(|e| error_chain(&e))
}

fn attach_kprobe(ebpf: &mut Ebpf, f: &str) -> Result<EventfdLink, String> {
    kprobe_on(ebpf, &format!("{f}_kprobe"), f).map(|l| EventfdLink::Kprobe(f.to_string(), l))
}

/// Loads (once) and attaches kprobe program `program` on kernel function
/// `function` (or its return, for a kretprobe program).
pub(super) fn kprobe_on(
    ebpf: &mut Ebpf,
    program: &str,
    function: &str,
) -> Result<KProbeLinkId, String> {
    let p = ebpf
        .program_mut(program)
        .ok_or_else(|| format!("program {program} missing"))?;
    let p: &mut KProbe = p.try_into().map_err(|e| format!("{e:#}"))?;
    if p.fd().is_err() {
        p.load().map_err(|e| error_chain(&e))?;
    }
    p.attach(function, 0).map_err(|e| error_chain(&e))
}
