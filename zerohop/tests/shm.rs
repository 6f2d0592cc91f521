//! The same-host lane through the facade: peers on this host move from TCP
//! to shared memory, peers elsewhere stay on TCP, one behaviour for both.

use std::time::Duration;

use zerohop::{Config, Endpoint, Event, Kind};

const WAIT: Duration = Duration::from_secs(10);
const LANE: u32 = 1 << 31;

fn open(kind: Kind) -> Endpoint {
    let mut c = Config::only(kind);
    c.pool_bytes = 64 << 20;
    Endpoint::open(c).unwrap()
}

#[test]
fn a_peer_on_this_host_moves_to_shared_memory_and_messages_cross_both_ways() {
    let s = open(Kind::Shm);
    let addr = s.listen("127.0.0.1:0").unwrap();
    let c = open(Kind::Shm);
    let peer = c.connect(addr, WAIT).unwrap();
    assert!(
        peer.id() & LANE != 0,
        "the connecting side's peer is a lane: {peer}"
    );
    let Event::Connected {
        peer: from,
        addr: seen,
    } = s.next_event(WAIT).unwrap()
    else {
        panic!("the connection first");
    };
    assert!(from.id() & LANE != 0, "the accepting side's too: {from}");
    assert!(seen.ip().is_loopback());
    for i in 0..1000u32 {
        let len = [1, 64, 4096, 65536, 1 << 20][i as usize % 5];
        let mut m = vec![(i % 251) as u8; len];
        m[..1.min(len)].copy_from_slice(&[i as u8][..1.min(len)]);
        c.send(peer, &m).unwrap();
        let got = s.recv(WAIT).unwrap();
        assert_eq!(got.bytes().unwrap(), &m[..], "message {i}");
        s.send_buffer(from, got.into_buffer()).unwrap();
        let echo = c.recv(WAIT).unwrap();
        assert_eq!(echo.bytes().unwrap(), &m[..], "echo {i}");
    }
    let st = c.stats(peer).unwrap();
    assert_eq!((st.messages_sent, st.messages_received), (1000, 1000));
    c.close(WAIT).unwrap();
    match s.next_event(WAIT).unwrap() {
        Event::Closed { peer, .. } => assert_eq!(peer, from),
        e => panic!("expected a clean close, got {e:?}"),
    }
}

/// `uma` is the same wire over CUDA managed memory: a peer on this host moves
/// to a lane (from another uma endpoint or a shm one), and what it sends lands
/// in managed memory a kernel can read in place. Needs a GPU: says SKIPPED
/// and passes where uma cannot open.
#[test]
fn uma_peers_on_this_host_move_to_shared_memory_into_managed_memory() {
    let mut config = Config::only(Kind::Uma);
    config.pool_bytes = 64 << 20;
    let s = match Endpoint::open(config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("SKIPPED: uma does not open here ({e})");
            return;
        }
    };
    assert_eq!(s.kind(), Kind::Uma);
    let addr = s.listen("127.0.0.1:0").unwrap();
    let uma = Endpoint::open(config).unwrap();
    let shm = open(Kind::Shm);
    for c in [&uma, &shm] {
        let peer = c.connect(addr, WAIT).unwrap();
        assert!(peer.id() & LANE != 0, "a lane from {:?}: {peer}", c.kind());
        let Event::Connected { peer: from, .. } = s.next_event(WAIT).unwrap() else {
            panic!("the connection first");
        };
        assert!(from.id() & LANE != 0);
        for len in [64, 64 << 10, 1 << 20] {
            let m: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
            c.send(peer, &m).unwrap();
            let got = s.recv(WAIT).unwrap();
            assert_eq!(got.memory(), zerohop::MemKind::Managed, "{len} B");
            assert!(got.device_ptr().is_some());
            assert_eq!(got.bytes().unwrap(), &m[..], "{len} B");
            s.send_buffer(from, got.into_buffer()).unwrap();
            let echo = c.recv(WAIT).unwrap();
            assert_eq!(echo.bytes().unwrap(), &m[..]);
        }
        c.close(WAIT).unwrap();
        match s.next_event(WAIT).unwrap() {
            Event::Closed { peer, .. } => assert_eq!(peer, from),
            e => panic!("expected a clean close, got {e:?}"),
        }
    }
}

/// A peer that stays on TCP (it offers no shared memory) and goes while it
/// is the shm listener's only TCP peer: its loss is an event at once, and
/// the listener sleeps afterwards (the loss sat unread in the TCP side,
/// which was read only while it had peers, and kept every wait awake).
#[test]
fn the_loss_of_the_last_tcp_peer_of_a_same_host_listener_is_told() {
    let s = open(Kind::Shm);
    let addr = s.listen("127.0.0.1:0").unwrap();
    let c = open(Kind::Tcp);
    let peer = c.connect(addr, WAIT).unwrap();
    assert_eq!(peer.id() & LANE, 0, "a tcp-only peer stays on tcp");
    let Event::Connected { peer: from, .. } = s.next_event(WAIT).unwrap() else {
        panic!("the connection first");
    };
    // Gone with no Close: lost, found by the progress thread's pass, not
    // by this thread's look.
    drop(c);
    std::thread::sleep(Duration::from_millis(500));
    match s.next_event(WAIT) {
        Ok(Event::Lost { peer, .. }) => assert_eq!(peer, from),
        other => panic!("expected the peer's loss, got {other:?}"),
    }
    // Nothing left to tell: a wait sleeps and times out.
    let started = std::time::Instant::now();
    let r = s.next_event(Duration::from_millis(300));
    assert!(r.as_ref().is_err_and(zerohop::Error::is_timeout), "{r:?}");
    assert!(started.elapsed() >= Duration::from_millis(300));
}
