//! Joins each guest request (guest agent, guest clock) with the host's
//! record of it (host clock) into one `IoSpan` with all four segments.
//!
//! The segments:
//!
//! ```text
//!  guest:   begin ──guest── kick ·············· irq ──guest── end       (guest clock)
//!  host:              kick ─hv─ pick ─engine─ start ─device─ done ─engine─ signal
//! ```
//!
//! The guest's ends are the application's: begin is the entry of the
//! system call that submitted the request, end the return of the one that
//! handed its completion back (the block layer's own stamps where the guest
//! agent saw no such call, counted). total = end − begin (what the guest
//! observed); guest = (kick − begin) + (end − irq); engine and device as on
//! the host; and
//! hypervisor = the rest: the guest's kick to its interrupt, less the host's
//! window, plus the host's kick → pickup. The four tile the total exactly
//! and need no common clock: each difference is taken on one clock.
//!
//! The clocks are needed to tell requests apart (two requests for the same
//! offset) and to put guest events on the host's timeline. Each joined
//! request bounds the offset θ = host − guest: the host sees the kick after
//! the guest made it (θ ≤ host kick − guest kick) and raised the completion
//! before the guest saw it (θ ≥ host signal − guest irq). The bounds of
//! each second are kept; their midpoints give the offset and its drift,
//! their width the uncertainty. No NTP, no assumption of equal clocks.
//!
//! Requests are joined by (VM, virtual disk, op, offset, length): the guest's
//! sector × 512 is the host's file offset on a raw image.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::clock::Clock;
use crate::model::{IoSpan, SplitWindow};
use crate::{
    abi::{
        GuestIoEvent, VmIoEvent, GUEST_F_NO_IRQ, GUEST_F_NO_KICK, GUEST_F_REAPED, GUEST_F_SYSCALL,
    },
    model::ChannelStats,
    model::Op,
};

/// A host request whose window was split, with the signal that ended it.
#[derive(Clone, Copy, Debug)]
pub struct HostIo {
    pub ev: VmIoEvent,
    pub signal_ns: u64,
    /// The signalling thread's CPU wait between completion and signal.
    pub signal_wait_ns: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StitchKey {
    pub vm: u32,
    pub vdisk: u32,
    pub op: Op,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct JoinKey {
    vm: u32,
    vdisk: u32,
    op: u8,
    pos: u64,
    bytes: u32,
}

/// What could not be joined, counted.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StitchCounters {
    /// Guest requests no host request matched within the hold time.
    pub unmatched_guest: u64,
    /// Host requests (of disks with a guest agent) no guest request matched.
    pub unmatched_host: u64,
    /// Why those were given up.
    #[serde(default)]
    pub unmatched_host_by: GivenUp,
    /// Joined, but the guest saw less time than the host spent (a wrong
    /// match or clocks running at different rates): not recorded.
    pub inconsistent: u64,
    /// Guest requests of disks not matched to a virtual disk.
    pub unknown_disk: u64,
    /// Joined requests whose guest kick or completion was not seen (the
    /// guest kernel lacks the probes, or the driver skipped the kick): their
    /// guest segment runs to the block layer's issue and completion.
    pub guest_ends_from_block_layer: u64,
    /// Joined requests without the system call that submitted them or the
    /// one that reaped them (the guest kernel's own I/O, io_uring workers, a
    /// completion queue polled from user space): the guest-observed latency
    /// starts or ends at the block layer's stamp instead.
    #[serde(default)]
    pub app_ends_from_block_layer: u64,
    /// Joined requests whose guest queue index was not one the host gave
    /// the disk: joined, but in no per-queue row.
    #[serde(default)]
    pub queue_out_of_range: u64,
    /// Guest records refused because the VM already had `MAX_WAITING_GUEST`
    /// waiting for their host partner.
    #[serde(default)]
    pub guest_over_cap: u64,
}

/// Why host records were given up without their guest partner.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GivenUp {
    /// The guest had reported past them (by the reaping slack and the hold).
    pub reported_past: u64,
    /// They waited the longest a guest agent may lag.
    pub lagged: u64,
    /// The VM had `MAX_WAITING_HOST` waiting.
    pub over_cap: u64,
    /// Still waiting when the run ended.
    pub at_end: u64,
}

