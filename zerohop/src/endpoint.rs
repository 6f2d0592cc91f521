//! One endpoint type whatever the transport: opened by picking, addressed
//! by host name or IP, and read as events.

use std::collections::HashMap;
use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[cfg(feature = "gpudirect-verbs")]
use zerohop_backends::verbs::RdmaTransport;
use zerohop_core::{Capabilities, Choice, Kind, PeerId};
use zerohop_std::shm::{LocalWire, ShmConfig, ShmLease};
use zerohop_std::tcp::{TcpConfig, TcpTransport};
use zerohop_std::{Deadline, Endpoint as Driven, EndpointConfig, StdLease};

use crate::message::Buf;
use crate::{Config, ConnectError, Error, Event, Message, Peer, Result, SendBuffer};

/// An endpoint over the transport this host runs best (or the one asked
/// for): listens, connects to any number of peers, sends bytes, and reports
/// messages and peers as events. Share it between threads by reference or
/// in an `Arc`: every method takes `&self`.
pub struct Endpoint {
    wire: Wire,
    choice: Choice,
    config: Config,
    max_message: usize,
    /// Whether TCP connections open a second connection for large messages.
    tcp_lanes: bool,
    /// Every peer's address, from its connection until its end is reported.
    book: Mutex<HashMap<PeerId, Entry>>,
    /// shm or uma on a host with a GPU: the device pool same-host peers
    /// exchange GPU messages from and into (its chunks allocated as
    /// messages need them, up to `pool_bytes`).
    #[cfg(feature = "cuda-uma")]
    device_pool: Option<std::sync::Arc<zerohop_backends::cuda::DevicePool>>,
}

struct Entry {
    addr: SocketAddr,
    errors: u64,
}

/// The transports the facade drives, each behind the std layer's endpoint
/// (deadlines, spinning then sleeping, the optional progress thread).
enum Wire {
    /// `tcp`; and `uma` where its same-host lanes cannot be set up (TCP
    /// into CUDA managed memory).
    Tcp(Driven<TcpTransport>),
    /// `shm`, and `uma` (its pool in CUDA managed memory): TCP whose
    /// same-host peers move to shared memory.
    Local(Driven<LocalWire>),
    #[cfg(feature = "gpudirect-verbs")]
    Rdma(Driven<zerohop_backends::verbs::RdmaTransport>),
    #[cfg(all(feature = "gpudirect-verbs", feature = "cuda-uma"))]
    Gpu(Driven<zerohop_backends::verbs::RdmaTransport<zerohop_backends::verbs::GpuPayload>>),
}

/// Runs `$body` with `$e` bound to whichever driven endpoint `$wire` holds.
macro_rules! each_wire {
    ($wire:expr, $e:ident => $body:expr) => {
        match $wire {
            Wire::Tcp($e) => $body,
            Wire::Local($e) => $body,
            #[cfg(feature = "gpudirect-verbs")]
            Wire::Rdma($e) => $body,
            #[cfg(all(feature = "gpudirect-verbs", feature = "cuda-uma"))]
            Wire::Gpu($e) => $body,
        }
    };
}

/// The lease types of the driven endpoints, to and from the facade's [`Buf`].
trait LeaseBuf: Sized {
    fn into_buf(self) -> Buf;
    fn from_buf(buf: Buf) -> Option<Self>;
}

impl LeaseBuf for ShmLease {
    fn into_buf(self) -> Buf {
        match self {
            ShmLease::Host(l) => Buf::Host(l),
            #[cfg(feature = "cuda-uma")]
            ShmLease::Device(l) => Buf::Device(l),
        }
    }
    fn from_buf(buf: Buf) -> Option<Self> {
        #[allow(unreachable_patterns)]
        match buf {
            Buf::Host(l) => Some(ShmLease::Host(l)),
            #[cfg(feature = "cuda-uma")]
            Buf::Device(l) => Some(ShmLease::Device(l)),
            _ => None,
        }
    }
}

impl LeaseBuf for StdLease {
    fn into_buf(self) -> Buf {
        Buf::Host(self)
    }
    fn from_buf(buf: Buf) -> Option<Self> {
        #[allow(unreachable_patterns)]
        match buf {
            Buf::Host(l) => Some(l),
            _ => None,
        }
    }
}

