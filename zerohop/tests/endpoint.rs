//! The facade as an application uses it, over TCP on loopback (every host
//! has it): open, listen, connect by name, events, bytes, counters, the
//! errors a user meets. The other transports run the same calls in the
//! examples (Soft-RoCE VM, H200).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};

use zerohop::{Config, ConnectError, Endpoint, Error, Event, Kind, MemKind, Preference, Skipped};

const WAIT: Duration = Duration::from_secs(10);

fn tcp() -> Config {
    let mut c = Config::only(Kind::Tcp);
    c.pool_bytes = 64 << 20;
    c
}

/// The same-host wire (moved to after a TCP handshake), as `tcp()`.
fn shm() -> Config {
    let mut c = Config::only(Kind::Shm);
    c.pool_bytes = 64 << 20;
    c
}

/// `tcp()` with no progress thread: the application's calls drive it.
fn tcp_caller_driven() -> Config {
    let mut c = tcp();
    c.progress_thread = false;
    c
}

fn server() -> (Endpoint, SocketAddr) {
    let s = Endpoint::open(tcp()).unwrap();
    let addr = s.listen("127.0.0.1:0").unwrap();
    (s, addr)
}

/// The next event that is not a connection.
fn next_non_connect(e: &Endpoint) -> Event {
    loop {
        match e.next_event(WAIT).unwrap() {
            Event::Connected { .. } => {}
            ev => return ev,
        }
    }
}

#[test]
fn a_peer_connects_by_host_name_and_its_messages_and_counters_follow() {
    let (s, addr) = server();
    assert_eq!(s.kind(), Kind::Tcp);
    assert_eq!(s.local_addr(), Some(addr));
    let c = Endpoint::open(tcp()).unwrap();
    let peer = c
        .connect(format!("localhost:{}", addr.port()), WAIT)
        .unwrap();
    assert_eq!(c.peer_addr(peer).map(|a| a.port()), Some(addr.port()));
    for i in 0..100u32 {
        c.send(peer, &i.to_le_bytes().repeat(i as usize + 1))
            .unwrap();
    }
    let Event::Connected {
        peer: from,
        addr: seen,
    } = s.next_event(WAIT).unwrap()
    else {
        panic!("the connection comes first");
    };
    assert!(seen.ip().is_loopback());
    assert_eq!(s.peers(), vec![(from, seen)]);
    for i in 0..100u32 {
        let m = s.recv(WAIT).unwrap();
        assert_eq!(m.peer(), from);
        assert_eq!(m.memory(), MemKind::Host);
        assert_eq!(m.device_ptr(), None, "host memory has no kernel address");
        assert_eq!(
            m.bytes().unwrap(),
            &i.to_le_bytes().repeat(i as usize + 1)[..]
        );
    }
    let bytes: u64 = (1..=100u64).map(|n| 4 * n).sum();
    let got = s.stats(from).unwrap();
    assert_eq!((got.messages_received, got.bytes_received), (100, bytes));
    assert_eq!((got.addr, got.errors), (seen, 0));
    let sent = c.stats(peer).unwrap();
    assert_eq!((sent.messages_sent, sent.bytes_sent), (100, bytes));
}

#[test]
fn a_clean_close_is_an_event_on_both_sides_and_ends_the_event_stream() {
    let (s, addr) = server();
    let c = Endpoint::open(tcp()).unwrap();
    let peer = c.connect(addr, WAIT).unwrap();
    c.send(peer, b"bye").unwrap();
    c.close(WAIT).unwrap();
    let s = Arc::new(s);
    let events: Vec<Event> = {
        let s2 = Arc::clone(&s);
        let t = std::thread::spawn(move || {
            let mut v = Vec::new();
            for e in s2.events() {
                let e = e.unwrap();
                let closed = matches!(e, Event::Closed { .. });
                v.push(e);
                if closed {
                    s2.close(WAIT).unwrap();
                }
            }
            v
        });
        t.join().unwrap()
    };
    assert!(matches!(events[0], Event::Connected { .. }), "{events:?}");
    assert!(matches!(&events[1], Event::Message(m) if m.bytes() == Some(&b"bye"[..])));
    let Event::Closed { addr: Some(a), .. } = &events[2] else {
        panic!("a clean close naming the peer: {events:?}");
    };
    assert!(a.ip().is_loopback());
    assert_eq!(events.len(), 3, "the stream ends once closed: {events:?}");
    // The client hears the server's answering Close.
    match c.next_event(WAIT).unwrap() {
        Event::Closed { peer: p, addr } => assert_eq!((p, addr), (peer, Some(addr.unwrap()))),
        e => panic!("expected the server's close, got {e:?}"),
    }
    assert!(s.peers().is_empty());
}

