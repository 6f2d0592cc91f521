//! The TCP wire: kind `tcp` (a private receive pool) and kind `uma` (the same wire
//! receiving into CUDA managed memory). A driver of core's session engine:
//! sockets, epoll and buffers here; the protocol (Hello, sequence, credit,
//! Close, timers) is the engine's.
//!
//! Readiness comes from edge-triggered epoll (`Poller`), so a pass
//! touches the sockets that are ready, whatever the number of peers. An
//! accepted connection holds 32 bytes and a deadline until its Hello: no
//! stage, no pool buffer, no peer id; a lane Hello (below) pairs it with its
//! peer instead. A message's buffer is leased only once its first payload
//! bytes are there, for at most the credit the engine granted, so a header
//! (or short record) that claims a large message and stops costs nothing;
//! one whose payload stalls or drips is dropped by the engine's idle and
//! minimum-rate timers, its buffer back. Buffers for payloads still coming
//! hold at most half the pool together (a message past that waits, its peer
//! held), so many such peers at once cannot starve the rest; grants past a
//! peer's window come from one budget, in the order peers asked. A peer
//! quiet for the idle timeout keeps its connection but not its stage.
//!
//! A whole message goes behind a short record (the engine's headerless
//! frame, [`ShortRecord`](zerohop_core::wire::ShortRecord)) to a peer whose
//! Hello takes them, unless [`TcpConfig::check_payload`] asks for checksums.
//!
//! Sends go straight to the socket with `writev` when nothing is queued and
//! are copied only for what the kernel did not take; each peer's queue is
//! bounded in bytes. Receives read through a staging buffer; a payload
//! larger than what is staged is read straight into its lease, and only once
//! no earlier message waits for the application (a stream of large messages
//! then reuses the buffer the application just gave back).
//!
//! Large messages are striped over a second connection per peer (its
//! *lane*), as UCX's rendezvous uses two lanes: the connecting side opens it
//! and says a Hello with `lane` 1 and its main connection's token; the
//! acceptor pairs them (a lane from another address than its main
//! connection's is not paired: the token alone is 32 bits) and acks with its
//! own lane Hello, the first bytes that way (a lane that comes before its
//! main connection waits for it the idle timeout, two an address and eight
//! in all); the connecting side stripes only
//! once it has read the ack. A message of at least `stripe_min` bytes leaves
//! with [`DataFlags::STRIPED`](zerohop_core::wire::DataFlags::STRIPED):
//! header and first half on the main connection, the rest on the lane, read
//! straight into the one lease. A striped frame on a connection without a paired lane
//! breaks the wire's rule ([`Error::WireRule`]).

use std::collections::VecDeque;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use zerohop_backends::{
    absence, counted_address, host_bytes, AcceptedPeers, Looks, PeerLimits, PeerSlots, SessionClock,
};
use zerohop_core::session::{HostOffer, HostRole, Instant, Session, SessionConfig, SessionStats};
use zerohop_core::wire::HEADER_LEN;
use zerohop_core::{Capabilities, Error, Kind, PeerId, PoolError, Received, Rejected, Transport};

use crate::endpoint::{pool_leaser, Leaser, Waiter, Wire};
use crate::host::{StdLease, StdPool};
use crate::poller::{Poller, Ready, Set};
use crate::waiting_room::FairQueue;

mod accept;
mod lane;
mod recv;
mod send;
mod stage;

use accept::Pending;
use lane::Lane;
use recv::Incoming;
use send::{write_frame, Direct, Out, Payload, Source};
use stage::Stage;

const STAGE_BYTES: usize = 64 << 10;
/// The rest of a message at least this long is read straight into its lease.
const DIRECT_MIN: usize = 1 << 10;
/// How far past a message read straight into its lease the same read goes.
const READ_AHEAD: usize = 4 << 10;
/// How long a large payload waits in its socket for the application to
/// take a message and give its buffer back, at most (see `read_peer`).
const DEFER_AT_MOST: Duration = Duration::from_millis(1);
/// Frames one peer's read takes before the others' turn (its read goes on
/// at the next pass): frames that deliver nothing (credit, a Want) fill no
/// inbox, and a peer streaming them would otherwise keep the read for good.
const FRAMES_PER_TURN: u32 = 256;
/// The default [`TcpConfig::stripe_min`]. Measured on the 16-core H200
/// host (BENCHMARKS.md), striping loses bandwidth from 256 to 768 KiB and
/// gains from 1 MiB up.
pub const STRIPE_MIN: usize = 1 << 20;
/// A message at least this long re-arms quick ACKs (see [`quick_ack`]).
const QUICK_ACK_MIN: usize = 1 << 20;
/// Lanes whose main connection is not there yet, kept at most (each for
/// the idle timeout), and at most from one address: a newcomer past either
/// bound replaces the oldest it competes with, so one stranger's flood of
/// lane Hellos cannot push out another address's lane.
const UNCLAIMED_LANES: usize = 8;
const UNCLAIMED_PER_ADDRESS: usize = 2;
/// How long accepting pauses when the process is out of descriptors.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// How often a run of failed accepts, or of newcomers refused by the peer
/// limits, is reported at warning level (each is a debug record): a
/// process out of descriptors for an hour would otherwise log ten warnings
/// a second, and a stranger's flood one a connection.
const WARN_EVERY: Duration = Duration::from_secs(10);
/// TCP keepalive on every peer's main connection: a peer quiet this long is
/// probed, [`KEEPALIVE_PROBES`] times [`KEEPALIVE_INTERVAL`] apart, and
/// one that never answers (a host that crashed, a link cut, a NAT that
/// forgot it) is lost, its place under the peer limits freed. Quiet peers
/// are otherwise kept, but for a full listener's newcomer
/// ([`TcpConfig::peer_limits`]). (Keepalive probes only a quiet connection:
/// one with data unacknowledged is judged by TCP's retransmissions, some
/// fifteen minutes.)
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
/// Between keepalive probes.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// Keepalive probes unanswered before the connection is given up.
pub const KEEPALIVE_PROBES: u32 = 4;
/// Refused newcomers kept while their Close goes out, at most (the oldest
/// goes first), and for how long each.
const REFUSING: usize = 64;
const REFUSING_FOR: Duration = Duration::from_secs(1);
/// How often the idle timers are looked at.
const TIMER_SCAN: Duration = Duration::from_millis(20);
/// Quiet scans a stage taken again after a quiet spell is kept (60 ms).
const RETAKEN_SCANS: u32 = 3;
/// Bytes from a peer in one timer scan that keep its stage (about 50 KB/s).
const SPOKE_BYTES: usize = 1 << 10;
/// One `try_recv` in this many also does the connection work.
const CTL_EVERY: u32 = 32;
/// One `try_recv` in this many asks epoll; the others read the peer that
/// delivered last straight away, which answers a reply with one system
/// call, as a program reading its one socket in a loop does.
const EPOLL_EVERY: u32 = 8;
// epoll keys: a slot, shifted, and what it is.
const MAIN: u64 = 0;
const LANE: u64 = 1;
const PENDING: u64 = 2;
const LISTENER: u64 = u64::MAX;
/// The descriptor an owner watches through this poller (see [`TcpTransport::watch`]).
const WATCHED: u64 = u64::MAX - 1;

