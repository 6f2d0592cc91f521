//! A `LocalPool` in front of a `SlabPool`, leases taken through either, against
//! a model: no two leases overlap; the shared pool's `used_bytes` is exactly
//! what is leased plus what the cache holds; a refusal is typed; everything
//! comes back when the cache drops.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use zerohop_core::pool::{Chunks, InlineTables};
use zerohop_core::testing::{CountingNic, FakeMemory};
use zerohop_core::{
    Error, Lease, LocalPool, MemKind, PoolConfig, PoolError, Region, SizeClasses, SlabPool,
};

#[derive(Arbitrary, Debug)]
enum Op {
    /// A lease of `len % 20_000` bytes, through the cache or straight from the pool.
    Lease {
        len: u16,
        cached: bool,
    },
    Release(u16),
    Flush,
}

const BUDGET: usize = 128 << 10;
const M: usize = 4;

fuzz_target!(|ops: Vec<Op>| {
    let mut cfg = PoolConfig::with_budget(BUDGET);
    cfg.chunk_bytes = 16 << 10;
    cfg.classes = SizeClasses::new(&[64, 1024, 4096]).unwrap();
    let pool = SlabPool::new(
        Chunks {
            memory: FakeMemory::new(),
            registrar: Some(CountingNic::new()),
        },
        cfg,
        InlineTables::<32, 1024>::new(),
    )
    .unwrap();
    let local: LocalPool<_, _, M> = LocalPool::new(&pool).unwrap();
    // Buffers of both kinds of lease: (address, capacity), and the leases.
    let mut direct: Vec<Lease<&_>> = Vec::new();
    let mut cached: Vec<Lease<&_>> = Vec::new();
    let mut spans: Vec<(u64, usize, bool)> = Vec::new();
    for op in ops {
        match op {
            Op::Lease { len, cached: via } => {
                let len = usize::from(len) % 20_000;
                let r = if via {
                    local.lease(len).map(|l| {
                        let s = (l.buffer().addr, l.capacity(), true);
                        cached.push(l);
                        s
                    })
                } else {
                    pool.lease(len).map(|l| {
                        let s = (l.buffer().addr, l.capacity(), false);
                        direct.push(l);
                        s
                    })
                };
                match r {
                    Ok((addr, cap, via)) => {
                        assert!(len > 0 && cap >= len);
                        assert!(
                            pool.source().memory.holds(Region {
                                addr,
                                len: cap,
                                kind: MemKind::Host,
                            }),
                            "a lease inside memory the pool still holds"
                        );
                        for &(a, c, _) in &spans {
                            assert!(
                                addr + cap as u64 <= a || a + c as u64 <= addr,
                                "leases overlap"
                            );
                        }
                        spans.push((addr, cap, via));
                    }
                    Err(Error::Pool(PoolError::ZeroLength)) => assert_eq!(len, 0),
                    Err(Error::Pool(PoolError::Exhausted { cap, .. })) => {
                        assert_eq!(cap, BUDGET);
                        assert!(
                            !spans.is_empty() || local.cached_bytes() > 0,
                            "refused with nothing leased and nothing cached"
                        );
                    }
                    Err(Error::Pool(
                        PoolError::TooManyChunks { .. } | PoolError::TooManyBuffers { .. },
                    )) => {}
                    Err(e) => panic!("unexpected {e}"),
                }
            }
            Op::Release(i) => {
                if !spans.is_empty() {
                    let k = usize::from(i) % spans.len();
                    let (addr, _, via) = spans.swap_remove(k);
                    if via {
                        let at = cached.iter().position(|l| l.buffer().addr == addr);
                        cached.swap_remove(at.expect("held"));
                    } else {
                        let at = direct.iter().position(|l| l.buffer().addr == addr);
                        direct.swap_remove(at.expect("held"));
                    }
                }
            }
            Op::Flush => local.flush(),
        }
        let leased: usize = spans.iter().map(|&(_, c, _)| c).sum();
        assert_eq!(pool.used_bytes(), leased + local.cached_bytes());
        assert!(
            local.cached_bytes() <= M * (64 + 1024 + 4096),
            "at most M per class cached"
        );
        assert!(pool.stats().leases >= spans.len());
    }
    drop(direct);
    drop(cached);
    assert_eq!(pool.used_bytes(), local.cached_bytes());
    drop(local);
    assert_eq!(pool.used_bytes(), 0);
    assert_eq!(pool.stats().leases, 0);
});
