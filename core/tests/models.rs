//! Property tests: MrTable and SlabPool against simple models, after every operation.

use proptest::prelude::*;
use zerohop_core::pool::{Chunks, InlineTables};
use zerohop_core::testing::{CountingNic, FakeMemory, MrModel};
use zerohop_core::{Access, Error, LocalPool, PoolConfig, PoolError, SizeClasses, SlabPool};

/// Full runs natively; a handful under miri, which is ~1000x slower and has
/// no file system for proptest's failure file.
fn config() -> ProptestConfig {
    if cfg!(miri) {
        ProptestConfig {
            cases: 3,
            failure_persistence: None,
            ..ProptestConfig::default()
        }
    } else {
        ProptestConfig::with_cases(512)
    }
}

#[derive(Debug, Clone)]
enum MrOp {
    Insert { addr: u64, len: usize, pinned: bool },
    Lookup { addr: u64, len: usize },
    Pin { addr: u64, len: usize },
    Unpin { pick: usize },
    Invalidate { addr: u64, len: usize },
}

fn mr_op() -> impl Strategy<Value = MrOp> {
    // A small address space so ranges collide often.
    let addr = (0u64..64).prop_map(|a| a * 16);
    let len = 1usize..96;
    prop_oneof![
        (addr.clone(), len.clone(), any::<bool>()).prop_map(|(addr, len, pinned)| MrOp::Insert {
            addr,
            len,
            pinned
        }),
        (addr.clone(), len.clone()).prop_map(|(addr, len)| MrOp::Lookup { addr, len }),
        (addr.clone(), len.clone()).prop_map(|(addr, len)| MrOp::Pin { addr, len }),
        any::<usize>().prop_map(|pick| MrOp::Unpin { pick }),
        (addr, len).prop_map(|(addr, len)| MrOp::Invalidate { addr, len }),
    ]
}

proptest! {
    #![proptest_config(config())]
    #[test]
    fn mr_table_matches_a_btreemap_model(ops in prop::collection::vec(mr_op(), 1..200)) {
        let mut m = MrModel::<8>::new();
        for op in ops {
            match op {
                MrOp::Insert { addr, len, pinned } => m.insert(addr, len, pinned, Access::LOCAL_WRITE),
                MrOp::Lookup { addr, len } => m.lookup(addr, len),
                MrOp::Pin { addr, len } => m.pin(addr, len),
                MrOp::Unpin { pick } => m.unpin(pick),
                MrOp::Invalidate { addr, len } => m.invalidate(addr, len),
            }
        }
        m.finish();
    }
}

proptest! {
    #![proptest_config(config())]
    #[test]
    fn pool_matches_a_model(ops in prop::collection::vec((any::<bool>(), 1usize..80_000, any::<usize>()), 1..300)) {
        const BUDGET: usize = 512 << 10;
        let mut cfg = PoolConfig::with_budget(BUDGET);
        cfg.chunk_bytes = 64 << 10;
        cfg.classes = SizeClasses::new(&[256, 1024, 4096, 16384]).unwrap();
        let pool = SlabPool::new(Chunks { memory: FakeMemory::new(), registrar: Some(CountingNic::new()) }, cfg, InlineTables::<64, 4096>::new()).unwrap();
        let mut held: Vec<zerohop_core::Lease<&_>> = Vec::new();
        let mut used = 0usize;
        for (take, len, pick) in ops {
            if take || held.is_empty() {
                let before = pool.stats();
                match pool.lease(len) {
                    Ok(l) => {
                        prop_assert!(l.capacity() >= len);
                        let mr = l.mr().unwrap();
                        prop_assert!(mr.covers(l.device_ptr(), l.capacity(), Access::LOCAL_WRITE), "lease inside its chunk's registration");
                        for other in &held {
                            prop_assert!(!other.buffer().overlaps(l.buffer().addr, l.buffer().len), "leases overlap");
                        }
                        used += l.capacity();
                        held.push(l);
                    }
                    Err(Error::Pool(PoolError::Exhausted { used: u, cap })) => {
                        prop_assert_eq!(cap, BUDGET);
                        prop_assert!(u <= before.reserved_bytes);
                        let need = if len > 16384 { len.next_multiple_of(4096) } else { 64 << 10 };
                        prop_assert!(u + need > BUDGET, "exhausted below the budget");
                        prop_assert!(!held.is_empty(), "with nothing leased, all memory is reclaimable");
                    }
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                }
            } else {
                let l = held.swap_remove(pick % held.len());
                used -= l.capacity();
            }
            prop_assert_eq!(pool.used_bytes(), used);
            let st = pool.stats();
            prop_assert!(st.reserved_bytes <= BUDGET);
            prop_assert_eq!(st.leases, held.len());
            prop_assert_eq!(st.registrations, st.grows, "every chunk registered once");
        }
        drop(held);
        prop_assert_eq!(pool.used_bytes(), 0);
        // Chunks stay registered until given back (reclaimed at the budget,
        // or an oversize buffer released while the spares were full) or the
        // pool drops.
        let live = pool.source().registrar.as_ref().unwrap().live();
        prop_assert_eq!(pool.source().memory.live_bytes(), pool.stats().reserved_bytes, "what the pool holds, and no more, is allocated");
        let st = pool.stats();
        prop_assert_eq!(u64::from(live), st.grows - st.given_back);
        prop_assert!(st.oversize_reused <= st.oversize);
    }
}

proptest! {
    #![proptest_config(config())]
    /// A `LocalPool` in front of the shared pool: leases never overlap, and the
    /// shared pool's `used_bytes` is exactly what is leased plus what the cache holds.
    #[test]
    fn local_pool_matches_a_model(ops in prop::collection::vec((any::<bool>(), 1usize..20_000, any::<usize>()), 1..300)) {
        let mut cfg = PoolConfig::with_budget(1 << 20);
        cfg.chunk_bytes = 64 << 10;
        cfg.classes = SizeClasses::new(&[256, 1024, 4096]).unwrap();
        let pool = SlabPool::new(Chunks { memory: FakeMemory::new(), registrar: Some(CountingNic::new()) }, cfg, InlineTables::<64, 4096>::new()).unwrap();
        let local: LocalPool<_, _, 8> = LocalPool::new(&pool).unwrap();
        let mut held: Vec<zerohop_core::Lease<&_>> = Vec::new();
        let mut used = 0usize;
        for (take, len, pick) in ops {
            if take || held.is_empty() {
                match local.lease(len) {
                    Ok(l) => {
                        prop_assert!(l.capacity() >= len);
                        for other in &held {
                            prop_assert!(!other.buffer().overlaps(l.buffer().addr, l.buffer().len), "leases overlap");
                        }
                        used += l.capacity();
                        held.push(l);
                    }
                    Err(Error::Pool(PoolError::Exhausted { .. })) => prop_assert!(!held.is_empty()),
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                }
            } else {
                used -= held.swap_remove(pick % held.len()).capacity();
            }
            prop_assert_eq!(pool.used_bytes(), used + local.cached_bytes());
            prop_assert!(local.cached_bytes() <= 3 * 8 * 4096, "at most M per class cached");
        }
        drop(held);
        prop_assert_eq!(pool.used_bytes(), local.cached_bytes());
        drop(local);
        prop_assert_eq!(pool.used_bytes(), 0);
        prop_assert_eq!(pool.stats().leases, 0);
    }
}