#[test]
fn a_lost_peer_is_an_event_and_an_error_that_name_its_address() {
    let (s, addr) = server();
    let c = Endpoint::open(tcp()).unwrap();
    let peer = c.connect(addr, WAIT).unwrap();
    c.send(peer, b"then I die").unwrap();
    let Event::Connected { addr: from, .. } = s.next_event(WAIT).unwrap() else {
        panic!("a connection first");
    };
    let Event::Message(_) = s.next_event(WAIT).unwrap() else {
        panic!("its message");
    };
    drop(c); // no close: the connection just ends
    let Event::Lost { addr, why, .. } = next_non_connect(&s) else {
        panic!("expected the peer lost");
    };
    assert_eq!(addr, Some(from));
    let text = why.to_string();
    assert!(
        text.contains(&from.to_string()) && text.contains("went away"),
        "{text}"
    );
    assert!(s.peers().is_empty());
}

/// An endpoint's peer limits reach its wire: past them a newcomer is
/// refused, and its connect says so.
#[test]
fn a_newcomer_past_the_listeners_peer_limits_is_told_it_was_refused() {
    let mut config = tcp();
    config.peer_limits = zerohop::PeerLimits {
        accepted: 1,
        per_address: 1,
    };
    // Its peer quiet an idle timeout would be let go for a newcomer.
    config.idle_timeout = Duration::from_secs(60);
    let s = Endpoint::open(config).unwrap();
    let addr = s.listen("127.0.0.1:0").unwrap();
    let kept = Endpoint::open(tcp()).unwrap();
    let peer = kept.connect(addr, WAIT).unwrap();
    kept.send(peer, b"kept").unwrap();
    let Event::Message(m) = next_non_connect(&s) else {
        panic!("the kept peer's message");
    };
    assert_eq!(m.bytes(), Some(&b"kept"[..]));
    let late = Endpoint::open(tcp()).unwrap();
    let e = late.connect(addr, WAIT).unwrap_err();
    assert!(
        matches!(e.connect_error(), Some(ConnectError::Refused)),
        "the newcomer was taken, or not told why: {e:?}"
    );
    assert!(e.to_string().contains("refused"), "{e}");
    assert!(late.peers().is_empty());
    assert_eq!(s.peers().len(), 1);
}

#[test]
fn a_message_longer_than_the_peer_takes_fails_at_the_sender_naming_the_limit() {
    let mut small = tcp();
    small.pool_bytes = 1 << 20; // so max_message defaults to 1 MiB
    let s = Endpoint::open(small).unwrap();
    assert_eq!(s.max_message(), 1 << 20);
    let addr = s.listen("127.0.0.1:0").unwrap();
    let c = Endpoint::open(tcp()).unwrap();
    let peer = c.connect(addr, WAIT).unwrap();
    let e = c.send(peer, &vec![0u8; (1 << 20) + 1]).unwrap_err();
    let Error::TooLarge {
        len,
        max,
        addr: Some(at),
    } = e
    else {
        panic!("expected TooLarge, got {e:?}");
    };
    assert_eq!((len, max, at), ((1 << 20) + 1, 1 << 20, addr));
    let text = e.to_string();
    assert!(
        text.contains("1048577")
            && text.contains(&addr.to_string())
            && text.contains("receive pool"),
        "{text}"
    );
    assert_eq!(c.stats(peer).unwrap().errors, 1);
    // What fits still goes.
    c.send(peer, &vec![7u8; 1 << 20]).unwrap();
    let m = s.recv(WAIT).unwrap();
    assert_eq!(m.len(), 1 << 20);
    // The limit is the receiver's: the small side sends the larger side
    // what it could not take itself (its own limit was checked as well,
    // and the refusal named the peer).
    let back = m.peer();
    s.send(back, &vec![9u8; 4 << 20]).unwrap();
    assert_eq!(c.recv(WAIT).unwrap().len(), 4 << 20);
}

#[test]
fn a_limit_larger_than_the_pool_is_refused_at_open() {
    let mut c = tcp();
    c.pool_bytes = 1 << 20;
    c.max_message = Some(4 << 20);
    let e = Endpoint::open(c).unwrap_err();
    assert!(matches!(e, Error::BadConfig(_)), "{e:?}");
    assert!(e.to_string().contains("pool"), "{e}");
}

