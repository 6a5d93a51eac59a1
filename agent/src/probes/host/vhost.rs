//! The kernel's vhost workers (`bpf/vhost.bpf.c`).

use super::*;
use crate::probes::LoadError;

impl BlockProbes {
    /// What a kernel vhost worker's disks need: the worker's switch-in
    /// after a kick (its pickup) and the MSI it raises through the irqfd
    /// (the end of its host windows). The switch costs a program run per
    /// context switch on the whole host, so attached only once a VM needs
    /// it.
    pub fn ensure_vhost_probes(&mut self) -> Result<(), LoadError> {
        if !self.vm_segments || self.vhost_probes {
            return Ok(());
        }
        self.ensure_switch_probe()?;
        self.attach_tracepoint("kvm", "kvm_msi_set_irq")?;
        self.vhost_probes = true;
        Ok(())
    }
}
