//! The verbs wire on a real verbs stack (the Soft-RoCE VM runs these from
//! scripts/test-all). On a host without RDMA, the probe tests check the
//! "missing, with why" answers and the wire tests print SKIPPED.
#![cfg(feature = "gpudirect-verbs")]

use std::sync::Arc;
use std::time::Duration;

use rdma_sys as ffi;
use zerohop_backends::host_bytes;
use zerohop_backends::verbs::{
    cm, Device, RdmaConfig, RdmaTransport, Registry, VerbsError, MIN_RECV_DEPTH,
};
use zerohop_core::{
    crc32c, pick, Access, Error, Kind, MemKind, PeerId, PoolError, Preference, Prereq, Received,
    Region, RegisterError, Registrar, Status, Transport,
};
use zerohop_std::testing::thread_cpu;
use zerohop_std::{probe_host, Deadline, Endpoint, EndpointConfig};
use zerohop_tests::harness::rdma_addr;

const WAIT: Duration = Duration::from_secs(60);
/// A connect's timeout.
const CONNECT: Duration = Duration::from_secs(10);

#[test]
fn probe_reports_the_verbs_stack() {
    let probe = probe_host();
    match Device::open() {
        Err(e) => {
            // No RDMA here: every verbs prerequisite is missing, with why.
            let Status::Missing(why) = probe.get(Prereq::IbverbsDevice) else {
                panic!("{:?}", probe.get(Prereq::IbverbsDevice))
            };
            eprintln!("no RDMA on this host ({e}); ibverbs-device: {why}");
            assert!(!probe.has(Prereq::HcaLive));
            assert_ne!(pick(Preference::Auto, &probe).unwrap().kind, Kind::Rdma);
            let err = pick(Preference::Only(Kind::Rdma), &probe)
                .unwrap_err()
                .to_string();
            assert!(err.contains("ibverbs-device"), "{err}");
        }
        Ok(dev) => {
            eprintln!("probe on {}: {:?}", dev.name(), probe);
            assert!(probe.has(Prereq::IbverbsDevice));
            assert!(probe.has(Prereq::HcaLive));
            // Soft-RoCE registers host memory only.
            if dev.name().starts_with("rxe") {
                assert!(
                    matches!(probe.get(Prereq::NicDmabuf), Status::Missing(_)),
                    "{:?}",
                    probe.get(Prereq::NicDmabuf)
                );
                assert!(!probe.has(Prereq::CudaDriver));
                assert_eq!(
                    pick(Preference::Auto, &probe).unwrap().kind,
                    Kind::Rdma,
                    "auto-pick chooses rdma on rxe"
                );
            }
        }
    }
}

#[test]
fn registry_registers_host_memory_once_and_refuses_managed() {
    let dev = match Device::open() {
        Ok(d) => d,
        Err(e) => return eprintln!("SKIPPED registry_...: {e}"),
    };
    let reg = Registry::new(dev);
    let buf = vec![0u8; 1 << 20].into_boxed_slice();
    let region = Region {
        addr: buf.as_ptr() as u64,
        len: buf.len(),
        kind: MemKind::Host,
    };
    let a = reg.register(region, Access::LOCAL_WRITE).unwrap();
    let inner = Region {
        addr: region.addr + 4096,
        len: 4096,
        kind: MemKind::Host,
    };
    let b = reg.register(inner, Access::LOCAL_WRITE).unwrap();
    assert_eq!(
        a.lkey, b.lkey,
        "a covered range comes from the table, not a second registration"
    );
    assert_eq!(reg.live(), 1);
    let managed = Region {
        kind: MemKind::Managed,
        ..region
    };
    assert_eq!(
        reg.register(managed, Access::LOCAL_WRITE),
        Err(Error::Register(RegisterError::Unsupported(
            MemKind::Managed
        )))
    );
    assert_eq!(
        reg.register(Region { len: 0, ..region }, Access::NONE),
        Err(Error::Register(RegisterError::ZeroLength))
    );
    reg.deregister(b).unwrap();
    assert_eq!(reg.live(), 1, "still pinned by the first user");
    reg.deregister(a).unwrap();
    assert_eq!(reg.live(), 0);
    assert!(
        reg.deregister(a).is_err(),
        "a second deregister is a typed error"
    );
    drop(buf);
}

type Pair = (
    Endpoint<RdmaTransport>,
    Endpoint<RdmaTransport>,
    zerohop_core::PeerId,
);

/// The RDMA device, or `None` (saying the test is skipped) where there is none.
fn device_or_skip() -> Option<Arc<Device>> {
    match Device::open() {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("SKIPPED: {e}");
            None
        }
    }
}

fn pair(port: u16, config: RdmaConfig) -> Option<Pair> {
    pair_with(port, config, config)
}

/// `a` (with `a_config`) connected to a listening `b` (with `b_config`).
fn pair_with(port: u16, a_config: RdmaConfig, b_config: RdmaConfig) -> Option<Pair> {
    pair_looking(port, a_config, b_config, EndpointConfig::default())
}

/// The same, `b`'s endpoint with `b_looks`.
fn pair_looking(
    port: u16,
    a_config: RdmaConfig,
    b_config: RdmaConfig,
    b_looks: EndpointConfig,
) -> Option<Pair> {
    let dev = device_or_skip()?;
    let addr = rdma_addr(port).expect("an RDMA address");
    let mut b = RdmaTransport::new(Arc::clone(&dev), b_config).unwrap();
    b.listen(addr).unwrap();
    let b = Endpoint::new(b, b_looks).unwrap();
    let mut a = RdmaTransport::new(dev, a_config).unwrap();
    let peer = a.connect(addr, CONNECT).unwrap();
    Some((
        Endpoint::new(a, EndpointConfig::default()).unwrap(),
        b,
        peer,
    ))
}

fn message(i: u64, max: usize) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    x ^= x >> 29;
    let len = (8 + (x as usize % max)) >> (x as usize % 5);
    let mut m: Vec<u8> = (0..len.max(8)).map(|k| (k as u64 ^ x) as u8).collect();
    m[..8].copy_from_slice(&i.to_le_bytes());
    let c = crc32c(0, &m);
    m.extend_from_slice(&c.to_le_bytes());
    m
}

#[test]
fn ten_thousand_messages_of_random_sizes_arrive_intact_and_in_order() {
    let config = RdmaConfig {
        recv_pool_bytes: 128 << 20,
        send_pool_bytes: 128 << 20,
        ..RdmaConfig::default()
    };
    let Some((a, b, peer)) = pair(19_001, config) else {
        return;
    };
    let n = 10_000u64;
    let b_pool = b.with(|t| Arc::clone(t.pool()));
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 0..n {
                // Up to 200 KiB: most fit one 64 KiB fragment, some are split in four.
                a.send(peer, &message(i, 200 << 10), Deadline::after(WAIT), None)
                    .unwrap();
            }
            a.flush(Deadline::after(WAIT)).unwrap();
        });
        for i in 0..n {
            let r = b.recv(Deadline::after(WAIT), None).unwrap();
            let m = host_bytes(&r.lease);
            let (body, crc) = m.split_at(m.len() - 4);
            assert_eq!(crc32c(0, body).to_le_bytes(), crc, "message {i} intact");
            assert_eq!(
                u64::from_le_bytes(body[..8].try_into().unwrap()),
                i,
                "order kept"
            );
        }
    });
    // The last message's receive slot is refilled at the receiver's next
    // call (after the reply it would send): one more pass makes the ring whole.
    b.flush(Deadline::after(WAIT)).unwrap();
    let st = b_pool.stats();
    // Only the posted receive ring still holds buffers (header rings have
    // their own pool): nothing delivered is leaked.
    assert_eq!(st.leases, posted(&config), "{st:?}");
    eprintln!("10000 messages over RDMA RC: intact, in order; receive pool {st:?}");
}

