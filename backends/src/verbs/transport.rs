//! RC queue pairs over librdmacm: the `rdma` and `gpudirect` transports
//! (the same wire; [`PayloadMemory`] says where payloads live).
//!
//! Each connection has one completion queue (with a completion channel, so
//! a progress thread can sleep in `poll(2)`), one RC queue pair, and a ring
//! of `recv_depth` posted receives. A frame leaves as the 32-byte zerohop
//! header (from a registered header slot) then its payload, or, for a
//! message that fits one fragment sent to a peer that announced it takes
//! them, *headerless*: its bytes alone, as a send with immediate data that
//! carries the credits returned (kind, length and sequence follow from the
//! completion and RC's ordering), so a 64 B message is 64 B on the wire.
//! Frames that fit the QP's inline room go inline (copied into the work
//! request, straight from the caller's bytes or host lease when nothing is
//! queued) and ask for a completion one in 16. A host payload is received whole into
//! one pool buffer, header first (if any), and handed on from past the
//! header (`Lease::advance`); a device payload is received as two entries,
//! the header into a host header slot and the payload into GPU memory, so
//! the CPU never reads a header out of device memory — which is why only a
//! host receiver announces headerless frames. Messages longer than one
//! fragment are split and reassembled (in order: RC delivers in order).
//!
//! Flow control is credit based, so the receiver never sees RNR: a sender
//! starts with the peer's receive depth (exchanged in the CM private data),
//! spends one per frame, and gets them back in every frame it receives
//! (a header's `dst`, or a headerless frame's immediate data, carries the
//! number of receives reposted since the last report). A delivered
//! message's receive is reposted at the receiver's next call, after any
//! reply it sends (`refill`): the repost stays off the round trip.
//! Data frames need two credits, a credit-only frame one: the last credit is
//! kept for returning credits (spent on a credit frame whenever data waits
//! for credits), so two busy peers cannot starve each other.
//!
//! On this wire a data header's `src` carries the whole message's length
//! (so the first fragment can lease the reassembly buffer) and `dst` the
//! credits returned.
//!
//! The CM private data is two little-endian words: the receive depth (the
//! peer's starting credits), then flags (bit 0: takes headerless frames). A
//! peer that sends one word gets framed messages only; one whose ring is
//! below [`MIN_RECV_DEPTH`] (or that sends none) is refused, on either side.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys as ffi;
use zerohop_core::wire_v1::{Flags, FrameKind, Header, HEADER_LEN};
use zerohop_core::{
    Access, Capabilities, Error, Kind, Lease, PeerId, Received, Rejected, SizeClasses, Transport,
};

use super::payload::{HostPayload, PayloadLease, PayloadMemory};
use super::{call_failed, Device, Registry, VerbsError};
use crate::{host_bytes, host_bytes_mut, HeapTables, HostPool};

/// Frame headers live in host memory whatever the payloads' memory: the CPU parses them.
type HeaderPool = HostPool<HeapTables>;
type HeaderLease = Lease<Arc<HeaderPool>>;

/// Settings of the verbs wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RdmaConfig {
    /// Receives kept posted per connection (and the credits a peer starts
    /// with); at least [`MIN_RECV_DEPTH`].
    pub recv_depth: u32,
    /// Largest payload of one frame; longer messages are split.
    pub fragment: usize,
    /// Largest message (default 64 MiB).
    pub max_message: usize,
    /// Budget of the receive pool (registered host memory).
    pub recv_pool_bytes: usize,
    /// Budget of the send pool (registered host memory for copies and headers).
    pub send_pool_bytes: usize,
    /// Accept headerless frames: a message that fits one fragment arrives as
    /// its bytes alone, the credits it returns in the immediate data (so a
    /// 64 B message is 64 B on the wire, as perftest's is). Announced in the
    /// CM private data; only a receiver whose payloads land in host memory
    /// takes them (a device receiver needs its header in the host header
    /// ring). Default on.
    pub headerless: bool,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            recv_depth: 64,
            fragment: 64 << 10,
            max_message: 64 << 20,
            recv_pool_bytes: 512 << 20,
            send_pool_bytes: 256 << 20,
            headerless: true,
        }
    }
}

/// The shallowest receive ring: a data frame needs two credits (see `pump`).
pub const MIN_RECV_DEPTH: u32 = 2;

const SEND_TAG: u64 = 1 << 63;
/// The host pool of header rings, shared by every connection of a transport.
const HEADER_POOL_BYTES: usize = 16 << 20;
const CM_TIMEOUT_MS: i32 = 5000;
/// Inline room asked of a QP: a header and a small message (perftest's
/// latency tests send this way too).
const INLINE_WANT: usize = 256;
/// Inline frames ask for a completion one in this many (perftest's
/// latency test does the same): the rest cost the NIC and the poller no
/// completion. The last free send slot is signaled as well, so slots come
/// back on a send ring shallower than this too.
const SIGNAL_EVERY: usize = 16;
/// Work completions taken per `ibv_poll_cq`.
const POLL_BATCH: usize = 16;
/// CM private data flag (second word): this side takes headerless frames
/// ([`RdmaConfig::headerless`]).
const PRIVATE_HEADERLESS: u32 = 1;

enum Payload<M: PayloadMemory> {
    None,
    /// `len` bytes from the start of a registered lease.
    Lease(PayloadLease<M>, usize),
}

struct Frame<M: PayloadMemory> {
    kind: FrameKind,
    seq: u64,
    total: u32,
    more: bool,
    payload: Payload<M>,
}

struct Conn<M: PayloadMemory> {
    id: NonNull<ffi::rdma_cm_id>,
    /// A connecting side's own CM channel (accepted ids report on the listener's).
    channel: Option<NonNull<ffi::rdma_event_channel>>,
    comp: NonNull<ffi::ibv_comp_channel>,
    cq: NonNull<ffi::ibv_cq>,
    headers: HeaderLease,
    recv: Vec<Option<PayloadLease<M>>>,
    /// Receive slots with no buffer posted (see `refill`).
    unposted: Vec<u32>,
    /// Send slots whose completion was asked for, with what must live until it.
    send: Vec<Option<Payload<M>>>,
    /// Send slots posted without a completion (inline frames), oldest first:
    /// free once a later send completes (an RC queue completes in order).
    unsignaled: VecDeque<u32>,
    /// When each send slot was last posted (a count of posts).
    posted_at: Vec<u64>,
    posts: u64,
    free_send: Vec<u32>,
    pending: VecDeque<Frame<M>>,
    credits: u32,
    owed: u32,
    tx_seq: u64,
    rx_next: u64,
    assembling: Option<(PayloadLease<M>, usize)>,
    /// Longest frame (header and payload) the QP sends inline: copied into
    /// the work request at posting, so its buffer is free at once.
    inline_max: usize,
    /// The peer takes headerless frames (see [`RdmaConfig::headerless`]).
    peer_headerless: bool,
    /// Sends may go: the CM said so, or (on the accepting side) a frame
    /// from the peer arrived first (see `established_by_arrival`).
    established: bool,
    closing: bool,
    peer_closed: bool,
}

/// An RDMA transport: RC connections to any number of peers.
pub struct RdmaTransport<M: PayloadMemory = HostPayload> {
    device: Arc<Device>,
    config: RdmaConfig,
    memory: M,
    header_pool: Arc<HeaderPool>,
    recv_pool: Arc<M::Pool>,
    send_pool: Arc<M::Pool>,
    listener: Option<(NonNull<ffi::rdma_event_channel>, NonNull<ffi::rdma_cm_id>)>,
    /// Boxed: the fast paths take a connection out of the table and put it back.
    peers: Vec<Option<Box<Conn<M>>>>,
    arrivals: VecDeque<Result<Received<PayloadLease<M>>, Error>>,
    closed: bool,
}

// SAFETY: every raw pointer is owned by the transport and used only through
// `&mut self`; verbs objects may move between threads.
unsafe impl<M: PayloadMemory> Send for RdmaTransport<M> {}