/// Turns TCP keepalive on for a peer's connection ([`KEEPALIVE_IDLE`]).
fn keepalive(s: &TcpStream) -> io::Result<()> {
    use rustix::net::sockopt;
    sockopt::set_tcp_keepidle(s, KEEPALIVE_IDLE)?;
    sockopt::set_tcp_keepintvl(s, KEEPALIVE_INTERVAL)?;
    sockopt::set_tcp_keepcnt(s, KEEPALIVE_PROBES)?;
    Ok(sockopt::set_socket_keepalive(s, true)?)
}

/// A warning that may recur in a flood: reported once per [`WARN_EVERY`],
/// with the count of those held back (each is a debug record).
#[derive(Debug, Default)]
struct Reported(Option<(StdInstant, u32)>);

impl Reported {
    /// Another at `now`: `Some(held back since the last report)` when this
    /// one is to be reported.
    fn occur(&mut self, now: StdInstant) -> Option<u32> {
        match &mut self.0 {
            Some((at, n)) if now.duration_since(*at) < WARN_EVERY => {
                *n += 1;
                None
            }
            last => {
                let n = last.map_or(0, |(_, n)| n);
                *last = Some((now, 0));
                Some(n)
            }
        }
    }

    /// The run ended: `Some(held back)` if it was reported.
    fn ended(&mut self) -> Option<u32> {
        self.0.take().map(|(_, n)| n)
    }
}

/// TCP wire settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpConfig {
    /// Largest message this side takes (default 64 MiB; its Hello tells peers). What it sends is held to each peer's.
    pub max_message: usize,
    /// Message bytes a peer may have on their way — sent, and not yet
    /// delivered into the inbox — before this side returns credit (default
    /// 16 MiB): what one peer can make this side hold beyond the inbox
    /// (bounded by `inbox_bytes`); a message longer than it waits for a
    /// grant from `grant_budget`.
    pub window: usize,
    /// Bytes granted at once, over all peers, beyond their windows (default
    /// 64 MiB): longer messages wait for room.
    pub grant_budget: usize,
    /// Bytes a peer's send queue may hold before `try_send` says `WouldBlock`
    /// (default 16 MiB; one message larger than this is still taken when the queue is empty).
    pub send_queue_bytes: usize,
    /// Received messages held for the application before reading stops (default 4096).
    pub inbox_messages: usize,
    /// Received bytes held for the application before reading stops (default 8 MiB).
    pub inbox_bytes: usize,
    /// Checksum every frame, payloads as well as headers (default off: TCP
    /// checksums its segments). Off, a whole message to a peer that takes
    /// them goes behind a short record, which has no checksum
    /// ([`ShortRecord`](zerohop_core::wire::ShortRecord)); on, this side
    /// neither sends nor takes them.
    pub check_payload: bool,
    /// Messages of at least this many bytes are striped over a second
    /// connection per peer (see the module docs); `None`: one connection.
    /// At least 8 KiB (`new` refuses less).
    pub stripe_min: Option<usize>,
    /// A peer silent this long before its Hello or mid-frame is dropped (default 5 s).
    pub idle_timeout: Duration,
    /// Bytes a second a peer's message under way must keep up, after the
    /// idle timeout's grace (default [`MIN_RATE`](zerohop_core::session::MIN_RATE);
    /// 0: none): a peer that drips a large message's bytes to hold its
    /// buffer is dropped.
    pub min_rate: u32,
    /// Connections that have not said Hello, kept at most; past it the
    /// oldest of the address with the most of them goes (default 256).
    pub max_handshakes: usize,
    /// Accepted peers kept at most, overall and from one address (peers
    /// this side connected to do not count; under a
    /// [`LocalWire`](crate::shm::LocalWire), those that moved to shared
    /// memory do): past either, an accepted peer (a same-host lane
    /// included, as its wire tells them: `offer_elsewhere`) quiet an idle
    /// timeout of its own accord, of the newcomer's group of addresses or
    /// a group holding more places than the newcomer's would, is let go for
    /// the newcomer (`make_room`: that address's only where the newcomer's
    /// own address is at its share; nobody while the inbox is full, the
    /// pool dry or the application away); with none, the
    /// newcomer's Hello is answered with a Close, which its side reports as
    /// [`ProtocolError::Refused`](zerohop_core::session::ProtocolError::Refused).
    /// A dead peer that never said so is found by TCP keepalive
    /// ([`KEEPALIVE_IDLE`]) and its place freed.
    pub peer_limits: PeerLimits,
    /// What this side offers the listeners it connects to, so that one on
    /// the same host can move the session to shared memory (the same-host
    /// lane, [`crate::shm`]); `None` (the default) says it will not.
    pub same_host: Option<HostOffer>,
    /// Offers from peers that connect here wait for
    /// [`answer_offer`](TcpTransport::answer_offer) (the same-host lane
    /// decides); off (the default), each is declined at once.
    pub takes_offers: bool,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            max_message: 64 << 20,
            window: 16 << 20,
            grant_budget: 64 << 20,
            send_queue_bytes: 16 << 20,
            inbox_messages: 4096,
            inbox_bytes: 8 << 20,
            check_payload: false,
            stripe_min: Some(STRIPE_MIN),
            idle_timeout: Duration::from_secs(5),
            min_rate: zerohop_core::session::MIN_RATE,
            max_handshakes: 256,
            peer_limits: PeerLimits::default(),
            same_host: None,
            takes_offers: false,
        }
    }
}

impl TcpConfig {
    /// A session's settings; `host`: the connecting side offers (or says it
    /// will not), the accepting side answers.
    fn session(&self, host: HostRole) -> SessionConfig {
        let max = u32::try_from(self.max_message).unwrap_or(u32::MAX);
        SessionConfig {
            window: u32::try_from(self.window).unwrap_or(u32::MAX),
            check_payload: self.check_payload,
            takes_headerless: !self.check_payload,
            sends_headerless: !self.check_payload,
            idle_timeout: self.idle_timeout,
            min_rate: self.min_rate,
            host,
            ..SessionConfig::stream(max)
        }
    }
}

/// A connection to a listener opened by [`TcpTransport::dial`], not yet a peer.
#[derive(Debug)]
pub struct Dialed {
    main: TcpStream,
    lane: Option<TcpStream>,
    addr: SocketAddr,
    token: u32,
}

