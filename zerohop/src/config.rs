//! What an endpoint is opened with.

use std::time::Duration;

use zerohop_backends::PeerLimits;
use zerohop_core::{Kind, Preference};

/// How to open an [`Endpoint`](crate::Endpoint). Start from
/// [`Config::from_env`] (what `zerohop info` reads) or [`Config::default`],
/// then change fields:
///
/// ```
/// let mut config = zerohop::Config::default();
/// config.transport = zerohop::Preference::Only(zerohop::Kind::Tcp);
/// config.pool_bytes = 64 << 20;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// Which transport: automatic (gpudirect > rdma > uma > tcp, the first
    /// this host can run) or exactly one (an error naming what is missing
    /// if it cannot run). `ZEROHOP_TRANSPORT`, else the Go package's
    /// `ZAP_TRANSPORT`.
    pub transport: Preference,
    /// Budget of the receive pool, in bytes (default 4 GiB; it grows in
    /// 2 MiB chunks up to this). A host pool reserves twice this in address
    /// space up front (one mapping, so that viewing a buffer takes no lock)
    /// and commits only as far as it has grown, strict overcommit included.
    /// `ZEROHOP_POOL_BYTES`, else `ZAP_UMA_POOL_BYTES` (0: the host's
    /// physical memory).
    pub pool_bytes: usize,
    /// The longest message this endpoint takes (peers learn it at
    /// connection; a longer send fails at the sender, naming this limit).
    /// `None`: 64 MiB, or the longest message the receive pool can hold if
    /// that is less. More than the pool holds is refused at
    /// [`open`](crate::Endpoint::open): a message must fit the pool it lands in.
    pub max_message: Option<usize>,
    /// Run a progress thread beside the application (default on): it
    /// accepts peers, finishes handshakes and queued sends, and reads for
    /// an application that is not calling. Off, the application's own
    /// calls do all of it ([`Endpoint::progress`](crate::Endpoint::progress)
    /// when it has nothing else to call), as UCX's `ucp_worker_progress`:
    /// one busy thread per process instead of two.
    pub progress_thread: bool,
    /// How long a waiting call busy-polls before it sleeps (default 50 µs).
    pub spin: Duration,
    /// How long [`send`](crate::Endpoint::send) waits for room (credit, or
    /// a socket that drains) before it says `Timeout` (default 30 s).
    pub send_timeout: Duration,
    /// A peer silent this long mid-handshake or mid-message is dropped
    /// (default 5 s). A peer that is quiet between messages is kept.
    pub idle_timeout: Duration,
    /// Bytes a second a peer must keep up while one of its messages is
    /// under way, after a grace of `idle_timeout` (default 64 KiB/s; 0:
    /// none): a peer that sends a large message a byte now and then, to
    /// hold its receive buffer, is dropped (`Stalled { during: Slow }`).
    /// Lower it for peers on slower links.
    pub min_rate: u32,
    /// Over `shm`, messages of this many bytes and up are read straight
    /// out of the sender's memory (one copy, one message handed over at a
    /// time), smaller ones go through the shared ring (two copies,
    /// pipelined); the side that sets a lane up decides for both (default
    /// 32 KiB, what a many-core server wants; on a small VM 2 MiB can be
    /// faster: BENCHMARKS.md). `ZEROHOP_SHM_SINGLE_COPY_FROM`.
    pub shm_single_copy_from: usize,
    /// Peers this endpoint accepts and keeps at most, overall and from one
    /// IP address (default 4096 each, at least 1; see [`PeerLimits`] on
    /// descriptors); peers it connects to do not count. Past either, a
    /// TCP or same-host listener lets go an accepted peer that it has heard
    /// nothing from for an idle timeout, of its own accord, from the
    /// newcomer's group of addresses (loopback, an IPv4 /24, an IPv6 /48)
    /// or one holding more places than the newcomer's would (the
    /// application sees it end, `Evicted`); otherwise (and over RDMA,
    /// whose peers are never let go) the
    /// newcomer is refused at its handshake: its
    /// [`connect`](crate::Endpoint::connect) fails, saying it was refused.
    pub peer_limits: PeerLimits,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            transport: Preference::Auto,
            pool_bytes: 4 << 30,
            max_message: None,
            progress_thread: true,
            spin: Duration::from_micros(50),
            send_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(5),
            min_rate: zerohop_core::session::MIN_RATE,
            shm_single_copy_from: zerohop_std::Config::default().shm_single_copy_from,
            peer_limits: PeerLimits::default(),
        }
    }
}

/// The longest message when none is configured.
const DEFAULT_MAX_MESSAGE: usize = 64 << 20;

impl Config {
    /// The defaults, with the transport and pool budget from the
    /// environment (see the fields). A malformed variable is an error that
    /// names it.
    pub fn from_env() -> Result<Config, crate::Error> {
        let env = zerohop_std::Config::from_env().map_err(crate::Error::Config)?;
        Ok(Config {
            transport: env.transport,
            pool_bytes: env.pool_bytes,
            shm_single_copy_from: env.shm_single_copy_from,
            ..Config::default()
        })
    }

    /// The defaults with exactly `kind` as the transport.
    pub fn only(kind: Kind) -> Config {
        Config {
            transport: Preference::Only(kind),
            ..Config::default()
        }
    }

    /// The longest message, once the pool is known; `Err` names both
    /// numbers when a message could not fit the pool.
    pub(crate) fn message_limit(&self) -> Result<usize, crate::Error> {
        match self.max_message {
            None => Ok(DEFAULT_MAX_MESSAGE.min(self.pool_bytes)),
            Some(0) => Err(crate::Error::BadConfig(
                "max_message is 0: no message could be received".into(),
            )),
            Some(m) if m > self.pool_bytes => Err(crate::Error::BadConfig(format!(
                "max_message ({m} bytes) is larger than pool_bytes ({} bytes): \
                 a message must fit the receive pool it lands in",
                self.pool_bytes
            ))),
            Some(m) => Ok(m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_limit_follows_the_pool_and_a_limit_beyond_it_is_refused() {
        let mut c = Config::default();
        assert_eq!(c.message_limit().unwrap(), 64 << 20);
        c.pool_bytes = 1 << 20;
        assert_eq!(c.message_limit().unwrap(), 1 << 20);
        c.max_message = Some(4096);
        assert_eq!(c.message_limit().unwrap(), 4096);
        c.max_message = Some(2 << 20);
        let e = c.message_limit().unwrap_err().to_string();
        assert!(
            e.contains("2097152") && e.contains("1048576") && e.contains("pool"),
            "{e}"
        );
        c.max_message = Some(0);
        assert!(c.message_limit().is_err());
    }
}
