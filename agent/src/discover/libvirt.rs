//! libvirt's own account of the VMs it runs (its live status XML), matched
//! to a QEMU process by the pid it records.
//!
//! The status XML is libvirtd's for each running domain
//! (`/run/libvirt/qemu/NAME.xml`), never matched by a name from a command
//! line. It gives the names libvirt's users know — the domain, its UUID,
//! each disk's target dev (`vda`) beside its alias (`virtio-disk0`) — and
//! the guest channel's socket. Read only; libvirt's monitor is never used.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Where libvirtd's QEMU driver keeps its status files, with the user a
/// file there must belong to (None: root): `IOSPAN_LIBVIRT_RUN` (a
/// colon-separated list, root's), else the system driver's place and each
/// user's session driver's (`/run/user/UID/libvirt/qemu/run`, that user's).
pub fn run_dirs() -> Vec<(PathBuf, Option<u32>)> {
    if let Some(v) = std::env::var_os("IOSPAN_LIBVIRT_RUN") {
        return std::env::split_paths(&v).map(|p| (p, None)).collect();
    }
    let mut v = vec![(PathBuf::from("/run/libvirt/qemu"), None)];
    if let Ok(rd) = std::fs::read_dir("/run/user") {
        for e in rd.flatten() {
            if let Some(uid) = e.file_name().to_str().and_then(|n| n.parse().ok()) {
                v.push((e.path().join("libvirt/qemu/run"), Some(uid)));
            }
        }
    }
    v
}

