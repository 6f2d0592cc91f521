//! The TCP wire through real sockets: in one process, across processes, across
//! network namespaces, and against peers that die or lie.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use zerohop_backends::{host_bytes, PeerLimits};
use zerohop_core::session::{ProtocolError, Stall};
use zerohop_core::wire::{
    Credit, Data, DataFlags, DecodeError, Frame, FrameKind, Hello, Host, HostStep, ShortRecord,
    Takes, Want, HEADER_LEN,
};
use zerohop_core::{crc32c, Error, Kind, PeerId, Transport};
use zerohop_std::tcp::{TcpConfig, TcpTransport, STRIPE_MIN};
use zerohop_std::{private_pool, Deadline, Endpoint, EndpointConfig, Event, StdPool, Wire};

const SECOND: Duration = Duration::from_secs(1);

fn transport(budget: usize, config: TcpConfig) -> TcpTransport {
    TcpTransport::new(private_pool(budget).unwrap(), config, Kind::Tcp).unwrap()
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

/// A hand-written peer on a raw socket: it speaks the wire (version 2)
/// frame by frame, so a test can make it do what the transport never would.
struct Raw {
    s: TcpStream,
}

impl Raw {
    /// Connects and says Hello on the main connection.
    fn connect(addr: SocketAddr) -> Raw {
        Raw::connect_with(addr, 0x7E57, 0)
    }

    fn connect_with(addr: SocketAddr, token: u32, lane: u8) -> Raw {
        let s = TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        Raw::greet(s, token, lane)
    }

    /// Says Hello on a fresh connection `s` (and, on a main one, the
    /// connecting side's same-host frame: no offer).
    fn greet(mut s: TcpStream, token: u32, lane: u8) -> Raw {
        s.write_all(&Raw::hello(token, lane)).unwrap();
        if lane == 0 {
            s.write_all(&Raw::no_offer()).unwrap();
        }
        Raw { s }
    }

    /// As [`connect`](Raw::connect), on a socket whose receive buffer is
    /// `rcvbuf` bytes from before the handshake (so the window it
    /// advertises stays that small).
    fn connect_with_rcvbuf(addr: SocketAddr, rcvbuf: libc::c_int) -> Raw {
        Raw::greet(Raw::socket(addr, None, Some(rcvbuf)), 0x7E57, 0)
    }

    /// As [`connect`](Raw::connect), from the local address `from`.
    fn connect_from(addr: SocketAddr, from: std::net::Ipv4Addr) -> Raw {
        Raw::greet(Raw::socket(addr, Some(from), None), 0x7E57, 0)
    }

    /// A lane's connection (its Hello only) from the local address `from`.
    fn lane_from(addr: SocketAddr, from: std::net::Ipv4Addr, token: u32) -> Raw {
        Raw::greet(Raw::socket(addr, Some(from), None), token, 1)
    }

    /// A connection to the IPv4 `addr`, from the local address `from` and
    /// with a receive buffer of `rcvbuf` bytes where given (both set
    /// before the handshake, which `std` cannot do).
    fn socket(
        addr: SocketAddr,
        from: Option<std::net::Ipv4Addr>,
        rcvbuf: Option<libc::c_int>,
    ) -> TcpStream {
        use std::os::fd::FromRawFd;
        let v4 = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(ip).to_be(),
            },
            sin_zero: [0; 8],
        };
        let SocketAddr::V4(to) = addr else {
            panic!("an IPv4 listener")
        };
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: a new socket, owned by the stream from the line after it;
        // the option and the addresses are locals that outlive the calls.
        let s = unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
            let s = TcpStream::from_raw_fd(fd);
            if let Some(size) = rcvbuf {
                let rc = libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_RCVBUF,
                    (&size as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                );
                assert_eq!(rc, 0, "SO_RCVBUF: {}", std::io::Error::last_os_error());
            }
            if let Some(ip) = from {
                let local = v4(ip, 0);
                let rc = libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), len);
                assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
            }
            let remote = v4(*to.ip(), to.port());
            let rc = libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), len);
            assert_eq!(rc, 0, "connect: {}", std::io::Error::last_os_error());
            s
        };
        s.set_nodelay(true).unwrap();
        s
    }

    /// The Host frame of a connecting side that will not share memory.
    fn no_offer() -> [u8; HEADER_LEN] {
        Frame::Host(Host {
            host: 0,
            pid: 0,
            nonce: 0,
            step: HostStep::NoOffer,
        })
        .encode(&[])
    }

    /// A Credit frame that returns nothing new: what a peer may send at
    /// any time, and what says nothing of a frame it owes.
    fn credit() -> [u8; HEADER_LEN] {
        Frame::Credit(Credit {
            frames: 0,
            limit: 1 << 30,
            control: 0,
        })
        .encode(&[])
    }

    /// A Hello granting a large window (lane 1: a second connection's).
    fn hello(token: u32, lane: u8) -> [u8; HEADER_LEN] {
        Frame::Hello(Hello {
            window: 1 << 30,
            max_message: 64 << 20,
            frame_max: 64 << 20,
            ring: 0,
            lane,
            takes: Takes::NONE,
            token,
        })
        .encode(&[])
    }

    /// A data header for a whole message of `len` bytes.
    /// A Want for a message of `len` bytes at byte `offset`.
    fn want(offset: u64, len: u32) -> [u8; HEADER_LEN] {
        Frame::Want(Want { offset, len }).encode(&[])
    }

    fn data(seq: u64, len: u32, flags: DataFlags) -> [u8; HEADER_LEN] {
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

    /// A short record for a whole message of `len` bytes, sequence number
    /// `seq` (its low 16 bits): what a peer whose Hello takes headerless
    /// frames is sent in place of a header, and may send.
    fn short(seq: u16, len: u32) -> [u8; HEADER_LEN] {
        ShortRecord {
            imm: u32::from(seq) << 16,
            len,
        }
        .encode()
    }

    /// What goes ahead of a whole message of `len` bytes: a header, or a
    /// short record (`short`).
    fn whole(short: bool, seq: u16, len: u32) -> [u8; HEADER_LEN] {
        if short {
            Raw::short(seq, len)
        } else {
            Raw::data(u64::from(seq), len, DataFlags::NONE)
        }
    }

    fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).unwrap();
    }

    /// Reads one frame: its header and payload.
    fn read_frame(&mut self) -> (Frame, Vec<u8>) {
        use std::io::Read;
        let mut h = [0u8; HEADER_LEN];
        self.s.read_exact(&mut h).unwrap();
        let f = Frame::decode(&h, 64 << 20).unwrap().frame;
        let mut payload = vec![0u8; f.payload_len()];
        self.s.read_exact(&mut payload).unwrap();
        (f, payload)
    }

    /// Whether the other side closed this connection within 5 s.
    fn closed_by_peer(&mut self) -> bool {
        use std::io::Read;
        self.s.set_read_timeout(Some(5 * SECOND)).unwrap();
        let mut b = [0u8; 4096];
        loop {
            match self.s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => {} // its Hello, credit: read past them
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
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

/// A receiver asleep on a dry pool (the application holds every buffer)
/// wakes when another thread gives a buffer back (the pool's bell), not at
/// its next look: with a poll interval of an hour, the message waiting in
/// the socket still comes long before the deadline.
#[test]
fn a_buffer_given_back_by_another_thread_wakes_a_receiver_asleep_on_a_dry_pool() {
    let mut t = transport(256 << 10, TcpConfig::default()); // 64 buffers of 4 KiB
    let addr = t.listen("127.0.0.1:0").unwrap();
    let pool = Arc::clone(t.pool());
    let slow_looks = EndpointConfig {
        poll_interval: 3600 * SECOND,
        ..EndpointConfig::default()
    };
    let server = Endpoint::new(t, slow_looks).unwrap();
    let (c, peer) = client(addr);
    let m = |i: usize| vec![i as u8; 4000];
    for i in 0..65 {
        c.send(peer, &m(i), Deadline::after(10 * SECOND), None)
            .unwrap();
    }
    let mut held: Vec<_> = (0..64)
        .map(|_| server.recv(Deadline::after(10 * SECOND), None).unwrap())
        .collect();
    assert_eq!(pool.stats().budget, pool.stats().used_bytes, "all held");
    let first = held.remove(0);
    let giver = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200)); // the receiver asleep by then
        drop(first);
    });
    let t0 = Instant::now();
    let last = server.recv(Deadline::after(10 * SECOND), None);
    let waited = t0.elapsed();
    giver.join().unwrap();
    // Unwoken, it sleeps out the deadline (its poll's only bound) and finds
    // the buffer then.
    assert!(
        waited < 5 * SECOND,
        "asleep {waited:?} after the buffer came back"
    );
    let last = last.unwrap();
    assert!(host_bytes(&last.lease) == m(64), "the waiting one, intact");
}

/// A sender waiting for a buffer of its pool (`lease_by`) wakes when
/// another thread gives one back, not at its next look (an hour here).
#[test]
fn a_buffer_given_back_by_another_thread_wakes_a_sender_waiting_to_lease_one() {
    let mut t = transport(256 << 10, TcpConfig::default()); // 64 buffers of 4 KiB
    t.listen("127.0.0.1:0").unwrap();
    let slow_looks = EndpointConfig {
        poll_interval: 3600 * SECOND,
        ..EndpointConfig::default()
    };
    let e = Endpoint::new(t, slow_looks).unwrap();
    let mut held: Vec<_> = (0..64).map(|_| e.lease(4000).unwrap()).collect();
    assert!(e.lease(4000).is_err(), "all held");
    let first = held.remove(0);
    let giver = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200)); // the sender asleep by then
        drop(first);
    });
    let t0 = Instant::now();
    let got = e.lease_by(4000, &mut Deadline::after(10 * SECOND), None);
    let waited = t0.elapsed();
    giver.join().unwrap();
    // Unwoken, it sleeps out the deadline (its poll's only bound).
    assert!(
        waited < 5 * SECOND,
        "asleep {waited:?} after the buffer came back"
    );
    assert_eq!(got.unwrap().capacity(), 4096);
}

#[test]
fn a_zero_copy_sender_of_small_messages_never_holds_every_buffer() {
    let (server, addr, _pool) = listener(64 << 20, TcpConfig::default());
    let (c, peer) = client(addr);
    const N: u32 = 300_000;
    std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(SECOND); // the sender runs ahead
            for i in 0..N {
                let r = server
                    .recv(Deadline::after(10 * SECOND), None)
                    .unwrap_or_else(|e| panic!("message {i}: {e}"));
                assert_eq!(host_bytes(&r.lease)[..4], i.to_le_bytes(), "in order");
            }
        });
        for i in 0..N {
            // `lease` does not wait: it fails once queued sends hold every
            // buffer descriptor of the pool, which the queue's bound on
            // messages (not only bytes) prevents.
            let mut l = c.lease(64).unwrap_or_else(|e| panic!("lease {i}: {e}"));
            zerohop_backends::host_bytes_mut(&mut l)[..4].copy_from_slice(&i.to_le_bytes());
            c.send_lease(peer, l, Deadline::after(10 * SECOND), None)
                .unwrap_or_else(|e| panic!("send {i}: {e}"));
        }
    });
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
fn garbage_before_a_hello_closes_only_that_connection_and_costs_nothing() {
    let (server, addr, pool) = listener(64 << 20, TcpConfig::default());
    let (good, peer) = client(addr);
    expect_still_served(&server, &good, peer);
    let used = pool.stats();
    // Not a zerohop frame; a frame of another version; data with no Hello
    // first: each connection is closed before it is a peer (there is no peer
    // to report), with nothing leased.
    let mut v1 = Raw::hello(1, 0);
    v1[2] = 1;
    for first in [
        vec![0xEE; 64],
        v1.to_vec(),
        Raw::data(0, 10, DataFlags::NONE).to_vec(),
    ] {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&first).unwrap();
        let mut raw = Raw { s };
        assert!(raw.closed_by_peer(), "{first:02x?}");
    }
    assert_eq!(server.with(|t| (t.peer_count(), t.handshaking())), (1, 0));
    assert_eq!(pool.stats().reserved_bytes, used.reserved_bytes);
    expect_still_served(&server, &good, peer);
}

#[test]
fn a_header_or_short_record_claiming_more_than_the_credit_or_the_maximum_fails_only_that_peer() {
    let (server, addr, pool) = listener(64 << 20, TcpConfig::default());
    let (good, peer) = client(addr);
    expect_still_served(&server, &good, peer);
    let used = pool.stats().reserved_bytes;
    // The largest length the wire can carry (4 GiB): past the maximum.
    // Then the maximum (64 MiB), past the 16 MiB window granted.
    for (len, want) in [
        (
            u32::MAX,
            ProtocolError::Decode(DecodeError::TooLong {
                len: u32::MAX,
                max: 64 << 20,
            }),
        ),
        (
            64 << 20,
            ProtocolError::CreditExceeded {
                limit: 16 << 20,
                end: 64 << 20,
            },
        ),
    ] {
        for short in [false, true] {
            let mut raw = Raw::connect(addr);
            raw.send(&Raw::whole(short, 0, len));
            raw.send(&[1; 100]);
            let e = server.recv(Deadline::after(5 * SECOND), None).unwrap_err();
            assert!(
                matches!(e, Error::Protocol { error, .. } if error == want),
                "short record {short}: {e:?}"
            );
            assert!(raw.closed_by_peer());
        }
    }
    assert_eq!(
        pool.stats().reserved_bytes,
        used,
        "nothing of the declared sizes was taken"
    );
    expect_still_served(&server, &good, peer);
    assert_eq!(pool.used_bytes(), 0);
}

