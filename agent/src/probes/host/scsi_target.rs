//! A kernel vhost-scsi worker's commands, kick to submission
//! (`bpf/scsi_target.bpf.c`, `vhost_signal` in `bpf/signals.bpf.c`).
//! LIO's: kprobes on target_core_mod's `target_init_cmd` (the worker pops
//! and prepares a command) and `__target_execute_cmd` (a task executes it,
//! the backstore's submission inside), so that requests LIO's workqueue
//! submits for a VM are the VM's. vhost's: `vhost_poll_wakeup` (the
//! guest's kick), `vhost_disable_notify` (the worker starts a batch) and
//! `vhost_signal` (the interrupt), so that they are split. Attached when
//! the first VM with a kernel vhost disk is followed, where LIO is loaded
//! and kprobes work; fentry is not used: these are module functions.

use aya::programs::KProbe;

use super::BlockProbes;
use crate::probes::{Attachment, Flavour};

/// (program, kernel function): LIO's, which make the commands the VM's.
const LIO_PROBES: [(&str, &str); 3] = [
    ("target_init_cmd_kprobe", "target_init_cmd"),
    ("target_execute_kprobe", "__target_execute_cmd"),
    ("target_execute_kretprobe", "__target_execute_cmd"),
];

/// vhost's, which time them: without LIO's they have nothing to time.
const VHOST_PROBES: [(&str, &str); 3] = [
    ("vhost_poll_wakeup_kprobe", "vhost_poll_wakeup"),
    ("vhost_disable_notify_kprobe", "vhost_disable_notify"),
    ("vhost_signal_kprobe", "vhost_signal"),
];

/// Whether LIO's core is loaded: the programs then have a function to
/// attach to, and a request start looks up whom its task acts for.
pub(super) fn lio_loaded() -> bool {
    std::path::Path::new("/sys/module/target_core_mod").exists()
}

/// What the probes of vhost-scsi VMs give.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VhostScsiProbes {
    /// None: a worker's commands LIO's workqueue submits are the host's.
    None,
    /// The commands are the VM's, not split.
    Attributed,
    /// The commands are the VM's and split (their vhost workers' signals
    /// end their windows: `VMF_VHOST_SIGNAL`).
    Split,
}

impl BlockProbes {
    /// The vhost-scsi probes, once: each set all or none (said in the log
    /// when one fails).
    pub fn ensure_scsi_target(&mut self) -> VhostScsiProbes {
        if self.tier.avoid.contains(&Flavour::Kprobe) || !lio_loaded() {
            return VhostScsiProbes::None;
        }
        if !self.probe_set(&LIO_PROBES, "are counted as the host's") {
            return VhostScsiProbes::None;
        }
        if !self.probe_set(&VHOST_PROBES, "are not split") {
            return VhostScsiProbes::Attributed;
        }
        VhostScsiProbes::Split
    }

    /// `probes` attached (already, or now), or none of them.
    fn probe_set(&mut self, probes: &[(&str, &str)], without: &str) -> bool {
        if self.attachments.iter().any(|a| a.program == probes[0].0) {
            return true;
        }
        let mut attached = Vec::new();
        for &(program, function) in probes {
            match super::tier::kprobe_on(&mut self.ebpf, program, function) {
                Ok(_) => attached.push(Attachment {
                    tracepoint: function.into(),
                    flavour: Flavour::Kprobe,
                    program: program.into(),
                }),
                Err(e) => {
                    log::warn!(
                        "kprobe {program} on {function}: {e}: a vhost-scsi worker's commands {without}"
                    );
                    self.unload(probes);
                    return false;
                }
            }
        }
        for a in &attached {
            log::info!("attached {} via kprobe", a.tracepoint);
        }
        self.attachments.extend(attached);
        true
    }

    /// Unloading a program detaches its links.
    fn unload(&mut self, probes: &[(&str, &str)]) {
        for &(program, _) in probes {
            if let Some(p) = self
                .ebpf
                .program_mut(program)
                .and_then(|p| <&mut KProbe>::try_from(p).ok())
            {
                let _ = p.unload();
            }
        }
    }
}
