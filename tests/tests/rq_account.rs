//! Requeues, partial completions and slot reuse, driven through the exact C
//! the eBPF program runs (bpf/include/rq_account.h), with synthetic event
//! streams.

use std::collections::HashMap;

use agent_integration::{rq, RqCompletion, RqOutcome, RqSlot};
use iospan::abi::{RQ_F_DONE, RQ_F_NO_ISSUE, RQ_F_NO_START, RQ_F_PARTIAL, RQ_F_REQUEUED};

const K: u64 = (1 << 63) | 0x1234;
const UNKNOWN: u64 = u64::MAX;

fn done(rq: u64, kstart: u64, kissue: u64, now: u64, remaining: u32, nr: u32) -> RqCompletion {
    RqCompletion {
        rq,
        kstart_ns: kstart,
        kissue_ns: kissue,
        now_ns: now,
        remaining,
        nr_bytes: nr,
    }
}

fn flags(o: &RqOutcome) -> u8 {
    o.flags as u8
}

#[test]
fn issue_then_complete_splits_queue_and_service() {
    let mut s = RqSlot::default();
    rq::issue(&mut s, K, 150);
    let o = rq::complete(Some(&mut s), &done(K, 100, 0, 400, 4096, 4096)).expect("final");
    assert_eq!(
        (o.start_ns, o.issue_ns, o.bytes, o.requeues, flags(&o)),
        (100, 150, 4096, 0, 0)
    );
    assert_eq!(rq::segments(&o, 400), [300, 50, 250]);
    assert_eq!(
        s.flags, RQ_F_DONE,
        "the slot is marked done at the final completion"
    );
    // The same tag's next I/O takes it over from scratch.
    rq::issue(&mut s, K, 500);
    assert_eq!((s.flags, s.issue_ns, s.start_ns), (0, 500, 0));
}

#[test]
fn our_issue_stamp_wins_over_the_kernels_plug_cached_one() {
    let mut s = RqSlot::default();
    rq::issue(&mut s, K, 180);
    // blk-stat's io_start_time_ns inside a plug can equal the start time.
    let o = rq::complete(Some(&mut s), &done(K, 100, 100, 400, 4096, 4096)).unwrap();
    assert_eq!(o.issue_ns, 180);
    // Without our stamp (slot lost), the kernel's is used.
    let o = rq::complete(None, &done(K, 100, 120, 400, 4096, 4096)).unwrap();
    assert_eq!((o.issue_ns, flags(&o)), (120, 0));
}

#[test]
fn requeue_moves_the_failed_attempt_into_the_queue_segment() {
    let mut s = RqSlot::default();
    rq::issue(&mut s, K, 150);
    rq::requeue(&mut s, K);
    rq::issue(&mut s, K, 300);
    let o = rq::complete(Some(&mut s), &done(K, 100, 0, 500, 4096, 4096)).unwrap();
    assert_eq!((o.issue_ns, o.requeues, flags(&o)), (300, 1, RQ_F_REQUEUED));
    assert_eq!(rq::segments(&o, 500), [400, 200, 200]);
}

#[test]
fn twice_requeued_counts_both() {
    let mut s = RqSlot::default();
    for t in [150, 200, 260] {
        rq::issue(&mut s, K, t);
        if t != 260 {
            rq::requeue(&mut s, K);
        }
    }
    let o = rq::complete(Some(&mut s), &done(K, 100, 0, 300, 512, 512)).unwrap();
    assert_eq!((o.issue_ns, o.requeues), (260, 2));
}

#[test]
fn partial_completions_add_up_to_one_request() {
    let mut s = RqSlot::default();
    rq::issue(&mut s, K, 150);
    assert!(rq::complete(Some(&mut s), &done(K, 100, 0, 300, 12288, 4096)).is_none());
    assert!(rq::complete(Some(&mut s), &done(K, 100, 0, 350, 8192, 4096)).is_none());
    assert_eq!(
        (s.rq, s.flags & RQ_F_DONE),
        (K, 0),
        "still in flight after partial completions"
    );
    let o = rq::complete(Some(&mut s), &done(K, 100, 0, 400, 4096, 4096)).unwrap();
    assert_eq!((o.bytes, flags(&o)), (12288, RQ_F_PARTIAL));
    assert_eq!(rq::segments(&o, 400), [300, 50, 250]);
}

