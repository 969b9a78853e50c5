//! T1: allocator micro-benchmark. `cargo bench --bench alloc`
//!
//! Prints markdown tables of alloc+free cost (ns per allocation, median of
//! rounds) for each pool at 64 B … 64 MiB, with the speed-up over the
//! baseline (`std::alloc::alloc`/`dealloc` at 64-byte alignment, i.e.
//! glibc's `posix_memalign`/`free`). Two patterns:
//!
//! * batch: allocate N blocks, then free them all (arena: one `reset`);
//! * pair: allocate one block and free it at once (arena: `reset`).
//!
//! Pools are called on their concrete types (as the seed's C++ T1 does);
//! "via `dyn`" rows go through `Box<dyn MemoryPool>` to show the cost of
//! choosing the pool at run time. `&mut` rows use the unsynchronised `allocate_mut`/`release_mut` path (the
//! workspace's); "shared" rows use the thread-safe `&self` path.
//! Optional argument: milliseconds per cell (default 40).

use std::alloc::{alloc, dealloc, Layout};
use std::hint::black_box;
use std::time::{Duration, Instant};

use nanoinfer::memory::{Allocation, CpuArena, CpuSlab, MemoryPool, SystemPool, Workspace};

const ALIGN: usize = 64;
const SIZES: [(usize, &str); 5] = [
    (64, "64 B"),
    (1 << 10, "1 KiB"),
    (64 << 10, "64 KiB"),
    (1 << 20, "1 MiB"),
    (64 << 20, "64 MiB"),
];

/// Blocks per batch: up to 64 MiB per batch, between 4 and 4096 blocks.
fn batch_len(size: usize) -> usize {
    ((64 << 20) / size).clamp(4, 4096)
}

/// Largest batch in bytes (4 x 64 MiB), plus room for alignment.
const ARENA_BYTES: usize = (256 << 20) + (1 << 20);

struct Timer {
    budget: Duration,
}

impl Timer {
    /// Median ns per op over rounds; `round` returns (ops, time spent on them).
    fn run(&self, mut round: impl FnMut() -> (usize, Duration)) -> f64 {
        round(); // warm-up
        let mut samples = Vec::new();
        let start = Instant::now();
        while samples.len() < 7 || (start.elapsed() < self.budget && samples.len() < 100_000) {
            let (ops, spent) = round();
            samples.push(spent.as_nanos() as f64 / ops as f64);
        }
        samples.sort_by(f64::total_cmp);
        samples[samples.len() / 2]
    }
}

fn layout(size: usize) -> Layout {
    Layout::from_size_align(size, ALIGN).expect("valid layout")
}

// ---- batch pattern ----

fn batch_system(t: &Timer, size: usize) -> f64 {
    let n = batch_len(size);
    let mut ptrs = Vec::with_capacity(n);
    t.run(|| {
        let start = Instant::now();
        for _ in 0..n {
            // SAFETY: non-zero size.
            let p = unsafe { alloc(layout(size)) };
            assert!(!p.is_null(), "system allocation failed");
            ptrs.push(black_box(p));
        }
        for p in ptrs.drain(..) {
            // SAFETY: allocated above with the same layout.
            unsafe { dealloc(p, layout(size)) };
        }
        (n, start.elapsed())
    })
}

fn batch_pool<P: MemoryPool + ?Sized, const SHARED: bool>(
    t: &Timer,
    pool: &mut P,
    size: usize,
) -> f64 {
    let n = batch_len(size);
    let mut live: Vec<Allocation> = Vec::with_capacity(n);
    t.run(|| {
        let start = Instant::now();
        for _ in 0..n {
            let a = if SHARED {
                pool.allocate(size, ALIGN)
            } else {
                pool.allocate_mut(size, ALIGN)
            };
            live.push(a.expect("pool allocation failed"));
        }
        black_box(&mut live);
        for a in live.drain(..) {
            if SHARED {
                pool.release(a)
            } else {
                pool.release_mut(a)
            }
            .expect("release failed");
        }
        pool.reset();
        (n, start.elapsed())
    })
}

