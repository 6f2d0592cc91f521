//! Typed errors: small `Copy` enums, no strings built at run time.

use core::fmt;

use crate::mem::MemKind;
use crate::session::ProtocolError;
use crate::transport::PeerId;

/// Everything a zerohop operation can fail with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum Error {
    /// Nothing can be done now; try again after progress. Not a failure.
    WouldBlock,
    /// The transport or endpoint was closed.
    Closed,
    /// A deadline passed.
    Timeout,
    /// The operation's cancellation token fired.
    Cancelled,
    /// No connection to that peer exists.
    UnknownPeer(PeerId),
    /// The peer went away (reset, EOF mid-message, QP in error); its in-flight
    /// messages were not delivered.
    PeerLost(PeerId),
    /// The peer closed cleanly: every message it sent has been delivered.
    PeerClosed(PeerId),
    /// A message longer than the configured maximum.
    TooLarge {
        /// Length asked for.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A peer broke the protocol (or went silent mid-frame); its connection
    /// was closed and nothing after the fault was delivered.
    Protocol {
        /// The peer.
        peer: PeerId,
        /// What was wrong.
        error: ProtocolError,
    },
    /// A peer broke a rule of the wire itself (not of the protocol every
    /// wire shares); its connection was closed.
    WireRule {
        /// The peer.
        peer: PeerId,
        /// The rule.
        rule: &'static str,
    },
    /// A message of `len` bytes from `peer` can never get a receive
    /// buffer: the pool refused it (`why`) while the wire's own receive
    /// buffers were all it had out, so none could come back. Its connection
    /// was closed; a larger receive pool holds it.
    NoReceiveBuffer {
        /// The peer.
        peer: PeerId,
        /// The message's length.
        len: usize,
        /// The pool's refusal.
        why: PoolError,
    },
    /// The slab pool could not serve a lease.
    Pool(PoolError),
    /// The registration cache could not take an entry.
    Mr(MrError),
    /// A registration was refused.
    Register(RegisterError),
    /// A memory source had no room for `len` bytes.
    OutOfMemory {
        /// Bytes asked for.
        len: usize,
    },
    /// A memory source returned memory that is not aligned as asked.
    Misaligned {
        /// The address it returned.
        addr: u64,
        /// The alignment asked for.
        align: usize,
    },
    /// Host code asked to read memory the CPU cannot see (GPU device memory).
    NotHostVisible(MemKind),
    /// An operating-system or driver call failed: the call, and its error
    /// number (`errno` for verbs and sockets, the `CUresult` for CUDA).
    Call {
        /// The failing call (e.g. `"ibv_post_send"`).
        call: &'static str,
        /// Its error number.
        code: i32,
    },
    /// The device or its driver does not do this (the call answered
    /// `EOPNOTSUPP`): a property of the host, not a passing failure.
    Unsupported {
        /// The call that said so.
        call: &'static str,
    },
    /// A backend condition with no error number behind it (the text says which).
    Backend(&'static str),
    /// A setting cannot work; the text names it and what it needs.
    BadConfig(&'static str),
}

impl Error {
    /// The peer a failure of its connection alone names: that peer is lost,
    /// and the transport serves the others on. `None` for a failure of the
    /// call or of the whole transport (a clean close, `PeerClosed`, is not a
    /// loss).
    pub fn lost_peer(&self) -> Option<PeerId> {
        match *self {
            Error::PeerLost(peer)
            | Error::Protocol { peer, .. }
            | Error::WireRule { peer, .. }
            | Error::NoReceiveBuffer { peer, .. } => Some(peer),
            _ => None,
        }
    }

    /// The peer whose end this is: one lost ([`lost_peer`](Self::lost_peer)),
    /// or one that closed cleanly (`PeerClosed`).
    pub fn ended_peer(&self) -> Option<PeerId> {
        match *self {
            Error::PeerClosed(peer) => Some(peer),
            ref e => e.lost_peer(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::WouldBlock => f.write_str("operation would block"),
            Error::Closed => f.write_str("transport closed"),
            Error::Timeout => f.write_str("deadline passed"),
            Error::Cancelled => f.write_str("cancelled"),
            Error::UnknownPeer(p) => write!(f, "no connection to peer {p}"),
            Error::PeerLost(p) => write!(
                f,
                "peer {p} went away; its in-flight messages were not delivered"
            ),
            Error::PeerClosed(p) => write!(
                f,
                "peer {p} closed cleanly; every message it sent was delivered"
            ),
            Error::TooLarge { len, max } => {
                write!(f, "message of {len} bytes exceeds the maximum of {max}")
            }
            Error::Protocol { peer, error } => write!(
                f,
                "peer {peer} broke the protocol ({error}); connection closed"
            ),
            Error::WireRule { peer, rule } => {
                write!(
                    f,
                    "peer {peer} broke the wire's rule: {rule}; connection closed"
                )
            }
            Error::NoReceiveBuffer { peer, len, why } => write!(
                f,
                "peer {peer}'s message of {len} bytes can never get a receive buffer \
                 (pool: {why}); connection closed"
            ),
            Error::Pool(e) => write!(f, "pool: {e}"),
            Error::Mr(e) => write!(f, "registration cache: {e}"),
            Error::Register(e) => write!(f, "registration: {e}"),
            Error::OutOfMemory { len } => write!(f, "memory source has no room for {len} bytes"),
            Error::Misaligned { addr, align } => {
                write!(
                    f,
                    "memory source returned {addr:#x}, not aligned to {align}"
                )
            }
            Error::NotHostVisible(k) => write!(f, "{} memory is not visible to the CPU", k.name()),
            Error::Call { call, code } => write!(f, "{call} failed (error {code})"),
            Error::Unsupported { call } => {
                write!(f, "{call}: not supported by this device or driver")
            }
            Error::Backend(what) => f.write_str(what),
            Error::BadConfig(what) => write!(f, "unusable setting: {what}"),
        }
    }
}

impl core::error::Error for Error {}

/// Why the slab pool could not serve a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum PoolError {
    /// Growing would pass the byte budget. `used` is what the pool already holds.
    Exhausted {
        /// Bytes the pool holds from its memory source.
        used: usize,
        /// The budget.
        cap: usize,
    },
    /// A zero-length lease.
    ZeroLength,
    /// Every slot descriptor is in use (the pool's `SLOTS` capacity).
    TooManyBuffers {
        /// The capacity.
        slots: usize,
    },
    /// Every chunk descriptor is in use (the pool's `CHUNKS` capacity).
    TooManyChunks {
        /// The capacity.
        chunks: usize,
    },
    /// The configuration is unusable (classes unsorted, zero, or larger than a chunk).
    BadConfig,
}

impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolError::Exhausted { used, cap } => {
                write!(f, "pool exhausted: {used} of {cap} bytes in use")
            }
            PoolError::ZeroLength => f.write_str("zero-length lease"),
            PoolError::TooManyBuffers { slots } => {
                write!(f, "all {slots} buffer descriptors in use")
            }
            PoolError::TooManyChunks { chunks } => {
                write!(f, "all {chunks} chunk descriptors in use")
            }
            PoolError::BadConfig => {
                f.write_str("size classes must be non-zero, ascending and fit a chunk")
            }
        }
    }
}

