//! RC queue pairs over librdmacm: the `rdma` and `gpudirect` transports
//! (the same wire; [`PayloadMemory`] says where payloads live). A driver of
//! core's session engine: queue pairs, posted buffers and completions here;
//! the protocol (Hello, sequence, credit, fragments, Close, timers) is the
//! engine's.
//!
//! Each connection has an RC queue pair with one completion queue (and its
//! completion channel, so a thread can sleep in `poll(2)`), and a ring of
//! `recv_depth` posted receives for data frames and a few more for control
//! frames: the engine's frame credits count both, so the peer never meets a
//! receiver without a buffer. A frame leaves as its
//! header (from a registered header slot) then its payload, or *headerless*
//! (a one-fragment message to a peer whose Hello says it takes them): its
//! bytes alone, with a send-with-immediate carrying its sequence number's
//! low bits and the credits returned, so a 64 B message is 64 B on the
//! wire. Frames that fit the QP's inline room go inline (copied into the
//! work request, straight from the caller's bytes or a host lease) and ask
//! for a completion one in 16. A host payload is received whole into one
//! pool buffer, header first, and handed on from past the header; a device
//! payload is received as two entries, the header into a host header slot
//! and the payload into GPU memory, so the CPU never reads a header out of
//! device memory (and only a host receiver takes headerless frames).
//!
//! Connections come and go in [`connect`] (listening, connecting,
//! accepting, the connection manager's events); the receive ring and what
//! arrives in it are [`recv`]'s, the send slots [`slots`]'; this module
//! is the rest of the data path: queueing, posting, completions, progress.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use rdma_sys as ffi;
use zerohop_core::session::{
    DataFrame, HostRole, Instant, Outgoing, ProtocolError, SendError, Session, SessionConfig,
    SessionStats, Stall, MIN_RING,
};
use zerohop_core::wire::{DataFlags, HEADER_LEN};
use zerohop_core::{
    Access, Capabilities, Error, Kind, Lease, PeerId, PoolConfig, Received, Rejected, SizeClasses,
    Transport,
};

use super::cm::{CmEvent, CmId, EventChannel, Qp, QpShape, RejectReason};
use super::payload::{HostPayload, PayloadLease, PayloadMemory, PayloadPool};
use super::{Device, Registry, VerbsError};
use crate::{host_bytes_mut, HeapTables, HostPool, PeerLimits, PeerSlots, SessionClock};

mod connect;
mod recv;
mod slots;

pub use connect::{Dialed, Dialer};
use recv::{arrive, receive_classes, Held};
use slots::SendSlots;

/// Frame headers live in host memory whatever the payloads' memory: the CPU parses them.
type HeaderPool = HostPool<HeapTables>;
type HeaderLease = Lease<Arc<HeaderPool>>;

/// Settings of the verbs wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RdmaConfig {
    /// Receives kept posted per connection for data frames (the peer's
    /// frame credits), besides [`CONTROL_SLOTS`](zerohop_core::session::CONTROL_SLOTS)
    /// more for control frames; at least [`MIN_RECV_DEPTH`]. Each holds a
    /// receive buffer of `fragment` bytes and a header from the receive
    /// pool (any frame may land in any posted buffer).
    pub recv_depth: u32,
    /// Largest payload of one frame; longer messages are fragmented.
    pub fragment: usize,
    /// Largest message (default 64 MiB).
    pub max_message: usize,
    /// Message bytes a peer may have on their way before this side returns
    /// credit (default 64 MiB); a longer message is granted when it comes.
    pub window: usize,
    /// Budget of the receive pool (registered memory the NIC writes).
    pub recv_pool_bytes: usize,
    /// Budget of the send pool (registered memory for copies).
    pub send_pool_bytes: usize,
    /// Take headerless frames (see the module docs); only a receiver whose
    /// payloads land in host memory does, and says so in its Hello. Default on.
    pub headerless: bool,
    /// A peer silent this long before its Hello or mid-message fails (default 5 s).
    pub idle_timeout: Duration,
    /// Bytes a second a peer's message under way must keep up, after the
    /// idle timeout's grace (default [`MIN_RATE`](zerohop_core::session::MIN_RATE); 0: none).
    pub min_rate: u32,
    /// Accepted peers kept at most, overall and from one address (peers
    /// this side connected to do not count): past either, a connect
    /// request is rejected before any queue pair is made for it.
    pub peer_limits: PeerLimits,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            recv_depth: 64,
            fragment: 64 << 10,
            max_message: 64 << 20,
            window: 64 << 20,
            recv_pool_bytes: 512 << 20,
            send_pool_bytes: 256 << 20,
            headerless: true,
            idle_timeout: Duration::from_secs(5),
            min_rate: zerohop_core::session::MIN_RATE,
            peer_limits: PeerLimits::default(),
        }
    }
}

