//! GPU payloads between same-host peers, by CUDA IPC: a message in the
//! sender's device memory lands in the receiver's device memory without
//! touching host memory.
//!
//! The sender's frame is a data frame flagged [`DataFlags::DEVICE`]
//! (its `len` is the message's) followed in the ring by a descriptor: the
//! CUDA IPC handle of the pool allocation the message lies in (each
//! exported once), the offset and length in it, and a ticket. The receiver
//! maps each peer allocation once ([`IpcCache`], bounded, all of a peer's
//! closed with its lane), leases a buffer of its own device pool, and
//! queues a device-to-device copy on the lane's stream ([`CopyQueue`]). The
//! message is delivered when its copy completes, in order with everything
//! else the peer sent; the receiver then stores the ticket in the ring's
//! `device_done` word, and the sender's buffer goes back to its pool.
//! Copies of one peer run behind each other while the host goes on
//! reading: messages are pipelined, at most [`MAX_IN_FLIGHT`] per direction.
//!
//! The peer is untrusted: a handle the driver refuses, a range outside the
//! allocation the driver reports, a ticket out of turn, a length that is
//! not the header's, or a `device_done` past what was sent, is a typed
//! error that ends this lane only.
//!
//! [`DataFlags::DEVICE`]: zerohop_core::wire::DataFlags::DEVICE

use std::collections::VecDeque;
use std::sync::Arc;

use zerohop_backends::cuda::{
    lease_memory, lease_region, CopyQueue, DeviceLease, DevicePool, IpcCache, IpcError, IpcHandle,
    IpcRegion,
};
use zerohop_core::{Error, Lease, PeerId, Received};

use super::ShmLease;

/// The descriptor after a device frame's header: handle, offset, length, ticket.
pub(crate) const DESC_BYTES: usize = 64 + 8 + 8 + 8;
/// Device messages a sender has in flight (sent, not yet copied), at most.
pub(crate) const MAX_IN_FLIGHT: usize = 64;
/// Their bytes, at most (one message alone may be longer): what a sender
/// holds of its pool, and a receiver's copies queue, for one peer.
pub(crate) const MAX_IN_FLIGHT_BYTES: usize = 512 << 20;
/// A sender whose device messages wait for the peer's copies looks again
/// (spins) rather than sleeping while the oldest was sent this recently: a
/// copy takes microseconds to a few hundred (256 MiB), a doorbell's
/// wake-up tens. A receiver that takes longer lets the sender sleep.
const DONE_SPIN: std::time::Duration = std::time::Duration::from_millis(1);
/// Peer allocations a lane keeps mapped, at most.
const MAPPINGS_PER_PEER: usize = 64;

pub(crate) fn desc(region: &IpcRegion, ticket: u64) -> [u8; DESC_BYTES] {
    let mut d = [0u8; DESC_BYTES];
    d[..64].copy_from_slice(&region.handle.0);
    d[64..72].copy_from_slice(&region.offset.to_le_bytes());
    d[72..80].copy_from_slice(&(region.len as u64).to_le_bytes());
    d[80..].copy_from_slice(&ticket.to_le_bytes());
    d
}

/// A descriptor's region (its length as the peer wrote it) and ticket.
pub(crate) fn parse(d: &[u8; DESC_BYTES]) -> (IpcRegion, u64, u64) {
    let w = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&d[i..i + 8]);
        u64::from_le_bytes(b)
    };
    let mut handle = [0u8; 64];
    handle.copy_from_slice(&d[..64]);
    let len = w(72);
    let region = IpcRegion {
        handle: IpcHandle(handle),
        offset: w(64),
        len: usize::try_from(len).unwrap_or(usize::MAX),
    };
    (region, len, w(80))
}

/// What waits for a copy to complete before it may be delivered.
enum Waiting {
    /// A device message: its copy's ticket, the peer's ticket, the buffer.
    Copy {
        copy: u64,
        ticket: u64,
        lease: DeviceLease,
    },
    /// What came after one (a host message, the peer's Close).
    Ready(Result<Received<ShmLease>, Error>),
}

