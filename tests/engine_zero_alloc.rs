//! Once warm, a decode step of the serving engine makes zero heap
//! allocations: `Session::step_into` with several concurrent greedy
//! requests on the CPU, counted process-wide (the kernels' worker threads
//! included) by a counting global allocator.
//!
//! "Warm" means the session has already served requests of the same shape:
//! the backend's per-thread kernel scratch has grown to the longest context,
//! the KV manager's tables and the event buffers exist. A first batch of
//! requests runs to completion; a second batch of different prompts is then
//! prefilled, and every decode step after that is counted.

mod engine_common;

use engine_common::*;
use nanoinfer::engine::{Event, Model, ModelParams, RequestParams, Session, SessionParams};
use nanoinfer::memory::counting_alloc::{self, AllocCounts, CountingAlloc};
use nanoinfer::memory::MemoryPoolKind;
use nanoinfer::model::WeightDType;
use std::path::Path;
use std::sync::Arc;

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc::new();

const REQUESTS: usize = 4;
const MAX_TOKENS: u32 = 48;
const MEASURED_STEPS: usize = 30;

fn load(dir: &Path, dtype: WeightDType) -> Model {
    let params = ModelParams {
        dtype,
        threads: 2,
        ..Default::default()
    };
    Model::load(dir, &params, None).expect("model loads")
}

fn params(pool: MemoryPoolKind) -> SessionParams {
    SessionParams {
        kv_capacity_tokens: 2048,
        block_size: 16,
        max_seqs: 8,
        max_batched_tokens: 256,
        memory_pool: Some(pool),
        ..Default::default()
    }
}

fn batch(seed: u64, vocab: usize) -> Vec<RequestParams> {
    let mut rng = TestRng::new(seed);
    (0..REQUESTS)
        .map(|i| {
            let mut r = request(rng.tokens(12 + 3 * i, vocab), MAX_TOKENS);
            r.sampling.ignore_eos = true;
            r
        })
        .collect()
}

/// Runs a batch to completion (the warm-up), then a second batch through
/// its prefill, and returns the allocator calls of the next
/// `MEASURED_STEPS` decode steps.
fn decode_counts(model: &Arc<Model>, pool: MemoryPoolKind) -> AllocCounts {
    let vocab = model.config().vocab_size;
    let mut session = Session::new(model.clone(), params(pool)).expect("session");
    let mut events: Vec<Event> = Vec::new();
    for req in batch(1, vocab) {
        session.add_request(req).unwrap();
    }
    let mut finished = 0;
    for _ in 0..1000 {
        session.step_into(&mut events).unwrap();
        finished += events.iter().filter(|e| e.finish.is_some()).count();
        if !session.has_work() {
            break;
        }
    }
    assert_eq!(finished, REQUESTS, "the warm-up batch finishes");

    for req in batch(2, vocab) {
        session.add_request(req).unwrap();
    }
    // Prefill: until every request reports its first token in one step.
    for _ in 0..100 {
        session.step_into(&mut events).unwrap();
        if events.len() == REQUESTS && events.iter().all(|e| e.tokens.len() == 1) {
            break;
        }
    }
    assert_eq!(session.stats().running, REQUESTS);

    let before = counting_alloc::global_counts();
    let mut decoded = 0;
    for _ in 0..MEASURED_STEPS {
        session.step_into(&mut events).unwrap();
        for e in &events {
            assert_eq!(e.tokens.len(), 1, "one token per request per step");
            assert!(e.finish.is_none());
        }
        decoded += events.len();
    }
    let after = counting_alloc::global_counts();
    assert_eq!(decoded, REQUESTS * MEASURED_STEPS);
    let st = session.stats();
    let ws = st.workspace.expect("CPU context has a workspace");
    assert_eq!(ws.pool, pool);
    AllocCounts {
        allocations: after.allocations - before.allocations,
        deallocations: after.deallocations - before.deallocations,
        reallocations: after.reallocations - before.reallocations,
        bytes: after.bytes - before.bytes,
    }
}

fn check_pools(model: &Arc<Model>, what: &str) {
    assert!(counting_alloc::is_installed());
    // The planned arena and the slab (every decode buffer of these models
    // fits its size classes) touch no allocator.
    for pool in [MemoryPoolKind::Arena, MemoryPoolKind::Slab] {
        let counts = decode_counts(model, pool);
        assert_eq!(
            counts.calls(),
            0,
            "{what}, {pool} pool: {MEASURED_STEPS} warm decode steps of {REQUESTS} requests \
             called the allocator: {counts:?}"
        );
    }
    // The baseline: every temporary is an allocation, so the counter sees them.
    let counts = decode_counts(model, MemoryPoolKind::System);
    assert!(
        counts.allocations >= (MEASURED_STEPS * 10) as u64,
        "{what}, system pool: expected allocations, counted {counts:?}"
    );
}

/// One test for both models: the counts are process-wide, and a second test
/// of this binary finishing (its thread exiting, the harness reporting it)
/// would allocate inside the other's measured window.
#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "debug builds check invariants every step (allocating)"
)]
fn warm_decode_steps_do_not_allocate() {
    let dir = TempDir::new("zero-alloc");
    write_tiny_llama(dir.path(), &TinySpec::default());
    let tiny = Arc::new(load(dir.path(), WeightDType::F32));
    check_pools(&tiny, "tiny model");
    drop(tiny);

    // SmolLM2 has a tokenizer: detokenizing allocates (tokenizer module),
    // so this session runs on token ids only, as a C host can.
    let smollm2 = Arc::new(Model {
        tokenizer: None,
        ..load(&smollm2_dir(), WeightDType::F32)
    });
    let counts = decode_counts(&smollm2, MemoryPoolKind::Arena);
    assert_eq!(
        counts.calls(),
        0,
        "SmolLM2, arena pool: {MEASURED_STEPS} warm decode steps of {REQUESTS} requests \
         called the allocator: {counts:?}"
    );
}
