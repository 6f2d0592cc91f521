//! A lane whose peer is a test or a fuzzer: it writes whatever it likes into
//! the segment (the peer's counters, the ring's bytes), and the lane reads
//! it as it reads a real peer's. What shared memory from a hostile process
//! looks like, without the process.

use std::collections::VecDeque;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use zerohop_core::session::{HostRole, Instant, SessionConfig};
use zerohop_core::{Error, PeerId, Received};

use super::lane::{Lane, Outcome, Source};
use super::ring::{Consumer, Producer, RingMem};
use super::segment::{SegRing, Segment};
use super::ShmLease;
use crate::host::StdPool;

thread_local! {
    /// What a rig's peer does right after the lane's next copy out of its
    /// memory (see [`LaneRig::peer_ends_during_next_copy`]).
    static AFTER_COPY: std::cell::RefCell<Option<Box<dyn FnOnce()>>> =
        const { std::cell::RefCell::new(None) };
}

/// Whether this process's lanes, as senders, take the tails they are
/// offered and never write them (a test's broken peer; see
/// [`take_tails_and_hang`]).
pub(crate) static TAILS_HANG: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// From now on this process's lanes take the tails their peers offer and
/// never write them: a broken sender, for a test in another process.
pub fn take_tails_and_hang() {
    TAILS_HANG.store(true, Ordering::Relaxed);
}

/// Whether this process's lanes, as receivers, wait (up to two seconds)
/// for the sender to take a tail they offer before they read the head (see
/// [`offers_wait_to_be_taken`]).
pub(crate) static OFFERS_WAIT: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// While `on`, this process's lanes give the sender every chance to take a
/// tail they offer (on a loaded host a spinning sender may not run before
/// the head is read): for a test whose sender's take must happen.
pub fn offers_wait_to_be_taken(on: bool) {
    OFFERS_WAIT.store(on, Ordering::Relaxed);
}

/// Offers whose wait (see [`offers_wait_to_be_taken`]) ran out untaken.
pub(crate) static OFFER_WAITS_RUN_OUT: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

/// How many offers this process's lanes waited the whole two seconds for,
/// in vain, while [`offers_wait_to_be_taken`] was on: a sender that never
/// saw them (asleep and not rung).
pub fn offer_waits_run_out() -> usize {
    OFFER_WAITS_RUN_OUT.load(Ordering::Relaxed)
}

/// Called by a lane right after a copy out of its peer's memory, before it
/// looks at what the peer did meanwhile.
pub(crate) fn after_copy() {
    if let Some(f) = AFTER_COPY.with(|h| h.borrow_mut().take()) {
        f();
    }
}

/// The peer id the rig's lane reports its peer by.
pub const PEER: PeerId = PeerId(super::LANE_BIT);

/// A lane (the side that opened the segment) and a hand on its peer's side.
#[derive(Debug)]
pub struct LaneRig {
    lane: Option<Lane>,
    peer_tx: Producer<SegRing>,
    peer_rx: SegRing,
    /// The peer's reading end of the lane's ring.
    peer_in: Consumer<SegRing>,
    pool: Arc<StdPool>,
    arrivals: VecDeque<Result<Received<ShmLease>, Error>>,
    /// Messages `arrivals` holds at most (the wire's inbox, shared by its lanes).
    inbox: usize,
    /// The peer's end of the lane's link (gone once it hangs up).
    peer_link: Option<UnixStream>,
}

pub use super::cma::{
    help_split, state_of as claim_state, ticket_of as claim_ticket, word as claim_word,
    Desc as SingleCopyDesc, DESC_BYTES as SINGLE_COPY_DESC_BYTES, DONE as HELP_DONE,
    IDLE as HELP_IDLE, OFFERED as HELP_OFFERED, PLACED_TICKET, TAKEN as HELP_TAKEN,
};

/// A short record, as a lane writes it ahead of a whole message that the
/// engine framed headerless: sequence number `seq` (its low 16 bits) and
/// `len` bytes of payload following.
pub fn short_record(seq: u16, len: u32) -> [u8; zerohop_core::wire::HEADER_LEN] {
    zerohop_core::wire::ShortRecord {
        imm: u32::from(seq) << 16,
        len,
    }
    .encode()
}

impl LaneRig {
    /// Rings of `ring_bytes` (a power of two, at least 4 KiB), messages up
    /// to 64 KiB, a receive pool of `pool_bytes`.
    pub fn new(ring_bytes: usize, pool_bytes: usize) -> std::io::Result<LaneRig> {
        let pool =
            crate::private_pool(pool_bytes).map_err(|e| std::io::Error::other(e.to_string()))?;
        Self::with_pool(ring_bytes, pool)
    }

