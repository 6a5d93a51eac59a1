//! The kernel's own per-disk accounting (/sys/block/*/stat), the count a
//! run's traced requests are checked against.
//!
//! Exact request counts and busy time per operation group, independent of
//! our probes.
//! A run compares its traced counts with these, so requests that completed
//! without our tracepoints seeing them are counted, not silently missing.

use std::{collections::BTreeMap, fs};

use serde::{Deserialize, Serialize};

use crate::{discover::disks::Dev, model::Op};

/// One disk's counters, per operation group as the kernel keeps them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskStat {
    pub reads: u64,
    pub read_ms: u64,
    pub writes: u64,
    pub write_ms: u64,
    pub discards: u64,
    pub discard_ms: u64,
    pub flushes: u64,
    pub flush_ms: u64,
    /// Time the disk had requests in flight, and that time weighted by how
    /// many (ms): their ratio is its mean depth while busy (iostat's
    /// aqu-sz over its busy time).
    pub busy_ms: u64,
    pub weighted_ms: u64,
}

/// What the kernel counted for one (disk, op) over a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KernelCount {
    pub ios: u64,
    /// Sum of start → completion over those requests, in ms (the kernel's
    /// resolution), the same interval as our `total`.
    pub time_ms: u64,
}

impl DiskStat {
    /// Parses the space-separated fields of a `stat` file (see
    /// Documentation/block/stat.rst); older kernels have fewer fields.
    pub fn parse(text: &str) -> Option<Self> {
        let f: Vec<u64> = text
            .split_whitespace()
            .map(|v| v.parse().ok())
            .collect::<Option<_>>()?;
        let at = |i: usize| f.get(i).copied().unwrap_or(0);
        (f.len() >= 11).then(|| DiskStat {
            reads: at(0),
            read_ms: at(3),
            writes: at(4),
            write_ms: at(7),
            discards: at(11),
            discard_ms: at(14),
            flushes: at(15),
            flush_ms: at(16),
            busy_ms: at(9),
            weighted_ms: at(10),
        })
    }

    /// A delta's mean depth while busy (None: not busy).
    pub fn depth(&self) -> Option<f64> {
        (self.busy_ms > 0).then(|| self.weighted_ms as f64 / self.busy_ms as f64)
    }

    fn minus(&self, b: &DiskStat) -> DiskStat {
        DiskStat {
            reads: self.reads.saturating_sub(b.reads),
            read_ms: self.read_ms.saturating_sub(b.read_ms),
            writes: self.writes.saturating_sub(b.writes),
            write_ms: self.write_ms.saturating_sub(b.write_ms),
            discards: self.discards.saturating_sub(b.discards),
            discard_ms: self.discard_ms.saturating_sub(b.discard_ms),
            flushes: self.flushes.saturating_sub(b.flushes),
            flush_ms: self.flush_ms.saturating_sub(b.flush_ms),
            busy_ms: self.busy_ms.saturating_sub(b.busy_ms),
            weighted_ms: self.weighted_ms.saturating_sub(b.weighted_ms),
        }
    }

    /// The kernel's count for our op class. `Other` has no group of its
    /// own (write-zeroes are counted as writes, passthrough not at all).
    pub fn for_op(&self, op: Op) -> Option<KernelCount> {
        match op {
            Op::Read => Some(KernelCount {
                ios: self.reads,
                time_ms: self.read_ms,
            }),
            Op::Write => Some(KernelCount {
                ios: self.writes,
                time_ms: self.write_ms,
            }),
            Op::Discard => Some(KernelCount {
                ios: self.discards,
                time_ms: self.discard_ms,
            }),
            Op::Flush => Some(KernelCount {
                ios: self.flushes,
                time_ms: self.flush_ms,
            }),
            Op::Other => None,
        }
    }
}

/// Counters of every whole disk that keeps them (`queue/iostats` = 1).
pub fn read_all() -> BTreeMap<Dev, DiskStat> {
    let mut out = BTreeMap::new();
    let Ok(rd) = fs::read_dir("/sys/block") else {
        return out;
    };
    for e in rd.flatten() {
        let base = e.path();
        if fs::read_to_string(base.join("queue/iostats"))
            .map(|s| s.trim() != "1")
            .unwrap_or(true)
        {
            continue;
        }
        let dev = fs::read_to_string(base.join("dev")).ok().and_then(|t| {
            let (a, b) = t.trim().split_once(':')?;
            Some(Dev::new(a.parse().ok()?, b.parse().ok()?))
        });
        let stat = fs::read_to_string(base.join("stat"))
            .ok()
            .and_then(|t| DiskStat::parse(&t));
        if let (Some(dev), Some(stat)) = (dev, stat) {
            out.insert(dev, stat);
        }
    }
    out
}

/// Per-disk change between two reads; disks present in both only.
pub fn delta(
    before: &BTreeMap<Dev, DiskStat>,
    after: &BTreeMap<Dev, DiskStat>,
) -> BTreeMap<Dev, DiskStat> {
    after
        .iter()
        .filter_map(|(d, a)| before.get(d).map(|b| (*d, a.minus(b))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_modern_and_the_old_layout() {
        let modern = "  3000 0 24000 41 2000 0 16000 30 0 60 71 5 0 40 1 7 2\n";
        let s = DiskStat::parse(modern).unwrap();
        assert_eq!(
            (s.reads, s.read_ms, s.writes, s.write_ms),
            (3000, 41, 2000, 30)
        );
        assert_eq!(
            (s.discards, s.discard_ms, s.flushes, s.flush_ms),
            (5, 1, 7, 2)
        );
        let old = "10 0 80 3 4 0 32 1 0 4 4";
        let s = DiskStat::parse(old).unwrap();
        assert_eq!((s.reads, s.writes, s.discards, s.flushes), (10, 4, 0, 0));
        assert!(DiskStat::parse("1 2 3").is_none());
        assert!(DiskStat::parse("x y z 1 2 3 4 5 6 7 8").is_none());
    }

    #[test]
    fn delta_is_per_disk_and_never_negative() {
        let d = Dev::new(7, 0);
        let mut a = BTreeMap::new();
        let mut b = BTreeMap::new();
        a.insert(
            d,
            DiskStat {
                reads: 10,
                ..Default::default()
            },
        );
        b.insert(
            d,
            DiskStat {
                reads: 25,
                writes: 3,
                ..Default::default()
            },
        );
        b.insert(
            Dev::new(8, 0),
            DiskStat {
                reads: 1,
                ..Default::default()
            },
        );
        let x = delta(&a, &b);
        assert_eq!(x.len(), 1);
        assert_eq!(x[&d].reads, 15);
        assert_eq!(delta(&b, &a)[&d].reads, 0);
    }
}
