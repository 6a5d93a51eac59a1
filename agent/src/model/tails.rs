//! The tail's composition: the slowest I/Os of a (VM, virtual disk, op) at
//! each percentile band, and where their time went, per segment.

use serde::{Deserialize, Serialize};

use crate::model::Op;

/// The segments of one I/O as the tail keeps them: total, guest,
/// hypervisor, engine, device (ns; the guest's 0 without a guest agent,
/// the total then the host window).
pub type Parts = [u32; 5];

pub const PARTS: [&str; 5] = ["total", "guest", "hypervisor", "engine", "device"];

/// The percentiles whose tails are kept: everything, then the slowest
/// half, tenth, hundredth and thousandth.
pub const BAND_FROM: [f64; 5] = [0.0, 50.0, 90.0, 99.0, 99.9];

/// The I/Os at or above a percentile of total latency, and where their
/// time went on average.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Band {
    pub from_pct: f64,
    pub ios: u64,
    /// The total latency at the percentile (the band's fastest I/O).
    pub threshold_us: f64,
    /// Mean per part, in `PARTS` order.
    pub mean_us: [f64; 5],
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TailEntry {
    pub vm: String,
    pub disk: String,
    pub op: Op,
    pub ios: u64,
    /// I/Os per second from the first I/O to the last.
    #[serde(default)]
    pub iops: f64,
    /// More I/Os than kept: the bands are of a uniform sample.
    pub sampled: bool,
    /// Totals are guest-observed (guest agent), else host windows.
    pub guest_observed: bool,
    pub bands: Vec<Band>,
    /// Per part, (latency µs, fraction at or below) at log-spaced points.
    pub cdf: Vec<Vec<(f64, f64)>>,
}

impl TailEntry {
    pub fn band(&self, from_pct: f64) -> Option<&Band> {
        self.bands
            .iter()
            .find(|b| (b.from_pct - from_pct).abs() < 1e-9)
    }
}

pub fn bands(kept: &[Parts]) -> Vec<Band> {
    let mut sorted = kept.to_vec();
    sorted.sort_unstable_by_key(|p| p[0]);
    let n = sorted.len();
    BAND_FROM
        .iter()
        .filter_map(|&pct| {
            let first = ((pct / 100.0) * n as f64).floor() as usize;
            let tail = sorted.get(first.min(n)..)?;
            if tail.is_empty() {
                return None;
            }
            let mut mean_us = [0.0; 5];
            for p in tail {
                for (m, v) in mean_us.iter_mut().zip(p) {
                    *m += f64::from(*v);
                }
            }
            for m in &mut mean_us {
                *m /= tail.len() as f64 * 1e3;
            }
            Some(Band {
                from_pct: pct,
                ios: tail.len() as u64,
                threshold_us: tail.first().map_or(0.0, |p| f64::from(p[0]) / 1e3),
                mean_us,
            })
        })
        .collect()
}

pub fn cdf(kept: &[Parts]) -> Vec<Vec<(f64, f64)>> {
    (0..5)
        .map(|i| {
            let mut v: Vec<u32> = kept.iter().filter_map(|p| p.get(i).copied()).collect();
            v.sort_unstable();
            let n = v.len();
            let Some(&last) = v.last() else {
                return Vec::new();
            };
            // 200 points spread over the ranks, plus the last.
            let step = n.checked_div(200).unwrap_or(0).max(1);
            let mut pts: Vec<(f64, f64)> = v
                .iter()
                .enumerate()
                .step_by(step)
                .map(|(k, &x)| (f64::from(x) / 1e3, (k as f64 + 1.0) / n as f64))
                .collect();
            pts.push((f64::from(last) / 1e3, 1.0));
            pts
        })
        .collect()
}
