//! The receive side of a queue pair: its ring of posted receives, and what
//! a completion brings — a headerless message, a frame's header for the
//! engine, a fragment to reassemble — handed on to the application.

use std::collections::VecDeque;
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::Instant as StdInstant;

use rdma_sys as ffi;
use zerohop_core::session::{Inbound, Instant};
use zerohop_core::wire::HEADER_LEN;
use zerohop_core::{Error, Lease, PeerId, Received, SizeClasses};

use super::{Conn, RdmaTransport, POLL_BATCH, SEND_TAG, TIMER_SCAN};
use crate::host_bytes;
use crate::verbs::payload::{PayloadLease, PayloadMemory, PayloadPool};

impl<M: PayloadMemory> RdmaTransport<M> {
    /// A receive buffer's size: a whole frame where the header lands in the
    /// buffer too (host payloads, see `post_recv`), else one fragment.
    pub(super) fn receive_buffer_len(fragment: usize) -> usize {
        fragment + if M::HOST_VISIBLE { HEADER_LEN } else { 0 }
    }

    /// Posts a receive into ring slot `slot`. Host payloads take the whole
    /// frame into one buffer, header first (one scatter entry: in Soft-RoCE
    /// each entry is a lookup and a copy in the kernel); device payloads
    /// take the header into the host header ring and the payload into GPU
    /// memory, so the CPU never reads a header out of device memory.
    pub(super) fn post_recv(
        pool: &Arc<M::Pool>,
        fragment: usize,
        conn: &mut Conn<M>,
        slot: usize,
    ) -> Result<(), Error> {
        let lease = Lease::take(Arc::clone(pool), Self::receive_buffer_len(fragment))?;
        Self::post_lease(conn, slot, lease)
    }

    /// Posts `lease` (a receive buffer of the ring's size) into `slot`.
    fn post_lease(conn: &mut Conn<M>, slot: usize, lease: PayloadLease<M>) -> Result<(), Error> {
        let payload = ffi::ibv_sge {
            addr: lease.device_ptr(),
            length: lease.len() as u32,
            lkey: lease.lkey().unwrap_or(0),
        };
        let header = ffi::ibv_sge {
            addr: conn.headers.device_ptr() + (slot * HEADER_LEN) as u64,
            length: HEADER_LEN as u32,
            lkey: conn.headers.lkey().unwrap_or(0),
        };
        let mut sge = if M::HOST_VISIBLE {
            [payload, payload]
        } else {
            [header, payload]
        };
        // SAFETY: an all-zero recv WR is valid; the fields are set below.
        let mut wr: ffi::ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = slot as u64;
        wr.sg_list = sge.as_mut_ptr();
        wr.num_sge = if M::HOST_VISIBLE { 1 } else { 2 };
        // SAFETY: the SGEs name registered memory that stays leased (in
        // `conn.recv[slot]`, or the header ring) until this receive completes
        // or the QP, destroyed before both, is gone.
        unsafe { conn.qp.post_recv(&mut wr) }?;
        conn.recv[slot] = Some(lease);
        Ok(())
    }

    /// Posts fresh buffers into the receive slots that have none, until the
    /// pool runs dry (the rest wait for the next call), and tells the engine,
    /// which returns them to the peer as credit. A delivered message's slot
    /// is refilled here, at the caller's next call — after the reply it
    /// sends, for one that answers — so the lease and the post stay off the
    /// round trip's path. A peer that closed still sends credit frames for
    /// what this side is sending: the slots are posted until both closed.
    #[inline]
    pub(super) fn refill(pool: &Arc<M::Pool>, fragment: usize, conn: &mut Conn<M>) {
        conn.recv_dry = false;
        // Asked on every poll: most find every slot posted.
        if !conn.unposted.is_empty() {
            Self::post_unposted(pool, fragment, conn);
        }
    }

    fn post_unposted(pool: &Arc<M::Pool>, fragment: usize, conn: &mut Conn<M>) {
        if conn.session.is_finished() {
            return;
        }
        while let Some(&slot) = conn.unposted.last() {
            if Self::post_recv(pool, fragment, conn, slot as usize).is_err() {
                conn.recv_dry = true;
                break;
            }
            conn.unposted.pop();
            conn.session.reposted(1);
        }
    }

