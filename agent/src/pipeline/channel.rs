//! The host end of a VM's guest channel: connects to the unix socket of
//! QEMU's chardev, reads the guest agent's frames, and hands guest records
//! to the stitcher. Reconnects while the run lasts (the guest agent or the
//! VM may restart), counts what is lost on the way.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{io::AsyncReadExt, net::UnixStream, sync::watch};

use crate::model::ChannelStats;
use crate::{
    discover::vms::{channel_socket, Registry, SocketSource},
    pipeline::correlate::Correlator,
    pipeline::transport::{encode_control, Control, Frame, FrameReader, Hello},
};

const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Follows the channel until `stop`, then reads what is already there.
/// Each connection goes to the listening socket the VM's process `pid`
/// holds for the chardev (`vms::channel_socket`), found anew each time:
/// never to a path only its command line names. Attempts back off from
/// 200 ms to 5 s while nothing answers.
pub async fn follow(
    vm: u32,
    pid: u32,
    src: SocketSource,
    known: Arc<Mutex<Registry>>,
    correlator: Arc<Mutex<Correlator>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 1 << 16];
    // One sequence across reconnections: resent frames are not counted twice.
    let mut reader = FrameReader::default();
    let mut warned = RateLimited::new();
    correlator
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .stitch
        .expect_guest(vm);
    let mut backoff = BACKOFF_MIN;
    loop {
        if *stop.borrow() {
            return;
        }
        let found = channel_socket(pid, &src);
        let stream = match &found {
            Some(path) => UnixStream::connect(path).await.ok(),
            None => None,
        };
        let (Some(stream), Some(path)) = (stream, found) else {
            // QEMU not listening yet, or gone: try again, less often.
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {
                    backoff = backoff.saturating_mul(2).min(BACKOFF_MAX);
                    continue;
                }
                _ = stop.changed() => return,
            }
        };
        let connected = tokio::time::Instant::now();
        with_stats(&correlator, vm, |s| {
            s.connections = s.connections.saturating_add(1)
        });
        let (mut rd, wr) = stream.into_split();
        // Whatever the guest agent wrote that nobody acknowledged (a host
        // agent before this one, a broken connection) comes again.
        let mut owe_resend = true;
        reader.new_stream();
        let mut stopping: Option<tokio::time::Instant> = None;
        loop {
            if owe_resend {
                owe_resend = !send_control(&wr, Control::Resend);
            }
            let n = if let Some(until) = stopping {
                // Stopping: what the guest agent sent up to now (it drains
                // every 100 ms), not what it goes on sending.
                match tokio::time::timeout_at(until, rd.read(&mut buf)).await {
                    Ok(Ok(n)) => n,
                    _ => 0,
                }
            } else {
                tokio::select! {
                    r = rd.read(&mut buf) => r.unwrap_or(0),
                    _ = stop.changed() => {
                        let now = tokio::time::Instant::now();
                        stopping = Some(now.checked_add(Duration::from_millis(300)).unwrap_or(now));
                        continue;
                    }
                }
            };
            if n == 0 {
                break;
            }
            reader.push(buf.get(..n).unwrap_or_default());
            take_frames(vm, &mut reader, &mut warned, &path, &known, &correlator);
            // Handled: the guest agent may forget them. (Again after each
            // read: frames resent after a crossing acknowledgement are
            // acknowledged anew.)
            if let Some(a) = reader.ack() {
                send_control(&wr, a);
            }
            with_stats(&correlator, vm, |s| {
                s.lost_frames = reader.lost_frames;
                s.sender_restarts = reader.restarts;
                s.resent_duplicates = reader.duplicates;
            });
        }
        if stopping.is_some() {
            return;
        }
        // A connection that closes at once is not retried at once.
        if connected.elapsed() >= Duration::from_secs(1) {
            backoff = BACKOFF_MIN;
        } else {
            tokio::select! {
                _ = tokio::time::sleep(backoff) => backoff = backoff.saturating_mul(2).min(BACKOFF_MAX),
                _ = stop.changed() => return,
            }
        }
    }
}