impl core::error::Error for PoolError {}

/// Why the registration cache could not take an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum MrError {
    /// Every entry is pinned: nothing can be evicted.
    Full {
        /// The table's capacity.
        entries: usize,
    },
    /// The range overlaps a pinned entry that does not cover it.
    OverlapsPinned {
        /// Start of the pinned entry.
        addr: u64,
        /// Its length.
        len: usize,
    },
    /// No entry matches the handle.
    NotFound,
}

impl fmt::Display for MrError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MrError::Full { entries } => write!(f, "all {entries} entries are pinned"),
            MrError::OverlapsPinned { addr, len } => {
                write!(
                    f,
                    "range overlaps the pinned registration [{addr:#x}, +{len})"
                )
            }
            MrError::NotFound => f.write_str("no such registration"),
        }
    }
}

impl core::error::Error for MrError {}

/// Why a registration was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum RegisterError {
    /// Zero-length range.
    ZeroLength,
    /// `addr + len` wraps the address space.
    AddressWraps {
        /// Start.
        addr: u64,
        /// Length.
        len: usize,
    },
    /// The range is not memory this NIC knows (the mock NIC's arena bounds).
    OutOfBounds,
    /// The NIC cannot register this kind of memory (e.g. CUDA managed memory).
    Unsupported(MemKind),
    /// The NIC's own table is full.
    NicFull,
    /// Refused on purpose (a fault injector).
    Refused,
}

impl fmt::Display for RegisterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RegisterError::ZeroLength => f.write_str("zero-length range"),
            RegisterError::AddressWraps { addr, len } => {
                write!(f, "range [{addr:#x}, +{len}) wraps the address space")
            }
            RegisterError::OutOfBounds => f.write_str("range outside the memory this NIC knows"),
            RegisterError::Unsupported(MemKind::Managed) => f.write_str(
                "CUDA managed memory cannot be registered with a NIC (the driver will not export it as a DMA-buf)",
            ),
            RegisterError::Unsupported(k) => write!(f, "{} memory cannot be registered here", k.name()),
            RegisterError::NicFull => f.write_str("the NIC's registration table is full"),
            RegisterError::Refused => f.write_str("registration refused (fault injected)"),
        }
    }
}

impl core::error::Error for RegisterError {}

impl From<PoolError> for Error {
    fn from(e: PoolError) -> Self {
        Error::Pool(e)
    }
}
impl From<MrError> for Error {
    fn from(e: MrError) -> Self {
        Error::Mr(e)
    }
}
impl From<RegisterError> for Error {
    fn from(e: RegisterError) -> Self {
        Error::Register(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What names one lost peer, and what does not: a clean close, a
    /// failure of the call, of the whole transport.
    #[test]
    fn a_failure_of_one_connection_names_its_peer_and_nothing_else_does() {
        let p = PeerId(7);
        for e in [
            Error::PeerLost(p),
            Error::Protocol {
                peer: p,
                error: crate::session::ProtocolError::RingOverrun,
            },
            Error::WireRule { peer: p, rule: "r" },
            Error::NoReceiveBuffer {
                peer: p,
                len: 1,
                why: PoolError::ZeroLength,
            },
        ] {
            assert_eq!(e.lost_peer(), Some(p), "{e}");
        }
        for e in [
            Error::PeerClosed(p),
            Error::UnknownPeer(p),
            Error::Pool(PoolError::ZeroLength),
            Error::Call {
                call: "ibv_post_send",
                code: 12,
            },
            Error::Closed,
        ] {
            assert_eq!(e.lost_peer(), None, "{e}");
        }
    }
}