impl Dialed {
    /// Where it goes.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

struct Peer {
    stream: TcpStream,
    addr: SocketAddr,
    session: Session,
    stage: Stage,
    stage_start: usize,
    stage_end: usize,
    incoming: Option<Incoming>,
    /// The message being received: leased at its first payload bytes.
    lease: Option<StdLease>,
    /// Of `lease`, the bytes counted in the transport's `coming_bytes`
    /// (zero for a message whose payload was all staged when leased).
    coming: usize,
    /// Refused a buffer for a payload to come: the budget for those
    /// (`coming_budget`) was full.
    waits_for_budget: bool,
    queue: VecDeque<Out>,
    queued_bytes: usize,
    direct: Option<Direct>,
    lane: Option<Lane>,
    /// The token its Hello carried (accepting side): its lane comes with it.
    token: Option<u32>,
    striped_sent: u64,
    /// Readiness seen and not yet used up (edge-triggered: a read that
    /// comes back short, or empty, uses it up; the next arrival raises it).
    readable: bool,
    /// Bytes came into the stage that the session has not been told of.
    heard: bool,
    /// In `wants`: it asked for a grant past its window.
    asked: bool,
    lane_readable: bool,
    /// epoll reported the other side's end (or an error) on the socket: it
    /// stays readable until a read says so, however short the reads before.
    hup: bool,
    lane_hup: bool,
    writable: bool,
    /// In the transport's lists of peers with reading or writing to do.
    in_read: bool,
    in_write: bool,
    /// Waiting for a pool buffer, or for the application to take a message
    /// before a large one is read (its bytes stay in the socket).
    dry: bool,
    deferred: bool,
    /// Since when the message whose payload waits (`deferred`) has waited.
    deferred_since: Option<Instant>,
    /// The last message was read straight into its lease: the next read
    /// into the stage takes only a header's worth and a little more.
    direct_stream: bool,
    /// Accepting side: the application has been told of this peer (once
    /// the same-host exchange settled on this wire).
    announced: bool,
    /// Timer scans since one that saw at least `SPOKE_BYTES` come: a peer
    /// quiet for the idle timeout with nothing staged gives its stage back
    /// (64 KiB each: a thousand idle peers held 64 MB), and takes one anew
    /// when bytes come. A frame now and then is quiet: a thousand peers
    /// that each sent a 32-byte frame every few seconds kept theirs.
    quiet_scans: u32,
    /// Bytes read since the last timer scan.
    scan_bytes: usize,
}

impl Peer {
    /// Its Hello (and, this side having offered, the answer on the same
    /// host) has not come yet: what it sends until then is no message, so
    /// a full inbox does not keep it unread (a connect would wait out its
    /// timeout and blame the peer).
    fn opening(&self) -> bool {
        !(self.session.is_open() && self.session.host_settled())
    }

    /// Something waits for a read, found by a peek (bytes, their end or an
    /// error): in its main connection, or on its lane for a striped
    /// payload under way that wants them (lane bytes nothing wants yet are
    /// no progress). Noted as readiness, for the read that follows.
    fn note_unread(&mut self) -> bool {
        let waits = |s: &TcpStream| !matches!(s.peek(&mut [0]), Err(e) if e.kind() == io::ErrorKind::WouldBlock);
        let main = waits(&self.stream);
        let lane_wanted = self
            .incoming
            .as_ref()
            .is_some_and(|inc| inc.lane_have < inc.d.len.saturating_sub(inc.split));
        let lane = lane_wanted
            && self
                .lane
                .as_ref()
                .is_some_and(|l| !l.early.is_empty() || waits(&l.stream));
        self.readable |= main;
        self.lane_readable |= lane;
        main || lane
    }
}

/// A peer kept on another wire of this endpoint, as a full listener sees
/// it when it looks for one to let go (see
/// [`TcpTransport::offer_elsewhere`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Elsewhere {
    pub(crate) id: PeerId,
    pub(crate) ip: std::net::IpAddr,
    /// Since when nothing has been heard from it, in microseconds of
    /// `CLOCK_MONOTONIC` ([`SessionClock::monotonic_us`]).
    pub(crate) quiet_since: u64,
    /// Quiet of its own accord: nothing this side holds back or owes it.
    pub(crate) its_own: bool,
    /// It has delivered a message: a peer that gossips goes after those
    /// that never said more than Hello.
    pub(crate) delivered: bool,
}

/// A TCP transport with any number of peers.
pub struct TcpTransport {
    config: TcpConfig,
    pool: Arc<StdPool>,
    kind: Kind,
    poller: Poller,
    ready: Vec<Ready>,
    listener: Option<TcpListener>,
    accept_after: Option<StdInstant>,
    /// Failed accepts, reported at most once per [`WARN_EVERY`].
    accept_failures: Reported,
    /// The watched descriptor became readable (see [`TcpTransport::watch`]).
    watched: bool,
    pending: Vec<Option<Pending>>,
    /// The accepted peers kept, here and on another wire of this endpoint
    /// (the same-host lane), judged by [`TcpConfig::peer_limits`].
    kept: AcceptedPeers,
    /// Newcomers refused at their Hello by the peer limits, ever.
    refused: u64,
    /// Refusals, reported at most once per [`WARN_EVERY`].
    refusals: Reported,
    /// Refused newcomers whose Close is on its way: each read until it
    /// closes, or for [`REFUSING_FOR`] (a socket closed with bytes unread
    /// resets the connection, and the reset can beat the Close there).
    /// (With each, when it was refused and the bytes it may still send.)
    refusing: VecDeque<(TcpStream, StdInstant, usize)>,
    peers: PeerSlots<Box<Peer>>,
    /// Slots with reading, and with writing, to do without a new event.
    hot_read: VecDeque<usize>,
    hot_write: VecDeque<usize>,
    arrivals: VecDeque<Result<Received<StdLease>, Error>>,
    arrival_bytes: usize,
    /// Peers that connected to the listener and said Hello, not yet taken.
    accepted: VecDeque<(PeerId, SocketAddr)>,
    /// Same-host offers waiting for `answer_offer`.
    offers: VecDeque<(PeerId, HostOffer)>,
    /// Answers to this side's offers: the peer, and whether it took it
    /// (then the TCP peer is gone: its session moved).
    answers: VecDeque<(PeerId, bool)>,
    /// Lanes whose main connection is not there yet, and since when.
    unclaimed: VecDeque<(Lane, StdInstant)>,
    /// The sessions' clock (see `now`).
    session_clock: SessionClock,
    next_scan: StdInstant,
    /// The timers' looks: a long gap is the application's absence.
    looks: Looks,
    /// `try_recv` calls that found nothing waiting (see [`CTL_EVERY`]).
    polls: u32,
    /// The peer that delivered last: a spinning receiver reads it directly
    /// (see `try_recv`).
    last: Option<usize>,
    /// The last reading pass found a message it could not lease a buffer for.
    pool_dry: bool,
    /// The pool's bell is this transport's to clear and poll (not where an
    /// owner shares the pool between wires: see [`Self::leave_bell_to_owner`]).
    owns_bell: bool,
    /// Bytes queued over all peers (each peer's `queued_bytes`, summed as they change).
    queued_total: usize,
    /// Peers that asked for a grant past their window, served an address
    /// ([`counted_address`](zerohop_backends::counted_address)) at a time,
    /// each address's in the order they asked (see `grant_in_turn`).
    wants: FairQueue<IpAddr, PeerId>,
    /// Receive buffers leased for messages whose payload is still coming
    /// (each peer's `coming`, summed), and their bound: half the pool. A
    /// peer that begins a message and stalls holds its buffer until its
    /// timers drop it; with many such peers (each within its own credit)
    /// the pool would run dry for every other peer's messages. Past the
    /// bound a message waits for its buffer, its peer held, not timed out
    /// (one alone may exceed it, so a message longer than half the pool
    /// still comes).
    coming_bytes: usize,
    coming_budget: usize,
    /// Since when a peer has waited for room in `coming_budget`, or for a
    /// grant (see `free_budget`).
    budget_wait_since: Option<Instant>,
    /// The first peer in `wants` waits for room in `grant_budget`.
    grant_waits: bool,
    /// A walk for a quiet peer to let go (`make_room`) found none: the
    /// next waits until this.
    next_walk: Option<Instant>,
    /// Peers let go for newcomers, reported at most once per [`WARN_EVERY`].
    evictions: Reported,
    /// Accepted peers kept on another wire of this endpoint (same-host
    /// lanes), as that wire last told them (`offer_elsewhere`): a full
    /// listener may let one go for a newcomer as it would a TCP peer.
    elsewhere: Vec<Elsewhere>,
    /// Of those, the ones let go, for that wire to end (`take_let_go`).
    let_go: Vec<PeerId>,
    closed: bool,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("kind", &self.kind)
            .field("listening", &self.local_addr())
            .field("peers", &self.peer_count())
            .finish_non_exhaustive()
    }
}

