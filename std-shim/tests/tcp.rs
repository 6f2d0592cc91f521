//! The TCP wire through real sockets: in one process, across processes, across
//! network namespaces, and against peers that die or lie.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use zerohop_backends::host_bytes;
use zerohop_core::session::ProtocolError;
use zerohop_core::wire::DecodeError as V2;
use zerohop_core::wire_v1::{Flags, FrameKind, Header, HEADER_LEN};
use zerohop_core::{crc32c, Error, Kind, PeerId, Transport};
use zerohop_std::tcp::{TcpConfig, TcpTransport, STRIPE_MIN};
use zerohop_std::{heap_pool, Deadline, Endpoint, EndpointConfig, StdPool};

const SECOND: Duration = Duration::from_secs(1);

fn transport(budget: usize, config: TcpConfig) -> TcpTransport {
    TcpTransport::new(heap_pool(budget).unwrap(), config, Kind::Tcp)
}

fn listener(
    budget: usize,
    config: TcpConfig,
) -> (Endpoint<TcpTransport>, SocketAddr, Arc<StdPool>) {
    let mut t = transport(budget, config);
    let addr = t.listen("127.0.0.1:0").unwrap();
    let pool = Arc::clone(t.pool());
    (
        Endpoint::new(t, EndpointConfig::default()).unwrap(),
        addr,
        pool,
    )
}

fn client(addr: SocketAddr) -> (Endpoint<TcpTransport>, PeerId) {
    client_with(addr, TcpConfig::default())
}

fn client_with(addr: SocketAddr, config: TcpConfig) -> (Endpoint<TcpTransport>, PeerId) {
    let mut t = transport(64 << 20, config);
    let peer = t.connect(addr, SECOND).unwrap();
    (Endpoint::new(t, EndpointConfig::default()).unwrap(), peer)
}

/// A message whose last 4 bytes are the CRC of the rest, so any damage shows.
fn message(i: u64, max: usize) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let len = 8 + (x as usize % max);
    let mut m: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    m[..8].copy_from_slice(&i.to_le_bytes());
    let c = crc32c(0, &m);
    m.extend_from_slice(&c.to_le_bytes());
    m
}

fn check(m: &[u8]) -> u64 {
    let (body, crc) = m.split_at(m.len() - 4);
    assert_eq!(
        crc32c(0, body).to_le_bytes(),
        crc,
        "checksum of a delivered message"
    );
    u64::from_le_bytes(body[..8].try_into().unwrap())
}

#[test]
fn two_endpoints_exchange_messages_in_order_and_release_every_buffer() {
    let (server, addr, server_pool) = listener(256 << 20, TcpConfig::default());
    let (c, peer) = client(addr);
    let n = 2000u64;
    let sender = std::thread::spawn(move || {
        for i in 0..n {
            c.send(
                peer,
                &message(i, 100_000),
                Deadline::after(10 * SECOND),
                None,
            )
            .unwrap();
        }
        c.close(Deadline::after(10 * SECOND)).unwrap();
    });
    for i in 0..n {
        let r = server.recv(Deadline::after(10 * SECOND), None).unwrap();
        assert_eq!(check(host_bytes(&r.lease)), i, "order kept");
    }
    sender.join().unwrap();
    assert_eq!(server_pool.used_bytes(), 0, "every receive lease went back");
}

#[test]
fn a_thread_sends_while_another_spins_in_recv_on_the_same_endpoint() {
    // A receiver spinning in `recv` keeps the transport locked between its
    // polls while no other thread wants it; a sender on the same endpoint
    // must get in at once, not when the (here 20 s) spin runs out.
    let (server, addr, _) = listener(64 << 20, TcpConfig::default());
    let mut t = transport(64 << 20, TcpConfig::default());
    let peer = t.connect(addr, SECOND).unwrap();
    let spinning = EndpointConfig {
        spin: 20 * SECOND,
        ..EndpointConfig::default()
    };
    let c = Endpoint::new(t, spinning).unwrap();
    std::thread::scope(|s| {
        let echo = s.spawn(|| {
            let r = server.recv(Deadline::after(30 * SECOND), None).unwrap();
            server
                .send(
                    r.peer,
                    host_bytes(&r.lease),
                    Deadline::after(30 * SECOND),
                    None,
                )
                .unwrap();
        });
        let receiver = s.spawn(|| c.recv(Deadline::after(30 * SECOND), None));
        // Let the receiver start spinning (it holds the lock from its first poll).
        std::thread::sleep(Duration::from_millis(200));
        let start = Instant::now();
        c.send(peer, b"through", Deadline::after(30 * SECOND), None)
            .unwrap();
        let took = start.elapsed();
        let r = receiver.join().unwrap().unwrap();
        echo.join().unwrap();
        assert_eq!(host_bytes(&r.lease), b"through");
        assert!(
            took < 5 * SECOND,
            "the send waited {took:?} for a spinning receiver"
        );
    });
}