/// Handles every whole frame read so far; a malformed one is skipped
/// (the reader finds the next frame's start) and counted.
fn take_frames(
    vm: u32,
    reader: &mut FrameReader,
    warned: &mut RateLimited,
    path: &std::path::Path,
    known: &Mutex<Registry>,
    correlator: &Mutex<Correlator>,
) {
    loop {
        match reader.next_frame() {
            Ok(Some(frame)) => handle(vm, frame, known, correlator),
            Ok(None) => break,
            Err(e) => {
                // The reader skipped to the next frame's start. The
                // guest decides how many: logged at most once per
                // interval, with how many were not.
                if let Some(quiet) = warned.due() {
                    log::warn!(
                        "VM slot {vm}: guest channel {}: {e}{}",
                        path.display(),
                        if quiet > 0 {
                            format!(" ({quiet} more malformed frames not logged)")
                        } else {
                            String::new()
                        }
                    );
                }
                with_stats(correlator, vm, |s| {
                    s.decode_errors = s.decode_errors.saturating_add(1)
                });
            }
        }
    }
}

/// A log line a guest can provoke: the first at once, then at most one per
/// `LOG_EVERY`, each saying how many were held back.
#[derive(Default)]
pub struct RateLimited {
    last: Option<std::time::Instant>,
    held: u64,
}

const LOG_EVERY: Duration = Duration::from_secs(10);

impl RateLimited {
    pub const fn new() -> Self {
        Self {
            last: None,
            held: 0,
        }
    }

    /// Some(lines held back since the last one) when a line is due now.
    pub fn due(&mut self) -> Option<u64> {
        let now = std::time::Instant::now();
        match self.last {
            Some(t) if now.duration_since(t) < LOG_EVERY => {
                self.held = self.held.saturating_add(1);
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.held))
            }
        }
    }
}

/// Sends a control message if the socket takes it now (an acknowledgement
/// not taken is carried by the next one).
fn send_control(wr: &tokio::net::unix::OwnedWriteHalf, c: Control) -> bool {
    let msg = encode_control(c);
    matches!(wr.try_write(&msg), Ok(n) if n == msg.len())
}

fn with_stats(correlator: &Mutex<Correlator>, vm: u32, f: impl FnOnce(&mut ChannelStats)) {
    let mut c = correlator.lock().unwrap_or_else(|p| p.into_inner());
    f(c.stitch.channels.entry(vm).or_default());
}

fn handle(vm: u32, frame: Frame, known: &Mutex<Registry>, correlator: &Mutex<Correlator>) {
    match frame {
        Frame::Hello(h) => {
            let (map, queues): (Vec<_>, Vec<_>) = {
                let known = known.lock().unwrap_or_else(|p| p.into_inner());
                let map = disk_map(vm, &h, &known);
                log::debug!(
                    "VM slot {vm}: guest disks {:?} mapped {map:?}",
                    h.disks
                        .iter()
                        .map(|d| (&d.name, d.dev, &d.serial))
                        .collect::<Vec<_>>()
                );
                let queues = map.iter().map(|&(_, v)| known.vdisk_queues(v)).collect();
                (map, queues)
            };
            let mut c = correlator.lock().unwrap_or_else(|p| p.into_inner());
            for ((dev, vdisk), queues) in map.into_iter().zip(queues) {
                c.stitch.map_disk(vm, dev, vdisk);
                if let Some(n) = queues {
                    c.stitch.set_queues(vm, vdisk, n);
                }
            }
            let s = c.stitch.channels.entry(vm).or_default();
            s.guest_probes = Some(h.probes);
            s.guest_kernel = Some(h.kernel);
        }
        Frame::Records(recs) => {
            let mut c = correlator.lock().unwrap_or_else(|p| p.into_inner());
            let stats = c.stitch.channels.entry(vm).or_default();
            stats.records = stats.records.saturating_add(recs.len() as u64);
            for r in recs {
                c.stitch.on_guest(vm, r);
            }
        }
        Frame::Stats(s) => with_stats(correlator, vm, |c| c.sender = s),
    }
}

