//! Memory as zerohop sees it: described, never dereferenced.

use crate::error::RegisterError;
use crate::Error;

/// Where a region lives, which decides who can read it and how a NIC can reach it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum MemKind {
    /// Ordinary pageable host memory.
    Host,
    /// Page-locked host memory (e.g. `cuMemHostAlloc`): host- and DMA-visible.
    HostPinned,
    /// CUDA managed (unified) memory: host-visible, migrates on demand. A NIC
    /// cannot register it (the driver refuses to export it as a DMA-buf).
    Managed,
    /// GPU device memory: not host-visible; a NIC reaches it through DMA-buf or peermem.
    Device,
}

impl MemKind {
    /// Whether the CPU may read and write this memory through a plain pointer.
    pub const fn host_visible(self) -> bool {
        !matches!(self, MemKind::Device)
    }

    /// Lower-case name, as printed in reports.
    pub const fn name(self) -> &'static str {
        match self {
            MemKind::Host => "host",
            MemKind::HostPinned => "host-pinned",
            MemKind::Managed => "managed",
            MemKind::Device => "device",
        }
    }
}

/// A contiguous range of memory of one kind: `[addr, addr + len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Region {
    /// First byte (a host virtual address, or a device address for [`MemKind::Device`]).
    pub addr: u64,
    /// Length in bytes.
    pub len: usize,
    /// Where it lives.
    pub kind: MemKind,
}

impl Region {
    /// One past the last byte, or `None` when the range wraps the address space.
    #[inline]
    pub const fn end(&self) -> Option<u64> {
        self.addr.checked_add(self.len as u64)
    }

    /// Checks the range is non-empty and does not wrap.
    pub fn validate(&self) -> Result<(), RegisterError> {
        if self.len == 0 {
            return Err(RegisterError::ZeroLength);
        }
        if self.end().is_none() {
            return Err(RegisterError::AddressWraps {
                addr: self.addr,
                len: self.len,
            });
        }
        Ok(())
    }

    /// Whether `[addr, addr+len)` lies inside this region (false on wrap).
    #[inline]
    pub const fn covers(&self, addr: u64, len: usize) -> bool {
        match (self.end(), addr.checked_add(len as u64)) {
            (Some(end), Some(want_end)) => addr >= self.addr && want_end <= end,
            _ => false,
        }
    }

    /// Whether the two ranges share at least one byte.
    pub const fn overlaps(&self, addr: u64, len: usize) -> bool {
        let a_end = self.addr.saturating_add(self.len as u64);
        let b_end = addr.saturating_add(len as u64);
        self.addr < b_end && addr < a_end
    }

    /// The sub-range `[offset, offset + len)` of this region, if it fits.
    pub const fn slice(&self, offset: usize, len: usize) -> Option<Region> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Some(Region {
                addr: self.addr + offset as u64,
                len,
                kind: self.kind,
            }),
            _ => None,
        }
    }
}

/// What a registration lets a NIC do. Combine with `|`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Access(u8);

impl Access {
    /// Local read only (the least a send buffer needs).
    pub const NONE: Access = Access(0);
    /// The NIC may write into the buffer (a receive buffer needs it).
    pub const LOCAL_WRITE: Access = Access(1);
    /// A peer may RDMA-read it.
    pub const REMOTE_READ: Access = Access(2);
    /// A peer may RDMA-write it (requires `LOCAL_WRITE` on real NICs).
    pub const REMOTE_WRITE: Access = Access(4);
    /// A peer may run atomics on it.
    pub const REMOTE_ATOMIC: Access = Access(8);
    const ALL: u8 = 0xF;

    /// The raw bits (stable: the values of the constants above).
    pub const fn bits(self) -> u8 {
        self.0
    }

    /// From raw bits; unknown bits are refused.
    pub const fn from_bits(bits: u8) -> Option<Access> {
        if bits & !Self::ALL == 0 {
            Some(Access(bits))
        } else {
            None
        }
    }

