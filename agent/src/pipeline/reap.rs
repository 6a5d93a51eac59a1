//! Inside the guest: each request's completion paired with the system call
//! that handed it back to the application.
//!
//! The guest-observed latency then runs from the submitting call's entry to
//! the reaping call's return — what a benchmark inside the guest times.
//!
//! The kernel side marks a thread (synchronous reads and writes) or a
//! process (io_getevents, io_uring_enter) as waiting once one of its
//! requests completes, and reports the next return of such a call. Records
//! come through one ring buffer in order, so a reap applies to every
//! request of that thread or process completed before it.

use std::collections::{HashMap, VecDeque};

use crate::abi::{
    GuestIoEvent, GuestReapEvent, GUEST_F_REAPED, GUEST_F_SYNC, GUEST_F_SYSCALL, GUEST_REAP_SYNC,
};

/// How long a completed request waits for its reaping call before it is
/// sent with the block layer's completion as its end.
pub const HOLD_NS: u64 = 1_000_000_000;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReapStats {
    /// Requests given their reaping call's return.
    pub reaped: u64,
    /// Requests submitted by a system call whose completion no reaping
    /// call returned within the hold (e.g. an io_uring completion queue
    /// polled from user space): they end at the block layer's completion.
    pub unreaped: u64,
    /// Requests no I/O call submitted (the kernel's own, writeback,
    /// io_uring workers): block layer stamps at both ends.
    pub no_syscall: u64,
}

#[derive(Default)]
pub struct Reaper {
    waiting: HashMap<u64, VecDeque<GuestIoEvent>>,
    pub stats: ReapStats,
}

fn waiter_key(sync: bool, id: u32) -> u64 {
    if sync {
        u64::from(id)
    } else {
        1 << 32 | u64::from(id)
    }
}

impl Reaper {
    /// A completed request: passed on at once unless a call submitted it.
    pub fn on_io(&mut self, ev: GuestIoEvent, out: &mut Vec<GuestIoEvent>) {
        if ev.flags & GUEST_F_SYSCALL == 0 || ev.tgid == 0 {
            self.stats.no_syscall = self.stats.no_syscall.saturating_add(1);
            out.push(ev);
            return;
        }
        let sync = ev.flags & GUEST_F_SYNC != 0;
        let key = waiter_key(sync, if sync { ev.tid } else { ev.tgid });
        self.waiting.entry(key).or_default().push_back(ev);
    }

    pub fn on_reap(&mut self, r: GuestReapEvent, out: &mut Vec<GuestIoEvent>) {
        let key = waiter_key(r.flags & GUEST_REAP_SYNC != 0, r.id);
        let Some(q) = self.waiting.get_mut(&key) else {
            return;
        };
        while let Some(mut ev) = q.pop_front() {
            if ev.done_ns > r.ts_ns {
                q.push_front(ev);
                break;
            }
            ev.reap_ns = r.ts_ns;
            ev.flags |= GUEST_F_REAPED;
            self.stats.reaped = self.stats.reaped.saturating_add(1);
            out.push(ev);
        }
        if q.is_empty() {
            self.waiting.remove(&key);
        }
    }

    /// Sends what waited longer than the hold at `now_ns` (guest clock).
    pub fn expire(&mut self, now_ns: u64, out: &mut Vec<GuestIoEvent>) {
        self.waiting.retain(|_, q| {
            while q
                .front()
                .is_some_and(|ev| ev.done_ns.saturating_add(HOLD_NS) <= now_ns)
            {
                if let Some(ev) = q.pop_front() {
                    self.stats.unreaped = self.stats.unreaped.saturating_add(1);
                    out.push(ev);
                }
            }
            !q.is_empty()
        });
    }

    /// Everything still waiting (the agent is stopping).
    pub fn flush(&mut self, out: &mut Vec<GuestIoEvent>) {
        self.expire(u64::MAX, out);
    }
}

/// The guest's monotonic clock: the clock of the kernel's stamps.
pub fn monotonic_ns() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::EVENT_GUEST_REAP;

    fn io(tgid: u32, tid: u32, sync: bool, done_ns: u64) -> GuestIoEvent {
        GuestIoEvent {
            flags: GUEST_F_SYSCALL | if sync { GUEST_F_SYNC } else { 0 },
            tgid,
            tid,
            sys_ns: done_ns - 100,
            done_ns,
            ..Default::default()
        }
    }

    fn reap(sync: bool, id: u32, ts_ns: u64) -> GuestReapEvent {
        GuestReapEvent {
            kind: EVENT_GUEST_REAP,
            flags: if sync { GUEST_REAP_SYNC } else { 0 },
            id,
            ts_ns,
            ..Default::default()
        }
    }

    #[test]
    fn an_asynchronous_reap_takes_every_earlier_completion_of_its_process() {
        let mut r = Reaper::default();
        let mut out = Vec::new();
        r.on_io(io(7, 8, false, 1000), &mut out);
        r.on_io(io(7, 9, false, 1100), &mut out);
        r.on_io(io(7, 8, false, 1300), &mut out);
        assert!(out.is_empty(), "held for their reap");
        r.on_reap(reap(false, 7, 1200), &mut out);
        assert_eq!(out.len(), 2);
        assert!(out
            .iter()
            .all(|e| e.reap_ns == 1200 && e.flags & GUEST_F_REAPED != 0));
        r.on_reap(reap(false, 7, 1400), &mut out);
        assert_eq!(out[2].reap_ns, 1400);
        assert_eq!(r.stats.reaped, 3);
    }

    #[test]
    fn a_synchronous_reap_is_its_own_threads() {
        let mut r = Reaper::default();
        let mut out = Vec::new();
        r.on_io(io(7, 8, true, 1000), &mut out);
        r.on_io(io(7, 9, true, 1000), &mut out);
        // Thread 9's return, and a process-wide (asynchronous) reap: not 8's.
        r.on_reap(reap(true, 9, 1050), &mut out);
        r.on_reap(reap(false, 7, 1060), &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].tid, out[0].reap_ns), (9, 1050));
        r.on_reap(reap(true, 8, 1070), &mut out);
        assert_eq!((out[1].tid, out[1].reap_ns), (8, 1070));
    }

    #[test]
    fn unreaped_and_unsubmitted_requests_are_sent_and_counted() {
        let mut r = Reaper::default();
        let mut out = Vec::new();
        r.on_io(
            GuestIoEvent {
                done_ns: 10,
                ..Default::default()
            },
            &mut out,
        );
        assert_eq!((out.len(), r.stats.no_syscall), (1, 1));
        r.on_io(io(7, 8, false, 1000), &mut out);
        r.expire(1000 + HOLD_NS - 1, &mut out);
        assert_eq!(out.len(), 1, "still within the hold");
        r.expire(1000 + HOLD_NS, &mut out);
        assert_eq!(out.len(), 2);
        assert_eq!(out[1].flags & GUEST_F_REAPED, 0);
        assert_eq!(r.stats.unreaped, 1);
        r.on_io(io(7, 8, false, 5000), &mut out);
        r.flush(&mut out);
        assert_eq!((out.len(), r.stats.unreaped), (3, 2));
    }
}
