//! The `zerohop` command as a user runs it — and as a stranger pokes at it:
//! `info` and `perf`, their JSON, the errors a bad flag or variable gets,
//! and a `perf --listen` that strays, scanners and hijackers cannot end.
//! Runs on any host (tcp needs nothing). `ZEROHOP_CLI_UNDER_TEST` points
//! the tests at another binary (an older build, to show what they catch).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, ChildStderr, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> String {
    std::env::var("ZEROHOP_CLI_UNDER_TEST").unwrap_or_else(|_| env!("CARGO_BIN_EXE_zerohop").into())
}

fn command(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut c = Command::new(bin());
    c.args(args);
    for var in [
        "ZEROHOP_TRANSPORT",
        "ZEROHOP_POOL_BYTES",
        "ZAP_TRANSPORT",
        "ZAP_UMA_POOL_BYTES",
    ] {
        c.env_remove(var);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

fn zerohop(args: &[&str], env: &[(&str, &str)]) -> Output {
    command(args, env)
        .output()
        .expect("the zerohop binary runs")
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "zerohop failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("valid JSON on stdout")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A port nothing listens on (just freed).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `zerohop perf --listen` on a port it picks itself (a port picked here
/// and freed could be taken by another test before the listener binds it),
/// once it serves.
struct Listener {
    child: Child,
    addr: SocketAddr,
    stderr: BufReader<ChildStderr>,
}

impl Listener {
    fn start(extra: &[&str]) -> Listener {
        Self::start_with(extra, &[], None)
    }

    fn start_with(extra: &[&str], env: &[(&str, &str)], nofile: Option<u32>) -> Listener {
        let mut args = vec!["perf", "--transport", "tcp", "--listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        let mut c = match nofile {
            // A descriptor limit the command cannot raise (hard = soft).
            Some(n) => {
                let mut c = Command::new("prlimit");
                c.arg(format!("--nofile={n}:{n}")).arg(bin()).args(&args);
                for (k, v) in env {
                    c.env(k, v);
                }
                c
            }
            None => command(&args, env),
        };
        let mut child = c
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        // "zerohop perf: serving tcp on ADDR", once it is bound.
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        stderr.read_line(&mut line).unwrap();
        let addr: SocketAddr = line
            .trim_end()
            .rsplit(' ')
            .next()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("the listener did not say where it serves: {line:?}"));
        Listener {
            child,
            addr,
            stderr,
        }
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    fn client(&self, extra: &[&str]) -> Output {
        let a = self.addr.to_string();
        let mut args = vec![
            "perf",
            "--transport",
            "tcp",
            "--connect",
            &a,
            "--sizes",
            "64,4k",
            "--iters",
            "200",
            "--stream-bytes",
            "1M",
            "--json",
        ];
        args.extend_from_slice(extra);
        zerohop(&args, &[])
    }

    /// Waits for the listener to exit; its status and stderr.
    fn finish(mut self) -> (bool, String) {
        let t0 = Instant::now();
        while self.alive() {
            if t0.elapsed() > Duration::from_secs(20) {
                let _ = self.child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let ok = self.child.wait().unwrap().success();
        let mut err = String::new();
        let _ = self.stderr.read_to_string(&mut err);
        (ok, err)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn info_json_names_every_prerequisite_and_a_choice() {
    let r = json(&zerohop(&["info", "--json"], &[]));
    let prereqs = r["prerequisites"].as_array().expect("a list");
    for name in [
        "cuda-driver",
        "ibverbs-device",
        "hca-live",
        "nic-dmabuf",
        "peermem",
    ] {
        let p = prereqs
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("{name} reported"));
        assert!(
            ["present", "missing", "unknown"].contains(&p["status"].as_str().unwrap()),
            "{p}"
        );
        assert!(
            !p["detail"].as_str().unwrap().is_empty(),
            "a reason for {name}"
        );
    }
    // Auto always finds something: tcp at worst.
    assert!(r["chosen"].is_string(), "{r}");
    assert_eq!(r["preference"], "auto");
}

#[test]
fn info_fails_when_the_transport_asked_for_cannot_run() {
    let r = json(&zerohop(&["info", "--json"], &[]));
    let absent = ["gpudirect", "rdma", "uma"]
        .into_iter()
        .find(|k| r["chosen"] != *k && !r["skipped"].as_array().unwrap().is_empty());
    let Some(kind) = absent else {
        eprintln!("SKIPPED: every transport runs here");
        return;
    };
    let out = zerohop(&["info"], &[("ZEROHOP_TRANSPORT", kind)]);
    assert!(
        !out.status.success(),
        "info said nothing was wrong with {kind}"
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("prerequisites"),
        "the report still prints"
    );
    assert!(stderr(&out).contains(kind), "{}", stderr(&out));
    let out = zerohop(&["info", "--json"], &[("ZEROHOP_TRANSPORT", kind)]);
    assert!(!out.status.success());
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(r["error"].is_string(), "{r}");
}

#[test]
fn perf_over_tcp_reports_every_size_with_its_counts_copying_and_zero_copy() {
    for zero_copy in [false, true] {
        let mut args = vec![
            "perf",
            "--transport",
            "tcp",
            "--sizes",
            "64,4k",
            "--iters",
            "200",
            "--stream-bytes",
            "1M",
            "--json",
        ];
        if zero_copy {
            args.push("--zero-copy");
        }
        let r = json(&zerohop(&args, &[("ZEROHOP_POOL_BYTES", "64M")]));
        assert_eq!(r["schema"], 2);
        assert_eq!(r["transport"], "tcp");
        assert_eq!(r["zero_copy"], zero_copy);
        assert!(r["error"].is_null(), "{r}");
        let rows = r["rows"].as_array().unwrap();
        let sizes: Vec<_> = rows
            .iter()
            .map(|row| row["size"].as_u64().unwrap())
            .collect();
        assert_eq!(sizes, [64, 4096]);
        for row in rows {
            let min = row["lat_min_us"].as_f64().unwrap();
            let p50 = row["lat_p50_us"].as_f64().unwrap();
            let p99 = row["lat_p99_us"].as_f64().unwrap();
            assert!(min > 0.0 && p50 >= min && p99 >= p50, "{row}");
            assert!(row["bw_gb_per_s"].as_f64().unwrap() > 0.0, "{row}");
            // What ran: 200 round trips (at least 100), 1 MiB / size messages, at least 1000.
            assert_eq!(row["round_trips"], 200, "{row}");
            let size = row["size"].as_u64().unwrap();
            assert_eq!(
                row["stream_messages"],
                ((1u64 << 20) / size).clamp(1000, 200_000),
                "{row}"
            );
        }
    }
}

#[test]
fn bad_flags_and_variables_are_errors_that_say_what_is_wrong() {
    /// Arguments, environment, and what the error must name.
    type Case = (
        &'static [&'static str],
        &'static [(&'static str, &'static str)],
        &'static str,
    );
    let cases: [Case; 7] = [
        (
            &["perf", "--transport", "tcp", "--sizes", "0"],
            &[],
            "--sizes",
        ),
        (
            &["info"],
            &[("ZEROHOP_TRANSPORT", "infiniband-please")],
            "ZEROHOP_TRANSPORT",
        ),
        (
            &["info"],
            &[("ZEROHOP_POOL_BYTES", "lots")],
            "ZEROHOP_POOL_BYTES",
        ),
        (
            &["info"],
            &[("ZAP_TRANSPORT", "smoke-signals")],
            "ZAP_TRANSPORT",
        ),
        (&["perf", "--transport", "warp-drive"], &[], "warp-drive"),
        (
            &["perf", "--transport", "tcp", "--iters", "0"],
            &[],
            "--iters",
        ),
        (
            &["perf", "--transport", "tcp", "--stream-bytes", "0"],
            &[],
            "--stream-bytes",
        ),
    ];
    for (args, env, named) in cases {
        let out = zerohop(args, env);
        assert!(!out.status.success(), "{args:?} {env:?} succeeded");
        assert!(stderr(&out).contains(named), "{args:?}: {}", stderr(&out));
    }
}

#[test]
fn sizes_are_checked_before_anything_is_allocated() {
    // 5 TiB: refused by name, with the limit, not an abort of the process.
    let t0 = Instant::now();
    let out = zerohop(&["perf", "--transport", "tcp", "--sizes", "64,5T"], &[]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "a clean failure, not a signal: {out:?}"
    );
    let err = stderr(&out);
    assert!(
        err.contains("--sizes 5T") && err.contains("longer than"),
        "{err}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "refused before any work"
    );
    // A size over a small pool is refused the same way.
    let out = zerohop(
        &["perf", "--transport", "tcp", "--sizes", "4M"],
        &[("ZEROHOP_POOL_BYTES", "1M")],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("--sizes 4M"), "{}", stderr(&out));
}

#[test]
fn connect_takes_host_names_and_errors_name_the_address_and_the_flag() {
    let l = Listener::start(&[]);
    let by_name = format!("localhost:{}", l.addr.port());
    let r = json(&zerohop(
        &[
            "perf",
            "--transport",
            "tcp",
            "--connect",
            &by_name,
            "--sizes",
            "64",
            "--iters",
            "100",
            "--stream-bytes",
            "64k",
            "--json",
        ],
        &[],
    ));
    assert_eq!(r["rows"].as_array().unwrap().len(), 1);
    let (ok, _) = l.finish();
    assert!(ok, "the listener ends cleanly after its one session");

    let nobody = format!("127.0.0.1:{}", free_port());
    let out = zerohop(
        &["perf", "--transport", "tcp", "--connect", &nobody, "--json"],
        &[],
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains(&format!("--connect {nobody}")), "{err}");
    // The JSON says so too.
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON even on failure");
    assert_eq!(r["schema"], 2);
    assert_eq!(r["error"]["flag"], format!("--connect {nobody}"));
    assert!(
        r["error"]["message"].as_str().unwrap().contains(&nobody),
        "{r}"
    );

    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = busy.local_addr().unwrap().to_string();
    let out = zerohop(&["perf", "--transport", "tcp", "--listen", &at], &[]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains(&format!("--listen {at}")),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_listener_survives_a_port_scan_garbage_and_a_stray_peer() {
    let l = Listener::start(&[]);
    // A port scan: connect, then close at once.
    for _ in 0..20 {
        drop(TcpStream::connect(l.addr).unwrap());
    }
    // Garbage.
    let mut g = TcpStream::connect(l.addr).unwrap();
    g.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    g.write_all(&[0xFFu8; 4096]).unwrap();
    drop(g);
    // A peer that speaks zerohop, says hello and leaves.
    let stray = zerohop::Endpoint::open(zerohop::Config::only(zerohop::Kind::Tcp)).unwrap();
    let p = stray.connect(l.addr, Duration::from_secs(5)).unwrap();
    stray.send(p, b"not a perf command").unwrap();
    drop(stray);
    std::thread::sleep(Duration::from_millis(200));
    let out = l.client(&[]);
    assert!(
        out.status.success(),
        "the listener still serves: {}",
        stderr(&out)
    );
    let (ok, err) = l.finish();
    assert!(ok, "and ends cleanly after the session: {err}");
}

#[test]
fn only_the_peer_that_started_a_session_controls_it() {
    let l = Listener::start(&[]);
    let a = l.addr.to_string();
    // A session with many round trips, in the background.
    let honest = command(
        &[
            "perf",
            "--transport",
            "tcp",
            "--connect",
            &a,
            "--sizes",
            "64,4k",
            "--iters",
            "20000",
            "--stream-bytes",
            "4M",
            "--json",
        ],
        &[],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // A stranger sends the commands a session's holder would: quit, and a
    // stream of 2^63 messages, and a session start of its own.
    let stray = zerohop::Endpoint::open(zerohop::Config::only(zerohop::Kind::Tcp)).unwrap();
    let p = stray.connect(l.addr, Duration::from_secs(5)).unwrap();
    let cmd = |tag: u8, size: u64, count: u64| {
        let mut m = vec![tag];
        m.extend_from_slice(&size.to_le_bytes());
        m.extend_from_slice(&count.to_le_bytes());
        m
    };
    stray.send(p, &cmd(b'Q', 0, 0)).unwrap();
    stray.send(p, &cmd(b'B', 64, 1 << 63)).unwrap();
    stray.send(p, b"zhperf\x03S").unwrap();
    let out = honest.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the honest session finished: {}",
        stderr(&out)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["rows"].as_array().unwrap().len(), 2, "{r}");
    let (ok, err) = l.finish();
    assert!(ok, "the listener ended after the honest session: {err}");
}

/// A stranger that starts a session and then says nothing holds the
/// listener for 5 s at most; meanwhile another client is told at once that
/// the listener is busy, and once the quiet holder is dropped it is served.
#[test]
fn a_quiet_session_holder_is_dropped_and_others_are_told_the_listener_is_busy() {
    let mut l = Listener::start(&["--loop"]);
    let stray = zerohop::Endpoint::open(zerohop::Config::only(zerohop::Kind::Tcp)).unwrap();
    let p = stray.connect(l.addr, Duration::from_secs(5)).unwrap();
    stray.send(p, b"zhperf\x03S").unwrap();
    let answer = stray.recv(Duration::from_secs(5)).unwrap();
    assert_eq!(
        answer.bytes(),
        Some(&b"zhperf\x03S"[..]),
        "the session is the stray's"
    );
    let held = Instant::now();
    let out = l.client(&[]);
    assert!(
        !out.status.success(),
        "served while another held the session"
    );
    assert!(
        stderr(&out).contains("serving another client's session"),
        "told why: {}",
        stderr(&out)
    );
    assert!(
        held.elapsed() < Duration::from_secs(4),
        "told at once: {:?}",
        held.elapsed()
    );
    std::thread::sleep(Duration::from_secs(6).saturating_sub(held.elapsed()));
    let out = l.client(&[]);
    assert!(
        out.status.success(),
        "served once the quiet holder was dropped: {}",
        stderr(&out)
    );
    assert!(l.alive());
    drop(stray);
}

#[test]
fn with_loop_the_listener_serves_run_after_run() {
    let mut l = Listener::start(&["--loop"]);
    for run in 0..3 {
        let out = l.client(&[]);
        assert!(out.status.success(), "run {run}: {}", stderr(&out));
        assert!(l.alive(), "still serving after run {run}");
    }
    // A client that dies mid-session does not end it either.
    let a = l.addr.to_string();
    let mut dying = command(
        &[
            "perf",
            "--transport",
            "tcp",
            "--connect",
            &a,
            "--sizes",
            "64",
            "--iters",
            "1000000",
        ],
        &[],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    dying.kill().unwrap();
    dying.wait().unwrap();
    let out = l.client(&[]);
    assert!(
        out.status.success(),
        "after a killed client: {}",
        stderr(&out)
    );
    assert!(l.alive());
}

/// The CPU time (user + system) a process has used, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

#[test]
fn a_listener_out_of_descriptors_backs_off_and_serves_once_they_free() {
    if Command::new("prlimit").arg("--version").output().is_err() {
        eprintln!("SKIPPED: no prlimit (util-linux)");
        return;
    }
    // A short spin: what is measured is the back-off, not the busy-poll.
    let mut l = Listener::start_with(
        &["--loop", "--spin-us", "1000"],
        &[("ZEROHOP_LOG", "warn")],
        Some(48),
    );
    // Far more connections than it has descriptors for.
    let hogs: Vec<TcpStream> = (0..120)
        .filter_map(|_| TcpStream::connect(l.addr).ok())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let pid = l.child.id(); // prlimit execs the command: the same pid
    let before = cpu_ticks(pid);
    std::thread::sleep(Duration::from_secs(2));
    let used = cpu_ticks(pid) - before; // in 1/100 s
    assert!(
        l.alive(),
        "the listener survived running out of descriptors"
    );
    assert!(
        used < 40,
        "it backs off instead of spinning: {used} ticks of CPU in 2 s"
    );
    drop(hogs);
    std::thread::sleep(Duration::from_millis(300));
    let out = l.client(&[]);
    assert!(
        out.status.success(),
        "served once descriptors freed: {}",
        stderr(&out)
    );
    let _ = l.child.kill();
    let (_, err) = l.finish();
    assert!(
        err.len() < 100_000,
        "bounded logging: {} bytes of stderr",
        err.len()
    );
}

#[test]
fn rows_print_as_each_size_finishes_and_the_progress_names_size_and_phase() {
    // The 64 B row is out while the 4 MiB size is still running.
    let mut c = command(
        &[
            "perf",
            "--transport",
            "tcp",
            "--sizes",
            "64,4M",
            "--iters",
            "200",
            "--stream-bytes",
            "2G",
        ],
        &[],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let mut out = BufReader::new(c.stdout.take().unwrap());
    let mut line = String::new();
    let mut early = false;
    while out.read_line(&mut line).unwrap() > 0 {
        if line.trim_start().starts_with("64 B") {
            early = c.try_wait().unwrap().is_none();
            break;
        }
        line.clear();
    }
    let _ = c.kill();
    let _ = c.wait();
    assert!(early, "the 64 B row came only at the end (or never)");

    // On a terminal, the progress line names the size and the phase.
    let cmd = format!(
        "{} perf --transport tcp --sizes 64,1M --iters 200 --stream-bytes 64M",
        bin()
    );
    let out = Command::new("script")
        .args(["-qfec", &cmd, "/dev/null"])
        .env_remove("ZEROHOP_TRANSPORT")
        .output();
    let Ok(out) = out else {
        eprintln!("SKIPPED: no script(1) for a pseudo-terminal");
        return;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("1 MiB: latency") || text.contains("1 MiB: bandwidth"),
        "no size and phase on the terminal: {text}"
    );
}
