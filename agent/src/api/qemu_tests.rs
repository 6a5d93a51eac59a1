use std::collections::BTreeMap;

use super::*;
use crate::{
    discover::qemu_counts::DiskCounts,
    model::{Hist, Op},
    output::live::FrameQemu,
};

fn frame(at_s: f64, ios: u64, inflight: u64, qemu_ops: Option<u64>) -> Frame {
    let mut segs = BTreeMap::new();
    let mut h = Hist::fine();
    for _ in 0..ios {
        h.record(100_000);
    }
    segs.insert("total".to_string(), h);
    Frame {
        at_s,
        vdisks: vec![Row {
            vm: "db01".into(),
            disk: "vd0".into(),
            queue: None,
            op: Op::Read,
            ios,
            bytes: ios * 4096,
            inflight,
            undelivered: 0,
            guest_observed: false,
            segs,
        }],
        qemu: qemu_ops.map(|ops| {
            BTreeMap::from([(
                "db01".to_string(),
                FrameQemu {
                    source: "QMP at /run/q.sock".into(),
                    counts: BTreeMap::from([(
                        "vd0".to_string(),
                        DiskCounts {
                            rd_ops: ops,
                            rd_ns: ops * 90_000,
                            ..Default::default()
                        },
                    )]),
                    ..Default::default()
                },
            )])
        }),
        ..Default::default()
    }
}

#[test]
fn a_run_puts_qemus_count_beside_each_vm_disk() {
    // Ours: 1,000 over the run; QEMU's: 996, 4 in flight at its end.
    let r = bench_report(
        &frame(1.0, 500, 2, Some(498)),
        &frame(3.0, 1500, 4, Some(1494)),
    );
    let q = r.entries[0].qemu.as_ref().expect("compared");
    assert_eq!(
        (q.ops, q.iospan_ops, q.diff, q.edge_allowance),
        (996, 1000, 4, 6)
    );
    assert!(!q.mismatch);
    assert_eq!(q.mean_us, Some(90.0));
    assert_eq!(r.qemu_counts["db01"], "QMP at /run/q.sock");
    // Beyond the requests in flight at the edges: flagged.
    let r = bench_report(
        &frame(1.0, 500, 0, Some(498)),
        &frame(3.0, 1500, 0, Some(1400)),
    );
    assert!(r.entries[0].qemu.as_ref().unwrap().mismatch);
    // Without QEMU's counters at both ends: nothing beside it.
    let r = bench_report(&frame(1.0, 500, 0, None), &frame(3.0, 1500, 0, Some(1400)));
    assert!(r.entries[0].qemu.is_none() && r.qemu_counts.is_empty());
}
