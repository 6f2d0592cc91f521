//! The floor for `zerohop perf --transport tcp`: the same ping-pong and stream,
//! written the obvious way with blocking std sockets (TCP_NODELAY, one thread
//! per side, 127.0.0.1), printing the same JSON rows.
//!
//! `cargo run --release -p zerohop-std --example raw_tcp -- 64,4096,65536,1048576`

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

fn main() -> std::io::Result<()> {
    let sizes: Vec<usize> = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "64,4096,65536,1048576".into())
        .split(',')
        .map(|s| s.parse().expect("a size in bytes"))
        .collect();
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
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
                    s.read_exact(&mut buf)?;
                    s.write_all(&buf)?;
                }
            } else {
                for _ in 0..count {
                    s.read_exact(&mut buf)?;
                }
                s.write_all(&((count * size) as u64).to_le_bytes())?;
            }
        }
    });
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    let mut rows = Vec::new();
    for &size in &sizes {
        let iters = 5000usize.min((256 << 20) / size).max(100) + 100;
        let mut buf = vec![0xA5u8; size];
        let ctl = |n: usize| [(size as u64).to_le_bytes(), (n as u64).to_le_bytes()].concat();
        c.write_all(&ctl(iters | (1 << 62)))?;
        let mut rtts = Vec::with_capacity(iters);
        for i in 0..iters {
            let t0 = Instant::now();
            c.write_all(&buf)?;
            c.read_exact(&mut buf)?;
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
    server.join().expect("server thread")?;
    println!(
        "{{\"transport\":\"raw-tcp\",\"rows\":[{}]}}",
        rows.join(",")
    );
    Ok(())
}
