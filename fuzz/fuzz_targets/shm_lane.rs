//! A same-host lane reading shared memory that a hostile peer controls:
//! arbitrary counters (the peer's write counter, its read counter of our
//! ring) and arbitrary ring bytes, interleaved with well-formed frames so
//! the fuzzer reaches past the handshake. What must hold:
//! - nothing panics, and no access leaves the segment (ASan would say);
//! - a broken ring or protocol is a typed error, after which the lane takes
//!   nothing more;
//! - no message delivered is longer than the lane's maximum (its bytes are
//!   not checked: raw writes may forge any frame the session accepts);
//! - every receive buffer goes back to the pool once the lane is gone;
//! - a lane is lost (`PeerLost`) only after its peer said it ended uncleanly;
//! - the side pass (timers, and the read of a due lane) fails only typed;
//! - sends, large ones too (placed or claimed, whatever the peer says it
//!   maps, has copied or is done with), fail only typed, and every buffer
//!   they took is back once the lane is gone;
//! - a lane that lets the wire sleep (`prepare_sleep`, with nothing
//!   delivered waiting) has nothing to read: a read right after delivers
//!   nothing and fails nothing. Else bytes the peer wrote before the sleep
//!   (it rings only for later ones) wait for a wake-up that never comes;
//! - a lane that keeps the wire awake gives it something to do: with the
//!   peer idle, a few passes (the lane read only where not quiet, as the
//!   wire skips quiet lanes) deliver, break the lane or let the wire sleep.
//!   Else the wire spins (a broken ring that only a read would report, a
//!   lane that waits for what cannot come).
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use zerohop_core::wire::{Data, DataFlags, Frame, Hello, Takes};
use zerohop_core::Error;
use zerohop_std::shm::testing::{
    claim_state, claim_ticket, claim_word, short_record, LaneRig, HELP_DONE, HELP_TAKEN,
};

#[derive(Arbitrary, Debug)]
enum Op {
    /// The peer's Hello, as a real peer sends it first.
    Hello,
    /// A well-formed data frame of `len` bytes with sequence number `seq`
    /// (flagged as naming device memory when `device`: a lane without a
    /// GPU side refuses it).
    Data {
        seq: u8,
        len: u16,
        device: bool,
    },
    /// A whole message as a short record (`seq` its sequence number's low
    /// bits, `credits` the frame credits it returns), its payload after it;
    /// or, `large`, a record of a single-copy length and a descriptor of
    /// the fuzzer's (an address in this process, a ticket, a pool file
    /// and a mode).
    Short {
        seq: u16,
        credits: u16,
        len: u16,
        large: Option<[u8; 40]>,
    },
    /// Raw bytes, written as a producer would.
    Write(Vec<u8>),
    /// The peer's write counter set to anything (small moves, or anything).
    Head {
        far: bool,
        v: u64,
    },
    /// The peer's read counter of our ring set to anything.
    Tail(u64),
    /// Bytes written over the ring past any counter.
    Scribble {
        at: u16,
        bytes: Vec<u8>,
    },
    Read,
    /// The clock moves on by up to 10 s (in microseconds), and the wire's
    /// side pass runs: a due lane's read, then its timers.
    Tend(u32),
    Send(u16),
    /// A message of a single-copy length (32 KiB and up): from the caller's
    /// slice (by the claim word), or a pool buffer (`lease`: placed once
    /// the peer maps the pool's file).
    SendLarge {
        len: u16,
        lease: bool,
    },
    /// The peer says it maps a pool file: this side's (`ours`), or any.
    Maps {
        ours: bool,
        ino: u64,
    },
    /// The peer says it has copied the claimed single-copy message `ticket`.
    Copied(u64),
    /// The peer offers the tail of the lane's claimed message `ticket`,
    /// to be written into a buffer of the fuzzer's.
    Offer(u64),
    /// Right after the lane's next copy out of the peer, the peer writes
    /// the tail the lane offered (`None`), or stores `word` in the help
    /// word (a taken one is read as done: a tail never written only costs
    /// the lane its wait, which the tests time).
    Helps(Option<u64>),
    /// The peer says it is done with placed messages up to `ticket`.
    PlacedDone(u64),
    /// The lane writes what it has queued, releases what the peer is done with.
    Flush,
    /// The peer reads what the lane wrote.
    PeerTake,
    Take,
    /// The wire's pass: reads until one finds nothing, what they deliver
    /// taken.
    Pass,
    /// The wire's look before it sleeps, after a pass that found nothing
    /// (and whatever the peer did since).
    Sleep,
    /// The peer says it dropped the lane uncleanly: a single-copy message
    /// read after it is lost with the lane.
    Ended,
}