impl<M: PayloadMemory> std::fmt::Debug for RdmaTransport<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaTransport")
            .field("kind", &self.memory.kind())
            .field("device", &self.device.name())
            .field("peers", &self.peer_count())
            .finish_non_exhaustive()
    }
}

fn set_nonblocking(fd: i32) {
    // SAFETY: fcntl on a descriptor we own; no memory is touched.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
}

fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: an all-zero sockaddr_storage is valid; the right variant is written below.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            (
                ss,
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            (
                ss,
                std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
            )
        }
    }
}

struct Event {
    kind: ffi::rdma_cm_event_type::Type,
    id: *mut ffi::rdma_cm_id,
    status: i32,
    peer_depth: Option<u32>,
    /// The second word of the peer's private data: flags such as
    /// `PRIVATE_HEADERLESS` (0 from a peer that sent one word).
    peer_flags: u32,
}

/// Takes one CM event from `channel` if one is ready within `timeout`.
fn next_event(
    channel: NonNull<ffi::rdma_event_channel>,
    timeout: Duration,
) -> Result<Option<Event>, VerbsError> {
    // SAFETY: a live channel we own.
    let fd = unsafe { (*channel.as_ptr()).fd };
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe {
        libc::poll(
            &mut pfd,
            1,
            timeout.as_millis().min(i32::MAX as u128) as i32,
        )
    };
    if n <= 0 {
        return Ok(None);
    }
    let mut ev: *mut ffi::rdma_cm_event = ptr::null_mut();
    // SAFETY: a live channel and a valid out-pointer; the fd is readable.
    if unsafe { ffi::rdma_get_cm_event(channel.as_ptr(), &mut ev) } != 0 {
        let e = call_failed("rdma_get_cm_event");
        return if matches!(
            e,
            VerbsError::Call {
                errno: libc::EAGAIN,
                ..
            }
        ) {
            Ok(None)
        } else {
            Err(e)
        };
    }
    // SAFETY: the event is valid until acked below. Both members of its
    // param union (`conn`, `ud`) begin with the private-data pointer and
    // length, which librdmacm sets for every event (null and 0 where there
    // is none), and the data it points to lives as long as the event.
    let out = unsafe {
        let e = &*ev;
        let conn = e.param.conn;
        let private = if conn.private_data.is_null() {
            &[][..]
        } else {
            std::slice::from_raw_parts(
                conn.private_data.cast::<u8>(),
                usize::from(conn.private_data_len),
            )
        };
        let (peer_depth, peer_flags) = parse_private(private);
        Event {
            kind: e.event,
            id: e.id,
            status: e.status,
            peer_depth,
            peer_flags,
        }
    };
    // SAFETY: acked once, after its data was copied out.
    unsafe { ffi::rdma_ack_cm_event(ev) };
    Ok(Some(out))
}

/// The peer's CM private data: its receive depth (`None` if it sent none)
/// and its flags (0 from a peer that sent one word; the CM pads what it
/// carries with zeros, so an older peer reads as "no flags").
fn parse_private(p: &[u8]) -> (Option<u32>, u32) {
    let word = |i: usize| {
        p.get(4 * i..4 * i + 4)
            .map(|w| u32::from_le_bytes(w.try_into().expect("four bytes")))
    };
    (word(0), word(1).unwrap_or(0))
}

/// The credits a peer starts with: the receive depth it announced, if a
/// data frame fits (`MIN_RECV_DEPTH`); otherwise the connection is refused.
fn usable_depth(depth: Option<u32>) -> Result<u32, VerbsError> {
    match depth {
        Some(d) if d >= MIN_RECV_DEPTH => Ok(d),
        depth => Err(VerbsError::ShallowPeer { depth }),
    }
}

/// What a REJECTED event's status says, for the two a zerohop peer meets:
/// the IB CM's reject reasons (RoCE and InfiniBand), as `ib_cm.h` numbers them.
fn rejected_because(kind: ffi::rdma_cm_event_type::Type, status: i32) -> &'static str {
    const INVALID_SERVICE_ID: i32 = 8;
    const CONSUMER_DEFINED: i32 = 28;
    match (kind, status) {
        (ffi::rdma_cm_event_type::RDMA_CM_EVENT_REJECTED, INVALID_SERVICE_ID) => {
            ": nothing listens on that port"
        }
        (ffi::rdma_cm_event_type::RDMA_CM_EVENT_REJECTED, CONSUMER_DEFINED) => {
            ": the listener refused (it is closing, out of receive buffers, \
             or our receive ring is too shallow for it)"
        }
        _ => "",
    }
}

fn expect_event(
    channel: NonNull<ffi::rdma_event_channel>,
    want: ffi::rdma_cm_event_type::Type,
    what: &str,
) -> Result<Event, VerbsError> {
    let deadline = Instant::now() + Duration::from_millis(CM_TIMEOUT_MS as u64 + 1000);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(VerbsError::Connect(format!("timed out waiting for {what}")));
        }
        if let Some(ev) = next_event(channel, left)? {
            if ev.kind == want {
                return Ok(ev);
            }
            // SAFETY: rdma_event_str returns a static NUL-terminated string.
            let name =
                unsafe { std::ffi::CStr::from_ptr(ffi::rdma_event_str(ev.kind)) }.to_string_lossy();
            return Err(VerbsError::Connect(format!(
                "{what}: got {name} (status {}){}",
                ev.status,
                rejected_because(ev.kind, ev.status)
            )));
        }
    }
}

