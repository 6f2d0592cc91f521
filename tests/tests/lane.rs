//! The same-host lane against a peer that writes its frames by hand
//! (`LaneRig`): a frame naming device memory, to a lane that carries none,
//! is a typed protocol error that ends that lane, and nothing is held after;
//! a buffer handed over by a single copy stays out until the peer has it;
//! a peer silent mid-handshake or mid-frame is dropped at the idle timeout,
//! however often its lane is looked at, and one that drips a message at
//! the minimum rate's deadline; a whole message goes as a short
//! record to a peer that takes them, and a short record is checked as
//! strictly as a frame's header.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use zerohop_backends::SharedPlace;
use zerohop_core::session::{ProtocolError, SessionConfig, Stall};
use zerohop_core::wire::{Close, Data, DataFlags, DecodeError, Frame, Hello, Takes};
use zerohop_core::Error;
use zerohop_std::shm::testing::{
    claim_word, help_split, short_record, LaneRig, SingleCopyDesc, HELP_DONE, HELP_IDLE,
    HELP_OFFERED, HELP_TAKEN, PEER, PLACED_TICKET, SINGLE_COPY_DESC_BYTES,
};

fn hello() -> [u8; 32] {
    hello_taking(Takes::NONE)
}

fn hello_taking(takes: Takes) -> [u8; 32] {
    Frame::Hello(Hello {
        window: 1 << 20,
        max_message: 1 << 20,
        frame_max: 1 << 20,
        ring: 0,
        lane: 0,
        takes,
        token: 9,
    })
    .encode(&[])
}

/// The peer says `hello`; the lane reads it and writes its own Hello and
/// credit, which the peer takes: a lane ready for messages.
fn greet(rig: &mut LaneRig, hello: [u8; 32]) {
    rig.peer_write(&hello);
    rig.read().unwrap();
    while rig.flush().unwrap() {}
    rig.peer_take();
}

fn data(flags: DataFlags, seq: u64, len: u32) -> [u8; 32] {
    Frame::Data(Data {
        flags,
        seq,
        msg_len: len,
        len,
        offset: 0,
        credits: 0,
        control: 0,
    })
    .encode(&[])
}

/// The link is the doorbell, so bytes wait on it whether the peer lives or
/// not: a peer that rang and then died is seen dead (the link's hang-up),
/// not kept alive by its unread rings. (When nothing was ever sent on the
/// link, a byte there read as a live peer: one byte and a death kept the
/// lane, its segment and its buffers for good.)
#[test]
fn a_peer_that_rang_and_died_is_seen_dead() {
    let mut rig = LaneRig::new(1 << 16, 1 << 20).unwrap();
    assert!(rig.link_alive());
    rig.peer_rings_and_hangs_up(3);
    assert!(
        !rig.link_alive(),
        "three rings unread, and the link hung up"
    );
}

#[test]
fn a_device_frame_to_a_lane_without_a_gpu_ends_that_lane_typed() {
    let mut rig = LaneRig::new(1 << 16, 1 << 20).unwrap();
    rig.peer_write(&hello());
    rig.peer_write(&data(DataFlags::NONE, 0, 5));
    rig.peer_write(b"hello");
    rig.read().unwrap();
    assert_eq!(rig.take_delivered(), [Ok(5)], "a host message first");
    // A device message: its header, then the descriptor a GPU peer writes.
    rig.peer_write(&data(DataFlags::DEVICE, 1, 32 << 10));
    rig.peer_write(&[0u8; 88]);
    match rig.read() {
        Err(Error::Protocol { error, .. }) => assert_eq!(error, ProtocolError::DeviceRefused),
        other => panic!("expected DeviceRefused, got {other:?}"),
    }
    assert!(!rig.alive(), "the lane ended");
    assert_eq!(rig.read(), Err(Error::Closed), "and takes nothing more");
    assert!(
        rig.take_delivered().is_empty(),
        "nothing of the device frame delivered"
    );
    assert_eq!(rig.pool_used(), 0, "no receive buffer held");
}

#[test]
fn a_lease_handed_over_by_a_single_copy_goes_back_and_its_end_is_progress() {
    let mut rig = LaneRig::new(1 << 16, 1 << 20).unwrap();
    rig.peer_write(&hello());
    rig.read().unwrap();
    while rig.flush().unwrap() {} // the lane's own Hello and credit out
    let base = rig.pool_used();
    rig.send_lease(48 << 10).unwrap();
    assert!(
        rig.pool_used() >= base + (48 << 10),
        "the lease is held while the peer may read it"
    );
    assert_eq!(
        rig.flush(),
        Ok(false),
        "nothing moves before the peer's copy"
    );
    assert!(rig.pool_used() >= base + (48 << 10));
    rig.peer_copied(1);
    // A sender waiting behind the handover sleeps when nothing moved: its
    // end must count, or the sender sleeps a poll interval each message.
    assert_eq!(rig.flush(), Ok(true), "the end of the handover is progress");
    assert_eq!(rig.pool_used(), base, "and the lease went back");
    assert_eq!(rig.flush(), Ok(false), "once");
}

#[test]
fn a_blocked_caller_finishes_only_its_own_frame() {
    // A ring smaller than the second message, so that its caller writes
    // the rest from its slice as the ring drains.
    let mut rig = LaneRig::new(16 << 10, 1 << 20).unwrap();
    greet(&mut rig, hello());
    let a = vec![0xAA; 48 << 10];
    assert_eq!(
        rig.send_direct(&a),
        Ok(false),
        "a single copy: its caller waits"
    );
    assert_eq!(rig.peer_take().len(), 32 + 40, "its header and descriptor");
    rig.peer_copied(1);
    // Another caller's send sees the handover over and writes its frame,
    // which the ring does not hold whole.
    let b = vec![0xBB; 20 << 10];
    assert_eq!(rig.send_direct(&b), Ok(false), "the rest from its slice");
    // The first caller comes back: its message is out, and the frame that
    // stands is the other's, which it must not write into.
    assert_eq!(rig.continue_send(&a), Ok(true), "a's message is over");
    let mut out = rig.peer_take();
    while !rig.continue_send(&b).unwrap() {
        out.extend(rig.peer_take());
    }
    out.extend(rig.peer_take());
    assert_eq!(out.len(), 32 + b.len(), "b's frame, whole and alone");
    assert!(out[32..].iter().all(|&x| x == 0xBB), "b's bytes only");
}

/// A blocked caller that gives up while the peer copies its bytes waits
/// for the copy; a peer that never finishes it is cut off after a while and
/// the caller's slice goes, to be written again — the ring says it ended
/// first, so the peer's copy, when it ends, is not delivered.
#[test]
fn a_caller_that_gives_up_on_a_peer_that_never_finishes_its_copy_ends_the_ring_first() {
    let mut rig = LaneRig::new(1 << 16, 1 << 20).unwrap();
    greet(&mut rig, hello());
    let a = vec![0xAA; 48 << 10];
    assert_eq!(
        rig.send_direct(&a),
        Ok(false),
        "a single copy: its caller waits"
    );
    rig.peer_claims(1);
    assert!(!rig.lane_ended());
    let started = std::time::Instant::now();
    rig.abandon_send(&a);
    assert!(
        started.elapsed() >= std::time::Duration::from_secs(1),
        "the copy under way was waited for"
    );
    assert!(
        rig.lane_ended(),
        "cut off: the ring ended before the slice went"
    );
    assert!(
        matches!(rig.flush(), Err(Error::WireRule { .. })),
        "and the lane ends, typed"
    );
}

