//! A fault-injecting [`Link`] decorator: drop, corrupt, duplicate, reorder.

use zerohop_core::wire::HEADER_LEN;
use zerohop_core::Error;

use super::link::Link;

/// Which received frames to hit: every n-th frame (counting from 1) for each
/// fault; 0 disables it. Deterministic, so a failing test replays exactly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct FaultPlan {
    /// Lose the frame.
    pub drop_every: u32,
    /// Flip a payload bit after it is received.
    pub corrupt_every: u32,
    /// Deliver the frame twice.
    pub duplicate_every: u32,
    /// Hold the frame back behind the next one.
    pub reorder_every: u32,
}

/// How many faults were injected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct FaultCounts {
    /// Frames lost.
    pub dropped: u32,
    /// Frames corrupted.
    pub corrupted: u32,
    /// Frames delivered twice.
    pub duplicated: u32,
    /// Frames swapped with their successor.
    pub reordered: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Pass,
    Corrupt,
    Duplicate,
}

/// Wraps a [`Link`] and injects faults into what it receives. `STASH` bytes
/// hold the one frame being duplicated or reordered; bigger frames pass untouched.
#[derive(Debug)]
pub struct Faulty<L, const STASH: usize> {
    inner: L,
    plan: FaultPlan,
    counts: FaultCounts,
    seen: u32,
    head: Option<Verdict>,
    stash: [u8; STASH],
    stashed: Option<([u8; HEADER_LEN], usize)>,
    stash_is_next: bool,
}

impl<L: Link, const STASH: usize> Faulty<L, STASH> {
    /// Wraps `inner` with `plan`.
    pub const fn new(inner: L, plan: FaultPlan) -> Self {
        Faulty {
            inner,
            plan,
            counts: FaultCounts {
                dropped: 0,
                corrupted: 0,
                duplicated: 0,
                reordered: 0,
            },
            seen: 0,
            head: None,
            stash: [0; STASH],
            stashed: None,
            stash_is_next: false,
        }
    }

    /// What was injected so far.
    pub const fn counts(&self) -> FaultCounts {
        self.counts
    }

    /// Changes the plan (e.g. no faults for a final clean phase).
    pub fn set_plan(&mut self, plan: FaultPlan) {
        self.plan = plan;
    }

    fn hits(every: u32, n: u32) -> bool {
        every != 0 && n % every == 0
    }

    fn after_take(&mut self) {
        self.head = None;
        // A reordered frame goes out right after the one that overtook it.
        if self.stashed.is_some() {
            self.stash_is_next = true;
        }
    }
}

impl<L: Link, const STASH: usize> Link for Faulty<L, STASH> {
    fn room(&self) -> Option<usize> {
        self.inner.room()
    }

    fn peer_gone(&self) -> bool {
        self.inner.peer_gone()
    }

    fn transmit(&mut self, header: &[u8; HEADER_LEN], payload: &[u8]) -> Result<(), Error> {
        self.inner.transmit(header, payload)
    }

    fn peek(&mut self) -> Option<([u8; HEADER_LEN], usize)> {
        if self.stash_is_next {
            return self.stashed;
        }
        loop {
            let Some((h, len)) = self.inner.peek() else {
                // Nothing overtook the held frame: let it go now.
                self.stash_is_next = self.stashed.is_some();
                return self.stashed;
            };
            if self.head.is_some() {
                return Some((h, len));
            }
            self.seen = self.seen.wrapping_add(1);
            let n = self.seen;
            if Self::hits(self.plan.drop_every, n) {
                self.inner.discard();
                self.counts.dropped += 1;
                continue;
            }
            let fits = len <= STASH && self.stashed.is_none();
            if fits && Self::hits(self.plan.reorder_every, n) {
                self.inner.take(&mut self.stash[..len]);
                self.stashed = Some((h, len));
                self.stash_is_next = false;
                self.counts.reordered += 1;
                continue;
            }
            self.head = Some(if fits && Self::hits(self.plan.duplicate_every, n) {
                Verdict::Duplicate
            } else if len > 0 && Self::hits(self.plan.corrupt_every, n) {
                Verdict::Corrupt
            } else {
                Verdict::Pass
            });
            return Some((h, len));
        }
    }

    fn take(&mut self, out: &mut [u8]) {
        if self.stash_is_next {
            if let Some((_, len)) = self.stashed.take() {
                out[..len].copy_from_slice(&self.stash[..len]);
            }
            self.stash_is_next = false;
            return;
        }
        let Some((h, len)) = self.inner.peek() else {
            return;
        };
        self.inner.take(out);
        match self.head {
            Some(Verdict::Corrupt) => {
                out[len / 2] ^= 0x10;
                self.counts.corrupted += 1;
            }
            Some(Verdict::Duplicate) => {
                self.stash[..len].copy_from_slice(&out[..len]);
                self.stashed = Some((h, len));
                self.counts.duplicated += 1;
            }
            _ => {}
        }
        self.after_take();
    }

    fn discard(&mut self) {
        if self.stash_is_next {
            self.stashed = None;
            self.stash_is_next = false;
            return;
        }
        self.inner.discard();
        self.after_take();
    }
}
