//! Test fakes, kept once (feature `testing`; core's own tests use them too):
//! memory without bytes behind it ([`FakeMemory`]), a registrar that counts
//! ([`CountingNic`]), the registration cache checked against a `BTreeMap`
//! after every operation ([`MrModel`]), and a reference driver for the
//! session engine that moves whole frames through `Vec`s ([`SimPeer`]).
//! Tests, benches, loom models and fuzz targets share them.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::vec::Vec;

use crate::session::{
    DataIn, HostOffer, Inbound, Instant, Outgoing, ProtocolError, SendError, Session, SessionConfig,
};
use crate::wire::{DataFlags, FrameKind, HEADER_LEN};
use crate::{Access, Error, MemKind, MrHandle, MrTable, RawMemory, Region, Registrar};

/// Addresses without memory behind them (core never dereferences one): a
/// bump allocator that never reuses an address and keeps what is live, so a
/// lease into memory already given back, or a double free, is caught. A
/// *skewed* one hands out addresses off the alignment asked (a broken source).
#[derive(Debug)]
pub struct FakeMemory {
    next: AtomicU64,
    skew: u64,
    live: Mutex<BTreeMap<u64, usize>>,
}

impl Default for FakeMemory {
    fn default() -> Self {
        FakeMemory::new()
    }
}

impl FakeMemory {
    /// Addresses from 1 MiB up.
    pub fn new() -> FakeMemory {
        FakeMemory::skewed(0)
    }

    /// Addresses `skew` bytes past the alignment asked.
    pub fn skewed(skew: u64) -> FakeMemory {
        FakeMemory {
            next: AtomicU64::new(1 << 20),
            skew,
            live: Mutex::new(BTreeMap::new()),
        }
    }

    fn live(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, usize>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `r` lies inside one live allocation.
    pub fn holds(&self, r: Region) -> bool {
        self.live()
            .range(..=r.addr)
            .next_back()
            .is_some_and(|(&a, &len)| r.addr + r.len as u64 <= a + len as u64)
    }

    /// Bytes allocated and not freed.
    pub fn live_bytes(&self) -> usize {
        self.live().values().sum()
    }
}

impl RawMemory for FakeMemory {
    fn alloc(&self, len: usize, align: usize) -> Result<Region, Error> {
        // Relaxed: a bump counter; nothing else is ordered by it.
        let base = self.next.fetch_add((len + align) as u64, Ordering::Relaxed);
        let addr = base.next_multiple_of(align as u64) + self.skew;
        self.live().insert(addr, len);
        Ok(Region {
            addr,
            len,
            kind: MemKind::Host,
        })
    }

    fn free(&self, region: Region) -> Result<(), Error> {
        match self.live().remove(&region.addr) {
            Some(len) if len == region.len => Ok(()),
            _ => Err(Error::Backend(
                "fake memory: a free of memory not allocated here (or twice)",
            )),
        }
    }

    fn host_visible(&self) -> bool {
        true
    }
}

/// A registrar that counts: registration ids (and keys) from 0, and how
/// many were made and are live.
#[derive(Debug, Default)]
pub struct CountingNic {
    ever: AtomicU32,
    live: AtomicU32,
}

impl CountingNic {
    /// One with nothing registered.
    pub const fn new() -> CountingNic {
        CountingNic {
            ever: AtomicU32::new(0),
            live: AtomicU32::new(0),
        }
    }

    /// Registrations made, ever.
    pub fn registered(&self) -> u32 {
        // Relaxed: read after the threads that count are done.
        self.ever.load(Ordering::Relaxed)
    }

    /// Registrations undone, ever.
    pub fn deregistered(&self) -> u32 {
        self.registered() - self.live()
    }