#[test]
fn the_progress_threads_stay_out_of_the_way_of_applications_that_keep_polling() {
    // Both sides call send / recv back to back for 300 ms; the progress
    // threads, woken every 2 ms by their timers, must not take the transport
    // lock for those quiet intervals (each such pass stalls the application
    // behind the lock). Taking a pass on every timer would be about 150 each.
    let quick = EndpointConfig {
        poll_interval: Duration::from_millis(2),
        ..EndpointConfig::default()
    };
    let mut t = transport(64 << 20, TcpConfig::default());
    let addr = t.listen("127.0.0.1:0").unwrap();
    let server = Endpoint::new(t, quick).unwrap();
    let mut t = transport(64 << 20, TcpConfig::default());
    let peer = t.connect(addr, SECOND).unwrap();
    let c = Endpoint::new(t, quick).unwrap();
    let start = Instant::now();
    let mut round_trips = 0u64;
    std::thread::scope(|s| {
        s.spawn(|| loop {
            let r = server.recv(Deadline::after(5 * SECOND), None).unwrap();
            let stop = r.lease.is_empty();
            server
                .send(
                    r.peer,
                    host_bytes(&r.lease),
                    Deadline::after(5 * SECOND),
                    None,
                )
                .unwrap();
            if stop {
                return;
            }
        });
        let (client_before, server_before) = (c.progress_passes(), server.progress_passes());
        while start.elapsed() < Duration::from_millis(300) {
            c.send(peer, &[7u8; 64], Deadline::after(5 * SECOND), None)
                .unwrap();
            let r = c.recv(Deadline::after(5 * SECOND), None).unwrap();
            assert_eq!(host_bytes(&r.lease), &[7u8; 64], "the echo");
            round_trips += 1;
        }
        let passes = (
            c.progress_passes() - client_before,
            server.progress_passes() - server_before,
        );
        c.send(peer, &[], Deadline::after(5 * SECOND), None)
            .unwrap();
        c.recv(Deadline::after(5 * SECOND), None).unwrap();
        assert!(
            round_trips > 100,
            "only {round_trips} round trips in 300 ms"
        );
        // A descheduled thread legitimately lets its progress thread take
        // over for a pass or two; 30 leaves room for a loaded machine.
        assert!(
            passes.0 < 30 && passes.1 < 30,
            "progress passes while both applications polled (client, server): {passes:?}"
        );
    });
}

#[test]
fn a_zero_length_message_and_a_64_mib_message_arrive() {
    let (server, addr, _) = listener(512 << 20, TcpConfig::default());
    let (c, peer) = client(addr);
    let big: Vec<u8> = (0..64usize << 20).map(|i| (i % 251) as u8).collect();
    let big2 = big.clone();
    let t = std::thread::spawn(move || {
        c.send(peer, &[], Deadline::after(10 * SECOND), None)
            .unwrap();
        c.send(peer, &big2, Deadline::after(30 * SECOND), None)
            .unwrap();
        c.flush(Deadline::after(30 * SECOND)).unwrap();
        c
    });
    assert_eq!(
        host_bytes(
            &server
                .recv(Deadline::after(10 * SECOND), None)
                .unwrap()
                .lease
        )
        .len(),
        0
    );
    let r = server.recv(Deadline::after(30 * SECOND), None).unwrap();
    assert!(host_bytes(&r.lease) == &big[..]);
    let c = t.join().unwrap();
    assert_eq!(
        c.send(PeerId(0), &vec![0; (64 << 20) + 1], Deadline::never(), None),
        Err(Error::TooLarge {
            len: (64 << 20) + 1,
            max: 64 << 20
        })
    );
}

#[test]
fn garbage_and_a_huge_declared_length_close_only_that_connection() {
    let (server, addr, pool) = listener(64 << 20, TcpConfig::default());
    let (good, peer) = client(addr);
    good.send(peer, b"before", Deadline::after(SECOND), None)
        .unwrap();
    assert_eq!(
        host_bytes(
            &server
                .recv(Deadline::after(5 * SECOND), None)
                .unwrap()
                .lease
        ),
        b"before"
    );

    // Garbage: not a zerohop frame.
    let mut g = TcpStream::connect(addr).unwrap();
    g.write_all(&[0xEE; 64]).unwrap();
    let e = server.recv(Deadline::after(5 * SECOND), None).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Protocol {
                error: ProtocolError::Decode(V2::BadMagic(0xEEEE)),
                ..
            }
        ),
        "{e:?}"
    );

    // A valid header declaring the largest length the wire can carry (u32::MAX,
    // 4 GiB; a 1 TiB length cannot be expressed): refused before any lease.
    let mut h = Header::data(0, 0, 0, &[], false, Flags::NONE);
    h.len = u32::MAX;
    h.checksum = h.compute_checksum(&[]);
    let mut liar = TcpStream::connect(addr).unwrap();
    liar.write_all(&h.encode()).unwrap();
    let e = server.recv(Deadline::after(5 * SECOND), None).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Protocol {
                error: ProtocolError::Decode(V2::TooLong {
                    len: 4294967295,
                    max: 67108864
                }),
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        pool.stats().reserved_bytes <= 2 << 20,
        "nothing of the declared size was taken: {:?}",
        pool.stats()
    );

    expect_still_served(&server, &good, peer);
    assert_eq!(server.with(|t| t.peer_count()), 1);
    assert_eq!(pool.used_bytes(), 0);
}

