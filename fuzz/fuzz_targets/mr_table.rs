//! MrTable against a BTreeMap model: invariants after every operation.
#![no_main]

use std::collections::{BTreeMap, HashSet};

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use zerohop_core::{Access, MemKind, MrHandle, MrTable};

#[derive(Arbitrary, Debug)]
enum Op {
    Insert {
        addr: u8,
        len: u8,
        pinned: bool,
        write: bool,
    },
    Lookup {
        addr: u8,
        len: u8,
    },
    Pin {
        addr: u8,
        len: u8,
    },
    Unpin {
        pick: u8,
    },
    Invalidate {
        addr: u8,
        len: u8,
    },
}

const N: usize = 8;

fuzz_target!(|ops: Vec<Op>| {
    let mut t = MrTable::<N>::new();
    let mut model: BTreeMap<u64, (MrHandle, u32)> = BTreeMap::new();
    let mut live: HashSet<u32> = HashSet::new();
    let mut next = 0u32;
    let (mut hits, mut misses) = (0u64, 0u64);
    let covering = |m: &BTreeMap<u64, (MrHandle, u32)>, a: u64, l: usize, acc: Access| {
        m.range(..=a)
            .next_back()
            .map(|(_, v)| *v)
            .filter(|(h, _)| h.covers(a, l, acc))
    };
    for op in ops {
        match op {
            Op::Insert {
                addr,
                len,
                pinned,
                write,
            } => {
                let (addr, len) = (u64::from(addr) * 8, usize::from(len) + 1);
                next += 1;
                let access = if write {
                    Access::LOCAL_WRITE
                } else {
                    Access::NONE
                };
                let h = MrHandle {
                    addr,
                    len,
                    lkey: next,
                    rkey: next,
                    access,
                    id: next,
                };
                live.insert(next);
                let mut removed = Vec::new();
                let before = covering(&model, addr, len, access);
                let r = t.insert(h, pinned, &mut |x| removed.push(x));
                for x in &removed {
                    assert!(live.remove(&x.id), "handle {} handed back twice", x.id);
                }
                match (before, r) {
                    (Some((e, pins)), Ok(got)) => {
                        assert_eq!(got, e, "a covered range is never registered twice");
                        assert_eq!(removed.iter().map(|x| x.id).collect::<Vec<_>>(), vec![h.id]);
                        model.insert(e.addr, (e, pins + u32::from(pinned)));
                    }
                    (None, Ok(got)) => {
                        assert_eq!(got, h);
                        for x in &removed {
                            assert_eq!(
                                model.remove(&x.addr).map(|v| v.1),
                                Some(0),
                                "only unpinned entries leave"
                            );
                        }
                        model.insert(addr, (h, u32::from(pinned)));
                    }
                    (_, Err(_)) => assert_eq!(removed.last().map(|x| x.id), Some(h.id)),
                }
            }
            Op::Lookup { addr, len } => {
                let (addr, len) = (u64::from(addr) * 8, usize::from(len) + 1);
                let want = covering(&model, addr, len, Access::NONE).map(|v| v.0);
                let got = t.lookup_covering(addr, len, Access::NONE);
                assert_eq!(got, want);
                if got.is_some() {
                    hits += 1
                } else {
                    misses += 1
                }
            }
            Op::Pin { addr, len } => {
                let (addr, len) = (u64::from(addr) * 8, usize::from(len) + 1);
                let want = covering(&model, addr, len, Access::NONE);
                let got = t.pin_covering(addr, len, Access::NONE);
                assert_eq!(got, want.map(|v| v.0));
                if let Some((h, pins)) = want {
                    model.insert(h.addr, (h, pins + 1));
                    hits += 1;
                } else {
                    misses += 1;
                }
            }
            Op::Unpin { pick } => {
                if model.is_empty() {
                    continue;
                }
                let (&k, &(h, pins)) = model.iter().nth(usize::from(pick) % model.len()).unwrap();
                let r = t.unpin(&h);
                assert_eq!(r.is_ok(), pins > 0);
                if pins > 0 {
                    model.insert(k, (h, pins - 1));
                }
            }
            Op::Invalidate { addr, len } => {
                let (addr, len) = (u64::from(addr) * 8, usize::from(len) + 1);
                let mut removed = Vec::new();
                let n = t.invalidate(addr, len, &mut |x| removed.push(x));
                let doomed: Vec<u64> = model
                    .values()
                    .filter(|(e, _)| e.region(MemKind::Host).overlaps(addr, len))
                    .map(|(e, _)| e.addr)
                    .collect();
                assert_eq!(n, doomed.len());
                for a in doomed {
                    model.remove(&a);
                }
                for x in &removed {
                    assert!(live.remove(&x.id));
                }
            }
        }
        // Invariants: same entries, sorted, disjoint, within capacity, counters exact.
        let got: Vec<_> = t.iter().collect();
        let want: Vec<_> = model.values().copied().collect();
        assert_eq!(got, want);
        assert!(got.len() <= N);
        for w in got.windows(2) {
            assert!(w[0].0.addr + w[0].0.len as u64 <= w[1].0.addr);
        }
        assert_eq!((t.stats().hits, t.stats().misses), (hits, misses));
    }
    let mut rest = Vec::new();
    t.clear(&mut |x| rest.push(x));
    for x in rest {
        assert!(live.remove(&x.id));
    }
    assert!(
        live.is_empty(),
        "every registration is handed back exactly once"
    );
});