fn batch_slab_miss(t: &Timer, size: usize) -> f64 {
    let n = batch_len(size);
    let mut live: Vec<Allocation> = Vec::with_capacity(n);
    t.run(|| {
        let mut pool = CpuSlab::new(); // untimed
        let start = Instant::now();
        for _ in 0..n {
            live.push(
                pool.allocate_mut(size, ALIGN)
                    .expect("slab allocation failed"),
            );
        }
        black_box(&mut live);
        for a in live.drain(..) {
            pool.release_mut(a).expect("release failed");
        }
        let spent = start.elapsed();
        drop(pool); // untimed: returns the slabs
        (n, spent)
    })
}

fn batch_workspace(t: &Timer, ws: &mut Workspace, size: usize) -> f64 {
    let n = batch_len(size);
    t.run(|| {
        let start = Instant::now();
        for _ in 0..n {
            let s = ws
                .alloc_uninit::<u8>(size)
                .expect("workspace allocation failed");
            black_box(s.as_mut_ptr());
        }
        ws.reset();
        (n, start.elapsed())
    })
}

// ---- pair pattern ----

const PAIRS_PER_ROUND: usize = 256;

fn pairs(size: usize) -> usize {
    if size >= 1 << 20 {
        8
    } else {
        PAIRS_PER_ROUND
    }
}

fn pair_system(t: &Timer, size: usize) -> f64 {
    let n = pairs(size);
    t.run(|| {
        let start = Instant::now();
        for _ in 0..n {
            // SAFETY: non-zero size; freed right away with the same layout.
            unsafe {
                let p = black_box(alloc(layout(size)));
                assert!(!p.is_null(), "system allocation failed");
                dealloc(p, layout(size));
            }
        }
        (n, start.elapsed())
    })
}

fn pair_pool<P: MemoryPool + ?Sized, const SHARED: bool>(
    t: &Timer,
    pool: &mut P,
    size: usize,
) -> f64 {
    let n = pairs(size);
    let bulk = pool.bulk_reset();
    t.run(|| {
        let start = Instant::now();
        for _ in 0..n {
            if SHARED {
                let a = pool.allocate(size, ALIGN).expect("pool allocation failed");
                black_box(a.ptr());
                pool.release(a).expect("release failed");
            } else {
                let a = pool
                    .allocate_mut(size, ALIGN)
                    .expect("pool allocation failed");
                black_box(a.ptr());
                pool.release_mut(a).expect("release failed");
            }
            if bulk {
                pool.reset();
            }
        }
        (n, start.elapsed())
    })
}

// ---- report ----

struct Row {
    name: &'static str,
    ns: Vec<f64>,
}

fn print_table(title: &str, baseline: &[f64], rows: &[Row]) {
    println!("\n### {title}\n");
    print!("| allocator |");
    for (_, label) in SIZES {
        print!(" {label} |");
    }
    println!();
    print!("|---|");
    for _ in SIZES {
        print!("---:|");
    }
    println!();
    print!("| system (`std::alloc`, baseline) |");
    for ns in baseline {
        print!(" {} |", fmt_ns(*ns));
    }
    println!();
    for row in rows {
        print!("| {} |", row.name);
        for (ns, base) in row.ns.iter().zip(baseline) {
            print!(" {} ({:.1}x) |", fmt_ns(*ns), base / ns);
        }
        println!();
    }
}

fn fmt_ns(ns: f64) -> String {
    if ns >= 10_000.0 {
        format!("{:.1} µs", ns / 1000.0)
    } else if ns >= 100.0 {
        format!("{ns:.0} ns")
    } else {
        format!("{ns:.1} ns")
    }
}

fn min_ratio(baseline: &[f64], ns: &[f64]) -> f64 {
    ns.iter()
        .zip(baseline)
        .map(|(ns, b)| b / ns)
        .fold(f64::INFINITY, f64::min)
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".to_string())
}