#[test]
fn short_read_then_requeue_as_the_loop_driver_does() {
    // lo_complete_rq: blk_update_request(rq, OK, short) then requeue.
    let mut s = RqSlot::default();
    rq::issue(&mut s, K, 150);
    assert!(rq::complete(Some(&mut s), &done(K, 100, 0, 200, 8192, 3072)).is_none());
    rq::requeue(&mut s, K);
    rq::issue(&mut s, K, 250);
    let o = rq::complete(Some(&mut s), &done(K, 100, 0, 400, 5120, 5120)).unwrap();
    assert_eq!((o.bytes, o.issue_ns, o.requeues), (8192, 250, 1));
    assert_eq!(flags(&o), RQ_F_PARTIAL | RQ_F_REQUEUED);
}

#[test]
fn start_stamp_fills_in_when_the_kernel_keeps_none() {
    let mut s = RqSlot::default();
    rq::start(&mut s, K, 90, (0, 0, 0, 0));
    rq::issue(&mut s, K, 150);
    let o = rq::complete(Some(&mut s), &done(K, 0, 0, 400, 4096, 4096)).unwrap();
    assert_eq!((o.start_ns, flags(&o)), (90, 0));
    assert_eq!(rq::segments(&o, 400), [310, 60, 250]);
}

#[test]
fn the_vm_and_vdisk_taken_at_start_survive_issue_requeue_and_partials() {
    let mut s = RqSlot::default();
    // Kernel keeps the start time (now = 0): only the identity is ours.
    rq::start_at(&mut s, K, 0, (4242, 3, 60, 70), 1 << 40);
    rq::issue(&mut s, K, 150);
    assert!(rq::complete(Some(&mut s), &done(K, 100, 0, 200, 8192, 4096)).is_none());
    rq::requeue(&mut s, K);
    rq::issue(&mut s, K, 250);
    let o = rq::complete(Some(&mut s), &done(K, 100, 0, 400, 4096, 4096)).unwrap();
    assert_eq!(
        (o.vm, o.vdisk, o.kick_ns, o.pick_ns, o.start_ns, o.issue_ns, o.bytes, o.pos),
        (4242, 3, 60, 70, 100, 250, 8192, 1 << 40)
    );
    // A new I/O on the same request without a start event has no submitter.
    rq::issue(&mut s, K, 500);
    let o = rq::complete(Some(&mut s), &done(K, 450, 0, 600, 4096, 4096)).unwrap();
    assert_eq!(
        (o.vm, o.vdisk, o.kick_ns, o.pick_ns, o.pos),
        (0, 0, 0, 0, 0)
    );
}

#[test]
fn no_start_time_at_all_is_flagged_and_total_falls_back_to_issue() {
    let mut s = RqSlot::default();
    rq::issue(&mut s, K, 150);
    let o = rq::complete(Some(&mut s), &done(K, 0, 0, 400, 4096, 4096)).unwrap();
    assert_eq!(flags(&o), RQ_F_NO_START);
    assert_eq!(rq::segments(&o, 400), [250, UNKNOWN, 250]);
}

#[test]
fn request_in_flight_before_tracing_has_no_issue_time() {
    let o = rq::complete(None, &done(K, 100, 0, 400, 4096, 4096)).unwrap();
    assert_eq!(flags(&o), RQ_F_NO_ISSUE);
    assert_eq!(rq::segments(&o, 400), [300, UNKNOWN, UNKNOWN]);
}

#[test]
fn a_leftover_slot_of_the_same_request_starts_afresh() {
    // The same preallocated request (same key) comes back for a new I/O
    // while the slot still holds the old one's state: no requeue was seen,
    // and no start (the host's requests are not followed from their
    // start), so nothing carries over.
    let mut s = RqSlot {
        rq: K,
        start_ns: 10,
        issue_ns: 20,
        done_bytes: 512,
        requeues: 3,
        flags: 0,
        vm: 0,
        vdisk: 2,
        kick_ns: 5,
        pick_ns: 6,
        pos: 0,
        dev: 254 << 20,
        op: 1,
        queue: 0x8003,
        hv_wait_ns: 7,
        eng_wait_ns: 8,
    };
    rq::issue(&mut s, K, 150);
    // Nor the entry a lost completion of it would be counted under, nor
    // the queue its kick came through.
    assert_eq!((s.dev, s.op, s.vm, s.vdisk, s.queue), (0, 0, 0, 0, 0));
    assert_eq!((s.hv_wait_ns, s.eng_wait_ns), (0, 0));
    let o = rq::complete(Some(&mut s), &done(K, 100, 0, 400, 4096, 4096)).unwrap();
    assert_eq!(
        (
            o.start_ns,
            o.issue_ns,
            o.bytes,
            o.requeues,
            flags(&o),
            o.vm,
            o.vdisk
        ),
        (100, 150, 4096, 0, 0, 0, 0)
    );
}

