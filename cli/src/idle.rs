//! Idle peers for `perf --idle-peers`: connections that say Hello and then
//! nothing, what a node gossiping with many peers looks like to its server.

use std::net::ToSocketAddrs;
use std::time::{Duration, Instant};

use zerohop_core::{Kind, Transport};
use zerohop_std::private_pool;
use zerohop_std::tcp::{TcpConfig, TcpTransport};

/// `n` connections to the listener at `addr` (one each: no second
/// connection for striping), once every one is open. Keep the transport:
/// dropping it closes them.
pub fn peers(addr: &str, n: usize) -> Result<TcpTransport, Box<dyn std::error::Error>> {
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
