//! Readiness through epoll, edge-triggered, so a pass costs what is ready
//! and not what is connected: a thousand idle peers cost nothing per message.
//!
//! Two sets: `data` (what the application reads: bytes from open peers) and
//! `ctl` (the connection's own work: new connections, handshakes, room to
//! write). A thread that reads for itself waits on `data`; the progress
//! thread waits on `ctl` while it does, and on both otherwise, so an
//! arrival wakes only the thread that wants it.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};

use rustix::buffer::spare_capacity;
use rustix::event::epoll::{self, CreateFlags, Event, EventData, EventFlags};
use rustix::event::Timespec;

/// Which set a registration belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Set {
    /// Readable bytes of open peers.
    Data,
    /// Everything else.
    Ctl,
}

/// What an event says of its source.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ready {
    /// The key it was registered with.
    pub key: u64,
    /// Bytes to read, or the end (hang-up, error: the read will tell).
    pub read: bool,
    /// Room to write (or an error, which the write will tell).
    pub write: bool,
    /// The other side hung up or the socket failed: what is left to read
    /// ends in an end of stream or an error (so a short read is not the end).
    pub hup: bool,
}

/// The two epoll sets and a buffer for their events.
pub(crate) struct Poller {
    data: OwnedFd,
    ctl: OwnedFd,
    events: Vec<Event>,
}

// SAFETY: `events` is a buffer of plain records the kernel fills in; their
// data word is only ever read as the u64 key it was registered with, never
// as a pointer, so nothing in them is tied to a thread.
unsafe impl Send for Poller {}

impl std::fmt::Debug for Poller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Poller")
            .field("data", &self.data)
            .field("ctl", &self.ctl)
            .finish_non_exhaustive()
    }
}

impl Poller {
    pub fn new() -> io::Result<Poller> {
        Ok(Poller {
            data: epoll::create(CreateFlags::CLOEXEC)?,
            ctl: epoll::create(CreateFlags::CLOEXEC)?,
            events: Vec::with_capacity(256),
        })
    }

    /// Watches `fd` in `set` for `read` and/or `write` readiness, edge-triggered.
    pub fn add(
        &self,
        fd: impl AsFd,
        set: Set,
        key: u64,
        read: bool,
        write: bool,
    ) -> io::Result<()> {
        let mut flags = EventFlags::ET;
        if read {
            flags |= EventFlags::IN | EventFlags::RDHUP;
        }
        if write {
            flags |= EventFlags::OUT;
        }
        epoll::add(self.set(set), fd, EventData::new_u64(key), flags)?;
        Ok(())
    }

    /// Stops watching `fd` in `set` (closing it does too; this is for
    /// descriptors that live on, such as a connection that becomes a lane).
    pub fn remove(&self, fd: impl AsFd, set: Set) {
        // A descriptor not in the set: nothing to undo.
        let _ = epoll::delete(self.set(set), fd);
    }

    /// The descriptor a thread sleeps on for `set` in poll(2).
    pub fn fd(&self, set: Set) -> RawFd {
        self.set(set).as_raw_fd()
    }

    /// Takes the events of `set` that are ready now, without waiting.
    pub fn ready(&mut self, set: Set, out: &mut Vec<Ready>) -> io::Result<()> {
        loop {
            self.events.clear();
            let fd = match set {
                Set::Data => &self.data,
                Set::Ctl => &self.ctl,
            };
            let zero = Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            match epoll::wait(fd, spare_capacity(&mut self.events), Some(&zero)) {
                Ok(_) => {}
                Err(e) if e == rustix::io::Errno::INTR => continue,
                Err(e) => return Err(e.into()),
            }
            let full = self.events.len() == self.events.capacity();
            out.extend(self.events.iter().map(|e| {
                let flags = e.flags;
                Ready {
                    key: e.data.u64(),
                    read: flags.intersects(
                        EventFlags::IN | EventFlags::RDHUP | EventFlags::HUP | EventFlags::ERR,
                    ),
                    write: flags.intersects(EventFlags::OUT | EventFlags::ERR),
                    hup: flags.intersects(EventFlags::RDHUP | EventFlags::HUP | EventFlags::ERR),
                }
            }));
            if !full {
                return Ok(());
            }
        }
    }

    fn set(&self, set: Set) -> &OwnedFd {
        match set {
            Set::Data => &self.data,
            Set::Ctl => &self.ctl,
        }
    }
}

/// What `fd` is ready for now, of `interest` (and the hang-up and error
/// flags poll always reports): one look, no wait.
pub(crate) fn ready_now(
    fd: impl AsFd,
    interest: rustix::event::PollFlags,
) -> rustix::io::Result<rustix::event::PollFlags> {
    let mut fds = [rustix::event::PollFd::new(&fd, interest)];
    rustix::event::poll(&mut fds, Some(&Timespec::default()))?;
    Ok(fds[0].revents())
}