#[test]
fn a_receiver_that_takes_only_framed_messages_still_gets_every_one() {
    // b receives as a GPU receiver must, every frame with its header (the
    // header goes to host memory, the payload to the device); a takes
    // headerless frames. Each learns the other's choice when connecting,
    // and messages from empty to split go both ways intact.
    let framed = RdmaConfig {
        headerless: false,
        recv_pool_bytes: 64 << 20,
        send_pool_bytes: 64 << 20,
        ..RdmaConfig::default()
    };
    let open = RdmaConfig {
        headerless: true,
        ..framed
    };
    let Some((a, b, peer)) = pair_with(19_006, open, framed) else {
        return;
    };
    // The listener's table gives its first connection the first slot.
    let back = zerohop_core::PeerId(0);
    let sizes = [
        0usize,
        1,
        64,
        224,
        4096,
        64 << 10,
        (64 << 10) + 1,
        200 << 10,
    ];
    for (from, to, dst) in [(&a, &b, peer), (&b, &a, back)] {
        for (i, &n) in sizes.iter().enumerate() {
            let m: Vec<u8> = (0..n).map(|k| (k * 7 + i) as u8).collect();
            from.send(dst, &m, Deadline::after(WAIT), None).unwrap();
            let r = to.recv(Deadline::after(WAIT), None).unwrap();
            assert_eq!(host_bytes(&r.lease), &m[..], "{n} bytes");
        }
    }
    assert_eq!(
        a.with(|t| t.sends_headerless(peer)),
        Some(false),
        "b announced framed receives only"
    );
    assert_eq!(
        b.with(|t| t.sends_headerless(back)),
        Some(true),
        "a announced headerless receives"
    );
}

#[test]
fn a_peer_torn_down_mid_stream_is_a_typed_error_and_leaks_nothing() {
    let config = RdmaConfig {
        recv_pool_bytes: 64 << 20,
        send_pool_bytes: 64 << 20,
        ..RdmaConfig::default()
    };
    let Some((a, b, peer)) = pair(19_002, config) else {
        return;
    };
    let b_pool = b.with(|t| Arc::clone(t.pool()));
    for i in 0..100 {
        a.send(peer, &message(i, 100 << 10), Deadline::after(WAIT), None)
            .unwrap();
    }
    // The sender vanishes without a Close: its QP is destroyed under the stream.
    drop(a);
    let mut got = 0;
    let err = loop {
        match b.recv(Deadline::after(WAIT), None) {
            Ok(_) => got += 1,
            Err(e) => break e,
        }
    };
    assert!(
        matches!(err, Error::PeerLost(_)),
        "{err:?} after {got} messages"
    );
    assert_eq!(b.with(|t| t.peer_count()), 0);
    let st = b_pool.stats();
    assert_eq!(
        st.leases, 0,
        "the receive ring and any partial message went back: {st:?}"
    );
    eprintln!("peer lost after {got} of 100 messages: {err}; receive pool {st:?}");
}

#[test]
fn a_lease_from_a_foreign_pool_is_copied_not_trusted() {
    let config = RdmaConfig {
        recv_pool_bytes: 32 << 20,
        send_pool_bytes: 32 << 20,
        ..RdmaConfig::default()
    };
    let Some((a, b, peer)) = pair(19_003, config) else {
        return;
    };
    // A private pool with no registration: its lease has no keys for this NIC.
    let foreign = zerohop_std::private_pool(4 << 20).unwrap();
    let mut lease = zerohop_core::Lease::take(Arc::clone(&foreign), 300).unwrap();
    zerohop_backends::host_bytes_mut(&mut lease).fill(0x5A);
    a.send_lease(peer, lease, Deadline::after(WAIT), None)
        .unwrap();
    let r = b.recv(Deadline::after(WAIT), None).unwrap();
    assert_eq!(host_bytes(&r.lease), &[0x5A; 300][..]);
    a.flush(Deadline::after(WAIT)).unwrap();
    assert_eq!(
        foreign.used_bytes(),
        0,
        "the foreign lease went back after the copy"
    );
}

/// An 8-deep receive ring and small pools: the hand-driven tests below.
fn small_ring() -> RdmaConfig {
    RdmaConfig {
        recv_depth: 8,
        recv_pool_bytes: 16 << 20,
        send_pool_bytes: 16 << 20,
        ..RdmaConfig::default()
    }
}

/// Receives a connection of `config` keeps posted: its data ring and the
/// control slots.
fn posted(config: &RdmaConfig) -> usize {
    config.recv_depth as usize + zerohop_core::session::CONTROL_SLOTS as usize
}

/// Two transports connected by hand, without endpoints (so no progress
/// thread moves anything behind a test's back): `a`, `b`, and the peer id
/// `a` has for `b`. `b` gives its first connection the first slot.
fn raw_pair(port: u16, config: RdmaConfig) -> Option<(RdmaTransport, RdmaTransport, PeerId)> {
    let (mut b, connecting) = listen_and_connect(&device_or_skip()?, port, config);
    while !connecting.is_finished() || b.peer_count() == 0 {
        b.progress().unwrap();
    }
    let (a, peer) = connecting.join().unwrap();
    Some((a, b, peer))
}

/// A transport listening on `port`, and a thread connecting another to it
/// (it ends with that one and its peer id for the listener once the
/// connecting side is established). Driving the listener is the caller's.
fn listen_and_connect(
    dev: &Arc<Device>,
    port: u16,
    config: RdmaConfig,
) -> (
    RdmaTransport,
    std::thread::JoinHandle<(RdmaTransport, PeerId)>,
) {
    let addr = rdma_addr(port).expect("an RDMA address");
    let mut b = RdmaTransport::new(Arc::clone(dev), config).unwrap();
    b.listen(addr).unwrap();
    let dev = Arc::clone(dev);
    let connecting = std::thread::spawn(move || {
        let mut a = RdmaTransport::new(dev, config).unwrap();
        let peer = a.connect(addr, CONNECT).unwrap();
        (a, peer)
    });
    (b, connecting)
}

/// Drives `t` until `thread` (which waits on `t`'s side of a connection)
/// ends, for at most `WAIT`.
fn drive_until_finished<R>(t: &mut RdmaTransport, thread: &std::thread::JoinHandle<R>) {
    drive_until(t, "the other side to finish", |_| thread.is_finished());
}

/// A thread connecting a transport of `small_ring()` to `addr`: it ends
/// with that transport and what its connect said.
fn connecting(
    dev: &Arc<Device>,
    addr: std::net::SocketAddr,
) -> std::thread::JoinHandle<(RdmaTransport, Result<PeerId, VerbsError>)> {
    let dev = Arc::clone(dev);
    std::thread::spawn(move || {
        let mut a = RdmaTransport::new(dev, small_ring()).unwrap();
        let peer = a.connect(addr, CONNECT);
        (a, peer)
    })
}

/// Polls `t` until a message arrives.
fn next(t: &mut RdmaTransport) -> Received<<RdmaTransport as Transport>::Lease> {
    loop {
        match t.try_recv() {
            Err(Error::WouldBlock) => std::hint::spin_loop(),
            r => return r.unwrap(),
        }
    }
}

#[test]
fn a_delivered_receive_is_reposted_after_the_reply_leaves_or_at_the_next_poll() {
    // A delivered message's receive slot is refilled at the receiver's next
    // call: after the reply it sends (so the pool lease and the post stay
    // off the round trip), or at its next poll when it sends nothing.
    let config = small_ring();
    let Some((mut a, mut b, peer)) = raw_pair(19_007, config) else {
        return;
    };
    let depth = posted(&config);
    let leases = |b: &RdmaTransport| b.pool().stats().leases;
    assert_eq!(leases(&b), depth, "the ring is posted");

    a.try_send(peer, b"ping").unwrap();
    let r = next(&mut b);
    assert_eq!(host_bytes(&r.lease), b"ping");
    assert_eq!(
        leases(&b),
        depth,
        "the message held, its slot not yet refilled"
    );
    b.try_send(r.peer, b"pong").unwrap();
    assert_eq!(leases(&b), depth + 1, "refilled once the reply was posted");
    drop(r);
    assert_eq!(host_bytes(&next(&mut a).lease), b"pong");

    a.try_send(peer, b"no reply").unwrap();
    drop(next(&mut b));
    assert_eq!(leases(&b), depth - 1, "the slot waits for the next call");
    assert!(matches!(b.try_recv(), Err(Error::WouldBlock)));
    assert_eq!(leases(&b), depth, "refilled by the next poll");
}

