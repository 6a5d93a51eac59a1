//! Finding VMs on the host: /proc scanned for QEMU processes, each
//! identified from its command line and libvirt's status file, its guest
//! channel found through its own file table.

use std::{fs, path::PathBuf};

use super::{cmdline::looks_like_qemu, *};

/// How long identifying one process may take before it is given up.
pub const IDENTIFY_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

/// `identify`, off the caller's thread and within `limit`: whatever a
/// process's command line names, the caller never waits longer. One that
/// takes longer is a QEMU process that is not followed (`not_vm` says why).
pub fn identify_within(pid: u32, limit: std::time::Duration) -> Option<Vm> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let spawned = std::thread::Builder::new()
        .name(format!("identify-{pid}"))
        .spawn(move || {
            let _ = tx.send(identify(pid));
        });
    if spawned.is_err() {
        return identify(pid);
    }
    match rx.recv_timeout(limit) {
        Ok(found) => found,
        Err(_) => Some(Vm {
            pid,
            name: format!("qemu-{pid}"),
            not_vm: Some(format!(
                "not identified within {limit:?} (its command line names something that does not answer)"
            )),
            ..Default::default()
        }),
    }
}

/// A running process's identity, if it is a QEMU process: a VM, or (with
/// `not_vm` set) a QEMU that runs no guest.
pub fn identify(pid: u32) -> Option<Vm> {
    let comm = fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    if !is_qemu_comm(&comm) {
        return None;
    }
    let raw = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    // An exited process awaiting its parent (a zombie) has no command
    // line left to tell what it was.
    if raw.is_empty() {
        return None;
    }
    let args: Vec<String> = raw
        .split(|&b| b == 0)
        .skip(1)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let mut vm = from_args(pid, &args);
    if !looks_like_qemu(&comm, &vm) {
        return None;
    }
    vm.exe = fs::read_link(format!("/proc/{pid}/exe"))
        .ok()
        .filter(|p| p.exists());
    vm.kvm = kvm_on_command_line(&comm, &args) || holds_kvm_vm(pid);
    if vm.not_vm.is_some() {
        return Some(vm);
    }
    if let Some(dom) = crate::discover::libvirt::domain_of(pid) {
        vm.apply_domain(dom);
    }
    vm.guest_channel = vm.channel.as_ref().and_then(|c| channel_socket(pid, c));
    if vm.disks.iter().any(|d| d.socket.is_some()) {
        let cwd = fs::read_link(format!("/proc/{pid}/cwd")).unwrap_or_default();
        vm.find_engines(&storage_daemons(), &cwd);
        for d in vm.disks.iter_mut().filter(|d| d.engine.is_none()) {
            d.engine = d.socket.as_ref().and_then(|s| socket_engine(&cwd.join(s)));
        }
    }
    if vm.disks.iter().any(VDisk::kernel_vhost) {
        vm.find_luns(&configfs_root());
    }
    Some(vm)
}

/// The guest channel's host socket: a listening unix socket the VM's own
/// process holds for the chardev (passed in by libvirt as `fd=N`, or bound
/// by QEMU at `path=`). A path on the command line that the process does
/// not itself listen on is never connected to.
pub fn channel_socket(pid: u32, src: &SocketSource) -> Option<PathBuf> {
    match src {
        SocketSource::Fd(fd) => crate::discover::procfs::held_listener(pid, Some(*fd), None),
        SocketSource::Path(p) => {
            let abs = if p.is_absolute() {
                p.clone()
            } else {
                fs::read_link(format!("/proc/{pid}/cwd")).ok()?.join(p)
            };
            crate::discover::procfs::held_listener(pid, None, Some(&abs))
        }
    }
}

/// Whether the VM's process still runs: not gone, not a zombie awaiting its
/// parent, and its pid not handed to another program.
pub fn alive(vm: &Vm) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{}/stat", vm.pid)) else {
        return false;
    };
    // "pid (comm) state ...": comm may hold spaces and parentheses.
    let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
        return false;
    };
    let comm = &stat[open + 1..close];
    let state = stat[close + 1..].trim_start().chars().next();
    is_qemu_comm(comm) && !matches!(state, Some('Z' | 'X' | 'x'))
}

/// When a process started, as time since boot (`/proc/PID/stat`'s
/// `starttime`, in clock ticks).
pub fn started_since_boot(pid: u32) -> Option<std::time::Duration> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after "(comm)": state is field 3, starttime field 22.
    let rest = &stat[stat.rfind(')')? + 1..];
    let ticks: u64 = rest.split_whitespace().nth(19)?.parse().ok()?;
    let hz = Some(rustix::param::clock_ticks_per_second()).filter(|&h| h > 0)?;
    Some(std::time::Duration::from_nanos(
        ticks.saturating_mul(1_000_000_000) / hz,
    ))
}

