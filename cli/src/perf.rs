//! `zerohop perf`: one-way latency from ping-pong (RTT / 2, as perftest and
//! ucx_perftest report it) and streaming bandwidth, over a size sweep.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::ops::Deref;

use zerohop_core::{pick, Error, Kind, Lease, PeerId, Pool, Preference};
use zerohop_std::{probe_host, CancelToken, Config, Deadline, Endpoint, EndpointConfig, Wire};

use crate::transports;
#[cfg(feature = "gpudirect-verbs")]
use zerohop_backends::verbs::HostPayload;

#[derive(Args, Debug)]
pub struct PerfArgs {
    /// Transport: auto, gpudirect, rdma, uma, tcp, mock (default: $ZEROHOP_TRANSPORT, else auto).
    #[arg(long)]
    transport: Option<String>,
    /// Serve a remote `--connect` run on ADDR (e.g. 0.0.0.0:7470), until it finishes.
    #[arg(long, conflicts_with = "connect")]
    listen: Option<String>,
    /// Run against a `--listen` peer at ADDR.
    #[arg(long)]
    connect: Option<SocketAddr>,
    /// With `--connect` over TCP: first open this many more connections to
    /// the listener, each saying Hello and then nothing, and keep them for the
    /// run (what a node gossiping with many peers looks like to its server).
    #[arg(long, default_value_t = 0, requires = "connect")]
    idle_peers: usize,
    /// With `--idle-peers`: hold the idle connections this many seconds and
    /// exit, running nothing (to sample the listener's idle CPU).
    #[arg(long, requires = "idle_peers")]
    hold: Option<u64>,
    /// Message sizes (bytes, k/M suffixes).
    #[arg(long, value_delimiter = ',', default_value = "64,4k,64k,1M")]
    sizes: Vec<String>,
    /// Ping-pong round trips per size (fewer for large sizes: at most 256 MiB moved each way).
    #[arg(long, default_value_t = 5000)]
    iters: usize,
    /// Bytes streamed per size for bandwidth (messages: between 1000 and 200000).
    #[arg(long, default_value = "1G")]
    stream_bytes: String,
    /// How long a waiting sender or receiver busy-polls before it sleeps,
    /// microseconds. The default (a second) busy-polls throughout, as perftest
    /// and ucx_perftest do: a thread that sleeps between messages pays a
    /// wake-up per message, and on a small host its idle CPU slows down (on
    /// Soft-RoCE, where a 64 KiB message takes ~4 ms, a 1 ms spin cost 15% of
    /// the bandwidth). Applications may prefer less.
    #[arg(long, default_value_t = 1_000_000)]
    spin_us: u64,
    /// Send from buffers leased from the wire's (registered) send pool and
    /// filled in place, as a zero-copy application does and as perftest
    /// sends its registered buffer, instead of copying the caller's bytes.
    #[arg(long)]
    zero_copy: bool,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize, Clone, Debug)]
pub struct Row {
    pub size: usize,
    /// The fastest round trip's half (perftest's `t_min`): the least a
    /// message costs, where p50 also carries the machine's noise.
    pub lat_min_us: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
    pub lat_p999_us: f64,
    pub bw_gb_per_s: f64,
    pub msg_per_s: f64,
}

#[derive(Serialize, Debug)]
struct Report {
    transport: &'static str,
    mode: String,
    zero_copy: bool,
    skipped: Vec<String>,
    rows: Vec<Row>,
}

#[derive(Clone, Debug)]
struct Plan {
    sizes: Vec<usize>,
    iters: usize,
    zero_copy: bool,
    stream_bytes: usize,
}

impl Plan {
    fn round_trips(&self, size: usize) -> usize {
        self.iters.min((256 << 20) / size.max(1)).max(100)
    }
    fn stream_count(&self, size: usize) -> usize {
        (self.stream_bytes / size.max(1)).clamp(1000, 200_000)
    }
}

