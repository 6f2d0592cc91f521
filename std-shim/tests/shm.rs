//! The same-host lane across processes: a peer killed mid-stream (SIGKILL,
//! either side) is reported lost at once, and nothing of the lane is left
//! behind — no segment mapped, no descriptor open, no file anywhere.

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use zerohop_backends::PeerLimits;
use zerohop_core::session::ProtocolError;
use zerohop_core::{Error, Kind, PeerId, Received, Transport};
use zerohop_std::shm::{LocalWire, ShmConfig, ShmLease, LANE_BIT};
use zerohop_std::tcp::{TcpConfig, TcpTransport};
use zerohop_std::testing::{thread_cpu, Reaped};
use zerohop_std::{
    private_pool, shared_pool, Deadline, Endpoint, EndpointConfig, Event, StdPool, Wire,
};

const WAIT: Duration = Duration::from_secs(10);

/// A received message's bytes (every message here lies in host memory).
fn host_bytes(l: &ShmLease) -> &[u8] {
    zerohop_backends::host_bytes(l.host().expect("a host message"))
}

/// Messages this long go by a single copy (`process_vm_readv`; the default
/// threshold is 32 KiB).
const SINGLE: usize = 64 << 10;
/// Messages sent from a pool that is a shared-memory file go placed there
/// (once the receiver maps it); this long, here.
const PLACED: usize = 1 << 20;

/// Sends `bytes` from a buffer of the endpoint's pool, as a zero-copy
/// sender does (from a shared pool: placed).
fn send_leased(e: &Endpoint<LocalWire>, peer: PeerId, bytes: &[u8]) -> Result<(), Error> {
    let mut l = e.lease(bytes.len())?;
    zerohop_backends::host_bytes_mut(l.host_mut().expect("a host buffer")).copy_from_slice(bytes);
    e.send_lease(peer, l, Deadline::after(WAIT), None)
}

/// The pool of this test or its child: a shared-memory file (single-copy
/// messages go placed) or private memory (they go by the claim word).
fn pool(shared: bool) -> Arc<StdPool> {
    match shared {
        true => shared_pool(64 << 20).unwrap(),
        false => private_pool(64 << 20).unwrap(),
    }
}

fn wire(pool: &Arc<StdPool>) -> LocalWire {
    wire_with(pool, TcpConfig::default())
}

/// A same-host wire (1 MiB rings, shared memory required) over `tcp`.
fn wire_with(pool: &Arc<StdPool>, tcp: TcpConfig) -> LocalWire {
    let shm = ShmConfig {
        ring_bytes: 1 << 20,
        required: true,
        ..ShmConfig::default()
    };
    LocalWire::new(Arc::clone(pool), tcp, shm, Kind::Shm).unwrap()
}

fn listener() -> (Endpoint<LocalWire>, SocketAddr, Arc<StdPool>) {
    listener_in(pool(false))
}

fn listener_in(pool: Arc<StdPool>) -> (Endpoint<LocalWire>, SocketAddr, Arc<StdPool>) {
    let mut t = wire(&pool);
    let addr = t.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    (
        Endpoint::new(t, EndpointConfig::default()).unwrap(),
        addr,
        pool,
    )
}

fn connect(addr: SocketAddr) -> (Endpoint<LocalWire>, PeerId) {
    connect_in(addr, pool(false))
}

fn connect_in(addr: SocketAddr, pool: Arc<StdPool>) -> (Endpoint<LocalWire>, PeerId) {
    let e = Endpoint::new(wire(&pool), EndpointConfig::default()).unwrap();
    let p = connect_also(&e, addr);
    (e, p)
}

/// `e` connects to `addr` too; the peer moves to shared memory.
fn connect_also(e: &Endpoint<LocalWire>, addr: SocketAddr) -> PeerId {
    let d = TcpTransport::dial(addr, WAIT, true).unwrap();
    let p = e.with(|t| t.attach(d)).unwrap();
    let p = e.wait_open(p, Deadline::after(WAIT)).unwrap();
    assert!(p.0 & LANE_BIT != 0, "the peer moved to shared memory");
    p
}

/// The tests count this process's descriptors: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The lane's traces in this process: mapped segments and pool files
/// (this process's own among them), and descriptors.
fn traces() -> (usize, usize) {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let segments = maps
        .lines()
        .filter(|l| l.contains("memfd:zerohop-lane") || l.contains("memfd:zerohop-pool"))
        .count();
    let fds = std::fs::read_dir("/proc/self/fd").unwrap().count();
    (segments, fds)
}

