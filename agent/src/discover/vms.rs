//! VM identity from QEMU's command line: the VM's name (`-name guest=NAME`
//! as libvirt passes it), its virtual disks (id, model, backing file) and
//! the host disk each backing file lives on. Shown everywhere instead of
//! pids.

use std::{
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use crate::discover::disks::Dev;

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
    /// The host end of the guest agent's channel: the listening unix socket
    /// the VM's process holds for that chardev (`channel_socket`).
    #[serde(default)]
    pub guest_channel: Option<PathBuf>,
    /// Device serials (`serial=`) by virtual disk id, to match the guest's
    /// disks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub serials: Vec<(String, String)>,
    /// Why this QEMU process is not a VM (it runs no guest: a capability
    /// probe), or None for a VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_vm: Option<String>,
    /// The libvirt domain it runs, when libvirt started it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub libvirt: Option<crate::discover::libvirt::Domain>,
}

/// Which vCPU eventfd writes count as the guest's kicks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KickSource {
    /// The VM's virtqueue notifiers, seen created by its vCPUs when the
    /// guest started its devices (the VM started while iospan ran).
    QueueNotifiers,
    /// The VM was running before iospan: any eventfd its vCPUs write counts,
    /// including the main loop's own notifier, which a vCPU writes when the
    /// guest reprograms a timer. A request held in the engine (a throttle, a
    /// busy loop) may then be given a later notification than its own,
    /// shortening its window.
    #[default]
    AnyVcpuEventfd,
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
}