#[test]
fn a_peer_that_dies_mid_message_is_reported_and_leaks_nothing() {
    let (server, addr, pool) = listener(64 << 20, TcpConfig::default());
    let (good, peer) = client(addr);
    let used_before = pool.used_bytes();
    for abort in [false, true] {
        let mut dying = TcpStream::connect(addr).unwrap();
        let payload = vec![7u8; 1 << 20];
        let h = Header::data(0, 0, 0, &payload, false, Flags::NONE);
        dying.write_all(&h.encode()).unwrap();
        dying.write_all(&payload[..300_000]).unwrap();
        // Let the server take the header and lease a buffer for the payload.
        await_partial_lease(&pool, used_before);
        if abort {
            // SO_LINGER 0: the kernel sends RST, as for a killed process with unread data.
            socket_linger_zero(&dying);
        }
        drop(dying);
        expect_lost_with_its_lease_back(&server, &pool, used_before);
    }
    expect_still_served(&server, &good, peer);
}

/// The well-behaved peer is unaffected: its next message still arrives.
fn expect_still_served(
    server: &Endpoint<TcpTransport>,
    good: &Endpoint<TcpTransport>,
    peer: PeerId,
) {
    good.send(peer, b"still here", Deadline::after(SECOND), None)
        .unwrap();
    let r = server.recv(Deadline::after(5 * SECOND), None).unwrap();
    assert_eq!(host_bytes(&r.lease), b"still here");
}

/// Waits until a partial message holds a receive lease (`pool` above `before`).
fn await_partial_lease(pool: &StdPool, before: usize) {
    let t0 = Instant::now();
    while pool.used_bytes() == before && t0.elapsed() < 5 * SECOND {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        pool.used_bytes() > before,
        "the partial message holds a lease"
    );
}

/// The next `recv` reports a lost peer, and its partial message's lease is back.
fn expect_lost_with_its_lease_back(server: &Endpoint<TcpTransport>, pool: &StdPool, before: usize) {
    let e = server.recv(Deadline::after(5 * SECOND), None).unwrap_err();
    assert!(matches!(e, Error::PeerLost(_)), "{e:?}");
    assert_eq!(
        pool.used_bytes(),
        before,
        "the partial message's lease went back"
    );
}

fn socket_linger_zero(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket descriptor and a correctly sized linger struct.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0);
}

