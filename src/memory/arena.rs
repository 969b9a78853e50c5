//! `CpuArena`: a bump allocator over 64-byte-aligned regions (chunks).

use std::alloc::{self, Layout};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use super::{
    check_request, foreign_allocation, log, out_of_memory, Allocation, Checkpoint, MemoryPool,
    PoolId, PoolStats,
};
use crate::{Error, Result};

/// Alignment of every chunk's base.
const CHUNK_ALIGN: usize = 64;

struct Chunk {
    base: NonNull<u8>,
    cap: usize,
    /// Bytes consumed from `base` (allocations rounded up to 64 bytes, plus
    /// padding for alignments above 64); always a multiple of 64.
    used: AtomicUsize,
}

// SAFETY: a chunk owns its region; threads touch disjoint parts of it (the
// CAS on `used` hands each byte out once), and it is freed only through
// `&mut CpuArena`.
unsafe impl Send for Chunk {}
// SAFETY: as above.
unsafe impl Sync for Chunk {}

impl Chunk {
    fn allocate(cap: usize) -> Option<Box<Chunk>> {
        if cap == 0 {
            return None;
        }
        let layout = Layout::from_size_align(cap, CHUNK_ALIGN).ok()?;
        // SAFETY: `layout` has a non-zero size.
        let base = NonNull::new(unsafe { alloc::alloc(layout) })?;
        Some(Box::new(Chunk {
            base,
            cap,
            used: AtomicUsize::new(0),
        }))
    }

    /// Where `size` bytes aligned to `align` go when `used` bytes are taken:
    /// `(start, end)` offsets, if they fit. Every allocation takes a multiple
    /// of 64 bytes, so `used` stays 64-aligned and alignments up to 64 need no
    /// arithmetic on the (latency-critical) offset: the common path is one add.
    #[inline]
    fn fit(&self, used: usize, size: usize, align: usize) -> Option<(usize, usize)> {
        // No overflow: `check_request` bounds `size` by `isize::MAX`.
        let rounded = (size + (CHUNK_ALIGN - 1)) & !(CHUNK_ALIGN - 1);
        let start = if align <= CHUNK_ALIGN {
            used
        } else {
            let addr = self.base.as_ptr() as usize + used;
            (addr.checked_add(align - 1)? & !(align - 1)) - self.base.as_ptr() as usize
        };
        let end = start.checked_add(rounded)?;
        (end <= self.cap).then_some((start, end))
    }

    #[inline]
    fn ptr_at(&self, offset: usize) -> NonNull<u8> {
        // SAFETY: callers pass `offset <= cap`, so the pointer stays inside
        // (or one past) the region and is non-null.
        unsafe { NonNull::new_unchecked(self.base.as_ptr().add(offset)) }
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        // SAFETY: `base` came from `alloc::alloc` with exactly this layout
        // (it was validated when the chunk was created).
        unsafe {
            alloc::dealloc(
                self.base.as_ptr(),
                Layout::from_size_align_unchecked(self.cap, CHUNK_ALIGN),
            )
        };
    }
}

struct Inner {
    /// In allocation order; the last one is the current chunk. Boxed so that
    /// `CpuArena::current` stays valid when the `Vec` reallocates.
    #[allow(clippy::vec_box)]
    chunks: Vec<Box<Chunk>>,
    /// Largest total capacity the arena has had: the size `reset` merges into.
    high_water_cap: usize,
    system_allocations: u64,
}

impl Inner {
    fn capacity(&self) -> usize {
        self.chunks.iter().map(|c| c.cap).sum()
    }

    fn used(&self) -> usize {
        self.chunks
            .iter()
            .map(|c| c.used.load(Ordering::Relaxed))
            .sum()
    }
}

