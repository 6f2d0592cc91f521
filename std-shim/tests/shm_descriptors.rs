//! The same-host lane when the offering process is out of file descriptors.
//! Its lane socket's accept fails (EMFILE), and the connection waits in the
//! backlog with no new readiness edge to come for it: the offering side must
//! retry after a pause, neither spinning on the failing accept nor waiting
//! for an edge that never comes. Then, with one descriptor free, the accept
//! succeeds but the setup's descriptor (the segment) has
//! no room: taking the message then would lose them (the kernel drops what
//! does not fit), so it waits, without spinning on the link that stays
//! readable. The lane is set up once descriptors are back.
//!
//! Its own test binary: the descriptor limit is the whole process's.

mod common;

use common::{highest_descriptor, nofile, set_nofile};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use zerohop_core::Kind;
use zerohop_std::shm::{LocalWire, ShmConfig, LANE_BIT};
use zerohop_std::tcp::{TcpConfig, TcpTransport};
use zerohop_std::{private_pool, Deadline, Endpoint, EndpointConfig, StdPool};

const WAIT: Duration = Duration::from_secs(10);
/// How long the offering side has no descriptor free, then one: enough to
/// accept the lane connection, not to take the setup's segment too.
const NONE_FREE: Duration = Duration::from_millis(350);
const ONE_FREE: Duration = Duration::from_millis(300);

fn wire(pool: &Arc<StdPool>) -> LocalWire {
    let shm = ShmConfig {
        ring_bytes: 1 << 20,
        required: true,
        ..ShmConfig::default()
    };
    LocalWire::new(Arc::clone(pool), TcpConfig::default(), shm, Kind::Shm).unwrap()
}

/// Counts the offering side's reports of a failed lane accept.
struct FailedAccepts(AtomicUsize);

impl log::Log for FailedAccepts {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::Level::Warn
    }
    fn log(&self, r: &log::Record) {
        if r.args()
            .to_string()
            .contains("accepting a lane connection failed")
        {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
    fn flush(&self) {}
}

static FAILED_ACCEPTS: FailedAccepts = FailedAccepts(AtomicUsize::new(0));

/// The listening side, in a child process: prints its address, then echoes.
#[test]
#[ignore = "a helper process for the test below"]
fn child_listener() {
    if std::env::var("ZEROHOP_TEST_CHILD").is_err() {
        return;
    }
    let pool = private_pool(16 << 20).unwrap();
    let mut t = wire(&pool);
    let addr = t.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let e = Endpoint::new(t, EndpointConfig::default()).unwrap();
    println!("listening on {addr}");
    loop {
        match e.recv(Deadline::after(Duration::from_secs(30)), None) {
            Ok(m) => {
                let bytes = zerohop_backends::host_bytes(m.lease.host().unwrap()).to_vec();
                e.send(m.peer, &bytes, Deadline::after(WAIT), None).unwrap();
            }
            // The dialer went (or never came): done.
            Err(_) => return,
        }
    }
}

/// CPU time of this process so far, every thread's.
fn cpu_time() -> Duration {
    // SAFETY: a valid out-pointer to an rusage.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) }, 0);
    let t = |v: libc::timeval| Duration::new(v.tv_sec as u64, v.tv_usec as u32 * 1000);
    t(u.ru_utime) + t(u.ru_stime)
}

#[test]
fn an_offering_side_out_of_descriptors_sets_its_lane_up_once_they_are_back() {
    log::set_logger(&FAILED_ACCEPTS).unwrap();
    log::set_max_level(log::LevelFilter::Warn);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "child_listener",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("ZEROHOP_TEST_CHILD", "1")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // The test harness prints first; the child's line names its address.
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr: SocketAddr = out
        .by_ref()
        .map_while(Result::ok)
        .find_map(|l| Some(l.split_once("listening on ")?.1.to_owned()))
        .expect("the child's address")
        .parse()
        .unwrap();
    // Read the rest as it comes, so the child never writes to a closed pipe.
    let drain = std::thread::spawn(move || out.for_each(drop));

    // The dialing side offers the lane: the listener creates the segment and
    // connects to this process's lane socket, which must accept it.
    let pool = private_pool(16 << 20).unwrap();
    let e = Endpoint::new(wire(&pool), EndpointConfig::default()).unwrap();
    // Every descriptor number below a limit is taken, then the limit set
    // there: the connections dialed next get numbers above it, so the
    // descriptors this process frees on its own (its TCP connection to the
    // peer, closed once the lane is agreed) make no room below it.
    let limit = highest_descriptor() + 16;
    let mut held = Vec::new();
    loop {
        let f = std::fs::File::open("/dev/null").unwrap();
        if f.as_raw_fd() as u64 >= limit {
            break;
        }
        held.push(f);
    }
    let d = TcpTransport::dial(addr, WAIT, true).unwrap();
    let before = nofile();
    set_nofile(libc::rlimit {
        rlim_cur: limit,
        ..before
    });
    let freer = std::thread::spawn(move || {
        // None free from the first failed accept on: the lane connection
        // may come late (on a 16-core H100 host, in two of four runs, only
        // one accept failed before the descriptor was freed).
        let t0 = Instant::now();
        while FAILED_ACCEPTS.0.load(Ordering::Relaxed) == 0 && t0.elapsed() < WAIT {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(NONE_FREE);
        held.pop();
        std::thread::sleep(ONE_FREE);
        drop(held);
        set_nofile(before);
    });
    let started = Instant::now();
    let cpu = cpu_time();
    let p = e.with(|t| t.attach(d)).unwrap();
    let peer = e.wait_open(p, Deadline::after(WAIT));
    let took = started.elapsed();
    let cpu = cpu_time() - cpu;
    freer.join().unwrap();
    let failed = FAILED_ACCEPTS.0.load(Ordering::Relaxed);
    let peer = peer.expect("the lane is set up once descriptors are free");
    assert!(peer.0 & LANE_BIT != 0, "the peer moved to shared memory");
    // The accept failed and was retried, a pause (100 ms) apart: a few
    // tries while none was free, not one per pass of a spin.
    assert!(
        failed >= 2,
        "{failed} failed lane accepts: the test starved nothing"
    );
    assert!(
        failed <= 2 * (NONE_FREE.as_millis() as usize / 100) + 2,
        "{failed} failed accepts in {took:?}: retried without a pause"
    );
    assert!(
        took >= NONE_FREE + ONE_FREE / 2,
        "open in {took:?}, before descriptors were freed"
    );
    // A setup waiting for room leaves its link readable: a waiter that
    // polled it would wake at once, pass after pass (about 250 ms of CPU
    // in these 650 ms; about 20 ms when it sleeps its poll interval).
    assert!(
        cpu < Duration::from_millis(100),
        "{cpu:?} of CPU in {took:?}: the wait spun"
    );

    e.send(peer, b"hello", Deadline::after(WAIT), None).unwrap();
    let r = e.recv(Deadline::after(WAIT), None).unwrap();
    assert_eq!(
        zerohop_backends::host_bytes(r.lease.host().unwrap()),
        b"hello"
    );
    drop(r);
    drop(e);
    let status = child.wait().unwrap();
    drain.join().unwrap();
    assert!(status.success(), "the listener: {status}");
}
