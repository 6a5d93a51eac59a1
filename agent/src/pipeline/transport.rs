//! The guest channel: frames from `iospan agent --guest` to the host agent,
//! over a virtio-serial port (no guest networking needed) or TCP.
//!
//! ```text
//!  magic "IOSP" | version u16 | kind u16 | sender u32 | seq u64 | len u32 | payload (len bytes)
//! ```
//!
//! All integers little-endian. `sender` is chosen at random when the guest
//! agent starts (a new one: the agent restarted or the guest rebooted);
//! `seq` counts its frames from 0, so a receiver counts frames lost in
//! between. The other way, the host agent sends 28-byte control messages
//! (`magic "IOSC" | kind u32 | sender u32 | first u64 | next u64`): `RESEND`
//! when it connects (send again every frame not yet acknowledged: a host
//! agent that stopped, or a connection that broke, took some without
//! confirming them) and `ACK` once frames are handled (every frame in
//! `first..next`: the sender forgets them). A frame is dropped by the
//! sender only for room, and counted; a resent frame a receiver already has
//! is skipped. Kinds: `HELLO` (JSON: who the guest is and its disks, sent at
//! start and every few seconds so a receiver joining late learns them),
//! `RECORDS` (whole `GuestIoEvent`s back to back), `STATS` (JSON: the
//! sender's own losses).
//!
//! `FrameCodec` cuts frames from the stream (tokio-util's codec traits over
//! `BytesMut`, headers read as zerocopy views); `FrameReader` follows the
//! sender's sequence across them.

use std::ops::Range;

use bytes::{Buf, Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use tokio_util::codec::{Decoder, Encoder};
use zerocopy::{
    little_endian::{U16, U32, U64},
    FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned,
};

use crate::abi::GuestIoEvent;
use crate::model::SenderStats;

pub const MAGIC: [u8; 4] = *b"IOSP";
pub const VERSION: u16 = 3;
pub const HEADER_LEN: usize = std::mem::size_of::<Header>();

/// A frame's header as it is on the wire.
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct Header {
    magic: [u8; 4],
    version: U16,
    kind: U16,
    sender: U32,
    seq: U64,
    len: U32,
}

/// Host → guest control messages.
pub const CONTROL_MAGIC: [u8; 4] = *b"IOSC";
pub const CONTROL_LEN: usize = std::mem::size_of::<ControlWire>();
pub const CONTROL_ACK: u32 = 1;
pub const CONTROL_RESEND: u32 = 2;

/// A control message as it is on the wire.
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct ControlWire {
    magic: [u8; 4],
    kind: U32,
    sender: U32,
    first: U64,
    next: U64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    /// Of `sender`'s frames, the receiver has every one in `first..next`
    /// (frames below `first` it never had: written while nobody listened).
    Ack { sender: u32, first: u64, next: u64 },
    /// A receiver that has nothing: send every unacknowledged frame again.
    Resend,
}

pub fn encode_control(c: Control) -> [u8; CONTROL_LEN] {
    let (kind, sender, first, next) = match c {
        Control::Ack {
            sender,
            first,
            next,
        } => (CONTROL_ACK, sender, first, next),
        Control::Resend => (CONTROL_RESEND, 0, 0, 0),
    };
    let wire = ControlWire {
        magic: CONTROL_MAGIC,
        kind: kind.into(),
        sender: sender.into(),
        first: first.into(),
        next: next.into(),
    };
    let mut out = [0u8; CONTROL_LEN];
    out.copy_from_slice(wire.as_bytes());
    out
}

/// Control messages out of a byte stream (skipping anything else).
#[derive(Default)]
pub struct ControlReader {
    buf: BytesMut,
}

impl ControlReader {
    pub fn push(&mut self, bytes: &[u8]) -> Vec<Control> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        loop {
            let Some(at) = find(&self.buf, &CONTROL_MAGIC) else {
                // Keep a possible start of a magic.
                let keep = self.buf.len().min(CONTROL_MAGIC.len().saturating_sub(1));
                self.buf.advance(self.buf.len().saturating_sub(keep));
                return out;
            };
            self.buf.advance(at);
            let Ok((wire, _)) = ControlWire::ref_from_prefix(&self.buf) else {
                return out;
            };
            match wire.kind.get() {
                CONTROL_ACK => out.push(Control::Ack {
                    sender: wire.sender.get(),
                    first: wire.first.get(),
                    next: wire.next.get(),
                }),
                CONTROL_RESEND => out.push(Control::Resend),
                _ => {}
            }
            self.buf.advance(CONTROL_LEN);
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}
/// Frames above this are refused: a corrupt length must not make the
/// receiver allocate without bound.
pub const MAX_PAYLOAD: usize = 1 << 20;

pub const HELLO: u16 = 1;
pub const RECORDS: u16 = 2;
pub const STATS: u16 = 3;

pub use crate::abi::PORT_NAME;

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

/// Disks of one HELLO kept: a VM has at most this many virtual disks.
pub const MAX_HELLO_DISKS: usize = 256;

impl Hello {
    /// The guest's strings kept printable only and its disk list bounded:
    /// the guest chose them, and the report, `doctor`, `top`, logs and
    /// pages show them.
    pub fn printable(mut self) -> Self {
        use crate::model::text::make_printable;
        make_printable(&mut self.boot_id);
        make_printable(&mut self.kernel);
        make_printable(&mut self.probes);
        self.disks.truncate(MAX_HELLO_DISKS);
        for d in &mut self.disks {
            make_printable(&mut d.name);
            if let Some(s) = d.serial.as_mut() {
                make_printable(s);
            }
        }
        self
    }
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

#[derive(Clone, Debug, PartialEq)]
pub enum Frame {
    Hello(Hello),
    Records(Vec<GuestIoEvent>),
    Stats(SenderStats),
}

/// A frame with its place in the sender's sequence, as it is sent.
pub struct Numbered<'a> {
    pub sender: u32,
    pub seq: u64,
    pub frame: &'a Frame,
}

pub fn encode(sender: u32, seq: u64, frame: &Frame) -> Vec<u8> {
    let mut out = BytesMut::new();
    // Encoding into memory cannot fail.
    let _ = FrameCodec.encode(Numbered { sender, seq, frame }, &mut out);
    out.to_vec()
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
    #[error("reading the guest channel: {0}")]
    Io(String),
}

impl From<std::io::Error> for DecodeError {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e.to_string())
    }
}

