//! Two session engines against each other through byte slices, with
//! arbitrary drops, duplicates, reorders, corruption, truncation and timer
//! jumps. No sockets. What must hold, whatever the fuzzer does:
//! - nothing panics;
//! - every message delivered is intact, and messages are delivered in order
//!   (the n-th delivered is the n-th sent), never twice;
//! - every failure is a typed `ProtocolError`, and a failed side stays failed;
//! - with no fault injected, everything sent arrives, the two fall quiet
//!   (no livelock, no deadlock), and a close on either side is clean on both;
//! - on ring wires the applications may hold the buffers data arrives in
//!   (`Op::Hold`, `Op::GiveBack`): with no fault, the two fall quiet while
//!   they still hold them (no credit frames traded for ever), and everything
//!   arrives once they give them back (no side left with no credit for good);
//!   and quiet never sits on room: no side holds a message that the peer's
//!   reposted, unreported slots would let go;
//! - a side may repost the slots of what came in late (`Op::Late`,
//!   `Op::Repost`), after its frames went out, as the verbs driver does.
//!
//! The same-host exchange runs in three of four setups (no offer, an offer
//! declined, an offer taken): no data crosses before it is settled, and once
//! an offer is taken neither session sends anything more (the session moved).
//!
//! Headerless frames (ring wires with immediate data) travel on RC, whose
//! own checksum guards their bytes: they are dropped, duplicated and
//! reordered here, never corrupted or cut (nothing in a headerless frame
//! could tell).
#![no_main]

use std::collections::VecDeque;
use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use zerohop_core::session::{
    HostOffer, HostRole, Instant, SendError, SessionConfig, MIN_RATE, MIN_RING,
};
use zerohop_core::testing::{SimEvent, SimFrame, SimPeer};
use zerohop_core::wire::FrameKind;

#[derive(Arbitrary, Debug)]
struct Setup {
    ring: u8,
    frame_max: u16,
    window: u16,
    max_message: u16,
    headerless: bool,
    /// 0: no exchange; 1: the connecting side (a) has no offer; 2: its offer
    /// is declined; 3: taken.
    host: u8,
    ops: Vec<Op>,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Op {
    Send { side: bool, len: u16 },
    Transmit { side: bool },
    Deliver { side: bool, n: u8 },
    Drop { side: bool },
    Duplicate { side: bool },
    Swap { side: bool },
    Corrupt { side: bool, at: u16, bit: u8 },
    Truncate { side: bool, keep: u16 },
    Consume { side: bool, n: u8 },
    Grant { side: bool },
    Close { side: bool },
    Tick { side: bool, ms: u16 },
    Hold { side: bool, on: bool },
    GiveBack { side: bool, n: u8 },
    Late { side: bool, on: bool },
    Repost { side: bool },
}

struct Side {
    peer: SimPeer,
    /// Frames on their way to the other side.
    wire: VecDeque<SimFrame>,
    /// Messages this side sent, by sequence number.
    sent: Vec<Vec<u8>>,
    /// Messages received from the other side and not yet consumed.
    inbox: VecDeque<usize>,
    delivered: usize,
    failed: bool,
    /// This side's application closed.
    closing: bool,
    closed_by_peer: bool,
    /// The session moved to shared memory (an offer taken).
    moved: bool,
}

fn pattern(side: bool, seq: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31) ^ seq.wrapping_mul(7) ^ usize::from(side)) as u8)
        .collect()
}

const OFFER: HostOffer = HostOffer {
    host: 0x5EED,
    pid: 1,
    nonce: 2,
};

