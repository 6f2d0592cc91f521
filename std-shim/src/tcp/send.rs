//! Sending: a message straight to the socket when nothing is ahead of it,
//! queued for what the kernel did not take; the engine's control frames.

use std::io::{self, IoSlice};
use std::net::TcpStream;

use zerohop_backends::host_bytes;
use zerohop_core::wire::{DataFlags, Decoded, Frame, FrameKind, ShortRecord, HEADER_LEN};
use zerohop_core::{Error, PeerId};

use super::{lane::stripe_split, TcpTransport};
use crate::host::{StdLease, QUEUED_MESSAGES};

pub(super) enum Payload {
    None,
    Owned(Vec<u8>),
    Leased(StdLease),
}

impl Payload {
    pub(super) fn bytes(&self) -> &[u8] {
        match self {
            Payload::None => &[],
            Payload::Owned(v) => v,
            Payload::Leased(l) => host_bytes(l),
        }
    }
}

/// What a send writes from: the caller's bytes (copied only if queued) or a lease.
pub(super) enum Source<'a> {
    Slice(&'a [u8]),
    Lease(StdLease),
}

impl Source<'_> {
    pub(super) fn bytes(&self) -> &[u8] {
        match self {
            Source::Slice(b) => b,
            Source::Lease(l) => host_bytes(l),
        }
    }
}

/// How far a frame has gone out: on the main connection, and on the lane.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Sent {
    pub(super) main: usize,
    pub(super) lane: usize,
}

pub(super) struct Out {
    pub(super) header: [u8; HEADER_LEN],
    pub(super) payload: Payload,
    /// Payload bytes on the main connection (all of them unless striped).
    pub(super) split: usize,
    pub(super) sent: Sent,
    /// A credit frame (see [`TcpTransport::control`]).
    pub(super) credit: bool,
}

/// A frame written straight from a blocked caller's slice (see
/// [`Wire::start_send`]): the caller passes the same bytes on every call.
pub(super) struct Direct {
    pub(super) header: [u8; HEADER_LEN],
    pub(super) split: usize,
    pub(super) sent: Sent,
}

/// Two credit headers this side encoded, `earlier` then `later`, as one.
fn fold_credit(earlier: &[u8; HEADER_LEN], later: &[u8; HEADER_LEN]) -> Option<[u8; HEADER_LEN]> {
    match (Frame::decode(earlier, 0), Frame::decode(later, 0)) {
        (
            Ok(Decoded {
                frame: Frame::Credit(a),
                ..
            }),
            Ok(Decoded {
                frame: Frame::Credit(b),
                ..
            }),
        ) => Some(Frame::Credit(a.then(b)).encode(&[])),
        _ => None,
    }
}

/// Writes as much of a frame as the sockets take: `header` and
/// `payload[..split]` on the main connection, the rest on `lane`.
/// `Ok(true)` when all of it went.
pub(super) fn write_frame(
    stream: &mut TcpStream,
    lane: Option<&mut TcpStream>,
    header: &[u8; HEADER_LEN],
    payload: &[u8],
    split: usize,
    sent: &mut Sent,
) -> io::Result<bool> {
    let (first, rest) = payload.split_at(split);
    let main_done = write_part(stream, header, first, &mut sent.main)?;
    let lane_done = match lane {
        _ if sent.lane == rest.len() => true,
        Some(l) => write_part(l, &[], rest, &mut sent.lane)?,
        None => return Err(io::ErrorKind::NotConnected.into()),
    };
    Ok(main_done && lane_done)
}

