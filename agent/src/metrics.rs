//! Prometheus text exposition of what a run has measured so far: latency
//! histograms per disk and per VM/virtual disk/op/segment (classic buckets,
//! four per power of two from 1 µs to 16 s, boundaries of the histograms'
//! own layouts, so the counts are exact), I/O and byte counters, losses,
//! trace export and the agent's own cost.

use std::fmt::Write;

use crate::{
    bpf::block::{BlockSnapshot, Counters},
    correlate::{HostSplit, SplitKey},
    disks,
    export::ExportCounters,
    model::{hist::Hist, BlkSegment},
    stitch::{StitchKey, Stitched},
    vms::Registry,
};

/// Bucket upper bounds, ns: 2^10 (≈1 µs) to 2^34 (≈17 s), four per octave.
pub fn bounds_ns() -> Vec<u64> {
    (10..34)
        .flat_map(|e| (0..4).map(move |q| (1u64 << e) + q * (1u64 << (e - 2))))
        .chain(std::iter::once(1u64 << 34))
        .collect()
}

/// Everything `render` shows.
pub struct View<'a> {
    pub snap: &'a BlockSnapshot,
    pub splits: &'a std::collections::BTreeMap<SplitKey, HostSplit>,
    pub stitched: &'a std::collections::BTreeMap<StitchKey, Stitched>,
    pub known: &'a Registry,
    pub export: Option<ExportCounters>,
    pub cpu_s: (f64, f64),
}

fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn labels(pairs: &[(&str, &str)]) -> String {
    let inner: Vec<String> = pairs
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", esc(v)))
        .collect();
    inner.join(",")
}

fn hist(out: &mut String, name: &str, l: &str, h: &Hist, bounds: &[u64]) {
    for &b in bounds {
        let _ = writeln!(
            out,
            "{name}_bucket{{{l},le=\"{}\"}} {}",
            b as f64 / 1e9,
            h.count_below(b)
        );
    }
    let _ = writeln!(out, "{name}_bucket{{{l},le=\"+Inf\"}} {}", h.count);
    let _ = writeln!(out, "{name}_sum{{{l}}} {}", h.sum_ns as f64 / 1e9);
    let _ = writeln!(out, "{name}_count{{{l}}} {}", h.count);
}

