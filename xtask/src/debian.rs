//! Debian packages the suite runs iospan against (kernels, QEMU releases):
//! fetched from Debian's archive with a sources list of our own per suite,
//! checked against the machine's archive keyring as apt checks any, and
//! unpacked with `dpkg-deb -x` into the cache — never installed.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

use crate::{backends::cache_dir, sh};

const MIRROR: &str = "http://deb.debian.org/debian";

/// One Debian suite's package lists, kept under the cache.
pub struct Suite {
    pub name: &'static str,
    dir: PathBuf,
}

impl Suite {
    /// The suite's lists, fetched once (and again when a package they name
    /// has left the mirror).
    pub fn open(name: &'static str) -> Result<Suite> {
        let dir = cache_dir().join("debian").join(name);
        for d in ["lists/partial", "cache/archives/partial", "debs"] {
            std::fs::create_dir_all(dir.join(d))?;
        }
        std::fs::write(
            dir.join("sources.list"),
            format!("deb {MIRROR} {name} main\n"),
        )?;
        let s = Suite { name, dir };
        if !s.has_lists() {
            s.update()?;
        }
        Ok(s)
    }

    fn has_lists(&self) -> bool {
        std::fs::read_dir(self.dir.join("lists"))
            .map(|d| {
                d.flatten().any(|e| {
                    e.file_name().to_string_lossy().ends_with("_Packages.lz4")
                        || e.file_name().to_string_lossy().ends_with("_Packages")
                })
            })
            .unwrap_or(false)
    }

    fn apt(&self, tool: &str) -> Command {
        let mut c = Command::new(tool);
        let opt = |k: &str, v: &Path| format!("{k}={}", v.display());
        c.arg("-o")
            .arg(opt("Dir::Etc::sourcelist", &self.dir.join("sources.list")))
            .args(["-o", "Dir::Etc::sourceparts=-"])
            .arg("-o")
            .arg(opt("Dir::State::Lists", &self.dir.join("lists")))
            .arg("-o")
            .arg(opt("Dir::Cache", &self.dir.join("cache")))
            .args(["-o", "APT::Get::List-Cleanup=0"]);
        c
    }

    fn update(&self) -> Result<()> {
        eprintln!("xtask: fetching Debian {}'s package lists", self.name);
        let out = sh::output(self.apt("apt-get").args(["update", "-qq"]))?;
        if !out.status.success() {
            bail!(
                "apt-get update for Debian {} failed (is {MIRROR} reachable?): {}",
                self.name,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// The package a metapackage depends on first whose name starts with
    /// `prefix` (linux-image-cloud-amd64 → linux-image-VERSION-cloud-amd64).
    pub fn dependency(&self, meta: &str, prefix: &str) -> Result<String> {
        let out = sh::output(self.apt("apt-cache").args(["depends", meta]))?;
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| {
                l.trim()
                    .strip_prefix("Depends: ")
                    .filter(|p| p.starts_with(prefix))
                    .map(str::to_string)
            })
            .with_context(|| format!("Debian {}'s {meta} depends on no {prefix}*", self.name))
    }

    /// Version of `pkg` in this suite.
    pub fn version(&self, pkg: &str) -> Result<String> {
        let out = sh::output(
            self.apt("apt-cache")
                .args(["show", "--no-all-versions", pkg]),
        )?;
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("Version: ").map(str::to_string))
            .with_context(|| format!("{pkg} is not in Debian {}", self.name))
    }

    /// `pkg` unpacked into the cache: its root directory.
    pub fn unpacked(&self, pkg: &str) -> Result<PathBuf> {
        let root = self.dir.join("pkgs").join(pkg);
        if root.join(".unpacked").exists() {
            return Ok(root);
        }
        let deb = self.download(pkg)?;
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root)?;
        sh::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
        std::fs::write(root.join(".unpacked"), b"")?;
        Ok(root)
    }

    fn download(&self, pkg: &str) -> Result<PathBuf> {
        let debs = self.dir.join("debs");
        let find = || {
            std::fs::read_dir(&debs).ok().and_then(|d| {
                d.flatten().map(|e| e.path()).find(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with(&format!("{pkg}_")))
                })
            })
        };
        if let Some(p) = find() {
            return Ok(p);
        }
        eprintln!("xtask: downloading {pkg} from Debian {}", self.name);
        let fetch = || {
            sh::output(
                self.apt("apt-get")
                    .args(["download", "-qq", pkg])
                    .current_dir(&debs),
            )
        };
        let mut out = fetch()?;
        if !out.status.success() {
            // Lists older than the mirror name a version it no longer has.
            self.update()?;
            out = fetch()?;
        }
        if !out.status.success() {
            bail!(
                "apt-get download {pkg} from Debian {}: {}",
                self.name,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        find().with_context(|| format!("{pkg}'s package not found after download"))
    }
}
