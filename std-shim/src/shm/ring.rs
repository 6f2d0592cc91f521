//! One direction of a same-host lane: a single-producer, single-consumer
//! byte ring in memory both processes map, carrying the session's frames as
//! a stream (as TCP carries them).
//!
//! Each write's bytes go in a *chunk* that starts on a cache line: a stamp
//! word, a length word, the bytes, padding to the next line. A consumer
//! waiting for the next chunk watches its stamp, in the line that also
//! carries the chunk's length and first bytes, as UCX's shared-memory FIFO
//! elements carry their own flag: one cache line crosses the cores for a
//! small message. Watching a separate `head` word and then reading the
//! bytes cost two crossings in turn, and with the producer's stores queued
//! behind its copies, more: a 96-byte ping-pong on the H200 host read
//! 0.50 µs one way so, 0.21 µs with the stamp in the bytes' line.
//!
//! `head` counts the ring bytes ever written (the producer's word), `tail`
//! those ever read (the consumer's). Each side keeps its own counter in
//! private memory and only *publishes* it to the segment; the other side's
//! word is read, then checked — a peer that shares memory is still not
//! trusted. The stamp of the chunk at position `p` is a function of `p` and
//! the segment's random key (a stale chunk of an earlier lap, or a payload
//! the peer's application chose, does not pass); its length is checked
//! against the ring. A read goes by stamps alone: the producer's `head`
//! line is written at every write, and a consumer that read it after each
//! message fetched it from the producer's core before handing the message
//! on. The head is read where the consumer looks whether to sleep
//! ([`Consumer::available`], [`Consumer::prepare_sleep`]): behind the
//! chunk just read, more than the ring ahead, or past a chunk that has no
//! stamp, it is [`Corrupt`]. (A head moved past unstamped chunks while the
//! reader never sleeps is a peer that sends nothing: its own loss, judged
//! by the session's timers.) No index the peer writes is ever used to reach
//! memory outside the ring. Bytes are copied out of the ring into private
//! memory before anything decodes them.
//!
//! Sleeping without a lost wake-up: a side about to sleep sets its `waits`
//! word, fences (`SeqCst`), then looks at the ring once more; a side that
//! moves the ring publishes its counter (the producer at each write, the
//! consumer at [`Consumer::publish`], once a read pass), fences, then reads
//! the other's `waits` and rings its doorbell if set. One of the two sees
//! the other (`loom` checks it: the `model` module below).

use std::sync::atomic::Ordering;

use crate::sync::{fence, AtomicU32, AtomicU64};

/// The control words of one ring, as laid out in the segment: each side's
/// counter on its own cache line, so a producer and a consumer on two cores
/// do not share one.
#[repr(C)]
#[derive(Debug, Default)]
pub(crate) struct RingCtl {
    /// Bytes written, ever (the producer publishes it).
    head: Line<AtomicU64>,
    /// Bytes read, ever (the consumer publishes it).
    tail: Line<AtomicU64>,
    /// Who waits for the other.
    waits: Line<Waits>,
    /// The single-copy handover of the ring's current large message (see
    /// `lane`): its ticket and state, which producer and consumer change
    /// by compare-and-swap.
    claim: Line<AtomicU64>,
    /// The last device message (see `lane`) of this ring whose bytes the
    /// consumer has copied out of the producer's GPU memory: its ticket,
    /// which only the consumer stores.
    device_done: Line<AtomicU64>,
    /// The inode of the producer's pool file that the consumer has mapped
    /// (0: none): the producer may then send large messages *placed* (see
    /// `lane`), which only the consumer stores.
    maps_file: Line<AtomicU64>,
    /// The last placed message of this ring whose bytes the consumer has
    /// copied out of the producer's pool file: its ticket, which only the
    /// consumer stores.
    placed_done: Line<AtomicU64>,
    /// Not 0 once the producer has dropped the lane without a clean close,
    /// which only the producer stores: its buffers went back to its pools
    /// then, so what the consumer copies out of the producer's memory
    /// afterwards may be a later message's bytes (see `lane`).
    ended: Line<AtomicU64>,
    /// The consumer's offer of a long message's tail to the producer,
    /// who may write it straight into the consumer's buffer while the
    /// consumer reads the head (see `cma`): the word (its ticket and
    /// state), which both change by compare-and-swap, and where the tail
    /// goes in the consumer, which only the consumer stores.
    help: Line<Help>,
}

#[repr(C)]
#[derive(Debug, Default)]
pub(crate) struct Help {
    pub(crate) word: AtomicU64,
    pub(crate) dst: AtomicU64,
}

impl RingCtl {
    /// The claim word of this ring's large messages.
    pub(crate) fn claim(&self) -> &AtomicU64 {
        &self.claim
    }

    /// The offer of a long message's tail (see `cma`).
    pub(crate) fn help(&self) -> &Help {
        &self.help
    }

    /// The ticket of the last device message copied out of the producer.
    #[cfg(feature = "cuda-uma")]
    pub(crate) fn device_done(&self) -> &AtomicU64 {
        &self.device_done
    }

    /// The inode of the producer's pool file the consumer has mapped.
    pub(crate) fn maps_file(&self) -> &AtomicU64 {
        &self.maps_file
    }

    /// The ticket of the last placed message copied out of the producer.
    pub(crate) fn placed_done(&self) -> &AtomicU64 {
        &self.placed_done
    }

    /// The producer ends the lane uncleanly: the word, then a fence, before
    /// its buffers go back to be written again.
    pub(crate) fn end(&self) {
        // Relaxed: the fence after it orders it.
        self.ended.store(1, Ordering::Relaxed);
        // SeqCst, not Release: the buffers' next writes may come from
        // another thread (whichever leases them next, after the pool's own
        // handoff), which a release fence here would not order for the
        // consumer; two SeqCst fences do (the `model` module below).
        fence(Ordering::SeqCst);
    }

