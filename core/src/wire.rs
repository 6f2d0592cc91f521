//! The frame: a fixed 32-byte little-endian header, then (data frames only)
//! `len` payload bytes. Every wire speaks it; the session engine
//! ([`crate::session`]) is its only interpreter.
//!
//! ```text
//!  0      2    3     4       6                                      28        32
//!  | magic | ver | kind | flags |      body (22 bytes, per kind)     | checksum |
//! ```
//!
//! The body, per kind (offsets from the start of the header):
//!
//! | kind | fields |
//! | --- | --- |
//! | Data | `credits` (low 14 bits) and `control` (high 2) u16 @6, `seq` u64 @8, `msg_len` u32 @16, `len` u32 @20, `offset` u32 @24; flags [`DataFlags`] |
//! | Credit | `frames` u32 @8, `limit` u64 @12, `control` u8 @20 |
//! | Hello | `window` u32 @8, `max_message` u32 @12, `frame_max` u32 @16, `ring` u16 @20, `lane` u8 @22, `takes` u8 @23, `token` u32 @24 |
//! | Close | `seq` u64 @8 |
//! | Want | `offset` u64 @8, `len` u32 @16 |
//! | Host | `host` u64 @8, `pid` u32 @16, `nonce` u32 @20, `step` u8 @24 |
//!
//! A stream wire may write a [`ShortRecord`] in place of a Data header for a
//! whole message to a peer that takes headerless frames.
//!
//! Bytes of a body that its kind does not name are zero. `checksum` is
//! CRC-32C over header bytes 0..28, continued over the payload when
//! [`DataFlags::PAYLOAD_CHECKED`] is set. The decoder bounds every length
//! before anyone reserves memory for it and never panics.

use core::fmt;

use crate::crc::crc32c;

/// Bytes in a header.
pub const HEADER_LEN: usize = 32;
/// `"ZH"` little-endian.
pub const MAGIC: u16 = 0x485A;
/// The protocol version this code speaks. Older versions are refused by
/// name: 1 (one header layout whose fields meant different things per
/// wire), 2 (no Host frame), 3 and 4 (control frames took the same ring
/// slots as data, and a side said when it waited for them), 5 (a notice
/// slot, reverted before any release).
pub const VERSION: u8 = 6;

/// What a frame carries: its kind byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[repr(u8)]
pub enum FrameKind {
    /// A message, or one fragment of it.
    Data = 1,
    /// Credit returned: receive slots reposted, and the byte limit raised.
    Credit = 2,
    /// The first frame each side sends: its version, limits and lane.
    Hello = 3,
    /// The sender starts no more messages (credit may still follow).
    Close = 4,
    /// The sender waits to start a message its credit does not cover.
    Want = 5,
    /// Where the sender runs, so peers on one host can share memory: an
    /// offer, or the answer to one.
    Host = 6,
}

impl FrameKind {
    fn from_u8(v: u8) -> Option<FrameKind> {
        Some(match v {
            1 => FrameKind::Data,
            2 => FrameKind::Credit,
            3 => FrameKind::Hello,
            4 => FrameKind::Close,
            5 => FrameKind::Want,
            6 => FrameKind::Host,
            _ => return None,
        })
    }

    /// Lower-case name, for reports.
    pub const fn name(self) -> &'static str {
        match self {
            FrameKind::Data => "data",
            FrameKind::Credit => "credit",
            FrameKind::Hello => "hello",
            FrameKind::Close => "close",
            FrameKind::Want => "want",
            FrameKind::Host => "host",
        }
    }
}

/// The flags of a data frame (the only kind that has any).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct DataFlags(u16);

impl DataFlags {
    /// No flags.
    pub const NONE: DataFlags = DataFlags(0);
    /// The checksum covers the payload too.
    pub const PAYLOAD_CHECKED: DataFlags = DataFlags(1);
    /// More fragments of this message follow.
    pub const MORE: DataFlags = DataFlags(2);
    /// The payload is striped: the frame's connection carries the header and
    /// the first part, the rest comes on a second connection of the same
    /// peer. Where the split falls is the wire's rule, known to both sides;
    /// a wire without second connections refuses it.
    pub const STRIPED: DataFlags = DataFlags(4);
    /// The message lies in device memory the receiver reaches by itself (a
    /// same-host peer's GPU memory, by CUDA IPC): the frame's `len` bytes
    /// are the message's, but what follows the header is the wire's
    /// descriptor of where they lie, not the bytes. A wire that cannot
    /// reach a peer's device memory refuses it.
    /// (Known only to builds with the `same-host` feature: elsewhere it is
    /// a reserved bit.)
    pub const DEVICE: DataFlags = DataFlags(8);
    const KNOWN: u16 = if cfg!(feature = "same-host") {
        0b1111
    } else {
        0b111
    };

