//! The kernel matrix: iospan's release binary inside Debian's cloud kernels
//! of three releases, booted under QEMU (software emulation) with a
//! VM-shaped workload inside. Each boot runs `xtask/rig/matrix-init`: iospan
//! doctor, the guest agent, the block split and the VM split in each probe
//! flavour iospan may choose there, and hands back what each step wrote.

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::{debian::Suite, guest, sh};

/// A Debian release whose cloud kernel the matrix boots.
pub struct Release {
    pub suite: &'static str,
    pub debian: u32,
    /// The kernel series it ships.
    pub series: &'static str,
}

pub const KERNELS: [Release; 3] = [
    Release {
        suite: "bullseye",
        debian: 11,
        series: "5.10",
    },
    Release {
        suite: "bookworm",
        debian: 12,
        series: "6.1",
    },
    Release {
        suite: "trixie",
        debian: 13,
        series: "6.12",
    },
];

/// Modules the matrix's init loads where the kernel has them as modules.
const MODULES: &[&str] = &["virtio_pci", "virtio_blk", "virtio_console"];

/// The in-kernel SCSI target and vhost-scsi, for the `vhost` step: loaded
/// where the kernel package carries them (the step then says what is
/// missing).
const VHOST_MODULES: &[&str] = &["target_core_iblock", "target_core_file", "vhost_scsi"];

/// How long one boot may take under software emulation.
const BOOT_LIMIT: Duration = Duration::from_secs(420);

pub fn release(series: &str) -> Result<&'static Release> {
    KERNELS
        .iter()
        .find(|r| r.series == series || r.suite == series)
        .with_context(|| format!("no kernel {series} in the matrix (5.10, 6.1, 6.12)"))
}

/// A release's cloud kernel, unpacked in the cache.
pub struct Kernel {
    pub release: &'static Release,
    /// The package's root: boot/vmlinuz-*, lib/modules/*.
    pub root: PathBuf,
    pub vmlinuz: PathBuf,
}

pub fn kernel(r: &'static Release) -> Result<Kernel> {
    let suite = Suite::open(r.suite)?;
    let pkg = suite.dependency("linux-image-cloud-amd64", "linux-image-")?;
    let root = suite.unpacked(&pkg)?;
    let vmlinuz = std::fs::read_dir(root.join("boot"))?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
        })
        .with_context(|| format!("no vmlinuz in {pkg}"))?;
    Ok(Kernel {
        release: r,
        root,
        vmlinuz,
    })
}

/// What one boot left: its console, and /out of the guest unpacked.
pub struct Outcome {
    pub console: String,
    pub out: PathBuf,
    pub seconds: f64,
}

impl Outcome {
    pub fn file(&self, name: &str) -> Result<String> {
        std::fs::read_to_string(self.out.join(name)).with_context(|| {
            format!(
                "{name} not written by the matrix boot; console:\n{}",
                self.console
            )
        })
    }

    pub fn json(&self, name: &str) -> Result<serde_json::Value> {
        serde_json::from_str(&self.file(name)?).with_context(|| format!("{name}: not JSON"))
    }

    /// A step's exit status (`NAME.rc`).
    pub fn rc(&self, step: &str) -> Result<i32> {
        self.file(&format!("{step}.rc"))?
            .trim()
            .parse()
            .with_context(|| format!("{step}.rc"))
    }
}

/// Boots the release's kernel with the matrix's initramfs, every step.
pub fn run(r: &'static Release) -> Result<Outcome> {
    run_steps(r, &[])
}

/// The same, only `steps` (all when empty).
pub fn run_steps(r: &'static Release, steps: &[String]) -> Result<Outcome> {
    const STEPS: [&str; 7] = [
        "doctor",
        "guest",
        "block",
        "vm-always-on",
        "vm-avoiding",
        "vm-deep",
        "vhost",
    ];
    if let Some(bad) = steps.iter().find(|s| !STEPS.contains(&s.as_str())) {
        bail!("no step {bad} in the matrix: {}", STEPS.join(", "));
    }
    let k = kernel(r)?;
    let work = sh::target_dir().join("matrix").join(r.suite);
    std::fs::create_dir_all(&work)?;
    let initrd = build_initrd(&k, &work)?;
    boot(&k, &initrd, &work, steps)
}

