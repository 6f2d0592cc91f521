//! One same-host peer: a session over the segment's two rings, driven as a
//! stream wire (TCP's framing, no fragmentation; a whole message behind a
//! short record instead of a header, see [`ShortRecord`]), and the Unix
//! connection that is both sides' doorbell and whose hang-up says the peer
//! is gone.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use zerohop_backends::{host_bytes, host_bytes_mut, shared_place};
use zerohop_core::session::{
    DataFrame, DataIn, Delivered, Inbound, Instant, ProtocolError, Session, SessionConfig,
};
use zerohop_core::wire::{DataFlags, ShortRecord, HEADER_LEN};
use zerohop_core::{Error, Lease, PeerId, Received};

use super::cma;
use super::handshake;
use super::mapped::PeerFiles;
use super::ring::{Consumer, Corrupt, Producer};
use super::segment::{SegRing, Segment};
use super::ShmLease;
use crate::host::{StdLease, StdPool, QUEUED_MESSAGES};

/// What goes in the ring ahead of a data frame's payload.
fn header_of(f: &DataFrame) -> [u8; HEADER_LEN] {
    // A lane does not fragment: a frame is a message, its length a u32.
    f.header.unwrap_or_else(|| {
        ShortRecord {
            imm: f.imm,
            len: u32::try_from(f.len).unwrap_or(u32::MAX),
        }
        .encode()
    })
}

/// What a frame writes from.
enum Payload {
    None,
    Owned(Vec<u8>),
    Leased(StdLease),
}

impl Payload {
    fn bytes(&self) -> &[u8] {
        match self {
            Payload::None => &[],
            Payload::Owned(v) => v,
            Payload::Leased(l) => host_bytes(l),
        }
    }
}

/// A frame not all in the ring yet.
struct Out {
    header: [u8; HEADER_LEN],
    payload: Payload,
    /// Bytes of header and payload already written.
    sent: usize,
}

impl Out {
    fn len(&self) -> usize {
        HEADER_LEN + self.payload.bytes().len()
    }
}

/// A blocked caller's slice, by address and length. Two threads may send
/// to one peer, and one's frame may stand where the other's ended: a
/// caller finishes or withdraws only its own.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Caller(usize, usize);

impl Caller {
    fn of(bytes: &[u8]) -> Self {
        Caller(bytes.as_ptr().addr(), bytes.len())
    }
}

/// A frame being written straight from a blocked caller's slice (the caller
/// passes the same bytes on every call: see `Wire::start_send`).
struct Direct {
    header: [u8; HEADER_LEN],
    sent: usize,
    caller: Caller,
}

/// A large message handed over by a single copy ([`cma`]): its bytes stay
/// where they are until the peer has read them.
struct Handover {
    ticket: u64,
    header: [u8; HEADER_LEN],
    held: Held,
}

enum Held {
    /// The blocked caller's slice (it passes it to `continue_send`).
    Caller(Caller),
    Owned(Vec<u8>),
    Leased(StdLease),
}

impl Held {
    /// Whether this is the blocked caller's slice `bytes`.
    fn is_callers(&self, bytes: &[u8]) -> bool {
        matches!(*self, Held::Caller(c) if c == Caller::of(bytes))
    }
}

/// Where a data frame's payload comes from.
enum Stage {
    /// Its descriptor (a single-copy message), being read from the ring.
    Desc {
        have: usize,
        buf: [u8; cma::DESC_BYTES],
    },
    /// The ring.
    Inline,
    /// Its descriptor (a device message), being read from the ring into
    /// the lane's `device_desc` (here, it would double the size of every
    /// frame's `Incoming`).
    #[cfg(feature = "cuda-uma")]
    Device { have: usize },
}

/// A data frame whose header the engine took: its payload goes here.
struct Incoming {
    d: DataIn,
    lease: Option<StdLease>,
    have: usize,
    stage: Stage,
}

impl Incoming {
    /// A message's payload to come, into a buffer not leased yet.
    fn new(d: DataIn, stage: Stage) -> Incoming {
        Incoming {
            d,
            lease: None,
            have: 0,
            stage,
        }
    }
}

/// Placed messages in flight at most. One: a second would go while the
/// peer copies the first, but each in flight is another buffer the copies
/// cycle through, out of the caches; one at a time ran 1 MiB at 37–39 GB/s
/// on the build VM, two at 15–16, any number at 9–11 (BENCHMARKS.md).
const PLACED_MAX: usize = 1;

/// Whether claim word `v` says the handover of ticket `t` is still to come
/// or under way: the message before is done, or was withdrawn (the peer has
/// not reset the word yet), or the peer is reading `t`.
fn claim_waits(t: u64, v: u64) -> bool {
    v == cma::word(t - 1, cma::OPEN)
        || v == cma::word(t - 1, cma::WITHDRAWN)
        || v == cma::word(t, cma::READING)
}

/// What the handover of a single-copy message has come to.
#[derive(PartialEq, Eq)]
enum Handed {
    /// The peer has the bytes.
    Done,
    /// Not yet.
    Waiting,
    /// The bytes go in the ring after all (refused, or withdrawn).
    Inline,
}

/// Counts of a lane's single-copy messages (see [`LocalWire::single_copies`](super::LocalWire::single_copies)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SingleCopies {
    /// Sent by the claim word (the receiver reads them while the sender
    /// waits for its done).
    pub claimed: u64,
    /// Claimed and placed ones whose tail this side wrote into the
    /// receiver's buffer while the receiver read the head.
    pub helped: u64,
    /// Sent placed in this side's pool file (the sender goes on at once).
    pub placed: u64,
    /// The peer's, copied out of this side's mapping of its pool file.
    pub mapped: u64,
}

/// This side's part of the peer's single-copy messages.
struct SingleIn {
    /// The peer's pool files mapped here (reads by `memcpy`).
    files: PeerFiles,
    /// The peer's process (reads by `process_vm_readv`), if known.
    peer_pid: Option<i32>,
    /// Offers a long message's tail for the sender to write here: only to
    /// a process of this user. Another user's cannot write into this one
    /// (the kernel refuses it), but could take the tail and hold this
    /// side's reader for the whole wait, keep the buffer for as long as it
    /// lives, or say it wrote what it did not (the buffer's old bytes,
    /// maybe another peer's, delivered as its message); this user's could
    /// do worse to this process anyway.
    offers_tails: bool,
    /// Large messages come by a single copy (until this side refuses one).
    cma: bool,
    /// The last claimed ticket this side took, and the last placed one.
    ticket: u64,
    placed: u64,
    /// The inode of the peer's pool file this side has told it it maps.
    told_maps: u64,
    /// The peer took a tail of the message being read and had not written
    /// it when this side gave up: it may still write into that buffer,
    /// which must not go back to the pool while the peer lives.
    stuck: bool,
}

impl SingleIn {
    /// Copies a single-copy message's bytes into `dst`: out of the peer's
    /// pool file where the descriptor names one this side maps, else by
    /// the kernel. The first read out of a file tells the peer (the
    /// consumer's `maps_file` word of `ring`): it may place messages then.
    fn copy(&mut self, desc: &cma::Desc, dst: &mut [u8], ring: &Consumer<SegRing>) -> bool {
        let got = self.copy_out(desc, dst, ring);
        // A test's peer may end its ring here, mid-race (see `testing`).
        #[cfg(feature = "testing")]
        if got {
            super::testing::after_copy();
        }
        got
    }

    fn copy_out(&mut self, desc: &cma::Desc, dst: &mut [u8], ring: &Consumer<SegRing>) -> bool {
        if let Some(p) = desc.place.filter(|&p| self.files.read(p, dst)) {
            if self.told_maps != p.ino {
                self.told_maps = p.ino;
                // Release: nothing to publish with it; the peer acts on it alone.
                ring.mem_ctl()
                    .maps_file()
                    .store(p.ino, std::sync::atomic::Ordering::Release);
            }
            return true;
        }
        self.peer_pid
            .is_some_and(|pid| cma::read(pid, desc.addr, dst))
            && self.files.process_alive()
    }

    /// Whether bytes just copied out of the peer's memory are its message's:
    /// not once the peer has ended the lane uncleanly (its `ended` word in
    /// `ring`), when its buffers may have been reused under the copy.
    fn kept(ring: &Consumer<SegRing>) -> bool {
        ring.mem_ctl().copied_intact()
    }

    /// Takes a placed message (no claim: the peer holds its bytes until
    /// the `placed_done` word of `ring` passes its ticket). Its bytes come
    /// whole or the lane ends: the peer places only into a file this side
    /// said it maps.
    fn take_placed(
        &mut self,
        peer: PeerId,
        desc: &cma::Desc,
        dst: &mut [u8],
        (ring, link): (&Consumer<SegRing>, &UnixStream),
    ) -> Result<bool, Error> {
        if desc.ticket != self.placed + 1 {
            return Err(Lane::bad_claim(peer));
        }
        self.placed = desc.ticket;
        let t = desc.ticket | cma::PLACED_TICKET;
        if !self.copy_helped(peer, desc, dst, (ring, link), t)? {
            return Err(Error::WireRule {
                peer,
                rule: "a placed message whose bytes this side cannot read",
            });
        }
        if !Self::kept(ring) {
            return Err(Error::PeerLost(peer));
        }
        // Release: our copy out of the peer's file is over.
        ring.mem_ctl()
            .placed_done()
            .store(desc.ticket, std::sync::atomic::Ordering::Release);
        Ok(true)
    }