    /// Registrations live now.
    pub fn live(&self) -> u32 {
        // Relaxed: as above.
        self.live.load(Ordering::Relaxed)
    }
}

impl Registrar for CountingNic {
    fn register(&self, region: Region, access: Access) -> Result<MrHandle, Error> {
        region.validate()?;
        // Relaxed: counters, read once the threads are done.
        let id = self.ever.fetch_add(1, Ordering::Relaxed);
        self.live.fetch_add(1, Ordering::Relaxed);
        Ok(MrHandle {
            addr: region.addr,
            len: region.len,
            lkey: id,
            rkey: id,
            access,
            id,
        })
    }

    fn deregister(&self, _: MrHandle) -> Result<(), Error> {
        // Relaxed: as above.
        self.live.fetch_sub(1, Ordering::Relaxed);
        Ok(())
    }
}

/// [`MrTable`] run against a `BTreeMap` model (start address -> handle and
/// pins), compared after every operation, with every handle accounted for:
/// in the table, or handed back exactly once.
///
/// # Panics
/// Every method panics where the table and the model disagree.
#[derive(Debug)]
pub struct MrModel<const N: usize> {
    table: MrTable<N>,
    model: BTreeMap<u64, (MrHandle, u32)>,
    live: HashSet<u32>,
    next: u32,
    hits: u64,
    misses: u64,
}

impl<const N: usize> Default for MrModel<N> {
    fn default() -> Self {
        MrModel::new()
    }
}

impl<const N: usize> MrModel<N> {
    /// An empty table and model.
    pub fn new() -> Self {
        MrModel {
            table: MrTable::new(),
            model: BTreeMap::new(),
            live: HashSet::new(),
            next: 0,
            hits: 0,
            misses: 0,
        }
    }

    /// The table.
    pub fn table(&self) -> &MrTable<N> {
        &self.table
    }

    fn covering(&self, addr: u64, len: usize, access: Access) -> Option<(MrHandle, u32)> {
        self.model
            .range(..=addr)
            .next_back()
            .map(|(_, v)| *v)
            .filter(|(h, _)| h.covers(addr, len, access))
    }

    fn handed_back(&mut self, removed: &[MrHandle]) {
        for x in removed {
            assert!(self.live.remove(&x.id), "handle {} handed back twice", x.id);
        }
    }

    /// Inserts a fresh registration of `[addr, +len)`.
    pub fn insert(&mut self, addr: u64, len: usize, pinned: bool, access: Access) {
        self.next += 1;
        let id = self.next;
        let h = MrHandle {
            addr,
            len,
            lkey: id,
            rkey: id,
            access,
            id,
        };
        self.live.insert(id);
        let before = self.covering(addr, len, access);
        let mut removed = Vec::new();
        let r = self.table.insert(h, pinned, &mut |x| removed.push(x));
        self.handed_back(&removed);
        match (before, r) {
            (Some((e, pins)), got) => {
                assert_eq!(got, Ok(e), "a covered range is never registered twice");
                assert_eq!(removed.iter().map(|x| x.id).collect::<Vec<_>>(), [id]);
                self.model.insert(e.addr, (e, pins + u32::from(pinned)));
            }
            (None, Ok(got)) => {
                assert_eq!(got, h);
                for x in removed.iter() {
                    let gone = self.model.remove(&x.addr).map(|v| v.1);
                    assert_eq!(gone, Some(0), "only unpinned entries leave");
                }
                self.model.insert(addr, (h, u32::from(pinned)));
            }
            (None, Err(_)) => {
                assert_eq!(
                    removed.last().map(|x| x.id),
                    Some(id),
                    "a refused handle comes back"
                );
            }
        }
        self.check();
    }

    /// Looks up the entry covering `[addr, +len)`.
    pub fn lookup(&mut self, addr: u64, len: usize) {
        let want = self.covering(addr, len, Access::NONE).map(|v| v.0);
        let got = self.table.lookup_covering(addr, len, Access::NONE);
        assert_eq!(got, want);
        self.count(got.is_some());
    }

