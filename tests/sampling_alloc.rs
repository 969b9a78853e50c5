//! Once warm, `Sampler::sample` must not touch the heap (when no logprobs are
//! requested). Counted with a per-thread counting allocator, so the other
//! tests running in parallel do not interfere.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use nanoinfer::sampling::{Rng, Sampler, SamplingParams};

struct Counting;

thread_local! {
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards every call to `System` unchanged; only counts allocations.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> usize {
    ALLOCS.with(Cell::get)
}

fn check(params: SamplingParams) {
    const VOCAB: usize = 49_152;
    let mut rng = Rng::seed_from_u64(1);
    let base: Vec<f32> = (0..VOCAB).map(|_| rng.next_f32() * 8.0 - 4.0).collect();
    let mut row = base.clone();
    let prompt: Vec<u32> = (0..200).map(|i| (i * 37) % VOCAB as u32).collect();
    // Output capacity reserved up front: growing it is the caller's allocation.
    let mut output: Vec<u32> = Vec::with_capacity(64);
    let suppress = [0u32, 2];
    let mut sampler = Sampler::new(&params, 5);

    for _ in 0..2 {
        row.copy_from_slice(&base);
        let t = sampler
            .sample(&mut row, &prompt, &output, &suppress)
            .unwrap();
        output.push(t.token);
    }
    let before = allocations();
    for _ in 0..50 {
        row.copy_from_slice(&base);
        let t = sampler
            .sample(&mut row, &prompt, &output, &suppress)
            .unwrap();
        output.push(t.token);
    }
    let n = allocations() - before;
    assert_eq!(n, 0, "{n} allocations in 50 warm calls with {params:?}");
}

#[test]
fn greedy_with_penalties_does_not_allocate() {
    check(SamplingParams {
        repetition_penalty: 1.3,
        presence_penalty: 0.5,
        frequency_penalty: 0.5,
        logit_bias: vec![(5, 1.0)],
        ..SamplingParams::default()
    });
}

#[test]
fn full_chain_does_not_allocate() {
    for (top_k, top_p, min_p) in [
        (0, 1.0, 0.0),
        (40, 0.9, 0.05),
        (0, 0.95, 0.0),
        (0, 1.0, 0.1),
    ] {
        check(SamplingParams {
            temperature: 0.8,
            top_k,
            top_p,
            min_p,
            repetition_penalty: 1.1,
            frequency_penalty: 0.2,
            ..SamplingParams::default()
        });
    }
}
