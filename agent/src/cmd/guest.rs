//! `iospan agent --guest`: inside a VM, each request's guest-side stamps,
//! sent to the host agent over the guest channel (see `transport`).
//!
//! Nothing here may block the guest's I/O or grow without bound: the port
//! is written without blocking, frames wait in a bounded queue while the
//! host side is absent, and what the queue cannot hold is dropped and
//! counted (sent in the next `STATS` frame). Written frames are kept until
//! the host agent acknowledges them and sent again to a host agent that
//! (re)connects, so a host agent's restart loses nothing.

use std::{
    collections::VecDeque,
    io::{Read, Write},
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::{
    abi::{GuestIoEvent, Record},
    model::SenderStats,
    pipeline::reap::{self, Reaper},
    pipeline::transport::{self, Control, ControlReader, Frame, GuestDisk, Hello},
    probes::guest::GuestProbes,
};

pub struct GuestOptions {
    /// The virtio-serial port; found by name when not given.
    pub port: Option<PathBuf>,
    /// TCP fallback: host:port of a listening host agent.
    pub connect: Option<String>,
    /// Written once the probes are attached (for scripts that must not
    /// start their workload before).
    pub ready_file: Option<PathBuf>,
    /// Run as SCHED_IDLE: a guest's workload is never preempted by the
    /// agent (a wake-up of the agent between a benchmark's clock read and
    /// its system call would be the benchmark's latency, not its I/O's).
    pub idle_priority: bool,
}

/// Bytes of frames kept while the channel is blocked.
const QUEUE_BYTES: usize = 8 << 20;
const HELLO_EVERY: Duration = Duration::from_secs(1);
const DRAIN_EVERY: Duration = Duration::from_millis(100);
const STATS_EVERY: Duration = Duration::from_secs(1);
/// How long a stopping agent keeps trying to deliver what it holds.
const FLUSH_FOR: Duration = Duration::from_secs(3);

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

enum Channel {
    Port(std::fs::File),
    Tcp(std::net::TcpStream),
}

impl Channel {
    fn write_some(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Channel::Port(f) => f.write(buf),
            Channel::Tcp(s) => s.write(buf),
        }
    }

    /// All the host agent sent back, without waiting (empty: nothing, or
    /// no host agent on the other end). All, not one read: the port hands
    /// over one host write per read, and the host acknowledges after each
    /// of its reads, so a read per round would fall ever further behind
    /// and see ever older acknowledgements.
    fn read_now(&mut self, buf: &mut [u8]) -> Vec<u8> {
        let mut out = Vec::new();
        while out.len() < READ_NOW_MAX {
            let r = match self {
                Channel::Port(f) => f.read(buf),
                Channel::Tcp(s) => s.read(buf),
            };
            match r {
                Ok(n) if n > 0 => out.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                _ => break,
            }
        }
        out
    }
}

/// Bytes of control messages taken per round (thousands of
/// acknowledgements: the channel never sends as many in 100 ms).
const READ_NOW_MAX: usize = 256 << 10;

/// One encoded frame and the records in it.
struct Queued {
    seq: u64,
    bytes: Vec<u8>,
    records: usize,
}

/// Frames waiting to be written (the front may be half written) and frames
/// written but not yet acknowledged, bounded together.
struct SendQueue {
    sender: u32,
    pending: VecDeque<Queued>,
    /// Bytes of the front pending frame already written.
    front_written: usize,
    unacked: VecDeque<Queued>,
    bytes: usize,
    seq: u64,
    stats: SenderStats,
}

impl SendQueue {
    fn new(sender: u32) -> Self {
        Self {
            sender,
            pending: VecDeque::new(),
            front_written: 0,
            unacked: VecDeque::new(),
            bytes: 0,
            seq: 0,
            stats: SenderStats::default(),
        }
    }

    fn push(&mut self, frame: &Frame) {
        let bytes = transport::encode(self.sender, self.seq, frame);
        if let Frame::Records(r) = frame {
            self.stats.sent_records += r.len() as u64;
        }
        self.bytes += bytes.len();
        self.pending.push_back(Queued {
            seq: self.seq,
            bytes,
            records: records_in(frame),
        });
        self.seq += 1;
        // For room: first what was written and never confirmed, then the
        // oldest waiting (never the half-written front: the stream must
        // stay in step).
        while self.bytes > QUEUE_BYTES {
            let (q, confirmed_never) = if let Some(q) = self.unacked.pop_front() {
                (q, true)
            } else if self.pending.len() > 1 {
                let at = usize::from(self.front_written > 0);
                match self.pending.remove(at) {
                    Some(q) => (q, false),
                    None => break,
                }
            } else {
                break;
            };
            self.bytes -= q.bytes.len();
            if confirmed_never {
                self.stats.unconfirmed_records += q.records as u64;
            } else {
                self.stats.dropped_records += q.records as u64;
                self.stats.sent_records -= q.records as u64;
            }
        }
    }