impl Op {
    /// Whether it is the peer's doing, not this side's.
    fn peers(&self) -> bool {
        !matches!(
            self,
            Op::Read
                | Op::Tend(_)
                | Op::Send(_)
                | Op::SendLarge { .. }
                | Op::Flush
                | Op::Take
                | Op::Pass
                | Op::Sleep
        )
    }
}

fuzz_target!(|ops: Vec<Op>| {
    // The pool one shared-memory file, as an endpoint's: large pool
    // buffers (`SendLarge { lease }`) go placed once the peer says it maps it.
    let Ok(mut rig) = LaneRig::new_shared(4096, 1 << 20) else {
        return;
    };
    let file = rig.pool_file().unwrap_or(0);
    let mut head = 0u64;
    let mut broke = false;
    let mut ended = false;
    // The lane's clock, in microseconds: reads are told the time of the
    // last side pass, as the wire tells them.
    let mut now = 1u64;
    // A read or a side pass: fine, or failed typed (after which the lane
    // takes nothing more).
    let judge = |r: Result<(), Error>, broke: &mut bool, ended: bool| match r {
        Ok(()) => assert!(!*broke, "a broken lane read on"),
        Err(Error::Closed) => assert!(*broke),
        Err(Error::WireRule { .. } | Error::Protocol { .. } | Error::Backend(_)) => *broke = true,
        Err(Error::PeerLost(_)) if ended => *broke = true,
        Err(e) => panic!("an untyped failure: {e:?}"),
    };
    // A send or a flush: fine, or failed typed.
    let sent = |r: Result<(), Error>, broke: &mut bool| match r {
        Ok(()) | Err(Error::Closed | Error::TooLarge { .. }) => {}
        Err(Error::WireRule { .. } | Error::Backend(_)) => *broke = true,
        Err(e) => panic!("an untyped send failure: {e:?}"),
    };
    let check = |taken: Vec<Result<usize, Error>>| {
        for m in taken {
            match m {
                Ok(len) => assert!(len <= 64 << 10, "a message past the lane's maximum"),
                Err(Error::PeerClosed(_)) => {}
                Err(e) => panic!("an untyped arrival: {e:?}"),
            }
        }
    };
    // The last pass found nothing and this side has done nothing since
    // (the peer may have): the wire may look whether to sleep.
    let mut idle = false;
    // Where the lane writes a tail the peer offers it (as in another process).
    let mut offer_to = vec![0u8; 32 << 10];
    for op in ops.iter().take(500) {
        let asleep = idle;
        if !op.peers() {
            idle = false;
        }
        match op {
            Op::Hello => {
                let h = Frame::Hello(Hello {
                    window: 1 << 20,
                    max_message: 1 << 20,
                    frame_max: 1 << 20,
                    ring: 0,
                    lane: 0,
                    takes: Takes::NONE,
                    token: 9,
                })
                .encode(&[]);
                head = head.wrapping_add(rig.peer_write(&h) as u64);
            }
            Op::Data { seq, len, device } => {
                let payload = vec![*seq; usize::from(*len) % 3000];
                let f = Frame::Data(Data {
                    flags: DataFlags::NONE.with(DataFlags::DEVICE, *device),
                    seq: u64::from(*seq),
                    msg_len: payload.len() as u32,
                    len: payload.len() as u32,
                    offset: 0,
                    credits: 0,
                    control: 0,
                })
                .encode(&payload);
                head = head.wrapping_add(rig.peer_write(&f) as u64);
                head = head.wrapping_add(rig.peer_write(&payload) as u64);
            }
            Op::Short {
                seq,
                credits,
                len,
                large,
            } => {
                let (len, payload) = match large {
                    Some(desc) => (
                        (32 << 10) + u32::from(*len) % ((32 << 10) + 1),
                        desc.to_vec(),
                    ),
                    None => {
                        let n = usize::from(*len) % 3000;
                        (n as u32, vec![*seq as u8; n])
                    }
                };
                let mut r = short_record(*seq, len);
                r[4..6].copy_from_slice(&credits.to_le_bytes());
                head = head.wrapping_add(rig.peer_write(&r) as u64);
                head = head.wrapping_add(rig.peer_write(&payload) as u64);
            }
            Op::Write(b) => head = head.wrapping_add(rig.peer_write(b) as u64),
            Op::Head { far, v } => {
                head = if *far { *v } else { head.wrapping_add(v % 64) };
                rig.poke_head(head);
            }
            Op::Tail(v) => rig.poke_tail(*v),
            Op::Scribble { at, bytes } => rig.poke_data(usize::from(*at), bytes),
            Op::Read => judge(rig.read_at(now), &mut broke, ended),
            Op::Tend(step) => {
                now += u64::from(*step) % 10_000_000;
                judge(rig.tend_at(now), &mut broke, ended);
            }
            Op::Send(len) => sent(rig.send(usize::from(*len) % 5000), &mut broke),
            Op::SendLarge { len, lease } => {
                let len = (32 << 10) + usize::from(*len) % ((32 << 10) + 1);
                let r = if *lease {
                    // A full lane or a dry pool is back-pressure.
                    match rig.send_lease(len) {
                        Err(Error::WouldBlock | Error::Pool(_)) => Ok(()),
                        r => r,
                    }
                } else {
                    rig.send(len)
                };
                sent(r, &mut broke);
            }
            Op::Maps { ours, ino } => rig.peer_maps(if *ours { file } else { *ino }),
            Op::Copied(t) => rig.peer_copied(*t),
            Op::Offer(t) => rig.peer_offers_tail(*t, offer_to.as_mut_ptr() as u64),
            Op::Helps(word) => {
                let word = word.map(|w| match claim_state(w) {
                    HELP_TAKEN => claim_word(claim_ticket(w), HELP_DONE),
                    _ => w,
                });
                rig.peer_helps_during_next_copy(vec![0x5A; 32 << 10], word);
            }
            Op::PlacedDone(t) => rig.peer_placed_done(*t),
            Op::Flush => {
                let r = rig.flush().map(|_| ());
                sent(r, &mut broke);
                if broke {
                    rig.drop_lane(); // as the wire drops a lane whose flush failed
                }
            }
            Op::PeerTake => {
                let _ = rig.peer_take();
            }
            Op::Ended => {
                ended = true;
                rig.peer_ended();
            }
            Op::Take => check(rig.take_delivered()),
            Op::Pass => {
                // As the wire's pass before it sleeps: reads until one
                // finds nothing for the application (what they find, the
                // application takes, its leases back, and calls again).
                for _ in 0..8 {
                    check(rig.take_delivered());
                    judge(rig.read_at(now), &mut broke, ended);
                    let got = rig.take_delivered();
                    if got.is_empty() {
                        idle = rig.alive();
                        break;
                    }
                    check(got);
                }
            }
            Op::Sleep if asleep => {
                if !rig.prepare_sleep() {
                    let r = rig.read_at(now);
                    assert!(r.is_ok(), "a lane let the wire sleep on a failure: {r:?}");
                    let taken = rig.take_delivered();
                    assert!(taken.is_empty(), "a lane let the wire sleep on {taken:?}");
                    continue;
                }
                // Kept awake: the wire passes again, reading the lane only
                // where it is not quiet (it skips quiet lanes) and writing
                // what it has. With the peer idle, within a few passes the
                // lane lets it sleep, delivers or breaks; else it spins.
                let mut settled = false;
                for _ in 0..8 {
                    if rig.quiet() {
                        sent(rig.flush().map(|_| ()), &mut broke);
                        if broke {
                            rig.drop_lane();
                        }
                    } else {
                        judge(rig.read_at(now), &mut broke, ended);
                    }
                    let got = rig.take_delivered();
                    if !rig.alive() || !got.is_empty() || !rig.prepare_sleep() {
                        check(got);
                        settled = true;
                        break;
                    }
                }
                assert!(settled, "a lane kept the wire awake for nothing");
            }
            Op::Sleep => {}
        }
        if broke {
            assert!(!rig.alive(), "a lane that broke stays broken");
        }
    }
    let _ = rig.take_delivered();
    rig.drop_lane();
    assert_eq!(rig.pool_used(), 0, "every receive buffer back");
});