    /// The consumer, after a copy out of the producer's memory: whether the
    /// bytes are the message's. A copy that saw a byte written after
    /// [`end`](Self::end), by any thread, sees the word.
    pub(crate) fn copied_intact(&self) -> bool {
        // SeqCst: pairs with `end`'s (see there).
        fence(Ordering::SeqCst);
        self.ended.load(Ordering::Relaxed) == 0
    }
}

#[repr(C)]
#[derive(Debug, Default)]
struct Waits {
    /// The consumer sleeps, or is about to: a write rings its doorbell.
    reader: AtomicU32,
    /// The producer waits for room: a read rings its doorbell.
    writer: AtomicU32,
}

/// A value alone on its cache line (alignment, not padding fields: no
/// bytes here that the peer writes and this side would ever read).
#[repr(C, align(64))]
#[derive(Debug, Default)]
struct Line<T>(T);

impl<T> std::ops::Deref for Line<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

#[cfg(feature = "testing")]
impl RingCtl {
    /// The producer's word, to poke (tests play a hostile peer).
    pub(crate) fn head_word(&self) -> &AtomicU64 {
        &self.head
    }

    /// The consumer's word, to poke.
    pub(crate) fn tail_word(&self) -> &AtomicU64 {
        &self.tail
    }
}

/// Bytes of a [`RingCtl`] in the segment.
pub(crate) const CTL_BYTES: usize = std::mem::size_of::<RingCtl>();

/// The ring's memory: its control words and its data bytes. The segment
/// gives the real one; the loom model gives one loom can watch.
pub(crate) trait RingMem {
    /// The control words.
    fn ctl(&self) -> &RingCtl;
    /// Data bytes: a power of two.
    fn cap(&self) -> usize;
    /// Copies `src` to data bytes `at..at + src.len()` (within `cap`).
    fn copy_in(&self, at: usize, src: &[u8]);
    /// Copies data bytes `at..at + dst.len()` (within `cap`) to `dst`.
    fn copy_out(&self, at: usize, dst: &mut [u8]);
    /// The stamp word of the chunk at data byte `at` (a multiple of
    /// [`CHUNK_ALIGN`], within `cap`): in the segment, the chunk's first
    /// eight bytes.
    fn stamp(&self, at: usize) -> &AtomicU64;
    /// The key of the ring's stamps (see [`stamp_of`]).
    fn key(&self) -> u64;
}

/// The peer's counter is impossible: behind this side's, or further ahead
/// than the ring holds. The lane is broken (its peer only: typed, not a panic).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Corrupt {
    /// The peer's counter as read.
    pub theirs: u64,
    /// This side's.
    pub ours: u64,
}

impl std::fmt::Display for Corrupt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the peer's ring counter {} is impossible beside ours, {}",
            self.theirs, self.ours
        )
    }
}

impl std::error::Error for Corrupt {}

/// What moving the ring asks of the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub(crate) struct Moved {
    /// Bytes moved.
    pub(crate) n: usize,
    /// The other side waits: ring its doorbell.
    pub(crate) wake: bool,
}

/// Copies between a ring position and a buffer, in the two pieces a wrap
/// makes of it.
fn pieces(cap: usize, pos: u64, len: usize) -> impl Iterator<Item = (usize, usize)> {
    let at = (pos as usize) & (cap - 1);
    let first = len.min(cap - at);
    // The second piece is empty unless the bytes wrap: no call for it.
    [(at, first), (0, len - first)]
        .into_iter()
        .filter(|&(_, n)| n > 0)
}

/// A chunk begins at a multiple of this (a cache line): its stamp, its
/// length and its first bytes share the line a waiting consumer watches.
pub(crate) const CHUNK_ALIGN: usize = 64;

/// A chunk's stamp word and length word (and four bytes kept zero) before
/// its bytes.
pub(crate) const STAMP_BYTES: usize = 16;

/// The ring bytes a chunk of `n` bytes takes.
fn chunk_bytes(n: usize) -> usize {
    (STAMP_BYTES + n).next_multiple_of(CHUNK_ALIGN)
}

/// The stamp of the chunk at `pos`. Not `pos` itself: zeroed memory would
/// then stamp position 0, and a payload that held small numbers could
/// stamp anything; the key (the segment's, random) makes a stale byte that
/// passes a chance of one in 2^64.
fn stamp_of(pos: u64, key: u64) -> u64 {
    !(pos ^ key)
}

/// The data bytes the write of a long message can take in `raw` ring
/// bytes: one chunk for each [`PUBLISH_EVERY`] bytes.
fn data_room(raw: usize) -> usize {
    let full = chunk_bytes(PUBLISH_EVERY);
    let rest = (raw % full) & !(CHUNK_ALIGN - 1);
    raw / full * PUBLISH_EVERY + rest.saturating_sub(STAMP_BYTES)
}

/// A long write publishes its bytes in steps of this many, a chunk each
/// (see [`Producer::write`]). Under loom, every byte: the model then sees
/// a consumer read a write that is still going on.
#[cfg(not(loom))]
const PUBLISH_EVERY: usize = 16 << 10;
#[cfg(loom)]
const PUBLISH_EVERY: usize = 1;

/// A long read gives its room back in steps of this many (see
/// [`Consumer::read`]). Under loom, never before [`Consumer::publish`]:
/// the model then checks that the room a read took comes back there.
#[cfg(not(loom))]
const RELEASE_EVERY: usize = 16 << 10;
#[cfg(loom)]
const RELEASE_EVERY: usize = usize::MAX;

/// The writing end.
#[derive(Debug)]
pub(crate) struct Producer<M: RingMem> {
    mem: M,
    head: u64,
    /// The consumer's tail as last read: room is reckoned from it, and the
    /// tail is read again only when that room is short. A tail read on
    /// every write would pull its cache line from the consumer's core once
    /// a message.
    seen_tail: u64,
    /// The ring's stamp key, read once.
    key: u64,
}

