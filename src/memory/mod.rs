//! Memory pools: where activations and other scratch memory come from.
//!
//! A [`MemoryPool`] hands out raw, aligned byte regions ([`Allocation`]s).
//! Three CPU pools implement it:
//!
//! | pool | allocate | release | `reset` | checkpoints |
//! |---|---|---|---|---|
//! | [`CpuArena`] | bump pointer | no-op | O(1): frees everything | yes |
//! | [`CpuSlab`] | power-of-two free lists, 16 B … 512 KiB | back to its free list | no-op | no |
//! | [`SystemPool`] | `std::alloc` (the baseline) | `std::alloc::dealloc` | no-op | no |
//!
//! Device (GPU) memory goes through [`DevicePool`] instead, whose
//! allocations are plain device addresses: `CudaStreamPool` (a stream-ordered
//! pool of the session's own) and `CudaBuddy` (the [`buddy`] allocator over
//! one device allocation) hold a CUDA session's workspace and KV cache. A
//! session picks one pool ([`MemoryPoolKind`]); the default is the arena on
//! the CPU and `cuda-stream` on a GPU, and a pool of the other device is refused.
//!
//! Safe Rust code does not use allocations directly: the per-step
//! [`Workspace`] turns a pool into typed `&mut [T]` slices whose lifetimes end
//! before the workspace can be reset.
//!
//! Methods taking `&self` are thread-safe. The `*_mut` variants
//! ([`MemoryPool::allocate_mut`], [`MemoryPool::release_mut`]) do the same
//! work without synchronisation when the caller has exclusive access, which is
//! the workspace's (single-threaded) hot path.
//!
//! Failures are errors, never aborts: an unsatisfiable request returns
//! [`ErrorKind::OutOfMemory`], a bad alignment [`ErrorKind::InvalidArgument`].

mod arena;
pub mod buddy;
mod budget;
pub mod counting_alloc;
mod device_pool;
mod fallible;
mod fault_switch;
mod slab;
mod system;
mod workspace;

#[cfg(test)]
mod tests;

use std::fmt;
use std::ptr::NonNull;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Error, ErrorKind, Result};

pub use arena::CpuArena;
pub use budget::{check_fits, utilization_kv_bytes, BudgetSource, DeviceMemory, MemoryBudget};
pub use device_pool::{DeviceAllocation, DevicePool};
pub use fallible::{try_with_capacity, zeroed_f32};
pub use fault_switch::PoolFaultSwitch;
pub use slab::CpuSlab;
pub use system::SystemPool;
pub use workspace::{Workspace, WorkspaceStats, Zeroable, WORKSPACE_ALIGN};

/// Identity of one pool instance; every [`Allocation`] and [`Checkpoint`]
/// carries the id of the pool that made it so that a pool can refuse
/// handles that belong to another pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PoolId(u64);

impl PoolId {
    /// A process-wide unique id.
    pub(crate) fn next() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        PoolId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// A region handed out by a [`MemoryPool`].
///
/// The handle is deliberately neither `Clone` nor `Copy`: giving it back with
/// [`MemoryPool::release`] consumes it, so one allocation cannot be released
/// twice. Dropping it without releasing leaks the region until the pool is
/// dropped (arena, slab size classes) or for good (system pool, slab blocks
/// above 512 KiB). Reading or writing through [`Allocation::ptr`] is `unsafe`
/// and valid only while the allocation is live: not released, and (arena) not
/// reclaimed by `reset` or `rollback`.
#[derive(Debug)]
pub struct Allocation {
    ptr: NonNull<u8>,
    size: usize,
    align: usize,
    pool: PoolId,
}

// SAFETY: an `Allocation` is an address plus bookkeeping; it grants no access
// by itself (dereferencing needs `unsafe`), and every pool accepts releases
// from any thread.
unsafe impl Send for Allocation {}
// SAFETY: as above; `&Allocation` only exposes plain values.
unsafe impl Sync for Allocation {}

impl Allocation {
    #[inline]
    pub(crate) fn new(ptr: NonNull<u8>, size: usize, align: usize, pool: PoolId) -> Self {
        Allocation {
            ptr,
            size,
            align,
            pool,
        }
    }

    /// A zero-byte allocation: a dangling, `align`-aligned pointer.
    pub(crate) fn zero_sized(align: usize, pool: PoolId) -> Self {
        let dangling = std::ptr::null_mut::<u8>().wrapping_add(align);
        let ptr = NonNull::new(dangling).unwrap_or(NonNull::dangling());
        Allocation {
            ptr,
            size: 0,
            align,
            pool,
        }
    }

    /// Start of the region; aligned to [`Allocation::align`].
    #[inline]
    pub fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// Bytes requested (the region may be larger, e.g. a slab size class).
    #[inline]
    pub fn size(&self) -> usize {
        self.size
    }

    /// Alignment requested.
    #[inline]
    pub fn align(&self) -> usize {
        self.align
    }

