//! What the tests of more than one crate use (feature `testing`).

use std::process::Child;
use std::time::Duration;

/// CPU time the calling thread has used: a test that something waits
/// asleep, not spinning, compares it with the wall time that passed.
pub fn thread_cpu() -> Duration {
    // SAFETY: getrusage writes the struct it is given, which is plain data.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_THREAD measures the calling thread.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) };
    assert_eq!(rc, 0, "getrusage");
    let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    Duration::from_micros(us(u.ru_utime) + us(u.ru_stime))
}

/// A helper process, killed and reaped when dropped: a test that fails
/// with one running leaves none behind (it would hold the test's output
/// open, and a pipe read to its end would wait for ever).
#[derive(Debug)]
pub struct Reaped(pub Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl std::ops::Deref for Reaped {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Reaped {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}
