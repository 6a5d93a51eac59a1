//! What the agent knows, independent of how it was measured: operations,
//! segments, per-(disk, op) statistics. No aya, no terminal here.

pub mod block;
pub mod dev;
pub mod diagnosis;
pub mod hist;
pub mod loss;
pub mod span;
pub mod split;
pub mod tails;
pub mod text;

use std::fmt;

use serde::{Deserialize, Serialize};

pub use dev::Dev;
pub use hist::{Hist, Summary};
pub use loss::{ChannelStats, SenderStats, SplitCounters};
pub use span::IoSpan;
pub use split::{HostExtras, SplitWindow};

use crate::abi::{BlkStats, VmSplitStats, BLK_NR_SEGS, VM_NR_SEGS};

/// How much a run measures, and so what it costs (docs/tiers.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Tier {
    /// What the agent service runs all the time: every VM request's host
    /// window joined in the kernel into histograms (hypervisor, engine,
    /// device), no system-call tracepoint, per-I/O records only for the
    /// requests exported.
    #[default]
    AlwaysOn,
    /// For a run that asks: each virtio request ended at its own used-ring
    /// push, QEMU's device model taking each request, CPU waits, and every
    /// request's record joined in user space; system-call tracepoints on
    /// the host while it runs.
    Deep,
}

impl Tier {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AlwaysOn => "always-on",
            Self::Deep => "deep",
        }
    }

    pub fn is_deep(self) -> bool {
        self == Self::Deep
    }

    /// The tier a command line's `--deep` asks for.
    pub fn of_deep(deep: bool) -> Self {
        if deep {
            Self::Deep
        } else {
            Self::AlwaysOn
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Tier {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "always-on" => Ok(Self::AlwaysOn),
            "deep" => Ok(Self::Deep),
            other => Err(format!("{other:?}: the tiers are always-on and deep")),
        }
    }
}

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
        self.ios = self.ios.saturating_add(o.ios);
        self.bytes = self.bytes.saturating_add(o.bytes);
        self.errors = self.errors.saturating_add(o.errors);
        self.requeued = self.requeued.saturating_add(o.requeued);
        self.partial = self.partial.saturating_add(o.partial);
        self.undelivered = self.undelivered.saturating_add(o.undelivered);
        for (h, oh) in self.segments.iter_mut().zip(o.segments.iter()) {
            h.merge(oh);
        }
    }

    /// Adds one share of the kernel's statistics (a CPU's, or the nested updates').
    pub fn add_cpu(&mut self, s: &BlkStats) {
        self.ios = self.ios.saturating_add(s.ios);
        self.bytes = self.bytes.saturating_add(s.bytes);
        self.errors = self.errors.saturating_add(s.errors);
        self.requeued = self.requeued.saturating_add(s.requeued);
        self.partial = self.partial.saturating_add(s.partial);
        let kernel = s.hist.iter().zip(&s.sum_ns).zip(&s.max_ns);
        for (h, ((buckets, &sum), &max)) in self.segments.iter_mut().zip(kernel) {
            h.add_kernel(buckets, sum, max);
        }
    }

    pub fn segment(&self, s: BlkSegment) -> &Hist {
        let [total, queue, service] = &self.segments;
        match s {
            BlkSegment::Total => total,
            BlkSegment::Queue => queue,
            BlkSegment::Service => service,
        }
    }
}

/// Host windows of a VM's requests the kernel joined (the always-on tier),
/// for one (VM, virtual disk, host disk, op, guest queue): in `abi::vm_seg`
/// order, hypervisor, engine, device, the whole window, and pickup to host
/// completion.
#[derive(Clone, Debug, PartialEq)]
pub struct JoinedWindows {
    pub count: u64,
    pub bytes: u64,
    pub segments: [Hist; VM_NR_SEGS],
}

impl Default for JoinedWindows {
    fn default() -> Self {
        Self {
            count: 0,
            bytes: 0,
            segments: std::array::from_fn(|_| Hist::default()),
        }
    }
}

impl JoinedWindows {
    /// Adds one CPU's entry.
    pub fn add_cpu(&mut self, s: &VmSplitStats) {
        self.count = self.count.saturating_add(s.count);
        self.bytes = self.bytes.saturating_add(s.bytes);
        let kernel = s.hist.iter().zip(&s.sum_ns).zip(&s.max_ns);
        for (h, ((buckets, &sum), &max)) in self.segments.iter_mut().zip(kernel) {
            h.add_kernel(buckets, sum, max);
        }
    }

    pub fn merge(&mut self, o: &JoinedWindows) {
        self.count = self.count.saturating_add(o.count);
        self.bytes = self.bytes.saturating_add(o.bytes);
        for (a, b) in self.segments.iter_mut().zip(&o.segments) {
            a.merge(b);
        }
    }
}