fn config(s: &Setup) -> SessionConfig {
    let ring = match s.ring % 4 {
        0 => 0,
        _ => MIN_RING + u16::from(s.ring % 13),
    };
    let max_message = 1 + u32::from(s.max_message % 4096);
    let frame_max = if ring == 0 {
        max_message
    } else {
        1 + u32::from(s.frame_max % 512)
    };
    SessionConfig {
        max_message,
        window: 1 + u32::from(s.window % 8192),
        frame_max,
        ring,
        takes_headerless: ring != 0 && s.headerless,
        sends_headerless: ring != 0 && s.headerless,
        check_payload: true,
        idle_timeout: Duration::from_millis(50),
        // Half the sessions held to a minimum rate mid-message as well.
        min_rate: if s.window.is_multiple_of(2) {
            MIN_RATE
        } else {
            0
        },
        host: HostRole::None,
    }
}

/// Delivers one frame from `from` to `to`, checking what it yields.
fn deliver(from: &mut Side, to: &mut Side, now: Instant) {
    let Some(f) = from.wire.pop_front() else {
        return;
    };
    match to.peer.receive(now, &f) {
        Ok(events) => {
            assert!(!to.failed, "a failed session took a frame");
            for e in events {
                match e {
                    SimEvent::Message(seq, bytes) => {
                        assert!(!to.closed_by_peer, "a message after a clean close");
                        assert_eq!(seq as usize, to.delivered, "out of order or twice");
                        let want = from
                            .sent
                            .get(to.delivered)
                            .expect("delivered but never sent");
                        assert_eq!(&bytes, want, "delivered bytes differ from those sent");
                        to.delivered += 1;
                        to.inbox.push_back(bytes.len());
                    }
                    SimEvent::Closed => {
                        assert_eq!(
                            to.delivered,
                            from.sent.len(),
                            "a close before every message"
                        );
                        to.closed_by_peer = true;
                    }
                    SimEvent::HostOffered(o) => {
                        assert_eq!(o, OFFER, "the offer as it was sent");
                        to.moved = to.peer.accept_offers;
                    }
                    SimEvent::HostAnswered(taken) => {
                        assert_eq!(taken, from.peer.accept_offers, "the answer as it was given");
                        to.moved = taken;
                    }
                    SimEvent::Opened | SimEvent::Wants(_) => {}
                }
            }
        }
        Err(e) => {
            // Typed, and sticky.
            assert_eq!(to.peer.session.failure(), Some(e));
            to.failed = true;
        }
    }
}

/// Moves every frame either side has to send to the other until neither
/// has any (true), or 1 000 rounds go by with no data frame (false: control
/// frames answering control frames); with `take`, the applications consume
/// every message and grant every want after each round. A side that
/// reposts late does so after it transmits. (Data frames are bounded: by
/// the messages sent, and while buffers are held by the slots they take.)
fn settle(a: &mut Side, b: &mut Side, now: Instant, take: bool) -> bool {
    let data = |f: &SimFrame| match f {
        SimFrame::Headerless { .. } => true,
        SimFrame::Framed(bytes) => bytes.get(3) == Some(&(FrameKind::Data as u8)),
    };
    let mut idle = 0;
    while idle < 1_000 {
        let (fa, fb) = (a.peer.transmit(), b.peer.transmit());
        idle = if fa.iter().chain(&fb).any(data) {
            0
        } else {
            idle + 1
        };
        a.wire.extend(fa);
        b.wire.extend(fb);
        let reposted = a.peer.repost() + b.peer.repost();
        if a.wire.is_empty() && b.wire.is_empty() && reposted == 0 {
            return true;
        }
        while !a.wire.is_empty() {
            deliver(a, b, now);
        }
        while !b.wire.is_empty() {
            deliver(b, a, now);
        }
        if take {
            for s in [&mut *a, &mut *b] {
                while let Some(len) = s.inbox.pop_front() {
                    s.peer.consume(len);
                }
                s.peer.session.grant(now);
            }
        }
    }
    false
}

fn side_mut<'a>(a: &'a mut Side, b: &'a mut Side, which: bool) -> (&'a mut Side, &'a mut Side) {
    if which {
        (b, a)
    } else {
        (a, b)
    }
}

