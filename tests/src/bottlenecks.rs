//! Bottlenecks put on purpose, for the diagnosis tests: a slow host device
//! (the `slowfs` FUSE file under a loop device), a busy process pinned to a
//! CPU, a VM thread pinned to one; and the proof that moving the knob a
//! diagnosis named took the bottleneck back.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::run;

/// A host block device whose every request takes at least a delay, many at
/// once: a loop device (direct I/O) over `native/slowfs.c`'s file, which
/// serves the rig's image after the delay.
pub struct SlowDisk {
    daemon: Child,
    mount: tempfile::TempDir,
    delay_file: PathBuf,
    pub dev: PathBuf,
}

impl SlowDisk {
    /// `image` served through a loop device, each request held `delay_us`.
    pub fn over(image: &Path, delay_us: u64) -> Self {
        let bin = slowfs();
        let mount = tempfile::Builder::new()
            .prefix("iospan-slowfs-")
            .tempdir()
            .unwrap();
        let delay_file = mount.path().with_extension("delay");
        std::fs::write(&delay_file, delay_us.to_string()).unwrap();
        let mut daemon = Command::new(&bin)
            .arg(mount.path())
            .arg(image)
            .arg(delay_us.to_string())
            .env("SLOWFS_DELAY_FILE", &delay_file)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut ready = String::new();
        let out = daemon.stdout.as_mut().unwrap();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut ready).unwrap();
        assert_eq!(ready.trim(), "slowfs: ready", "slowfs did not mount");
        let file = mount.path().join("disk.img");
        let out = run(Command::new("losetup")
            .args(["--direct-io=on", "--find", "--show"])
            .arg(&file));
        assert!(
            out.status.success(),
            "losetup over {}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let dev = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        Self {
            daemon,
            mount,
            delay_file,
            dev,
        }
    }

    /// Its name under /sys/block (`loop3`).
    pub fn name(&self) -> String {
        self.dev.file_name().unwrap().to_string_lossy().into_owned()
    }

    /// Each request held `delay_us` from now on.
    pub fn set_delay(&self, delay_us: u64) {
        std::fs::write(&self.delay_file, delay_us.to_string()).unwrap();
        let pid = self.daemon.id().to_string();
        assert!(run(Command::new("kill").args(["-USR1", &pid]))
            .status
            .success());
    }

    /// One of its queue settings (`nr_requests`, `scheduler`), set.
    pub fn set_queue(&self, setting: &str, value: &str) {
        let p = format!("/sys/block/{}/queue/{setting}", self.name());
        std::fs::write(&p, value).unwrap_or_else(|e| panic!("{p} = {value}: {e}"));
    }
}

impl Drop for SlowDisk {
    fn drop(&mut self) {
        let _ = run(Command::new("losetup").arg("-d").arg(&self.dev));
        // The loop device lets go of the file a moment after detaching.
        for _ in 0..50 {
            if run(Command::new("umount").arg(self.mount.path()))
                .status
                .success()
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
        let _ = std::fs::remove_file(&self.delay_file);
    }
}

/// `native/slowfs.c`, built once per test binary.
fn slowfs() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let dir =
                std::env::temp_dir().join(format!("iospan-slowfs-bin-{}", std::process::id()));
            crate::build_native(&dir, "slowfs.c", "slowfs", &["-O2", "-Wall", "-pthread"])
        })
        .clone()
}

/// A spinner at SCHED_IDLE on every CPU while it lasts. On a nested host a
/// thread woken on an idle CPU waits 70-100 µs for that CPU to come out of
/// its halt (the outer hypervisor's): a kvm_vm vhost worker's wake-up was
/// half its 180 µs window on a quiet host against 3-8 µs on a busy one. A
/// SCHED_IDLE task yields at once to any woken thread, so a wake-up costs
/// what the path itself costs, on a quiet host or a busy one.
pub struct CpusAwake {
    /// Held for their drop.
    _spinners: Vec<Hog>,
}

impl CpusAwake {
    pub fn start() -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
        Self {
            _spinners: (0..cpus).map(Hog::idle).collect(),
        }
    }
}

/// A process spinning on one CPU at a higher priority than a VM's threads
/// (nice -10): what a busy neighbour does to a thread sharing its CPU.
pub struct Hog(Child);

impl Hog {
    pub fn on(cpu: u32) -> Self {
        Self::spin(cpu, &["nice", "-n", "-10"])
    }

