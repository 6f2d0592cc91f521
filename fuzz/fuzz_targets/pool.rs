//! SlabPool against a model: no overlap, exact used bytes, exhaustion exactly
//! at the budget, one registration per chunk, everything back at the end, and
//! its bell rung once by the first buffer back after each refusal.
#![no_main]

use std::sync::atomic::{AtomicU32, Ordering};

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use zerohop_core::pool::{Chunks, InlineTables};
use zerohop_core::testing::{CountingNic, FakeMemory};
use zerohop_core::{Access, Bell, Error, PoolConfig, PoolError, SizeClasses, SlabPool};

/// Counts its rings.
#[derive(Default)]
struct Rings(AtomicU32);

impl Bell for Rings {
    fn ring(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

#[derive(Arbitrary, Debug)]
enum Op {
    Lease(u32),
    Release(u16),
}

const BUDGET: usize = 256 << 10;

fuzz_target!(|ops: Vec<Op>| {
    let mut cfg = PoolConfig::with_budget(BUDGET);
    cfg.chunk_bytes = 32 << 10;
    cfg.classes = SizeClasses::new(&[64, 512, 4096]).unwrap();
    let pool = SlabPool::with_bell(
        Chunks {
            memory: FakeMemory::new(),
            registrar: Some(CountingNic::new()),
        },
        cfg,
        InlineTables::<16, 512>::new(),
        Rings::default(),
    )
    .unwrap();
    let mut held = Vec::new();
    let mut used = 0usize;
    // A refusal since the last ring (a zero-length lease is none), and the rings.
    let (mut refused, mut rings) = (false, 0);
    for op in ops {
        match op {
            Op::Lease(len) => {
                let len = (len % 70_000) as usize;
                let reserved = pool.stats().reserved_bytes;
                match pool.lease(len) {
                    Ok(l) => {
                        assert!(len > 0 && l.capacity() >= len);
                        assert!(l.mr().unwrap().covers(
                            l.device_ptr(),
                            l.capacity(),
                            Access::LOCAL_WRITE
                        ));
                        for h in &held {
                            let h: &zerohop_core::Lease<_> = h;
                            assert!(
                                !h.buffer().overlaps(l.buffer().addr, l.buffer().len),
                                "leases overlap"
                            );
                        }
                        used += l.capacity();
                        held.push(l);
                    }
                    Err(Error::Pool(PoolError::ZeroLength)) => assert_eq!(len, 0),
                    Err(Error::Pool(PoolError::Exhausted { used: u, cap })) => {
                        refused = true;
                        assert!(u <= reserved && cap == BUDGET);
                        let need = if len > 4096 {
                            len.next_multiple_of(4096)
                        } else {
                            32 << 10
                        };
                        assert!(u + need > BUDGET, "refused below the budget");
                        assert!(
                            !held.is_empty(),
                            "with nothing leased, all memory is reclaimable"
                        );
                    }
                    Err(Error::Pool(
                        PoolError::TooManyChunks { .. } | PoolError::TooManyBuffers { .. },
                    )) => refused = true,
                    Err(e) => panic!("unexpected {e}"),
                }
            }
            Op::Release(i) => {
                if !held.is_empty() {
                    let l = held.swap_remove(usize::from(i) % held.len());
                    used -= l.capacity();
                    drop(l);
                    rings += u32::from(std::mem::take(&mut refused));
                }
            }
        }
        assert_eq!(
            pool.bell().0.load(Ordering::Relaxed),
            rings,
            "one ring for the first buffer back after a refusal"
        );
        let st = pool.stats();
        assert_eq!(st.used_bytes, used);
        assert!(st.reserved_bytes <= BUDGET);
        assert_eq!(st.leases, held.len());
        assert_eq!(st.registrations, st.grows, "every chunk registered once");
        let nic = pool.source().registrar.as_ref().unwrap();
        assert_eq!(u64::from(nic.live()), st.grows - st.given_back);
        assert_eq!(pool.source().memory.live_bytes(), st.reserved_bytes);
    }
    drop(held);
    assert_eq!(pool.used_bytes(), 0);
});
