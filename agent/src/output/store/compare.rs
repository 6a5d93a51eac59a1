//! Stored runs side by side: each tail band's segments, and what moved.

use std::fmt::Write as _;

use anyhow::{bail, Result};
use serde::Serialize;

use super::StoredRun;
use crate::model::{
    diagnosis::Diagnosis,
    tails::{TailEntry, PARTS},
};

pub fn band_name(from_pct: f64) -> String {
    if from_pct == 0.0 {
        "all".into()
    } else {
        format!("p{}+", trim(from_pct))
    }
}

fn trim(v: f64) -> String {
    let s = format!("{v:.1}");
    s.trim_end_matches(".0").to_string()
}

/// The tails of two runs for the same virtual disk and op: by VM, disk and
/// op; else by disk and op when each run has one VM (one workload on two
/// platforms, its VMs named differently).
pub fn pairs<'a>(a: &'a StoredRun, b: &'a StoredRun) -> Vec<(&'a TailEntry, &'a TailEntry)> {
    let mut out = Vec::new();
    for x in &a.tails {
        if let Some(y) = b
            .tails
            .iter()
            .find(|y| y.vm == x.vm && y.disk == x.disk && y.op == x.op)
        {
            out.push((x, y));
        }
    }
    if out.is_empty() {
        for x in &a.tails {
            let mut ys = b.tails.iter().filter(|y| y.disk == x.disk && y.op == x.op);
            let xs = a
                .tails
                .iter()
                .filter(|z| z.disk == x.disk && z.op == x.op)
                .count();
            if let (Some(y), None, 1) = (ys.next(), ys.next(), xs) {
                out.push((x, y));
            }
        }
    }
    // One workload on two platforms: the disk's name is the platform's
    // (vd0 here, drive-virtio-disk0 there); one disk per op on each side
    // pairs by op.
    if out.is_empty() {
        for x in &a.tails {
            let one = |r: &'a StoredRun| {
                let mut it = r.tails.iter().filter(|z| z.op == x.op);
                match (it.next(), it.next()) {
                    (Some(z), None) => Some(z),
                    _ => None,
                }
            };
            if let (Some(_), Some(y)) = (one(a), one(b)) {
                out.push((x, y));
            }
        }
    }
    out
}

/// Where a difference between two runs lies at one statistic.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Difference {
    /// "mean", "p99", "p99.9".
    pub at: String,
    pub a_us: [f64; 5],
    pub b_us: [f64; 5],
    /// The I/Os behind each side's figures.
    pub a_ios: u64,
    pub b_ios: u64,
    /// The segment whose change is the largest, and its share of the
    /// total's change.
    pub segment: &'static str,
    pub share: f64,
}

/// Fewer I/Os than this in a tail and its mean is a handful of I/Os, not
/// the run's tail: one stall anywhere decides the verdict.
pub const FEW_IOS: u64 = 10;

impl Difference {
    pub fn few(&self) -> bool {
        self.a_ios.min(self.b_ios) < FEW_IOS
    }
}

/// Mean, p99 tail and p99.9 tail of two runs' I/Os on one disk, and the
/// segment that explains each difference.
pub fn differences(x: &TailEntry, y: &TailEntry) -> Vec<Difference> {
    [("mean", 0.0), ("p99", 99.0), ("p99.9", 99.9)]
        .iter()
        .filter_map(|&(at, pct)| {
            let (a, b) = (x.band(pct)?, y.band(pct)?);
            let d: Vec<f64> = (0..5).map(|i| b.mean_us[i] - a.mean_us[i]).collect();
            let (i, di) = (1..5)
                .map(|i| (i, d[i]))
                .max_by(|p, q| p.1.abs().total_cmp(&q.1.abs()))?;
            Some(Difference {
                at: at.into(),
                a_us: a.mean_us,
                b_us: b.mean_us,
                a_ios: a.ios,
                b_ios: b.ios,
                segment: PARTS[i],
                share: if d[0].abs() > 0.0 { di / d[0] } else { 0.0 },
            })
        })
        .collect()
}

/// The run length whose tail at `at` holds `FEW_IOS` I/Os.
fn tail_needs(at: &str) -> u64 {
    let pct: f64 = at.trim_start_matches('p').parse().unwrap_or(99.0);
    (FEW_IOS as f64 / (1.0 - pct / 100.0)).round() as u64
}