#[test]
fn a_receiver_that_stops_reading_blocks_then_times_out_the_sender_with_bounded_memory() {
    let config = TcpConfig {
        inbox_messages: 16,
        send_queue_bytes: 1 << 20,
        ..TcpConfig::default()
    };
    let (server, addr, server_pool) = listener(64 << 20, config);
    let mut t = transport(64 << 20, config);
    let peer = t.connect(addr, SECOND).unwrap();
    let c = Endpoint::new(t, EndpointConfig::default()).unwrap();
    let chunk = vec![1u8; 64 << 10];
    let started = Instant::now();
    let mut sent = 0usize;
    let err = loop {
        match c.send(
            peer,
            &chunk,
            Deadline::after(Duration::from_millis(300)),
            None,
        ) {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
        assert!(started.elapsed() < 60 * SECOND, "the sender never blocked");
    };
    assert_eq!(err, Error::Timeout);
    let queued = c.pending_sends();
    assert!(
        queued <= (1 << 20) + (64 << 10) + HEADER_LEN,
        "sender queue bounded: {queued}"
    );
    assert!(
        server_pool.stats().reserved_bytes <= 4 << 20,
        "receiver memory bounded: {:?}",
        server_pool.stats()
    );
    assert!(
        sent > 16,
        "it sent until the kernel buffers filled ({sent})"
    );
    drop(server);
}

#[test]
fn a_receiver_reads_ahead_at_most_inbox_bytes_so_its_pool_stays_small() {
    let config = TcpConfig {
        inbox_bytes: 256 << 10,
        ..TcpConfig::default()
    };
    let (server, addr, server_pool) = listener(64 << 20, config);
    let (c, peer) = client(addr);
    // Nobody calls recv on the server: its progress thread reads ahead alone.
    let chunk = vec![3u8; 64 << 10];
    let mut sent = 0;
    while c
        .send(
            peer,
            &chunk,
            Deadline::after(Duration::from_millis(300)),
            None,
        )
        .is_ok()
    {
        sent += 1;
        assert!(sent < 100_000, "the sender never blocked");
    }
    let st = server_pool.stats();
    assert!(
        st.used_bytes <= (256 << 10) + (64 << 10),
        "read ahead bounded by inbox_bytes (plus the message in progress): {st:?}"
    );
    assert!(st.reserved_bytes <= 2 << 20, "one chunk: {st:?}");
    assert!(
        sent > 8,
        "the kernel buffers and the sender's queue took the rest ({sent})"
    );
    // Everything sent arrives once the application reads.
    for _ in 0..sent {
        let m = server.recv(Deadline::after(10 * SECOND), None).unwrap();
        assert_eq!(m.lease.len(), 64 << 10);
    }
}

#[test]
fn a_large_message_waits_in_the_socket_while_another_waits_for_the_application() {
    // Two 40 KiB messages: the receiver's first 64 KiB read takes the first
    // whole and the second's header with part of its payload. While the
    // first waits for the application, the second takes no buffer (its rest
    // stays in the socket): a stream of large messages then reuses the
    // buffer the application gives back instead of cycling through new ones.
    let mut b = transport(16 << 20, TcpConfig::default());
    let addr = b.listen("127.0.0.1:0").unwrap();
    let mut a = transport(16 << 20, TcpConfig::default());
    let peer = a.connect(addr, SECOND).unwrap();
    let m = |i: u8| vec![i; 40 << 10];
    a.try_send(peer, &m(1)).unwrap();
    a.try_send(peer, &m(2)).unwrap();
    let until = Instant::now() + 5 * SECOND;
    while a.queued_bytes() > 0 && Instant::now() < until {
        a.progress().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    // Let both messages reach b's socket before it reads at all.
    std::thread::sleep(Duration::from_millis(50));
    let mut next = || loop {
        assert!(Instant::now() < until, "no message");
        b.progress().unwrap();
        match b.try_recv() {
            Ok(r) => return (r, b.pool().used_bytes()),
            Err(Error::WouldBlock) => std::thread::sleep(Duration::from_millis(1)),
            Err(e) => panic!("{e}"),
        }
    };
    let (first, held_with_first) = next();
    assert_eq!(host_bytes(&first.lease), &m(1)[..]);
    drop(first);
    let (second, held_with_second) = next();
    assert_eq!(host_bytes(&second.lease), &m(2)[..]);
    assert_eq!(
        held_with_first, held_with_second,
        "while the first message waited, the second took no buffer of its own"
    );
}

/// Sizes around the striping threshold and well past it, with small ones
/// between, so order across the two connections is tested too.
const STRIPE_SIZES: [usize; 9] = [
    100,
    STRIPE_MIN - 1,
    STRIPE_MIN,
    STRIPE_MIN + 1,
    12,
    (1 << 20) + 4095,
    3 << 20,
    64 << 10,
    (4 << 20) + 3,
];

/// Message `i` of `len` bytes: `i`, then bytes from `i`, then the CRC (see `check`).
fn sized(i: u64, len: usize) -> Vec<u8> {
    let mut m: Vec<u8> = (0..len - 4).map(|k| (k as u64 * 31 + i) as u8).collect();
    m[..8].copy_from_slice(&i.to_le_bytes());
    let c = crc32c(0, &m);
    m.extend_from_slice(&c.to_le_bytes());
    m
}

#[test]
fn large_messages_are_striped_over_two_connections_and_arrive_whole_and_in_order() {
    for check_payload in [false, true] {
        let config = TcpConfig {
            check_payload,
            stripe_min: Some(STRIPE_MIN),
            ..TcpConfig::default()
        };
        let (server, addr, server_pool) = listener(64 << 20, config);
        let (c, peer) = client_with(addr, config);
        // The lane is open but not yet confirmed: nothing is striped until
        // the acceptor's ack has been read.
        assert_eq!(c.with(|t| t.connections(peer)), Some(1));
        let echo = std::thread::spawn(move || {
            // Echo every message back until an empty one; the acceptor's
            // replies are striped too once it has paired the lane.
            loop {
                let r = server.recv(Deadline::after(10 * SECOND), None).unwrap();
                if r.lease.is_empty() {
                    return server;
                }
                server
                    .send_lease(r.peer, r.lease, Deadline::after(10 * SECOND), None)
                    .unwrap();
            }
        });
        let echoed = |i: u64, len: usize| {
            c.send(peer, &sized(i, len), Deadline::after(10 * SECOND), None)
                .unwrap();
            let r = c.recv(Deadline::after(10 * SECOND), None).unwrap();
            assert_eq!((check(host_bytes(&r.lease)), r.lease.len()), (i, len));
        };
        // Until the ack is in, large messages go whole on the main connection.
        let mut warm = 0;
        while c.with(|t| t.striped_sent(peer)) == 0 {
            assert!(warm < 100, "the lane was never confirmed");
            echoed(1_000 + warm, STRIPE_MIN);
            warm += 1;
        }
        assert_eq!(c.with(|t| t.connections(peer)), Some(2), "confirmed");
        let before = c.with(|t| t.striped_sent(peer));
        let rounds = 3u64;
        let striped = STRIPE_SIZES.iter().filter(|&&n| n >= STRIPE_MIN).count() as u64;
        let mut i = 0u64;
        for _ in 0..rounds {
            // All of a round in flight at once, then all of its echoes.
            for &len in &STRIPE_SIZES {
                c.send(peer, &sized(i, len), Deadline::after(10 * SECOND), None)
                    .unwrap();
                i += 1;
            }
            for (k, &len) in STRIPE_SIZES.iter().enumerate() {
                let r = c.recv(Deadline::after(10 * SECOND), None).unwrap();
                let got = host_bytes(&r.lease);
                assert_eq!(got.len(), len);
                assert_eq!(
                    check(got),
                    i - STRIPE_SIZES.len() as u64 + k as u64,
                    "order kept"
                );
            }
        }
        assert_eq!(
            c.with(|t| t.striped_sent(peer)) - before,
            rounds * striped,
            "each large message striped"
        );
        c.send(peer, &[], Deadline::after(10 * SECOND), None)
            .unwrap();
        let server = echo.join().unwrap();
        let (connections, echoed_striped) =
            server.with(|t| (t.connections(PeerId(0)), t.striped_sent(PeerId(0))));
        assert_eq!(connections, Some(2), "the acceptor paired the lane");
        assert!(
            (rounds * striped..=rounds * striped + warm).contains(&echoed_striped),
            "its large echoes striped: {echoed_striped}"
        );
        c.close(Deadline::after(10 * SECOND)).unwrap();
        server.close(Deadline::after(10 * SECOND)).unwrap();
        assert_eq!(server_pool.used_bytes(), 0, "every receive lease went back");
    }
}

#[test]
fn with_striping_off_a_peer_has_one_connection() {
    let one = TcpConfig {
        stripe_min: None,
        ..TcpConfig::default()
    };
    let (server, addr, _pool) = listener(64 << 20, TcpConfig::default());
    let (c, peer) = client_with(addr, one);
    let big = sized(0, 1 << 20);
    c.send(peer, &big, Deadline::after(10 * SECOND), None)
        .unwrap();
    let r = server.recv(Deadline::after(10 * SECOND), None).unwrap();
    assert_eq!(host_bytes(&r.lease), &big[..]);
    assert_eq!(
        c.with(|t| (t.connections(peer), t.striped_sent(peer))),
        (Some(1), 0)
    );
    assert_eq!(server.with(|t| t.connections(r.peer)), Some(1));
}

/// A raw client speaking the striped wire: a main connection and its lane,
/// each announced by a Hello with `token`.
struct RawStriped {
    main: TcpStream,
    lane: TcpStream,
}

impl RawStriped {
    fn hello(token: u64, lane: u32) -> [u8; HEADER_LEN] {
        Header::control(FrameKind::Hello, 0, lane, token).encode()
    }

    /// The documented split: half the payload, rounded down to 4 KiB, on the
    /// main connection after the header; the rest on the lane.
    fn halves(payload: &[u8]) -> (&[u8], &[u8]) {
        payload.split_at((payload.len() / 2) & !4095)
    }

    fn header(seq: u64, payload: &[u8]) -> [u8; HEADER_LEN] {
        Header::data(0, 0, seq, payload, false, Flags::STRIPED).encode()
    }

    /// Reads the acceptor's ack off the lane: its Hello with our token.
    fn await_ack(&mut self, token: u64) {
        use std::io::Read;
        self.lane.set_read_timeout(Some(5 * SECOND)).unwrap();
        let mut ack = [0u8; HEADER_LEN];
        self.lane.read_exact(&mut ack).unwrap();
        let h = Header::decode(&ack, 0).unwrap();
        assert_eq!((h.kind, h.seq), (FrameKind::Hello, token), "the ack");
    }
}

#[test]
fn a_lane_that_says_hello_before_its_main_connection_is_paired_and_acked() {
    let (server, addr, pool) = listener(64 << 20, TcpConfig::default());
    let token = 0x5EED;
    let payload = sized(9, 600 << 10);
    let (first, rest) = RawStriped::halves(&payload);
    let mut raw = RawStriped {
        main: TcpStream::connect(addr).unwrap(),
        lane: TcpStream::connect(addr).unwrap(),
    };
    // The lane speaks first, and (not waiting for the ack, as a client
    // should) its half of the message comes right behind its Hello: the
    // acceptor reads it into its stage before it knows the connection is a lane.
    raw.lane.write_all(&RawStriped::hello(token, 1)).unwrap();
    raw.lane.write_all(rest).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    raw.main.write_all(&RawStriped::hello(token, 0)).unwrap();
    raw.await_ack(token);
    raw.main
        .write_all(&RawStriped::header(0, &payload))
        .unwrap();
    raw.main.write_all(first).unwrap();
    let r = server.recv(Deadline::after(5 * SECOND), None).unwrap();
    assert_eq!(host_bytes(&r.lease), &payload[..]);
    assert_eq!(
        server.with(|t| (t.peer_count(), t.connections(r.peer))),
        (1, Some(2))
    );
    drop(r);
    assert_eq!(pool.used_bytes(), 0);
}

#[test]
fn a_striped_frame_without_a_paired_lane_is_a_protocol_error() {
    let (server, addr, pool) = listener(64 << 20, TcpConfig::default());
    let (good, peer) = client(addr);
    let used_before = pool.used_bytes();
    // No Hello at all (the fuzzer's find: the reader waited for a lane that
    // would never come and never saw the connection close); then a Hello
    // but no lane yet.
    for hello in [false, true] {
        let mut raw = TcpStream::connect(addr).unwrap();
        if hello {
            raw.write_all(&RawStriped::hello(0xAB, 0)).unwrap();
        }
        let payload = sized(3, 256);
        raw.write_all(&RawStriped::header(0, &payload)).unwrap();
        raw.write_all(&payload).unwrap();
        let e = server.recv(Deadline::after(5 * SECOND), None).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Protocol {
                    error: ProtocolError::Decode(V2::ReservedBits), // NoLane, in v1
                    ..
                }
            ),
            "{hello}: {e:?}"
        );
    }
    assert_eq!(
        server.with(|t| t.peer_count()),
        1,
        "only the good peer is left"
    );
    assert_eq!(pool.used_bytes(), used_before, "nothing leased for them");
    expect_still_served(&server, &good, peer);
}

