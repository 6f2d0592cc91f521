//! The TCP listener when its process is out of file descriptors: `accept`
//! fails (EMFILE) and the connection waits in the backlog, with no new
//! readiness edge to come for it (epoll is edge-triggered). The listener
//! must try again after a pause: neither once per pass (a spin on a failing
//! system call) nor only at the next edge (a peer left waiting for good).
//! Once descriptors are back, the waiting peer is accepted and served.
//!
//! Its own test binary: the descriptor limit is the whole process's.

mod common;

use common::{highest_descriptor, nofile, set_nofile};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use zerohop_core::{Kind, Transport};
use zerohop_std::private_pool;
use zerohop_std::tcp::{TcpConfig, TcpTransport};

/// How long no descriptor is free; the listener's pause is 100 ms.
const NONE_FREE: Duration = Duration::from_millis(400);
const WAIT: Duration = Duration::from_secs(10);

/// Counts the listener's records of a failed accept (one a try, a debug
/// record but for the first, a warning), its warnings among them, and its
/// warnings that accepts resumed.
struct FailedAccepts {
    tries: AtomicUsize,
    warned: AtomicUsize,
    resumed: AtomicUsize,
}

impl log::Log for FailedAccepts {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::Level::Debug
    }
    fn log(&self, r: &log::Record) {
        let text = r.args().to_string();
        let warning = r.level() == log::Level::Warn;
        if text.contains("tcp: accept failed") {
            self.tries.fetch_add(1, Ordering::Relaxed);
            if warning {
                self.warned.fetch_add(1, Ordering::Relaxed);
            }
        }
        if warning && text.contains("tcp: accepts resumed") {
            self.resumed.fetch_add(1, Ordering::Relaxed);
        }
    }
    fn flush(&self) {}
}

static FAILED_ACCEPTS: FailedAccepts = FailedAccepts {
    tries: AtomicUsize::new(0),
    warned: AtomicUsize::new(0),
    resumed: AtomicUsize::new(0),
};

fn transport() -> TcpTransport {
    let config = TcpConfig {
        stripe_min: None, // one connection a peer: one descriptor to find
        ..TcpConfig::default()
    };
    TcpTransport::new(private_pool(8 << 20).unwrap(), config, Kind::Tcp).unwrap()
}

#[test]
fn a_listener_out_of_descriptors_retries_after_a_pause_and_serves_the_peer_once_they_are_back() {
    log::set_logger(&FAILED_ACCEPTS).unwrap();
    log::set_max_level(log::LevelFilter::Debug);
    let mut server = transport();
    let addr = server.listen("127.0.0.1:0").unwrap();
    // The peer dials first: the kernel completes its handshake into the
    // listener's backlog whatever the listener's descriptors. Nothing here
    // drives the listener yet, so it has accepted nothing.
    let dialed = TcpTransport::dial(addr, WAIT, false).unwrap();
    let mut client = transport();
    // Every descriptor number below the limit taken, then the limit set there.
    let limit = highest_descriptor() + 1;
    let mut held = Vec::new();
    loop {
        let f = std::fs::File::open("/dev/null").unwrap();
        if f.as_raw_fd() as u64 >= limit {
            break;
        }
        held.push(f);
    }
    let before = nofile();
    set_nofile(libc::rlimit {
        rlim_cur: limit,
        ..before
    });
    // The peer says Hello and sends (its socket was opened before the limit).
    let peer = client.attach(dialed).unwrap();
    let started = Instant::now();
    let mut passes = 0u64;
    while started.elapsed() < NONE_FREE {
        let _ = server.progress();
        let _ = client.progress();
        passes += 1;
    }
    let failed = FAILED_ACCEPTS.tries.load(Ordering::Relaxed);
    assert_eq!(
        server.handshaking(),
        0,
        "nothing accepted with no descriptor free"
    );
    assert!(
        failed >= 2,
        "{failed} failed accepts: the test starved nothing"
    );
    assert!(
        failed <= (NONE_FREE.as_millis() / 100) as usize + 2,
        "{failed} failed accepts in {passes} passes: retried without a pause"
    );
    assert_eq!(
        FAILED_ACCEPTS.warned.load(Ordering::Relaxed),
        1,
        "one warning for the run of failures, the retries at debug level"
    );
    // Descriptors back: the listener's next try, a pause later, takes the
    // peer, with no new edge on its socket.
    drop(held);
    set_nofile(before);
    let back = Instant::now();
    let mut sent = false;
    let got = loop {
        assert!(back.elapsed() < WAIT, "the peer was never accepted");
        let _ = client.progress();
        if !sent && client.try_send(peer, b"after the drought").is_ok() {
            sent = true;
        }
        let _ = server.progress();
        match server.try_recv() {
            Ok(m) => break m,
            Err(zerohop_core::Error::WouldBlock) => {}
            Err(e) => panic!("the listener failed: {e}"),
        }
    };
    let took = back.elapsed();
    assert_eq!(
        zerohop_backends::host_bytes(&got.lease),
        b"after the drought"
    );
    assert!(
        took < Duration::from_secs(2),
        "accepted {took:?} after descriptors came back"
    );
    assert_eq!(
        FAILED_ACCEPTS.tries.load(Ordering::Relaxed),
        failed,
        "no failure once descriptors are back"
    );
    assert_eq!(
        FAILED_ACCEPTS.resumed.load(Ordering::Relaxed),
        1,
        "the end of the run of failures is reported once"
    );
    assert_eq!(server.peer_count(), 1);
}
