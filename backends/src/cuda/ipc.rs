//! Device memory across processes of one host by CUDA IPC: a GPU payload
//! crosses from the sender's device memory to the receiver's without
//! touching host memory.
//!
//! The sender exports each allocation (a pool chunk) once
//! ([`DeviceMemory::export`]: `cuIpcGetMemHandle`, 64 bytes) and names a
//! message by that handle, an offset and a length. The receiver opens each
//! peer allocation once (`cuIpcOpenMemHandle`) into an [`IpcCache`] —
//! bounded, least recently used out first, every mapping of a peer closed
//! when the peer goes (the MR table's pattern) — and copies device to
//! device into its own buffer ([`DeviceMemory::copy_from_peer`]); the
//! sender's buffer goes back to its pool when the receiver says it is done.
//!
//! The peer is untrusted: a handle the driver refuses is a typed error, and
//! an offset and length are checked against the size the driver reports for
//! the mapping (`cuMemGetAddressRange`), never the size the peer claims.

use std::collections::HashMap;
use std::fmt;

use cudarc::driver::result;
use cudarc::driver::sys::{self, CUipcMem_flags};
use zerohop_core::Region;

use super::{CudaError, DeviceMemory, Gpu};

/// What another process on this host needs to map one device allocation.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcHandle(pub [u8; 64]);

impl fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IpcHandle(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "…)")
    }
}

/// A region of the sender's device memory as a peer names it: the
/// allocation's handle, the region's offset in it, its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcRegion {
    /// The allocation.
    pub handle: IpcHandle,
    /// Bytes from the allocation's start.
    pub offset: u64,
    /// Bytes.
    pub len: usize,
}

impl DeviceMemory {
    /// `region` (of a live allocation of ours) as a peer process maps it.
    /// The allocation is exported on its first use and its handle kept.
    pub fn export(&self, region: Region) -> Result<IpcRegion, CudaError> {
        let (_, a) = self.live.containing(region).ok_or(CudaError::Driver {
            call: "cuIpcGetMemHandle",
            result: sys::CUresult::CUDA_ERROR_INVALID_VALUE,
        })?;
        let mut exports = self.exports.lock().unwrap_or_else(|e| e.into_inner());
        let handle = match exports.get(&a.base) {
            Some(h) => *h,
            None => {
                self.gpu.bind()?;
                let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::uninit();
                // SAFETY: a valid out-pointer; `a.base` is the start of a live
                // cuMemAlloc allocation of this context.
                unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), a.base) }
                    .result()
                    .map_err(super::driver("cuIpcGetMemHandle"))?;
                // SAFETY: the call succeeded, so the driver wrote the handle.
                let h = unsafe { h.assume_init() };
                let h = IpcHandle(h.reserved.map(|c| c as u8));
                exports.insert(a.base, h);
                h
            }
        };
        Ok(IpcRegion {
            handle,
            offset: region.addr - a.base,
            len: region.len,
        })
    }

    /// Copies `len` bytes at device address `src` (a peer's mapped memory,
    /// from [`IpcCache::resolve`]) to the start of `dst` (ours), on the
    /// device, and waits for the copy.
    ///
    /// # Safety
    /// `[src, src + len)` must be device memory mapped in this process (an
    /// [`IpcCache`] entry that stays open until this call returns).
    pub unsafe fn copy_from_peer(
        &self,
        dst: Region,
        src: u64,
        len: usize,
    ) -> Result<(), CudaError> {
        self.check(dst, len)?;
        self.gpu.bind()?;
        // SAFETY: `dst` lies in a live allocation of ours (checked); the
        // caller guarantees the source range (this function's contract).
        unsafe { cudarc::driver::result::memcpy_dtod_sync(dst.addr, src, len) }
            .map_err(super::driver("cuMemcpyDtoD"))?;
        self.gpu.synchronize()
    }
}

/// A peer's device allocation mapped into this process; closed on drop.
#[derive(Debug)]
pub struct IpcMapping {
    gpu: Gpu,
    base: u64,
    len: usize,
}

impl IpcMapping {
    /// Maps the allocation `handle` names. A handle of no live allocation
    /// (forged, or its owner gone) is the driver's error, typed.
    pub fn open(gpu: &Gpu, handle: &IpcHandle) -> Result<IpcMapping, CudaError> {
        gpu.bind()?;
        let h = sys::CUipcMemHandle {
            reserved: handle.0.map(|b| b as core::ffi::c_char),
        };
        let mut ptr = 0;
        // SAFETY: a valid out-pointer and a handle passed by value; the
        // driver validates the handle itself.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(super::driver("cuIpcOpenMemHandle"))?;
        // Owned from here: closed on any error below.
        let mut mapping = IpcMapping {
            gpu: gpu.clone(),
            base: ptr,
            len: 0,
        };
        let (mut base, mut len) = (0, 0);
        // SAFETY: valid out-pointers; `ptr` was just mapped by the driver.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut len, ptr) }
            .result()
            .map_err(super::driver("cuMemGetAddressRange"))?;
        // The mapping's extent as the driver knows it: what bounds a peer's offsets.
        mapping.len = len.saturating_sub(ptr.saturating_sub(base) as usize);
        Ok(mapping)
    }

