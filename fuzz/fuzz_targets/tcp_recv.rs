//! Arbitrary byte streams into the real TCP receive path (over loopback):
//! typed errors, no panic, nothing leased beyond the configured maximum, and
//! every lease back in the pool afterwards. An input whose first byte is odd
//! is sent after a valid Hello and same-host frame, so the fuzzer reaches
//! past the handshake; with bit 2 set as well, after a short record of the
//! first message (sequence 0; its length the input's second byte, or the
//! whole input with bit 3), so it reaches the short record's path and the
//! frames that follow one.
#![no_main]

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use zerohop_core::wire::{Frame, Hello, Host, HostStep, ShortRecord, Takes};
use zerohop_core::{Error, Kind, Transport};
use zerohop_std::tcp::{TcpConfig, TcpTransport};
use zerohop_std::{private_pool, StdPool};

const MAX: usize = 64 << 10;

struct Rig {
    transport: TcpTransport,
    pool: Arc<StdPool>,
    addr: SocketAddr,
}

fn rig() -> &'static Mutex<Rig> {
    static RIG: OnceLock<Mutex<Rig>> = OnceLock::new();
    RIG.get_or_init(|| {
        let pool = private_pool(8 << 20).unwrap();
        let config = TcpConfig {
            max_message: MAX,
            ..TcpConfig::default()
        };
        let mut transport = TcpTransport::new(Arc::clone(&pool), config, Kind::Tcp).unwrap();
        let addr = transport.listen("127.0.0.1:0").unwrap();
        Mutex::new(Rig {
            transport,
            pool,
            addr,
        })
    })
}

fuzz_target!(|data: &[u8]| {
    let mut rig = rig().lock().unwrap();
    let rig = &mut *rig;
    let mut s = TcpStream::connect(rig.addr).unwrap();
    if data.first().is_some_and(|b| b & 1 == 1) {
        let hello = Frame::Hello(Hello {
            window: 1 << 20,
            max_message: 1 << 20,
            frame_max: 1 << 20,
            ring: 0,
            lane: 0,
            takes: Takes::NONE,
            token: 1,
        });
        s.write_all(&hello.encode(&[])).unwrap();
        // Its same-host frame: no offer, or (bit 1) an offer this listener
        // declines (it takes none).
        let step = if data[0] & 2 == 0 {
            HostStep::NoOffer
        } else {
            HostStep::Offer
        };
        let host = Frame::Host(Host {
            host: 7,
            pid: 8,
            nonce: 9,
            step,
        });
        s.write_all(&host.encode(&[])).unwrap();
        if data[0] & 4 != 0 {
            // Its message: the input's first `data[1]` bytes (all of it
            // with bit 3), so what follows is read as the next frames.
            let len = match data.get(1) {
                Some(&n) if data[0] & 8 == 0 => usize::from(n).min(data.len()),
                _ => data.len(),
            };
            let len = u32::try_from(len).unwrap();
            s.write_all(&ShortRecord { imm: 0, len }.encode()).unwrap();
        }
    }
    // The transport may have closed the connection already: that is an answer.
    let _ = s.write_all(data);
    drop(s);
    let t0 = Instant::now();
    loop {
        let _ = rig.transport.progress(); // accepts the connection
        match rig.transport.try_recv() {
            Ok(r) => assert!(r.lease.len() <= MAX),
            Err(Error::WouldBlock) => {}
            Err(
                Error::PeerLost(_)
                | Error::PeerClosed(_)
                | Error::Protocol { .. }
                | Error::WireRule { .. },
            ) => {}
            Err(e) => panic!("unexpected {e}"),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the connection was never resolved"
        );
        if rig.transport.peer_count() == 0 && rig.transport.handshaking() == 0 {
            // Drain what was queued before the peer went: messages and errors
            // interleave, so stop only when nothing is left.
            loop {
                match rig.transport.try_recv() {
                    Err(Error::WouldBlock) => break,
                    Ok(r) => assert!(r.lease.len() <= MAX),
                    Err(_) => {}
                }
            }
            break;
        }
    }
    assert_eq!(rig.pool.used_bytes(), 0, "every lease back");
    assert!(rig.pool.stats().reserved_bytes <= 8 << 20);
});