/// A child that connects and streams (or sinks) until it is killed.
#[test]
#[ignore = "a helper process for the kill tests"]
fn child_peer() {
    let Ok(addr) = std::env::var("ZEROHOP_TEST_CONNECT") else {
        return;
    };
    let shared = std::env::var("ZEROHOP_TEST_POOL").as_deref() == Ok("shared");
    let (e, peer) = connect_in(addr.parse().unwrap(), pool(shared));
    let m = vec![0x5Au8; if shared { PLACED } else { SINGLE }];
    match std::env::var("ZEROHOP_TEST_ROLE").as_deref() {
        Ok("send") if shared => loop {
            send_leased(&e, peer, &m).unwrap();
        },
        Ok("send") => loop {
            e.send(peer, &m, Deadline::after(WAIT), None).unwrap();
        },
        Ok("hang-tail") => {
            // A sender that spins all along (it looks at the offer while it
            // waits), which takes the first tail offered and never writes it.
            drop(e);
            let config = EndpointConfig {
                spin: Duration::from_secs(30),
                ..EndpointConfig::default()
            };
            let e = Endpoint::new(wire(&pool(shared)), config).unwrap();
            let peer = connect_also(&e, addr.parse().unwrap());
            zerohop_std::shm::testing::take_tails_and_hang();
            while e.send(peer, &m, Deadline::after(WAIT), None).is_ok() {}
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        Ok("send-asleep") => {
            // A sender that sleeps on its doorbell at once, and would sleep
            // out 10 s unless rung, sends a few long slices (claimed).
            drop(e);
            let config = EndpointConfig {
                spin: Duration::ZERO,
                poll_interval: Duration::from_secs(10),
                ..EndpointConfig::default()
            };
            let e = Endpoint::new(wire(&pool(shared)), config).unwrap();
            let peer = connect_also(&e, addr.parse().unwrap());
            for i in 0..ASLEEP_MESSAGES {
                e.send(peer, &asleep_message(i), Deadline::after(WAIT), None)
                    .unwrap();
            }
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        _ => loop {
            drop(e.recv(Deadline::after(Duration::from_secs(60)), None));
        },
    }
}

/// What the "send-asleep" child sends: `ASLEEP_MESSAGES` of these, 1 MiB
/// each (long enough that an offer rings a sleeping sender), every byte
/// telling its message and place.
const ASLEEP_MESSAGES: u8 = 3;

fn asleep_message(i: u8) -> Vec<u8> {
    (0..1usize << 20)
        .map(|k| (k as u8).wrapping_mul(31) ^ i)
        .collect()
}

fn spawn_in(addr: SocketAddr, role: &str, shared: bool) -> Reaped {
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "child_peer",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("ZEROHOP_TEST_CONNECT", addr.to_string())
        .env("ZEROHOP_TEST_ROLE", role)
        .env(
            "ZEROHOP_TEST_POOL",
            if shared { "shared" } else { "private" },
        )
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    Reaped(child)
}

fn accepted(server: &Endpoint<LocalWire>) -> PeerId {
    match server.next_event(Deadline::after(WAIT), None).unwrap() {
        Event::Accepted { peer, .. } => peer,
        e => panic!("expected the child's connection, got {e:?}"),
    }
}

#[test]
fn a_sender_killed_mid_stream_is_lost_at_once_and_leaves_nothing() {
    sender_killed(false);
}

/// The same with placed messages: the receiver maps the sender's pool file,
/// and unmaps it when the sender is gone.
#[test]
fn a_sender_of_placed_messages_killed_mid_stream_is_lost_at_once_and_leaves_nothing() {
    sender_killed(true);
}

fn sender_killed(shared: bool) {
    let _one = serial();
    let (server, addr, pool) = listener_in(pool(shared));
    let before = traces();
    let mut child = spawn_in(addr, "send", shared);
    let peer = accepted(&server);
    assert!(peer.0 & LANE_BIT != 0);
    // Mid-stream: messages are arriving.
    for _ in 0..50 {
        let r = server.recv(Deadline::after(WAIT), None).unwrap();
        assert_eq!(
            host_bytes(&r.lease).len(),
            if shared { PLACED } else { SINGLE }
        );
    }
    let copies = server.with(|t| t.single_copies(peer)).unwrap();
    assert_eq!(copies.mapped > 0, shared, "{copies:?}");
    assert_eq!(
        traces().0,
        before.0 + 1 + usize::from(shared),
        "one segment mapped while the lane lives, and the peer's pool file"
    );
    child.kill().unwrap(); // SIGKILL
    let killed = Instant::now();
    let lost = loop {
        match server.recv(Deadline::after(WAIT), None) {
            Ok(_) => {} // what it wrote before it died
            Err(e) => break e,
        }
    };
    let took = killed.elapsed();
    child.wait().unwrap();
    lost_at_once("a killed sender", (lost, peer), took, before, &pool);
}

/// What a peer `killed` some time ago left: `lost` is its `PeerLost`, told
/// within 100 ms (`took`); no segment mapped, no descriptor left (against
/// the traces `before` it came), every buffer of `pool` back.
fn lost_at_once(
    killed: &str,
    (lost, peer): (Error, PeerId),
    took: Duration,
    before: (usize, usize),
    pool: &StdPool,
) {
    assert_eq!(lost, Error::PeerLost(peer));
    eprintln!("{killed} was reported lost {took:?} after SIGKILL");
    assert!(took < Duration::from_millis(100), "lost after {took:?}");
    assert_eq!(traces(), before, "no segment mapped, no descriptor left");
    assert_eq!(pool.used_bytes(), 0, "every buffer back");
}

/// The receiver waits for each offer to be taken (a testing knob, global
/// to the process) while this lives, however the test ends.
struct OffersWait;

impl OffersWait {
    fn on() -> OffersWait {
        zerohop_std::shm::testing::offers_wait_to_be_taken(true);
        OffersWait
    }
}

impl Drop for OffersWait {
    fn drop(&mut self) {
        zerohop_std::shm::testing::offers_wait_to_be_taken(false);
    }
}

/// A sender that takes the tail of its message and never writes it (a
/// testing knob in the child) costs the receiver that lane after half a
/// second; the receive buffer it might still write into stays out of the
/// pool while it lives, and goes back once it has exited.
#[test]
fn a_tail_taken_and_never_written_keeps_its_buffer_until_the_sender_exits() {
    let _one = serial();
    let (server, addr, pool) = listener_in(pool(false));
    // The child takes the first tail offered (given the time to: the
    // lane waits for the take before it reads the head).
    let offers_wait = OffersWait::on();
    let mut child = spawn_in(addr, "hang-tail", false);
    let first = accepted(&server);
    let err = loop {
        // The child's first connection (its endpoint's, then dropped) goes.
        match server.next_event(Deadline::after(WAIT), None) {
            Ok(Event::Accepted { .. } | Event::Closed(_)) => {}
            Ok(Event::Message(m)) => panic!("a message whose tail was taken: {m:?}"),
            Ok(Event::Lost { peer, .. }) if peer == first => {}
            Ok(Event::Lost { error, .. }) => break error,
            Err(e) => panic!("{e:?}"),
        }
    };
    drop(offers_wait);
    assert!(matches!(err, Error::WireRule { .. }), "{err:?}");
    assert!(
        pool.used_bytes() >= SINGLE,
        "held while the sender lives: {}",
        pool.used_bytes()
    );
    child.kill().unwrap();
    child.wait().unwrap();
    let until = Instant::now() + WAIT;
    while pool.used_bytes() != 0 && Instant::now() < until {
        let _ = server.recv(Deadline::after(Duration::from_millis(20)), None);
    }
    assert_eq!(pool.used_bytes(), 0, "back once the sender exited");
}

/// A sender asleep on its doorbell while its long message is read (it
/// spins not at all) is rung when the receiver offers it the tail, and
/// writes it: the receiver, told to wait up to 2 s for each offer to be
/// taken before it reads the head, gets every message intact with no wait
/// run out — where an unrung sender would sleep through each (the count,
/// not the time, is asserted: a loaded host may be slow either way).
#[test]
fn a_sender_asleep_is_rung_to_write_the_tail_of_a_long_message() {
    let _one = serial();
    let (server, addr, _pool) = listener_in(pool(false));
    let offers_wait = OffersWait::on();
    let run_out_before = zerohop_std::shm::testing::offer_waits_run_out();
    let _child = spawn_in(addr, "send-asleep", false);
    let first = accepted(&server);
    let mut got = 0;
    let mut took = Duration::ZERO;
    while got < ASLEEP_MESSAGES {
        // The child's first connection (its endpoint's, then dropped) goes.
        let t0 = Instant::now();
        match server.next_event(Deadline::after(WAIT), None) {
            Ok(Event::Accepted { .. } | Event::Closed(_)) => {}
            Ok(Event::Lost { peer, .. }) if peer == first => {}
            Ok(Event::Message(m)) => {
                took += t0.elapsed();
                assert!(
                    host_bytes(&m.lease) == asleep_message(got),
                    "message {got} intact"
                );
                got += 1;
            }
            Ok(e) => panic!("{e:?}"),
            Err(e) => panic!("{e:?}"),
        }
    }
    drop(offers_wait);
    let run_out = zerohop_std::shm::testing::offer_waits_run_out() - run_out_before;
    eprintln!("{ASLEEP_MESSAGES} messages in {took:?}, {run_out} offers untaken after 2 s");
    assert_eq!(
        run_out, 0,
        "{ASLEEP_MESSAGES} messages in {took:?}: the sleeping sender was not rung to take its offers"
    );
}

#[test]
fn a_receiver_killed_mid_stream_is_lost_at_once_and_leaves_nothing() {
    receiver_killed(false);
}

/// The same with placed messages: those the receiver never copied go back
/// to the sender's pool.
#[test]
fn a_receiver_of_placed_messages_killed_mid_stream_is_lost_at_once_and_leaves_nothing() {
    receiver_killed(true);
}

fn receiver_killed(shared: bool) {
    let _one = serial();
    let (server, addr, pool) = listener_in(pool(shared));
    let before = traces();
    let mut child = spawn_in(addr, "recv", shared);
    let peer = accepted(&server);
    let m = vec![7u8; if shared { PLACED } else { SINGLE }];
    for _ in 0..50 {
        match shared {
            true => send_leased(&server, peer, &m).unwrap(),
            false => server.send(peer, &m, Deadline::after(WAIT), None).unwrap(),
        }
    }
    child.kill().unwrap();
    let killed = Instant::now();
    // The sender notices whichever way it looks: its sends fail, its recv reports.
    let lost = loop {
        if let Err(e) = server.send(peer, &m, Deadline::after(WAIT), None) {
            assert!(
                matches!(e, Error::UnknownPeer(_) | Error::PeerLost(_)),
                "{e:?}"
            );
            break server.recv(Deadline::after(WAIT), None).unwrap_err();
        }
        if killed.elapsed() > WAIT {
            panic!("the dead receiver was never noticed");
        }
    };
    let took = killed.elapsed();
    child.wait().unwrap();
    // (Placed messages the receiver never copied are back too.)
    lost_at_once("a killed receiver", (lost, peer), took, before, &pool);
}

/// An endpoint that sleeps at once and would sleep out 10 s unless
/// something wakes it (its progress thread too): a test of what wakes it.
fn sleepy() -> EndpointConfig {
    EndpointConfig {
        spin: Duration::ZERO,
        poll_interval: Duration::from_secs(10),
        ..EndpointConfig::default()
    }
}

/// A listener with the [`sleepy`] config.
fn sleepy_listener() -> (Endpoint<LocalWire>, SocketAddr, Arc<StdPool>) {
    sleepy_listener_with(sleepy())
}

fn sleepy_listener_with(config: EndpointConfig) -> (Endpoint<LocalWire>, SocketAddr, Arc<StdPool>) {
    let pool = pool(false);
    let mut t = wire(&pool);
    let addr = t.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    (Endpoint::new(t, config).unwrap(), addr, pool)
}

/// Side passes on `server` until `n` of its lanes are armed (quiet ones
/// are, after 10 ms).
fn armed(server: &Endpoint<LocalWire>, n: usize) {
    let until = Instant::now() + WAIT;
    while server.with(|t| t.armed_lanes()) != n {
        assert!(Instant::now() < until, "{n} lanes never armed");
        server.with(|t| t.progress()).unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Quiet lanes leave the polls' walks (armed) and ask their peer to ring;
/// each wakes for its next message. The server here sleeps 10 s unless
/// woken: only the rings can bring each message within the deadline.
#[test]
fn quiet_lanes_are_armed_and_each_wakes_for_its_next_message() {
    const LANES: usize = 32;
    let _one = serial();
    let (server, addr, _pool) = sleepy_listener();
    let (client, first) = connect(addr);
    let mut peers = vec![first];
    for _ in 1..LANES {
        peers.push(connect_also(&client, addr));
    }
    let mut theirs = Vec::new();
    for &p in &peers {
        let msg = p.0.to_le_bytes();
        client.send(p, &msg, Deadline::after(WAIT), None).unwrap();
        let r = server.recv(Deadline::after(WAIT), None).unwrap();
        assert_eq!(host_bytes(&r.lease), msg);
        theirs.push(r.peer);
    }
    armed(&server, LANES);
    // Out of order, one at a time, each sent once the server is asleep:
    // each arrives from the lane it was sent on.
    let order: Vec<usize> = (0..LANES).map(|i| (i * 7) % LANES).collect();
    let (go, went) = std::sync::mpsc::channel::<usize>();
    let sender = {
        let peers = peers.clone();
        std::thread::spawn(move || {
            for k in went {
                std::thread::sleep(Duration::from_millis(20));
                let msg = [k as u8; 100];
                client
                    .send(peers[k], &msg, Deadline::after(WAIT), None)
                    .unwrap();
            }
            client
        })
    };
    for &k in &order {
        go.send(k).unwrap();
        let r = server.recv(Deadline::after(WAIT / 2), None).unwrap();
        assert_eq!(
            (r.peer, host_bytes(&r.lease)),
            (theirs[k], &[k as u8; 100][..])
        );
    }
    drop(go);
    let client = sender.join().unwrap();
    assert!(
        server.with(|t| t.armed_lanes()) < LANES,
        "the lanes that spoke woke"
    );
    // And back to sleep, then all at once.
    armed(&server, LANES);
    for &p in &peers {
        client
            .send(p, b"again", Deadline::after(WAIT), None)
            .unwrap();
    }
    let mut from: Vec<PeerId> = (0..LANES)
        .map(|_| server.recv(Deadline::after(WAIT / 2), None).unwrap())
        .inspect(|r| assert_eq!(host_bytes(&r.lease), b"again"))
        .map(|r| r.peer)
        .collect();
    from.sort_by_key(|p| p.0);
    theirs.sort_by_key(|p| p.0);
    assert_eq!(from, theirs, "one message from each lane");
}

/// A peer killed while its lane is armed is reported lost at once by a
/// server asleep for 10 s: the link's hang-up wakes it.
#[test]
fn a_peer_killed_while_its_lane_is_armed_is_lost_at_once_and_leaves_nothing() {
    let _one = serial();
    let (server, addr, pool) = sleepy_listener();
    let before = traces();
    let mut child = spawn_in(addr, "recv", false);
    let peer = accepted(&server);
    armed(&server, 1);
    child.kill().unwrap();
    let killed = Instant::now();
    let lost = server.recv(Deadline::after(WAIT), None).unwrap_err();
    let took = killed.elapsed();
    child.wait().unwrap();
    lost_at_once(
        "a killed peer of an armed lane",
        (lost, peer),
        took,
        before,
        &pool,
    );
}

/// A listener whose application thread reads and sleeps (10 s here) takes
/// a same-host peer's offer as its reads find it, not at a later pass: the
/// peer moves to shared memory at once. (Its offer once waited for the
/// 64th poll, ~320 ms at the default 5 ms interval: here the peer's
/// handshake timed out first, in 2 of 3 runs.)
#[test]
fn a_listener_asleep_takes_a_same_host_offer_at_once() {
    let _one = serial();
    let (server, addr, _pool) = sleepy_listener();
    let client = std::thread::spawn(move || connect(addr));
    let event = server.next_event(Deadline::after(Duration::from_secs(3)), None);
    assert!(
        matches!(event, Ok(Event::Accepted { peer, .. }) if peer.0 & LANE_BIT != 0),
        "{event:?}"
    );
    let (_client, peer) = client.join().unwrap();
    assert!(peer.0 & LANE_BIT != 0);
}
/// A pass that reads nothing (the progress thread's while the application
/// reads for itself) still ends an armed lane whose peer died: its link's
/// hang-up is looked at by every pass.
#[test]
fn a_pass_that_reads_nothing_still_ends_an_armed_lane_whose_peer_died() {
    let _one = serial();
    let (server, addr, _pool) = sleepy_listener_with(EndpointConfig {
        progress_thread: false,
        ..sleepy()
    });
    let mut child = spawn_in(addr, "recv", false);
    let peer = accepted(&server);
    armed(&server, 1);
    child.kill().unwrap();
    child.wait().unwrap();
    let until = Instant::now() + WAIT;
    while server.with(|t| t.lane_count()) != 0 {
        assert!(Instant::now() < until, "the dead peer's lane stayed");
        server.with(|t| t.background_progress(false)).unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    let lost = server.recv(Deadline::after(WAIT), None).unwrap_err();
    assert_eq!(lost, Error::PeerLost(peer));
}

/// An application that only sends, with sends that never wait (no pass of
/// its own), still loses a dead peer of an armed lane at once: the progress
/// thread wakes for the hang-up and ends the lane. (Which of its poll sets
/// wakes it depends on what it last polled: this does not single out the
/// armed link's hang-up-only place in `awake_rings`.)
#[test]
fn a_dead_armed_peer_is_let_go_while_the_application_only_sends() {
    let _one = serial();
    let (server, addr, _pool) = sleepy_listener();
    let mut child = spawn_in(addr, "recv", false);
    let dead = accepted(&server);
    let (client, _) = connect(addr);
    let live = accepted(&server);
    armed(&server, 2);
    let drain = std::thread::spawn(move || {
        while client
            .recv(Deadline::after(Duration::from_secs(2)), None)
            .is_ok()
        {}
    });
    assert!(
        server.peer_addr(dead).is_some(),
        "the peer to kill is there"
    );
    child.kill().unwrap();
    let killed = Instant::now();
    // Sends that never wait (a message every millisecond): no pass of the
    // application's own.
    while server.peer_addr(dead).is_some() {
        assert!(killed.elapsed() < WAIT / 2, "the dead peer's lane stayed");
        server
            .send(live, b"tick", Deadline::after(WAIT), None)
            .unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    let took = killed.elapsed();
    child.wait().unwrap();
    eprintln!("a dead armed peer let go {took:?} after SIGKILL, the application only sending");
    assert!(took < Duration::from_secs(1), "let go after {took:?}");
    drop(server);
    drain.join().unwrap();
}

/// A sleepy client with one lane to a default listener, each side's peer,
/// after a message from the client.
fn sleepy_client_pair() -> (Endpoint<LocalWire>, PeerId, Endpoint<LocalWire>, PeerId) {
    let (server, addr, _pool) = listener();
    let client = Endpoint::new(wire(&pool(false)), sleepy()).unwrap();
    let peer = connect_also(&client, addr);
    client
        .send(peer, b"hello", Deadline::after(WAIT), None)
        .unwrap();
    let r = server.recv(Deadline::after(WAIT), None).unwrap();
    assert_eq!(host_bytes(&r.lease), b"hello");
    (client, peer, server, r.peer)
}

/// A reader asleep while its only lane is armed; another thread sends a
/// request on that lane (which wakes it): the reply wakes the reader,
/// within its 3 s deadline of a 10 s poll interval.
#[test]
fn a_reply_to_a_request_another_thread_sent_wakes_the_reader() {
    let _one = serial();
    let (client, peer, server, _) = sleepy_client_pair();
    let echo = std::thread::spawn(move || {
        let r = server.recv(Deadline::after(WAIT), None).unwrap();
        server
            .send(r.peer, host_bytes(&r.lease), Deadline::after(WAIT), None)
            .unwrap();
        server // (a close would wait for the client's answer: see "Left")
    });
    armed(&client, 1);
    let client = Arc::new(client);
    let reader = {
        let client = Arc::clone(&client);
        std::thread::spawn(move || {
            let r = client.recv(Deadline::after(Duration::from_secs(3)), None);
            r.map(|r| host_bytes(&r.lease).to_vec())
        })
    };
    std::thread::sleep(Duration::from_millis(100)); // the reader is asleep
    client
        .send(peer, b"ping", Deadline::after(WAIT), None)
        .unwrap();
    assert_eq!(reader.join().unwrap(), Ok(b"ping".to_vec()));
    drop(echo.join().unwrap());
}

/// A reader asleep while its lane is awake; another thread's pass arms the
/// lane: the peer's next message still wakes the reader.
#[test]
fn a_lane_another_thread_armed_still_wakes_the_reader() {
    let _one = serial();
    let (client, _, server, from) = sleepy_client_pair();
    let client = Arc::new(client);
    let reader = {
        let client = Arc::clone(&client);
        std::thread::spawn(move || {
            let r = client.recv(Deadline::after(Duration::from_secs(3)), None);
            r.map(|r| host_bytes(&r.lease).to_vec())
        })
    };
    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(
        client.with(|t| t.armed_lanes()),
        0,
        "awake as the reader slept"
    );
    armed(&client, 1); // what the progress thread's pass does when it wakes
    server
        .send(from, b"push", Deadline::after(WAIT), None)
        .unwrap();
    assert_eq!(reader.join().unwrap(), Ok(b"push".to_vec()));
}

/// A reader asleep while its armed lane's peer writes, and another thread
/// calling `progress` meanwhile (a sender's wait does): that pass takes
/// the message and the ring that woke the reader, and the reader must still
/// wake for it (it slept out its deadline 8 times in 10 when such a pass
/// drained the link; either of its mends, the link left undrained while a
/// thread sleeps or the `news` bell, wakes it).
#[test]
fn another_threads_pass_leaves_a_sleeping_reader_its_wake_up() {
    let _one = serial();
    let (server, addr, _pool) = listener();
    let config = EndpointConfig {
        progress_thread: false,
        ..sleepy()
    };
    let client = Arc::new(Endpoint::new(wire(&pool(false)), config).unwrap());
    let peer = connect_also(&client, addr);
    client
        .send(peer, b"hello", Deadline::after(WAIT), None)
        .unwrap();
    let from = server.recv(Deadline::after(WAIT), None).unwrap().peer;
    for round in 0..5 {
        armed(&client, 1);
        let reader = {
            let client = Arc::clone(&client);
            std::thread::spawn(move || {
                let t0 = Instant::now();
                let r = client.recv(Deadline::after(WAIT), None);
                (r.map(|r| host_bytes(&r.lease).to_vec()), t0.elapsed())
            })
        };
        std::thread::sleep(Duration::from_millis(50)); // the reader is asleep
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let driver = {
            let (client, stop) = (Arc::clone(&client), Arc::clone(&stop));
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = client.progress();
                }
            })
        };
        std::thread::sleep(Duration::from_millis(5));
        server
            .send(from, b"push", Deadline::after(WAIT), None)
            .unwrap();
        let (r, took) = reader.join().unwrap();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        driver.join().unwrap();
        assert_eq!(r, Ok(b"push".to_vec()), "round {round}");
        // Woken, not at the end of its 10 s poll interval.
        assert!(took < WAIT / 2, "round {round}: read after {took:?}");
    }
}

/// A pass that reads nothing ends a lane (its peer died) while no thread
/// sleeps; the application takes the news without sleeping: the progress
/// thread then sleeps as before (a bell left rung for it spun it at
/// ~230 000 passes a second).
#[test]
fn news_of_an_ended_lane_taken_without_sleeping_leaves_the_progress_thread_asleep() {
    let _one = serial();
    let (server, addr, _pool) = sleepy_listener();
    let mut child = spawn_in(addr, "recv", false);
    let peer = accepted(&server);
    armed(&server, 1);
    // The lock held, so that the progress thread does not take the
    // hang-up itself in a pass of its own.
    server.with(|t| {
        child.kill().unwrap();
        child.wait().unwrap();
        let until = Instant::now() + WAIT;
        while t.lane_count() != 0 {
            assert!(Instant::now() < until, "the dead peer's lane stayed");
            t.background_progress(false).unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
    });
    let lost = server.recv(Deadline::after(WAIT), None).unwrap_err();
    assert_eq!(lost, Error::PeerLost(peer));
    std::thread::sleep(Duration::from_millis(100));
    let before = server.progress_passes();
    std::thread::sleep(Duration::from_millis(500));
    let passes = server.progress_passes() - before;
    assert!(
        passes < 10,
        "the progress thread spins: {passes} passes in 500 ms"
    );
}

/// A message each way between a connector's new peer and the server's
/// (`from`).
fn exchange(c: &Endpoint<LocalWire>, peer: PeerId, server: &Endpoint<LocalWire>, from: PeerId) {
    c.send(peer, b"hello", Deadline::after(WAIT), None).unwrap();
    let r = server.recv(Deadline::after(WAIT), None).unwrap();
    assert_eq!(host_bytes(&r.lease), b"hello");
    drop(r);
    server
        .send(from, b"back", Deadline::after(WAIT), None)
        .unwrap();
    assert_eq!(
        host_bytes(&c.recv(Deadline::after(WAIT), None).unwrap().lease),
        b"back"
    );
}

/// The abstract Unix sockets this process's lanes take segments on.
fn lane_sockets() -> Vec<String> {
    let me = format!(".{}.", std::process::id());
    std::fs::read_to_string("/proc/net/unix")
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(7))
        .filter(|n| n.starts_with("@zerohop-lane.") && n.contains(&me))
        .map(|n| n[1..].to_string())
        .collect()
}

/// A fresh endpoint (with a progress thread), and the address of its lane
/// socket, as any local process finds it.
fn endpoint_and_its_lane_socket() -> (Endpoint<LocalWire>, std::os::unix::net::SocketAddr) {
    use std::os::linux::net::SocketAddrExt;
    let before = lane_sockets();
    let c = Endpoint::new(
        wire(&private_pool(16 << 20).unwrap()),
        EndpointConfig::default(),
    )
    .unwrap();
    let name = lane_sockets()
        .into_iter()
        .find(|n| !before.contains(n))
        .expect("the endpoint's lane socket");
    let a = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    (c, a)
}

/// A shm listener that keeps one accepted peer, whose peers are quiet
/// after `idle`.
fn one_peer_listener(idle: Duration) -> (Endpoint<LocalWire>, SocketAddr) {
    let tcp = TcpConfig {
        peer_limits: PeerLimits {
            accepted: 1,
            per_address: 1,
        },
        idle_timeout: idle,
        ..TcpConfig::default()
    };
    let mut t = wire_with(&pool(false), tcp);
    let addr = t.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    (Endpoint::new(t, EndpointConfig::default()).unwrap(), addr)
}

/// Accepted peers that moved to shared memory still count against the
/// listener's peer limits: past them a newcomer from this host is refused
/// at its Hello (typed, on its side), and the place a lane frees is taken
/// again.
#[test]
fn peers_in_shared_memory_count_against_the_listeners_peer_limits() {
    let _one = serial();
    // None quiet an idle timeout (let go for a newcomer) in the test's time.
    let (server, addr) = one_peer_listener(Duration::from_secs(60));
    let (c, peer) = connect(addr);
    let from = accepted(&server);
    exchange(&c, peer, &server, from);
    // The first is in shared memory now, off the TCP table.
    let t0 = Instant::now();
    while server.with(|t| t.tcp().peers_left()) > 0 {
        assert!(t0.elapsed() < WAIT, "the moved peer left the TCP table");
        std::thread::sleep(Duration::from_millis(5));
    }
    let newcomer = || {
        let e = Endpoint::new(wire(&pool(false)), EndpointConfig::default()).unwrap();
        let p = e.with(|t| t.attach(TcpTransport::dial(addr, WAIT, true).unwrap()));
        let r = e.wait_open(p.unwrap(), Deadline::after(WAIT));
        (e, r)
    };
    let (_refused, r) = newcomer();
    assert!(
        matches!(
            r,
            Err(Error::Protocol {
                error: ProtocolError::Refused,
                ..
            })
        ),
        "{r:?}"
    );
    assert_eq!(server.with(|t| t.tcp().refused()), 1);
    exchange(&c, peer, &server, from);
    // The lane ends: its place is free.
    drop(c);
    match server.next_event(Deadline::after(WAIT), None).unwrap() {
        Event::Closed(p) | Event::Lost { peer: p, .. } => assert_eq!(p, from),
        e => panic!("the first's end: {e:?}"),
    }
    let (second, r) = newcomer();
    let peer = r.unwrap();
    assert!(peer.0 & LANE_BIT != 0, "it moved to shared memory too");
    let from = accepted(&server);
    exchange(&second, peer, &server, from);
    assert_eq!(server.with(|t| t.tcp().refused()), 1);
}

/// A full listener lets a quiet lane go for a newcomer as it would a quiet
/// TCP peer: the lane's side reads a clean close, the application here is
/// told (`Evicted`), and the newcomer moves to shared memory in its place.
/// (Before, lanes counted against the limits and were never let go: a
/// local stranger opened 300 in 0.34 s and kept every newcomer out.)
#[test]
fn a_full_listener_lets_a_quiet_lane_go_for_a_newcomer() {
    let _one = serial();
    let (server, addr) = one_peer_listener(Duration::from_millis(1000));
    let (first, peer) = connect(addr);
    let from = accepted(&server);
    exchange(&first, peer, &server, from);
    // Quiet for more than the idle timeout (and the lanes' next offer).
    std::thread::sleep(Duration::from_millis(1300));
    let (second, peer2) = connect(addr);
    let from2 = accepted(&server);
    match server.next_event(Deadline::after(WAIT), None).unwrap() {
        Event::Lost {
            peer,
            error:
                Error::Protocol {
                    error: ProtocolError::Evicted,
                    ..
                },
        } => assert_eq!(peer, from),
        e => panic!("the first let go: {e:?}"),
    }
    match first.next_event(Deadline::after(WAIT), None).unwrap() {
        Event::Closed(p) => assert_eq!(p, peer),
        e => panic!("the first's side: {e:?}"),
    }
    exchange(&second, peer2, &server, from2);
    assert_eq!(server.with(|t| t.tcp().refused()), 0);
}

#[test]
fn strangers_on_the_lane_sockets_cost_them_their_connection_and_peers_still_move() {
    let _one = serial();
    use std::io::Write;
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
    let (server, addr, _pool) = listener();
    let pool = private_pool(64 << 20).unwrap();
    let c = Endpoint::new(wire(&pool), EndpointConfig::default()).unwrap();
    let names = lane_sockets();
    assert!(
        names.len() >= 2,
        "the listener's and the connector's: {names:?}"
    );
    // A flood of idle connections, and garbage, on every lane socket here.
    let mut strangers = Vec::new();
    for name in &names {
        let a = UnixAddr::from_abstract_name(name.as_bytes()).unwrap();
        for _ in 0..100 {
            strangers.push(UnixStream::connect_addr(&a).unwrap());
        }
        let mut g = UnixStream::connect_addr(&a).unwrap();
        g.write_all(&[0xEE; 300]).unwrap();
        strangers.push(g);
    }
    let _ = c.progress();
    let _ = server.progress();
    // A real peer still moves to shared memory, despite the strangers.
    let peer = connect_also(&c, addr);
    exchange(&c, peer, &server, accepted(&server));
    drop(strangers);
}

/// The wire's inbox is shared by its lanes: a read pass stops once it is
/// full. Passes start one lane further each time, so two peers with a
/// backlog each are both read; the first lane's 64 messages all came
/// before the second's first when every pass began at the first lane.
#[test]
fn two_peers_with_a_backlog_share_a_small_inbox() {
    let _one = serial();
    let shm = ShmConfig {
        ring_bytes: 1 << 20,
        required: true,
        inbox_messages: 4,
        ..ShmConfig::default()
    };
    let mut t = LocalWire::new(
        private_pool(16 << 20).unwrap(),
        TcpConfig::default(),
        shm,
        Kind::Shm,
    )
    .unwrap();
    let addr = t.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let driven = EndpointConfig {
        progress_thread: false,
        ..EndpointConfig::default()
    };
    let server = Endpoint::new(t, driven).unwrap();
    // Both connect while the server answers them.
    let (clients, peers) = std::thread::scope(|s| {
        let dial = s.spawn(|| [connect(addr), connect(addr)]);
        let mut peers = Vec::new();
        while peers.len() < 2 {
            if let Event::Accepted { peer, .. } =
                server.next_event(Deadline::after(WAIT), None).unwrap()
            {
                peers.push(peer);
            }
        }
        (dial.join().unwrap(), peers)
    });
    // A backlog from each, in their rings before the server reads any.
    for (i, (c, to_server)) in clients.iter().enumerate() {
        for k in 0..64u8 {
            c.send(*to_server, &[i as u8, k], Deadline::after(WAIT), None)
                .unwrap();
        }
    }
    let mut from = Vec::new();
    for _ in 0..16 {
        let r = server.recv(Deadline::after(WAIT), None).unwrap();
        from.push(peers.iter().position(|p| *p == r.peer).unwrap());
    }
    assert!(
        from.contains(&0) && from.contains(&1),
        "the first 16 messages came from {from:?}"
    );
}

/// A lane setup answers an offer this side made; any local process can
/// connect to the lane socket and send well-formed setups, each with a
/// memfd, for offers never made. They are not kept: each held its segment
/// and its connection for the setup timeout, and a few hundred a second
/// ran the process out of descriptors.
#[test]
fn setups_for_offers_never_made_hold_nothing() {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;
    let _one = serial();
    let (c, a) = endpoint_and_its_lane_socket();
    let fds = traces().1;
    for token in 0..100u32 {
        let s = UnixStream::connect_addr(&a).unwrap();
        let segment =
            rustix::fs::memfd_create("stranger", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        // A setup as the lane's handshake writes it (version 2): magic,
        // version, token, and the segment's descriptor.
        let mut msg = [0u8; 12];
        msg[..4].copy_from_slice(b"ZHSU");
        msg[4..8].copy_from_slice(&2u32.to_le_bytes());
        msg[8..].copy_from_slice(&token.to_le_bytes());
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        let rights = [segment.as_fd()];
        assert!(control.push(SendAncillaryMessage::ScmRights(&rights)));
        rustix::net::sendmsg(
            &s,
            &[std::io::IoSlice::new(&msg)],
            &mut control,
            SendFlags::NOSIGNAL,
        )
        .unwrap();
        // Its own ends close here: what stays is what the endpoint keeps.
    }
    // Taken (accepted, read) by the endpoint's progress thread meanwhile:
    // a connection in the backlog is no descriptor of this process yet.
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    while traces().1 > fds && t.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        traces().1,
        fds,
        "descriptors held for setups of offers never made"
    );
    drop(c);
}

/// Between two pools of shared-memory files, a stream of large messages
/// sent from pool buffers goes placed after the first (claimed) one, each
/// arriving whole and in order, copied out of the receiver's mapping of the
/// sender's file; the sender's buffers all come back.
#[test]
fn placed_messages_stream_back_to_back_and_arrive_intact_and_in_order() {
    let _one = serial();
    let (server, addr, server_pool) = listener_in(pool(true));
    let client_pool = pool(true);
    let (client, peer) = connect_in(addr, Arc::clone(&client_pool));
    let from = accepted(&server);
    let message = |i: usize| -> Vec<u8> { (0..PLACED).map(|b| (b * 7 + i) as u8).collect() };
    const N: usize = 16;
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 0..N {
                send_leased(&client, peer, &message(i)).unwrap();
            }
        });
        for i in 0..N {
            let r = server.recv(Deadline::after(WAIT), None).unwrap();
            assert!(host_bytes(&r.lease) == message(i), "message {i} intact");
        }
    });
    client.flush(Deadline::after(WAIT)).unwrap();
    let sent = client.with(|t| t.single_copies(peer)).unwrap();
    assert_eq!(
        (sent.claimed, sent.placed),
        (1, N as u64 - 1),
        "the first claimed, the rest placed"
    );
    let got = server.with(|t| t.single_copies(from)).unwrap();
    assert_eq!(got.mapped, N as u64, "every one out of the mapped file");
    assert_eq!(client_pool.used_bytes(), 0, "the sender's buffers all back");
    assert_eq!(server_pool.used_bytes(), 0);
}