#[test]
fn connecting_where_nobody_listens_or_to_a_stranger_is_a_clear_error() {
    let c = Endpoint::open(tcp()).unwrap();
    // Nobody listens: a port just freed.
    let free = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let e = c.connect(free, WAIT).unwrap_err();
    assert!(
        matches!(e.connect_error(), Some(ConnectError::Unreachable(io))
            if io.kind() == std::io::ErrorKind::ConnectionRefused),
        "{e:?}"
    );
    assert!(e.to_string().contains(&free.to_string()), "{e}");
    // A name that does not resolve.
    let e = c.connect("no-such-host.invalid:7470", WAIT).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Address {
                op: "connect to",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .starts_with("connect to no-such-host.invalid:7470"),
        "{e}"
    );
    // A listener that speaks something else: refused, with why, not a hang.
    let stranger = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = stranger.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = stranger.accept().unwrap();
        let mut hello = [0u8; 32];
        let _ = s.read_exact(&mut hello);
        s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n......")
            .unwrap();
        std::thread::sleep(Duration::from_millis(200));
    });
    let t0 = Instant::now();
    let e = c.connect(at, WAIT).unwrap_err();
    assert!(
        t0.elapsed() < WAIT / 2,
        "refused at once, not at the timeout"
    );
    assert!(
        matches!(e.connect_error(), Some(ConnectError::Protocol(_))),
        "{e:?}"
    );
    assert!(e.to_string().contains("broke the protocol"), "{e}");
    t.join().unwrap();
    // A zerohop of another version: our own Hello sent back under a later
    // version number (the version is read before anything else in it).
    let newer = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = newer.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = newer.accept().unwrap();
        let mut hello = [0u8; 32];
        s.read_exact(&mut hello).unwrap();
        let ours = hello[2];
        hello[2] = ours + 1;
        s.write_all(&hello).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        ours
    });
    let e = c.connect(at, WAIT).unwrap_err();
    let ours = t.join().unwrap();
    match e.connect_error() {
        Some(&ConnectError::Version { ours: o, theirs }) => {
            assert_eq!((o, theirs), (ours, ours + 1), "{e}")
        }
        _ => panic!("another version, told as {e:?}"),
    }
    let text = e.to_string();
    assert!(
        text.contains(&format!("version {}", ours + 1)) && text.contains(&ours.to_string()),
        "{text}"
    );
    // A listener that accepts and says nothing: the timeout, named, and
    // our end of the connection closed (no half-open peer left behind).
    let mute = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = mute.local_addr().unwrap();
    let hung_up = std::thread::spawn(move || {
        let (mut s, _) = mute.accept().unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        let mut sink = Vec::new();
        // Our Hello, then the end of the stream once we let go.
        s.read_to_end(&mut sink).map(|_| sink.len())
    });
    let e = c.connect(at, Duration::from_millis(300)).unwrap_err();
    assert!(
        matches!(e.connect_error(), Some(ConnectError::NoAnswer)),
        "{e:?}"
    );
    assert!(e.to_string().contains("no answer"), "{e}");
    assert!(
        matches!(hung_up.join().unwrap(), Ok(32..)),
        "our side closed after its Hello"
    );
    assert!(c.peers().is_empty());
    // The same where the wire's handshake timeout (`idle_timeout`) runs out
    // before the connect's: still no answer, not a broken protocol.
    let mut quick = tcp();
    quick.idle_timeout = Duration::from_millis(200);
    let c = Endpoint::open(quick).unwrap();
    let mute = TcpListener::bind("127.0.0.1:0").unwrap();
    let e = c.connect(mute.local_addr().unwrap(), WAIT).unwrap_err();
    assert!(
        matches!(e.connect_error(), Some(ConnectError::NoAnswer)),
        "{e:?}"
    );
}

/// A connect told to wait for ever (`Duration::MAX`) waits as long as it
/// must: no deadline arithmetic overflows.
#[test]
fn a_connect_may_wait_for_ever() {
    let s = Endpoint::open(tcp()).unwrap();
    let addr = s.listen("127.0.0.1:0").unwrap();
    let c = Endpoint::open(tcp()).unwrap();
    let peer = c.connect(addr, Duration::MAX).unwrap();
    c.send(peer, b"ever").unwrap();
    let Event::Message(m) = next_non_connect(&s) else {
        panic!("the message");
    };
    assert_eq!(m.bytes(), Some(&b"ever"[..]));
}