/// Bump-pointer arena with O(1) [`reset`](MemoryPool::reset) and
/// checkpoint/rollback.
///
/// Every allocation takes a multiple of 64 bytes (one cache line), so
/// separate allocations never share a line and the common case (alignment
/// up to 64) costs one add on the bump offset.
///
/// Normally there is one chunk. A request that does not fit chains a new
/// chunk (logged) so that outstanding allocations stay where they are; the
/// next `reset` merges the chunks into one region as large as the arena ever
/// was, so a steady workload settles on a single chunk and zero system
/// allocations. A fixed arena ([`CpuArena::fixed`]) never grows: it returns
/// `OutOfMemory` instead.
///
/// Concurrency: `allocate(&self)` bumps the current chunk's offset with a CAS
/// and takes a mutex only to grow. Chunks are freed only through `&mut self`
/// (`reset`, `rollback`, drop), so a chunk a thread has loaded stays alive.
pub struct CpuArena {
    id: PoolId,
    /// The last chunk of `inner.chunks`, or null when there is none.
    current: AtomicPtr<Chunk>,
    /// True when there is exactly one chunk and it is as large as the arena
    /// has ever been: `reset` then only rewinds it.
    steady: AtomicBool,
    inner: Mutex<Inner>,
    growable: bool,
    /// Allocations since the last reset/rollback.
    live: AtomicUsize,
    /// Allocations counted out of `live` by earlier resets/rollbacks.
    retired_allocations: u64,
    /// Highest `used` recorded at resets, rollbacks and growth.
    peak: AtomicUsize,
    epoch: u64,
}

impl CpuArena {
    /// An arena with one region of `capacity` bytes that grows (by chaining
    /// a chunk, logged) when a request does not fit.
    pub fn new(capacity: usize) -> Result<Self> {
        Self::with_growth(capacity, true)
    }

    /// An arena of exactly `capacity` bytes: a request that does not fit
    /// fails with `OutOfMemory`.
    pub fn fixed(capacity: usize) -> Result<Self> {
        Self::with_growth(capacity, false)
    }

    fn with_growth(capacity: usize, growable: bool) -> Result<Self> {
        let mut chunks = Vec::new();
        let mut system_allocations = 0;
        if capacity > 0 {
            let chunk = Chunk::allocate(capacity)
                .ok_or_else(|| out_of_memory("arena", capacity, CHUNK_ALIGN, "initial region"))?;
            chunks.push(chunk);
            system_allocations = 1;
        }
        let mut arena = CpuArena {
            id: PoolId::next(),
            current: AtomicPtr::new(ptr::null_mut()),
            steady: AtomicBool::new(false),
            inner: Mutex::new(Inner {
                chunks,
                high_water_cap: capacity,
                system_allocations,
            }),
            growable,
            live: AtomicUsize::new(0),
            retired_allocations: 0,
            peak: AtomicUsize::new(0),
            epoch: 0,
        };
        arena.sync_current();
        Ok(arena)
    }

    /// Number of chunks (1 in the steady state; more after growth until the next reset).
    pub fn chunk_count(&self) -> usize {
        self.lock().chunks.len()
    }

    /// Whether the arena grows when a request does not fit.
    pub fn is_growable(&self) -> bool {
        self.growable
    }

    /// Resets the arena and makes sure it is one region of at least
    /// `capacity` bytes: the explicit resize a planned workspace uses when a
    /// step needs more than it was sized for (fixed arenas included). Returns
    /// whether it had to resize (logged). On `OutOfMemory` the arena keeps
    /// its old region.
    pub fn reserve(&mut self, capacity: usize) -> Result<bool> {
        self.reset();
        let inner = self.inner_mut();
        let old = inner.capacity();
        if inner.chunks.len() == 1 && old >= capacity {
            return Ok(false);
        }
        let target = capacity.max(old).max(CHUNK_ALIGN);
        let chunk = Chunk::allocate(target)
            .ok_or_else(|| out_of_memory("arena", target, CHUNK_ALIGN, "explicit resize"))?;
        inner.chunks.clear();
        inner.chunks.push(chunk);
        inner.system_allocations += 1;
        inner.high_water_cap = target;
        log(&format!(
            "arena: resized from {old} to {target} bytes (a step needs more than planned)"
        ));
        self.sync_current();
        Ok(true)
    }