/// `cargo xtask matrix`.
pub fn main(kernels: &[String], steps: &[String]) -> Result<()> {
    let chosen: Vec<&'static Release> = if kernels.is_empty() {
        KERNELS.iter().collect()
    } else {
        kernels.iter().map(|k| release(k)).collect::<Result<_>>()?
    };
    for r in chosen {
        let o = run_steps(r, steps)?;
        println!(
            "Debian {} {}: {:.0} s, results in {}",
            r.suite,
            r.series,
            o.seconds,
            o.out.display()
        );
    }
    Ok(())
}

fn build_initrd(k: &Kernel, work: &Path) -> Result<PathBuf> {
    let agent = guest::build_guest_agent()?;
    let stage = work.join("initramfs");
    let _ = std::fs::remove_dir_all(&stage);
    for d in ["bin", "proc", "sys", "dev", "modules", "tmp"] {
        std::fs::create_dir_all(stage.join(d))?;
    }
    let rig = sh::root().join("xtask/rig");
    let native = sh::root().join("tests/native");
    sh::run(
        Command::new("cc")
            .args(["-static", "-O2", "-Wall", "-o"])
            .arg(stage.join("workload"))
            .arg(rig.join("workload.c")),
    )?;
    // A VM-shaped process, named as QEMU's; unstripped: iospan finds its
    // probe sites by symbol.
    sh::run(
        Command::new("cc")
            .args(["-static", "-O2", "-pthread", "-o"])
            .arg(stage.join("bin/qemu-system-x86_64"))
            .arg(native.join("vm_load.c")),
    )?;
    // The VM process whose disk the kernel's vhost-scsi serves: QEMU's
    // name, in a directory of its own beside vm_load's.
    std::fs::create_dir_all(stage.join("vhost"))?;
    sh::run(
        Command::new("cc")
            .args(["-static", "-O2", "-Wall", "-pthread", "-o"])
            .arg(stage.join("vhost/qemu-system-x86_64"))
            .arg(native.join("vhost_scsi.c")),
    )?;
    std::fs::copy("/bin/busybox", stage.join("bin/busybox"))
        .context("copying /bin/busybox (busybox-static)")?;
    std::fs::copy(rig.join("matrix-init"), stage.join("init"))?;
    let mut perms = std::fs::metadata(stage.join("init"))?.permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(stage.join("init"), perms)?;
    sh::run(
        Command::new("strip")
            .arg("-o")
            .arg(stage.join("bin/iospan"))
            .arg(&agent),
    )?;
    let mut names = Vec::new();
    let mut modules = guest::module_order(&k.root, MODULES)?;
    for m in VHOST_MODULES {
        match guest::module_order(&k.root, &[m]) {
            Ok(more) => {
                for p in more {
                    if !modules.contains(&p) {
                        modules.push(p);
                    }
                }
            }
            Err(e) => eprintln!("xtask: matrix: {}: {e:#}", k.release.series),
        }
    }
    for m in modules {
        let name = guest::module_name(&m)?;
        std::fs::write(stage.join("modules").join(&name), guest::module_bytes(&m)?)?;
        names.push(name);
    }
    std::fs::write(stage.join("modules.order"), names.join("\n") + "\n")?;
    let initrd = work.join("initrd.cpio.gz");
    let cmd = format!(
        "find . | cpio -o -H newc --quiet | gzip -1 > {}",
        initrd.display()
    );
    sh::run(Command::new("sh").arg("-c").arg(cmd).current_dir(&stage))?;
    Ok(initrd)
}

