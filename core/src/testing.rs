//! Test fakes, kept once (feature `testing`; core's own tests use them too):
//! memory without bytes behind it, a registrar that counts, and a reference
//! driver for the session engine that moves whole frames through `Vec`s.
//! Tests, benches, loom models and fuzz targets share them.

use std::collections::VecDeque;
use std::vec::Vec;

use crate::session::{
    DataIn, Inbound, Instant, Outgoing, ProtocolError, SendError, Session, SessionConfig,
};
use crate::wire::HEADER_LEN;

/// One frame on a simulated wire: a header with its payload, or (ring wires
/// with immediate data) a headerless payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SimFrame {
    /// Header then payload, as one unit.
    Framed(Vec<u8>),
    /// A payload alone with the credits in the immediate data.
    Headerless {
        /// The message.
        payload: Vec<u8>,
        /// The immediate data.
        imm: u32,
    },
}

/// What happened to a [`SimPeer`] as frames arrived.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SimEvent {
    /// The peer's Hello came.
    Opened,
    /// A whole message: its sequence number and bytes.
    Message(u64, Vec<u8>),
    /// The peer waits for a grant of this many bytes.
    Wants(usize),
    /// The peer closed cleanly.
    Closed,
}

/// A reference driver: one session, its send queue, and reassembly into
/// `Vec`s. It does what every real driver does, with no I/O: frames go out
/// as `SimFrame`s and come in the same way.
#[derive(Debug)]
pub struct SimPeer {
    /// The engine.
    pub session: Session,
    queue: VecDeque<(Outgoing, Vec<u8>)>,
    assembling: Vec<u8>,
    /// Ring wires: slots to report reposted on the next transmit.
    slots_used: u32,
}

impl SimPeer {
    /// A peer with nothing exchanged yet.
    pub fn new(config: SessionConfig, token: u32, now: Instant) -> SimPeer {
        SimPeer {
            session: Session::new(config, token, now),
            queue: VecDeque::new(),
            assembling: Vec::new(),
            slots_used: 0,
        }
    }

    /// Starts a message (its bytes are kept until sent); returns its sequence number.
    pub fn send(&mut self, bytes: &[u8]) -> Result<u64, SendError> {
        let out = self.session.send(bytes.len())?;
        self.queue.push_back((out, bytes.to_vec()));
        Ok(out.seq())
    }

    /// Messages started and not yet all framed.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Everything that may go now: control frames first (a Close only once
    /// the messages before it are out), then data fragments while the
    /// peer's ring has room.
    pub fn transmit(&mut self) -> Vec<SimFrame> {
        // A ring driver reposts each slot once its frame is handled.
        let n = core::mem::take(&mut self.slots_used);
        self.session.reposted(n);
        let mut out = Vec::new();
        loop {
            if let Some((msg, bytes)) = self.queue.front_mut() {
                if let Some(f) = self.session.next_frame(msg, Some(bytes), false) {
                    let payload = &bytes[f.offset..f.offset + f.len];
                    out.push(match f.header {
                        Some(h) => {
                            let mut v = h.to_vec();
                            v.extend_from_slice(payload);
                            SimFrame::Framed(v)
                        }
                        None => SimFrame::Headerless {
                            payload: payload.to_vec(),
                            imm: f.imm,
                        },
                    });
                    if f.last {
                        self.queue.pop_front();
                    }
                    continue;
                }
            }
            match self.session.poll_control() {
                Some(c) => out.push(SimFrame::Framed(c.header.to_vec())),
                None => break,
            }
        }
        out
    }

    /// A frame arrived whole (a frame wire: the mock link, verbs).
    pub fn receive(
        &mut self,
        now: Instant,
        frame: &SimFrame,
    ) -> Result<Vec<SimEvent>, ProtocolError> {
        if self.session.config().ring != 0 {
            self.slots_used += 1;
        }
        let mut events = Vec::new();
        match frame {
            SimFrame::Headerless { payload, imm } => {
                let d = self.session.handle_headerless(now, payload.len(), *imm)?;
                events.push(SimEvent::Message(d.seq, payload.clone()));
            }
            SimFrame::Framed(bytes) => {
                let carried = bytes.len().saturating_sub(HEADER_LEN);
                match self.session.handle_header(now, bytes, Some(carried))? {
                    Inbound::Control => {}
                    Inbound::Opened => events.push(SimEvent::Opened),
                    Inbound::Want => {
                        let len = self.session.pending_grant().unwrap_or(0);
                        events.push(SimEvent::Wants(len));
                    }
                    Inbound::Closed => events.push(SimEvent::Closed),
                    Inbound::Data(d) => {
                        if let Some(m) = self.place(now, d, &bytes[HEADER_LEN..])? {
                            events.push(m);
                        }
                    }
                }
            }
        }
        Ok(events)
    }

    fn place(
        &mut self,
        now: Instant,
        d: DataIn,
        payload: &[u8],
    ) -> Result<Option<SimEvent>, ProtocolError> {
        if d.first {
            self.assembling = std::vec![0; d.msg_len];
        }
        self.assembling[d.offset..d.offset + d.len].copy_from_slice(payload);
        let done = self.session.handle_payload(now, Some(payload))?;
        Ok(done.map(|m| SimEvent::Message(m.seq, core::mem::take(&mut self.assembling))))
    }

    /// The application took a message of `len` bytes.
    pub fn consume(&mut self, len: usize) {
        self.session.consumed(len);
    }
}

/// Rounds [`exchange`] allows before it calls the two sessions livelocked.
pub const EXCHANGE_ROUNDS: usize = 100_000;

/// Moves every frame either side has to send to the other, until neither
/// has any; returns what each side saw (`a`'s events, `b`'s events). The
/// application takes every message at once (its bytes come back as
/// credit) and grants every want.
///
/// # Panics
/// If the two never fall quiet ([`EXCHANGE_ROUNDS`]): a livelock, such as
/// credit frames answering each other for ever.
pub fn exchange(
    a: &mut SimPeer,
    b: &mut SimPeer,
    now: Instant,
) -> Result<(Vec<SimEvent>, Vec<SimEvent>), ProtocolError> {
    let mut seen = (Vec::new(), Vec::new());
    for _ in 0..EXCHANGE_ROUNDS {
        let to_b = a.transmit();
        let to_a = b.transmit();
        if to_a.is_empty() && to_b.is_empty() {
            return Ok(seen);
        }
        for f in &to_b {
            deliver(b, now, f, &mut seen.1)?;
        }
        for f in &to_a {
            deliver(a, now, f, &mut seen.0)?;
        }
    }
    panic!("the sessions never fell quiet: a livelock");
}

fn deliver(
    p: &mut SimPeer,
    now: Instant,
    f: &SimFrame,
    seen: &mut Vec<SimEvent>,
) -> Result<(), ProtocolError> {
    for e in p.receive(now, f)? {
        match &e {
            SimEvent::Message(_, m) => p.consume(m.len()),
            SimEvent::Wants(_) => p.session.grant(),
            _ => {}
        }
        seen.push(e);
    }
    Ok(())
}
