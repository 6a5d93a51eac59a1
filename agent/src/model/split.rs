//! The segments of a set of requests, as the window they tile.

use super::{Hist, IoSpan};

/// What only the host's view has beside its segments.
#[derive(Clone, Debug, PartialEq)]
pub struct HostExtras {
    /// Pickup to the host's completion: the engine's submit side and the
    /// device, without the engine's completion side (what an engine that
    /// times a request up to its completion callback, before it signals
    /// the guest, counts: QEMU's NVMe and iothreads).
    pub pickup_to_done: Hist,
    /// Of the hypervisor and engine segments, the owning thread's wait
    /// for a CPU (`IoSpan::cpu_wait`).
    pub hypervisor_cpu_wait: Hist,
    pub engine_cpu_wait: Hist,
}

/// The segments of the requests of one key (VM, disk, op, and queue where
/// kept), tiling `window`. The host's view: hypervisor + engine + device =
/// the host window. The joined view (a guest agent's records with the
/// host's): guest + hypervisor + engine + device = the guest-observed total.
#[derive(Clone, Debug, PartialEq)]
pub struct SplitWindow {
    /// The joined view's guest segment; None in the host's view.
    pub guest: Option<Hist>,
    pub hypervisor: Hist,
    pub engine: Hist,
    pub device: Hist,
    pub window: Hist,
    /// The host view's own figures; None in the joined view.
    pub host: Option<HostExtras>,
    pub bytes: u64,
}

impl SplitWindow {
    fn segments(guest: Option<Hist>, host: Option<HostExtras>) -> Self {
        Self {
            guest,
            hypervisor: Hist::fine(),
            engine: Hist::fine(),
            device: Hist::fine(),
            window: Hist::fine(),
            host,
            bytes: 0,
        }
    }

    /// The host's view: the host window and its extras.
    pub fn host() -> Self {
        Self::segments(
            None,
            Some(HostExtras {
                pickup_to_done: Hist::fine(),
                hypervisor_cpu_wait: Hist::fine(),
                engine_cpu_wait: Hist::fine(),
            }),
        )
    }

    /// The joined view: the guest's segment and the guest-observed total.
    pub fn joined() -> Self {
        Self::segments(Some(Hist::fine()), None)
    }

    /// One request: its span's `total_ns` is the window this view tiles.
    pub fn record(&mut self, sp: &IoSpan) {
        self.bytes = self.bytes.saturating_add(u64::from(sp.bytes));
        if let Some(g) = &mut self.guest {
            g.record(sp.guest_ns);
        }
        self.hypervisor.record(sp.hypervisor_ns);
        self.engine.record(sp.engine_ns);
        self.device.record(sp.device_ns);
        self.window.record(sp.total_ns);
        if let Some(h) = &mut self.host {
            h.pickup_to_done
                .record(sp.done_ns.saturating_sub(sp.pick_ns));
            h.hypervisor_cpu_wait.record(sp.cpu_wait.hypervisor_ns);
            h.engine_cpu_wait.record(sp.cpu_wait.engine_ns);
        }
    }

    /// Another window of the same view added.
    pub fn merge(&mut self, o: &SplitWindow) {
        self.bytes = self.bytes.saturating_add(o.bytes);
        if let (Some(a), Some(b)) = (&mut self.guest, &o.guest) {
            a.merge_any(b);
        }
        self.hypervisor.merge_any(&o.hypervisor);
        self.engine.merge_any(&o.engine);
        self.device.merge_any(&o.device);
        self.window.merge_any(&o.window);
        if let (Some(a), Some(b)) = (&mut self.host, &o.host) {
            a.pickup_to_done.merge_any(&b.pickup_to_done);
            a.hypervisor_cpu_wait.merge_any(&b.hypervisor_cpu_wait);
            a.engine_cpu_wait.merge_any(&b.engine_cpu_wait);
        }
    }
}
