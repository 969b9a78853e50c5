//! One test suite run against every pool, plus pool-specific checks.
//! Sizes shrink under Miri (`cargo +nightly miri test`).

use std::collections::HashSet;
use std::slice;
use std::sync::Arc;

use super::*;
use crate::ErrorKind;

const MANY: usize = if cfg!(miri) { 24 } else { 300 };
const THREAD_ITERS: usize = if cfg!(miri) { 20 } else { 2000 };

/// Deterministic pseudo-random numbers (no dependency).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn fill(a: &Allocation, byte: u8) {
    // SAFETY: a live allocation is valid for `size` bytes of writes.
    unsafe { a.ptr().as_ptr().write_bytes(byte, a.size()) }
}

fn holds(a: &Allocation, byte: u8) -> bool {
    // SAFETY: a live allocation is valid for `size` bytes of reads, and was filled.
    unsafe { slice::from_raw_parts(a.ptr().as_ptr(), a.size()) }
        .iter()
        .all(|&b| b == byte)
}

fn addr(a: &Allocation) -> usize {
    a.ptr().as_ptr() as usize
}

fn assert_disjoint(allocations: &[Allocation]) {
    let mut ranges: Vec<(usize, usize)> = allocations
        .iter()
        .filter(|a| a.size() > 0)
        .map(|a| (addr(a), addr(a) + a.size()))
        .collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        assert!(
            w[0].1 <= w[1].0,
            "allocations {:x?} and {:x?} overlap",
            w[0],
            w[1]
        );
    }
}

fn release_all(pool: &dyn MemoryPool, allocations: Vec<Allocation>) {
    for a in allocations {
        pool.release(a).unwrap();
    }
}

/// The checks every pool must pass.
mod suite {
    use super::*;

    pub type Make = fn() -> Box<dyn MemoryPool>;

    pub fn alignment(make: Make) {
        let mut pool = make();
        let mut live = Vec::new();
        for shift in 0..=12 {
            let align = 1usize << shift;
            for (i, size) in [1usize, 3, 64, 100, 5000].into_iter().enumerate() {
                let a = if i % 2 == 0 {
                    pool.allocate(size, align).unwrap()
                } else {
                    pool.allocate_mut(size, align).unwrap()
                };
                assert_eq!(
                    addr(&a) % align,
                    0,
                    "{}: {size} bytes at align {align}",
                    pool.name()
                );
                assert_eq!((a.size(), a.align()), (size, align));
                fill(&a, shift as u8 + 1);
                live.push((a, shift as u8 + 1));
            }
        }
        for (a, byte) in &live {
            assert!(holds(a, *byte), "{}: pattern lost", pool.name());
        }
        let allocations: Vec<Allocation> = live.into_iter().map(|(a, _)| a).collect();
        assert_disjoint(&allocations);
        release_all(&*pool, allocations);
    }

    pub fn no_overlap(make: Make) {
        let mut pool = make();
        let mut rng = Lcg(7);
        let aligns = [1usize, 8, 16, 64, 256];
        let mut live: Vec<(Allocation, u8)> = Vec::new();
        for i in 0..MANY {
            let size = 1 + rng.below(3000) as usize;
            let align = aligns[rng.below(aligns.len() as u64) as usize];
            let a = pool.allocate_mut(size, align).unwrap();
            let byte = (i % 251) as u8 + 1;
            fill(&a, byte);
            live.push((a, byte));
        }
        // Release every other one, allocate more, and check that the
        // survivors were not touched.
        let mut kept = Vec::new();
        for (i, (a, byte)) in live.into_iter().enumerate() {
            if i % 2 == 0 {
                pool.release_mut(a).unwrap();
            } else {
                kept.push((a, byte));
            }
        }
        for i in 0..MANY / 2 {
            let a = pool.allocate(1 + rng.below(3000) as usize, 16).unwrap();
            let byte = 255 - (i % 200) as u8;
            fill(&a, byte);
            kept.push((a, byte));
        }
        for (a, byte) in &kept {
            assert!(
                holds(a, *byte),
                "{}: a live allocation was overwritten",
                pool.name()
            );
        }
        let allocations: Vec<Allocation> = kept.into_iter().map(|(a, _)| a).collect();
        assert_disjoint(&allocations);
        release_all(&*pool, allocations);
    }

