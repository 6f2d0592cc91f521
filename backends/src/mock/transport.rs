//! A [`Transport`] over a [`Link`], receiving into a host pool (a [`HostPool`](crate::HostPool), or a `LocalPool` in front of one).

use core::ops::Deref;

use zerohop_core::wire_v1::{Flags, FrameKind, Header, HEADER_LEN};
use zerohop_core::{
    Access, Capabilities, Error, Kind, Lease, PeerId, Pool, Received, Rejected, Transport,
};

use super::link::Link;
use super::nic::MockNic;
use crate::host::{host_bytes, host_bytes_mut, HostBacked};

/// The only peer on a point-to-point link.
const PEER: PeerId = PeerId(0);

/// One side of a point-to-point mock connection. Every frame is checksummed
/// over its payload and sequenced, so the faults a [`Faulty`](super::Faulty)
/// link injects surface as typed errors: `Corrupt`, `SequenceGap`, `Duplicate`.
#[derive(Debug)]
pub struct MockTransport<L, P>
where
    P: Deref,
    P::Target: Pool,
{
    link: L,
    pool: P,
    nic: Option<&'static MockNic>,
    tx_seq: u64,
    rx_next: u64,
    max_message: usize,
    /// A message that arrived after a gap: the gap is reported first, then this.
    held: Option<(u64, Lease<P>)>,
    closed: bool,
    peer_closed: bool,
}

impl<L, P> MockTransport<L, P>
where
    L: Link,
    P: Deref<Target: HostBacked> + Clone,
{
    /// The pool messages arrive in (and zero-copy sends may leave from).
    pub fn pool(&self) -> &P {
        &self.pool
    }

    /// A transport over `link` receiving into `pool`; messages up to `max_message` bytes.
    pub fn new(link: L, pool: P, max_message: usize) -> Self {
        MockTransport {
            link,
            pool,
            nic: None,
            tx_seq: 0,
            rx_next: 0,
            max_message,
            held: None,
            closed: false,
            peer_closed: false,
        }
    }

    /// Checks every zero-copy send's lkey against `nic`, as a real NIC would.
    pub fn with_nic(mut self, nic: &'static MockNic) -> Self {
        self.nic = Some(nic);
        self
    }

    /// The link (to reach a fault injector's counters).
    pub fn link(&self) -> &L {
        &self.link
    }

    /// The link, mutably (to change a fault plan).
    pub fn link_mut(&mut self) -> &mut L {
        &mut self.link
    }

    fn send_frame(&mut self, payload: &[u8]) -> Result<(), Error> {
        if self.closed {
            return Err(Error::Closed);
        }
        if payload.len() > self.max_message {
            return Err(Error::TooLarge {
                len: payload.len(),
                max: self.max_message,
            });
        }
        let h = Header::data(0, 0, self.tx_seq, payload, true, Flags::NONE);
        self.link.transmit(&h.encode(), payload)?;
        self.tx_seq += 1;
        Ok(())
    }

    /// Reads the frame at the head of the link into a fresh lease.
    fn receive_frame(
        &mut self,
        header: [u8; HEADER_LEN],
        carried: usize,
    ) -> Result<Option<(u64, Lease<P>)>, Error> {
        let h = match Header::decode(&header, self.max_message) {
            Ok(h) => h,
            Err(e) => {
                self.link.discard();
                return Err(e.into());
            }
        };
        match h.kind {
            FrameKind::Data => {}
            FrameKind::Close => {
                self.link.discard();
                self.peer_closed = true;
                // A close carries the sender's next sequence number, so a lost
                // tail is reported too.
                if h.seq > self.rx_next {
                    let expected = self.rx_next;
                    self.rx_next = h.seq;
                    return Err(Error::SequenceGap {
                        peer: PEER,
                        expected,
                        got: h.seq,
                    });
                }
                return Ok(None);
            }
            FrameKind::Hello | FrameKind::Credit => {
                self.link.discard();
                return Ok(None);
            }
        }
        if carried != h.len as usize {
            self.link.discard();
            return Err(Error::Corrupt(PEER));
        }
        // Leave the frame queued when the pool is dry: that is back-pressure,
        // and the typed error tells the caller why nothing arrives.
        let mut lease = Lease::take(self.pool.clone(), carried.max(1))?;
        lease.set_len(carried)?;
        self.link.take(host_bytes_mut(&mut lease));
        if h.verify(host_bytes(&lease)).is_err() {
            return Err(Error::Corrupt(PEER));
        }
        Ok(Some((h.seq, lease)))
    }
}

impl<L, P> Transport for MockTransport<L, P>
where
    L: Link,
    P: Deref<Target: HostBacked> + Clone,
{
    type Lease = Lease<P>;

    fn kind(&self) -> Kind {
        Kind::Mock
    }

    fn caps(&self) -> Capabilities {
        Capabilities::new(false, true, 0)
    }

    fn try_send(&mut self, peer: PeerId, bytes: &[u8]) -> Result<(), Error> {
        if peer != PEER {
            return Err(Error::UnknownPeer(peer));
        }
        self.send_frame(bytes)
    }

    fn try_send_lease(
        &mut self,
        peer: PeerId,
        lease: Self::Lease,
    ) -> Result<(), Rejected<Self::Lease>> {
        if peer != PEER {
            return Err(Rejected {
                error: Error::UnknownPeer(peer),
                lease,
            });
        }
        if let (Some(nic), Some(mr)) = (self.nic, lease.mr()) {
            let r = lease.region();
            if let Err(error) = nic.check(mr.lkey, r.addr, r.len, Access::NONE) {
                return Err(Rejected { error, lease });
            }
        }
        match self.send_frame(host_bytes(&lease)) {
            Ok(()) => Ok(()),
            Err(error) => Err(Rejected { error, lease }),
        }
    }

    fn try_recv(&mut self) -> Result<Received<Self::Lease>, Error> {
        if let Some((seq, lease)) = self.held.take() {
            self.rx_next = seq + 1;
            return Ok(Received { peer: PEER, lease });
        }
        loop {
            let Some((header, carried)) = self.link.peek() else {
                return Err(if self.peer_closed {
                    Error::Closed
                } else {
                    Error::WouldBlock
                });
            };
            let Some((seq, lease)) = self.receive_frame(header, carried)? else {
                continue;
            };
            if seq < self.rx_next {
                return Err(Error::Duplicate { peer: PEER, seq });
            }
            if seq > self.rx_next {
                let expected = self.rx_next;
                self.held = Some((seq, lease));
                return Err(Error::SequenceGap {
                    peer: PEER,
                    expected,
                    got: seq,
                });
            }
            self.rx_next = seq + 1;
            return Ok(Received { peer: PEER, lease });
        }
    }

    fn progress(&mut self) -> Result<bool, Error> {
        Ok(false)
    }

    fn close(&mut self) -> Result<(), Error> {
        if !self.closed {
            self.closed = true;
            let h = Header::control(FrameKind::Close, 0, 0, self.tx_seq);
            // Best effort: a full ring means the peer learns of the close when it drains.
            let _ = self.link.transmit(&h.encode(), &[]);
        }
        Ok(())
    }
}
