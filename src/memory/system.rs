//! `SystemPool`: every allocation goes to `std::alloc` (the global
//! allocator). The baseline the other pools are measured against.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::{
    check_request, foreign_allocation, out_of_memory, Allocation, MemoryPool, PoolId, PoolStats,
};
use crate::Result;

/// Plain `std::alloc` allocations with usage counters.
pub struct SystemPool {
    id: PoolId,
    used: AtomicUsize,
    peak: AtomicUsize,
    allocations: AtomicU64,
    releases: AtomicU64,
}

impl Default for SystemPool {
    fn default() -> Self {
        Self::new()
    }
}

impl SystemPool {
    pub fn new() -> Self {
        SystemPool {
            id: PoolId::next(),
            used: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            allocations: AtomicU64::new(0),
            releases: AtomicU64::new(0),
        }
    }

    fn raw_allocate(size: usize, align: usize) -> Result<NonNull<u8>> {
        let layout = Layout::from_size_align(size, align)
            .map_err(|_| out_of_memory("system", size, align, "invalid layout"))?;
        // SAFETY: `size > 0` (zero-byte requests return earlier).
        NonNull::new(unsafe { alloc::alloc(layout) })
            .ok_or_else(|| out_of_memory("system", size, align, "the system allocator refused"))
    }

    fn raw_release(allocation: &Allocation) {
        // SAFETY: the allocation came from `raw_allocate` with this (valid)
        // layout: it carries our pool id and cannot be copied, so it is
        // released once.
        unsafe {
            alloc::dealloc(
                allocation.ptr.as_ptr(),
                Layout::from_size_align_unchecked(allocation.size, allocation.align),
            )
        };
    }
}

// SAFETY: each allocation is a distinct block from the global allocator with
// the requested size and alignment.
unsafe impl MemoryPool for SystemPool {
    fn name(&self) -> &'static str {
        "system"
    }

    fn allocate(&self, size: usize, align: usize) -> Result<Allocation> {
        check_request("system", size, align)?;
        if size == 0 {
            return Ok(Allocation::zero_sized(align, self.id));
        }
        let ptr = Self::raw_allocate(size, align)?;
        let now = self.used.fetch_add(size, Ordering::Relaxed) + size;
        if now > self.peak.load(Ordering::Relaxed) {
            self.peak.fetch_max(now, Ordering::Relaxed);
        }
        self.allocations.fetch_add(1, Ordering::Relaxed);
        Ok(Allocation::new(ptr, size, align, self.id))
    }

    fn allocate_mut(&mut self, size: usize, align: usize) -> Result<Allocation> {
        check_request("system", size, align)?;
        if size == 0 {
            return Ok(Allocation::zero_sized(align, self.id));
        }
        let ptr = Self::raw_allocate(size, align)?;
        let used = self.used.get_mut();
        *used += size;
        let peak = self.peak.get_mut();
        *peak = (*peak).max(*used);
        *self.allocations.get_mut() += 1;
        Ok(Allocation::new(ptr, size, align, self.id))
    }

    fn release(&self, allocation: Allocation) -> Result<()> {
        if allocation.pool != self.id {
            return Err(foreign_allocation("system", &allocation));
        }
        if allocation.size == 0 {
            return Ok(());
        }
        Self::raw_release(&allocation);
        self.used.fetch_sub(allocation.size, Ordering::Relaxed);
        self.releases.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn release_mut(&mut self, allocation: Allocation) -> Result<()> {
        if allocation.pool != self.id {
            return Err(foreign_allocation("system", &allocation));
        }
        if allocation.size == 0 {
            return Ok(());
        }
        Self::raw_release(&allocation);
        *self.used.get_mut() -= allocation.size;
        *self.releases.get_mut() += 1;
        Ok(())
    }

    fn bulk_reset(&self) -> bool {
        false
    }

    /// No-op: blocks are given back one by one with `release`.
    fn reset(&mut self) {}

    fn stats(&self) -> PoolStats {
        let used = self.used.load(Ordering::Relaxed);
        let allocations = self.allocations.load(Ordering::Relaxed);
        let releases = self.releases.load(Ordering::Relaxed);
        PoolStats {
            used_bytes: used,
            capacity_bytes: used,
            peak_bytes: self.peak.load(Ordering::Relaxed).max(used),
            live_allocations: allocations.saturating_sub(releases) as usize,
            total_allocations: allocations,
            system_allocations: allocations,
        }
    }
}
