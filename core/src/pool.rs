//! The slab pool: registered buffers in size classes, leased and released in O(1).
//!
//! Memory comes in chunks (2 MiB by default) from a [`ChunkSource`], which
//! registers each chunk **once** with the NIC; every buffer carved from the
//! chunk carries the chunk's keys. A size class's free buffers form a linked
//! list threaded through a fixed table of slot descriptors, so lease and
//! release are a pop and a push under a short spin lock. Growth (allocate +
//! register, microseconds) happens *outside* the lock, with its bytes reserved
//! against the budget first so concurrent growers cannot overshoot it.
//! Requests larger than the largest class take the oversize path: a dedicated
//! chunk. A released one is kept (the last [`SPARE_OVERSIZE`]) for the next
//! oversize request it fits, so a stream of large messages does not fault in
//! and register fresh memory for each one; kept buffers go back to the source
//! when the budget or the chunk table needs their room, or with the pool.
//! Idle chunks of one class go back too when another class needs their
//! memory or their descriptors (a burst of one class must not starve the
//! others for good); free buffers of a chunk that still holds a lease keep
//! their descriptors.
//!
//! Capacity is fixed when the pool is made: its descriptor tables come from
//! a [`PoolTables`] — [`InlineTables`] (arrays in the pool itself, for
//! firmware and statics) or any boxed slices a std caller provides.

use core::ops::Deref;

use crate::error::PoolError;
use crate::mem::{Access, MrHandle, RawMemory, Region, Registrar};
use crate::Error;

/// Whether a class that cannot grow takes a free buffer of a larger one
/// (the `borrow-larger` feature; always in core's own tests).
const BORROW_LARGER: bool = cfg!(any(test, feature = "borrow-larger"));

/// Most size classes a pool can have.
pub const MAX_CLASSES: usize = 8;
const NONE: u32 = u32::MAX;
/// Class index used for oversize slots.
const OVERSIZE: usize = MAX_CLASSES;
/// Released oversize buffers kept for reuse, at most.
pub const SPARE_OVERSIZE: usize = 2;

/// Ascending buffer sizes, at most [`MAX_CLASSES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct SizeClasses {
    sizes: [usize; MAX_CLASSES],
    n: usize,
}

impl SizeClasses {
    /// 256 B, 1 KiB, 4 KiB, 16 KiB, 64 KiB, 256 KiB, 1 MiB: each four times
    /// the last, so a buffer holds at most four times the bytes asked for (a
    /// gossiped block of 100 KiB takes 256 KiB, not 1 MiB). One slot is left
    /// for a wire's own frame size (the verbs receive ring's).
    pub const DEFAULT: SizeClasses = SizeClasses {
        sizes: [
            256,
            1 << 10,
            4 << 10,
            16 << 10,
            64 << 10,
            256 << 10,
            1 << 20,
            0,
        ],
        n: 7,
    };

    /// Classes from a list: non-empty, non-zero, strictly ascending, at most
    /// [`MAX_CLASSES`]. A `const fn`: a constant list is checked at compile time.
    pub const fn new(sizes: &[usize]) -> Result<SizeClasses, PoolError> {
        if sizes.is_empty() || sizes.len() > MAX_CLASSES || sizes[0] == 0 {
            return Err(PoolError::BadConfig);
        }
        let mut c = SizeClasses {
            sizes: [0; MAX_CLASSES],
            n: sizes.len(),
        };
        let mut i = 0;
        while i < sizes.len() {
            if i > 0 && sizes[i - 1] >= sizes[i] {
                return Err(PoolError::BadConfig);
            }
            c.sizes[i] = sizes[i];
            i += 1;
        }
        Ok(c)
    }

    /// The sizes, ascending.
    pub fn as_slice(&self) -> &[usize] {
        &self.sizes[..self.n]
    }

    /// The largest class.
    pub fn largest(&self) -> usize {
        self.sizes[self.n - 1]
    }

    /// Index of the smallest class that holds `len` bytes.
    pub(crate) fn class_for(&self, len: usize) -> Option<usize> {
        self.as_slice().iter().position(|&s| s >= len)
    }
}

/// How a pool grows and what it may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct PoolConfig {
    /// Buffer sizes.
    pub classes: SizeClasses,
    /// Bytes taken from the memory source per growth step.
    pub chunk_bytes: usize,
    /// Alignment asked of the memory source for every chunk (a power of two).
    pub chunk_align: usize,
    /// Most bytes the pool may hold from its source, chunks and oversize buffers together.
    pub budget: usize,
    /// What each chunk's registration allows (receive pools need `LOCAL_WRITE`).
    pub access: Access,
}

impl PoolConfig {
    /// Default classes, 2 MiB chunks, page alignment, local-write access, and `budget`.
    pub const fn with_budget(budget: usize) -> PoolConfig {
        PoolConfig {
            classes: SizeClasses::DEFAULT,
            chunk_bytes: 2 << 20,
            chunk_align: 4096,
            budget,
            access: Access::LOCAL_WRITE,
        }
    }

    /// This configuration fitted to its budget: chunks no larger than the
    /// budget (rounded down to the alignment), and the classes that no
    /// longer fit a chunk dropped. A budget under one chunk then still
    /// serves leases up to itself, where 2 MiB chunks would serve none.
    #[must_use]
    pub fn fitted(mut self) -> PoolConfig {
        let room = self.budget & !(self.chunk_align.max(1) - 1);
        if self.chunk_bytes <= room {
            return self;
        }
        self.chunk_bytes = room;
        let fit = self
            .classes
            .as_slice()
            .iter()
            .take_while(|&&c| c <= room)
            .count();
        if let Ok(c) = SizeClasses::new(&self.classes.as_slice()[..fit]) {
            self.classes = c;
        }
        self
    }

    /// The longest lease a pool of this configuration can serve with
    /// nothing else leased: the largest class if its chunk fits the budget,
    /// and an oversize buffer up to the budget (rounded down to the
    /// alignment). What a receiver may announce as its longest message.
    pub fn largest_lease(&self) -> usize {
        let largest = self.classes.largest();
        let class = if self.chunk_bytes <= self.budget {
            largest
        } else {
            0
        };
        let oversize = self.budget & !(self.chunk_align.max(1) - 1);
        if oversize > largest {
            oversize
        } else {
            class
        }
    }

    fn validate(&self) -> Result<(), PoolError> {
        // Classes are never empty and never zero (SizeClasses::new), so a
        // chunk that holds the largest is not empty either.
        let ok = self.chunk_bytes <= u32::MAX as usize
            && self.chunk_align.is_power_of_two()
            && self.classes.largest() <= self.chunk_bytes;
        if ok {
            Ok(())
        } else {
            Err(PoolError::BadConfig)
        }
    }
}

/// A chunk of memory, with its registration when the source has a NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Registered {
    /// The memory.
    pub region: Region,
    /// Its registration (one per chunk), if any.
    pub mr: Option<MrHandle>,
}

/// Where a pool's chunks come from.
pub trait ChunkSource {
    /// Allocates (and registers, if this source has a NIC) `len` bytes aligned to `align`.
    fn obtain(&self, len: usize, align: usize, access: Access) -> Result<Registered, Error>;
    /// Deregisters and frees a chunk from `obtain`. Failures are the source's
    /// to record: a pool tearing down cannot do anything better with them.
    fn give_back(&self, chunk: Registered);
}

/// The usual [`ChunkSource`]: memory from `M`, each chunk registered once with
/// `R` when there is one.
#[derive(Debug)]
pub struct Chunks<M, R> {
    /// The memory source.
    pub memory: M,
    /// The NIC, if chunks must be registered.
    pub registrar: Option<R>,
}

impl<M: RawMemory, R: Registrar> ChunkSource for Chunks<M, R> {
    fn obtain(&self, len: usize, align: usize, access: Access) -> Result<Registered, Error> {
        let region = self.memory.alloc(len, align)?;
        let mr = match &self.registrar {
            None => None,
            Some(r) => match r.register(region, access) {
                Ok(h) => Some(h),
                Err(e) => {
                    let _ = self.memory.free(region);
                    return Err(e);
                }
            },
        };
        Ok(Registered { region, mr })
    }

    fn give_back(&self, chunk: Registered) {
        if let (Some(r), Some(mr)) = (&self.registrar, chunk.mr) {
            if r.deregister(mr).is_err() {
                warn!("pool: deregistering a chunk failed; freeing it anyway");
            }
        }
        if self.memory.free(chunk.region).is_err() {
            warn!("pool: freeing a chunk failed");
        }
    }
}

/// One leased buffer, as the pool describes it. Only a [`Lease`] holds one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct SlotTicket {
    index: u32,
    /// Its size class (`OVERSIZE` for an oversize buffer).
    class: u8,
    /// The whole buffer (its class size, or the oversize length rounded up).
    pub region: Region,
    /// The local key of the chunk's registration, if any: what a work
    /// request quotes. (The whole registration is the pool's, under its
    /// lock, [`Pool::registration`]: a lease moves with every message, and
    /// carried whole it was as large again.)
    pub lkey: Option<u32>,
}

impl SlotTicket {
    /// A placeholder (fills a cache's unused places; never released).
    pub(crate) const EMPTY: SlotTicket = SlotTicket {
        index: NONE,
        class: OVERSIZE as u8,
        region: Region {
            addr: 0,
            len: 0,
            kind: crate::mem::MemKind::Host,
        },
        lkey: None,
    };
}

/// Told when a buffer comes back to a pool that has refused a lease since
/// it was last told: a thread waiting for a buffer sleeps on it instead of
/// looking again at a fixed interval. The pool rings after its lock is let
/// go, from whichever thread gives the buffer back.
pub trait Bell {
    /// Whether [`ring`](Self::ring) does anything: `false` compiles the
    /// pool's bookkeeping for it out (a firmware image's [`NoBell`]).
    const RINGS: bool = true;
    /// A buffer came back after a refusal.
    fn ring(&self);
}

/// No one to tell: a pool whose users never wait for a buffer.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoBell;

