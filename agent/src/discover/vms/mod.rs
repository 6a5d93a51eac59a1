//! The VMs on the host and their virtual disks, as every output names them:
//! parsed by `cmdline`, found by `scan`, kept by `registry`.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::discover::disks::Dev;

mod cmdline;
mod engines;
mod registry;
mod scan;
mod stack;
mod symbols;
pub use symbols::{ProbeChoice, ProbeRole};

pub use cmdline::{from_args, is_qemu_comm};
pub use engines::{
    configfs_root, exports_from_args, is_plain_name, lio_luns, monitor_from_args, socket_engine,
    storage_daemons, Export, STORAGE_DAEMON_COMM,
};
pub use registry::{NotVm, Registry, VmMaps};
pub use scan::{
    alive, channel_socket, engine_alive, holds_kvm_vm, identify, identify_within,
    kvm_on_command_line, qemu_pids, scan, since_boot, started_since_boot, vcpu_runtime,
    IDENTIFY_LIMIT, VCPU_RAN,
};
pub use stack::{file_key, host_disk_of, host_stack_of, host_stack_of_dev, HostStack};

/// Virtual disks followed per VM: a command line anyone may write cannot
/// fill the kernel's disk tables (4096 entries) alone.
pub const MAX_VDISKS: usize = 256;

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The command-name prefix of a QEMU system emulator (its comm, and the
/// file name it was executed as). Mirrors VM_COMM_PREFIX in agent_abi.h.
pub const QEMU_PREFIX: &str = "qemu-system-";

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vm {
    pub pid: u32,
    pub name: String,
    /// The VM's UUID (`-uuid`, libvirt's domain UUID).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    pub disks: Vec<VDisk>,
    /// The QEMU binary it runs (for uprobes).
    #[serde(default)]
    pub exe: Option<PathBuf>,
    /// Where the host window's kicks come from for this VM.
    #[serde(default)]
    pub kicks: KickSource,
    /// QEMU names its threads (`-name …,debug-threads=on`, as libvirt
    /// runs it): vCPU threads, and so the guest's kicks, can be told apart.
    #[serde(default)]
    pub named_threads: bool,
    /// The chardev behind a virtserialport named `org.iospan.0`, as the
    /// command line gives it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channel: Option<SocketSource>,
    /// A QMP monitor of its command line (`-qmp unix:…,server`, or a
    /// `-mon …,mode=control` on a socket chardev), where QEMU's own counts
    /// are read (`discover::qemu_counts`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub monitor: Option<SocketSource>,
    /// The host end of the guest agent's channel: the listening unix socket
    /// the VM's process holds for that chardev (`channel_socket`).
    #[serde(default)]
    pub guest_channel: Option<PathBuf>,
    /// Device serials (`serial=`) by virtual disk id, to match the guest's
    /// disks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub serials: Vec<(String, String)>,
    /// Virtual disks past `MAX_VDISKS` on its command line: not followed
    /// (their requests are the VM's, on no virtual disk).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub vdisks_over_cap: usize,
    /// vCPUs at start (`-smp`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    /// Why this QEMU process is not a VM (it runs no guest: a capability
    /// probe), or None for a VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_vm: Option<String>,
    /// The libvirt domain it runs, when libvirt started it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub libvirt: Option<crate::discover::libvirt::Domain>,
    /// Its guest runs on KVM (it holds a KVM VM, or its command line asks
    /// for KVM): its kicks and interrupts are KVM's events.
    #[serde(default)]
    pub kvm: bool,
}

/// Which vCPU eventfd writes count as the guest's kicks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KickSource {
    /// The VM's virtqueue notifiers, seen created by its vCPUs when the
    /// guest started its devices (the VM started while iospan ran).
    QueueNotifiers,
    /// Any eventfd its vCPUs write counts (the VM was running before the
    /// deep tier watched, or the always-on tier sees eventfd writes
    /// through fentry or kprobes): including the main loop's own notifier,
    /// which a vCPU writes when the guest reprograms a timer. A request
    /// held in the engine (a throttle, a busy loop) may then be given a
    /// later notification than its own, shortening its window.
    #[default]
    AnyVcpuEventfd,
    /// KVM's exits at the notify addresses learnt from the wake-ups their
    /// kicks make (the always-on tier on KVM).
    KvmExits,
    /// None seen: a guest without KVM whose kicks are eventfd writes, seen
    /// only by the deep tier's system-call tracepoints where the kernel
    /// has neither fentry nor kprobes (`iospan run --deep`). Its requests
    /// are counted not_followed. (A vCPU's wake-up of the engine is no
    /// stand-in: QEMU's vCPUs wake its loop for timers too, and a kick
    /// that finds the loop running wakes nothing, so the loop's pickup
    /// would be an earlier wake-up's, hundreds of µs early.)
    NotSeen,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VDisk {
    /// The virtual disk's id: the device's `id=`, else its drive's id.
    pub id: String,
    /// virtio-blk-pci, nvme, scsi-hd, vhost-user-blk-pci, … (None: a bare -drive).
    pub model: Option<String>,
    pub file: Option<PathBuf>,
    /// The whole host disk under the backing file, when it is on one.
    #[serde(skip)]
    pub host_dev: Option<Dev>,
    /// The host disks under a device-mapper backing device (its slaves,
    /// down to the physical disks), where the device segment is timed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub host_stack: Vec<String>,
    /// The name the guest's user knows the disk by (libvirt's target
    /// dev: `vda`, `sdb`), when libvirt started the VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_dev: Option<String>,
    /// The iothread serving it (`iothread=`), when not the main loop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iothread: Option<String>,
    /// QEMU's I/O engine for the drive (`aio=`: threads, native, io_uring).
    #[serde(default)]
    pub aio: Option<String>,
    /// The device takes its doorbells through eventfds (`ioeventfd=on`,
    /// NVMe; virtio-blk always does).
    #[serde(default)]
    pub ioeventfd: bool,
    /// A vhost-user disk's socket (its chardev's path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<PathBuf>,
    /// The process that serves the disk from outside QEMU (vhost-user),
    /// found by the socket it exports on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineRef>,
    /// Its engine also serves another VM (see `Registry::add`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub engine_shared: bool,
    /// A kernel vhost-scsi disk's target: its WWPN, and the LUN once found
    /// in LIO's configfs (`naa.…/lun_0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// Its request queues, as the host configured them: `num-queues`
    /// (virtio-blk, vhost-user-blk), `max_ioqpairs` (NVMe), else QEMU's
    /// default (a virtio disk: one per vCPU; NVMe: 64). A guest's queue
    /// index at or past it is not believed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queues: Option<u32>,
    /// The settings a diagnosis may name, as its command line set them.
    #[serde(default)]
    pub knobs: DiskKnobs,
}

/// A virtual disk's settings as its command line set them (None: QEMU's
/// default), for the diagnosis to say what they are and what to try.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskKnobs {
    /// `queue-size=` (virtio; QEMU's default 256).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_size: Option<u32>,
    /// `ioeventfd=` as set (virtio's default is on, NVMe's off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ioeventfd: Option<bool>,
    /// The drive's throttle limits, by QMP's names (`iops`, `iops_rd`,
    /// `iops_wr`, `bps`, `bps_rd`, `bps_wr`): `-drive throttling.*`, or
    /// QMP's `query-block` where read.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub throttle: Vec<(String, u64)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throttle_group: Option<String>,
    /// `cache=` of its drive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<String>,
}