/// The shallowest receive ring (see [`zerohop_core::session::MIN_RING`]).
pub const MIN_RECV_DEPTH: u32 = MIN_RING as u32;

const SEND_TAG: u64 = 1 << 63;
/// The host pool of header rings, shared by every connection of a transport.
const HEADER_POOL_BYTES: usize = 16 << 20;
/// Inline room asked of a QP: a header and a small message.
const INLINE_WANT: usize = 256;
/// Work completions taken per `ibv_poll_cq`.
const POLL_BATCH: usize = 16;
/// How often the engines' idle timers are looked at.
const TIMER_SCAN: Duration = Duration::from_millis(20);

/// Where a queued message's remaining bytes are.
enum Parts<M: PayloadMemory> {
    /// Copies, one registered buffer per fragment, in order: (buffer, length).
    Copies(VecDeque<(PayloadLease<M>, usize)>),
    /// A buffer of our own registered pools, sent as it is (one fragment).
    Lease(PayloadLease<M>),
    /// An empty message.
    Empty,
}

/// A message started in the engine and waiting for frame credits or send slots.
struct OutMsg<M: PayloadMemory> {
    out: Outgoing,
    parts: Parts<M>,
}

struct Conn<M: PayloadMemory> {
    /// First: dropped (disconnected and destroyed) before the buffers below.
    qp: Qp,
    session: Session,
    headers: HeaderLease,
    recv: Vec<Option<PayloadLease<M>>>,
    /// Receive slots with no buffer posted (see `refill`).
    unposted: Vec<u32>,
    /// The last refill stopped with slots left for want of a buffer: the
    /// pool was dry (the application holds the buffers).
    recv_dry: bool,
    send: SendSlots<PayloadLease<M>>,
    queue: VecDeque<OutMsg<M>>,
    /// A message being reassembled from its fragments.
    assembling: Option<PayloadLease<M>>,
    /// What waits for a buffer for a message ahead, in order (see `Held`).
    held: VecDeque<Held<M>>,
    /// The connection is up: the CM said so, or (accepting side) a frame
    /// from the peer arrived first.
    established: bool,
    /// The peer's address (where we connected, or whence its request came).
    addr: Option<SocketAddr>,
    /// The peer connected to our listener: its Hello is news for the application.
    accepted: bool,
}

/// An RDMA transport: RC connections to any number of peers.
pub struct RdmaTransport<M: PayloadMemory = HostPayload> {
    device: Arc<Device>,
    config: RdmaConfig,
    memory: M,
    header_pool: Arc<HeaderPool>,
    recv_pool: Arc<M::Pool>,
    send_pool: Arc<M::Pool>,
    listener: Option<CmId>,
    /// Boxed: the fast paths take a connection out of the table and put it back.
    peers: PeerSlots<Box<Conn<M>>>,
    arrivals: VecDeque<Result<Received<PayloadLease<M>>, Error>>,
    /// What connections that went left waiting for a buffer (see `Held`).
    orphans: VecDeque<(PeerId, VecDeque<Held<M>>)>,
    /// Peers that connected to the listener and said Hello, not yet taken.
    accepted: VecDeque<(PeerId, SocketAddr)>,
    /// The sessions' clock (see `now`).
    session_clock: SessionClock,
    next_scan: StdInstant,
    /// When a message waiting for a buffer may next be judged (see `whole`).
    next_judge: StdInstant,
    /// The timers' looks: a long gap is the application's absence.
    looks: crate::Looks,
    closed: bool,
}

