//! The registration cache: which ranges are registered with the NIC, and under
//! which keys. Registering costs microseconds (UCX models ~16 µs + 0.06 ns/B);
//! a hit here costs a binary search.
//!
//! Entries never overlap and are kept sorted by start address, so the only
//! entry that can cover an address is the last one starting at or before it.
//! Removed handles (evicted, superseded, invalidated, duplicate) are handed to
//! the caller's `removed` callback: the caller collects them and deregisters
//! after releasing whatever lock guards the table.

use crate::error::MrError;
use crate::mem::{Access, MemKind, MrHandle, Region, Registrar};
use crate::Error;

/// Hit/miss/eviction counters of an [`MrTable`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct MrStats {
    /// Lookups answered from the table.
    pub hits: u64,
    /// Lookups that found no covering entry.
    pub misses: u64,
    /// Unpinned entries dropped to make room (least recently used first).
    pub evictions: u64,
    /// Entries dropped by [`MrTable::invalidate`] or superseded by a larger registration.
    pub invalidations: u64,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    handle: MrHandle,
    pins: u32,
    last_use: u64,
}

const EMPTY: Entry = Entry {
    handle: MrHandle {
        addr: 0,
        len: 0,
        lkey: 0,
        rkey: 0,
        access: Access::NONE,
        id: 0,
    },
    pins: 0,
    last_use: 0,
};

/// A fixed-capacity registration cache of `N` entries.
#[derive(Debug)]
pub struct MrTable<const N: usize> {
    /// Start addresses, sorted; kept apart from `entries` so the search touches one dense array.
    starts: [u64; N],
    entries: [Entry; N],
    len: usize,
    clock: u64,
    stats: MrStats,
}

impl<const N: usize> Default for MrTable<N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const N: usize> MrTable<N> {
    /// An empty table; `const` so it can live in a `static`.
    pub const fn new() -> Self {
        MrTable {
            starts: [0; N],
            entries: [EMPTY; N],
            len: 0,
            clock: 0,
            stats: MrStats {
                hits: 0,
                misses: 0,
                evictions: 0,
                invalidations: 0,
            },
        }
    }

    /// Entries held.
    pub const fn len(&self) -> usize {
        self.len
    }

    /// Whether no entry is held.
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The capacity `N`.
    pub const fn capacity(&self) -> usize {
        N
    }

    /// The counters.
    pub const fn stats(&self) -> MrStats {
        self.stats
    }

