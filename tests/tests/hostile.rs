//! A local user's fake VMs: anyone can start a process named like QEMU with
//! any command line. Started as `nobody`, with a vhost-scsi target named by
//! an absolute path and by `..` (into a tree whose backstore is a FIFO, or a
//! link to /dev/zero), an executable deleted with a FIFO at its
//! `PATH (deleted)`, and a guest channel naming a root-only socket: the
//! root agent finishes on time, stays small, and never connects (root).

use std::{
    io::ErrorKind,
    os::unix::{fs::PermissionsExt, net::UnixListener},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use agent_integration::{iospan_bin, run};

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    assert_eq!(
        unsafe { libc::mkfifo(c.as_ptr(), 0o666) },
        0,
        "mkfifo {}",
        p.display()
    );
}

fn open_dir(p: &Path) {
    std::fs::create_dir_all(p).unwrap();
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// The fake QEMU, built under QEMU's name in `dir`.
fn fake_qemu(dir: &Path) -> PathBuf {
    open_dir(dir);
    let exe = dir.join("qemu-system-x86_64");
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/native/fake_qemu.c");
    let out = run(Command::new("cc").args(["-O1", "-o"]).arg(&exe).arg(src));
    assert!(
        out.status.success(),
        "building {src}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

/// `exe` with `args`, as nobody.
fn as_nobody(exe: &Path, args: &[String]) -> Child {
    Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(exe)
        .args(args)
        .env("FAKE_QEMU_SECONDS", "40")
        .stdin(Stdio::null())
        .spawn()
        .expect("setpriv (util-linux)")
}

/// A LUN tree as LIO lays it out, made by the attacker outside configfs:
/// `root/tpgt_1/lun/lun_0/x` links to `store`.
fn evil_target(root: &Path, store: &Path) {
    open_dir(&root.join("tpgt_1/lun/lun_0"));
    std::os::unix::fs::symlink(store, root.join("tpgt_1/lun/lun_0/x")).unwrap();
}

/// Peak RSS (KiB) of the waited child `pid`.
/// The process at the other end of a unix socket.
fn peer_pid(s: &std::os::unix::net::UnixStream) -> Option<i32> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for the call; the socket is open.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(cred.pid)
}

fn wait_rss(pid: u32, limit: Duration) -> Option<(i32, i64)> {
    let deadline = Instant::now() + limit;
    loop {
        let mut status = 0;
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        let r = unsafe { libc::wait4(pid as i32, &mut status, libc::WNOHANG, &mut ru) };
        if r == pid as i32 {
            return Some((status, ru.ru_maxrss));
        }
        if Instant::now() > deadline {
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn fake_vms_of_a_local_user_neither_stall_nor_steer_the_agent() {
    let base_held = tempfile::Builder::new()
        .prefix("iospan-hostile-")
        .tempdir()
        .unwrap();
    let base = base_held.path().to_path_buf();
    open_dir(&base);
    let traps = Traps::lay(&base);
    let exe = fake_qemu(&base.join("bin"));
    let cases = traps.command_lines();
    // Two found by the start-up scan, the rest at their exec while it runs.
    let mut fakes: Vec<Child> = cases[..2].iter().map(|a| as_nobody(&exe, a)).collect();
    // One whose executable is gone, with a FIFO where its path says it was.
    let del_dir = base.join("del");
    let del_exe = fake_qemu(&del_dir);
    fakes.push(as_nobody(&del_exe, &cases[3]));
    std::thread::sleep(Duration::from_millis(300));
    std::fs::remove_file(&del_exe).unwrap();
    mkfifo(&del_dir.join("qemu-system-x86_64 (deleted)"));

    let json = base.join("report.json");
    let started = Instant::now();
    // Waited with wait4 below, for its peak RSS.
    #[allow(clippy::zombie_processes)]
    let agent = Command::new(iospan_bin())
        .args(["run", "--quiet", "--duration", "4s", "--json-out"])
        .arg(&json)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    fakes.push(as_nobody(&exe, &cases[2]));
    fakes.push(as_nobody(&exe, &cases[0]));
    let waited = wait_rss(agent.id(), Duration::from_secs(30));
    let took = started.elapsed();
    let connections = traps.connections();
    for f in &mut fakes {
        let _ = f.kill();
        let _ = f.wait();
    }
    let (status, rss_kib) =
        waited.unwrap_or_else(|| panic!("iospan run -d 4s still running after {took:?}: stalled"));
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "iospan run: wait status {status:#x}"
    );
    assert!(took < Duration::from_secs(20), "a 4 s run took {took:?}");
    assert!(rss_kib < 256 << 10, "peak RSS {rss_kib} KiB");
    assert_eq!(
        connections, 0,
        "the agent connected to a socket only the fake VMs' command lines named"
    );
    check_every_fake_identified(&json);
}

/// What the fake VMs' command lines name: a socket only root can reach,
/// backstores that would block or never end a read, a disk.
struct Traps {
    sock: std::path::PathBuf,
    listener: UnixListener,
    abs_target: std::path::PathBuf,
    zero_target: std::path::PathBuf,
    disk: std::path::PathBuf,
}

impl Traps {
    fn lay(base: &std::path::Path) -> Self {
        // A socket only root can reach, counting who connects.
        let private = base.join("root-only");
        std::fs::create_dir_all(&private).unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
        let sock = private.join("ctl.sock");
        let listener = UnixListener::bind(&sock).unwrap();
        listener.set_nonblocking(true).unwrap();

        // Backstores: a FIFO for udev_path, and links to /dev/zero.
        let fifo_store = base.join("fifo-store");
        open_dir(&fifo_store);
        mkfifo(&fifo_store.join("udev_path"));
        let zero_store = base.join("zero-store");
        open_dir(&zero_store);
        std::os::unix::fs::symlink("/dev/zero", zero_store.join("udev_path")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", zero_store.join("info")).unwrap();
        let abs_target = base.join("abs-target");
        evil_target(&abs_target, &fifo_store);
        let zero_target = base.join("zero-target");
        evil_target(&zero_target, &zero_store);
        let disk = base.join("disk.img");
        std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
        std::fs::set_permissions(&disk, std::fs::Permissions::from_mode(0o644)).unwrap();

        Self {
            sock,
            listener,
            abs_target,
            zero_target,
            disk,
        }
    }

    /// The fakes' arguments: a vhost-scsi target by absolute path to a
    /// FIFO backstore, one by `..` to /dev/zero, a channel with a disk,
    /// and (the fourth) the one whose executable goes.
    fn command_lines(&self) -> Vec<Vec<String>> {
        let (sock, disk) = (&self.sock, &self.disk);
        let (abs_target, zero_target) = (&self.abs_target, &self.zero_target);
        let up = "../../../../../../../..";
        let chan = |id: &str| {
            vec![
                "-chardev".to_string(),
                format!("socket,id={id},path={}", sock.display()),
                "-device".into(),
                format!("virtserialport,chardev={id},name=org.iospan.0"),
            ]
        };
        let drive = vec![
            "-drive".to_string(),
            format!(
                "file={},if=none,id=d0,format=raw,aio=io_uring,cache=none",
                disk.display()
            ),
            "-device".into(),
            "virtio-blk-pci,drive=d0,id=vd0".into(),
        ];
        let vhost = |wwpn: String| {
            vec![
                "-device".to_string(),
                format!("vhost-scsi-pci,wwpn={wwpn},id=vs0"),
            ]
        };
        let cases: Vec<Vec<String>> = vec![
            [
                vec!["-name".into(), "guest=abs-fifo".into()],
                vhost(abs_target.display().to_string()),
                chan("c0"),
            ]
            .concat(),
            [
                vec!["-name".into(), "guest=dotdot-zero".into()],
                vhost(format!("{up}{}", zero_target.display())),
                chan("c1"),
            ]
            .concat(),
            [
                vec!["-name".into(), "guest=channel-only".into()],
                drive.clone(),
                chan("c2"),
            ]
            .concat(),
            [
                vec!["-name".into(), "guest=deleted-exe".into()],
                drive,
                chan("c3"),
            ]
            .concat(),
        ];
        cases
    }

    /// Connections made to the root-only socket.
    fn connections(&self) -> usize {
        let mut connections = 0;
        loop {
            match self.listener.accept() {
                Ok(_) => connections += 1,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return connections,
                Err(e) => panic!("accept: {e}"),
            }
        }
    }
}

/// Each fake was identified at once (nothing it named was waited on, so
/// none ran out its identification time and was dropped).
fn check_every_fake_identified(json: &std::path::Path) {
    let rep: serde_json::Value = serde_json::from_slice(&std::fs::read(json).unwrap()).unwrap();
    let names: Vec<&str> = rep["vms"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    for n in ["abs-fifo", "dotdot-zero", "channel-only", "deleted-exe"] {
        assert!(names.contains(&n), "{n} not among the VMs: {names:?}");
    }
    assert_eq!(rep["not_vms"].as_u64(), Some(0), "{:#}", rep["vms"]);
}

/// A guest writing its channel as fast as the agent reads: a HELLO whose
/// strings carry terminal escapes, then records with a new queue number
/// each that match no host request (the VM does no I/O), for 6 s of a
/// 12 s run. The agent's peak RSS stays under 128 MiB, every record it
/// took is counted as unmatched or refused, none is lost unsaid, and the
/// escapes reach no output.
#[test]
fn a_guest_flooding_its_channel_leaves_the_agent_small_and_counts_every_record() {
    use std::os::fd::AsRawFd;

    let base_held = tempfile::Builder::new()
        .prefix("iospan-flood-")
        .tempdir()
        .unwrap();

    let base = base_held.path().to_path_buf();
    open_dir(&base);
    // The channel's listening socket, held by the fake VM (an inherited
    // descriptor, as libvirt passes it) and accepted on here.
    let listener = UnixListener::bind(base.join("chan.sock")).unwrap();
    let fd = listener.as_raw_fd();
    // SAFETY: clears close-on-exec on a descriptor we own.
    assert_eq!(unsafe { libc::fcntl(fd, libc::F_SETFD, 0) }, 0);
    let mut vm = flooding_vm(&base, fd);
    std::thread::sleep(Duration::from_millis(300));

    let json = base.join("report.json");
    #[allow(clippy::zombie_processes)]
    let agent = Command::new(iospan_bin())
        .args(["run", "--quiet", "--duration", "12s", "--json-out"])
        .arg(&json)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut conn = accept_agent(listener, agent.id() as i32);
    let sent = flood(&mut conn, Duration::from_secs(6));
    let waited = wait_rss(agent.id(), Duration::from_secs(40));
    drop(conn);
    let _ = vm.kill();
    let _ = vm.wait();
    let (status, rss_kib) = waited.expect("iospan run -d 12s did not end");
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "iospan run: wait status {status:#x}"
    );
    assert!(sent >= 100_000, "only {sent} records sent in 6 s");
    assert!(
        rss_kib < 128 << 10,
        "peak RSS {rss_kib} KiB after {sent} records"
    );
    check_flood_counted(&json, sent, rss_kib);
}

/// A fake VM with a disk and the guest channel on inherited descriptor `fd`,
/// named with a terminal escape.
fn flooding_vm(base: &std::path::Path, fd: i32) -> Child {
    let disk = base.join("disk.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    let exe = fake_qemu(&base.join("bin"));
    Command::new(&exe)
        .args(["-name", "guest=flood\u{1b}[2J"])
        .arg("-drive")
        .arg(format!(
            "file={},if=none,id=d0,format=raw,aio=io_uring,cache=none",
            disk.display()
        ))
        .args(["-device", "virtio-blk-pci,drive=d0,id=vd0"])
        .arg("-chardev")
        .arg(format!("socket,id=ch0,fd={fd},server=on,wait=off"))
        .args(["-device", "virtserialport,chardev=ch0,name=org.iospan.0"])
        .env("FAKE_QEMU_SECONDS", "40")
        .stdin(Stdio::null())
        .spawn()
        .unwrap()
}

/// The agent's connection to the channel. Every agent on the host follows
/// every VM's channel: another test's may reach this one first. Only ours
/// is flooded.
fn accept_agent(listener: UnixListener, agent_pid: i32) -> std::os::unix::net::UnixStream {
    listener.set_nonblocking(false).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let ours = loop {
            match listener.accept() {
                Ok((s, _)) if peer_pid(&s) == Some(agent_pid) => break Ok(s),
                Ok(_) => continue,
                Err(e) => break Err(e),
            }
        };
        let _ = tx.send(ours);
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the agent never connected to the VM's own channel")
        .unwrap()
}

/// A hello with escapes in its strings, then frames of records as fast as
/// the agent takes them for `how_long`: the records sent.
fn flood(conn: &mut std::os::unix::net::UnixStream, how_long: Duration) -> u64 {
    use iospan::pipeline::transport::{encode, Frame, GuestDisk, Hello, MAX_PAYLOAD};
    use std::io::Write;
    // Major 252, minor 0.
    let dev = 252 << 20;
    let hello = Frame::Hello(Hello {
        boot_id: "boot\u{1b}]0;owned\u{7}".into(),
        kernel: "6.1\u{1b}[31m".into(),
        disks: vec![GuestDisk {
            dev,
            name: "vda".into(),
            serial: None,
        }],
        probes: "kick and completion probes".into(),
    });
    conn.write_all(&encode(1, 0, &hello)).unwrap();
    let per_frame = MAX_PAYLOAD / iospan::abi::GuestIoEvent::SIZE - 1;
    let mut sent = 0u64;
    let mut seq = 1u64;
    let t0 = Instant::now();
    while t0.elapsed() < how_long {
        let recs: Vec<iospan::abi::GuestIoEvent> = (0..per_frame as u64)
            .map(|i| {
                let n = sent + i;
                iospan::abi::GuestIoEvent {
                    kind: iospan::abi::EVENT_GUEST_IO,
                    dev,
                    sector: n * 8,
                    bytes: 4096,
                    queue: n as u32,
                    start_ns: 1_000 + n * 1_000,
                    issue_ns: 1_100 + n * 1_000,
                    done_ns: 1_500 + n * 1_000,
                    ..Default::default()
                }
            })
            .collect();
        if conn
            .write_all(&encode(1, seq, &Frame::Records(recs)))
            .is_err()
        {
            break;
        }
        sent += per_frame as u64;
        seq += 1;
    }
    sent
}

/// Every record the flood sent taken and counted; the name shown, not obeyed.
fn check_flood_counted(json: &std::path::Path, sent: u64, rss_kib: i64) {
    let rep: serde_json::Value = serde_json::from_slice(&std::fs::read(json).unwrap()).unwrap();
    let g = rep["guests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["vm"].as_str().is_some_and(|v| v.starts_with("flood")))
        .unwrap_or_else(|| {
            panic!(
                "the flooding guest is not in the report: {:#}",
                rep["guests"]
            )
        });
    // The name its command line gave, shown, not obeyed.
    assert_eq!(g["vm"], "flood\\u{1b}[2J");
    let received = g["channel"]["records"].as_u64().unwrap();
    assert_eq!(received, sent, "{:#}", g["channel"]);
    assert_eq!(
        g["channel"]["lost_frames"].as_u64(),
        Some(0),
        "{:#}",
        g["channel"]
    );
    let s = &rep["stitch"];
    let counted = ["unmatched_guest", "guest_over_cap", "unknown_disk"]
        .iter()
        .map(|k| s[k].as_u64().unwrap_or(0))
        .sum::<u64>();
    assert_eq!(counted, received, "records taken but not counted: {s:#}");
    assert!(s["guest_over_cap"].as_u64().unwrap() > 0, "{s:#}");
    eprintln!(
        "flood: {sent} records sent and taken, peak RSS {rss_kib} KiB; over cap {}, unmatched {}",
        s["guest_over_cap"], s["unmatched_guest"]
    );
    assert_eq!(
        s["unknown_disk"].as_u64(),
        Some(0),
        "the disk was not matched: {s:#}"
    );
}
