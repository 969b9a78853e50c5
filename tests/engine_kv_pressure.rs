//! KV memory pressure: preemption (recompute and swap), prefix reuse,
//! head-of-line admission and refusal of requests that can never fit.

mod engine_common;

use engine_common::*;
use nanoinfer::engine::{FinishReason, PreemptionMode, RequestParams, Session};
use nanoinfer::kv::KvBackendKind;

fn pressure_requests(n: usize, seed: u64) -> Vec<RequestParams> {
    let mut rng = TestRng::new(seed);
    (0..n)
        .map(|_| {
            let len = rng.range(4, 40);
            let max = rng.range(8, 40) as u32;
            request(rng.tokens(len, 128), max)
        })
        .collect()
}

#[test]
fn tiny_cache_preempts_and_every_request_finishes_unchanged() {
    let m = default_tiny();
    let reqs = pressure_requests(36, 21);
    let expected: Vec<Vec<u32>> = reqs.iter().map(|r| run_alone(&m, r).tokens).collect();
    for kind in [KvBackendKind::Paged, KvBackendKind::Token] {
        for mode in [PreemptionMode::Recompute, PreemptionMode::Swap] {
            for prefix in [false, true] {
                let cfg = format!("{kind:?} {mode:?} prefix {prefix}");
                let mut params = session_params(kind, 4, 160, 16, prefix);
                params.preemption = mode;
                params.max_batched_tokens = 64;
                let mut s = Session::new(m.model.clone(), params).unwrap();
                let outs = run_all(&mut s, &reqs);
                for (i, o) in outs.iter().enumerate() {
                    assert_eq!(o.finish, Some(FinishReason::Length), "{cfg}: request {i}");
                    assert_eq!(
                        o.tokens, expected[i],
                        "{cfg}: request {i} changed under preemption"
                    );
                }
                let st = s.stats();
                assert!(
                    st.preemptions > 0,
                    "{cfg}: the tiny cache never preempted: {st:?}"
                );
                if mode == PreemptionMode::Swap {
                    assert!(
                        st.swapped_out_tokens > 0 && st.swapped_in_tokens > 0,
                        "{cfg}: {st:?}"
                    );
                } else {
                    assert_eq!(st.swapped_out_tokens, 0, "{cfg}");
                }
                assert_idle_clean(&s);
            }
        }
    }
}

#[test]
fn preemption_under_priority_policy_keeps_outputs() {
    let m = default_tiny();
    let mut reqs = pressure_requests(40, 8);
    for (i, r) in reqs.iter_mut().enumerate() {
        r.priority = (i % 4) as i32;
    }
    let expected: Vec<Vec<u32>> = reqs.iter().map(|r| run_alone(&m, r).tokens).collect();
    for mode in [PreemptionMode::Recompute, PreemptionMode::Swap] {
        let mut params = session_params(KvBackendKind::Paged, 8, 128, 8, true);
        params.preemption = mode;
        params.policy = nanoinfer::engine::SchedulePolicyKind::Priority;
        params.aging_steps = 4;
        let mut s = Session::new(m.model.clone(), params).unwrap();
        let outs = run_all(&mut s, &reqs);
        for (i, o) in outs.iter().enumerate() {
            assert_eq!(o.tokens, expected[i], "{mode:?}: request {i}");
        }
        assert!(s.stats().preemptions > 0);
    }
}

/// A 200-token shared prefix followed by `suffix_len` tokens that start
/// differently from any other suffix built with another `tag`.
fn prefixed(prefix: &[u32], tag: u32, suffix_len: usize, rng: &mut TestRng) -> Vec<u32> {
    let mut p = prefix.to_vec();
    p.push(100 + tag);
    p.extend(rng.tokens(suffix_len - 1, 100));
    p
}