    /// Whether all of `other` is set.
    pub const fn contains(self, other: DataFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// Raw bits.
    pub const fn bits(self) -> u16 {
        self.0
    }

    /// `self` with `other` set when `on`.
    #[must_use]
    pub const fn with(self, other: DataFlags, on: bool) -> DataFlags {
        if on {
            DataFlags(self.0 | other.0)
        } else {
            self
        }
    }
}

impl core::ops::BitOr for DataFlags {
    type Output = DataFlags;
    fn bitor(self, rhs: DataFlags) -> DataFlags {
        DataFlags(self.0 | rhs.0)
    }
}

/// A data frame's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Data {
    /// Flags.
    pub flags: DataFlags,
    /// The message's sequence number (every fragment carries it).
    pub seq: u64,
    /// The whole message's length.
    pub msg_len: u32,
    /// Payload bytes in this frame.
    pub len: u32,
    /// Where this fragment's payload starts in the message.
    pub offset: u32,
    /// Data slots the sender reposted since its last report (ring wires; 0
    /// elsewhere). At most [`MAX_FRAME_CREDITS`]: the rest wait for the
    /// next frame.
    pub credits: u16,
    /// Control slots the sender reposted since its last report (ring
    /// wires), at most [`MAX_CONTROL_CREDITS`].
    pub control: u8,
}

/// The most data slots one data frame returns (14 bits, beside the control
/// slots in the same 16-bit word and in a headerless frame's immediate data).
pub const MAX_FRAME_CREDITS: u16 = 0x3FFF;
/// The most control slots a frame returns (2 bits): a ring wire's peer has
/// [`CONTROL_SLOTS`](crate::session::CONTROL_SLOTS) of them.
pub const MAX_CONTROL_CREDITS: u8 = 3;

/// A credit frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Credit {
    /// Data slots reposted since the last report.
    pub frames: u32,
    /// Message bytes the receiver takes in all, counted from the first
    /// message: the sender may start a message that ends at or below it.
    pub limit: u64,
    /// Control slots reposted since the last report (ring wires), at most
    /// [`MAX_CONTROL_CREDITS`].
    pub control: u8,
}

impl Credit {
    /// One credit frame that says what `self` and then `later` say: the
    /// slots of both and the higher limit (limits only grow). A stream
    /// driver that could not write a credit frame yet folds the next into
    /// it, so a peer that reads nothing cannot grow the queue of frames for
    /// it. Stream wires only: on a ring wire each frame the engine handed
    /// out already spent one of the peer's slots, and posting one for two
    /// would lose a slot.
    pub fn then(self, later: Credit) -> Credit {
        Credit {
            frames: self.frames.saturating_add(later.frames),
            limit: self.limit.max(later.limit),
            control: self.control.saturating_add(later.control),
        }
    }
}

/// What a Hello's sender takes (the `takes` byte).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Takes(u8);

impl Takes {
    /// Nothing special.
    pub const NONE: Takes = Takes(0);
    /// Headerless frames: a one-fragment message as its bytes alone, its
    /// credits in the wire's immediate data (verbs).
    pub const HEADERLESS: Takes = Takes(1);
    /// Data frames naming this side's peer's device memory
    /// ([`DataFlags::DEVICE`]: a same-host lane with a GPU side). Known only
    /// to builds with the `same-host` feature.
    pub const DEVICE: Takes = Takes(2);
    const KNOWN: u8 = if cfg!(feature = "same-host") {
        0b11
    } else {
        0b1
    };

    /// Whether all of `other` is set.
    pub const fn contains(self, other: Takes) -> bool {
        self.0 & other.0 == other.0
    }

    /// `self` with `other` set when `on`.
    #[must_use]
    pub const fn with(self, other: Takes, on: bool) -> Takes {
        if on {
            Takes(self.0 | other.0)
        } else {
            self
        }
    }

    /// Raw bits.
    pub const fn bits(self) -> u8 {
        self.0
    }
}

/// A Hello frame: the sender's limits, and which of a peer's connections
/// this one is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Hello {
    /// Message bytes the sender takes from this peer before it returns
    /// credit (its first `limit`).
    pub window: u32,
    /// The longest message the sender takes.
    pub max_message: u32,
    /// The longest frame payload the sender takes (longer messages are fragmented).
    pub frame_max: u32,
    /// Receive slots the sender keeps posted (its peer's first frame
    /// credits); 0 on wires without a ring.
    pub ring: u16,
    /// Which of the peer's connections this is: 0 the main one, 1 its
    /// second (striped payloads only).
    pub lane: u8,
    /// What the sender takes.
    pub takes: Takes,
    /// Names the connections of one peer alike (a lane is paired by it).
    pub token: u32,
}

/// A close frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Close {
    /// The sequence number the sender's next message would have had: how
    /// many it sent, so a lost tail is seen.
    pub seq: u64,
}

/// A want frame: the sender waits to start a message of `len` bytes
/// after `offset` bytes of earlier messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Want {
    /// Message bytes the sender started before this message.
    pub offset: u64,
    /// The message's length.
    pub len: u32,
}

/// Which step of the same-host exchange a [`Host`] frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[repr(u8)]
pub enum HostStep {
    /// The connecting side will not share memory (its other fields are 0).
    NoOffer = 0,
    /// The connecting side offers to share memory: its host, process and
    /// the nonce that names where it takes the segment.
    Offer = 1,
    /// The accepting side took the offer: the session moves to shared memory.
    Accept = 2,
    /// The accepting side declined: the session stays on this wire.
    Decline = 3,
}