pub fn render(v: &View<'_>) -> String {
    let bounds = bounds_ns();
    let mut out = String::new();

    let _ = writeln!(
        out,
        "# HELP iospan_disk_latency_seconds Host block-layer latency per disk, op and segment.\n\
         # TYPE iospan_disk_latency_seconds histogram"
    );
    for ((dev, op), s) in &v.snap.stats {
        let disk = disks::name_of(*dev);
        for seg in BlkSegment::ALL {
            let l = labels(&[
                ("disk", &disk),
                ("op", op.as_str()),
                ("segment", seg.as_str()),
            ]);
            hist(
                &mut out,
                "iospan_disk_latency_seconds",
                &l,
                s.segment(seg),
                &bounds,
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP iospan_disk_ios_total Requests completed per disk and op.\n\
         # TYPE iospan_disk_ios_total counter"
    );
    for ((dev, op), s) in &v.snap.stats {
        let l = labels(&[("disk", &disks::name_of(*dev)), ("op", op.as_str())]);
        let _ = writeln!(out, "iospan_disk_ios_total{{{l}}} {}", s.ios);
    }
    let _ = writeln!(
        out,
        "# HELP iospan_disk_bytes_total Bytes completed per disk and op.\n\
         # TYPE iospan_disk_bytes_total counter"
    );
    for ((dev, op), s) in &v.snap.stats {
        let l = labels(&[("disk", &disks::name_of(*dev)), ("op", op.as_str())]);
        let _ = writeln!(out, "iospan_disk_bytes_total{{{l}}} {}", s.bytes);
    }

    // Per VM and virtual disk: the host block layer's segments, the host
    // window's split, and (guest agent) the guest-observed four.
    let _ = writeln!(
        out,
        "# HELP iospan_vm_latency_seconds Latency of VMs' I/O per virtual disk, op and segment \
         (host: total/queue/service, host window: hypervisor/engine/device/host_window, \
         guest-observed: g_total/g_guest/g_hypervisor/g_engine/g_device).\n\
         # TYPE iospan_vm_latency_seconds histogram"
    );
    let mut ios = String::new();
    for (k, s) in &v.snap.vm_stats {
        let vm = v.known.name(k.vm);
        let host = disks::name_of(k.dev);
        let vdisk = v.known.vdisk(k.vdisk).unwrap_or(&host).to_string();
        let base = [
            ("vm", vm.as_str()),
            ("vdisk", vdisk.as_str()),
            ("host_disk", host.as_str()),
            ("op", k.op.as_str()),
        ];
        // The host block layer's, the host window's split, the guest's.
        let mut segs: Vec<(&str, &Hist)> = BlkSegment::ALL
            .iter()
            .map(|&seg| (seg.as_str(), s.segment(seg)))
            .collect();
        let split = SplitKey {
            vm: k.vm,
            dev: k.dev,
            op: k.op,
            vdisk: k.vdisk,
        };
        if let Some(h) = v.splits.get(&split) {
            segs.extend([
                ("hypervisor", &h.hypervisor),
                ("engine", &h.engine),
                ("device", &h.device),
                ("host_window", &h.window),
            ]);
        }
        let stitch = StitchKey {
            vm: k.vm,
            vdisk: k.vdisk,
            op: k.op,
        };
        if let Some(st) = v.stitched.get(&stitch) {
            segs.extend([
                ("g_total", &st.total),
                ("g_guest", &st.guest),
                ("g_hypervisor", &st.hypervisor),
                ("g_engine", &st.engine),
                ("g_device", &st.device),
            ]);
        }
        for (seg, h) in segs {
            let mut l = base.to_vec();
            l.push(("segment", seg));
            hist(
                &mut out,
                "iospan_vm_latency_seconds",
                &labels(&l),
                h,
                &bounds,
            );
        }
        let _ = writeln!(ios, "iospan_vm_ios_total{{{}}} {}", labels(&base), s.ios);
        let _ = writeln!(
            ios,
            "iospan_vm_bytes_total{{{}}} {}",
            labels(&base),
            s.bytes
        );
    }
    let _ = writeln!(
        out,
        "# HELP iospan_vm_ios_total Requests of VMs completed per virtual disk and op.\n\
         # TYPE iospan_vm_ios_total counter\n\
         # HELP iospan_vm_bytes_total Bytes of VMs' requests per virtual disk and op.\n\
         # TYPE iospan_vm_bytes_total counter"
    );
    out.push_str(&ios);
    for vm in v.known.vms.iter() {
        let (slot, _) = vm;
        let n = v.snap.vm_undelivered.get(slot).copied().unwrap_or(0);
        let _ = writeln!(
            out,
            "iospan_vm_undelivered_total{{{}}} {n}",
            labels(&[("vm", &v.known.name(*slot))])
        );
    }

    lost(&mut out, &v.snap.counters);
    if let Some(e) = &v.export {
        let _ = writeln!(
            out,
            "# HELP iospan_traces_total Per-I/O traces by outcome.\n# TYPE iospan_traces_total counter"
        );
        for (what, n) in [
            ("offered", e.offered),
            ("chosen", e.chosen),
            ("exported", e.exported_traces),
            ("dropped_queue_full", e.dropped_queue_full),
            ("failed", e.failed_traces),
        ] {
            let _ = writeln!(out, "iospan_traces_total{{outcome=\"{what}\"}} {n}");
        }
    }
    let _ = writeln!(
        out,
        "# HELP iospan_agent_cpu_seconds_total The agent's own CPU time.\n\
         # TYPE iospan_agent_cpu_seconds_total counter\n\
         iospan_agent_cpu_seconds_total{{mode=\"user\"}} {}\n\
         iospan_agent_cpu_seconds_total{{mode=\"system\"}} {}",
        v.cpu_s.0, v.cpu_s.1
    );
    out
}

fn lost(out: &mut String, c: &Counters) {
    let _ = writeln!(
        out,
        "# HELP iospan_lost_total Lost or degraded measurements, by kind.\n# TYPE iospan_lost_total counter"
    );
    for (key, _, n) in c.losses() {
        // Known only once a run has ended.
        if key != "unseen" {
            let _ = writeln!(out, "iospan_lost_total{{kind=\"{key}\"}} {n}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classic_bounds_are_boundaries_of_both_layouts() {
        let b = bounds_ns();
        assert_eq!(b.len(), 24 * 4 + 1);
        let mut coarse = Hist::default();
        let mut fine = Hist::fine();
        for v in (1_000..20_000_000u64).step_by(997) {
            coarse.record(v);
            fine.record(v);
        }
        for &le in &b {
            let exact = (1_000..20_000_000u64)
                .step_by(997)
                .filter(|&v| v < le)
                .count() as u64;
            assert_eq!(coarse.count_below(le), exact, "le {le}");
            assert_eq!(fine.count_below(le), exact, "le {le}");
        }
    }
}