#[test]
fn second_request_with_shared_prefix_computes_only_its_suffix() {
    let m = default_tiny();
    let mut rng = TestRng::new(99);
    let prefix = rng.tokens(200, 100);
    let first = request(prefixed(&prefix, 1, 20, &mut rng), 10);
    let second = request(prefixed(&prefix, 2, 30, &mut rng), 10);
    let expected = run_alone(&m, &second).tokens;
    for (kind, block) in [
        (KvBackendKind::Paged, 16),
        (KvBackendKind::Paged, 1),
        (KvBackendKind::Paged, 7),
        (KvBackendKind::Token, 1),
    ] {
        let cfg = format!("{kind:?} block {block}");
        for prefix_caching in [true, false] {
            let mut s = Session::new(
                m.model.clone(),
                session_params(kind, block, 1024, 64, prefix_caching),
            )
            .unwrap();
            run_all(&mut s, std::slice::from_ref(&first));
            let before = s.stats();
            let out = run_all(&mut s, std::slice::from_ref(&second)).remove(0);
            let after = s.stats();
            assert_eq!(
                out.tokens, expected,
                "{cfg} caching {prefix_caching}: output differs from caching off"
            );
            let computed = after.prefill_tokens - before.prefill_tokens;
            let cached = after.prefix_cached_tokens - before.prefix_cached_tokens;
            assert_eq!(
                computed + cached,
                230,
                "{cfg}: every prompt token is either computed or cached"
            );
            if prefix_caching {
                // Whole blocks of the 200 shared tokens are reused.
                assert_eq!(cached as usize, 200 / block * block, "{cfg}: cached tokens");
                assert_eq!(after.prefix_hits - before.prefix_hits, 1);
            } else {
                assert_eq!(cached, 0, "{cfg}");
                assert_eq!(computed, 230, "{cfg}");
            }
        }
    }
}

#[test]
fn cache_salt_isolates_prefixes() {
    let m = default_tiny();
    let mut rng = TestRng::new(4);
    let prompt = rng.tokens(64, 128);
    for kind in [KvBackendKind::Paged, KvBackendKind::Token] {
        let mut s = Session::new(m.model.clone(), session_params(kind, 8, 512, 512, true)).unwrap();
        let mut a = request(prompt.clone(), 4);
        a.cache_salt = 1;
        run_all(&mut s, std::slice::from_ref(&a));
        let mut b = a.clone();
        b.cache_salt = 2;
        let out_b = run_all(&mut s, std::slice::from_ref(&b)).remove(0);
        assert_eq!(
            s.stats().prefix_cached_tokens,
            0,
            "{kind:?}: another tenant's prefix was reused"
        );
        let out_a = run_all(&mut s, std::slice::from_ref(&a)).remove(0);
        assert!(
            s.stats().prefix_cached_tokens >= 56,
            "{kind:?}: same salt should reuse"
        );
        assert_eq!(out_a.tokens, out_b.tokens);
    }
}

#[test]
fn swap_resumes_behind_a_longer_cached_prefix() {
    // Several requests share one long prompt and prefill it in small chunks
    // while the cache is too small for all of them: later ones are swapped
    // out mid-prefill and, when resumed, find more of the prompt cached by
    // the earlier ones than they had saved themselves.
    let m = default_tiny();
    let mut rng = TestRng::new(17);
    let shared = rng.tokens(90, 128);
    let reqs: Vec<RequestParams> = (0..6)
        .map(|i| {
            let mut p = shared.clone();
            p.extend(rng.tokens(i, 128));
            request(p, 20)
        })
        .collect();
    let expected: Vec<Vec<u32>> = reqs.iter().map(|r| run_alone(&m, r).tokens).collect();
    for kind in [KvBackendKind::Paged, KvBackendKind::Token] {
        let mut params = session_params(kind, 4, 140, 8, true);
        params.preemption = PreemptionMode::Swap;
        params.max_batched_tokens = 24;
        let mut s = Session::new(m.model.clone(), params).unwrap();
        let outs = run_all(&mut s, &reqs);
        for (i, o) in outs.iter().enumerate() {
            assert_eq!(o.tokens, expected[i], "{kind:?}: request {i}");
        }
        let st = s.stats();
        assert!(
            st.preemptions > 0 && st.prefix_cached_tokens > 0,
            "{kind:?}: {st:?}"
        );
        // Swapped KV that the prefix cache already supplied is not written back.
        assert!(st.swapped_in_tokens <= st.swapped_out_tokens, "{st:?}");
    }
}

