//! The shared segment of a same-host lane: one sealed memfd, mapped by both
//! processes, holding a header, two rings' control words and their data.
//!
//! ```text
//!  0        64          64+CTL        64+2*CTL      4096            4096+R          4096+2R
//!  | header | ring 0 ctl | ring 1 ctl |    unused    | ring 0 data   | ring 1 data   |
//! ```
//!
//! Ring 0 carries the creator's frames (the accepting side's), ring 1 the
//! opener's. The creator seals the memfd against shrinking and growing
//! before it sends it, and the opener checks the seals: a peer cannot cut
//! the mapping from under this side (a SIGBUS), whatever it does. The
//! opener copies the header and validates it once; the sizes it keeps are
//! its own copies. The memfd is anonymous: nothing is left in `/dev/shm`
//! or anywhere else once both sides have unmapped it and closed it.

use std::ffi::c_void;
use std::fmt;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

use super::ring::{RingCtl, RingMem, CHUNK_ALIGN, CTL_BYTES};
use crate::sync::AtomicU64;

const MAGIC: [u8; 8] = *b"ZHLANE\0\x01";
/// The layout and its rules: 4 since the header says where single copies
/// start (bytes 16..20; a peer of 3 assumed 32 KiB); 6 since a ring's
/// control words say when its producer ended the lane uncleanly; 7 since a
/// ring's writes are stamped chunks, whose key the header carries (bytes
/// 24..32; see `ring`); 8 since a ring's control words carry the offer of
/// a long message's tail (see `cma`).
const VERSION: u32 = 8;
const HEADER_BYTES: usize = 64;
/// Where the data of ring 0 starts.
const DATA_AT: usize = 4096;
/// The smallest and largest rings a segment may have.
pub(crate) const MIN_RING_BYTES: usize = 4096;
pub(crate) const MAX_RING_BYTES: usize = 1 << 30;
/// The seals a segment must carry before this side maps it.
const SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// Why a segment from a peer was refused.
#[derive(Debug)]
#[non_exhaustive]
pub enum SegmentError {
    /// A call failed.
    Io(io::Error),
    /// The segment is not what a lane's segment must be (the text says how).
    Invalid(&'static str),
}

impl fmt::Display for SegmentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SegmentError::Io(e) => write!(f, "shared segment: {e}"),
            SegmentError::Invalid(why) => write!(f, "shared segment refused: {why}"),
        }
    }
}

impl std::error::Error for SegmentError {}

impl From<io::Error> for SegmentError {
    fn from(e: io::Error) -> Self {
        SegmentError::Io(e)
    }
}

/// A mapped segment; unmapped and closed when dropped.
#[derive(Debug)]
pub(crate) struct Segment {
    base: NonNull<u8>,
    len: usize,
    ring_bytes: usize,
    /// Where single copies start, as the header says (see `single_copy_from`).
    single_copy_from: u32,
    /// The rings' stamp key, as the header says.
    key: u64,
    fd: OwnedFd,
}

// SAFETY: the mapping is shared memory reached only through atomics (the
// rings' control words) and bounded copies (their data), whichever thread
// holds the segment; the pointer stays valid until Drop unmaps it.
unsafe impl Send for Segment {}
// SAFETY: as for Send: `&Segment` only hands out atomics and copies.
unsafe impl Sync for Segment {}