fuzz_target!(|setup: Setup| {
    let cfg = config(&setup);
    let mut now = Instant::from_micros(1);
    // The same-host exchange runs on stream wires (TCP) only.
    let (cfg_a, cfg_b) = match (setup.host % 4, cfg.ring) {
        (0, _) | (_, 1..) => (cfg, cfg),
        (1, 0) => (
            SessionConfig {
                host: HostRole::Offer(None),
                ..cfg
            },
            SessionConfig {
                host: HostRole::Answer,
                ..cfg
            },
        ),
        _ => (
            SessionConfig {
                host: HostRole::Offer(Some(OFFER)),
                ..cfg
            },
            SessionConfig {
                host: HostRole::Answer,
                ..cfg
            },
        ),
    };
    let new_side = |cfg, token| Side {
        peer: SimPeer::new(cfg, token, now),
        wire: VecDeque::new(),
        sent: Vec::new(),
        inbox: VecDeque::new(),
        delivered: 0,
        failed: false,
        closing: false,
        closed_by_peer: false,
        moved: false,
    };
    let (mut a, mut b) = (new_side(cfg_a, 1), new_side(cfg_b, 2));
    b.peer.accept_offers = setup.host % 4 == 3;
    let mut faults = false;
    let mut closed = false;
    for op in setup.ops.iter().take(2000) {
        match *op {
            Op::Send { side, len } => {
                let (s, _) = side_mut(&mut a, &mut b, side);
                let len = usize::from(len) % 5000;
                let bytes = pattern(side, s.sent.len(), len);
                match s.peer.send(&bytes) {
                    Ok(seq) => {
                        assert_eq!(seq as usize, s.sent.len());
                        s.sent.push(bytes);
                    }
                    Err(
                        SendError::NotOpen
                        | SendError::NoCredit
                        | SendError::Closed
                        | SendError::PeerClosed
                        | SendError::TooLarge { .. }
                        | SendError::Failed(_),
                    ) => {}
                    Err(SendError::SequenceExhausted) => unreachable!("2^64 messages"),
                }
            }
            Op::Transmit { side } => {
                let (s, _) = side_mut(&mut a, &mut b, side);
                let frames = s.peer.transmit();
                s.wire.extend(frames);
            }
            Op::Deliver { side, n } => {
                let (s, o) = side_mut(&mut a, &mut b, side);
                for _ in 0..n % 8 {
                    deliver(s, o, now);
                }
            }
            Op::Drop { side } => {
                let (s, _) = side_mut(&mut a, &mut b, side);
                faults |= s.wire.pop_front().is_some();
            }
            Op::Duplicate { side } => {
                let (s, _) = side_mut(&mut a, &mut b, side);
                if let Some(f) = s.wire.front().cloned() {
                    s.wire.push_front(f);
                    faults = true;
                }
            }
            Op::Swap { side } => {
                let (s, _) = side_mut(&mut a, &mut b, side);
                if s.wire.len() >= 2 {
                    s.wire.swap(0, 1);
                    faults = true;
                }
            }
            Op::Corrupt { side, at, bit } => {
                let (s, _) = side_mut(&mut a, &mut b, side);
                if let Some(SimFrame::Framed(f)) = s
                    .wire
                    .front_mut()
                    .filter(|f| !matches!(f, SimFrame::Framed(b) if b.is_empty()))
                {
                    let i = usize::from(at) % f.len();
                    f[i] ^= 1 << (bit % 8);
                    faults = true;
                }
            }
            Op::Truncate { side, keep } => {
                let (s, _) = side_mut(&mut a, &mut b, side);
                if let Some(SimFrame::Framed(f)) = s.wire.front_mut() {
                    let keep = usize::from(keep) % (f.len() + 1);
                    if keep < f.len() {
                        f.truncate(keep);
                        faults = true;
                    }
                }
            }
            Op::Consume { side, n } => {
                let (s, _) = side_mut(&mut a, &mut b, side);
                for _ in 0..n % 8 {
                    if let Some(len) = s.inbox.pop_front() {
                        s.peer.consume(len);
                    }
                }
            }
            Op::Grant { side } => {
                let (s, _) = side_mut(&mut a, &mut b, side);
                s.peer.session.grant(now);
            }
            Op::Close { side } => {
                let (s, _) = side_mut(&mut a, &mut b, side);
                s.peer.session.close();
                s.closing = true;
                closed = true;
            }
            Op::Hold { side, on } => {
                let (s, _) = side_mut(&mut a, &mut b, side);
                s.peer.holding = on;
            }
            Op::GiveBack { side, n } => {
                let (s, _) = side_mut(&mut a, &mut b, side);
                s.peer.give_back(u32::from(n % 8));
            }
            Op::Late { side, on } => {
                let (s, _) = side_mut(&mut a, &mut b, side);
                s.peer.repost_late = on;
            }
            Op::Repost { side } => {
                let (s, _) = side_mut(&mut a, &mut b, side);
                s.peer.repost();
            }
            Op::Tick { side, ms } => {
                now = now.after(Duration::from_millis(u64::from(ms % 100)));
                let (s, _) = side_mut(&mut a, &mut b, side);
                if let Err(e) = s.peer.session.handle_timeout(now) {
                    assert_eq!(s.peer.session.failure(), Some(e));
                    s.failed = true;
                    faults = true; // a stall is the test's doing, as a fault is
                }
            }
        }
    }
    if a.moved || b.moved {
        // Nothing crossed before the exchange settled, and nothing after.
        assert_eq!(
            (a.delivered, b.delivered),
            (0, 0),
            "data around a taken offer"
        );
    }
    if faults || a.failed || b.failed || a.moved || b.moved {
        return;
    }
    // No fault. While the applications still hold what they hold, the two
    // fall quiet (a frame that only answers a frame would go on for ever).
    assert!(
        settle(&mut a, &mut b, now, false),
        "frames traded for ever while buffers were held: a livelock"
    );
    assert!(!a.failed && !b.failed, "a fault-free run failed");
    for (x, y) in [(&a, &b), (&b, &a)] {
        let room = x.peer.session.frame_credits().unwrap_or(0) + y.peer.session.owed_slots().0;
        assert!(
            x.peer.queued() == 0 || room == 0,
            "quiet on room: a message waits while {room} slots are free for it"
        );
        // Nothing queued, so the Close has nothing to wait behind: quiet
        // means it went (a side short of control slots is owed them, and
        // the peer returns them unasked). A session that moved to shared
        // memory sends nothing more.
        let closing = (x.closing || x.closed_by_peer) && !x.moved;
        assert!(
            x.peer.queued() > 0 || !closing || x.peer.session.close_sent(),
            "quiet with a Close held: control credits {:?}, the peer owes {:?}",
            x.peer.session.control_credits(),
            y.peer.session.owed_slots()
        );
    }
    // Then every buffer back: everything in flight arrives, every message is
    // consumed, and the two fall quiet with every message across.
    for s in [&mut a, &mut b] {
        s.peer.holding = false;
        s.peer.give_back(u32::MAX);
    }
    assert!(
        settle(&mut a, &mut b, now, true),
        "the sessions never fell quiet: a livelock"
    );
    assert!(!a.failed && !b.failed, "a fault-free run failed");
    if a.moved || b.moved {
        // The offer was taken: both sessions moved, nothing crossed.
        assert!(a.moved && b.moved, "only one side moved");
        assert_eq!(
            (a.delivered, b.delivered),
            (0, 0),
            "data around a taken offer"
        );
        return;
    }
    assert_eq!(b.delivered, a.sent.len(), "a message from a never arrived");
    assert_eq!(a.delivered, b.sent.len(), "a message from b never arrived");
    assert_eq!(a.peer.queued(), 0, "a deadlock: a's messages wait for ever");
    assert_eq!(b.peer.queued(), 0, "a deadlock: b's messages wait for ever");
    if closed {
        assert!(
            a.peer.session.is_finished() && b.peer.session.is_finished(),
            "a close was not clean"
        );
    }
});
