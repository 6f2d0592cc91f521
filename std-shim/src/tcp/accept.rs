//! Accepting: a connection holds 32 bytes and a deadline until its Hello
//! makes it a peer, or pairs it as a peer's lane.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Instant as StdInstant;

use zerohop_backends::{absence, counted_address, crowd_group};
use zerohop_core::session::{HostRole, Instant, ProtocolError, Session};
use zerohop_core::wire::{Close, Frame, HEADER_LEN};
use zerohop_core::{Error, PeerId};

use super::{
    key, micros, Lane, TcpTransport, ACCEPT_BACKOFF, PENDING, REFUSING, TIMER_SCAN, WARN_EVERY,
};
use crate::poller::Set;
use crate::waiting_room::{oldest_of_most_crowded, quiet_to_let_go};

/// An accepted connection before its Hello: 32 bytes and a deadline.
pub(super) struct Pending {
    pub(super) stream: TcpStream,
    pub(super) addr: SocketAddr,
    pub(super) since: StdInstant,
    pub(super) hello: [u8; HEADER_LEN],
    pub(super) have: usize,
}

impl TcpTransport {
    pub(super) fn accept_all(&mut self) -> bool {
        if self.accept_after.is_some_and(|t| StdInstant::now() < t) {
            return false;
        }
        self.accept_after = None;
        let mut any = false;
        while let Some(l) = &self.listener {
            match l.accept() {
                Ok((s, addr)) => {
                    any = true;
                    if let Some(n) = self.accept_failures.ended() {
                        log::warn!("tcp: accepts resumed ({n} more failed since the last report)");
                    }
                    if let Err(e) = self.add_pending(s, addr) {
                        log::warn!("tcp: accepted {addr} but could not set it up: {e}");
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors (EMFILE) or memory: the connection
                    // waits in the backlog; try again after a pause, not at once.
                    let now = StdInstant::now();
                    match self.accept_failures.occur(now) {
                        None => log::debug!(
                            "tcp: accept failed: {e}; pausing accepts for {ACCEPT_BACKOFF:?}"
                        ),
                        Some(n) => log::warn!(
                            "tcp: accept failed: {e}; pausing accepts for {ACCEPT_BACKOFF:?} \
                             ({n} more failed since the last report; reported every \
                             {WARN_EVERY:?} while they fail)"
                        ),
                    }
                    self.accept_after = Some(now + ACCEPT_BACKOFF);
                    break;
                }
            }
        }
        any
    }

    pub(super) fn add_pending(&mut self, s: TcpStream, addr: SocketAddr) -> io::Result<()> {
        s.set_nonblocking(true)?;
        if self.handshaking() >= self.config.max_handshakes {
            // The oldest connection that never said Hello, of the address
            // with the most of them, makes room.
            let waiting = self.pending.iter().enumerate();
            let waiting = waiting.filter_map(|(i, p)| {
                p.as_ref()
                    .map(|p| (i, counted_address(p.addr.ip()), p.since))
            });
            if let Some(i) = oldest_of_most_crowded(waiting) {
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
    pub(super) fn handshake(&mut self, slot: usize) {
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

    /// Answers a newcomer past the peer limits with a Close where our Hello
    /// was due (its side reads a refusal, not a lost peer), and shuts our
    /// side; the socket is read until the newcomer closes (see `refusing`).
    /// Its second connection, if it came first, goes too.
    fn refuse(&mut self, p: Pending, token: u32, why: zerohop_backends::Refusal) {
        self.refused += 1;
        match self.refusals.occur(StdInstant::now()) {
            None => log::debug!("tcp: {} refused: {why}", p.addr),
            Some(n) => log::warn!(
                "tcp: {} refused: {why} ({n} more refused since the last report; reported \
                 every {WARN_EVERY:?} while they come)",
                p.addr
            ),
        }
        // A fresh socket: its send buffer takes the 32 bytes at once.
        let close = Frame::Close(Close { seq: 0 }).encode(&[]);
        let mut left = REFUSED_READS;
        if (&p.stream).write(&close).is_ok_and(|n| n == close.len())
            && p.stream.shutdown(std::net::Shutdown::Write).is_ok()
            && drained(&p.stream, &mut left) == Some(false)
        {
            if self.refusing.len() >= REFUSING {
                self.refusing.pop_front();
            }
            self.refusing.push_back((p.stream, StdInstant::now(), left));
        }
        self.unclaimed.retain(|(l, _)| !l.fits(Some(token), p.addr));
    }

    /// A newcomer past the peer limits takes the place of a peer accepted
    /// here that has been quiet (nothing heard) for an idle timeout or
    /// more, where this side is not what keeps it quiet, from a crowd: the
    /// newcomer's own group of addresses
    /// ([`crowd_group`](zerohop_backends::crowd_group): loopback, an IPv4
    /// /24, an IPv6 /48), else one holding more places than the
    /// newcomer's would (of the group with the most quiet peers:
    /// [`quiet_to_let_go`]; one that never delivered a message first, then
    /// the longest quiet). Where the newcomer's own
    /// address is at its share, only that address's peers. Its side is
    /// sent a Close; the application is told ([`ProtocolError::Evicted`]).
    /// Without it a stranger that opened connection after connection and
    /// said nothing more kept every place, and every newcomer out, for as
    /// long as it liked; a peer alone in its group is never let go for
    /// another group's newcomer. After a walk that finds none, none again
    /// for a timer scan, nor before the first kept peer could be quiet.
    /// Whether a place was made.
    fn make_room(&mut self, ip: std::net::IpAddr) -> bool {
        let (t, idle) = (self.now(), self.config.idle_timeout);
        // Not while this side holds its peers back: a full inbox or a dry
        // pool leaves them unread, and so does an application away.
        let away = self.looks.away(std::time::Instant::now(), absence(idle));
        if self.next_walk.is_some_and(|b| t < b) || self.inbox_full() || self.pool_dry || away {
            return false;
        }
        let own_address = counted_address(ip);
        let own_share = self.kept.from(ip) >= self.config.peer_limits.per_address;
        let fits = |peer: std::net::IpAddr| !own_share || counted_address(peer) == own_address;
        let own = crowd_group(ip);
        // Since when each is quiet, on one scale for this wire's clock and
        // another's (`SessionClock::monotonic_us`).
        let mono = |at: Instant| self.session_clock.monotonic_us(at);
        let (now_us, idle_us) = (mono(t), micros(idle));
        let mut heard = now_us;
        let quiet_long = |since: u64| now_us.saturating_sub(since) >= idle_us;
        // Ranked: those that never delivered a message first (a stranger's
        // connections that said Hello and nothing more go before a peer
        // that gossips, however long or briefly either has been kept),
        // then the longest quiet.
        let mut quiet: Vec<(Who, std::net::IpAddr, (bool, u64))> = Vec::new();
        for (slot, p) in self.peers.iter().filter(|(_, p)| p.token.is_some()) {
            let last = mono(p.session.last_heard());
            heard = heard.min(last);
            // Quiet of its own accord: not waiting for a grant, a buffer
            // or the application, nothing of ours queued, nothing unread,
            // its socket taking a Close.
            let its_own = p.announced
                && !p.opening()
                && !(p.asked || p.dry || p.deferred || p.waits_for_budget)
                && p.queue.is_empty()
                && p.direct.is_none()
                && p.incoming.is_none()
                && !p.readable
                && p.writable
                && p.stage_end == p.stage_start;
            if its_own && fits(p.addr.ip()) && quiet_long(last) {
                let delivered = p.session.stats().messages_received > 0;
                quiet.push((Who::Tcp(slot), crowd_group(p.addr.ip()), (delivered, last)));
            }
        }
        // Same-host lanes, as their wire last told (`offer_elsewhere`).
        for e in &self.elsewhere {
            heard = heard.min(e.quiet_since);
            if e.its_own && fits(e.ip) && quiet_long(e.quiet_since) {
                let rank = (e.delivered, e.quiet_since);
                quiet.push((Who::Elsewhere(e.id), crowd_group(e.ip), rank));
            }
        }
        // Places as the limits count them: same-host lanes too.
        let kept = &self.kept;
        let places = |g| kept.in_group(g);
        // A few picks at most: one with bytes waiting in its socket spoke.
        for _ in 0..4 {
            let ranked: Vec<_> = quiet.iter().map(|&(_, g, last)| (g, last)).collect();
            let Some(i) = quiet_to_let_go(&ranked, places, own) else {
                break;
            };
            match quiet.swap_remove(i).0 {
                Who::Tcp(slot) if self.peers.at_mut(slot).is_some_and(|p| p.note_unread()) => {}
                Who::Tcp(slot) => {
                    self.evict(slot, ip);
                    return true;
                }
                Who::Elsewhere(peer) => {
                    // Its wire ends it; its place frees as it goes.
                    self.elsewhere.retain(|e| e.id != peer);
                    self.let_go.push(peer);
                    self.report_eviction(peer, ip);
                    return true;
                }
            }
        }
        // None found: no walk again for a timer scan (a newcomer refused
        // in a loop), nor before the first kept peer could be quiet. (A
        // walk that finds one sets no such wait: a stranger letting its
        // own quiet peers go one after another would keep every other
        // newcomer out.)
        let first = idle_us.saturating_sub(now_us.saturating_sub(heard));
        self.next_walk = Some(t.after(std::time::Duration::from_micros(first).max(TIMER_SCAN)));
        false
    }

    fn report_eviction(&mut self, peer: PeerId, ip: std::net::IpAddr) {
        match self.evictions.occur(StdInstant::now()) {
            None => log::debug!("tcp: peer {peer} let go, quiet, for a newcomer from {ip}"),
            Some(n) => log::warn!(
                "tcp: peer {peer} let go, quiet, for a newcomer from {ip} ({n} more let go \
                 since the last report; reported every {WARN_EVERY:?} while they go)"
            ),
        }
    }

    /// Lets `slot`'s peer go for a newcomer from `ip`: a Close (nothing of
    /// ours queued before it; sent as far as its socket takes it now), its
    /// side shut and read as a refused newcomer's, the application told.
    fn evict(&mut self, slot: usize, ip: std::net::IpAddr) {
        let peer = self.id(slot);
        self.report_eviction(peer, ip);
        if let Some(p) = self.peers.at_mut(slot) {
            p.session.close();
        }
        self.control(slot);
        self.flush(slot);
        let Some(p) = self.peers.at_mut(slot) else {
            return; // its socket failed: reported lost by the flush
        };
        let mut left = REFUSED_READS;
        if p.queue.is_empty()
            && p.stream.shutdown(std::net::Shutdown::Write).is_ok()
            && drained(&p.stream, &mut left) == Some(false)
        {
            // Out of epoll first: the copy kept would keep its events
            // coming under the slot's key, to the newcomer that takes it.
            self.poller.remove(&p.stream, Set::Data);
            self.poller.remove(&p.stream, Set::Ctl);
            if let Ok(s) = p.stream.try_clone() {
                if self.refusing.len() >= REFUSING {
                    self.refusing.pop_front();
                }
                self.refusing.push_back((s, StdInstant::now(), left));
            }
        }
        self.arrivals.push_back(Err(Error::Protocol {
            peer,
            error: ProtocolError::Evicted,
        }));
        self.drop_peer(slot, true);
    }

    pub(super) fn hello(&mut self, p: Pending) {
        match Frame::decode(&p.hello, 0).map(|d| d.frame) {
            Ok(Frame::Hello(h)) if h.lane == 1 => self.pair(Lane {
                stream: p.stream,
                token: h.token,
                from: p.addr.ip(),
                confirmed: true,
                ack: [0; HEADER_LEN],
                ack_have: 0,
                early: Vec::new(),
            }),
            Ok(Frame::Hello(h)) => {
                let full = self.kept.admit(&self.config.peer_limits, p.addr.ip()).err();
                let answer = self.config.session(HostRole::Answer);
                let mut session = Session::new(answer, 0, self.now());
                match session.handle_header(self.now(), &p.hello, None) {
                    Ok(_) => {
                        // Room is made for a Hello that opens a session only.
                        if let Some(why) = full.filter(|_| !self.make_room(p.addr.ip())) {
                            return self.refuse(p, h.token, why);
                        }
                        let token = session.peer().map_or(0, |h| h.token);
                        match self.add_peer(p.stream, p.addr, session) {
                            // Announced once its same-host frame settles (`control`).
                            Ok(id) => {
                                let mine = |(l, _): &(Lane, _)| l.fits(Some(token), p.addr);
                                if let Some(k) = self.unclaimed.iter().position(mine) {
                                    if let Some((lane, _)) = self.unclaimed.remove(k) {
                                        self.attach_lane(id, lane);
                                    }
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
}

/// A peer a full listener may let go: one of its own (a slot), or one
/// another wire of the endpoint keeps (an id).
#[derive(Clone, Copy)]
enum Who {
    Tcp(usize),
    Elsewhere(PeerId),
}

/// Bytes read from a refused newcomer, at most, before it is cut off: an
/// honest one sends its Hello and its same-host frame (64 bytes); one that
/// streams would otherwise keep the listener reading it.
const REFUSED_READS: usize = 1024;

/// Reads and drops what a refused newcomer sent, up to the `left` bytes
/// it may still send: `Some(true)` once it has closed, `Some(false)` while
/// it may send more, `None` on an error, or past `left` (cut off).
pub(super) fn drained(s: &TcpStream, left: &mut usize) -> Option<bool> {
    let mut sink = [0u8; 2 * HEADER_LEN];
    loop {
        match (&*s).read(&mut sink) {
            Ok(0) => return Some(true),
            Ok(n) => *left = left.checked_sub(n)?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Some(false),
            Err(_) => return None,
        }
    }
}
