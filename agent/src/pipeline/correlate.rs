//! Splits each VM request's host window into hypervisor, engine and device
//! time, from the records the kernel side streams:
//!
//! ```text
//!  kick ──hypervisor── pickup ──engine── host start ──device── host done ──engine── signal
//!  (vCPU writes the     (engine thread    (the request's         (driver          (engine writes an
//!   virtqueue eventfd)   reads it)         kernel start)          completion)      eventfd to the guest)
//! ```
//!
//! The kick and pickup ride with the request from its submission; the
//! signal is the first one the VM's engine sends after the request's host
//! completion. Signals come through the ring buffer from any CPU, so a
//! request waits `hold_ns` of stream time for its signal to arrive before it
//! is settled. The three segments tile the window exactly. Under TCG the
//! injection that follows the signal is not observable: the window ends at
//! the signal.

use std::collections::{BTreeMap, HashMap, VecDeque};

use crate::model::SplitCounters;
use crate::{
    abi::{vm_seg, VdiskKey, VmIoEvent, VmSplitEvent, VmSplitKey, VmUnsplit, RQ_F_POLLED},
    discover::disks::Dev,
    model::IoSpan,
    model::{Hist, JoinedWindows, Op, SplitWindow},
    pipeline::stitch::{HostIo, Stitcher},
    pipeline::vqueue::{Layout, QueueIndex},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct SplitKey {
    pub vm: u32,
    pub dev: Dev,
    pub op: Op,
    pub vdisk: u32,
}

/// Windows the kernel joined (the always-on tier: no CPU waits).
fn add_joined(s: &mut SplitWindow, w: &JoinedWindows) {
    s.bytes = s.bytes.saturating_add(w.bytes);
    // In `vm_seg` order (held below).
    let [hypervisor, engine, device, window, pickup_to_done] = &w.segments;
    s.hypervisor.merge_any(hypervisor);
    s.engine.merge_any(engine);
    s.device.merge_any(device);
    s.window.merge_any(window);
    if let Some(h) = &mut s.host {
        h.pickup_to_done.merge_any(pickup_to_done);
    }
}

const _: () = assert!(
    vm_seg::HYPERVISOR == 0
        && vm_seg::ENGINE == 1
        && vm_seg::DEVICE == 2
        && vm_seg::WINDOW == 3
        && vm_seg::PICKUP_TO_DONE == 4
);

/// An engine's signal to the guest, with the signalling thread's last
/// waits for a CPU (start, end; newest first).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Signal {
    pub ts_ns: u64,
    pub waits: [(u64, u64); 2],
    /// The completions it makes visible: a used-ring push's count (the
    /// engine pushes one request at a time, in completion order), or 0 for
    /// an interrupt covering every completion before it.
    pub covers: u16,
    /// How many requests took it (a push is taken by at most `covers`).
    pub taken: u16,
}

impl Signal {
    /// Whether another request may take it.
    fn has_room(&self) -> bool {
        self.covers == 0 || self.taken < self.covers
    }

    /// How much of [from, signal] its thread waited for a CPU.
    fn waited_since(&self, from: u64) -> u64 {
        self.waits
            .iter()
            .map(|&(s, e)| e.min(self.ts_ns).saturating_sub(s.max(from)))
            .sum()
    }
}

/// A VM's signals in time order, waiting for the requests they complete.
/// At depth a request's own push comes after many others' completions, and
/// a request waiting for its push is looked at again with every record:
/// the span of times whose signals are all taken is kept, so that a look
/// starts past it instead of walking it again.
#[derive(Default)]
struct Signals {
    q: VecDeque<Signal>,
    /// Every signal timed in [.0, .1) is taken as often as it covers.
    full: (u64, u64),
}

impl Signals {
    fn insert(&mut self, sig: Signal) {
        // Nearly always in order; records from other CPUs may be a little late.
        let at = self
            .q
            .iter()
            .rposition(|s| s.ts_ns <= sig.ts_ns)
            .map_or(0, |i| i.saturating_add(1));
        let (lo, hi) = self.full;
        if sig.has_room() && lo <= sig.ts_ns && sig.ts_ns < hi {
            self.full.1 = sig.ts_ns;
        }
        self.q.insert(at, sig);
    }