/// Between two pools of shared-memory files, the caller's slices (`send`)
/// of 64 KiB and 1 MiB go by the claim word, read out of the slice: none is
/// copied into the sender's pool, so none is placed and the receiver maps
/// no file for them. All arrive whole and in order.
#[test]
fn copied_slices_go_by_the_claim_word() {
    let _one = serial();
    let (server, addr, server_pool) = listener_in(pool(true));
    let client_pool = pool(true);
    let (client, peer) = connect_in(addr, Arc::clone(&client_pool));
    let from = accepted(&server);
    let message =
        |len: usize, i: usize| -> Vec<u8> { (0..len).map(|b| (b * 7 + i) as u8).collect() };
    const N: usize = 8;
    let sizes = [64 << 10, PLACED];
    std::thread::scope(|s| {
        s.spawn(|| {
            for len in sizes {
                for i in 0..N {
                    client
                        .send(peer, &message(len, i), Deadline::after(WAIT), None)
                        .unwrap();
                }
            }
        });
        for len in sizes {
            for i in 0..N {
                let r = server.recv(Deadline::after(WAIT), None).unwrap();
                assert!(
                    host_bytes(&r.lease) == message(len, i),
                    "{len}: message {i} intact"
                );
            }
        }
    });
    client.flush(Deadline::after(WAIT)).unwrap();
    let sent = client.with(|t| t.single_copies(peer)).unwrap();
    assert_eq!(
        (sent.claimed, sent.placed),
        (2 * N as u64, 0),
        "every one by the claim word"
    );
    let got = server.with(|t| t.single_copies(from)).unwrap();
    assert_eq!(got.mapped, 0, "none out of a mapped file");
    assert_eq!(client_pool.used_bytes(), 0, "the sender's buffers all back");
    assert_eq!(server_pool.used_bytes(), 0);
}