/// `iospan compare`'s text: each pair of runs against the first.
pub fn compare_text(runs: &[StoredRun]) -> Result<String> {
    let Some((base, rest)) = runs.split_first() else {
        bail!("give two runs or more");
    };
    if rest.is_empty() {
        bail!("give two runs or more (one given: {})", base.label);
    }
    // Runs of one label from several hosts (one workload, two platforms)
    // are told apart by their host.
    let name = |r: &StoredRun| {
        if runs
            .iter()
            .any(|o| o.label == r.label && o.host.name != r.host.name)
        {
            format!("{}@{}", r.label, r.host.name)
        } else {
            r.label.clone()
        }
    };
    let mut out = String::new();
    if runs.iter().any(|r| r.host != base.host) {
        for r in runs {
            let _ = writeln!(out, "{}: {}", name(r), r.host.describe());
        }
        out.push('\n');
    }
    for other in rest {
        let ps = pairs(base, other);
        if ps.is_empty() {
            bail!(
                "runs {} and {} have no virtual disk in common to compare (by VM, disk and op; or by disk and op with one VM each)",
                name(base),
                name(other)
            );
        }
        for (x, y) in ps {
            pair_text(&mut out, (&name(base), &name(other)), x, y);
            moved_text(&mut out, (base, other), (&name(base), &name(other)), (x, y));
            out.push('\n');
        }
    }
    Ok(out)
}

/// One virtual disk of two runs: each tail's segments, A, B and B − A,
/// and the segment that explains the change.
fn pair_text(out: &mut String, (a_name, b_name): (&str, &str), x: &TailEntry, y: &TailEntry) {
    let _ = writeln!(
        out,
        "{} vs {} — {} {} (A: {} {} I/Os{}; B: {} {} I/Os{})",
        a_name,
        b_name,
        x.disk,
        x.op,
        x.vm,
        x.ios,
        if x.guest_observed {
            ""
        } else {
            ", host window"
        },
        y.vm,
        y.ios,
        if y.guest_observed {
            ""
        } else {
            ", host window"
        },
    );
    let _ = writeln!(
        out,
        "  {:<14} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "µs", "total", "guest", "hv", "engine", "device"
    );
    for d in differences(x, y) {
        let row = |name: &str, v: [f64; 5]| {
            format!(
                "  {:<14} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}\n",
                name, v[0], v[1], v[2], v[3], v[4]
            )
        };
        let label = if d.at == "mean" {
            "mean".to_string()
        } else {
            format!("{}+ tail", d.at)
        };
        *out += &row(&format!("{label} A"), d.a_us);
        *out += &row(&format!("{label} B"), d.b_us);
        let delta: [f64; 5] = std::array::from_fn(|i| d.b_us[i] - d.a_us[i]);
        *out += &row("  B − A", delta);
        let _ = writeln!(
            out,
            "  → at {}: {} explains {:.0}% of the change ({:+.1} of {:+.1} µs){}",
            d.at,
            d.segment,
            d.share * 100.0,
            delta[PARTS.iter().position(|p| *p == d.segment).unwrap_or(0)],
            delta[0],
            if d.at == "mean" {
                String::new()
            } else {
                format!(
                    "; {} and {} I/Os{}",
                    d.a_ios,
                    d.b_ios,
                    if d.few() {
                        format!(
                            ": too few to speak for the runs' tails (at {} they need {} I/Os or more each)",
                            d.at,
                            tail_needs(&d.at)
                        )
                    } else {
                        String::new()
                    }
                )
            }
        );
    }
}

/// A stored run's diagnosis of one disk and op.
fn diagnosis_of<'a>(r: &'a StoredRun, t: &TailEntry) -> Option<&'a Diagnosis> {
    r.report
        .entries
        .iter()
        .find(|e| e.vm.as_deref() == Some(t.vm.as_str()) && e.disk == t.disk && e.op == t.op)?
        .diagnosis
        .as_ref()
}

/// Whether the change from A to B moved the segment A's diagnosis named,
/// and by how much of A's latency; then what B's diagnosis says.
fn moved_text(
    out: &mut String,
    (a, b): (&StoredRun, &StoredRun),
    (a_name, b_name): (&str, &str),
    (x, y): (&TailEntry, &TailEntry),
) {
    let (Some(da), Some(all_a), Some(all_b)) = (diagnosis_of(a, x), x.band(0.0), y.band(0.0))
    else {
        return;
    };
    match da.segment {
        Some(seg) => {
            let i = PARTS.iter().position(|p| *p == seg.as_str()).unwrap_or(0);
            let delta = all_b.mean_us[i] - all_a.mean_us[i];
            let total = all_b.mean_us[0] - all_a.mean_us[0];
            let _ = writeln!(
                out,
                "  → {a_name}'s diagnosis named {} ({}): the change moved it by {delta:+.1} µs, \
                 {:+.0} % of {a_name}'s latency (the total moved by {total:+.1} µs)",
                seg.as_str(),
                da.cause.as_str(),
                100.0 * delta / all_a.mean_us[0].max(1e-9),
            );
        }
        None => {
            let _ = writeln!(
                out,
                "  → {a_name}'s diagnosis named no bottleneck: {}",
                da.summary
            );
        }
    }
    if let Some(db) = diagnosis_of(b, y) {
        let _ = writeln!(out, "  → {b_name}'s diagnosis: {}", db.summary);
    }
}
