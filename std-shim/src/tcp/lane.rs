//! A peer's second connection, its *lane*: the rest of each striped
//! payload, in message order, and nothing else (see the module docs above).

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant as StdInstant};

use zerohop_backends::counted_address;
use zerohop_core::wire::{Frame, Hello, Takes, HEADER_LEN};
use zerohop_core::PeerId;

use super::{key, TcpTransport, LANE, UNCLAIMED_LANES, UNCLAIMED_PER_ADDRESS};
use crate::poller::Set;
use crate::waiting_room::oldest_of_most_crowded;

/// Payload bytes of a striped message that travel on the main connection:
/// half, rounded down to a page. Both sides compute it from the length.
pub(super) fn stripe_split(len: usize) -> usize {
    (len / 2) & !4095
}

/// A peer's second connection (the rest of striped payloads, in order).
pub(super) struct Lane {
    pub(super) stream: TcpStream,
    pub(super) token: u32,
    /// Where it came from (accepting side): it pairs only with a main
    /// connection from the same address, so a stranger must be there as
    /// well as guess the 32-bit token.
    pub(super) from: IpAddr,
    /// The acceptor paired it (connecting side: its ack has been read).
    pub(super) confirmed: bool,
    pub(super) ack: [u8; HEADER_LEN],
    pub(super) ack_have: usize,
    /// Bytes read with its Hello that belong to the first striped payload.
    pub(super) early: Vec<u8>,
}

impl Lane {
    /// Reads what has arrived of the acceptor's ack: `Ok(true)` once it is
    /// in and names this lane's token.
    pub(super) fn confirm(&mut self) -> io::Result<bool> {
        while !self.confirmed {
            match self.stream.read(&mut self.ack[self.ack_have..]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => self.ack_have += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
            if self.ack_have == HEADER_LEN {
                self.confirmed = matches!(Frame::decode(&self.ack, 0).map(|d| d.frame),
                    Ok(Frame::Hello(h)) if h.lane == 1 && h.token == self.token);
                if !self.confirmed {
                    return Err(io::ErrorKind::InvalidData.into());
                }
            }
        }
        Ok(true)
    }

    /// Whether it is the lane of a main connection from `addr` whose Hello
    /// carried `token`.
    pub(super) fn fits(&self, token: Option<u32>, addr: SocketAddr) -> bool {
        token == Some(self.token) && addr.ip().to_canonical() == self.from.to_canonical()
    }

    /// Reads into `dst`, the ack and the early bytes first.
    pub(super) fn read(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        self.confirm()?;
        if !self.early.is_empty() {
            let n = self.early.len().min(dst.len());
            dst[..n].copy_from_slice(&self.early[..n]);
            self.early.drain(..n);
            return Ok(n);
        }
        self.stream.read(dst)
    }
}

pub(super) fn lane_hello(token: u32) -> [u8; HEADER_LEN] {
    Frame::Hello(Hello {
        window: 0,
        max_message: 0,
        frame_max: 0,
        ring: 0,
        lane: 1,
        takes: Takes::NONE,
        token,
    })
    .encode(&[])
}

/// Opens a peer's lane and says its Hello (the first bytes on a fresh
/// connection: the socket takes them whole).
pub(super) fn dial_lane(addr: SocketAddr, timeout: Duration, token: u32) -> io::Result<TcpStream> {
    let mut lane = TcpStream::connect_timeout(&addr, timeout)?;
    lane.set_nodelay(true)?;
    lane.write_all(&lane_hello(token))?;
    Ok(lane)
}

impl TcpTransport {
    /// Gives a dialed lane (see [`dial_lane`]) to peer `id`, whose main
    /// connection it will be paired with on the other side.
    pub(super) fn add_lane(&mut self, id: PeerId, lane: TcpStream, token: u32) -> io::Result<()> {
        lane.set_nonblocking(true)?;
        let slot = self.peers.slot(id).ok_or(io::ErrorKind::NotConnected)?;
        self.poller
            .add(&lane, Set::Data, key(slot, LANE), true, false)?;
        self.poller
            .add(&lane, Set::Ctl, key(slot, LANE), false, true)?;
        let p = self.peer_mut(id).map_err(|_| io::ErrorKind::NotConnected)?;
        p.lane = Some(Lane {
            stream: lane,
            token,
            from: p.addr.ip(),
            confirmed: false,
            ack: [0; HEADER_LEN],
            ack_have: 0,
            early: Vec::new(),
        });
        Ok(())
    }

    /// A lane said Hello: joins its peer (by token) or waits for it.
    pub(super) fn pair(&mut self, lane: Lane) {
        let found = self
            .peers
            .iter()
            .find(|(_, p)| lane.fits(p.token, p.addr) && p.lane.is_none())
            .map(|(slot, _)| slot);
        if found.is_none() {
            if let Some((_, p)) = self.peers.iter().find(|(_, p)| p.token == Some(lane.token)) {
                // A client whose connections leave from two addresses (a NAT
                // pool) loses striping, not its messages: say why.
                log::info!(
                    "tcp: a second connection from {} names the token of {}: not paired (another address)",
                    lane.from,
                    p.addr
                );
            }
        }
        match found {
            Some(slot) => {
                let id = self.id(slot);
                self.attach_lane(id, lane);
            }
            None => {
                let waiting = &self.unclaimed;
                let from = counted_address(lane.from);
                let own = |(l, _): &(Lane, StdInstant)| counted_address(l.from) == from;
                // Its own address's oldest past the address's bound; past
                // the overall bound, the oldest of the address with the most.
                let replaced = if waiting.iter().filter(|w| own(w)).count() >= UNCLAIMED_PER_ADDRESS
                {
                    waiting.iter().position(own)
                } else if waiting.len() >= UNCLAIMED_LANES {
                    let all = waiting.iter().enumerate();
                    oldest_of_most_crowded(
                        all.map(|(i, (l, since))| (i, counted_address(l.from), *since)),
                    )
                } else {
                    None
                };
                if let Some(k) = replaced {
                    self.unclaimed.remove(k);
                }
                self.unclaimed.push_back((lane, StdInstant::now()));
            }
        }
    }

    /// Acks `lane` (accepting side) and gives it to `id`.
    pub(super) fn attach_lane(&mut self, id: PeerId, mut lane: Lane) {
        let Some(slot) = self.peers.slot(id) else {
            return;
        };
        // Watched first, acked last: once acked, the peer stripes over it.
        // (A lane dropped after its adds leaves epoll as its socket closes.)
        // The first bytes this way on a fresh connection: the socket takes them whole.
        let ok = self
            .poller
            .add(&lane.stream, Set::Data, key(slot, LANE), true, false)
            .is_ok()
            && self
                .poller
                .add(&lane.stream, Set::Ctl, key(slot, LANE), false, true)
                .is_ok()
            && lane.stream.write_all(&lane_hello(lane.token)).is_ok();
        if let (true, Ok(p)) = (ok, self.peer_mut(id)) {
            p.lane = Some(lane);
            self.mark_read(slot);
        }
    }
}
