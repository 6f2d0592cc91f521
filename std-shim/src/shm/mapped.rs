//! Large messages out of the peer's pool file: the sender's pool is one
//! shared-memory file (`zerohop_backends::MappedMemory::shared`), its descriptor
//! names where a message lies in it, and this side copies the bytes out of
//! its own read-only mapping of the file with `memcpy` — several times the
//! kernel's cross-memory copy (`process_vm_readv`, [`cma`](super::cma)),
//! which stays the way when this one cannot serve.
//!
//! The file is fetched from the peer's process by `pidfd_getfd`, which asks
//! the same right as `process_vm_readv`, and mapped once. Nothing the peer
//! says is taken on trust: the file must be the one the descriptor names
//! (its inode), a regular file of tmpfs (a hugetlbfs file passes every other
//! check and faults where huge pages run out), sealed against shrinking
//! and growing (looked at before its size: a mapping never reaches past
//! its end), and no larger than what this side allows a peer's files in
//! all (its own pool's budget, twice); the range must lie inside it. Any of
//! that failing sends the message the cross-memory way.
//!
//! What stays: a read of a hole in the peer's file commits the page there,
//! charged to this side's memory, until the peer's file is gone (the lane
//! ends). A hostile peer can make this side hold at most that limit so.

use std::ffi::c_void;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;

use rustix::fs::SealFlags;
use rustix::mm::{MapFlags, ProtFlags};
use rustix::process::{Pid, PidfdFlags, PidfdGetfdFlags};
use zerohop_backends::SharedPlace;

/// Files of one peer mapped at most (a pool is one file; one more allows
/// for a peer's pool coming and going).
const MAX_FILES: usize = 2;

/// `statfs`' word for tmpfs, where memfds live.
const TMPFS_MAGIC: u64 = 0x0102_1994;

struct Mapped {
    fd: u32,
    ino: u64,
    base: NonNull<u8>,
    len: usize,
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: the mapping this value made, unmapped once; copies out of
        // it borrow the `PeerFiles` that owns it.
        if unsafe { rustix::mm::munmap(self.base.as_ptr().cast::<c_void>(), self.len) }.is_err() {
            log::warn!("shm: unmapping a peer's pool file failed");
        }
    }
}

/// The peer's pool files this side has mapped.
pub(crate) struct PeerFiles {
    pidfd: Option<OwnedFd>,
    /// Newest last; the oldest goes when a new one would pass `MAX_FILES`.
    maps: Vec<Mapped>,
    /// Messages copied out of a mapping (a statistic the tests read).
    pub(crate) reads: u64,
    /// Bytes of the peer's files this side maps at most, in all (0: none).
    limit: usize,
}

// SAFETY: the mappings are this value's own, read only through `&mut self`.
unsafe impl Send for PeerFiles {}

impl PeerFiles {
    /// The files of process `pid` (`None`, or a process this side may not
    /// open: no file is ever mapped, every read says no), none mapped until
    /// [`allow`](Self::allow) says how much.
    pub(crate) fn new(pid: Option<i32>) -> Self {
        let pidfd = pid
            .and_then(Pid::from_raw)
            .and_then(|p| rustix::process::pidfd_open(p, PidfdFlags::empty()).ok());
        PeerFiles {
            pidfd,
            maps: Vec::new(),
            reads: 0,
            limit: 0,
        }
    }

    /// Whether the peer's process can be asked after (a pidfd).
    pub(crate) fn knows_process(&self) -> bool {
        self.pidfd.is_some()
    }

    /// Whether the peer's process has exited, as its pidfd says (a look
    /// that fails, interrupted, says nothing: no).
    pub(crate) fn process_exited(&self) -> bool {
        self.pidfd.as_ref().is_some_and(exited)
    }

    /// A second descriptor of the peer's pidfd, to ask after its process
    /// once this side's lane is gone.
    pub(crate) fn pidfd(&self) -> Option<OwnedFd> {
        self.pidfd.as_ref().and_then(|fd| fd.try_clone().ok())
    }

    /// Whether the peer's process has not exited (its pidfd is not yet
    /// readable). Asked after a read by its pid: a pid is free for another
    /// process only once its own has exited and been reaped, so a read
    /// followed by a yes read the peer, not a process that took its pid
    /// after it died (a peer killed outright ends nothing in the segment).
    /// No pidfd: no.
    pub(crate) fn process_alive(&self) -> bool {
        self.pidfd.as_ref().is_some_and(|fd| {
            crate::poller::ready_now(fd, rustix::event::PollFlags::IN).is_ok_and(|ev| ev.is_empty())
        })
    }

