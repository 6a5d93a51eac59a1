//! A scratch loop device over a fully written file in /dev/shm: the fastest
//! block device any Linux host has, for the demo, the tests and the bench.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
};

use anyhow::{bail, Context, Result};

pub struct ScratchLoop {
    pub file: PathBuf,
    /// `loopN`
    pub name: String,
}

impl ScratchLoop {
    /// Creates `size_mib` MiB in `dir` (written, not sparse, so every read
    /// reaches the backing store) and attaches it with direct I/O.
    pub fn create(dir: &Path, size_mib: u64) -> Result<Self> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let file = dir.join(format!(
            "iospan-scratch-{}-{}.img",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let chunk = vec![0x5au8; 1 << 20];
        {
            use std::{io::Write, os::unix::fs::OpenOptionsExt};
            // A name anyone could guess, in a directory anyone may write
            // (/dev/shm): made new, never followed through a planted link
            // or an existing file, readable by root only.
            let mut f = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&file)
                .with_context(|| {
                    format!(
                        "creating {} (it must not exist yet: a file or link of that name is \
                         someone else's)",
                        file.display()
                    )
                })?;
            for _ in 0..size_mib {
                f.write_all(&chunk)
                    .with_context(|| format!("writing {}", file.display()))?;
            }
        }
        let out = Command::new("losetup")
            .args(["--find", "--show", "--direct-io=on"])
            .arg(&file)
            .output()
            .context("running losetup (util-linux)")?;
        if !out.status.success() {
            let _ = fs::remove_file(&file);
            bail!(
                "losetup failed to attach {}: {}\nhint: needs root and the loop driver (`modprobe loop`)",
                file.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let name = dev.trim_start_matches("/dev/").to_string();
        Ok(Self { file, name })
    }

    pub fn dev_path(&self) -> String {
        format!("/dev/{}", self.name)
    }
}

impl Drop for ScratchLoop {
    fn drop(&mut self) {
        let _ = Command::new("losetup")
            .arg("-d")
            .arg(self.dev_path())
            .status();
        let _ = fs::remove_file(&self.file);
    }
}
