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
    let mut cpus: Option<u32> = None;
    let mut vhost: Vec<(String, Option<String>, String, Option<u32>)> = Vec::new(); // (model, id, chardev, queues)
    let mut vscsi: Vec<(String, Option<String>, String)> = Vec::new(); // (model, id, wwpn)
    let mut qmp: Option<PathBuf> = None; // -qmp unix:PATH,server
    let mut mon_dev: Option<String> = None; // chardev of a -mon in control mode
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
            "smp" => cpus = smp_cpus(v),
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
                        queues: queues_of(&o),
                    });
                }
                match (get(&o, "chardev"), get(&o, "wwpn")) {
                    (Some(chardev), _) if model.starts_with("vhost-user-blk") => {
                        vhost.push((model.to_string(), id, chardev.to_string(), queues_of(&o)));
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
            // QEMU's monitors in QMP mode (the first usable one): a unix
            // socket QEMU listens on; a client socket or TCP is not ours.
            "qmp" | "qmp-pretty" => {
                if let Some(rest) = v.strip_prefix("unix:") {
                    let mut parts = rest.split(',');
                    let path = parts.next().unwrap_or("");
                    let server = parts.any(|p| {
                        p == "server" || p.strip_prefix("server=").is_some_and(|x| on(Some(x)))
                    });
                    if server && !path.is_empty() && qmp.is_none() {
                        qmp = Some(PathBuf::from(path));
                    }
                }
            }
            "mon" => {
                let o = options(v);
                if get(&o, "mode") == Some("control") && mon_dev.is_none() {
                    mon_dev = get(&o, "chardev").map(str::to_string);
                }
            }
            "chardev" => {
                if let Some(c) = socket_chardev(&options(v)) {
                    chardevs.push(c);
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
            queues: d.queues,
            ..Default::default()
        })
        .collect();
    // vhost-user disks: served by whoever exports on the chardev's socket.
    for (model, id, chardev, queues) in &vhost {
        disks.push(VDisk {
            id: id.clone().unwrap_or_else(|| chardev.clone()),
            model: Some(model.clone()),
            ioeventfd: true,
            queues: *queues,
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
    let vdisks_over_cap = disks.len().saturating_sub(MAX_VDISKS);
    disks.truncate(MAX_VDISKS);
    for d in &mut disks {
        // QEMU's defaults: a virtio disk gets a queue per vCPU (-smp, 1
        // without it), an NVMe controller 64 I/O queue pairs.
        let nvme = d.model.as_deref().is_some_and(|m| m.starts_with("nvme"));
        d.queues = d.queues.or(Some(if nvme { 64 } else { cpus.unwrap_or(1) }));
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
    // Whoever started the process chose these: kept printable only.
    let mut name = name.unwrap_or_else(|| format!("qemu-{pid}"));
    make_printable(&mut name);
    if let Some(u) = uuid.as_mut() {
        make_printable(u);
    }
    for d in &mut disks {
        make_printable(&mut d.id);
    }
    Vm {
        pid,
        name,
        uuid,
        disks,
        exe: None,
        kvm: false,
        kicks: KickSource::default(),
        named_threads,
        channel: channel_dev.and_then(|c| socket_of(&c)),
        monitor: qmp
            .map(SocketSource::Path)
            .or_else(|| mon_dev.and_then(|c| socket_of(&c))),
        guest_channel: None,
        serials,
        not_vm,
        libvirt: None,
        vdisks_over_cap,
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
}

/// The most queues QEMU gives one device (VIRTIO_QUEUE_MAX).
pub const MAX_QUEUES: u32 = 1024;

/// A device's queue count as its options set it.
fn queues_of(o: &[(String, String)]) -> Option<u32> {
    ["num-queues", "num_queues", "max_ioqpairs"]
        .iter()
        .find_map(|k| get(o, k)?.parse::<u32>().ok())
        .map(|n| n.clamp(1, MAX_QUEUES))
}

/// `-smp N` or `-smp cpus=N,…`: the vCPUs at start.
fn smp_cpus(v: &str) -> Option<u32> {
    let o = options(v);
    get(&o, "cpus")
        .or_else(|| get(&o, ""))
        .and_then(|n| n.parse::<u32>().ok())
        .map(|n| n.clamp(1, MAX_QUEUES))
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