    pub fn stats(make: Make) {
        let mut pool = make();
        let s0 = pool.stats();
        assert_eq!(
            (s0.used_bytes, s0.live_allocations, s0.total_allocations),
            (0, 0, 0)
        );
        let a = pool.allocate(100, 8).unwrap();
        let b = pool.allocate_mut(100, 8).unwrap();
        let c = pool.allocate(100, 8).unwrap();
        let s = pool.stats();
        assert_eq!((s.live_allocations, s.total_allocations), (3, 3));
        assert!(s.used_bytes >= 300, "{}: {s:?}", pool.name());
        assert!(
            s.capacity_bytes >= s.used_bytes && s.peak_bytes >= s.used_bytes,
            "{s:?}"
        );
        assert!(s.system_allocations >= 1, "{s:?}");
        pool.release(b).unwrap();
        let s2 = pool.stats();
        if pool.bulk_reset() {
            assert_eq!(s2.live_allocations, 3, "arena release is a no-op");
            assert_eq!(s2.used_bytes, s.used_bytes);
        } else {
            assert_eq!(s2.live_allocations, 2);
            assert!(s2.used_bytes < s.used_bytes, "{s2:?} vs {s:?}");
        }
        pool.release_mut(a).unwrap();
        pool.release(c).unwrap();
        pool.reset();
        let s3 = pool.stats();
        assert_eq!(
            (s3.used_bytes, s3.live_allocations, s3.total_allocations),
            (0, 0, 3)
        );
        assert!(s3.peak_bytes >= 300, "{s3:?}");
    }

    pub fn reset(make: Make) {
        let mut pool = make();
        let a = pool.allocate(256, 64).unwrap();
        fill(&a, 0xA5);
        let first = addr(&a);
        if pool.bulk_reset() {
            pool.reset(); // reclaims `a`
            assert_eq!(pool.stats().used_bytes, 0);
            let b = pool.allocate(256, 64).unwrap();
            assert_eq!(addr(&b), first, "arena reuses its region after reset");
        } else {
            pool.reset();
            assert!(
                holds(&a, 0xA5),
                "{}: reset must not touch live allocations",
                pool.name()
            );
            assert_eq!(pool.stats().live_allocations, 1);
            pool.release(a).unwrap();
        }
    }

