//! The cuda-uma backend: CUDA memory through cudarc, libcuda loaded at run time.
//!
//! Every entry point first asks whether libcuda can be loaded at all
//! ([`driver_present`]): cudarc panics on its first call when it cannot, and
//! a host without an NVIDIA driver must get a typed [`CudaError`] instead.
//!
//! - [`Gpu`]: a device and its primary context, made current on whichever
//!   thread allocates (the progress thread included).
//! - [`HostCudaMemory`]: managed (`cuMemAllocManaged`) or pinned host
//!   (`cuMemHostAlloc`) memory: host-visible, so it can back a receive pool.
//! - [`DeviceMemory`]: `cuMemAlloc` memory, never host-visible.
//! - [`DmaBuf`]: device memory exported for a NIC (`cuMemGetHandleForAddressRange`).
//! - [`Checksum`]: a GPU kernel (embedded PTX) that checksums bytes in place.
//! - [`IpcCache`]: peers' device memory mapped by CUDA IPC, for copies
//!   device to device between processes of one host.

mod checksum;
mod dmabuf;
mod ipc;
mod memory;

use std::fmt;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUdevice_attribute};
use cudarc::driver::{result, CudaContext, DriverError};
use zerohop_core::{Prereq, Probe};

pub use checksum::{cpu_checksum, Checksum};
pub use dmabuf::DmaBuf;
pub use ipc::{CopyQueue, IpcCache, IpcError, IpcHandle, IpcMapping, IpcRegion};
pub use memory::{DeviceMemory, HostCudaMemory};

/// A pool of GPU device memory registered with no NIC: what same-host peers
/// send from and receive into, by CUDA IPC (each chunk exported once, on
/// its first message: [`DeviceMemory::export`]). Its bell rings when a
/// buffer comes back after it refused one: a lane stopped for a device
/// buffer sleeps on it.
pub type DevicePool = zerohop_core::SlabPool<
    zerohop_core::pool::Chunks<DeviceMemory, crate::Nic>,
    crate::HeapTables,
    crate::HostBell,
>;

/// A buffer of a [`DevicePool`]: device memory, read by a kernel through
/// its `device_ptr()`, never as `&[u8]`.
pub type DeviceLease = zerohop_core::Lease<Arc<DevicePool>>;

/// The size classes of a [`device_pool`]: GPU payloads are large, and
/// every buffer of a kept chunk keeps its IPC export and the peer's
/// mapping of it (a fresh allocation per message would cost an export and
/// a peer's `cuIpcOpenMemHandle` each).
pub const DEVICE_CLASSES: zerohop_core::SizeClasses = match zerohop_core::SizeClasses::new(&[
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
    64 << 20,
    256 << 20,
]) {
    Ok(c) => c,
    Err(_) => panic!("ascending classes"),
};

/// A device-memory pool of at most `budget` bytes on `gpu`: classes of
/// 64 KiB to 256 MiB ([`DEVICE_CLASSES`]) carved from 256 MiB chunks (fitted
/// to a smaller budget), larger messages in oversize buffers.
pub fn device_pool(gpu: &Gpu, budget: usize) -> Result<Arc<DevicePool>, zerohop_core::Error> {
    let source = zerohop_core::pool::Chunks::<DeviceMemory, crate::Nic> {
        memory: DeviceMemory::new(gpu),
        registrar: None,
    };
    let mut config = zerohop_core::PoolConfig::with_budget(budget);
    config.classes = DEVICE_CLASSES;
    config.chunk_bytes = 256 << 20;
    config.chunk_align = 2 << 20;
    let config = config.fitted();
    Ok(Arc::new(DevicePool::with_bell(
        source,
        config,
        crate::HeapTables::for_config(&config),
        crate::HostBell::default(),
    )?))
}

/// The device memory a lease of a [`DevicePool`] lies in (its copies and
/// exports go through it).
pub fn lease_memory(lease: &DeviceLease) -> &DeviceMemory {
    &lease.pool().source().memory
}

/// Where a device lease's message lies: its address and length.
pub fn lease_region(lease: &DeviceLease) -> zerohop_core::Region {
    zerohop_core::Region {
        addr: lease.device_ptr(),
        len: lease.len(),
        kind: zerohop_core::MemKind::Device,
    }
}

