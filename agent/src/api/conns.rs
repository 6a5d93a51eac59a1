//! The API's connection slots. A full house evicts, it does not refuse:
//! when every slot is taken, a new connection takes the slot of the oldest
//! one that holds no request (its TLS handshake or its request headers not
//! yet done, or kept alive between requests) of the peer (a local user,
//! a remote address: `peer`) that holds the most such connections — a
//! flood evicts its own connections, not a slow client's of another peer.
//! A connection serving a request is kept while its reader reads: one
//! whose response has made no progress for `WRITE_STALL` is closed. The
//! deadline of a connection that holds no request tightens as the slots
//! fill, so a flood that never speaks costs its sender more connections a
//! second than it costs the agent slots.

use std::{
    collections::{BTreeSet, HashMap},
    sync::{
        atomic::{AtomicU64, Ordering::Relaxed},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use tokio::sync::oneshot;

pub use super::peer::Peer;

/// What a connection that holds no request is waiting for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waiting {
    /// Its TLS handshake.
    Handshake,
    /// Its first request's headers.
    Headers,
    /// Its next request, having answered one (HTTP keep-alive).
    KeptAlive,
}

impl Waiting {
    const ALL: [Waiting; 3] = [Waiting::Handshake, Waiting::Headers, Waiting::KeptAlive];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Handshake => "handshake",
            Self::Headers => "headers",
            Self::KeptAlive => "kept_alive",
        }
    }
}

/// Why the agent closed a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Closed {
    /// Its slot went to a new connection: every slot was taken.
    Evicted(Waiting),
    /// It held no request past its deadline.
    Deadline(Waiting),
    /// Its reader took nothing of a response for `WRITE_STALL`.
    SlowReader,
}

/// A response (a stream's frames among them) whose reader takes none of
/// it for this long is dropped with its connection: a client that stops
/// reading holds neither a slot nor the agent's buffers for long.
pub const WRITE_STALL: Duration = Duration::from_secs(10);

/// The deadline of a connection that holds no request while at most half
/// the slots are taken.
pub const IDLE_DEADLINE: Duration = Duration::from_secs(5);
/// The deadline with every slot taken: a real client's handshake and
/// request take milliseconds, even from across a continent.
pub const FULL_DEADLINE: Duration = Duration::from_secs(1);

/// How long a connection may hold no request with `open` of `cap` slots
/// taken: `IDLE_DEADLINE` up to half, then falling linearly to
/// `FULL_DEADLINE` at the cap (as proxies' overload managers scale their
/// idle timeouts).
pub fn deadline(open: usize, cap: usize) -> Duration {
    let fill = open as f64 / cap.max(1) as f64;
    if fill <= 0.5 {
        return IDLE_DEADLINE;
    }
    let pressure = ((fill - 0.5) / 0.5).min(1.0);
    IDLE_DEADLINE.mul_f64(1.0 - pressure) + FULL_DEADLINE.mul_f64(pressure)
}

/// Connections the agent closed, by reason and by what they waited for.
#[derive(Debug, Default)]
pub struct ClosedCounts {
    evicted: [AtomicU64; 3],
    deadline: [AtomicU64; 3],
    slow_readers: AtomicU64,
}

impl ClosedCounts {
    fn add(&self, c: Closed) {
        let (side, w) = match c {
            Closed::Evicted(w) => (&self.evicted, w),
            Closed::Deadline(w) => (&self.deadline, w),
            Closed::SlowReader => {
                self.slow_readers.fetch_add(1, Relaxed);
                return;
            }
        };
        side[w as usize].fetch_add(1, Relaxed);
    }

    /// Connections closed because their reader stopped reading.
    pub fn slow_readers(&self) -> u64 {
        self.slow_readers.load(Relaxed)
    }

