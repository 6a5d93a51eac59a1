//! The guest channel: frames from `iospan agent --guest` to the host agent,
//! over a virtio-serial port (no guest networking needed) or TCP.
//!
//! ```text
//!  magic "IOSP" | version u16 | kind u16 | seq u64 | len u32 | payload (len bytes)
//! ```
//!
//! All integers little-endian. `seq` counts the sender's frames from 0 since
//! it started, so a receiver counts frames lost in between (and sees a
//! restart as `seq` going back). Kinds: `HELLO` (JSON: who the guest is and
//! its disks, sent at start and every few seconds so a receiver joining
//! late learns them), `RECORDS` (whole `GuestIoEvent`s back to back),
//! `STATS` (JSON: the sender's own losses).

use serde::{Deserialize, Serialize};

use crate::abi::GuestIoEvent;

pub const MAGIC: [u8; 4] = *b"IOSP";
pub const VERSION: u16 = 2;
pub const HEADER_LEN: usize = 4 + 2 + 2 + 8 + 4;
/// Frames above this are refused: a corrupt length must not make the
/// receiver allocate without bound.
pub const MAX_PAYLOAD: usize = 1 << 20;

pub const HELLO: u16 = 1;
pub const RECORDS: u16 = 2;
pub const STATS: u16 = 3;

/// The name of the virtio-serial port the guest agent writes to.
pub const PORT_NAME: &str = "org.iospan.0";

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    /// The guest kernel's boot id: a new one means the guest rebooted.
    pub boot_id: String,
    pub kernel: String,
    pub disks: Vec<GuestDisk>,
    /// What the guest kernel let the agent see: "kick and completion
    /// probes" or why not.
    pub probes: String,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GuestDisk {
    /// major << 20 | minor, as in the records.
    pub dev: u32,
    pub name: String,
    /// The device's serial (virtio-blk `serial=`, NVMe serial), to match it
    /// to the host's virtual disk.
    pub serial: Option<String>,
}

/// The sender's own losses, cumulative since it started.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SenderStats {
    /// Records the guest's ring buffer had no room for.
    pub ring_lost: u64,
    /// Requests the guest's in-flight table had no room for.
    pub inflight_lost: u64,
    /// Records dropped because the channel stayed blocked (no host agent)
    /// and the send queue was full.
    pub dropped_records: u64,
    pub sent_records: u64,
    /// Requests whose completion no system call was seen handing back
    /// (their guest segment ends at the block layer's completion).
    #[serde(default)]
    pub unreaped: u64,
    /// Requests no I/O system call submitted (the guest kernel's own).
    #[serde(default)]
    pub no_syscall: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Frame {
    Hello(Hello),
    Records(Vec<GuestIoEvent>),
    Stats(SenderStats),
}

