//! CUDA memory, DMA-buf export and the in-place checksum kernel, on a real GPU.
//! Without a driver (CI) the GPU tests print SKIPPED, and the no-driver
//! behaviour itself is what gets tested.
#![cfg(feature = "cuda-uma")]

use std::os::fd::{AsFd, AsRawFd};

use zerohop_backends::cuda::{
    cpu_checksum, driver_present, Checksum, CudaError, DeviceMemory, DmaBuf, Gpu, HostCudaMemory,
};
use zerohop_core::{MemKind, Prereq, Probe, RawMemory, Status};

fn gpu_or_skip(test: &str) -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            None
        }
    }
}

#[test]
fn probe_and_open_never_panic_and_say_why() {
    let mut probe = Probe::new();
    zerohop_backends::cuda::probe(&mut probe);
    match (driver_present(), Gpu::open(0)) {
        (false, r) => {
            assert_eq!(r.unwrap_err(), CudaError::NoDriver);
            let Status::Missing(why) = probe.get(Prereq::CudaDriver) else {
                panic!("cuda-driver must be missing")
            };
            assert!(why.as_str().contains("libcuda"), "{why}");
            assert!(!probe.has(Prereq::CudaDevice));
            assert!(!probe.has(Prereq::GpuDmabuf));
        }
        (true, Ok(gpu)) => {
            assert!(
                probe.has(Prereq::CudaDriver),
                "{:?}",
                probe.get(Prereq::CudaDriver)
            );
            assert!(
                probe.has(Prereq::CudaDevice),
                "{:?}",
                probe.get(Prereq::CudaDevice)
            );
            eprintln!(
                "probe on {}: {:?} / {:?}",
                gpu.name().unwrap(),
                probe.get(Prereq::CudaDevice),
                probe.get(Prereq::GpuDmabuf)
            );
        }
        (true, Err(e)) => assert!(
            !probe.has(Prereq::CudaDevice),
            "device missing ({e}) but probe says present"
        ),
    }
    let far = Gpu::open(4096).map(|_| ()).unwrap_err();
    assert!(
        matches!(
            far,
            CudaError::NoDriver | CudaError::NoDevice { ordinal: 4096, .. }
        ),
        "{far}"
    );
}

#[test]
fn managed_memory_is_written_by_the_cpu_and_checksummed_in_place_by_the_gpu() {
    let Some(gpu) = gpu_or_skip("managed_memory_..._in_place_by_the_gpu") else {
        return;
    };
    let mem = HostCudaMemory::managed(&gpu);
    let kernel = Checksum::load(&gpu).expect("the embedded PTX loads");
    for len in [1usize, 255, 4096, 1 << 20, 3 << 20] {
        let r = mem.alloc(len, 4096).unwrap();
        assert_eq!(r.kind, MemKind::Managed);
        assert_eq!(r.addr % 4096, 0);
        let p = mem.pointer(r).unwrap();
        // SAFETY: `r` is a live managed allocation of `len` bytes, host-mapped.
        let bytes = unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), len) };
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i * 7 + len) as u8;
        }
        let want = cpu_checksum(bytes);
        // SAFETY: managed memory of this context, not touched until the call returns.
        let got = unsafe { kernel.run(r.addr, len) }.unwrap();
        assert_eq!(got, want, "GPU checksum of {len} bytes in managed memory");
        mem.prefetch(r, true).unwrap();
        // SAFETY: as above.
        let after_prefetch = unsafe { kernel.run(r.addr, len) }.unwrap();
        assert_eq!(after_prefetch, want, "after prefetch to the device");
        mem.free(r).unwrap();
    }
    assert!(mem
        .free(zerohop_core::Region {
            addr: 0x1000,
            len: 1,
            kind: MemKind::Managed
        })
        .is_err());
}

