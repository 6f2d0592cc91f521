//! Gossip in a full mesh: N processes, each listening and connected to
//! every other, each sending every other a stream of transactions and
//! blocks (256 B to 1 MiB) and checking everything it receives: whole
//! (a CRC-32C over each message), from the peer it says, in order, none
//! missing. What a validator's node does with its peers.
//!
//! ```sh
//! cargo run --release --example gossip -- --spawn 8           # 8 processes on 127.0.0.1
//! cargo run --release --example gossip -- --spawn 8 --messages 500 --host 192.0.2.1
//! ```
//!
//! `--spawn N` starts N copies of itself as nodes (`--node`), tells each
//! every node's address, and exits non-zero unless every node checked out.
//! The transport is the one `ZEROHOP_TRANSPORT` asks for (else the best
//! this host runs).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use zerohop::{Config, Endpoint, Event, Peer};

const WAIT: Duration = Duration::from_secs(60);

type BoxError = Box<dyn std::error::Error>;

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().filter_or("ZEROHOP_LOG", "warn"))
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| {
        let i = args.iter().position(|a| a == name)?;
        args.get(i + 1).cloned()
    };
    let messages: u32 = flag("--messages").map_or(200, |m| m.parse().expect("--messages N"));
    let host = flag("--host")
        .unwrap_or_else(|| std::env::var("RXE_ADDR").unwrap_or_else(|_| "127.0.0.1".into()));
    let result = if let Some(id) = flag("--node") {
        node(id.parse().expect("--node ID"), &host, messages)
    } else {
        let n: usize = flag("--spawn").map_or(8, |n| n.parse().expect("--spawn N"));
        spawn(n, &host, messages)
    };
    if let Err(e) = result {
        eprintln!("gossip: {e}");
        std::process::exit(1);
    }
}

/// Message `seq` from node `from`: a size a gossiping node sends (a 256 B
/// control frame, 1–4 KiB transactions, 16–64 KiB fragments, a 1 MiB block
/// now and then), its header (from, seq), a pattern, and the CRC-32C of
/// everything before its last four bytes.
fn message(from: u32, seq: u32) -> Vec<u8> {
    let sizes = [256, 1024, 4096, 16 << 10, 2048, 64 << 10, 3000, 1 << 20];
    let len = sizes[(seq as usize * 7 + from as usize) % sizes.len()];
    let mut m: Vec<u8> = (0..len)
        .map(|k| (k as u32).wrapping_mul(31) as u8 ^ (from as u8) ^ (seq as u8))
        .collect();
    m[..4].copy_from_slice(&from.to_le_bytes());
    m[4..8].copy_from_slice(&seq.to_le_bytes());
    let crc = zerohop_core::crc32c(0, &m[..len - 4]);
    m[len - 4..].copy_from_slice(&crc.to_le_bytes());
    m
}

/// Checks a received message; `(from, seq)`.
fn check(m: &[u8]) -> Result<(u32, u32), String> {
    if m.len() < 12 {
        return Err(format!("a message of {} bytes", m.len()));
    }
    let (body, crc) = m.split_at(m.len() - 4);
    if zerohop_core::crc32c(0, body).to_le_bytes() != crc {
        return Err(format!("a corrupt message of {} bytes", m.len()));
    }
    let from = u32::from_le_bytes(body[..4].try_into().expect("4 bytes"));
    let seq = u32::from_le_bytes(body[4..8].try_into().expect("4 bytes"));
    if body.len() + 4 != message(from, seq).len() {
        return Err(format!(
            "message {seq} from node {from} has the wrong length"
        ));
    }
    Ok((from, seq))
}