#[cfg(all(feature = "gpudirect-verbs", feature = "cuda-uma"))]
impl LeaseBuf for zerohop_core::Lease<std::sync::Arc<zerohop_backends::verbs::GpuPool>> {
    fn into_buf(self) -> Buf {
        Buf::Gpu(self)
    }
    fn from_buf(buf: Buf) -> Option<Self> {
        match buf {
            Buf::Gpu(l) => Some(l),
            _ => None,
        }
    }
}

/// Per-peer counters, as UCX and NCCL users read theirs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PeerStats {
    /// The peer's address.
    pub addr: SocketAddr,
    /// Messages sent to it (accepted by the wire).
    pub messages_sent: u64,
    /// Their bytes.
    pub bytes_sent: u64,
    /// Messages received from it, whole.
    pub messages_received: u64,
    /// Their bytes.
    pub bytes_received: u64,
    /// Times a send to it waited for credit (the peer's window or its ring).
    pub credit_stalls: u64,
    /// Calls about it that failed (a send that timed out, a message too long).
    pub errors: u64,
}

/// The blocking iterator of [`Endpoint::events`].
#[derive(Debug)]
pub struct Events<'a> {
    endpoint: &'a Endpoint,
    done: bool,
}

impl Iterator for Events<'_> {
    type Item = Result<Event>;

    fn next(&mut self) -> Option<Result<Event>> {
        if self.done {
            return None;
        }
        match self.endpoint.event_by(&mut Deadline::never()) {
            Err(e) if e.is_closed() => {
                self.done = true;
                None
            }
            r => Some(r),
        }
    }
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("kind", &self.kind())
            .field("local_addr", &self.local_addr())
            .field("peers", &self.book().len())
            .finish_non_exhaustive()
    }
}

fn resolve(
    addr: &(impl ToSocketAddrs + fmt::Display),
    op: &'static str,
) -> Result<Vec<SocketAddr>> {
    let failed = |why: String| Error::Address {
        op,
        addr: addr.to_string(),
        why,
    };
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| failed(e.to_string()))?
        .collect();
    if addrs.is_empty() {
        return Err(failed("the name has no address".into()));
    }
    Ok(addrs)
}

/// Waits for the Hello of a peer just attached (by [`Driven::attach`]), and
/// returns the id it ends up with; on any failure the peer is let go (a
/// no-op where the wire already dropped it).
fn answered<T: zerohop_std::Wire>(
    e: &Driven<T>,
    peer: PeerId,
    deadline: Deadline,
    let_go: fn(&mut T, PeerId) -> bool,
    then: impl FnOnce(PeerId),
) -> Result<PeerId, ConnectError> {
    e.wait_open_with(peer, deadline, then, |t, peer| {
        let_go(t, peer);
    })
    .map_err(ConnectError::from)
}