    /// Copies a claimed or placed message's bytes into `dst`: a long one's
    /// tail offered to the sender meanwhile under the help word's ticket
    /// `t` (see [`cma`]), and the offer settled before this returns,
    /// whether the head came or not — but where the sender took the tail
    /// and neither wrote it nor exited within [`cma::HELP_WAIT`]: then the
    /// error, and `stuck` says `dst` may still be written. Whether all of
    /// them came.
    fn copy_helped(
        &mut self,
        peer: PeerId,
        desc: &cma::Desc,
        dst: &mut [u8],
        (ring, link): (&Consumer<SegRing>, &UnixStream),
        t: u64,
    ) -> Result<bool, Error> {
        let placed = t & cma::PLACED_TICKET != 0;
        use std::sync::atomic::Ordering;
        // Offered only where a sender that dies while it writes can be
        // told from one that is slow (its pidfd).
        let Some(at) = cma::help_split(dst.len(), placed)
            .filter(|_| self.offers_tails && self.files.knows_process())
        else {
            return Ok(self.copy(desc, dst, ring));
        };
        let help = ring.mem_ctl().help();
        let len = dst.len();
        let (head, tail) = dst.split_at_mut(at);
        // Relaxed: published by the offer's Release store.
        help.dst.store(tail.as_mut_ptr() as u64, Ordering::Relaxed);
        help.word
            .store(cma::word(t, cma::OFFERED), Ordering::Release);
        // A sender asleep on its doorbell sees the offer only if rung (the
        // flag is read after the offer's store: one that flags itself after
        // this look finds the offer in its last look before sleeping).
        if len >= cma::HELP_RING_MIN && ring.writer_waits() {
            handshake::ring(link);
        }
        #[cfg(feature = "testing")]
        if super::testing::OFFERS_WAIT.load(Ordering::Relaxed) {
            let until = std::time::Instant::now() + std::time::Duration::from_secs(2);
            while help.word.load(Ordering::Acquire) == cma::word(t, cma::OFFERED) {
                if std::time::Instant::now() >= until {
                    super::testing::OFFER_WAITS_RUN_OUT.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                std::hint::spin_loop();
            }
        }
        let head_got = self.copy(desc, head, ring);
        // AcqRel: against the sender's take; whoever swaps first decides.
        let mut v = match help.word.compare_exchange(
            cma::word(t, cma::OFFERED),
            cma::word(t, cma::IDLE),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => cma::word(t, cma::IDLE),
            Err(v) => v,
        };
        let mut spins = 0u32;
        let mut until = None;
        // Taken: the sender is writing the tail; its end is waited for, a
        // bounded time (a live peer that never ends it costs this side its
        // lane, not its thread; its buffer stays out while the peer lives,
        // since a late write lands there: see `take_stuck`).
        while v == cma::word(t, cma::TAKEN) {
            spins = spins.wrapping_add(1);
            if spins % 1024 == 0 {
                if self.files.process_exited() {
                    return Err(Error::PeerLost(peer)); // it writes no more
                }
                let now = std::time::Instant::now();
                if now > *until.get_or_insert(now + cma::HELP_WAIT) {
                    self.stuck = true;
                    return Err(Error::WireRule {
                        peer,
                        rule: "a tail taken and never written",
                    });
                }
            }
            std::hint::spin_loop();
            // Acquire: the sender's write of the tail is over before its DONE.
            v = help.word.load(Ordering::Acquire);
        }
        if v == cma::word(t, cma::IDLE) {
            // Back, or not writable there: the tail is this side's to read
            // (one message: one read of a mapped file counted).
            let reads = self.files.reads;
            let tail_got = head_got && self.copy(&desc.skip(at), tail, ring);
            self.files.reads = reads;
            return Ok(tail_got);
        }
        if v != cma::word(t, cma::DONE) {
            return Err(Lane::bad_claim(peer));
        }
        Ok(head_got)
    }

    /// Takes a message handed over by the claim word of `ring` (see
    /// [`cma`]): whether its bytes came (else they follow in the ring:
    /// refused here, or withdrawn by the sender).
    fn take_claimed(
        &mut self,
        peer: PeerId,
        desc: &cma::Desc,
        dst: &mut [u8],
        (ring, link): (&Consumer<SegRing>, &UnixStream),
    ) -> Result<bool, Error> {
        use std::sync::atomic::Ordering;
        let ticket = desc.ticket;
        if ticket != self.ticket + 1 {
            return Err(Lane::bad_claim(peer));
        }
        self.ticket = ticket;
        let claim = ring.mem_ctl().claim();
        // AcqRel: against the sender's withdrawal; whoever swaps first decides.
        match claim.compare_exchange(
            cma::word(ticket - 1, cma::OPEN),
            cma::word(ticket, cma::READING),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => {
                let got = self.copy_helped(peer, desc, dst, (ring, link), ticket)?;
                if got && !Self::kept(ring) {
                    return Err(Error::PeerLost(peer));
                }
                // Not permitted here (or the peer lied): the bytes come in the ring.
                self.cma &= got;
                let state = if got { cma::OPEN } else { cma::REFUSED };
                // Release: our copy out of the peer's memory is over.
                claim.store(cma::word(ticket, state), Ordering::Release);
                Ok(got)
            }
            Err(v) if cma::state_of(v) == cma::WITHDRAWN && cma::ticket_of(v) >= ticket => {
                // Withdrawn (with the ones after it, up to the word's
                // ticket): its bytes follow in the ring. The word's own
                // message readies it for the next ticket (Release: as a
                // done) — unless the sender withdraws that one meanwhile.
                if cma::ticket_of(v) == ticket {
                    let _ = claim.compare_exchange(
                        v,
                        cma::word(ticket, cma::OPEN),
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    );
                }
                Ok(false)
            }
            Err(_) => Err(Lane::bad_claim(peer)),
        }
    }
}

/// How reading a lane ended.
pub(crate) enum Outcome {
    /// Nothing more now.
    Drained,
    /// Stopped with bytes left: the inbox is full or the pool dry.
    Stopped,
    /// The peer broke the protocol or the ring.
    Bad(Error),
}

/// One same-host peer.
pub(crate) struct Lane {
    /// The peer's address on the usual wire (how the application names it).
    pub(crate) addr: SocketAddr,
    /// This side created the lane: it accepted the peer on the usual wire
    /// (and the lane counts against that wire's peer limits).
    pub(crate) accepted: bool,
    pub(crate) session: Session,
    tx: Producer<SegRing>,
    rx: Consumer<SegRing>,
    /// The Unix connection the segment came over: each side's doorbell (a
    /// byte on it wakes the other), and its hang-up is the peer's end.
    link: UnixStream,
    header: [u8; HEADER_LEN],
    have: usize,
    /// Bytes taken from the peer's ring as of the last [`Lane::heard`].
    taken_when_heard: u64,
    incoming: Option<Incoming>,
    queue: VecDeque<Out>,
    pub(crate) queued_bytes: usize,
    /// Counted in its wire's lanes with bytes unsent, as of the last
    /// [`tally`](super::tally).
    pub(crate) tallied: bool,
    /// The frame a blocked caller is writing from its slice: it goes first.
    direct: Option<Direct>,
    /// This side said it waits for room (the peer rings when it reads).
    waiting_room: bool,
    /// A handover's peer broke it or never finished it: the lane is over.
    broken: bool,
    /// The sleep check found the peer's ring counter impossible: the lane
    /// is not quiet until a read has looked (and says why).
    read_for_corrupt: bool,
    /// The pool had no buffer for the last message begun.
    pub(crate) dry: bool,
    /// The last read stopped at a full inbox (the inbox is shared by every
    /// lane: a frame of this one may have been begun).
    held: bool,
    /// What this side takes of the peer's single-copy messages.
    single_in: SingleIn,
    /// Placed messages the peer has not copied yet, oldest first: their
    /// tickets and buffers.
    placed: VecDeque<(u64, StdLease)>,
    /// The last placed ticket this side issued.
    tx_placed: u64,
    /// Messages at least this long go by a single copy (the segment says).
    single_min: usize,
    /// Large messages go by a single copy (until the peer refuses one).
    cma_tx: bool,
    /// The outstanding single-copy message, if any: nothing goes after it
    /// until it is handed over.
    handover: Option<Handover>,
    /// The last ticket this side issued.
    tx_ticket: u64,
    /// The peer's offers of a message's tail are taken (until a write into
    /// its memory fails, or cannot be tried), and how many were written.
    help_tx: bool,
    tx_helped: u64,
    /// The receive buffer of a message whose tail the peer took and never
    /// wrote (see [`take_stuck`](Self::take_stuck)).
    stuck: Option<StdLease>,
    /// The lane sleeps between passes (see `LocalWire::arm`): reads and
    /// walks skip it, and the peer rings its link for anything it writes.
    pub(crate) armed: bool,
    /// Rings may be left on the link from a sleep that ended (see
    /// [`Lane::take_rings`]).
    rings_left: bool,
    /// Bytes taken and ring bytes written as of the last side pass that
    /// saw either move, and that pass's time (see [`Lane::still_for`]).
    moved: (u64, u64),
    moved_at: Instant,
    /// Device messages each way (a lane whose wire has a device pool).
    #[cfg(feature = "cuda-uma")]
    gpu: Option<Box<super::device::LaneGpu>>,
    /// The descriptor of the device message being read.
    #[cfg(feature = "cuda-uma")]
    device_desc: [u8; super::device::DESC_BYTES],
}

impl Lane {
    /// A lane over `segment`: the creator (the side that took the offer)
    /// writes ring 0 and reads ring 1, the other the reverse. Its Hello is
    /// queued by [`start`](Self::start).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        addr: SocketAddr,
        segment: Arc<Segment>,
        creator: bool,
        link: UnixStream,
        config: SessionConfig,
        token: u32,
        now: Instant,
    ) -> Lane {
        let (mine, theirs) = if creator { (0, 1) } else { (1, 0) };
        // The process at the other end of the link (the kernel's word, not the peer's).
        let cred = rustix::net::sockopt::socket_peercred(&link).ok();
        let peer_pid = cred.as_ref().map(|c| c.pid.as_raw_nonzero().get());
        let same_user = cred.is_some_and(|c| c.uid == rustix::process::geteuid());
        Lane {
            addr,
            accepted: creator,
            single_min: segment.single_copy_from(),
            session: Session::new(config, token, now),
            tx: Producer::new(segment.ring(mine)),
            rx: Consumer::new(segment.ring(theirs)),
            taken_when_heard: 0,
            link,
            header: [0; HEADER_LEN],
            have: 0,
            incoming: None,
            queue: VecDeque::new(),
            queued_bytes: 0,
            tallied: false,
            direct: None,
            waiting_room: false,
            broken: false,
            read_for_corrupt: false,
            dry: false,
            held: false,
            single_in: SingleIn {
                files: PeerFiles::new(peer_pid),
                peer_pid,
                offers_tails: same_user,
                cma: true,
                ticket: 0,
                placed: 0,
                told_maps: 0,
                stuck: false,
            },
            placed: VecDeque::new(),
            tx_placed: 0,
            cma_tx: true,
            handover: None,
            tx_ticket: 0,
            help_tx: true,
            tx_helped: 0,
            stuck: None,
            armed: false,
            rings_left: false,
            moved: (0, 0),
            moved_at: now,
            #[cfg(feature = "cuda-uma")]
            gpu: None,
            #[cfg(feature = "cuda-uma")]
            device_desc: [0; super::device::DESC_BYTES],
        }
    }