/// A new CM event channel with one TCP-port-space id on it; the caller owns
/// both and destroys them (id first).
fn channel_and_id(
) -> Result<(NonNull<ffi::rdma_event_channel>, NonNull<ffi::rdma_cm_id>), VerbsError> {
    // SAFETY: creates a channel we own.
    let ch = NonNull::new(unsafe { ffi::rdma_create_event_channel() })
        .ok_or_else(|| call_failed("rdma_create_event_channel"))?;
    let mut id = ptr::null_mut();
    // SAFETY: a live channel and a valid out-pointer.
    let rc = unsafe {
        ffi::rdma_create_id(
            ch.as_ptr(),
            &mut id,
            ptr::null_mut(),
            ffi::rdma_port_space::RDMA_PS_TCP,
        )
    };
    match NonNull::new(id) {
        Some(id) if rc == 0 => Ok((ch, id)),
        _ => {
            let e = call_failed("rdma_create_id");
            // SAFETY: the channel has no ids.
            unsafe { ffi::rdma_destroy_event_channel(ch.as_ptr()) };
            Err(e)
        }
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
    pub fn with_memory(device: Arc<Device>, config: RdmaConfig, memory: M) -> Result<Self, Error> {
        if config.recv_depth < MIN_RECV_DEPTH {
            return Err(Error::BadConfig(
                "RdmaConfig::recv_depth is below verbs::MIN_RECV_DEPTH",
            ));
        }
        let registry = Registry::new(Arc::clone(&device));
        // Receive buffers need local write (the NIC writes them); send buffers only local read.
        let recv_pool = memory.pool(
            &registry,
            config.recv_pool_bytes,
            Access::LOCAL_WRITE,
            receive_classes(Self::receive_buffer_len(config.fragment))?,
        )?;
        let send_pool = memory.pool(
            &registry,
            config.send_pool_bytes,
            Access::NONE,
            SizeClasses::DEFAULT,
        )?;
        // Header rings: (depth + send depth) slots of 32 bytes per connection.
        let header_pool = HostPayload.pool(
            &registry,
            HEADER_POOL_BYTES,
            Access::LOCAL_WRITE,
            SizeClasses::DEFAULT,
        )?;
        Ok(RdmaTransport {
            device,
            config,
            memory,
            header_pool,
            recv_pool,
            send_pool,
            listener: None,
            peers: Vec::new(),
            arrivals: VecDeque::new(),
            closed: false,
        })
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

    /// Connected peers.
    pub fn peer_count(&self) -> usize {
        self.peers
            .iter()
            .flatten()
            .filter(|c| c.established)
            .count()
    }

    /// Listens for RDMA CM connections on `addr` (an address of the RDMA device's netdev).
    pub fn listen(&mut self, addr: SocketAddr) -> Result<(), VerbsError> {
        let (ch, id) = channel_and_id()?;
        let id = id.as_ptr();
        let (mut ss, _) = sockaddr(addr);
        // SAFETY: a live id and a valid sockaddr; listen only after a successful bind.
        let rc = unsafe {
            match ffi::rdma_bind_addr(id, (&mut ss as *mut libc::sockaddr_storage).cast()) {
                0 => ffi::rdma_listen(id, 64),
                e => e,
            }
        };
        if rc != 0 {
            let e = call_failed("rdma_bind_addr/rdma_listen");
            // SAFETY: destroy what was created above, once.
            unsafe {
                ffi::rdma_destroy_id(id);
                ffi::rdma_destroy_event_channel(ch.as_ptr());
            }
            return Err(e);
        }
        // SAFETY: a live channel.
        set_nonblocking(unsafe { (*ch.as_ptr()).fd });
        self.listener = NonNull::new(id).map(|id| (ch, id));
        Ok(())
    }

    /// Connects to a listening transport (blocking until established or
    /// `CM_TIMEOUT`). A peer that announces a receive ring shallower than
    /// [`MIN_RECV_DEPTH`] is disconnected and refused (`ShallowPeer`).
    pub fn connect(&mut self, addr: SocketAddr) -> Result<PeerId, VerbsError> {
        // Failures to connect name the address.
        let at = |e| match e {
            VerbsError::Connect(why) => VerbsError::Connect(format!("to {addr}: {why}")),
            e => e,
        };
        let (ch, id) = channel_and_id()?;
        let conn = Self::resolve(ch, id, addr).and_then(|()| self.setup(id, Some(ch)));
        let mut conn = match conn {
            Ok(conn) => conn,
            Err(e) => {
                // SAFETY: neither resolution nor a failed setup keeps the id
                // or channel: they are still ours, destroyed once, id first.
                unsafe {
                    ffi::rdma_destroy_id(id.as_ptr());
                    ffi::rdma_destroy_event_channel(ch.as_ptr());
                }
                return Err(at(e));
            }
        };
        // From here the connection owns the id and the channel: `teardown`
        // destroys them.
        match self.handshake(ch, &mut conn) {
            Ok(()) => Ok(self.add(conn)),
            Err(e) => {
                self.teardown(&mut conn);
                Err(at(e))
            }
        }
    }

    fn resolve(
        ch: NonNull<ffi::rdma_event_channel>,
        id: NonNull<ffi::rdma_cm_id>,
        addr: SocketAddr,
    ) -> Result<(), VerbsError> {
        let (mut ss, _) = sockaddr(addr);
        // SAFETY: a live id and a valid destination sockaddr.
        if unsafe {
            ffi::rdma_resolve_addr(
                id.as_ptr(),
                ptr::null_mut(),
                (&mut ss as *mut libc::sockaddr_storage).cast(),
                CM_TIMEOUT_MS,
            )
        } != 0
        {
            return Err(call_failed("rdma_resolve_addr"));
        }
        expect_event(
            ch,
            ffi::rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED,
            "address resolution",
        )?;
        // SAFETY: a live id with a resolved address.
        if unsafe { ffi::rdma_resolve_route(id.as_ptr(), CM_TIMEOUT_MS) } != 0 {
            return Err(call_failed("rdma_resolve_route"));
        }
        expect_event(
            ch,
            ffi::rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED,
            "route resolution",
        )?;
        Ok(())
    }

    /// Sends the connect request and waits for the connection to come up
    /// with a peer whose ring can take data frames.
    fn handshake(
        &self,
        ch: NonNull<ffi::rdma_event_channel>,
        conn: &mut Conn<M>,
    ) -> Result<(), VerbsError> {
        let private = self.private();
        let mut param = conn_param(&private);
        // SAFETY: a live id with a QP; `param` and `private` outlive the call.
        if unsafe { ffi::rdma_connect(conn.id.as_ptr(), &mut param) } != 0 {
            return Err(call_failed("rdma_connect"));
        }
        let ev = expect_event(
            ch,
            ffi::rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED,
            "connection",
        )?;
        conn.credits = usable_depth(ev.peer_depth)?;
        conn.peer_headerless = ev.peer_flags & PRIVATE_HEADERLESS != 0;
        conn.established = true;
        // SAFETY: a live channel.
        set_nonblocking(unsafe { (*ch.as_ptr()).fd });
        Ok(())
    }

    fn add(&mut self, conn: Conn<M>) -> PeerId {
        match self.peers.iter().position(Option::is_none) {
            Some(i) => {
                self.peers[i] = Some(Box::new(conn));
                PeerId(i as u32)
            }
            None => {
                self.peers.push(Some(Box::new(conn)));
                PeerId(self.peers.len() as u32 - 1)
            }
        }
    }

    /// Creates the CQ, its channel and the QP on `id`, and posts the receive ring.
    fn setup(
        &mut self,
        id: NonNull<ffi::rdma_cm_id>,
        channel: Option<NonNull<ffi::rdma_event_channel>>,
    ) -> Result<Conn<M>, VerbsError> {
        // SAFETY: a live id; after address resolution its `verbs` is the device context.
        if unsafe { (*id.as_ptr()).verbs } != self.device.ctx() {
            return Err(VerbsError::Connect(format!(
                "the route leaves through another RDMA device than {}",
                self.device.name()
            )));
        }
        let depth = self.config.recv_depth as usize;
        let send_depth = depth + 8;
        // The NIC writes received headers here: it needs the receive pool's local-write access.
        let headers = Lease::take(
            Arc::clone(&self.header_pool),
            (depth + send_depth) * HEADER_LEN,
        )
        .map_err(|e| VerbsError::Connect(format!("header ring: {e}")))?;
        // SAFETY: a live context; the channel is destroyed with the connection.
        let comp = NonNull::new(unsafe { ffi::ibv_create_comp_channel(self.device.ctx()) })
            .ok_or_else(|| call_failed("ibv_create_comp_channel"))?;
        // SAFETY: a live context and channel.
        let cq = unsafe {
            ffi::ibv_create_cq(
                self.device.ctx(),
                (depth + send_depth + 16) as i32,
                ptr::null_mut(),
                comp.as_ptr(),
                0,
            )
        };
        let Some(cq) = NonNull::new(cq) else {
            let e = call_failed("ibv_create_cq");
            // SAFETY: the channel has no CQ.
            unsafe { ffi::ibv_destroy_comp_channel(comp.as_ptr()) };
            return Err(e);
        };
        // SAFETY: an all-zero qp_init_attr is a valid starting point.
        let mut attr: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attr.send_cq = cq.as_ptr();
        attr.recv_cq = cq.as_ptr();
        attr.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        attr.cap.max_send_wr = send_depth as u32;
        attr.cap.max_recv_wr = depth as u32;
        attr.cap.max_send_sge = 2;
        attr.cap.max_recv_sge = 2;
        attr.cap.max_inline_data = INLINE_WANT as u32;
        // SAFETY: a live id, PD and CQ; the attr lives across the call.
        let mut created = unsafe { ffi::rdma_create_qp(id.as_ptr(), self.device.pd(), &mut attr) };
        if created != 0 {
            // A device without inline sends: every frame then leaves from registered memory.
            attr.cap.max_inline_data = 0;
            // SAFETY: as above.
            created = unsafe { ffi::rdma_create_qp(id.as_ptr(), self.device.pd(), &mut attr) };
        }
        if created != 0 {
            let e = call_failed("rdma_create_qp");
            // SAFETY: CQ then channel, each once; no QP uses them.
            unsafe {
                ffi::ibv_destroy_cq(cq.as_ptr());
                ffi::ibv_destroy_comp_channel(comp.as_ptr());
            }
            return Err(e);
        }
        // SAFETY: live objects; the channel fd is ours.
        unsafe {
            set_nonblocking((*comp.as_ptr()).fd);
            ffi::ibv_req_notify_cq(cq.as_ptr(), 0);
        }
        let mut conn = Conn {
            id,
            channel,
            comp,
            cq,
            headers,
            recv: (0..depth).map(|_| None).collect(),
            unposted: Vec::with_capacity(depth),
            send: (0..send_depth).map(|_| None).collect(),
            unsignaled: VecDeque::new(),
            posted_at: vec![0; send_depth],
            posts: 0,
            free_send: (0..send_depth as u32).rev().collect(),
            pending: VecDeque::new(),
            credits: 0,
            owed: 0,
            tx_seq: 0,
            rx_next: 0,
            assembling: None,
            // rdma_create_qp wrote back what the QP supports.
            inline_max: attr.cap.max_inline_data as usize,
            peer_headerless: false,
            established: false,
            closing: false,
            peer_closed: false,
        };
        for slot in 0..depth {
            if let Err(e) = Self::post_recv(&self.recv_pool, self.config.fragment, &mut conn, slot)
            {
                Self::release_verbs(&mut conn);
                return Err(VerbsError::Connect(format!(
                    "posting the receive ring: {e}"
                )));
            }
        }
        conn.owed = 0; // the initial ring is announced in the private data, not as credits
        Ok(conn)
    }

    /// Whether this side takes headerless frames: configured to, and its
    /// payloads land in host memory (announced in the private data, and
    /// required of every headerless frame that arrives).
    fn takes_headerless(&self) -> bool {
        self.config.headerless && M::HOST_VISIBLE
    }

    /// This side's CM private data: receive depth, flags.
    fn private(&self) -> [u8; 8] {
        let flags = if self.takes_headerless() {
            PRIVATE_HEADERLESS
        } else {
            0
        };
        let mut p = [0u8; 8];
        p[..4].copy_from_slice(&self.config.recv_depth.to_le_bytes());
        p[4..].copy_from_slice(&flags.to_le_bytes());
        p
    }

    /// A receive buffer's size: a whole frame where the header lands in the
    /// buffer too (host payloads, see `post_recv`), else one fragment.
    fn receive_buffer_len(fragment: usize) -> usize {
        fragment + if M::HOST_VISIBLE { HEADER_LEN } else { 0 }
    }

    /// Posts a receive into ring slot `slot`. Host payloads take the whole
    /// frame into one buffer, header first (one scatter entry: in Soft-RoCE
    /// each entry is a lookup and a copy in the kernel); device payloads
    /// take the header into the host header ring and the payload into GPU
    /// memory, so the CPU never reads a header out of device memory.
    fn post_recv(
        pool: &Arc<M::Pool>,
        fragment: usize,
        conn: &mut Conn<M>,
        slot: usize,
    ) -> Result<(), Error> {
        let whole = M::HOST_VISIBLE;
        let lease = Lease::take(Arc::clone(pool), Self::receive_buffer_len(fragment))?;
        let (hmr, pmr) = (
            conn.headers.mr().expect("registered"),
            lease.mr().expect("registered"),
        );
        let payload = ffi::ibv_sge {
            addr: lease.device_ptr(),
            length: lease.len() as u32,
            lkey: pmr.lkey,
        };
        let mut sge = if whole {
            [payload, payload]
        } else {
            [
                ffi::ibv_sge {
                    addr: conn.headers.device_ptr() + (slot * HEADER_LEN) as u64,
                    length: HEADER_LEN as u32,
                    lkey: hmr.lkey,
                },
                payload,
            ]
        };
        // SAFETY: an all-zero recv WR is valid; the fields are set below.
        let mut wr: ffi::ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = slot as u64;
        wr.sg_list = sge.as_mut_ptr();
        wr.num_sge = if whole { 1 } else { 2 };
        let mut bad = ptr::null_mut();
        // SAFETY: a live QP; the SGEs name registered memory that stays leased
        // (in `conn.recv[slot]`) until this receive completes or the QP is destroyed.
        let rc = unsafe { ffi::ibv_post_recv((*conn.id.as_ptr()).qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(Error::Backend("ibv_post_recv"));
        }
        conn.recv[slot] = Some(lease);
        conn.owed += 1;
        Ok(())
    }

    /// Posts fresh buffers into the receive slots that have none, until the
    /// pool runs dry (the rest wait for the next call). A completed receive
    /// is not reposted before its message is delivered but here, at the
    /// caller's next call — after the reply it sends, for one that answers —
    /// so the pool lease and the post stay off the round trip's path. Every
    /// poll starts here, and so does a send's end, so a slot waits at most
    /// until its receiver calls again (or the progress thread's pass for one
    /// that stopped). The peer's credits count posted receives only, so a
    /// slot waiting here is one the peer cannot send into.
    fn refill(pool: &Arc<M::Pool>, fragment: usize, conn: &mut Conn<M>) {
        if conn.peer_closed {
            return;
        }
        while let Some(&slot) = conn.unposted.last() {
            if Self::post_recv(pool, fragment, conn, slot as usize).is_err() {
                break;
            }
            conn.unposted.pop();
        }
    }

    /// Posts as many queued frames as credits and send slots allow.
    fn pump(conn: &mut Conn<M>, depth: u32) -> Result<bool, Error> {
        let mut any = false;
        while let Some(f) = conn.pending.front() {
            let need = if f.kind == FrameKind::Data { 2 } else { 1 };
            if conn.credits < need || conn.free_send.is_empty() {
                break;
            }
            let f = conn.pending.pop_front().expect("front exists");
            Self::post_send(conn, f)?;
            any = true;
        }
        // Return credits on their own when enough are owed and no data frame
        // carries them: nothing is queued, or what is queued waits for credits
        // (a data frame needs two; the last one is kept for this, so two
        // peers that only send cannot starve each other).
        if (conn.pending.is_empty() || conn.credits < 2)
            && conn.owed >= (depth / 4).max(1)
            && conn.credits >= 1
            && !conn.free_send.is_empty()
        {
            Self::post_send(
                conn,
                Frame {
                    kind: FrameKind::Credit,
                    seq: 0,
                    total: 0,
                    more: false,
                    payload: Payload::None,
                },
            )?;
            any = true;
        }
        Ok(any)
    }

    fn post_send(conn: &mut Conn<M>, f: Frame<M>) -> Result<(), Error> {
        let data = match &f.payload {
            Payload::None => (0, 0, 0),
            Payload::Lease(l, len) => (l.device_ptr(), *len, l.mr().expect("registered").lkey),
        };
        // GPU memory cannot go inline: the CPU copies inline data.
        Self::post_frame(conn, f, data, M::HOST_VISIBLE)
    }

    /// Whether a data frame goes without a header: a whole message in one
    /// fragment, to a peer that takes headerless frames.
    fn headerless(conn: &Conn<M>, kind: FrameKind, more: bool, total: u32, len: usize) -> bool {
        conn.peer_headerless && kind == FrameKind::Data && !more && total as usize == len
    }

    /// Whether a frame of `wire_len` bytes (header included, if any) goes inline.
    fn inline(conn: &Conn<M>, wire_len: usize, may: bool) -> bool {
        may && wire_len <= conn.inline_max
    }

    /// Posts `f`'s header (from its ring slot) and `data` (address, length,
    /// lkey: `f`'s payload, or a caller's bytes) — or, headerless, `data`
    /// alone with the credits in the immediate data — inline when allowed
    /// and small enough. `f.payload` stays in the send slot until the send
    /// completes; an inline frame's goes back at once (the NIC has a copy).
    fn post_frame(
        conn: &mut Conn<M>,
        f: Frame<M>,
        (addr, len, lkey): (u64, usize, u32),
        may_inline: bool,
    ) -> Result<(), Error> {
        let slot = conn.free_send.pop().expect("checked by the caller") as usize;
        let data = ffi::ibv_sge {
            addr,
            length: len as u32,
            lkey,
        };
        let headerless = Self::headerless(conn, f.kind, f.more, f.total, len);
        let (mut sge, entries) = if headerless {
            // The bytes alone; the credits ride in the immediate data.
            ([data, data], usize::from(len > 0))
        } else {
            let more = if f.more { Flags::MORE } else { Flags::NONE };
            let mut h = match f.kind {
                FrameKind::Data => Header::data(f.total, conn.owed, f.seq, &[], false, more),
                k => Header::control(k, 0, conn.owed, f.seq),
            };
            h.len = len as u32;
            h.checksum = h.compute_checksum(&[]);
            let at = (conn.recv.len() + slot) * HEADER_LEN;
            host_bytes_mut_range(&mut conn.headers, at, HEADER_LEN).copy_from_slice(&h.encode());
            let header = ffi::ibv_sge {
                addr: conn.headers.device_ptr() + at as u64,
                length: HEADER_LEN as u32,
                lkey: conn.headers.mr().expect("registered").lkey,
            };
            ([header, data], if len > 0 { 2 } else { 1 })
        };
        let wire_len = len + if headerless { 0 } else { HEADER_LEN };
        let inline = Self::inline(conn, wire_len, may_inline);
        // A frame from registered memory asks for its completion (its buffer
        // is held until then, and `flush` waits for it); inline ones only
        // one in SIGNAL_EVERY, which frees the slots of those before it.
        // The last free slot is always signaled: on a ring shallower than
        // SIGNAL_EVERY, unsignaled frames would otherwise take every slot and
        // no completion would ever give them back.
        let signaled =
            !inline || conn.unsignaled.len() + 1 >= SIGNAL_EVERY || conn.free_send.is_empty();
        // SAFETY: an all-zero send WR is valid; the fields are set below.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = SEND_TAG | slot as u64;
        wr.sg_list = sge.as_mut_ptr();
        wr.num_sge = entries as i32;
        if headerless {
            wr.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
            wr.imm_data_invalidated_rkey_union.imm_data = conn.owed.to_be();
        } else {
            wr.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND;
        }
        if signaled {
            wr.send_flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        if inline {
            wr.send_flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
        }
        let mut bad = ptr::null_mut();
        // SAFETY: a live QP; the header slot stays untouched until the send
        // completes (the slot is not reused before), and the payload as the
        // caller promised (inline data is copied before this call returns).
        let rc = unsafe { ffi::ibv_post_send((*conn.id.as_ptr()).qp, &mut wr, &mut bad) };
        if rc != 0 {
            conn.free_send.push(slot as u32);
            return Err(Error::Backend("ibv_post_send"));
        }
        conn.posts += 1;
        conn.posted_at[slot] = conn.posts;
        match (signaled, inline) {
            (true, true) => conn.send[slot] = Some(Payload::None),
            (true, false) => conn.send[slot] = Some(f.payload),
            (false, _) => conn.unsignaled.push_back(slot as u32),
        }
        conn.credits -= 1;
        conn.owed = 0;
        Ok(())
    }

    /// A signaled send completed: its slot is free, and so are those of the
    /// unsignaled sends posted before it.
    fn send_completed(conn: &mut Conn<M>, slot: usize) {
        conn.send[slot] = None; // the payload lease goes back to its pool
        conn.free_send.push(slot as u32);
        let upto = conn.posted_at[slot];
        while let Some(&u) = conn.unsignaled.front() {
            if conn.posted_at[u as usize] > upto {
                break;
            }
            conn.unsignaled.pop_front();
            conn.free_send.push(u);
        }
    }

    /// Splits a message into frames: zero-copy when `lease` holds it in one fragment.
    // The refused lease rides back in the error; boxing it would allocate on
    // the back-pressure path.
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
        if total > self.config.max_message {
            return Err((
                Error::TooLarge {
                    len: total,
                    max: self.config.max_message,
                },
                lease,
            ));
        }
        let frag = self.config.fragment;
        // A lease of our own registered pools goes as it is (zero copy);
        // any other (another pool, another PD, no registration) is copied.
        let own = lease.as_ref().is_some_and(|l| {
            Arc::ptr_eq(l.pool(), &self.send_pool) || Arc::ptr_eq(l.pool(), &self.recv_pool)
        });
        let Some(Some(conn)) = self.peers.get_mut(peer.0 as usize) else {
            return Err((Error::UnknownPeer(peer), lease));
        };
        if conn.closing {
            return Err((Error::UnknownPeer(peer), lease));
        }
        if !conn.established {
            // Accepted, not yet established: the caller tries again.
            return Err((Error::WouldBlock, lease));
        }
        // Bounded queue: at most one ring's worth of frames waiting.
        if conn.pending.len() > conn.send.len() * 2 {
            return Err((Error::WouldBlock, lease));
        }
        let seq = conn.tx_seq;
        // A small message with nothing queued ahead and credits to spare
        // goes inline straight from where it is — the caller's bytes, or a
        // host lease of our own — without a buffer or a queue entry of ours
        // (the lease goes back once posted: the NIC has a copy).
        let inline_from = match (bytes, &lease) {
            (Some(b), _) => Some(b.as_ptr() as u64),
            (None, Some(l)) if own && M::HOST_VISIBLE => Some(l.device_ptr()),
            _ => None,
        };
        if let Some(addr) = inline_from {
            let header = if Self::headerless(conn, FrameKind::Data, false, total as u32, total) {
                0
            } else {
                HEADER_LEN
            };
            if conn.pending.is_empty()
                && conn.credits >= 2
                && !conn.free_send.is_empty()
                && Self::inline(conn, header + total, true)
            {
                let f = Frame {
                    kind: FrameKind::Data,
                    seq,
                    total: total as u32,
                    more: false,
                    payload: Payload::None,
                };
                if let Err(e) = Self::post_frame(conn, f, (addr, total, 0), true) {
                    return Err((e, lease));
                }
                conn.tx_seq += 1;
                Self::refill(&self.recv_pool, frag, conn);
                return Ok(());
            }
        }
        match lease {
            // One fragment from a lease of our own registered pools: zero copy.
            Some(l) if total <= frag && own => {
                conn.pending.push_back(Frame {
                    kind: FrameKind::Data,
                    seq,
                    total: total as u32,
                    more: false,
                    payload: Payload::Lease(l, total),
                });
            }
            lease => {
                let mut frames = Vec::new();
                let mut off = 0;
                loop {
                    let n = (total - off).min(frag);
                    let payload = if n == 0 {
                        Payload::None
                    } else {
                        let mut buf = match Lease::take(Arc::clone(&self.send_pool), n) {
                            Ok(b) => b,
                            // A dry send pool is back-pressure: try again after completions.
                            Err(Error::Pool(_)) => return Err((Error::WouldBlock, lease)),
                            Err(e) => return Err((e, lease)),
                        };
                        let copied = match (&bytes, &lease) {
                            (Some(b), _) => self.memory.write(&mut buf, 0, &b[off..off + n]),
                            (None, Some(l)) => self.memory.copy(&mut buf, 0, l, off, n),
                            (None, None) => Ok(()),
                        };
                        if let Err(e) = copied {
                            return Err((e, lease));
                        }
                        Payload::Lease(buf, n)
                    };
                    off += n;
                    frames.push(Frame {
                        kind: FrameKind::Data,
                        seq,
                        total: total as u32,
                        more: off < total,
                        payload,
                    });
                    if off >= total {
                        break;
                    }
                }
                conn.pending.extend(frames);
            }
        }
        conn.tx_seq += 1;
        // The message is queued: a posting failure now means a broken QP,
        // which the next progress reports for this peer.
        let _ = Self::pump(conn, self.config.recv_depth);
        Self::refill(&self.recv_pool, frag, conn);
        Ok(())
    }

    /// Drains completion events and the CQ of every connection, and CM events.
    fn poll_all(&mut self) -> bool {
        let mut any = self.accept_all();
        for i in 0..self.peers.len() {
            let Some(mut conn) = self.peers[i].take() else {
                continue;
            };
            let outcome = self.poll_conn(&mut conn, PeerId(i as u32));
            any |= outcome.is_err() || outcome.as_ref().is_ok_and(|p| *p);
            match outcome {
                Ok(_) if !(conn.peer_closed && conn.idle()) => self.peers[i] = Some(conn),
                Ok(_) => self.teardown(&mut conn),
                Err(e) => self.retire(&mut conn, Some(e)),
            }
        }
        any
    }

    /// Runs `work` on connection `i`, taken out of the table meanwhile; a
    /// failure tears the connection down and is reported once through
    /// `try_recv`. Returns what `work` said (true on a failure: something happened).
    fn service(
        &mut self,
        i: usize,
        work: impl FnOnce(&mut Self, &mut Conn<M>, PeerId) -> Result<bool, Error>,
    ) -> bool {
        let Some(mut conn) = self.peers.get_mut(i).and_then(Option::take) else {
            return false;
        };
        match work(self, &mut conn, PeerId(i as u32)) {
            Ok(any) => {
                self.peers[i] = Some(conn);
                any
            }
            Err(e) => {
                self.retire(&mut conn, Some(e));
                true
            }
        }
    }

    /// Reaps completions and posts what they free: the caller's fast path.
    fn drain_and_pump(&mut self, conn: &mut Conn<M>, peer: PeerId) -> Result<bool, Error> {
        let n = self.drain_cq(conn, peer)?;
        Ok(Self::pump(conn, self.config.recv_depth)? || n > 0)
    }

    /// The caller's fast path: completions only (no system call on providers
    /// whose CQ lives in user memory); CM events and channel re-arming are the
    /// progress thread's.
    fn poll_fast(&mut self) {
        for i in 0..self.peers.len() {
            self.service(i, Self::drain_and_pump);
        }
    }

    /// A sender's own progress: when `peer`'s send ring is full or frames
    /// wait for credits, reap its completions and post what they free, here,
    /// rather than wait for the progress thread to be woken for it.
    fn reap(&mut self, peer: PeerId) {
        let i = peer.0 as usize;
        let busy = matches!(self.peers.get(i), Some(Some(c)) if c.free_send.is_empty() || !c.pending.is_empty());
        if busy {
            self.service(i, Self::drain_and_pump);
        }
    }

    /// Takes and acknowledges the completion-channel events already there (so
    /// the channel is not left readable by a stale one), drains the CQ, arms
    /// it for the next event and drains once more (a completion between the
    /// last poll and the arming raises no event). Returns whether anything completed.
    fn drain_and_arm(&mut self, conn: &mut Conn<M>, peer: PeerId) -> Result<bool, Error> {
        let mut any = false;
        let mut cq = ptr::null_mut();
        let mut ctx = ptr::null_mut();
        let mut events = 0;
        // SAFETY: a live, non-blocking completion channel and valid out-pointers.
        while unsafe { ffi::ibv_get_cq_event(conn.comp.as_ptr(), &mut cq, &mut ctx) } == 0 {
            events += 1;
        }
        if events > 0 {
            // SAFETY: acknowledges exactly the events taken above.
            unsafe { ffi::ibv_ack_cq_events(conn.cq.as_ptr(), events) };
        }
        loop {
            let n = self.drain_cq(conn, peer)?;
            any |= n > 0;
            if n == 0 {
                // SAFETY: a live CQ.
                unsafe { ffi::ibv_req_notify_cq(conn.cq.as_ptr(), 0) };
                if self.drain_cq(conn, peer)? == 0 {
                    break;
                }
                any = true;
            }
        }
        Ok(any)
    }

    /// Readies the completion channels for a thread about to sleep on them
    /// (see `drain_and_arm`), so it sleeps only with every CQ armed and wakes
    /// on the next completion, not on an old event. Returns whether anything
    /// completed meanwhile (then it should not sleep).
    pub fn arm_completions(&mut self) -> bool {
        let before = self.arrivals.len();
        let mut any = false;
        for i in 0..self.peers.len() {
            any |= self.service(i, |t, conn, peer| {
                Ok(t.drain_and_arm(conn, peer)? | Self::pump(conn, t.config.recv_depth)?)
            });
        }
        any || self.arrivals.len() != before
    }

    /// Messages (or errors) waiting for `try_recv`.
    pub fn has_arrivals(&self) -> bool {
        !self.arrivals.is_empty()
    }

    fn poll_conn(&mut self, conn: &mut Conn<M>, peer: PeerId) -> Result<bool, Error> {
        let mut any = false;
        // CM events of a connecting side arrive on its own channel.
        if let Some(ch) = conn.channel {
            while let Ok(Some(ev)) = next_event(ch, Duration::ZERO) {
                any = true;
                if ev.kind == ffi::rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED {
                    // Expected after a Close either way; otherwise the peer vanished.
                    if !conn.peer_closed && !conn.closing {
                        return Err(Error::PeerLost(peer));
                    }
                    conn.peer_closed = true;
                }
            }
        }
        any |= self.drain_and_arm(conn, peer)?;
        any |= Self::pump(conn, self.config.recv_depth)?;
        Ok(any)
    }

    fn drain_cq(&mut self, conn: &mut Conn<M>, peer: PeerId) -> Result<usize, Error> {
        Self::refill(&self.recv_pool, self.config.fragment, conn);
        // Not zeroed: this runs on every poll of a spinning receiver.
        let mut wcs = std::mem::MaybeUninit::<[ffi::ibv_wc; POLL_BATCH]>::uninit();
        // SAFETY: a live CQ and room for POLL_BATCH completions.
        let n = unsafe {
            ffi::ibv_poll_cq(conn.cq.as_ptr(), POLL_BATCH as i32, wcs.as_mut_ptr().cast())
        };
        if n < 0 {
            return Err(Error::Backend("ibv_poll_cq"));
        }
        // SAFETY: ibv_poll_cq wrote the first `n` (<= POLL_BATCH) completions.
        let wcs =
            unsafe { std::slice::from_raw_parts(wcs.as_ptr().cast::<ffi::ibv_wc>(), n as usize) };
        for wc in wcs {
            if wc.status != ffi::ibv_wc_status::IBV_WC_SUCCESS {
                // A QP in error (retries exceeded, peer gone): every pending send fails with it.
                if conn.peer_closed && wc.status == ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR {
                    continue;
                }
                return Err(Error::PeerLost(peer));
            }
            if wc.wr_id & SEND_TAG != 0 {
                Self::send_completed(conn, (wc.wr_id & !SEND_TAG) as usize);
            } else {
                if !conn.established {
                    Self::established_by_arrival(conn);
                }
                let imm = (wc.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0).then(|| {
                    // SAFETY: the flag says the union holds the immediate data.
                    u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })
                });
                self.received(conn, peer, wc.wr_id as usize, wc.byte_len as usize, imm)?;
            }
        }
        Ok(n as usize)
    }

    /// The accepting side's first receive can complete before its CM event
    /// channel reports the connection established: the peer may send as
    /// soon as its own side is, and the RTU that raises our event travels
    /// (and is read, by whoever polls the CM next) behind it. A frame that
    /// arrived proves the connection, so replies may go at once — a reply
    /// refused meanwhile failed a server's first answer under load — and
    /// librdmacm is told, as `rdma_notify` is for.
    fn established_by_arrival(conn: &mut Conn<M>) {
        conn.established = true;
        // SAFETY: a live id with a QP. Its only effect is the ESTABLISHED
        // event, which `accept_all` takes as a no-op now; a failure (the
        // event already on its way) changes nothing here.
        unsafe { ffi::rdma_notify(conn.id.as_ptr(), ffi::ibv_event_type::IBV_EVENT_COMM_EST) };
    }

    fn received(
        &mut self,
        conn: &mut Conn<M>,
        peer: PeerId,
        slot: usize,
        byte_len: usize,
        imm: Option<u32>,
    ) -> Result<(), Error> {
        let mut lease = conn.recv[slot]
            .take()
            .ok_or(Error::Backend("completion for an empty receive slot"))?;
        if let Some(credits) = imm {
            return self.received_headerless(conn, peer, slot, lease, byte_len, credits);
        }
        // Host payloads carry their header in front (see `post_recv`).
        let in_place = self.memory.host_view(&lease);
        let header_in_place = in_place.is_some();
        let header = match in_place {
            Some(bytes) => bytes,
            None => &host_bytes(&conn.headers)[slot * HEADER_LEN..(slot + 1) * HEADER_LEN],
        };
        // Only what arrived: a frame shorter than a header would otherwise
        // be read against the stale bytes of the buffer's last frame.
        let h = Header::decode(&header[..byte_len.min(header.len())], self.config.fragment)
            .map_err(|error| Error::Protocol {
                peer,
                error: error.into(),
            })?;
        if header_in_place {
            // The payload follows the header in the same buffer: hand it on from there.
            lease.advance(HEADER_LEN)?;
        }
        conn.credits = conn.credits.saturating_add(h.dst);
        conn.unposted.push(slot as u32);
        match h.kind {
            FrameKind::Data => {}
            FrameKind::Close => {
                conn.peer_closed = true;
                return Ok(());
            }
            FrameKind::Credit | FrameKind::Hello => return Ok(()),
        }
        let len = h.len as usize;
        if byte_len != HEADER_LEN + len {
            return Err(Error::Protocol {
                peer,
                error: zerohop_core::wire_v1::DecodeError::UnexpectedPayload.into(),
            });
        }
        let total = h.src as usize;
        let more = h.flags.contains(Flags::MORE);
        if conn.assembling.is_none() && !more {
            lease.set_len(len)?;
            self.deliver(conn, peer, h.seq, lease);
            return Ok(());
        }
        if conn.assembling.is_none() {
            if total > self.config.max_message {
                return Err(Error::TooLarge {
                    len: total,
                    max: self.config.max_message,
                });
            }
            let whole = Lease::take(Arc::clone(&self.recv_pool), total.max(1))?;
            conn.assembling = Some((whole, 0));
        }
        let (whole, have) = conn.assembling.as_mut().expect("set above");
        if *have + len > whole.capacity() {
            return Err(Error::Protocol {
                peer,
                error: zerohop_core::wire_v1::DecodeError::UnexpectedPayload.into(),
            });
        }
        self.memory.copy(whole, *have, &lease, 0, len)?;
        *have += len;
        if !more {
            let (mut whole, have) = conn.assembling.take().expect("set above");
            whole.set_len(have)?;
            self.deliver(conn, peer, h.seq, whole);
        }
        Ok(())
    }

    /// A headerless frame: a whole message at the start of the buffer, the
    /// credits it returns in the immediate data. Only a receiver that
    /// announced it takes them, and never inside a split message (a sender
    /// sends a message's fragments back to back, with headers).
    fn received_headerless(
        &mut self,
        conn: &mut Conn<M>,
        peer: PeerId,
        slot: usize,
        mut lease: PayloadLease<M>,
        byte_len: usize,
        credits: u32,
    ) -> Result<(), Error> {
        if !self.takes_headerless() || conn.assembling.is_some() || byte_len > self.config.fragment
        {
            return Err(Error::Protocol {
                peer,
                error: zerohop_core::wire_v1::DecodeError::UnexpectedPayload.into(),
            });
        }
        conn.credits = conn.credits.saturating_add(credits);
        conn.unposted.push(slot as u32);
        lease.set_len(byte_len)?;
        let seq = conn.rx_next;
        self.deliver(conn, peer, seq, lease);
        Ok(())
    }

    /// Hands a whole message to the application, reporting a gap in the
    /// sequence first (RC delivers in order, so a gap means a peer bug).
    fn deliver(&mut self, conn: &mut Conn<M>, peer: PeerId, seq: u64, lease: PayloadLease<M>) {
        if seq != conn.rx_next {
            self.arrivals.push_back(Err(Error::SequenceGap {
                peer,
                expected: conn.rx_next,
                got: seq,
            }));
        }
        conn.rx_next = seq + 1;
        self.arrivals.push_back(Ok(Received { peer, lease }));
    }

    fn accept_all(&mut self) -> bool {
        let Some((ch, _)) = self.listener else {
            return false;
        };
        let mut any = false;
        while let Ok(Some(ev)) = next_event(ch, Duration::ZERO) {
            any = true;
            let Some(id) = NonNull::new(ev.id) else {
                continue;
            };
            match ev.kind {
                ffi::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST => {
                    // A closed listener, or a peer whose ring could never
                    // take a data frame: refused before anything is set up.
                    let credits = match usable_depth(ev.peer_depth) {
                        Ok(credits) if !self.closed => credits,
                        _ => {
                            // SAFETY: refuse the request on its own id, which nothing else holds.
                            unsafe {
                                ffi::rdma_reject(id.as_ptr(), ptr::null(), 0);
                                ffi::rdma_destroy_id(id.as_ptr());
                            }
                            continue;
                        }
                    };
                    match self.setup(id, None) {
                        Ok(mut conn) => {
                            conn.credits = credits;
                            conn.peer_headerless = ev.peer_flags & PRIVATE_HEADERLESS != 0;
                            let private = self.private();
                            let mut param = conn_param(&private);
                            // SAFETY: a live id with a QP; `param` outlives the call.
                            if unsafe { ffi::rdma_accept(id.as_ptr(), &mut param) } != 0 {
                                self.teardown(&mut conn);
                            } else {
                                self.add(conn);
                            }
                        }
                        Err(_) => {
                            // SAFETY: reject and drop the request's id, which nothing else holds.
                            unsafe {
                                ffi::rdma_reject(id.as_ptr(), ptr::null(), 0);
                                ffi::rdma_destroy_id(id.as_ptr());
                            }
                        }
                    }
                }
                ffi::rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED => {
                    if let Some(c) = self.peers.iter_mut().flatten().find(|c| c.id == id) {
                        c.established = true;
                    }
                }
                // The peer went away, or an accepted connection never came
                // up (the peer refused our reply, or it was lost): either way
                // the connection leaves the table and its ring goes back to
                // the pool. (librdmacm also moves a failed one's QP to
                // error: whichever `drain_cq`'s flushed receives or this
                // event comes first takes it down.)
                ffi::rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED
                | ffi::rdma_cm_event_type::RDMA_CM_EVENT_REJECTED
                | ffi::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_ERROR
                | ffi::rdma_cm_event_type::RDMA_CM_EVENT_UNREACHABLE => {
                    if let Some(i) = self
                        .peers
                        .iter()
                        .position(|c| c.as_ref().is_some_and(|c| c.id == id))
                    {
                        let mut conn = self.peers[i].take().expect("found");
                        let lost = !conn.peer_closed && !conn.closing;
                        self.retire(&mut conn, lost.then_some(Error::PeerLost(PeerId(i as u32))));
                    }
                }
                _ => {}
            }
        }
        any
    }

    /// Takes down a connection that failed (`error`) or ended. The error
    /// reaches `try_recv` only if the application can know the peer: an
    /// accepted connection that never came up (no ESTABLISHED event, no
    /// frame) was never handed out, and sends to it were refused.
    fn retire(&mut self, conn: &mut Conn<M>, error: Option<Error>) {
        if let (Some(e), true) = (error, conn.established) {
            self.arrivals.push_back(Err(e));
        }
        self.teardown(conn);
    }

    /// Disconnects and destroys everything the connection owns: its verbs
    /// objects, its CM id and, on the connecting side, its event channel;
    /// its leases go back to their pools.
    fn teardown(&self, conn: &mut Conn<M>) {
        // SAFETY: a live id; disconnecting moves its QP to error first.
        unsafe { ffi::rdma_disconnect(conn.id.as_ptr()) };
        Self::release_verbs(conn);
        // SAFETY: the id's QP is gone; the id and then its channel, each destroyed once.
        unsafe {
            ffi::rdma_destroy_id(conn.id.as_ptr());
            if let Some(ch) = conn.channel.take() {
                ffi::rdma_destroy_event_channel(ch.as_ptr());
            }
        }
    }

    /// Destroys the QP, CQ and completion channel and drops every buffer
    /// the connection holds; the CM id and its channel stay (`setup` hands
    /// them back to its caller on failure).
    fn release_verbs(conn: &mut Conn<M>) {
        // SAFETY: each object is destroyed once, QP first (so the NIC stops
        // touching the posted buffers before their leases are dropped below).
        unsafe {
            ffi::rdma_destroy_qp(conn.id.as_ptr());
            ffi::ibv_destroy_cq(conn.cq.as_ptr());
            ffi::ibv_destroy_comp_channel(conn.comp.as_ptr());
        }
        conn.recv.clear();
        conn.unposted.clear();
        conn.send.clear();
        conn.unsignaled.clear();
        conn.pending.clear();
        conn.assembling = None;
    }

    /// The descriptors to wait on: connection-manager channels (`cm`) and
    /// completion channels (`completions`).
    pub fn poll_descriptors(&self, out: &mut Vec<i32>, cm: bool, completions: bool) {
        if let (true, Some((ch, _))) = (cm, self.listener) {
            // SAFETY: a live channel.
            out.push(unsafe { (*ch.as_ptr()).fd });
        }
        for c in self.peers.iter().flatten() {
            if completions {
                // SAFETY: live channels.
                out.push(unsafe { (*c.comp.as_ptr()).fd });
            }
            if let (true, Some(ch)) = (cm, c.channel) {
                // SAFETY: a live channel.
                out.push(unsafe { (*ch.as_ptr()).fd });
            }
        }
    }

    /// Whether messages to `peer` that fit one fragment leave without a
    /// header (the peer announced it takes them); `None` for no such peer.
    pub fn sends_headerless(&self, peer: PeerId) -> Option<bool> {
        let conn = self.peers.get(peer.0 as usize)?.as_ref()?;
        Some(conn.peer_headerless)
    }

    /// Frames queued (waiting for credits) but not yet posted.
    pub fn unposted_frames(&self) -> usize {
        self.peers.iter().flatten().map(|c| c.pending.len()).sum()
    }

    /// Frames queued, or posted and not yet completed (an unsignaled inline
    /// frame counts as sent once posted: the NIC holds a copy, and a failure
    /// still surfaces as an error completion).
    pub fn pending_frames(&self) -> usize {
        self.peers
            .iter()
            .flatten()
            .map(|c| c.pending.len() + c.send.iter().filter(|s| s.is_some()).count())
            .sum()
    }
}

impl<M: PayloadMemory> Conn<M> {
    /// Nothing queued and nothing in flight.
    fn idle(&self) -> bool {
        self.pending.is_empty() && self.send.iter().all(Option::is_none)
    }
}

fn conn_param(private: &[u8; 8]) -> ffi::rdma_conn_param {
    // SAFETY: an all-zero conn param is valid; the fields are set below.
    let mut p: ffi::rdma_conn_param = unsafe { std::mem::zeroed() };
    p.private_data = private.as_ptr().cast();
    p.private_data_len = private.len() as u8;
    p.responder_resources = 1;
    p.initiator_depth = 1;
    p.retry_count = 7;
    p.rnr_retry_count = 7;
    p
}

/// The default buffer sizes with one of exactly `frame` bytes among them: the
/// receive ring's buffers, filled to the byte by a full frame.
fn receive_classes(frame: usize) -> Result<SizeClasses, Error> {
    let mut sizes = [0usize; zerohop_core::MAX_CLASSES];
    let mut n = 0;
    for &c in SizeClasses::DEFAULT.as_slice() {
        if c > frame && (n == 0 || sizes[n - 1] < frame) {
            sizes[n] = frame;
            n += 1;
        }
        if c != frame {
            sizes[n] = c;
            n += 1;
        }
    }
    if sizes[n - 1] < frame {
        sizes[n] = frame;
        n += 1;
    }
    SizeClasses::new(&sizes[..n]).map_err(Error::Pool)
}

fn host_bytes_mut_range(l: &mut HeaderLease, at: usize, len: usize) -> &mut [u8] {
    &mut host_bytes_mut(l)[at..at + len]
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
        match self.queue(peer, None, Some(lease)) {
            Ok(()) => Ok(()),
            Err((error, lease)) => Err(Rejected {
                error,
                lease: lease.expect("a refused lease is always handed back"),
            }),
        }
    }

    fn try_recv(&mut self) -> Result<Received<PayloadLease<M>>, Error> {
        if self.arrivals.is_empty() {
            self.poll_fast();
        }
        match self.arrivals.pop_front() {
            Some(r) => r,
            None if self.closed && self.peers.iter().all(Option::is_none) => Err(Error::Closed),
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
        for c in self.peers.iter_mut().flatten() {
            let seq = c.tx_seq;
            c.pending.push_back(Frame {
                kind: FrameKind::Close,
                seq,
                total: 0,
                more: false,
                payload: Payload::None,
            });
            c.closing = true;
            let _ = Self::pump(c, self.config.recv_depth);
        }
        Ok(())
    }
}

impl<M: PayloadMemory> Drop for RdmaTransport<M> {
    fn drop(&mut self) {
        for i in 0..self.peers.len() {
            if let Some(mut c) = self.peers[i].take() {
                self.teardown(&mut c);
            }
        }
        if let Some((ch, id)) = self.listener.take() {
            // SAFETY: the listening id and its channel, destroyed once.
            unsafe {
                ffi::rdma_destroy_id(id.as_ptr());
                ffi::rdma_destroy_event_channel(ch.as_ptr());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_private, receive_classes, PRIVATE_HEADERLESS};

    #[test]
    fn private_data_of_old_and_new_peers_reads_as_depth_and_flags() {
        // This side: depth 64, takes headerless frames.
        let mut ours = [0u8; 8];
        ours[..4].copy_from_slice(&64u32.to_le_bytes());
        ours[4..].copy_from_slice(&PRIVATE_HEADERLESS.to_le_bytes());
        assert_eq!(parse_private(&ours), (Some(64), PRIVATE_HEADERLESS));
        // A one-word peer, as the CM delivers it (zero padded to 56 bytes): no flags.
        let mut old = [0u8; 56];
        old[..4].copy_from_slice(&32u32.to_le_bytes());
        assert_eq!(parse_private(&old), (Some(32), 0));
        assert_eq!(parse_private(&old[..4]), (Some(32), 0));
        // Nothing, or less than a word: no depth (no credits), no flags.
        assert_eq!(parse_private(&[]), (None, 0));
        assert_eq!(parse_private(&[1, 2, 3]), (None, 0));
    }

    #[test]
    fn receive_classes_hold_a_whole_frame_exactly() {
        let c = |f| receive_classes(f).unwrap().as_slice().to_vec();
        let k = 1 << 10;
        assert_eq!(
            c(64 * k + 32),
            [256, k, 4 * k, 16 * k, 64 * k, 64 * k + 32, 1 << 20]
        );
        assert_eq!(
            c(64 * k),
            [256, k, 4 * k, 16 * k, 64 * k, 1 << 20],
            "no duplicate"
        );
        assert_eq!(c(100), [100, 256, k, 4 * k, 16 * k, 64 * k, 1 << 20]);
        assert_eq!(
            c(4 << 20),
            [256, k, 4 * k, 16 * k, 64 * k, 1 << 20, 4 << 20]
        );
    }
}