#[test]
fn a_maximum_size_header_or_short_record_from_a_silent_peer_costs_nothing_and_200_leave_an_honest_peer_served(
) {
    let config = TcpConfig {
        idle_timeout: 2 * SECOND,
        max_handshakes: 1000,
        ..TcpConfig::default()
    };
    let (server, addr, pool) = listener(64 << 20, config);
    let (good, peer) = client(addr);
    expect_still_served(&server, &good, peer);
    let used = pool.stats().used_bytes;
    // 200 peers say Hello, then a header (or, every other one, a short
    // record) claiming the whole window (16 MiB), then nothing: no buffer is
    // leased until payload bytes come.
    let mut silent: Vec<Raw> = (0..200)
        .map(|i| {
            let mut raw = Raw::connect(addr);
            raw.send(&Raw::whole(i % 2 == 1, 0, 16 << 20));
            raw
        })
        .collect();
    let t0 = Instant::now();
    while server.with(|t| t.peer_count()) < 201 {
        assert!(t0.elapsed() < 10 * SECOND, "the 200 were never accepted");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(50)); // their headers are in
    assert_eq!(
        pool.stats().used_bytes,
        used,
        "a header alone leases nothing"
    );
    // The honest peer is served at once, many times over.
    let t0 = Instant::now();
    for _ in 0..100 {
        expect_still_served(&server, &good, peer);
    }
    assert!(t0.elapsed() < SECOND, "served promptly: {:?}", t0.elapsed());
    // Two of them (a header's and a short record's) send a byte: each
    // leases its message, at most the window.
    silent[0].send(&[7]);
    await_partial_lease(&pool, used);
    let one = pool.stats().used_bytes;
    assert!(one - used <= 16 << 20);
    silent[1].send(&[7]);
    await_partial_lease(&pool, one);
    assert!(pool.stats().used_bytes - used <= 2 * (16 << 20));
    // Silent mid-frame past the idle timeout: each is dropped, typed (the
    // two that sent a byte may be found too slow first: a byte in the idle
    // timeout's grace is behind the minimum rate).
    let (mut silent_ones, mut slow_ones) = (0, 0);
    while silent_ones + slow_ones < 200 {
        match server.recv(Deadline::after(10 * SECOND), None) {
            Err(Error::Protocol {
                error: ProtocolError::Stalled { during },
                ..
            }) => match during {
                Stall::Frame => silent_ones += 1,
                Stall::Slow => slow_ones += 1,
                other => panic!("{other:?}"),
            },
            other => panic!("{other:?}"),
        }
    }
    assert!(slow_ones <= 2, "only those that sent a byte: {slow_ones}");
    assert_eq!(pool.stats().used_bytes, used, "the bytes' leases went back");
    assert_eq!(server.with(|t| t.peer_count()), 1);
    expect_still_served(&server, &good, peer);
}

/// Peers that each begin a message of their whole window and stall (behind
/// a header, a short record, or a first fragment of one byte), more
/// of them than the pool holds such messages, cannot take the buffers an
/// honest peer's messages need: payloads still coming hold at most half the
/// pool together, and the peers past that wait, held, with no buffer. (Each
/// alone stays within its credit; before this bound six of them, 96 MiB
/// begun in a 64 MiB pool, left the honest peer unserved until their idle
/// timeout.)
#[test]
fn peers_that_begin_whole_window_messages_and_stall_hold_at_most_half_the_pool() {
    let config = TcpConfig {
        idle_timeout: 20 * SECOND, // none times out: the test ends them
        ..TcpConfig::default()
    };
    let (server, addr, pool) = listener(64 << 20, config);
    let (good, peer) = client(addr);
    expect_still_served(&server, &good, peer);
    let used = pool.stats().used_bytes;
    // A header, a short record, or a first fragment of one byte (whose
    // message's rest is to come however much of the fragment is staged).
    let fragment = Frame::Data(Data {
        flags: DataFlags::MORE,
        seq: 0,
        msg_len: 16 << 20,
        len: 1,
        offset: 0,
        credits: 0,
        control: 0,
    })
    .encode(&[]);
    let mut stalled: Vec<Raw> = (0..6)
        .map(|i| {
            let mut raw = Raw::connect(addr);
            match i % 3 {
                2 => raw.send(&fragment),
                k => raw.send(&Raw::whole(k == 1, 0, 16 << 20)),
            }
            raw.send(&[7]);
            raw
        })
        .collect();
    let t0 = Instant::now();
    while server.with(|t| t.peer_count()) < 7 {
        assert!(t0.elapsed() < 5 * SECOND, "the six were never accepted");
        std::thread::sleep(Duration::from_millis(5));
    }
    await_partial_lease(&pool, used);
    std::thread::sleep(Duration::from_millis(200)); // every byte is in
                                                    // The honest peer is served at once, many times over.
    let t0 = Instant::now();
    for _ in 0..100 {
        expect_still_served(&server, &good, peer);
    }
    assert!(t0.elapsed() < SECOND, "served promptly: {:?}", t0.elapsed());
    let held = pool.stats().used_bytes - used;
    assert!(
        held > 0 && held <= 32 << 20,
        "payloads still coming hold at most half the pool: {held}"
    );
    // The others go, and the first finishes its message: delivered, with a
    // buffer of its own or one theirs left (this side keeps reading
    // meanwhile: a payload left in the socket waits while messages wait
    // for the application).
    let mut first = stalled.remove(0);
    stalled.clear();
    std::thread::scope(|s| {
        let writer = s.spawn(|| first.send(&vec![7u8; (16 << 20) - 1]));
        let m = loop {
            match server.recv(Deadline::after(10 * SECOND), None) {
                Ok(m) => break m,
                Err(Error::PeerLost(_)) => {} // one of the others
                Err(e) => panic!("{e}"),
            }
        };
        assert_eq!(m.lease.len(), 16 << 20);
        drop(m);
        assert!(pool.stats().used_bytes - used <= 32 << 20);
        writer.join().unwrap();
    });
    drop(first);
    // Every buffer comes back.
    let t0 = Instant::now();
    while server.with(|t| t.peer_count()) > 1 || pool.stats().used_bytes != used {
        assert!(
            t0.elapsed() < 10 * SECOND,
            "the stalled peers' buffers came back"
        );
        let _ = server.recv(Deadline::after(Duration::from_millis(50)), None);
    }
    // The honest peer still served (past the others' last news).
    good.send(peer, b"still here", Deadline::after(SECOND), None)
        .unwrap();
    loop {
        match server.recv(Deadline::after(5 * SECOND), None) {
            Ok(r) => break assert_eq!(host_bytes(&r.lease), b"still here"),
            Err(Error::PeerLost(_)) => {}
            Err(e) => panic!("{e}"),
        }
    }
}

/// Peers that said Hello and went quiet stay connected (a quiet open
/// session is fine: nodes keep hundreds of peers) but give their staging
/// buffers back after the idle timeout, so a crowd of them costs a socket
/// and a session each, not 64 KiB more; a quiet peer that speaks again
/// takes one anew and is heard.
#[test]
fn quiet_peers_stay_connected_but_give_their_staging_buffers_back() {
    let config = TcpConfig {
        idle_timeout: Duration::from_millis(300),
        ..TcpConfig::default()
    };
    let (server, addr, _pool) = listener(64 << 20, config);
    let mut quiet: Vec<Raw> = (0..50).map(|_| Raw::connect(addr)).collect();
    let t0 = Instant::now();
    while server.with(|t| t.peer_count()) < 50 {
        assert!(t0.elapsed() < 5 * SECOND, "the 50 were never accepted");
        let _ = server.next_event(Deadline::after(Duration::from_millis(10)), None);
    }
    assert!(
        server.with(|t| t.stage_bytes()) > 0,
        "their frames were read through stages"
    );
    let t0 = Instant::now();
    while server.with(|t| t.stage_bytes()) > 0 {
        assert!(
            t0.elapsed() < 3 * SECOND,
            "quiet stages kept: {} bytes",
            server.with(|t| t.stage_bytes())
        );
        let _ = server.next_event(Deadline::after(Duration::from_millis(20)), None);
    }
    assert_eq!(server.with(|t| t.peer_count()), 50, "all still connected");
    quiet[7].send(&[&Raw::data(0, 5, DataFlags::NONE)[..], b"again"].concat());
    let m = server.recv(Deadline::after(5 * SECOND), None).unwrap();
    assert_eq!(host_bytes(&m.lease), b"again");
    assert!(server.with(|t| t.stage_bytes()) > 0, "a stage taken anew");
}

/// A frame now and then does not keep a stage: peers that each send a
/// 32-byte Credit frame every 300 ms (the outside attack's was one every few
/// seconds: a thousand such peers held 69 MB) give theirs back after the
/// idle timeout as quiet ones do, holding one only a little while after
/// each frame, and stay connected.
#[test]
fn peers_that_trickle_a_frame_now_and_then_give_their_staging_buffers_back() {
    let config = TcpConfig {
        idle_timeout: Duration::from_millis(300),
        ..TcpConfig::default()
    };
    let (server, addr, _pool) = listener(64 << 20, config);
    let mut trickling: Vec<Raw> = (0..20).map(|_| Raw::connect(addr)).collect();
    let t0 = Instant::now();
    while server.with(|t| t.peer_count()) < 20 {
        assert!(t0.elapsed() < 5 * SECOND, "the 20 were never accepted");
        let _ = server.next_event(Deadline::after(Duration::from_millis(10)), None);
    }
    // Past the idle timeout, the stages held, sampled for two seconds.
    let t0 = Instant::now();
    let mut next = Instant::now();
    let (mut held, mut samples) = (0usize, 0usize);
    while t0.elapsed() < 3 * SECOND {
        if Instant::now() >= next {
            for r in &mut trickling {
                r.send(&Raw::credit());
            }
            next += Duration::from_millis(300);
        }
        let _ = server.next_event(Deadline::after(Duration::from_millis(5)), None);
        if t0.elapsed() > SECOND {
            held += server.with(|t| t.stage_bytes());
            samples += 1;
        }
    }
    let all = 20 * (64 << 10);
    assert!(
        held / samples.max(1) < all / 2,
        "stages kept by a trickle: {} of {all} bytes on average",
        held / samples.max(1)
    );
    assert_eq!(server.with(|t| t.peer_count()), 20, "all still connected");
}

#[test]
fn an_idle_half_frame_and_a_silent_handshake_are_dropped_after_the_timeout() {
    let config = TcpConfig {
        idle_timeout: Duration::from_millis(300),
        ..TcpConfig::default()
    };
    let (server, addr, _pool) = listener(64 << 20, config);
    // Half a header after the Hello.
    let mut half = Raw::connect(addr);
    half.send(&Raw::data(0, 10, DataFlags::NONE)[..10]);
    let t0 = Instant::now();
    let e = server.recv(Deadline::after(5 * SECOND), None).unwrap_err();
    assert_eq!(
        e,
        Error::Protocol {
            peer: PeerId(0),
            error: ProtocolError::Stalled {
                during: Stall::Frame
            }
        }
    );
    assert!(
        t0.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t0.elapsed()
    );
    assert!(half.closed_by_peer());
    // No Hello at all: closed, never a peer.
    let mut mute = TcpStream::connect(addr).unwrap();
    mute.write_all(&[0x5A]).unwrap(); // one byte of a header
    let t0 = Instant::now();
    let mut raw = Raw { s: mute };
    assert!(raw.closed_by_peer());
    assert!(t0.elapsed() >= Duration::from_millis(250) && t0.elapsed() < 3 * SECOND);
    assert_eq!(server.with(|t| (t.peer_count(), t.handshaking())), (0, 0));
}

/// A peer that drips a large message, a byte every 100 ms (never silent
/// for the idle timeout), held the message's buffer for as long as it
/// liked; now, past the idle timeout's grace, it must keep up the minimum
/// rate (64 KiB/s): it is dropped, typed, its buffer back, and an honest
/// peer is served throughout.
#[test]
fn a_peer_dripping_a_large_message_is_dropped_at_the_minimum_rate_with_its_buffer_back() {
    for short in [false, true] {
        dripping_peer(short);
    }
}

