//! Property tests: MrTable and SlabPool against simple models, after every operation.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use proptest::prelude::*;
use zerohop_core::{
    Access, Chunks, Error, InlineTables, LocalPool, MemKind, MrHandle, MrTable, PoolConfig,
    PoolError, RawMemory, Region, Registrar, SizeClasses, SlabPool,
};

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
        any::<usize>().prop_map(|pick| MrOp::Unpin { pick }),
        (addr, len).prop_map(|(addr, len)| MrOp::Invalidate { addr, len }),
    ]
}

/// The model: start address -> (handle, pins).
type Model = BTreeMap<u64, (MrHandle, u32)>;

fn check_invariants<const N: usize>(t: &MrTable<N>, model: &Model) {
    let got: Vec<_> = t.iter().collect();
    let want: Vec<_> = model.values().copied().collect();
    assert_eq!(got, want, "table and model disagree");
    for w in got.windows(2) {
        assert!(
            w[0].0.addr + w[0].0.len as u64 <= w[1].0.addr,
            "sorted and disjoint"
        );
    }
}

proptest! {
    #![proptest_config(config())]
    #[test]
    fn mr_table_matches_a_btreemap_model(ops in prop::collection::vec(mr_op(), 1..200)) {
        const N: usize = 8;
        let mut t = MrTable::<N>::new();
        let mut model = Model::new();
        let mut next_id = 0u32;
        let mut live: HashSet<u32> = HashSet::new(); // ids registered and not yet handed back
        let (mut hits, mut misses) = (0u64, 0u64);
        for op in ops {
            match op {
                MrOp::Insert { addr, len, pinned } => {
                    next_id += 1;
                    let h = MrHandle { addr, len, lkey: next_id, rkey: next_id, access: Access::LOCAL_WRITE, id: next_id };
                    live.insert(next_id);
                    let mut removed = Vec::new();
                    let r = t.insert(h, pinned, &mut |x| removed.push(x));
                    for x in &removed {
                        prop_assert!(live.remove(&x.id), "handle {} handed back twice", x.id);
                    }
                    let covering = model.range(..=addr).next_back().map(|(_, v)| *v).filter(|(e, _)| e.covers(addr, len, Access::LOCAL_WRITE));
                    if let Some((e, pins)) = covering {
                        prop_assert_eq!(r, Ok(e));
                        prop_assert_eq!(removed.iter().map(|x| x.id).collect::<Vec<_>>(), vec![h.id]);
                        model.insert(e.addr, (e, pins + u32::from(pinned)));
                    } else if r.is_ok() {
                        for x in removed.iter().filter(|x| x.id != h.id) {
                            prop_assert_eq!(model.remove(&x.addr).map(|v| v.1), Some(0), "only unpinned entries leave");
                        }
                        model.insert(addr, (h, u32::from(pinned)));
                        prop_assert!(model.len() <= N);
                    } else {
                        prop_assert_eq!(removed.last().map(|x| x.id), Some(h.id), "a refused handle comes back");
                    }
                }
                MrOp::Lookup { addr, len } => {
                    let want = model.range(..=addr).next_back().map(|(_, v)| v.0).filter(|e| e.covers(addr, len, Access::NONE));
                    let got = t.lookup_covering(addr, len, Access::NONE);
                    prop_assert_eq!(got, want);
                    if got.is_some() { hits += 1 } else { misses += 1 }
                }
                MrOp::Unpin { pick } => {
                    if model.is_empty() { continue; }
                    let (&k, &(h, pins)) = model.iter().nth(pick % model.len()).unwrap();
                    let r = t.unpin(&h);
                    if pins > 0 {
                        prop_assert_eq!(r, Ok(()));
                        model.insert(k, (h, pins - 1));
                    } else {
                        prop_assert!(r.is_err());
                    }
                }
                MrOp::Invalidate { addr, len } => {
                    let mut removed = Vec::new();
                    let n = t.invalidate(addr, len, &mut |x| removed.push(x));
                    let doomed: Vec<u64> = model.values().filter(|(e, _)| e.region(MemKind::Host).overlaps(addr, len)).map(|(e, _)| e.addr).collect();
                    prop_assert_eq!(n, doomed.len());
                    for a in doomed { model.remove(&a); }
                    for x in &removed {
                        prop_assert!(live.remove(&x.id), "handle {} handed back twice", x.id);
                    }
                }
            }
            check_invariants(&t, &model);
            prop_assert_eq!(t.stats().hits, hits);
            prop_assert_eq!(t.stats().misses, misses);
        }
        // Every handle ever registered is either still in the table or was handed back once.
        let mut rest = Vec::new();
        t.clear(&mut |x| rest.push(x));
        for x in rest { prop_assert!(live.remove(&x.id)); }
        prop_assert!(live.is_empty(), "leaked registrations: {:?}", live);
    }
}

#[derive(Debug, Default)]
struct Arena {
    next: AtomicU64,
}

impl RawMemory for Arena {
    fn alloc(&self, len: usize, align: usize) -> Result<Region, Error> {
        // Relaxed: a bump counter; nothing else is ordered by it.
        let at = self.next.fetch_add((len + align) as u64, Ordering::Relaxed);
        let addr = (0x1000_0000 + at).next_multiple_of(align as u64);
        Ok(Region {
            addr,
            len,
            kind: MemKind::HostPinned,
        })
    }
    fn free(&self, _: Region) -> Result<(), Error> {
        Ok(())
    }
    fn host_visible(&self) -> bool {
        true
    }
}

#[derive(Debug, Default)]
struct Nic {
    live: AtomicU32,
    ever: AtomicU32,
}

impl Registrar for Nic {
    fn register(&self, region: Region, access: Access) -> Result<MrHandle, Error> {
        // Relaxed: counters read on this thread only.
        let id = self.ever.fetch_add(1, Ordering::Relaxed);
        self.live.fetch_add(1, Ordering::Relaxed);
        Ok(MrHandle {
            addr: region.addr,
            len: region.len,
            lkey: id,
            rkey: id,
            access,
            id,
        })
    }
    fn deregister(&self, _: MrHandle) -> Result<(), Error> {
        self.live.fetch_sub(1, Ordering::Relaxed);
        Ok(())
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
        let pool = SlabPool::new(Chunks { memory: Arena::default(), registrar: Some(Nic::default()) }, cfg, InlineTables::<64, 4096>::new()).unwrap();
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
        let live = pool.source().registrar.as_ref().unwrap().live.load(Ordering::Relaxed);
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
        let pool = SlabPool::new(Chunks { memory: Arena::default(), registrar: Some(Nic::default()) }, cfg, InlineTables::<64, 4096>::new()).unwrap();
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
