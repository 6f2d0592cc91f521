//! The behavioural suite every backend must pass, and the harnesses that
//! give it a connected pair of endpoints per backend.
//!
//! `tests/suite.rs` instantiates [`suite!`] once per backend compiled in; a
//! backend whose hardware is absent says so and skips (its harness returns
//! `None` with the reason).
#![warn(missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use zerohop_core::session::ProtocolError;
use zerohop_core::wire::{Data, DataFlags, Frame};
use zerohop_core::{crc32c, Error, Lease, PeerId, Transport};
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

/// A wire that can put a forged frame on the wire, bypassing its session:
/// what a broken peer sends (each backend's test hook).
pub trait Forge {
    /// Sends `frame` (a header and its payload) to `peer` as it is.
    fn forge(&mut self, peer: PeerId, frame: &[u8]) -> Result<(), Error>;
}

/// How a backend makes a pair.
pub trait Harness {
    /// The transport.
    type T: Wire<Lease: HostView> + Forge;
    /// A fresh connected pair, or why this host cannot make one.
    fn pair() -> Result<Pair<Self::T>, String>;
    /// The largest message the suite may send.
    fn max_message() -> usize;
    /// How long a peer may be silent mid-frame before it fails (the
    /// harnesses set it short, so the suite can wait past it).
    fn idle_timeout() -> Duration {
        IDLE
    }
}

/// A lease the suite reads and fills as host bytes (every harness's
/// messages lie in host memory).
pub trait HostView: Sized + Send + std::fmt::Debug + 'static {
    /// A host lease as this wire's.
    fn from_host(l: StdLease) -> Self;
    /// Its bytes.
    fn host(&self) -> &[u8];
    /// Its bytes, to fill.
    fn host_mut(&mut self) -> &mut [u8];
}

impl HostView for StdLease {
    fn from_host(l: StdLease) -> Self {
        l
    }
    fn host(&self) -> &[u8] {
        zerohop_backends::host_bytes(self)
    }
    fn host_mut(&mut self) -> &mut [u8] {
        zerohop_backends::host_bytes_mut(self)
    }
}

impl HostView for zerohop_std::shm::ShmLease {
    fn from_host(l: StdLease) -> Self {
        zerohop_std::shm::ShmLease::Host(l)
    }
    fn host(&self) -> &[u8] {
        zerohop_backends::host_bytes(self.host().expect("the suite sends host messages"))
    }
    fn host_mut(&mut self) -> &mut [u8] {
        zerohop_backends::host_bytes_mut(self.host_mut().expect("the suite sends host messages"))
    }
}

fn host_bytes<L: HostView>(l: &L) -> &[u8] {
    l.host()
}

fn host_bytes_mut<L: HostView>(l: &mut L) -> &mut [u8] {
    l.host_mut()
}

/// The idle timeout the harnesses configure.
pub const IDLE: Duration = Duration::from_secs(2);

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
    host_bytes_mut(&mut lease).copy_from_slice(&want);
    p.a.send_lease(
        p.to_b,
        HostView::from_host(lease),
        Deadline::after(WAIT),
        None,
    )
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
    host_bytes_mut(&mut lease).copy_from_slice(&want);
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
    // A close waits for the peer's answering Close, which comes once the
    // peer has read everything before it: the peer reads meanwhile.
    std::thread::scope(|s| {
        let closing = s.spawn(|| p.a.close(Deadline::after(WAIT)));
        for i in 0..50 {
            let r = p.b.recv(Deadline::after(WAIT), None).unwrap();
            assert_eq!(host_bytes(&r.lease), &message(i, 2000)[..]);
        }
        closing.join().unwrap().unwrap();
    });
}

/// A receiver that holds a peer's messages back (it has not taken the last
/// ones) does not time the peer out, however long it takes.
pub fn a_receiver_that_holds_back_keeps_the_peer<H: Harness>() {
    let Some(p) = pair_or_skip::<H>("a_receiver_that_holds_back_keeps_the_peer") else {
        return;
    };
    for i in 0..50 {
        p.a.send(p.to_b, &message(i, 2000), Deadline::after(WAIT), None)
            .unwrap();
    }
    // Past the wire's idle timeout, nobody reading.
    std::thread::sleep(H::idle_timeout() + Duration::from_millis(500));
    for i in 0..50 {
        let r = p.b.recv(Deadline::after(WAIT), None).unwrap();
        assert_eq!(host_bytes(&r.lease), &message(i, 2000)[..], "message {i}");
    }
}

/// A data frame carrying `payload` whole, with sequence number `seq`.
fn forged(seq: u64, payload: &[u8]) -> Vec<u8> {
    let f = Frame::Data(Data {
        flags: DataFlags::NONE,
        seq,
        msg_len: payload.len() as u32,
        len: payload.len() as u32,
        offset: 0,
        credits: 0,
        control: 0,
    });
    let mut v = f.encode(payload).to_vec();
    v.extend_from_slice(payload);
    v
}

/// After a failure, nothing more from that peer is delivered.
fn nothing_more<T: Wire>(b: &Endpoint<T>) {
    if let Ok(r) = b.recv(Deadline::after(Duration::from_millis(300)), None) {
        panic!("a message after the failure, from {}", r.peer);
    }
}