impl VDisk {
    /// Whether iospan can split this disk's host windows: a device whose
    /// doorbell is an eventfd (virtio-blk; NVMe with `ioeventfd=on`) served
    /// by QEMU's own event loop or an iothread, submitting from the thread
    /// that picked the kick up or (aio=threads) a worker it woke.
    /// NVMe's default doorbell is handled inside the vCPU's exit, leaving no
    /// trace the host kernel sees under TCG; vhost devices are not followed
    /// yet. Their requests are counted as not followed.
    pub fn split_supported(&self) -> bool {
        self.split_support().is_ok()
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
    pub fn split_support(&self) -> Result<(), &'static str> {
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
            Some("nvme") if self.ioeventfd => {}
            Some("nvme") => {
                return Err(
                    "NVMe doorbells without ioeventfd=on are handled inside the vCPU's exit",
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

/// An option's value as QEMU takes it: a JSON object (`-device {"driver":…}`,
/// as libvirt passes every device, blockdev and object) or `k=v,k=v`
/// (`,,` is a literal comma; a leading bare word under the key ""). JSON
/// is flattened to the same pairs: nested objects as dotted keys
/// (`cache.direct`), booleans and numbers as their text.
fn options(s: &str) -> Vec<(String, String)> {
    if s.trim_start().starts_with('{') {
        if let Ok(serde_json::Value::Object(m)) = serde_json::from_str(s) {
            let mut out = Vec::new();
            flatten_json("", &m, &mut out, 0);
            return out;
        }
    }
    keyval(s)
}

fn flatten_json(
    prefix: &str,
    m: &serde_json::Map<String, serde_json::Value>,
    out: &mut Vec<(String, String)>,
    depth: usize,
) {
    use serde_json::Value;
    for (k, v) in m {
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            Value::String(s) => out.push((key, s.clone())),
            Value::Bool(b) => out.push((key, if *b { "on" } else { "off" }.into())),
            Value::Number(n) => out.push((key, n.to_string())),
            // Bounded: a command line is anyone's to write.
            Value::Object(o) if depth < 4 => flatten_json(&key, o, out, depth + 1),
            _ => {}
        }
    }
}

fn keyval(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = s.chars().peekable();
    let mut parts = Vec::new();
    while let Some(c) = chars.next() {
        if c == ',' {
            if chars.peek() == Some(&',') {
                chars.next();
                cur.push(',');
            } else {
                parts.push(std::mem::take(&mut cur));
            }
        } else {
            cur.push(c);
        }
    }
    parts.push(cur);
    for (i, p) in parts.into_iter().enumerate() {
        match p.split_once('=') {
            Some((k, v)) => out.push((k.to_string(), v.to_string())),
            None if i == 0 => out.push((String::new(), p)),
            None => out.push((p, "on".into())),
        }
    }
    out
}

fn get<'a>(opts: &'a [(String, String)], key: &str) -> Option<&'a str> {
    opts.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
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

/// Identity from QEMU's arguments (argv without argv[0]): every form
/// QEMU takes them in, keyval or JSON (libvirt's), in one pass.
pub fn from_args(pid: u32, args: &[String]) -> Vm {
    let mut name = None;
    let mut uuid = None;
    let mut named_threads = false;
    let mut machine: Option<String> = None;
    let (mut paused, mut kernel) = (false, false);
    let mut iothreads: Vec<String> = Vec::new();
    let mut chardevs: Vec<(String, SocketSource)> = Vec::new(); // (id, unix socket)
    let mut channel_dev: Option<String> = None; // chardev of the guest agent's port
    let mut serials: Vec<(String, String)> = Vec::new(); // (device or drive id, serial)
                                                         // drive/node id -> backing file
    let mut files: Vec<(String, Option<PathBuf>, Option<String>)> = Vec::new(); // (id, file, child node)
    let mut aio: Vec<(String, String)> = Vec::new(); // (drive/node id, aio mode)
    let mut devices: Vec<Device> = Vec::new();
    let mut vhost: Vec<(String, Option<String>, String)> = Vec::new(); // (model, id, chardev)
    let mut vscsi: Vec<(String, Option<String>, String)> = Vec::new(); // (model, id, wwpn)
    let on = |v: Option<&str>| v.is_some_and(|v| matches!(v, "on" | "true" | "yes"));
    let mut i = 0;
    while i < args.len() {
        let is_opt = args[i].starts_with('-');
        let a = args[i].trim_start_matches('-');
        let v = args.get(i + 1).map(String::as_str).unwrap_or("");
        // Options that take no value.
        match (is_opt, a) {
            (true, "S") => {
                paused = true;
                i += 1;
                continue;
            }
            (false, _) => {
                i += 1;
                continue;
            }
            _ => {}
        }
        match a {
            "name" => {
                let o = options(v);
                name = get(&o, "guest").or_else(|| get(&o, "")).map(str::to_string);
                named_threads = on(get(&o, "debug-threads"));
            }
            "uuid" => uuid = Some(v.to_string()),
            "machine" | "M" => {
                let o = options(v);
                machine = get(&o, "type").or_else(|| get(&o, "")).map(str::to_string);
            }
            "kernel" => kernel = true,
            "object" => {
                let o = options(v);
                if get(&o, "qom-type").or_else(|| get(&o, "")) == Some("iothread") {
                    if let Some(id) = get(&o, "id") {
                        iothreads.push(id.to_string());
                    }
                }
            }
            "drive" => {
                let o = options(v);
                if let Some(id) = get(&o, "id") {
                    files.push((id.to_string(), get(&o, "file").map(PathBuf::from), None));
                    aio.push((
                        id.to_string(),
                        get(&o, "aio").unwrap_or("threads").to_string(),
                    ));
                }
            }
            "blockdev" => {
                if let Some((id, file, child, a)) = blockdev(v) {
                    files.push((id.clone(), file, child));
                    if let Some(a) = a {
                        aio.push((id, a));
                    }
                }
            }
            "device" => {
                let o = options(v);
                let model = get(&o, "").or_else(|| get(&o, "driver")).unwrap_or("");
                let id = get(&o, "id").map(str::to_string);
                if let (false, Some(drive)) = (model.is_empty(), get(&o, "drive")) {
                    if let Some(serial) = get(&o, "serial") {
                        serials.push((
                            id.clone().unwrap_or_else(|| drive.to_string()),
                            serial.to_string(),
                        ));
                    }
                    devices.push(Device {
                        model: model.to_string(),
                        id: id.clone(),
                        drive: drive.to_string(),
                        ioeventfd: on(get(&o, "ioeventfd")),
                        iothread: get(&o, "iothread").map(str::to_string),
                    });
                }
                match (get(&o, "chardev"), get(&o, "wwpn")) {
                    (Some(chardev), _) if model.starts_with("vhost-user-blk") => {
                        vhost.push((model.to_string(), id, chardev.to_string()));
                    }
                    (_, Some(wwpn)) if model.starts_with("vhost-scsi") => {
                        vscsi.push((model.to_string(), id, wwpn.to_string()));
                    }
                    (chardev, _)
                        if model == "virtserialport"
                            && get(&o, "name") == Some(crate::abi::PORT_NAME) =>
                    {
                        channel_dev = chardev.map(str::to_string);
                    }
                    _ => {}
                }
            }
            "chardev" => {
                let o = options(v);
                let backend = get(&o, "").or_else(|| get(&o, "backend"));
                let src = match (get(&o, "path"), get(&o, "fd")) {
                    (Some(p), _) => Some(SocketSource::Path(PathBuf::from(p))),
                    (None, Some(fd)) => fd.parse().ok().map(SocketSource::Fd),
                    _ => None,
                };
                if let (Some("socket"), Some(id), Some(src)) = (backend, get(&o, "id"), src) {
                    chardevs.push((id.to_string(), src));
                }
            }
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    let file_of = |id: &str| node_file(&files, id);
    let aio_of = |id: &str| Some(node_aio(&files, &aio, id));
    let socket_of = |chardev: &str| {
        chardevs
            .iter()
            .find(|(c, _)| c == chardev)
            .map(|(_, s)| s.clone())
    };
    let mut disks: Vec<VDisk> = devices
        .iter()
        .map(|d| VDisk {
            id: d.id.clone().unwrap_or_else(|| d.drive.clone()),
            model: Some(d.model.clone()),
            file: file_of(&d.drive),
            aio: aio_of(&d.drive),
            ioeventfd: d.ioeventfd,
            iothread: d.iothread.clone(),
            ..Default::default()
        })
        .collect();
    // vhost-user disks: served by whoever exports on the chardev's socket.
    for (model, id, chardev) in &vhost {
        disks.push(VDisk {
            id: id.clone().unwrap_or_else(|| chardev.clone()),
            model: Some(model.clone()),
            ioeventfd: true,
            socket: match socket_of(chardev) {
                Some(SocketSource::Path(p)) => Some(p),
                _ => None,
            },
            ..Default::default()
        });
    }
    // Kernel vhost-scsi disks: their LUNs are LIO's (Vm::find_luns).
    for (model, id, wwpn) in &vscsi {
        disks.push(VDisk {
            id: id.clone().unwrap_or_else(|| wwpn.clone()),
            model: Some(model.clone()),
            ioeventfd: true,
            target: Some(wwpn.clone()),
            ..Default::default()
        });
    }
    // -drive with if=virtio (or default) and no -device: the drive is the disk.
    for (id, file, _) in &files {
        let used = devices.iter().any(|d| d.drive == *id)
            || files.iter().any(|(_, _, c)| c.as_deref() == Some(id));
        if !used && file.is_some() {
            disks.push(VDisk {
                id: id.clone(),
                file: file.clone(),
                aio: aio_of(id),
                ..Default::default()
            });
        }
    }
    for d in &mut disks {
        d.resolve_host();
        // A device naming an iothread no -object made is QEMU's error;
        // keep only what exists.
        d.iothread = d.iothread.take().filter(|t| iothreads.contains(t));
    }
    let not_vm = if machine.as_deref() == Some("none") {
        Some("runs no machine (-machine none): a capability probe".to_string())
    } else if paused && disks.is_empty() && !kernel {
        Some("paused (-S) with no disk and no kernel to run".to_string())
    } else {
        None
    };
    Vm {
        pid,
        name: name.unwrap_or_else(|| format!("qemu-{pid}")),
        uuid,
        disks,
        exe: None,
        kicks: KickSource::default(),
        named_threads,
        channel: channel_dev.and_then(|c| socket_of(&c)),
        guest_channel: None,
        serials,
        not_vm,
        libvirt: None,
    }
}

/// A `-device` with a drive.
struct Device {
    model: String,
    id: Option<String>,
    drive: String,
    ioeventfd: bool,
    iothread: Option<String>,
}

/// A `-blockdev` (JSON or key=value): node name, file name, child node
/// and aio mode.
/// (node name, file name, child node, aio mode).
type BlockNode = (String, Option<PathBuf>, Option<String>, Option<String>);

fn blockdev(v: &str) -> Option<BlockNode> {
    let o = options(v);
    Some((
        get(&o, "node-name")?.to_string(),
        get(&o, "filename")
            .or_else(|| get(&o, "file.filename"))
            .map(PathBuf::from),
        get(&o, "file").map(str::to_string),
        get(&o, "aio")
            .or_else(|| get(&o, "file.aio"))
            .map(str::to_string),
    ))
}

type Nodes = [(String, Option<PathBuf>, Option<String>)];

/// A node and the nodes under it, format nodes down to the protocol node
/// that names the file (and carries the aio mode).
fn node_chain(files: &Nodes, id: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = Some(id.to_string());
    while let Some(c) = cur.take().filter(|_| out.len() < 8) {
        if let Some((_, _, child)) = files.iter().find(|(n, _, _)| *n == c) {
            cur = child.clone();
        }
        out.push(c);
    }
    out
}

fn node_file(files: &Nodes, id: &str) -> Option<PathBuf> {
    node_chain(files, id).iter().find_map(|n| {
        files
            .iter()
            .find(|(m, f, _)| m == n && f.is_some())
            .and_then(|(_, f, _)| f.clone())
    })
}

/// The file driver's aio mode; threads, its default, when none is set.
fn node_aio(files: &Nodes, aio: &[(String, String)], id: &str) -> String {
    node_chain(files, id)
        .iter()
        .find_map(|n| aio.iter().find(|(m, _)| m == n).map(|(_, a)| a.clone()))
        .unwrap_or_else(|| "threads".into())
}

/// The program name (comm, 15 bytes) of qemu-storage-daemon.
pub const STORAGE_DAEMON_COMM: &str = "qemu-storage-da";

/// One vhost-user-blk export of an engine process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Export {
    pub id: String,
    pub socket: PathBuf,
    pub file: Option<PathBuf>,
    pub aio: String,
}

/// qemu-storage-daemon's vhost-user-blk exports, from its arguments
/// (argv without argv[0]). Relative socket paths are taken from `cwd`.
pub fn exports_from_args(args: &[String], cwd: &Path) -> Vec<Export> {
    let mut files = Vec::new();
    let mut aio = Vec::new();
    let mut exports = Vec::new();
    let mut i = 0;
    while i < args.len() {
        // --opt VALUE or --opt=VALUE
        let (opt, inline) = match args[i].split_once('=') {
            Some((o, v)) if o.starts_with("--") => (o, Some(v.to_string())),
            _ => (args[i].as_str(), None),
        };
        let value = match inline {
            Some(v) => v,
            None => {
                i += 1;
                args.get(i).cloned().unwrap_or_default()
            }
        };
        match opt.trim_start_matches('-') {
            "blockdev" => {
                if let Some((id, file, child, a)) = blockdev(&value) {
                    files.push((id.clone(), file, child));
                    if let Some(a) = a {
                        aio.push((id, a));
                    }
                }
            }
            "export" => {
                let o = options(&value);
                if get(&o, "type") == Some("vhost-user-blk")
                    && get(&o, "addr.type").unwrap_or("unix") == "unix"
                {
                    if let (Some(id), Some(node), Some(path)) =
                        (get(&o, "id"), get(&o, "node-name"), get(&o, "addr.path"))
                    {
                        exports.push((id.to_string(), node.to_string(), cwd.join(path)));
                    }
                }
            }
            _ => {}
        }
        i += 1;
    }
    exports
        .into_iter()
        .map(|(id, node, socket)| Export {
            id,
            socket,
            file: node_file(&files, &node),
            aio: node_aio(&files, &aio, &node),
        })
        .collect()
}

/// Every qemu-storage-daemon running now, with its exports.
pub fn storage_daemons() -> Vec<(EngineRef, Vec<Export>)> {
    let Ok(rd) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out: Vec<(EngineRef, Vec<Export>)> = rd
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let comm = fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            if comm.trim_end() != STORAGE_DAEMON_COMM {
                return None;
            }
            let raw = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let args: Vec<String> = raw
                .split(|&b| b == 0)
                .skip(1)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let cwd = fs::read_link(format!("/proc/{pid}/cwd")).unwrap_or_default();
            let exe = fs::read_link(format!("/proc/{pid}/exe")).ok();
            Some((
                EngineRef {
                    pid,
                    program: exe.as_deref().and_then(Path::file_name).map_or_else(
                        || "qemu-storage-daemon".into(),
                        |n| n.to_string_lossy().into_owned(),
                    ),
                    export: String::new(),
                    exe: exe.filter(|p| p.exists()),
                    comm: STORAGE_DAEMON_COMM.into(),
                },
                exports_from_args(&args, &cwd),
            ))
        })
        .collect();
    out.sort_by_key(|(e, _)| e.pid);
    out
}

impl Vm {
    /// Finds the engines serving its vhost-user disks among `daemons`: the
    /// one exporting on a disk's socket serves it (its file is the disk's
    /// backing file).
    pub fn find_engines(&mut self, daemons: &[(EngineRef, Vec<Export>)], cwd: &Path) {
        for d in &mut self.disks {
            let Some(sock) = d.socket.as_ref().map(|s| cwd.join(s)) else {
                continue;
            };
            let same = |a: &Path| {
                a == sock || fs::canonicalize(a).ok() == fs::canonicalize(&sock).ok() && a.exists()
            };
            for (engine, exports) in daemons {
                if let Some(x) = exports.iter().find(|x| same(&x.socket)) {
                    d.engine = Some(EngineRef {
                        export: x.id.clone(),
                        ..engine.clone()
                    });
                    d.file = x.file.clone();
                    d.aio = Some(x.aio.clone());
                    d.resolve_host();
                }
            }
        }
    }