/// Guest disk → virtual disk slot: by serial where the VM gives its disks
/// one; otherwise a VM with a single virtual disk and a guest with a single
/// disk are each other's.
fn disk_map(vm: u32, hello: &Hello, known: &Registry) -> Vec<(u32, u32)> {
    let Some(v) = known.vms.get(&vm) else {
        return Vec::new();
    };
    let slots: Vec<(u32, &str)> = known
        .vdisks
        .iter()
        .filter(|(_, (owner, _))| *owner == vm)
        .map(|(slot, (_, id))| (*slot, id.as_str()))
        .collect();
    let mut out = Vec::new();
    for d in &hello.disks {
        let Some(serial) = &d.serial else { continue };
        if let Some((id, _)) = v.serials.iter().find(|(_, s)| s == serial) {
            if let Some((slot, _)) = slots.iter().find(|(_, i)| i == id) {
                out.push((d.dev, *slot));
            }
        }
    }
    // A disk seen as several: an NVMe namespace a subsystem shares is a
    // multipath head (nvme0n1) whose requests run on its paths (nvme0c0n1).
    let real: Vec<_> = hello
        .disks
        .iter()
        .filter(|d| {
            !["loop", "ram", "zram", "sr", "dm-", "md", "nbd"]
                .iter()
                .any(|p| d.name.starts_with(p))
        })
        .collect();
    let heads: Vec<_> = real
        .iter()
        .filter(|d| nvme_head_of(&d.name).is_none())
        .collect();
    if let ([only], [_], true) = (slots.as_slice(), heads.as_slice(), out.is_empty()) {
        out.extend(real.iter().map(|d| (d.dev, only.0)));
    }
    // A head's paths are its disk.
    let paths: Vec<(u32, u32)> = real
        .iter()
        .filter_map(|p| {
            let head = nvme_head_of(&p.name)?;
            let head_dev = real.iter().find(|d| d.name == head)?.dev;
            let slot = out.iter().find(|(dev, _)| *dev == head_dev)?.1;
            Some((p.dev, slot))
        })
        .collect();
    for m in paths {
        if !out.contains(&m) {
            out.push(m);
        }
    }
    out
}

/// The multipath head of an NVMe path device: nvme0c1n2 is a path of
/// nvme0n2.
fn nvme_head_of(name: &str) -> Option<String> {
    let rest = name.strip_prefix("nvme")?;
    let (subsys, rest) = rest.split_once('c')?;
    let (ctrl, ns) = rest.split_once('n')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (digits(subsys) && digits(ctrl) && digits(ns)).then(|| format!("nvme{subsys}n{ns}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_nvme_path_names_its_head() {
        assert_eq!(nvme_head_of("nvme0c0n1").as_deref(), Some("nvme0n1"));
        assert_eq!(nvme_head_of("nvme12c3n45").as_deref(), Some("nvme12n45"));
        for not_a_path in [
            "nvme0n1",
            "nvme0n1p1",
            "nvmec0n1",
            "nvme0c0n",
            "vda",
            "nvme0c0n1p2",
        ] {
            assert_eq!(nvme_head_of(not_a_path), None, "{not_a_path}");
        }
    }

    #[test]
    fn a_guests_malformed_frames_are_logged_once_per_interval_with_a_count() {
        let mut w = RateLimited::new();
        assert_eq!(w.due(), Some(0), "the first at once");
        for _ in 0..16_378 {
            assert_eq!(w.due(), None);
        }
        w.last = w.last.map(|t| t - LOG_EVERY);
        assert_eq!(
            w.due(),
            Some(16_378),
            "then one line with what was held back"
        );
        assert_eq!(w.due(), None);
    }
}
