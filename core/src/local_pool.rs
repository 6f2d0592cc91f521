//! A single-owner cache of buffers in front of a shared [`SlabPool`]: the
//! common lease and release touch no atomic and no lock.
//!
//! A shared pool pays at least two atomic read-modify-writes per lease and
//! release (its lock, taken twice). UCX gets its few-nanosecond `ucs_mpool_get`
//! the same way this does: the memory pool belongs to one worker and is not
//! thread-safe. Here each size class has a *magazine* (Bonwick's slab
//! allocator) of up to `M` leased-out buffers; an empty magazine is refilled
//! with `M / 2` buffers under one lock, a full one gives `M / 2` back under one
//! lock. The type system keeps it single-owner: `LocalPool` is not `Sync`, so a
//! `Lease<&LocalPool>` cannot leave its thread, and releases always come home.
//!
//! Buffers in the magazines count as used in the shared pool's
//! [`used_bytes`](SlabPool::used_bytes) (they are out of it) until
//! [`flush`](LocalPool::flush) or drop; [`cached_bytes`](LocalPool::cached_bytes)
//! says how many. Oversize requests pass straight through to the shared pool.

use core::cell::RefCell;

use crate::error::PoolError;
use crate::pool::{Bell, ChunkSource, NoBell, Pool, PoolTables, SlabPool, SlotTicket, MAX_CLASSES};
use crate::{Error, Lease, MrHandle};

/// Free buffers of one class, taken from the shared pool and not leased out.
#[derive(Debug)]
struct Magazine<const M: usize> {
    /// `tickets[..len]` are free buffers; the rest are stale copies.
    tickets: [SlotTicket; M],
    len: usize,
}

/// A cache of `M` buffers per size class in front of a shared [`SlabPool`],
/// for one thread (or one single-threaded context, as in firmware).
pub struct LocalPool<'a, S: ChunkSource, T: PoolTables, const M: usize = 16, B: Bell = NoBell> {
    shared: &'a SlabPool<S, T, B>,
    magazines: RefCell<[Magazine<M>; MAX_CLASSES]>,
}

impl<S: ChunkSource, T: PoolTables, const M: usize, B: Bell> core::fmt::Debug
    for LocalPool<'_, S, T, M, B>
{
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("LocalPool")
            .field("magazine", &M)
            .field("cached_bytes", &self.cached_bytes())
            .finish_non_exhaustive()
    }
}

impl<'a, S: ChunkSource, T: PoolTables, const M: usize, B: Bell> LocalPool<'a, S, T, M, B> {
    /// An empty cache in front of `shared`. `M` must be at least 2 (a
    /// magazine refills and flushes by halves).
    pub fn new(shared: &'a SlabPool<S, T, B>) -> Result<Self, PoolError> {
        if M < 2 {
            return Err(PoolError::BadConfig);
        }
        Ok(LocalPool {
            shared,
            magazines: RefCell::new(core::array::from_fn(|_| Magazine {
                tickets: [SlotTicket::EMPTY; M],
                len: 0,
            })),
        })
    }

    /// The shared pool behind this cache.
    pub fn shared(&self) -> &'a SlabPool<S, T, B> {
        self.shared
    }

    /// Leases a buffer of at least `len` bytes (what [`Lease::take`] does,
    /// with the common case built in place: no intermediate `Result` of a
    /// ticket, whose copy cost a store-forwarding stall per lease).
    #[inline]
    pub fn lease(&self, len: usize) -> Result<Lease<&Self>, Error> {
        if len > 0 {
            if let Some(class) = self.shared.config().classes.class_for(len) {
                let mut mags = self.magazines.borrow_mut();
                let m = &mut mags[class];
                if m.len > 0 {
                    m.len -= 1;
                    return Ok(Lease::from_ticket(self, m.tickets[m.len], len));
                }
            }
        }
        Lease::take(self, len)
    }

    /// Bytes of free buffers held here (out of the shared pool, not leased).
    pub fn cached_bytes(&self) -> usize {
        let sizes = self.shared.config().classes;
        let mags = self.magazines.borrow();
        sizes
            .as_slice()
            .iter()
            .zip(mags.iter())
            .map(|(size, m)| size * m.len)
            .sum()
    }

    /// Gives every cached buffer back to the shared pool.
    pub fn flush(&self) {
        let mut mags = self.magazines.borrow_mut();
        for m in mags.iter_mut() {
            self.shared.release_batch(&m.tickets[..m.len]);
            m.len = 0;
        }
    }
}

