//! zerohop-std: zerohop on an operating system.
//!
//! - [`Endpoint`]: blocking `send`/`recv`/`next_event` with deadlines and
//!   cancellation over any [`Wire`] (a core
//!   [`Transport`](zerohop_core::Transport) with descriptors to wait on),
//!   progressed by the caller or by a progress thread. Applications use the
//!   `zerohop` crate's endpoint, which drives this one.
//! - [`tcp`]: the TCP wire (kind `tcp`, and kind `uma` when its pool is CUDA
//!   managed memory).
//! - [`shm`]: the same-host lane (kind `shm`): TCP whose peers on this host
//!   move to shared-memory rings.
//! - [`Config::from_env`] (which transport, how much pool) and
//!   [`probe_host`] (what this host has), which `zerohop::Endpoint::open` picks from.
#![warn(missing_docs)]

mod config;
mod doorbell;
pub mod endpoint;
mod host;
mod poller;
pub mod shm;
mod sync;
pub mod tcp;
#[cfg(feature = "testing")]
pub mod testing;
mod waiting_room;

pub use config::{parse_bytes, Config, ConfigError};
// What a driver implements beyond `Wire` (`Waiter`, `Leaser`) stays in `endpoint`.
pub use endpoint::{CancelToken, Deadline, Endpoint, EndpointConfig, Event, Wire};
#[cfg(feature = "cuda-uma")]
pub use host::{cuda_pool, managed_pool};
pub use host::{private_pool, probe_host, shared_pool, StdLease, StdPool};