impl Segment {
    /// A fresh segment with two rings of `ring_bytes` each (a power of two,
    /// within the limits), sealed, mapped, its header written; messages of
    /// `single_copy_from` bytes and up cross it by a single copy.
    pub(crate) fn create(ring_bytes: usize, single_copy_from: usize) -> io::Result<Segment> {
        if !ring_bytes.is_power_of_two() || !(MIN_RING_BYTES..=MAX_RING_BYTES).contains(&ring_bytes)
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a lane's ring must be a power of two from 4 KiB to 1 GiB",
            ));
        }
        let fd = rustix::fs::memfd_create(
            "zerohop-lane",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )?;
        let len = DATA_AT + 2 * ring_bytes;
        rustix::fs::ftruncate(&fd, len as u64)?;
        rustix::fs::fcntl_add_seals(&fd, SEALS)?;
        let mut seg = Self::map(fd, len, ring_bytes)?;
        let single = u32::try_from(single_copy_from).unwrap_or(u32::MAX);
        seg.single_copy_from = single;
        let mut header = [0u8; HEADER_BYTES];
        header[..8].copy_from_slice(&MAGIC);
        header[8..12].copy_from_slice(&VERSION.to_le_bytes());
        header[12..16].copy_from_slice(&(ring_bytes as u32).to_le_bytes());
        header[16..20].copy_from_slice(&single.to_le_bytes());
        // The rings' stamp key: random, so that no payload a peer's
        // application chose passes for a stamp (see `ring`).
        let key = std::hash::BuildHasher::hash_one(
            &std::collections::hash_map::RandomState::new(),
            (std::process::id(), seg.base.as_ptr() as usize),
        );
        seg.key = key;
        header[24..32].copy_from_slice(&key.to_le_bytes());
        // SAFETY: the header lies inside the fresh mapping (len > 64), which
        // nobody else has yet.
        unsafe { std::ptr::copy_nonoverlapping(header.as_ptr(), seg.base.as_ptr(), HEADER_BYTES) };
        Ok(seg)
    }

    /// Maps a segment a peer sent: checks its seals and size, then copies
    /// its header and validates it.
    pub(crate) fn open(fd: OwnedFd) -> Result<Segment, SegmentError> {
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(io::Error::from)?;
        if !seals.contains(SEALS) {
            return Err(SegmentError::Invalid(
                "not sealed against shrinking and growing",
            ));
        }
        let size = rustix::fs::fstat(&fd).map_err(io::Error::from)?.st_size;
        let len =
            usize::try_from(size).map_err(|_| SegmentError::Invalid("a size out of range"))?;
        if !(DATA_AT + 2 * MIN_RING_BYTES..=DATA_AT + 2 * MAX_RING_BYTES).contains(&len) {
            return Err(SegmentError::Invalid("a size no lane has"));
        }
        // Mapped at the size the seals fix; the header is checked against it.
        let mut seg = Self::map(fd, len, 0)?;
        let mut header = [0u8; HEADER_BYTES];
        // SAFETY: the mapping is at least DATA_AT bytes (checked above); the
        // header is copied out once, and only the copy is looked at.
        unsafe {
            std::ptr::copy_nonoverlapping(seg.base.as_ptr(), header.as_mut_ptr(), HEADER_BYTES)
        };
        if header[..8] != MAGIC {
            return Err(SegmentError::Invalid("not a zerohop lane segment"));
        }
        let word =
            |i: usize| u32::from_le_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
        if word(8) != VERSION {
            return Err(SegmentError::Invalid("another version of the lane segment"));
        }
        let ring_bytes = word(12) as usize;
        if !ring_bytes.is_power_of_two()
            || !(MIN_RING_BYTES..=MAX_RING_BYTES).contains(&ring_bytes)
            || DATA_AT + 2 * ring_bytes != len
        {
            return Err(SegmentError::Invalid(
                "ring sizes that do not match the segment",
            ));
        }
        seg.ring_bytes = ring_bytes;
        seg.single_copy_from = word(16);
        seg.key = u64::from_le_bytes(header[24..32].try_into().expect("8 bytes"));
        Ok(seg)
    }

    fn map(fd: OwnedFd, len: usize, ring_bytes: usize) -> io::Result<Segment> {
        // SAFETY: a fresh shared mapping of `len` bytes of a memfd whose
        // size the seals fix at `len`: no existing memory is aliased, and no
        // access through it can fault.
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )?
        };
        let base = NonNull::new(p.cast::<u8>()).ok_or(io::ErrorKind::Other)?;
        Ok(Segment {
            base,
            len,
            ring_bytes,
            single_copy_from: u32::MAX,
            key: 0,
            fd,
        })
    }

    /// The memfd (to send to the peer).
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Each ring's data bytes.
    #[cfg(test)]
    pub(crate) fn ring_bytes(&self) -> usize {
        self.ring_bytes
    }

    /// Messages of this many bytes and up go by a single copy, as the
    /// segment's maker said (both sides read it the same way).
    pub(crate) fn single_copy_from(&self) -> usize {
        (self.single_copy_from as usize).max(super::cma::FLOOR)
    }

    /// Ring `which` (0: the creator's frames, 1: the opener's).
    pub(crate) fn ring(self: &Arc<Self>, which: usize) -> SegRing {
        let which = which & 1;
        SegRing {
            seg: Arc::clone(self),
            which,
            data_at: DATA_AT + which * self.ring_bytes,
            cap: self.ring_bytes,
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: the mapping this segment made, unmapped once; the rings
        // that borrow it hold the segment (an Arc), so none outlives it.
        if unsafe { rustix::mm::munmap(self.base.as_ptr().cast::<c_void>(), self.len) }.is_err() {
            log::warn!("shm: unmapping a lane segment failed");
        }
    }
}

