//! Owning types for the connection's verbs objects: each frees itself in
//! `Drop` and holds what it needs to outlive it (rust-ibverbs' and
//! sideway's shape), so no error path destroys anything by hand, or twice.
//!
//! - [`EventChannel`]: a librdmacm event channel, shared (`Arc`) by the ids on it.
//! - [`CmId`]: a connection-manager id; holds its channel.
//! - [`Cq`]: a completion queue with its own completion channel (a thread
//!   can sleep on the channel's descriptor).
//! - [`Qp`]: an RC queue pair created on a [`CmId`]; owns the id and the CQ,
//!   and is destroyed first (QP, then id, then CQ and channel), so the NIC
//!   stops touching posted buffers before anything else goes.
//!
//! The channel and the id are public: the verbs tests drive hand-written
//! peers (ids without queue pairs, private data of their choosing) with them.

use std::net::SocketAddr;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys as ffi;

use super::{call_failed, VerbsError};

/// The longest the CM's own timers are given for address or route
/// resolution (ms); a connect's timeout bounds each further.
pub const CM_TIMEOUT_MS: i32 = 5000;

fn set_nonblocking(fd: i32) {
    // SAFETY: fcntl on a descriptor we own; no memory is touched.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
}

/// A CM event, copied out (the event itself is acked at once).
#[derive(Debug)]
pub struct CmEvent {
    /// What happened.
    pub kind: ffi::rdma_cm_event_type::Type,
    /// The id it concerns (a connect request's is new: see [`CmId::adopt`]).
    pub id: *mut ffi::rdma_cm_id,
    /// The event's status (a reject's reason, an error).
    pub status: i32,
    /// The first word of the peer's CM private data (`None` if it sent
    /// less; the CM pads what it carries with zeros): its receive depth on a
    /// request or an acceptance, a [`RejectReason`] on a reject.
    pub word: Option<u32>,
}

impl CmEvent {
    /// The event's name, as librdmacm spells it.
    pub fn name(&self) -> String {
        // SAFETY: rdma_event_str returns a static NUL-terminated string.
        unsafe { std::ffi::CStr::from_ptr(ffi::rdma_event_str(self.kind)) }
            .to_string_lossy()
            .into_owned()
    }
}

/// A librdmacm event channel.
#[derive(Debug)]
pub struct EventChannel(NonNull<ffi::rdma_event_channel>);

// SAFETY: the channel is used through `&self` calls librdmacm makes thread
// safe (rdma_get_cm_event); it is destroyed once, in Drop.
unsafe impl Send for EventChannel {}
// SAFETY: as above.
unsafe impl Sync for EventChannel {}

impl EventChannel {
    /// A new channel, non-blocking.
    pub fn new() -> Result<Arc<EventChannel>, VerbsError> {
        // SAFETY: creates a channel we own.
        let ch = NonNull::new(unsafe { ffi::rdma_create_event_channel() })
            .ok_or_else(|| call_failed("rdma_create_event_channel"))?;
        let ch = EventChannel(ch);
        set_nonblocking(ch.fd());
        Ok(Arc::new(ch))
    }

    /// Its descriptor, readable when an event waits.
    pub fn fd(&self) -> i32 {
        // SAFETY: a live channel.
        unsafe { (*self.0.as_ptr()).fd }
    }

