//! `Workspace`: typed scratch slices for one forward step, from any pool.

use std::cell::RefCell;
use std::mem::{self, MaybeUninit};
use std::ptr::NonNull;
use std::slice;

use super::{Allocation, CpuArena, CpuSlab, MemoryPool, MemoryPoolKind, PoolStats, SystemPool};
use crate::{Error, ErrorKind, Result};

/// Alignment of every workspace slice (a cache line, enough for AVX-512).
pub const WORKSPACE_ALIGN: usize = 64;

/// Usage figures of a context's workspace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkspaceStats {
    pub pool: MemoryPoolKind,
    /// The planned peak in bytes.
    pub planned_bytes: usize,
    /// The pool's figures (capacity, peak, system allocations).
    pub pool_stats: PoolStats,
    /// Explicit arena resizes (steps larger than planned).
    pub resizes: u64,
    pub steps: u64,
    /// Time spent acquiring (and zeroing) step buffers, in nanoseconds.
    pub acquire_ns: u64,
}

/// Types for which the all-zero bit pattern is a valid value.
///
/// # Safety
///
/// Implement only for types whose every field is valid when all bytes are 0.
pub unsafe trait Zeroable: Copy {}

macro_rules! zeroable {
    ($($t:ty),*) => { $(
        // SAFETY: all-zero bytes are a valid value of this primitive (0 / 0.0).
        unsafe impl Zeroable for $t {}
    )* };
}
zeroable!(u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize, f32, f64);
zeroable!(half::f16, half::bf16);
// SAFETY: an array of zeroable elements is zeroable.
unsafe impl<T: Zeroable, const N: usize> Zeroable for [T; N] {}

/// The workspace's pool: the built-in pools are held by value so that the
/// hot path is a direct, inlinable call; any other pool goes through `dyn`.
enum Pool {
    Arena(CpuArena),
    Slab(Box<CpuSlab>),
    System(SystemPool),
    Custom(Box<dyn MemoryPool>),
}

impl Pool {
    #[inline]
    fn get(&self) -> &dyn MemoryPool {
        match self {
            Pool::Arena(p) => p,
            Pool::Slab(p) => &**p,
            Pool::System(p) => p,
            Pool::Custom(p) => &**p,
        }
    }

    #[inline]
    fn allocate_mut(&mut self, size: usize, align: usize) -> Result<Allocation> {
        match self {
            Pool::Arena(p) => p.allocate_mut(size, align),
            Pool::Slab(p) => p.allocate_mut(size, align),
            Pool::System(p) => p.allocate_mut(size, align),
            Pool::Custom(p) => p.allocate_mut(size, align),
        }
    }

    #[inline]
    fn release_mut(&mut self, allocation: Allocation) -> Result<()> {
        match self {
            Pool::Arena(p) => p.release_mut(allocation),
            Pool::Slab(p) => p.release_mut(allocation),
            Pool::System(p) => p.release_mut(allocation),
            Pool::Custom(p) => p.release_mut(allocation),
        }
    }

    fn reset(&mut self) {
        match self {
            Pool::Arena(p) => p.reset(),
            Pool::Slab(p) => p.reset(),
            Pool::System(p) => p.reset(),
            Pool::Custom(p) => p.reset(),
        }
    }

    fn rollback(&mut self, checkpoint: super::Checkpoint) -> Result<()> {
        match self {
            Pool::Arena(p) => p.rollback(checkpoint),
            Pool::Slab(p) => p.rollback(checkpoint),
            Pool::System(p) => p.rollback(checkpoint),
            Pool::Custom(p) => p.rollback(checkpoint),
        }
    }
}