    /// This lane carries device messages both ways, received into `gpu`'s
    /// pool (before [`start`](Self::start): its Hello says so).
    #[cfg(feature = "cuda-uma")]
    pub(crate) fn with_gpu(mut self, gpu: super::device::LaneGpu) -> Lane {
        self.session.take_device_frames();
        self.gpu = Some(Box::new(gpu));
        self
    }

    /// This side maps at most `bytes` of the peer's pool files, in all
    /// (none until told): see [`mapped`](super::mapped).
    pub(crate) fn map_within(mut self, bytes: usize) -> Lane {
        self.single_in.files.allow(bytes);
        self
    }

    /// How this side's single-copy messages have gone, and how many of
    /// the peer's it copied out of the peer's pool file.
    pub(crate) fn single_copies(&self) -> SingleCopies {
        SingleCopies {
            claimed: self.tx_ticket,
            helped: self.tx_helped,
            placed: self.tx_placed,
            mapped: self.single_in.files.reads,
        }
    }

    /// A receive buffer the peer may still write into (it took a tail and
    /// this side gave up waiting), with the peer's pidfd: it goes back to
    /// its pool only once that process has exited (the wire keeps it).
    pub(crate) fn take_stuck(&mut self) -> Option<(StdLease, Option<std::os::fd::OwnedFd>)> {
        let lease = self.stuck.take()?;
        Some((lease, self.single_in.files.pidfd()))
    }

    /// Queues the lane's Hello: it goes with the first flush.
    pub(crate) fn start(mut self) -> Lane {
        self.control();
        self
    }

    /// Sends a message in device memory: its descriptor goes in the ring,
    /// its bytes stay in `lease` (held until the peer has copied them).
    #[cfg(feature = "cuda-uma")]
    // A refused lease comes back whole (as `Transport::try_send_lease`'s does).
    #[allow(clippy::result_large_err)]
    pub(crate) fn send_device(
        &mut self,
        peer: PeerId,
        lease: zerohop_backends::cuda::DeviceLease,
    ) -> Result<(), (Error, zerohop_backends::cuda::DeviceLease)> {
        use super::device::DESC_BYTES;
        if let Err(e) = self.release_device(peer) {
            return Err((e, lease));
        }
        match self.session.peer() {
            None => return Err((Error::WouldBlock, lease)), // its Hello has not come
            Some(p) if !p.takes_device => {
                return Err((
                    Error::Backend(
                        "shm: the peer takes no device messages (it has no GPU side: no CUDA, or no device pool)",
                    ),
                    lease,
                ))
            }
            Some(_) => {}
        }
        let behind = !self.queue.is_empty() || self.direct.is_some() || self.handover.is_some();
        let Some(gpu) = self.gpu.as_mut() else {
            return Err((
                Error::Backend("shm: a device buffer, and this lane has no device pool"),
                lease,
            ));
        };
        match self.tx.room() {
            Ok(room) if !behind && gpu.has_room(lease.len()) && room >= HEADER_LEN + DESC_BYTES => {
            }
            Ok(_) => return Err((Error::WouldBlock, lease)),
            Err(c) => return Err((Self::corrupt(peer, c), lease)),
        }
        let (desc, ticket) = match gpu.describe(&lease) {
            Ok(d) => d,
            Err(e) => return Err((e, lease)),
        };
        let mut out = match self.session.send(lease.len()) {
            Ok(o) => o,
            Err(e) => {
                self.control();
                return Err((e.to_error(peer), lease));
            }
        };
        let Some(f) = self.session.next_frame(&mut out, None, DataFlags::DEVICE) else {
            return Err((Error::Backend("shm: the session framed nothing"), lease));
        };
        let header = header_of(&f);
        match self.tx.write(&[&header, &desc]) {
            Ok(m) if m.n == HEADER_LEN + DESC_BYTES => {
                if m.wake {
                    handshake::ring(&self.link);
                }
            }
            _ => {
                return Err((Self::corrupt(peer, Corrupt { theirs: 0, ours: 0 }), lease));
            }
        }
        if let Some(gpu) = self.gpu.as_mut() {
            gpu.sent(ticket, lease);
        }
        self.control();
        Ok(())
    }

    /// The buffers of placed messages the peer has copied go back to the
    /// pool. Whether any did; a done past the last ticket sent is the
    /// peer breaking the lane. Inline: every send and every pass asks,
    /// and with none placed the answer is one comparison, not a call.
    #[inline]
    fn release_placed(&mut self, peer: PeerId) -> Result<bool, Error> {
        if self.placed.is_empty() {
            return Ok(false);
        }
        if self.help_tx {
            self.help_peer();
        }
        self.release_copied_placed(peer)
    }

    fn release_copied_placed(&mut self, peer: PeerId) -> Result<bool, Error> {
        // Acquire: the peer's copy out of those buffers is over.
        let done = self
            .tx
            .mem_ctl()
            .placed_done()
            .load(std::sync::atomic::Ordering::Acquire);
        if done > self.tx_placed {
            return Err(Error::WireRule {
                peer,
                rule: "a placed message done that was never sent",
            });
        }
        let before = self.placed.len();
        while self.placed.front().is_some_and(|(t, _)| *t <= done) {
            self.placed.pop_front(); // the buffer goes back to its pool
        }
        Ok(self.placed.len() != before)
    }

    /// Bytes this side has taken to send that the peer does not have yet:
    /// queued, handed over (a single copy the peer has not taken; placed
    /// ones not copied yet) and device copies in flight. An endpoint's
    /// `flush` waits for them.
    pub(crate) fn unsent_bytes(&self) -> usize {
        let handed = match self.handover.as_ref().map(|h| &h.held) {
            Some(Held::Caller(Caller(_, len))) => *len,
            Some(Held::Owned(v)) => v.len(),
            Some(Held::Leased(l)) => l.len(),
            None => 0,
        };
        let placed: usize = self.placed.iter().map(|(_, l)| l.len()).sum();
        self.queued_bytes + handed + placed + self.device_in_flight()
    }

    /// Whether [`unsent_bytes`](Self::unsent_bytes) is above zero: the
    /// common answers without the sum (a look after every read and send).
    #[inline]
    pub(crate) fn has_unsent(&self) -> bool {
        self.queued_bytes > 0
            || self.device_in_flight() > 0
            || ((self.handover.is_some() || !self.placed.is_empty()) && self.unsent_bytes() > 0)
    }

    /// The sender's device buffers the peer has copied go back to the
    /// pool. Whether any did.
    fn release_device(&mut self, peer: PeerId) -> Result<bool, Error> {
        #[cfg(feature = "cuda-uma")]
        if self.device_in_flight() > 0 {
            let done = self.peer_device_done();
            let Some(gpu) = self.gpu.as_mut() else {
                return Ok(false); // in flight implies a GPU side
            };
            let before = gpu.in_flight();
            gpu.release(done).map_err(|()| Error::WireRule {
                peer,
                rule: "a device message done that was never sent",
            })?;
            return Ok(gpu.in_flight() != before);
        }
        let _ = peer;
        Ok(false)
    }

