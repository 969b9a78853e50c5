//! Continuous batching must not change results: greedy outputs of requests
//! run concurrently equal each request run alone, whatever the KV backend,
//! block size, prefix caching and prefill chunk size.

mod engine_common;

use engine_common::*;
use nanoinfer::engine::{FinishReason, Model, ModelParams, RequestParams, Session, SessionParams};
use nanoinfer::kv::KvBackendKind;
use nanoinfer::model::WeightDType;
use std::sync::Arc;

/// Requests of varied prompt lengths and output lengths; a few share
/// prefixes (and two are identical) so prefix caching has something to reuse.
fn mixed_requests(vocab: usize) -> Vec<RequestParams> {
    let mut rng = TestRng::new(11);
    let mut reqs = Vec::new();
    for (i, len) in [1usize, 3, 9, 17, 40, 70, 95].into_iter().enumerate() {
        reqs.push(request(rng.tokens(len, vocab), 4 + 5 * i as u32));
    }
    let base = rng.tokens(50, vocab);
    for extra in [0usize, 1, 13, 30] {
        let mut p = base.clone();
        p.extend(rng.tokens(extra, vocab));
        reqs.push(request(p, 12));
    }
    reqs.push(request(base.clone(), 12));
    reqs
}

#[test]
fn tiny_model_outputs_depend_on_the_prompt() {
    // Guards the other tests: a degenerate model (same token forever) would
    // make "batched == alone" vacuous.
    let m = default_tiny();
    let outs: Vec<Vec<u32>> = mixed_requests(128)
        .iter()
        .take(7)
        .map(|r| run_alone(&m, r).tokens)
        .collect();
    let distinct: std::collections::HashSet<_> = outs.iter().collect();
    assert!(
        distinct.len() >= 6,
        "outputs barely differ across prompts: {outs:?}"
    );
    let varied = outs
        .iter()
        .filter(|o| o.iter().collect::<std::collections::HashSet<_>>().len() > 2)
        .count();
    assert!(varied >= 4, "outputs are mostly constant: {outs:?}");
}

#[test]
fn batched_equals_alone_for_every_backend_chunk_and_cache_setting() {
    let m = default_tiny();
    let reqs = mixed_requests(128);
    let expected: Vec<Vec<u32>> = reqs.iter().map(|r| run_alone(&m, r).tokens).collect();
    for (i, e) in expected.iter().enumerate() {
        assert_eq!(
            e.len(),
            reqs[i].sampling.max_tokens as usize,
            "max_tokens is reached exactly"
        );
    }
    let backends = [
        (KvBackendKind::Paged, 1),
        (KvBackendKind::Paged, 4),
        (KvBackendKind::Paged, 16),
        (KvBackendKind::Token, 1),
    ];
    for (kind, block) in backends {
        for prefix in [false, true] {
            for chunk in [1usize, 7, 64, 1000] {
                let cfg = format!("{kind:?} block {block} prefix {prefix} chunk {chunk}");
                let mut params = session_params(kind, block, 2048, chunk, prefix);
                params.max_batched_tokens = 96;
                let mut s = Session::new(m.model.clone(), params).unwrap();
                // Twice through one session: the second round finds the
                // first round's prefixes cached (when caching is on).
                for round in 0..2 {
                    let outs = run_all(&mut s, &reqs);
                    for (i, o) in outs.iter().enumerate() {
                        assert_eq!(
                            o.tokens, expected[i],
                            "{cfg} round {round}: request {i} differs from running alone"
                        );
                        assert_eq!(o.finish, Some(FinishReason::Length), "{cfg}: request {i}");
                    }
                }
                let st = s.stats();
                assert_eq!(st.preemptions, 0, "{cfg}: roomy cache should not preempt");
                if prefix {
                    assert!(
                        st.prefix_cached_tokens > 0,
                        "{cfg}: shared prefixes were not reused: {st:?}"
                    );
                } else {
                    assert_eq!(st.prefix_cached_tokens, 0, "{cfg}");
                }
            }
        }
    }
}

#[test]
fn requests_joining_mid_flight_match_running_alone() {
    // Arrivals staggered over steps: requests join while others decode and
    // prefill, so every step mixes prefill chunks and decode rows.
    let m = default_tiny();
    let mut rng = TestRng::new(5);
    let reqs: Vec<RequestParams> = (0..24)
        .map(|i| {
            let len = rng.range(1, 60);
            request(rng.tokens(len, 128), 3 + (i % 9) as u32 * 3)
        })
        .collect();
    let expected: Vec<Vec<u32>> = reqs.iter().map(|r| run_alone(&m, r).tokens).collect();
    for kind in [KvBackendKind::Paged, KvBackendKind::Token] {
        let mut params = session_params(kind, 8, 2048, 7, true);
        params.max_seqs = 6;
        params.max_batched_tokens = 20;
        let mut s = Session::new(m.model.clone(), params).unwrap();
        let mut log = EventLog::default();
        let mut ids = Vec::new();
        let mut next = 0;
        while next < reqs.len() || s.has_work() {
            for _ in 0..rng.range(0, 3) {
                if next < reqs.len() {
                    let id = s.add_request(reqs[next].clone()).unwrap();
                    log.expect(id);
                    ids.push(id);
                    next += 1;
                }
            }
            log.record(s.step().unwrap());
            s.check_invariants().unwrap();
            assert!(s.stats().running <= 6);
        }
        assert_idle_clean(&s);
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(log.get(*id).tokens, expected[i], "{kind:?}: request {i}");
        }
    }
}