    /// The first signal at or after `done` that has room, taken once more.
    fn take_after(&mut self, done: u64) -> Option<Signal> {
        let (lo, hi) = self.full;
        let in_full = lo <= done && done < hi;
        let from = if in_full { hi } else { done };
        let start = if in_full { lo } else { done };
        let i = self.q.partition_point(|s| s.ts_ns < from);
        // Everything walked over on the way is full: the span grows to it.
        let Some(s) = self.q.range_mut(i..).find(|s| s.has_room()) else {
            if let Some(last) = self.q.back().filter(|l| l.ts_ns >= from) {
                self.full = (start, last.ts_ns);
            }
            return None;
        };
        s.taken = s.taken.saturating_add(1);
        let sig = *s;
        self.full = (start, sig.ts_ns.max(from));
        Some(sig)
    }

    /// Signals before `horizon` are done with.
    fn drop_before(&mut self, horizon: u64) {
        while self.q.front().is_some_and(|s| s.ts_ns < horizon) {
            self.q.pop_front();
        }
    }
}

/// The always-on tier's figures, as the kernel joined them.
#[derive(Default)]
struct KernelView {
    splits: BTreeMap<SplitKey, SplitWindow>,
    queue_splits: BTreeMap<(SplitKey, u32), SplitWindow>,
    counters: SplitCounters,
}

pub struct Correlator {
    hold_ns: u64,
    signals: HashMap<u32, Signals>,
    /// Requests waiting for their signal, with whether they are split
    /// (a polled request or one without a kick is not, but its push is its
    /// own: it takes it, so that no other request does).
    pending: VecDeque<(VmIoEvent, bool)>,
    latest_ns: u64,
    /// Both tiers' host windows split, per (VM, disk, op, vdisk), as of the
    /// last `refresh` (the deep tier's recorded here, the always-on tier's
    /// read from the kernel).
    pub splits: BTreeMap<SplitKey, SplitWindow>,
    /// The same per guest queue, where the kick's notifier names it (a VM
    /// found running, its notifiers made before iospan started, has none).
    pub queue_splits: BTreeMap<(SplitKey, u32), SplitWindow>,
    /// The deep tier's, recorded request by request.
    deep_splits: BTreeMap<SplitKey, SplitWindow>,
    deep_queue_splits: BTreeMap<(SplitKey, u32), SplitWindow>,
    deep_counters: SplitCounters,
    kernel: KernelView,
    kernel_bases: HashMap<(u32, u32), QueueBases>,
    /// Per virtual disk: how its notifiers map to queues, and how many
    /// queues the host gave it.
    vdisks: HashMap<u32, (Layout, Option<u32>)>,
    /// Per (VM, virtual disk): the lowest notifier order seen carrying its
    /// requests, its queue 0 as far as known (`QueueIndex::Order`).
    order_base: HashMap<(u32, u32), u16>,
    pub counters: SplitCounters,
    /// Per VM found running: when its push probes went live. A request
    /// completed before then may never see its push (it was pushed
    /// unseen): it takes none, or every later request would take the push
    /// after its own.
    pushes_live: HashMap<u32, u64>,
    /// Joins split requests of VMs with a guest agent to the guest's records.
    pub stitch: Stitcher,
}

impl Correlator {
    pub fn new(hold_ns: u64) -> Self {
        Self {
            hold_ns,
            signals: HashMap::new(),
            pending: VecDeque::new(),
            latest_ns: 0,
            splits: BTreeMap::new(),
            queue_splits: BTreeMap::new(),
            deep_splits: BTreeMap::new(),
            deep_queue_splits: BTreeMap::new(),
            deep_counters: SplitCounters::default(),
            kernel: KernelView::default(),
            kernel_bases: HashMap::new(),
            vdisks: HashMap::new(),
            order_base: HashMap::new(),
            counters: SplitCounters::default(),
            pushes_live: HashMap::new(),
            // Guest records arrive in batches (the guest agent sends every
            // 100 ms): a partner may be a second late.
            stitch: Stitcher::new(2_000_000_000),
        }
    }

    /// Whether a virtual disk's queue layout is known (`set_vdisk`).
    pub fn knows_vdisk(&self, vdisk: u32) -> bool {
        self.vdisks.contains_key(&vdisk)
    }

    /// A virtual disk's device model's notifier layout and its number of
    /// queues (an index at or past it is no queue of the disk's).
    pub fn set_vdisk(&mut self, vdisk: u32, layout: Layout, queues: Option<u32>) {
        self.vdisks.insert(vdisk, (layout, queues));
    }

    /// VM `vm`'s used-ring pushes are seen from `ns` on (see `pushes_live`).
    pub fn pushes_live_from(&mut self, vm: u32, ns: u64) {
        self.pushes_live.insert(vm, ns);
    }