/// One ring of a segment.
#[derive(Debug, Clone)]
pub(crate) struct SegRing {
    seg: Arc<Segment>,
    which: usize,
    /// Where its bytes start in the segment, and how many (the layout's,
    /// kept here: every copy in and out asks).
    data_at: usize,
    cap: usize,
}

impl SegRing {
    fn data(&self) -> *mut u8 {
        // SAFETY: data_at + cap = DATA_AT + which * ring_bytes + ring_bytes
        // <= len (the layout; both set from it in `Segment::ring`).
        unsafe { self.seg.base.as_ptr().add(self.data_at) }
    }
}

impl RingMem for SegRing {
    fn ctl(&self) -> &RingCtl {
        const { assert!(HEADER_BYTES + 2 * CTL_BYTES <= DATA_AT) };
        // SAFETY: the control words lie inside the mapping (the layout),
        // 64-byte aligned (the mapping is page aligned, the offsets are
        // multiples of 64), and are atomics only: the peer's writes to them
        // are atomic accesses too (or garbage this side validates, never a
        // reason to touch memory elsewhere). Zeroed memory is a valid
        // RingCtl. The reference lives as long as `self`, which keeps the
        // mapping.
        unsafe {
            &*self
                .seg
                .base
                .as_ptr()
                .add(HEADER_BYTES + self.which * CTL_BYTES)
                .cast::<RingCtl>()
        }
    }

    fn cap(&self) -> usize {
        self.cap
    }

    fn copy_in(&self, at: usize, src: &[u8]) {
        if at.checked_add(src.len()).is_none_or(|end| end > self.cap()) {
            debug_assert!(false, "a copy past the ring");
            return;
        }
        // SAFETY: inside the ring (checked); these bytes are the producer's
        // until it publishes them, and `src` is private memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.data().add(at), src.len()) }
    }

    fn stamp(&self, at: usize) -> &AtomicU64 {
        // A bad offset is this side's bug, not the peer's: it never comes
        // from the segment.
        assert!(
            at % CHUNK_ALIGN == 0 && at < self.cap(),
            "a stamp off a chunk"
        );
        // SAFETY: inside the ring (checked), 8-byte aligned (the data
        // starts on a page, `at` is a multiple of 64). The peer writes this
        // word as an atomic, or garbage this side only compares; the
        // reference lives as long as `self`, which keeps the mapping.
        unsafe { &*self.data().add(at).cast::<AtomicU64>() }
    }

    fn key(&self) -> u64 {
        self.seg.key
    }