impl HostStep {
    fn from_u8(v: u8) -> Option<HostStep> {
        Some(match v {
            0 => HostStep::NoOffer,
            1 => HostStep::Offer,
            2 => HostStep::Accept,
            3 => HostStep::Decline,
            _ => return None,
        })
    }
}

/// A host frame: right after the Hellos of a wire that can find peers on
/// the same host (TCP), the connecting side says whether it offers to share
/// memory, and the accepting side answers an offer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Host {
    /// The sender's host: a digest of its boot id and its IPC, mount and
    /// network namespaces (the same only where memory can be shared).
    pub host: u64,
    /// The sender's process id.
    pub pid: u32,
    /// The sender's nonce: with `pid`, names where it takes the segment.
    pub nonce: u32,
    /// Offer or answer.
    pub step: HostStep,
}

/// A decoded header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Frame {
    /// A message or a fragment of one.
    Data(Data),
    /// Credit returned.
    Credit(Credit),
    /// The first frame on a connection.
    Hello(Hello),
    /// A clean close.
    Close(Close),
    /// A request for credit.
    Want(Want),
    /// A same-host offer or its answer.
    Host(Host),
}

impl Frame {
    /// Its kind.
    pub const fn kind(&self) -> FrameKind {
        match self {
            Frame::Data(_) => FrameKind::Data,
            Frame::Credit(_) => FrameKind::Credit,
            Frame::Hello(_) => FrameKind::Hello,
            Frame::Close(_) => FrameKind::Close,
            Frame::Want(_) => FrameKind::Want,
            Frame::Host(_) => FrameKind::Host,
        }
    }

    /// Payload bytes that follow the header.
    pub const fn payload_len(&self) -> usize {
        match self {
            Frame::Data(d) => d.len as usize,
            _ => 0,
        }
    }

    /// The 32 header bytes, checksummed over the header and, for a data
    /// frame flagged [`DataFlags::PAYLOAD_CHECKED`], over `payload` too.
    pub fn encode(&self, payload: &[u8]) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        b[2] = VERSION;
        b[3] = self.kind() as u8;
        match *self {
            Frame::Data(d) => {
                b[4..6].copy_from_slice(&d.flags.0.to_le_bytes());
                let slots = (d.credits & MAX_FRAME_CREDITS) | (u16::from(d.control) << 14);
                b[6..8].copy_from_slice(&slots.to_le_bytes());
                b[8..16].copy_from_slice(&d.seq.to_le_bytes());
                b[16..20].copy_from_slice(&d.msg_len.to_le_bytes());
                b[20..24].copy_from_slice(&d.len.to_le_bytes());
                b[24..28].copy_from_slice(&d.offset.to_le_bytes());
            }
            Frame::Credit(c) => {
                b[8..12].copy_from_slice(&c.frames.to_le_bytes());
                b[12..20].copy_from_slice(&c.limit.to_le_bytes());
                b[20] = c.control;
            }
            Frame::Hello(h) => {
                b[8..12].copy_from_slice(&h.window.to_le_bytes());
                b[12..16].copy_from_slice(&h.max_message.to_le_bytes());
                b[16..20].copy_from_slice(&h.frame_max.to_le_bytes());
                b[20..22].copy_from_slice(&h.ring.to_le_bytes());
                b[22] = h.lane;
                b[23] = h.takes.0;
                b[24..28].copy_from_slice(&h.token.to_le_bytes());
            }
            Frame::Close(c) => b[8..16].copy_from_slice(&c.seq.to_le_bytes()),
            Frame::Want(w) => {
                b[8..16].copy_from_slice(&w.offset.to_le_bytes());
                b[16..20].copy_from_slice(&w.len.to_le_bytes());
            }
            Frame::Host(h) => {
                b[8..16].copy_from_slice(&h.host.to_le_bytes());
                b[16..20].copy_from_slice(&h.pid.to_le_bytes());
                b[20..24].copy_from_slice(&h.nonce.to_le_bytes());
                b[24] = h.step as u8;
            }
        }
        let mut sum = crc32c(0, &b[..28]);
        if self.payload_checked() {
            sum = crc32c(sum, payload);
        }
        b[28..32].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Whether the checksum covers the payload.
    pub const fn payload_checked(&self) -> bool {
        matches!(self, Frame::Data(d) if d.flags.contains(DataFlags::PAYLOAD_CHECKED))
    }