#[test]
fn a_lane_that_dies_mid_message_loses_its_peer_and_leaks_nothing() {
    let (server, addr, pool) = listener(64 << 20, TcpConfig::default());
    let (good, peer) = client(addr);
    let used_before = pool.used_bytes();
    // The lane closes (end of stream), then, for a second peer, resets (as
    // from a killed process); each main connection stays open, with its part
    // of the message delivered.
    for (token, abort) in [(0xD1E5, false), (0xD1E6, true)] {
        let mut raw = RawStriped {
            main: TcpStream::connect(addr).unwrap(),
            lane: TcpStream::connect(addr).unwrap(),
        };
        raw.main.write_all(&RawStriped::hello(token, 0)).unwrap();
        raw.lane.write_all(&RawStriped::hello(token, 1)).unwrap();
        raw.await_ack(token);
        let payload = sized(1, 1 << 20);
        let (first, rest) = RawStriped::halves(&payload);
        raw.main
            .write_all(&RawStriped::header(0, &payload))
            .unwrap();
        raw.main.write_all(first).unwrap();
        raw.lane.write_all(&rest[..100_000]).unwrap();
        await_partial_lease(&pool, used_before);
        if abort {
            socket_linger_zero(&raw.lane);
        }
        drop(raw.lane);
        expect_lost_with_its_lease_back(&server, &pool, used_before);
    }
    assert_eq!(
        server.with(|t| t.peer_count()),
        1,
        "only the good peer is left"
    );
    expect_still_served(&server, &good, peer);
}

