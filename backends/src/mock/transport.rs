//! A [`Transport`] over a [`Link`], receiving into a host pool (a [`HostPool`](crate::HostPool), or a `LocalPool` in front of one).
//!
//! A driver of core's [session engine](zerohop_core::session) and nothing
//! more: it moves the engine's frames through the link and the payloads
//! into pool leases. The protocol — Hello, sequence numbers, credit, Close,
//! what a fault means — is the engine's, as on every other wire.

use core::ops::Deref;

use zerohop_core::session::{DataIn, Inbound, Instant, Session, SessionConfig};
use zerohop_core::wire::{DataFlags, HEADER_LEN};
use zerohop_core::{
    Access, Capabilities, Error, Kind, Lease, PeerId, Pool, Received, Rejected, Transport,
};

use super::link::Link;
use super::nic::MockNic;
use crate::host::{host_bytes, host_bytes_mut, HostBacked};

/// The only peer on a point-to-point link.
const PEER: PeerId = PeerId(0);

/// How the peer ended, until the application has been told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// Told: the link is done.
    Reported,
    /// To tell.
    Pending(Error),
}

/// One side of a point-to-point mock connection. Every frame is checksummed
/// over its payload, so the faults a [`Faulty`](super::Faulty) link injects
/// fail the session with a typed [`Error::Protocol`]; nothing after the fault
/// is delivered.
#[derive(Debug)]
pub struct MockTransport<L, P>
where
    P: Deref,
    P::Target: Pool,
{
    link: L,
    pool: P,
    nic: Option<&'static MockNic>,
    session: Session,
    now: Instant,
    /// A data frame whose header the engine took; its payload waits in the
    /// link until a buffer is leased for it.
    incoming: Option<DataIn>,
    /// The message being reassembled.
    assembling: Option<Lease<P>>,
    end: Option<End>,
}

