//! Integration tests of iospan against real kernels, real block devices and
//! the eBPF side's own C logic. These tests need root: they load eBPF
//! programs and create loop devices. They run with `cargo xtask test`.

use std::{
    ffi::CStr,
    os::raw::c_char,
    path::{Path, PathBuf},
    process::Command,
};

pub use iospan::abi::{RqCompletion, RqOutcome, RqSlot};

pub mod api;
pub mod bottlenecks;

#[repr(C)]
pub struct ShimField {
    pub name: *const c_char,
    pub offset: usize,
    pub size: usize,
}

#[repr(C)]
#[derive(Default, Debug)]
pub struct ShimConsts {
    pub hist_buckets: u32,
    pub nr_ops: u32,
    pub nr_segs: u32,
    pub default_max_disks: u32,
    pub rq_slots: u32,
    pub f_partial: u32,
    pub f_requeued: u32,
    pub f_no_start: u32,
    pub f_no_issue: u32,
    pub f_error: u32,
    pub f_done: u32,
    pub f_requeue_pending: u32,
    pub nr_counters: u32,
    pub event_blk_io: u32,
    pub vdisk_several: u32,
    pub event_vm_io: u32,
    pub event_vm_signal: u32,
    pub nr_dio_end_io: u32,
    pub vdisk_file_bdev: u32,
    pub vq_by_index: u32,
    pub vq_by_addr: u32,
    pub vq_by_order: u32,
    pub vq_value_mask: u32,
    pub event_vm_pushes: u32,
    pub push_batch: u32,
    pub done_ring: u32,
    pub done_ent_size: u32,
    pub event_vm_split: u32,
    pub _pad: u32,
    pub signal_hold_ns: u64,
}

extern "C" {
    fn shim_hist_bucket(v: u64) -> u32;
    fn shim_rq_on_start(
        s: *mut RqSlot,
        rq: u64,
        now: u64,
        vm: u32,
        vdisk: u32,
        kick_ns: u64,
        pick_ns: u64,
        pos: u64,
        dev: u32,
        op: u32,
    );
    fn shim_rq_on_issue(s: *mut RqSlot, rq: u64, now: u64);
    fn shim_rq_on_requeue(s: *mut RqSlot, rq: u64);
    fn shim_rq_undelivered(s: *const RqSlot, rq: u64) -> i32;
    fn shim_rq_on_complete(s: *mut RqSlot, c: *const RqCompletion, o: *mut RqOutcome) -> i32;
    fn shim_rq_segments(o: *const RqOutcome, now: u64, seg: *mut u64);
    fn shim_layout() -> *const ShimField;
    fn shim_consts(c: *mut ShimConsts);
}

/// The C side's bucket for `v`.
pub fn c_hist_bucket(v: u64) -> usize {
    // SAFETY: pure function.
    unsafe { shim_hist_bucket(v) as usize }
}

/// The C side's request accounting, over slots the test owns.
pub mod rq {
    use super::*;