impl<M: RingMem> Producer<M> {
    /// The writing end of a fresh ring (both counters 0).
    pub(crate) fn new(mem: M) -> Self {
        let key = mem.key();
        Producer {
            mem,
            head: 0,
            seen_tail: 0,
            key,
        }
    }

    /// The ring's memory.
    #[cfg(feature = "testing")]
    pub(crate) fn mem(&self) -> &M {
        &self.mem
    }

    /// The ring's control words (its claim word).
    pub(crate) fn mem_ctl(&self) -> &RingCtl {
        self.mem.ctl()
    }

    /// Bytes a write can take now (the consumer's tail read afresh).
    pub(crate) fn room(&mut self) -> Result<usize, Corrupt> {
        // Acquire: the consumer's reads of the bytes it released happened
        // before this load, so overwriting them is safe.
        let tail = self.mem.ctl().tail.load(Ordering::Acquire);
        let cap = self.mem.cap() as u64;
        match self.head.checked_sub(tail) {
            Some(used) if used <= cap => {
                self.seen_tail = tail;
                Ok(data_room((cap - used) as usize))
            }
            _ => Err(Corrupt {
                theirs: tail,
                ours: self.head,
            }),
        }
    }

    /// Writes as much of `parts`, in order, as fits, and publishes it: a
    /// chunk every [`PUBLISH_EVERY`] bytes, so that a consumer spinning on
    /// the ring copies a long message out while the rest is copied in.
    /// Each chunk's bytes, then its length, then its stamp (Release), then
    /// the head: a consumer that sees the stamp sees the bytes, and one
    /// that sees the head sees the stamp.
    pub(crate) fn write(&mut self, parts: &[&[u8]]) -> Result<Moved, Corrupt> {
        let want: usize = parts.iter().map(|p| p.len()).sum();
        let cap = self.mem.cap();
        // `seen_tail` passed the checks when read: head - seen_tail <= cap.
        let mut room = data_room(cap - (self.head - self.seen_tail) as usize);
        if room < want {
            room = self.room()?;
        }
        let total = want.min(room);
        if total == 0 {
            return Ok(Moved { n: 0, wake: false });
        }
        let at = self.head as usize & (cap - 1);
        if total == want && total <= PUBLISH_EVERY && at + STAMP_BYTES + total <= cap {
            // The common case (a frame, a short message): every part whole
            // in one chunk whose bytes do not wrap.
            let mut to = at + STAMP_BYTES;
            for p in parts {
                self.mem.copy_in(to, p);
                to += p.len();
            }
            self.seal(at, total);
        } else {
            self.write_chunks(parts, total);
        }
        let ctl = self.mem.ctl();
        // Release: the chunks are visible to a consumer that acquires this
        // head (one that sleeps looks at it).
        ctl.head.store(self.head, Ordering::Release);
        // SeqCst fence: orders the head store before the load of the
        // consumer's `reader_waits` (see the module docs: no lost wake-up).
        fence(Ordering::SeqCst);
        // Relaxed: the fence orders it; a stale 1 costs one spurious wake-up.
        let wake = ctl.waits.reader.load(Ordering::Relaxed) != 0;
        Ok(Moved { n: total, wake })
    }

    /// The chunk at ring byte `at` (the head's), its `size` bytes copied
    /// in: its length, then its stamp (Release: a consumer that acquires
    /// the stamp sees the bytes and the length); the head moves past it.
    fn seal(&mut self, at: usize, size: usize) {
        // A chunk starts on a line, so its stamp and length never wrap.
        let mut len = [0u8; 8];
        len[..4].copy_from_slice(&(size as u32).to_le_bytes());
        self.mem.copy_in(at + 8, &len);
        self.mem
            .stamp(at)
            .store(stamp_of(self.head, self.key), Ordering::Release);
        self.head += chunk_bytes(size) as u64;
    }

    /// Writes the first `total` bytes of `parts` as chunks of at most
    /// [`PUBLISH_EVERY`] bytes each, wrapping where the ring does, and
    /// publishes the head after each but the last (the caller's store).
    fn write_chunks(&mut self, parts: &[&[u8]], total: usize) {
        let cap = self.mem.cap();
        let (mut part, mut from) = (0, 0);
        let mut done = 0;
        while done < total {
            let size = (total - done).min(PUBLISH_EVERY);
            let at = self.head as usize & (cap - 1);
            let mut put = 0;
            while put < size {
                let src = &parts[part][from..];
                let take = src.len().min(size - put);
                let pos = self.head + (STAMP_BYTES + put) as u64;
                let mut k = 0;
                for (to, len) in pieces(cap, pos, take) {
                    self.mem.copy_in(to, &src[k..k + len]);
                    k += len;
                }
                put += take;
                from += take;
                if from == parts[part].len() {
                    part += 1;
                    from = 0;
                }
            }
            self.seal(at, size);
            done += size;
            if done < total {
                // Release: as the caller's final store, for the chunks so far.
                self.mem.ctl().head.store(self.head, Ordering::Release);
            }
        }
    }

    /// Ring bytes written, ever (stamps and padding included): when it
    /// moves, this side wrote.
    pub(crate) fn written(&self) -> u64 {
        self.head
    }

    /// About to wait for room: says so, then looks again. `Ok(true)`:
    /// room appeared meanwhile, do not sleep.
    pub(crate) fn prepare_wait(&mut self) -> Result<bool, Corrupt> {
        // Relaxed: the fence below orders it before the second look.
        self.mem.ctl().waits.writer.store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        Ok(self.room()? > 0)
    }

    /// Done waiting.
    pub(crate) fn done_waiting(&self) {
        // Relaxed: a flag the consumer only uses to decide whether to ring.
        self.mem.ctl().waits.writer.store(0, Ordering::Relaxed);
    }
}