/// Scratch memory for one step.
///
/// Allocation takes `&self` and returns `&mut [T]` borrowed from the
/// workspace, so many slices can be live at once; `reset` (and `scope`) take
/// `&mut self`, so the borrow checker guarantees no slice outlives the memory
/// behind it:
///
/// ```
/// use nanoinfer::memory::{MemoryPoolKind, Workspace};
///
/// let mut ws = Workspace::with_kind(MemoryPoolKind::Arena, 1 << 20)?;
/// for _step in 0..3 {
///     let x = ws.alloc_zeroed::<f32>(1024)?;
///     let y = ws.alloc_filled::<f32>(1024, 1.5)?;
///     for (a, b) in x.iter_mut().zip(y.iter()) {
///         *a += 2.0 * b;
///     }
///     assert_eq!(x[7], 3.0);
///     ws.reset(); // all slices of this step are gone
/// }
/// # Ok::<(), nanoinfer::Error>(())
/// ```
///
/// A slice used after `reset` does not compile:
///
/// ```compile_fail
/// use nanoinfer::memory::{MemoryPoolKind, Workspace};
/// let mut ws = Workspace::with_kind(MemoryPoolKind::Arena, 1 << 20).unwrap();
/// let x = ws.alloc_zeroed::<f32>(4).unwrap();
/// ws.reset();
/// x[0] = 1.0;
/// ```
///
/// Nor does a slice escaping a `scope`:
///
/// ```compile_fail
/// use nanoinfer::memory::{MemoryPoolKind, Workspace};
/// let mut ws = Workspace::with_kind(MemoryPoolKind::Arena, 1 << 20).unwrap();
/// let leaked = ws.scope(|ws| ws.alloc_zeroed::<f32>(4).unwrap());
/// leaked[0] = 1.0;
/// ```
///
/// With an arena, `reset` is the arena's O(1) reset. With other pools the
/// workspace records each allocation in a reusable `Vec` and releases them
/// on `reset`, so after the first steps (warm-up) neither path touches the
/// system allocator.
pub struct Workspace {
    pool: RefCell<Pool>,
    /// Allocations to release on `reset` (pools without bulk reset).
    tracked: RefCell<Vec<Allocation>>,
    track: bool,
}

// Handing out `&mut [T]` from `&self` is the point (as in bumpalo): every
// call returns fresh, disjoint memory.
#[allow(clippy::mut_from_ref)]
impl Workspace {
    /// A workspace over any pool (calls go through `dyn`; the built-in pools
    /// are faster through [`Workspace::with_kind`] or `From`).
    pub fn new(pool: Box<dyn MemoryPool>) -> Self {
        Self::from_pool(Pool::Custom(pool))
    }

    /// A workspace over a new pool of `kind` (see [`create_pool`](super::create_pool)).
    pub fn with_kind(kind: MemoryPoolKind, initial_capacity: usize) -> Result<Self> {
        Ok(match kind {
            MemoryPoolKind::Arena => CpuArena::new(initial_capacity)?.into(),
            MemoryPoolKind::Slab => CpuSlab::new().into(),
            MemoryPoolKind::System => SystemPool::new().into(),
            MemoryPoolKind::CudaStream | MemoryPoolKind::CudaBuddy => {
                return Err(crate::Error::invalid_arg(format!(
                    "memory pool \"{kind}\" holds GPU memory and cannot back a host workspace"
                )))
            }
        })
    }

    fn from_pool(pool: Pool) -> Self {
        let track = !pool.get().bulk_reset();
        Workspace {
            pool: RefCell::new(pool),
            tracked: RefCell::new(Vec::new()),
            track,
        }
    }

    /// `len` zeros (written with `write_bytes`).
    #[inline]
    pub fn alloc_zeroed<T: Zeroable>(&self, len: usize) -> Result<&mut [T]> {
        let ptr = self.alloc_array::<T>(len)?;
        // SAFETY: `ptr` is valid for `len` elements (`alloc_array`), and all
        // zero bytes are a valid `T` (`Zeroable`).
        unsafe {
            ptr.as_ptr().write_bytes(0, len);
            Ok(slice::from_raw_parts_mut(ptr.as_ptr(), len))
        }
    }

    /// `len` copies of `value`.
    #[inline]
    pub fn alloc_filled<T: Copy>(&self, len: usize, value: T) -> Result<&mut [T]> {
        let uninit = self.alloc_uninit::<T>(len)?;
        for slot in uninit.iter_mut() {
            slot.write(value);
        }
        // SAFETY: every element was written just above.
        Ok(unsafe { slice::from_raw_parts_mut(uninit.as_mut_ptr().cast::<T>(), len) })
    }

    /// A copy of `src`.
    #[inline]
    pub fn alloc_copy<T: Copy>(&self, src: &[T]) -> Result<&mut [T]> {
        let ptr = self.alloc_array::<T>(src.len())?;
        // SAFETY: `ptr` is valid for `src.len()` elements and does not
        // overlap `src` (it is fresh pool memory).
        unsafe {
            ptr.as_ptr()
                .copy_from_nonoverlapping(src.as_ptr(), src.len());
            Ok(slice::from_raw_parts_mut(ptr.as_ptr(), src.len()))
        }
    }

    /// `len` uninitialised elements: the cheapest option when every element
    /// is written before it is read.
    #[inline]
    pub fn alloc_uninit<T: Copy>(&self, len: usize) -> Result<&mut [MaybeUninit<T>]> {
        let ptr = self.alloc_array::<T>(len)?;
        // SAFETY: `ptr` is valid for `len` elements; `MaybeUninit` needs no
        // initialisation.
        Ok(unsafe { slice::from_raw_parts_mut(ptr.as_ptr().cast::<MaybeUninit<T>>(), len) })
    }

