//! Waiting rooms shared by strangers, where one source's flood must cost
//! that source only: the rule for a full room (TCP handshakes and
//! unclaimed second connections, the same-host lane socket's links, a TCP
//! listener's quiet peers when it keeps as many as it takes), and a queue
//! served a source at a time (TCP's grants past the window).

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// Which entry of a full waiting room (its index, its source, since when it
/// waits) makes room: the oldest of the source with the most entries.
pub(crate) fn oldest_of_most_crowded<K: Hash + Eq, T: Ord + Copy>(
    waiting: impl Iterator<Item = (usize, K, T)>,
) -> Option<usize> {
    let waiting: Vec<_> = waiting.collect();
    let mut by_source = HashMap::new();
    for (_, source, _) in &waiting {
        *by_source.entry(source).or_insert(0usize) += 1;
    }
    let most = by_source.values().copied().max()?;
    waiting
        .iter()
        .filter(|(_, source, _)| by_source.get(source) == Some(&most))
        .min_by_key(|&&(_, _, since)| since)
        .map(|&(i, _, _)| i)
}

/// Which quiet peer a full table lets go for a newcomer of group `own`
/// (its index in `quiet`, each entry its group and its rank, the least
/// going first; `places`, how many places each group holds): one of the
/// newcomer's own group if it has any, else of a group holding more places
/// than the newcomer's would, the least ranked of the group with the most
/// quiet ones. A peer alone in its group is never let go for another group's.
pub(crate) fn quiet_to_let_go<K: Hash + Eq + Copy, T: Ord + Copy>(
    quiet: &[(K, T)],
    places: impl Fn(K) -> usize,
    own: K,
) -> Option<usize> {
    let newcomers = places(own) + 1;
    let mine = quiet.iter().any(|&(g, _)| g == own);
    let eligible = quiet
        .iter()
        .enumerate()
        .filter(|&(_, &(g, _))| {
            if mine {
                g == own
            } else {
                places(g) > newcomers
            }
        })
        .map(|(i, &(g, since))| (i, g, since));
    oldest_of_most_crowded(eligible)
}

/// A queue served by turns: one item of each source with items waiting,
/// in the order the sources first waited, then round again; a source's
/// items in the order they came. Holds what is pushed until it is taken.
#[derive(Debug)]
pub(crate) struct FairQueue<K, T> {
    turns: VecDeque<K>,
    items: HashMap<K, VecDeque<T>>,
}

impl<K, T> Default for FairQueue<K, T> {
    fn default() -> Self {
        FairQueue {
            turns: VecDeque::new(),
            items: HashMap::new(),
        }
    }
}

impl<K: Hash + Eq + Copy, T: Copy> FairQueue<K, T> {
    pub(crate) fn push(&mut self, source: K, item: T) {
        let waiting = self.items.entry(source).or_default();
        if waiting.is_empty() {
            self.turns.push_back(source);
        }
        waiting.push_back(item);
    }

    /// The item whose turn it is.
    pub(crate) fn front(&self) -> Option<T> {
        self.items.get(self.turns.front()?)?.front().copied()
    }

    /// Takes the item whose turn it is; its source's next waits behind
    /// every other source's.
    pub(crate) fn pop_front(&mut self) -> Option<T> {
        let source = self.turns.pop_front()?;
        let waiting = self.items.get_mut(&source)?;
        let item = waiting.pop_front();
        if waiting.is_empty() {
            self.items.remove(&source);
        } else {
            self.turns.push_back(source);
        }
        item
    }

    /// Takes `item` out of `source`'s turn wherever it waits (a peer gone
    /// before its turn: it must not count as waiting, nor stay).
    pub(crate) fn remove(&mut self, source: K, item: T)
    where
        T: PartialEq,
    {
        let Some(waiting) = self.items.get_mut(&source) else {
            return;
        };
        waiting.retain(|&i| i != item);
        if waiting.is_empty() {
            self.items.remove(&source);
            self.turns.retain(|&s| s != source);
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.turns.is_empty()
    }

    /// Items waiting, over every source, in no order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = T> + '_ {
        self.items.values().flatten().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant as StdInstant};

    #[test]
    fn the_oldest_of_the_most_crowded_source_makes_room() {
        let t = StdInstant::now();
        let at = |ms| t + Duration::from_millis(ms);
        // Source 1 is the oldest entry, source 2 the most crowded.
        let room = [(0, 1, at(0)), (1, 2, at(5)), (2, 2, at(3)), (3, 3, at(1))];
        assert_eq!(oldest_of_most_crowded(room.into_iter()), Some(2));
        assert_eq!(oldest_of_most_crowded(room[..1].iter().copied()), Some(0));
        assert_eq!(
            oldest_of_most_crowded(std::iter::empty::<(usize, u8, StdInstant)>()),
            None
        );
    }

    #[test]
    fn a_quiet_peer_goes_from_the_newcomers_group_or_a_crowd_never_alone() {
        let places = |g: char| match g {
            'a' => 1,
            'b' => 3,
            'c' => 2,
            _ => 0,
        };
        // Ranks: a (alone) the least, then b's, then c's.
        let quiet = [('a', 1), ('b', 5), ('c', 7), ('b', 4)];
        // A newcomer of a new group: b holds 3 > 1, c holds 2 > 1; b has
        // the most quiet ones, its oldest goes. Never a, alone.
        assert_eq!(quiet_to_let_go(&quiet, places, 'z'), Some(3));
        // Of c (2 places, 3 once it is in): its own first.
        assert_eq!(quiet_to_let_go(&quiet, places, 'c'), Some(2));
        // Of a, and none of a's quiet: b's (3 > 2), not c's (2).
        assert_eq!(quiet_to_let_go(&quiet[1..], places, 'a'), Some(2));
        // Of b, none of b's quiet: nobody holds more than b would.
        assert_eq!(quiet_to_let_go(&[('a', 1), ('c', 7)], places, 'b'), None);
        assert_eq!(quiet_to_let_go(&[('a', 1)], places, 'z'), None);
    }

    #[test]
    fn a_fair_queue_serves_a_source_at_a_time() {
        let mut q = FairQueue::default();
        assert_eq!((q.front(), q.is_empty()), (None::<u32>, true));
        // Source 1 floods first; source 2 comes after three of its items.
        for item in [10, 11, 12] {
            q.push(1, item);
        }
        q.push(2, 20);
        q.push(1, 13);
        assert_eq!(q.iter().count(), 5);
        let mut order = Vec::new();
        while let Some(item) = q.front() {
            assert_eq!(q.pop_front(), Some(item));
            order.push(item);
        }
        assert_eq!(order, [10, 20, 11, 12, 13]);
        assert!(q.is_empty() && q.items.is_empty());
        assert_eq!(q.pop_front(), None);
    }

    #[test]
    fn an_item_taken_out_of_its_turn_neither_counts_nor_stays() {
        let mut q = FairQueue::default();
        for (source, item) in [(1, 10), (2, 20), (1, 11), (3, 30)] {
            q.push(source, item);
        }
        q.remove(1, 11);
        q.remove(2, 20); // its source's only item: the turn goes too
        q.remove(3, 31); // not there
        q.remove(4, 40); // nor its source
        let mut left: Vec<_> = q.iter().collect();
        left.sort();
        assert_eq!(left, [10, 30]);
        assert_eq!(
            (q.pop_front(), q.pop_front(), q.pop_front()),
            (Some(10), Some(30), None)
        );
        assert!(q.is_empty() && q.items.is_empty());
    }
}