/// Which of `GivenUp`'s counts a record goes to.
#[derive(Clone, Copy)]
enum Reason {
    ReportedPast,
    Lagged,
    OverCap,
    AtEnd,
}

impl GivenUp {
    fn count(&mut self, r: Reason) {
        let n = match r {
            Reason::ReportedPast => &mut self.reported_past,
            Reason::Lagged => &mut self.lagged,
            Reason::OverCap => &mut self.over_cap,
            Reason::AtEnd => &mut self.at_end,
        };
        *n = n.saturating_add(1);
    }
}

/// A guest-observed latency above this is no measurement (the guest's
/// stamps say so, not its disk): the join is counted inconsistent.
pub const MAX_GUEST_TOTAL_NS: u64 = 3_600_000_000_000;

/// Guest records a VM may have waiting for their host partner: a guest
/// that reports I/O that never happened fills no more than this.
pub const MAX_WAITING_GUEST: usize = 1 << 16;

/// How long a guest record waits, on the wall clock, for its host partner
/// when no host I/O moves the stream clock.
const WAIT_WALL: Duration = Duration::from_secs(4);

/// How long a host record waits for its guest record, on the stream or the
/// wall clock, while the guest agent has not reported past it. The guest
/// agent runs only when the guest is otherwise idle (SCHED_IDLE), so a
/// guest busy with a benchmark delivers its records seconds late.
const MAX_GUEST_LAG_NS: u64 = 30_000_000_000;
const MAX_GUEST_LAG_WALL: Duration = Duration::from_secs(30);

/// How far past a host record the guest must have reported before the
/// record is given up: guest records come in completion order, but for
/// those the guest agent holds for their reaping call and its next drain.
const REPORT_SLACK_NS: u64 = crate::pipeline::reap::HOLD_NS + 500_000_000;

/// Host records a VM may have waiting for their guest partner: past it the
/// oldest is given up (counted `unmatched_host`).
pub const MAX_WAITING_HOST: usize = 1 << 18;

/// The queue count assumed for a disk the host said nothing of.
const DEFAULT_QUEUES: u32 = 1;

/// A guest record waiting for its host partner.
#[derive(Clone, Copy, Debug)]
struct WaitingGuest {
    /// The host stream's time when it arrived: its `Arrival`'s.
    stream_ns: u64,
    event: GuestIoEvent,
}

/// Which side of a join had been waiting for the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Host,
    Guest,
}

/// A record that arrived without its partner, in arrival order.
#[derive(Clone, Copy, Debug)]
struct Arrival {
    /// The host stream's time then.
    stream_ns: u64,
    key: JoinKey,
    /// A host record's completion (which of the key's records it is).
    done_ns: u64,
    /// The wall clock's time then.
    at: Instant,
}

impl Arrival {
    fn now(stream_ns: u64, key: JoinKey, done_ns: u64) -> Self {
        Self {
            stream_ns,
            key,
            done_ns,
            at: Instant::now(),
        }
    }
}

/// One VM's records waiting for their partners, each side in arrival
/// order (a side's records go by that side's rule).
#[derive(Debug, Default)]
struct Waiting {
    host: VecDeque<Arrival>,
    guest: VecDeque<Arrival>,
    /// Host records still unjoined (`host` also holds joined ones' arrivals).
    hosts: usize,
    /// Guest records still unjoined.
    guests: usize,
    /// The latest host completion a guest record has been joined to: the
    /// guest agent has reported about this far.
    reported_ns: u64,
}

