//! Blocking endpoints over non-blocking transports.
//!
//! The transport sits behind one mutex. A progress thread waits in `poll(2)`
//! on the transport's sockets (and a wake pipe), then drives `progress()`
//! (accept, flush queued sends, read into the arrival queue) and wakes
//! waiters through a condvar. Application threads call the transport
//! directly: `send` writes to the socket itself when nothing is queued, and
//! `recv` polls `try_recv` for a short spin before sleeping, so a message
//! that arrives while a receiver is waiting costs no thread hand-off. A
//! spinning call keeps the transport locked between its polls while no
//! other thread waits for it (polling back to back, as perftest and UCX
//! do), and lets a waiting thread in between two polls. The
//! progress thread reads (or reaps completions) only for an application
//! that has stopped calling: one that keeps polling is never raced for its
//! own messages (UCX's rule: whoever polls, progresses). Zero-copy buffers
//! are leased from the wire's pool without the transport lock (the pool
//! has its own), so taking one never waits for a spinning receiver.
//! Why a mutex + condvar and not channels: the transport must be driven from
//! both sides (the caller's fast path and the progress thread), and a
//! channel would force every message through a hand-off.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use zerohop_backends::HostBell;
use zerohop_core::session::SessionStats;
use zerohop_core::{Error, PeerId, PoolError, Received, Transport};

use crate::doorbell::Doorbell;
use crate::sync::{thread, Arc, AtomicBool, AtomicUsize, Condvar, Mutex, MutexGuard, TryLockError};

/// How many polls of a spinning call pass between two reads of the clock.
const CLOCK_EVERY: u32 = 32;

/// Who is about to wait in `poll(2)` on a transport's descriptors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waiter {
    /// The progress thread: connection management and queued sends always;
    /// incoming data (and completions) only for an application that is not
    /// polling, so one arrival wakes one thread.
    Progress {
        /// An application thread is in `recv`, or one has sent or received
        /// since the progress thread last looked: it reads for itself.
        app_polling: bool,
    },
    /// An application thread blocked in `recv` (`reading`) or in `send`.
    App {
        /// Waiting for data (else for room to send).
        reading: bool,
    },
}

impl Waiter {
    /// Whether this waiter reads what arrives when it wakes (an application
    /// thread in `recv`, or the progress thread for one that is not
    /// polling): only it clears a pool's bell, so only it may sleep on one.
    pub fn reads(self) -> bool {
        matches!(
            self,
            Waiter::App { reading: true } | Waiter::Progress { app_polling: false }
        )
    }
}

/// Takes a zero-copy send buffer of the given length: see [`Wire::leaser`].
pub type Leaser<L> = Box<dyn Fn(usize) -> Result<L, Error> + Send + Sync>;

/// The leaser of a wire whose zero-copy buffers all come from one pool
/// (every wire here): each call leases from `pool`.
pub(crate) fn pool_leaser<P>(pool: P) -> Leaser<zerohop_core::Lease<P>>
where
    P: std::ops::Deref<Target: zerohop_core::Pool> + Clone + Send + Sync + 'static,
{
    Box::new(move |len| zerohop_core::Lease::take(pool.clone(), len))
}

/// What an [`Endpoint`] needs of a transport beyond core's trait.
pub trait Wire: Transport<Lease: Send> + Send + 'static {
    /// Whether what arrives on this wire wakes a thread asleep on its
    /// [`poll_fds`](Self::poll_fds). A wire without (the mock link) is
    /// driven by the progress thread's periodic pass instead, which then
    /// wakes its waiters.
    const WAKES_POLL: bool = false;

    /// The descriptors `waiter` should wait on, with the events wanted. A
    /// transport with none (the mock link) is polled on a timer instead.
    fn poll_fds(&self, out: &mut Vec<libc::pollfd>, waiter: Waiter) {
        let _ = (out, waiter);
    }

    /// Where zero-copy sends get their buffers: a lease of `len` bytes from
    /// the pool this wire's sends leave from (registered with the NIC where
    /// there is one), to fill in place and [`Endpoint::send_lease`]. The
    /// endpoint keeps it and leases without the transport lock: a pool has
    /// its own, and a thread taking a buffer must not wait for one that
    /// spins in `recv` holding the transport.
    fn leaser(&self) -> Leaser<Self::Lease>;

    /// A handle on the bell of the pool [`leaser`](Self::leaser) leases
    /// from, where it has one: a thread waiting for a buffer
    /// ([`Endpoint::lease_by`]) sleeps on it, and wakes as one comes back.
    fn lease_bell(&self) -> Option<HostBell> {
        None
    }

    /// Copies the start of a message into `out`: the way to read a message
    /// whose bytes are not host-visible (GPU memory), and small control
    /// messages on any wire.
    fn read_lease(&self, lease: &Self::Lease, out: &mut [u8]) -> Result<(), Error>;

    /// Readies the descriptors `waiter` is about to sleep on (a completion
    /// channel must be armed, and its old events taken, before a sleep that
    /// should end at the next completion). Returns true when something
    /// arrived meanwhile: then the caller looks again instead of sleeping.
    fn prepare_sleep(&mut self, waiter: Waiter) -> bool {
        let _ = waiter;
        false
    }

    /// `waiter`, which [`prepare_sleep`](Self::prepare_sleep) let sleep, is
    /// awake again (called under the transport lock as it wakes). A wire
    /// that told its peers this side sleeps (so they ring it) takes that
    /// back here, and only here: another thread's pass while the sleeper
    /// still sleeps must leave it to be rung.
    fn woke(&mut self, waiter: Waiter) {
        let _ = waiter;
    }

    /// Bytes (or frames) accepted but not yet delivered as far as this wire
    /// can tell: `flush` and `close` wait for none.
    fn pending_sends(&self) -> usize {
        0
    }

    /// Peers still connected, or on their way: a closing endpoint waits
    /// for this to reach 0 (every peer's Close answered, or the peer gone).
    fn peers_left(&self) -> usize {
        0
    }

    /// Whether accepted sends need the progress thread to move (queued behind
    /// a full socket, or waiting for credits): a send rings it only then, so
    /// the common send wakes no other thread. Defaults to `pending_sends() > 0`.
    fn needs_progress(&self) -> bool {
        self.pending_sends() > 0
    }

    /// Starts sending `bytes` for a caller that blocks until they are sent.
    /// `Ok(false)`: the wire took part of the message and leaves the rest in
    /// the caller's slice, to be written by [`continue_send`](Self::continue_send)
    /// with the same bytes, so a large message is never copied. The default
    /// is `try_send`, which copies what it queues.
    fn start_send(&mut self, peer: PeerId, bytes: &[u8]) -> Result<bool, Error> {
        self.try_send(peer, bytes).map(|()| true)
    }

    /// Writes more of a message begun by `start_send`; `Ok(true)` when all is sent.
    fn continue_send(&mut self, peer: PeerId, bytes: &[u8]) -> Result<bool, Error> {
        let _ = (peer, bytes);
        Ok(true)
    }

    /// The caller of an unfinished `start_send` must leave (deadline,
    /// cancellation): the wire copies the rest and finishes the message itself.
    fn abandon_send(&mut self, peer: PeerId, bytes: &[u8]) {
        let _ = (peer, bytes);
    }

    /// The progress thread's work. With `read` false an application thread
    /// is receiving and reads for itself: only accept and flush, so a
    /// message never lands in a queue that thread is not watching.
    fn background_progress(&mut self, read: bool) -> Result<bool, Error> {
        let _ = read;
        self.progress()
    }

    /// The next peer that connected to this wire's listener and said Hello,
    /// with its address (a wire without a listener has none).
    fn take_accepted(&mut self) -> Option<(PeerId, SocketAddr)> {
        None
    }

    /// Whether the Hellos with `peer`, which this side connected to, have
    /// crossed: `Some(Ok(id))` open (`id` is what names the peer from now
    /// on: a wire may move it, as the same-host lane does), `None` not
    /// yet, `Some(Err)` refused or gone. Wires whose connect waits for the
    /// Hello say `Some(Ok(peer))`.
    fn opened(&mut self, peer: PeerId) -> Option<Result<PeerId, Error>> {
        Some(Ok(peer))
    }

    /// A connected peer's address.
    fn peer_addr(&self, peer: PeerId) -> Option<SocketAddr> {
        let _ = peer;
        None
    }

    /// What has crossed to and from a connected peer.
    fn peer_stats(&self, peer: PeerId) -> Option<SessionStats> {
        let _ = peer;
        None
    }
}