/// A caller whose send fails while the peer may read its slice (the peer
/// broke the handover word) leaves with its error, and its slice with it:
/// the ring says the lane ended first.
#[test]
fn a_caller_whose_send_fails_mid_handover_ends_the_ring_first() {
    let mut rig = LaneRig::new(1 << 16, 1 << 20).unwrap();
    greet(&mut rig, hello());
    let a = vec![0xAA; 48 << 10];
    assert_eq!(rig.send_direct(&a), Ok(false));
    rig.peer_copied(7); // a done for a ticket never sent
    assert!(matches!(rig.continue_send(&a), Err(Error::WireRule { .. })));
    assert!(rig.lane_ended(), "the ring ended before the caller left");
}

/// A lane whose session finished cleanly gave back nothing its peer could
/// still read: its drop leaves the ring's `ended` word alone.
#[test]
fn a_lane_that_finished_cleanly_does_not_end_its_ring() {
    let mut rig = LaneRig::new(1 << 16, 1 << 20).unwrap();
    rig.peer_write(&hello());
    rig.read().unwrap();
    while rig.flush().unwrap() {}
    rig.send(100).unwrap();
    rig.peer_take();
    rig.close().unwrap();
    rig.peer_write(&Frame::Close(Close { seq: 0 }).encode(&[]));
    rig.read().unwrap();
    assert_eq!(rig.take_messages(), [Err(Error::PeerClosed(PEER))]);
    assert!(rig.finished(), "closed both ways, nothing left");
    rig.drop_lane();
    assert!(!rig.lane_ended(), "a clean end is not an unclean one");
}

/// The lane's idle timeout, in microseconds of its clock.
fn idle_micros() -> u64 {
    SessionConfig::stream(64 << 10).idle_timeout.as_micros() as u64
}

/// Reads the lane every millisecond, with a side pass after each, from
/// `from` until the clock passes `until`; the first error.
fn poll_until(rig: &mut LaneRig, from: u64, until: u64) -> Result<(), Error> {
    let mut t = from;
    while t <= until {
        rig.read_at(t)?;
        rig.tend_at(t)?;
        t += 1000;
    }
    Ok(())
}

#[test]
fn a_peer_that_never_says_hello_is_dropped_at_the_idle_timeout() {
    let idle = idle_micros();
    let mut rig = LaneRig::new(1 << 16, 1 << 20).unwrap();
    // Looked at all the while: looks are not news of the peer.
    assert_eq!(poll_until(&mut rig, 1, idle - 1000), Ok(()));
    match poll_until(&mut rig, idle, idle + 1000) {
        Err(Error::Protocol { error, .. }) => assert_eq!(
            error,
            ProtocolError::Stalled {
                during: Stall::Handshake
            }
        ),
        other => panic!("expected a handshake stall, got {other:?}"),
    }
    assert_eq!(rig.read(), Err(Error::Closed), "the lane is gone");
}

#[test]
fn a_peer_that_stops_mid_frame_is_dropped_an_idle_timeout_after_its_last_byte() {
    let idle = idle_micros();
    for (cut, head) in [10usize, 32 + 2]
        .into_iter()
        .flat_map(|c| [(c, data(DataFlags::NONE, 0, 5)), (c, short_record(0, 5))])
    {
        let mut rig = LaneRig::new(1 << 16, 1 << 20).unwrap();
        rig.peer_write(&hello());
        rig.read_at(1).unwrap();
        let frame = [&head[..], b"hello"].concat();
        // Part of the frame at 5 ms; then nothing, while the lane is read.
        rig.peer_write(&frame[..cut]);
        let last = 5000;
        poll_until(&mut rig, last, last + idle - 1000)
            .unwrap_or_else(|e| panic!("cut at {cut}: dropped early: {e:?}"));
        match poll_until(&mut rig, last + idle, last + idle + 1000) {
            Err(Error::Protocol { error, .. }) => assert_eq!(
                error,
                ProtocolError::Stalled {
                    during: Stall::Frame
                },
                "cut at {cut}"
            ),
            other => panic!("cut at {cut}: expected a frame stall, got {other:?}"),
        }
        assert!(rig.take_delivered().is_empty(), "nothing of it delivered");
        assert_eq!(rig.pool_used(), 0, "no receive buffer held");
    }
}

/// The rest of that frame written into the ring, but not read before the
/// side passes (a progress thread leaves reading to an application thread
/// that calls): a peer is judged on what it sent, so the due side pass
/// reads it first, and the message arrives.
#[test]
fn a_frame_whose_rest_waits_unread_in_the_ring_is_not_the_peers_stall() {
    let idle = idle_micros();
    for head in [data(DataFlags::NONE, 0, 5), short_record(0, 5)] {
        let mut rig = LaneRig::new(1 << 16, 1 << 20).unwrap();
        rig.peer_write(&hello());
        rig.read_at(1).unwrap();
        let frame = [&head[..], b"hello"].concat();
        rig.peer_write(&frame[..10]);
        rig.read_at(5000).unwrap();
        rig.peer_write(&frame[10..]);
        let mut t = 10_000;
        while t < 3 * idle {
            rig.tend_at(t)
                .unwrap_or_else(|e| panic!("dropped with its bytes unread: {e:?}"));
            t += 10_000;
        }
        assert_eq!(rig.take_delivered(), [Ok(5)]);
    }
}

/// A reader of many lanes skips the quiet ones: a lane is quiet only when
/// a read would find nothing to do, so a skipped lane never holds back a
/// byte, a frame of its own, or its end.
#[test]
fn a_lane_is_quiet_only_when_a_read_has_nothing_to_do() {
    let mut rig = LaneRig::new(1 << 16, 1 << 20).unwrap();
    rig.peer_write(&hello());
    assert!(!rig.quiet(), "bytes in the ring");
    rig.read().unwrap();
    // The lane's own Hello went out with that read's flush.
    assert!(rig.quiet(), "all read and written");
    rig.peer_write(&data(DataFlags::NONE, 0, 5)[..10]);
    assert!(!rig.quiet(), "a new byte");
    rig.read().unwrap();
    assert!(!rig.quiet(), "part of a header held");
    let rest = [&data(DataFlags::NONE, 0, 5)[10..], &b"hello"[..]].concat();
    rig.peer_write(&rest[..24]); // the header and two bytes of the payload
    rig.read().unwrap();
    assert!(!rig.quiet(), "a payload begun");
    rig.peer_write(&rest[24..]);
    rig.read().unwrap();
    assert_eq!(rig.take_delivered(), [Ok(5)]);
    assert!(rig.quiet());
    // A message of its own, in the ring at once: quiet again; one held
    // by a handover until the peer copies it: not.
    rig.send(100).unwrap();
    assert!(rig.quiet(), "sent whole");
    // (With a credit frame for the message read before it.)
    assert!(rig.peer_take().len() >= 32 + 100);
    rig.send_lease(200 << 10).unwrap();
    assert!(!rig.quiet(), "a buffer out with the peer");
}

