//! Receiving: readiness into the peers, bytes through the stage or straight
//! into a lease leased at the first payload bytes, headers and payloads to
//! the engine.

use std::io::{self, IoSliceMut, Read};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use zerohop_backends::{counted_address, host_bytes, host_bytes_mut};
use zerohop_core::session::{DataIn, Inbound};
use zerohop_core::wire::HEADER_LEN;
use zerohop_core::{Error, Lease, Received};

use super::lane::stripe_split;
use super::stage::Stage;
use super::{
    Peer, TcpTransport, DEFER_AT_MOST, DIRECT_MIN, FRAMES_PER_TURN, LANE, LISTENER, PENDING,
    QUICK_ACK_MIN, READ_AHEAD, STAGE_BYTES, WATCHED,
};
use crate::poller::Set;

/// A data frame whose header (or short record) the engine took: where its
/// payload goes.
pub(super) struct Incoming {
    pub(super) d: DataIn,
    pub(super) split: usize,
    pub(super) have: usize,
    pub(super) lane_have: usize,
}

pub(super) enum Outcome {
    /// Nothing more until the socket says so.
    Drained,
    /// Stopped with work left (inbox full, pool dry, a message deferred).
    Stopped,
    /// The connection ended: cleanly (the peer closed first) or not.
    Gone { clean: bool },
    /// The peer broke the protocol or the wire's rule.
    Bad(Error),
}

/// Reads into the stage, up to `room` bytes past its start: `Ok(true)` when
/// bytes came, `Ok(false)` when the socket is drained, `Err` at its end.
pub(super) fn read_stage(p: &mut Peer, room: usize) -> Result<bool, ()> {
    stage_ready(&mut p.stage, p.addr)?;
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
        // The system call itself (rustix): libc's `recv` is a cancellation
        // point, and its wrappers cost a 64 B message as much as the rest
        // of its read.
        match rustix::io::read(&p.stream, &mut p.stage[p.stage_end..end]) {
            Ok(0) => return Err(()),
            Ok(n) => {
                p.scan_bytes = p.scan_bytes.saturating_add(n);
                // Short: the socket had no more. Anything later raises a new
                // edge, except an end already reported (then read on to it).
                p.readable = p.stage_end + n == end || p.hup;
                p.stage_end += n;
                p.heard = true;
                return Ok(true);
            }
            Err(rustix::io::Errno::AGAIN) => {
                p.readable = false;
                return Ok(false);
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => return Err(()),
        }
    }
}

/// Gives a peer its stage before a read into it: its first read, or its
/// first since a quiet spell took the stage (see `Peer::quiet_scans`). Out
/// of memory for it, the peer goes (it alone).
fn stage_ready(stage: &mut Stage, addr: std::net::SocketAddr) -> Result<(), ()> {
    stage.ready().map_err(|e| {
        log::warn!("tcp: no stage for {addr} ({e}): dropped");
    })
}

