//! The VMs a run knows, by the kernel's slot number: names for every
//! output, and the mirror of what the BPF maps must hold for them.

use super::*;
use crate::discover::disks::Dev;

/// The VMs a run knows, by the slots the kernel side attributes to, and
/// their virtual disks by vdisk slot.
#[derive(Debug, Default)]
pub struct Registry {
    pub vms: std::collections::BTreeMap<u32, Vm>,
    /// vdisk slot -> (VM slot, virtual disk id)
    pub vdisks: std::collections::BTreeMap<u32, (u32, String)>,
    /// vdisk slots whose host windows are split (VDisk::split_supported).
    pub split: std::collections::BTreeSet<u32>,
    /// Engine processes serving running VMs from outside QEMU: pid -> VM
    /// slot (removed when the VM exits).
    pub engines: std::collections::BTreeMap<u32, u32>,
    /// Slots the kernel side handed to QEMU processes that are not VMs:
    /// they run no guest (capability probes), or were gone before they
    /// could be named. Their requests are the host's.
    pub not_vms: std::collections::BTreeMap<u32, NotVm>,
    /// Slots of VMs whose process has exited.
    pub exited: std::collections::BTreeSet<u32>,
    /// VMs not known to run on KVM when named, and when: QEMU creates its
    /// KVM VM after the exec that names it, so one whose accelerator comes
    /// from its configuration (not its command line) is looked at again
    /// (`learn_kvm`).
    pub kvm_unsure: std::collections::BTreeMap<u32, std::time::Instant>,
    /// VMs whose guest's start nothing the tier attaches can see (no kick
    /// seen, its requests from no vCPU): their requests are QEMU's own
    /// until a vCPU thread is seen running (`vcpu_runtime`).
    pub awaiting_run: std::collections::BTreeSet<u32>,
}

/// A QEMU process that is not a VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotVm {
    pub pid: u32,
    pub why: String,
}

/// What the kernel side needs to know of a VM's virtual disks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VmMaps {
    /// Backing file -> vdisk slot.
    pub files: Vec<(crate::abi::FileKey, u32)>,
    /// (VM, host disk) -> its only vdisk there, or VDISK_SEVERAL.
    pub disks: Vec<(crate::abi::VmDevKey, u32)>,
}

impl VmMaps {
    pub fn extend(&mut self, other: VmMaps) {
        self.files.extend(other.files);
        self.disks.extend(other.disks);
    }
}

impl Registry {
    /// Registers a VM under its slot and gives its disks vdisk slots;
    /// returns what the kernel side needs to resolve its requests.
    pub fn add(&mut self, slot: u32, mut vm: Vm) -> VmMaps {
        // An engine serving another VM still running is not this VM's
        // alone: its requests cannot be told apart by process, so they
        // stay the host's (and the disk unsplit, saying why).
        for d in &mut vm.disks {
            if let Some(e) = &d.engine {
                match self.engines.get(&e.pid) {
                    Some(other) if *other != slot => {
                        d.engine_shared = true;
                    }
                    _ => {
                        self.engines.insert(e.pid, slot);
                    }
                }
            }
        }
        let mut maps = VmMaps::default();
        let mut per_dev: std::collections::BTreeMap<Dev, Vec<u32>> = Default::default();
        for d in &vm.disks {
            let vdisk = self.vdisks.len() as u32 + 1;
            self.vdisks.insert(vdisk, (slot, d.id.clone()));
            if let Some(k) = d.file.as_deref().and_then(file_key) {
                maps.files.push((k, vdisk));
            }
            if let Some(dev) = d.host_dev {
                per_dev.entry(dev).or_default().push(vdisk);
            }
        }
        for (dev, vdisks) in per_dev {
            let v = if vdisks.len() == 1 {
                vdisks[0]
            } else {
                crate::abi::VDISK_SEVERAL
            };
            maps.disks.push((
                crate::abi::VmDevKey {
                    vm: slot,
                    dev: dev.0,
                },
                v,
            ));
        }
        if !vm.kvm {
            self.kvm_unsure.insert(slot, std::time::Instant::now());
        }
        self.vms.insert(slot, vm);
        self.mark_split(slot);
        maps
    }

    /// A VM found to run on KVM after it was named: its disks' split
    /// decided again (an NVMe disk's doorbells are KVM's exits). Whether
    /// it was news.
    pub fn learn_kvm(&mut self, slot: u32) -> bool {
        self.kvm_unsure.remove(&slot);
        let Some(vm) = self.vms.get_mut(&slot).filter(|vm| !vm.kvm) else {
            return false;
        };
        vm.kvm = true;
        self.mark_split(slot);
        true
    }

    /// Marks the vdisks of a VM whose host windows split (`split`).
    fn mark_split(&mut self, slot: u32) {
        let Some(vm) = self.vms.get(&slot) else {
            return;
        };
        // A VM's vdisks were numbered in the order of its disks.
        let vdisks = self.vdisks.iter().filter(|(_, (s, _))| *s == slot);
        for ((vdisk, _), d) in vdisks.zip(&vm.disks) {
            if d.split_supported(vm.kvm) {
                self.split.insert(*vdisk);
            }
        }
    }

    /// Whether a slot is a VM's (named, and not found to run no guest).
    pub fn is_vm(&self, slot: u32) -> bool {
        self.vms.contains_key(&slot)
    }

    pub fn name(&self, slot: u32) -> String {
        self.vms
            .get(&slot)
            .map_or_else(|| format!("vm#{slot}"), |v| v.name.clone())
    }

    pub fn vdisk(&self, vdisk: u32) -> Option<&str> {
        self.vdisks.get(&vdisk).map(|(_, id)| id.as_str())
    }

    /// A virtual disk by its slot.
    fn vdisk_def(&self, vdisk: u32) -> Option<&VDisk> {
        let (vm, id) = self.vdisks.get(&vdisk)?;
        self.vms.get(vm)?.disks.iter().find(|d| &d.id == id)
    }

    /// A virtual disk's target dev (libvirt's `vda`), where known.
    pub fn vdisk_target(&self, vdisk: u32) -> Option<&str> {
        self.vdisk_def(vdisk)?.target_dev.as_deref()
    }

    /// How many request queues the host gave a virtual disk.
    pub fn vdisk_queues(&self, vdisk: u32) -> Option<u32> {
        self.vdisk_def(vdisk)?.queues
    }

    /// The QEMU device model of a virtual disk (virtio-blk-pci, nvme, …).
    pub fn vdisk_model(&self, vdisk: u32) -> Option<&str> {
        self.vdisk_def(vdisk)?.model.as_deref()
    }
}
