//! What quiet TCP peers cost the listener's process in memory, read from
//! its resident set: a stage each while they speak, pages only where bytes
//! landed, and nothing once they are quiet.
//!
//! Its own test binary: the resident set is the whole process's.

#[allow(dead_code)] // the descriptor limit only
mod common;

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use zerohop_core::wire::{Frame, Hello, Host, HostStep, Takes, HEADER_LEN};
use zerohop_core::Kind;
use zerohop_std::tcp::{TcpConfig, TcpTransport};
use zerohop_std::{private_pool, Endpoint, EndpointConfig};

const PEERS: usize = 500;

/// The process's resident set, in bytes.
fn rss() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
        .expect("VmRSS in /proc/self/status");
    kb << 10
}

/// A peer's Hello and its same-host frame (no offer): all it ever says.
fn greeting() -> [u8; 2 * HEADER_LEN] {
    let hello = Frame::Hello(Hello {
        window: 1 << 20,
        max_message: 1 << 20,
        frame_max: 1 << 20,
        ring: 0,
        lane: 0,
        takes: Takes::NONE,
        token: 0x7E57,
    })
    .encode(&[]);
    let host = Frame::Host(Host {
        host: 0,
        pid: 0,
        nonce: 0,
        step: HostStep::NoOffer,
    })
    .encode(&[]);
    let mut both = [0u8; 2 * HEADER_LEN];
    both[..HEADER_LEN].copy_from_slice(&hello);
    both[HEADER_LEN..].copy_from_slice(&host);
    both
}

/// 500 peers that say Hello and then nothing: while they are new, their
/// stages hold the pages their Hellos landed in; once they are quiet for
/// the idle timeout the stages go, and so does their memory (heap stages,
/// zeroed, cost 13 MB resident for the 500, and 9 MB stayed in the process
/// once they were given back).
#[test]
fn quiet_peers_hold_a_page_of_stage_at_most_and_none_once_quiet() {
    let mut lim = common::nofile();
    let want = (4 * PEERS + 64) as libc::rlim_t;
    if lim.rlim_cur < want {
        if lim.rlim_max < want {
            eprintln!(
                "SKIPPED: {PEERS} peers need {want} descriptors, the hard limit is {}",
                lim.rlim_max
            );
            return;
        }
        lim.rlim_cur = want;
        common::set_nofile(lim);
    }
    // Long enough that no stage goes before the 500 are in (on a loaded
    // machine too), and the sample sees them all.
    let config = TcpConfig {
        idle_timeout: Duration::from_secs(2),
        ..TcpConfig::default()
    };
    let mut t = TcpTransport::new(private_pool(64 << 20).unwrap(), config, Kind::Tcp).unwrap();
    let addr = t.listen("127.0.0.1:0").unwrap();
    let server = Endpoint::new(t, EndpointConfig::default()).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let before = rss();
    let greeting = greeting();
    let peers: Vec<TcpStream> = (0..PEERS)
        .map(|_| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(&greeting).unwrap();
            s
        })
        .collect();
    let t0 = Instant::now();
    while server.with(|t| t.peer_count()) < PEERS {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the peers were never accepted"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let staged = server.with(|t| t.stage_bytes());
    let speaking = rss().saturating_sub(before);
    // The quiet scans give the stages back.
    let t0 = Instant::now();
    while server.with(|t| t.stage_bytes()) > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the stages were kept"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let quiet = rss().saturating_sub(before);
    eprintln!(
        "{PEERS} peers: stages {staged} B mapped; resident +{speaking} B new, +{quiet} B quiet"
    );
    assert!(staged > 0, "the peers' Hellos were read into stages");
    // Measured with mapped stages: 5.7 KB a new peer, 1.6 KB a quiet one;
    // with heap stages (64 KiB, zeroed), 18 KB a quiet one.
    assert!(
        speaking < PEERS * (16 << 10),
        "{speaking} B for {PEERS} new peers"
    );
    assert!(
        quiet < PEERS * (4 << 10),
        "{quiet} B for {PEERS} quiet peers"
    );
    assert!(
        quiet < speaking,
        "nothing went back: +{speaking} B, then +{quiet} B"
    );
    drop(peers);
}