/// A caller-driven receiver away past the idle timeout in the middle of a
/// message longer than its ring: the fragments that came meanwhile wait in
/// its completion queue, and are taken before the peer is judged, so the
/// message arrives and the peer stays (before, the peer failed with
/// `Stalled { Frame }` at the first call after the absence). Nor is the
/// absence held against the message's rate: the wire holds its peers when
/// it comes back (without that, `Stalled { Slow }`).
#[test]
fn a_peer_mid_message_while_this_side_was_away_is_read_not_timed_out() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let idle = Duration::from_millis(400);
    let config = RdmaConfig {
        idle_timeout: idle,
        fragment: 4096,
        ..small_ring()
    };
    let Some((mut a, mut b, peer)) = raw_pair(19_136, config) else {
        return;
    };
    // 8 slots of 4 KiB: 256 KiB takes many turns of the ring.
    let m: Vec<u8> = (0..256u32 << 10)
        .map(|i| (i * 7 + i / 4096) as u8)
        .collect();
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let done = Arc::new(AtomicBool::new(false));
    let sender = {
        let (m, done) = (m.clone(), Arc::clone(&done));
        std::thread::spawn(move || {
            a.try_send(peer, &m).unwrap(); // what the ring takes now
            wait.recv().unwrap();
            while !done.load(Ordering::Relaxed) {
                a.progress().unwrap();
            }
            a
        })
    };
    // The first fragments, and no more: the sender waits for the signal.
    let t0 = std::time::Instant::now();
    while t0.elapsed() < Duration::from_millis(100) {
        b.progress().unwrap();
        let r = b.try_recv();
        assert!(
            matches!(r, Err(Error::WouldBlock)),
            "mid-message, nothing yet: {r:?}"
        );
    }
    assert!(
        b.pool().stats().leases > posted(&config),
        "mid-message: the message's buffer is leased beside the ring's"
    );
    // The sender goes on; this side is away for ten idle timeouts: longer
    // than the message's first fragments earned against the minimum rate
    // (32 KiB, half a second), so it is also the absence the wire holds
    // its peers for (without that hold: `Stalled { Slow }` on return).
    go.send(()).unwrap();
    std::thread::sleep(10 * idle);
    let until = std::time::Instant::now() + WAIT;
    let r = loop {
        b.progress().unwrap();
        match b.try_recv() {
            Err(Error::WouldBlock) if std::time::Instant::now() < until => {}
            r => break r.unwrap(),
        }
    };
    assert_eq!(host_bytes(&r.lease), &m[..]);
    done.store(true, Ordering::Relaxed);
    drop(sender.join().unwrap());
}

#[test]
fn a_small_lease_goes_inline_and_back_to_its_pool_once_posted() {
    // A lease of the wire's own pools small enough to go inline leaves
    // straight from its buffer, which is free again once posted (the NIC
    // has a copy): a send-pool lease, and a received one echoed back.
    let config = small_ring();
    let Some((mut a, mut b, peer)) = raw_pair(19_008, config) else {
        return;
    };
    let want: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37)).collect();
    let mut lease = zerohop_core::Lease::take(Arc::clone(a.send_pool()), want.len()).unwrap();
    zerohop_backends::host_bytes_mut(&mut lease).copy_from_slice(&want);
    assert!(a.try_send_lease(peer, lease).is_ok());
    assert_eq!(a.send_pool().stats().leases, 0, "back once posted");

    let r = next(&mut b);
    assert_eq!(host_bytes(&r.lease), &want[..]);
    // The received buffer itself goes back (zero-copy echo).
    assert!(b.try_send_lease(r.peer, r.lease).is_ok());
    assert_eq!(
        b.pool().stats().leases,
        posted(&config),
        "the echoed buffer went back and its slot was refilled"
    );
    assert_eq!(host_bytes(&next(&mut a).lease), &want[..]);
}

#[test]
fn two_peers_out_of_credits_with_data_queued_still_return_credits() {
    // Both sides post a ring's worth and one more before either polls:
    // each spends every data slot of the other's, owes a ring's worth, and
    // has a data frame queued. The slots must go back in credit frames on
    // the control slots, or neither queue ever moves. Driven by hand,
    // without progress threads, so the stall is certain rather than a race.
    let config = small_ring();
    let Some((mut a, mut b, peer)) = raw_pair(19_004, config) else {
        return;
    };
    // The listener's table gives its first connection the first slot.
    let back = zerohop_core::PeerId(0);
    let n = u64::from(config.recv_depth) + 1;
    for i in 0..n {
        a.try_send(peer, &message(i, 100)).unwrap();
    }
    for i in 0..n {
        b.try_send(back, &message(i, 100)).unwrap();
    }
    let (mut got_a, mut got_b) = (0, 0);
    let until = std::time::Instant::now() + Duration::from_secs(20);
    while (got_a < n || got_b < n) && std::time::Instant::now() < until {
        for (t, got) in [(&mut a, &mut got_a), (&mut b, &mut got_b)] {
            t.progress().unwrap();
            while let Ok(r) = t.try_recv() {
                let m = host_bytes(&r.lease);
                assert_eq!(
                    u64::from_le_bytes(m[..8].try_into().unwrap()),
                    *got,
                    "order kept"
                );
                *got += 1;
            }
        }
    }
    assert_eq!(
        (got_a, got_b),
        (n, n),
        "every queued message arrived both ways"
    );
}

#[test]
fn a_long_message_still_under_way_when_the_peer_closes_arrives_whole() {
    // The receiver closes while the sender's message, many rings long, is
    // under way. The receiver sends no more data, but its credit frames for
    // the rest of the message take the sender's receive slots: the sender
    // must go on reposting them until it has closed too. It stopped at the
    // peer's Close, so after a few credit frames the message stalled.
    let config = RdmaConfig {
        fragment: 4096,
        ..small_ring()
    };
    let Some((mut a, mut b, peer)) = raw_pair(19_141, config) else {
        return;
    };
    // 8 slots of 4 KiB: 1 MiB is 256 frames, 32 turns of the ring.
    let m: Vec<u8> = (0..1u32 << 20).map(|i| (i * 13 + i / 4096) as u8).collect();
    a.try_send(peer, &m).unwrap();
    b.close().unwrap();
    let until = std::time::Instant::now() + WAIT;
    let r = next_driving(&mut b, &mut a, until).expect("the message stalled after the close");
    assert_eq!(host_bytes(&r.lease), &m[..]);
    drop(r);
    a.close().unwrap();
    // Both closed: each side lets the connection go, and every buffer is back.
    while a.peer_count() + b.peer_count() > 0 {
        assert!(
            std::time::Instant::now() < until,
            "the closed pair never parted"
        );
        a.progress().unwrap();
        b.progress().unwrap();
    }
    assert_eq!(
        a.send_pool().stats().leases,
        0,
        "the sender's buffers are back"
    );
}

/// Polls `t` for a message, driving `other` as well (its queued frames, or
/// the credits it owes, may be what `t` waits for), until `until`.
fn next_driving(
    t: &mut RdmaTransport,
    other: &mut RdmaTransport,
    until: std::time::Instant,
) -> Option<Received<<RdmaTransport as Transport>::Lease>> {
    while std::time::Instant::now() < until {
        other.progress().unwrap();
        match t.try_recv() {
            Ok(r) => return Some(r),
            Err(Error::WouldBlock) => {}
            Err(e) => panic!("{e}"),
        }
    }
    None
}

#[test]
fn the_shallowest_rings_keep_moving_both_ways() {
    // Rings of the least depth accepted and two more: a stream each way at
    // once, then a ping-pong, driven by hand. A send ring is the receive
    // depth plus 8; below 8, it held fewer slots than the one-in-16 inline
    // frames that ask for a completion, so unsignaled frames took every slot
    // and none came back (`zerohop perf` with a ring of 4 never finished).
    for (depth, port) in [
        (MIN_RECV_DEPTH, 19_010),
        (MIN_RECV_DEPTH + 1, 19_011),
        (MIN_RECV_DEPTH + 2, 19_012),
    ] {
        let config = RdmaConfig {
            recv_depth: depth,
            ..small_ring()
        };
        let Some((mut a, mut b, peer)) = raw_pair(port, config) else {
            return;
        };
        let back = zerohop_core::PeerId(0);
        let n = 300u64;
        let until = std::time::Instant::now() + Duration::from_secs(60);
        let (mut sent, mut got) = ([0u64; 2], [0u64; 2]);
        while got != [n, n] && std::time::Instant::now() < until {
            for (k, t, to) in [(0, &mut a, peer), (1, &mut b, back)] {
                if sent[k] < n {
                    match t.try_send(to, &message(sent[k], 100)) {
                        Ok(()) => sent[k] += 1,
                        Err(Error::WouldBlock) => {}
                        Err(e) => panic!("depth {depth}: {e}"),
                    }
                }
                t.progress().unwrap();
                while let Ok(r) = t.try_recv() {
                    let m = host_bytes(&r.lease);
                    assert_eq!(u64::from_le_bytes(m[..8].try_into().unwrap()), got[k]);
                    got[k] += 1;
                }
            }
        }
        assert_eq!(got, [n, n], "depth {depth}: both streams arrived whole");
        for i in 0..n {
            let want = message(i, 100);
            a.try_send(peer, &want).unwrap();
            let r = next_driving(&mut b, &mut a, until)
                .unwrap_or_else(|| panic!("depth {depth}: ping {i} stalled"));
            assert_eq!(host_bytes(&r.lease), &want[..]);
            b.try_send_lease(r.peer, r.lease).unwrap();
            let r = next_driving(&mut a, &mut b, until)
                .unwrap_or_else(|| panic!("depth {depth}: pong {i} stalled"));
            assert_eq!(host_bytes(&r.lease), &want[..]);
        }
    }
}

