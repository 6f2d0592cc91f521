//! Idle peers for `perf --idle-peers`: connections (or same-host lanes) that
//! say Hello and then nothing, what a node gossiping with many peers looks
//! like to its server.

use std::net::ToSocketAddrs;
use std::time::{Duration, Instant};

use zerohop::{Config, Endpoint};
use zerohop_core::{Kind, Transport};
use zerohop_std::private_pool;
use zerohop_std::tcp::{TcpConfig, TcpTransport};

/// Idle peers, held open for as long as this lives.
pub enum Idle {
    /// TCP connections.
    Tcp(Box<TcpTransport>),
    /// Same-host lanes (shared memory), each a connection that moved there.
    Lanes(Box<Endpoint>),
}

impl Idle {
    /// The peers held.
    pub fn count(&self) -> usize {
        match self {
            Idle::Tcp(t) => t.peer_count(),
            Idle::Lanes(ep) => ep.peers().len(),
        }
    }
}

/// `n` peers of the listener at `addr`, once every one is open: lanes when
/// `config` picks a same-host wire (shm, uma), else TCP connections (one
/// each: no second connection for striping).
pub fn peers(addr: &str, n: usize, config: &Config) -> Result<Idle, Box<dyn std::error::Error>> {
    let mut config = *config;
    // Nobody drives them once open, as nobody drives the TCP ones: what is
    // measured is the listener's cost of them, not a third busy thread
    // beside the two that ping-pong on a small host.
    config.progress_thread = false;
    let ep = Endpoint::open(config)?;
    if !matches!(ep.kind(), Kind::Shm | Kind::Uma) {
        return tcp_peers(addr, n).map(|t| Idle::Tcp(Box::new(t)));
    }
    for i in 0..n {
        ep.connect(addr, Duration::from_secs(10))
            .map_err(|e| format!("idle lane {i} of {n} to {addr}: {e}"))?;
    }
    Ok(Idle::Lanes(Box::new(ep)))
}

fn tcp_peers(addr: &str, n: usize) -> Result<TcpTransport, Box<dyn std::error::Error>> {
    let to = addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| format!("{addr} has no address"))?;
    let config = TcpConfig {
        stripe_min: None,
        ..TcpConfig::default()
    };
    let mut t = TcpTransport::new(private_pool(n.max(1) << 12)?, config, Kind::Tcp)?;
    for i in 0..n {
        t.connect(to, Duration::from_secs(10))
            .map_err(|e| format!("idle connection {i} of {n} to {addr}: {e}"))?;
    }
    let until = Instant::now() + Duration::from_secs(60);
    while t.peer_count() < n {
        if Instant::now() > until {
            return Err(format!(
                "{} of {n} idle connections to {addr} opened",
                t.peer_count()
            )
            .into());
        }
        t.progress()?;
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(t)
}
