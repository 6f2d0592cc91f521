//! The same-host lane (kind `shm`): peers that turn out to share this host
//! move their session from TCP to shared memory.
//!
//! [`LocalWire`] is a TCP wire ([`TcpTransport`]) that offers its host to
//! every listener it connects to, and takes such offers from peers that
//! connect to it (the same-host exchange of the session engine, right after
//! the Hellos, before any data). When the two identities match (boot id,
//! IPC, mount and network namespaces: `host`), the accepting side creates
//! a sealed memfd segment with a ring per direction (`segment`, `ring`),
//! passes it to the offering side over an abstract Unix socket
//! (`handshake`), whose connection stays as the lane's link, and answers
//! *accept*; both sides then drop
//! the TCP connection and run a fresh session over the rings (`lane`).
//! Peers elsewhere stay on TCP, in the same endpoint.
//!
//! The peer's id says which: lanes have the top bit set. An endpoint learns
//! of a peer only once its path is decided (the acceptor announces the lane,
//! the connector's `opened` answers with it), so no id changes under the
//! application.
//!
//! A receiver spins on the rings' counters (no system call); a sleeper
//! waits on the Unix link after telling the peer to ring it (a byte on the
//! link), and the link's hang-up reports a peer that died (SIGKILL
//! included) at once.
//!
//! A lane still for [`ARM_AFTER`] is armed: it asks its peer to ring, as a
//! sleeper does, and leaves the polls' reads and walks, so that many quiet
//! peers cost a spinning receiver nothing per poll. The links of the armed
//! lanes are in one epoll set (`armed_rings`), which readers look at every
//! [`RING_LOOK`] and at every pass: a ring or a hang-up brings its lane
//! back. Every lane's link is in another (`awake_rings`): an awake
//! one's for rings and its hang-up, an armed one's for its hang-up only
//! (so that a waiter that does not read learns of a dead peer, and is not
//! woken by rings it would leave unread). A sleeper waits on the two sets
//! (a reader) or on the second, whatever the number of lanes; both are
//! level-triggered, so that a sleeper sees what polling each link would
//! show, whichever thread looked at them last.

pub(crate) mod cma;
#[cfg(feature = "cuda-uma")]
pub(crate) mod device;
pub(crate) mod handshake;
pub(crate) mod host;
pub(crate) mod lane;
pub(crate) mod mapped;
#[cfg_attr(loom, allow(dead_code))]
pub(crate) mod ring;
pub(crate) mod segment;
#[cfg(feature = "testing")]
pub mod testing;

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use zerohop_backends::{host_bytes, PeerSlots, SessionClock};
use zerohop_core::session::{HostOffer, HostRole, Instant, SessionConfig, SessionStats};
use zerohop_core::{Bell, Capabilities, Error, Kind, PeerId, Received, Rejected, Transport};

use crate::endpoint::{pool_leaser, Leaser, Waiter, Wire};
use crate::host::{StdLease, StdPool};
use crate::tcp::{Dialed, TcpConfig, TcpTransport};
use crate::waiting_room::oldest_of_most_crowded;

use self::handshake::{LaneListener, Setup, SetupRead};
use self::lane::{Lane, Outcome, Source};
use self::segment::Segment;

pub use self::lane::SingleCopies;
pub use self::ring::Corrupt;
pub use self::segment::SegmentError;

/// Whether this host can give same-host lanes their memory: a sealed
/// memfd that maps (and an identity to offer).
pub fn probe(probe: &mut zerohop_core::Probe) {
    use zerohop_core::Prereq;
    match Segment::create(segment::MIN_RING_BYTES, cma::DEFAULT_MIN).and_then(|_| host::identity())
    {
        Ok(_) => probe.present(Prereq::Memfd, "sealed memfd maps; abstract Unix sockets"),
        Err(e) => probe.missing(Prereq::Memfd, &format!("memfd: {e}")),
    }
}

/// A buffer of the same-host wire: host memory (every peer), or GPU device
/// memory (a same-host peer, with `cuda-uma`: it crosses by CUDA IPC).
#[derive(Debug)]
pub enum ShmLease {
    /// Host memory, read as `&[u8]`.
    Host(StdLease),
    /// GPU device memory, read by a kernel through its `device_ptr()`.
    #[cfg(feature = "cuda-uma")]
    Device(zerohop_backends::cuda::DeviceLease),
}

impl ShmLease {
    /// The host buffer, if it is one.
    pub fn host(&self) -> Option<&StdLease> {
        match self {
            ShmLease::Host(l) => Some(l),
            #[cfg(feature = "cuda-uma")]
            ShmLease::Device(_) => None,
        }
    }

    /// The host buffer to fill, if it is one.
    pub fn host_mut(&mut self) -> Option<&mut StdLease> {
        match self {
            ShmLease::Host(l) => Some(l),
            #[cfg(feature = "cuda-uma")]
            ShmLease::Device(_) => None,
        }
    }

    /// The message's length.
    pub fn len(&self) -> usize {
        match self {
            ShmLease::Host(l) => l.len(),
            #[cfg(feature = "cuda-uma")]
            ShmLease::Device(l) => l.len(),
        }
    }

    /// Whether the message is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The top bit of a lane's [`PeerId`] (TCP peers never have it): the lane
/// table's tag.
pub const LANE_BIT: u32 = zerohop_backends::TAG_BIT;
/// Connections on the lane socket whose setup has not come, kept at most
/// (past it, the oldest of the user with the most go). Setups that came
/// wait for their TCP answer only when they answer an offer of this
/// side's, so those are bounded by its peers.
const MAX_PENDING: usize = 64;
/// How long a setup or its answer may keep the other waiting.
const SETUP_TIMEOUT: Duration = Duration::from_secs(5);
/// After a failed accept on the lane socket, the next try (as TCP's listener).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// An offer whose lane socket is full (its backlog flooded, or its owner
/// out of descriptors a while) is dialled again this often, for this long,
/// before this side declines it and the peer stays on TCP. Short: the
/// offering side's application waits for the answer within its connect
/// timeout, and a decline still connects it (over TCP) where a late answer
/// would not.
const DIAL_RETRY_EVERY: Duration = Duration::from_millis(10);
const DIAL_RETRY_FOR: Duration = Duration::from_millis(250);
/// How often a spinning receiver looks at the lanes' links (a dead peer
/// is seen at once by a sleeper; a spinner sees it within this).
const LINK_CHECK: Duration = Duration::from_millis(5);
/// How often the lanes accepted here are told to the TCP wire, for a full
/// listener's newcomers: a lane just quiet an idle timeout may wait this
/// much longer to be let go, and one that spoke within it may be let go
/// on what it was.
const OFFER_EVERY: Duration = Duration::from_millis(20);
/// One `try_recv` in this many looks at the clock, to move the TCP side, the
/// upgrades and the lanes' links along every [`SIDE_PERIOD`] (a spinning
/// receiver then pays no system call per poll).
const CLOCK_EVERY: u32 = 64;
const SIDE_PERIOD: Duration = Duration::from_millis(1);
/// A lane with nothing moved either way for this long is armed (see the
/// module docs): a peer that speaks more often than this stays read on
/// every poll, and one that speaks less pays a ring for its first frame.
const ARM_AFTER: Duration = Duration::from_millis(10);
/// How often the armed lanes are walked anyway: their timers (none is due
/// for a quiet open session), and a look at their rings for bytes that
/// came without a ring.
const ARMED_WALK: Duration = Duration::from_millis(100);
/// How often a spinning receiver looks whether an armed lane rang: its
/// first frame after a quiet spell waits up to this (and the side pass).
const RING_LOOK: Duration = Duration::from_micros(20);

/// A connection on the lane socket, waiting for its setup message.
#[derive(Debug)]
struct Link {
    stream: UnixStream,
    since: StdInstant,
    /// The user of the process at the other end (the kernel's word).
    uid: Option<u32>,
    /// Its setup came, and this process had no room for its descriptors.
    no_room: bool,
}

/// A same-host offer this side takes, whose lane socket was full: tried
/// again at `next`, declined once [`DIAL_RETRY_FOR`] has passed since `first`.
#[derive(Debug)]
struct Redial {
    peer: PeerId,
    offer: HostOffer,
    first: StdInstant,
    next: StdInstant,
}

/// Settings of the same-host lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShmConfig {
    /// Each direction's ring, in bytes (a power of two; default 4 MiB).
    pub ring_bytes: usize,
    /// Received messages held for the application before reading stops (default 4096).
    pub inbox_messages: usize,
    /// Bytes a lane's send queue may hold (beyond its ring) before a send
    /// says `WouldBlock` (default 16 MiB; one message larger than this is
    /// still taken when nothing is queued).
    pub send_queue_bytes: usize,
    /// A peer elsewhere is refused: `connect` fails unless the peer moves to
    /// shared memory (what an explicit `shm` asks). Off, it stays on TCP.
    pub required: bool,
    /// Messages of this many bytes and up are read by the receiver straight
    /// out of the sender's memory: a buffer of the sender's pool file out of
    /// the receiver's mapping of that file (`memcpy`; the sender goes on at
    /// once), anything else (a caller's slice always) by
    /// `process_vm_readv`, one message handed over at a time; smaller ones
    /// are copied through the ring (two copies, pipelined). The side that
    /// sets a lane up decides for both (default 32 KiB; at least 4 KiB).
    /// Which is faster depends on the host: on the 16-core H200 host the
    /// single copy by `process_vm_readv` won from 32 KiB (64 KiB at 11.3
    /// GB/s against 7.2 through the ring, 1 MiB at 14.3 against 8.3); on
    /// the 2-vCPU build VM the ring won up to 1 MiB in one set of
    /// alternating runs (64 KiB at 8.1–10.2 GB/s against 5.1–7.3, 1 MiB at
    /// 10.6–11.1 against 8.2–9.0) and drew in another (BENCHMARKS.md).
    pub single_copy_from: usize,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            ring_bytes: 4 << 20,
            inbox_messages: 4096,
            send_queue_bytes: 16 << 20,
            required: false,
            single_copy_from: cma::DEFAULT_MIN,
        }
    }
}

