//! The mock backend end to end: pool + software NIC + link + fault injector.
//! Nothing is lost silently, nothing after a fault is delivered, and nothing leaks.
#![cfg(all(feature = "mock", feature = "std"))]

use std::sync::Arc;

use zerohop_backends::mock::{
    Arena, FaultCounts, FaultPlan, Faulty, Link, LinkEnd, MockLink, MockNic, MockTransport,
};
use zerohop_backends::{host_bytes, HostBell, HostMemory, HostPool, Nic};
use zerohop_core::pool::{Chunks, InlineTables};
use zerohop_core::session::{Instant, ProtocolError, Stall};
use zerohop_core::wire::DecodeError;
use zerohop_core::{
    Error, Lease, PeerId, PoolConfig, PoolError, RegisterError, Registrar, SizeClasses, Transport,
};

type Pool = HostPool<InlineTables<16, 256>>;
const PEER: PeerId = PeerId(0);

fn leak<T>(t: T) -> &'static T {
    Box::leak(Box::new(t))
}

/// A pool over a fresh arena, registered with a fresh NIC bounded to that arena.
fn pool(budget: usize) -> (Arc<Pool>, &'static MockNic) {
    let arena = Arena::new(Box::leak(vec![0u8; 1 << 20].into_boxed_slice()));
    let nic = leak(MockNic::new(Some(arena.region())));
    let mut cfg = PoolConfig::with_budget(budget);
    cfg.chunk_bytes = 64 << 10;
    cfg.classes = SizeClasses::new(&[256, 4096, 16384]).unwrap();
    let source = Chunks {
        memory: HostMemory::Arena(arena),
        registrar: Some(Nic::Mock(nic)),
    };
    (
        Arc::new(Pool::with_bell(source, cfg, InlineTables::new(), HostBell::default()).unwrap()),
        nic,
    )
}

fn message(i: u32) -> Vec<u8> {
    let len = (i as usize * 7919) % 3000;
    (0..len).map(|k| (k as u32 ^ i) as u8).collect()
}

#[test]
fn clean_link_delivers_every_message_once_in_order() {
    let link = leak(MockLink::<8192>::new());
    let (a, b) = link.ends();
    let (pa, _) = pool(256 << 10);
    let (pb, nic_b) = pool(256 << 10);
    let mut tx = MockTransport::new(a, pa.clone(), 4096);
    let mut rx = MockTransport::new(b, pb.clone(), 4096);
    let mut got = 0u32;
    // Under miri (~1000x slower) a few dozen messages cover the same paths.
    let n = if cfg!(miri) { 50 } else { 2000 };
    for i in 0..n {
        tx.try_send(PEER, &message(i)).unwrap();
        let r = rx.try_recv().unwrap();
        assert_eq!(host_bytes(&r.lease), &message(i)[..], "message {i}");
        got += 1;
    }
    assert_eq!(rx.try_recv().unwrap_err(), Error::WouldBlock);
    assert_eq!(got, n);
    assert_eq!(pb.used_bytes(), 0, "every receive lease went back");
    let registered = nic_b.stats().live;
    assert_eq!(
        registered as u64,
        pb.stats().grows,
        "one registration per chunk"
    );
    drop((rx, pb));
    assert_eq!(
        nic_b.stats().live,
        0,
        "dropping the pool deregisters every chunk"
    );
}

type End = LinkEnd<'static, 65536>;
type Sender = MockTransport<End, Arc<Pool>>;
type FaultyReceiver = MockTransport<Faulty<End, 4096>, Arc<Pool>>;

fn faulty_pair(plan: FaultPlan) -> (Sender, FaultyReceiver, Arc<Pool>) {
    let link = leak(MockLink::<65536>::new());
    let (a, b) = link.ends();
    let (pa, _) = pool(256 << 10);
    let (pb, _) = pool(256 << 10);
    let tx = MockTransport::new(a, pa, 4096);
    let rx = MockTransport::new(Faulty::<_, 4096>::new(b, plan), pb.clone(), 4096);
    (tx, rx, pb)
}

/// Sends `n` messages, then drains the receiver until the link is done,
/// sorting outcomes. Each message ends with its number.
fn run(plan: FaultPlan, n: u32) -> (Vec<u32>, Vec<Error>, FaultCounts, Arc<Pool>) {
    let (mut tx, mut rx, pb) = faulty_pair(plan);
    for i in 0..n {
        let mut m = message(i);
        m.truncate(200);
        m.extend_from_slice(&i.to_le_bytes());
        tx.try_send(PEER, &m).unwrap();
    }
    tx.close().unwrap(); // carries the message count: a lost tail shows
    let mut delivered = Vec::new();
    let mut errors = Vec::new();
    loop {
        match rx.try_recv() {
            Ok(r) => {
                let b = host_bytes(&r.lease);
                let id = u32::from_le_bytes(b[b.len() - 4..].try_into().unwrap());
                let mut want = message(id);
                want.truncate(200);
                want.extend_from_slice(&id.to_le_bytes());
                assert_eq!(b, &want[..], "a delivered message is intact");
                delivered.push(id);
            }
            Err(Error::Closed) => break,
            Err(Error::WouldBlock) => panic!("the link went quiet before its end was reported"),
            Err(e) => errors.push(e),
        }
    }
    let counts = rx.link().counts();
    (delivered, errors, counts, pb)
}