/// A ring whose counter the peer corrupted: a quiet lane is judged by its
/// next stamp alone, and the look before the wire sleeps sees the counter;
/// from there the lane is not quiet, so a reader of many lanes reads it and
/// it breaks, typed, where skipping it would leave the wire spinning (the
/// sleep check would refuse to sleep, and nothing would read).
#[test]
fn a_lane_whose_peer_corrupts_its_counter_is_read_before_the_wire_sleeps() {
    for bad in [u64::MAX, 1 << 20] {
        let mut rig = LaneRig::new(1 << 16, 1 << 20).unwrap();
        rig.peer_write(&hello());
        rig.read().unwrap();
        assert!(rig.quiet(), "all read and written");
        assert!(!rig.prepare_sleep(), "nothing to do: sleep");
        rig.poke_head(bad);
        assert!(
            rig.prepare_sleep(),
            "an impossible head: do not sleep ({bad})"
        );
        assert!(!rig.quiet(), "and read it ({bad})");
        assert!(rig.read().is_err(), "the read says why ({bad})");
    }
}

/// The wire's inbox is shared by its lanes: once others fill it, a lane
/// stops with a frame begun, its rest waiting in the ring. That wait is
/// this side's doing (the application has not taken its messages), not the
/// peer's stall, however long it lasts.
#[test]
fn a_frame_held_back_by_a_full_inbox_is_not_the_peers_stall() {
    let idle = idle_micros();
    let mut rig = LaneRig::new(1 << 16, 1 << 20).unwrap();
    rig.peer_write(&hello());
    rig.read_at(1).unwrap();
    // One message whole, the next begun.
    rig.peer_write(&data(DataFlags::NONE, 0, 5));
    rig.peer_write(b"first");
    rig.peer_write(&data(DataFlags::NONE, 1, 6));
    rig.peer_write(b"se");
    rig.set_inbox(2);
    rig.read_at(1000).unwrap();
    // Its rest comes, but the inbox is full now (other lanes' messages).
    rig.peer_write(b"cond");
    rig.set_inbox(1);
    poll_until(&mut rig, 2000, 2000 + 2 * idle)
        .unwrap_or_else(|e| panic!("dropped while held back: {e:?}"));
    assert_eq!(rig.take_delivered(), [Ok(5)]);
    // The application takes its messages: the rest is read.
    rig.read_at(2 * idle + 3000).unwrap();
    assert_eq!(rig.take_delivered(), [Ok(6)]);
}

#[test]
fn a_whole_message_goes_as_a_short_record_only_to_a_peer_that_takes_them() {
    for takes in [Takes::NONE, Takes::HEADERLESS] {
        let mut rig = LaneRig::new(1 << 16, 1 << 20).unwrap();
        greet(&mut rig, hello_taking(takes));
        rig.send(100).unwrap();
        rig.send(7).unwrap();
        let out = rig.peer_take();
        assert_eq!(out.len(), 2 * 32 + 107, "two records and their payloads");
        let (first, second) = (&out[..32], &out[132..164]);
        if takes.contains(Takes::HEADERLESS) {
            assert_eq!(first, short_record(0, 100), "sequence 0, 100 bytes");
            assert_eq!(second, short_record(1, 7), "sequence 1, 7 bytes");
        } else {
            for (h, seq, len) in [(first, 0, 100), (second, 1, 7)] {
                match Frame::decode(h, 1 << 20).map(|d| d.frame) {
                    Ok(Frame::Data(d)) => assert_eq!((d.seq, d.len), (seq, len)),
                    other => panic!("a data frame's header, got {other:?}"),
                }
            }
        }
    }
}

#[test]
fn short_records_deliver_their_messages_in_order() {
    // A pool that holds every message at once: a dry one stops the read.
    let mut rig = LaneRig::new(1 << 16, 16 << 20).unwrap();
    rig.peer_write(&hello());
    let sent: [Vec<u8>; 3] = [
        b"hello".to_vec(),
        (0..3000).map(|i| i as u8).collect(),
        vec![],
    ];
    for (seq, payload) in sent.iter().enumerate() {
        rig.peer_write(&short_record(seq as u16, payload.len() as u32));
        rig.peer_write(payload);
    }
    // A framed message may follow a short one: one sequence for both.
    rig.peer_write(&data(DataFlags::NONE, 3, 2));
    rig.peer_write(b"ok");
    rig.read().unwrap();
    let got = rig.take_messages();
    let want: Vec<Result<Vec<u8>, Error>> = sent
        .iter()
        .cloned()
        .chain([b"ok".to_vec()])
        .map(Ok)
        .collect();
    assert_eq!(got, want, "every message, whole, in order");
    assert_eq!(rig.pool_used(), 0, "every buffer handed on and back");
}

/// What the peer writes, what the lane delivers first, the error it ends with.
type Case = (Vec<Vec<u8>>, Vec<Result<usize, Error>>, ProtocolError);

#[test]
fn a_bad_short_record_ends_that_lane_typed() {
    let mut reserved = short_record(0, 5);
    reserved[31] = 1;
    let mut tag_word = short_record(0, 5);
    tag_word[2] = 1;
    let with_payload = |r: [u8; 32]| [&r[..], b"hello"].concat();
    let close = Frame::Close(Close { seq: 0 }).encode(&[]);
    let cases: [Case; 7] = [
        (
            vec![hello().to_vec(), with_payload(short_record(5, 5))],
            vec![],
            ProtocolError::SequenceGap {
                expected: 0,
                got: 5,
            },
        ),
        (
            vec![
                hello().to_vec(),
                with_payload(short_record(0, 5)),
                with_payload(short_record(0, 5)),
            ],
            vec![Ok(5)],
            ProtocolError::Duplicate { seq: 0 },
        ),
        (
            vec![hello().to_vec(), with_payload(reserved)],
            vec![],
            ProtocolError::Decode(DecodeError::ReservedBits),
        ),
        (
            vec![hello().to_vec(), with_payload(tag_word)],
            vec![],
            ProtocolError::Decode(DecodeError::ReservedBits),
        ),
        (
            vec![hello().to_vec(), short_record(0, 2 << 20).to_vec()],
            vec![],
            ProtocolError::Decode(DecodeError::TooLong {
                len: 2 << 20,
                max: 64 << 10,
            }),
        ),
        // Before the peer's Hello: the lane has not said it takes them.
        (
            vec![with_payload(short_record(0, 5))],
            vec![],
            ProtocolError::HeaderlessRefused,
        ),
        (
            vec![
                hello().to_vec(),
                close.to_vec(),
                with_payload(short_record(0, 5)),
            ],
            vec![Err(Error::PeerClosed(PEER))],
            ProtocolError::AfterClose,
        ),
    ];
    for (writes, first, want) in cases {
        let mut rig = LaneRig::new(1 << 16, 1 << 20).unwrap();
        for w in &writes {
            rig.peer_write(w);
        }
        match rig.read() {
            Err(Error::Protocol { error, .. }) => assert_eq!(error, want),
            other => panic!("expected {want:?}, got {other:?}"),
        }
        assert!(!rig.alive(), "the lane ended");
        assert_eq!(
            rig.take_delivered(),
            first,
            "nothing of the bad record delivered"
        );
    }
}