    #[inline]
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    #[inline]
    fn inner_mut(&mut self) -> &mut Inner {
        self.inner.get_mut().unwrap_or_else(PoisonError::into_inner)
    }

    /// Points `current` at the last chunk and recomputes `steady`
    /// (exclusive access only; after every change to the chunk list).
    fn sync_current(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(PoisonError::into_inner);
        let steady = inner.chunks.len() == 1 && inner.chunks[0].cap >= inner.high_water_cap;
        let last = inner
            .chunks
            .last_mut()
            .map_or(ptr::null_mut(), |c| &mut **c as *mut Chunk);
        *self.current.get_mut() = last;
        *self.steady.get_mut() = steady;
    }

    /// Records `used` into the peak before it goes down.
    fn record_peak(&mut self, used: usize) {
        let peak = self.peak.get_mut();
        *peak = (*peak).max(used);
    }

    #[inline]
    fn handle(&self, ptr: NonNull<u8>, size: usize, align: usize) -> Allocation {
        Allocation::new(ptr, size, align, self.id)
    }

    /// The fast path of `allocate`: a CAS on the current chunk's offset.
    #[inline]
    fn bump_shared(&self, size: usize, align: usize) -> Option<NonNull<u8>> {
        let current = self.current.load(Ordering::Acquire);
        if current.is_null() {
            return None;
        }
        // SAFETY: `current` points at a boxed chunk owned by `inner`; chunks
        // are freed only through `&mut self`.
        let chunk = unsafe { &*current };
        let mut used = chunk.used.load(Ordering::Relaxed);
        while let Some((start, end)) = chunk.fit(used, size, align) {
            match chunk
                .used
                .compare_exchange_weak(used, end, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => {
                    self.live.fetch_add(1, Ordering::Relaxed);
                    return Some(chunk.ptr_at(start));
                }
                Err(now) => used = now,
            }
        }
        None
    }

    /// The fast path of `allocate_mut`: with `&mut self` no other thread
    /// bumps the chunk, so a plain load and store replace the CAS.
    #[inline]
    fn bump_exclusive(&mut self, size: usize, align: usize) -> Option<NonNull<u8>> {
        let current = *self.current.get_mut();
        if current.is_null() {
            return None;
        }
        // SAFETY: as in `bump_shared`.
        let chunk = unsafe { &*current };
        let used = chunk.used.load(Ordering::Relaxed);
        let (start, end) = chunk.fit(used, size, align)?;
        chunk.used.store(end, Ordering::Relaxed);
        *self.live.get_mut() += 1;
        Some(chunk.ptr_at(start))
    }

    /// The slow path: retries on a chunk another thread installed, otherwise
    /// chains a new chunk (when growable).
    ///
    /// Returns only the pointer so that callers merge the fast and slow paths
    /// on one register instead of a 32-byte handle in memory (which costs a
    /// store-forwarding stall per allocation).
    #[cold]
    #[inline(never)]
    fn allocate_slow(&self, size: usize, align: usize) -> Result<NonNull<u8>> {
        let mut inner = self.lock();
        loop {
            if let Some(chunk) = inner.chunks.last() {
                let mut used = chunk.used.load(Ordering::Relaxed);
                while let Some((start, end)) = chunk.fit(used, size, align) {
                    match chunk.used.compare_exchange_weak(
                        used,
                        end,
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    ) {
                        Ok(_) => {
                            self.live.fetch_add(1, Ordering::Relaxed);
                            return Ok(chunk.ptr_at(start));
                        }
                        Err(now) => used = now,
                    }
                }
            }
            self.grow(&mut inner, size, align)?;
        }
    }

