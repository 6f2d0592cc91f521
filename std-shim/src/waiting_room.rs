//! The rule for a full waiting room of connections that have not said who
//! they are yet (TCP handshakes and unclaimed second connections, the
//! same-host lane socket's links): one source's flood pushes out its own.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::Instant as StdInstant;

/// Which entry of a full waiting room (its index, its source, since when it
/// waits) makes room: the oldest of the source with the most entries.
pub(crate) fn oldest_of_most_crowded<K: Hash + Eq>(
    waiting: impl Iterator<Item = (usize, K, StdInstant)>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_oldest_of_the_most_crowded_source_makes_room() {
        let t = StdInstant::now();
        let at = |ms| t + Duration::from_millis(ms);
        // Source 1 is the oldest entry, source 2 the most crowded.
        let room = [(0, 1, at(0)), (1, 2, at(5)), (2, 2, at(3)), (3, 3, at(1))];
        assert_eq!(oldest_of_most_crowded(room.into_iter()), Some(2));
        assert_eq!(oldest_of_most_crowded(room[..1].iter().copied()), Some(0));
        assert_eq!(
            oldest_of_most_crowded(std::iter::empty::<(usize, u8, _)>()),
            None
        );
    }
}