/// A lane's GPU side: its device pool, the peer's mappings, its copy
/// stream, and the device messages in flight each way.
pub(crate) struct LaneGpu {
    pool: Arc<DevicePool>,
    // Declared before the cache: dropped first, it waits for its copies
    // before the mappings they read close (even when `finish` failed).
    copies: CopyQueue,
    cache: IpcCache,
    /// Sent, not yet copied by the peer: (ticket, buffer).
    sent: VecDeque<(u64, DeviceLease)>,
    /// When the oldest of them went.
    oldest_sent: Option<std::time::Instant>,
    sent_bytes: usize,
    sent_ticket: u64,
    /// Received, in order: copies under way and what came after them.
    waiting: VecDeque<Waiting>,
    rx_ticket: u64,
    /// The last of `copies`' tickets that completed (`u64::MAX`: none yet).
    copied: u64,
}

fn ipc_error(peer: PeerId, e: IpcError) -> Error {
    log::warn!("shm: a device message from {peer} cannot be read: {e}");
    match e {
        IpcError::Cuda(c) => c.into(),
        IpcError::OutOfRange { .. } => Error::WireRule {
            peer,
            rule: "a device message outside the allocation it names",
        },
    }
}

impl LaneGpu {
    /// A GPU side receiving into `pool` (its GPU's copies and mappings).
    pub(crate) fn new(pool: Arc<DevicePool>) -> Result<LaneGpu, Error> {
        let gpu = pool.source().memory.gpu().clone();
        Ok(LaneGpu {
            cache: IpcCache::new(&gpu, MAPPINGS_PER_PEER),
            copies: CopyQueue::new(&gpu)?,
            pool,
            sent: VecDeque::new(),
            oldest_sent: None,
            sent_bytes: 0,
            sent_ticket: 0,
            waiting: VecDeque::new(),
            rx_ticket: 0,
            copied: u64::MAX,
        })
    }

    /// Whether a device message of `len` bytes may go now.
    pub(crate) fn has_room(&self, len: usize) -> bool {
        self.sent.is_empty()
            || (self.sent.len() < MAX_IN_FLIGHT && self.sent_bytes + len <= MAX_IN_FLIGHT_BYTES)
    }

    /// The descriptor of `lease` (exported on its allocation's first use)
    /// under the next ticket.
    pub(crate) fn describe(&self, lease: &DeviceLease) -> Result<([u8; DESC_BYTES], u64), Error> {
        let region = lease_memory(lease).export(lease_region(lease))?;
        let ticket = self.sent_ticket + 1;
        Ok((desc(&region, ticket), ticket))
    }

    /// `lease` went under `ticket` (from [`describe`](Self::describe)).
    pub(crate) fn sent(&mut self, ticket: u64, lease: DeviceLease) {
        self.sent_ticket = ticket;
        self.sent_bytes += lease.len();
        if self.sent.is_empty() {
            self.oldest_sent = Some(std::time::Instant::now());
        }
        self.sent.push_back((ticket, lease));
    }

    /// The peer says it copied every device message up to `done`: their
    /// buffers go back. `Err`: a ticket never sent.
    pub(crate) fn release(&mut self, done: u64) -> Result<(), ()> {
        if done > self.sent_ticket {
            return Err(());
        }
        let before = self.sent.len();
        while self.sent.front().is_some_and(|(t, _)| *t <= done) {
            if let Some((_, l)) = self.sent.pop_front() {
                self.sent_bytes -= l.len();
            }
        }
        if self.sent.len() != before {
            // The next one's clock starts now (its send time is not kept).
            self.oldest_sent = (!self.sent.is_empty()).then(std::time::Instant::now);
        }
        Ok(())
    }

    /// Device messages sent and not yet copied.
    pub(crate) fn in_flight(&self) -> usize {
        self.sent.len()
    }

    /// Whether the peer's `done` would give back a buffer this side holds.
    pub(crate) fn would_release(&self, done: u64) -> bool {
        self.sent.front().is_some_and(|(t, _)| *t <= done)
    }

    /// Whether a copy is due soon enough to look again rather than sleep.
    pub(crate) fn done_due(&self) -> bool {
        self.oldest_sent.is_some_and(|t| t.elapsed() < DONE_SPIN)
    }