    /// Maps at most `bytes` of the peer's files, in all.
    pub(crate) fn allow(&mut self, bytes: usize) {
        self.limit = bytes;
    }

    /// Copies `dst.len()` bytes at `place` in the peer's file into `dst`.
    /// Whether it could (if not, `dst` may hold part of them).
    pub(crate) fn read(&mut self, place: SharedPlace, dst: &mut [u8]) -> bool {
        let Some(i) = self.find(place) else {
            return false;
        };
        let m = &self.maps[i];
        let inside = usize::try_from(place.offset)
            .ok()
            .and_then(|o| o.checked_add(dst.len()).map(|end| (o, end)))
            .filter(|&(_, end)| end <= m.len);
        let Some((offset, _)) = inside else {
            return false;
        };
        // SAFETY: `offset..offset + dst.len()` lies inside the mapping
        // (checked above), which is whole and cannot fault: the file's size
        // is sealed and it was mapped at that size. The peer may write the
        // bytes meanwhile; what lands in `dst` is then the peer's own
        // garbage, as any byte of its message could be.
        unsafe {
            std::ptr::copy_nonoverlapping(m.base.as_ptr().add(offset), dst.as_mut_ptr(), dst.len())
        };
        self.reads += 1;
        true
    }

    /// The mapping of the file `place` names, mapped now if it is new.
    fn find(&mut self, place: SharedPlace) -> Option<usize> {
        if let Some(i) = self
            .maps
            .iter()
            .position(|m| m.fd == place.fd && m.ino == place.ino)
        {
            return Some(i);
        }
        let pidfd = self.pidfd.as_ref()?;
        // A failure (not permitted, no such descriptor) is not the peer
        // breaking anything: the message goes the other way.
        let file = rustix::process::pidfd_getfd(
            pidfd,
            i32::try_from(place.fd).ok()?,
            PidfdGetfdFlags::empty(),
        )
        .ok()?;
        // The seals first: the size read after them is the size for good.
        let sealed = rustix::fs::fcntl_get_seals(&file)
            .is_ok_and(|s| s.contains(SealFlags::SHRINK | SealFlags::GROW));
        let st = rustix::fs::fstat(&file).ok()?;
        let regular = rustix::fs::FileType::from_raw_mode(st.st_mode).is_file();
        let tmpfs = rustix::fs::fstatfs(&file).is_ok_and(|f| f.f_type as u64 == TMPFS_MAGIC);
        let len = usize::try_from(st.st_size).ok().filter(|&n| n > 0)?;
        if !sealed || !regular || !tmpfs || st.st_ino != place.ino || len > self.limit {
            return None; // the other way
        }
        // Room for it within the limit: the oldest mappings go.
        while !self.maps.is_empty()
            && (self.maps.len() >= MAX_FILES
                || self.maps.iter().map(|m| m.len).sum::<usize>() + len > self.limit)
        {
            self.maps.remove(0);
        }
        // SAFETY: a fresh read-only shared mapping of the whole file, whose
        // size the seals fix (read after them): no memory of ours is
        // aliased, and no read through it can reach past the file's end.
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ,
                MapFlags::SHARED,
                &file,
                0,
            )
        }
        .ok()?;
        let base = NonNull::new(p.cast::<u8>())?;
        self.maps.push(Mapped {
            fd: place.fd,
            ino: place.ino,
            base,
            len,
        });
        Some(self.maps.len() - 1)
    }
}

/// Whether the process behind `pidfd` has exited (its pidfd readable); a
/// look that fails (interrupted) says no.
pub(crate) fn exited(pidfd: &OwnedFd) -> bool {
    crate::poller::ready_now(pidfd, rustix::event::PollFlags::IN).is_ok_and(|ev| !ev.is_empty())
}

#[cfg(test)]
mod tests {
    use super::PeerFiles;

    /// A process is alive to `process_alive` until it exits; after, and
    /// with no process to ask, it is not (reads by its pid are refused).
    #[test]
    fn a_peer_process_is_alive_until_it_exits() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let files = PeerFiles::new(Some(child.id() as i32));
        assert!(files.process_alive());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(
            !files.process_alive(),
            "exited (and reaped: its pid is free)"
        );
        assert!(!PeerFiles::new(None).process_alive());
    }
}
