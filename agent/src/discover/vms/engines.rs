//! Storage engines outside QEMU: qemu-storage-daemon's vhost-user exports,
//! SPDK and other vhost-user targets found by the socket they listen on, and
//! the kernel's vhost-scsi LUNs (LIO configfs).

use std::{
    fs,
    path::{Path, PathBuf},
};

use super::{
    cmdline::{blockdev, get, node_aio, node_file, options, socket_chardev},
    *,
};

/// The program name (comm, 15 bytes) of qemu-storage-daemon.
pub const STORAGE_DAEMON_COMM: &str = "qemu-storage-da";

/// One vhost-user-blk export of an engine process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Export {
    pub id: String,
    /// Its block node (`node-name=`).
    pub node: String,
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
    for (opt, value) in long_options(args) {
        match opt {
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
    }
    exports
        .into_iter()
        .map(|(id, node, socket)| Export {
            id,
            socket,
            file: node_file(&files, &node),
            aio: node_aio(&files, &aio, &node),
            node,
        })
        .collect()
}

/// qemu-storage-daemon's QMP monitor (`--monitor [chardev=]ID` on a
/// `--chardev socket,…,server=on` it listens on), from its arguments.
/// Every monitor of the daemon speaks QMP; the first on a socket is taken.
pub fn monitor_from_args(args: &[String]) -> Option<SocketSource> {
    let mut chardevs: Vec<(String, SocketSource)> = Vec::new();
    let mut monitors: Vec<String> = Vec::new();
    for (opt, value) in long_options(args) {
        let o = options(&value);
        match opt {
            // Only one the daemon listens on.
            "chardev" if get(&o, "server").is_some_and(|v| matches!(v, "on" | "yes" | "true")) => {
                chardevs.extend(socket_chardev(&o));
            }
            "monitor" => monitors.extend(
                get(&o, "chardev")
                    .or_else(|| get(&o, ""))
                    .map(str::to_string),
            ),
            _ => {}
        }
    }
    monitors.iter().find_map(|m| {
        chardevs
            .iter()
            .find(|(id, _)| id == m)
            .map(|(_, s)| s.clone())
    })
}

/// qemu-storage-daemon's options as (name, value): `--opt VALUE` or
/// `--opt=VALUE`, the leading dashes taken off.
fn long_options(args: &[String]) -> Vec<(&str, String)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let (opt, value) = match args[i].split_once('=') {
            Some((o, v)) if o.starts_with("--") => (o, v.to_string()),
            _ => {
                i += 1;
                (
                    args[i - 1].as_str(),
                    args.get(i).cloned().unwrap_or_default(),
                )
            }
        };
        out.push((opt.trim_start_matches('-'), value));
        i += 1;
    }
    out
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
                    node: String::new(),
                    monitor: monitor_from_args(&args),
                },
                exports_from_args(&args, &cwd),
            ))
        })
        .collect();
    out.sort_by_key(|(e, _)| e.pid);
    out
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
///
/// `wwpn` comes from a command line anyone can write: it is a name, never a
/// path (`/`, `..` and `.` refused), and a backstore counts only inside
/// configfs's own `target/core`.
pub fn lio_luns(configfs: &Path, wwpn: &str) -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    if !is_plain_name(wwpn) {
        return out;
    }
    let Ok(core) = fs::canonicalize(configfs.join("target/core")) else {
        return out;
    };
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
                .find_map(|l| {
                    let dir = fs::canonicalize(l.path()).ok()?;
                    backstore_path(dir.strip_prefix(&core).ok().map(|_| dir.as_path())?)
                });
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

/// A single path component: not empty, no `/`, not `.` or `..`.
pub fn is_plain_name(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains('/') && !s.contains('\0')
}

/// A backstore's attributes are a few hundred bytes.
const ATTR_CAP: u64 = 64 << 10;

fn backstore_path(dir: &Path) -> Option<PathBuf> {
    let read = |name: &str| {
        crate::discover::procfs::read_regular(&dir.join(name), ATTR_CAP)
            .ok()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
    };
    let udev = read("udev_path").unwrap_or_default();
    if !udev.trim().is_empty() {
        return Some(PathBuf::from(udev.trim()));
    }
    let info = read("info")?;
    ["File: ", "UDEV PATH: "].iter().find_map(|key| {
        let rest = &info[info.find(key)? + key.len()..];
        let path = rest.split_whitespace().next()?;
        Some(PathBuf::from(path))
    })
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
        node: String::new(),
        monitor: None,
    })
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
                        node: x.node.clone(),
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