impl TcpTransport {
    /// A transport receiving into `pool`, with no listener and no peers.
    /// `kind` is `Tcp`, or `Uma` when the pool is CUDA managed memory.
    /// Fails if the process cannot create an epoll instance (out of
    /// descriptors).
    /// Its longest message is at most what the pool can hold
    /// ([`PoolConfig::largest_lease`](zerohop_core::PoolConfig::largest_lease)):
    /// a peer is never told it may send what could never be received.
    pub fn new(pool: Arc<StdPool>, mut config: TcpConfig, kind: Kind) -> io::Result<Self> {
        if config
            .stripe_min
            .is_some_and(|n| lane::stripe_split(n) == 0)
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "tcp: stripe_min below 8 KiB (a striped message's part on the second connection would be empty)",
            ));
        }
        if let Err(why) = config.peer_limits.check() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("tcp: {why}"),
            ));
        }
        let now = StdInstant::now();
        config.max_message = config.max_message.min(pool.config().largest_lease());
        let coming_budget = pool.stats().budget / 2;
        Ok(TcpTransport {
            config,
            pool,
            kind,
            poller: Poller::new()?,
            ready: Vec::new(),
            listener: None,
            accept_after: None,
            accept_failures: Reported::default(),
            watched: false,
            pending: Vec::new(),
            kept: AcceptedPeers::default(),
            refused: 0,
            refusals: Reported::default(),
            refusing: VecDeque::new(),
            peers: PeerSlots::new(false),
            hot_read: VecDeque::new(),
            hot_write: VecDeque::new(),
            arrivals: VecDeque::new(),
            arrival_bytes: 0,
            accepted: VecDeque::new(),
            offers: VecDeque::new(),
            answers: VecDeque::new(),
            unclaimed: VecDeque::new(),
            session_clock: SessionClock::start(),
            next_scan: now,
            looks: Looks::default(),
            polls: 0,
            last: None,
            pool_dry: false,
            owns_bell: true,
            queued_total: 0,
            wants: FairQueue::default(),
            coming_bytes: 0,
            coming_budget,
            budget_wait_since: None,
            grant_waits: false,
            next_walk: None,
            evictions: Reported::default(),
            elsewhere: Vec::new(),
            let_go: Vec::new(),
            closed: false,
        })
    }

    /// The receive pool.
    pub fn pool(&self) -> &Arc<StdPool> {
        &self.pool
    }

    /// For an owner that reads its own wires from the same pool (the
    /// same-host lane): it clears and polls the pool's bell once for all of
    /// them, since one wire's clear would take a ring another's sleep needs.
    pub(crate) fn leave_bell_to_owner(&mut self) {
        self.owns_bell = false;
    }

    /// The last reading pass stopped for want of a buffer.
    pub(crate) fn pool_dry(&self) -> bool {
        self.pool_dry
    }

    /// The longest message it takes (what its Hello tells peers).
    pub fn max_message(&self) -> usize {
        self.config.max_message
    }

    /// Whether [`close`](Transport::close) was called: no new peers.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Listens on `addr` (port 0 picks one; see [`local_addr`](Self::local_addr)).
    /// Refused once closed: peers accepted then would keep a closing
    /// transport from finishing.
    pub fn listen(&mut self, addr: impl ToSocketAddrs) -> io::Result<SocketAddr> {
        if self.closed {
            return Err(io::Error::other("the transport is closed"));
        }
        let l = TcpListener::bind(addr)?;
        l.set_nonblocking(true)?;
        self.poller.add(&l, Set::Ctl, LISTENER, true, false)?;
        let a = l.local_addr()?;
        self.listener = Some(l);
        Ok(a)
    }

    /// Where it listens, if it does.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// Connects to a listening transport (blocking up to `timeout` for the
    /// TCP connection), says Hello and opens the peer's lane unless
    /// `stripe_min` is `None`. The peer answers its Hello in progress:
    /// sends before that say `WouldBlock`; a peer that does not speak
    /// zerohop, or another version, is reported through `try_recv` (and
    /// by [`opened`](Self::opened)). [`dial`](Self::dial) then
    /// [`attach`](Self::attach) do the same with the blocking part apart.
    pub fn connect(&mut self, addr: SocketAddr, timeout: Duration) -> io::Result<PeerId> {
        let dialed = Self::dial(addr, timeout, self.config.stripe_min.is_some())?;
        self.attach(dialed)
    }

    /// The blocking half of [`connect`](Self::connect), which needs no
    /// transport (so a host that is slow to answer holds up no other
    /// peer): opens the connection to `addr`, and with `lane` its second
    /// connection, which says its Hello at once.
    pub fn dial(addr: SocketAddr, timeout: Duration, lane: bool) -> io::Result<Dialed> {
        let until = StdInstant::now().checked_add(timeout);
        let main = TcpStream::connect_timeout(&addr, timeout)?;
        // The second connection within what is left of the time.
        let left = until.map_or(timeout, |u| u.saturating_duration_since(StdInstant::now()));
        let lane = lane && !left.is_zero();
        use std::hash::BuildHasher;
        // Unique among the acceptor's peers: a random key over this connection's address.
        let token = std::collections::hash_map::RandomState::new()
            .hash_one((main.local_addr()?, std::process::id())) as u32;
        let lane = match lane.then(|| lane::dial_lane(addr, left, token)) {
            Some(Err(e)) => {
                log::info!(
                    "tcp: no second connection to {addr} ({e}): large messages go unstriped"
                );
                None
            }
            Some(Ok(l)) => Some(l),
            None => None,
        };
        Ok(Dialed {
            main,
            lane,
            addr,
            token,
        })
    }

    /// The other half of [`connect`](Self::connect): the dialed connection
    /// becomes a peer, whose Hello goes at once.
    pub fn attach(&mut self, dialed: Dialed) -> io::Result<PeerId> {
        // A dial that ends while the transport closes: its connections go.
        if self.closed {
            return Err(io::Error::other("the transport is closed"));
        }
        let Dialed {
            main,
            lane,
            addr,
            token,
        } = dialed;
        let offer = HostRole::Offer(self.config.same_host);
        let session = Session::new(self.config.session(offer), token, self.now());
        let id = self.add_peer(main, addr, session)?;
        if let Some(lane) = lane {
            if let Err(e) = self.add_lane(id, lane, token) {
                log::info!("tcp: the second connection to {addr} failed ({e}): large messages go unstriped");
            }
        }
        Ok(id)
    }

    /// How many connections carry `peer`'s messages: 2 once its lane is
    /// paired and confirmed, else 1; `None` for no such peer.
    pub fn connections(&self, peer: PeerId) -> Option<usize> {
        let p = self.peer(peer)?;
        Some(1 + usize::from(p.lane.as_ref().is_some_and(|l| l.confirmed)))
    }

    /// Messages sent to `peer` striped over its two connections (0 for no such peer).
    pub fn striped_sent(&self, peer: PeerId) -> u64 {
        self.peer(peer).map_or(0, |p| p.striped_sent)
    }

    /// Bytes of staging buffer the peers have mapped (a diagnostic: a peer
    /// quiet for the idle timeout holds none; of what is mapped, only the
    /// pages bytes landed in are resident).
    pub fn stage_bytes(&self) -> usize {
        self.peers.iter().map(|(_, p)| p.stage.len()).sum()
    }

    /// Live peers (the Hello received).
    pub fn peer_count(&self) -> usize {
        self.peers
            .iter()
            .filter(|(_, p)| p.session.is_open())
            .count()
    }

    /// Peers in the table, open or not yet (a closing transport waits for 0).
    pub fn peers_left(&self) -> usize {
        self.peers.count()
    }

    /// Newcomers refused at their Hello by [`TcpConfig::peer_limits`], ever.
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// The peers another wire of this endpoint keeps for the limits
    /// ([`keep_elsewhere`](Self::keep_elsewhere)), as they are now: a full
    /// listener may let one of them go for a newcomer; those it lets go
    /// come back from [`take_let_go`](Self::take_let_go).
    pub(crate) fn offer_elsewhere(&mut self, peers: Vec<Elsewhere>) {
        // One may be quiet sooner than the last walk that found none saw.
        let idle_us = micros(self.config.idle_timeout);
        let sooner = self.next_walk.is_some_and(|w| {
            let w = self.session_clock.monotonic_us(w);
            peers
                .iter()
                .any(|p| p.its_own && p.quiet_since.saturating_add(idle_us) < w)
        });
        if sooner {
            self.next_walk = None;
        }
        self.elsewhere = peers;
    }

    /// Whether the limits are near (within an eighth of `accepted`), or an
    /// address's share is below the whole: only then are another wire's
    /// peers worth telling (`offer_elsewhere`).
    pub(crate) fn near_limits(&self) -> bool {
        let l = self.config.peer_limits;
        l.per_address < l.accepted || self.kept.total() + l.accepted / 8 >= l.accepted
    }

    /// The peers of another wire let go for newcomers since the last call:
    /// that wire ends each (`ProtocolError::Evicted`).
    pub(crate) fn take_let_go(&mut self) -> Vec<PeerId> {
        std::mem::take(&mut self.let_go)
    }

    /// An accepted peer from `ip` moved to another wire of this endpoint
    /// and is kept there: it counts against the peer limits until
    /// [`let_go_elsewhere`](Self::let_go_elsewhere).
    pub(crate) fn keep_elsewhere(&mut self, ip: std::net::IpAddr) {
        self.kept.add(ip);
    }

    /// The peer [`keep_elsewhere`](Self::keep_elsewhere) counted has gone.
    /// (`peer`, gone, is no longer one a full listener may let go: a stale
    /// offer would admit a newcomer for a place nobody frees.)
    pub(crate) fn let_go_elsewhere(&mut self, peer: PeerId, ip: std::net::IpAddr) {
        self.kept.remove(ip);
        self.elsewhere.retain(|e| e.id != peer);
    }

    /// Accepted connections that have not said Hello yet.
    pub fn handshaking(&self) -> usize {
        self.pending.iter().flatten().count()
    }

    /// A live peer's address.
    pub fn peer_addr(&self, peer: PeerId) -> Option<SocketAddr> {
        self.peer(peer).map(|p| p.addr)
    }

    /// Watches `fd` for readability in this transport's poller, for its
    /// owner: the shm wire's lane socket. [`take_watched`](Self::take_watched)
    /// says when it became readable (edge-triggered: drain it then).
    pub fn watch(&mut self, fd: impl std::os::fd::AsFd) -> io::Result<()> {
        self.poller.add(fd, Set::Ctl, WATCHED, true, false)
    }

    /// Whether the watched descriptor became readable since the last call.
    pub fn take_watched(&mut self) -> bool {
        std::mem::take(&mut self.watched)
    }

    /// The next same-host offer from a peer that connected here (with
    /// `takes_offers`): answer it with [`answer_offer`](Self::answer_offer).
    pub fn take_offer(&mut self) -> Option<(PeerId, HostOffer)> {
        self.offers.pop_front()
    }

    /// Answers a same-host offer: `accept`, the session moves to shared
    /// memory (this peer goes, silently, once the answer is out); else it
    /// stays here, and the peer is announced.
    pub fn answer_offer(&mut self, peer: PeerId, accept: bool) {
        let Some((slot, p)) = self.peers.find_mut(peer) else {
            return;
        };
        p.session.answer_host(accept);
        self.control(slot);
    }

    /// Same-host news for the wire above (offers, answers, its watched
    /// descriptor): what its next pass should take now, not after a poll
    /// interval (a sleeper reads them and would sleep on them).
    pub fn has_host_news(&self) -> bool {
        !self.offers.is_empty() || !self.answers.is_empty() || self.watched
    }

    /// The next answer to one of this side's offers: the peer, and whether
    /// it took it (then the peer is gone from here: its session moved).
    pub fn take_answer(&mut self) -> Option<(PeerId, bool)> {
        self.answers.pop_front()
    }

    /// A live peer's Hello token (what names it in a same-host handshake).
    pub fn peer_token(&self, peer: PeerId) -> Option<u32> {
        let p = self.peer(peer)?;
        Some(match p.token {
            Some(t) => t,              // accepting side: the peer's
            None => p.session.token(), // connecting side: ours
        })
    }

    /// Drops a peer at once, with no Close and no report: a connect that
    /// gave up waiting for the answer to its Hello. Whether it was there.
    pub fn disconnect(&mut self, peer: PeerId) -> bool {
        let Some(slot) = self.peers.slot(peer) else {
            return false;
        };
        self.drop_peer(slot, true);
        true
    }

    /// What has crossed to and from a live peer.
    pub fn peer_stats(&self, peer: PeerId) -> Option<SessionStats> {
        self.peer(peer).map(|p| p.session.stats())
    }

    /// The next peer that connected to the listener and said Hello, with its address.
    pub fn take_accepted(&mut self) -> Option<(PeerId, SocketAddr)> {
        self.accepted.pop_front()
    }

    /// Whether the Hellos with a peer this side connected to have crossed:
    /// `Some(Ok)` open, `None` not yet, `Some(Err)` refused or gone (the
    /// error `try_recv` would have reported, taken from there).
    pub fn opened(&mut self, peer: PeerId) -> Option<Result<PeerId, Error>> {
        if let Some(p) = self.peer(peer) {
            return (p.session.is_open() && p.session.host_settled()).then_some(Ok(peer));
        }
        Some(Err(zerohop_backends::take_end(&mut self.arrivals, peer)))
    }

    /// Whether messages or news of peers wait for `try_recv`.
    pub(crate) fn has_arrivals(&self) -> bool {
        !self.arrivals.is_empty()
    }

    /// Bytes queued for sending, over all peers (0: everything is with the kernel).
    pub fn queued_bytes(&self) -> usize {
        self.queued_total
    }

    /// Writes `frame` to `peer`'s connection as it is, bypassing its
    /// session (nothing may be queued): what a broken peer sends, for tests.
    #[cfg(feature = "testing")]
    pub fn send_raw_frame(&mut self, peer: PeerId, frame: &[u8]) -> io::Result<()> {
        let p = self
            .peer_mut(peer)
            .map_err(|_| io::ErrorKind::NotConnected)?;
        if !p.queue.is_empty() || p.direct.is_some() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let mut sent = 0;
        send::write_part(&mut p.stream, &[], frame, &mut sent)?;
        match sent == frame.len() {
            true => Ok(()),
            false => Err(io::ErrorKind::WouldBlock.into()),
        }
    }

    fn now(&self) -> Instant {
        self.session_clock.now()
    }

    fn peer(&self, id: PeerId) -> Option<&Peer> {
        self.peers.get(id).map(|p| &**p)
    }

    fn peer_mut(&mut self, id: PeerId) -> Result<&mut Peer, Error> {
        self.peers
            .get_mut(id)
            .map(|p| &mut **p)
            .ok_or(Error::UnknownPeer(id))
    }

    fn id(&self, slot: usize) -> PeerId {
        self.peers.id(slot)
    }

    fn add_peer(&mut self, s: TcpStream, addr: SocketAddr, session: Session) -> io::Result<PeerId> {
        s.set_nodelay(true)?;
        s.set_nonblocking(true)?;
        // Best effort: a safety net the connection does not depend on.
        if let Err(e) = keepalive(&s) {
            log::debug!("tcp: {addr}: no keepalive ({e}); a silent death goes unseen");
        }
        let token = session.peer().map(|p| p.token);
        let (slot, id) = self
            .peers
            .insert(Box::new(Peer {
                stream: s,
                addr,
                session,
                stage: Stage::default(), // mapped at the first read
                stage_start: 0,
                stage_end: 0,
                incoming: None,
                lease: None,
                coming: 0,
                waits_for_budget: false,
                queue: VecDeque::new(),
                queued_bytes: 0,
                direct: None,
                lane: None,
                token,
                striped_sent: 0,
                readable: true,
                heard: false,
                asked: false,
                lane_readable: true,
                hup: false,
                lane_hup: false,
                writable: true,
                in_read: false,
                in_write: false,
                dry: false,
                deferred: false,
                deferred_since: None,
                direct_stream: false,
                announced: false,
                quiet_scans: 0,
                scan_bytes: 0,
            }))
            .map_err(|_| io::Error::from(io::ErrorKind::OutOfMemory))?;
        let stream = &self.peers.at(slot).expect("just inserted").stream;
        let watched = self
            .poller
            .add(stream, Set::Data, key(slot, MAIN), true, false)
            .and_then(|()| {
                self.poller
                    .add(stream, Set::Ctl, key(slot, MAIN), false, true)
            });
        if let Err(e) = watched {
            // Its id was never given out; its socket leaves epoll as it closes.
            self.peers.remove(slot);
            return Err(e);
        }
        if token.is_some() {
            self.kept.add(addr.ip());
        }
        self.control(slot);
        self.mark_read(slot);
        Ok(id)
    }

    // ----- readiness -----

    // ----- sending -----

    // ----- receiving -----

    /// Removes a peer; an unclean end is reported once as `PeerLost`. What
    /// it held (a partial message, queued sends) goes back with it.
    fn drop_peer(&mut self, slot: usize, clean: bool) {
        let Some((id, p)) = self.peers.remove(slot) else {
            return;
        };
        if p.token.is_some() {
            self.kept.remove(p.addr.ip());
        }
        if p.asked {
            self.wants.remove(counted_address(p.addr.ip()), id);
        }
        self.queued_total -= p.queued_bytes;
        self.coming_bytes -= p.coming;
        if !clean {
            log::info!(
                "tcp: peer {id} ({}) lost; {} queued frame(s) not delivered",
                p.addr,
                p.queue.len()
            );
            self.arrivals.push_back(Err(Error::PeerLost(id)));
        }
    }

    /// Runs the idle timers (every few milliseconds at most), drops
    /// handshakes past their deadline, and grants what the budget allows.
    /// Whether anything came of it for the application (a message read, a
    /// peer failed).
    fn timers(&mut self) -> bool {
        let now = StdInstant::now();
        if now < self.next_scan {
            return false;
        }
        let before = self.arrivals.len();
        self.next_scan = now + TIMER_SCAN;
        let t = self.now();
        let idle = self.config.idle_timeout;
        let quiet_scans = u32::try_from(idle.as_millis() / TIMER_SCAN.as_millis())
            .unwrap_or(u32::MAX)
            .max(1);
        let came_back = self.looks.came_back(now, absence(idle));
        for p in &mut self.pending {
            if p.as_ref()
                .is_some_and(|p| now.duration_since(p.since) >= idle)
            {
                *p = None;
            }
        }
        self.unclaimed
            .retain(|(_, since)| now.duration_since(*since) < idle);
        self.refusing.retain_mut(|(s, since, left)| {
            now.duration_since(*since) < REFUSING_FOR && accept::drained(s, left) == Some(false)
        });
        for slot in 0..self.peers.len() {
            let inbox_full = self.inbox_full();
            let Some(p) = self.peers.at_mut(slot) else {
                continue;
            };
            let full = inbox_full && !p.opening();
            // A peer is judged on what it sent, read first: what waits for
            // it (readiness not used yet, or bytes in its sockets: a
            // progress thread leaves reading to an application thread that
            // calls, and this pass may not have read) is read now, once the
            // peer is due, unless the inbox is full.
            let due = |p: &Peer| p.session.poll_timeout().is_some_and(|d| d <= t);
            if due(p) && !full && (p.readable || p.note_unread()) {
                self.read_turn(slot);
            }
            let (inbox_full, queued) = (self.inbox_full(), !self.arrivals.is_empty());
            let Some(p) = self.peers.at_mut(slot) else {
                continue;
            };
            let full = inbox_full && !p.opening();
            // A quiet peer's empty stage goes back (see `quiet_scans`).
            if std::mem::take(&mut p.scan_bytes) >= SPOKE_BYTES {
                p.quiet_scans = 0;
            } else if p.stage_start == p.stage_end && p.incoming.is_none() && !p.stage.is_empty() {
                p.quiet_scans += 1;
                if p.quiet_scans >= quiet_scans {
                    p.stage.release();
                    // A stage taken again by a frame now and then goes
                    // after a few quiet scans more, not at the next one (a
                    // fresh mapping a frame would cost more than it holds).
                    p.quiet_scans = quiet_scans.saturating_sub(RETAKEN_SCANS);
                }
            }
            // A payload this side leaves in the socket while the application
            // has not taken the last messages, a dry pool, or bytes it cannot
            // read for a full inbox, are not the peer's stall (the bytes
            // found there afresh, by a peek: readiness flags may be guesses).
            // Readiness a turn's cap (256 frames) left is: a peer that floods
            // control frames mid-message is judged on its payload.
            let unreadable = (p.deferred && queued) || (full && due(p));
            if p.dry || (unreadable && p.note_unread()) {
                p.session.handle_held(t);
            }
            // Nor is the time nobody drove this wire a slow peer's, nor a
            // full inbox's, in which nobody is read: its message's timing
            // pauses (its silence is judged as ever).
            if came_back || full {
                p.session.handle_absence(t);
            }
            if let Err(error) = p.session.handle_timeout(t) {
                let id = self.id(slot);
                self.arrivals
                    .push_back(Err(Error::Protocol { peer: id, error }));
                self.drop_peer(slot, true);
                continue;
            }
        }
        self.free_budget(t);
        self.grant_in_turn(t);
        self.arrivals.len() != before
    }

    /// Payloads still to come hold at most `coming_budget` between them, and
    /// grants past the window at most `grant_budget`. A peer kept waiting
    /// for room in either for the idle timeout frees it from the slowest
    /// holder that its session tells slow under contention
    /// ([`Session::slow_under_contention`]: a message timed that long and
    /// slower than 16 times the minimum rate), or from every holder of a
    /// grant unused that long, their peers dropped
    /// ([`Stall::Slow`](zerohop_core::session::Stall::Slow)); then the wait
    /// starts again. Peers that each keep a large message at a
    /// little over the minimum rate cannot hold the budget for good (128 of
    /// them, at 128 KiB/s each, held it against an honest peer's 1 MiB
    /// message for as long as they went on); an honest message on a slow
    /// link is not judged by the budget's contention alone. Not while this
    /// side holds the peers back itself (a full inbox, a dry pool): then
    /// nobody's message moves.
    fn free_budget(&mut self, t: Instant) {
        let Some(since) = self.budget_wait_since else {
            return;
        };
        // Which budget is short: its holders are the ones judged.
        let room_waits = self.peers.iter().any(|(_, p)| p.waits_for_budget);
        let grant_waits = self.grant_waits;
        if !grant_waits && !room_waits {
            self.budget_wait_since = None;
            return;
        }
        let idle = self.config.idle_timeout;
        if self.inbox_full() || self.pool_dry {
            self.budget_wait_since = Some(t); // this side's wait, not theirs
            return;
        }
        if t < since.after(idle) {
            return;
        }
        // The peer waiting for a grant, alone, is not judged for the grant
        // its message under way uses (a second message asked for while its
        // first comes). Not with others waiting behind it: a first message
        // trickled just over the minimum rate would hold them all back for
        // its whole length. Nor for a grant it left unused.
        // Of those still asking: a Want its message came within the window
        // answered stays queued until its turn.
        let asking = |id: &PeerId| {
            self.peer(*id)
                .is_some_and(|p| p.session.pending_grant().is_some())
        };
        let alone = {
            let mut still_asking = self.wants.iter().filter(asking);
            match (still_asking.next(), still_asking.next()) {
                (Some(only), None) => Some(only),
                _ => None,
            }
        };
        let waiter = alone.filter(|_| grant_waits);
        let holds = |id: PeerId, p: &Peer| {
            let waits_on_itself =
                Some(id) == waiter && p.session.slow_under_contention(t) != Some(0);
            (room_waits && p.coming > 0)
                || (grant_waits && p.session.extra_granted() > 0 && !waits_on_itself)
        };
        // A grant's holder with bytes unread may have begun its message: it
        // is read now (not being due, the timers did not read it), a turn's
        // worth of frames, and judged on what it sent.
        let unused: Vec<usize> = self
            .peers
            .iter()
            .filter(|&(slot, p)| {
                holds(self.id(slot), p) && p.session.slow_under_contention(t) == Some(0)
            })
            .map(|(slot, _)| slot)
            .collect();
        for slot in unused {
            if self
                .peers
                .at_mut(slot)
                .is_some_and(|p| p.readable || p.stage_end > p.stage_start || p.note_unread())
            {
                self.read_turn(slot);
            }
        }
        // Those reads may have filled the inbox: this side's wait then.
        if self.inbox_full() || self.pool_dry {
            self.budget_wait_since = Some(t);
            return;
        }
        let mut dropped: Vec<(usize, u64)> = self
            .peers
            .iter()
            .filter(|&(slot, p)| holds(self.id(slot), p))
            .filter_map(|(slot, p)| Some((slot, p.session.slow_under_contention(t)?)))
            .collect();
        // The slowest; every grant left unused (pace 0) at once, so that
        // many of them cost a waiter one idle timeout, not one each.
        let slowest = dropped.iter().map(|&(_, pace)| pace).min();
        dropped.retain(|&(_, pace)| Some(pace) == slowest);
        if slowest > Some(0) {
            dropped.truncate(1);
        }
        self.budget_wait_since = Some(t);
        for (slot, _) in dropped {
            let peer = self.id(slot);
            log::warn!("tcp: peer {peer} is the slowest to use receive room or a grant others wait for; dropping it");
            let error = zerohop_core::session::ProtocolError::Stalled {
                during: zerohop_core::session::Stall::Slow,
            };
            self.arrivals
                .push_back(Err(Error::Protocol { peer, error }));
            self.drop_peer(slot, true);
        }
    }

    /// Grants past the window, from the budget all peers share, to the
    /// peers that asked (a Want), an address at a time in the order the
    /// addresses came to ask, each address's peers in the order they
    /// asked: the one whose turn it is waits until the budget has room for
    /// it, and those behind it wait too. A peer that asks again queues
    /// behind every peer already waiting, and one address's many peers
    /// take one turn a round: a stranger that asks from many connections,
    /// each holding the budget an idle timeout before it gives way, delays
    /// another address's grant by one turn, not one per connection.
    fn grant_in_turn(&mut self, t: Instant) {
        self.grant_waits = false;
        if self.wants.is_empty() {
            return;
        }
        let mut granted: u64 = self
            .peers
            .iter()
            .map(|(_, p)| p.session.extra_granted())
            .sum();
        while let Some(id) = self.wants.front() {
            let Some((slot, p)) = self.peers.find_mut(id) else {
                self.wants.pop_front(); // gone
                continue;
            };
            let Some(len) = p.session.pending_grant() else {
                p.asked = false; // its message came within its window
                self.wants.pop_front();
                continue;
            };
            // What the grant adds to the credit told: a sender that gave up
            // a granted message and asks again holds its earlier grant.
            let adds = p.session.grant_adds();
            let budget = self.config.grant_budget as u64;
            if len as u64 > budget + self.config.window as u64 {
                // More than the whole budget past the window: never
                // granted, and it must not hold up those behind it (its
                // sender's send times out).
                p.asked = false;
                self.wants.pop_front();
                continue;
            }
            if granted + adds > budget {
                self.grant_waits = true;
                self.budget_wait_since.get_or_insert(t);
                return;
            }
            p.session.grant(t);
            p.asked = false;
            granted += adds;
            self.wants.pop_front();
            self.control(slot);
        }
    }

    /// One pass: readiness, accepts past their back-off, writes, (with
    /// `read`) reads, then timers: a peer is judged on what it sent, read
    /// first, not on when this side last looked (a caller-driven
    /// application away longer than the idle timeout left its bytes unread).
    fn pass(&mut self, read: bool) -> bool {
        let mut any = self.poll_set(Set::Ctl);
        if self.accept_after.is_some() {
            any |= self.accept_all();
        }
        if read {
            any |= self.poll_set(Set::Data);
        }
        any |= self.flush_all();
        if read {
            any |= self.read_all();
        }
        any |= self.timers();
        any
    }
}

