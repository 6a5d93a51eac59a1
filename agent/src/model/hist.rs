//! Log-linear latency histograms: the kernel's layout, and a finer one for
//! what is recorded in user space.
//!
//! The kernel's layout (`bpf/include/hist.h`,
//! pinned by the agent-integration test `hist_buckets`) has eight
//! sub-buckets per power of two; distributions recorded here in user space
//! (the joined segments of guest I/O) take a finer one, 64 sub-buckets,
//! so their percentiles are within 1.6 % rather than 12.5 %.

use serde::{Deserialize, Serialize};

use crate::abi::{HIST_MAX_LOG2, HIST_SUB_BITS};

/// Sub-bucket bits of the user-space layout.
pub const FINE_SUB_BITS: u32 = 6;

/// Buckets of a layout with 2^`bits` sub-buckets per power of two (`bits`
/// is one of the two layouts' constants, far below `HIST_MAX_LOG2`).
#[allow(clippy::arithmetic_side_effects)]
const fn buckets_for(bits: u32) -> usize {
    ((HIST_MAX_LOG2 - bits + 2) << bits) as usize
}

/// The kernel-layout bucket a value in nanoseconds falls into.
pub fn bucket_of(v: u64) -> usize {
    bucket_in(v, HIST_SUB_BITS)
}

/// `[lower, upper)` of a kernel-layout bucket, in nanoseconds.
pub fn bucket_bounds(b: usize) -> (u64, u64) {
    bounds_in(b, HIST_SUB_BITS)
}

// `bits` is a layout's (3 or 6, checked where a histogram is read in:
// `Hist`'s `try_from`), `v >= 2^(bits + 1)` past the first test, so `e`
// lies in `bits + 1 ..= 63`: no shift or subtraction here leaves its range.
#[allow(clippy::arithmetic_side_effects)]
fn bucket_in(v: u64, bits: u32) -> usize {
    let sub = 1u64 << bits;
    if v < 2 * sub {
        return v as usize;
    }
    let e = 63 - v.leading_zeros();
    if e > HIST_MAX_LOG2 {
        return buckets_for(bits) - 1;
    }
    let s = (v >> (e - bits)) & (sub - 1);
    (((e - bits + 1) as u64) * sub + s) as usize
}

// A bucket index below `buckets_for(bits)`, or the next one (a caller's
// end bound): `e` stays within `bits + 1 ..= HIST_MAX_LOG2 + 1`. An index
// past that (a corrupt histogram's) is given the top bucket's bounds.
#[allow(clippy::arithmetic_side_effects)]
fn bounds_in(b: usize, bits: u32) -> (u64, u64) {
    let b = (b as u64).min(buckets_for(bits) as u64);
    let sub = 1u64 << bits;
    if b < 2 * sub {
        return (b, b + 1);
    }
    let e = b / sub + bits as u64 - 1;
    let width = 1u64 << (e - bits as u64);
    let lower = (1u64 << e) + (b % sub) * width;
    (lower, lower + width)
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "HistFields")]
pub struct Hist {
    /// Sub-bucket bits of this histogram's layout.
    sub_bits: u32,
    pub buckets: Vec<u64>,
    pub count: u64,
    pub sum_ns: u64,
    pub max_ns: u64,
}

/// A histogram as read from a file (a stored run, a report): taken only in
/// one of the two layouts, with that layout's number of buckets.
#[derive(Deserialize)]
struct HistFields {
    sub_bits: u32,
    buckets: Vec<u64>,
    count: u64,
    sum_ns: u64,
    max_ns: u64,
}

impl TryFrom<HistFields> for Hist {
    type Error = String;

    fn try_from(f: HistFields) -> Result<Self, String> {
        if f.sub_bits != HIST_SUB_BITS && f.sub_bits != FINE_SUB_BITS {
            return Err(format!(
                "a histogram of {} sub-bucket bits (only {HIST_SUB_BITS} and {FINE_SUB_BITS} exist)",
                f.sub_bits
            ));
        }
        if f.buckets.len() != buckets_for(f.sub_bits) {
            return Err(format!(
                "a histogram of {} buckets (its layout has {})",
                f.buckets.len(),
                buckets_for(f.sub_bits)
            ));
        }
        Ok(Hist {
            sub_bits: f.sub_bits,
            buckets: f.buckets,
            count: f.count,
            sum_ns: f.sum_ns,
            max_ns: f.max_ns,
        })
    }
}

