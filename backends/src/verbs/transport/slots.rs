//! The send side of a queue pair: its ring of send slots, which of them ask
//! for a completion, and what each holds until the NIC is done with it. No
//! verbs here, so its rules are tested without a device.
//!
//! A signaled send's slot is free at its completion. An unsignaled one
//! (inline: the NIC copied the bytes when it was posted) raises none; it is
//! free once a send posted after it completes, since an RC queue completes
//! in order. Inline sends ask for a completion one in [`SIGNAL_EVERY`] (as
//! perftest's latency test does), and so does the one that takes the last
//! free slot, so slots come back on a ring shallower than that too.

use std::collections::VecDeque;

/// Inline sends ask for a completion one in this many.
pub(super) const SIGNAL_EVERY: usize = 16;

/// A queue pair's send slots; `H` is what a send's slot keeps alive until
/// its completion (its payload buffer).
pub(super) struct SendSlots<H> {
    /// Signaled sends in flight, each with what it holds (none, inline).
    held: Vec<Option<Option<H>>>,
    /// Slots posted without a completion, oldest first.
    unsignaled: VecDeque<u32>,
    /// When each slot was last posted (a count of posts).
    posted_at: Vec<u64>,
    posts: u64,
    free: Vec<u32>,
}

/// A slot taken for one send: [`SendSlots::posted`] or
/// [`SendSlots::not_posted`] gives it back.
#[must_use]
pub(super) struct Taken {
    pub(super) slot: usize,
    /// Whether the send must ask for a completion.
    pub(super) signaled: bool,
    inline: bool,
}

impl<H> SendSlots<H> {
    pub(super) fn new(depth: usize) -> Self {
        SendSlots {
            held: (0..depth).map(|_| None).collect(),
            unsignaled: VecDeque::new(),
            posted_at: vec![0; depth],
            posts: 0,
            free: (0..depth as u32).rev().collect(),
        }
    }

    /// How many slots the ring has.
    pub(super) fn depth(&self) -> usize {
        self.held.len()
    }

    pub(super) fn has_free(&self) -> bool {
        !self.free.is_empty()
    }

    /// A free slot for a send (`inline`: its bytes go in the work request),
    /// and whether it must ask for a completion; `None` when all are out.
    pub(super) fn take(&mut self, inline: bool) -> Option<Taken> {
        let slot = self.free.pop()? as usize;
        let signaled = !inline || self.unsignaled.len() + 1 >= SIGNAL_EVERY || self.free.is_empty();
        Some(Taken {
            slot,
            signaled,
            inline,
        })
    }

    /// The send in `t` was posted: `hold` lives until its completion (an
    /// inline send's goes at once: the NIC has copied it).
    pub(super) fn posted(&mut self, t: Taken, hold: Option<H>) {
        self.posts += 1;
        self.posted_at[t.slot] = self.posts;
        match (t.signaled, t.inline) {
            (true, true) => self.held[t.slot] = Some(None),
            (true, false) => self.held[t.slot] = Some(hold),
            (false, _) => self.unsignaled.push_back(t.slot as u32),
        }
    }

    /// The send in `t` could not be posted: its slot is free again.
    pub(super) fn not_posted(&mut self, t: Taken) {
        self.free.push(t.slot as u32);
    }

    /// A signaled send completed: its slot is free, what it held goes, and
    /// so are the slots of the unsignaled sends posted before it.
    pub(super) fn completed(&mut self, slot: usize) {
        // Not a slot of ours, or not one with a signaled send out (a second
        // completion for it): freeing it again would hand one slot to two
        // sends, and drop a buffer the NIC may still be reading.
        if self.held.get_mut(slot).and_then(Option::take).is_none() {
            return;
        }
        self.free.push(slot as u32);
        let upto = self.posted_at[slot];
        while let Some(&u) = self.unsignaled.front() {
            if self.posted_at[u as usize] > upto {
                break;
            }
            self.unsignaled.pop_front();
            self.free.push(u);
        }
    }

    /// Signaled sends not yet completed (an unsignaled one counts as sent
    /// once posted: the NIC holds a copy, and a failure still surfaces as
    /// an error completion of a later send).
    pub(super) fn in_flight(&self) -> usize {
        self.held.iter().filter(|h| h.is_some()).count()
    }
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    use super::*;

