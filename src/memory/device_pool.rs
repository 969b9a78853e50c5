//! Pools of device (GPU) memory.
//!
//! Device memory cannot be dereferenced by the host, so it must never go
//! through [`MemoryPool`](super::MemoryPool), whose allocations `Workspace`
//! turns into `&mut [T]`. A [`DevicePool`] hands out plain device addresses
//! instead; buffers built on them (the CUDA backend's `DeviceBuffer`) give
//! their allocation back when dropped. Implementations: `CudaStreamPool`
//! and `CudaBuddy` in `backend::cuda`.

use super::{PoolId, PoolStats};
use crate::Result;

/// A region of device memory handed out by a [`DevicePool`]. Not `Clone`:
/// releasing consumes it, so one allocation cannot be released twice.
#[derive(Debug)]
pub struct DeviceAllocation {
    addr: u64,
    size: usize,
    pool: PoolId,
}

impl DeviceAllocation {
    pub(crate) fn new(addr: u64, size: usize, pool: PoolId) -> Self {
        DeviceAllocation { addr, size, pool }
    }

    /// Device address of the first byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Bytes requested.
    pub fn size(&self) -> usize {
        self.size
    }

    pub fn pool_id(&self) -> PoolId {
        self.pool
    }
}

/// A source of device memory for one session's long-lived buffers
/// (workspace, KV cache). Allocation and release are ordered on the
/// device's compute stream: memory released while kernels that use it are
/// still queued is reused only by work queued after them.
pub trait DevicePool: Send + Sync {
    /// Short lowercase name ("cuda-stream", "cuda-buddy").
    fn name(&self) -> &'static str;
    /// `size` bytes aligned to `align` (a power of two). Errors with
    /// `OutOfMemory` when the pool or the device has no room.
    fn allocate(&self, size: usize, align: usize) -> Result<DeviceAllocation>;
    /// Gives an allocation back; refuses one from another pool.
    fn release(&self, allocation: DeviceAllocation) -> Result<()>;
    /// `used_bytes`, `capacity_bytes` (reserved from the device), `peak_bytes`,
    /// `live_allocations`, `total_allocations`, `system_allocations`.
    fn stats(&self) -> PoolStats;
}