impl<L, P> MockTransport<L, P>
where
    L: Link,
    P: Deref<Target: HostBacked> + Clone,
{
    /// A transport over `link` receiving into `pool`; messages up to
    /// `max_message` bytes, every payload checksummed. Its Hello goes out at once.
    pub fn new(link: L, pool: P, max_message: usize) -> Self {
        let max = u32::try_from(max_message).unwrap_or(u32::MAX);
        let config = SessionConfig {
            check_payload: true,
            ..SessionConfig::stream(max)
        };
        Self::with_config(link, pool, config)
    }

    /// A transport whose session takes `config` (a window, a timeout).
    pub fn with_config(link: L, pool: P, config: SessionConfig) -> Self {
        let mut t = MockTransport {
            link,
            pool,
            nic: None,
            session: Session::new(config, 0, Instant::default()),
            now: Instant::default(),
            incoming: None,
            assembling: None,
            end: None,
        };
        t.send_control();
        t
    }

    /// Checks every zero-copy send's lkey against `nic`, as a real NIC would.
    pub fn with_nic(mut self, nic: &'static MockNic) -> Self {
        self.nic = Some(nic);
        self
    }

    /// The pool messages arrive in (and zero-copy sends may leave from).
    pub fn pool(&self) -> &P {
        &self.pool
    }

    /// The link (to reach a fault injector's counters).
    pub fn link(&self) -> &L {
        &self.link
    }

    /// The link, mutably (to change a fault plan).
    pub fn link_mut(&mut self) -> &mut L {
        &mut self.link
    }

    /// The engine (for its state in tests).
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Puts `frame` (a header and its payload) on the link as it is,
    /// bypassing the engine: what a broken peer sends, for tests.
    pub fn send_raw_frame(&mut self, frame: &[u8]) -> Result<(), Error> {
        let (h, payload) = frame.split_at(HEADER_LEN.min(frame.len()));
        let header: [u8; HEADER_LEN] = h
            .try_into()
            .map_err(|_| Error::BadConfig("a frame is at least a header"))?;
        self.link.transmit(&header, payload)
    }

    /// Moves this side's clock (the mock has none): the engine's idle timer
    /// runs on it.
    pub fn set_now(&mut self, now: Instant) {
        self.now = now;
    }

    /// Sends the control frames that are due, while the link has room.
    fn send_control(&mut self) -> bool {
        let mut any = false;
        while self.link.room().is_some() {
            let Some(c) = self.session.poll_control() else {
                break;
            };
            // Room for a header was checked: this cannot be refused.
            let _ = self.link.transmit(&c.header, &[]);
            any = true;
        }
        any
    }

    /// Takes control frames at the head of the link (the peer's Hello,
    /// credit), so a sender that never receives still opens and gets credit.
    fn take_control(&mut self) {
        while self.end.is_none() && self.incoming.is_none() {
            let Some((header, carried)) = self.link.peek() else {
                return;
            };
            if header[3] == zerohop_core::wire::FrameKind::Data as u8 {
                return; // the application's, through try_recv
            }
            if let Err(e) = self.take_header(header, carried) {
                self.end = Some(End::Pending(e)); // told at the next try_recv
                return;
            }
        }
    }

    /// Hands one header to the engine; control frames leave the link here.
    fn take_header(&mut self, header: [u8; HEADER_LEN], carried: usize) -> Result<(), Error> {
        match self.session.handle_header(self.now, &header, Some(carried)) {
            Ok(Inbound::Data(d)) => {
                self.incoming = Some(d);
                Ok(())
            }
            Ok(Inbound::Closed) => {
                self.link.discard();
                self.end = Some(End::Pending(Error::PeerClosed(PEER)));
                Ok(())
            }
            Ok(inbound) => {
                self.link.discard();
                if inbound == Inbound::Want {
                    // One peer, one pool: the pool's budget is the bound.
                    self.session.grant(self.now);
                }
                Ok(())
            }
            Err(error) => {
                self.link.discard();
                Err(self.fail(Error::Protocol { peer: PEER, error }))
            }
        }
    }

    fn fail(&mut self, e: Error) -> Error {
        self.end = Some(End::Reported);
        self.incoming = None;
        self.assembling = None;
        e
    }

    /// Lands the payload of the frame whose header the engine took.
    fn take_payload(&mut self, d: DataIn) -> Result<Option<Lease<P>>, Error> {
        if d.first {
            // A dry pool leaves the frame in the link: back-pressure, and
            // the typed error tells the caller why nothing arrives.
            let mut lease = Lease::take(self.pool.clone(), d.msg_len.max(1))?;
            lease.set_len(d.msg_len)?;
            self.assembling = Some(lease);
        }
        self.incoming = None;
        let Some(lease) = self.assembling.as_mut() else {
            return Err(self.fail(Error::Backend("mock: a fragment without its message")));
        };
        let at = &mut host_bytes_mut(lease)[d.offset..d.offset + d.len];
        self.link.take(at);
        match self.session.handle_payload(self.now, Some(at)) {
            Ok(Some(done)) => {
                self.session.consumed(done.len);
                Ok(self.assembling.take())
            }
            Ok(None) => Ok(None),
            Err(error) => Err(self.fail(Error::Protocol { peer: PEER, error })),
        }
    }

    fn send_bytes(&mut self, bytes: &[u8]) -> Result<(), Error> {
        if self.end == Some(End::Reported) {
            return Err(Error::UnknownPeer(PEER));
        }
        self.take_control();
        self.send_control();
        // The whole frame must fit now: a message the engine started must go.
        if self.link.room().is_none_or(|room| room < bytes.len()) {
            return Err(Error::WouldBlock);
        }
        let mut out = self
            .session
            .send(bytes.len())
            .map_err(|e| e.to_error(PEER))?;
        // One frame: the peer takes messages whole (a stream configuration).
        while let Some(f) = self
            .session
            .next_frame(&mut out, Some(bytes), DataFlags::NONE)
        {
            let Some(header) = f.header else {
                return Err(Error::Backend("mock: a headerless frame"));
            };
            self.link
                .transmit(&header, &bytes[f.offset..f.offset + f.len])?;
        }
        self.send_control();
        Ok(())
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
        self.send_bytes(bytes)
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
        if let (Some(nic), Some(lkey)) = (self.nic, lease.lkey()) {
            let r = lease.region();
            if let Err(error) = nic.check(lkey, r.addr, r.len, Access::NONE) {
                return Err(Rejected { error, lease });
            }
        }
        match self.send_bytes(host_bytes(&lease)) {
            Ok(()) => Ok(()),
            Err(error) => Err(Rejected { error, lease }),
        }
    }

    fn try_recv(&mut self) -> Result<Received<Self::Lease>, Error> {
        loop {
            match self.end {
                Some(End::Reported) => return Err(Error::Closed),
                Some(End::Pending(e)) => {
                    self.end = Some(End::Reported);
                    self.send_control(); // a clean close is answered with ours
                    return Err(e);
                }
                None => {}
            }
            if let Err(error) = self.session.handle_timeout(self.now) {
                return Err(self.fail(Error::Protocol { peer: PEER, error }));
            }
            self.send_control();
            if let Some(d) = self.incoming {
                match self.take_payload(d)? {
                    Some(lease) => return Ok(Received { peer: PEER, lease }),
                    None => continue,
                }
            }
            let Some((header, carried)) = self.link.peek() else {
                // An empty link whose other end dropped without its Close.
                if self.link.peer_gone() && !self.session.peer_closed() {
                    return Err(self.fail(Error::PeerLost(PEER)));
                }
                return Err(Error::WouldBlock);
            };
            self.take_header(header, carried)?;
        }
    }

    fn progress(&mut self) -> Result<bool, Error> {
        self.take_control();
        Ok(self.send_control())
    }

    fn close(&mut self) -> Result<(), Error> {
        self.session.close();
        // A full ring means the peer learns of the close when it drains.
        self.send_control();
        Ok(())
    }
}
