//! A loopback pair of fixed byte rings carrying whole frames.

use core::sync::atomic::{AtomicBool, Ordering};

use zerohop_core::wire::HEADER_LEN;
use zerohop_core::Error;

/// A frame carrier (the mock's "phy"). Fault injectors wrap it.
pub trait Link {
    /// The longest payload a frame queued now could carry (`None`: not even a header fits).
    fn room(&self) -> Option<usize>;
    /// Queues one frame (`header` then `payload`); `WouldBlock` when there is no room.
    fn transmit(&mut self, header: &[u8; HEADER_LEN], payload: &[u8]) -> Result<(), Error>;
    /// The next frame's header and payload length, if one is queued.
    fn peek(&mut self) -> Option<([u8; HEADER_LEN], usize)>;
    /// Copies the next frame's payload into `out` (which holds at least the
    /// length `peek` gave) and removes the frame.
    fn take(&mut self, out: &mut [u8]);
    /// Removes the next frame unread.
    fn discard(&mut self);
    /// Whether the other end is gone (dropped without a word): what a
    /// reset connection is on a real wire. Default: never.
    fn peer_gone(&self) -> bool {
        false
    }
}

/// A ring of length-prefixed frames in `CAP` bytes.
#[derive(Debug)]
struct Ring<const CAP: usize> {
    buf: [u8; CAP],
    head: usize,
    used: usize,
}

impl<const CAP: usize> Ring<CAP> {
    const fn new() -> Self {
        Ring {
            buf: [0; CAP],
            head: 0,
            used: 0,
        }
    }

    fn write_at(&mut self, at: usize, bytes: &[u8]) {
        let at = at % CAP;
        let first = bytes.len().min(CAP - at);
        self.buf[at..at + first].copy_from_slice(&bytes[..first]);
        self.buf[..bytes.len() - first].copy_from_slice(&bytes[first..]);
    }

    fn read_at(&self, at: usize, out: &mut [u8]) {
        let at = at % CAP;
        let first = out.len().min(CAP - at);
        out[..first].copy_from_slice(&self.buf[at..at + first]);
        let rest = out.len() - first;
        out[first..].copy_from_slice(&self.buf[..rest]);
    }

    fn room(&self) -> Option<usize> {
        (CAP - self.used).checked_sub(4 + HEADER_LEN)
    }

    fn push(&mut self, header: &[u8; HEADER_LEN], payload: &[u8]) -> Result<(), Error> {
        let need = 4 + HEADER_LEN + payload.len();
        if need > CAP - self.used {
            return Err(Error::WouldBlock);
        }
        let tail = self.head + self.used;
        self.write_at(tail, &(payload.len() as u32).to_le_bytes());
        self.write_at(tail + 4, header);
        self.write_at(tail + 4 + HEADER_LEN, payload);
        self.used += need;
        Ok(())
    }

    fn peek(&self) -> Option<([u8; HEADER_LEN], usize)> {
        if self.used == 0 {
            return None;
        }
        let mut len = [0u8; 4];
        self.read_at(self.head, &mut len);
        let mut header = [0u8; HEADER_LEN];
        self.read_at(self.head + 4, &mut header);
        Some((header, u32::from_le_bytes(len) as usize))
    }

    fn pop(&mut self, out: Option<&mut [u8]>) {
        let Some((_, len)) = self.peek() else { return };
        if let Some(out) = out {
            self.read_at(self.head + 4 + HEADER_LEN, &mut out[..len]);
        }
        let total = 4 + HEADER_LEN + len;
        self.head = (self.head + total) % CAP;
        self.used -= total;
    }
}

/// Two rings, one per direction, and whether each end is still there.
/// `const`, so a link can live in a `static`.
#[derive(Debug)]
pub struct MockLink<const CAP: usize> {
    a_to_b: spin::Mutex<Ring<CAP>>,
    b_to_a: spin::Mutex<Ring<CAP>>,
    a_gone: AtomicBool,
    b_gone: AtomicBool,
}

