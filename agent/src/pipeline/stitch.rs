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
        *n += 1;
    }
}

/// The offset of one VM's guest clock, from the bounds its requests give.
///
/// A bound can be wrong: a host kick taken from an earlier notification
/// gives an upper bound below the truth, a completion the guest reaped
/// before its interrupt was raised a lower bound above it. Per window the
/// offset is where the fewest bounds are violated; those few are counted
/// as contradicting, and the interval where that minimum holds is the
/// uncertainty.
#[derive(Clone, Debug, Default)]
pub struct Clock {
    /// The bounds of each second, oldest first.
    windows: VecDeque<BoundsWindow>,
    pub pairs: u64,
    /// The latest window's estimate, refreshed every few pairs (matching
    /// asks for it per request).
    cached: Option<i64>,
}

/// One second's bounds on a guest clock's offset.
#[derive(Clone, Debug, Default)]
struct BoundsWindow {
    /// Its start, on the host clock.
    start_ns: u64,
    lower: Vec<i64>,
    upper: Vec<i64>,
}

/// The offsets that violate the fewest bounds of a window: `low..=high`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct OffsetInterval {
    low: i64,
    high: i64,
    violations: u64,
}

impl OffsetInterval {
    fn mid(&self) -> i64 {
        self.low / 2 + self.high / 2
    }
}

/// What is known of a guest clock: host = guest + offset_ns (+ drift).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClockEstimate {
    pub offset_ns: i64,
    /// Half the width of the latest window's interval: the offset lies
    /// within ± this.
    pub uncertainty_ns: i64,
    /// Rate of the offset's change across windows, in parts per million.
    pub drift_ppm: f64,
    pub pairs: u64,
    /// Bounds set aside as contradicting the others, over all windows.
    pub contradicting_bounds: u64,
}

const WINDOW_NS: u64 = 1_000_000_000;
const MAX_WINDOWS: usize = 120;
/// Bounds kept per window and side.
const MAX_BOUNDS: usize = 2048;

/// The interval of offsets violating the fewest bounds.
fn best_interval(lower: &[i64], upper: &[i64]) -> Option<OffsetInterval> {
    let mut lo = lower.to_vec();
    let mut hi = upper.to_vec();
    lo.sort_unstable();
    hi.sort_unstable();
    // Candidate offsets: every bound. violations(θ) = #lower > θ + #upper < θ.
    let mut cands: Vec<i64> = lo.iter().chain(hi.iter()).copied().collect();
    cands.sort_unstable();
    cands.dedup();
    let viol =
        |t: i64| (lo.len() - lo.partition_point(|&l| l <= t)) + hi.partition_point(|&u| u < t);
    let best = cands.iter().map(|&t| viol(t)).min()?;
    let at: Vec<i64> = cands.iter().copied().filter(|&t| viol(t) == best).collect();
    Some(OffsetInterval {
        low: *at.first()?,
        high: *at.last()?,
        violations: best as u64,
    })
}

impl Clock {
    fn add(&mut self, host_ns: u64, lo: Option<i64>, hi: Option<i64>) {
        self.pairs += 1;
        let start = host_ns - host_ns % WINDOW_NS;
        if self.windows.back().is_none_or(|w| w.start_ns != start) {
            self.windows.push_back(BoundsWindow {
                start_ns: start,
                ..Default::default()
            });
            if self.windows.len() > MAX_WINDOWS {
                self.windows.pop_front();
            }
        }
        if let Some(w) = self.windows.back_mut() {
            if let Some(lo) = lo.filter(|_| w.lower.len() < MAX_BOUNDS) {
                w.lower.push(lo);
            }
            if let Some(hi) = hi.filter(|_| w.upper.len() < MAX_BOUNDS) {
                w.upper.push(hi);
            }
        }
        if self.pairs % 64 == 1 {
            self.cached = self
                .windows
                .back()
                .and_then(|w| best_interval(&w.lower, &w.upper))
                .map(|i| i.mid());
        }
    }