impl Endpoint {
    /// Picks the transport as `zerohop info` does and opens an endpoint on
    /// it, with no listener and no peers. An explicit choice that cannot run
    /// here is [`Error::Unavailable`], naming each missing prerequisite;
    /// automatic choice falls back to tcp, logging (at info level) why each
    /// faster transport was skipped ([`choice`](Self::choice) keeps it).
    pub fn open(config: Config) -> Result<Endpoint> {
        let max_message = config.message_limit()?;
        let probe = zerohop_std::probe_host();
        let choice = zerohop_core::pick(config.transport, &probe).map_err(Error::Unavailable)?;
        for s in choice.skipped() {
            log::info!("zerohop: skipped {s}");
        }
        let kind = choice.kind;
        let setup = |why: String| Error::Setup { kind, why };
        let driven = EndpointConfig {
            spin: config.spin,
            progress_thread: config.progress_thread,
            ..EndpointConfig::default()
        };
        let tcp_lanes = TcpConfig::default().stripe_min.is_some();
        #[cfg(feature = "cuda-uma")]
        let mut device_pool = None;
        let wire = match kind {
            Kind::Tcp => {
                let pool = zerohop_std::private_pool(config.pool_bytes)
                    .map_err(|e| setup(format!("the receive pool: {e}")))?;
                let t = TcpTransport::new(pool, tcp_config(&config, max_message), kind)
                    .map_err(|e| setup(format!("the tcp wire: {e}")))?;
                Wire::Tcp(Driven::new(t, driven).map_err(|e| setup(e.to_string()))?)
            }
            // `uma` is `shm`'s wire over managed memory: peers on this host
            // move to lanes as well, their messages landing in the same pool.
            Kind::Shm | Kind::Uma => {
                let pool = match kind {
                    #[cfg(feature = "cuda-uma")]
                    Kind::Uma => zerohop_std::managed_pool(config.pool_bytes),
                    _ => zerohop_std::shared_pool(config.pool_bytes),
                }
                .map_err(|e| setup(format!("the receive pool: {e}")))?;
                // An explicit `shm` wants shared memory or nothing.
                let shm = ShmConfig {
                    required: config.transport == zerohop_core::Preference::Only(Kind::Shm),
                    single_copy_from: config.shm_single_copy_from,
                    ..ShmConfig::default()
                };
                let tcp = tcp_config(&config, max_message);
                match LocalWire::new(std::sync::Arc::clone(&pool), tcp, shm, kind) {
                    #[allow(unused_mut)]
                    Ok(mut t) => {
                        // A GPU here: same-host peers exchange device messages too.
                        #[cfg(feature = "cuda-uma")]
                        if zerohop_backends::cuda::driver_present() {
                            match zerohop_backends::cuda::Gpu::open(0)
                                .map_err(zerohop_core::Error::from)
                                .and_then(|gpu| {
                                    zerohop_backends::cuda::device_pool(&gpu, config.pool_bytes)
                                }) {
                                Ok(p) => {
                                    t.carry_device(std::sync::Arc::clone(&p));
                                    device_pool = Some(p);
                                }
                                Err(e) => log::info!(
                                    "zerohop: same-host lanes carry no device messages: {e}"
                                ),
                            }
                        }
                        Wire::Local(Driven::new(t, driven).map_err(|e| setup(e.to_string()))?)
                    }
                    // `uma` without lanes is still `uma`: TCP into managed memory.
                    Err(e) if kind == Kind::Uma => {
                        log::info!("zerohop: uma without same-host lanes: {e}");
                        let t = TcpTransport::new(pool, tcp, kind)
                            .map_err(|e| setup(format!("the tcp wire: {e}")))?;
                        Wire::Tcp(Driven::new(t, driven).map_err(|e| setup(e.to_string()))?)
                    }
                    Err(e) => return Err(setup(e.to_string())),
                }
            }
            #[cfg(feature = "gpudirect-verbs")]
            Kind::Rdma => {
                use zerohop_backends::verbs::{Device, RdmaTransport};
                let device = Device::open().map_err(|e| setup(e.to_string()))?;
                let t = RdmaTransport::new(device, rdma_config(&config, max_message))
                    .map_err(|e| setup(e.to_string()))?;
                Wire::Rdma(Driven::new(t, driven).map_err(|e| setup(e.to_string()))?)
            }
            #[cfg(all(feature = "gpudirect-verbs", feature = "cuda-uma"))]
            Kind::Gpudirect => {
                use zerohop_backends::verbs::{Device, GpuPayload, RdmaTransport};
                let gpu = zerohop_backends::cuda::Gpu::open(0).map_err(|e| setup(e.to_string()))?;
                let device = Device::open().map_err(|e| setup(e.to_string()))?;
                let t = RdmaTransport::with_memory(
                    device,
                    rdma_config(&config, max_message),
                    GpuPayload::new(gpu),
                )
                .map_err(|e| setup(e.to_string()))?;
                Wire::Gpu(Driven::new(t, driven).map_err(|e| setup(e.to_string()))?)
            }
            _ => {
                return Err(setup(
                    "this build has no endpoint for it (mock is the in-memory \
                     test link: it has no addresses; build it from zerohop-backends)"
                        .into(),
                ))
            }
        };
        // The wire announces no more than its receive pool holds.
        let held = each_wire!(&wire, e => e.with(|t| t.max_message()));
        if config.max_message.is_some_and(|m| m > held) {
            return Err(Error::BadConfig(format!(
                "max_message ({max_message} bytes) does not fit the receive pool \
                 (pool_bytes {}: it holds messages of at most {held} bytes)",
                config.pool_bytes
            )));
        }
        Ok(Endpoint {
            wire,
            choice,
            config,
            max_message: held,
            tcp_lanes,
            book: Mutex::new(HashMap::new()),
            #[cfg(feature = "cuda-uma")]
            device_pool,
        })
    }