/// A name with several addresses: each is tried, the error lists each, and
/// the typed reason is the one that got furthest (a listener's answer over
/// a port where nothing listens).
#[test]
fn a_connect_tried_at_several_addresses_reports_each_and_types_the_furthest() {
    let mut config = tcp();
    config.peer_limits = zerohop::PeerLimits {
        accepted: 1,
        per_address: 1,
    };
    // Its peer quiet an idle timeout would be let go for a newcomer.
    config.idle_timeout = Duration::from_secs(60);
    let s = Endpoint::open(config).unwrap();
    let full = s.listen("127.0.0.1:0").unwrap();
    let kept = Endpoint::open(tcp()).unwrap();
    kept.connect(full, WAIT).unwrap();
    let free = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    // A name that resolves to both: `ToSocketAddrs` on a slice.
    let both = [free, full];
    let shown = format!("{free},{full}");
    struct Name<'a>(&'a [SocketAddr], &'a str);
    impl<'a> std::net::ToSocketAddrs for Name<'a> {
        type Iter = std::iter::Copied<std::slice::Iter<'a, SocketAddr>>;
        fn to_socket_addrs(&self) -> std::io::Result<Self::Iter> {
            Ok(self.0.iter().copied())
        }
    }
    impl std::fmt::Display for Name<'_> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.1)
        }
    }
    let c = Endpoint::open(tcp()).unwrap();
    // Either way round: the furthest, not the last.
    let e = c.connect(Name(&[full, free], &shown), WAIT).unwrap_err();
    assert!(
        matches!(e.connect_error(), Some(ConnectError::Refused)),
        "the furthest, tried first: {e:?}"
    );
    let e = c.connect(Name(&both, &shown), WAIT).unwrap_err();
    let Error::Connect { addr, tried } = &e else {
        panic!("{e:?}");
    };
    assert_eq!(addr, &shown);
    let at: Vec<SocketAddr> = tried.iter().map(|(a, _)| *a).collect();
    assert_eq!(at, both, "each address tried, in order");
    assert!(matches!(tried[0].1, ConnectError::Unreachable(_)), "{e:?}");
    assert!(
        matches!(e.connect_error(), Some(ConnectError::Refused)),
        "the furthest: {e:?}"
    );
    let text = e.to_string();
    assert!(
        text.contains(&format!("{free}: no connection"))
            && text.contains(&format!("{full}: refused")),
        "{text}"
    );
    assert!(
        std::error::Error::source(&e).is_some_and(|s| s.to_string().starts_with("refused")),
        "the source is the furthest attempt's"
    );
}

#[test]
fn an_explicit_transport_this_host_cannot_run_names_what_is_missing() {
    // Automatic takes the best this host runs (shm without a GPU: TCP with
    // its same-host peers in shared memory; uma on a GPU host) and says why
    // each faster one was skipped; asked for explicitly, each of those is
    // an error naming it. No machine we test on has an RDMA device.
    let mut config = tcp();
    config.transport = Preference::Auto;
    let auto = Endpoint::open(config).unwrap();
    assert!(
        matches!(auto.kind(), Kind::Shm | Kind::Uma),
        "{:?}",
        auto.kind()
    );
    let skipped: Vec<Kind> = auto
        .choice()
        .skipped()
        .map(|s| match *s {
            Skipped::NotCompiled(k) | Skipped::Missing(k, _) => k,
        })
        .collect();
    assert!(
        skipped.contains(&Kind::Rdma) && skipped.contains(&Kind::Gpudirect),
        "{skipped:?}"
    );
    assert_eq!(
        skipped.contains(&Kind::Uma),
        auto.kind() == Kind::Shm,
        "uma is skipped exactly where it was not taken"
    );
    for kind in skipped {
        let e = Endpoint::open(Config::only(kind)).unwrap_err();
        assert!(matches!(e, Error::Unavailable(_)), "{kind}: {e:?}");
        assert!(e.to_string().contains(kind.name()), "{e}");
    }
}

