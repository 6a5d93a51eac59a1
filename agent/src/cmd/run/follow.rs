//! The VMs a run follows: named as they appear, their probes attached and
//! engines found, let go when they exit.

use std::sync::Mutex;

use crate::{
    discover::vms::{self, Registry},
    probes::host::BlockProbes,
};

/// Names VM slots the kernel side handed out since the last look, and
/// tells it their backing files. A QEMU process that runs no guest (a
/// capability probe), or is gone before it could be named, is let go: its
/// requests are the host's, and it is counted, not shown.
/// Returns the guest channels of the VMs it named.
pub(super) fn name_new_vms(probes: &mut BlockProbes, known: &Mutex<Registry>) -> Vec<GuestChannel> {
    let mut channels = Vec::new();
    let Ok(pids) = probes.vm_pids() else {
        return channels;
    };
    let mut known = known.lock().unwrap_or_else(|p| p.into_inner());
    for (tgid, slot) in pids {
        if known.vms.contains_key(&slot) || known.not_vms.contains_key(&slot) {
            continue;
        }
        let vm = match vms::identify_within(tgid, vms::IDENTIFY_LIMIT) {
            Some(vm) if vm.not_vm.is_none() => vm,
            other => {
                let why = other
                    .and_then(|v| v.not_vm)
                    .unwrap_or_else(|| "gone before it could be named".to_string());
                log::debug!("QEMU pid {tgid} is not a VM: {why}");
                if let Err(e) = probes
                    .forget_vm(tgid, slot)
                    .and_then(|()| probes.retire_vm(slot, &[], false))
                {
                    log::warn!("QEMU pid {tgid}: {}", crate::probes::error_chain(&e));
                }
                known.not_vms.insert(slot, vms::NotVm { pid: tgid, why });
                continue;
            }
        };
        {
            log::info!(
                "VM {} (pid {tgid}) with disks {:?}",
                vm.name,
                vm.disks.iter().map(|d| &d.id).collect::<Vec<_>>()
            );
            if let Some(src) = &vm.channel {
                channels.push((slot, vm.pid, src.clone()));
            }
            let named_threads = vm.named_threads;
            // Its disks first: the kernel side names its requests' virtual
            // disks from them, and its firmware reads as soon as it runs;
            // attaching probes (reading QEMU's symbols) takes longer.
            let maps = known.add(slot, vm);
            if let Err(e) = probes.add_vm_maps(&maps) {
                log::warn!("VM pid {tgid}: {}", crate::probes::error_chain(&e));
            }
            // A VM's requests need their submitter taken at their start, and
            // its notifications followed: what the tier then sees of its
            // kicks is known.
            if let Err(e) = probes.ensure_vm_probes() {
                log::warn!("VM attribution off: {}", crate::probes::error_chain(&e));
            }
            // Exec'd while the probes ran: in the deep tier its notifiers
            // were seen created.
            let kicks = known
                .vms
                .get(&slot)
                .map(|vm| kick_source(probes, vm, true))
                .unwrap_or_default();
            if let Some(vm) = known.vms.get_mut(&slot) {
                vm.kicks = kicks;
            }
            // No vCPU to see start the guest, or its start may have come
            // before the start probe was attached (a VM exec'd while the
            // agent started): its requests are the guest's from here
            // (QEMU's own start-up reads included), its disks now known.
            // No kick of it to be seen (TCG): from its vCPUs seen running,
            // after QEMU's own reads as it realizes and activates its drives.
            if !named_threads || !probes.saw_start_of(tgid) {
                if let Err(e) = probes.mark_started(tgid) {
                    log::warn!("VM pid {tgid}: {}", crate::probes::error_chain(&e));
                }
            } else if kicks == vms::KickSource::NotSeen {
                known.awaiting_run.insert(slot);
            }
            if let Some(vm) = known.vms.get(&slot) {
                attach_vm_probes(probes, slot, vm);
                add_engines(probes, slot, vm);
            }
        }
    }
    channels
}