// Control messages (client -> server), 17 bytes: tag, size, count.
const LATENCY: u8 = b'L';
const STREAM: u8 = b'B';
const QUIT: u8 = b'Q';
const WARMUP: usize = 100;

fn control(tag: u8, size: usize, count: usize) -> [u8; 17] {
    let mut m = [0u8; 17];
    m[0] = tag;
    m[1..9].copy_from_slice(&(size as u64).to_le_bytes());
    m[9..17].copy_from_slice(&(count as u64).to_le_bytes());
    m
}

/// A control message, read through the endpoint (its bytes may be in GPU memory).
fn read_control<T, P>(ep: &Endpoint<T>, lease: &Lease<P>) -> Option<(u8, usize, usize)>
where
    T: Wire<Lease = Lease<P>>,
    P: Deref<Target: Pool>,
{
    let mut b = [0u8; 17];
    if lease.len() != b.len() || ep.read(lease, &mut b).is_err() {
        return None;
    }
    parse_control(&b)
}

fn parse_control(b: &[u8]) -> Option<(u8, usize, usize)> {
    if b.len() != 17 {
        return None;
    }
    let size = u64::from_le_bytes(b[1..9].try_into().ok()?) as usize;
    let count = u64::from_le_bytes(b[9..17].try_into().ok()?) as usize;
    Some((b[0], size, count))
}

const LONG: Duration = Duration::from_secs(60);