impl<M: PayloadMemory> std::fmt::Debug for RdmaTransport<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaTransport")
            .field("kind", &self.memory.kind())
            .field("device", &self.device.name())
            .field("peers", &self.peer_count())
            .finish_non_exhaustive()
    }
}

impl RdmaTransport<HostPayload> {
    /// The `rdma` kind on `device`: payloads in registered host memory.
    pub fn new(device: Arc<Device>, config: RdmaConfig) -> Result<Self, Error> {
        Self::with_memory(device, config, HostPayload)
    }
}

impl<M: PayloadMemory> RdmaTransport<M> {
    /// A transport on `device` whose payloads live in `memory` (host memory:
    /// `rdma`; GPU memory: `gpudirect`), with its own registered pools.
    ///
    /// Its longest message is at most what the receive pool can hold: a
    /// peer is never told it may send what could never be received.
    pub fn with_memory(
        device: Arc<Device>,
        mut config: RdmaConfig,
        memory: M,
    ) -> Result<Self, Error> {
        if config.recv_depth < MIN_RECV_DEPTH || config.recv_depth > u32::from(u16::MAX) {
            return Err(Error::BadConfig(
                "RdmaConfig::recv_depth must be between verbs::MIN_RECV_DEPTH and 65535",
            ));
        }
        config.peer_limits.check().map_err(Error::BadConfig)?;
        let classes = receive_classes(Self::receive_buffer_len(config.fragment))?;
        let held = PoolConfig {
            classes,
            ..PoolConfig::with_budget(config.recv_pool_bytes)
        }
        .fitted();
        config.max_message = config.max_message.min(held.largest_lease());
        let registry = Registry::new(Arc::clone(&device));
        // Receive buffers need local write (the NIC writes them); send buffers only local read.
        let recv_pool = memory.pool(
            &registry,
            config.recv_pool_bytes,
            Access::LOCAL_WRITE,
            classes,
        )?;
        let send_pool = memory.pool(
            &registry,
            config.send_pool_bytes,
            Access::NONE,
            SizeClasses::DEFAULT,
        )?;
        let header_pool = HostPayload.pool(
            &registry,
            HEADER_POOL_BYTES,
            Access::LOCAL_WRITE,
            SizeClasses::DEFAULT,
        )?;
        let now = StdInstant::now();
        Ok(RdmaTransport {
            device,
            config,
            memory,
            header_pool,
            recv_pool,
            send_pool,
            listener: None,
            peers: PeerSlots::new(false),
            arrivals: VecDeque::new(),
            orphans: VecDeque::new(),
            accepted: VecDeque::new(),
            session_clock: SessionClock::start(),
            next_scan: now,
            next_judge: now,
            looks: crate::Looks::default(),
            closed: false,
        })
    }

    /// The longest message it takes (what its Hello tells peers).
    pub fn max_message(&self) -> usize {
        self.config.max_message
    }

    /// What payloads live in.
    pub fn memory(&self) -> &M {
        &self.memory
    }

    /// The receive pool.
    pub fn pool(&self) -> &Arc<M::Pool> {
        &self.recv_pool
    }