/// A large message goes by a single copy behind a short record too: the
/// sender's record and descriptor, written into a second lane, bring the
/// sender's bytes (`process_vm_readv` of this same process).
#[test]
fn a_single_copy_message_goes_behind_a_short_record_and_arrives_whole() {
    let mut sender = LaneRig::new(1 << 16, 1 << 20).unwrap();
    greet(&mut sender, hello_taking(Takes::HEADERLESS));
    let message: Vec<u8> = (0..48 << 10).map(|i| (i % 251) as u8).collect();
    assert_eq!(sender.send_direct(&message), Ok(false), "its caller waits");
    let out = sender.peer_take();
    assert_eq!(out.len(), 32 + 40, "a record and a descriptor");
    assert_eq!(out[..32], short_record(0, 48 << 10), "a short record");
    let mut receiver = LaneRig::new(1 << 16, 1 << 20).unwrap();
    receiver.peer_write(&hello());
    receiver.peer_write(&out);
    receiver.read().unwrap();
    assert_eq!(
        receiver.take_messages(),
        [Ok(message)],
        "the sender's bytes"
    );
}

/// The single-copy descriptors in what a lane wrote: each message's 72
/// bytes (its 32-byte record or header, then the descriptor).
fn descriptors(out: &[u8]) -> Vec<SingleCopyDesc> {
    assert_eq!(
        out.len() % (32 + SINGLE_COPY_DESC_BYTES),
        0,
        "{}",
        out.len()
    );
    out.chunks(32 + SINGLE_COPY_DESC_BYTES)
        .map(|m| SingleCopyDesc::parse(m[32..].try_into().unwrap()).expect("a descriptor"))
        .collect()
}

/// A lane whose pool is one shared-memory file names where a large message
/// lies in it; once the peer says it maps that file, the messages after go
/// *placed*: no claim, one at a time, each buffer held until the peer's
/// `placed_done` passes its ticket; a done past what was sent ends the lane.
#[test]
fn placed_messages_go_once_the_peer_maps_the_pool_file() {
    let mut rig = LaneRig::new_shared_up_to(1 << 16, 8 << 20, 1 << 20).unwrap();
    greet(&mut rig, hello_taking(Takes::HEADERLESS));
    let ino = rig.pool_file().expect("a shared pool");
    let base = rig.pool_used();
    rig.send_lease(48 << 10).unwrap();
    let one = rig.pool_used() - base; // a buffer of its class
    assert!(one >= 48 << 10);
    let first = descriptors(&rig.peer_take());
    assert_eq!(first.len(), 1);
    assert!(!first[0].placed, "claimed: the peer maps nothing yet");
    assert_eq!(first[0].place.map(|p| p.ino), Some(ino), "its place named");
    assert_eq!(
        rig.send_lease(48 << 10),
        Err(Error::WouldBlock),
        "nothing passes a claimed message"
    );
    rig.peer_copied(1);
    rig.peer_maps(ino);
    assert!(rig.flush().unwrap());
    assert_eq!(rig.pool_used(), base, "the claimed lease went back");
    for ticket in 1..=2 {
        rig.send_lease(48 << 10).unwrap();
        let placed = descriptors(&rig.peer_take());
        assert_eq!(
            placed
                .iter()
                .map(|d| (d.placed, d.ticket))
                .collect::<Vec<_>>(),
            [(true, ticket)],
            "placed, tickets of their own"
        );
        assert_eq!(placed[0].place.map(|p| p.ino), Some(ino));
        assert_eq!(rig.pool_used(), base + one, "held");
        assert_eq!(
            rig.send_lease(48 << 10),
            Err(Error::WouldBlock),
            "one placed message at a time"
        );
        assert_eq!(rig.flush(), Ok(false), "nothing moves before its done");
        rig.peer_placed_done(ticket);
        assert!(rig.flush().unwrap(), "a buffer going back is progress");
        assert_eq!(rig.pool_used(), base, "and back it went");
    }
    let c = rig.single_copies();
    assert_eq!((c.claimed, c.placed), (1, 2));
    rig.send_lease(48 << 10).unwrap();
    rig.peer_placed_done(9);
    assert!(
        matches!(rig.flush(), Err(Error::WireRule { .. })),
        "a done past the last placed message ends the lane"
    );
}

/// The receiving side: a placed message is copied out of the sender's
/// pool file (here this process's own, as a same-host peer's would be),
/// its done stored; the first, claimed, one tells the sender the file is
/// mapped.
#[test]
fn a_placed_message_arrives_whole_out_of_the_senders_pool_file() {
    let mut sender = LaneRig::new_shared(1 << 16, 4 << 20).unwrap();
    greet(&mut sender, hello_taking(Takes::HEADERLESS));
    let mut receiver = LaneRig::new(1 << 16, 4 << 20).unwrap();
    receiver.peer_write(&hello());
    let a: Vec<u8> = (0..48 << 10).map(|i| (i % 251) as u8).collect();
    let b: Vec<u8> = (0..40 << 10).map(|i| (i % 241) as u8).collect();
    sender.send_lease_of(&a).unwrap();
    receiver.peer_write(&sender.peer_take());
    receiver.read().unwrap();
    let ino = sender.pool_file().unwrap();
    assert_eq!(receiver.told_peer(), (ino, 0), "it says it maps the file");
    sender.peer_copied(1);
    sender.peer_maps(ino);
    sender.send_lease_of(&b).unwrap();
    let out = sender.peer_take();
    assert!(descriptors(&out)[0].placed);
    receiver.peer_write(&out);
    receiver.read().unwrap();
    assert_eq!(receiver.take_messages(), [Ok(a), Ok(b)], "in order, whole");
    assert_eq!(receiver.told_peer(), (ino, 1), "the placed one done");
    assert_eq!(receiver.single_copies().mapped, 2, "both out of the file");
}