/// The reading end.
///
/// Reads take bytes; [`Consumer::publish`] gives their room back to the
/// producer. A reader publishes once a pass (after every frame it found),
/// not once a read: each publication is a store the producer's core must
/// fetch and a fence. A long read publishes as it goes, as a long write does.
#[derive(Debug)]
pub(crate) struct Consumer<M: RingMem> {
    mem: M,
    /// Ring bytes taken, ever: inside the current chunk's bytes, or at
    /// their end.
    tail: u64,
    /// Where the current chunk starts (its stamp).
    start: u64,
    /// Where the current chunk's bytes end (checked when its stamp was
    /// read); the next chunk starts at the next line from here.
    end: u64,
    /// The tail as last stored to the segment.
    stored: u64,
    /// The tail as of the last look at the producer's `waits` after a store.
    published: u64,
    /// The producer's bytes read, ever (see [`Consumer::taken`]).
    taken: u64,
    /// The ring's stamp key, read once.
    key: u64,
}

impl<M: RingMem> Consumer<M> {
    /// The reading end of a fresh ring (both counters 0).
    pub(crate) fn new(mem: M) -> Self {
        let key = mem.key();
        Consumer {
            mem,
            tail: 0,
            start: 0,
            end: 0,
            stored: 0,
            published: 0,
            taken: 0,
            key,
        }
    }

    /// Where the next chunk starts.
    fn next_chunk(&self) -> u64 {
        self.end.next_multiple_of(CHUNK_ALIGN as u64)
    }

    /// Whether the chunk at `pos` is written: its stamp (one cache line,
    /// which the producer's write moves to this core along with the
    /// chunk's first bytes). `Some(len)`: its length, checked.
    fn stamped(&self, pos: u64) -> Result<Option<usize>, Corrupt> {
        let cap = self.mem.cap();
        let at = pos as usize & (cap - 1);
        // Acquire: pairs with the producer's Release store of the stamp;
        // the chunk's length and bytes are visible.
        if self.mem.stamp(at).load(Ordering::Acquire) != stamp_of(pos, self.key) {
            return Ok(None);
        }
        let mut len = [0u8; 8];
        self.mem.copy_out(at + 8, &mut len);
        let n = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
        // A chunk fits the ring (`n` first: no sum on it can overflow).
        if n == 0 || len[4..] != [0; 4] || n > cap - STAMP_BYTES {
            return Err(Corrupt {
                theirs: pos + (STAMP_BYTES + n) as u64,
                ours: pos,
            });
        }
        Ok(Some(n))
    }

    /// Moves to the next chunk, if its stamp says it is written:
    /// `Ok(false)` when not. With `check_head`, only then, the producer's
    /// head, which must then say nothing was written (a head that says
    /// otherwise, or that is out of bounds, is [`Corrupt`]).
    fn next(&mut self, check_head: bool) -> Result<bool, Corrupt> {
        let pos = self.next_chunk();
        let n = match self.stamped(pos)? {
            Some(n) => n,
            None if !check_head => return Ok(false),
            None => {
                // Acquire: a head past `pos` makes the chunk's stamp visible.
                let head = self.mem.ctl().head.load(Ordering::Acquire);
                let bad = Corrupt {
                    theirs: head,
                    ours: self.tail,
                };
                // The producer stores the head after a chunk's stamp: it may
                // still say the current chunk's start, never less; and it is
                // never more than the ring ahead of what was read.
                if head < self.start || head > self.tail.saturating_add(self.mem.cap() as u64) {
                    return Err(bad);
                }
                if head <= pos {
                    return Ok(false);
                }
                self.stamped(pos)?.ok_or(bad)?
            }
        };
        self.start = pos;
        self.tail = pos + STAMP_BYTES as u64;
        self.end = self.tail + n as u64;
        Ok(true)
    }

    /// Bytes waiting to be read in the current chunk, or in the next one
    /// (its stamp, and without one the producer's head, read afresh).
    pub(crate) fn available(&mut self) -> Result<usize, Corrupt> {
        if self.tail == self.end && !self.next(true)? {
            return Ok(0);
        }
        Ok((self.end - self.tail) as usize)
    }

    /// Nothing to read and nothing read to give back: every chunk the
    /// producer stamped has been read and its room published. One look,
    /// at the next chunk's stamp (its line carries the message), not at
    /// the head: an impossible head is seen at [`Consumer::prepare_sleep`].
    /// A stamp with an impossible length is not "drained": the read says
    /// why.
    pub(crate) fn is_drained(&self) -> bool {
        self.tail == self.published
            && self.tail == self.end
            && self.stamped(self.next_chunk()) == Ok(None)
    }

    /// The producer's bytes read, ever: not the stamps and padding around
    /// them, so that a peer that writes a byte a chunk is not counted 64
    /// (a reader of its rate would be fooled by a factor as large).
    pub(crate) fn taken(&self) -> u64 {
        self.taken
    }

    /// Copies up to `out.len()` waiting bytes into `out`; how many. Their
    /// room goes back to the producer at [`Consumer::publish`], or on the
    /// way through a long read. By the stamps alone: the head is not read.
    pub(crate) fn read(&mut self, out: &mut [u8]) -> Result<usize, Corrupt> {
        let cap = self.mem.cap();
        let n = out.len();
        if n == 0 || self.tail == self.end && !self.next(false)? {
            return Ok(0);
        }
        let at = self.tail as usize & (cap - 1);
        if n <= (self.end - self.tail) as usize && n <= RELEASE_EVERY && at + n <= cap {
            // The common case (a header, a short message): all of `out`
            // inside the current chunk, unwrapped.
            self.mem.copy_out(at, out);
            self.took(n);
            return Ok(n);
        }
        self.read_chunks(out)
    }

