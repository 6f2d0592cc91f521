//! On a CUDA host (prints why and exits 0 elsewhere):
//! 1. a 4 KiB lease+release from a warm managed-memory pool vs cuMemAllocManaged
//!    + cuMemFree per call, and cuMemAllocManaged alone;
//! 2. received bytes made readable by a kernel — the bytes already in a managed
//!    lease, the GPU reading them where they are (on demand, or after a prefetch)
//!    — vs the classic path from pinned memory: cuMemcpyHtoD into device memory,
//!    then the same kernel. 64 KiB to 64 MiB, same run.
//!
//! Medians; the CPU rewrites each buffer before every timed round, as a receive would.
//!
//! `cargo bench -p zerohop-backends --features cuda-uma --bench cuda_uma`

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::result;
use cudarc::driver::sys::CUmemAttach_flags;
use zerohop_backends::cuda::{Checksum, DeviceMemory, Gpu, HostCudaMemory};
use zerohop_backends::{HostBell, HostMemory, HostPool, Nic};
use zerohop_core::pool::{Chunks, InlineTables};
use zerohop_core::{Lease, PoolConfig, RawMemory};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn per_op_ns(rounds: usize, ops: usize, mut f: impl FnMut()) -> f64 {
    let mut samples = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t0 = Instant::now();
        for _ in 0..ops {
            f();
        }
        samples.push(t0.elapsed().as_nanos() as f64 / ops as f64);
    }
    median(samples)
}

fn main() {
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            println!("cuda_uma bench: skipped: {e}");
            return;
        }
    };
    println!("device: {}", gpu.name().unwrap_or_default());
    let (free, total) = gpu.memory_info().unwrap();
    println!(
        "device memory: {} MiB free of {} MiB",
        free >> 20,
        total >> 20
    );

    // ---- 1. per-call allocation cost, 4 KiB ---------------------------------
    let source = Chunks::<HostMemory, Nic> {
        memory: HostMemory::Cuda(HostCudaMemory::managed(&gpu)),
        registrar: None,
    };
    let pool = Arc::new(
        HostPool::with_bell(
            source,
            PoolConfig::with_budget(64 << 20),
            InlineTables::<64, 4096>::new(),
            HostBell::default(),
        )
        .unwrap(),
    );
    drop(Lease::take(Arc::clone(&pool), 4096).unwrap()); // warm: the 4 KiB chunk exists
    let lease_ns = per_op_ns(21, 100_000, || {
        let l = Lease::take(&*pool, 4096).unwrap();
        std::hint::black_box(l.device_ptr());
    });
    gpu.bind().unwrap();
    let alloc_free_ns = per_op_ns(21, 2_000, || {
        // SAFETY: allocate and free 4 KiB of managed memory on the bound context.
        unsafe {
            let p = result::malloc_managed(4096, CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL).unwrap();
            result::free_sync(p).unwrap();
        }
    });
    let mut ptrs = Vec::with_capacity(2000);
    let mut alloc_only = Vec::new();
    for _ in 0..21 {
        let t0 = Instant::now();
        for _ in 0..2000 {
            // SAFETY: as above; freed below.
            ptrs.push(
                unsafe { result::malloc_managed(4096, CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL) }
                    .unwrap(),
            );
        }
        alloc_only.push(t0.elapsed().as_nanos() as f64 / 2000.0);
        for p in ptrs.drain(..) {
            // SAFETY: each pointer came from cuMemAllocManaged just above, freed once.
            unsafe { result::free_sync(p) }.unwrap();
        }
    }
    let alloc_ns = median(alloc_only);
    println!("\n4 KiB per call (median of 21 rounds)");
    println!(
        "  zerohop pool lease+release (managed):  {:>9.1} ns",
        lease_ns
    );
    println!(
        "  cuMemAllocManaged alone:               {:>9.1} ns   ({:.0}x the pool)",
        alloc_ns,
        alloc_ns / lease_ns
    );
    println!(
        "  cuMemAllocManaged + cuMemFree:         {:>9.1} ns   ({:.0}x the pool)",
        alloc_free_ns,
        alloc_free_ns / lease_ns
    );

    // ---- 2. bytes made readable by a kernel -------------------------------------
    let kernel = Checksum::load(&gpu).unwrap();
    let managed = HostCudaMemory::managed(&gpu);
    let pinned = HostCudaMemory::pinned(&gpu);
    let device = DeviceMemory::new(&gpu);
    println!("\nreceived bytes -> read by a kernel (median of 15; GB/s of payload)");
    println!(
        "{:>8}  {:>14} {:>14} {:>16}   {:>8} {:>8}",
        "size", "uma in place", "uma prefetch", "pinned+HtoD", "best/HtoD", "target"
    );
    for shift in [16u32, 18, 20, 22, 24, 26] {
        let len = 1usize << shift;
        let m = managed.alloc(len, 4096).unwrap();
        let p = pinned.alloc(len, 4096).unwrap();
        let d = device.alloc(len, 4096).unwrap();
        let host = |mem: &HostCudaMemory, r| {
            let ptr = mem.pointer(r).unwrap();
            // SAFETY: `r` is a live host-visible CUDA allocation of `len` bytes, used by this thread only.
            unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len) }
        };
        let (mut in_place, mut prefetched, mut copied) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..16u8 {
            host(&managed, m).fill(round); // the receive: the CPU writes the lease
            let t0 = Instant::now();
            // SAFETY: managed memory of this context, not written while the kernel runs.
            let a = unsafe { kernel.run(m.addr, len) }.unwrap();
            let t_in_place = t0.elapsed();

            host(&managed, m).fill(round);
            let t0 = Instant::now();
            managed.prefetch(m, true).unwrap();
            // SAFETY: as above.
            let b = unsafe { kernel.run(m.addr, len) }.unwrap();
            let t_prefetch = t0.elapsed();

            host(&pinned, p).fill(round);
            let t0 = Instant::now();
            device.copy_from_host(d, host(&pinned, p)).unwrap();
            // SAFETY: device memory of this context.
            let c = unsafe { kernel.run(d.addr, len) }.unwrap();
            let t_copy = t0.elapsed();
            assert!(a == b && b == c, "the three paths read the same bytes");
            if round > 0 {
                in_place.push(gbps(len, t_in_place));
                prefetched.push(gbps(len, t_prefetch));
                copied.push(gbps(len, t_copy));
            }
        }
        let (i, pf, c) = (median(in_place), median(prefetched), median(copied));
        println!(
            "{:>5} KiB  {:>11.2} GB/s {:>11.2} GB/s {:>13.2} GB/s   {:>7.2}x {:>8}",
            len >> 10,
            i,
            pf,
            c,
            i.max(pf) / c,
            "0.7x"
        );
        managed.free(m).unwrap();
        pinned.free(p).unwrap();
        device.free(d).unwrap();
    }
}

fn gbps(len: usize, t: Duration) -> f64 {
    len as f64 / t.as_secs_f64() / 1e9
}
