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
    /// `listen` could not use an address, or `connect` could not resolve one.
    Address {
        /// `"listen on"` or `"connect to"`.
        op: &'static str,
        /// The address as given.
        addr: String,
        /// What failed (for `listen`, at the last address tried of a name
        /// with several).
        why: String,
    },
    /// `connect` reached no peer: each address of the name was tried, and
    /// each failed ([`ConnectError`] says why; [`Error::connect_error`]
    /// picks the attempt that got furthest).
    Connect {
        /// The address as given.
        addr: String,
        /// Each address tried, in order, and why it failed.
        tried: Vec<(SocketAddr, ConnectError)>,
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

    /// Why `connect` failed, for the address that got furthest (a refusal
    /// or another version over a host that did not answer; of several as
    /// far, the last tried).
    pub fn connect_error(&self) -> Option<&ConnectError> {
        match self {
            Error::Connect { tried, .. } => tried.iter().map(|(_, e)| e).max_by_key(|e| e.reach()),
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

/// Why `connect` could not make a peer of one address. A listener's answer
/// (refused, another version) is told apart from no answer at all, so that
/// a node can tell "try later, or elsewhere" from "nobody is there".
#[derive(Debug)]
#[non_exhaustive]
pub enum ConnectError {
    /// No connection was made: nothing listens there, the host cannot be
    /// reached, or it did not answer within the timeout (the system's error).
    Unreachable(std::io::Error),
    /// A connection was made, but no Hello came back within the timeout
    /// (or the wire's own handshake timeout, `idle_timeout`, if shorter):
    /// not a zerohop listener, or one too busy to answer.
    NoAnswer,
    /// A connection was made, and the other side ended it before its Hello
    /// came: not a zerohop listener, or one that went down.
    HungUp,
    /// The listener turned a newcomer away: it keeps as many peers as its
    /// limits allow (in all, or from this address; see
    /// [`PeerLimits`](crate::PeerLimits)), it is closing, or (over RDMA) it
    /// has no room for another connection now. Worth trying later, or
    /// elsewhere.
    Refused,
    /// The peer speaks another version of zerohop's protocol.
    Version {
        /// This side's.
        ours: u8,
        /// The peer's.
        theirs: u8,
    },
    /// The peer broke the protocol at the handshake: it does not speak zerohop.
    Protocol(zerohop_core::session::ProtocolError),
    /// Anything else: this side could not set the connection up, or the
    /// wire failed (the cause is kept).
    Other(Box<dyn std::error::Error + Send + Sync>),
}

impl ConnectError {
    /// How far the attempt got: an answer from a listener over silence, and
    /// silence over no connection.
    fn reach(&self) -> u8 {
        match self {
            ConnectError::Unreachable(_) => 0,
            ConnectError::Other(_) => 1,
            ConnectError::NoAnswer | ConnectError::HungUp => 2,
            ConnectError::Refused | ConnectError::Version { .. } | ConnectError::Protocol(_) => 3,
        }
    }
}

impl From<zerohop_core::Error> for ConnectError {
    /// The handshake's outcome on a wire whose session reports it
    /// (a deadline while the Hello was due is [`ConnectError::NoAnswer`]).
    fn from(e: zerohop_core::Error) -> Self {
        use zerohop_core::session::ProtocolError as P;
        use zerohop_core::wire::DecodeError as D;
        match e {
            zerohop_core::Error::Timeout => ConnectError::NoAnswer,
            // The peer went before its Hellos crossed (an answer would
            // have been a refusal or another version).
            zerohop_core::Error::PeerLost(_) | zerohop_core::Error::PeerClosed(_) => {
                ConnectError::HungUp
            }
            zerohop_core::Error::Protocol { error, .. } => match error {
                P::Refused => ConnectError::Refused,
                // The session's own handshake timer (`idle_timeout`) ran
                // out before the connect's: silence, not a broken protocol.
                P::Stalled {
                    during: zerohop_core::session::Stall::Handshake,
                } => ConnectError::NoAnswer,
                P::Decode(D::UnsupportedVersion { ours, theirs }) => {
                    ConnectError::Version { ours, theirs }
                }
                error => ConnectError::Protocol(error),
            },
            e => ConnectError::Other(Box::new(e)),
        }
    }
}

#[cfg(feature = "gpudirect-verbs")]
impl From<zerohop_backends::verbs::VerbsError> for ConnectError {
    fn from(e: zerohop_backends::verbs::VerbsError) -> Self {
        use std::io::{Error as Io, ErrorKind};
        use zerohop_backends::verbs::{cm::RejectReason, VerbsError as V};
        match e {
            V::NoListener => ConnectError::Unreachable(ErrorKind::ConnectionRefused.into()),
            V::Unreachable(why) => ConnectError::Unreachable(Io::new(ErrorKind::TimedOut, why)),
            V::NoHello => ConnectError::NoAnswer,
            // A listener that answered no: at its limits, out of room, or
            // (an older or foreign one) without saying why. A ring of ours
            // too shallow for it is this side's setting: `Other`.
            V::Rejected(Some(RejectReason::Refused | RejectReason::NoResources) | None) => {
                ConnectError::Refused
            }
            V::ShallowPeer { depth: Some(d) } => {
                ConnectError::Protocol(zerohop_core::session::ProtocolError::ShallowPeer {
                    ring: u16::try_from(d).unwrap_or(u16::MAX),
                })
            }
            V::Protocol(error) => zerohop_core::Error::Protocol {
                peer: zerohop_core::PeerId(u32::MAX),
                error,
            }
            .into(),
            e => ConnectError::Other(Box::new(e)),
        }
    }
}

impl fmt::Display for ConnectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConnectError::Unreachable(e) => write!(f, "no connection: {e}"),
            ConnectError::NoAnswer => f.write_str("no answer to our hello within the timeout"),
            ConnectError::HungUp => f.write_str("the other side hung up before its hello"),
            ConnectError::Refused => f.write_str(
                "refused: the listener keeps as many peers as its limits allow, or is closing",
            ),
            ConnectError::Version { ours, theirs } => write!(
                f,
                "the peer speaks protocol version {theirs}, this side {ours}"
            ),
            ConnectError::Protocol(e) => write!(f, "the peer broke the protocol ({e})"),
            ConnectError::Other(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for ConnectError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConnectError::Unreachable(e) => Some(e),
            ConnectError::Protocol(e) => Some(e),
            ConnectError::Other(e) => Some(&**e),
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
            Error::Connect { addr, tried } => {
                write!(f, "connect to {addr}: ")?;
                match &tried[..] {
                    [(_, e)] => e.fmt(f),
                    _ => {
                        for (i, (at, e)) in tried.iter().enumerate() {
                            let sep = if i == 0 { "" } else { "; " };
                            write!(f, "{sep}{at}: {e}")?;
                        }
                        Ok(())
                    }
                }
            }
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
            Error::Connect { .. } => self.connect_error().map(|e| e as _),
            _ => None,
        }
    }
}