    /// `read`'s other case, out of line: `out` across chunks, or wrapped.
    #[inline(never)]
    fn read_chunks(&mut self, out: &mut [u8]) -> Result<usize, Corrupt> {
        let cap = self.mem.cap();
        let mut to = 0;
        while to < out.len() {
            if self.tail == self.end && !self.next(false)? {
                break;
            }
            let step = ((self.end - self.tail) as usize)
                .min(out.len() - to)
                .min(RELEASE_EVERY);
            for (at, len) in pieces(cap, self.tail, step) {
                self.mem.copy_out(at, &mut out[to..to + len]);
                to += len;
            }
            self.took(step);
        }
        Ok(to)
    }

    /// `n` bytes of the current chunk were copied out: past them, and past
    /// the chunk's padding once it is read (the room goes back whole);
    /// its room goes back on the way through a long read.
    fn took(&mut self, n: usize) {
        self.tail += n as u64;
        self.taken += n as u64;
        if self.tail == self.end {
            self.tail = self.next_chunk();
            self.end = self.tail;
        }
        if self.tail - self.stored >= RELEASE_EVERY as u64 {
            // Release: our reads of those bytes happen before the
            // producer, acquiring this tail, writes over them. The look
            // at `waits` comes at `publish`.
            self.mem.ctl().tail.store(self.tail, Ordering::Release);
            self.stored = self.tail;
        }
    }

    /// Gives the room of every byte read back to the producer. `true`: the
    /// producer waits for it, ring its doorbell.
    pub(crate) fn publish(&mut self) -> bool {
        if self.tail == self.published {
            return false;
        }
        let ctl = self.mem.ctl();
        if self.tail != self.stored {
            // Release: as in `read`.
            ctl.tail.store(self.tail, Ordering::Release);
            self.stored = self.tail;
        }
        self.published = self.tail;
        // SeqCst fence: orders the tail store before the load of
        // `writer_waits` (no lost wake-up).
        fence(Ordering::SeqCst);
        // Relaxed: ordered by the fence.
        ctl.waits.writer.load(Ordering::Relaxed) != 0
    }

    /// The ring's control words (its claim word).
    pub(crate) fn mem_ctl(&self) -> &RingCtl {
        self.mem.ctl()
    }

    /// Whether the producer waits (for room, or for a handover): after
    /// moving anything it waits for, ring its doorbell.
    pub(crate) fn writer_waits(&self) -> bool {
        // SeqCst fence: orders this side's last store (a tail, a claim)
        // before the load of the producer's flag (no lost wake-up).
        fence(Ordering::SeqCst);
        // Relaxed: ordered by the fence.
        self.mem.ctl().waits.writer.load(Ordering::Relaxed) != 0
    }

    /// About to sleep: says so, then looks again. `Ok(true)`: bytes came
    /// meanwhile, do not sleep.
    pub(crate) fn prepare_sleep(&mut self) -> Result<bool, Corrupt> {
        // Relaxed: the fence below orders it before the second look.
        self.mem.ctl().waits.reader.store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        Ok(self.available()? > 0)
    }