    /// Decodes and checks a header: magic, version, kind, flags and the
    /// bytes its kind leaves zero, every length against `max_payload`
    /// (before anyone reserves memory for it), and the checksum — in full
    /// where no payload bytes follow, else over the header part, kept in the
    /// [`Decoded`] for [`Decoded::verify`] once the payload is in.
    pub fn decode(bytes: &[u8], max_payload: usize) -> Result<Decoded, DecodeError> {
        let Some(b) = bytes.get(..HEADER_LEN) else {
            return Err(DecodeError::Truncated { have: bytes.len() });
        };
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| u64::from(u32_at(i)) | (u64::from(u32_at(i + 4)) << 32);
        let magic = u16_at(0);
        if magic != MAGIC {
            return Err(DecodeError::BadMagic(magic));
        }
        if b[2] != VERSION {
            return Err(DecodeError::UnsupportedVersion {
                theirs: b[2],
                ours: VERSION,
            });
        }
        let kind = FrameKind::from_u8(b[3]).ok_or(DecodeError::UnknownKind(b[3]))?;
        let flags = u16_at(4);
        let flags_known = match kind {
            FrameKind::Data => DataFlags::KNOWN,
            _ => 0,
        };
        // Each kind names its bytes; any other set byte is a frame from a
        // version this code does not speak, or garbage.
        let unused = match kind {
            FrameKind::Data | FrameKind::Hello => 0..0,
            FrameKind::Credit => 21..28,
            FrameKind::Close => 16..28,
            FrameKind::Want => 20..28,
            FrameKind::Host => 25..28,
        };
        // Bytes 6..8 belong to the data kind only.
        let word6 = kind != FrameKind::Data && u16_at(6) != 0;
        // A Credit frame's control byte holds 0..=3; its high bits are reserved.
        let control = kind == FrameKind::Credit && b[20] > MAX_CONTROL_CREDITS;
        if flags & !flags_known != 0 || word6 || control || b[unused].iter().any(|&x| x != 0) {
            return Err(DecodeError::ReservedBits);
        }
        let frame = match kind {
            FrameKind::Data => Frame::Data(Data {
                flags: DataFlags(flags),
                credits: u16_at(6) & MAX_FRAME_CREDITS,
                control: (u16_at(6) >> 14) as u8,
                seq: u64_at(8),
                msg_len: u32_at(16),
                len: u32_at(20),
                offset: u32_at(24),
            }),
            FrameKind::Credit => Frame::Credit(Credit {
                frames: u32_at(8),
                limit: u64_at(12),
                control: b[20],
            }),
            FrameKind::Hello => {
                let takes = b[23];
                if takes & !Takes::KNOWN != 0 {
                    return Err(DecodeError::ReservedBits);
                }
                Frame::Hello(Hello {
                    window: u32_at(8),
                    max_message: u32_at(12),
                    frame_max: u32_at(16),
                    ring: u16_at(20),
                    lane: b[22],
                    takes: Takes(takes),
                    token: u32_at(24),
                })
            }
            FrameKind::Close => Frame::Close(Close { seq: u64_at(8) }),
            FrameKind::Want => Frame::Want(Want {
                offset: u64_at(8),
                len: u32_at(16),
            }),
            FrameKind::Host => Frame::Host(Host {
                host: u64_at(8),
                pid: u32_at(16),
                nonce: u32_at(20),
                step: HostStep::from_u8(b[24]).ok_or(DecodeError::ReservedBits)?,
            }),
        };
        if let Frame::Data(d) = frame {
            if u64::from(d.len) > max_payload as u64 {
                return Err(DecodeError::TooLong {
                    len: d.len,
                    max: max_payload,
                });
            }
        }
        let carried = u32_at(28);
        let header_sum = crc32c(0, &b[..28]);
        let decoded = Decoded {
            frame,
            carried,
            header_sum,
        };
        // A frame without payload bytes is checked now, whatever its flags
        // say: nothing will follow to check it against later.
        if !frame.payload_checked() || frame.payload_len() == 0 {
            decoded.verify(&[])?;
        }
        Ok(decoded)
    }
}

/// A header that decoded, with what checking its payload needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Decoded {
    /// The frame.
    pub frame: Frame,
    /// The checksum it carried.
    carried: u32,
    /// CRC-32C over its bytes 0..28.
    header_sum: u32,
}

impl Decoded {
    /// Checks the carried checksum against the header and `payload` (for a
    /// frame whose checksum covers its payload; the header alone for the others).
    pub fn verify(&self, payload: &[u8]) -> Result<(), DecodeError> {
        let computed = if self.frame.payload_checked() {
            crc32c(self.header_sum, payload)
        } else {
            self.header_sum
        };
        if computed == self.carried {
            Ok(())
        } else {
            Err(DecodeError::BadChecksum {
                carried: self.carried,
                computed,
            })
        }
    }
}

/// What a stream wire (TCP, a same-host lane) writes in place of a data
/// frame's header where the engine frames a message headerless: the whole
/// message in one frame, to a peer whose Hello said it takes them
/// ([`Takes::HEADERLESS`]). It carries what verbs carries in immediate data,
/// the engine's word (sequence and credits, see
/// [`DataFrame::imm`](crate::session::DataFrame::imm)), and the length:
///
/// ```text
///  0       2      4     8     12                                  32
///  | TAG   | zero | imm | len |               zero                 |
/// ```
///
/// It is a header's length, so a queued or half-read frame has one shape
/// either way, and its first two bytes tell it from a header's [`MAGIC`].
/// It has no checksum: a lane is memory, whose reader bounds-checks every
/// length, and TCP checks every segment itself; the reader checks a record
/// as strictly as a header (reserved bytes zero here; the length against
/// the frame maximum and the byte credit, the sequence and the handshake's
/// order in the engine's
/// [`handle_short_record`](crate::session::Session::handle_short_record)). The
/// header's codec and CRC-32C were a sixth of a small message's work over
/// TCP and a third over a lane. A side that wants every frame checksummed
/// sends and takes none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct ShortRecord {
    /// The engine's immediate word.
    pub imm: u32,
    /// The message's length in bytes.
    pub len: u32,
}

