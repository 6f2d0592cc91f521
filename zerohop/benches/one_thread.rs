//! What the library's own code costs per message, with no waiting in it:
//! one thread drives both endpoints of a connection (send, receive, echo the
//! buffer back, receive), so every nanosecond is bookkeeping, copies and
//! system calls, never a peer's core. On a noisy machine the time moves;
//! the instructions do not: `scripts/count-instructions` runs this under
//! callgrind at two lengths and prints the user-space instructions per
//! one-way message (the difference, so start-up drops out).
//!
//! With IDLE_PEERS, that many more endpoints connect to the server first
//! and then say nothing: what each connected peer adds to a message's cost.
//!
//! `cargo bench -p zerohop --bench one_thread -- [shm|tcp|rdma] [ROUND_TRIPS] [IDLE_PEERS]`

use std::time::{Duration, Instant};

use zerohop::{Config, Endpoint, Event, Kind};

const WAIT: Duration = Duration::from_secs(10);
const WARMUP: usize = 1000;

fn open(kind: Kind) -> Endpoint {
    let mut c = Config::only(kind);
    c.pool_bytes = 64 << 20;
    // The caller drives both ends: no thread of the endpoint's own.
    c.progress_thread = false;
    Endpoint::open(c).expect("open an endpoint")
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let kind = match args.first().map(String::as_str) {
        None | Some("shm") => Kind::Shm,
        Some("tcp") => Kind::Tcp,
        // Needs the `gpudirect-verbs` feature and an RDMA device (the rxe VM).
        Some("rdma") => Kind::Rdma,
        Some(other) => panic!("one_thread: a transport, shm, tcp or rdma, not {other}"),
    };
    let round_trips: usize = args.get(1).map_or(200_000, |n| n.parse().expect("a count"));
    let idle: usize = args.get(2).map_or(0, |n| n.parse().expect("a count"));
    let server = open(kind);
    // RDMA listens on its device's address (the rxe VM's: RXE_ADDR).
    let host = std::env::var("RXE_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
    let addr = server.listen(format!("{host}:0")).expect("listen");
    let idle_peers: Vec<Endpoint> = (0..idle)
        .map(|_| {
            let e = open(kind);
            std::thread::scope(|s| {
                let accepting = s.spawn(|| loop {
                    if let Event::Connected { .. } = server.next_event(WAIT).expect("accept") {
                        return;
                    }
                });
                e.connect(addr, WAIT).expect("connect an idle peer");
                accepting.join().expect("the accepting thread");
            });
            e
        })
        .collect();
    let client = open(kind);
    // The listener must be polled while the client connects.
    let (peer, from) = std::thread::scope(|s| {
        let accepted = s.spawn(|| loop {
            if let Event::Connected { peer, .. } = server.next_event(WAIT).expect("accept") {
                return peer;
            }
        });
        let peer = client.connect(addr, WAIT).expect("connect");
        (peer, accepted.join().expect("the accepting thread"))
    });
    let message = [0xA5u8; 64];
    // ZERO_COPY=1: the client sends a leased buffer filled in place, as
    // `perf --zero-copy` does, instead of copying its bytes.
    let zero_copy = std::env::var_os("ZERO_COPY").is_some_and(|v| v == "1");
    let round_trip = || {
        if zero_copy {
            let mut b = client.lease_timeout(64, WAIT).expect("lease");
            b.bytes_mut()
                .expect("host memory")
                .copy_from_slice(&message);
            client.send_buffer(peer, b).expect("send");
        } else {
            client.send(peer, &message).expect("send");
        }
        let m = server.recv(WAIT).expect("receive");
        server.send_buffer(from, m.into_buffer()).expect("echo");
        let echo = client.recv(WAIT).expect("receive the echo");
        assert_eq!(echo.len(), message.len());
    };
    for _ in 0..WARMUP {
        round_trip();
    }
    // EMPTY_POLLS=N: N receives that find nothing (each a spin of the
    // endpoint's clock interval, then one clock read) instead of the round
    // trips: what a receiver's spin costs a look.
    if let Some(n) = std::env::var("EMPTY_POLLS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        for _ in 0..n {
            assert!(server.recv(Duration::ZERO).is_err());
        }
        return;
    }
    let t0 = Instant::now();
    for _ in 0..round_trips {
        round_trip();
    }
    let per_message = t0.elapsed().as_secs_f64() * 1e6 / (2 * round_trips) as f64;
    println!(
        "{}: 64 B, {round_trips} round trips in one thread, {} idle peers: {per_message:.3} us per one-way message (send and receive)",
        kind.name(),
        idle_peers.len()
    );
}