    /// Takes one event if one is ready within `timeout`.
    pub fn next(&self, timeout: Duration) -> Result<Option<CmEvent>, VerbsError> {
        let mut pfd = libc::pollfd {
            fd: self.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // Whole milliseconds, rounded up: a wait under one is not a spin.
        let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut pfd, 1, ms) } <= 0 {
            return Ok(None);
        }
        let mut ev: *mut ffi::rdma_cm_event = ptr::null_mut();
        // SAFETY: a live channel and a valid out-pointer; the fd is readable.
        if unsafe { ffi::rdma_get_cm_event(self.0.as_ptr(), &mut ev) } != 0 {
            return match call_failed("rdma_get_cm_event") {
                VerbsError::Call {
                    errno: libc::EAGAIN,
                    ..
                } => Ok(None),
                e => Err(e),
            };
        }
        // SAFETY: the event is valid until acked below. Both members of its
        // param union (`conn`, `ud`) begin with the private-data pointer and
        // length, which librdmacm sets for every event (null and 0 where
        // there is none), and the data lives as long as the event.
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
            CmEvent {
                kind: e.event,
                id: e.id,
                status: e.status,
                word: private
                    .get(..4)
                    .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])),
            }
        };
        // SAFETY: acked once, after its data was copied out.
        unsafe { ffi::rdma_ack_cm_event(ev) };
        Ok(Some(out))
    }

    /// Waits (until `until`) for the next event, which must be `want`.
    pub fn expect(
        &self,
        want: ffi::rdma_cm_event_type::Type,
        what: &str,
        until: Instant,
    ) -> Result<CmEvent, VerbsError> {
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                // One last look: an event already queued is taken.
                if let Some(ev) = self.next(Duration::ZERO)? {
                    return if ev.kind == want {
                        Ok(ev)
                    } else {
                        Err(unexpected(&ev, what))
                    };
                }
                return Err(VerbsError::Unreachable(format!(
                    "timed out waiting for {what}"
                )));
            }
            if let Some(ev) = self.next(left)? {
                if ev.kind == want {
                    return Ok(ev);
                }
                return Err(unexpected(&ev, what));
            }
        }
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every id on the channel holds an Arc to it, so none is left.
        unsafe { ffi::rdma_destroy_event_channel(self.0.as_ptr()) };
    }
}

/// Why a zerohop listener rejected a connect request: the little-endian
/// word of private data its reject carries, so the connecting side can tell
/// a refusal from a mismatch. A reject without it (0: another listener, or
/// the CM's own answer to a request whose id went away unanswered) names
/// every cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum RejectReason {
    /// The listener keeps as many peers as its limits allow, has no slot
    /// left, or is closing: a newcomer is turned away.
    Refused = 1,
    /// The connecting side's receive ring is too shallow for credit to
    /// keep moving (below [`MIN_RECV_DEPTH`](super::MIN_RECV_DEPTH)).
    ShallowRing = 2,
    /// The listener could not set a connection up (no receive buffers or
    /// header ring left, the device refused a queue pair, or the route
    /// leaves through another RDMA device than its own).
    NoResources = 3,
}

impl RejectReason {
    fn from_word(word: Option<u32>) -> Option<Self> {
        match word? {
            1 => Some(RejectReason::Refused),
            2 => Some(RejectReason::ShallowRing),
            3 => Some(RejectReason::NoResources),
            _ => None,
        }
    }
}

/// What an event other than the one awaited (during `what`) says: for a
/// REJECTED event, the two causes a zerohop peer meets (the IB CM's reject
/// reasons, RoCE and InfiniBand, as `ib_cm.h` numbers them); for the events
/// of a peer never reached, that.
fn unexpected(ev: &CmEvent, what: &str) -> VerbsError {
    use ffi::rdma_cm_event_type as t;
    const INVALID_SERVICE_ID: i32 = 8;
    const CONSUMER_DEFINED: i32 = 28;
    let got = || format!("{what}: got {} (status {})", ev.name(), ev.status);
    match (ev.kind, ev.status) {
        (t::RDMA_CM_EVENT_REJECTED, INVALID_SERVICE_ID) => VerbsError::NoListener,
        (t::RDMA_CM_EVENT_REJECTED, CONSUMER_DEFINED) => {
            VerbsError::Rejected(RejectReason::from_word(ev.word))
        }
        (
            t::RDMA_CM_EVENT_ADDR_ERROR
            | t::RDMA_CM_EVENT_ROUTE_ERROR
            | t::RDMA_CM_EVENT_UNREACHABLE
            | t::RDMA_CM_EVENT_CONNECT_ERROR,
            _,
        ) => VerbsError::Unreachable(got()),
        _ => VerbsError::Connect(got()),
    }
}

fn sockaddr(addr: SocketAddr) -> libc::sockaddr_storage {
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
        }
    }
    ss
}

