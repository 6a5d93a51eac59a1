//! What could not be measured, counted: the host windows left unsplit, and
//! each guest channel's losses on both ends.

use serde::{Deserialize, Serialize};

/// Requests whose window could not be split, counted.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitCounters {
    /// No kick was picked up before the request (e.g. QEMU's own I/O on the
    /// image, or a VM found after its notification).
    pub no_kick: u64,
    /// No signal followed the request's completion within the hold time.
    pub no_signal: u64,
    /// Timestamps out of order (e.g. a pickup after the request's start).
    pub unordered: u64,
    /// Requests of virtual disks whose engine path is not followed yet
    /// (see VDisk::split_supported).
    #[serde(default)]
    pub not_followed: u64,
    /// Requests the engine found by polling its queue (QEMU's iothreads
    /// poll before they sleep), with no kick of their own: their hypervisor
    /// time cannot be measured host-side, so they are not split.
    #[serde(default)]
    pub polled: u64,
}

/// One VM's guest channel, as the host saw it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChannelStats {
    /// Connections made to the channel's socket.
    pub connections: u64,
    pub records: u64,
    /// Frames missing from the sender's sequence (lost on the way).
    pub lost_frames: u64,
    /// The sender started over (guest agent restarted, guest rebooted).
    pub sender_restarts: u64,
    /// Frames sent again (after a reconnection) that had arrived already.
    #[serde(default)]
    pub resent_duplicates: u64,
    /// Connections dropped on a malformed stream.
    pub decode_errors: u64,
    /// The guest agent's own account (its latest STATS frame).
    pub sender: SenderStats,
    /// What the guest kernel let the guest agent see.
    pub guest_probes: Option<String>,
    pub guest_kernel: Option<String>,
}

/// The sender's own losses, cumulative since it started.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SenderStats {
    /// Records the guest's ring buffer had no room for.
    pub ring_lost: u64,
    /// Requests the guest's in-flight table had no room for.
    pub inflight_lost: u64,
    /// Records dropped because the channel stayed blocked (no host agent)
    /// and the send queue was full.
    pub dropped_records: u64,
    pub sent_records: u64,
    /// Records written but dropped for room before any host agent
    /// acknowledged them (a host agent that reads and never acknowledges).
    #[serde(default)]
    pub unconfirmed_records: u64,
    /// Requests whose completion no system call was seen handing back
    /// (their guest segment ends at the block layer's completion).
    #[serde(default)]
    pub unreaped: u64,
    /// Requests no I/O system call submitted (the guest kernel's own).
    #[serde(default)]
    pub no_syscall: u64,
}
