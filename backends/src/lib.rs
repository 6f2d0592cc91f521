//! zerohop-backends: the memory, NICs and links behind zerohop-core's traits.
//!
//! One cargo feature per backend: `mock` (no_std, no alloc: arena memory, a
//! software NIC, a loopback link, fault injectors), `cuda-uma` (CUDA memory via
//! cudarc) and `gpudirect-verbs` (RDMA verbs via rdma-sys). `std` adds mapped
//! and heap memory. Every backend's memory that the CPU can read is a variant of
//! [`HostMemory`], so received bytes are viewed through one safe function,
//! [`host_bytes`].
#![cfg_attr(not(feature = "std"), no_std)]
#![warn(missing_docs)]

#[macro_use]
mod fmt;

#[cfg(all(feature = "std", target_os = "linux"))]
mod bell;

#[cfg(feature = "cuda-uma")]
pub mod cuda;
#[cfg(feature = "std")]
mod heap;
mod host;
#[cfg(all(feature = "std", target_os = "linux"))]
mod mapped;
#[cfg(feature = "mock")]
pub mod mock;
mod nic;
#[cfg(feature = "std")]
mod peers;
#[cfg(all(feature = "std", feature = "testing"))]
pub mod testing;
#[cfg(feature = "gpudirect-verbs")]
pub mod verbs;

#[cfg(all(feature = "std", target_os = "linux"))]
pub use bell::HostBell;
#[cfg(feature = "std")]
pub use heap::{HeapMemory, HeapTables};
#[cfg(all(feature = "std", target_os = "linux"))]
pub use host::shared_place;
pub use host::{host_bytes, host_bytes_mut, HostBacked, HostMemory, HostPool};
/// A pool that no thread waits on rings no bell (no OS to wake one with).
#[cfg(not(all(feature = "std", target_os = "linux")))]
pub type HostBell = zerohop_core::NoBell;
#[cfg(all(feature = "std", target_os = "linux"))]
pub use mapped::{MappedMemory, SharedPlace};
pub use nic::Nic;
#[cfg(feature = "std")]
pub use peers::{
    absence, counted_address, crowd_group, take_end, AcceptedPeers, Looks, PeerLimits, PeerSlots,
    Refusal, SessionClock, MAX_PEER_SLOTS, TAG_BIT,
};
