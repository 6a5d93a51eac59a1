//! A guest's channel, byte for byte as the guest chooses: frames decoded in
//! pieces of any size, and every record stitched — each with a host request
//! at the same place, so that whatever queue number it carries reaches the
//! per-queue rows. Nothing panics, no per-queue row exists for a queue the
//! host did not give the disk, and no record goes uncounted.
#![no_main]

use iospan::{
    abi::VmIoEvent,
    pipeline::{
        stitch::{HostIo, Stitcher},
        transport::{Frame, FrameReader},
    },
};
use libfuzzer_sys::fuzz_target;

const VM: u32 = 1;
const GUEST_DEV: u32 = 7;
const QUEUES: u32 = 4;

fuzz_target!(|data: &[u8]| {
    let Some((&step, stream)) = data.split_first() else {
        return;
    };
    let step = usize::from(step % 64) + 1;
    let mut reader = FrameReader::default();
    let mut st = Stitcher::new(1_000_000);
    st.map_disk(VM, GUEST_DEV, 0);
    st.set_queues(VM, 0, QUEUES);
    st.expect_guest(VM);
    let mut records = 0u64;
    for piece in stream.chunks(step) {
        reader.push(piece);
        loop {
            match reader.next_frame() {
                Ok(Some(Frame::Records(recs))) => {
                    for g in recs {
                        records += 1;
                        // The host's side is the kernel's: its stamps in
                        // order on one clock. Only the guest's are arbitrary.
                        let t = 1_000_000 * records;
                        let host = HostIo {
                            ev: VmIoEvent {
                                op: g.op,
                                vm: VM,
                                vdisk: 0,
                                pos: g.sector.wrapping_mul(512),
                                bytes: g.bytes,
                                kick_ns: t,
                                pick_ns: t + 1_000,
                                start_ns: t + 2_000,
                                issue_ns: t + 2_100,
                                done_ns: t + 50_000,
                                ..Default::default()
                            },
                            signal_ns: t + 51_000,
                            signal_wait_ns: 0,
                        };
                        st.on_guest(VM, g);
                        st.on_host(host);
                    }
                }
                Ok(Some(_)) => {}
                Ok(None) => break,
                // The agent drops the connection: what follows is a new one.
                Err(_) => {
                    reader = FrameReader::default();
                    break;
                }
            }
        }
    }
    st.finish();
    for ((_, q), _) in &st.queues {
        assert!(*q < QUEUES, "a per-queue row for the guest's queue {q}");
    }
    let joined: u64 = st.stitched.values().map(|s| s.window.count).sum();
    let c = &st.counters;
    let accounted = joined + c.unmatched_guest + c.guest_over_cap + c.unknown_disk + c.inconsistent;
    assert!(
        accounted >= records,
        "{records} records, {accounted} accounted: {c:?}"
    );
});