/// A large slice `send` took is the endpoint's to deliver until the peer
/// has it. While the peer cannot copy it (its transport held), `send` waits
/// for the claim word until its deadline, then finishes from a copy through
/// the ring and returns; what the ring cannot hold yet counts as pending,
/// and `flush` waits for it, asleep; flushed, the endpoint may go and the
/// message still arrives. (From 10ebd9c a slice copied into the pool went
/// claimed out of that buffer and `send` returned at once, and neither
/// `pending_sends` nor `flush` saw it until 2046ecb: dropped after a flush,
/// the peer lost it.)
#[test]
fn a_slice_send_took_is_pending_until_the_peer_has_it() {
    // Twice the ring: half of it must wait for the peer to read.
    let m: Vec<u8> = (0..2 << 20).map(|i| (i % 251) as u8).collect();
    pending_until_the_peer_has_it(true, m, 1 << 20, |client, peer, m| {
        let t0 = Instant::now();
        client
            .send(peer, m, Deadline::after(Duration::from_millis(200)), None)
            .unwrap();
        assert!(
            t0.elapsed() >= Duration::from_millis(200),
            "send waited for the claim word until its deadline"
        );
    });
}

/// A pool buffer of a private pool (no file the peer could map) goes by the
/// claim word, and `send_lease` returns at once: until the peer has read
/// it, its bytes count as pending and `flush` waits for the claim word,
/// asleep (it spun before e88c2b2, counting a handover as waiting for
/// ring room: 0.3 s of CPU in a 0.3 s flush); flushed, the endpoint may go
/// and the message still arrives. (Every handover's bytes count since
/// 2046ecb: a handed-over buffer did not, and `flush` returned at once.)
#[test]
fn a_buffer_handed_over_is_pending_until_the_peer_has_it() {
    let m: Vec<u8> = (0..64 << 10).map(|i| (i % 251) as u8).collect();
    let len = m.len();
    let client_pool = pending_until_the_peer_has_it(false, m, len, |client, peer, m| {
        send_leased(client, peer, m).unwrap();
    });
    assert_eq!(client_pool.used_bytes(), 0, "the sender's buffer back");
}

/// A client (pools of shared-memory files or of private memory: `shared`) whose
/// server is held while `send` gives it `m`: at least `pending` bytes of
/// it count as pending, and `flush` waits for the peer, asleep; once the
/// server reads, `flush` ends, the client may go and the message arrives
/// intact. The client's pool.
fn pending_until_the_peer_has_it(
    shared: bool,
    m: Vec<u8>,
    pending: usize,
    send: impl FnOnce(&Endpoint<LocalWire>, PeerId, &[u8]),
) -> Arc<StdPool> {
    let _one = serial();
    let (server, addr, _server_pool) = listener_in(pool(shared));
    let client_pool = pool(shared);
    let (client, peer) = connect_in(addr, Arc::clone(&client_pool));
    let _from = accepted(&server);
    server.with(|_held| {
        send(&client, peer, &m);
        assert!(
            client.pending_sends() >= pending,
            "pending while the peer is held: {}",
            client.pending_sends()
        );
        let (cpu, t0) = (thread_cpu(), Instant::now());
        assert_eq!(
            client.flush(Deadline::after(Duration::from_millis(300))),
            Err(Error::Timeout),
            "flush waits for the peer"
        );
        // Asleep, not spinning: behind a handover it waits for the claim
        // word, behind queued bytes for the room the peer's read makes.
        let (cpu, wall) = (thread_cpu() - cpu, t0.elapsed());
        assert!(cpu < wall / 3, "flush spun: {cpu:?} of CPU in {wall:?}");
    });
    let reader = std::thread::spawn(move || {
        let r = server.recv(Deadline::after(WAIT), None).unwrap();
        host_bytes(&r.lease) == m
    });
    client.flush(Deadline::after(WAIT)).unwrap();
    assert_eq!(client.pending_sends(), 0);
    drop(client);
    assert!(reader.join().unwrap(), "intact");
    client_pool
}

/// Bytes queued for one same-host peer (its ring full while it was held)
/// go out once it reads again, while the application only sends to another
/// peer: each send rings the progress thread while any lane has bytes
/// left, since nothing else wakes it for a pass while the application
/// keeps calling. (A send that asked only its own lane, tried and not
/// kept, left them queued for as long as the sends to the other peer went
/// on: 599 152 bytes for 600 ms, where they went at once before.)
#[test]
fn bytes_queued_for_one_peer_go_while_the_application_sends_only_to_another() {
    let _one = serial();
    let QueuedForX {
        x,
        y: _y,
        a,
        to_y,
        m,
    } = queued_for_x();
    let t0 = Instant::now();
    while a.pending_sends() > 0 && t0.elapsed() < Duration::from_secs(5) {
        a.send(to_y, b"ping", Deadline::after(WAIT), None).unwrap();
        std::thread::sleep(Duration::from_micros(500));
    }
    assert_eq!(
        a.pending_sends(),
        0,
        "the queue for the first peer went while the sends to the other did"
    );
    for _ in 0..QUEUED {
        let r = x.recv(Deadline::after(WAIT), None).unwrap();
        assert!(host_bytes(&r.lease) == m);
    }
}