/// A caller's slice (as `Endpoint::send` gives it, the caller waiting) goes
/// by the claim word, read out of the slice itself, even to a peer that
/// maps this side's pool file: no pool buffer is taken for it, the caller
/// is not done until the peer has copied it, and nothing passes it
/// meanwhile. (Copied into the
/// pool and placed instead, its bytes crossed between the two cores twice,
/// written in and read out: BENCHMARKS.md.) A pool buffer after it goes
/// placed. All arrive whole and in order.
#[test]
fn a_large_slice_goes_by_the_claim_word_even_to_a_peer_that_maps_the_pool_file() {
    let pattern = |len: usize, m: usize| -> Vec<u8> { (0..len).map(|i| (i % m) as u8).collect() };
    let (a, b, c) = (
        pattern(48 << 10, 251),
        pattern(40 << 10, 241),
        pattern(36 << 10, 239),
    );
    let mut sender = LaneRig::new_shared(1 << 16, 4 << 20).unwrap();
    greet(&mut sender, hello_taking(Takes::HEADERLESS));
    let mut receiver = LaneRig::new(1 << 16, 4 << 20).unwrap();
    receiver.peer_write(&hello());
    let ino = sender.pool_file().unwrap();
    // A pool buffer shows the peer the file, which it maps.
    sender.send_lease_of(&a).unwrap();
    receiver.peer_write(&sender.peer_take());
    receiver.read().unwrap();
    assert_eq!(receiver.told_peer(), (ino, 0), "the peer maps the file");
    sender.peer_copied(1);
    sender.peer_maps(ino);
    assert!(sender.flush().unwrap());
    let base = sender.pool_used();

    assert_eq!(sender.send_direct(&b), Ok(false), "the caller waits");
    let out = sender.peer_take();
    let d = descriptors(&out)[0];
    assert_eq!(
        (d.placed, d.place, d.ticket, d.addr),
        (false, None, 2, b.as_ptr() as u64),
        "by the claim word, out of the caller's slice"
    );
    assert_eq!(sender.pool_used(), base, "no pool buffer for it");
    assert_eq!(
        sender.send_lease_of(&c),
        Err(Error::WouldBlock),
        "nothing passes a claimed message"
    );
    assert_eq!(sender.continue_send(&b), Ok(false), "not copied yet");
    receiver.peer_write(&out);
    receiver.read().unwrap();
    sender.peer_copied(2);
    assert_eq!(
        sender.continue_send(&b),
        Ok(true),
        "copied: the caller goes"
    );
    assert!(sender.flush().is_ok());

    sender.send_lease_of(&c).unwrap();
    let out = sender.peer_take();
    let d = descriptors(&out)[0];
    assert_eq!((d.placed, d.ticket), (true, 1), "a pool buffer goes placed");
    receiver.peer_write(&out);
    receiver.read().unwrap();
    assert_eq!(receiver.told_peer(), (ino, 1));
    sender.peer_placed_done(1);
    assert!(sender.flush().unwrap());
    assert_eq!(sender.pool_used(), base, "every buffer back");
    let copies = sender.single_copies();
    assert_eq!((copies.claimed, copies.placed), (2, 1));
    assert_eq!(
        receiver.take_messages(),
        [Ok(a), Ok(b), Ok(c)],
        "whole, in order"
    );
}

/// A lane dropped before its session finished gives a claimed or placed
/// message's buffer back to its pool at once, and the application's next
/// lease writes it; the lane says so first, in its ring's `ended` word, and
/// a receiver whose copy ends after that word is set loses the lane instead
/// of delivering the new bytes as the old message.
#[test]
fn a_message_copied_after_its_sender_dropped_the_lane_is_lost_not_delivered_with_reused_bytes() {
    copied_after_the_sender_ended(|sender, _| sender.drop_lane());
}

/// The same where the lane ends on its own side's error (the peer's word
/// about the message in flight is impossible: a done past what was sent),
/// and the wire drops it as it drops any lane whose flush failed.
#[test]
fn a_message_copied_after_its_sender_failed_the_lane_is_lost_not_delivered_with_reused_bytes() {
    copied_after_the_sender_ended(|sender, placed| {
        let held = sender.pool_used();
        if placed {
            sender.peer_placed_done(99);
        } else {
            sender.peer_copied(99);
        }
        assert!(
            matches!(sender.flush(), Err(Error::WireRule { .. })),
            "{placed}: an impossible word ends the lane"
        );
        assert!(!sender.lane_ended(), "{placed}: not until the lane goes");
        assert_eq!(sender.pool_used(), held, "{placed}: its buffer still held");
        sender.drop_lane(); // as the wire drops a lane whose flush failed
    });
}

/// A claimed and then a placed 48 KiB message in flight when `end` ends the
/// sending lane; the receiver's copy ends after that.
fn copied_after_the_sender_ended(end: impl Fn(&mut LaneRig, bool)) {
    for placed in [false, true] {
        let mut sender = LaneRig::new_shared(1 << 16, 4 << 20).unwrap();
        greet(&mut sender, hello_taking(Takes::HEADERLESS));
        let mut receiver = LaneRig::new(1 << 16, 4 << 20).unwrap();
        receiver.peer_write(&hello());
        let a: Vec<u8> = (0..48 << 10).map(|i| (i % 251) as u8).collect();
        let b: Vec<u8> = (0..48 << 10).map(|i| (i % 241) as u8).collect();
        sender.send_lease_of(&a).unwrap();
        let mut out = sender.peer_take();
        let mut expect = vec![];
        if placed {
            receiver.peer_write(&out);
            receiver.read().unwrap();
            let ino = sender.pool_file().unwrap();
            assert_eq!(receiver.told_peer(), (ino, 0), "it maps the file");
            sender.peer_copied(1);
            sender.peer_maps(ino);
            sender.send_lease_of(&b).unwrap();
            out = sender.peer_take();
            expect.push(Ok(a.clone()));
        }
        let desc = descriptors(&out)[0];
        assert_eq!(desc.placed, placed);
        assert!(!sender.lane_ended(), "a lane that stands has not ended");
        end(&mut sender, placed);
        assert!(
            sender.lane_ended(),
            "{placed}: ended unfinished, it says so"
        );
        assert_eq!(
            sender.scribble(48 << 10, 0xEE).unwrap(),
            desc.addr,
            "{placed}: the message's buffer, written again"
        );
        receiver.peer_write(&out);
        // The drop races the receiver's copy: the word comes after the
        // bytes and before the receiver's look.
        receiver.peer_ends_during_next_copy();
        assert!(
            matches!(receiver.read(), Err(Error::PeerLost(PEER))),
            "{placed}: the lane is lost"
        );
        assert!(!receiver.alive());
        assert_eq!(receiver.take_messages(), expect, "{placed}: not delivered");
        assert_eq!(receiver.pool_used(), 0, "{placed}: no buffer held");
    }
}