impl ShortRecord {
    /// Its first two bytes, little-endian (`"SZ"`).
    pub const TAG: u16 = 0x535A;

    /// The record's bytes.
    pub fn encode(self) -> [u8; HEADER_LEN] {
        let mut h = [0; HEADER_LEN];
        h[..2].copy_from_slice(&Self::TAG.to_le_bytes());
        h[4..8].copy_from_slice(&self.imm.to_le_bytes());
        h[8..12].copy_from_slice(&self.len.to_le_bytes());
        h
    }

    /// The record in `h`; `None` where `h` does not start with [`TAG`](Self::TAG)
    /// (a header, for [`Frame::decode`]), an error where a reserved byte is set.
    pub fn decode(h: &[u8; HEADER_LEN]) -> Option<Result<ShortRecord, DecodeError>> {
        if h[..2] != Self::TAG.to_le_bytes() {
            return None;
        }
        // One OR over the reserved bytes (no early exit: it vectorizes).
        let reserved = h[2] | h[3] | h[12..].iter().fold(0, |a, &b| a | b);
        if reserved != 0 {
            return Some(Err(DecodeError::ReservedBits));
        }
        let word = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        Some(Ok(ShortRecord {
            imm: word(4),
            len: word(8),
        }))
    }
}

/// Why bytes are not a valid header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum DecodeError {
    /// Fewer than [`HEADER_LEN`] bytes.
    Truncated {
        /// Bytes present.
        have: usize,
    },
    /// Not a zerohop frame.
    BadMagic(u16),
    /// A protocol version this code does not speak.
    UnsupportedVersion {
        /// The peer's.
        theirs: u8,
        /// This code's ([`VERSION`]).
        ours: u8,
    },
    /// An unknown frame kind.
    UnknownKind(u8),
    /// Flags or bytes this version leaves zero are set.
    ReservedBits,
    /// The payload would exceed the receiver's maximum.
    TooLong {
        /// Declared length.
        len: u32,
        /// The maximum.
        max: usize,
    },
    /// The checksum does not match.
    BadChecksum {
        /// Carried in the frame.
        carried: u32,
        /// Computed here.
        computed: u32,
    },
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Truncated { have } => {
                write!(f, "truncated header: {have} of {HEADER_LEN} bytes")
            }
            DecodeError::BadMagic(m) => write!(f, "bad magic {m:#06x} (not a zerohop frame)"),
            DecodeError::UnsupportedVersion { theirs, ours } => write!(
                f,
                "the peer speaks zerohop protocol version {theirs}, this side speaks {ours}"
            ),
            DecodeError::UnknownKind(k) => write!(f, "unknown frame kind {k}"),
            DecodeError::ReservedBits => f.write_str("reserved bits set"),
            DecodeError::TooLong { len, max } => write!(
                f,
                "declared payload of {len} bytes exceeds the maximum of {max}"
            ),
            DecodeError::BadChecksum { carried, computed } => write!(
                f,
                "checksum {carried:#010x} does not match {computed:#010x}"
            ),
        }
    }
}

