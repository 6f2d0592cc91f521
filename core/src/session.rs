//! The per-peer session engine: the zerohop protocol, once, for every wire.
//!
//! **Sans-I/O.** A [`Session`] never reads a clock, a socket, a queue pair or
//! memory. It is a state machine over frame headers (byte slices), lengths
//! and caller-supplied times ([`Instant`]). A *driver* (TCP sockets, verbs
//! queue pairs, the mock link, shared-memory rings) moves bytes and calls it:
//!
//! - **handle** what arrived: [`handle_header`](Session::handle_header) (32
//!   header bytes) or, on a stream wire,
//!   [`handle_short_record`](Session::handle_short_record) (32 bytes that
//!   head a whole message), then [`handle_payload`](Session::handle_payload)
//!   once the frame's payload is where the engine said it goes;
//!   [`handle_headerless`](Session::handle_headerless) for a frame that came
//!   whole as its bytes alone (verbs' immediate data);
//!   [`handle_timeout`](Session::handle_timeout) for the clock;
//! - **commands** from the application: [`send`](Session::send) (a message's
//!   length: its sequence number and byte credit), [`close`](Session::close),
//!   [`consumed`](Session::consumed) (the application took a message: its
//!   bytes come back as credit), [`reposted`](Session::reposted) (ring wires:
//!   receive slots posted again), [`grant`](Session::grant) (a message longer
//!   than the window may come);
//! - **poll** for what to do next: [`next_frame`](Session::next_frame) (the
//!   next fragment of a message: its header and where its payload lies in the
//!   message), [`poll_control`](Session::poll_control) (Hello, Credit, Want,
//!   Close headers to send), [`poll_timeout`](Session::poll_timeout) (when to
//!   call back).
//!
//! The engine owns, per peer: sequence numbers (a gap or a duplicate fails
//! the session; nothing out of order is delivered), byte credit (a peer can
//! make the receiver hold at most the bytes it was granted: the window, and
//! a message longer than the window only once the receiver [grants](Session::grant)
//! it), frame credit on ring wires (never more frames than posted receive
//! slots: data and control frames each have slots of their own, see
//! [`CONTROL_SLOTS`]), fragmentation and reassembly, the headerless-or-framed choice, the
//! Hello exchange (no data before it, a peer of another version refused by
//! name), a clean Close, the idle timer (a peer silent mid-handshake or
//! mid-frame fails) and a minimum rate while a message is under way
//! ([`SessionConfig::min_rate`]: a drip of bytes cannot hold a buffer).
//! Every failure is a typed [`ProtocolError`]; none panics,
//! and no arithmetic on a received field can overflow.

use core::fmt;
use core::time::Duration;

use crate::transport::PeerId;
use crate::wire::{
    Close, Credit, Data, DataFlags, DecodeError, Decoded, Frame, FrameKind, Hello, Host, HostStep,
    ShortRecord, Takes, Want, HEADER_LEN, MAX_FRAME_CREDITS,
};

/// A point in time: microseconds from an origin the driver chooses (a
/// monotonic clock's). Only differences matter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Instant(u64);

impl Instant {
    /// `micros` microseconds after the origin.
    pub const fn from_micros(micros: u64) -> Instant {
        Instant(micros)
    }

    /// Microseconds since the origin.
    pub const fn as_micros(self) -> u64 {
        self.0
    }

    /// `self + d`, saturating at the end of time.
    #[must_use]
    pub fn after(self, d: Duration) -> Instant {
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        Instant(self.0.saturating_add(micros))
    }
}

/// What one side of a session takes and does. Both sides of a connection
/// tell each other theirs in their Hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct SessionConfig {
    /// The longest message this side takes.
    pub max_message: u32,
    /// Message bytes the peer may send before this side returns credit: the
    /// most a peer can make this side hold, besides what it [grants](Session::grant).
    pub window: u32,
    /// The longest frame payload this side takes (its receive buffers on a
    /// ring wire; `max_message` on a stream wire, which does not fragment).
    pub frame_max: u32,
    /// Receive slots this side keeps posted for data frames (ring wires:
    /// the peer's frame credits), besides [`CONTROL_SLOTS`] more for control
    /// frames ([`posted_slots`](Self::posted_slots) in all); 0 on a stream
    /// wire, where frames are not counted.
    pub ring: u16,
    /// This side takes headerless frames: a wire whose frames carry
    /// immediate data (verbs, its payloads in host memory) or a short
    /// record (a same-host lane). Not a ring rule: stream wires (lanes)
    /// take them in builds without `ring-credits` too.
    pub takes_headerless: bool,
    /// This wire can send headerless frames (it carries immediate data).
    pub sends_headerless: bool,
    /// Checksum the payloads this side sends, where it can read them.
    pub check_payload: bool,
    /// A peer silent this long mid-handshake, mid-frame or mid-message fails.
    pub idle_timeout: Duration,
    /// Bytes a second a peer must keep up, on average, while a message of
    /// its is under way, after a grace of `idle_timeout` (0: no minimum).
    /// A peer that sends a byte now and then, never silent for the idle
    /// timeout, would otherwise hold the buffer of a message it never
    /// finishes for good; now holding one costs it this rate. A driver
    /// tells the engine when this side held the peer back
    /// ([`Session::handle_held`]): that time is not held against it.
    pub min_rate: u32,
    /// This side's part in the same-host exchange (see [`HostRole`]).
    pub host: HostRole,
}

/// Where a side runs, offered so that two sides on one host can move their
/// session to shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct HostOffer {
    /// A digest of the host's boot id and the IPC, mount and network
    /// namespaces: equal only where memory can be shared.
    pub host: u64,
    /// The offering process.
    pub pid: u32,
    /// With `pid`, names where the offering side takes the segment.
    pub nonce: u32,
}

/// A side's part in the same-host exchange, which a wire that can find
/// peers on one host (TCP) runs right after the Hellos: the connecting side
/// sends one Host frame (an offer, or none), the accepting side answers an
/// offer, and no data goes either way until that is settled. A side that
/// accepts hands the session over: its driver starts a fresh one in the
/// shared memory and drops this one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum HostRole {
    /// No exchange: this wire cannot move a session (verbs, the mock link).
    None,
    /// The connecting side: offers this host, or (`None`) says it will not.
    Offer(Option<HostOffer>),
    /// The accepting side: waits for the peer's Host frame and answers an
    /// offer (see [`Session::answer_host`]).
    Answer,
}

impl SessionConfig {
    /// A stream wire's settings (TCP, the mock link): no ring, no
    /// fragmentation, a 16 MiB window, messages up to `max_message`.
    pub const fn stream(max_message: u32) -> SessionConfig {
        SessionConfig {
            max_message,
            window: 16 << 20,
            frame_max: max_message,
            ring: 0,
            takes_headerless: false,
            sends_headerless: false,
            check_payload: false,
            idle_timeout: Duration::from_secs(5),
            min_rate: MIN_RATE,
            host: HostRole::None,
        }
    }

    /// Receive slots a ring wire keeps posted: the data ring and the
    /// [`CONTROL_SLOTS`] (0 on a stream wire).
    pub const fn posted_slots(&self) -> u32 {
        if self.ring == 0 {
            0
        } else {
            self.ring as u32 + CONTROL_SLOTS
        }
    }

    /// Whether the settings can work: every limit non-zero (a ring of 0
    /// is a stream wire's).
    pub fn check(&self) -> Result<(), &'static str> {
        if self.max_message == 0 || self.window == 0 || self.frame_max == 0 {
            return Err("SessionConfig: max_message, window and frame_max must be non-zero");
        }
        if self.ring != 0 && !RING {
            return Err("SessionConfig: a ring wire needs zerohop-core's ring-credits feature");
        }
        if self.idle_timeout.is_zero() {
            return Err("SessionConfig: idle_timeout must be non-zero");
        }
        Ok(())
    }
}

/// The default [`SessionConfig::min_rate`]: 64 KiB a second, a slow
/// home uplink's. A peer slower than that for longer than the idle
/// timeout's grace fails mid-message (`Stalled { during: Stall::Slow }`);
/// holding a window's buffer costs a stranger that much of its bandwidth.
pub const MIN_RATE: u32 = 64 << 10;

/// How many times [`SessionConfig::min_rate`] a message under way must
/// keep up while it holds receive room that other peers wait for (see
/// [`Session::slow_under_contention`]): 1 MiB/s at the default rate.
pub const CONTENDED_RATE_FACTOR: u32 = 16;

/// The shallowest data ring a ring wire may have: one slot moves messages
/// (slowly); control frames have slots of their own ([`CONTROL_SLOTS`]).
pub const MIN_RING: u16 = 1;

/// Receive slots a ring wire keeps posted for control frames (Hello, Credit,
/// Want, Close, Host), besides its data ring. Every frame takes one of the
/// peer's posted receives; a control frame's goes straight back (nothing of
/// it is kept), so the slots a peer's control frames take never wait for
/// the application, as data slots do while it holds their buffers.
///
/// Each side counts the other's control slots apart from its data slots,
/// and returns them on every frame it sends (2 bits of a data frame's
/// header and of its immediate data, a byte of a Credit frame). The rules
/// that keep both sides moving (see `Session::credit_due`):
/// - a side returns control slots in a Credit frame of their own only once
///   it owes [`CONTROL_SLOTS`]` - 1` of them, that is once the peer is down
///   to its last: so such a frame (which takes one of the peer's) never
///   calls for an answer of its own, and credit frames answering credit
///   frames die out;
/// - a side's last control slot goes only with a Credit frame that returns
///   control slots: two sides can then never both be left with none;
/// - data slots the application gave back go to a peer that cannot post
///   data (this side's count of what it may send says so) at once, else a
///   quarter of the ring at a time. No side need say that it waits.
pub const CONTROL_SLOTS: u32 = 3;

