//! Each virtual disk's figures beside QEMU's own accounting of the same
//! requests (`discover::qemu_counts`): its count of operations, and its
//! mean time per request, which runs from its device model taking the
//! request to its completion callback, so it is put beside iospan's engine
//! plus device.

use std::collections::BTreeMap;

use crate::{
    discover::qemu_counts::{DiskCounts, Source},
    model::Op,
    output::report::{Entry, QemuCheck, RunReport},
};

/// What QEMU counted of one VM over a run.
#[derive(Clone, Debug)]
pub struct VmQemu {
    pub source: Source,
    /// Per virtual disk, its counters over the run (last read less first).
    pub counts: BTreeMap<String, DiskCounts>,
    /// Why its counters could not be read, when they could not.
    pub error: Option<String>,
    /// The VM was running when the run began: its first read is the
    /// run's start, so requests in flight then may fall on either side.
    pub predates_run: bool,
}

/// QEMU's counters of `op`: (operations, bytes, total ns).
fn of_op(c: &DiskCounts, op: Op) -> Option<(u64, u64, u64)> {
    match op {
        Op::Read => Some((c.rd_ops, c.rd_bytes, c.rd_ns)),
        Op::Write => Some((c.wr_ops, c.wr_bytes, c.wr_ns)),
        Op::Flush => Some((c.fl_ops, 0, c.fl_ns)),
        _ => None,
    }
}

/// Puts QEMU's figures beside every VM entry whose VM's counters were
/// read, and an entry of zero requests beside QEMU's counts that iospan has
/// none for; returns how many entries mismatch. `inflight`: each VM's
/// requests still in flight at the end, by name.
pub fn compare(
    report: &mut RunReport,
    qemu: &BTreeMap<String, VmQemu>,
    inflight: &BTreeMap<String, u64>,
) -> u64 {
    let mut mismatches = 0;
    for v in &mut report.vms {
        if let Some(q) = qemu.get(&v.name) {
            v.qemu_counts = Some(match &q.error {
                Some(e) => format!("{} (not read: {e})", q.source.describe()),
                None => q.source.describe(),
            });
        }
    }
    // QEMU's disks and ops with requests iospan has no entry for: a
    // mismatch as much as a different count.
    let mut missing: Vec<Entry> = Vec::new();
    for (vm, q) in qemu {
        if q.error.is_some() {
            continue;
        }
        for (disk, c) in &q.counts {
            for op in [Op::Read, Op::Write, Op::Flush] {
                let Some((ops, _, _)) = of_op(c, op) else {
                    continue;
                };
                let seen = report.entries.iter().any(|e| {
                    e.vm.as_deref() == Some(vm.as_str()) && e.disk == *disk && e.op == op
                });
                if ops > 0 && !seen {
                    missing.push(Entry::empty(Some(vm.clone()), disk.clone(), op));
                }
            }
        }
    }
    report.entries.extend(missing);
    for e in &mut report.entries {
        let Some(vm) = e.vm.as_deref() else {
            continue;
        };
        let Some(q) = qemu.get(vm).filter(|q| q.error.is_none()) else {
            continue;
        };
        let Some(c) = q.counts.get(&e.disk) else {
            continue;
        };
        let Some((ops, bytes, ns)) = of_op(c, e.op) else {
            continue;
        };
        let summary = report.vms.iter().find(|v| v.name == vm);
        let merged = summary.map_or(0, |v| v.engine_merged + v.host_merged);
        let flying = inflight.get(vm).copied().unwrap_or(0);
        let edge = if q.predates_run { 2 * flying } else { flying };
        let iospan_ops = e.ios + e.undelivered;
        let mean = |name: &str| e.segments.get(name).filter(|s| s.count > 0).map(|s| s.mean_us);
        let mismatch = ops > iospan_ops + merged + edge || iospan_ops > ops + edge;
        mismatches += u64::from(mismatch);
        e.qemu = Some(QemuCheck {
            ops,
            bytes,
            mean_us: (ops > 0).then(|| round3(ns as f64 / ops as f64 / 1000.0)),
            iospan_ops,
            diff: iospan_ops as i64 - ops as i64,
            merged_allowance: merged,
            edge_allowance: edge,
            engine_device_mean_us: mean("engine")
                .zip(mean("device"))
                .map(|(a, b)| round3(a + b)),
            mismatch,
        });
    }
    report.lost.qemu_mismatch = mismatches;
    mismatches
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// Whether QEMU's mean is within `share` of iospan's engine + device
/// (None: one of them has no figure).
pub fn means_agree(c: &QemuCheck, share: f64) -> Option<bool> {
    let (q, i) = (c.mean_us?, c.engine_device_mean_us?);
    Some((q - i).abs() <= share * i.max(q))
}
