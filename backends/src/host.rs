//! Host-visible memory of every backend, and the one safe way to read a lease.

use core::ops::Deref;

use zerohop_core::pool::{Chunks, PoolTables};
use zerohop_core::{Error, Lease, LocalPool, Pool, RawMemory, Region, SlabPool};

#[cfg(feature = "std")]
use crate::heap::HeapMemory;
#[cfg(feature = "mock")]
use crate::mock::Arena;
use crate::nic::Nic;
use crate::HostBell;

/// Memory the CPU can read and write, from whichever backends are compiled in.
///
/// Only this crate's allocators can be put in here, which is what makes
/// [`host_bytes`] sound: every region a [`HostPool`] hands out is real memory
/// of this process that stays mapped while its lease lives.
#[derive(Debug)]
#[non_exhaustive]
// One value per pool, and no_std has no Box: the arena's inline block table stays inline.
#[allow(clippy::large_enum_variant)]
pub enum HostMemory {
    /// The mock arena (a caller-given static buffer).
    #[cfg(feature = "mock")]
    Arena(Arena),
    /// The process heap.
    #[cfg(feature = "std")]
    Heap(HeapMemory),
    /// One mapping made up front: a shared-memory file a same-host peer
    /// may map, or private memory.
    #[cfg(all(feature = "std", target_os = "linux"))]
    Mapped(crate::mapped::MappedMemory),
    /// CUDA managed or pinned host memory.
    #[cfg(feature = "cuda-uma")]
    Cuda(crate::cuda::HostCudaMemory),
}

impl HostMemory {
    /// Private memory for a pool of `budget` bytes: one mapping reserved up
    /// front, so that a view of a lease is a range check, not a lookup under
    /// a lock (every received message is viewed at least once); the heap
    /// where no such mapping can be made.
    #[cfg(feature = "std")]
    pub fn private(budget: usize) -> HostMemory {
        #[cfg(target_os = "linux")]
        match crate::mapped::MappedMemory::private(pool_room(budget)) {
            Ok(m) => return HostMemory::Mapped(m),
            Err(e) => info!(
                "zerohop: no private mapping for a pool ({}); the heap instead",
                e
            ),
        }
        HostMemory::Heap(HeapMemory::new())
    }

    /// A shared-memory file for a pool of `budget` bytes, which a same-host
    /// peer may map (see [`crate::MappedMemory::shared`]).
    #[cfg(all(feature = "std", target_os = "linux"))]
    pub fn shared(budget: usize) -> Result<HostMemory, Error> {
        crate::mapped::MappedMemory::shared(pool_room(budget)).map(HostMemory::Mapped)
    }

    /// What memory it hands out: `Host`, or CUDA's `Managed` or `Pinned`.
    pub fn kind(&self) -> zerohop_core::MemKind {
        match self {
            #[cfg(feature = "cuda-uma")]
            HostMemory::Cuda(m) => m.kind(),
            #[allow(unreachable_patterns)]
            _ => zerohop_core::MemKind::Host,
        }
    }

    /// A pointer to `region`'s first byte with the provenance of the allocation
    /// it lies in, or `None` when this source did not allocate it.
    fn pointer(&self, region: Region) -> Option<core::ptr::NonNull<u8>> {
        match self {
            #[cfg(feature = "mock")]
            HostMemory::Arena(m) => m.pointer(region),
            #[cfg(feature = "std")]
            HostMemory::Heap(m) => m.pointer(region),
            #[cfg(all(feature = "std", target_os = "linux"))]
            HostMemory::Mapped(m) => m.pointer(region),
            #[cfg(feature = "cuda-uma")]
            HostMemory::Cuda(m) => m.pointer(region),
            #[allow(unreachable_patterns)]
            _ => {
                let _ = region;
                None
            }
        }
    }
}

impl RawMemory for HostMemory {
    fn alloc(&self, len: usize, align: usize) -> Result<Region, Error> {
        let r = match self {
            #[cfg(feature = "mock")]
            HostMemory::Arena(m) => m.alloc(len, align),
            #[cfg(feature = "std")]
            HostMemory::Heap(m) => m.alloc(len, align),
            #[cfg(all(feature = "std", target_os = "linux"))]
            HostMemory::Mapped(m) => m.alloc(len, align),
            #[cfg(feature = "cuda-uma")]
            HostMemory::Cuda(m) => m.alloc(len, align),
            #[allow(unreachable_patterns)]
            _ => Err(Error::OutOfMemory { len }),
        }?;
        // Guard the soundness of `host_bytes`: a host pool must never hold device memory.
        if !r.kind.host_visible() {
            let _ = self.free(r);
            return Err(Error::NotHostVisible(r.kind));
        }
        Ok(r)
    }

    fn free(&self, region: Region) -> Result<(), Error> {
        match self {
            #[cfg(feature = "mock")]
            HostMemory::Arena(m) => m.free(region),
            #[cfg(feature = "std")]
            HostMemory::Heap(m) => m.free(region),
            #[cfg(all(feature = "std", target_os = "linux"))]
            HostMemory::Mapped(m) => m.free(region),
            #[cfg(feature = "cuda-uma")]
            HostMemory::Cuda(m) => m.free(region),
            #[allow(unreachable_patterns)]
            _ => {
                let _ = region;
                Ok(())
            }
        }
    }

