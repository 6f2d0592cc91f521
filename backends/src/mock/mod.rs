//! The mock backend: everything a real stack has, in software, with no heap.
//!
//! - [`Arena`]: [`RawMemory`](zerohop_core::RawMemory) over a caller-given `&'static mut [u8]`.
//! - [`MockNic`]: a software NIC — keys, bounds and access checks, counters,
//!   and a switch that refuses registrations (a fault).
//! - [`MockLink`]: a loopback pair of fixed byte rings carrying real frames.
//! - [`Faulty`]: wraps any [`Link`] and drops, corrupts, duplicates or
//!   reorders frames on a fixed schedule (smoltcp's `FaultInjector` idea).
//! - [`MockTransport`]: a [`Transport`](zerohop_core::Transport) over a link,
//!   receiving into a [`HostPool`](crate::HostPool).

mod arena;
mod faults;
mod link;
mod nic;
mod transport;

pub use arena::Arena;
pub use faults::{FaultCounts, FaultPlan, Faulty};
pub use link::{Link, LinkEnd, MockLink};
pub use nic::{MockNic, NicStats};
pub use transport::MockTransport;
