//! The TCP wire: kind `tcp` (heap receive pool) and kind `uma` (the same wire
//! receiving into CUDA managed memory). A driver of core's session engine:
//! sockets, epoll and buffers here; the protocol (Hello, sequence, credit,
//! Close, timers) is the engine's.
//!
//! Readiness comes from edge-triggered epoll ([`Poller`]), so a pass
//! touches the sockets that are ready, whatever the number of peers. An
//! accepted connection holds 32 bytes and a deadline until its Hello: no
//! stage, no pool buffer, no peer id; a lane Hello (below) pairs it with its
//! peer instead. A message's buffer is leased only once its first payload
//! bytes are there, for at most the credit the engine granted, so a header
//! that claims a large message and stops costs nothing.
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
//! acceptor pairs them and acks with its own lane Hello, the first bytes that
//! way; the connecting side stripes only once it has read the ack. A message
//! of at least `stripe_min` bytes leaves with [`DataFlags::STRIPED`]: header
//! and first half on the main connection, the rest on the lane, read straight
//! into the one lease. A striped frame on a connection without a paired lane
//! breaks the wire's rule ([`Error::WireRule`]).

use std::collections::VecDeque;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use zerohop_backends::{host_bytes, host_bytes_mut};
use zerohop_core::session::{DataIn, Inbound, Instant, SendError, Session, SessionConfig};
use zerohop_core::wire::{Frame, FrameKind, Hello, Takes, HEADER_LEN};
use zerohop_core::{
    Capabilities, Error, Kind, Lease, PeerId, PoolError, Received, Rejected, Transport,
};

use crate::endpoint::{pool_leaser, Leaser, Waiter, Wire};
use crate::host::{StdLease, StdPool};
use crate::poller::{Poller, Ready, Set};

const STAGE_BYTES: usize = 64 << 10;
/// The rest of a message at least this long is read straight into its lease.
const DIRECT_MIN: usize = 1 << 10;
/// How far past a message read straight into its lease the same read goes.
const READ_AHEAD: usize = 4 << 10;
/// The default [`TcpConfig::stripe_min`]. Measured on the 16-core H200
/// host (BENCHMARKS.md), striping loses bandwidth from 256 to 768 KiB and
/// gains from 1 MiB up.
pub const STRIPE_MIN: usize = 1 << 20;
/// A message at least this long re-arms quick ACKs (see [`quick_ack`]).
const QUICK_ACK_MIN: usize = 1 << 20;
/// Lanes whose main connection is not there yet, kept at most.
const UNCLAIMED_LANES: usize = 8;
/// How long accepting pauses when the process is out of descriptors.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// How often the idle timers are looked at.
const TIMER_SCAN: Duration = Duration::from_millis(20);
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

/// TCP wire settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpConfig {
    /// Largest message accepted or sent (default 64 MiB).
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
    /// Checksum payloads as well as headers (default off: TCP checksums its segments).
    pub check_payload: bool,
    /// Messages of at least this many bytes are striped over a second
    /// connection per peer (see the module docs); `None`: one connection.
    pub stripe_min: Option<usize>,
    /// A peer silent this long before its Hello or mid-frame is dropped (default 5 s).
    pub idle_timeout: Duration,
    /// Connections that have not said Hello, kept at most; the oldest goes first (default 256).
    pub max_handshakes: usize,
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
            max_handshakes: 256,
        }
    }
}

impl TcpConfig {
    fn session(&self) -> SessionConfig {
        let max = u32::try_from(self.max_message).unwrap_or(u32::MAX);
        SessionConfig {
            window: u32::try_from(self.window).unwrap_or(u32::MAX),
            check_payload: self.check_payload,
            idle_timeout: self.idle_timeout,
            ..SessionConfig::stream(max)
        }
    }
}

/// Payload bytes of a striped message that travel on the main connection:
/// half, rounded down to a page. Both sides compute it from the length.
fn stripe_split(len: usize) -> usize {
    (len / 2) & !4095
}

fn peer_id(slot: usize, gen: u8) -> PeerId {
    PeerId(slot as u32 | u32::from(gen) << 24)
}

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

/// What a send writes from: the caller's bytes (copied only if queued) or a lease.
enum Source<'a> {
    Slice(&'a [u8]),
    Lease(StdLease),
}

impl Source<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            Source::Slice(b) => b,
            Source::Lease(l) => host_bytes(l),
        }
    }
}

/// How far a frame has gone out: on the main connection, and on the lane.
#[derive(Clone, Copy, Debug, Default)]
struct Sent {
    main: usize,
    lane: usize,
}

struct Out {
    header: [u8; HEADER_LEN],
    payload: Payload,
    /// Payload bytes on the main connection (all of them unless striped).
    split: usize,
    sent: Sent,
}

/// A frame written straight from a blocked caller's slice (see
/// [`Wire::start_send`]): the caller passes the same bytes on every call.
struct Direct {
    header: [u8; HEADER_LEN],
    split: usize,
    sent: Sent,
}

/// A data frame whose header the engine took: where its payload goes.
struct Incoming {
    d: DataIn,
    split: usize,
    have: usize,
    lane_have: usize,
}

/// A peer's second connection (the rest of striped payloads, in order).
struct Lane {
    stream: TcpStream,
    token: u32,
    /// The acceptor paired it (connecting side: its ack has been read).
    confirmed: bool,
    ack: [u8; HEADER_LEN],
    ack_have: usize,
    /// Bytes read with its Hello that belong to the first striped payload.
    early: Vec<u8>,
}