#[test]
fn a_ring_too_shallow_to_move_is_refused() {
    let Some(dev) = device_or_skip() else {
        return;
    };
    let config = RdmaConfig {
        recv_depth: MIN_RECV_DEPTH - 1,
        ..small_ring()
    };
    assert!(matches!(
        RdmaTransport::new(dev, config),
        Err(Error::BadConfig(_))
    ));
}

#[test]
fn a_listener_answers_a_first_message_that_arrives_before_its_established_event() {
    // The connecting side sends its Hello once its own side is established;
    // the RTU that raises the listener's ESTABLISHED event trails it, and
    // the listener reads CM events only in `progress` (its endpoint's
    // progress thread, which a loaded host can hold back). The listener
    // must answer meanwhile: a frame that arrived proves the connection.
    // Here `b` takes the connect request and then only polls for data, so
    // its ESTABLISHED event stays unread; `connect` returns only once b's
    // Hello has come, so it hangs if an arrival does not establish.
    let Some(dev) = device_or_skip() else {
        return;
    };
    let config = small_ring();
    let until = std::time::Instant::now() + WAIT;
    // The RTU can beat the end of the pass that accepts (then that pass
    // reads the event, and there is no race to test): a fresh pair then.
    for port in 19_100..19_120 {
        let (mut b, connecting) = listen_and_connect(&dev, port, config);
        // The first CM event a listener reads is the connect request (accepted there).
        while !b.progress().unwrap() {
            assert!(std::time::Instant::now() < until, "no connect request");
        }
        if b.established() != 0 {
            drive_until_finished(&mut b, &connecting);
            continue;
        }
        while !connecting.is_finished() {
            assert!(
                std::time::Instant::now() < until,
                "the connect never finished"
            );
            assert!(matches!(b.try_recv(), Err(Error::WouldBlock)));
        }
        let (mut a, peer) = connecting.join().unwrap();
        assert_eq!(b.established(), 1, "the arrival established the connection");
        a.try_send(peer, b"first").unwrap();
        let r = next(&mut b);
        assert_eq!(host_bytes(&r.lease), b"first");
        b.try_send(r.peer, b"reply")
            .expect("a reply to a message that arrived goes out");
        assert_eq!(host_bytes(&next(&mut a).lease), b"reply");
        return;
    }
    eprintln!("note: each listener read its ESTABLISHED event while accepting: the race was not exercised");
}

#[test]
fn a_receiver_that_is_not_receiving_yet_still_frees_its_ring() {
    // The application of b does not call recv until a has sent many rings'
    // worth and flushed: b's progress thread must drain arrivals (and hand
    // credits back) for an application that is not polling.
    let config = RdmaConfig {
        recv_depth: 8,
        recv_pool_bytes: 32 << 20,
        send_pool_bytes: 32 << 20,
        ..RdmaConfig::default()
    };
    let Some((a, b, peer)) = pair(19_005, config) else {
        return;
    };
    let n = 200u64;
    for i in 0..n {
        a.send(peer, &message(i, 1000), Deadline::after(WAIT), None)
            .unwrap();
    }
    a.flush(Deadline::after(WAIT))
        .expect("every send completed with b not receiving");
    for i in 0..n {
        let r = b.recv(Deadline::after(WAIT), None).unwrap();
        let m = host_bytes(&r.lease);
        assert_eq!(
            u64::from_le_bytes(m[..8].try_into().unwrap()),
            i,
            "order kept"
        );
    }
}

/// A peer that went leaves its id naming nobody, even once a new peer has
/// taken its slot in the listener's table: a send to the old id is
/// `UnknownPeer`, not a message to the newcomer, and the newcomer's id is
/// another. (Ids were slot numbers, reused at once.)
#[test]
fn a_lost_peers_id_does_not_reach_the_peer_that_takes_its_place() {
    let Some(dev) = device_or_skip() else {
        return;
    };
    let accept = |b: &mut RdmaTransport| -> PeerId {
        let until = std::time::Instant::now() + WAIT;
        loop {
            b.progress().unwrap();
            if let Some((p, _)) = b.take_accepted() {
                return p;
            }
            assert!(std::time::Instant::now() < until, "no peer came");
        }
    };
    let (mut b, connecting) = listen_and_connect(&dev, 19_013, small_ring());
    let first = accept(&mut b);
    let (mut a1, to_b) = connecting.join().unwrap();
    a1.try_send(to_b, b"one").unwrap();
    let r = next(&mut b);
    assert_eq!((r.peer, host_bytes(&r.lease)), (first, &b"one"[..]));
    drop(r);
    drop(a1); // gone without a Close
    let until = std::time::Instant::now() + WAIT;
    loop {
        b.progress().unwrap();
        match b.try_recv() {
            Err(Error::WouldBlock) => {}
            Err(Error::PeerLost(p)) => {
                assert_eq!(p, first);
                break;
            }
            other => panic!("{other:?}"),
        }
        assert!(std::time::Instant::now() < until, "the loss never came");
    }
    let addr = rdma_addr(19_013).expect("an RDMA address");
    let dev2 = Arc::clone(&dev);
    let connecting = std::thread::spawn(move || {
        let mut a = RdmaTransport::new(dev2, small_ring()).unwrap();
        let peer = a.connect(addr, CONNECT).unwrap();
        (a, peer)
    });
    let second = accept(&mut b);
    let (mut a2, _) = connecting.join().unwrap();
    assert_ne!(second, first, "the newcomer has an id of its own");
    assert_eq!(b.peer_count(), 1);
    assert_eq!(b.try_send(first, b"stale"), Err(Error::UnknownPeer(first)));
    b.try_send(second, b"fresh").unwrap();
    let until = std::time::Instant::now() + WAIT;
    let r = loop {
        b.progress().unwrap();
        match a2.try_recv() {
            Err(Error::WouldBlock) => {}
            r => break r.unwrap(),
        }
        assert!(
            std::time::Instant::now() < until,
            "nothing reached the newcomer"
        );
    };
    assert_eq!(
        host_bytes(&r.lease),
        b"fresh",
        "the stale send went nowhere"
    );
}

#[test]
fn an_accepted_connection_its_peer_refuses_goes_quietly_and_leaks_nothing() {
    // A peer can go away between the listener's accept and its own RTU
    // (refused, crashed, unreachable): the CM then tells the listener
    // REJECTED / CONNECT_ERROR / UNREACHABLE instead of ESTABLISHED. The
    // connection must leave the table and its receive ring the pool; the
    // application never saw the peer, so nothing is reported to it (it
    // was told `PeerLost` for a peer id it had never been given, when the
    // ring's flushed receives were the only sign).
    let Some(dev) = device_or_skip() else {
        return;
    };
    let addr = rdma_addr(19_130).expect("an RDMA address");
    let mut b = RdmaTransport::new(dev, small_ring()).unwrap();
    b.listen(addr).unwrap();
    let pool = Arc::clone(b.pool());
    let (answered_tx, answered) = std::sync::mpsc::channel();
    let (go, go_rx) = std::sync::mpsc::channel();
    // A peer with a ring like zerohop's (so the listener accepts), no QP
    // (so librdmacm hands the listener's reply up instead of answering
    // it), which says it was answered, waits for `go`, then rejects.
    let client = std::thread::spawn(move || -> Result<(), String> {
        let peer = cm_peer::Peer::connect(addr, &cm_peer::ring(8))?;
        peer.expect(ffi::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_RESPONSE)?;
        answered_tx.send(()).map_err(|e| e.to_string())?;
        go_rx.recv().map_err(|e| e.to_string())?;
        peer.reject()
    });
    let until = std::time::Instant::now() + WAIT;
    // `b` accepts; its reply reaches the peer, which holds its answer back.
    while answered.try_recv().is_err() {
        b.progress().unwrap();
        if client.is_finished() {
            panic!(
                "the peer ended before the listener's reply: {:?}",
                client.join()
            );
        }
        assert!(
            std::time::Instant::now() < until,
            "no reply from the listener"
        );
    }
    assert_eq!(
        pool.stats().leases,
        posted(&small_ring()),
        "the accepted connection posted its receive ring"
    );
    go.send(()).unwrap();
    client.join().unwrap().unwrap();
    while pool.stats().leases != 0 {
        b.progress().unwrap();
        assert!(
            std::time::Instant::now() < until,
            "the refused connection kept its receive ring: {:?}",
            pool.stats()
        );
    }
    assert_eq!(b.peer_count(), 0);
    assert!(
        matches!(b.try_recv(), Err(Error::WouldBlock)),
        "a peer the application never saw is not reported"
    );
}