/// A peer drips a large message behind a header or (`short`) a short record.
fn dripping_peer(short: bool) {
    let config = TcpConfig {
        idle_timeout: Duration::from_millis(500),
        ..TcpConfig::default()
    };
    let (server, addr, pool) = listener(64 << 20, config);
    let (good, peer) = client(addr);
    expect_still_served(&server, &good, peer);
    let used = pool.stats().used_bytes;
    let mut drip = Raw::connect(addr);
    drip.send(&Raw::whole(short, 0, 8 << 20));
    drip.send(&[7]);
    await_partial_lease(&pool, used);
    let t0 = Instant::now();
    let mut s = drip.s.try_clone().unwrap();
    let dripping = std::thread::spawn(move || {
        while t0.elapsed() < 5 * SECOND && s.write_all(&[7]).is_ok() {
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let is_slow = |e: &Error| {
        matches!(
            e,
            Error::Protocol {
                error: ProtocolError::Stalled {
                    during: Stall::Slow
                },
                ..
            }
        )
    };
    let (mut served, mut dropped) = (0, false);
    while !dropped {
        match server.recv(Deadline::after(Duration::from_millis(100)), None) {
            Err(e) if is_slow(&e) => dropped = true,
            Err(Error::Timeout) => {
                // The drip may be dropped while the honest message waits:
                // its error comes first, then the message.
                good.send(peer, b"still here", Deadline::after(SECOND), None)
                    .unwrap();
                let r = loop {
                    match server.recv(Deadline::after(5 * SECOND), None) {
                        Ok(r) => break r,
                        Err(e) if is_slow(&e) && !dropped => dropped = true,
                        other => panic!("short record {short}: {other:?}"),
                    }
                };
                assert_eq!(host_bytes(&r.lease), b"still here");
                served += 1;
            }
            other => panic!("short record {short}: {other:?}"),
        }
        assert!(
            t0.elapsed() < 5 * SECOND,
            "the dripping peer was kept (short record {short})"
        );
    }
    // The idle timeout's grace from its header, whatever its drops.
    assert!(t0.elapsed() < 2 * SECOND, "{:?}", t0.elapsed());
    assert!(served >= 2, "the honest peer was served meanwhile");
    assert_eq!(pool.stats().used_bytes, used, "the drip's lease went back");
    assert!(drip.closed_by_peer());
    dripping.join().unwrap();
    expect_still_served(&server, &good, peer);
}

/// An application that only sends for a while, back to back, no thread in
/// `recv`: the progress thread, which leaves reading to an application
/// that is calling, must still read a peer mid-message (or leave it
/// unjudged): the peer is not dropped silent or slow for this side's not
/// reading, and its message arrives.
#[test]
fn a_peer_mid_message_while_the_application_only_sends_is_read_not_timed_out() {
    let idle = Duration::from_millis(300);
    let config = TcpConfig {
        idle_timeout: idle,
        ..TcpConfig::default()
    };
    let (server, addr, pool) = listener(64 << 20, config);
    let (good, peer) = client(addr);
    good.send(peer, b"hello", Deadline::after(SECOND), None)
        .unwrap();
    let good_here = server.recv(Deadline::after(5 * SECOND), None).unwrap().peer;
    let used = pool.stats().used_bytes;
    let payload = sized(9, 1 << 20);
    let mut raw = Raw::connect(addr);
    raw.send(&Raw::data(0, 1 << 20, DataFlags::NONE));
    raw.send(&payload[..100]);
    await_partial_lease(&pool, used);
    // The application sends, and only sends, for five idle timeouts; the
    // rest of the message comes in halves, one and two thirds of the idle
    // timeout in.
    let t0 = Instant::now();
    let rest = std::thread::spawn(move || {
        std::thread::sleep(idle / 3);
        raw.send(&payload[100..1 << 19]);
        std::thread::sleep(idle / 3);
        raw.send(&payload[1 << 19..]);
        (raw, payload)
    });
    let mut sent = 0;
    let tick = vec![3u8; 1 << 20];
    // The other side reads what this side sends (1 MiB each, enough to
    // fill the socket, so the progress thread is woken to flush).
    let drain = std::thread::spawn(move || {
        let mut got = 0;
        while let Ok(r) = good.recv(Deadline::after(SECOND), None) {
            assert_eq!(host_bytes(&r.lease), &[3u8; 1 << 20][..]);
            got += 1;
        }
        got
    });
    while t0.elapsed() < 5 * idle {
        server
            .send(good_here, &tick, Deadline::after(SECOND), None)
            .unwrap();
        sent += 1;
    }
    let (_raw, payload) = rest.join().unwrap();
    let r = server.recv(Deadline::after(5 * SECOND), None).unwrap();
    assert_eq!(host_bytes(&r.lease), &payload[..]);
    assert_eq!(drain.join().unwrap(), sent);
}

/// Credit frames every 50 ms on a clone of `raw`'s connection until it fails
/// or `for_` has passed: what a peer that owes a frame may send meanwhile.
fn keep_sending_credit(raw: &Raw, for_: Duration) -> std::thread::JoinHandle<()> {
    let mut s = raw.s.try_clone().unwrap();
    std::thread::spawn(move || {
        let credit = Raw::credit();
        let t0 = Instant::now();
        while t0.elapsed() < for_ && s.write_all(&credit).is_ok() {
            std::thread::sleep(Duration::from_millis(50));
        }
    })
}

/// A peer that says Hello and then never its same-host frame (the
/// accepting side waits for it before it tells the application of the
/// peer) is dropped once the idle timeout has passed since its Hello,
/// whatever credit frames it sends meanwhile. It was kept for ever, a
/// descriptor and a 64 KiB stage each, out of the application's reach.
#[test]
fn a_hello_without_its_host_frame_is_dropped_after_the_timeout_whatever_else_it_sends() {
    let config = TcpConfig {
        idle_timeout: Duration::from_millis(300),
        ..TcpConfig::default()
    };
    let (server, addr, _pool) = listener(64 << 20, config);
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(&Raw::hello(0x7E57, 0)).unwrap();
    let mut raw = Raw { s };
    let t0 = Instant::now();
    let credit = keep_sending_credit(&raw, 3 * SECOND);
    assert!(raw.closed_by_peer(), "kept past 5 s");
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(250) && took < 2 * SECOND,
        "{took:?}"
    );
    credit.join().unwrap();
    assert_eq!(server.with(|t| (t.peer_count(), t.peers_left())), (0, 0));
}

/// The grant tests' listener: a 400 ms idle timeout, a 1 MiB window, and
/// 4 MiB of grants past windows shared by all peers.
fn grant_listener() -> (Endpoint<TcpTransport>, SocketAddr, Arc<StdPool>) {
    let config = TcpConfig {
        idle_timeout: Duration::from_millis(400),
        window: 1 << 20,
        grant_budget: 4 << 20,
        max_message: 8 << 20,
        ..TcpConfig::default()
    };
    listener(64 << 20, config)
}

/// A Want for a 4 MiB message (3 MiB past a 1 MiB window).
fn want_4_mib() -> [u8; HEADER_LEN] {
    Raw::want(0, 4 << 20)
}

/// Reads `raw`'s frames until a Credit grants it 4 MiB (within 5 s).
fn await_grant(raw: &mut Raw) {
    let t0 = Instant::now();
    loop {
        let (f, _) = raw.read_frame();
        if matches!(f, Frame::Credit(c) if c.limit >= 4 << 20) {
            return;
        }
        assert!(t0.elapsed() < 5 * SECOND, "never granted");
    }
}

/// A client whose messages may be 8 MiB.
fn client_of_8_mib(addr: SocketAddr) -> (Endpoint<TcpTransport>, PeerId) {
    client_with(
        addr,
        TcpConfig {
            max_message: 8 << 20,
            ..TcpConfig::default()
        },
    )
}

/// The next message, and how many peers were dropped as stalled mid-frame
/// before it.
fn recv_counting_stalls(
    server: &Endpoint<TcpTransport>,
    during: Stall,
) -> (
    zerohop_core::Received<<TcpTransport as Transport>::Lease>,
    usize,
) {
    let mut stalls = 0;
    loop {
        match server.recv(Deadline::after(5 * SECOND), None) {
            Ok(r) => return (r, stalls),
            Err(Error::Protocol {
                error: ProtocolError::Stalled { during: d },
                ..
            }) if d == during => stalls += 1,
            Err(e) => panic!("{e}"),
        }
    }
}

/// An honest client's 4 MiB message (3 MiB past the window: it asks for a
/// grant), sent within `wait`: it arrives intact. Returns how many peers
/// were dropped as stalled `during` before it, and the client (kept
/// connected while the caller looks on).
fn honest_long_message_goes(
    server: &Endpoint<TcpTransport>,
    addr: SocketAddr,
    wait: Duration,
    during: Stall,
) -> (usize, Endpoint<TcpTransport>) {
    let (good, peer) = client_of_8_mib(addr);
    let long = sized(1, 4 << 20);
    good.send(peer, &long, Deadline::after(wait), None)
        .expect("the honest long message was granted");
    let (got, stalls) = recv_counting_stalls(server, during);
    assert_eq!(host_bytes(&got.lease), &long[..]);
    (stalls, good)
}

/// A Want for a message longer than the window, granted from the budget
/// all peers share, and never followed by its message, whatever else the
/// peer sends: once another peer has waited the idle timeout for the
/// budget, the holder is dropped as the slowest (`Stall::Slow`), and the
/// budget serves the other's long message. (The grant was held for good,
/// and every other long message waited on it.)
#[test]
fn a_grant_never_used_is_taken_back_with_its_peer_and_serves_another() {
    let (server, addr, pool) = grant_listener();
    let mut raw = Raw::connect(addr);
    raw.send(&want_4_mib());
    let credit = keep_sending_credit(&raw, 3 * SECOND);
    // Granted (3 MiB beyond its window) before the honest peer asks.
    let t0 = Instant::now();
    await_grant(&mut raw);
    // The budget comes back once the granted peer is dropped.
    let (stalls, _good) = honest_long_message_goes(&server, addr, 5 * SECOND, Stall::Slow);
    assert!(stalls > 0, "the granted peer was dropped as the slowest");
    assert!(
        t0.elapsed() >= Duration::from_millis(350),
        "{:?}",
        t0.elapsed()
    );
    credit.join().unwrap();
    assert_eq!(pool.stats().used_bytes, 0);
}

/// Credit granted past the window and left unused gives way to others: a
/// peer that sends a 1-byte message in the granted one's place and goes
/// quiet is dropped once another peer has waited the idle timeout for the
/// budget, and that peer's long message is granted (before, the rest
/// counted against the budget for as long as the quiet peer stayed: 129
/// bytes kept every long message of every peer out).
#[test]
fn a_short_message_in_a_granted_ones_place_gives_the_grant_back_to_others() {
    let (server, addr, pool) = grant_listener();
    let mut hog = Raw::connect(addr);
    hog.send(&want_4_mib());
    await_grant(&mut hog);
    hog.send(&Raw::data(0, 1, DataFlags::NONE));
    hog.send(&[1]);
    let r = server.recv(Deadline::after(5 * SECOND), None).unwrap();
    assert_eq!(host_bytes(&r.lease), &[1]);
    drop(r);
    let t0 = Instant::now();
    let (stalls, _good) = honest_long_message_goes(&server, addr, 5 * SECOND, Stall::Slow);
    assert_eq!(stalls, 1, "the quiet peer was dropped");
    assert!(t0.elapsed() < 2 * SECOND, "{:?}", t0.elapsed());
    assert_eq!(server.with(|t| t.peer_count()), 1);
    drop(hog);
    let t0 = Instant::now();
    while pool.stats().used_bytes != 0 {
        assert!(t0.elapsed() < 5 * SECOND, "every buffer back");
        let _ = server.recv(Deadline::after(Duration::from_millis(20)), None);
    }
}

/// A peer that leaves a grant unused with nobody else waiting for the
/// budget is kept: an honest sender may give up the send it asked for (its
/// deadline passed), and credit told cannot be taken back. It is served
/// long after the idle timeout. (It was dropped, `Stalled`, an idle timeout
/// after its grant, and its sender saw the peer lost.)
#[test]
fn a_grant_left_unused_without_contention_keeps_its_peer() {
    let (server, addr, pool) = grant_listener();
    let mut raw = Raw::connect(addr);
    raw.send(&want_4_mib());
    await_grant(&mut raw);
    // Five idle timeouts with the grant unused and nothing else to read.
    std::thread::sleep(Duration::from_secs(2));
    raw.send(&Raw::data(0, 1, DataFlags::NONE));
    raw.send(&[9]);
    let r = server
        .recv(Deadline::after(5 * SECOND), None)
        .expect("the peer kept, its message served");
    assert_eq!(host_bytes(&r.lease), &[9]);
    drop(r);
    assert_eq!(server.with(|t| t.peer_count()), 1);
    assert_eq!(pool.stats().used_bytes, 0);
}

/// Reads `raw`'s frames until a Credit tells a limit of `limit` or more
/// (within 5 s).
fn await_limit(raw: &mut Raw, limit: u64) {
    let t0 = Instant::now();
    loop {
        let (f, _) = raw.read_frame();
        if matches!(f, Frame::Credit(c) if c.limit >= limit) {
            return;
        }
        assert!(t0.elapsed() < 5 * SECOND, "never granted {limit}");
    }
}

/// A sender that gave up a granted message and asks again for another as
/// long holds its earlier grant: only what the new one adds is charged to
/// the budget. It is granted at once (before, the whole length was charged
/// on top of its own earlier grant, 3 + 4 MiB against a 4 MiB budget: it
/// waited on itself, and was dropped as the budget's slowest holder).
#[test]
fn a_sender_that_asks_again_after_giving_up_a_grant_is_granted() {
    let (server, addr, pool) = grant_listener();
    let mut raw = Raw::connect(addr);
    raw.send(&want_4_mib());
    await_grant(&mut raw);
    // It gave the message up; a 1-byte one goes instead, then it asks again.
    raw.send(&Raw::data(0, 1, DataFlags::NONE));
    raw.send(&[5]);
    let r = server.recv(Deadline::after(5 * SECOND), None).unwrap();
    assert_eq!(host_bytes(&r.lease), &[5]);
    drop(r);
    raw.send(&Raw::want(1, 4 << 20));
    let t0 = Instant::now();
    await_limit(&mut raw, 1 + (4 << 20));
    assert!(
        t0.elapsed() < Duration::from_millis(300),
        "{:?}",
        t0.elapsed()
    );
    let long = sized(3, 4 << 20);
    raw.send(&Raw::data(1, 4 << 20, DataFlags::NONE));
    raw.send(&long);
    let r = server.recv(Deadline::after(5 * SECOND), None).unwrap();
    assert_eq!(host_bytes(&r.lease), &long[..]);
    drop(r);
    assert_eq!(pool.stats().used_bytes, 0);
}

/// Many grants left unused give way to a waiting peer together: its long
/// message waits about one idle timeout, not one per holder (one was
/// dropped an idle timeout apart, until the message fit: three of the
/// four here, 1.2 s).
#[test]
fn many_unused_grants_give_way_to_a_waiting_peer_at_once() {
    let (server, addr, _pool) = grant_listener();
    // Four holders of 1 MiB past the window each: the whole budget.
    let mut holders: Vec<Raw> = (0..4).map(|_| Raw::connect(addr)).collect();
    for h in &mut holders {
        h.send(&Raw::want(0, 2 << 20));
        await_limit(h, 2 << 20);
    }
    let (slow, _good) = honest_long_message_goes(&server, addr, 10 * SECOND, Stall::Slow);
    assert_eq!(slow, 4, "every unused grant's holder was dropped at once");
}

/// A holder of an unused grant that keeps part of a header staged (the
/// end of one credit frame and the start of the next, now and then) is
/// judged as one that sends nothing: it gives way to a waiting peer (it
/// counted as a message under way, timed afresh at each part, and held
/// the grant for good).
#[test]
fn an_unused_grant_held_behind_part_of_a_header_gives_way() {
    let (server, addr, _pool) = grant_listener();
    let mut hog = Raw::connect(addr);
    hog.send(&want_4_mib());
    await_grant(&mut hog);
    let credit = Raw::credit();
    hog.send(&credit[..1]);
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let _stop = StopOnDrop(&stop);
        let (mut w, stop) = (hog.s.try_clone().unwrap(), &stop);
        s.spawn(move || {
            let t0 = Instant::now();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && t0.elapsed() < 10 * SECOND {
                let mut part = credit[1..].to_vec();
                part.push(credit[0]);
                if w.write_all(&part).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(150));
            }
        });
        let (slow, _good) = honest_long_message_goes(&server, addr, 5 * SECOND, Stall::Slow);
        assert_eq!(slow, 1, "the hog was dropped");
    });
}