    /// Expands its vhost-scsi disks into their LUNs, from LIO's configfs
    /// under `configfs`: one virtual disk per LUN (`ID/lun_N` where the
    /// target has several), backed by the LUN's file or block device.
    pub fn find_luns(&mut self, configfs: &Path) {
        let mut out = Vec::with_capacity(self.disks.len());
        for d in self.disks.drain(..) {
            let (true, Some(wwpn)) = (d.kernel_vhost(), d.target.clone()) else {
                out.push(d);
                continue;
            };
            let luns = lio_luns(configfs, &wwpn);
            if luns.is_empty() {
                out.push(d);
                continue;
            }
            let several = luns.len() > 1;
            for (lun, backing) in luns {
                let host_dev = host_disk_of(&backing);
                out.push(VDisk {
                    id: if several {
                        format!("{}/{lun}", d.id)
                    } else {
                        d.id.clone()
                    },
                    target: Some(format!("{wwpn}/{lun}")),
                    file: Some(backing),
                    host_dev,
                    ..d.clone()
                });
            }
        }
        self.disks = out;
    }

    /// The engine processes serving its disks from outside QEMU (and not
    /// another VM's as well).
    pub fn engines(&self) -> Vec<&EngineRef> {
        let mut v: Vec<&EngineRef> = self
            .disks
            .iter()
            .filter(|d| !d.engine_shared)
            .filter_map(|d| d.engine.as_ref())
            .collect();
        v.sort_by_key(|e| e.pid);
        v.dedup_by_key(|e| e.pid);
        v
    }
}

/// Where LIO's configfs is mounted: `IOSPAN_CONFIGFS`, else the kernel's
/// usual place.
pub fn configfs_root() -> PathBuf {
    std::env::var_os("IOSPAN_CONFIGFS")
        .map_or_else(|| PathBuf::from("/sys/kernel/config"), PathBuf::from)
}

/// The LUNs a vhost target exports, in LUN order: (`lun_N`, backing file
/// or block device). Each LUN directory links to its backstore, whose
/// `udev_path` names the backing (set by targetcli), else its `info`
/// ("File: …" for a file backstore, "UDEV PATH: …" for a block one).
pub fn lio_luns(configfs: &Path, wwpn: &str) -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    let target = configfs.join("target/vhost").join(wwpn);
    let Ok(tpgs) = fs::read_dir(&target) else {
        return out;
    };
    for tpg in tpgs.flatten() {
        if !tpg.file_name().to_string_lossy().starts_with("tpgt_") {
            continue;
        }
        let Ok(luns) = fs::read_dir(tpg.path().join("lun")) else {
            continue;
        };
        for lun in luns.flatten() {
            let name = lun.file_name().to_string_lossy().into_owned();
            let Ok(links) = fs::read_dir(lun.path()) else {
                continue;
            };
            let backing = links
                .flatten()
                .filter(|l| l.file_type().is_ok_and(|t| t.is_symlink()))
                .find_map(|l| backstore_path(&fs::canonicalize(l.path()).ok()?));
            if let Some(b) = backing {
                out.push((name, b));
            }
        }
    }
    out.sort_by_key(|(lun, _)| {
        lun.trim_start_matches("lun_")
            .parse::<u64>()
            .unwrap_or(u64::MAX)
    });
    out
}

fn backstore_path(dir: &Path) -> Option<PathBuf> {
    let udev = fs::read_to_string(dir.join("udev_path")).unwrap_or_default();
    if !udev.trim().is_empty() {
        return Some(PathBuf::from(udev.trim()));
    }
    let info = fs::read_to_string(dir.join("info")).ok()?;
    ["File: ", "UDEV PATH: "].iter().find_map(|key| {
        let rest = &info[info.find(key)? + key.len()..];
        let path = rest.split_whitespace().next()?;
        Some(PathBuf::from(path))
    })
}

/// The whole host disk a file lives on, or a block device is part of.
/// Under device-mapper (LVM, multipath, dm-crypt) it is the first
/// physical disk under the stack (see `host_stack_of`).
pub fn host_disk_of(file: &Path) -> Option<Dev> {
    host_stack_of(Path::new("/sys"), file)?
        .leaves
        .first()
        .copied()
}

/// The block devices under a backing file or device, as sysfs tells them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostStack {
    /// The device QEMU's requests enter: the whole disk or partition it
    /// opened, or the disk holding its file (`sdb1`, `dm-3`, `loop0p1`).
    pub top: String,
    /// The physical disks at the bottom, whose requests the block layer
    /// times (a dm device has none of its own), whole disks, in order.
    pub leaves: Vec<Dev>,
    /// Their names, for the report (`loop0`, `nvme0n1`).
    pub leaf_names: Vec<String>,
    /// Whether device-mapper stands between the two.
    pub dm: bool,
}

/// The stack under `file` read from the sysfs tree at `sys` (a recorded
/// tree in tests): the device it is or lives on, down through dm slaves
/// (`/sys/block/dm-N/slaves/…`) to whole physical disks.
pub fn host_stack_of(sys: &Path, file: &Path) -> Option<HostStack> {
    use std::os::unix::fs::FileTypeExt;
    let meta = fs::metadata(file).ok()?;
    let dev = if meta.file_type().is_block_device() {
        meta.rdev()
    } else {
        meta.dev()
    };
    host_stack_of_dev(sys, libc::major(dev), libc::minor(dev))
}