/// Serves one client session: echo for latency, count and acknowledge for streams.
fn serve<T, P>(ep: &Endpoint<T>, cancel: Option<&CancelToken>) -> Result<(), Error>
where
    T: Wire<Lease = Lease<P>>,
    P: Deref<Target: Pool>,
{
    loop {
        let r = ep.recv(Deadline::never(), cancel)?;
        let Some((tag, _size, count)) = read_control(ep, &r.lease) else {
            return Err(Error::Backend("perf: expected a control message"));
        };
        let peer = r.peer;
        drop(r);
        match tag {
            LATENCY => {
                for _ in 0..count {
                    // One deadline for the echo, read before the message
                    // arrives: a clock read between the arrival and the
                    // reply would lengthen the round trip being measured.
                    let deadline = Deadline::after(LONG);
                    let m = ep.recv(deadline, cancel)?;
                    ep.send_lease(peer, m.lease, deadline, cancel)?; // zero-copy echo
                }
            }
            STREAM => {
                let mut bytes = 0u64;
                for _ in 0..count {
                    bytes += ep.recv(Deadline::after(LONG), cancel)?.lease.len() as u64;
                }
                ep.send(peer, &bytes.to_le_bytes(), Deadline::after(LONG), cancel)?;
            }
            QUIT => return Ok(()),
            _ => return Err(Error::Backend("perf: unknown control message")),
        }
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6 / 2.0 // one-way: half the round trip
}

fn client<T, P>(
    ep: &Endpoint<T>,
    peer: PeerId,
    plan: &Plan,
    bar: &ProgressBar,
    cancel: Option<&CancelToken>,
) -> Result<Vec<Row>, Error>
where
    T: Wire<Lease = Lease<P>>,
    P: Deref<Target: Pool>,
{
    let mut rows = Vec::new();
    for &size in &plan.sizes {
        let buf = vec![0xA5u8; size];
        // One message: the caller's bytes (copied as the wire needs), or a
        // pool buffer sent as it is.
        let send_one = |deadline| {
            if plan.zero_copy {
                let lease = ep.lease(size)?;
                ep.send_lease(peer, lease, deadline, cancel)
            } else {
                ep.send(peer, &buf, deadline, cancel)
            }
        };
        let n = plan.round_trips(size);
        ep.send(
            peer,
            &control(LATENCY, size, n + WARMUP),
            Deadline::after(LONG),
            None,
        )?;
        // One clock read per round trip, as perftest's latency tests take
        // one cycle-counter read per iteration: a round trip is the time
        // from one send to the next, the receive and its bookkeeping
        // included, and its deadline follows from the same reading. (Two
        // reads per round trip, and one more per call for its deadline,
        // sat on the path being measured: a read costs ~140 ns in the
        // Soft-RoCE VM.)
        let mut stamps = Vec::with_capacity(n + 1);
        for i in 0..n + WARMUP {
            let now = Instant::now();
            if i >= WARMUP {
                stamps.push(now);
            }
            let deadline = Deadline::at(now + LONG);
            send_one(deadline)?;
            let r = ep.recv(deadline, cancel)?;
            if r.lease.len() != size {
                return Err(Error::Backend("perf: echo of the wrong size"));
            }
        }
        stamps.push(Instant::now()); // the end of the last round trip
        let mut rtts: Vec<Duration> = stamps.windows(2).map(|w| w[1] - w[0]).collect();
        rtts.sort_unstable();
        bar.inc(1);

        let count = plan.stream_count(size);
        ep.send(
            peer,
            &control(STREAM, size, count),
            Deadline::after(LONG),
            None,
        )?;
        let t0 = Instant::now();
        for _ in 0..count {
            send_one(Deadline::after(LONG))?;
        }
        let ack = ep.recv(Deadline::after(LONG), cancel)?;
        let secs = t0.elapsed().as_secs_f64();
        let mut got = [0u8; 8];
        if ack.lease.len() != got.len() || ep.read(&ack.lease, &mut got).is_err() {
            return Err(Error::Backend("perf: bad ack"));
        }
        let got = u64::from_le_bytes(got);
        if got != (count * size) as u64 {
            return Err(Error::Backend(
                "perf: the receiver counted a different byte total",
            ));
        }
        bar.inc(1);
        rows.push(Row {
            size,
            lat_min_us: percentile(&rtts, 0.0),
            lat_p50_us: percentile(&rtts, 0.5),
            lat_p99_us: percentile(&rtts, 0.99),
            lat_p999_us: percentile(&rtts, 0.999),
            bw_gb_per_s: got as f64 / secs / 1e9,
            msg_per_s: count as f64 / secs,
        });
    }
    ep.send(peer, &control(QUIT, 0, 0), Deadline::after(LONG), cancel)?;
    Ok(rows)
}

fn human(n: usize) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

fn print_table(r: &Report) {
    println!("zerohop perf: transport {} ({})", r.transport, r.mode);
    for s in &r.skipped {
        println!("  skipped {s}");
    }
    println!(
        "{:>8}  {:>10} {:>10} {:>10} {:>10}   {:>10} {:>12}",
        "size", "lat min", "p50", "p99", "p99.9", "GB/s", "msg/s"
    );
    for row in &r.rows {
        println!(
            "{:>8}  {:>8.2}us {:>8.2}us {:>8.2}us {:>8.2}us   {:>10.3} {:>12.0}",
            human(row.size),
            row.lat_min_us,
            row.lat_p50_us,
            row.lat_p99_us,
            row.lat_p999_us,
            row.bw_gb_per_s,
            row.msg_per_s
        );
    }
    println!("latency is one-way (half the ping-pong round trip), as perftest and ucx_perftest report it");
}

fn progress(total: u64, json: bool) -> ProgressBar {
    if json {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message("measuring");
    bar
}

fn in_process<T, P>(
    server: Endpoint<T>,
    client_ep: Endpoint<T>,
    peer: PeerId,
    plan: &Plan,
    bar: &ProgressBar,
) -> Result<Vec<Row>, Error>
where
    T: Wire<Lease = Lease<P>>,
    P: Deref<Target: Pool>,
{
    // Whichever side fails first cancels the other, which would otherwise
    // wait out its deadline (or, for the server's next command, forever)
    // for a message that will not come; the first failure is the one reported.
    fn cancel_on_error<R>(token: &CancelToken, r: Result<R, Error>) -> Result<R, Error> {
        if r.is_err() {
            token.cancel();
        }
        r
    }
    let failed = CancelToken::new();
    let rows = std::thread::scope(|s| {
        let srv = s.spawn(|| cancel_on_error(&failed, serve(&server, Some(&failed))));
        let rows = cancel_on_error(&failed, client(&client_ep, peer, plan, bar, Some(&failed)));
        let served = srv
            .join()
            .unwrap_or(Err(Error::Backend("perf: the server thread panicked")));
        match (rows, served) {
            (Ok(rows), Ok(())) => Ok(rows),
            (Err(Error::Cancelled), Err(e)) | (Err(e), _) | (Ok(_), Err(e)) => Err(e),
        }
    })?;
    // Close both: every send delivered (the last acknowledgement included).
    client_ep.close(Deadline::after(LONG))?;
    server.close(Deadline::after(LONG))?;
    Ok(rows)
}

pub fn run(args: &PerfArgs) -> Result<(), Box<dyn std::error::Error>> {
    let config = Config::from_env()?;
    // The flag overrides ZEROHOP_TRANSPORT, through the same parser and pick.
    let preference = match &args.transport {
        Some(t) => Preference::parse(t).map_err(|e| format!("--transport {t:?}: {e}"))?,
        None => config.transport,
    };
    let choice = pick(preference, &probe_host())?;
    let mut sizes = Vec::new();
    for s in &args.sizes {
        sizes.push(
            zerohop_std::parse_bytes(s)
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("--sizes: {s:?} is not a byte count"))?,
        );
    }
    let plan = Plan {
        sizes,
        iters: args.iters.max(1),
        zero_copy: args.zero_copy,
        stream_bytes: zerohop_std::parse_bytes(&args.stream_bytes)
            .ok_or("--stream-bytes: not a byte count")?,
    };
    let kind = choice.kind;
    let skipped: Vec<String> = choice.skipped().map(|s| s.to_string()).collect();
    let bar = progress(2 * plan.sizes.len() as u64, args.json);
    let budget = config.pool_bytes;
    // Progress in the caller's thread, as ucx_perftest drives its worker:
    // each side of a run is one thread that sends, receives and progresses.
    let ep = EndpointConfig {
        spin: Duration::from_micros(args.spin_us),
        progress_thread: false,
        ..EndpointConfig::default()
    };
    // In one process the listener must accept while the same thread
    // connects (an RDMA connect waits for the listener's answer): it keeps a
    // progress thread, which stays out of the way once its thread serves.
    let listener_ep = EndpointConfig {
        progress_thread: true,
        ..ep
    };
    let (mode, rows) = match (kind, &args.listen, args.connect) {
        (Kind::Tcp | Kind::Uma, Some(addr), _) => {
            let (ep, bound) = transports::tcp_listen(kind, addr, budget, &ep)?;
            eprintln!("zerohop perf: serving {} on {bound}", kind.name());
            serve(&ep, None)?;
            return Ok(());
        }
        (Kind::Tcp | Kind::Uma, None, Some(addr)) => {
            let _idle = match args.idle_peers {
                0 => None,
                n => Some(transports::idle_peers(addr, n)?),
            };
            if let Some(secs) = args.hold {
                eprintln!("zerohop perf: holding {} idle connections for {secs} s", args.idle_peers);
                std::thread::sleep(Duration::from_secs(secs));
                return Ok(());
            }
            let (ep, peer) = transports::tcp_connect(kind, addr, budget, &ep)?;
            let mode = match args.idle_peers {
                0 => format!("to {addr}"),
                n => format!("to {addr}, beside {n} idle connections"),
            };
            (mode, client(&ep, peer, &plan, &bar, None)?)
        }
        (Kind::Tcp | Kind::Uma, None, None) => {
            let (server, addr) = transports::tcp_listen(kind, "127.0.0.1:0", budget, &listener_ep)?;
            let (c, peer) = transports::tcp_connect(kind, addr, budget, &ep)?;
            (
                "in one process, over 127.0.0.1".to_string(),
                in_process(server, c, peer, &plan, &bar)?,
            )
        }
        #[cfg(feature = "gpudirect-verbs")]
        (Kind::Rdma, Some(addr), _) => {
            let addr: SocketAddr = addr.parse().map_err(|e| format!("--listen {addr}: {e}"))?;
            let ep = transports::rdma::listen(addr, budget, &ep, HostPayload)?;
            eprintln!("zerohop perf: serving rdma on {addr}");
            serve(&ep, None)?;
            return Ok(());
        }
        #[cfg(feature = "gpudirect-verbs")]
        (Kind::Rdma, None, Some(addr)) => {
            let (ep, peer) = transports::rdma::connect(addr, budget, &ep, HostPayload)?;
            (format!("to {addr}"), client(&ep, peer, &plan, &bar, None)?)
        }
        #[cfg(feature = "gpudirect-verbs")]
        (Kind::Rdma, None, None) => {
            let addr = transports::rdma::local_addr()?;
            let server = transports::rdma::listen(addr, budget, &listener_ep, HostPayload)?;
            let (c, peer) = transports::rdma::connect(addr, budget, &ep, HostPayload)?;
            (
                format!("in one process, over RDMA RC on {addr}"),
                in_process(server, c, peer, &plan, &bar)?,
            )
        }
        #[cfg(all(feature = "gpudirect-verbs", feature = "cuda-uma"))]
        (Kind::Gpudirect, Some(addr), _) => {
            let addr: SocketAddr = addr.parse().map_err(|e| format!("--listen {addr}: {e}"))?;
            let gpu = transports::rdma::gpu_memory()?;
            let ep = transports::rdma::listen(addr, budget, &ep, gpu)?;
            eprintln!("zerohop perf: serving gpudirect on {addr} (payloads in GPU memory)");
            serve(&ep, None)?;
            return Ok(());
        }
        #[cfg(all(feature = "gpudirect-verbs", feature = "cuda-uma"))]
        (Kind::Gpudirect, None, Some(addr)) => {
            let gpu = transports::rdma::gpu_memory()?;
            let (ep, peer) = transports::rdma::connect(addr, budget, &ep, gpu)?;
            (
                format!("to {addr}, payloads in GPU memory"),
                client(&ep, peer, &plan, &bar, None)?,
            )
        }
        #[cfg(all(feature = "gpudirect-verbs", feature = "cuda-uma"))]
        (Kind::Gpudirect, None, None) => {
            let addr = transports::rdma::local_addr()?;
            let gpu = transports::rdma::gpu_memory()?;
            let server = transports::rdma::listen(addr, budget, &listener_ep, gpu.clone())?;
            let (c, peer) = transports::rdma::connect(addr, budget, &ep, gpu)?;
            (
                format!("in one process, over RDMA RC on {addr}, payloads in GPU memory"),
                in_process(server, c, peer, &plan, &bar)?,
            )
        }
        #[cfg(feature = "mock")]
        (Kind::Mock, None, None) => {
            let max =
                zerohop_backends::mock::MockLink::<{ transports::mock::LINK_BYTES }>::max_payload();
            if let Some(&big) = plan.sizes.iter().find(|&&s| s > max) {
                return Err(format!(
                    "mock link carries at most {max} bytes per message; {big} asked"
                )
                .into());
            }
            let (a, b) = transports::mock::pair(budget, &ep)?;
            (
                "in one process, over the mock link".to_string(),
                in_process(a, b, PeerId(0), &plan, &bar)?,
            )
        }
        #[cfg(not(all(feature = "gpudirect-verbs", feature = "cuda-uma")))]
        (Kind::Gpudirect, _, _) => {
            return Err("perf over gpudirect needs a build with both the gpudirect-verbs and cuda-uma features \
                        (cargo build --release -p zerohop-cli --features gpudirect-verbs,cuda-uma)"
                .into())
        }
        (k, _, _) => {
            return Err(format!(
                "perf over {} is not available in this build for this mode",
                k.name()
            )
            .into())
        }
    };
    bar.finish_and_clear();
    let report = Report {
        transport: kind.name(),
        mode,
        zero_copy: plan.zero_copy,
        skipped,
        rows,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}