/// Takes `stream` out of TCP's interactive mode, in which it delays its
/// ACKs: a large message after a run of replies waits on them (measured on
/// the 2-vCPU VM: striped 1 MiB streams after ping-pong, 0.89x of one
/// connection without this, 1.11x with it). The kernel leaves the mode again
/// at the next reply, so it is re-armed per large message. Best effort.
pub(super) fn quick_ack(stream: &TcpStream) {
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

impl TcpTransport {
    /// Takes what epoll says of `set` and notes it on the peers.
    pub(super) fn poll_set(&mut self, set: Set) -> bool {
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
            if r.key == WATCHED {
                self.watched = true;
                continue;
            }
            let (slot, what) = ((r.key >> 2) as usize, r.key & 3);
            if what == PENDING {
                self.handshake(slot);
            } else if let Some(p) = self.peers.at_mut(slot) {
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

    pub(super) fn mark_read(&mut self, slot: usize) {
        if let Some(p) = self.peers.at_mut(slot) {
            if !p.in_read {
                p.in_read = true;
                self.hot_read.push_back(slot);
            }
        }
    }

    pub(super) fn inbox_full(&self) -> bool {
        self.arrivals.len() >= self.config.inbox_messages
            || self.arrival_bytes >= self.config.inbox_bytes
    }

    pub(super) fn read_all(&mut self) -> bool {
        let before = self.arrivals.len();
        if self.pool_dry {
            // Before the look at the pool: a buffer back after it rings anew.
            if self.owns_bell {
                self.pool.bell().clear();
            }
            self.pool_dry = false;
        }
        for _ in 0..self.hot_read.len() {
            let full = self.inbox_full();
            let Some(slot) = self.hot_read.pop_front() else {
                break;
            };
            let Some(p) = self.peers.at_mut(slot) else {
                continue;
            };
            if full && !p.opening() {
                // Read once the application makes room, in its turn; a
                // peer still opening is read now (see `Peer::opening`).
                self.hot_read.push_back(slot);
                continue;
            }
            p.in_read = false;
            self.read_turn(slot);
        }
        self.arrivals.len() != before
    }

    /// One peer's turn at reading, and what follows from how it ended.
    pub(super) fn read_turn(&mut self, slot: usize) {
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

    pub(super) fn read_peer(&mut self, slot: usize) -> Outcome {
        let now = self.now();
        let id = self.id(slot);
        let (inbox, inbox_bytes) = (self.config.inbox_messages, self.config.inbox_bytes);
        let takes_offers = self.config.takes_offers;
        let Some(p) = self.peers.at_mut(slot) else {
            return Outcome::Drained;
        };
        let protocol = |error| Outcome::Bad(Error::Protocol { peer: id, error });
        let mut frames = 0;
        loop {
            if frames == FRAMES_PER_TURN
                || ((self.arrivals.len() >= inbox || self.arrival_bytes >= inbox_bytes)
                    && !p.opening())
            {
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
                    // For `DEFER_AT_MOST` at most: other peers' messages can
                    // keep the inbox from emptying for good.
                    let may_wait =
                        inc.d.len.saturating_sub(staged) >= DIRECT_MIN && !self.arrivals.is_empty();
                    let since = may_wait.then(|| *p.deferred_since.get_or_insert(now));
                    p.deferred = since.is_some_and(|since| now < since.after(DEFER_AT_MOST));
                    if p.deferred {
                        p.waits_for_budget = false;
                        return Outcome::Stopped;
                    }
                    // A payload still to come holds its buffer while it comes
                    // (the message's: a first fragment of several leaves the
                    // rest to come, however much of it is staged): within the
                    // bound on all such (see `coming_bytes`).
                    let lease_len = inc.d.msg_len.max(1);
                    let coming = if !inc.d.last || inc.d.len > staged {
                        lease_len
                    } else {
                        0
                    };
                    if coming > 0
                        && self.coming_bytes > 0
                        && self.coming_bytes + coming > self.coming_budget
                    {
                        p.dry = true;
                        p.waits_for_budget = true;
                        self.budget_wait_since.get_or_insert(now);
                        return Outcome::Stopped;
                    }
                    match Lease::take(Arc::clone(&self.pool), lease_len) {
                        Ok(mut l) => {
                            let _ = l.set_len(inc.d.msg_len);
                            p.lease = Some(l);
                            p.deferred_since = None;
                            p.dry = false;
                            p.waits_for_budget = false;
                            p.coming = coming;
                            self.coming_bytes += coming;
                        }
                        Err(e) => {
                            if !matches!(e, Error::Pool(_)) {
                                log::warn!("tcp: receive pool failed: {e}");
                            }
                            p.dry = true;
                            p.waits_for_budget = false; // for the pool now
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
                            // Bytes on either connection are news of the peer.
                            p.session.handle_activity(now, n, false);
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
                    // The message's progress (the stage's bytes were told
                    // as news of the peer only: headers and control frames
                    // are not progress).
                    p.session.handle_activity(now, take, false);
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
                    if stage_ready(&mut p.stage, p.addr).is_err() {
                        return Outcome::Gone { clean: false };
                    }
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
                            p.scan_bytes = p.scan_bytes.saturating_add(n);
                            inc.have += n.min(into_lease);
                            p.stage_end = n.saturating_sub(into_lease);
                            p.readable = n == into_lease + READ_AHEAD || p.hup;
                            p.session.handle_activity(now, n.min(into_lease), false);
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
                        self.coming_bytes -= std::mem::take(&mut p.coming);
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
                let header: &[u8; HEADER_LEN] = p.stage[p.stage_start..][..HEADER_LEN]
                    .try_into()
                    .expect("a header's length");
                if let Some(taken) = p.session.handle_short_record(now, header) {
                    // A whole message's header, in effect: its payload follows.
                    let d = match taken {
                        Ok(d) => d,
                        Err(e) => return protocol(e),
                    };
                    p.stage_start += HEADER_LEN;
                    frames += 1;
                    // A message whose payload is all staged (a small one,
                    // mostly) is leased, copied and handed on here, in one
                    // step: what step 1 would do on the next turn of the loop.
                    // A dry pool is met there, and a turn's last frame
                    // waits for the next turn as before.
                    if frames < FRAMES_PER_TURN
                        && d.first
                        && d.last
                        && d.len <= staged - HEADER_LEN
                        && d.len < QUICK_ACK_MIN
                        && p.lease.is_none()
                    {
                        if let Ok(mut lease) = Lease::take(Arc::clone(&self.pool), d.msg_len.max(1))
                        {
                            let _ = lease.set_len(d.msg_len);
                            let (at, end) = (p.stage_start, p.stage_start + d.len);
                            // One view of the lease: a view is a lookup in the pool's memory.
                            let payload =
                                &mut host_bytes_mut(&mut lease)[d.offset..d.offset + d.len];
                            payload.copy_from_slice(&p.stage[at..end]);
                            p.stage_start = end;
                            p.direct_stream = d.len >= DIRECT_MIN;
                            p.dry = false;
                            match p.session.handle_payload(now, Some(payload)) {
                                Ok(Some(done)) => {
                                    p.session.consumed(done.len);
                                    self.arrival_bytes += lease.len();
                                    self.arrivals.push_back(Ok(Received { peer: id, lease }));
                                }
                                Ok(None) => p.lease = Some(lease),
                                Err(e) => return protocol(e),
                            }
                            continue;
                        }
                    }
                    p.incoming = Some(Incoming {
                        d,
                        split: d.len,
                        have: 0,
                        lane_have: 0,
                    });
                    continue;
                }
                let inbound = match p.session.handle_header(now, header, None) {
                    Ok(i) => i,
                    Err(e) => return protocol(e),
                };
                p.stage_start += HEADER_LEN;
                match inbound {
                    Inbound::Data(d) => {
                        // A lane this side opened may not have had its ack
                        // read yet (the acceptor stripes as soon as it pairs):
                        // reading the lane's part reads the ack first, and a
                        // bad one loses the peer.
                        if d.striped && p.lane.is_none() {
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
                    Inbound::HostOffer(offer) => {
                        if takes_offers {
                            self.offers.push_back((id, offer));
                        } else {
                            p.session.answer_host(false); // sent by `control`
                        }
                    }
                    Inbound::HostAnswer { accepted } => {
                        self.answers.push_back((id, accepted));
                        if accepted {
                            // The session moved: this connection is done with, silently.
                            return Outcome::Gone { clean: true };
                        }
                    }
                    // A Want is answered by the timers, in turn, within the
                    // budget (`grant_in_turn`).
                    Inbound::Want => {
                        if !std::mem::replace(&mut p.asked, true) {
                            self.wants.push(counted_address(p.addr.ip()), id);
                        }
                    }
                    // Credit owed, a Close to answer: sent after this pass (`control`).
                    Inbound::Control | Inbound::Opened => {}
                }
                // An accepting side's peer whose exchange just settled (it
                // had no offer) is news before any of its messages.
                if p.token.is_some()
                    && !p.announced
                    && p.session.host_settled()
                    && !p.session.is_moved()
                {
                    p.announced = true;
                    self.accepted.push_back((id, p.addr));
                }
                frames += 1;
                continue;
            }
            // Only bytes are news of the peer: a spinning receiver looks at
            // the peer that delivered last on every poll, and a look that
            // finds nothing must not keep one stalled mid-header alive.
            // News only: a payload's bytes count toward its message's rate
            // as they are taken (1b), not as staged.
            if std::mem::take(&mut p.heard) {
                p.session.handle_activity(now, 0, staged > 0);
            }
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
}
