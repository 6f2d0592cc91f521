//! How the progress thread sleeps and is woken.
//!
//! On an OS it waits in `poll(2)` on the transport's descriptors plus the read
//! end of a socket pair; `ring` writes a byte to the other end. Rings are
//! level-triggered and coalesce (a full socket already holds a pending one),
//! so a ring that comes while the thread is busy is seen when it next sleeps.
//! Under loom the same contract is a flag and a condvar, and there is no
//! timeout: a wake-up the endpoint forgot to send is a deadlock loom reports,
//! not a stall the poll interval hides.

#[cfg(not(loom))]
pub(crate) use self::os::Doorbell;

#[cfg(loom)]
pub(crate) use self::model::Doorbell;

#[cfg(not(loom))]
mod os {
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    use std::time::Duration;

    /// A wake-up socket pair.
    #[derive(Debug)]
    pub(crate) struct Doorbell {
        tx: UnixStream,
        rx: UnixStream,
    }

    impl Doorbell {
        pub(crate) fn new() -> std::io::Result<Self> {
            let (tx, rx) = UnixStream::pair()?;
            tx.set_nonblocking(true)?;
            rx.set_nonblocking(true)?;
            Ok(Doorbell { tx, rx })
        }

        /// Wakes the sleeper (now, or at its next sleep).
        pub(crate) fn ring(&self) {
            // A full socket already holds a pending ring: WouldBlock is fine.
            let _ = (&self.tx).write(&[1]);
        }

        /// Sleeps until one of `fds` is ready, a ring, or `timeout`; consumes
        /// the rings. Returns whether anything woke it before the timeout.
        /// `fds` is left as given (its `revents` aside), so a caller may
        /// sleep on it again.
        pub(crate) fn sleep(&self, fds: &mut Vec<libc::pollfd>, timeout: Duration) -> bool {
            fds.push(libc::pollfd {
                fd: self.rx.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
            let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: `fds` is a valid, exclusively borrowed array of
            // `fds.len()` pollfd structs for the duration of the call. A
            // descriptor closed by another thread meanwhile only yields
            // POLLNVAL or a spurious wake-up.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            if fds.pop().is_some_and(|w| w.revents != 0) {
                let mut sink = [0u8; 64];
                while matches!((&self.rx).read(&mut sink), Ok(n) if n > 0) {}
            }
            n != 0
        }
    }
}

#[cfg(loom)]
mod model {
    use std::time::Duration;

    use crate::sync::{Condvar, Mutex};

    /// The pipe's contract, for the model checker: a sticky flag.
    #[derive(Debug)]
    pub(crate) struct Doorbell {
        rung: Mutex<bool>,
        bell: Condvar,
    }

    impl Doorbell {
        pub(crate) fn new() -> std::io::Result<Self> {
            Ok(Doorbell {
                rung: Mutex::new(false),
                bell: Condvar::new(),
            })
        }

        pub(crate) fn ring(&self) {
            *self.rung.lock().unwrap() = true;
            self.bell.notify_one();
        }

        /// Model transports have no descriptors; loom has no clock, so
        /// every sleep ends with a ring.
        pub(crate) fn sleep(&self, fds: &mut Vec<libc::pollfd>, _timeout: Duration) -> bool {
            assert!(fds.is_empty(), "model transports have no descriptors");
            let mut rung = self.rung.lock().unwrap();
            while !*rung {
                rung = self.bell.wait(rung).unwrap();
            }
            *rung = false;
            true
        }
    }
}