    /// The last of this side's device messages the peer says it copied.
    #[cfg(feature = "cuda-uma")]
    fn peer_device_done(&self) -> u64 {
        // Acquire: the peer's copy out of those buffers is over.
        self.tx
            .mem_ctl()
            .device_done()
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// A timer of its session is due at `now` and something waits in the
    /// ring: the side pass reads it before judging the peer (a progress
    /// thread leaves reading to an application thread that calls).
    pub(crate) fn due_unread(&self, now: Instant) -> bool {
        self.session.poll_timeout().is_some_and(|d| d <= now) && !self.quiet()
    }

    /// Bytes this side has taken from the peer's ring, ever: when it moves,
    /// frames came in (credit a blocked sender waits for, among them).
    pub(crate) fn taken(&self) -> u64 {
        self.rx.taken()
    }

    /// The side pass's timers at `now`: a peer this side holds back (its
    /// pool dry, the inbox full) is not stalled; bytes taken since the last
    /// pass are news of it (see `heard`); then its idle timeout.
    pub(crate) fn tend(&mut self, now: Instant, came_back: bool) -> Result<(), ProtocolError> {
        if self.dry || self.held {
            self.session.handle_held(now);
        }
        if came_back {
            self.session.handle_absence(now);
        }
        self.heard(now);
        self.session.handle_timeout(now)
    }

    /// The clock as of a side pass: bytes taken since the last one mean the
    /// peer was heard since, whatever time the reads that took them were
    /// told. Reads between side passes use the time of the last one (a
    /// clock read a poll would cost a spinning receiver a quarter of its
    /// time); after a long quiet that time is old, and a frame found half
    /// written then must not look stalled since it.
    fn heard(&mut self, now: Instant) {
        let taken = self.taken();
        if taken != self.taken_when_heard {
            let bytes = usize::try_from(taken - self.taken_when_heard).unwrap_or(usize::MAX);
            self.taken_when_heard = taken;
            let partial = self.have > 0 || self.incoming.is_some();
            self.session.handle_activity(now, bytes, partial);
        }
    }

    /// Device messages whose copies are over go to `arrivals` (with what
    /// waited behind them), and the peer learns which it may reuse.
    /// Inlined, the look for a GPU side: a lane without one pays nothing
    /// more in a build with CUDA (the rest stays out of the read's code).
    #[inline]
    fn deliver_device(
        &mut self,
        peer: PeerId,
        arrivals: &mut VecDeque<Result<Received<ShmLease>, Error>>,
    ) -> Result<(), Error> {
        #[cfg(feature = "cuda-uma")]
        if self.gpu.is_some() {
            return self.deliver_copies(peer, arrivals);
        }
        let _ = (peer, arrivals);
        Ok(())
    }

    #[cfg(feature = "cuda-uma")]
    #[inline(never)]
    fn deliver_copies(
        &mut self,
        peer: PeerId,
        arrivals: &mut VecDeque<Result<Received<ShmLease>, Error>>,
    ) -> Result<(), Error> {
        if let Some(gpu) = self.gpu.as_mut() {
            let before = arrivals.len();
            let done = gpu.deliver(peer, arrivals)?;
            // Copies that ended after the peer dropped the lane may hold
            // reused bytes: they go, with what waited behind them.
            if done.is_some() && !SingleIn::kept(&self.rx) {
                arrivals.truncate(before);
                return Err(Error::PeerLost(peer));
            }
            if let Some(done) = done {
                // Release: our copy out of the peer's memory is over.
                self.rx
                    .mem_ctl()
                    .device_done()
                    .store(done, std::sync::atomic::Ordering::Release);
                if self.rx.writer_waits() {
                    handshake::ring(&self.link);
                }
            }
        }
        Ok(())
    }

    /// What the engine said of a host message's payload (all in `lease`):
    /// the message on to the application, or how the lane ends (`Err`).
    #[inline]
    fn delivered(
        &mut self,
        peer: PeerId,
        verdict: Result<Option<Delivered>, ProtocolError>,
        lease: StdLease,
        arrivals: &mut VecDeque<Result<Received<ShmLease>, Error>>,
    ) -> Result<(), Outcome> {
        match verdict {
            Ok(Some(done)) => {
                self.session.consumed(done.len);
                let lease = ShmLease::Host(lease);
                self.arrive(arrivals, Ok(Received { peer, lease }));
                Ok(())
            }
            // A stream wire does not fragment.
            Ok(None) => Err(Outcome::Bad(Error::Backend(
                "shm: a fragment on a stream lane",
            ))),
            Err(error) => Err(Outcome::Bad(Error::Protocol { peer, error })),
        }
    }

    /// Hands a message (or the peer's Close) on: behind any device message
    /// whose copy is under way, else straight to `arrivals`.
    fn arrive(
        &mut self,
        arrivals: &mut VecDeque<Result<Received<ShmLease>, Error>>,
        r: Result<Received<ShmLease>, Error>,
    ) {
        #[cfg(feature = "cuda-uma")]
        if let Some(gpu) = self.gpu.as_mut().filter(|g| g.holds()) {
            gpu.hold(r);
            return;
        }
        arrivals.push_back(r);
    }

    /// Whether device copies are under way (nothing rings when one ends:
    /// the lane must be looked at, not slept on).
    fn copying(&self) -> bool {
        #[cfg(feature = "cuda-uma")]
        if let Some(gpu) = &self.gpu {
            return gpu.holds();
        }
        false
    }

    /// Device messages sent that the peer has not copied yet.
    pub(crate) fn device_in_flight(&self) -> usize {
        #[cfg(feature = "cuda-uma")]
        if let Some(gpu) = &self.gpu {
            return gpu.in_flight();
        }
        0
    }

    fn bad_claim(peer: PeerId) -> Error {
        Error::WireRule {
            peer,
            rule: "a same-host handover word the peer could not have written",
        }
    }

    /// Where the handover of the outstanding single-copy message stands.
    /// `caller`: the blocked caller's bytes, when it asks (a refusal then
    /// turns into a direct write of the rest).
    fn poll_handover(&mut self, peer: PeerId, caller: Option<&[u8]>) -> Result<Handed, Error> {
        if self.help_tx && self.handover.is_some() {
            self.help_peer();
        }
        let Some(h) = self.handover.as_ref() else {
            return Ok(Handed::Done);
        };
        let (t, v) = (h.ticket, self.claim_word());
        let state = if v == cma::word(t, cma::OPEN) {
            Handed::Done
        } else if claim_waits(t, v) {
            Handed::Waiting
        } else if v == cma::word(t, cma::REFUSED) {
            Handed::Inline
        } else {
            return Err(Self::bad_claim(peer));
        };
        match state {
            Handed::Done => {
                self.handover = None; // a held lease goes back
            }
            Handed::Inline => {
                if matches!(h.held, Held::Caller(..)) && caller.is_none() {
                    return Ok(Handed::Waiting); // the caller writes it, when it next asks
                }
                self.cma_tx = false;
                let h = self.handover.take().expect("handover");
                self.inline_rest(h, caller);
            }
            Handed::Waiting => {}
        }
        Ok(state)
    }

    /// The tail the peer offers of a message this side still holds, if
    /// one is open and this side takes offers: the help word as read, and
    /// the message's bytes (start, length). An offer of another ticket, or
    /// one after a refused write, is none (a look: the take swaps again).
    fn open_offer(&self) -> Option<(u64, *const u8, usize)> {
        if self.broken || !self.help_tx {
            // Broken: a caller that left with the lane's error may have
            // taken its slice with it, nothing here is read any more.
            return None;
        }
        // Relaxed: a look; the swap that takes it acquires (and before a
        // sleep, `prepare_wait`'s fence orders it after the flag).
        let offer = self
            .tx
            .mem_ctl()
            .help()
            .word
            .load(std::sync::atomic::Ordering::Relaxed);
        if cma::state_of(offer) != cma::OFFERED {
            return None;
        }
        let t = cma::ticket_of(offer);
        // The claimed message it names, or the placed one.
        let (src, len) = if let Some(h) = self.handover.as_ref().filter(|h| h.ticket == t) {
            match &h.held {
                Held::Caller(c) => (c.0 as *const u8, c.1),
                Held::Owned(v) => (v.as_ptr(), v.len()),
                Held::Leased(l) => (host_bytes(l).as_ptr(), l.len()),
            }
        } else {
            let (_, l) = self
                .placed
                .iter()
                .find(|(p, _)| *p | cma::PLACED_TICKET == t)?;
            (host_bytes(l).as_ptr(), l.len())
        };
        Some((offer, src, len))
    }

    /// Takes the peer's offer of the handover's tail, if it made one, and
    /// writes the tail into the peer's buffer (see [`cma`]).
    fn help_peer(&mut self) {
        use std::sync::atomic::Ordering;
        let Some((offer, src, len)) = self.open_offer() else {
            return;
        };
        let help = self.tx.mem_ctl().help();
        let t = cma::ticket_of(offer);
        let placed = t & cma::PLACED_TICKET != 0;
        // AcqRel: against the peer's taking it back; Acquire: its `dst`.
        if help
            .word
            .compare_exchange(
                offer,
                cma::word(t, cma::TAKEN),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_err()
        {
            return;
        }
        #[cfg(feature = "testing")]
        if super::testing::TAILS_HANG.load(Ordering::Relaxed) {
            return; // taken, and never written
        }
        let dst = help.dst.load(Ordering::Relaxed);
        // The peer's process, asked after by its pidfd right before the
        // write (the read path's check comes after its read; a write cannot
        // be taken back): a pid alone may name another process by now.
        let pid = self
            .single_in
            .peer_pid
            .filter(|_| self.single_in.files.process_alive());
        let split = cma::help_split(len, placed);
        let tried = split.is_some() && pid.is_some();
        let wrote = match (split, pid) {
            // SAFETY: the lane holds the bytes until the peer's done, and
            // this runs under its `&mut`: a placed lease, or the
            // handover's copy or lease, or the blocked caller's slice (the
            // caller leaves only by `continue_send` or `withdraw`, which
            // take the same `&mut`). Nothing writes them meanwhile.
            (Some(at), Some(pid)) => unsafe {
                cma::write(pid, dst, src.wrapping_add(at), len - at)
            },
            _ => false,
        };
        // A write refused (another user, a ptrace policy) is refused again:
        // offers are left to the peer from now on.
        self.help_tx = wrote || !tried;
        self.tx_helped += u64::from(wrote);
        let state = if wrote { cma::DONE } else { cma::IDLE };
        // Release: the write is over before the peer sees DONE.
        help.word.store(cma::word(t, state), Ordering::Release);
    }

    /// The bytes of a message whose handover failed follow its header and
    /// descriptor in the ring: from the caller's slice (as a direct write),
    /// or from the front of the queue.
    fn inline_rest(&mut self, h: Handover, caller: Option<&[u8]>) {
        // The header and descriptor are out; the descriptor's bytes are not
        // the payload's, so the rest is the whole payload.
        let payload = match h.held {
            Held::Caller(c) => {
                self.direct = Some(Direct {
                    header: h.header,
                    sent: HEADER_LEN,
                    caller: c,
                });
                let _ = caller;
                return;
            }
            Held::Owned(v) => Payload::Owned(v),
            Held::Leased(l) => Payload::Leased(l),
        };
        self.queued_bytes += payload.bytes().len();
        self.queue.push_front(Out {
            header: h.header,
            payload,
            sent: HEADER_LEN,
        });
    }

    /// As [`inline_rest`](Self::inline_rest), from a copy of the caller's
    /// `bytes` (the caller is leaving).
    fn inline_copy(&mut self, h: Handover, bytes: &[u8]) {
        let h = Handover {
            held: Held::Owned(bytes.to_vec()),
            ..h
        };
        self.inline_rest(h, None);
    }

    fn corrupt(peer: PeerId, _: Corrupt) -> Error {
        Error::WireRule {
            peer,
            rule: "a same-host ring whose counters are impossible",
        }
    }

    /// Starts a message: written into the ring as far as it fits, the rest
    /// copied (a slice) or kept (a lease) until the ring has room. A large
    /// one goes by a single copy: a pool buffer placed where the peer maps
    /// this side's pool file, else (a caller's slice always) by the claim
    /// word: out of the caller's slice (`direct`, the caller waiting until
    /// the peer has read it), or out of an owned copy (`try_send`).
    // A refused lease comes back whole (as `Transport::try_send_lease`'s does).
    #[allow(clippy::result_large_err)]
    pub(crate) fn send(
        &mut self,
        peer: PeerId,
        payload: Source<'_>,
        direct: bool,
        queue_limit: usize,
    ) -> Result<bool, Refused> {
        let len = payload.bytes().len();
        // A handover that ended since the last look is not in the way (one
        // load of the claim word, where the wire's progress costs system
        // calls). A bad word is the lane's end, which `flush` reports.
        if self.handover.is_some() {
            let _ = self.poll_handover(peer, None);
        }
        if let Err(e) = self.release_placed(peer) {
            return Err(payload.refused(e));
        }
        let behind = !self.queue.is_empty() || self.direct.is_some() || self.handover.is_some();
        if behind
            && (self.queued_bytes + HEADER_LEN + len > queue_limit
                || self.queue.len() >= QUEUED_MESSAGES)
        {
            return Err(payload.refused(Error::WouldBlock));
        }
        // A large message by a single copy: only with nothing ahead of it,
        // its header and descriptor whole in the ring.
        let single = self.cma_tx && len >= self.single_min;
        if single {
            match self.tx.room() {
                _ if behind => return Err(payload.refused(Error::WouldBlock)),
                _ if self.placed.len() >= PLACED_MAX => {
                    return Err(payload.refused(Error::WouldBlock))
                }
                Ok(room) if room < HEADER_LEN + cma::DESC_BYTES => {
                    return Err(payload.refused(Error::WouldBlock))
                }
                Ok(_) => {}
                Err(c) => return Err(payload.refused(Self::corrupt(peer, c))),
            }
        }
        let mut out = match self.session.send(len) {
            Ok(o) => o,
            Err(e) => {
                self.control(); // a Want, when credit is short
                return Err(payload.refused(e.to_error(peer)));
            }
        };
        let Some(f) = self.session.next_frame(&mut out, None, DataFlags::NONE) else {
            return Err(payload.refused(Error::Backend("shm: the session framed nothing")));
        };
        let header = header_of(&f);
        if single {
            // Placed, where the peer has shown it maps the file (Acquire:
            // nothing to order; the word is the peer's claim, checked at
            // each placed read there).
            let maps = self
                .tx
                .mem_ctl()
                .maps_file()
                .load(std::sync::atomic::Ordering::Acquire);
            let (held, addr) = match payload {
                Source::Slice(b) if direct => (Held::Caller(Caller::of(b)), b.as_ptr() as u64),
                Source::Slice(b) => {
                    let v = b.to_vec();
                    let a = v.as_ptr() as u64;
                    (Held::Owned(v), a)
                }
                Source::Lease(l) => {
                    let a = host_bytes(&l).as_ptr() as u64;
                    (Held::Leased(l), a)
                }
            };
            let place = match &held {
                Held::Leased(l) => shared_place(l),
                _ => None,
            };
            let placed = place.is_some_and(|p| p.ino == maps);
            let ticket = 1 + if placed {
                self.tx_placed
            } else {
                self.tx_ticket
            };
            let d = cma::Desc {
                addr,
                ticket,
                place,
                placed,
            }
            .encode();
            match self.tx.write(&[&header, &d]) {
                Ok(m) if m.n == HEADER_LEN + cma::DESC_BYTES => {
                    if m.wake {
                        handshake::ring(&self.link);
                    }
                }
                _ => {
                    return Err(Refused {
                        error: Self::corrupt(peer, Corrupt { theirs: 0, ours: 0 }),
                        lease: match held {
                            Held::Leased(l) => Some(l),
                            _ => None,
                        },
                    })
                }
            }
            let held = match (placed, held) {
                (true, Held::Leased(l)) => {
                    // Nothing to wait for: the next message may follow at once.
                    self.tx_placed = ticket;
                    self.placed.push_back((ticket, l));
                    self.control();
                    return Ok(true);
                }
                (_, held) => held,
            };
            self.tx_ticket = ticket;
            let waits = matches!(held, Held::Caller(..));
            self.handover = Some(Handover {
                ticket,
                header,
                held,
            });
            self.control();
            return Ok(!waits);
        }
        let mut sent = 0;
        if !behind {
            match self.tx.write(&[&header, payload.bytes()]) {
                Ok(m) => {
                    sent = m.n;
                    if m.wake {
                        handshake::ring(&self.link);
                    }
                }
                Err(c) => return Err(payload.refused(Self::corrupt(peer, c))),
            }
            // The rest from the caller's slice as the ring drains: no copy.
            if let (true, true, Source::Slice(b)) = (sent < HEADER_LEN + len, direct, &payload) {
                let caller = Caller::of(b);
                self.direct = Some(Direct {
                    header,
                    sent,
                    caller,
                });
                self.control();
                return Ok(false);
            }
        }
        if sent < HEADER_LEN + len {
            let payload = match payload {
                Source::Slice(b) => Payload::Owned(b.to_vec()),
                Source::Lease(l) => Payload::Leased(l),
            };
            self.queued_bytes += HEADER_LEN + len - sent;
            self.queue.push_back(Out {
                header,
                payload,
                sent,
            });
        }
        self.control();
        Ok(true)
    }

    /// Writes more of a frame begun by `send` with `direct` from the same
    /// bytes; `Ok(true)` once all of it is in the ring.
    pub(crate) fn continue_send(&mut self, peer: PeerId, bytes: &[u8]) -> Result<bool, Error> {
        if self
            .handover
            .as_ref()
            .is_some_and(|h| h.held.is_callers(bytes))
        {
            let handed = self.poll_handover(peer, Some(bytes)).inspect_err(|_| {
                // The caller leaves with its error while the peer may read
                // its slice: the ring says the lane ended first (see `Drop`).
                self.tx.mem_ctl().end();
                self.broken = true;
            });
            match handed? {
                Handed::Done => {
                    self.flush(peer)?;
                    return Ok(true);
                }
                Handed::Waiting => return Ok(false),
                Handed::Inline => {} // the rest from the slice, below
            }
        }
        // Not this caller's frame (or none): its own is all out.
        let Some(d) = self
            .direct
            .as_mut()
            .filter(|d| d.caller == Caller::of(bytes))
        else {
            return Ok(true);
        };
        let (h, p) = if d.sent < HEADER_LEN {
            (&d.header[d.sent..], bytes)
        } else {
            (&[][..], &bytes[d.sent - HEADER_LEN..])
        };
        let m = self.tx.write(&[h, p]).map_err(|c| Self::corrupt(peer, c))?;
        if m.wake {
            handshake::ring(&self.link);
        }
        d.sent += m.n;
        if d.sent < HEADER_LEN + bytes.len() {
            return Ok(false);
        }
        self.direct = None;
        self.flush(peer)?; // what queued behind it
        Ok(true)
    }

    /// The caller of an unfinished direct send must leave: the rest is
    /// copied and finished from the queue, ahead of everything queued.
    pub(crate) fn abandon_send(&mut self, bytes: &[u8]) {
        if let Some(h) = self.handover.take_if(|h| h.held.is_callers(bytes)) {
            self.withdraw(h, bytes);
            return;
        }
        let Some(d) = self.direct.take_if(|d| d.caller == Caller::of(bytes)) else {
            return;
        };
        let rest = HEADER_LEN + bytes.len() - d.sent;
        self.queued_bytes += rest;
        self.queue.push_front(Out {
            header: d.header,
            payload: Payload::Owned(bytes.to_vec()),
            sent: d.sent,
        });
    }

    /// The blocked caller of a single-copy message must leave. Withdrawn
    /// before the peer took it: its bytes follow in the ring, from a copy.
    /// Taken: the copy under way is waited for (the caller's memory must
    /// not go while the peer reads it); a peer that never finishes is cut off.
    fn withdraw(&mut self, h: Handover, bytes: &[u8]) {
        use std::sync::atomic::Ordering;
        let t = h.ticket;
        let claim = self.tx.mem_ctl().claim();
        // Before the take: the word is the last message's — done, or
        // withdrawn too (the peer has not come to it yet: one withdrawn
        // word then stands for both).
        let mut v = claim.load(Ordering::Acquire);
        while v == cma::word(t - 1, cma::OPEN) || v == cma::word(t - 1, cma::WITHDRAWN) {
            // AcqRel: wins or loses against the receiver's take; either way sees its store.
            match claim.compare_exchange(
                v,
                cma::word(t, cma::WITHDRAWN),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.inline_copy(h, bytes);
                    return;
                }
                Err(now) => v = now,
            }
        }
        let until = std::time::Instant::now() + std::time::Duration::from_secs(2);
        loop {
            // Acquire: the peer's copy out of these bytes is over before we go.
            let v = claim.load(Ordering::Acquire);
            if v == cma::word(t, cma::OPEN) {
                return; // done: the peer has the message
            }
            if v == cma::word(t, cma::REFUSED) {
                self.cma_tx = false;
                self.inline_copy(h, bytes);
                return;
            }
            if v != cma::word(t, cma::READING) || std::time::Instant::now() > until || !self.alive()
            {
                // A peer that breaks the word, never finishes, or died
                // mid-copy: the lane ends (its link hangs up on the peer).
                // The caller's bytes go now, before the lane: the ring says
                // so first, so a copy that ends later is not delivered.
                self.tx.mem_ctl().end();
                self.broken = true;
                return;
            }
            std::hint::spin_loop();
        }
    }

    /// Says to the peer, in the word where this side says which of the
    /// peer's device messages it has copied, that it copied through
    /// `ticket`, whatever it did: what a broken peer says, for tests.
    #[cfg(all(feature = "testing", feature = "cuda-uma"))]
    pub(crate) fn say_device_done(&self, ticket: u64) {
        // Release: as the honest word is stored (`deliver_copies`).
        self.rx
            .mem_ctl()
            .device_done()
            .store(ticket, std::sync::atomic::Ordering::Release);
        handshake::ring(&self.link);
    }

    /// Writes `frame` into the ring as it is, past the session (nothing may
    /// be queued): what a broken peer sends, for tests.
    #[cfg(feature = "testing")]
    pub(crate) fn write_raw(&mut self, peer: PeerId, frame: &[u8]) -> Result<(), Error> {
        if !self.queue.is_empty() || self.direct.is_some() {
            return Err(Error::WouldBlock);
        }
        let m = self
            .tx
            .write(&[frame])
            .map_err(|c| Self::corrupt(peer, c))?;
        if m.wake {
            handshake::ring(&self.link);
        }
        match m.n == frame.len() {
            true => Ok(()),
            false => Err(Error::Backend("shm: the forged frame did not fit")),
        }
    }

    /// The engine's control frames (Hello, credit, a Want, the Close), queued.
    #[inline]
    pub(crate) fn control(&mut self) {
        if !self.session.control_quiet() {
            self.queue_control();
        }
    }

    fn queue_control(&mut self) {
        while let Some(c) = self.session.poll_control() {
            self.queued_bytes += HEADER_LEN;
            self.queue.push_back(Out {
                header: c.header,
                payload: Payload::None,
                sent: 0,
            });
        }
    }

    /// Writes what is queued, as far as the ring has room. Whether anything moved.
    #[inline]
    pub(crate) fn flush(&mut self, peer: PeerId) -> Result<bool, Error> {
        // The common look (after every read): nothing queued, handed over
        // or out in the peer's hands.
        let idle = self.queue.is_empty()
            && self.handover.is_none()
            && self.placed.is_empty()
            && self.device_in_flight() == 0;
        if idle && !self.broken {
            return Ok(false);
        }
        self.flush_out(peer)
    }

    fn flush_out(&mut self, peer: PeerId) -> Result<bool, Error> {
        if self.broken {
            return Err(Self::bad_claim(peer));
        }
        let mut any = self.release_device(peer)? | self.release_placed(peer)?;
        if self.handover.is_some() {
            // A handover that ended is progress: the sender's next message may go.
            match self.poll_handover(peer, None)? {
                Handed::Waiting => return Ok(any), // nothing goes ahead of it
                Handed::Done | Handed::Inline => any = true,
            }
        }
        if self.direct.is_some() {
            return Ok(any); // a caller is mid-frame from its slice; ours go after it
        }
        while let Some(o) = self.queue.front_mut() {
            let total = o.len();
            let (h, p) = if o.sent < HEADER_LEN {
                (&o.header[o.sent..], o.payload.bytes())
            } else {
                (&[][..], &o.payload.bytes()[o.sent - HEADER_LEN..])
            };
            let m = self.tx.write(&[h, p]).map_err(|c| Self::corrupt(peer, c))?;
            if m.wake {
                handshake::ring(&self.link);
            }
            o.sent += m.n;
            self.queued_bytes -= m.n;
            any |= m.n > 0;
            if o.sent < total {
                break;
            }
            self.queue.pop_front();
        }
        Ok(any)
    }

    /// Reads frames into `arrivals` (at most `inbox` messages there),
    /// messages into leases of `pool`, and gives the room they took back
    /// to the peer once, after all of them (a long read also every 16 KiB
    /// on the way).
    pub(crate) fn read(
        &mut self,
        peer: PeerId,
        now: Instant,
        pool: &Arc<StdPool>,
        arrivals: &mut VecDeque<Result<Received<ShmLease>, Error>>,
        inbox: usize,
    ) -> Outcome {
        // Reads go by the ring's stamps; the head the sleep check found
        // impossible is looked at again here, and breaks the lane typed.
        if std::mem::take(&mut self.read_for_corrupt) {
            if let Err(c) = self.rx.available() {
                return Outcome::Bad(Self::corrupt(peer, c));
            }
        }
        let outcome = self.read_frames(peer, now, pool, arrivals, inbox);
        self.give_back_room();
        outcome
    }

    /// Gives the room of every byte read back to the peer, ringing it if
    /// it waits for room.
    fn give_back_room(&mut self) {
        if self.rx.publish() {
            handshake::ring(&self.link);
        }
    }

    fn read_frames(
        &mut self,
        peer: PeerId,
        now: Instant,
        pool: &Arc<StdPool>,
        arrivals: &mut VecDeque<Result<Received<ShmLease>, Error>>,
        inbox: usize,
    ) -> Outcome {
        let protocol = |error| Outcome::Bad(Error::Protocol { peer, error });
        // Once a read, not once a frame: each look at the copies costs a
        // driver call, and the copies queued in this read share one event.
        if let Err(e) = self.deliver_device(peer, arrivals) {
            return Outcome::Bad(e);
        }
        self.held = false;
        loop {
            if arrivals.len() >= inbox {
                self.held = true;
                return Outcome::Stopped;
            }
            // 1. The payload of the frame whose header the engine took.
            #[cfg(feature = "cuda-uma")]
            if let Some(Incoming {
                d,
                stage: Stage::Device { have },
                ..
            }) = self.incoming.as_mut()
            {
                use super::device::DESC_BYTES;
                if *have < DESC_BYTES {
                    match self.rx.read(&mut self.device_desc[*have..]) {
                        Ok(n) => *have += n,
                        Err(c) => return Outcome::Bad(Self::corrupt(peer, c)),
                    }
                    if *have < DESC_BYTES {
                        return Outcome::Drained;
                    }
                }
                // The engine passes device frames only to a lane with a GPU side.
                let Some(gpu) = self.gpu.as_mut() else {
                    return Outcome::Bad(Error::Backend(
                        "shm: a device frame on a lane without GPU",
                    ));
                };
                match gpu.start(peer, &self.device_desc, d.msg_len) {
                    Ok(true) => self.dry = false,
                    Ok(false) => {
                        self.dry = true;
                        return Outcome::Stopped;
                    }
                    Err(e) => return Outcome::Bad(e),
                }
                self.incoming = None;
                match self.session.handle_payload(now, None) {
                    Ok(Some(done)) => self.session.consumed(done.len),
                    Ok(None) => {
                        return Outcome::Bad(Error::Backend("shm: a fragment on a stream lane"))
                    }
                    Err(e) => return protocol(e),
                }
                continue;
            }
            if let Some(inc) = self.incoming.as_mut() {
                if inc.lease.is_none() {
                    // Leased once what it needs is there: a whole
                    // descriptor, or payload bytes in the ring. A record
                    // alone holds no buffer (hundreds of lanes could each
                    // hold one of the largest until their timeout).
                    let ready = match &mut inc.stage {
                        Stage::Desc { have, buf } => {
                            match self.rx.read(&mut buf[*have..]) {
                                Ok(n) => *have += n,
                                Err(c) => return Outcome::Bad(Self::corrupt(peer, c)),
                            }
                            *have == cma::DESC_BYTES
                        }
                        _ => match self.rx.available() {
                            Ok(n) => n > 0 || inc.d.len == 0,
                            Err(c) => return Outcome::Bad(Self::corrupt(peer, c)),
                        },
                    };
                    if !ready {
                        return Outcome::Drained;
                    }
                    match Lease::take(Arc::clone(pool), inc.d.msg_len.max(1)) {
                        Ok(mut l) => {
                            let _ = l.set_len(inc.d.msg_len);
                            inc.lease = Some(l);
                            self.dry = false;
                        }
                        Err(_) => {
                            self.dry = true;
                            return Outcome::Stopped;
                        }
                    }
                }
                // One view of the lease a frame: a view is a lookup in the pool's memory.
                let bytes = host_bytes_mut(inc.lease.as_mut().expect("leased above"));
                let want = inc.d.len;
                if let Stage::Desc { have, buf } = &mut inc.stage {
                    match self.rx.read(&mut buf[*have..]) {
                        Ok(n) => *have += n,
                        Err(c) => return Outcome::Bad(Self::corrupt(peer, c)),
                    }
                    if *have < cma::DESC_BYTES {
                        return Outcome::Drained;
                    }
                    let Some(desc) = cma::Desc::parse(buf) else {
                        return Outcome::Bad(Self::bad_claim(peer));
                    };
                    let (ring, link) = (&self.rx, &self.link);
                    let dst = &mut bytes[..want];
                    let got = if desc.placed {
                        self.single_in.take_placed(peer, &desc, dst, (ring, link))
                    } else {
                        self.single_in.take_claimed(peer, &desc, dst, (ring, link))
                    };
                    if ring.writer_waits() {
                        handshake::ring(link);
                    }
                    match got {
                        Ok(true) => inc.have = want,
                        Ok(false) => {} // its bytes follow in the ring
                        Err(e) => {
                            if self.single_in.stuck {
                                // The peer may still write into it.
                                self.stuck = self.incoming.take().and_then(|i| i.lease);
                            }
                            return Outcome::Bad(e);
                        }
                    }
                    inc.stage = Stage::Inline;
                }
                if inc.have < want {
                    match self.rx.read(&mut bytes[inc.have..want]) {
                        Ok(n) => {
                            inc.have += n;
                            if inc.have < want {
                                return Outcome::Drained;
                            }
                        }
                        Err(c) => return Outcome::Bad(Self::corrupt(peer, c)),
                    }
                }
                let verdict = self.session.handle_payload(now, Some(&bytes[..want]));
                let lease = self.incoming.take().and_then(|i| i.lease).expect("leased");
                if let Err(o) = self.delivered(peer, verdict, lease, arrivals) {
                    return o;
                }
                continue;
            }
            // 2. A header.
            if self.have < HEADER_LEN {
                let n = match self.rx.read(&mut self.header[self.have..]) {
                    Ok(n) => n,
                    Err(c) => return Outcome::Bad(Self::corrupt(peer, c)),
                };
                self.have += n;
                if self.have < HEADER_LEN {
                    if n > 0 {
                        // Part of a header: a frame has begun (its timer
                        // runs). Only bytes are news of the peer, not a look.
                        self.session.handle_activity(now, 0, true);
                    }
                    return Outcome::Drained;
                }
            }
            self.have = 0;
            if let Some(taken) = self.session.handle_short_record(now, &self.header) {
                // A whole message's header, in effect: its payload follows.
                let d = match taken {
                    Ok(d) => d,
                    Err(e) => return protocol(e),
                };
                self.control();
                let stage = self.host_stage(d.len);
                if !matches!(stage, Stage::Inline) {
                    self.incoming = Some(Incoming::new(d, stage));
                    continue;
                }
                // A message in the ring (a small one, mostly) is read into
                // its lease here, in one step: what step 1 would do on the
                // next turn of the loop. A dry pool is met there.
                let Ok(mut lease) = Lease::take(Arc::clone(pool), d.msg_len.max(1)) else {
                    self.incoming = Some(Incoming::new(d, stage));
                    continue;
                };
                let _ = lease.set_len(d.msg_len);
                self.dry = false;
                let bytes = &mut host_bytes_mut(&mut lease)[..d.len];
                let have = match self.rx.read(bytes) {
                    Ok(n) => n,
                    Err(c) => return Outcome::Bad(Self::corrupt(peer, c)),
                };
                if have < d.len {
                    self.incoming = Some(Incoming {
                        d,
                        // None of its bytes yet: no buffer held (step 1).
                        lease: (have > 0).then_some(lease),
                        have,
                        stage,
                    });
                    return Outcome::Drained;
                }
                let verdict = self.session.handle_payload(now, Some(bytes));
                if let Err(o) = self.delivered(peer, verdict, lease, arrivals) {
                    return o;
                }
                continue;
            }
            let inbound = match self.session.handle_header(now, &self.header, None) {
                Ok(i) => i,
                Err(e) => return protocol(e),
            };
            match inbound {
                Inbound::Data(d) => {
                    if !d.first || !d.last {
                        return Outcome::Bad(Error::Backend("shm: a fragment on a stream lane"));
                    }
                    let stage = if d.device {
                        device_stage()
                    } else {
                        self.host_stage(d.len)
                    };
                    self.incoming = Some(Incoming::new(d, stage));
                }
                Inbound::Closed => self.arrive(arrivals, Err(Error::PeerClosed(peer))),
                Inbound::Want => self.session.grant(now),
                // A lane runs no same-host exchange (`HostRole::None`): the
                // engine refuses Host frames itself.
                Inbound::Control
                | Inbound::Opened
                | Inbound::HostOffer(_)
                | Inbound::HostAnswer { .. } => {}
            }
            self.control();
        }
    }

    /// Where a host message of `len` bytes comes from: a descriptor for a
    /// single copy, or the ring.
    fn host_stage(&self, len: usize) -> Stage {
        if self.single_in.cma && len >= self.single_min {
            Stage::Desc {
                have: 0,
                buf: [0; cma::DESC_BYTES],
            }
        } else {
            Stage::Inline
        }
    }

    /// Takes the peer for another user's process (see `offers_tails`).
    #[cfg(feature = "testing")]
    pub(crate) fn peer_of_another_user(&mut self) {
        self.single_in.offers_tails = false;
    }

    /// Whether the peer's end of the link is still there (a peer killed
    /// mid-message hangs it up: the kernel closes its descriptors). Asked
    /// of the socket's state, not of bytes on it: rings wait there unread
    /// whether the peer lives or not.
    pub(crate) fn alive(&self) -> bool {
        use rustix::event::PollFlags;
        match crate::poller::ready_now(&self.link, PollFlags::RDHUP) {
            Ok(ev) => !ev.intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR),
            Err(rustix::io::Errno::INTR) => true, // asked again at the next look
            Err(_) => false,
        }
    }