/// What the peer announced in its Hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct PeerParams {
    /// Its window (our first byte limit).
    pub window: u32,
    /// The longest message it takes.
    pub max_message: u32,
    /// The longest frame payload it takes.
    pub frame_max: u32,
    /// Its receive ring (0: none).
    pub ring: u16,
    /// It takes headerless frames.
    pub takes_headerless: bool,
    /// It takes data frames naming device memory ([`DataFlags::DEVICE`]).
    pub takes_device: bool,
    /// Its connection token.
    pub token: u32,
}

/// What has crossed a session: per-peer counters for reports (what UCX and
/// NCCL users read of their endpoints).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct SessionStats {
    /// Messages started toward the peer.
    pub messages_sent: u64,
    /// Their bytes.
    pub bytes_sent: u64,
    /// Messages received whole.
    pub messages_received: u64,
    /// Their bytes.
    pub bytes_received: u64,
    /// Times a send waited for credit: a message short of byte credit
    /// (counted once per message), a frame short of the peer's ring slots
    /// (once per frame).
    pub credit_stalls: u64,
}

/// Where a session is stuck when a deadline passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Stall {
    /// The peer's Hello never came, or its part of the same-host exchange.
    Handshake,
    /// A frame or a message was begun and not finished.
    Frame,
    /// A message under way came slower than [`SessionConfig::min_rate`];
    /// or, with other peers waiting for the receive room or grants it
    /// held, it was the slowest holder ([`Session::slow_under_contention`]:
    /// a message slower than 16 times `min_rate`, or a grant left unused).
    Slow,
}

/// Why a session failed: the peer broke the protocol, or went silent mid-way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum ProtocolError {
    /// Bytes that are not a valid header (or a payload that fails its checksum).
    Decode(DecodeError),
    /// The first frame was not a Hello.
    HelloExpected {
        /// What came instead.
        got: FrameKind,
    },
    /// A Close where the peer's Hello was due: it refused the session (a
    /// listener with as many peers as it keeps answers so).
    Refused,
    /// A second Hello, or a Hello for a second connection where a main one was due.
    UnexpectedHello,
    /// A Host frame out of its place (on a wire without the exchange, a
    /// second one, an answer nobody asked for).
    UnexpectedHost,
    /// Something else came where the same-host exchange's Host frame was due.
    HostExpected {
        /// What came instead.
        got: FrameKind,
    },
    /// A Hello with a zero window, message or frame limit.
    BadHello,
    /// A ring-wire peer whose ring is shallower than [`MIN_RING`].
    ShallowPeer {
        /// The ring it announced.
        ring: u16,
    },
    /// A message's sequence number skipped: messages were lost.
    SequenceGap {
        /// The number expected.
        expected: u64,
        /// The one that came.
        got: u64,
    },
    /// A sequence number already delivered came again.
    Duplicate {
        /// The repeated number.
        seq: u64,
    },
    /// The 2^64th message: sequence numbers ran out.
    SequenceExhausted,
    /// A message that would end past the byte limit this side granted.
    CreditExceeded {
        /// The limit granted (message bytes, counted from the first).
        limit: u64,
        /// Where the message would end.
        end: u64,
    },
    /// More frames than this side had posted receive slots for.
    RingOverrun,
    /// More frame credits returned than the peer's ring holds (on a wire
    /// without frame credit, a stream's, any).
    TooManyCredits,
    /// A message longer than this side takes.
    TooLarge {
        /// Its length.
        len: u32,
        /// The longest this side takes.
        max: u32,
    },
    /// A frame whose payload is not as long as its header declares (frame wires).
    FrameLength {
        /// Payload bytes the header declares.
        declared: usize,
        /// Payload bytes that came.
        carried: usize,
    },
    /// Fragments that do not add up to their message (its length changed,
    /// it overran, or ended without or continued past its last fragment).
    Fragment,
    /// A headerless frame to a side that does not take them, or inside a fragmented message.
    HeaderlessRefused,
    /// A frame naming the peer's device memory on a wire that cannot reach it.
    DeviceRefused,
    /// A Want at the wrong offset, or for a message this side does not take.
    BadWant,
    /// A frame after the peer's Close.
    AfterClose,
    /// A Close in the middle of a message.
    Unfinished,
    /// Silent past the idle timeout, or too slow mid-message.
    Stalled {
        /// Where it stopped.
        during: Stall,
    },
    /// Let go to make room: a listener that kept as many peers as it
    /// takes let this one go for a newcomer, having heard nothing from it
    /// for an idle timeout or more.
    Evicted,
}

impl fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProtocolError::Decode(e) => e.fmt(f),
            ProtocolError::HelloExpected { got } => {
                write!(f, "expected a hello first, got a {} frame", got.name())
            }
            ProtocolError::Refused => {
                f.write_str("the peer closed where its hello was due: it refused the session")
            }
            ProtocolError::UnexpectedHello => f.write_str("a hello where none was due"),
            ProtocolError::UnexpectedHost => f.write_str("a host frame where none was due"),
            ProtocolError::HostExpected { got } => write!(
                f,
                "a {} frame where the same-host exchange's host frame was due",
                got.name()
            ),
            ProtocolError::BadHello => f.write_str("a hello with a zero limit"),
            ProtocolError::ShallowPeer { ring } => write!(
                f,
                "the peer announced a receive ring of {ring}; the least that keeps credit moving is {MIN_RING}"
            ),
            ProtocolError::SequenceGap { expected, got } => {
                write!(f, "expected sequence {expected}, got {got} (messages lost)")
            }
            ProtocolError::Duplicate { seq } => write!(f, "duplicate sequence {seq}"),
            ProtocolError::SequenceExhausted => f.write_str("sequence numbers exhausted"),
            ProtocolError::CreditExceeded { limit, end } => write!(
                f,
                "a message ending at byte {end} exceeds the credit granted (up to byte {limit})"
            ),
            ProtocolError::RingOverrun => f.write_str("more frames than posted receive slots"),
            ProtocolError::TooManyCredits => {
                f.write_str("more frame credits returned than the peer's ring holds (or any, on a stream wire)")
            }
            ProtocolError::TooLarge { len, max } => {
                write!(f, "a message of {len} bytes exceeds the maximum of {max}")
            }
            ProtocolError::FrameLength { declared, carried } => write!(
                f,
                "a frame declaring {declared} payload bytes carried {carried}"
            ),
            ProtocolError::Fragment => f.write_str("fragments that do not add up to their message"),
            ProtocolError::HeaderlessRefused => {
                f.write_str("a headerless frame where none may come")
            }
            ProtocolError::DeviceRefused => {
                f.write_str("a frame naming device memory on a wire that cannot reach it")
            }
            ProtocolError::BadWant => f.write_str("a want at the wrong offset or length"),
            ProtocolError::AfterClose => f.write_str("a frame after the peer's close"),
            ProtocolError::Unfinished => f.write_str("closed in the middle of a message"),
            ProtocolError::Stalled {
                during: Stall::Handshake,
            } => f.write_str("silent before its hello past the idle timeout"),
            ProtocolError::Stalled {
                during: Stall::Frame,
            } => f.write_str("silent mid-frame past the idle timeout"),
            ProtocolError::Stalled {
                during: Stall::Slow,
            } => f.write_str("a message under way slower than the minimum rate"),
            ProtocolError::Evicted => f.write_str(
                "let go, quiet an idle timeout, for a newcomer to a listener that kept as many peers as it takes",
            ),
        }
    }
}

impl core::error::Error for ProtocolError {}

impl From<DecodeError> for ProtocolError {
    fn from(e: DecodeError) -> Self {
        ProtocolError::Decode(e)
    }
}

/// Why a message cannot start now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum SendError {
    /// The peer's Hello has not come yet, or the same-host exchange is
    /// not settled: try again after progress.
    NotOpen,
    /// Not enough byte credit: try again after progress (a Want is on its way).
    NoCredit,
    /// Longer than the peer takes.
    TooLarge {
        /// The message's length.
        len: usize,
        /// The peer's maximum.
        max: usize,
    },
    /// This side closed (or the session moved to another wire).
    Closed,
    /// The peer closed: its Close came.
    PeerClosed,
    /// The session failed.
    Failed(ProtocolError),
    /// The 2^64th message.
    SequenceExhausted,
}

impl SendError {
    /// As the error a driver's send reports for `peer` (the same on every
    /// wire): not now is `WouldBlock`; a failed session is no longer a peer.
    pub fn to_error(self, peer: PeerId) -> crate::Error {
        match self {
            SendError::NotOpen | SendError::NoCredit => crate::Error::WouldBlock,
            SendError::TooLarge { len, max } => crate::Error::TooLarge { len, max },
            SendError::Closed => crate::Error::Closed,
            SendError::PeerClosed => crate::Error::PeerClosed(peer),
            SendError::Failed(_) | SendError::SequenceExhausted => crate::Error::UnknownPeer(peer),
        }
    }
}