    pub(super) fn drain_cq(&mut self, conn: &mut Conn<M>, peer: PeerId) -> Result<usize, Error> {
        if !conn.held.is_empty() {
            self.release_held(conn, peer)?;
        }
        Self::refill(&self.recv_pool, self.config.fragment, conn);
        let mut wcs = [const { MaybeUninit::<ffi::ibv_wc>::uninit() }; POLL_BATCH];
        let n = conn.qp.cq().poll(&mut wcs)?;
        for wc in &wcs[..n] {
            // SAFETY: ibv_poll_cq wrote the first `n` completions.
            let wc = unsafe { wc.assume_init_ref() };
            if wc.status != ffi::ibv_wc_status::IBV_WC_SUCCESS {
                // A QP in error (retries exceeded, peer gone): flushed work
                // after the peer's clean close is expected.
                if conn.session.peer_closed()
                    && wc.status == ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR
                {
                    continue;
                }
                return Err(Error::PeerLost(peer));
            }
            if wc.wr_id & SEND_TAG != 0 {
                // The payload lease goes back to its pool.
                conn.send.completed((wc.wr_id & !SEND_TAG) as usize);
                continue;
            }
            if !conn.established {
                // A frame proves the connection (the RTU that raises our
                // ESTABLISHED may still be on its way): replies may go.
                conn.established = true;
                conn.qp.id().notify_established();
            }
            let imm = (wc.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0).then(|| {
                // SAFETY: the flag says the union holds the immediate data.
                u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })
            });
            self.received(conn, peer, wc.wr_id as usize, wc.byte_len as usize, imm)?;
        }
        Ok(n)
    }

    fn received(
        &mut self,
        conn: &mut Conn<M>,
        peer: PeerId,
        slot: usize,
        byte_len: usize,
        imm: Option<u32>,
    ) -> Result<(), Error> {
        let now = self.now();
        let mut lease = conn.recv[slot].take().ok_or(Error::Backend(
            "verbs: a completion for an empty receive slot",
        ))?;
        conn.unposted.push(slot as u32);
        let protocol = |error| Error::Protocol { peer, error };
        if let Some(imm) = imm {
            let done = conn
                .session
                .handle_headerless(now, byte_len, imm)
                .map_err(protocol)?;
            lease.set_len(done.len)?;
            return self.deliver(conn, peer, lease, done.len);
        }
        // Host payloads carry their header in front (see `post_recv`).
        let in_place = self.memory.host_view(&lease).is_some();
        let header = match self.memory.host_view(&lease) {
            Some(bytes) => &bytes[..HEADER_LEN.min(bytes.len())],
            None => &host_bytes(&conn.headers)[slot * HEADER_LEN..(slot + 1) * HEADER_LEN],
        };
        // Only what arrived: a frame shorter than a header would otherwise
        // be read against the stale bytes of the buffer's last frame.
        let header = &header[..byte_len.min(header.len())];
        let carried = Some(byte_len.saturating_sub(HEADER_LEN));
        let inbound = conn
            .session
            .handle_header(now, header, carried)
            .map_err(protocol)?;
        let d = match inbound {
            Inbound::Data(d) => d,
            _ => {
                // A control frame keeps nothing of its buffer: it goes
                // straight back into its slot, so the peer's control slots
                // never wait for a buffer the application holds (see
                // `CONTROL_SLOTS`).
                conn.unposted.pop();
                Self::post_lease(conn, slot, lease)?;
                conn.session.reposted(1);
                self.control(conn, peer, now, inbound);
                return Ok(());
            }
        };
        let skip = if in_place { HEADER_LEN } else { 0 };
        if d.first && d.last {
            // The payload follows its header in the buffer: handed on from there.
            lease.advance(skip)?;
            lease.set_len(d.len)?;
            let view = self.memory.host_view(&lease);
            conn.session.handle_payload(now, view).map_err(protocol)?;
            return self.deliver(conn, peer, lease, d.len);
        }
        if d.first && conn.held.is_empty() {
            conn.assembling = self.whole(Some(conn), None, Some(&lease), peer, d.msg_len, true)?;
        }
        if d.first && conn.assembling.is_none() {
            conn.held.push_back(Held::Fragments {
                len: d.msg_len,
                parts: Vec::new(),
                done: false,
            });
        }
        let last = conn
            .session
            .handle_payload(now, None)
            .map_err(protocol)?
            .is_some();
        if let Some(whole) = conn.assembling.as_mut() {
            self.memory.copy(whole, d.offset, &lease, skip, d.len)?;
            if last {
                let mut whole = conn.assembling.take().expect("assembling");
                whole.set_len(d.msg_len)?;
                return self.deliver(conn, peer, whole, d.msg_len);
            }
            return Ok(());
        }
        match conn.held.back_mut() {
            Some(Held::Fragments { parts, done, .. }) if !*done => {
                parts.push((lease, d.offset, skip, d.len));
                *done = last;
                Ok(())
            }
            _ => Err(Error::Backend("verbs: a fragment without its message")),
        }
    }

    /// A buffer for a whole message of `len` bytes, or `None` where the
    /// pool has none now but one can come back: where buffers that this
    /// wire's receive side does not hold (the application's, a send's, the
    /// arrival queue's) would serve it once given back, or free a chunk
    /// that would (`SlabPool::could_serve_later`). The message's fragments
    /// then wait in their receive buffers (see `Held`), the pool's bell
    /// waking the wire. Where only this wire's own buffers could, none ever
    /// comes: the connection fails now ([`Error::NoReceiveBuffer`]), not
    /// after a stall. The receive side's buffers are every connection's
    /// ring and what waits: `lent` (the connection being served, out of the
    /// table), `held` (a queue out of its place), `in_hand` (a buffer just
    /// taken out of its ring slot), the rest of the table and the queues of
    /// connections that went. Reading them all is judged at a message's
    /// `first` refusal, and then at most once a timer scan while it waits:
    /// the wire looks again at every receive call, a lease being cheap.
    fn whole(
        &mut self,
        lent: Option<&Conn<M>>,
        held: Option<&VecDeque<Held<M>>>,
        in_hand: Option<&PayloadLease<M>>,
        peer: PeerId,
        len: usize,
        first: bool,
    ) -> Result<Option<PayloadLease<M>>, Error> {
        let pool = Arc::clone(&self.recv_pool);
        let take = || Lease::take(Arc::clone(&pool), len.max(1));
        let why = match take() {
            Ok(whole) => return Ok(Some(whole)),
            Err(Error::Pool(why)) => why,
            Err(e) => return Err(e),
        };
        if !first {
            let now = StdInstant::now();
            if now < self.next_judge {
                return Ok(None);
            }
            self.next_judge = now + TIMER_SCAN;
        }
        let mut kept = Vec::new();
        let mut keep = |l: &PayloadLease<M>| kept.push(*l.ticket());
        let conns = lent.into_iter().chain(self.peers.iter().map(|(_, c)| &**c));
        for c in conns {
            c.recv.iter().flatten().for_each(&mut keep);
            c.held.iter().for_each(|h| h.leases(&mut keep));
        }
        let queues = held.into_iter().chain(self.orphans.iter().map(|(_, h)| h));
        for h in queues.flatten() {
            h.leases(&mut keep);
        }
        in_hand.into_iter().for_each(&mut keep);
        if pool.could_serve_later(len.max(1), &kept) {
            return Ok(None);
        }
        // None can come: one more look, for a buffer given back since.
        take()
            .map(Some)
            .map_err(|_| Error::NoReceiveBuffer { peer, len, why })
    }

    /// Hands on what waited for a buffer on a live connection (see `Held`),
    /// in order, as far as the pool now has buffers for it.
    pub(super) fn release_held(&mut self, conn: &mut Conn<M>, peer: PeerId) -> Result<(), Error> {
        let mut held = std::mem::take(&mut conn.held);
        let under_way = self.hand_on(&mut held, Some(conn), peer);
        conn.held = held;
        conn.assembling = under_way?;
        Ok(())
    }

    /// Hands on what connections that went left waiting (their outcome last).
    pub(super) fn release_orphans(&mut self) {
        for _ in 0..self.orphans.len() {
            let Some((peer, mut held)) = self.orphans.pop_front() else {
                break;
            };
            if let Err(e) = self.hand_on(&mut held, None, peer) {
                // No buffer can ever come: the rest is lost, and said so.
                held.clear();
                self.arrivals.push_back(Err(e));
            }
            if !held.is_empty() {
                self.orphans.push_back((peer, held));
            }
        }
    }

    /// Hands on the front of `held`, in order, as far as the pool has
    /// buffers for it. Returns the buffer of the message still under way
    /// (only the last held can be), its bytes so far copied in, once it has
    /// one. `conn`: the live connection, which returns each message's bytes
    /// to the peer as credit as it goes.
    fn hand_on(
        &mut self,
        held: &mut VecDeque<Held<M>>,
        mut conn: Option<&mut Conn<M>>,
        peer: PeerId,
    ) -> Result<Option<PayloadLease<M>>, Error> {
        while let Some(front) = held.front() {
            let &Held::Fragments { len, done, .. } = front else {
                if let Some(Held::Arrival(a)) = held.pop_front() {
                    if let (Ok(r), Some(c)) = (&a, conn.as_deref_mut()) {
                        c.session.consumed(r.lease.len());
                    }
                    self.arrivals.push_back(a);
                }
                continue;
            };
            let Some(mut whole) =
                self.whole(conn.as_deref(), Some(held), None, peer, len, false)?
            else {
                return Ok(None);
            };
            if let Some(Held::Fragments { parts, .. }) = held.pop_front() {
                for (part, at, skip, n) in parts {
                    self.memory.copy(&mut whole, at, &part, skip, n)?;
                }
            }
            if !done {
                return Ok(Some(whole));
            }
            whole.set_len(len)?;
            if let Some(c) = conn.as_deref_mut() {
                c.session.consumed(len);
            }
            self.arrivals.push_back(Ok(Received { peer, lease: whole }));
        }
        Ok(None)
    }

    /// What a control frame brings.
    fn control(&mut self, conn: &mut Conn<M>, peer: PeerId, now: Instant, inbound: Inbound) {
        match inbound {
            Inbound::Closed => arrive(
                &mut self.arrivals,
                &mut conn.held,
                Err(Error::PeerClosed(peer)),
            ),
            // The receive pool's budget is what a grant can cost.
            Inbound::Want => conn.session.grant(now),
            Inbound::Opened => {
                if let (true, Some(addr)) = (conn.accepted, conn.addr) {
                    self.accepted.push_back((peer, addr));
                }
            }
            // Without the same-host exchange (`HostRole::None`) the engine
            // refuses Host frames itself: these never come.
            Inbound::Control
            | Inbound::Data(_)
            | Inbound::HostOffer(_)
            | Inbound::HostAnswer { .. } => {}
        }
    }

    /// Hands a whole message to the application; its bytes come back to the
    /// peer as credit (the arrival queue is the application's). Behind a
    /// message that waits for a buffer it waits too, its bytes not yet
    /// returned: a peer stops at its window while this side holds it back.
    fn deliver(
        &mut self,
        conn: &mut Conn<M>,
        peer: PeerId,
        lease: PayloadLease<M>,
        len: usize,
    ) -> Result<(), Error> {
        if conn.held.is_empty() {
            conn.session.consumed(len);
        }
        arrive(
            &mut self.arrivals,
            &mut conn.held,
            Ok(Received { peer, lease }),
        );
        Ok(())
    }
}