/// `d` in whole microseconds, as the sessions' clocks count (saturating).
fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn key(slot: usize, what: u64) -> u64 {
    (slot as u64) << 2 | what
}

impl Transport for TcpTransport {
    type Lease = StdLease;

    fn kind(&self) -> Kind {
        self.kind
    }

    fn caps(&self) -> Capabilities {
        Capabilities::new(self.kind == Kind::Uma, true, 20)
    }

    fn try_send(&mut self, peer: PeerId, bytes: &[u8]) -> Result<(), Error> {
        self.send_frame(peer, Source::Slice(bytes), false)
            .map(|_| ())
            .map_err(|(e, _)| e)
    }

    fn try_send_lease(&mut self, peer: PeerId, lease: StdLease) -> Result<(), Rejected<StdLease>> {
        self.send_frame(peer, Source::Lease(lease), false)
            .map(|_| ())
            .map_err(|(error, src)| match src {
                Source::Lease(lease) => Rejected { error, lease },
                Source::Slice(_) => unreachable!("a lease handed in comes back as a lease"),
            })
    }

    fn try_recv(&mut self) -> Result<Received<StdLease>, Error> {
        if self.arrivals.is_empty() {
            // Reads first; connection work (accepts, handshakes, room to
            // write, timers) every few calls, so a caller that drives the
            // transport alone does it all at one system call a poll.
            self.polls = self.polls.wrapping_add(1);
            if self.polls % CTL_EVERY == 0 {
                self.pass(true);
            } else {
                match self.last.filter(|_| self.polls % EPOLL_EVERY != 0) {
                    Some(slot) => {
                        if let Some(p) = self.peers.at_mut(slot) {
                            p.readable = true; // a guess: costs one read if wrong
                        }
                        self.mark_read(slot);
                    }
                    None => {
                        self.poll_set(Set::Data);
                    }
                }
                self.read_all();
            }
        }
        match self.arrivals.pop_front() {
            Some(Ok(m)) => {
                self.arrival_bytes -= m.lease.len();
                Ok(m)
            }
            Some(Err(e)) => Err(e),
            None if self.closed && self.peer_count() == 0 => Err(Error::Closed),
            None if self.pool_dry => {
                let st = self.pool.stats();
                Err(Error::Pool(PoolError::Exhausted {
                    used: st.reserved_bytes,
                    cap: st.budget,
                }))
            }
            None => Err(Error::WouldBlock),
        }
    }