/// One behaviour on every wire: a sequence gap fails that peer with a typed
/// error, the message that skipped is not delivered, nor anything after it,
/// and every receive buffer goes back.
pub fn a_gap_fails_the_peer_and_nothing_after_it_is_delivered<H: Harness>() {
    let Some(p) = pair_or_skip::<H>("a_gap_fails_the_peer_and_nothing_after_it_is_delivered")
    else {
        return;
    };
    p.a.send(p.to_b, b"m0", Deadline::after(WAIT), None)
        .unwrap();
    let r = p.b.recv(Deadline::after(WAIT), None).unwrap();
    assert_eq!(host_bytes(&r.lease), b"m0");
    drop(r);
    p.a.flush(Deadline::after(WAIT)).unwrap();
    p.a.with(|t| t.forge(p.to_b, &forged(5, b"skipped ahead")))
        .unwrap();
    assert_eq!(
        p.b.recv(Deadline::after(WAIT), None).unwrap_err(),
        Error::Protocol {
            peer: p.to_a,
            error: ProtocolError::SequenceGap {
                expected: 1,
                got: 5
            }
        }
    );
    let _ = p.a.send(p.to_b, b"m1", Deadline::after(WAIT), None);
    nothing_more(&p.b);
    // Its one peer gone, the receiver holds nothing (a verbs ring included).
    assert_eq!(p.b_pool.used_bytes(), 0, "every receive buffer back");
}

/// One behaviour on every wire: a repeated sequence number fails that peer
/// and the message is not delivered twice.
pub fn a_duplicate_fails_the_peer_and_is_not_delivered_twice<H: Harness>() {
    let Some(p) = pair_or_skip::<H>("a_duplicate_fails_the_peer_and_is_not_delivered_twice") else {
        return;
    };
    for m in [&b"m0"[..], b"m1"] {
        p.a.send(p.to_b, m, Deadline::after(WAIT), None).unwrap();
        assert_eq!(
            host_bytes(&p.b.recv(Deadline::after(WAIT), None).unwrap().lease),
            m
        );
    }
    p.a.flush(Deadline::after(WAIT)).unwrap();
    p.a.with(|t| t.forge(p.to_b, &forged(1, b"m1"))).unwrap();
    assert_eq!(
        p.b.recv(Deadline::after(WAIT), None).unwrap_err(),
        Error::Protocol {
            peer: p.to_a,
            error: ProtocolError::Duplicate { seq: 1 }
        }
    );
    nothing_more(&p.b);
    // Its one peer gone, the receiver holds nothing (a verbs ring included).
    assert_eq!(p.b_pool.used_bytes(), 0, "every receive buffer back");
}

/// One behaviour on every wire: a clean close is reported as clean on both
/// sides, after every message sent before it.
pub fn a_clean_close_is_clean_on_both_sides<H: Harness>() {
    let Some(p) = pair_or_skip::<H>("a_clean_close_is_clean_on_both_sides") else {
        return;
    };
    for i in 0..5 {
        p.a.send(p.to_b, &message(i, 300), Deadline::after(WAIT), None)
            .unwrap();
    }
    p.a.with(|t| t.close()).unwrap();
    for i in 0..5 {
        let r = p.b.recv(Deadline::after(WAIT), None).unwrap();
        assert_eq!(host_bytes(&r.lease), &message(i, 300)[..]);
    }
    assert_eq!(
        p.b.recv(Deadline::after(WAIT), None).unwrap_err(),
        Error::PeerClosed(p.to_a)
    );
    assert_eq!(
        p.a.recv(Deadline::after(WAIT), None).unwrap_err(),
        Error::PeerClosed(p.to_b)
    );
}

/// One behaviour on every wire: a peer that goes away without a word is
/// reported lost, once, after what it sent arrived, with every buffer back.
pub fn a_lost_peer_is_reported_with_every_lease_back<H: Harness>() {
    let Some(p) = pair_or_skip::<H>("a_lost_peer_is_reported_with_every_lease_back") else {
        return;
    };
    for i in 0..5 {
        p.a.send(p.to_b, &message(i, 3000), Deadline::after(WAIT), None)
            .unwrap();
    }
    p.a.flush(Deadline::after(WAIT)).unwrap();
    drop(p.a); // no close: its connection just ends
    let mut got = 0;
    let lost = loop {
        match p.b.recv(Deadline::after(WAIT), None) {
            Ok(r) => {
                assert_eq!(host_bytes(&r.lease), &message(got, 3000)[..]);
                got += 1;
            }
            Err(e) => break e,
        }
    };
    assert_eq!(lost, Error::PeerLost(p.to_a));
    assert_eq!(got, 5, "what it sent before it went arrived");
    nothing_more(&p.b);
    // Its one peer gone, the receiver holds nothing (a verbs ring included).
    assert_eq!(p.b_pool.used_bytes(), 0, "every receive buffer back");
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
            #[test]
            fn a_receiver_that_holds_back_keeps_the_peer() {
                $crate::a_receiver_that_holds_back_keeps_the_peer::<$harness>()
            }
            #[test]
            fn a_gap_fails_the_peer_and_nothing_after_it_is_delivered() {
                $crate::a_gap_fails_the_peer_and_nothing_after_it_is_delivered::<$harness>()
            }
            #[test]
            fn a_duplicate_fails_the_peer_and_is_not_delivered_twice() {
                $crate::a_duplicate_fails_the_peer_and_is_not_delivered_twice::<$harness>()
            }
            #[test]
            fn a_clean_close_is_clean_on_both_sides() {
                $crate::a_clean_close_is_clean_on_both_sides::<$harness>()
            }
            #[test]
            fn a_lost_peer_is_reported_with_every_lease_back() {
                $crate::a_lost_peer_is_reported_with_every_lease_back::<$harness>()
            }
        }
    };
}

pub mod harness;