    /// An interrupt covering every completion before it.
    pub fn on_signal(&mut self, vm: u32, ts_ns: u64) {
        self.on_signal_waits(
            vm,
            Signal {
                ts_ns,
                ..Default::default()
            },
        );
    }

    pub fn on_signal_waits(&mut self, vm: u32, sig: Signal) {
        self.signals.entry(vm).or_default().insert(sig);
        self.latest_ns = self.latest_ns.max(sig.ts_ns);
        self.settle(false);
    }

    /// `followed`: whether the request's virtual disk is one whose engine
    /// path is followed; others are only counted.
    pub fn on_io(&mut self, ev: VmIoEvent, followed: bool) {
        self.latest_ns = self.latest_ns.max(ev.done_ns);
        if !followed {
            self.deep_counters.not_followed = self.deep_counters.not_followed.saturating_add(1);
            return;
        }
        let split = if ev.flags & RQ_F_POLLED != 0 {
            self.deep_counters.polled = self.deep_counters.polled.saturating_add(1);
            false
        } else if ev.kick_ns == 0 {
            self.deep_counters.no_kick = self.deep_counters.no_kick.saturating_add(1);
            false
        } else {
            true
        };
        self.pending.push_back((ev, split));
        self.settle(false);
    }

    /// Settles every request still waiting, with the signals there are.
    pub fn finish(&mut self) {
        self.settle(true);
        self.stitch.finish();
        self.refresh();
    }

    /// The always-on tier's windows and unsplit requests as the kernel
    /// has them now (cumulative); `followed`: whether a virtual disk's
    /// windows can be split here at all (its unsplit requests are counted
    /// as not followed where not). Refreshes the view.
    pub fn set_kernel(
        &mut self,
        splits: &BTreeMap<VmSplitKey, JoinedWindows>,
        unsplit: &BTreeMap<VdiskKey, VmUnsplit>,
        followed: impl Fn(u32) -> bool,
    ) {
        let mut view = KernelView::default();
        let bases = queue_bases(splits.keys());
        self.kernel_bases = bases.clone();
        for (k, w) in splits {
            let key = SplitKey {
                vm: k.vm,
                dev: Dev(k.dev),
                op: Op::from_index(usize::from(k.op)).unwrap_or(Op::Other),
                vdisk: k.vdisk,
            };
            add_joined(view.splits.entry(key).or_insert_with(SplitWindow::host), w);
            if let Some(q) = self.kernel_queue(k, &bases) {
                add_joined(
                    view.queue_splits
                        .entry((key, q))
                        .or_insert_with(SplitWindow::host),
                    w,
                );
            }
        }
        for (k, u) in unsplit {
            let c = &mut view.counters;
            if followed(k.vdisk) {
                c.no_kick = c.no_kick.saturating_add(u.no_kick);
                c.polled = c.polled.saturating_add(u.polled);
            } else {
                c.not_followed = c
                    .not_followed
                    .saturating_add(u.no_kick.saturating_add(u.polled));
            }
            c.no_signal = c.no_signal.saturating_add(u.no_signal);
            c.unordered = c.unordered.saturating_add(u.unordered);
        }
        self.kernel = view;
        self.refresh();
    }

    /// Each virtual disk's whole windows so far (both tiers', all its
    /// VM's host disks and ops), from the last `refresh`.
    pub fn vdisk_windows(&self) -> BTreeMap<u32, Hist> {
        let mut out: BTreeMap<u32, Hist> = BTreeMap::new();
        for (k, s) in &self.splits {
            out.entry(k.vdisk).or_default().merge_any(&s.window);
        }
        out
    }

    /// The view readers see: both tiers' figures together.
    pub fn refresh(&mut self) {
        fn both<K: Ord + Copy>(
            a: &BTreeMap<K, SplitWindow>,
            b: &BTreeMap<K, SplitWindow>,
        ) -> BTreeMap<K, SplitWindow> {
            let mut out = a.clone();
            for (k, v) in b {
                match out.get_mut(k) {
                    Some(mine) => mine.merge(v),
                    None => {
                        out.insert(*k, v.clone());
                    }
                }
            }
            out
        }
        self.splits = both(&self.deep_splits, &self.kernel.splits);
        self.queue_splits = both(&self.deep_queue_splits, &self.kernel.queue_splits);
        let (d, k) = (&self.deep_counters, &self.kernel.counters);
        self.counters = SplitCounters {
            no_kick: d.no_kick.saturating_add(k.no_kick),
            no_signal: d.no_signal.saturating_add(k.no_signal),
            unordered: d.unordered.saturating_add(k.unordered),
            not_followed: d.not_followed.saturating_add(k.not_followed),
            polled: d.polled.saturating_add(k.polled),
        };
    }