/// The kernel's layout: what its per-CPU histograms are summed into.
impl Default for Hist {
    fn default() -> Self {
        Self::with_sub_bits(HIST_SUB_BITS)
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
    fn with_sub_bits(sub_bits: u32) -> Self {
        Self {
            sub_bits,
            buckets: vec![0; buckets_for(sub_bits)],
            count: 0,
            sum_ns: 0,
            max_ns: 0,
        }
    }

    /// The user-space layout, for values recorded one by one here.
    pub fn fine() -> Self {
        Self::with_sub_bits(FINE_SUB_BITS)
    }

    pub fn record(&mut self, v: u64) {
        if let Some(n) = self.buckets.get_mut(bucket_in(v, self.sub_bits)) {
            *n = n.saturating_add(1);
        }
        self.count = self.count.saturating_add(1);
        // Values can come from a guest: a sum that would wrap stays at the top.
        self.sum_ns = self.sum_ns.saturating_add(v);
        self.max_ns = self.max_ns.max(v);
    }

    /// Adds another histogram of the same layout.
    pub fn merge(&mut self, other: &Hist) {
        debug_assert_eq!(
            self.sub_bits, other.sub_bits,
            "merging histograms of two layouts"
        );
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            *a = a.saturating_add(*b);
        }
        self.count = self.count.saturating_add(other.count);
        self.sum_ns = self.sum_ns.saturating_add(other.sum_ns);
        self.max_ns = self.max_ns.max(other.max_ns);
    }

    /// Adds one CPU's kernel histogram (the kernel's layout): its buckets,
    /// sum and maximum; its count is its buckets'.
    pub fn add_kernel(&mut self, buckets: &[u64], sum_ns: u64, max_ns: u64) {
        debug_assert_eq!(
            self.sub_bits, HIST_SUB_BITS,
            "a kernel histogram into a fine one"
        );
        for (a, &b) in self.buckets.iter_mut().zip(buckets) {
            *a = a.saturating_add(b);
            self.count = self.count.saturating_add(b);
        }
        self.sum_ns = self.sum_ns.saturating_add(sum_ns);
        self.max_ns = self.max_ns.max(max_ns);
    }

    /// The same in the kernel's layout: a fine bucket lies inside one
    /// kernel bucket (the kernel's bounds are a subset of the fine ones).
    pub fn coarse(&self) -> Hist {
        if self.sub_bits == HIST_SUB_BITS {
            return self.clone();
        }
        let mut out = Hist::default();
        for (b, &n) in self.buckets.iter().enumerate().filter(|(_, n)| **n > 0) {
            if let Some(c) = out
                .buckets
                .get_mut(bucket_of(bounds_in(b, self.sub_bits).0))
            {
                *c = c.saturating_add(n);
            }
        }
        out.count = self.count;
        out.sum_ns = self.sum_ns;
        out.max_ns = self.max_ns;
        out
    }

    /// Adds a histogram of either layout: the kernel's where they differ.
    pub fn merge_any(&mut self, other: &Hist) {
        if self.sub_bits == other.sub_bits {
            self.merge(other);
        } else {
            *self = self.coarse();
            self.merge(&other.coarse());
        }
    }

    /// What was recorded since `earlier`, an earlier state of this same
    /// histogram (the maximum stays the whole run's: an upper bound).
    pub fn since(&self, earlier: &Hist) -> Hist {
        if earlier.sub_bits != self.sub_bits {
            return self.clone();
        }
        Hist {
            sub_bits: self.sub_bits,
            buckets: self
                .buckets
                .iter()
                .zip(&earlier.buckets)
                .map(|(a, b)| a.saturating_sub(*b))
                .collect(),
            count: self.count.saturating_sub(earlier.count),
            sum_ns: self.sum_ns.saturating_sub(earlier.sum_ns),
            max_ns: self.max_ns,
        }
    }

    /// Bucket counts with their bounds (ns), the empty ones left out.
    pub fn nonzero_buckets(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.buckets
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .map(|(b, n)| {
                let (lo, hi) = bounds_in(b, self.sub_bits);
                (lo, hi, *n)
            })
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
        let total = self.buckets.iter().fold(0u64, |a, &n| a.saturating_add(n));
        if total == 0 {
            return 0.0;
        }
        // NaN asks for the median: no rank at all is no answer.
        let q = if q.is_nan() { 0.5 } else { q.max(0.0).min(1.0) };
        let rank = (q * total as f64).max(1.0);
        let mut seen = 0u64;
        for (b, &n) in self.buckets.iter().enumerate() {
            if n == 0 {
                continue;
            }
            if seen.saturating_add(n) as f64 >= rank {
                let (lo, hi) = bounds_in(b, self.sub_bits);
                // The top bucket ends at the largest value seen, not at
                // its bound: the slowest values are the ones asked for most.
                let hi = hi.min(self.max_ns.saturating_add(1)).max(lo);
                let frac = (rank - seen as f64) / n as f64;
                let v = lo as f64 + frac * hi.saturating_sub(lo) as f64;
                return v.min(self.max_ns as f64);
            }
            seen = seen.saturating_add(n);
        }
        self.max_ns as f64
    }

