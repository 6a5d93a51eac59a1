//! What a running agent has measured so far, as one frame: cumulative
//! figures per VM virtual disk, queue, host disk and op.
//!
//! A live
//! view (`top`) differences two frames into the last interval's rates and
//! latencies; the same frame goes over the HTTP API to a remote view.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{
    discover::disks,
    discover::vms::Registry,
    model::block::BlockSnapshot,
    model::SplitWindow,
    model::{BlkSegment, Hist, Op},
    pipeline::correlate::{Correlator, SplitKey},
    pipeline::stitch::StitchKey,
};

/// The segment columns of a live view, in order.
pub const SEGMENTS: [&str; 8] = [
    "total",
    "guest",
    "hv",
    "engine",
    "device",
    "queue",
    // Of hv and engine, the owning thread's wait for a CPU.
    "hv_wait",
    "engine_wait",
];

/// Cumulative figures since the agent started.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Frame {
    /// Seconds on the agent's monotonic clock.
    pub at_s: f64,
    pub vdisks: Vec<Row>,
    /// Per guest queue of a virtual disk (VMs with a guest agent: the
    /// queue is the guest's).
    #[serde(default)]
    pub queues: Vec<Row>,
    pub disks: Vec<Row>,
    /// Requests or events lost so far: not counted, or counted untimed
    /// (the report's `lost`, but the VM requests whose host window was
    /// not split: those are `unsplit`).
    pub lost: u64,
    /// VM requests counted and timed whose host window was not split
    /// (no kick, no signal, out of order, disks not followed), so far;
    /// `polled` aside.
    #[serde(default)]
    pub unsplit: u64,
    /// VM requests a polling engine found with no kick of their own, so
    /// far (`lost.host_split.polled`): counted, not split.
    #[serde(default)]
    pub polled: u64,
    /// Guest and host requests of VMs with a guest agent that found no
    /// partner (the report's `stitch.unmatched_*`).
    #[serde(default)]
    pub unmatched: u64,
    /// QEMU's own counters, by VM name, read just before this frame's
    /// figures (only when asked: an API run's start and stop).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qemu: Option<BTreeMap<String, FrameQemu>>,
    /// Every disk's diagnosis over the agent's last window (10 s): what
    /// limits it, why, and the setting that would move it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub diagnoses: Vec<crate::model::diagnosis::FrameDiagnosis>,
    /// The VMs' monitors failing now (QMP, libvirt's client): not read
    /// until their back-off is over.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub monitors: Vec<crate::discover::monitors::Misbehaving>,
}

/// One VM's own counters beside a frame.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FrameQemu {
    /// Where they were read, or why they could not be.
    pub source: String,
    pub counts: crate::discover::qemu_counts::Counts,
    /// Disks counted by an engine outside QEMU (vhost-user).
    #[serde(default)]
    pub engine_disks: std::collections::BTreeSet<String>,
    /// Its requests merged on the way (QEMU's and the host's), so far.
    #[serde(default)]
    pub merged: u64,
    /// Its requests submitted (ours) just before QEMU's read, and at the
    /// frame's figures: those between are in ours, maybe not in QEMU's.
    #[serde(default)]
    pub submitted_before_read: u64,
    #[serde(default)]
    pub submitted: u64,
    /// Why a source could not be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One (VM, virtual disk, op), or one (host disk, op) with `vm` empty.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Row {
    pub vm: String,
    pub disk: String,
    /// A queue row's guest queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<u32>,
    pub op: Op,
    pub ios: u64,
    pub bytes: u64,
    /// Requests of the VM in flight on the host now (VM rows).
    pub inflight: u64,
    /// Requests of this VM disk whose completion never reached the probes
    /// (VM rows): the guest's, counted beside `ios`, never timed.
    #[serde(default)]
    pub undelivered: u64,
    /// Whether `total` is the guest-observed latency (guest agent) or the
    /// host window (kick to interrupt) only.
    pub guest_observed: bool,
    /// By `SEGMENTS` name; absent where not measured.
    pub segs: BTreeMap<String, Hist>,
}

