//! The table of a wire's peers, each in a slot and named by a [`PeerId`]
//! that carries the slot and the slot's generation: once a peer goes, its
//! id names nothing, even after another peer takes its slot (a send to a
//! lost peer's id would otherwise reach the newcomer, and its `PeerLost`
//! read as the newcomer's). One table for every wire with many peers (TCP,
//! the same-host lanes, verbs), so ids mean the same on each.
//!
//! An id is the slot in its low 24 bits, the generation in the next 7, and
//! the table's tag bit on top: two tables that share an endpoint (TCP
//! peers and same-host lanes) tag theirs apart. A slot whose 128
//! generations are used up is retired, never given out again, so an id
//! never names two peers in a table's life (a stranger that reconnects
//! over and over would otherwise bring a lost peer's id back, to be
//! answered what was meant for that peer); a table holds at most 2^24
//! slots, retired ones among them: 16 bytes of table per 128 peers gone.
//!
//! [`PeerLimits`] bounds how many accepted peers a listening wire keeps,
//! one rule for every wire.

use std::vec::Vec;

use zerohop_core::PeerId;

/// Slots a table holds at most (an id's slot field).
pub const MAX_PEER_SLOTS: usize = 1 << 24;
/// The generations a slot goes through before it is retired.
const GEN_MASK: u32 = 0x7F;
/// A retired slot's generation (no id carries it).
const RETIRED: u8 = 0xFF;
const SLOT_MASK: u32 = (MAX_PEER_SLOTS - 1) as u32;
/// The bit that tells tagged tables' ids apart.
pub const TAG_BIT: u32 = 1 << 31;

/// Peers in generation-counted slots.
pub struct PeerSlots<T> {
    slots: Vec<(u8, Option<T>)>,
    /// Occupied slots, kept as they change: wires ask on every poll
    /// whether any peer is left, and a walk of the slots would cost each
    /// poll one step per peer ever held.
    occupied: usize,
    /// One past the last occupied slot: the walks stop there (slots stay,
    /// with their generations, after their peers go; a wire that once held
    /// thousands of peers walked every slot on every poll, 2-4 µs a 64 B
    /// message after 4 096 same-host peers had come and gone).
    end: usize,
    tag: u32,
}

impl<T> std::fmt::Debug for PeerSlots<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerSlots")
            .field("slots", &self.slots.len())
            .field("occupied", &self.count())
            .field("tagged", &(self.tag != 0))
            .finish()
    }
}

impl<T> PeerSlots<T> {
    /// An empty table; a `tagged` one's ids have [`TAG_BIT`] set, an
    /// untagged one's never do.
    pub const fn new(tagged: bool) -> Self {
        PeerSlots {
            slots: Vec::new(),
            occupied: 0,
            end: 0,
            tag: if tagged { TAG_BIT } else { 0 },
        }
    }

    /// The id of whatever is in `slot` now (or comes next, if it is free).
    pub fn id(&self, slot: usize) -> PeerId {
        let gen = self.slots.get(slot).map_or(0, |(g, _)| *g);
        PeerId(self.tag | slot as u32 | (u32::from(gen) & GEN_MASK) << 24)
    }

    /// The slot that `id` names, if its peer is still there.
    pub fn slot(&self, id: PeerId) -> Option<usize> {
        if id.0 & TAG_BIT != self.tag {
            return None;
        }
        let slot = (id.0 & SLOT_MASK) as usize;
        match self.slots.get(slot) {
            Some((gen, Some(_))) if u32::from(*gen) == (id.0 >> 24) & GEN_MASK => Some(slot),
            _ => None,
        }
    }

    /// The peer `id` names.
    pub fn get(&self, id: PeerId) -> Option<&T> {
        self.slot(id).and_then(|s| self.at(s))
    }

    /// The peer `id` names.
    pub fn get_mut(&mut self, id: PeerId) -> Option<&mut T> {
        self.find_mut(id).map(|(_, p)| p)
    }