pub fn encode(seq: u64, frame: &Frame) -> Vec<u8> {
    let (kind, payload) = match frame {
        Frame::Hello(h) => (HELLO, serde_json::to_vec(h).unwrap_or_default()),
        Frame::Records(r) => (RECORDS, r.iter().flat_map(|e| e.to_bytes()).collect()),
        Frame::Stats(s) => (STATS, serde_json::to_vec(s).unwrap_or_default()),
    };
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&kind.to_le_bytes());
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&payload);
    out
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DecodeError {
    #[error("bad magic: not an iospan guest channel")]
    Magic,
    #[error("frame version {0}, this agent speaks {VERSION}: upgrade the older side")]
    Version(u16),
    #[error("frame of {0} bytes, above the {MAX_PAYLOAD}-byte limit")]
    TooLong(usize),
    #[error("malformed {what} frame: {why}")]
    Payload { what: &'static str, why: String },
}

/// Reassembles frames from a byte stream read in arbitrary pieces.
#[derive(Default)]
pub struct FrameReader {
    buf: Vec<u8>,
    /// The next `seq` expected, and frames found missing.
    next_seq: Option<u64>,
    pub lost_frames: u64,
    pub restarts: u64,
}

impl FrameReader {
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole frame, if buffered. After an error the stream is out
    /// of step: the caller drops the connection (and with it the buffer).
    pub fn next_frame(&mut self) -> Result<Option<Frame>, DecodeError> {
        if self.buf.len() < HEADER_LEN {
            return Ok(None);
        }
        if self.buf[..4] != MAGIC {
            return Err(DecodeError::Magic);
        }
        let u16_at = |i: usize| u16::from_le_bytes([self.buf[i], self.buf[i + 1]]);
        let version = u16_at(4);
        if version != VERSION {
            return Err(DecodeError::Version(version));
        }
        let kind = u16_at(6);
        let seq = u64::from_le_bytes(self.buf[8..16].try_into().unwrap_or_default());
        let len = u32::from_le_bytes(self.buf[16..20].try_into().unwrap_or_default()) as usize;
        if len > MAX_PAYLOAD {
            return Err(DecodeError::TooLong(len));
        }
        if self.buf.len() < HEADER_LEN + len {
            return Ok(None);
        }
        let payload: Vec<u8> = self
            .buf
            .drain(..HEADER_LEN + len)
            .skip(HEADER_LEN)
            .collect();
        match self.next_seq {
            Some(n) if seq > n => self.lost_frames += seq - n,
            Some(n) if seq < n => self.restarts += 1,
            _ => {}
        }
        self.next_seq = Some(seq + 1);
        let bad = |what, why: String| DecodeError::Payload { what, why };
        let frame = match kind {
            HELLO => Frame::Hello(
                serde_json::from_slice(&payload).map_err(|e| bad("hello", e.to_string()))?,
            ),
            STATS => Frame::Stats(
                serde_json::from_slice(&payload).map_err(|e| bad("stats", e.to_string()))?,
            ),
            RECORDS => {
                if !payload.len().is_multiple_of(GuestIoEvent::SIZE) {
                    return Err(bad(
                        "records",
                        format!("{} bytes is not whole records", payload.len()),
                    ));
                }
                Frame::Records(
                    payload
                        .chunks_exact(GuestIoEvent::SIZE)
                        // SAFETY: exact size; every bit pattern is a valid record.
                        .map(|c| unsafe {
                            std::ptr::read_unaligned(c.as_ptr().cast::<GuestIoEvent>())
                        })
                        .collect(),
                )
            }
            // A newer sender's frame kind: skipped, the stream stays in step.
            _ => return self.next_frame(),
        };
        Ok(Some(frame))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(sector: u64) -> GuestIoEvent {
        GuestIoEvent {
            kind: crate::abi::EVENT_GUEST_IO,
            sector,
            bytes: 4096,
            done_ns: 7,
            ..Default::default()
        }
    }

    #[test]
    fn frames_survive_any_split_of_the_stream() {
        let hello = Frame::Hello(Hello {
            boot_id: "b".into(),
            kernel: "k".into(),
            disks: vec![],
            probes: "p".into(),
        });
        let recs = Frame::Records(vec![rec(8), rec(16)]);
        let stats = Frame::Stats(SenderStats {
            dropped_records: 3,
            ..Default::default()
        });
        let bytes: Vec<u8> = [encode(0, &hello), encode(1, &recs), encode(2, &stats)].concat();
        for step in [1, 7, 20, bytes.len()] {
            let mut r = FrameReader::default();
            let mut got = Vec::new();
            for piece in bytes.chunks(step) {
                r.push(piece);
                while let Some(f) = r.next_frame().unwrap() {
                    got.push(f);
                }
            }
            assert_eq!(
                got,
                vec![hello.clone(), recs.clone(), stats.clone()],
                "pieces of {step}"
            );
            assert_eq!((r.lost_frames, r.restarts), (0, 0));
        }
    }

    #[test]
    fn gaps_and_restarts_are_counted() {
        let mut r = FrameReader::default();
        for seq in [0, 1, 5, 6, 0, 1] {
            r.push(&encode(seq, &Frame::Records(vec![rec(seq)])));
            assert!(r.next_frame().unwrap().is_some());
        }
        assert_eq!((r.lost_frames, r.restarts), (3, 1));
    }

    #[test]
    fn garbage_and_oversize_frames_are_refused() {
        let mut r = FrameReader::default();
        r.push(b"GET / HTTP/1.1\r\n\r\n....");
        assert_eq!(r.next_frame(), Err(DecodeError::Magic));
        let mut f = encode(0, &Frame::Records(vec![rec(1)]));
        f[16..20].copy_from_slice(&(u32::MAX).to_le_bytes());
        let mut r = FrameReader::default();
        r.push(&f);
        assert!(matches!(r.next_frame(), Err(DecodeError::TooLong(_))));
        let mut f = encode(0, &Frame::Records(vec![rec(1)]));
        f[4] = 9;
        let mut r = FrameReader::default();
        r.push(&f);
        assert_eq!(r.next_frame(), Err(DecodeError::Version(9)));
    }

    #[test]
    fn unknown_kinds_are_skipped_in_step() {
        let mut unknown = encode(0, &Frame::Stats(SenderStats::default()));
        unknown[6..8].copy_from_slice(&99u16.to_le_bytes());
        let mut r = FrameReader::default();
        r.push(&unknown);
        r.push(&encode(1, &Frame::Records(vec![rec(3)])));
        assert_eq!(r.next_frame().unwrap(), Some(Frame::Records(vec![rec(3)])));
    }
}