    /// (reason, waiting for, count), every pair.
    pub fn each(&self) -> impl Iterator<Item = (&'static str, Waiting, u64)> + '_ {
        Waiting::ALL.into_iter().flat_map(move |w| {
            [
                ("evicted", w, self.evicted[w as usize].load(Relaxed)),
                ("deadline", w, self.deadline[w as usize].load(Relaxed)),
            ]
        })
    }

    /// Connections evicted, whatever they waited for.
    pub fn evicted(&self) -> u64 {
        self.evicted.iter().map(|a| a.load(Relaxed)).sum()
    }

    /// Connections closed past their deadline.
    pub fn timed_out(&self) -> u64 {
        self.deadline.iter().map(|a| a.load(Relaxed)).sum()
    }

    /// Connections closed past their deadline before their first request
    /// (a kept-alive one closed between requests is HTTP's usual course).
    pub fn timed_out_unheard(&self) -> u64 {
        [Waiting::Handshake, Waiting::Headers]
            .iter()
            .map(|&w| self.deadline[w as usize].load(Relaxed))
            .sum()
    }
}

struct Conn {
    peer: Peer,
    /// While it holds no request: since when, and for what.
    waiting: Option<(Instant, Waiting)>,
    /// Requests in flight (a response not yet sent whole).
    busy: u32,
    /// Since when its writes have waited for the reader (`Stall`).
    stall: Arc<Stall>,
    close: Option<oneshot::Sender<Closed>>,
}

#[derive(Default)]
struct House {
    conns: HashMap<u64, Conn>,
    /// The connections that hold no request, oldest first ...
    waiting: BTreeSet<(Instant, u64)>,
    /// ... the same per peer ...
    waiting_of: HashMap<Peer, BTreeSet<(Instant, u64)>>,
    /// ... and the peers by how many they hold.
    peers: BTreeSet<(usize, Peer)>,
    next_id: u64,
}

impl House {
    fn close(&mut self, id: u64, why: Closed, counts: &ClosedCounts) {
        if self.conns.contains_key(&id) {
            self.set_waiting(id, None);
        }
        if let Some(mut c) = self.conns.remove(&id) {
            counts.add(why);
            if let Some(tx) = c.close.take() {
                let _ = tx.send(why);
            }
        }
    }

    fn set_waiting(&mut self, id: u64, w: Option<(Instant, Waiting)>) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let (old, peer) = (c.waiting, c.peer);
        c.waiting = w;
        let mut of_peer = self.waiting_of.remove(&peer).unwrap_or_default();
        self.peers.remove(&(of_peer.len(), peer));
        if let Some((since, _)) = old {
            self.waiting.remove(&(since, id));
            of_peer.remove(&(since, id));
        }
        if let Some((since, _)) = w {
            self.waiting.insert((since, id));
            of_peer.insert((since, id));
        }
        if !of_peer.is_empty() {
            self.peers.insert((of_peer.len(), peer));
            self.waiting_of.insert(peer, of_peer);
        }
    }

    /// The oldest connection that holds no request, and what it waits for.
    fn oldest_waiting(&self) -> Option<(Instant, u64, Waiting)> {
        let &(since, id) = self.waiting.first()?;
        let w = self.conns.get(&id)?.waiting?.1;
        Some((since, id, w))
    }

    /// The oldest connection holding no request of the peer that holds
    /// the most such connections: a full house's eviction.
    fn to_evict(&self) -> Option<(u64, Waiting)> {
        let &(_, peer) = self.peers.last()?;
        let &(_, id) = self.waiting_of.get(&peer)?.first()?;
        Some((id, self.conns.get(&id)?.waiting?.1))
    }
}

/// Since when a connection's writes have waited for its reader: 0 while
/// they do not, else the wait's start in ms from the slots' epoch (plus
/// one). Set by its socket's writes (`Connection`), read by the sweep.
#[derive(Debug, Default)]
pub struct Stall(AtomicU64);

impl Stall {
    /// A write found the socket full: the wait starts, if it had not.
    pub fn waiting(&self, ms: u64) {
        let _ = self
            .0
            .compare_exchange(0, ms.saturating_add(1), Relaxed, Relaxed);
    }