/// A status file larger than this is not libvirt's (a domain of hundreds
/// of disks writes a few hundred KiB).
const STATUS_CAP: u64 = 4 << 20;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Domain {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    #[serde(default)]
    pub disks: Vec<DomainDisk>,
    #[serde(default)]
    pub channels: Vec<DomainChannel>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainDisk {
    /// The device's alias: QEMU's device id (`virtio-disk0`).
    pub alias: String,
    /// The target dev (`vda`).
    pub target_dev: String,
    /// `file`, `block`, `network`, `volume`.
    pub kind: String,
    /// The source file or device, when local.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Its `<driver>`'s attributes a diagnosis names (`io`, `iothread`,
    /// `queues`, `queue_size`, `ioeventfd`, `cache`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub driver: Vec<(String, String)>,
    /// Its `<iotune>` limits, by QMP's names (`iops`, `iops_rd`, …).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub iotune: Vec<(String, u64)>,
}

/// libvirt's `<iotune>` elements by the names QEMU's QMP gives the same
/// limits.
const IOTUNE: [(&str, &str); 6] = [
    ("total_iops_sec", "iops"),
    ("read_iops_sec", "iops_rd"),
    ("write_iops_sec", "iops_wr"),
    ("total_bytes_sec", "bps"),
    ("read_bytes_sec", "bps_rd"),
    ("write_bytes_sec", "bps_wr"),
];

/// A disk's `<driver>` attributes the diagnosis reads, made printable.
fn driver_attrs(disk: roxmltree::Node<'_, '_>) -> Vec<(String, String)> {
    let Some(d) = disk.children().find(|c| c.has_tag_name("driver")) else {
        return Vec::new();
    };
    [
        "io",
        "iothread",
        "queues",
        "queue_size",
        "ioeventfd",
        "cache",
    ]
    .iter()
    .filter_map(|k| {
        let v = d.attribute(*k)?;
        Some((k.to_string(), crate::model::text::printable(v).into_owned()))
    })
    .collect()
}

/// A disk's `<iotune>` limits set above 0, by QMP's names.
fn iotune(disk: roxmltree::Node<'_, '_>) -> Vec<(String, u64)> {
    let Some(t) = disk.children().find(|c| c.has_tag_name("iotune")) else {
        return Vec::new();
    };
    IOTUNE
        .iter()
        .filter_map(|(tag, name)| {
            let v: u64 = t
                .children()
                .find(|c| c.has_tag_name(*tag))?
                .text()?
                .trim()
                .parse()
                .ok()?;
            (v > 0).then(|| (name.to_string(), v))
        })
        .collect()
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainChannel {
    /// The virtio-serial port's name (`org.iospan.0`).
    pub name: String,
    /// The host socket libvirt bound for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

fn shown(s: &str) -> String {
    crate::model::text::printable(s).into_owned()
}

/// Reads one status file's text: the pid it records and the domain.
pub fn parse_status(xml: &str) -> Option<(u32, Domain)> {
    let doc = roxmltree::Document::parse(xml).ok()?;
    let root = doc.root_element();
    // A status file wraps the domain in <domstatus pid=…>; a bare <domain>
    // (an inactive definition) runs nothing.
    if root.tag_name().name() != "domstatus" {
        return None;
    }
    let pid = root.attribute("pid")?.parse().ok()?;
    let dom = root.children().find(|n| n.has_tag_name("domain"))?;
    fn child<'a, 'i>(n: roxmltree::Node<'a, 'i>, tag: &str) -> Option<roxmltree::Node<'a, 'i>> {
        n.children().find(|c| c.has_tag_name(tag))
    }
    // A session domain's file is its user's to write: every name in it
    // kept printable only.
    let text =
        |n: Option<roxmltree::Node<'_, '_>>| n.and_then(|n| n.text()).map(|t| shown(t.trim()));
    let name = text(child(dom, "name"))?;
    let uuid = text(child(dom, "uuid"));
    let mut d = Domain {
        name,
        uuid,
        ..Default::default()
    };
    if let Some(devices) = child(dom, "devices") {
        for n in devices.children().filter(|n| n.is_element()) {
            match n.tag_name().name() {
                "disk" => {
                    let (Some(target), Some(alias)) = (
                        child(n, "target").and_then(|t| t.attribute("dev")),
                        child(n, "alias").and_then(|a| a.attribute("name")),
                    ) else {
                        continue;
                    };
                    let source = child(n, "source").and_then(|s| {
                        s.attribute("file")
                            .or_else(|| s.attribute("dev"))
                            .map(str::to_string)
                    });
                    d.disks.push(DomainDisk {
                        alias: shown(alias),
                        target_dev: shown(target),
                        kind: n.attribute("type").unwrap_or("file").to_string(),
                        source,
                        driver: driver_attrs(n),
                        iotune: iotune(n),
                    });
                }
                "channel" => {
                    let Some(name) = child(n, "target").and_then(|t| t.attribute("name")) else {
                        continue;
                    };
                    d.channels.push(DomainChannel {
                        name: shown(name),
                        path: child(n, "source")
                            .and_then(|s| s.attribute("path"))
                            .map(str::to_string),
                    });
                }
                _ => {}
            }
        }
    }
    Some((pid, d))
}

/// Status files looked at in one directory, at most: a host runs
/// hundreds of domains, a user's session directory holds that user's.
const MAX_STATUS_FILES: usize = 1024;
/// Of a status file, the head read for its pid before it is parsed.
const STATUS_HEAD: u64 = 4096;

/// The status files of `dir` that belong to `owner`, at most
/// `MAX_STATUS_FILES` of them, owner checked before anything is read.
fn status_files(dir: &Path, owner: u32) -> Vec<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.flatten()
        .take(MAX_STATUS_FILES)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "xml"))
        .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.uid() == owner))
        .collect()
}

/// The pid a status file's head records (`<domstatus … pid='N'>`).
fn pid_in_head(head: &[u8]) -> Option<u32> {
    let text = String::from_utf8_lossy(head);
    let tag = text.split("<domstatus").nth(1)?.split('>').next()?;
    let at = tag.find("pid=")?;
    let rest = tag.get(at + 4..)?;
    let quote = rest.chars().next().filter(|c| *c == '\'' || *c == '"')?;
    rest.get(1..)?.split_once(quote)?.0.parse().ok()
}

