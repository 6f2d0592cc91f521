//! The bell a host pool rings when a buffer comes back after it refused a
//! lease ([`zerohop_core::Bell`]): an eventfd, which a thread waiting for a
//! buffer polls beside its sockets, so that it wakes when the application
//! gives a buffer back from another thread rather than at its next look.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use zerohop_core::Bell;

/// An eventfd, or nothing where none could be made (then a waiter finds a
/// buffer back at its next look, as with no bell).
#[derive(Debug)]
pub struct HostBell {
    fd: Option<OwnedFd>,
}

impl Default for HostBell {
    fn default() -> Self {
        // SAFETY: eventfd takes no pointers; a descriptor it returns is new
        // and ours alone.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            info!("zerohop: no eventfd for a pool's bell ({}); waiters look again at their poll interval", e);
            return HostBell { fd: None };
        }
        // SAFETY: `fd` is a fresh descriptor owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        HostBell { fd: Some(fd) }
    }
}

impl HostBell {
    /// The descriptor to poll for readability: readable once rung, until
    /// [`clear`](Self::clear)ed.
    pub fn fd(&self) -> Option<RawFd> {
        self.fd.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// Another handle on the same bell (its eventfd duplicated): what a
    /// waiter keeps apart from the pool. `None` where the pool has no bell
    /// or no descriptor is left.
    pub fn try_clone(&self) -> Option<HostBell> {
        let fd = self.fd.as_ref()?.try_clone().ok()?;
        Some(HostBell { fd: Some(fd) })
    }

    /// Takes the rings so far: call it before looking at the pool, so that a
    /// buffer given back after the look rings anew.
    pub fn clear(&self) {
        let Some(fd) = &self.fd else { return };
        let mut count = 0u64;
        // SAFETY: a live eventfd and an 8-byte buffer, as eventfd reads take.
        // Nothing rung: EAGAIN, which is fine.
        unsafe { libc::read(fd.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
    }
}

impl Bell for HostBell {
    fn ring(&self) {
        let Some(fd) = &self.fd else { return };
        let one = 1u64;
        // SAFETY: a live eventfd and an 8-byte value, as eventfd writes take.
        // A counter near its maximum (never rung off) refuses: the fd is
        // readable already.
        unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(bell: &HostBell) -> bool {
        let mut p = libc::pollfd {
            fd: bell.fd().unwrap(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; no wait.
        unsafe { libc::poll(&mut p, 1, 0) == 1 }
    }

    #[test]
    #[cfg_attr(miri, ignore = "miri has no poll(2)")]
    fn a_rung_bell_is_readable_until_cleared() {
        let bell = HostBell::default();
        assert!(!readable(&bell), "a new bell is quiet");
        bell.ring();
        bell.ring();
        assert!(readable(&bell));
        bell.clear();
        assert!(!readable(&bell), "one clear takes every ring");
        bell.ring();
        assert!(readable(&bell));
        let other = bell.try_clone().unwrap();
        other.clear();
        assert!(!readable(&bell), "one bell, two handles");
        bell.ring();
        assert!(readable(&other));
    }
}