    /// A write went through: no wait.
    pub fn flowing(&self) {
        self.0.store(0, Relaxed);
    }

    fn since_ms(&self) -> Option<u64> {
        self.0.load(Relaxed).checked_sub(1)
    }
}

/// The slots, shared by the accept loop, the connections and the sweep.
pub struct Slots {
    house: Mutex<House>,
    cap: usize,
    epoch: Instant,
    pub closed: ClosedCounts,
}

/// A new connection let in.
pub struct Admission {
    pub slot: Slot,
    /// Says why, when the agent closes it.
    pub closed: oneshot::Receiver<Closed>,
    /// Whether it took the slot of a connection evicted for it.
    pub evicted: bool,
}

/// One connection's slot: given back when dropped.
pub struct Slot {
    slots: Arc<Slots>,
    id: u64,
    /// Its writes' wait for the reader.
    pub stall: Arc<Stall>,
    pub peer: Peer,
}

impl std::fmt::Debug for Slots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slots")
            .field("open", &self.open())
            .field("cap", &self.cap)
            .finish_non_exhaustive()
    }
}

impl Slots {
    pub fn new(cap: usize) -> Arc<Self> {
        Arc::new(Self {
            house: Mutex::new(House::default()),
            cap,
            epoch: Instant::now(),
            closed: ClosedCounts::default(),
        })
    }

    fn house(&self) -> std::sync::MutexGuard<'_, House> {
        self.house.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.house().conns.len()
    }

    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Milliseconds since the slots began, for `Stall`.
    pub fn ms(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.epoch).as_millis()).unwrap_or(u64::MAX)
    }

    /// A slot for a new connection of `peer`, first waiting for `first`:
    /// when every slot is taken, evicting the oldest connection that holds
    /// no request of the peer holding the most; None when every one holds
    /// a request.
    pub fn admit(self: &Arc<Self>, first: Waiting, now: Instant, peer: Peer) -> Option<Admission> {
        let mut h = self.house();
        let evicted = h.conns.len() >= self.cap;
        if evicted {
            let (id, w) = h.to_evict()?;
            h.close(id, Closed::Evicted(w), &self.closed);
        }
        let id = h.next_id;
        h.next_id += 1;
        let (tx, rx) = oneshot::channel();
        let stall = Arc::new(Stall::default());
        h.conns.insert(
            id,
            Conn {
                peer,
                waiting: None,
                busy: 0,
                stall: stall.clone(),
                close: Some(tx),
            },
        );
        h.set_waiting(id, Some((now, first)));
        drop(h);
        let slot = Slot {
            slots: self.clone(),
            id,
            stall,
            peer,
        };
        Some(Admission {
            slot,
            closed: rx,
            evicted,
        })
    }

    /// Closes every connection that has held no request past the deadline
    /// the slots' fill sets now, and every one whose reader has taken
    /// nothing for `WRITE_STALL`; returns how many.
    pub fn sweep(&self, now: Instant) -> usize {
        let mut h = self.house();
        let limit = deadline(h.conns.len(), self.cap);
        let mut n = 0;
        while let Some((since, id, w)) = h.oldest_waiting() {
            if now.saturating_duration_since(since) < limit {
                break;
            }
            h.close(id, Closed::Deadline(w), &self.closed);
            n += 1;
        }
        let stalled_before = self.ms(now).saturating_sub(WRITE_STALL.as_millis() as u64);
        let stalled: Vec<u64> = h
            .conns
            .iter()
            .filter(|(_, c)| c.stall.since_ms().is_some_and(|s| s < stalled_before))
            .map(|(id, _)| *id)
            .collect();
        for id in stalled {
            h.close(id, Closed::SlowReader, &self.closed);
            n += 1;
        }
        n
    }
}

