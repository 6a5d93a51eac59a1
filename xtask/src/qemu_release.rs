//! QEMU releases other than the installed one: Debian's packages of them
//! fetched and unpacked into the cache beside it, never installed. The
//! rig boots with one through `RunArgs::qemu`.

use std::{path::PathBuf, process::Command};

use anyhow::{bail, Context, Result};

use crate::debian::Suite;

/// A QEMU release and the Debian suite that serves it.
pub struct QemuRelease {
    /// Major.minor, as `--version` starts.
    pub series: &'static str,
    pub suite: &'static str,
}

/// The releases the suite boots beside the installed one (Debian 12's 7.2).
pub const QEMU_RELEASES: &[QemuRelease] = &[QemuRelease {
    series: "10.0",
    suite: "bookworm-backports",
}];

/// An unpacked release: its emulator and firmware directory.
pub struct Unpacked {
    pub binary: PathBuf,
    pub data: PathBuf,
    /// Its `--version` line.
    pub version: String,
}

/// `series` unpacked in the cache (fetched the first time).
pub fn unpacked(series: &str) -> Result<Unpacked> {
    let r = QEMU_RELEASES
        .iter()
        .find(|r| r.series == series)
        .with_context(|| {
            let known: Vec<&str> = QEMU_RELEASES.iter().map(|r| r.series).collect();
            format!("no QEMU {series} in the suite: {}", known.join(", "))
        })?;
    let suite = Suite::open(r.suite)?;
    let binary = suite
        .unpacked("qemu-system-x86")?
        .join("usr/bin/qemu-system-x86_64");
    let data = suite.unpacked("qemu-system-data")?.join("usr/share/qemu");
    let out = Command::new(&binary)
        .arg("--version")
        .output()
        .with_context(|| format!("running {}", binary.display()))?;
    let version = String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or("")
        .to_string();
    if !out.status.success() || !version.contains(&format!("version {series}.")) {
        bail!(
            "{} is not QEMU {series}: {version} {}",
            binary.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(Unpacked {
        binary,
        data,
        version,
    })
}