    /// The slot `id` names and its peer, from one look.
    pub fn find_mut(&mut self, id: PeerId) -> Option<(usize, &mut T)> {
        let slot = self.slot(id)?;
        Some((slot, self.at_mut(slot)?))
    }

    /// The peer in `slot`.
    pub fn at(&self, slot: usize) -> Option<&T> {
        self.slots.get(slot)?.1.as_ref()
    }

    /// The peer in `slot`.
    pub fn at_mut(&mut self, slot: usize) -> Option<&mut T> {
        self.slots.get_mut(slot)?.1.as_mut()
    }

    /// The slot the next [`insert`](Self::insert) takes (the first free
    /// one), or `None` when every slot an id can name is taken.
    pub fn vacant(&self) -> Option<usize> {
        match self
            .slots
            .iter()
            .position(|(g, p)| p.is_none() && *g != RETIRED)
        {
            Some(i) => Some(i),
            None if self.slots.len() < MAX_PEER_SLOTS => Some(self.slots.len()),
            None => None,
        }
    }

    /// The peer in `slot` with its id.
    pub fn entry(&mut self, slot: usize) -> Option<(PeerId, &mut T)> {
        let id = self.id(slot);
        Some((id, self.at_mut(slot)?))
    }

    /// Puts `peer` in the first free slot ([`vacant`](Self::vacant)'s): the
    /// slot and the peer's id, or the peer back when every slot an id can
    /// name is taken.
    pub fn insert(&mut self, peer: T) -> Result<(usize, PeerId), T> {
        let Some(slot) = self.vacant() else {
            return Err(peer);
        };
        if slot == self.slots.len() {
            self.slots.push((0, None));
        }
        self.slots[slot].1 = Some(peer);
        self.occupied += 1;
        self.end = self.end.max(slot + 1);
        Ok((slot, self.id(slot)))
    }

    /// A peer left `slot` for good.
    fn vacated(&mut self, slot: usize) {
        self.occupied -= 1;
        if slot + 1 == self.end {
            self.shrink_end();
        }
    }

    /// The walks' end moves back past empty slots.
    fn shrink_end(&mut self) {
        while self.end > 0 && self.slots[self.end - 1].1.is_none() {
            self.end -= 1;
        }
    }

    /// Removes the peer in `slot` for good: its id, which names nothing
    /// from now on, and the peer.
    pub fn remove(&mut self, slot: usize) -> Option<(PeerId, T)> {
        let id = self.id(slot);
        let (gen, p) = self.slots.get_mut(slot)?;
        let peer = p.take()?;
        *gen = next_generation(*gen);
        self.vacated(slot);
        Some((id, peer))
    }

    /// Takes the peer in `slot` out for a while, to be [`restore`](Self::restore)d
    /// (its id still names the slot) or [`retire`](Self::retire)d.
    pub fn lend(&mut self, slot: usize) -> Option<T> {
        let peer = self.slots.get_mut(slot)?.1.take()?;
        // (The walks' end stays: a peer lent on every poll and restored
        // would walk it back and forth.)
        self.occupied -= 1;
        Some(peer)
    }

    /// Puts a lent peer back in its slot.
    pub fn restore(&mut self, slot: usize, peer: T) {
        if let Some((g, p @ None)) = self.slots.get_mut(slot) {
            if *g != RETIRED {
                *p = Some(peer);
                self.occupied += 1;
                self.end = self.end.max(slot + 1);
            }
        }
    }

    /// Ends a lent peer's slot generation: its id names nothing from now on.
    pub fn retire(&mut self, slot: usize) {
        if let Some((gen, None)) = self.slots.get_mut(slot) {
            *gen = next_generation(*gen);
            self.shrink_end();
        }
    }

    /// Slots up to the last occupied one: every peer's slot is below it.
    pub fn len(&self) -> usize {
        self.end
    }

    /// Whether no peer is in the table (lent ones aside).
    pub fn is_empty(&self) -> bool {
        self.occupied == 0
    }

    /// Peers in the table.
    pub fn count(&self) -> usize {
        self.occupied
    }

