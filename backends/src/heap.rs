//! Host memory from the process heap (the tcp transport's receive buffers).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::Mutex;

use zerohop_core::pool::{Chunk, PoolTables, Slot};
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
    live: Mutex<BTreeMap<u64, Allocation>>,
}

impl HeapMemory {
    /// A heap source with nothing allocated.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes allocated now.
    pub fn allocated(&self) -> usize {
        self.lock().values().map(|a| a.layout.size()).sum()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Allocation>> {
        // A panic while holding this lock cannot leave the map half-updated
        // (each update is one insert or remove), so poisoning is ignored.
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A pointer to `region`'s first byte, if it lies inside one live allocation.
    pub fn pointer(&self, region: Region) -> Option<NonNull<u8>> {
        let live = self.lock();
        let (&start, a) = live.range(..=region.addr).next_back()?;
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
        self.lock().insert(addr, Allocation { ptr, layout });
        Ok(Region {
            addr,
            len,
            kind: MemKind::Host,
        })
    }

    fn free(&self, region: Region) -> Result<(), Error> {
        let a = self.lock().remove(&region.addr).ok_or(Error::Backend(
            "free of memory this heap source did not allocate",
        ))?;
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
        for a in live.into_values() {
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

    /// Tables for a pool of `budget` bytes: a chunk descriptor per 2 MiB of budget
    /// (at least 64, for oversize buffers), and 64 Ki buffers.
    pub fn for_budget(budget: usize) -> Self {
        Self::new((budget / (2 << 20)).max(64), 64 << 10)
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