    pub fn estimate(&self) -> Option<ClockEstimate> {
        let fits: Vec<(u64, OffsetInterval)> = self
            .windows
            .iter()
            .filter(|w| !w.lower.is_empty() && !w.upper.is_empty())
            .filter_map(|w| best_interval(&w.lower, &w.upper).map(|i| (w.start_ns, i)))
            .collect();
        let (_, last) = *fits.last()?;
        let pts: Vec<(f64, f64)> = fits
            .iter()
            .map(|(start, i)| (*start as f64, (i.low as f64 + i.high as f64) / 2.0))
            .collect();
        // Least squares through the windows' midpoints: the drift.
        let n = pts.len() as f64;
        let (mx, my) = pts
            .iter()
            .fold((0.0, 0.0), |a, c| (a.0 + c.0 / n, a.1 + c.1 / n));
        let (sxy, sxx) = pts.iter().fold((0.0, 0.0), |a, c| {
            (a.0 + (c.0 - mx) * (c.1 - my), a.1 + (c.0 - mx).powi(2))
        });
        Some(ClockEstimate {
            offset_ns: last.mid(),
            uncertainty_ns: (last.high - last.low) / 2,
            drift_ppm: if sxx > 0.0 { sxy / sxx * 1e6 } else { 0.0 },
            pairs: self.pairs,
            contradicting_bounds: fits.iter().map(|(_, i)| i.violations).sum(),
        })
    }

    /// The current offset for matching, if known.
    fn offset(&self) -> Option<i64> {
        self.cached
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
            w.hosts += 1;
            w.host
                .push_back(Arrival::now(self.latest_ns, key, io.ev.done_ns));
            self.host.entry(key).or_default().push_back(io);
        }
        self.evict(key.vm, false);
    }

    pub fn on_guest(&mut self, vm: u32, g: GuestIoEvent) {
        let Some(&vdisk) = self.disks.get(&(vm, g.dev)) else {
            self.counters.unknown_disk += 1;
            return;
        };
        // The guest's sector is the guest's to say: one past any file
        // offset joins nothing.
        let Some(pos) = g.sector.checked_mul(512) else {
            self.counters.unmatched_guest += 1;
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
                    self.counters.guest_over_cap += 1;
                    return;
                }
                w.guests += 1;
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
            offset.map(|o| -o),
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
        let total = end.saturating_sub(begin);
        let from_block = g.flags & (GUEST_F_NO_KICK | GUEST_F_NO_IRQ) != 0;
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
            self.counters.inconsistent += 1;
            return;
        };
        if from_block {
            self.counters.guest_ends_from_block_layer += 1;
        }
        let app_from_block = g.flags & GUEST_F_SYSCALL == 0 || g.flags & GUEST_F_REAPED == 0;
        if app_from_block {
            self.counters.app_ends_from_block_layer += 1;
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
                self.counters.unmatched_guest += 1;
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
                self.counters.unmatched_host += 1;
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
            self.counters.queue_out_of_range += 1;
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
        .and_then(|o| u64::try_from(i128::from(guest_done_ns) + i128::from(o)).ok())
        .map_or(host_done_ns, |g| g.min(host_done_ns))
}

/// host − guest, where it fits the clock's offsets (a guest stamp no
/// clock could give is no bound).
fn bound(host_ns: u64, guest_ns: u64) -> Option<i64> {
    i64::try_from(i128::from(host_ns) - i128::from(guest_ns)).ok()
}

