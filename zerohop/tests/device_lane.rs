//! GPU payloads between two processes on one GPU through the facade over
//! `shm`: a message leased in the sender's device memory
//! (`lease_device`) lands in the receiver's device memory by CUDA IPC
//! (device to device), in order with host messages, checksummed by a
//! kernel where it lands; the bandwidth is printed beside a local
//! device-to-device copy of the same size. Either process killed
//! mid-stream is reported lost and leaves no segment, descriptor or
//! mapping behind. Without a GPU (CI) the tests print SKIPPED.
#![cfg(feature = "cuda-uma")]

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use zerohop::{Config, Endpoint, Error, Event, Kind, MemKind};
use zerohop_backends::cuda::{cpu_checksum, Checksum, CopyQueue, DeviceMemory, Gpu};
use zerohop_core::RawMemory;
use zerohop_std::testing::Reaped;

const MIB: usize = 1 << 20;
const SIZES: [usize; 9] = [
    MIB,
    2 * MIB,
    4 * MIB,
    8 * MIB,
    16 * MIB,
    32 * MIB,
    64 * MIB,
    128 * MIB,
    256 * MIB,
];
const WAIT: Duration = Duration::from_secs(30);

fn gpu_or_skip(test: &str) -> Option<Gpu> {
    match Gpu::open(0).and_then(|g| g.memory_info().map(|m| (g, m))) {
        Ok((g, (free, _))) if free >= 40 << 30 => Some(g),
        Ok((_, (free, _))) => {
            eprintln!("SKIPPED {test}: {free} bytes of device memory free (40 GiB wanted)");
            None
        }
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            None
        }
    }
}

fn config() -> Config {
    let mut c = Config::only(Kind::Shm);
    c.max_message = Some(256 * MIB);
    // Each size class keeps its 256 MiB chunks, and a 256 MiB message takes
    // a chunk of its own: a budget that makes the pool give chunks back
    // makes every message pay a fresh allocation, export and peer mapping.
    c.pool_bytes = 16 << 30;
    // Both processes drive their wire in the calling thread, as `perf` does
    // (with ZEROHOP_DEVICE_LANE_THREAD set: a progress thread beside it).
    c.progress_thread = std::env::var_os("ZEROHOP_DEVICE_LANE_THREAD").is_some();
    c
}

/// The bytes of message `seed` of `len` bytes.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Messages of each size in the bandwidth run: about 4 GiB, 8 to 1024 of them.
fn count(size: usize) -> usize {
    ((4usize << 30) / size).clamp(8, 1024)
}

