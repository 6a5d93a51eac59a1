//! One guest I/O, joined: the value every per-I/O output (events, traces,
//! tails) is made from.

use crate::{abi::VmIoEvent, model::Op};

/// One guest I/O, joined: the record per-I/O outputs (the event stream,
/// traces) are made from. Stamps are on the host's clock; the guest's are
/// moved there by the VM's clock offset at the time of the join (`None`
/// before the first offset is known: then they are the guest's own).
#[derive(Clone, Debug, PartialEq)]
pub struct IoSpan {
    pub vm: u32,
    pub vdisk: u32,
    /// The host disk the engine's request went to.
    pub dev: u32,
    pub op: Op,
    pub pos: u64,
    pub bytes: u32,
    /// Guest stamps: the application's call, the kick, the interrupt, the
    /// call that handed the completion back.
    pub begin_ns: u64,
    pub guest_kick_ns: u64,
    pub guest_irq_ns: u64,
    pub end_ns: u64,
    /// Host stamps: the kick seen, the engine's pickup, the host request's
    /// start, issue to the driver and completion, the engine's signal to
    /// the guest.
    pub kick_ns: u64,
    pub pick_ns: u64,
    pub start_ns: u64,
    pub issue_ns: u64,
    pub done_ns: u64,
    pub signal_ns: u64,
    /// The offset added to the guest's stamps (host = guest + offset).
    pub clock_offset_ns: Option<i64>,
    pub guest_ns: u64,
    pub hypervisor_ns: u64,
    pub engine_ns: u64,
    pub device_ns: u64,
    /// Guest-observed: end − begin = the four segments' sum.
    pub total_ns: u64,
    /// The guest's ends are the block layer's (no system call seen).
    pub app_ends_from_block_layer: bool,
    /// Whether the guest's side was joined; without it the I/O is the host
    /// window only (kick to signal) and the guest stamps are 0.
    pub has_guest: bool,
    /// The guest's queue for it (its block layer's hardware context),
    /// where the guest agent told; else the host's, by the notifier its
    /// kick came through.
    pub queue: Option<u32>,
    /// Of the hypervisor and engine segments, the time the thread that
    /// owned them waited for a CPU (runnable, not running).
    pub cpu_wait: CpuWait,
}

/// Time a segment's owning thread spent runnable but not running: the
/// engine thread between the kick and its pickup (hypervisor); the
/// submitting thread between the pickup and the host start, and the
/// signalling thread between the host completion and its signal (engine).
/// The guest's interrupt delivery after the signal (the vCPU's) is not
/// in it. Each within its segment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuWait {
    pub hypervisor_ns: u64,
    pub engine_ns: u64,
}

impl IoSpan {
    /// A VM request's host window alone, for VMs without a guest agent.
    /// `signal_wait_ns`: the signalling thread's CPU wait between the host
    /// completion and the signal.
    pub fn host_only(ev: &VmIoEvent, signal_ns: u64, signal_wait_ns: u64) -> Self {
        // The kernel's stamps come in this order; a missing one (0) must
        // give a short segment, never a wrapped one.
        let engine = ev
            .start_ns
            .saturating_sub(ev.pick_ns)
            .saturating_add(signal_ns.saturating_sub(ev.done_ns));
        Self {
            vm: ev.vm,
            vdisk: ev.vdisk,
            dev: ev.dev,
            op: Op::from_index(ev.op as usize).unwrap_or(Op::Other),
            pos: ev.pos,
            bytes: ev.bytes,
            begin_ns: 0,
            guest_kick_ns: 0,
            guest_irq_ns: 0,
            end_ns: 0,
            kick_ns: ev.kick_ns,
            pick_ns: ev.pick_ns,
            start_ns: ev.start_ns,
            // Stamps out of order (a clock read on another CPU) kept inside
            // the request's own start and end, whichever way they came.
            issue_ns: ev
                .issue_ns
                .max(ev.start_ns)
                .min(ev.done_ns.max(ev.start_ns)),
            done_ns: ev.done_ns,
            signal_ns,
            clock_offset_ns: None,
            guest_ns: 0,
            hypervisor_ns: ev.pick_ns.saturating_sub(ev.kick_ns),
            engine_ns: engine,
            device_ns: ev.done_ns.saturating_sub(ev.start_ns),
            total_ns: signal_ns.saturating_sub(ev.kick_ns),
            app_ends_from_block_layer: false,
            has_guest: false,
            queue: None,
            cpu_wait: CpuWait {
                hypervisor_ns: u64::from(ev.hv_wait_ns).min(ev.pick_ns.saturating_sub(ev.kick_ns)),
                engine_ns: u64::from(ev.eng_wait_ns)
                    .saturating_add(signal_wait_ns)
                    .min(engine),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fuzzing found it: a stamp missing (0) or out of order underflowed
    /// the host window's segments.
    #[test]
    fn a_missing_stamp_gives_a_short_segment_not_a_wrapped_one() {
        let ev = VmIoEvent {
            kick_ns: 5_000,
            pick_ns: 0,
            start_ns: 6_000,
            issue_ns: 6_100,
            done_ns: 9_000,
            ..Default::default()
        };
        let s = IoSpan::host_only(&ev, 0, 0);
        assert_eq!(s.hypervisor_ns, 0);
        assert_eq!(s.total_ns, 0);
        assert_eq!(s.engine_ns, 6_000);
        assert_eq!(s.device_ns, 3_000);
    }
}
