//! MR cache hit lookup and pool lease+release, each beside the obvious baseline
//! (the Go transport's design): a `Mutex<BTreeMap>` registration cache and a
//! `Mutex<Vec>` free list per size class. Both sides sit behind a lock, as they
//! would when shared between a progress thread and the application.
//!
//! And the frame checksum's throughput: `crc`'s table without the `std`
//! feature, `crc32c`'s (the CPU's CRC instruction) with it.
//!
//! `cargo bench -p zerohop-core --bench core [--features std]`

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use zerohop_core::pool::{Chunks, InlineTables};
use zerohop_core::testing::{CountingNic, FakeMemory};
use zerohop_core::{Access, LocalPool, MrHandle, MrTable, PoolConfig, SlabPool};

const STRIDE: u64 = 0x1_0000;

fn handle(i: u64) -> MrHandle {
    MrHandle {
        addr: 0x1000_0000 + i * STRIDE,
        len: 0x8000,
        lkey: i as u32,
        rkey: i as u32,
        access: Access::LOCAL_WRITE,
        id: i as u32,
    }
}

/// Addresses inside random entries, so the search path varies like real traffic.
fn probes(n: u64) -> Vec<u64> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            0x1000_0000 + (x % n) * STRIDE + (x >> 40) % 0x7000
        })
        .collect()
}

fn mr_lookup(c: &mut Criterion) {
    let mut g = c.benchmark_group("mr_hit_lookup");
    for n in [16u64, 256, 1024, 4096] {
        let addrs = probes(n);
        macro_rules! table_of {
            ($cap:literal) => {{
                let mut t = Box::new(MrTable::<$cap>::new());
                for i in 0..n {
                    t.insert(handle(i), false, &mut |_| {}).unwrap();
                }
                let t = spin::Mutex::new(t);
                g.bench_with_input(
                    BenchmarkId::new("zerohop_MrTable", n),
                    &addrs,
                    |b, addrs| {
                        let mut k = 0;
                        b.iter(|| {
                            k = (k + 1) & 4095;
                            let h = t.lock().lookup_covering(addrs[k], 64, Access::LOCAL_WRITE);
                            black_box(h.expect("hit"));
                        })
                    },
                );
            }};
        }
        match n {
            16 => table_of!(16),
            256 => table_of!(256),
            1024 => table_of!(1024),
            _ => table_of!(4096),
        }
        let map: Mutex<BTreeMap<u64, MrHandle>> =
            Mutex::new((0..n).map(|i| (handle(i).addr, handle(i))).collect());
        g.bench_with_input(
            BenchmarkId::new("baseline_Mutex_BTreeMap", n),
            &addrs,
            |b, addrs| {
                let mut k = 0;
                b.iter(|| {
                    k = (k + 1) & 4095;
                    let a = addrs[k];
                    let m = map.lock().unwrap();
                    let h = m
                        .range(..=a)
                        .next_back()
                        .map(|(_, h)| *h)
                        .filter(|h| h.covers(a, 64, Access::LOCAL_WRITE));
                    black_box(h.expect("hit"));
                })
            },
        );
    }
    g.finish();
}

#[derive(Clone, Copy)]
struct Buffer {
    lkey: u32,
}

fn lease_release(c: &mut Criterion) {
    let mut g = c.benchmark_group("lease_release");
    let cfg = PoolConfig::with_budget(1 << 30);
    let source = Chunks {
        memory: FakeMemory::new(),
        registrar: Some(CountingNic::new()),
    };
    let pool = Box::new(SlabPool::new(source, cfg, InlineTables::<512, 8192>::new()).unwrap());
    let classes = cfg.classes.as_slice().to_vec();
    // Baseline: a Mutex<Vec> free list per class, pre-filled.
    let lists: Vec<Mutex<Vec<Buffer>>> = classes
        .iter()
        .map(|_| Mutex::new((0..64).map(|i| Buffer { lkey: i }).collect()))
        .collect();
    // The same pool behind a single-owner cache (what one thread or one
    // progress loop holds): no atomic on the common path.
    let local: LocalPool<_, _> = LocalPool::new(&*pool).unwrap();
    for &size in &classes {
        drop(pool.lease(size).unwrap()); // warm: the class's chunk exists
        drop(local.lease(size).unwrap()); // warm: the magazine holds one
        g.bench_function(BenchmarkId::new("zerohop_LocalPool", size), |b| {
            b.iter(|| {
                let l = local.lease(black_box(size)).unwrap();
                black_box(l.lkey().unwrap());
            })
        });
        g.bench_function(BenchmarkId::new("zerohop_SlabPool", size), |b| {
            b.iter(|| {
                let l = pool.lease(black_box(size)).unwrap();
                black_box(l.lkey().unwrap());
            })
        });
        g.bench_function(BenchmarkId::new("baseline_Mutex_Vec", size), |b| {
            b.iter(|| {
                let want = black_box(size);
                let class = classes.iter().position(|&s| s >= want).unwrap();
                let buf = lists[class].lock().unwrap().pop().unwrap();
                black_box(buf.lkey);
                lists[class].lock().unwrap().push(buf);
            })
        });
    }
    g.finish();
}

/// What any thread-safe lease+release pays at least: two atomic read-modify-writes
/// (one to take a buffer, one to give it back). Measured so the pool's figures
/// can be read against this machine's floor.
fn atomic_floor(c: &mut Criterion) {
    let a = AtomicU64::new(0);
    c.bench_function("atomic_floor/two_rmw", |b| {
        b.iter(|| {
            // AcqRel: what a lock's acquire and release would each need.
            a.fetch_add(1, Ordering::AcqRel);
            a.fetch_sub(black_box(1), Ordering::AcqRel);
        })
    });
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(50)
}

fn checksum(c: &mut Criterion) {
    let mut g = c.benchmark_group(if cfg!(feature = "std") {
        "crc32c_hardware"
    } else {
        "crc32c_table"
    });
    for len in [32usize, 4096, 65536] {
        let bytes: Vec<u8> = (0..len).map(|i| i as u8).collect();
        g.throughput(criterion::Throughput::Bytes(len as u64));
        g.bench_with_input(BenchmarkId::from_parameter(len), &bytes, |b, bytes| {
            b.iter(|| zerohop_core::crc32c(0, black_box(bytes)))
        });
    }
    g.finish();
}

criterion_group! { name = benches; config = config(); targets = mr_lookup, lease_release, atomic_floor, checksum }
criterion_main!(benches);