    fn progress(&mut self) -> Result<bool, Error> {
        Ok(self.pass(true))
    }

    fn close(&mut self) -> Result<(), Error> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        self.listener = None;
        self.pending.clear();
        for slot in 0..self.peers.len() {
            if let Some(p) = self.peers.at_mut(slot) {
                p.session.close();
                self.control(slot);
            }
        }
        Ok(())
    }
}

impl Wire for TcpTransport {
    const WAKES_POLL: bool = true;

    fn leaser(&self) -> Leaser<StdLease> {
        pool_leaser(Arc::clone(&self.pool))
    }

    fn lease_bell(&self) -> Option<zerohop_backends::HostBell> {
        self.pool.bell().try_clone()
    }

    fn read_lease(&self, lease: &StdLease, out: &mut [u8]) -> Result<(), Error> {
        crate::endpoint::copy_out(host_bytes(lease), out)
    }

    fn poll_fds(&self, out: &mut Vec<libc::pollfd>, waiter: Waiter) {
        let fd = |fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        out.push(fd(self.poller.fd(Set::Ctl)));
        if waiter != (Waiter::Progress { app_polling: true }) {
            out.push(fd(self.poller.fd(Set::Data)));
        }
        // A peer stopped for want of a buffer goes on once one comes back,
        // whichever thread gives it back (the pool's bell, cleared before
        // the read that found the pool dry), for a waiter that reads.
        if self.pool_dry && self.owns_bell && waiter.reads() {
            out.extend(self.pool.bell().fd().map(fd));
        }
    }

