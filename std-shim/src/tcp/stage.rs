//! A peer's stage: where its headers, small payloads and read-ahead land
//! before they are parsed (see the module docs above).

use std::ffi::c_void;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use rustix::mm::{Advice, MapFlags, ProtFlags};

use super::STAGE_BYTES;

/// `STAGE_BYTES` of anonymous memory mapped for one peer, or nothing
/// (`Stage::default()`, a quiet peer's). Mapped, not taken from the heap:
/// a page is resident only once bytes land in it (a quiet peer's Hello
/// touches one of sixteen), the kernel hands it over zeroed, and an unmapped
/// stage goes back to the system at once. (On the heap, zeroed, 1 000 quiet
/// peers held 64 KiB each, and the stages given back stayed in the process:
/// 43 MB of heap after they went quiet; `tests/tcp_memory.rs`.)
#[derive(Debug, Default)]
pub(super) struct Stage {
    /// Its mapping, `STAGE_BYTES` long; `None` when given back.
    base: Option<NonNull<u8>>,
}

// SAFETY: the mapping is owned by this value alone (no alias escapes it but
// through `&self`/`&mut self` borrows), like a `Box<[u8]>`.
unsafe impl Send for Stage {}
// SAFETY: as above; shared access only reads.
unsafe impl Sync for Stage {}

impl Stage {
    /// Maps the stage if it has none (the first read, or the first after a
    /// quiet spell gave it back).
    pub(super) fn ready(&mut self) -> std::io::Result<()> {
        if self.base.is_none() {
            // SAFETY: a fresh private anonymous mapping at an address the
            // kernel picks: no memory of anyone else's is touched.
            let p = unsafe {
                rustix::mm::mmap_anonymous(
                    std::ptr::null_mut(),
                    STAGE_BYTES,
                    ProtFlags::READ | ProtFlags::WRITE,
                    MapFlags::PRIVATE,
                )
            }?;
            // Small pages only: adjacent stages merge into one region, and a
            // host whose transparent huge pages are "always" would fault in
            // 2 MiB, 32 peers' stages, at a stage's first byte. Advice only.
            // SAFETY: the mapping just made, its whole length.
            let _ = unsafe { rustix::mm::madvise(p, STAGE_BYTES, Advice::LinuxNoHugepage) };
            self.base = NonNull::new(p.cast::<u8>());
        }
        Ok(())
    }

    /// Gives the mapping back (a quiet peer's).
    pub(super) fn release(&mut self) {
        *self = Stage::default();
    }
}

impl Deref for Stage {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self.base {
            // SAFETY: `base` maps `STAGE_BYTES` readable bytes for as long as
            // `self` lives, and `&self` excludes a `&mut` to them.
            Some(p) => unsafe { std::slice::from_raw_parts(p.as_ptr(), STAGE_BYTES) },
            None => &[],
        }
    }
}

impl DerefMut for Stage {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self.base {
            // SAFETY: as in `deref`, and `&mut self` makes this the only
            // borrow of them.
            Some(p) => unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), STAGE_BYTES) },
            None => &mut [],
        }
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        if let Some(p) = self.base.take() {
            // SAFETY: the mapping `ready` made, `STAGE_BYTES` long, with no
            // borrow of it left (`&mut self`). A failure leaves it mapped.
            let _ = unsafe { rustix::mm::munmap(p.as_ptr().cast::<c_void>(), STAGE_BYTES) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stage_is_zeroed_writable_and_given_back() {
        let mut s = Stage::default();
        assert!(s.is_empty());
        s.ready().unwrap();
        assert_eq!(s.len(), STAGE_BYTES);
        assert!(s.iter().all(|&b| b == 0));
        s[STAGE_BYTES - 1] = 7;
        s.ready().unwrap(); // kept
        assert_eq!(s[STAGE_BYTES - 1], 7);
        s.release();
        assert!(s.is_empty());
        s.ready().unwrap();
        assert_eq!(s[STAGE_BYTES - 1], 0, "a fresh mapping");
    }
}