#[test]
fn one_endpoint_listens_and_connects_to_many_peers_at_once() {
    const N: usize = 5;
    let nodes: Vec<(Endpoint, SocketAddr)> = (0..N).map(|_| server()).collect();
    // Each node connects to every node after it: a full mesh.
    let mut out = vec![Vec::new(); N];
    for (i, (e, _)) in nodes.iter().enumerate() {
        for (_, addr) in &nodes[i + 1..] {
            out[i].push(e.connect(addr, WAIT).unwrap());
        }
    }
    for (i, (e, _)) in nodes.iter().enumerate() {
        for p in &out[i] {
            e.send(*p, format!("from {i}").as_bytes()).unwrap();
        }
    }
    // Node j hears from every i < j.
    for (j, (e, _)) in nodes.iter().enumerate() {
        let mut heard: Vec<String> = (0..j)
            .map(|_| String::from_utf8(e.recv(WAIT).unwrap().bytes().unwrap().to_vec()).unwrap())
            .collect();
        heard.sort();
        let want: Vec<String> = (0..j).map(|i| format!("from {i}")).collect();
        assert_eq!(heard, want, "node {j}");
        assert_eq!(e.peers().len(), N - 1, "node {j} knows every other node");
    }
}

#[test]
fn buffers_are_filled_in_place_and_a_received_one_is_echoed_without_a_copy() {
    let (s, addr) = server();
    let mut config = tcp();
    config.progress_thread = false; // caller-driven: the calls below do the work
    let c = Endpoint::open(config).unwrap();
    let peer = c.connect(addr, WAIT).unwrap();
    let mut b = c.lease(4096).unwrap();
    b.bytes_mut().unwrap().fill(0x5A);
    b.set_len(1000).unwrap();
    c.send_buffer(peer, b).unwrap();
    let m = s.recv(WAIT).unwrap();
    assert_eq!(m.bytes().unwrap(), &[0x5A; 1000][..]);
    let from = m.peer();
    s.send_buffer(from, m.into_buffer()).unwrap();
    let echo = c.recv(WAIT).unwrap();
    assert_eq!(echo.bytes().unwrap(), &[0x5A; 1000][..]);
    let mut head = [0u8; 4];
    c.copy_out(&echo, &mut head).unwrap();
    assert_eq!(head, [0x5A; 4]);
    assert!(
        c.copy_out(&echo, &mut [0u8; 2000]).is_err(),
        "more than the message"
    );
}

#[test]
fn a_zero_copy_sender_that_outruns_its_pool_waits_for_buffers_and_nothing_is_lost() {
    let (s, addr) = server();
    let mut config = tcp();
    config.pool_bytes = 4 << 20; // two chunks: the queue holds all of it soon
    let c = Endpoint::open(config).unwrap();
    let peer = c.connect(addr, WAIT).unwrap();
    const N: u32 = 8000; // 32 MiB of 4 KiB leases: eight pools' worth
    std::thread::scope(|scope| {
        let reader = scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(200)); // the sender runs dry first
            for i in 0..N {
                let m = match next_non_connect(&s) {
                    Event::Message(m) => m,
                    e => panic!("message {i}: {e:?}"),
                };
                let b = m.bytes().unwrap();
                assert_eq!(b.len(), 4096);
                assert_eq!(b[..4], i.to_le_bytes(), "message {i} in order");
            }
        });
        for i in 0..N {
            // `lease` fails with the pool's error once the queued sends
            // hold every buffer; this one waits for them to go out.
            let mut b = c
                .lease_timeout(4096, WAIT)
                .unwrap_or_else(|e| panic!("lease {i}: {e}"));
            b.bytes_mut().unwrap()[..4].copy_from_slice(&i.to_le_bytes());
            c.send_buffer(peer, b).unwrap();
        }
        reader.join().unwrap();
    });
    let t0 = Instant::now();
    assert!(
        c.lease_timeout(8 << 20, WAIT).is_err(),
        "more than the whole pool"
    );
    assert!(t0.elapsed() < WAIT / 2, "said at once, not at the deadline");
}

/// A gossip node's day: a burst of small messages held at once (every
/// buffer descriptor of the pool), then a block. The small buffers came
/// back, but their descriptors stayed with the small size class: the block's
/// lease failed ("too many buffers") for the life of the endpoint.
#[test]
fn a_burst_of_small_buffers_held_at_once_does_not_starve_a_large_one_later() {
    let mut config = tcp();
    config.progress_thread = false;
    let e = Endpoint::open(config).unwrap();
    let mut small = Vec::new();
    let refused = loop {
        match e.lease(64) {
            Ok(b) => small.push(b),
            Err(err) => break err,
        }
        assert!(small.len() <= 1 << 20, "the pool bounds its buffers");
    };
    assert!(
        refused.to_string().contains("buffer descriptors"),
        "the pool's own limit, typed: {refused}"
    );
    // Every descriptor held by a live lease: the large class is refused too.
    assert!(e.lease(64 << 10).is_err());
    let held = small.len();
    small.clear();
    let large = e
        .lease(64 << 10)
        .unwrap_or_else(|err| panic!("after {held} small buffers came back: {err}"));
    assert_eq!(large.len(), 64 << 10);
    // And small ones again, as many as before but the block's share.
    drop(large);
    let again: Vec<_> = (0..held / 2).map(|_| e.lease(64).unwrap()).collect();
    assert_eq!(again.len(), held / 2);
}

