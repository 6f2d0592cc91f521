//! Async endpoints for tokio. A thread beside the runtime waits on the
//! endpoint (spinning briefly, then asleep in `poll(2)` on its descriptors)
//! and hands each event to the runtime through a channel: tasks are woken
//! by the endpoint's progress, and nothing busy-loops inside the runtime.
//! A send that cannot go at once waits on the runtime's blocking pool.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> zerohop::Result<()> {
//! use std::time::Duration;
//! use futures_util::StreamExt;
//! use zerohop::tokio::AsyncEndpoint;
//! use zerohop::{Config, Endpoint, Event, Kind};
//!
//! let server = AsyncEndpoint::new(Endpoint::open(Config::only(Kind::Tcp))?);
//! let addr = server.endpoint().listen("127.0.0.1:0")?;
//! let client = AsyncEndpoint::new(Endpoint::open(Config::only(Kind::Tcp))?);
//! let peer = client.connect(addr, Duration::from_secs(5)).await?;
//! client.send(peer, b"tx 42").await?;
//! let mut events = server.events().await;
//! while let Some(event) = events.next().await {
//!     if let Event::Message(m) = event? {
//!         assert_eq!(m.bytes(), Some(&b"tx 42"[..]));
//!         break;
//!     }
//! }
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::net::ToSocketAddrs;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use ::tokio::sync::{mpsc, Mutex, OwnedMutexGuard};

use crate::{Endpoint, Error, Event, Message, Peer, Result};

/// Events the pump holds for the runtime before it stops reading (the
/// messages behind them wait in the wire, and the peers for credit): few,
/// since each holds its pool buffer.
const QUEUE: usize = 64;
/// How often the pump looks whether it should stop.
const STOP_CHECK: Duration = Duration::from_millis(100);

type Queue = mpsc::Receiver<Result<Event>>;

/// An [`Endpoint`] for async code: `send`, `recv`, `next_event` and an
/// event [`Stream`](futures_core::Stream). Everything else (listen, stats,
/// leases) is on [`endpoint`](Self::endpoint).
pub struct AsyncEndpoint {
    inner: Arc<Endpoint>,
    events: Arc<Mutex<Queue>>,
    stop: Arc<AtomicBool>,
}

impl fmt::Debug for AsyncEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncEndpoint")
            .field("endpoint", &self.inner)
            .finish_non_exhaustive()
    }
}

impl AsyncEndpoint {
    /// Wraps `endpoint` and starts the thread that waits on it.
    ///
    /// # Panics
    /// If the thread cannot be started (the process is out of threads).
    pub fn new(endpoint: Endpoint) -> AsyncEndpoint {
        let inner = Arc::new(endpoint);
        let (tx, rx) = mpsc::channel(QUEUE);
        let stop = Arc::new(AtomicBool::new(false));
        let (ep, halt) = (Arc::clone(&inner), Arc::clone(&stop));
        std::thread::Builder::new()
            .name("zerohop-async".into())
            .spawn(move || pump(&ep, &tx, &halt))
            .expect("spawning the zerohop-async thread");
        AsyncEndpoint {
            inner,
            events: Arc::new(Mutex::new(rx)),
            stop,
        }
    }

    /// The endpoint underneath: listen, stats, leases, close.
    pub fn endpoint(&self) -> &Endpoint {
        &self.inner
    }

    /// [`Endpoint::connect`], waiting on the runtime's blocking pool.
    pub async fn connect(
        &self,
        addr: impl ToSocketAddrs + fmt::Display + Send + 'static,
        timeout: Duration,
    ) -> Result<Peer> {
        let ep = Arc::clone(&self.inner);
        blocking(move || ep.connect(addr, timeout)).await
    }

    /// Sends a copy of `bytes`: at once when the wire has room, else from
    /// a copy on the runtime's blocking pool, up to the endpoint's
    /// `send_timeout`.
    ///
    /// Not cancel-safe: a message the wire had no room for is on the
    /// blocking pool once this future has been polled, and goes on if the
    /// future is dropped; a send made after the drop may arrive before it.
    pub async fn send(&self, peer: Peer, bytes: &[u8]) -> Result<()> {
        if self.inner.send_now(peer, bytes)? {
            return Ok(());
        }
        let (ep, owned) = (Arc::clone(&self.inner), bytes.to_vec());
        blocking(move || ep.send(peer, &owned)).await
    }

    /// The next message; a peer's end comes back as an [`Error::Peer`], as
    /// [`Endpoint::recv`] gives it.
    pub async fn recv(&self) -> Result<Message> {
        loop {
            match self.next_event().await {
                Some(Ok(Event::Message(m))) => return Ok(m),
                Some(Ok(Event::Connected { .. })) => {}
                Some(Ok(Event::Closed { peer, addr })) => {
                    return Err(Error::Peer {
                        peer,
                        addr,
                        error: zerohop_core::Error::PeerClosed(peer.0),
                    })
                }
                Some(Ok(Event::Lost { why, .. })) => return Err(why),
                Some(Err(e)) => return Err(e),
                None => return Err(Error::Endpoint(zerohop_core::Error::Closed)),
            }
        }
    }

    /// The next event; `None` once the endpoint is closed and its peers gone.
    pub async fn next_event(&self) -> Option<Result<Event>> {
        self.events.lock().await.recv().await
    }

    /// The events as a stream (one stream at a time: a second waits for
    /// the first to be dropped).
    pub async fn events(&self) -> EventStream {
        EventStream {
            queue: Arc::clone(&self.events).lock_owned().await,
        }
    }
}

impl Drop for AsyncEndpoint {
    fn drop(&mut self) {
        // Release: the pump's Acquire load sees it within STOP_CHECK.
        self.stop.store(true, Ordering::Release);
    }
}

/// The events of an [`AsyncEndpoint`], as a [`Stream`](futures_core::Stream).
#[derive(Debug)]
pub struct EventStream {
    queue: OwnedMutexGuard<Queue>,
}

impl futures_core::Stream for EventStream {
    type Item = Result<Event>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Event>>> {
        self.queue.poll_recv(cx)
    }
}

/// Runs `f` on the runtime's blocking pool.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    ::tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}

/// The waiting thread: events into the channel until the endpoint ends,
/// the async side goes, or it is told to stop.
fn pump(ep: &Endpoint, tx: &mpsc::Sender<Result<Event>>, stop: &AtomicBool) {
    // Acquire: pairs with the Release store in `AsyncEndpoint::drop`.
    while !stop.load(Ordering::Acquire) {
        let item = match ep.next_event(STOP_CHECK) {
            Err(e) if e.is_timeout() => continue,
            Err(e) if e.is_closed() => return,
            r => r,
        };
        if tx.blocking_send(item).is_err() {
            return; // the async side is gone
        }
    }
}