impl core::error::Error for DecodeError {}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            window: 0x0100_0000,
            max_message: 0x0400_0000,
            frame_max: 0x1_0000,
            ring: 64,
            lane: 1,
            takes: Takes::HEADERLESS,
            token: 0xA1B2_C3D4,
        }
    }

    /// Two credit frames folded into one return the slots of both and the
    /// higher limit; slots saturate.
    #[test]
    fn a_credit_folded_into_another_says_what_both_said() {
        let a = Credit {
            frames: 3,
            limit: 1000,
            control: 1,
        };
        let b = Credit {
            frames: 4,
            limit: 5000,
            control: 2,
        };
        let both = Credit {
            frames: 7,
            limit: 5000,
            control: 3,
        };
        assert_eq!(a.then(b), both);
        assert_eq!(b.then(a).limit, 5000, "a limit never goes back");
        let full = Credit {
            frames: u32::MAX,
            control: u8::MAX,
            ..a
        };
        assert_eq!(full.then(b).frames, u32::MAX);
        assert_eq!(full.then(b).control, u8::MAX);
    }

    /// Every kind's bytes, field by field: the layout in the module docs.
    #[test]
    fn each_kind_encodes_to_its_byte_fixture() {
        let data = Frame::Data(Data {
            flags: DataFlags::PAYLOAD_CHECKED | DataFlags::MORE,
            seq: 0x0102_0304_0506_0708,
            msg_len: 0x0A0B_0C0D,
            len: 2,
            offset: 0x0100,
            credits: 0x0211,
            control: 2,
        })
        .encode(b"hi");
        assert_eq!(
            &data[..4],
            &[0x5A, 0x48, 6, 1],
            "magic 'ZH', version 6, data"
        );
        assert_eq!(
            &data[4..8],
            &[3, 0, 0x11, 0x82],
            "checked + more; credits, control in the top 2 bits"
        );
        assert_eq!(&data[8..16], &[8, 7, 6, 5, 4, 3, 2, 1], "seq");
        assert_eq!(&data[16..20], &[0x0D, 0x0C, 0x0B, 0x0A], "msg_len");
        assert_eq!(&data[20..28], &[2, 0, 0, 0, 0, 1, 0, 0], "len, offset");

        let credit = Frame::Credit(Credit {
            frames: 5,
            limit: 0x0102_0304_0506_0708,
            control: 3,
        })
        .encode(&[]);
        assert_eq!(&credit[2..8], &[6, 2, 0, 0, 0, 0], "no flags");
        assert_eq!(&credit[8..12], &[5, 0, 0, 0], "frames");
        assert_eq!(&credit[12..20], &[8, 7, 6, 5, 4, 3, 2, 1], "limit");
        assert_eq!(credit[20], 3, "control");
        assert_eq!(&credit[21..28], &[0; 7]);

        let h = Frame::Hello(hello()).encode(&[]);
        assert_eq!(&h[2..4], &[6, 3]);
        assert_eq!(&h[8..12], &[0, 0, 0, 1], "window");
        assert_eq!(&h[12..16], &[0, 0, 0, 4], "max_message");
        assert_eq!(&h[16..20], &[0, 0, 1, 0], "frame_max");
        assert_eq!(&h[20..24], &[64, 0, 1, 1], "ring, lane, takes");
        assert_eq!(&h[24..28], &[0xD4, 0xC3, 0xB2, 0xA1], "token");

        let close = Frame::Close(Close { seq: 9 }).encode(&[]);
        assert_eq!(&close[2..4], &[6, 4]);
        assert_eq!(
            &close[8..28],
            &[9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );

        let want = Frame::Want(Want {
            offset: 0x100,
            len: 0x0200_0000,
        })
        .encode(&[]);
        assert_eq!(&want[2..4], &[6, 5]);
        assert_eq!(&want[8..20], &[0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);

        let host = Frame::Host(Host {
            host: 0x0102_0304_0506_0708,
            pid: 0x1234,
            nonce: 0xA1B2_C3D4,
            step: HostStep::Offer,
        })
        .encode(&[]);
        assert_eq!(&host[2..8], &[6, 6, 0, 0, 0, 0], "host, no flags");
        assert_eq!(&host[8..16], &[8, 7, 6, 5, 4, 3, 2, 1], "host");
        assert_eq!(&host[16..20], &[0x34, 0x12, 0, 0], "pid");
        assert_eq!(&host[20..24], &[0xD4, 0xC3, 0xB2, 0xA1], "nonce");
        assert_eq!(&host[24..28], &[1, 0, 0, 0], "step: offer");

        // The checksum is CRC-32C of bytes 0..28 (and the payload, when checked).
        for (bytes, payload) in [(data, &b"hi"[..]), (credit, &[][..]), (h, &[][..])] {
            let want = crc32c(crc32c(0, &bytes[..28]), payload);
            assert_eq!(bytes[28..32], want.to_le_bytes());
        }
    }

    #[test]
    fn a_short_record_has_its_byte_fixture_and_is_told_from_a_header() {
        let r = ShortRecord {
            imm: 0x0102_0304,
            len: 0x0A0B_0C0D,
        };
        let b = r.encode();
        assert_eq!(&b[..4], &[0x5A, 0x53, 0, 0], "tag 'SZ', then zero");
        assert_eq!(&b[4..8], &[4, 3, 2, 1], "imm");
        assert_eq!(&b[8..12], &[0x0D, 0x0C, 0x0B, 0x0A], "len");
        assert!(b[12..].iter().all(|&x| x == 0));
        assert_eq!(ShortRecord::decode(&b), Some(Ok(r)));
        // Every reserved byte, set alone, is refused.
        for i in (2..4).chain(12..HEADER_LEN) {
            let mut bad = b;
            bad[i] = 0x80;
            assert_eq!(
                ShortRecord::decode(&bad),
                Some(Err(DecodeError::ReservedBits)),
                "byte {i}"
            );
        }
        // And every pair set alike, whose bits a sum or an exclusive or
        // of them would cancel.
        let reserved: std::vec::Vec<usize> = (2..4).chain(12..HEADER_LEN).collect();
        for (k, &i) in reserved.iter().enumerate() {
            for &j in &reserved[k + 1..] {
                let mut bad = b;
                (bad[i], bad[j]) = (0x80, 0x80);
                assert_eq!(
                    ShortRecord::decode(&bad),
                    Some(Err(DecodeError::ReservedBits)),
                    "bytes {i} and {j}"
                );
            }
        }
        // A header is not a record, nor is a record a header.
        let header = Frame::Close(Close { seq: 1 }).encode(&[]);
        assert_eq!(ShortRecord::decode(&header), None);
        assert!(matches!(
            Frame::decode(&b, usize::MAX),
            Err(DecodeError::BadMagic(ShortRecord::TAG))
        ));
    }

    #[test]
    fn every_kind_round_trips() {
        let frames = [
            Frame::Data(Data {
                flags: DataFlags::STRIPED,
                seq: u64::MAX,
                msg_len: 7,
                len: 7,
                offset: u32::MAX,
                credits: MAX_FRAME_CREDITS,
                control: MAX_CONTROL_CREDITS,
            }),
            Frame::Credit(Credit {
                frames: 3,
                limit: u64::MAX,
                control: 0,
            }),
            Frame::Credit(Credit {
                frames: 0,
                limit: 0,
                control: MAX_CONTROL_CREDITS,
            }),
            Frame::Hello(hello()),
            Frame::Close(Close { seq: 42 }),
            Frame::Want(Want {
                offset: 1 << 40,
                len: 99,
            }),
            Frame::Host(Host {
                host: u64::MAX,
                pid: 7,
                nonce: u32::MAX,
                step: HostStep::Offer,
            }),
            Frame::Host(Host {
                host: 0,
                pid: 0,
                nonce: 0,
                step: HostStep::NoOffer,
            }),
            Frame::Host(Host {
                host: 0,
                pid: 0,
                nonce: 0,
                step: HostStep::Accept,
            }),
            Frame::Host(Host {
                host: 0,
                pid: 0,
                nonce: 0,
                step: HostStep::Decline,
            }),
        ];
        for f in frames {
            let payload = [0x5Au8; 7];
            let payload = &payload[..f.payload_len()];
            let d = Frame::decode(&f.encode(payload), 1 << 20).unwrap();
            assert_eq!(d.frame, f);
            assert_eq!(d.verify(payload), Ok(()));
        }
    }

    #[test]
    fn a_checked_payload_is_verified_once_it_is_in() {
        let f = Frame::Data(Data {
            flags: DataFlags::PAYLOAD_CHECKED,
            seq: 0,
            msg_len: 2,
            len: 2,
            offset: 0,
            credits: 0,
            control: 0,
        });
        let d = Frame::decode(&f.encode(b"hi"), 16).unwrap();
        assert_eq!(d.verify(b"hi"), Ok(()));
        assert!(matches!(
            d.verify(b"ho"),
            Err(DecodeError::BadChecksum { .. })
        ));
        // Unchecked: the payload does not enter the sum.
        let plain = Frame::Data(Data {
            flags: DataFlags::NONE,
            ..match f {
                Frame::Data(d) => d,
                _ => unreachable!(),
            }
        });
        let d = Frame::decode(&plain.encode(b"hi"), 16).unwrap();
        assert_eq!(d.verify(b"anything"), Ok(()));
    }

    #[test]
    fn truncated_and_garbage_headers_are_typed_errors() {
        let good = Frame::Hello(hello()).encode(&[]);
        for n in 0..HEADER_LEN {
            assert_eq!(
                Frame::decode(&good[..n], 0),
                Err(DecodeError::Truncated { have: n })
            );
        }
        assert_eq!(
            Frame::decode(&[0xAB; 32], 0),
            Err(DecodeError::BadMagic(0xABAB))
        );
        for old in [1, 2, 3, 4, 5] {
            let mut v = good;
            v[2] = old;
            assert_eq!(
                Frame::decode(&v, 0),
                Err(DecodeError::UnsupportedVersion {
                    theirs: old,
                    ours: 6
                })
            );
        }
        // A host frame with an unknown step, or bytes past the step set.
        let h = Frame::Host(Host {
            host: 1,
            pid: 2,
            nonce: 3,
            step: HostStep::Decline,
        })
        .encode(&[]);
        for (at, v) in [(24, 4u8), (25, 1), (27, 1), (4, 1)] {
            let mut b = h;
            b[at] = v;
            let sum = crc32c(0, &b[..28]);
            b[28..32].copy_from_slice(&sum.to_le_bytes());
            assert_eq!(
                Frame::decode(&b, 0),
                Err(DecodeError::ReservedBits),
                "byte {at}"
            );
        }
        let mut k = good;
        k[3] = 77;
        assert_eq!(Frame::decode(&k, 0), Err(DecodeError::UnknownKind(77)));
        k[3] = 0;
        assert_eq!(Frame::decode(&k, 0), Err(DecodeError::UnknownKind(0)));
        let mut r = good;
        r[6] = 1;
        assert_eq!(Frame::decode(&r, 0), Err(DecodeError::ReservedBits));
        let mut c = good;
        c[10] ^= 0x40; // the window flipped: the header checksum catches it
        assert!(matches!(
            Frame::decode(&c, 0),
            Err(DecodeError::BadChecksum { .. })
        ));
    }

    #[test]
    fn flags_and_bytes_a_kind_does_not_name_are_refused() {
        let resum = |mut b: [u8; 32]| {
            let s = crc32c(0, &b[..28]);
            b[28..].copy_from_slice(&s.to_le_bytes());
            b
        };
        // A control frame with a data flag.
        let mut b = Frame::Close(Close { seq: 1 }).encode(&[]);
        b[4] = 1;
        assert_eq!(Frame::decode(&resum(b), 0), Err(DecodeError::ReservedBits));
        // Bytes 6..8 on a kind other than data.
        let mut b = Frame::Want(Want { offset: 1, len: 1 }).encode(&[]);
        b[7] = 1;
        assert_eq!(Frame::decode(&resum(b), 0), Err(DecodeError::ReservedBits));
        // A credit frame with a flag (it has none), or more control slots
        // than two bits hold.
        let credit = Frame::Credit(Credit {
            frames: 0,
            limit: 0,
            control: 3,
        })
        .encode(&[]);
        let mut b = credit;
        b[4] = 1;
        assert_eq!(Frame::decode(&resum(b), 0), Err(DecodeError::ReservedBits));
        let mut b = credit;
        b[20] = 4;
        assert_eq!(Frame::decode(&resum(b), 0), Err(DecodeError::ReservedBits));
        // A data frame with a flag no version defines.
        let mut b = Frame::Data(Data {
            flags: DataFlags::NONE,
            seq: 0,
            msg_len: 0,
            len: 0,
            offset: 0,
            credits: 0,
            control: 0,
        })
        .encode(&[]);
        b[4] = 16;
        assert_eq!(Frame::decode(&resum(b), 0), Err(DecodeError::ReservedBits));
        // Bytes past a kind's last field: each of them.
        for (frame, from) in [
            (Frame::Close(Close { seq: 1 }), 16),
            (
                Frame::Credit(Credit {
                    frames: 1,
                    limit: 1,
                    control: 0,
                }),
                21,
            ),
            (Frame::Want(Want { offset: 1, len: 1 }), 20),
        ] {
            for i in from..28 {
                let mut b = frame.encode(&[]);
                b[i] = 1;
                assert_eq!(
                    Frame::decode(&resum(b), 0),
                    Err(DecodeError::ReservedBits),
                    "{:?} byte {i}",
                    frame.kind()
                );
            }
        }
        // Unknown Hello capabilities.
        let mut b = Frame::Hello(hello()).encode(&[]);
        b[23] = 4;
        assert_eq!(Frame::decode(&resum(b), 0), Err(DecodeError::ReservedBits));
    }

    #[test]
    fn a_huge_declared_length_is_refused_before_any_payload() {
        let f = Frame::Data(Data {
            flags: DataFlags::NONE,
            seq: 0,
            msg_len: u32::MAX,
            len: u32::MAX,
            offset: 0,
            credits: 0,
            control: 0,
        });
        assert_eq!(
            Frame::decode(&f.encode(&[]), 64 << 20),
            Err(DecodeError::TooLong {
                len: u32::MAX,
                max: 64 << 20
            })
        );
        // At the bound exactly: accepted.
        let f = Frame::Data(Data {
            flags: DataFlags::NONE,
            seq: 0,
            msg_len: 64,
            len: 64,
            offset: 0,
            credits: 0,
            control: 0,
        });
        assert!(Frame::decode(&f.encode(&[]), 64).is_ok());
    }

    #[test]
    fn a_frame_without_payload_is_checked_at_once_even_when_flagged_payload_checked() {
        let f = Frame::Data(Data {
            flags: DataFlags::PAYLOAD_CHECKED,
            seq: 3,
            msg_len: 0,
            len: 0,
            offset: 0,
            credits: 0,
            control: 0,
        });
        let mut b = f.encode(&[]);
        assert_eq!(Frame::decode(&b, 0).map(|d| d.frame), Ok(f));
        b[28] ^= 1;
        assert!(matches!(
            Frame::decode(&b, 0),
            Err(DecodeError::BadChecksum { .. })
        ));
    }

    #[test]
    fn flag_helpers_say_what_is_set() {
        let f = DataFlags::MORE | DataFlags::STRIPED;
        assert_eq!(f.bits(), 6);
        assert!(f.contains(DataFlags::MORE));
        assert!(!f.contains(DataFlags::PAYLOAD_CHECKED));
        assert!(!DataFlags::NONE.contains(DataFlags::MORE));
        assert_eq!(DataFlags::NONE.with(DataFlags::MORE, true), DataFlags::MORE);
        assert_eq!(
            DataFlags::NONE.with(DataFlags::MORE, false),
            DataFlags::NONE
        );
        // Setting a flag that is already set keeps it set.
        assert_eq!(f.with(DataFlags::MORE, true), f);
        assert_eq!(DataFlags::MORE | DataFlags::MORE, DataFlags::MORE);
        assert_eq!(Takes::HEADERLESS.bits(), 1);
        assert_eq!(Takes::NONE.bits(), 0);
        assert!(Takes::HEADERLESS.contains(Takes::HEADERLESS));
        assert!(!Takes::NONE.contains(Takes::HEADERLESS));
        let both = Takes::HEADERLESS.with(Takes::DEVICE, true);
        assert_eq!(both.bits(), 3);
        assert_eq!(both.with(Takes::DEVICE, true), both, "set stays set");
        assert_eq!(both.with(Takes::DEVICE, false), both, "false leaves it");
        for (k, name) in [
            (FrameKind::Data, "data"),
            (FrameKind::Credit, "credit"),
            (FrameKind::Hello, "hello"),
            (FrameKind::Close, "close"),
            (FrameKind::Want, "want"),
        ] {
            assert_eq!(FrameKind::from_u8(k as u8), Some(k));
            assert_eq!(k.name(), name);
        }
    }
}
