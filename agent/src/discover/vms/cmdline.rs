//! QEMU's command line, parsed: a pure function from argv to the VM's
//! identity, virtual disks and channel. Keyval and JSON option forms alike.

use crate::model::text::make_printable;
use std::path::PathBuf;

use super::*;

/// An option's value as QEMU takes it: a JSON object (`-device {"driver":…}`,
/// as libvirt passes every device, blockdev and object) or `k=v,k=v`
/// (`,,` is a literal comma; a leading bare word under the key ""). JSON
/// is flattened to the same pairs: nested objects as dotted keys
/// (`cache.direct`), booleans and numbers as their text.
pub(super) fn options(s: &str) -> Vec<(String, String)> {
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

pub(super) fn keyval(s: &str) -> Vec<(String, String)> {
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

/// A unix socket chardev's id and socket (`-chardev socket,id=…,path=…`
/// or `fd=…`), from its options.
pub(super) fn socket_chardev(o: &[(String, String)]) -> Option<(String, SocketSource)> {
    let backend = get(o, "").or_else(|| get(o, "backend"));
    let src = match (get(o, "path"), get(o, "fd")) {
        (Some(p), _) => SocketSource::Path(PathBuf::from(p)),
        (None, Some(fd)) => SocketSource::Fd(fd.parse().ok()?),
        _ => return None,
    };
    (backend == Some("socket")).then_some(())?;
    Some((get(o, "id")?.to_string(), src))
}

pub(super) fn get<'a>(opts: &'a [(String, String)], key: &str) -> Option<&'a str> {
    opts.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

/// Identity from QEMU's arguments (argv without argv[0]): every form
/// QEMU takes them in, keyval or JSON (libvirt's), in one pass.
pub fn from_args(pid: u32, args: &[String]) -> Vm {
    let mut p = Parsed::default();
    let mut i = 0;
    while i < args.len() {
        let is_opt = args[i].starts_with('-');
        let a = args[i].trim_start_matches('-');
        let v = args.get(i + 1).map(String::as_str).unwrap_or("");
        // Options that take no value.
        match (is_opt, a) {
            (true, "S") => p.paused = true,
            (false, _) => {}
            _ if p.take(a, v) => i += 1,
            _ => {}
        }
        i += 1;
    }
    p.into_vm(pid)
}

/// An option's truth as QEMU reads it.
fn on(v: Option<&str>) -> bool {
    v.is_some_and(|v| matches!(v, "on" | "true" | "yes"))
}

/// A vhost-user disk's device: served by whoever exports on its chardev.
struct VhostUser {
    model: String,
    id: Option<String>,
    chardev: String,
    queues: Option<u32>,
}

/// A kernel vhost-scsi device: its LUNs are LIO's target's.
struct VhostScsi {
    model: String,
    id: Option<String>,
    wwpn: String,
}

/// What the command line said, option by option.
#[derive(Default)]
struct Parsed {
    name: Option<String>,
    uuid: Option<String>,
    named_threads: bool,
    machine: Option<String>,
    paused: bool,
    kernel: bool,
    iothreads: Vec<String>,
    /// (id, unix socket) of each socket chardev.
    chardevs: Vec<(String, SocketSource)>,
    /// The chardev of the guest agent's port.
    channel_dev: Option<String>,
    /// (device or drive id, serial).
    serials: Vec<(String, String)>,
    /// (drive or node id, backing file, child node).
    files: Vec<(String, Option<PathBuf>, Option<String>)>,
    /// (drive or node id, aio mode).
    aio: Vec<(String, String)>,
    /// (drive id, its throttle limits, group and cache mode).
    drive_knobs: Vec<(String, DiskKnobs)>,
    devices: Vec<Device>,
    cpus: Option<u32>,
    vhost: Vec<VhostUser>,
    vscsi: Vec<VhostScsi>,
    /// `-qmp unix:PATH,server`.
    qmp: Option<PathBuf>,
    /// The chardev of a `-mon` in control mode.
    mon_dev: Option<String>,
}

impl Parsed {
    /// Takes option `a` with value `v`; false for an option it does not
    /// know (whose next word is then read as an option or skipped).
    fn take(&mut self, a: &str, v: &str) -> bool {
        match a {
            "name" => {
                let o = options(v);
                self.name = get(&o, "guest").or_else(|| get(&o, "")).map(str::to_string);
                self.named_threads = on(get(&o, "debug-threads"));
            }
            "uuid" => self.uuid = Some(v.to_string()),
            "smp" => self.cpus = smp_cpus(v),
            "machine" | "M" => {
                let o = options(v);
                self.machine = get(&o, "type").or_else(|| get(&o, "")).map(str::to_string);
            }
            "kernel" => self.kernel = true,
            "object" => {
                let o = options(v);
                if get(&o, "qom-type").or_else(|| get(&o, "")) == Some("iothread") {
                    if let Some(id) = get(&o, "id") {
                        self.iothreads.push(id.to_string());
                    }
                }
            }
            "drive" => self.drive(&options(v)),
            "blockdev" => {
                if let Some((id, file, child, a)) = blockdev(v) {
                    self.files.push((id.clone(), file, child));
                    if let Some(a) = a {
                        self.aio.push((id, a));
                    }
                }
            }
            "device" => self.device(&options(v)),
            "qmp" | "qmp-pretty" => self.qmp(v),
            "mon" => {
                let o = options(v);
                if get(&o, "mode") == Some("control") && self.mon_dev.is_none() {
                    self.mon_dev = get(&o, "chardev").map(str::to_string);
                }
            }
            "chardev" => {
                if let Some(c) = socket_chardev(&options(v)) {
                    self.chardevs.push(c);
                }
            }
            _ => return false,
        }
        true
    }

    fn drive(&mut self, o: &[(String, String)]) {
        if let Some(id) = get(o, "id") {
            // `file=` or, where a format driver is named (LUKS, qcow2
            // with options), its protocol node's `file.filename=`.
            let file = get(o, "file").or_else(|| get(o, "file.filename"));
            self.files
                .push((id.to_string(), file.map(PathBuf::from), None));
            self.aio.push((
                id.to_string(),
                get(o, "aio")
                    .or_else(|| get(o, "file.aio"))
                    .unwrap_or("threads")
                    .to_string(),
            ));
            self.drive_knobs.push((id.to_string(), drive_knobs(o)));
        }
    }

    fn device(&mut self, o: &[(String, String)]) {
        let model = get(o, "").or_else(|| get(o, "driver")).unwrap_or("");
        let id = get(o, "id").map(str::to_string);
        if let (false, Some(drive)) = (model.is_empty(), get(o, "drive")) {
            if let Some(serial) = get(o, "serial") {
                self.serials.push((
                    id.clone().unwrap_or_else(|| drive.to_string()),
                    serial.to_string(),
                ));
            }
            self.devices.push(Device {
                model: model.to_string(),
                id: id.clone(),
                drive: drive.to_string(),
                ioeventfd: on(get(o, "ioeventfd")),
                iothread: get(o, "iothread").map(str::to_string),
                queues: queues_of(o),
                knobs: DiskKnobs {
                    queue_size: get(o, "queue-size").and_then(|v| v.parse().ok()),
                    ioeventfd: get(o, "ioeventfd").map(|v| on(Some(v))),
                    ..Default::default()
                },
            });
        }
        match (get(o, "chardev"), get(o, "wwpn")) {
            (Some(chardev), _) if model.starts_with("vhost-user-blk") => {
                self.vhost.push(VhostUser {
                    model: model.to_string(),
                    id,
                    chardev: chardev.to_string(),
                    queues: queues_of(o),
                });
            }
            (_, Some(wwpn)) if model.starts_with("vhost-scsi") => {
                self.vscsi.push(VhostScsi {
                    model: model.to_string(),
                    id,
                    wwpn: wwpn.to_string(),
                });
            }
            (chardev, _)
                if model == "virtserialport" && get(o, "name") == Some(crate::abi::PORT_NAME) =>
            {
                self.channel_dev = chardev.map(str::to_string);
            }
            _ => {}
        }
    }

    /// QEMU's monitors in QMP mode (the first usable one): a unix socket
    /// QEMU listens on; a client socket or TCP is not ours.
    fn qmp(&mut self, v: &str) {
        if let Some(rest) = v.strip_prefix("unix:") {
            let mut parts = rest.split(',');
            let path = parts.next().unwrap_or("");
            let server = parts
                .any(|p| p == "server" || p.strip_prefix("server=").is_some_and(|x| on(Some(x))));
            if server && !path.is_empty() && self.qmp.is_none() {
                self.qmp = Some(PathBuf::from(path));
            }
        }
    }

    /// A device's settings with its drive's (throttle, cache).
    fn knobs_of(&self, d: &Device) -> DiskKnobs {
        let mut k = d.knobs.clone();
        if let Some((_, dk)) = self.drive_knobs.iter().find(|(id, _)| *id == d.drive) {
            k.throttle = dk.throttle.clone();
            k.throttle_group = dk.throttle_group.clone();
            k.cache = dk.cache.clone();
        }
        for s in k.throttle_group.iter_mut().chain(k.cache.iter_mut()) {
            make_printable(s);
        }
        k
    }

    fn socket_of(&self, chardev: &str) -> Option<SocketSource> {
        self.chardevs
            .iter()
            .find(|(c, _)| c == chardev)
            .map(|(_, s)| s.clone())
    }

    /// Every virtual disk: devices with a drive, vhost-user and vhost-scsi
    /// devices, and drives that are their own disk; at most MAX_VDISKS,
    /// with how many more there were.
    fn disks(&self) -> (Vec<VDisk>, usize) {
        let aio_of = |id: &str| Some(node_aio(&self.files, &self.aio, id));
        let mut disks: Vec<VDisk> = self
            .devices
            .iter()
            .map(|d| VDisk {
                id: d.id.clone().unwrap_or_else(|| d.drive.clone()),
                model: Some(d.model.clone()),
                file: node_file(&self.files, &d.drive),
                aio: aio_of(&d.drive),
                ioeventfd: d.ioeventfd,
                iothread: d.iothread.clone(),
                queues: d.queues,
                knobs: self.knobs_of(d),
                ..Default::default()
            })
            .collect();
        for v in &self.vhost {
            disks.push(VDisk {
                id: v.id.clone().unwrap_or_else(|| v.chardev.clone()),
                model: Some(v.model.clone()),
                ioeventfd: true,
                queues: v.queues,
                socket: match self.socket_of(&v.chardev) {
                    Some(SocketSource::Path(p)) => Some(p),
                    _ => None,
                },
                ..Default::default()
            });
        }
        // Kernel vhost-scsi disks: their LUNs are LIO's (Vm::find_luns).
        for v in &self.vscsi {
            disks.push(VDisk {
                id: v.id.clone().unwrap_or_else(|| v.wwpn.clone()),
                model: Some(v.model.clone()),
                ioeventfd: true,
                target: Some(v.wwpn.clone()),
                ..Default::default()
            });
        }
        // -drive with if=virtio (or default) and no -device: the drive is the disk.
        for (id, file, _) in &self.files {
            let used = self.devices.iter().any(|d| d.drive == *id)
                || self.files.iter().any(|(_, _, c)| c.as_deref() == Some(id));
            if !used && file.is_some() {
                disks.push(VDisk {
                    id: id.clone(),
                    file: file.clone(),
                    aio: aio_of(id),
                    ..Default::default()
                });
            }
        }
        let over_cap = disks.len().saturating_sub(MAX_VDISKS);
        disks.truncate(MAX_VDISKS);
        for d in &mut disks {
            // QEMU's defaults: a virtio disk gets a queue per vCPU (-smp, 1
            // without it), an NVMe controller 64 I/O queue pairs.
            let nvme = d.model.as_deref().is_some_and(|m| m.starts_with("nvme"));
            d.queues = d
                .queues
                .or(Some(if nvme { 64 } else { self.cpus.unwrap_or(1) }));
            d.resolve_host();
            // A device naming an iothread no -object made is QEMU's error;
            // keep only what exists.
            d.iothread = d.iothread.take().filter(|t| self.iothreads.contains(t));
        }
        (disks, over_cap)
    }

    fn not_vm(&self, disks: &[VDisk]) -> Option<String> {
        if self.machine.as_deref() == Some("none") {
            Some("runs no machine (-machine none): a capability probe".to_string())
        } else if self.paused && disks.is_empty() && !self.kernel {
            Some("paused (-S) with no disk and no kernel to run".to_string())
        } else {
            None
        }
    }

    fn into_vm(self, pid: u32) -> Vm {
        let (mut disks, vdisks_over_cap) = self.disks();
        let not_vm = self.not_vm(&disks);
        // Whoever started the process chose these: kept printable only.
        let mut name = self.name.clone().unwrap_or_else(|| format!("qemu-{pid}"));
        make_printable(&mut name);
        let mut uuid = self.uuid.clone();
        if let Some(u) = uuid.as_mut() {
            make_printable(u);
        }
        for d in &mut disks {
            make_printable(&mut d.id);
            if let Some(t) = d.iothread.as_mut() {
                make_printable(t);
            }
        }
        let channel = self.channel_dev.as_deref().and_then(|c| self.socket_of(c));
        let monitor = match &self.qmp {
            Some(q) => Some(SocketSource::Path(q.clone())),
            None => self.mon_dev.as_deref().and_then(|c| self.socket_of(c)),
        };
        Vm {
            pid,
            name,
            uuid,
            disks,
            exe: None,
            kvm: false,
            kicks: KickSource::default(),
            named_threads: self.named_threads,
            channel,
            monitor,
            guest_channel: None,
            serials: self.serials,
            not_vm,
            libvirt: None,
            vdisks_over_cap,
            vcpus: self.cpus,
        }
    }
}

/// A `-device` with a drive.
struct Device {
    model: String,
    id: Option<String>,
    drive: String,
    ioeventfd: bool,
    iothread: Option<String>,
    queues: Option<u32>,
    knobs: DiskKnobs,
}

/// A `-drive`'s throttle limits (`throttling.iops-total=` …, by the names
/// QMP's `query-block` gives them), group and cache mode.
fn drive_knobs(o: &[(String, String)]) -> DiskKnobs {
    const LIMITS: [(&str, &str); 6] = [
        ("throttling.iops-total", "iops"),
        ("throttling.iops-read", "iops_rd"),
        ("throttling.iops-write", "iops_wr"),
        ("throttling.bps-total", "bps"),
        ("throttling.bps-read", "bps_rd"),
        ("throttling.bps-write", "bps_wr"),
    ];
    DiskKnobs {
        throttle: LIMITS
            .iter()
            .filter_map(|(opt, name)| Some((name.to_string(), get(o, opt)?.parse().ok()?)))
            .collect(),
        throttle_group: get(o, "throttling.group").map(str::to_string),
        cache: get(o, "cache").map(str::to_string),
        ..Default::default()
    }
}

/// The most queues QEMU gives one device (VIRTIO_QUEUE_MAX).
pub const MAX_QUEUES: u32 = 1024;

/// A device's queue count as its options set it.
fn queues_of(o: &[(String, String)]) -> Option<u32> {
    ["num-queues", "num_queues", "max_ioqpairs"]
        .iter()
        .find_map(|k| get(o, k)?.parse::<u32>().ok())
        .map(|n| n.max(1).min(MAX_QUEUES))
}

/// `-smp N` or `-smp cpus=N,…`: the vCPUs at start.
fn smp_cpus(v: &str) -> Option<u32> {
    let o = options(v);
    get(&o, "cpus")
        .or_else(|| get(&o, ""))
        .and_then(|n| n.parse::<u32>().ok())
        .map(|n| n.max(1).min(MAX_QUEUES))
}

/// A `-blockdev` (JSON or key=value): node name, file name, child node
/// and aio mode.
/// (node name, file name, child node, aio mode).
pub(super) type BlockNode = (String, Option<PathBuf>, Option<String>, Option<String>);

pub(super) fn blockdev(v: &str) -> Option<BlockNode> {
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

pub(super) type Nodes = [(String, Option<PathBuf>, Option<String>)];

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

pub(super) fn node_file(files: &Nodes, id: &str) -> Option<PathBuf> {
    node_chain(files, id).iter().find_map(|n| {
        files
            .iter()
            .find(|(m, f, _)| m == n && f.is_some())
            .and_then(|(_, f, _)| f.clone())
    })
}

/// The file driver's aio mode; threads, its default, when none is set.
pub(super) fn node_aio(files: &Nodes, aio: &[(String, String)], id: &str) -> String {
    node_chain(files, id)
        .iter()
        .find_map(|n| aio.iter().find(|(m, _)| m == n).map(|(_, a)| a.clone()))
        .unwrap_or_else(|| "threads".into())
}

/// Whether a program name (a comm) is a QEMU system emulator's, as
/// distributions install it: `qemu-system-*` (upstream, Debian, SUSE),
/// `qemu-kvm` (RHEL and Fedora's /usr/libexec/qemu-kvm), `kvm` (Proxmox's
/// /usr/bin/kvm). Mirrors vm_comm() in vms.bpf.c, which gives such a
/// process a VM slot at exec.
pub fn is_qemu_comm(comm: &str) -> bool {
    let comm = comm.trim_end_matches('\n');
    comm.starts_with(QEMU_PREFIX) || comm == "qemu-kvm" || comm == "kvm"
}

/// Whether arguments are QEMU's: a name other programs use too (`kvm`)
/// must come with a command line only QEMU takes.
pub(super) fn looks_like_qemu(comm: &str, vm: &Vm) -> bool {
    comm.starts_with(QEMU_PREFIX)
        || vm.not_vm.is_some()
        || !vm.disks.is_empty()
        || vm.uuid.is_some()
        || !vm.name.starts_with("qemu-")
}