    /// The transport it runs.
    pub fn kind(&self) -> Kind {
        self.choice.kind
    }

    /// How the transport was chosen: the preference, and why each faster
    /// one was skipped (see [`Choice::skipped`]).
    pub fn choice(&self) -> &Choice {
        &self.choice
    }

    /// What the transport can do (the Go package's `Caps`).
    pub fn caps(&self) -> Capabilities {
        each_wire!(&self.wire, e => e.with(|t| zerohop_core::Transport::caps(t)))
    }

    /// The configuration it was opened with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The longest message this endpoint takes (what it tells its peers).
    pub fn max_message(&self) -> usize {
        self.max_message
    }

    /// Listens on `addr` (a host name or an IP address with a port; port 0
    /// lets the system pick) and returns the address bound. Peers that
    /// connect are reported as [`Event::Connected`]. Over RDMA the address
    /// must belong to the RDMA device's network interface.
    pub fn listen(&self, addr: impl ToSocketAddrs + fmt::Display) -> Result<SocketAddr> {
        let addrs = resolve(&addr, "listen on")?;
        if each_wire!(&self.wire, e => e.with(|t| t.is_closed())) {
            return Err(Error::Endpoint(zerohop_core::Error::Closed));
        }
        let mut why = String::new();
        for a in addrs {
            let bound = each_wire!(&self.wire, e => e.with(|t| t.listen_at(a)));
            match bound {
                Ok(b) => return Ok(b),
                Err(e) => why = e,
            }
        }
        Err(Error::Address {
            op: "listen on",
            addr: addr.to_string(),
            why,
        })
    }