/// Messages [`queued_for_x`] sends to x while x is held.
const QUEUED: usize = 100;

/// Two listening endpoints, x and y, and `a` connected to both.
struct QueuedForX {
    x: Endpoint<LocalWire>,
    y: Endpoint<LocalWire>,
    a: Endpoint<LocalWire>,
    to_y: PeerId,
    /// What went to x, [`QUEUED`] times.
    m: Vec<u8>,
}

/// [`QueuedForX`], with more than x's ring holds queued for x: `QUEUED`
/// buffers of 16 KiB sent while x was held.
fn queued_for_x() -> QueuedForX {
    let (x, x_addr, _x_pool) = listener_in(pool(false));
    let (y, y_addr, _y_pool) = listener_in(pool(false));
    let (a, to_x) = connect_in(x_addr, pool(false));
    let _from_a = accepted(&x);
    let to_y = connect_also(&a, y_addr);
    let _from_a_too = accepted(&y);
    let m = vec![7u8; 16 << 10];
    x.with(|_held| {
        for _ in 0..QUEUED {
            send_leased(&a, to_x, &m).unwrap();
        }
    });
    assert!(
        a.pending_sends() > 0,
        "more than the ring holds waits in the queue"
    );
    QueuedForX { x, y, a, to_y, m }
}

/// The `i`-th message of [`dry_server`]'s client: one 4 KiB buffer each.
fn dry_msg(i: usize) -> Vec<u8> {
    vec![i as u8; 4000]
}

/// A server (with `config`) whose application holds every buffer of its
/// 256 KiB pool (64 of 4 KiB: `dry_msg(0..64)`), while `dry_msg(64)` waits
/// in its ring; the client, kept alive beside it.
fn dry_server(
    config: EndpointConfig,
) -> (
    Endpoint<LocalWire>,
    Endpoint<LocalWire>,
    Vec<Received<ShmLease>>,
) {
    let pool = private_pool(256 << 10).unwrap();
    let mut t = wire(&pool);
    let addr = t.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let server = Endpoint::new(t, config).unwrap();
    let (client, peer) = connect_in(addr, self::pool(false));
    let _from = accepted(&server);
    for i in 0..65 {
        client
            .send(peer, &dry_msg(i), Deadline::after(WAIT), None)
            .unwrap();
    }
    let held: Vec<_> = (0..64)
        .map(|_| server.recv(Deadline::after(WAIT), None).unwrap())
        .collect();
    assert_eq!(pool.stats().budget, pool.stats().used_bytes, "all held");
    (server, client, held)
}

/// A receiver whose pool is dry (the application holds every buffer) while
/// a message waits in its ring sleeps until a buffer comes back, noticed
/// within the poll interval, rather than spinning on bytes it cannot take
/// (it spun: 0.3 s of CPU in a 0.3 s `recv`).
#[test]
fn a_receiver_whose_pool_is_dry_sleeps_and_takes_the_message_once_a_buffer_is_back() {
    let _one = serial();
    let (server, _client, mut held) = dry_server(EndpointConfig::default());
    let (cpu, t0) = (thread_cpu(), Instant::now());
    assert_eq!(
        server
            .recv(Deadline::after(Duration::from_millis(300)), None)
            .map(|r| r.lease.len()),
        Err(Error::Timeout),
        "nothing to receive into"
    );
    let (cpu, wall) = (thread_cpu() - cpu, t0.elapsed());
    assert!(cpu < wall / 3, "recv spun: {cpu:?} of CPU in {wall:?}");
    let first = held.remove(0);
    assert!(host_bytes(&first.lease) == dry_msg(0));
    drop(first);
    let last = server.recv(Deadline::after(WAIT), None).unwrap();
    assert!(
        host_bytes(&last.lease) == dry_msg(64),
        "the waiting one, intact"
    );
}

/// A receiver asleep on a dry pool wakes when another thread gives a buffer
/// back (the pool's bell), not at its next look: with a poll interval of an
/// hour, the waiting message still comes within the deadline.
#[test]
fn a_buffer_given_back_by_another_thread_wakes_a_receiver_asleep_on_a_dry_pool() {
    let _one = serial();
    let slow_looks = EndpointConfig {
        poll_interval: Duration::from_secs(3600),
        ..EndpointConfig::default()
    };
    let (server, _client, mut held) = dry_server(slow_looks);
    let first = held.remove(0);
    let giver = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200)); // the receiver asleep by then
        drop(first);
    });
    let t0 = Instant::now();
    let last = server.recv(Deadline::after(WAIT), None);
    let waited = t0.elapsed();
    giver.join().unwrap();
    // Unwoken, it sleeps out the deadline (its poll's only bound) and finds
    // the buffer then: the whole WAIT.
    assert!(
        waited < WAIT / 2,
        "asleep {waited:?} after the buffer came back"
    );
    let last = last.unwrap();
    assert!(
        host_bytes(&last.lease) == dry_msg(64),
        "the waiting one, intact"
    );
}

/// Two endpoints with small pools, each holding messages it received,
/// each send a 100 KiB slice before reading: both arrive. With 2 MiB pools
/// and one held message; with 6 MiB pools and two small ones besides,
/// which keep chunks carved for their sizes. (While slices were copied
/// into the pool and placed, 10ebd9c to 56eb34f, each side's copy could
/// hold the last buffer a receive needed until the other copied it: both
/// receives starved, until 2046ecb and the commit after it left room.)
#[test]
fn large_slices_both_ways_arrive_between_small_pools() {
    large_slices_both_ways(2 << 20, &[]);
    large_slices_both_ways(6 << 20, &[100, 500]);
}

/// Two endpoints with pools of `pool_bytes`, each holding messages it
/// received (of `small` bytes, then one of 100 KiB), each send a 100 KiB
/// slice before reading: both arrive.
fn large_slices_both_ways(pool_bytes: usize, small: &[usize]) {
    use zerohop_core::Transport;
    let _one = serial();
    let (server_pool, client_pool) = (
        shared_pool(pool_bytes).unwrap(),
        shared_pool(pool_bytes).unwrap(),
    );
    let (server, addr, _) = listener_in(Arc::clone(&server_pool));
    let (client, peer) = connect_in(addr, Arc::clone(&client_pool));
    let from = accepted(&server);
    let m = vec![1u8; 100 << 10];
    let mut held = Vec::new();
    for held_len in small.iter().copied().chain([m.len()]) {
        let h = vec![2u8; held_len];
        client.send(peer, &h, Deadline::after(WAIT), None).unwrap();
        held.push(server.recv(Deadline::after(WAIT), None).unwrap());
        server.send(from, &h, Deadline::after(WAIT), None).unwrap();
        held.push(client.recv(Deadline::after(WAIT), None).unwrap());
    }
    // Both sends before either side reads.
    client.with(|c| {
        server.with(|s| {
            c.try_send(peer, &m).unwrap();
            s.try_send(from, &m).unwrap();
        })
    });
    let a = client.recv(Deadline::after(WAIT), None);
    let b = server.recv(Deadline::after(WAIT), None);
    assert!(
        a.is_ok() && b.is_ok(),
        "client {:?}, server {:?}",
        a.map(|r| r.lease.len()),
        b.map(|r| r.lease.len())
    );
}

/// A caller that cannot wait (a zero deadline) leaves each single-copy
/// message before the peer takes it: withdrawn, one after another while
/// the peer reads nothing yet, and every one still arrives intact, in order.
#[test]
fn single_copy_messages_withdrawn_back_to_back_arrive_intact_and_in_order() {
    let _one = serial();
    let (server, addr, _pool) = listener();
    let (client, peer) = connect(addr);
    let from = accepted(&server);
    let n = 40u8;
    std::thread::scope(|scope| {
        // The receiver starts late: the first messages are all withdrawn
        // before it comes to any of them.
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            for i in 0..n {
                let r = server
                    .recv(Deadline::after(WAIT), None)
                    .unwrap_or_else(|e| panic!("receiving message {i}: {e}"));
                assert_eq!(r.peer, from);
                let b = host_bytes(&r.lease);
                assert_eq!(b.len(), SINGLE + usize::from(i), "message {i}");
                assert!(b.iter().all(|&x| x == i), "message {i} intact");
            }
        });
        let mut sent = 0u8;
        let t0 = Instant::now();
        while sent < n {
            assert!(t0.elapsed() < 3 * WAIT, "{sent} of {n} sent");
            let m = vec![sent; SINGLE + usize::from(sent)];
            match client.send(peer, &m, Deadline::after(Duration::ZERO), None) {
                Ok(()) => sent += 1,
                Err(Error::Timeout | Error::WouldBlock) => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => panic!("message {sent}: {e}"),
            }
        }
    });
}

#[test]
fn two_threads_sending_to_one_peer_each_finish_only_their_own_frames() {
    let _one = serial();
    let (server, addr, _pool) = listener();
    let (client, peer) = connect(addr);
    let from = accepted(&server);
    const EACH: u32 = 300;
    const SMALL: usize = 24 << 10; // through the ring, which it overruns
    std::thread::scope(|scope| {
        // One thread's caller waits on each single copy's handover, the
        // other's finishes its ring frames from its slice as the ring
        // drains: whoever ends one thread's frame, the other must go on
        // with its own, not write its bytes into that one's place.
        for (tag, len) in [(1u8, SINGLE), (2u8, SMALL)] {
            let client = &client;
            scope.spawn(move || {
                for i in 0..EACH {
                    let mut m = vec![tag; len];
                    m[..4].copy_from_slice(&i.to_le_bytes());
                    client
                        .send(peer, &m, Deadline::after(WAIT), None)
                        .unwrap_or_else(|e| panic!("sender {tag}, message {i}: {e}"));
                }
            });
        }
        std::thread::sleep(Duration::from_millis(100)); // the ring fills first
        let mut next = [0u32; 3];
        for n in 0..2 * EACH {
            let r = server
                .recv(Deadline::after(WAIT), None)
                .unwrap_or_else(|e| panic!("receiving message {n}: {e}"));
            assert_eq!(r.peer, from);
            let b = host_bytes(&r.lease);
            let tag = b[4];
            let len = match tag {
                1 => SINGLE,
                2 => SMALL,
                _ => panic!("message {n}: of neither sender (byte {tag})"),
            };
            assert_eq!(b.len(), len, "message {n} from sender {tag}");
            let i = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            assert!(
                b[4..].iter().all(|&x| x == tag),
                "sender {tag}'s {i} intact"
            );
            assert_eq!(i, next[usize::from(tag)], "sender {tag}'s in order");
            next[usize::from(tag)] += 1;
        }
    });
}

#[test]
fn a_zero_copy_sender_of_small_messages_never_holds_every_buffer() {
    let _one = serial();
    let (server, addr, _pool) = listener();
    let (client, peer) = connect(addr);
    let from = accepted(&server);
    const N: u32 = 200_000;
    std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(200)); // the sender runs ahead
            for i in 0..N {
                let r = server
                    .recv(Deadline::after(WAIT), None)
                    .unwrap_or_else(|e| panic!("message {i}: {e}"));
                assert_eq!(r.peer, from);
                assert_eq!(host_bytes(&r.lease)[..4], i.to_le_bytes(), "in order");
            }
        });
        for i in 0..N {
            // `lease` does not wait: it fails once queued sends hold every
            // buffer descriptor of the pool, which the queue's bound on
            // messages (not only bytes) prevents.
            let mut l = client
                .lease(64)
                .unwrap_or_else(|e| panic!("lease {i}: {e}"));
            let b = zerohop_backends::host_bytes_mut(l.host_mut().expect("a host buffer"));
            b[..4].copy_from_slice(&i.to_le_bytes());
            client
                .send_lease(peer, l, Deadline::after(WAIT), None)
                .unwrap_or_else(|e| panic!("send {i}: {e}"));
        }
    });
}