/// Time since boot now, on the clock `started_since_boot` counts.
pub fn since_boot() -> std::time::Duration {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    std::time::Duration::new(
        ts.tv_sec.max(0) as u64,
        ts.tv_nsec.max(0).min(999_999_999) as u32,
    )
}

/// Whether an engine process still runs (as the same program).
pub fn engine_alive(e: &EngineRef) -> bool {
    fs::read_to_string(format!("/proc/{}/comm", e.pid)).is_ok_and(|c| c.trim_end() == e.comm)
}

/// The processes running now whose program is a QEMU system emulator's
/// (VMs or not: the agent finds out when it names them).
pub fn qemu_pids() -> Vec<u32> {
    let Ok(rd) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| is_qemu_comm(&c))
        })
        .collect()
}

/// Every QEMU VM running now.
pub fn scan() -> Vec<Vm> {
    let mut v: Vec<Vm> = qemu_pids()
        .into_iter()
        .filter_map(|pid| identify_within(pid, IDENTIFY_LIMIT))
        .filter(|vm| vm.not_vm.is_none())
        .collect();
    v.sort_by_key(|vm| vm.pid);
    v
}

/// Whether a QEMU command line runs its guest on KVM: `-enable-kvm`,
/// `-accel kvm`, `-machine …,accel=kvm` (libvirt's older form), or a
/// binary whose default is KVM (RHEL's qemu-kvm, Proxmox's kvm).
pub fn kvm_on_command_line(comm: &str, args: &[String]) -> bool {
    let comm = comm.trim_end();
    if comm == "qemu-kvm" || comm == "kvm" {
        return true;
    }
    args.iter().enumerate().any(|(i, a)| {
        let next = args.get(i + 1).map(String::as_str).unwrap_or("");
        match a.trim_start_matches('-') {
            "enable-kvm" => a.starts_with('-'),
            "accel" => next.split(',').next() == Some("kvm") || next.contains("\"accel\":\"kvm\""),
            "machine" | "M" => next.split(',').any(|o| {
                o.strip_prefix("accel=")
                    .is_some_and(|v| v.split(':').next() == Some("kvm"))
            }),
            _ => false,
        }
    })
}

/// Whether the process holds a KVM VM (`anon_inode:kvm-vm` among its
/// open files): a QEMU whose accelerator came from its configuration.
pub fn holds_kvm_vm(pid: u32) -> bool {
    let Ok(dir) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    dir.flatten()
        .filter_map(|e| fs::read_link(e.path()).ok())
        .any(|t| t.as_os_str() == "anon_inode:kvm-vm")
}

/// How long a VM's vCPU threads must have run before its guest is taken to
/// run: a vCPU thread waiting for the VM to start has run about 1 ms
/// (measured: QEMU's TCG thread paused with `-S`), one running its guest
/// passes 5 ms within milliseconds.
pub const VCPU_RAN: std::time::Duration = std::time::Duration::from_millis(5);

/// The CPU time of a VM's busiest vCPU thread (QEMU names them "CPU
/// <n>/KVM", "CPU <n>/TCG", or "ALL CPUs/TCG" with one thread for all):
/// None where it names none or is gone.
pub fn vcpu_runtime(pid: u32) -> Option<std::time::Duration> {
    let tasks = fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    tasks
        .flatten()
        .filter(|t| {
            fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| c.starts_with("CPU ") || c.starts_with("ALL CPUs/"))
        })
        .filter_map(|t| thread_runtime(&t.path()))
        .max()
}

/// A thread's CPU time: schedstat's first field (ns), else stat's user and
/// system ticks (kernels without scheduler statistics).
fn thread_runtime(task: &std::path::Path) -> Option<std::time::Duration> {
    if let Some(ns) = fs::read_to_string(task.join("schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
    {
        return Some(std::time::Duration::from_nanos(ns));
    }
    let stat = fs::read_to_string(task.join("stat")).ok()?;
    // Fields after "(comm)": utime is field 14, stime 15.
    let mut rest = stat[stat.rfind(')')? + 1..].split_whitespace().skip(11);
    let ticks = rest.next()?.parse::<u64>().ok()? + rest.next()?.parse::<u64>().ok()?;
    let hz = Some(rustix::param::clock_ticks_per_second()).filter(|&h| h > 0)?;
    Some(std::time::Duration::from_nanos(
        ticks.saturating_mul(1_000_000_000) / hz,
    ))
}