    /// Reclaims every slice handed out (the borrow checker has ended them).
    pub fn reset(&mut self) {
        let pool = self.pool.get_mut();
        for allocation in self.tracked.get_mut().drain(..) {
            // Cannot fail: every tracked allocation came from this pool.
            let _ = pool.release_mut(allocation);
        }
        pool.reset();
    }

    /// Runs `f` and then reclaims the slices it allocated, keeping earlier
    /// ones (none can be borrowed during `f`). Arena: a checkpoint/rollback;
    /// other pools: releases the allocations `f` made. A pool with bulk reset
    /// but no checkpoints reclaims them only at the next `reset`.
    pub fn scope<R>(&mut self, f: impl FnOnce(&Workspace) -> R) -> R {
        let mark = self.tracked.get_mut().len();
        let checkpoint = if self.track {
            None
        } else {
            self.pool.get_mut().get().checkpoint().ok()
        };
        let result = f(self);
        let pool = self.pool.get_mut();
        if self.track {
            for allocation in self.tracked.get_mut().drain(mark..) {
                let _ = pool.release_mut(allocation);
            }
        } else if let Some(checkpoint) = checkpoint {
            // Cannot fail: the checkpoint is ours and nothing reset the pool
            // during `f` (that needs `&mut self`).
            let _ = pool.rollback(checkpoint);
        }
        result
    }

    /// Resets the workspace and, when its pool is an arena holding less
    /// than `bytes`, resizes the arena to `bytes` (an explicit, logged
    /// resize; see [`CpuArena::reserve`]). Returns whether it resized. Other
    /// pools take memory as it is asked for and only reset.
    pub fn reserve(&mut self, bytes: usize) -> Result<bool> {
        self.reset();
        match self.pool.get_mut() {
            Pool::Arena(arena) => arena.reserve(bytes),
            _ => Ok(false),
        }
    }

    /// The pool's usage figures.
    pub fn stats(&self) -> PoolStats {
        self.pool.borrow().get().stats()
    }

    /// The pool's name ("arena", "slab", "system").
    pub fn pool_name(&self) -> &'static str {
        self.pool.borrow().get().name()
    }

    /// Allocates from a pool without bulk reset and records the allocation
    /// (out of line, to keep the arena path of `alloc_array` small).
    #[inline(never)]
    fn allocate_tracked(&self, pool: &mut Pool, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        if self.track {
            // Reserve first so that a failure cannot lose the allocation.
            self.tracked.borrow_mut().try_reserve(1).map_err(|_| {
                Error::new(
                    ErrorKind::OutOfMemory,
                    "workspace: cannot grow the allocation list",
                )
            })?;
        }
        let allocation = pool.allocate_mut(bytes, align)?;
        let ptr = allocation.ptr();
        if self.track {
            self.tracked.borrow_mut().push(allocation);
        }
        Ok(ptr)
    }

    /// Room for `len` elements of `T`, aligned to `max(align_of::<T>(), 64)`.
    #[inline]
    fn alloc_array<T>(&self, len: usize) -> Result<NonNull<T>> {
        let size = mem::size_of::<T>();
        if size == 0 || len == 0 {
            return Ok(NonNull::dangling());
        }
        let bytes = len.checked_mul(size).ok_or_else(|| {
            Error::new(
                ErrorKind::OutOfMemory,
                format!("workspace: {len} elements of {size} bytes overflow the address space"),
            )
        })?;
        let align = mem::align_of::<T>().max(WORKSPACE_ALIGN);
        let mut pool = self.pool.borrow_mut();
        let ptr = match &mut *pool {
            // The hot path: a bump, nothing to record.
            Pool::Arena(arena) => arena.allocate_mut(bytes, align)?.ptr(),
            pool => self.allocate_tracked(pool, bytes, align)?,
        };
        Ok(ptr.cast::<T>())
    }
}

impl Drop for Workspace {
    fn drop(&mut self) {
        let pool = self.pool.get_mut();
        for allocation in self.tracked.get_mut().drain(..) {
            let _ = pool.release_mut(allocation);
        }
    }
}

impl From<CpuArena> for Workspace {
    fn from(pool: CpuArena) -> Self {
        Self::from_pool(Pool::Arena(pool))
    }
}

impl From<CpuSlab> for Workspace {
    fn from(pool: CpuSlab) -> Self {
        Self::from_pool(Pool::Slab(Box::new(pool)))
    }
}

impl From<SystemPool> for Workspace {
    fn from(pool: SystemPool) -> Self {
        Self::from_pool(Pool::System(pool))
    }
}