/// TCP, with its same-host peers in shared memory. See the module docs.
pub struct LocalWire {
    /// `Shm`, or `Uma` over a CUDA managed pool.
    kind: Kind,
    tcp: TcpTransport,
    config: ShmConfig,
    session: SessionConfig,
    offer: HostOffer,
    listener: LaneListener,
    /// The lane socket has connections to take (epoll said so, or the
    /// last accept failed and is retried then).
    accept_due: Option<StdInstant>,
    pool: Arc<StdPool>,
    lanes: PeerSlots<Box<Lane>>,
    /// The slots of the lanes that are not armed: what every poll reads and
    /// every side pass tends.
    awake: Vec<usize>,
    /// Every lane's link: the awake lanes' for rings and hang-ups, the
    /// armed ones' for hang-ups (see the module docs).
    awake_rings: crate::poller::EpollSet,
    /// The links of the armed lanes, keyed by the lane's id: a ring (or a
    /// hang-up) wakes the lane, for a reader.
    armed_rings: crate::poller::EpollSet,
    /// The last look's events of `armed_rings`.
    rang: Vec<crate::poller::Ready>,
    /// Rung when a pass leaves arrivals while an application thread sleeps
    /// (see `tell_sleepers`): a reader asleep in `recv` waits on it too.
    news: zerohop_backends::HostBell,
    /// When the armed lanes are next walked (see [`ARMED_WALK`]).
    next_armed_walk: StdInstant,
    /// When a spinning receiver next looks at the armed lanes' rings.
    next_ring_look: StdInstant,
    /// Receive buffers of ended lanes whose peer took a tail and never
    /// wrote it, each with the peer's pidfd: back to the pool once that
    /// process has exited (its late write could land there until then).
    stuck: Vec<(StdLease, Option<std::os::fd::OwnedFd>)>,
    /// Unix connections taken, waiting for their setup message.
    links: Vec<Link>,
    /// Offers taken whose lane socket was full, to dial again.
    redials: Vec<Redial>,
    /// Dials refused by a full lane socket, ever.
    redialled: u64,
    /// Setups received, by the TCP token they name, waiting for the answer.
    setups: HashMap<u32, (Setup, UnixStream, StdInstant)>,
    /// Peers this side connected to over TCP: token and address.
    dialed: HashMap<PeerId, (u32, SocketAddr)>,
    /// Accepted offers whose setup has not come yet: token -> TCP peer.
    awaiting: HashMap<u32, (PeerId, SocketAddr, StdInstant)>,
    /// A connecting side's peers that moved: the TCP id -> the lane's id
    /// (or why the move failed).
    moved: HashMap<PeerId, Result<PeerId, Error>>,
    accepted: VecDeque<(PeerId, SocketAddr)>,
    arrivals: VecDeque<Result<Received<ShmLease>, Error>>,
    /// The sessions' clock (see `now`).
    session_clock: SessionClock,
    polls: u32,
    next_link_check: StdInstant,
    /// When the lanes are next told to the TCP wire, for a full listener
    /// that may let a quiet one go for a newcomer (`offer_elsewhere`).
    next_offer: StdInstant,
    /// When a spinning receiver next moves the side work along.
    next_side: StdInstant,
    /// The lanes' timer looks: a long gap is the application's absence.
    looks: zerohop_backends::Looks,
    /// The time of the last side pass, for the lanes' reads.
    clock: Instant,
    /// The lane a read pass starts at, one further each pass: the inbox is
    /// shared, and lanes read first could otherwise fill it every pass.
    first_lane: usize,
    /// Application threads asleep on the lanes (between `prepare_sleep` and
    /// `woke`), which asked the peers to ring: the last to wake tells them
    /// it is awake. Never another thread's pass: the progress thread's, run
    /// while an application thread slept, once took the flags back from
    /// under it, and the peer rang no more (the sleeper slept out its poll
    /// interval: `a_sender_asleep_is_rung_to_write_the_tail_of_a_long_message`
    /// failed 4 times in 30 on its own).
    sleepers: u32,
    /// Lanes with bytes unsent (those [`tally`] marked): whether a send
    /// leaves work for the progress thread is one look, not one at every
    /// lane (which cost each send ~11 instructions an idle same-host peer).
    /// Every call that may change a lane's unsent bytes tallies it after.
    unsent_lanes: usize,
    /// A lane stopped for want of a buffer (host or device) at the last
    /// read: a sleeper that reads waits on the pools' bells too (see
    /// `look_at_pool`).
    dry: bool,
    closed: bool,
    /// Where device messages from same-host peers land (and what lets this
    /// side send them): lanes carry them only when it is set.
    #[cfg(feature = "cuda-uma")]
    device_pool: Option<Arc<zerohop_backends::cuda::DevicePool>>,
}

impl std::fmt::Debug for LocalWire {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalWire")
            .field("tcp", &self.tcp)
            .field("lanes", &self.lanes.count())
            .finish_non_exhaustive()
    }
}

