//! What the facade costs over the endpoint it drives: the same ping-pong
//! (64 B) and stream (64 KiB) over TCP on loopback, through
//! `zerohop::Endpoint` and straight through `zerohop_std::Endpoint`, in
//! alternating rounds of one run; medians and their ratio.
//!
//! `cargo bench -p zerohop --bench facade [-- ROUNDS]` (default 7)

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use zerohop_core::{Kind, PeerId};
use zerohop_std::tcp::{TcpConfig, TcpTransport};
use zerohop_std::{private_pool, Deadline, Endpoint as Driven, EndpointConfig};

const PINGS: usize = 20_000;
const STREAM: usize = 20_000;
const BIG: usize = 64 << 10;
const WAIT: Duration = Duration::from_secs(30);
/// Busy-polling throughout, as `zerohop perf` and ucx_perftest wait.
const SPIN: Duration = Duration::from_secs(1);

/// One round's figures: one-way 64 B latency p50 (µs) and 64 KiB GB/s.
type Figures = (f64, f64);

fn p50(mut rtts: Vec<Duration>) -> f64 {
    rtts.sort_unstable();
    rtts[rtts.len() / 2].as_secs_f64() * 1e6 / 2.0
}

fn direct_round() -> Figures {
    let driven = EndpointConfig {
        spin: SPIN,
        progress_thread: false,
        ..EndpointConfig::default()
    };
    let mut st = TcpTransport::new(
        private_pool(256 << 20).unwrap(),
        TcpConfig::default(),
        Kind::Tcp,
    )
    .unwrap();
    let addr: SocketAddr = st.listen("127.0.0.1:0").unwrap();
    let server = Driven::new(
        st,
        EndpointConfig {
            progress_thread: true,
            ..driven
        },
    )
    .unwrap();
    let mut ct = TcpTransport::new(
        private_pool(256 << 20).unwrap(),
        TcpConfig::default(),
        Kind::Tcp,
    )
    .unwrap();
    let peer: PeerId = ct.connect(addr, WAIT).unwrap();
    let client = Driven::new(ct, driven).unwrap();
    client.wait_open(peer, Deadline::after(WAIT)).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..PINGS {
                let m = server.recv(Deadline::after(WAIT), None).unwrap();
                server
                    .send_lease(m.peer, m.lease, Deadline::after(WAIT), None)
                    .unwrap();
            }
            let mut from = None;
            for _ in 0..STREAM {
                from = Some(server.recv(Deadline::after(WAIT), None).unwrap().peer);
            }
            server
                .send(from.unwrap(), b"done", Deadline::after(WAIT), None)
                .unwrap();
        });
        let small = [7u8; 64];
        let mut rtts = Vec::with_capacity(PINGS);
        for _ in 0..PINGS {
            let t0 = Instant::now();
            client
                .send(peer, &small, Deadline::after(WAIT), None)
                .unwrap();
            drop(client.recv(Deadline::after(WAIT), None).unwrap());
            rtts.push(t0.elapsed());
        }
        let big = vec![7u8; BIG];
        let t0 = Instant::now();
        for _ in 0..STREAM {
            client
                .send(peer, &big, Deadline::after(WAIT), None)
                .unwrap();
        }
        drop(client.recv(Deadline::after(WAIT), None).unwrap());
        (
            p50(rtts),
            (STREAM * BIG) as f64 / t0.elapsed().as_secs_f64() / 1e9,
        )
    })
}

fn facade_round() -> Figures {
    let mut config = zerohop::Config::only(Kind::Tcp);
    config.pool_bytes = 256 << 20;
    config.spin = SPIN;
    let server = zerohop::Endpoint::open(config).unwrap();
    config.progress_thread = false;
    let client = zerohop::Endpoint::open(config).unwrap();
    let addr = server.listen("127.0.0.1:0").unwrap();
    let peer = client.connect(addr, WAIT).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..PINGS {
                let m = server.recv(WAIT).unwrap();
                server.send_buffer(m.peer(), m.into_buffer()).unwrap();
            }
            let mut from = None;
            for _ in 0..STREAM {
                from = Some(server.recv(WAIT).unwrap().peer());
            }
            server.send(from.unwrap(), b"done").unwrap();
        });
        let small = [7u8; 64];
        let mut rtts = Vec::with_capacity(PINGS);
        for _ in 0..PINGS {
            let t0 = Instant::now();
            client.send(peer, &small).unwrap();
            drop(client.recv(WAIT).unwrap());
            rtts.push(t0.elapsed());
        }
        let big = vec![7u8; BIG];
        let t0 = Instant::now();
        for _ in 0..STREAM {
            client.send(peer, &big).unwrap();
        }
        drop(client.recv(WAIT).unwrap());
        (
            p50(rtts),
            (STREAM * BIG) as f64 / t0.elapsed().as_secs_f64() / 1e9,
        )
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(7);
    let (mut direct, mut facade) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        // Alternate which goes first, so a slow spell of the machine falls on both.
        let (d, f) = if r % 2 == 0 {
            let d = direct_round();
            (d, facade_round())
        } else {
            let f = facade_round();
            (direct_round(), f)
        };
        println!(
            "round {r}: 64 B p50 direct {:.2} us, facade {:.2} us; 64 KiB direct {:.3} GB/s, facade {:.3} GB/s",
            d.0, f.0, d.1, f.1
        );
        direct.push(d);
        facade.push(f);
    }
    let (dl, fl) = (
        median(direct.iter().map(|d| d.0).collect()),
        median(facade.iter().map(|f| f.0).collect()),
    );
    let (db, fb) = (
        median(direct.iter().map(|d| d.1).collect()),
        median(facade.iter().map(|f| f.1).collect()),
    );
    println!(
        "medians of {rounds} rounds: 64 B one-way p50 direct {dl:.2} us, facade {fl:.2} us ({:.3}x); \
         64 KiB direct {db:.3} GB/s, facade {fb:.3} GB/s ({:.3}x)",
        fl / dl,
        fb / db
    );
    println!("target: the facade at most 5% over the direct endpoint (latency <= 1.05x, bandwidth >= 0.95x)");
}