    fn prepare_sleep(&mut self, waiter: Waiter) -> bool {
        match waiter {
            Waiter::App { reading: true } => !self.arrivals.is_empty(),
            _ => false,
        }
    }

    fn pending_sends(&self) -> usize {
        self.queued_bytes()
    }

    fn start_send(&mut self, peer: PeerId, bytes: &[u8]) -> Result<bool, Error> {
        self.send_frame(peer, Source::Slice(bytes), true)
            .map_err(|(e, _)| e)
    }

    fn continue_send(&mut self, peer: PeerId, bytes: &[u8]) -> Result<bool, Error> {
        let Some((slot, p)) = self.peers.find_mut(peer) else {
            return Err(Error::PeerLost(peer));
        };
        let Some(d) = p.direct.as_mut() else {
            return Ok(true);
        };
        let lane = p.lane.as_mut().map(|l| &mut l.stream);
        match write_frame(&mut p.stream, lane, &d.header, bytes, d.split, &mut d.sent) {
            Ok(false) => Ok(false),
            Ok(true) => {
                p.direct = None;
                self.mark_write(slot);
                Ok(true)
            }
            // The read side reports the peer lost and drops it.
            Err(_) => {
                p.direct = None;
                Err(Error::PeerLost(peer))
            }
        }
    }