    /// The peers, with their slots.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &T)> {
        self.slots[..self.end]
            .iter()
            .enumerate()
            .filter_map(|(i, (_, p))| Some((i, p.as_ref()?)))
    }

    /// The peers, with their slots.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (usize, &mut T)> {
        self.slots[..self.end]
            .iter_mut()
            .enumerate()
            .filter_map(|(i, (_, p))| Some((i, p.as_mut()?)))
    }
}

/// How many accepted peers a listening wire keeps, at most: past either
/// bound a newcomer is refused at its handshake, before it holds a peer's
/// buffers, unless the wire lets a kept peer go for it (TCP lets go one
/// quiet an idle timeout of its own accord, from the newcomer's group of
/// addresses or one holding more places than the newcomer's would, so
/// that a stranger whose peers say Hello and nothing more gives its places
/// up to newcomers; same-host lanes too; verbs peers are never let go). One address that opens
/// connection after connection (a stranger, a broken client in a loop)
/// fills its own share, not the table every peer needs. Peers this side
/// connected to are the application's choice and do not count.
///
/// The defaults bound the table, not the process's descriptors: a TCP peer
/// holds one or two (its second, striping connection), so a listener whose
/// descriptor limit is lower than twice `per_address` (the usual soft
/// limit is 1024) should lower `per_address` for one address to be unable
/// to take them all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerLimits {
    /// Accepted peers, over all addresses (default 4096; at least 1).
    pub accepted: usize,
    /// Accepted peers from one IP address, or one IPv6 /64
    /// ([`counted_address`]) (default 4096, no bound of its own: peers
    /// behind one NAT, or on one host, share an address; at least 1).
    pub per_address: usize,
}

impl Default for PeerLimits {
    fn default() -> Self {
        PeerLimits {
            accepted: 4096,
            per_address: 4096,
        }
    }
}

/// Why a newcomer was refused ([`PeerLimits::admit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The wire keeps as many accepted peers as it takes.
    Full {
        /// The bound.
        accepted: usize,
    },
    /// The newcomer's address has as many accepted peers as one may.
    AddressFull {
        /// The bound.
        per_address: usize,
    },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Full { accepted } => {
                write!(f, "{accepted} accepted peers already, the most kept")
            }
            Refusal::AddressFull { per_address } => write!(
                f,
                "{per_address} accepted peers from its address already, the most kept from one"
            ),
        }
    }
}

impl PeerLimits {
    /// Whether a newcomer may join `kept` accepted peers, `kept_from_its
    /// address` of them from its own address.
    pub fn admit(&self, kept: usize, kept_from_its_address: usize) -> Result<(), Refusal> {
        if kept >= self.accepted {
            Err(Refusal::Full {
                accepted: self.accepted,
            })
        } else if kept_from_its_address >= self.per_address {
            Err(Refusal::AddressFull {
                per_address: self.per_address,
            })
        } else {
            Ok(())
        }
    }

    /// Both bounds at least 1 (0 would refuse every peer, silently).
    pub fn check(&self) -> Result<(), &'static str> {
        match (self.accepted, self.per_address) {
            (0, _) => Err("peer_limits.accepted is 0: every peer would be refused"),
            (_, 0) => Err("peer_limits.per_address is 0: every peer would be refused"),
            _ => Ok(()),
        }
    }
}

/// The address a peer counts under in [`PeerLimits::per_address`]: an
/// IPv4 address (one mapped into IPv6 too), or an IPv6 address's /64
/// prefix, a host's usual allocation (a host picks at will among the 2^64
/// addresses of its /64: counted one by one, it would have no bound).
pub fn counted_address(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip.to_canonical() {
        std::net::IpAddr::V6(v6) => {
            std::net::IpAddr::V6((u128::from(v6) & !u128::from(u64::MAX)).into())
        }
        v4 => v4,
    }
}