#[test]
fn max_tokens_is_reached_exactly_and_eos_stops_early() {
    let spec = TinySpec::default();
    let m = tiny_model(&spec);
    let mut rng = TestRng::new(3);
    let prompt = rng.tokens(10, 128);
    for max in [1u32, 2, 5, 17] {
        let o = run_alone(&m, &request(prompt.clone(), max));
        assert_eq!(o.tokens.len(), max as usize);
        assert_eq!(o.finish, Some(FinishReason::Length));
    }
    // Same weights, but the 4th generated token declared as EOS: generation
    // stops right there, reason Eos, with the EOS token reported.
    let free_run = run_alone(&m, &request(prompt.clone(), 17)).tokens;
    let eos = free_run[3];
    let first = free_run.iter().position(|&t| t == eos).unwrap();
    let m_eos = tiny_model(&TinySpec {
        eos: Some(eos),
        ..spec
    });
    let o = run_alone(&m_eos, &request(prompt.clone(), 17));
    assert_eq!(o.tokens, free_run[..=first]);
    assert_eq!(o.finish, Some(FinishReason::Eos));
    // ignore_eos runs to max_tokens.
    let mut r = request(prompt, 17);
    r.sampling.ignore_eos = true;
    assert_eq!(run_alone(&m_eos, &r).tokens, free_run);
}

/// The transformers-made tiny models (Llama3 rope scaling, Qwen2 biases,
/// Qwen3 q/k norms, tied embeddings) batch like the random one.
#[test]
fn committed_tiny_models_batched_equal_alone() {
    for name in ["tiny-llama3", "tiny-qwen2", "tiny-qwen3"] {
        let m = committed_tiny(name);
        let vocab = m.config().vocab_size;
        let mut rng = TestRng::new(8);
        let base = rng.tokens(40, vocab);
        let reqs: Vec<RequestParams> = (0..8)
            .map(|i| {
                let mut p = if i % 2 == 0 { base.clone() } else { vec![] };
                let extra = rng.range(1, 50);
                p.extend(rng.tokens(extra, vocab));
                let mut r = request(p, 12);
                r.sampling.ignore_eos = true;
                r
            })
            .collect();
        let expected: Vec<Vec<u32>> = reqs.iter().map(|r| run_alone(&m, r).tokens).collect();
        for kind in [KvBackendKind::Paged, KvBackendKind::Token] {
            let mut s = Session::new(m.clone(), session_params(kind, 4, 400, 7, true)).unwrap();
            for round in 0..2 {
                let outs = run_all(&mut s, &reqs);
                for (i, o) in outs.iter().enumerate() {
                    assert_eq!(
                        o.tokens, expected[i],
                        "{name} {kind:?} round {round}: request {i}"
                    );
                }
            }
            assert!(s.stats().prefix_cached_tokens > 0);
        }
    }
}

/// The real model with its tokenizer: batched text equals each prompt alone.
#[test]
fn smollm2_batched_equals_alone_with_text() {
    let dir = smollm2_dir();
    let params = ModelParams {
        dtype: WeightDType::F32,
        threads: 2,
    };
    let model = Arc::new(Model::load(&dir, &params, None).unwrap());
    let tok = model.tokenizer().unwrap();
    let prompts = [
        "The capital of France is",
        "Once upon a time, in a small village by the sea,",
        "def fibonacci(n):",
        "The three primary colors are",
    ];
    let reqs: Vec<RequestParams> = prompts
        .iter()
        .map(|p| {
            let mut r = request(tok.encode(p, true).unwrap(), 16);
            r.sampling.ignore_eos = true;
            r
        })
        .collect();
    let alone: Vec<Outcome> = reqs.iter().map(|r| run_alone(&model, r)).collect();
    for kind in [KvBackendKind::Paged, KvBackendKind::Token] {
        let sp = SessionParams {
            kv_backend: kind,
            kv_capacity_tokens: 1024,
            prefill_chunk_size: 5,
            ..Default::default()
        };
        let mut s = Session::new(model.clone(), sp).unwrap();
        let batched = run_all(&mut s, &reqs);
        for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
            assert_eq!(a.tokens.len(), 16);
            assert_eq!(a.tokens, b.tokens, "{kind:?}: prompt {i} tokens");
            assert_eq!(a.text, b.text, "{kind:?}: prompt {i} text");
            assert_eq!(
                a.text,
                tok.decode(&a.tokens, true).unwrap(),
                "streamed text equals decoding the ids"
            );
            assert!(!a.text.trim().is_empty());
        }
    }
}
