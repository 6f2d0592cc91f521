//! Device memory exported as a DMA-buf, the handle a NIC registers
//! (`ibv_reg_dmabuf_mr`) to reach GPU memory without peermem.

use std::ffi::c_void;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use cudarc::driver::sys::{self, CUmemRangeHandleType};
use zerohop_core::{MemKind, Region};

use super::{CudaError, Gpu};

/// A DMA-buf file descriptor over a range of GPU memory. The descriptor is
/// owned: dropping the `DmaBuf` closes it (the memory itself stays allocated).
#[derive(Debug)]
pub struct DmaBuf {
    fd: OwnedFd,
    region: Region,
}

fn host_page() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).unwrap_or(4096).max(1)
}

impl DmaBuf {
    /// Exports `region` (host-page aligned start and length). Only device
    /// memory exports: for managed or pinned memory the driver is asked
    /// anyway and its refusal comes back as [`CudaError::NotDeviceMemory`].
    pub fn export(gpu: &Gpu, region: Region) -> Result<DmaBuf, CudaError> {
        let page = host_page() as u64;
        if region.len == 0 || region.addr % page != 0 || region.len as u64 % page != 0 {
            return Err(CudaError::Unaligned {
                addr: region.addr,
                len: region.len,
            });
        }
        gpu.bind()?;
        let mut fd: libc::c_int = -1;
        // SAFETY: `fd` is a valid out-pointer for the int the driver writes;
        // the range is only described to the driver, which validates it.
        let r = unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut libc::c_int).cast::<c_void>(),
                region.addr,
                region.len,
                CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(match region.kind {
                MemKind::Device => CudaError::Driver {
                    call: "cuMemGetHandleForAddressRange",
                    result: r,
                },
                kind => CudaError::NotDeviceMemory { kind, result: r },
            });
        }
        // SAFETY: on success the driver returned a fresh descriptor that nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(DmaBuf { fd, region })
    }

    /// The exported range (its start is the iova a NIC registration uses).
    pub fn region(&self) -> Region {
        self.region
    }

    /// Where `addr` lies inside the DMA-buf (the `offset` of `ibv_reg_dmabuf_mr`).
    pub fn offset_of(&self, addr: u64) -> Option<u64> {
        self.region.covers(addr, 1).then(|| addr - self.region.addr)
    }

    /// The size the kernel reports for the DMA-buf (`lseek(fd, 0, SEEK_END)`).
    pub fn size_from_fd(&self) -> std::io::Result<u64> {
        // SAFETY: a valid, owned descriptor; seeking a dma-buf has no other effect.
        let end = unsafe { libc::lseek(self.fd.as_raw_fd(), 0, libc::SEEK_END) };
        if end < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: as above.
        unsafe { libc::lseek(self.fd.as_raw_fd(), 0, libc::SEEK_SET) };
        Ok(end as u64)
    }
}

impl AsFd for DmaBuf {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
