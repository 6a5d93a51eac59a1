//! Block device identity: the kernel's internal dev_t (major << 20 | minor)
//! as the eBPF programs report it, and the names users type.

use std::{fs, path::Path};

use thiserror::Error;

pub use crate::model::dev::Dev;

#[derive(Debug, Error)]
pub enum DiskError {
    #[error("unknown disk `{name}`: no /sys/class/block/{name} (block devices here: {known})")]
    Unknown { name: String, known: String },
    #[error("`{name}` is a partition of `{disk}`: requests are attributed to whole disks; use `--disk {disk}`")]
    Partition { name: String, disk: String },
    #[error("reading {path}")]
    Sysfs {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

fn parse_dev(s: &str) -> Option<Dev> {
    let (maj, min) = s.trim().split_once(':')?;
    Some(Dev::new(maj.parse().ok()?, min.parse().ok()?))
}

/// The whole-disk device a user-given name (`loop0`, `/dev/loop0`) stands for.
pub fn resolve(name: &str) -> Result<Dev, DiskError> {
    let short = name.strip_prefix("/dev/").unwrap_or(name);
    let base = Path::new("/sys/class/block").join(short);
    if !base.exists() {
        return Err(DiskError::Unknown {
            name: name.to_string(),
            known: whole_disks().join(", "),
        });
    }
    if base.join("partition").exists() {
        let disk = fs::canonicalize(&base)
            .ok()
            .and_then(|p| {
                p.parent()
                    .and_then(|d| d.file_name())
                    .map(|d| d.to_string_lossy().into_owned())
            })
            .unwrap_or_else(|| "its disk".into());
        return Err(DiskError::Partition {
            name: name.to_string(),
            disk,
        });
    }
    let path = base.join("dev");
    let text = fs::read_to_string(&path).map_err(|source| DiskError::Sysfs {
        path: path.display().to_string(),
        source,
    })?;
    parse_dev(&text).ok_or_else(|| DiskError::Sysfs {
        path: path.display().to_string(),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not MAJ:MIN: {text:?}"),
        ),
    })
}

/// The name of a device, or its MAJ:MIN when it has gone away.
pub fn name_of(dev: Dev) -> String {
    let uevent = format!("/sys/dev/block/{}:{}/uevent", dev.major(), dev.minor());
    fs::read_to_string(uevent)
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("DEVNAME=").map(str::to_string))
        })
        .unwrap_or_else(|| dev.to_string())
}

/// Names of disks as they are asked for, read once each: for per-I/O
/// output, where a sysfs read per record would cost more than the record.
#[derive(Default)]
pub struct Names(std::collections::HashMap<Dev, String>);

impl Names {
    pub fn of(&mut self, dev: Dev) -> &str {
        self.0.entry(dev).or_insert_with(|| name_of(dev))
    }
}

/// A host disk's queue as sysfs shows it: its I/O scheduler, its
/// `nr_requests`, the device's own queue depth where it has one (SCSI),
/// whether it is rotational, and what it is stacked on (its slaves, down
/// to the devices).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueSettings {
    pub scheduler: Option<String>,
    pub nr_requests: Option<u32>,
    pub device_depth: Option<u32>,
    pub rotational: Option<bool>,
    pub stack: Vec<String>,
}

/// `name`'s queue settings (a whole disk's name, as /sys/block has it).
pub fn queue_settings(name: &str) -> QueueSettings {
    queue_settings_in(Path::new("/sys/block"), name)
}

pub fn queue_settings_in(sys_block: &Path, name: &str) -> QueueSettings {
    let base = sys_block.join(name);
    let read = |p: &str| {
        fs::read_to_string(base.join(p))
            .ok()
            .map(|s| s.trim().to_string())
    };
    let num = |p: &str| read(p).and_then(|s| s.parse().ok());
    // "none [mq-deadline] kyber": the bracketed one is in use.
    let scheduler = read("queue/scheduler").map(|s| {
        s.split_whitespace()
            .find_map(|w| w.strip_prefix('[')?.strip_suffix(']'))
            .unwrap_or(s.as_str())
            .to_string()
    });
    let mut stack = Vec::new();
    let mut under = name.to_string();
    // Down the slaves (device mapper, md): the first of each level.
    for _ in 0..8 {
        let Some(next) = fs::read_dir(sys_block.join(&under).join("slaves"))
            .ok()
            .and_then(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .min()
            })
        else {
            break;
        };
        stack.push(next.clone());
        under = next;
    }
    // A loop device's backing file.
    if let Some(f) = read("loop/backing_file") {
        stack.push(crate::model::text::printable(&f).into_owned());
    }
    QueueSettings {
        scheduler,
        nr_requests: num("queue/nr_requests"),
        device_depth: num("device/queue_depth"),
        rotational: read("queue/rotational").map(|r| r == "1"),
        stack,
    }
}

pub fn whole_disks() -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir("/sys/block")
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_packs_like_the_kernel() {
        let d = Dev::new(259, 3);
        assert_eq!(d.0, (259 << 20) | 3);
        assert_eq!((d.major(), d.minor()), (259, 3));
        assert_eq!(d.to_string(), "259:3");
        assert_eq!(parse_dev("7:0\n"), Some(Dev::new(7, 0)));
        assert_eq!(parse_dev("garbage"), None);
    }

    #[test]
    fn unknown_disk_names_the_input_and_the_choices() {
        let e = resolve("no-such-disk-xyz").unwrap_err().to_string();
        assert!(
            e.contains("no-such-disk-xyz") && e.contains("block devices here"),
            "{e}"
        );
    }
}