    /// A VM request the kernel joined and streamed (sampled, or every one
    /// of a VM whose guest agent joins them): to the guest's side, or kept
    /// for export. Its figures are the kernel's already.
    pub fn on_joined(&mut self, ev: &VmSplitEvent, followed: bool) {
        if !followed {
            return;
        }
        let io = ev.io;
        if self.stitch.has_guest(io.vm) {
            self.stitch.on_host(HostIo {
                ev: io,
                signal_ns: ev.signal_ns,
                signal_wait_ns: 0,
            });
            return;
        }
        let mut span = IoSpan::host_only(&io, ev.signal_ns, 0);
        span.queue = self.queue_of(&io);
        self.stitch.tail(&span);
        if self.stitch.keeping_spans() {
            self.stitch.keep(span);
        }
    }

    /// A kernel entry's guest queue, its notifier named by the disk's
    /// device model; notifiers named by order or page counted from the
    /// disk's lowest (`bases`).
    fn kernel_queue(&self, k: &VmSplitKey, bases: &HashMap<(u32, u32), QueueBases>) -> Option<u32> {
        let (layout, limit) = self
            .vdisks
            .get(&k.vdisk)
            .copied()
            .unwrap_or((Layout::Virtio, None));
        let b = bases.get(&(k.vm, k.vdisk)).copied().unwrap_or_default();
        let q = match QueueIndex::of(k.queue, layout) {
            QueueIndex::Order(o) => QueueIndex::Order(o).rebased(b.order),
            QueueIndex::Page(_) if b.offsets && layout != Layout::Nvme => Some(0),
            QueueIndex::Page(_) if b.offsets => None,
            QueueIndex::Page(p) => QueueIndex::Page(p).rebased(b.page),
            other => other.rebased(0),
        };
        q.filter(|&q| limit.is_none_or(|n| q < n))
    }

    /// Settles requests from the oldest on, stopping at the first that must
    /// still wait: records arrive in completion order, so what follows it
    /// waits with it. Called per record: constant work in the steady state.
    fn settle(&mut self, all: bool) {
        while let Some((ev, _)) = self.pending.front() {
            // The first signal after the completion that still has room: a
            // push already taken by as many requests as it pushed belongs
            // to those (at depth one completion follows another while the
            // engine pushes an earlier one: the first push after a
            // completion is seldom its own).
            let (vm, done) = (ev.vm, ev.done_ns);
            let unseen = self.pushes_live.get(&vm).is_some_and(|&live| done < live);
            let sig = self
                .signals
                .get_mut(&vm)
                .filter(|_| !unseen)
                .and_then(|q| q.take_after(done));
            let waited = all || unseen || self.latest_ns >= done.saturating_add(self.hold_ns);
            if sig.is_none() && !waited {
                break;
            }
            let (ev, split) = self.pending.pop_front().expect("front exists");
            match sig {
                Some(sig) if split => self.record(&ev, sig),
                None if split => {
                    self.deep_counters.no_signal = self.deep_counters.no_signal.saturating_add(1);
                }
                _ => {}
            }
        }
        // Signals older than the oldest request still pending (less the
        // hold) are done with.
        let horizon = self
            .pending
            .front()
            .map_or(self.latest_ns, |(e, _)| e.done_ns)
            .saturating_sub(self.hold_ns);
        for q in self.signals.values_mut() {
            q.drop_before(horizon);
        }
    }

    fn record(&mut self, ev: &VmIoEvent, signal: Signal) {
        let sig = signal.ts_ns;
        let signal_wait_ns = signal.waited_since(ev.done_ns);
        let (kick, pick, start, done) = (ev.kick_ns, ev.pick_ns, ev.start_ns, ev.done_ns);
        if !(kick <= pick && pick <= start && start <= done && done <= sig) {
            self.deep_counters.unordered = self.deep_counters.unordered.saturating_add(1);
            return;
        }
        let key = SplitKey {
            vm: ev.vm,
            dev: Dev(ev.dev),
            op: Op::from_index(ev.op as usize).unwrap_or(Op::Other),
            vdisk: ev.vdisk,
        };
        let mut span = IoSpan::host_only(ev, sig, signal_wait_ns);
        self.deep_splits
            .entry(key)
            .or_insert_with(SplitWindow::host)
            .record(&span);
        span.queue = self.queue_of(ev);
        if let Some(q) = span.queue {
            self.deep_queue_splits
                .entry((key, q))
                .or_insert_with(SplitWindow::host)
                .record(&span);
        }
        if self.stitch.has_guest(ev.vm) {
            self.stitch.on_host(HostIo {
                ev: *ev,
                signal_ns: sig,
                signal_wait_ns,
            });
        } else {
            self.stitch.tail(&span);
            if self.stitch.keeping_spans() {
                self.stitch.keep(span);
            }
        }
    }