    /// Whether every flag of `other` is set here.
    #[inline]
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    /// Both sets of flags.
    pub const fn union(self, other: Access) -> Access {
        Access(self.0 | other.0)
    }
}

impl core::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        self.union(rhs)
    }
}

/// What a registration gives back: the keys a work request or a peer names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct MrHandle {
    /// First registered byte.
    pub addr: u64,
    /// Registered length.
    pub len: usize,
    /// Local key (goes into a scatter/gather entry).
    pub lkey: u32,
    /// Remote key (what a peer quotes in RDMA read/write).
    pub rkey: u32,
    /// What the registration allows.
    pub access: Access,
    /// The registrar's own id for this registration (unique while it lives).
    pub id: u32,
}

impl MrHandle {
    /// The registered range as a region of `kind`.
    #[inline]
    pub const fn region(&self, kind: MemKind) -> Region {
        Region {
            addr: self.addr,
            len: self.len,
            kind,
        }
    }

    /// Whether this registration covers `[addr, addr+len)` with at least `access`.
    #[inline]
    pub const fn covers(&self, addr: u64, len: usize, access: Access) -> bool {
        self.region(MemKind::Host).covers(addr, len) && self.access.contains(access)
    }
}

/// Registers memory with a NIC (real verbs, or the mock NIC).
pub trait Registrar {
    /// Registers `region` for `access`. Zero-length and wrapping ranges are refused.
    fn register(&self, region: Region, access: Access) -> Result<MrHandle, Error>;
    /// Undoes a registration. Call it outside any lock: real NICs take microseconds.
    fn deregister(&self, handle: MrHandle) -> Result<(), Error>;
}

/// A source of raw memory of one kind (an arena, the heap, CUDA allocations).
pub trait RawMemory {
    /// Allocates `len` bytes aligned to `align` (a power of two).
    fn alloc(&self, len: usize, align: usize) -> Result<Region, Error>;
    /// Returns memory obtained from `alloc`.
    fn free(&self, region: Region) -> Result<(), Error>;
    /// Whether the CPU can read what `alloc` returns.
    fn host_visible(&self) -> bool;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(addr: u64, len: usize) -> Region {
        Region {
            addr,
            len,
            kind: MemKind::Host,
        }
    }

    #[test]
    fn covers_and_overlaps_respect_the_edges() {
        let a = r(100, 10);
        assert!(a.covers(100, 10));
        assert!(a.covers(105, 5));
        assert!(!a.covers(105, 6));
        assert!(!a.covers(99, 1));
        assert!(a.overlaps(109, 1));
        assert!(!a.overlaps(110, 5));
        assert!(!a.overlaps(90, 10));
        assert!(
            !a.covers(u64::MAX, 2),
            "a wrapping query is covered by nothing"
        );
    }

    #[test]
    fn validate_refuses_empty_and_wrapping_ranges() {
        assert_eq!(r(1, 0).validate(), Err(RegisterError::ZeroLength));
        assert_eq!(
            r(u64::MAX - 1, 4).validate(),
            Err(RegisterError::AddressWraps {
                addr: u64::MAX - 1,
                len: 4
            })
        );
        assert_eq!(r(u64::MAX - 4, 4).validate(), Ok(()));
    }

    #[test]
    fn access_bits_round_trip_and_refuse_unknown_bits() {
        let a = Access::LOCAL_WRITE | Access::REMOTE_READ;
        assert_eq!(Access::from_bits(a.bits()), Some(a));
        assert!(a.contains(Access::LOCAL_WRITE));
        assert!(!a.contains(Access::REMOTE_WRITE));
        assert_eq!(Access::from_bits(0x10), None);
    }

    #[test]
    fn slice_stays_inside() {
        let a = r(0x1000, 64);
        assert_eq!(a.slice(16, 48), Some(r(0x1010, 48)));
        assert_eq!(a.slice(16, 49), None);
        assert_eq!(a.slice(usize::MAX, 2), None);
    }
}
