//! The facade's error: what failed, and for a peer, its address.

use std::fmt;
use std::net::SocketAddr;

use zerohop_core::{Kind, PickError};
use zerohop_std::ConfigError;

use crate::Peer;

/// A `Result` with zerohop's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything the facade can fail with. Errors that concern one peer name
/// its address.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// An environment variable is malformed (the text names it).
    Config(ConfigError),
    /// A setting cannot work (the text says which, and why).
    BadConfig(String),
    /// No transport can run as asked: an explicit choice names each missing
    /// prerequisite (`zerohop info` says why each one is missing).
    Unavailable(PickError),
    /// The transport was chosen but could not be set up (no device, no memory).
    Setup {
        /// The transport.
        kind: Kind,
        /// What failed.
        why: String,
    },
    /// `listen` or `connect` could not use an address.
    Address {
        /// `"listen on"` or `"connect to"`.
        op: &'static str,
        /// The address as given.
        addr: String,
        /// What failed (the last address tried, for a name with several).
        why: String,
    },
    /// A failure that concerns one peer: it went away, broke the protocol,
    /// or is not connected.
    Peer {
        /// The peer.
        peer: Peer,
        /// Its address, if it was ever known.
        addr: Option<SocketAddr>,
        /// What happened.
        error: zerohop_core::Error,
    },
    /// A message longer than its destination takes: the peer's limit (its
    /// `max_message`, itself bounded by its receive pool).
    TooLarge {
        /// The message's length.
        len: usize,
        /// The most the peer takes.
        max: usize,
        /// The peer's address.
        addr: Option<SocketAddr>,
    },
    /// A failure of the endpoint itself: a deadline, a closed endpoint, a
    /// pool with no room, a failing wire.
    Endpoint(zerohop_core::Error),
}

impl Error {
    /// The transport-level error underneath, where there is one.
    pub fn core(&self) -> Option<&zerohop_core::Error> {
        match self {
            Error::Peer { error, .. } | Error::Endpoint(error) => Some(error),
            _ => None,
        }
    }

    /// A deadline passed (the call may be tried again).
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Endpoint(zerohop_core::Error::Timeout))
    }

    /// The endpoint was closed.
    pub fn is_closed(&self) -> bool {
        matches!(self, Error::Endpoint(zerohop_core::Error::Closed))
    }

    /// The peer this error is about, if it is about one.
    pub fn peer(&self) -> Option<Peer> {
        match self {
            Error::Peer { peer, .. } => Some(*peer),
            _ => None,
        }
    }
}

/// `addr`, or the peer's number where no address is known.
struct Who<'a>(Peer, Option<&'a SocketAddr>);

impl fmt::Display for Who<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.1 {
            Some(a) => write!(f, "{a}"),
            None => write!(f, "{}", self.0),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use zerohop_core::Error as E;
        match self {
            Error::Config(e) => e.fmt(f),
            Error::BadConfig(why) => f.write_str(why),
            Error::Unavailable(e) => e.fmt(f),
            Error::Setup { kind, why } => write!(f, "setting up {kind}: {why}"),
            Error::Address { op, addr, why } => write!(f, "{op} {addr}: {why}"),
            Error::Peer { peer, addr, error } => {
                let who = Who(*peer, addr.as_ref());
                match error {
                    E::PeerLost(_) => write!(
                        f,
                        "peer {who} went away; its in-flight messages were not delivered"
                    ),
                    E::PeerClosed(_) => write!(
                        f,
                        "peer {who} closed cleanly; every message it sent was delivered"
                    ),
                    E::UnknownPeer(_) => write!(f, "no connection to peer {who}"),
                    E::Protocol { error, .. } => write!(
                        f,
                        "peer {who} broke the protocol ({error}); connection closed"
                    ),
                    E::WireRule { rule, .. } => write!(
                        f,
                        "peer {who} broke the wire's rule: {rule}; connection closed"
                    ),
                    e => write!(f, "peer {who}: {e}"),
                }
            }
            Error::TooLarge { len, max, addr } => {
                write!(f, "a message of {len} bytes is longer than ")?;
                match addr {
                    Some(a) => write!(f, "peer {a}")?,
                    None => f.write_str("the peer")?,
                }
                write!(
                    f,
                    " takes ({max} bytes: its max_message, bounded by its receive pool)"
                )
            }
            Error::Endpoint(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Config(e) => Some(e),
            Error::Unavailable(e) => Some(e),
            Error::Peer { error, .. } | Error::Endpoint(error) => Some(error),
            _ => None,
        }
    }
}
