//! One harness per backend.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use zerohop_core::{Kind, PeerId};
use zerohop_std::tcp::{TcpConfig, TcpTransport};
use zerohop_std::{private_pool, Endpoint, EndpointConfig};

use crate::{Forge, Harness, Pair};

impl Forge for TcpTransport {
    fn forge(&mut self, peer: PeerId, frame: &[u8]) -> Result<(), zerohop_core::Error> {
        self.send_raw_frame(peer, frame)
            .map_err(|_| zerohop_core::Error::Backend("tcp: the forged frame did not go"))
    }
}

#[cfg(feature = "mock")]
impl<L: zerohop_backends::mock::Link, P> Forge for zerohop_backends::mock::MockTransport<L, P>
where
    P: std::ops::Deref<Target: zerohop_backends::HostBacked> + Clone,
{
    fn forge(&mut self, _: PeerId, frame: &[u8]) -> Result<(), zerohop_core::Error> {
        self.send_raw_frame(frame)
    }
}

#[cfg(feature = "gpudirect-verbs")]
impl<M: zerohop_backends::verbs::PayloadMemory> Forge
    for zerohop_backends::verbs::RdmaTransport<M>
{
    fn forge(&mut self, peer: PeerId, frame: &[u8]) -> Result<(), zerohop_core::Error> {
        self.send_raw_frame(peer, frame)
    }
}

impl Forge for zerohop_std::shm::LocalWire {
    fn forge(&mut self, peer: PeerId, frame: &[u8]) -> Result<(), zerohop_core::Error> {
        self.send_raw_frame(peer, frame)
    }
}

/// The same-host lane: two endpoints over loopback that move to shared memory.
#[derive(Debug)]
pub struct Shm;

impl Harness for Shm {
    type T = zerohop_std::shm::LocalWire;
    fn pair() -> Result<Pair<Self::T>, String> {
        use zerohop_std::shm::{LocalWire, ShmConfig, LANE_BIT};
        let config = TcpConfig {
            max_message: 4 << 20,
            idle_timeout: crate::IDLE,
            ..TcpConfig::default()
        };
        let shm = ShmConfig {
            ring_bytes: 1 << 20,
            required: true,
            ..ShmConfig::default()
        };
        let (a_pool, b_pool) = (
            private_pool(64 << 20).map_err(|e| e.to_string())?,
            private_pool(64 << 20).map_err(|e| e.to_string())?,
        );
        let mut b = LocalWire::new(Arc::clone(&b_pool), config, shm, Kind::Shm)
            .map_err(|e| e.to_string())?;
        let addr = b
            .listen("127.0.0.1:0".parse().expect("an address"))
            .map_err(|e| e.to_string())?;
        let a = LocalWire::new(Arc::clone(&a_pool), config, shm, Kind::Shm)
            .map_err(|e| e.to_string())?;
        let ep = |t| Endpoint::new(t, EndpointConfig::default()).map_err(|e| e.to_string());
        let (a, b) = (ep(a)?, ep(b)?);
        let dialed =
            TcpTransport::dial(addr, Duration::from_secs(5), true).map_err(|e| e.to_string())?;
        let tcp_peer = a.with(|t| t.attach(dialed)).map_err(|e| e.to_string())?;
        let to_b = a
            .wait_open(
                tcp_peer,
                zerohop_std::Deadline::after(Duration::from_secs(10)),
            )
            .map_err(|e| e.to_string())?;
        if to_b.0 & LANE_BIT == 0 {
            return Err("the peer stayed on tcp".into());
        }
        // b numbers its first lane 0 (with the lane bit).
        Ok(Pair {
            a,
            b,
            to_b,
            to_a: PeerId(LANE_BIT),
            a_pool,
            b_pool,
        })
    }
    fn max_message() -> usize {
        4 << 20
    }
}

/// Plain TCP over 127.0.0.1.
#[derive(Debug)]
pub struct Tcp;

/// TCP-wire pair over loopback with receive pools from `pool`.
pub fn tcp_pair(
    kind: Kind,
    pool: impl Fn() -> Result<Arc<zerohop_std::StdPool>, String>,
) -> Result<Pair<TcpTransport>, String> {
    let config = TcpConfig {
        max_message: 4 << 20,
        idle_timeout: crate::IDLE,
        ..TcpConfig::default()
    };
    let b_pool = pool()?;
    let a_pool = pool()?;
    let mut b = TcpTransport::new(Arc::clone(&b_pool), config, kind).unwrap();
    let addr = b.listen("127.0.0.1:0").map_err(|e| e.to_string())?;
    let mut a = TcpTransport::new(Arc::clone(&a_pool), config, kind).unwrap();
    let to_b = a
        .connect(addr, Duration::from_secs(5))
        .map_err(|e| e.to_string())?;
    let ep = |t| Endpoint::new(t, EndpointConfig::default()).map_err(|e| e.to_string());
    // b numbers its first accepted peer 0.
    Ok(Pair {
        a: ep(a)?,
        b: ep(b)?,
        to_b,
        to_a: PeerId(0),
        a_pool,
        b_pool,
    })
}

impl Harness for Tcp {
    type T = TcpTransport;
    fn pair() -> Result<Pair<TcpTransport>, String> {
        tcp_pair(Kind::Tcp, || {
            private_pool(64 << 20).map_err(|e| e.to_string())
        })
    }
    fn max_message() -> usize {
        4 << 20
    }
}

/// The mock link in one process.
#[cfg(feature = "mock")]
#[derive(Debug)]
pub struct Mock;

