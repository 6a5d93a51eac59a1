//! `cargo xtask dist`: the .deb for hypervisor hosts (cargo-deb): the
//! binary, the systemd unit, the default configuration (a conffile) and the
//! dashboards. cargo-deb is installed into cargo's bin directory when
//! missing (once; outside the checkout).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use crate::sh;

/// The cargo-deb release the packaging is made with.
const CARGO_DEB: &str = "3.8.0";

/// cargo-deb, installed if absent.
pub fn ensure_cargo_deb() -> Result<()> {
    let have = sh::cargo_command()
        .args(["deb", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if have {
        return Ok(());
    }
    eprintln!("xtask: installing cargo-deb {CARGO_DEB} (once, a few minutes)");
    sh::cargo(&["install", "--locked", "cargo-deb", "--version", CARGO_DEB])
}

/// Builds the release binary and the .deb; its path.
pub fn build() -> Result<PathBuf> {
    ensure_cargo_deb()?;
    sh::cargo(&["build", "--release", "-p", "iospan"])?;
    let out = sh::target_dir().join("debian");
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let deb = out.join(format!(
        "iospan_{}-1_{}.deb",
        env!("CARGO_PKG_VERSION"),
        deb_arch()?
    ));
    sh::run(
        sh::cargo_command()
            .args(["deb", "-p", "iospan", "--no-build", "--output"])
            .arg(&deb),
    )?;
    if !deb.exists() {
        bail!("cargo deb did not write {}", deb.display());
    }
    eprintln!("xtask: dist: {}", deb.display());
    Ok(deb)
}

/// Debian's name for this machine's architecture.
fn deb_arch() -> Result<&'static str> {
    Ok(match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => bail!("no Debian architecture name known for {other}"),
    })
}