impl Bell for NoBell {
    const RINGS: bool = false;
    #[inline]
    fn ring(&self) {}
}

/// What a [`Lease`] needs of its pool. Object-safe, so a std caller can hold
/// `Arc<dyn Pool + Send + Sync>`.
pub trait Pool {
    /// Takes a buffer of at least `len` bytes. Prefer [`Lease::take`].
    fn take_slot(&self, len: usize) -> Result<SlotTicket, Error>;
    /// Returns a buffer. Only [`Lease`]'s `Drop` calls this, exactly once per ticket.
    fn release_slot(&self, ticket: &SlotTicket);
    /// The registration of the chunk a leased buffer lives in, if any
    /// (looked up under the pool's lock: prefer [`Lease::lkey`] on a hot path).
    fn registration(&self, ticket: &SlotTicket) -> Option<MrHandle>;
}

/// A leased pool buffer. Dropping it returns the buffer to the pool; it cannot
/// be cloned, so it is released exactly once.
#[derive(Debug)]
pub struct Lease<P>
where
    P: Deref,
    P::Target: Pool,
{
    pool: P,
    ticket: SlotTicket,
    /// Where the message starts in the buffer (past a header read in place;
    /// a u32 keeps the lease small: headers are short).
    start: u32,
    len: usize,
}

impl<P> Lease<P>
where
    P: Deref,
    P::Target: Pool,
{
    /// Leases a buffer of at least `len` bytes from `pool` (a `&SlabPool`, an `Arc<..>`, ...).
    #[inline]
    pub fn take(pool: P, len: usize) -> Result<Self, Error> {
        let ticket = pool.take_slot(len)?;
        Ok(Lease {
            pool,
            ticket,
            start: 0,
            len,
        })
    }

    /// A lease over a ticket its pool has already handed out (a cache's fast path).
    #[inline]
    pub(crate) fn from_ticket(pool: P, ticket: SlotTicket, len: usize) -> Self {
        Lease {
            pool,
            ticket,
            start: 0,
            len,
        }
    }

    /// The pool's ticket for this buffer (what [`SlabPool::could_serve_later`] takes).
    pub fn ticket(&self) -> &SlotTicket {
        &self.ticket
    }

    /// The message length (at most [`capacity`](Self::capacity)).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the message is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Room for the message: the buffer's size, less what [`advance`](Self::advance) skipped.
    pub fn capacity(&self) -> usize {
        self.ticket.region.len - self.start as usize
    }

    /// Drops the first `n` bytes of the message from view (a header the
    /// wire read in place): the message then starts `n` bytes further into
    /// the buffer, so a frame received into one buffer, header first, is
    /// handed on without moving its payload. More than the message is refused.
    pub fn advance(&mut self, n: usize) -> Result<(), Error> {
        let start = u32::try_from(n)
            .ok()
            .and_then(|n| self.start.checked_add(n));
        let (Some(start), true) = (start, n <= self.len) else {
            return Err(Error::TooLarge {
                len: n,
                max: self.len,
            });
        };
        self.start = start;
        self.len -= n;
        Ok(())
    }

    /// Sets the message length; more than the capacity is refused.
    pub fn set_len(&mut self, len: usize) -> Result<(), Error> {
        if len > self.capacity() {
            return Err(Error::TooLarge {
                len,
                max: self.capacity(),
            });
        }
        self.len = len;
        Ok(())
    }

    /// The message bytes' region `[addr, addr + len)`.
    pub fn region(&self) -> Region {
        Region {
            addr: self.device_ptr(),
            len: self.len,
            ..self.ticket.region
        }
    }

    /// The whole buffer's region (from its first byte, whatever was advanced).
    pub fn buffer(&self) -> Region {
        self.ticket.region
    }

    /// The message's address, for a GPU kernel or a NIC work request.
    pub fn device_ptr(&self) -> u64 {
        self.ticket.region.addr + u64::from(self.start)
    }

    /// The registration of the chunk this buffer lives in (its lkey/rkey),
    /// if any: looked up in the pool (see [`lkey`](Self::lkey)).
    pub fn mr(&self) -> Option<MrHandle> {
        self.pool.registration(&self.ticket)
    }

    /// The local key of the registration of the chunk this buffer lives
    /// in, if any: what a work request quotes, without a look in the pool.
    #[inline]
    pub fn lkey(&self) -> Option<u32> {
        self.ticket.lkey
    }

    /// The pool it came from.
    pub fn pool(&self) -> &P {
        &self.pool
    }
}

impl<P> Drop for Lease<P>
where
    P: Deref,
    P::Target: Pool,
{
    #[inline]
    fn drop(&mut self) {
        self.pool.release_slot(&self.ticket);
    }
}

/// Counters and gauges of a pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct PoolStats {
    /// Bytes in outstanding leases (each counted at its buffer size).
    pub used_bytes: usize,
    /// Bytes held from the memory source (chunks and oversize buffers).
    pub reserved_bytes: usize,
    /// The budget.
    pub budget: usize,
    /// Leases outstanding.
    pub leases: usize,
    /// Chunks (and oversize buffers) obtained from the source, ever.
    pub grows: u64,
    /// Chunks registered, ever (one per chunk from a source with a NIC).
    pub registrations: u64,
    /// Oversize leases served, ever.
    pub oversize: u64,
    /// Of those, served from a kept (released) oversize buffer.
    pub oversize_reused: u64,
    /// Idle chunks (or kept oversize buffers) given back to make room, ever.
    pub reclaimed: u64,
    /// Chunks and oversize buffers given back to the source, ever (while
    /// the pool lives: `grows - given_back` are held now).
    pub given_back: u64,
}

/// One chunk descriptor (opaque): an entry of a pool's chunk table.
#[derive(Clone, Copy, Debug)]
pub struct Chunk {
    mem: Option<Registered>,
    /// Next byte not yet carved into slots.
    carved: usize,
    /// Leases outstanding in this chunk: a chunk with none can be reclaimed.
    in_use: u32,
    /// Of those, a caller's (scratch for `could_serve_later`).
    kept: u32,
    /// The size class it is carved for (`OVERSIZE` for an oversize buffer).
    class: u8,
    /// Free-list link for unused chunk descriptors.
    next_free: u32,
}

impl Chunk {
    /// An unused descriptor.
    pub const EMPTY: Chunk = EMPTY_CHUNK;
}

impl Slot {
    /// An unused descriptor.
    pub const EMPTY: Slot = EMPTY_SLOT;
}

/// Where a pool keeps its descriptor tables. The table lengths are the pool's
/// capacity: how many chunks it can hold, and how many buffers.
pub trait PoolTables {
    /// The chunk table.
    fn chunks(&mut self) -> &mut [Chunk];
    /// The buffer (slot) table.
    fn slots(&mut self) -> &mut [Slot];
}

/// Tables stored inline: `CHUNKS` chunks and `SLOTS` buffers, no heap.
#[derive(Debug)]
pub struct InlineTables<const CHUNKS: usize, const SLOTS: usize> {
    chunks: [Chunk; CHUNKS],
    slots: [Slot; SLOTS],
}

impl<const CHUNKS: usize, const SLOTS: usize> InlineTables<CHUNKS, SLOTS> {
    /// Empty tables; `const`, so a pool's tables can be built in a `static`.
    pub const fn new() -> Self {
        InlineTables {
            chunks: [Chunk::EMPTY; CHUNKS],
            slots: [Slot::EMPTY; SLOTS],
        }
    }
}

impl<const CHUNKS: usize, const SLOTS: usize> Default for InlineTables<CHUNKS, SLOTS> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const CHUNKS: usize, const SLOTS: usize> PoolTables for InlineTables<CHUNKS, SLOTS> {
    fn chunks(&mut self) -> &mut [Chunk] {
        &mut self.chunks
    }
    fn slots(&mut self) -> &mut [Slot] {
        &mut self.slots
    }
}

const EMPTY_CHUNK: Chunk = Chunk {
    mem: None,
    carved: 0,
    in_use: 0,
    kept: 0,
    class: 0,
    next_free: NONE,
};

/// One buffer descriptor (opaque): an entry of a pool's slot table.
#[derive(Clone, Copy, Debug)]
pub struct Slot {
    chunk: u32,
    offset: u32,
    next: u32,
    class: u8,
}

const EMPTY_SLOT: Slot = Slot {
    chunk: NONE,
    offset: 0,
    next: NONE,
    class: 0,
};

#[derive(Debug)]
struct State<T> {
    tables: T,
    chunk_cap: usize,
    slot_cap: usize,
    chunks_made: usize,
    free_chunks: u32,
    slots_made: usize,
    /// Free slots per class; index `OVERSIZE` holds spare descriptors of released oversize buffers.
    free: [u32; MAX_CLASSES + 1],
    /// Growths in flight (memory reserved, chunk not yet installed).
    growing: u32,
    /// The chunk each class is carving, or `NONE`.
    carving: [u32; MAX_CLASSES],
    /// Released oversize chunks kept for reuse, or `NONE`.
    spare_oversize: [u32; SPARE_OVERSIZE],
    stats: PoolStats,
    /// A lease was refused since the bell last rang (see [`Bell`]).
    wanted: bool,
}

/// The slab pool over a [`ChunkSource`] `S`, with its descriptor tables in
/// `T`, telling `B` when a buffer comes back after a refusal. It is `Sync`
/// when `S` and `T` are `Send` and `B` is `Sync`: lease from many threads at once.
pub struct SlabPool<S: ChunkSource, T: PoolTables, B: Bell = NoBell> {
    source: S,
    config: PoolConfig,
    state: crate::sync::Mutex<State<T>>,
    bell: B,
}

impl<S: ChunkSource, T: PoolTables, B: Bell> core::fmt::Debug for SlabPool<S, T, B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SlabPool")
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl<S: ChunkSource, T: PoolTables> SlabPool<S, T> {
    /// A pool that grows from `source` as `config` says, with no bell. Nothing is allocated yet.
    pub fn new(source: S, config: PoolConfig, tables: T) -> Result<Self, PoolError> {
        Self::with_bell(source, config, tables, NoBell)
    }
}

