//! The floor for `zerohop perf --transport tcp`: the same ping-pong and stream,
//! written the obvious way with std sockets (TCP_NODELAY, one thread per side,
//! 127.0.0.1), printing the same JSON rows. Blocking calls by default; with
//! `spin`, non-blocking sockets retried in a busy loop, the way zerohop's
//! receiver (for `--spin-us`), UCX and perftest wait: the floor for latency
//! without the cost of waking a sleeping thread.
//!
//! Both sides in one process (two threads) by default; as two processes, the
//! way `zerohop perf --listen/--connect` and `ucx_perftest` run, with
//! `listen ADDR` in one and `connect ADDR` in the other.
//!
//! With `epoll`, each socket is also watched by an epoll set that is never
//! waited on (see [`watch`]); with `epoll2`, by two (reading in one, writing
//! in the other, as zerohop's data and connection sets watch it). With
//! `record`, each message goes behind a 32-byte record, written with the
//! payload in one `writev` and read with it in one buffer, as zerohop's short
//! record; with `stage`, reads fill a 64 KiB stage up to 4 KiB at a time and
//! the message is copied out of it, as zerohop's receiver reads. These take the
//! program step by step towards zerohop's system calls (`docs/runs/raw-shape/`).
//!
//! `cargo run --release -p zerohop-std --example raw_tcp -- 64,4096,65536,1048576 [spin] [epoll|epoll2] [record] [stage] [listen|connect ADDR]`

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

/// A socket that either blocks or spins on `WouldBlock`.
struct Stream {
    s: TcpStream,
    /// With `record` or `stage`: bytes read and not yet taken.
    stage: Vec<u8>,
    start: usize,
    end: usize,
}

/// With `stage`: the stage's size, and how far one read into it goes.
const STAGE: usize = 64 << 10;
const STAGE_READ: usize = 4 << 10;
/// With `record`: the bytes ahead of each message.
const RECORD: usize = 32;

fn flag(f: &std::sync::atomic::AtomicBool) -> bool {
    f.load(std::sync::atomic::Ordering::Relaxed)
}

impl Stream {
    fn new(s: TcpStream, spin: bool) -> io::Result<Self> {
        s.set_nodelay(true)?;
        s.set_nonblocking(spin)?;
        if flag(&EPOLL) {
            watch(&s, libc::EPOLLIN)?;
        }
        if flag(&EPOLL2) {
            watch(&s, libc::EPOLLIN)?;
            watch(&s, libc::EPOLLOUT)?;
        }
        Ok(Stream {
            s,
            stage: vec![0; STAGE],
            start: 0,
            end: 0,
        })
    }