/// One behaviour on every wire: the first fault fails the peer with a typed
/// error, everything before it arrived in order, nothing after it is
/// delivered, and every buffer is back.
fn expect_failed_at(
    (delivered, errors, _, pool): &(Vec<u32>, Vec<Error>, FaultCounts, Arc<Pool>),
    good: u32,
    error: ProtocolError,
) {
    assert_eq!(
        delivered,
        &(0..good).collect::<Vec<_>>(),
        "in order, up to the fault"
    );
    assert_eq!(errors, &[Error::Protocol { peer: PEER, error }]);
    assert_eq!(pool.used_bytes(), 0, "every receive buffer back");
}

// Frames are counted from 1, the peer's hello first: frame k is message k - 2.

#[test]
fn a_dropped_frame_fails_the_peer_with_the_gap_and_nothing_after_it_arrives() {
    let r = run(
        FaultPlan {
            drop_every: 10,
            ..FaultPlan::default()
        },
        100,
    );
    assert_eq!(r.2.dropped, 1, "the link stops at the first fault");
    expect_failed_at(
        &r,
        8,
        ProtocolError::SequenceGap {
            expected: 8,
            got: 9,
        },
    );
}

#[test]
fn a_lost_tail_is_seen_at_the_close() {
    // Only the last message is lost: the close says how many were sent.
    let r = run(
        FaultPlan {
            drop_every: 6,
            ..FaultPlan::default()
        },
        5,
    );
    expect_failed_at(
        &r,
        4,
        ProtocolError::SequenceGap {
            expected: 4,
            got: 5,
        },
    );
}

#[test]
fn a_corrupted_frame_fails_its_checksum_and_is_not_delivered() {
    let r = run(
        FaultPlan {
            corrupt_every: 7,
            ..FaultPlan::default()
        },
        70,
    );
    assert_eq!(r.2.corrupted, 1);
    assert_eq!(r.0, (0..5).collect::<Vec<_>>());
    assert!(
        matches!(
            r.1[..],
            [Error::Protocol {
                peer: PEER,
                error: ProtocolError::Decode(DecodeError::BadChecksum { .. })
            }]
        ),
        "{:?}",
        r.1
    );
    assert_eq!(r.3.used_bytes(), 0);
}

#[test]
fn a_duplicated_frame_fails_the_peer_and_is_delivered_once() {
    let r = run(
        FaultPlan {
            duplicate_every: 5,
            ..FaultPlan::default()
        },
        50,
    );
    assert_eq!(r.2.duplicated, 1);
    expect_failed_at(&r, 4, ProtocolError::Duplicate { seq: 3 });
}

#[test]
fn a_reordered_frame_fails_the_peer_at_the_gap_it_opens() {
    let r = run(
        FaultPlan {
            reorder_every: 3,
            ..FaultPlan::default()
        },
        10,
    );
    assert_eq!(r.2.reordered, 1);
    expect_failed_at(
        &r,
        1,
        ProtocolError::SequenceGap {
            expected: 1,
            got: 2,
        },
    );
}

#[test]
fn a_peer_silent_before_its_hello_fails_after_the_idle_timeout() {
    let link = leak(MockLink::<8192>::new());
    let (a, _silent) = link.ends();
    let (pa, _) = pool(64 << 10);
    let mut tx = MockTransport::new(a, pa, 4096);
    assert_eq!(
        tx.try_send(PEER, b"x"),
        Err(Error::WouldBlock),
        "not open yet"
    );
    tx.set_now(Instant::from_micros(4_999_999));
    assert_eq!(tx.try_recv().unwrap_err(), Error::WouldBlock);
    tx.set_now(Instant::from_micros(5_000_000));
    assert_eq!(
        tx.try_recv().unwrap_err(),
        Error::Protocol {
            peer: PEER,
            error: ProtocolError::Stalled {
                during: Stall::Handshake
            }
        }
    );
    assert_eq!(tx.try_recv().unwrap_err(), Error::Closed);
    assert_eq!(tx.try_send(PEER, b"x"), Err(Error::UnknownPeer(PEER)));
}

#[test]
fn a_peer_of_another_version_is_refused_by_name() {
    let link = leak(MockLink::<8192>::new());
    let (a, mut raw) = link.ends();
    let (pa, _) = pool(64 << 10);
    let mut tx = MockTransport::new(a, pa, 4096);
    // A version-2 hello (the version before the same-host exchange).
    let mut v2 = [0u8; 32];
    v2[..4].copy_from_slice(&[0x5A, 0x48, 2, 3]);
    raw.transmit(&v2, &[]).unwrap();
    assert_eq!(
        tx.try_recv().unwrap_err(),
        Error::Protocol {
            peer: PEER,
            error: ProtocolError::Decode(DecodeError::UnsupportedVersion {
                theirs: 2,
                ours: zerohop_core::wire::VERSION
            })
        }
    );
}

