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
