//! Host memory in one mapping made up front: buffers are ranges of it, so
//! a view of one is a range check, with no lookup and no lock (every view
//! of a lease makes one: `host_bytes`).
//!
//! Two backings:
//! - **shared** ([`MappedMemory::shared`]), for pools whose buffers a
//!   same-host peer reads straight out of this process: one sealed memfd of
//!   fixed size. A peer that may read this process's memory (the right
//!   `process_vm_readv` needs) takes the file with `pidfd_getfd`, maps it
//!   once, and copies a large message out with `memcpy`, several times
//!   faster than the kernel's cross-memory copy (BENCHMARKS.md). The file is
//!   sealed against shrinking, so a peer's mapping never faults past its
//!   end. It gives such a peer no access it did not have: the same right
//!   reads and writes any memory of this process.
//! - **private** ([`MappedMemory::private`]), for pools no peer maps (tcp's,
//!   the verbs wire's): anonymous memory, reserved inaccessible (so that it
//!   is not committed, nor charged where overcommit is strict) and made
//!   readable and writable a range at a time as ranges are first handed out.
//!
//! Ranges are whole pages of the host's size. A range the mapping cannot
//! place (it is full, or too cut up) comes from the heap instead: the
//! mapping never refuses what the heap would serve, and only such overflow
//! ranges pay a lookup under a lock to be viewed.
//!
//! Freed ranges stay committed for the next allocation (a stream of large
//! messages would otherwise fault every page in again, on both sides)
//! until more than [`WARM_MAX`] bytes of them wait; then every free range
//! goes back to the kernel (holes punched in the file; private pages
//! dropped). So the mapping holds what the pool holds plus at most that,
//! not its peak; and, as heap memory does, a new range may hold bytes of an
//! earlier one of this process.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use zerohop_core::{Error, MemKind, RawMemory, Region};

use crate::heap::HeapMemory;

/// Freed bytes kept committed at most (see the module's text).
pub const WARM_MAX: usize = 64 << 20;

/// Where a range of a shared [`MappedMemory`] lies, for a peer to find it: the
/// file's descriptor number in this process, its inode (the peer checks it
/// got that file), and the offset in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedPlace {
    /// The file's descriptor in this process.
    pub fd: u32,
    /// The file's inode number.
    pub ino: u64,
    /// The range's offset in the file.
    pub offset: u64,
}

/// Ranges of one mapping of this process (see the module's text).
#[derive(Debug)]
pub struct MappedMemory {
    /// The memfd behind a shared mapping; `None`: private memory.
    file: Option<File>,
    base: NonNull<u8>,
    cap: usize,
    /// The host's page size: every range is made of whole pages.
    page: usize,
    /// The bytes from the mapping's start that are accessible: all of a
    /// shared file's; of private memory, as far as ranges were handed out
    /// (opened under the ranges' lock, never closed again). `pointer` reads
    /// it without the lock.
    opened: AtomicUsize,
    /// Free and live ranges, as (offset, length), each sorted by offset.
    ranges: Mutex<Ranges>,
    /// What the mapping could not place.
    overflow: HeapMemory,
}

/// A shared mapping's file.
#[derive(Debug)]
struct File {
    fd: OwnedFd,
    ino: u64,
}

#[derive(Debug, Default)]
struct Ranges {
    free: Vec<(usize, usize)>,
    live: Vec<(usize, usize)>,
    /// Bytes freed since every free range was last punched: at least the
    /// free bytes still committed. Past `WARM_MAX`, every free range is
    /// punched again.
    warm: usize,
}

// SAFETY: the mapping is this value's own and lives until it drops; the
// pointer is only dereferenced through views whose aliasing the pool's
// leases govern, and the range tables are behind a mutex (the overflow heap
// is `Send` and `Sync` itself).
unsafe impl Send for MappedMemory {}
// SAFETY: as above; `&self` methods touch only the mutex-guarded tables.
unsafe impl Sync for MappedMemory {}

fn os_error(what: &'static str) -> Error {
    Error::Call {
        call: what,
        code: std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
    }
}

/// `capacity` rounded up to whole pages of the host's, and that page size.
fn pages(capacity: usize) -> Result<(usize, usize), Error> {
    // SAFETY: sysconf only reads a system value.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .unwrap_or(4096)
        .max(4096);
    let cap = capacity
        .max(page)
        .checked_next_multiple_of(page)
        .ok_or(Error::OutOfMemory { len: capacity })?;
    Ok((cap, page))
}

