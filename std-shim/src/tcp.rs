//! The TCP wire: kind `tcp` (heap receive pool) and kind `uma` (the same wire
//! receiving into CUDA managed memory).
//!
//! Non-blocking sockets, one per peer (two for large messages: below),
//! framed with core's [`wire`](zerohop_core::wire_v1). Sends go
//! straight to the socket with `writev` when the peer's queue is empty and are
//! copied only for what the kernel did not take; each peer's queue is bounded
//! in bytes, so a receiver that stops reading makes `try_send` say
//! `WouldBlock`. Receives read through a small staging buffer and land in pool
//! leases; a payload larger than what is staged is read straight into its
//! lease, and only once no earlier message waits for the application (so a
//! stream of large messages reuses the buffer the application just gave
//! back, as a program reading into one buffer would). A declared length is
//! checked against `max_message` before anything is leased for it.
//!
//! Large messages are striped over two connections per peer, as UCX's
//! rendezvous uses two lanes: the connecting side opens a second connection
//! (the peer's *lane*) and names both with a token in a Hello frame (`seq`
//! the token, `dst` 0 for the main connection, 1 for the lane). The acceptor
//! pairs them and acks on the lane (its own Hello with the token, the first
//! bytes that way); the connecting side stripes only once it has read the
//! ack, so a striped frame on a connection without a paired lane is a
//! protocol error (`DecodeError::NoLane`), never a wait for a lane that may
//! not come. A message of at least `stripe_min` bytes leaves with the
//! [`Flags::STRIPED`] flag: its header and first half on the main
//! connection, the rest on the lane
//! (payload bytes only, in message order), written one after the other; the
//! receiver reads both halves straight into the one lease. This lets the
//! sender's kernel fill one socket while the receiver copies out of the
//! other, rather than the two taking turns at one socket's lock. A peer
//! without a lane (it never sent a Hello: another implementation, or
//! striping off) gets every message whole on one connection.

use std::collections::VecDeque;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use zerohop_backends::{host_bytes, host_bytes_mut};
use zerohop_core::wire_v1::{DecodeError, Flags, FrameKind, Header, HEADER_LEN};
use zerohop_core::{
    Capabilities, Error, Kind, Lease, PeerId, PoolError, Received, Rejected, Transport,
};

use crate::endpoint::{pool_leaser, Leaser, Waiter, Wire};
use crate::host::{StdLease, StdPool};

const STAGE_BYTES: usize = 64 << 10;
/// The rest of a message at least this long is read straight into its lease.
const DIRECT_MIN: usize = 1 << 10;
/// How far past a message read straight into its lease the same read goes.
const READ_AHEAD: usize = 4 << 10;
/// The default [`TcpConfig::stripe_min`]. Measured on the 16-core H200
/// host (BENCHMARKS.md), striping loses bandwidth from 256 to 768 KiB
/// (0.72-1.01x) and gains from 1 MiB up (1.02-1.45x at 1 MiB, 1.28-1.43x
/// at 4 MiB).
pub const STRIPE_MIN: usize = 1 << 20;

/// A message at least this long re-arms quick ACKs on the connections it
/// arrives on (see [`quick_ack`]).
const QUICK_ACK_MIN: usize = 1 << 20;

/// Lanes whose main connection has not said Hello yet, kept at most (the
/// oldest is closed first): a forged lane Hello cannot pile up sockets.
const UNCLAIMED_LANES: usize = 8;

/// Payload bytes of a striped message that travel on the main connection
/// (the rest go on the lane): half, rounded down to a page. Both sides
/// compute it from the length alone.
fn stripe_split(len: usize) -> usize {
    (len / 2) & !4095
}

/// TCP wire settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpConfig {
    /// Largest message accepted or sent (default 64 MiB).
    pub max_message: usize,
    /// Bytes a peer's send queue may hold before `try_send` says `WouldBlock`
    /// (default 16 MiB; one message larger than this is still taken when the queue is empty).
    pub send_queue_bytes: usize,
    /// Received messages held for the application before reading stops (default 4096).
    pub inbox_messages: usize,
    /// Received bytes held for the application before reading stops (default
    /// 8 MiB): beyond it the kernel's window pushes back on the sender, and
    /// the receive pool stays small however far the sender runs ahead. (A
    /// message too large to be staged is not read at all while another
    /// waits for the application: it stays in the socket.)
    pub inbox_bytes: usize,
    /// Checksum payloads as well as headers (default off: TCP checksums its segments).
    pub check_payload: bool,
    /// Messages of at least this many bytes are striped over a second
    /// connection per peer (see the module docs). `None`: `connect` opens one
    /// connection, and nothing is striped. Striped messages from a peer are
    /// received either way. Default: [`STRIPE_MIN`].
    pub stripe_min: Option<usize>,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            max_message: 64 << 20,
            send_queue_bytes: 16 << 20,
            inbox_messages: 4096,
            inbox_bytes: 8 << 20,
            check_payload: false,
            stripe_min: Some(STRIPE_MIN),
        }
    }
}