impl Lane {
    /// Reads what has arrived of the acceptor's ack: `Ok(true)` once it is
    /// in and names this lane's token.
    fn confirm(&mut self) -> io::Result<bool> {
        while !self.confirmed {
            match self.stream.read(&mut self.ack[self.ack_have..]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => self.ack_have += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
            if self.ack_have == HEADER_LEN {
                self.confirmed = matches!(Frame::decode(&self.ack, 0).map(|d| d.frame),
                    Ok(Frame::Hello(h)) if h.lane == 1 && h.token == self.token);
                if !self.confirmed {
                    return Err(io::ErrorKind::InvalidData.into());
                }
            }
        }
        Ok(true)
    }

    /// Reads into `dst`, the ack and the early bytes first.
    fn read(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        self.confirm()?;
        if !self.early.is_empty() {
            let n = self.early.len().min(dst.len());
            dst[..n].copy_from_slice(&self.early[..n]);
            self.early.drain(..n);
            return Ok(n);
        }
        self.stream.read(dst)
    }
}

/// An accepted connection before its Hello: 32 bytes and a deadline.
struct Pending {
    stream: TcpStream,
    addr: SocketAddr,
    since: StdInstant,
    hello: [u8; HEADER_LEN],
    have: usize,
}

struct Peer {
    stream: TcpStream,
    addr: SocketAddr,
    session: Session,
    stage: Box<[u8]>,
    stage_start: usize,
    stage_end: usize,
    incoming: Option<Incoming>,
    /// The message being received: leased at its first payload bytes.
    lease: Option<StdLease>,
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
    /// The last message was read straight into its lease: the next read
    /// into the stage takes only a header's worth and a little more.
    direct_stream: bool,
}

enum Outcome {
    /// Nothing more until the socket says so.
    Drained,
    /// Stopped with work left (inbox full, pool dry, a message deferred).
    Stopped,
    /// The connection ended: cleanly (the peer closed first) or not.
    Gone { clean: bool },
    /// The peer broke the protocol or the wire's rule.
    Bad(Error),
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
    pending: Vec<Option<Pending>>,
    peers: Vec<(u8, Option<Box<Peer>>)>,
    /// Slots with reading, and with writing, to do without a new event.
    hot_read: VecDeque<usize>,
    hot_write: VecDeque<usize>,
    arrivals: VecDeque<Result<Received<StdLease>, Error>>,
    arrival_bytes: usize,
    unclaimed: VecDeque<Lane>,
    origin: StdInstant,
    next_scan: StdInstant,
    /// `try_recv` calls that found nothing waiting (see [`CTL_EVERY`]).
    polls: u32,
    /// The peer that delivered last: a spinning receiver reads it directly
    /// (see `try_recv`).
    last: Option<usize>,
    /// The last reading pass found a message it could not lease a buffer for.
    pool_dry: bool,
    /// Bytes queued over all peers (each peer's `queued_bytes`, summed as they change).
    queued_total: usize,
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
    ///
    /// # Panics
    /// If the process cannot create an epoll instance (out of descriptors).
    pub fn new(pool: Arc<StdPool>, config: TcpConfig, kind: Kind) -> Self {
        let now = StdInstant::now();
        TcpTransport {
            config,
            pool,
            kind,
            poller: Poller::new().expect("epoll_create1: out of file descriptors"),
            ready: Vec::new(),
            listener: None,
            accept_after: None,
            pending: Vec::new(),
            peers: Vec::new(),
            hot_read: VecDeque::new(),
            hot_write: VecDeque::new(),
            arrivals: VecDeque::new(),
            arrival_bytes: 0,
            unclaimed: VecDeque::new(),
            origin: now,
            next_scan: now,
            polls: 0,
            last: None,
            pool_dry: false,
            queued_total: 0,
            closed: false,
        }
    }

    /// The receive pool.
    pub fn pool(&self) -> &Arc<StdPool> {
        &self.pool
    }