    /// `ids`: (vm, vdisk, kick_ns, pick_ns) taken at the start.
    pub fn start(s: &mut RqSlot, rq: u64, now: u64, ids: (u32, u32, u64, u64)) {
        start_at(s, rq, now, ids, 0)
    }
    /// As `start`, for a VM request at file offset `pos`.
    pub fn start_at(s: &mut RqSlot, rq: u64, now: u64, ids: (u32, u32, u64, u64), pos: u64) {
        start_entry(s, rq, now, ids, pos, (0, 0))
    }
    /// As `start_at`, naming the (host disk, op) entry it is counted under.
    pub fn start_entry(
        s: &mut RqSlot,
        rq: u64,
        now: u64,
        ids: (u32, u32, u64, u64),
        pos: u64,
        entry: (u32, u32),
    ) {
        // SAFETY: `s` is a valid, exclusive slot.
        unsafe {
            shim_rq_on_start(
                s, rq, now, ids.0, ids.1, ids.2, ids.3, pos, entry.0, entry.1,
            )
        }
    }
    pub fn issue(s: &mut RqSlot, rq: u64, now: u64) {
        // SAFETY: as above.
        unsafe { shim_rq_on_issue(s, rq, now) }
    }
    pub fn requeue(s: &mut RqSlot, rq: u64) {
        // SAFETY: as above.
        unsafe { shim_rq_on_requeue(s, rq) }
    }
    /// Whether `s` holds an issued, unfinished request of key `rq` (asked
    /// when that key starts or is issued again).
    pub fn undelivered(s: &RqSlot, rq: u64) -> bool {
        // SAFETY: pure function over a valid slot.
        unsafe { shim_rq_undelivered(s, rq) != 0 }
    }
    /// `None` for a partial completion.
    pub fn complete(s: Option<&mut RqSlot>, c: &RqCompletion) -> Option<RqOutcome> {
        let mut o = RqOutcome::default();
        let p = s.map_or(std::ptr::null_mut(), |s| s as *mut RqSlot);
        // SAFETY: `p` is null or a valid slot; `c` and `o` are live.
        (unsafe { shim_rq_on_complete(p, c, &mut o) } != 0).then_some(o)
    }
    /// [total, queue, service]; u64::MAX where unknown.
    pub fn segments(o: &RqOutcome, now: u64) -> [u64; 3] {
        let mut seg = [0u64; 3];
        // SAFETY: `seg` holds BLK_NR_SEGS values.
        unsafe { shim_rq_segments(o, now, seg.as_mut_ptr()) };
        seg
    }
}

/// (name, offset, size) of every field the C compiler laid out.
pub fn c_layout() -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    // SAFETY: a static, NULL-name-terminated table.
    unsafe {
        let mut p = shim_layout();
        while !(*p).name.is_null() {
            let name = CStr::from_ptr((*p).name).to_string_lossy().into_owned();
            out.push((name, (*p).offset, (*p).size));
            p = p.add(1);
        }
    }
    out
}

pub fn c_consts() -> ShimConsts {
    let mut c = ShimConsts::default();
    // SAFETY: fills the struct.
    unsafe { shim_consts(&mut c) };
    c
}

/// The `iospan` binary of this build (target/<profile>/iospan).
pub fn iospan_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
    let bin = profile_dir.join("iospan");
    assert!(
        bin.exists(),
        "{} not built: run `cargo build -p iospan` with the same profile first (cargo xtask test does)",
        bin.display()
    );
    bin
}

/// `iospan` (with its arguments) around a QEMU command line, run to its
/// end; its failure is the test's.
pub fn run_around(iospan: &mut Command, qemu: &Command) -> std::process::Output {
    let out = run(iospan
        .arg("--")
        .arg(qemu.get_program())
        .args(qemu.get_args()));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs a traced guest to its end (`run`), which must succeed, and
/// returns its console (stdout) and how long it took.
pub fn run_guest(cmd: &mut Command) -> (Vec<String>, f64) {
    let t = std::time::Instant::now();
    let out = run(cmd);
    let console: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        console.join("\n")
    );
    (console, t.elapsed().as_secs_f64())
}

/// Runs a command to its end, its output captured; a command still running
/// after `RUN_LIMIT` is killed and the test fails (a hang is a failure, not
/// a stuck CI job).
pub fn run(cmd: &mut Command) -> std::process::Output {
    use std::io::Read;
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let status = wait_limited(&mut child, RUN_LIMIT)
        .unwrap_or_else(|| panic!("{cmd:?} still running after {RUN_LIMIT:?}: killed"));
    std::process::Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}

/// How long any one command of a test may run.
pub const RUN_LIMIT: std::time::Duration = std::time::Duration::from_secs(300);

