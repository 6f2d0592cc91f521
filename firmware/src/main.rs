//! zerohop on a Cortex-M4F, no heap: lease from the pool (its chunk registered
//! with the software NIC), send over the loopback link through the session
//! engine, receive, check; then close, and see the close reported as clean.
//! One context owns everything, so each side leases through a `LocalPool`:
//! the common lease and release take no lock.
//!
//! It runs [`ROUNDS`] rounds and reports through semihosting's exit code
//! (QEMU: `qemu-system-arm -M mps2-an386 -semihosting -kernel ...`): success,
//! or failure at the first round that went wrong.
#![no_std]
#![no_main]

use core::ptr::addr_of_mut;

use cortex_m_rt::entry;
use cortex_m_semihosting::debug::{self, EXIT_FAILURE, EXIT_SUCCESS};
use panic_halt as _;
use zerohop_backends::mock::{Arena, LinkEnd, MockLink, MockNic, MockTransport};
use zerohop_backends::{host_bytes, host_bytes_mut, HostMemory, HostPool, Nic};
use zerohop_core::pool::{Chunks, InlineTables};
use zerohop_core::{Error, Lease, LocalPool, PeerId, PoolConfig, SizeClasses, Transport};

/// Messages sent and checked before the image reports success.
const ROUNDS: u32 = 1000;

type Pool = HostPool<InlineTables<4, 32>>;
type Local<'p> = LocalPool<'p, Chunks<HostMemory, Nic>, InlineTables<4, 32>, 4>;

static LINK: MockLink<2048> = MockLink::new();
static NIC: MockNic = MockNic::new(None);
static mut ARENA_TX: [u8; 8192] = [0; 8192];
static mut ARENA_RX: [u8; 8192] = [0; 8192];

/// The pool's classes, checked when the image is built.
const CLASSES: SizeClasses = match SizeClasses::new(&[64, 256, 1024]) {
    Ok(c) => c,
    Err(_) => panic!("size classes"),
};

fn pool(buf: &'static mut [u8], nic: &'static MockNic) -> Pool {
    let mut cfg = PoolConfig::with_budget(8192);
    cfg.chunk_bytes = 4096;
    cfg.chunk_align = 64;
    cfg.classes = CLASSES;
    let source = Chunks {
        memory: HostMemory::Arena(Arena::new(buf)),
        registrar: Some(Nic::Mock(nic)),
    };
    match Pool::new(source, cfg, InlineTables::new()) {
        Ok(p) => p,
        Err(_) => halt(),
    }
}

/// Reports failure to the host (a debugger or QEMU) and stops.
fn halt() -> ! {
    debug::exit(EXIT_FAILURE);
    loop {
        cortex_m::asm::bkpt();
    }
}

type End = LinkEnd<'static, 2048>;

fn exchange<'p>(
    tx: &mut MockTransport<End, &'p Local<'p>>,
    rx: &mut MockTransport<End, &'p Local<'p>>,
    pool: &'p Local<'p>,
    round: u8,
) -> bool {
    let Ok(mut lease) = Lease::take(pool, 200) else {
        return false;
    };
    for (i, b) in host_bytes_mut(&mut lease).iter_mut().enumerate() {
        *b = round.wrapping_add(i as u8);
    }
    if tx.try_send_lease(PeerId(0), lease).is_err() {
        return false;
    }
    match rx.try_recv() {
        Ok(r) => host_bytes(&r.lease)
            .iter()
            .enumerate()
            .all(|(i, &b)| b == round.wrapping_add(i as u8)),
        Err(_) => false,
    }
}

#[entry]
fn main() -> ! {
    let nic = &NIC;
    // SAFETY: `main` runs once and never returns, with no interrupt handlers;
    // these are the only references ever taken to the two buffers.
    let (arena_tx, arena_rx) =
        unsafe { (&mut *addr_of_mut!(ARENA_TX), &mut *addr_of_mut!(ARENA_RX)) };
    let tx_pool = pool(arena_tx, nic);
    let rx_pool = pool(arena_rx, nic);
    let (Ok(tx_local), Ok(rx_local)) = (Local::new(&tx_pool), Local::new(&rx_pool)) else {
        halt();
    };
    let (a, b) = LINK.ends();
    let mut tx = MockTransport::new(a, &tx_local, 1024).with_nic(nic);
    let mut rx = MockTransport::new(b, &rx_local, 1024);
    for round in 0..ROUNDS {
        // Every received buffer came home: only the cache holds any.
        let idle = rx_pool.used_bytes() == rx_local.cached_bytes();
        if !exchange(&mut tx, &mut rx, &tx_local, round as u8) || !idle {
            halt();
        }
    }
    // A clean close, reported as one on the other side.
    if tx.close().is_err() || rx.try_recv().err() != Some(Error::PeerClosed(PeerId(0))) {
        halt();
    }
    debug::exit(EXIT_SUCCESS);
    loop {
        cortex_m::asm::wfi();
    }
}