    fn host_visible(&self) -> bool {
        true
    }
}

/// Address space for a pool of `budget` bytes in one mapping: reserved, not
/// committed, until ranges of it are handed out. Twice the budget leaves
/// room to spare for most ways the pool's buffers can fall; a buffer that
/// finds none comes from the heap ([`crate::MappedMemory`]).
#[cfg(all(feature = "std", target_os = "linux"))]
fn pool_room(budget: usize) -> usize {
    budget.saturating_mul(2).max(4 << 20)
}

/// A slab pool of host-visible memory, optionally registered with a NIC,
/// ringing a [`HostBell`] when a buffer comes back after a refusal.
pub type HostPool<T> = SlabPool<Chunks<HostMemory, Nic>, T, HostBell>;

/// A pool whose buffers lie in [`HostMemory`]: a [`HostPool`], or a
/// [`LocalPool`] in front of one. What [`host_bytes`] needs to find a lease's bytes.
/// Sealed: `host_bytes`'s soundness rests on these two pools never handing out
/// overlapping buffers, so no other type may claim it.
pub trait HostBacked: Pool + sealed::Sealed {
    /// The memory every buffer of this pool is carved from.
    fn host_memory(&self) -> &HostMemory;
}

mod sealed {
    pub trait Sealed {}
}
impl<T: PoolTables> sealed::Sealed for HostPool<T> {}
impl<T: PoolTables, const M: usize> sealed::Sealed
    for LocalPool<'_, Chunks<HostMemory, Nic>, T, M, HostBell>
{
}

impl<T: PoolTables> HostBacked for HostPool<T> {
    fn host_memory(&self) -> &HostMemory {
        &self.source().memory
    }
}

impl<T: PoolTables, const M: usize> HostBacked
    for LocalPool<'_, Chunks<HostMemory, Nic>, T, M, HostBell>
{
    fn host_memory(&self) -> &HostMemory {
        &self.shared().source().memory
    }
}

fn view<P>(lease: &Lease<P>) -> (core::ptr::NonNull<u8>, usize)
where
    P: Deref,
    P::Target: HostBacked,
{
    let r = lease.region();
    let memory = lease.pool().host_memory();
    match memory.pointer(r) {
        Some(p) => (p, r.len),
        None => panic!("zerohop: a lease lies outside its pool's memory (pool invariant broken)"),
    }
}

/// Where a lease's bytes lie in a shared-memory file, when its pool's
/// memory is one (a shared [`HostMemory::Mapped`]): what a same-host peer
/// needs to read them out of its own mapping of the file.
#[cfg(all(feature = "std", target_os = "linux"))]
pub fn shared_place<P>(lease: &Lease<P>) -> Option<crate::mapped::SharedPlace>
where
    P: Deref,
    P::Target: HostBacked,
{
    match lease.pool().host_memory() {
        HostMemory::Mapped(m) => m.place(lease.region().addr, lease.region().len),
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

/// The message bytes of a lease from a [`HostPool`].
///
/// # Panics
/// Only if the pool's own invariant is broken (a lease outside the memory it
/// was carved from); the property tests and fuzzers check that it holds.
pub fn host_bytes<P>(lease: &Lease<P>) -> &[u8]
where
    P: Deref,
    P::Target: HostBacked,
{
    let (p, len) = view(lease);
    // SAFETY: `p..p+len` lies inside a live allocation of `HostMemory`, or
    // inside one mapping made up front (a shared file's or private), which
    // stays whole while it lives, in its accessible part, which never
    // shrinks (both checked by `pointer`): real, host-visible memory of this
    // process (device memory is refused at allocation). A process that may
    // fetch a shared file may as well write any memory of this one
    // (`process_vm_writev`): it is outside what this can promise. The
    // memory stays allocated while the lease lives: the
    // lease holds `P`, which keeps the pool alive (a `LocalPool` borrows its
    // shared pool, so that one lives too), and the pool gives memory
    // back only when it drops, or for a chunk or oversize buffer in which
    // no lease is left (an idle chunk reclaimed, an oversize buffer's one
    // lease released). The pool never hands out overlapping buffers, so
    // the only other view of these bytes comes through this same lease (a
    // `LocalPool` caches only released buffers), and
    // the shared borrow of `lease` excludes a mutable one.
    unsafe { core::slice::from_raw_parts(p.as_ptr(), len) }
}

/// The message bytes of a lease from a [`HostPool`], writable.
///
/// # Panics
/// As [`host_bytes`].
pub fn host_bytes_mut<P>(lease: &mut Lease<P>) -> &mut [u8]
where
    P: Deref,
    P::Target: HostBacked,
{
    let (p, len) = view(lease);
    // SAFETY: as in `host_bytes`; `&mut Lease` makes this the only view.
    unsafe { core::slice::from_raw_parts_mut(p.as_ptr(), len) }
}