    /// A read of this lane while no thread sleeps: the rings a sleep that
    /// ended left on the link are taken (left there, they would keep every
    /// waiter on the wire's level-triggered set awake while the lane is
    /// busy), and the peer asked to ring no more. One system call after
    /// each sleep, none otherwise.
    #[inline]
    pub(crate) fn take_rings(&mut self) {
        if self.rings_left {
            self.rings_left = false;
            self.rx.woke();
            handshake::drain(&self.link);
        }
    }

    /// The link: rings and the hang-up (the wire watches it in its lanes'
    /// epoll set, for a sleeper and for an armed lane).
    pub(crate) fn link(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.link.as_fd()
    }

    /// Whether nothing moved either way (bytes taken, bytes written) for
    /// `after`, as the side passes saw it, this one at `now` included.
    pub(crate) fn still_for(&mut self, now: Instant, after: Duration) -> bool {
        let moved = (self.rx.taken(), self.tx.written());
        if moved != self.moved {
            self.moved = moved;
            self.moved_at = now;
        }
        now >= self.moved_at.after(after)
    }

    /// Asks the peer to ring for anything it writes, as a sleeper does, for
    /// a lane with nothing under way either way: `true`, the lane is armed
    /// (reads may skip it until its link rings). `false`: not now (bytes
    /// came meanwhile, or something waits); the flag is taken back unless
    /// a sleeper set it too (`sleeping`).
    pub(crate) fn arm(&mut self, sleeping: bool) -> bool {
        let idle = self.quiet()
            && !self.has_unsent()
            && self.placed.is_empty()
            && !self.waiting_room
            && !self.dry
            && !self.held
            && self.session.is_open();
        if !idle {
            return false;
        }
        handshake::drain(&self.link);
        self.rings_left = false;
        // The flag first (its fence), then the second look at the ring.
        match self.rx.prepare_sleep() {
            Ok(false) => {
                self.armed = true;
                return true;
            }
            Ok(true) => {}
            // An impossible counter: the next read breaks the lane, typed.
            Err(_) => self.read_for_corrupt = true,
        }
        if !sleeping {
            self.rx.woke();
        }
        false
    }

