//! The verbs transport's connections: listening, connecting, accepting,
//! and the connection manager's events that bring one up or take it down
//! (the data path, posts and completions, is the parent module's).
//!
//! The CM private data is one little-endian word. On a request and its
//! acceptance it is this side's ring depth: the peer's frame credits before
//! the Hellos cross. A peer whose ring is shallower than [`MIN_RECV_DEPTH`]
//! (or that sends none) is refused, on either side. On a reject it says why
//! ([`RejectReason`]), so the connecting side can tell a listener at its
//! peer limits from one it does not fit.

use super::*;

/// What dialing a peer needs of a transport (its device, pools and
/// settings), taken under its lock in a moment ([`RdmaTransport::dialer`]):
/// the dial itself — address and route resolution, the queue pair and its
/// receive ring, the CM's handshake — then runs without the transport, and
/// other peers are served meanwhile.
pub struct Dialer<M: PayloadMemory> {
    device: Arc<Device>,
    config: RdmaConfig,
    header_pool: Arc<HeaderPool>,
    recv_pool: Arc<M::Pool>,
    session: SessionConfig,
    clock: SessionClock,
}

/// A connection [`Dialer::dial`] brought up, for [`RdmaTransport::attach`]
/// (dropped instead, it is torn down).
pub struct Dialed<M: PayloadMemory> {
    conn: Box<Conn<M>>,
    /// The receive pool its ring came from: the transport's own, or
    /// another's, which `attach` refuses.
    from: Arc<M::Pool>,
    /// The ring the peer announced: our frame credits.
    ring: u16,
}

impl<M: PayloadMemory> std::fmt::Debug for Dialer<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dialer")
            .field("device", &self.device.name())
            .finish_non_exhaustive()
    }
}

impl<M: PayloadMemory> std::fmt::Debug for Dialed<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dialed")
            .field("addr", &self.conn.addr)
            .field("ring", &self.ring)
            .finish_non_exhaustive()
    }
}

impl<M: PayloadMemory> Dialer<M> {
    /// Resolves `addr`, sets a connection up and brings it up through the
    /// CM, within `timeout`.
    pub fn dial(&self, addr: SocketAddr, timeout: Duration) -> Result<Dialed<M>, VerbsError> {
        let until = deadline(timeout);
        let at = |e| match e {
            VerbsError::Connect(why) => VerbsError::Connect(format!("to {addr}: {why}")),
            e => e,
        };
        let id = CmId::new(&EventChannel::new()?)?;
        id.resolve(addr, until).map_err(at)?;
        let mut conn = self.setup(id).map_err(|(e, _)| at(e))?;
        self.post_ring(&mut conn).map_err(at)?;
        conn.qp
            .id()
            .connect(&self.config.recv_depth.to_le_bytes())?;
        let ev = conn
            .qp
            .id()
            .channel()
            .expect(
                ffi::rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED,
                "connection",
                until,
            )
            .map_err(at)?;
        let ring = usable_depth(ev.word)?;
        conn.established = true;
        conn.addr = Some(addr);
        Ok(Dialed {
            conn: Box::new(conn),
            from: Arc::clone(&self.recv_pool),
            ring,
        })
    }

    /// Creates the QP (and its CQ) on `id`, and a connection around it with
    /// nothing posted ([`post_ring`](Self::post_ring) next). On failure the
    /// id comes back, to be rejected or dropped.
    #[allow(clippy::result_large_err)]
    fn setup(&self, id: CmId) -> Result<Conn<M>, (VerbsError, CmId)> {
        if id.verbs() != self.device.ctx() {
            let why = format!(
                "the route leaves through another RDMA device than {}",
                self.device.name()
            );
            return Err((VerbsError::Connect(why), id));
        }
        // The data ring and the control slots (see `CONTROL_SLOTS`).
        let depth = self.session.posted_slots() as usize;
        let send_depth = depth + 8;
        let headers = match Lease::take(
            Arc::clone(&self.header_pool),
            (depth + send_depth) * HEADER_LEN,
        ) {
            Ok(h) => h,
            Err(e) => return Err((VerbsError::Connect(format!("header ring: {e}")), id)),
        };
        let shape = QpShape {
            send_depth,
            recv_depth: depth,
            inline_want: INLINE_WANT,
        };
        let qp = Qp::create(id, self.device.pd(), shape)?;
        Ok(Conn {
            qp,
            // A stand-in: the side that keeps the connection makes its own.
            session: Session::new(self.session, 0, self.clock.now()),
            headers,
            recv: (0..depth).map(|_| None).collect(),
            unposted: Vec::with_capacity(depth),
            recv_dry: false,
            send: SendSlots::new(send_depth),
            queue: VecDeque::new(),
            assembling: None,
            held: VecDeque::new(),
            established: false,
            addr: None,
            accepted: false,
        })
    }