pub fn host_stack_of_dev(sys: &Path, major: u32, minor: u32) -> Option<HostStack> {
    let dir = fs::canonicalize(sys.join(format!("dev/block/{major}:{minor}"))).ok()?;
    let top = dir.file_name()?.to_string_lossy().into_owned();
    let mut st = HostStack {
        top,
        ..Default::default()
    };
    let mut todo = vec![dir];
    let mut seen = 0;
    while let Some(d) = todo.pop() {
        // A stack is shallow; a loop in a (recorded) tree must not hang us.
        seen += 1;
        if seen > 64 {
            break;
        }
        let slaves: Vec<PathBuf> = fs::read_dir(d.join("slaves"))
            .map(|rd| {
                let mut v: Vec<PathBuf> = rd
                    .flatten()
                    .filter_map(|e| fs::canonicalize(e.path()).ok())
                    .collect();
                v.sort();
                v
            })
            .unwrap_or_default();
        if !slaves.is_empty() {
            st.dm = true;
            // Depth first, in name order.
            todo.extend(slaves.into_iter().rev());
            continue;
        }
        let disk = if d.join("partition").exists() {
            d.parent()?.to_path_buf()
        } else {
            d
        };
        let text = fs::read_to_string(disk.join("dev")).ok()?;
        let (a, b) = text.trim().split_once(':')?;
        let leaf = Dev::new(a.parse().ok()?, b.parse().ok()?);
        if !st.leaves.contains(&leaf) {
            st.leaves.push(leaf);
            st.leaf_names
                .push(disk.file_name()?.to_string_lossy().into_owned());
        }
    }
    (!st.leaves.is_empty()).then_some(st)
}

impl VDisk {
    /// Finds the host disks under its backing file or device.
    fn resolve_host(&mut self) {
        let st = self
            .file
            .as_deref()
            .and_then(|f| host_stack_of(Path::new("/sys"), f));
        self.host_dev = st.as_ref().and_then(|s| s.leaves.first().copied());
        self.host_stack = match st {
            Some(s) if s.dm => std::iter::once(s.top).chain(s.leaf_names).collect(),
            _ => Vec::new(),
        };
    }
}

/// Whether a program name (a comm) is a QEMU system emulator's, as
/// distributions install it: `qemu-system-*` (upstream, Debian, SUSE),
/// `qemu-kvm` (RHEL and Fedora's /usr/libexec/qemu-kvm), `kvm` (Proxmox's
/// /usr/bin/kvm). Mirrors vm_comm() in block.bpf.c, which gives such a
/// process a VM slot at exec.
pub fn is_qemu_comm(comm: &str) -> bool {
    let comm = comm.trim_end_matches('\n');
    comm.starts_with(QEMU_PREFIX) || comm == "qemu-kvm" || comm == "kvm"
}

/// Whether arguments are QEMU's: a name other programs use too (`kvm`)
/// must come with a command line only QEMU takes.
fn looks_like_qemu(comm: &str, vm: &Vm) -> bool {
    comm.starts_with(QEMU_PREFIX)
        || vm.not_vm.is_some()
        || !vm.disks.is_empty()
        || vm.uuid.is_some()
        || !vm.name.starts_with("qemu-")
}

/// A running process's identity, if it is a QEMU process: a VM, or (with
/// `not_vm` set) a QEMU that runs no guest.
pub fn identify(pid: u32) -> Option<Vm> {
    let comm = fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    if !is_qemu_comm(&comm) {
        return None;
    }
    let raw = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    // An exited process awaiting its parent (a zombie) has no command
    // line left to tell what it was.
    if raw.is_empty() {
        return None;
    }
    let args: Vec<String> = raw
        .split(|&b| b == 0)
        .skip(1)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let mut vm = from_args(pid, &args);
    if !looks_like_qemu(&comm, &vm) {
        return None;
    }
    vm.exe = fs::read_link(format!("/proc/{pid}/exe"))
        .ok()
        .filter(|p| p.exists());
    if vm.not_vm.is_some() {
        return Some(vm);
    }
    if let Some(dom) = crate::discover::libvirt::domain_of(pid) {
        vm.apply_domain(dom);
    }
    vm.guest_channel = vm.channel.as_ref().and_then(|c| channel_socket(pid, c));
    if vm.disks.iter().any(|d| d.socket.is_some()) {
        let cwd = fs::read_link(format!("/proc/{pid}/cwd")).unwrap_or_default();
        vm.find_engines(&storage_daemons(), &cwd);
        for d in vm.disks.iter_mut().filter(|d| d.engine.is_none()) {
            d.engine = d.socket.as_ref().and_then(|s| socket_engine(&cwd.join(s)));
        }
    }
    if vm.disks.iter().any(VDisk::kernel_vhost) {
        vm.find_luns(&configfs_root());
    }
    Some(vm)
}

/// The guest channel's host socket: a listening unix socket the VM's own
/// process holds for the chardev (passed in by libvirt as `fd=N`, or bound
/// by QEMU at `path=`). A path on the command line that the process does
/// not itself listen on is never connected to.
pub fn channel_socket(pid: u32, src: &SocketSource) -> Option<PathBuf> {
    match src {
        SocketSource::Fd(fd) => crate::discover::procfs::held_listener(pid, Some(*fd), None),
        SocketSource::Path(p) => {
            let abs = if p.is_absolute() {
                p.clone()
            } else {
                fs::read_link(format!("/proc/{pid}/cwd")).ok()?.join(p)
            };
            crate::discover::procfs::held_listener(pid, None, Some(&abs))
        }
    }
}

impl Vm {
    /// What libvirt knows of the domain: its UUID, and each disk's target
    /// dev by the alias QEMU has as the device's id.
    pub fn apply_domain(&mut self, dom: crate::discover::libvirt::Domain) {
        if self.uuid.is_none() {
            self.uuid = dom.uuid.clone();
        }
        for d in &mut self.disks {
            d.target_dev = dom
                .disks
                .iter()
                .find(|x| x.alias == d.id)
                .map(|x| x.target_dev.clone());
        }
        self.libvirt = Some(dom);
    }
}

/// Whether the VM's process still runs: not gone, not a zombie awaiting its
/// parent, and its pid not handed to another program.
pub fn alive(vm: &Vm) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{}/stat", vm.pid)) else {
        return false;
    };
    // "pid (comm) state ...": comm may hold spaces and parentheses.
    let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
        return false;
    };
    let comm = &stat[open + 1..close];
    let state = stat[close + 1..].trim_start().chars().next();
    is_qemu_comm(comm) && !matches!(state, Some('Z' | 'X' | 'x'))
}

/// Whether an engine process still runs (as the same program).
pub fn engine_alive(e: &EngineRef) -> bool {
    fs::read_to_string(format!("/proc/{}/comm", e.pid)).is_ok_and(|c| c.trim_end() == e.comm)
}

/// The inode of the listening Unix socket bound at `path`
/// (/proc/net/unix: flag __SO_ACCEPTCON, 0x10000, marks a listener).
fn unix_listener(path: &Path) -> Option<u64> {
    let canon = fs::canonicalize(path).ok();
    crate::discover::procfs::unix_sockets()
        .into_iter()
        .find_map(|s| {
            let bound = s.path.as_deref()?;
            let same = bound == path || (canon.is_some() && fs::canonicalize(bound).ok() == canon);
            (s.listening && same).then_some(s.inode)
        })
}

/// The process holding socket `inode` open (the lowest pid, if several).
fn socket_owner(inode: u64) -> Option<u32> {
    let mut pids: Vec<u32> = fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    pids.into_iter().find(|pid| {
        crate::discover::procfs::sockets_of(*pid)
            .iter()
            .any(|(_, i)| *i == inode)
    })
}

/// The process listening on a vhost-user socket: the engine of a disk no
/// qemu-storage-daemon serves (an SPDK vhost target, another server).
pub fn socket_engine(socket: &Path) -> Option<EngineRef> {
    let pid = socket_owner(unix_listener(socket)?)?;
    let comm = fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    let exe = fs::read_link(format!("/proc/{pid}/exe")).ok();
    Some(EngineRef {
        pid,
        program: exe.as_deref().and_then(Path::file_name).map_or_else(
            || comm.trim_end().into(),
            |n| n.to_string_lossy().into_owned(),
        ),
        export: socket.display().to_string(),
        exe: exe.filter(|p| p.exists()),
        comm: comm.trim_end().into(),
    })
}

