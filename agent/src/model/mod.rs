//! What the agent knows, independent of how it was measured: operations,
//! segments, per-(disk, op) statistics. No aya, no terminal here.

pub mod hist;
pub mod loss;
pub mod span;
pub mod tails;
pub mod text;

use std::fmt;

use serde::{Deserialize, Serialize};

pub use hist::{Hist, Summary};
pub use loss::{ChannelStats, SenderStats, SplitCounters};
pub use span::IoSpan;

use crate::abi::{BlkStats, BLK_NR_SEGS};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    Read,
    Write,
    Flush,
    Discard,
    Other,
}

impl Op {
    pub const ALL: [Op; 5] = [Op::Read, Op::Write, Op::Flush, Op::Discard, Op::Other];

    pub fn from_index(i: usize) -> Option<Op> {
        Self::ALL.get(i).copied()
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Discard => "discard",
            Op::Other => "other",
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Host block-layer segments, in `enum blk_segment` order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlkSegment {
    Total,
    Queue,
    Service,
}

impl BlkSegment {
    pub const ALL: [BlkSegment; BLK_NR_SEGS] =
        [BlkSegment::Total, BlkSegment::Queue, BlkSegment::Service];

    /// The segment's name in reports and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Total => "total",
            Self::Queue => "queue",
            Self::Service => "service",
        }
    }
}

/// Everything measured for one (disk, op) over a window.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DiskOpStats {
    pub ios: u64,
    pub bytes: u64,
    pub errors: u64,
    pub requeued: u64,
    pub partial: u64,
    /// Requests the kernel completed whose completion never reached us:
    /// counted, not timed (only a VM's are known one by one).
    pub undelivered: u64,
    /// Indexed by `BlkSegment as usize`.
    pub segments: [Hist; BLK_NR_SEGS],
}

impl DiskOpStats {
    /// Adds another window's figures (a retired table entry's).
    pub fn merge(&mut self, o: &DiskOpStats) {
        self.ios += o.ios;
        self.bytes += o.bytes;
        self.errors += o.errors;
        self.requeued += o.requeued;
        self.partial += o.partial;
        self.undelivered += o.undelivered;
        for (h, oh) in self.segments.iter_mut().zip(o.segments.iter()) {
            h.merge(oh);
        }
    }

    /// Adds one share of the kernel's statistics (a CPU's, or the nested updates').
    pub fn add_cpu(&mut self, s: &BlkStats) {
        self.ios += s.ios;
        self.bytes += s.bytes;
        self.errors += s.errors;
        self.requeued += s.requeued;
        self.partial += s.partial;
        for (i, h) in self.segments.iter_mut().enumerate() {
            for (a, &b) in h.buckets.iter_mut().zip(s.hist[i].iter()) {
                *a += b;
                h.count += b;
            }
            h.sum_ns += s.sum_ns[i];
            h.max_ns = h.max_ns.max(s.max_ns[i]);
        }
    }

    pub fn segment(&self, s: BlkSegment) -> &Hist {
        &self.segments[s as usize]
    }
}