impl<const CAP: usize> Default for MockLink<CAP> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const CAP: usize> MockLink<CAP> {
    /// An empty link; each direction holds `CAP` bytes of frames.
    pub const fn new() -> Self {
        MockLink {
            a_to_b: spin::Mutex::new(Ring::new()),
            b_to_a: spin::Mutex::new(Ring::new()),
            a_gone: AtomicBool::new(false),
            b_gone: AtomicBool::new(false),
        }
    }

    /// The two ends: what `a` transmits, `b` receives, and back. Dropping
    /// an end hangs up: the other sees [`Link::peer_gone`].
    pub fn ends(&self) -> (LinkEnd<'_, CAP>, LinkEnd<'_, CAP>) {
        // Relaxed: the flags order nothing else; a fresh pair of ends
        // starts with both there (a static link may be handed out again).
        self.a_gone.store(false, Ordering::Relaxed);
        self.b_gone.store(false, Ordering::Relaxed);
        (
            LinkEnd {
                tx: &self.a_to_b,
                rx: &self.b_to_a,
                me_gone: &self.a_gone,
                peer_gone: &self.b_gone,
            },
            LinkEnd {
                tx: &self.b_to_a,
                rx: &self.a_to_b,
                me_gone: &self.b_gone,
                peer_gone: &self.a_gone,
            },
        )
    }

    /// The largest payload one frame can carry.
    pub const fn max_payload() -> usize {
        CAP - 4 - HEADER_LEN
    }
}

/// One end of a [`MockLink`].
#[derive(Debug)]
pub struct LinkEnd<'a, const CAP: usize> {
    tx: &'a spin::Mutex<Ring<CAP>>,
    rx: &'a spin::Mutex<Ring<CAP>>,
    me_gone: &'a AtomicBool,
    peer_gone: &'a AtomicBool,
}

impl<const CAP: usize> Drop for LinkEnd<'_, CAP> {
    fn drop(&mut self) {
        // Release: the frames this end queued before hanging up are seen by
        // a peer that sees the flag (its Acquire load).
        self.me_gone.store(true, Ordering::Release);
    }
}

impl<const CAP: usize> Link for LinkEnd<'_, CAP> {
    fn room(&self) -> Option<usize> {
        self.tx.lock().room()
    }

    fn transmit(&mut self, header: &[u8; HEADER_LEN], payload: &[u8]) -> Result<(), Error> {
        self.tx.lock().push(header, payload)
    }

    fn peek(&mut self) -> Option<([u8; HEADER_LEN], usize)> {
        self.rx.lock().peek()
    }

    fn take(&mut self, out: &mut [u8]) {
        self.rx.lock().pop(Some(out));
    }

    fn discard(&mut self) {
        self.rx.lock().pop(None);
    }

    fn peer_gone(&self) -> bool {
        // Acquire: pairs with the Release store when the other end drops.
        self.peer_gone.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_wrap_around_the_ring_intact() {
        let link = MockLink::<100>::new();
        let (mut a, mut b) = link.ends();
        for round in 0u8..50 {
            let payload = [round; 23];
            a.transmit(&[round; HEADER_LEN], &payload).unwrap();
            let (h, len) = b.peek().unwrap();
            assert_eq!((h[0], len), (round, 23));
            let mut out = [0u8; 23];
            b.take(&mut out);
            assert_eq!(out, payload);
        }
        assert!(b.peek().is_none());
    }

    #[test]
    fn a_full_ring_says_would_block() {
        let link = MockLink::<80>::new();
        let (mut a, _b) = link.ends();
        assert_eq!(a.room(), Some(80 - 4 - HEADER_LEN));
        a.transmit(&[0; HEADER_LEN], &[1; 40]).unwrap();
        assert_eq!(a.room(), None);
        assert_eq!(
            a.transmit(&[0; HEADER_LEN], &[1; 1]),
            Err(Error::WouldBlock)
        );
    }
}
