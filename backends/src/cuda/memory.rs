//! CUDA memory as zerohop `RawMemory`: managed, pinned host, and device.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard};

use cudarc::driver::result;
use cudarc::driver::sys::{self, CUmemAttach_flags, CUmemLocationType};
use zerohop_core::{Error, MemKind, RawMemory, Region};

use super::{driver, CudaError, Gpu};

/// One CUDA allocation: `base` as the driver returned it, `total` bytes; the
/// region handed out starts at the first address aligned as asked.
#[derive(Debug, Clone, Copy)]
pub(super) struct Allocation {
    pub(super) base: u64,
    total: usize,
}

#[derive(Debug, Default)]
pub(super) struct Live(Mutex<BTreeMap<u64, Allocation>>);

impl Live {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<u64, Allocation>> {
        // Each update is a single insert or remove: a poisoned map is still consistent.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The allocation containing `region`, as (region start, allocation).
    pub(super) fn containing(&self, region: Region) -> Option<(u64, Allocation)> {
        let live = self.lock();
        let (&start, a) = live.range(..=region.addr).next_back()?;
        let end = a.base + a.total as u64;
        (region.end()? <= end).then_some((start, *a))
    }
}

/// Allocates `len` bytes aligned to `align` with `raw`, retrying with padding
/// when the driver's own alignment falls short; returns (aligned, allocation).
fn aligned(
    len: usize,
    align: usize,
    raw: impl Fn(usize) -> Result<u64, CudaError>,
    free: impl Fn(u64),
) -> Result<(u64, Allocation), CudaError> {
    let base = raw(len)?;
    if base % align as u64 == 0 {
        return Ok((base, Allocation { base, total: len }));
    }
    free(base);
    let total = len + align;
    let base = raw(total)?;
    Ok((
        base.next_multiple_of(align as u64),
        Allocation { base, total },
    ))
}

/// CUDA memory the CPU can read: managed (unified) or pinned host.
#[derive(Debug)]
pub struct HostCudaMemory {
    gpu: Gpu,
    kind: MemKind,
    live: Live,
}

impl HostCudaMemory {
    /// What it allocates: managed or pinned host memory.
    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// `cuMemAllocManaged` memory (attached globally): bytes a kernel reads in place.
    pub fn managed(gpu: &Gpu) -> Self {
        HostCudaMemory {
            gpu: gpu.clone(),
            kind: MemKind::Managed,
            live: Live::default(),
        }
    }

    /// `cuMemHostAlloc` page-locked memory (portable): DMA-able host memory.
    pub fn pinned(gpu: &Gpu) -> Self {
        HostCudaMemory {
            gpu: gpu.clone(),
            kind: MemKind::HostPinned,
            live: Live::default(),
        }
    }

    /// The GPU this memory belongs to.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// A host pointer to `region`, if it lies inside one live allocation.
    pub fn pointer(&self, region: Region) -> Option<NonNull<u8>> {
        self.live.containing(region)?;
        // The driver hands out addresses as integers: managed and pinned memory
        // are mapped at the same address on the host (unified addressing).
        NonNull::new(std::ptr::with_exposed_provenance_mut::<u8>(
            region.addr as usize,
        ))
    }

    /// Migrates managed memory to the GPU (`to_device`) or to the host before
    /// it is read there, and waits. A no-op for pinned memory.
    pub fn prefetch(&self, region: Region, to_device: bool) -> Result<(), CudaError> {
        if self.kind != MemKind::Managed {
            return Ok(());
        }
        let (_, a) = self.live.containing(region).ok_or(CudaError::Driver {
            call: "cuMemPrefetchAsync",
            result: sys::CUresult::CUDA_ERROR_INVALID_VALUE,
        })?;
        self.gpu.bind()?;
        let location = sys::CUmemLocation {
            type_: if to_device {
                CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE
            } else {
                CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST
            },
            id: if to_device {
                self.gpu.context().ordinal() as i32
            } else {
                0
            },
        };
        // SAFETY: [a.base, a.base + a.total) is one live managed allocation of
        // this process (checked above); stream 0 is the context's null stream.
        unsafe { result::mem_prefetch_async(a.base, a.total, location, std::ptr::null_mut()) }
            .map_err(driver("cuMemPrefetchAsync"))?;
        self.gpu.synchronize()
    }

    fn raw_alloc(&self, len: usize) -> Result<u64, CudaError> {
        match self.kind {
            MemKind::Managed => {
                // SAFETY: a plain allocation on the current context; the memory
                // is only read after the caller writes it.
                unsafe { result::malloc_managed(len, CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL) }
                    .map_err(driver("cuMemAllocManaged"))
            }
            _ => {
                // SAFETY: a plain allocation, as above. Flag 1 = CU_MEMHOSTALLOC_PORTABLE (pinned for every context).
                let p = unsafe { result::malloc_host(len, 1) }.map_err(driver("cuMemHostAlloc"))?;
                Ok(p.addr() as u64)
            }
        }
    }

    fn raw_free(&self, base: u64) {
        let r = match self.kind {
            // SAFETY: `base` came from cuMemAllocManaged and is freed once (it
            // was just removed from the live map, or never entered it).
            MemKind::Managed => unsafe { result::free_sync(base) },
            // SAFETY: `base` came from cuMemHostAlloc and is freed once (as above).
            _ => unsafe {
                result::free_host(std::ptr::with_exposed_provenance_mut::<c_void>(
                    base as usize,
                ))
            },
        };
        if let Err(e) = r {
            log_free_failure(e.0);
        }
    }
}

fn log_free_failure(r: sys::CUresult) {
    #[cfg(feature = "log")]
    log::warn!("CUDA free failed: {r:?}");
    let _ = r;
}

impl RawMemory for HostCudaMemory {
    fn alloc(&self, len: usize, align: usize) -> Result<Region, Error> {
        self.gpu.bind()?;
        let (addr, a) = aligned(len, align, |n| self.raw_alloc(n), |b| self.raw_free(b))?;
        self.live.lock().insert(addr, a);
        Ok(Region {
            addr,
            len,
            kind: self.kind,
        })
    }

