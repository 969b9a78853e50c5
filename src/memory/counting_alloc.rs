//! A counting global allocator, to prove that hot paths do not allocate.
//!
//! The library never installs it. A test or benchmark binary opts in:
//!
//! ```ignore
//! use nanoinfer::memory::counting_alloc::{self, CountingAlloc};
//!
//! #[global_allocator]
//! static GLOBAL: CountingAlloc = CountingAlloc::new();
//!
//! #[test]
//! fn step_does_not_allocate() {
//!     assert!(counting_alloc::is_installed());
//!     let ((), counts) = counting_alloc::measure(|| { /* one decode step */ });
//!     assert_eq!(counts.allocations, 0);
//! }
//! ```
//!
//! Counts are kept per thread ([`thread_counts`], [`measure`]), so tests
//! running in parallel do not disturb each other, and process-wide
//! ([`global_counts`]).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

/// Allocator calls counted over some span.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocCounts {
    /// `alloc` and `alloc_zeroed` calls.
    pub allocations: u64,
    /// `dealloc` calls.
    pub deallocations: u64,
    /// `realloc` calls.
    pub reallocations: u64,
    /// Bytes requested by allocations and reallocations (new sizes).
    pub bytes: u64,
}

impl AllocCounts {
    /// Calls of any kind.
    pub fn calls(&self) -> u64 {
        self.allocations + self.deallocations + self.reallocations
    }

    fn since(&self, earlier: &AllocCounts) -> AllocCounts {
        AllocCounts {
            allocations: self.allocations - earlier.allocations,
            deallocations: self.deallocations - earlier.deallocations,
            reallocations: self.reallocations - earlier.reallocations,
            bytes: self.bytes - earlier.bytes,
        }
    }
}

/// `System` with call counters. Declare it as the `#[global_allocator]` of a
/// test or benchmark binary.
pub struct CountingAlloc {
    inner: System,
}

impl Default for CountingAlloc {
    fn default() -> Self {
        Self::new()
    }
}

impl CountingAlloc {
    pub const fn new() -> Self {
        CountingAlloc { inner: System }
    }
}

struct Counters {
    allocations: AtomicU64,
    deallocations: AtomicU64,
    reallocations: AtomicU64,
    bytes: AtomicU64,
}

static GLOBAL: Counters = Counters {
    allocations: AtomicU64::new(0),
    deallocations: AtomicU64::new(0),
    reallocations: AtomicU64::new(0),
    bytes: AtomicU64::new(0),
};

// Const-initialised and without `Drop`: usable from inside the allocator
// (no lazy initialisation, no destructor registration).
thread_local! {
    static THREAD: Cell<AllocCounts> = const {
        Cell::new(AllocCounts { allocations: 0, deallocations: 0, reallocations: 0, bytes: 0 })
    };
}

#[derive(Clone, Copy)]
enum Call {
    Alloc,
    Dealloc,
    Realloc,
}

#[inline]
fn record(call: Call, bytes: usize) {
    let bytes = bytes as u64;
    let _ = THREAD.try_with(|cell| {
        let mut c = cell.get();
        match call {
            Call::Alloc => {
                c.allocations += 1;
                c.bytes += bytes;
            }
            Call::Dealloc => c.deallocations += 1,
            Call::Realloc => {
                c.reallocations += 1;
                c.bytes += bytes;
            }
        }
        cell.set(c);
    });
    match call {
        Call::Alloc => {
            GLOBAL.allocations.fetch_add(1, Ordering::Relaxed);
            GLOBAL.bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        Call::Dealloc => {
            GLOBAL.deallocations.fetch_add(1, Ordering::Relaxed);
        }
        Call::Realloc => {
            GLOBAL.reallocations.fetch_add(1, Ordering::Relaxed);
            GLOBAL.bytes.fetch_add(bytes, Ordering::Relaxed);
        }
    }
}

// SAFETY: every call is forwarded unchanged to `System`; counting touches
// only atomics and a const thread-local, neither of which allocates.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        record(Call::Alloc, layout.size());
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        record(Call::Alloc, layout.size());
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        record(Call::Dealloc, 0);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        record(Call::Realloc, new_size);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.realloc(ptr, layout, new_size) }
    }
}

/// Calls made by the current thread so far (all zero unless a
/// `CountingAlloc` is the global allocator).
pub fn thread_counts() -> AllocCounts {
    THREAD.try_with(Cell::get).unwrap_or_default()
}

/// Calls made by the whole process so far.
pub fn global_counts() -> AllocCounts {
    AllocCounts {
        allocations: GLOBAL.allocations.load(Ordering::Relaxed),
        deallocations: GLOBAL.deallocations.load(Ordering::Relaxed),
        reallocations: GLOBAL.reallocations.load(Ordering::Relaxed),
        bytes: GLOBAL.bytes.load(Ordering::Relaxed),
    }
}

/// Runs `f` and returns what it allocated on this thread.
pub fn measure<R>(f: impl FnOnce() -> R) -> (R, AllocCounts) {
    let before = thread_counts();
    let result = f();
    let after = thread_counts();
    (result, after.since(&before))
}

/// Whether a `CountingAlloc` is the global allocator (it allocates one
/// byte and checks that the counter moved), so a zero count cannot pass
/// vacuously.
pub fn is_installed() -> bool {
    let (_, counts) = measure(|| std::hint::black_box(Box::new(0u8)));
    counts.allocations > 0
}