/// Writes what `stream` takes of `head` then `body`, `written` bytes of
/// them already sent; `Ok(true)` when all of it went.
pub(super) fn write_part(
    stream: &mut TcpStream,
    head: &[u8],
    body: &[u8],
    written: &mut usize,
) -> io::Result<bool> {
    let total = head.len() + body.len();
    while *written < total {
        // The system calls themselves (rustix), as `read_stage` reads, and
        // without SIGPIPE: a peer gone is an error, not a signal to a host
        // application that may not ignore it.
        use rustix::net::{send, sendmsg, SendAncillaryBuffer, SendFlags};
        let res = if *written < head.len() {
            let parts = [IoSlice::new(&head[*written..]), IoSlice::new(body)];
            sendmsg(
                &*stream,
                &parts,
                &mut SendAncillaryBuffer::default(),
                SendFlags::NOSIGNAL,
            )
        } else {
            send(
                &*stream,
                &body[*written - head.len()..],
                SendFlags::NOSIGNAL,
            )
        };
        match res {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => *written += n,
            Err(rustix::io::Errno::AGAIN) => return Ok(false),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(true)
}

impl TcpTransport {
    /// Starts a message for `peer` and writes it at once when nothing is
    /// ahead of it; what the kernel did not take is queued (a slice copied
    /// only then) or, with `direct`, left for the caller to write from its
    /// slice ([`Wire::continue_send`]): then `Ok(false)`. A refused source
    /// comes back with the error.
    #[allow(clippy::result_large_err)]
    pub(super) fn send_frame<'a>(
        &mut self,
        peer: PeerId,
        src: Source<'a>,
        direct: bool,
    ) -> Result<bool, (Error, Source<'a>)> {
        if self.closed {
            return Err((Error::Closed, src));
        }
        let (limit, check, stripe_min) = (
            self.config.send_queue_bytes,
            self.config.check_payload,
            self.config.stripe_min,
        );
        // The longest message is the receiver's to say (the engine holds
        // it to the peer's Hello); `max_message` is what this side takes.
        let len = src.bytes().len();
        let Some((slot, p)) = self.peers.find_mut(peer) else {
            return Err((Error::UnknownPeer(peer), src));
        };
        if p.queued_bytes > 0
            && (p.queued_bytes + HEADER_LEN + len > limit || p.queue.len() >= QUEUED_MESSAGES)
        {
            return Err((Error::WouldBlock, src));
        }
        let mut out = match p.session.send(len) {
            Ok(out) => out,
            Err(e) => {
                self.control(slot); // a Want, when credit is short
                return Err((e.to_error(peer), src));
            }
        };
        let striped = stripe_min.is_some_and(|m| len >= m)
            && p.lane
                .as_mut()
                .is_some_and(|l| matches!(l.confirm(), Ok(true)));
        let Some(f) = p.session.next_frame(
            &mut out,
            check.then(|| src.bytes()),
            DataFlags::NONE.with(DataFlags::STRIPED, striped),
        ) else {
            return Err((Error::Backend("tcp: the session framed nothing"), src));
        };
        let header = f.header.unwrap_or_else(|| {
            ShortRecord {
                imm: f.imm,
                len: u32::try_from(f.len).unwrap_or(u32::MAX),
            }
            .encode()
        });
        let split = if striped { stripe_split(len) } else { len };
        p.striped_sent += u64::from(striped);
        let mut sent = Sent::default();
        let mut done = false;
        if p.queue.is_empty() && p.direct.is_none() {
            // A write error means a dead socket: the read side reports it.
            let lane = p.lane.as_mut().map(|l| &mut l.stream);
            let r = write_frame(&mut p.stream, lane, &header, src.bytes(), split, &mut sent);
            done = matches!(r, Ok(true));
            if r.is_ok() && !done && direct && matches!(src, Source::Slice(_)) {
                p.direct = Some(Direct {
                    header,
                    split,
                    sent,
                });
                return Ok(false);
            }
        }
        if !done {
            let payload = match src {
                Source::Slice(b) => Payload::Owned(b.to_vec()),
                Source::Lease(l) => Payload::Leased(l),
            };
            let queued = HEADER_LEN + len - sent.main - sent.lane;
            p.queued_bytes += queued;
            p.queue.push_back(Out {
                header,
                payload,
                split,
                sent,
                credit: false,
            });
            self.queued_total += queued;
        }
        self.control(slot);
        Ok(true)
    }

    /// Queues the control frames the peer's session has due (a Close after
    /// the data; credit ahead of data not yet begun), then writes what is
    /// queued, announces a peer whose exchange settled, and lets go of one
    /// whose session ended. The common look (after every frame) first: no
    /// frame due, nothing queued, nothing to announce.
    #[inline(always)]
    pub(super) fn control(&mut self, slot: usize) {
        let idle = self.peers.at_mut(slot).is_some_and(|p| {
            p.session.control_quiet() && p.queue.is_empty() && (p.token.is_none() || p.announced)
        });
        if !idle {
            self.queue_control(slot);
        }
    }

    fn queue_control(&mut self, slot: usize) {
        let Some(p) = self.peers.at_mut(slot) else {
            return;
        };
        while let Some(c) = p.session.poll_control() {
            let credit = c.kind == FrameKind::Credit;
            let mut out = Out {
                header: c.header,
                payload: Payload::None,
                split: 0,
                sent: Sent::default(),
                credit,
            };
            // Credit may pass data not yet begun; a Want or the Close names
            // the data before it, and stays behind it.
            let begun = usize::from(p.queue.front().is_some_and(|o| o.sent.main > 0));
            // A credit frame still waiting whole takes the new one in: a
            // peer that reads nothing holds one credit frame here, however
            // much it sends.
            let waiting = credit
                .then(|| p.queue.iter().skip(begun).position(|o| o.credit))
                .flatten();
            if let Some(old) = waiting.and_then(|i| p.queue.remove(begun + i)) {
                let folded = fold_credit(&old.header, &out.header);
                debug_assert!(folded.is_some(), "our own credit headers decode");
                out.header = folded.unwrap_or(out.header);
                p.queued_bytes -= HEADER_LEN;
                self.queued_total -= HEADER_LEN;
            }
            if credit && p.queue.len() > begun {
                p.queue.insert(begun, out);
            } else {
                p.queue.push_back(out);
            }
            p.queued_bytes += HEADER_LEN;
            self.queued_total += HEADER_LEN;
        }
        // An accepting side's peer is news once the same-host exchange
        // settled on this wire (a session that moved is not).
        if p.token.is_some() && !p.announced && p.session.host_settled() && !p.session.is_moved() {
            p.announced = true;
            let addr = p.addr;
            self.accepted.push_back((self.id(slot), addr));
        }
        let Some(p) = self.peers.at_mut(slot) else {
            return;
        };
        if !p.queue.is_empty() {
            self.mark_write(slot);
            self.flush(slot);
        } else if (p.session.is_finished() || p.session.is_moved()) && p.direct.is_none() {
            // The peer's Close answered ours (or the session moved to shared
            // memory), and nothing is left to write: the side that closed
            // first lets go here.
            self.drop_peer(slot, true);
        }
    }

    pub(super) fn flush(&mut self, slot: usize) -> bool {
        let Some(p) = self.peers.at_mut(slot) else {
            return false;
        };
        if p.direct.is_some() || !p.writable {
            return false; // a caller is mid-frame from its slice; ours go after it
        }
        let mut any = false;
        let mut broken = false;
        while let Some(front) = p.queue.front_mut() {
            let before = front.sent.main + front.sent.lane;
            let lane = p.lane.as_mut().map(|l| &mut l.stream);
            let r = write_frame(
                &mut p.stream,
                lane,
                &front.header,
                front.payload.bytes(),
                front.split,
                &mut front.sent,
            );
            let moved = front.sent.main + front.sent.lane - before;
            p.queued_bytes -= moved;
            self.queued_total -= moved;
            any |= moved > 0;
            match r {
                Ok(true) => {
                    p.queue.pop_front();
                }
                Ok(false) => {
                    p.writable = false;
                    break;
                }
                Err(_) => {
                    broken = true;
                    break;
                }
            }
        }
        // Both closed with everything out, or moved to shared memory with
        // its answer out.
        let finished = p.queue.is_empty()
            && (p.session.is_finished() || p.session.is_moved())
            && p.direct.is_none();
        if broken || finished {
            // Both closed with everything out, or a dead socket (clean if
            // the peer had closed first).
            let clean = finished || p.session.peer_closed();
            self.drop_peer(slot, clean);
        }
        any || broken
    }

    pub(super) fn flush_all(&mut self) -> bool {
        let mut any = false;
        for _ in 0..self.hot_write.len() {
            let Some(slot) = self.hot_write.pop_front() else {
                break;
            };
            if let Some(p) = self.peers.at_mut(slot) {
                p.in_write = false;
            }
            any |= self.flush(slot);
            if let Some(p) = self.peers.at(slot) {
                if p.writable {
                    self.mark_write(slot);
                }
            }
        }
        any
    }

    pub(super) fn mark_write(&mut self, slot: usize) {
        if let Some(p) = self.peers.at_mut(slot) {
            let work = !p.queue.is_empty() && p.direct.is_none();
            if work && !p.in_write {
                p.in_write = true;
                self.hot_write.push_back(slot);
            }
        }
    }
}