    fn free(&self, region: Region) -> Result<(), Error> {
        let a = self
            .live
            .lock()
            .remove(&region.addr)
            .ok_or(Error::Backend("CUDA free of memory not allocated here"))?;
        self.gpu.bind()?;
        self.raw_free(a.base);
        Ok(())
    }

    fn host_visible(&self) -> bool {
        true
    }
}

impl Drop for HostCudaMemory {
    fn drop(&mut self) {
        let live = std::mem::take(&mut *self.live.lock());
        if !live.is_empty() && self.gpu.bind().is_ok() {
            for a in live.into_values() {
                self.raw_free(a.base);
            }
        }
    }
}

/// `cuMemAlloc` device memory. Not host-visible: there is no way to get a
/// `&[u8]` over it; copy with [`DeviceMemory::copy_to_host`] or hand its
/// address to a kernel or a NIC (through a [`DmaBuf`](super::DmaBuf)).
#[derive(Debug)]
pub struct DeviceMemory {
    pub(super) gpu: Gpu,
    pub(super) live: Live,
    /// CUDA IPC handles of allocations exported so far (by base).
    pub(super) exports: Mutex<BTreeMap<u64, super::IpcHandle>>,
}

impl DeviceMemory {
    /// Device memory of `gpu`.
    pub fn new(gpu: &Gpu) -> Self {
        DeviceMemory {
            gpu: gpu.clone(),
            live: Live::default(),
            exports: Mutex::default(),
        }
    }

    /// The GPU.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    pub(super) fn check(&self, region: Region, len: usize) -> Result<(), CudaError> {
        if region.len < len || self.live.containing(region).is_none() {
            return Err(CudaError::Driver {
                call: "cuMemcpy",
                result: sys::CUresult::CUDA_ERROR_INVALID_VALUE,
            });
        }
        Ok(())
    }

    /// Copies `src` into the start of `region` (synchronously).
    pub fn copy_from_host(&self, region: Region, src: &[u8]) -> Result<(), CudaError> {
        self.check(region, src.len())?;
        self.gpu.bind()?;
        // SAFETY: the destination range lies inside a live allocation of ours (checked).
        unsafe { result::memcpy_htod_sync(region.addr, src) }.map_err(driver("cuMemcpyHtoD"))?;
        // From pageable memory the call may return once the bytes are
        // staged, before they land: a peer process or a NIC reading the
        // buffer next is ordered by nothing else.
        self.gpu.synchronize()
    }

    /// Copies `len` bytes from the start of `src` (device memory of
    /// `src_memory`, this source or another) to the start of `dst` (ours),
    /// synchronously, on the device.
    pub fn copy_from_device(
        &self,
        dst: Region,
        src_memory: &DeviceMemory,
        src: Region,
        len: usize,
    ) -> Result<(), CudaError> {
        self.check(dst, len)?;
        src_memory.check(src, len)?;
        self.gpu.bind()?;
        // SAFETY: both ranges lie inside live device allocations (checked);
        // callers hand in two distinct leases, so the ranges do not overlap.
        unsafe { result::memcpy_dtod_sync(dst.addr, src.addr, len) }
            .map_err(driver("cuMemcpyDtoD"))?;
        // A device-to-device cuMemcpy does not wait for the copy.
        self.gpu.synchronize()
    }

    /// Copies the start of `region` into `dst` (synchronously).
    pub fn copy_to_host(&self, region: Region, dst: &mut [u8]) -> Result<(), CudaError> {
        self.check(region, dst.len())?;
        self.gpu.bind()?;
        // SAFETY: the source range lies inside a live allocation of ours (checked).
        unsafe { result::memcpy_dtoh_sync(dst, region.addr) }.map_err(driver("cuMemcpyDtoH"))
    }
}

impl RawMemory for DeviceMemory {
    fn alloc(&self, len: usize, align: usize) -> Result<Region, Error> {
        self.gpu.bind()?;
        let raw = |n| {
            // SAFETY: a plain allocation on the current context.
            unsafe { result::malloc_sync(n) }.map_err(driver("cuMemAlloc"))
        };
        let free = |b| {
            // SAFETY: `b` was just allocated by cuMemAlloc and is freed once.
            if let Err(e) = unsafe { result::free_sync(b) } {
                log_free_failure(e.0);
            }
        };
        let (addr, a) = aligned(len, align, raw, free)?;
        self.live.lock().insert(addr, a);
        Ok(Region {
            addr,
            len,
            kind: MemKind::Device,
        })
    }

    fn free(&self, region: Region) -> Result<(), Error> {
        let a = self
            .live
            .lock()
            .remove(&region.addr)
            .ok_or(Error::Backend("CUDA free of memory not allocated here"))?;
        self.exports
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&a.base);
        self.gpu.bind()?;
        // SAFETY: `a.base` came from cuMemAlloc and left the live map just now: freed once.
        unsafe { result::free_sync(a.base) }.map_err(driver("cuMemFree"))?;
        Ok(())
    }

    fn host_visible(&self) -> bool {
        false
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        let live = std::mem::take(&mut *self.live.lock());
        if !live.is_empty() && self.gpu.bind().is_ok() {
            for a in live.into_values() {
                // SAFETY: every entry is a live cuMemAlloc allocation, freed once here.
                if let Err(e) = unsafe { result::free_sync(a.base) } {
                    log_free_failure(e.0);
                }
            }
        }
    }
}
