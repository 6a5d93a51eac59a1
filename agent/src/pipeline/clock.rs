//! A guest's clock against the host's, from the bounds its joined
//! requests give: the host sees a kick after the guest made it and raises
//! a completion before the guest sees it, so each joined request bounds
//! the offset θ = host − guest from both sides. The bounds of each second
//! are kept; the offsets violating the fewest give the estimate, their
//! spread its uncertainty, the windows' midpoints its drift.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// The offset of one VM's guest clock, from the bounds its requests give.
///
/// A bound can be wrong: a host kick taken from an earlier notification
/// gives an upper bound below the truth, a completion the guest reaped
/// before its interrupt was raised a lower bound above it. Per window the
/// offset is where the fewest bounds are violated; those few are counted
/// as contradicting, and the interval where that minimum holds is the
/// uncertainty.
#[derive(Clone, Debug, Default)]
pub struct Clock {
    /// The bounds of each second, oldest first.
    windows: VecDeque<BoundsWindow>,
    pub pairs: u64,
    /// The latest window's estimate, refreshed every few pairs (matching
    /// asks for it per request).
    cached: Option<i64>,
}

/// One second's bounds on a guest clock's offset.
#[derive(Clone, Debug, Default)]
struct BoundsWindow {
    /// Its start, on the host clock.
    start_ns: u64,
    lower: Vec<i64>,
    upper: Vec<i64>,
}

/// The offsets that violate the fewest bounds of a window: `low..=high`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct OffsetInterval {
    low: i64,
    high: i64,
    violations: u64,
}

impl OffsetInterval {
    /// Halves first: both ends come from a guest's stamps, and their sum
    /// may not fit.
    fn mid(&self) -> i64 {
        (self.low / 2).saturating_add(self.high / 2)
    }

    /// Half its width, at most i64's top (its ends may lie i64's whole
    /// range apart).
    fn half_width(&self) -> i64 {
        let w = i128::from(self.high).saturating_sub(i128::from(self.low)) / 2;
        i64::try_from(w).unwrap_or(i64::MAX)
    }
}

/// What is known of a guest clock: host = guest + offset_ns (+ drift).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClockEstimate {
    pub offset_ns: i64,
    /// Half the width of the latest window's interval: the offset lies
    /// within ± this.
    pub uncertainty_ns: i64,
    /// Rate of the offset's change across windows, in parts per million.
    pub drift_ppm: f64,
    pub pairs: u64,
    /// Bounds set aside as contradicting the others, over all windows.
    pub contradicting_bounds: u64,
}

const WINDOW_NS: u64 = 1_000_000_000;
const MAX_WINDOWS: usize = 120;
/// Bounds kept per window and side.
const MAX_BOUNDS: usize = 2048;

/// The interval of offsets violating the fewest bounds.
fn best_interval(lower: &[i64], upper: &[i64]) -> Option<OffsetInterval> {
    let mut lo = lower.to_vec();
    let mut hi = upper.to_vec();
    lo.sort_unstable();
    hi.sort_unstable();
    // Candidate offsets: every bound. violations(θ) = #lower > θ + #upper < θ.
    let mut cands: Vec<i64> = lo.iter().chain(hi.iter()).copied().collect();
    cands.sort_unstable();
    cands.dedup();
    let viol = |t: i64| {
        lo.len()
            .saturating_sub(lo.partition_point(|&l| l <= t))
            .saturating_add(hi.partition_point(|&u| u < t))
    };
    let best = cands.iter().map(|&t| viol(t)).min()?;
    let at: Vec<i64> = cands.iter().copied().filter(|&t| viol(t) == best).collect();
    Some(OffsetInterval {
        low: *at.first()?,
        high: *at.last()?,
        violations: best as u64,
    })
}

impl Clock {
    pub(super) fn add(&mut self, host_ns: u64, lo: Option<i64>, hi: Option<i64>) {
        self.pairs = self.pairs.saturating_add(1);
        let start = host_ns.saturating_sub(host_ns.checked_rem(WINDOW_NS).unwrap_or(0));
        if self.windows.back().is_none_or(|w| w.start_ns != start) {
            self.windows.push_back(BoundsWindow {
                start_ns: start,
                ..Default::default()
            });
            if self.windows.len() > MAX_WINDOWS {
                self.windows.pop_front();
            }
        }
        if let Some(w) = self.windows.back_mut() {
            if let Some(lo) = lo.filter(|_| w.lower.len() < MAX_BOUNDS) {
                w.lower.push(lo);
            }
            if let Some(hi) = hi.filter(|_| w.upper.len() < MAX_BOUNDS) {
                w.upper.push(hi);
            }
        }
        if self.pairs % 64 == 1 {
            self.cached = self
                .windows
                .back()
                .and_then(|w| best_interval(&w.lower, &w.upper))
                .map(|i| i.mid());
        }
    }

    pub fn estimate(&self) -> Option<ClockEstimate> {
        let fits: Vec<(u64, OffsetInterval)> = self
            .windows
            .iter()
            .filter(|w| !w.lower.is_empty() && !w.upper.is_empty())
            .filter_map(|w| best_interval(&w.lower, &w.upper).map(|i| (w.start_ns, i)))
            .collect();
        let (_, last) = *fits.last()?;
        let pts: Vec<(f64, f64)> = fits
            .iter()
            .map(|(start, i)| (*start as f64, (i.low as f64 + i.high as f64) / 2.0))
            .collect();
        // Least squares through the windows' midpoints: the drift.
        let n = pts.len() as f64;
        let (mx, my) = pts
            .iter()
            .fold((0.0, 0.0), |a, c| (a.0 + c.0 / n, a.1 + c.1 / n));
        let (sxy, sxx) = pts.iter().fold((0.0, 0.0), |a, c| {
            (a.0 + (c.0 - mx) * (c.1 - my), a.1 + (c.0 - mx).powi(2))
        });
        Some(ClockEstimate {
            offset_ns: last.mid(),
            uncertainty_ns: last.half_width(),
            drift_ppm: if sxx > 0.0 { sxy / sxx * 1e6 } else { 0.0 },
            pairs: self.pairs,
            contradicting_bounds: fits
                .iter()
                .fold(0u64, |a, (_, i)| a.saturating_add(i.violations)),
        })
    }

    /// The current offset for matching, if known.
    pub(super) fn offset(&self) -> Option<i64> {
        self.cached
    }
}