/// What waiting on an endpoint gives: a message, or news of a peer.
#[derive(Debug)]
pub enum Event<L> {
    /// A peer connected to this endpoint's listener (its Hello came).
    Accepted {
        /// The peer.
        peer: PeerId,
        /// Where it connected from.
        addr: SocketAddr,
    },
    /// A message.
    Message(Received<L>),
    /// The peer closed cleanly: every message it sent was delivered.
    Closed(PeerId),
    /// The peer went away or broke the protocol; nothing after the fault was delivered.
    Lost {
        /// The peer.
        peer: PeerId,
        /// How: `PeerLost`, `Protocol`, `WireRule`, `NoReceiveBuffer`.
        error: Error,
    },
}

impl<L> Event<L> {
    /// What `try_recv` said, as an event: `None` for "nothing now" (an
    /// empty wire, a dry pool); `Err` for a failure of the whole wire.
    fn from_recv(r: Result<Received<L>, Error>) -> Result<Option<Event<L>>, Error> {
        match r {
            Ok(m) => Ok(Some(Event::Message(m))),
            Err(Error::WouldBlock | Error::Pool(_)) => Ok(None),
            Err(Error::PeerClosed(peer)) => Ok(Some(Event::Closed(peer))),
            Err(error) => match error.lost_peer() {
                Some(peer) => Ok(Some(Event::Lost { peer, error })),
                None => Err(error),
            },
        }
    }
}

/// When a blocking call gives up.
///
/// A deadline [`after`](Deadline::after) a duration starts at the call's
/// first look at the clock: a call that completes at once (a message already
/// there, a send the wire takes) reads no clock at all; one that waits reads
/// it within a few polls. Each call starts its own copy: a caller that makes
/// several calls under one deadline passes it
/// [`started`](Deadline::started), or to a call that keeps it in place
/// ([`Endpoint::next_event_by`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadline(When);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum When {
    Never,
    At(Instant),
    /// This long from the first look at the clock.
    In(Duration),
}

impl Deadline {
    /// Never.
    pub const fn never() -> Self {
        Deadline(When::Never)
    }

    /// `d` from the first time the call looks at the clock (see above).
    pub const fn after(d: Duration) -> Self {
        Deadline(When::In(d))
    }

    /// At `t`.
    pub const fn at(t: Instant) -> Self {
        Deadline(When::At(t))
    }

    /// The same deadline, started now if it was not yet: for a caller that
    /// makes several calls under one deadline.
    pub fn started(mut self) -> Self {
        self.fix(Instant::now());
        self
    }

    /// The instant it passes (started at `now` if it was not yet).
    fn fix(&mut self, now: Instant) -> Option<Instant> {
        if let When::In(d) = self.0 {
            self.0 = now.checked_add(d).map_or(When::Never, When::At);
        }
        match self.0 {
            When::At(t) => Some(t),
            _ => None,
        }
    }

    fn remaining(&mut self) -> Option<Duration> {
        let now = Instant::now();
        self.fix(now).map(|t| t.saturating_duration_since(now))
    }

    fn passed(&mut self) -> bool {
        self.remaining() == Some(Duration::ZERO)
    }

    /// Whether passed at `now` (a clock read the caller already has).
    fn passed_at(&mut self, now: Instant) -> bool {
        self.fix(now).is_some_and(|t| now >= t)
    }
}

/// A sender's wait: busy tries for `spin` from its first, then a sleep
/// each try. The clock is read at the first try (a send that cannot wait
/// gives up at once) and then once in [`CLOCK_EVERY`] while spinning, at
/// every try once asleep.
struct Spin {
    spin: Duration,
    until: Option<Instant>,
    tries: u32,
    spinning: bool,
}

impl Spin {
    fn new(spin: Duration) -> Self {
        Spin {
            spin,
            until: None,
            tries: 0,
            spinning: !spin.is_zero(),
        }
    }

    /// The time, on the tries that read it.
    fn clock(&mut self) -> Option<Instant> {
        self.tries = self.tries.wrapping_add(1);
        (!self.spinning || self.tries % CLOCK_EVERY == 1).then(Instant::now)
    }

    /// Whether this try spins (else it sleeps), given what it read.
    fn on(&mut self, now: Option<Instant>) -> bool {
        if let Some(now) = now {
            if now >= *self.until.get_or_insert(now + self.spin) {
                self.spinning = false;
            }
        }
        self.spinning
    }
}

