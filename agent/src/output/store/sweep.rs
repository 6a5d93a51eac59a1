//! A sweep's stored result: runs at rising queue depth (or jobs), their
//! curves, and the knee where IOPS stop rising and latency climbs.

use std::{collections::BTreeMap, fmt::Write as _};

use serde::{Deserialize, Serialize};

use super::StoredRun;
use crate::model::{tails::PARTS, Op};

/// One level of a sweep, for one VM disk and op.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Level {
    pub value: u32,
    pub label: String,
    /// Over the disk's busy span (`TailEntry::iops`).
    pub iops: f64,
    /// p99 of the total (guest-observed where joined, else the host window).
    pub p99_us: f64,
    /// Mean per part (`PARTS`), over all I/Os.
    pub mean_us: [f64; 5],
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Knee {
    /// The last level before IOPS stopped growing while latency rose.
    pub at: u32,
    pub iops: f64,
    pub next: u32,
    pub iops_gain: f64,
    pub p99_gain: f64,
    /// The segment whose mean grew most from the knee to the next level.
    pub segment: String,
    pub segment_growth_us: f64,
    /// The level past the knee as its run diagnosed it: what limits the
    /// disk there (docs/diagnosis.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diagnosis: Option<crate::model::diagnosis::Diagnosis>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SweepCurve {
    pub vm: String,
    pub disk: String,
    pub op: Op,
    pub levels: Vec<Level>,
    pub knee: Option<Knee>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SweepResult {
    pub schema: String,
    /// "qd" or "jobs".
    pub over: String,
    pub command: Vec<String>,
    pub curves: Vec<SweepCurve>,
}

/// From one level to the next, IOPS grew by less than this per doubling of
/// the level (queue depth or jobs)...
pub const KNEE_IOPS_PER_DOUBLING: f64 = 0.15;

/// ... while p99 latency grew by more than this: saturated.
pub const KNEE_P99_GAIN: f64 = 0.25;

/// The first level past which IOPS stops growing while latency rises.
pub fn knee(levels: &[Level]) -> Option<Knee> {
    levels.windows(2).find_map(|w| {
        let (a, b) = (&w[0], &w[1]);
        if a.iops <= 0.0 || a.p99_us <= 0.0 {
            return None;
        }
        let iops_gain = b.iops / a.iops - 1.0;
        let p99_gain = b.p99_us / a.p99_us - 1.0;
        let doublings = (f64::from(b.value) / f64::from(a.value.max(1))).log2();
        if doublings <= 0.0 {
            return None;
        }
        let per_doubling = (b.iops / a.iops).powf(1.0 / doublings) - 1.0;
        if per_doubling >= KNEE_IOPS_PER_DOUBLING || p99_gain <= KNEE_P99_GAIN {
            return None;
        }
        let (i, g) = (1..5)
            .map(|i| (i, b.mean_us[i] - a.mean_us[i]))
            .max_by(|x, y| x.1.total_cmp(&y.1))?;
        Some(Knee {
            at: a.value,
            iops: a.iops,
            next: b.value,
            iops_gain,
            p99_gain,
            segment: PARTS[i].to_string(),
            segment_growth_us: g,
            diagnosis: None,
        })
    })
}

/// The diagnosis a level's run gave one VM disk and op.
fn levels_past(
    runs: &[(u32, StoredRun)],
    level: u32,
    (vm, disk, op): (&str, &str, Op),
) -> Option<crate::model::diagnosis::Diagnosis> {
    let (_, run) = runs.iter().find(|(v, _)| *v == level)?;
    run.report
        .entries
        .iter()
        .find(|e| e.vm.as_deref() == Some(vm) && e.disk == disk && e.op == op)?
        .diagnosis
        .clone()
}

/// The levels' figures per VM disk and op, from their stored runs.
pub fn curves(levels: &[(u32, StoredRun)]) -> Vec<SweepCurve> {
    let levels_runs = levels;
    let mut by: BTreeMap<(String, String, Op), Vec<Level>> = BTreeMap::new();
    for (value, run) in levels {
        for t in &run.tails {
            let Some(all) = t.band(0.0) else { continue };
            let entry = run.report.entries.iter().find(|e| {
                e.vm.as_deref() == Some(t.vm.as_str()) && e.disk == t.disk && e.op == t.op
            });
            let Some(e) = entry else { continue };
            let p99_us = e
                .stitched
                .as_ref()
                .and_then(|s| s.segments.get("total"))
                .or_else(|| e.segments.get("host_window"))
                .map_or(0.0, |s| s.p99_us);
            by.entry((t.vm.clone(), t.disk.clone(), t.op))
                .or_default()
                .push(Level {
                    value: *value,
                    label: run.label.clone(),
                    iops: t.iops,
                    p99_us,
                    mean_us: all.mean_us,
                });
        }
    }
    by.into_iter()
        .map(|((vm, disk, op), levels)| {
            let knee = knee(&levels).map(|mut k| {
                k.diagnosis = levels_past(levels_runs, k.next, (&vm, &disk, op));
                k
            });
            SweepCurve {
                knee,
                vm,
                disk,
                op,
                levels,
            }
        })
        .collect()
}

impl SweepResult {
    pub fn text(&self) -> String {
        let mut out = String::new();
        for c in &self.curves {
            let _ = writeln!(
                out,
                "{} {} {} — sweep over {}",
                c.vm, c.disk, c.op, self.over
            );
            let _ = writeln!(
                out,
                "  {:>6} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
                self.over, "IOPS", "p99 µs", "mean µs", "guest", "hv", "engine", "device"
            );
            for l in &c.levels {
                let mark = if c.knee.as_ref().is_some_and(|k| k.at == l.value) {
                    "  ← knee"
                } else {
                    ""
                };
                let _ = writeln!(
                    out,
                    "  {:>6} {:>9.0} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}{mark}",
                    l.value,
                    l.iops,
                    l.p99_us,
                    l.mean_us[0],
                    l.mean_us[1],
                    l.mean_us[2],
                    l.mean_us[3],
                    l.mean_us[4]
                );
            }
            match &c.knee {
                Some(k) => {
                    let _ = writeln!(
                        out,
                        "  knee at {} {}: {:.0} IOPS; at {} IOPS {:+.0}% while p99 {:+.0}%; {} grew most ({:+.1} µs mean)",
                        self.over,
                        k.at,
                        k.iops,
                        k.next,
                        k.iops_gain * 100.0,
                        k.p99_gain * 100.0,
                        k.segment,
                        k.segment_growth_us
                    );
                    let _ = writeln!(
                        out,
                        "  past the knee the workload's own concurrency adds latency, not IOPS: \
                         {} {} would do as much, faster",
                        self.over, k.at
                    );
                    if let Some(d) = &k.diagnosis {
                        let _ = writeln!(
                            out,
                            "  at {} {}, what limits it: {}",
                            self.over,
                            k.next,
                            d.text().replace('\n', "\n  ")
                        );
                    }
                }
                None => {
                    let _ = writeln!(
                        out,
                        "  no knee: from each level to the next, IOPS grew by {:.0}% or more per doubling, or p99 by {:.0}% or less",
                        KNEE_IOPS_PER_DOUBLING * 100.0,
                        KNEE_P99_GAIN * 100.0
                    );
                }
            }
            out.push('\n');
        }
        out
    }
}
