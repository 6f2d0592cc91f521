//! zerohop: messages between peers that land where a GPU (or a DPU's
//! firmware) reads them — straight into GPU memory over RDMA, into CUDA
//! managed memory, or over plain TCP when the host has nothing better, with
//! the reason a faster path was not taken.
//!
//! One [`Endpoint`] whatever the transport: [`Endpoint::open`] picks it
//! (`ZEROHOP_TRANSPORT`, or the best this host runs: gpudirect, rdma, uma,
//! then tcp), then [`listen`](Endpoint::listen) and
//! [`connect`](Endpoint::connect) take host names or IP addresses, and
//! messages and peers arrive as [`Event`]s.
//!
//! ```
//! use std::time::Duration;
//! use zerohop::{Config, Endpoint, Event};
//!
//! # fn main() -> zerohop::Result<()> {
//! let server = Endpoint::open(Config::only(zerohop::Kind::Tcp))?;
//! let addr = server.listen("127.0.0.1:0")?;
//! let client = Endpoint::open(Config::only(zerohop::Kind::Tcp))?;
//! let peer = client.connect(addr, Duration::from_secs(5))?;
//! client.send(peer, b"block 1")?;
//!
//! // The server learns the peer, then its message.
//! let Event::Connected { peer: from, .. } = server.next_event(Duration::from_secs(5))? else {
//!     panic!("a connection first");
//! };
//! let m = server.recv(Duration::from_secs(5))?;
//! assert_eq!((m.peer(), m.bytes()), (from, Some(&b"block 1"[..])));
//! # Ok(())
//! # }
//! ```
//!
//! A message in host or CUDA managed memory reads as `&[u8]`
//! ([`Message::bytes`]); one in managed or device memory gives the address
//! a kernel reads ([`Message::device_ptr`]). Features: `cuda-uma` (the
//! `uma` transport, and `gpudirect` with the next), `gpudirect-verbs`
//! (`rdma`), `tokio` (async sends, receives and event streams).
//!
//! The layers below, for what this crate does not cover, are
//! [`zerohop_core`] (no_std: pools, the registration cache, the session
//! engine), [`zerohop_backends`] and [`zerohop_std`].
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod endpoint;
mod error;
mod message;
#[cfg(feature = "tokio")]
#[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
pub mod tokio;

pub use config::Config;
pub use endpoint::{Endpoint, Events, PeerStats};
pub use error::{ConnectError, Error, Result};
pub use message::{Event, Message, Peer, SendBuffer};
pub use zerohop_backends::PeerLimits;
pub use zerohop_core::{Capabilities, Choice, Kind, MemKind, PickError, Preference, Skipped};

// The README's code, compiled and run as doc-tests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