/// A frame cut from the stream, its payload not yet decoded.
#[derive(Debug)]
pub struct RawFrame {
    pub kind: u16,
    pub sender: u32,
    pub seq: u64,
    pub payload: Bytes,
}

/// The channel's framing: headers checked, payloads bounded, and after a
/// bad header the stream skipped to the next magic (an error names what
/// was wrong; the next call goes on from there).
#[derive(Clone, Copy, Debug, Default)]
pub struct FrameCodec;

impl FrameCodec {
    fn resync(src: &mut BytesMut) {
        let skip = find(src.get(1..).unwrap_or_default(), &MAGIC).map_or_else(
            || {
                src.len()
                    .saturating_sub(MAGIC.len().saturating_sub(1))
                    .max(1)
            },
            |i| i.saturating_add(1),
        );
        src.advance(skip.min(src.len()));
    }
}

impl Decoder for FrameCodec {
    type Item = RawFrame;
    type Error = DecodeError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<RawFrame>, DecodeError> {
        let Ok((h, _)) = Header::ref_from_prefix(src) else {
            return Ok(None);
        };
        let (kind, sender, seq) = (h.kind.get(), h.sender.get(), h.seq.get());
        let (version, len) = (h.version.get(), h.len.get() as usize);
        if h.magic != MAGIC {
            Self::resync(src);
            return Err(DecodeError::Magic);
        }
        if version != VERSION {
            Self::resync(src);
            return Err(DecodeError::Version(version));
        }
        if len > MAX_PAYLOAD {
            Self::resync(src);
            return Err(DecodeError::TooLong(len));
        }
        // `len` is at most `MAX_PAYLOAD`: the frame's size fits.
        let whole = HEADER_LEN.saturating_add(len);
        if src.len() < whole {
            src.reserve(whole.saturating_sub(src.len()));
            return Ok(None);
        }
        src.advance(HEADER_LEN);
        let payload = src.split_to(len).freeze();
        Ok(Some(RawFrame {
            kind,
            sender,
            seq,
            payload,
        }))
    }
}

