//! Prometheus text exposition of what a run has measured so far: latency
//! histograms, counters, losses and the agent's own cost.
//!
//! Latency histograms per disk and per VM/virtual disk/op/segment (classic buckets,
//! four per power of two from 1 µs to 16 s, boundaries of the histograms'
//! own layouts, so the counts are exact), I/O and byte counters, requests
//! in flight, losses, trace export and the agent's own cost (CPU, map
//! fill). In the OpenMetrics format (what a scraper asks for with
//! `Accept: application/openmetrics-text`) latency buckets carry exemplars:
//! the latest exported trace that fell in them.

use std::fmt::Write;

use crate::{
    discover::disks,
    discover::vms::Registry,
    model::block::{BlockSnapshot, Counters},
    model::SplitWindow,
    model::{hist::Hist, BlkSegment},
    output::export::{Exemplars, ExportCounters, SeriesKey},
    pipeline::correlate::SplitKey,
    pipeline::stitch::StitchKey,
};

pub use crate::model::hist::bounds_ns;

/// Everything `render` shows.
pub struct View<'a> {
    pub snap: &'a BlockSnapshot,
    pub splits: &'a std::collections::BTreeMap<SplitKey, SplitWindow>,
    pub stitched: &'a std::collections::BTreeMap<StitchKey, SplitWindow>,
    pub known: &'a Registry,
    pub export: Option<ExportCounters>,
    pub exemplars: Option<&'a Exemplars>,
    /// The kernel side's tables: (map, entries, capacity).
    pub maps: &'a [(&'static str, u32, u32)],
    pub cpu_s: (f64, f64),
    /// The VMs' monitors: failed exchanges by reason, and those failing now.
    pub monitors: Option<&'a crate::discover::monitors::Monitors>,
}

/// The two text expositions a scraper may ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Prometheus text 0.0.4.
    Prometheus,
    /// OpenMetrics 1.0: exemplars, `# EOF`.
    OpenMetrics,
}