/// A placed descriptor is checked as a claimed one is: a ticket out of its
/// sequence, a mode past 1, a placed one naming no file, or bytes that
/// neither the named file nor the sender's memory give, each end the lane
/// typed, nothing of it delivered and no buffer held.
#[test]
fn a_bad_placed_descriptor_ends_that_lane_typed() {
    let readable: Vec<u8> = vec![7; 40 << 10];
    let good = SingleCopyDesc {
        addr: readable.as_ptr() as u64,
        ticket: 1,
        place: Some(SharedPlace {
            fd: u32::MAX - 1, // no such descriptor here
            ino: 1,
            offset: 0,
        }),
        placed: true,
    };
    let mut mode = good.encode();
    mode[20] = 2;
    let mut no_file = good.encode();
    no_file[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
    let cases: Vec<(&str, [u8; SINGLE_COPY_DESC_BYTES])> = vec![
        (
            "a ticket out of its sequence",
            SingleCopyDesc { ticket: 2, ..good }.encode(),
        ),
        ("a mode past 1", mode),
        ("placed, naming no file", no_file),
        (
            "bytes nowhere to be read",
            SingleCopyDesc { addr: 8, ..good }.encode(),
        ),
    ];
    for (what, desc) in cases {
        let mut rig = LaneRig::new(1 << 16, 4 << 20).unwrap();
        rig.peer_write(&hello());
        rig.peer_write(&data(DataFlags::NONE, 0, 40 << 10));
        rig.peer_write(&desc);
        assert!(
            matches!(rig.read(), Err(Error::WireRule { .. })),
            "{what}: a typed end"
        );
        assert!(!rig.alive(), "{what}");
        assert!(rig.take_delivered().is_empty(), "{what}: nothing delivered");
        assert_eq!(rig.pool_used(), 0, "{what}: no buffer held");
    }
    // The good one, for contrast: the named file fails, the sender's
    // memory (this process's) gives the bytes.
    let mut rig = LaneRig::new(1 << 16, 4 << 20).unwrap();
    rig.peer_write(&hello());
    rig.peer_write(&data(DataFlags::NONE, 0, 40 << 10));
    rig.peer_write(&good.encode());
    rig.read().unwrap();
    assert_eq!(rig.take_messages(), [Ok(readable.clone())]);
    assert_eq!(rig.told_peer().1, 1, "its done stored");
}

/// A claimed message from `source` (in this process, as the peer's memory),
/// ticket `ticket`, written into the rig's ring.
fn peer_claimed(rig: &mut LaneRig, ticket: u64, seq: u64, source: &[u8]) {
    rig.peer_write(&data(DataFlags::NONE, seq, source.len() as u32));
    let desc = SingleCopyDesc {
        addr: source.as_ptr() as u64,
        ticket,
        place: None,
        placed: false,
    };
    rig.peer_write(&desc.encode());
}

/// A claimed message of 64 KiB or more is copied by both sides: the
/// receiver offers the tail to the sender before it reads the head. Not
/// taken, the receiver takes the offer back and reads the tail itself; a
/// shorter message offers nothing.
#[test]
fn a_long_claimed_message_offers_its_tail_and_takes_it_back_unhelped() {
    let mut rig = LaneRig::new(1 << 16, 4 << 20).unwrap();
    rig.peer_write(&hello());
    let short: Vec<u8> = (0..40 << 10).map(|i| (i % 251) as u8).collect();
    let long: Vec<u8> = (0..64 << 10).map(|i| (i % 241) as u8).collect();
    assert_eq!(help_split(short.len(), false), None);
    assert_eq!(help_split(long.len(), false), Some(32 << 10));
    peer_claimed(&mut rig, 1, 0, &short);
    rig.read().unwrap();
    assert_eq!(rig.take_messages(), [Ok(short)]);
    assert_eq!(rig.peer_help_word(), 0, "no offer for a short one");
    peer_claimed(&mut rig, 2, 1, &long);
    rig.read().unwrap();
    assert_eq!(rig.take_messages(), [Ok(long)], "the tail read by the lane");
    assert_eq!(
        rig.peer_help_word(),
        claim_word(2, HELP_IDLE),
        "offered, and taken back"
    );
    assert_eq!(rig.pool_used(), 0);
}

/// A sender that takes the offer and writes the tail is waited for and
/// believed: the message is the head the receiver read and the tail the
/// sender wrote (here other bytes than its source's, to tell them apart).
#[test]
fn a_tail_the_sender_wrote_is_the_messages() {
    let mut rig = LaneRig::new(1 << 16, 4 << 20).unwrap();
    rig.peer_write(&hello());
    let source: Vec<u8> = (0..64 << 10).map(|i| (i % 241) as u8).collect();
    let at = help_split(source.len(), false).unwrap();
    let tail = vec![0xA5u8; source.len() - at];
    rig.peer_helps_during_next_copy(tail.clone(), None);
    peer_claimed(&mut rig, 1, 0, &source);
    rig.read().unwrap();
    let mut expect = source[..at].to_vec();
    expect.extend_from_slice(&tail);
    assert_eq!(rig.take_messages(), [Ok(expect)]);
    assert_eq!(rig.peer_help_word(), claim_word(1, HELP_DONE));
    assert_eq!(rig.pool_used(), 0);
}

/// A help word naming another message than the one read ends the lane
/// typed, nothing delivered and no buffer held.
#[test]
fn a_help_word_of_another_message_ends_that_lane_typed() {
    for word in [claim_word(2, HELP_DONE), claim_word(0, HELP_OFFERED)] {
        let mut rig = LaneRig::new(1 << 16, 4 << 20).unwrap();
        rig.peer_write(&hello());
        let source = vec![3u8; 64 << 10];
        rig.peer_helps_during_next_copy(Vec::new(), Some(word));
        peer_claimed(&mut rig, 1, 0, &source);
        assert!(
            matches!(rig.read(), Err(Error::WireRule { .. })),
            "{word:#x}: a typed end"
        );
        assert!(!rig.alive());
        assert!(rig.take_delivered().is_empty(), "{word:#x}: not delivered");
        assert_eq!(rig.pool_used(), 0, "{word:#x}: no buffer held");
    }
}

/// A live sender that takes the tail and never says it wrote it costs the
/// receiver that lane after half a second, not its thread for good; the
/// buffer it may still write into stays out of the pool while it lives
/// (here it is this process: for good).
#[test]
fn a_tail_taken_and_never_written_ends_that_lane_after_a_while() {
    let mut rig = LaneRig::new(1 << 16, 4 << 20).unwrap();
    rig.peer_write(&hello());
    let source = vec![3u8; 64 << 10];
    rig.peer_helps_during_next_copy(Vec::new(), Some(claim_word(1, HELP_TAKEN)));
    peer_claimed(&mut rig, 1, 0, &source);
    let start = std::time::Instant::now();
    assert!(matches!(rig.read(), Err(Error::WireRule { .. })));
    let waited = start.elapsed();
    assert!(
        waited >= std::time::Duration::from_millis(500),
        "{waited:?}: the wait's bound"
    );
    assert!(!rig.alive());
    assert!(rig.take_delivered().is_empty());
    assert!(
        rig.pool_used() >= 64 << 10,
        "the buffer the peer may still write into is not back"
    );
}

/// A sender waiting for its claimed message writes the tail it is offered
/// straight into the receiver's buffer (here this process's), says DONE,
/// and counts it; an offer for another ticket it leaves alone.
#[test]
fn a_waiting_sender_writes_the_tail_it_is_offered() {
    let mut rig = LaneRig::new(1 << 16, 4 << 20).unwrap();
    greet(&mut rig, hello_taking(Takes::HEADERLESS));
    let message: Vec<u8> = (0..64 << 10).map(|i| (i % 239) as u8).collect();
    let at = help_split(message.len(), false).unwrap();
    assert_eq!(rig.send_direct(&message), Ok(false), "waits for the peer");
    assert_eq!(descriptors(&rig.peer_take())[0].ticket, 1);
    rig.peer_claims(1);
    let mut dst = vec![0u8; message.len() - at];
    rig.peer_offers_tail(2, dst.as_mut_ptr() as u64);
    assert_eq!(rig.continue_send(&message), Ok(false));
    assert_eq!(
        rig.help_word(),
        claim_word(2, HELP_OFFERED),
        "not its ticket"
    );
    assert_eq!(rig.single_copies().helped, 0);
    assert!(
        !rig.prepare_sleep(),
        "another ticket's offer does not keep it awake"
    );
    rig.peer_offers_tail(1, dst.as_mut_ptr() as u64);
    assert_eq!(
        rig.continue_send(&message),
        Ok(false),
        "still read by the peer"
    );
    assert_eq!(rig.help_word(), claim_word(1, HELP_DONE));
    assert!(dst == message[at..], "the tail written where offered");
    assert_eq!(rig.single_copies().helped, 1);
    rig.peer_copied(1);
    assert_eq!(rig.continue_send(&message), Ok(true), "done");
}

/// A tail whose write the kernel refuses (here a destination the peer
/// cannot be written at: a read-only page, EFAULT; elsewhere another
/// user or a ptrace policy, EPERM) is handed back, not done: the peer
/// copies it itself. The sender takes no offer after that.
#[test]
fn a_sender_whose_tail_write_is_refused_hands_it_back_and_takes_no_more_offers() {
    let mut rig = LaneRig::new(1 << 16, 4 << 20).unwrap();
    greet(&mut rig, hello_taking(Takes::HEADERLESS));
    let message: Vec<u8> = (0..64 << 10).map(|i| (i % 239) as u8).collect();
    let at = help_split(message.len(), false).unwrap();
    let tail = message.len() - at;
    // SAFETY: a fresh anonymous mapping, unmapped below; nothing else uses it.
    let read_only = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            tail,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(read_only, libc::MAP_FAILED);
    assert_eq!(rig.send_direct(&message), Ok(false), "waits for the peer");
    rig.peer_claims(1);
    rig.peer_offers_tail(1, read_only as u64);
    assert_eq!(rig.continue_send(&message), Ok(false));
    assert_eq!(
        rig.help_word(),
        claim_word(1, HELP_IDLE),
        "handed back: the peer reads the tail"
    );
    assert_eq!(rig.single_copies().helped, 0);
    rig.peer_copied(1);
    assert_eq!(rig.continue_send(&message), Ok(true), "done");
    // The next message's offer, to a writable buffer, is left to the peer.
    assert_eq!(rig.send_direct(&message), Ok(false));
    assert_eq!(
        descriptors(&rig.peer_take()).last().map(|d| d.ticket),
        Some(2)
    );
    rig.peer_claims(2);
    let mut dst = vec![0u8; tail];
    rig.peer_offers_tail(2, dst.as_mut_ptr() as u64);
    assert_eq!(rig.continue_send(&message), Ok(false));
    assert_eq!(
        rig.help_word(),
        claim_word(2, HELP_OFFERED),
        "no more offers taken"
    );
    assert!(dst.iter().all(|&b| b == 0), "nothing written");
    assert!(
        !rig.prepare_sleep(),
        "an offer it will not take does not keep it awake"
    );
    rig.peer_copied(2);
    assert_eq!(rig.continue_send(&message), Ok(true));
    // SAFETY: the mapping made above, of that length.
    assert_eq!(unsafe { libc::munmap(read_only, tail) }, 0);
}

/// A placed message's tail (1 MiB and up) is offered under its placed ticket: the sender,
/// looking whether the peer is done with it, writes the tail and says so,
/// and not for the same number as a claimed ticket.
#[test]
fn a_sender_writes_the_tail_of_a_placed_message_it_is_offered() {
    let mut rig = LaneRig::new_shared(1 << 16, 4 << 20).unwrap();
    greet(&mut rig, hello_taking(Takes::HEADERLESS));
    let ino = rig.pool_file().expect("a shared pool");
    let base = rig.pool_used();
    rig.peer_maps(ino);
    let message: Vec<u8> = (0..1 << 20).map(|i| (i % 239) as u8).collect();
    assert_eq!(
        help_split(64 << 10, true),
        None,
        "a short placed one: no help"
    );
    let at = help_split(message.len(), true).unwrap();
    rig.send_lease_of(&message).unwrap();
    let placed = descriptors(&rig.peer_take());
    assert_eq!((placed[0].placed, placed[0].ticket), (true, 1));
    let mut dst = vec![0u8; message.len() - at];
    rig.peer_offers_tail(1, dst.as_mut_ptr() as u64);
    rig.flush().unwrap();
    assert_eq!(
        rig.help_word(),
        claim_word(1, HELP_OFFERED),
        "claimed ticket 1 is not placed ticket 1"
    );
    rig.peer_offers_tail(1 | PLACED_TICKET, dst.as_mut_ptr() as u64);
    rig.flush().unwrap();
    assert_eq!(rig.help_word(), claim_word(1 | PLACED_TICKET, HELP_DONE));
    assert!(dst == message[at..], "the tail written where offered");
    assert_eq!(rig.single_copies().helped, 1);
    rig.peer_placed_done(1);
    rig.flush().unwrap();
    assert_eq!(rig.pool_used(), base, "its buffer back");
}

/// A file of the peer's, sealed (or not) as the test says, `len` bytes.
fn peer_file(len: u64, flags: libc::c_uint, seals: libc::c_int) -> Option<OwnedFd> {
    // SAFETY: a NUL-terminated name and valid flags.
    let fd = unsafe { libc::memfd_create(c"peer".as_ptr(), libc::MFD_ALLOW_SEALING | flags) };
    if fd < 0 {
        return None; // hugetlbfs memfds are not everywhere
    }
    // SAFETY: a descriptor just opened and owned by no one else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: live descriptors, plain integer arguments.
    unsafe {
        assert_eq!(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t), 0);
        assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals), 0);
    }
    Some(fd)
}

