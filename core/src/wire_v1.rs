//! The frame: a fixed 32-byte little-endian header, then `len` payload bytes.
//!
//! ```text
//!  0      2    3     4       6        8     12    16         24     28        32
//!  | magic | ver | kind | flags | resvd | src | dst |   seq    | len | checksum |
//! ```
//!
//! `checksum` is CRC-32C over header bytes 0..28, continued over the payload
//! when [`Flags::PAYLOAD_CHECKED`] is set. The decoder bounds `len` against the
//! caller's maximum *before* anyone reserves memory for the payload.

use core::fmt;

use crate::crc::crc32c;

/// Bytes in a header.
pub const HEADER_LEN: usize = 32;
/// `"ZH"` little-endian.
pub const MAGIC: u16 = 0x485A;
/// The only version this code speaks.
pub const VERSION: u8 = 1;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[repr(u8)]
pub enum FrameKind {
    /// A message (or one fragment of it).
    Data = 1,
    /// Receive credits returned to the sender; `len` = 0, `seq` = credits granted.
    Credit = 2,
    /// The first frame on a connection: `src` names the sender's endpoint.
    Hello = 3,
    /// The sender is closing cleanly; nothing follows.
    Close = 4,
}

impl FrameKind {
    fn from_u8(v: u8) -> Option<FrameKind> {
        Some(match v {
            1 => FrameKind::Data,
            2 => FrameKind::Credit,
            3 => FrameKind::Hello,
            4 => FrameKind::Close,
            _ => return None,
        })
    }
}

/// Header flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Flags(u16);

impl Flags {
    /// No flags.
    pub const NONE: Flags = Flags(0);
    /// The checksum covers the payload too.
    pub const PAYLOAD_CHECKED: Flags = Flags(1);
    /// More fragments of this message follow.
    pub const MORE: Flags = Flags(2);
    /// The payload is striped (TCP): this frame carries the header and the
    /// first part; the rest follows on the peer's second connection (its
    /// lane), which carries nothing else. Where the split falls is the
    /// transport's rule, known to both sides.
    pub const STRIPED: Flags = Flags(4);
    const KNOWN: u16 = 0b111;

    /// Whether all of `other` is set.
    pub const fn contains(self, other: Flags) -> bool {
        self.0 & other.0 == other.0
    }

    /// Raw bits.
    pub const fn bits(self) -> u16 {
        self.0
    }
}

impl core::ops::BitOr for Flags {
    type Output = Flags;
    fn bitor(self, rhs: Flags) -> Flags {
        Flags(self.0 | rhs.0)
    }
}

/// A decoded header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Header {
    /// What the frame carries.
    pub kind: FrameKind,
    /// Flags.
    pub flags: Flags,
    /// Sender endpoint id.
    pub src: u32,
    /// Receiver endpoint id.
    pub dst: u32,
    /// Per-connection sequence number (0, 1, 2, ... for data frames).
    pub seq: u64,
    /// Payload bytes that follow.
    pub len: u32,
    /// CRC-32C (see the module docs).
    pub checksum: u32,
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
    /// A version this code does not speak.
    UnsupportedVersion(u8),
    /// An unknown frame kind.
    UnknownKind(u8),
    /// Flag or reserved bits this version does not define.
    ReservedBits,
    /// The payload would exceed the receiver's maximum.
    TooLong {
        /// Declared length.
        len: u64,
        /// The maximum.
        max: usize,
    },
    /// A control frame that carries a payload.
    UnexpectedPayload,
    /// A [`Flags::STRIPED`] frame on a connection whose second lane is not
    /// paired (the sender may stripe only once the receiver confirmed it).
    NoLane,
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
            DecodeError::UnsupportedVersion(v) => {
                write!(f, "unsupported version {v} (this is {VERSION})")
            }
            DecodeError::UnknownKind(k) => write!(f, "unknown frame kind {k}"),
            DecodeError::ReservedBits => f.write_str("reserved bits set"),
            DecodeError::TooLong { len, max } => write!(
                f,
                "declared payload of {len} bytes exceeds the maximum of {max}"
            ),
            DecodeError::UnexpectedPayload => f.write_str("control frame with a payload"),
            DecodeError::NoLane => f.write_str("striped frame without a paired second connection"),
            DecodeError::BadChecksum { carried, computed } => {
                write!(
                    f,
                    "checksum {carried:#010x} does not match {computed:#010x}"
                )
            }
        }
    }
}