    /// Chains a chunk that fits `size` bytes at `align`, at least doubling
    /// the arena's capacity.
    fn grow(&self, inner: &mut Inner, size: usize, align: usize) -> Result<()> {
        let capacity = inner.capacity();
        if !self.growable {
            return Err(out_of_memory(
                "arena",
                size,
                align,
                &format!(
                    "the fixed arena has {} of {capacity} bytes left",
                    capacity - inner.used()
                ),
            ));
        }
        // The base is 64-aligned, so only larger alignments need padding;
        // the size is rounded up to 64 bytes.
        let needed = ((size + (CHUNK_ALIGN - 1)) & !(CHUNK_ALIGN - 1))
            .checked_add(align.saturating_sub(CHUNK_ALIGN))
            .ok_or_else(|| out_of_memory("arena", size, align, "size overflow"))?;
        let new_cap = needed.max(capacity).max(CHUNK_ALIGN);
        let chunk = Chunk::allocate(new_cap).ok_or_else(|| {
            out_of_memory(
                "arena",
                size,
                align,
                &format!("could not chain a {new_cap}-byte chunk"),
            )
        })?;
        inner
            .chunks
            .try_reserve(1)
            .map_err(|_| out_of_memory("arena", size, align, "could not grow the chunk list"))?;
        let used = inner.used();
        self.peak.fetch_max(used, Ordering::Relaxed);
        inner.chunks.push(chunk);
        self.steady.store(false, Ordering::Relaxed);
        inner.system_allocations += 1;
        let total = capacity + new_cap;
        inner.high_water_cap = inner.high_water_cap.max(total);
        let last = inner
            .chunks
            .last()
            .map_or(ptr::null_mut(), |c| &**c as *const Chunk as *mut Chunk);
        self.current.store(last, Ordering::Release);
        log(&format!(
            "arena: {size} bytes (align {align}) do not fit in {capacity} bytes; chained a \
             {new_cap}-byte chunk (now {} chunk(s), {total} bytes); the next reset merges them",
            inner.chunks.len()
        ));
        Ok(())
    }

    /// `reset` when chunks must be merged (after growth or a failed merge).
    #[cold]
    #[inline(never)]
    fn reset_slow(&mut self) {
        let used = self.inner_mut().used();
        self.record_peak(used);
        let inner = self.inner_mut();
        let target = inner.high_water_cap;
        let merged = inner.chunks.len() == 1 && inner.chunks[0].cap >= target;
        if !merged && target > 0 {
            let old = inner.chunks.len();
            match Chunk::allocate(target) {
                Some(chunk) => {
                    inner.chunks.clear();
                    inner.chunks.push(chunk);
                    inner.system_allocations += 1;
                    log(&format!(
                        "arena: merged {old} chunk(s) into one {target}-byte region"
                    ));
                }
                None => {
                    // Keep the first chunk and try again at the next reset.
                    inner.chunks.truncate(1);
                    log(&format!(
                        "arena: could not merge {old} chunks into one {target}-byte region; \
                         kept the first chunk"
                    ));
                }
            }
        }
        for chunk in inner.chunks.iter_mut() {
            *chunk.used.get_mut() = 0;
        }
        self.sync_current();
    }

    /// Current position: (number of chunks, offset in the last).
    fn position(inner: &Inner) -> (usize, usize) {
        let n = inner.chunks.len();
        (
            n,
            inner
                .chunks
                .last()
                .map_or(0, |c| c.used.load(Ordering::Relaxed)),
        )
    }
}