    /// Pins the entry covering `[addr, +len)`.
    pub fn pin(&mut self, addr: u64, len: usize) {
        let want = self.covering(addr, len, Access::NONE);
        let got = self.table.pin_covering(addr, len, Access::NONE);
        assert_eq!(got, want.map(|v| v.0));
        if let Some((h, pins)) = want {
            self.model.insert(h.addr, (h, pins + 1));
        }
        self.count(got.is_some());
    }

    fn count(&mut self, hit: bool) {
        if hit {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
        self.check();
    }

    /// Unpins entry number `pick` (modulo the table's length).
    pub fn unpin(&mut self, pick: usize) {
        if self.model.is_empty() {
            return;
        }
        let (&k, &(h, pins)) = self
            .model
            .iter()
            .nth(pick % self.model.len())
            .expect("in range");
        let r = self.table.unpin(&h);
        assert_eq!(
            r.is_ok(),
            pins > 0,
            "unpin of an entry with {pins} pins: {r:?}"
        );
        if pins > 0 {
            self.model.insert(k, (h, pins - 1));
        }
        self.check();
    }

    /// Invalidates `[addr, +len)`: every overlapping entry leaves, pinned or not.
    pub fn invalidate(&mut self, addr: u64, len: usize) {
        let mut removed = Vec::new();
        let n = self.table.invalidate(addr, len, &mut |x| removed.push(x));
        let doomed: Vec<u64> = self
            .model
            .values()
            .filter(|(e, _)| e.region(MemKind::Host).overlaps(addr, len))
            .map(|(e, _)| e.addr)
            .collect();
        assert_eq!(n, doomed.len());
        let mut handed: Vec<u32> = removed.iter().map(|x| x.id).collect();
        let mut want: Vec<u32> = doomed.iter().map(|a| self.model[a].0.id).collect();
        handed.sort_unstable();
        want.sort_unstable();
        assert_eq!(handed, want, "exactly the overlapping handles come back");
        for a in doomed {
            self.model.remove(&a);
        }
        self.handed_back(&removed);
        self.check();
    }

    /// The invariants after an operation: the same entries, sorted and
    /// disjoint, at most `N`, and the same counters.
    fn check(&self) {
        let got: Vec<_> = self.table.iter().collect();
        let want: Vec<_> = self.model.values().copied().collect();
        assert_eq!(got, want, "table and model disagree");
        assert!(got.len() <= N);
        for w in got.windows(2) {
            assert!(
                w[0].0.addr + w[0].0.len as u64 <= w[1].0.addr,
                "sorted and disjoint"
            );
        }
        assert_eq!(self.table.stats().hits, self.hits);
        assert_eq!(self.table.stats().misses, self.misses);
    }

    /// Empties the table: every handle ever registered was handed back once.
    pub fn finish(mut self) {
        let mut rest = Vec::new();
        self.table.clear(&mut |x| rest.push(x));
        self.handed_back(&rest);
        assert!(
            self.live.is_empty(),
            "leaked registrations: {:?}",
            self.live
        );
    }
}

/// One frame on a simulated wire: a header with its payload, or (ring wires
/// with immediate data) a headerless payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SimFrame {
    /// Header then payload, as one unit.
    Framed(Vec<u8>),
    /// A payload alone with the credits in the immediate data.
    Headerless {
        /// The message.
        payload: Vec<u8>,
        /// The immediate data.
        imm: u32,
    },
}

/// What happened to a [`SimPeer`] as frames arrived.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SimEvent {
    /// The peer's Hello came.
    Opened,
    /// A whole message: its sequence number and bytes.
    Message(u64, Vec<u8>),
    /// The peer waits for a grant of this many bytes.
    Wants(usize),
    /// The peer closed cleanly.
    Closed,
    /// The peer offered to share memory (this side answered as
    /// [`SimPeer::accept_offers`] says).
    HostOffered(HostOffer),
    /// The peer answered this side's offer.
    HostAnswered(bool),
}