    /// The entries, in address order, with their pin counts.
    pub fn iter(&self) -> impl Iterator<Item = (MrHandle, u32)> + '_ {
        self.entries[..self.len].iter().map(|e| (e.handle, e.pins))
    }

    /// Index of the one entry that could cover `addr`: the last starting at or before it.
    /// How many entries start below `addr` (where one starting at `addr` goes).
    fn starting_below(&self, addr: u64) -> usize {
        self.starts[..self.len].partition_point(|&s| s < addr)
    }

    fn candidate(&self, addr: u64) -> Option<usize> {
        let after = self.starts[..self.len].partition_point(|&s| s <= addr);
        after.checked_sub(1)
    }

    fn find_covering(&self, addr: u64, len: usize, access: Access) -> Option<usize> {
        let i = self.candidate(addr)?;
        self.entries[i]
            .handle
            .covers(addr, len, access)
            .then_some(i)
    }

    fn touch(&mut self, i: usize) {
        self.clock += 1;
        self.entries[i].last_use = self.clock;
    }

    /// The registration covering `[addr, addr+len)` with at least `access`, if
    /// any. Counts a hit or a miss and marks the entry recently used; does not pin.
    pub fn lookup_covering(&mut self, addr: u64, len: usize, access: Access) -> Option<MrHandle> {
        match self.find_covering(addr, len, access) {
            Some(i) => {
                self.stats.hits += 1;
                self.touch(i);
                Some(self.entries[i].handle)
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Like [`lookup_covering`](Self::lookup_covering), and pins the entry on a
    /// hit: it will not be evicted until [`unpin`](Self::unpin)ned.
    pub fn pin_covering(&mut self, addr: u64, len: usize, access: Access) -> Option<MrHandle> {
        let handle = self.lookup_covering(addr, len, access)?;
        if let Some(i) = self.find_covering(addr, len, access) {
            self.entries[i].pins += 1;
        }
        Some(handle)
    }

    /// Drops one pin of the entry registered as `handle`.
    pub fn unpin(&mut self, handle: &MrHandle) -> Result<(), MrError> {
        let i = self.candidate(handle.addr).ok_or(MrError::NotFound)?;
        let e = &mut self.entries[i];
        if e.handle.id != handle.id || e.handle.addr != handle.addr || e.pins == 0 {
            return Err(MrError::NotFound);
        }
        e.pins -= 1;
        Ok(())
    }

    /// Adds a fresh registration, pinned once if `pinned`.
    ///
    /// - If an entry already covers its range with at least its access, that
    ///   entry is returned and the *new* handle goes to `removed`: a range is
    ///   never held twice.
    /// - Unpinned entries it overlaps are superseded (to `removed`); a pinned
    ///   one it overlaps is an error, and `handle` is handed to `removed`.
    /// - When full, the least recently used unpinned entry is evicted (to
    ///   `removed`); when every entry is pinned, [`MrError::Full`] and `handle`
    ///   goes to `removed`.
    pub fn insert(
        &mut self,
        handle: MrHandle,
        pinned: bool,
        removed: &mut impl FnMut(MrHandle),
    ) -> Result<MrHandle, MrError> {
        if let Some(i) = self.find_covering(handle.addr, handle.len, handle.access) {
            self.entries[i].pins += u32::from(pinned);
            self.touch(i);
            removed(handle);
            return Ok(self.entries[i].handle);
        }
        if let Some(e) = self.overlapping_pinned(handle.addr, handle.len) {
            removed(handle);
            return Err(MrError::OverlapsPinned {
                addr: e.addr,
                len: e.len,
            });
        }
        self.stats.invalidations +=
            self.remove_overlapping(handle.addr, handle.len, removed) as u64;
        if self.len == N {
            match self.least_recently_used_unpinned() {
                Some(victim) => {
                    removed(self.remove_at(victim));
                    self.stats.evictions += 1;
                }
                None => {
                    removed(handle);
                    return Err(MrError::Full { entries: N });
                }
            }
        }
        let at = self.starting_below(handle.addr);
        self.starts.copy_within(at..self.len, at + 1);
        self.entries.copy_within(at..self.len, at + 1);
        self.starts[at] = handle.addr;
        self.entries[at] = Entry {
            handle,
            pins: u32::from(pinned),
            last_use: 0,
        };
        self.len += 1;
        self.touch(at);
        Ok(handle)
    }

    /// Removes every entry overlapping `[addr, addr+len)`, pinned or not (the
    /// memory behind them is gone), handing each to `removed`. Returns how many.
    pub fn invalidate(
        &mut self,
        addr: u64,
        len: usize,
        removed: &mut impl FnMut(MrHandle),
    ) -> usize {
        let n = self.remove_overlapping(addr, len, removed);
        self.stats.invalidations += n as u64;
        n
    }

    /// Removes every entry, handing each to `removed` (for teardown).
    pub fn clear(&mut self, removed: &mut impl FnMut(MrHandle)) {
        for e in &self.entries[..self.len] {
            removed(e.handle);
        }
        self.len = 0;
    }

    /// The pinned registration covering `region` for `access`, registering it
    /// through `registrar` on a miss. Convenience for single-threaded callers:
    /// the registration call happens inside, so a caller holding a lock around
    /// the table should use [`pin_covering`](Self::pin_covering) and
    /// [`insert`](Self::insert) instead.
    pub fn get_or_register<R: Registrar + ?Sized>(
        &mut self,
        registrar: &R,
        region: Region,
        access: Access,
        removed: &mut impl FnMut(MrHandle),
    ) -> Result<MrHandle, Error> {
        region.validate()?;
        if let Some(h) = self.pin_covering(region.addr, region.len, access) {
            return Ok(h);
        }
        if let Some(e) = self.overlapping_pinned(region.addr, region.len) {
            return Err(Error::Mr(MrError::OverlapsPinned {
                addr: e.addr,
                len: e.len,
            }));
        }
        if self.len == N && self.least_recently_used_unpinned().is_none() {
            return Err(Error::Mr(MrError::Full { entries: N }));
        }
        let fresh = registrar.register(region, access)?;
        Ok(self.insert(fresh, true, removed)?)
    }

    fn overlapping_range(&self, addr: u64, len: usize) -> core::ops::Range<usize> {
        let probe = Region {
            addr,
            len,
            kind: MemKind::Host,
        };
        // Entries are disjoint and sorted: the overlapping ones are contiguous,
        // starting at the candidate for `addr` (if it reaches in) or just after.
        let mut first = self.starting_below(addr);
        if first > 0
            && self.entries[first - 1]
                .handle
                .region(MemKind::Host)
                .overlaps(addr, len)
        {
            first -= 1;
        }
        let mut last = first;
        while last < self.len
            && self.entries[last]
                .handle
                .region(MemKind::Host)
                .overlaps(probe.addr, probe.len)
        {
            last += 1;
        }
        first..last
    }

    fn overlapping_pinned(&self, addr: u64, len: usize) -> Option<MrHandle> {
        self.entries[self.overlapping_range(addr, len)]
            .iter()
            .find(|e| e.pins > 0)
            .map(|e| e.handle)
    }

    fn remove_overlapping(
        &mut self,
        addr: u64,
        len: usize,
        removed: &mut impl FnMut(MrHandle),
    ) -> usize {
        let range = self.overlapping_range(addr, len);
        let n = range.len();
        for e in &self.entries[range.clone()] {
            removed(e.handle);
        }
        self.starts.copy_within(range.end..self.len, range.start);
        self.entries.copy_within(range.end..self.len, range.start);
        self.len -= n;
        n
    }

    fn least_recently_used_unpinned(&self) -> Option<usize> {
        self.entries[..self.len]
            .iter()
            .enumerate()
            .filter(|(_, e)| e.pins == 0)
            .min_by_key(|(_, e)| e.last_use)
            .map(|(i, _)| i)
    }

    fn remove_at(&mut self, i: usize) -> MrHandle {
        let h = self.entries[i].handle;
        self.starts.copy_within(i + 1..self.len, i);
        self.entries.copy_within(i + 1..self.len, i);
        self.len -= 1;
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(addr: u64, len: usize, id: u32) -> MrHandle {
        MrHandle {
            addr,
            len,
            lkey: id,
            rkey: id,
            access: Access::LOCAL_WRITE,
            id,
        }
    }

    fn collect<const M: usize>(out: &mut [Option<MrHandle>; M]) -> impl FnMut(MrHandle) + '_ {
        move |x| {
            let slot = out
                .iter_mut()
                .find(|s| s.is_none())
                .expect("test buffer full");
            *slot = Some(x);
        }
    }

    #[test]
    fn lookup_finds_the_covering_entry_and_counts() {
        let mut t = MrTable::<4>::new();
        assert!(t.is_empty());
        assert_eq!(t.capacity(), 4);
        let mut sink = |_| panic!("nothing should be removed");
        t.insert(h(0x1000, 0x100, 1), false, &mut sink).unwrap();
        t.insert(h(0x3000, 0x100, 2), false, &mut sink).unwrap();
        assert_eq!(
            t.lookup_covering(0x1010, 0x10, Access::LOCAL_WRITE)
                .map(|x| x.id),
            Some(1)
        );
        assert_eq!(
            t.lookup_covering(0x10f0, 0x20, Access::LOCAL_WRITE),
            None,
            "straddles the end"
        );
        assert_eq!(t.lookup_covering(0x2000, 1, Access::NONE), None);
        assert_eq!(
            t.lookup_covering(0x3000, 1, Access::REMOTE_WRITE),
            None,
            "access not granted"
        );
        assert_eq!(t.stats().hits, 1);
        assert_eq!(t.stats().misses, 3);
        assert!(!t.is_empty());
    }

    #[test]
    fn unpin_takes_only_the_handle_it_pinned() {
        let mut t = MrTable::<4>::new();
        t.insert(h(0x1000, 0x100, 1), true, &mut |_| {}).unwrap();
        // Same place, another registration (a stale copy of an older one).
        assert_eq!(t.unpin(&h(0x1000, 0x100, 9)), Err(MrError::NotFound));
        assert_eq!(t.unpin(&h(0x1000, 0x100, 1)), Ok(()));
        assert_eq!(t.unpin(&h(0x1000, 0x100, 1)), Err(MrError::NotFound));
    }

    /// Registers fake handles with ids from 10 and counts the calls.
    struct Counting(core::cell::Cell<u32>);

    impl Registrar for Counting {
        fn register(&self, region: Region, access: Access) -> Result<MrHandle, crate::Error> {
            let id = 10 + self.0.get();
            self.0.set(self.0.get() + 1);
            Ok(MrHandle {
                access,
                ..h(region.addr, region.len, id)
            })
        }
        fn deregister(&self, _: MrHandle) -> Result<(), crate::Error> {
            Ok(())
        }
    }

    #[test]
    fn get_or_register_registers_only_what_the_table_can_keep() {
        let nic = Counting(core::cell::Cell::new(0));
        let at = |addr| Region {
            addr,
            len: 0x100,
            kind: MemKind::Host,
        };
        let mut t = MrTable::<2>::new();
        let a = t
            .get_or_register(&nic, at(0x1000), Access::LOCAL_WRITE, &mut |_| {})
            .unwrap();
        // Not full, though everything held is pinned: room for one more.
        let b = t
            .get_or_register(&nic, at(0x2000), Access::LOCAL_WRITE, &mut |_| {})
            .unwrap();
        assert_eq!((a.id, b.id, nic.0.get()), (10, 11, 2));
        // Full, every entry pinned: refused before the NIC is asked.
        assert_eq!(
            t.get_or_register(&nic, at(0x3000), Access::LOCAL_WRITE, &mut |_| {}),
            Err(crate::Error::Mr(MrError::Full { entries: 2 }))
        );
        assert_eq!(nic.0.get(), 2);
        // Covered: the entry again, no registration.
        let again = t
            .get_or_register(&nic, at(0x2000), Access::LOCAL_WRITE, &mut |_| {})
            .unwrap();
        assert_eq!((again.id, nic.0.get()), (11, 2));
    }

    #[test]
    fn a_covered_range_is_never_inserted_twice() {
        let mut t = MrTable::<4>::new();
        let mut removed = [None; 2];
        t.insert(h(0x1000, 0x1000, 1), false, &mut |_| {}).unwrap();
        let got = t
            .insert(h(0x1100, 0x10, 2), true, &mut collect(&mut removed))
            .unwrap();
        assert_eq!(got.id, 1);
        assert_eq!(
            removed[0].map(|x| x.id),
            Some(2),
            "the duplicate comes back for deregistration"
        );
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn full_table_evicts_the_least_recently_used_unpinned_entry() {
        let mut t = MrTable::<2>::new();
        let mut removed = [None; 2];
        t.insert(h(0x1000, 0x10, 1), false, &mut |_| {}).unwrap();
        t.insert(h(0x2000, 0x10, 2), false, &mut |_| {}).unwrap();
        t.lookup_covering(0x1000, 1, Access::NONE); // 1 is now the most recent
        t.insert(h(0x3000, 0x10, 3), false, &mut collect(&mut removed))
            .unwrap();
        assert_eq!(removed[0].map(|x| x.id), Some(2));
        assert_eq!(t.stats().evictions, 1);
    }

    #[test]
    fn every_entry_pinned_means_full_and_the_new_handle_comes_back() {
        let mut t = MrTable::<2>::new();
        t.insert(h(0x1000, 0x10, 1), true, &mut |_| {}).unwrap();
        t.insert(h(0x2000, 0x10, 2), true, &mut |_| {}).unwrap();
        let mut removed = [None; 1];
        assert_eq!(
            t.insert(h(0x3000, 0x10, 3), false, &mut collect(&mut removed)),
            Err(MrError::Full { entries: 2 })
        );
        assert_eq!(removed[0].map(|x| x.id), Some(3));
        t.unpin(&h(0x1000, 0x10, 1)).unwrap();
        t.insert(h(0x3000, 0x10, 4), false, &mut |_| {}).unwrap();
        assert_eq!(
            t.unpin(&h(0x1000, 0x10, 1)),
            Err(MrError::NotFound),
            "1 was evicted"
        );
    }

    #[test]
    fn invalidate_removes_every_overlapping_entry_even_pinned() {
        let mut t = MrTable::<8>::new();
        for (i, a) in [0x1000u64, 0x2000, 0x3000, 0x4000].iter().enumerate() {
            t.insert(h(*a, 0x100, i as u32), i == 1, &mut |_| {})
                .unwrap();
        }
        let mut removed = [None; 4];
        let n = t.invalidate(0x10ff, 0x2000, &mut collect(&mut removed));
        assert_eq!(n, 3);
        assert_eq!(t.len(), 1);
        assert_eq!(t.iter().next().map(|(x, _)| x.addr), Some(0x4000));
        assert_eq!(t.stats().invalidations, 3);
    }

    #[test]
    fn overlapping_a_pinned_entry_is_refused() {
        let mut t = MrTable::<4>::new();
        t.insert(h(0x1000, 0x100, 1), true, &mut |_| {}).unwrap();
        let mut removed = [None; 1];
        assert_eq!(
            t.insert(h(0x1080, 0x100, 2), false, &mut collect(&mut removed)),
            Err(MrError::OverlapsPinned {
                addr: 0x1000,
                len: 0x100
            })
        );
        assert_eq!(removed[0].map(|x| x.id), Some(2));
    }

    #[test]
    fn a_larger_registration_supersedes_unpinned_overlaps() {
        let mut t = MrTable::<4>::new();
        t.insert(h(0x1000, 0x100, 1), false, &mut |_| {}).unwrap();
        t.insert(h(0x1200, 0x100, 2), false, &mut |_| {}).unwrap();
        // Beside them, out of the way: it stays.
        t.insert(h(0x2000, 0x100, 4), false, &mut |_| {}).unwrap();
        let mut removed = [None; 3];
        let got = t
            .insert(h(0x1000, 0x400, 3), false, &mut collect(&mut removed))
            .unwrap();
        assert_eq!(got, h(0x1000, 0x400, 3), "the larger one is the entry now");
        // Exactly the two it covers came back, each once, for the caller to
        // deregister; the one beside them did not.
        let mut ids: [u32; 3] = [0; 3];
        for (i, x) in removed.iter().enumerate() {
            ids[i] = x.map_or(0, |x| x.id);
        }
        ids.sort_unstable();
        assert_eq!(ids, [0, 1, 2]);
        assert_eq!(t.len(), 2);
        assert_eq!(
            t.stats().invalidations,
            2,
            "superseded entries count as invalidated"
        );
        assert_eq!(t.stats().evictions, 0, "nothing was evicted for room");
        assert_eq!(
            t.lookup_covering(0x2000, 0x100, Access::NONE).map(|x| x.id),
            Some(4)
        );
        assert_eq!(
            t.lookup_covering(0x1200, 0x100, Access::NONE).map(|x| x.id),
            Some(3)
        );
    }
}