enum Payload {
    Owned(Vec<u8>),
    Leased(StdLease),
}

impl Payload {
    fn bytes(&self) -> &[u8] {
        match self {
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

    fn into_payload(self) -> Payload {
        match self {
            Source::Slice(b) => Payload::Owned(b.to_vec()),
            Source::Lease(l) => Payload::Leased(l),
        }
    }
}

/// How far a frame has gone out: `main` bytes of its header and first part
/// on the peer's main connection, `lane` bytes of the rest on its lane.
#[derive(Clone, Copy, Debug, Default)]
struct Sent {
    main: usize,
    lane: usize,
}

impl Sent {
    fn total(&self) -> usize {
        self.main + self.lane
    }
}

struct Outgoing {
    header: [u8; HEADER_LEN],
    payload: Payload,
    /// Payload bytes on the main connection (all of them unless striped).
    split: usize,
    sent: Sent,
}

impl Outgoing {
    fn total(&self) -> usize {
        HEADER_LEN + self.payload.bytes().len()
    }
}

/// A frame written straight from a blocked caller's slice (see
/// [`Wire::start_send`]): the caller passes the same bytes on every call.
struct Direct {
    header: [u8; HEADER_LEN],
    len: usize,
    split: usize,
    sent: Sent,
}

struct Partial {
    header: Header,
    lease: StdLease,
    /// Payload bytes that come on the main connection (the rest on the lane).
    split: usize,
    /// Of those, in the lease.
    have: usize,
    /// Bytes of the rest, from the lane, in the lease.
    lane_have: usize,
}

impl Partial {
    /// Bytes still to come on the lane.
    fn lane_missing(&self) -> usize {
        self.header.len as usize - self.split - self.lane_have
    }
}

/// A peer's second connection: the rest of each striped message's payload,
/// in message order, and nothing else.
struct Lane {
    stream: TcpStream,
    /// The pairing token both connections said Hello with.
    token: u64,
    /// The acceptor has paired it: its Hello back (the ack) is the first
    /// thing on the lane towards the connecting side, which stripes only
    /// after reading it, so a striped frame never reaches an acceptor
    /// whose lane is not paired. The acceptor's own lanes start confirmed.
    confirmed: bool,
    /// The ack, as far as it has arrived (connecting side).
    ack: [u8; HEADER_LEN],
    ack_have: usize,
    /// Bytes read from it before it was known to be a lane (after its
    /// Hello) and not yet taken; they come first.
    early: Vec<u8>,
}

impl Lane {
    /// A lane with nothing read from it beyond its Hello but `early`.
    fn new(stream: TcpStream, token: u64, confirmed: bool, early: Vec<u8>) -> Lane {
        Lane {
            stream,
            token,
            confirmed,
            ack: [0; HEADER_LEN],
            ack_have: 0,
            early,
        }
    }

    /// Reads what has arrived of the acceptor's ack: `Ok(true)` once it is
    /// all in and names this lane's token; an error for anything else.
    fn confirm(&mut self) -> io::Result<bool> {
        while !self.confirmed {
            match self.stream.read(&mut self.ack[self.ack_have..]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => self.ack_have += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
            if self.ack_have == HEADER_LEN {
                let h = Header::decode(&self.ack, 0).map_err(|_| io::ErrorKind::InvalidData)?;
                if h.kind != FrameKind::Hello || h.seq != self.token {
                    return Err(io::ErrorKind::InvalidData.into());
                }
                self.confirmed = true;
            }
        }
        Ok(true)
    }

    /// Reads into `dst` (not empty), the ack first: `Ok(0)` only at end of stream.
    fn read(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        if !self.confirm()? {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        if !self.early.is_empty() {
            let n = self.early.len().min(dst.len());
            dst[..n].copy_from_slice(&self.early[..n]);
            self.early.drain(..n);
            return Ok(n);
        }
        self.stream.read(dst)
    }
}

struct Peer {
    stream: TcpStream,
    addr: SocketAddr,
    stage: Box<[u8]>,
    stage_start: usize,
    stage_end: usize,
    partial: Option<Partial>,
    queue: VecDeque<Outgoing>,
    queued_bytes: usize,
    /// A caller is writing a frame from its own slice; the queue waits behind it.
    direct: Option<Direct>,
    /// The second connection striped messages use (see the module docs).
    lane: Option<Lane>,
    /// The pairing token from this connection's Hello (accepting side).
    token: Option<u64>,
    /// Messages sent to it striped (a statistic).
    striped_sent: u64,
    tx_seq: u64,
    rx_next: u64,
    /// Waiting for a pool buffer: reading from this peer is paused.
    dry: bool,
    /// A large message's header is staged, but a message already waits
    /// for the application: its bytes stay in the socket until that one is
    /// taken (see `read_peer`), and its fd is not polled for reading.
    deferred: bool,
    /// The last message was large enough to be read straight into its lease:
    /// the next read into the stage takes only a header's worth and a
    /// little more, so the next message is not staged and copied whole.
    direct_stream: bool,
    /// We queued our Close frame.
    closing: bool,
    /// Our write side is shut down (Close sent).
    write_shut: bool,
}

impl Peer {
    /// Which of its sockets a reader should wait on, (main, lane): the lane
    /// only while a striped message lacks its rest; the main connection
    /// unless reading it is paused, or the message in progress needs only
    /// its rest from the lane (the bytes behind it would wake the reader
    /// for nothing).
    fn wants_read(&self) -> (bool, bool) {
        match &self.partial {
            Some(part) if part.lane_missing() > 0 => (part.have < part.split, self.lane.is_some()),
            _ => (!self.dry && !self.deferred, false),
        }
    }

    /// Which of its sockets the frame going out now still has bytes for,
    /// (main, lane); the caller's frame, else the queue's first.
    fn wants_write(&self) -> (bool, bool) {
        let (total, split, sent) = match (&self.direct, self.queue.front()) {
            (Some(d), _) => (HEADER_LEN + d.len, d.split, d.sent),
            (None, Some(o)) => (o.total(), o.split, o.sent),
            (None, None) => return (false, false),
        };
        (
            sent.main < HEADER_LEN + split,
            sent.lane < total - HEADER_LEN - split,
        )
    }
}

enum ReadOutcome {
    /// Nothing more to read now.
    Idle,
    /// A Hello frame: the connection is a main one (`lane` false) or the
    /// lane of the main connection with the same `token`.
    Hello { token: u64, lane: bool },
    /// The peer is gone: cleanly (it sent Close), or not.
    Gone { clean: bool },
    /// It sent something that is not a frame.
    Bad(DecodeError),
}

/// A TCP transport with any number of peers.
pub struct TcpTransport {
    config: TcpConfig,
    pool: Arc<StdPool>,
    kind: Kind,
    listener: Option<TcpListener>,
    peers: Vec<Option<Peer>>,
    arrivals: VecDeque<Result<Received<StdLease>, Error>>,
    /// Payload bytes in `arrivals`.
    arrival_bytes: usize,
    /// Lanes that said Hello before their main connection did, by token.
    unclaimed: VecDeque<(u64, Lane)>,
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
    pub fn new(pool: Arc<StdPool>, config: TcpConfig, kind: Kind) -> Self {
        TcpTransport {
            config,
            pool,
            kind,
            listener: None,
            peers: Vec::new(),
            arrivals: VecDeque::new(),
            arrival_bytes: 0,
            unclaimed: VecDeque::new(),
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
        let a = l.local_addr()?;
        self.listener = Some(l);
        Ok(a)
    }

    /// Where it listens, if it does.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// Connects to a listening transport (blocking up to `timeout`), and
    /// opens the peer's lane for striped messages unless `stripe_min` is `None`.
    pub fn connect(&mut self, addr: SocketAddr, timeout: Duration) -> io::Result<PeerId> {
        let s = TcpStream::connect_timeout(&addr, timeout)?;
        let id = self.add_peer(s, addr)?;
        if self.config.stripe_min.is_some() {
            if let Err(e) = self.open_lane(id, addr, timeout) {
                // The peer works on one connection; only large messages lose.
                log::info!(
                    "tcp: no second connection to {addr} ({e}): large messages go unstriped"
                );
            }
        }
        Ok(id)
    }

    /// Says Hello with a fresh token on `id`'s connection, then opens its
    /// lane and says Hello there with the same token.
    fn open_lane(&mut self, id: PeerId, addr: SocketAddr, timeout: Duration) -> io::Result<()> {
        use std::hash::BuildHasher;
        let p = self.peer_mut(id).map_err(|_| io::ErrorKind::NotConnected)?;
        // Unique among the acceptor's peers: this process's random hash
        // keys over this connection's own address.
        let token = std::collections::hash_map::RandomState::new()
            .hash_one((p.stream.local_addr()?, std::process::id()));
        let hello = |lane| Header::control(FrameKind::Hello, 0, lane, token).encode();
        // First on a fresh connection: the socket takes 32 bytes whole.
        p.stream.write_all(&hello(0))?;
        let mut lane = TcpStream::connect_timeout(&addr, timeout)?;
        lane.set_nodelay(true)?;
        lane.write_all(&hello(1))?;
        lane.set_nonblocking(true)?;
        p.lane = Some(Lane::new(lane, token, false, Vec::new()));
        Ok(())
    }

    /// How many connections carry `peer`'s messages: 2 once its lane is
    /// paired (accepting side) and confirmed (connecting side: the ack has
    /// been read, by a large send or a striped receive), so large messages
    /// are striped; else 1. `None` for no such peer.
    pub fn connections(&self, peer: PeerId) -> Option<usize> {
        let p = self.peers.get(peer.0 as usize)?.as_ref()?;
        Some(1 + usize::from(p.lane.as_ref().is_some_and(|l| l.confirmed)))
    }

    /// Messages sent to `peer` striped over its two connections so far (0
    /// for no such peer).
    pub fn striped_sent(&self, peer: PeerId) -> u64 {
        let p = self.peers.get(peer.0 as usize).and_then(Option::as_ref);
        p.map_or(0, |p| p.striped_sent)
    }

    /// Live peers.
    pub fn peer_count(&self) -> usize {
        self.peers.iter().flatten().count()
    }

    /// A live peer's address.
    pub fn peer_addr(&self, peer: PeerId) -> Option<SocketAddr> {
        self.peers.get(peer.0 as usize)?.as_ref().map(|p| p.addr)
    }

    /// Bytes queued for sending, over all peers (0: everything is with the kernel).
    pub fn queued_bytes(&self) -> usize {
        self.peers.iter().flatten().map(|p| p.queued_bytes).sum()
    }

    fn add_peer(&mut self, s: TcpStream, addr: SocketAddr) -> io::Result<PeerId> {
        s.set_nodelay(true)?;
        s.set_nonblocking(true)?;
        let peer = Peer {
            stream: s,
            addr,
            stage: vec![0u8; STAGE_BYTES].into_boxed_slice(),
            stage_start: 0,
            stage_end: 0,
            partial: None,
            queue: VecDeque::new(),
            queued_bytes: 0,
            direct: None,
            lane: None,
            token: None,
            striped_sent: 0,
            tx_seq: 0,
            rx_next: 0,
            dry: false,
            deferred: false,
            direct_stream: false,
            closing: false,
            write_shut: false,
        };
        let slot = self.peers.iter().position(Option::is_none);
        let id = match slot {
            Some(i) => {
                self.peers[i] = Some(peer);
                i
            }
            None => {
                self.peers.push(Some(peer));
                self.peers.len() - 1
            }
        };
        Ok(PeerId(id as u32))
    }

    fn accept_all(&mut self) -> bool {
        let mut any = false;
        while let Some(l) = &self.listener {
            match l.accept() {
                Ok((s, addr)) => {
                    any = true;
                    if let Err(e) = self.add_peer(s, addr) {
                        log::warn!("tcp: accepted {addr} but could not set it up: {e}");
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    log::warn!("tcp: accept failed: {e}");
                    break;
                }
            }
        }
        any
    }

    fn peer_mut(&mut self, peer: PeerId) -> Result<&mut Peer, Error> {
        match self.peers.get_mut(peer.0 as usize) {
            Some(Some(p)) if !p.closing => Ok(p),
            _ => Err(Error::UnknownPeer(peer)),
        }
    }

    /// Writes one data frame at once when nothing is ahead of it for this
    /// peer, from the caller's slice or lease. What the kernel did not take
    /// is queued (a slice is copied only then), or, with `direct`, left for
    /// the caller to write from its slice ([`Wire::continue_send`]): then
    /// `Ok(false)`. Refused sources come back with the error (a lease rides
    /// back in it; boxing it would allocate on the back-pressure path).
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
        let p = match self.peer_mut(peer) {
            Ok(p) => p,
            Err(e) => return Err((e, src)),
        };
        if p.queued_bytes > 0 && p.queued_bytes + HEADER_LEN + len > limit {
            return Err((Error::WouldBlock, src));
        }
        // (A lane not yet confirmed is checked for the ack here: a sender
        // that never receives still starts striping.)
        let striped = stripe_min.is_some_and(|m| len >= m)
            && p.lane
                .as_mut()
                .is_some_and(|l| matches!(l.confirm(), Ok(true)));
        let (split, extra) = match striped {
            true => (stripe_split(len), Flags::STRIPED),
            false => (len, Flags::NONE),
        };
        p.striped_sent += u64::from(striped);
        let header = Header::data(0, 0, p.tx_seq, src.bytes(), check, extra).encode();
        p.tx_seq += 1;
        let mut sent = Sent::default();
        if p.queue.is_empty() && p.direct.is_none() {
            // A write error means a dead socket: the read side reports the
            // peer lost, and this message, queued, fails with it.
            let lane = p.lane.as_mut().map(|l| &mut l.stream);
            let done = write_frame(&mut p.stream, lane, &header, src.bytes(), split, &mut sent);
            if matches!(done, Ok(true)) {
                return Ok(true);
            }
            if done.is_ok() && direct && matches!(src, Source::Slice(_)) {
                p.direct = Some(Direct {
                    header,
                    len,
                    split,
                    sent,
                });
                return Ok(false);
            }
        }
        let out = Outgoing {
            header,
            payload: src.into_payload(),
            split,
            sent,
        };
        p.queued_bytes += out.total() - sent.total();
        p.queue.push_back(out);
        Ok(true)
    }

    fn flush_all(&mut self) -> bool {
        let mut any = false;
        let mut lost = Vec::new();
        for (i, slot) in self.peers.iter_mut().enumerate() {
            let Some(p) = slot else { continue };
            match flush_peer(p) {
                Ok(progressed) => any |= progressed,
                Err(_) => lost.push(i),
            }
            if p.closing && p.queue.is_empty() && !p.write_shut {
                let _ = p.stream.shutdown(Shutdown::Write);
                if let Some(l) = &p.lane {
                    let _ = l.stream.shutdown(Shutdown::Write);
                }
                p.write_shut = true;
            }
        }
        for i in lost {
            self.drop_peer(i, false);
        }
        any
    }

    fn read_all(&mut self) -> bool {
        let mut any = false;
        let mut i = 0;
        let mut paired = false;
        while i < self.peers.len() {
            if self.inbox_full() {
                break;
            }
            let before = self.arrivals.len();
            let outcome = self.read_peer(i);
            any |= self.arrivals.len() != before;
            match outcome {
                ReadOutcome::Idle => {}
                ReadOutcome::Hello { token, lane } => {
                    paired |= self.hello(i, token, lane);
                    continue; // this connection again: bytes may follow the Hello
                }
                ReadOutcome::Gone { clean } => {
                    any = true;
                    self.drop_peer(i, clean);
                }
                ReadOutcome::Bad(error) => {
                    any = true;
                    log::warn!("tcp: peer #{i} sent an invalid frame: {error}; closing it");
                    self.arrivals.push_back(Err(Error::Protocol {
                        peer: PeerId(i as u32),
                        error: error.into(),
                    }));
                    self.drop_peer(i, true);
                }
            }
            i += 1;
            if i == self.peers.len() && std::mem::take(&mut paired) {
                // A lane joined a peer already passed: its early bytes may
                // be all that a striped message waits for (no socket
                // readiness would say so), so look at every peer again.
                i = 0;
            }
        }
        any
    }

    /// A Hello on connection `i` (which must have said nothing before):
    /// a main connection records its token and takes its lane if that came
    /// first; a lane leaves the peer table for its main connection, or waits
    /// for it. Returns whether a lane was paired.
    fn hello(&mut self, i: usize, token: u64, lane: bool) -> bool {
        let Some(p) = self.peers[i].as_mut() else {
            return false;
        };
        let fresh = p.token.is_none() && p.lane.is_none() && p.rx_next == 0 && p.partial.is_none();
        if !fresh {
            log::warn!("tcp: peer #{i} said Hello again; ignored");
            return false;
        }
        if !lane {
            p.token = Some(token);
            let Some(k) = self.unclaimed.iter().position(|(t, _)| *t == token) else {
                return false;
            };
            let Some((_, lane)) = self.unclaimed.remove(k) else {
                return false;
            };
            return pair(p, lane);
        }
        let Some(p) = self.peers[i].take() else {
            return false;
        };
        let early = p.stage[p.stage_start..p.stage_end].to_vec();
        let lane = Lane::new(p.stream, token, true, early);
        let main = self
            .peers
            .iter_mut()
            .flatten()
            .find(|q| q.token == Some(token) && q.lane.is_none());
        match main {
            Some(q) => pair(q, lane),
            None => {
                if self.unclaimed.len() == UNCLAIMED_LANES {
                    self.unclaimed.pop_front();
                }
                self.unclaimed.push_back((token, lane));
                false
            }
        }
    }

    /// Removes a peer; a dirty exit is reported once as `PeerLost`. Its partial
    /// message and queued sends are dropped here, returning their leases.
    fn drop_peer(&mut self, i: usize, clean: bool) {
        if let Some(p) = self.peers[i].take() {
            let undelivered = p.queue.len();
            if !clean {
                log::info!(
                    "tcp: peer #{i} ({}) lost; {undelivered} queued message(s) not delivered",
                    p.addr
                );
                self.arrivals
                    .push_back(Err(Error::PeerLost(PeerId(i as u32))));
            }
        }
    }

    fn read_peer(&mut self, i: usize) -> ReadOutcome {
        let (max, inbox, inbox_bytes) = (
            self.config.max_message,
            self.config.inbox_messages,
            self.config.inbox_bytes,
        );
        let Some(p) = self.peers[i].as_mut() else {
            return ReadOutcome::Idle;
        };
        loop {
            if self.arrivals.len() >= inbox || self.arrival_bytes >= inbox_bytes {
                return ReadOutcome::Idle;
            }
            // 1. Finish the message in progress.
            if let Some(part) = p.partial.as_mut() {
                // 1a. A striped message's rest, from the lane into its place
                // (on the connecting side, the acceptor's ack is read first).
                let mut lane_idle = true;
                if let (true, Some(lane)) = (part.lane_missing() > 0, p.lane.as_mut()) {
                    let at = part.split + part.lane_have;
                    match lane.read(&mut host_bytes_mut(&mut part.lease)[at..]) {
                        Ok(0) => return ReadOutcome::Gone { clean: false },
                        Ok(n) => {
                            part.lane_have += n;
                            lane_idle = false;
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => lane_idle = false,
                        Err(_) => return ReadOutcome::Gone { clean: false },
                    }
                }
                // 1b. The main connection's part: staged bytes first, then the socket.
                let want = part.split - part.have;
                let staged = (p.stage_end - p.stage_start).min(want);
                if staged > 0 {
                    host_bytes_mut(&mut part.lease)[part.have..part.have + staged]
                        .copy_from_slice(&p.stage[p.stage_start..p.stage_start + staged]);
                    part.have += staged;
                    p.stage_start += staged;
                }
                if part.have == part.split && part.lane_missing() > 0 {
                    // Only the lane's part is missing.
                    if lane_idle {
                        return ReadOutcome::Idle;
                    }
                    continue;
                }
                if part.have < part.split {
                    if want - staged >= DIRECT_MIN {
                        // The stage is empty (its bytes went into the lease):
                        // read the rest of this part straight into its
                        // lease, and only a little beyond it (the next header
                        // and a prefix, copied later) into the stage.
                        p.stage_start = 0;
                        p.stage_end = 0;
                        let rest = &mut host_bytes_mut(&mut part.lease)[part.have..part.split];
                        let into_lease = rest.len();
                        let mut bufs = [
                            IoSliceMut::new(rest),
                            IoSliceMut::new(&mut p.stage[..READ_AHEAD]),
                        ];
                        match p.stream.read_vectored(&mut bufs) {
                            Ok(0) => return ReadOutcome::Gone { clean: false },
                            Ok(n) => {
                                part.have += n.min(into_lease);
                                p.stage_end = n.saturating_sub(into_lease);
                            }
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                                if lane_idle {
                                    return ReadOutcome::Idle;
                                }
                            }
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                            Err(_) => return ReadOutcome::Gone { clean: false },
                        }
                        continue;
                    }
                } else {
                    let part = p.partial.take().expect("checked above");
                    if part
                        .header
                        .flags
                        .contains(zerohop_core::wire_v1::Flags::PAYLOAD_CHECKED)
                    {
                        if let Err(e) = part.header.verify(host_bytes(&part.lease)) {
                            return ReadOutcome::Bad(e);
                        }
                    }
                    if part.header.seq != p.rx_next {
                        self.arrivals.push_back(Err(Error::SequenceGap {
                            peer: PeerId(i as u32),
                            expected: p.rx_next,
                            got: part.header.seq,
                        }));
                    }
                    p.rx_next = part.header.seq + 1;
                    p.direct_stream = part.header.len as usize >= DIRECT_MIN;
                    self.arrival_bytes += part.lease.len();
                    self.arrivals.push_back(Ok(Received {
                        peer: PeerId(i as u32),
                        lease: part.lease,
                    }));
                    continue;
                }
            }
            // 2. A header, if one is staged.
            if p.partial.is_none() && p.stage_end - p.stage_start >= HEADER_LEN {
                let h = match Header::decode(&p.stage[p.stage_start..p.stage_end], max) {
                    Ok(h) => h,
                    Err(e) => return ReadOutcome::Bad(e),
                };
                match h.kind {
                    FrameKind::Data => {
                        let len = h.len as usize;
                        if h.flags.contains(Flags::STRIPED) && p.lane.is_none() {
                            return ReadOutcome::Bad(DecodeError::NoLane);
                        }
                        // A payload that must be read from the socket into
                        // its own lease waits while a message is already
                        // waiting for the application: reading it now would
                        // fill a second (cache-cold) buffer, and a stream
                        // would cycle through the whole inbox's worth. Left
                        // in the socket, it is read into the buffer the
                        // application is about to give back.
                        let staged = p.stage_end - p.stage_start - HEADER_LEN;
                        p.deferred =
                            len.saturating_sub(staged) >= DIRECT_MIN && !self.arrivals.is_empty();
                        if p.deferred {
                            return ReadOutcome::Idle;
                        }
                        let mut lease = match Lease::take(Arc::clone(&self.pool), len.max(1)) {
                            Ok(l) => l,
                            Err(Error::Pool(_)) => {
                                p.dry = true;
                                return ReadOutcome::Idle;
                            }
                            Err(e) => {
                                log::warn!("tcp: receive pool failed: {e}");
                                p.dry = true;
                                return ReadOutcome::Idle;
                            }
                        };
                        p.dry = false;
                        let _ = lease.set_len(len);
                        p.stage_start += HEADER_LEN;
                        let split = match h.flags.contains(Flags::STRIPED) {
                            true => stripe_split(len),
                            false => len,
                        };
                        if len >= QUICK_ACK_MIN {
                            quick_ack(&p.stream);
                            if let (true, Some(l)) = (split < len, &p.lane) {
                                quick_ack(&l.stream);
                            }
                        }
                        p.partial = Some(Partial {
                            header: h,
                            lease,
                            split,
                            have: 0,
                            lane_have: 0,
                        });
                    }
                    FrameKind::Close => return ReadOutcome::Gone { clean: true },
                    FrameKind::Hello => {
                        p.stage_start += HEADER_LEN;
                        return ReadOutcome::Hello {
                            token: h.seq,
                            lane: h.dst == 1,
                        };
                    }
                    FrameKind::Credit => p.stage_start += HEADER_LEN,
                }
                continue;
            }
            // 3. More bytes into the stage.
            if p.stage_start == p.stage_end {
                p.stage_start = 0;
                p.stage_end = 0;
            } else if p.stage_start > 0 && p.stage_end == STAGE_BYTES {
                p.stage.copy_within(p.stage_start..p.stage_end, 0);
                p.stage_end -= p.stage_start;
                p.stage_start = 0;
            }
            let room = if p.direct_stream {
                (p.stage_end + READ_AHEAD).min(STAGE_BYTES)
            } else {
                STAGE_BYTES
            };
            match p.stream.read(&mut p.stage[p.stage_end..room]) {
                Ok(0) => {
                    let clean = p.partial.is_none() && p.stage_start == p.stage_end && p.closing;
                    return ReadOutcome::Gone { clean };
                }
                Ok(n) => p.stage_end += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return ReadOutcome::Idle,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return ReadOutcome::Gone { clean: false },
            }
        }
    }

    fn inbox_full(&self) -> bool {
        self.arrivals.len() >= self.config.inbox_messages
            || self.arrival_bytes >= self.config.inbox_bytes
    }

    fn pool_dry(&self) -> bool {
        self.peers.iter().flatten().any(|p| p.dry)
    }
}

/// Takes `stream` out of TCP's interactive mode, which it enters when it
/// sends soon after receiving (replies, a ping-pong) and in which it delays
/// its ACKs: a large message that then arrives waits on them. Measured on
/// the 2-vCPU VM, 1 MiB streams after 200 ping-pong round trips: striped
/// 0.89x of one connection without this, 1.11x with it (BENCHMARKS.md).
/// The kernel leaves the mode again at the next reply, so it is re-armed
/// per large message (one `setsockopt` per MiB or more). Best effort.
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

/// Pairs `lane` with main connection `p` (accepting side) and acks it on the
/// lane, so the connecting side starts striping. Returns whether it paired:
/// a lane that cannot take the ack is dropped (the peer keeps one connection).
fn pair(p: &mut Peer, mut lane: Lane) -> bool {
    let ack = Header::control(FrameKind::Hello, 0, 1, lane.token).encode();
    // The first bytes this way on a fresh connection: the socket takes them whole.
    if let Err(e) = lane.stream.write_all(&ack) {
        log::info!(
            "tcp: could not ack the second connection of {} ({e})",
            p.addr
        );
        return false;
    }
    lane.confirmed = true;
    p.lane = Some(lane);
    true
}

/// Writes as much of a frame as the sockets take: `header` and
/// `payload[..split]` on the main connection, `payload[split..]` (a striped
/// frame's rest) on `lane`, one after the other, so the receiver copies out
/// of one while the kernel fills the other. `Ok(true)` when all of it went.
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
        // Striped frames are made only for peers with a lane, which they keep.
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

fn flush_peer(p: &mut Peer) -> io::Result<bool> {
    if p.direct.is_some() {
        // A caller is mid-frame from its own slice; ours go after it.
        return Ok(false);
    }
    let mut any = false;
    while let Some(front) = p.queue.front_mut() {
        let before = front.sent.total();
        let lane = p.lane.as_mut().map(|l| &mut l.stream);
        let done = write_frame(
            &mut p.stream,
            lane,
            &front.header,
            front.payload.bytes(),
            front.split,
            &mut front.sent,
        )?;
        let moved = front.sent.total() - before;
        p.queued_bytes -= moved;
        any |= moved > 0;
        if !done {
            break;
        }
        p.queue.pop_front();
    }
    Ok(any)
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
        // Reads only: accepting is `progress`'s, so a polling receiver makes
        // one system call per peer, not two.
        if self.arrivals.is_empty() {
            self.read_all();
        }
        match self.arrivals.pop_front() {
            Some(r) => {
                if let Ok(m) = &r {
                    self.arrival_bytes -= m.lease.len();
                }
                r
            }
            None if self.closed && self.peer_count() == 0 => Err(Error::Closed),
            None if self.pool_dry() => {
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
        let accepted = self.accept_all();
        let flushed = self.flush_all();
        let read = self.read_all();
        Ok(accepted || flushed || read)
    }

    fn close(&mut self) -> Result<(), Error> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        self.listener = None;
        for p in self.peers.iter_mut().flatten() {
            let header = Header::control(FrameKind::Close, 0, 0, p.tx_seq).encode();
            p.queue.push_back(Outgoing {
                header,
                payload: Payload::Owned(Vec::new()),
                split: 0,
                sent: Sent::default(),
            });
            p.queued_bytes += HEADER_LEN;
            p.closing = true;
        }
        self.flush_all();
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
        let (accept, data) = match waiter {
            Waiter::Progress { app_polling } => (true, !app_polling),
            Waiter::App { reading } => (false, reading),
        };
        if let (true, Some(l)) = (accept, &self.listener) {
            out.push(libc::pollfd {
                fd: l.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let reading = data && !self.inbox_full();
        for p in self.peers.iter().flatten() {
            let (read_main, read_lane) = match reading {
                true => p.wants_read(),
                false => (false, false),
            };
            // The queue can move only when no caller is mid-frame; that
            // caller waits for room itself.
            let writable = match waiter {
                Waiter::Progress { .. } => p.direct.is_none(),
                Waiter::App { .. } => true,
            };
            let (write_main, write_lane) = match writable {
                true => p.wants_write(),
                false => (false, false),
            };
            let events = |r: bool, w: bool| {
                (if r { libc::POLLIN } else { 0 }) | (if w { libc::POLLOUT } else { 0 })
            };
            let mut push = |fd, events| {
                if events != 0 {
                    out.push(libc::pollfd {
                        fd,
                        events,
                        revents: 0,
                    });
                }
            };
            push(p.stream.as_raw_fd(), events(read_main, write_main));
            if let Some(l) = &p.lane {
                push(l.stream.as_raw_fd(), events(read_lane, write_lane));
            }
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
        let out = Outgoing {
            header,
            payload: Payload::Owned(bytes.to_vec()),
            split,
            sent,
        };
        p.queued_bytes += out.total() - sent.total();
        p.queue.push_front(out);
    }

    fn background_progress(&mut self, read: bool) -> Result<bool, Error> {
        let accepted = self.accept_all();
        let flushed = self.flush_all();
        let read = read && self.read_all();
        Ok(accepted || flushed || read)
    }
}
