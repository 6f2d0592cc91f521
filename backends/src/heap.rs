//! Host memory from the process heap: what a [`crate::MappedMemory`] cannot
//! place, and pools where no mapping can be made (`HostMemory::private`).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::Mutex;

use zerohop_core::pool::{Chunk, PoolTables, Slot};
use zerohop_core::PoolConfig;
use zerohop_core::{Error, MemKind, RawMemory, Region};

#[derive(Debug)]
struct Allocation {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: an `Allocation` is the sole owner of its heap block; the pointer is
// only dereferenced through views whose aliasing the pool's leases govern.
unsafe impl Send for Allocation {}

/// Heap allocations, remembered by address so `free` can give back the exact
/// layout and views can recover each pointer with its provenance.
#[derive(Debug, Default)]
pub struct HeapMemory {
    /// Sorted by address. A pool holds few allocations (its chunks, and
    /// oversize buffers), and every view of a lease looks one up: a binary
    /// search of a flat array is the cheap look.
    live: Mutex<Vec<(u64, Allocation)>>,
}

impl HeapMemory {
    /// A heap source with nothing allocated.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes allocated now.
    pub fn allocated(&self) -> usize {
        self.lock().iter().map(|(_, a)| a.layout.size()).sum()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(u64, Allocation)>> {
        // A panic while holding this lock cannot leave the map half-updated
        // (each update is one insert or remove), so poisoning is ignored.
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A pointer to `region`'s first byte, if it lies inside one live allocation.
    pub fn pointer(&self, region: Region) -> Option<NonNull<u8>> {
        let live = self.lock();
        // The last allocation starting at or before the region.
        let i = live.partition_point(|&(start, _)| start <= region.addr);
        let (start, a) = live.get(i.checked_sub(1)?)?;
        let start = *start;
        let whole = Region {
            addr: start,
            len: a.layout.size(),
            kind: MemKind::Host,
        };
        if !whole.covers(region.addr, region.len) {
            return None;
        }
        // SAFETY: the offset keeps the pointer inside the allocation (checked by `covers`).
        Some(unsafe { a.ptr.add((region.addr - start) as usize) })
    }
}

impl RawMemory for HeapMemory {
    fn alloc(&self, len: usize, align: usize) -> Result<Region, Error> {
        let layout =
            Layout::from_size_align(len.max(1), align).map_err(|_| Error::OutOfMemory { len })?;
        // SAFETY: the layout has a non-zero size (len.max(1)).
        let ptr =
            NonNull::new(unsafe { alloc_zeroed(layout) }).ok_or(Error::OutOfMemory { len })?;
        let addr = ptr.as_ptr().addr() as u64;
        let mut live = self.lock();
        let i = live.partition_point(|&(start, _)| start < addr);
        live.insert(i, (addr, Allocation { ptr, layout }));
        Ok(Region {
            addr,
            len,
            kind: MemKind::Host,
        })
    }

    fn free(&self, region: Region) -> Result<(), Error> {
        let a = {
            let mut live = self.lock();
            let i = live
                .binary_search_by_key(&region.addr, |&(start, _)| start)
                .map_err(|_| Error::Backend("free of memory this heap source did not allocate"))?;
            live.remove(i).1
        };
        // SAFETY: `a.ptr` came from `alloc_zeroed(a.layout)` and was removed from
        // the map, so it is freed exactly once with its own layout.
        unsafe { dealloc(a.ptr.as_ptr(), a.layout) };
        Ok(())
    }

    fn host_visible(&self) -> bool {
        true
    }
}

impl Drop for HeapMemory {
    fn drop(&mut self) {
        let live = std::mem::take(self.live.get_mut().unwrap_or_else(|e| e.into_inner()));
        for (_, a) in live {
            // SAFETY: every entry is a live allocation made with this layout.
            unsafe { dealloc(a.ptr.as_ptr(), a.layout) };
        }
    }
}

/// Pool descriptor tables on the heap, sized at run time.
#[derive(Debug)]
pub struct HeapTables {
    chunks: Box<[Chunk]>,
    slots: Box<[Slot]>,
}

impl HeapTables {
    /// Room for `chunks` chunks and `slots` buffers.
    pub fn new(chunks: usize, slots: usize) -> Self {
        HeapTables {
            chunks: vec![Chunk::EMPTY; chunks].into_boxed_slice(),
            slots: vec![Slot::EMPTY; slots].into_boxed_slice(),
        }
    }

    /// Tables for a pool of `config`: a chunk descriptor per 2 MiB of budget
    /// (at least 64, for oversize buffers), and a buffer descriptor for each
    /// smallest buffer the budget holds (every buffer lies in budgeted
    /// memory), 64 Ki at most. A small pool's tables are then small: a
    /// fixed 64 Ki (1 MiB, written twice) made a 1 MiB pool cost more to
    /// build than its memory.
    pub fn for_config(config: &PoolConfig) -> Self {
        let smallest = config.classes.as_slice().first().copied().unwrap_or(1);
        let buffers = config.budget.div_ceil(smallest.max(1)).saturating_add(64);
        Self::new((config.budget / (2 << 20)).max(64), buffers.min(64 << 10))
    }
}

impl PoolTables for HeapTables {
    fn chunks(&mut self) -> &mut [Chunk] {
        &mut self.chunks
    }
    fn slots(&mut self) -> &mut [Slot] {
        &mut self.slots
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inside(m: &HeapMemory, addr: u64, len: usize) -> Option<u64> {
        let r = Region {
            addr,
            len,
            kind: MemKind::Host,
        };
        m.pointer(r).map(|p| p.as_ptr().addr() as u64)
    }

    /// Tables sized to the budget run out of memory, never of descriptors:
    /// the smallest buffers fill the budget, and the pool says it is full.
    #[test]
    fn tables_for_a_pool_describe_every_buffer_its_budget_holds() {
        use zerohop_core::pool::Chunks;
        use zerohop_core::PoolError;
        for budget in [64 << 10, 1 << 20, 3 << 20] {
            let config = PoolConfig::with_budget(budget).fitted();
            let tables = HeapTables::for_config(&config);
            assert!(tables.slots.len() <= budget / 256 + 64, "sized to {budget}");
            let memory = crate::HostMemory::Heap(HeapMemory::new());
            let source = Chunks::<_, crate::Nic> {
                memory,
                registrar: None,
            };
            let pool =
                crate::HostPool::with_bell(source, config, tables, crate::HostBell::default())
                    .unwrap();
            let mut held = Vec::new();
            let e = loop {
                match pool.lease(1) {
                    Ok(l) => held.push(l),
                    Err(e) => break e,
                }
            };
            assert!(
                matches!(e, Error::Pool(PoolError::Exhausted { .. })),
                "{budget}: {e:?} after {} buffers",
                held.len()
            );
            assert_eq!(held.len() * 256, pool.stats().reserved_bytes, "{budget}");
        }
    }

    #[test]
    fn views_are_found_inside_live_allocations_only() {
        let m = HeapMemory::new();
        let rs: Vec<Region> = [4096, 100, 65536]
            .iter()
            .map(|&n| m.alloc(n, 64).unwrap())
            .collect();
        assert_eq!(m.allocated(), 4096 + 100 + 65536);
        for r in &rs {
            assert_eq!(inside(&m, r.addr, r.len), Some(r.addr), "the whole");
            assert_eq!(inside(&m, r.addr + 7, r.len - 7), Some(r.addr + 7));
            assert_eq!(inside(&m, r.addr + 1, r.len), None, "past its end");
        }
        let lowest = rs.iter().map(|r| r.addr).min().unwrap();
        assert_eq!(inside(&m, lowest - 1, 1), None, "before every allocation");
        m.free(rs[1]).unwrap();
        assert_eq!(inside(&m, rs[1].addr, 1), None, "freed");
        assert!(m.free(rs[1]).is_err(), "freed twice");
        assert_eq!(inside(&m, rs[2].addr, rs[2].len), Some(rs[2].addr));
        assert_eq!(m.allocated(), 4096 + 65536);
    }
}
