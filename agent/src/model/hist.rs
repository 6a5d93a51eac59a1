//! Log-linear latency histograms, bucket for bucket the same as
//! `bpf/include/hist.h` (pinned by the agent-integration test `hist_buckets`).

use serde::{Deserialize, Serialize};

use crate::abi::{HIST_BUCKETS, HIST_MAX_LOG2, HIST_SUB, HIST_SUB_BITS};

/// The bucket a value in nanoseconds falls into.
pub fn bucket_of(v: u64) -> usize {
    if v < 2 * HIST_SUB as u64 {
        return v as usize;
    }
    let e = 63 - v.leading_zeros();
    if e > HIST_MAX_LOG2 {
        return HIST_BUCKETS - 1;
    }
    let sub = (v >> (e - HIST_SUB_BITS)) as u32 & (HIST_SUB - 1);
    ((e - HIST_SUB_BITS + 1) * HIST_SUB + sub) as usize
}

/// `[lower, upper)` of a bucket, in nanoseconds.
pub fn bucket_bounds(b: usize) -> (u64, u64) {
    let b = b as u64;
    let sub = HIST_SUB as u64;
    if b < 2 * sub {
        return (b, b + 1);
    }
    let e = b / sub + HIST_SUB_BITS as u64 - 1;
    let width = 1u64 << (e - HIST_SUB_BITS as u64);
    let lower = (1u64 << e) + (b % sub) * width;
    (lower, lower + width)
}

#[derive(Clone, Debug, PartialEq)]
pub struct Hist {
    pub buckets: Vec<u64>,
    pub count: u64,
    pub sum_ns: u64,
    pub max_ns: u64,
}

impl Default for Hist {
    fn default() -> Self {
        Self {
            buckets: vec![0; HIST_BUCKETS],
            count: 0,
            sum_ns: 0,
            max_ns: 0,
        }
    }
}

/// The figures every report shows for one latency distribution.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

impl Hist {
    pub fn record(&mut self, v: u64) {
        self.buckets[bucket_of(v)] += 1;
        self.count += 1;
        self.sum_ns += v;
        self.max_ns = self.max_ns.max(v);
    }

    pub fn merge(&mut self, other: &Hist) {
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            *a += b;
        }
        self.count += other.count;
        self.sum_ns += other.sum_ns;
        self.max_ns = self.max_ns.max(other.max_ns);
    }

    pub fn mean_ns(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum_ns as f64 / self.count as f64
        }
    }

    /// The q-quantile (0..=1) in nanoseconds, interpolated linearly inside
    /// its bucket and never above the observed maximum.
    pub fn quantile_ns(&self, q: f64) -> f64 {
        let total: u64 = self.buckets.iter().sum();
        if total == 0 {
            return 0.0;
        }
        let rank = (q.clamp(0.0, 1.0) * total as f64).max(1.0);
        let mut seen = 0u64;
        for (b, &n) in self.buckets.iter().enumerate() {
            if n == 0 {
                continue;
            }
            if (seen + n) as f64 >= rank {
                let (lo, hi) = bucket_bounds(b);
                let frac = (rank - seen as f64) / n as f64;
                let v = lo as f64 + frac * (hi - lo) as f64;
                return v.min(self.max_ns as f64);
            }
            seen += n;
        }
        self.max_ns as f64
    }

    pub fn summary(&self) -> Summary {
        // µs with ns precision.
        let us = |ns: f64| ns.round() / 1000.0;
        Summary {
            count: self.count,
            mean_us: us(self.mean_ns()),
            p50_us: us(self.quantile_ns(0.50)),
            p90_us: us(self.quantile_ns(0.90)),
            p99_us: us(self.quantile_ns(0.99)),
            p999_us: us(self.quantile_ns(0.999)),
            max_us: us(self.max_ns as f64),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_contiguous_and_cover_their_values() {
        let mut prev_hi = 0;
        for b in 0..HIST_BUCKETS {
            let (lo, hi) = bucket_bounds(b);
            assert_eq!(
                lo,
                prev_hi,
                "bucket {b} starts where {} ended",
                b.saturating_sub(1)
            );
            assert!(hi > lo);
            assert_eq!(bucket_of(lo), b);
            assert_eq!(bucket_of(hi - 1), b);
            prev_hi = hi;
        }
        assert_eq!(bucket_of(u64::MAX), HIST_BUCKETS - 1);
    }

    #[test]
    fn bucket_width_is_within_an_eighth() {
        for b in 2 * HIST_SUB as usize..HIST_BUCKETS {
            let (lo, hi) = bucket_bounds(b);
            assert!((hi - lo) as f64 / lo as f64 <= 1.0 / HIST_SUB as f64 + 1e-12);
        }
    }

    #[test]
    fn quantiles_of_a_uniform_distribution() {
        let mut h = Hist::default();
        for v in 1..=100_000u64 {
            h.record(v * 100); // 100 ns .. 10 ms
        }
        for (q, want) in [(0.5, 5_000_000.0), (0.9, 9_000_000.0), (0.99, 9_900_000.0)] {
            let got = h.quantile_ns(q);
            assert!(
                (got - want).abs() / want < 0.02,
                "q{q}: got {got}, want {want}"
            );
        }
        assert_eq!(h.quantile_ns(1.0), 10_000_000.0);
        assert!((h.mean_ns() - 5_000_050.0).abs() < 1.0);
    }

    #[test]
    fn quantile_of_a_single_value_is_not_above_it() {
        let mut h = Hist::default();
        h.record(12_345);
        let s = h.summary();
        assert!(s.p50_us <= 12.345 && s.p50_us > 12.345 * 0.875, "{s:?}");
        assert_eq!(s.max_us, 12.345);
    }

    #[test]
    fn empty_histogram_summarises_to_zero() {
        assert_eq!(Hist::default().summary(), Summary::default());
    }
}