    /// A spinner at SCHED_IDLE on `cpu`: it keeps the CPU out of its halt
    /// and yields at once to any thread woken there (see `CpusAwake`).
    pub fn idle(cpu: u32) -> Self {
        Self::spin(cpu, &["chrt", "-i", "0"])
    }

    /// A shell loop on `cpu`, started by `how` (a priority or a policy).
    fn spin(cpu: u32, how: &[&str]) -> Self {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new(how[0]);
        cmd.args(&how[1..])
            .args(["taskset", "-c", &cpu.to_string()])
            .args(["sh", "-c", "while :; do :; done"]);
        // A test killed before its drop must not leave the CPU taken for
        // the tests after it.
        // SAFETY: prctl is async-signal-safe and touches no memory here.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Self(
            cmd.spawn()
                .unwrap_or_else(|e| panic!("{how:?} taskset sh: {e}")),
        )
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The tid of the thread named `comm` in the QEMU process whose command line
/// has `-name guest=VM`, once it has one (within 60 s).
pub fn vm_thread(vm: &str, comm: &str) -> u32 {
    let t = Instant::now();
    let needle = format!("guest={vm},");
    loop {
        let found = std::fs::read_dir("/proc").unwrap().flatten().find_map(|p| {
            let exe = std::fs::read_link(p.path().join("exe")).ok()?;
            if !exe.to_string_lossy().contains("qemu-system") {
                return None;
            }
            let cmdline = std::fs::read(p.path().join("cmdline")).ok()?;
            if !String::from_utf8_lossy(&cmdline).contains(&needle) {
                return None;
            }
            std::fs::read_dir(p.path().join("task"))
                .ok()?
                .flatten()
                .find_map(|t| {
                    let name = std::fs::read_to_string(t.path().join("comm")).ok()?;
                    (name.trim_end() == comm)
                        .then(|| t.file_name().to_string_lossy().parse().ok())?
                })
        });
        if let Some(tid) = found {
            return tid;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no thread {comm:?} of VM {vm} within 60 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Pins thread `tid` to `cpus` (a taskset list).
pub fn pin(tid: u32, cpus: &str) {
    let out = run(Command::new("taskset").args(["-pc", cpus, &tid.to_string()]));
    assert!(
        out.status.success(),
        "taskset -pc {cpus} {tid}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Pins VM `vm`'s thread `comm` to `cpus` as soon as it exists, from a
/// thread of its own (the VM starts under `iospan run`).
pub fn pin_when_started(vm: &str, comm: &str, cpus: &str) -> std::thread::JoinHandle<u32> {
    let (vm, comm, cpus) = (vm.to_string(), comm.to_string(), cpus.to_string());
    std::thread::spawn(move || {
        let tid = vm_thread(&vm, &comm);
        pin(tid, &cpus);
        tid
    })
}

/// The guest's mean latency without a bottleneck, with it, and with the
/// knob moved as the diagnosis said.
#[derive(Clone, Copy, Debug)]
pub struct Means {
    pub free_us: f64,
    pub stuck_us: f64,
    pub moved_us: f64,
}

/// The bottleneck added to the guest's latency, the knob took back at
/// least half of it, and `iospan compare before after` (labelled runs in
/// `runs`) says the change moved the segment `diagnosis` named.
pub fn proven(m: Means, diagnosis: &serde_json::Value, runs: &Path) {
    let added = m.stuck_us - m.free_us;
    let back = m.stuck_us - m.moved_us;
    let ctx = format!(
        "guest mean: free {:.0} µs, with the bottleneck {:.0} µs, knob moved {:.0} µs; \
         diagnosis: {diagnosis:#}",
        m.free_us, m.stuck_us, m.moved_us,
    );
    eprintln!("{ctx}");
    assert!(
        added > 0.3 * m.free_us,
        "the bottleneck added little: {ctx}"
    );
    assert!(back >= 0.5 * added, "the knob took back under half: {ctx}");
    let out = run(Command::new(crate::iospan_bin())
        .args(["compare", "before", "after", "--runs-dir"])
        .arg(runs));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let segment = diagnosis["segment"].as_str().unwrap_or("");
    let named = format!("before's diagnosis named {segment}");
    assert!(text.contains(&named), "{named:?} not in:\n{text}");
    assert!(text.contains("the change moved it by"), "{text}");
}