    /// Posts a new connection's receive ring. On failure the connection goes
    /// as it drops (QP, CQ, id), what was posted back in the pool.
    fn post_ring(&self, conn: &mut Conn<M>) -> Result<(), VerbsError> {
        for slot in 0..conn.recv.len() {
            RdmaTransport::post_recv(&self.recv_pool, self.config.fragment, conn, slot)
                .map_err(|e| VerbsError::Connect(format!("posting the receive ring: {e}")))?;
        }
        Ok(())
    }
}

/// `timeout` from now, or a year for one too long to add (a connect told to
/// wait "for ever").
fn deadline(timeout: Duration) -> StdInstant {
    let now = StdInstant::now();
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(365 * 86_400))
}

/// The address of a peer whose source the CM did not give (not IP): such
/// peers share it, and the overall bound applies to them as to any.
const UNSPECIFIED: std::net::IpAddr = std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED);

impl<M: PayloadMemory> RdmaTransport<M> {
    /// Listens for RDMA CM connections on `addr` (an address of the RDMA device's netdev).
    pub fn listen(&mut self, addr: SocketAddr) -> Result<(), VerbsError> {
        // Refused once closed: peers accepted then would keep a closing
        // transport from finishing.
        if self.closed {
            return Err(VerbsError::Connect("the transport is closed".into()));
        }
        let id = CmId::new(&EventChannel::new()?)?;
        id.listen(addr, 64)?;
        self.listener = Some(id);
        Ok(())
    }

