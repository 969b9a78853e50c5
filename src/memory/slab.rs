//! `CpuSlab`: power-of-two size classes from 16 B to 512 KiB.

use std::alloc::{self, Layout};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use super::{
    check_request, foreign_allocation, out_of_memory, Allocation, MemoryPool, PoolId, PoolStats,
};
use crate::Result;

const MIN_CLASS_SHIFT: u32 = 4;
const MAX_CLASS_SHIFT: u32 = 19;
const NUM_CLASSES: usize = (MAX_CLASS_SHIFT - MIN_CLASS_SHIFT + 1) as usize;
const SLAB_BYTES: usize = 1 << 20;

struct ClassState {
    /// Head of the intrusive free list (null when empty).
    free: *mut u8,
    /// Newest slab (null before the first) and the bytes carved from it.
    slab: *mut u8,
    carved: usize,
    slabs: Vec<NonNull<u8>>,
    allocations: u64,
    releases: u64,
}

// SAFETY: the raw pointers refer to slab memory owned by the pool; the state
// is only reached through its mutex or through `&mut CpuSlab`.
unsafe impl Send for ClassState {}

impl ClassState {
    const fn new() -> Self {
        ClassState {
            free: ptr::null_mut(),
            slab: ptr::null_mut(),
            carved: 0,
            slabs: Vec::new(),
            allocations: 0,
            releases: 0,
        }
    }

    /// A block from the free list or the current slab's tail, if any.
    #[inline]
    fn take(&mut self, block: usize) -> Option<NonNull<u8>> {
        if let Some(head) = NonNull::new(self.free) {
            // SAFETY: free blocks are at least 16 bytes, aligned to at least
            // 16, and hold the next pointer written by `give`.
            self.free = unsafe { head.as_ptr().cast::<*mut u8>().read() };
            return Some(head);
        }
        if !self.slab.is_null() && self.carved + block <= SLAB_BYTES {
            // SAFETY: `carved + block <= SLAB_BYTES`, inside the slab.
            let p = unsafe { self.slab.add(self.carved) };
            self.carved += block;
            return NonNull::new(p);
        }
        None
    }

    /// Pushes a block onto the free list.
    #[inline]
    fn give(&mut self, p: NonNull<u8>) {
        // SAFETY: `p` is a released block of this class (>= 16 bytes, aligned
        // to >= 16), no longer used by anyone; it now stores the next pointer.
        unsafe { p.as_ptr().cast::<*mut u8>().write(self.free) };
        self.free = p.as_ptr();
    }

    /// Allocates a new slab and carves its first block.
    #[cold]
    #[inline(never)]
    fn new_slab(&mut self, class: usize) -> Option<NonNull<u8>> {
        let block = class_size(class);
        self.slabs.try_reserve(1).ok()?;
        // SAFETY: the layout has a non-zero size.
        let slab = NonNull::new(unsafe { alloc::alloc(slab_layout(class)) })?;
        self.slabs.push(slab);
        self.slab = slab.as_ptr();
        self.carved = block;
        Some(slab)
    }
}

#[inline]
fn class_size(class: usize) -> usize {
    1 << (class as u32 + MIN_CLASS_SHIFT)
}

fn slab_layout(class: usize) -> Layout {
    // SAFETY: the alignment is a power of two (a class size, at most 512 KiB,
    // or 64) and 1 MiB rounded up to it is far below `isize::MAX`.
    unsafe { Layout::from_size_align_unchecked(SLAB_BYTES, class_size(class).max(64)) }
}

/// Size class for a request, or `None` when it bypasses the slabs.
#[inline]
fn class_of(size: usize, align: usize) -> Option<usize> {
    let need = size.max(align).max(1 << MIN_CLASS_SHIFT);
    if need > CpuSlab::MAX_CLASS_SIZE {
        return None;
    }
    Some((need.next_power_of_two().trailing_zeros() - MIN_CLASS_SHIFT) as usize)
}

#[cold]
fn slab_oom(size: usize, align: usize) -> crate::Error {
    out_of_memory("slab", size, align, "could not allocate a new 1 MiB slab")
}

/// Layout of a block that bypasses the slabs (cache-line aligned at least).
fn large_layout(size: usize, align: usize) -> Option<Layout> {
    Layout::from_size_align(size, align.max(64)).ok()
}