    /// One message: with `record`, behind its record in one `writev`.
    fn send_msg(&mut self, buf: &[u8]) -> io::Result<()> {
        if !flag(&SHAPE_RECORD) {
            return self.write_all(buf);
        }
        let mut rec = [0u8; RECORD];
        rec[..2].copy_from_slice(b"SZ");
        rec[8..12].copy_from_slice(&(buf.len() as u32).to_le_bytes());
        let mut sent = 0;
        while sent < RECORD + buf.len() {
            let iov = if sent < RECORD {
                [io::IoSlice::new(&rec[sent..]), io::IoSlice::new(buf)]
            } else {
                [
                    io::IoSlice::new(&[]),
                    io::IoSlice::new(&buf[sent - RECORD..]),
                ]
            };
            match self.s.write_vectored(&iov) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::hint::spin_loop(),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// One message into `buf`: with `record`, its record read and skipped;
    /// with `stage`, through the stage.
    fn recv_msg(&mut self, buf: &mut [u8]) -> io::Result<()> {
        let record = flag(&SHAPE_RECORD);
        if !flag(&SHAPE_STAGE) {
            if !record {
                return self.read_exact(buf);
            }
            let want = RECORD + buf.len();
            if self.stage.len() < want {
                self.stage.resize(want, 0);
            }
            let mut scratch = std::mem::take(&mut self.stage);
            let r = self.read_exact(&mut scratch[..want]);
            buf.copy_from_slice(&scratch[RECORD..want]);
            self.stage = scratch;
            return r;
        }
        let mut skip = if record { RECORD } else { 0 };
        let mut have = 0;
        while have < buf.len() {
            if self.start == self.end {
                self.start = 0;
                self.end = 0;
                let room = (buf.len() - have + skip).clamp(STAGE_READ, STAGE);
                let mut stage = std::mem::take(&mut self.stage);
                let r = self.read(&mut stage[..room]);
                self.stage = stage;
                match r? {
                    0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                    n => self.end = n,
                }
            }
            let take = skip.min(self.end - self.start);
            self.start += take;
            skip -= take;
            let n = (buf.len() - have).min(self.end - self.start);
            buf[have..have + n].copy_from_slice(&self.stage[self.start..self.start + n]);
            have += n;
            self.start += n;
        }
        Ok(())
    }
}

/// With `epoll`: each socket is also in an epoll set (edge-triggered, as
/// zerohop's and UCX's are) that is never waited on: what the kernel's
/// receive path costs a socket any multi-socket program watches.
static EPOLL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static EPOLL2: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static SHAPE_RECORD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static SHAPE_STAGE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn watch(s: &TcpStream, what: libc::c_int) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: plain system calls on a live descriptor; the epoll
    // descriptor is kept open for the process's life on purpose.
    unsafe {
        let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
        if ep < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut ev = libc::epoll_event {
            events: (what | libc::EPOLLET) as u32,
            u64: 0,
        };
        if libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, s.as_raw_fd(), &mut ev) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.s.read(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::hint::spin_loop(),
                r => return r,
            }
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        loop {
            match self.s.write(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::hint::spin_loop(),
                r => return r,
            }
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Echoes ping-pongs and counts streams until the client says it is done.
fn serve(s: TcpStream, spin: bool) -> io::Result<()> {
    let mut s = Stream::new(s, spin)?;
    let mut ctl = [0u8; 16];
    loop {
        if s.read_exact(&mut ctl).is_err() {
            return Ok(());
        }
        let size = u64::from_le_bytes(ctl[..8].try_into().unwrap()) as usize;
        let count = u64::from_le_bytes(ctl[8..].try_into().unwrap()) as usize;
        let mut buf = vec![0u8; size];
        if size == 0 {
            return Ok(());
        }
        if count & (1 << 62) != 0 {
            for _ in 0..count & !(1 << 62) {
                s.recv_msg(&mut buf)?;
                s.send_msg(&buf)?;
            }
        } else {
            for _ in 0..count {
                s.read_exact(&mut buf)?;
            }
            s.write_all(&((count * size) as u64).to_le_bytes())?;
        }
    }
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let sizes: Vec<usize> = args
        .first()
        .map_or("64,4096,65536,1048576", String::as_str)
        .split(',')
        .map(|s| s.parse().expect("a size in bytes"))
        .collect();
    let spin = args.iter().any(|a| a == "spin");
    for (name, f) in [
        ("epoll", &EPOLL),
        ("epoll2", &EPOLL2),
        ("record", &SHAPE_RECORD),
        ("stage", &SHAPE_STAGE),
    ] {
        f.store(
            args.iter().any(|a| a == name),
            std::sync::atomic::Ordering::Relaxed,
        );
    }
    let role = |name: &str| {
        let i = args.iter().position(|a| a == name)?;
        Some(
            args.get(i + 1)
                .expect("an address after listen/connect")
                .clone(),
        )
    };
    if let Some(addr) = role("listen") {
        let listener = TcpListener::bind(addr)?;
        let (s, _) = listener.accept()?;
        return serve(s, spin);
    }
    let (c, server) = match role("connect") {
        Some(addr) => (TcpStream::connect(addr)?, None),
        None => {
            let listener = TcpListener::bind("127.0.0.1:0")?;
            let addr = listener.local_addr()?;
            let server = std::thread::spawn(move || serve(listener.accept()?.0, spin));
            (TcpStream::connect(addr)?, Some(server))
        }
    };
    let mut c = Stream::new(c, spin)?;
    let mut rows = Vec::new();
    for &size in &sizes {
        let iters = 5000usize.min((256 << 20) / size).max(100) + 100;
        let mut buf = vec![0xA5u8; size];
        let ctl = |n: usize| [(size as u64).to_le_bytes(), (n as u64).to_le_bytes()].concat();
        c.write_all(&ctl(iters | (1 << 62)))?;
        let mut rtts = Vec::with_capacity(iters);
        for i in 0..iters {
            let t0 = Instant::now();
            c.send_msg(&buf)?;
            c.recv_msg(&mut buf)?;
            if i >= 100 {
                rtts.push(t0.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
        }
        rtts.sort_by(f64::total_cmp);
        let count = ((1usize << 30) / size).clamp(1000, 200_000);
        c.write_all(&ctl(count))?;
        let t0 = Instant::now();
        for _ in 0..count {
            c.write_all(&buf)?;
        }
        let mut ack = [0u8; 8];
        c.read_exact(&mut ack)?;
        let secs = t0.elapsed().as_secs_f64();
        assert_eq!(u64::from_le_bytes(ack), (count * size) as u64);
        let p = |q: f64| rtts[((rtts.len() - 1) as f64 * q).round() as usize];
        rows.push(format!(
            "{{\"size\":{size},\"lat_p50_us\":{:.3},\"lat_p99_us\":{:.3},\"lat_p999_us\":{:.3},\"bw_gb_per_s\":{:.4},\"msg_per_s\":{:.0}}}",
            p(0.5),
            p(0.99),
            p(0.999),
            (count * size) as f64 / secs / 1e9,
            count as f64 / secs
        ));
    }
    c.write_all(&[0u8; 16])?;
    drop(c);
    if let Some(server) = server {
        server.join().expect("server thread")?;
    }
    println!(
        "{{\"transport\":\"raw-tcp{}\",\"rows\":[{}]}}",
        if spin { "-spin" } else { "" },
        rows.join(",")
    );
    Ok(())
}
