//! The pool's concurrent lease and release under every interleaving loom finds.
//! `LOOM_MAX_PREEMPTIONS=2 RUSTFLAGS="--cfg loom" cargo test -p zerohop-core --test loom --profile loom`
#![cfg(loom)]

use loom::sync::Arc;
use loom::thread;
use zerohop_core::pool::{Chunks, InlineTables};
use zerohop_core::testing::{CountingNic, FakeMemory};
use zerohop_core::{Error, PoolConfig, PoolError, SizeClasses, SlabPool};

fn pool(budget: usize) -> SlabPool<Chunks<FakeMemory, CountingNic>, InlineTables<4, 8>> {
    let mut cfg = PoolConfig::with_budget(budget);
    cfg.chunk_bytes = 512;
    cfg.chunk_align = 64;
    cfg.classes = SizeClasses::new(&[256, 512]).unwrap();
    SlabPool::new(
        Chunks {
            memory: FakeMemory::new(),
            registrar: Some(CountingNic::new()),
        },
        cfg,
        InlineTables::new(),
    )
    .unwrap()
}

#[test]
fn concurrent_leases_never_overlap_and_all_come_back() {
    loom::model(|| {
        let p = Arc::new(pool(1024)); // two chunks: growth races with reuse
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let p = Arc::clone(&p);
                thread::spawn(move || {
                    let a = zerohop_core::Lease::take(&*p, 200).unwrap();
                    let b = zerohop_core::Lease::take(&*p, 100);
                    let b = b.ok();
                    if let Some(b) = &b {
                        assert!(!a.buffer().overlaps(b.buffer().addr, b.buffer().len));
                    }
                    (a.device_ptr(), b.map(|b| b.device_ptr()))
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(p.used_bytes(), 0);
        assert_eq!(p.stats().leases, 0);
        assert!(p.stats().reserved_bytes <= 1024);
    });
}

#[test]
fn exhaustion_is_exact_under_contention() {
    loom::model(|| {
        // One chunk of two 256 B buffers; both threads race to grow it. Before
        // the fix, the thread that lost the race saw the budget reserved by the
        // other's growth in flight and reported a false exhaustion.
        let p = Arc::new(pool(512));
        let held = Arc::new(loom::sync::Mutex::new(Vec::new()));
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let (p, held) = (Arc::clone(&p), Arc::clone(&held));
                thread::spawn(move || {
                    let l =
                        zerohop_core::Lease::take(Arc::clone(&p), 256).expect("within the budget");
                    held.lock().unwrap().push(l);
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let n = held.lock().unwrap().len();
        assert_eq!(n, 2, "both leases fit the budget: no false exhaustion");
        assert_eq!(
            zerohop_core::Lease::take(Arc::clone(&p), 256).unwrap_err(),
            Error::Pool(PoolError::Exhausted {
                used: 512,
                cap: 512
            }),
            "a third is refused, exactly at the budget"
        );
        held.lock().unwrap().clear();
        assert_eq!(p.used_bytes(), 0);
    });
}

/// A bell as the host's eventfd behaves: rung, it stays rung until cleared.
#[derive(Debug, Default)]
struct ModelBell {
    rung: loom::sync::Mutex<bool>,
    woken: loom::sync::Condvar,
}

impl zerohop_core::Bell for ModelBell {
    fn ring(&self) {
        *self.rung.lock().unwrap() = true;
        self.woken.notify_all();
    }
}

impl ModelBell {
    fn clear(&self) {
        *self.rung.lock().unwrap() = false;
    }

    fn sleep(&self) {
        let mut rung = self.rung.lock().unwrap();
        while !*rung {
            rung = self.woken.wait(rung).unwrap();
        }
    }
}

#[test]
fn a_waiter_on_a_dry_pool_is_rung_by_the_buffer_another_thread_gives_back() {
    loom::model(|| {
        // Two 256 B buffers, both held; another thread gives one back while
        // this one clears the bell, looks, and sleeps on a refusal, as a
        // wire does. A lost ring is a sleep loom reports as a deadlock.
        let mut cfg = PoolConfig::with_budget(512);
        cfg.chunk_bytes = 512;
        cfg.chunk_align = 64;
        cfg.classes = SizeClasses::new(&[256, 512]).unwrap();
        let source = Chunks {
            memory: FakeMemory::new(),
            registrar: Some(CountingNic::new()),
        };
        let p = Arc::new(
            SlabPool::with_bell(
                source,
                cfg,
                InlineTables::<4, 8>::new(),
                ModelBell::default(),
            )
            .unwrap(),
        );
        let a = zerohop_core::Lease::take(Arc::clone(&p), 256).unwrap();
        let b = zerohop_core::Lease::take(Arc::clone(&p), 256).unwrap();
        let giver = thread::spawn(move || drop(a));
        loop {
            p.bell().clear();
            match zerohop_core::Lease::take(Arc::clone(&p), 256) {
                Ok(_) => break,
                Err(_) => p.bell().sleep(),
            }
        }
        giver.join().unwrap();
        drop(b);
        assert_eq!(p.used_bytes(), 0);
    });
}
