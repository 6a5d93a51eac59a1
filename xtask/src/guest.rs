//! `cargo xtask guest …`: the guest rig. A distribution kernel with BTF
//! (Debian's cloud kernel), a busybox initramfs with the virtio modules and
//! a static O_DIRECT workload, booted under QEMU with software emulation and
//! a virtio-blk or NVMe disk. The guest prints the workload's own per-I/O
//! latency and exact count, then its disk's /sys/block/DEV/stat: the ground
//! truth for counts.

use std::{
    collections::BTreeSet,
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::Value;

use crate::{setup, sh};

/// Modules the initramfs loads, with their dependencies (NVMe is built in):
/// the disk, and the virtio-serial port of the guest agent's channel.
const MODULES: &[&str] = &["virtio_blk", "virtio_pci", "virtio_console", "dm_delay"];

/// The target the guest agent is built for: static, runs in any guest.
pub const GUEST_TARGET: &str = "x86_64-unknown-linux-musl";

#[derive(clap::Subcommand)]
pub enum GuestCmd {
    /// Fetch the kernel and build the initramfs into target/rig (cached).
    Build,
    /// Boot the rig guest once and print what it measured.
    Run(Box<RunArgs>),
}

#[derive(clap::Args, Clone, Debug)]
pub struct RunArgs {
    /// Virtual disk model.
    #[arg(long, value_enum, default_value_t = DiskModel::VirtioBlk)]
    pub disk: DiskModel,
    /// QEMU's I/O engine for the image.
    #[arg(long, value_enum, default_value_t = Aio::IoUring)]
    pub aio: Aio,
    /// Serve the disk from a dedicated iothread (virtio-blk only).
    #[arg(long)]
    pub iothread: bool,
    /// Queue depth of the guest workload.
    #[arg(long, default_value_t = 1)]
    pub qd: u32,
    /// Number of I/Os the guest workload does.
    #[arg(long, default_value_t = 2000)]
    pub ios: u64,
    /// randread or randwrite (random 4 KiB), read or write (sequential).
    #[arg(long, default_value = "randread")]
    pub rw: String,
    /// Disk image (raw, fully written); created at 256 MiB if missing.
    #[arg(long)]
    pub image: Option<PathBuf>,
    /// The VM's name, as libvirt passes it (-name guest=NAME).
    #[arg(long, default_value = "iospan-rig")]
    pub name: String,
    /// The virtual disk's id.
    #[arg(long, default_value = "vd0")]
    pub disk_id: String,
    /// Throttle the drive in its engine's block layer (QEMU's
    /// throttling.iops-total; qemu-storage-daemon's throttle filter).
    #[arg(long, value_name = "IOPS")]
    pub throttle_iops: Option<u32>,
    /// NVMe only: take doorbells through eventfds (ioeventfd=on; the
    /// guest then uses shadow doorbells).
    #[arg(long)]
    pub ioeventfd: bool,
    /// Boot without the guest agent (no guest channel, no guest segment).
    #[arg(long)]
    pub no_guest_agent: bool,
    /// Stack a device-mapper "delay" target holding each I/O this many
    /// milliseconds inside the guest, and run the workload on it.
    #[arg(long, value_name = "MS")]
    pub dm_delay_ms: Option<u32>,
    /// Stop the guest agent this many seconds into the workload and start
    /// it again (the host sees its sender start over).
    #[arg(long, value_name = "S")]
    pub agent_restart_s: Option<u32>,
    /// Stop the guest agent for this many seconds as the workload starts,
    /// as a guest busy with its own work starves it: its records reach the
    /// host that much late.
    #[arg(long, value_name = "S")]
    pub agent_stall_s: Option<u32>,
    /// Run the workload, reboot the guest once, run it again.
    #[arg(long)]
    pub reboot: bool,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
    /// Have the workload report each I/O (offset and latency) as well.
    #[arg(long)]
    pub per_io: bool,
    /// Also write the guest's whole console to FILE.
    #[arg(long, value_name = "FILE")]
    pub console_out: Option<PathBuf>,
    /// Stay idle this long after the workload before powering off: an idle
    /// edge, so that counters read while the VM runs (QEMU's own, every
    /// 100 ms) see the whole workload.
    #[arg(long, default_value_t = 300, value_name = "MS")]
    pub idle_ms: u32,
    /// vCPUs, and as many workload jobs, each pinned to its vCPU (so to
    /// its own block-layer queue); a virtio-blk disk gets one queue per
    /// vCPU (num-queues, QEMU's default made explicit).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub cpus: u32,
    /// The QEMU system emulator to boot with (default: qemu-system-x86_64
    /// on PATH), e.g. another release unpacked beside the installed one.
    #[arg(long, value_name = "PATH")]
    pub qemu: Option<PathBuf>,
    /// That QEMU's firmware directory (its `-L`), when not the installed one's.
    #[arg(long, value_name = "DIR", requires = "qemu")]
    pub qemu_data: Option<PathBuf>,
    /// Boot through SeaBIOS, QEMU's default firmware, which reads the disk
    /// before the guest kernel runs (default: qboot, which reads none).
    #[arg(long)]
    pub seabios: bool,
    /// More virtio-blk disks (vd1, vd2, …), one per image: the workload runs
    /// on every disk at once, each at the same depth.
    #[arg(long = "more-disk", value_name = "IMAGE")]
    pub more_disks: Vec<PathBuf>,
    /// With --iothread and more disks: an iothread per disk (io0, io1, …)
    /// instead of one serving them all.
    #[arg(long)]
    pub iothread_per_disk: bool,
    /// Bytes per request (a multiple of 4 KiB, up to 1 MiB).
    #[arg(long, default_value_t = 4096)]
    pub bs: u32,
    /// virtio-blk's queue size (QEMU's queue-size, 256 by default).
    #[arg(long)]
    pub queue_size: Option<u32>,
    /// The images are LUKS (made by `luks_image`), opened with the rig's
    /// secret: QEMU decrypts each read on the disk's engine thread.
    #[arg(long)]
    pub luks: bool,
}

/// The secret the rig's LUKS images are made with.
pub const LUKS_SECRET: &str = "iospan-rig";

/// A LUKS copy of raw `image` at `luks` (serpent, which the CPU has no
/// instructions for: its decryption is the engine thread's own work),
/// made once with qemu-img.
pub fn luks_image(image: &Path, luks: &Path) -> Result<()> {
    if luks.exists() {
        return Ok(());
    }
    let part = luks.with_extension("part");
    // qemu-img sizes the key's PBKDF by timing it in thread CPU time, which
    // the kernel keeps at tick granularity: on a busy machine a timing can
    // read 0 ms and qemu-img gives up ("Unable to get accurate CPU usage").
    // That refusal is about the clock, not the image: try again.
    const ATTEMPTS: u32 = 5;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let _ = std::fs::remove_file(&part);
        let mut cmd = luks_convert(image, &part);
        eprintln!("xtask: {}", sh::show(&cmd));
        let out =
            sh::output(&mut cmd).context("making a LUKS image (qemu-img, from qemu-utils)")?;
        if out.status.success() {
            std::fs::rename(&part, luks)?;
            return Ok(());
        }
        let err = String::from_utf8_lossy(&out.stderr);
        if !err.contains("accurate CPU usage") || attempt == ATTEMPTS {
            bail!(
                "making a LUKS image (qemu-img, from qemu-utils): `{}` failed ({}): {}",
                sh::show(&cmd),
                out.status,
                err.trim()
            );
        }
        eprintln!("xtask: qemu-img could not time its key derivation; trying again ({attempt}/{ATTEMPTS})");
    }
}