/// A message being sent: a cursor over its fragments. The driver keeps it
/// beside the message's bytes and asks [`Session::next_frame`] for each
/// fragment, in the order the messages were started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Outgoing {
    seq: u64,
    len: u32,
    framed: u32,
    first: bool,
}

impl Outgoing {
    /// Its sequence number.
    pub const fn seq(&self) -> u64 {
        self.seq
    }

    /// Its length.
    pub const fn len(&self) -> usize {
        self.len as usize
    }

    /// Whether it is empty.
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether every fragment has been handed out.
    pub const fn is_framed(&self) -> bool {
        !self.first && self.framed == self.len
    }
}

/// One fragment to post: its header (or none: headerless) and where its
/// payload lies in the message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct DataFrame {
    /// The header to send first; `None` for a headerless frame, which goes
    /// as its payload alone with [`imm`](Self::imm) in the wire's immediate data.
    pub header: Option<[u8; HEADER_LEN]>,
    /// A headerless frame's immediate data (opaque to the driver; handed to
    /// the peer's [`Session::handle_headerless`]): the low 16 bits of the
    /// message's sequence number, then the frame credits it returns.
    pub imm: u32,
    /// Where the payload starts in the message.
    pub offset: usize,
    /// Payload bytes.
    pub len: usize,
    /// The message's last fragment.
    pub last: bool,
}

/// A control frame to send (header only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Control {
    /// Its kind.
    pub kind: FrameKind,
    /// The header.
    pub header: [u8; HEADER_LEN],
}

/// What a header that arrived asks of the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Inbound {
    /// Nothing more (a control frame the engine took in).
    Control,
    /// The peer's Hello: the session is open.
    Opened,
    /// Payload follows: put `len` bytes at `offset` of the message's buffer
    /// (take one of `msg_len` bytes when `first`), then call
    /// [`Session::handle_payload`].
    Data(DataIn),
    /// The peer waits for credit for a message longer than the window: see
    /// [`Session::pending_grant`].
    Want,
    /// The peer closed cleanly: every message it sent has arrived.
    Closed,
    /// The peer (connecting side) offers to share memory on its host: the
    /// driver answers with [`Session::answer_host`].
    HostOffer(HostOffer),
    /// The peer answered this side's offer: `accepted`, the session moves to
    /// shared memory (the driver drops this one); else it stays here.
    HostAnswer {
        /// The offer was taken.
        accepted: bool,
    },
}

/// A data frame's payload, as the driver must place it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct DataIn {
    /// The message's sequence number.
    pub seq: u64,
    /// The whole message's length.
    pub msg_len: usize,
    /// Where this fragment goes in it.
    pub offset: usize,
    /// This fragment's length.
    pub len: usize,
    /// The message's first fragment: take its buffer now.
    pub first: bool,
    /// Its last: once the payload is in, the message is whole.
    pub last: bool,
    /// The frame is striped (see [`DataFlags::STRIPED`]).
    pub striped: bool,
    /// The message lies in the peer's device memory (see [`DataFlags::DEVICE`]).
    pub device: bool,
}

/// A whole message, ready for the application.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Delivered {
    /// Its sequence number.
    pub seq: u64,
    /// Its length.
    pub len: usize,
}

/// The message being reassembled.
#[derive(Clone, Copy, Debug)]
struct Assembly {
    seq: u64,
    len: u32,
    have: u32,
}

/// A data frame whose header arrived and whose payload has not.
#[derive(Clone, Copy, Debug)]
struct PendingFrame {
    /// The header, to verify with the payload; `None` behind a short
    /// record, which carries no checksum.
    decoded: Option<Decoded>,
    len: u32,
    last: bool,
}

/// Whether this build runs the same-host exchange (the `same-host` feature):
/// without it, every session acts as [`HostRole::None`].
const SAME_HOST: bool = cfg!(feature = "same-host");

/// Whether this build counts frames on ring wires (the `ring-credits`
/// feature): without it, a ring configuration is refused
/// ([`SessionConfig::check`]) and every session is a stream wire's.
const RING: bool = cfg!(feature = "ring-credits");

/// Whether this build holds a message under way to
/// [`SessionConfig::min_rate`] (the `min-rate` feature): without it, the
/// field is ignored and only silence fails a peer mid-message.
const RATE_RULE: bool = cfg!(feature = "min-rate");

/// One peer's protocol state. See the module documentation.
#[derive(Clone, Debug)]
pub struct Session {
    config: SessionConfig,
    token: u32,
    peer: Option<PeerParams>,
    failed: Option<ProtocolError>,
    hello_sent: bool,
    closing: bool,
    close_sent: bool,
    peer_closed: bool,
    last_heard: Instant,
    /// The driver holds part of a frame the engine has not seen (a header
    /// cut by the stream).
    partial: bool,
    /// Since when the message under way is timed against `min_rate`: the
    /// first look at the timers after it began (a driver's own clock, not
    /// the time its reads were told, which may be a pass old), moved on by
    /// the time this side held the peer back since; and its payload bytes
    /// heard.
    rate_since: Option<Instant>,
    rate_bytes: u64,
    /// The last look at the timers (`handle_timeout`).
    last_look: Instant,

    // Sending.
    tx_seq: u64,
    /// Messages started whose last fragment has not been handed out.
    tx_unframed: u64,
    /// Message bytes started.
    tx_started: u64,
    /// The peer's byte limit.
    tx_limit: u64,
    /// Data frame credits (`None`: the peer has no ring).
    tx_frames: Option<u32>,
    /// Control frame credits, where the peer has a ring.
    tx_control: u32,
    /// The peer's ring, when connection setup told it (see [`Session::with_peer_ring`]).
    told_ring: Option<u16>,
    /// A Want to send: the length it asks for (at `tx_started`).
    want_due: Option<u32>,
    /// The Want last sent, (offset, len): not sent again.
    want_sent: Option<(u64, u32)>,

    // Receiving.
    rx_next: u64,
    assembly: Option<Assembly>,
    pending: Option<PendingFrame>,
    /// Message bytes whose first fragment arrived.
    rx_started: u64,
    /// Message bytes the application took.
    rx_consumed: u64,
    /// The byte limit this side stands by.
    rx_limit: u64,
    /// The limit last told the peer.
    rx_limit_sent: u64,
    /// The peer's Want, (offset, len), until satisfied.
    rx_want: Option<(u64, u32)>,
    /// When a Want past the window was last [granted](Self::grant): credit
    /// it gave left unused an idle timeout on is the slowest of holders
    /// under contention (see `slow_under_contention`).
    granted_at: Option<Instant>,
    /// When the peer's Hello came: the same-host exchange must be over
    /// within the idle timeout of it.
    opened_at: Instant,
    /// Data frames the peer may still send (ring wires).
    rx_frames_allowed: u32,
    /// Control frames the peer may still send (ring wires).
    rx_control_allowed: u32,
    /// Data slots reposted and not yet reported.
    owed_frames: u32,
    /// Control slots reposted and not yet reported.
    owed_control: u32,
    /// Control frames taken whose slots were not reposted yet: the next
    /// slots reposted are theirs.
    unposted_control: u32,

    // The same-host exchange (see [`HostRole`]).
    /// This side's Host frame has been handed out.
    host_sent: bool,
    /// The exchange is over: data may go.
    host_settled: bool,
    /// The peer's offer, until answered (answering side).
    host_offered: Option<HostOffer>,
    /// The driver's answer to the peer's offer, until handed out.
    host_answer: Option<bool>,
    /// The offer was taken: the session lives on in shared memory, and this
    /// one sends nothing more and takes only credit.
    moved: bool,
    /// Data frames may name the peer's device memory ([`DataFlags::DEVICE`]).
    takes_device: bool,

    // Counters (see [`SessionStats`]; 32 bits: a firmware target pays for 64).
    credit_stalls: u32,
    /// The message now waiting for byte credit was counted.
    byte_stall_counted: bool,
    /// The frame now waiting for a ring slot was counted.
    frame_stall_counted: bool,
}

impl Session {
    /// A session with nothing exchanged yet; its first frame will be its
    /// Hello (see [`poll_control`](Self::poll_control)) carrying `token`.
    /// `now` starts the handshake's idle timer.
    pub fn new(config: SessionConfig, token: u32, now: Instant) -> Session {
        Session {
            config,
            token,
            peer: None,
            failed: None,
            hello_sent: false,
            closing: false,
            close_sent: false,
            peer_closed: false,
            last_heard: now,
            partial: false,
            rate_since: None,
            rate_bytes: 0,
            last_look: now,
            tx_seq: 0,
            tx_unframed: 0,
            tx_started: 0,
            tx_limit: 0,
            tx_frames: None,
            tx_control: 0,
            told_ring: None,
            want_due: None,
            want_sent: None,
            rx_next: 0,
            assembly: None,
            pending: None,
            rx_started: 0,
            rx_consumed: 0,
            rx_limit: u64::from(config.window),
            rx_limit_sent: u64::from(config.window),
            rx_want: None,
            granted_at: None,
            opened_at: now,
            rx_frames_allowed: u32::from(config.ring),
            rx_control_allowed: if config.ring != 0 { CONTROL_SLOTS } else { 0 },
            owed_frames: 0,
            owed_control: 0,
            unposted_control: 0,
            host_sent: false,
            host_settled: !SAME_HOST || matches!(config.host, HostRole::None),
            host_offered: None,
            host_answer: None,
            moved: false,
            takes_device: false,
            credit_stalls: 0,
            byte_stall_counted: false,
            frame_stall_counted: false,
        }
    }