/// The group of addresses whose peers count as one crowd when a full
/// listener lets a quiet peer go for a newcomer: every loopback address as
/// one (a process can bind any of 127/8), an IPv4 /24, an IPv6 /48 (a
/// site's usual allocation). Coarser than [`counted_address`]: a stranger
/// that spreads its connections over many addresses of one host or site
/// is still one crowd.
pub fn crowd_group(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip.to_canonical() {
        ip if ip.is_loopback() => std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        std::net::IpAddr::V4(v4) => std::net::IpAddr::V4((u32::from(v4) & !0xff).into()),
        std::net::IpAddr::V6(v6) => {
            std::net::IpAddr::V6((u128::from(v6) & !((1u128 << 80) - 1)).into())
        }
    }
}

/// The accepted peers a listening wire keeps, counted by address
/// ([`counted_address`]) and by group ([`crowd_group`]) as they come and
/// go: a newcomer is judged without a walk of the peers (a stranger that
/// reconnects in a loop would cost a walk each time; a full TCP listener
/// walks its peers for one to let go, and after a walk that finds none,
/// not again for a timer scan).
#[derive(Debug, Default)]
pub struct AcceptedPeers {
    by_address: std::collections::HashMap<std::net::IpAddr, usize>,
    by_group: std::collections::HashMap<std::net::IpAddr, usize>,
    total: usize,
}

impl AcceptedPeers {
    /// A peer from `ip` is kept.
    pub fn add(&mut self, ip: std::net::IpAddr) {
        *self.by_address.entry(counted_address(ip)).or_default() += 1;
        *self.by_group.entry(crowd_group(ip)).or_default() += 1;
        self.total += 1;
    }

    /// A peer from `ip` that [`add`](Self::add) counted has gone.
    pub fn remove(&mut self, ip: std::net::IpAddr) {
        let address = counted_address(ip);
        if let Some(n) = self.by_address.get_mut(&address) {
            *n -= 1;
            if *n == 0 {
                self.by_address.remove(&address);
            }
            self.total -= 1;
            let group = crowd_group(ip);
            if let Some(n) = self.by_group.get_mut(&group) {
                *n -= 1;
                if *n == 0 {
                    self.by_group.remove(&group);
                }
            }
        }
    }

    /// How many are kept from the group ([`crowd_group`]) `group` names.
    pub fn in_group(&self, group: std::net::IpAddr) -> usize {
        self.by_group.get(&group).copied().unwrap_or(0)
    }

    /// How many are kept from `ip`'s counted address.
    pub fn from(&self, ip: std::net::IpAddr) -> usize {
        self.by_address
            .get(&counted_address(ip))
            .copied()
            .unwrap_or(0)
    }

    /// Whether a newcomer from `from` may join them under `limits`.
    pub fn admit(&self, limits: &PeerLimits, from: std::net::IpAddr) -> Result<(), Refusal> {
        let same = self.by_address.get(&counted_address(from)).copied();
        limits.admit(self.total, same.unwrap_or(0))
    }

    /// Peers kept.
    pub fn total(&self) -> usize {
        self.total
    }
}