    fn copy_out(&self, at: usize, dst: &mut [u8]) {
        if at.checked_add(dst.len()).is_none_or(|end| end > self.cap()) {
            debug_assert!(false, "a copy past the ring");
            return;
        }
        // SAFETY: inside the ring (checked), into private memory. A peer
        // that writes these bytes while they are copied (it should not: the
        // producer owns them until released) makes the copy garbage, which
        // the session's checks then see — never an access out of bounds.
        unsafe { std::ptr::copy_nonoverlapping(self.data().add(at), dst.as_mut_ptr(), dst.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::ring::{Consumer, Producer};

    #[test]
    fn a_segment_crosses_as_its_memfd_and_both_maps_see_one_ring() {
        let a = Arc::new(Segment::create(1 << 16, 100 << 10).unwrap());
        let fd = a.fd().try_clone_to_owned().unwrap();
        let b = Arc::new(Segment::open(fd).unwrap());
        assert_eq!(b.ring_bytes(), 1 << 16);
        // Where single copies start: the maker's word, on both sides.
        assert_eq!(a.single_copy_from(), 100 << 10);
        assert_eq!(b.single_copy_from(), 100 << 10);
        // Below the floor, both read the floor.
        let tiny = Segment::create(1 << 16, 1).unwrap();
        let fd = tiny.fd().try_clone_to_owned().unwrap();
        assert_eq!(tiny.single_copy_from(), crate::shm::cma::FLOOR);
        assert_eq!(
            Segment::open(fd).unwrap().single_copy_from(),
            crate::shm::cma::FLOOR
        );
        let mut p = Producer::new(a.ring(0));
        let mut c = Consumer::new(b.ring(0));
        assert_eq!(p.write(&[b"through the memfd"]).unwrap().n, 17);
        let mut out = [0u8; 17];
        assert_eq!(c.read(&mut out).unwrap(), 17);
        assert_eq!(&out, b"through the memfd");
        // The other ring is the other direction.
        let mut p1 = Producer::new(b.ring(1));
        let mut c1 = Consumer::new(a.ring(1));
        assert_eq!(p1.write(&[b"back"]).unwrap().n, 4);
        assert_eq!(c1.read(&mut out[..4]).unwrap(), 4);
        assert_eq!(&out[..4], b"back");
    }

    #[test]
    fn a_segment_that_is_not_sealed_sized_or_headed_as_a_lane_is_refused() {
        let memfd = |len: u64, seal: bool| {
            let fd = rustix::fs::memfd_create("t", MemfdFlags::ALLOW_SEALING).unwrap();
            rustix::fs::ftruncate(&fd, len).unwrap();
            if seal {
                rustix::fs::fcntl_add_seals(&fd, SEALS).unwrap();
            }
            fd
        };
        let invalid = |r: Result<Segment, SegmentError>| match r {
            Err(SegmentError::Invalid(why)) => why,
            other => panic!("expected a refusal, got {other:?}"),
        };
        let len = (DATA_AT + 2 * MIN_RING_BYTES) as u64;
        assert!(invalid(Segment::open(memfd(len, false))).contains("sealed"));
        assert!(invalid(Segment::open(memfd(100, true))).contains("size"));
        assert!(invalid(Segment::open(memfd(len, true))).contains("not a zerohop"));
        // A good header whose ring size disagrees with the segment.
        let fd = memfd(len, false);
        let mut header = [0u8; HEADER_BYTES];
        header[..8].copy_from_slice(&MAGIC);
        header[8..12].copy_from_slice(&VERSION.to_le_bytes());
        header[12..16].copy_from_slice(&(8192u32).to_le_bytes());
        rustix::io::pwrite(&fd, &header, 0).unwrap();
        rustix::fs::fcntl_add_seals(&fd, SEALS).unwrap();
        assert!(invalid(Segment::open(fd)).contains("ring sizes"));
        // Sizes a lane may not have.
        for bad in [0, 1000, 1 << 31] {
            assert!(Segment::create(bad, 32 << 10).is_err(), "{bad}");
        }
    }
}