#[test]
fn a_wire_with_lanes_is_of_kind_shm_or_uma_and_says_so() {
    use zerohop_core::Transport;
    let _one = serial(); // its wires' descriptors would count in a kill test's
    let pool = private_pool(8 << 20).unwrap();
    let t = wire(&pool);
    assert_eq!(t.kind(), Kind::Shm);
    assert!(
        !t.caps().gpu_resident,
        "private host memory: no kernel reads it"
    );
    // `uma` receives into managed memory, which a private pool is not.
    for other in [
        Kind::Uma,
        Kind::Tcp,
        Kind::Rdma,
        Kind::Gpudirect,
        Kind::Mock,
    ] {
        let e = LocalWire::new(
            Arc::clone(&pool),
            TcpConfig::default(),
            ShmConfig::default(),
            other,
        )
        .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{other:?}");
    }
    // Over a managed pool, where there is a GPU (the facade's uma test
    // runs the whole wire there).
    #[cfg(feature = "cuda-uma")]
    if let Ok(managed) = zerohop_std::managed_pool(8 << 20) {
        let u = LocalWire::new(
            managed,
            TcpConfig::default(),
            ShmConfig::default(),
            Kind::Uma,
        )
        .unwrap();
        assert_eq!(u.kind(), Kind::Uma);
        assert!(u.caps().gpu_resident, "a kernel reads managed memory");
    }
}

/// A lane from `a` (with a progress thread) to a caller-driven receiver
/// `b` (none), `idle` their idle timeout, one message already across; and
/// the id `a` has for `b`.
#[cfg(feature = "testing")]
fn caller_driven_lane(idle: Duration) -> (Endpoint<LocalWire>, Endpoint<LocalWire>, PeerId) {
    caller_driven_lane_from(idle, private_pool(16 << 20).unwrap())
}

/// As [`caller_driven_lane`], `a` sending from `a_pool`.
#[cfg(feature = "testing")]
fn caller_driven_lane_from(
    idle: Duration,
    a_pool: Arc<StdPool>,
) -> (Endpoint<LocalWire>, Endpoint<LocalWire>, PeerId) {
    let tcp = TcpConfig {
        idle_timeout: idle,
        ..TcpConfig::default()
    };
    let mut b = wire_with(&private_pool(16 << 20).unwrap(), tcp);
    let addr = b.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let driven = EndpointConfig {
        progress_thread: false,
        ..EndpointConfig::default()
    };
    let b = Endpoint::new(b, driven).unwrap();
    let a = Endpoint::new(wire_with(&a_pool, tcp), EndpointConfig::default()).unwrap();
    // The receiver is driven by its caller: it answers the connection
    // while it waits for it.
    let (to_b, to_a) = std::thread::scope(|s| {
        let accepted = s.spawn(|| loop {
            if let Event::Accepted { peer, .. } = b.next_event(Deadline::after(WAIT), None).unwrap()
            {
                return peer;
            }
        });
        let d = TcpTransport::dial(addr, WAIT, true).unwrap();
        let p = a.with(|t| t.attach(d)).unwrap();
        (
            a.wait_open(p, Deadline::after(WAIT)).unwrap(),
            accepted.join().unwrap(),
        )
    });
    assert!(to_b.0 & LANE_BIT != 0 && to_a.0 & LANE_BIT != 0);
    a.send(to_b, b"m0", Deadline::after(WAIT), None).unwrap();
    let r = b.recv(Deadline::after(WAIT), None).unwrap();
    assert_eq!(host_bytes(&r.lease), b"m0");
    drop(r);
    (a, b, to_b)
}

/// A sender dropped without `close` gives its buffers back to its pool
/// while a single-copy message of its waits to be copied, and its next
/// lease writes that buffer again. The receiver loses the peer; it never
/// delivers those bytes as the message (the ring's `ended` word,
/// RELIABILITY.md item 17).
#[cfg(feature = "testing")]
#[test]
fn a_sender_dropped_unclosed_with_a_message_out_is_lost_not_read_out_of_its_reused_buffer() {
    let _one = serial();
    let a_pool = private_pool(16 << 20).unwrap();
    let (a, b, to_b) = caller_driven_lane_from(Duration::from_secs(5), Arc::clone(&a_pool));
    let mut l = a.lease(SINGLE).unwrap();
    let buf = l.host_mut().expect("a host buffer");
    zerohop_backends::host_bytes_mut(buf).fill(0x5A);
    let at = zerohop_backends::host_bytes(buf).as_ptr();
    a.send_lease(to_b, l, Deadline::after(WAIT), None).unwrap();
    drop(a); // no close: its lane goes, its buffers back to the pool
    let mut again = zerohop_core::Lease::take(Arc::clone(&a_pool), SINGLE).unwrap();
    let bytes = zerohop_backends::host_bytes_mut(&mut again);
    assert_eq!(bytes.as_ptr(), at, "the message's buffer, leased again");
    bytes.fill(0xEE);
    match b.recv(Deadline::after(WAIT), None) {
        Err(Error::PeerLost(_)) => {}
        Ok(r) => panic!(
            "a message of {} bytes delivered, {:#x} its first byte",
            r.lease.len(),
            host_bytes(&r.lease)[0]
        ),
        Err(e) => panic!("{e}"),
    }
    drop(again);
    assert_eq!(a_pool.used_bytes(), 0);
}

/// A device message's bytes here, and the one written over them once its
/// sender is gone.
#[cfg(feature = "cuda-uma")]
const DEVICE_SENT: u8 = 0x5A;
#[cfg(feature = "cuda-uma")]
const DEVICE_REUSED: u8 = 0xEE;
#[cfg(feature = "cuda-uma")]
const DEVICE_LEN: usize = 8 << 20;

/// A wire whose lanes carry device messages from and into `device`.
#[cfg(feature = "cuda-uma")]
fn device_wire(device: &Arc<zerohop_backends::cuda::DevicePool>) -> LocalWire {
    let mut t = wire(&private_pool(16 << 20).unwrap());
    t.carry_device(Arc::clone(device));
    t
}

/// A device test's listening side: a device pool of `budget` bytes and a
/// caller-driven endpoint (`looks`), or `None` (SKIPPED) without a GPU.
#[cfg(feature = "cuda-uma")]
fn device_server(
    test: &str,
    budget: usize,
    looks: EndpointConfig,
) -> Option<(
    Endpoint<LocalWire>,
    SocketAddr,
    Arc<zerohop_backends::cuda::DevicePool>,
)> {
    let gpu = match zerohop_backends::cuda::Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            return None;
        }
    };
    let device = zerohop_backends::cuda::device_pool(&gpu, budget).unwrap();
    let mut t = device_wire(&device);
    let addr = t.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let looks = EndpointConfig {
        progress_thread: false,
        ..looks
    };
    Some((Endpoint::new(t, looks).unwrap(), addr, device))
}

/// This binary's helper test `child` as the other process, told `addr`,
/// its stdin a pipe (it stays until that closes).
#[cfg(feature = "cuda-uma")]
fn device_child(child: &str, addr: SocketAddr) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--ignored", "--exact", child, "--nocapture"])
        .env("ZEROHOP_TEST_CONNECT", addr.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::null());
    c
}

/// A device test's helper process: its endpoint (device pool 512 MiB),
/// connected to `ZEROHOP_TEST_CONNECT` and moved to a lane; `None` when
/// run as a test of its own.
#[cfg(feature = "cuda-uma")]
fn device_client() -> Option<(
    Endpoint<LocalWire>,
    PeerId,
    Arc<zerohop_backends::cuda::DevicePool>,
)> {
    let addr = std::env::var("ZEROHOP_TEST_CONNECT").ok()?;
    let gpu = zerohop_backends::cuda::Gpu::open(0).unwrap();
    let device = zerohop_backends::cuda::device_pool(&gpu, 512 << 20).unwrap();
    let e = Endpoint::new(device_wire(&device), EndpointConfig::default()).unwrap();
    let peer = connect_also(&e, addr.parse().unwrap());
    Some((e, peer, device))
}

/// A device `ended` test's sender, up to its one device message: the
/// ready/go exchange (the receiver stops driving its endpoint once it has
/// answered), then an 8 MiB device message of `DEVICE_SENT`. The endpoint,
/// the peer, the device pool and the message buffer's address; `None` when
/// run as a test of its own.
#[cfg(feature = "cuda-uma")]
fn device_sender_sent() -> Option<(
    Endpoint<LocalWire>,
    PeerId,
    Arc<zerohop_backends::cuda::DevicePool>,
    u64,
)> {
    let (e, peer, device) = device_client()?;
    e.send(peer, b"ready", Deadline::after(WAIT), None).unwrap();
    let go = e.recv(Deadline::after(WAIT), None).unwrap();
    assert_eq!(host_bytes(&go.lease), b"go");
    let l = zerohop_core::Lease::take(Arc::clone(&device), DEVICE_LEN).unwrap();
    zerohop_backends::cuda::write_lease(&l, &vec![DEVICE_SENT; DEVICE_LEN]).unwrap();
    let at = l.device_ptr();
    e.send_lease(peer, ShmLease::Device(l), Deadline::after(WAIT), None)
        .unwrap();
    Some((e, peer, device, at))
}

/// Once the sender's lane has ended: the message's buffer (at `at`) leased
/// again from `device` and written over with `DEVICE_REUSED`, returned to
/// be kept alive (so the peer's mapping still reads it).
#[cfg(feature = "cuda-uma")]
fn reuse_sent_buffer(
    device: &Arc<zerohop_backends::cuda::DevicePool>,
    at: u64,
) -> zerohop_backends::cuda::DeviceLease {
    let again = zerohop_core::Lease::take(Arc::clone(device), DEVICE_LEN).unwrap();
    assert_eq!(again.device_ptr(), at, "the message's buffer, leased again");
    zerohop_backends::cuda::write_lease(&again, &vec![DEVICE_REUSED; DEVICE_LEN]).unwrap();
    again
}

/// The sender of the device `ended` test: one device message out, then its
/// endpoint dropped without `close`, and the message's buffer leased again
/// and written over. It stays until its stdin closes.
#[cfg(feature = "cuda-uma")]
#[test]
#[ignore = "a helper process for the device ended test"]
fn child_device_dropper() {
    use std::io::Read;
    let Some((e, _peer, device, at)) = device_sender_sent() else {
        return;
    };
    drop(e); // no close: its lane ends, the message's buffer goes back
    let _kept = reuse_sent_buffer(&device, at);
    eprintln!("dropped");
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
}