/// A listener keeps at most its peer limits' accepted peers: a connect
/// request past them is rejected before a queue pair or a ring is made
/// for it, the peer kept is served on, and its place, once it goes, is
/// taken again.
#[test]
fn a_listener_at_its_peer_limits_rejects_newcomers_and_serves_those_it_keeps() {
    let Some(dev) = device_or_skip() else {
        return;
    };
    let addr = rdma_addr(19_153).expect("an RDMA address");
    let config = RdmaConfig {
        peer_limits: zerohop_backends::PeerLimits {
            accepted: 1,
            per_address: 1,
        },
        ..small_ring()
    };
    let mut b = RdmaTransport::new(Arc::clone(&dev), config).unwrap();
    b.listen(addr).unwrap();
    let first = connecting(&dev, addr);
    drive_until_finished(&mut b, &first);
    let (mut a, peer) = first.join().unwrap();
    let peer = peer.unwrap();
    let posted = b.pool().stats().leases;
    let second = connecting(&dev, addr);
    drive_until_finished(&mut b, &second);
    match second.join().unwrap().1 {
        // Told why: a refusal, not a ring it does not fit.
        Err(VerbsError::Rejected(Some(cm::RejectReason::Refused))) => {}
        other => panic!("the second was taken: {other:?}"),
    }
    assert_eq!(b.peer_count(), 1);
    assert_eq!(b.pool().stats().leases, posted, "nothing posted for it");
    // The one kept is served.
    a.try_send(peer, b"kept").unwrap();
    let until = std::time::Instant::now() + WAIT;
    let r = next_driving(&mut b, &mut a, until).expect("the kept peer's message");
    assert_eq!(host_bytes(&r.lease), b"kept");
    drop(r);
    // It goes; its place is taken again.
    drop(a);
    drive_until(&mut b, "the first's end", |b| b.peer_count() == 0);
    let third = connecting(&dev, addr);
    drive_until_finished(&mut b, &third);
    assert!(third.join().unwrap().1.is_ok(), "the freed place is taken");
}

/// The facade over rdma tells the outcomes of a connect apart by type, as
/// over TCP: a listener at its peer limits (the reject's reason) and a port
/// where nothing listens (the CM's own reject).
#[test]
fn the_facade_over_rdma_tells_a_refusal_from_nobody_listening() {
    use zerohop::{Config, ConnectError, Endpoint as Facade, Kind, PeerLimits};
    if device_or_skip().is_none() {
        return;
    }
    let addr = rdma_addr(19_155).expect("an RDMA address");
    let open = |limits| {
        let mut c = Config::only(Kind::Rdma);
        c.pool_bytes = 16 << 20;
        c.peer_limits = limits;
        Facade::open(c).unwrap()
    };
    let one = PeerLimits {
        accepted: 1,
        per_address: 1,
    };
    let s = open(one);
    s.listen(addr).unwrap();
    let kept = open(PeerLimits::default());
    // No deadline arithmetic overflows for a connect that waits for ever.
    kept.connect(addr, Duration::MAX).unwrap();
    let late = open(PeerLimits::default());
    let e = late.connect(addr, WAIT).unwrap_err();
    assert!(
        matches!(e.connect_error(), Some(ConnectError::Refused)),
        "{e:?}"
    );
    assert!(late.peers().is_empty());
    let nobody = std::net::SocketAddr::new(addr.ip(), addr.port() + 1);
    let e = late.connect(nobody, WAIT).unwrap_err();
    assert!(
        matches!(e.connect_error(), Some(ConnectError::Unreachable(io))
            if io.kind() == std::io::ErrorKind::ConnectionRefused),
        "{e:?}"
    );
    assert!(e.to_string().contains(&nobody.to_string()), "{e}");
}

/// A connect to a host that never answers ends at its timeout, and holds up
/// no other peer meanwhile: the dial runs outside the transport's lock (it
/// held it for the whole CM handshake, up to some 20 s whatever the
/// timeout asked).
#[test]
fn the_facade_over_rdma_dials_within_its_timeout_without_holding_up_other_peers() {
    use std::net::{IpAddr, SocketAddr};
    use std::time::Instant;
    use zerohop::{Config, ConnectError, Endpoint as Facade, Kind};
    if device_or_skip().is_none() {
        return;
    }
    let addr = rdma_addr(19_157).expect("an RDMA address");
    let open = || {
        let mut c = Config::only(Kind::Rdma);
        c.pool_bytes = 16 << 20;
        Facade::open(c).unwrap()
    };
    let s = open();
    s.listen(addr).unwrap();
    let c = open();
    let peer = c.connect(addr, WAIT).unwrap();
    // Nobody at .77 of the VM's subnet (its device is a dummy interface):
    // the CM's request goes unanswered.
    let IpAddr::V4(ip) = addr.ip() else {
        panic!("{addr}")
    };
    let [a, b, n, _] = ip.octets();
    let void = SocketAddr::from(([a, b, n, 77], 19_158));
    let timeout = Duration::from_secs(2);
    std::thread::scope(|scope| {
        let dialing = scope.spawn(|| {
            let t0 = Instant::now();
            (c.connect(void, timeout), t0.elapsed())
        });
        std::thread::sleep(Duration::from_millis(200));
        // Messages cross while the dial waits.
        for i in 0..10u8 {
            let t0 = Instant::now();
            c.send(peer, &[i; 64]).unwrap();
            let m = s.recv(WAIT).unwrap();
            assert_eq!(m.bytes(), Some(&[i; 64][..]));
            assert!(
                t0.elapsed() < Duration::from_millis(500),
                "message {i} took {:?}",
                t0.elapsed()
            );
        }
        assert!(!dialing.is_finished(), "the dial ended before the messages");
        let (r, took) = dialing.join().unwrap();
        let e = r.unwrap_err();
        assert!(
            matches!(e.connect_error(), Some(ConnectError::Unreachable(_))),
            "{e:?}"
        );
        assert!(
            took >= timeout && took < timeout + Duration::from_millis(1500),
            "{took:?}"
        );
    });
    assert_eq!(c.peers().len(), 1);
}

/// A connection dialed by one transport is refused by another's `attach`
/// (its ring and memory keys are the first's), and goes without a trace.
#[test]
fn a_connection_dialed_by_another_transport_is_refused_at_attach() {
    let Some(dev) = device_or_skip() else {
        return;
    };
    let addr = rdma_addr(19_159).expect("an RDMA address");
    let mut b = RdmaTransport::new(Arc::clone(&dev), small_ring()).unwrap();
    b.listen(addr).unwrap();
    let a = RdmaTransport::new(Arc::clone(&dev), small_ring()).unwrap();
    let mut other = RdmaTransport::new(dev, small_ring()).unwrap();
    let dialing = std::thread::spawn(move || {
        let dialed = a.dialer().dial(addr, CONNECT);
        (a, dialed)
    });
    drive_until_finished(&mut b, &dialing);
    let (a, dialed) = dialing.join().unwrap();
    let e = other.attach(dialed.unwrap()).unwrap_err();
    assert!(e.to_string().contains("another transport"), "{e}");
    assert_eq!(other.peer_count(), 0);
    assert_eq!(a.peer_count(), 0);
    assert_eq!(a.pool().stats().leases, 0, "its ring went back");
}