impl LocalWire {
    /// A wire receiving into `pool` (TCP peers and lanes alike), offering
    /// this host to the listeners it connects to and taking the offers of
    /// peers that connect to it. `kind` is `Shm`, or `Uma` when `pool` is
    /// CUDA managed memory: the `uma` wire, whose peers on this host move
    /// to lanes as `shm`'s do, their messages landing in the managed pool.
    pub fn new(
        pool: Arc<StdPool>,
        mut tcp: TcpConfig,
        config: ShmConfig,
        kind: Kind,
    ) -> io::Result<LocalWire> {
        use zerohop_backends::HostBacked;
        let tcp_kind = match kind {
            Kind::Shm => Kind::Tcp,
            Kind::Uma if pool.host_memory().kind() == zerohop_core::MemKind::Managed => Kind::Uma,
            Kind::Uma => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "uma receives into CUDA managed memory: this pool is not",
                ))
            }
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "a wire with same-host lanes is of kind shm or uma",
                ))
            }
        };
        use std::hash::BuildHasher;
        let nonce =
            std::collections::hash_map::RandomState::new().hash_one(std::process::id()) as u32;
        let offer = host::offer(nonce)?;
        let listener = LaneListener::bind(&offer)?;
        tcp.same_host = Some(offer);
        tcp.takes_offers = true;
        let mut t = TcpTransport::new(Arc::clone(&pool), tcp, tcp_kind)?;
        // One pool for the lanes and the TCP side: one clear for both.
        t.leave_bell_to_owner();
        // Its readiness comes with the TCP side's: `accept` only then.
        t.watch(listener.fd())?;
        let max = u32::try_from(t.max_message()).unwrap_or(u32::MAX);
        let session = SessionConfig {
            window: u32::try_from(tcp.window).unwrap_or(u32::MAX),
            idle_timeout: tcp.idle_timeout,
            min_rate: tcp.min_rate,
            host: HostRole::None,
            // A whole message goes as a short record (`wire::ShortRecord`).
            takes_headerless: true,
            sends_headerless: true,
            ..SessionConfig::stream(max)
        };
        let now = StdInstant::now();
        Ok(LocalWire {
            kind,
            tcp: t,
            config,
            session,
            offer,
            listener,
            accept_due: None,
            pool,
            lanes: PeerSlots::new(true),
            awake: Vec::new(),
            awake_rings: crate::poller::EpollSet::new(false)?,
            armed_rings: crate::poller::EpollSet::new(false)?,
            rang: Vec::new(),
            news: zerohop_backends::HostBell::default(),
            next_armed_walk: now,
            next_ring_look: now,
            stuck: Vec::new(),
            links: Vec::new(),
            redials: Vec::new(),
            redialled: 0,
            setups: HashMap::new(),
            dialed: HashMap::new(),
            awaiting: HashMap::new(),
            moved: HashMap::new(),
            accepted: VecDeque::new(),
            arrivals: VecDeque::new(),
            session_clock: SessionClock::start(),
            polls: 0,
            next_link_check: now,
            next_offer: now,
            next_side: now,
            looks: zerohop_backends::Looks::default(),
            clock: Instant::from_micros(0),
            first_lane: 0,
            sleepers: 0,
            unsent_lanes: 0,
            dry: false,
            closed: false,
            #[cfg(feature = "cuda-uma")]
            device_pool: None,
        })
    }

    /// Same-host peers also carry messages in GPU device memory (sent
    /// from buffers of `pool`, received into it), by CUDA IPC. For lanes
    /// set up from now on.
    #[cfg(feature = "cuda-uma")]
    pub fn carry_device(&mut self, pool: Arc<zerohop_backends::cuda::DevicePool>) {
        self.device_pool = Some(pool);
    }

    /// A new lane with the GPU side this wire gives them, its Hello queued.
    fn equip(&self, lane: Lane) -> Lane {
        // A peer's pool files are as large as its budget allows; what this
        // side maps of them (and may be made to hold, see `mapped`) is
        // bounded by its own.
        let lane = lane.map_within(self.pool.config().budget.saturating_mul(2));
        #[cfg(feature = "cuda-uma")]
        if let Some(pool) = &self.device_pool {
            match device::LaneGpu::new(Arc::clone(pool)) {
                Ok(gpu) => return lane.with_gpu(gpu).start(),
                Err(e) => log::warn!("shm: a lane without device messages: {e}"),
            }
        }
        lane.start()
    }

    /// The TCP side (its listener, its peers elsewhere).
    pub fn tcp(&self) -> &TcpTransport {
        &self.tcp
    }

    /// Listens on `addr` (TCP; same-host peers then move). Refused once closed.
    pub fn listen(&mut self, addr: SocketAddr) -> io::Result<SocketAddr> {
        self.tcp.listen(addr)
    }

    /// Whether [`close`](Transport::close) was called: no new peers.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Where it listens.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.tcp.local_addr()
    }

    /// The second half of a connect (see [`TcpTransport::dial`]): the
    /// dialed connection becomes a TCP peer that offers this host;
    /// [`Wire::opened`] says where it ends up.
    pub fn attach(&mut self, dialed: Dialed) -> io::Result<PeerId> {
        let addr = dialed.addr();
        let peer = self.tcp.attach(dialed)?;
        if let Some(token) = self.tcp.peer_token(peer) {
            self.dialed.insert(peer, (token, addr));
        }
        Ok(peer)
    }

    /// The longest message it takes (what its Hellos tell peers).
    pub fn max_message(&self) -> usize {
        self.tcp.max_message()
    }

    /// Gives up on a peer this side connected to before its Hellos crossed
    /// (a connect that timed out): its TCP connection closes, an upgrade on
    /// its way is forgotten, and a lane it already moved to closes, with no
    /// event for a peer the application never had. Whether it was known.
    pub fn disconnect(&mut self, peer: PeerId) -> bool {
        let mut known = self.dialed.remove(&peer).is_some();
        let before = self.awaiting.len();
        self.awaiting.retain(|_, (p, _, _)| *p != peer);
        known |= self.awaiting.len() != before;
        if let Some(moved) = self.moved.remove(&peer) {
            known = true;
            if let Ok(lane) = moved {
                if self.lane(lane).is_some() {
                    // Silently: the application never had this peer.
                    if let Some(slot) = self.lanes.slot(lane) {
                        self.remove_lane(slot);
                    }
                }
            }
        }
        self.tcp.disconnect(peer) || known
    }

    /// Takes no connection on the lane socket for `pause`, as after a
    /// failed accept: tests play an offering side whose socket's backlog
    /// fills (a flood, or a process out of descriptors a while).
    #[cfg(feature = "testing")]
    pub fn pause_lane_accepts(&mut self, pause: Duration) {
        self.accept_due = Some(StdInstant::now() + pause);
    }

    /// Dials to a peer's lane socket that found it full, ever.
    #[cfg(feature = "testing")]
    pub fn redialled(&self) -> u64 {
        self.redialled
    }

    /// Writes `frame` (a header and its payload) into a lane's ring as it
    /// is, bypassing its session: what a broken peer sends, for tests.
    #[cfg(feature = "testing")]
    pub fn send_raw_frame(&mut self, peer: PeerId, frame: &[u8]) -> Result<(), Error> {
        if peer.0 & LANE_BIT == 0 {
            return self
                .tcp
                .send_raw_frame(peer, frame)
                .map_err(|_| Error::Backend("tcp: the forged frame did not go"));
        }
        self.wake_peer(peer);
        let l = self.lanes.get_mut(peer).ok_or(Error::UnknownPeer(peer))?;
        let r = l.write_raw(peer, frame);
        tally(&mut self.unsent_lanes, l);
        r
    }

    /// Tells a lane's peer that its device messages were copied through
    /// `ticket`, whether or not they were, past this side's reads: what a
    /// broken peer says, for tests.
    #[cfg(all(feature = "testing", feature = "cuda-uma"))]
    pub fn say_device_done(&mut self, peer: PeerId, ticket: u64) -> Result<(), Error> {
        self.wake_peer(peer);
        let l = self.lanes.get_mut(peer).ok_or(Error::UnknownPeer(peer))?;
        l.say_device_done(ticket);
        Ok(())
    }

    /// Same-host peers, in shared memory now.
    pub fn lane_count(&self) -> usize {
        self.lanes.count()
    }

    /// Lanes armed now: quiet ones that the polls skip until their link
    /// rings (see the module docs).
    #[cfg(feature = "testing")]
    pub fn armed_lanes(&self) -> usize {
        self.lanes.count() - self.awake.len()
    }

    /// How the single-copy messages of same-host peer `peer` have gone
    /// (`None`: no such lane).
    pub fn single_copies(&self, peer: PeerId) -> Option<SingleCopies> {
        self.lane(peer).map(Lane::single_copies)
    }

    fn now(&self) -> Instant {
        self.session_clock.now()
    }

    fn lane(&self, id: PeerId) -> Option<&Lane> {
        self.lanes.get(id).map(|l| &**l)
    }

    /// The new lane's id; `None` when every slot an id can name is taken.
    fn add_lane(&mut self, lane: Lane) -> Option<PeerId> {
        let accepted = lane.accepted.then_some(lane.addr.ip());
        let (slot, id) = self.lanes.insert(Box::new(lane)).ok()?;
        let l = self.lanes.at_mut(slot)?;
        if let Err(e) = self.awake_rings.add(l.link(), u64::from(id.0), true, false) {
            log::warn!("shm: a lane's link could not be watched: {e}");
            self.lanes.remove(slot);
            return None;
        }
        tally(&mut self.unsent_lanes, l);
        self.awake.push(slot);
        if let Some(ip) = accepted {
            self.tcp.keep_elsewhere(ip);
        }
        if self.sleepers > 0 {
            // Its peer rings for nobody yet: a sleeper looks again, and
            // asks it to before it sleeps.
            self.news.ring();
        }
        Some(id)
    }

    /// Debug builds: every lane with bytes unsent is counted, no other.
    fn check_tally(&self) {
        debug_assert_eq!(
            self.unsent_lanes,
            self.lanes
                .iter()
                .filter(|(_, l)| l.unsent_bytes() > 0)
                .count(),
            "a call that changed a lane's unsent bytes did not tally it"
        );
    }

    /// Takes a lane out of the wire (its unsent bytes out of the tally).
    fn remove_lane(&mut self, slot: usize) -> Option<(PeerId, Box<Lane>)> {
        let (id, lane) = self.lanes.remove(slot)?;
        if lane.tallied {
            self.unsent_lanes -= 1;
        }
        if lane.armed {
            self.armed_rings.remove(lane.link());
        } else if let Some(i) = self.awake.iter().position(|&s| s == slot) {
            self.awake.swap_remove(i);
        }
        self.awake_rings.remove(lane.link());
        if lane.accepted {
            self.tcp.let_go_elsewhere(id, lane.addr.ip());
        }
        Some((id, lane))
    }

    /// Removes a lane; an unclean end (the peer had not closed) is reported
    /// once as `PeerLost`. Its segment is unmapped, its descriptors closed.
    fn drop_lane(&mut self, slot: usize, error: Option<Error>) {
        // Its slot's next lane gets a new generation: the old id names
        // nothing. The lane's drop unmaps the segment and hangs its link up.
        let Some((id, mut lane)) = self.remove_lane(slot) else {
            return;
        };
        self.stuck.extend(lane.take_stuck());
        let error = error.or_else(|| (!lane.session.peer_closed()).then_some(Error::PeerLost(id)));
        // A lane that a connect has not taken yet (`opened`) ends that
        // connect: news of a peer nobody had reaches no one else.
        let connect = self
            .moved
            .iter_mut()
            .find(|(_, r)| matches!(r, Ok(l) if *l == id))
            .map(|(_, r)| r);
        if let Some(r) = connect {
            *r = Err(lane_end(id, error.unwrap_or(Error::PeerClosed(id))));
            return;
        }
        if let Some(e) = error {
            log::info!("shm: lane to {} ended: {e}", lane.addr);
            self.arrivals.push_back(Err(lane_end(id, e)));
        }
    }

    /// The upgrades: offers to take, setups to receive, answers to match.
    fn upgrade(&mut self) {
        let now = StdInstant::now();
        // Accepting side: take the offers of peers on this host, and those
        // whose lane socket was full, when they are due again.
        let mut due = Vec::new();
        self.redials.retain(|r| {
            let wait = r.next > now;
            if !wait {
                due.push((r.peer, r.offer, r.first));
            }
            wait
        });
        while let Some((peer, offer)) = self.tcp.take_offer() {
            due.push((peer, offer, now));
        }
        for (peer, offer, first) in due {
            self.answer_offer(peer, offer, first, now);
        }
        // Offering side: connections on the lane socket, and their setups.
        // Only when epoll says there are some: an accept that finds none
        // still makes and frees a socket in the kernel, on every pass.
        // A new edge during a pause after a failed accept leaves the pause.
        if self.tcp.take_watched() && self.accept_due.is_none() {
            self.accept_due = Some(now);
        }
        // The setups that came since the last pass first, before a flood
        // behind them could push them out.
        for link in std::mem::take(&mut self.links) {
            if let Some(link) = self.read_setup(link, now) {
                self.links.push(link);
            }
        }
        // A setup waiting for room for its descriptors goes first: another
        // accept would take one of them.
        let no_room = |links: &[Link]| links.iter().any(|l| l.no_room);
        while self.accept_due.is_some_and(|t| now >= t) && !no_room(&self.links) {
            match self.listener.accept() {
                Ok(Some(s)) => {
                    let uid = rustix::net::sockopt::socket_peercred(&s).ok();
                    let link = Link {
                        stream: s,
                        since: now,
                        uid: uid.map(|c| c.uid.as_raw()),
                        no_room: false,
                    };
                    // Its setup at once (a taker sends it just after its
                    // connect): a flood behind it must not push it out unread.
                    let Some(link) = self.read_setup(link, now) else {
                        continue;
                    };
                    if self.links.len() >= MAX_PENDING {
                        // Full: a flood of strangers that say nothing costs
                        // them their connections, not a peer its lane.
                        let waiting = self.links.iter().enumerate();
                        let waiting = waiting.map(|(i, l)| (i, l.uid, l.since));
                        if let Some(i) = oldest_of_most_crowded(waiting) {
                            // A last look: a setup that came meanwhile is
                            // taken, and one waiting for descriptors kept.
                            let last = self.links.remove(i);
                            if let Some(l) = self.read_setup(last, now).filter(|l| l.no_room) {
                                self.links.push(l);
                            }
                        }
                    }
                    self.links.push(link);
                }
                Ok(None) => self.accept_due = None,
                // Out of descriptors (EMFILE): the connection waits in the
                // backlog, and no new edge comes for it; retry after a pause.
                Err(e) => {
                    log::warn!("shm: accepting a lane connection failed: {e}; retrying in {ACCEPT_BACKOFF:?}");
                    self.accept_due = Some(now + ACCEPT_BACKOFF);
                }
            }
        }
        while let Some((peer, taken)) = self.tcp.take_answer() {
            let Some((token, addr)) = self.dialed.remove(&peer) else {
                continue;
            };
            if taken {
                self.awaiting.insert(token, (peer, addr, now));
            } else if self.config.required {
                self.tcp.disconnect(peer);
                self.moved.insert(
                    peer,
                    Err(Error::Backend(
                        "shm: the peer declined the lane (not on this host, takes no shared memory, or could not set it up), and shm was asked for",
                    )),
                );
            }
        }
        // Match each taken offer with its setup.
        let tokens: Vec<u32> = self.awaiting.keys().copied().collect();
        for token in tokens {
            if let Some((setup, link, _)) = self.setups.remove(&token) {
                let (peer, addr, _) = self.awaiting.remove(&token).expect("listed");
                let r = self.open_lane(addr, token, setup, link);
                self.moved.insert(peer, r);
            } else if self.awaiting[&token].2.elapsed() > SETUP_TIMEOUT {
                let (peer, _, _) = self.awaiting.remove(&token).expect("listed");
                self.moved.insert(peer, Err(Error::PeerLost(peer)));
            }
        }
        self.setups
            .retain(|_, (_, _, at)| at.elapsed() < SETUP_TIMEOUT);
    }

    /// Reads a lane connection's setup: taken (kept only for an offer of
    /// ours), or the link back while it may still come.
    fn read_setup(&mut self, mut link: Link, now: StdInstant) -> Option<Link> {
        match handshake::recv_setup(&link.stream) {
            Ok(SetupRead::Ready(setup)) => {
                // Only for an offer of ours (its answer may come before or
                // after): any local process can connect and send setups,
                // each holding a segment and a link here.
                let ours = self.awaiting.contains_key(&setup.token)
                    || self.dialed.values().any(|(t, _)| *t == setup.token);
                if ours {
                    self.setups.insert(setup.token, (setup, link.stream, now));
                }
                None
            }
            Ok(wait) if now.duration_since(link.since) < SETUP_TIMEOUT => {
                link.no_room = matches!(wait, SetupRead::NoRoom);
                Some(link)
            }
            Ok(_) | Err(_) => None,
        }
    }

    /// Accepting side: answers a same-host offer first made at `first` —
    /// taken, declined (the peer stays on TCP), or, while the offering
    /// side's lane socket is full, tried again later.
    fn answer_offer(&mut self, peer: PeerId, offer: HostOffer, first: StdInstant, now: StdInstant) {
        if self.closed || offer.host != self.offer.host {
            self.tcp.answer_offer(peer, false);
            return;
        }
        match self.take_offer(peer, offer) {
            Ok(true) => self.tcp.answer_offer(peer, true),
            Ok(false) if now.duration_since(first) < DIAL_RETRY_FOR => {
                self.redialled += 1;
                self.redials.push(Redial {
                    peer,
                    offer,
                    first,
                    next: now + DIAL_RETRY_EVERY,
                });
            }
            Ok(false) => {
                log::info!(
                    "shm: the lane socket of a peer on this host stayed full; it stays on tcp"
                );
                self.tcp.answer_offer(peer, false);
            }
            Err(e) => {
                log::info!(
                    "shm: could not share memory with a peer on this host ({e}); it stays on tcp"
                );
                self.tcp.answer_offer(peer, false);
            }
        }
    }

    /// Accepting side: connects to the offering side's lane socket, creates
    /// the segment, sends it over, and starts the lane
    /// (announced to the application). `Ok(false)`: the socket is full
    /// (`WouldBlock` on the dial), nothing made; any later error is an error.
    fn take_offer(&mut self, peer: PeerId, offer: HostOffer) -> io::Result<bool> {
        let token = self
            .tcp
            .peer_token(peer)
            .ok_or(io::ErrorKind::NotConnected)?;
        let addr = self
            .tcp
            .peer_addr(peer)
            .ok_or(io::ErrorKind::NotConnected)?;
        // The connection first: a full socket is dialled again, and a retry
        // should not make a segment each time. Only the dial is retried (an
        // `mmap` over the locked-memory limit says EAGAIN too).
        let link = match handshake::dial(&offer) {
            Ok(link) => link,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) => return Err(e),
        };
        let seg = Arc::new(Segment::create(
            self.config.ring_bytes,
            self.config.single_copy_from,
        )?);
        handshake::send_setup(&link, token, seg.fd())?;
        let now = self.now();
        let lane = Lane::new(addr, seg, true, link, self.session, 0, now);
        let lane = self.equip(lane);
        let id = self
            .add_lane(lane)
            .ok_or(io::Error::other("every lane slot is taken"))?;
        self.accepted.push_back((id, addr));
        Ok(true)
    }

    /// Offering side: maps the segment the peer sent and starts the lane.
    fn open_lane(
        &mut self,
        addr: SocketAddr,
        token: u32,
        setup: Setup,
        link: UnixStream,
    ) -> Result<PeerId, Error> {
        let seg = Segment::open(setup.segment).map_err(|e| {
            log::warn!("shm: the segment from {addr} was refused: {e}");
            Error::Backend("shm: the peer's segment was refused")
        })?;
        let now = self.now();
        let lane = Lane::new(addr, Arc::new(seg), false, link, self.session, token, now);
        let lane = self.equip(lane);
        self.add_lane(lane)
            .ok_or(Error::Backend("shm: every lane slot is taken"))
    }

    /// Reads every lane into the arrivals. Whether anything came: a
    /// message, or a frame that changed the session (credit for a blocked
    /// sender: a sender told "nothing moved" would sleep on it).
    fn read_lanes(&mut self) -> bool {
        let before = self.arrivals.len();
        let mut took = false;
        // The time as of the last side pass (every millisecond or so): idle
        // timers run in seconds, and a clock read per poll would cost a
        // spinning receiver a quarter of its time.
        let now = self.clock;
        // (Set again by each lane read below that stops for a buffer.)
        self.dry = false;
        let n = self.awake.len();
        self.first_lane = if self.first_lane + 1 < n {
            self.first_lane + 1
        } else {
            0
        };
        for k in 0..n {
            let i = match self.first_lane + k {
                i if i >= n => i - n,
                i => i,
            };
            // (A lane that ended left the list shorter: one may be skipped
            // this pass, none is lost.)
            let Some(&slot) = self.awake.get(i) else {
                continue;
            };
            // Most of many same-host peers say nothing most of the time.
            if self.lanes.entry(slot).is_some_and(|(_, l)| !l.quiet()) {
                took |= self.read_lane(slot, now);
            }
        }
        self.check_tally();
        took || self.arrivals.len() != before
    }

    /// Before a read pass looks at the pool, where the last stopped for
    /// want of a buffer (a lane or the TCP side): takes the pool's rings,
    /// so that a buffer given back after this look rings anew. Once for all
    /// of this wire's parts, which share the pool and its bell.
    fn look_at_pool(&mut self) {
        if self.dry || self.tcp.pool_dry() {
            self.pool.bell().clear();
        }
        #[cfg(feature = "cuda-uma")]
        if let (true, Some(device)) = (self.dry, &self.device_pool) {
            device.bell().clear();
        }
    }

    /// One lane's read and flush at `now`: whether it took, moved or
    /// delivered anything. A lane that broke or finished is dropped.
    fn read_lane(&mut self, slot: usize, now: Instant) -> bool {
        let Some((id, l)) = self.lanes.entry(slot) else {
            return false;
        };
        if self.sleepers == 0 {
            l.take_rings(); // (a sleeper may need them: only while none sleeps)
        }
        let before = self.arrivals.len();
        let taken = l.taken();
        let outcome = l.read(
            id,
            now,
            &self.pool,
            &mut self.arrivals,
            self.config.inbox_messages,
        );
        self.dry |= l.dry;
        if let Outcome::Bad(e) = outcome {
            self.drop_lane(slot, Some(e));
            return true;
        }
        let mut took = l.taken() != taken || self.arrivals.len() != before;
        match l.flush(id) {
            Ok(moved) => took |= moved,
            Err(e) => {
                self.drop_lane(slot, Some(e));
                return true;
            }
        }
        tally(&mut self.unsent_lanes, l);
        if l.finished() {
            self.drop_lane(slot, None);
        }
        took
    }

    /// Lanes a full listener let go for newcomers end, each with a Close
    /// (`ProtocolError::Evicted` here); every `OFFER_EVERY`, the lanes
    /// accepted here are told to the TCP wire, which judges them as its
    /// own peers when it needs a place (`TcpTransport::make_room`).
    fn let_go_lanes(&mut self) -> bool {
        let let_go = self.tcp.take_let_go();
        let any = !let_go.is_empty();
        let now = self.now();
        for id in let_go {
            let Some(slot) = self.lanes.slot(id) else {
                continue; // gone meanwhile (its place freed as it went)
            };
            self.wake_lane(slot); // (read here)
            let Some(l) = self.lanes.at_mut(slot) else {
                continue;
            };
            if l.session.peer_closed() {
                continue; // closing of its own: its end is news enough
            }
            // What it sent since the offer is delivered, within the inbox's
            // bound, device copies waited for.
            let mut tail = VecDeque::new();
            let room = self
                .config
                .inbox_messages
                .saturating_sub(self.arrivals.len());
            let read = l.read(id, now, &self.pool, &mut tail, room);
            let settled = l.settle_device(id, &mut tail);
            self.arrivals.extend(tail);
            let error = match read {
                lane::Outcome::Bad(e) => Some(e),
                _ => settled.err(),
            };
            if error.is_some() {
                self.drop_lane(slot, error);
                continue;
            }
            let Some((_, l)) = self.lanes.entry(slot) else {
                continue;
            };
            if l.session.peer_closed() {
                continue; // its Close was in the ring: its end is news enough
            }
            // A Close only behind everything it sent: a lane with more left
            // in its ring (the inbox full, the pool dry) is hung up without
            // one, and its side reads a lost peer, not a clean close.
            if l.quiet() {
                l.session.close();
                l.control();
                let _ = l.flush(id);
            }
            let error = zerohop_core::session::ProtocolError::Evicted;
            self.drop_lane(slot, Some(Error::Protocol { peer: id, error }));
        }
        any
    }

    /// Tells the TCP wire the lanes accepted here (every `OFFER_EVERY`),
    /// after the pass's reads and timers (their `last_heard` as fresh as
    /// this pass knows): none is quiet of its own accord in a pass back
    /// from the application's absence.
    fn offer_lanes(&mut self, came_back: bool) {
        let std_now = StdInstant::now();
        if std_now < self.next_offer {
            return;
        }
        self.next_offer = std_now + OFFER_EVERY;
        if !self.tcp.near_limits() {
            self.tcp.offer_elsewhere(Vec::new()); // (allocates nothing)
            return;
        }
        // This side holds them all back while its inbox is full or the
        // pool dry: none is quiet of its own accord then.
        let held = came_back || self.arrivals.len() >= self.config.inbox_messages || self.dry;
        let offered = self
            .lanes
            .iter()
            .filter(|(_, l)| l.accepted)
            .map(|(slot, l)| crate::tcp::Elsewhere {
                id: self.lanes.id(slot),
                ip: l.addr.ip(),
                quiet_since: self.session_clock.monotonic_us(l.session.last_heard()),
                its_own: !held && l.quiet() && !l.has_unsent() && l.session.is_open(),
                delivered: l.session.stats().messages_received > 0,
            })
            .collect();
        self.tcp.offer_elsewhere(offered);
    }

    /// Links (a dead peer), idle timers and queued frames of every lane.
    /// `arm_at_once`: idle lanes are armed now, not after [`ARM_AFTER`]
    /// (for the reading progress thread, which sleeps without asking the
    /// awake lanes' peers to ring: see `background_progress`).
    fn tend_lanes(&mut self, arm_at_once: bool) -> bool {
        if !self.stuck.is_empty() {
            // A buffer goes back once its writer is gone for good.
            self.stuck
                .retain(|(_, pidfd)| !pidfd.as_ref().is_some_and(mapped::exited));
        }
        let now = self.now();
        self.clock = now;
        let check = StdInstant::now() >= self.next_link_check;
        if check {
            self.next_link_check = StdInstant::now() + LINK_CHECK;
        }
        let away = zerohop_backends::absence(self.session.idle_timeout);
        let came_back = self.looks.came_back(StdInstant::now(), away);
        let mut any = self.let_go_lanes();
        // The awake lanes, each once (one that ended or was armed leaves
        // its place to the list's last).
        let mut i = 0;
        while let Some(&slot) = self.awake.get(i) {
            any |= self.tend_lane(slot, now, came_back, check);
            if self.arm(slot, now, arm_at_once) {
                self.awake.swap_remove(i);
            } else if self.awake.get(i) == Some(&slot) {
                i += 1;
            }
        }
        // The armed ones now and then, and after the application's absence
        // (their sessions hear of it).
        if came_back || StdInstant::now() >= self.next_armed_walk {
            self.next_armed_walk = StdInstant::now() + ARMED_WALK;
            for slot in 0..self.lanes.len() {
                let Some(l) = self.lanes.at_mut(slot).filter(|l| l.armed) else {
                    continue;
                };
                if !l.quiet() {
                    self.wake_lane(slot); // bytes came without a ring
                }
                any |= self.tend_lane(slot, now, came_back, false);
                if self
                    .lanes
                    .at(slot)
                    .is_some_and(|l| l.armed && l.has_unsent())
                {
                    self.wake_lane(slot); // a frame its timers queued waits for room
                }
            }
        }
        self.offer_lanes(came_back);
        any
    }

    /// Lane `slot`'s timers, control frames and queued bytes (and with
    /// `check`, its link's state): whether anything moved. A lane that
    /// broke or whose peer is gone is dropped.
    fn tend_lane(&mut self, slot: usize, now: Instant, came_back: bool, check: bool) -> bool {
        let mut any = false;
        // A peer is judged on what it sent, read first.
        if self
            .lanes
            .entry(slot)
            .is_some_and(|(_, l)| l.due_unread(now))
        {
            any |= self.read_lane(slot, now);
        }
        let Some((id, l)) = self.lanes.entry(slot) else {
            return any;
        };
        l.control();
        match l.flush(id) {
            Ok(moved) => any |= moved,
            Err(e) => {
                self.drop_lane(slot, Some(e));
                return any;
            }
        }
        if let Err(error) = l.tend(now, came_back) {
            self.drop_lane(slot, Some(Error::Protocol { peer: id, error }));
            return any;
        }
        tally(&mut self.unsent_lanes, l);
        if check && !l.alive() {
            // Its end hung up: whatever it sent is in the ring; take it first.
            let mut tail = VecDeque::new();
            let read = l.read(id, now, &self.pool, &mut tail, usize::MAX);
            // Device copies out of its memory: waited for, delivered
            // with what came behind them (else they are lost, and the
            // peer with them).
            let settled = l.settle_device(id, &mut tail);
            self.arrivals.extend(tail);
            // The read's failure first: one that dropped a Close held
            // behind device copies (the peer ended its ring) must be
            // the peer's one event, or it would have none.
            let error = match read {
                lane::Outcome::Bad(e) => Some(e),
                _ => settled.err(),
            };
            self.drop_lane(slot, error);
            any = true;
        }
        any
    }

    /// Arms lane `slot` if it has been still for [`ARM_AFTER`] (or
    /// `at_once`) and nothing is under way (see the module docs): its link
    /// moves to the armed set. Whether it did (the caller takes it out of
    /// `awake`).
    fn arm(&mut self, slot: usize, now: Instant, at_once: bool) -> bool {
        let sleeping = self.sleepers > 0;
        let Some((id, l)) = self.lanes.entry(slot) else {
            return false;
        };
        let still = l.still_for(now, ARM_AFTER) || at_once;
        if !still {
            return false;
        }
        if !l.arm(sleeping) {
            // Its drain may have taken a ring that came with new bytes, and
            // woken a sleeper for: the bytes are news for it.
            if sleeping && !l.quiet() {
                self.news.ring();
            }
            return false;
        }
        let key = u64::from(id.0);
        let moved = self.armed_rings.add(l.link(), key, true, false);
        let moved = moved.and_then(|()| {
            self.awake_rings
                .modify(l.link(), key, false)
                .inspect_err(|_| {
                    self.armed_rings.remove(l.link());
                })
        });
        if let Err(e) = moved {
            log::debug!("shm: a quiet lane stays awake: {e}");
            l.disarm(now, sleeping);
            return false;
        }
        true
    }

    /// Takes the rings and hang-ups of the armed lanes' links: a lane whose
    /// link hung up is looked at now, and for a `reader` (which reads the
    /// lanes next) a lane that rang is awake again (else its ring stays
    /// for one). Whether a lane woke or ended.
    fn look_at_rings(&mut self, reader: bool) -> bool {
        if self.awake.len() == self.lanes.count() {
            return false; // none armed: no system call
        }
        let mut rang = std::mem::take(&mut self.rang);
        rang.clear();
        if let Err(e) = self.armed_rings.ready(&mut rang) {
            log::warn!("shm: epoll_wait on the lanes' links failed: {e}");
        }
        let mut any = false;
        for r in &rang {
            let Some(slot) = u32::try_from(r.key)
                .ok()
                .and_then(|k| self.lanes.slot(PeerId(k)))
            else {
                continue; // gone meanwhile
            };
            if r.hup {
                any |= self.wake_lane(slot);
                any |= self.tend_lane(slot, self.clock, false, true);
            } else if reader {
                any |= self.wake_lane(slot);
            }
        }
        self.rang = rang;
        any
    }

    /// Lane `slot` is read by every poll again, if it was armed: its link
    /// rang, or this side calls on it. The rings on its link are taken
    /// only while no application thread sleeps: one asleep may have been
    /// woken by them, and finds them still there when it looks (it takes
    /// them before it sleeps again). Whether it was armed.
    fn wake_lane(&mut self, slot: usize) -> bool {
        let (now, sleeping) = (self.clock, self.sleepers > 0);
        match self.lanes.entry(slot) {
            Some((id, l)) if l.armed => {
                self.armed_rings.remove(l.link());
                if let Err(e) = self.awake_rings.modify(l.link(), u64::from(id.0), true) {
                    // (Its sleepers then learn of it by the poll interval.)
                    log::warn!("shm: a lane's link could not be watched: {e}");
                }
                l.disarm(now, sleeping);
                self.awake.push(slot);
                true
            }
            _ => false,
        }
    }

    /// The lane `peer` names is awake (see [`wake_lane`](Self::wake_lane))
    /// before a call into it: what the call leaves to do, the walks do.
    fn wake_peer(&mut self, peer: PeerId) {
        if let Some(slot) = self.lanes.slot(peer) {
            self.wake_lane(slot);
        }
    }

    /// No application thread sleeps on the lanes any more: the peers need
    /// not ring (but for the armed lanes'), and stop once their lane is
    /// read (`Lane::woke`: one no read reaches rings for the next reader).
    fn lanes_awake(&mut self) {
        for &slot in &self.awake {
            if let Some(l) = self.lanes.at_mut(slot) {
                l.woke(); // (its unsent bytes stay as they were)
            }
        }
    }

    /// What waits for `try_recv` now: the arrivals' length, and whether
    /// the TCP side holds any (see [`tell_sleepers`](Self::tell_sleepers)).
    fn arrivals_mark(&self) -> (usize, bool) {
        (self.arrivals.len(), self.tcp.has_arrivals())
    }

    /// An application thread asleep (in `recv`, maybe) hears of arrivals
    /// since `before` (an [`arrivals_mark`](Self::arrivals_mark)) by the
    /// `news` bell: the hang-up or ring that woke it may have been taken
    /// by the pass that left them.
    fn tell_sleepers(&self, before: (usize, bool)) {
        let grew = self.arrivals.len() > before.0 || (self.tcp.has_arrivals() && !before.1);
        if grew && self.sleepers > 0 {
            self.news.ring();
        }
    }

    fn pass(&mut self) -> bool {
        // (`progress` runs it for threads that do not read, too.)
        let mark = self.arrivals_mark();
        self.look_at_pool();
        let mut any = self.tcp.progress().unwrap_or(false);
        // The lanes are read before new ones are set up: a lane is never
        // announced and read in one `try_recv`, so an application that
        // looks at what was accepted first (`next_event`) learns of the
        // peer before its first message (under load the peer could write
        // between the two).
        any |= self.look_at_rings(true);
        any |= self.read_lanes();
        self.upgrade();
        any |= self.tend_lanes(false);
        self.tell_sleepers(mark);
        any
    }
}

