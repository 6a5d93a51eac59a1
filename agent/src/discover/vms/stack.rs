//! From a virtual disk's backing file or device to the host disks under
//! it: the filesystem's device, or the block device itself, and its
//! device-mapper stack down to the physical disks.

use std::{
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use super::*;
use crate::discover::disks::Dev;

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
    host_stack_of_dev(sys, rustix::fs::major(dev), rustix::fs::minor(dev))
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
            ino: u64::from((rustix::fs::major(rdev) << 20) | rustix::fs::minor(rdev)),
        });
    }
    let dev = m.dev();
    Some(crate::abi::FileKey {
        dev: (rustix::fs::major(dev) << 20) | rustix::fs::minor(dev),
        _pad: 0,
        ino: m.ino(),
    })
}

impl VDisk {
    /// Finds the host disks under its backing file or device.
    pub(super) fn resolve_host(&mut self) {
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