impl DiskKnobs {
    /// The throttle limit QMP names `key` (0 and absent: none).
    pub fn limit(&self, key: &str) -> Option<u64> {
        self.throttle
            .iter()
            .find(|(k, v)| k == key && *v > 0)
            .map(|(_, v)| *v)
    }
}

/// An engine process serving a virtual disk: the one that pops its
/// virtqueue and submits its requests to the host.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineRef {
    pub pid: u32,
    /// Its program (`qemu-storage-daemon`).
    pub program: String,
    /// The export serving the disk (its `id=`), or the socket it listens
    /// on for an engine other than qemu-storage-daemon.
    pub export: String,
    #[serde(skip)]
    pub exe: Option<PathBuf>,
    /// Its thread-group leader's name, to tell it still runs as itself.
    #[serde(skip)]
    pub comm: String,
    /// The export's block node (`node-name=`), where the engine's own
    /// counters of the disk are found.
    #[serde(skip)]
    pub node: String,
    /// The engine's QMP monitor (`--monitor` on a socket chardev).
    #[serde(skip)]
    pub monitor: Option<SocketSource>,
}

impl VDisk {
    /// Whether iospan can split this disk's host windows: a device whose
    /// doorbell is an eventfd (virtio-blk; NVMe with `ioeventfd=on`) served
    /// by QEMU's own event loop or an iothread, submitting from the thread
    /// that picked the kick up or (aio=threads) a worker it woke.
    /// NVMe's default doorbell is taken inside the vCPU's exit to QEMU:
    /// under KVM the exit shows it (kvm:kvm_mmio), under TCG nothing the
    /// host kernel sees does. Requests of disks not followed are counted as
    /// such. `on_kvm`: its VM runs on KVM (`Vm::kvm`).
    pub fn split_supported(&self, on_kvm: bool) -> bool {
        self.split_support(on_kvm).is_ok()
    }

