//! Large messages by a single copy: the receiver reads them straight out of
//! the sender's memory (`process_vm_readv`, "cross-memory attach"), as
//! UCX's `cma` transport does, instead of the two copies a ring costs (in,
//! then out). The ring carries the frame's header and a descriptor (the
//! bytes' address in the sender, a ticket, and where they lie in the
//! sender's pool file when they do: then the receiver copies them out of
//! its own mapping of that file instead, [`mapped`](super::mapped)); the
//! bytes stay where they are until the receiver says it has them.
//!
//! A message from a pool buffer, once the receiver has said it maps the
//! sender's pool file, goes *placed* (see `lane`): no claim, its own
//! tickets, its done in the ring's `placed_done` word. Every other one (a
//! caller's slice always: copying it into the pool first costs a second
//! copy that crosses between the two cores, BENCHMARKS.md) is handed over
//! as follows.
//!
//! The handover is one word per direction in the segment, the *claim*:
//! `ticket << 2 | state`. After ticket `t - 1` is done it reads
//! `(t - 1) << 2 | OPEN`. The receiver takes `t` by a compare-and-swap to
//! `t << 2 | READING`, copies, and stores `t << 2 | OPEN` (done) — or
//! `t << 2 | REFUSED` where it may not read the sender's memory (another
//! user, a ptrace policy): then the bytes follow in the ring, and neither
//! side tries again. A sender that must leave before `t` is taken (its
//! caller's deadline) swaps in `t << 2 | WITHDRAWN` first: then too the
//! bytes follow in the ring. It swaps from `t - 1`'s done or from `t - 1`'s
//! own withdrawal (the receiver has not come to that one yet): a withdrawn
//! word stands for every message up to its ticket, and the receiver opens
//! it at that ticket. Whoever swaps first decides; a sender whose
//! withdrawal lost waits for the copy under way. Any other value is a
//! peer breaking the lane.
//!
//! A claimed message of [`HELP_MIN`] bytes or more (placed:
//! [`HELP_PLACED_MIN`]) is copied by both cores: the sender, waiting for
//! its done anyway, writes the tail (from [`help_split`] on) straight into
//! the receiver's buffer (`process_vm_writev`) while the receiver reads
//! the head. Each ring has a second word for it, the *help*: `ticket << 2
//! | state` (a placed message's ticket with [`PLACED_TICKET`] set), beside
//! the tail's address in the receiver. Having claimed `t` (or taken placed
//! `t`), the receiver stores
//! the address and then `t << 2 | OFFERED`, and reads the head; it offers
//! only where it holds the sender's pidfd. The sender takes the offer by a
//! compare-and-swap to `TAKEN`, writes, and stores `DONE` — or `IDLE`
//! where it did not write (and, where the kernel refused the write, it
//! takes no more offers; the receiver goes on offering). Done with the
//! head, the receiver takes an offer still open back (`OFFERED` to `IDLE`)
//! and copies the tail itself; one taken it waits for: a sender whose
//! pidfd says it exited is a lost peer, one that has not written it within
//! [`HELP_WAIT`] breaks the lane, and the buffer it may still write into
//! stays out of the pool until its process has exited (the wire keeps it).
//! An offer of [`HELP_RING_MIN`] bytes or more rings a sender that sleeps
//! on its doorbell, and a sender about to sleep looks at the help word
//! last.
//!
//! The write needs the ptrace right that the read needs, under which
//! either process could already rewrite or stop the other: it asks for no
//! trust the read does not. A pid alone is not trusted: the sender writes
//! only while the receiver's pidfd says it lives, as the receiver keeps
//! bytes it read only when the sender's pidfd says so after the read.

use std::ffi::c_void;

use zerohop_backends::SharedPlace;

/// Messages at least this long go by a single copy by default
/// ([`ShmConfig::single_copy_from`](super::ShmConfig::single_copy_from); the
/// side that makes the segment writes its value there, and both sides go by
/// it).
pub(crate) const DEFAULT_MIN: usize = 32 << 10;
/// The least a segment's threshold is taken to be (a smaller value in a
/// peer's segment is read as this, on both sides).
pub(crate) const FLOOR: usize = 4 << 10;
/// The descriptor that follows such a frame's header in the ring: the
/// bytes' address in the sender, the ticket, and where they lie in the
/// sender's pool file when they do ([`mapped`](super::mapped)): its
/// descriptor number (`NO_FILE` when not), the mode (0: handed over by the
/// claim word; 1: placed, see `lane`), its inode, the offset.
pub const DESC_BYTES: usize = 40;
const NO_FILE: u32 = u32::MAX;

