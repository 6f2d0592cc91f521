//! Building endpoints of each kind, in one process or across processes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use zerohop_core::{Error, Kind, PeerId};
use zerohop_std::tcp::{TcpConfig, TcpTransport};
use zerohop_std::{heap_pool, Endpoint, EndpointConfig, StdPool};

/// The receive pool for a kind (heap for tcp, CUDA managed memory for uma).
pub fn pool_for(kind: Kind, budget: usize) -> Result<Arc<StdPool>, Error> {
    match kind {
        #[cfg(feature = "cuda-uma")]
        Kind::Uma => zerohop_std::managed_pool(budget),
        _ => heap_pool(budget),
    }
}

/// A TCP-wire endpoint (kind tcp or uma) listening on `addr`.
pub fn tcp_listen(
    kind: Kind,
    addr: &str,
    budget: usize,
    ep: &EndpointConfig,
) -> Result<(Endpoint<TcpTransport>, SocketAddr), Box<dyn std::error::Error>> {
    let mut t = TcpTransport::new(pool_for(kind, budget)?, TcpConfig::default(), kind);
    let bound = t.listen(addr)?;
    Ok((Endpoint::new(t, *ep)?, bound))
}

/// A TCP-wire endpoint (kind tcp or uma) connected to `addr`.
pub fn tcp_connect(
    kind: Kind,
    addr: SocketAddr,
    budget: usize,
    ep: &EndpointConfig,
) -> Result<(Endpoint<TcpTransport>, PeerId), Box<dyn std::error::Error>> {
    let mut t = TcpTransport::new(pool_for(kind, budget)?, TcpConfig::default(), kind);
    let peer = t.connect(addr, Duration::from_secs(10))?;
    Ok((Endpoint::new(t, *ep)?, peer))
}

/// `n` connections to the listener at `addr` that say Hello and nothing
/// more (one each: no second connection for striping), once every one is
/// open. Keep the transport: dropping it closes them.
pub fn idle_peers(addr: SocketAddr, n: usize) -> Result<TcpTransport, Box<dyn std::error::Error>> {
    let config = TcpConfig {
        stripe_min: None,
        ..TcpConfig::default()
    };
    let mut t = TcpTransport::new(heap_pool(n.max(1) << 12)?, config, Kind::Tcp);
    for i in 0..n {
        t.connect(addr, Duration::from_secs(10))
            .map_err(|e| format!("idle connection {i} of {n} to {addr}: {e}"))?;
    }
    let until = std::time::Instant::now() + Duration::from_secs(60);
    use zerohop_core::Transport;
    while t.peer_count() < n {
        if std::time::Instant::now() > until {
            return Err(format!(
                "{} of {n} idle connections to {addr} opened",
                t.peer_count()
            )
            .into());
        }
        t.progress()?;
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(t)
}

#[cfg(feature = "mock")]
pub mod mock {
    //! The mock link in one process: one static link per run.
    use super::*;
    use zerohop_backends::mock::{LinkEnd, MockLink, MockTransport};

    /// Ring bytes per direction: room for one 4 MiB message and its header.
    pub const LINK_BYTES: usize = 8 << 20;
    pub type MockWire = MockTransport<LinkEnd<'static, LINK_BYTES>, Arc<StdPool>>;

    pub fn pair(
        budget: usize,
        ep: &EndpointConfig,
    ) -> Result<(Endpoint<MockWire>, Endpoint<MockWire>), Box<dyn std::error::Error>> {
        // 16 MiB of rings: a static (zeroed .bss), never a stack temporary.
        static LINK: MockLink<LINK_BYTES> = MockLink::new();
        let (a, b) = LINK.ends();
        let max = MockLink::<LINK_BYTES>::max_payload();
        let ta = MockTransport::new(a, heap_pool(budget)?, max);
        let tb = MockTransport::new(b, heap_pool(budget)?, max);
        Ok((Endpoint::new(ta, *ep)?, Endpoint::new(tb, *ep)?))
    }
}

#[cfg(feature = "gpudirect-verbs")]
pub mod rdma {
    //! RC queue pairs over the RDMA device (`$ZEROHOP_RDMA_DEVICE`, else the first).
    use super::*;
    use zerohop_backends::verbs::{Device, PayloadMemory, RdmaConfig, RdmaTransport};

    type BoxError = Box<dyn std::error::Error>;

    /// The address in-process runs listen on: `$ZEROHOP_RDMA_ADDR`, else
    /// `$RXE_ADDR` (set in the Soft-RoCE VM); it must belong to the RDMA device's netdev.
    pub fn local_addr() -> Result<SocketAddr, String> {
        let ip = std::env::var("ZEROHOP_RDMA_ADDR")
            .or_else(|_| std::env::var("RXE_ADDR"))
            .map_err(|_| {
                "set ZEROHOP_RDMA_ADDR to an IP address of the RDMA device's network interface"
                    .to_string()
            })?;
        format!("{ip}:7471")
            .parse()
            .map_err(|e| format!("ZEROHOP_RDMA_ADDR={ip}: {e}"))
    }

    fn config(budget: usize) -> RdmaConfig {
        RdmaConfig {
            recv_pool_bytes: budget.min(1 << 30),
            send_pool_bytes: budget.min(1 << 30),
            ..RdmaConfig::default()
        }
    }

    pub fn listen<M: PayloadMemory>(
        addr: SocketAddr,
        budget: usize,
        ep: &EndpointConfig,
        memory: M,
    ) -> Result<Endpoint<RdmaTransport<M>>, Box<dyn std::error::Error>> {
        let mut t = RdmaTransport::with_memory(Device::open()?, config(budget), memory)?;
        t.listen(addr)?;
        Ok(Endpoint::new(t, *ep)?)
    }

    pub fn connect<M: PayloadMemory>(
        addr: SocketAddr,
        budget: usize,
        ep: &EndpointConfig,
        memory: M,
    ) -> Result<(Endpoint<RdmaTransport<M>>, PeerId), BoxError> {
        let mut t = RdmaTransport::with_memory(Device::open()?, config(budget), memory)?;
        let peer = t.connect(addr)?;
        Ok((Endpoint::new(t, *ep)?, peer))
    }

    /// The `gpudirect` kind's payload memory: GPU 0 (`$ZEROHOP_CUDA_DEVICE`
    /// is not consulted: one GPU per process, the first).
    #[cfg(feature = "cuda-uma")]
    pub fn gpu_memory() -> Result<zerohop_backends::verbs::GpuPayload, Box<dyn std::error::Error>> {
        let gpu = zerohop_backends::cuda::Gpu::open(0)?;
        Ok(zerohop_backends::verbs::GpuPayload::new(gpu))
    }
}
