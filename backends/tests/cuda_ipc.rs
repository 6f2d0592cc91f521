//! Two processes on one GPU: messages in the sender's device memory land in
//! the receiver's device memory by CUDA IPC (each allocation exported and
//! opened once, copied device to device), checksummed by a kernel where
//! they land; a forged handle and a range past the allocation are typed
//! errors and the receiver goes on; the receiver's cache stays bounded; a
//! receiver killed mid-stream is seen at once and leaves nothing held.
//! Prints the bandwidth beside a local device-to-device copy of each size.
//! Without a GPU (CI) the tests print SKIPPED.
#![cfg(feature = "cuda-uma")]

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use zerohop_backends::cuda::{
    cpu_checksum, Checksum, DeviceMemory, Gpu, IpcCache, IpcError, IpcHandle, IpcRegion,
};
use zerohop_core::{RawMemory, Region};

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
const CACHE: usize = 4;
/// Messages in flight from the sender (it waits for a done beyond that).
const WINDOW: usize = 4;

fn gpu_or_skip(test: &str) -> Option<Gpu> {
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            return None;
        }
    };
    match gpu.memory_info() {
        Ok((free, _)) if free >= 4 << 30 => Some(gpu),
        Ok((free, _)) => {
            eprintln!("SKIPPED {test}: {free} bytes of device memory free (4 GiB wanted)");
            None
        }
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            None
        }
    }
}

// The link between the two processes (a Unix stream), in both directions.
const COPY: u8 = b'M';
const CHECK: u8 = b'C';
const STATS: u8 = b'S';
const FORGET: u8 = b'F';
const QUIT: u8 = b'Q';
const OK: u8 = 0;
const OUT_OF_RANGE: u8 = 1;
const CUDA: u8 = 2;

fn put_region(s: &mut UnixStream, tag: u8, r: &IpcRegion) {
    let mut m = vec![tag];
    m.extend_from_slice(&r.handle.0);
    m.extend_from_slice(&r.offset.to_le_bytes());
    m.extend_from_slice(&(r.len as u64).to_le_bytes());
    s.write_all(&m).unwrap();
}

fn get_u64(s: &mut UnixStream) -> u64 {
    let mut b = [0u8; 8];
    s.read_exact(&mut b).unwrap();
    u64::from_le_bytes(b)
}

fn get_u8(s: &mut UnixStream) -> u8 {
    let mut b = [0u8; 1];
    s.read_exact(&mut b).unwrap();
    b[0]
}

/// The receiving process: maps what it is named, copies it into its own
/// device memory, answers.
#[test]
#[ignore = "the receiving process of the CUDA IPC tests"]
fn receiver_process() {
    let Ok(path) = std::env::var("ZEROHOP_IPC_SOCKET") else {
        return;
    };
    let mut s = UnixStream::connect(path).unwrap();
    let gpu = Gpu::open(0).unwrap();
    let mem = DeviceMemory::new(&gpu);
    let dst = mem.alloc(*SIZES.last().unwrap(), 2 * MIB).unwrap();
    let mut cache = IpcCache::new(&gpu, CACHE);
    let sum = Checksum::load(&gpu).unwrap();
    const PEER: u64 = 1;
    loop {
        let mut tag = [0u8; 1];
        if s.read_exact(&mut tag).is_err() {
            return; // the sender went
        }
        match tag[0] {
            COPY | CHECK => {
                let mut b = [0u8; 80];
                s.read_exact(&mut b).unwrap();
                let r = IpcRegion {
                    handle: IpcHandle(b[..64].try_into().unwrap()),
                    offset: u64::from_le_bytes(b[64..72].try_into().unwrap()),
                    len: u64::from_le_bytes(b[72..80].try_into().unwrap()) as usize,
                };
                let status = match cache.resolve(PEER, &r) {
                    Err(IpcError::OutOfRange { .. }) => OUT_OF_RANGE,
                    Err(IpcError::Cuda(_)) => CUDA,
                    Ok(src) if r.len <= dst.len => {
                        // SAFETY: `src` is a range the cache checked against
                        // its open mapping, which stays open during the copy.
                        unsafe { mem.copy_from_peer(dst, src, r.len) }.unwrap();
                        OK
                    }
                    Ok(_) => OUT_OF_RANGE,
                };
                let mut out = vec![status];
                if tag[0] == CHECK {
                    let c = match status {
                        // SAFETY: `dst` is our live device allocation, and
                        // nothing writes it until the kernel is done.
                        OK => unsafe { sum.run(dst.addr, r.len) }.unwrap(),
                        _ => 0,
                    };
                    out.extend_from_slice(&c.to_le_bytes());
                }
                s.write_all(&out).unwrap();
            }
            STATS => {
                let (opened, evicted) = cache.counts();
                let mut out = Vec::new();
                for v in [opened, evicted, cache.open_count() as u64] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
                s.write_all(&out).unwrap();
            }
            FORGET => {
                let n = cache.forget_peer(PEER) as u64;
                s.write_all(&n.to_le_bytes()).unwrap();
            }
            _ => return,
        }
    }
}