/// The address in `ss`, if it is an IPv4 or IPv6 one.
fn socket_addr(ss: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match i32::from(ss.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in, which it is large and aligned enough for.
            let sin =
                unsafe { &*(ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            let ip = std::net::Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::from((ip, u16::from_be(sin.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 =
                unsafe { &*(ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddr::V6(std::net::SocketAddrV6::new(
                ip,
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

fn conn_param(private: &[u8]) -> ffi::rdma_conn_param {
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

/// A connection-manager id, TCP port space.
#[derive(Debug)]
pub struct CmId {
    id: NonNull<ffi::rdma_cm_id>,
    /// The channel its events arrive on: it outlives the id.
    channel: Arc<EventChannel>,
}

// SAFETY: the id is used through `&self` calls that librdmacm makes thread
// safe; it is destroyed once, in Drop.
unsafe impl Send for CmId {}

impl CmId {
    /// A new id on `channel`.
    pub fn new(channel: &Arc<EventChannel>) -> Result<CmId, VerbsError> {
        let mut id = ptr::null_mut();
        // SAFETY: a live channel and a valid out-pointer.
        let rc = unsafe {
            ffi::rdma_create_id(
                channel.0.as_ptr(),
                &mut id,
                ptr::null_mut(),
                ffi::rdma_port_space::RDMA_PS_TCP,
            )
        };
        match NonNull::new(id) {
            Some(id) if rc == 0 => Ok(CmId {
                id,
                channel: Arc::clone(channel),
            }),
            _ => Err(call_failed("rdma_create_id")),
        }
    }

    /// Takes ownership of the id a CONNECT_REQUEST event brought on
    /// `channel` (the listener's).
    ///
    /// # Safety
    /// `id` is that event's id, not owned by anything else, and its events
    /// arrive on `channel`.
    pub unsafe fn adopt(id: NonNull<ffi::rdma_cm_id>, channel: &Arc<EventChannel>) -> CmId {
        CmId {
            id,
            channel: Arc::clone(channel),
        }
    }

    /// The raw id (librdmacm's).
    pub fn as_ptr(&self) -> *mut ffi::rdma_cm_id {
        self.id.as_ptr()
    }

    /// The channel its events arrive on.
    pub fn channel(&self) -> &Arc<EventChannel> {
        &self.channel
    }

    /// The device context its route goes through (after resolution or a request).
    pub fn verbs(&self) -> *mut ffi::ibv_context {
        // SAFETY: a live id.
        unsafe { (*self.id.as_ptr()).verbs }
    }

    /// The peer's address (a connect request's sender, or where a resolved id goes).
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: a live id; its route's destination is a sockaddr_storage
        // librdmacm fills at resolution or with the request.
        let ss = unsafe { &(*self.id.as_ptr()).route.addr.dst_addr_union.dst_storage };
        socket_addr(ss)
    }

    /// The address it is bound to (a listener's, with the port it was given).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: a live id; its route's source is a sockaddr_storage
        // librdmacm fills at bind or resolution.
        let ss = unsafe { &(*self.id.as_ptr()).route.addr.src_addr_union.src_storage };
        socket_addr(ss)
    }

    /// Binds to `addr` and listens.
    pub fn listen(&self, addr: SocketAddr, backlog: i32) -> Result<(), VerbsError> {
        let mut ss = sockaddr(addr);
        // SAFETY: a live id and a valid sockaddr; listen only after a successful bind.
        let rc = unsafe {
            match ffi::rdma_bind_addr(
                self.as_ptr(),
                (&mut ss as *mut libc::sockaddr_storage).cast(),
            ) {
                0 => ffi::rdma_listen(self.as_ptr(), backlog),
                e => e,
            }
        };
        match rc {
            0 => Ok(()),
            _ => Err(call_failed("rdma_bind_addr/rdma_listen")),
        }
    }

    /// Resolves `addr` and the route to it, waiting for both on the channel
    /// until `until` at most.
    pub fn resolve(&self, addr: SocketAddr, until: Instant) -> Result<(), VerbsError> {
        // What is left of the time, for the CM's own timers (1 ms at least).
        let left = || {
            let ms = until.saturating_duration_since(Instant::now()).as_millis();
            ms.clamp(1, CM_TIMEOUT_MS as u128) as i32
        };
        let mut ss = sockaddr(addr);
        // SAFETY: a live id and a valid destination sockaddr.
        let rc = unsafe {
            ffi::rdma_resolve_addr(
                self.as_ptr(),
                ptr::null_mut(),
                (&mut ss as *mut libc::sockaddr_storage).cast(),
                left(),
            )
        };
        if rc != 0 {
            return Err(call_failed("rdma_resolve_addr"));
        }
        self.channel.expect(
            ffi::rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED,
            "address resolution",
            until,
        )?;
        // SAFETY: a live id with a resolved address.
        if unsafe { ffi::rdma_resolve_route(self.as_ptr(), left()) } != 0 {
            return Err(call_failed("rdma_resolve_route"));
        }
        self.channel.expect(
            ffi::rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED,
            "route resolution",
            until,
        )?;
        Ok(())
    }

    /// Sends the connect request with `private` data (the id has a QP).
    pub fn connect(&self, private: &[u8]) -> Result<(), VerbsError> {
        self.connect_without_qp(private, 0)
    }

    /// Sends a connect request naming QP number `qp_num` (librdmacm fills
    /// in the id's own QP when it has one and this is 0): what a test's peer
    /// with no QP sends.
    pub fn connect_without_qp(&self, private: &[u8], qp_num: u32) -> Result<(), VerbsError> {
        let mut param = conn_param(private);
        param.qp_num = qp_num;
        // SAFETY: a live id; `param` and `private` outlive the call.
        match unsafe { ffi::rdma_connect(self.as_ptr(), &mut param) } {
            0 => Ok(()),
            _ => Err(call_failed("rdma_connect")),
        }
    }

    /// Accepts the request this id came with, with `private` data.
    pub fn accept(&self, private: &[u8]) -> Result<(), VerbsError> {
        self.accept_without_qp(private, 0)
    }

    /// Accepts naming QP number `qp_num` (see [`connect_without_qp`](Self::connect_without_qp)).
    pub fn accept_without_qp(&self, private: &[u8], qp_num: u32) -> Result<(), VerbsError> {
        let mut param = conn_param(private);
        param.qp_num = qp_num;
        // SAFETY: a live id with a QP; `param` outlives the call.
        match unsafe { ffi::rdma_accept(self.as_ptr(), &mut param) } {
            0 => Ok(()),
            _ => Err(call_failed("rdma_accept")),
        }
    }

    /// Refuses the request this id came with, or the answer to its own,
    /// saying why (best effort).
    pub fn reject(&self, why: RejectReason) {
        let word = (why as u32).to_le_bytes();
        // SAFETY: a live id, of a connect request or one answered (the CM
        // refuses any other with an error, which is ignored); librdmacm
        // copies `word` during the call.
        unsafe { ffi::rdma_reject(self.as_ptr(), word.as_ptr().cast(), word.len() as u8) };
    }

    /// Tells librdmacm the connection is up: a frame arrived before the
    /// ESTABLISHED event (best effort; the event then comes as a no-op).
    pub fn notify_established(&self) {
        // SAFETY: a live id with a QP.
        unsafe { ffi::rdma_notify(self.as_ptr(), ffi::ibv_event_type::IBV_EVENT_COMM_EST) };
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: a live id, destroyed once; a QP on it was destroyed first
        // (`Qp` owns the id and destroys its QP before this runs).
        unsafe { ffi::rdma_destroy_id(self.id.as_ptr()) };
    }
}

/// A completion queue and its own completion channel.
#[derive(Debug)]
pub(crate) struct Cq {
    cq: NonNull<ffi::ibv_cq>,
    channel: NonNull<ffi::ibv_comp_channel>,
}

// SAFETY: used through `&mut` of its owner; destroyed once, in Drop.
unsafe impl Send for Cq {}

impl Cq {
    /// A CQ of `depth` entries on `ctx`, armed, its channel non-blocking.
    pub fn new(ctx: *mut ffi::ibv_context, depth: usize) -> Result<Cq, VerbsError> {
        // SAFETY: a live context; the channel is destroyed in Drop (or below).
        let channel = NonNull::new(unsafe { ffi::ibv_create_comp_channel(ctx) })
            .ok_or_else(|| call_failed("ibv_create_comp_channel"))?;
        // SAFETY: a live context and channel.
        let cq =
            unsafe { ffi::ibv_create_cq(ctx, depth as i32, ptr::null_mut(), channel.as_ptr(), 0) };
        let Some(cq) = NonNull::new(cq) else {
            let e = call_failed("ibv_create_cq");
            // SAFETY: the channel has no CQ.
            unsafe { ffi::ibv_destroy_comp_channel(channel.as_ptr()) };
            return Err(e);
        };
        let cq = Cq { cq, channel };
        set_nonblocking(cq.fd());
        cq.arm();
        Ok(cq)
    }

    pub fn as_ptr(&self) -> *mut ffi::ibv_cq {
        self.cq.as_ptr()
    }

    /// The completion channel's descriptor: readable after a completion on an armed CQ.
    pub fn fd(&self) -> i32 {
        // SAFETY: a live channel.
        unsafe { (*self.channel.as_ptr()).fd }
    }

    /// Asks for an event at the next completion.
    pub fn arm(&self) {
        // SAFETY: a live CQ.
        unsafe { ffi::ibv_req_notify_cq(self.as_ptr(), 0) };
    }

    /// Takes and acknowledges the channel's events already there.
    pub fn take_events(&self) {
        let mut cq = ptr::null_mut();
        let mut ctx = ptr::null_mut();
        let mut events = 0;
        // SAFETY: a live, non-blocking channel and valid out-pointers.
        while unsafe { ffi::ibv_get_cq_event(self.channel.as_ptr(), &mut cq, &mut ctx) } == 0 {
            events += 1;
        }
        if events > 0 {
            // SAFETY: acknowledges exactly the events taken above.
            unsafe { ffi::ibv_ack_cq_events(self.as_ptr(), events) };
        }
    }

    /// Polls up to `out.len()` completions into `out`; how many came.
    pub fn poll(
        &self,
        out: &mut [std::mem::MaybeUninit<ffi::ibv_wc>],
    ) -> Result<usize, VerbsError> {
        // SAFETY: a live CQ and room for `out.len()` completions.
        let n =
            unsafe { ffi::ibv_poll_cq(self.as_ptr(), out.len() as i32, out.as_mut_ptr().cast()) };
        usize::try_from(n).map_err(|_| call_failed("ibv_poll_cq"))
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // Events taken but not acknowledged would make the destroy wait.
        self.take_events();
        // SAFETY: no QP uses the CQ any more (a `Qp` owning it is destroyed
        // first); the CQ, then its channel, each once.
        unsafe {
            ffi::ibv_destroy_cq(self.cq.as_ptr());
            ffi::ibv_destroy_comp_channel(self.channel.as_ptr());
        }
    }
}

/// An RC queue pair on a CM id, completing on one CQ.
#[derive(Debug)]
pub(crate) struct Qp {
    // Declared in drop order (after `Drop::drop` destroys the QP itself).
    id: CmId,
    cq: Cq,
    qp: NonNull<ffi::ibv_qp>,
    inline_max: usize,
}

// SAFETY: used through `&mut` of its owner (posting is thread safe anyway);
// destroyed once, in Drop.
unsafe impl Send for Qp {}

/// What to create a queue pair with.
#[derive(Clone, Copy, Debug)]
pub(crate) struct QpShape {
    pub send_depth: usize,
    pub recv_depth: usize,
    pub inline_want: usize,
}

impl Qp {
    /// Creates an RC QP on `id` in `pd`, with a CQ of its own. On failure
    /// the id comes back (a request can still be rejected with it).
    pub fn create(
        id: CmId,
        pd: *mut ffi::ibv_pd,
        shape: QpShape,
    ) -> Result<Qp, (VerbsError, CmId)> {
        let cq = match Cq::new(id.verbs(), shape.send_depth + shape.recv_depth + 16) {
            Ok(cq) => cq,
            Err(e) => return Err((e, id)),
        };
        // SAFETY: an all-zero qp_init_attr is a valid starting point.
        let mut attr: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attr.send_cq = cq.as_ptr();
        attr.recv_cq = cq.as_ptr();
        attr.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        attr.cap.max_send_wr = shape.send_depth as u32;
        attr.cap.max_recv_wr = shape.recv_depth as u32;
        attr.cap.max_send_sge = 2;
        attr.cap.max_recv_sge = 2;
        attr.cap.max_inline_data = shape.inline_want as u32;
        // SAFETY: a live id, PD and CQ; the attr lives across the call.
        let mut created = unsafe { ffi::rdma_create_qp(id.as_ptr(), pd, &mut attr) };
        if created != 0 {
            // A device without inline sends: every frame then leaves from registered memory.
            attr.cap.max_inline_data = 0;
            // SAFETY: as above.
            created = unsafe { ffi::rdma_create_qp(id.as_ptr(), pd, &mut attr) };
        }
        // SAFETY: a live id; after a successful create its `qp` is the QP.
        let qp = NonNull::new(unsafe { (*id.as_ptr()).qp });
        match qp {
            Some(qp) if created == 0 => Ok(Qp {
                id,
                cq,
                qp,
                // rdma_create_qp wrote back what the QP supports.
                inline_max: attr.cap.max_inline_data as usize,
            }),
            _ => Err((call_failed("rdma_create_qp"), id)),
        }
    }

    pub fn id(&self) -> &CmId {
        &self.id
    }

    pub fn cq(&self) -> &Cq {
        &self.cq
    }

    /// The longest frame the QP sends inline.
    pub fn inline_max(&self) -> usize {
        self.inline_max
    }

    /// Posts `wr`.
    ///
    /// # Safety
    /// Every SGE of `wr` names registered memory (or, inline, readable
    /// memory) that stays valid until the send completes (inline: until
    /// this call returns).
    pub unsafe fn post_send(&self, wr: &mut ffi::ibv_send_wr) -> Result<(), VerbsError> {
        let mut bad = ptr::null_mut();
        // SAFETY: a live QP; the caller vouches for the buffers.
        match unsafe { ffi::ibv_post_send(self.qp.as_ptr(), wr, &mut bad) } {
            0 => Ok(()),
            errno => Err(VerbsError::Call {
                call: "ibv_post_send",
                errno,
            }),
        }
    }

    /// Posts `wr` to the receive queue.
    ///
    /// # Safety
    /// Every SGE of `wr` names registered memory, writable by the NIC, that
    /// stays valid until the receive completes or the QP is destroyed.
    pub unsafe fn post_recv(&self, wr: &mut ffi::ibv_recv_wr) -> Result<(), VerbsError> {
        let mut bad = ptr::null_mut();
        // SAFETY: a live QP; the caller vouches for the buffers.
        match unsafe { ffi::ibv_post_recv(self.qp.as_ptr(), wr, &mut bad) } {
            0 => Ok(()),
            errno => Err(VerbsError::Call {
                call: "ibv_post_recv",
                errno,
            }),
        }
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: the id's QP, destroyed once; then the fields drop: the id
        // (rdma_destroy_id), then the CQ and its channel.
        unsafe {
            ffi::rdma_disconnect(self.id.as_ptr());
            ffi::rdma_destroy_qp(self.id.as_ptr());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_addresses_survive_the_sockaddr_round_trip() {
        for a in [
            "192.0.2.1:7471",
            "[fe80::1%3]:9",
            "[2001:db8::5]:65535",
            "0.0.0.0:0",
        ] {
            let a: SocketAddr = a.parse().unwrap();
            assert_eq!(socket_addr(&sockaddr(a)), Some(a));
        }
        // SAFETY: an all-zero sockaddr_storage is valid (family AF_UNSPEC).
        let unspec: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        assert_eq!(socket_addr(&unspec), None);
    }
}
