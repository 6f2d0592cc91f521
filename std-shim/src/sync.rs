//! The endpoint's threads, locks and flags: std's, or loom's when built with
//! `--cfg loom`, so the model checker runs the real endpoint code (its send,
//! receive, flush, close and progress loop) under every interleaving.

#[cfg(not(loom))]
pub(crate) use std::{
    sync::atomic::{AtomicBool, AtomicUsize},
    sync::{Arc, Condvar, Mutex, MutexGuard, TryLockError},
    thread,
};

#[cfg(loom)]
pub(crate) use loom::{
    sync::atomic::{AtomicBool, AtomicUsize},
    sync::{Arc, Condvar, Mutex, MutexGuard},
    thread,
};
/// loom's `try_lock` reports std's error type.
#[cfg(loom)]
pub(crate) use std::sync::TryLockError;