    /// The mapped allocation's device address in this process.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Its length in bytes, as the driver reports it.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never, for a live allocation).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: `base` was mapped by cuIpcOpenMemHandle and is closed once, here.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.base) };
        }
    }
}

/// A peer's region that cannot be read: the handle does not map, or the
/// range lies outside the mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IpcError {
    /// The driver refused the handle (or CUDA failed).
    Cuda(CudaError),
    /// `offset + len` past the mapping's `mapped` bytes.
    OutOfRange {
        /// Offset the peer named.
        offset: u64,
        /// Length it named.
        len: usize,
        /// Bytes the mapping has.
        mapped: usize,
    },
}

impl fmt::Display for IpcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IpcError::Cuda(e) => write!(f, "CUDA IPC: {e}"),
            IpcError::OutOfRange {
                offset,
                len,
                mapped,
            } => write!(
                f,
                "CUDA IPC: the peer named [{offset}, +{len}) of an allocation of {mapped} bytes"
            ),
        }
    }
}

impl std::error::Error for IpcError {}

impl From<CudaError> for IpcError {
    fn from(e: CudaError) -> Self {
        IpcError::Cuda(e)
    }
}

struct Entry {
    mapping: IpcMapping,
    used: u64,
}

/// Peers' allocations mapped into this process: each opened once, at most
/// `capacity` open (the least recently used closed first), all of a peer's
/// closed when it goes.
pub struct IpcCache {
    gpu: Gpu,
    capacity: usize,
    entries: HashMap<(u64, IpcHandle), Entry>,
    clock: u64,
    opened: u64,
    evicted: u64,
}

impl fmt::Debug for IpcCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcCache")
            .field("capacity", &self.capacity)
            .field("open", &self.entries.len())
            .field("opened", &self.opened)
            .field("evicted", &self.evicted)
            .finish()
    }
}

impl IpcCache {
    /// A cache of at most `capacity` (at least 1) mappings on `gpu`.
    pub fn new(gpu: &Gpu, capacity: usize) -> IpcCache {
        IpcCache {
            gpu: gpu.clone(),
            capacity: capacity.max(1),
            entries: HashMap::new(),
            clock: 0,
            opened: 0,
            evicted: 0,
        }
    }

    /// The device address in this process of `region` of `peer`'s memory,
    /// its allocation mapped on first use, the range checked against it.
    pub fn resolve(&mut self, peer: u64, region: &IpcRegion) -> Result<u64, IpcError> {
        self.clock += 1;
        let key = (peer, region.handle);
        if !self.entries.contains_key(&key) {
            let mapping = IpcMapping::open(&self.gpu, &region.handle)?;
            if self.entries.len() >= self.capacity {
                let oldest = self
                    .entries
                    .iter()
                    .min_by_key(|(_, e)| e.used)
                    .map(|(k, _)| *k);
                if let Some(k) = oldest {
                    self.entries.remove(&k); // closed as it drops
                    self.evicted += 1;
                }
            }
            self.opened += 1;
            self.entries.insert(key, Entry { mapping, used: 0 });
        }
        let e = self.entries.get_mut(&key).expect("inserted above");
        e.used = self.clock;
        let mapped = e.mapping.len();
        let fits = usize::try_from(region.offset)
            .ok()
            .and_then(|o| o.checked_add(region.len))
            .is_some_and(|end| end <= mapped);
        if !fits {
            return Err(IpcError::OutOfRange {
                offset: region.offset,
                len: region.len,
                mapped,
            });
        }
        Ok(e.mapping.base() + region.offset)
    }

    /// Closes every mapping of `peer` (it went); how many.
    pub fn forget_peer(&mut self, peer: u64) -> usize {
        let before = self.entries.len();
        self.entries.retain(|(p, _), _| *p != peer);
        before - self.entries.len()
    }

    /// Mappings open now.
    pub fn open_count(&self) -> usize {
        self.entries.len()
    }

    /// Mappings opened, and closed to make room, since the cache was made.
    pub fn counts(&self) -> (u64, u64) {
        (self.opened, self.evicted)
    }
}

/// Device-to-device copies into this process's memory, queued on a stream
/// of their own so the GPU copies one message while the host takes the
/// next: each copy has a ticket, and [`completed`](Self::completed) hands
/// back the tickets whose copies have finished, in order. Copies queued
/// between two looks share one event (recorded at the look: a stream runs
/// its copies in order, so one event covers every copy before it), polled,
/// never waited on unless asked.
pub struct CopyQueue {
    gpu: Gpu,
    stream: sys::CUstream,
    /// Events recorded, each with the last ticket it covers.
    pending: std::collections::VecDeque<(u64, sys::CUevent)>,
    spare: Vec<sys::CUevent>,
    next: u64,
    /// Copies queued since the last event (none: `next` is covered).
    unsealed: bool,
    /// The last ticket handed back.
    handed: Option<u64>,
}