/// One node: listens, learns every address, connects to the nodes before
/// it (the ones after connect to it), sends to all, checks all it gets.
fn node(id: u32, host: &str, messages: u32) -> Result<(), BoxError> {
    let ep = Endpoint::open(Config::from_env()?)?;
    let bound = ep.listen(format!("{host}:0"))?;
    println!("PORT {}", bound.port());
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let addrs: Vec<String> = line.split_whitespace().map(String::from).collect();
    let n = addrs.len() as u32;
    // Who is who: a peer's first message is its id.
    let mut ids: HashMap<Peer, u32> = HashMap::new();
    let mut out: Vec<Peer> = Vec::new();
    for (j, addr) in addrs.iter().enumerate().take(id as usize) {
        let p = ep.connect(addr.as_str(), WAIT)?;
        ep.send(p, &id.to_le_bytes())?;
        ids.insert(p, j as u32);
        out.push(p);
    }
    let t0 = Instant::now();
    let mut next = vec![0u32; n as usize];
    // Per peer (in `out`'s order): messages sent, and the next one, built once.
    let mut sent: Vec<u32> = Vec::new();
    let mut ready: Vec<Option<Vec<u8>>> = Vec::new();
    let want = (n - 1) * messages;
    let mut got = 0u32;
    // Sends that cannot go at once wait while this node reads: a node that
    // blocked in a send would stop taking what its peers send it, and a mesh
    // of them could wait on each other for ever.
    while got < want || sent.iter().any(|&s| s < messages) || out.len() < (n - 1) as usize {
        if t0.elapsed() > WAIT {
            return Err(format!("node {id}: {got} of {want} messages after {WAIT:?}").into());
        }
        sent.resize(out.len(), 0);
        ready.resize(out.len(), None);
        let mut waiting = false;
        for (k, &p) in out.iter().enumerate() {
            if sent[k] == messages {
                continue;
            }
            let m = ready[k].get_or_insert_with(|| message(id, sent[k]));
            match ep.send_timeout(p, m, Duration::ZERO) {
                Ok(()) => {
                    sent[k] += 1;
                    ready[k] = None;
                }
                Err(e) if e.is_timeout() => waiting = true,
                Err(e) => return Err(format!("node {id}: {e}").into()),
            }
        }
        let idle = waiting || sent.iter().all(|&s| s == messages);
        let event = match ep.next_event(Duration::from_millis(u64::from(idle))) {
            Ok(e) => e,
            Err(e) if e.is_timeout() => continue,
            Err(e) => return Err(e.into()),
        };
        match event {
            Event::Message(m) => {
                let bytes = m.bytes().ok_or("a message outside host memory")?;
                let Some(&known) = ids.get(&m.peer()) else {
                    // The first message of a node that connected to us: its id.
                    let from =
                        u32::from_le_bytes(bytes.try_into().map_err(|_| "a bad introduction")?);
                    ids.insert(m.peer(), from);
                    out.push(m.peer());
                    continue;
                };
                let (from, seq) = check(bytes).map_err(|e| format!("node {id}: {e}"))?;
                if known != from {
                    return Err(format!("node {id}: node {known} sent as node {from}").into());
                }
                if seq != next[from as usize] {
                    return Err(format!(
                        "node {id}: from node {from}, message {seq} where {} was due",
                        next[from as usize]
                    )
                    .into());
                }
                next[from as usize] += 1;
                got += 1;
            }
            Event::Lost { why, .. } => return Err(format!("node {id}: {why}").into()),
            _ => {}
        }
    }
    ep.close(WAIT)?;
    let total: u32 = sent.iter().sum();
    println!(
        "DONE node {id}: sent {total} and checked {got} messages in {:.2?} over {}",
        t0.elapsed(),
        ep.kind()
    );
    Ok(())
}

/// Starts `n` nodes, gives each the others' addresses, and waits for all.
fn spawn(n: usize, host: &str, messages: u32) -> Result<(), BoxError> {
    let me = std::env::current_exe()?;
    let mut nodes = Vec::new();
    let mut addrs = Vec::new();
    for id in 0..n {
        let mut child = Command::new(&me)
            .args([
                "--node",
                &id.to_string(),
                "--host",
                host,
                "--messages",
                &messages.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let mut out = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        let mut line = String::new();
        out.read_line(&mut line)?;
        let port = line
            .strip_prefix("PORT ")
            .ok_or_else(|| format!("node {id} said {line:?}"))?;
        addrs.push(format!("{host}:{}", port.trim()));
        nodes.push((child, out));
    }
    let list = addrs.join(" ") + "\n";
    for (child, _) in &mut nodes {
        child
            .stdin
            .take()
            .ok_or("no stdin")?
            .write_all(list.as_bytes())?;
    }
    let mut failed = 0;
    for (id, (mut child, mut out)) in nodes.into_iter().enumerate() {
        let mut report = String::new();
        out.read_line(&mut report)?;
        let ok = child.wait()?.success() && report.starts_with("DONE");
        if !ok {
            failed += 1;
            eprintln!("gossip: node {id} failed");
        } else {
            print!("{report}");
        }
    }
    if failed > 0 {
        return Err(format!("{failed} of {n} nodes failed").into());
    }
    println!("gossip: {n} nodes in a full mesh, {messages} messages from each to each, every one checked");
    Ok(())
}