#[test]
fn an_exhausted_pool_holds_messages_back_and_loses_none() {
    let link = leak(MockLink::<65536>::new());
    let (a, b) = link.ends();
    let (pa, _) = pool(256 << 10);
    let (pb, _) = pool(64 << 10); // one chunk: 16 buffers of 4 KiB
    let mut tx = MockTransport::new(a, pa, 4096);
    let mut rx = MockTransport::new(b, pb.clone(), 4096);
    for i in 0..20u32 {
        tx.try_send(PEER, &[i as u8; 3000]).unwrap();
    }
    let mut held = Vec::new();
    for _ in 0..16 {
        held.push(rx.try_recv().unwrap());
    }
    assert_eq!(
        rx.try_recv().unwrap_err(),
        Error::Pool(PoolError::Exhausted {
            used: 64 << 10,
            cap: 64 << 10
        })
    );
    held.clear(); // the app lets go of its buffers
    for i in 16..20u32 {
        let r = rx.try_recv().unwrap();
        assert_eq!(host_bytes(&r.lease)[0], i as u8, "held back, not lost");
    }
    assert_eq!(pb.used_bytes(), 0);
}

#[test]
fn registration_refused_mid_run_is_a_typed_error_and_recovers() {
    let link = leak(MockLink::<65536>::new());
    let (a, b) = link.ends();
    let (pa, _) = pool(256 << 10);
    let (pb, nic) = pool(256 << 10);
    let mut tx = MockTransport::new(a, pa, 32 << 10);
    let mut rx = MockTransport::new(b, pb.clone(), 32 << 10);
    tx.try_send(PEER, &[1; 100]).unwrap();
    drop(rx.try_recv().unwrap()); // first chunk (256 B class) registered
    nic.refuse_registrations(true);
    tx.try_send(PEER, &[2; 20_000]).unwrap(); // oversize: needs a fresh registration
    assert_eq!(
        rx.try_recv().unwrap_err(),
        Error::Register(RegisterError::Refused)
    );
    assert_eq!(
        pb.stats().reserved_bytes,
        64 << 10,
        "the refused chunk's memory went back"
    );
    nic.refuse_registrations(false);
    assert_eq!(
        host_bytes(&rx.try_recv().unwrap().lease),
        &[2; 20_000][..],
        "the message waited"
    );
    assert_eq!(pb.used_bytes(), 0);
}

#[test]
fn a_zero_copy_send_with_a_dead_key_is_refused_with_the_lease_back() {
    let link = leak(MockLink::<8192>::new());
    let (a, b) = link.ends();
    let (pa, nic) = pool(256 << 10);
    let (pb, _) = pool(256 << 10);
    let _rx = MockTransport::new(b, pb, 4096);
    let mut tx = MockTransport::new(a, pa.clone(), 4096).with_nic(nic);
    let lease = Lease::take(pa.clone(), 100).unwrap();
    tx.try_send_lease(PEER, lease).unwrap();
    let lease = Lease::take(pa.clone(), 100).unwrap();
    nic.deregister(lease.mr().unwrap()).unwrap(); // the chunk's registration vanishes under the lease
    let rejected = tx.try_send_lease(PEER, lease).unwrap_err();
    assert_eq!(rejected.error, Error::Backend("mock NIC: unknown lkey"));
    drop(rejected.lease);
    assert_eq!(pa.used_bytes(), 0);
}

#[test]
fn a_clean_close_is_reported_as_clean_on_both_sides() {
    let link = leak(MockLink::<8192>::new());
    let (a, b) = link.ends();
    let (pa, _) = pool(64 << 10);
    let (pb, _) = pool(64 << 10);
    let mut tx = MockTransport::new(a, pa, 4096);
    let mut rx = MockTransport::new(b, pb, 4096);
    tx.try_send(PEER, b"last words").unwrap();
    tx.close().unwrap();
    assert_eq!(tx.try_send(PEER, b"more"), Err(Error::Closed));
    assert_eq!(host_bytes(&rx.try_recv().unwrap().lease), b"last words");
    assert_eq!(rx.try_recv().unwrap_err(), Error::PeerClosed(PEER));
    assert_eq!(rx.try_recv().unwrap_err(), Error::Closed);
    // rx answered with its own close.
    assert_eq!(tx.try_recv().unwrap_err(), Error::PeerClosed(PEER));
    assert_eq!(tx.try_recv().unwrap_err(), Error::Closed);
    assert!(tx.session().is_finished() && rx.session().is_finished());
}

#[test]
fn oversize_messages_and_unknown_peers_are_refused() {
    let link = leak(MockLink::<8192>::new());
    let (a, b) = link.ends();
    let (pa, _) = pool(64 << 10);
    let (pb, _) = pool(64 << 10);
    let _rx = MockTransport::new(b, pb, 4096);
    let mut tx = MockTransport::new(a, pa, 4096);
    assert_eq!(
        tx.try_send(PEER, &[0; 4097]),
        Err(Error::TooLarge {
            len: 4097,
            max: 4096
        })
    );
    assert_eq!(
        tx.try_send(PeerId(3), &[0; 1]),
        Err(Error::UnknownPeer(PeerId(3)))
    );
}