fn spawn_receiver(tag: &str) -> (Child, UnixStream) {
    let path = std::env::temp_dir().join(format!("zerohop-ipc-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "receiver_process", "--ignored", "--nocapture"])
        .env("ZEROHOP_IPC_SOCKET", &path)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let (s, _) = listener.accept().unwrap();
    let _ = std::fs::remove_file(&path);
    (child, s)
}

/// Bytes with a pattern that differs per position and per size.
fn pattern(len: usize, seed: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13 ^ seed) as u8)
        .collect()
}

/// Messages of `len` bytes for about 32 GiB (4096 at most).
fn count(len: usize) -> usize {
    ((32usize << 30) / len).clamp(16, 4096)
}

#[test]
fn device_memory_crosses_processes_checked_where_it_lands() {
    let Some(gpu) = gpu_or_skip("device_memory_crosses_processes_checked_where_it_lands") else {
        return;
    };
    let mem = DeviceMemory::new(&gpu);
    let (mut child, mut s) = spawn_receiver("cross");
    let local = mem.alloc(*SIZES.last().unwrap(), 2 * MIB).unwrap();
    let mut chunks: Vec<Region> = Vec::new();
    eprintln!(
        "{:>9} | {:>12} {:>12} {:>6} | {:>9}",
        "size", "IPC GB/s", "local GB/s", "ratio", "msgs"
    );
    for (k, &len) in SIZES.iter().enumerate() {
        // A fresh allocation per size: the receiver's cache sees nine.
        let src = mem.alloc(len, 2 * MIB).unwrap();
        let bytes = pattern(len, k);
        mem.copy_from_host(src, &bytes).unwrap();
        let r = mem.export(src).unwrap();
        assert_eq!(r.offset, 0);
        assert_eq!(mem.export(src).unwrap(), r, "one handle per allocation");
        // Intact where it lands: the receiver's kernel checksums its copy.
        put_region(&mut s, CHECK, &r);
        assert_eq!(get_u8(&mut s), OK, "{len} B");
        assert_eq!(get_u64(&mut s), cpu_checksum(&bytes), "{len} B intact");
        // A message that is a slice of the allocation: offset honoured.
        let (at, n) = (len / 2 + 3, len / 4);
        let part = IpcRegion {
            offset: at as u64,
            len: n,
            ..r
        };
        put_region(&mut s, CHECK, &part);
        assert_eq!(get_u8(&mut s), OK);
        assert_eq!(
            get_u64(&mut s),
            cpu_checksum(&bytes[at..at + n]),
            "a slice of {len} B at {at}"
        );
        // Bandwidth: messages with a window in flight, each done when the
        // receiver's copy has finished.
        let n = count(len);
        let t0 = Instant::now();
        let mut done = 0;
        for i in 0..n {
            if i >= WINDOW {
                assert_eq!(get_u8(&mut s), OK);
                done += 1;
            }
            put_region(&mut s, COPY, &r);
        }
        while done < n {
            assert_eq!(get_u8(&mut s), OK);
            done += 1;
        }
        let ipc = (n * len) as f64 / t0.elapsed().as_secs_f64() / 1e9;
        // The same bytes copied device to device inside this process.
        let t0 = Instant::now();
        for _ in 0..n {
            mem.copy_from_device(local, &mem, src, len).unwrap();
        }
        gpu.synchronize().unwrap();
        let here = (n * len) as f64 / t0.elapsed().as_secs_f64() / 1e9;
        eprintln!(
            "{:>6} MiB | {ipc:>12.1} {here:>12.1} {:>5.2}x | {n:>9}",
            len / MIB,
            ipc / here
        );
        if len >= 16 * MIB {
            assert!(
                ipc >= 0.8 * here,
                "{len} B: {ipc:.1} GB/s by IPC, {here:.1} GB/s locally"
            );
        }
        if len == MIB {
            assert!(ipc >= 50.0, "1 MiB: {ipc:.1} GB/s by IPC");
        }
        chunks.push(src);
    }
    // A peer is untrusted: a range past the allocation and a forged handle
    // are typed errors, and the receiver goes on.
    let last = mem.export(*chunks.last().unwrap()).unwrap();
    let past = IpcRegion {
        offset: (256 * MIB - 100) as u64,
        len: 200,
        ..last
    };
    put_region(&mut s, COPY, &past);
    assert_eq!(get_u8(&mut s), OUT_OF_RANGE);
    let wrapping = IpcRegion {
        offset: u64::MAX - 8,
        len: 64,
        ..last
    };
    put_region(&mut s, COPY, &wrapping);
    assert_eq!(get_u8(&mut s), OUT_OF_RANGE);
    let forged = IpcRegion {
        handle: IpcHandle([0x5A; 64]),
        offset: 0,
        len: 64,
    };
    put_region(&mut s, COPY, &forged);
    assert_eq!(get_u8(&mut s), CUDA);
    put_region(&mut s, COPY, &last);
    assert_eq!(get_u8(&mut s), OK, "the receiver still serves");
    // The cache: each allocation opened once, at most CACHE open.
    s.write_all(&[STATS]).unwrap();
    let (opened, evicted, open) = (get_u64(&mut s), get_u64(&mut s), get_u64(&mut s));
    assert_eq!(opened, SIZES.len() as u64, "each allocation opened once");
    assert_eq!(evicted, opened - CACHE as u64);
    assert_eq!(open, CACHE as u64);
    s.write_all(&[FORGET]).unwrap();
    assert_eq!(
        get_u64(&mut s),
        CACHE as u64,
        "a peer's mappings close with it"
    );
    s.write_all(&[STATS]).unwrap();
    let _ = (get_u64(&mut s), get_u64(&mut s));
    assert_eq!(get_u64(&mut s), 0);
    s.write_all(&[QUIT]).unwrap();
    assert!(child.wait().unwrap().success());
    for c in chunks {
        mem.free(c).unwrap();
    }
    mem.free(local).unwrap();
}