impl Encoder<Numbered<'_>> for FrameCodec {
    type Error = std::io::Error;

    fn encode(&mut self, item: Numbered<'_>, dst: &mut BytesMut) -> std::io::Result<()> {
        let (kind, payload) = match item.frame {
            Frame::Hello(h) => (HELLO, serde_json::to_vec(h)?),
            Frame::Records(r) => (RECORDS, r.as_bytes().to_vec()),
            Frame::Stats(s) => (STATS, serde_json::to_vec(s)?),
        };
        let header = Header {
            magic: MAGIC,
            version: VERSION.into(),
            kind: kind.into(),
            sender: item.sender.into(),
            seq: item.seq.into(),
            len: (payload.len() as u32).into(),
        };
        dst.reserve(HEADER_LEN.saturating_add(payload.len()));
        dst.extend_from_slice(header.as_bytes());
        dst.extend_from_slice(&payload);
        Ok(())
    }
}

/// The sender heard, and how much of its sequence: every frame in
/// `first..next` was had or counted lost.
#[derive(Clone, Copy, Debug)]
struct Heard {
    sender: u32,
    first: u64,
    next: u64,
}

/// What a frame's number says about it.
enum Place {
    /// New: take it.
    New(Heard),
    /// Already had (resent): skip it.
    Duplicate,
}

/// Reassembles frames from a byte stream read in arbitrary pieces, and
/// follows the sender's sequence across connections: gaps counted as lost,
/// frames seen before (resent) skipped, a new sender counted as a restart.
#[derive(Default)]
pub struct FrameReader {
    buf: BytesMut,
    codec: FrameCodec,
    heard: Option<Heard>,
    /// Frames older than `heard.first`, resent (in order) after later ones
    /// arrived, merged into `heard` once they reach it.
    backfill: Option<Range<u64>>,
    pub lost_frames: u64,
    pub restarts: u64,
    /// Resent frames this receiver already had.
    pub duplicates: u64,
}

impl FrameReader {
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// A new connection: whatever is buffered of the old one is dropped,
    /// the sequence is kept.
    pub fn new_stream(&mut self) {
        self.buf.clear();
    }

    /// What to acknowledge: the sender's frames handled (or counted lost).
    pub fn ack(&self) -> Option<Control> {
        self.heard.map(|h| Control::Ack {
            sender: h.sender,
            first: h.first,
            next: h.next,
        })
    }

