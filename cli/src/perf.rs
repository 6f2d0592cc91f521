//! `zerohop perf`: one-way latency from ping-pong (RTT / 2, as perftest and
//! ucx_perftest report it) and streaming bandwidth, over a size sweep,
//! through the `zerohop` endpoint an application uses.
//!
//! Client and server speak a small control protocol over the endpoint: a
//! session starts with the client's [`START`] (answered by the server), then
//! one latency command ([`LATENCY`] or [`LATENCY_COPYING`]) and one
//! [`STREAM`] command per size, then [`QUIT`]. Only
//! the peer that started a session controls it: others' messages are
//! dropped, and a peer that connects, sends garbage or leaves costs the
//! server nothing but a log line.

use std::time::{Duration, Instant};

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use zerohop::{Config, Endpoint, Event, Kind, Message, Peer, Preference};

use crate::idle;

#[derive(Args, Debug)]
pub struct PerfArgs {
    /// Transport: auto, gpudirect, rdma, uma, shm, tcp (default: $ZEROHOP_TRANSPORT, else auto).
    #[arg(long)]
    transport: Option<String>,
    /// Serve `--connect` runs on ADDR (a host name or IP, with a port), one
    /// session (or every session, with `--loop`).
    #[arg(long, conflicts_with = "connect")]
    listen: Option<String>,
    /// With `--listen`: serve run after run, until killed (as ucx_perftest's server does).
    #[arg(short = 'l', long = "loop", requires = "listen")]
    serve_forever: bool,
    /// Run against a `--listen` peer at ADDR (a host name or IP, with a port).
    #[arg(long)]
    connect: Option<String>,
    /// With `--connect`: first open this many more peers of the listener (TCP
    /// connections, or same-host lanes with shm and uma), each saying Hello
    /// and then nothing, and keep them for the run (what a node gossiping
    /// with many peers looks like to its server).
    #[arg(long, default_value_t = 0, requires = "connect")]
    idle_peers: usize,
    /// With `--idle-peers`: hold the idle connections this many seconds and
    /// exit, running nothing (to sample the listener's idle CPU).
    #[arg(long, requires = "idle_peers")]
    hold: Option<u64>,
    /// Message sizes (bytes, k/M suffixes), each at most the endpoint's longest message.
    #[arg(long, value_delimiter = ',', default_value = "64,4k,64k,1M")]
    sizes: Vec<String>,
    /// Ping-pong round trips per size, at least 1 (fewer for large sizes: at most 256 MiB moved each way).
    #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..=MAX_COUNT as u64))]
    iters: u64,
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
    /// Machine-readable output (one JSON document, with an `error` object on failure).
    #[arg(long)]
    json: bool,
}

/// The JSON document's version: 2 added `schema`, the counts per row and `error`.
const SCHEMA: u32 = 2;

#[derive(Serialize, Clone, Debug)]
pub struct Row {
    pub size: usize,
    /// Round trips timed (after the warm-up).
    pub round_trips: usize,
    /// Messages streamed for the bandwidth figure.
    pub stream_messages: usize,
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
    schema: u32,
    transport: &'static str,
    mode: String,
    zero_copy: bool,
    skipped: Vec<String>,
    rows: Vec<Row>,
    error: Option<Failure>,
}