    /// On a ring wire whose connection setup already told this side the
    /// peer's ring depth (verbs: the CM private data), the frame credits to
    /// start with, so the Hello itself can be posted. The peer's Hello must
    /// then announce the same ring.
    #[must_use]
    pub fn with_peer_ring(mut self, ring: u16) -> Session {
        if RING {
            self.tx_frames = Some(u32::from(ring));
            self.tx_control = CONTROL_SLOTS;
            self.told_ring = Some(ring);
        }
        self
    }

    // ----- getters -----

    /// The settings.
    pub fn config(&self) -> &SessionConfig {
        &self.config
    }

    /// This side's token, as its Hello carries it.
    pub fn token(&self) -> u32 {
        self.token
    }

    /// What the peer announced, once its Hello came.
    pub fn peer(&self) -> Option<&PeerParams> {
        self.peer.as_ref()
    }

    /// The peer's Hello came (and no failure since): messages may start.
    pub fn is_open(&self) -> bool {
        self.peer.is_some() && self.failed.is_none()
    }

    /// When the peer was last heard from (or this side last held it back,
    /// which is no silence of its own).
    pub fn last_heard(&self) -> Instant {
        self.last_heard
    }

    /// Why the session failed, if it did.
    pub fn failure(&self) -> Option<ProtocolError> {
        self.failed
    }

    /// The peer closed cleanly.
    pub fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// This side's Close has been handed out.
    pub fn close_sent(&self) -> bool {
        self.close_sent
    }

    /// Both sides closed: nothing more will cross.
    pub fn is_finished(&self) -> bool {
        self.close_sent && self.peer_closed
    }

    /// The same-host exchange is over (or this wire has none): data may go.
    pub fn host_settled(&self) -> bool {
        !SAME_HOST || self.host_settled
    }

    /// The same-host offer was taken: the session moved to shared memory,
    /// and the driver drops this one once its last frame is out.
    pub fn is_moved(&self) -> bool {
        SAME_HOST && self.moved
    }

    /// What has crossed so far.
    pub fn stats(&self) -> SessionStats {
        SessionStats {
            messages_sent: self.tx_seq,
            bytes_sent: self.tx_started,
            messages_received: self.rx_next,
            bytes_received: self.rx_started - self.assembly.map_or(0, |a| u64::from(a.len)),
            credit_stalls: u64::from(self.credit_stalls),
        }
    }

    /// Messages started whose fragments have not all been handed out.
    pub fn unframed(&self) -> u64 {
        self.tx_unframed
    }

    /// Message bytes the peer's credit allows now.
    pub fn credit(&self) -> u64 {
        self.tx_limit.saturating_sub(self.tx_started)
    }

    /// Data frame credits (`None`: the peer has no ring).
    pub fn frame_credits(&self) -> Option<u32> {
        self.tx_frames.filter(|_| RING)
    }

    /// Receive slots reposted and not yet returned to the peer, data and
    /// control (ring wires).
    pub fn owed_slots(&self) -> (u32, u32) {
        (self.owed_frames, self.owed_control)
    }

    /// Control frame credits (`None`: the peer has no ring).
    pub fn control_credits(&self) -> Option<u32> {
        self.frame_credits().map(|_| self.tx_control)
    }

    /// Whether [`next_frame`](Self::next_frame) gives the first fragment of
    /// a message started now: the session is open, its Hello is out, and the
    /// peer's ring has room. A driver that must either post a message at once
    /// or keep a copy of it asks first.
    pub fn ready_to_frame(&self) -> bool {
        self.is_open() && self.hello_sent && self.host_settled() && self.may_post_data()
    }

    /// Whether a data frame may be posted now: on a ring wire, one of the
    /// peer's data slots is free.
    pub fn may_post_data(&self) -> bool {
        self.frame_credits().is_none_or(|n| n >= 1)
    }

    /// Whether a control frame may be posted now: on a ring wire, one of
    /// the peer's control slots is free, and the last goes only with a
    /// Credit frame (`credit`) that returns control slots (see
    /// [`CONTROL_SLOTS`]).
    fn may_post_control(&self, credit: bool) -> bool {
        self.frame_credits().is_none()
            || self.tx_control >= 2
            || (self.tx_control == 1 && credit && self.owed_control > 0)
    }

    /// Message bytes received and not yet [consumed](Self::consumed): what
    /// this side holds for the peer.
    pub fn held(&self) -> u64 {
        self.rx_started - self.rx_consumed
    }

    /// Bytes granted beyond the window (for messages longer than it), until
    /// those messages are consumed: what a driver counts against its budget
    /// for such grants.
    pub fn extra_granted(&self) -> u64 {
        self.rx_limit.saturating_sub(self.window_limit())
    }

    /// The byte limit the window alone gives the peer: what it consumed,
    /// plus the window.
    fn window_limit(&self) -> u64 {
        self.rx_consumed
            .saturating_add(u64::from(self.config.window))
    }

    /// How much [`extra_granted`](Self::extra_granted) would grow if the
    /// peer's [`pending_grant`](Self::pending_grant) were granted now: its
    /// length less the window left, and less what earlier grants gave (a
    /// sender that gave up a granted message and asks again holds its
    /// earlier grant).
    pub fn grant_adds(&self) -> u64 {
        match self.rx_want {
            Some((offset, len)) => offset
                .saturating_add(u64::from(len))
                .saturating_sub(self.rx_limit.max(self.window_limit())),
            None => 0,
        }
    }

    /// A message longer than the window that the peer waits to send: its
    /// length, until [`grant`](Self::grant)ed.
    pub fn pending_grant(&self) -> Option<usize> {
        match self.rx_want {
            Some((offset, len)) if offset.saturating_add(u64::from(len)) > self.rx_limit => {
                Some(len as usize)
            }
            _ => None,
        }
    }

    // ----- commands -----

    /// This wire reaches the peer's device memory (a same-host lane with
    /// CUDA IPC): data frames may carry [`DataFlags::DEVICE`], and this
    /// side's Hello says so ([`Takes::DEVICE`]: call it before the Hello
    /// goes). Without it, such a frame fails the session
    /// ([`ProtocolError::DeviceRefused`]).
    pub fn take_device_frames(&mut self) {
        self.takes_device = true;
    }

    /// Starts a message of `len` bytes: its sequence number and byte credit.
    /// Without enough credit, a Want goes to the peer (once) and the answer
    /// is [`SendError::NoCredit`]: try again after progress.
    pub fn send(&mut self, len: usize) -> Result<Outgoing, SendError> {
        if let Some(e) = self.failed {
            return Err(SendError::Failed(e));
        }
        if self.peer_closed {
            return Err(SendError::PeerClosed);
        }
        if self.closing || self.is_moved() {
            return Err(SendError::Closed);
        }
        let Some(peer) = self.peer.filter(|_| self.host_settled()) else {
            return Err(SendError::NotOpen);
        };
        let max = peer.max_message as usize;
        let Some(len32) = u32::try_from(len).ok().filter(|_| len <= max) else {
            return Err(SendError::TooLarge { len, max });
        };
        if u64::from(len32) > self.credit() {
            let at = (self.tx_started, len32);
            if self.want_sent != Some(at) {
                self.want_due = Some(len32);
            }
            if !self.byte_stall_counted {
                self.byte_stall_counted = true;
                self.credit_stalls = self.credit_stalls.wrapping_add(1);
            }
            return Err(SendError::NoCredit);
        }
        let Some(next) = self.tx_seq.checked_add(1) else {
            return Err(SendError::SequenceExhausted);
        };
        let out = Outgoing {
            seq: self.tx_seq,
            len: len32,
            framed: 0,
            first: true,
        };
        self.tx_seq = next;
        self.tx_started += u64::from(len32);
        self.tx_unframed += 1;
        self.want_due = None;
        self.byte_stall_counted = false;
        Ok(out)
    }

    /// Answers the peer's same-host offer ([`Inbound::HostOffer`]): `accept`
    /// moves the session to shared memory (the driver then drops this one,
    /// once the answer is out), else it stays on this wire. Ignored where no
    /// offer waits for an answer.
    pub fn answer_host(&mut self, accept: bool) {
        if SAME_HOST && self.host_offered.take().is_some() {
            self.host_answer = Some(accept);
        }
    }

    /// Closes: no new messages; the Close follows the last fragment of every
    /// message started (see [`poll_control`](Self::poll_control)). Idempotent.
    pub fn close(&mut self) {
        self.closing = true;
    }

    /// A delivered message of `len` bytes left the wire's hands: the
    /// application took it, or the driver put it in an inbox bounded on its
    /// own. Its bytes come back to the peer as credit.
    pub fn consumed(&mut self, len: usize) {
        let len = len as u64;
        // More than was received is a driver bug; the counters never pass it.
        debug_assert!(self.rx_consumed + len <= self.rx_started);
        self.rx_consumed = (self.rx_consumed + len).min(self.rx_started);
        self.rx_limit = self.rx_limit.max(self.window_limit());
    }

