//! Peers, events, and the buffers messages live in.

use std::fmt;
use std::net::SocketAddr;

use zerohop_backends::{host_bytes, host_bytes_mut};
use zerohop_core::{MemKind, PeerId};
use zerohop_std::StdLease;

/// A connected peer, as this endpoint names it. Copy it freely; an error
/// about a peer gives its address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Peer(pub(crate) PeerId);

impl Peer {
    /// The transport's number for it (unique among this endpoint's peers,
    /// for as long as it is connected).
    pub fn id(self) -> u32 {
        (self.0).0
    }
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// What [`Endpoint::next_event`](crate::Endpoint::next_event) and
/// [`Endpoint::events`](crate::Endpoint::events) give.
#[derive(Debug)]
#[non_exhaustive]
pub enum Event {
    /// A peer connected to this endpoint's listener. (A peer this side
    /// connects to is the answer of [`connect`](crate::Endpoint::connect).)
    Connected {
        /// The peer.
        peer: Peer,
        /// Where it connected from.
        addr: SocketAddr,
    },
    /// A message from a peer.
    Message(Message),
    /// The peer closed cleanly: every message it sent was delivered.
    Closed {
        /// The peer.
        peer: Peer,
        /// Its address.
        addr: Option<SocketAddr>,
    },
    /// The peer went away without closing, or broke the protocol: nothing
    /// after the fault was delivered; `why` says which.
    Lost {
        /// The peer.
        peer: Peer,
        /// Its address.
        addr: Option<SocketAddr>,
        /// What happened (`Error::Peer`, naming the address).
        why: crate::Error,
    },
}

/// A buffer of one of the endpoint's pools: host memory (tcp, rdma), CUDA
/// managed memory (uma), or GPU device memory (gpudirect; shm's device pool).
#[derive(Debug)]
pub(crate) enum Buf {
    Host(StdLease),
    /// Device memory that same-host peers exchange by CUDA IPC.
    #[cfg(feature = "cuda-uma")]
    Device(zerohop_backends::cuda::DeviceLease),
    #[cfg(all(feature = "gpudirect-verbs", feature = "cuda-uma"))]
    Gpu(zerohop_core::Lease<std::sync::Arc<zerohop_backends::verbs::GpuPool>>),
}

impl Buf {
    fn len(&self) -> usize {
        match self {
            Buf::Host(l) => l.len(),
            #[cfg(feature = "cuda-uma")]
            Buf::Device(l) => l.len(),
            #[cfg(all(feature = "gpudirect-verbs", feature = "cuda-uma"))]
            Buf::Gpu(l) => l.len(),
        }
    }

    fn memory(&self) -> MemKind {
        match self {
            Buf::Host(l) => l.buffer().kind,
            #[cfg(feature = "cuda-uma")]
            Buf::Device(_) => MemKind::Device,
            #[cfg(all(feature = "gpudirect-verbs", feature = "cuda-uma"))]
            Buf::Gpu(l) => l.buffer().kind,
        }
    }

    fn bytes(&self) -> Option<&[u8]> {
        match self {
            Buf::Host(l) => Some(host_bytes(l)),
            #[cfg(feature = "cuda-uma")]
            Buf::Device(_) => None,
            #[cfg(all(feature = "gpudirect-verbs", feature = "cuda-uma"))]
            Buf::Gpu(_) => None,
        }
    }

    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        match self {
            Buf::Host(l) => Some(host_bytes_mut(l)),
            #[cfg(feature = "cuda-uma")]
            Buf::Device(_) => None,
            #[cfg(all(feature = "gpudirect-verbs", feature = "cuda-uma"))]
            Buf::Gpu(_) => None,
        }
    }

    fn device_ptr(&self) -> Option<u64> {
        let ptr = match self {
            Buf::Host(l) => l.device_ptr(),
            #[cfg(feature = "cuda-uma")]
            Buf::Device(l) => l.device_ptr(),
            #[cfg(all(feature = "gpudirect-verbs", feature = "cuda-uma"))]
            Buf::Gpu(l) => l.device_ptr(),
        };
        matches!(self.memory(), MemKind::Managed | MemKind::Device).then_some(ptr)
    }
}

/// A received message: who sent it, and the pool buffer it landed in
/// (given back to the pool, and its bytes to the peer as credit, when
/// dropped: keep it no longer than needed).
#[derive(Debug)]
pub struct Message {
    pub(crate) peer: Peer,
    pub(crate) buf: Buf,
}

impl Message {
    /// The sender.
    pub fn peer(&self) -> Peer {
        self.peer
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its bytes, where the CPU can read them in place: host memory and
    /// CUDA managed memory. `None` for GPU device memory: hand
    /// [`device_ptr`](Self::device_ptr) to a kernel, or copy it out with
    /// [`Endpoint::copy_out`](crate::Endpoint::copy_out).
    pub fn bytes(&self) -> Option<&[u8]> {
        self.buf.bytes()
    }

    /// Its address for a GPU kernel, where a kernel can read it in place:
    /// CUDA managed memory (uma) and device memory (gpudirect, and a device
    /// message from a same-host peer over shm); `None` in host memory.
    pub fn device_ptr(&self) -> Option<u64> {
        self.buf.device_ptr()
    }

    /// What memory it lies in.
    pub fn memory(&self) -> MemKind {
        self.buf.memory()
    }

    /// The buffer, to send on as it is (an echo, a relay) without a copy.
    pub fn into_buffer(self) -> SendBuffer {
        SendBuffer { buf: self.buf }
    }
}

/// A buffer to fill in place and send without a copy (the Go package's
/// `AllocBuffer`): from [`Endpoint::lease`](crate::Endpoint::lease), sent
/// with [`Endpoint::send_buffer`](crate::Endpoint::send_buffer).
#[derive(Debug)]
pub struct SendBuffer {
    pub(crate) buf: Buf,
}

impl SendBuffer {
    /// The message's length.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its bytes to fill, where the CPU can write them (host and managed
    /// memory); `None` for GPU device memory (fill it from a kernel through
    /// [`device_ptr`](Self::device_ptr)).
    pub fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        self.buf.bytes_mut()
    }

    /// Its address for a GPU kernel (managed and device memory).
    pub fn device_ptr(&self) -> Option<u64> {
        self.buf.device_ptr()
    }

    /// Shortens (or lengthens, within its capacity) the message.
    pub fn set_len(&mut self, len: usize) -> crate::Result<()> {
        let r = match &mut self.buf {
            Buf::Host(l) => l.set_len(len),
            #[cfg(feature = "cuda-uma")]
            Buf::Device(l) => l.set_len(len),
            #[cfg(all(feature = "gpudirect-verbs", feature = "cuda-uma"))]
            Buf::Gpu(l) => l.set_len(len),
        };
        r.map_err(crate::Error::Endpoint)
    }
}
