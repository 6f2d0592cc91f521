//! How a segment reaches the other process: the side that offered listens
//! on an abstract Unix socket named by its offer; the side that took the
//! offer connects, and sends a small setup message with three descriptors
//! (SCM_RIGHTS): the memfd and the two doorbells (eventfds). The connection
//! then stays open for the lane's life: its hang-up is how each side learns
//! that the other died (SIGKILL included), at once.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use zerohop_core::session::HostOffer;

use super::host::socket_name;

const MAGIC: [u8; 4] = *b"ZHSU";
const VERSION: u32 = 1;
const SETUP_BYTES: usize = 12;

/// Connections the lane socket queues before a dial finds it full (and
/// is tried again: see `shm::DIAL_RETRY_FOR`). Its owner takes them as they
/// come, so only a flood or a process out of descriptors fills it.
const BACKLOG: i32 = 128;

/// Where an offering side takes segments.
#[derive(Debug)]
pub(crate) struct LaneListener {
    listener: UnixListener,
}

impl LaneListener {
    /// Listens on the abstract socket `offer` names (nothing in the file
    /// system: it goes with the process).
    pub(crate) fn bind(offer: &HostOffer) -> io::Result<LaneListener> {
        let (s, addr) = lane_socket(offer)?;
        rustix::net::bind(&s, &addr)?;
        rustix::net::listen(&s, BACKLOG)?;
        Ok(LaneListener {
            listener: UnixListener::from(s),
        })
    }

    /// A connection waiting to be taken, if one is.
    pub(crate) fn accept(&self) -> io::Result<Option<UnixStream>> {
        match self.listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(true)?;
                Ok(Some(s))
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Its descriptor (for poll).
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.listener.as_fd()
    }
}

/// What the taking side sends.
#[derive(Debug)]
pub(crate) struct Setup {
    /// The connection's Hello token on the usual wire: which peer this is.
    pub(crate) token: u32,
    /// The segment's memfd.
    pub(crate) segment: OwnedFd,
    /// The doorbell that wakes the offering side (it polls this one).
    pub(crate) bell_offerer: OwnedFd,
    /// The doorbell that wakes the taking side.
    pub(crate) bell_taker: OwnedFd,
}

/// Connects to the offering side's socket: the lane's link, once
/// [`send_setup`] has sent the setup on it.
///
/// Non-blocking: an offering side whose backlog is full (out of descriptors
/// a while, or flooded: any local process can connect to an abstract
/// socket) refuses it at once with `WouldBlock` (EAGAIN), which the caller
/// retries a while, instead of waiting with its lock held.
pub(crate) fn dial(offer: &HostOffer) -> io::Result<UnixStream> {
    let (s, addr) = lane_socket(offer)?;
    rustix::net::connect(&s, &addr)?;
    Ok(UnixStream::from(s))
}

/// A fresh non-blocking Unix stream socket, and the abstract address of the
/// lane socket `offer` names (to bind, or to dial).
fn lane_socket(offer: &HostOffer) -> io::Result<(OwnedFd, rustix::net::SocketAddrUnix)> {
    let s = rustix::net::socket_with(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::STREAM,
        rustix::net::SocketFlags::NONBLOCK | rustix::net::SocketFlags::CLOEXEC,
        None,
    )?;
    let addr = rustix::net::SocketAddrUnix::new_abstract_name(socket_name(offer).as_bytes())?;
    Ok((s, addr))
}