pub(crate) const OPEN: u64 = 0;
pub(crate) const READING: u64 = 1;
pub(crate) const WITHDRAWN: u64 = 2;
pub(crate) const REFUSED: u64 = 3;

/// Claimed messages at least this long are copied by both sides (see
/// above): the receiver's part is a system call either way.
pub(crate) const HELP_MIN: usize = 64 << 10;
/// Placed messages at least this long are: below it the sender's system
/// call costs more than the receiver's `memcpy` of the half out of its
/// mapping (build VM, zero-copy streams: 64 KiB 23.5 → 15.3 GB/s, 256 KiB
/// 32.5 → 30.2, 1 MiB 18.5 → 37.7; BENCHMARKS.md).
pub(crate) const HELP_PLACED_MIN: usize = 1 << 20;

/// An offer of a message at least this long wakes a sender asleep on its
/// doorbell (one that spins sees it anyway): the sender's wake-up, tens of
/// microseconds, is then shorter than the copy of the half it would take.
/// A shorter one's half is copied before a sleeper could come; the ring
/// would only cost the receiver a system call.
pub(crate) const HELP_RING_MIN: usize = 1 << 20;

/// A placed message's ticket in the help word (placed and claimed
/// messages count their tickets apart; the help word is one for both).
pub const PLACED_TICKET: u64 = 1 << 60;

/// How long a receiver waits for a tail the sender took: its write of at
/// most half a message takes milliseconds; past this the lane ends.
pub(crate) const HELP_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// The help word's states (see above): no offer open.
pub const IDLE: u64 = 0;
/// The receiver offers the tail.
pub const OFFERED: u64 = 1;
/// The sender writes it.
pub const TAKEN: u64 = 2;
/// The sender wrote it.
pub const DONE: u64 = 3;

/// Where a claimed (or `placed`) message of `len` bytes splits between the
/// receiver's head and the sender's tail: half, on a page boundary
/// (`None`: too short to split).
pub const fn help_split(len: usize, placed: bool) -> Option<usize> {
    if len < if placed { HELP_PLACED_MIN } else { HELP_MIN } {
        return None;
    }
    Some(len / 2 / 4096 * 4096)
}

/// The claim (or help) word's value for `ticket` in `state`.
pub const fn word(ticket: u64, state: u64) -> u64 {
    ticket << 2 | state
}

/// The ticket a claim word names.
pub const fn ticket_of(word: u64) -> u64 {
    word >> 2
}

/// The state a claim word is in.
pub const fn state_of(word: u64) -> u64 {
    word & 3
}

/// A single-copy message's descriptor, as sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    /// The bytes' address in the sender.
    pub addr: u64,
    /// Its ticket (claimed and placed messages count apart).
    pub ticket: u64,
    /// Where they lie in the sender's pool file, if they do.
    pub place: Option<SharedPlace>,
    /// Placed: no claim; the sender keeps the bytes until the receiver's
    /// `placed_done` passes the ticket.
    pub placed: bool,
}

impl Desc {
    /// The descriptor of its bytes from `at` on.
    pub fn skip(&self, at: usize) -> Desc {
        Desc {
            addr: self.addr.wrapping_add(at as u64),
            place: self.place.map(|p| SharedPlace {
                offset: p.offset.wrapping_add(at as u64),
                ..p
            }),
            ..*self
        }
    }

    /// Its bytes in the ring.
    pub fn encode(&self) -> [u8; DESC_BYTES] {
        let mut d = [0u8; DESC_BYTES];
        d[..8].copy_from_slice(&self.addr.to_le_bytes());
        d[8..16].copy_from_slice(&self.ticket.to_le_bytes());
        let p = self.place.unwrap_or(SharedPlace {
            fd: NO_FILE,
            ino: 0,
            offset: 0,
        });
        d[16..20].copy_from_slice(&p.fd.to_le_bytes());
        d[20..24].copy_from_slice(&u32::from(self.placed).to_le_bytes());
        d[24..32].copy_from_slice(&p.ino.to_le_bytes());
        d[32..].copy_from_slice(&p.offset.to_le_bytes());
        d
    }