#[test]
fn a_listener_refuses_a_peer_whose_ring_cannot_take_a_data_frame() {
    // A data frame needs a data slot: a peer announcing a ring of 0, or
    // nothing zerohop can read, could never be sent a message (it was
    // accepted, and data frames to it would have waited for credits that
    // cannot come). It is refused at the request, before a ring is posted.
    let Some(dev) = device_or_skip() else {
        return;
    };
    let addr = rdma_addr(19_131).expect("an RDMA address");
    let mut b = RdmaTransport::new(dev, small_ring()).unwrap();
    b.listen(addr).unwrap();
    let pool = Arc::clone(b.pool());
    for private in [cm_peer::ring(0), Vec::new()] {
        let shown = format!("{private:?}");
        let client = std::thread::spawn(move || {
            cm_peer::Peer::connect(addr, &private).and_then(|p| p.next_with_word())
        });
        let until = std::time::Instant::now() + WAIT;
        while !client.is_finished() {
            b.progress().unwrap();
            assert_eq!(pool.stats().leases, 0, "a ring was posted for {shown}");
            assert!(std::time::Instant::now() < until, "no answer for {shown}");
        }
        // Rejected, saying why: the listener's word for a shallow ring.
        assert_eq!(
            client.join().unwrap(),
            Ok((
                ffi::rdma_cm_event_type::RDMA_CM_EVENT_REJECTED,
                Some(cm::RejectReason::ShallowRing as u32)
            )),
            "private data {shown}"
        );
        assert_eq!(b.peer_count(), 0);
        assert!(matches!(b.try_recv(), Err(Error::WouldBlock)));
    }
}

#[test]
fn connecting_to_a_peer_whose_ring_cannot_take_a_data_frame_is_refused_and_leaks_nothing() {
    let Some(dev) = device_or_skip() else {
        return;
    };
    let mut a = RdmaTransport::new(dev, small_ring()).unwrap();
    let pools = [Arc::clone(a.pool()), Arc::clone(a.send_pool())];
    // A ring of 0, and no private data at all; a port each (the CM may
    // hold a port a little while after its last connection went).
    for (port, private, announced) in [
        (19_132, cm_peer::ring(0), Some(0)),
        (19_135, Vec::new(), None),
    ] {
        let addr = rdma_addr(port).expect("an RDMA address");
        let shown = format!("{private:?}");
        let listener = cm_peer::Peer::listen(addr).unwrap();
        // Accepts, then reports the events it sees until DISCONNECTED.
        let server = std::thread::spawn(move || -> Result<Vec<u32>, String> {
            let mut listener = listener;
            listener.accept(&private)?;
            let mut seen = Vec::new();
            while seen.last() != Some(&ffi::rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED) {
                seen.push(listener.next().map_err(|e| format!("{e} after {seen:?}"))?);
            }
            Ok(seen)
        });
        let err = a.connect(addr, CONNECT).unwrap_err();
        match (&err, announced) {
            // The CM pads private data with zeros: "nothing" reads as 0 on IB and RoCE.
            (VerbsError::ShallowPeer { depth: Some(0) }, Some(0)) => {}
            (
                VerbsError::ShallowPeer {
                    depth: Some(0) | None,
                },
                None,
            ) => {}
            _ => panic!("private data {shown}: {err:?}"),
        }
        assert!(err.to_string().contains("receive ring"), "{err}");
        assert_eq!(a.peer_count(), 0);
        for pool in &pools {
            assert_eq!(pool.stats().leases, 0, "{shown}: {:?}", pool.stats());
        }
        let seen = server.join().unwrap().unwrap();
        eprintln!("the peer with private data {shown} saw CM events {seen:?}");
    }
}

#[test]
fn connecting_where_nobody_listens_is_a_typed_error_and_leaks_nothing() {
    // A refused connect tears down what it set up once: the QP, CQ and
    // ring, then the CM id and channel (they were destroyed twice: by the
    // connection's teardown, then again by `connect`).
    let Some(dev) = device_or_skip() else {
        return;
    };
    let addr = rdma_addr(19_133).expect("an RDMA address");
    let mut a = RdmaTransport::new(Arc::clone(&dev), small_ring()).unwrap();
    let pools = [Arc::clone(a.pool()), Arc::clone(a.send_pool())];
    for _ in 0..3 {
        let err = a.connect(addr, CONNECT).unwrap_err();
        assert!(matches!(err, VerbsError::NoListener), "{err:?}");
        assert!(err.to_string().contains("nothing listens"), "{err}");
        assert_eq!(a.peer_count(), 0);
        for pool in &pools {
            assert_eq!(pool.stats().leases, 0, "{:?}", pool.stats());
        }
    }
    // The same transport then connects once someone listens, and a message crosses.
    let mut b = RdmaTransport::new(dev, small_ring()).unwrap();
    b.listen(addr).unwrap();
    let listening = std::thread::spawn(move || {
        let until = std::time::Instant::now() + WAIT;
        loop {
            b.progress().unwrap();
            match b.try_recv() {
                Ok(r) => return host_bytes(&r.lease).to_vec(),
                Err(Error::WouldBlock) => assert!(std::time::Instant::now() < until),
                Err(e) => panic!("{e}"),
            }
        }
    });
    let peer = a.connect(addr, CONNECT).unwrap();
    a.try_send(peer, b"after three refusals").unwrap();
    drive_until_finished(&mut a, &listening);
    assert_eq!(listening.join().unwrap(), b"after three refusals");
}

#[test]
fn a_listener_out_of_receive_buffers_refuses_the_next_peer_and_keeps_the_first() {
    // One 2 MiB chunk of 64 KiB (+ header) receive buffers holds 31: a
    // ring of 16 (19 posted, with the control slots) for the first peer,
    // not a second. The second is refused
    // at its request (its ring's partial post undone, its id rejected once:
    // it was destroyed twice, by the failed setup and then by the reject
    // path), and the first keeps working.
    let Some(dev) = device_or_skip() else {
        return;
    };
    let addr = rdma_addr(19_134).expect("an RDMA address");
    let config = RdmaConfig {
        recv_depth: 16,
        recv_pool_bytes: 2 << 20,
        ..small_ring()
    };
    let mut b = RdmaTransport::new(Arc::clone(&dev), config).unwrap();
    b.listen(addr).unwrap();
    let pool = Arc::clone(b.pool());
    let first = connecting(&dev, addr);
    drive_until_finished(&mut b, &first);
    let (mut a1, to_b) = first.join().unwrap();
    let to_b = to_b.expect("the first peer connects");
    let second = connecting(&dev, addr);
    drive_until_finished(&mut b, &second);
    let (a2, refused) = second.join().unwrap();
    match refused {
        Err(VerbsError::Rejected(Some(cm::RejectReason::NoResources))) => {}
        other => panic!("the second peer: {other:?}"),
    }
    assert_eq!(a2.peer_count(), 0);
    assert_eq!(a2.pool().stats().leases, 0);
    drop(a2);
    let until = std::time::Instant::now() + WAIT;
    while b.peer_count() != 1 {
        b.progress().unwrap();
        assert!(
            std::time::Instant::now() < until,
            "{} peers",
            b.peer_count()
        );
    }
    assert_eq!(
        pool.stats().leases,
        posted(&config),
        "the first ring only: {:?}",
        pool.stats()
    );
    a1.try_send(to_b, b"still here").unwrap();
    let r = next_driving(&mut b, &mut a1, std::time::Instant::now() + WAIT)
        .expect("the first peer's message");
    assert_eq!(host_bytes(&r.lease), b"still here");
}

/// A peer that does what zerohop's own never does: announce a ring too
/// shallow, refuse a listener's reply, or accept with no QP behind it.
// Its ids have no queue pair (a connect or accept names a QP number that
// points at nothing) and its private data is of its choosing; it is built on
// the backend's owning CM types, which free themselves, in order, on drop.
mod cm_peer {
    use std::net::SocketAddr;
    use std::ptr::NonNull;
    use std::time::Duration;

    use rdma_sys as ffi;
    use zerohop_backends::verbs::cm::{self, CmId, EventChannel};

    /// A made-up QP number: these ids have no queue pair.
    const NO_QP: u32 = 0x00ab_cdef;

    /// Private data announcing a receive ring of `depth` (no flags).
    pub fn ring(depth: u32) -> Vec<u8> {
        let mut p = depth.to_le_bytes().to_vec();
        p.extend_from_slice(&0u32.to_le_bytes());
        p
    }

    pub struct Peer {
        /// On a listener, the id of the request it accepted (dropped first).
        accepted: Option<CmId>,
        /// The connecting id, or the listening one.
        id: CmId,
    }

    impl Peer {
        fn fresh_id() -> Result<CmId, String> {
            let ch = EventChannel::new().map_err(|e| e.to_string())?;
            CmId::new(&ch).map_err(|e| e.to_string())
        }