fn luks_convert(image: &Path, part: &Path) -> Command {
    let mut cmd = Command::new("qemu-img");
    cmd.args(["convert", "-f", "raw", "-O", "luks", "--object"])
        .arg(format!("secret,id=sec0,data={LUKS_SECRET}"))
        .args([
            "-o",
            "key-secret=sec0,cipher-alg=serpent-256,cipher-mode=xts,iter-time=10",
        ])
        .arg(image)
        .arg(part);
    cmd
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DiskModel {
    VirtioBlk,
    Nvme,
    /// vhost-user-blk: qemu-storage-daemon serves the image, QEMU only
    /// relays kicks and interrupts.
    VhostUser,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Aio {
    IoUring,
    Native,
    Threads,
}

impl Aio {
    fn qemu(self) -> &'static str {
        match self {
            Aio::IoUring => "io_uring",
            Aio::Native => "native",
            Aio::Threads => "threads",
        }
    }
}

impl Default for RunArgs {
    fn default() -> Self {
        Self {
            disk: DiskModel::VirtioBlk,
            aio: Aio::IoUring,
            iothread: false,
            qd: 1,
            ios: 2000,
            rw: "randread".into(),
            image: None,
            name: "iospan-rig".into(),
            disk_id: "vd0".into(),
            throttle_iops: None,
            ioeventfd: false,
            no_guest_agent: false,
            dm_delay_ms: None,
            agent_restart_s: None,
            agent_stall_s: None,
            reboot: false,
            json: false,
            per_io: false,
            console_out: None,
            idle_ms: 300,
            cpus: 1,
            qemu: None,
            qemu_data: None,
            seabios: false,
            more_disks: Vec::new(),
            iothread_per_disk: false,
            bs: 4096,
            queue_size: None,
            luks: false,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct RigResult {
    pub vm: String,
    pub disk_id: String,
    pub model: DiskModel,
    pub aio: Aio,
    pub iothread: bool,
    pub guest_dev: String,
    /// The workload's own line: exact I/O count and per-I/O latency (the
    /// first disk's) ...
    pub workload: Value,
    /// ... and every disk's, one line each (`--more-disk`).
    pub workloads: Vec<Value>,
    /// Each I/O's (offset, latency ns) as the workload timed it, in
    /// completion order (with `--per-io`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub per_io: Vec<(u64, u64)>,
    /// The guest disk's request counters at the end (since boot).
    pub guest_reads: u64,
    pub guest_writes: u64,
    /// The same over the workload only.
    pub workload_reads: u64,
    pub workload_writes: u64,
    pub seconds: f64,
}

pub fn dir() -> PathBuf {
    sh::target_dir().join("rig")
}

pub fn main(cmd: GuestCmd) -> Result<()> {
    match cmd {
        GuestCmd::Build => build().map(|_| ()),
        GuestCmd::Run(a) => {
            let r = run(&a)?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                let w = &r.workload;
                println!(
                    "{} {} ({:?}, aio={}{}) {} QD{}: {} I/Os, mean {} µs, p99 {} µs; guest /sys/block/{}/stat: {} reads, {} writes ({} and {} during the workload); {:.1} s",
                    r.vm, r.disk_id, r.model, r.aio.qemu(), if r.iothread { ", iothread" } else { "" },
                    w["rw"].as_str().unwrap_or("?"), w["qd"], w["ios"], w["mean_us"], w["p99_us"],
                    r.guest_dev, r.guest_reads, r.guest_writes, r.workload_reads, r.workload_writes, r.seconds
                );
            }
            Ok(())
        }
    }
}

pub struct Rig {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
}

/// Builds (or reuses) the rig's kernel and initramfs.
pub fn build() -> Result<Rig> {
    let kernel = fetch_kernel()?;
    let dir = dir();
    let kernel_dir = dir.join("kernel");
    let initrd = dir.join("initrd.cpio.gz");
    let src = sh::root().join("xtask/rig");
    let agent = build_guest_agent()?;
    let stamp = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let newest_src = ["workload.c", "init"]
        .iter()
        .map(|f| src.join(f))
        .chain([agent.clone()])
        .filter_map(|f| stamp(&f))
        .max();
    if stamp(&initrd).is_none() || newest_src > stamp(&initrd) {
        build_initrd(&kernel_dir, &initrd, &agent)?;
    }
    Ok(Rig { kernel, initrd })
}

/// The rig's kernel, fetched once (a download: it may run beside a build).
pub fn fetch_kernel() -> Result<PathBuf> {
    setup::ensure_rig()?;
    let dir = dir();
    std::fs::create_dir_all(&dir)?;
    let kernel = dir.join("vmlinuz");
    if !kernel.exists() {
        download_kernel(&dir.join("kernel"), &kernel)?;
    }
    Ok(kernel)
}

fn download_kernel(kernel_dir: &Path, kernel: &Path) -> Result<()> {
    eprintln!("xtask: fetching Debian's cloud kernel");
    let find = || -> Result<Option<String>> {
        let deps =
            sh::output(Command::new("apt-cache").args(["depends", "linux-image-cloud-amd64"]))?;
        Ok(String::from_utf8_lossy(&deps.stdout).lines().find_map(|l| {
            l.trim()
                .strip_prefix("Depends: ")
                .filter(|p| p.starts_with("linux-image-"))
                .map(str::to_string)
        }))
    };
    let pkg = match find()? {
        Some(p) => p,
        None => {
            // A machine whose package lists were never fetched.
            setup::fetch_package_lists()?;
            find()?.context("Debian's package lists have no linux-image-cloud-amd64")?
        }
    };
    let dl = dir().join("deb");
    std::fs::create_dir_all(&dl)?;
    sh::quietly(
        &format!("downloading {pkg}"),
        "kernel-download",
        Command::new("apt-get")
            .args(["download", "-q", &pkg])
            .current_dir(&dl),
    )?;
    let deb = std::fs::read_dir(&dl)?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(&pkg))
        })
        .context("downloaded kernel package not found")?;
    let _ = std::fs::remove_dir_all(kernel_dir);
    sh::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(kernel_dir))?;
    let vmlinuz = std::fs::read_dir(kernel_dir.join("boot"))?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
        })
        .context("no vmlinuz in the kernel package")?;
    std::fs::copy(vmlinuz, kernel)?;
    Ok(())
}

