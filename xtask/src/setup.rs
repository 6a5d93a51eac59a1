//! What a fresh Debian-like machine needs, installed only when missing.

use std::{path::Path, process::Command};

use anyhow::{bail, Result};

use crate::sh;

/// (what to look for, the package that brings it)
const BUILD: &[(Need, &str)] = &[
    (Need::Tool("clang"), "clang"),
    (Need::Tool("llvm-strip"), "llvm"),
    // The host object is linked from one file per concern, optimized once,
    // then made BPF (agent/build.rs); `cargo xtask layers` reads each
    // file's symbols.
    (Need::Tool("llvm-link"), "llvm"),
    (Need::Tool("llvm-dis"), "llvm"),
    (Need::Tool("opt"), "llvm"),
    (Need::Tool("llc"), "llvm"),
    (Need::Tool("llvm-nm"), "llvm"),
    (Need::File("/usr/include/bpf/bpf_helpers.h"), "libbpf-dev"),
    (Need::File("/usr/include/linux/types.h"), "linux-libc-dev"),
    (Need::Tool("bpftool"), "bpftool"),
    (Need::Tool("fio"), "fio"),
    (Need::Tool("losetup"), "mount"),
    (Need::Tool("setpriv"), "util-linux"),
    (Need::Tool("cc"), "gcc"),
];
const BENCH: &[(Need, &str)] = &[(Need::Tool("bpftrace"), "bpftrace")];
const RIG: &[(Need, &str)] = &[
    (Need::Tool("qemu-system-x86_64"), "qemu-system-x86"),
    (Need::File("/bin/busybox"), "busybox-static"),
    (Need::Tool("cpio"), "cpio"),
    (Need::File("/usr/lib/x86_64-linux-gnu/libc.a"), "libc6-dev"),
];

/// What the integration tests drive besides the rig: terminals, a browser,
/// TLS, the unit checker, the vhost-user engine.
const TEST: &[(Need, &str)] = &[
    (Need::Tool("tmux"), "tmux"),
    (Need::Tool("chromium"), "chromium"),
    (Need::Tool("openssl"), "openssl"),
    (Need::Tool("curl"), "curl"),
    (Need::Tool("systemd-analyze"), "systemd"),
    // Every system call the agent makes, against the unit's filter.
    (Need::Tool("strace"), "strace"),
    (Need::Tool("qemu-storage-daemon"), "qemu-system-common"),
    // VMs as hypervisor hosts run them: started by libvirt.
    (Need::Tool("libvirtd"), "libvirt-daemon-system"),
    (Need::Tool("virtlogd"), "libvirt-daemon-system"),
    (Need::Tool("virsh"), "libvirt-clients"),
    (Need::Tool("partx"), "util-linux"),
    // The eBPF sources' layout (bpf/.clang-format), checked by a test.
    (Need::Tool("clang-format"), "clang-format"),
    // LUKS images for the diagnosis tests: an engine thread's own work.
    (Need::Tool("qemu-img"), "qemu-utils"),
];

#[derive(Clone, Copy)]
enum Need {
    Tool(&'static str),
    File(&'static str),
}

impl Need {
    fn present(self) -> bool {
        match self {
            Need::Tool(t) => {
                sh::which(t)
                    || Path::new("/usr/sbin").join(t).exists()
                    || Path::new("/sbin").join(t).exists()
            }
            Need::File(f) => Path::new(f).exists(),
        }
    }
}

pub fn ensure(bench: bool) -> Result<()> {
    install(BUILD.iter().chain(if bench { BENCH } else { &[] }))
}

/// What the guest rig needs besides the build: QEMU, a static busybox.
pub fn ensure_rig() -> Result<()> {
    install(BUILD.iter().chain(RIG))
}

/// Everything the test suite uses.
pub fn ensure_test() -> Result<()> {
    install(BUILD.iter().chain(RIG).chain(TEST))
}

/// A Rust standard library for `target` (rustup fetches it once).
pub fn ensure_rust_target(target: &str) -> Result<()> {
    let installed =
        crate::sh::output(Command::new("rustup").args(["target", "list", "--installed"]))?;
    if String::from_utf8_lossy(&installed.stdout)
        .lines()
        .any(|l| l.trim() == target)
    {
        return Ok(());
    }
    crate::sh::quietly(
        &format!("adding the Rust target {target}"),
        "rustup-target",
        Command::new("rustup").args(["target", "add", target]),
    )
}

fn install<'a>(needs: impl Iterator<Item = &'a (Need, &'static str)>) -> Result<()> {
    let mut missing: Vec<&str> = needs
        .filter(|(n, _)| !n.present())
        .map(|(_, p)| *p)
        .collect();
    missing.sort();
    missing.dedup();
    if missing.is_empty() {
        return Ok(());
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "missing packages: {}\nhint: run as root, or `sudo apt-get install -y {}`",
            missing.join(" "),
            missing.join(" ")
        );
    }
    fetch_package_lists()?;
    sh::quietly(
        &format!("installing {}", missing.join(" ")),
        "apt-install",
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

/// `apt-get update`: what an install or a download needs first on a
/// machine whose lists are missing or old.
pub fn fetch_package_lists() -> Result<()> {
    sh::quietly(
        "fetching Debian's package lists",
        "apt-update",
        Command::new("apt-get").args(["update", "-q"]),
    )
}

pub fn vmlinux() -> Result<()> {
    ensure(false)?;
    let arch = match std::env::consts::ARCH {
        "x86_64" => "x86",
        "aarch64" => "arm64",
        a => bail!("no vmlinux.h directory for {a}"),
    };
    let out = sh::output(Command::new("bpftool").args([
        "btf",
        "dump",
        "file",
        "/sys/kernel/btf/vmlinux",
        "format",
        "c",
    ]))?;
    if !out.status.success() {
        bail!("bpftool failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let path = sh::root()
        .join("bpf/include/vmlinux")
        .join(arch)
        .join("vmlinux.h");
    std::fs::write(&path, &out.stdout)?;
    eprintln!(
        "xtask: wrote {} ({} bytes)",
        path.display(),
        out.stdout.len()
    );
    Ok(())
}
