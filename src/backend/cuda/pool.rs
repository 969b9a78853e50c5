//! Device memory pools of a session ([`DevicePool`]s): where its workspace
//! and KV cache come from.
//!
//! - [`CudaStreamPool`]: a stream-ordered pool of its own
//!   (`cuMemPoolCreate`), allocating with `cuMemAllocFromPoolAsync` and
//!   freeing with `cuMemFreeAsync` on the device's compute stream. Its
//!   release threshold decides how much freed memory it keeps cached at a
//!   synchronization; destroying it gives everything back to the driver.
//! - [`CudaBuddy`]: one `cuMemAlloc` region sized for the session up
//!   front, carved by the buddy allocator of `memory::buddy`.
//!
//! Both release in stream order: all work runs on the one compute stream,
//! so memory released while queued kernels still use it is reused only by
//! work queued after them. Each pool synchronizes the stream before it
//! gives its memory back to the driver.

use super::{cuda_error, CudaDevice};
use crate::memory::buddy::BuddyAllocator;
use crate::memory::{DeviceAllocation, DevicePool, MemoryPoolKind, PoolId, PoolStats};
use crate::{Error, ErrorKind, Result};
use cudarc::driver::{result, sys, CudaContext, CudaStream};
use std::sync::{Arc, Mutex};

/// Alignment every pool allocation gets (and the most a caller may ask
/// for): what `cudaMalloc` guarantees, enough for any vector access.
pub const DEVICE_ALIGN: usize = 256;

/// Smallest block of a [`CudaBuddy`].
pub const BUDDY_MIN_BLOCK: usize = 256;

fn check_align(pool: &str, align: usize) -> Result<()> {
    if align.is_power_of_two() && align <= DEVICE_ALIGN {
        Ok(())
    } else {
        Err(Error::invalid_arg(format!(
            "{pool} pool: alignment {align} is not a power of two up to {DEVICE_ALIGN}"
        )))
    }
}

fn foreign(pool: &str, a: &DeviceAllocation) -> Error {
    Error::invalid_arg(format!(
        "{pool} pool: the allocation at {:#x} ({} bytes) belongs to another pool",
        a.addr(),
        a.size()
    ))
}

/// Counters kept by the pool itself (the driver knows bytes, not handles).
#[derive(Default)]
struct Counts {
    live: usize,
    total: u64,
    system: u64,
}

/// A stream-ordered CUDA memory pool of one session.
pub struct CudaStreamPool {
    id: PoolId,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    pool: sys::CUmemoryPool,
    counts: Mutex<Counts>,
}

// SAFETY: a CUmemoryPool handle may be used from any thread (the driver
// API is thread-safe); the counters are behind a mutex.
unsafe impl Send for CudaStreamPool {}
// SAFETY: as above.
unsafe impl Sync for CudaStreamPool {}

impl CudaStreamPool {
    /// The default release threshold: keep everything. A session's pool
    /// allocates once, when the session is created, and holds those
    /// buffers until it ends, when destroying the pool returns all of it;
    /// trimming at every synchronization would buy nothing.
    pub const KEEP_ALL: u64 = u64::MAX;