// SAFETY: every byte of a chunk is handed out at most once between resets or
// rollbacks (the CAS, or exclusive access, advances `used` past it); chunks
// are 64-aligned, `used` stays a multiple of 64 and `fit` aligns beyond that;
// chunks are only freed or reused through `&mut self`, after which the trait
// contract considers their allocations reclaimed.
unsafe impl MemoryPool for CpuArena {
    fn name(&self) -> &'static str {
        "arena"
    }

    #[inline]
    fn allocate(&self, size: usize, align: usize) -> Result<Allocation> {
        check_request("arena", size, align)?;
        if size == 0 {
            return Ok(Allocation::zero_sized(align, self.id));
        }
        let ptr = match self.bump_shared(size, align) {
            Some(ptr) => ptr,
            None => self.allocate_slow(size, align)?,
        };
        Ok(self.handle(ptr, size, align))
    }

    #[inline]
    fn allocate_mut(&mut self, size: usize, align: usize) -> Result<Allocation> {
        check_request("arena", size, align)?;
        if size == 0 {
            return Ok(Allocation::zero_sized(align, self.id));
        }
        let ptr = match self.bump_exclusive(size, align) {
            Some(ptr) => ptr,
            None => self.allocate_slow(size, align)?,
        };
        Ok(self.handle(ptr, size, align))
    }

    #[inline]
    fn release_mut(&mut self, allocation: Allocation) -> Result<()> {
        self.release(allocation)
    }

    #[inline]
    fn release(&self, allocation: Allocation) -> Result<()> {
        if allocation.pool != self.id {
            return Err(foreign_allocation("arena", &allocation));
        }
        Ok(())
    }

    fn bulk_reset(&self) -> bool {
        true
    }

    #[inline]
    fn reset(&mut self) {
        self.retired_allocations += std::mem::take(self.live.get_mut()) as u64;
        self.epoch += 1;
        if *self.steady.get_mut() {
            // SAFETY: a steady arena has exactly one chunk, `current`.
            let chunk = unsafe { &*(*self.current.get_mut()) };
            let used = chunk.used.load(Ordering::Relaxed);
            chunk.used.store(0, Ordering::Relaxed);
            self.record_peak(used);
            return;
        }
        self.reset_slow();
    }

    fn supports_checkpoints(&self) -> bool {
        true
    }

    fn checkpoint(&self) -> Result<Checkpoint> {
        let inner = self.lock();
        Ok(Checkpoint {
            pool: self.id,
            epoch: self.epoch,
            position: Self::position(&inner),
            live: self.live.load(Ordering::Relaxed),
        })
    }

    /// Every live allocation ends at or below the bump position, and those
    /// made before `checkpoint` end at or below its position, so moving the
    /// bump position back to the lower of the two reclaims only allocations
    /// made after the checkpoint. A checkpoint may be rolled back to again.
    fn rollback(&mut self, checkpoint: Checkpoint) -> Result<()> {
        if checkpoint.pool != self.id {
            return Err(Error::invalid_arg(
                "arena: the checkpoint belongs to another pool",
            ));
        }
        if checkpoint.epoch != self.epoch {
            return Err(Error::invalid_arg(
                "arena: the checkpoint was taken before the last reset and is no longer valid",
            ));
        }
        let used = self.inner_mut().used();
        self.record_peak(used);
        let inner = self.inner_mut();
        let (chunks, offset) = checkpoint.position.min(Self::position(inner));
        inner.chunks.truncate(chunks);
        if let Some(last) = inner.chunks.last_mut() {
            *last.used.get_mut() = offset;
        }
        let live = self.live.get_mut();
        let kept = (*live).min(checkpoint.live);
        self.retired_allocations += (*live - kept) as u64;
        *live = kept;
        self.sync_current();
        Ok(())
    }

    fn stats(&self) -> PoolStats {
        let inner = self.lock();
        let used = inner.used();
        let live = self.live.load(Ordering::Relaxed);
        PoolStats {
            used_bytes: used,
            capacity_bytes: inner.capacity(),
            peak_bytes: self.peak.load(Ordering::Relaxed).max(used),
            live_allocations: live,
            total_allocations: self.retired_allocations + live as u64,
            system_allocations: inner.system_allocations,
        }
    }
}