// SAFETY: a CUDA stream and its events belong to a context, not a thread:
// every method binds the GPU's context on the calling thread before it uses
// them, and `&mut self` keeps two threads from using them at once.
unsafe impl Send for CopyQueue {}

impl fmt::Debug for CopyQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CopyQueue")
            .field("pending", &self.pending.len())
            .field("next", &self.next)
            .finish()
    }
}

impl CopyQueue {
    /// A queue on a new non-blocking stream of `gpu`.
    pub fn new(gpu: &Gpu) -> Result<CopyQueue, CudaError> {
        gpu.bind()?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(super::driver("cuStreamCreate"))?;
        Ok(CopyQueue {
            gpu: gpu.clone(),
            stream,
            pending: std::collections::VecDeque::new(),
            spare: Vec::new(),
            next: 0,
            unsealed: false,
            handed: None,
        })
    }

    /// Queues a copy of `len` bytes at device address `src` to the start of
    /// `dst` (of `mem`, ours); its ticket.
    ///
    /// # Safety
    /// `[src, src + len)` must stay mapped (its [`IpcCache`] entry open),
    /// and `dst` must not be read, written or freed, until the ticket is
    /// completed.
    pub unsafe fn copy(
        &mut self,
        mem: &DeviceMemory,
        dst: Region,
        src: u64,
        len: usize,
    ) -> Result<u64, CudaError> {
        mem.check(dst, len)?;
        self.gpu.bind()?;
        // SAFETY: `dst` lies in a live allocation of ours (checked); the
        // caller keeps both ranges alive until the ticket completes; the
        // stream is ours and live.
        unsafe { result::memcpy_dtod_async(dst.addr, src, len, self.stream) }
            .map_err(super::driver("cuMemcpyDtoDAsync"))?;
        let ticket = self.next;
        self.next += 1;
        self.unsealed = true;
        Ok(ticket)
    }

    /// Records an event behind the copies queued since the last one.
    fn seal(&mut self) -> Result<(), CudaError> {
        if !self.unsealed {
            return Ok(());
        }
        self.gpu.bind()?;
        let event = match self.spare.pop() {
            Some(e) => e,
            None => result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(super::driver("cuEventCreate"))?,
        };
        // SAFETY: the event and the stream are ours and live.
        if let Err(e) = unsafe { result::event::record(event, self.stream) } {
            self.spare.push(event);
            return Err(super::driver("cuEventRecord")(e));
        }
        self.unsealed = false;
        self.pending.push_back((self.next - 1, event));
        Ok(())
    }

    /// Calls `done` with each ticket whose copy has finished, oldest first;
    /// a failed copy is the driver's error (the stream is then unusable).
    pub fn completed(&mut self, mut done: impl FnMut(u64)) -> Result<(), CudaError> {
        self.seal()?;
        if !self.pending.is_empty() {
            self.gpu.bind()?;
        }
        while let Some(&(last, event)) = self.pending.front() {
            // SAFETY: `event` is a live event of ours, recorded on our stream.
            match unsafe { sys::cuEventQuery(event) } {
                sys::CUresult::CUDA_SUCCESS => {
                    self.pending.pop_front();
                    self.spare.push(event);
                    let first = self.handed.map_or(0, |h| h + 1);
                    for t in first..=last {
                        done(t);
                    }
                    self.handed = Some(last);
                }
                sys::CUresult::CUDA_ERROR_NOT_READY => return Ok(()),
                r => {
                    return Err(CudaError::Driver {
                        call: "cuEventQuery",
                        result: r,
                    })
                }
            }
        }
        Ok(())
    }

    /// Waits for every queued copy, then hands back their tickets as
    /// [`completed`](Self::completed) does (before a mapping they read from
    /// may close).
    pub fn finish(&mut self, done: impl FnMut(u64)) -> Result<(), CudaError> {
        // Sealed first: the event then covers every copy the sync waits for.
        self.seal()?;
        if !self.pending.is_empty() {
            self.gpu.bind()?;
            // SAFETY: the stream is ours and live.
            unsafe { result::stream::synchronize(self.stream) }
                .map_err(super::driver("cuStreamSynchronize"))?;
        }
        self.completed(done)
    }

    /// Copies queued and not yet handed back as completed.
    pub fn pending(&self) -> usize {
        (self.next - self.handed.map_or(0, |h| h + 1)) as usize
    }
}

impl Drop for CopyQueue {
    fn drop(&mut self) {
        if self.gpu.bind().is_err() {
            return;
        }
        // SAFETY: the stream and every event are ours; the stream's work is
        // waited for before anything it uses is released.
        unsafe {
            let _ = result::stream::synchronize(self.stream);
            for (_, e) in self.pending.drain(..) {
                let _ = result::event::destroy(e);
            }
            for e in self.spare.drain(..) {
                let _ = result::event::destroy(e);
            }
            let _ = result::stream::destroy(self.stream);
        }
    }
}
