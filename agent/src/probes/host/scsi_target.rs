//! LIO's commands for a kernel vhost-scsi worker's VM
//! (`bpf/scsi_target.bpf.c`): kprobes on target_core_mod's
//! `target_init_cmd` (the worker prepares a command) and
//! `__target_execute_cmd` (a task executes it, the backstore's submission
//! inside), so that requests LIO's workqueue submits for a VM are the VM's.
//! Attached when the first VM with a kernel vhost disk is followed, where
//! LIO is loaded and kprobes work; fentry is not used: these are module
//! functions.

use aya::programs::KProbe;

use super::BlockProbes;
use crate::probes::{Attachment, Flavour};

/// (program, kernel function).
const PROBES: [(&str, &str); 3] = [
    ("target_init_cmd_kprobe", "target_init_cmd"),
    ("target_execute_kprobe", "__target_execute_cmd"),
    ("target_execute_kretprobe", "__target_execute_cmd"),
];

/// Whether LIO's core is loaded: the programs then have a function to
/// attach to, and a request start looks up whom its task acts for.
pub(super) fn lio_loaded() -> bool {
    std::path::Path::new("/sys/module/target_core_mod").exists()
}

impl BlockProbes {
    /// The LIO probes, all or none, once: without one of them no command
    /// is followed to its submitter (said in the log; the commands'
    /// requests are then counted as the submitting task's).
    pub fn ensure_scsi_target(&mut self) {
        let attached_already = self.attachments.iter().any(|a| a.program == PROBES[0].0);
        if attached_already || self.tier.avoid.contains(&Flavour::Kprobe) || !lio_loaded() {
            return;
        }
        let mut attached = Vec::new();
        for (program, function) in PROBES {
            match super::tier::kprobe_on(&mut self.ebpf, program, function) {
                Ok(_) => attached.push(Attachment {
                    tracepoint: function.into(),
                    flavour: Flavour::Kprobe,
                    program: program.into(),
                }),
                Err(e) => {
                    log::info!(
                        "kprobe {program} on {function}: {e}: a vhost-scsi worker's commands \
                         submitted by LIO's workqueue are counted as the host's"
                    );
                    self.detach_scsi_target();
                    return;
                }
            }
        }
        for a in &attached {
            log::info!("attached {} via kprobe", a.tracepoint);
        }
        self.attachments.extend(attached);
    }

    /// Unloading a program detaches its links.
    fn detach_scsi_target(&mut self) {
        for (program, _) in PROBES {
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