#[test]
fn a_recv_with_nothing_to_read_times_out_and_the_endpoint_goes_on() {
    let (s, addr) = server();
    let t0 = Instant::now();
    let e = s.recv(Duration::from_millis(100)).unwrap_err();
    assert!(e.is_timeout(), "{e:?}");
    assert!(t0.elapsed() >= Duration::from_millis(100));
    let c = Endpoint::open(tcp()).unwrap();
    let peer = c.connect(addr, WAIT).unwrap();
    c.send(peer, b"late").unwrap();
    assert_eq!(s.recv(WAIT).unwrap().bytes(), Some(&b"late"[..]));
}

/// A node that is behind on reading (its inbox full: 4 096 unread) still
/// connects to a new peer: the newcomer's Hello is not a message, and a full
/// inbox is no reason to report that the newcomer did not answer.
fn connect_with_a_full_inbox(case: &str, config: fn() -> Config) {
    let a = Endpoint::open(config()).unwrap();
    let a_addr = a.listen("127.0.0.1:0").unwrap();
    const N: u32 = 5000; // past the inbox's 4 096 messages
    const LEN: usize = 512;
    let sender = std::thread::spawn(move || {
        let b = Endpoint::open(config()).unwrap();
        let to_a = b.connect(a_addr, WAIT).unwrap();
        for i in 0..N {
            b.send(to_a, &i.to_le_bytes().repeat(LEN / 4)).unwrap();
        }
        b
    });
    // `a` accepts and reads what it can without taking it, until its inbox
    // is full (the sender stays blocked from then on).
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        a.progress().unwrap();
    }
    // The newcomer answers by itself (`a` is the one under test).
    let mut answers = config();
    answers.progress_thread = true;
    let c = Endpoint::open(answers).unwrap();
    let c_addr = c.listen("127.0.0.1:0").unwrap();
    let to_c = a.connect(c_addr, Duration::from_secs(3));
    assert!(to_c.is_ok(), "{case}: {to_c:?}");
    // Nothing of the backlog was lost or reordered meanwhile.
    let mut got = 0;
    while got < N {
        match a.next_event(WAIT).unwrap() {
            Event::Message(m) => {
                assert_eq!(
                    &m.bytes().unwrap()[..4],
                    &got.to_le_bytes(),
                    "{case}: message {got}"
                );
                assert_eq!(m.len(), LEN);
                got += 1;
            }
            Event::Connected { .. } => {}
            ev => panic!("{ev:?}"),
        }
    }
    a.send(to_c.unwrap(), b"hello").unwrap();
    assert_eq!(c.recv(WAIT).unwrap().bytes().unwrap(), b"hello");
    drop(sender.join().unwrap());
}

#[test]
fn a_connect_is_answered_while_unread_messages_fill_the_inbox() {
    connect_with_a_full_inbox("tcp", tcp);
    connect_with_a_full_inbox("tcp, caller-driven", tcp_caller_driven);
    connect_with_a_full_inbox("shm", shm);
}

/// This thread's CPU time (user and system), from /proc.
fn thread_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
    // The fields after the command's closing parenthesis: utime and stime
    // are the 12th and 13th, in clock ticks (100 a second on Linux).
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<u64> = rest
        .split(' ')
        .skip(11)
        .take(2)
        .map(|v| v.parse().unwrap())
        .collect();
    Duration::from_millis((f[0] + f[1]) * 10)
}