/// Every domain with a status file in `dir`: its pid, the domain, and the
/// user the file belongs to.
pub fn domains_in(dir: &Path) -> Vec<(u32, Domain, u32)> {
    use std::os::unix::fs::MetadataExt;
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.flatten()
        .take(MAX_STATUS_FILES)
        .filter(|e| e.path().extension().is_some_and(|x| x == "xml"))
        .filter_map(|e| {
            let owner = std::fs::symlink_metadata(e.path()).ok()?.uid();
            let bytes = crate::discover::procfs::read_regular(&e.path(), STATUS_CAP).ok()?;
            let (pid, d) = parse_status(std::str::from_utf8(&bytes).ok()?)?;
            Some((pid, d, owner))
        })
        .collect()
}

/// The domain running as process `pid`, if libvirt runs it: told by a
/// status file root wrote, or, for a session domain, the user the process
/// runs as (a user's file speaks only for that user's processes). Only
/// the files that may speak for it are opened, and of those only the one
/// whose head names its pid is parsed: another user's hundred files cost
/// nothing, a hundred of its own user's a head each.
pub fn domain_of(pid: u32) -> Option<Domain> {
    use std::os::unix::fs::MetadataExt;
    let proc_uid = std::fs::metadata(format!("/proc/{pid}")).ok()?.uid();
    run_dirs()
        .into_iter()
        .filter(|(_, user)| user.is_none_or(|u| u == proc_uid))
        .flat_map(|(dir, user)| status_files(&dir, user.unwrap_or(0)))
        .find_map(|path| {
            let head = crate::discover::procfs::read_head(&path, STATUS_CAP, STATUS_HEAD).ok()?;
            if pid_in_head(&head)? != pid {
                return None;
            }
            let bytes = crate::discover::procfs::read_regular(&path, STATUS_CAP).ok()?;
            let (p, d) = parse_status(std::str::from_utf8(&bytes).ok()?)?;
            (p == pid).then_some(d)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A status file as libvirtd 9.0 writes it (trimmed).
    const STATUS: &str = r#"<!--
WARNING: THIS IS AN AUTO-GENERATED FILE. CHANGES TO IT ARE LIKELY TO BE
OVERWRITTEN AND LOST.
-->
<domstatus state='running' reason='booted' pid='12215'>
  <monitor path='/var/lib/libvirt/qemu/domain-2-db01/monitor.sock' type='unix'/>
  <domain type='qemu' id='2'>
    <name>db01</name>
    <uuid>b40a0dcb-ecba-4afd-97ea-fcc0c6900c2a</uuid>
    <devices>
      <emulator>/usr/bin/qemu-system-x86_64</emulator>
      <disk type='file' device='disk'>
        <driver name='qemu' type='raw' cache='none' io='io_uring' iothread='1'/>
        <source file='/var/lib/libvirt/images/db01.img' index='2'/>
        <target dev='vda' bus='virtio'/>
        <alias name='virtio-disk0'/>
      </disk>
      <disk type='block' device='disk'>
        <driver name='qemu' type='raw' cache='none' io='native'/>
        <source dev='/dev/vg0/db01-data' index='1'/>
        <target dev='vdb' bus='virtio'/>
        <alias name='virtio-disk1'/>
      </disk>
      <disk type='file' device='cdrom'>
        <target dev='sda' bus='sata'/>
        <readonly/>
        <alias name='sata0-0-0'/>
      </disk>
      <channel type='unix'>
        <source mode='bind' path='/var/lib/libvirt/qemu/channel/target/domain-2-db01/org.iospan.0'/>
        <target type='virtio' name='org.iospan.0' state='connected'/>
        <alias name='channel0'/>
      </channel>
    </devices>
  </domain>
</domstatus>
"#;

    #[test]
    fn a_status_file_gives_the_pid_names_uuid_disks_and_channel() {
        let (pid, d) = parse_status(STATUS).unwrap();
        assert_eq!(pid, 12215);
        assert_eq!(d.name, "db01");
        assert_eq!(
            d.uuid.as_deref(),
            Some("b40a0dcb-ecba-4afd-97ea-fcc0c6900c2a")
        );
        let disks: Vec<_> = d
            .disks
            .iter()
            .map(|x| {
                (
                    x.alias.as_str(),
                    x.target_dev.as_str(),
                    x.kind.as_str(),
                    x.source.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            disks,
            [
                (
                    "virtio-disk0",
                    "vda",
                    "file",
                    Some("/var/lib/libvirt/images/db01.img")
                ),
                ("virtio-disk1", "vdb", "block", Some("/dev/vg0/db01-data")),
                ("sata0-0-0", "sda", "file", None),
            ]
        );
        assert_eq!(d.channels.len(), 1);
        assert_eq!(d.channels[0].name, "org.iospan.0");
    }

    #[test]
    fn definitions_and_garbage_are_not_running_domains() {
        assert!(parse_status("<domain><name>x</name></domain>").is_none());
        assert!(parse_status("<domstatus><domain><name>x</name></domain></domstatus>").is_none());
        assert!(parse_status("<domstatus pid='7'></domstatus>").is_none());
        assert!(parse_status("not xml <<<").is_none());
        assert!(parse_status("").is_none());
    }

    #[test]
    fn names_in_a_status_file_are_kept_printable() {
        let xml = STATUS
            .replace("<name>db01</name>", "<name>db&#10;01\u{202e}; id #</name>")
            .replace("dev='vda'", "dev='vd\u{2066}a'");
        let (_, d) = parse_status(&xml).unwrap();
        assert_eq!(d.name, "db\\u{a}01\\u{202e}; id #");
        assert!(
            d.disks.iter().any(|k| k.target_dev == "vd\\u{2066}a"),
            "{d:?}"
        );
    }

    #[test]
    fn a_status_files_pid_is_read_from_its_head() {
        assert_eq!(pid_in_head(STATUS.as_bytes()), Some(12215));
        assert_eq!(
            pid_in_head(b"<domstatus state=\"running\" pid=\"7\">"),
            Some(7)
        );
        assert_eq!(pid_in_head(b"<domain><name>x</name>"), None);
        assert_eq!(pid_in_head(b"<domstatus pid='12"), None);
    }

    /// Another user's hundreds of big files beside root's one: only root's
    /// is opened (the owner is checked first), and in a blink.
    #[test]
    fn another_users_status_files_are_never_read() {
        let dir = tempfile::tempdir().unwrap();
        let big = format!("<domstatus pid='1'>{}", "x".repeat(3 << 20));
        for i in 0..100 {
            let p = dir.path().join(format!("u{i}.xml"));
            std::fs::write(&p, &big).unwrap();
            rustix::fs::chown(&p, Some(rustix::fs::Uid::from_raw(65534)), None).unwrap();
        }
        std::fs::write(dir.path().join("db01.xml"), STATUS).unwrap();
        let t = std::time::Instant::now();
        let mine = status_files(dir.path(), rustix::process::geteuid().as_raw());
        assert_eq!(mine, vec![dir.path().join("db01.xml")]);
        assert!(
            t.elapsed() < std::time::Duration::from_millis(200),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn a_run_dir_is_scanned_for_status_files_only() {
        let dir_held = tempfile::Builder::new()
            .prefix("iospan-libvirt-")
            .tempdir()
            .unwrap();
        let dir = dir_held.path().to_path_buf();
        std::fs::write(dir.join("db01.xml"), STATUS).unwrap();
        std::fs::write(dir.join("db01.pid"), "12215").unwrap();
        std::fs::write(dir.join("broken.xml"), "<domstatus").unwrap();
        let v = domains_in(&dir);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].0, 12215);
        // Whoever runs the test wrote it.
        // SAFETY: geteuid has no preconditions.
        assert_eq!(v[0].2, rustix::process::geteuid().as_raw());
    }
}