impl core::error::Error for DecodeError {}

impl From<DecodeError> for crate::session::ProtocolError {
    /// The nearest version-2 error, for the drivers not yet on the engine.
    fn from(e: DecodeError) -> Self {
        use crate::wire::DecodeError as V2;
        crate::session::ProtocolError::Decode(match e {
            DecodeError::Truncated { have } => V2::Truncated { have },
            DecodeError::BadMagic(m) => V2::BadMagic(m),
            DecodeError::UnsupportedVersion(v) => V2::UnsupportedVersion {
                theirs: v,
                ours: VERSION,
            },
            DecodeError::UnknownKind(k) => V2::UnknownKind(k),
            DecodeError::TooLong { len, max } => V2::TooLong {
                len: len.min(u32::MAX as u64) as u32,
                max,
            },
            DecodeError::BadChecksum { carried, computed } => V2::BadChecksum { carried, computed },
            DecodeError::ReservedBits | DecodeError::UnexpectedPayload | DecodeError::NoLane => {
                V2::ReservedBits
            }
        })
    }
}

impl Header {
    /// A data header for `payload` (checksummed over the payload when
    /// `check_payload`), with `extra` flags ([`Flags::MORE`], [`Flags::STRIPED`]).
    pub fn data(
        src: u32,
        dst: u32,
        seq: u64,
        payload: &[u8],
        check_payload: bool,
        extra: Flags,
    ) -> Header {
        let flags = if check_payload {
            Flags::PAYLOAD_CHECKED | extra
        } else {
            extra
        };
        let mut h = Header {
            kind: FrameKind::Data,
            flags,
            src,
            dst,
            seq,
            len: payload.len() as u32,
            checksum: 0,
        };
        h.checksum = h.compute_checksum(payload);
        h
    }

    /// A control header (no payload).
    pub fn control(kind: FrameKind, src: u32, dst: u32, seq: u64) -> Header {
        let mut h = Header {
            kind,
            flags: Flags::NONE,
            src,
            dst,
            seq,
            len: 0,
            checksum: 0,
        };
        h.checksum = h.compute_checksum(&[]);
        h
    }