    /// The pool that made this allocation.
    #[inline]
    pub fn pool_id(&self) -> PoolId {
        self.pool
    }
}

/// A position in a pool that supports [`MemoryPool::rollback`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checkpoint {
    pub(crate) pool: PoolId,
    /// Incremented by every `reset`; a checkpoint from an earlier epoch is refused.
    pub(crate) epoch: u64,
    /// Pool-defined position (arena: number of chunks, offset in the last one).
    pub(crate) position: (usize, usize),
    /// Live allocations when the checkpoint was taken.
    pub(crate) live: usize,
}

/// Usage figures of a pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes held by live allocations, including the pool's rounding (slab
    /// size class, arena alignment padding). Arena: everything allocated since
    /// the last `reset`/`rollback`, because its `release` is a no-op.
    pub used_bytes: usize,
    /// Bytes the pool currently holds from the system.
    pub capacity_bytes: usize,
    /// Highest `used_bytes` seen since the pool was created.
    pub peak_bytes: usize,
    /// Allocations handed out and not yet given back (arena: since the last
    /// `reset`/`rollback`).
    pub live_allocations: usize,
    /// Successful non-empty `allocate` calls since the pool was created.
    pub total_allocations: u64,
    /// Times the pool asked the system allocator for memory (arena chunks,
    /// slabs, blocks that bypass the slab, every system-pool allocation).
    pub system_allocations: u64,
}

/// A source of aligned scratch memory (see the [module docs](self)).
///
/// All methods are object-safe; pools are used as `Box<dyn MemoryPool>`.
/// Zero-byte requests succeed with a dangling, aligned pointer and consume
/// nothing. `align` must be a power of two.
///
/// # Safety
///
/// Implementors promise that every non-empty allocation they return is valid
/// for reads and writes of `size` bytes, aligned to `align`, and disjoint from
/// every other live allocation of the pool, until it is released or, for
/// pools whose [`bulk_reset`](MemoryPool::bulk_reset) is true, reclaimed by
/// `reset`/`rollback`. [`Workspace`] hands this memory to safe code as
/// `&mut [T]` and relies on that promise.
pub unsafe trait MemoryPool: Send + Sync {
    /// Short lowercase name ("arena", "slab", "system").
    fn name(&self) -> &'static str;

    /// Allocates `size` bytes aligned to `align`. Thread-safe.
    fn allocate(&self, size: usize, align: usize) -> Result<Allocation>;

    /// Same as [`allocate`](MemoryPool::allocate), without synchronisation.
    fn allocate_mut(&mut self, size: usize, align: usize) -> Result<Allocation> {
        self.allocate(size, align)
    }

    /// Gives an allocation back. Errors (and leaks it) when it belongs to
    /// another pool. Arena: a no-op, the memory comes back at `reset`/`rollback`.
    fn release(&self, allocation: Allocation) -> Result<()>;

    /// Same as [`release`](MemoryPool::release), without synchronisation.
    fn release_mut(&mut self, allocation: Allocation) -> Result<()> {
        self.release(allocation)
    }

    /// True when [`reset`](MemoryPool::reset) reclaims every allocation at
    /// once (arena). When false, `reset` leaves live allocations alone.
    fn bulk_reset(&self) -> bool;

    /// Arena: reclaims every allocation in O(1) (and merges grown chunks
    /// into one region). Other pools: no-op.
    fn reset(&mut self);

    /// Whether [`checkpoint`](MemoryPool::checkpoint) and
    /// [`rollback`](MemoryPool::rollback) are supported.
    fn supports_checkpoints(&self) -> bool {
        false
    }

    /// The current position, for a later [`rollback`](MemoryPool::rollback).
    /// Pools without checkpoints return `ErrorKind::Unsupported`.
    fn checkpoint(&self) -> Result<Checkpoint> {
        Err(Error::unsupported(format!(
            "the {} memory pool does not support checkpoints",
            self.name()
        )))
    }

    /// Reclaims every allocation made since `checkpoint` was taken.
    /// Allocations made before it stay valid. Pools without checkpoints
    /// return `ErrorKind::Unsupported`.
    fn rollback(&mut self, checkpoint: Checkpoint) -> Result<()> {
        let _ = checkpoint;
        Err(Error::unsupported(format!(
            "the {} memory pool does not support rollback",
            self.name()
        )))
    }

    fn stats(&self) -> PoolStats;
}

/// The pool implementations a session can choose.
///
/// CPU pools serve the host step workspace: the default there is the arena
/// (a session's workspace is planned, so a bump region reset every step
/// serves it without touching the system allocator). GPU pools
/// ([`DevicePool`]s) hold a CUDA session's workspace and KV cache: the
/// default there is `CudaStream`. A session refuses a pool of the other
/// kind of device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum MemoryPoolKind {
    #[default]
    Arena,
    Slab,
    System,
    /// A stream-ordered CUDA memory pool of the session's own
    /// (`cuMemPoolCreate` + `cuMemAllocFromPoolAsync`).
    CudaStream,
    /// A buddy allocator over one device allocation sized for the session.
    CudaBuddy,
}