    fn abandon_send(&mut self, peer: PeerId, bytes: &[u8]) {
        let Ok(p) = self.peer_mut(peer) else { return };
        let Some(Direct {
            header,
            split,
            sent,
            ..
        }) = p.direct.take()
        else {
            return;
        };
        // Mid-frame, the message cannot be withdrawn: finish it from a copy.
        let queued = HEADER_LEN + bytes.len() - sent.main - sent.lane;
        p.queued_bytes += queued;
        p.queue.push_front(Out {
            header,
            payload: Payload::Owned(bytes.to_vec()),
            split,
            sent,
            credit: false,
        });
        self.queued_total += queued;
    }

    fn background_progress(&mut self, read: bool) -> Result<bool, Error> {
        Ok(self.pass(read))
    }

    fn take_accepted(&mut self) -> Option<(PeerId, SocketAddr)> {
        TcpTransport::take_accepted(self)
    }

    fn opened(&mut self, peer: PeerId) -> Option<Result<PeerId, Error>> {
        TcpTransport::opened(self, peer)
    }

    fn peers_left(&self) -> usize {
        TcpTransport::peers_left(self)
    }

    fn peer_addr(&self, peer: PeerId) -> Option<SocketAddr> {
        TcpTransport::peer_addr(self, peer)
    }

    fn peer_stats(&self, peer: PeerId) -> Option<SessionStats> {
        TcpTransport::peer_stats(self, peer)
    }
}