/// What the application hears of lane `id` that ended with `e`: always
/// news of that peer (a lost or closed peer's event), never an error of the
/// whole wire. A rule the peer broke, told as the backend's, is that rule;
/// a failure of this side's (a device copy, say) is the peer's loss, its
/// cause logged by the caller.
fn lane_end(id: PeerId, e: Error) -> Error {
    match e {
        e if e.ended_peer() == Some(id) => e,
        Error::Backend(rule) => Error::WireRule { peer: id, rule },
        _ => Error::PeerLost(id),
    }
}

/// Counts `l` in `unsent_lanes` while it has bytes unsent, after a call
/// that may have changed them (see `LocalWire::unsent_lanes`).
#[inline]
fn tally(unsent_lanes: &mut usize, l: &mut Lane) {
    let unsent = l.has_unsent();
    if unsent != l.tallied {
        l.tallied = unsent;
        if unsent {
            *unsent_lanes += 1;
        } else {
            *unsent_lanes -= 1;
        }
    }
}

impl Drop for LocalWire {
    fn drop(&mut self) {
        // A buffer whose writer may still live is left out for good: given
        // back, a late write of that peer's would land in another message.
        for (lease, pidfd) in self.stuck.drain(..) {
            if !pidfd.as_ref().is_some_and(mapped::exited) {
                std::mem::forget(lease);
            }
        }
    }
}