    /// Ring wires: `n` receive slots were posted again; the peer learns it
    /// with the next frame (or a Credit frame, see [`CONTROL_SLOTS`]). The
    /// slots control frames took are refilled first: any posted receive
    /// takes any frame, so which buffer went where does not matter, but a
    /// driver should repost a control frame's buffer at once (nothing of it
    /// is kept), so that control slots never wait for the application.
    pub fn reposted(&mut self, n: u32) {
        if !RING {
            return;
        }
        let control = n.min(self.unposted_control);
        self.unposted_control -= control;
        self.owed_control += control;
        self.owed_frames = self.owed_frames.saturating_add(n - control);
    }

    /// Lets the peer send the message longer than the window it waits to
    /// send ([`pending_grant`](Self::pending_grant)): this side will hold it.
    /// `now` starts the grant's clock: credit it gave left unused an idle
    /// timeout on makes the peer the slowest holder under contention (see
    /// [`slow_under_contention`](Self::slow_under_contention)).
    pub fn grant(&mut self, now: Instant) {
        if let Some((offset, len)) = self.rx_want {
            self.rx_limit = self.rx_limit.max(offset.saturating_add(u64::from(len)));
            self.granted_at = Some(now);
        }
    }

    // ----- polls -----

    /// The next fragment of `msg` (started by [`send`](Self::send), and the
    /// oldest message not yet all handed out), or `None` while the peer's
    /// ring has no room or once it is all out. `message` is the whole message, where
    /// the CPU can read it: its fragments are checksummed when the
    /// configuration says so. `placement` is where the wire puts the
    /// payload: [`DataFlags::STRIPED`] (split over two connections),
    /// [`DataFlags::DEVICE`] (left in device memory the peer reaches), or
    /// [`DataFlags::NONE`]; other flags are the engine's and are ignored.
    pub fn next_frame(
        &mut self,
        msg: &mut Outgoing,
        message: Option<&[u8]>,
        placement: DataFlags,
    ) -> Option<DataFrame> {
        // Nothing before this side's Hello, even when the peer's came first.
        // (No message exists before the same-host exchange is over, nor
        // after a move: `send` refuses both.)
        if msg.is_framed() || self.failed.is_some() || !self.hello_sent {
            return None;
        }
        // Fragments go in message order: a cursor of another message is a driver bug.
        debug_assert_eq!(msg.seq, self.tx_seq - self.tx_unframed);
        let peer = self.peer?;
        if !self.may_post_data() {
            // The peer sees this side short (its count of what this side
            // may send) and answers with every slot it reposts.
            if !self.frame_stall_counted {
                self.frame_stall_counted = true;
                self.credit_stalls = self.credit_stalls.wrapping_add(1);
            }
            return None;
        }
        let offset = msg.framed;
        let len = (msg.len - offset).min(peer.frame_max);
        let last = offset + len == msg.len;
        let striped = placement.contains(DataFlags::STRIPED);
        let device = SAME_HOST && placement.contains(DataFlags::DEVICE);
        let headerless = self.config.sends_headerless
            && peer.takes_headerless
            && msg.first
            && last
            && !striped
            && !device;
        // Headers and immediate data have room for 14 bits of data credits
        // (the rest wait) and 2 of control credits (all of them).
        let credits = self.take_owed(u32::from(MAX_FRAME_CREDITS));
        let control = self.take_owed_control();
        let header = if headerless {
            None
        } else {
            let payload = message
                .filter(|m| m.len() == msg.len as usize)
                .map(|m| &m[offset as usize..(offset + len) as usize]);
            let flags = DataFlags::NONE
                .with(
                    DataFlags::PAYLOAD_CHECKED,
                    self.config.check_payload && payload.is_some(),
                )
                .with(DataFlags::MORE, !last)
                .with(DataFlags::STRIPED, striped)
                .with(DataFlags::DEVICE, device);
            let frame = Frame::Data(Data {
                flags,
                seq: msg.seq,
                msg_len: msg.len,
                len,
                offset,
                credits: credits as u16,
                control: control as u8,
            });
            Some(frame.encode(payload.unwrap_or(&[])))
        };
        if let (true, Some(n)) = (RING, self.tx_frames.as_mut()) {
            *n -= 1;
        }
        self.frame_stall_counted = false;
        msg.first = false;
        msg.framed += len;
        if last {
            self.tx_unframed -= 1;
        }
        Some(DataFrame {
            header,
            imm: (u32::from(msg.seq as u16) << 16) | (control << 14) | credits,
            offset: offset as usize,
            len: len as usize,
            last,
        })
    }

    /// The next control frame to send, if one is due: the Hello first, then
    /// a Want, the Close after the last fragment of every message started,
    /// and returned credit (which may still follow the Close: the peer may
    /// be finishing its own messages). A driver posts the data frames that
    /// can go ([`next_frame`](Self::next_frame)) before it asks: they carry
    /// the credit owed for free.
    ///
    /// On a ring wire every control frame takes one of the peer's control
    /// slots; a Hello, Host, Want or Close needs two, and only a Credit
    /// frame that returns control slots may take the last (see
    /// [`CONTROL_SLOTS`] for when Credit frames go).
    #[inline]
    pub fn poll_control(&mut self) -> Option<Control> {
        // Drivers ask after every frame: the steady state's answer is one
        // look, the rest out of line.
        if self.control_quiet() {
            debug_assert!(
                self.clone().next_control().is_none(),
                "control_quiet held back a due frame"
            );
            return None;
        }
        self.next_control()
    }

    /// Whether [`poll_control`](Self::poll_control) has nothing to give, by
    /// one quick look (`false` may still find nothing): this side's Hello
    /// and its same-host frames are out, no Want or Close waits, and no
    /// credit is owed. (Whatever else `next_control` looks at only holds a
    /// frame back.) A driver that asks after every frame looks here first.
    #[inline]
    pub fn control_quiet(&self) -> bool {
        let host_sent = !SAME_HOST
            || (self.host_answer.is_none()
                && (self.host_sent || !matches!(self.config.host, HostRole::Offer(_))));
        self.hello_sent
            && host_sent
            && self.want_due.is_none()
            && !self.closing
            && !self.credit_owed()
    }

    #[inline(never)]
    fn next_control(&mut self) -> Option<Control> {
        if self.failed.is_some() || !self.may_post_control(true) || self.is_moved() {
            return None;
        }
        let frame = if !self.hello_sent {
            self.hello_sent = true;
            Frame::Hello(Hello {
                window: self.config.window,
                max_message: self.config.max_message,
                frame_max: self.config.frame_max,
                ring: if RING { self.config.ring } else { 0 },
                lane: 0,
                takes: Takes::NONE
                    .with(Takes::HEADERLESS, self.config.takes_headerless)
                    .with(Takes::DEVICE, SAME_HOST && self.takes_device),
                token: self.token,
            })
        } else if !self.may_post_control(false) {
            // The last control slot: only a Credit frame that returns some.
            if !self.credit_due() {
                return None;
            }
            self.credit_frame()
        } else if let (true, HostRole::Offer(offer), false) =
            (SAME_HOST, self.config.host, self.host_sent)
        {
            // Right after the Hello: the peer need not have answered it.
            self.host_sent = true;
            self.host_settled = offer.is_none();
            Frame::Host(match offer {
                Some(o) => Host {
                    host: o.host,
                    pid: o.pid,
                    nonce: o.nonce,
                    step: HostStep::Offer,
                },
                None => Host {
                    host: 0,
                    pid: 0,
                    nonce: 0,
                    step: HostStep::NoOffer,
                },
            })
        } else if self.peer.is_none() {
            return None;
        } else if let (true, Some(accept)) = (SAME_HOST, self.host_answer) {
            self.host_answer = None;
            self.host_sent = true;
            self.host_settled = true;
            self.moved = accept;
            Frame::Host(Host {
                host: 0,
                pid: 0,
                nonce: 0,
                step: if accept {
                    HostStep::Accept
                } else {
                    HostStep::Decline
                },
            })
        } else if !self.host_settled() {
            // Only credit until the exchange is over.
            if !self.credit_due() {
                return None;
            }
            self.credit_frame()
        } else if let (Some(len), false, 0) = (self.want_due, self.close_sent, self.tx_unframed) {
            // After every fragment started: the peer checks the Want's
            // offset against the messages it has seen begin.
            self.want_due = None;
            self.want_sent = Some((self.tx_started, len));
            Frame::Want(Want {
                offset: self.tx_started,
                len,
            })
        } else if self.closing && !self.close_sent && self.tx_unframed == 0 {
            self.close_sent = true;
            Frame::Close(Close { seq: self.tx_seq })
        } else if self.credit_due() {
            self.credit_frame()
        } else {
            return None;
        };
        if RING && self.tx_frames.is_some() {
            self.tx_control -= 1;
        }
        Some(Control {
            kind: frame.kind(),
            header: frame.encode(&[]),
        })
    }

    /// The Credit frame due now (see [`poll_control`](Self::poll_control)).
    fn credit_frame(&mut self) -> Frame {
        self.rx_limit_sent = self.rx_limit;
        Frame::Credit(Credit {
            frames: self.take_owed(u32::MAX),
            limit: self.rx_limit,
            control: self.take_owed_control() as u8,
        })
    }