/// What went wrong, and which flag it concerns.
#[derive(Serialize, Clone, Debug)]
pub struct Failure {
    /// The flag and its value (`--connect host:7470`), when one is to blame.
    flag: Option<String>,
    message: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.flag {
            Some(flag) => write!(f, "{flag}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for Failure {}

fn fail(flag: Option<String>, e: impl std::fmt::Display) -> Failure {
    Failure {
        flag,
        message: e.to_string(),
    }
}

impl From<zerohop::Error> for Failure {
    fn from(e: zerohop::Error) -> Failure {
        fail(None, e)
    }
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

// The control protocol. A session starts with START (answered by START
// itself); commands are 17 bytes: tag, size, count.
const START: &[u8; 8] = b"zhperf\x03S";
/// The answer to a START while another peer holds the session.
const BUSY: &[u8; 8] = b"zhperf\x03B";
/// How long a session's holder may go quiet (between commands, or within
/// one) before the listener ends its session: a stranger that starts one
/// and says nothing holds the listener no longer. Within a command, a
/// second more per MB of its message size (see [`quiet_for`]).
const QUIET: Duration = Duration::from_secs(5);

/// The quiet limit within a command of `size`-byte messages: a slow wire
/// (Soft-RoCE moves ~16 MB/s) takes seconds over each large one.
fn quiet_for(size: usize) -> Duration {
    QUIET + Duration::from_secs((size as u64).div_ceil(1_000_000))
}
/// Round trips whose echo is the buffer received, sent back as it is (a
/// zero-copy client's: no byte copied on either side).
const LATENCY: u8 = b'L';
/// Round trips whose echo is the server's own bytes, sent by copy, as a
/// copying client sends its own: what ucx_perftest's and perftest's
/// servers do, each side sending from its buffer and receiving into one.
/// (An echo of the buffer just received sends lines the server's copy in
/// has just written: the client's copy out takes each from the server's
/// core, which an unchanged buffer's do not.)
const LATENCY_COPYING: u8 = b'C';
const STREAM: u8 = b'B';
const QUIT: u8 = b'Q';
const WARMUP: usize = 100;
/// The most round trips or messages a command may ask for.
const MAX_COUNT: usize = 100_000_000;
const LONG: Duration = Duration::from_secs(60);

fn command(tag: u8, size: usize, count: usize) -> [u8; 17] {
    let mut m = [0u8; 17];
    m[0] = tag;
    m[1..9].copy_from_slice(&(size as u64).to_le_bytes());
    m[9..17].copy_from_slice(&(count as u64).to_le_bytes());
    m
}

/// A command, if `m` is one (its bytes read wherever they lie).
fn read_command(ep: &Endpoint, m: &Message) -> Option<(u8, usize, usize)> {
    let mut b = [0u8; 17];
    if m.len() != b.len() || ep.copy_out(m, &mut b).is_err() {
        return None;
    }
    let size = usize::try_from(u64::from_le_bytes(b[1..9].try_into().ok()?)).ok()?;
    let count = usize::try_from(u64::from_le_bytes(b[9..17].try_into().ok()?)).ok()?;
    Some((b[0], size, count))
}

fn is_start(ep: &Endpoint, m: &Message) -> bool {
    is(ep, m, START)
}

/// Whether `m` is the control message `what`.
fn is(ep: &Endpoint, m: &Message, what: &[u8; 8]) -> bool {
    let mut b = [0u8; 8];
    m.len() == b.len() && ep.copy_out(m, &mut b).is_ok() && &b == what
}

/// The next message from `owner`; others' messages are dropped (a session
/// start answered busy), and other peers' comings and goings noted. The owner's end is an error. `timeout`
/// bounds the wait for the first event, then the rest of the wait once
/// another event came first (at most twice `timeout` in all): the clock is
/// read only then, so the echo of a latency run reads none.
fn next_from(ep: &Endpoint, owner: Peer, timeout: Duration) -> Result<Message, zerohop::Error> {
    let mut until: Option<Option<Instant>> = None;
    loop {
        let left = until.map_or(timeout, |u| {
            u.map_or(Duration::MAX, |u| {
                u.saturating_duration_since(Instant::now())
            })
        });
        match ep.next_event(left)? {
            Event::Message(m) if m.peer() == owner => return Ok(m),
            Event::Message(m) if is_start(ep, &m) => {
                log::info!(
                    "perf: {:?} asked for a session while another holds it: busy",
                    ep.peer_addr(m.peer())
                );
                // Without waiting: a stranger that takes nothing must not
                // hold up the session's echoes.
                let _ = ep.send_timeout(m.peer(), BUSY, Duration::ZERO);
            }
            Event::Message(m) => log::info!(
                "perf: dropped {} bytes from {:?}, which does not hold the session",
                m.len(),
                ep.peer_addr(m.peer())
            ),
            Event::Closed { peer, .. } if peer == owner => {
                return Err(zerohop::Error::Peer {
                    peer,
                    addr: ep.peer_addr(peer),
                    error: zerohop_core::Error::PeerClosed(zerohop_core::PeerId(peer.id())),
                })
            }
            Event::Lost { peer, why, .. } if peer == owner => return Err(why),
            e => log::info!("perf: {e:?}"),
        }
        until.get_or_insert_with(|| Instant::now().checked_add(timeout));
    }
}

/// Serves sessions: one, or (`forever`) one after another; `announce`
/// says on stderr how each went.
fn serve(ep: &Endpoint, forever: bool, announce: bool) -> Result<(), Failure> {
    loop {
        let owner = await_start(ep)?;
        let who = ep
            .peer_addr(owner)
            .map_or_else(|| owner.to_string(), |a| a.to_string());
        match session(ep, owner) {
            Ok(()) if announce => eprintln!("zerohop perf: session with {who} done"),
            Ok(()) => {}
            Err(e) if forever => eprintln!("zerohop perf: session with {who} ended: {e}"),
            Err(e) => return Err(fail(None, format!("the session with {who}: {e}"))),
        }
        if !forever {
            return Ok(());
        }
    }
}

/// Waits for a peer's START and answers it: that peer holds the session.
fn await_start(ep: &Endpoint) -> Result<Peer, Failure> {
    loop {
        match ep.next_event(Duration::MAX)? {
            Event::Message(m) if is_start(ep, &m) => {
                let owner = m.peer();
                drop(m);
                if let Err(e) = ep.send(owner, START) {
                    eprintln!("zerohop perf: answering a session start: {e}");
                    continue;
                }
                return Ok(owner);
            }
            Event::Message(m) => log::info!(
                "perf: dropped {} bytes from {:?} before any session",
                m.len(),
                ep.peer_addr(m.peer())
            ),
            Event::Lost { why, .. } => log::info!("perf: {why}"),
            e => log::info!("perf: {e:?}"),
        }
    }
}

/// One session: the owner's commands until QUIT.
fn session(ep: &Endpoint, owner: Peer) -> Result<(), zerohop::Error> {
    let bad = |why: &str| zerohop::Error::BadConfig(format!("perf: {why}"));
    loop {
        let m = next_from(ep, owner, QUIET)?;
        let Some((tag, size, count)) = read_command(ep, &m) else {
            return Err(bad(
                "the session's holder sent something that is not a command",
            ));
        };
        drop(m);
        if count > MAX_COUNT || size > ep.max_message() {
            return Err(bad("a command beyond the limits (count or size)"));
        }
        match tag {
            LATENCY => {
                for _ in 0..count {
                    let m = next_from(ep, owner, quiet_for(size))?;
                    ep.send_buffer(owner, m.into_buffer())?; // zero-copy echo
                }
            }
            LATENCY_COPYING => {
                let own = vec![0x5Au8; size];
                for _ in 0..count {
                    drop(next_from(ep, owner, quiet_for(size))?);
                    ep.send(owner, &own)?;
                }
            }
            STREAM => {
                let mut bytes = 0u64;
                for _ in 0..count {
                    bytes += next_from(ep, owner, quiet_for(size))?.len() as u64;
                }
                ep.send(owner, &bytes.to_le_bytes())?;
            }
            QUIT => return Ok(()),
            _ => return Err(bad("an unknown command")),
        }
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6 / 2.0 // one-way: half the round trip
}

/// Runs the sweep against the server at `peer`; each row goes to `done`
/// as its size finishes.
fn client(
    ep: &Endpoint,
    peer: Peer,
    plan: &Plan,
    bar: &ProgressBar,
    done: &mut dyn FnMut(&Row),
) -> Result<Vec<Row>, zerohop::Error> {
    ep.send(peer, START)?;
    let answer = ep.recv(LONG)?;
    if is(ep, &answer, BUSY) {
        return Err(zerohop::Error::BadConfig(
            "perf: the listener is serving another client's session (try again once it is done)"
                .into(),
        ));
    }
    if !is_start(ep, &answer) {
        return Err(zerohop::Error::BadConfig(
            "perf: the listener did not answer the session start (another program, or another version of perf)"
                .into(),
        ));
    }
    drop(answer);
    let mut rows = Vec::new();
    for &size in &plan.sizes {
        let buf = vec![0xA5u8; size];
        // One message: the caller's bytes (copied as the wire needs), or a
        // pool buffer sent as it is.
        let send_one = || {
            if plan.zero_copy {
                // Waiting while the pool is dry: a stream of small leases
                // outruns the wire, and its queue holds every buffer.
                ep.send_buffer(peer, ep.lease_timeout(size, LONG)?)
            } else {
                ep.send(peer, &buf)
            }
        };
        bar.set_message(format!("{}: latency", human(size)));
        let n = plan.round_trips(size);
        let echo = if plan.zero_copy {
            LATENCY
        } else {
            LATENCY_COPYING
        };
        ep.send(peer, &command(echo, size, n + WARMUP))?;
        // One clock read per round trip, as perftest's latency tests take
        // one cycle-counter read per iteration: a round trip is the time
        // from one send to the next, the receive and its bookkeeping included.
        let mut stamps = Vec::with_capacity(n + 1);
        for i in 0..n + WARMUP {
            if i >= WARMUP {
                stamps.push(Instant::now());
            }
            send_one()?;
            let r = ep.recv(LONG)?;
            if r.len() != size {
                return Err(zerohop::Error::BadConfig(
                    "perf: an echo of the wrong size".into(),
                ));
            }
        }
        stamps.push(Instant::now()); // the end of the last round trip
        let mut rtts: Vec<Duration> = stamps.windows(2).map(|w| w[1] - w[0]).collect();
        rtts.sort_unstable();
        bar.inc(1);

        bar.set_message(format!("{}: bandwidth", human(size)));
        let count = plan.stream_count(size);
        ep.send(peer, &command(STREAM, size, count))?;
        let t0 = Instant::now();
        for _ in 0..count {
            send_one()?;
        }
        let ack = ep.recv(LONG)?;
        let secs = t0.elapsed().as_secs_f64();
        let mut got = [0u8; 8];
        if ack.len() != got.len() || ep.copy_out(&ack, &mut got).is_err() {
            return Err(zerohop::Error::BadConfig(
                "perf: a bad acknowledgement".into(),
            ));
        }
        let got = u64::from_le_bytes(got);
        if got != (count * size) as u64 {
            return Err(zerohop::Error::BadConfig(
                "perf: the receiver counted a different byte total".into(),
            ));
        }
        bar.inc(1);
        let row = Row {
            size,
            round_trips: n,
            stream_messages: count,
            lat_min_us: percentile(&rtts, 0.0),
            lat_p50_us: percentile(&rtts, 0.5),
            lat_p99_us: percentile(&rtts, 0.99),
            lat_p999_us: percentile(&rtts, 0.999),
            bw_gb_per_s: got as f64 / secs / 1e9,
            msg_per_s: count as f64 / secs,
        };
        done(&row);
        rows.push(row);
    }
    ep.send(peer, &command(QUIT, 0, 0))?;
    Ok(rows)
}

fn human(n: usize) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

fn table_header(transport: &str, mode: &str, skipped: &[String]) -> String {
    let mut s = format!("zerohop perf: transport {transport} ({mode})\n");
    for k in skipped {
        s += &format!("  skipped {k}\n");
    }
    s + &format!(
        "{:>8}  {:>10} {:>10} {:>10} {:>10}   {:>10} {:>12}",
        "size", "lat min", "p50", "p99", "p99.9", "GB/s", "msg/s"
    )
}

fn table_row(row: &Row) -> String {
    format!(
        "{:>8}  {:>8.2}us {:>8.2}us {:>8.2}us {:>8.2}us   {:>10.3} {:>12.0}",
        human(row.size),
        row.lat_min_us,
        row.lat_p50_us,
        row.lat_p99_us,
        row.lat_p999_us,
        row.bw_gb_per_s,
        row.msg_per_s
    )
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
    bar
}

/// The flags, checked before anything is opened or allocated.
fn plan(args: &PerfArgs, config: &Config) -> Result<Plan, Failure> {
    // The longest message this endpoint could take: 64 MiB, or its pool.
    let limit = config
        .max_message
        .unwrap_or(64 << 20)
        .min(config.pool_bytes);
    let mut sizes = Vec::new();
    for s in &args.sizes {
        let flag = || Some(format!("--sizes {s}"));
        let n = zerohop_std::parse_bytes(s)
            .filter(|&n| n > 0)
            .ok_or_else(|| fail(flag(), "not a byte count (e.g. 64, 4k, 1M)"))?;
        if n > limit {
            return Err(fail(
                flag(),
                format!(
                    "{n} bytes is longer than a message may be here ({} bytes: the least of 64 MiB and ZEROHOP_POOL_BYTES)",
                    limit
                ),
            ));
        }
        sizes.push(n);
    }
    let stream_bytes = zerohop_std::parse_bytes(&args.stream_bytes)
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            fail(
                Some(format!("--stream-bytes {}", args.stream_bytes)),
                "not a positive byte count",
            )
        })?;
    Ok(Plan {
        sizes,
        iters: args.iters as usize,
        zero_copy: args.zero_copy,
        stream_bytes,
    })
}

pub fn run(args: &PerfArgs) -> Result<(), Box<dyn std::error::Error>> {
    let mut config = Config::from_env()?;
    // The flag overrides ZEROHOP_TRANSPORT, through the same parser and pick.
    if let Some(t) = &args.transport {
        config.transport =
            Preference::parse(t).map_err(|e| fail(Some(format!("--transport {t}")), e))?;
    }
    let plan = plan(args, &config)?;
    // Progress in the caller's thread, as ucx_perftest drives its worker:
    // each side of a run is one thread that sends, receives and progresses.
    config.spin = Duration::from_micros(args.spin_us);
    config.progress_thread = false;
    let transport_flag = || args.transport.as_ref().map(|t| format!("--transport {t}"));
    if let Some(addr) = &args.listen {
        let ep = Endpoint::open(config).map_err(|e| fail(transport_flag(), e))?;
        let bound = ep
            .listen(addr.as_str())
            .map_err(|e| fail(Some(format!("--listen {addr}")), e))?;
        eprintln!("zerohop perf: serving {} on {bound}", ep.kind());
        return Ok(serve(&ep, args.serve_forever, true)?);
    }
    if let (Some(addr), Some(secs)) = (&args.connect, args.hold) {
        let idle = idle::peers(addr, args.idle_peers, &config)
            .map_err(|e| fail(Some(format!("--connect {addr}")), e))?;
        eprintln!(
            "zerohop perf: holding {} idle peers for {secs} s",
            idle.count()
        );
        std::thread::sleep(Duration::from_secs(secs));
        return Ok(());
    }
    let bar = progress(2 * plan.sizes.len() as u64, args.json);
    let mut report = Report {
        schema: SCHEMA,
        transport: "",
        mode: String::new(),
        zero_copy: plan.zero_copy,
        skipped: Vec::new(),
        rows: Vec::new(),
        error: None,
    };
    let result = measure(args, config, &plan, &bar, &mut report);
    bar.finish_and_clear();
    if let Err(e) = &result {
        report.error = Some(e.clone());
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else if result.is_ok() {
        println!("latency is one-way (half the ping-pong round trip), as perftest and ucx_perftest report it");
    }
    Ok(result?)
}

/// Opens the endpoints, runs the sweep, and fills `report` as it goes
/// (rows printed as each size finishes, unless the output is JSON).
fn measure(
    args: &PerfArgs,
    config: Config,
    plan: &Plan,
    bar: &ProgressBar,
    report: &mut Report,
) -> Result<(), Failure> {
    let transport_flag = || args.transport.as_ref().map(|t| format!("--transport {t}"));
    let ep = Endpoint::open(config).map_err(|e| fail(transport_flag(), e))?;
    report.transport = ep.kind().name();
    report.skipped = ep.choice().skipped().map(|s| s.to_string()).collect();
    let gpu = if ep.kind() == Kind::Gpudirect {
        ", payloads in GPU memory"
    } else {
        ""
    };
    let json = args.json;
    let mut rows_so_far = Vec::new();
    let mut print = |row: &Row| {
        if !json {
            bar.suspend(|| println!("{}", table_row(row)));
        }
        rows_so_far.push(row.clone());
    };
    let result = match &args.connect {
        Some(addr) => {
            let flag = || Some(format!("--connect {addr}"));
            let _idle = match args.idle_peers {
                0 => None,
                n => Some(idle::peers(addr, n, &config).map_err(|e| fail(flag(), e))?),
            };
            let peer = ep
                .connect(addr.as_str(), Duration::from_secs(10))
                .map_err(|e| fail(flag(), e))?;
            report.mode = match args.idle_peers {
                0 => format!("to {addr}{gpu}"),
                n => format!("to {addr}, beside {n} idle peers{gpu}"),
            };
            if !json {
                bar.suspend(|| {
                    println!(
                        "{}",
                        table_header(report.transport, &report.mode, &report.skipped)
                    )
                });
            }
            let r = client(&ep, peer, plan, bar, &mut print).map_err(|e| fail(flag(), e));
            let _ = ep.close(LONG);
            r
        }
        None => in_process(ep, config, plan, bar, &mut print, report, json),
    };
    report.rows = rows_so_far;
    result.map(|_| ())
}

/// Server and client in one process: the server in a thread of its own.
fn in_process(
    client_ep: Endpoint,
    mut config: Config,
    plan: &Plan,
    bar: &ProgressBar,
    print: &mut dyn FnMut(&Row),
    report: &mut Report,
    json: bool,
) -> Result<Vec<Row>, Failure> {
    // An RDMA connect waits for the listener's answer while this thread
    // connects: the listener keeps a progress thread, which stays out of the
    // way once its thread serves.
    config.progress_thread = true;
    let server = Endpoint::open(config)?;
    let host = match server.kind() {
        Kind::Rdma | Kind::Gpudirect => rdma_host().map_err(|e| fail(None, e))?,
        _ => "127.0.0.1".into(),
    };
    let addr = server.listen(format!("{host}:0"))?;
    report.mode = format!("in one process, over {addr}");
    if !json {
        bar.suspend(|| {
            println!(
                "{}",
                table_header(report.transport, &report.mode, &report.skipped)
            )
        });
    }
    let peer = client_ep.connect(addr, Duration::from_secs(10))?;
    std::thread::scope(|s| {
        let serving = s.spawn(|| serve(&server, false, false));
        let rows = client(&client_ep, peer, plan, bar, print);
        if rows.is_err() {
            // The server waits for a command that will not come: end it.
            let _ = client_ep.close(Duration::ZERO);
            let _ = server.close(Duration::ZERO);
        }
        let served = serving
            .join()
            .unwrap_or_else(|_| Err(fail(None, "perf: the server thread panicked")));
        let rows = rows?;
        served?;
        // Close both: every send delivered (the last acknowledgement included).
        client_ep.close(LONG)?;
        server.close(LONG)?;
        Ok(rows)
    })
}

/// The address in-process RDMA runs listen on: `$ZEROHOP_RDMA_ADDR`, else
/// `$RXE_ADDR` (set in the Soft-RoCE VM); it must belong to the RDMA device's netdev.
fn rdma_host() -> Result<String, String> {
    std::env::var("ZEROHOP_RDMA_ADDR")
        .or_else(|_| std::env::var("RXE_ADDR"))
        .map_err(|_| {
            "set ZEROHOP_RDMA_ADDR to an IP address of the RDMA device's network interface".into()
        })
}