/// The modules to load, dependencies first. A package's modules.dep is
/// made by depmod at install time, so dependencies are read from each
/// module's own `.modinfo` (its `depends=` entry).
pub(crate) fn module_order(kernel_dir: &Path, names: &[&str]) -> Result<Vec<PathBuf>> {
    // usr/lib/modules in packages of a merged /usr (Debian 13 on).
    let modules = ["lib/modules", "usr/lib/modules"]
        .iter()
        .map(|d| kernel_dir.join(d))
        .find(|d| d.is_dir())
        .context("no lib/modules in the kernel package")?;
    let base = std::fs::read_dir(&modules)?
        .flatten()
        .map(|e| e.path())
        .next()
        .context("no kernel version under lib/modules in the kernel package")?;
    let mut by_name = std::collections::HashMap::new();
    let mut stack = vec![base.join("kernel")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)?.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if let Some(n) = p.file_name().and_then(|n| n.to_str()).and_then(|n| {
                [".ko", ".ko.xz", ".ko.zst"]
                    .iter()
                    .find_map(|ext| n.strip_suffix(ext))
            }) {
                by_name.insert(n.replace('-', "_"), p.clone());
            }
        }
    }
    let depends = |p: &Path| -> Result<Vec<String>> {
        let bytes = module_bytes(p)?;
        let key = b"depends=";
        let at = bytes
            .windows(key.len())
            .position(|w| w == key)
            .with_context(|| format!("no depends= in {}", p.display()))?;
        let rest = &bytes[at + key.len()..];
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        Ok(String::from_utf8_lossy(&rest[..end])
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| s.replace('-', "_"))
            .collect())
    };
    fn visit(
        name: &str,
        by_name: &std::collections::HashMap<String, PathBuf>,
        depends: &dyn Fn(&Path) -> Result<Vec<String>>,
        seen: &mut BTreeSet<String>,
        order: &mut Vec<PathBuf>,
    ) -> Result<()> {
        if !seen.insert(name.to_string()) {
            return Ok(());
        }
        let path = by_name
            .get(name)
            .with_context(|| format!("module {name} not in the kernel package"))?;
        for d in depends(path)? {
            visit(&d, by_name, depends, seen, order)?;
        }
        order.push(path.clone());
        Ok(())
    }
    let mut order = Vec::new();
    let mut seen = BTreeSet::new();
    let builtin = std::fs::read_to_string(base.join("modules.builtin")).unwrap_or_default();
    for name in names {
        if !by_name.contains_key(*name) {
            let file = |l: &str| {
                l.rsplit('/')
                    .next()
                    .map(|f| f.trim_end_matches(".ko").replace('-', "_"))
            };
            if builtin.lines().any(|l| file(l).as_deref() == Some(*name)) {
                // Built into this kernel: nothing to load.
                continue;
            }
        }
        visit(name, &by_name, &depends, &mut seen, &mut order)?;
    }
    Ok(order)
}