    /// When [`handle_timeout`](Self::handle_timeout) must be called: while
    /// the peer's Hello, a frame's payload or a message's next fragment is
    /// awaited (or the driver holds part of a header), the idle timeout after
    /// the peer was last heard; while the peer owes its part of the
    /// same-host exchange, the idle timeout after its Hello (whatever else
    /// the peer sends meanwhile: credit frames would keep it open for
    /// ever); otherwise never (a quiet open session is fine, and so is
    /// credit granted and left unused: see
    /// [`slow_under_contention`](Self::slow_under_contention)).
    ///
    /// And while a message is under way, at the latest when it falls behind
    /// [`SessionConfig::min_rate`]: the idle timeout, plus a second per
    /// `min_rate` payload bytes heard, after the first look at the timers
    /// once it began, later by the time this side held the peer back or
    /// was away since ([`handle_held`](Self::handle_held),
    /// [`handle_absence`](Self::handle_absence)).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.deadline().map(|(at, _)| at)
    }

    /// The next deadline, and where the peer is stuck if it passes.
    fn deadline(&self) -> Option<(Instant, Stall)> {
        if self.failed.is_some() || self.peer_closed {
            return None;
        }
        let idle = self.config.idle_timeout;
        let (since, during) = if self.peer.is_none() {
            (self.last_heard, Stall::Handshake)
        } else if self.peer_owes_host() {
            (self.opened_at, Stall::Handshake)
        } else if self.mid_message() {
            (self.last_heard, Stall::Frame)
        } else {
            return None;
        };
        let at = since.after(idle);
        let since = self
            .rate_since
            .filter(|_| self.config.min_rate > 0 && self.mid_message());
        if let (true, Some(since), Stall::Frame) = (RATE_RULE, since, during) {
            // A 32-bit division (a small core has no 64-bit one, and its
            // library routine would cost a firmware image a kilobyte): the
            // microseconds a KiB may take.
            let per_kib = (1_024_000_000 / self.config.min_rate).max(1);
            let allowed = (self.rate_bytes >> 10).saturating_mul(u64::from(per_kib));
            let slow = Instant(since.after(idle).0.saturating_add(allowed));
            if slow < at {
                return Some((slow, Stall::Slow));
            }
        }
        Some((at, during))
    }

    /// The pace of the peer's message under way, in payload bytes a
    /// second, when it is slower than [`CONTENDED_RATE_FACTOR`] times
    /// [`SessionConfig::min_rate`] and has been timed for the idle timeout
    /// (timed as for `min_rate`: from the first look at the timers once it
    /// began, the time this side held the peer back or was away not
    /// counted); zero, in every build, for credit [granted](Self::grant)
    /// past the window an idle timeout ago and not used, unless a payload
    /// under way reaches past the window (whatever else the peer sends
    /// meanwhile, a part of a header or small messages included: a message
    /// counts as using credit as its first header comes). A driver whose
    /// receive room
    /// for payloads still to come, or whose budget for grants, is short,
    /// with other peers waiting for it, drops the slowest such peers:
    /// messages that each keep a little over `min_rate`, or grants left
    /// unused, give way. `None` otherwise (no grant left unused that long,
    /// and no message under way, or not timed that long, or faster, or no
    /// `min_rate`, or a build without `min-rate`). Unused credit is no stall
    /// by itself: credit told cannot be taken back, and an honest sender
    /// may give up the send it asked for.
    pub fn slow_under_contention(&self, now: Instant) -> Option<u64> {
        let idle = self.config.idle_timeout;
        // A payload under way that reaches past the window uses the grant:
        // it is judged by its pace (below). A small one does not shield it.
        let payload = self.pending.is_some() || self.assembly.is_some();
        let past_window = payload && self.rx_started > self.window_limit();
        if !past_window
            && self.grant_unused()
            && self.granted_at.is_some_and(|t| now >= t.after(idle))
        {
            return Some(0);
        }
        let since = self
            .rate_since
            .filter(|_| RATE_RULE && self.mid_message())?;
        if now < since.after(idle) {
            return None;
        }
        let took = now.0.saturating_sub(since.0).max(1);
        let pace = self.rate_bytes.saturating_mul(1_000_000) / took;
        let slow = u64::from(self.config.min_rate) * u64::from(CONTENDED_RATE_FACTOR);
        (pace < slow).then_some(pace)
    }

    /// Credit granted past the window that the peer has not used: room
    /// told beyond what the window gives once every message it began is
    /// consumed (a message shorter than its grant, under way, leaves only
    /// the rest unused where that is past the window).
    fn grant_unused(&self) -> bool {
        self.rx_limit
            > self
                .rx_started
                .saturating_add(u64::from(self.config.window))
    }

    /// A message (or a frame, or part of a header) of the peer's is under way.
    fn mid_message(&self) -> bool {
        self.pending.is_some() || self.assembly.is_some() || self.partial
    }

    /// `n` payload bytes of the message under way arrived at `now`,
    /// counted against `min_rate` (bytes told between messages are
    /// dropped at the next one's start, `begin_rate`).
    fn heard(&mut self, now: Instant, n: usize) {
        if RATE_RULE {
            self.rate_bytes = self.rate_bytes.saturating_add(n as u64);
        }
        self.last_heard = now;
    }

    /// A message (or a header) of the peer's begins: timed from the next
    /// look at the timers.
    fn begin_rate(&mut self) {
        if RATE_RULE && !self.mid_message() {
            self.rate_since = None;
            self.rate_bytes = 0;
        }
    }

    /// The time since the last look at the timers was this side's doing:
    /// the message's timing against `min_rate` pauses for it.
    fn pause_rate(&mut self, now: Instant) {
        if let (true, Some(since)) = (RATE_RULE, self.rate_since) {
            let gap = now.0.saturating_sub(self.last_look.0);
            self.rate_since = Some(Instant(since.0.saturating_add(gap).min(now.0)));
        }
    }

    /// The peer's Host frame is awaited: its offer (answering side), or its
    /// answer to this side's offer, once sent.
    fn peer_owes_host(&self) -> bool {
        SAME_HOST
            && !self.host_settled
            && match self.config.host {
                HostRole::Answer => {
                    self.host_offered.is_none() && self.host_answer.is_none() && !self.host_sent
                }
                HostRole::Offer(Some(_)) => self.host_sent,
                _ => false,
            }
    }

    // ----- handling what arrived -----

    /// The clock moved: a peer silent past its deadline (see
    /// [`poll_timeout`](Self::poll_timeout)) fails the session. A driver
    /// hands the engine what arrived first (the bytes in its socket, the
    /// completions in its queue): a peer is judged on what it sent, not on
    /// when this side last looked.
    pub fn handle_timeout(&mut self, now: Instant) -> Result<(), ProtocolError> {
        self.check_failed()?;
        if RATE_RULE && self.rate_since.is_none() && self.mid_message() {
            self.rate_since = Some(now);
        }
        if RATE_RULE {
            self.last_look = now;
        }
        match self.deadline() {
            Some((at, during)) if now >= at => Err(self.fail(ProtocolError::Stalled { during })),
            _ => Ok(()),
        }
    }

    /// This side holds the peer back: a frame's payload waits in the wire
    /// because this side has no room for it yet (a full inbox, a dry pool).
    /// The peer is not to blame, so the idle timer counts from `now`, and
    /// the message's timing against `min_rate` pauses for the time since
    /// the last look at the timers. Call it before that look's
    /// [`handle_timeout`](Self::handle_timeout).
    pub fn handle_held(&mut self, now: Instant) {
        self.last_heard = now;
        self.pause_rate(now);
    }

    /// Nobody drove this side's wire since the last look at the timers (a
    /// caller-driven application away): the peer could not send what this
    /// side did not read, so the message's timing against `min_rate`
    /// pauses for that time. Its silence is judged as ever (the driver
    /// reads what came meanwhile first). Call it before that look's
    /// [`handle_timeout`](Self::handle_timeout).
    pub fn handle_absence(&mut self, now: Instant) {
        self.pause_rate(now);
    }

    /// Bytes of a frame arrived that the engine has not seen yet: `bytes`
    /// of the payload under way (a stream driver reads payloads itself;
    /// they count toward the message's rate), or part of a header, which
    /// a stream driver holding it says with `partial`. The peer is alive,
    /// and the idle timer counts from `now`.
    pub fn handle_activity(&mut self, now: Instant, bytes: usize, partial: bool) {
        if partial {
            self.begin_rate();
        }
        self.heard(now, bytes);
        self.partial = partial;
    }

    /// A frame's 32 header bytes arrived. Decodes and checks them against
    /// everything the session knows; see [`Inbound`] for what follows.
    /// `carried` is, on a frame wire (one unit per frame: verbs, the mock
    /// link), how many payload bytes came with the header: it must be what
    /// the header declares. A stream wire passes `None` and reads what the
    /// header declares.
    pub fn handle_header(
        &mut self,
        now: Instant,
        bytes: &[u8],
        carried: Option<usize>,
    ) -> Result<Inbound, ProtocolError> {
        self.begin_header(now)?;
        let decoded = match Frame::decode(bytes, self.config.frame_max as usize) {
            Ok(d) => d,
            Err(e) => return Err(self.fail(e.into())),
        };
        let declared = decoded.frame.payload_len();
        if let Some(carried) = carried.filter(|&c| c != declared) {
            return Err(self.fail(ProtocolError::FrameLength { declared, carried }));
        }
        let r = self.take_header(decoded);
        if let Err(e) = r {
            self.fail(e);
        }
        r
    }

    /// The payload of the data frame whose header came last is in place.
    /// `payload` is its bytes where the CPU can read them (checked against
    /// the checksum when the frame carries one over its payload); `None`
    /// for payloads in device memory. Returns the message once it is whole.
    pub fn handle_payload(
        &mut self,
        now: Instant,
        payload: Option<&[u8]>,
    ) -> Result<Option<Delivered>, ProtocolError> {
        self.check_failed()?;
        let Some(p) = self.pending.take() else {
            debug_assert!(false, "a payload without its header");
            return Err(self.fail(ProtocolError::Fragment));
        };
        if let (Some(bytes), Some(decoded)) = (payload, p.decoded) {
            debug_assert_eq!(bytes.len(), p.len as usize);
            if let Err(e) = decoded.verify(bytes) {
                return Err(self.fail(e.into()));
            }
        }
        // A ring wire's fragment came whole: its bytes count toward the
        // message's rate here (a stream driver told them as it read them).
        self.heard(
            now,
            if self.config.ring != 0 {
                p.len as usize
            } else {
                0
            },
        );
        self.partial = false;
        let Some(a) = self.assembly.as_mut() else {
            return Err(self.fail(ProtocolError::Fragment));
        };
        a.have += p.len;
        if !p.last {
            return Ok(None);
        }
        let done = Delivered {
            seq: a.seq,
            len: a.len as usize,
        };
        self.assembly = None;
        self.advance_rx()?;
        Ok(Some(done))
    }

    /// A stream wire's 32 bytes where a header goes, if they are a short
    /// record ([`ShortRecord`]; `None`: a header, for
    /// [`handle_header`](Self::handle_header)). The record is held to every
    /// rule a headerless frame meets (sequence, credit, the byte limit) and
    /// then stands for a whole message's Data header: its payload, all of the
    /// message, follows on the stream, and the driver reads it and calls
    /// [`handle_payload`](Self::handle_payload) as after any header.
    pub fn handle_short_record(
        &mut self,
        now: Instant,
        bytes: &[u8; HEADER_LEN],
    ) -> Option<Result<DataIn, ProtocolError>> {
        let record = ShortRecord::decode(bytes)?;
        Some(self.take_short_record(now, record))
    }

    /// A headerless frame arrived whole (verbs' immediate data): a message of `len`
    /// bytes at the start of its receive buffer, and the immediate data it
    /// carried (see [`DataFrame::imm`]): its sequence number is checked like
    /// any other's, modulo 2^16.
    pub fn handle_headerless(
        &mut self,
        now: Instant,
        len: usize,
        imm: u32,
    ) -> Result<Delivered, ProtocolError> {
        self.check_failed()?;
        self.last_heard = now;
        self.partial = false;
        let r = self.take_headerless(len, imm);
        if let Err(e) = r {
            self.fail(e);
        }
        r
    }

    // ----- internals -----

    fn check_failed(&self) -> Result<(), ProtocolError> {
        match self.failed {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn fail(&mut self, e: ProtocolError) -> ProtocolError {
        self.failed = Some(e);
        e
    }

    /// Reports up to `max` owed data slots: they are the peer's again.
    fn take_owed(&mut self, max: u32) -> u32 {
        if !RING {
            return 0;
        }
        let n = self.owed_frames.min(max);
        self.owed_frames -= n;
        self.rx_frames_allowed = self.rx_frames_allowed.saturating_add(n);
        n
    }

    /// Reports every owed control slot (at most [`CONTROL_SLOTS`]).
    fn take_owed_control(&mut self) -> u32 {
        if !RING {
            return 0;
        }
        let n = core::mem::take(&mut self.owed_control);
        self.rx_control_allowed += n;
        n
    }

    /// This side counts frames: a ring wire, in a build that has them.
    fn ring_wire(&self) -> bool {
        RING && self.config.ring != 0
    }

    /// Whether a Credit frame should go (see [`CONTROL_SLOTS`]).
    fn credit_due(&self) -> bool {
        self.credit_owed() && self.may_post_control(true)
    }

    /// Whether enough credit is owed for a Credit frame, room for it aside.
    #[inline]
    fn credit_owed(&self) -> bool {
        let ring = self.ring_wire();
        // Data slots: every one at once to a peer that can post no data
        // (this side's count, what is in flight included), else a quarter
        // of the ring at a time.
        let owed = self.owed_frames;
        let data = ring
            && owed > 0
            && (self.rx_frames_allowed == 0 || owed >= u32::from(self.config.ring / 4).max(1));
        // Control slots: once the peer is down to its last. A Credit frame
        // takes one of the peer's: it never owes CONTROL_SLOTS - 1 (two) for
        // one such frame alone, so frames answering frames die out.
        let control = ring && self.owed_control >= CONTROL_SLOTS - 1;
        let moved = self.rx_limit - self.rx_limit_sent;
        let bytes = moved > 0
            && (moved >= u64::from(self.config.window / 4).max(1)
                || self.rx_want.is_some_and(|(offset, len)| {
                    offset.saturating_add(u64::from(len)) <= self.rx_limit
                }));
        data || control || bytes
    }

    /// One more frame arrived: ring wires count it against the data or
    /// control slots granted.
    fn count_frame(&mut self, data: bool) -> Result<(), ProtocolError> {
        if !self.ring_wire() {
            return Ok(());
        }
        let allowed = if data {
            &mut self.rx_frames_allowed
        } else {
            self.unposted_control += 1;
            &mut self.rx_control_allowed
        };
        *allowed = allowed.checked_sub(1).ok_or(ProtocolError::RingOverrun)?;
        Ok(())
    }

    /// Data and control slots the peer returned.
    fn take_credits(&mut self, data: u32, control: u32) -> Result<(), ProtocolError> {
        if let (true, Some(n), Some(peer)) = (RING, self.tx_frames.as_mut(), self.peer) {
            let data = n.saturating_add(data);
            let control = self.tx_control.saturating_add(control);
            if data > u32::from(peer.ring) || control > CONTROL_SLOTS {
                return Err(ProtocolError::TooManyCredits);
            }
            *n = data;
            self.tx_control = control;
        } else if data != 0 || control != 0 {
            // A wire without frame credit (a stream): a peer returns none.
            return Err(ProtocolError::TooManyCredits);
        }
        Ok(())
    }

    fn take_hello(&mut self, h: Hello) -> Result<Inbound, ProtocolError> {
        if self.peer.is_some() || h.lane != 0 {
            return Err(ProtocolError::UnexpectedHello);
        }
        if h.window == 0 || h.max_message == 0 || h.frame_max == 0 {
            return Err(ProtocolError::BadHello);
        }
        if self.ring_wire() {
            if h.ring < MIN_RING {
                return Err(ProtocolError::ShallowPeer { ring: h.ring });
            }
            match self.told_ring {
                // Told at connection setup: the Hello must agree.
                Some(told) if told != h.ring => return Err(ProtocolError::BadHello),
                Some(_) => {}
                // Learned now: our Hello (and Host offer), already sent,
                // took control slots.
                None => {
                    self.tx_frames = Some(u32::from(h.ring));
                    let early = u32::from(self.hello_sent) + u32::from(self.host_sent);
                    self.tx_control = CONTROL_SLOTS.saturating_sub(early);
                }
            }
        }
        if SAME_HOST {
            self.opened_at = self.last_heard;
        }
        self.peer = Some(PeerParams {
            window: h.window,
            max_message: h.max_message,
            frame_max: h.frame_max,
            ring: if self.ring_wire() { h.ring } else { 0 },
            takes_headerless: h.takes.contains(Takes::HEADERLESS),
            takes_device: SAME_HOST && h.takes.contains(Takes::DEVICE),
            token: h.token,
        });
        self.tx_limit = u64::from(h.window);
        Ok(Inbound::Opened)
    }

    fn take_header(&mut self, decoded: Decoded) -> Result<Inbound, ProtocolError> {
        let frame = decoded.frame;
        if self.peer.is_none() {
            return match frame {
                Frame::Hello(h) => {
                    self.count_frame(false)?;
                    self.take_hello(h)
                }
                Frame::Close(_) => Err(ProtocolError::Refused),
                other => Err(ProtocolError::HelloExpected { got: other.kind() }),
            };
        }
        if (self.peer_closed || self.is_moved()) && !matches!(frame, Frame::Credit(_)) {
            return Err(ProtocolError::AfterClose);
        }
        self.count_frame(matches!(frame, Frame::Data(_)))?;
        if let Frame::Host(h) = frame {
            return match SAME_HOST {
                true => self.take_host(h),
                false => Err(ProtocolError::UnexpectedHost),
            };
        }
        // Until the exchange is settled only credit may come: the answering
        // side's first frame after the Hello is the peer's Host frame, and
        // neither side sends data before the answer.
        let awaiting_host = !self.host_settled();
        if awaiting_host && !matches!(frame, Frame::Credit(_)) {
            return Err(ProtocolError::HostExpected { got: frame.kind() });
        }
        match frame {
            Frame::Hello(_) => Err(ProtocolError::UnexpectedHello),
            Frame::Credit(c) => {
                self.take_credits(c.frames, u32::from(c.control))?;
                self.tx_limit = self.tx_limit.max(c.limit);
                Ok(Inbound::Control)
            }
            Frame::Want(w) => {
                if w.offset != self.rx_started || w.len == 0 || w.len > self.config.max_message {
                    return Err(ProtocolError::BadWant);
                }
                self.rx_want = Some((w.offset, w.len));
                Ok(if w.len > self.config.window {
                    Inbound::Want
                } else {
                    Inbound::Control
                })
            }
            Frame::Close(c) => {
                if self.assembly.is_some() {
                    return Err(ProtocolError::Unfinished);
                }
                if c.seq != self.rx_next {
                    return Err(ProtocolError::SequenceGap {
                        expected: self.rx_next,
                        got: c.seq,
                    });
                }
                // The peer sends no more messages; this side finishes
                // those it started and closes too.
                self.peer_closed = true;
                self.closing = true;
                Ok(Inbound::Closed)
            }
            Frame::Data(d) => self.take_data(decoded, d),
            Frame::Host(_) => Err(ProtocolError::UnexpectedHost),
        }
    }

    /// The peer's Host frame: an offer (or none) on the answering side, the
    /// answer on the offering side; anything else is out of place.
    fn take_host(&mut self, h: Host) -> Result<Inbound, ProtocolError> {
        match (self.config.host, h.step) {
            (HostRole::Answer, HostStep::NoOffer | HostStep::Offer)
                if !self.host_sent && self.host_offered.is_none() && self.host_answer.is_none() =>
            {
                if h.step == HostStep::NoOffer {
                    self.host_sent = true; // nothing to answer
                    self.host_settled = true;
                    return Ok(Inbound::Control);
                }
                let offer = HostOffer {
                    host: h.host,
                    pid: h.pid,
                    nonce: h.nonce,
                };
                self.host_offered = Some(offer);
                Ok(Inbound::HostOffer(offer))
            }
            (HostRole::Offer(Some(_)), HostStep::Accept | HostStep::Decline)
                if self.host_sent && !self.host_settled =>
            {
                self.host_settled = true;
                self.moved = h.step == HostStep::Accept;
                Ok(Inbound::HostAnswer {
                    accepted: self.moved,
                })
            }
            _ => Err(ProtocolError::UnexpectedHost),
        }
    }

    fn check_seq(&self, seq: u64) -> Result<(), ProtocolError> {
        if seq < self.rx_next {
            Err(ProtocolError::Duplicate { seq })
        } else if seq > self.rx_next {
            Err(ProtocolError::SequenceGap {
                expected: self.rx_next,
                got: seq,
            })
        } else {
            Ok(())
        }
    }

    /// Charges a new message of `len` bytes against the byte limit.
    fn start_message(&mut self, len: u32) -> Result<(), ProtocolError> {
        if len > self.config.max_message {
            return Err(ProtocolError::TooLarge {
                len,
                max: self.config.max_message,
            });
        }
        let end = self.rx_started.saturating_add(u64::from(len));
        if end > self.rx_limit {
            return Err(ProtocolError::CreditExceeded {
                limit: self.rx_limit,
                end,
            });
        }
        self.rx_started = end;
        if self
            .rx_want
            .is_some_and(|(offset, _)| offset < self.rx_started)
        {
            // Its message (or another in its place) came. The grant's
            // clock (`granted_at`) runs on while credit it gave is unused.
            self.rx_want = None;
        }
        Ok(())
    }

    fn take_data(&mut self, decoded: Decoded, d: Data) -> Result<Inbound, ProtocolError> {
        if SAME_HOST && d.flags.contains(DataFlags::DEVICE) && !self.takes_device {
            return Err(ProtocolError::DeviceRefused);
        }
        self.take_credits(u32::from(d.credits), u32::from(d.control))?;
        self.check_seq(d.seq)?;
        let more = d.flags.contains(DataFlags::MORE);
        let first = match self.assembly {
            None => {
                // A first fragment: shorter than its message exactly when more follow,
                // and never empty when it is not the whole message.
                let fits = d.offset == 0
                    && if more {
                        d.len > 0 && d.len < d.msg_len
                    } else {
                        d.len == d.msg_len
                    };
                if !fits {
                    return Err(ProtocolError::Fragment);
                }
                self.start_message(d.msg_len)?;
                self.assembly = Some(Assembly {
                    seq: d.seq,
                    len: d.msg_len,
                    have: 0,
                });
                true
            }
            Some(a) => {
                let end = a.have.checked_add(d.len);
                let fits = d.msg_len == a.len
                    && d.offset == a.have
                    && end.is_some_and(|e| {
                        if more {
                            e < a.len && d.len > 0
                        } else {
                            e == a.len
                        }
                    });
                if !fits {
                    return Err(ProtocolError::Fragment);
                }
                false
            }
        };
        let offset = self.assembly.map_or(0, |a| a.have);
        self.pending = Some(PendingFrame {
            decoded: Some(decoded),
            len: d.len,
            last: !more,
        });
        Ok(Inbound::Data(DataIn {
            seq: d.seq,
            msg_len: d.msg_len as usize,
            offset: offset as usize,
            len: d.len as usize,
            first,
            last: !more,
            striped: d.flags.contains(DataFlags::STRIPED),
            device: d.flags.contains(DataFlags::DEVICE),
        }))
    }

    /// What every 32 bytes where a header goes (a header, a short record)
    /// start with: a failed session stays failed; the peer was heard at
    /// `now`; no header is partial any more, and a control frame is no
    /// progress of a message under way. The driver must finish a frame's
    /// payload before the next header: one that does not has a bug.
    fn begin_header(&mut self, now: Instant) -> Result<(), ProtocolError> {
        self.check_failed()?;
        self.begin_rate();
        self.last_heard = now;
        self.partial = false;
        if self.pending.is_some() {
            debug_assert!(false, "a header before the last frame's payload");
            return Err(self.fail(ProtocolError::Fragment));
        }
        Ok(())
    }

    fn take_headerless(&mut self, len: usize, imm: u32) -> Result<Delivered, ProtocolError> {
        let (seq, _) = self.check_headerless(len, imm)?;
        self.advance_rx()?;
        Ok(Delivered { seq, len })
    }

    /// A short record: a headerless frame's checks, then its message under
    /// way as a whole message's Data header leaves it.
    fn take_short_record(
        &mut self,
        now: Instant,
        record: Result<ShortRecord, DecodeError>,
    ) -> Result<DataIn, ProtocolError> {
        self.begin_header(now)?;
        let r = match record {
            Ok(r) => r,
            Err(e) => return Err(self.fail(e.into())),
        };
        let len = usize::try_from(r.len).unwrap_or(usize::MAX);
        let (seq, len32) = match self.check_headerless(len, r.imm) {
            Ok(ok) => ok,
            Err(e) => return Err(self.fail(e)),
        };
        self.assembly = Some(Assembly {
            seq,
            len: len32,
            have: 0,
        });
        self.pending = Some(PendingFrame {
            decoded: None,
            len: len32,
            last: true,
        });
        Ok(DataIn {
            seq,
            msg_len: len,
            offset: 0,
            len,
            first: true,
            last: true,
            striped: false,
            device: false,
        })
    }

    /// A headerless frame's checks and charges (frame count, credits,
    /// sequence, the byte limit): its sequence number and length.
    fn check_headerless(&mut self, len: usize, imm: u32) -> Result<(u64, u32), ProtocolError> {
        let seq16 = (imm >> 16) as u16;
        let (control, credits) = ((imm >> 14) & 3, imm & u32::from(MAX_FRAME_CREDITS));
        // The sequence number, rebuilt from its low bits around the one expected.
        let delta = i64::from(seq16.wrapping_sub(self.rx_next as u16) as i16);
        let seq = self.rx_next.wrapping_add_signed(delta);
        if !self.config.takes_headerless || self.assembly.is_some() {
            return Err(ProtocolError::HeaderlessRefused);
        }
        if self.peer.is_none() {
            return Err(ProtocolError::HeaderlessRefused);
        }
        // As a Data header: nothing after the peer's Close or once the
        // session moved, nothing before the same-host exchange settled.
        if self.peer_closed || self.is_moved() {
            return Err(ProtocolError::AfterClose);
        }
        if !self.host_settled() {
            return Err(ProtocolError::HostExpected {
                got: FrameKind::Data,
            });
        }
        let Some(len32) = u32::try_from(len)
            .ok()
            .filter(|&l| l <= self.config.frame_max)
        else {
            return Err(ProtocolError::Decode(DecodeError::TooLong {
                len: u32::try_from(len).unwrap_or(u32::MAX),
                max: self.config.frame_max as usize,
            }));
        };
        self.count_frame(true)?;
        self.take_credits(credits, control)?;
        self.check_seq(seq)?;
        self.start_message(len32)?;
        Ok((seq, len32))
    }

    fn advance_rx(&mut self) -> Result<(), ProtocolError> {
        match self.rx_next.checked_add(1) {
            Some(n) => {
                self.rx_next = n;
                Ok(())
            }
            None => Err(self.fail(ProtocolError::SequenceExhausted)),
        }
    }
}

#[cfg(test)]
mod tests;