    /// The guest queue a request's kick came through, if its notifier says.
    fn queue_of(&mut self, ev: &VmIoEvent) -> Option<u32> {
        let (layout, limit) = self
            .vdisks
            .get(&ev.vdisk)
            .copied()
            .unwrap_or((Layout::Virtio, None));
        let index = QueueIndex::of(ev.queue, layout);
        let base = match index {
            QueueIndex::Order(o) => self.rebase(ev.vm, ev.vdisk, o),
            QueueIndex::Page(p) => {
                let b = self.kernel_bases.get(&(ev.vm, ev.vdisk)).copied();
                match b {
                    Some(b) if b.offsets => {
                        return (layout != Layout::Nvme).then_some(0);
                    }
                    Some(b) => b.page.min(p),
                    None => p,
                }
            }
            _ => 0,
        };
        index.rebased(base).filter(|&q| limit.is_none_or(|n| q < n))
    }

    /// The disk's first notifier as far as known, lowered to `order` if
    /// that is lower: the queues already recorded move up by as much.
    fn rebase(&mut self, vm: u32, vdisk: u32, order: u16) -> u16 {
        let base = *self.order_base.entry((vm, vdisk)).or_insert(order);
        if order >= base {
            return base;
        }
        let shift = u32::from(base.saturating_sub(order));
        self.deep_queue_splits = std::mem::take(&mut self.deep_queue_splits)
            .into_iter()
            .map(|((k, q), s)| {
                let mine = k.vm == vm && k.vdisk == vdisk;
                ((k, if mine { q.saturating_add(shift) } else { q }), s)
            })
            .collect();
        self.order_base.insert((vm, vdisk), order);
        order
    }
}

/// Per (VM, virtual disk): the lowest notifier order and page its kernel
/// entries name, and whether any names an offset within its page.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct QueueBases {
    order: u16,
    page: u16,
    offsets: bool,
}

