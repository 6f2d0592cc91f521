//! Readiness through epoll, edge-triggered, so a pass costs what is ready
//! and not what is connected: a thousand idle peers cost nothing per message.
//!
//! A TCP wire has two sets (a [`Poller`]): `data` (what the application reads: bytes from open peers) and
//! `ctl` (the connection's own work: new connections, handshakes, room to
//! write). A thread that reads for itself waits on `data`; the progress
//! thread waits on `ctl` while it does, and on both otherwise, so an
//! arrival wakes only the thread that wants it. The shm wire keeps two more,
//! level-triggered, for its lanes' links ([`EpollSet`]s).

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

/// The two epoll sets of a TCP wire.
#[derive(Debug)]
pub(crate) struct Poller {
    data: EpollSet,
    ctl: EpollSet,
}

impl Poller {
    pub fn new() -> io::Result<Poller> {
        Ok(Poller {
            data: EpollSet::new(true)?,
            ctl: EpollSet::new(true)?,
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
        self.set(set).add(fd, key, read, write)
    }

    /// Stops watching `fd` in `set` (closing it does too; this is for
    /// descriptors that live on, such as a connection that becomes a lane).
    pub fn remove(&self, fd: impl AsFd, set: Set) {
        self.set(set).remove(fd);
    }

    /// The descriptor a thread sleeps on for `set` in poll(2).
    pub fn fd(&self, set: Set) -> RawFd {
        self.set(set).fd()
    }

    /// Takes the events of `set` that are ready now, without waiting.
    pub fn ready(&mut self, set: Set, out: &mut Vec<Ready>) -> io::Result<()> {
        match set {
            Set::Data => self.data.ready(out),
            Set::Ctl => self.ctl.ready(out),
        }
    }

    fn set(&self, set: Set) -> &EpollSet {
        match set {
            Set::Data => &self.data,
            Set::Ctl => &self.ctl,
        }
    }
}

/// One epoll set, edge- or level-triggered, and a buffer for its events.
pub(crate) struct EpollSet {
    fd: OwnedFd,
    /// `EventFlags::ET`, or none (level-triggered).
    trigger: EventFlags,
    events: Vec<Event>,
}

// SAFETY: `events` is a buffer of plain records the kernel fills in; their
// data word is only ever read as the u64 key it was registered with, never
// as a pointer, so nothing in them is tied to a thread.
unsafe impl Send for EpollSet {}

impl std::fmt::Debug for EpollSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpollSet")
            .field("fd", &self.fd)
            .finish_non_exhaustive()
    }
}

impl EpollSet {
    /// An empty set; `edge`: each readiness is told once (else for as
    /// long as it lasts, and a sleeper on the set sees what its
    /// descriptors would say in `poll(2)`).
    pub fn new(edge: bool) -> io::Result<EpollSet> {
        Ok(EpollSet {
            fd: epoll::create(CreateFlags::CLOEXEC)?,
            trigger: if edge {
                EventFlags::ET
            } else {
                EventFlags::empty()
            },
            events: Vec::with_capacity(256),
        })
    }

    /// Watches `fd` for `read` and/or `write` readiness.
    pub fn add(&self, fd: impl AsFd, key: u64, read: bool, write: bool) -> io::Result<()> {
        let mut flags = self.trigger;
        if read {
            flags |= EventFlags::IN | EventFlags::RDHUP;
        }
        if write {
            flags |= EventFlags::OUT;
        }
        epoll::add(&self.fd, fd, EventData::new_u64(key), flags)?;
        Ok(())
    }

    /// Watches `fd` (in the set already) for its hang-up only (`read`
    /// false: no readable bytes), or for both again.
    pub fn modify(&self, fd: impl AsFd, key: u64, read: bool) -> io::Result<()> {
        let mut flags = self.trigger | EventFlags::RDHUP;
        if read {
            flags |= EventFlags::IN;
        }
        epoll::modify(&self.fd, fd, EventData::new_u64(key), flags)?;
        Ok(())
    }

    /// Stops watching `fd`.
    pub fn remove(&self, fd: impl AsFd) {
        // A descriptor not in the set: nothing to undo.
        let _ = epoll::delete(&self.fd, fd);
    }

    /// The descriptor a thread sleeps on in poll(2).
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Takes the events that are ready now, without waiting: all of an
    /// edge-triggered set's, a buffer's worth of a level-triggered one's
    /// (what it leaves stays ready for the next look; another
    /// `epoll_wait` would only return the same ones again).
    pub fn ready(&mut self, out: &mut Vec<Ready>) -> io::Result<()> {
        loop {
            self.events.clear();
            let zero = Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            match epoll::wait(&self.fd, spare_capacity(&mut self.events), Some(&zero)) {
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
            if !full || self.trigger.is_empty() {
                return Ok(());
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    /// A level-triggered set with more ready descriptors than one look
    /// takes: each look returns a buffer's worth (another `epoll_wait`
    /// would return the same ones, for ever), and what it leaves is there
    /// for the next. An edge-triggered one tells each once, all in one look.
    #[test]
    fn a_look_at_a_level_triggered_set_takes_a_buffers_worth_and_leaves_the_rest() {
        const READY: usize = 600;
        let pairs: Vec<(UnixStream, UnixStream)> = (0..READY)
            .map(|_| {
                let (a, mut b) = UnixStream::pair().unwrap();
                b.write_all(&[1]).unwrap();
                (a, b)
            })
            .collect();
        for edge in [false, true] {
            let mut set = EpollSet::new(edge).unwrap();
            for (k, (a, _)) in pairs.iter().enumerate() {
                set.add(a, k as u64, true, false).unwrap();
            }
            let mut out = Vec::new();
            set.ready(&mut out).unwrap();
            let mut keys: Vec<u64> = out.iter().map(|r| r.key).collect();
            keys.sort_unstable();
            keys.dedup();
            assert_eq!(keys.len(), out.len(), "each told once a look");
            match edge {
                false => assert_eq!(out.len(), set.events.capacity()),
                true => assert_eq!(out.len(), READY),
            }
            out.clear();
            set.ready(&mut out).unwrap();
            match edge {
                false => assert!(!out.is_empty(), "the rest is still ready"),
                true => assert!(out.is_empty(), "an edge is told once"),
            }
        }
    }
}