#[derive(Default)]
pub struct Stitcher {
    hold_ns: u64,
    /// `WAIT_WALL`, unless a test shortens it.
    wait_wall: Option<Duration>,
    /// (VM, virtual disk) -> its queue count, as the host configured it.
    queue_limits: HashMap<(u32, u32), u32>,
    /// What waits for a partner, per VM.
    waiting: HashMap<u32, Waiting>,
    /// guest disk (VM slot, guest dev) -> virtual disk slot.
    disks: HashMap<(u32, u32), u32>,
    /// VMs with a guest channel: their host requests wait for a partner.
    expected: std::collections::HashSet<u32>,
    host: HashMap<JoinKey, VecDeque<HostIo>>,
    guest: HashMap<JoinKey, VecDeque<WaitingGuest>>,
    latest_ns: u64,
    pub clocks: HashMap<u32, Clock>,
    pub stitched: BTreeMap<StitchKey, SplitWindow>,
    /// The same, per guest queue (the guest block layer's hardware
    /// context, which is the virtqueue or NVMe queue pair it submits to).
    pub queues: BTreeMap<(StitchKey, u32), SplitWindow>,
    pub counters: StitchCounters,
    /// Each VM's guest channel (VM slot -> what came through it).
    pub channels: BTreeMap<u32, ChannelStats>,
    /// Joined requests not yet taken by a per-I/O output (kept only when
    /// one asked for them: `keep_spans`).
    spans: Option<Vec<IoSpan>>,
    /// Every request's segments, for a benchmark run's tails (`keep_tails`).
    pub tails: Option<crate::pipeline::tails::Tails>,
}

impl Stitcher {
    pub fn new(hold_ns: u64) -> Self {
        Self {
            hold_ns,
            ..Default::default()
        }
    }

    /// Keep each joined request for `take_spans` (a per-I/O output runs).
    pub fn keep_spans(&mut self) {
        self.spans.get_or_insert_with(Vec::new);
    }

    /// Whether per-I/O records are being kept.
    pub fn keeping_spans(&self) -> bool {
        self.spans.is_some()
    }

    /// Keep every request's segments (a labelled benchmark run).
    pub fn keep_tails(&mut self) {
        self.tails.get_or_insert_with(Default::default);
    }

    /// A request's segments, for the tails (a host window without a guest
    /// side; joined requests are taken at the join).
    pub fn tail(&mut self, span: &IoSpan) {
        if let Some(t) = self.tails.as_mut() {
            t.record(span);
        }
    }

    /// Keeps a record made elsewhere (a host window without a guest side).
    pub fn keep(&mut self, span: IoSpan) {
        if let Some(spans) = self.spans.as_mut() {
            spans.push(span);
        }
    }