/// Sends the offering side, on the link [`dial`] made, the segment and the
/// doorbells, for the peer `token` names.
pub(crate) fn send_setup(
    link: &UnixStream,
    token: u32,
    segment: BorrowedFd<'_>,
    bell_offerer: BorrowedFd<'_>,
    bell_taker: BorrowedFd<'_>,
) -> io::Result<()> {
    let msg = setup_message(token);
    let fds = [segment, bell_offerer, bell_taker];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(3))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other(
            "descriptors do not fit the control buffer",
        ));
    }
    let n = rustix::net::sendmsg(
        link,
        &[IoSlice::new(&msg)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    if n != SETUP_BYTES {
        return Err(io::Error::other("the lane setup went in part"));
    }
    Ok(())
}

/// A setup's bytes, for the peer `token` names.
fn setup_message(token: u32) -> [u8; SETUP_BYTES] {
    let mut msg = [0u8; SETUP_BYTES];
    msg[..4].copy_from_slice(&MAGIC);
    msg[4..8].copy_from_slice(&VERSION.to_le_bytes());
    msg[8..12].copy_from_slice(&token.to_le_bytes());
    msg
}

/// What a look at a taken connection found.
#[derive(Debug)]
pub(crate) enum SetupRead {
    /// A whole setup with its three descriptors, now this process's.
    Ready(Setup),
    /// Nothing yet.
    NotYet,
    /// A setup whose descriptors this process has no room for (EMFILE):
    /// it stays queued for a later look.
    NoRoom,
}

fn refused(why: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

/// Reads a setup from a taken connection. Anything but a whole setup with
/// its three descriptors is refused.
pub(crate) fn recv_setup(s: &UnixStream) -> io::Result<SetupRead> {
    // Descriptors that do not fit the process are dropped by the kernel as
    // it hands a message over, and a setup taken so would be lost for good.
    // So peek: the descriptors come as copies, and the message stays queued
    // until they all came.
    let mut msg = [0u8; SETUP_BYTES];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(3))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let peeked = match rustix::net::recvmsg(
        s,
        &mut [IoSliceMut::new(&mut msg)],
        &mut control,
        RecvFlags::DONTWAIT | RecvFlags::PEEK | RecvFlags::CMSG_CLOEXEC,
    ) {
        Ok(r) => r,
        Err(rustix::io::Errno::AGAIN) => return Ok(SetupRead::NotYet),
        Err(e) => return Err(e.into()),
    };
    let mut fds: Vec<OwnedFd> = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = m {
            fds.extend(rights);
        }
    }
    if peeked.bytes == 0 {
        return Err(refused("the peer hung up before its lane setup"));
    }
    // One message of SETUP_BYTES, sent at once: a shorter one is no setup.
    if peeked.bytes != SETUP_BYTES || msg[..4] != MAGIC {
        return Err(refused("not a lane setup"));
    }
    if u32::from_le_bytes([msg[4], msg[5], msg[6], msg[7]]) != VERSION {
        return Err(refused("a lane setup of another version"));
    }
    if peeked.flags.contains(ReturnFlags::CTRUNC) {
        // Cut short with fewer than three: the process is out of
        // descriptors. With three or more (the buffer, rounded up to its
        // alignment, has room for a few more): more were sent than a setup has.
        return match fds.len() {
            0..3 => Ok(SetupRead::NoRoom),
            _ => Err(refused("a lane setup with more than three descriptors")),
        };
    }
    let token = u32::from_le_bytes([msg[8], msg[9], msg[10], msg[11]]);
    let [segment, bell_offerer, bell_taker]: [OwnedFd; 3] = fds
        .try_into()
        .map_err(|_| refused("a lane setup without exactly three descriptors"))?;
    // Take it off the queue; its descriptors are ours already (the kernel
    // drops the queued ones, asked for no room).
    let mut taken = [0u8; SETUP_BYTES];
    let r = rustix::net::recvmsg(
        s,
        &mut [IoSliceMut::new(&mut taken)],
        &mut RecvAncillaryBuffer::default(),
        RecvFlags::DONTWAIT,
    )?;
    if r.bytes != SETUP_BYTES || taken != msg {
        return Err(refused("the lane setup changed between two reads"));
    }
    Ok(SetupRead::Ready(Setup {
        token,
        segment,
        bell_offerer,
        bell_taker,
    }))
}

/// A doorbell: an eventfd, non-blocking.
pub(crate) fn bell() -> io::Result<OwnedFd> {
    Ok(rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
    )?)
}

/// Rings a doorbell (a full counter already holds a pending ring).
pub(crate) fn ring(bell: BorrowedFd<'_>) {
    let _ = rustix::io::write(bell, &1u64.to_ne_bytes());
}