    /// As [`new`](Self::new), the pool one shared-memory file (a peer that
    /// maps it is sent large messages placed).
    pub fn new_shared(ring_bytes: usize, pool_bytes: usize) -> std::io::Result<LaneRig> {
        Self::new_shared_up_to(ring_bytes, pool_bytes, 64 << 10)
    }

    /// As [`new_shared`](Self::new_shared), messages up to `max_message`.
    pub fn new_shared_up_to(
        ring_bytes: usize,
        pool_bytes: usize,
        max_message: u32,
    ) -> std::io::Result<LaneRig> {
        let pool =
            crate::shared_pool(pool_bytes).map_err(|e| std::io::Error::other(e.to_string()))?;
        Self::with_pool_up_to(ring_bytes, pool, max_message)
    }

    fn with_pool(ring_bytes: usize, pool: Arc<StdPool>) -> std::io::Result<LaneRig> {
        Self::with_pool_up_to(ring_bytes, pool, 64 << 10)
    }

    fn with_pool_up_to(
        ring_bytes: usize,
        pool: Arc<StdPool>,
        max_message: u32,
    ) -> std::io::Result<LaneRig> {
        let seg = Arc::new(Segment::create(ring_bytes, super::cma::DEFAULT_MIN)?);
        let (link, peer_link) = UnixStream::pair()?;
        let config = SessionConfig {
            check_payload: true,
            takes_headerless: true,
            sends_headerless: true,
            host: HostRole::None,
            ..SessionConfig::stream(max_message)
        };
        let lane = Lane::new(
            "127.0.0.1:1".parse().expect("an address"),
            Arc::clone(&seg),
            false,
            link,
            config,
            7,
            Instant::from_micros(0),
        )
        .map_within(pool.config().budget.saturating_mul(2))
        .start();
        Ok(LaneRig {
            lane: Some(lane),
            peer_tx: Producer::new(seg.ring(0)),
            peer_rx: seg.ring(1),
            peer_in: Consumer::new(seg.ring(1)),
            pool,
            arrivals: VecDeque::new(),
            inbox: 64,
            peer_link: Some(peer_link),
        })
    }

    /// Writes `bytes` into the peer's ring as a well-behaved producer would
    /// (what fits); returns how many went.
    pub fn peer_write(&mut self, bytes: &[u8]) -> usize {
        self.peer_tx.write(&[bytes]).map_or(0, |m| m.n)
    }

    /// Sets the peer's write counter to anything.
    pub fn poke_head(&self, v: u64) {
        self.peer_tx_ring()
            .ctl()
            .head_word()
            .store(v, Ordering::Release);
    }

    /// Sets the peer's read counter (of the lane's own ring) to anything.
    pub fn poke_tail(&self, v: u64) {
        self.peer_rx.ctl().tail_word().store(v, Ordering::Release);
    }

    /// Writes `bytes` into the peer's ring's data at `at` (wrapped), past any counter.
    pub fn poke_data(&self, at: usize, bytes: &[u8]) {
        let r = self.peer_tx_ring();
        let cap = r.cap();
        for (i, b) in bytes.iter().enumerate() {
            r.copy_in((at + i) & (cap - 1), std::slice::from_ref(b));
        }
    }

    fn peer_tx_ring(&self) -> &SegRing {
        self.peer_tx.mem()
    }

    /// Reads stop once `n` messages wait to be taken (64 unless set): the
    /// wire's inbox, which other lanes may have filled.
    pub fn set_inbox(&mut self, n: usize) {
        self.inbox = n;
    }

    /// Whether a reader of many lanes would skip this one now (see `Lane::quiet`).
    pub fn quiet(&self) -> bool {
        self.lane.as_ref().is_some_and(|l| l.quiet())
    }

    /// The lane's look before the wire sleeps: `true`, do not sleep (see
    /// `Lane::prepare_sleep`).
    pub fn prepare_sleep(&mut self) -> bool {
        self.lane.as_mut().is_some_and(|l| l.prepare_sleep(true))
    }

    /// As [`prepare_sleep`](Self::prepare_sleep), for a sleeper that will
    /// not read (a thread waiting to send, connect or close).
    pub fn prepare_sleep_not_reading(&mut self) -> bool {
        self.lane.as_mut().is_some_and(|l| l.prepare_sleep(false))
    }

    /// The lane reads what is there. `Err`: the lane broke (typed); it
    /// takes nothing more.
    pub fn read(&mut self) -> Result<(), Error> {
        self.read_at(1)
    }

