//! How a segment reaches the other process: the side that offered listens
//! on an abstract Unix socket named by its offer; the side that took the
//! offer connects, and sends a small setup message with one descriptor
//! (SCM_RIGHTS): the memfd. The connection then stays open for the lane's
//! life. It is each side's doorbell — a byte on it wakes the other — and
//! its hang-up is how each side learns that the other died (SIGKILL
//! included), at once.
//!
//! The doorbell is the link, not an eventfd passed to the peer: a passed
//! eventfd shares its open file, whose O_NONBLOCK the peer can clear, and
//! whose counter it can fill, so that this side's next read or write of it
//! blocks for good (with the endpoint's lock held). Each side's end of the
//! link is its own file, and every call on it says MSG_DONTWAIT.

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
const VERSION: u32 = 2;
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

/// Sends the offering side, on the link [`dial`] made, the segment, for the
/// peer `token` names.
pub(crate) fn send_setup(link: &UnixStream, token: u32, segment: BorrowedFd<'_>) -> io::Result<()> {
    let msg = setup_message(token);
    let fds = [segment];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
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
    /// A whole setup with its descriptor, now this process's.
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
/// its one descriptor is refused.
pub(crate) fn recv_setup(s: &UnixStream) -> io::Result<SetupRead> {
    // Descriptors that do not fit the process are dropped by the kernel as
    // it hands a message over, and a setup taken so would be lost for good.
    // So peek: the descriptors come as copies, and the message stays queued
    // until they all came.
    let mut msg = [0u8; SETUP_BYTES];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
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
        // Cut short with none: the process is out of descriptors. With
        // one or more (the buffer, rounded up to its alignment, has room
        // for another): more were sent than a setup has.
        return match fds.len() {
            0 => Ok(SetupRead::NoRoom),
            _ => Err(refused("a lane setup with more than one descriptor")),
        };
    }
    let token = u32::from_le_bytes([msg[8], msg[9], msg[10], msg[11]]);
    let [segment]: [OwnedFd; 1] = fds
        .try_into()
        .map_err(|_| refused("a lane setup without exactly one descriptor"))?;
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
    Ok(SetupRead::Ready(Setup { token, segment }))
}

/// Rings the other side's doorbell: a byte on the link. Never waits: a
/// full socket already holds rings it has not taken.
pub(crate) fn ring(link: &UnixStream) {
    let _ = rustix::net::send(link, &[1], SendFlags::DONTWAIT | SendFlags::NOSIGNAL);
}

/// Takes the rings waiting on the link, at most a few reads' worth: a peer
/// that rings without pause costs wake-ups, not a read that never ends.
/// (Nothing but rings comes on a link once its setup is taken.)
pub(crate) fn drain(link: &UnixStream) {
    let mut b = [0u8; 256];
    for _ in 0..4 {
        match rustix::net::recv(link, &mut b, RecvFlags::DONTWAIT) {
            Ok((n, _)) if n == b.len() => {}
            _ => return,
        }
    }
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
        let seg = some_fd();
        let link = dial(&o).unwrap();
        send_setup(&link, 0x77, seg.as_fd()).unwrap();
        // A ring may follow the setup before it is read: it stays a ring.
        ring(&link);
        let taken = l.accept().unwrap().expect("a connection");
        let SetupRead::Ready(setup) = recv_setup(&taken).unwrap() else {
            panic!("the setup")
        };
        assert_eq!(setup.token, 0x77);
        assert_eq!(
            rustix::fs::fstat(&setup.segment).unwrap().st_ino,
            rustix::fs::fstat(&seg).unwrap().st_ino,
            "the memfd itself"
        );
        // The link is the doorbell: rings are seen on the other end, and drained.
        ring(&link);
        assert!(readable(&taken), "rung");
        drain(&taken);
        assert!(!readable(&taken), "drained");
        ring(&taken);
        assert!(readable(&link), "both ways");
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

    /// Setup messages with two descriptors (they fit the buffer's room,
    /// rounded up) and eight (cut short by the kernel) are refused.
    #[test]
    fn a_setup_with_more_than_one_descriptor_is_refused() {
        let o = offer(0x5E71);
        let l = LaneListener::bind(&o).unwrap();
        for (n, why) in [
            (2, "a lane setup without exactly one descriptor"),
            (8, "a lane setup with more than one descriptor"),
        ] {
            let s =
                UnixStream::connect_addr(&UnixAddr::from_abstract_name(socket_name(&o)).unwrap())
                    .unwrap();
            let msg = setup_message(0);
            let b: Vec<OwnedFd> = (0..n).map(|_| some_fd()).collect();
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

    fn some_fd() -> OwnedFd {
        rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap()
    }

    /// Whether a byte waits on `s`.
    fn readable(s: &UnixStream) -> bool {
        rustix::net::recv(s, &mut [0u8; 1], RecvFlags::PEEK | RecvFlags::DONTWAIT).is_ok()
    }

    /// Ringing and draining never wait, whatever the link's file flags
    /// (the peer could clear O_NONBLOCK on a descriptor it shares; the
    /// eventfd doorbells were shared, and a read of an empty one, or a
    /// write to a full one, then blocked for good): a link whose other end
    /// never reads takes rings until it is full, then drops them; an empty
    /// one drains at once.
    #[test]
    fn ringing_and_draining_never_wait_on_a_blocking_or_full_link() {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(false).unwrap();
        b.set_nonblocking(false).unwrap();
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drain(&a); // nothing there
            for _ in 0..1_000_000 {
                ring(&a); // `b` never reads: the socket fills
            }
            let rung = readable(&b);
            while readable(&b) {
                drain(&b);
            }
            drain(&b); // nothing there
            done.send(rung).unwrap();
        });
        let rung = finished
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("a ring or a drain waited");
        assert!(rung, "the rings reached the other end");
    }
}