/// Takes a doorbell's rings, if any.
pub(crate) fn drain(bell: BorrowedFd<'_>) {
    let mut b = [0u8; 8];
    let _ = rustix::io::read(bell, &mut b);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::SocketAddr as UnixAddr;

    fn offer(nonce: u32) -> HostOffer {
        HostOffer {
            host: 0xABCD,
            pid: std::process::id(),
            nonce,
        }
    }

    #[test]
    fn a_setup_crosses_with_its_descriptors_and_strangers_are_refused() {
        let o = offer(0x5E70);
        let l = LaneListener::bind(&o).unwrap();
        assert!(l.accept().unwrap().is_none());
        let seg = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let (b1, b2) = (bell().unwrap(), bell().unwrap());
        let link = dial(&o).unwrap();
        send_setup(&link, 0x77, seg.as_fd(), b1.as_fd(), b2.as_fd()).unwrap();
        let taken = l.accept().unwrap().expect("a connection");
        let SetupRead::Ready(setup) = recv_setup(&taken).unwrap() else {
            panic!("the setup")
        };
        assert_eq!(setup.token, 0x77);
        // Taken off the queue: nothing more comes.
        assert!(matches!(recv_setup(&taken).unwrap(), SetupRead::NotYet));
        // The doorbells are the same eventfds: a ring on one end is seen on the other.
        ring(b1.as_fd());
        let mut v = [0u8; 8];
        assert_eq!(rustix::io::read(&setup.bell_offerer, &mut v).unwrap(), 8);
        assert_eq!(u64::from_ne_bytes(v), 1);
        drop(link);
        // A stranger writing garbage on the socket is refused, typed.
        let mut s =
            UnixStream::connect_addr(&UnixAddr::from_abstract_name(socket_name(&o)).unwrap())
                .unwrap();
        s.write_all(b"GET / HTTP/1.1\r\n").unwrap();
        let taken = l.accept().unwrap().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let e = recv_setup(&taken).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        // Nothing sent yet is "not here yet".
        let _s2 = UnixStream::connect_addr(&UnixAddr::from_abstract_name(socket_name(&o)).unwrap())
            .unwrap();
        let taken = l.accept().unwrap().unwrap();
        assert!(matches!(recv_setup(&taken).unwrap(), SetupRead::NotYet));
        // One that hangs up before its setup is refused.
        drop(_s2);
        assert_eq!(
            recv_setup(&taken).unwrap_err().to_string(),
            "the peer hung up before its lane setup"
        );
    }

    /// An offering side whose backlog is full refuses a dial at once,
    /// typed as "would block" (what the taking side retries), and takes
    /// one again once a connection is accepted.
    #[test]
    fn a_full_backlog_refuses_a_dial_until_a_connection_is_taken() {
        let o = offer(0x5E72);
        let l = LaneListener::bind(&o).unwrap();
        let mut queued = Vec::new();
        let refused = loop {
            match dial(&o) {
                Ok(s) => queued.push(s),
                Err(e) => break e,
            }
            assert!(queued.len() <= BACKLOG as usize + 1, "past the backlog");
        };
        assert_eq!(refused.kind(), io::ErrorKind::WouldBlock, "{refused}");
        assert!(queued.len() >= BACKLOG as usize, "{} queued", queued.len());
        assert!(dial(&o).is_err(), "still full");
        let _taken = l.accept().unwrap().expect("a queued connection");
        dial(&o).expect("room for one again");
    }

    /// Setup messages with four descriptors (they fit the buffer's room,
    /// rounded up) and eight (cut short by the kernel) are refused.
    #[test]
    fn a_setup_with_more_than_three_descriptors_is_refused() {
        let o = offer(0x5E71);
        let l = LaneListener::bind(&o).unwrap();
        for (n, why) in [
            (4, "a lane setup without exactly three descriptors"),
            (8, "a lane setup with more than three descriptors"),
        ] {
            let s =
                UnixStream::connect_addr(&UnixAddr::from_abstract_name(socket_name(&o)).unwrap())
                    .unwrap();
            let msg = setup_message(0);
            let b: Vec<OwnedFd> = (0..n).map(|_| bell().unwrap()).collect();
            let fds: Vec<BorrowedFd<'_>> = b.iter().map(|f| f.as_fd()).collect();
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(8))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
            rustix::net::sendmsg(&s, &[IoSlice::new(&msg)], &mut control, SendFlags::NOSIGNAL)
                .unwrap();
            let taken = l.accept().unwrap().unwrap();
            let e = recv_setup(&taken).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{n} descriptors: {e}");
            assert_eq!(e.to_string(), why, "{n} descriptors");
        }
    }
}