/// Queues what the application is to learn of a connection (a message, its
/// Close, how it ended), behind what waits for a buffer (`held`) if any.
pub(super) fn arrive<M: PayloadMemory>(
    arrivals: &mut VecDeque<Result<Received<PayloadLease<M>>, Error>>,
    held: &mut VecDeque<Held<M>>,
    a: Result<Received<PayloadLease<M>>, Error>,
) {
    match held.is_empty() {
        true => arrivals.push_back(a),
        false => held.push_back(Held::Arrival(a)),
    }
}

/// What a connection cannot hand on yet because a message ahead of it had
/// no buffer: the receive pool was dry (the application holds its buffers)
/// when the message's first fragment came. Its fragments wait in the
/// receive buffers they landed in, and whatever comes after it waits
/// behind it, in order. The engine takes every frame meanwhile, so credit
/// and control frames keep moving; what waits is not returned to the peer
/// as credit until it is handed on. A connection that goes leaves its
/// queue, its outcome last, to be handed on still (the transport's
/// `orphans`).
pub(super) enum Held<M: PayloadMemory> {
    /// A message of `len` bytes: its fragments so far, each (receive buffer,
    /// offset in the message, offset in the buffer, length); `done` once the
    /// last came.
    Fragments {
        len: usize,
        parts: Vec<(PayloadLease<M>, usize, usize, usize)>,
        done: bool,
    },
    /// A whole message behind it, the peer's Close, or how its connection ended.
    Arrival(Result<Received<PayloadLease<M>>, Error>),
}