/// The frame of one snapshot.
pub fn frame(at_s: f64, snap: &BlockSnapshot, corr: &Correlator, known: &Registry) -> Frame {
    let stitch = &corr.stitch;
    Frame {
        at_s,
        vdisks: vdisk_rows(snap, corr, known),
        queues: queue_rows(corr, known),
        disks: disk_rows(snap),
        lost: snap.counters.losses().iter().map(|l| l.2).sum::<u64>()
            - unsplit(&snap.counters.host_split)
            - snap.counters.host_split.polled,
        unsplit: unsplit(&snap.counters.host_split),
        polled: snap.counters.host_split.polled,
        unmatched: stitch.counters.unmatched_guest + stitch.counters.unmatched_host,
        qemu: None,
        diagnoses: Vec::new(),
        monitors: Vec::new(),
    }
}

/// A row per VM, virtual disk and op: the guest-observed segments where a
/// guest agent joined, else the host window's split, else the host disk's.
fn vdisk_rows(snap: &BlockSnapshot, corr: &Correlator, known: &Registry) -> Vec<Row> {
    let finished = snap.vm_finished();
    let inflight = |vm: u32| {
        if known.exited.contains(&vm) {
            // Never completed for us, not in flight (see metrics).
            return 0;
        }
        let c = snap.vm_counts.get(&vm).copied().unwrap_or_default();
        c.submitted
            .saturating_sub(finished.get(&vm).map_or(0, |f| f.done))
    };
    let mut vdisks = Vec::new();
    for (k, s) in &snap.vm_stats {
        // The VM process's own requests (no virtual disk) are not a row.
        let Some(vdisk) = known.vdisk(k.vdisk) else {
            continue;
        };
        let mut segs = BTreeMap::new();
        segs.insert("queue".to_string(), s.segment(BlkSegment::Queue).clone());
        let split = corr.splits.get(&SplitKey {
            vm: k.vm,
            dev: k.dev,
            op: k.op,
            vdisk: k.vdisk,
        });
        let joined = corr
            .stitch
            .stitched
            .get(&StitchKey {
                vm: k.vm,
                vdisk: k.vdisk,
                op: k.op,
            })
            .filter(|st| st.window.count > 0);
        if let Some(st) = joined {
            segs.extend(stitched_segs(st));
            if let Some(h) = split {
                segs.extend(wait_segs(h));
            }
        } else if let Some(h) = split {
            segs.extend(host_segs(h));
        } else {
            segs.insert("device".to_string(), s.segment(BlkSegment::Total).clone());
        }
        vdisks.push(Row {
            vm: known.name(k.vm),
            disk: vdisk.to_string(),
            queue: None,
            op: k.op,
            ios: s.ios,
            bytes: s.bytes,
            inflight: inflight(k.vm),
            undelivered: s.undelivered,
            guest_observed: joined.is_some(),
            segs,
        });
    }
    vdisks
}

/// A row per host disk and op: the host block layer's segments.
fn disk_rows(snap: &BlockSnapshot) -> Vec<Row> {
    snap.stats
        .iter()
        .map(|((dev, op), s)| Row {
            vm: String::new(),
            disk: disks::name_of(*dev),
            queue: None,
            op: *op,
            ios: s.ios,
            bytes: s.bytes,
            inflight: 0,
            undelivered: 0,
            guest_observed: false,
            segs: [
                ("device", s.segment(BlkSegment::Service)),
                ("queue", s.segment(BlkSegment::Queue)),
                ("total", s.segment(BlkSegment::Total)),
            ]
            .into_iter()
            .map(|(n, h)| (n.to_string(), h.clone()))
            .collect(),
        })
        .collect()
}