fn inode(fd: &OwnedFd) -> u64 {
    // SAFETY: `st` is written by fstat before it is read.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a live descriptor and a stat buffer of its size.
    assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0);
    st.st_ino
}

/// A descriptor may name any file of the peer's: one that is not a sealed
/// tmpfs file within what this side maps (twice its pool's budget), or not
/// the file the descriptor's inode says, is never mapped — its bytes come
/// the other way (`process_vm_readv` of the address). Before the checks, a
/// hugetlbfs memfd without huge pages behind it killed the receiver with
/// SIGBUS, and a sparse file of any size took its address space.
#[test]
fn a_peer_file_that_is_not_a_sealed_tmpfs_file_within_the_limit_is_read_the_other_way() {
    let sealed = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    let bytes: Vec<u8> = (0..40 << 10).map(|i| (i % 239) as u8).collect();
    // The rig's pool is 4 MiB: it maps at most 8 MiB of the peer's files.
    let files = [
        (
            "hugetlbfs",
            peer_file(2 << 20, libc::MFD_HUGETLB, sealed),
            None,
        ),
        ("not sealed", peer_file(1 << 20, 0, libc::F_SEAL_SEAL), None),
        ("past the limit", peer_file(1 << 30, 0, sealed), None),
        ("another inode", peer_file(1 << 20, 0, sealed), Some(1)),
    ];
    for (what, file, ino) in files {
        let Some(file) = file else {
            eprintln!("{what}: SKIPPED (this kernel makes no such memfd)");
            continue;
        };
        let mut rig = LaneRig::new(1 << 16, 4 << 20).unwrap();
        rig.peer_write(&hello());
        rig.peer_write(&data(DataFlags::NONE, 0, 40 << 10));
        let desc = SingleCopyDesc {
            addr: bytes.as_ptr() as u64,
            ticket: 1,
            place: Some(SharedPlace {
                fd: file.as_raw_fd() as u32,
                ino: ino.unwrap_or_else(|| inode(&file)),
                offset: 0,
            }),
            placed: false,
        };
        rig.peer_write(&desc.encode());
        rig.read().unwrap();
        assert_eq!(rig.take_messages(), [Ok(bytes.clone())], "{what}");
        assert_eq!(rig.told_peer().0, 0, "{what}: not mapped");
        assert_eq!(rig.single_copies().mapped, 0, "{what}");
    }
    // A good file, for contrast: mapped, and said so.
    let file = peer_file(1 << 20, 0, sealed).unwrap();
    let mut rig = LaneRig::new(1 << 16, 4 << 20).unwrap();
    rig.peer_write(&hello());
    rig.peer_write(&data(DataFlags::NONE, 0, 40 << 10));
    let desc = SingleCopyDesc {
        addr: 8,
        ticket: 1,
        place: Some(SharedPlace {
            fd: file.as_raw_fd() as u32,
            ino: inode(&file),
            offset: 4096,
        }),
        placed: false,
    };
    rig.peer_write(&desc.encode());
    rig.read().unwrap();
    assert_eq!(rig.take_messages(), [Ok(vec![0; 40 << 10])], "its zeros");
    assert_eq!(rig.told_peer().0, inode(&file));
}