/// Waits for a child up to `limit`; kills it and returns None past that.
pub fn wait_limited(
    child: &mut std::process::Child,
    limit: std::time::Duration,
) -> Option<std::process::ExitStatus> {
    let deadline = std::time::Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

/// fio's JSON for one job: (total_ios, clat mean, p50, p99 µs) for `dir`.
pub fn fio_numbers(json: &serde_json::Value, dir: &str) -> (u64, f64, f64, f64) {
    let d = &json["jobs"][0][dir];
    let ios = d["total_ios"].as_u64().expect("fio total_ios");
    let (mean, p50, p99) = fio_latency(&d["clat_ns"], "clat");
    (ios, mean, p50, p99)
}

/// One percentile (fio's key, e.g. "90.000000") of fio's completion
/// latency for `dir`, µs.
pub fn fio_clat_percentile(json: &serde_json::Value, dir: &str, p: &str) -> f64 {
    json["jobs"][0][dir]["clat_ns"]["percentile"][p]
        .as_f64()
        .unwrap_or_else(|| panic!("fio clat percentile {p}: {json}"))
        / 1000.0
}

/// fio's total latency for `dir` (submission and completion, `lat_ns`;
/// percentiles with `--lat_percentiles=1`): (mean, p50, p99) µs. A
/// request's block-layer life starts inside the submission call, so only
/// this holds all of it; clat misses that part.
pub fn fio_total_latency(json: &serde_json::Value, dir: &str) -> (f64, f64, f64) {
    fio_latency(
        &json["jobs"][0][dir]["lat_ns"],
        "lat (run fio with --lat_percentiles=1)",
    )
}

/// (mean, p50, p99) µs of one of fio's latency objects.
fn fio_latency(d: &serde_json::Value, what: &str) -> (f64, f64, f64) {
    let pct = |p: &str| {
        d["percentile"][p]
            .as_f64()
            .unwrap_or_else(|| panic!("fio {what} percentile {p}: {d}"))
            / 1000.0
    };
    let mean = d["mean"]
        .as_f64()
        .unwrap_or_else(|| panic!("fio {what} mean: {d}"))
        / 1000.0;
    (mean, pct("50.000000"), pct("99.000000"))
}

/// The rig's kernel and initramfs, and its fully written image.
pub fn rig_and_image() -> (xtask::guest::Rig, PathBuf) {
    let rig = xtask::guest::build().expect("rig build");
    let image = xtask::guest::dir().join("disk.img");
    xtask::guest::ensure_image(&image, 256).expect("rig image");
    (rig, image)
}

/// The whole disk under a file, as iospan names it.
pub fn host_disk_of(path: &Path) -> String {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(path).expect("stat").dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let sys = std::fs::canonicalize(format!("/sys/dev/block/{major}:{minor}"))
        .expect("the file's disk in /sys");
    let disk = if sys.join("partition").exists() {
        sys.parent().expect("a partition's disk").to_path_buf()
    } else {
        sys
    };
    disk.file_name()
        .expect("a disk name")
        .to_string_lossy()
        .into_owned()
}

/// A terminal for a full-screen program (xtask's session), each step
/// failing the test.
pub struct Tmux(xtask::tmux::Tmux);

impl Tmux {
    /// Starts `cmd` in a `width`×`height` terminal.
    pub fn start(cmd: &str, width: u16, height: u16) -> Self {
        Self(xtask::tmux::Tmux::start(cmd, width, height).unwrap_or_else(|e| panic!("{e:#}")))
    }

    pub fn screen(&self) -> String {
        self.0.screen().unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// Types each key (tmux key names: "Enter", "Escape", "m").
    pub fn keys(&self, keys: &[&str]) {
        self.0.keys(keys).unwrap_or_else(|e| panic!("{e:#}"));
    }

    /// Waits for the screen to satisfy `ok` (90 s at most): that screen.
    pub fn until(&self, what: &str, ok: impl Fn(&str) -> bool) -> String {
        self.0
            .until(what, std::time::Duration::from_secs(90), ok)
            .unwrap_or_else(|e| panic!("{e:#}"))
    }

    pub fn alive(&self) -> bool {
        self.0.alive()
    }
}

/// `curl` over https trusting `ca`: (status, body); status 0 when the
/// TLS handshake or connection failed.
pub fn curl_tls(url: &str, ca: &std::path::Path, token: Option<&str>) -> (u16, String) {
    let mut c = std::process::Command::new("curl");
    c.args(["-sS", "--max-time", "5", "-w", "\n%{http_code}", "--cacert"])
        .arg(ca)
        .arg(url);
    if let Some(t) = token {
        c.args(["-H", &format!("Authorization: Bearer {t}")]);
    }
    let out = run(&mut c);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// A CA and a server certificate it signed for 127.0.0.1 (P-256, two
/// days), made by openssl in `dir`: (ca.crt, NAME.crt, NAME.key).
pub fn test_ca(dir: &Path, name: &str) -> (PathBuf, PathBuf, PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n",
    )
    .unwrap();
    let (crt, key, csr) = (
        format!("{name}.crt"),
        format!("{name}.key"),
        format!("{name}.csr"),
    );
    for cmd in [
        vec![
            "req",
            "-x509",
            "-days",
            "2",
            "-subj",
            "/CN=iospan-test-ca",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
        ],
        vec![
            "req",
            "-subj",
            "/CN=iospan-test",
            "-keyout",
            &key,
            "-out",
            &csr,
        ],
        vec![
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
            "-out",
            &crt,
        ],
    ] {
        let mut c = std::process::Command::new("openssl");
        c.current_dir(dir).arg(cmd[0]);
        if cmd[0] == "req" {
            c.args(ec);
        }
        let made = run(c.args(&cmd[1..]));
        assert!(
            made.status.success(),
            "openssl {cmd:?}: {}",
            String::from_utf8_lossy(&made.stderr)
        );
    }
    (dir.join("ca.crt"), dir.join(crt), dir.join(key))
}

/// The helper VM of `native/kvm_vm.c` (a process named as QEMU, whose vCPU
/// kicks through KVM and whose engine reads a disk with io_uring), built
/// into `dir`.
pub fn kvm_vm(dir: &Path) -> PathBuf {
    build_as_qemu(dir, "kvm-vm", "kvm_vm.c", "-O1")
}

/// `native/SRC` built into `dir/SUBDIR` under the name QEMU's processes
/// have (iospan recognises VMs by their command).
fn build_as_qemu(dir: &Path, subdir: &str, src: &str, opt: &str) -> PathBuf {
    build_native(
        &dir.join(subdir),
        src,
        "qemu-system-x86_64",
        &[opt, "-rdynamic", "-pthread"],
    )
}

/// `native/SRC` built with `cc FLAGS` into `dir/NAME`.
pub fn build_native(dir: &Path, src: &str, name: &str, flags: &[&str]) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let exe = dir.join(name);
    let src = format!("{}/native/{src}", env!("CARGO_MANIFEST_DIR"));
    let out = run(Command::new("cc").args(flags).arg("-o").arg(&exe).arg(&src));
    assert!(
        out.status.success(),
        "building {src}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

/// The VM of `native/vm_load.c` (Q queues kicked through KVM, an io_uring
/// engine, event-driven or polling), built into `dir` under a name QEMU's
/// processes have.
pub fn vm_load(dir: &Path) -> PathBuf {
    build_as_qemu(dir, "vm-load", "vm_load.c", "-O2")
}

/// The helper VM's disk in `dir`: on a real disk (not tmpfs), fully
/// written, so O_DIRECT reads reach it.
pub fn kvm_image(dir: &Path) -> PathBuf {
    let image = dir.join("disk.img");
    if std::fs::metadata(&image).is_ok_and(|m| m.len() == 16 << 20) {
        return image;
    }
    let chunk: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8)
        .collect();
    // Written back before any VM reads it, as an image copied onto a host
    // is: an engine's O_DIRECT read of dirty pages writes them back first
    // (16 MB counted as the VM's writes), and in that burst the kernel
    // runs no program for a few of the reads' completions (counted as
    // unseen and undelivered: bursts of 4–22 in ~1 of 8 runs, none in
    // runs on a synced image; docs/lost.md).
    let mut f = std::fs::File::create(&image).unwrap();
    std::io::Write::write_all(&mut f, &chunk.repeat(16)).unwrap();
    f.sync_all().unwrap();
    image
}

/// An HTTP/1.1 response read whole: its status (0 if none) and body.
pub fn status_and_body(raw: &str) -> (u16, String) {
    let status = raw
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = raw
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

/// An agent configuration in `dir` tracing `host`, its API on `addr`, its
/// token file beside it: (configuration, token file).
pub fn agent_config(dir: &Path, host: &str, addr: &str) -> (PathBuf, PathBuf) {
    let conf = dir.join("iospan.toml");
    let token_file = dir.join("api-token");
    std::fs::write(
        &conf,
        format!(
            "[agent]\ndisks = [\"{host}\"]\n[api]\nlisten = \"{addr}\"\ntoken_file = \"{}\"\n",
            token_file.display()
        ),
    )
    .unwrap();
    (conf, token_file)
}

/// Files a test writes its run's reports to, in the temp directory
/// (`iospan-NAME-PID…`): removed when the test passes, kept for a look when
/// it fails (dropped while panicking); `IOSPAN_KEEP_REPORTS` keeps them
/// all.
pub struct Reports(Vec<PathBuf>);

impl Reports {
    /// Files `names` (each with the test process's id in it) in the temp
    /// directory.
    pub fn in_temp<S: AsRef<str>>(names: &[S]) -> Self {
        let dir = std::env::temp_dir();
        Self(names.iter().map(|n| dir.join(n.as_ref())).collect())
    }

    /// The `i`th of them.
    pub fn path(&self, i: usize) -> &Path {
        &self.0[i]
    }
}

impl Drop for Reports {
    fn drop(&mut self) {
        if std::thread::panicking() || std::env::var_os("IOSPAN_KEEP_REPORTS").is_some() {
            return;
        }
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A child process killed and reaped when dropped (an agent, a VM, a
/// tracer a test started).
pub struct Reap(pub std::process::Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What `iospan run` needs to split the rig's guests here. They run under
/// TCG, whose kicks the always-on tier sees only through fentry or kprobes
/// on eventfd_write; on a kernel with neither (this development machine's)
/// only the deep tier sees them.
/// The same for an API run of the agent service: its query's tier.
pub fn rig_split_query() -> &'static str {
    if rig_split_args().is_empty() {
        ""
    } else {
        "&tier=deep"
    }
}

pub fn rig_split_args() -> &'static [&'static str] {
    static ARGS: std::sync::OnceLock<&'static [&'static str]> = std::sync::OnceLock::new();
    ARGS.get_or_init(|| {
        let out = run(Command::new(iospan_bin()).args(["doctor", "--json"]));
        let d: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let works = |t: &str| {
            d["probes"]
                .as_array()
                .is_some_and(|ps| ps.iter().any(|p| p["probe"] == t && p["works"] == true))
        };
        if works("fentry") || works("kprobe") {
            &[]
        } else {
            &["--deep"]
        }
    })
}

/// A run's standard error, read as it comes: `attached` waits for its
/// first progress line (printed once its probes are attached, a second
/// into the run), `finish` collects the rest after the run ended.
pub struct RunStderr {
    lines: std::sync::mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl RunStderr {
    pub fn of(child: &mut std::process::Child) -> Self {
        use std::io::BufRead;
        let err = child.stderr.take().expect("the run's stderr piped");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // Read to the end even when nobody listens: a full pipe would
            // stall the run.
            for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Self {
            lines,
            seen: Vec::new(),
        }
    }

    /// Blocks until the run shows progress (its probes attached), or
    /// panics with what it printed instead.
    pub fn attached(&mut self, within: std::time::Duration) {
        let t = std::time::Instant::now();
        while let Some(left) = within.checked_sub(t.elapsed()) {
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    let progress = l.trim_start().starts_with("iospan:");
                    self.seen.push(l);
                    if progress {
                        return;
                    }
                }
                Err(_) => break,
            }
        }
        panic!(
            "the run showed no progress within {within:?}: {}",
            self.seen.join("\n")
        );
    }

    /// Everything it printed, once it has exited.
    pub fn finish(mut self) -> String {
        self.seen.extend(self.lines.iter());
        self.seen.join("\n")
    }
}

/// A run's host-window requests counted unsplit, by cause: the report's
/// `lost.host_split` (docs/lost.md). `polled` is apart: an iothread's
/// poll finding a request is the engine's design, not a miss.
pub struct Unsplit {
    /// No kick, no signal, unordered or not followed.
    pub counted: u64,
    pub polled: u64,
}

pub fn unsplit(rep: &serde_json::Value) -> Unsplit {
    let split = &rep["lost"]["host_split"];
    let n = |k: &str| {
        split[k]
            .as_u64()
            .unwrap_or_else(|| panic!("lost.host_split.{k} in {split}"))
    };
    Unsplit {
        counted: ["no_kick", "no_signal", "unordered", "not_followed"]
            .iter()
            .map(|k| n(k))
            .sum(),
        polled: n("polled"),
    }
}