impl MemoryPoolKind {
    /// Every pool, CPU ones first.
    pub const ALL: [MemoryPoolKind; 5] = [
        MemoryPoolKind::Arena,
        MemoryPoolKind::Slab,
        MemoryPoolKind::System,
        MemoryPoolKind::CudaStream,
        MemoryPoolKind::CudaBuddy,
    ];
    /// The pools of host memory (implementing [`MemoryPool`]).
    pub const CPU: [MemoryPoolKind; 3] = [
        MemoryPoolKind::Arena,
        MemoryPoolKind::Slab,
        MemoryPoolKind::System,
    ];
    /// The pools of GPU memory (implementing [`DevicePool`]).
    pub const GPU: [MemoryPoolKind; 2] = [MemoryPoolKind::CudaStream, MemoryPoolKind::CudaBuddy];

    pub fn as_str(self) -> &'static str {
        match self {
            MemoryPoolKind::Arena => "arena",
            MemoryPoolKind::Slab => "slab",
            MemoryPoolKind::System => "system",
            MemoryPoolKind::CudaStream => "cuda-stream",
            MemoryPoolKind::CudaBuddy => "cuda-buddy",
        }
    }

    /// Whether this pool hands out GPU memory.
    pub fn is_gpu(self) -> bool {
        matches!(self, MemoryPoolKind::CudaStream | MemoryPoolKind::CudaBuddy)
    }

    /// The default pool of a session on a GPU (`gpu`) or on the CPU.
    pub fn default_for(gpu: bool) -> Self {
        if gpu {
            MemoryPoolKind::CudaStream
        } else {
            MemoryPoolKind::Arena
        }
    }

    /// Checks that this pool serves the device a model runs on (`gpu`;
    /// `device` names it in the error).
    pub fn check_device(self, gpu: bool, device: &str) -> Result<()> {
        if self.is_gpu() == gpu {
            return Ok(());
        }
        let (mine, theirs, choices) = if gpu {
            (
                "CPU",
                "a GPU",
                "\"cuda-stream\" (default) or \"cuda-buddy\"",
            )
        } else {
            (
                "GPU",
                "the CPU",
                "\"arena\" (default), \"slab\" or \"system\"",
            )
        };
        Err(Error::invalid_arg(format!(
            "memory pool \"{self}\" is a {mine} pool but the model runs on {theirs} ({device}); \
             choose {choices}"
        )))
    }
}

impl fmt::Display for MemoryPoolKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for MemoryPoolKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let name = s.trim().to_ascii_lowercase().replace('_', "-");
        MemoryPoolKind::ALL
            .into_iter()
            .find(|k| k.as_str() == name)
            .ok_or_else(|| {
                Error::invalid_arg(format!(
                    "unknown memory pool {s:?}: expected \"arena\", \"slab\", \"system\", \
                     \"cuda-stream\" or \"cuda-buddy\""
                ))
            })
    }
}

/// Creates a host pool. `initial_capacity` is the arena's first region in
/// bytes; the slab (which carves slabs on demand) and the system pool
/// ignore it. Fails with `OutOfMemory` when the arena's region cannot be
/// allocated, and with `InvalidArgument` for a GPU pool (those are
/// [`DevicePool`]s, made by the CUDA backend).
pub fn create_pool(kind: MemoryPoolKind, initial_capacity: usize) -> Result<Box<dyn MemoryPool>> {
    Ok(match kind {
        MemoryPoolKind::Arena => Box::new(CpuArena::new(initial_capacity)?),
        MemoryPoolKind::Slab => Box::new(CpuSlab::new()),
        MemoryPoolKind::System => Box::new(SystemPool::new()),
        MemoryPoolKind::CudaStream | MemoryPoolKind::CudaBuddy => {
            return Err(Error::invalid_arg(format!(
                "memory pool \"{kind}\" holds GPU memory and cannot serve host buffers"
            )))
        }
    })
}

/// Reports pool events that deserve attention (arena growth). One place so
/// that the library's log callback can take it over.
pub(crate) fn log(message: &str) {
    eprintln!("[nanoinfer::memory] {message}");
}

/// Checks a request's shape: `align` a power of two, and `size` rounded up to
/// `align` representable as a `Layout` (at most `isize::MAX`).
#[inline]
pub(crate) fn check_request(pool: &str, size: usize, align: usize) -> Result<()> {
    if align.is_power_of_two() && size <= isize::MAX as usize - (align - 1) {
        Ok(())
    } else {
        Err(bad_request(pool, size, align))
    }
}

#[cold]
fn bad_request(pool: &str, size: usize, align: usize) -> Error {
    if !align.is_power_of_two() {
        Error::invalid_arg(format!(
            "{pool} pool: alignment {align} is not a power of two"
        ))
    } else {
        out_of_memory(pool, size, align, "the request exceeds the address space")
    }
}

#[cold]
pub(crate) fn out_of_memory(pool: &str, size: usize, align: usize, why: &str) -> Error {
    Error::new(
        ErrorKind::OutOfMemory,
        format!("{pool} pool: cannot allocate {size} bytes (align {align}): {why}"),
    )
}

#[cold]
pub(crate) fn foreign_allocation(pool: &str, allocation: &Allocation) -> Error {
    Error::invalid_arg(format!(
        "{pool} pool: the allocation at {:p} ({} bytes) belongs to another pool",
        allocation.ptr, allocation.size
    ))
}