/// Reads one frame from a raw socket: (header, payload).
fn read_frame(s: &mut TcpStream) -> (Header, Vec<u8>) {
    use std::io::Read;
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let header = Header::decode(&h, 64 << 20).unwrap();
    let mut payload = vec![0u8; header.len as usize];
    s.read_exact(&mut payload).unwrap();
    (header, payload)
}

#[test]
fn a_large_send_is_finished_from_the_callers_slice_or_from_a_copy_when_its_deadline_strikes() {
    let raw = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    // One connection (no lane), so the raw reader sees every frame whole.
    let one = TcpConfig {
        stripe_min: None,
        ..TcpConfig::default()
    };
    let (c, peer) = client_with(raw.local_addr().unwrap(), one);
    let (mut reader, _) = raw.accept().unwrap();
    let big = message(1, 1 << 20);
    let big: Vec<u8> = big.iter().copied().cycle().take(16 << 20).collect();

    // 1. Nobody reads: the kernel takes a few MiB, the caller writes on from
    // its slice until the deadline, then the rest is copied and queued; the
    // send has succeeded (the message is on the wire and cannot be withdrawn).
    let t0 = Instant::now();
    c.send(
        peer,
        &big,
        Deadline::after(Duration::from_millis(300)),
        None,
    )
    .unwrap();
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "it waited, writing"
    );
    let queued = c.pending_sends();
    assert!(
        queued > 0 && queued < big.len(),
        "the unsent rest was copied: {queued}"
    );
    // A later message goes behind it.
    c.send(peer, b"after", Deadline::never(), None).unwrap();
    let (h, p) = read_frame(&mut reader);
    assert_eq!((h.seq, p.len()), (0, big.len()));
    assert!(
        p == big,
        "the copied rest continues the caller's bytes exactly"
    );
    let (h, p) = read_frame(&mut reader);
    assert_eq!((h.seq, &p[..]), (1, &b"after"[..]));

    // 2. A reader that keeps up: the send returns when all of the message is
    // with the kernel, and nothing was copied or queued.
    let drain = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        let (h, p) = read_frame(&mut reader);
        (h.seq, p)
    });
    c.send(peer, &big, Deadline::never(), None).unwrap();
    assert_eq!(c.pending_sends(), 0, "sent from the caller's slice");
    let (seq, p) = drain.join().unwrap();
    assert_eq!(seq, 2);
    assert!(p == big);
}

