//! zerohop-std: zerohop on an operating system.
//!
//! - [`Endpoint`]: blocking `send`/`recv` with deadlines and cancellation over
//!   any core [`Transport`](zerohop_core::Transport), with a progress thread.
//! - [`tcp`]: the TCP wire (kind `tcp`, and kind `uma` when its pool is CUDA
//!   managed memory).
//! - [`Config::from_env`] and [`pick_from_env`]: which transport, how much pool.
#![warn(missing_docs)]

mod config;
mod doorbell;
mod endpoint;
mod host;
mod poller;
mod sync;
pub mod tcp;

pub use config::{parse_bytes, Config, ConfigError};
pub use endpoint::{CancelToken, Deadline, Endpoint, EndpointConfig, Event, Leaser, Waiter, Wire};
#[cfg(feature = "cuda-uma")]
pub use host::{cuda_pool, managed_pool};
pub use host::{heap_pool, pick_from_env, probe_host, PickFromEnvError, StdLease, StdPool};
pub use zerohop_backends::HeapTables;
