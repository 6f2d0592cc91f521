//! What a verbs wire's payloads live in: host memory (kind `rdma`) or GPU
//! device memory (kind `gpudirect`). Frame headers always land in host memory,
//! where the CPU parses them; payloads go where the [`PayloadMemory`] says,
//! and the wire touches them only through its copies, so the same wire code
//! carries both kinds.

use std::sync::Arc;

use zerohop_core::pool::{ChunkSource, PoolTables, SlotTicket};
use zerohop_core::{Access, Error, Kind, Lease, Pool, PoolConfig, SizeClasses, SlabPool};

use super::Registry;
use crate::{host_bytes, host_bytes_mut, HeapTables, HostBell, HostMemory, HostPool, Nic};

/// A buffer of a [`PayloadMemory`]'s pool.
pub type PayloadLease<M> = Lease<Arc<<M as PayloadMemory>::Pool>>;

/// What the wire asks of a payload pool beside its leases: every payload
/// pool is a slab pool with a bell (see [`SlabPool`]).
pub trait PayloadPool: Pool + Send + Sync + 'static {
    /// The bell it rings when a buffer comes back after it refused one: a
    /// receiver whose ring a dry pool left short sleeps on it.
    fn bell(&self) -> &HostBell;

    /// Whether it could serve a lease of `len` bytes that it refuses now
    /// once every buffer but `kept` came back
    /// ([`SlabPool::could_serve_later`]).
    fn could_serve_later(&self, len: usize, kept: &[SlotTicket]) -> bool;
}

impl<S: ChunkSource, T: PoolTables> PayloadPool for SlabPool<S, T, HostBell>
where
    SlabPool<S, T, HostBell>: Pool + Send + Sync + 'static,
{
    fn bell(&self) -> &HostBell {
        SlabPool::bell(self)
    }

    fn could_serve_later(&self, len: usize, kept: &[SlotTicket]) -> bool {
        SlabPool::could_serve_later(self, len, kept)
    }
}

/// Where payloads live and how the wire moves bytes there.
pub trait PayloadMemory: Send + Sync + 'static {
    /// The registered slab pool payload buffers come from.
    type Pool: PayloadPool;

    /// Whether the CPU can read the pool's buffers (host memory): only then
    /// may a frame from them go inline, copied by the CPU at posting.
    const HOST_VISIBLE: bool;

    /// The transport kind this memory makes: `rdma` or `gpudirect`.
    fn kind(&self) -> Kind;

    /// A pool of at most `budget` bytes in buffers of `classes`, every chunk
    /// registered once on `registry` with `access`.
    fn pool(
        &self,
        registry: &Registry,
        budget: usize,
        access: Access,
        classes: SizeClasses,
    ) -> Result<Arc<Self::Pool>, Error>;

    /// The message bytes where the CPU reads them in place: `Some` exactly
    /// when [`HOST_VISIBLE`](Self::HOST_VISIBLE).
    fn host_view<'a>(&self, lease: &'a PayloadLease<Self>) -> Option<&'a [u8]>
    where
        Self: Sized;

    /// Copies host bytes `src` into `dst` from byte `at` (a send of a caller's bytes).
    fn write(&self, dst: &mut PayloadLease<Self>, at: usize, src: &[u8]) -> Result<(), Error>
    where
        Self: Sized;

    /// Copies `len` bytes of `src` from byte `from` into `dst` from byte `at`
    /// (reassembling a message from its fragments, fragmenting a lease).
    fn copy(
        &self,
        dst: &mut PayloadLease<Self>,
        at: usize,
        src: &PayloadLease<Self>,
        from: usize,
        len: usize,
    ) -> Result<(), Error>
    where
        Self: Sized;

    /// Copies the start of `src` into `out` (small control messages, tests).
    fn read(&self, src: &PayloadLease<Self>, out: &mut [u8]) -> Result<(), Error>
    where
        Self: Sized;
}

fn span_check(at: usize, len: usize, cap: usize) -> Result<(), Error> {
    match at.checked_add(len) {
        Some(end) if end <= cap => Ok(()),
        _ => Err(Error::TooLarge {
            len: at.saturating_add(len),
            max: cap,
        }),
    }
}