    /// Awake again.
    pub(crate) fn woke(&self) {
        // Relaxed: a flag the producer only uses to decide whether to ring.
        self.mem.ctl().waits.reader.store(0, Ordering::Relaxed);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::rc::Rc;

    /// A ring in one process's heap, for the unit tests: its bytes in
    /// words, so that a chunk's stamp is the chunk's first word, written
    /// over by later laps' bytes, as in the segment.
    struct HeapRing {
        ctl: RingCtl,
        words: Box<[AtomicU64]>,
    }

    #[derive(Clone)]
    struct Mem(Rc<HeapRing>);

    impl Mem {
        fn new(cap: usize) -> Mem {
            Mem(Rc::new(HeapRing {
                ctl: RingCtl::default(),
                words: (0..cap / 8).map(|_| AtomicU64::new(0)).collect(),
            }))
        }

        /// The bytes (atomics are cells: written through a shared borrow).
        fn bytes(&self) -> *mut u8 {
            self.0.words.as_ptr() as *mut u8
        }
    }

    impl RingMem for Mem {
        fn ctl(&self) -> &RingCtl {
            &self.0.ctl
        }
        fn cap(&self) -> usize {
            self.0.words.len() * 8
        }
        fn copy_in(&self, at: usize, src: &[u8]) {
            assert!(at + src.len() <= self.cap());
            // SAFETY: inside the words (checked); one thread, so no access
            // to them runs alongside.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.bytes().add(at), src.len()) }
        }
        fn copy_out(&self, at: usize, dst: &mut [u8]) {
            assert!(at + dst.len() <= self.cap());
            // SAFETY: as in `copy_in`.
            unsafe {
                std::ptr::copy_nonoverlapping(self.bytes().add(at), dst.as_mut_ptr(), dst.len())
            }
        }
        fn stamp(&self, at: usize) -> &AtomicU64 {
            &self.0.words[at / 8]
        }
        fn key(&self) -> u64 {
            0
        }
    }

    #[test]
    fn bytes_cross_in_order_through_every_wrap_and_partial_write() {
        let m = Mem::new(512);
        let (mut p, mut c) = (Producer::new(m.clone()), Consumer::new(m));
        let mut sent = Vec::new();
        let mut got = Vec::new();
        let mut k = 0u8;
        for round in 0..200usize {
            let a: Vec<u8> = (0..round % 23)
                .map(|_| {
                    k = k.wrapping_add(1);
                    k
                })
                .collect();
            let b: Vec<u8> = (0..round % 7)
                .map(|_| {
                    k = k.wrapping_add(1);
                    k
                })
                .collect();
            let room = p.room().unwrap();
            let w = p.write(&[&a, &b]).unwrap();
            assert_eq!(w.n, (a.len() + b.len()).min(room), "all that fits, no more");
            sent.extend(a.iter().chain(&b).take(w.n));
            let mut out = vec![0u8; round % 41];
            let n = c.read(&mut out).unwrap();
            got.extend_from_slice(&out[..n]);
            let _ = c.publish();
        }
        let mut rest = vec![0u8; 64];
        let n = c.read(&mut rest).unwrap();
        got.extend_from_slice(&rest[..n]);
        let _ = c.publish();
        assert_eq!(got, sent);
        assert_eq!(c.available().unwrap(), 0);
        assert_eq!(p.room().unwrap(), 512 - STAMP_BYTES);
    }

    /// A ring that notes, at each copy in, how far the head was published.
    struct Watched {
        mem: Mem,
        seen: std::cell::RefCell<Vec<(usize, u64)>>,
    }

    impl RingMem for &Watched {
        fn ctl(&self) -> &RingCtl {
            self.mem.ctl()
        }
        fn cap(&self) -> usize {
            self.mem.cap()
        }
        fn copy_in(&self, at: usize, src: &[u8]) {
            if !src.is_empty() {
                // Relaxed: one thread; the value is only recorded.
                let head = self.mem.ctl().head.load(Ordering::Relaxed);
                self.seen.borrow_mut().push((at, head));
            }
            self.mem.copy_in(at, src)
        }
        fn copy_out(&self, at: usize, dst: &mut [u8]) {
            if !dst.is_empty() {
                // Relaxed: one thread; the value is only recorded.
                let tail = self.mem.ctl().tail.load(Ordering::Relaxed);
                self.seen.borrow_mut().push((at, tail));
            }
            self.mem.copy_out(at, dst)
        }
        fn stamp(&self, at: usize) -> &AtomicU64 {
            self.mem.stamp(at)
        }
        fn key(&self) -> u64 {
            0
        }
    }

    #[test]
    fn a_long_write_is_published_as_it_goes() {
        let w = Watched {
            mem: Mem::new(1 << 20),
            seen: Default::default(),
        };
        let mut p = Producer::new(&w);
        let header = [7u8; 32];
        let payload = vec![9u8; 3 * PUBLISH_EVERY + 5];
        assert_eq!(p.write(&[&header, &payload]).unwrap().n, 32 + payload.len());
        // A chunk a step: its bytes, then its length, each begun with the
        // chunks before it already published (the head at the chunk's
        // start). The first chunk holds the header and the payload's start.
        let full = chunk_bytes(PUBLISH_EVERY);
        let mut want: Vec<(usize, u64)> = vec![(16, 0), (48, 0), (8, 0)];
        for k in 1..4 {
            let at = k * full;
            want.extend([(at + 16, at as u64), (at + 8, at as u64)]);
        }
        assert_eq!(*w.seen.borrow(), want);
        let mut c = Consumer::new(&w);
        let mut out = vec![0u8; 32 + payload.len()];
        assert_eq!(c.read(&mut out).unwrap(), out.len());
        assert!(out[..32] == header && out[32..] == payload[..]);
        assert_eq!(c.read(&mut [0; 1]).unwrap(), 0, "nothing more");
    }

    #[test]
    fn a_read_gives_room_back_at_publish_and_a_long_one_as_it_goes() {
        let w = Watched {
            mem: Mem::new(1 << 20),
            seen: Default::default(),
        };
        let (mut p, mut c) = (Producer::new(&w), Consumer::new(&w));
        // Relaxed: one thread.
        let tail = || w.mem.ctl().tail.load(Ordering::Relaxed);
        // Short reads: their room comes back once, at `publish`.
        assert_eq!(p.write(&[&[1; 100]]).unwrap().n, 100);
        assert_eq!(c.read(&mut [0; 32]).unwrap(), 32);
        assert_eq!(c.read(&mut [0; 68]).unwrap(), 68);
        assert_eq!(tail(), 0, "not before publish");
        assert!(!c.publish(), "no writer waits");
        let first = chunk_bytes(100) as u64;
        assert_eq!(tail(), first, "the chunk, to the end of its line");
        assert_eq!(c.taken(), 100, "the bytes, not their stamp and padding");
        // A long read: each step begins with the steps before it given
        // back (the tail at the end of the chunk before).
        let payload = vec![9u8; 3 * RELEASE_EVERY + 5];
        assert_eq!(p.write(&[&payload]).unwrap().n, payload.len());
        w.seen.borrow_mut().clear();
        let mut out = vec![0u8; payload.len()];
        assert_eq!(c.read(&mut out).unwrap(), out.len());
        assert!(out == payload);
        let start = |k: usize| (chunk_bytes(100) + k * chunk_bytes(PUBLISH_EVERY)) as u64;
        let end = |k: usize| start(k + 1);
        // A chunk's length and its bytes are read under one tail.
        let mut tails: Vec<u64> = w.seen.borrow().iter().map(|&(_, t)| t).collect();
        tails.dedup();
        assert_eq!(tails, [first, end(0), end(1), end(2)]);
        let _ = c.publish();
        let last = start(3) + chunk_bytes(5) as u64;
        assert_eq!(tail(), last, "to the end of the last chunk's line");
        assert_eq!(c.taken(), 100 + payload.len() as u64);
    }

    #[test]
    fn a_full_ring_takes_nothing_and_an_empty_one_gives_nothing() {
        // Two lines: one chunk of 112 bytes fills it.
        let m = Mem::new(128);
        let (mut p, mut c) = (Producer::new(m.clone()), Consumer::new(m));
        assert_eq!(c.read(&mut [0; 4]).unwrap(), 0);
        assert_eq!(p.write(&[&[1; 200]]).unwrap().n, 112);
        assert_eq!(p.write(&[&[2; 1]]).unwrap().n, 0);
        assert_eq!(p.room().unwrap(), 0);
        let mut out = [0; 120];
        assert_eq!(c.read(&mut out).unwrap(), 112);
        assert_eq!(out[..112], [1; 112]);
        assert_eq!(
            p.write(&[&[2; 1]]).unwrap().n,
            0,
            "read, not yet given back"
        );
        let _ = c.publish();
        assert_eq!(p.write(&[&[2; 1]]).unwrap().n, 1);
    }

    #[test]
    fn impossible_counters_and_chunks_from_the_peer_are_typed_errors() {
        let m = Mem::new(256);
        let (mut p, mut c) = (Producer::new(m.clone()), Consumer::new(m.clone()));
        // Two chunks, at 0 and 64; the consumer inside the second.
        assert_eq!(p.write(&[&[9; 8]]).unwrap().n, 8);
        assert_eq!(p.write(&[&[9; 8]]).unwrap().n, 8);
        assert_eq!(c.read(&mut [0; 12]).unwrap(), 12);
        let head = |v: u64| m.ctl().head.store(v, Ordering::Relaxed);
        assert_eq!(c.available(), Ok(4), "the rest of the chunk, head unread");
        assert_eq!(c.read(&mut [0; 4]).unwrap(), 4);
        let ours = 128; // the chunk read, to the end of its line
        let _ = c.publish();
        // A head past what the ring holds, or behind the chunk read: with
        // no stamp at the next chunk, the head is looked at.
        for bad in [ours + 257, u64::MAX, 63, 0] {
            head(bad);
            assert_eq!(c.available(), Err(Corrupt { theirs: bad, ours }), "{bad}");
            assert!(c.prepare_sleep().is_err(), "the sleep check sees it: {bad}");
            // A read goes by the stamps: nothing to read, the head unread.
            assert_eq!(c.read(&mut [0; 4]), Ok(0), "{bad}");
        }
        // A head that still says the chunk's start (the producer stores it
        // after the stamp) says nothing new, as does one at the next chunk.
        for fine in [64, 128] {
            head(fine);
            assert_eq!(c.available(), Ok(0), "{fine}");
            assert!(c.is_drained(), "{fine}");
        }
        // One that says a chunk is there which has no stamp.
        head(192);
        assert_eq!(c.available(), Err(Corrupt { theirs: 192, ours }));
        // A stamp whose length is 0, longer than the ring, or whose
        // reserved bytes are not zero.
        head(128);
        for len in [
            [0, 0, 0, 0, 0, 0, 0, 0],
            [0, 1, 0, 0, 0, 0, 0, 0],
            [1, 0, 0, 0, 0, 0, 0, 1],
        ] {
            m.copy_in(128 + 8, &len);
            m.stamp(128).store(stamp_of(128, 0), Ordering::Release);
            let n = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as u64;
            let theirs = 128 + STAMP_BYTES as u64 + n;
            assert_eq!(c.available(), Err(Corrupt { theirs, ours }), "{len:?}");
        }
        // A stamp of another lap, or another ring's (another key), is no stamp.
        for other in [stamp_of(128 + 256, 0), stamp_of(128, 1)] {
            m.stamp(128).store(other, Ordering::Release);
            assert_eq!(c.available(), Ok(0));
        }
        // A tail ahead of what was written, or so far behind the ring
        // overflows: seen at the producer's next look at it, which a write
        // the room it knows of cannot hold makes.
        m.ctl().tail.store(u64::MAX, Ordering::Relaxed);
        assert_eq!(p.write(&[&[1; 8]]).unwrap().n, 8, "fits what it knew");
        m.ctl().tail.store(193, Ordering::Relaxed);
        assert_eq!(
            p.room(),
            Err(Corrupt {
                theirs: 193,
                ours: 192
            })
        );
        assert!(p.write(&[&[1; 100]]).is_err());
        m.ctl().tail.store(192, Ordering::Relaxed);
        assert_eq!(p.room().unwrap(), 256 - STAMP_BYTES);
        let e = Corrupt { theirs: 9, ours: 8 }.to_string();
        assert!(e.contains('9') && e.contains('8'), "{e}");
    }

    #[test]
    fn a_side_about_to_sleep_is_woken_by_the_next_move_and_not_otherwise() {
        // Four lines: three bytes and a write of 112 fill it.
        let m = Mem::new(256);
        let (mut p, mut c) = (Producer::new(m.clone()), Consumer::new(m));
        assert_eq!(p.write(&[&[1]]).unwrap(), Moved { n: 1, wake: false });
        assert!(c.prepare_sleep().unwrap(), "bytes waiting: do not sleep");
        assert_eq!(c.read(&mut [0; 1]).unwrap(), 1);
        assert!(!c.publish(), "no writer waits");
        assert!(!c.prepare_sleep().unwrap(), "empty: sleep");
        assert_eq!(p.write(&[&[2]]).unwrap(), Moved { n: 1, wake: true });
        c.woke();
        assert!(!p.write(&[&[3]]).unwrap().wake, "awake: no doorbell");
        // The writer's side.
        assert_eq!(p.write(&[&[0; 120]]).unwrap().n, 112);
        assert!(!p.prepare_wait().unwrap(), "full: wait");
        assert_eq!(c.read(&mut [0; 4]).unwrap(), 4);
        assert!(c.publish(), "the writer waits: ring");
        assert!(!c.publish(), "nothing new read: nothing to give back");
        p.done_waiting();
        assert_eq!(c.read(&mut [0; 4]).unwrap(), 4);
        assert!(!c.publish(), "the writer stopped waiting");
    }
}

/// Every interleaving of a producer and a consumer, with the sleeps and
/// doorbells the lane uses, on a ring smaller than what crosses:
/// `LOOM_MAX_PREEMPTIONS=2 RUSTFLAGS="--cfg loom" cargo test -p zerohop-std --lib --profile loom shm::ring`.
/// A lost wake-up leaves a side asleep for ever, which loom reports.
#[cfg(all(test, loom))]
mod model {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::{Arc, Condvar, Mutex};
    use loom::thread;