    /// A new pool on `dev`'s GPU whose cached free memory above
    /// `release_threshold` bytes goes back to the driver at each stream
    /// synchronization.
    pub fn new(dev: &CudaDevice, release_threshold: u64) -> Result<Self> {
        dev.ctx
            .bind_to_thread()
            .map_err(|e| cuda_error("binding the context", e))?;
        // SAFETY: all-zero pool properties are valid (no IPC handles, no
        // size limit, default usage); the fields that matter are set next.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = dev.ctx.cu_device();
        // SAFETY: `props` is a valid, initialized CUmemPoolProps.
        let pool = unsafe { result::mem_pool::create(&props) }
            .map_err(|e| cuda_error("cuMemPoolCreate", e))?;
        let p = CudaStreamPool {
            id: PoolId::next(),
            ctx: dev.ctx.clone(),
            stream: dev.stream.clone(),
            pool,
            counts: Mutex::new(Counts::default()),
        };
        let mut threshold = release_threshold;
        // SAFETY: the pool is live; RELEASE_THRESHOLD takes a cuuint64_t.
        unsafe {
            result::mem_pool::set_attribute(
                p.pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
        }
        .map_err(|e| cuda_error("cuMemPoolSetAttribute(RELEASE_THRESHOLD)", e))?;
        Ok(p)
    }

    /// A 64-bit attribute of the pool (0 if the driver cannot answer).
    fn attribute(&self, attr: sys::CUmemPool_attribute) -> u64 {
        let mut v = 0u64;
        // SAFETY: the pool is live; the byte-count attributes are cuuint64_t.
        let ok = unsafe {
            result::mem_pool::get_attribute(self.pool, attr, (&mut v as *mut u64).cast())
        };
        ok.map_or(0, |_| v)
    }

    /// Bytes the pool holds from the driver now, and at most since creation
    /// (or the last `reset_peaks`).
    pub fn reserved(&self) -> (u64, u64) {
        use sys::CUmemPool_attribute as A;
        (
            self.attribute(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
            self.attribute(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH),
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl DevicePool for CudaStreamPool {
    fn name(&self) -> &'static str {
        MemoryPoolKind::CudaStream.as_str()
    }

    fn allocate(&self, size: usize, align: usize) -> Result<DeviceAllocation> {
        check_align(self.name(), align)?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_error("binding the context", e))?;
        let reserved_before = self.reserved().0;
        // SAFETY: pool and stream are live; the memory is handed out as a
        // raw address and written before it is read (DeviceBuffer zeroes it).
        let addr = unsafe {
            result::mem_pool::alloc_async(self.pool, size.max(1), self.stream.cu_stream())
        }
        .map_err(|e| cuda_error(&format!("cuMemAllocFromPoolAsync of {size} bytes"), e))?;
        if addr % align as u64 != 0 {
            // SAFETY: just allocated from this pool, not handed out.
            let _ = unsafe { result::free_async(addr, self.stream.cu_stream()) };
            return Err(Error::internal(format!(
                "cuda-stream pool: the driver returned {addr:#x}, not aligned to {align}"
            )));
        }
        let mut c = self.lock();
        c.live += 1;
        c.total += 1;
        if self.reserved().0 > reserved_before {
            c.system += 1;
        }
        Ok(DeviceAllocation::new(addr, size, self.id))
    }

    fn release(&self, allocation: DeviceAllocation) -> Result<()> {
        if allocation.pool_id() != self.id {
            return Err(foreign(self.name(), &allocation));
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_error("binding the context", e))?;
        // SAFETY: the address came from this pool and the handle (not
        // Clone) is consumed here, so it is freed once; stream order keeps
        // queued users ahead of any reuse.
        unsafe { result::free_async(allocation.addr(), self.stream.cu_stream()) }
            .map_err(|e| cuda_error("cuMemFreeAsync", e))?;
        self.lock().live -= 1;
        Ok(())
    }

    fn stats(&self) -> PoolStats {
        use sys::CUmemPool_attribute as A;
        let c = self.lock();
        PoolStats {
            used_bytes: self.attribute(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT) as usize,
            capacity_bytes: self.attribute(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) as usize,
            peak_bytes: self.attribute(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH) as usize,
            live_allocations: c.live,
            total_allocations: c.total,
            system_allocations: c.system,
        }
    }
}

impl Drop for CudaStreamPool {
    fn drop(&mut self) {
        // Every buffer holds the pool, so all were released (their frees
        // queued); wait for those, then hand the memory back to the driver.
        let _ = self.ctx.bind_to_thread();
        let _ = self.stream.synchronize();
        // SAFETY: the pool is live and destroyed once, here.
        let _ = unsafe { result::mem_pool::destroy(self.pool) };
    }
}

/// A buddy allocator over one device allocation.
pub struct CudaBuddy {
    id: PoolId,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    base: u64,
    buddy: Mutex<(BuddyAllocator, u64)>,
}

impl CudaBuddy {
    /// Allocates `capacity` bytes (rounded up to [`BUDDY_MIN_BLOCK`]) with
    /// `cuMemAlloc` at once. See [`BuddyAllocator::capacity_for`] to size
    /// it for a known sequence of allocations.
    pub fn new(dev: &CudaDevice, capacity: usize) -> Result<Self> {
        let capacity = capacity.max(1).next_multiple_of(BUDDY_MIN_BLOCK);
        dev.ctx
            .bind_to_thread()
            .map_err(|e| cuda_error("binding the context", e))?;
        // SAFETY: plain allocation; freed once in Drop.
        let base = unsafe { result::malloc_sync(capacity) }.map_err(|e| {
            cuda_error(
                &format!("cuMemAlloc of the {capacity}-byte buddy region"),
                e,
            )
        })?;
        let buddy = match BuddyAllocator::new(capacity, BUDDY_MIN_BLOCK) {
            Ok(b) => b,
            Err(e) => {
                // SAFETY: allocated above, not handed out.
                let _ = unsafe { result::free_sync(base) };
                return Err(e);
            }
        };
        Ok(CudaBuddy {
            id: PoolId::next(),
            ctx: dev.ctx.clone(),
            stream: dev.stream.clone(),
            base,
            buddy: Mutex::new((buddy, 0)),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (BuddyAllocator, u64)> {
        self.buddy.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes of the region.
    pub fn capacity(&self) -> usize {
        self.lock().0.capacity()
    }
}

impl DevicePool for CudaBuddy {
    fn name(&self) -> &'static str {
        MemoryPoolKind::CudaBuddy.as_str()
    }

    fn allocate(&self, size: usize, align: usize) -> Result<DeviceAllocation> {
        check_align(self.name(), align)?;
        let mut g = self.lock();
        let block = g.0.allocate(size, align).map_err(|e| {
            Error::new(
                ErrorKind::OutOfMemory,
                format!("cuda-buddy pool: {}", e.message),
            )
        })?;
        g.1 += 1;
        // The region's base is aligned to DEVICE_ALIGN (cuMemAlloc) and the
        // block's offset to its own size, at least BUDDY_MIN_BLOCK.
        Ok(DeviceAllocation::new(
            self.base + block.offset as u64,
            size,
            self.id,
        ))
    }

    fn release(&self, allocation: DeviceAllocation) -> Result<()> {
        if allocation.pool_id() != self.id {
            return Err(foreign(self.name(), &allocation));
        }
        let offset = (allocation.addr() - self.base) as usize;
        self.lock().0.release(offset).map(|_| ())
    }

    fn stats(&self) -> PoolStats {
        let g = self.lock();
        PoolStats {
            used_bytes: g.0.used(),
            capacity_bytes: g.0.capacity(),
            peak_bytes: g.0.peak(),
            live_allocations: g.0.live_allocations(),
            total_allocations: g.1,
            system_allocations: 1,
        }
    }
}

impl Drop for CudaBuddy {
    fn drop(&mut self) {
        // Kernels queued on the stream may still use the region.
        let _ = self.ctx.bind_to_thread();
        let _ = self.stream.synchronize();
        // SAFETY: allocated in `new`, freed once, here, after the stream
        // drained; every buffer from it is gone (each holds the pool).
        let _ = unsafe { result::free_sync(self.base) };
    }
}

/// Creates the device pool of a session: `kind` must be a GPU pool;
/// `buddy_capacity` sizes a [`CudaBuddy`] (the stream pool grows on demand).
pub fn create_device_pool(
    dev: &CudaDevice,
    kind: MemoryPoolKind,
    buddy_capacity: usize,
) -> Result<Arc<dyn DevicePool>> {
    Ok(match kind {
        MemoryPoolKind::CudaStream => {
            let threshold = super::env_number(
                "NANOINFER_CUDA_POOL_RELEASE_BYTES",
                CudaStreamPool::KEEP_ALL,
            );
            Arc::new(CudaStreamPool::new(dev, threshold)?)
        }
        MemoryPoolKind::CudaBuddy => Arc::new(CudaBuddy::new(dev, buddy_capacity)?),
        cpu => {
            cpu.check_device(true, "cuda")?;
            return Err(Error::internal(format!("{cpu} is not a GPU pool")));
        }
    })
}