/// Private host memory registered with `ibv_reg_mr`: the `rdma` kind.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostPayload;

impl PayloadMemory for HostPayload {
    type Pool = HostPool<HeapTables>;
    const HOST_VISIBLE: bool = true;

    fn kind(&self) -> Kind {
        Kind::Rdma
    }

    fn pool(
        &self,
        registry: &Registry,
        budget: usize,
        access: Access,
        classes: SizeClasses,
    ) -> Result<Arc<Self::Pool>, Error> {
        let source = zerohop_core::pool::Chunks {
            memory: HostMemory::private(budget),
            registrar: Some(Nic::Verbs(registry.clone())),
        };
        let mut config = PoolConfig::with_budget(budget);
        config.access = access;
        config.classes = classes;
        let config = config.fitted();
        Ok(Arc::new(HostPool::with_bell(
            source,
            config,
            HeapTables::for_config(&config),
            HostBell::default(),
        )?))
    }

    fn host_view<'a>(&self, lease: &'a PayloadLease<Self>) -> Option<&'a [u8]> {
        Some(host_bytes(lease))
    }

    fn write(&self, dst: &mut PayloadLease<Self>, at: usize, src: &[u8]) -> Result<(), Error> {
        let d = host_bytes_mut(dst);
        span_check(at, src.len(), d.len())?;
        d[at..at + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn copy(
        &self,
        dst: &mut PayloadLease<Self>,
        at: usize,
        src: &PayloadLease<Self>,
        from: usize,
        len: usize,
    ) -> Result<(), Error> {
        let s = host_bytes(src);
        span_check(from, len, s.len())?;
        self.write(dst, at, &s[from..from + len])
    }

    fn read(&self, src: &PayloadLease<Self>, out: &mut [u8]) -> Result<(), Error> {
        let s = host_bytes(src);
        span_check(0, out.len(), s.len())?;
        out.copy_from_slice(&s[..out.len()]);
        Ok(())
    }
}

#[cfg(feature = "cuda-uma")]
pub use self::gpu::{GpuChunks, GpuPayload, GpuPool};

#[cfg(feature = "cuda-uma")]
mod gpu {
    use std::os::fd::AsFd;
    use std::sync::Arc;

    use zerohop_core::pool::{ChunkSource, Registered};
    use zerohop_core::{
        Access, Error, Kind, PoolConfig, RawMemory, Region, Registrar, SizeClasses, SlabPool,
    };

    use super::{span_check, PayloadLease, PayloadMemory};
    use crate::cuda::{DeviceMemory, DmaBuf, Gpu};
    use crate::verbs::Registry;
    use crate::{HeapTables, HostBell};

    /// A pool of GPU device memory registered with the NIC, with the host
    /// pool's bell: a receiver whose ring it left short sleeps on it.
    pub type GpuPool = SlabPool<GpuChunks, HeapTables, HostBell>;

    /// GPU memory chunks, each registered once with the NIC: exported as a
    /// DMA-buf and registered with `ibv_reg_dmabuf_mr` (iova = the device
    /// address), or, where the NIC or driver cannot, by device pointer through
    /// peermem; a host with neither gets the registration's typed error.
    #[derive(Debug)]
    pub struct GpuChunks {
        memory: DeviceMemory,
        registry: Registry,
    }

    impl GpuChunks {
        /// Chunks of `gpu`'s memory registered on `registry`.
        pub fn new(gpu: &Gpu, registry: Registry) -> Self {
            GpuChunks {
                memory: DeviceMemory::new(gpu),
                registry,
            }
        }

        /// The device memory source (copies in and out go through it).
        pub fn memory(&self) -> &DeviceMemory {
            &self.memory
        }

        fn register(
            &self,
            region: Region,
            access: Access,
        ) -> Result<zerohop_core::MrHandle, Error> {
            let via_dmabuf = if self.registry.device().dmabuf_supported().is_ok() {
                // The descriptor can close once registered: the MR holds its own reference.
                DmaBuf::export(self.memory.gpu(), region)
                    .map_err(Error::from)
                    .and_then(|buf| {
                        self.registry
                            .register_dmabuf(buf.as_fd(), 0, region, access)
                    })
            } else {
                Err(Error::Backend("the NIC does not register DMA-bufs"))
            };
            via_dmabuf.or_else(|e| {
                self.registry
                    .register_device_peermem(region, access)
                    .map_err(|_| e)
            })
        }
    }

    impl ChunkSource for GpuChunks {
        fn obtain(&self, len: usize, align: usize, access: Access) -> Result<Registered, Error> {
            let region = self.memory.alloc(len, align)?;
            match self.register(region, access) {
                Ok(mr) => Ok(Registered {
                    region,
                    mr: Some(mr),
                }),
                Err(e) => {
                    let _ = self.memory.free(region);
                    Err(e)
                }
            }
        }

        fn give_back(&self, chunk: Registered) {
            if let Some(mr) = chunk.mr {
                if self.registry.deregister(mr).is_err() {
                    warn!("gpudirect: deregistering a chunk failed; freeing it anyway");
                }
            }
            if self.memory.free(chunk.region).is_err() {
                warn!("gpudirect: freeing a chunk failed");
            }
        }
    }

    /// GPU device memory on the wire: the `gpudirect` kind.
    #[derive(Clone, Debug)]
    pub struct GpuPayload {
        gpu: Gpu,
    }

    impl GpuPayload {
        /// Payloads in `gpu`'s memory.
        pub fn new(gpu: Gpu) -> Self {
            GpuPayload { gpu }
        }
    }

    /// Where a lease's message may lie: from its start to its buffer's end.
    fn room(l: &PayloadLease<GpuPayload>) -> Region {
        Region {
            addr: l.device_ptr(),
            len: l.capacity(),
            kind: l.buffer().kind,
        }
    }

    fn device(l: &PayloadLease<GpuPayload>) -> &DeviceMemory {
        l.pool().source().memory()
    }

    impl PayloadMemory for GpuPayload {
        type Pool = GpuPool;
        const HOST_VISIBLE: bool = false;

        fn kind(&self) -> Kind {
            Kind::Gpudirect
        }

        fn pool(
            &self,
            registry: &Registry,
            budget: usize,
            access: Access,
            classes: SizeClasses,
        ) -> Result<Arc<GpuPool>, Error> {
            let mut config = PoolConfig::with_budget(budget);
            config.access = access;
            config.classes = classes;
            // DMA-buf export wants host-page-aligned ranges; chunks are 2 MiB.
            config.chunk_align = config.chunk_align.max(4096);
            let config = config.fitted();
            Ok(Arc::new(SlabPool::with_bell(
                GpuChunks::new(&self.gpu, registry.clone()),
                config,
                HeapTables::for_config(&config),
                HostBell::default(),
            )?))
        }

        fn host_view<'a>(&self, _: &'a PayloadLease<Self>) -> Option<&'a [u8]> {
            None
        }

        fn write(&self, dst: &mut PayloadLease<Self>, at: usize, src: &[u8]) -> Result<(), Error> {
            let b = room(dst);
            span_check(at, src.len(), b.len)?;
            let to = Region {
                addr: b.addr + at as u64,
                len: src.len(),
                kind: b.kind,
            };
            device(dst).copy_from_host(to, src).map_err(Error::from)
        }

        fn copy(
            &self,
            dst: &mut PayloadLease<Self>,
            at: usize,
            src: &PayloadLease<Self>,
            from: usize,
            len: usize,
        ) -> Result<(), Error> {
            let (d, s) = (room(dst), room(src));
            span_check(at, len, d.len)?;
            span_check(from, len, s.len)?;
            let to = Region {
                addr: d.addr + at as u64,
                len,
                kind: d.kind,
            };
            let from = Region {
                addr: s.addr + from as u64,
                len,
                kind: s.kind,
            };
            device(dst)
                .copy_from_device(to, device(src), from, len)
                .map_err(Error::from)
        }

        fn read(&self, src: &PayloadLease<Self>, out: &mut [u8]) -> Result<(), Error> {
            let s = room(src);
            span_check(0, out.len(), s.len)?;
            device(src)
                .copy_to_host(
                    Region {
                        len: out.len(),
                        ..s
                    },
                    out,
                )
                .map_err(Error::from)
        }
    }
}