/// A reference driver: one session, its send queue, and reassembly into
/// `Vec`s. It does what every real driver does, with no I/O: frames go out
/// as `SimFrame`s and come in the same way.
#[derive(Debug)]
pub struct SimPeer {
    /// The engine.
    pub session: Session,
    queue: VecDeque<(Outgoing, Vec<u8>)>,
    assembling: Vec<u8>,
    /// Ring wires: slots to report reposted on the next transmit.
    slots_used: u32,
    /// Ring wires: the application holds the buffers data frames arrive in
    /// (their slots are not reposted) while set, as one whose receive pool
    /// it has drained; [`give_back`](Self::give_back) returns them.
    pub holding: bool,
    /// Slots of data frames held so.
    held: u32,
    /// Ring wires: slots are reposted only by [`repost`](Self::repost), so
    /// frames go out before the slots of what came in are posted again (the
    /// verbs driver's order), rather than at the start of each transmit.
    pub repost_late: bool,
    /// How this side answers a same-host offer (default: decline).
    pub accept_offers: bool,
}

impl SimPeer {
    /// A peer with nothing exchanged yet.
    pub fn new(config: SessionConfig, token: u32, now: Instant) -> SimPeer {
        SimPeer {
            session: Session::new(config, token, now),
            queue: VecDeque::new(),
            assembling: Vec::new(),
            slots_used: 0,
            holding: false,
            held: 0,
            repost_late: false,
            accept_offers: false,
        }
    }

    /// The application gives back up to `n` held buffers: their slots are
    /// reposted at the next transmit. Returns how many.
    pub fn give_back(&mut self, n: u32) -> u32 {
        let n = n.min(self.held);
        self.held -= n;
        self.slots_used += n;
        n
    }

    /// Posts again the slots of what came in (and of buffers given back);
    /// returns how many.
    pub fn repost(&mut self) -> u32 {
        let n = core::mem::take(&mut self.slots_used);
        self.session.reposted(n);
        n
    }

    /// Buffers the application holds (see [`holding`](Self::holding)).
    pub fn held(&self) -> u32 {
        self.held
    }

    /// Starts a message (its bytes are kept until sent); returns its sequence number.
    pub fn send(&mut self, bytes: &[u8]) -> Result<u64, SendError> {
        let out = self.session.send(bytes.len())?;
        self.queue.push_back((out, bytes.to_vec()));
        Ok(out.seq())
    }

    /// Messages started and not yet all framed.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Everything that may go now: control frames first (a Close only once
    /// the messages before it are out), then data fragments while the
    /// peer's ring has room.
    pub fn transmit(&mut self) -> Vec<SimFrame> {
        // A ring driver reposts each slot once its frame is handled.
        if !self.repost_late {
            self.repost();
        }
        let mut out = Vec::new();
        loop {
            if let Some((msg, bytes)) = self.queue.front_mut() {
                if let Some(f) = self.session.next_frame(msg, Some(bytes), DataFlags::NONE) {
                    let payload = &bytes[f.offset..f.offset + f.len];
                    out.push(match f.header {
                        Some(h) => {
                            let mut v = h.to_vec();
                            v.extend_from_slice(payload);
                            SimFrame::Framed(v)
                        }
                        None => SimFrame::Headerless {
                            payload: payload.to_vec(),
                            imm: f.imm,
                        },
                    });
                    if f.last {
                        self.queue.pop_front();
                    }
                    continue;
                }
            }
            match self.session.poll_control() {
                Some(c) => out.push(SimFrame::Framed(c.header.to_vec())),
                None => break,
            }
        }
        out
    }