/// A row per virtual disk's queue: the guest agent's where it gave the
/// disk's, else the host window per queue its kicks came through.
fn queue_rows(corr: &Correlator, known: &Registry) -> Vec<Row> {
    let stitch = &corr.stitch;
    // A virtual disk's queue: its VM, disk and op, its count, bytes and
    // segments, and whether they are the guest's view.
    let queue_row = |(vm, vdisk, op): (u32, u32, Op), q: u32, ios, bytes, guest, segs| {
        Some(Row {
            vm: known.name(vm),
            disk: known.vdisk(vdisk)?.to_string(),
            queue: Some(q),
            op,
            ios,
            bytes,
            inflight: 0,
            undelivered: 0,
            guest_observed: guest,
            segs,
        })
    };
    let mut queues: Vec<Row> = stitch
        .queues
        .iter()
        .filter_map(|((k, q), st)| {
            let segs = stitched_segs(st);
            queue_row(
                (k.vm, k.vdisk, k.op),
                *q,
                st.window.count,
                st.bytes,
                true,
                segs,
            )
        })
        .collect();
    let guest_queues: std::collections::BTreeSet<_> =
        stitch.queues.keys().map(|(k, _)| *k).collect();
    queues.extend(corr.queue_splits.iter().filter_map(|((k, q), h)| {
        let joined = StitchKey {
            vm: k.vm,
            vdisk: k.vdisk,
            op: k.op,
        };
        if guest_queues.contains(&joined) {
            return None;
        }
        queue_row(
            (k.vm, k.vdisk, k.op),
            *q,
            h.window.count,
            h.bytes,
            false,
            host_segs(h),
        )
    }));
    queues
}

/// VM requests counted and timed whose host window was not split
/// (`polled` aside).
fn unsplit(h: &crate::model::SplitCounters) -> u64 {
    h.no_kick + h.no_signal + h.unordered + h.not_followed
}

fn host_segs(h: &SplitWindow) -> BTreeMap<String, Hist> {
    let mut segs: BTreeMap<String, Hist> = [
        ("total", &h.window),
        ("hv", &h.hypervisor),
        ("engine", &h.engine),
        ("device", &h.device),
    ]
    .into_iter()
    .map(|(n, h)| (n.to_string(), h.clone()))
    .collect();
    segs.extend(wait_segs(h));
    segs
}

/// The host window's CPU waits (the guest agent's view has none of its own).
fn wait_segs(h: &SplitWindow) -> Vec<(String, Hist)> {
    h.host
        .iter()
        .flat_map(|x| {
            [
                ("hv_wait".to_string(), x.hypervisor_cpu_wait.clone()),
                ("engine_wait".to_string(), x.engine_cpu_wait.clone()),
            ]
        })
        .collect()
}

fn stitched_segs(st: &SplitWindow) -> BTreeMap<String, Hist> {
    st.guest
        .iter()
        .map(|g| ("guest", g))
        .chain([
            ("total", &st.window),
            ("hv", &st.hypervisor),
            ("engine", &st.engine),
            ("device", &st.device),
        ])
        .map(|(n, h)| (n.to_string(), h.clone()))
        .collect()
}

impl Row {
    /// The same (VM, disk, op).
    pub fn same(&self, other: &Row) -> bool {
        self.vm == other.vm
            && self.disk == other.disk
            && self.queue == other.queue
            && self.op == other.op
    }

    /// What this row gained since `earlier` (the same row, in an earlier
    /// frame); all of it when there is none.
    pub fn since(&self, earlier: Option<&Row>) -> Row {
        let Some(e) = earlier else {
            return self.clone();
        };
        Row {
            ios: self.ios.saturating_sub(e.ios),
            bytes: self.bytes.saturating_sub(e.bytes),
            undelivered: self.undelivered.saturating_sub(e.undelivered),
            segs: self
                .segs
                .iter()
                .map(|(k, h)| {
                    (
                        k.clone(),
                        e.segs.get(k).map_or_else(|| h.clone(), |o| h.since(o)),
                    )
                })
                .collect(),
            ..self.clone()
        }
    }
}