#[test]
fn a_receiver_killed_mid_stream_is_seen_at_once_and_holds_nothing() {
    let Some(gpu) = gpu_or_skip("a_receiver_killed_mid_stream_is_seen_at_once_and_holds_nothing")
    else {
        return;
    };
    let before = gpu.memory_info().unwrap().0;
    let mem = DeviceMemory::new(&gpu);
    let src = mem.alloc(64 * MIB, 2 * MIB).unwrap();
    mem.copy_from_host(src, &pattern(64 * MIB, 9)).unwrap();
    let r = mem.export(src).unwrap();
    let (mut child, mut s) = spawn_receiver("kill");
    for _ in 0..WINDOW {
        put_region(&mut s, COPY, &r);
    }
    for _ in 0..200 {
        assert_eq!(get_u8(&mut s), OK);
        put_region(&mut s, COPY, &r);
    }
    child.kill().unwrap(); // SIGKILL, copies under way
    let killed = Instant::now();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest); // what it answered before it died, then EOF
    let took = killed.elapsed();
    child.wait().unwrap();
    eprintln!("a killed receiver was seen {took:?} after SIGKILL");
    assert!(took < Duration::from_millis(100), "seen after {took:?}");
    // The sender's memory is its own again: freed, and the receiver's
    // context (its mappings and its memory) gone with the process.
    mem.free(src).unwrap();
    let t0 = Instant::now();
    loop {
        let free = gpu.memory_info().unwrap().0;
        if free + (16 << 20) >= before {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "device memory free {free}, {before} before the receiver"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