    /// The descriptor in `d`, or `None` where it cannot be one: a mode
    /// other than 0 and 1, or a placed one that names no file.
    pub fn parse(d: &[u8; DESC_BYTES]) -> Option<Desc> {
        let w = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&d[i..i + 8]);
            u64::from_le_bytes(b)
        };
        let fd = u32::from_le_bytes([d[16], d[17], d[18], d[19]]);
        let placed = match u32::from_le_bytes([d[20], d[21], d[22], d[23]]) {
            0 => false,
            1 if fd != NO_FILE => true,
            _ => return None,
        };
        Some(Desc {
            addr: w(0),
            ticket: w(8),
            place: (fd != NO_FILE).then(|| SharedPlace {
                fd,
                ino: w(24),
                offset: w(32),
            }),
            placed,
        })
    }
}

/// Copies `dst.len()` bytes at `addr` in process `pid` into `dst`.
/// Whether all of them came (the kernel checks the range and the right to
/// read it: a bad address is a short or failed read, never a fault here).
pub(crate) fn read(pid: i32, addr: u64, dst: &mut [u8]) -> bool {
    let mut done = 0;
    while done < dst.len() {
        let local = libc::iovec {
            iov_base: dst[done..].as_mut_ptr().cast::<c_void>(),
            iov_len: dst.len() - done,
        };
        let remote = libc::iovec {
            iov_base: addr.wrapping_add(done as u64) as usize as *mut c_void,
            iov_len: dst.len() - done,
        };
        // SAFETY: `local` is this process's own writable buffer of the
        // length given; `remote` names memory in another process, which the
        // kernel alone touches and checks (EFAULT, EPERM, ESRCH).
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
        match usize::try_from(n) {
            Ok(0) | Err(_) => return false,
            Ok(n) => done += n,
        }
    }
    true
}

/// Copies the `len` bytes at `src` in this process to `addr` in process
/// `pid`. Whether all of them went (the kernel checks the remote range and
/// the right to write it).
///
/// # Safety
/// `src..src + len` is readable memory of this process that nothing
/// writes until this returns.
pub(crate) unsafe fn write(pid: i32, addr: u64, src: *const u8, len: usize) -> bool {
    let mut done = 0;
    while done < len {
        let local = libc::iovec {
            iov_base: src.wrapping_add(done) as *mut c_void,
            iov_len: len - done,
        };
        let remote = libc::iovec {
            iov_base: addr.wrapping_add(done as u64) as usize as *mut c_void,
            iov_len: len - done,
        };
        // SAFETY: `local` is this process's memory, readable and unchanged
        // for the call (the caller's promise); `remote` names memory in
        // another process, which the kernel alone touches and checks.
        let n = unsafe { libc::process_vm_writev(pid, &local, 1, &remote, 1, 0) };
        match usize::try_from(n) {
            Ok(0) | Err(_) => return false,
            Ok(n) => done += n,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_of_this_process_sees_its_bytes_and_a_bad_address_is_a_failed_read() {
        let src: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        let mut dst = vec![0u8; src.len()];
        assert!(read(
            std::process::id() as i32,
            src.as_ptr() as u64,
            &mut dst
        ));
        assert_eq!(dst, src);
        assert!(
            !read(std::process::id() as i32, 8, &mut dst[..16]),
            "address 8 is mapped nowhere"
        );
        let file = SharedPlace {
            fd: 7,
            ino: 0x1234_5678_9ABC,
            offset: 1 << 40,
        };
        for (place, placed) in [(None, false), (Some(file), false), (Some(file), true)] {
            let d = Desc {
                addr: 0xDEAD_BEEF,
                ticket: 42,
                place,
                placed,
            };
            assert_eq!(Desc::parse(&d.encode()), Some(d));
        }
        let claimed = Desc {
            addr: 1,
            ticket: 1,
            place: None,
            placed: false,
        }
        .encode();
        let mut bad = claimed;
        bad[22] = 1;
        assert_eq!(Desc::parse(&bad), None, "a mode past 1");
        let mut bad = claimed;
        bad[20] = 1;
        assert_eq!(Desc::parse(&bad), None, "placed, and no file named");
        assert_eq!(ticket_of(word(5, READING)), 5);
        assert_eq!(state_of(word(5, REFUSED)), REFUSED);
    }
}