/// Size-class pool with per-class free lists.
///
/// Each class has a mutex-protected state: an intrusive free list (the next
/// pointer lives in the freed block itself, so releasing never allocates) and
/// the uncarved tail of its newest 1 MiB slab. A request is served from the
/// free list (a hit), else carved from the slab tail, else from a new slab
/// (a miss, one system allocation per slab). Slabs go back to the system only
/// when the pool is dropped.
///
/// A request of `size` bytes at `align` uses the class
/// `max(size, align, 16).next_power_of_two()`. Slabs are aligned to their
/// class size, so every block is aligned to its class size: any alignment up
/// to 512 KiB is honoured. Requests whose class would exceed 512 KiB (large
/// sizes or large alignments) go straight to the system allocator.
pub struct CpuSlab {
    id: PoolId,
    classes: [Mutex<ClassState>; NUM_CLASSES],
    used: AtomicUsize,
    peak: AtomicUsize,
    capacity: AtomicUsize,
    system_allocations: AtomicU64,
    large_allocations: AtomicU64,
    large_releases: AtomicU64,
}

impl Default for CpuSlab {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuSlab {
    /// Smallest block handed out.
    pub const MIN_CLASS_SIZE: usize = 1 << MIN_CLASS_SHIFT;
    /// Largest size class; bigger requests go to the system allocator.
    pub const MAX_CLASS_SIZE: usize = 1 << MAX_CLASS_SHIFT;
    /// Bytes of one slab carved into blocks of one class.
    pub const SLAB_BYTES: usize = SLAB_BYTES;

    pub fn new() -> Self {
        CpuSlab {
            id: PoolId::next(),
            classes: std::array::from_fn(|_| Mutex::new(ClassState::new())),
            used: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            capacity: AtomicUsize::new(0),
            system_allocations: AtomicU64::new(0),
            large_allocations: AtomicU64::new(0),
            large_releases: AtomicU64::new(0),
        }
    }

    /// The block size a request gets, or `None` when it bypasses the slabs.
    pub fn class_size_for(size: usize, align: usize) -> Option<usize> {
        class_of(size, align).map(class_size)
    }

    #[inline]
    fn add_used(&self, bytes: usize) {
        let now = self.used.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if now > self.peak.load(Ordering::Relaxed) {
            self.peak.fetch_max(now, Ordering::Relaxed);
        }
    }

    #[inline]
    fn add_used_mut(&mut self, bytes: usize) {
        let used = self.used.get_mut();
        *used += bytes;
        let peak = self.peak.get_mut();
        *peak = (*peak).max(*used);
    }

    /// A block above the largest class, straight from the system.
    #[cold]
    #[inline(never)]
    fn allocate_large(&self, size: usize, align: usize) -> Result<NonNull<u8>> {
        let layout = large_layout(size, align)
            .ok_or_else(|| out_of_memory("slab", size, align, "invalid layout"))?;
        // SAFETY: `size > 0` (zero-byte requests return earlier).
        let ptr = NonNull::new(unsafe { alloc::alloc(layout) })
            .ok_or_else(|| out_of_memory("slab", size, align, "the system allocator refused"))?;
        self.add_used(size);
        self.capacity.fetch_add(size, Ordering::Relaxed);
        self.system_allocations.fetch_add(1, Ordering::Relaxed);
        self.large_allocations.fetch_add(1, Ordering::Relaxed);
        Ok(ptr)
    }

    /// The hot path of `allocate`: a block from the free list or the slab
    /// tail, or `None` for everything else (bad or empty requests, large
    /// blocks, a class that needs a new slab).
    ///
    /// The hot paths return a pointer so that callers merge them with the
    /// slow path on a register rather than on a 32-byte handle in memory,
    /// which would cost a store-forwarding stall per allocation.
    #[inline]
    fn pop_shared(&self, size: usize, align: usize) -> Option<NonNull<u8>> {
        if size == 0 || !align.is_power_of_two() {
            return None;
        }
        let class = class_of(size, align)?;
        let block = class_size(class);
        let mut state = self.classes[class]
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let ptr = state.take(block)?;
        state.allocations += 1;
        drop(state);
        self.add_used(block);
        Some(ptr)
    }

    /// `pop_shared` without locking.
    #[inline]
    fn pop_exclusive(&mut self, size: usize, align: usize) -> Option<NonNull<u8>> {
        if size == 0 || !align.is_power_of_two() {
            return None;
        }
        let class = class_of(size, align)?;
        let block = class_size(class);
        let state = self.classes[class]
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        let ptr = state.take(block)?;
        state.allocations += 1;
        self.add_used_mut(block);
        Some(ptr)
    }

    /// Everything `pop_*` declines: validation, empty and large requests,
    /// carving a new slab. Exclusive callers come here too (through `&self`).
    #[cold]
    #[inline(never)]
    fn allocate_slow(&self, size: usize, align: usize) -> Result<NonNull<u8>> {
        check_request("slab", size, align)?;
        if size == 0 {
            return Ok(Allocation::zero_sized(align, self.id).ptr());
        }
        let Some(class) = class_of(size, align) else {
            return self.allocate_large(size, align);
        };
        let block = class_size(class);
        let mut state = self.classes[class]
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let ptr = match state.take(block) {
            Some(p) => p,
            None => {
                let p = state.new_slab(class).ok_or_else(|| slab_oom(size, align))?;
                self.capacity.fetch_add(SLAB_BYTES, Ordering::Relaxed);
                self.system_allocations.fetch_add(1, Ordering::Relaxed);
                p
            }
        };
        state.allocations += 1;
        drop(state);
        self.add_used(block);
        Ok(ptr)
    }