/// The generation after `gen`, or [`RETIRED`] once they are used up.
fn next_generation(gen: u8) -> u8 {
    match u32::from(gen) {
        g if g < GEN_MASK => gen + 1,
        _ => RETIRED,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newcomer_is_admitted_below_both_bounds_and_refused_at_either() {
        use std::net::IpAddr;
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        // The same IPv4 address carried in IPv6.
        let a6: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        let limits = PeerLimits {
            accepted: 4,
            per_address: 2,
        };
        let mut kept = AcceptedPeers::default();
        assert_eq!(kept.admit(&limits, a), Ok(()));
        kept.add(a);
        kept.add(b);
        assert_eq!(kept.admit(&limits, a), Ok(()));
        kept.add(a6);
        assert_eq!(kept.total(), 3);
        let address_full = Err(Refusal::AddressFull { per_address: 2 });
        assert_eq!(kept.admit(&limits, a), address_full);
        assert_eq!(kept.admit(&limits, a6), address_full);
        assert_eq!(kept.admit(&limits, b), Ok(()));
        kept.add(b);
        // The overall bound is named first when both are reached.
        let full = Err(Refusal::Full { accepted: 4 });
        assert_eq!(kept.admit(&limits, b), full);
        assert_eq!(kept.admit(&limits, "10.0.0.3".parse().unwrap()), full);
        // Going frees both shares; an address never counted changes nothing.
        kept.remove("10.0.0.9".parse().unwrap());
        assert_eq!(kept.total(), 4);
        kept.remove(a);
        assert_eq!(kept.admit(&limits, b), address_full);
        assert_eq!(kept.admit(&limits, a6), Ok(()));
        kept.remove(a6);
        kept.remove(b);
        kept.remove(b);
        assert_eq!(kept.total(), 0);
        assert!(kept.by_address.is_empty(), "no address left behind");
        assert!(kept.by_group.is_empty(), "no group left behind");
        assert_ne!(
            Refusal::Full { accepted: 4 }.to_string(),
            Refusal::AddressFull { per_address: 4 }.to_string()
        );
        assert!(PeerLimits::default().check().is_ok());
        for (accepted, per_address) in [(0, 1), (1, 0)] {
            let bad = PeerLimits {
                accepted,
                per_address,
            };
            assert!(bad.check().is_err(), "{bad:?}");
        }
    }

    /// An IPv6 host counts as its /64: two addresses there share one
    /// bound, a neighbouring /64 has its own; IPv4 addresses count alone.
    #[test]
    fn an_ipv6_host_counts_as_its_64_under_the_per_address_bound() {
        use std::net::IpAddr;
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let limits = PeerLimits {
            accepted: 16,
            per_address: 2,
        };
        let mut kept = AcceptedPeers::default();
        kept.add(ip("2001:db8:1:2::1"));
        kept.add(ip("2001:db8:1:2:ffff:ffff:ffff:fffe"));
        let address_full = Err(Refusal::AddressFull { per_address: 2 });
        assert_eq!(
            kept.admit(&limits, ip("2001:db8:1:2:abcd::7")),
            address_full
        );
        assert_eq!(kept.admit(&limits, ip("2001:db8:1:3::1")), Ok(()));
        assert_eq!(kept.admit(&limits, ip("2001:db8:1:1::1")), Ok(()));
        kept.add(ip("10.0.0.1"));
        kept.add(ip("10.0.0.2"));
        assert_eq!(kept.admit(&limits, ip("10.0.0.3")), Ok(()));
        assert_eq!(
            counted_address(ip("2001:db8:1:2:abcd::7")),
            ip("2001:db8:1:2::")
        );
        assert_eq!(counted_address(ip("::ffff:10.0.0.1")), ip("10.0.0.1"));
        kept.remove(ip("2001:db8:1:2::99"));
        assert_eq!(kept.admit(&limits, ip("2001:db8:1:2::1")), Ok(()));
    }

    #[test]
    fn a_gone_peers_id_names_nothing_once_its_slot_is_taken_again() {
        let mut t = PeerSlots::new(false);
        let a = t.insert("a").unwrap().1;
        let b = t.insert("b").unwrap().1;
        assert_eq!((t.get(a), t.get(b)), (Some(&"a"), Some(&"b")));
        assert_eq!(t.remove(t.slot(a).unwrap()), Some((a, "a")));
        assert_eq!(t.get(a), None);
        assert_eq!(t.vacant(), Some(0));
        let c = t.insert("c").unwrap().1;
        assert_eq!(t.slot(c), Some(0), "the free slot is taken again");
        assert_ne!(c, a, "with a new id");
        assert_eq!((t.get(a), t.get(c)), (None, Some(&"c")));
        assert_eq!(t.count(), 2);
    }

    #[test]
    fn the_count_follows_every_way_a_peer_comes_and_goes() {
        let mut t = PeerSlots::new(false);
        let check = |t: &PeerSlots<u32>, want: usize| {
            assert_eq!(t.count(), want);
            assert_eq!(t.iter().count(), want, "the count agrees with the slots");
        };
        let a = t.insert(1).unwrap().0;
        let b = t.insert(2).unwrap().0;
        check(&t, 2);
        let lent = t.lend(a).unwrap();
        check(&t, 1);
        assert_eq!(t.lend(a), None, "a lent slot lends nothing twice");
        check(&t, 1);
        t.restore(a, lent);
        check(&t, 2);
        t.restore(a, 9); // an occupied slot keeps its peer
        check(&t, 2);
        assert_eq!(t.at(a), Some(&1));
        t.lend(b).unwrap();
        t.retire(b);
        check(&t, 1);
        t.restore(b, 2); // back under its next generation (generations are left)
        check(&t, 2);
        assert_eq!(t.remove(a).map(|(_, p)| p), Some(1));
        assert_eq!(t.remove(a), None);
        check(&t, 1);
        assert_eq!(t.remove(b).map(|(_, p)| p), Some(2));
        check(&t, 0);
        // A slot retired for good takes no lent peer back.
        let mut t = PeerSlots::new(false);
        for i in 0..127 {
            t.insert(i).unwrap();
            t.remove(0).unwrap();
        }
        assert_eq!(t.insert(127).unwrap().0, 0, "the slot's last generation");
        let p = t.lend(0).unwrap();
        t.retire(0);
        t.restore(0, p);
        check(&t, 0);
    }

    #[test]
    fn a_slot_is_retired_after_128_generations_and_ids_never_repeat() {
        let mut t = PeerSlots::new(true);
        let mut ids = std::collections::HashSet::new();
        for i in 0..1000 {
            let id = t.insert(i).unwrap().1;
            assert_eq!(id.0 & TAG_BIT, TAG_BIT);
            assert!(ids.insert(id), "peer {i}: {id:?} given out again");
            let slot = t.slot(id).unwrap();
            assert_eq!(t.remove(slot).map(|(gone, _)| gone), Some(id));
        }
        assert_eq!(
            t.slots.len(),
            1000usize.div_ceil(128),
            "a slot per 128 peers"
        );
        assert_eq!(t.len(), 0, "none walked");
        assert_eq!(t.count(), 0);
        // Lent and retired the same way.
        let mut t = PeerSlots::new(false);
        for i in 0..128 {
            t.insert(i).unwrap();
            t.lend(0).unwrap();
            t.retire(0);
        }
        assert_eq!(t.vacant(), Some(1), "slot 0 used up");
    }

    #[test]
    fn tagged_and_untagged_tables_never_name_each_others_peers() {
        let mut plain = PeerSlots::new(false);
        let mut tagged = PeerSlots::new(true);
        let p = plain.insert(1).unwrap().1;
        let q = tagged.insert(2).unwrap().1;
        assert_eq!(p.0 & TAG_BIT, 0);
        assert_eq!(q.0 & TAG_BIT, TAG_BIT);
        assert_eq!((plain.get(q), tagged.get(p)), (None, None));
        assert_eq!((plain.get(p), tagged.get(q)), (Some(&1), Some(&2)));
    }

    #[test]
    fn a_lent_peer_keeps_its_id_and_a_retired_one_loses_it() {
        let mut t = PeerSlots::new(false);
        let a = t.insert('a').unwrap().1;
        assert_eq!(t.entry(0).map(|(id, p)| (id, *p)), Some((a, 'a')));
        let x = t.lend(0).unwrap();
        assert_eq!(t.get(a), None, "out meanwhile");
        t.restore(0, x);
        assert_eq!(t.get(a), Some(&'a'));
        t.lend(0).unwrap();
        t.retire(0);
        let b = t.insert('b').unwrap().1;
        assert_ne!(a, b);
        assert_eq!(t.get(a), None);
        t.restore(0, 'z'); // an occupied slot is left as it is
        assert_eq!(t.get(b), Some(&'b'));
    }

    #[test]
    fn ids_out_of_range_or_of_free_slots_name_nothing() {
        let mut t = PeerSlots::<u8>::new(false);
        assert_eq!(t.slot(PeerId(0)), None);
        t.insert(1).unwrap();
        t.remove(0).unwrap();
        assert_eq!(t.slot(t.id(0)), None, "free");
        assert_eq!(t.slot(PeerId(5)), None);
        assert_eq!(t.slot(PeerId(u32::MAX)), None);
        assert_eq!(t.iter().count(), 0);
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn crowds_are_loopback_a_v4_slash_24_or_a_v6_slash_48() {
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        let same = |a, b| crowd_group(ip(a)) == crowd_group(ip(b));
        assert!(same("127.0.0.1", "127.9.8.7") && same("127.0.0.1", "::1"));
        assert!(same("::ffff:127.0.0.2", "127.0.0.1"));
        assert!(same("10.1.2.3", "10.1.2.250") && !same("10.1.2.3", "10.1.3.3"));
        assert!(
            same("2001:db8:1::1", "2001:db8:1:ffff::9") && !same("2001:db8:1::1", "2001:db8:2::1")
        );
        assert!(!same("10.1.2.3", "127.0.0.1"));
        let mut kept = AcceptedPeers::default();
        for a in ["127.0.0.1", "127.0.0.2", "::1", "10.1.2.3"] {
            kept.add(ip(a));
        }
        assert_eq!(kept.in_group(crowd_group(ip("127.1.1.1"))), 3);
        assert_eq!(kept.in_group(crowd_group(ip("10.1.2.99"))), 1);
        kept.remove(ip("127.0.0.2"));
        kept.remove(ip("192.0.2.1")); // never kept: nothing moves
        assert_eq!(kept.in_group(crowd_group(ip("127.0.0.1"))), 2);
    }

    #[test]
    fn two_session_clocks_meet_on_the_monotonic_scale() {
        let a = SessionClock::start();
        std::thread::sleep(std::time::Duration::from_millis(100));
        let b = SessionClock::start();
        let (at_a, at_b) = (a.now(), b.now());
        // The same moment, read on each: a's reading is 100 ms later.
        assert!(at_a.as_micros() >= at_b.as_micros() + 100_000);
        let (ma, mb) = (a.monotonic_us(at_a), b.monotonic_us(at_b));
        assert!(ma.abs_diff(mb) < 50_000, "{ma} / {mb}");
    }

    #[test]
    fn the_walks_end_after_the_last_occupied_slot() {
        let mut t = PeerSlots::new(false);
        for i in 0..100 {
            t.insert(i).unwrap();
        }
        assert_eq!(t.len(), 100);
        for slot in (0..100).filter(|&s| s != 3) {
            t.remove(slot).unwrap();
        }
        assert_eq!((t.len(), t.count(), t.is_empty()), (4, 1, false));
        // A lent peer's slot stays in the walks (lent and restored on
        // every poll, it would walk the end back and forth).
        let three = t.lend(3).unwrap();
        assert_eq!((t.len(), t.is_empty()), (4, true));
        t.restore(3, three);
        assert_eq!(t.iter().map(|(s, p)| (s, *p)).collect::<Vec<_>>(), [(3, 3)]);
        t.insert(7).unwrap(); // the first free slot: 0
        t.insert(8).unwrap(); // 1
        t.remove(1).unwrap();
        t.remove(3).unwrap();
        assert_eq!(t.len(), 1);
        // Retired after a lend: past the end.
        t.lend(0).unwrap();
        t.retire(0);
        assert_eq!((t.len(), t.iter_mut().count(), t.is_empty()), (0, 0, true));
    }
}

/// When a wire's driver last looked at its peers' timers, to tell the
/// application's absence from a peer's silence: a driver whose waiters
/// wake every few milliseconds looks often, so a gap longer than `away`
/// means nobody was driving it (a caller-driven application doing other
/// work), and what its peers could not send meanwhile is not theirs to
/// answer for (the engine's `handle_held`).
#[derive(Debug, Default)]
pub struct Looks {
    last: Option<std::time::Instant>,
}

impl Looks {
    /// Whether the last look was more than `away` before `now` (not a look).
    pub fn away(&self, now: std::time::Instant, away: std::time::Duration) -> bool {
        self.last
            .is_some_and(|was| now.saturating_duration_since(was) > away)
    }

    /// A look at `now`: whether the one before was more than `away` ago.
    pub fn came_back(&mut self, now: std::time::Instant, away: std::time::Duration) -> bool {
        self.last
            .replace(now)
            .is_some_and(|was| now.saturating_duration_since(was) > away)
    }
}

/// Why `peer` ended, taken from a wire's arrivals, where its end waits for
/// `try_recv` (a Close, a loss, a refusal of its Hello); [`PeerLost`]
/// where none is there. What a wire's `opened` answers for a peer that is
/// gone before its Hellos crossed.
///
/// [`PeerLost`]: zerohop_core::Error::PeerLost
pub fn take_end<L>(
    arrivals: &mut std::collections::VecDeque<
        Result<zerohop_core::Received<L>, zerohop_core::Error>,
    >,
    peer: PeerId,
) -> zerohop_core::Error {
    arrivals
        .iter()
        .position(|a| {
            a.as_ref()
                .err()
                .is_some_and(|e| e.ended_peer() == Some(peer))
        })
        .and_then(|i| arrivals.remove(i))
        .and_then(Result::err)
        .unwrap_or(zerohop_core::Error::PeerLost(peer))
}

/// How long without a look at the timers is an absence: half the idle
/// timeout, and at least a quarter of a second (a loaded machine's waiter
/// may be late by a scheduler's slice or two).
pub fn absence(idle_timeout: std::time::Duration) -> std::time::Duration {
    (idle_timeout / 2).max(std::time::Duration::from_millis(250))
}

/// A driver's clock for its sessions: microseconds since the driver
/// began, read from `CLOCK_MONOTONIC` (what `std::time::Instant` reads)
/// without `Duration`'s arithmetic, since a driver asks on every read.
#[derive(Clone, Copy, Debug)]
pub struct SessionClock {
    origin_us: u64,
}

impl SessionClock {
    /// Starts now.
    pub fn start() -> SessionClock {
        SessionClock {
            origin_us: monotonic_us(),
        }
    }

    /// The time since the start, as the engine counts it.
    #[inline]
    pub fn now(&self) -> zerohop_core::session::Instant {
        zerohop_core::session::Instant::from_micros(monotonic_us().saturating_sub(self.origin_us))
    }

    /// `at` of this clock as microseconds of `CLOCK_MONOTONIC`: one scale
    /// for the clocks of a process's wires, each started at its own time.
    pub fn monotonic_us(&self, at: zerohop_core::session::Instant) -> u64 {
        self.origin_us.saturating_add(at.as_micros())
    }
}

#[inline]
fn monotonic_us() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid place for the call's one write; the
    // monotonic clock exists on every system this builds for (it cannot
    // fail with a valid pointer, and a zero time would be only early).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000)
        .saturating_add(ts.tv_nsec as u64 / 1_000)
}

#[cfg(test)]
mod looks_tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn the_session_clock_keeps_time_with_std() {
        let clock = SessionClock::start();
        let t0 = clock.now();
        let started = Instant::now();
        std::thread::sleep(Duration::from_millis(20));
        let (t1, waited) = (clock.now(), started.elapsed());
        let moved = t1.as_micros() - t0.as_micros();
        // As far as std's clock moved, give or take the calls between.
        assert!(moved >= 20_000, "moved {moved} us over a 20 ms sleep");
        assert!(
            moved <= waited.as_micros() as u64 + 1_000,
            "moved {moved} us where std saw {waited:?}"
        );
    }

    #[test]
    fn only_a_gap_longer_than_away_is_a_return() {
        let mut looks = Looks::default();
        let t0 = Instant::now();
        let away = Duration::from_millis(100);
        assert!(!looks.came_back(t0, away), "the first look");
        assert!(!looks.came_back(t0 + away, away), "exactly away: not yet");
        assert!(looks.came_back(t0 + away * 2 + Duration::from_millis(1), away));
        assert!(
            !looks.came_back(t0 + away * 3, away),
            "the gap from the last look"
        );
        assert_eq!(absence(Duration::from_secs(5)), Duration::from_millis(2500));
        assert_eq!(
            absence(Duration::from_millis(100)),
            Duration::from_millis(250)
        );
    }
}
