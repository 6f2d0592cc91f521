//! Arena memory over a caller-given static buffer: first-fit over a fixed block table.

use core::ptr::NonNull;

use zerohop_core::{Error, MemKind, RawMemory, Region};

const MAX_BLOCKS: usize = 32;

#[derive(Clone, Copy, Debug)]
struct Block {
    offset: usize,
    len: usize,
}

/// `RawMemory` over a `&'static mut [u8]` the caller donates (heapless's
/// `manage(block)` pattern). At most 32 live allocations; each is aligned as
/// asked relative to the buffer's real address.
#[derive(Debug)]
pub struct Arena {
    base: NonNull<u8>,
    len: usize,
    blocks: spin::Mutex<([Option<Block>; MAX_BLOCKS], usize)>,
}

// SAFETY: the arena owns its buffer exclusively (it took the `&'static mut`);
// `base` is only turned into slices for regions handed out under the block
// lock, and those slices' aliasing is governed by the pool's leases.
unsafe impl Send for Arena {}
// SAFETY: as above; all mutation of the block table goes through the spin lock.
unsafe impl Sync for Arena {}

impl Arena {
    /// Takes ownership of `buf` for the program's lifetime.
    pub fn new(buf: &'static mut [u8]) -> Arena {
        let len = buf.len();
        Arena {
            base: NonNull::from(buf).cast(),
            len,
            blocks: spin::Mutex::new(([None; MAX_BLOCKS], 0)),
        }
    }

    /// The whole buffer, as a region (what a mock NIC is told it may touch).
    pub fn region(&self) -> Region {
        Region {
            addr: self.base.as_ptr().addr() as u64,
            len: self.len,
            kind: MemKind::Host,
        }
    }

    /// Bytes allocated now.
    pub fn allocated(&self) -> usize {
        self.blocks.lock().0.iter().flatten().map(|b| b.len).sum()
    }

    /// A pointer to `region`'s first byte that carries the buffer's provenance,
    /// or `None` when the region is not inside the buffer.
    pub fn pointer(&self, region: Region) -> Option<NonNull<u8>> {
        let start = self.region();
        if !start.covers(region.addr, region.len) {
            return None;
        }
        let offset = (region.addr - start.addr) as usize;
        // SAFETY: `offset + region.len <= self.len` (checked by `covers`), so the
        // pointer stays inside the donated buffer.
        Some(unsafe { self.base.add(offset) })
    }
}

impl RawMemory for Arena {
    fn alloc(&self, len: usize, align: usize) -> Result<Region, Error> {
        if len == 0 || !align.is_power_of_two() {
            return Err(Error::OutOfMemory { len });
        }
        let base = self.base.as_ptr().addr();
        let mut guard = self.blocks.lock();
        let (blocks, count) = &mut *guard;
        if *count == MAX_BLOCKS {
            return Err(Error::OutOfMemory { len });
        }
        // First fit: the lowest start, at 0 or just past a live block, that
        // overlaps no live block. (No sort: on a microcontroller, a sort's
        // code costs more than this table's few comparisons.)
        let ends = blocks.iter().flatten().map(|b| b.offset + b.len);
        let mut found: Option<usize> = None;
        for cursor in core::iter::once(0).chain(ends) {
            let start = (base + cursor).next_multiple_of(align) - base;
            let Some(end) = start.checked_add(len).filter(|&e| e <= self.len) else {
                continue;
            };
            let free = blocks
                .iter()
                .flatten()
                .all(|b| end <= b.offset || start >= b.offset + b.len);
            if free && found.is_none_or(|f| start < f) {
                found = Some(start);
            }
        }
        let offset = found.ok_or(Error::OutOfMemory { len })?;
        let slot = blocks
            .iter_mut()
            .find(|b| b.is_none())
            .ok_or(Error::OutOfMemory { len })?;
        *slot = Some(Block { offset, len });
        *count += 1;
        Ok(Region {
            addr: (base + offset) as u64,
            len,
            kind: MemKind::Host,
        })
    }

    fn free(&self, region: Region) -> Result<(), Error> {
        let base = self.base.as_ptr().addr() as u64;
        let mut guard = self.blocks.lock();
        let (blocks, count) = &mut *guard;
        let slot = blocks
            .iter_mut()
            .find(|b| {
                b.is_some_and(|b| base + b.offset as u64 == region.addr && b.len == region.len)
            })
            .ok_or(Error::Backend("arena free of a block it did not allocate"))?;
        *slot = None;
        *count -= 1;
        Ok(())
    }

    fn host_visible(&self) -> bool {
        true
    }
}

#[cfg(all(test, feature = "std"))]
mod tests {
    use super::*;

    fn arena(n: usize) -> Arena {
        Arena::new(Box::leak(vec![0u8; n].into_boxed_slice()))
    }

    #[test]
    fn allocations_are_aligned_disjoint_and_reusable() {
        let a = arena(64 << 10);
        let x = a.alloc(1000, 4096).unwrap();
        let y = a.alloc(1000, 4096).unwrap();
        assert_eq!(x.addr % 4096, 0);
        assert_eq!(y.addr % 4096, 0);
        assert!(!x.overlaps(y.addr, y.len));
        a.free(x).unwrap();
        let z = a.alloc(500, 64).unwrap();
        assert!(a.region().covers(z.addr, z.len));
        assert!(
            a.free(x).is_err(),
            "double free is an error, not corruption"
        );
    }

    #[test]
    fn running_out_is_typed() {
        let a = arena(8192);
        assert!(a.alloc(4096, 1).is_ok());
        assert_eq!(a.alloc(8192, 1), Err(Error::OutOfMemory { len: 8192 }));
        assert_eq!(a.alloc(0, 1), Err(Error::OutOfMemory { len: 0 }));
    }
}