    #[cold]
    #[inline(never)]
    fn release_large(&self, allocation: Allocation) {
        if let Some(layout) = large_layout(allocation.size, allocation.align) {
            // SAFETY: the allocation came from `allocate_large` with this
            // layout (it carries our id and cannot be copied), and is
            // released once because releasing consumes the handle.
            unsafe { alloc::dealloc(allocation.ptr.as_ptr(), layout) };
        }
        self.used.fetch_sub(allocation.size, Ordering::Relaxed);
        self.capacity.fetch_sub(allocation.size, Ordering::Relaxed);
        self.large_releases.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for CpuSlab {
    fn drop(&mut self) {
        for (class, state) in self.classes.iter_mut().enumerate() {
            let state = state.get_mut().unwrap_or_else(PoisonError::into_inner);
            for slab in state.slabs.drain(..) {
                // SAFETY: every slab was allocated with `slab_layout(class)`
                // and is freed once, here.
                unsafe { alloc::dealloc(slab.as_ptr(), slab_layout(class)) };
            }
        }
    }
}

// SAFETY: a block is either on one free list, in the uncarved tail of one
// slab, or handed out, never two of these at once; blocks of a class never
// overlap (slabs are disjoint, carving advances by the class size), and
// class-size-aligned slabs make every block aligned to its class size, which
// is at least the requested alignment. Large blocks come from the system.
unsafe impl MemoryPool for CpuSlab {
    fn name(&self) -> &'static str {
        "slab"
    }

    #[inline]
    fn allocate(&self, size: usize, align: usize) -> Result<Allocation> {
        let ptr = match self.pop_shared(size, align) {
            Some(ptr) => ptr,
            None => self.allocate_slow(size, align)?,
        };
        Ok(Allocation::new(ptr, size, align, self.id))
    }

    #[inline]
    fn allocate_mut(&mut self, size: usize, align: usize) -> Result<Allocation> {
        let ptr = match self.pop_exclusive(size, align) {
            Some(ptr) => ptr,
            None => self.allocate_slow(size, align)?,
        };
        Ok(Allocation::new(ptr, size, align, self.id))
    }

    #[inline]
    fn release(&self, allocation: Allocation) -> Result<()> {
        if allocation.pool != self.id {
            return Err(foreign_allocation("slab", &allocation));
        }
        if allocation.size == 0 {
            return Ok(());
        }
        let Some(class) = class_of(allocation.size, allocation.align) else {
            self.release_large(allocation);
            return Ok(());
        };
        let mut state = self.classes[class]
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        state.give(allocation.ptr);
        state.releases += 1;
        drop(state);
        self.used.fetch_sub(class_size(class), Ordering::Relaxed);
        Ok(())
    }

    #[inline]
    fn release_mut(&mut self, allocation: Allocation) -> Result<()> {
        if allocation.pool != self.id {
            return Err(foreign_allocation("slab", &allocation));
        }
        if allocation.size == 0 {
            return Ok(());
        }
        let Some(class) = class_of(allocation.size, allocation.align) else {
            self.release_large(allocation);
            return Ok(());
        };
        let state = self.classes[class]
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        state.give(allocation.ptr);
        state.releases += 1;
        *self.used.get_mut() -= class_size(class);
        Ok(())
    }

    fn bulk_reset(&self) -> bool {
        false
    }

    /// No-op: blocks are given back one by one with `release`.
    fn reset(&mut self) {}

    fn stats(&self) -> PoolStats {
        let (mut allocations, mut releases) = (0u64, 0u64);
        for state in &self.classes {
            let state = state.lock().unwrap_or_else(PoisonError::into_inner);
            allocations += state.allocations;
            releases += state.releases;
        }
        let large = self.large_allocations.load(Ordering::Relaxed);
        let large_released = self.large_releases.load(Ordering::Relaxed);
        let used = self.used.load(Ordering::Relaxed);
        PoolStats {
            used_bytes: used,
            capacity_bytes: self.capacity.load(Ordering::Relaxed),
            peak_bytes: self.peak.load(Ordering::Relaxed).max(used),
            live_allocations: (allocations + large).saturating_sub(releases + large_released)
                as usize,
            total_allocations: allocations + large,
            system_allocations: self.system_allocations.load(Ordering::Relaxed),
        }
    }
}