impl<S: ChunkSource, T: PoolTables, const M: usize, B: Bell> Pool for LocalPool<'_, S, T, M, B> {
    #[inline]
    fn take_slot(&self, len: usize) -> Result<SlotTicket, Error> {
        if len == 0 {
            return Err(PoolError::ZeroLength.into());
        }
        let Some(class) = self.shared.config().classes.class_for(len) else {
            return self.shared.take_slot(len);
        };
        {
            let mut mags = self.magazines.borrow_mut();
            let m = &mut mags[class];
            if m.len == 0 {
                m.len = self.shared.take_batch(class, &mut m.tickets[..M / 2]);
            }
            if m.len > 0 {
                m.len -= 1;
                return Ok(m.tickets[m.len]);
            }
        }
        // Nothing free in the shared pool's class: let it grow (outside our borrow).
        self.shared.take_slot(len)
    }

    fn registration(&self, ticket: &SlotTicket) -> Option<MrHandle> {
        self.shared.registration(ticket)
    }

    #[inline]
    fn release_slot(&self, ticket: &SlotTicket) {
        let Some(class) = self.shared.class_of(ticket) else {
            return self.shared.release_slot(ticket);
        };
        let mut mags = self.magazines.borrow_mut();
        let m = &mut mags[class];
        if m.len == M {
            self.shared.release_batch(&m.tickets[M / 2..]);
            m.len = M / 2;
        }
        // Last in, first out: the place usually still holds this very ticket
        // (it was leased from here), so a copy is skipped, and with it a
        // store-forwarding stall that cost half the time of the whole cycle.
        // The whole ticket is compared, not its slot index: a stale copy left
        // behind a flush may carry an index the shared pool has since given
        // to a buffer of another chunk (reclaimed chunks hand their slot
        // descriptors on), with another address and registration.
        if m.tickets[m.len] != *ticket {
            m.tickets[m.len] = *ticket;
        }
        m.len += 1;
    }
}

impl<S: ChunkSource, T: PoolTables, const M: usize, B: Bell> Drop for LocalPool<'_, S, T, M, B> {
    fn drop(&mut self) {
        self.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::tests::source;
    use crate::pool::{Chunks, InlineTables, PoolConfig};
    use crate::testing::{CountingNic, FakeMemory};

    type Shared = SlabPool<Chunks<FakeMemory, CountingNic>, InlineTables<8, 256>>;

    fn shared(budget: usize) -> Shared {
        let mut cfg = PoolConfig::with_budget(budget);
        cfg.chunk_bytes = 4096;
        cfg.classes = crate::SizeClasses::new(&[256, 1024]).unwrap();
        SlabPool::new(source(), cfg, InlineTables::new()).unwrap()
    }

    #[test]
    fn leases_come_from_the_magazine_and_go_back_to_it() {
        let pool = shared(1 << 20);
        let local: LocalPool<_, _, 4> = LocalPool::new(&pool).unwrap();
        // The first lease finds the class empty: the shared pool grows.
        let a = local.lease(100).unwrap();
        assert_eq!(a.capacity(), 256);
        assert_eq!(a.mr().unwrap().lkey, 0, "the first chunk's registration");
        assert_eq!((pool.used_bytes(), local.cached_bytes()), (256, 0));
        let addr = a.buffer().addr;
        drop(a);
        assert_eq!((pool.used_bytes(), local.cached_bytes()), (256, 256));
        // Last in, first out: the buffer just released is handed out again.
        let b = local.lease(1).unwrap();
        assert_eq!(b.buffer().addr, addr);
        // An empty magazine refills by half (two): one leased, one cached.
        let c = local.lease(1).unwrap();
        assert_eq!((pool.used_bytes(), local.cached_bytes()), (3 * 256, 256));
        drop((b, c));
        local.flush();
        assert_eq!(local.cached_bytes(), 0);
        assert_eq!(pool.used_bytes(), 0);
    }

    #[test]
    fn a_full_magazine_gives_half_back_and_drop_gives_all_back() {
        let pool = shared(1 << 20);
        let local: LocalPool<_, _, 4> = LocalPool::new(&pool).unwrap();
        let leases: [_; 6] = core::array::from_fn(|_| local.lease(1000).unwrap());
        let mut addrs: [u64; 6] = core::array::from_fn(|i| leases[i].buffer().addr);
        addrs.sort_unstable();
        assert!(addrs.windows(2).all(|w| w[0] + 1024 <= w[1]), "no overlap");
        drop(leases);
        // Six came home to a magazine of four (one already cached): it
        // flushed two twice on the way and keeps three.
        assert_eq!(local.cached_bytes(), 3 * 1024);
        assert_eq!(pool.used_bytes(), 3 * 1024);
        drop(local);
        assert_eq!(pool.used_bytes(), 0);
        assert_eq!(pool.stats().leases, 0);
    }

    #[test]
    fn oversize_and_zero_and_exhaustion_pass_through_typed() {
        let pool = shared(4096);
        let local: LocalPool<_, _, 4> = LocalPool::new(&pool).unwrap();
        assert_eq!(
            local.lease(0).unwrap_err(),
            Error::Pool(PoolError::ZeroLength)
        );
        // Also when the magazine of the smallest class holds a buffer.
        drop(local.lease(1).unwrap());
        assert_eq!(local.cached_bytes(), 256);
        assert_eq!(
            local.lease(0).unwrap_err(),
            Error::Pool(PoolError::ZeroLength)
        );
        assert_eq!(local.cached_bytes(), 256);
        let shown = std::format!("{local:?}");
        assert!(shown.contains("LocalPool") && shown.contains("cached_bytes: 256"));
        local.flush();
        let big = local.lease(4096).unwrap();
        assert_eq!(local.cached_bytes(), 0, "oversize never cached");
        assert!(matches!(
            local.lease(1),
            Err(Error::Pool(PoolError::Exhausted { .. }))
        ));
        drop(big);
        assert_eq!(pool.used_bytes(), 0);
        assert!(local.lease(1).is_ok());
        assert!(matches!(
            LocalPool::<_, _, 1>::new(&pool),
            Err(PoolError::BadConfig)
        ));
    }
}
