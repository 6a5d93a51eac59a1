//! A labelled run's time series: one point per interval and (VM, virtual
//! disk, op), built from the live frames.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{
    model::Op,
    output::live::{Frame, SEGMENTS},
};

/// One interval of a (VM, virtual disk, op).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Point {
    pub t_s: f64,
    pub iops: f64,
    /// p99 per live segment name (total, guest, hv, engine, device, queue).
    pub p99_us: BTreeMap<String, f64>,
    pub mean_us: BTreeMap<String, f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Series {
    pub vm: String,
    pub disk: String,
    pub op: Op,
    pub points: Vec<Point>,
}

/// Builds the time series from a run's frames, one interval at a time
/// (frames are not kept).
#[derive(Default)]
pub struct SeriesBuilder {
    t0: Option<f64>,
    prev: Option<Frame>,
    series: BTreeMap<(String, String, Op), Vec<Point>>,
}

impl SeriesBuilder {
    pub fn add(&mut self, f: &Frame) {
        let t0 = *self.t0.get_or_insert(f.at_s);
        if let Some(prev) = &self.prev {
            let secs = (f.at_s - prev.at_s).max(1e-3);
            for r in &f.vdisks {
                let d = r.since(prev.vdisks.iter().find(|p| p.same(r)));
                let mut p = Point {
                    t_s: f.at_s - t0,
                    iops: d.ios as f64 / secs,
                    p99_us: BTreeMap::new(),
                    mean_us: BTreeMap::new(),
                };
                for name in SEGMENTS {
                    if let Some(h) = d.segs.get(name).filter(|h| h.count > 0) {
                        p.p99_us.insert(name.into(), h.quantile_ns(0.99) / 1e3);
                        p.mean_us.insert(name.into(), h.mean_ns() / 1e3);
                    }
                }
                self.series
                    .entry((r.vm.clone(), r.disk.clone(), r.op))
                    .or_default()
                    .push(p);
            }
        }
        self.prev = Some(f.clone());
    }

    pub fn finish(self) -> Vec<Series> {
        self.series
            .into_iter()
            .map(|((vm, disk, op), points)| Series {
                vm,
                disk,
                op,
                points,
            })
            .collect()
    }
}
