//! Randomized soak: thousands of add / step / cancel operations with random
//! lengths, priorities, shared prefixes and cancellations against a small
//! cache, under random session settings. After every operation the session's
//! invariants hold; every accepted request gets exactly one terminal event;
//! every request that ran to its end produced what it produces alone.

mod engine_common;

use engine_common::*;
use nanoinfer::engine::{
    FinishReason, PreemptionMode, RequestId, RequestParams, SchedulePolicyKind, Session,
    SessionParams,
};
use nanoinfer::kv::KvBackendKind;
use nanoinfer::sampling::SamplingParams;

fn random_params(rng: &mut TestRng, capacity: usize) -> SessionParams {
    SessionParams {
        kv_backend: if rng.chance(0.5) {
            KvBackendKind::Paged
        } else {
            KvBackendKind::Token
        },
        block_size: [1, 2, 4, 16][rng.range(0, 4)],
        kv_capacity_tokens: capacity,
        max_batched_tokens: rng.range(8, 128),
        max_seqs: rng.range(1, 12),
        prefill_chunk_size: [1, 3, 7, 16, 64][rng.range(0, 5)],
        policy: if rng.chance(0.5) {
            SchedulePolicyKind::Fcfs
        } else {
            SchedulePolicyKind::Priority
        },
        aging_steps: rng.range(1, 20) as u64,
        prefix_caching: rng.chance(0.6),
        preemption: if rng.chance(0.5) {
            PreemptionMode::Recompute
        } else {
            PreemptionMode::Swap
        },
        ..Default::default()
    }
}

fn random_request(rng: &mut TestRng, prefixes: &[Vec<u32>], capacity: usize) -> RequestParams {
    let mut prompt = if rng.chance(0.4) {
        prefixes[rng.range(0, prefixes.len())].clone()
    } else {
        vec![]
    };
    let extra = rng.range(if prompt.is_empty() { 1 } else { 0 }, 40);
    prompt.extend(rng.tokens(extra, 128));
    // Now and then a request too large for the cache, which must be refused.
    let max_tokens = if rng.chance(0.03) {
        capacity as u32
    } else {
        rng.range(1, 40) as u32
    };
    let sampling = if rng.chance(0.3) {
        SamplingParams {
            temperature: 0.8,
            top_k: 20,
            seed: Some(rng.next_u64()),
            max_tokens,
            ..Default::default()
        }
    } else {
        SamplingParams {
            max_tokens,
            ..Default::default()
        }
    };
    RequestParams {
        prompt,
        sampling,
        priority: rng.range(0, 4) as i32,
        cache_salt: rng.range(0, 2) as u64,
    }
}

fn soak(seed: u64, ops: usize) {
    let m = default_tiny();
    let mut rng = TestRng::new(seed);
    let capacity = rng.range(100, 260);
    let params = random_params(&mut rng, capacity);
    let cfg = format!("seed {seed}: {params:?}");
    let prefixes: Vec<Vec<u32>> = (0..3)
        .map(|_| {
            let len = rng.range(10, 50);
            rng.tokens(len, 128)
        })
        .collect();
    let mut s = Session::new(m.model.clone(), params).unwrap();
    let mut log = EventLog::default();
    let mut accepted: Vec<(RequestId, RequestParams)> = Vec::new();
    let mut cancelled = 0;
    for _ in 0..ops {
        let roll = rng.range(0, 100);
        if roll < 30 {
            let r = random_request(&mut rng, &prefixes, capacity);
            let fits = r.prompt.len() + r.sampling.max_tokens as usize <= capacity;
            match s.add_request(r.clone()) {
                Ok(id) => {
                    assert!(fits, "{cfg}: oversized request accepted");
                    log.expect(id);
                    accepted.push((id, r));
                }
                Err(e) => {
                    assert!(!fits, "{cfg}: fitting request refused: {e}");
                    assert!(e.message.contains("KV capacity"), "{e}");
                }
            }
        } else if roll < 40 && !accepted.is_empty() {
            let (id, _) = accepted[rng.range(0, accepted.len())];
            let active = s.is_active(id);
            let res = s.cancel(id);
            assert_eq!(res.is_ok(), active, "{cfg}: cancel of request {id}");
            cancelled += res.is_ok() as usize;
        } else {
            log.record(s.step().unwrap());
        }
        if let Err(e) = s.check_invariants() {
            panic!("{cfg}: invariant violated after {} steps: {e}", log.steps);
        }
    }
    drain(&mut s, &mut log, 100_000);

    let st = s.stats();
    let mut compared = 0;
    for (id, r) in &accepted {
        let o = log.get(*id);
        match o.finish.as_ref().unwrap() {
            FinishReason::Cancelled => {}
            FinishReason::Length => {
                assert_eq!(o.tokens.len(), r.sampling.max_tokens as usize);
                assert_eq!(
                    o.tokens,
                    run_alone(&m, r).tokens,
                    "{cfg}: request {id} differs from running alone"
                );
                compared += 1;
            }
            other => panic!("{cfg}: request {id} ended with {other:?}"),
        }
    }
    assert!(
        compared > accepted.len() / 3,
        "{cfg}: too few requests completed ({compared} of {})",
        accepted.len()
    );
    assert!(cancelled > 0, "{cfg}");
    eprintln!(
        "seed {seed}: {} requests, {compared} compared, {cancelled} cancelled, {} steps, {} preemptions, {} cached tokens",
        accepted.len(),
        log.steps,
        st.preemptions,
        st.prefix_cached_tokens
    );
}

#[test]
fn soak_random_sessions() {
    for seed in 0..8 {
        soak(1000 + seed, 2500);
    }
}