    /// Where it listens, if it does.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        each_wire!(&self.wire, e => e.with(|t| t.listening()))
    }

    /// Connects to a listening endpoint at `addr` (a host name or an IP
    /// address with a port), waiting up to `timeout` for the connection and
    /// the peer's answer; each address of a name is tried in turn. Failing,
    /// [`Error::Connect`] says for each address why ([`ConnectError`]: no
    /// connection, no answer, refused at the listener's peer limits, another
    /// protocol version, not zerohop); a name that does not resolve is
    /// [`Error::Address`]. Other peers are served meanwhile. The peer's
    /// first messages can reach another thread's `recv` or `events` just
    /// before this call returns its [`Peer`] (and, for that moment,
    /// [`peer_addr`](Self::peer_addr) of it is `None`).
    pub fn connect(
        &self,
        addr: impl ToSocketAddrs + fmt::Display,
        timeout: Duration,
    ) -> Result<Peer> {
        let addrs = resolve(&addr, "connect to")?;
        let until = Instant::now().checked_add(timeout);
        let mut tried = Vec::new();
        for a in addrs {
            let left = until.map_or(timeout, |u| u.saturating_duration_since(Instant::now()));
            if left.is_zero() {
                // The time went to the addresses before it.
                let late = std::io::Error::from(std::io::ErrorKind::TimedOut);
                tried.push((a, ConnectError::Unreachable(late)));
                continue;
            }
            match self.connect_one(a, left) {
                Ok(peer) => return Ok(Peer(peer)),
                Err(e) => tried.push((a, e)),
            }
        }
        Err(Error::Connect {
            addr: addr.to_string(),
            tried,
        })
    }

    fn connect_one(&self, addr: SocketAddr, timeout: Duration) -> Result<PeerId, ConnectError> {
        // The timeout covers the whole connect: the dial, then the Hello.
        let deadline = Deadline::after(timeout).started();
        // In the book before any news of the peer's end can be taken.
        let known = |peer| {
            self.book().insert(peer, Entry { addr, errors: 0 });
        };
        let other = |e: std::io::Error| ConnectError::Other(Box::new(e));
        // Each wire dials without its transport's lock (a host slow to
        // answer holds up no other peer), then attaches and waits.
        match &self.wire {
            Wire::Tcp(e) => {
                let dialed = TcpTransport::dial(addr, timeout, self.tcp_lanes)
                    .map_err(ConnectError::Unreachable)?;
                let peer = e.attach(|t| t.attach(dialed)).map_err(other)?;
                answered(e, peer, deadline, TcpTransport::disconnect, known)
            }
            Wire::Local(e) => {
                let dialed = TcpTransport::dial(addr, timeout, self.tcp_lanes)
                    .map_err(ConnectError::Unreachable)?;
                let peer = e.attach(|t| t.attach(dialed)).map_err(other)?;
                // The id it ends up with: a lane's, for a peer on this host.
                answered(e, peer, deadline, LocalWire::disconnect, known)
            }
            #[cfg(feature = "gpudirect-verbs")]
            Wire::Rdma(e) => {
                let dialed = e.with(|t| t.dialer()).dial(addr, timeout)?;
                let peer = e.attach(|t| t.attach(dialed))?;
                answered(e, peer, deadline, RdmaTransport::disconnect, known)
            }
            #[cfg(all(feature = "gpudirect-verbs", feature = "cuda-uma"))]
            Wire::Gpu(e) => {
                let dialed = e.with(|t| t.dialer()).dial(addr, timeout)?;
                let peer = e.attach(|t| t.attach(dialed))?;
                answered(e, peer, deadline, RdmaTransport::disconnect, known)
            }
        }
    }

    /// Sends a copy of `bytes` to `peer`, waiting for room (the peer's
    /// credit, a socket that drains) up to the configured `send_timeout`.
    pub fn send(&self, peer: Peer, bytes: &[u8]) -> Result<()> {
        self.send_timeout(peer, bytes, self.config.send_timeout)
    }

    /// As [`send`](Self::send), waiting at most `timeout`.
    pub fn send_timeout(&self, peer: Peer, bytes: &[u8], timeout: Duration) -> Result<()> {
        let deadline = Deadline::after(timeout);
        each_wire!(&self.wire, e => e.send(peer.0, bytes, deadline, None))
            .map_err(|error| self.about(peer, error))
    }

    /// Sends a copy of `bytes` if the wire has room now: `Ok(false)` where
    /// it has none (not an error: not counted against the peer).
    #[cfg(feature = "tokio")]
    pub(crate) fn send_now(&self, peer: Peer, bytes: &[u8]) -> Result<bool> {
        let deadline = Deadline::after(Duration::ZERO);
        match each_wire!(&self.wire, e => e.send(peer.0, bytes, deadline, None)) {
            Ok(()) => Ok(true),
            Err(zerohop_core::Error::Timeout) => Ok(false),
            Err(error) => Err(self.about(peer, error)),
        }
    }

    /// A buffer of `len` bytes to fill in place and send without a copy
    /// (from the wire's send pool: registered with the NIC where there is one).
    /// A dry pool is an error at once: see [`lease_timeout`](Self::lease_timeout).
    pub fn lease(&self, len: usize) -> Result<SendBuffer> {
        each_wire!(&self.wire, e => e.lease(len).map(LeaseBuf::into_buf))
            .map(|buf| SendBuffer { buf })
            .map_err(Error::Endpoint)
    }

    /// As [`lease`](Self::lease), waiting up to `timeout` while the pool is
    /// dry and moving the wire meanwhile: a zero-copy sender that outruns
    /// the wire holds the pool's buffers in its queue until they go out (on
    /// `tcp` and `shm` the pool is also where received messages wait, so
    /// dropping those gives buffers back too). Then the pool's error; a
    /// length beyond the pool's whole budget fails at once.
    pub fn lease_timeout(&self, len: usize, timeout: Duration) -> Result<SendBuffer> {
        let mut deadline = Deadline::after(timeout);
        each_wire!(&self.wire, e => e.lease_by(len, &mut deadline, None).map(LeaseBuf::into_buf))
            .map(|buf| SendBuffer { buf })
            .map_err(Error::Endpoint)
    }

    /// A buffer of `len` bytes in GPU device memory, to fill from a kernel
    /// (through its `device_ptr()`) and send with
    /// [`send_buffer`](Self::send_buffer): over `gpudirect` the wire's
    /// registered GPU memory; over `shm` and `uma`, a device pool whose messages reach
    /// same-host peers by CUDA IPC (device to device, no host copy) and
    /// land in their device memory. Elsewhere [`Error::BadConfig`]. A buffer
    /// filled by a kernel must be complete (its stream synchronized) before
    /// `send_buffer`: the peer copies it on a stream of its own;
    /// [`copy_in`](Self::copy_in) waits by itself.
    #[cfg(feature = "cuda-uma")]
    pub fn lease_device(&self, len: usize) -> Result<SendBuffer> {
        #[cfg(feature = "gpudirect-verbs")]
        if let Wire::Gpu(_) = &self.wire {
            return self.lease(len);
        }
        let Some(pool) = &self.device_pool else {
            return Err(Error::BadConfig(format!(
                "lease_device: the {} endpoint has no device memory (device messages go \
                 over shm between processes of one host with a GPU, or over gpudirect)",
                self.kind().name()
            )));
        };
        zerohop_core::Lease::take(std::sync::Arc::clone(pool), len)
            .map(|l| SendBuffer {
                buf: Buf::Device(l),
            })
            .map_err(Error::Endpoint)
    }

    /// Sends a buffer from [`lease`](Self::lease) (or a received
    /// [`Message::into_buffer`]) as it is, waiting up to `send_timeout`.
    pub fn send_buffer(&self, peer: Peer, buffer: SendBuffer) -> Result<()> {
        let deadline = Deadline::after(self.config.send_timeout);
        let r = each_wire!(&self.wire, e => match LeaseBuf::from_buf(buffer.buf) {
            Some(lease) => e.send_lease(peer.0, lease, deadline, None),
            None => return Err(Error::BadConfig(
                "send_buffer: a buffer of another endpoint's memory".into(),
            )),
        });
        r.map_err(|error| self.about(peer, error))
    }

    /// The next message from any peer, waiting up to `timeout`
    /// (`Duration::MAX`: for ever). A peer that connects is noted (see
    /// [`peers`](Self::peers)); one that closes or is lost comes back as an
    /// [`Error::Peer`] naming it, and the endpoint serves the others.
    pub fn recv(&self, timeout: Duration) -> Result<Message> {
        // One clock for every wait of the call (started at the first).
        let mut deadline = Deadline::after(timeout);
        loop {
            match self.event_by(&mut deadline)? {
                Event::Message(m) => return Ok(m),
                Event::Connected { .. } => {}
                Event::Closed { peer, addr } => {
                    return Err(Error::Peer {
                        peer,
                        addr,
                        error: zerohop_core::Error::PeerClosed(peer.0),
                    })
                }
                Event::Lost { why, .. } => return Err(why),
            }
        }
    }

    /// The next event (a peer connected, a message, a peer closed or
    /// lost), waiting up to `timeout`.
    pub fn next_event(&self, timeout: Duration) -> Result<Event> {
        self.event_by(&mut Deadline::after(timeout))
    }

    /// Every event as it comes, blocking between them; the iterator ends
    /// once the endpoint is closed and its peers are gone.
    pub fn events(&self) -> Events<'_> {
        Events {
            endpoint: self,
            done: false,
        }
    }

    fn event_by(&self, deadline: &mut Deadline) -> Result<Event> {
        // The address book changes with the transport locked: in the order
        // the wire tells of peers, whichever threads take the events.
        each_wire!(&self.wire, e => e.next_event_with(deadline, None, |ev| self.event(ev)))
            .map_err(Error::Endpoint)
    }

    fn event<L: LeaseBuf>(&self, ev: zerohop_std::Event<L>) -> Event {
        use zerohop_std::Event as E;
        match ev {
            E::Message(r) => Event::Message(Message {
                peer: Peer(r.peer),
                buf: r.lease.into_buf(),
            }),
            E::Accepted { peer, addr } => {
                self.book().insert(peer, Entry { addr, errors: 0 });
                Event::Connected {
                    peer: Peer(peer),
                    addr,
                }
            }
            E::Closed(peer) => Event::Closed {
                peer: Peer(peer),
                addr: self.book().remove(&peer).map(|e| e.addr),
            },
            E::Lost { peer, error } => {
                let addr = self.book().remove(&peer).map(|e| e.addr);
                Event::Lost {
                    peer: Peer(peer),
                    addr,
                    why: Error::Peer {
                        peer: Peer(peer),
                        addr,
                        error,
                    },
                }
            }
        }
    }

    /// A failed call about `peer`, as the facade's error (counted against it).
    fn about(&self, peer: Peer, error: zerohop_core::Error) -> Error {
        use zerohop_core::Error as E;
        let addr = {
            let mut book = self.book();
            book.get_mut(&peer.0).map(|e| {
                e.errors += 1;
                e.addr
            })
        };
        match error {
            E::TooLarge { len, max } => Error::TooLarge { len, max, addr },
            E::Timeout | E::Closed | E::Cancelled | E::Pool(_) | E::WouldBlock => {
                Error::Endpoint(error)
            }
            error => Error::Peer { peer, addr, error },
        }
    }

    fn book(&self) -> MutexGuard<'_, HashMap<PeerId, Entry>> {
        // One insert or remove at a time: a panic cannot leave it half-changed.
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The connected peers and their addresses.
    pub fn peers(&self) -> Vec<(Peer, SocketAddr)> {
        let mut v: Vec<_> = self
            .book()
            .iter()
            .map(|(p, e)| (Peer(*p), e.addr))
            .collect();
        v.sort();
        v
    }

    /// A connected peer's address.
    pub fn peer_addr(&self, peer: Peer) -> Option<SocketAddr> {
        self.book().get(&peer.0).map(|e| e.addr)
    }

    /// A connected peer's counters.
    pub fn stats(&self, peer: Peer) -> Option<PeerStats> {
        let s = each_wire!(&self.wire, e => e.peer_stats(peer.0))?;
        let book = self.book();
        let entry = book.get(&peer.0)?;
        Some(PeerStats {
            addr: entry.addr,
            messages_sent: s.messages_sent,
            bytes_sent: s.bytes_sent,
            messages_received: s.messages_received,
            bytes_received: s.bytes_received,
            credit_stalls: s.credit_stalls,
            errors: entry.errors,
        })
    }

    /// Copies the start of `message` into `out`, wherever the message lies
    /// (the way to read GPU memory from the host).
    pub fn copy_out(&self, message: &Message, out: &mut [u8]) -> Result<()> {
        if let Some(bytes) = message.bytes() {
            let src =
                bytes
                    .get(..out.len())
                    .ok_or(Error::Endpoint(zerohop_core::Error::TooLarge {
                        len: out.len(),
                        max: bytes.len(),
                    }))?;
            out.copy_from_slice(src);
            return Ok(());
        }
        #[cfg(all(feature = "gpudirect-verbs", feature = "cuda-uma"))]
        if let (Wire::Gpu(e), Buf::Gpu(l)) = (&self.wire, &message.buf) {
            return e.read(l, out).map_err(Error::Endpoint);
        }
        #[cfg(feature = "cuda-uma")]
        if let Buf::Device(l) = &message.buf {
            return zerohop_backends::cuda::read_lease(l, out).map_err(Error::Endpoint);
        }
        Err(Error::BadConfig(
            "copy_out: a message of another endpoint's memory".into(),
        ))
    }

    /// Copies `src` into the start of `buffer`, wherever it lies (the way
    /// to fill GPU memory from the host), and waits until the bytes are
    /// there; the message keeps its length.
    pub fn copy_in(&self, buffer: &mut SendBuffer, src: &[u8]) -> Result<()> {
        if src.len() > buffer.len() {
            return Err(Error::Endpoint(zerohop_core::Error::TooLarge {
                len: src.len(),
                max: buffer.len(),
            }));
        }
        if let Some(bytes) = buffer.bytes_mut() {
            bytes[..src.len()].copy_from_slice(src);
            return Ok(());
        }
        #[cfg(feature = "cuda-uma")]
        if let Buf::Device(l) = &buffer.buf {
            return zerohop_backends::cuda::write_lease(l, src).map_err(Error::Endpoint);
        }
        Err(Error::BadConfig(
            "copy_in: a buffer whose memory this endpoint cannot write".into(),
        ))
    }

    /// Bytes of the device pool leased now (device messages sent and not
    /// yet copied by their peer, messages received and held, buffers being
    /// filled); `None` without a device pool (see [`lease_device`](Self::lease_device)).
    #[cfg(feature = "cuda-uma")]
    pub fn device_bytes_leased(&self) -> Option<usize> {
        self.device_pool.as_ref().map(|p| p.used_bytes())
    }

    /// Moves the wire along in the caller's thread (accepts, handshakes,
    /// queued sends, reads): for an endpoint opened without a progress
    /// thread, when the application has nothing else to call. Whether
    /// anything happened.
    pub fn progress(&self) -> Result<bool> {
        each_wire!(&self.wire, e => e.progress()).map_err(Error::Endpoint)
    }

    /// Waits until every accepted send is with the OS (TCP) or completed (RDMA).
    pub fn flush(&self, timeout: Duration) -> Result<()> {
        each_wire!(&self.wire, e => e.flush(Deadline::after(timeout))).map_err(Error::Endpoint)
    }

    /// Closes: no new sends or peers, a clean Close to every peer after what
    /// was sent to it, then waits up to `timeout` for what is queued to go
    /// and for every peer's answering Close (so none is left with a reset
    /// connection when this process exits). Messages and events that came
    /// meanwhile can still be read; [`events`](Self::events) ends after
    /// them. `Timeout`: queued messages were not all delivered, or a peer
    /// did not answer.
    pub fn close(&self, timeout: Duration) -> Result<()> {
        each_wire!(&self.wire, e => e.shutdown(Deadline::after(timeout))).map_err(Error::Endpoint)
    }
}

