//! The gpudirect-verbs backend: RDMA verbs through rdma-sys (libibverbs,
//! librdmacm). One wire, two kinds: `rdma` (payloads in registered host
//! memory, [`HostPayload`]) and, with `cuda-uma` too, `gpudirect` (payloads
//! in GPU memory registered through DMA-buf or peermem, `GpuPayload`).
//!
//! Layers, as cudarc does it: raw FFI (rdma-sys) -> [`Device`] and
//! [`Registry`] (owning wrappers, every call checked) -> [`PayloadMemory`]
//! (where payloads live) -> [`RdmaTransport`].

pub mod cm;
mod payload;
mod transport;

use std::collections::HashMap;
use std::ffi::CStr;
use std::fmt;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};

use rdma_sys as ffi;
use zerohop_core::{
    Access, Error, MemKind, MrHandle, MrTable, Prereq, Probe, Region, RegisterError, Registrar,
};

#[cfg(feature = "cuda-uma")]
pub use payload::{GpuChunks, GpuPayload, GpuPool};
pub use payload::{HostPayload, PayloadLease, PayloadMemory, PayloadPool};
pub use transport::{Dialed, Dialer, RdmaConfig, RdmaTransport, MIN_RECV_DEPTH};

/// The environment variable naming the RDMA device to use (e.g. `rxe0`, `mlx5_0`).
pub const DEVICE_ENV: &str = "ZEROHOP_RDMA_DEVICE";

/// What can go wrong with verbs.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum VerbsError {
    /// No RDMA device: the kernel has no RDMA support (ENOSYS) or none is configured.
    NoDevice(String),
    /// A verbs or CM call failed with this errno.
    Call {
        /// The call.
        call: &'static str,
        /// errno.
        errno: i32,
    },
    /// An address or route could not be resolved, the connection did not
    /// come up, or this side could not set it up (the text says which).
    Connect(String),
    /// Nothing listens at the address (the CM's "invalid service ID").
    NoListener,
    /// No listener could be reached: no address or route to it, the host
    /// did not answer, or the CM timed out (the text says which step).
    Unreachable(String),
    /// The connection came up, but the peer's Hello did not come in time.
    NoHello,
    /// The listener rejected the connection: why, where it said (a zerohop
    /// listener does; see [`cm::RejectReason`]).
    Rejected(Option<cm::RejectReason>),
    /// The peer announced a receive ring too shallow for credit to keep
    /// moving (below [`MIN_RECV_DEPTH`]), or none at all (not a zerohop
    /// peer): the connection was refused rather than left to stall.
    ShallowPeer {
        /// The receive depth in the peer's CM private data, if it sent one.
        depth: Option<u32>,
    },
    /// The peer broke the protocol at the handshake (another version, no Hello).
    Protocol(zerohop_core::session::ProtocolError),
}

impl fmt::Display for VerbsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VerbsError::NoDevice(why) => write!(f, "no RDMA device: {why}"),
            VerbsError::Call { call, errno } => write!(
                f,
                "{call} failed: {}",
                std::io::Error::from_raw_os_error(*errno)
            ),
            VerbsError::Connect(why) => write!(f, "RDMA connection failed: {why}"),
            VerbsError::NoListener => {
                f.write_str("RDMA connection refused: nothing listens on that port")
            }
            VerbsError::Unreachable(why) => write!(f, "RDMA peer not reached: {why}"),
            VerbsError::NoHello => f.write_str("RDMA connection up, but no hello from the peer"),
            VerbsError::Rejected(why) => {
                f.write_str("RDMA connection refused: ")?;
                f.write_str(match why {
                    Some(cm::RejectReason::Refused) => {
                        "the listener keeps as many peers as its limits allow, has no slot \
                         left, or is closing"
                    }
                    Some(cm::RejectReason::ShallowRing) => {
                        "our receive ring is too shallow for the listener"
                    }
                    Some(cm::RejectReason::NoResources) => {
                        "the listener could not set the connection up (out of receive \
                         buffers or queue pairs)"
                    }
                    None => {
                        "the listener rejected it without saying why (it is closing, out of \
                         receive buffers, keeps as many peers as it takes, or our receive \
                         ring is too shallow for it)"
                    }
                })
            }
            VerbsError::ShallowPeer { depth: Some(d) } => write!(
                f,
                "RDMA connection refused: the peer announced a receive ring of {d}, \
                 and the least that keeps credit moving is {MIN_RECV_DEPTH}"
            ),
            VerbsError::ShallowPeer { depth: None } => write!(
                f,
                "RDMA connection refused: the peer announced no receive ring \
                 (its CM private data is not zerohop's)"
            ),
            VerbsError::Protocol(e) => write!(f, "RDMA connection refused: {e}"),
        }
    }
}