#[cfg(feature = "mock")]
mod mock_links {
    use zerohop_backends::mock::MockLink;
    pub const BYTES: usize = 8 << 20;
    // Statics, not boxes: an 8 MiB ring built on a test thread's stack would
    // overflow it. One per suite case that pairs (11 today), with room to
    // grow; running out is the harness's bug, not a host's lack, so it
    // fails the case rather than skipping it.
    static LINKS: [MockLink<BYTES>; 16] = [const { MockLink::new() }; 16];
    static NEXT: super::AtomicUsize = super::AtomicUsize::new(0);

    pub fn next() -> Result<&'static MockLink<BYTES>, String> {
        // Relaxed: a ticket counter; each link is handed out once.
        let i = NEXT.fetch_add(1, super::Ordering::Relaxed);
        match LINKS.get(i) {
            Some(l) => Ok(l),
            None => panic!("out of static mock links: raise the count in harness.rs"),
        }
    }
}

#[cfg(feature = "mock")]
impl Harness for Mock {
    type T = zerohop_backends::mock::MockTransport<
        zerohop_backends::mock::LinkEnd<'static, { mock_links::BYTES }>,
        Arc<zerohop_std::StdPool>,
    >;
    fn pair() -> Result<Pair<Self::T>, String> {
        use zerohop_backends::mock::MockTransport;
        let (a, b) = mock_links::next()?.ends();
        let a_pool = private_pool(64 << 20).map_err(|e| e.to_string())?;
        let b_pool = private_pool(64 << 20).map_err(|e| e.to_string())?;
        let ta = MockTransport::new(a, Arc::clone(&a_pool), Self::max_message());
        let tb = MockTransport::new(b, Arc::clone(&b_pool), Self::max_message());
        let ep = |t| Endpoint::new(t, EndpointConfig::default()).map_err(|e| e.to_string());
        Ok(Pair {
            a: ep(ta)?,
            b: ep(tb)?,
            to_b: PeerId(0),
            to_a: PeerId(0),
            a_pool,
            b_pool,
        })
    }
    fn max_message() -> usize {
        4 << 20
    }
}

/// The `uma` transport: the TCP wire into CUDA managed memory (skips without a GPU).
#[cfg(feature = "cuda-uma")]
#[derive(Debug)]
pub struct Uma;

#[cfg(feature = "cuda-uma")]
impl Harness for Uma {
    type T = TcpTransport;
    fn pair() -> Result<Pair<TcpTransport>, String> {
        tcp_pair(Kind::Uma, || {
            zerohop_std::managed_pool(256 << 20).map_err(|e| e.to_string())
        })
    }
    fn max_message() -> usize {
        4 << 20
    }
}

/// Where the RDMA tests connect: `$RXE_ADDR` in the Soft-RoCE VM, else
/// `$ZEROHOP_RDMA_ADDR` (an address of the RDMA device's netdev).
#[cfg(feature = "gpudirect-verbs")]
pub fn rdma_addr(port: u16) -> Result<std::net::SocketAddr, String> {
    let ip = std::env::var("RXE_ADDR")
        .or_else(|_| std::env::var("ZEROHOP_RDMA_ADDR"))
        .map_err(|_| {
            "no RDMA address: set ZEROHOP_RDMA_ADDR (the Soft-RoCE VM sets RXE_ADDR)".to_string()
        })?;
    format!("{ip}:{port}")
        .parse()
        .map_err(|e| format!("{ip}: {e}"))
}

/// RC queue pairs over the first RDMA device (skips where there is none).
#[cfg(feature = "gpudirect-verbs")]
#[derive(Debug)]
pub struct Rdma;

#[cfg(feature = "gpudirect-verbs")]
impl Harness for Rdma {
    type T = zerohop_backends::verbs::RdmaTransport;
    fn pair() -> Result<Pair<Self::T>, String> {
        use zerohop_backends::verbs::{Device, RdmaConfig, RdmaTransport};
        static PORT: AtomicUsize = AtomicUsize::new(18_000);
        let device = Device::open().map_err(|e| e.to_string())?;
        let config = RdmaConfig {
            max_message: Self::max_message(),
            recv_pool_bytes: 64 << 20,
            send_pool_bytes: 64 << 20,
            idle_timeout: crate::IDLE,
            ..RdmaConfig::default()
        };
        // Relaxed: a port counter, one per pair.
        let addr = rdma_addr(PORT.fetch_add(1, Ordering::Relaxed) as u16)?;
        let mut b = RdmaTransport::new(Arc::clone(&device), config).map_err(|e| e.to_string())?;
        b.listen(addr).map_err(|e| e.to_string())?;
        let b = Endpoint::new(b, EndpointConfig::default()).map_err(|e| e.to_string())?;
        let mut a = RdmaTransport::new(device, config).map_err(|e| e.to_string())?;
        // The listener accepts from its progress thread while this side connects.
        let to_b = a
            .connect(addr, std::time::Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        let (a_pool, b_pool) = (Arc::clone(a.send_pool()), b.with(|t| Arc::clone(t.pool())));
        let a = Endpoint::new(a, EndpointConfig::default()).map_err(|e| e.to_string())?;
        let t0 = std::time::Instant::now();
        while b.with(|t| t.peer_count()) == 0 {
            if t0.elapsed() > Duration::from_secs(10) {
                return Err("the listener never saw the connection established".into());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(Pair {
            a,
            b,
            to_b,
            to_a: PeerId(0),
            a_pool,
            b_pool,
        })
    }
    fn max_message() -> usize {
        4 << 20
    }
}