impl MappedMemory {
    /// A shared file of `capacity` bytes (rounded up to a page), mapped
    /// and empty. Nothing is committed until it is written.
    pub fn shared(capacity: usize) -> Result<Self, Error> {
        let (cap, page) = pages(capacity)?;
        // SAFETY: a NUL-terminated name and valid flags.
        let raw = unsafe {
            libc::memfd_create(
                c"zerohop-pool".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return Err(os_error("memfd_create"));
        }
        // SAFETY: `raw` is a descriptor just opened and owned by no one else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let len = libc::off_t::try_from(cap).map_err(|_| Error::OutOfMemory { len: cap })?;
        // SAFETY: a live descriptor of ours.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } != 0 {
            return Err(os_error("ftruncate"));
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: a live memfd made with MFD_ALLOW_SEALING.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(os_error("fcntl(F_ADD_SEALS)"));
        }
        // SAFETY: `st` is written by fstat before it is read.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a live descriptor and a stat buffer of the right size.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(os_error("fstat"));
        }
        let file = File { fd, ino: st.st_ino };
        Self::map(cap, page, Some(file))
    }

    /// Private memory of `capacity` bytes (rounded up to a page): address
    /// space only, inaccessible until a range of it is first handed out.
    pub fn private(capacity: usize) -> Result<Self, Error> {
        let (cap, page) = pages(capacity)?;
        Self::map(cap, page, None)
    }

    /// Maps `cap` bytes: the whole of `file`, or anonymous memory.
    fn map(cap: usize, page: usize, file: Option<File>) -> Result<Self, Error> {
        let (flags, fd, prot) = match &file {
            Some(f) => (
                libc::MAP_SHARED,
                f.fd.as_raw_fd(),
                libc::PROT_READ | libc::PROT_WRITE,
            ),
            // Inaccessible: strict overcommit charges a private mapping
            // once it is writable, whatever MAP_NORESERVE says.
            None => (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, libc::PROT_NONE),
        };
        // SAFETY: a new mapping (of the whole file, whose size is sealed, or
        // anonymous), placed by the kernel: it overlaps nothing of ours.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                cap,
                prot,
                flags | libc::MAP_NORESERVE,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_error("mmap"));
        }
        let base = NonNull::new(p.cast::<u8>()).ok_or(Error::OutOfMemory { len: cap })?;
        let opened = if file.is_some() { cap } else { 0 };
        Ok(MappedMemory {
            file,
            base,
            cap,
            page,
            opened: AtomicUsize::new(opened),
            ranges: Mutex::new(Ranges {
                free: vec![(0, cap)],
                live: Vec::new(),
                warm: 0,
            }),
            overflow: HeapMemory::new(),
        })
    }

    /// The mapping's size.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Bytes of live ranges now (whole pages), and of overflow ranges.
    pub fn allocated(&self) -> usize {
        self.lock().live.iter().map(|&(_, n)| n).sum::<usize>() + self.overflow.allocated()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ranges> {
        // Each update is whole under the lock: a panic cannot leave it half done.
        self.ranges.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn base_addr(&self) -> u64 {
        self.base.as_ptr().addr() as u64
    }

    /// Whether `addr..addr + len` lies inside the mapping.
    fn inside(&self, addr: u64, len: usize) -> Option<usize> {
        let off = addr.checked_sub(self.base_addr())?;
        let end = off.checked_add(len as u64)?;
        (end <= self.cap as u64).then_some(off as usize)
    }

    /// A pointer to `region`'s first byte, if it lies inside the
    /// accessible part of the mapping or one overflow range. The mapping
    /// stays whole while this value lives, and what was opened stays open,
    /// so such a region is memory; which ranges are whose is the pool's to
    /// keep (a lookup of the live ranges here, under their lock, would cost
    /// every view of a lease a lock, for nothing `host_bytes` needs).
    pub fn pointer(&self, region: Region) -> Option<NonNull<u8>> {
        let Some(off) = self.inside(region.addr, region.len) else {
            return self.overflow.pointer(region);
        };
        // Acquire: pairs with the store after the `mprotect` that opened it.
        if off + region.len > self.opened.load(Ordering::Acquire) {
            return None;
        }
        // SAFETY: `off + region.len` is inside the mapping (checked above).
        Some(unsafe { self.base.add(off) })
    }

    /// Where `addr..addr + len` lies in the file, if it does (never in
    /// private memory).
    pub fn place(&self, addr: u64, len: usize) -> Option<SharedPlace> {
        let file = self.file.as_ref()?;
        let off = self.inside(addr, len)?;
        Some(SharedPlace {
            fd: u32::try_from(file.fd.as_raw_fd()).ok()?,
            ino: file.ino,
            offset: off as u64,
        })
    }

    /// A range of the mapping for `len` bytes aligned to `align` (as an
    /// address), first fit; `None` where none is free (or none can be
    /// opened).
    fn place_range(&self, len: usize, align: usize) -> Option<Region> {
        let want = len.max(1).checked_next_multiple_of(self.page)?;
        let align = align.max(1);
        let base = self.base_addr() as usize;
        let mut r = self.lock();
        // First fit, the start aligned as an address (the mapping is only
        // page-aligned).
        let fit = r.free.iter().enumerate().find_map(|(i, &(off, n))| {
            let start = (base + off).checked_next_multiple_of(align)? - base;
            (start.checked_add(want)? <= off + n).then_some((i, start))
        });
        let (i, start) = fit?;
        // Relaxed: `opened` changes under the lock held here.
        let from = self.opened.load(Ordering::Relaxed);
        if start + want > from {
            // Private memory: open the pages up to the range's end (those
            // between were free, and opening them early harms nothing).
            // SAFETY: pages of our own mapping (`from..start + want` lies
            // inside it), none of them viewed while inaccessible.
            let rc = unsafe {
                libc::mprotect(
                    self.base.as_ptr().add(from).cast(),
                    start + want - from,
                    libc::PROT_READ | libc::PROT_WRITE,
                )
            };
            if rc != 0 {
                // Strict overcommit refused the charge: the heap may not.
                return None;
            }
            // Release: a view of the range (`pointer`) sees it open.
            self.opened.store(start + want, Ordering::Release);
        }
        let (off, n) = r.free.remove(i);
        // What the aligned range leaves either side stays free.
        let mut k = i;
        if start > off {
            r.free.insert(k, (off, start - off));
            k += 1;
        }
        if start + want < off + n {
            r.free.insert(k, (start + want, off + n - start - want));
        }
        let at = r.live.partition_point(|&(o, _)| o < start);
        r.live.insert(at, (start, want));
        Some(Region {
            addr: (base + start) as u64,
            len,
            kind: MemKind::Host,
        })
    }

    /// Gives the pages of the free range `off..off + n` back to the kernel;
    /// they read zero when next touched.
    fn drop_pages(&self, off: usize, n: usize) {
        match &self.file {
            // SAFETY: a live descriptor; the range is inside the file and
            // no live range overlaps it.
            Some(f) => unsafe {
                libc::fallocate(
                    f.fd.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    off as libc::off_t,
                    n as libc::off_t,
                )
            },
            // SAFETY: a range of our own private mapping that no live range
            // overlaps (the pool holds no view of it).
            None => unsafe {
                libc::madvise(self.base.as_ptr().add(off).cast(), n, libc::MADV_DONTNEED)
            },
        };
    }
}

impl RawMemory for MappedMemory {
    fn alloc(&self, len: usize, align: usize) -> Result<Region, Error> {
        match self.place_range(len, align) {
            Some(r) => Ok(r),
            // Full, or too cut up: the heap serves it, as it would have.
            None => self.overflow.alloc(len, align),
        }
    }

    fn free(&self, region: Region) -> Result<(), Error> {
        let Some(off) = self.inside(region.addr, region.len) else {
            return self.overflow.free(region);
        };
        let mut r = self.lock();
        let i = r
            .live
            .binary_search_by_key(&off, |&(o, _)| o)
            .map_err(|_| Error::Backend("free of memory this mapping did not allocate"))?;
        let (off, n) = r.live.remove(i);
        // Back into the free list, joined with its neighbours.
        let at = r.free.partition_point(|&(o, _)| o < off);
        r.free.insert(at, (off, n));
        if at + 1 < r.free.len() && r.free[at].0 + r.free[at].1 == r.free[at + 1].0 {
            r.free[at].1 += r.free.remove(at + 1).1;
        }
        if at > 0 && r.free[at - 1].0 + r.free[at - 1].1 == r.free[at].0 {
            r.free[at - 1].1 += r.free.remove(at).1;
        }
        r.warm += n;
        if r.warm > WARM_MAX {
            r.warm = 0;
            // (Private pages never opened were never committed.)
            // Relaxed: `opened` changes under the lock held here.
            let opened = self.opened.load(Ordering::Relaxed);
            for &(off, n) in &r.free {
                let end = (off + n).min(opened);
                if end > off {
                    self.drop_pages(off, end - off);
                }
            }
        }
        Ok(())
    }

    fn host_visible(&self) -> bool {
        true
    }
}

impl Drop for MappedMemory {
    fn drop(&mut self) {
        // SAFETY: our own mapping of `cap` bytes; no view outlives the pool
        // that owns this value.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.cap) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(
        miri,
        ignore = "memfd_create, mmap, mprotect, fallocate and madvise are system calls miri does not run"
    )]
    fn ranges_are_aligned_disjoint_zeroed_and_join_again_when_freed() {
        for (m, shared) in both(1 << 20) {
            let page = m.page;
            let a = m.alloc(5000, 64).unwrap();
            let b = m.alloc(64 << 10, 64 << 10).unwrap();
            assert_eq!(b.addr % (64 << 10), 0, "aligned as an address");
            let a_len = 5000usize.next_multiple_of(page);
            let b_len = (64usize << 10).next_multiple_of(page);
            assert!(a.addr + a_len as u64 <= b.addr || b.addr + b_len as u64 <= a.addr);
            assert_eq!(m.allocated(), a_len + b_len);
            let p = m.pointer(a).unwrap();
            // SAFETY: a live range of 5000 bytes, viewed only here.
            let bytes = unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), a.len) };
            assert!(bytes.iter().all(|&x| x == 0));
            bytes.fill(7);
            match m.place(a.addr, a.len) {
                Some(place) => assert_eq!(place.offset, a.addr - m.base_addr()),
                None => assert!(!shared, "a shared range has a place in its file"),
            }
            assert!(m.place(m.base_addr() + m.capacity() as u64, 1).is_none());
            m.free(a).unwrap();
            assert!(m.free(a).is_err(), "a second free of a range is refused");
            // The same range again, its pages still committed.
            let c = m.alloc(5000, 64).unwrap();
            assert_eq!(c.addr, a.addr, "first fit takes the freed range");
            m.free(b).unwrap();
            m.free(c).unwrap();
            assert_eq!(m.allocated(), 0);
            // Everything joined into one range again: the whole mapping fits.
            let all = m.alloc(m.capacity(), 1).unwrap();
            assert!(m.inside(all.addr, all.len).is_some(), "from the mapping");
            m.free(all).unwrap();
        }
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "memfd_create, mmap, mprotect, fallocate and madvise are system calls miri does not run"
    )]
    fn freed_pages_go_back_to_the_kernel_past_the_warm_bound() {
        for (m, _) in both(4 * WARM_MAX) {
            let page = m.page;
            let r = m.alloc(WARM_MAX, page).unwrap();
            let r2 = m.alloc(2 * page, page).unwrap();
            fill(&m, r, 1);
            assert!(committed(&m) >= WARM_MAX);
            m.free(r).unwrap();
            assert!(committed(&m) >= WARM_MAX, "kept warm up to the bound");
            m.free(r2).unwrap(); // past the bound now: every free range dropped
            assert_eq!(committed(&m), 0);
            let again = m.alloc(page, page).unwrap();
            // SAFETY: a live range of a page, viewed only here.
            let bytes =
                unsafe { std::slice::from_raw_parts(m.pointer(again).unwrap().as_ptr(), page) };
            assert!(bytes.iter().all(|&x| x == 0), "a dropped page reads zero");
        }
    }

    /// Ranges freed, each followed by a larger one that fresh pages serve:
    /// what stays committed of the freed ones is bounded all the same.
    #[test]
    #[cfg_attr(
        miri,
        ignore = "memfd_create, mmap, mprotect, fallocate and madvise are system calls miri does not run"
    )]
    fn freed_ranges_stay_committed_up_to_the_warm_bound_however_they_alternate() {
        for (m, _) in both(8 * WARM_MAX) {
            let page = m.page;
            let mut blockers = Vec::new();
            for n in [60usize, 61, 62, 63, 64] {
                let r = m.alloc(n << 20, page).unwrap();
                fill(&m, r, 1);
                blockers.push(m.alloc(page, page).unwrap()); // the next one cannot reuse it
                m.free(r).unwrap();
                assert!(
                    committed(&m) <= m.allocated() + WARM_MAX,
                    "after {n} MiB: {} MiB committed",
                    committed(&m) >> 20
                );
            }
        }
    }

    /// Private memory is reserved inaccessible, and opened only as far as
    /// ranges have been handed out: strict overcommit charges no more.
    #[test]
    #[cfg_attr(
        miri,
        ignore = "memfd_create, mmap, mprotect, fallocate and madvise are system calls miri does not run"
    )]
    fn private_memory_is_opened_only_as_far_as_ranges_were_handed_out() {
        let m = MappedMemory::private(16 << 20).unwrap();
        let a = m.alloc(1 << 20, m.page).unwrap();
        assert_eq!(a.addr, m.base_addr(), "first fit");
        let base = m.base_addr();
        let perms = |addr: u64| -> String {
            let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
            maps.lines()
                .find_map(|l| {
                    let (range, rest) = l.split_once(' ')?;
                    let (lo, hi) = range.split_once('-')?;
                    let (lo, hi) = (
                        u64::from_str_radix(lo, 16).ok()?,
                        u64::from_str_radix(hi, 16).ok()?,
                    );
                    (lo <= addr && addr < hi).then(|| rest[..4].to_string())
                })
                .unwrap()
        };
        assert_eq!(perms(base), "rw-p", "the range handed out");
        assert_eq!(perms(base + (1 << 20)), "---p", "past it: reserved only");
        let past = Region {
            addr: base + (1 << 20),
            len: 16,
            kind: MemKind::Host,
        };
        assert!(m.pointer(past).is_none(), "no view of what is not open");
        let shared = MappedMemory::shared(16 << 20).unwrap();
        assert_eq!(
            perms(shared.base_addr() + (8 << 20)),
            "rw-s",
            "a shared file's is whole"
        );
        m.free(a).unwrap();
    }

    /// A shared and a private mapping of `capacity` bytes, each with
    /// whether it is the shared one.
    fn both(capacity: usize) -> [(MappedMemory, bool); 2] {
        [
            (MappedMemory::shared(capacity).unwrap(), true),
            (MappedMemory::private(capacity).unwrap(), false),
        ]
    }

    /// Writes `byte` over `r`, a live range of `m` that nothing else views.
    fn fill(m: &MappedMemory, r: Region, byte: u8) {
        // SAFETY: a live range (the caller's), viewed only here.
        unsafe { std::slice::from_raw_parts_mut(m.pointer(r).unwrap().as_ptr(), r.len) }.fill(byte);
    }

    /// Bytes of the mapping in memory now (`mincore`: a file's pages in
    /// its page cache, private pages present).
    fn committed(m: &MappedMemory) -> usize {
        let mut pages = vec![0u8; m.capacity() / m.page];
        // SAFETY: our own page-aligned mapping of `capacity` bytes, and a
        // vector of one byte per page of it.
        let rc = unsafe { libc::mincore(m.base.as_ptr().cast(), m.capacity(), pages.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore");
        pages.iter().filter(|&&p| p & 1 != 0).count() * m.page
    }

    /// What does not fit comes from the heap: viewed, freed and counted as
    /// the mapping's own ranges are, with no place in a file.
    #[test]
    #[cfg_attr(
        miri,
        ignore = "memfd_create, mmap, mprotect, fallocate and madvise are system calls miri does not run"
    )]
    fn what_the_mapping_cannot_place_comes_from_the_heap() {
        for (m, _) in both(64 << 10) {
            let a = m.alloc(m.capacity(), 1).unwrap();
            let b = m.alloc(8 << 10, 64).unwrap();
            assert!(
                m.inside(b.addr, b.len).is_none(),
                "beyond the mapping's room"
            );
            assert_eq!(m.allocated(), m.capacity() + m.overflow.allocated());
            assert!(m.place(b.addr, b.len).is_none(), "no place in a file");
            fill(&m, b, 3);
            m.free(b).unwrap();
            assert!(
                m.free(b).is_err(),
                "a second free of an overflow range is refused"
            );
            let outside = Region {
                addr: 8,
                len: 16,
                kind: MemKind::Host,
            };
            assert!(m.free(outside).is_err());
            assert!(m.pointer(outside).is_none());
            m.free(a).unwrap();
            assert_eq!(m.allocated(), 0);
            // A length no page count can hold is refused, typed.
            assert!(matches!(
                m.alloc(usize::MAX, 1),
                Err(Error::OutOfMemory { .. })
            ));
        }
        assert!(matches!(
            MappedMemory::private(usize::MAX),
            Err(Error::OutOfMemory { .. })
        ));
    }
}