    /// Writes what the channel takes now. Err only for a broken channel.
    fn flush(&mut self, ch: &mut Channel) -> std::io::Result<()> {
        while let Some(front) = self.pending.front() {
            match ch.write_some(&front.bytes[self.front_written..]) {
                Ok(0) => return Ok(()),
                Ok(n) => {
                    self.front_written += n;
                    if self.front_written == front.bytes.len() {
                        self.front_written = 0;
                        if let Some(q) = self.pending.pop_front() {
                            self.unacked.push_back(q);
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn on_control(&mut self, c: Control) {
        match c {
            // Another sender's (this guest's agent before a restart or
            // reboot, on a connection that outlived it).
            Control::Ack { sender, .. } if sender != self.sender => {}
            Control::Ack { first, next, .. } => {
                let had = |q: &Queued| q.seq >= first && q.seq < next;
                // Written while nobody listened: the receiver never had them.
                let mut again = Vec::new();
                for q in std::mem::take(&mut self.unacked) {
                    if had(&q) {
                        self.bytes -= q.bytes.len();
                    } else if q.seq < first {
                        again.push(q);
                    } else {
                        self.unacked.push_back(q);
                    }
                }
                // Queued again by a resend request that crossed this
                // acknowledgement (a half-written front stays: the stream
                // must stay in step; the receiver skips it).
                let keep_front = usize::from(self.front_written > 0);
                let mut i = keep_front;
                while i < self.pending.len() {
                    if had(&self.pending[i]) {
                        if let Some(q) = self.pending.remove(i) {
                            self.bytes -= q.bytes.len();
                        }
                    } else {
                        i += 1;
                    }
                }
                for q in again.into_iter().rev() {
                    self.pending.insert(keep_front, q);
                }
            }
            Control::Resend => {
                // A new receiver starts at a frame's start: a half-written
                // front is written again whole (the receiver skips to the
                // next magic past the tail it may get of the old one).
                self.front_written = 0;
                while let Some(q) = self.unacked.pop_back() {
                    self.pending.push_front(q);
                }
            }
        }
    }

    /// Records not known to have reached a host agent.
    fn undelivered(&self) -> usize {
        self.pending
            .iter()
            .chain(&self.unacked)
            .map(|q| q.records)
            .sum()
    }
}

/// A number telling this run of the agent from any other (its frames'
/// `sender`): the kernel's random source, else time and pid.
fn sender_id() -> u32 {
    let mut b = [0u8; 4];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok()
    {
        return u32::from_le_bytes(b);
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    t ^ std::process::id().rotate_left(16)
}

fn records_in(frame: &Frame) -> usize {
    match frame {
        Frame::Records(r) => r.len(),
        _ => 0,
    }
}

/// The virtio-serial port named `transport::PORT_NAME`, as the guest
/// kernel numbered it.
pub fn find_port() -> Option<PathBuf> {
    let by_name = Path::new("/dev/virtio-ports").join(transport::PORT_NAME);
    if by_name.exists() {
        return Some(by_name);
    }
    std::fs::read_dir("/sys/class/virtio-ports")
        .ok()?
        .flatten()
        .find_map(|e| {
            let name = std::fs::read_to_string(e.path().join("name")).ok()?;
            (name.trim() == transport::PORT_NAME).then(|| Path::new("/dev").join(e.file_name()))
        })
}

fn open_channel(opts: &GuestOptions) -> Result<Channel> {
    if let Some(addr) = &opts.connect {
        let s = std::net::TcpStream::connect(addr)
            .with_context(|| format!("connecting to the host agent at {addr}"))?;
        s.set_nonblocking(true)?;
        return Ok(Channel::Tcp(s));
    }
    let port = match &opts.port {
        Some(p) => p.clone(),
        None => find_port().with_context(|| {
            format!(
                "no virtio-serial port named {}: give the VM `-device virtio-serial-pci -chardev socket,id=iospan,path=PATH,server=on,wait=off \
                 -device virtserialport,chardev=iospan,name={}` (or pass --port / --connect)",
                transport::PORT_NAME,
                transport::PORT_NAME
            )
        })?,
    };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&port)
        .with_context(|| format!("opening the guest channel {}", port.display()))?;
    Ok(Channel::Port(f))
}

fn hello(coverage: &str) -> Hello {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    let disks = std::fs::read_dir("/sys/block")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let dev = read(&format!("/sys/block/{name}/dev"));
                    let (maj, min) = dev.split_once(':')?;
                    let dev = (maj.parse::<u32>().ok()? << 20) | min.parse::<u32>().ok()?;
                    let serial = [
                        format!("/sys/block/{name}/serial"),
                        format!("/sys/block/{name}/device/serial"),
                    ]
                    .iter()
                    .map(|p| read(p))
                    .find(|s| !s.is_empty());
                    Some(GuestDisk { dev, name, serial })
                })
                .collect()
        })
        .unwrap_or_default();
    Hello {
        boot_id: read("/proc/sys/kernel/random/boot_id"),
        kernel: read("/proc/sys/kernel/osrelease"),
        disks,
        probes: coverage.to_string(),
    }
}

/// SCHED_IDLE: the agent runs only when the guest has nothing else to.
fn run_when_idle() {
    // SAFETY: sched_param is plain integers (musl adds fields glibc
    // lacks): zeroed is priority 0, the only one SCHED_IDLE takes.
    let param: libc::sched_param = unsafe { std::mem::zeroed() };
    // The system call itself: musl's sched_setscheduler() is a stub
    // that always fails with ENOSYS.
    // SAFETY: a valid sched_param for this thread (pid 0 = caller).
    if unsafe {
        libc::syscall(
            libc::SYS_sched_setscheduler,
            0,
            libc::SCHED_IDLE,
            &param as *const libc::sched_param,
        )
    } != 0
    {
        log::warn!(
            "could not run as SCHED_IDLE ({}): the agent may delay the guest's work",
            std::io::Error::last_os_error()
        );
    }
}

pub fn run(opts: &GuestOptions) -> Result<()> {
    if opts.port.is_some() && opts.connect.is_some() {
        bail!("--port and --connect both given: the guest channel is one or the other");
    }
    let mut probes = GuestProbes::load().context("the guest probes")?;
    let mut ring = probes.take_events()?;
    let mut ch = open_channel(opts)?;
    if opts.idle_priority {
        run_when_idle();
    }
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    eprintln!("iospan: guest agent: {}", probes.coverage);
    if let Some(f) = &opts.ready_file {
        std::fs::write(f, b"ready\n")
            .with_context(|| format!("writing --ready-file {}", f.display()))?;
    }
    let mut q = SendQueue::new(sender_id());
    let mut control = ControlReader::default();
    let mut inbox = vec![0u8; 4096];
    let mut reaper = Reaper::default();
    let mut last_hello: Option<Instant> = None;
    let mut last_stats = Instant::now();
    let mut stop_at: Option<Instant> = None;
    loop {
        let stopping_now = STOP.load(Ordering::Relaxed) && stop_at.is_none();
        if stopping_now {
            stop_at = Some(Instant::now() + FLUSH_FOR);
        }
        // Records are submitted without wake-ups: drain on a timer.
        std::thread::sleep(DRAIN_EVERY);
        let mut batch: Vec<GuestIoEvent> = Vec::new();
        let _ = ring.drain(|item| {
            match Record::from_bytes(item) {
                Some(Record::GuestIo(ev)) => reaper.on_io(ev, &mut batch),
                Some(Record::GuestReap(r)) => reaper.on_reap(r, &mut batch),
                _ => {}
            }
            Ok::<(), std::convert::Infallible>(())
        });
        if stop_at.is_some() {
            reaper.flush(&mut batch);
        } else {
            reaper.expire(reap::monotonic_ns(), &mut batch);
        }
        // (The first always: an agent stopped within its first drain still
        // says who it is.)
        if last_hello.is_none()
            || (stop_at.is_none() && last_hello.is_some_and(|t| t.elapsed() >= HELLO_EVERY))
        {
            q.push(&Frame::Hello(hello(&probes.coverage)));
            last_hello = Some(Instant::now());
        }
        // Frames of at most ~64 KiB: the port's buffers stay small.
        for chunk in batch.chunks(1024) {
            q.push(&Frame::Records(chunk.to_vec()));
        }
        // Stopping: the final account once, and again only after records
        // (so the queue can run empty and the agent exit once all is
        // acknowledged).
        let final_account = stopping_now || (stop_at.is_some() && !batch.is_empty());
        if last_stats.elapsed() >= STATS_EVERY || final_account {
            let (ring_lost, inflight_lost) = probes.lost();
            q.stats.ring_lost = ring_lost;
            q.stats.inflight_lost = inflight_lost;
            q.stats.unreaped = reaper.stats.unreaped;
            q.stats.no_syscall = reaper.stats.no_syscall;
            let stats = q.stats.clone();
            q.push(&Frame::Stats(stats));
            last_stats = Instant::now();
        }
        for c in control.push(&ch.read_now(&mut inbox)) {
            q.on_control(c);
        }
        if let Err(e) = q.flush(&mut ch) {
            // The host side went away (TCP): reconnect on the next round.
            log::warn!("guest channel: {e}; reconnecting");
            std::thread::sleep(Duration::from_millis(200));
            if let Ok(c) = open_channel(opts) {
                ch = c;
            }
        }
        if let Some(t) = stop_at {
            if (q.pending.is_empty() && q.unacked.is_empty()) || Instant::now() >= t {
                let undelivered = q.undelivered();
                eprintln!(
                    "iospan: guest agent: {} records sent, {} dropped, {} unconfirmed, {} undelivered at exit",
                    q.stats.sent_records - undelivered as u64,
                    q.stats.dropped_records,
                    q.stats.unconfirmed_records,
                    undelivered
                );
                return Ok(());
            }
        }
    }
}