/// VMs waiting for their guest to be seen running (`Registry::awaiting_run`)
/// whose vCPU threads have now run: their requests are the guest's from
/// here. Exited ones are let go.
pub(super) fn start_vms_that_ran(probes: &mut BlockProbes, known: &Mutex<Registry>) {
    let mut known = known.lock().unwrap_or_else(|p| p.into_inner());
    let mut done = Vec::new();
    for slot in &known.awaiting_run {
        let Some(vm) = known.vms.get(slot).filter(|_| !known.exited.contains(slot)) else {
            done.push(*slot);
            continue;
        };
        match vms::vcpu_runtime(vm.pid) {
            Some(ran) if ran >= vms::VCPU_RAN => {
                if let Err(e) = probes.mark_started(vm.pid) {
                    log::warn!("VM pid {}: {}", vm.pid, crate::probes::error_chain(&e));
                }
                done.push(*slot);
            }
            Some(_) => {}
            None if !vms::alive(vm) => done.push(*slot),
            None => {}
        }
    }
    for slot in done {
        known.awaiting_run.remove(&slot);
    }
}

/// How long after its naming a VM not known to run on KVM is looked at
/// again for a KVM VM of its own.
const KVM_LOOK: std::time::Duration = std::time::Duration::from_secs(30);

/// VMs named before they created their KVM VM (`Registry::kvm_unsure`),
/// looked at again: one now holding a KVM VM has its kicks taken from
/// KVM's exits and its disks split as a KVM VM's, its probes chosen again.
pub(super) fn learn_late_kvm(probes: &mut BlockProbes, known: &Mutex<Registry>) {
    let mut known = known.lock().unwrap_or_else(|p| p.into_inner());
    if known.kvm_unsure.is_empty() {
        return;
    }
    let mut learnt = Vec::new();
    let mut dropped = Vec::new();
    for (slot, since) in &known.kvm_unsure {
        let Some(vm) = known.vms.get(slot).filter(|_| !known.exited.contains(slot)) else {
            dropped.push(*slot);
            continue;
        };
        if vms::holds_kvm_vm(vm.pid) {
            learnt.push(*slot);
        } else if since.elapsed() >= KVM_LOOK {
            dropped.push(*slot);
        }
    }
    for slot in dropped {
        known.kvm_unsure.remove(&slot);
    }
    for slot in learnt {
        if !known.learn_kvm(slot) {
            continue;
        }
        let Some(vm) = known.vms.get_mut(&slot) else {
            continue;
        };
        let watched = vm.kicks == vms::KickSource::QueueNotifiers;
        vm.kicks = kick_source(probes, vm, watched);
        log::info!(
            "VM {} (pid {}) runs on KVM: its kicks are {:?}",
            vm.name,
            vm.pid,
            vm.kicks
        );
        attach_vm_probes(probes, slot, vm);
    }
}

/// Lets go of VMs whose process has exited: their probes are detached and
/// their pid no longer names them. They stay in the registry: the report
/// still names their requests.
pub(super) fn forget_exited_vms(
    probes: &mut BlockProbes,
    known: &Mutex<Registry>,
    exited: &mut std::collections::BTreeSet<u32>,
) {
    let mut known = known.lock().unwrap_or_else(|p| p.into_inner());
    let known = &mut *known;
    for (slot, vm) in known.vms.iter() {
        if exited.contains(slot) {
            continue;
        }
        let vm_alive = vms::alive(vm);
        // An engine goes with its VM, or alone when it exits first (its
        // pid must not name the VM for whoever is given it next).
        for e in vm.engines() {
            if known.engines.get(&e.pid) != Some(slot) || (vm_alive && vms::engine_alive(e)) {
                continue;
            }
            known.engines.remove(&e.pid);
            match probes.forget_vm(e.pid, *slot) {
                Ok(()) => log::info!(
                    "{} (pid {}) no longer serves VM {}: its probes detached",
                    e.program,
                    e.pid,
                    vm.name
                ),
                Err(err) => log::warn!(
                    "{} (pid {}): {}",
                    e.program,
                    e.pid,
                    crate::probes::error_chain(&err)
                ),
            }
        }
        if vm_alive {
            continue;
        }
        exited.insert(*slot);
        known.exited.insert(*slot);
        let vdisks: Vec<u32> = known
            .vdisks
            .iter()
            .filter(|(_, (owner, _))| owner == slot)
            .map(|(v, _)| *v)
            .collect();
        match probes
            .forget_vm(vm.pid, *slot)
            .and_then(|()| probes.retire_vm(*slot, &vdisks, true))
        {
            Ok(()) => log::info!(
                "VM {} (pid {}) exited: its probes detached",
                vm.name,
                vm.pid
            ),
            Err(e) => log::warn!("VM {} exited: {}", vm.name, crate::probes::error_chain(&e)),
        }
    }
}