    /// The side pass of the wire at `micros` on the lane's clock (which
    /// starts at 0): a lane whose timer is due reads what waits in its ring
    /// first, then what the peer was heard to send since the last pass,
    /// then the idle timers. `Err`: the peer stalled or broke the ring
    /// (typed); the lane is gone.
    pub fn tend_at(&mut self, micros: u64) -> Result<(), Error> {
        let now = Instant::from_micros(micros);
        if self.lane.as_ref().is_some_and(|l| l.due_unread(now)) {
            self.read_at(micros)?;
        }
        let Some(lane) = self.lane.as_mut() else {
            return Err(Error::Closed);
        };
        lane.tend(now, false).map_err(|error| {
            self.lane = None;
            Error::Protocol { peer: PEER, error }
        })
    }

    /// [`read`](Self::read), told the time is `micros` (reads between side
    /// passes are told the time of the last one).
    pub fn read_at(&mut self, micros: u64) -> Result<(), Error> {
        let Some(lane) = self.lane.as_mut() else {
            return Err(Error::Closed);
        };
        match lane.read(
            PEER,
            Instant::from_micros(micros),
            &self.pool,
            &mut self.arrivals,
            self.inbox,
        ) {
            Outcome::Bad(e) => {
                self.lane = None; // as the transport drops it
                Err(e)
            }
            _ => lane
                .flush(PEER)
                .map(|_| ())
                .inspect_err(|_| self.lane = None),
        }
    }

    /// The lane sends a message of `len` bytes (its ring's room reckoned from
    /// the peer's read counter as last read, read again when short).
    pub fn send(&mut self, len: usize) -> Result<(), Error> {
        self.send_slice(&vec![0x42u8; len])
    }

    /// The lane sends `bytes` from the caller's slice (as `send`).
    pub fn send_slice(&mut self, bytes: &[u8]) -> Result<(), Error> {
        match self.send_source(Source::Slice(bytes)) {
            Err(Error::WouldBlock) => Ok(()),
            r => r,
        }
    }

    /// The lane sends `payload`; a failure that ends the lane (not a full
    /// lane, a message too large or a closed session) drops it, as the
    /// wire drops a lane whose send failed.
    fn send_source(&mut self, payload: Source<'_>) -> Result<(), Error> {
        let Some(lane) = self.lane.as_mut() else {
            return Err(Error::Closed);
        };
        let Err(r) = lane.send(PEER, payload, false, 1 << 20) else {
            return Ok(());
        };
        if !matches!(
            r.error,
            Error::WouldBlock | Error::TooLarge { .. } | Error::Closed
        ) {
            self.lane = None;
        }
        Err(r.error)
    }

    /// The lane sends a buffer of `len` bytes leased from the pool (from
    /// 32 KiB up by a single copy: the lease stays out until the peer says
    /// it has the bytes, [`peer_copied`](Self::peer_copied)).
    pub fn send_lease(&mut self, len: usize) -> Result<(), Error> {
        if self.lane.is_none() {
            return Err(Error::Closed);
        }
        let lease = zerohop_core::Lease::take(Arc::clone(&self.pool), len)?;
        self.send_source(Source::Lease(lease))
    }

    /// The lane sends `bytes` in a buffer leased from the pool (as
    /// [`send_lease`](Self::send_lease)).
    pub fn send_lease_of(&mut self, bytes: &[u8]) -> Result<(), Error> {
        if self.lane.is_none() {
            return Err(Error::Closed);
        }
        let mut lease = zerohop_core::Lease::take(Arc::clone(&self.pool), bytes.len())?;
        zerohop_backends::host_bytes_mut(&mut lease).copy_from_slice(bytes);
        self.send_source(Source::Lease(lease))
    }

    /// Leases `len` bytes from the lane's pool, fills them with `byte` and
    /// gives them back, as the application's next message does: the
    /// buffer's address (a buffer just given back comes first).
    pub fn scribble(&self, len: usize, byte: u8) -> Result<u64, Error> {
        let mut lease = zerohop_core::Lease::take(Arc::clone(&self.pool), len)?;
        let bytes = zerohop_backends::host_bytes_mut(&mut lease);
        bytes.fill(byte);
        Ok(bytes.as_ptr() as u64)
    }

    /// The inode of the pool's shared-memory file (`None`: a private pool).
    pub fn pool_file(&self) -> Option<u64> {
        let l = zerohop_core::Lease::take(Arc::clone(&self.pool), 1).ok()?;
        zerohop_backends::shared_place(&l).map(|p| p.ino)
    }

