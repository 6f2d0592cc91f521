//! The `uma` transport: the TCP wire receiving into CUDA managed memory, each
//! message checksummed by a GPU kernel where it landed.
#![cfg(feature = "cuda-uma")]

use std::time::Duration;

use zerohop_backends::cuda::{cpu_checksum, Checksum, Gpu};
use zerohop_backends::host_bytes;
use zerohop_core::{pick, Kind, Preference, Prereq, Status};
use zerohop_std::tcp::{TcpConfig, TcpTransport};
use zerohop_std::{managed_pool, private_pool, probe_host, Deadline, Endpoint, EndpointConfig};

#[test]
fn without_a_driver_uma_is_refused_by_name_and_auto_falls_to_tcp() {
    let probe = probe_host();
    if probe.has(Prereq::CudaDriver) {
        eprintln!("SKIPPED without_a_driver...: this host has a CUDA driver");
        return;
    }
    assert!(matches!(probe.get(Prereq::CudaDriver), Status::Missing(_)));
    let e = pick(Preference::Only(Kind::Uma), &probe).unwrap_err();
    assert!(e.to_string().contains("uma: missing cuda-driver"), "{e}");
    let auto = pick(Preference::Auto, &probe).unwrap();
    assert_ne!(auto.kind, Kind::Uma);
    assert!(managed_pool(1 << 20).is_err(), "a typed error, not a panic");
}

#[test]
fn messages_land_in_managed_memory_and_the_gpu_checksums_them_in_place() {
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => return eprintln!("SKIPPED messages_land_in_managed_memory...: {e}"),
    };
    let kernel = Checksum::load(&gpu).unwrap();
    let pool = managed_pool(1 << 30).unwrap();
    let mut rx = TcpTransport::new(pool.clone(), TcpConfig::default(), Kind::Uma).unwrap();
    let addr = rx.listen("127.0.0.1:0").unwrap();
    let rx = Endpoint::new(rx, EndpointConfig::default()).unwrap();
    let mut tx = TcpTransport::new(
        private_pool(256 << 20).unwrap(),
        TcpConfig::default(),
        Kind::Tcp,
    )
    .unwrap();
    let peer = tx.connect(addr, Duration::from_secs(5)).unwrap();
    let tx = Endpoint::new(tx, EndpointConfig::default()).unwrap();
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let sizes: Vec<usize> = (0..300)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (1 + (x as usize % (4 << 20))) >> (x as usize % 12)
        })
        .collect();
    std::thread::scope(|s| {
        let sizes = &sizes;
        s.spawn(move || {
            for (i, &len) in sizes.iter().enumerate() {
                let m: Vec<u8> = (0..len).map(|k| (k * 31 + i) as u8).collect();
                tx.send(peer, &m, Deadline::after(Duration::from_secs(30)), None)
                    .unwrap();
            }
            // A send is queued, not yet delivered: close flushes (a drop would not).
            tx.close(Deadline::after(Duration::from_secs(30))).unwrap();
        });
        for (i, &len) in sizes.iter().enumerate() {
            let r = rx
                .recv(Deadline::after(Duration::from_secs(30)), None)
                .unwrap();
            assert_eq!(r.lease.region().kind, zerohop_core::MemKind::Managed);
            let cpu = cpu_checksum(host_bytes(&r.lease));
            // SAFETY: the lease is managed memory of GPU 0, held (not written) until the call returns.
            let gpu_sum = unsafe { kernel.run(r.lease.device_ptr(), r.lease.len()) }.unwrap();
            assert_eq!(
                gpu_sum, cpu,
                "message {i} ({len} bytes): GPU checksum in place equals the CPU's"
            );
        }
    });
    assert_eq!(pool.used_bytes(), 0);
    eprintln!(
        "uma: {} messages, up to 4 MiB, checksummed in place by the GPU",
        sizes.len()
    );
}
