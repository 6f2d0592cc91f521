//! The host's pools and probe, and the transport choice from the environment.

use std::sync::{Arc, Once};

use zerohop_backends::{HeapMemory, HeapTables, HostMemory, HostPool, Nic};
use zerohop_core::{pick, Choice, Chunks, Error, Lease, PickError, PoolConfig, Probe};

use crate::config::{Config, ConfigError};

/// The pool type std transports receive into, its tables on the heap.
pub type StdPool = HostPool<HeapTables>;

/// A buffer leased from a [`StdPool`].
pub type StdLease = Lease<Arc<StdPool>>;

/// A heap-backed pool of `budget` bytes with the default size classes
/// (fitted to a budget under one chunk: see [`PoolConfig::fitted`]).
pub fn heap_pool(budget: usize) -> Result<Arc<StdPool>, Error> {
    let source = Chunks::<HostMemory, Nic> {
        memory: HostMemory::Heap(HeapMemory::new()),
        registrar: None,
    };
    Ok(Arc::new(StdPool::new(
        source,
        PoolConfig::with_budget(budget).fitted(),
        HeapTables::for_budget(budget),
    )?))
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
    let source = Chunks::<HostMemory, Nic> {
        memory: HostMemory::Cuda(memory),
        registrar: None,
    };
    Ok(Arc::new(StdPool::new(
        source,
        PoolConfig::with_budget(budget).fitted(),
        HeapTables::for_budget(budget),
    )?))
}

/// A managed-memory pool on GPU 0 (see [`cuda_pool`]).
#[cfg(feature = "cuda-uma")]
pub fn managed_pool(budget: usize) -> Result<Arc<StdPool>, Error> {
    cuda_pool(budget, true)
}

/// Probes every backend compiled into this binary. Never panics, whatever
/// the host lacks (no libcuda, no RDMA in the kernel).
pub fn probe_host() -> Probe {
    #[allow(unused_mut)]
    let mut probe = Probe::new();
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

/// Why `pick_from_env` failed.
#[derive(Debug)]
pub enum PickFromEnvError {
    /// The environment was malformed.
    Config(ConfigError),
    /// The transport asked for cannot run here.
    Pick(PickError),
}

impl std::fmt::Display for PickFromEnvError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PickFromEnvError::Config(e) => e.fmt(f),
            PickFromEnvError::Pick(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for PickFromEnvError {}

/// Reads [`Config::from_env`], probes the host, and picks. The reason each
/// faster transport was skipped is logged once per process at info level.
pub fn pick_from_env() -> Result<(Choice, Probe, Config), PickFromEnvError> {
    let config = Config::from_env().map_err(PickFromEnvError::Config)?;
    let probe = probe_host();
    let choice = pick(config.transport, &probe).map_err(PickFromEnvError::Pick)?;
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for s in choice.skipped() {
            log::info!("zerohop: skipped {s}");
        }
        log::info!("zerohop: using {}", choice.kind);
    });
    Ok((choice, probe, config))
}