/// The boot's QEMU: the kernel and initramfs, the workload's disk (vda),
/// the results' disk (vdb, `out.img`), the vhost step's iblock backstores
/// (vdc, and vdd which QEMU delays) and the guest agent's channel
/// (`channel.out`), all under `work`.
fn qemu_command(k: &Kernel, initrd: &Path, work: &Path, steps: &[String]) -> Result<Command> {
    let disk = work.join("disk.img");
    guest::ensure_image(&disk, 128)?;
    // LIO's disks: fresh and sparse at each boot, so that a read costs
    // the same wherever it lands and whichever run makes it (the host's
    // disk serves none of it), and the vhost step's runs compare.
    let lio_disk = work.join("lio.img");
    sparse_image(&lio_disk, 64)?;
    let slow_disk = work.join("lio-slow.img");
    sparse_image(&slow_disk, 64)?;
    let out_img = work.join("out.img");
    std::fs::write(&out_img, vec![0u8; 32 << 20])?;
    let channel = work.join("channel.out");
    let mut c = Command::new("qemu-system-x86_64");
    // One TCG thread: the kernel patches its own text as probes attach
    // (static keys), which multi-threaded TCG has been seen to run torn.
    c.args([
        "-accel",
        "tcg,thread=single",
        "-m",
        "1024",
        "-smp",
        "2",
        "-display",
        "none",
    ])
    .args([
        "-serial",
        "stdio",
        "-monitor",
        "none",
        "-no-reboot",
        "-bios",
        "qboot.rom",
    ])
    .arg("-kernel")
    .arg(&k.vmlinuz)
    .arg("-initrd")
    .arg(initrd)
    .arg("-append")
    .arg(if steps.is_empty() {
        "console=ttyS0 quiet panic=-1".to_string()
    } else {
        format!(
            "console=ttyS0 quiet panic=-1 iospan.steps={}",
            steps.join(",")
        )
    })
    .arg("-drive")
    .arg(format!(
        "file={},if=none,id=d0,format=raw,cache=none,aio=io_uring",
        disk.display()
    ))
    .args(["-device", "virtio-blk-pci,drive=d0,num-queues=2"])
    .arg("-drive")
    .arg(format!(
        "file={},if=none,id=d1,format=raw",
        out_img.display()
    ))
    .args(["-device", "virtio-blk-pci,drive=d1"])
    .arg("-drive")
    .arg(format!(
        "file={},if=none,id=d2,format=raw,cache=none,aio=io_uring",
        lio_disk.display()
    ))
    .args(["-device", "virtio-blk-pci,drive=d2"])
    // vhost's delayed backstore (vdd): every request waits in QEMU's
    // throttle, a slow device as the guest sees it.
    .arg("-drive")
    .arg(format!(
        "file={},if=none,id=d3,format=raw,cache=none,aio=io_uring,throttling.iops-total=200",
        slow_disk.display()
    ))
    .args(["-device", "virtio-blk-pci,drive=d3"])
    // The guest agent's channel: its records land in a file.
    .args(["-device", "virtio-serial-pci", "-chardev"])
    .arg(format!("file,id=chan,path={}", channel.display()))
    .args(["-device", "virtserialport,chardev=chan,name=org.iospan.0"]);
    Ok(c)
}

/// A fresh image of `mib` MiB of holes at `path`.
fn sparse_image(path: &Path, mib: u64) -> Result<()> {
    let f = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    f.set_len(mib << 20)
        .with_context(|| format!("sizing {}", path.display()))
}

fn boot(k: &Kernel, initrd: &Path, work: &Path, steps: &[String]) -> Result<Outcome> {
    let channel = work.join("channel.out");
    let _ = std::fs::remove_file(&channel);
    let out_img = work.join("out.img");
    let mut c = qemu_command(k, initrd, work, steps)?;
    let tag = format!("{} {}", k.release.suite, k.release.series);
    eprintln!("xtask: matrix: booting Debian {tag}'s cloud kernel");
    let t = Instant::now();
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting qemu-system-x86_64")?;
    let stdout = child.stdout.take().context("QEMU's console")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut console = String::new();
    loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(line) => {
                if let Some(step) = line.strip_prefix("IOSPAN-MATRIX ") {
                    eprintln!(
                        "xtask: matrix: {tag}: {step} ({:.0} s)",
                        t.elapsed().as_secs_f64()
                    );
                }
                console.push_str(&line);
                console.push('\n');
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
        if t.elapsed() > BOOT_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            bail!("the {tag} boot took over {BOOT_LIMIT:?}; console:\n{console}");
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("QEMU exited {status} booting {tag}; console:\n{console}");
    }
    let out = work.join("out");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    let tar = sh::output(
        Command::new("tar")
            .arg("-xf")
            .arg(&out_img)
            .arg("-C")
            .arg(&out),
    )?;
    if !tar.status.success() || !out.join("kernel").exists() {
        bail!("the {tag} boot wrote no results; console:\n{console}");
    }
    let _ = std::fs::rename(&channel, out.join("channel.bin"));
    Ok(Outcome {
        console,
        out,
        seconds: t.elapsed().as_secs_f64(),
    })
}