impl Format {
    /// From a scrape's Accept header.
    pub fn from_accept(accept: &str) -> Self {
        if accept.contains("application/openmetrics-text") {
            Self::OpenMetrics
        } else {
            Self::Prometheus
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Self::Prometheus => "text/plain; version=0.0.4; charset=utf-8",
            Self::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// `# HELP` and `# TYPE` of a family. OpenMetrics names a counter family
/// without the `_total` its samples carry, and an info family (a gauge of 1
/// in Prometheus's text) without its `_info`.
pub fn family(out: &mut String, f: Format, name: &str, kind: &str, help: &str) {
    let (name, kind) = match (f, kind) {
        (Format::OpenMetrics, "counter") => (name.strip_suffix("_total").unwrap_or(name), kind),
        (Format::OpenMetrics, "info") => (name.strip_suffix("_info").unwrap_or(name), kind),
        (Format::Prometheus, "info") => (name, "gauge"),
        _ => (name, kind),
    };
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// Each disk's diagnosis over the agent's last window: an info sample
/// naming its limiting segment (`none`), cause and confidence, and that
/// segment's share of the latency.
pub fn diagnoses(out: &mut String, f: Format, ds: &[crate::model::diagnosis::FrameDiagnosis]) {
    family(
        out,
        f,
        "iospan_diagnosis_info",
        "info",
        "What limits each disk over the agent's last window: the segment, the cause and how sure \
         (docs/diagnosis.md).",
    );
    let key = |d: &crate::model::diagnosis::FrameDiagnosis| {
        [
            ("vm", d.vm.clone()),
            ("disk", d.disk.clone()),
            ("op", d.op.to_string()),
        ]
    };
    for d in ds {
        let x = &d.diagnosis;
        let seg = x.segment.map_or("none", |s| s.as_str());
        let k = key(d);
        let mut pairs: Vec<(&str, &str)> = k.iter().map(|(a, b)| (*a, b.as_str())).collect();
        pairs.extend([
            ("segment", seg),
            ("cause", x.cause.as_str()),
            ("confidence", x.confidence.as_str()),
        ]);
        let _ = writeln!(out, "iospan_diagnosis_info{{{}}} 1", labels(&pairs));
    }
    family(
        out,
        f,
        "iospan_diagnosis_share",
        "gauge",
        "The limiting segment's share of each disk's mean latency over the agent's last window.",
    );
    for d in ds.iter().filter(|d| d.diagnosis.segment.is_some()) {
        let k = key(d);
        let pairs: Vec<(&str, &str)> = k.iter().map(|(a, b)| (*a, b.as_str())).collect();
        let _ = writeln!(
            out,
            "iospan_diagnosis_share{{{}}} {}",
            labels(&pairs),
            d.diagnosis.share_mean
        );
    }
}

fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

pub fn labels(pairs: &[(&str, &str)]) -> String {
    let inner: Vec<String> = pairs
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", esc(v)))
        .collect();
    inner.join(",")
}

/// A histogram's samples; with `exemplars`, each bucket's own, if any.
fn hist(
    out: &mut String,
    name: &str,
    l: &str,
    h: &Hist,
    bounds: &[u64],
    exemplars: Option<(&Exemplars, &SeriesKey)>,
) {
    let exemplar = |out: &mut String, le: u64| {
        if let Some(e) = exemplars.and_then(|(x, k)| x.get(k, le)) {
            let _ = write!(
                out,
                " # {{trace_id=\"{}\"}} {} {:.3}",
                e.trace_id,
                e.value_ns as f64 / 1e9,
                e.unix_s
            );
        }
    };
    for &b in bounds {
        let _ = write!(
            out,
            "{name}_bucket{{{l},le=\"{}\"}} {}",
            b as f64 / 1e9,
            h.count_below(b)
        );
        exemplar(out, b);
        out.push('\n');
    }
    let _ = write!(out, "{name}_bucket{{{l},le=\"+Inf\"}} {}", h.count);
    exemplar(out, u64::MAX);
    out.push('\n');
    let _ = writeln!(out, "{name}_sum{{{l}}} {}", h.sum_ns as f64 / 1e9);
    let _ = writeln!(out, "{name}_count{{{l}}} {}", h.count);
}

pub fn render(v: &View<'_>, f: Format) -> String {
    let bounds = bounds_ns();
    let mut out = String::new();
    disk_families(&mut out, v, f, &bounds);
    vm_latency_families(&mut out, v, f, &bounds);
    vm_count_families(&mut out, v, f);
    lost(&mut out, f, &v.snap.counters);
    agent_families(&mut out, v, f);
    if f == Format::OpenMetrics {
        out.push_str("# EOF\n");
    }
    out
}

/// The host disks': latency by segment, requests and bytes.
fn disk_families(out: &mut String, v: &View<'_>, f: Format, bounds: &[u64]) {
    family(
        out,
        f,
        "iospan_disk_latency_seconds",
        "histogram",
        "Host block-layer latency per disk, op and segment.",
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
                out,
                "iospan_disk_latency_seconds",
                &l,
                s.segment(seg),
                bounds,
                None,
            );
        }
    }
    family(
        out,
        f,
        "iospan_disk_ios_total",
        "counter",
        "Requests completed per disk and op.",
    );
    for ((dev, op), s) in &v.snap.stats {
        let l = labels(&[("disk", &disks::name_of(*dev)), ("op", op.as_str())]);
        let _ = writeln!(out, "iospan_disk_ios_total{{{l}}} {}", s.ios);
    }
    family(
        out,
        f,
        "iospan_disk_bytes_total",
        "counter",
        "Bytes completed per disk and op.",
    );
    for ((dev, op), s) in &v.snap.stats {
        let l = labels(&[("disk", &disks::name_of(*dev)), ("op", op.as_str())]);
        let _ = writeln!(out, "iospan_disk_bytes_total{{{l}}} {}", s.bytes);
    }
}

/// Per VM and virtual disk: the host block layer's segments, the host
/// window's split, and (guest agent) the guest-observed four; requests and
/// bytes.
fn vm_latency_families(out: &mut String, v: &View<'_>, f: Format, bounds: &[u64]) {
    family(
        out,
        f,
        "iospan_vm_latency_seconds",
        "histogram",
        "Latency of VMs' I/O per virtual disk, op and segment \
         (host: total/queue/service, host window: hypervisor/engine/device/host_window, \
         guest-observed: g_total/g_guest/g_hypervisor/g_engine/g_device).",
    );
    let exemplars = v.exemplars.filter(|_| f == Format::OpenMetrics);
    let (mut ios, mut bytes) = (String::new(), String::new());
    // Slots of QEMU processes that are not VMs are the host's requests.
    for (k, s) in v.snap.vm_stats.iter().filter(|(k, _)| v.known.is_vm(k.vm)) {
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
        let mut segs: Vec<(&'static str, &Hist)> = BlkSegment::ALL
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
            segs.push(("g_total", &st.window));
            segs.extend(st.guest.as_ref().map(|g| ("g_guest", g)));
            segs.extend([
                ("g_hypervisor", &st.hypervisor),
                ("g_engine", &st.engine),
                ("g_device", &st.device),
            ]);
        }
        for (seg, h) in segs {
            let mut l = base.to_vec();
            l.push(("segment", seg));
            let key = SeriesKey {
                vm: vm.clone(),
                vdisk: vdisk.clone(),
                op: k.op.as_str(),
                segment: seg,
            };
            hist(
                out,
                "iospan_vm_latency_seconds",
                &labels(&l),
                h,
                bounds,
                exemplars.map(|x| (x, &key)),
            );
        }
        let _ = writeln!(ios, "iospan_vm_ios_total{{{}}} {}", labels(&base), s.ios);
        let _ = writeln!(
            bytes,
            "iospan_vm_bytes_total{{{}}} {}",
            labels(&base),
            s.bytes
        );
    }
    // A family's samples follow its TYPE line, together (OpenMetrics).
    for (name, help, samples) in [
        (
            "iospan_vm_ios_total",
            "Requests of VMs completed per virtual disk and op.",
            &ios,
        ),
        (
            "iospan_vm_bytes_total",
            "Bytes of VMs' requests per virtual disk and op.",
            &bytes,
        ),
    ] {
        family(out, f, name, "counter", help);
        out.push_str(samples);
    }
}

/// Per VM: undelivered, merged and in-flight requests, and what names it.
fn vm_count_families(out: &mut String, v: &View<'_>, f: Format) {
    let finished = v.snap.vm_finished();
    family(
        out,
        f,
        "iospan_vm_undelivered_total",
        "counter",
        "Requests of VMs whose completion never reached iospan.",
    );
    let per_vm = |key: fn(&crate::abi::VmCounts) -> u64| {
        v.known.vms.keys().map(move |slot| {
            let c = v.snap.vm_counts.get(slot).copied().unwrap_or_default();
            (v.known.name(*slot), key(&c), *slot)
        })
    };
    for slot in v.known.vms.keys() {
        let n = finished.get(slot).map_or(0, |f| f.undelivered);
        let _ = writeln!(
            out,
            "iospan_vm_undelivered_total{{{}}} {n}",
            labels(&[("vm", &v.known.name(*slot))])
        );
    }
    family(
        out,
        f,
        "iospan_vm_merged_total",
        "counter",
        "Guest requests merged into another before reaching the host disk, \
         by QEMU (engine) or the host block layer (host).",
    );
    for (by, key) in [
        (
            "engine",
            (|c| c.engine_merges) as fn(&crate::abi::VmCounts) -> u64,
        ),
        ("host", |c| c.bio_merges),
    ] {
        for (name, n, _) in per_vm(key) {
            let _ = writeln!(
                out,
                "iospan_vm_merged_total{{{}}} {n}",
                labels(&[("vm", &name), ("by", by)])
            );
        }
    }
    family(
        out,
        f,
        "iospan_vm_inflight_requests",
        "gauge",
        "Requests of VMs on the host disks now: started, not yet completed.",
    );
    for (name, submitted, slot) in per_vm(|c| c.submitted) {
        let done = finished.get(&slot).map_or(0, |f| f.done);
        // A process does not exit with direct I/O in flight: what an
        // exited VM still has open never reached our completion probes,
        // and is counted as undelivered when the run ends, not as in flight.
        let inflight = if v.known.exited.contains(&slot) {
            0
        } else {
            submitted.saturating_sub(done)
        };
        let _ = writeln!(
            out,
            "iospan_vm_inflight_requests{{{}}} {inflight}",
            labels(&[("vm", &name)]),
        );
    }
    family(
        out,
        f,
        "iospan_vm_info",
        "gauge",
        "A VM iospan knows: its UUID and libvirt domain, where it has them (1 per VM).",
    );
    for (slot, vm) in &v.known.vms {
        let _ = writeln!(
            out,
            "iospan_vm_info{{{}}} 1",
            labels(&[
                ("vm", &v.known.name(*slot)),
                ("vm_uuid", vm.uuid.as_deref().unwrap_or("")),
                ("pid", &vm.pid.to_string()),
            ])
        );
    }
}

/// The agent's own: traces by outcome, CPU time, kernel-side tables.
fn agent_families(out: &mut String, v: &View<'_>, f: Format) {
    if let Some(e) = &v.export {
        family(
            out,
            f,
            "iospan_traces_total",
            "counter",
            "Per-I/O traces by outcome.",
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
    family(
        out,
        f,
        "iospan_agent_cpu_seconds_total",
        "counter",
        "The agent's own CPU time.",
    );
    let _ = writeln!(
        out,
        "iospan_agent_cpu_seconds_total{{mode=\"user\"}} {}\n\
         iospan_agent_cpu_seconds_total{{mode=\"system\"}} {}",
        v.cpu_s.0, v.cpu_s.1
    );
    for (name, help, pick) in [
        (
            "iospan_map_entries",
            "Entries in the kernel side's tables.",
            (|m: &(&str, u32, u32)| m.1) as fn(&(&str, u32, u32)) -> u32,
        ),
        (
            "iospan_map_capacity",
            "Capacity of the kernel side's tables.",
            |m| m.2,
        ),
    ] {
        family(out, f, name, "gauge", help);
        for m in v.maps {
            let _ = writeln!(out, "{name}{{map=\"{}\"}} {}", m.0, pick(m));
        }
    }
    if let Some(m) = v.monitors {
        monitor_families(out, m, f);
    }
}

/// The VMs' monitors that failed: every exchange by reason, and how many
/// are waiting out a back-off now.
fn monitor_families(out: &mut String, m: &crate::discover::monitors::Monitors, f: Format) {
    family(
        out,
        f,
        "iospan_qemu_monitor_failures_total",
        "counter",
        "Exchanges with a VM's monitor (QMP, libvirt's client) that failed, by reason.",
    );
    let failures = m.failures();
    for reason in [
        "busy",
        "timeout",
        "closed",
        "too_much",
        "not_qmp",
        "not_its_own",
        "refused",
        "io",
        "other",
    ] {
        let n = failures
            .iter()
            .find(|(r, _)| *r == reason)
            .map_or(0, |(_, n)| *n);
        let _ = writeln!(
            out,
            "iospan_qemu_monitor_failures_total{{reason=\"{reason}\"}} {n}"
        );
    }
    family(
        out,
        f,
        "iospan_qemu_monitors_failing",
        "gauge",
        "VMs' monitors failing now, tried again only after a back-off.",
    );
    let _ = writeln!(
        out,
        "iospan_qemu_monitors_failing {}",
        m.misbehaving().len()
    );
}

fn lost(out: &mut String, f: Format, c: &Counters) {
    family(
        out,
        f,
        "iospan_lost_total",
        "counter",
        "Lost or degraded measurements, by kind.",
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