    fn body(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        b[2] = VERSION;
        b[3] = self.kind as u8;
        b[4..6].copy_from_slice(&self.flags.0.to_le_bytes());
        // 6..8 reserved, zero
        b[8..12].copy_from_slice(&self.src.to_le_bytes());
        b[12..16].copy_from_slice(&self.dst.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// The checksum this header should carry for `payload`.
    pub fn compute_checksum(&self, payload: &[u8]) -> u32 {
        let c = crc32c(0, &self.body()[..28]);
        if self.flags.contains(Flags::PAYLOAD_CHECKED) {
            crc32c(c, payload)
        } else {
            c
        }
    }

    /// The 32 header bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = self.body();
        b[28..32].copy_from_slice(&self.checksum.to_le_bytes());
        b
    }

    /// Decodes and checks a header: magic, version, kind, reserved bits, the
    /// length against `max_payload`, and the header part of the checksum when
    /// the payload is not covered. Never panics.
    pub fn decode(bytes: &[u8], max_payload: usize) -> Result<Header, DecodeError> {
        let Some(b) = bytes.get(..HEADER_LEN) else {
            return Err(DecodeError::Truncated { have: bytes.len() });
        };
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let magic = u16_at(0);
        if magic != MAGIC {
            return Err(DecodeError::BadMagic(magic));
        }
        if b[2] != VERSION {
            return Err(DecodeError::UnsupportedVersion(b[2]));
        }
        let kind = FrameKind::from_u8(b[3]).ok_or(DecodeError::UnknownKind(b[3]))?;
        let flags = u16_at(4);
        if flags & !Flags::KNOWN != 0 || u16_at(6) != 0 {
            return Err(DecodeError::ReservedBits);
        }
        let len = u32_at(24);
        if len as u64 > max_payload as u64 {
            return Err(DecodeError::TooLong {
                len: len as u64,
                max: max_payload,
            });
        }
        if kind != FrameKind::Data && len != 0 {
            return Err(DecodeError::UnexpectedPayload);
        }
        let h = Header {
            kind,
            flags: Flags(flags),
            src: u32_at(8),
            dst: u32_at(12),
            seq: u64::from_le_bytes([b[16], b[17], b[18], b[19], b[20], b[21], b[22], b[23]]),
            len,
            checksum: u32_at(28),
        };
        // A frame without payload bytes is checked now, whatever its flags
        // say: nothing will follow to check it against later.
        if !h.flags.contains(Flags::PAYLOAD_CHECKED) || h.len == 0 {
            h.verify(&[])?;
        }
        Ok(h)
    }

    /// Checks the checksum against `payload` (call it once the payload is in,
    /// for frames with [`Flags::PAYLOAD_CHECKED`]; harmless for the others).
    pub fn verify(&self, payload: &[u8]) -> Result<(), DecodeError> {
        let computed = self.compute_checksum(payload);
        if computed == self.checksum {
            Ok(())
        } else {
            Err(DecodeError::BadChecksum {
                carried: self.checksum,
                computed,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_frame_round_trips_with_a_byte_fixture() {
        let h = Header::data(7, 9, 0x0102_0304_0506_0708, b"hi", true, Flags::NONE);
        let bytes = h.encode();
        assert_eq!(
            &bytes[..4],
            &[0x5A, 0x48, 1, 1],
            "magic 'ZH', version 1, kind data"
        );
        assert_eq!(&bytes[4..6], &[1, 0], "payload-checked flag");
        assert_eq!(
            &bytes[16..24],
            &[8, 7, 6, 5, 4, 3, 2, 1],
            "seq little-endian"
        );
        assert_eq!(&bytes[24..28], &[2, 0, 0, 0]);
        let back = Header::decode(&bytes, 16).unwrap();
        assert_eq!(back, h);
        assert_eq!(back.verify(b"hi"), Ok(()));
        assert!(matches!(
            back.verify(b"ho"),
            Err(DecodeError::BadChecksum { .. })
        ));
    }

    #[test]
    fn truncated_and_garbage_headers_are_typed_errors() {
        let good = Header::control(FrameKind::Hello, 1, 2, 0).encode();
        for n in 0..HEADER_LEN {
            assert_eq!(
                Header::decode(&good[..n], 0),
                Err(DecodeError::Truncated { have: n })
            );
        }
        assert_eq!(
            Header::decode(&[0xAB; 32], 0),
            Err(DecodeError::BadMagic(0xABAB))
        );
        let mut v = good;
        v[2] = 9;
        assert_eq!(
            Header::decode(&v, 0),
            Err(DecodeError::UnsupportedVersion(9))
        );
        let mut k = good;
        k[3] = 77;
        assert_eq!(Header::decode(&k, 0), Err(DecodeError::UnknownKind(77)));
        let mut r = good;
        r[6] = 1;
        assert_eq!(Header::decode(&r, 0), Err(DecodeError::ReservedBits));
        let mut c = good;
        c[10] ^= 0x40; // src flipped: the header checksum catches it
        assert!(matches!(
            Header::decode(&c, 0),
            Err(DecodeError::BadChecksum { .. })
        ));
    }

    #[test]
    fn a_huge_declared_length_is_refused_before_any_payload() {
        let mut h = Header::data(1, 2, 0, &[], false, Flags::NONE);
        h.len = u32::MAX;
        h.checksum = h.compute_checksum(&[]);
        assert_eq!(
            Header::decode(&h.encode(), 64 << 20),
            Err(DecodeError::TooLong {
                len: u32::MAX as u64,
                max: 64 << 20
            })
        );
    }

    #[test]
    fn a_frame_without_payload_is_checked_at_once_even_when_flagged_payload_checked() {
        let mut h = Header::control(FrameKind::Hello, 1, 2, 7);
        h.flags = Flags::PAYLOAD_CHECKED;
        h.checksum = h.compute_checksum(&[]);
        assert_eq!(Header::decode(&h.encode(), 0), Ok(h));
        h.checksum ^= 1;
        assert!(matches!(
            Header::decode(&h.encode(), 0),
            Err(DecodeError::BadChecksum { .. })
        ));
    }

    #[test]
    fn control_frames_carry_no_payload() {
        let mut h = Header::control(FrameKind::Credit, 1, 2, 5);
        h.len = 3;
        h.checksum = h.compute_checksum(&[]);
        assert_eq!(
            Header::decode(&h.encode(), 100),
            Err(DecodeError::UnexpectedPayload)
        );
    }
}