/// Whether a pool that said `e` to a lease of `len` may have one later
/// (its leases come back); not when `len` is beyond its whole budget.
fn comes_back(e: PoolError, len: usize) -> bool {
    match e {
        PoolError::Exhausted { cap, .. } => len <= cap,
        PoolError::TooManyBuffers { .. } | PoolError::TooManyChunks { .. } => true,
        _ => false,
    }
}

/// Cancels blocking calls from another thread (Go's `context` in miniature).
/// Waiting calls notice within [`EndpointConfig::poll_interval`].
#[derive(Clone, Debug, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    /// A fresh, uncancelled token.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancels every call using this token, now and later.
    pub fn cancel(&self) {
        // Release: pairs with the Acquire load, so whatever the canceller did
        // before is visible to the call that observes the cancellation.
        self.0.store(true, Ordering::Release);
    }

    /// Whether cancelled.
    pub fn is_cancelled(&self) -> bool {
        // Acquire: pairs with `cancel`'s Release store.
        self.0.load(Ordering::Acquire)
    }
}

/// Endpoint tuning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndpointConfig {
    /// How long `recv` polls the transport before sleeping (default 50 µs).
    pub spin: Duration,
    /// Longest single sleep of a waiting call or of the progress thread
    /// (default 5 ms): bounds how late a cancellation is seen. A receive
    /// or a [`lease_by`](Endpoint::lease_by) waiting for a buffer wakes as
    /// one comes back (its pool's bell; host pools have one).
    pub poll_interval: Duration,
    /// Run a progress thread beside the application (default on): it
    /// accepts, finishes handshakes and queued sends, and reads for an
    /// application that is not calling. Off, the application's own calls
    /// (`recv`, `send`, `flush`, [`Endpoint::progress`]) do all of it in its
    /// thread, as UCX's `ucp_worker_progress` does: no second busy thread,
    /// which on a small host is the difference (two processes, two cores).
    pub progress_thread: bool,
}

impl Default for EndpointConfig {
    fn default() -> Self {
        EndpointConfig {
            spin: Duration::from_micros(50),
            poll_interval: Duration::from_millis(5),
            progress_thread: true,
        }
    }
}

struct Shared<T: Wire> {
    transport: Mutex<T>,
    /// The wire's [`Wire::leaser`], outside the transport lock.
    leaser: Leaser<T::Lease>,
    /// The wire's [`Wire::lease_bell`].
    lease_bell: Option<HostBell>,
    progressed: Condvar,
    stop: AtomicBool,
    /// Application threads in `recv` (spinning or asleep in poll(2)).
    /// Changed under the transport mutex only.
    app_reading: AtomicUsize,
    /// Sends and receives called so far (wrapping): the progress thread
    /// tells an application that keeps polling from one that stopped.
    /// Changed under the transport mutex only.
    app_calls: AtomicUsize,
    /// Threads waiting for the transport mutex (or asleep on `progressed`,
    /// which takes it on waking): a spinning call lets them in.
    contended: AtomicUsize,
    /// Passes the progress thread made with the transport locked.
    passes: AtomicUsize,
    doorbell: Doorbell,
    config: EndpointConfig,
    /// What `try_recv` gave in the pass that also accepted a peer (its first
    /// message, or its end): held for the next look, so `next_event` reports
    /// the peer before anything from it. Taken with the transport locked.
    early: Mutex<Option<Result<Received<T::Lease>, Error>>>,
    /// Whether `early` holds one: every look asks, and a load is cheaper
    /// than the two locked instructions of taking `early`'s lock.
    /// Changed under the transport mutex only.
    early_held: AtomicBool,
    /// Peers a connect attached and waits for (see [`Endpoint::attach`]),
    /// each with its end once one came: kept for that connect's
    /// `wait_open`, not handed to another thread's look. Changed with the
    /// transport locked.
    claimed: Mutex<Vec<(PeerId, Option<Error>)>>,
    /// Whether `claimed` lists any: a look that finds an end asks.
    any_claimed: AtomicBool,
}

impl<T: Wire> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, T> {
        // A panic inside a transport call leaves it in a state its own methods
        // handle (peers drop, queues stay consistent per operation): carry on.
        match self.transport.try_lock() {
            Ok(t) => return t,
            Err(TryLockError::Poisoned(e)) => return e.into_inner(),
            Err(TryLockError::WouldBlock) => {}
        }
        // Relaxed: a hint to spinning calls (see `relax`); the mutex orders the rest.
        self.contended.fetch_add(1, Ordering::Relaxed);
        let t = self.transport.lock().unwrap_or_else(|e| e.into_inner());
        self.contended.fetch_sub(1, Ordering::Relaxed);
        t
    }

    /// Between two polls of a spinning call: keeps the transport locked,
    /// unless another thread waits for it; then lets go for a moment. A
    /// release and re-lock per poll (with a `pause` between, to give a
    /// waiter its chance) made each poll slower for nothing when no one
    /// waits, which is the common case: an application's one receiving
    /// thread, the progress thread asleep while it polls.
    fn relax<'a>(&'a self, t: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        // Relaxed: a hint; a waiter seen a poll late costs one poll's time.
        if self.contended.load(Ordering::Relaxed) == 0 {
            return t;
        }
        drop(t);
        std::hint::spin_loop();
        self.lock()
    }

    /// Adds `delta` to `app_calls` or `app_reading`, which change under the
    /// transport mutex only (`_locked` proves it held): a load and a store,
    /// where an atomic add would be a locked instruction on every call.
    fn adjust(counter: &AtomicUsize, delta: isize, _locked: &MutexGuard<'_, T>) {
        // Relaxed: the mutex orders the writers; the progress thread reads
        // them as hints (see `progress_loop`).
        let n = counter.load(Ordering::Relaxed);
        counter.store(n.wrapping_add_signed(delta), Ordering::Relaxed);
    }

    fn wake_progress(&self) {
        self.doorbell.ring();
    }
}

/// A transport with blocking calls, deadlines, cancellation and a progress thread.
pub struct Endpoint<T: Wire> {
    shared: Arc<Shared<T>>,
    thread: Option<thread::JoinHandle<()>>,
    /// `close` ran: dropping says nothing of undelivered sends.
    closed: bool,
}