#[test]
fn cancellation_interrupts_a_waiting_recv() {
    let (server, _, _) = listener(16 << 20, TcpConfig::default());
    let token = zerohop_std::CancelToken::new();
    let t2 = token.clone();
    let canceller = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        t2.cancel();
    });
    let t0 = Instant::now();
    assert_eq!(
        server.recv(Deadline::never(), Some(&token)).unwrap_err(),
        Error::Cancelled
    );
    assert!(t0.elapsed() < 2 * SECOND);
    canceller.join().unwrap();
}

#[test]
fn sending_to_an_unknown_peer_is_a_typed_error() {
    let (server, _, _) = listener(16 << 20, TcpConfig::default());
    assert_eq!(
        server.send(PeerId(9), b"x", Deadline::after(SECOND), None),
        Err(Error::UnknownPeer(PeerId(9)))
    );
}

// ---- across processes ------------------------------------------------------

/// Runs as a child process (see `two_processes`): echoes `count` messages back.
#[test]
#[ignore = "a helper: run by other tests in a child process"]
fn child_echo() {
    let Ok(addr) = std::env::var("ZEROHOP_TEST_CONNECT") else {
        return;
    };
    let count: u64 = std::env::var("ZEROHOP_TEST_COUNT")
        .unwrap()
        .parse()
        .unwrap();
    let (c, peer) = client(addr.parse().unwrap());
    for _ in 0..count {
        let r = c.recv(Deadline::after(60 * SECOND), None).unwrap();
        c.send(
            peer,
            host_bytes(&r.lease),
            Deadline::after(60 * SECOND),
            None,
        )
        .unwrap();
    }
    c.close(Deadline::after(30 * SECOND)).unwrap();
}