    pub fn checkpoints(make: Make) {
        let mut pool = make();
        if !pool.supports_checkpoints() {
            let err = pool.checkpoint().unwrap_err();
            assert_eq!(err.kind, ErrorKind::Unsupported);
            assert!(err.message.contains(pool.name()), "{err}");
            let arena = CpuArena::new(64).unwrap();
            let foreign = arena.checkpoint().unwrap();
            assert_eq!(
                pool.rollback(foreign).unwrap_err().kind,
                ErrorKind::Unsupported
            );
            return;
        }
        let a = pool.allocate(100, 16).unwrap();
        fill(&a, 1);
        let cp = pool.checkpoint().unwrap();
        let used_at_cp = pool.stats().used_bytes;
        let grown_at_cp = pool.stats().system_allocations;
        let b = pool.allocate(200, 16).unwrap();
        let b_addr = addr(&b);
        let _c = pool.allocate_mut(50, 16).unwrap();
        assert_eq!(pool.stats().live_allocations, 3);
        pool.rollback(cp).unwrap();
        let s = pool.stats();
        assert_eq!((s.live_allocations, s.used_bytes), (1, used_at_cp));
        let b2 = pool.allocate(200, 16).unwrap();
        if pool.stats().system_allocations == grown_at_cp {
            // (A growing arena frees chunks chained after the checkpoint, so
            // only an arena that did not grow lands on the same address.)
            assert_eq!(
                addr(&b2),
                b_addr,
                "rollback reclaims what came after the checkpoint"
            );
        }
        assert!(
            holds(&a, 1),
            "rollback keeps what came before the checkpoint"
        );
        // The same checkpoint can be rolled back to again.
        pool.rollback(cp).unwrap();
        assert_eq!(pool.stats().used_bytes, used_at_cp);
        // Checkpoints of another pool, or from before a reset, are refused.
        let other = CpuArena::new(64).unwrap().checkpoint().unwrap();
        assert_eq!(
            pool.rollback(other).unwrap_err().kind,
            ErrorKind::InvalidArgument
        );
        pool.reset();
        let err = pool.rollback(cp).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidArgument);
        assert!(err.message.contains("reset"), "{err}");
    }

    pub fn threads(make: Make) {
        let pool: Arc<dyn MemoryPool> = Arc::from(make());
        let workers: Vec<_> = (0..4u8)
            .map(|t| {
                let pool = Arc::clone(&pool);
                std::thread::spawn(move || {
                    let mut rng = Lcg(t as u64 + 1);
                    let mut live: Vec<(Allocation, u8)> = Vec::new();
                    for i in 0..THREAD_ITERS {
                        if live.len() >= 16 || (!live.is_empty() && rng.below(3) == 0) {
                            let (a, byte) = live.swap_remove(rng.below(live.len() as u64) as usize);
                            assert!(holds(&a, byte), "thread {t}: block corrupted");
                            pool.release(a).unwrap();
                        } else {
                            let size = if i % 97 == 0 && !cfg!(miri) {
                                600 * 1024 // above the slab's largest class
                            } else {
                                1 + rng.below(4096) as usize
                            };
                            let a = pool.allocate(size, 1 << rng.below(7)).unwrap();
                            let byte = t * 50 + (i % 50) as u8 + 1;
                            fill(&a, byte);
                            live.push((a, byte));
                        }
                    }
                    for (a, byte) in live {
                        assert!(holds(&a, byte), "thread {t}: block corrupted");
                        pool.release(a).unwrap();
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        let s = pool.stats();
        if !pool.bulk_reset() {
            assert_eq!(
                (s.live_allocations, s.used_bytes),
                (0, 0),
                "{}: {s:?}",
                pool.name()
            );
        }
        assert!(s.total_allocations > 0 && s.peak_bytes > 0, "{s:?}");
    }

    pub fn large_block(make: Make) {
        let mut pool = make();
        let size = if cfg!(miri) {
            600 * 1024
        } else {
            3 * 1024 * 1024 + 1
        };
        let before = pool.stats();
        let a = pool.allocate(size, 4096).unwrap();
        assert_eq!(addr(&a) % 4096, 0);
        fill(&a, 0x5A);
        let b = pool.allocate_mut(64, 64).unwrap();
        fill(&b, 0x11);
        assert!(holds(&a, 0x5A) && holds(&b, 0x11));
        assert!(pool.stats().used_bytes >= before.used_bytes + size);
        pool.release_mut(a).unwrap();
        pool.release(b).unwrap();
        pool.reset();
        assert_eq!(pool.stats().live_allocations, 0);
    }

    pub fn out_of_memory(make: Make) {
        let mut pool = make();
        for (size, align) in [(usize::MAX, 1), (isize::MAX as usize, 64)] {
            let err = pool.allocate(size, align).unwrap_err();
            assert_eq!(err.kind, ErrorKind::OutOfMemory, "{err}");
            assert!(err.message.contains(&size.to_string()), "{err}");
        }
        if !cfg!(miri) {
            // Valid layouts the system cannot back.
            for size in [1usize << 60, isize::MAX as usize - 4096] {
                assert_eq!(
                    pool.allocate(size, 64).unwrap_err().kind,
                    ErrorKind::OutOfMemory
                );
                assert_eq!(
                    pool.allocate_mut(size, 64).unwrap_err().kind,
                    ErrorKind::OutOfMemory
                );
            }
        }
        // The pool still works.
        let a = pool.allocate(128, 64).unwrap();
        fill(&a, 3);
        assert!(holds(&a, 3));
        pool.release(a).unwrap();
    }

    pub fn bad_alignment(make: Make) {
        let mut pool = make();
        for align in [0usize, 3, 48, usize::MAX] {
            let err = pool.allocate(16, align).unwrap_err();
            assert_eq!(err.kind, ErrorKind::InvalidArgument);
            assert!(err.message.contains("power of two"), "{err}");
            assert_eq!(
                pool.allocate_mut(16, align).unwrap_err().kind,
                ErrorKind::InvalidArgument
            );
        }
        assert_eq!(pool.stats().total_allocations, 0);
    }

    pub fn foreign_release(make: Make) {
        let mut pool = make();
        let other = SystemPool::new();
        // A refused release leaks the block (documented on `release`); under
        // Miri, whose leak check would report that, the strangers are
        // zero-sized (the pool id is checked first either way).
        let size = if cfg!(miri) { 0 } else { 32 };
        let stranger = other.allocate(size, 16).unwrap();
        let before = pool.stats();
        let err = pool.release(stranger).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidArgument);
        assert!(err.message.contains("another pool"), "{err}");
        let stranger = other.allocate(size, 16).unwrap();
        assert_eq!(
            pool.release_mut(stranger).unwrap_err().kind,
            ErrorKind::InvalidArgument
        );
        assert_eq!(pool.stats(), before);
    }

    pub fn zero_size(make: Make) {
        let mut pool = make();
        for align in [1usize, 64, 4096] {
            let a = pool.allocate(0, align).unwrap();
            assert_eq!((a.size(), addr(&a) % align), (0, 0));
            pool.release(a).unwrap();
            let a = pool.allocate_mut(0, align).unwrap();
            pool.release_mut(a).unwrap();
        }
        assert_eq!(pool.stats().total_allocations, 0);
    }
}

macro_rules! pool_suite {
    ($($module:ident => $make:expr;)*) => {$(
        mod $module {
            use super::*;
            fn make() -> Box<dyn MemoryPool> {
                $make
            }
            #[test] fn alignment() { suite::alignment(make) }
            #[test] fn no_overlap() { suite::no_overlap(make) }
            #[test] fn stats() { suite::stats(make) }
            #[test] fn reset() { suite::reset(make) }
            #[test] fn checkpoints() { suite::checkpoints(make) }
            #[test] fn threads() { suite::threads(make) }
            #[test] fn large_block() { suite::large_block(make) }
            #[test] fn out_of_memory() { suite::out_of_memory(make) }
            #[test] fn bad_alignment() { suite::bad_alignment(make) }
            #[test] fn foreign_release() { suite::foreign_release(make) }
            #[test] fn zero_size() { suite::zero_size(make) }
        }
    )*};
}

pool_suite! {
    arena => Box::new(CpuArena::new(1 << 20).unwrap());
    // Starts tiny so that every check also exercises chained growth.
    arena_growing => Box::new(CpuArena::new(256).unwrap());
    slab => Box::new(CpuSlab::new());
    system => Box::new(SystemPool::new());
}

mod arena_only {
    use super::*;

    #[test]
    fn growth_keeps_allocations_and_merges_at_reset() {
        let mut arena = CpuArena::new(1024).unwrap();
        let a = arena.allocate(800, 64).unwrap();
        fill(&a, 1);
        let b = arena.allocate(800, 64).unwrap(); // does not fit: chains a chunk
        fill(&b, 2);
        assert_eq!(arena.chunk_count(), 2);
        assert!(holds(&a, 1) && holds(&b, 2));
        let s = arena.stats();
        assert_eq!(
            (s.capacity_bytes, s.system_allocations, s.used_bytes),
            (2048, 2, 2 * 832)
        );
        arena.reset();
        assert_eq!(arena.chunk_count(), 1);
        let s = arena.stats();
        assert_eq!(
            (s.capacity_bytes, s.system_allocations, s.used_bytes),
            (2048, 3, 0)
        );
        // The merged region now holds the whole step without growing.
        let _a = arena.allocate(800, 64).unwrap();
        let _b = arena.allocate(800, 64).unwrap();
        assert_eq!(
            (arena.chunk_count(), arena.stats().system_allocations),
            (1, 3)
        );
        arena.reset();
        assert_eq!(
            arena.stats().system_allocations,
            3,
            "a steady state allocates nothing"
        );
    }

    #[test]
    fn fixed_arena_refuses_to_grow() {
        let mut arena = CpuArena::fixed(1024).unwrap();
        assert!(!arena.is_growable());
        let _a = arena.allocate(1000, 8).unwrap();
        let err = arena.allocate(100, 8).unwrap_err();
        assert_eq!(err.kind, ErrorKind::OutOfMemory);
        assert!(err.message.contains("fixed arena"), "{err}");
        arena.reset();
        let _b = arena.allocate(1024, 64).unwrap();
        assert_eq!(arena.chunk_count(), 1);
    }

    #[test]
    fn zero_capacity_arena_grows_on_first_use() {
        let mut arena = CpuArena::new(0).unwrap();
        assert_eq!(arena.stats().capacity_bytes, 0);
        let a = arena.allocate_mut(100, 128).unwrap();
        assert_eq!(addr(&a) % 128, 0);
        fill(&a, 9);
        assert!(holds(&a, 9));
        arena.reset();
        assert!(arena.stats().capacity_bytes >= 100);
    }

    #[test]
    fn rollback_drops_chunks_chained_after_the_checkpoint() {
        let mut arena = CpuArena::new(1024).unwrap();
        let a = arena.allocate(512, 64).unwrap();
        fill(&a, 4);
        let cp = arena.checkpoint().unwrap();
        let _b = arena.allocate(900, 64).unwrap();
        assert_eq!(arena.chunk_count(), 2);
        arena.rollback(cp).unwrap();
        assert_eq!(arena.chunk_count(), 1);
        let c = arena.allocate(64, 64).unwrap();
        assert_eq!(addr(&c), addr(&a) + 512);
        assert!(holds(&a, 4));
        // The growth is remembered: the next reset merges to the larger size.
        arena.reset();
        assert!(arena.stats().capacity_bytes >= 2048);
    }

    #[test]
    fn rollback_never_moves_forward() {
        let mut arena = CpuArena::new(4096).unwrap();
        let a = arena.allocate(64, 64).unwrap();
        let cp1 = arena.checkpoint().unwrap();
        let _b = arena.allocate(1000, 64).unwrap();
        let cp2 = arena.checkpoint().unwrap();
        arena.rollback(cp1).unwrap();
        // cp2 lies beyond the current position: rolling back to it keeps the position.
        arena.rollback(cp2).unwrap();
        let c = arena.allocate(64, 64).unwrap();
        assert_eq!(addr(&c), addr(&a) + 64);
    }

    #[test]
    fn concurrent_growth() {
        let arena = Arc::new(CpuArena::new(512).unwrap());
        let workers: Vec<_> = (0..4u8)
            .map(|t| {
                let arena = Arc::clone(&arena);
                std::thread::spawn(move || {
                    let mut mine = Vec::new();
                    for i in 0..MANY {
                        let a = arena.allocate(1 + (i * 37) % 700, 32).unwrap();
                        fill(&a, t + 1);
                        mine.push(a);
                    }
                    mine.iter().all(|a| holds(a, t + 1))
                })
            })
            .collect();
        for w in workers {
            assert!(w.join().unwrap(), "a block was overwritten");
        }
        let mut arena = Arc::into_inner(arena).unwrap();
        assert_eq!(arena.stats().live_allocations, 4 * MANY);
        arena.reset();
        assert_eq!(arena.stats().used_bytes, 0);
    }
}

mod slab_only {
    use super::*;

    #[test]
    fn size_classes() {
        assert_eq!(CpuSlab::class_size_for(1, 1), Some(16));
        assert_eq!(CpuSlab::class_size_for(16, 1), Some(16));
        assert_eq!(CpuSlab::class_size_for(17, 1), Some(32));
        assert_eq!(CpuSlab::class_size_for(16, 64), Some(64));
        assert_eq!(CpuSlab::class_size_for(1000, 4096), Some(4096));
        assert_eq!(CpuSlab::class_size_for(512 * 1024, 1), Some(512 * 1024));
        assert_eq!(CpuSlab::class_size_for(512 * 1024 + 1, 1), None);
        assert_eq!(CpuSlab::class_size_for(8, 1 << 20), None);
    }

    #[test]
    fn released_blocks_are_reused() {
        let slab = CpuSlab::new();
        let a = slab.allocate(100, 8).unwrap();
        let first = addr(&a);
        slab.release(a).unwrap();
        let b = slab.allocate(120, 16).unwrap(); // same 128-byte class
        assert_eq!(addr(&b), first);
        assert_eq!(slab.stats().system_allocations, 1);
        slab.release(b).unwrap();
    }

    #[test]
    fn a_full_slab_carves_a_new_one() {
        let mut slab = CpuSlab::new();
        let per_slab = CpuSlab::SLAB_BYTES / 4096;
        let blocks: Vec<_> = (0..=per_slab)
            .map(|_| slab.allocate_mut(4096, 64).unwrap())
            .collect();
        let s = slab.stats();
        assert_eq!(
            (s.system_allocations, s.capacity_bytes),
            (2, 2 * CpuSlab::SLAB_BYTES)
        );
        assert_eq!(s.used_bytes, (per_slab + 1) * 4096);
        assert_disjoint(&blocks);
        release_all(&slab, blocks);
        assert_eq!(slab.stats().used_bytes, 0);
        assert_eq!(
            slab.stats().capacity_bytes,
            2 * CpuSlab::SLAB_BYTES,
            "slabs are cached"
        );
    }

    #[test]
    fn huge_alignment_bypasses_the_slabs() {
        let slab = CpuSlab::new();
        let a = slab.allocate(16, 1 << 20).unwrap();
        assert_eq!(addr(&a) % (1 << 20), 0);
        let s = slab.stats();
        assert_eq!(
            (s.system_allocations, s.capacity_bytes, s.used_bytes),
            (1, 16, 16)
        );
        slab.release(a).unwrap();
        assert_eq!(slab.stats().capacity_bytes, 0);
    }
}

mod workspace {
    use super::*;

    fn workspaces() -> Vec<Workspace> {
        MemoryPoolKind::CPU
            .iter()
            .map(|&k| Workspace::with_kind(k, 1 << 16).unwrap())
            .collect()
    }

    #[test]
    fn slices_have_the_requested_contents() {
        for mut ws in workspaces() {
            for _step in 0..3 {
                let z = ws.alloc_zeroed::<f32>(1000).unwrap();
                let f = ws.alloc_filled::<f32>(1000, 2.5).unwrap();
                let c = ws.alloc_copy(&[1u16, 2, 3]).unwrap();
                let u = ws.alloc_uninit::<u64>(10).unwrap();
                for (i, slot) in u.iter_mut().enumerate() {
                    slot.write(i as u64);
                }
                assert!(z.iter().all(|&x| x == 0.0), "{}", ws.pool_name());
                assert!(f.iter().all(|&x| x == 2.5));
                assert_eq!(c, &[1, 2, 3]);
                // All slices are live and independent at once.
                z.fill(7.0);
                assert!(f.iter().all(|&x| x == 2.5));
                for p in [
                    z.as_ptr() as usize,
                    f.as_ptr() as usize,
                    c.as_ptr() as usize,
                ] {
                    assert_eq!(p % WORKSPACE_ALIGN, 0);
                }
                ws.reset();
            }
        }
    }

    #[test]
    fn reset_reclaims_everything() {
        for mut ws in workspaces() {
            let first = ws.alloc_zeroed::<f32>(256).unwrap().as_ptr();
            let _ = ws.alloc_zeroed::<u8>(3000).unwrap();
            assert_eq!(ws.stats().live_allocations, 2);
            ws.reset();
            let s = ws.stats();
            assert_eq!(
                (s.live_allocations, s.used_bytes),
                (0, 0),
                "{}",
                ws.pool_name()
            );
            let again = ws.alloc_zeroed::<f32>(256).unwrap().as_ptr();
            if ws.pool_name() != "system" {
                assert_eq!(again, first, "{} reuses memory", ws.pool_name());
            }
        }
    }

    #[test]
    fn scope_reclaims_its_own_slices() {
        for mut ws in workspaces() {
            let mut inner_ptrs = Vec::new();
            for _layer in 0..3 {
                let live_before = ws.stats().live_allocations;
                let sum = ws.scope(|ws| {
                    let x = ws.alloc_filled::<f32>(500, 1.0).unwrap();
                    inner_ptrs.push(x.as_ptr() as usize);
                    x.iter().sum::<f32>()
                });
                assert_eq!(sum, 500.0);
                assert_eq!(
                    ws.stats().live_allocations,
                    live_before,
                    "{}",
                    ws.pool_name()
                );
                let _ = ws.alloc_zeroed::<f32>(10).unwrap(); // outside any scope
            }
            if ws.pool_name() == "arena" {
                // Each scope starts where the previous persistent slice ended.
                assert!(inner_ptrs.windows(2).all(|w| w[1] > w[0]));
            }
            ws.reset();
        }
    }

    #[test]
    fn empty_and_zero_sized_requests() {
        for ws in workspaces() {
            let before = ws.stats().total_allocations;
            assert!(ws.alloc_zeroed::<f32>(0).unwrap().is_empty());
            assert_eq!(ws.alloc_filled(10, ()).unwrap().len(), 10);
            assert_eq!(ws.stats().total_allocations, before);
        }
    }

    #[test]
    fn oversized_requests_are_errors() {
        for ws in workspaces() {
            let err = ws.alloc_zeroed::<f32>(usize::MAX / 2).unwrap_err();
            assert_eq!(err.kind, ErrorKind::OutOfMemory);
            assert!(err.message.contains("workspace"), "{err}");
            if !cfg!(miri) {
                let err = ws.alloc_uninit::<f32>(1 << 58).unwrap_err();
                assert_eq!(
                    err.kind,
                    ErrorKind::OutOfMemory,
                    "{}: {err}",
                    ws.pool_name()
                );
            }
            // Still usable.
            assert_eq!(ws.alloc_filled(4, 1i32).unwrap(), &[1, 1, 1, 1]);
        }
    }
}

mod kinds {
    use super::*;

    #[test]
    fn parse_and_display() {
        for kind in MemoryPoolKind::ALL {
            assert_eq!(kind.to_string().parse::<MemoryPoolKind>().unwrap(), kind);
        }
        assert_eq!(
            " Arena ".parse::<MemoryPoolKind>().unwrap(),
            MemoryPoolKind::Arena
        );
        assert_eq!(
            "CUDA_STREAM".parse::<MemoryPoolKind>().unwrap(),
            MemoryPoolKind::CudaStream
        );
        let names: Vec<&str> = MemoryPoolKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(
            names,
            ["arena", "slab", "system", "cuda-stream", "cuda-buddy"]
        );
        let err = "bump".parse::<MemoryPoolKind>().unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidArgument);
        assert!(
            err.message.contains("\"bump\"") && err.message.contains("cuda-buddy"),
            "{err}"
        );
    }

    #[test]
    fn device_defaults_and_mismatches() {
        assert_eq!(MemoryPoolKind::default(), MemoryPoolKind::Arena);
        assert_eq!(MemoryPoolKind::default_for(false), MemoryPoolKind::Arena);
        assert_eq!(
            MemoryPoolKind::default_for(true),
            MemoryPoolKind::CudaStream
        );
        for k in MemoryPoolKind::CPU {
            assert!(!k.is_gpu());
            k.check_device(false, "cpu").unwrap();
            let e = k.check_device(true, "cuda:0").unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidArgument);
            assert!(
                e.message.contains(k.as_str()) && e.message.contains("cuda:0"),
                "{e}"
            );
        }
        for k in MemoryPoolKind::GPU {
            assert!(k.is_gpu());
            k.check_device(true, "cuda:0").unwrap();
            let e = k.check_device(false, "cpu").unwrap_err();
            assert!(
                e.message.contains(k.as_str()) && e.message.contains("cpu"),
                "{e}"
            );
            // Not a host pool.
            let e = create_pool(k, 4096).err().unwrap();
            assert_eq!(e.kind, ErrorKind::InvalidArgument);
            assert!(Workspace::with_kind(k, 4096).is_err());
        }
    }

    #[test]
    fn create_pool_makes_each_kind() {
        let names: HashSet<&str> = MemoryPoolKind::CPU
            .iter()
            .map(|&k| {
                let pool = create_pool(k, 4096).unwrap();
                assert_eq!(pool.name(), k.as_str());
                pool.name()
            })
            .collect();
        assert_eq!(names.len(), 3);
        assert_eq!(
            create_pool(MemoryPoolKind::Arena, 4096)
                .unwrap()
                .stats()
                .capacity_bytes,
            4096
        );
        if !cfg!(miri) {
            let err = create_pool(MemoryPoolKind::Arena, 1 << 60).err().unwrap();
            assert_eq!(err.kind, ErrorKind::OutOfMemory);
        }
    }
}
