//! What the tests of more than one crate use (feature `testing`).

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

pub use zerohop_backends::testing::Reaped;