impl<T: Wire> std::fmt::Debug for Endpoint<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl<T: Wire> Endpoint<T> {
    /// Wraps `transport` and starts its progress thread, if the
    /// configuration asks for one.
    pub fn new(transport: T, config: EndpointConfig) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            leaser: transport.leaser(),
            lease_bell: transport.lease_bell(),
            transport: Mutex::new(transport),
            progressed: Condvar::new(),
            stop: AtomicBool::new(false),
            app_reading: AtomicUsize::new(0),
            app_calls: AtomicUsize::new(0),
            contended: AtomicUsize::new(0),
            passes: AtomicUsize::new(0),
            doorbell: Doorbell::new()?,
            config,
            early: Mutex::new(None),
            early_held: AtomicBool::new(false),
            claimed: Mutex::new(Vec::new()),
            any_claimed: AtomicBool::new(false),
        });
        let thread = match config.progress_thread {
            true => {
                let s = Arc::clone(&shared);
                let t = thread::Builder::new()
                    .name("zerohop-progress".into())
                    .spawn(move || progress_loop(&s))?;
                Some(t)
            }
            false => None,
        };
        Ok(Endpoint {
            shared,
            thread,
            closed: false,
        })
    }

    /// Moves the transport along in the caller's thread: accepts, handshakes,
    /// queued sends, reads. What a progress thread does; an application
    /// without one (see [`EndpointConfig::progress_thread`]) that is not
    /// inside `recv` calls it now and then. Returns whether anything happened.
    pub fn progress(&self) -> Result<bool, Error> {
        self.shared.lock().progress()
    }

    /// A buffer for a zero-copy send: see [`Wire::leaser`]. Takes no
    /// transport lock.
    pub fn lease(&self, len: usize) -> Result<T::Lease, Error> {
        (self.shared.leaser)(len)
    }

    /// As [`lease`](Self::lease), waiting while the pool is dry: its buffers
    /// come back as queued zero-copy sends go out, which this call moves
    /// along (a sender of many small leases outruns the wire and holds every
    /// buffer descriptor of the pool in its queue), and as the application
    /// drops what it received (on wires that send from their receive pool).
    /// At the deadline, the pool's error; at once, a length beyond the
    /// pool's whole budget.
    pub fn lease_by(
        &self,
        len: usize,
        deadline: &mut Deadline,
        cancel: Option<&CancelToken>,
    ) -> Result<T::Lease, Error> {
        let mut last = match (self.shared.leaser)(len) {
            Err(Error::Pool(e)) if comes_back(e, len) => e,
            other => return other,
        };
        let mut got = None;
        let bell = self.shared.lease_bell.as_ref();
        let r = self.send_with(deadline, cancel, bell, |_| {
            match (self.shared.leaser)(len) {
                Ok(l) => {
                    got = Some(l);
                    Ok(())
                }
                Err(Error::Pool(e)) if comes_back(e, len) => {
                    last = e;
                    Err(Error::WouldBlock)
                }
                Err(e) => Err(e),
            }
        });
        if got.is_some() {
            // This call may have cleared a ring another waiter on the pool
            // (a receive stopped for a buffer) slept through: passed on.
            if let Some(b) = bell {
                zerohop_core::Bell::ring(b);
            }
        }
        match r {
            Ok(_) => got.ok_or(Error::Pool(last)),
            Err(Error::Timeout) => Err(Error::Pool(last)),
            Err(e) => Err(e),
        }
    }

    /// Copies the start of a received message into `out`: see [`Wire::read_lease`].
    pub fn read(&self, lease: &T::Lease, out: &mut [u8]) -> Result<(), Error> {
        self.shared.lock().read_lease(lease, out)
    }

    /// A connected peer's address.
    pub fn peer_addr(&self, peer: PeerId) -> Option<SocketAddr> {
        self.shared.lock().peer_addr(peer)
    }

    /// What has crossed to and from a connected peer.
    pub fn peer_stats(&self, peer: PeerId) -> Option<SessionStats> {
        self.shared.lock().peer_stats(peer)
    }

    /// Runs `f` on the transport (to listen, connect, read counters).
    pub fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        let r = f(&mut self.shared.lock());
        self.shared.wake_progress();
        r
    }

    /// Makes a peer of a connection this thread dialed (`attach`: the
    /// wire's own attach, run with the transport locked), for this
    /// thread's [`wait_open`](Self::wait_open): until that returns, the
    /// peer's end (a refusal, another version, a hang-up) is kept for it,
    /// and no other thread's `recv` or `next_event` takes it instead.
    pub fn attach<E>(&self, attach: impl FnOnce(&mut T) -> Result<PeerId, E>) -> Result<PeerId, E> {
        let mut t = self.shared.lock();
        let peer = attach(&mut t)?;
        self.claims().push((peer, None));
        // Relaxed: the transport mutex orders it (as `early_held`).
        self.shared.any_claimed.store(true, Ordering::Relaxed);
        drop(t);
        self.shared.wake_progress();
        Ok(peer)
    }

    /// `e`, unless it is the end of a peer a connect waits for: then it is
    /// kept for that connect (`_locked`: the transport, which the caller
    /// has locked).
    fn unclaimed(&self, e: Error, _locked: &T) -> Option<Error> {
        // Relaxed: as in `take_early`.
        if !self.shared.any_claimed.load(Ordering::Relaxed) {
            return Some(e);
        }
        let about = e.ended_peer();
        let mut claims = self.claims();
        match claims
            .iter_mut()
            .find(|(p, end)| Some(*p) == about && end.is_none())
        {
            Some((_, end)) => {
                *end = Some(e);
                None
            }
            None => Some(e),
        }
    }

    /// Ends the claim on `peer` (`_locked`: as in `unclaimed`).
    fn unclaim(&self, peer: PeerId, _locked: &T) {
        let mut claims = self.claims();
        claims.retain(|&(p, _)| p != peer);
        // Relaxed: as in `attach`.
        self.shared
            .any_claimed
            .store(!claims.is_empty(), Ordering::Relaxed);
    }

    fn claims(&self) -> MutexGuard<'_, Vec<(PeerId, Option<Error>)>> {
        // Changed an entry at a time: a poisoned list is still consistent.
        self.shared
            .claimed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, T>, mut deadline: Deadline) -> MutexGuard<'a, T> {
        let cap = self.shared.config.poll_interval;
        let d = deadline.remaining().map_or(cap, |r| r.min(cap));
        // Relaxed: as in `Shared::lock`. Counted while asleep too: on waking
        // this thread takes the mutex without a `lock` call.
        self.shared.contended.fetch_add(1, Ordering::Relaxed);
        let t = self
            .shared
            .progressed
            .wait_timeout(guard, d)
            .unwrap_or_else(|e| e.into_inner())
            .0;
        self.shared.contended.fetch_sub(1, Ordering::Relaxed);
        t
    }

    /// Waits until the transport's descriptors are ready (or the deadline or
    /// the poll interval passes), in this thread, as a blocking socket call
    /// would: no hand-off through the progress thread. Transports without
    /// descriptors wait for the progress thread's signal instead.
    fn wait_io<'a>(
        &'a self,
        guard: MutexGuard<'a, T>,
        deadline: Deadline,
        reading: bool,
    ) -> MutexGuard<'a, T> {
        self.wait_io_or(guard, deadline, reading, None)
    }

    /// [`wait_io`](Self::wait_io), also woken by `bell`.
    fn wait_io_or<'a>(
        &'a self,
        mut guard: MutexGuard<'a, T>,
        mut deadline: Deadline,
        reading: bool,
        bell: Option<&HostBell>,
    ) -> MutexGuard<'a, T> {
        let waiter = Waiter::App { reading };
        if guard.prepare_sleep(waiter) {
            // Something to look at before sleeping (it may be another
            // caller's to do, as the rest of its send): let a waiter in.
            return self.shared.relax(guard);
        }
        let mut fds = Vec::new();
        guard.poll_fds(&mut fds, waiter);
        if fds.is_empty() {
            let mut guard = self.wait(guard, deadline);
            guard.woke(waiter);
            return guard;
        }
        fds.extend(bell.and_then(HostBell::fd).map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        }));
        drop(guard);
        let cap = self.shared.config.poll_interval;
        let d = deadline.remaining().map_or(cap, |r| r.min(cap));
        // SAFETY: `fds` is a valid array of pollfd for the call; a descriptor
        // closed meanwhile by another thread only reports POLLNVAL.
        unsafe {
            libc::poll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                d.as_millis().clamp(0, i32::MAX as u128) as i32,
            )
        };
        let mut guard = self.shared.lock();
        guard.woke(waiter);
        guard
    }

    /// Sends `bytes` to `peer`, waiting while its queue is full. A message the
    /// socket takes only in part is finished from `bytes` while this call
    /// waits, as a blocking `write` would, rather than copied. Deadline and
    /// cancellation bound the wait; a message already on the wire when they
    /// strike cannot be withdrawn, so it is finished from a copy and the send
    /// reports success.
    pub fn send(
        &self,
        peer: PeerId,
        bytes: &[u8],
        mut deadline: Deadline,
        cancel: Option<&CancelToken>,
    ) -> Result<(), Error> {
        let mut done = true;
        let mut t = self.send_with(&mut deadline, cancel, None, |t| {
            done = t.start_send(peer, bytes)?;
            Ok(())
        })?;
        // Like `recv`: retry for a short spin before sleeping until the socket
        // has room, since a sleeping thread's wake-up costs more than the
        // receiver needs to make that room.
        let mut spin = Spin::new(self.shared.config.spin);
        while !done {
            if cancel.is_some_and(CancelToken::is_cancelled) {
                t.abandon_send(peer, bytes);
                break;
            }
            let now = spin.clock();
            if now.is_some_and(|now| deadline.passed_at(now)) {
                t.abandon_send(peer, bytes);
                break;
            }
            if spin.on(now) {
                t = self.shared.relax(t);
            } else {
                // With no progress thread, this call is the only one driving
                // the wire while it waits: the connection work (accepts,
                // handshakes, timers, other peers' queues) is done here too,
                // or one peer that stops reading would hold up every other.
                // (A pass that moved anything, room to write included,
                // means looking again at once rather than sleeping.)
                if self.thread.is_some() || t.progress() != Ok(true) {
                    t = self.wait_io(t, deadline, false);
                }
            }
            done = t.continue_send(peer, bytes)?;
        }
        if t.needs_progress() {
            self.shared.wake_progress();
        }
        Ok(())
    }

    /// Sends a pool buffer without copying, waiting while the queue is full.
    /// On failure the lease is dropped (returned to its pool).
    pub fn send_lease(
        &self,
        peer: PeerId,
        lease: T::Lease,
        mut deadline: Deadline,
        cancel: Option<&CancelToken>,
    ) -> Result<(), Error> {
        // The transport hands a refused lease back; keep it for the next attempt.
        let mut lease = Some(lease);
        let t = self.send_with(&mut deadline, cancel, None, |t| {
            let Some(l) = lease.take() else {
                return Err(Error::Closed);
            };
            t.try_send_lease(peer, l).map_err(|r| {
                lease = Some(r.lease);
                r.error
            })
        })?;
        if t.needs_progress() {
            self.shared.wake_progress();
        }
        Ok(())
    }

    /// Retries `attempt` until it is taken, fails for good, the deadline passes
    /// or `cancel` fires; between attempts, flushes and waits for the sockets
    /// (and for `bell`, cleared after each wait: what `attempt` waits for is
    /// a buffer back). Returns the transport, still locked.
    fn send_with(
        &self,
        deadline: &mut Deadline,
        cancel: Option<&CancelToken>,
        bell: Option<&HostBell>,
        mut attempt: impl FnMut(&mut T) -> Result<(), Error>,
    ) -> Result<MutexGuard<'_, T>, Error> {
        let mut t = self.shared.lock();
        Shared::adjust(&self.shared.app_calls, 1, &t);
        let mut last_try = false;
        // As `send`: a short spin before sleeping (a sleeping sender pays a
        // wake-up for each message the peer makes room for).
        let mut spin = Spin::new(self.shared.config.spin);
        loop {
            if cancel.is_some_and(CancelToken::is_cancelled) {
                return Err(Error::Cancelled);
            }
            match attempt(&mut t) {
                Ok(()) => return Ok(t),
                Err(Error::WouldBlock) => {}
                Err(e) => return Err(e),
            }
            if last_try {
                return Err(Error::Timeout); // the deadline had passed
            }
            let now = spin.clock();
            if now.is_some_and(|now| deadline.passed_at(now)) {
                // One more try once the wire has moved: a caller that cannot
                // wait still drives it (the progress thread leaves a polling
                // application's wire to it), so what is queued goes out.
                if t.progress() == Ok(true) {
                    last_try = true;
                    continue;
                }
                return Err(Error::Timeout);
            }
            // Move the wire ourselves (flush, read credit that came back);
            // if that changed anything, try again at once, else wait for it.
            if t.progress() == Ok(true) {
                continue;
            }
            if spin.on(now) {
                t = self.shared.relax(t);
            } else {
                t = self.wait_io_or(t, *deadline, false, bell);
                // Before the next look: a buffer back after it rings anew.
                if let Some(b) = bell {
                    b.clear();
                }
            }
        }
    }

    /// The next message from any peer. Errors about one peer (lost, invalid
    /// frames) come back here once each; the endpoint keeps serving the others.
    pub fn recv(
        &self,
        mut deadline: Deadline,
        cancel: Option<&CancelToken>,
    ) -> Result<Received<T::Lease>, Error> {
        self.wait_for(&mut deadline, cancel, true, |t| {
            match self.take_early(t).unwrap_or_else(|| t.try_recv()) {
                Ok(r) => Ok(Some(r)),
                // An empty wire, or a dry pool (waits for leases to come back).
                Err(Error::WouldBlock | Error::Pool(_)) => Ok(None),
                // Unless it is a connect's peer's end (kept for the connect).
                Err(e) => self.unclaimed(e, t).map_or(Ok(None), Err),
            }
        })
    }

    /// The next event: a peer that connected to the listener, a message, a
    /// peer that closed or was lost. `Err` only for the endpoint's own end
    /// (closed, deadline, cancellation) or a failure of the whole wire.
    pub fn next_event(
        &self,
        mut deadline: Deadline,
        cancel: Option<&CancelToken>,
    ) -> Result<Event<T::Lease>, Error> {
        self.next_event_by(&mut deadline, cancel)
    }

    /// As [`next_event`](Self::next_event), under a deadline the caller
    /// keeps: one [`after`](Deadline::after) a duration starts in place at
    /// the first look at the clock, so the caller's next call under it goes
    /// on from there rather than starting again.
    pub fn next_event_by(
        &self,
        deadline: &mut Deadline,
        cancel: Option<&CancelToken>,
    ) -> Result<Event<T::Lease>, Error> {
        self.next_event_with(deadline, cancel, |ev| ev)
    }

    /// As [`next_event_by`](Self::next_event_by), the event given to `then`
    /// with the transport still locked: what `then` records of peers
    /// (connected, gone) is in the order the wire told it, whichever
    /// threads take the events.
    pub fn next_event_with<R>(
        &self,
        deadline: &mut Deadline,
        cancel: Option<&CancelToken>,
        mut then: impl FnMut(Event<T::Lease>) -> R,
    ) -> Result<R, Error> {
        self.wait_for(deadline, cancel, true, |t| {
            Ok(self.look_for_event(t)?.map(&mut then))
        })
    }

    /// One look for the next event (the transport locked).
    fn look_for_event(&self, t: &mut T) -> Result<Option<Event<T::Lease>>, Error> {
        if let Some((peer, addr)) = t.take_accepted() {
            return Ok(Some(Event::Accepted { peer, addr }));
        }
        if let Some(r) = self.take_early(t) {
            return match r {
                Err(e) => self
                    .unclaimed(e, t)
                    .map_or(Ok(None), |e| Event::from_recv(Err(e))),
                r => Event::from_recv(r),
            };
        }
        let r = match t.try_recv() {
            Err(Error::WouldBlock | Error::Pool(_)) => return Ok(None),
            // A connect's peer's end is kept for the connect.
            Err(e) => match self.unclaimed(e, t) {
                Some(e) => Err(e),
                None => return Ok(None),
            },
            r => r,
        };
        // The same pass may have accepted the peer this came from: news of
        // the peer goes first.
        if let Some((peer, addr)) = t.take_accepted() {
            self.hold_early(r, t);
            return Ok(Some(Event::Accepted { peer, addr }));
        }
        Event::from_recv(r)
    }

    /// What a pass held back for the next look, if anything (`_locked`:
    /// the transport, which the caller has locked).
    fn take_early(&self, _locked: &T) -> Option<Result<Received<T::Lease>, Error>> {
        // Relaxed: the transport mutex orders every change (as `adjust`'s).
        if !self.shared.early_held.load(Ordering::Relaxed) {
            return None;
        }
        self.shared.early_held.store(false, Ordering::Relaxed);
        self.early().take()
    }

    /// Holds `r` for the next look (`_locked`: as in `take_early`).
    fn hold_early(&self, r: Result<Received<T::Lease>, Error>, _locked: &T) {
        *self.early() = Some(r);
        // Relaxed: as in `take_early`.
        self.shared.early_held.store(true, Ordering::Relaxed);
    }

    fn early(&self) -> MutexGuard<'_, Option<Result<Received<T::Lease>, Error>>> {
        // Filled and emptied whole: a poisoned slot is still consistent.
        self.shared.early.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until the Hellos with `peer` (which this side connected to)
    /// have crossed, and returns the id that names it from now on (see
    /// [`Wire::opened`]): a peer that refuses (another version, not
    /// zerohop) or goes is the error `recv` would have given.
    pub fn wait_open(&self, peer: PeerId, deadline: Deadline) -> Result<PeerId, Error> {
        self.wait_open_with(peer, deadline, |_| {}, |_, _| {})
    }

    /// As [`wait_open`](Self::wait_open), with the transport still locked
    /// in the look that decides (and the peer still claimed, see
    /// [`attach`](Self::attach)): `then` given the peer's id once open, so
    /// that what it records of the peer comes before any news of its end;
    /// or, where it failed, `let_go` given the transport and the peer, so
    /// that no news of a peer the caller never had reaches anyone.
    pub fn wait_open_with(
        &self,
        peer: PeerId,
        mut deadline: Deadline,
        then: impl FnOnce(PeerId),
        let_go: impl FnOnce(&mut T, PeerId),
    ) -> Result<PeerId, Error> {
        // Its end, where `attach` claimed it and one came, else the wire's.
        let opened = |t: &mut T| {
            let end = self
                .claims()
                .iter()
                .find_map(|&(p, end)| end.filter(|_| p == peer));
            end.map(Err).or_else(|| t.opened(peer))
        };
        // The look that finds it open gives it to `then` and ends the claim
        // under the same lock (no end can come between).
        let mut then = Some(then);
        let mut open = |t: &mut T, p: PeerId| {
            if let Some(then) = then.take() {
                then(p);
            }
            self.unclaim(peer, t);
            p
        };
        // Not `reading`: messages that come meanwhile wait for a later
        // `recv`, and must not keep this wait from sleeping.
        let r = self.wait_for(&mut deadline, None, false, |t| {
            if let Some(r) = opened(t) {
                return r.map(|p| Some(open(t, p)));
            }
            t.progress()?;
            opened(t).transpose().map(|p| p.map(|p| open(t, p)))
        });
        if r.is_ok() {
            return r;
        }
        // One last look as the wait ends (its Hello may have come with the
        // deadline); failed, the peer is let go before the claim ends.
        let mut t = self.shared.lock();
        let r = match r {
            Err(Error::Timeout) => opened(&mut t).unwrap_or(r),
            r => r,
        };
        match r {
            Ok(p) => Ok(open(&mut t, p)),
            Err(e) => {
                let_go(&mut t, peer);
                self.unclaim(peer, &t);
                Err(e)
            }
        }
    }

    /// Polls `look` until it finds something (`Ok(Some)`) or fails, as a
    /// receiver waits: spinning on the transport, then asleep on its
    /// descriptors, until the deadline or a cancellation. `reading`: `look`
    /// takes arrivals (then one waiting keeps it from sleeping).
    fn wait_for<R>(
        &self,
        deadline: &mut Deadline,
        cancel: Option<&CancelToken>,
        reading: bool,
        mut look: impl FnMut(&mut T) -> Result<Option<R>, Error>,
    ) -> Result<R, Error> {
        // The spin is timed from the first clock check (CLOCK_EVERY polls in):
        // a message that is already there costs no clock read.
        let mut spin_until = None;
        // This thread reads for itself from here on, spinning and then asleep
        // in poll(2): the progress thread leaves reading to it, so one
        // arrival wakes one thread and the two do not fight for the lock.
        // The count changes under the transport lock, which the progress
        // thread holds while it decides whether to read.
        let mut t = self.shared.lock();
        Shared::adjust(&self.shared.app_reading, 1, &t);
        Shared::adjust(&self.shared.app_calls, 1, &t);
        let mut spinning = !self.shared.config.spin.is_zero();
        let mut spins = 0u32;
        let result = loop {
            if cancel.is_some_and(CancelToken::is_cancelled) {
                break Err(Error::Cancelled);
            }
            match look(&mut t) {
                Ok(Some(r)) => break Ok(r),
                Ok(None) => {}
                Err(e) => break Err(e),
            }
            // 1. Spin: poll the transport directly for a short while, letting
            // a thread that waits for the lock in between attempts. The clock
            // is read every `CLOCK_EVERY` attempts only: where it is a system
            // call (virtual machines without a stable TSC) it would cost more
            // than a poll.
            spins = spins.wrapping_add(1);
            if spinning && spins % CLOCK_EVERY != 0 {
                t = self.shared.relax(t);
                continue;
            }
            // One clock read serves the deadline and the spin.
            let now = Instant::now();
            if deadline.passed_at(now) {
                break Err(Error::Timeout);
            }
            let until = *spin_until.get_or_insert(now + self.shared.config.spin);
            if spinning && now < until {
                continue;
            }
            // 2. Sleep in poll(2) on the transport's descriptors; with no
            // progress thread, do its work first.
            spinning = false;
            if self.thread.is_none() && t.progress() == Ok(true) {
                continue;
            }
            t = self.wait_io(t, *deadline, reading);
        };
        Shared::adjust(&self.shared.app_reading, -1, &t);
        drop(t);
        result
    }

    /// How many times the progress thread has taken the transport lock to
    /// work (a diagnostic): while an application keeps sending or receiving
    /// on a wire that wakes `poll(2)`, it stays near zero, since every such
    /// pass contends with the application for the lock.
    pub fn progress_passes(&self) -> usize {
        // Relaxed: a statistic.
        self.shared.passes.load(Ordering::Relaxed)
    }

    /// Bytes accepted but not yet handed to the OS.
    pub fn pending_sends(&self) -> usize {
        self.shared.lock().pending_sends()
    }

    /// Waits until every accepted send is with the OS (TCP) or completed (RDMA).
    /// Drives the transport itself and waits on its descriptors, as a blocked
    /// `send` does; the progress thread helps where there are none.
    pub fn flush(&self, mut deadline: Deadline) -> Result<(), Error> {
        let mut t = self.shared.lock();
        loop {
            // Errors are the affected peers' and reach `recv`; flushing goes on.
            let _ = t.progress();
            if t.pending_sends() == 0 {
                return Ok(());
            }
            if deadline.passed() {
                return Err(Error::Timeout);
            }
            self.shared.wake_progress();
            t = self.wait_io(t, deadline, false);
        }
    }

    /// Ends every session cleanly: no new messages or peers; a Close to
    /// each peer after what was sent to it; then waits (until `deadline`)
    /// for everything queued to go and for each peer's answering Close, so
    /// that no peer is left with a connection reset. Messages that arrive
    /// meanwhile wait for `recv`. `Timeout`: queued messages were not all
    /// delivered, or a peer did not answer.
    pub fn shutdown(&self, mut deadline: Deadline) -> Result<(), Error> {
        let mut t = self.shared.lock();
        t.close()?;
        loop {
            // Errors are the affected peers' and reach `recv`; closing goes on.
            let _ = t.progress();
            if t.pending_sends() == 0 && t.peers_left() == 0 {
                return Ok(());
            }
            if deadline.passed() {
                return Err(Error::Timeout);
            }
            self.shared.wake_progress();
            // Not `reading`: messages that came wait for `recv`, and must
            // not keep this wait from sleeping.
            t = self.wait_io(t, deadline, false);
        }
    }

    /// [`shutdown`](Self::shutdown), then stops the progress thread.
    pub fn close(mut self, deadline: Deadline) -> Result<(), Error> {
        let done = self.shutdown(deadline);
        self.closed = true;
        self.stop();
        done
    }

    fn stop(&mut self) {
        // Relaxed would do for a flag the thread polls, but Release/Acquire keeps
        // the reasoning local: everything before stop() is seen by the thread.
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake_progress();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl<T: Wire> Drop for Endpoint<T> {
    fn drop(&mut self) {
        if !self.closed {
            // Dropped without `close`: what is still queued is not delivered; say so.
            let pending = self.shared.lock().pending_sends();
            if pending > 0 {
                log::warn!(
                    "zerohop: endpoint dropped without close: sends not yet delivered ({pending}, in the wire's unit: bytes or frames)"
                );
            }
        }
        self.stop();
    }
}

fn progress_loop<T: Wire>(s: &Shared<T>) {
    let mut fds: Vec<libc::pollfd> = Vec::new();
    let mut calls_seen = 0;
    let mut woken = true;
    // Acquire: pairs with `stop`'s Release store.
    while !s.stop.load(Ordering::Acquire) {
        // Relaxed: `app_calls` is a hint (a stale count only delays the
        // progress thread's taking over by one poll interval); `app_reading`
        // is read again under the transport mutex below.
        let calls = s.app_calls.load(Ordering::Relaxed);
        let app_polling = s.app_reading.load(Ordering::Relaxed) > 0 || calls != calls_seen;
        calls_seen = calls;
        if T::WAKES_POLL && !woken && app_polling {
            // A quiet interval while the application drives the wire itself:
            // nothing for this thread, so it does not take the lock (it
            // would stall a sender mid-`writev` and cost both threads a
            // futex round trip and a context switch) and sleeps on the same
            // descriptors. A ring, a new peer, a queued send or a dead
            // descriptor (POLLNVAL) wakes it for a full pass.
            woken = s.doorbell.sleep(&mut fds, s.config.poll_interval);
            continue;
        }
        {
            let mut t = s.lock();
            // Relaxed: a statistic.
            s.passes.fetch_add(1, Ordering::Relaxed);
            // Relaxed: `app_reading` changes under the transport mutex, held here.
            let app_polling = app_polling || s.app_reading.load(Ordering::Relaxed) > 0;
            match t.background_progress(!app_polling) {
                Ok(true) => s.progressed.notify_all(),
                Ok(false) => {}
                Err(e) => log::debug!("zerohop: progress: {e}"),
            }
            fds.clear();
            t.poll_fds(&mut fds, Waiter::Progress { app_polling });
        }
        // Waiters re-check on every wake; a notify per loop keeps senders
        // blocked on a full queue moving as the kernel drains it.
        s.progressed.notify_all();
        woken = s.doorbell.sleep(&mut fds, s.config.poll_interval);
    }
}

#[cfg(feature = "mock")]
impl<L, T> Wire for zerohop_backends::mock::MockTransport<L, Arc<zerohop_backends::HostPool<T>>>
where
    L: zerohop_backends::mock::Link + Send + 'static,
    T: zerohop_core::pool::PoolTables + Send + Sync + 'static,
{
    fn leaser(&self) -> Leaser<Self::Lease> {
        pool_leaser(Arc::clone(self.pool()))
    }

    fn read_lease(&self, lease: &Self::Lease, out: &mut [u8]) -> Result<(), Error> {
        copy_out(zerohop_backends::host_bytes(lease), out)
    }
}

/// Copies the start of `bytes` into `out`; a message shorter than `out` is `TooLarge`.
pub(crate) fn copy_out(bytes: &[u8], out: &mut [u8]) -> Result<(), Error> {
    let src = bytes.get(..out.len()).ok_or(Error::TooLarge {
        len: out.len(),
        max: bytes.len(),
    })?;
    out.copy_from_slice(src);
    Ok(())
}

#[cfg(feature = "gpudirect-verbs")]
impl<M: zerohop_backends::verbs::PayloadMemory> Wire for zerohop_backends::verbs::RdmaTransport<M> {
    const WAKES_POLL: bool = true;

    fn leaser(&self) -> Leaser<Self::Lease> {
        pool_leaser(Arc::clone(self.send_pool()))
    }

    fn lease_bell(&self) -> Option<HostBell> {
        use zerohop_backends::verbs::PayloadPool;
        self.send_pool().bell().try_clone()
    }

    fn read_lease(&self, lease: &Self::Lease, out: &mut [u8]) -> Result<(), Error> {
        if lease.len() < out.len() {
            return Err(Error::TooLarge {
                len: out.len(),
                max: lease.len(),
            });
        }
        self.memory().read(lease, out)
    }

    fn poll_fds(&self, out: &mut Vec<libc::pollfd>, waiter: Waiter) {
        // The progress thread watches completions only for an application
        // that stopped polling (then it drains arrivals, so the peer gets its
        // credits back, and posts frames that waited for them). One that
        // keeps calling reaps its own, its sends' included: a message wakes
        // the thread that wants it and no other.
        let (cm, completions) = match waiter {
            Waiter::Progress { app_polling } => (true, !app_polling),
            Waiter::App { .. } => (false, true),
        };
        let mut fds = Vec::new();
        self.poll_descriptors(&mut fds, cm, completions);
        out.extend(fds.into_iter().map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        }));
    }

    fn pending_sends(&self) -> usize {
        self.pending_frames()
    }

    fn prepare_sleep(&mut self, waiter: Waiter) -> bool {
        match waiter {
            // The progress thread arms in its own progress (`poll_conn`).
            Waiter::Progress { .. } => false,
            Waiter::App { reading } => self.arm_completions() || (reading && self.has_arrivals()),
        }
    }

    fn needs_progress(&self) -> bool {
        // Posted frames complete without help (their completions are reaped
        // by whoever polls next); only frames waiting for credits need the
        // progress thread.
        self.unposted_frames() > 0
    }

    fn peers_left(&self) -> usize {
        zerohop_backends::verbs::RdmaTransport::peers_left(self)
    }

    fn opened(&mut self, peer: PeerId) -> Option<Result<PeerId, Error>> {
        zerohop_backends::verbs::RdmaTransport::opened(self, peer)
    }

    fn take_accepted(&mut self) -> Option<(PeerId, SocketAddr)> {
        zerohop_backends::verbs::RdmaTransport::take_accepted(self)
    }

    fn peer_addr(&self, peer: PeerId) -> Option<SocketAddr> {
        zerohop_backends::verbs::RdmaTransport::peer_addr(self, peer)
    }

    fn peer_stats(&self, peer: PeerId) -> Option<SessionStats> {
        zerohop_backends::verbs::RdmaTransport::peer_stats(self, peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_after_a_duration_starts_at_its_first_look_and_then_stays() {
        let d = Duration::from_millis(40);
        let mut late = Deadline::after(d);
        std::thread::sleep(2 * d);
        // Not started by the sleep: its first look starts it.
        assert!(!late.passed(), "started at its first look, not at `after`");
        let fixed = late;
        assert_eq!(late.remaining().map(|r| r <= d), Some(true));
        std::thread::sleep(d + Duration::from_millis(5));
        assert!(late.passed(), "then it runs out");
        assert_eq!(late, fixed, "started once");
        // `started` starts it for a caller with several calls under it.
        let s = Deadline::after(d).started();
        assert!(matches!(s.0, When::At(_)));
        assert_eq!(s.started(), s);
        // A duration past the clock's range never passes.
        let mut never = Deadline::after(Duration::MAX);
        assert!(!never.passed() && never.remaining().is_none());
        assert_eq!(never, Deadline::never());
        let mut gone = Deadline::at(Instant::now());
        assert!(gone.passed_at(Instant::now() + Duration::from_millis(1)));
    }
}