    /// Listens on `addr` (port 0 picks one; see [`local_addr`](Self::local_addr)).
    pub fn listen(&mut self, addr: impl ToSocketAddrs) -> io::Result<SocketAddr> {
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
    /// zerohop, or another version, is reported through `try_recv`.
    pub fn connect(&mut self, addr: SocketAddr, timeout: Duration) -> io::Result<PeerId> {
        let s = TcpStream::connect_timeout(&addr, timeout)?;
        use std::hash::BuildHasher;
        // Unique among the acceptor's peers: a random key over this connection's address.
        let token = std::collections::hash_map::RandomState::new()
            .hash_one((s.local_addr()?, std::process::id())) as u32;
        let session = Session::new(self.config.session(), token, self.now());
        let id = self.add_peer(s, addr, session)?;
        if self.config.stripe_min.is_some() {
            if let Err(e) = self.open_lane(id, addr, timeout, token) {
                log::info!(
                    "tcp: no second connection to {addr} ({e}): large messages go unstriped"
                );
            }
        }
        Ok(id)
    }

    fn open_lane(
        &mut self,
        id: PeerId,
        addr: SocketAddr,
        timeout: Duration,
        token: u32,
    ) -> io::Result<()> {
        let mut lane = TcpStream::connect_timeout(&addr, timeout)?;
        lane.set_nodelay(true)?;
        lane.write_all(&lane_hello(token))?; // first bytes on a fresh connection
        lane.set_nonblocking(true)?;
        let slot = id.0 as usize & 0xFF_FFFF;
        self.poller
            .add(&lane, Set::Data, key(slot, LANE), true, false)?;
        self.poller
            .add(&lane, Set::Ctl, key(slot, LANE), false, true)?;
        let p = self.peer_mut(id).map_err(|_| io::ErrorKind::NotConnected)?;
        p.lane = Some(Lane {
            stream: lane,
            token,
            confirmed: false,
            ack: [0; HEADER_LEN],
            ack_have: 0,
            early: Vec::new(),
        });
        Ok(())
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

    /// Live peers (the Hello received).
    pub fn peer_count(&self) -> usize {
        self.peers
            .iter()
            .filter(|(_, p)| p.as_ref().is_some_and(|p| p.session.is_open()))
            .count()
    }

    /// Accepted connections that have not said Hello yet.
    pub fn handshaking(&self) -> usize {
        self.pending.iter().flatten().count()
    }

    /// A live peer's address.
    pub fn peer_addr(&self, peer: PeerId) -> Option<SocketAddr> {
        self.peer(peer).map(|p| p.addr)
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
        write_part(&mut p.stream, &[], frame, &mut sent)?;
        match sent == frame.len() {
            true => Ok(()),
            false => Err(io::ErrorKind::WouldBlock.into()),
        }
    }

    fn now(&self) -> Instant {
        Instant::from_micros(self.origin.elapsed().as_micros() as u64)
    }

    fn peer(&self, id: PeerId) -> Option<&Peer> {
        match self.peers.get(id.0 as usize & 0xFF_FFFF) {
            Some((gen, Some(p))) if u32::from(*gen) == id.0 >> 24 => Some(p),
            _ => None,
        }
    }

    fn peer_mut(&mut self, id: PeerId) -> Result<&mut Peer, Error> {
        match self.peers.get_mut(id.0 as usize & 0xFF_FFFF) {
            Some((gen, Some(p))) if u32::from(*gen) == id.0 >> 24 => Ok(p),
            _ => Err(Error::UnknownPeer(id)),
        }
    }

    fn id(&self, slot: usize) -> PeerId {
        peer_id(slot, self.peers[slot].0)
    }

    fn add_peer(&mut self, s: TcpStream, addr: SocketAddr, session: Session) -> io::Result<PeerId> {
        s.set_nodelay(true)?;
        s.set_nonblocking(true)?;
        let slot = match self.peers.iter().position(|(_, p)| p.is_none()) {
            Some(i) => i,
            None if self.peers.len() < 1 << 24 => {
                self.peers.push((0, None));
                self.peers.len() - 1
            }
            None => return Err(io::ErrorKind::OutOfMemory.into()),
        };
        self.poller
            .add(&s, Set::Data, key(slot, MAIN), true, false)?;
        self.poller
            .add(&s, Set::Ctl, key(slot, MAIN), false, true)?;
        let token = session.peer().map(|p| p.token);
        self.peers[slot].1 = Some(Box::new(Peer {
            stream: s,
            addr,
            session,
            stage: vec![0u8; STAGE_BYTES].into_boxed_slice(),
            stage_start: 0,
            stage_end: 0,
            incoming: None,
            lease: None,
            queue: VecDeque::new(),
            queued_bytes: 0,
            direct: None,
            lane: None,
            token,
            striped_sent: 0,
            readable: true,
            lane_readable: true,
            hup: false,
            lane_hup: false,
            writable: true,
            in_read: false,
            in_write: false,
            dry: false,
            deferred: false,
            direct_stream: false,
        }));
        self.control(slot);
        self.mark_read(slot);
        Ok(self.id(slot))
    }

    // ----- readiness -----

    /// Takes what epoll says of `set` and notes it on the peers.
    fn poll_set(&mut self, set: Set) -> bool {
        let mut ready = std::mem::take(&mut self.ready);
        ready.clear();
        if let Err(e) = self.poller.ready(set, &mut ready) {
            log::warn!("tcp: epoll_wait failed: {e}");
        }
        let any = !ready.is_empty();
        for r in &ready {
            if r.key == LISTENER {
                self.accept_all();
                continue;
            }
            let (slot, what) = ((r.key >> 2) as usize, r.key & 3);
            if what == PENDING {
                self.handshake(slot);
            } else if let Some((_, Some(p))) = self.peers.get_mut(slot) {
                match what {
                    LANE => {
                        p.lane_readable |= r.read;
                        p.lane_hup |= r.hup;
                    }
                    _ => {
                        p.readable |= r.read;
                        p.hup |= r.hup;
                    }
                }
                p.writable |= r.write;
                if r.read {
                    self.mark_read(slot);
                }
                if r.write {
                    self.mark_write(slot);
                }
            }
        }
        self.ready = ready;
        any
    }

    fn mark_read(&mut self, slot: usize) {
        if let Some((_, Some(p))) = self.peers.get_mut(slot) {
            if !p.in_read {
                p.in_read = true;
                self.hot_read.push_back(slot);
            }
        }
    }

    fn mark_write(&mut self, slot: usize) {
        if let Some((_, Some(p))) = self.peers.get_mut(slot) {
            let work = !p.queue.is_empty() && p.direct.is_none();
            if work && !p.in_write {
                p.in_write = true;
                self.hot_write.push_back(slot);
            }
        }
    }

    fn accept_all(&mut self) -> bool {
        if self.accept_after.is_some_and(|t| StdInstant::now() < t) {
            return false;
        }
        self.accept_after = None;
        let mut any = false;
        while let Some(l) = &self.listener {
            match l.accept() {
                Ok((s, addr)) => {
                    any = true;
                    if let Err(e) = self.add_pending(s, addr) {
                        log::warn!("tcp: accepted {addr} but could not set it up: {e}");
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors (EMFILE) or memory: the connection
                    // waits in the backlog; try again after a pause, not at once.
                    log::warn!("tcp: accept failed: {e}; pausing accepts for {ACCEPT_BACKOFF:?}");
                    self.accept_after = Some(StdInstant::now() + ACCEPT_BACKOFF);
                    break;
                }
            }
        }
        any
    }

    fn add_pending(&mut self, s: TcpStream, addr: SocketAddr) -> io::Result<()> {
        s.set_nonblocking(true)?;
        if self.handshaking() >= self.config.max_handshakes {
            // The oldest connection that never said Hello makes room.
            let oldest = self
                .pending
                .iter()
                .enumerate()
                .filter_map(|(i, p)| Some((i, p.as_ref()?.since)))
                .min_by_key(|&(_, t)| t);
            if let Some((i, _)) = oldest {
                self.pending[i] = None;
            }
        }
        let slot = match self.pending.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.pending.push(None);
                self.pending.len() - 1
            }
        };
        self.poller
            .add(&s, Set::Ctl, key(slot, PENDING), true, false)?;
        self.pending[slot] = Some(Pending {
            stream: s,
            addr,
            since: StdInstant::now(),
            hello: [0; HEADER_LEN],
            have: 0,
        });
        self.handshake(slot);
        Ok(())
    }

    /// Reads an accepted connection's first frame: a Hello makes it a peer
    /// (lane 0) or pairs it with one (lane 1); anything else closes it.
    fn handshake(&mut self, slot: usize) {
        let Some(Some(p)) = self.pending.get_mut(slot) else {
            return;
        };
        loop {
            match p.stream.read(&mut p.hello[p.have..]) {
                Ok(0) => break,
                Ok(n) if p.have + n < HEADER_LEN => p.have += n,
                Ok(_) => {
                    let Some(p) = self.pending[slot].take() else {
                        return;
                    };
                    self.poller.remove(&p.stream, Set::Ctl);
                    return self.hello(p);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(_) => break,
            }
        }
        self.pending[slot] = None; // it left, or broke before its Hello
    }

    fn hello(&mut self, p: Pending) {
        match Frame::decode(&p.hello, 0).map(|d| d.frame) {
            Ok(Frame::Hello(h)) if h.lane == 1 => self.pair(Lane {
                stream: p.stream,
                token: h.token,
                confirmed: true,
                ack: [0; HEADER_LEN],
                ack_have: 0,
                early: Vec::new(),
            }),
            Ok(Frame::Hello(_)) => {
                let mut session = Session::new(self.config.session(), 0, self.now());
                match session.handle_header(self.now(), &p.hello, None) {
                    Ok(_) => {
                        let token = session.peer().map_or(0, |h| h.token);
                        match self.add_peer(p.stream, p.addr, session) {
                            Ok(id) => {
                                if let Some(k) =
                                    self.unclaimed.iter().position(|l| l.token == token)
                                {
                                    let lane = self.unclaimed.remove(k).expect("found");
                                    self.attach_lane(id, lane);
                                }
                            }
                            Err(e) => log::warn!("tcp: {}: could not set up the peer: {e}", p.addr),
                        }
                    }
                    Err(e) => log::info!("tcp: {} refused: {e}", p.addr),
                }
            }
            Ok(other) => log::info!(
                "tcp: {} sent a {} frame before its hello; closed",
                p.addr,
                other.kind().name()
            ),
            Err(e) => log::info!("tcp: {} is not a zerohop peer ({e}); closed", p.addr),
        }
    }

    /// A lane said Hello: joins its peer (by token) or waits for it.
    fn pair(&mut self, lane: Lane) {
        let found = self.peers.iter().position(|(_, p)| {
            p.as_ref()
                .is_some_and(|p| p.token == Some(lane.token) && p.lane.is_none())
        });
        match found {
            Some(slot) => {
                let id = self.id(slot);
                self.attach_lane(id, lane);
            }
            None => {
                if self.unclaimed.len() == UNCLAIMED_LANES {
                    self.unclaimed.pop_front();
                }
                self.unclaimed.push_back(lane);
            }
        }
    }

    /// Acks `lane` (accepting side) and gives it to `id`.
    fn attach_lane(&mut self, id: PeerId, mut lane: Lane) {
        let slot = id.0 as usize & 0xFF_FFFF;
        // The first bytes this way on a fresh connection: the socket takes them whole.
        let ok = lane.stream.write_all(&lane_hello(lane.token)).is_ok()
            && self
                .poller
                .add(&lane.stream, Set::Data, key(slot, LANE), true, false)
                .is_ok()
            && self
                .poller
                .add(&lane.stream, Set::Ctl, key(slot, LANE), false, true)
                .is_ok();
        if let (true, Ok(p)) = (ok, self.peer_mut(id)) {
            p.lane = Some(lane);
            self.mark_read(slot);
        }
    }

    // ----- sending -----

    /// Starts a message for `peer` and writes it at once when nothing is
    /// ahead of it; what the kernel did not take is queued (a slice copied
    /// only then) or, with `direct`, left for the caller to write from its
    /// slice ([`Wire::continue_send`]): then `Ok(false)`. A refused source
    /// comes back with the error.
    #[allow(clippy::result_large_err)]
    fn send_frame<'a>(
        &mut self,
        peer: PeerId,
        src: Source<'a>,
        direct: bool,
    ) -> Result<bool, (Error, Source<'a>)> {
        if self.closed {
            return Err((Error::Closed, src));
        }
        let (max, limit, check, stripe_min) = (
            self.config.max_message,
            self.config.send_queue_bytes,
            self.config.check_payload,
            self.config.stripe_min,
        );
        let len = src.bytes().len();
        if len > max {
            return Err((Error::TooLarge { len, max }, src));
        }
        let slot = peer.0 as usize & 0xFF_FFFF;
        let p = match self.peer_mut(peer) {
            Ok(p) => p,
            Err(e) => return Err((e, src)),
        };
        if p.queued_bytes > 0 && p.queued_bytes + HEADER_LEN + len > limit {
            return Err((Error::WouldBlock, src));
        }
        let mut out = match p.session.send(len) {
            Ok(out) => out,
            Err(e) => {
                self.control(slot); // a Want, when credit is short
                return Err((send_error(e, peer), src));
            }
        };
        let striped = stripe_min.is_some_and(|m| len >= m)
            && p.lane
                .as_mut()
                .is_some_and(|l| matches!(l.confirm(), Ok(true)));
        let Some(f) = p
            .session
            .next_frame(&mut out, check.then(|| src.bytes()), striped)
        else {
            return Err((Error::Backend("tcp: the session framed nothing"), src));
        };
        let header = f.header.unwrap_or([0; HEADER_LEN]);
        let split = if striped { stripe_split(len) } else { len };
        p.striped_sent += u64::from(striped);
        let mut sent = Sent::default();
        let mut done = false;
        if p.queue.is_empty() && p.direct.is_none() {
            // A write error means a dead socket: the read side reports it.
            let lane = p.lane.as_mut().map(|l| &mut l.stream);
            let r = write_frame(&mut p.stream, lane, &header, src.bytes(), split, &mut sent);
            done = matches!(r, Ok(true));
            if r.is_ok() && !done && direct && matches!(src, Source::Slice(_)) {
                p.direct = Some(Direct {
                    header,
                    split,
                    sent,
                });
                return Ok(false);
            }
        }
        if !done {
            let payload = match src {
                Source::Slice(b) => Payload::Owned(b.to_vec()),
                Source::Lease(l) => Payload::Leased(l),
            };
            let queued = HEADER_LEN + len - sent.main - sent.lane;
            p.queued_bytes += queued;
            p.queue.push_back(Out {
                header,
                payload,
                split,
                sent,
            });
            self.queued_total += queued;
        }
        self.control(slot);
        Ok(true)
    }

    /// Queues the control frames the peer's session has due (a Close after
    /// the data; credit ahead of data not yet begun), then writes.
    fn control(&mut self, slot: usize) {
        let Some((_, Some(p))) = self.peers.get_mut(slot) else {
            return;
        };
        while let Some(c) = p.session.poll_control() {
            let out = Out {
                header: c.header,
                payload: Payload::None,
                split: 0,
                sent: Sent::default(),
            };
            // Credit may pass data not yet begun; a Want or the Close names
            // the data before it, and stays behind it.
            let begun = usize::from(p.queue.front().is_some_and(|o| o.sent.main > 0));
            if c.kind == FrameKind::Credit && p.queue.len() > begun {
                p.queue.insert(begun, out);
            } else {
                p.queue.push_back(out);
            }
            p.queued_bytes += HEADER_LEN;
            self.queued_total += HEADER_LEN;
        }
        if !p.queue.is_empty() {
            self.mark_write(slot);
            self.flush(slot);
        }
    }

    fn flush(&mut self, slot: usize) -> bool {
        let Some((_, Some(p))) = self.peers.get_mut(slot) else {
            return false;
        };
        if p.direct.is_some() || !p.writable {
            return false; // a caller is mid-frame from its slice; ours go after it
        }
        let mut any = false;
        let mut broken = false;
        while let Some(front) = p.queue.front_mut() {
            let before = front.sent.main + front.sent.lane;
            let lane = p.lane.as_mut().map(|l| &mut l.stream);
            let r = write_frame(
                &mut p.stream,
                lane,
                &front.header,
                front.payload.bytes(),
                front.split,
                &mut front.sent,
            );
            let moved = front.sent.main + front.sent.lane - before;
            p.queued_bytes -= moved;
            self.queued_total -= moved;
            any |= moved > 0;
            match r {
                Ok(true) => {
                    p.queue.pop_front();
                }
                Ok(false) => {
                    p.writable = false;
                    break;
                }
                Err(_) => {
                    broken = true;
                    break;
                }
            }
        }
        let finished = p.queue.is_empty() && p.session.is_finished() && p.direct.is_none();
        if broken || finished {
            // Both closed with everything out, or a dead socket (clean if
            // the peer had closed first).
            let clean = finished || p.session.peer_closed();
            self.drop_peer(slot, clean);
        }
        any || broken
    }

    fn flush_all(&mut self) -> bool {
        let mut any = false;
        for _ in 0..self.hot_write.len() {
            let Some(slot) = self.hot_write.pop_front() else {
                break;
            };
            if let Some((_, Some(p))) = self.peers.get_mut(slot) {
                p.in_write = false;
            }
            any |= self.flush(slot);
            if let Some((_, Some(p))) = self.peers.get(slot) {
                if p.writable {
                    self.mark_write(slot);
                }
            }
        }
        any
    }

    // ----- receiving -----

    fn inbox_full(&self) -> bool {
        self.arrivals.len() >= self.config.inbox_messages
            || self.arrival_bytes >= self.config.inbox_bytes
    }

    fn read_all(&mut self) -> bool {
        let before = self.arrivals.len();
        self.pool_dry = false;
        for _ in 0..self.hot_read.len() {
            if self.inbox_full() {
                break;
            }
            let Some(slot) = self.hot_read.pop_front() else {
                break;
            };
            let Some((_, Some(p))) = self.peers.get_mut(slot) else {
                continue;
            };
            p.in_read = false;
            let had = self.arrivals.len();
            let outcome = self.read_peer(slot);
            if self.arrivals.len() > had {
                self.last = Some(slot);
            }
            match outcome {
                Outcome::Drained => self.control(slot),
                Outcome::Stopped => {
                    self.control(slot);
                    self.mark_read(slot);
                }
                Outcome::Gone { clean } => self.drop_peer(slot, clean),
                Outcome::Bad(e) => {
                    log::warn!(
                        "tcp: peer {} broke the protocol: {e}; closing it",
                        self.id(slot)
                    );
                    self.arrivals.push_back(Err(e));
                    self.drop_peer(slot, true);
                }
            }
        }
        self.arrivals.len() != before
    }

    fn read_peer(&mut self, slot: usize) -> Outcome {
        let now = self.now();
        let id = self.id(slot);
        let (inbox, inbox_bytes) = (self.config.inbox_messages, self.config.inbox_bytes);
        let Some((_, Some(p))) = self.peers.get_mut(slot) else {
            return Outcome::Drained;
        };
        let protocol = |error| Outcome::Bad(Error::Protocol { peer: id, error });
        loop {
            if self.arrivals.len() >= inbox || self.arrival_bytes >= inbox_bytes {
                return Outcome::Stopped;
            }
            // 1. The payload of the frame whose header the engine took.
            if let Some(inc) = p.incoming.as_mut() {
                let staged = p.stage_end - p.stage_start;
                if p.lease.is_none() {
                    if !inc.d.first {
                        return Outcome::Bad(Error::Backend("tcp: a fragment without its message"));
                    }
                    // Leased once its bytes are there: a header alone costs nothing.
                    if inc.d.len > 0
                        && staged == 0
                        && p.lane.as_ref().is_none_or(|l| l.early.is_empty())
                    {
                        match read_stage(p, READ_AHEAD) {
                            Ok(true) => continue,
                            Ok(false) => return Outcome::Drained,
                            Err(()) => return Outcome::Gone { clean: false },
                        }
                    }
                    // A payload that must come from the socket waits while a
                    // message waits for the application: read now, it would
                    // fill a second, cold buffer; later, the one given back.
                    p.deferred =
                        inc.d.len.saturating_sub(staged) >= DIRECT_MIN && !self.arrivals.is_empty();
                    if p.deferred {
                        return Outcome::Stopped;
                    }
                    match Lease::take(Arc::clone(&self.pool), inc.d.msg_len.max(1)) {
                        Ok(mut l) => {
                            let _ = l.set_len(inc.d.msg_len);
                            p.lease = Some(l);
                            p.dry = false;
                        }
                        Err(e) => {
                            if !matches!(e, Error::Pool(_)) {
                                log::warn!("tcp: receive pool failed: {e}");
                            }
                            p.dry = true;
                            self.pool_dry = true;
                            return Outcome::Stopped;
                        }
                    }
                    if inc.d.len >= QUICK_ACK_MIN {
                        quick_ack(&p.stream);
                        if let (true, Some(l)) = (inc.split < inc.d.len, &p.lane) {
                            quick_ack(&l.stream);
                        }
                    }
                }
                let Some(lease) = p.lease.as_mut() else {
                    return Outcome::Stopped;
                };
                let base = inc.d.offset;
                // 1a. A striped payload's rest, from the lane.
                let mut lane_idle = true;
                let lane_missing = inc.d.len - inc.split - inc.lane_have;
                let lane_ready =
                    p.lane_readable || p.lane.as_ref().is_some_and(|l| !l.early.is_empty());
                if let (true, true, Some(lane)) = (lane_missing > 0, lane_ready, p.lane.as_mut()) {
                    let at = base + inc.split + inc.lane_have;
                    let dst = &mut host_bytes_mut(lease)[at..base + inc.d.len];
                    let asked = dst.len();
                    match lane.read(dst) {
                        Ok(0) => return Outcome::Gone { clean: false },
                        Ok(n) => {
                            inc.lane_have += n;
                            lane_idle = false;
                            p.lane_readable &= n == asked || p.lane_hup || !lane.early.is_empty();
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => p.lane_readable = false,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => lane_idle = false,
                        Err(_) => return Outcome::Gone { clean: false },
                    }
                }
                // 1b. The main connection's part: staged bytes, then the socket.
                let want = inc.split - inc.have;
                let take = staged.min(want);
                if take > 0 {
                    let at = base + inc.have;
                    host_bytes_mut(lease)[at..at + take]
                        .copy_from_slice(&p.stage[p.stage_start..p.stage_start + take]);
                    inc.have += take;
                    p.stage_start += take;
                }
                if inc.have < inc.split {
                    if want - take < DIRECT_MIN {
                        match read_stage(p, STAGE_BYTES) {
                            Ok(true) => continue,
                            Ok(false) if lane_idle => return Outcome::Drained,
                            Ok(false) => continue,
                            Err(()) => return Outcome::Gone { clean: false },
                        }
                    }
                    if !p.readable {
                        if lane_idle {
                            return Outcome::Drained;
                        }
                        continue;
                    }
                    // The rest straight into the lease; a little beyond it into the stage.
                    p.stage_start = 0;
                    p.stage_end = 0;
                    let rest = &mut host_bytes_mut(lease)[base + inc.have..base + inc.split];
                    let into_lease = rest.len();
                    let mut bufs = [
                        IoSliceMut::new(rest),
                        IoSliceMut::new(&mut p.stage[..READ_AHEAD]),
                    ];
                    match p.stream.read_vectored(&mut bufs) {
                        Ok(0) => return Outcome::Gone { clean: false },
                        Ok(n) => {
                            inc.have += n.min(into_lease);
                            p.stage_end = n.saturating_sub(into_lease);
                            p.readable = n == into_lease + READ_AHEAD || p.hup;
                            p.session.handle_activity(now, false);
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            p.readable = false;
                            if lane_idle {
                                return Outcome::Drained;
                            }
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(_) => return Outcome::Gone { clean: false },
                    }
                    continue;
                }
                if inc.lane_have < inc.d.len - inc.split {
                    if lane_idle {
                        return Outcome::Drained; // the lane's readiness brings us back
                    }
                    continue;
                }
                // 1c. The frame is in.
                let (d, len) = (inc.d, inc.d.len);
                p.incoming = None;
                p.direct_stream = len >= DIRECT_MIN;
                let payload = &host_bytes(lease)[d.offset..d.offset + len];
                match p.session.handle_payload(now, Some(payload)) {
                    Ok(Some(done)) => {
                        // Out of the wire's hands: the inbox, bounded on its
                        // own (`inbox_bytes`), holds it for the application.
                        p.session.consumed(done.len);
                        let lease = p.lease.take().expect("leased above");
                        self.arrival_bytes += lease.len();
                        self.arrivals.push_back(Ok(Received { peer: id, lease }));
                    }
                    Ok(None) => {}
                    Err(e) => return protocol(e),
                }
                continue;
            }
            // 2. A header, if one is staged.
            let staged = p.stage_end - p.stage_start;
            if staged >= HEADER_LEN {
                let header = &p.stage[p.stage_start..p.stage_start + HEADER_LEN];
                let inbound = match p.session.handle_header(now, header, None) {
                    Ok(i) => i,
                    Err(e) => return protocol(e),
                };
                p.stage_start += HEADER_LEN;
                match inbound {
                    Inbound::Data(d) => {
                        if d.striped && p.lane.as_ref().is_none_or(|l| !l.confirmed) {
                            return Outcome::Bad(Error::WireRule {
                                peer: id,
                                rule: "a striped frame on a connection without a paired second connection",
                            });
                        }
                        let split = if d.striped {
                            stripe_split(d.len)
                        } else {
                            d.len
                        };
                        p.incoming = Some(Incoming {
                            d,
                            split,
                            have: 0,
                            lane_have: 0,
                        });
                    }
                    Inbound::Closed => self.arrivals.push_back(Err(Error::PeerClosed(id))),
                    // Credit owed, a Close to answer: sent after this pass
                    // (`control`); a Want by the timers, within the budget.
                    Inbound::Want | Inbound::Control | Inbound::Opened => {}
                }
                continue;
            }
            p.session.handle_activity(now, staged > 0);
            // 3. More bytes into the stage.
            let room = if p.direct_stream {
                HEADER_LEN + READ_AHEAD
            } else {
                STAGE_BYTES
            };
            match read_stage(p, room) {
                Ok(true) => {}
                Ok(false) => return Outcome::Drained,
                Err(()) => {
                    return Outcome::Gone {
                        clean: p.session.peer_closed() && staged == 0,
                    }
                }
            }
        }
    }

    /// Removes a peer; an unclean end is reported once as `PeerLost`. What
    /// it held (a partial message, queued sends) goes back with it.
    fn drop_peer(&mut self, slot: usize, clean: bool) {
        let Some((gen, p)) = self.peers.get_mut(slot) else {
            return;
        };
        let Some(p) = p.take() else { return };
        let id = peer_id(slot, *gen);
        *gen = gen.wrapping_add(1);
        self.queued_total -= p.queued_bytes;
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
    fn timers(&mut self) {
        let now = StdInstant::now();
        if now < self.next_scan {
            return;
        }
        self.next_scan = now + TIMER_SCAN;
        let t = self.now();
        let idle = self.config.idle_timeout;
        for p in &mut self.pending {
            if p.as_ref()
                .is_some_and(|p| now.duration_since(p.since) >= idle)
            {
                *p = None;
            }
        }
        let mut granted: u64 = self
            .peers
            .iter()
            .filter_map(|(_, p)| p.as_ref())
            .map(|p| p.session.extra_granted())
            .sum();
        for slot in 0..self.peers.len() {
            let Some((_, Some(p))) = self.peers.get_mut(slot) else {
                continue;
            };
            if let Err(error) = p.session.handle_timeout(t) {
                let id = self.id(slot);
                self.arrivals
                    .push_back(Err(Error::Protocol { peer: id, error }));
                self.drop_peer(slot, true);
                continue;
            }
            if let Some(len) = p.session.pending_grant() {
                if granted + len as u64 <= self.config.grant_budget as u64 {
                    p.session.grant();
                    granted += p.session.extra_granted();
                    self.control(slot);
                }
            }
        }
    }

    /// One pass: readiness, accepts past their back-off, timers, writes,
    /// and (with `read`) reads.
    fn pass(&mut self, read: bool) -> bool {
        let mut any = self.poll_set(Set::Ctl);
        if self.accept_after.is_some() {
            any |= self.accept_all();
        }
        if read {
            any |= self.poll_set(Set::Data);
        }
        self.timers();
        any |= self.flush_all();
        if read {
            any |= self.read_all();
        }
        any
    }
}

fn key(slot: usize, what: u64) -> u64 {
    (slot as u64) << 2 | what
}

fn lane_hello(token: u32) -> [u8; HEADER_LEN] {
    Frame::Hello(Hello {
        window: 0,
        max_message: 0,
        frame_max: 0,
        ring: 0,
        lane: 1,
        takes: Takes::NONE,
        token,
    })
    .encode(&[])
}

fn send_error(e: SendError, peer: PeerId) -> Error {
    match e {
        SendError::NotOpen | SendError::NoCredit => Error::WouldBlock,
        SendError::TooLarge { len, max } => Error::TooLarge { len, max },
        SendError::Closed => Error::Closed,
        SendError::Failed(_) | SendError::SequenceExhausted => Error::UnknownPeer(peer),
    }
}

/// Reads into the stage, up to `room` bytes past its start: `Ok(true)` when
/// bytes came, `Ok(false)` when the socket is drained, `Err` at its end.
fn read_stage(p: &mut Peer, room: usize) -> Result<bool, ()> {
    if p.stage_start == p.stage_end {
        p.stage_start = 0;
        p.stage_end = 0;
    } else if p.stage_start > 0 && p.stage_end + HEADER_LEN > STAGE_BYTES {
        p.stage.copy_within(p.stage_start..p.stage_end, 0);
        p.stage_end -= p.stage_start;
        p.stage_start = 0;
    }
    let end = (p.stage_start + room).min(STAGE_BYTES).max(p.stage_end + 1);
    if end > STAGE_BYTES {
        // A full stage is never read into (a header or a payload empties it first).
        debug_assert!(false, "tcp: read into a full stage");
        return Err(());
    }
    if !p.readable {
        return Ok(false); // drained, as far as the last read could tell
    }
    loop {
        match p.stream.read(&mut p.stage[p.stage_end..end]) {
            Ok(0) => return Err(()),
            Ok(n) => {
                // Short: the socket had no more. Anything later raises a new
                // edge, except an end already reported (then read on to it).
                p.readable = p.stage_end + n == end || p.hup;
                p.stage_end += n;
                return Ok(true);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                p.readable = false;
                return Ok(false);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Err(()),
        }
    }
}

/// Takes `stream` out of TCP's interactive mode, in which it delays its
/// ACKs: a large message after a run of replies waits on them (measured on
/// the 2-vCPU VM: striped 1 MiB streams after ping-pong, 0.89x of one
/// connection without this, 1.11x with it). The kernel leaves the mode again
/// at the next reply, so it is re-armed per large message. Best effort.
fn quick_ack(stream: &TcpStream) {
    let one: libc::c_int = 1;
    // SAFETY: a live socket descriptor, and an int option of the size given.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_QUICKACK,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
}

/// Writes as much of a frame as the sockets take: `header` and
/// `payload[..split]` on the main connection, the rest on `lane`.
/// `Ok(true)` when all of it went.
fn write_frame(
    stream: &mut TcpStream,
    lane: Option<&mut TcpStream>,
    header: &[u8; HEADER_LEN],
    payload: &[u8],
    split: usize,
    sent: &mut Sent,
) -> io::Result<bool> {
    let (first, rest) = payload.split_at(split);
    let main_done = write_part(stream, header, first, &mut sent.main)?;
    let lane_done = match lane {
        _ if sent.lane == rest.len() => true,
        Some(l) => write_part(l, &[], rest, &mut sent.lane)?,
        None => return Err(io::ErrorKind::NotConnected.into()),
    };
    Ok(main_done && lane_done)
}

/// Writes what `stream` takes of `head` then `body`, `written` bytes of
/// them already sent; `Ok(true)` when all of it went.
fn write_part(
    stream: &mut TcpStream,
    head: &[u8],
    body: &[u8],
    written: &mut usize,
) -> io::Result<bool> {
    let total = head.len() + body.len();
    while *written < total {
        let res = if *written < head.len() {
            stream.write_vectored(&[IoSlice::new(&head[*written..]), IoSlice::new(body)])
        } else {
            stream.write(&body[*written - head.len()..])
        };
        match res {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => *written += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
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
                        if let Some((_, Some(p))) = self.peers.get_mut(slot) {
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
            if let Some((_, Some(p))) = self.peers.get_mut(slot) {
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
        let slot = peer.0 as usize & 0xFF_FFFF;
        let Ok(p) = self.peer_mut(peer) else {
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
        });
        self.queued_total += queued;
    }

    fn background_progress(&mut self, read: bool) -> Result<bool, Error> {
        Ok(self.pass(read))
    }
}