impl<M: PayloadMemory> Held<M> {
    /// Calls `f` on each pool buffer it holds.
    fn leases(&self, f: &mut impl FnMut(&PayloadLease<M>)) {
        match self {
            Held::Fragments { parts, .. } => parts.iter().for_each(|(l, ..)| f(l)),
            Held::Arrival(Ok(r)) => f(&r.lease),
            Held::Arrival(Err(_)) => {}
        }
    }
}

/// The default buffer sizes with one of exactly `frame` bytes among them: the
/// receive ring's buffers, filled to the byte by a full frame.
pub(super) fn receive_classes(frame: usize) -> Result<SizeClasses, Error> {
    let mut sizes = [0usize; zerohop_core::pool::MAX_CLASSES];
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

#[cfg(test)]
mod tests {
    use super::receive_classes;

    #[test]
    fn receive_classes_hold_a_whole_frame_exactly() {
        let c = |f| receive_classes(f).unwrap().as_slice().to_vec();
        let k = 1 << 10;
        assert_eq!(
            c(64 * k + 32),
            [256, k, 4 * k, 16 * k, 64 * k, 64 * k + 32, 256 * k, 1 << 20]
        );
        assert_eq!(
            c(64 * k),
            [256, k, 4 * k, 16 * k, 64 * k, 256 * k, 1 << 20],
            "no duplicate"
        );
        assert_eq!(
            c(100),
            [100, 256, k, 4 * k, 16 * k, 64 * k, 256 * k, 1 << 20]
        );
        assert_eq!(
            c(4 << 20),
            [256, k, 4 * k, 16 * k, 64 * k, 256 * k, 1 << 20, 4 << 20]
        );
    }
}