impl Transport for LocalWire {
    type Lease = ShmLease;

    fn kind(&self) -> Kind {
        self.kind
    }

    fn caps(&self) -> Capabilities {
        Capabilities::new(self.kind == Kind::Uma, true, 1)
    }

    fn try_send(&mut self, peer: PeerId, bytes: &[u8]) -> Result<(), Error> {
        if peer.0 & LANE_BIT == 0 {
            return self.tcp.try_send(peer, bytes);
        }
        if self.closed {
            return Err(Error::Closed);
        }
        let limit = self.config.send_queue_bytes;
        self.wake_peer(peer);
        let l = self.lanes.get_mut(peer).ok_or(Error::UnknownPeer(peer))?;
        let r = l.send(peer, Source::Slice(bytes), false, limit);
        tally(&mut self.unsent_lanes, l);
        r.map(|_| ()).map_err(|r| r.error)
    }

    fn try_send_lease(&mut self, peer: PeerId, lease: ShmLease) -> Result<(), Rejected<ShmLease>> {
        #[allow(clippy::result_large_err)] // the lease comes back whole
        let refused = |error, lease| Err(Rejected { error, lease });
        if peer.0 & LANE_BIT == 0 {
            return match lease {
                ShmLease::Host(l) => self.tcp.try_send_lease(peer, l).map_err(|r| Rejected {
                    error: r.error,
                    lease: ShmLease::Host(r.lease),
                }),
                #[cfg(feature = "cuda-uma")]
                device => refused(
                    Error::Backend("a device buffer goes only to a peer on this host (shm)"),
                    device,
                ),
            };
        }
        if self.closed {
            return refused(Error::Closed, lease);
        }
        let limit = self.config.send_queue_bytes;
        self.wake_peer(peer);
        let Some(l) = self.lanes.get_mut(peer) else {
            return refused(Error::UnknownPeer(peer), lease);
        };
        let r = match lease {
            ShmLease::Host(lease) => l
                .send(peer, Source::Lease(lease), false, limit)
                .map(|_| ())
                .map_err(|r| Rejected {
                    error: r.error,
                    lease: ShmLease::Host(r.lease.expect("a lease comes back as a lease")),
                }),
            #[cfg(feature = "cuda-uma")]
            ShmLease::Device(lease) => l.send_device(peer, lease).map_err(|(error, l)| Rejected {
                error,
                lease: ShmLease::Device(l),
            }),
        };
        tally(&mut self.unsent_lanes, l);
        r
    }