#[test]
fn head_of_line_request_that_does_not_fit_blocks_later_ones() {
    let m = default_tiny();
    let mut rng = TestRng::new(2);
    let a = request(rng.tokens(50, 128), 40);
    let b = request(rng.tokens(60, 128), 10);
    let c = request(rng.tokens(5, 128), 5);
    for kind in [KvBackendKind::Paged, KvBackendKind::Token] {
        let mut s =
            Session::new(m.model.clone(), session_params(kind, 4, 100, 512, false)).unwrap();
        let mut log = EventLog::default();
        let ids: Vec<_> = [&a, &b, &c]
            .iter()
            .map(|r| {
                let id = s.add_request((*r).clone()).unwrap();
                log.expect(id);
                id
            })
            .collect();
        drain(&mut s, &mut log, 10_000);
        let (oa, ob, oc) = (log.get(ids[0]), log.get(ids[1]), log.get(ids[2]));
        // B could not start while A held the cache, and C did not jump the queue.
        assert!(
            ob.first_token_step > oa.finish_step.map(|s| s - 1),
            "{kind:?}: B ran beside A"
        );
        assert!(
            oc.first_token_step >= ob.first_token_step,
            "{kind:?}: C overtook B"
        );
        assert_eq!(s.stats().preemptions, 0);
        for (o, r) in [(oa, &a), (ob, &b), (oc, &c)] {
            assert_eq!(o.tokens, run_alone(&m, r).tokens);
        }
    }
}

#[test]
fn requests_that_can_never_fit_are_refused_at_admission() {
    let m = tiny_model(&TinySpec {
        max_positions: 300,
        ..Default::default()
    });
    for kind in [KvBackendKind::Paged, KvBackendKind::Token] {
        let mut s =
            Session::new(m.model.clone(), session_params(kind, 16, 100, 512, true)).unwrap();
        let e = s.add_request(request(vec![1; 90], 11)).unwrap_err();
        assert!(e.message.contains("KV capacity of 100 tokens"), "{e}");
        // Exactly at capacity is fine.
        let id = s.add_request(request(vec![1; 90], 10)).unwrap();
        let e = s.add_request(request(vec![1; 250], 51)).unwrap_err();
        assert!(e.message.contains("context length 300"), "{e}");
        let e = s.add_request(request(vec![], 5)).unwrap_err();
        assert!(e.message.contains("prompt is empty"), "{e}");
        let e = s.add_request(request(vec![128], 5)).unwrap_err();
        assert!(e.message.contains("outside the vocabulary"), "{e}");
        let e = s.add_request(request(vec![1], 0)).unwrap_err();
        assert!(e.message.contains("max_tokens"), "{e}");
        // Refusals queue nothing; the accepted request runs to its end.
        assert_eq!(s.stats().waiting, 1);
        let mut log = EventLog::default();
        log.expect(id);
        drain(&mut s, &mut log, 1000);
        assert_eq!(log.get(id).tokens.len(), 10);
    }
}

#[test]
fn requests_arriving_together_compute_a_shared_prefix_once() {
    let m = default_tiny();
    let mut rng = TestRng::new(31);
    let prefix = rng.tokens(100, 100);
    let reqs: Vec<RequestParams> = (0..8)
        .map(|i| request(prefixed(&prefix, i, 10, &mut rng), 5))
        .collect();
    let expected: Vec<Vec<u32>> = reqs.iter().map(|r| run_alone(&m, r).tokens).collect();
    for (kind, block) in [
        (KvBackendKind::Paged, 4),
        (KvBackendKind::Paged, 16),
        (KvBackendKind::Token, 1),
    ] {
        let mut s =
            Session::new(m.model.clone(), session_params(kind, block, 2048, 64, true)).unwrap();
        let outs = run_all(&mut s, &reqs);
        for (i, o) in outs.iter().enumerate() {
            assert_eq!(o.tokens, expected[i], "{kind:?}: request {i}");
        }
        let st = s.stats();
        let shared = (100 / block * block) as u64;
        // The first request computes the prefix (in two chunks of 64); the
        // other seven wait for it and then reuse it.
        assert_eq!(
            st.prefix_cached_tokens,
            7 * shared,
            "{kind:?} block {block}: {st:?}"
        );
        assert_eq!(
            st.prefill_tokens,
            8 * 110 - 7 * shared,
            "{kind:?} block {block}"
        );
    }
}