#[test]
fn a_completion_never_delivered_is_noticed_when_its_tag_comes_back() {
    let vm = (7, 2, 0, 0);
    let mut s = RqSlot::default();
    // Delivered: started, issued, completed.
    rq::start(&mut s, K, 10, vm);
    assert!(!rq::undelivered(&s, K), "a fresh slot holds nothing");
    rq::issue(&mut s, K, 20);
    rq::complete(Some(&mut s), &done(K, 0, 0, 30, 4096, 4096)).unwrap();
    assert!(!rq::undelivered(&s, K));
    // Started and issued, its completion never seen: the tag's next start
    // tells, with whose it was.
    rq::start(&mut s, K, 40, vm);
    assert!(!rq::undelivered(&s, K), "started, not yet issued");
    rq::issue(&mut s, K, 50);
    assert!(rq::undelivered(&s, K));
    assert_eq!(s.vm, 7);
    assert!(
        !rq::undelivered(&s, K + 1),
        "another key's slot says nothing"
    );
    // A requeued request is still the kernel's, not lost.
    rq::requeue(&mut s, K);
    assert!(!rq::undelivered(&s, K));
    rq::issue(&mut s, K, 60);
    assert!(rq::undelivered(&s, K));
    rq::start(&mut s, K, 70, (0, 0, 0, 0));
    assert!(!rq::undelivered(&s, K), "the new request took the slot");
}

#[test]
fn a_vm_request_dispatched_again_without_a_requeue_keeps_what_it_is() {
    // Every new VM request passes its start, so a second issue of a VM's
    // unfinished request is the same request dispatched again: its
    // identity and start stay, its issue moves.
    let mut s = RqSlot::default();
    rq::start_entry(&mut s, K, 10, (7, 2, 3, 4), 8192, (254 << 20, 1));
    rq::issue(&mut s, K, 20);
    rq::issue(&mut s, K, 35);
    assert_eq!(
        (s.dev, s.op),
        (254 << 20, 1),
        "the entry a loss would count under"
    );
    let o = rq::complete(Some(&mut s), &done(K, 0, 0, 50, 4096, 4096)).unwrap();
    assert_eq!(
        (o.vm, o.vdisk, o.kick_ns, o.pick_ns, o.pos, o.start_ns, o.issue_ns),
        (7, 2, 3, 4, 8192, 10, 35)
    );
    assert_eq!(rq::segments(&o, 50), [40, 25, 15]);
}

#[test]
fn another_requests_slot_is_neither_used_nor_disturbed() {
    let other = K + 1;
    let mut s = RqSlot::default();
    rq::issue(&mut s, other, 150);
    let o = rq::complete(Some(&mut s), &done(K, 100, 0, 400, 4096, 4096)).unwrap();
    assert_eq!(flags(&o), RQ_F_NO_ISSUE);
    assert_eq!((s.rq, s.issue_ns), (other, 150));
    rq::requeue(&mut s, K);
    assert_eq!(
        s.requeues, 0,
        "a requeue of another request leaves this slot alone"
    );
}

#[test]
fn a_done_slot_is_never_taken_for_the_request_it_held() {
    let mut s = RqSlot::default();
    rq::issue(&mut s, K, 150);
    rq::complete(Some(&mut s), &done(K, 100, 0, 400, 4096, 4096)).unwrap();
    // A second completion event for the same key (no new issue seen) must
    // not reuse the finished request's stamps.
    let o = rq::complete(Some(&mut s), &done(K, 450, 0, 600, 4096, 4096)).unwrap();
    assert_eq!(o.flags as u8, RQ_F_NO_ISSUE);
    rq::requeue(&mut s, K);
    assert_eq!(s.requeues, 0, "a requeue of a finished request is ignored");
}

#[test]
fn stamps_from_the_future_are_distrusted() {
    let mut s = RqSlot::default();
    rq::issue(&mut s, K, 900);
    let o = rq::complete(Some(&mut s), &done(K, 100, 0, 400, 4096, 4096)).unwrap();
    assert_eq!(flags(&o), RQ_F_NO_ISSUE);
    let o = rq::complete(None, &done(K, 950, 0, 400, 4096, 4096)).unwrap();
    assert_eq!(flags(&o), RQ_F_NO_ISSUE | RQ_F_NO_START);
}