    /// A frame arrived whole (a frame wire: the mock link, verbs).
    pub fn receive(
        &mut self,
        now: Instant,
        frame: &SimFrame,
    ) -> Result<Vec<SimEvent>, ProtocolError> {
        let ring = self.session.config().ring != 0;
        let data = match frame {
            SimFrame::Headerless { .. } => true,
            SimFrame::Framed(bytes) => bytes.get(3) == Some(&(FrameKind::Data as u8)),
        };
        match (ring, data && self.holding) {
            (false, _) => {}
            (true, true) => self.held += 1,
            (true, false) => self.slots_used += 1,
        }
        let mut events = Vec::new();
        match frame {
            SimFrame::Headerless { payload, imm } => {
                let d = self.session.handle_headerless(now, payload.len(), *imm)?;
                events.push(SimEvent::Message(d.seq, payload.clone()));
            }
            SimFrame::Framed(bytes) => {
                let carried = bytes.len().saturating_sub(HEADER_LEN);
                match self.session.handle_header(now, bytes, Some(carried))? {
                    Inbound::Control => {}
                    Inbound::Opened => events.push(SimEvent::Opened),
                    Inbound::Want => {
                        let len = self.session.pending_grant().unwrap_or(0);
                        events.push(SimEvent::Wants(len));
                    }
                    Inbound::Closed => events.push(SimEvent::Closed),
                    Inbound::HostOffer(o) => {
                        self.session.answer_host(self.accept_offers);
                        events.push(SimEvent::HostOffered(o));
                    }
                    Inbound::HostAnswer { accepted } => {
                        events.push(SimEvent::HostAnswered(accepted))
                    }
                    Inbound::Data(d) => {
                        if let Some(m) = self.place(now, d, &bytes[HEADER_LEN..])? {
                            events.push(m);
                        }
                    }
                }
            }
        }
        Ok(events)
    }

    fn place(
        &mut self,
        now: Instant,
        d: DataIn,
        payload: &[u8],
    ) -> Result<Option<SimEvent>, ProtocolError> {
        if d.first {
            self.assembling = std::vec![0; d.msg_len];
        }
        self.assembling[d.offset..d.offset + d.len].copy_from_slice(payload);
        let done = self.session.handle_payload(now, Some(payload))?;
        Ok(done.map(|m| SimEvent::Message(m.seq, core::mem::take(&mut self.assembling))))
    }

    /// The application took a message of `len` bytes.
    pub fn consume(&mut self, len: usize) {
        self.session.consumed(len);
    }
}

/// Rounds [`exchange`] allows before it calls the two sessions livelocked.
pub const EXCHANGE_ROUNDS: usize = 100_000;

/// Moves every frame either side has to send to the other, until neither
/// has any; returns what each side saw (`a`'s events, `b`'s events). The
/// application takes every message at once (its bytes come back as
/// credit) and grants every want.
///
/// # Panics
/// If the two never fall quiet ([`EXCHANGE_ROUNDS`]): a livelock, such as
/// credit frames answering each other for ever.
pub fn exchange(
    a: &mut SimPeer,
    b: &mut SimPeer,
    now: Instant,
) -> Result<(Vec<SimEvent>, Vec<SimEvent>), ProtocolError> {
    let mut seen = (Vec::new(), Vec::new());
    for _ in 0..EXCHANGE_ROUNDS {
        let to_b = a.transmit();
        let to_a = b.transmit();
        let reposted = a.repost() + b.repost();
        if to_a.is_empty() && to_b.is_empty() && reposted == 0 {
            return Ok(seen);
        }
        for f in &to_b {
            deliver(b, now, f, &mut seen.1)?;
        }
        for f in &to_a {
            deliver(a, now, f, &mut seen.0)?;
        }
    }
    panic!("the sessions never fell quiet: a livelock");
}

fn deliver(
    p: &mut SimPeer,
    now: Instant,
    f: &SimFrame,
    seen: &mut Vec<SimEvent>,
) -> Result<(), ProtocolError> {
    for e in p.receive(now, f)? {
        match &e {
            SimEvent::Message(_, m) => p.consume(m.len()),
            SimEvent::Wants(_) => p.session.grant(now),
            _ => {}
        }
        seen.push(e);
    }
    Ok(())
}