    fn post<H>(s: &mut SendSlots<H>, inline: bool, hold: Option<H>) -> (usize, bool) {
        let t = s.take(inline).expect("a free slot");
        let got = (t.slot, t.signaled);
        s.posted(t, hold);
        got
    }

    #[test]
    fn inline_sends_ask_for_a_completion_one_in_sixteen_and_others_always() {
        let mut s = SendSlots::<()>::new(64);
        for round in 0..3 {
            let sig: Vec<(usize, bool)> = (0..SIGNAL_EVERY)
                .map(|_| post(&mut s, true, None))
                .collect();
            let at: Vec<usize> = (0..SIGNAL_EVERY).filter(|&i| sig[i].1).collect();
            assert_eq!(at, [SIGNAL_EVERY - 1], "round {round}: the 16th only");
            s.completed(sig[SIGNAL_EVERY - 1].0);
            assert_eq!(s.free.len(), 64, "round {round}: the rest with it");
        }
        assert!(post(&mut s, false, None).1, "not inline: always");
    }

    #[test]
    fn a_completion_frees_the_unsignaled_sends_posted_before_it_and_no_later_ones() {
        let mut s = SendSlots::<()>::new(8);
        let first: Vec<_> = (0..3).map(|_| post(&mut s, true, None)).collect();
        assert!(first.iter().all(|&(_, sig)| !sig));
        let (signaled, _) = post(&mut s, false, None);
        let later = post(&mut s, true, None);
        assert!(!later.1);
        assert_eq!(s.free.len(), 3);
        s.completed(signaled);
        assert_eq!(
            s.free.len(),
            7,
            "itself and the three before it, not the one after"
        );
        assert_eq!(s.unsignaled, [later.0 as u32]);
        assert_eq!(s.in_flight(), 0);
    }

    #[test]
    fn the_last_free_slot_asks_for_a_completion_so_a_shallow_ring_comes_back() {
        let mut s = SendSlots::<()>::new(4);
        let sig: Vec<(usize, bool)> = (0..4).map(|_| post(&mut s, true, None)).collect();
        let flags: Vec<bool> = sig.iter().map(|p| p.1).collect();
        assert_eq!(flags, [false, false, false, true]);
        assert!(s.take(true).is_none(), "all out");
        s.completed(sig[3].0);
        assert_eq!(s.free.len(), 4, "every slot back from one completion");
    }

    #[test]
    fn a_send_holds_its_buffer_until_its_completion_and_an_inline_one_not_at_all() {
        let mut s = SendSlots::<Rc<()>>::new(4);
        let buf = Rc::new(());
        let (slot, signaled) = post(&mut s, false, Some(Rc::clone(&buf)));
        assert!(signaled);
        assert_eq!(Rc::strong_count(&buf), 2, "held while the NIC reads it");
        assert_eq!(s.in_flight(), 1);
        s.completed(slot);
        assert_eq!(Rc::strong_count(&buf), 1, "back at the completion");
        post(&mut s, true, Some(Rc::clone(&buf)));
        assert_eq!(Rc::strong_count(&buf), 1, "inline: copied, back at once");
    }

    #[test]
    fn a_send_not_posted_gives_its_slot_back_and_a_stray_completion_is_ignored() {
        let mut s = SendSlots::<()>::new(2);
        let t = s.take(false).unwrap();
        s.not_posted(t);
        assert_eq!(s.free.len(), 2);
        s.completed(99);
        assert_eq!(s.free.len(), 2);
        assert_eq!(s.depth(), 2);
    }

    #[test]
    fn a_second_completion_for_a_slot_frees_nothing_twice() {
        let mut s = SendSlots::<Rc<()>>::new(4);
        let buf = Rc::new(());
        let (slot, _) = post(&mut s, false, Some(Rc::clone(&buf)));
        s.completed(slot);
        s.completed(slot);
        assert_eq!(s.free.len(), 4, "the slot once in the free list");
        // A slot posted again must keep its buffer through a stale completion.
        let (again, _) = post(&mut s, true, None);
        let (other, _) = post(&mut s, false, Some(Rc::clone(&buf)));
        s.completed(again); // unsignaled: no completion of its own
        assert_eq!(
            Rc::strong_count(&buf),
            2,
            "the signaled send keeps its buffer"
        );
        assert_eq!(s.free.len(), 2, "the two out stay out");
        let taken = [s.take(false).unwrap().slot, s.take(false).unwrap().slot];
        assert!(taken[0] != taken[1] && !taken.contains(&again) && !taken.contains(&other));
    }
}