/// The first `len` bytes of a device lease's message; `TooLarge` past it.
fn lease_prefix(
    lease: &DeviceLease,
    len: usize,
) -> Result<zerohop_core::Region, zerohop_core::Error> {
    let region = lease_region(lease);
    if len > region.len {
        return Err(zerohop_core::Error::TooLarge {
            len,
            max: region.len,
        });
    }
    Ok(zerohop_core::Region { len, ..region })
}

/// Copies the start of a device lease's message into `out` (the way to read
/// GPU memory from the host).
pub fn read_lease(lease: &DeviceLease, out: &mut [u8]) -> Result<(), zerohop_core::Error> {
    let region = lease_prefix(lease, out.len())?;
    Ok(lease_memory(lease).copy_to_host(region, out)?)
}

/// Copies `src` into the start of a device lease's message and waits until
/// the bytes are there (the way to fill GPU memory from the host).
pub fn write_lease(lease: &DeviceLease, src: &[u8]) -> Result<(), zerohop_core::Error> {
    let region = lease_prefix(lease, src.len())?;
    Ok(lease_memory(lease).copy_from_host(region, src)?)
}

/// What can go wrong talking to CUDA.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CudaError {
    /// libcuda.so cannot be loaded: no NVIDIA driver on this host.
    NoDriver,
    /// The driver loaded but reports no device (or not the one asked for).
    NoDevice {
        /// Devices present.
        count: i32,
        /// The one asked for.
        ordinal: usize,
    },
    /// A driver call failed.
    Driver {
        /// The call.
        call: &'static str,
        /// The driver's answer (e.g. `CUDA_ERROR_INVALID_VALUE`).
        result: sys::CUresult,
    },
    /// Only device memory can be exported as a DMA-buf; the driver refused this kind.
    NotDeviceMemory {
        /// The kind asked for.
        kind: zerohop_core::MemKind,
        /// What the driver answered when asked anyway.
        result: sys::CUresult,
    },
    /// A DMA-buf export must start and end on host page boundaries.
    Unaligned {
        /// Start.
        addr: u64,
        /// Length.
        len: usize,
    },
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaError::NoDriver => f.write_str("libcuda.so cannot be loaded (no NVIDIA driver on this host)"),
            CudaError::NoDevice { count, ordinal } => write!(f, "no CUDA device {ordinal} ({count} present)"),
            CudaError::Driver { call, result } => write!(f, "{call} failed: {result:?}"),
            CudaError::NotDeviceMemory { kind, result } => write!(
                f,
                "only device memory (cuMemAlloc) exports as a DMA-buf; {} memory was refused by the driver ({result:?}), so a NIC cannot register it",
                kind.name()
            ),
            CudaError::Unaligned { addr, len } => write!(f, "DMA-buf export of [{addr:#x}, +{len}) is not host-page aligned"),
        }
    }
}

impl std::error::Error for CudaError {}

impl From<CudaError> for zerohop_core::Error {
    fn from(e: CudaError) -> Self {
        use zerohop_core::Error;
        match e {
            CudaError::Driver { call, result } => Error::Call {
                call,
                code: result as i32,
            },
            CudaError::NoDriver => Error::Backend("CUDA: no driver"),
            CudaError::NoDevice { .. } => Error::Backend("CUDA: no device"),
            CudaError::NotDeviceMemory { .. } => Error::Backend("CUDA: not device memory"),
            CudaError::Unaligned { .. } => Error::Backend("CUDA: unaligned DMA-buf range"),
        }
    }
}

fn driver(call: &'static str) -> impl Fn(DriverError) -> CudaError {
    move |e| CudaError::Driver { call, result: e.0 }
}

/// Whether libcuda can be loaded. Safe to call anywhere: it only tries `dlopen`.
pub fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only attempts to dlopen the candidate library
    // names and drops what it opened; it calls nothing inside the library.
    unsafe { sys::is_culib_present() }
}

/// A CUDA device with its primary context.
#[derive(Debug, Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
}