    /// The peer says it maps the lane's pool file `ino` (then large
    /// messages from it go placed).
    pub fn peer_maps(&self, ino: u64) {
        self.peer_rx.ctl().maps_file().store(ino, Ordering::Release);
    }

    /// The peer says it has copied the lane's placed messages up to `ticket`.
    pub fn peer_placed_done(&self, ticket: u64) {
        self.peer_rx
            .ctl()
            .placed_done()
            .store(ticket, Ordering::Release);
    }

    /// What the lane itself told its peer (its own ring's words, as the
    /// consumer of the peer's ring): the pool file it maps, and the last
    /// placed message it copied.
    pub fn told_peer(&self) -> (u64, u64) {
        let ctl = self.peer_tx_ring().ctl();
        (
            ctl.maps_file().load(Ordering::Acquire),
            ctl.placed_done().load(Ordering::Acquire),
        )
    }

    /// The peer says it dropped the lane uncleanly (its buffers went back
    /// to its pools).
    pub fn peer_ended(&self) {
        self.peer_tx_ring().ctl().end();
    }

    /// The peer ends its ring right after the lane's next copy out of its
    /// memory, before the lane looks at the word: a drop that races the
    /// copy, in the order that tells a look after the copy from one before.
    pub fn peer_ends_during_next_copy(&self) {
        let ring = self.peer_tx_ring().clone();
        AFTER_COPY.with(|h| *h.borrow_mut() = Some(Box::new(move || ring.ctl().end())));
    }

    /// Right after the lane's next copy out of its memory (the head of a
    /// long claimed message), the peer acts on the lane's offer of the
    /// tail as a sender does: takes it, writes `tail` there by
    /// `process_vm_writev` and says DONE; or, given `word`, stores that
    /// instead of all this (a peer that breaks the help word).
    pub fn peer_helps_during_next_copy(&self, tail: Vec<u8>, word: Option<u64>) {
        use super::cma;
        let ring = self.peer_tx_ring().clone();
        let help = move || {
            let h = ring.ctl().help();
            if let Some(w) = word {
                h.word.store(w, Ordering::Release);
                return;
            }
            let offer = h.word.load(Ordering::Acquire);
            if cma::state_of(offer) != cma::OFFERED {
                return; // that copy was not a head with its tail offered
            }
            let t = cma::ticket_of(offer);
            h.word.store(cma::word(t, cma::TAKEN), Ordering::Release);
            let dst = h.dst.load(Ordering::Relaxed);
            // SAFETY: `tail` lives and is unchanged for the call.
            let wrote =
                unsafe { cma::write(std::process::id() as i32, dst, tail.as_ptr(), tail.len()) };
            let state = if wrote { cma::DONE } else { cma::IDLE };
            h.word.store(cma::word(t, state), Ordering::Release);
        };
        AFTER_COPY.with(|h| *h.borrow_mut() = Some(Box::new(help)));
    }

    /// The help word of the messages the peer sends (the lane offers there).
    pub fn peer_help_word(&self) -> u64 {
        self.peer_tx_ring()
            .ctl()
            .help()
            .word
            .load(Ordering::Acquire)
    }

    /// The peer offers the lane the tail of the lane's claimed message
    /// `ticket`, to be written at `dst` (in this process), as a receiver
    /// does before reading the head.
    pub fn peer_offers_tail(&self, ticket: u64, dst: u64) {
        let h = self.peer_rx.ctl().help();
        h.dst.store(dst, Ordering::Relaxed);
        h.word.store(
            super::cma::word(ticket, super::cma::OFFERED),
            Ordering::Release,
        );
    }

    /// The help word of the lane's own claimed messages.
    pub fn help_word(&self) -> u64 {
        self.peer_rx.ctl().help().word.load(Ordering::Acquire)
    }

    /// The lane and its peer close cleanly: the lane's Close goes (the
    /// peer's is its to write); `Ok` once the lane has written it.
    pub fn close(&mut self) -> Result<(), Error> {
        let Some(lane) = self.lane.as_mut() else {
            return Err(Error::Closed);
        };
        lane.session.close();
        lane.control();
        lane.flush(PEER).map(|_| ())
    }

    /// Whether the lane's session is over on both sides with nothing left
    /// to write (a transport drops it then, cleanly).
    pub fn finished(&self) -> bool {
        self.lane.as_ref().is_some_and(Lane::finished)
    }

    /// Whether the lane has said it ended uncleanly (in its own ring's words).
    pub fn lane_ended(&self) -> bool {
        !self.peer_rx.ctl().copied_intact()
    }