    /// Its link rang (or this side calls on it): reads look at it again.
    /// While a thread sleeps (`sleeping`) the flag and the rings on the
    /// link stay, for that thread; else both are taken ([`take_rings`]).
    ///
    /// [`take_rings`]: Lane::take_rings
    pub(crate) fn disarm(&mut self, now: Instant, sleeping: bool) {
        self.armed = false;
        self.moved_at = now; // not armed again before it has been still a while
        self.rings_left = true;
        if !sleeping {
            self.take_rings();
        }
    }

    /// About to sleep: tells the peer to ring (for bytes, and for room if
    /// frames wait for it). `true`: something came meanwhile, do not sleep
    /// (bytes to read only for a sleeper that `takes_bytes`).
    pub(crate) fn prepare_sleep(&mut self, takes_bytes: bool) -> bool {
        handshake::drain(&self.link);
        self.rings_left = false;
        // Each read pass gives back the room it took; nothing read may
        // stay held while this side sleeps (the peer may wait for it).
        self.give_back_room();
        // A quiet lane's ring is judged by its next stamp alone, and reads
        // go by stamps; its counter is looked at here. Impossible: not
        // quiet, so the next pass reads it and the read says why (skipped,
        // the wire would not sleep and not look either: a spin).
        let bytes = match self.rx.prepare_sleep() {
            // Bytes a lane stopped for want of a buffer cannot take are no
            // reason to stay up (it spun on them, a core's worth): the wire
            // sleeps on its pool's bell too, rung when a buffer comes back.
            Ok(bytes) => bytes && !self.dry,
            Err(_) => {
                self.read_for_corrupt = true;
                true
            }
        };
        // Behind a handover nothing goes whatever the room: it waits for the
        // peer's claim word (the peer rings after moving it).
        let for_claim = self.handover.is_some();
        let for_room = !for_claim && (!self.queue.is_empty() || self.direct.is_some());
        let for_done = self.device_in_flight() > 0 || !self.placed.is_empty();
        self.waiting_room = for_room || for_claim || for_done;
        // The flag first (its fence), then the second look at what it waits for.
        let room = self.waiting_room && self.tx.prepare_wait().unwrap_or(true);
        (bytes && takes_bytes)
            || (for_room && room)
            || (for_claim && self.claim_moved())
            || (for_done && self.done_moved())
            || ((for_claim || for_done) && self.help_offered())
            || self.copying()
    }