/// A device `ended` test's receiving side, up to the sender's device
/// message: a caller-driven endpoint, the sender `child` spawned (its
/// stderr piped, where it says how far it got), accepted, and the ready/go
/// exchange; the endpoint is not driven again until the test says so.
/// `None` (SKIPPED) without a GPU.
#[cfg(feature = "cuda-uma")]
fn device_ended_receiver(
    test: &str,
    child: &str,
) -> Option<(
    Endpoint<LocalWire>,
    PeerId,
    Arc<zerohop_backends::cuda::DevicePool>,
    Reaped,
)> {
    let (server, addr, device) = device_server(test, 512 << 20, EndpointConfig::default())?;
    let child = Reaped(
        device_child(child, addr)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let peer = accepted(&server);
    let ready = server.recv(Deadline::after(WAIT), None).unwrap();
    assert_eq!(host_bytes(&ready.lease), b"ready");
    drop(ready);
    server
        .send(peer, b"go", Deadline::after(WAIT), None)
        .unwrap();
    Some((server, peer, device, child))
}

/// Reads a child's stderr lines (`said`) until one is `word`: `false` if
/// the child ended first.
#[cfg(feature = "cuda-uma")]
fn child_says(said: &mut impl Iterator<Item = std::io::Result<String>>, word: &str) -> bool {
    said.any(|l| l.is_ok_and(|l| l == word))
}

/// The device path of the ring's `ended` word (RELIABILITY.md item 17): a
/// sender dropped without `close` while its device message waits to be
/// copied gives the buffer back to its pool, which leases and writes it
/// again; the receiver then copies it by CUDA IPC, device to device, and
/// must lose the peer, not deliver the rewritten bytes as the message.
/// Two processes: CUDA IPC opens no handle in the process that made it.
/// Without a GPU it prints SKIPPED.
#[cfg(feature = "cuda-uma")]
#[test]
fn a_device_sender_dropped_unclosed_is_lost_not_read_out_of_its_reused_buffer() {
    use std::io::BufRead;
    let _one = serial();
    let test = "a_device_sender_dropped_unclosed_is_lost_not_read_out_of_its_reused_buffer";
    let Some((server, peer, device, mut child)) =
        device_ended_receiver(test, "child_device_dropper")
    else {
        return;
    };
    // Not driven until the sender has sent, dropped and written over.
    let mut said = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    assert!(child_says(&mut said, "dropped"), "the sender failed");
    lost_not_delivered(&server, peer, &device, child);
}

/// The receiver's side of the device `ended` tests, once the sender's lane
/// has ended and its buffer holds other bytes: its next `recv` loses the
/// peer (it does not deliver the message), holds no device buffer, and the
/// sender (`child`) exits well once its stdin closes.
#[cfg(feature = "cuda-uma")]
fn lost_not_delivered(
    server: &Endpoint<LocalWire>,
    peer: PeerId,
    device: &zerohop_backends::cuda::DevicePool,
    mut child: Reaped,
) {
    match server.recv(Deadline::after(WAIT), None) {
        Err(Error::PeerLost(p)) => assert_eq!(p, peer),
        Ok(r) => {
            let ShmLease::Device(l) = &r.lease else {
                panic!("a host message of {} bytes", r.lease.len())
            };
            let mut first = [0u8];
            zerohop_backends::cuda::read_lease(l, &mut first).unwrap();
            panic!(
                "a device message of {} bytes delivered, {:#x} its first byte",
                l.len(),
                first[0]
            );
        }
        Err(e) => panic!("{e}"),
    }
    assert_eq!(device.used_bytes(), 0, "the receive buffer back");
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success(), "the sender failed");
}

/// The sender of the device own-error test: one device message out; then,
/// told on its stdin that the receiver has said something impossible (that
/// it copied a device message never sent), its endpoint's next `recv`
/// reports that peer's rule broken (the wire drops the lane, and the
/// message's buffer goes back to the pool), and the buffer is leased again
/// and written over. It stays until its stdin closes.
#[cfg(feature = "cuda-uma")]
#[test]
#[ignore = "a helper process for the device own-error test"]
fn child_device_sender_told_the_impossible() {
    use std::io::{BufRead, Read};
    let Some((e, peer, device, at)) = device_sender_sent() else {
        return;
    };
    eprintln!("sent");
    let mut stdin = std::io::stdin().lock();
    let mut told = String::new();
    stdin.read_line(&mut told).unwrap();
    assert_eq!(told, "told\n");
    match e.recv(Deadline::after(WAIT), None) {
        Err(Error::WireRule { peer: p, rule }) => {
            assert_eq!(p, peer);
            assert!(rule.contains("never sent"), "{rule}");
        }
        Err(e) => panic!("{e}"),
        Ok(r) => panic!("a message of {} bytes", r.lease.len()),
    }
    let _kept = reuse_sent_buffer(&device, at);
    eprintln!("reused");
    let _ = stdin.read_to_end(&mut Vec::new());
}

/// The device path of a lane that ends on its own side's error while the
/// peer is still to copy (RELIABILITY.md, the `ended` word): the receiver
/// tells the sender it copied a device message the sender never sent; the
/// sender's wire drops the lane for it, its buffer goes back to the pool and
/// is leased and written again; the receiver's copy by CUDA IPC then must
/// lose the peer, not deliver the rewritten bytes as the message. Two
/// processes: CUDA IPC opens no handle in the process that made it. Without
/// a GPU it prints SKIPPED.
#[cfg(feature = "cuda-uma")]
#[test]
fn a_device_sender_whose_lane_failed_on_its_own_is_lost_not_read_out_of_its_reused_buffer() {
    use std::io::{BufRead, Write};
    let _one = serial();
    let test =
        "a_device_sender_whose_lane_failed_on_its_own_is_lost_not_read_out_of_its_reused_buffer";
    let Some((server, peer, device, mut child)) =
        device_ended_receiver(test, "child_device_sender_told_the_impossible")
    else {
        return;
    };
    // Not driven from here until the sender has failed and written over.
    let mut said = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    assert!(child_says(&mut said, "sent"), "the sender failed");
    // Ticket 99: the sender has sent one device message.
    server.with(|t| t.say_device_done(peer, 99)).unwrap();
    child.stdin.as_mut().unwrap().write_all(b"told\n").unwrap();
    assert!(child_says(&mut said, "reused"), "the sender failed");
    lost_not_delivered(&server, peer, &device, child);
}

/// Device messages the streamer sends, and the most of them the receiver's
/// device pool holds at once (one 64 MiB chunk of 16 MiB buffers).
#[cfg(feature = "cuda-uma")]
const STREAMED: usize = 6;
#[cfg(feature = "cuda-uma")]
const DEVICE_HELD: usize = 4;

/// The sender of the device bell test: `STREAMED` device messages, message
/// `i` filled with byte `i`, then it stays until its stdin closes.
#[cfg(feature = "cuda-uma")]
#[test]
#[ignore = "a helper process for the device bell test"]
fn child_device_streamer() {
    use std::io::Read;
    let Some((e, peer, device)) = device_client() else {
        return;
    };
    for i in 0..STREAMED {
        let l = zerohop_core::Lease::take(Arc::clone(&device), DEVICE_LEN).unwrap();
        zerohop_backends::cuda::write_lease(&l, &vec![i as u8; DEVICE_LEN]).unwrap();
        e.send_lease(peer, ShmLease::Device(l), Deadline::after(WAIT * 3), None)
            .unwrap();
    }
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    e.close(Deadline::after(WAIT)).unwrap();
}

/// A receiver whose device pool ran dry (the application holds every
/// device buffer) sleeps until a buffer comes back, and wakes when another
/// thread gives one back (the device pool's bell), not at its next look:
/// with a poll interval of an hour, the waiting message still comes long
/// before the deadline, without spinning. Two processes: CUDA IPC opens no
/// handle in the process that made it. Without a GPU it prints SKIPPED.
#[cfg(feature = "cuda-uma")]
#[test]
fn a_device_buffer_given_back_wakes_a_receiver_whose_device_pool_ran_dry() {
    let _one = serial();
    let test = "a_device_buffer_given_back_wakes_a_receiver_whose_device_pool_ran_dry";
    let slow_looks = EndpointConfig {
        poll_interval: Duration::from_secs(3600),
        ..EndpointConfig::default()
    };
    let Some((server, addr, _device)) = device_server(test, 64 << 20, slow_looks) else {
        return;
    };
    let mut child = Reaped(device_child("child_device_streamer", addr).spawn().unwrap());
    let _peer = accepted(&server);
    let first_byte = |r: &Received<ShmLease>| {
        let ShmLease::Device(l) = &r.lease else {
            panic!("a host message of {} bytes", r.lease.len())
        };
        assert_eq!(l.len(), DEVICE_LEN);
        let mut b = [0u8];
        zerohop_backends::cuda::read_lease(l, &mut b).unwrap();
        b[0]
    };
    let mut held = Vec::new();
    for i in 0..DEVICE_HELD {
        let r = server.recv(Deadline::after(WAIT), None).unwrap();
        assert_eq!(first_byte(&r), i as u8, "message {i}");
        held.push(r);
    }
    match server.recv(Deadline::after(Duration::from_secs(1)), None) {
        Err(Error::Timeout) => {}
        Ok(r) => panic!("a message beyond the device pool: {}", first_byte(&r)),
        Err(e) => panic!("{e}"),
    }
    let first = held.remove(0);
    let giver = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200)); // the receiver asleep by then
        drop(first);
    });
    let (cpu, t0) = (thread_cpu(), Instant::now());
    let next = server.recv(Deadline::after(WAIT), None);
    let (cpu, waited) = (thread_cpu() - cpu, t0.elapsed());
    giver.join().unwrap();
    // Unwoken, it sleeps out the deadline (its poll's only bound).
    assert!(
        waited < Duration::from_secs(5),
        "asleep {waited:?} after the buffer came back"
    );
    assert!(cpu < waited / 3, "recv spun: {cpu:?} of CPU in {waited:?}");
    assert_eq!(first_byte(&next.unwrap()), DEVICE_HELD as u8, "in order");
    drop(held);
    let last = server.recv(Deadline::after(WAIT), None).unwrap();
    assert_eq!(first_byte(&last), DEVICE_HELD as u8 + 1, "the last");
    drop(last);
    // The streamer closes once its stdin does: driven here, this side
    // answers its Close.
    drop(child.stdin.take());
    match server.recv(Deadline::after(WAIT), None) {
        Err(Error::PeerClosed(_)) => {}
        Ok(r) => panic!("a message beyond the stream: {}", first_byte(&r)),
        Err(e) => panic!("{e}"),
    }
    assert!(child.wait().unwrap().success(), "the streamer failed");
}

/// The second data frame of a lane (its payload too), to write by hand.
#[cfg(feature = "testing")]
fn second_frame(payload: &[u8]) -> Vec<u8> {
    use zerohop_core::wire::{Data, DataFlags, Frame};
    let header = Frame::Data(Data {
        flags: DataFlags::NONE,
        seq: 1,
        msg_len: payload.len() as u32,
        len: payload.len() as u32,
        offset: 0,
        credits: 0,
        control: 0,
    })
    .encode(payload);
    let mut frame = header.to_vec();
    frame.extend_from_slice(payload);
    frame
}

/// A caller-driven receiver (no progress thread) away for longer than the
/// idle timeout, which then finds a frame half written, waits for the rest
/// as it would any time: the quiet before the frame is not the frame's
/// stall. (Its lanes are read with the time of the last side pass, which
/// after the quiet is old.)
#[cfg(feature = "testing")]
#[test]
fn a_frame_half_written_after_a_long_quiet_is_not_a_stall() {
    let _g = serial();
    let idle = Duration::from_millis(800);
    let (a, b, to_b) = caller_driven_lane(idle);
    // Away, past the idle timeout.
    std::thread::sleep(idle + Duration::from_millis(400));
    let payload: Vec<u8> = (0..4000u32).map(|i| (i % 251) as u8).collect();
    let frame = second_frame(&payload);
    let half = frame.len() / 2;
    a.with(|t| t.send_raw_frame(to_b, &frame[..half])).unwrap();
    // Back: the half is found (with the old time) and the side passes of
    // a quarter of the timeout go by; the rest comes well inside it.
    match b.recv(Deadline::after(idle / 4), None) {
        Err(Error::Timeout) => {}
        other => panic!("the half frame's wait is not a stall: {other:?}"),
    }
    a.with(|t| t.send_raw_frame(to_b, &frame[half..])).unwrap();
    let r = b.recv(Deadline::after(WAIT), None).unwrap();
    assert_eq!(host_bytes(&r.lease), &payload[..]);
}

