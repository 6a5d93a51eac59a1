//! Checks that turn the usual failures into errors that name the cause and
//! the fix, before anything is loaded.

use std::path::Path;

use anyhow::{bail, Result};

const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

fn effective_caps() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .unwrap_or(0)
}

pub fn has_bpf_privileges() -> bool {
    let caps = effective_caps();
    let has = |c: u32| caps & (1u64 << c) != 0;
    has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON))
}

pub fn require_bpf_privileges() -> Result<()> {
    if !has_bpf_privileges() {
        bail!(
            "not privileged to load eBPF programs (need CAP_BPF and CAP_PERFMON, or root)\n\
             hint: run as root (`sudo iospan …`) or grant the capabilities: \
             `setcap cap_bpf,cap_perfmon,cap_sys_resource+ep $(which iospan)`"
        );
    }
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        log::warn!(
            "no kernel BTF at /sys/kernel/btf/vmlinux: tp_btf is unavailable and CO-RE relocations may fail; \
             a kernel built with CONFIG_DEBUG_INFO_BTF=y is needed for full support"
        );
    }
    Ok(())
}

/// Fails with a clear message when `cmd` is neither a path to an
/// executable nor found in PATH.
pub fn require_command(cmd: &str) -> Result<()> {
    let is_exec = |p: &Path| {
        use std::os::unix::fs::PermissionsExt;
        p.metadata()
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    };
    if cmd.contains('/') {
        if is_exec(Path::new(cmd)) {
            return Ok(());
        }
        bail!("command `{cmd}` not found or not executable");
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    if std::env::split_paths(&path).any(|d| is_exec(&d.join(cmd))) {
        return Ok(());
    }
    bail!("command `{cmd}` not found in PATH\nhint: install it, or give its full path after `--`")
}

/// User and system CPU seconds used by this process so far.
pub fn self_cpu() -> (f64, f64) {
    // SAFETY: getrusage fills the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    (s(ru.ru_utime), s(ru.ru_stime))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_command_is_named() {
        let e = require_command("surely-not-a-command-iospan")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("surely-not-a-command-iospan") && e.contains("PATH"),
            "{e}"
        );
        assert!(require_command("sh").is_ok());
        assert!(require_command("/nonexistent/x").is_err());
    }
}
