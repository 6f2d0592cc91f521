//! The host's pools and probe.

use std::sync::Arc;

use zerohop_backends::{HeapTables, HostBell, HostMemory, HostPool, Nic};
use zerohop_core::pool::Chunks;
use zerohop_core::{Error, Lease, PoolConfig, Probe};

/// The pool type std transports receive into, its tables on the heap.
pub type StdPool = HostPool<HeapTables>;

/// A buffer leased from a [`StdPool`].
pub type StdLease = Lease<Arc<StdPool>>;

/// Messages a peer's send queue holds at most, whatever their bytes: each
/// queued zero-copy send holds one of its pool's buffer descriptors, and a
/// sender of small leases that outruns its wire would otherwise hold them
/// all (every other lease then fails until they go out).
pub(crate) const QUEUED_MESSAGES: usize = 4096;

/// A pool of `budget` bytes of this process's private memory, with the
/// default size classes (fitted to a budget under one chunk: see
/// [`PoolConfig::fitted`]): one mapping reserved up front, so that a view of
/// a lease is a range check, not a lookup under a lock (every received
/// message is viewed at least once). Where no mapping can be made, the heap
/// ([`HostMemory::private`]).
pub fn private_pool(budget: usize) -> Result<Arc<StdPool>, Error> {
    pool_in(HostMemory::private(budget), budget)
}

/// A pool of `budget` bytes carved from `memory`, the default size classes
/// fitted to the budget, its tables on the heap.
fn pool_in(memory: HostMemory, budget: usize) -> Result<Arc<StdPool>, Error> {
    let source = Chunks::<HostMemory, Nic> {
        memory,
        registrar: None,
    };
    let config = PoolConfig::with_budget(budget).fitted();
    Ok(Arc::new(StdPool::with_bell(
        source,
        config,
        HeapTables::for_config(&config),
        HostBell::default(),
    )?))
}

/// A pool of `budget` bytes in one shared-memory file, for the shm wire: a
/// same-host peer reads a large message out of its own mapping of the file
/// instead of by the kernel's cross-memory copy (`zerohop_backends::MappedMemory`).
/// Where no such file can be made, a private pool.
pub fn shared_pool(budget: usize) -> Result<Arc<StdPool>, Error> {
    let memory = match HostMemory::shared(budget) {
        Ok(m) => m,
        Err(e) => {
            log::info!("zerohop: no shared-memory pool ({e}); a private pool instead");
            return private_pool(budget);
        }
    };
    pool_in(memory, budget)
}

/// A pool of `budget` bytes of CUDA memory on GPU 0, for the `uma` transport:
/// `managed` (a kernel reads received bytes in place) or pinned host memory.
#[cfg(feature = "cuda-uma")]
pub fn cuda_pool(budget: usize, managed: bool) -> Result<Arc<StdPool>, Error> {
    use zerohop_backends::cuda::{Gpu, HostCudaMemory};
    let gpu = Gpu::open(0)?;
    let memory = if managed {
        HostCudaMemory::managed(&gpu)
    } else {
        HostCudaMemory::pinned(&gpu)
    };
    pool_in(HostMemory::Cuda(memory), budget)
}

/// A managed-memory pool on GPU 0 (see [`cuda_pool`]).
#[cfg(feature = "cuda-uma")]
pub fn managed_pool(budget: usize) -> Result<Arc<StdPool>, Error> {
    cuda_pool(budget, true)
}

/// Probes every backend compiled into this binary. Never panics, whatever
/// the host lacks (no libcuda, no RDMA in the kernel).
pub fn probe_host() -> Probe {
    let mut probe = Probe::new();
    probe.set_compiled(zerohop_core::Kind::Shm);
    crate::shm::probe(&mut probe);
    #[cfg(feature = "mock")]
    probe.set_compiled(zerohop_core::Kind::Mock);
    #[cfg(feature = "cuda-uma")]
    {
        probe.set_compiled(zerohop_core::Kind::Uma);
        zerohop_backends::cuda::probe(&mut probe);
    }
    #[cfg(feature = "gpudirect-verbs")]
    {
        probe.set_compiled(zerohop_core::Kind::Rdma);
        probe.set_compiled(zerohop_core::Kind::Gpudirect);
        zerohop_backends::verbs::probe(&mut probe);
    }
    probe
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host pool of a few MiB: its budget held by two classes' chunks, a
    /// lease of a third class borrows a free buffer of a larger one
    /// (`borrow-larger`) rather than fail while that buffer sits idle.
    #[test]
    fn a_small_host_pool_serves_a_third_class_from_a_larger_ones_free_buffer() {
        let pool = private_pool(4 << 20).unwrap(); // two 2 MiB chunks
        let big = Lease::take(Arc::clone(&pool), 1 << 20).unwrap();
        let small = Lease::take(Arc::clone(&pool), 64).unwrap();
        let block = Lease::take(Arc::clone(&pool), 100 << 10).unwrap();
        assert_eq!(block.capacity(), 1 << 20, "the 1 MiB chunk's free buffer");
        drop((big, small, block));
        assert_eq!(pool.used_bytes(), 0);
    }
}
