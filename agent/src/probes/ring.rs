//! A kernel ring buffer of records, for its one reader: drained on a timer
//! (the guest agent), or awaited until the kernel side wakes it (a run).

use aya::maps::{MapData, RingBuf};
use tokio::io::{unix::AsyncFd, Interest};

/// A ring buffer taken from its eBPF object.
pub struct Ring(RingBuf<MapData>);

impl Ring {
    pub(crate) fn new(ring: RingBuf<MapData>) -> Self {
        Self(ring)
    }

    /// Each record now in the ring, oldest first, to `f` (its error stops
    /// the drain); whether there was any.
    pub fn drain<E>(&mut self, f: impl FnMut(&[u8]) -> Result<(), E>) -> Result<bool, E> {
        drain(&mut self.0, f)
    }

    /// The ring registered with the running tokio reactor, to be awaited.
    pub fn awaitable(self) -> std::io::Result<AwaitedRing> {
        // SAFETY: the ring buffer owns its fd and outlives the registration
        // (AsyncFd owns the ring buffer).
        let fd = unsafe { AsyncFd::register_with_interest(self.0, Interest::READABLE) }?;
        Ok(AwaitedRing(fd))
    }
}

/// A ring whose reader sleeps until the kernel side wakes it.
pub struct AwaitedRing(AsyncFd<RingBuf<MapData>>);

impl AwaitedRing {
    /// Resolves when the kernel side woke the reader. Readiness is cleared
    /// before the caller drains: a record written after it wakes again.
    pub async fn woken(&mut self) -> std::io::Result<()> {
        let mut ready = self.0.readable_mut().await?;
        ready.clear_ready();
        Ok(())
    }

    /// As `Ring::drain`.
    pub fn drain<E>(&mut self, f: impl FnMut(&[u8]) -> Result<(), E>) -> Result<bool, E> {
        drain(self.0.get_mut(), f)
    }
}

fn drain<E>(
    ring: &mut RingBuf<MapData>,
    mut f: impl FnMut(&[u8]) -> Result<(), E>,
) -> Result<bool, E> {
    let mut any = false;
    while let Some(item) = ring.next() {
        f(&item)?;
        any = true;
    }
    Ok(any)
}
