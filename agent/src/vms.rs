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

use crate::disks::Dev;

/// The command-name prefix of a QEMU system emulator (its comm, and the
/// file name it was executed as). Mirrors VM_COMM_PREFIX in agent_abi.h.
pub const QEMU_PREFIX: &str = "qemu-system-";

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vm {
    pub pid: u32,
    pub name: String,
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
    /// The host end of the guest agent's channel: the unix socket of the
    /// chardev behind a virtserialport named `org.iospan.0`.
    #[serde(default)]
    pub guest_channel: Option<PathBuf>,
    /// Device serials (`serial=`) by virtual disk id, to match the guest's
    /// disks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub serials: Vec<(String, String)>,
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

/// `k=v,k=v` options as QEMU parses them (`,,` is a literal comma); a
/// leading bare word is returned under the key "".
fn options(s: &str) -> Vec<(String, String)> {
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

/// Identity from QEMU's arguments (argv without argv[0]).
pub fn from_args(pid: u32, args: &[String]) -> Vm {
    let mut name = None;
    let mut named_threads = false;
    let mut chardevs: Vec<(String, PathBuf)> = Vec::new(); // (id, unix socket path)
    let mut channel_dev: Option<String> = None; // chardev of the guest agent's port
    let mut serials: Vec<(String, String)> = Vec::new(); // (device or drive id, serial)
                                                         // drive/node id -> backing file
    let mut files: Vec<(String, Option<PathBuf>, Option<String>)> = Vec::new(); // (id, file, child node)
    let mut aio: Vec<(String, String)> = Vec::new(); // (drive/node id, aio mode)
    let mut devices: Vec<(String, Option<String>, String, bool)> = Vec::new(); // (model, id, drive, ioeventfd)
    let mut vhost: Vec<(String, Option<String>, String)> = Vec::new(); // (model, id, chardev)
    let mut vscsi: Vec<(String, Option<String>, String)> = Vec::new(); // (model, id, wwpn)
    let mut i = 0;
    while i < args.len() {
        let a = args[i].trim_start_matches('-');
        let v = args.get(i + 1).map(String::as_str).unwrap_or("");
        let is_opt = args[i].starts_with('-');
        match (is_opt, a) {
            (true, "name") => {
                let o = options(v);
                name = get(&o, "guest").or_else(|| get(&o, "")).map(str::to_string);
                named_threads =
                    get(&o, "debug-threads").is_some_and(|v| matches!(v, "on" | "true" | "yes"));
                i += 1;
            }
            (true, "drive") => {
                let o = options(v);
                if let Some(id) = get(&o, "id") {
                    files.push((id.to_string(), get(&o, "file").map(PathBuf::from), None));
                    aio.push((
                        id.to_string(),
                        get(&o, "aio").unwrap_or("threads").to_string(),
                    ));
                }
                i += 1;
            }
            (true, "blockdev") => {
                if let Some((id, file, child, a)) = blockdev(v) {
                    files.push((id.clone(), file, child));
                    if let Some(a) = a {
                        aio.push((id, a));
                    }
                }
                i += 1;
            }
            (true, "device") => {
                let o = options(v);
                let model = get(&o, "").or_else(|| get(&o, "driver")).unwrap_or("");
                let id = get(&o, "id").map(str::to_string);
                if let (false, Some(drive)) = (model.is_empty(), get(&o, "drive")) {
                    let ioeventfd =
                        get(&o, "ioeventfd").is_some_and(|v| matches!(v, "on" | "true" | "yes"));
                    if let Some(serial) = get(&o, "serial") {
                        serials.push((
                            id.clone().unwrap_or_else(|| drive.to_string()),
                            serial.to_string(),
                        ));
                    }
                    devices.push((model.to_string(), id.clone(), drive.to_string(), ioeventfd));
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
                            && get(&o, "name") == Some(crate::transport::PORT_NAME) =>
                    {
                        channel_dev = chardev.map(str::to_string);
                    }
                    _ => {}
                }
                i += 1;
            }
            (true, "chardev") => {
                let o = options(v);
                if let (Some("socket"), Some(id), Some(path)) =
                    (get(&o, ""), get(&o, "id"), get(&o, "path"))
                {
                    chardevs.push((id.to_string(), PathBuf::from(path)));
                }
                i += 1;
            }
            _ => {}
        }
        i += 1;
    }
    let file_of = |id: &str| node_file(&files, id);
    let aio_of = |id: &str| Some(node_aio(&files, &aio, id));
    let mut disks: Vec<VDisk> = devices
        .iter()
        .map(|(model, id, drive, ioeventfd)| VDisk {
            id: id.clone().unwrap_or_else(|| drive.clone()),
            model: Some(model.clone()),
            file: file_of(drive),
            aio: aio_of(drive),
            ioeventfd: *ioeventfd,
            ..Default::default()
        })
        .collect();
    // vhost-user disks: served by whoever exports on the chardev's socket.
    for (model, id, chardev) in &vhost {
        disks.push(VDisk {
            id: id.clone().unwrap_or_else(|| chardev.clone()),
            model: Some(model.clone()),
            ioeventfd: true,
            socket: chardevs
                .iter()
                .find(|(c, _)| c == chardev)
                .map(|(_, p)| p.clone()),
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
        let used = devices.iter().any(|(_, _, d, _)| d == id)
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
        d.host_dev = d.file.as_deref().and_then(host_disk_of);
    }
    Vm {
        pid,
        name: name.unwrap_or_else(|| format!("qemu-{pid}")),
        disks,
        exe: None,
        kicks: KickSource::default(),
        named_threads,
        guest_channel: channel_dev.and_then(|c| {
            chardevs
                .into_iter()
                .find(|(id, _)| *id == c)
                .map(|(_, p)| p)
        }),
        serials,
    }
}

/// A `-blockdev` (JSON or key=value): node name, file name, child node
/// and aio mode.
/// (node name, file name, child node, aio mode).
type BlockNode = (String, Option<PathBuf>, Option<String>, Option<String>);

fn blockdev(v: &str) -> Option<BlockNode> {
    if let Ok(j) = serde_json::from_str::<serde_json::Value>(v) {
        let id = j["node-name"].as_str()?.to_string();
        return Some((
            id,
            j["filename"].as_str().map(PathBuf::from),
            j["file"].as_str().map(str::to_string),
            j["aio"].as_str().map(str::to_string),
        ));
    }
    let o = options(v);
    Some((
        get(&o, "node-name")?.to_string(),
        get(&o, "filename").map(PathBuf::from),
        get(&o, "file").map(str::to_string),
        get(&o, "aio").map(str::to_string),
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
                    d.host_dev = d.file.as_deref().and_then(host_disk_of);
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
pub fn host_disk_of(file: &Path) -> Option<Dev> {
    use std::os::unix::fs::FileTypeExt;
    let meta = fs::metadata(file).ok()?;
    let dev = if meta.file_type().is_block_device() {
        meta.rdev()
    } else {
        meta.dev()
    };
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let sys = fs::canonicalize(format!("/sys/dev/block/{major}:{minor}")).ok()?;
    let disk = if sys.join("partition").exists() {
        sys.parent()?.to_path_buf()
    } else {
        sys
    };
    let text = fs::read_to_string(disk.join("dev")).ok()?;
    let (a, b) = text.trim().split_once(':')?;
    Some(Dev::new(a.parse().ok()?, b.parse().ok()?))
}

/// A running process's identity, if it is a QEMU VM.
pub fn identify(pid: u32) -> Option<Vm> {
    let comm = fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    if !comm.starts_with(QEMU_PREFIX) {
        return None;
    }
    let raw = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<String> = raw
        .split(|&b| b == 0)
        .skip(1)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let mut vm = from_args(pid, &args);
    vm.exe = fs::read_link(format!("/proc/{pid}/exe"))
        .ok()
        .filter(|p| p.exists());
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
    comm.starts_with(QEMU_PREFIX) && !matches!(state, Some('Z' | 'X' | 'x'))
}

/// Whether an engine process still runs (as the same program).
pub fn engine_alive(e: &EngineRef) -> bool {
    fs::read_to_string(format!("/proc/{}/comm", e.pid)).is_ok_and(|c| c.trim_end() == e.comm)
}

/// The inode of the listening Unix socket bound at `path`
/// (/proc/net/unix: flag __SO_ACCEPTCON, 0x10000, marks a listener).
fn unix_listener(path: &Path) -> Option<u64> {
    let table = fs::read_to_string("/proc/net/unix").ok()?;
    let canon = fs::canonicalize(path).ok();
    table.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let (flags, inode, bound) = (f.get(3)?, f.get(6)?, Path::new(f.get(7)?));
        let listening = u32::from_str_radix(flags, 16).ok()? & 0x10000 != 0;
        let same = bound == path || (canon.is_some() && fs::canonicalize(bound).ok() == canon);
        (listening && same).then(|| inode.parse().ok()).flatten()
    })
}

/// The process holding socket `inode` open (the lowest pid, if several).
fn socket_owner(inode: u64) -> Option<u32> {
    let want = format!("socket:[{inode}]");
    let mut pids: Vec<u32> = fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    pids.into_iter().find(|pid| {
        fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
            fds.flatten()
                .any(|fd| fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == want.as_str()))
        })
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

    pub fn name(&self, slot: u32) -> String {
        self.vms
            .get(&slot)
            .map_or_else(|| format!("vm#{slot}"), |v| v.name.clone())
    }

    pub fn vdisk(&self, vdisk: u32) -> Option<&str> {
        self.vdisks.get(&vdisk).map(|(_, id)| id.as_str())
    }

    /// The QEMU device model of a virtual disk (virtio-blk-pci, nvme, …).
    pub fn vdisk_model(&self, vdisk: u32) -> Option<&str> {
        let (vm, id) = self.vdisks.get(&vdisk)?;
        self.vms
            .get(vm)?
            .disks
            .iter()
            .find(|d| &d.id == id)?
            .model
            .as_deref()
    }
}

/// The kernel's identity of a file: its superblock's dev_t (major << 20 |
/// minor) and inode number, as the eBPF side reads them from the inode.
pub fn file_key(path: &Path) -> Option<crate::abi::FileKey> {
    let m = fs::metadata(path).ok()?;
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
            vm.guest_channel.as_deref(),
            Some(Path::new("/run/iospan/web01.sock"))
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
                exe: None,
                kicks: KickSource::default(),
                named_threads: true,
                guest_channel: None,
                serials: Vec::new(),
            },
        );
        let m2 = r.add(
            2,
            Vm {
                pid: 11,
                name: "two".into(),
                disks: vec![disk("y", a), disk("z", a), disk("w", b)],
                exe: None,
                kicks: KickSource::default(),
                named_threads: true,
                guest_channel: None,
                serials: Vec::new(),
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