    /// Whether the kernel's vhost workers serve it (vhost-scsi): they pick
    /// its kicks up, submit its requests and raise its interrupts, inside
    /// the kernel.
    pub fn kernel_vhost(&self) -> bool {
        self.model
            .as_deref()
            .is_some_and(|m| m.starts_with("vhost-scsi"))
    }

    /// Whether its requests are submitted by QEMU's worker threads.
    pub fn worker_submitted(&self) -> bool {
        self.aio.as_deref() == Some("threads")
    }

    /// As `split_supported`, with the reason when not.
    pub fn split_support(&self, on_kvm: bool) -> Result<(), &'static str> {
        match self.model.as_deref() {
            Some(m) if m.starts_with("virtio-blk") => {}
            Some(m) if m.starts_with("vhost-user-blk") && self.engine_shared => {
                return Err("its qemu-storage-daemon also serves another VM: its requests are counted as the host's")
            }
            Some(m)
                if m.starts_with("vhost-user-blk")
                    && self.engine.as_ref().is_some_and(|e| !e.followed()) =>
            {
                return Err("its engine is not qemu-storage-daemon (SPDK, …): its requests are the VM's, their kicks, pickups and used-ring pushes are not followed")
            }
            Some(m) if m.starts_with("vhost-user-blk") && self.engine.is_some() => {}
            Some(m) if m.starts_with("vhost-user-blk") => {
                return Err("no process listens on its socket (is its vhost-user server running?)")
            }
            Some("nvme") if self.ioeventfd || on_kvm => {}
            Some("nvme") => {
                return Err(
                    "NVMe doorbells without ioeventfd=on are taken in the vCPU's exit to QEMU: seen under KVM (its MMIO exit), not under TCG",
                )
            }
            Some(m) if m.starts_with("vhost-scsi") && self.host_dev.is_some() => {}
            Some(m) if m.starts_with("vhost-scsi") => {
                return Err("no LUN of its target found in LIO's configfs (target/vhost/WWPN under IOSPAN_CONFIGFS, default /sys/kernel/config) on a host disk")
            }
            Some(m) if m.starts_with("vhost") => {
                return Err("vhost devices other than vhost-user-blk and vhost-scsi are not followed yet")
            }
            _ => return Err("device model not followed"),
        }
        Ok(())
    }
}

/// Where a chardev's unix socket comes from: a path QEMU binds, or a
/// socket libvirt bound and passed in (`fd=N`), found through the process's
/// own file table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SocketSource {
    Path(PathBuf),
    Fd(i32),
}

impl Vm {
    /// What libvirt knows of the domain: its UUID, and each disk's target
    /// dev by the alias QEMU has as the device's id.
    pub fn apply_domain(&mut self, dom: crate::discover::libvirt::Domain) {
        if self.uuid.is_none() {
            self.uuid = dom.uuid.clone();
        }
        for d in &mut self.disks {
            let Some(x) = dom.disks.iter().find(|x| x.alias == d.id) else {
                d.target_dev = None;
                continue;
            };
            d.target_dev = Some(x.target_dev.clone());
            // libvirt sets a disk's <iotune> over QMP after QEMU starts:
            // not on its command line.
            if !x.iotune.is_empty() {
                d.knobs.throttle = x.iotune.clone();
            }
            let attr = |k: &str| {
                x.driver
                    .iter()
                    .find(|(a, _)| a == k)
                    .map(|(_, v)| v.as_str())
            };
            if let Some(q) = attr("queue_size").and_then(|v| v.parse().ok()) {
                d.knobs.queue_size = Some(q);
            }
            if let Some(on) = attr("ioeventfd") {
                d.knobs.ioeventfd = Some(on == "on");
            }
        }
        self.libvirt = Some(dom);
    }
}

#[cfg(test)]
mod tests;