    struct ModelRing {
        ctl: RingCtl,
        data: Vec<UnsafeCell<u8>>,
        stamps: Vec<AtomicU64>,
    }

    #[derive(Clone)]
    struct Mem(Arc<ModelRing>);

    impl RingMem for Mem {
        fn ctl(&self) -> &RingCtl {
            &self.0.ctl
        }
        fn cap(&self) -> usize {
            self.0.data.len()
        }
        fn copy_in(&self, at: usize, src: &[u8]) {
            for (i, &b) in src.iter().enumerate() {
                // SAFETY: loom checks that no read of this byte races the write.
                self.0.data[at + i].with_mut(|p| unsafe { *p = b });
            }
        }
        fn copy_out(&self, at: usize, dst: &mut [u8]) {
            for (i, d) in dst.iter_mut().enumerate() {
                // SAFETY: as above.
                *d = self.0.data[at + i].with(|p| unsafe { *p });
            }
        }
        fn stamp(&self, at: usize) -> &AtomicU64 {
            &self.0.stamps[at / CHUNK_ALIGN]
        }
        fn key(&self) -> u64 {
            0
        }
    }

    /// A doorbell: rung, and waited for.
    #[derive(Default)]
    struct Bell {
        rung: Mutex<bool>,
        cv: Condvar,
    }