impl<S: ChunkSource, T: PoolTables, B: Bell> SlabPool<S, T, B> {
    /// A pool that grows from `source` as `config` says and rings `bell` when
    /// a buffer comes back after a refusal. Nothing is allocated yet.
    pub fn with_bell(
        source: S,
        config: PoolConfig,
        mut tables: T,
        bell: B,
    ) -> Result<Self, PoolError> {
        config.validate()?;
        let chunk_cap = tables.chunks().len();
        let slot_cap = tables.slots().len();
        if chunk_cap == 0
            || slot_cap == 0
            || chunk_cap >= NONE as usize
            || slot_cap >= NONE as usize
        {
            return Err(PoolError::BadConfig);
        }
        tables.chunks().fill(Chunk::EMPTY);
        tables.slots().fill(Slot::EMPTY);
        Ok(SlabPool {
            source,
            config,
            state: crate::sync::Mutex::new(State {
                tables,
                chunk_cap,
                slot_cap,
                chunks_made: 0,
                free_chunks: NONE,
                slots_made: 0,
                growing: 0,
                free: [NONE; MAX_CLASSES + 1],
                carving: [NONE; MAX_CLASSES],
                spare_oversize: [NONE; SPARE_OVERSIZE],
                stats: PoolStats {
                    budget: config.budget,
                    ..PoolStats::default()
                },
                wanted: false,
            }),
            bell,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// The memory source.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// The bell rung when a buffer comes back after a refusal.
    pub fn bell(&self) -> &B {
        &self.bell
    }

    /// Bytes in outstanding leases, exactly.
    pub fn used_bytes(&self) -> usize {
        self.state.lock().stats.used_bytes
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> PoolStats {
        self.state.lock().stats
    }

    /// Leases a buffer of at least `len` bytes (shorthand for [`Lease::take`]).
    pub fn lease(&self, len: usize) -> Result<Lease<&Self>, Error> {
        Lease::take(self, len)
    }

    /// Pops a free slot of `class`, or carves one from the class's chunk.
    fn try_fast(&self, st: &mut State<T>, class: usize) -> Result<Option<u32>, PoolError> {
        let size = self.config.classes.sizes[class];
        if let Some(head) = Self::pop_free(st, class) {
            return Ok(Some(head));
        }
        let c = st.carving[class];
        if c == NONE {
            return Ok(None);
        }
        let chunk = st.tables.chunks()[c as usize];
        let chunk_len = chunk.mem.map_or(0, |m| m.region.len);
        if chunk.carved + size > chunk_len {
            return Ok(None);
        }
        let Some(index) = Self::slot_descriptor(st) else {
            return Err(PoolError::TooManyBuffers { slots: st.slot_cap });
        };
        let offset = chunk.carved as u32;
        st.tables.chunks()[c as usize].carved += size;
        st.tables.slots()[index as usize] = Slot {
            chunk: c,
            offset,
            next: NONE,
            class: class as u8,
        };
        Ok(Some(index))
    }

    /// Pops the head of `class`'s free list, if any.
    #[inline]
    fn pop_free(st: &mut State<T>, class: usize) -> Option<u32> {
        let head = st.free[class];
        if head == NONE {
            return None;
        }
        st.free[class] = st.tables.slots()[head as usize].next;
        Some(head)
    }

    /// Takes one chunk with no outstanding lease out of the pool: a class
    /// chunk's free slots are unlinked (their descriptors become spares) and
    /// its memory is returned for the caller to give back outside the lock.
    /// With `for_slots`, a class chunk: a kept oversize buffer holds no
    /// slot descriptor. O(chunks + free slots of that class): a cold path,
    /// run only at the budget or when descriptors run out, kept out of line
    /// (the lease path it would sit in is the firmware's largest function).
    #[inline(never)]
    fn reclaim_idle(st: &mut State<T>, for_slots: bool) -> Option<Registered> {
        // A kept oversize buffer first: nothing points into it.
        if let Some(k) = st.spare_oversize.iter().position(|&c| c != NONE) {
            if !for_slots {
                let c = core::mem::replace(&mut st.spare_oversize[k], NONE);
                let mem = Self::free_chunk(st, c);
                st.stats.reclaimed += u64::from(mem.is_some());
                return mem;
            }
        }
        let made = st.chunks_made;
        // Idle oversize chunks are all kept spares (passed over above, or
        // left for slots): a class chunk.
        let victim = st.tables.chunks()[..made]
            .iter()
            .position(|c| c.mem.is_some() && c.in_use == 0 && usize::from(c.class) < OVERSIZE)?
            as u32;
        let class = st.tables.chunks()[victim as usize].class as usize;
        // Unlink the victim's slots from the class free list, keeping the rest in order.
        let mut prev = NONE;
        let mut at = st.free[class];
        while at != NONE {
            let next = st.tables.slots()[at as usize].next;
            if st.tables.slots()[at as usize].chunk == victim {
                if prev == NONE {
                    st.free[class] = next;
                } else {
                    st.tables.slots()[prev as usize].next = next;
                }
                st.tables.slots()[at as usize] = Slot {
                    next: st.free[OVERSIZE],
                    ..Slot::EMPTY
                };
                st.free[OVERSIZE] = at;
            } else {
                prev = at;
            }
            at = next;
        }
        if st.carving[class] == victim {
            st.carving[class] = NONE;
        }
        let mem = Self::free_chunk(st, victim);
        st.stats.reclaimed += u64::from(mem.is_some());
        mem
    }

    /// Empties chunk descriptor `c` (no lease in it) onto the free list and
    /// returns its memory, for the caller to give back outside the lock.
    fn free_chunk(st: &mut State<T>, c: u32) -> Option<Registered> {
        let mem = st.tables.chunks()[c as usize].mem.take();
        st.tables.chunks()[c as usize] = Chunk {
            next_free: st.free_chunks,
            ..Chunk::EMPTY
        };
        st.free_chunks = c;
        if let Some(m) = mem {
            st.stats.reserved_bytes -= m.region.len;
            st.stats.given_back += 1;
        }
        mem
    }

    /// Serves an oversize request of `grow_len` bytes from a kept buffer
    /// that fits it without wasting more than as much again.
    fn reuse_oversize(&self, st: &mut State<T>, grow_len: usize) -> Option<SlotTicket> {
        let (k, len) = (0..SPARE_OVERSIZE).find_map(|k| {
            let c = st.spare_oversize[k];
            if c == NONE {
                return None;
            }
            let len = st.tables.chunks()[c as usize]
                .mem
                .map_or(0, |m| m.region.len);
            (len >= grow_len && len / 2 <= grow_len).then_some((k, len))
        })?;
        let index = Self::slot_descriptor(st)?;
        let c = core::mem::replace(&mut st.spare_oversize[k], NONE);
        Self::oversize_slot(st, index, c);
        st.stats.oversize_reused += 1;
        Some(self.finish_take(st, index, None, len))
    }

    /// Points slot descriptor `index` at the whole of oversize chunk `chunk`.
    fn oversize_slot(st: &mut State<T>, index: u32, chunk: u32) {
        st.tables.slots()[index as usize] = Slot {
            chunk,
            offset: 0,
            next: NONE,
            class: OVERSIZE as u8,
        };
        st.stats.oversize += 1;
    }

    /// Whether another thread is obtaining a chunk now (outside the lock).
    fn growth_in_flight(st: &State<T>) -> bool {
        st.growing > 0
    }

    fn chunk_descriptor(st: &mut State<T>) -> Option<u32> {
        if st.free_chunks != NONE {
            let i = st.free_chunks;
            st.free_chunks = st.tables.chunks()[i as usize].next_free;
            return Some(i);
        }
        if st.chunks_made < st.chunk_cap {
            st.chunks_made += 1;
            return Some((st.chunks_made - 1) as u32);
        }
        None
    }

    /// Whether a slot descriptor is free or can still be made.
    fn slot_free(st: &State<T>) -> bool {
        st.free[OVERSIZE] != NONE || st.slots_made < st.slot_cap
    }

    fn slot_descriptor(st: &mut State<T>) -> Option<u32> {
        let head = st.free[OVERSIZE];
        if head != NONE {
            st.free[OVERSIZE] = st.tables.slots()[head as usize].next;
            return Some(head);
        }
        if st.slots_made < st.slot_cap {
            st.slots_made += 1;
            return Some((st.slots_made - 1) as u32);
        }
        None
    }

    /// Slow path: reserve budget and descriptors under the lock, obtain the
    /// chunk outside it, install it under the lock again.
    /// `Ok(None)`: over the budget while another growth is in flight; retry.
    fn grow(&self, class: Option<usize>, len: usize) -> Result<Option<SlotTicket>, Error> {
        let align = self.config.chunk_align;
        let grow_len = match class {
            Some(_) => self.config.chunk_bytes,
            None => len.checked_next_multiple_of(align).ok_or(Error::TooLarge {
                len,
                max: self.config.budget,
            })?,
        };
        let chunk_index = {
            let mut st = self.state.lock();
            if class.is_none() {
                if let Some(ticket) = self.reuse_oversize(&mut st, grow_len) {
                    return Ok(Some(ticket));
                }
            }
            // At the budget, idle chunks of other classes go back to the source
            // first (in batches, given back outside the lock): a class must not
            // starve while another hoards free memory. So with descriptors,
            // which run out first when a burst of one class carves them all
            // (and they stay with its chunks).
            let over = |st: &State<T>| {
                st.stats
                    .reserved_bytes
                    .checked_add(grow_len)
                    .is_none_or(|total| total > self.config.budget)
            };
            let room_short = |st: &State<T>| {
                over(st) || (st.free_chunks == NONE && st.chunks_made == st.chunk_cap)
            };
            let short = |st: &State<T>| room_short(st) || !Self::slot_free(st);
            while short(&st) {
                let mut batch: [Option<Registered>; 4] = [None; 4];
                // Only descriptors short: a kept oversize buffer has none to give.
                let for_slots = !room_short(&st);
                for slot in batch.iter_mut() {
                    if !short(&st) {
                        break;
                    }
                    *slot = Self::reclaim_idle(&mut st, for_slots);
                }
                if batch[0].is_none() {
                    break;
                }
                drop(st);
                for m in batch.into_iter().flatten() {
                    self.source.give_back(m);
                }
                st = self.state.lock();
            }
            // A growth that completed since our fast path looked may have
            // left a free buffer, and descriptors freed above may serve the
            // room left in the class's chunk: look again under this lock.
            if let Some(c) = class {
                if let Some(index) = self.try_fast(&mut st, c)? {
                    return Ok(Some(self.finish_take(&mut st, index, class, 0)));
                }
            }
            if over(&st) {
                // Another thread's chunk is on its way: its buffers may serve
                // us, so wait for it rather than report a false exhaustion.
                if Self::growth_in_flight(&st) {
                    return Ok(None);
                }
                return Err(PoolError::Exhausted {
                    used: st.stats.reserved_bytes,
                    cap: self.config.budget,
                }
                .into());
            }
            // The chunk needs a slot descriptor too; check now so a full
            // slot table fails before any memory is taken.
            if !Self::slot_free(&st) {
                return Err(PoolError::TooManyBuffers { slots: st.slot_cap }.into());
            }
            let i = Self::chunk_descriptor(&mut st).ok_or(PoolError::TooManyChunks {
                chunks: st.chunk_cap,
            })?;
            st.stats.reserved_bytes += grow_len;
            st.growing += 1;
            i
        };
        let obtained = self
            .source
            .obtain(grow_len, align, self.config.access)
            .and_then(|m| {
                // `align` is a power of two (checked with the config): a mask,
                // not a 64-bit division (a library call on 32-bit targets).
                if m.region.addr & (align as u64 - 1) != 0 {
                    self.source.give_back(m);
                    Err(Error::Misaligned {
                        addr: m.region.addr,
                        align,
                    })
                } else if m.region.len < grow_len {
                    self.source.give_back(m);
                    Err(Error::OutOfMemory { len: grow_len })
                } else {
                    Ok(m)
                }
            });
        let mut st = self.state.lock();
        st.growing -= 1;
        let mem = match obtained {
            Ok(m) => m,
            Err(e) => {
                st.stats.reserved_bytes -= grow_len;
                st.tables.chunks()[chunk_index as usize] = Chunk {
                    next_free: st.free_chunks,
                    ..EMPTY_CHUNK
                };
                st.free_chunks = chunk_index;
                return Err(e);
            }
        };
        st.stats.grows += 1;
        st.stats.registrations += u64::from(mem.mr.is_some());
        st.tables.chunks()[chunk_index as usize] = Chunk {
            mem: Some(Registered {
                region: Region {
                    len: grow_len,
                    ..mem.region
                },
                mr: mem.mr,
            }),
            carved: 0,
            in_use: 0,
            kept: 0,
            class: class.map_or(OVERSIZE as u8, |c| c as u8),
            next_free: NONE,
        };
        let index = match class {
            Some(class) => {
                st.carving[class] = chunk_index;
                match self.try_fast(&mut st, class) {
                    Ok(Some(i)) => i,
                    // Another thread emptied the slot table meanwhile; the chunk
                    // stays for later leases of this class.
                    Ok(None) | Err(_) => {
                        return Err(PoolError::TooManyBuffers { slots: st.slot_cap }.into())
                    }
                }
            }
            None => {
                let Some(i) = Self::slot_descriptor(&mut st) else {
                    let m = Self::free_chunk(&mut st, chunk_index);
                    let slots = st.slot_cap;
                    drop(st);
                    if let Some(m) = m {
                        self.source.give_back(m);
                    }
                    return Err(PoolError::TooManyBuffers { slots }.into());
                };
                Self::oversize_slot(&mut st, i, chunk_index);
                i
            }
        };
        Ok(Some(self.finish_take(&mut st, index, class, grow_len)))
    }

    #[inline]
    fn finish_take(
        &self,
        st: &mut State<T>,
        index: u32,
        class: Option<usize>,
        oversize_len: usize,
    ) -> SlotTicket {
        let size = class.map_or(oversize_len, |c| self.config.classes.sizes[c]);
        st.stats.used_bytes += size;
        st.stats.leases += 1;
        // The slot and its chunk looked up once each: every lease passes here.
        let slot = st.tables.slots()[index as usize];
        let chunk = &mut st.tables.chunks()[slot.chunk as usize];
        chunk.in_use += 1;
        let mem = chunk.mem.expect("a slot always points at a live chunk");
        SlotTicket {
            index,
            class: slot.class,
            region: Region {
                addr: mem.region.addr + u64::from(slot.offset),
                len: size,
                kind: mem.region.kind,
            },
            lkey: mem.mr.map(|m| m.lkey),
        }
    }
}

impl<S: ChunkSource, T: PoolTables, B: Bell> Pool for SlabPool<S, T, B> {
    fn take_slot(&self, len: usize) -> Result<SlotTicket, Error> {
        match self.take_unmarked(len) {
            // Any refusal but a zero length may end with a buffer back (a
            // source out of memory too: a chunk given back makes room).
            Err(e) if B::RINGS && e != Error::Pool(PoolError::ZeroLength) => {
                // Marked first, then looked at again: a buffer given back
                // in between is either found by this look or rings the bell.
                self.state.lock().wanted = true;
                self.take_unmarked(len)
            }
            taken => taken,
        }
    }

    fn registration(&self, ticket: &SlotTicket) -> Option<MrHandle> {
        let mut st = self.state.lock();
        let chunk = st.tables.slots().get(ticket.index as usize)?.chunk;
        st.tables.chunks().get(chunk as usize)?.mem?.mr
    }

    fn release_slot(&self, ticket: &SlotTicket) {
        let mut st = self.state.lock();
        let ring = B::RINGS && core::mem::take(&mut st.wanted);
        let idle = Self::release_locked(&mut st, ticket);
        drop(st);
        // The chunk first: a waiter the ring wakes may need its room.
        if let Some(m) = idle {
            self.source.give_back(m);
        }
        if ring {
            self.bell.ring();
        }
    }
}

impl<S: ChunkSource, T: PoolTables, B: Bell> SlabPool<S, T, B> {
    /// [`Pool::take_slot`] without marking a refusal for the bell. Every
    /// lease passes here: a free buffer of the class that serves `len` is
    /// popped inline; carving, growth and borrowing are out of line.
    #[inline]
    fn take_unmarked(&self, len: usize) -> Result<SlotTicket, Error> {
        if let (true, Some(c)) = (len != 0, self.config.classes.class_for(len)) {
            let mut st = self.state.lock();
            if let Some(head) = Self::pop_free(&mut st, c) {
                return Ok(self.finish_take(&mut st, head, Some(c), 0));
            }
        }
        self.take_carving(len)
    }

    /// [`take_unmarked`](Self::take_unmarked) past its free lists.
    #[inline(never)]
    fn take_carving(&self, len: usize) -> Result<SlotTicket, Error> {
        if len == 0 {
            return Err(PoolError::ZeroLength.into());
        }
        let mut class = self.config.classes.class_for(len);
        // Set once the class cannot grow: then a free buffer of a larger
        // class serves, each looked at in turn (`borrow-larger`).
        let mut refused = None;
        loop {
            if let Some(c) = class {
                let mut st = self.state.lock();
                // `Err`: room in the class's chunk but no descriptor for
                // it; growing takes idle chunks' descriptors (or says so).
                if let Ok(Some(index)) = self.try_fast(&mut st, c) {
                    return Ok(self.finish_take(&mut st, index, class, 0));
                }
            }
            if let Some(e) = refused {
                class = class.map(|c| c + 1).filter(|&c| c < self.config.classes.n);
                if class.is_none() {
                    return Err(e);
                }
                continue;
            }
            match self.grow(class, len) {
                Ok(Some(ticket)) => return Ok(ticket),
                // A concurrent growth may bring what we need: look again.
                Ok(None) => crate::sync::backoff(),
                // (An oversize lease, of no class, has none larger to borrow.)
                Err(e) if BORROW_LARGER => refused = Some(e),
                Err(e) => return Err(e),
            }
        }
    }
}

impl<S: ChunkSource, T: PoolTables, B: Bell> SlabPool<S, T, B> {
    /// Whether a lease of `len` bytes that this pool refuses now could be
    /// served once every buffer but `kept` (leases of this pool) came back:
    /// a holder of `kept` (a receive ring, and what waits in it) asks
    /// whether waiting for the others can help, or would wait for good. It
    /// can where another's buffer of the class that serves `len` (or of a
    /// larger one it may borrow) is out, or where chunks that hold none of
    /// `kept` would fall idle and, reclaimed, make room for it.
    pub fn could_serve_later<'a>(
        &self,
        len: usize,
        kept: impl IntoIterator<Item = &'a SlotTicket>,
    ) -> bool {
        let want = self.config.classes.class_for(len);
        let grow_len = match want {
            Some(_) => self.config.chunk_bytes,
            None => len.next_multiple_of(self.config.chunk_align.max(1)),
        };
        let mut st = self.state.lock();
        for c in st.tables.chunks().iter_mut() {
            c.kept = 0;
        }
        for t in kept {
            if t.index == NONE {
                continue;
            }
            let chunk = st.tables.slots()[t.index as usize].chunk as usize;
            let c = &mut st.tables.chunks()[chunk];
            c.kept = c.kept.saturating_add(1);
        }
        let serves = |class: usize| match want {
            Some(w) => class == w || (BORROW_LARGER && class > w && class < OVERSIZE),
            None => false,
        };
        // Room the budget has, and what chunks without any of `kept` would give.
        let mut room = self.config.budget.saturating_sub(st.stats.reserved_bytes);
        let mut falls_idle = false;
        for c in st.tables.chunks().iter() {
            let Some(mem) = c.mem else { continue };
            let others = c.in_use.saturating_sub(c.kept);
            if others != 0 && serves(c.class as usize) {
                return true;
            }
            if c.kept == 0 {
                room = room.saturating_add(mem.region.len);
                falls_idle |= c.in_use != 0;
            }
        }
        falls_idle && room >= grow_len
    }

    /// The size class of a ticket's buffer, `None` for an oversize one.
    pub(crate) fn class_of(&self, ticket: &SlotTicket) -> Option<usize> {
        let c = ticket.class as usize;
        (c < OVERSIZE).then_some(c)
    }

    /// Fills `out` with free buffers of `class` under one lock, without
    /// growing; returns how many. A [`LocalPool`](crate::LocalPool)'s refill.
    pub(crate) fn take_batch(&self, class: usize, out: &mut [SlotTicket]) -> usize {
        let mut st = self.state.lock();
        let mut n = 0;
        for o in out.iter_mut() {
            match self.try_fast(&mut st, class) {
                Ok(Some(index)) => {
                    *o = self.finish_take(&mut st, index, Some(class), 0);
                    n += 1;
                }
                Ok(None) | Err(_) => break,
            }
        }
        n
    }

    /// Returns class buffers under one lock. A [`LocalPool`](crate::LocalPool)'s flush.
    pub(crate) fn release_batch(&self, tickets: &[SlotTicket]) {
        let mut st = self.state.lock();
        for t in tickets {
            // Class buffers only: an oversize buffer never enters a cache.
            let _ = Self::release_locked(&mut st, t);
        }
        let ring = B::RINGS && !tickets.is_empty() && core::mem::take(&mut st.wanted);
        drop(st);
        if ring {
            self.bell.ring();
        }
    }

    /// Puts a buffer back on its class's free list; an oversize buffer's chunk
    /// is returned for the caller to give back outside the lock.
    fn release_locked(st: &mut State<T>, ticket: &SlotTicket) -> Option<Registered> {
        let i = ticket.index as usize;
        let slot = st.tables.slots()[i];
        let class = slot.class as usize;
        st.stats.used_bytes -= ticket.region.len;
        st.stats.leases -= 1;
        st.tables.chunks()[slot.chunk as usize].in_use -= 1;
        st.tables.slots()[i].next = st.free[class];
        st.free[class] = ticket.index;
        if class != OVERSIZE {
            return None;
        }
        // Oversize: its slot descriptor is free (above); its chunk is kept
        // for reuse while there is room among the spares, else it goes
        // back to the source.
        st.tables.slots()[i].chunk = NONE;
        if let Some(k) = st.spare_oversize.iter().position(|&c| c == NONE) {
            st.spare_oversize[k] = slot.chunk;
            return None;
        }
        Self::free_chunk(st, slot.chunk)
    }
}

impl<S, T, B> Drop for SlabPool<S, T, B>
where
    S: ChunkSource,
    T: PoolTables,
    B: Bell,
{
    fn drop(&mut self) {
        // No lease can outlive the pool (each borrows or owns a reference to it),
        // so every chunk is idle here.
        let st = self.state.get_mut();
        let made = st.chunks_made;
        for chunk in &mut st.tables.chunks()[..made] {
            if let Some(m) = chunk.mem.take() {
                self.source.give_back(m);
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use core::sync::atomic::{AtomicU32, Ordering};

    use super::*;
    use crate::testing::{CountingNic, FakeMemory};

    type TestPool = SlabPool<Chunks<FakeMemory, CountingNic>, InlineTables<16, 1024>>;

    /// Fake memory registered with a counting NIC (registration ids from 0).
    pub(crate) fn source() -> Chunks<FakeMemory, CountingNic> {
        Chunks {
            memory: FakeMemory::new(),
            registrar: Some(CountingNic::new()),
        }
    }

    fn pool(budget: usize) -> TestPool {
        let source = source();
        let mut cfg = PoolConfig::with_budget(budget);
        cfg.chunk_bytes = 64 << 10;
        cfg.classes = SizeClasses::new(&[256, 4096, 16384]).unwrap();
        SlabPool::new(source, cfg, InlineTables::new()).unwrap()
    }

    #[test]
    fn a_budget_under_one_chunk_is_fitted_and_serves_leases_up_to_itself() {
        // 2 MiB chunks over a 1 MiB budget serve nothing from a class.
        let raw = PoolConfig::with_budget(1 << 20);
        assert_eq!(raw.largest_lease(), 0);
        let p = SlabPool::new(source(), raw, InlineTables::<16, 1024>::new()).unwrap();
        assert!(p.lease(64).is_err());
        let fit = raw.fitted();
        assert_eq!(fit.chunk_bytes, 1 << 20);
        assert_eq!(
            fit.classes,
            SizeClasses::DEFAULT,
            "1 MiB still fits a 1 MiB chunk"
        );
        assert_eq!(fit.largest_lease(), 1 << 20);
        let p = SlabPool::new(source(), fit, InlineTables::<16, 1024>::new()).unwrap();
        drop(p.lease(64).unwrap());
        drop(p.lease(1 << 20).unwrap());
        assert!(p.lease((1 << 20) + 1).is_err());
        // 100 KiB: 64 KiB is the largest class that fits; oversize up to the
        // budget rounded down to a page.
        let fit = PoolConfig::with_budget(100 << 10).fitted();
        assert_eq!(
            (fit.chunk_bytes, fit.classes.largest()),
            (100 << 10, 64 << 10)
        );
        assert_eq!(fit.largest_lease(), 100 << 10);
        let odd = PoolConfig::with_budget((100 << 10) + 100).fitted();
        assert_eq!(odd.largest_lease(), 100 << 10);
        let p = SlabPool::new(source(), odd, InlineTables::<16, 1024>::new()).unwrap();
        drop(p.lease(100 << 10).unwrap());
        assert!(p.lease((100 << 10) + 1).is_err());
        // A budget of several chunks is left as it is.
        let big = PoolConfig::with_budget(64 << 20);
        assert_eq!(big.fitted(), big);
        assert_eq!(big.largest_lease(), 64 << 20);
        let small_chunks = PoolConfig {
            budget: 1 << 20,
            chunk_bytes: 1 << 20,
            ..big
        };
        assert_eq!(
            small_chunks.largest_lease(),
            1 << 20,
            "the largest class, whose chunk fits"
        );
    }

    #[test]
    fn advance_skips_a_header_read_in_place() {
        let p = pool(1 << 20);
        let mut l = p.lease(100).unwrap();
        let (buf, ptr) = (l.buffer(), l.device_ptr());
        l.advance(32).unwrap();
        assert_eq!((l.len(), l.capacity()), (68, 256 - 32));
        assert_eq!(l.device_ptr(), ptr + 32);
        assert_eq!(l.region().addr, ptr + 32);
        assert_eq!(l.region().len, 68);
        assert_eq!(l.buffer(), buf, "the buffer itself is unchanged");
        l.set_len(224).unwrap();
        assert!(l.set_len(225).is_err(), "no room past the buffer's end");
        assert!(l.advance(225).is_err(), "more than the message is refused");
        assert_eq!(l.len(), 224, "a refused advance changes nothing");
        drop(l);
        assert_eq!(p.used_bytes(), 0, "an advanced lease goes back whole");
        assert_eq!(
            p.lease(256).unwrap().device_ptr(),
            buf.addr,
            "and is leased again from its start"
        );
    }

    #[test]
    fn one_registration_per_chunk_and_keys_on_every_lease() {
        let p = pool(1 << 20);
        let a = p.lease(100).unwrap();
        let b = p.lease(200).unwrap();
        assert_eq!(a.capacity(), 256);
        assert_eq!(b.device_ptr(), a.device_ptr() + 256, "carved side by side");
        assert_eq!(a.mr(), b.mr(), "same chunk, same keys");
        assert!(a
            .mr()
            .unwrap()
            .covers(b.device_ptr(), 256, Access::LOCAL_WRITE));
        assert_eq!(p.source().registrar.as_ref().unwrap().registered(), 1);
        assert_eq!(p.used_bytes(), 512);
        drop(a);
        drop(b);
        assert_eq!(p.used_bytes(), 0);
    }

    #[test]
    fn a_lease_quotes_its_own_chunks_key_and_the_pool_finds_its_registration() {
        let p = pool(4 << 20);
        let first = p.lease(256).unwrap();
        let first_mr = first.mr().expect("a registered chunk");
        // Lease until one lands in a second chunk (its own registration).
        let mut held = std::vec::Vec::new();
        let other = loop {
            let l = p.lease(256).unwrap();
            if !first_mr.covers(l.device_ptr(), 256, Access::NONE) {
                break l;
            }
            assert_eq!(l.lkey(), Some(first_mr.lkey), "the first chunk's key");
            held.push(l);
            assert!(held.len() < 1 << 16, "a second chunk never came");
        };
        let other_mr = other.mr().expect("a registered chunk");
        assert_ne!(other_mr.lkey, first_mr.lkey, "one registration per chunk");
        assert_eq!(
            other.lkey(),
            Some(other_mr.lkey),
            "the key it carries is its chunk's"
        );
        assert!(other_mr.covers(other.device_ptr(), 256, Access::LOCAL_WRITE));
        assert_eq!(first.lkey(), Some(first_mr.lkey));
        assert_eq!(p.source().registrar.as_ref().unwrap().registered(), 2);
    }

    #[test]
    fn released_memory_is_reused_first() {
        let p = pool(1 << 20);
        let a = p.lease(4000).unwrap();
        let addr = a.device_ptr();
        drop(a);
        let b = p.lease(3000).unwrap();
        assert_eq!(b.device_ptr(), addr);
        assert_eq!(p.stats().grows, 1);
    }

    #[test]
    fn exhaustion_is_typed_and_exact() {
        let p = pool(128 << 10); // two chunks
        let mut held = [const { None }; 8];
        for slot in held.iter_mut() {
            *slot = Some(p.lease(16384).unwrap()); // 4 per chunk
        }
        assert_eq!(
            p.lease(1).unwrap_err(),
            Error::Pool(PoolError::Exhausted {
                used: 128 << 10,
                cap: 128 << 10
            })
        );
        held[3] = None;
        assert!(p.lease(16000).is_ok(), "a release makes room again");
    }

    /// Counts its rings.
    #[derive(Debug, Default)]
    struct Rings(AtomicU32);

    impl Bell for Rings {
        fn ring(&self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// [`pool`]'s shape (one 64 KiB chunk at this budget: four 16 KiB
    /// buffers), ringing [`Rings`].
    fn belled() -> SlabPool<Chunks<FakeMemory, CountingNic>, InlineTables<16, 1024>, Rings> {
        let mut cfg = PoolConfig::with_budget(64 << 10);
        cfg.chunk_bytes = 64 << 10;
        cfg.classes = SizeClasses::new(&[256, 4096, 16384]).unwrap();
        SlabPool::with_bell(source(), cfg, InlineTables::new(), Rings::default()).unwrap()
    }

    #[test]
    fn a_buffer_back_after_a_refusal_rings_the_bell_once() {
        let p = belled();
        let rings = || p.bell().0.load(Ordering::Relaxed);
        let [a, b, c, d]: [_; 4] = core::array::from_fn(|_| p.lease(16384).unwrap());
        drop(a);
        assert_eq!(rings(), 0, "no refusal yet: nobody to tell");
        let a = p.lease(16384).unwrap();
        assert!(p.lease(16384).is_err());
        assert_eq!(rings(), 0, "a refusal alone rings nothing");
        drop(a);
        assert_eq!(rings(), 1, "the first buffer back after it");
        drop(b);
        assert_eq!(rings(), 1, "no refusal since");
        let [a, b]: [_; 2] = core::array::from_fn(|_| p.lease(16384).unwrap());
        assert_eq!(p.lease(0).unwrap_err(), Error::Pool(PoolError::ZeroLength));
        drop(a);
        assert_eq!(rings(), 1, "a zero-length lease waits for nothing");
        let a = p.lease(16384).unwrap();
        assert!(p.lease(1 << 20).is_err(), "an oversize refusal");
        drop((a, b, c, d));
        assert_eq!(
            rings(),
            2,
            "one ring for one refusal, however many come back"
        );
    }

    #[test]
    fn buffers_a_local_cache_hands_back_after_a_refusal_ring_the_bell() {
        let p = belled();
        let rings = || p.bell().0.load(Ordering::Relaxed);
        let local = crate::LocalPool::<_, _, 4, _>::new(&p).unwrap();
        let [a, b, c, d]: [_; 4] = core::array::from_fn(|_| local.lease(16384).unwrap());
        assert!(local.lease(16384).is_err(), "the shared pool refuses");
        local.flush();
        assert_eq!(rings(), 0, "an empty flush gives nothing back");
        drop((a, b));
        assert_eq!(rings(), 0, "kept in the cache");
        local.flush();
        assert_eq!(rings(), 1, "given back by the flush");
        drop((c, d));
    }

    #[test]
    fn a_class_that_cannot_grow_borrows_a_free_buffer_of_a_larger_one() {
        // Two chunks: one for 16 KiB (three of its four buffers free), the
        // other for 256 B; none for 4 KiB within the budget: a free 16 KiB
        // buffer serves.
        let p = pool(128 << 10);
        let big = p.lease(16384).unwrap();
        let small = p.lease(256).unwrap();
        let mid = p.lease(4096).unwrap();
        assert_eq!(mid.capacity(), 16384);
        assert_eq!(p.stats().used_bytes, 2 * 16384 + 256);
        drop(mid);
        assert_eq!(p.stats().used_bytes, 16384 + 256, "back to its own class");
        // Nothing larger free either: refused, typed.
        let rest: [_; 3] = core::array::from_fn(|_| p.lease(16384).unwrap());
        assert_eq!(
            p.lease(4096).unwrap_err(),
            Error::Pool(PoolError::Exhausted {
                used: 128 << 10,
                cap: 128 << 10
            })
        );
        // With room to grow, a request is served from its own class.
        drop((big, small, rest));
        assert_eq!(p.lease(4096).unwrap().capacity(), 4096);
    }

    #[test]
    fn the_largest_of_a_full_set_of_classes_that_cannot_grow_is_refused_typed() {
        let mut cfg = PoolConfig::with_budget(64 << 10); // one chunk
        cfg.chunk_bytes = 64 << 10;
        let k = 1 << 10;
        let sizes = [256, 512, k, 2 * k, 4 * k, 8 * k, 16 * k, 32 * k];
        cfg.classes = SizeClasses::new(&sizes[..MAX_CLASSES]).unwrap();
        let p: TestPool = SlabPool::new(source(), cfg, InlineTables::new()).unwrap();
        let _held = p.lease(100).unwrap(); // the one chunk
        assert_eq!(
            p.lease(20 << 10).unwrap_err(),
            Error::Pool(PoolError::Exhausted {
                used: 64 << 10,
                cap: 64 << 10
            }),
            "no class above the largest"
        );
    }

    #[test]
    fn a_zero_length_lease_is_refused_with_a_free_buffer_at_hand() {
        let p = pool(1 << 20);
        drop(p.lease(1).unwrap()); // the smallest class has one free now
        assert_eq!(p.lease(0).unwrap_err(), Error::Pool(PoolError::ZeroLength));
        assert_eq!(p.stats().used_bytes, 0);
        assert_eq!(p.lease(1).map(|l| l.len()), Ok(1), "the free one serves");
    }

    #[test]
    fn zero_length_and_oversize() {
        let p = pool(1 << 20);
        assert_eq!(p.lease(0).unwrap_err(), Error::Pool(PoolError::ZeroLength));
        let big = p.lease(100_000).unwrap();
        assert_eq!(big.capacity(), 102_400, "rounded to the chunk alignment");
        assert_eq!(p.stats().oversize, 1);
        assert_eq!(p.stats().reserved_bytes, 102_400);
        drop(big);
        assert_eq!(p.stats().reserved_bytes, 102_400, "kept for reuse");
        let nic = p.source().registrar.as_ref().unwrap();
        assert_eq!(nic.deregistered(), 0);
        // Too large for the budget: the kept buffer goes back first, and
        // the refusal counts nothing held.
        assert_eq!(
            p.lease(2 << 20).unwrap_err(),
            Error::Pool(PoolError::Exhausted {
                used: 0,
                cap: 1 << 20
            })
        );
        assert_eq!(nic.deregistered(), 1);
        assert_eq!(p.stats().reserved_bytes, 0);
    }

    #[test]
    fn released_oversize_buffers_are_reused_then_given_back_when_their_room_is_needed() {
        let p = pool(1 << 20);
        let nic = p.source().registrar.as_ref().unwrap();
        let first = p.lease(300_000).unwrap();
        let addr = first.buffer().addr;
        drop(first);
        // The same size again, and one a little smaller: the kept buffer, no
        // new memory or registration.
        for len in [300_000, 200_000] {
            let again = p.lease(len).unwrap();
            assert_eq!(again.buffer().addr, addr, "{len}: the kept buffer");
            assert!(again.capacity() >= len);
            assert_eq!(p.used_bytes(), again.capacity());
        }
        let st = p.stats();
        assert_eq!((st.grows, st.oversize, st.oversize_reused), (1, 3, 2));
        assert_eq!(nic.registered(), 1);
        // Less than half its size: a buffer of its own (the kept one would
        // waste more than it serves).
        let small = p.lease(100_000).unwrap();
        assert_ne!(small.buffer().addr, addr);
        assert_eq!(p.stats().oversize_reused, 2);
        // Three released: the first two kept, the third given back.
        let (a, b) = (p.lease(300_000).unwrap(), p.lease(300_000).unwrap());
        drop(small);
        drop(a);
        drop(b);
        let st = p.stats();
        assert_eq!(st.given_back, 1);
        assert_eq!(st.reserved_bytes, 102_400 + 303_104, "the two kept");
        // Class chunks that need the room get it: the kept buffers go back.
        // (12 chunks of four: with both kept buffers, over the budget.)
        let held: [_; 48] = core::array::from_fn(|_| p.lease(16384).unwrap());
        let st = p.stats();
        assert!(st.reserved_bytes <= 1 << 20, "{st:?}");
        assert_eq!((st.given_back, st.reclaimed), (3, 2), "{st:?}");
        assert_eq!(u64::from(nic.deregistered()), st.given_back);
        drop(held);
    }

    #[test]
    fn misaligned_memory_is_refused_and_returned() {
        let source = Chunks::<_, CountingNic> {
            memory: FakeMemory::skewed(8),
            registrar: None,
        };
        let p: SlabPool<_, InlineTables<4, 64>> = SlabPool::new(
            source,
            PoolConfig::with_budget(8 << 20),
            InlineTables::new(),
        )
        .unwrap();
        assert!(matches!(
            p.lease(10),
            Err(Error::Misaligned { align: 4096, .. })
        ));
        assert_eq!(p.stats().reserved_bytes, 0);
    }

    #[test]
    fn bad_configs_are_refused() {
        assert_eq!(SizeClasses::new(&[]), Err(PoolError::BadConfig));
        assert_eq!(SizeClasses::new(&[0, 8]), Err(PoolError::BadConfig));
        assert_eq!(SizeClasses::new(&[64, 64]), Err(PoolError::BadConfig));
        assert_eq!(SizeClasses::new(&[1; 9]), Err(PoolError::BadConfig));
        let mut cfg = PoolConfig::with_budget(1 << 20);
        cfg.chunk_bytes = 512 << 10; // smaller than the 1 MiB class
        let source = Chunks::<_, CountingNic> {
            memory: FakeMemory::new(),
            registrar: None,
        };
        assert!(matches!(
            SlabPool::new(source, cfg, InlineTables::<4, 4>::new()),
            Err(PoolError::BadConfig)
        ));
    }

    #[test]
    fn slot_table_full_is_typed() {
        let source = Chunks::<_, CountingNic> {
            memory: FakeMemory::new(),
            registrar: None,
        };
        let p: SlabPool<_, InlineTables<4, 2>> = SlabPool::new(
            source,
            PoolConfig::with_budget(8 << 20),
            InlineTables::new(),
        )
        .unwrap();
        let _a = p.lease(1).unwrap();
        let _b = p.lease(1).unwrap();
        assert_eq!(
            p.lease(1).unwrap_err(),
            Error::Pool(PoolError::TooManyBuffers { slots: 2 })
        );
    }

    #[test]
    fn dropping_the_pool_gives_every_chunk_back() {
        let p = pool(1 << 20);
        drop(p.lease(10).unwrap());
        drop(p.lease(5000).unwrap());
        let source_counts = {
            let nic = p.source().registrar.as_ref().unwrap();
            nic.registered()
        };
        assert_eq!(source_counts, 2);
        // Drop runs give_back for both chunks; checked through a shared counter below.
        struct Watch<'a>(&'a AtomicU32);
        impl ChunkSource for Watch<'_> {
            fn obtain(&self, len: usize, align: usize, _: Access) -> Result<Registered, Error> {
                let r = FakeMemory::new().alloc(len, align)?;
                Ok(Registered {
                    region: r,
                    mr: None,
                })
            }
            fn give_back(&self, _: Registered) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        let given = AtomicU32::new(0);
        let p2: SlabPool<_, InlineTables<4, 16>> = SlabPool::new(
            Watch(&given),
            PoolConfig::with_budget(8 << 20),
            InlineTables::new(),
        )
        .unwrap();
        drop(p2.lease(10).unwrap());
        drop(p2.lease(5000).unwrap());
        drop(p2);
        assert_eq!(given.load(Ordering::Relaxed), 2);
    }

    /// Regression (found by the `tcp_recv` fuzzer): with a budget of two
    /// chunks, a third size class was refused as "exhausted" although every
    /// buffer was free, because chunks stayed with the class that took them.
    #[test]
    fn an_idle_chunk_of_another_class_is_reclaimed_at_the_budget() {
        let p = pool(128 << 10); // two 64 KiB chunks
        drop(p.lease(100).unwrap()); // 256 B class takes chunk 1
        let held = p.lease(4000).unwrap(); // 4 KiB class takes chunk 2
        let third = p.lease(10_000).unwrap(); // 16 KiB class: chunk 1 is idle, reclaimed
        assert_eq!(p.stats().reclaimed, 1);
        assert_eq!(p.stats().reserved_bytes, 128 << 10);
        let nic = p.source().registrar.as_ref().unwrap();
        assert_eq!(
            nic.deregistered(),
            1,
            "the reclaimed chunk was deregistered"
        );
        // Every chunk now holds a lease: nothing to reclaim. The 256 B
        // class borrows a free buffer of a larger one; an oversize lease,
        // which has none to borrow, is refused typed.
        let borrowed = p.lease(100).unwrap();
        assert_eq!(borrowed.capacity(), 4096);
        assert!(matches!(
            p.lease(100 << 10).unwrap_err(),
            Error::Pool(PoolError::Exhausted { .. })
        ));
        drop((held, third, borrowed));
        assert_eq!(
            p.lease(100).unwrap().capacity(),
            256,
            "idle again: reclaimable again"
        );
    }

    /// A holder of some of a pool's buffers (a receive ring) asks whether
    /// waiting can bring a lease it was refused: yes while another's buffer
    /// of the class that serves it is out, or while a chunk holding none of
    /// its own would fall idle and make room; no where its own buffers keep
    /// every chunk that could.
    #[test]
    fn a_refused_lease_can_come_later_only_where_others_hold_what_would_serve_it() {
        use std::vec::Vec;
        let p = pool(128 << 10); // two 64 KiB chunks
                                 // Chunk 1, the 4 KiB class: 15 buffers "ours", one the application's.
        let ring: Vec<_> = (0..15).map(|_| p.lease(4000).unwrap()).collect();
        let app_small = p.lease(4000).unwrap();
        // Chunk 2, the 16 KiB class: three ours, one the application's.
        let mut ours_big: Vec<_> = (0..3).map(|_| p.lease(10_000).unwrap()).collect();
        let app_big = p.lease(10_000).unwrap();
        assert!(p.lease(10_000).is_err(), "the budget is all carved");
        let kept = |big: &[Lease<&TestPool>]| -> Vec<SlotTicket> {
            ring.iter().chain(big).map(|l| *l.ticket()).collect()
        };
        // Another's 16 KiB buffer is out: it can come back.
        assert!(p.could_serve_later(10_000, &kept(&ours_big)));
        // Ours all: the application's 4 KiB buffer coming back frees no
        // chunk (the ring's are in it), so nothing can.
        ours_big.push(app_big);
        assert!(!p.could_serve_later(10_000, &kept(&ours_big)));
        // A 4 KiB lease borrows no smaller class, and the application's
        // 4 KiB buffer serves it.
        assert!(p.could_serve_later(4000, &kept(&ours_big)));
        // Nothing is out but ours: nothing can come.
        let all: Vec<SlotTicket> = kept(&ours_big)
            .into_iter()
            .chain([*app_small.ticket()])
            .collect();
        assert!(!p.could_serve_later(4000, &all));
        drop((ring, app_small, ours_big));

        // A chunk with none of ours falls idle once the application's
        // buffers come back, and is reclaimed for any class.
        let small: Vec<_> = (0..16).map(|_| p.lease(4000).unwrap()).collect(); // ours, chunk 1
        let app_tiny = p.lease(100).unwrap(); // the application's, chunk 2 (256 B class)
        assert!(p.lease(10_000).is_err());
        let ours: Vec<SlotTicket> = small.iter().map(|l| *l.ticket()).collect();
        assert!(p.could_serve_later(10_000, &ours));
        // An oversize lease (100 KiB) needs both chunks' room: one chunk
        // falling idle is not enough, and with none of ours both are.
        assert!(!p.could_serve_later(100 << 10, &ours));
        assert!(p.could_serve_later(100 << 10, &[]));
        drop((small, app_tiny));

        // A smaller class may borrow another's buffer of a larger one.
        let small: Vec<_> = (0..16).map(|_| p.lease(4000).unwrap()).collect(); // ours, chunk 1
        let big: Vec<_> = (0..4).map(|_| p.lease(10_000).unwrap()).collect(); // chunk 2
        assert!(p.lease(4000).is_err());
        let ours: Vec<SlotTicket> = small.iter().chain(&big[..3]).map(|l| *l.ticket()).collect();
        assert!(
            p.could_serve_later(4000, &ours),
            "the application's 16 KiB buffer"
        );
        drop((small, big));

        // An oversize buffer serves no class: only the room it frees counts.
        let p = pool(96 << 10);
        let small: Vec<_> = (0..16).map(|_| p.lease(4000).unwrap()).collect(); // ours, 64 KiB
        let oversize = p.lease(20 << 10).unwrap(); // the application's, 20 KiB
        assert!(
            p.lease(10_000).is_err(),
            "a chunk needs 64 KiB, 12 KiB are left"
        );
        let ours: Vec<SlotTicket> = small.iter().map(|l| *l.ticket()).collect();
        assert!(
            !p.could_serve_later(10_000, &ours),
            "20 KiB back and 12 KiB left make no 64 KiB chunk"
        );
        drop((small, oversize));
    }

    /// Fake memory whose answers a test sets: `fail` refuses, `skew_len`
    /// changes the length handed out (a short or generous source). Counts
    /// what was obtained and given back.
    #[derive(Default)]
    struct Scripted {
        memory: FakeMemory,
        fail: core::cell::Cell<bool>,
        skew_len: core::cell::Cell<isize>,
        obtained: core::cell::Cell<u32>,
        given_back: core::cell::Cell<u32>,
    }

    impl ChunkSource for &Scripted {
        fn obtain(&self, len: usize, align: usize, _: Access) -> Result<Registered, Error> {
            if self.fail.get() {
                return Err(Error::OutOfMemory { len });
            }
            let got = len.checked_add_signed(self.skew_len.get()).unwrap();
            let region = self.memory.alloc(got, align)?;
            self.obtained.set(self.obtained.get() + 1);
            Ok(Registered { region, mr: None })
        }
        fn give_back(&self, chunk: Registered) {
            self.given_back.set(self.given_back.get() + 1);
            let _ = self.memory.free(chunk.region);
        }
    }

    /// Chunks of 4 KiB, classes of 1 and 2 KiB.
    fn scripted<const C: usize, const S: usize>(
        source: &Scripted,
        budget: usize,
    ) -> SlabPool<&Scripted, InlineTables<C, S>> {
        let mut cfg = PoolConfig::with_budget(budget);
        cfg.chunk_bytes = 4096;
        cfg.classes = SizeClasses::new(&[1024, 2048]).unwrap();
        SlabPool::new(source, cfg, InlineTables::new()).unwrap()
    }

    #[test]
    fn the_default_classes_are_the_documented_sizes() {
        assert_eq!(
            SizeClasses::DEFAULT.as_slice(),
            [256, 1024, 4096, 16384, 65536, 256 << 10, 1 << 20]
        );
        assert_eq!(SizeClasses::DEFAULT.largest(), 1 << 20);
    }

    #[test]
    fn a_default_buffer_holds_at_most_four_times_the_bytes_asked_for() {
        let c = SizeClasses::DEFAULT;
        let edges = [(64 << 10) + 1, (256 << 10) + 1, 1 << 20];
        for len in (1..=c.largest()).step_by(97).chain(edges) {
            let size = c.as_slice()[c.class_for(len).unwrap()];
            assert!(
                size >= len && size <= (4 * len).max(256),
                "{len} B takes {size} B"
            );
        }
    }

    #[test]
    fn a_source_that_gives_too_little_is_refused_and_one_that_gives_more_is_accounted_exactly() {
        let source = Scripted::default();
        let p = scripted::<4, 16>(&source, 16384);
        source.skew_len.set(-1);
        assert_eq!(p.lease(10).unwrap_err(), Error::OutOfMemory { len: 4096 });
        assert_eq!((source.obtained.get(), source.given_back.get()), (1, 1));
        assert_eq!(p.stats().reserved_bytes, 0);
        // More than asked: the pool uses and counts what it asked for.
        source.skew_len.set(100);
        drop(p.lease(10).unwrap());
        drop(p.lease(10_000).unwrap()); // oversize, kept
        assert_eq!(p.stats().reserved_bytes, 4096 + 12288);
        // At the budget the kept buffer goes back; the count stays exact.
        drop(p.lease(2000).unwrap());
        assert_eq!(p.stats().given_back, 1);
        assert_eq!(p.stats().reserved_bytes, 4096 + 4096);
    }

    #[test]
    fn chunk_descriptors_freed_or_left_by_a_failed_growth_are_all_reused() {
        let source = Scripted::default();
        // Two chunk descriptors, and a budget of two chunks.
        let p = scripted::<2, 16>(&source, 8192);
        drop(p.lease(1000).unwrap()); // chunk of the 1 KiB class
        drop(p.lease(2000).unwrap()); // chunk of the 2 KiB class
                                      // Eight kilobytes at once: both idle chunks are reclaimed, and the
                                      // growth that needed them fails.
        source.fail.set(true);
        assert_eq!(p.lease(8000).unwrap_err(), Error::OutOfMemory { len: 8192 });
        assert_eq!(p.stats().reclaimed, 2);
        assert_eq!(p.stats().reserved_bytes, 0);
        // Both descriptors are free again.
        source.fail.set(false);
        let a = p.lease(1000).unwrap();
        let b = p.lease(2000).unwrap();
        assert_eq!(p.stats().reserved_bytes, 8192);
        drop((a, b));
        // A third is never made: the table holds two.
        let q = scripted::<2, 16>(&source, 1 << 20);
        let held = (q.lease(5000).unwrap(), q.lease(5000).unwrap());
        assert_eq!(
            q.lease(5000).unwrap_err(),
            Error::Pool(PoolError::TooManyChunks { chunks: 2 })
        );
        drop(held);
    }

    #[test]
    fn slot_descriptors_of_a_reclaimed_chunk_are_all_reused() {
        let source = Scripted::default();
        // Four slot descriptors, a budget of one chunk.
        let p = scripted::<4, 4>(&source, 4096);
        let ones: [_; 4] = core::array::from_fn(|_| p.lease(1000).unwrap());
        drop(ones);
        // The 2 KiB class takes the chunk back: its four descriptors are spares.
        let twos = (p.lease(2000).unwrap(), p.lease(2000).unwrap());
        assert_eq!(p.stats().reclaimed, 1);
        drop(twos);
        let st = p.stats();
        assert_eq!((st.grows, st.leases), (2, 0));
    }

    /// A burst of small leases carved every slot descriptor into one class;
    /// once they came back, a larger class was refused ("too many buffers")
    /// for good, although every buffer was free and the budget had room:
    /// descriptors stayed with the class that carved them.
    #[test]
    fn slot_descriptors_held_by_idle_chunks_of_another_class_serve_a_new_class() {
        let source = Scripted::default();
        // Four slot descriptors, four chunk descriptors, room for 256 chunks.
        let p = scripted::<4, 4>(&source, 1 << 20);
        let ones: [_; 4] = core::array::from_fn(|_| p.lease(1000).unwrap());
        assert_eq!(
            p.lease(1000).unwrap_err(),
            Error::Pool(PoolError::TooManyBuffers { slots: 4 }),
            "every descriptor in use: typed"
        );
        drop(ones);
        // The 2 KiB class takes the 1 KiB chunk's descriptors (and its chunk goes back).
        let two = p.lease(2000).unwrap();
        let st = p.stats();
        assert_eq!((st.reclaimed, st.given_back, st.grows), (1, 1, 2));
        assert_eq!(st.reserved_bytes, 4096);
        assert_eq!(source.given_back.get(), 1);
        let more: [_; 3] = core::array::from_fn(|_| p.lease(2000).unwrap());
        // A descriptor held by a live lease is never taken.
        assert_eq!(
            p.lease(2000).unwrap_err(),
            Error::Pool(PoolError::TooManyBuffers { slots: 4 })
        );
        assert_eq!(p.stats().reclaimed, 1);
        drop((two, more));
        // And back: the 1 KiB class takes both idle 2 KiB chunks' (two
        // descriptors each), the second when its own chunk still has room.
        let ones: [_; 3] = core::array::from_fn(|_| p.lease(1000).unwrap());
        let st = p.stats();
        assert_eq!((st.reclaimed, st.leases, st.reserved_bytes), (3, 3, 4096));
        drop(ones);
    }

    /// A lease refused for want of slot descriptors, every one held by a
    /// live lease, leaves the pool's kept oversize buffers alone: they hold
    /// no descriptor (giving them back only unmapped and deregistered them).
    #[test]
    fn kept_oversize_buffers_stay_when_only_slot_descriptors_are_short() {
        let source = Scripted::default();
        let p = scripted::<8, 4>(&source, 1 << 20);
        drop(p.lease(10_000).unwrap()); // kept
        let ones: [_; 4] = core::array::from_fn(|_| p.lease(1000).unwrap());
        assert_eq!(
            p.lease(2000).unwrap_err(),
            Error::Pool(PoolError::TooManyBuffers { slots: 4 })
        );
        let st = p.stats();
        assert_eq!((st.given_back, st.reclaimed), (0, 0));
        assert_eq!(
            st.reserved_bytes,
            (12 << 10) + 4096,
            "the kept one and the chunk"
        );
        drop(ones);
    }

    /// The same with chunk descriptors: chunks of one class, all idle, fill
    /// the chunk table; another class takes one of them.
    #[test]
    fn chunk_descriptors_held_by_idle_chunks_of_another_class_serve_a_new_class() {
        let source = Scripted::default();
        // Two chunk descriptors, plenty of slot descriptors and budget.
        let p = scripted::<2, 64>(&source, 1 << 20);
        let ones: [_; 8] = core::array::from_fn(|_| p.lease(1000).unwrap());
        assert_eq!(
            p.lease(1000).unwrap_err(),
            Error::Pool(PoolError::TooManyChunks { chunks: 2 })
        );
        drop(ones);
        let two = p.lease(2000).unwrap();
        assert_eq!(p.stats().reclaimed, 1);
        // Oversize, too: the other idle 1 KiB chunk makes way.
        let big = p.lease(10_000).unwrap();
        assert_eq!(p.stats().reclaimed, 2);
        assert_eq!(big.capacity(), 12 << 10);
        // Both chunks hold a lease now: nothing to reclaim. A 1 KiB lease
        // borrows a free 2 KiB buffer; another oversize one is refused, typed.
        assert_eq!(p.lease(1000).unwrap().capacity(), 2048);
        assert_eq!(
            p.lease(10_000).unwrap_err(),
            Error::Pool(PoolError::TooManyChunks { chunks: 2 })
        );
        drop((two, big));
    }

    #[test]
    fn slot_table_full_is_typed_before_any_memory_is_taken() {
        let source = Scripted::default();
        let p = scripted::<4, 2>(&source, 1 << 20);
        let held = (p.lease(1000).unwrap(), p.lease(1000).unwrap());
        assert_eq!(
            p.lease(2000).unwrap_err(),
            Error::Pool(PoolError::TooManyBuffers { slots: 2 })
        );
        assert_eq!(source.obtained.get(), 1, "no chunk taken for nothing");
        let shown = std::format!("{p:?}");
        assert!(
            shown.contains("SlabPool") && shown.contains("leases: 2"),
            "{shown}"
        );
        drop(held);
    }

    #[test]
    fn set_len_is_bounded_by_capacity() {
        let p = pool(1 << 20);
        let mut l = p.lease(10).unwrap();
        assert_eq!((l.len(), l.is_empty()), (10, false));
        l.set_len(0).unwrap();
        assert!(l.is_empty());
        l.set_len(256).unwrap();
        assert_eq!(l.region().len, 256);
        assert_eq!(l.set_len(257), Err(Error::TooLarge { len: 257, max: 256 }));
    }

    #[test]
    fn many_threads_lease_and_release_without_overlap() {
        extern crate std;
        use std::collections::BTreeMap;
        use std::sync::{Arc, Mutex};
        use std::vec::Vec;
        let p = Arc::new(pool(1 << 20));
        // Every buffer held by any thread, by start address: a lease that
        // overlaps one another thread holds is caught at once.
        let held: Arc<Mutex<BTreeMap<u64, usize>>> = Arc::default();
        let claim = |held: &Mutex<BTreeMap<u64, usize>>, r: Region| {
            let mut h = held.lock().unwrap();
            let before = h.range(..=r.addr).next_back();
            assert!(
                before.is_none_or(|(&a, &len)| a + len as u64 <= r.addr),
                "{r:?} overlaps a buffer another lease holds"
            );
            let after = h.range(r.addr..).next();
            assert!(
                after.is_none_or(|(&a, _)| r.addr + r.len as u64 <= a),
                "{r:?} overlaps a buffer another lease holds"
            );
            h.insert(r.addr, r.len);
        };
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let (p, held) = (Arc::clone(&p), Arc::clone(&held));
                std::thread::spawn(move || {
                    let rounds = if cfg!(miri) { 20 } else { 2000 };
                    let mut mine = Vec::new();
                    for i in 0..rounds {
                        let len = 1 + (i * 37 + t * 101) % 16384;
                        let l = Lease::take(Arc::clone(&p), len).unwrap();
                        claim(&held, l.buffer());
                        mine.push(l);
                        // Hold up to four at a time; give back the oldest.
                        if mine.len() > 4 {
                            let old = mine.remove(0);
                            held.lock().unwrap().remove(&old.buffer().addr);
                        }
                    }
                    for l in mine {
                        held.lock().unwrap().remove(&l.buffer().addr);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(held.lock().unwrap().is_empty());
        assert_eq!(p.used_bytes(), 0);
        assert_eq!(p.stats().leases, 0);
    }
}
