//! The endpoint's shutdown and wake-ups under every interleaving loom finds:
//! the real `Endpoint` code (send, recv, flush, close, the progress loop)
//! over a model wire, with loom's threads, locks and condvars. Loom has no
//! clock, so no wait here can end by timing out: every sleeper must be woken
//! by the thread that has its work, or loom reports the deadlock.
//!
//! `LOOM_MAX_PREEMPTIONS=2 RUSTFLAGS="--cfg loom" cargo test -p zerohop-std --test loom --profile loom`
#![cfg(loom)]

use std::collections::VecDeque;
use std::time::Duration;

use loom::sync::{Arc, Mutex};
use loom::thread;
use zerohop_core::{Capabilities, Error, Kind, PeerId, Received, Rejected, Transport};
use zerohop_std::endpoint::Leaser;
use zerohop_std::{Deadline, Endpoint, EndpointConfig, Wire};

/// What left the model wire, seen from outside the endpoint.
#[derive(Default)]
struct Ledger {
    delivered: Vec<u8>,
}

/// A loopback with a one-message send queue: a second send must wait for
/// `progress` to move the first onto the "network" (the inbox).
struct ModelWire {
    queued: VecDeque<u8>,
    inbox: VecDeque<u8>,
    closed: bool,
    ledger: Arc<Mutex<Ledger>>,
}

impl ModelWire {
    fn new(ledger: Arc<Mutex<Ledger>>) -> Self {
        ModelWire {
            queued: VecDeque::new(),
            inbox: VecDeque::new(),
            closed: false,
            ledger,
        }
    }
}

impl Transport for ModelWire {
    type Lease = u8;

    fn kind(&self) -> Kind {
        Kind::Mock
    }

    fn caps(&self) -> Capabilities {
        Capabilities::new(false, false, 0)
    }

    fn try_send(&mut self, _: PeerId, bytes: &[u8]) -> Result<(), Error> {
        if self.closed {
            return Err(Error::Closed);
        }
        if !self.queued.is_empty() {
            return Err(Error::WouldBlock);
        }
        self.queued.push_back(bytes[0]);
        Ok(())
    }

    fn try_send_lease(&mut self, peer: PeerId, lease: u8) -> Result<(), Rejected<u8>> {
        self.try_send(peer, &[lease])
            .map_err(|error| Rejected { error, lease })
    }

    fn try_recv(&mut self) -> Result<Received<u8>, Error> {
        self.inbox
            .pop_front()
            .map(|lease| Received {
                peer: PeerId(0),
                lease,
            })
            .ok_or(Error::WouldBlock)
    }

    fn progress(&mut self) -> Result<bool, Error> {
        let Some(m) = self.queued.pop_front() else {
            return Ok(false);
        };
        self.ledger.lock().unwrap().delivered.push(m);
        self.inbox.push_back(m);
        Ok(true)
    }

    fn close(&mut self) -> Result<(), Error> {
        self.closed = true;
        Ok(())
    }
}

impl Wire for ModelWire {
    fn leaser(&self) -> Leaser<u8> {
        Box::new(|_| Ok(0))
    }

    fn read_lease(&self, lease: &u8, out: &mut [u8]) -> Result<(), Error> {
        match out {
            [] => Ok(()),
            [b] => {
                *b = *lease;
                Ok(())
            }
            _ => Err(Error::TooLarge {
                len: out.len(),
                max: 1,
            }),
        }
    }

    fn pending_sends(&self) -> usize {
        self.queued.len()
    }
}

fn config() -> EndpointConfig {
    EndpointConfig {
        // No spin: the model explores the sleeping path, where wake-ups matter.
        spin: Duration::ZERO,
        poll_interval: Duration::from_millis(5),
        progress_thread: true,
    }
}

fn endpoint() -> (Endpoint<ModelWire>, Arc<Mutex<Ledger>>) {
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let ep = Endpoint::new(ModelWire::new(Arc::clone(&ledger)), config()).unwrap();
    (ep, ledger)
}

/// `close` flushes what was accepted, then stops the progress thread: every
/// accepted message is delivered, in order, and close returns Ok.
#[test]
fn close_delivers_every_accepted_send_then_stops() {
    loom::model(|| {
        let (ep, ledger) = endpoint();
        ep.send(PeerId(0), &[1], Deadline::never(), None).unwrap();
        ep.send(PeerId(0), &[2], Deadline::never(), None).unwrap();
        ep.close(Deadline::never()).unwrap();
        assert_eq!(ledger.lock().unwrap().delivered, [1, 2]);
    });
}

/// A thread asleep in `recv` is woken by the progress thread's delivery,
/// whichever of them runs first; then close stops everything.
#[test]
fn a_sleeping_receiver_is_woken_and_close_ends_cleanly() {
    loom::model(|| {
        let (ep, ledger) = endpoint();
        let ep = Arc::new(ep);
        let receiver = {
            let ep = Arc::clone(&ep);
            thread::spawn(move || ep.recv(Deadline::never(), None).map(|r| r.lease))
        };
        ep.send(PeerId(0), &[7], Deadline::never(), None).unwrap();
        assert_eq!(receiver.join().unwrap(), Ok(7));
        let ep = Arc::try_unwrap(ep).ok().expect("the receiver is gone");
        ep.close(Deadline::never()).unwrap();
        assert_eq!(ledger.lock().unwrap().delivered, [7]);
    });
}

/// A send racing with a second sender for the one queue place: both complete
/// (one waits for the progress thread or flushes itself), nothing is lost.
#[test]
fn two_senders_share_a_full_queue_without_loss() {
    loom::model(|| {
        let (ep, ledger) = endpoint();
        let ep = Arc::new(ep);
        let other = {
            let ep = Arc::clone(&ep);
            thread::spawn(move || ep.send(PeerId(0), &[1], Deadline::never(), None))
        };
        ep.send(PeerId(0), &[2], Deadline::never(), None).unwrap();
        other.join().unwrap().unwrap();
        let ep = Arc::try_unwrap(ep).ok().expect("the sender is gone");
        ep.close(Deadline::never()).unwrap();
        let mut got = ledger.lock().unwrap().delivered.clone();
        got.sort_unstable();
        assert_eq!(got, [1, 2]);
    });
}

/// Dropping an endpoint without close stops its progress thread (no hang),
/// and a send after close is refused, typed.
#[test]
fn drop_stops_the_progress_thread_and_closed_refuses_sends() {
    loom::model(|| {
        let (ep, _) = endpoint();
        ep.with(|t| t.close()).unwrap();
        assert_eq!(
            ep.send(PeerId(0), &[1], Deadline::never(), None),
            Err(Error::Closed)
        );
        drop(ep);
    });
}