    /// The requests joined since the last call.
    pub fn take_spans(&mut self) -> Vec<IoSpan> {
        self.spans.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Which of the VM's virtual disks a guest disk is.
    pub fn map_disk(&mut self, vm: u32, guest_dev: u32, vdisk: u32) {
        self.disks.insert((vm, guest_dev), vdisk);
    }

    /// How many request queues the host gave a VM's virtual disk: a
    /// guest's queue index is believed only below it.
    pub fn set_queues(&mut self, vm: u32, vdisk: u32, n: u32) {
        self.queue_limits.insert((vm, vdisk), n.max(1));
    }

    /// The VM has a guest channel: its host requests are kept for joining
    /// (and counted unmatched if no guest record comes).
    pub fn expect_guest(&mut self, vm: u32) {
        self.expected.insert(vm);
    }

    pub fn has_guest(&self, vm: u32) -> bool {
        self.expected.contains(&vm)
    }

    pub fn on_host(&mut self, io: HostIo) {
        self.latest_ns = self.latest_ns.max(io.ev.done_ns);
        let key = JoinKey {
            vm: io.ev.vm,
            vdisk: io.ev.vdisk,
            op: io.ev.op,
            pos: io.ev.pos,
            bytes: io.ev.bytes,
        };
        let offset = self.clocks.get(&key.vm).and_then(Clock::offset);
        if let Some(g) = self.take_guest(key, &io, offset) {
            self.join(&io, &g, Side::Guest, offset);
        } else {
            let w = self.waiting.entry(key.vm).or_default();
            w.hosts = w.hosts.saturating_add(1);
            w.host
                .push_back(Arrival::now(self.latest_ns, key, io.ev.done_ns));
            self.host.entry(key).or_default().push_back(io);
        }
        self.evict(key.vm, false);
    }

    pub fn on_guest(&mut self, vm: u32, g: GuestIoEvent) {
        let Some(&vdisk) = self.disks.get(&(vm, g.dev)) else {
            self.counters.unknown_disk = self.counters.unknown_disk.saturating_add(1);
            return;
        };
        // The guest's sector is the guest's to say: one past any file
        // offset joins nothing.
        let Some(pos) = g.sector.checked_mul(512) else {
            self.counters.unmatched_guest = self.counters.unmatched_guest.saturating_add(1);
            return;
        };
        let key = JoinKey {
            vm,
            vdisk,
            op: g.op,
            pos,
            bytes: g.bytes,
        };
        let offset = self.clocks.get(&vm).and_then(Clock::offset);
        let found = self.host.get_mut(&key).and_then(|q| {
            let i = best(q.iter().map(|h| h.ev.kick_ns), g.kick_ns, offset)?;
            q.remove(i)
        });
        if self.host.get(&key).is_some_and(VecDeque::is_empty) {
            self.host.remove(&key);
        }
        match found {
            Some(h) => self.join(&h, &g, Side::Host, offset),
            None => {
                // Room made first: the cap counts only what still waits.
                self.evict(vm, false);
                let w = self.waiting.entry(vm).or_default();
                if w.guests >= MAX_WAITING_GUEST {
                    self.counters.guest_over_cap = self.counters.guest_over_cap.saturating_add(1);
                    return;
                }
                w.guests = w.guests.saturating_add(1);
                w.guest.push_back(Arrival::now(self.latest_ns, key, 0));
                self.guest.entry(key).or_default().push_back(WaitingGuest {
                    stream_ns: self.latest_ns,
                    event: g,
                });
                return;
            }
        }
        self.evict(vm, false);
    }

    fn take_guest(
        &mut self,
        key: JoinKey,
        h: &HostIo,
        offset: Option<i64>,
    ) -> Option<GuestIoEvent> {
        let q = self.guest.get_mut(&key)?;
        // Guest kicks against the host's kick moved to the guest's clock.
        let i = best(
            q.iter().map(|w| w.event.kick_ns),
            h.ev.kick_ns,
            // i64::MIN has no negation: no shift, the oldest.
            offset.and_then(i64::checked_neg),
        )?;
        let g = q.remove(i).map(|w| w.event);
        if q.is_empty() {
            self.guest.remove(&key);
        }
        g
    }
    /// Joins a host record and a guest record, one of which (`waited`) had
    /// been waiting for the other.
    /// `offset`: the VM's clock offset as the caller matched with it.
    fn join(&mut self, h: &HostIo, g: &GuestIoEvent, waited: Side, offset: Option<i64>) {
        let ev = &h.ev;
        let w = self.waiting.entry(ev.vm).or_default();
        w.reported_ns = w
            .reported_ns
            .max(reported_to(ev.done_ns, g.done_ns, offset));
        match waited {
            Side::Host => w.hosts = w.hosts.saturating_sub(1),
            Side::Guest => w.guests = w.guests.saturating_sub(1),
        }
        let GuestEnds {
            begin,
            end,
            kick,
            irq,
        } = GuestEnds::of(g);
        let total = end.saturating_sub(begin);
        let from_block = g.flags & (GUEST_F_NO_KICK | GUEST_F_NO_IRQ) != 0;
        // The guest's stamps are the guest's to say: no sum of them may wrap.
        let guest = kick
            .saturating_sub(begin)
            .saturating_add(end.saturating_sub(irq));
        // The host's side as measured on the host alone.
        let host = IoSpan::host_only(ev, h.signal_ns, h.signal_wait_ns);
        let host_side = guest
            .saturating_add(host.engine_ns)
            .saturating_add(host.device_ns);
        let Some(hypervisor) = total
            .checked_sub(host_side)
            .filter(|_| total <= MAX_GUEST_TOTAL_NS)
        else {
            self.counters.inconsistent = self.counters.inconsistent.saturating_add(1);
            return;
        };
        if from_block {
            self.counters.guest_ends_from_block_layer =
                self.counters.guest_ends_from_block_layer.saturating_add(1);
        }
        let app_from_block = g.flags & GUEST_F_SYSCALL == 0 || g.flags & GUEST_F_REAPED == 0;
        if app_from_block {
            self.counters.app_ends_from_block_layer =
                self.counters.app_ends_from_block_layer.saturating_add(1);
        }
        let clock = self.clocks.entry(ev.vm).or_default();
        let offset = clock.offset();
        clock.add(
            ev.kick_ns,
            (g.flags & GUEST_F_NO_IRQ == 0)
                .then(|| bound(h.signal_ns, g.irq_ns))
                .flatten(),
            (g.flags & GUEST_F_NO_KICK == 0)
                .then(|| bound(ev.kick_ns, g.kick_ns))
                .flatten(),
        );
        let key = StitchKey {
            vm: ev.vm,
            vdisk: ev.vdisk,
            op: host.op,
        };
        let at = |ns: u64| offset.map_or(ns, |o| ns.saturating_add_signed(o));
        let span = IoSpan {
            begin_ns: at(begin),
            guest_kick_ns: at(kick),
            guest_irq_ns: at(irq),
            end_ns: at(end),
            clock_offset_ns: offset,
            guest_ns: guest,
            hypervisor_ns: hypervisor,
            total_ns: total,
            app_ends_from_block_layer: app_from_block,
            has_guest: true,
            queue: self.queue_ok(ev.vm, ev.vdisk, g.queue),
            ..host
        };
        self.stitched
            .entry(key)
            .or_insert_with(SplitWindow::joined)
            .record(&span);
        if let Some(q) = span.queue {
            self.queues
                .entry((key, q))
                .or_insert_with(SplitWindow::joined)
                .record(&span);
        }
        if let Some(t) = self.tails.as_mut() {
            t.record(&span);
        }
        if let Some(spans) = self.spans.as_mut() {
            spans.push(span);
        }
    }

    /// Gives up, counted, what waited past its side's rule in one VM (all
    /// of it when `all`). Only the fronts of the VM's two queues are looked
    /// at: constant work per record.
    ///
    /// A guest record waits the hold on the stream clock, or `WAIT_WALL` on
    /// the wall clock (when no host I/O moves the stream). A host record
    /// waits the hold and until the guest has reported past it, or at most
    /// `MAX_GUEST_LAG_*`; past `MAX_WAITING_HOST` the oldest goes.
    fn evict(&mut self, vm: u32, all: bool) {
        let Some(w) = self.waiting.get_mut(&vm) else {
            return;
        };
        let (now, latest) = (Instant::now(), self.latest_ns);
        let waited = |a: &Arrival, stream_ns: u64, wall: Duration| {
            a.stream_ns.saturating_add(stream_ns) <= latest
                || now.saturating_duration_since(a.at) >= wall
        };
        let guest_wall = self.wait_wall.unwrap_or(WAIT_WALL);
        // Whether an arrival is due is told from the arrival alone; only a
        // due one is looked up (it may have been joined since: passed over).
        while let Some(&a) = w.guest.front() {
            if !all && !waited(&a, self.hold_ns, guest_wall) {
                break;
            }
            w.guest.pop_front();
            if let Some(i) = position(&self.guest, &a.key, |g| g.stream_ns == a.stream_ns) {
                remove_at(&mut self.guest, &a.key, i);
                w.guests = w.guests.saturating_sub(1);
                self.counters.unmatched_guest = self.counters.unmatched_guest.saturating_add(1);
            }
        }
        while let Some(&a) = w.host.front() {
            let reported = w.reported_ns >= a.done_ns.saturating_add(REPORT_SLACK_NS)
                && waited(&a, self.hold_ns, guest_wall);
            let reason = if reported {
                Reason::ReportedPast
            } else if w.hosts > MAX_WAITING_HOST {
                Reason::OverCap
            } else if waited(&a, MAX_GUEST_LAG_NS, MAX_GUEST_LAG_WALL) {
                Reason::Lagged
            } else if all {
                Reason::AtEnd
            } else {
                break;
            };
            w.host.pop_front();
            if let Some(i) = position(&self.host, &a.key, |h| h.ev.done_ns == a.done_ns) {
                remove_at(&mut self.host, &a.key, i);
                w.hosts = w.hosts.saturating_sub(1);
                self.counters.unmatched_host = self.counters.unmatched_host.saturating_add(1);
                self.counters.unmatched_host_by.count(reason);
            }
        }
    }

    /// Gives up what waited too long in every VM: a VM whose I/O stopped
    /// brings no record of its own to `evict`.
    pub fn expire(&mut self) {
        self.evict_all(false);
    }

    fn evict_all(&mut self, all: bool) {
        let vms: Vec<u32> = self.waiting.keys().copied().collect();
        for vm in vms {
            self.evict(vm, all);
        }
    }

    /// The guest's queue index, if the host gave the disk that many queues.
    fn queue_ok(&mut self, vm: u32, vdisk: u32, queue: u32) -> Option<u32> {
        let limit = self
            .queue_limits
            .get(&(vm, vdisk))
            .copied()
            .unwrap_or(DEFAULT_QUEUES);
        if queue < limit {
            Some(queue)
        } else {
            self.counters.queue_out_of_range = self.counters.queue_out_of_range.saturating_add(1);
            None
        }
    }

    /// The end of a run: whatever still waits is unmatched.
    pub fn finish(&mut self) {
        self.evict_all(true);
    }
}

/// Where, among the records waiting under `key`, the one `is` picks out.
fn position<T>(
    waiting: &HashMap<JoinKey, VecDeque<T>>,
    key: &JoinKey,
    is: impl Fn(&T) -> bool,
) -> Option<usize> {
    waiting.get(key)?.iter().position(is)
}

/// Removes the `i`th record waiting under `key` (the key with its last).
fn remove_at<T>(waiting: &mut HashMap<JoinKey, VecDeque<T>>, key: &JoinKey, i: usize) {
    if let Some(q) = waiting.get_mut(key) {
        q.remove(i);
        if q.is_empty() {
            waiting.remove(key);
        }
    }
}

/// How far a joined guest record shows the guest has reported, on the
/// host clock: its own completion moved by the VM's clock offset where one
/// is known (a record joined to the wrong request of a repeated offset —
/// a later one — must not carry the mark past requests still to come),
/// else its partner's.
fn reported_to(host_done_ns: u64, guest_done_ns: u64, offset: Option<i64>) -> u64 {
    offset
        .and_then(|o| u64::try_from(i128::from(guest_done_ns).saturating_add(i128::from(o))).ok())
        .map_or(host_done_ns, |g| g.min(host_done_ns))
}

/// A guest I/O's ends as the guest saw them: from the application's
/// call (or the block layer's start) to its reap (or the completion), and
/// the kick and interrupt between (the block layer's issue and completion
/// where the guest saw neither).
struct GuestEnds {
    begin: u64,
    end: u64,
    kick: u64,
    irq: u64,
}

impl GuestEnds {
    fn of(g: &GuestIoEvent) -> Self {
        let begin = if g.flags & GUEST_F_SYSCALL != 0 && g.sys_ns != 0 {
            g.sys_ns.min(g.start_ns)
        } else {
            g.start_ns
        };
        let end = if g.flags & GUEST_F_REAPED != 0 {
            g.reap_ns.max(g.done_ns)
        } else {
            g.done_ns
        };
        let kick = if g.flags & GUEST_F_NO_KICK != 0 {
            g.issue_ns
        } else {
            g.kick_ns
        };
        let irq = if g.flags & GUEST_F_NO_IRQ != 0 {
            g.done_ns
        } else {
            g.irq_ns
        };
        Self {
            begin,
            end,
            kick,
            irq,
        }
    }
}

/// host − guest, where it fits the clock's offsets (a guest stamp no
/// clock could give is no bound).
fn bound(host_ns: u64, guest_ns: u64) -> Option<i64> {
    i64::try_from(i128::from(host_ns).saturating_sub(i128::from(guest_ns))).ok()
}

/// The candidate kick nearest to `reference + shift` (a kick moved to the
/// candidates' clock); without a shift (or a reference), the oldest.
fn best(mut kicks: impl Iterator<Item = u64>, reference: u64, shift: Option<i64>) -> Option<usize> {
    let Some(shift) = shift.filter(|_| reference != 0) else {
        return kicks.next().map(|_| 0);
    };
    let want = i128::from(reference).saturating_add(i128::from(shift));
    kicks
        .enumerate()
        .min_by_key(|&(_, k)| i128::from(k).saturating_sub(want).unsigned_abs())
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests;