/// Listening, the same way on every wire.
trait ListenAt {
    fn listen_at(&mut self, a: SocketAddr) -> std::result::Result<SocketAddr, String>;
    fn listening(&self) -> Option<SocketAddr>;
}

impl ListenAt for LocalWire {
    fn listen_at(&mut self, a: SocketAddr) -> std::result::Result<SocketAddr, String> {
        self.listen(a).map_err(|e| e.to_string())
    }
    fn listening(&self) -> Option<SocketAddr> {
        self.local_addr()
    }
}

impl ListenAt for TcpTransport {
    fn listen_at(&mut self, a: SocketAddr) -> std::result::Result<SocketAddr, String> {
        self.listen(a).map_err(|e| e.to_string())
    }
    fn listening(&self) -> Option<SocketAddr> {
        self.local_addr()
    }
}

#[cfg(feature = "gpudirect-verbs")]
impl<M: zerohop_backends::verbs::PayloadMemory> ListenAt
    for zerohop_backends::verbs::RdmaTransport<M>
{
    fn listen_at(&mut self, a: SocketAddr) -> std::result::Result<SocketAddr, String> {
        self.listen(a).map_err(|e| e.to_string())?;
        Ok(self.local_addr().unwrap_or(a))
    }
    fn listening(&self) -> Option<SocketAddr> {
        self.local_addr()
    }
}

/// The TCP wire's settings from the endpoint's.
fn tcp_config(config: &Config, max_message: usize) -> TcpConfig {
    TcpConfig {
        max_message,
        idle_timeout: config.idle_timeout,
        min_rate: config.min_rate,
        peer_limits: config.peer_limits,
        ..TcpConfig::default()
    }
}

#[cfg(feature = "gpudirect-verbs")]
fn rdma_config(config: &Config, max_message: usize) -> zerohop_backends::verbs::RdmaConfig {
    zerohop_backends::verbs::RdmaConfig {
        max_message,
        recv_pool_bytes: config.pool_bytes,
        send_pool_bytes: config.pool_bytes.min(1 << 30),
        idle_timeout: config.idle_timeout,
        min_rate: config.min_rate,
        peer_limits: config.peer_limits,
        ..zerohop_backends::verbs::RdmaConfig::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn an_endpoint_can_be_shared_between_threads() {
        assert_send_sync::<Endpoint>();
        assert_send_sync::<Message>();
        assert_send_sync::<SendBuffer>();
    }
}
