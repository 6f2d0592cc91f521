//! zerohop-core: the vocabulary every zerohop backend speaks.
//!
//! Sans-I/O: memory is *described* here ([`Region`]), never dereferenced; the
//! registration cache ([`MrTable`]), the slab pool ([`SlabPool`]), the frame
//! codec ([`wire`]) and the transport choice ([`pick`]) are plain state
//! machines over fixed-capacity tables. No heap, no unsafe, no OS.
#![no_std]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[cfg(any(test, loom, feature = "testing"))]
extern crate std;

// The log facade comes first so every later module sees its macros.
#[macro_use]
mod fmt;

mod crc;
mod error;
mod local_pool;
mod mem;
mod mr_table;
mod pick;
pub mod pool;
pub mod session;
mod sync;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
mod transport;
pub mod wire;

pub use crc::crc32c;
pub use error::{Error, MrError, PoolError, RegisterError};
pub use local_pool::LocalPool;
pub use mem::{Access, MemKind, MrHandle, RawMemory, Region, Registrar};
pub use mr_table::{MrStats, MrTable};
pub use pick::{
    pick, Choice, Detail, Kind, KindSet, PickError, Preference, Prereq, PrereqSet, Probe, Skipped,
    Status, UnknownPreference,
};
// The pool's plumbing (its tables, chunk sources, tickets) stays in `pool`.
pub use pool::{Bell, Lease, NoBell, Pool, PoolConfig, PoolStats, SizeClasses, SlabPool};
pub use transport::{Capabilities, PeerId, Received, Rejected, Transport};