/// Many requests on many queues, events interleaved in random order while
/// each request's own events stay in order, with partial completions,
/// requeues and tags reused for new I/Os: every I/O ends exactly once, with
/// its bytes, its last issue time, and segments that tile its lifetime.
#[test]
fn interleaved_streams_over_many_queues_and_reused_tags() {
    let mut rnd = XorShift(0x2545_F491_4F6C_DD1D);
    let mut slots: HashMap<u64, RqSlot> = HashMap::new();
    let mut now = 1_000u64;
    let mut ended = 0u32;
    for round in 0..200 {
        let mut ios = round_of_ios(&mut rnd, now);
        let mut remaining: Vec<usize> = (0..ios.len()).collect();
        while !remaining.is_empty() {
            let pick = rnd.below(remaining.len() as u64) as usize;
            let io = &mut ios[remaining[pick]];
            now += 1 + rnd.below(50);
            let slot = slots.entry(io.key).or_default();
            if play_next(slot, io, now, round) {
                ended += 1;
            }
            if io.next == io.script.len() {
                remaining.swap_remove(pick);
            }
        }
        assert!(
            slots.values().all(|s| s.flags & RQ_F_DONE != 0),
            "round {round}: every slot done"
        );
    }
    assert_eq!(ended, 200 * 4 * 8 * 16);
}

/// A request's events, in its own order.
#[derive(Clone, Debug)]
enum Ev {
    Issue,
    Requeue,
    Partial(u32),
    Final(u32),
}

/// One I/O of a round: its script, how far it has played, what it expects.
struct Io {
    key: u64,
    start: u64,
    size: u32,
    script: Vec<Ev>,
    next: usize,
    last_issue: u64,
    requeues: u16,
}

/// A seeded xorshift: the same interleaving every run.
struct XorShift(u64);

impl XorShift {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// 4 queues x 8 hardware contexts x 16 tags in flight at once, each with
/// a script of partial completions and requeues.
fn round_of_ios(rnd: &mut XorShift, now: u64) -> Vec<Io> {
    let mut ios = Vec::new();
    for q in 0..4u64 {
        for h in 0..8u64 {
            for t in 0..16u64 {
                let size = 4096 * (1 + rnd.below(8) as u32);
                ios.push(Io {
                    key: (1 << 63) | (q << 36) | (h << 21) | t,
                    start: now,
                    size,
                    script: script_of(rnd, size),
                    next: 0,
                    last_issue: 0,
                    requeues: 0,
                });
            }
        }
    }
    ios
}

fn script_of(rnd: &mut XorShift, size: u32) -> Vec<Ev> {
    let mut script = vec![Ev::Issue];
    let mut left = size;
    for _ in 0..rnd.below(3) {
        if rnd.below(2) == 0 && left > 512 {
            let piece = 512
                * (1 + rnd.below((left / 512 - 1).max(1) as u64) as u32)
                    .min(left / 512 - 1)
                    .max(1);
            script.push(Ev::Partial(piece));
            left -= piece;
        }
        if rnd.below(2) == 0 {
            script.push(Ev::Requeue);
            script.push(Ev::Issue);
        }
    }
    script.push(Ev::Final(left));
    script
}

/// The I/O's next event on its slot; true when it ended the I/O.
fn play_next(slot: &mut RqSlot, io: &mut Io, now: u64, round: u32) -> bool {
    let ev = io.script[io.next].clone();
    io.next += 1;
    let left_before: u32 = io.script[io.next - 1..]
        .iter()
        .map(|e| match e {
            Ev::Partial(n) | Ev::Final(n) => *n,
            _ => 0,
        })
        .sum();
    match ev {
        Ev::Issue => {
            rq::issue(slot, io.key, now);
            io.last_issue = now;
        }
        Ev::Requeue => {
            rq::requeue(slot, io.key);
            io.requeues += 1;
        }
        Ev::Partial(n) => {
            let c = done(io.key, io.start, 0, now, left_before, n);
            assert!(
                rq::complete(Some(slot), &c).is_none(),
                "round {round}: partial ended the I/O"
            );
        }
        Ev::Final(n) => {
            let c = done(io.key, io.start, 0, now, n, n);
            let o = rq::complete(Some(slot), &c).expect("final completion ends the I/O");
            assert_eq!(o.bytes, io.size, "round {round}: bytes of {:#x}", io.key);
            assert_eq!(o.issue_ns, io.last_issue);
            assert_eq!(o.requeues, io.requeues);
            let seg = rq::segments(&o, now);
            assert_eq!(seg[1] + seg[2], seg[0], "queue + service tile the total");
            return true;
        }
    }
    false
}