    /// How many values fell below `le_ns` — exact where `le_ns` is a bucket
    /// boundary of this layout (the classic buckets of `metrics` are).
    pub fn count_below(&self, le_ns: u64) -> u64 {
        self.buckets
            .iter()
            .enumerate()
            .take_while(|(b, _)| bounds_in(*b, self.sub_bits).1 <= le_ns)
            .map(|(_, n)| n)
            .sum()
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

/// Bucket upper bounds, ns: 2^10 (≈1 µs) to 2^34 (≈17 s), four per octave.
#[allow(clippy::arithmetic_side_effects)] // constants: e in 10..34
pub fn bounds_ns() -> Vec<u64> {
    (10..34)
        .flat_map(|e| (0..4).map(move |q| (1u64 << e) + q * (1u64 << (e - 2))))
        .chain(std::iter::once(1u64 << 34))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fuzzing found it: values a guest chose wrapped the sum.
    #[test]
    fn a_sum_at_its_end_stays_there() {
        let mut h = Hist::fine();
        h.record(u64::MAX);
        h.record(u64::MAX);
        assert_eq!((h.count, h.sum_ns, h.max_ns), (2, u64::MAX, u64::MAX));
        let mut m = Hist::fine();
        m.record(1);
        m.merge(&h);
        assert_eq!((m.count, m.sum_ns), (3, u64::MAX));
    }

    #[test]
    fn buckets_are_contiguous_and_cover_their_values() {
        for bits in [HIST_SUB_BITS, FINE_SUB_BITS] {
            let n = buckets_for(bits);
            let mut prev_hi = 0;
            for b in 0..n {
                let (lo, hi) = bounds_in(b, bits);
                assert_eq!(
                    lo, prev_hi,
                    "layout {bits}: bucket {b} starts where the last ended"
                );
                assert!(hi > lo);
                assert_eq!(bucket_in(lo, bits), b);
                assert_eq!(bucket_in(hi - 1, bits), b);
                prev_hi = hi;
            }
            assert_eq!(bucket_in(u64::MAX, bits), n - 1);
        }
        assert_eq!(buckets_for(HIST_SUB_BITS), crate::abi::HIST_BUCKETS);
    }

    #[test]
    fn bucket_width_is_within_one_sub_bucket() {
        for bits in [HIST_SUB_BITS, FINE_SUB_BITS] {
            let sub = 1usize << bits;
            for b in 2 * sub..buckets_for(bits) {
                let (lo, hi) = bounds_in(b, bits);
                assert!((hi - lo) as f64 / lo as f64 <= 1.0 / sub as f64 + 1e-12);
            }
        }
    }

    /// A tail with a cliff (most requests fast, one in seventy slow): the
    /// p99 falls among the few in between, where the kernel's layout can
    /// only interpolate across an eighth; the fine one stays within 2 %.
    #[test]
    fn the_fine_layout_finds_a_p99_at_a_cliff() {
        let mut vals: Vec<u64> = (0..1970).map(|i| 300_000 + i * 50).collect();
        vals.extend([1_190_000, 1_230_000, 1_250_000, 1_280_000, 1_300_000]);
        vals.extend((0..25).map(|i| 3_000_000 + i * 100_000));
        let mut fine = Hist::fine();
        for &v in &vals {
            fine.record(v);
        }
        vals.sort_unstable();
        // Nearest rank: the ceil(q·n)-th smallest.
        let exact = vals[(0.99 * vals.len() as f64).ceil() as usize - 1] as f64;
        let got = fine.quantile_ns(0.99);
        assert!((got - exact).abs() / exact < 0.02, "p99 {got} vs {exact}");
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
    fn a_fine_histogram_coarsens_bucket_for_bucket() {
        let mut fine = Hist::fine();
        let mut kernel = Hist::default();
        for v in [
            3u64,
            17,
            130,
            999,
            1_000,
            1_023,
            65_535,
            1 << 20,
            123_456_789,
        ] {
            fine.record(v);
            kernel.record(v);
        }
        assert_eq!(fine.coarse(), kernel);
        let mut mixed = Hist::default();
        mixed.record(5);
        mixed.merge_any(&fine);
        assert_eq!((mixed.count, mixed.sum_ns), (10, kernel.sum_ns + 5));
    }

    #[test]
    fn empty_histogram_summarises_to_zero() {
        assert_eq!(Hist::default().summary(), Summary::default());
    }
}