fn main() {
    // `cargo bench` passes `--bench`; a number is the per-cell budget in ms.
    let ms = std::env::args()
        .skip(1)
        .find_map(|a| a.parse::<u64>().ok())
        .unwrap_or(40);
    let t = Timer {
        budget: Duration::from_millis(ms),
    };
    println!(
        "T1 allocator benchmark — {} — {} ms per cell, align {ALIGN}",
        cpu_model(),
        ms
    );

    let mut arena = CpuArena::new(ARENA_BYTES).expect("arena");
    let mut slab = CpuSlab::new();
    let mut system = SystemPool::new();
    let mut arena_dyn: Box<dyn MemoryPool> = Box::new(CpuArena::new(ARENA_BYTES).expect("arena"));
    let mut slab_dyn: Box<dyn MemoryPool> = Box::new(CpuSlab::new());
    let mut ws = Workspace::from(CpuArena::new(ARENA_BYTES).expect("arena"));

    let each =
        |f: &mut dyn FnMut(usize) -> f64| SIZES.iter().map(|&(s, _)| f(s)).collect::<Vec<_>>();

    let base = each(&mut |s| batch_system(&t, s));
    let batch = vec![
        Row {
            name: "arena (`&mut`)",
            ns: each(&mut |s| batch_pool::<_, false>(&t, &mut arena, s)),
        },
        Row {
            name: "arena (`&mut`, via `dyn`)",
            ns: each(&mut |s| batch_pool::<_, false>(&t, &mut *arena_dyn, s)),
        },
        Row {
            name: "arena (shared `&self`)",
            ns: each(&mut |s| batch_pool::<_, true>(&t, &mut arena, s)),
        },
        Row {
            name: "Workspace over arena",
            ns: each(&mut |s| batch_workspace(&t, &mut ws, s)),
        },
        Row {
            name: "slab hit (`&mut`)",
            ns: each(&mut |s| batch_pool::<_, false>(&t, &mut slab, s)),
        },
        Row {
            name: "slab hit (`&mut`, via `dyn`)",
            ns: each(&mut |s| batch_pool::<_, false>(&t, &mut *slab_dyn, s)),
        },
        Row {
            name: "slab hit (shared `&self`)",
            ns: each(&mut |s| batch_pool::<_, true>(&t, &mut slab, s)),
        },
        Row {
            name: "slab miss (fresh slabs, `&mut`)",
            ns: each(&mut |s| batch_slab_miss(&t, s)),
        },
        Row {
            name: "SystemPool (`&mut`)",
            ns: each(&mut |s| batch_pool::<_, false>(&t, &mut system, s)),
        },
    ];
    print_table(
        "Batch: N allocations, then N frees (ns per alloc+free)",
        &base,
        &batch,
    );
    println!(
        "\nN per batch: {}",
        SIZES
            .iter()
            .map(|&(s, l)| format!("{l}: {}", batch_len(s)))
            .collect::<Vec<_>>()
            .join(", ")
    );

    let pair_base = each(&mut |s| pair_system(&t, s));
    let pair = vec![
        Row {
            name: "arena (`&mut`, alloc + reset)",
            ns: each(&mut |s| pair_pool::<_, false>(&t, &mut arena, s)),
        },
        Row {
            name: "arena (`&mut`, via `dyn`)",
            ns: each(&mut |s| pair_pool::<_, false>(&t, &mut *arena_dyn, s)),
        },
        Row {
            name: "slab hit (`&mut`)",
            ns: each(&mut |s| pair_pool::<_, false>(&t, &mut slab, s)),
        },
        Row {
            name: "slab hit (shared `&self`)",
            ns: each(&mut |s| pair_pool::<_, true>(&t, &mut slab, s)),
        },
        Row {
            name: "SystemPool (`&mut`)",
            ns: each(&mut |s| pair_pool::<_, false>(&t, &mut system, s)),
        },
    ];
    print_table(
        "Pair: allocate one block and free it at once (ns per alloc+free)",
        &pair_base,
        &pair,
    );

    // The slab serves blocks up to 512 KiB; 1 MiB and 64 MiB go to the
    // system allocator by design, so its target covers the first three sizes.
    println!("\n### Targets (issue 6, T1): worst ratio vs system\n");
    let slab_sizes = 3;
    for (label, base, row, sizes, target) in [
        (
            "arena vs system, batch, all sizes",
            &base,
            &batch[0],
            SIZES.len(),
            20.0,
        ),
        (
            "arena vs system, pair, all sizes",
            &pair_base,
            &pair[0],
            SIZES.len(),
            20.0,
        ),
        (
            "slab hit vs system, batch, 64 B-64 KiB",
            &base,
            &batch[4],
            slab_sizes,
            3.0,
        ),
        (
            "slab hit vs system, pair, 64 B-64 KiB",
            &pair_base,
            &pair[2],
            slab_sizes,
            3.0,
        ),
    ] {
        let r = min_ratio(&base[..sizes], &row.ns[..sizes]);
        println!(
            "- {label}: {r:.1}x (target >= {target}x): {}",
            if r >= target { "met" } else { "NOT met" }
        );
    }
}