/// Starts this test binary's `child` test as the other process, told `addr`.
fn spawn(child: &str, addr: std::net::SocketAddr) -> Reaped {
    Reaped(
        Command::new(std::env::current_exe().unwrap())
            .args([child, "--exact", "--ignored", "--nocapture"])
            .env("ZEROHOP_DEVICE_LANE_PEER", addr.to_string())
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

fn peer_addr() -> Option<std::net::SocketAddr> {
    std::env::var("ZEROHOP_DEVICE_LANE_PEER")
        .ok()
        .map(|a| a.parse().unwrap())
}

/// What of this process a lane holds: segment mappings and descriptors.
fn held() -> (usize, usize) {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let segments = maps
        .lines()
        .filter(|l| l.contains("memfd:zerohop-lane"))
        .count();
    let fds = std::fs::read_dir("/proc/self/fd").unwrap().count();
    (segments, fds)
}

fn next_message(e: &Endpoint) -> zerohop::Message {
    match e.recv(WAIT) {
        Ok(m) => m,
        Err(err) => panic!("no message: {err}"),
    }
}

/// The sending process: for each size a host message (its checksum), a
/// device message (checked where it lands), then the bandwidth run.
#[test]
#[ignore = "the sending process of device_messages_cross_by_ipc_and_land_checksummed"]
fn device_sender() {
    let Some(addr) = peer_addr() else { return };
    let e = Endpoint::open(config()).unwrap();
    let peer = e.connect(addr, WAIT).unwrap();
    for (i, &size) in SIZES.iter().enumerate() {
        let bytes = pattern(i as u64 + 1, size);
        let mut head = [0u8; 16];
        head[..8].copy_from_slice(&cpu_checksum(&bytes).to_le_bytes());
        head[8..].copy_from_slice(&(size as u64).to_le_bytes());
        e.send(peer, &head).unwrap();
        let mut buf = e.lease_device(size).unwrap();
        assert_eq!(buf.bytes_mut(), None, "device memory is not host bytes");
        e.copy_in(&mut buf, &bytes).unwrap();
        e.send_buffer(peer, buf).unwrap();
        // A first batch the receiver does not time (the pools grow, the
        // receiver maps the chunks), then the timed one.
        let mut slowest = (Duration::ZERO, 0);
        for i in 0..2 * count(size) {
            let t = Instant::now();
            let buf = e.lease_device(size).unwrap();
            e.send_buffer(peer, buf).unwrap();
            slowest = slowest.max((t.elapsed(), i));
        }
        eprintln!(
            "sender, {} MiB: the slowest send took {:?} (message {} of {})",
            size / MIB,
            slowest.0,
            slowest.1,
            2 * count(size)
        );
    }
    e.close(WAIT).unwrap();
}

#[test]
fn device_messages_cross_by_ipc_and_land_checksummed() {
    let Some(gpu) = gpu_or_skip("device_messages_cross_by_ipc_and_land_checksummed") else {
        return;
    };
    let e = Endpoint::open(config()).unwrap();
    let addr = e.listen("127.0.0.1:0").unwrap();
    let mut child = spawn("device_sender", addr);
    let sum = Checksum::load(&gpu).unwrap();
    let local = DeviceMemory::new(&gpu);
    let mut queue = CopyQueue::new(&gpu).unwrap();
    eprintln!("size      messages  IPC GB/s  local copies back to back GB/s: same buffers, rotating  ratio");
    for &size in &SIZES {
        let head = loop {
            match e.next_event(WAIT).unwrap() {
                Event::Message(m) => break m,
                Event::Connected { .. } => {}
                other => panic!("{other:?}"),
            }
        };
        let head = head.bytes().expect("a host message").to_vec();
        let want = u64::from_le_bytes(head[..8].try_into().unwrap());
        assert_eq!(
            u64::from_le_bytes(head[8..].try_into().unwrap()),
            size as u64
        );
        let m = next_message(&e);
        assert_eq!(
            (m.len(), m.memory(), m.bytes()),
            (size, MemKind::Device, None)
        );
        let ptr = m
            .device_ptr()
            .expect("a device message has a device address");
        // SAFETY: the message's device memory is ours and held by `m` until
        // the kernel's answer is back.
        let got = unsafe { sum.run(ptr, size) }.unwrap();
        assert_eq!(got, want, "{size} bytes checksummed where they landed");
        let mut first = [0u8; 64];
        e.copy_out(&m, &mut first).unwrap();
        drop(m);
        // Bandwidth, past a first batch: from the first message's arrival
        // to the last's.
        let n = count(size);
        for _ in 0..n {
            drop(next_message(&e));
        }
        let mut arrivals = Vec::with_capacity(n);
        for _ in 0..n {
            let m = next_message(&e);
            assert_eq!((m.len(), m.memory()), (size, MemKind::Device));
            arrivals.push(Instant::now());
        }
        let ipc =
            size as f64 * (n - 1) as f64 / (arrivals[n - 1] - arrivals[0]).as_secs_f64() / 1e9;
        // Gaps between arrivals: steady, or stalls?
        let mut gaps: Vec<(Duration, usize)> = arrivals
            .windows(2)
            .enumerate()
            .map(|(i, w)| (w[1] - w[0], i + 1))
            .collect();
        gaps.sort_unstable();
        let (gap_p50, (gap_max, at)) = (gaps[gaps.len() / 2].0, gaps[gaps.len() - 1]);
        // Local device-to-device copies of the same size, queued back to
        // back on a stream (the copy engine's rate): between the same two
        // buffers (at 16 MiB both stay in the GPU's 50 MB L2), and between
        // buffers that rotate through as much memory as the lane keeps in
        // flight (512 MiB), as the lane's copies do. The ratio is to the
        // faster of the two.
        let ring = (512 * MIB / size).clamp(1, 32);
        let src: Vec<_> = (0..ring)
            .map(|_| local.alloc(size, 4096).unwrap())
            .collect();
        let dst: Vec<_> = (0..ring)
            .map(|_| local.alloc(size, 4096).unwrap())
            .collect();
        let mut rates = [0.0; 2];
        for (rotating, rate) in [false, true].into_iter().zip(&mut rates) {
            let t = Instant::now();
            for i in 0..n {
                let k = if rotating { i % ring } else { 0 };
                // SAFETY: live allocations of ours, freed only after
                // `finish` below has waited for every copy.
                unsafe { queue.copy(&local, dst[k], src[k].addr, size) }.unwrap();
            }
            queue.finish(|_| {}).unwrap();
            *rate = size as f64 * n as f64 / t.elapsed().as_secs_f64() / 1e9;
        }
        for r in src.into_iter().chain(dst) {
            local.free(r).unwrap();
        }
        let copy = rates[0].max(rates[1]);
        eprintln!(
            "{:>4} MiB  {n:>8}  {ipc:>8.1}  {:>10.1} {:>10.1}  {:.2}x ({:.2}x the rotating copies)  gaps p50 {gap_p50:?} max {gap_max:?} (before message {at})",
            size / MIB,
            rates[0],
            rates[1],
            ipc / copy,
            ipc / rates[1],
        );
    }
    match e.next_event(WAIT).unwrap() {
        Event::Closed { .. } => {}
        other => panic!("expected the sender's clean close, got {other:?}"),
    }
    assert!(child.wait().unwrap().success(), "the sender failed");
}

/// A process that sends device messages (or receives them) until killed.
#[test]
#[ignore = "the process the device kill tests kill"]
fn device_victim() {
    let Some(addr) = peer_addr() else { return };
    let e = Endpoint::open(config()).unwrap();
    // Before the connect: the parent drives its endpoint (accepts) only
    // once it has read this.
    eprintln!("ready");
    let peer = e.connect(addr, WAIT).unwrap();
    loop {
        match std::env::var("ZEROHOP_DEVICE_LANE_ROLE").as_deref() {
            Ok("send") => {
                let buf = e.lease_device(8 * MIB).unwrap();
                let _ = e.send_buffer(peer, buf);
            }
            _ => {
                let _ = e.recv(WAIT);
            }
        }
    }
}

/// Kills the victim once `moving` says the stream runs, then waits for the
/// endpoint to report it lost; how long that took.
fn kill_mid_stream(role: &str, moving: impl Fn(&Endpoint, zerohop::Peer) -> bool) -> Duration {
    let e = Endpoint::open(config()).unwrap();
    let addr = e.listen("127.0.0.1:0").unwrap();
    let before = held();
    let mut child = Reaped(
        Command::new(std::env::current_exe().unwrap())
            .args(["device_victim", "--exact", "--ignored", "--nocapture"])
            .env("ZEROHOP_DEVICE_LANE_PEER", addr.to_string())
            .env("ZEROHOP_DEVICE_LANE_ROLE", role)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let ready = std::io::BufReader::new(child.stderr.take().unwrap())
        .lines()
        .any(|l| l.is_ok_and(|l| l == "ready"));
    assert!(ready, "the victim did not start");
    let peer = loop {
        if let Event::Connected { peer, .. } = e.next_event(WAIT).unwrap() {
            break peer;
        }
    };
    let t = Instant::now();
    while !moving(&e, peer) {
        assert!(t.elapsed() < WAIT, "the stream never ran");
    }
    child.kill().unwrap(); // SIGKILL, device messages in flight
    let killed = Instant::now();
    let seen = loop {
        match e.next_event(Duration::from_millis(10)) {
            Ok(Event::Lost { .. }) => break killed.elapsed(),
            Ok(_) => {}
            Err(Error::Endpoint(zerohop_core::Error::Timeout)) => {
                if role == "recv" {
                    // A sender learns through its sends.
                    if let Ok(buf) = e.lease_device(8 * MIB) {
                        let _ = e.send_buffer(peer, buf);
                    }
                }
            }
            Err(err) => panic!("{err}"),
        }
        assert!(
            killed.elapsed() < WAIT,
            "the killed peer was never reported"
        );
    };
    let _ = child.wait();
    // Nothing of the lane left: its segment unmapped, its descriptors closed,
    // and every device buffer back (a lease of the whole budget's worth goes).
    let t = Instant::now();
    while held() != before && t.elapsed() < Duration::from_secs(5) {
        let _ = e.next_event(Duration::from_millis(10));
    }
    assert_eq!(held(), before, "segments and descriptors after the kill");
    // Every device buffer came back (sends in flight, copies under way).
    let t = Instant::now();
    while e.device_bytes_leased() != Some(0) && t.elapsed() < Duration::from_secs(5) {
        let _ = e.next_event(Duration::from_millis(10));
    }
    assert_eq!(
        e.device_bytes_leased(),
        Some(0),
        "device buffers held after the kill"
    );
    e.close(Duration::from_secs(1)).ok();
    seen
}

#[test]
fn a_device_sender_killed_mid_stream_is_lost_and_leaves_nothing() {
    if gpu_or_skip("a_device_sender_killed_mid_stream_is_lost_and_leaves_nothing").is_none() {
        return;
    }
    let got = std::cell::Cell::new(0);
    let seen = kill_mid_stream("send", |e, _| {
        if let Ok(Event::Message(m)) = e.next_event(Duration::from_millis(100)) {
            assert_eq!(m.memory(), MemKind::Device);
            got.set(got.get() + 1);
        }
        got.get() >= 20
    });
    eprintln!("a device sender killed mid-stream was reported lost {seen:?} after SIGKILL");
    assert!(seen < Duration::from_millis(100), "{seen:?}");
}

#[test]
fn a_device_receiver_killed_mid_stream_is_lost_and_leaves_nothing() {
    if gpu_or_skip("a_device_receiver_killed_mid_stream_is_lost_and_leaves_nothing").is_none() {
        return;
    }
    let sent = std::cell::Cell::new(0);
    let seen = kill_mid_stream("recv", |e, peer| {
        let buf = e.lease_device(8 * MIB).unwrap();
        if e.send_buffer(peer, buf).is_ok() {
            sent.set(sent.get() + 1);
        }
        sent.get() >= 100
    });
    eprintln!("a device receiver killed mid-stream was reported lost {seen:?} after SIGKILL");
    assert!(seen < Duration::from_millis(100), "{seen:?}");
}