    /// The lane's single-copy counts.
    pub fn single_copies(&self) -> super::SingleCopies {
        self.lane
            .as_ref()
            .map(Lane::single_copies)
            .unwrap_or_default()
    }

    /// The peer says it has copied the lane's single-copy message `ticket`
    /// (the first is 1), as a peer does after its `process_vm_readv`.
    pub fn peer_copied(&self, ticket: u64) {
        let done = super::cma::word(ticket, super::cma::OPEN);
        self.peer_rx.ctl().claim().store(done, Ordering::Release);
    }

    /// The peer takes the lane's single-copy message `ticket` and starts
    /// copying it (its claim word's READING), as a peer does before its
    /// `process_vm_readv`.
    pub fn peer_claims(&self, ticket: u64) {
        let reading = super::cma::word(ticket, super::cma::READING);
        self.peer_rx.ctl().claim().store(reading, Ordering::Release);
    }

    /// The blocked caller of `bytes` gives up (its deadline passed), as the
    /// endpoint's `send` does: the lane lets go of its slice.
    pub fn abandon_send(&mut self, bytes: &[u8]) {
        if let Some(lane) = self.lane.as_mut() {
            lane.abandon_send(bytes);
        }
    }

    /// A blocked caller's send of `bytes` (as the endpoint's `send`):
    /// `Ok(false)` while it must go on with [`continue_send`](Self::continue_send).
    pub fn send_direct(&mut self, bytes: &[u8]) -> Result<bool, Error> {
        let Some(lane) = self.lane.as_mut() else {
            return Err(Error::Closed);
        };
        lane.send(PEER, Source::Slice(bytes), true, 1 << 20)
            .map_err(|r| r.error)
    }

    /// The same caller again, with the same `bytes`: `Ok(true)` once its
    /// message is out of its hands.
    pub fn continue_send(&mut self, bytes: &[u8]) -> Result<bool, Error> {
        let Some(lane) = self.lane.as_mut() else {
            return Err(Error::Closed);
        };
        lane.continue_send(PEER, bytes)
    }

    /// What the lane has written for its peer since the last call (the
    /// peer reads it all, and gives the room back).
    pub fn peer_take(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = self.peer_in.read(&mut buf) {
            out.extend_from_slice(&buf[..n]);
        }
        self.peer_in.publish();
        out
    }

    /// The lane's flush: whether anything moved.
    pub fn flush(&mut self) -> Result<bool, Error> {
        let Some(lane) = self.lane.as_mut() else {
            return Err(Error::Closed);
        };
        lane.flush(PEER)
    }

    /// Messages delivered, their bytes (taken from the arrivals; their
    /// leases go back).
    pub fn take_messages(&mut self) -> Vec<Result<Vec<u8>, Error>> {
        self.arrivals
            .drain(..)
            .map(|r| {
                r.map(|m| match &m.lease {
                    super::ShmLease::Host(l) => zerohop_backends::host_bytes(l).to_vec(),
                    #[cfg(feature = "cuda-uma")]
                    // A rig has no GPU side: no device message comes.
                    super::ShmLease::Device(_) => Vec::new(),
                })
            })
            .collect()
    }

    /// Messages delivered (taken from the arrivals; their leases go back).
    pub fn take_delivered(&mut self) -> Vec<Result<usize, Error>> {
        self.arrivals
            .drain(..)
            .map(|r| r.map(|m| m.lease.len()))
            .collect()
    }

    /// Whether the lane still stands.
    pub fn alive(&self) -> bool {
        self.lane.is_some()
    }

    /// The peer rings this side `rings` times (bytes on the link), then
    /// its process goes: the link hangs up.
    pub fn peer_rings_and_hangs_up(&mut self, rings: usize) {
        if let Some(link) = self.peer_link.take() {
            for _ in 0..rings {
                super::handshake::ring(&link);
            }
        }
    }

    /// Whether the lane sees its peer's end of the link still there.
    pub fn link_alive(&self) -> bool {
        self.lane.as_ref().is_some_and(|l| l.alive())
    }

    /// The lane takes its peer for another user's process (as if the
    /// link's credentials named one): no tail is offered to it.
    pub fn peer_of_another_user(&mut self) {
        if let Some(l) = self.lane.as_mut() {
            l.peer_of_another_user();
        }
    }

    /// Bytes leased from the receive pool now.
    pub fn pool_used(&self) -> usize {
        self.pool.used_bytes()
    }

    /// Drops the lane (as a transport does when its peer goes).
    pub fn drop_lane(&mut self) {
        self.lane = None;
    }
}