    impl Bell {
        fn ring(&self) {
            *self.rung.lock().unwrap() = true;
            self.cv.notify_one();
        }
        fn wait(&self) {
            let mut r = self.rung.lock().unwrap();
            while !*r {
                r = self.cv.wait(r).unwrap();
            }
            *r = false;
        }
    }

    #[test]
    fn bytes_cross_whole_and_in_order_and_no_wake_up_is_lost() {
        loom::model(|| {
            let mem = Mem(Arc::new(ModelRing {
                // Two chunks of a byte each: the three bytes wrap it.
                ctl: RingCtl::default(),
                data: (0..2 * CHUNK_ALIGN).map(|_| UnsafeCell::new(0)).collect(),
                stamps: (0..2).map(|_| AtomicU64::new(0)).collect(),
            }));
            let (to_reader, to_writer) = (Arc::new(Bell::default()), Arc::new(Bell::default()));
            let (m, rb, wb) = (mem.clone(), Arc::clone(&to_reader), Arc::clone(&to_writer));
            let writer = thread::spawn(move || {
                let mut p = Producer::new(m);
                let mut sent = 0;
                let msg = [1u8, 2, 3];
                while sent < msg.len() {
                    let w = p.write(&[&msg[sent..]]).unwrap();
                    sent += w.n;
                    if w.wake {
                        rb.ring();
                    }
                    if sent < msg.len() && w.n == 0 && !p.prepare_wait().unwrap() {
                        wb.wait();
                        p.done_waiting();
                    } else {
                        p.done_waiting();
                    }
                }
            });
            let mut c = Consumer::new(mem);
            let mut got = Vec::new();
            while got.len() < 3 {
                let mut b = [0u8; 2];
                let n = c.read(&mut b).unwrap();
                got.extend_from_slice(&b[..n]);
                if c.publish() {
                    to_writer.ring();
                }
                if got.len() < 3 && n == 0 && !c.prepare_sleep().unwrap() {
                    to_reader.wait();
                }
                c.woke();
            }
            writer.join().unwrap();
            assert_eq!(got, [1, 2, 3]);
        });
    }

    /// A lane dropped unfinished ends its ring, then its buffer is written
    /// again (the next lease); a consumer that copied a byte of that buffer
    /// and finds the ring not ended copied the message's byte, never the
    /// new one. The byte is an atomic here: loom checks the order, and a
    /// real copy is the same loads without the name.
    #[test]
    fn a_copy_that_saw_a_reused_byte_sees_the_ring_ended() {
        loom::model(|| {
            let ctl = Arc::new(RingCtl::default());
            let byte = Arc::new(AtomicU32::new(1)); // the message's byte
            let (c, b) = (Arc::clone(&ctl), Arc::clone(&byte));
            let producer = thread::spawn(move || {
                c.end();
                b.store(2, Ordering::Relaxed); // the buffer's next lease
            });
            let copied = byte.load(Ordering::Relaxed);
            if ctl.copied_intact() {
                assert_eq!(copied, 1, "a reused byte delivered as the message's");
            }
            producer.join().unwrap();
        });
    }

    /// The same, the buffer written again by another thread, which leased
    /// it after the dropping thread gave it back (the pool's handoff, a
    /// release and an acquire): with release and acquire fences in `end`
    /// and `copied_intact` loom finds the reused byte delivered; with
    /// SeqCst fences it does not.
    #[test]
    fn a_copy_that_saw_a_byte_reused_by_another_thread_sees_the_ring_ended() {
        loom::model(|| {
            let ctl = Arc::new(RingCtl::default());
            let byte = Arc::new(AtomicU32::new(1));
            let pool = Arc::new(AtomicU32::new(0)); // 1: the buffer given back
            let (c, p) = (Arc::clone(&ctl), Arc::clone(&pool));
            let dropper = thread::spawn(move || {
                c.end();
                p.store(1, Ordering::Release);
            });
            let (b, p) = (Arc::clone(&byte), Arc::clone(&pool));
            let next_lease = thread::spawn(move || {
                if p.load(Ordering::Acquire) == 1 {
                    b.store(2, Ordering::Relaxed);
                }
            });
            let copied = byte.load(Ordering::Relaxed);
            if ctl.copied_intact() {
                assert_eq!(copied, 1, "a reused byte delivered as the message's");
            }
            dropper.join().unwrap();
            next_lease.join().unwrap();
        });
    }
}