/// A peer that drips a message into the ring, a byte every 100 ms (never
/// silent for the idle timeout), held its receive buffer for as long as it
/// liked; past the idle timeout's grace it must keep up the minimum rate
/// (64 KiB/s): dropped `Stalled { Slow }`, nothing delivered, the buffer
/// back. A framed header and a short record alike; and a peer that writes
/// 400 bytes every 100 ms a byte at a time (4 KB/s), each byte a chunk of
/// the ring's: its bytes count, not the 64 of ring each takes.
#[test]
fn a_peer_that_drips_a_message_is_dropped_at_the_minimum_rate() {
    let idle = idle_micros();
    // Under the single-copy length: the bytes come through the ring. Read
    // before each side pass, or left for the side pass alone (as while a
    // progress thread leaves reading to an application thread): a byte
    // found waiting at a look is read and counted, not excused.
    let heads = [data(DataFlags::NONE, 0, 30_000), short_record(0, 30_000)];
    let cases = heads
        .into_iter()
        .flat_map(|h| [(h, true), (h, false)])
        .flat_map(|(h, r)| [(h, r, 1), (h, r, 400)]);
    for (head, reads, per_tick) in cases {
        let mut rig = LaneRig::new(1 << 16, 1 << 20).unwrap();
        rig.peer_write(&hello());
        rig.read_at(1).unwrap();
        rig.peer_write(&head);
        rig.read_at(1).unwrap();
        let mut t = 100_000;
        let failed = loop {
            for _ in 0..per_tick {
                rig.peer_write(&[7]);
            }
            let read = if reads { rig.read_at(t) } else { Ok(()) };
            if let Err(e) = read.and_then(|()| rig.tend_at(t)) {
                break (t, e);
            }
            assert!(t < 3 * idle, "the dripping peer was kept");
            t += 100_000;
        };
        let Error::Protocol { error, .. } = failed.1 else {
            panic!("{failed:?}")
        };
        assert_eq!(
            error,
            ProtocolError::Stalled {
                during: Stall::Slow
            }
        );
        // The idle timeout's grace from the first side pass after its
        // header, then the first pass past it and what the bytes so far
        // earned (at most 5.5 s of 4 KB/s: a third of a second).
        let earned = if per_tick > 1 { 400_000 } else { 0 };
        assert!(
            failed.0 > idle && failed.0 <= idle + 300_000 + earned,
            "{} ({per_tick} a tick, reads {reads})",
            failed.0
        );
        assert!(rig.take_delivered().is_empty(), "nothing of it delivered");
        assert_eq!(rig.pool_used(), 0, "its receive buffer back");
    }
}

/// A record alone holds no receive buffer: one of a message in the ring is
/// leased once its first payload bytes are there, one of a single-copy
/// message once its whole descriptor is. (Each was leased at the record:
/// hundreds of lanes that wrote a record for a large message and nothing
/// more held a buffer each, the pool's whole budget, until their timeout.)
#[test]
fn a_record_alone_holds_no_receive_buffer() {
    // In the ring: a record, then its bytes in two parts.
    let mut rig = LaneRig::new(1 << 16, 1 << 20).unwrap();
    rig.peer_write(&hello());
    rig.read().unwrap();
    let payload: Vec<u8> = (0..3000).map(|i| i as u8).collect();
    rig.peer_write(&short_record(0, payload.len() as u32));
    rig.read().unwrap();
    assert_eq!(rig.pool_used(), 0, "held at the record alone");
    rig.peer_write(&payload[..1000]);
    rig.read().unwrap();
    assert!(rig.pool_used() >= payload.len(), "leased once bytes came");
    rig.peer_write(&payload[1000..]);
    rig.read().unwrap();
    assert_eq!(rig.take_messages(), vec![Ok(payload)]);
    assert_eq!(rig.pool_used(), 0);
}

/// As `a_record_alone_holds_no_receive_buffer`, for a single-copy message:
/// its record, then part of its descriptor.
#[test]
fn a_single_copy_record_holds_no_receive_buffer_before_its_descriptor() {
    let mut rig = LaneRig::new_shared(1 << 16, 1 << 20).unwrap();
    greet(&mut rig, hello());
    rig.peer_write(&short_record(0, 48 << 10));
    rig.read().unwrap();
    rig.peer_write(&[0u8; SINGLE_COPY_DESC_BYTES - 1]);
    rig.read().unwrap();
    assert_eq!(rig.pool_used(), 0, "held before the whole descriptor came");
    assert!(rig.take_delivered().is_empty());
}

/// A long message from another user's process is read whole by this side:
/// its tail is not offered (that process cannot write here, and one that
/// took the tail could hold this side's reader, keep the buffer, or say it
/// wrote what it did not).
#[test]
fn a_sender_of_another_user_is_offered_no_tail() {
    let mut rig = LaneRig::new(1 << 16, 4 << 20).unwrap();
    rig.peer_of_another_user();
    rig.peer_write(&hello());
    let long: Vec<u8> = (0..64 << 10).map(|i| (i % 241) as u8).collect();
    assert!(help_split(long.len(), false).is_some());
    // A sender that would take an offer and say it wrote the tail.
    rig.peer_helps_during_next_copy(vec![0xA5; 32 << 10], None);
    peer_claimed(&mut rig, 1, 0, &long);
    rig.read().unwrap();
    let got = rig.take_messages();
    assert!(
        got == [Ok(long)],
        "not the sender's bytes: the tail was offered"
    );
    assert_eq!(rig.peer_help_word(), 0, "no offer made");
    assert_eq!(rig.pool_used(), 0);
}

/// Bytes waiting in the ring keep awake a sleeper that would read them, not
/// one that waits to send, connect or close (a lane held by a full inbox has
/// bytes for as long as the inbox is full: such a wait spun a core).
#[test]
fn bytes_in_the_ring_keep_awake_only_a_sleeper_that_reads() {
    let mut rig = LaneRig::new(1 << 16, 1 << 20).unwrap();
    greet(&mut rig, hello());
    rig.peer_write(&short_record(0, 5));
    rig.peer_write(b"hello");
    assert!(rig.prepare_sleep(), "a reader stays up for them");
    assert!(!rig.prepare_sleep_not_reading(), "a sender sleeps");
    rig.read().unwrap();
    assert_eq!(rig.take_messages(), [Ok(b"hello".to_vec())]);
    assert!(!rig.prepare_sleep(), "nothing left: a reader sleeps too");
}