/// A peer that asks for a second long message while its first, granted,
/// still comes (between its fragments) waits on its own grant: it is not
/// judged for it, with nobody else waiting (before, its first message,
/// coming at under 1 MiB/s, was lost with it as the budget's slowest).
#[test]
fn a_peer_waiting_on_its_own_grant_is_not_judged_for_it() {
    let (server, addr, _pool) = grant_listener();
    let mut raw = Raw::connect(addr);
    const M1: u32 = 3 << 19; // 1.5 MiB, past the 1 MiB window
    const CHUNK: u32 = 32 << 10;
    raw.send(&Raw::want(0, M1));
    await_limit(&mut raw, u64::from(M1));
    let body = sized(7, M1 as usize);
    // About 640 KiB/s: under the contended rate (1 MiB/s), over the minimum.
    for (i, chunk) in body.chunks(CHUNK as usize).enumerate() {
        let offset = i as u32 * CHUNK;
        let last = offset + CHUNK >= M1;
        let header = Frame::Data(Data {
            flags: DataFlags::NONE.with(DataFlags::MORE, !last),
            seq: 0,
            msg_len: M1,
            len: chunk.len() as u32,
            offset,
            credits: 0,
            control: 0,
        })
        .encode(&[]);
        raw.send(&header);
        raw.send(chunk);
        if i == 0 {
            // The second, asked for at the first's end.
            raw.send(&Raw::want(u64::from(M1), 4 << 20));
            // A peer elsewhere asks behind it and goes: gone, it does not
            // wait with it (before, its turn stayed queued and counted, and
            // the first message was judged and dropped as the slowest).
            let mut passer_by = Raw::connect_from(addr, std::net::Ipv4Addr::new(127, 0, 0, 2));
            passer_by.send(&want_4_mib());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let r = loop {
        match server.recv(Deadline::after(5 * SECOND), None) {
            Err(Error::PeerLost(_)) => {} // the passer-by
            r => break r.expect("the first message, its peer kept"),
        }
    };
    assert_eq!(host_bytes(&r.lease), &body[..]);
    drop(r);
    await_limit(&mut raw, u64::from(M1) + (4 << 20));
}

/// Grants go an address at a time: a stranger that asks from many
/// connections, each granted the whole budget in its turn and holding it
/// unused until it gives way (an idle timeout), delays another address's
/// grant by a turn or two, not one per connection (before, in the order
/// asked: five such connections cost the other address five idle
/// timeouts, 2 s here; an outside attack held a 20 MiB message back 33 s
/// with 34 connections, adding two every idle timeout).
#[test]
fn grants_go_an_address_at_a_time() {
    let (_server, addr, _pool) = grant_listener();
    let from = |last| std::net::Ipv4Addr::new(127, 0, 0, last);
    let whole_budget = Raw::want(0, 5 << 20);
    let mut strangers: Vec<Raw> = (0..5).map(|_| Raw::connect_from(addr, from(2))).collect();
    for s in &mut strangers {
        s.send(&whole_budget);
    }
    std::thread::sleep(Duration::from_millis(100)); // asked; one granted
    let mut honest = Raw::connect_from(addr, from(3));
    honest.send(&want_4_mib());
    let t0 = Instant::now();
    await_grant(&mut honest);
    let took = t0.elapsed();
    assert!(took < Duration::from_millis(1500), "{took:?}");
}

/// A granted message that comes at a little over the minimum rate does not
/// keep the grant budget from another peer for good: once that peer has
/// waited the idle timeout for its grant, the slow holder is dropped
/// (`Stall::Slow`) and the other's long message is granted (before, the
/// budget's contention counted only peers waiting for receive buffers:
/// the honest message waited for the whole 4 MiB to drip in, 16 s).
#[test]
fn a_granted_message_dripped_slowly_gives_way_to_another_peers_grant() {
    let (server, addr, _pool) = grant_listener();
    let mut hog = Raw::connect(addr);
    hog.send(&want_4_mib());
    await_grant(&mut hog);
    hog.send(&Raw::whole(false, 0, 4 << 20));
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let _stop = StopOnDrop(&stop);
        // About 256 KiB/s: four times the minimum rate, under 1 MiB/s.
        s.spawn(|| {
            let t0 = Instant::now();
            while !stop.load(std::sync::atomic::Ordering::Relaxed)
                && t0.elapsed() < 15 * SECOND
                && hog.s.write_all(&[7u8; 16 << 10]).is_ok()
            {
                std::thread::sleep(Duration::from_millis(60));
            }
        });
        std::thread::sleep(Duration::from_millis(200)); // under way
        let t0 = Instant::now();
        let (slow, _good) = honest_long_message_goes(&server, addr, 10 * SECOND, Stall::Slow);
        assert_eq!(slow, 1, "the slow holder was dropped");
        assert!(t0.elapsed() < 3 * SECOND, "{:?}", t0.elapsed());
    });
}

/// Grants past the window go to the peers that asked, in the order they
/// asked: a peer that asks while others wait queues behind them, whatever
/// its place among the connections (before, the budget went to the lowest
/// slot: a stranger holding it and another asking again kept an honest
/// peer from it for good).
#[test]
fn grants_past_the_window_go_first_asked_first_served() {
    let (server, addr, pool) = grant_listener();
    // Connected first (the lowest slot), it asks last.
    let mut early = Raw::connect(addr);
    let mut hog = Raw::connect(addr);
    hog.send(&want_4_mib());
    let hog_credit = keep_sending_credit(&hog, 2 * SECOND);
    await_grant(&mut hog);
    let (good, peer) = client_of_8_mib(addr);
    let long = sized(1, 4 << 20);
    std::thread::scope(|s| {
        let sending = s.spawn(|| good.send(peer, &long, Deadline::after(5 * SECOND), None));
        std::thread::sleep(Duration::from_millis(100)); // its Want is in
        early.send(&want_4_mib());
        let early_credit = keep_sending_credit(&early, 2 * SECOND);
        // The hog's grant gives way; the budget goes to the honest peer, which
        // asked before the early one: only the hog stalls before it is served.
        let (got, stalls) = recv_counting_stalls(&server, Stall::Slow);
        assert_eq!(host_bytes(&got.lease), &long[..]);
        assert_eq!(stalls, 1, "served before the peer that asked after it");
        sending.join().unwrap().unwrap();
        drop(got);
        early_credit.join().unwrap();
    });
    hog_credit.join().unwrap();
    let t0 = Instant::now();
    while pool.stats().used_bytes != 0 {
        assert!(t0.elapsed() < 5 * SECOND, "every buffer back");
        let _ = server.recv(Deadline::after(Duration::from_millis(20)), None);
    }
}

/// A stripe threshold too small to split a message over two connections
/// is refused when the transport is made, typed (it made every striped
/// message wait for bytes that never came).
#[test]
fn a_stripe_threshold_below_8_kib_is_refused() {
    for (min, ok) in [(4096, false), (8191, false), (8192, true)] {
        let config = TcpConfig {
            stripe_min: Some(min),
            ..TcpConfig::default()
        };
        let r = TcpTransport::new(private_pool(1 << 20).unwrap(), config, Kind::Tcp);
        match r {
            Ok(_) => assert!(ok, "{min} taken"),
            Err(e) => {
                assert!(!ok, "{min} refused: {e}");
                assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
            }
        }
    }
}

/// A peer streaming frames that deliver nothing (credit) as fast as it
/// can does not keep the listener's read: an honest peer beside it is
/// served promptly. (A peer's read went on until its socket was empty or
/// the inbox full, and credit frames fill no inbox.)
#[test]
fn a_peer_streaming_credit_frames_leaves_an_honest_peer_served() {
    let (server, addr, _pool) = listener(64 << 20, TcpConfig::default());
    let (good, peer) = client(addr);
    expect_still_served(&server, &good, peer);
    let raw = Raw::connect(addr);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = {
        let mut s = raw.s.try_clone().unwrap();
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let burst: Vec<u8> = Raw::credit()
                .iter()
                .copied()
                .cycle()
                .take(64 << 10)
                .collect();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && s.write_all(&burst).is_ok() {}
        })
    };
    std::thread::sleep(Duration::from_millis(100)); // the flood is on
    let t0 = Instant::now();
    for _ in 0..20 {
        expect_still_served(&server, &good, peer);
    }
    let took = t0.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    drop(raw);
    flood.join().unwrap();
    assert!(
        took < 3 * SECOND,
        "20 round trips beside the flood took {took:?}"
    );
}

/// Drives a caller-driven transport for `d`, asserting each poll finds no
/// message and no error.
fn progress_with_nothing_to_deliver(t: &mut TcpTransport, d: Duration) {
    let t0 = Instant::now();
    while t0.elapsed() < d {
        t.progress().unwrap();
        assert!(matches!(t.try_recv(), Err(Error::WouldBlock)));
    }
}