#[test]
fn device_memory_exports_as_a_dmabuf_that_closes_on_drop() {
    let Some(gpu) = gpu_or_skip("device_memory_exports_as_a_dmabuf") else {
        return;
    };
    let dev = DeviceMemory::new(&gpu);
    let r = dev.alloc(2 << 20, 1 << 16).unwrap();
    assert_eq!(r.kind, MemKind::Device);
    assert!(!dev.host_visible());
    let buf = DmaBuf::export(&gpu, r).expect("cuMemAlloc memory exports");
    assert_eq!(
        buf.size_from_fd().unwrap(),
        2 << 20,
        "the DMA-buf spans the whole range"
    );
    assert_eq!(buf.offset_of(r.addr + 12345), Some(12345));
    assert_eq!(buf.offset_of(r.addr + (2 << 20)), None);
    let raw = buf.as_fd().as_raw_fd();
    let ino = fstat_ino(raw).expect("open while the DmaBuf lives");
    drop(buf);
    assert_ne!(
        fstat_ino(raw),
        Some(ino),
        "the descriptor closed with the DmaBuf"
    );
    // Round trip through device memory, and a kernel checksum of it.
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 13) as u8).collect();
    dev.copy_from_host(r, &data).unwrap();
    let mut back = vec![0u8; 4096];
    dev.copy_to_host(r, &mut back).unwrap();
    assert_eq!(back, data);
    let kernel = Checksum::load(&gpu).unwrap();
    // SAFETY: live device memory of this context.
    let on_device = unsafe { kernel.run(r.addr, 4096) }.unwrap();
    assert_eq!(on_device, cpu_checksum(&data));
    dev.free(r).unwrap();
}

fn fstat_ino(fd: i32) -> Option<(u64, u64)> {
    // SAFETY: fstat writes into a zeroed struct we own; a closed fd just fails.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some((st.st_dev, st.st_ino))
}

#[test]
fn managed_and_pinned_memory_do_not_export_and_say_why() {
    let Some(gpu) = gpu_or_skip("managed_and_pinned_memory_do_not_export") else {
        return;
    };
    for (mem, kind) in [
        (HostCudaMemory::managed(&gpu), MemKind::Managed),
        (HostCudaMemory::pinned(&gpu), MemKind::HostPinned),
    ] {
        let r = mem.alloc(2 << 20, 1 << 16).unwrap();
        let e = DmaBuf::export(&gpu, r).unwrap_err();
        let CudaError::NotDeviceMemory { kind: k, result } = e.clone() else {
            panic!("{e}")
        };
        assert_eq!(k, kind);
        eprintln!(
            "{} memory: driver answered {result:?}; message: {e}",
            kind.name()
        );
        assert!(e.to_string().contains("cannot register it"));
        mem.free(r).unwrap();
    }
    let dev = DeviceMemory::new(&gpu);
    let r = dev.alloc(8192, 4096).unwrap();
    let odd = zerohop_core::Region {
        addr: r.addr + 8,
        len: 4096,
        kind: MemKind::Device,
    };
    assert_eq!(
        DmaBuf::export(&gpu, odd).unwrap_err(),
        CudaError::Unaligned {
            addr: r.addr + 8,
            len: 4096
        }
    );
    dev.free(r).unwrap();
}

/// The copies the gpudirect wire makes on received payloads (reassembling
/// fragments, fragmenting a lease): device to device, across two sources,
/// at offsets, and refused outside the allocations.
#[test]
fn device_to_device_copies_reassemble_at_offsets_and_refuse_out_of_range() {
    let Some(gpu) = gpu_or_skip("device_to_device_copies") else {
        return;
    };
    let (recv, send) = (DeviceMemory::new(&gpu), DeviceMemory::new(&gpu));
    let whole = recv.alloc(3 << 16, 4096).unwrap();
    let frag = send.alloc(1 << 16, 4096).unwrap();
    let data: Vec<u8> = (0..3u32 << 16).map(|i| (i ^ (i >> 9)) as u8).collect();
    // Three fragments through one staging buffer of the other source, as a
    // receive ring's buffers are copied into a message's lease.
    for (k, chunk) in data.chunks(1 << 16).enumerate() {
        send.copy_from_host(frag, chunk).unwrap();
        let at = zerohop_core::Region {
            addr: whole.addr + (k << 16) as u64,
            len: chunk.len(),
            ..whole
        };
        recv.copy_from_device(at, &send, frag, chunk.len()).unwrap();
    }
    let mut back = vec![0u8; data.len()];
    recv.copy_to_host(whole, &mut back).unwrap();
    assert!(back == data, "reassembled on the device, byte for byte");
    // Past the end of the source, or from memory it does not own: refused, typed.
    assert!(recv
        .copy_from_device(whole, &send, frag, (1 << 16) + 1)
        .is_err());
    assert!(recv.copy_from_device(whole, &recv, frag, 16).is_err());
    recv.free(whole).unwrap();
    send.free(frag).unwrap();
}