/// A module file's contents, decompressed (busybox insmod takes plain
/// modules; newer kernel packages ship them compressed).
pub(crate) fn module_bytes(p: &Path) -> Result<Vec<u8>> {
    let tool = match p.extension().and_then(|e| e.to_str()) {
        Some("xz") => "xz",
        Some("zst") => "zstd",
        _ => return std::fs::read(p).with_context(|| format!("reading {}", p.display())),
    };
    let out = sh::output(Command::new(tool).arg("-dc").arg(p))?;
    if !out.status.success() {
        bail!(
            "{tool} -dc {}: {}",
            p.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out.stdout)
}

/// The module's file name once decompressed.
pub(crate) fn module_name(p: &Path) -> Result<String> {
    let n = p.file_name().context("module name")?.to_string_lossy();
    Ok(n.trim_end_matches(".xz")
        .trim_end_matches(".zst")
        .to_string())
}

/// `iospan`, static (musl) and without the exporters, for the guest (and
/// the demo's host side): cargo rebuilds it only when the agent changed.
pub fn build_guest_agent() -> Result<PathBuf> {
    setup::ensure_rust_target(GUEST_TARGET)?;
    sh::quietly(
        "building iospan (static)",
        "build-guest-agent",
        sh::cargo_command().args([
            "build",
            "--release",
            "-p",
            "iospan",
            // The guest agent exports nothing itself: no OTLP stack.
            "--no-default-features",
            "--target",
            GUEST_TARGET,
        ]),
    )?;
    Ok(sh::target_dir().join(GUEST_TARGET).join("release/iospan"))
}

fn build_initrd(kernel_dir: &Path, initrd: &Path, agent: &Path) -> Result<()> {
    eprintln!("xtask: building the rig initramfs");
    let stage = dir().join("initramfs");
    let _ = std::fs::remove_dir_all(&stage);
    for d in ["bin", "proc", "sys", "dev", "modules", "tmp"] {
        std::fs::create_dir_all(stage.join(d))?;
    }
    let src = sh::root().join("xtask/rig");
    sh::run(
        Command::new("cc")
            .args(["-static", "-O2", "-Wall", "-o"])
            .arg(stage.join("workload"))
            .arg(src.join("workload.c")),
    )?;
    std::fs::copy("/bin/busybox", stage.join("bin/busybox"))
        .context("copying /bin/busybox (busybox-static)")?;
    std::fs::copy(src.join("init"), stage.join("init"))?;
    // Stripped: debug info would triple the initramfs and the boot.
    sh::run(
        Command::new("strip")
            .arg("-o")
            .arg(stage.join("bin/iospan"))
            .arg(agent),
    )?;
    let mut names = Vec::new();
    for m in module_order(kernel_dir, MODULES)? {
        let name = module_name(&m)?;
        std::fs::write(stage.join("modules").join(&name), module_bytes(&m)?)?;
        names.push(name);
    }
    std::fs::write(stage.join("modules.order"), names.join("\n") + "\n")?;
    let mut perms = std::fs::metadata(stage.join("init"))?.permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(stage.join("init"), perms)?;
    let cmd = format!(
        "find . | cpio -o -H newc --quiet | gzip -1 > {}",
        initrd.display()
    );
    sh::run(Command::new("sh").arg("-c").arg(cmd).current_dir(&stage))
}

/// A fully written raw image: O_DIRECT reads of holes never reach the disk.
pub fn ensure_image(path: &Path, mib: u64) -> Result<()> {
    if path.exists() && std::fs::metadata(path)?.len() >= mib << 20 {
        return Ok(());
    }
    if let Some(p) = path.parent() {
        std::fs::create_dir_all(p)?;
    }
    let mut f =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let chunk: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8)
        .collect();
    for _ in 0..mib {
        f.write_all(&chunk)?;
    }
    f.sync_all()?;
    Ok(())
}

