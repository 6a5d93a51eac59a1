//! Each virtual disk's figures beside QEMU's own accounting of the same
//! requests (`discover::qemu_counts`): its count of operations, and its
//! mean time per request, which runs from its device model taking the
//! request to its completion callback, so it is put beside iospan's engine
//! plus device.

use std::collections::{BTreeMap, BTreeSet};

use crate::{
    discover::qemu_counts::{DiskCounts, Source},
    model::{Op, Summary},
    output::report::{Entry, QemuCheck, RunReport},
};

/// What QEMU counted of one VM over a run.
#[derive(Clone, Debug)]
pub struct VmQemu {
    /// Where its counts were read (QEMU's monitor or libvirt, and each
    /// engine serving some of its disks), or why they could not be.
    pub sources: Vec<Source>,
    /// Per virtual disk, its counters over the run (last read less first).
    pub counts: BTreeMap<String, DiskCounts>,
    /// Disks whose counts are an engine's outside QEMU (vhost-user).
    pub engine_disks: BTreeSet<String>,
    /// Why a source's counters could not be read, when they could not.
    pub error: Option<String>,
    /// The VM was running when the run began: its first read is the
    /// run's start, so requests in flight then may fall on either side.
    pub predates_run: bool,
    /// Our count of its submitted requests just after QEMU's last read.
    pub submitted_at_last_read: Option<u64>,
    /// Of those, the ones not finished when that read began: in flight
    /// at it, so counted by QEMU or not (a read by libvirt's client takes
    /// tens of ms).
    pub unfinished_at_last_read: Option<u64>,
    /// The same just after QEMU's first read of a VM running before the
    /// run: ours counted from the probes' start, QEMU's from that read.
    pub submitted_at_first_read: Option<u64>,
    /// It exited within the run, this long after QEMU's last read.
    pub exited_ms_after_last_read: Option<u64>,
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
/// requests still in flight at the end, by name; `submitted`: each VM's
/// requests submitted over the run (ours).
pub fn compare(
    report: &mut RunReport,
    qemu: &BTreeMap<String, VmQemu>,
    inflight: &BTreeMap<String, u64>,
    submitted: &BTreeMap<String, u64>,
) -> u64 {
    let mut mismatches = 0;
    for v in &mut report.vms {
        if let Some(q) = qemu.get(&v.name) {
            let mut text = crate::discover::qemu_counts::describe_all(&q.sources);
            if let Some(e) = &q.error {
                text.push_str(&format!(" (not read: {e})"));
            }
            if let Some(ms) = q.exited_ms_after_last_read {
                text.push_str(&format!(
                    "; the VM exited within the run, at most {ms} ms after its counters' last read"
                ));
            }
            v.qemu_counts = Some(text);
        }
    }
    // QEMU's disks and ops with requests iospan has no entry for: a
    // mismatch as much as a different count.
    let mut missing: Vec<Entry> = Vec::new();
    for (vm, q) in qemu {
        for (disk, c) in &q.counts {
            for op in [Op::Read, Op::Write, Op::Flush] {
                let Some((ops, _, _)) = of_op(c, op) else {
                    continue;
                };
                let seen = report
                    .entries
                    .iter()
                    .any(|e| e.vm.as_deref() == Some(vm.as_str()) && e.disk == *disk && e.op == op);
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
        let Some(q) = qemu.get(vm) else {
            continue;
        };
        let Some(c) = q.counts.get(&e.disk) else {
            continue;
        };
        let summary = report.vms.iter().find(|v| v.name == vm);
        let flying = inflight.get(vm).copied().unwrap_or(0);
        let allow = Allowances {
            merged: summary.map_or(0, |v| v.engine_merged + v.host_merged),
            edge: if q.predates_run { 2 * flying } else { flying },
            // Requests submitted after QEMU's last read (a VM that exited:
            // its last requests, and QEMU's own as it closed its images)
            // are in ours, not in its.
            after_last_read: match (q.submitted_at_last_read, submitted.get(vm)) {
                (Some(at), Some(total)) => total.saturating_sub(at),
                _ => 0,
            },
            at_last_read: q.unfinished_at_last_read.unwrap_or(0),
            // A VM running before the run: QEMU's window begins at its
            // first read, ours when the probes started.
            before_first_read: q.submitted_at_first_read.unwrap_or(0),
        };
        let engine = q.engine_disks.contains(&e.disk);
        let Some(c) = check(c, e.op, e.ios + e.undelivered, &e.segments, engine, allow) else {
            continue;
        };
        mismatches += u64::from(c.mismatch);
        e.qemu = Some(c);
    }
    report.lost.qemu_mismatch = mismatches;
    mismatches
}

/// By how many requests QEMU's count of a VM disk may honestly differ
/// from ours.
#[derive(Clone, Copy, Debug, Default)]
pub struct Allowances {
    /// Guest requests we saw inside others (QEMU counts each).
    pub merged: u64,
    /// In flight at the window's edges.
    pub edge: u64,
    /// Ours after QEMU's last read, in flight at it, and before its first.
    pub after_last_read: u64,
    pub at_last_read: u64,
    pub before_first_read: u64,
}

/// One VM disk's `op` over a window: QEMU's counters `c` beside our
/// `iospan_ops` (timed plus undelivered) and our segments. None: QEMU
/// keeps no counter of that op.
pub fn check(
    c: &DiskCounts,
    op: Op,
    iospan_ops: u64,
    segments: &BTreeMap<String, Summary>,
    engine: bool,
    a: Allowances,
) -> Option<QemuCheck> {
    let (ops, bytes, ns) = of_op(c, op)?;
    let timed = |name: &str| segments.get(name).filter(|s| s.count > 0);
    let mean = |name: &str| timed(name).map(|s| s.mean_us);
    let max = |name: &str| timed(name).map(|s| s.max_us);
    // An engine that keeps no count of its exports' requests (QEMU's
    // storage daemon counts none for vhost-user-blk) reads zero: said,
    // not taken for a mismatch.
    let uncounted = engine && ops == 0 && iospan_ops > 0;
    let mismatch = !uncounted
        && (ops > iospan_ops + a.merged + a.edge
            || iospan_ops
                > ops + a.edge + a.after_last_read + a.at_last_read + a.before_first_read);
    Some(QemuCheck {
        ops,
        bytes,
        mean_us: (ops > 0).then(|| round3(ns as f64 / ops as f64 / 1000.0)),
        iospan_ops,
        diff: iospan_ops as i64 - ops as i64,
        merged_allowance: a.merged,
        edge_allowance: a.edge,
        after_last_read: a.after_last_read,
        in_flight_at_last_read: a.at_last_read,
        before_first_read: a.before_first_read,
        engine_device_mean_us: mean("engine")
            .zip(mean("device"))
            .map(|(a, b)| round3(a + b)),
        engine_device_max_us: max("engine").zip(max("device")).map(|(a, b)| round3(a + b)),
        pickup_to_done_mean_us: mean("pickup_to_done").map(round3),
        counted_by: if engine { "engine" } else { "qemu" }.into(),
        uncounted,
        mismatch,
    })
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// Whether QEMU's mean agrees with ours within `share`: it lies between
/// our pickup → host completion and our engine + device (QEMU's time ends
/// at its completion callback, which by device and thread comes before or
/// after it signals the guest), each widened by `share`. None: no figure
/// to hold it to.
pub fn means_agree(c: &QemuCheck, share: f64) -> Option<bool> {
    let (q, mean) = (c.mean_us?, c.engine_device_mean_us?);
    let lower = c.pickup_to_done_mean_us.unwrap_or(mean).min(mean);
    Some(q >= lower * (1.0 - share) && q <= merged_upper(c, mean) * (1.0 + share))
}

/// The most QEMU's mean can be, our requests' engine + device averaging
/// `mean`. QEMU counts a request it merged once per guest request in it,
/// each with the merged request's time, where we count it once: of its
/// `ops`, the `merged` ones add at most our longest request's time each
/// (`(ops - merged) * mean + merged * max`, over `ops`). Which requests
/// get merged is no accident (those that waited while the queue built
/// up), so no share of the mean bounds them: 1.62 × ours was seen with
/// 40 % merged, 1.20 with 25 %.
fn merged_upper(c: &QemuCheck, mean: f64) -> f64 {
    let merged = c.merged_allowance.min(c.ops);
    if merged == 0 {
        return mean;
    }
    let max = c.engine_device_max_us.unwrap_or(mean).max(mean);
    ((c.ops - merged) as f64 * mean + merged as f64 * max) / c.ops as f64
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn report(ios: u64) -> RunReport {
        let mut e = Entry::empty(Some("db01".into()), "vd0".into(), Op::Read);
        e.ios = ios;
        RunReport {
            duration_s: 10.0,
            entries: vec![e],
            ..Default::default()
        }
    }

    fn qemu(rd_ops: u64, engine: bool, at_last: Option<u64>) -> BTreeMap<String, VmQemu> {
        let counts = BTreeMap::from([(
            "vd0".to_string(),
            DiskCounts {
                rd_ops,
                rd_ns: rd_ops * 800_000,
                ..Default::default()
            },
        )]);
        BTreeMap::from([(
            "db01".to_string(),
            VmQemu {
                sources: vec![Source::Qmp {
                    socket: PathBuf::from("/run/q.sock"),
                    pid: 7,
                }],
                counts,
                engine_disks: if engine {
                    BTreeSet::from(["vd0".to_string()])
                } else {
                    BTreeSet::new()
                },
                error: None,
                predates_run: false,
                submitted_at_last_read: at_last,
                unfinished_at_last_read: None,
                submitted_at_first_read: None,
                exited_ms_after_last_read: at_last.map(|_| 40),
            },
        )])
    }

    fn check(r: &RunReport) -> &QemuCheck {
        r.entries[0].qemu.as_ref().expect("compared")
    }

    #[test]
    fn equal_counts_pass_and_one_more_is_a_mismatch() {
        let none = BTreeMap::new();
        let mut r = report(2000);
        assert_eq!(compare(&mut r, &qemu(2000, false, None), &none, &none), 0);
        let c = check(&r);
        assert_eq!(
            (c.ops, c.iospan_ops, c.diff, c.mismatch),
            (2000, 2000, 0, false)
        );
        assert_eq!(c.mean_us, Some(800.0));
        let mut r = report(2001);
        assert_eq!(compare(&mut r, &qemu(2000, false, None), &none, &none), 1);
        assert!(check(&r).mismatch);
        assert_eq!(r.lost.qemu_mismatch, 1);
    }

    #[test]
    fn requests_after_the_last_read_of_an_exited_vm_are_ours_alone() {
        let none = BTreeMap::new();
        // QEMU's last read was at 2000 submitted; 2 more came before it
        // exited (its own probes as it closed the image).
        let submitted = BTreeMap::from([("db01".to_string(), 2002)]);
        let mut r = report(2002);
        assert_eq!(
            compare(&mut r, &qemu(2000, false, Some(2000)), &none, &submitted),
            0
        );
        assert_eq!(check(&r).after_last_read, 2);
        assert!(r.vms.is_empty());
        // Beyond them: a mismatch still.
        let mut r = report(2005);
        assert_eq!(
            compare(&mut r, &qemu(2000, false, Some(2000)), &none, &submitted),
            1
        );
        // And QEMU counting more than ours is never excused by them.
        let mut r = report(1990);
        assert_eq!(
            compare(&mut r, &qemu(2000, false, Some(1990)), &none, &submitted),
            1
        );
    }

    #[test]
    fn requests_in_flight_at_the_last_read_may_fall_either_side() {
        let none = BTreeMap::new();
        // libvirt read 214 while ours had 218 submitted by the read's end,
        // 214 finished at its start; the VM made 605 and exited.
        let submitted = BTreeMap::from([("db01".to_string(), 605)]);
        let mut q = qemu(214, false, Some(218));
        q.get_mut("db01").unwrap().unfinished_at_last_read = Some(4);
        let mut r = report(605);
        assert_eq!(compare(&mut r, &q, &none, &submitted), 0);
        let c = check(&r);
        assert_eq!((c.after_last_read, c.in_flight_at_last_read), (387, 4));
        // One more of ours than those explain: a mismatch.
        let mut r = report(606);
        let submitted = BTreeMap::from([("db01".to_string(), 605)]);
        assert_eq!(compare(&mut r, &q, &none, &submitted), 1);
    }

    #[test]
    fn a_vm_running_before_the_run_is_compared_from_qemus_first_read() {
        let none = BTreeMap::new();
        let mut q = qemu(53851, false, None);
        let v = q.get_mut("db01").unwrap();
        v.predates_run = true;
        // Ours counted 840 before QEMU's first read of the run.
        v.submitted_at_first_read = Some(840);
        let mut r = report(54686);
        assert_eq!(compare(&mut r, &q, &none, &none), 0);
        assert_eq!(check(&r).before_first_read, 840);
        let mut r = report(54800);
        assert_eq!(compare(&mut r, &q, &none, &none), 1);
    }

    #[test]
    fn an_engine_that_counts_nothing_is_said_not_flagged() {
        let none = BTreeMap::new();
        let mut r = report(2000);
        assert_eq!(compare(&mut r, &qemu(0, true, None), &none, &none), 0);
        let c = check(&r);
        assert!(c.uncounted && !c.mismatch, "{c:?}");
        assert_eq!(c.counted_by, "engine");
        // An engine that counts: held to ours like QEMU.
        let mut r = report(2000);
        assert_eq!(compare(&mut r, &qemu(1500, true, None), &none, &none), 1);
        assert!(!check(&r).uncounted);
    }

    #[test]
    fn qemus_mean_may_lie_above_ours_by_what_it_merged() {
        // A CI boot: QEMU merged 499 of 2,001 sequential reads.
        let mut c = QemuCheck {
            ops: 2001,
            bytes: 0,
            mean_us: Some(85.445),
            iospan_ops: 1502,
            diff: -499,
            merged_allowance: 499,
            edge_allowance: 0,
            after_last_read: 0,
            in_flight_at_last_read: 0,
            before_first_read: 0,
            engine_device_mean_us: Some(71.136),
            engine_device_max_us: Some(412.5),
            pickup_to_done_mean_us: Some(42.867),
            counted_by: "qemu".into(),
            uncounted: false,
            mismatch: false,
        };
        assert_eq!(means_agree(&c, 0.10), Some(true));
        // The same means with nothing merged: QEMU's is 20 % above ours.
        c.merged_allowance = 0;
        assert_eq!(means_agree(&c, 0.10), Some(false));
        // Below pickup → completion by more than the share: never excused.
        c.merged_allowance = 499;
        c.mean_us = Some(38.0);
        assert_eq!(means_agree(&c, 0.10), Some(false));
        // Another: 794 of 2,001 merged, QEMU's mean 1.62 × ours (the
        // requests it merged had waited longest; weighed per QEMU request
        // ours was 507.5 µs): inside, where 1 + share + merged share
        // (1.50 × ours) was not.
        c.merged_allowance = 794;
        c.mean_us = Some(512.423);
        c.engine_device_mean_us = Some(316.873);
        c.engine_device_max_us = Some(9498.34);
        c.pickup_to_done_mean_us = Some(206.457);
        assert_eq!(means_agree(&c, 0.10), Some(true));
        // No merged request can be longer than our longest.
        assert!((merged_upper(&c, 316.873) - 3960.0).abs() < 1.0);
        c.mean_us = Some(3960.0 * 1.1 + 1.0);
        assert_eq!(means_agree(&c, 0.10), Some(false));
    }
}
