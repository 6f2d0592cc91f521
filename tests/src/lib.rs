//! The behavioural suite every backend must pass, and the harnesses that
//! give it a connected pair of endpoints per backend.
//!
//! `tests/suite.rs` instantiates [`suite!`] once per backend compiled in; a
//! backend whose hardware is absent says so and skips (its harness returns
//! `None` with the reason).
#![warn(missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use zerohop_backends::host_bytes;
use zerohop_core::{crc32c, Error, Lease, PeerId};
use zerohop_std::{Deadline, Endpoint, StdLease, StdPool, Wire};

/// A connected pair: `a` sends to `b` as `to_b`, `b` answers as `to_a`.
#[allow(missing_debug_implementations)]
pub struct Pair<T: Wire> {
    /// One side.
    pub a: Endpoint<T>,
    /// The other.
    pub b: Endpoint<T>,
    /// `b` as `a` names it.
    pub to_b: PeerId,
    /// `a` as `b` names it (known once `b` has received from `a`).
    pub to_a: PeerId,
    /// `a`'s pool (for zero-copy sends).
    pub a_pool: Arc<StdPool>,
    /// `b`'s receive pool.
    pub b_pool: Arc<StdPool>,
}

/// How a backend makes a pair.
pub trait Harness {
    /// The transport.
    type T: Wire<Lease = StdLease>;
    /// A fresh connected pair, or why this host cannot make one.
    fn pair() -> Result<Pair<Self::T>, String>;
    /// The largest message the suite may send.
    fn max_message() -> usize;
}

const WAIT: Duration = Duration::from_secs(30);

fn message(i: u32, len: usize) -> Vec<u8> {
    let mut m: Vec<u8> = (0..len)
        .map(|k| (k as u32).wrapping_mul(31).wrapping_add(i) as u8)
        .collect();
    if len >= 8 {
        m[..4].copy_from_slice(&i.to_le_bytes());
        let c = crc32c(0, &m[..len - 4]);
        m[len - 4..].copy_from_slice(&c.to_le_bytes());
    }
    m
}

/// Gets a pair or prints why not (the test then passes as skipped).
pub fn pair_or_skip<H: Harness>(test: &str) -> Option<Pair<H::T>> {
    match H::pair() {
        Ok(p) => Some(p),
        Err(why) => {
            eprintln!("SKIPPED {test}: {why}");
            None
        }
    }
}

/// Messages of many sizes arrive intact, once each, in order; every receive
/// buffer goes back to the pool.
pub fn delivers_in_order<H: Harness>() {
    let Some(p) = pair_or_skip::<H>("delivers_in_order") else {
        return;
    };
    // A verbs receiver always holds its posted receive ring: compare with that level.
    let baseline = p.b_pool.used_bytes();
    let max = H::max_message();
    let sizes: Vec<usize> = (0..300u32)
        .map(|i| [0, 1, 7, 64, 255, 256, 257, 4096, 65_536, max][i as usize % 10].min(max))
        .collect();
    std::thread::scope(|s| {
        s.spawn(|| {
            for (i, &len) in sizes.iter().enumerate() {
                p.a.send(p.to_b, &message(i as u32, len), Deadline::after(WAIT), None)
                    .unwrap();
            }
        });
        for (i, &len) in sizes.iter().enumerate() {
            let r = p.b.recv(Deadline::after(WAIT), None).unwrap();
            assert_eq!(
                host_bytes(&r.lease),
                &message(i as u32, len)[..],
                "message {i} of {len} bytes"
            );
        }
    });
    assert_eq!(
        p.b_pool.used_bytes(),
        baseline,
        "receive leases all returned"
    );
}

/// A pool buffer sent without a copy arrives with its contents, and the
/// sender's buffer goes back to its pool once sent.
pub fn zero_copy_send_arrives<H: Harness>() {
    let Some(p) = pair_or_skip::<H>("zero_copy_send_arrives") else {
        return;
    };
    let mut lease = Lease::take(Arc::clone(&p.a_pool), 1000).unwrap();
    let want = message(7, 1000);
    let region = lease.region();
    assert_eq!(region.len, 1000);
    zerohop_backends::host_bytes_mut(&mut lease).copy_from_slice(&want);
    p.a.send_lease(p.to_b, lease, Deadline::after(WAIT), None)
        .unwrap();
    let r = p.b.recv(Deadline::after(WAIT), None).unwrap();
    assert_eq!(host_bytes(&r.lease), &want[..]);
    p.a.flush(Deadline::after(WAIT)).unwrap();
    assert_eq!(
        p.a_pool.used_bytes(),
        0,
        "the sent lease went back after the send"
    );
}