        /// Resolves `addr` and sends a connect request with `private` data.
        pub fn connect(addr: SocketAddr, private: &[u8]) -> Result<Self, String> {
            let id = Self::fresh_id()?;
            id.resolve(addr, std::time::Instant::now() + Duration::from_secs(10))
                .map_err(|e| e.to_string())?;
            id.connect_without_qp(private, NO_QP)
                .map_err(|e| e.to_string())?;
            Ok(Peer { accepted: None, id })
        }

        /// Listens on `addr`.
        pub fn listen(addr: SocketAddr) -> Result<Self, String> {
            let id = Self::fresh_id()?;
            id.listen(addr, 1).map_err(|e| e.to_string())?;
            Ok(Peer { accepted: None, id })
        }

        /// Waits for a connect request and accepts it with `private` data.
        pub fn accept(&mut self, private: &[u8]) -> Result<(), String> {
            let ev = self.event()?;
            if ev.kind != ffi::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST {
                return Err(format!(
                    "CM event {}, expected a connect request",
                    ev.name()
                ));
            }
            let raw = NonNull::new(ev.id).ok_or("a connect request without an id")?;
            // SAFETY: a connect request's id is the event's own, owned by
            // nothing else; its events come on the listener's channel.
            let id = unsafe { CmId::adopt(raw, self.id.channel()) };
            let accepted = id.accept_without_qp(private, NO_QP);
            self.accepted = Some(id);
            accepted.map_err(|e| e.to_string())
        }

        /// Rejects the answer to this peer's connect request.
        pub fn reject(&self) -> Result<(), String> {
            self.id.reject(cm::RejectReason::Refused);
            Ok(())
        }

        /// The next CM event (acknowledged), waiting at most 10 s.
        fn event(&self) -> Result<zerohop_backends::verbs::cm::CmEvent, String> {
            self.id
                .channel()
                .next(Duration::from_secs(10))
                .map_err(|e| e.to_string())?
                .ok_or_else(|| "no CM event within 10 s".to_string())
        }

        /// The next CM event's type.
        pub fn next(&self) -> Result<ffi::rdma_cm_event_type::Type, String> {
            self.event().map(|ev| ev.kind)
        }

        /// The next CM event's type and the first word of its private data
        /// (a reject's reason).
        pub fn next_with_word(
            &self,
        ) -> Result<(ffi::rdma_cm_event_type::Type, Option<u32>), String> {
            self.event().map(|ev| (ev.kind, ev.word))
        }

        pub fn expect(&self, want: ffi::rdma_cm_event_type::Type) -> Result<(), String> {
            match self.next()? {
                k if k == want => Ok(()),
                k => Err(format!("CM event {k}, expected {want}")),
            }
        }
    }
}

/// A receiver whose ring a dry pool left short (the application holds every
/// receive buffer, so the sender has no credit) wakes when another thread
/// gives a buffer back (the pool's bell), not at its next look: with a poll
/// interval of an hour, the message the sender holds still comes long
/// before the deadline.
#[test]
fn a_buffer_given_back_by_another_thread_wakes_a_receiver_whose_ring_ran_dry() {
    // One 2 MiB chunk of receive buffers holds 31 (see above): a ring of 16.
    let config = RdmaConfig {
        recv_depth: 16,
        recv_pool_bytes: 2 << 20,
        ..small_ring()
    };
    let slow_looks = EndpointConfig {
        poll_interval: Duration::from_secs(3600),
        ..EndpointConfig::default()
    };
    let Some((a, b, peer)) = pair_looking(19_140, small_ring(), config, slow_looks) else {
        return;
    };
    let pool = b.with(|t| Arc::clone(t.pool()));
    let m = |i: usize| vec![i as u8; 4000];
    let sender = std::thread::spawn(move || {
        for i in 0..31 {
            a.send(peer, &m(i), Deadline::after(WAIT), None).unwrap();
        }
        a.flush(Deadline::after(WAIT)).unwrap();
        a
    });
    // Hold what arrives until nothing comes for 2 s: the pool dry, its
    // other buffers posted in the control slots (28 held). Wire version 4
    // could stop the sender sooner, with a slot free here that it could not
    // learn of (RELIABILITY.md, "Ring credits with the receive pools dry").
    let mut held = Vec::new();
    while let Ok(r) = b.recv(Deadline::after(Duration::from_secs(2)), None) {
        held.push(r);
    }
    let next = held.len();
    let control = zerohop_core::session::CONTROL_SLOTS as usize;
    assert_eq!(next, 31 - control, "the sender stopped short");
    assert_eq!(pool.stats().budget, pool.stats().reserved_bytes);
    let first = held.remove(0);
    let giver = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200)); // the receiver asleep by then
        drop(first);
    });
    let (cpu, t0) = (thread_cpu(), std::time::Instant::now());
    let last = b.recv(Deadline::after(Duration::from_secs(10)), None);
    let (cpu, waited) = (thread_cpu() - cpu, t0.elapsed());
    giver.join().unwrap();
    // Unwoken, it sleeps out the deadline (its poll's only bound).
    assert!(
        waited < Duration::from_secs(5),
        "asleep {waited:?} after the buffer came back"
    );
    // (The two sides traded credit frames while the pool was dry: a core's
    // worth on each, the sender's waiting and this side's one slot back.)
    assert!(cpu < waited / 3, "recv spun: {cpu:?} of CPU in {waited:?}");
    assert_eq!(host_bytes(&last.unwrap().lease), &m(next)[..], "intact");
    // Every buffer back: the rest arrive, in order.
    drop(held);
    for i in next + 1..31 {
        let r = b.recv(Deadline::after(WAIT), None).unwrap();
        assert_eq!(host_bytes(&r.lease), &m(i)[..], "message {i}");
    }
    drop(sender.join().unwrap());
}

/// A message longer than a fragment whose first fragment comes while the
/// application holds every buffer of its size waits in the receive buffers
/// its fragments landed in, and what comes after it waits behind it: once
/// a buffer comes back it arrives whole, then the rest, in order. (Before,
/// the failed lease failed the connection.)
#[test]
fn a_long_message_into_a_dry_pool_waits_for_a_buffer_and_keeps_its_place() {
    // Two 2 MiB chunks: the receive ring's buffers (31 of 64 KiB, 19
    // posted), and eight of 256 KiB for messages of four fragments.
    let config = RdmaConfig {
        recv_depth: 16,
        recv_pool_bytes: 4 << 20,
        ..small_ring()
    };
    let Some((a, b, peer)) = pair_with(19_142, small_ring(), config) else {
        return;
    };
    let pool = b.with(|t| Arc::clone(t.pool()));
    let long = |i: usize| (0..200_000).map(|k| (k * 7 + i) as u8).collect::<Vec<u8>>();
    let short = || vec![0xA5; 100];
    let sender = std::thread::spawn(move || {
        for i in 0..10 {
            a.send(peer, &long(i), Deadline::after(WAIT), None).unwrap();
        }
        a.send(peer, &short(), Deadline::after(WAIT), None).unwrap();
        a.flush(Deadline::after(WAIT)).unwrap();
        a
    });
    let mut held = Vec::new();
    for i in 0..8 {
        let r = b.recv(Deadline::after(WAIT), None).unwrap();
        assert_eq!(host_bytes(&r.lease), &long(i)[..], "message {i}");
        held.push(r);
    }
    // Every 256 KiB buffer held: the ninth waits, the connection stays.
    match b.recv(Deadline::after(Duration::from_secs(1)), None) {
        Err(Error::Timeout) => {}
        other => panic!("the ninth message had no buffer: {other:?}"),
    }
    assert_eq!(pool.stats().budget, pool.stats().reserved_bytes);
    held.remove(0);
    let r = b.recv(Deadline::after(WAIT), None).unwrap();
    assert_eq!(
        host_bytes(&r.lease),
        &long(8)[..],
        "the ninth, once a buffer came back"
    );
    drop((r, held));
    let tenth = b.recv(Deadline::after(WAIT), None).unwrap();
    assert_eq!(host_bytes(&tenth.lease), &long(9)[..], "the tenth");
    let r = b.recv(Deadline::after(WAIT), None).unwrap();
    assert_eq!(host_bytes(&r.lease), &short()[..], "the short one, last");
    drop((tenth, r));
    drop((sender.join().unwrap(), b));
    assert_eq!(pool.stats().leases, 0, "every buffer back");
}