fn spawn_child(prefix: &[&str], addr: SocketAddr, count: u64) -> std::process::Child {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(prefix.first().copied().unwrap_or(exe.to_str().unwrap()));
    if !prefix.is_empty() {
        cmd.args(&prefix[1..]).arg(&exe);
    }
    cmd.args([
        "--ignored",
        "--exact",
        "child_echo",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("ZEROHOP_TEST_CONNECT", addr.to_string())
    .env("ZEROHOP_TEST_COUNT", count.to_string())
    .stdout(Stdio::null())
    .spawn()
    .unwrap()
}

#[test]
fn two_processes_over_loopback() {
    let (server, addr, pool) = listener(256 << 20, TcpConfig::default());
    let count = 5000;
    let mut child = spawn_child(&[], addr, count);
    let peer = wait_for_peer(&server);
    pump(&server, peer, count, 20_000, 64);
    assert!(child.wait().unwrap().success());
    assert_eq!(pool.used_bytes(), 0);
}

fn wait_for_peer(server: &Endpoint<TcpTransport>) -> PeerId {
    let t0 = Instant::now();
    loop {
        if server.with(|t| t.peer_count()) == 1 {
            return PeerId(0);
        }
        assert!(t0.elapsed() < 30 * SECOND, "the child never connected");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Keeps up to `window` messages in flight to an echoing peer; checks each echo.
fn pump(server: &Endpoint<TcpTransport>, peer: PeerId, count: u64, max: usize, window: u64) {
    let (mut sent, mut got) = (0u64, 0u64);
    while got < count {
        while sent < count && sent - got < window {
            server
                .send(
                    peer,
                    &message(sent, max),
                    Deadline::after(60 * SECOND),
                    None,
                )
                .unwrap();
            sent += 1;
        }
        let r = server.recv(Deadline::after(60 * SECOND), None).unwrap();
        assert_eq!(r.peer, peer);
        assert_eq!(check(host_bytes(&r.lease)), got, "none lost, order kept");
        got += 1;
    }
}

// ---- across network namespaces ---------------------------------------------

struct Netns;

impl Netns {
    const A: &'static str = "zh-test-a";
    const B: &'static str = "zh-test-b";

    fn ip(args: &[&str]) -> bool {
        Command::new("ip")
            .args(args)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Two namespaces joined by a veth pair: A = 192.0.2.1, B = 192.0.2.2
    /// (TEST-NET-1: exists only inside these namespaces).
    fn create() -> Result<Netns, String> {
        let _ = Netns::ip(&["netns", "del", Self::A]);
        let _ = Netns::ip(&["netns", "del", Self::B]);
        let steps: [&[&str]; 10] = [
            &["netns", "add", Self::A],
            &["netns", "add", Self::B],
            &[
                "link",
                "add",
                "zh-veth-a",
                "type",
                "veth",
                "peer",
                "name",
                "zh-veth-b",
            ],
            &["link", "set", "zh-veth-a", "netns", Self::A],
            &["link", "set", "zh-veth-b", "netns", Self::B],
            &[
                "-n",
                Self::A,
                "addr",
                "add",
                "192.0.2.1/24",
                "dev",
                "zh-veth-a",
            ],
            &[
                "-n",
                Self::B,
                "addr",
                "add",
                "192.0.2.2/24",
                "dev",
                "zh-veth-b",
            ],
            &["-n", Self::A, "link", "set", "zh-veth-a", "up"],
            &["-n", Self::B, "link", "set", "zh-veth-b", "up"],
            &["-n", Self::B, "link", "set", "lo", "up"],
        ];
        let ns = Netns;
        for s in steps {
            if !Netns::ip(s) {
                return Err(format!("`ip {}` failed", s.join(" ")));
            }
        }
        Ok(ns)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Netns::ip(&["netns", "del", Self::A]);
        let _ = Netns::ip(&["netns", "del", Self::B]);
    }
}

/// Runs as a child inside namespace A: listens on 192.0.2.1 and pumps messages.
#[test]
#[ignore = "a helper: run by two_network_namespaces in a child process"]
fn child_pump() {
    let Ok(count) = std::env::var("ZEROHOP_TEST_PUMP") else {
        return;
    };
    let count: u64 = count.parse().unwrap();
    let mut t = transport(512 << 20, TcpConfig::default());
    t.listen("192.0.2.1:47001").unwrap();
    let pool = Arc::clone(t.pool());
    let server = Endpoint::new(t, EndpointConfig::default()).unwrap();
    let peer = wait_for_peer(&server);
    pump(&server, peer, count, 8192, 256);
    assert_eq!(pool.used_bytes(), 0);
    println!("child_pump: {count} messages echoed intact and in order");
}

#[test]
fn two_network_namespaces_100k_messages() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!(
            "SKIPPED two_network_namespaces_100k_messages: needs root to create network namespaces"
        );
        return;
    }
    let ns = match Netns::create() {
        Ok(ns) => ns,
        Err(why) => {
            eprintln!("SKIPPED two_network_namespaces_100k_messages: {why}");
            return;
        }
    };
    let exe = std::env::current_exe().unwrap();
    let count = 100_000u64;
    let pumper = Command::new("ip")
        .args(["netns", "exec", Netns::A])
        .arg(&exe)
        .args([
            "--ignored",
            "--exact",
            "child_pump",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("ZEROHOP_TEST_PUMP", count.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let mut echoer = Command::new("ip")
        .args(["netns", "exec", Netns::B])
        .arg(&exe)
        .args([
            "--ignored",
            "--exact",
            "child_echo",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("ZEROHOP_TEST_CONNECT", "192.0.2.1:47001")
        .env("ZEROHOP_TEST_COUNT", count.to_string())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let out = pumper.wait_with_output().unwrap();
    let echoed = echoer.wait().unwrap();
    drop(ns);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "pumper failed: {text}");
    assert!(echoed.success());
    assert!(
        text.contains("100000 messages echoed intact and in order"),
        "{text}"
    );
}