impl Gpu {
    /// Opens device `ordinal`. Never panics: no driver is `NoDriver`.
    pub fn open(ordinal: usize) -> Result<Gpu, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        result::init().map_err(driver("cuInit"))?;
        let count = result::device::get_count().map_err(driver("cuDeviceGetCount"))?;
        if ordinal >= count.max(0) as usize {
            return Err(CudaError::NoDevice { count, ordinal });
        }
        let ctx = CudaContext::new(ordinal).map_err(driver("cuDevicePrimaryCtxRetain"))?;
        Ok(Gpu { ctx })
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))
    }

    /// The cudarc context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device name.
    pub fn name(&self) -> Result<String, CudaError> {
        result::device::get_name(self.ctx.cu_device()).map_err(driver("cuDeviceGetName"))
    }

    /// A device attribute.
    pub fn attribute(&self, attr: CUdevice_attribute) -> Result<i32, CudaError> {
        // SAFETY: `cu_device` is a device handle cudarc obtained from cuDeviceGet.
        unsafe { result::device::get_attribute(self.ctx.cu_device(), attr) }
            .map_err(driver("cuDeviceGetAttribute"))
    }

    /// Free and total device memory, bytes.
    pub fn memory_info(&self) -> Result<(usize, usize), CudaError> {
        self.bind()?;
        result::mem_get_info().map_err(driver("cuMemGetInfo"))
    }

    /// Waits for all work on this context.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: the context is current on this thread (bound just above).
        unsafe { sys::cuCtxSynchronize() }
            .result()
            .map_err(driver("cuCtxSynchronize"))
    }
}

fn driver_version() -> Option<i32> {
    let mut v = 0;
    // SAFETY: a valid out-pointer; only called once the library is known to load.
    unsafe { sys::cuDriverGetVersion(&mut v) }
        .result()
        .ok()
        .map(|_| v)
}

/// Fills `cuda-driver`, `cuda-device` and `gpu-dmabuf` of `probe`. Never panics.
pub fn probe(probe: &mut Probe) {
    if !driver_present() {
        let why = "libcuda.so cannot be loaded (no NVIDIA driver)";
        probe.missing(Prereq::CudaDriver, why);
        probe.missing(Prereq::CudaDevice, "no CUDA driver");
        probe.missing(Prereq::GpuDmabuf, "no CUDA driver");
        return;
    }
    if let Err(e) = result::init() {
        let why = format!("cuInit failed: {:?}", e.0);
        probe.missing(Prereq::CudaDriver, &why);
        probe.missing(Prereq::CudaDevice, "cuInit failed");
        probe.missing(Prereq::GpuDmabuf, "cuInit failed");
        return;
    }
    let v = driver_version().unwrap_or(0);
    probe.present(
        Prereq::CudaDriver,
        &format!("libcuda loaded, CUDA {}.{}", v / 1000, (v % 1000) / 10),
    );
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            probe.missing(Prereq::CudaDevice, &e.to_string());
            probe.missing(Prereq::GpuDmabuf, "no CUDA device");
            return;
        }
    };
    let attr = |a| gpu.attribute(a).unwrap_or(0);
    let (major, minor) = (
        attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
        attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
    );
    let managed = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY) == 1;
    let concurrent = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS) == 1;
    let name = gpu.name().unwrap_or_else(|_| "unknown GPU".into());
    let detail = format!(
        "{name} (sm_{major}{minor}), managed {}, concurrent managed access {}",
        yes(managed),
        yes(concurrent)
    );
    if managed {
        probe.present(Prereq::CudaDevice, &detail);
    } else {
        probe.missing(Prereq::CudaDevice, &format!("{detail}: no managed memory"));
    }
    let dmabuf = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) == 1;
    let rdma = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED) == 1;
    match (dmabuf, rdma) {
        (true, true) => probe.present(
            Prereq::GpuDmabuf,
            "DMA_BUF_SUPPORTED = 1, GPU_DIRECT_RDMA_SUPPORTED = 1",
        ),
        _ => probe.missing(
            Prereq::GpuDmabuf,
            &format!(
                "DMA_BUF_SUPPORTED = {}, GPU_DIRECT_RDMA_SUPPORTED = {}",
                u8::from(dmabuf),
                u8::from(rdma)
            ),
        ),
    }
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}