/// Every QEMU VM running now.
pub fn scan() -> Vec<Vm> {
    let mut v: Vec<Vm> = fs::read_dir("/proc")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter_map(identify)
                .filter(|vm| vm.not_vm.is_none())
                .collect()
        })
        .unwrap_or_default();
    v.sort_by_key(|vm| vm.pid);
    v
}

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
            if d.split_supported() {
                self.split.insert(vdisk);
            }
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
        self.vms.insert(slot, vm);
        maps
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

    /// The QEMU device model of a virtual disk (virtio-blk-pci, nvme, …).
    pub fn vdisk_model(&self, vdisk: u32) -> Option<&str> {
        self.vdisk_def(vdisk)?.model.as_deref()
    }
}

/// The kernel's identity of a file: its superblock's dev_t (major << 20 |
/// minor) and inode number, as the eBPF side reads them from the inode.
pub fn file_key(path: &Path) -> Option<crate::abi::FileKey> {
    use std::os::unix::fs::FileTypeExt;
    let m = fs::metadata(path).ok()?;
    // A block device by its number: whatever node opened it (libvirt's
    // private /dev, a by-id link) is the same device.
    if m.file_type().is_block_device() {
        let rdev = m.rdev();
        return Some(crate::abi::FileKey {
            dev: crate::abi::VDISK_FILE_BDEV,
            _pad: 0,
            ino: u64::from((libc::major(rdev) << 20) | libc::minor(rdev)),
        });
    }
    let dev = m.dev();
    Some(crate::abi::FileKey {
        dev: (libc::major(dev) << 20) | libc::minor(dev),
        _pad: 0,
        ino: m.ino(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &[&str]) -> Vec<String> {
        s.iter().map(|a| a.to_string()).collect()
    }

    /// A configfs tree as LIO lays it out: a vhost target whose TPG's LUNs
    /// link to file and block backstores.
    fn lio_tree(root: &Path, wwpn: &str, luns: &[(&str, &str, &str, &str)]) {
        for (lun, store, udev, info) in luns {
            let core = root.join("target/core").join(store);
            fs::create_dir_all(&core).unwrap();
            fs::write(core.join("udev_path"), udev).unwrap();
            fs::write(core.join("info"), info).unwrap();
            let dir = root
                .join("target/vhost")
                .join(wwpn)
                .join("tpgt_1/lun")
                .join(lun);
            fs::create_dir_all(&dir).unwrap();
            std::os::unix::fs::symlink(&core, dir.join("5f2e8a91c3")).unwrap();
        }
        fs::create_dir_all(root.join("target/vhost").join(wwpn).join("tpgt_1/acls")).unwrap();
    }

    #[test]
    fn a_vhost_scsi_target_becomes_a_disk_per_lun_with_its_backing() {
        let root = std::env::temp_dir().join(format!("iospan-lio-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let img = root.join("vm.img");
        fs::create_dir_all(&root).unwrap();
        fs::write(&img, [0u8; 4096]).unwrap();
        let wwpn = "naa.5001405c0ffee001";
        lio_tree(
            &root,
            wwpn,
            &[
                ("lun_10", "fileio_1/logs", "",
                 &format!("Status: ACTIVATED  Max Queue Depth: 128\n        TCM FILEIO ID: 1        File: {}  Size: 4096  Mode: O_DSYNC Async: 1\n", img.display())),
                ("lun_2", "fileio_0/data", &img.display().to_string(), ""),
            ],
        );
        let mut vm = from_args(
            7,
            &args(&["-device", &format!("vhost-scsi-pci,wwpn={wwpn},id=vs0")]),
        );
        assert_eq!(vm.disks.len(), 1);
        assert!(vm.disks[0].kernel_vhost());
        assert_eq!(
            vm.disks[0].split_support().unwrap_err(),
            "no LUN of its target found in LIO's configfs (target/vhost/WWPN under IOSPAN_CONFIGFS, default /sys/kernel/config) on a host disk"
        );
        vm.find_luns(&root.join("nowhere"));
        assert_eq!(vm.disks.len(), 1, "no configfs: the device stays, unsplit");
        vm.find_luns(&root);
        let ids: Vec<_> = vm.disks.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["vs0/lun_2", "vs0/lun_10"], "in LUN order");
        for d in &vm.disks {
            assert_eq!(d.file.as_deref(), Some(img.as_path()));
            assert_eq!(d.host_dev, host_disk_of(&img));
        }
        assert_eq!(
            vm.disks[1].target.as_deref(),
            Some("naa.5001405c0ffee001/lun_10")
        );
        // On a host disk (not tmpfs) the split is supported.
        assert_eq!(vm.disks[0].split_supported(), host_disk_of(&img).is_some());
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn libvirt_style_name_drive_and_device() {
        let vm = from_args(
            7,
            &args(&[
                "-name", "guest=web01,debug-threads=on",
                "-drive", "file=/var/lib/libvirt/images/web01.img,if=none,id=drive-virtio-disk0,format=raw,cache=none,aio=io_uring",
                "-device", "virtio-blk-pci,drive=drive-virtio-disk0,id=virtio-disk0,bootindex=1",
                "-drive", "file=/data/db,,with,,commas.raw,if=none,id=d1",
                "-device", "nvme,drive=d1,serial=abc",
                "-chardev", "socket,id=charchannel0,path=/run/libvirt/qemu/other.sock,server=on,wait=off",
                "-chardev", "socket,id=charchannel1,path=/run/iospan/web01.sock,server=on,wait=off",
                "-device", "virtio-serial-pci,id=virtio-serial0",
                "-device", "virtserialport,bus=virtio-serial0.0,nr=1,chardev=charchannel0,id=channel0,name=org.qemu.guest_agent.0",
                "-device", "virtserialport,bus=virtio-serial0.0,nr=2,chardev=charchannel1,id=channel1,name=org.iospan.0",
            ]),
        );
        assert_eq!(vm.name, "web01");
        assert_eq!(
            vm.channel,
            Some(SocketSource::Path("/run/iospan/web01.sock".into()))
        );
        assert_eq!(vm.serials, [("d1".to_string(), "abc".to_string())]);
        assert_eq!(vm.disks.len(), 2);
        assert_eq!(vm.disks[0].id, "virtio-disk0");
        assert_eq!(vm.disks[0].model.as_deref(), Some("virtio-blk-pci"));
        assert_eq!(
            vm.disks[0].file.as_deref(),
            Some(Path::new("/var/lib/libvirt/images/web01.img"))
        );
        assert_eq!(vm.disks[1].id, "d1", "no device id: the drive's");
        assert_eq!(vm.disks[0].aio.as_deref(), Some("io_uring"));
        assert_eq!(
            vm.disks[1].aio.as_deref(),
            Some("threads"),
            "QEMU's default"
        );
        assert!(vm.disks[0].split_supported(), "virtio-blk on io_uring");
        assert!(vm.named_threads);
        assert!(!vm.disks[1].split_supported(), "NVMe without ioeventfd=on");
        assert!(vm.disks[1].worker_submitted());
        assert_eq!(
            vm.disks[1].file.as_deref(),
            Some(Path::new("/data/db,with,commas.raw"))
        );
    }

    /// Split a recorded command line as /proc/PID/cmdline would (one
    /// argument per element; the recordings keep JSON in single quotes).
    fn recorded(line: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut cur = String::new();
        let mut quoted = false;
        for c in line.chars() {
            match c {
                '\'' => quoted = !quoted,
                ' ' | '\n' if !quoted => {
                    if !cur.is_empty() {
                        out.push(std::mem::take(&mut cur));
                    }
                }
                _ => cur.push(c),
            }
        }
        if !cur.is_empty() {
            out.push(cur);
        }
        out.remove(0);
        out
    }

    /// libvirt 9.0 (Debian 12) starting a TCG domain with an iothread, a
    /// file disk, a block-device disk and the guest channel passed as an fd.
    const LIBVIRT: &str = r#"/usr/bin/qemu-system-x86_64 -name guest=lv-file,debug-threads=on -S
        -object '{"qom-type":"secret","id":"masterKey0","format":"raw","file":"/var/lib/libvirt/qemu/domain-2-lv-file/master-key.aes"}'
        -machine pc-i440fx-7.2,usb=off,dump-guest-core=off,memory-backend=pc.ram -accel tcg -cpu qemu64
        -bios /usr/share/qemu/qboot.rom -m 512 -object '{"qom-type":"memory-backend-ram","id":"pc.ram","size":536870912}'
        -overcommit mem-lock=off -smp 1,sockets=1,cores=1,threads=1 -object '{"qom-type":"iothread","id":"iothread1"}'
        -uuid b40a0dcb-ecba-4afd-97ea-fcc0c6900c2a -display none -no-user-config -nodefaults
        -chardev socket,id=charmonitor,fd=31,server=on,wait=off -mon chardev=charmonitor,id=monitor,mode=control
        -rtc base=utc -no-shutdown -no-acpi -boot strict=on -kernel /srv/rig/vmlinuz -initrd /srv/rig/initrd.cpio.gz
        -append 'console=ttyS0 quiet'
        -device '{"driver":"virtio-serial-pci","id":"virtio-serial0","bus":"pci.0","addr":"0x2"}'
        -blockdev '{"driver":"file","filename":"/var/lib/libvirt/images/lv-file.img","aio":"io_uring","node-name":"libvirt-2-storage","cache":{"direct":true,"no-flush":false},"auto-read-only":true,"discard":"unmap"}'
        -blockdev '{"node-name":"libvirt-2-format","read-only":false,"cache":{"direct":true,"no-flush":false},"driver":"raw","file":"libvirt-2-storage"}'
        -device '{"driver":"virtio-blk-pci","iothread":"iothread1","bus":"pci.0","addr":"0x3","drive":"libvirt-2-format","id":"virtio-disk0","bootindex":1,"write-cache":"on"}'
        -blockdev '{"driver":"host_device","filename":"/dev/vg0/lv-data","aio":"native","node-name":"libvirt-1-storage","cache":{"direct":true,"no-flush":false},"auto-read-only":true,"discard":"unmap"}'
        -blockdev '{"node-name":"libvirt-1-format","read-only":false,"cache":{"direct":true,"no-flush":false},"driver":"raw","file":"libvirt-1-storage"}'
        -device '{"driver":"virtio-blk-pci","bus":"pci.0","addr":"0x4","drive":"libvirt-1-format","id":"virtio-disk1","write-cache":"on"}'
        -add-fd set=0,fd=30,opaque=serial0-source -chardev file,id=charserial0,path=/dev/fdset/0,append=on
        -device '{"driver":"isa-serial","chardev":"charserial0","id":"serial0","index":0}'
        -chardev socket,id=charchannel0,fd=29,server=on,wait=off
        -device '{"driver":"virtserialport","bus":"virtio-serial0.0","nr":1,"chardev":"charchannel0","id":"channel0","name":"org.iospan.0"}'
        -audiodev '{"id":"audio1","driver":"none"}' -sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny -msg timestamp=on"#;

    #[test]
    fn libvirt_json_devices_blockdevs_iothreads_uuid_and_fd_channel() {
        let vm = from_args(7, &recorded(LIBVIRT));
        assert_eq!(vm.name, "lv-file");
        assert_eq!(
            vm.uuid.as_deref(),
            Some("b40a0dcb-ecba-4afd-97ea-fcc0c6900c2a")
        );
        assert!(vm.named_threads);
        assert_eq!(vm.not_vm, None, "paused at start, but it has disks");
        let d: Vec<_> = vm
            .disks
            .iter()
            .map(|d| {
                (
                    d.id.as_str(),
                    d.model.as_deref(),
                    d.file.as_deref().and_then(Path::to_str),
                    d.aio.as_deref(),
                    d.iothread.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            d,
            [
                (
                    "virtio-disk0",
                    Some("virtio-blk-pci"),
                    Some("/var/lib/libvirt/images/lv-file.img"),
                    Some("io_uring"),
                    Some("iothread1")
                ),
                (
                    "virtio-disk1",
                    Some("virtio-blk-pci"),
                    Some("/dev/vg0/lv-data"),
                    Some("native"),
                    None
                ),
            ]
        );
        assert!(vm.disks.iter().all(VDisk::split_supported));
        assert_eq!(vm.channel, Some(SocketSource::Fd(29)));
        assert_eq!(vm.guest_channel, None, "resolved only through the process");
    }

    #[test]
    fn libvirt_capability_probes_are_not_vms() {
        // What libvirtd runs to learn a binary's capabilities.
        let probe = recorded(
            "qemu-system-x86_64 -S -no-user-config -nodefaults -nographic -machine none,accel=kvm:tcg \
             -qmp unix:/var/lib/libvirt/qemu/capabilities.monitor.sock,server=on,wait=off \
             -pidfile /var/lib/libvirt/qemu/capabilities.pidfile -daemonize",
        );
        let vm = from_args(40, &probe);
        assert!(
            vm.not_vm
                .as_deref()
                .is_some_and(|w| w.contains("-machine none")),
            "{vm:?}"
        );
        // -M and JSON-free keyval forms too; paused with nothing to run.
        assert!(from_args(41, &args(&["-M", "none"])).not_vm.is_some());
        assert!(from_args(42, &args(&["-machine", "type=none,accel=tcg"]))
            .not_vm
            .is_some());
        assert!(
            from_args(43, &args(&["-S", "-nodefaults", "-qmp", "stdio"]))
                .not_vm
                .is_some()
        );
        // Paused with a kernel to run, or a disk, is a VM.
        assert!(from_args(44, &args(&["-S", "-kernel", "/boot/vmlinuz"]))
            .not_vm
            .is_none());
        assert!(from_args(45, &args(&["-S", "-drive", "file=/a.img,id=d0"]))
            .not_vm
            .is_none());
    }

    #[test]
    fn rhel_qemu_kvm_and_proxmox_kvm_are_qemu() {
        assert!(is_qemu_comm("qemu-system-x86"));
        assert!(is_qemu_comm("qemu-kvm\n"));
        assert!(is_qemu_comm("kvm"));
        assert!(!is_qemu_comm("kvm-pit/1234"));
        assert!(!is_qemu_comm("qemu-storage-da"));
        assert!(!is_qemu_comm("qemu-ga"));
        // RHEL 9's /usr/libexec/qemu-kvm as libvirt starts it (from libvirt's
        // and RHEL's documentation): q35, a qcow2 on a file, the guest channel.
        let rhel = recorded(
            r#"/usr/libexec/qemu-kvm -name guest=rhel9-db,debug-threads=on -S -machine pc-q35-rhel9.2.0,usb=off,memory-backend=pc.ram
               -accel kvm -uuid 5d2b1cbf-0f6e-4c2a-9d0c-6a7c3f0e1a11 -no-user-config -nodefaults
               -object '{"qom-type":"iothread","id":"iothread1"}'
               -blockdev '{"driver":"file","filename":"/var/lib/libvirt/images/rhel9-db.qcow2","node-name":"libvirt-1-storage","auto-read-only":true,"discard":"unmap","aio":"native","cache":{"direct":true,"no-flush":false}}'
               -blockdev '{"node-name":"libvirt-1-format","read-only":false,"discard":"unmap","cache":{"direct":true,"no-flush":false},"driver":"qcow2","file":"libvirt-1-storage"}'
               -device '{"driver":"virtio-blk-pci","iothread":"iothread1","bus":"pci.4","addr":"0x0","drive":"libvirt-1-format","id":"virtio-disk0","bootindex":1,"write-cache":"on","num-queues":4}'
               -chardev socket,id=charchannel1,fd=35,server=on,wait=off
               -device '{"driver":"virtserialport","bus":"virtio-serial0.0","nr":2,"chardev":"charchannel1","id":"channel1","name":"org.iospan.0"}'"#,
        );
        let vm = from_args(100, &rhel);
        assert_eq!(vm.name, "rhel9-db");
        assert_eq!(vm.disks.len(), 1);
        assert_eq!(vm.disks[0].id, "virtio-disk0");
        assert_eq!(
            vm.disks[0].file.as_deref(),
            Some(Path::new("/var/lib/libvirt/images/rhel9-db.qcow2"))
        );
        assert_eq!(vm.disks[0].aio.as_deref(), Some("native"));
        assert_eq!(vm.disks[0].iothread.as_deref(), Some("iothread1"));
        assert_eq!(vm.channel, Some(SocketSource::Fd(35)));
        assert!(looks_like_qemu("qemu-kvm", &vm));
        // Proxmox VE's qemu-server (from its documentation): /usr/bin/kvm,
        // -id, a bare -name with options, keyval drives on LVM and ZFS.
        let pve = recorded(
            "/usr/bin/kvm -id 100 -name 'web01,debug-threads=on' -no-shutdown \
             -chardev socket,id=qmp,path=/var/run/qemu-server/100.qmp,server=on,wait=off -mon chardev=qmp,mode=control \
             -pidfile /var/run/qemu-server/100.pid -daemonize -smbios type=1,uuid=6b0e1c0a-1f3a-4c55-9d4e-2b7f0c2a9e10 \
             -smp 2,sockets=1,cores=2,maxcpus=2 -m 4096 -object iothread,id=iothread-virtio0 \
             -drive file=/dev/pve/vm-100-disk-0,if=none,id=drive-virtio0,cache=none,aio=io_uring,format=raw,detect-zeroes=on \
             -device virtio-blk-pci,drive=drive-virtio0,id=virtio0,bus=pci.0,addr=0xa,iothread=iothread-virtio0,bootindex=100 \
             -drive file=/dev/zvol/rpool/data/vm-100-disk-1,if=none,id=drive-scsi0,cache=none,aio=native,format=raw \
             -device scsi-hd,bus=scsihw0.0,channel=0,scsi-id=0,lun=0,drive=drive-scsi0,id=scsi0 -machine type=pc+pve0",
        );
        let vm = from_args(200, &pve);
        assert_eq!(vm.name, "web01");
        assert!(vm.named_threads);
        assert_eq!(vm.not_vm, None);
        let ids: Vec<_> = vm.disks.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["virtio0", "scsi0"]);
        assert_eq!(
            vm.disks[0].file.as_deref(),
            Some(Path::new("/dev/pve/vm-100-disk-0"))
        );
        assert_eq!(vm.disks[0].iothread.as_deref(), Some("iothread-virtio0"));
        assert_eq!(vm.disks[1].aio.as_deref(), Some("native"));
        assert!(looks_like_qemu("kvm", &vm));
        // Something else named kvm, with a command line QEMU never takes.
        assert!(!looks_like_qemu(
            "kvm",
            &from_args(300, &args(&["--verbose", "x"]))
        ));
    }

    /// A recorded sysfs tree: an LVM volume (dm-0) over a partition of a
    /// loop device, a striped one (dm-1) over two whole disks, and a plain
    /// partition.
    fn sysfs_tree(root: &Path) {
        let dev = |p: &str, d: &str| {
            fs::create_dir_all(root.join(p)).unwrap();
            fs::write(root.join(p).join("dev"), format!("{d}\n")).unwrap();
        };
        dev("devices/virtual/block/loop0", "7:0");
        dev("devices/virtual/block/loop0/loop0p1", "259:0");
        fs::write(
            root.join("devices/virtual/block/loop0/loop0p1/partition"),
            "1\n",
        )
        .unwrap();
        dev("devices/pci0000:00/nvme/nvme0n1", "259:1");
        dev("devices/pci0000:00/sda", "8:0");
        dev("devices/virtual/block/dm-0", "253:0");
        dev("devices/virtual/block/dm-1", "253:1");
        let link = |from: &str, to: &str| {
            let p = root.join(from);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::os::unix::fs::symlink(root.join(to), p).unwrap();
        };
        link(
            "devices/virtual/block/dm-0/slaves/loop0p1",
            "devices/virtual/block/loop0/loop0p1",
        );
        link(
            "devices/virtual/block/dm-1/slaves/sda",
            "devices/pci0000:00/sda",
        );
        link(
            "devices/virtual/block/dm-1/slaves/nvme0n1",
            "devices/pci0000:00/nvme/nvme0n1",
        );
        for (n, d) in [
            ("7:0", "devices/virtual/block/loop0"),
            ("259:0", "devices/virtual/block/loop0/loop0p1"),
            ("259:1", "devices/pci0000:00/nvme/nvme0n1"),
            ("8:0", "devices/pci0000:00/sda"),
            ("253:0", "devices/virtual/block/dm-0"),
            ("253:1", "devices/virtual/block/dm-1"),
        ] {
            link(&format!("dev/block/{n}"), d);
        }
    }

    #[test]
    fn device_mapper_stacks_resolve_to_the_physical_disks_under_them() {
        let root = std::env::temp_dir().join(format!("iospan-sysfs-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        sysfs_tree(&root);
        let lv = host_stack_of_dev(&root, 253, 0).unwrap();
        assert_eq!(lv.top, "dm-0");
        assert!(lv.dm);
        assert_eq!(lv.leaves, [Dev::new(7, 0)], "the partition's whole disk");
        assert_eq!(lv.leaf_names, ["loop0"]);
        let striped = host_stack_of_dev(&root, 253, 1).unwrap();
        assert_eq!(striped.leaf_names, ["nvme0n1", "sda"]);
        assert_eq!(striped.leaves, [Dev::new(259, 1), Dev::new(8, 0)]);
        let part = host_stack_of_dev(&root, 259, 0).unwrap();
        assert_eq!((part.top.as_str(), part.dm), ("loop0p1", false));
        assert_eq!(part.leaves, [Dev::new(7, 0)]);
        assert!(host_stack_of_dev(&root, 1, 1).is_none());
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn block_devices_are_keyed_by_their_number_not_their_node() {
        let k = file_key(Path::new("/dev/null")).unwrap();
        assert_ne!(
            k.dev,
            crate::abi::VDISK_FILE_BDEV,
            "a character device is a file"
        );
        let loop_node = fs::read_dir("/dev")
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                use std::os::unix::fs::FileTypeExt;
                fs::metadata(p).is_ok_and(|m| m.file_type().is_block_device())
            })
            .expect("a block device node under /dev");
        let k = file_key(&loop_node).unwrap();
        let rdev = fs::metadata(&loop_node).unwrap().rdev();
        assert_eq!(k.dev, crate::abi::VDISK_FILE_BDEV);
        assert_eq!(
            k.ino,
            u64::from((libc::major(rdev) << 20) | libc::minor(rdev))
        );
    }

    #[test]
    fn blockdev_chains_json_and_keyval() {
        let vm = from_args(
            8,
            &args(&[
                "-name",
                "db",
                "-blockdev",
                r#"{"driver":"file","filename":"/img/db.qcow2","node-name":"libvirt-1-storage"}"#,
                "-blockdev",
                r#"{"node-name":"libvirt-1-format","driver":"qcow2","file":"libvirt-1-storage"}"#,
                "-device",
                "virtio-blk-pci,drive=libvirt-1-format,id=virtio-disk0",
                "-blockdev",
                "driver=file,node-name=f2,filename=/img/log.raw",
                "-blockdev",
                "driver=raw,node-name=r2,file=f2",
                "-device",
                "scsi-hd,drive=r2,id=scsi0-0-0-0",
            ]),
        );
        assert_eq!(vm.name, "db");
        let files: Vec<_> = vm
            .disks
            .iter()
            .map(|d| (d.id.as_str(), d.file.clone()))
            .collect();
        assert_eq!(
            files,
            [
                ("virtio-disk0", Some(PathBuf::from("/img/db.qcow2"))),
                ("scsi0-0-0-0", Some(PathBuf::from("/img/log.raw")))
            ]
        );
    }

    #[test]
    fn vhost_user_disks_are_served_by_the_daemon_exporting_on_their_socket() {
        let mut vm = from_args(
            12,
            &args(&[
                "-name",
                "guest=vu",
                "-object",
                "memory-backend-memfd,id=mem0,size=512M,share=on",
                "-chardev",
                "socket,id=vu0,path=/run/vu/a.sock",
                "-device",
                "vhost-user-blk-pci,chardev=vu0,id=vd0,num-queues=1",
                "-chardev",
                "socket,id=vu1,path=rel.sock",
                "-device",
                "vhost-user-blk-pci,chardev=vu1",
            ]),
        );
        assert_eq!(vm.disks.len(), 2);
        assert_eq!(vm.disks[0].id, "vd0");
        assert_eq!(vm.disks[1].id, "vu1", "no device id: the chardev's");
        assert_eq!(
            vm.disks[0].socket.as_deref(),
            Some(Path::new("/run/vu/a.sock"))
        );
        assert!(!vm.disks[0].split_supported(), "no engine found yet");
        let exports = exports_from_args(
            &args(&[
                "--blockdev", "driver=file,node-name=file0,filename=/img/a.raw,cache.direct=on,aio=io_uring",
                "--blockdev", "driver=raw,node-name=disk0,file=file0",
                "--blockdev=driver=file,node-name=f1,filename=/img/b.raw",
                "--export", "type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,addr.path=/run/vu/a.sock,writable=on",
                "--export=type=vhost-user-blk,id=exp1,node-name=f1,addr.type=unix,addr.path=rel.sock",
                "--export", "type=nbd,id=n0,node-name=disk0",
            ]),
            Path::new("/srv"),
        );
        assert_eq!(
            exports,
            [
                Export {
                    id: "exp0".into(),
                    socket: "/run/vu/a.sock".into(),
                    file: Some("/img/a.raw".into()),
                    aio: "io_uring".into()
                },
                Export {
                    id: "exp1".into(),
                    socket: "/srv/rel.sock".into(),
                    file: Some("/img/b.raw".into()),
                    aio: "threads".into()
                },
            ]
        );
        let engine = EngineRef {
            pid: 40,
            program: "qemu-storage-daemon".into(),
            export: String::new(),
            exe: None,
            comm: STORAGE_DAEMON_COMM.into(),
        };
        vm.find_engines(&[(engine, exports)], Path::new("/srv"));
        let e = vm.disks[0].engine.as_ref().expect("served");
        assert_eq!((e.pid, e.export.as_str()), (40, "exp0"));
        assert_eq!(vm.disks[0].file.as_deref(), Some(Path::new("/img/a.raw")));
        assert_eq!(vm.disks[0].aio.as_deref(), Some("io_uring"));
        assert!(vm.disks[0].split_supported());
        assert_eq!(
            vm.disks[1].engine.as_ref().map(|e| e.export.as_str()),
            Some("exp1")
        );
        assert_eq!(vm.engines().len(), 1, "one process, two exports");
    }

    #[test]
    fn bare_drive_and_unnamed_vm() {
        let vm = from_args(
            9,
            &args(&["-m", "512", "-drive", "file=/tmp/a.img,id=hd0,if=virtio"]),
        );
        assert_eq!(vm.name, "qemu-9");
        assert_eq!(vm.disks.len(), 1);
        assert_eq!(vm.disks[0].id, "hd0");
        assert_eq!(vm.disks[0].model, None);
    }

    #[test]
    fn registry_gives_disks_slots_and_marks_shared_host_disks() {
        let (a, b) = (Dev::new(8, 0), Dev::new(259, 0));
        let disk = |id: &str, dev| VDisk {
            id: id.into(),
            host_dev: Some(dev),
            ..Default::default()
        };
        let mut r = Registry::default();
        let m1 = r.add(
            1,
            Vm {
                pid: 10,
                name: "one".into(),
                disks: vec![disk("x", a)],
                named_threads: true,
                ..Default::default()
            },
        );
        let m2 = r.add(
            2,
            Vm {
                pid: 11,
                name: "two".into(),
                disks: vec![disk("y", a), disk("z", a), disk("w", b)],
                named_threads: true,
                ..Default::default()
            },
        );
        assert_eq!(m1.disks, [(crate::abi::VmDevKey { vm: 1, dev: a.0 }, 1)]);
        assert_eq!(
            m2.disks,
            [
                (
                    crate::abi::VmDevKey { vm: 2, dev: a.0 },
                    crate::abi::VDISK_SEVERAL
                ),
                (crate::abi::VmDevKey { vm: 2, dev: b.0 }, 4)
            ]
        );
        assert_eq!(
            (r.vdisk(1), r.vdisk(3), r.vdisk(4), r.vdisk(9)),
            (Some("x"), Some("z"), Some("w"), None)
        );
        assert_eq!(
            (r.name(2), r.name(7)),
            ("two".to_string(), "vm#7".to_string())
        );
    }

    #[test]
    fn file_key_uses_the_kernels_dev_encoding() {
        let exe = std::env::current_exe().unwrap();
        let k = file_key(&exe).unwrap();
        let m = fs::metadata(&exe).unwrap();
        assert_eq!(k.ino, m.ino());
        assert_eq!(k.dev >> 20, libc::major(m.dev()));
        assert_eq!(k.dev & 0xfffff, libc::minor(m.dev()));
        assert!(file_key(Path::new("/nonexistent/file")).is_none());
    }
}

/// Where a uprobe on `symbol` in `exe` goes, and how the kernel will run
/// the probed instruction: emulated when it is a push (cheap), single-
/// stepped out of line otherwise (see `iospan doctor` for both costs here).
/// An endbr64 (CET builds) is stepped over: calls run through it to the
/// push after it. None when the symbol is not found.
pub fn uprobe_site(exe: &Path, symbol: &str) -> Option<(u64, Prologue)> {
    use object::{Object, ObjectSection, ObjectSymbol};
    let data = fs::read(exe).ok()?;
    let file = object::File::parse(&*data).ok()?;
    let sym = file
        .dynamic_symbols()
        .chain(file.symbols())
        .find(|s| s.name() == Ok(symbol))?;
    let section = file.section_by_index(sym.section_index()?).ok()?;
    let bytes = section.data_range(sym.address(), 8).ok()??;
    let offset = if bytes.starts_with(&[0xf3, 0x0f, 0x1e, 0xfa]) {
        4
    } else {
        0
    };
    let push = matches!(
        &bytes[offset as usize..],
        [0x50..=0x57, ..] | [0x41, 0x50..=0x57, ..]
    );
    Some((
        offset,
        if push {
            Prologue::Push
        } else {
            Prologue::SingleStepped
        },
    ))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Prologue {
    Push,
    SingleStepped,
}

impl Vm {
    /// The QEMU functions probed in this VM, each with whether it is hit
    /// per request (hot): with the host-window split, those whose hits end
    /// its windows (the used-ring push for virtio disks, the interrupt for
    /// NVMe); always, virtio-blk's accounting of requests it merged, hit
    /// only when it merges.
    pub fn uprobe_symbols(&self, split: bool) -> Vec<(&'static str, bool)> {
        let mut v = Vec::new();
        let model = |d: &VDisk, p: &str| d.model.as_deref().is_some_and(|m| m.starts_with(p));
        let virtio = self.disks.iter().any(|d| model(d, "virtio-blk"));
        if split && virtio {
            v.push(("virtqueue_flush", true));
        }
        if split && self.disks.iter().any(|d| model(d, "nvme")) {
            v.push(("msix_notify", true));
        }
        if virtio {
            v.push(("block_acct_merge_done", false));
        }
        v
    }
}

impl EngineRef {
    /// Whether its kick pickups and used-ring pushes are followed
    /// (qemu-storage-daemon's libvhost-user); other engines are only
    /// identified, their requests the VM's.
    pub fn followed(&self) -> bool {
        self.comm == STORAGE_DAEMON_COMM
    }

    /// The engine's probes: its used-ring push ends its disks' host
    /// windows, as QEMU's does.
    pub fn uprobe_symbols(&self, split: bool) -> Vec<(&'static str, bool)> {
        if split && self.followed() {
            vec![("vu_queue_push", true)]
        } else {
            Vec::new()
        }
    }
}