/// A peer that writes half a frame into the ring and stops is dropped
/// once the idle timeout passes (as on every wire): polling its lane is
/// not hearing from it. (Every poll of the lane counted as hearing from
/// the peer, so the stall was never seen.)
#[cfg(feature = "testing")]
#[test]
fn a_frame_left_half_written_is_a_stall_past_the_idle_timeout() {
    let _g = serial();
    let idle = Duration::from_millis(800);
    for cut in [10, 1000] {
        // Part of the header, then part of the payload.
        let (a, b, to_b) = caller_driven_lane(idle);
        let frame = second_frame(&[7; 4000]);
        a.with(|t| t.send_raw_frame(to_b, &frame[..cut])).unwrap();
        let t0 = std::time::Instant::now();
        let e = loop {
            match b.recv(Deadline::after(idle / 4), None) {
                Err(Error::Timeout) => {
                    assert!(t0.elapsed() < 4 * idle, "cut at {cut}: never dropped")
                }
                Err(e) => break e,
                Ok(r) => panic!("half a frame delivered: {} bytes", r.lease.len()),
            }
        };
        assert!(
            matches!(
                e,
                Error::Protocol {
                    error: zerohop_core::session::ProtocolError::Stalled { .. },
                    ..
                }
            ),
            "cut at {cut}: {e:?}"
        );
        assert!(t0.elapsed() >= idle, "not before the timeout");
    }
}

/// A lane whose bytes wait unread while a progress thread leaves reading
/// to an application thread (the wire's side passes only,
/// `background_progress(false)`, as while the application only sends): once
/// the peer is due, the side pass reads its lane first and judges it on what
/// it read — here the rest of the frame, so the message arrives — not on
/// when this side last looked (it was dropped, `Stalled { Frame }`).
#[cfg(feature = "testing")]
#[test]
fn a_lane_whose_bytes_wait_unread_while_the_progress_thread_leaves_reading_is_read_first() {
    use zerohop_core::Transport;
    let _g = serial();
    let idle = Duration::from_millis(500);
    let (a, b, to_b) = caller_driven_lane(idle);
    let payload: Vec<u8> = (0..4000u32).map(|i| (i % 251) as u8).collect();
    let frame = second_frame(&payload);
    a.with(|t| t.send_raw_frame(to_b, &frame[..100])).unwrap();
    // The frame's start is read: its timer runs.
    let t0 = Instant::now();
    while t0.elapsed() < idle / 4 {
        b.with(|t| t.progress()).unwrap();
    }
    a.with(|t| t.send_raw_frame(to_b, &frame[100..])).unwrap();
    // Side passes only, every 20 ms, for three idle timeouts.
    let t0 = Instant::now();
    while t0.elapsed() < 3 * idle {
        b.with(|t| t.background_progress(false)).unwrap();
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = b.recv(Deadline::after(WAIT), None).unwrap();
    assert_eq!(host_bytes(&r.lease), &payload[..]);
}

/// A pause of the lane socket's accepts (as after a failed accept, out
/// of descriptors) holds while new connections come. Each raises an edge,
/// which cut the pause short: an accept per edge, each failing again while
/// descriptors are short. Here strangers' connections wait in the backlog
/// until the pause is over, then are taken (and their garbage costs them
/// their connection).
#[cfg(feature = "testing")]
#[test]
fn a_pause_of_lane_accepts_holds_while_new_connections_come() {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    const PAUSE: Duration = Duration::from_millis(600);
    let _one = serial();
    let (c, a) = endpoint_and_its_lane_socket();
    let paused = Instant::now();
    c.with(|t| t.pause_lane_accepts(PAUSE));
    let mut strangers = Vec::new();
    for _ in 0..10 {
        let mut s = UnixStream::connect_addr(&a).unwrap();
        s.write_all(&[0xEE; 64]).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        strangers.push(s);
        std::thread::sleep(PAUSE / 30);
    }
    // Each is taken, and dropped for its garbage, only after the pause.
    for (i, s) in strangers.iter_mut().enumerate() {
        let end = s.read(&mut [0u8; 1]);
        let after = paused.elapsed();
        assert!(
            matches!(end, Ok(0))
                || end.is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
            "stranger {i}: the listener hung up on its garbage"
        );
        assert!(
            after >= PAUSE,
            "stranger {i} taken {after:?} into a pause of {PAUSE:?}: a new edge cut it short"
        );
    }
}

/// A connect that times out (a listener that takes the connection and
/// never answers the Hello) leaves nothing behind once given up.
#[test]
fn a_connect_given_up_leaves_no_peer_behind() {
    let _g = serial();
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    let pool = private_pool(8 << 20).unwrap();
    let e = Endpoint::new(wire(&pool), EndpointConfig::default()).unwrap();
    let d = TcpTransport::dial(addr, WAIT, false).unwrap();
    let (_held, _) = silent.accept().unwrap();
    let p = e.with(|t| t.attach(d)).unwrap();
    assert_eq!(
        e.wait_open(p, Deadline::after(Duration::from_millis(300))),
        Err(Error::Timeout)
    );
    assert_eq!(e.with(|t| t.peers_left()), 1, "still there until given up");
    assert!(e.with(|t| t.disconnect(p)));
    assert_eq!(e.with(|t| t.peers_left()), 0);
    assert!(!e.with(|t| t.disconnect(p)), "once");
}

/// A connecting endpoint whose lane socket takes no connection until
/// resumed (`pause_lane_accepts(Duration::ZERO)`), and that socket's name
/// (call it once the listener's own lane socket exists).
#[cfg(feature = "testing")]
fn paused_connector() -> (Endpoint<LocalWire>, rustix::net::SocketAddrUnix) {
    let theirs = lane_sockets();
    let pool = private_pool(64 << 20).unwrap();
    let mut w = wire(&pool);
    w.pause_lane_accepts(WAIT);
    let c = Endpoint::new(w, EndpointConfig::default()).unwrap();
    let mine: Vec<String> = lane_sockets()
        .into_iter()
        .filter(|n| !theirs.contains(n))
        .collect();
    assert_eq!(mine.len(), 1, "the connector's lane socket: {mine:?}");
    let name = rustix::net::SocketAddrUnix::new_abstract_name(mine[0].as_bytes()).unwrap();
    (c, name)
}

/// Connects to the lane socket `name` until its backlog is full (a connect
/// refused at once): the strangers' sockets, which say nothing.
#[cfg(feature = "testing")]
fn fill_backlog(name: &rustix::net::SocketAddrUnix) -> Vec<std::os::fd::OwnedFd> {
    let mut strangers = Vec::new();
    loop {
        let s = rustix::net::socket_with(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            rustix::net::SocketFlags::NONBLOCK,
            None,
        )
        .unwrap();
        match rustix::net::connect(&s, name) {
            Ok(()) => strangers.push(s),
            Err(e) => {
                assert_eq!(e, rustix::io::Errno::AGAIN, "a full backlog");
                return strangers;
            }
        }
        assert!(strangers.len() <= 1024, "the backlog never filled");
    }
}

/// The offering side's lane socket full when the other side takes its
/// offer (its backlog flooded by strangers while it takes no connection:
/// abstract sockets have no permissions): the taker dials again until
/// there is room, and the peer still moves to shared memory.
#[cfg(feature = "testing")]
#[test]
fn a_lane_socket_full_for_a_while_is_dialled_again() {
    let _one = serial();
    let (server, addr, _pool) = listener();
    // Until the taker has found the socket full (resumed below).
    let (c, name) = paused_connector();
    // Strangers fill its backlog: a connect is refused at once.
    let strangers = fill_backlog(&name);
    let d = TcpTransport::dial(addr, WAIT, true).unwrap();
    let p = c.with(|t| t.attach(d)).unwrap();
    let (peer, from) = std::thread::scope(|s| {
        // The taker's application waits for the peer meanwhile (its own
        // thread moves the wire then, not the progress thread).
        let from = s.spawn(|| accepted(&server));
        // The lane socket takes connections again once the taker found it
        // full, and before it would decline (a quarter of a second).
        s.spawn(|| {
            let until = Instant::now() + WAIT;
            while server.with(|t| t.redialled()) == 0 {
                assert!(
                    Instant::now() < until,
                    "the taker never found the socket full"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            c.with(|t| t.pause_lane_accepts(Duration::ZERO));
        });
        (c.wait_open(p, Deadline::after(WAIT)), from.join().unwrap())
    });
    let peer = peer.expect("a lane once the socket had room");
    assert!(peer.0 & LANE_BIT != 0, "moved once there was room");
    exchange(&c, peer, &server, from);
    drop(strangers);
}

/// A flood on the lane socket behind an honest taker's connection does not
/// push it out: its setup, there when the connection is taken, is read
/// then. Before, connections were all taken first and their setups read
/// after, and past the 64 waiting the oldest went: the honest one, taken
/// first, went with its setup unread, and the connect failed at the setup
/// timeout (`PeerLost`).
#[cfg(feature = "testing")]
#[test]
fn a_flood_on_the_lane_socket_does_not_push_out_a_setup_that_came() {
    let _one = serial();
    let (server, addr, _pool) = listener();
    // Until the strangers are in the backlog (resumed below).
    let (c, name) = paused_connector();
    let d = TcpTransport::dial(addr, WAIT, true).unwrap();
    let p = c.with(|t| t.attach(d)).unwrap();
    let (peer, from, strangers) = std::thread::scope(|s| {
        let from = s.spawn(|| accepted(&server));
        // The taker dialled the lane socket and sent its setup: its lane is made.
        let until = Instant::now() + WAIT;
        while server.with(|t| t.lane_count()) == 0 {
            assert!(Instant::now() < until, "the taker never dialled");
            std::thread::sleep(Duration::from_millis(1));
        }
        // Strangers that say nothing fill the backlog behind it.
        let strangers = fill_backlog(&name);
        assert!(strangers.len() > 64, "more strangers than the links kept");
        c.with(|t| t.pause_lane_accepts(Duration::ZERO));
        let peer = c.wait_open(p, Deadline::after(WAIT));
        (peer, from.join().unwrap(), strangers)
    });
    let peer = peer.expect("the lane, its setup read as its connection was taken");
    assert!(peer.0 & LANE_BIT != 0, "moved to shared memory");
    exchange(&c, peer, &server, from);
    drop(strangers);
}

/// A caller that leaves mid ring frame (its deadline passed while the rest
/// waited in its slice): the rest goes to the queue — the one call in which
/// a lane's unsent bytes go from none to some (a frame written from the
/// caller's slice is not counted) — and goes out without the application
/// calling again. Debug builds check the wire's count of lanes with bytes
/// unsent at each send: a tally left out of `abandon_send` fails here.
#[test]
fn the_rest_of_a_ring_frame_its_caller_left_goes_without_the_application() {
    let _one = serial();
    let (server, addr, _pool) = listener();
    let (client, peer) = connect(addr);
    let _from = accepted(&server);
    const SMALL: usize = 24 << 10; // through the ring (1 MiB here)
    let m = vec![3u8; SMALL];
    let mut sent = 0;
    server.with(|_held| {
        // The server reads nothing meanwhile: the ring fills, one frame
        // is begun from the caller's slice, and its caller leaves.
        for _ in 0..((1 << 20) / SMALL + 2) {
            client
                .send(peer, &m, Deadline::after(Duration::from_millis(50)), None)
                .unwrap();
            sent += 1;
        }
    });
    assert!(
        client.pending_sends() > 0,
        "an abandoned frame's rest is queued"
    );
    let t0 = Instant::now();
    while client.pending_sends() > 0 && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(client.pending_sends(), 0, "the rest went, unasked");
    for _ in 0..sent {
        let r = server.recv(Deadline::after(WAIT), None).unwrap();
        assert!(host_bytes(&r.lease) == m);
    }
}

/// A lane dropped with bytes queued (its peer went) leaves the wire's count
/// of lanes with bytes unsent: else every send would ring the progress
/// thread for good (debug builds check the count at each send).
#[test]
fn a_lane_dropped_with_bytes_queued_leaves_the_count_of_lanes_with_bytes_unsent() {
    let _one = serial();
    let QueuedForX { x, y, a, to_y, .. } = queued_for_x();
    drop(x); // its lane hangs up: a's drops it, bytes queued and all
    let t0 = Instant::now();
    while a.pending_sends() > 0 && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(a.pending_sends(), 0, "x's lane went");
    // Each send asks whether work is left (debug: checked against every lane).
    a.send(to_y, b"ping", Deadline::after(WAIT), None).unwrap();
    let got = y.recv(Deadline::after(WAIT), None).unwrap();
    assert_eq!(host_bytes(&got.lease), b"ping");
}