/// Registers the engine processes serving a VM's disks from outside QEMU
/// under its slot (those not also serving another VM: `Registry::add`).
pub(super) fn add_engines(probes: &mut BlockProbes, slot: u32, vm: &vms::Vm) {
    for d in vm.disks.iter().filter(|d| d.engine_shared) {
        log::warn!(
            "VM {} disk {}: {}",
            vm.name,
            d.id,
            d.split_support(vm.kvm).err().unwrap_or_default()
        );
    }
    for e in vm.engines() {
        match probes.add_engine(e, slot) {
            Ok(()) => log::info!(
                "VM {}: disks served by {} (pid {}, export {})",
                vm.name,
                e.program,
                e.pid,
                e.export
            ),
            Err(err) => log::warn!(
                "VM {}: {} (pid {}) not followed: {}",
                vm.name,
                e.program,
                e.pid,
                crate::probes::error_chain(&err)
            ),
        }
    }
}

/// A VM's guest channel: its slot, its process, the chardev's socket.
pub(super) type GuestChannel = (u32, u32, vms::SocketSource);

/// The guest channels of the VMs known now.
pub(super) fn guest_channels(known: &Registry) -> Vec<GuestChannel> {
    known
        .vms
        .iter()
        .filter_map(|(slot, vm)| Some((*slot, vm.pid, vm.channel.clone()?)))
        .collect()
}

/// The per-VM probes: the worker hand-off for aio=threads disks, the
/// worker switch-in and MSI for kernel vhost disks, and the
/// probes that end its host windows. A failure costs the VM its split,
/// not the run.
pub(super) fn attach_vm_probes(probes: &mut BlockProbes, slot: u32, vm: &vms::Vm) {
    let mut flags = 0;
    if !vm.disks.iter().any(|d| d.split_supported(vm.kvm)) {
        if let Err(e) = probes.exempt_from_stop(vm.pid) {
            log::warn!("VM {}: {}", vm.name, crate::probes::error_chain(&e));
        }
    }
    // Probes some disks need, shared by every VM that has such a disk.
    let needs = |kind: fn(&vms::VDisk) -> bool| {
        vm.disks
            .iter()
            .any(|d| d.split_supported(vm.kvm) && kind(d))
    };
    let unsplit = |what: &str, e: crate::probes::LoadError| {
        log::warn!(
            "VM {}: {what} disks not split: {}",
            vm.name,
            crate::probes::error_chain(&e)
        )
    };
    if needs(vms::VDisk::worker_submitted) {
        if let Err(e) = probes.ensure_handoff_probe() {
            unsplit("aio=threads", e);
        }
    }
    if needs(vms::VDisk::kernel_vhost) {
        // Its vhost workers' interrupts end its windows (vhost-net's, of a
        // VM without a vhost disk, do not).
        flags |= crate::abi::VMF_VHOST;
    }
    if vm.disks.iter().any(vms::VDisk::kernel_vhost) {
        // LIO's workqueue submits its worker's commands: followed to it,
        // and timed from the kick to the worker's signal.
        use crate::probes::host::VhostScsiProbes;
        if probes.ensure_scsi_target() == VhostScsiProbes::Split {
            flags |= crate::abi::VMF_VHOST_SIGNAL;
        }
    }
    if vm.channel.is_some() {
        // Its guest agent joins each request: the kernel streams them all.
        flags |= crate::abi::VMF_STREAM_ALL;
    }
    if let Err(e) = probes.set_vm_flags(slot, flags) {
        log::warn!("VM {}: {}", vm.name, crate::probes::error_chain(&e));
    }
    if let Err(e) = probes.attach_vm_uprobes(vm) {
        log::warn!(
            "VM {}: no host-window split or merge count: {}",
            vm.name,
            crate::probes::error_chain(&e)
        );
    }
}

/// Where a VM's kicks come from, by the tier and what the kernel shows:
/// `watched` when it was exec'd while the probes ran.
pub(super) fn kick_source(probes: &BlockProbes, vm: &vms::Vm, watched: bool) -> vms::KickSource {
    if probes.tier.tier.is_deep() {
        return if watched {
            vms::KickSource::QueueNotifiers
        } else {
            vms::KickSource::AnyVcpuEventfd
        };
    }
    if vm.kvm {
        vms::KickSource::KvmExits
    } else if probes.tier.sees_eventfd_writes() {
        vms::KickSource::AnyVcpuEventfd
    } else {
        vms::KickSource::NotSeen
    }
}