/// The lowest queue index of each kind seen per (VM, virtual disk): the
/// kernel names queues by notify order or page, counted from there.
fn queue_bases<'a>(keys: impl Iterator<Item = &'a VmSplitKey>) -> HashMap<(u32, u32), QueueBases> {
    let mut out: HashMap<(u32, u32), QueueBases> = HashMap::new();
    let mut seen: HashMap<(u32, u32), (bool, bool)> = HashMap::new();
    for k in keys {
        let b = out.entry((k.vm, k.vdisk)).or_default();
        let (order_seen, page_seen) = seen.entry((k.vm, k.vdisk)).or_default();
        match QueueIndex::of(k.queue, Layout::Virtio) {
            QueueIndex::Order(o) => {
                b.order = if *order_seen { b.order.min(o) } else { o };
                *order_seen = true;
            }
            QueueIndex::Page(p) => {
                b.page = if *page_seen { b.page.min(p) } else { p };
                *page_seen = true;
            }
            QueueIndex::Known(_)
                if k.queue & !crate::abi::VQ_VALUE_MASK == crate::abi::VQ_BY_ADDR =>
            {
                b.offsets = true
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::EVENT_VM_IO;

    #[test]
    fn a_late_push_inside_the_full_span_is_taken() {
        let push = |ts_ns| Signal {
            ts_ns,
            covers: 1,
            ..Default::default()
        };
        let mut q = Signals::default();
        q.insert(push(10));
        q.insert(push(20));
        assert_eq!(q.take_after(5).map(|s| s.ts_ns), Some(10));
        assert_eq!(q.take_after(5).map(|s| s.ts_ns), Some(20));
        assert_eq!(q.take_after(5), None);
        q.insert(push(12));
        assert_eq!(q.take_after(8).map(|s| s.ts_ns), Some(12));
        q.insert(push(30));
        assert_eq!(q.take_after(6).map(|s| s.ts_ns), Some(30));
    }

    /// The span of full signals skips only what a walk from each request's
    /// completion would have found full: the same signals are taken, in
    /// any order of pushes (some late), completions and drops.
    #[test]
    fn skipping_the_full_span_takes_what_a_walk_would() {
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let (mut fast, mut walk) = (Signals::default(), VecDeque::<Signal>::new());
        let (mut push_ts, mut done_ts, mut taken) = (1_000u64, 0u64, 0usize);
        for _ in 0..20_000 {
            match next(10) {
                0..=3 => {
                    push_ts += next(40);
                    // Now and then a record from another CPU, a little late.
                    let ts = push_ts.saturating_sub(if next(4) == 0 { next(300) } else { 0 });
                    let sig = Signal {
                        ts_ns: ts,
                        covers: [0, 1, 1, 1, 2][next(5) as usize],
                        ..Default::default()
                    };
                    fast.insert(sig);
                    let at = walk
                        .iter()
                        .rposition(|s| s.ts_ns <= ts)
                        .map_or(0, |i| i + 1);
                    walk.insert(at, sig);
                }
                4..=8 => {
                    // Completions keep pace with the pushes, some out of order.
                    done_ts = (done_ts + next(32)).saturating_sub(if next(3) == 0 {
                        next(300)
                    } else {
                        0
                    });
                    let got = fast.take_after(done_ts);
                    let i = walk.partition_point(|s| s.ts_ns < done_ts);
                    let want = walk.range_mut(i..).find(|s| s.has_room()).map(|s| {
                        s.taken += 1;
                        *s
                    });
                    assert_eq!(got, want, "done at {done_ts}");
                    taken += usize::from(got.is_some());
                }
                _ => {
                    let horizon = done_ts.saturating_sub(500);
                    fast.drop_before(horizon);
                    while walk.front().is_some_and(|s| s.ts_ns < horizon) {
                        walk.pop_front();
                    }
                }
            }
        }
        assert_eq!(fast.q, walk);
        assert!(taken > 5_000, "{taken} taken");
    }

    fn io(vm: u32, kick: u64, pick: u64, start: u64, done: u64) -> VmIoEvent {
        VmIoEvent {
            kind: EVENT_VM_IO,
            dev: Dev::new(254, 0).0,
            kick_ns: kick,
            pick_ns: pick,
            start_ns: start,
            done_ns: done,
            vm,
            vdisk: 1,
            ..Default::default()
        }
    }

    fn split(c: &Correlator, vm: u32) -> &SplitWindow {
        c.deep_splits
            .get(&SplitKey {
                vm,
                dev: Dev::new(254, 0),
                op: Op::Read,
                vdisk: 1,
            })
            .expect("a split")
    }

    #[test]
    fn segments_tile_the_window() {
        let mut c = Correlator::new(1_000);
        c.on_io(io(1, 100, 130, 200, 900), true);
        c.on_signal(1, 950);
        let s = split(&c, 1);
        assert_eq!(
            (
                s.hypervisor.sum_ns,
                s.engine.sum_ns,
                s.device.sum_ns,
                s.window.sum_ns
            ),
            (30, 70 + 50, 700, 850)
        );
        assert_eq!(
            s.hypervisor.sum_ns + s.engine.sum_ns + s.device.sum_ns,
            s.window.sum_ns
        );
    }

    #[test]
    fn the_view_adds_the_kernels_windows_to_the_deep_tiers() {
        let mut c = Correlator::new(1_000);
        c.on_io(io(1, 100, 130, 200, 900), true);
        c.on_signal(1, 950);
        let mut joined = JoinedWindows::default();
        for (seg, ns) in [
            (vm_seg::HYPERVISOR, 40),
            (vm_seg::ENGINE, 60),
            (vm_seg::DEVICE, 500),
        ] {
            joined.segments[seg].record(ns);
        }
        joined.segments[vm_seg::WINDOW].record(600);
        joined.count = 1;
        let key = VmSplitKey {
            vm: 1,
            vdisk: 1,
            dev: Dev::new(254, 0).0,
            op: Op::Read as u16,
            queue: 0,
        };
        let unsplit = VmUnsplit {
            no_kick: 2,
            ..Default::default()
        };
        c.set_kernel(
            &BTreeMap::from([(key, joined)]),
            &BTreeMap::from([(VdiskKey { vm: 1, vdisk: 1 }, unsplit)]),
            |_| true,
        );
        let s = c.splits.values().next().expect("a split");
        assert_eq!(s.window.count, 2, "one window of each tier");
        assert_eq!(s.window.sum_ns, 850 + 600);
        assert_eq!(s.device.sum_ns, 700 + 500);
        assert_eq!(c.counters.no_kick, 2);
        // The kernel's figures are cumulative: read again, not added twice.
        c.set_kernel(
            &BTreeMap::from([(key, JoinedWindows::default())]),
            &BTreeMap::new(),
            |_| true,
        );
        assert_eq!(c.splits.values().next().expect("a split").window.count, 1);
        assert_eq!(c.counters.no_kick, 0);
    }

    fn push(c: &mut Correlator, vm: u32, ts_ns: u64, covers: u16) {
        c.on_signal_waits(
            vm,
            Signal {
                ts_ns,
                covers,
                ..Default::default()
            },
        );
    }

    #[test]
    fn each_used_ring_push_ends_one_request_in_completion_order() {
        let mut c = Correlator::new(10_000);
        // Three requests complete while the engine is still pushing: each
        // push is one request's, oldest first, not all the first push's.
        for done in [100, 110, 120] {
            c.on_io(io(1, 10, 20, 30, done), true);
        }
        for ts in [130, 140, 150] {
            push(&mut c, 1, ts, 1);
        }
        let s = split(&c, 1);
        assert_eq!(s.window.count, 3);
        // Windows kick (10) -> push: 120 + 130 + 140.
        assert_eq!(s.window.sum_ns, 120 + 130 + 140);
        assert_eq!(c.deep_counters.no_signal, 0);
        // A push of two completions (virtqueue_flush(vq, 2)) ends two.
        let mut c = Correlator::new(10_000);
        c.on_io(io(1, 10, 20, 30, 100), true);
        c.on_io(io(1, 10, 20, 30, 105), true);
        push(&mut c, 1, 130, 2);
        assert_eq!(split(&c, 1).window.sum_ns, 120 + 120);
    }

    #[test]
    fn requests_completed_before_the_push_probes_went_live_take_no_push() {
        // A VM found running: its requests are followed before its pushes
        // are; the pushes of those requests were never seen, and they must
        // not take the pushes of the requests after them.
        let mut c = Correlator::new(10_000);
        c.pushes_live_from(1, 105);
        c.on_io(io(1, 10, 20, 30, 100), true);
        c.on_io(io(1, 10, 20, 30, 110), true);
        push(&mut c, 1, 120, 1);
        c.finish();
        let s = split(&c, 1);
        assert_eq!((s.window.count, s.window.sum_ns), (1, 110));
        assert_eq!(c.deep_counters.no_signal, 1);
    }

    #[test]
    fn a_push_is_taken_by_the_request_it_was_for_even_when_not_split() {
        let mut c = Correlator::new(10_000);
        // A polled request (no kick of its own) completes first: the first
        // push is its own, not the split request's after it.
        let mut polled = io(1, 0, 0, 30, 100);
        polled.flags = RQ_F_POLLED;
        c.on_io(polled, true);
        c.on_io(io(1, 10, 20, 30, 110), true);
        push(&mut c, 1, 130, 1);
        push(&mut c, 1, 160, 1);
        let s = split(&c, 1);
        assert_eq!((s.window.count, s.window.sum_ns), (1, 150));
        assert_eq!(c.deep_counters.polled, 1);
        // An interrupt covers every completion before it, pushes or not.
        let mut c = Correlator::new(10_000);
        c.on_io(io(1, 10, 20, 30, 100), true);
        c.on_io(io(1, 10, 20, 30, 110), true);
        c.on_signal(1, 150);
        assert_eq!(split(&c, 1).window.sum_ns, 140 + 140);
        // A request with no push left waits, then is counted without one.
        let mut c = Correlator::new(1_000);
        c.on_io(io(1, 10, 20, 30, 100), true);
        c.on_io(io(1, 10, 20, 30, 110), true);
        push(&mut c, 1, 130, 1);
        c.on_io(io(2, 10, 20, 30, 5_000), true);
        assert_eq!(split(&c, 1).window.count, 1);
        assert_eq!(c.deep_counters.no_signal, 1);
    }

    #[test]
    fn the_first_signal_after_completion_counts_even_if_it_arrives_first() {
        let mut c = Correlator::new(1_000);
        // An earlier signal (for another request) and the right one, seen
        // before the request's own record (another CPU's ring position).
        c.on_signal(1, 500);
        c.on_signal(1, 960);
        c.on_io(io(1, 100, 130, 200, 900), true);
        assert_eq!(split(&c, 1).window.sum_ns, 860);
    }

    #[test]
    fn one_signal_ends_a_batch_of_completions() {
        let mut c = Correlator::new(1_000);
        c.on_io(io(1, 100, 130, 200, 900), true);
        c.on_io(io(1, 100, 130, 210, 920), true);
        c.on_signal(1, 1000);
        let s = split(&c, 1);
        assert_eq!(s.window.count, 2);
        assert_eq!(s.window.sum_ns, 900 + 900);
    }

    #[test]
    fn vms_do_not_share_signals() {
        let mut c = Correlator::new(1_000);
        c.on_io(io(1, 100, 130, 200, 900), true);
        c.on_signal(2, 950);
        assert!(c.deep_splits.is_empty());
        c.on_signal(1, 3_000);
        assert_eq!(split(&c, 1).window.sum_ns, 2_900);
        assert!(!c.deep_splits.contains_key(&SplitKey {
            vm: 2,
            dev: Dev::new(254, 0),
            op: Op::Read,
            vdisk: 1
        }));
    }

    #[test]
    fn a_polled_request_is_counted_never_split() {
        let mut c = Correlator::new(1_000);
        let mut polled = io(1, 0, 0, 200, 900);
        polled.flags = RQ_F_POLLED;
        c.on_io(polled, true);
        c.on_io(io(1, 100, 130, 400, 900), true);
        c.on_signal(1, 950);
        c.finish();
        assert_eq!((c.deep_counters.polled, c.deep_counters.no_kick), (1, 0));
        assert_eq!(split(&c, 1).window.count, 1);
    }

    #[test]
    fn each_queue_gets_its_own_split() {
        use crate::abi::{VQ_BY_ADDR, VQ_BY_ORDER};
        let key = |vdisk| SplitKey {
            vm: 1,
            dev: Dev::new(254, 0),
            op: Op::Read,
            vdisk,
        };
        let mut c = Correlator::new(1_000);
        c.set_vdisk(1, Layout::Virtio, Some(4));
        for (q, n) in [(0x004, 2), (0x00c, 1), (0x010, 1), (0, 1)] {
            for _ in 0..n {
                let mut e = io(1, 100, 130, 200, 900);
                e.queue = if q == 0 { 0 } else { VQ_BY_ADDR | q };
                c.on_io(e, true);
            }
        }
        c.on_signal(1, 950);
        let counts: Vec<_> = c
            .deep_queue_splits
            .iter()
            .map(|((_, q), s)| (*q, s.window.count))
            .collect();
        // Queue 4 is past the disk's four: no queue of it.
        assert_eq!(counts, [(1, 2), (3, 1)]);
        // Split without a queue: the disk's split requests less its queues'.
        let queued: u64 = c.deep_queue_splits.values().map(|s| s.window.count).sum();
        assert_eq!(split(&c, 1).window.count - queued, 2);
        assert_eq!(split(&c, 1).window.count, 5);

        // Named by order: counted from the lowest seen, rows moving up when
        // a lower one (the disk's queue 0) shows up late.
        let mut c = Correlator::new(1_000);
        for o in [5u16, 5, 4] {
            let mut e = io(1, 100, 130, 200, 900);
            e.vdisk = 2;
            e.queue = VQ_BY_ORDER | o;
            c.on_io(e, true);
        }
        c.on_signal(1, 950);
        let counts: Vec<_> = c
            .deep_queue_splits
            .iter()
            .map(|((k, q), s)| (k.vdisk, *q, s.window.count))
            .collect();
        assert_eq!(counts, [(2, 0, 1), (2, 1, 2)]);
        assert!(c.deep_queue_splits.keys().all(|(k, _)| *k == key(2)));
    }

    #[test]
    fn missing_kicks_signals_and_disorder_are_counted() {
        let mut c = Correlator::new(1_000);
        c.on_io(io(1, 0, 0, 200, 900), true);
        c.on_io(io(1, 100, 300, 200, 900), true); // pickup after the start
        c.on_io(io(3, 100, 130, 200, 900), true); // no signal, ever
        c.on_signal(1, 950);
        c.on_signal(1, 5_000); // stream time moves past the hold
        c.finish();
        c.on_io(io(1, 100, 130, 200, 900), false);
        assert_eq!(
            c.deep_counters,
            SplitCounters {
                no_kick: 1,
                no_signal: 1,
                unordered: 1,
                not_followed: 1,
                polled: 0,
            }
        );
        assert!(c.deep_splits.is_empty());
    }

    #[test]
    fn a_request_waits_for_its_signal_only_for_the_hold() {
        let mut c = Correlator::new(1_000);
        c.on_io(io(1, 100, 130, 200, 900), true);
        c.on_signal(2, 1_500); // other VM's traffic moves stream time, not past the hold
        assert_eq!(c.deep_counters.no_signal, 0);
        c.on_signal(2, 2_000);
        assert_eq!(
            c.deep_counters.no_signal, 1,
            "settled without a signal once the hold passed"
        );
        c.on_signal(1, 2_100);
        assert!(
            c.deep_splits.is_empty(),
            "a late signal does not revive a settled request"
        );
    }
}
