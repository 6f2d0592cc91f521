//! The verbs wire without an Endpoint: two threads, each owning one
//! transport and polling it in a busy loop, ping-pong 64 B messages. It
//! splits the wire's own per-message cost from the Endpoint's (locking,
//! spinning, sleeping); compare it with `ib_send_lat` on the same link.
//!
//! `rdma_pingpong [round trips] [fast]` (needs `$ZEROHOP_RDMA_ADDR` or
//! `$RXE_ADDR`). `fast` polls completions only (`try_recv`); without it
//! every empty poll also runs `progress()`, as an idle progress thread would.
use std::time::Instant;

use zerohop_backends::verbs::{Device, RdmaConfig, RdmaTransport};
use zerohop_core::{Error, Received, Transport};

const WARMUP: usize = 100;

/// Polls `t` until a message arrives.
fn wait(
    t: &mut RdmaTransport,
    fast: bool,
) -> Result<Received<<RdmaTransport as Transport>::Lease>, Error> {
    loop {
        match t.try_recv() {
            Err(Error::WouldBlock) if fast => std::hint::spin_loop(),
            Err(Error::WouldBlock) => drop(t.progress()?),
            r => return r,
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let iters: usize = std::env::args().nth(1).map_or(Ok(2000), |s| s.parse())?;
    let fast = std::env::args().nth(2).as_deref() == Some("fast");
    let ip = std::env::var("ZEROHOP_RDMA_ADDR").or_else(|_| std::env::var("RXE_ADDR"))?;
    let addr: std::net::SocketAddr = format!("{ip}:7472").parse()?;
    let mut server = RdmaTransport::new(Device::open()?, RdmaConfig::default())?;
    server.listen(addr)?;
    let echo = std::thread::spawn(move || -> Result<(), Error> {
        while server.peer_count() == 0 {
            server.progress()?;
        }
        for _ in 0..iters + WARMUP {
            let r = wait(&mut server, fast)?;
            let mut b = [0u8; 64];
            b.copy_from_slice(&zerohop_backends::host_bytes(&r.lease)[..64]);
            drop(r.lease);
            while let Err(Error::WouldBlock) = server.try_send(r.peer, &b) {}
        }
        Ok(())
    });
    let mut client = RdmaTransport::new(Device::open()?, RdmaConfig::default())?;
    let peer = client.connect(addr, std::time::Duration::from_secs(10))?;
    let mut one_way = Vec::with_capacity(iters);
    for i in 0..iters + WARMUP {
        let t0 = Instant::now();
        client.try_send(peer, &[7u8; 64])?;
        drop(wait(&mut client, fast)?);
        if i >= WARMUP {
            one_way.push(t0.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    echo.join().expect("the echo thread")?;
    one_way.sort_by(f64::total_cmp);
    println!(
        "64 B one-way latency: min {:.2} us, p50 {:.2} us, p99 {:.2} us over {iters} round trips",
        one_way[0],
        one_way[one_way.len() / 2],
        one_way[one_way.len() * 99 / 100]
    );
    Ok(())
}