impl Slot {
    /// Its TLS handshake is done: its headers are due next, from now.
    pub fn handshaken(&self, now: Instant) {
        self.slots
            .house()
            .set_waiting(self.id, Some((now, Waiting::Headers)));
    }

    /// A request arrived: the connection is kept until it is answered.
    pub fn busy(&self) -> Busy {
        let mut h = self.slots.house();
        h.set_waiting(self.id, None);
        if let Some(c) = h.conns.get_mut(&self.id) {
            c.busy += 1;
        }
        Busy {
            slots: self.slots.clone(),
            id: self.id,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut h = self.slots.house();
        h.set_waiting(self.id, None);
        h.conns.remove(&self.id);
    }
}

/// A request in flight on a connection: when the last one's response has
/// been sent whole, the connection waits for its next request.
pub struct Busy {
    slots: Arc<Slots>,
    id: u64,
}

impl Drop for Busy {
    fn drop(&mut self) {
        let mut h = self.slots.house();
        let Some(c) = h.conns.get_mut(&self.id) else {
            return;
        };
        c.busy = c.busy.saturating_sub(1);
        if c.busy == 0 {
            h.set_waiting(self.id, Some((Instant::now(), Waiting::KeptAlive)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    const FLOOD: Peer = Peer::Uid(65534);

    fn admit(slots: &Arc<Slots>, w: Waiting, now: Instant) -> (Slot, oneshot::Receiver<Closed>) {
        let a = slots.admit(w, now, FLOOD).expect("a slot");
        (a.slot, a.closed)
    }

    #[test]
    fn the_deadline_tightens_past_half_full() {
        assert_eq!(deadline(0, 100), IDLE_DEADLINE);
        assert_eq!(deadline(50, 100), IDLE_DEADLINE);
        assert_eq!(deadline(100, 100), FULL_DEADLINE);
        assert_eq!(deadline(200, 100), FULL_DEADLINE);
        assert_eq!(deadline(75, 100), Duration::from_secs(3));
    }

    #[test]
    fn a_full_house_evicts_the_oldest_connection_without_a_request() {
        let t0 = Instant::now();
        let slots = Slots::new(3);
        let (a, mut a_rx) = admit(&slots, Waiting::Handshake, at(t0, 0));
        let (b, mut b_rx) = admit(&slots, Waiting::Headers, at(t0, 1));
        let (c, _c_rx) = admit(&slots, Waiting::Headers, at(t0, 2));
        // `a` sent a request: it is kept; `b` is then the oldest waiting.
        let _req = a.busy();
        let d = slots.admit(Waiting::Headers, at(t0, 3), FLOOD).unwrap();
        assert!(d.evicted);
        assert_eq!(b_rx.try_recv(), Ok(Closed::Evicted(Waiting::Headers)));
        assert!(
            a_rx.try_recv().is_err(),
            "a connection with a request evicted"
        );
        assert_eq!(slots.open(), 3);
        assert_eq!(slots.closed.evicted(), 1);
        drop((b, c));
        assert_eq!(slots.open(), 2);
    }

    #[test]
    fn a_house_of_requests_refuses_the_newcomer() {
        let t0 = Instant::now();
        let slots = Slots::new(2);
        let (a, _a_rx) = admit(&slots, Waiting::Headers, t0);
        let (b, _b_rx) = admit(&slots, Waiting::Headers, t0);
        let (_ra, _rb) = (a.busy(), b.busy());
        assert!(slots.admit(Waiting::Headers, t0, FLOOD).is_none());
        assert_eq!(slots.closed.evicted(), 0);
        assert_eq!(slots.open(), 2);
    }

    #[test]
    fn an_answered_connection_waits_again_and_can_be_evicted() {
        let t0 = Instant::now();
        let slots = Slots::new(2);
        let (a, mut a_rx) = admit(&slots, Waiting::Headers, t0);
        drop(a.busy()); // answered: kept alive, waiting from now
        let (_b, mut b_rx) = admit(&slots, Waiting::Headers, Instant::now());
        let (_c, _c_rx) = admit(&slots, Waiting::Headers, Instant::now());
        assert_eq!(a_rx.try_recv(), Ok(Closed::Evicted(Waiting::KeptAlive)));
        assert!(b_rx.try_recv().is_err());
    }

    #[test]
    fn the_sweep_closes_what_waited_past_the_deadline_of_the_fill() {
        let t0 = Instant::now();
        let slots = Slots::new(4);
        let (a, mut a_rx) = admit(&slots, Waiting::Handshake, t0);
        let (_b, mut b_rx) = admit(&slots, Waiting::Headers, at(t0, 2000));
        // Half full: 5 s each.
        assert_eq!(slots.sweep(at(t0, 4999)), 0);
        assert_eq!(slots.sweep(at(t0, 5000)), 1);
        assert_eq!(a_rx.try_recv(), Ok(Closed::Deadline(Waiting::Handshake)));
        drop(a);
        // Full: 1 s each, for those already waiting too.
        let mut more: Vec<_> = (0..3)
            .map(|_| admit(&slots, Waiting::Headers, at(t0, 5000)))
            .collect();
        assert_eq!(slots.sweep(at(t0, 5500)), 1, "the one waiting 3.5 s");
        assert_eq!(b_rx.try_recv(), Ok(Closed::Deadline(Waiting::Headers)));
        assert!(more.iter_mut().all(|(_, rx)| rx.try_recv().is_err()));
        assert_eq!(slots.closed.timed_out(), 2);
    }

    #[test]
    fn a_handshake_done_restarts_the_wait_for_headers() {
        let t0 = Instant::now();
        let slots = Slots::new(4);
        let (a, mut rx) = admit(&slots, Waiting::Handshake, t0);
        a.handshaken(at(t0, 4000));
        assert_eq!(slots.sweep(at(t0, 6000)), 0);
        assert_eq!(slots.sweep(at(t0, 9000)), 1);
        assert_eq!(rx.try_recv(), Ok(Closed::Deadline(Waiting::Headers)));
    }
}

#[cfg(test)]
mod fairness {
    use super::*;

    #[test]
    fn a_flood_of_one_peer_evicts_its_own_not_anothers_slow_client() {
        let t0 = Instant::now();
        let slots = Slots::new(4);
        let flood = Peer::Uid(65534);
        let mut held = Vec::new();
        let a = slots.admit(Waiting::Headers, t0, flood).unwrap();
        held.push(a);
        // The slow client, older than the rest of the flood.
        let slow = slots
            .admit(
                Waiting::Headers,
                t0 + Duration::from_millis(1),
                Peer::Uid(0),
            )
            .unwrap();
        for i in 2..200u64 {
            let a = slots
                .admit(Waiting::Headers, t0 + Duration::from_millis(i), flood)
                .unwrap();
            held.push(a);
        }
        let mut slow_closed = slow.closed;
        assert!(
            slow_closed.try_recv().is_err(),
            "the slow client was evicted"
        );
        assert_eq!(slots.open(), 4);
        assert_eq!(slots.closed.evicted(), 196);
    }

    #[test]
    fn a_reader_that_stops_reading_is_closed_after_the_stall() {
        let t0 = Instant::now();
        let slots = Slots::new(4);
        let a = slots.admit(Waiting::Headers, t0, Peer::Uid(1)).unwrap();
        let _busy = a.slot.busy();
        a.slot.stall.waiting(slots.ms(t0));
        assert_eq!(
            slots.sweep(t0 + WRITE_STALL - Duration::from_millis(200)),
            0
        );
        let mut rx = a.closed;
        assert_eq!(
            slots.sweep(t0 + WRITE_STALL + Duration::from_millis(200)),
            1
        );
        assert_eq!(rx.try_recv(), Ok(Closed::SlowReader));
        assert_eq!(slots.closed.slow_readers(), 1);
    }
}
