//! An echo server and its client, over whatever transport this host picks
//! (`ZEROHOP_TRANSPORT` chooses one).
//!
//! ```sh
//! cargo run --example echo -- serve 127.0.0.1:7470     # one terminal
//! cargo run --example echo -- 127.0.0.1:7470 1000      # another: 1000 messages
//! cargo run --example echo -- selftest 1000            # both, in one process
//! ```
//!
//! The client sends messages of 1 B to 1 MiB, each ending in a checksum of
//! the rest, and checks that every echo comes back whole, in order; it exits
//! non-zero on the first that does not.

use std::time::{Duration, Instant};

use zerohop::{Config, Endpoint, Event};

const WAIT: Duration = Duration::from_secs(30);

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().filter_or("ZEROHOP_LOG", "warn"))
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("serve") => serve(args.get(1).map_or("0.0.0.0:7470", String::as_str)),
        Some("selftest") => selftest(count(args.get(1))),
        Some(addr) => client(addr, count(args.get(1))),
        None => Err("usage: echo serve ADDR | echo ADDR [COUNT] | echo selftest [COUNT]".into()),
    };
    if let Err(e) = result {
        eprintln!("echo: {e}");
        std::process::exit(1);
    }
}

fn count(arg: Option<&String>) -> u32 {
    arg.map_or(1000, |s| s.parse().expect("COUNT is a number"))
}

type BoxError = Box<dyn std::error::Error>;

/// Echoes every message to its sender, until the endpoint is closed.
fn serve(addr: &str) -> Result<(), BoxError> {
    let server = Endpoint::open(Config::from_env()?)?;
    let bound = server.listen(addr)?;
    eprintln!("echo: serving {} on {bound}", server.kind());
    run_server(&server)
}

fn run_server(server: &Endpoint) -> Result<(), BoxError> {
    for event in server.events() {
        match event? {
            Event::Connected { addr, .. } => eprintln!("echo: {addr} connected"),
            // Sent back as it is: the received buffer, no copy.
            Event::Message(m) => server.send_buffer(m.peer(), m.into_buffer())?,
            Event::Closed { addr, .. } => eprintln!("echo: {addr:?} closed"),
            Event::Lost { why, .. } => eprintln!("echo: {why}"),
            _ => {}
        }
    }
    Ok(())
}

/// Message `i`: a length from 1 B to 1 MiB, a pattern, and (from 8 bytes
/// up) the CRC-32C of the rest in its last four bytes.
fn message(i: u32) -> Vec<u8> {
    let len = [1, 64, 256, 4096, 65536, 1 << 20][i as usize % 6] + (i as usize % 7);
    let mut m: Vec<u8> = (0..len)
        .map(|k| (k as u32 ^ i.wrapping_mul(2654435761)) as u8)
        .collect();
    if len >= 8 {
        let crc = zerohop_core::crc32c(0, &m[..len - 4]);
        m[len - 4..].copy_from_slice(&crc.to_le_bytes());
    }
    m
}

fn client(addr: &str, count: u32) -> Result<(), BoxError> {
    let client = Endpoint::open(Config::from_env()?)?;
    let peer = client.connect(addr, WAIT)?;
    let t0 = Instant::now();
    let mut bytes = 0usize;
    for i in 0..count {
        let m = message(i);
        client.send(peer, &m)?;
        let echo = client.recv(WAIT)?;
        let mut got = vec![0u8; echo.len()];
        client.copy_out(&echo, &mut got)?;
        if got != m {
            return Err(format!(
                "echo {i} of {count} differs ({} bytes sent, {} back)",
                m.len(),
                got.len()
            )
            .into());
        }
        bytes += m.len();
    }
    let stats = client.stats(peer).ok_or("the server went away")?;
    println!(
        "echo: {count} messages ({:.1} MiB) over {} to {addr}, every echo intact, in {:.2?}; sent {} / received {} messages",
        bytes as f64 / (1 << 20) as f64,
        client.kind(),
        t0.elapsed(),
        stats.messages_sent,
        stats.messages_received,
    );
    client.close(WAIT)?;
    Ok(())
}

/// Server and client in one process: what CI runs.
fn selftest(count: u32) -> Result<(), BoxError> {
    let server = Endpoint::open(Config::from_env()?)?;
    let host = std::env::var("ZEROHOP_RDMA_ADDR")
        .or_else(|_| std::env::var("RXE_ADDR"))
        .unwrap_or_else(|_| "127.0.0.1".into());
    let bound = server.listen(format!("{host}:0"))?;
    std::thread::scope(|s| {
        let serving = s.spawn(|| run_server(&server).map_err(|e| e.to_string()));
        let r = client(&bound.to_string(), count);
        server.close(WAIT).map_err(|e| e.to_string())?;
        serving.join().expect("the server thread")?;
        r.map_err(|e| e.to_string())
    })?;
    Ok(())
}