    /// The send pool (lease from it for zero-copy sends).
    pub fn send_pool(&self) -> &Arc<M::Pool> {
        &self.send_pool
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Connected peers whose Hello came.
    pub fn peer_count(&self) -> usize {
        self.peers
            .iter()
            .filter(|(_, c)| c.established && c.session.is_open())
            .count()
    }

    /// Posts `frame` (a header and its payload) to `peer` as it is, from a
    /// send buffer, bypassing its session: what a broken peer sends, for tests.
    #[cfg(feature = "testing")]
    pub fn send_raw_frame(&mut self, peer: PeerId, frame: &[u8]) -> Result<(), Error> {
        let Some(conn) = self.peers.get_mut(peer) else {
            return Err(Error::UnknownPeer(peer));
        };
        let mut buf = Lease::take(Arc::clone(&self.send_pool), frame.len())?;
        self.memory.write(&mut buf, 0, frame)?;
        // A plain send: the header rides in the buffer, no immediate data.
        let data = (buf.device_ptr(), frame.len(), buf.lkey().unwrap_or(0));
        Self::post(conn, None, None, data, Some(buf), false)?;
        Ok(())
    }

    /// The next peer that connected to the listener and said Hello, with its address.
    pub fn take_accepted(&mut self) -> Option<(PeerId, SocketAddr)> {
        self.accepted.pop_front()
    }

    /// A peer's address, while it is connected.
    pub fn peer_addr(&self, peer: PeerId) -> Option<SocketAddr> {
        self.peers.get(peer)?.addr
    }

    /// What has crossed to and from `peer`, while it is connected.
    pub fn peer_stats(&self, peer: PeerId) -> Option<SessionStats> {
        Some(self.peers.get(peer)?.session.stats())
    }

    /// Connections in the table, up or not yet (a closing transport waits for 0).
    pub fn peers_left(&self) -> usize {
        self.peers.count()
    }

    /// Connections up (by the CM's event, or a frame that came first),
    /// whether or not their Hellos have crossed yet.
    pub fn established(&self) -> usize {
        self.peers.iter().filter(|(_, c)| c.established).count()
    }

    fn now(&self) -> Instant {
        self.session_clock.now()
    }

    fn session_config(&self) -> SessionConfig {
        let c = &self.config;
        let clamp = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        SessionConfig {
            max_message: clamp(c.max_message),
            window: clamp(c.window),
            frame_max: clamp(c.fragment),
            ring: c.recv_depth as u16,
            takes_headerless: c.headerless && M::HOST_VISIBLE,
            sends_headerless: true,
            check_payload: false, // RC checks every packet (ICRC)
            idle_timeout: c.idle_timeout,
            min_rate: c.min_rate,
            // A queue pair is already past any same-host question.
            host: HostRole::None,
        }
    }

    /// Posts what the engine lets go: queued messages' fragments while
    /// credits and send slots allow, then its control frames. Asked on
    /// every poll: where nothing is queued and no control frame is due,
    /// it answers inline.
    #[inline]
    fn pump(conn: &mut Conn<M>) -> Result<bool, Error> {
        if !conn.established || (conn.queue.is_empty() && conn.session.control_quiet()) {
            return Ok(false);
        }
        Self::pump_queued(conn)
    }

    fn pump_queued(conn: &mut Conn<M>) -> Result<bool, Error> {
        let mut any = false;
        while conn.send.has_free() {
            let Some(front) = conn.queue.front_mut() else {
                break;
            };
            let Some(f) = conn
                .session
                .next_frame(&mut front.out, None, DataFlags::NONE)
            else {
                break;
            };
            let hold = match &mut front.parts {
                Parts::Copies(c) => c.pop_front().map(|(l, _)| l),
                Parts::Lease(_) => match std::mem::replace(&mut front.parts, Parts::Empty) {
                    Parts::Lease(l) => Some(l),
                    _ => None,
                },
                Parts::Empty => None,
            };
            if f.last {
                conn.queue.pop_front();
            }
            let data = hold.as_ref().map_or((0, 0, 0), |l| {
                (l.device_ptr(), f.len, l.lkey().unwrap_or(0))
            });
            Self::post_frame(conn, &f, data, hold, M::HOST_VISIBLE)?;
            any = true;
        }
        while conn.send.has_free() {
            let Some(c) = conn.session.poll_control() else {
                break;
            };
            let f = DataFrame {
                header: Some(c.header),
                imm: 0,
                offset: 0,
                len: 0,
                last: true,
            };
            Self::post_frame(conn, &f, (0, 0, 0), None, true)?;
            any = true;
        }
        Ok(any)
    }

    /// Posts frame `f`: its header from its ring slot and `data` (address,
    /// length, lkey: a registered buffer or, inline, a caller's bytes) — or,
    /// headerless, `data` alone with the immediate data — inline when
    /// `may_inline` and small enough. `hold` lives in the send slot until
    /// the send completes; an inline frame's goes back at once.
    fn post_frame(
        conn: &mut Conn<M>,
        f: &DataFrame,
        data: (u64, usize, u32),
        hold: Option<PayloadLease<M>>,
        may_inline: bool,
    ) -> Result<(), Error> {
        let imm = f.header.is_none().then_some(f.imm);
        Self::post(conn, f.header, imm, data, hold, may_inline)
    }

    /// Posts a send: `header` (from its ring slot) then `data`, or `data`
    /// alone, with `imm` as immediate data when given.
    fn post(
        conn: &mut Conn<M>,
        header: Option<[u8; HEADER_LEN]>,
        imm: Option<u32>,
        (addr, len, lkey): (u64, usize, u32),
        hold: Option<PayloadLease<M>>,
        may_inline: bool,
    ) -> Result<(), Error> {
        let wire_len = len + if header.is_some() { HEADER_LEN } else { 0 };
        let inline = may_inline && wire_len <= conn.qp.inline_max();
        let Some(taken) = conn.send.take(inline) else {
            return Err(Error::Backend("verbs: no free send slot")); // checked by the callers
        };
        let slot = taken.slot;
        let data = ffi::ibv_sge {
            addr,
            length: len as u32,
            lkey,
        };
        let (mut sge, entries) = match header {
            None => ([data, data], usize::from(len > 0)),
            Some(h) => {
                let at = (conn.recv.len() + slot) * HEADER_LEN;
                host_bytes_mut(&mut conn.headers)[at..at + HEADER_LEN].copy_from_slice(&h);
                let header = ffi::ibv_sge {
                    addr: conn.headers.device_ptr() + at as u64,
                    length: HEADER_LEN as u32,
                    lkey: conn.headers.lkey().unwrap_or(0),
                };
                ([header, data], if len > 0 { 2 } else { 1 })
            }
        };
        // SAFETY: an all-zero send WR is valid; the fields are set below.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = SEND_TAG | slot as u64;
        wr.sg_list = sge.as_mut_ptr();
        wr.num_sge = entries as i32;
        if let Some(imm) = imm {
            wr.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
            wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        } else {
            wr.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND;
        }
        if taken.signaled {
            wr.send_flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        if inline {
            wr.send_flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
        }
        // SAFETY: the header slot is untouched until this send completes (a
        // slot is not reused before); the payload is `hold`, kept in the slot
        // until then, or inline data copied before this call returns.
        if let Err(e) = unsafe { conn.qp.post_send(&mut wr) } {
            conn.send.not_posted(taken);
            return Err(e.into());
        }
        conn.send.posted(taken, hold);
        Ok(())
    }

    /// Starts a message for `peer`: its fragments go at once while credits
    /// and send slots allow (a small one inline straight from the caller's
    /// bytes or host lease); the rest is copied into registered buffers and
    /// queued, or, for a lease of our own pools, queued as it is.
    #[allow(clippy::result_large_err)]
    fn queue(
        &mut self,
        peer: PeerId,
        bytes: Option<&[u8]>,
        lease: Option<PayloadLease<M>>,
    ) -> Result<(), (Error, Option<PayloadLease<M>>)> {
        if self.closed {
            return Err((Error::Closed, lease));
        }
        let total = bytes.map_or_else(|| lease.as_ref().map_or(0, |l| l.len()), <[u8]>::len);
        let max = self.config.max_message;
        if total > max {
            return Err((Error::TooLarge { len: total, max }, lease));
        }
        let own = lease.as_ref().is_some_and(|l| {
            Arc::ptr_eq(l.pool(), &self.send_pool) || Arc::ptr_eq(l.pool(), &self.recv_pool)
        });
        let fragment = self.config.fragment;
        let Some(conn) = self.peers.get_mut(peer) else {
            return Err((Error::UnknownPeer(peer), lease));
        };
        if !conn.established || conn.queue.len() > conn.send.depth() * 2 {
            return Err((Error::WouldBlock, lease)); // not up yet, or a ring's worth waits
        }
        // A message the engine starts must go out: everything that can fail
        // (a buffer to copy into) comes first, and credit is looked at
        // before anything is copied.
        if !conn.session.is_open() || conn.session.credit() < total as u64 {
            let e = conn
                .session
                .send(total)
                .err()
                .unwrap_or(SendError::NoCredit);
            let _ = Self::pump(conn); // a Want, when credit is short
            return Err((e.to_error(peer), lease));
        }
        // A small message with nothing ahead goes inline straight from where
        // it is: the caller's bytes, or a host lease of our own.
        let inline_from = match (bytes, &lease) {
            (Some(b), _) => Some(b.as_ptr() as u64),
            (None, Some(l)) if own && M::HOST_VISIBLE => Some(l.device_ptr()),
            _ => None,
        };
        let now = conn.queue.is_empty() && conn.send.has_free() && conn.session.ready_to_frame();
        if let (Some(addr), true) = (
            inline_from,
            now && HEADER_LEN + total <= conn.qp.inline_max(),
        ) {
            let mut out = match conn.session.send(total) {
                Ok(out) => out,
                Err(e) => return Err((e.to_error(peer), lease)),
            };
            // One fragment (it fits inline, so it fits a frame), framed now.
            let Some(f) = conn.session.next_frame(&mut out, None, DataFlags::NONE) else {
                return Err((Error::Backend("verbs: the session framed nothing"), lease));
            };
            if let Err(e) = Self::post_frame(conn, &f, (addr, f.len, 0), None, true) {
                return Err((e, lease));
            }
            Self::refill(&self.recv_pool, fragment, conn);
            return Ok(());
        }
        let frag = conn
            .session
            .peer()
            .map_or(fragment, |p| p.frame_max as usize)
            .max(1);
        let (parts, lease) = match (bytes, lease) {
            (_, Some(l)) if own && total <= frag => (Parts::Lease(l), None),
            (_, lease) if total == 0 => (Parts::Empty, lease),
            (bytes, lease) => {
                // Copies, one registered buffer per fragment, as the peer
                // takes them. (A foreign lease is copied, not trusted.)
                let mut copies = VecDeque::new();
                for at in (0..total).step_by(frag) {
                    let n = frag.min(total - at);
                    let mut buf = match Lease::take(Arc::clone(&self.send_pool), n) {
                        Ok(b) => b,
                        // A dry send pool is back-pressure: try again after completions.
                        Err(Error::Pool(_)) => return Err((Error::WouldBlock, lease)),
                        Err(e) => return Err((e, lease)),
                    };
                    let copied = match (bytes, &lease) {
                        (Some(b), _) => self.memory.write(&mut buf, 0, &b[at..at + n]),
                        (None, Some(l)) => self.memory.copy(&mut buf, 0, l, at, n),
                        (None, None) => Ok(()),
                    };
                    if let Err(e) = copied {
                        return Err((e, lease));
                    }
                    copies.push_back((buf, n));
                }
                (Parts::Copies(copies), lease)
            }
        };
        let out = match conn.session.send(total) {
            Ok(out) => out,
            Err(e) => {
                let lease = lease.or(match parts {
                    Parts::Lease(l) => Some(l),
                    _ => None,
                });
                return Err((e.to_error(peer), lease));
            }
        };
        drop(lease); // copied: the caller's lease goes back to its pool
        conn.queue.push_back(OutMsg { out, parts });
        // Queued: a posting failure now means a broken QP, which the next
        // progress reports for this peer.
        let _ = Self::pump(conn);
        Self::refill(&self.recv_pool, fragment, conn);
        Ok(())
    }

    /// Runs `work` on connection `i`, taken out of the table meanwhile; a
    /// failure retires the connection and is reported once through
    /// `try_recv`. Returns what `work` said (true on a failure).
    fn service(
        &mut self,
        i: usize,
        work: impl FnOnce(&mut Self, &mut Conn<M>, PeerId) -> Result<bool, Error>,
    ) -> bool {
        let Some(mut conn) = self.peers.lend(i) else {
            return false;
        };
        match work(self, &mut conn, self.peers.id(i)) {
            Ok(any) => {
                if conn.session.is_finished() && conn.idle() {
                    self.peers.retire(i); // both closed: it goes
                } else {
                    self.peers.restore(i, conn);
                }
                any
            }
            Err(e) => {
                let peer = self.peers.id(i);
                self.peers.retire(i);
                self.retire(conn, peer, Some(e));
                true
            }
        }
    }

    /// Reaps completions and posts what they free: the caller's fast path.
    fn drain_and_pump(&mut self, conn: &mut Conn<M>, peer: PeerId) -> Result<bool, Error> {
        let n = self.drain_cq(conn, peer)?;
        Ok(Self::pump(conn)? || n > 0)
    }

    /// Takes the completion channel's events (so it is not left readable by
    /// a stale one), drains the CQ, arms it, and drains once more (a
    /// completion between the last poll and the arming raises no event).
    fn drain_and_arm(&mut self, conn: &mut Conn<M>, peer: PeerId) -> Result<bool, Error> {
        conn.qp.cq().take_events();
        let mut any = false;
        loop {
            let n = self.drain_cq(conn, peer)?;
            any |= n > 0;
            if n == 0 {
                conn.qp.cq().arm();
                if self.drain_cq(conn, peer)? == 0 {
                    break;
                }
                any = true;
            }
        }
        Ok(any)
    }

    /// Readies the completion channels for a thread about to sleep on them
    /// (see `drain_and_arm`). Returns whether anything completed meanwhile
    /// (then it should not sleep).
    pub fn arm_completions(&mut self) -> bool {
        self.clear_bell();
        let before = self.arrivals.len();
        let mut any = false;
        for i in 0..self.peers.len() {
            any |= self.service(i, |t, conn, peer| {
                Ok(t.drain_and_arm(conn, peer)? | Self::pump(conn)?)
            });
        }
        any || self.arrivals.len() != before
    }

    /// Messages (or errors) waiting for `try_recv`.
    pub fn has_arrivals(&self) -> bool {
        !self.arrivals.is_empty()
    }

    /// A ring left short by a dry pool waits for the pool's bell.
    fn recv_dry(&self) -> bool {
        !self.orphans.is_empty()
            || self
                .peers
                .iter()
                .any(|(_, c)| c.recv_dry || !c.held.is_empty())
    }

    /// Takes the receive pool's rings before the refills look at it again,
    /// where a ring was left short: a buffer back after the look rings anew.
    fn clear_bell(&self) {
        if self.recv_dry() {
            self.recv_pool.bell().clear();
        }
    }

    /// One pass: CM events, completions (arming the channels), timers.
    fn poll_all(&mut self) -> bool {
        self.clear_bell();
        if !self.orphans.is_empty() {
            self.release_orphans();
        }
        let mut any = self.accept_all();
        let now = StdInstant::now();
        let timers = now >= self.next_scan;
        let mut came_back = false;
        if timers {
            self.next_scan = now + TIMER_SCAN;
            came_back = self
                .looks
                .came_back(now, crate::absence(self.config.idle_timeout));
        }
        let t = self.now();
        for i in 0..self.peers.len() {
            // A connecting side's CM events come on its own channel.
            let own = self.peers.at(i).and_then(|c| {
                let ch = c.qp.id().channel();
                let shared = self
                    .listener
                    .as_ref()
                    .is_some_and(|l| Arc::ptr_eq(l.channel(), ch));
                (!shared).then(|| Arc::clone(ch))
            });
            if let Some(ch) = own {
                while let Ok(Some(ev)) = ch.next(Duration::ZERO) {
                    any = true;
                    self.cm_event(&ch, ev);
                }
            }
            any |= self.service(i, |tr, conn, peer| {
                // Completions first: a peer is judged on what arrived, not on
                // when this side last looked (a caller-driven application
                // away past the idle timeout left them in the queue).
                let moved = tr.drain_and_arm(conn, peer)? | Self::pump(conn)?;
                if timers {
                    // Receive slots left empty by a dry pool (the
                    // application holds the buffers) hold the peer back;
                    // time nobody drove this wire is not the peer's slowness.
                    if !conn.unposted.is_empty() {
                        conn.session.handle_held(t);
                    }
                    if came_back {
                        conn.session.handle_absence(t);
                    }
                    conn.session
                        .handle_timeout(t)
                        .map_err(|error| Error::Protocol { peer, error })?;
                }
                Ok(moved)
            });
        }
        any
    }

    /// The descriptors to wait on: connection-manager channels (`cm`) and
    /// completion channels (`completions`).
    pub fn poll_descriptors(&self, out: &mut Vec<i32>, cm: bool, completions: bool) {
        if let (true, Some(l)) = (cm, &self.listener) {
            out.push(l.channel().fd());
        }
        if completions && self.recv_dry() {
            out.extend(self.recv_pool.bell().fd());
        }
        for (_, c) in self.peers.iter() {
            if completions {
                out.push(c.qp.cq().fd());
            }
            let shared = self
                .listener
                .as_ref()
                .is_some_and(|l| Arc::ptr_eq(l.channel(), c.qp.id().channel()));
            if cm && !shared {
                out.push(c.qp.id().channel().fd());
            }
        }
    }

    /// Whether messages to `peer` that fit one fragment leave without a
    /// header (the peer's Hello said it takes them); `None` for no such peer.
    pub fn sends_headerless(&self, peer: PeerId) -> Option<bool> {
        let conn = self.peers.get(peer)?;
        Some(conn.session.peer().is_some_and(|p| p.takes_headerless))
    }

    /// Messages started and waiting for frame credits or send slots.
    pub fn unposted_frames(&self) -> usize {
        self.peers.iter().map(|(_, c)| c.queue.len()).sum()
    }

    /// Messages queued, or frames posted and not yet completed (see
    /// [`SendSlots::in_flight`]).
    pub fn pending_frames(&self) -> usize {
        self.peers
            .iter()
            .map(|(_, c)| c.queue.len() + c.send.in_flight())
            .sum()
    }
}

impl<M: PayloadMemory> Conn<M> {
    /// Nothing queued and nothing in flight.
    fn idle(&self) -> bool {
        self.queue.is_empty() && self.send.in_flight() == 0 && self.held.is_empty()
    }
}

impl<M: PayloadMemory> Transport for RdmaTransport<M> {
    type Lease = PayloadLease<M>;

    fn kind(&self) -> Kind {
        self.memory.kind()
    }

    fn caps(&self) -> Capabilities {
        Capabilities::new(self.memory.kind() == Kind::Gpudirect, true, 2)
    }

    fn try_send(&mut self, peer: PeerId, bytes: &[u8]) -> Result<(), Error> {
        self.reap(peer);
        self.queue(peer, Some(bytes), None).map_err(|(e, _)| e)
    }

    fn try_send_lease(
        &mut self,
        peer: PeerId,
        lease: PayloadLease<M>,
    ) -> Result<(), Rejected<PayloadLease<M>>> {
        self.reap(peer);
        self.queue(peer, None, Some(lease))
            .map_err(|(error, lease)| Rejected {
                error,
                lease: lease.expect("a refused lease is always handed back"),
            })
    }

    fn try_recv(&mut self) -> Result<Received<PayloadLease<M>>, Error> {
        if !self.orphans.is_empty() {
            self.release_orphans();
        }
        if self.arrivals.is_empty() {
            // Completions only: no system call where the CQ lives in user
            // memory; CM events and channel arming are progress's.
            for i in 0..self.peers.len() {
                self.service(i, Self::drain_and_pump);
            }
        }
        match self.arrivals.pop_front() {
            Some(r) => r,
            None if self.closed && self.peers.count() == 0 => Err(Error::Closed),
            None => Err(Error::WouldBlock),
        }
    }

    fn progress(&mut self) -> Result<bool, Error> {
        Ok(self.poll_all())
    }

    fn close(&mut self) -> Result<(), Error> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        for (_, c) in self.peers.iter_mut() {
            c.session.close();
            let _ = Self::pump(c);
        }
        Ok(())
    }
}

impl<M: PayloadMemory> RdmaTransport<M> {
    /// A sender's own progress: when `peer`'s send ring is full or messages
    /// wait, reap its completions and post what they free, here.
    fn reap(&mut self, peer: PeerId) {
        let Some(i) = self.peers.slot(peer) else {
            return;
        };
        let busy = self
            .peers
            .at(i)
            .is_some_and(|c| !c.send.has_free() || !c.queue.is_empty());
        if busy {
            self.service(i, Self::drain_and_pump);
        }
    }
}
