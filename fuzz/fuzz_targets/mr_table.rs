//! MrTable against a BTreeMap model: invariants after every operation.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use zerohop_core::testing::MrModel;
use zerohop_core::Access;

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
    let mut m = MrModel::<N>::new();
    // A small address space so ranges collide often.
    let span = |addr: u8, len: u8| (u64::from(addr) * 8, usize::from(len) + 1);
    for op in ops {
        match op {
            Op::Insert {
                addr,
                len,
                pinned,
                write,
            } => {
                let (addr, len) = span(addr, len);
                let access = if write {
                    Access::LOCAL_WRITE
                } else {
                    Access::NONE
                };
                m.insert(addr, len, pinned, access);
            }
            Op::Lookup { addr, len } => {
                let (addr, len) = span(addr, len);
                m.lookup(addr, len);
            }
            Op::Pin { addr, len } => {
                let (addr, len) = span(addr, len);
                m.pin(addr, len);
            }
            Op::Unpin { pick } => m.unpin(usize::from(pick)),
            Op::Invalidate { addr, len } => {
                let (addr, len) = span(addr, len);
                m.invalidate(addr, len);
            }
        }
    }
    m.finish();
});
