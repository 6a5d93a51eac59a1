//! Knowing a VM was just exec'd: the kernel side writes each VM exec into
//! a ring buffer that wakes us, so an idle agent sleeps until one comes
//! instead of looking every few milliseconds (each look a wakeup on some
//! process's CPU).

use std::time::Duration;

use crate::probes::{host::BlockProbes, ring::AwaitedRing};

/// How often a run looks for a VM just exec'd when the kernel side cannot
/// wake it (the ring buffer not polled): one map read a look.
const EXEC_LOOK: Duration = Duration::from_millis(10);

pub(super) struct ExecWatch {
    ring: Option<AwaitedRing>,
    poll: tokio::time::Interval,
    /// The kernel side's generation when VMs were last named.
    seen_gen: Option<u32>,
}

impl ExecWatch {
    pub(super) fn new(probes: &mut BlockProbes) -> Self {
        let ring = probes
            .take_vm_execs()
            .map_err(anyhow::Error::from)
            .and_then(|r| Ok(r.awaitable()?))
            .map_err(|e| log::warn!("VM execs are looked for every {EXEC_LOOK:?}: {e:#}"))
            .ok();
        let mut poll = tokio::time::interval(EXEC_LOOK);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        Self {
            ring,
            poll,
            seen_gen: None,
        }
    }

    /// Resolves when a VM may have been exec'd since the last call.
    pub(super) async fn exec(&mut self) {
        let Some(ring) = self.ring.as_mut() else {
            self.poll.tick().await;
            return;
        };
        match ring.woken().await {
            Ok(()) => {
                let _ = ring.drain(|_| Ok::<(), std::convert::Infallible>(()));
            }
            Err(e) => {
                log::warn!("VM execs are looked for every {EXEC_LOOK:?}: {e}");
                self.ring = None;
            }
        }
    }

    /// Whether the kernel side's generation moved since the last look
    /// that said so (or cannot be read): VMs may be there to name.
    pub(super) fn moved(&mut self, probes: &BlockProbes) -> bool {
        let gen = probes.vm_gen().ok();
        let moved = gen.is_none() || gen != self.seen_gen;
        self.seen_gen = gen;
        moved
    }
}