    /// Whether [`close`](Transport::close) was called: no new peers.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Where it listens, if it does (with the port the system gave, for port 0).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.as_ref()?.local_addr()
    }

    /// Connects to a listening transport: blocks until the connection is
    /// established and the peer's Hello has come, at most `timeout` (all of
    /// it under this `&mut self`: an endpoint dials with
    /// [`dialer`](Self::dialer) and [`attach`](Self::attach) instead, so
    /// that other peers are served meanwhile). Nothing listening is
    /// `NoListener`, a listener never reached `Unreachable`, one that
    /// rejects us `Rejected` (with its reason), one that says no Hello
    /// `NoHello`; a peer whose ring is too shallow (`ShallowPeer`) or of
    /// another protocol version (`Protocol`) is refused. Nothing is left
    /// behind.
    pub fn connect(&mut self, addr: SocketAddr, timeout: Duration) -> Result<PeerId, VerbsError> {
        let until = deadline(timeout);
        let dialed = self.dialer().dial(addr, timeout)?;
        let peer = self.attach(dialed)?;
        loop {
            match self.opened(peer) {
                Some(Ok(peer)) => return Ok(peer),
                // The session's own handshake timer ran out first.
                Some(Err(Error::Protocol {
                    error:
                        ProtocolError::Stalled {
                            during: Stall::Handshake,
                        },
                    ..
                })) => return Err(VerbsError::NoHello),
                Some(Err(Error::Protocol { error, .. })) => {
                    return Err(VerbsError::Protocol(error))
                }
                Some(Err(_)) => {
                    return Err(VerbsError::Connect(format!(
                        "to {addr}: the peer went away before its hello"
                    )))
                }
                None if StdInstant::now() >= until => {
                    self.disconnect(peer);
                    return Err(VerbsError::NoHello);
                }
                None => {
                    let _ = self.poll_all();
                    std::hint::spin_loop();
                }
            }
        }
    }

    /// What a connect needs of this transport, to dial without it.
    pub fn dialer(&self) -> Dialer<M> {
        Dialer {
            device: Arc::clone(&self.device),
            config: self.config,
            header_pool: Arc::clone(&self.header_pool),
            recv_pool: Arc::clone(&self.recv_pool),
            session: self.session_config(),
            clock: self.session_clock,
        }
    }

    /// Makes a peer of a connection [`Dialer::dial`] brought up (from this
    /// transport's own [`dialer`](Self::dialer); another's is refused), and
    /// sends its Hello. The peer's Hello is yet to come: [`opened`](Self::opened)
    /// says when it has.
    pub fn attach(&mut self, dialed: Dialed<M>) -> Result<PeerId, VerbsError> {
        // A dial that ends while the transport closes: its connection goes.
        if self.closed {
            return Err(VerbsError::Connect("the transport is closed".into()));
        }
        let Dialed {
            mut conn,
            from,
            ring,
        } = dialed;
        // Another transport's dial: its ring, QP and memory keys are that
        // transport's, and would be posted and reaped here as ours.
        if !Arc::ptr_eq(&from, &self.recv_pool) {
            return Err(VerbsError::Connect(
                "a connection dialed by another transport".into(),
            ));
        }
        let addr = conn.addr;
        // Tokens tell the two ends of a connection apart: the accepting
        // side's is 0, the connecting side's 1.
        conn.session = Session::new(self.session_config(), 1, self.now()).with_peer_ring(ring);
        let (i, peer) = self.peers.insert(conn).map_err(|_| {
            let to = addr.map(|a| format!("to {a}: ")).unwrap_or_default();
            VerbsError::Connect(format!("{to}every peer slot is taken"))
        })?;
        self.service(i, Self::drain_and_pump); // our Hello
        Ok(peer)
    }

    /// Whether the Hellos of a peer this side connected to have crossed:
    /// `Some(Ok)` they have, `None` not yet, `Some(Err)` the peer refused
    /// (another version, not zerohop) or went, with why (taken from what
    /// `try_recv` would have said).
    pub fn opened(&mut self, peer: PeerId) -> Option<Result<PeerId, Error>> {
        if let Some(c) = self.peers.get(peer) {
            return c.session.is_open().then_some(Ok(peer));
        }
        Some(Err(crate::take_end(&mut self.arrivals, peer)))
    }

    /// Drops a peer at once, without a Close: its connection is torn down
    /// and what it had under way is lost. False if there is no such peer.
    pub fn disconnect(&mut self, peer: PeerId) -> bool {
        let Some(i) = self.peers.slot(peer) else {
            return false;
        };
        self.peers.remove(i).is_some()
    }

    pub(super) fn accept_all(&mut self) -> bool {
        let Some(channel) = self.listener.as_ref().map(|l| Arc::clone(l.channel())) else {
            return false;
        };
        let mut any = false;
        while let Ok(Some(ev)) = channel.next(Duration::ZERO) {
            any = true;
            self.cm_event(&channel, ev);
        }
        any
    }

    pub(super) fn cm_event(&mut self, channel: &Arc<EventChannel>, ev: CmEvent) {
        let Some(raw) = NonNull::new(ev.id) else {
            return;
        };
        match ev.kind {
            ffi::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST => {
                // SAFETY: a connect request's id is the event's own, owned by
                // nothing else, and its events come on the listener's channel.
                let id = unsafe { CmId::adopt(raw, channel) };
                // A closed listener, a full peer table, as many accepted
                // peers as it keeps, or a peer whose ring could never take
                // a data frame: refused before anything is set up.
                // Counted by a walk: a request costs a queue pair, far more.
                let ip = |a: Option<SocketAddr>| {
                    a.map_or(UNSPECIFIED, |a| crate::peers::counted_address(a.ip()))
                };
                let from = ip(id.peer_addr());
                let (mut kept, mut same) = (0, 0);
                for (_, c) in self.peers.iter().filter(|(_, c)| c.accepted) {
                    kept += 1;
                    same += usize::from(ip(c.addr) == from);
                }
                if let Err(why) = self.config.peer_limits.admit(kept, same) {
                    let from = id.peer_addr().map_or(UNSPECIFIED, |a| a.ip());
                    debug!("verbs: a connect request from {} refused: {}", from, why);
                    return id.reject(RejectReason::Refused);
                }
                if self.closed || self.peers.vacant().is_none() {
                    return id.reject(RejectReason::Refused);
                }
                let Ok(ring) = usable_depth(ev.word) else {
                    return id.reject(RejectReason::ShallowRing);
                };
                let dialer = self.dialer();
                let mut conn = match dialer.setup(id) {
                    Ok(conn) => conn,
                    Err((_, id)) => return id.reject(RejectReason::NoResources),
                };
                if dialer.post_ring(&mut conn).is_err() {
                    // Rejected with why; the connection goes as it drops.
                    return conn.qp.id().reject(RejectReason::NoResources);
                }
                conn.session =
                    Session::new(self.session_config(), 0, self.now()).with_peer_ring(ring);
                conn.addr = conn.qp.id().peer_addr();
                conn.accepted = true;
                // The table had room (above): the insert takes it.
                if conn
                    .qp
                    .id()
                    .accept(&self.config.recv_depth.to_le_bytes())
                    .is_ok()
                {
                    let _ = self.peers.insert(Box::new(conn));
                }
            }
            ffi::rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED => {
                if let Some((_, c)) = self
                    .peers
                    .iter_mut()
                    .find(|(_, c)| c.qp.id().as_ptr() == raw.as_ptr())
                {
                    c.established = true;
                    let _ = Self::pump(c); // our Hello
                }
            }
            // The peer went away, or an accepted connection never came up.
            ffi::rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED
            | ffi::rdma_cm_event_type::RDMA_CM_EVENT_REJECTED
            | ffi::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_ERROR
            | ffi::rdma_cm_event_type::RDMA_CM_EVENT_UNREACHABLE => {
                let found = self
                    .peers
                    .iter()
                    .find(|(_, c)| c.qp.id().as_ptr() == raw.as_ptr())
                    .map(|(i, _)| i);
                if let Some((peer, mut conn)) = found.and_then(|i| self.peers.remove(i)) {
                    // What landed before the end is taken first: its Close
                    // may wait in the CQ behind the CM event (a clean close
                    // read as a lost peer otherwise). Flushed receives after
                    // it are the end itself.
                    if conn.established {
                        let _ = self.drain_cq(&mut conn, peer);
                    }
                    let lost = !conn.session.peer_closed();
                    self.retire(conn, peer, lost.then_some(Error::PeerLost(peer)));
                }
            }
            _ => {}
        }
    }

    /// Takes down a connection that failed (`error`) or ended; the error
    /// reaches `try_recv` only if the application could know the peer (its
    /// connection came up). Its verbs objects and buffers go as it drops,
    /// but for the whole messages (and Close) that wait for a buffer for one
    /// ahead of them: those are still handed on, in order, the error last
    /// (see `Held`). A message it had not all of is lost.
    pub(super) fn retire(&mut self, mut conn: Box<Conn<M>>, peer: PeerId, error: Option<Error>) {
        let mut held = std::mem::take(&mut conn.held);
        if matches!(held.back(), Some(Held::Fragments { done: false, .. })) {
            held.pop_back();
        }
        if let (Some(e), true) = (error, conn.established) {
            // A failure of this connection alone (a post or a poll refused,
            // a broken invariant) is this peer's loss, not the transport's:
            // the others are served on. Its cause goes to the log.
            let e = match e {
                e @ Error::PeerClosed(_) => e,
                e if e.lost_peer().is_some() => e,
                e => {
                    warn!("verbs: peer {} lost: {}", peer, e);
                    Error::PeerLost(peer)
                }
            };
            arrive(&mut self.arrivals, &mut held, Err(e));
        }
        drop(conn);
        if !held.is_empty() {
            self.orphans.push_back((peer, held));
        }
    }
}

/// The credits a peer starts with: the ring it announced, if deep enough.
fn usable_depth(depth: Option<u32>) -> Result<u16, VerbsError> {
    match depth {
        Some(d) if d >= MIN_RECV_DEPTH => Ok(u16::try_from(d).unwrap_or(u16::MAX)),
        depth => Err(VerbsError::ShallowPeer { depth }),
    }
}