    fn try_recv(&mut self) -> Result<Received<ShmLease>, Error> {
        if self.arrivals.is_empty() {
            self.look_at_pool();
            self.polls = self.polls.wrapping_add(1);
            let look = self.polls % CLOCK_EVERY == 0;
            // (A redial is due within milliseconds: every poll looks then.)
            let now = (look || !self.redials.is_empty()).then(StdInstant::now);
            let side = now.is_some_and(|now| now >= self.next_side);
            if side {
                self.next_side = StdInstant::now() + SIDE_PERIOD;
                self.pass();
            } else if self.tcp.has_host_news() {
                // (Read by the last poll: a peer's offer, say, answered now;
                // after the reads, as in `pass`.)
                self.read_lanes();
                self.upgrade();
            } else {
                // Armed lanes: did one ring? (A system call, so not at every
                // clock look: a spinning receiver pays it once a RING_LOOK.)
                let armed = self.awake.len() < self.lanes.count();
                if let Some(now) = now.filter(|&now| armed && now >= self.next_ring_look) {
                    self.next_ring_look = now + RING_LOOK;
                    self.look_at_rings(true);
                }
                self.read_lanes();
            }
            // TCP peers are read when there are any (else its epoll would
            // cost a system call on every poll of a lane), and what the TCP
            // side holds is taken: the end of its last peer, found by a pass.
            if self.arrivals.is_empty() && (self.tcp.peers_left() > 0 || self.tcp.has_arrivals()) {
                match self.tcp.try_recv() {
                    Ok(m) => {
                        return Ok(Received {
                            peer: m.peer,
                            lease: ShmLease::Host(m.lease),
                        })
                    }
                    Err(Error::WouldBlock) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        match self.arrivals.pop_front() {
            Some(r) => r,
            None if self.closed && self.tcp.peers_left() == 0 && self.lane_count() == 0 => {
                Err(Error::Closed)
            }
            None => Err(Error::WouldBlock),
        }
    }

    fn progress(&mut self) -> Result<bool, Error> {
        Ok(self.pass())
    }

    fn close(&mut self) -> Result<(), Error> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        self.tcp.close()?;
        for slot in 0..self.lanes.len() {
            self.wake_lane(slot); // its Close goes by the walks
            if let Some((id, l)) = self.lanes.entry(slot) {
                l.session.close();
                l.control();
                let _ = l.flush(id);
                tally(&mut self.unsent_lanes, l);
            }
        }
        Ok(())
    }
}

impl Wire for LocalWire {
    const WAKES_POLL: bool = true;

    fn leaser(&self) -> Leaser<ShmLease> {
        let host = pool_leaser(Arc::clone(&self.pool));
        Box::new(move |len| host(len).map(ShmLease::Host))
    }

    fn lease_bell(&self) -> Option<zerohop_backends::HostBell> {
        self.pool.bell().try_clone()
    }

    fn read_lease(&self, lease: &ShmLease, out: &mut [u8]) -> Result<(), Error> {
        match lease {
            ShmLease::Host(l) => crate::endpoint::copy_out(host_bytes(l), out),
            #[cfg(feature = "cuda-uma")]
            ShmLease::Device(l) => zerohop_backends::cuda::read_lease(l, out),
        }
    }

    fn poll_fds(&self, out: &mut Vec<libc::pollfd>, waiter: Waiter) {
        // (The lane socket wakes a sleeper through the TCP side's epoll
        // set, edge-triggered: a connection left in its backlog while
        // accepts pause does not keep waking it.)
        self.tcp.poll_fds(out, waiter);
        // (A link whose setup waits for room stays readable: the next pass
        // on the poll interval looks again.)
        for link in self.links.iter().filter(|l| !l.no_room) {
            out.push(libc::pollfd {
                fd: link.stream.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        // The lanes' links, in two sets: a ring, a hang-up. The armed
        // lanes' for a waiter that reads (as TCP's data set: the progress
        // thread leaves them to an application that reads for itself).
        let set = |fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // Both whatever is armed now: another thread's pass may arm or wake
        // a lane while this one sleeps.
        // (Even with no lane yet: another thread's pass may add one.)
        out.push(set(self.awake_rings.fd()));
        if waiter.reads() {
            out.push(set(self.armed_rings.fd()));
        }
        // (Not the progress thread: the bell is cleared by an application
        // thread about to sleep in `recv`, and would keep it spinning.)
        if waiter == (Waiter::App { reading: true }) {
            out.extend(self.news.fd().map(set));
        }
        if (self.dry || self.tcp.pool_dry()) && waiter.reads() {
            let bell = |fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            out.extend(self.pool.bell().fd().map(bell));
            // A lane stopped for a device buffer: the device pool's bell.
            #[cfg(feature = "cuda-uma")]
            if let (true, Some(device)) = (self.dry, &self.device_pool) {
                out.extend(device.bell().fd().map(bell));
            }
        }
    }

    fn prepare_sleep(&mut self, waiter: Waiter) -> bool {
        if waiter == (Waiter::App { reading: true }) {
            self.news.clear(); // before the look at the arrivals
        }
        let mut any = self.tcp.prepare_sleep(waiter)
            || (waiter == Waiter::App { reading: true } && !self.arrivals.is_empty());
        // Same-host news this thread's reads took: not slept on.
        if self.tcp.has_host_news() {
            self.upgrade();
            any = true;
        }
        // Bytes in a lane's ring keep awake a waiter that would read them,
        // and one waiting to send, connect or close while the inbox has
        // room (its next pass reads them: they may be the credit or the
        // Hello it waits for, written before its flag, so never rung); not
        // while the inbox is full (a lane held by it has bytes for as long
        // as it is full).
        let room = self.arrivals.len() < self.config.inbox_messages;
        let takes_bytes = waiter != (Waiter::App { reading: false }) || room;
        // An armed lane that rang is awake (and read first), for a reader;
        // one that ended is news for any waiter.
        let mark = self.arrivals_mark();
        let woke = self.look_at_rings(waiter.reads());
        any |= (woke && waiter.reads()) || self.arrivals.len() != mark.0;
        if waiter != (Waiter::App { reading: true }) {
            self.tell_sleepers(mark);
        }
        let mut left = false;
        for &slot in &self.awake {
            if let Some(l) = self.lanes.at_mut(slot) {
                any |= l.prepare_sleep(takes_bytes);
                tally(&mut self.unsent_lanes, l);
                // (Bytes this waiter leaves: their ring, drained here, may
                // have woken a reader asleep.)
                left |= !takes_bytes && !l.quiet();
            }
        }
        if left && self.sleepers > 0 {
            self.news.ring();
        }
        if !any {
            self.sleepers += 1; // until its `woke`
        } else if self.sleepers == 0 {
            self.lanes_awake(); // it does not sleep after all
        }
        any
    }

    fn woke(&mut self, waiter: Waiter) {
        self.tcp.woke(waiter);
        self.sleepers = self.sleepers.saturating_sub(1);
        if self.sleepers == 0 {
            self.lanes_awake();
        }
    }

    fn pending_sends(&self) -> usize {
        let lanes: usize = self.lanes.iter().map(|(_, l)| l.unsent_bytes()).sum();
        self.tcp.pending_sends() + lanes
    }

    fn needs_progress(&self) -> bool {
        self.check_tally();
        self.tcp.pending_sends() > 0
            || self.unsent_lanes > 0
            || !self.awaiting.is_empty()
            || !self.links.is_empty()
            || !self.redials.is_empty()
    }

    fn start_send(&mut self, peer: PeerId, bytes: &[u8]) -> Result<bool, Error> {
        if peer.0 & LANE_BIT == 0 {
            return self.tcp.start_send(peer, bytes);
        }
        if self.closed {
            return Err(Error::Closed);
        }
        let limit = self.config.send_queue_bytes;
        self.wake_peer(peer);
        let l = self.lanes.get_mut(peer).ok_or(Error::UnknownPeer(peer))?;
        let r = l.send(peer, Source::Slice(bytes), true, limit);
        tally(&mut self.unsent_lanes, l);
        r.map_err(|r| r.error)
    }

    fn continue_send(&mut self, peer: PeerId, bytes: &[u8]) -> Result<bool, Error> {
        if peer.0 & LANE_BIT == 0 {
            return self.tcp.continue_send(peer, bytes);
        }
        self.wake_peer(peer);
        let l = self.lanes.get_mut(peer).ok_or(Error::PeerLost(peer))?;
        let r = l.continue_send(peer, bytes);
        tally(&mut self.unsent_lanes, l);
        r
    }

    fn abandon_send(&mut self, peer: PeerId, bytes: &[u8]) {
        if peer.0 & LANE_BIT == 0 {
            return self.tcp.abandon_send(peer, bytes);
        }
        self.wake_peer(peer);
        if let Some(l) = self.lanes.get_mut(peer) {
            l.abandon_send(bytes);
            tally(&mut self.unsent_lanes, l);
        }
    }

    fn background_progress(&mut self, read: bool) -> Result<bool, Error> {
        let mark = self.arrivals_mark();
        if read {
            self.look_at_pool();
        }
        let mut any = self.tcp.background_progress(read)?;
        // As `pass`: reads first, so a peer is judged on what it sent.
        any |= self.look_at_rings(read);
        if read {
            any |= self.read_lanes();
        }
        self.upgrade();
        // A reading progress thread sleeps next without a `prepare_sleep`:
        // its lanes' peers ring only for armed lanes.
        any |= self.tend_lanes(read);
        self.tell_sleepers(mark);
        Ok(any)
    }

    fn take_accepted(&mut self) -> Option<(PeerId, SocketAddr)> {
        self.accepted
            .pop_front()
            .or_else(|| self.tcp.take_accepted())
    }

    fn opened(&mut self, peer: PeerId) -> Option<Result<PeerId, Error>> {
        if self.dialed.contains_key(&peer) && self.tcp.peer_addr(peer).is_none() {
            // Gone from TCP before its answer was taken: a read outside a
            // pass (`try_recv`) may have left the answer for `upgrade`.
            self.upgrade();
        }
        if let Some(r) = self.moved.remove(&peer) {
            return Some(r);
        }
        // The answer taken: the TCP peer leaves as its lane comes.
        let on_its_way = self.awaiting.values().any(|(p, _, _)| *p == peer);
        match self.tcp.opened(peer) {
            Some(Ok(p)) if !self.config.required => {
                self.dialed.remove(&peer);
                Some(Ok(p))
            }
            // Required: only a lane will do; a declined offer comes back as `moved`.
            Some(Ok(_)) => None,
            // The TCP peer went: its lane is on its way. Not one that went
            // before its answer (a listener that hung up), nor one that
            // broke or refused the session (another version, a listener at
            // its peer limits): no lane comes, and the wait would time out.
            Some(Err(e)) if on_its_way && !matches!(e, Error::Protocol { .. }) => None,
            Some(Err(e)) => {
                self.dialed.remove(&peer);
                Some(Err(e))
            }
            r => r,
        }
    }

    fn peers_left(&self) -> usize {
        self.tcp.peers_left() + self.lane_count()
    }

    fn peer_addr(&self, peer: PeerId) -> Option<SocketAddr> {
        match peer.0 & LANE_BIT {
            0 => self.tcp.peer_addr(peer),
            _ => self.lane(peer).map(|l| l.addr),
        }
    }

    fn peer_stats(&self, peer: PeerId) -> Option<SessionStats> {
        match peer.0 & LANE_BIT {
            0 => self.tcp.peer_stats(peer),
            _ => self.lane(peer).map(|l| l.session.stats()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lane_that_ended_is_always_news_of_its_peer() {
        let id = PeerId(LANE_BIT | 3);
        let other = PeerId(LANE_BIT | 4);
        let protocol = Error::Protocol {
            peer: id,
            error: zerohop_core::session::ProtocolError::Refused,
        };
        for (ended, told) in [
            (Error::PeerClosed(id), Error::PeerClosed(id)),
            (Error::PeerLost(id), Error::PeerLost(id)),
            (protocol, protocol),
            (
                Error::Backend("shm: a fragment on a stream lane"),
                Error::WireRule {
                    peer: id,
                    rule: "shm: a fragment on a stream lane",
                },
            ),
            (Error::Timeout, Error::PeerLost(id)),
            (Error::PeerLost(other), Error::PeerLost(id)),
        ] {
            assert_eq!(lane_end(id, ended), told, "{ended:?}");
            assert_eq!(told.ended_peer(), Some(id), "{told:?}");
        }
    }
}