/// A connect that waits for an answer sleeps while messages that came
/// meanwhile wait unread: they are for a later `recv`, not for this wait.
fn a_connect_sleeps_beside_unread_messages(case: &str, config: fn() -> Config) {
    let mut answers = config();
    answers.progress_thread = true;
    let a = Endpoint::open(answers).unwrap();
    let a_addr = a.listen("127.0.0.1:0").unwrap();
    let c = Endpoint::open(config()).unwrap();
    let to_a = c.connect(a_addr, WAIT).unwrap();
    // Unread by `c` until after its second connect.
    a.send(next_peer(&a), b"unread").unwrap();
    let until = Instant::now() + Duration::from_millis(500);
    while Instant::now() < until {
        c.progress().unwrap();
    }
    let mute = TcpListener::bind("127.0.0.1:0").unwrap();
    const WAITED: Duration = Duration::from_secs(1);
    let cpu = thread_cpu();
    let e = c.connect(mute.local_addr().unwrap(), WAITED).unwrap_err();
    let used = thread_cpu() - cpu;
    assert!(
        matches!(e.connect_error(), Some(ConnectError::NoAnswer)),
        "{case}: {e:?}"
    );
    assert!(
        used < WAITED / 4,
        "{case}: the connect spun: {used:?} of CPU in {WAITED:?}"
    );
    let m = c.recv(WAIT).unwrap();
    assert_eq!((m.peer(), m.bytes().unwrap()), (to_a, &b"unread"[..]));
}

/// The peer of the next connection `e` hears of.
fn next_peer(e: &Endpoint) -> zerohop::Peer {
    match e.next_event(WAIT).unwrap() {
        Event::Connected { peer, .. } => peer,
        ev => panic!("{ev:?}"),
    }
}

#[test]
fn a_connect_sleeps_while_earlier_messages_wait_unread() {
    a_connect_sleeps_beside_unread_messages("tcp", tcp);
    a_connect_sleeps_beside_unread_messages("tcp, caller-driven", tcp_caller_driven);
    a_connect_sleeps_beside_unread_messages("shm", shm);
}

/// A close that waits for a peer's answering Close sleeps while messages
/// that came before wait unread (they are for `recv`, after or beside it).
fn a_close_sleeps_beside_unread_messages(case: &str, config: fn() -> Config) {
    let a = Endpoint::open(config()).unwrap();
    let a_addr = a.listen("127.0.0.1:0").unwrap();
    // `b` sends and answers by itself; `mute` connects, then never calls
    // again, so its answering Close never comes.
    let mut answers = config();
    answers.progress_thread = true;
    let b = Endpoint::open(answers).unwrap();
    let mut silent = config();
    silent.progress_thread = false;
    let mute = Endpoint::open(silent).unwrap();
    std::thread::scope(|s| {
        let to_a = s.spawn(|| b.connect(a_addr, WAIT).unwrap());
        let muted = s.spawn(|| mute.connect(a_addr, WAIT).unwrap());
        while !(to_a.is_finished() && muted.is_finished()) {
            a.progress().unwrap();
        }
        b.send(to_a.join().unwrap(), b"unread").unwrap();
        muted.join().unwrap();
    });
    let until = Instant::now() + Duration::from_millis(500);
    while Instant::now() < until {
        a.progress().unwrap();
    }
    const WAITED: Duration = Duration::from_secs(1);
    let cpu = thread_cpu();
    let closed = a.close(WAITED);
    let used = thread_cpu() - cpu;
    assert!(
        closed.as_ref().is_err_and(Error::is_timeout),
        "{case}: {closed:?}"
    );
    assert!(
        used < WAITED / 4,
        "{case}: the close spun: {used:?} of CPU in {WAITED:?}"
    );
    // What came before the close is still there to read.
    let mut read = false;
    while let Ok(ev) = a.next_event(Duration::from_millis(100)) {
        read |= matches!(&ev, Event::Message(m) if m.bytes() == Some(&b"unread"[..]));
    }
    assert!(read, "{case}: the message sent before the close was lost");
}

#[test]
fn a_close_sleeps_while_earlier_messages_wait_unread() {
    a_close_sleeps_beside_unread_messages("tcp", tcp);
    a_close_sleeps_beside_unread_messages("tcp, caller-driven", tcp_caller_driven);
    a_close_sleeps_beside_unread_messages("shm", shm);
}

/// A listener that takes the connection and hangs up before any Hello:
/// the connect fails at once, and says so, over tcp as over shm (whose
/// side waits for a same-host answer that can no longer come).
#[test]
fn a_listener_that_hangs_up_before_its_hello_fails_the_connect_at_once() {
    for (case, config) in [("tcp", tcp()), ("shm", shm())] {
        let c = Endpoint::open(config).unwrap();
        let rude = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = rude.local_addr().unwrap();
        let hangs_up = std::thread::spawn(move || {
            let (mut s, _) = rude.accept().unwrap();
            // Our Hello first, so the end is not a reset.
            let _ = s.read(&mut [0u8; 64]);
            drop(s);
        });
        let started = Instant::now();
        let e = c.connect(at, Duration::from_secs(5)).unwrap_err();
        let took = started.elapsed();
        hangs_up.join().unwrap();
        assert!(
            matches!(e.connect_error(), Some(ConnectError::HungUp)),
            "{case}: {e:?}"
        );
        assert!(e.to_string().contains("hung up"), "{case}: {e}");
        assert!(took < Duration::from_secs(2), "{case}: waited {took:?}");
        assert!(c.peers().is_empty(), "{case}");
    }
}