/// The candidate kick nearest to `reference + shift` (a kick moved to the
/// candidates' clock); without a shift (or a reference), the oldest.
fn best(mut kicks: impl Iterator<Item = u64>, reference: u64, shift: Option<i64>) -> Option<usize> {
    let Some(shift) = shift.filter(|_| reference != 0) else {
        return kicks.next().map(|_| 0);
    };
    let want = i128::from(reference) + i128::from(shift);
    kicks
        .enumerate()
        .min_by_key(|&(_, k)| (i128::from(k) - want).unsigned_abs())
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::{EVENT_GUEST_IO, EVENT_VM_IO};
    use crate::model::Hist;

    const THETA: u64 = 5_000_000_000; // host = guest + 5 s

    /// A guest request at guest time `t` and its host record, consistent:
    /// guest start t, kick t+10, host kick +2 (θ applied), pickup +5, start
    /// +20, done +60, signal +70, guest irq +75, guest done +80 (µs).
    fn pair(pos: u64, t: u64) -> (GuestIoEvent, HostIo) {
        let us = 1000;
        let g = GuestIoEvent {
            kind: EVENT_GUEST_IO,
            dev: 7,
            sector: pos / 512,
            bytes: 4096,
            start_ns: t,
            issue_ns: t + 5 * us,
            kick_ns: t + 10 * us,
            irq_ns: t + 75 * us,
            done_ns: t + 80 * us,
            ..Default::default()
        };
        let h = t + THETA;
        let ev = VmIoEvent {
            kind: EVENT_VM_IO,
            vm: 1,
            vdisk: 3,
            pos,
            bytes: 4096,
            kick_ns: h + 12 * us,
            pick_ns: h + 15 * us,
            start_ns: h + 20 * us,
            done_ns: h + 60 * us,
            ..Default::default()
        };
        (
            g,
            HostIo {
                ev,
                signal_ns: h + 70 * us,
                signal_wait_ns: 0,
            },
        )
    }

    fn stitcher() -> Stitcher {
        let mut s = Stitcher::new(2_000_000_000);
        s.expect_guest(1);
        s.map_disk(1, 7, 3);
        s
    }

    #[test]
    fn the_applications_system_calls_bound_the_guest_observed_latency() {
        let mut s = stitcher();
        let (mut g, h) = pair(4096, 1_000_000);
        // Submitted by a call entered 30 µs before the block layer's start,
        // reaped by one returning 25 µs after its completion.
        g.flags |= GUEST_F_SYSCALL | GUEST_F_REAPED;
        g.sys_ns = g.start_ns - 30_000;
        g.reap_ns = g.done_ns + 25_000;
        s.on_guest(1, g);
        s.on_host(h);
        let st = &s.stitched[&StitchKey {
            vm: 1,
            vdisk: 3,
            op: Op::Read,
        }];
        let mean = |h: &Hist| h.summary().mean_us;
        assert!(
            (mean(&st.window) - 135.0).abs() < 0.5,
            "{}",
            mean(&st.window)
        );
        assert!(
            (mean(st.guest.as_ref().expect("the joined view's guest segment")) - 70.0).abs() < 0.5,
            "{}",
            mean(st.guest.as_ref().expect("the joined view's guest segment"))
        );
        assert!((mean(&st.hypervisor) - 10.0).abs() < 0.5);
        assert_eq!(s.counters.app_ends_from_block_layer, 0);
        // Without its reaping call: the block layer's completion ends it.
        let (mut g, h) = pair(8192, 2_000_000);
        g.flags |= GUEST_F_SYSCALL;
        g.sys_ns = g.start_ns - 30_000;
        s.on_guest(1, g);
        s.on_host(h);
        assert_eq!(s.counters.app_ends_from_block_layer, 1);
    }

    /// Fuzzing found these: guest stamps at the ends of u64 made the
    /// guest segment's sum, the clock bounds and the nearest-kick search
    /// overflow (a panic in debug, wrapped figures in release).
    #[test]
    fn guest_stamps_at_the_ends_of_the_clock_are_refused_not_wrapped() {
        let mut s = stitcher();
        for (i, (kick, irq, done)) in [
            (u64::MAX, 0, u64::MAX),
            (0, u64::MAX, 1),
            (u64::MAX / 2, 0, u64::MAX),
        ]
        .into_iter()
        .enumerate()
        {
            let (mut g, h) = pair(4096 * (i as u64 + 1), 1_000_000);
            g.start_ns = 0;
            g.kick_ns = kick;
            g.irq_ns = irq;
            g.done_ns = done;
            g.flags |= GUEST_F_REAPED;
            g.reap_ns = u64::MAX;
            s.on_guest(1, g);
            s.on_host(h);
        }
        // Each joined nothing it could not hold: refused and counted.
        assert_eq!(s.counters.inconsistent, 3, "{:?}", s.counters);
        assert!(s.stitched.is_empty());
        // And a sane request after them still joins.
        let (g, h) = pair(1 << 20, 2_000_000);
        s.on_guest(1, g);
        s.on_host(h);
        assert_eq!(
            s.stitched.values().map(|st| st.window.count).sum::<u64>(),
            1
        );
        assert_eq!(bound(u64::MAX, 0), None);
        assert_eq!(bound(5, 7), Some(-2));
        assert_eq!(
            best([u64::MAX, 3].into_iter(), u64::MAX, Some(i64::MAX)),
            Some(0)
        );
    }

    #[test]
    fn segments_tile_the_guest_observed_latency_whatever_the_clocks() {
        let mut s = stitcher();
        let (g, h) = pair(4096, 1_000_000);
        s.on_guest(1, g);
        s.on_host(h);
        let st = &s.stitched[&StitchKey {
            vm: 1,
            vdisk: 3,
            op: Op::Read,
        }];
        let mean = |h: &Hist| h.summary().mean_us;
        // guest 10 + 5, device 40, engine 5 + 10, hypervisor 80 - 70 = 10.
        assert_eq!(st.window.summary().count, 1);
        assert!(
            (mean(st.guest.as_ref().expect("the joined view's guest segment")) - 15.0).abs() < 0.5,
            "{}",
            mean(st.guest.as_ref().expect("the joined view's guest segment"))
        );
        assert!((mean(&st.device) - 40.0).abs() < 0.5);
        assert!((mean(&st.engine) - 15.0).abs() < 0.5);
        assert!((mean(&st.hypervisor) - 10.0).abs() < 0.5);
        assert!((mean(&st.window) - 80.0).abs() < 1.0);
    }

    #[test]
    fn the_clock_offset_is_bracketed_by_kicks_and_completions() {
        let mut s = stitcher();
        for i in 0..200 {
            let (g, h) = pair(i * 4096, 1_000_000 + i * 200_000);
            if i % 2 == 0 {
                s.on_guest(1, g);
                s.on_host(h);
            } else {
                s.on_host(h);
                s.on_guest(1, g);
            }
        }
        let est = s.clocks[&1].estimate().unwrap();
        // θ ∈ [signal − irq, host kick − guest kick] = [θ − 5 µs, θ + 2 µs].
        assert!((est.offset_ns - THETA as i64).abs() <= 5_000, "{est:?}");
        assert_eq!(
            (est.uncertainty_ns, est.contradicting_bounds),
            (3_500, 0),
            "{est:?}"
        );
        assert_eq!(est.pairs, 200);
    }

    #[test]
    fn bounds_from_earlier_notifications_are_set_aside() {
        let mut s = stitcher();
        for i in 0..100u64 {
            let (g, mut h) = pair(i * 4096, 1_000_000 + i * 200_000);
            if i % 10 == 0 {
                // The host took an older kick for this one.
                h.ev.kick_ns -= 150_000;
            }
            s.on_guest(1, g);
            s.on_host(h);
        }
        let est = s.clocks[&1].estimate().unwrap();
        assert!((est.offset_ns - THETA as i64).abs() <= 5_000, "{est:?}");
        assert_eq!(est.contradicting_bounds, 10, "{est:?}");
    }

    #[test]
    fn repeated_offsets_are_told_apart_by_time_and_strays_are_counted() {
        let mut s = stitcher();
        // Establish the clock, then two requests for the same offset whose
        // guest records arrive after both host records.
        let (g, h) = pair(0, 1_000_000);
        s.on_guest(1, g);
        s.on_host(h);
        let (g1, h1) = pair(8192, 2_000_000);
        let (g2, h2) = pair(8192, 3_000_000);
        s.on_host(h1);
        s.on_host(h2);
        s.on_guest(1, g2);
        s.on_guest(1, g1);
        assert_eq!(
            s.stitched
                .values()
                .map(|v| v.window.summary().count)
                .sum::<u64>(),
            3
        );
        assert_eq!(s.counters.inconsistent, 0);
        // A guest request of an unknown disk, and one with no host partner.
        s.on_guest(1, GuestIoEvent { dev: 99, ..g1 });
        s.on_guest(1, GuestIoEvent { sector: 777, ..g1 });
        s.finish();
        assert_eq!(
            (
                s.counters.unknown_disk,
                s.counters.unmatched_guest,
                s.counters.unmatched_host
            ),
            (1, 1, 0)
        );
    }

    /// A guest busy with its benchmark: its agent (SCHED_IDLE) sends the
    /// first three seconds' records five seconds late. Every one joins.
    #[test]
    fn a_busy_guests_late_records_still_join() {
        let mut s = stitcher();
        let ms = 1_000_000;
        let early: Vec<_> = (0..3000u64).map(|i| pair(4096 * i, i * ms)).collect();
        for (_, h) in &early {
            s.on_host(*h);
        }
        // The host goes on for five more seconds before the guest speaks.
        let late: Vec<_> = (3000..8000u64).map(|i| pair(4096 * i, i * ms)).collect();
        for (_, h) in &late {
            s.on_host(*h);
        }
        assert_eq!(s.counters.unmatched_host, 0, "nothing given up unreported");
        for (g, _) in early.iter().chain(&late) {
            s.on_guest(1, *g);
        }
        s.finish();
        let joined = s.stitched.values().map(|st| st.window.count).sum::<u64>();
        assert_eq!(joined, 8000);
        assert_eq!(
            (s.counters.unmatched_host, s.counters.unmatched_guest),
            (0, 0)
        );
    }

    /// The same, on a small disk whose offsets repeat many times within
    /// the late seconds, and with the guest's first records (which give
    /// the clock its offset) among the late ones: still every one joins,
    /// each with its own partner.
    #[test]
    fn late_records_of_repeated_offsets_join_their_own_partners() {
        for before in [0u64, 200] {
            let mut s = stitcher();
            let ms = 1_000_000;
            let pairs: Vec<_> = (0..24000u64)
                .map(|i| pair(4096 * ((i * 7919) % 97), i * ms / 2))
                .collect();
            // Live before the stall: joined as they come.
            for (g, h) in &pairs[..before as usize] {
                s.on_host(*h);
                s.on_guest(1, *g);
            }
            // Five seconds with the guest agent stopped; then its backlog
            // in one drain, and its records 200 ms behind the host's.
            let stall = before as usize + 10_000;
            for (_, h) in &pairs[before as usize..stall] {
                s.on_host(*h);
            }
            for (g, _) in &pairs[before as usize..stall] {
                s.on_guest(1, *g);
            }
            for i in stall..pairs.len() {
                s.on_host(pairs[i].1);
                if i >= stall + 400 {
                    s.on_guest(1, pairs[i - 400].0);
                }
            }
            for (g, _) in &pairs[pairs.len() - 400..] {
                s.on_guest(1, *g);
            }
            s.finish();
            let joined = s.stitched.values().map(|st| st.window.count).sum::<u64>();
            assert_eq!(joined, 24000, "{before}: {:?}", s.counters);
        }
    }

    /// A host completion never delivered leaves its guest record to join
    /// a later request at the same offset (random reads of a small disk
    /// repeat them): that wrong join must not carry the guest's reported
    /// mark seconds ahead, past the late records still to come, whose host
    /// partners would then be given up unjoined.
    #[test]
    fn a_wrong_join_to_a_later_request_gives_up_no_other() {
        let mut s = stitcher();
        let ms = 1_000_000;
        // Every request at its own offset but two: 300 and 8000 share one.
        let at = |i: u64| if i == 8000 { 4096 * 300 } else { 4096 * i };
        let pairs: Vec<_> = (0..10_000u64).map(|i| pair(at(i), i * ms)).collect();
        for (g, h) in &pairs[..200] {
            s.on_host(*h);
            s.on_guest(1, *g);
        }
        assert!(s.clocks[&1].offset().is_some(), "the offset is known");
        // The guest agent stops; 300's completion never reaches the host.
        for (i, (_, h)) in pairs.iter().enumerate().skip(200) {
            if i != 300 {
                s.on_host(*h);
            }
        }
        for (g, _) in &pairs[200..] {
            s.on_guest(1, *g);
        }
        assert_eq!(s.counters.unmatched_host, 0, "{:?}", s.counters);
        // 300's guest record took 8000's host request; 8000's guest record
        // is left without one.
        let joined = s.stitched.values().map(|st| st.window.count).sum::<u64>();
        assert_eq!(joined, 9999);
        s.finish();
        assert_eq!(
            (s.counters.unmatched_host, s.counters.unmatched_guest),
            (0, 1)
        );
    }

    /// Once the guest has reported past a host record (plus the reaping
    /// slack and the hold), the record's partner is not coming: counted.
    #[test]
    fn host_records_the_guest_reported_past_are_given_up() {
        let mut s = stitcher();
        let ms = 1_000_000;
        let (_, lost) = pair(1 << 30, 0);
        s.on_host(lost);
        let step = |s: &mut Stitcher, i: u64| {
            let (g, h) = pair(4096 * i, i * ms);
            s.on_host(h);
            s.on_guest(1, g);
        };
        let due = (REPORT_SLACK_NS.max(s.hold_ns) / ms) + 1;
        for i in 1..due - 10 {
            step(&mut s, i);
        }
        assert_eq!(
            s.counters.unmatched_host, 0,
            "reported, but within the slack"
        );
        for i in due - 10..due + 10 {
            step(&mut s, i);
        }
        assert_eq!(s.counters.unmatched_host, 1);
        assert_eq!(s.counters.unmatched_host_by.reported_past, 1);
        assert_eq!(s.waiting[&1].hosts, 0);
    }

    /// A channel that never speaks: host records wait the lag bound, not
    /// the hold, and no more than `MAX_WAITING_HOST` of them.
    #[test]
    fn a_silent_guest_holds_host_records_within_bounds() {
        let mut s = stitcher();
        let ms = 1_000_000;
        let n = MAX_GUEST_LAG_NS / (10 * ms);
        for i in 0..n {
            s.on_host(pair(4096 * i, i * 10 * ms).1);
        }
        assert_eq!(s.counters.unmatched_host, 0, "within the lag bound");
        for i in n..n + 100 {
            s.on_host(pair(4096 * i, i * 10 * ms).1);
        }
        assert!(
            (100..=101).contains(&s.counters.unmatched_host),
            "{}",
            s.counters.unmatched_host
        );
        // A flood: the oldest go past the cap.
        let mut s = stitcher();
        let flood = MAX_WAITING_HOST as u64 + 500;
        for i in 0..flood {
            s.on_host(pair(4096 * i, i).1);
        }
        assert_eq!(s.counters.unmatched_host, 500);
        assert_eq!(s.counters.unmatched_host_by.over_cap, 500);
        assert_eq!(s.waiting[&1].hosts, MAX_WAITING_HOST);
    }

    #[test]
    fn a_wrong_join_is_refused_not_recorded() {
        let mut s = stitcher();
        let (mut g, h) = pair(0, 1_000_000);
        // The guest claims less time than the host's window took.
        g.irq_ns = g.kick_ns + 1000;
        g.done_ns = g.irq_ns + 1000;
        s.on_guest(1, g);
        s.on_host(h);
        assert_eq!(s.counters.inconsistent, 1);
        assert!(s.stitched.is_empty());
    }

    /// A hostile guest: real I/Os each reported with a new queue index,
    /// then records that match nothing with no host I/O at all. Per-queue
    /// rows stay within the host's queue count, waiting records within the
    /// cap and the wall-clock wait; every refusal is counted.
    #[test]
    fn a_guest_cannot_grow_the_stitcher_past_the_hosts_facts() {
        let mut s = stitcher();
        s.set_queues(1, 3, 4);
        for i in 0..1000u64 {
            let (mut g, h) = pair(4096 * (i + 1), 1_000_000 + i * 1_000_000);
            g.queue = (i * 7919) as u32; // 0, 7919, …: a new index each time
            s.on_guest(1, g);
            s.on_host(h);
        }
        let joined = s.stitched.values().map(|st| st.window.count).sum::<u64>();
        assert_eq!(joined, 1000, "every real I/O is still joined");
        assert!(
            s.queues.keys().all(|(_, q)| *q < 4),
            "{:?}",
            s.queues.keys()
        );
        assert_eq!(
            s.queues.len(),
            1,
            "only queue 0 of the indexes sent is below 4"
        );
        assert_eq!(s.counters.queue_out_of_range, 999);

        // 200k records no host request will ever match, no host I/O.
        let flood = 200_000u64;
        for i in 0..flood {
            let (mut g, _) = pair(1 << 40 | (i * 4096), 9_000_000_000 + i);
            g.queue = 0;
            s.on_guest(1, g);
        }
        let waiting: usize = s.guest.values().map(VecDeque::len).sum();
        assert!(waiting <= MAX_WAITING_GUEST, "{waiting} waiting");
        assert_eq!(s.counters.guest_over_cap, flood - MAX_WAITING_GUEST as u64);
        // A sector whose byte offset does not fit: refused, counted.
        let (mut g, _) = pair(0, 1);
        g.sector = u64::MAX;
        let before = s.counters.unmatched_guest;
        s.on_guest(1, g);
        assert_eq!(s.counters.unmatched_guest, before + 1);

        // On the wall clock the waiting ones go, counted unmatched.
        s.wait_wall = Some(std::time::Duration::from_millis(50));
        std::thread::sleep(std::time::Duration::from_millis(60));
        let (g, _) = pair(1 << 41, 1);
        s.on_guest(1, g);
        let waiting: usize = s.guest.values().map(VecDeque::len).sum();
        assert_eq!(waiting, 1, "only the newest waits");
        assert_eq!(
            s.counters.unmatched_guest,
            before + 1 + MAX_WAITING_GUEST as u64
        );
        assert_eq!(s.waiting[&1].guests, 1);
    }
}