/// A zero-copy buffer comes from the endpoint without its transport lock:
/// a thread taking one does not wait for another that holds the transport
/// (as a receiver spinning in `recv` does between its polls), and the
/// buffer is the wire's own, sent as it is.
pub fn a_lease_needs_no_transport_lock<H: Harness>() {
    let Some(p) = pair_or_skip::<H>("a_lease_needs_no_transport_lock") else {
        return;
    };
    let a = Arc::new(p.a);
    let (tx, rx) = std::sync::mpsc::channel();
    let taken = a.with(|_locked| {
        let a = Arc::clone(&a);
        std::thread::spawn(move || {
            let _ = tx.send(a.lease(1000));
        });
        // Bounded: a lease behind the transport lock would wait for the end of `with`.
        rx.recv_timeout(Duration::from_secs(10))
    });
    let mut lease = taken
        .expect("a lease while another thread holds the transport")
        .unwrap();
    let want = message(9, 1000);
    zerohop_backends::host_bytes_mut(&mut lease).copy_from_slice(&want);
    a.send_lease(p.to_b, lease, Deadline::after(WAIT), None)
        .unwrap();
    let r = p.b.recv(Deadline::after(WAIT), None).unwrap();
    assert_eq!(host_bytes(&r.lease), &want[..]);
}

/// Replies flow back: b answers a on the peer id it received from.
pub fn replies_reach_the_sender<H: Harness>() {
    let Some(p) = pair_or_skip::<H>("replies_reach_the_sender") else {
        return;
    };
    p.a.send(p.to_b, b"ping", Deadline::after(WAIT), None)
        .unwrap();
    let r = p.b.recv(Deadline::after(WAIT), None).unwrap();
    assert_eq!(r.peer, p.to_a);
    p.b.send(r.peer, b"pong", Deadline::after(WAIT), None)
        .unwrap();
    let back = p.a.recv(Deadline::after(WAIT), None).unwrap();
    assert_eq!(back.peer, p.to_b);
    assert_eq!(host_bytes(&back.lease), b"pong");
}

/// Misuse gets typed errors: too large, unknown peer, nothing to receive.
pub fn misuse_is_typed<H: Harness>() {
    let Some(p) = pair_or_skip::<H>("misuse_is_typed") else {
        return;
    };
    let max = H::max_message();
    assert_eq!(
        p.a.send(p.to_b, &vec![0; max + 1], Deadline::after(WAIT), None),
        Err(Error::TooLarge { len: max + 1, max })
    );
    assert_eq!(
        p.a.send(PeerId(4242), b"x", Deadline::after(WAIT), None),
        Err(Error::UnknownPeer(PeerId(4242)))
    );
    assert_eq!(
        p.b.recv(Deadline::after(Duration::from_millis(50)), None)
            .unwrap_err(),
        Error::Timeout
    );
}

/// After a clean close, what was sent before it still arrives.
pub fn close_flushes<H: Harness>() {
    let Some(p) = pair_or_skip::<H>("close_flushes") else {
        return;
    };
    for i in 0..50 {
        p.a.send(p.to_b, &message(i, 2000), Deadline::after(WAIT), None)
            .unwrap();
    }
    p.a.close(Deadline::after(WAIT)).unwrap();
    for i in 0..50 {
        let r = p.b.recv(Deadline::after(WAIT), None).unwrap();
        assert_eq!(host_bytes(&r.lease), &message(i, 2000)[..]);
    }
}

/// Instantiates the suite for one harness.
#[macro_export]
macro_rules! suite {
    ($name:ident, $harness:ty) => {
        mod $name {
            #[test]
            fn delivers_in_order() {
                $crate::delivers_in_order::<$harness>()
            }
            #[test]
            fn zero_copy_send_arrives() {
                $crate::zero_copy_send_arrives::<$harness>()
            }
            #[test]
            fn a_lease_needs_no_transport_lock() {
                $crate::a_lease_needs_no_transport_lock::<$harness>()
            }
            #[test]
            fn replies_reach_the_sender() {
                $crate::replies_reach_the_sender::<$harness>()
            }
            #[test]
            fn misuse_is_typed() {
                $crate::misuse_is_typed::<$harness>()
            }
            #[test]
            fn close_flushes() {
                $crate::close_flushes::<$harness>()
            }
        }
    };
}

pub mod harness;