/// A fresh socket path for a VM's guest channel (short: unix socket paths
/// are limited to 107 bytes).
fn channel_path(vm: &str) -> PathBuf {
    let dir = dir().join("chan");
    let _ = std::fs::create_dir_all(&dir);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let p = dir.join(format!("{vm}-{}-{nanos}.sock", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

/// The QEMU command line for one rig boot.
/// The vhost-user socket of a rig VM's disk.
pub fn vhost_socket(a: &RunArgs) -> PathBuf {
    let dir = dir().join("vu");
    let _ = std::fs::create_dir_all(&dir);
    dir.join(format!("{}-{}.sock", a.name, a.disk_id))
}

/// qemu-storage-daemon serving a rig disk over vhost-user; stopped when
/// dropped.
pub struct StorageDaemon {
    child: std::process::Child,
    pub socket: PathBuf,
}

impl StorageDaemon {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for StorageDaemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_file(self.socket.with_extension("qmp"));
    }
}

/// Its command line: the image on io_uring (or the rig's aio), raw,
/// throttled when asked, exported on `vhost_socket`.
pub fn storage_daemon_command(a: &RunArgs, image: &Path) -> Command {
    let socket = vhost_socket(a);
    let mut c = Command::new("qemu-storage-daemon");
    c.arg("--blockdev").arg(format!(
        "driver=file,node-name=file0,filename={},cache.direct=on,aio={}",
        image.display(),
        a.aio.qemu()
    ));
    c.args(["--blockdev", "driver=raw,node-name=disk0,file=file0"]);
    let mut node = "disk0";
    if let Some(n) = a.throttle_iops {
        c.args([
            "--object",
            &format!("throttle-group,id=tg0,x-iops-total={n}"),
        ]);
        c.args([
            "--blockdev",
            "driver=throttle,node-name=thr0,throttle-group=tg0,file=disk0",
        ]);
        node = "thr0";
    }
    c.arg("--export").arg(format!(
        "type=vhost-user-blk,id=exp-{},node-name={node},addr.type=unix,addr.path={},writable=on,num-queues=1",
        a.disk_id,
        socket.display()
    ));
    // Its own QMP monitor, as a host's daemon has one: where its counters
    // are read.
    c.arg("--chardev").arg(format!(
        "socket,id=qmp0,path={},server=on,wait=off",
        storage_daemon_monitor(a).display()
    ));
    c.args(["--monitor", "chardev=qmp0"]);
    c
}

/// The QMP monitor of a vhost-user rig disk's qemu-storage-daemon.
pub fn storage_daemon_monitor(a: &RunArgs) -> PathBuf {
    vhost_socket(a).with_extension("qmp")
}

/// Starts qemu-storage-daemon for a vhost-user rig disk and waits for its
/// socket.
pub fn storage_daemon(a: &RunArgs, image: &Path) -> Result<StorageDaemon> {
    let socket = vhost_socket(a);
    let _ = std::fs::remove_file(&socket);
    let _ = std::fs::remove_file(storage_daemon_monitor(a));
    let mut cmd = storage_daemon_command(a, image);
    eprintln!("xtask: {}", sh::show(&cmd));
    let child = cmd
        .stdout(Stdio::null())
        .spawn()
        .context("starting qemu-storage-daemon (Debian package qemu-system-common)")?;
    let mut d = StorageDaemon { child, socket };
    let t = Instant::now();
    while !d.socket.exists() {
        if let Some(status) = d.child.try_wait()? {
            bail!(
                "qemu-storage-daemon exited with {status} before exporting {}",
                d.socket.display()
            );
        }
        if t.elapsed() > Duration::from_secs(20) {
            bail!(
                "qemu-storage-daemon did not export {} within 20 s",
                d.socket.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(d)
}

/// A `-drive` for image `image` as disk `id`: raw, or LUKS (`--luks`).
fn drive(a: &RunArgs, id: &str, image: &Path, throttle_iops: Option<u32>) -> String {
    let throttle = throttle_iops
        .map(|n| format!(",throttling.iops-total={n}"))
        .unwrap_or_default();
    if a.luks {
        format!(
            "driver=luks,key-secret=sec0,file.filename={},file.aio={},file.cache.direct=on,\
             if=none,id={id}{throttle}",
            image.display(),
            a.aio.qemu()
        )
    } else {
        format!(
            "file={},if=none,id={id},format=raw,cache=none,aio={}{throttle}",
            image.display(),
            a.aio.qemu()
        )
    }
}

/// The virtio-blk devices: the rig's disk, then `--more-disk`'s (vd1, …),
/// on the main loop or on iothreads (one for all, or one each).
fn virtio_disks(c: &mut Command, a: &RunArgs) {
    let queue_size = a
        .queue_size
        .map(|n| format!(",queue-size={n}"))
        .unwrap_or_default();
    let ids: Vec<String> = std::iter::once(a.disk_id.clone())
        .chain((1..=a.more_disks.len()).map(|i| format!("vd{i}")))
        .collect();
    for (i, id) in ids.iter().enumerate() {
        if let Some(img) = i.checked_sub(1).and_then(|k| a.more_disks.get(k)) {
            c.arg("-drive").arg(drive(a, id, img, None));
        }
        let iothread = match (a.iothread, a.iothread_per_disk) {
            (false, _) => String::new(),
            (true, false) if i > 0 => ",iothread=io0".into(),
            (true, _) => {
                c.args(["-object", &format!("iothread,id=io{i}")]);
                format!(",iothread=io{i}")
            }
        };
        c.args([
            "-device",
            &format!(
                "virtio-blk-pci,drive={id}{iothread},num-queues={}{queue_size}",
                a.cpus
            ),
        ]);
    }
}

/// The guest's names of its disks: the rig's, then one per `--more-disk`.
fn guest_devs(a: &RunArgs) -> String {
    let first = match a.disk {
        DiskModel::VirtioBlk | DiskModel::VhostUser => "vda",
        DiskModel::Nvme => "nvme0n1",
    };
    std::iter::once(first.to_string())
        .chain((1..=a.more_disks.len()).map(|i| format!("vd{}", (b'a' + i as u8) as char)))
        .collect::<Vec<_>>()
        .join(",")
}

pub fn qemu_command(rig: &Rig, a: &RunArgs, image: &Path) -> (Command, String) {
    let guest_dev = match a.disk {
        DiskModel::VirtioBlk | DiskModel::VhostUser => "vda",
        DiskModel::Nvme => "nvme0n1",
    };
    let devs = guest_devs(a);
    let mut c = Command::new(a.qemu.as_deref().unwrap_or(Path::new("qemu-system-x86_64")));
    if let Some(data) = &a.qemu_data {
        c.arg("-L").arg(data);
    }
    let smp = a.cpus.to_string();
    c.args(["-accel", "tcg", "-m", "512", "-smp", &smp, "-display", "none", "-serial", "stdio", "-monitor", "none"])
        .args(if a.reboot { &[][..] } else { &["-no-reboot"][..] })
        // qboot: a firmware that loads -kernel without touching the disks,
        // so the guest kernel's own counters cover all guest I/O.
        .args(if a.seabios { &[][..] } else { &["-bios", "qboot.rom"][..] })
        .args(["-name", &format!("guest={},debug-threads=on", a.name)])
        .arg("-kernel")
        .arg(&rig.kernel)
        .arg("-initrd")
        .arg(&rig.initrd)
        .arg("-append")
        .arg(format!(
            "console=ttyS0 quiet panic=-1 iospan.dev={devs} iospan.qd={} iospan.ios={} iospan.rw={} iospan.agent={} iospan.dmdelay={}{}",
            a.qd,
            a.ios,
            a.rw,
            u8::from(!a.no_guest_agent),
            a.dm_delay_ms.map(i64::from).unwrap_or(-1),
            a.agent_restart_s.map(|s| format!(" iospan.agentrestart={s}")).unwrap_or_default()
        ) + &a.agent_stall_s.map(|s| format!(" iospan.agentstall={s}")).unwrap_or_default()
            + if a.reboot { " iospan.reboot=1" } else { "" }
            + if a.per_io { " iospan.perio=1" } else { "" }
            + &format!(" iospan.idle={} iospan.jobs={} iospan.bs={}", a.idle_ms, a.cpus, a.bs)
            // QEMU 10's NVMe namespaces sit in a subsystem: one path each,
            // seen by the guest as such, not as a multipath head.
            + if a.disk == DiskModel::Nvme { " nvme_core.multipath=N" } else { "" });
    if a.luks {
        c.arg("-object")
            .arg(format!("secret,id=sec0,data={LUKS_SECRET}"));
    }
    if a.disk != DiskModel::VhostUser {
        c.arg("-drive")
            .arg(drive(a, &a.disk_id, image, a.throttle_iops));
    }
    // A QMP monitor, as hosts give their VMs one: iospan reads QEMU's own
    // counters there (`entries[].qemu`).
    let qmp = channel_path(&format!("{}-qmp", a.name));
    c.arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", qmp.display()));
    if !a.no_guest_agent {
        // The guest channel: a virtio-serial port whose host end is a unix
        // socket QEMU listens on; the host agent finds it in QEMU's argv.
        let chan = channel_path(&a.name);
        c.args(["-device", "virtio-serial-pci", "-chardev"])
            .arg(format!(
                "socket,id=iospan-chan,path={},server=on,wait=off",
                chan.display()
            ))
            .args([
                "-device",
                "virtserialport,chardev=iospan-chan,name=org.iospan.0",
            ]);
    }
    match a.disk {
        DiskModel::VirtioBlk => virtio_disks(&mut c, a),
        DiskModel::Nvme => {
            let ioeventfd = if a.ioeventfd { ",ioeventfd=on" } else { "" };
            c.args([
                "-device",
                &format!("nvme,drive={},serial=iospan0{ioeventfd}", a.disk_id),
            ]);
        }
        DiskModel::VhostUser => {
            // The daemon maps guest memory: it must be shared.
            c.args([
                "-object",
                "memory-backend-memfd,id=mem0,size=512M,share=on",
                "-machine",
                "memory-backend=mem0",
                "-chardev",
            ])
            .arg(format!(
                "socket,id=vu-{},path={}",
                a.disk_id,
                vhost_socket(a).display()
            ))
            .args([
                "-device",
                &format!(
                    "vhost-user-blk-pci,chardev=vu-{0},id={0},num-queues=1",
                    a.disk_id
                ),
            ]);
        }
    }
    (c, guest_dev.to_string())
}

pub fn run(a: &RunArgs) -> Result<RigResult> {
    if a.ioeventfd && a.disk != DiskModel::Nvme {
        bail!("--ioeventfd is for NVMe; virtio-blk always takes its kicks through eventfds");
    }
    if a.iothread && a.disk != DiskModel::VirtioBlk {
        bail!("--iothread is for virtio-blk (NVMe in QEMU 7.2 has none; a vhost-user disk is served by its daemon)");
    }
    if (!a.more_disks.is_empty() || a.queue_size.is_some()) && a.disk != DiskModel::VirtioBlk {
        bail!("--more-disk and --queue-size are for virtio-blk");
    }
    if a.bs == 0 || !a.bs.is_multiple_of(4096) || a.bs > 1 << 20 {
        bail!("--bs {}: a multiple of 4096 up to 1048576", a.bs);
    }
    if !matches!(a.rw.as_str(), "randread" | "randwrite" | "read" | "write") {
        bail!("--rw {}: use randread, randwrite, read or write", a.rw);
    }
    let rig = build()?;
    let image = a.image.clone().unwrap_or_else(|| dir().join("disk.img"));
    ensure_image(&image, 256)?;
    let _daemon = match a.disk {
        DiskModel::VhostUser => Some(storage_daemon(a, &image)?),
        _ => None,
    };
    let (mut cmd, guest_dev) = qemu_command(&rig, a, &image);
    eprintln!("xtask: {}", sh::show(&cmd));
    let t = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting qemu-system-x86_64")?;
    let stdout = child.stdout.take().context("qemu stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut lines = Vec::new();
    let deadline = Duration::from_secs(600);
    loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(l) => lines.push(l),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(_) if t.elapsed() > deadline => {
                let _ = child.kill();
                bail!(
                    "the rig guest did not finish within {deadline:?}; its console:\n{}",
                    lines.join("\n")
                );
            }
            Err(_) => {}
        }
    }
    let status = child.wait()?;
    if let Some(f) = &a.console_out {
        std::fs::write(f, lines.join("\n") + "\n")
            .with_context(|| format!("writing --console-out {}", f.display()))?;
    }
    parse(&lines, a, guest_dev, t.elapsed().as_secs_f64()).with_context(|| {
        format!(
            "qemu exited with {status}; the guest's console:\n{}",
            lines.join("\n")
        )
    })
}

/// Reads the guest's console: the workload's line and the disk counters.
pub fn parse(lines: &[String], a: &RunArgs, guest_dev: String, seconds: f64) -> Result<RigResult> {
    let find = |tag: &str| {
        lines
            .iter()
            .find_map(|l| l.find(tag).map(|i| l[i + tag.len()..].trim().to_string()))
    };
    if let Some(e) = find("IOSPAN-ERROR") {
        bail!("guest: {e}");
    }
    let workload: Value =
        serde_json::from_str(&find("IOSPAN-WORKLOAD").context("no workload result")?)?;
    let tag = "IOSPAN-WORKLOAD";
    let workloads = lines
        .iter()
        .filter_map(|l| serde_json::from_str(l[l.find(tag)? + tag.len()..].trim()).ok())
        .collect();
    let stat = |tag: &str| -> Result<(u64, u64)> {
        let s = find(tag).with_context(|| format!("no {tag} line"))?;
        let f: Vec<u64> = s
            .split_whitespace()
            .skip(1)
            .filter_map(|v| v.parse().ok())
            .collect();
        Ok((
            *f.first().context("stat reads")?,
            *f.get(4).context("stat writes")?,
        ))
    };
    let per_io = lines
        .iter()
        .filter_map(|l| {
            let mut f = l.split_once("IOSPAN-IO ")?.1.split_whitespace();
            Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
        })
        .collect();
    let (r0, w0) = stat("IOSPAN-BEFORE")?;
    let (r1, w1) = stat("IOSPAN-STAT")?;
    Ok(RigResult {
        vm: a.name.clone(),
        disk_id: a.disk_id.clone(),
        model: a.disk,
        aio: a.aio,
        iothread: a.iothread,
        guest_dev,
        workload,
        workloads,
        per_io,
        guest_reads: r1,
        guest_writes: w1,
        workload_reads: r1 - r0,
        workload_writes: w1 - w0,
        seconds,
    })
}