    /// The next whole frame, if buffered. An error names what was wrong;
    /// the reader has already skipped to the next frame's start.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, DecodeError> {
        // A kind this receiver does not know is skipped in step, in the
        // loop: any number of them costs no stack.
        while let Some(raw) = self.codec.decode(&mut self.buf)? {
            match self.place(raw.sender, raw.seq) {
                Place::Duplicate => self.duplicates = self.duplicates.saturating_add(1),
                Place::New(h) => {
                    self.heard = Some(h);
                    if let Some(frame) = Self::decode(raw.kind, &raw.payload)? {
                        return Ok(Some(frame));
                    }
                }
            }
        }
        Ok(None)
    }

    /// Where frame `seq` of `sender` falls in what was heard.
    fn place(&mut self, sender: u32, seq: u64) -> Place {
        let fresh = Heard {
            sender,
            first: seq,
            next: seq.saturating_add(1),
        };
        let Some(h) = self.heard else {
            return Place::New(fresh);
        };
        if h.sender != sender {
            self.restarts = self.restarts.saturating_add(1);
            self.backfill = None;
            return Place::New(fresh);
        }
        if seq < h.first {
            return self.place_before(h, seq);
        }
        if seq < h.next {
            return Place::Duplicate;
        }
        // The sequence is the guest's to say: none of it may wrap.
        self.lost_frames = self.lost_frames.saturating_add(seq.saturating_sub(h.next));
        Place::New(Heard {
            next: seq.saturating_add(1),
            ..h
        })
    }

    /// A frame written before this receiver heard the sender (resent to it
    /// now): new here, and the gap down to it was not a loss.
    fn place_before(&mut self, h: Heard, seq: u64) -> Place {
        let backfill = match self.backfill.take() {
            Some(b) if b.contains(&seq) => {
                self.backfill = Some(b);
                return Place::Duplicate;
            }
            Some(b) if seq == b.end => b.start..b.end.saturating_add(1),
            _ => seq..seq.saturating_add(1),
        };
        if backfill.end == h.first {
            return Place::New(Heard {
                first: backfill.start,
                ..h
            });
        }
        self.backfill = Some(backfill);
        Place::New(h)
    }

    /// A frame's payload; None for a kind this receiver does not know.
    fn decode(kind: u16, payload: &[u8]) -> Result<Option<Frame>, DecodeError> {
        let bad = |what, why: String| DecodeError::Payload { what, why };
        let frame = match kind {
            HELLO => Frame::Hello(
                serde_json::from_slice::<Hello>(payload)
                    .map_err(|e| bad("hello", e.to_string()))?
                    .printable(),
            ),
            STATS => Frame::Stats(
                serde_json::from_slice(payload).map_err(|e| bad("stats", e.to_string()))?,
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
                        .filter_map(|c| GuestIoEvent::read_from_bytes(c).ok())
                        .collect(),
                )
            }
            // A newer sender's frame kind: skipped, the stream stays in step.
            _ => return Ok(None),
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
    fn a_hostile_hello_arrives_printable_and_bounded() {
        let hostile = Frame::Hello(Hello {
            boot_id: "b\u{1b}[2J".into(),
            kernel: "6.1\u{1b}]0;owned\u{7}".into(),
            disks: (0..1000)
                .map(|i| GuestDisk {
                    dev: i,
                    name: format!("vd\u{202e}{i}"),
                    serial: Some("s\r\n".into()),
                })
                .collect(),
            probes: "x".repeat(100_000),
        });
        let mut r = FrameReader::default();
        r.push(&encode(7, 0, &hostile));
        let Some(Frame::Hello(h)) = r.next_frame().unwrap() else {
            panic!("no hello");
        };
        assert_eq!(h.boot_id, "b\\u{1b}[2J");
        assert!(!h.kernel.contains('\u{1b}') && !h.kernel.contains('\u{7}'));
        assert_eq!(h.disks.len(), MAX_HELLO_DISKS);
        assert!(h
            .disks
            .iter()
            .all(|d| !d.name.contains('\u{202e}') && d.serial.as_deref() == Some("s\\u{d}\\u{a}")));
        assert!(h.probes.chars().count() <= crate::model::text::MAX_NAME + 1);
    }

    /// Fuzzing found it: a sender's sequence at u64::MAX overflowed the
    /// next expected one.
    #[test]
    fn a_sequence_at_its_end_does_not_wrap() {
        let stats = Frame::Stats(SenderStats::default());
        let mut r = FrameReader::default();
        for seq in [u64::MAX - 1, u64::MAX, u64::MAX, 3] {
            r.push(&encode(7, seq, &stats));
            while r.next_frame().unwrap().is_some() {}
        }
        // Nothing wrapped into a gap counted as lost.
        assert_eq!(r.lost_frames, 0);
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
        let bytes: Vec<u8> = [
            encode(7, 0, &hello),
            encode(7, 1, &recs),
            encode(7, 2, &stats),
        ]
        .concat();
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
    fn gaps_restarts_and_resent_frames_are_counted() {
        let mut r = FrameReader::default();
        // Sender 1: a gap of three; its frames 5 and 6 resent after a
        // reconnection (skipped); then sender 2 (a restarted agent) from 0.
        for (sender, seq, new) in [
            (1, 0, true),
            (1, 1, true),
            (1, 5, true),
            (1, 6, true),
            (1, 5, false),
            (1, 6, false),
            (1, 7, true),
            (2, 0, true),
            (2, 1, true),
        ] {
            r.new_stream();
            r.push(&encode(sender, seq, &Frame::Records(vec![rec(seq)])));
            assert_eq!(r.next_frame().unwrap().is_some(), new, "{sender}/{seq}");
        }
        assert_eq!((r.lost_frames, r.restarts, r.duplicates), (3, 1, 2));
        assert_eq!(
            r.ack(),
            Some(Control::Ack {
                sender: 2,
                first: 0,
                next: 2
            })
        );
    }

    /// Frames written before anyone listened, resent after later ones
    /// arrived: new to the receiver, and its acknowledgement covers them.
    #[test]
    fn frames_older_than_the_first_heard_are_taken() {
        let mut r = FrameReader::default();
        for seq in [2, 3, 0, 1, 0] {
            r.push(&encode(9, seq, &Frame::Records(vec![rec(seq)])));
            let new = r.next_frame().unwrap().is_some();
            assert_eq!(new, !(seq == 0 && r.duplicates == 1), "seq {seq}");
        }
        assert_eq!((r.lost_frames, r.duplicates), (0, 1));
        assert_eq!(
            r.ack(),
            Some(Control::Ack {
                sender: 9,
                first: 0,
                next: 4
            })
        );
    }

    #[test]
    fn the_tail_of_a_broken_frame_is_skipped_to_the_next() {
        let whole = encode(3, 0, &Frame::Records(vec![rec(8)]));
        let next = encode(3, 1, &Frame::Records(vec![rec(16)]));
        let mut r = FrameReader::default();
        r.push(&whole[10..]);
        r.push(&next);
        assert_eq!(r.next_frame(), Err(DecodeError::Magic));
        assert_eq!(r.next_frame().unwrap(), Some(Frame::Records(vec![rec(16)])));
        assert_eq!(r.next_frame().unwrap(), None);
    }

    #[test]
    fn control_messages_survive_any_split_and_noise() {
        let mut bytes = b"xx".to_vec();
        bytes.extend(encode_control(Control::Resend));
        bytes.extend(b"IOS");
        let ack = Control::Ack {
            sender: 5,
            first: 3,
            next: 42,
        };
        bytes.extend(encode_control(ack));
        for step in [1, 5, 16, bytes.len()] {
            let mut c = ControlReader::default();
            let got: Vec<Control> = bytes.chunks(step).flat_map(|p| c.push(p)).collect();
            assert_eq!(got, vec![Control::Resend, ack], "pieces of {step}");
        }
    }

    #[test]
    fn garbage_and_oversize_frames_are_refused() {
        let mut r = FrameReader::default();
        r.push(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(r.next_frame(), Err(DecodeError::Magic));
        let mut f = encode(0, 0, &Frame::Records(vec![rec(1)]));
        f[20..24].copy_from_slice(&(u32::MAX).to_le_bytes());
        let mut r = FrameReader::default();
        r.push(&f);
        assert!(matches!(r.next_frame(), Err(DecodeError::TooLong(_))));
        let mut f = encode(0, 0, &Frame::Records(vec![rec(1)]));
        f[4] = 9;
        let mut r = FrameReader::default();
        r.push(&f);
        assert_eq!(r.next_frame(), Err(DecodeError::Version(9)));
    }

    #[test]
    fn unknown_kinds_are_skipped_in_step() {
        let mut unknown = encode(0, 0, &Frame::Stats(SenderStats::default()));
        unknown[6..8].copy_from_slice(&99u16.to_le_bytes());
        let mut r = FrameReader::default();
        r.push(&unknown);
        r.push(&encode(0, 1, &Frame::Records(vec![rec(3)])));
        assert_eq!(r.next_frame().unwrap(), Some(Frame::Records(vec![rec(3)])));
    }

    /// A guest sending a million frames of kinds this receiver does not
    /// know before a real one: skipped in a loop, not one call deeper each.
    #[test]
    fn any_number_of_unknown_kinds_costs_no_stack() {
        let mut unknown = encode(0, 0, &Frame::Records(Vec::new()));
        unknown[6..8].copy_from_slice(&99u16.to_le_bytes());
        let mut stream = Vec::with_capacity(unknown.len() * 1_000_001);
        for seq in 0..1_000_000u64 {
            unknown[12..20].copy_from_slice(&seq.to_le_bytes());
            stream.extend_from_slice(&unknown);
        }
        stream.extend(encode(0, 1_000_000, &Frame::Records(vec![rec(5)])));
        // A small stack: recursion per frame would overflow it.
        let got = std::thread::Builder::new()
            .stack_size(64 << 10)
            .spawn(move || {
                let mut r = FrameReader::default();
                r.push(&stream);
                r.next_frame()
            })
            .unwrap()
            .join()
            .expect("no stack overflow");
        assert_eq!(got.unwrap(), Some(Frame::Records(vec![rec(5)])));
    }
}