    /// Whether the peer offers a tail of this side's for it to write (see
    /// [`cma`]): the sender's last look before it sleeps, after its flag,
    /// as the peer looks at the flag after its offer. Any other value of
    /// the word (a foreign ticket, an offer after a refused write) lets
    /// it sleep.
    fn help_offered(&self) -> bool {
        self.open_offer().is_some()
    }

    /// Whether the peer has moved the claim word of the handover this side
    /// waits on (copied the message, refused it, or broke the word): no
    /// need to sleep.
    fn claim_moved(&self) -> bool {
        self.handover
            .as_ref()
            .is_some_and(|h| !claim_waits(h.ticket, self.claim_word()))
    }

    /// The claim word of this side's single-copy messages.
    fn claim_word(&self) -> u64 {
        // Acquire: the peer's reads of our bytes happened before its done.
        self.tx
            .mem_ctl()
            .claim()
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether the peer has copied a placed or device message this side
    /// still holds (its buffer can go back), or is about to: no need to sleep.
    fn done_moved(&self) -> bool {
        let placed_done = || {
            self.tx
                .mem_ctl()
                .placed_done()
                .load(std::sync::atomic::Ordering::Acquire)
        };
        if self
            .placed
            .front()
            .is_some_and(|&(t, _)| t <= placed_done())
        {
            return true;
        }
        #[cfg(feature = "cuda-uma")]
        if let Some(gpu) = &self.gpu {
            return gpu.would_release(self.peer_device_done()) || gpu.done_due();
        }
        false
    }

    /// The peer is gone: copies under way out of its memory are waited for,
    /// and what they and the messages behind them hold goes to `arrivals`.
    pub(crate) fn settle_device(
        &mut self,
        peer: PeerId,
        arrivals: &mut VecDeque<Result<Received<ShmLease>, Error>>,
    ) -> Result<(), Error> {
        #[cfg(feature = "cuda-uma")]
        if let Some(gpu) = self.gpu.as_mut() {
            gpu.finish()?;
        }
        self.deliver_device(peer, arrivals)
    }

    /// Awake: no more rings needed until the next sleep. The reading flag
    /// stays up until a read of this lane takes it down ([`take_rings`]):
    /// a lane no read reaches keeps asking its peer to ring, for whichever
    /// thread reads next (the progress thread sleeps without asking).
    ///
    /// [`take_rings`]: Lane::take_rings
    pub(crate) fn woke(&mut self) {
        self.rings_left = true;
        if self.waiting_room {
            self.tx.done_waiting();
            self.waiting_room = false;
        }
    }

    /// Nothing for a read pass to do: no frame begun or queued, nothing
    /// out with the peer or copying, and no new bytes in its ring. A
    /// reader of many lanes skips these for the cost of one look at each
    /// peer's next stamp (its counter is looked at before sleeping).
    pub(crate) fn quiet(&self) -> bool {
        self.have == 0
            && self.incoming.is_none()
            && self.queue.is_empty()
            && self.direct.is_none()
            && self.handover.is_none()
            && !self.broken
            && !self.read_for_corrupt
            && !self.session.is_finished() // to be dropped by the pass
            && self.device_in_flight() == 0
            && !self.copying()
            && self.rx.is_drained()
    }

    /// Whether the session is over on both sides, with nothing left to write.
    pub(crate) fn finished(&self) -> bool {
        self.session.is_finished()
            && self.queue.is_empty()
            && self.direct.is_none()
            && self.handover.is_none()
            && self.placed.is_empty()
            && self.device_in_flight() == 0
            && !self.copying()
    }
}

/// The stage of a device frame: its descriptor comes first.
#[cfg(feature = "cuda-uma")]
fn device_stage() -> Stage {
    Stage::Device { have: 0 }
}

/// Without CUDA no lane takes device frames (the engine refuses them).
#[cfg(not(feature = "cuda-uma"))]
fn device_stage() -> Stage {
    Stage::Inline
}

/// What [`Lane::send`] sends: the caller's bytes, or a lease.
pub(crate) enum Source<'a> {
    Slice(&'a [u8]),
    Lease(StdLease),
}

/// A refused send: why, and the lease back (for a lease).
pub(crate) struct Refused {
    pub(crate) error: Error,
    pub(crate) lease: Option<StdLease>,
}

impl Source<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            Source::Slice(b) => b,
            Source::Lease(l) => host_bytes(l),
        }
    }

    fn refused(self, error: Error) -> Refused {
        Refused {
            error,
            lease: match self {
                Source::Slice(_) => None,
                Source::Lease(l) => Some(l),
            },
        }
    }
}

/// A lane dropped before its session finished (a lost or refused peer, an
/// idle timeout, `disconnect`) gives the buffers the peer may still be
/// copying — a claimed, placed or device message's — back to their pools at
/// once, where the next lease writes them. It says so first, in its ring's
/// `ended` word: the peer drops a message whose copy ends after it (see
/// [`SingleIn::kept`]) instead of delivering another message's bytes.
impl Drop for Lane {
    fn drop(&mut self) {
        if !self.finished() {
            self.tx.mem_ctl().end();
        }
        // A buffer the peer may still write into, not taken by the wire
        // (`take_stuck`), never goes back to a pool that lives on.
        if let Some(lease) = self.stuck.take() {
            if !self.single_in.files.process_exited() {
                std::mem::forget(lease);
            }
        }
    }
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane")
            .field("addr", &self.addr)
            .field("queued_bytes", &self.queued_bytes)
            .finish_non_exhaustive()
    }
}