/// Where the receive ring's own buffers are all the pool has out, a buffer
/// for a long message can never come (their chunk never falls idle for a
/// larger class): the connection fails at once with the pool's error, not
/// after a stall.
#[test]
fn a_long_message_no_buffer_can_ever_hold_fails_its_connection_at_once() {
    // One 2 MiB chunk, all of it the ring's class.
    let config = RdmaConfig {
        recv_depth: 16,
        recv_pool_bytes: 2 << 20,
        ..small_ring()
    };
    let Some((a, b, peer)) = pair_with(19_143, small_ring(), config) else {
        return;
    };
    let pool = b.with(|t| Arc::clone(t.pool()));
    let sender = std::thread::spawn(move || {
        a.send(peer, &vec![1u8; 200_000], Deadline::after(WAIT), None)
            .unwrap();
        // Driven until the receiver's failure reaches it.
        let _ = a.flush(Deadline::after(WAIT));
        a
    });
    let t0 = std::time::Instant::now();
    match b.recv(Deadline::after(WAIT), None) {
        Err(Error::NoReceiveBuffer {
            len: 200_000,
            why: PoolError::Exhausted { cap, .. },
            ..
        }) => assert_eq!(cap, 2 << 20),
        other => panic!("no buffer could come: {other:?}"),
    }
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "failed after {:?}",
        t0.elapsed()
    );
    assert_eq!(pool.stats().leases, 0, "the ring's buffers back");
    drop(sender.join().unwrap());
}

/// Drives `t` until `done` says so, or fails the test after `WAIT`.
fn drive_until(
    t: &mut RdmaTransport,
    what: &str,
    mut done: impl FnMut(&mut RdmaTransport) -> bool,
) {
    let until = std::time::Instant::now() + WAIT;
    while !done(t) {
        t.progress().unwrap();
        assert!(std::time::Instant::now() < until, "never: {what}");
    }
}

/// What `t` hands on within `within`, driving it.
fn arrivals_within(
    t: &mut RdmaTransport,
    within: Duration,
) -> Vec<Result<Received<<RdmaTransport as Transport>::Lease>, Error>> {
    let (mut got, t0) = (Vec::new(), std::time::Instant::now());
    while t0.elapsed() < within {
        t.progress().unwrap();
        match t.try_recv() {
            Err(Error::WouldBlock) => {}
            r => got.push(r),
        }
    }
    got
}

/// A peer that sends, closes and goes while its messages wait behind one
/// that has no buffer: they are still handed on once a buffer comes back,
/// in order, its Close last. (Before, the connection's going dropped them
/// and the Close, silently: a reviewer's probe.)
#[test]
fn messages_waiting_for_a_buffer_outlive_their_connection_and_its_close_comes_last() {
    let Some(dev) = device_or_skip() else {
        return;
    };
    let addr = rdma_addr(19_150).expect("an RDMA address");
    // The ring's chunk, and one of the 1 MiB class: two buffers.
    let config = RdmaConfig {
        recv_depth: 8,
        recv_pool_bytes: 4 << 20,
        ..small_ring()
    };
    let mut b = RdmaTransport::new(Arc::clone(&dev), config).unwrap();
    b.listen(addr).unwrap();
    let long = |i: usize| (0..600_000).map(|k| (k * 7 + i) as u8).collect::<Vec<u8>>();
    let sender = std::thread::spawn(move || {
        let mut a = RdmaTransport::new(dev, small_ring()).unwrap();
        let peer = a.connect(addr, CONNECT).unwrap();
        for m in [long(0), long(1), long(2), vec![0xA5; 100]] {
            loop {
                match a.try_send(peer, &m) {
                    Ok(()) => break,
                    Err(Error::WouldBlock) => drop(a.progress().unwrap()),
                    Err(e) => panic!("send: {e}"),
                }
            }
        }
        while a.pending_frames() > 0 {
            a.progress().unwrap();
        }
        a.close().unwrap();
        let t0 = std::time::Instant::now();
        while t0.elapsed() < Duration::from_millis(500) {
            a.progress().unwrap();
        }
    });
    let mut held = Vec::new();
    drive_until(&mut b, "two messages", |b| {
        if let Ok(r) = b.try_recv() {
            held.push(r);
        }
        held.len() == 2
    });
    assert_eq!(host_bytes(&held[0].lease), &long(0)[..]);
    assert_eq!(host_bytes(&held[1].lease), &long(1)[..]);
    drive_until(&mut b, "the sender gone", |_| sender.is_finished());
    sender.join().unwrap();
    let early = arrivals_within(&mut b, Duration::from_secs(1));
    assert!(early.is_empty(), "handed on without a buffer: {early:?}");
    assert_eq!(b.peers_left(), 0, "the connection went");
    drop(held);
    let after = arrivals_within(&mut b, Duration::from_secs(2));
    let shown: Vec<_> = after
        .iter()
        .map(|r| r.as_ref().map(|m| m.lease.len()))
        .collect();
    assert!(
        matches!(&after[..], [Ok(m), Ok(s), Err(Error::PeerClosed(_))]
            if host_bytes(&m.lease) == &long(2)[..] && host_bytes(&s.lease) == &[0xA5; 100][..]),
        "the held message, the short one and the Close: {shown:?}"
    );
    drop(after);
    assert_eq!(b.pool().stats().leases, 0, "every buffer back");
}

/// Another peer's message being reassembled will give its buffer back:
/// a second peer's long message that finds the pool dry waits for it, and
/// is not failed as one no buffer could ever hold (a reviewer's probe).
#[test]
fn a_long_message_waits_for_the_buffer_another_peers_message_will_give_back() {
    let Some(dev) = device_or_skip() else {
        return;
    };
    let addr = rdma_addr(19_151).expect("an RDMA address");
    // The ring's 2 MiB chunk, and room for one 1.5 MB (oversize) buffer.
    let config = RdmaConfig {
        recv_depth: 8,
        recv_pool_bytes: 3840 << 10,
        ..small_ring()
    };
    let mut b = RdmaTransport::new(Arc::clone(&dev), config).unwrap();
    b.listen(addr).unwrap();
    let c1 = connecting(&dev, addr);
    drive_until(&mut b, "the first peer", |b| {
        c1.is_finished() && b.peer_count() == 1
    });
    let (mut a1, p1) = c1.join().unwrap();
    let p1 = p1.expect("the first peer connects");
    let c2 = connecting(&dev, addr);
    drive_until(&mut b, "the second peer", |b| {
        c2.is_finished() && b.peer_count() == 2
    });
    let (mut a2, p2) = c2.join().unwrap();
    let p2 = p2.expect("the second peer connects");
    let len = 1_500_000;
    a1.try_send(p1, &vec![1u8; len]).unwrap();
    drive_until(&mut b, "the first's buffer", |b| {
        b.pool().stats().oversize == 1
    });
    a2.try_send(p2, &vec![2u8; len]).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let driver = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                a1.progress().unwrap();
                a2.progress().unwrap();
            }
            (a1, a2)
        })
    };
    for i in [1u8, 2] {
        let mut got = None;
        drive_until(&mut b, "a message", |b| match b.try_recv() {
            Err(Error::WouldBlock) => false,
            r => {
                got = Some(r);
                true
            }
        });
        match got.unwrap() {
            Ok(m) => assert_eq!(host_bytes(&m.lease), &vec![i; len][..], "message {i}"),
            Err(e) => panic!("message {i}: {e}"),
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    drop(driver.join().unwrap());
}

/// Where the only buffer out but the ring's is one whose return cannot
/// serve a long message (a short message the application keeps, in the
/// ring's own chunk), no buffer can ever come: the connection fails at
/// once, not after waiting for good (a reviewer's probe).
#[test]
fn a_long_message_fails_at_once_where_only_a_buffer_that_cannot_serve_it_is_out() {
    let config = RdmaConfig {
        recv_depth: 16,
        recv_pool_bytes: 2 << 20,
        ..small_ring()
    };
    let Some((mut a, mut b, peer)) = raw_pair(19_152, config) else {
        return;
    };
    a.try_send(peer, &[7u8; 100]).unwrap();
    let short = next(&mut b);
    a.try_send(peer, &vec![1u8; 200_000]).unwrap();
    let (t0, mut got) = (std::time::Instant::now(), None);
    while got.is_none() && t0.elapsed() < Duration::from_secs(10) {
        a.progress().unwrap();
        b.progress().unwrap();
        match b.try_recv() {
            Err(Error::WouldBlock) => {}
            r => got = Some(r),
        }
    }
    assert!(
        matches!(got, Some(Err(Error::NoReceiveBuffer { len: 200_000, .. }))),
        "{:?} after {:?}",
        got.map(|r| r.map(|m| m.lease.len())),
        t0.elapsed()
    );
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "after {:?}",
        t0.elapsed()
    );
    drop(short);
}
