//! The run's event stream (`--events-out`): each host request and each
//! joined guest I/O as one JSON line, drained from the kernel's ring.

use std::{
    io::Write,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::Result;
use tokio::sync::watch;

use crate::{
    abi::{BlkIoEvent, Record, RQ_F_NO_ISSUE, RQ_F_NO_START},
    discover::disks::{self, Dev},
    discover::vms::Registry,
    model::IoSpan,
    model::Op,
    output::export::{ExportCounters, Names, Tracer},
    pipeline::correlate::{Correlator, Signal},
    pipeline::vqueue::Layout,
};

/// What the ring buffer's reader did: records written to --events-out,
/// and the exporter's own counts.
pub(super) struct Drained {
    pub written: u64,
    pub export: Option<ExportCounters>,
}

/// The drain timer's period while records come: often enough that a deep
/// run's ring never fills between its ticks.
const DRAIN_EVERY: Duration = Duration::from_millis(25);

/// The longest the drain timer backs off to while no record comes: the
/// kernel side wakes us with the first record after a quiet spell, so an
/// idle agent need not wake every `DRAIN_EVERY` (each wakeup lands on some
/// process's CPU).
const DRAIN_IDLE_MAX: Duration = Duration::from_secs(1);

/// Drains the ring buffer into JSON lines until told to stop, then each
/// joined guest I/O (those at least `slower_than_ns` long). The kernel
/// side wakes us past a backlog threshold or after a quiet spell, not per
/// record, so a timer drains too.
pub(super) async fn drain_events<W: Write>(
    ring: crate::probes::ring::Ring,
    out: Option<W>,
    known: Arc<Mutex<Registry>>,
    correlator: Arc<Mutex<Correlator>>,
    mut stop: watch::Receiver<bool>,
    slower_than_ns: u64,
    tracer: Option<Tracer>,
) -> Result<Drained> {
    let mut ring = ring
        .awaitable()
        .map_err(|e| anyhow::anyhow!("polling the ring buffer: {e}"))?;
    let mut every = DRAIN_EVERY;
    let mut d = Drain {
        out,
        known,
        slower_than_ns,
        tracer,
        written: 0,
        malformed: 0,
        disk_names: disks::Names::default(),
    };
    loop {
        let stopping = tokio::select! {
            _ = ring.woken() => false,
            _ = tokio::time::sleep(every) => false,
            _ = stop.changed() => true,
        };
        let mut corr = correlator.lock().unwrap_or_else(|p| p.into_inner());
        let drained = ring.drain(|item| d.record(&mut corr, item))?;
        every = if drained {
            DRAIN_EVERY
        } else {
            (every * 2).min(DRAIN_IDLE_MAX)
        };
        if stopping {
            corr.finish();
        } else {
            corr.stitch.expire();
        }
        let spans = corr.stitch.take_spans();
        drop(corr);
        d.joined(spans)?;
        if stopping {
            break;
        }
    }
    d.finish().await
}

/// The drain's outputs and counts.
struct Drain<W> {
    out: Option<W>,
    known: Arc<Mutex<Registry>>,
    slower_than_ns: u64,
    tracer: Option<Tracer>,
    written: u64,
    malformed: u64,
    disk_names: disks::Names,
}

impl<W: Write> Drain<W> {
    fn known(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One record from the ring: a host request written out, a VM's
    /// request, signal, split or pushes to the correlator.
    fn record(&mut self, corr: &mut Correlator, item: &[u8]) -> Result<()> {
        match Record::from_bytes(item) {
            Some(Record::BlkIo(ev)) => {
                if self.out.is_some() {
                    // Fields borrowed apart: no reference count taken per record.
                    let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
                    let json = event_json(&ev, &known, &mut self.disk_names);
                    drop(known);
                    self.write(&json)?;
                }
            }
            Some(Record::VmIo(ev)) => {
                let known = self.known();
                let followed = known.split.contains(&ev.vdisk);
                if !corr.knows_vdisk(ev.vdisk) && known.vdisk(ev.vdisk).is_some() {
                    corr.set_vdisk(
                        ev.vdisk,
                        Layout::of_model(known.vdisk_model(ev.vdisk)),
                        known.vdisk_queues(ev.vdisk),
                    );
                }
                drop(known);
                corr.on_io(ev, followed);
            }
            Some(Record::VmSignal(ev)) => corr.on_signal_waits(
                ev.vm,
                Signal {
                    ts_ns: ev.ts_ns,
                    waits: [
                        (ev.wait_start[0], ev.wait_end[0]),
                        (ev.wait_start[1], ev.wait_end[1]),
                    ],
                    ..Default::default()
                },
            ),
            Some(Record::VmSplit(ev)) => {
                let followed = self.known().split.contains(&ev.io.vdisk);
                corr.on_joined(&ev, followed);
            }
            Some(Record::VmPushes(ev)) => {
                let waits = [
                    (ev.wait_start[0], ev.wait_end[0]),
                    (ev.wait_start[1], ev.wait_end[1]),
                ];
                for &ts_ns in ev.pushes() {
                    corr.on_signal_waits(
                        ev.vm,
                        Signal {
                            ts_ns,
                            waits,
                            covers: 1,
                            taken: 0,
                        },
                    );
                }
            }
            // Guest records travel the guest channel, never this ring.
            Some(Record::GuestIo(_) | Record::GuestReap(_)) | None => self.malformed += 1,
        }
        Ok(())
    }

    fn write(&mut self, json: &serde_json::Value) -> Result<()> {
        if let Some(out) = self.out.as_mut() {
            serde_json::to_writer(&mut *out, json)?;
            out.write_all(b"\n")?;
            self.written += 1;
        }
        Ok(())
    }

    /// Joined guest I/Os: written out (the slow enough ones) and offered
    /// to the tracer.
    fn joined(&mut self, spans: Vec<IoSpan>) -> Result<()> {
        let known = self.known.clone();
        let known = known.lock().unwrap_or_else(|p| p.into_inner());
        let slower_than_ns = self.slower_than_ns;
        for sp in spans.iter().filter(|s| s.total_ns >= slower_than_ns) {
            if self.out.is_some() {
                let json = span_json(sp, &known, &mut self.disk_names);
                self.write(&json)?;
            }
        }
        if let Some(t) = self.tracer.as_mut() {
            for sp in spans {
                t.offer(sp, |sp| names_of(sp, &known));
            }
            t.tick(|sp| names_of(sp, &known));
        }
        Ok(())
    }

    async fn finish(mut self) -> Result<Drained> {
        if let Some(out) = self.out.as_mut() {
            out.flush()?;
        }
        if self.malformed > 0 {
            log::warn!(
                "{} ring-buffer records of unexpected size or kind were dropped",
                self.malformed
            );
        }
        let export = match self.tracer {
            Some(t) => {
                let known = self.known.clone();
                let names =
                    |sp: &IoSpan| names_of(sp, &known.lock().unwrap_or_else(|p| p.into_inner()));
                Some(t.finish(names, Duration::from_secs(10)).await)
            }
            None => None,
        };
        Ok(Drained {
            written: self.written,
            export,
        })
    }
}

/// What an I/O's VM, virtual disk and host disk are called.
pub(super) fn names_of(sp: &IoSpan, known: &Registry) -> Names {
    Names {
        vm: known.name(sp.vm),
        vm_uuid: known.vms.get(&sp.vm).and_then(|v| v.uuid.clone()),
        vdisk: known.vdisk(sp.vdisk).unwrap_or_default().to_string(),
        host_disk: disks::name_of(Dev(sp.dev)),
        nvme: known
            .vdisk_model(sp.vdisk)
            .is_some_and(|m| m.starts_with("nvme")),
    }
}

pub(super) fn event_json(
    ev: &BlkIoEvent,
    known: &Registry,
    disk_names: &mut disks::Names,
) -> serde_json::Value {
    let us = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1000.0;
    let start = (ev.flags & RQ_F_NO_START == 0).then_some(ev.start_ns);
    let issue = (ev.flags & RQ_F_NO_ISSUE == 0).then_some(ev.issue_ns);
    serde_json::json!({
        "kind": "host",
        "disk": disk_names.of(Dev(ev.dev)),
        "vm": (ev.vm != 0).then(|| known.name(ev.vm)),
        "vdisk": known.vdisk(ev.vdisk),
        "op": Op::from_index(ev.op as usize).unwrap_or(Op::Other),
        "sector": ev.sector,
        "bytes": ev.bytes,
        "start_ns": start,
        "issue_ns": issue,
        "done_ns": ev.done_ns,
        "total_us": start.or(issue).map(|s| us(s, ev.done_ns)),
        "queue_us": start.zip(issue).map(|(s, i)| us(s, i)),
        "service_us": issue.map(|i| us(i, ev.done_ns)),
        "requeues": ev.requeues,
        "flags": ev.flags,
    })
}

/// One joined guest I/O: its stamps (host clock) and four segments.
pub(super) fn span_json(
    sp: &IoSpan,
    known: &Registry,
    disk_names: &mut disks::Names,
) -> serde_json::Value {
    let us = |ns: u64| ns as f64 / 1000.0;
    serde_json::json!({
        // A host window alone where the VM has no guest agent.
        "kind": if sp.has_guest { "guest_io" } else { "vm_io" },
        "vm": known.name(sp.vm),
        "vdisk": known.vdisk(sp.vdisk),
        "nvme": known.vdisk_model(sp.vdisk).is_some_and(|m| m.starts_with("nvme")),
        "host_disk": disk_names.of(Dev(sp.dev)),
        "queue": sp.queue,
        "op": sp.op,
        "pos": sp.pos,
        "bytes": sp.bytes,
        "begin_ns": sp.begin_ns,
        "guest_kick_ns": sp.guest_kick_ns,
        "kick_ns": sp.kick_ns,
        "pick_ns": sp.pick_ns,
        "start_ns": sp.start_ns,
        "issue_ns": sp.issue_ns,
        "done_ns": sp.done_ns,
        "signal_ns": sp.signal_ns,
        "guest_irq_ns": sp.guest_irq_ns,
        "end_ns": sp.end_ns,
        "clock_offset_ns": sp.clock_offset_ns,
        "total_us": us(sp.total_ns),
        "guest_us": us(sp.guest_ns),
        "hypervisor_us": us(sp.hypervisor_ns),
        "engine_us": us(sp.engine_ns),
        "device_us": us(sp.device_ns),
        "hypervisor_cpu_wait_us": us(sp.cpu_wait.hypervisor_ns),
        "engine_cpu_wait_us": us(sp.cpu_wait.engine_ns),
        "app_ends_from_block_layer": sp.app_ends_from_block_layer,
    })
}