/// A refusal of a connect's Hello is the connect's to report, even while
/// another thread reads the same endpoint's events: that thread hears
/// nothing of a peer it never had.
fn refusal_beside_a_reader(case: &str, config: fn() -> Config) {
    let mut limited = config();
    limited.peer_limits = zerohop::PeerLimits {
        accepted: 1,
        per_address: 1,
    };
    limited.idle_timeout = Duration::from_secs(60); // none let go for a newcomer
    let s = Endpoint::open(limited).unwrap();
    let addr = s.listen("127.0.0.1:0").unwrap();
    let kept = Endpoint::open(config()).unwrap();
    kept.connect(addr, WAIT).unwrap();
    let late = Arc::new(Endpoint::open(config()).unwrap());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (late, stop) = (Arc::clone(&late), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut heard = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match late.next_event(Duration::from_millis(20)) {
                    Ok(ev) => heard.push(format!("{ev:?}")),
                    Err(e) if e.is_timeout() => {}
                    Err(e) => heard.push(format!("{e:?}")),
                }
            }
            heard
        })
    };
    for i in 0..20 {
        let e = late.connect(addr, WAIT).unwrap_err();
        assert!(
            matches!(e.connect_error(), Some(ConnectError::Refused)),
            "{case}, attempt {i}: {e:?}"
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let heard = reader.join().unwrap();
    assert!(
        heard.is_empty(),
        "{case}: the reader heard of peers it never had: {heard:?}"
    );
}

#[test]
fn a_refusal_reaches_the_connect_while_another_thread_reads_events() {
    refusal_beside_a_reader("tcp", tcp);
    refusal_beside_a_reader("shm", shm);
}

/// Several threads take one endpoint's events while peers come and go at
/// once: the address book ends as the peers did, empty (a peer's end taken
/// by one thread before another recorded its arrival left it there).
#[test]
fn the_address_book_follows_peers_that_come_and_go_under_several_readers() {
    let (s, addr) = server();
    let s = Arc::new(s);
    const PEERS: usize = 200;
    let ends = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let readers: Vec<_> = (0..4)
        .map(|_| {
            let (s, ends) = (Arc::clone(&s), Arc::clone(&ends));
            std::thread::spawn(move || {
                while ends.load(std::sync::atomic::Ordering::SeqCst) < PEERS {
                    match s.next_event(Duration::from_millis(20)) {
                        Ok(Event::Closed { .. } | Event::Lost { .. }) => {
                            ends.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                        Ok(_) => {}
                        Err(e) if e.is_timeout() => {}
                        Err(e) => panic!("{e:?}"),
                    }
                }
            })
        })
        .collect();
    let mut c = tcp();
    c.progress_thread = false;
    for i in 0..PEERS {
        let e = Endpoint::open(c).unwrap();
        e.connect(addr, WAIT).unwrap();
        // Gone at once: half with a Close, half lost.
        if i % 2 == 0 {
            let _ = e.close(Duration::from_millis(200));
        }
    }
    let until = Instant::now() + WAIT;
    while ends.load(std::sync::atomic::Ordering::SeqCst) < PEERS && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    ends.fetch_add(PEERS, std::sync::atomic::Ordering::SeqCst); // the readers stop
    for r in readers {
        r.join().unwrap();
    }
    assert_eq!(s.peers(), vec![], "peers that had gone are still listed");
}

/// A closed endpoint takes no new peers: a listen after `close` is refused
/// as closed (peers accepted then would keep it from ever finishing).
#[test]
fn a_closed_endpoint_refuses_to_listen() {
    for config in [tcp(), shm()] {
        let e = Endpoint::open(config).unwrap();
        e.close(WAIT).unwrap();
        let r = e.listen("127.0.0.1:0");
        assert!(r.as_ref().is_err_and(Error::is_closed), "{r:?}");
        assert_eq!(e.local_addr(), None);
    }
}