/// The passes of a progress thread that leaves reading to an application
/// thread (`background_progress(false)`), every 20 ms for `for_`.
fn passes_leaving_reading(t: &mut TcpTransport, for_: Duration) {
    let t0 = Instant::now();
    while t0.elapsed() < for_ {
        t.background_progress(false).unwrap();
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The same until fewer than `peers` peers are left, `each` (told the
/// pass's number) before each pass; fails if `what` is kept past 5 s, or
/// goes after 2 s or more.
fn passes_leaving_reading_until_dropped(
    t: &mut TcpTransport,
    peers: usize,
    what: &str,
    mut each: impl FnMut(u32),
) {
    let t0 = Instant::now();
    let mut pass = 0;
    while t.peer_count() == peers {
        assert!(t0.elapsed() < 5 * SECOND, "the {what} peer was kept");
        each(pass);
        pass += 1;
        t.background_progress(false).unwrap();
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(t0.elapsed() < 2 * SECOND, "{:?}", t0.elapsed());
}

/// A transport of 64 MiB, `idle` its idle timeout.
fn with_idle_timeout(idle: Duration) -> TcpTransport {
    transport(
        64 << 20,
        TcpConfig {
            idle_timeout: idle,
            ..TcpConfig::default()
        },
    )
}

/// A transport of 64 MiB whose inbox holds one message, `idle` its idle timeout.
fn one_message_inbox(idle: Duration) -> TcpTransport {
    transport(
        64 << 20,
        TcpConfig {
            idle_timeout: idle,
            inbox_messages: 1,
            ..TcpConfig::default()
        },
    )
}

/// The next `n` messages' bytes, progressing between looks until `by`.
fn receive(t: &mut TcpTransport, n: usize, by: Instant) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    while got.len() < n {
        match t.try_recv() {
            Ok(r) => got.push(host_bytes(&r.lease).to_vec()),
            Err(Error::WouldBlock) if Instant::now() < by => {
                t.progress().unwrap();
            }
            Err(e) => panic!("after {} messages: {e:?}", got.len()),
        }
    }
    got
}

/// The next arrival says a peer stalled `during`.
fn expect_stalled(t: &mut TcpTransport, during: Stall) {
    match t.try_recv() {
        Err(Error::Protocol {
            error: ProtocolError::Stalled { during: d },
            ..
        }) if d == during => {}
        other => panic!("{other:?}"),
    }
}

/// A caller-driven transport (no progress thread) whose application was
/// away longer than the idle timeout: the peer it left mid-frame sent the
/// rest in time, and it is read, not timed out for this side's absence.
#[test]
fn a_peer_left_mid_frame_while_this_side_was_away_is_read_not_timed_out() {
    let idle = Duration::from_millis(500);
    let mut t = with_idle_timeout(idle);
    let addr = t.listen("127.0.0.1:0").unwrap();
    let mut raw = Raw::connect(addr);
    let payload = sized(5, 4000);
    raw.send(&Raw::data(0, 4000, DataFlags::NONE));
    raw.send(&payload[..100]);
    // This side takes the header and the first bytes: now mid-frame.
    progress_with_nothing_to_deliver(&mut t, idle / 4);
    // The rest comes at once; the application is away for three timeouts.
    raw.send(&payload[100..]);
    std::thread::sleep(3 * idle);
    t.progress().unwrap();
    assert_eq!(receive(&mut t, 1, Instant::now() + 5 * SECOND), [payload]);
}

/// The same while the progress thread runs the timers and leaves reading
/// to an application thread (`background_progress(false)`, as while the
/// application sends): the peer is due with bytes waiting in its socket,
/// so the timers read them before judging it, and its message follows.
#[test]
fn a_peer_whose_bytes_wait_unread_while_the_progress_thread_leaves_reading_is_read_first() {
    let idle = Duration::from_millis(500);
    let mut t = with_idle_timeout(idle);
    let addr = t.listen("127.0.0.1:0").unwrap();
    let mut raw = Raw::connect(addr);
    let payload = sized(7, 4000);
    raw.send(&Raw::data(0, 4000, DataFlags::NONE));
    raw.send(&payload[..100]);
    progress_with_nothing_to_deliver(&mut t, idle / 4);
    raw.send(&payload[100..]);
    let t0 = Instant::now();
    passes_leaving_reading(&mut t, 3 * idle);
    assert_eq!(receive(&mut t, 1, t0 + 10 * idle), [payload]);
}

/// A peer that drips, while the progress thread leaves reading to the
/// application: the byte waiting at each look is read and counted, not
/// excused, and the peer is dropped at the minimum rate as ever (a hold
/// for waiting bytes kept it for good).
#[test]
fn a_dripping_peer_is_dropped_at_the_minimum_rate_while_the_progress_thread_leaves_reading() {
    let idle = Duration::from_millis(500);
    let mut t = with_idle_timeout(idle);
    let addr = t.listen("127.0.0.1:0").unwrap();
    let mut raw = Raw::connect(addr);
    raw.send(&Raw::data(0, 8 << 20, DataFlags::NONE));
    raw.send(&[7]);
    progress_with_nothing_to_deliver(&mut t, Duration::from_millis(50));
    assert_eq!(t.peer_count(), 1);
    // A byte every five passes (100 ms).
    let drip = |pass| {
        if pass % 5 == 0 {
            raw.send(&[7]);
        }
    };
    passes_leaving_reading_until_dropped(&mut t, 1, "dripping", drip);
    expect_stalled(&mut t, Stall::Slow);
}

/// A listener (a 500 ms idle timeout) with one peer whose 8 MiB message
/// is under way with one byte of its payload, taken in.
fn a_byte_of_8_mib_under_way() -> (TcpTransport, Raw) {
    let mut t = with_idle_timeout(Duration::from_millis(500));
    let addr = t.listen("127.0.0.1:0").unwrap();
    let mut raw = Raw::connect(addr);
    let first = Frame::Data(Data {
        flags: DataFlags::MORE,
        seq: 0,
        msg_len: 8 << 20,
        len: 1,
        offset: 0,
        credits: 0,
        control: 0,
    });
    raw.send(&first.encode(&[]));
    raw.send(&[7]);
    progress_with_nothing_to_deliver(&mut t, Duration::from_millis(50));
    (t, raw)
}

/// The same with a peer that, mid-message, floods control frames instead
/// of its payload: the timers' read stops at a turn's cap (256 frames),
/// and readiness left by the cap is the peer's, not a hold (held, it was
/// kept for as long as the application only sent).
#[test]
fn a_peer_flooding_control_frames_mid_message_is_dropped_at_the_minimum_rate() {
    let (mut t, mut raw) = a_byte_of_8_mib_under_way();
    let flood: Vec<u8> = (0..300).flat_map(|_| Raw::credit()).collect();
    raw.send(&flood);
    passes_leaving_reading_until_dropped(&mut t, 1, "flooding", |_| {});
    expect_stalled(&mut t, Stall::Slow);
}

/// Control frames are news of a peer, not progress of its message: one
/// that keeps a large message under way with a byte of payload and then
/// sends Credit frames at about 240 KB/s (nearly four times the minimum
/// rate, in frames) is dropped at the minimum rate (before, the stage's
/// bytes all counted as the message's, and it was kept for good).
#[test]
fn a_peer_sending_control_frames_at_a_rate_mid_message_is_still_dropped_at_the_minimum_rate() {
    let (mut t, mut raw) = a_byte_of_8_mib_under_way();
    // 150 frames (4.8 KB) every 20 ms, read as they come.
    let burst: Vec<u8> = (0..150).flat_map(|_| Raw::credit()).collect();
    let t0 = Instant::now();
    while t.peer_count() == 1 {
        assert!(
            t0.elapsed() < 5 * SECOND,
            "the credit-sending peer was kept"
        );
        raw.send(&burst);
        let next = Instant::now() + Duration::from_millis(20);
        while Instant::now() < next {
            t.progress().unwrap();
        }
    }
    assert!(t0.elapsed() < 2 * SECOND, "{:?}", t0.elapsed());
    expect_stalled(&mut t, Stall::Slow);
}

/// A large payload waits in its socket while messages wait for the
/// application (so it is read into the buffer the application gives
/// back), but not for good: another peer whose small messages keep coming
/// keeps messages waiting, and the large one is read and delivered among
/// them (before, it waited until the application had taken every message:
/// a flood of small ones stalled every other peer's large messages).
#[test]
fn a_large_payload_waits_for_the_application_only_a_moment_while_others_messages_keep_coming() {
    let mut t = transport(64 << 20, TcpConfig::default());
    let addr = t.listen("127.0.0.1:0").unwrap();
    let mut flood = Raw::connect_with(addr, 0x1111, 0);
    let mut honest = Raw::connect_with(addr, 0x2222, 0);
    progress_with_nothing_to_deliver(&mut t, Duration::from_millis(50));
    assert_eq!(t.peer_count(), 2);
    let one = |raw: &mut Raw, seq: u64| {
        raw.send(&Raw::data(seq, 1, DataFlags::NONE));
        raw.send(&[1]);
    };
    one(&mut flood, 0);
    let large = sized(3, 256 << 10);
    honest.send(&Raw::data(0, large.len() as u32, DataFlags::NONE));
    honest.send(&large);
    // 200 ms of passes, a small message every 5 ms, none taken.
    let t0 = Instant::now();
    let mut seq = 1;
    while t0.elapsed() < Duration::from_millis(200) {
        one(&mut flood, seq);
        seq += 1;
        let next = Instant::now() + Duration::from_millis(5);
        while Instant::now() < next {
            t.progress().unwrap();
        }
    }
    // In order of arrival: the large one, then small ones after it.
    let mut after = None;
    let by = Instant::now() + 5 * SECOND;
    while after.is_none() || seq > 0 {
        assert!(Instant::now() < by, "not all delivered");
        t.progress().unwrap();
        match t.try_recv() {
            Ok(m) if m.lease.len() == large.len() => {
                assert!(host_bytes(&m.lease) == &large[..]);
                after = Some(0);
            }
            Ok(m) => {
                assert_eq!(m.lease.len(), 1);
                seq -= 1;
                if let Some(n) = after.as_mut() {
                    *n += 1;
                }
            }
            Err(Error::WouldBlock) => {}
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        after.is_some_and(|n| n > 10),
        "small messages after the large one: {after:?}"
    );
}

/// Bytes waiting in a peer's socket while the inbox is full and the
/// progress thread leaves reading to the application (which has not
/// taken its messages): they cannot be read, so the peer is held, not
/// judged, and its message follows once the application takes the first.
#[test]
fn a_peer_whose_bytes_wait_behind_a_full_inbox_while_the_progress_thread_leaves_reading_is_held() {
    let idle = Duration::from_millis(500);
    let mut t = one_message_inbox(idle);
    let addr = t.listen("127.0.0.1:0").unwrap();
    let mut first = Raw::connect_with(addr, 0x1111, 0);
    let mut second = Raw::connect_with(addr, 0x2222, 0);
    let payload = sized(8, 4000);
    second.send(&Raw::data(0, 4000, DataFlags::NONE));
    second.send(&payload[..100]);
    progress_with_nothing_to_deliver(&mut t, idle / 4);
    assert_eq!(t.peer_count(), 2);
    // The first peer's message fills the inbox; then the second's rest.
    first.send(&Raw::data(0, 3, DataFlags::NONE));
    first.send(b"one");
    std::thread::sleep(Duration::from_millis(50));
    for _ in 0..3 {
        t.progress().unwrap(); // reads it: the inbox holds one
    }
    second.send(&payload[100..]);
    let t0 = Instant::now();
    passes_leaving_reading(&mut t, 3 * idle);
    assert_eq!(t.peer_count(), 2, "a peer was dropped");
    let got = receive(&mut t, 2, t0 + 10 * idle);
    assert_eq!(got, [b"one".to_vec(), payload]);
}

/// A peer silent mid-header while the inbox is full and the progress
/// thread leaves reading to the application: nothing of it waits, so the
/// full inbox is no excuse, and it is dropped at the idle timeout (a
/// readiness flag that was only a guess held it for good).
#[test]
fn a_peer_silent_mid_header_behind_a_full_inbox_is_dropped_after_the_timeout() {
    let idle = Duration::from_millis(500);
    let mut t = one_message_inbox(idle);
    let addr = t.listen("127.0.0.1:0").unwrap();
    let mut first = Raw::connect_with(addr, 0x1111, 0);
    let mut silent = Raw::connect_with(addr, 0x2222, 0);
    silent.send(&Raw::data(0, 4000, DataFlags::NONE)[..10]);
    progress_with_nothing_to_deliver(&mut t, idle / 4);
    assert_eq!(t.peer_count(), 2);
    first.send(&Raw::data(0, 3, DataFlags::NONE));
    first.send(b"one");
    std::thread::sleep(Duration::from_millis(50));
    for _ in 0..3 {
        t.progress().unwrap(); // reads it: the inbox holds one
    }
    passes_leaving_reading_until_dropped(&mut t, 2, "silent", |_| {});
    let one = t.try_recv().unwrap();
    assert_eq!(host_bytes(&one.lease), b"one");
    expect_stalled(&mut t, Stall::Frame);
}

/// The same absence with a full inbox: the pass's reads stop at the first
/// peer's message (the inbox holds one), before the peer left mid-frame;
/// that one is held by this side, not timed out, and its message follows.
#[test]
fn a_peer_the_reads_did_not_reach_for_a_full_inbox_is_held_not_timed_out() {
    let idle = Duration::from_millis(500);
    let mut t = one_message_inbox(idle);
    let addr = t.listen("127.0.0.1:0").unwrap();
    let mut first = Raw::connect_with(addr, 0x1111, 0);
    let mut second = Raw::connect_with(addr, 0x2222, 0);
    let payload = sized(6, 4000);
    second.send(&Raw::data(0, 4000, DataFlags::NONE));
    second.send(&payload[..100]);
    // Both peers in, the second mid-frame.
    progress_with_nothing_to_deliver(&mut t, idle / 4);
    assert_eq!(t.peer_count(), 2);
    // The first peer's two messages, then the rest of the second's frame:
    // the next pass reads them in that order, and one fills the inbox.
    first.send(&Raw::data(0, 3, DataFlags::NONE));
    first.send(b"one");
    first.send(&Raw::data(1, 3, DataFlags::NONE));
    first.send(b"two");
    std::thread::sleep(Duration::from_millis(50));
    second.send(&payload[100..]);
    std::thread::sleep(3 * idle);
    t.progress().unwrap();
    let mut got = receive(&mut t, 3, Instant::now() + 5 * SECOND);
    got.sort_by_key(Vec::len);
    assert_eq!(got, [b"one".to_vec(), b"two".to_vec(), payload]);
}

/// The same stall from a peer that has delivered a message: a spinning
/// receiver then reads that peer straight away on each poll (no epoll),
/// and a look that finds nothing is not news of the peer.
#[test]
fn a_half_frame_from_the_peer_that_delivered_last_is_dropped_after_the_timeout() {
    let config = TcpConfig {
        idle_timeout: Duration::from_millis(300),
        ..TcpConfig::default()
    };
    let (server, addr, _pool) = listener(64 << 20, config);
    let mut raw = Raw::connect(addr);
    raw.send(&Raw::data(0, 5, DataFlags::NONE));
    raw.send(b"hello");
    let r = server.recv(Deadline::after(5 * SECOND), None).unwrap();
    assert_eq!(host_bytes(&r.lease), b"hello");
    drop(r);
    // Half of the next header, then nothing, while the receiver spins.
    raw.send(&Raw::data(1, 10, DataFlags::NONE)[..10]);
    let t0 = Instant::now();
    let e = server.recv(Deadline::after(5 * SECOND), None).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Protocol {
                error: ProtocolError::Stalled {
                    during: Stall::Frame
                },
                ..
            }
        ),
        "{e:?} after {:?}",
        t0.elapsed()
    );
    assert!(
        t0.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t0.elapsed()
    );
    assert!(raw.closed_by_peer());
}

#[test]
fn hundreds_of_connections_that_never_say_hello_make_room_oldest_first() {
    let config = TcpConfig {
        max_handshakes: 50,
        ..TcpConfig::default()
    };
    let (server, addr, _pool) = listener(64 << 20, config);
    let idle: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    let t0 = Instant::now();
    while server.with(|t| t.handshaking()) < 50 || t0.elapsed() < Duration::from_millis(200) {
        assert!(t0.elapsed() < 10 * SECOND);
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(server.with(|t| t.handshaking()), 50, "bounded");
    // A peer that does say Hello is served among them.
    let (good, peer) = client(addr);
    expect_still_served(&server, &good, peer);
    drop(idle);
}

/// Past `max_handshakes`, the connection that makes room is the oldest of
/// the address with the most connections that have not said Hello: one
/// address's flood of silent connections does not push out another's
/// connection before its Hello (before, the oldest went, whoever's).
#[test]
fn a_flood_of_silent_connections_from_one_address_does_not_push_out_anothers_handshake() {
    let config = TcpConfig {
        max_handshakes: 8,
        ..TcpConfig::default()
    };
    let (server, addr, _pool) = listener(64 << 20, config);
    let honest = TcpStream::connect(addr).unwrap();
    honest.set_nodelay(true).unwrap();
    while server.with(|t| t.handshaking()) < 1 {
        std::thread::sleep(Duration::from_millis(5));
    }
    let flood: Vec<TcpStream> = (0..32)
        .map(|_| Raw::socket(addr, Some(std::net::Ipv4Addr::new(127, 0, 0, 2)), None))
        .collect();
    let t0 = Instant::now();
    while server.with(|t| t.handshaking()) < 8 || t0.elapsed() < Duration::from_millis(200) {
        assert!(t0.elapsed() < 10 * SECOND);
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut honest = Raw::greet(honest, 0x7E57, 0);
    honest.s.set_read_timeout(Some(5 * SECOND)).unwrap();
    assert!(
        matches!(honest.read_frame().0, Frame::Hello(_)),
        "the listener's Hello"
    );
    wait_for_peer(&server);
    drop(flood);
}

/// Every peer's main connection, accepted or dialed, has TCP keepalive on with
/// zerohop's short idle time (as the kernel reports its timers in
/// /proc/net/tcp): a peer that dies without a word is found and its place
/// under the peer limits freed; quiet peers are otherwise kept for good.
#[test]
fn every_peer_connection_is_kept_alive_so_a_silent_death_is_found() {
    use zerohop_std::tcp::KEEPALIVE_IDLE;
    let (server, addr, _pool) = listener(64 << 20, TcpConfig::default());
    let one_connection = TcpConfig {
        stripe_min: None,
        ..TcpConfig::default()
    };
    let (good, peer) = client_with(addr, one_connection);
    expect_still_served(&server, &good, peer);
    // /proc/net/tcp: "sl local rem st queues tr:when ...", hex addresses
    // and ports; `tr` 2 is the keepalive timer, `when` in clock ticks (100
    // a second). The namespace's every socket is listed: the two ends are
    // the connection to the listener's port on 127.0.0.1 and its mirror.
    let listener_port = addr.port();
    let timers = || -> Vec<(bool, u64)> {
        let table = std::fs::read_to_string("/proc/self/net/tcp").unwrap();
        let end = |a: &str| {
            let (ip, port) = a.split_once(':').unwrap();
            (ip == "0100007F").then(|| u16::from_str_radix(port, 16).unwrap())
        };
        let sockets: Vec<(u16, u16, bool, u64)> = table
            .lines()
            .skip(1)
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                let (tr, when) = f[5].split_once(':').unwrap();
                let timer = (tr == "02", u64::from_str_radix(when, 16).unwrap());
                (f[3] == "01").then_some(())?; // established
                Some((end(f[1])?, end(f[2])?, timer.0, timer.1))
            })
            .collect();
        let accepted: Vec<_> = sockets.iter().filter(|s| s.0 == listener_port).collect();
        let [a] = accepted[..] else {
            return Vec::new();
        };
        let dialed = sockets.iter().find(|s| s.0 == a.1 && s.1 == listener_port);
        dialed.map_or(Vec::new(), |d| vec![(a.2, a.3), (d.2, d.3)])
    };
    let t0 = Instant::now();
    let mut seen = timers();
    while !(seen.len() == 2 && seen.iter().all(|&(kept_alive, _)| kept_alive)) {
        assert!(t0.elapsed() < 5 * SECOND, "not both kept alive: {seen:?}");
        std::thread::sleep(Duration::from_millis(20));
        seen = timers();
    }
    let limit = KEEPALIVE_IDLE.as_secs() * 100;
    assert!(
        seen.iter().all(|&(_, when)| when <= limit),
        "the first probe within {KEEPALIVE_IDLE:?}, not the system's two hours: {seen:?}"
    );
}

/// A listener that keeps as many peers as it takes lets a quiet peer go
/// for a newcomer (nothing heard for an idle timeout) of a crowd: here the
/// loopback addresses, one crowd however many a process binds. Of the
/// quiet ones, one that never delivered a message goes first (a
/// stranger's connections that said Hello and nothing more before a peer
/// that gossips), then the longest quiet; peers that speak are never let
/// go. The quiet one's side reads a Close, the application is told
/// (`Evicted`); with none quiet, the next newcomer is refused. (Before, a
/// stranger that held the limit's worth of connections that said Hello and
/// nothing more kept every newcomer out for as long as it liked: an outside
/// attack on `perf --listen` did so with 4 100; with each peer counted by
/// its own address, one connection from each of 4 096 loopback addresses
/// would have.) Which crowd goes first, and that a peer alone in its group
/// is spared, `waiting_room`'s unit test shows.
#[test]
fn a_full_listener_lets_a_quiet_peer_of_the_crowd_go_for_a_newcomer() {
    let config = TcpConfig {
        // (An application away half of it, 500 ms, lets nobody go.)
        idle_timeout: SECOND,
        peer_limits: PeerLimits {
            accepted: 4,
            per_address: 4,
        },
        ..TcpConfig::default()
    };
    let (server, addr, _pool) = listener(64 << 20, config);
    let from = |last| std::net::Ipv4Addr::new(127, 0, 0, last);
    let hello = |r: &mut Raw| {
        r.s.set_read_timeout(Some(5 * SECOND)).unwrap(); // fail, not hang
        assert!(matches!(r.read_frame().0, Frame::Hello(_)));
    };
    // Kept long, alone at its address: it delivers a message, then is
    // quiet longer than anyone.
    let mut kept_long = Raw::connect_from(addr, from(2));
    hello(&mut kept_long);
    kept_long.send(&[&Raw::data(0, 5, DataFlags::NONE)[..], b"first"].concat());
    let m = server
        .recv(Deadline::after(5 * SECOND), None)
        .expect("heard");
    assert_eq!(host_bytes(&m.lease), b"first");
    drop(m);
    let mut speakers: Vec<Raw> = (0..2).map(|_| Raw::connect_from(addr, from(1))).collect();
    for r in &mut speakers {
        hello(r);
    }
    // Quiet, and never more than its Hello.
    let mut fresh = Raw::connect_from(addr, from(5));
    hello(&mut fresh);
    let mut seqs = [0u64; 4];
    let mut speak = |who: &mut [&mut Raw]| {
        for (r, seq) in who.iter_mut().zip(seqs.iter_mut()) {
            r.send(&[&Raw::data(*seq, 5, DataFlags::NONE)[..], b"hello"].concat());
            *seq += 1;
        }
        for _ in 0..who.len() {
            let m = server
                .recv(Deadline::after(5 * SECOND), None)
                .expect("heard");
            assert_eq!(host_bytes(&m.lease), b"hello");
        }
    };
    for _ in 0..13 {
        speak(&mut speakers.iter_mut().collect::<Vec<_>>());
        std::thread::sleep(Duration::from_millis(100));
    }
    let evicted =
        |server: &Endpoint<TcpTransport>| match server.recv(Deadline::after(5 * SECOND), None) {
            Err(Error::Protocol {
                peer,
                error: ProtocolError::Evicted,
            }) => peer,
            other => panic!("{other:?}"),
        };
    let mut newcomer = Raw::connect_from(addr, from(3));
    hello(&mut newcomer);
    assert!(
        matches!(fresh.read_frame().0, Frame::Close(_)),
        "the one that never spoke let go"
    );
    assert!(fresh.closed_by_peer());
    let gone = evicted(&server);
    assert!(server.with(|t| t.peer_stats(gone)).is_none(), "gone");
    kept_long.s.set_nonblocking(true).unwrap();
    let told = std::io::Read::read(&mut kept_long.s, &mut [0; 1]);
    assert!(
        matches!(told, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "kept"
    );
    kept_long.s.set_nonblocking(false).unwrap();
    // The one kept long goes for the next, then nobody is quiet.
    {
        let [a, b] = &mut speakers[..] else {
            unreachable!()
        };
        speak(&mut [a, b, &mut newcomer]);
    }
    let mut late = Raw::connect_from(addr, from(4));
    hello(&mut late);
    assert!(
        matches!(kept_long.read_frame().0, Frame::Close(_)),
        "then the one kept long"
    );
    evicted(&server);
    assert_eq!(server.with(|t| t.refused()), 0);
    let [a, b] = &mut speakers[..] else {
        unreachable!()
    };
    speak(&mut [a, b, &mut newcomer, &mut late]);
    let mut refused = Raw::connect_from(addr, from(6));
    refused.s.set_read_timeout(Some(5 * SECOND)).unwrap();
    assert!(matches!(refused.read_frame().0, Frame::Close(_)), "refused");
    assert_eq!(server.with(|t| t.refused()), 1);
}

/// A listener keeps at most its peer limits' accepted peers, overall and
/// from one address: a newcomer past either is answered with a Close where
/// the Hello was due (a zerohop peer reports `Refused`), the peers kept are
/// served on, and a place that frees is taken again.
#[test]
fn a_listener_at_its_peer_limits_refuses_newcomers_and_serves_those_it_keeps() {
    // Limits of 0 would refuse every peer: refused themselves, at once.
    for (accepted, per_address) in [(0, 1), (1, 0)] {
        let config = TcpConfig {
            peer_limits: PeerLimits {
                accepted,
                per_address,
            },
            ..TcpConfig::default()
        };
        match TcpTransport::new(private_pool(1 << 20).unwrap(), config, Kind::Tcp) {
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}"),
            Ok(_) => panic!("limits {accepted} / {per_address} taken"),
        }
    }
    let config = TcpConfig {
        peer_limits: PeerLimits {
            accepted: 3,
            per_address: 2,
        },
        // None quiet an idle timeout (let go for a newcomer) in the test's time.
        idle_timeout: Duration::from_secs(60),
        ..TcpConfig::default()
    };
    let (server, addr, _pool) = listener(64 << 20, config);
    let (good, peer) = client(addr); // 127.0.0.1: one
    expect_still_served(&server, &good, peer);
    let from = |ip: [u8; 4]| {
        Raw::greet(
            Raw::socket(addr, Some(std::net::Ipv4Addr::from(ip)), None),
            0x7E57,
            0,
        )
    };
    let mut second = from([127, 0, 0, 1]); // 127.0.0.1: two
    assert!(matches!(second.read_frame().0, Frame::Hello(_)));
    // A third from 127.0.0.1 is within the overall bound, past its address's.
    let mut third = from([127, 0, 0, 1]);
    assert!(matches!(third.read_frame().0, Frame::Close(_)), "refused");
    assert!(third.closed_by_peer());
    assert_eq!(server.with(|t| t.refused()), 1);
    // Another address has its own share, until the overall bound.
    let mut other = from([127, 0, 0, 2]);
    assert!(matches!(other.read_frame().0, Frame::Hello(_)));
    let mut fourth = from([127, 0, 0, 3]);
    assert!(matches!(fourth.read_frame().0, Frame::Close(_)), "full");
    assert!(fourth.closed_by_peer());
    assert_eq!(server.with(|t| t.refused()), 2);
    // A zerohop peer refused says so, typed.
    let (refused, _) = client(addr);
    match refused.recv(Deadline::after(5 * SECOND), None) {
        Err(Error::Protocol {
            error: ProtocolError::Refused,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(server.with(|t| t.refused()), 3);
    expect_still_served(&server, &good, peer);
    // A refused newcomer that streams is cut off (1 KiB past its Hello),
    // not read for as long as it sends.
    let mut flood = from([127, 0, 0, 4]);
    assert!(matches!(flood.read_frame().0, Frame::Close(_)));
    let t0 = Instant::now();
    let junk = vec![7u8; 64 << 10];
    while flood.s.write_all(&junk).is_ok() {
        assert!(t0.elapsed() < 5 * SECOND, "the flood was never cut off");
    }
    expect_still_served(&server, &good, peer);
    assert_eq!(server.with(|t| t.refused()), 4);
    // The second goes: its place, and its address's, are taken again.
    drop(second);
    match server.recv(Deadline::after(5 * SECOND), None) {
        Err(Error::PeerLost(_)) => {}
        other => panic!("the second's end: {other:?}"),
    }
    let mut again = from([127, 0, 0, 1]);
    assert!(matches!(again.read_frame().0, Frame::Hello(_)));
    assert_eq!(server.with(|t| t.peer_count()), 3);
    assert_eq!(server.with(|t| t.refused()), 4);
    expect_still_served(&server, &good, peer);
    drop((other, again));
}

#[test]
fn a_sequence_number_at_the_end_of_the_range_is_a_typed_error() {
    let (server, addr, _pool) = listener(64 << 20, TcpConfig::default());
    let mut raw = Raw::connect(addr);
    raw.send(&Raw::data(u64::MAX, 3, DataFlags::NONE));
    raw.send(b"abc");
    assert_eq!(
        server.recv(Deadline::after(5 * SECOND), None).unwrap_err(),
        Error::Protocol {
            peer: PeerId(0),
            error: ProtocolError::SequenceGap {
                expected: 0,
                got: u64::MAX
            }
        }
    );
}

/// Short records from a peer whose Hello takes them: delivered in order; a
/// record out of sequence, with a reserved byte set or before the peer's
/// Host frame fails that peer, typed, and its message is not delivered.
#[test]
fn short_records_are_delivered_in_order_and_one_out_of_sequence_or_malformed_fails_its_peer() {
    let (server, addr, pool) = listener(64 << 20, TcpConfig::default());
    let (good, peer) = client(addr);
    expect_still_served(&server, &good, peer);
    let mut raw = Raw::connect(addr);
    for (seq, body) in [(0u16, &b"zero"[..]), (1, b""), (2, b"two")] {
        raw.send(&Raw::short(seq, body.len() as u32));
        raw.send(body);
    }
    for body in [&b"zero"[..], b"", b"two"] {
        let r = server.recv(Deadline::after(5 * SECOND), None).unwrap();
        assert_eq!(host_bytes(&r.lease), body);
    }
    // A gap (3 expected), then a duplicate on a fresh peer.
    let mut bad = Raw::short(5, 4).to_vec();
    bad.extend_from_slice(b"gap!");
    let mut dup = Raw::short(0, 1).to_vec();
    dup.extend_from_slice(b"a");
    dup.extend_from_slice(&Raw::short(0, 1));
    dup.extend_from_slice(b"b");
    let mut reserved = Raw::short(0, 1);
    reserved[20] = 1;
    let mut reserved = reserved.to_vec();
    reserved.push(b'r');
    for (raw, delivered, want) in [
        (
            &mut raw,
            0,
            ProtocolError::SequenceGap {
                expected: 3,
                got: 5,
            },
        ),
        (
            &mut Raw::connect(addr),
            1,
            ProtocolError::Duplicate { seq: 0 },
        ),
        (
            &mut Raw::connect(addr),
            0,
            ProtocolError::Decode(DecodeError::ReservedBits),
        ),
    ]
    .into_iter()
    .zip([bad, dup, reserved])
    .map(|((r, d, w), bytes)| {
        r.send(&bytes);
        (r, d, w)
    }) {
        for _ in 0..delivered {
            let r = server.recv(Deadline::after(5 * SECOND), None).unwrap();
            assert_eq!(host_bytes(&r.lease), b"a");
        }
        let e = server.recv(Deadline::after(5 * SECOND), None).unwrap_err();
        assert!(
            matches!(e, Error::Protocol { error, .. } if error == want),
            "{e:?}, want {want:?}"
        );
        assert!(raw.closed_by_peer());
    }
    // Before its Host frame (the same-host exchange unsettled), as a header
    // would be.
    let mut early = Raw {
        s: TcpStream::connect(addr).unwrap(),
    };
    early.send(&Raw::hello(0x7E57, 0));
    early.send(&Raw::short(0, 1));
    early.send(b"x");
    let e = server.recv(Deadline::after(5 * SECOND), None).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Protocol {
                error: ProtocolError::HostExpected {
                    got: FrameKind::Data
                },
                ..
            }
        ),
        "{e:?}"
    );
    assert!(early.closed_by_peer());
    expect_still_served(&server, &good, peer);
    assert_eq!(pool.used_bytes(), 0, "every lease back");
}

/// The transport sends a peer whose Hello takes headerless frames short
/// records, and one whose Hello does not (or any peer, with
/// `check_payload`) checksummed headers; with `check_payload` it takes no
/// short record either.
#[test]
fn short_records_go_only_to_peers_that_take_them_and_never_with_checksums() {
    use std::io::Read;
    for check_payload in [false, true] {
        for takes in [Takes::NONE, Takes::HEADERLESS] {
            let config = TcpConfig {
                check_payload,
                ..TcpConfig::default()
            };
            let (server, addr, _pool) = listener(64 << 20, config);
            let s = TcpStream::connect(addr).unwrap();
            let mut hello = Raw::hello(0x7E57, 0);
            hello = match Frame::decode(&hello, 0).unwrap().frame {
                Frame::Hello(h) => Frame::Hello(Hello { takes, ..h }).encode(&[]),
                other => panic!("{other:?}"),
            };
            s.set_read_timeout(Some(5 * SECOND)).unwrap();
            let mut raw = Raw { s };
            raw.send(&hello);
            raw.send(&Raw::no_offer());
            let peer = wait_for_peer(&server);
            // Its Hello first.
            assert_eq!(raw.read_frame().0.kind(), FrameKind::Hello);
            for i in 0..3u16 {
                let body = [i as u8; 5];
                server
                    .send(peer, &body, Deadline::after(5 * SECOND), None)
                    .unwrap();
                let mut h = [0u8; HEADER_LEN];
                raw.s.read_exact(&mut h).unwrap();
                let short = takes == Takes::HEADERLESS && !check_payload;
                match ShortRecord::decode(&h) {
                    Some(r) => {
                        assert!(
                            short,
                            "a short record to {takes:?}, checked {check_payload}"
                        );
                        let r = r.unwrap();
                        assert_eq!((r.imm >> 16, r.len), (u32::from(i), 5));
                    }
                    None => {
                        assert!(!short, "a header to {takes:?}, checked {check_payload}");
                        let d = Frame::decode(&h, 64 << 20).unwrap();
                        let mut payload = [0u8; 5];
                        raw.s.read_exact(&mut payload).unwrap();
                        d.verify(&payload).unwrap();
                        assert!(matches!(d.frame, Frame::Data(x) if x.seq == u64::from(i)));
                        continue;
                    }
                }
                let mut payload = [0u8; 5];
                raw.s.read_exact(&mut payload).unwrap();
                assert_eq!(payload, body);
            }
            // What it takes: a short record is refused with checksums on.
            raw.send(&Raw::short(0, 2));
            raw.send(b"hi");
            if check_payload {
                let e = server.recv(Deadline::after(5 * SECOND), None).unwrap_err();
                assert!(
                    matches!(
                        e,
                        Error::Protocol {
                            error: ProtocolError::HeaderlessRefused,
                            ..
                        }
                    ),
                    "{e:?}"
                );
            } else {
                let r = server.recv(Deadline::after(5 * SECOND), None).unwrap();
                assert_eq!(host_bytes(&r.lease), b"hi");
            }
        }
    }
}

#[test]
fn a_listener_of_another_version_is_refused_by_name() {
    let raw = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut t = transport(
        16 << 20,
        TcpConfig {
            stripe_min: None,
            ..TcpConfig::default()
        },
    );
    let peer = t.connect(raw.local_addr().unwrap(), SECOND).unwrap();
    let (mut s, _) = raw.accept().unwrap();
    // Version 2: the one before the same-host exchange.
    let mut v2 = Raw::hello(1, 0);
    v2[2] = 2;
    s.write_all(&v2).unwrap();
    let c = Endpoint::new(t, EndpointConfig::default()).unwrap();
    let e = c.recv(Deadline::after(5 * SECOND), None).unwrap_err();
    assert_eq!(
        e,
        Error::Protocol {
            peer,
            error: ProtocolError::Decode(DecodeError::UnsupportedVersion {
                theirs: 2,
                ours: zerohop_core::wire::VERSION
            })
        }
    );
    assert!(
        e.to_string().contains("version 2, this side speaks 6"),
        "{e}"
    );
}

#[test]
fn a_clean_close_is_reported_as_clean_on_both_sides() {
    let (server, addr, _pool) = listener(64 << 20, TcpConfig::default());
    let mut t = transport(16 << 20, TcpConfig::default());
    let peer = t.connect(addr, SECOND).unwrap();
    let c = Endpoint::new(t, EndpointConfig::default()).unwrap();
    c.send(peer, b"last words", Deadline::after(5 * SECOND), None)
        .unwrap();
    let r = server.recv(Deadline::after(5 * SECOND), None).unwrap();
    assert_eq!(host_bytes(&r.lease), b"last words");
    let from = r.peer;
    drop(r);
    c.with(|t| t.close()).unwrap();
    assert_eq!(
        server.recv(Deadline::after(5 * SECOND), None).unwrap_err(),
        Error::PeerClosed(from)
    );
    // The server answered with its own close: reported on the client too.
    assert_eq!(
        c.recv(Deadline::after(5 * SECOND), None).unwrap_err(),
        Error::PeerClosed(peer)
    );
    let t0 = Instant::now();
    while server.with(|t| t.peer_count()) > 0 {
        assert!(
            t0.elapsed() < 5 * SECOND,
            "the finished peer was never let go"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    // The side that closed first lets go too, once the answer is in.
    while c.with(|t| t.peers_left()) > 0 {
        assert!(
            t0.elapsed() < 5 * SECOND,
            "the side that closed first kept the finished peer"
        );
        c.progress().unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn shutdown_waits_for_every_peers_answering_close_and_then_nothing_is_left() {
    let (server, addr, _pool) = listener(64 << 20, TcpConfig::default());
    let clients: Vec<_> = (0..3).map(|_| client(addr)).collect();
    for (c, peer) in &clients {
        c.send(*peer, &[1u8; 100_000], Deadline::after(5 * SECOND), None)
            .unwrap();
    }
    for _ in 0..3 {
        let Event::Message(_) = next_message_event(&server) else {
            unreachable!()
        };
    }
    // The server closes first; each client's session answers on its own.
    server.shutdown(Deadline::after(5 * SECOND)).unwrap();
    assert_eq!(server.with(|t| t.peers_left()), 0);
    for (c, peer) in &clients {
        c.shutdown(Deadline::after(5 * SECOND)).unwrap();
        assert_eq!(c.with(|t| t.peers_left()), 0);
        assert_eq!(
            c.recv(Deadline::after(SECOND), None).unwrap_err(),
            Error::PeerClosed(*peer),
            "the server's close reached the client as a clean close"
        );
    }
}

#[test]
fn the_side_that_closed_first_lets_go_when_the_answer_comes_on_an_open_connection() {
    // A peer that answers the Close and keeps its socket open: no end of
    // stream comes to end the session for the transport.
    let (server, addr, _pool) = listener(64 << 20, TcpConfig::default());
    let mut raw = Raw::connect(addr);
    let Event::Accepted { .. } = server
        .next_event(Deadline::after(5 * SECOND), None)
        .unwrap()
    else {
        panic!("the raw peer's connection");
    };
    let closing = std::thread::spawn(move || {
        loop {
            if let (Frame::Close(_), _) = raw.read_frame() {
                break;
            }
        }
        raw.send(&Frame::Close(zerohop_core::wire::Close { seq: 0 }).encode(&[]));
        raw // kept open until the test ends
    });
    server.shutdown(Deadline::after(5 * SECOND)).unwrap();
    assert_eq!(server.with(|t| t.peers_left()), 0);
    drop(closing.join().unwrap());
}

fn next_message_event(server: &Endpoint<TcpTransport>) -> Event<zerohop_std::StdLease> {
    loop {
        match server
            .next_event(Deadline::after(5 * SECOND), None)
            .unwrap()
        {
            Event::Accepted { .. } => {}
            e @ Event::Message(_) => return e,
            e => panic!("unexpected {e:?}"),
        }
    }
}

#[test]
fn events_say_who_connected_from_where_what_crossed_and_how_each_peer_ended() {
    let (server, addr, _pool) = listener(64 << 20, TcpConfig::default());
    let wait = || Deadline::after(5 * SECOND);
    let (a, to_server) = client(addr);
    a.send(to_server, b"hello from a", wait(), None).unwrap();
    let Event::Accepted {
        peer: pa,
        addr: from,
    } = server.next_event(wait(), None).unwrap()
    else {
        panic!("the first event is the connection");
    };
    assert_eq!(a.with(|t| t.peer_addr(to_server)), Some(addr));
    assert_eq!(from.ip(), addr.ip());
    assert_ne!(
        from.port(),
        addr.port(),
        "the peer's own port, not the listener's"
    );
    let Event::Message(m) = server.next_event(wait(), None).unwrap() else {
        panic!("then its message");
    };
    assert_eq!((m.peer, host_bytes(&m.lease)), (pa, &b"hello from a"[..]));
    drop(m);
    let stats = server.with(|t| t.peer_stats(pa)).unwrap();
    assert_eq!((stats.messages_received, stats.bytes_received), (1, 12));
    assert_eq!(stats.messages_sent, 0);
    let sent = a.with(|t| t.peer_stats(to_server)).unwrap();
    assert_eq!((sent.messages_sent, sent.bytes_sent), (1, 12));

    // A second peer that dies: Accepted, then Lost, naming the same peer.
    let mut raw = Raw::connect(addr);
    let Event::Accepted { peer: pr, .. } = server.next_event(wait(), None).unwrap() else {
        panic!("the raw peer's connection");
    };
    assert_ne!(pr, pa);
    raw.send(&Raw::data(0, 1000, DataFlags::NONE));
    drop(raw);
    match server.next_event(wait(), None).unwrap() {
        Event::Lost { peer, error } => assert_eq!((peer, error), (pr, Error::PeerLost(pr))),
        e => panic!("expected the raw peer lost, got {e:?}"),
    }
    // The first closes cleanly.
    a.with(|t| t.close()).unwrap();
    match server.next_event(wait(), None).unwrap() {
        Event::Closed(peer) => assert_eq!(peer, pa),
        e => panic!("expected a clean close, got {e:?}"),
    }
    assert_eq!(
        server
            .next_event(Deadline::after(Duration::from_millis(50)), None)
            .unwrap_err(),
        Error::Timeout
    );
}

/// A peer whose Hello and first message are read in one pass: the message
/// waits for the next look, so that the application hears of the peer
/// first, and then it comes.
#[test]
fn a_message_read_with_its_peers_hello_comes_right_after_the_peer() {
    let mut t = transport(64 << 20, TcpConfig::default());
    let addr = t.listen("127.0.0.1:0").unwrap();
    // No progress thread: the first pass is the application's call, after
    // everything the peer sent is in the socket.
    let config = EndpointConfig {
        progress_thread: false,
        ..EndpointConfig::default()
    };
    let server = Endpoint::new(t, config).unwrap();
    let mut raw = Raw::connect(addr);
    raw.send(&[&Raw::data(0, 5, DataFlags::NONE)[..], b"first"].concat());
    std::thread::sleep(Duration::from_millis(100));
    let wait = || Deadline::after(5 * SECOND);
    let Event::Accepted { peer, .. } = server.next_event(wait(), None).unwrap() else {
        panic!("the first event is the connection");
    };
    let held = server.with(|t| t.try_recv());
    assert!(
        matches!(held, Err(Error::WouldBlock)),
        "the pass took the message in with the Hello: {held:?}"
    );
    match server.next_event(wait(), None).unwrap() {
        Event::Message(m) => assert_eq!((m.peer, host_bytes(&m.lease)), (peer, &b"first"[..])),
        e => panic!("then its message, held from that pass: {e:?}"),
    }
}

/// A caller-driven endpoint (no progress thread) whose `send` waits on a
/// peer that reads nothing still accepts and greets new peers meanwhile:
/// the blocked send does the connection work, as a blocked receive does,
/// so one peer that stops reading holds up no other's handshake.
#[test]
fn a_send_blocked_on_a_peer_that_reads_nothing_still_greets_new_peers() {
    let mut t = transport(64 << 20, TcpConfig::default());
    let addr = t.listen("127.0.0.1:0").unwrap();
    let config = EndpointConfig {
        progress_thread: false,
        ..EndpointConfig::default()
    };
    let server = Endpoint::new(t, config).unwrap();
    let stuck = Raw::connect_with_rcvbuf(addr, 4096);
    let Event::Accepted { peer, .. } = server
        .next_event(Deadline::after(5 * SECOND), None)
        .unwrap()
    else {
        panic!("the first event is the connection");
    };
    std::thread::scope(|s| {
        // Within the peer's credit, far beyond what the sockets buffer.
        let sending = s.spawn(|| {
            let big = vec![7u8; 8 << 20];
            server.send(peer, &big, Deadline::after(3 * SECOND), None)
        });
        std::thread::sleep(Duration::from_millis(300));
        let mut fresh = Raw::connect(addr);
        fresh.s.set_read_timeout(Some(2 * SECOND)).unwrap();
        let greeted = Instant::now();
        let (hello, _) = fresh.read_frame();
        assert!(
            matches!(hello, Frame::Hello(_)),
            "the new peer is greeted: {hello:?}"
        );
        assert!(
            !sending.is_finished(),
            "greeted in {:?}, while the send still waits",
            greeted.elapsed()
        );
        // At its deadline the rest is queued from a copy (a message begun
        // on the wire cannot be withdrawn): the send reports success.
        let r = sending.join().unwrap();
        assert!(r.is_ok(), "{r:?}");
        assert!(server.pending_sends() > 0, "the rest waits in the queue");
    });
    drop(stuck);
}

#[test]
fn a_peer_that_dies_mid_message_is_reported_and_leaks_nothing() {
    let (server, addr, pool) = listener(64 << 20, TcpConfig::default());
    let (good, peer) = client(addr);
    let used_before = pool.used_bytes();
    for abort in [false, true] {
        let mut raw = Raw::connect(addr);
        raw.send(&Raw::data(0, 1 << 20, DataFlags::NONE));
        raw.send(&[7u8; 300_000]);
        let dying = raw.s;
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

/// A peer that sends and never reads: the credit its messages earn waits
/// for it folded into one frame, so what this side queues for it stays a
/// few headers however long it goes on. Without the folding each message's
/// credit frame queued on its own once the kernel's buffers were full:
/// 32 bytes a message, for as long as the peer kept sending.
#[test]
fn a_peer_that_never_reads_holds_one_credit_frame_however_much_it_sends() {
    // A window of 64 bytes: every 16-byte message taken earns a credit frame.
    let config = TcpConfig {
        window: 64,
        ..TcpConfig::default()
    };
    let (server, addr, _pool) = listener(64 << 20, config);
    // A receive buffer as small as the kernel allows.
    let mut raw = Raw::connect_with_rcvbuf(addr, 1024);
    // Until the kernel's buffers are full and frames queue here (about
    // 50 000 credit frames, 1.6 MB, on loopback), then 20 000 more: without
    // the folding, 640 KB more queued.
    let (mut most, mut seq, mut until) = (0, 0u64, None);
    let t0 = Instant::now();
    while until.is_none_or(|end| seq < end) {
        assert!(
            t0.elapsed() < 120 * SECOND,
            "after {seq} messages, nothing queued here yet: the kernel's buffers never filled"
        );
        raw.send(&Raw::data(seq, 16, DataFlags::NONE));
        raw.send(&[seq as u8; 16]);
        let r = server.recv(Deadline::after(5 * SECOND), None).unwrap();
        assert_eq!(host_bytes(&r.lease), &[seq as u8; 16][..]);
        drop(r);
        let queued = server.with(|t| t.queued_bytes());
        most = most.max(queued);
        if queued > 0 && until.is_none() {
            until = Some(seq + 20_000);
        }
        seq += 1;
    }
    assert!(
        most <= 4 * HEADER_LEN,
        "queued for a peer that reads nothing: at most {most} bytes"
    );
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
    let until = Instant::now() + 5 * SECOND;
    // The handshake: both sides progress until a may send.
    while a.try_send(peer, &m(1)) == Err(Error::WouldBlock) {
        assert!(Instant::now() < until, "never opened");
        b.progress().unwrap();
        a.progress().unwrap();
    }
    a.try_send(peer, &m(2)).unwrap();
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
fn a_striped_message_that_comes_before_the_lanes_ack_is_read_is_received() {
    // The acceptor stripes as soon as it pairs the lane; the connecting side
    // may see the striped header on its main connection before it has read
    // the ack that waits on its lane.
    let (server, addr, _pool) = listener(64 << 20, TcpConfig::default());
    let mut t = transport(64 << 20, TcpConfig::default());
    let peer = t.connect(addr, SECOND).unwrap();
    let caller_driven = EndpointConfig {
        progress_thread: false,
        ..EndpointConfig::default()
    };
    let c = Endpoint::new(t, caller_driven).unwrap();
    let Event::Accepted { peer: back, .. } = server
        .next_event(Deadline::after(5 * SECOND), None)
        .unwrap()
    else {
        panic!("the connection");
    };
    let t0 = Instant::now();
    while server.with(|t| t.connections(back)) != Some(2) {
        assert!(t0.elapsed() < 5 * SECOND, "the lane was never paired");
        std::thread::sleep(Duration::from_millis(1));
    }
    for i in 0..3 {
        server
            .send(back, &sized(i, 2 << 20), Deadline::after(5 * SECOND), None)
            .unwrap();
    }
    assert!(
        server.with(|t| t.striped_sent(back)) >= 1,
        "the acceptor striped"
    );
    for i in 0..3 {
        let r = c.recv(Deadline::after(5 * SECOND), None).unwrap();
        assert_eq!((check(host_bytes(&r.lease)), r.lease.len()), (i, 2 << 20));
    }
    assert_eq!(
        c.with(|t| t.connections(peer)),
        Some(2),
        "the ack was read on the way"
    );
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
    main: Raw,
    lane: Raw,
}

impl RawStriped {
    /// The documented split: half the payload, rounded down to 4 KiB, on the
    /// main connection after the header; the rest on the lane.
    fn halves(payload: &[u8]) -> (&[u8], &[u8]) {
        payload.split_at((payload.len() / 2) & !4095)
    }

    fn header(seq: u64, payload: &[u8]) -> [u8; HEADER_LEN] {
        Raw::data(seq, payload.len() as u32, DataFlags::STRIPED)
    }

    /// Reads the acceptor's ack off the lane: its lane Hello with our token.
    fn await_ack(&mut self, token: u32) {
        self.lane.s.set_read_timeout(Some(5 * SECOND)).unwrap();
        match self.lane.read_frame().0 {
            Frame::Hello(h) => assert_eq!((h.lane, h.token), (1, token), "the ack"),
            other => panic!("not an ack: {other:?}"),
        }
    }
}

/// A lane connection that says its Hello (only).
fn raw_lane(addr: SocketAddr, token: u32) -> Raw {
    Raw::connect_with(addr, token, 1)
}

#[test]
fn a_lane_that_says_hello_before_its_main_connection_is_paired_and_acked() {
    let (server, addr, pool) = listener(64 << 20, TcpConfig::default());
    let token = 0x5EED;
    let payload = sized(9, 600 << 10);
    let (first, rest) = RawStriped::halves(&payload);
    // The lane speaks first, and (not waiting for the ack, as a client
    // should) its half of the message comes right behind its Hello.
    let mut lane = raw_lane(addr, token);
    lane.send(rest);
    std::thread::sleep(Duration::from_millis(100));
    let main = Raw::connect_with(addr, token, 0);
    let mut raw = RawStriped { main, lane };
    raw.await_ack(token);
    raw.main.send(&RawStriped::header(0, &payload));
    raw.main.send(first);
    let r = server.recv(Deadline::after(5 * SECOND), None).unwrap();
    assert_eq!(host_bytes(&r.lease), &payload[..]);
    assert_eq!(
        server.with(|t| (t.peer_count(), t.connections(r.peer))),
        (1, Some(2))
    );
    drop(r);
    assert_eq!(pool.used_bytes(), 0);
}

/// A lane pairs only with a main connection from its own address: a
/// stranger elsewhere that guessed (here: knew) the token is not given
/// half of the peer's striped messages, and the peer's own lane still pairs.
#[test]
fn a_lane_from_another_address_is_not_paired_whatever_its_token() {
    let (server, addr, _pool) = listener(64 << 20, TcpConfig::default());
    let token = 0x5EED;
    // One before the main connection (it waits unclaimed), one after.
    let early = Raw::lane_from(addr, std::net::Ipv4Addr::new(127, 0, 0, 2), token);
    std::thread::sleep(Duration::from_millis(100));
    let main = Raw::connect_with(addr, token, 0);
    let peer = wait_for_peer(&server);
    let late = Raw::lane_from(addr, std::net::Ipv4Addr::new(127, 0, 0, 3), token);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(server.with(|t| t.connections(peer)), Some(1));
    let mut own = raw_lane(addr, token);
    // The acceptor acks the lane it pairs, on that lane: ours, and not the
    // strangers'.
    own.s.set_read_timeout(Some(5 * SECOND)).unwrap();
    match own.read_frame().0 {
        Frame::Hello(h) => assert_eq!((h.lane, h.token), (1, token), "the ack"),
        other => panic!("not an ack: {other:?}"),
    }
    assert_eq!(server.with(|t| t.connections(peer)), Some(2));
    for mut stranger in [early, late] {
        use std::io::Read;
        stranger
            .s
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let mut b = [0u8; HEADER_LEN];
        assert!(
            !matches!(stranger.s.read(&mut b), Ok(n) if n > 0),
            "a stranger's lane was acked"
        );
    }
    drop((main, own));
}

/// A lane whose main connection never comes is closed at the idle timeout
/// (before, it was kept for good, a descriptor each).
#[test]
fn a_lane_whose_main_connection_never_comes_is_closed_at_the_idle_timeout() {
    use std::io::Read;
    let config = TcpConfig {
        idle_timeout: SECOND / 2,
        ..TcpConfig::default()
    };
    let (_server, addr, _pool) = listener(64 << 20, config);
    let t0 = Instant::now();
    let mut lane = raw_lane(addr, 0x0DD);
    lane.s.set_read_timeout(Some(5 * SECOND)).unwrap();
    let mut b = [0u8; HEADER_LEN];
    let r = lane.s.read(&mut b);
    let waited = t0.elapsed();
    assert!(
        matches!(r, Ok(0))
            || r.as_ref()
                .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "the lane was kept: {r:?} after {waited:?}"
    );
    assert!(
        waited >= SECOND * 2 / 5 && waited < 3 * SECOND,
        "closed after {waited:?}"
    );
}

/// Lanes waiting for their main connection are kept two an address, eight
/// in all, and the ones pushed out are of addresses at their bound: a
/// stranger's flood of lane Hellos from four addresses does not push out
/// a lane from another, which still pairs when its main connection comes
/// (before, the ninth lane pushed out the oldest, whoever's).
#[test]
fn a_flood_of_lanes_from_a_few_addresses_does_not_push_out_anothers() {
    let (server, addr, _pool) = listener(64 << 20, TcpConfig::default());
    let token = 0x5EED;
    let mut own = raw_lane(addr, token);
    std::thread::sleep(Duration::from_millis(100));
    let flood: Vec<Raw> = (0..32)
        .map(|i| {
            let from = std::net::Ipv4Addr::new(127, 0, 0, 2 + (i % 4) as u8);
            Raw::lane_from(addr, from, 0xF100 + i)
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let main = Raw::connect_with(addr, token, 0);
    own.s.set_read_timeout(Some(5 * SECOND)).unwrap();
    match own.read_frame().0 {
        Frame::Hello(h) => assert_eq!((h.lane, h.token), (1, token), "the ack"),
        other => panic!("not an ack: {other:?}"),
    }
    let peer = wait_for_peer(&server);
    assert_eq!(server.with(|t| t.connections(peer)), Some(2));
    drop((main, flood));
}

#[test]
fn a_striped_frame_without_a_paired_lane_breaks_the_wires_rule() {
    let (server, addr, pool) = listener(64 << 20, TcpConfig::default());
    let (good, peer) = client(addr);
    expect_still_served(&server, &good, peer);
    let used_before = pool.used_bytes();
    let mut raw = Raw::connect_with(addr, 0xAB, 0);
    let payload = sized(3, 256);
    raw.send(&RawStriped::header(0, &payload));
    raw.send(&payload);
    let e = server.recv(Deadline::after(5 * SECOND), None).unwrap_err();
    assert!(matches!(e, Error::WireRule { .. }), "{e:?}");
    assert!(e.to_string().contains("striped"), "{e}");
    assert!(raw.closed_by_peer());
    assert_eq!(
        server.with(|t| t.peer_count()),
        1,
        "only the good peer is left"
    );
    assert_eq!(pool.used_bytes(), used_before, "nothing leased for it");
    expect_still_served(&server, &good, peer);
}

#[test]
fn a_lane_that_dies_mid_message_loses_its_peer_and_leaks_nothing() {
    let (server, addr, pool) = listener(64 << 20, TcpConfig::default());
    let (good, peer) = client(addr);
    expect_still_served(&server, &good, peer);
    let used_before = pool.used_bytes();
    // The lane closes (end of stream), then, for a second peer, resets (as
    // from a killed process); each main connection stays open, with its part
    // of the message delivered.
    for (token, abort) in [(0xD1E5, false), (0xD1E6, true)] {
        let main = Raw::connect_with(addr, token, 0);
        let lane = raw_lane(addr, token);
        let mut raw = RawStriped { main, lane };
        raw.await_ack(token);
        let payload = sized(1, 1 << 20);
        let (first, rest) = RawStriped::halves(&payload);
        raw.main.send(&RawStriped::header(0, &payload));
        raw.main.send(first);
        raw.lane.send(&rest[..100_000]);
        await_partial_lease(&pool, used_before);
        if abort {
            socket_linger_zero(&raw.lane.s);
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

/// A striped message whose main part is in and whose lane part trickles in
/// for longer than the idle timeout is received: bytes on the lane are news
/// of the peer as well.
#[test]
fn a_striped_message_whose_lane_part_trickles_past_the_idle_timeout_is_received() {
    let config = TcpConfig {
        idle_timeout: Duration::from_millis(300),
        ..TcpConfig::default()
    };
    let (server, addr, pool) = listener(64 << 20, config);
    let token = 0x7121;
    let main = Raw::connect_with(addr, token, 0);
    let lane = raw_lane(addr, token);
    let mut raw = RawStriped { main, lane };
    raw.await_ack(token);
    let payload = sized(4, 1 << 20);
    let (first, rest) = RawStriped::halves(&payload);
    raw.main.send(&RawStriped::header(0, &payload));
    raw.main.send(first);
    // The lane's half in ten pieces, 100 ms apart: a second in all.
    for piece in rest.chunks(rest.len().div_ceil(10)) {
        std::thread::sleep(Duration::from_millis(100));
        raw.lane.send(piece);
    }
    let r = server
        .recv(Deadline::after(5 * SECOND), None)
        .expect("the message, not a stall");
    assert_eq!(host_bytes(&r.lease), &payload[..]);
    drop(r);
    assert_eq!(pool.used_bytes(), 0);
}

/// Reads one data frame, skipping control frames: (seq, payload).
fn read_message(raw: &mut Raw) -> (u64, Vec<u8>) {
    loop {
        if let (Frame::Data(d), p) = raw.read_frame() {
            return (d.seq, p);
        }
    }
}

#[test]
fn a_large_send_is_finished_from_the_callers_slice_or_from_a_copy_when_its_deadline_strikes() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    // One connection (no lane), so the raw reader sees every frame whole.
    let one = TcpConfig {
        stripe_min: None,
        ..TcpConfig::default()
    };
    let (c, peer) = client_with(listener.local_addr().unwrap(), one);
    let (s, _) = listener.accept().unwrap();
    let mut reader = Raw { s };
    assert!(matches!(reader.read_frame().0, Frame::Hello(_)));
    reader.send(&Raw::hello(1, 0));
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
    let (seq, p) = read_message(&mut reader);
    assert_eq!((seq, p.len()), (0, big.len()));
    assert!(
        p == big,
        "the copied rest continues the caller's bytes exactly"
    );
    let (seq, p) = read_message(&mut reader);
    assert_eq!((seq, &p[..]), (1, &b"after"[..]));

    // 2. A reader that keeps up: the send returns when all of the message is
    // with the kernel, and nothing was copied or queued.
    let drain = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        read_message(&mut reader)
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

/// A dial ends outside the transport (an endpoint dials without its lock):
/// one that lands after the transport closed is refused, its connection
/// closed, and no peer is left that a closing endpoint would wait for.
#[test]
fn a_dial_that_lands_after_the_transport_closed_is_refused() {
    let (server, addr, _pool) = listener(64 << 20, TcpConfig::default());
    let mut t = transport(64 << 20, TcpConfig::default());
    let dialed = TcpTransport::dial(addr, SECOND, true).unwrap();
    t.close().unwrap();
    let e = t.attach(dialed).unwrap_err();
    assert!(e.to_string().contains("closed"), "{e}");
    assert_eq!(t.peer_count(), 0);
    // The listener sees the connection go before any Hello: no peer there.
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(server.with(|s| s.peer_count()), 0);
}

/// Peers that each keep a large message under way at the minimum rate, as
/// many as fill the budget for payloads still to come (half the pool),
/// cannot keep an honest peer's large message waiting for good: once it has
/// waited the idle timeout, the slowest of them is dropped as too slow, and
/// the honest message goes in. (Before, they held the budget for as long as
/// they kept the rate.)
#[test]
fn peers_that_keep_the_budget_for_coming_payloads_at_the_minimum_rate_give_way() {
    let config = TcpConfig {
        idle_timeout: SECOND / 2,
        ..TcpConfig::default()
    };
    let (server, addr, _pool) = listener(64 << 20, config);
    let (good, peer) = client(addr);
    expect_still_served(&server, &good, peer);
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        // Two messages of 16 MiB under way fill the 32 MiB budget; each
        // keeps 256 KiB/s, four times the minimum rate.
        // The drippers stop however this ends (the scope then joins them).
        let _stop = StopOnDrop(&stop);
        for _ in 0..2 {
            s.spawn(|| drip(addr, 16 << 20, &stop));
        }
        while server.with(|t| t.peer_count()) < 3 {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(300)); // both under way
        let big = vec![0x5Au8; 1 << 20];
        good.send(peer, &big, Deadline::after(10 * SECOND), None)
            .unwrap();
        let t0 = Instant::now();
        let (m, slow) = recv_counting_stalls(&server, Stall::Slow);
        assert_eq!(m.peer, peer);
        assert!(
            host_bytes(&m.lease) == &big[..],
            "the honest message, whole"
        );
        assert!(slow >= 1, "no dripper was dropped");
        assert!(
            t0.elapsed() < 3 * SECOND,
            "the honest message waited {:?}",
            t0.elapsed()
        );
    });
}

/// Sends a short record for a message of `len` bytes, then its payload at
/// about 256 KiB/s (four times the minimum rate), until `stop`, a closed
/// connection, or 15 s (a failing test ends too).
fn drip(addr: SocketAddr, len: u32, stop: &std::sync::atomic::AtomicBool) {
    let mut raw = Raw::connect(addr);
    raw.send(&Raw::whole(true, 0, len));
    let t0 = Instant::now();
    while !stop.load(std::sync::atomic::Ordering::Relaxed)
        && t0.elapsed() < 15 * SECOND
        && raw.s.write_all(&[7u8; 16 << 10]).is_ok()
    {
        std::thread::sleep(Duration::from_millis(60));
    }
}

/// Sets its flag when dropped: threads that poll it stop however a test ends.
struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The rule above judges a message's pace only while the peer could send:
/// not while this side holds every peer back itself (its inbox full, the
/// application away). A slow holder is kept through such a spell, and
/// judged once the application reads again.
#[test]
fn a_holder_is_not_judged_while_a_full_inbox_holds_it_back() {
    let config = TcpConfig {
        idle_timeout: SECOND / 2,
        inbox_messages: 4,
        ..TcpConfig::default()
    };
    let (server, addr, pool) = listener(32 << 20, config);
    let (good, peer) = client(addr);
    let (filler, to_server) = client(addr);
    expect_still_served(&server, &good, peer);
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        // One message of 16 MiB under way, the whole budget (half the
        // pool), at 256 KiB/s.
        let used = pool.used_bytes();
        let _stop = StopOnDrop(&stop);
        s.spawn(|| drip(addr, 16 << 20, &stop));
        await_partial_lease(&pool, used);
        // The honest 1 MiB waits for room; then the inbox fills, unread.
        let big = vec![0x5Au8; 1 << 20];
        good.send(peer, &big, Deadline::after(10 * SECOND), None)
            .unwrap();
        for i in 0..4u8 {
            filler
                .send(to_server, &[i], Deadline::after(SECOND), None)
                .unwrap();
        }
        // Four idle timeouts with the application away: nobody is judged.
        std::thread::sleep(2 * SECOND);
        assert_eq!(
            server.with(|t| t.peer_count()),
            3,
            "a peer was dropped for this side's own stall"
        );
        // Reading again: the filler's four, then the honest message once the
        // slow holder has been judged.
        let (mut small, mut slow) = (0, 0);
        let m = loop {
            let (m, stalls) = recv_counting_stalls(&server, Stall::Slow);
            slow += stalls;
            match m.lease.len() {
                1 => small += 1,
                _ => break m,
            }
        };
        assert_eq!(m.peer, peer);
        assert_eq!(m.lease.len(), 1 << 20);
        assert_eq!((small, slow), (4, 1));
    });
}
