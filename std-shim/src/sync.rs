//! The endpoint's threads, locks and flags, and the same-host ring's atomics:
//! std's, or loom's when built with `--cfg loom`, so the model checker runs
//! the real endpoint code (its send, receive, flush, close and progress
//! loop) and the real ring under every interleaving.

#[cfg(not(loom))]
pub(crate) use std::{
    sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize},
    sync::{Arc, Condvar, Mutex, MutexGuard, TryLockError},
    thread,
};

#[cfg(loom)]
pub(crate) use loom::{
    sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize},
    sync::{Arc, Condvar, Mutex, MutexGuard},
    thread,
};
/// loom's `try_lock` reports std's error type.
#[cfg(loom)]
pub(crate) use std::sync::TryLockError;