    /// Whether received messages wait for their copies (what comes from the
    /// peer meanwhile must wait behind them).
    pub(crate) fn holds(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// Something of the peer's that must wait behind a copy under way.
    pub(crate) fn hold(&mut self, r: Result<Received<ShmLease>, Error>) {
        self.waiting.push_back(Waiting::Ready(r));
    }

    /// Starts the copy of the device message `d` describes (`msg_len`
    /// bytes, by the header). `Ok(false)`: the device pool is dry, try
    /// again later with the same descriptor.
    pub(crate) fn start(
        &mut self,
        peer: PeerId,
        d: &[u8; DESC_BYTES],
        msg_len: usize,
    ) -> Result<bool, Error> {
        let (region, len, ticket) = parse(d);
        if ticket != self.rx_ticket.wrapping_add(1) || len != msg_len as u64 {
            return Err(Error::WireRule {
                peer,
                rule: "a device message descriptor out of turn or of another length",
            });
        }
        // The sender's own limits, held to: a peer cannot make this side
        // queue more of its copies (and hold more of the shared pool).
        let (copying, bytes) = self.copying();
        if copying > 0 && (copying >= MAX_IN_FLIGHT || bytes + msg_len > MAX_IN_FLIGHT_BYTES) {
            return Err(Error::WireRule {
                peer,
                rule: "more device messages in flight than a sender may have",
            });
        }
        let Ok(mut lease) = Lease::take(Arc::clone(&self.pool), msg_len.max(1)) else {
            return Ok(false);
        };
        let _ = lease.set_len(msg_len);
        if self.cache.open_count() >= MAPPINGS_PER_PEER && self.copies.pending() > 0 {
            // A mapping may close to make room: no copy may still read it.
            self.finish()?;
        }
        let src = self
            .cache
            .resolve(u64::from(peer.0), &region)
            .map_err(|e| ipc_error(peer, e))?;
        let dst = lease_region(&lease);
        // SAFETY: `src` is mapped by this lane's cache, which closes a
        // mapping only once no copy is pending (above, and in `Drop`, which
        // waits for every copy before the cache goes); `lease` stays in
        // `waiting` until its copy completes.
        let copy = unsafe { self.copies.copy(lease_memory(&lease), dst, src, msg_len) }?;
        self.rx_ticket = ticket;
        self.waiting.push_back(Waiting::Copy {
            copy,
            ticket,
            lease,
        });
        Ok(true)
    }

    /// Copies under way, and their bytes.
    fn copying(&self) -> (usize, usize) {
        self.waiting
            .iter()
            .filter_map(|w| match w {
                Waiting::Copy { lease, .. } => Some(lease.len()),
                Waiting::Ready(_) => None,
            })
            .fold((0, 0), |(n, b), len| (n + 1, b + len))
    }

    /// Waits for every copy under way (before the mappings they read may
    /// close, or the peer is gone).
    pub(crate) fn finish(&mut self) -> Result<(), Error> {
        let copied = &mut self.copied;
        self.copies.finish(|t| *copied = t)?;
        Ok(())
    }

    /// Moves what no copy holds back any more into `arrivals`, in order;
    /// the last device ticket delivered, if any.
    pub(crate) fn deliver(
        &mut self,
        peer: PeerId,
        arrivals: &mut VecDeque<Result<Received<ShmLease>, Error>>,
    ) -> Result<Option<u64>, Error> {
        if self.waiting.is_empty() {
            return Ok(None);
        }
        let copied = &mut self.copied;
        self.copies.completed(|t| *copied = t)?;
        let mut done = None;
        loop {
            match self.waiting.front() {
                Some(Waiting::Copy { copy, .. })
                    if self.copied != u64::MAX && *copy <= self.copied => {}
                Some(Waiting::Ready(_)) => {}
                _ => break,
            }
            match self.waiting.pop_front() {
                Some(Waiting::Copy { ticket, lease, .. }) => {
                    done = Some(ticket);
                    arrivals.push_back(Ok(Received {
                        peer,
                        lease: ShmLease::Device(lease),
                    }));
                }
                Some(Waiting::Ready(r)) => arrivals.push_back(r),
                None => break,
            }
        }
        Ok(done)
    }
}

impl Drop for LaneGpu {
    fn drop(&mut self) {
        // The peer's mappings close with the cache: no copy may still read them.
        if self.copies.pending() > 0 && self.finish().is_err() {
            log::warn!("shm: waiting for a lane's device copies failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_descriptor_round_trips() {
        let region = IpcRegion {
            handle: IpcHandle([7; 64]),
            offset: 4096,
            len: 1 << 20,
        };
        let (r, len, t) = parse(&desc(&region, 9));
        assert_eq!((r, len, t), (region, 1 << 20, 9));
    }
}
