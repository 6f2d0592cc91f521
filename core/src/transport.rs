//! The transport contract every backend implements: non-blocking, sans-wait.

use core::fmt;

use crate::pick::Kind;
use crate::Error;

/// A peer's number on one transport (assigned by the transport, dense from 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct PeerId(pub u32);

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// What a transport can do. Built from `Default` and adjusted; more fields may come.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub struct Capabilities {
    /// Received bytes land in memory a GPU kernel reads in place.
    pub gpu_resident: bool,
    /// `try_send_lease` sends from the pool buffer without a copy.
    pub zero_copy: bool,
    /// Expected small-message one-way latency, microseconds (a hint for pick reports).
    pub min_latency_us: u32,
}

impl Capabilities {
    /// Capabilities with every field given (the struct is `#[non_exhaustive]`).
    pub const fn new(gpu_resident: bool, zero_copy: bool, min_latency_us: u32) -> Self {
        Capabilities {
            gpu_resident,
            zero_copy,
            min_latency_us,
        }
    }
}

/// A received message: who sent it, and the pool buffer it landed in.
#[derive(Debug)]
pub struct Received<L> {
    /// The sender.
    pub peer: PeerId,
    /// The buffer; dropping it gives it back to the receive pool.
    pub lease: L,
}

/// A lease handed back by a send that could not take it, with the reason.
#[derive(Debug)]
pub struct Rejected<L> {
    /// Why (`WouldBlock` means: try again after progress).
    pub error: Error,
    /// The lease, untouched.
    pub lease: L,
}

/// A message transport. Every method returns at once: [`Error::WouldBlock`] is a
/// value meaning "not now", never a spin inside the backend.
pub trait Transport {
    /// The pool buffer type messages arrive in (and zero-copy sends leave from).
    type Lease;

    /// Which kind of transport this is.
    fn kind(&self) -> Kind;

    /// A short name for reports (defaults to the kind's name).
    fn name(&self) -> &'static str {
        self.kind().name()
    }

    /// What it can do.
    fn caps(&self) -> Capabilities;

    /// Queues a copy of `bytes` for `peer`.
    fn try_send(&mut self, peer: PeerId, bytes: &[u8]) -> Result<(), Error>;

    /// Queues a pool buffer for `peer` without copying; hands it back on refusal.
    fn try_send_lease(
        &mut self,
        peer: PeerId,
        lease: Self::Lease,
    ) -> Result<(), Rejected<Self::Lease>>;

    /// The next received message, or `WouldBlock`. Errors concerning one peer
    /// (lost, corrupt frames) are reported here once each.
    fn try_recv(&mut self) -> Result<Received<Self::Lease>, Error>;

    /// Moves queued work along (flush sends, accept, read). Returns whether
    /// anything happened, so a caller knows when to back off.
    fn progress(&mut self) -> Result<bool, Error>;

    /// Stops accepting work; what is queued is flushed by further `progress`
    /// or reported failed. Idempotent.
    fn close(&mut self) -> Result<(), Error>;
}
