//! Proves with a counting global allocator that a workspace-backed step
//! makes zero heap allocations once warm (arena and slab), and that the
//! counter does see allocations (system pool).

use nanoinfer::memory::counting_alloc::{self, CountingAlloc};
use nanoinfer::memory::{MemoryPoolKind, Workspace};
use nanoinfer::Result;

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc::new();

/// A toy two-layer MLP block with per-layer scratch, shaped like a decode step.
struct Block {
    dim: usize,
    hidden: usize,
    layers: usize,
    up: Vec<f32>,   // [hidden, dim]
    down: Vec<f32>, // [dim, hidden]
}

impl Block {
    fn new(dim: usize, hidden: usize, layers: usize) -> Self {
        let weight = |i: usize| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5;
        Block {
            dim,
            hidden,
            layers,
            up: (0..hidden * dim).map(weight).collect(),
            down: (0..dim * hidden).map(|i| weight(i + 17)).collect(),
        }
    }

    fn matvec(w: &[f32], x: &[f32], out: &mut [f32]) {
        for (row, o) in w.chunks_exact(x.len()).zip(out.iter_mut()) {
            *o = row.iter().zip(x).map(|(a, b)| a * b).sum();
        }
    }

    /// One step: `state` is updated in place; all scratch comes from `ws`.
    fn step(&self, ws: &mut Workspace, state: &mut [f32]) -> Result<()> {
        for _ in 0..self.layers {
            ws.scope(|ws| -> Result<()> {
                let normed = ws.alloc_copy(state)?;
                let rms =
                    (normed.iter().map(|x| x * x).sum::<f32>() / self.dim as f32 + 1e-6).sqrt();
                normed.iter_mut().for_each(|x| *x /= rms);
                let h = ws.alloc_zeroed::<f32>(self.hidden)?;
                Self::matvec(&self.up, normed, h);
                h.iter_mut().for_each(|x| *x = *x / (1.0 + (-*x).exp()));
                let y = ws.alloc_filled::<f32>(self.dim, 0.0)?;
                Self::matvec(&self.down, h, y);
                for (s, d) in state.iter_mut().zip(y.iter()) {
                    *s += 0.1 * d;
                }
                Ok(())
            })?;
        }
        let logits = ws.alloc_uninit::<f32>(self.dim)?;
        let mut max = f32::MIN;
        for (l, s) in logits.iter_mut().zip(state.iter()) {
            max = max.max(*l.write(*s));
        }
        state.iter_mut().for_each(|s| *s -= max * 1e-3);
        ws.reset();
        Ok(())
    }
}

fn run(
    kind: MemoryPoolKind,
    initial_capacity: usize,
    warmup: usize,
    steps: usize,
) -> (Vec<f32>, counting_alloc::AllocCounts) {
    let block = Block::new(64, 256, 4);
    let mut ws = Workspace::with_kind(kind, initial_capacity).unwrap();
    let mut state: Vec<f32> = (0..block.dim).map(|i| i as f32 / 64.0).collect();
    for _ in 0..warmup {
        block.step(&mut ws, &mut state).unwrap();
    }
    let ((), counts) = counting_alloc::measure(|| {
        for _ in 0..steps {
            block.step(&mut ws, &mut state).unwrap();
        }
    });
    (state, counts)
}

#[test]
fn counting_allocator_is_installed() {
    assert!(counting_alloc::is_installed());
    let (v, counts) = counting_alloc::measure(|| vec![0u8; 100]);
    assert_eq!((counts.allocations, counts.bytes), (1, 100));
    drop(v);
}

#[test]
fn arena_steps_make_no_heap_allocations_once_warm() {
    // A 1 KiB arena is too small: the first step grows it (chained chunks),
    // its reset merges them, and from then on nothing is allocated.
    let (_, counts) = run(MemoryPoolKind::Arena, 1024, 2, 50);
    assert_eq!(counts.calls(), 0, "{counts:?}");
}

#[test]
fn slab_steps_make_no_heap_allocations_once_warm() {
    let (_, counts) = run(MemoryPoolKind::Slab, 0, 2, 50);
    assert_eq!(counts.calls(), 0, "{counts:?}");
}

#[test]
fn system_pool_steps_do_allocate() {
    // 4 layers x 3 slices + 1 per step: 13 allocations and frees per step.
    let (_, counts) = run(MemoryPoolKind::System, 0, 2, 50);
    assert_eq!(
        (counts.allocations, counts.deallocations),
        (50 * 13, 50 * 13),
        "{counts:?}"
    );
}

#[test]
fn every_pool_computes_the_same_steps() {
    let results: Vec<Vec<f32>> = MemoryPoolKind::CPU
        .iter()
        .map(|&k| run(k, 4096, 2, 10).0)
        .collect();
    assert!(results[0].iter().all(|x| x.is_finite()));
    assert_eq!(results[0], results[1]);
    assert_eq!(results[0], results[2]);
}