impl std::error::Error for VerbsError {}

impl From<VerbsError> for Error {
    fn from(e: VerbsError) -> Self {
        match e {
            VerbsError::Call {
                call,
                errno: libc::EOPNOTSUPP,
            } => Error::Unsupported { call },
            VerbsError::Call { call, errno } => Error::Call { call, code: errno },
            VerbsError::NoDevice(_) => Error::Backend("verbs: no RDMA device"),
            VerbsError::Connect(_) => Error::Backend("verbs: the connection failed"),
            VerbsError::NoListener => Error::Backend("verbs: nothing listens at that address"),
            VerbsError::Unreachable(_) => Error::Backend("verbs: the peer could not be reached"),
            VerbsError::NoHello => Error::Backend("verbs: no hello from the peer"),
            VerbsError::Rejected(Some(cm::RejectReason::Refused)) => Error::Protocol {
                peer: zerohop_core::PeerId(u32::MAX),
                error: zerohop_core::session::ProtocolError::Refused,
            },
            VerbsError::Rejected(_) => {
                Error::Backend("verbs: the listener rejected the connection")
            }
            VerbsError::ShallowPeer { .. } => {
                Error::Backend("verbs: the peer's receive ring is too shallow")
            }
            VerbsError::Protocol(error) => Error::Protocol {
                peer: zerohop_core::PeerId(u32::MAX),
                error,
            },
        }
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn call_failed(call: &'static str) -> VerbsError {
    VerbsError::Call {
        call,
        errno: errno(),
    }
}

/// An opened RDMA device (the context librdmacm shares with its CM ids) and
/// one protection domain on it.
#[derive(Debug)]
pub struct Device {
    ctx: NonNull<ffi::ibv_context>,
    pd: NonNull<ffi::ibv_pd>,
    name: String,
    /// The list from `rdma_get_devices`, freed on drop (it owns no contexts).
    list: NonNull<*mut ffi::ibv_context>,
}

// SAFETY: verbs objects may be used from any thread (libibverbs is thread
// safe); the raw pointers are owned by this struct and freed once in Drop.
unsafe impl Send for Device {}
// SAFETY: as above; every verbs call used through `&Device` is thread safe.
unsafe impl Sync for Device {}

impl Device {
    /// Opens the device named by `$ZEROHOP_RDMA_DEVICE`, or the first one, and
    /// allocates a protection domain. Never panics: a kernel without RDMA is
    /// a typed [`VerbsError::NoDevice`].
    pub fn open() -> Result<Arc<Device>, VerbsError> {
        Self::open_named(std::env::var(DEVICE_ENV).ok().as_deref())
    }

    /// Opens device `name` (or the first).
    pub fn open_named(name: Option<&str>) -> Result<Arc<Device>, VerbsError> {
        let mut n = 0;
        // SAFETY: a valid out-pointer; the list is freed in Drop (or below on error).
        let list = unsafe { ffi::rdma_get_devices(&mut n) };
        let Some(list) = NonNull::new(list) else {
            let e = errno();
            return Err(VerbsError::NoDevice(format!(
                "rdma_get_devices: {}",
                std::io::Error::from_raw_os_error(e)
            )));
        };
        let free = |list: NonNull<*mut ffi::ibv_context>| {
            // SAFETY: the list came from rdma_get_devices and is freed once.
            unsafe { ffi::rdma_free_devices(list.as_ptr()) }
        };
        let mut chosen = None;
        let mut seen = Vec::new();
        for i in 0..n.max(0) as usize {
            // SAFETY: the list holds `n` valid context pointers.
            let ctx = unsafe { *list.as_ptr().add(i) };
            let Some(ctx) = NonNull::new(ctx) else {
                continue;
            };
            // SAFETY: a live context's device and its NUL-terminated name.
            let dev_name =
                unsafe { CStr::from_ptr(ffi::ibv_get_device_name((*ctx.as_ptr()).device)) }
                    .to_string_lossy()
                    .into_owned();
            if name.is_none_or(|want| want == dev_name) {
                chosen = Some((ctx, dev_name));
                break;
            }
            seen.push(dev_name);
        }
        let Some((ctx, name_found)) = chosen else {
            free(list);
            return Err(VerbsError::NoDevice(match name {
                Some(w) => format!("{w} not found (devices: {})", seen.join(", ")),
                None => "the device list is empty".into(),
            }));
        };
        // SAFETY: a live context from librdmacm.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.as_ptr()) };
        let Some(pd) = NonNull::new(pd) else {
            let e = call_failed("ibv_alloc_pd");
            free(list);
            return Err(e);
        };
        Ok(Arc::new(Device {
            ctx,
            pd,
            name: name_found,
            list,
        }))
    }

    /// The device name (e.g. `rxe0`).
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn ctx(&self) -> *mut ffi::ibv_context {
        self.ctx.as_ptr()
    }

    pub(crate) fn pd(&self) -> *mut ffi::ibv_pd {
        self.pd.as_ptr()
    }

    /// Whether the NIC takes DMA-buf registrations: `ibv_reg_dmabuf_mr` with
    /// fd -1 answers EBADF when it does, EOPNOTSUPP/EPROTONOSUPPORT when not.
    pub fn dmabuf_supported(&self) -> Result<(), i32> {
        let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32;
        // SAFETY: a live PD; fd -1 is refused before any mapping is attempted.
        let mr = unsafe { ffi::ibv_reg_dmabuf_mr(self.pd(), 0, 4096, 0, -1, access) };
        if let Some(mr) = NonNull::new(mr) {
            // SAFETY: unexpectedly registered: undo it.
            unsafe { ffi::ibv_dereg_mr(mr.as_ptr()) };
            return Ok(());
        }
        match errno() {
            libc::EBADF => Ok(()),
            e => Err(e),
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: the PD is ours; every MR and QP on it is gone (each holds an
        // Arc<Device>). The list came from rdma_get_devices and is freed once;
        // the contexts stay with librdmacm.
        unsafe {
            ffi::ibv_dealloc_pd(self.pd.as_ptr());
            ffi::rdma_free_devices(self.list.as_ptr());
        }
    }
}

fn to_verbs_access(a: Access) -> i32 {
    let mut f = 0u32;
    if a.contains(Access::LOCAL_WRITE) {
        f |= ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
    }
    if a.contains(Access::REMOTE_READ) {
        f |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
    }
    if a.contains(Access::REMOTE_WRITE) {
        f |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
    }
    if a.contains(Access::REMOTE_ATOMIC) {
        f |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
    }
    f as i32
}

// SAFETY: the MR pointers are owned by this map and only used under the
// registry's mutex or after being taken out of it (then exclusively);
// libibverbs calls are thread safe.
unsafe impl Send for Registrations {}

#[derive(Debug)]
struct Registrations {
    /// Every live registration, indexed by address: a range is never registered twice.
    table: MrTable<4096>,
    mrs: HashMap<u32, NonNull<ffi::ibv_mr>>,
}

/// Registers memory with a [`Device`]'s protection domain. Every registration
/// is recorded (pinned) in core's [`MrTable`], so a range already covered is
/// answered from the table and never registered twice; deregistration happens
/// outside the lock.
#[derive(Debug, Clone)]
pub struct Registry {
    device: Arc<Device>,
    regs: Arc<Mutex<Registrations>>,
}

impl Registry {
    /// A registry on `device`.
    pub fn new(device: Arc<Device>) -> Registry {
        Registry {
            device,
            regs: Arc::new(Mutex::new(Registrations {
                table: MrTable::new(),
                mrs: HashMap::new(),
            })),
        }
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    fn lock(&self) -> MutexGuard<'_, Registrations> {
        // Each update keeps table and map consistent before any call that can fail.
        self.regs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Live registrations.
    pub fn live(&self) -> usize {
        self.lock().mrs.len()
    }

    fn record(
        &self,
        mr: NonNull<ffi::ibv_mr>,
        region: Region,
        access: Access,
    ) -> Result<MrHandle, Error> {
        // SAFETY: a live MR the driver just returned.
        let (lkey, rkey) = unsafe { ((*mr.as_ptr()).lkey, (*mr.as_ptr()).rkey) };
        let handle = MrHandle {
            addr: region.addr,
            len: region.len,
            lkey,
            rkey,
            access,
            id: lkey,
        };
        let mut handed_back = Vec::new();
        let mut dead = Vec::new();
        let result = {
            let mut regs = self.lock();
            regs.mrs.insert(handle.id, mr);
            let r = regs
                .table
                .insert(handle, true, &mut |h| handed_back.push(h));
            dead.extend(handed_back.iter().filter_map(|h| regs.mrs.remove(&h.id)));
            r
        };
        deregister_all(dead);
        result.map_err(Error::Mr)
    }

    /// Registers a DMA-buf range of GPU memory: `offset` into the buffer `fd`,
    /// `len` bytes, mapped at `iova` (the buffer's device address, so work
    /// requests name device addresses as they do host ones).
    pub fn register_dmabuf(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        region: Region,
        access: Access,
    ) -> Result<MrHandle, Error> {
        self.register_with(region, access, "ibv_reg_dmabuf_mr", || {
            // SAFETY: a live PD and a DMA-buf descriptor the caller keeps open for the call.
            unsafe {
                ffi::ibv_reg_dmabuf_mr(
                    self.device.pd(),
                    offset,
                    region.len,
                    region.addr,
                    fd.as_raw_fd(),
                    to_verbs_access(access),
                )
            }
        })
    }

    /// Registers GPU device memory by its device pointer, the way
    /// nvidia_peermem (or nv_peer_mem) lets `ibv_reg_mr` take it. Refused,
    /// typed, where neither module is loaded: without one the call would fail
    /// in the driver, or worse, pin whatever host page the address names.
    pub fn register_device_peermem(
        &self,
        region: Region,
        access: Access,
    ) -> Result<MrHandle, Error> {
        if region.kind != MemKind::Device {
            return Err(Error::Register(RegisterError::Unsupported(region.kind)));
        }
        if peermem_module().is_none() {
            return Err(Error::Backend(
                "device memory through ibv_reg_mr needs nvidia_peermem (or nv_peer_mem) loaded",
            ));
        }
        // peermem resolves the device address for the NIC.
        self.register_with(region, access, "ibv_reg_mr (peermem)", || {
            self.reg_mr(region, access)
        })
    }

    /// `ibv_reg_mr` of `region` (host memory, or device memory under peermem).
    fn reg_mr(&self, region: Region, access: Access) -> *mut ffi::ibv_mr {
        // SAFETY: a live PD; callers register only memory they own for as long
        // as the registration lives (pools deregister a chunk before freeing
        // it); the NIC pins the pages, nothing is dereferenced here.
        unsafe {
            ffi::ibv_reg_mr(
                self.device.pd(),
                region.addr as usize as *mut libc::c_void,
                region.len,
                to_verbs_access(access),
            )
        }
    }

    /// The registration covering `region` from the table, or a fresh one from
    /// `reg` (named `call` in the error), recorded in the table.
    fn register_with(
        &self,
        region: Region,
        access: Access,
        call: &'static str,
        reg: impl FnOnce() -> *mut ffi::ibv_mr,
    ) -> Result<MrHandle, Error> {
        region.validate()?;
        if let Some(h) = self
            .lock()
            .table
            .pin_covering(region.addr, region.len, access)
        {
            return Ok(h);
        }
        let mr = NonNull::new(reg()).ok_or_else(|| Error::from(call_failed(call)))?;
        self.record(mr, region, access)
    }
}

/// Deregisters MRs already taken out of the map (so each has one owner), outside the lock.
fn deregister_all(dead: Vec<NonNull<ffi::ibv_mr>>) {
    for m in dead {
        // SAFETY: removed from the map under the lock: this is its only owner.
        unsafe { ffi::ibv_dereg_mr(m.as_ptr()) };
    }
}

impl Registrar for Registry {
    fn register(&self, region: Region, access: Access) -> Result<MrHandle, Error> {
        region.validate()?;
        match region.kind {
            MemKind::Host | MemKind::HostPinned => {}
            // The NIC cannot reach managed memory; device memory goes through a DMA-buf.
            k => return Err(Error::Register(RegisterError::Unsupported(k))),
        }
        self.register_with(region, access, "ibv_reg_mr", || self.reg_mr(region, access))
    }

    fn deregister(&self, handle: MrHandle) -> Result<(), Error> {
        let mut dead = Vec::new();
        {
            let mut regs = self.lock();
            regs.table.unpin(&handle)?;
            let still_pinned = regs
                .table
                .iter()
                .any(|(h, pins)| h.id == handle.id && pins > 0);
            if still_pinned {
                return Ok(()); // another user of the same range still holds it
            }
            let mut gone = Vec::new();
            regs.table
                .invalidate(handle.addr, handle.len, &mut |h| gone.push(h));
            dead.extend(gone.iter().filter_map(|h| regs.mrs.remove(&h.id)));
        }
        if dead.is_empty() {
            return Err(Error::Mr(zerohop_core::MrError::NotFound));
        }
        deregister_all(dead);
        Ok(())
    }
}

impl Drop for Registrations {
    fn drop(&mut self) {
        for (_, m) in self.mrs.drain() {
            // SAFETY: the last owner of every remaining registration.
            unsafe { ffi::ibv_dereg_mr(m.as_ptr()) };
        }
    }
}

/// Fills `ibverbs-device`, `hca-live`, `nic-dmabuf` and `peermem`. Never panics.
pub fn probe(probe: &mut Probe) {
    let mut n = 0;
    // SAFETY: a valid out-pointer; the list is freed right after.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = std::io::Error::last_os_error();
        let why = if e.raw_os_error() == Some(libc::ENOSYS) {
            format!("ibv_get_device_list: {e} (this kernel has no RDMA support)")
        } else {
            format!("ibv_get_device_list: {e}")
        };
        probe.missing(Prereq::IbverbsDevice, &why);
        probe.missing(Prereq::HcaLive, "no RDMA device");
        probe.missing(Prereq::NicDmabuf, "no RDMA device");
    } else {
        let mut names = Vec::new();
        for i in 0..n.max(0) as usize {
            // SAFETY: the list holds `n` valid device pointers and their names.
            let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(*list.add(i))) };
            names.push(name.to_string_lossy().into_owned());
        }
        // SAFETY: the list came from ibv_get_device_list and is freed once.
        unsafe { ffi::ibv_free_device_list(list) };
        if names.is_empty() {
            probe.missing(Prereq::IbverbsDevice, "ibv_get_device_list: no devices");
            probe.missing(Prereq::HcaLive, "no RDMA device");
            probe.missing(Prereq::NicDmabuf, "no RDMA device");
        } else {
            probe.present(Prereq::IbverbsDevice, &names.join(", "));
            match Device::open() {
                Err(e) => {
                    probe.missing(Prereq::HcaLive, &e.to_string());
                    probe.missing(Prereq::NicDmabuf, "no live HCA");
                }
                Ok(dev) => {
                    probe.present(
                        Prereq::HcaLive,
                        &format!("{}: device opens, protection domain allocates", dev.name()),
                    );
                    match dev.dmabuf_supported() {
                        Ok(()) => probe.present(
                            Prereq::NicDmabuf,
                            &format!("{}: ibv_reg_dmabuf_mr(fd -1) answers EBADF", dev.name()),
                        ),
                        Err(e) => probe.missing(
                            Prereq::NicDmabuf,
                            &format!(
                                "{}: ibv_reg_dmabuf_mr answers {} (no DMA-buf support)",
                                dev.name(),
                                std::io::Error::from_raw_os_error(e)
                            ),
                        ),
                    }
                }
            }
        }
    }
    probe_peermem(probe);
}

/// The loaded peer-memory module and where it was seen, if any.
fn peermem_module() -> Option<String> {
    for m in ["nvidia_peermem", "nv_peer_mem"] {
        if std::path::Path::new(&format!("/sys/module/{m}")).exists() {
            return Some(format!("/sys/module/{m}"));
        }
    }
    let mods = std::fs::read_to_string("/proc/modules").ok()?;
    mods.lines()
        .filter_map(|l| l.split_whitespace().next())
        .find(|m| *m == "nvidia_peermem" || *m == "nv_peer_mem")
        .map(|m| format!("/proc/modules lists {m}"))
}

fn probe_peermem(probe: &mut Probe) {
    match peermem_module() {
        Some(seen) => probe.present(Prereq::Peermem, &seen),
        None => probe.missing(
            Prereq::Peermem,
            "neither nvidia_peermem nor nv_peer_mem is loaded (/sys/module, /proc/modules)",
        ),
    }
}
