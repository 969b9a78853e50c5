//! Fault injection (`Session::inject_faults`): the step workspace's memory
//! pool failing mid-forward, the KV cache reporting exhaustion, and the
//! forward pass returning an error, each at every step of a reference run.
//! After each fault: every accepted request ends with exactly one terminal
//! event; the requests the fault hit end with an error naming it; all the
//! others produce exactly what they produce alone; at idle nothing leaks
//! (free + evictable == total); and the session keeps serving.

mod engine_common;
mod ffi_common;

use engine_common::*;
use nanoinfer::engine::{
    FaultPlan, FinishReason, Model, PreemptionMode, RequestParams, Session, SessionParams,
};
use nanoinfer::kv::KvBackendKind;
use nanoinfer::memory::MemoryPoolKind;
use std::sync::Arc;

/// Five requests of assorted lengths; with `max_seqs` 3 and small chunks
/// some wait while others prefill or decode, so a fault at any step meets
/// requests in every state.
fn workload() -> Vec<RequestParams> {
    random_prompts(11, 5, 3, 40, 128)
        .into_iter()
        .enumerate()
        .map(|(i, p)| request(p, 4 + 3 * i as u32))
        .collect()
}

fn params(kv: KvBackendKind, pool: MemoryPoolKind, preemption: PreemptionMode) -> SessionParams {
    SessionParams {
        kv_backend: kv,
        block_size: 4,
        kv_capacity_tokens: 256,
        max_batched_tokens: 24,
        max_seqs: 3,
        prefill_chunk_size: 8,
        memory_pool: Some(pool),
        preemption,
        ..Default::default()
    }
}

/// Runs the workload under `plan`; checks the event contract and idle
/// cleanliness (`drain`), then that the session still serves requests
/// exactly as they run alone. Returns the outcomes in workload order.
fn run_with_faults(
    model: &Arc<Model>,
    sp: &SessionParams,
    plan: FaultPlan,
    reference: &[Outcome],
) -> (Vec<Outcome>, nanoinfer::engine::FaultCounts) {
    let mut s = Session::new(model.clone(), sp.clone()).unwrap();
    s.inject_faults(plan.clone());
    let outcomes = run_all(&mut s, &workload());
    spend_plan(&mut s, &plan);
    let counts = s.injected_faults();
    let again = workload();
    let after = run_all(&mut s, &again[..3]);
    for (i, o) in after.iter().enumerate() {
        assert_eq!(
            o.finish,
            Some(FinishReason::Length),
            "{plan:?}: request after the faults"
        );
        assert_eq!(
            o.tokens, reference[i].tokens,
            "{plan:?}: request after the faults differs from running alone"
        );
    }
    assert_eq!(
        s.injected_faults(),
        counts,
        "a spent plan raised more faults"
    );
    (outcomes, counts)
}

/// Idle steps until every step `plan` names is past, so that later
/// requests meet no fault.
fn spend_plan(s: &mut Session, plan: &FaultPlan) {
    let last = plan.last_step();
    while s.stats().steps <= last {
        assert!(s.step().unwrap().is_empty(), "events from an idle session");
    }
}

/// Every request either finished normally with its solo output, or ended
/// with an error containing `needle`; returns the number of errors.
fn check_outcomes(what: &str, outcomes: &[Outcome], reference: &[Outcome], needle: &str) -> usize {
    let mut errors = 0;
    for (i, (o, r)) in outcomes.iter().zip(reference).enumerate() {
        match o.finish.as_ref().expect("terminal event") {
            FinishReason::Length => assert_eq!(
                o.tokens, r.tokens,
                "{what}: request {i} finished but differs from running alone"
            ),
            FinishReason::Error(msg) => {
                assert!(
                    msg.contains(needle),
                    "{what}: request {i}: error `{msg}` lacks `{needle}`"
                );
                // What it streamed before the fault is a prefix of its solo output.
                assert!(
                    r.tokens.starts_with(&o.tokens),
                    "{what}: request {i} streamed tokens it would not produce alone"
                );
                errors += 1;
            }
            other => panic!("{what}: request {i} ended with {other:?}"),
        }
    }
    errors
}

fn reference(model: &Arc<Model>) -> (Vec<Outcome>, usize) {
    let reference: Vec<Outcome> = workload().iter().map(|r| run_alone(model, r)).collect();
    // Steps of a fault-free run with the test's settings.
    let sp = params(
        KvBackendKind::Paged,
        MemoryPoolKind::Arena,
        PreemptionMode::Recompute,
    );
    let mut s = Session::new(model.clone(), sp).unwrap();
    let clean = run_all(&mut s, &workload());
    for (o, r) in clean.iter().zip(&reference) {
        assert_eq!(
            o.tokens, r.tokens,
            "fault-free batched run differs from alone"
        );
    }
    (reference, s.stats().steps as usize)
}

/// Errors that fail a forward pass (injected directly, or from the pool):
/// at every step, the requests planned in that step end with that error in
/// that same step; the rest are unaffected.
fn forward_failure_at_every_step(pool_fault: bool) {
    let m = default_tiny();
    let (reference, steps) = reference(&m);
    assert!(steps >= 10, "the workload is too short: {steps} steps");
    let pools = [
        MemoryPoolKind::Arena,
        MemoryPoolKind::Slab,
        MemoryPoolKind::System,
    ];
    for step in 0..steps as u64 {
        let kv = if step % 2 == 0 {
            KvBackendKind::Paged
        } else {
            KvBackendKind::Token
        };
        let pool = pools[step as usize % pools.len()];
        let sp = params(kv, pool, PreemptionMode::Recompute);
        let (plan, needle) = if pool_fault {
            let plan = FaultPlan {
                pool_failure_steps: vec![step],
                ..Default::default()
            };
            (plan, "cannot allocate")
        } else {
            let plan = FaultPlan {
                forward_error_steps: vec![step],
                ..Default::default()
            };
            (plan, "injected fault")
        };
        let what = format!("{plan:?} on {kv:?}/{pool:?}");
        let (outcomes, counts) = run_with_faults(&m, &sp, plan, &reference);
        let raised = counts.pool_failures + counts.forward_errors;
        assert_eq!(raised, 1, "{what}: {counts:?}");
        let errors = check_outcomes(&what, &outcomes, &reference, needle);
        assert!(errors >= 1, "{what}: the failed forward pass hit nobody");
        // All of them in one step, the one the fault fired in.
        let failed_steps: std::collections::HashSet<_> = outcomes
            .iter()
            .filter(|o| matches!(o.finish, Some(FinishReason::Error(_))))
            .map(|o| o.finish_step)
            .collect();
        assert_eq!(failed_steps.len(), 1, "{what}: errors in several steps");
        assert!(
            failed_steps.iter().all(|&s| s >= Some(step as usize)),
            "{what}: an error before the fault's step"
        );
    }
}

#[test]
fn a_forward_error_at_any_step_fails_that_steps_batch_only() {
    forward_failure_at_every_step(false);
}

#[test]
fn a_pool_allocation_failure_at_any_step_fails_that_steps_batch_only() {
    forward_failure_at_every_step(true);
}

/// KV exhaustion for one step (and for a window of three) at every step,
/// with both preemption modes: running requests are preempted (and resumed
/// with unchanged output); an idle session that cannot place its head
/// request fails that one request rather than spin.
#[test]
fn kv_exhaustion_at_any_step_preempts_or_fails_the_head_only() {
    let m = default_tiny();
    let (reference, steps) = reference(&m);
    let mut preempted_runs = 0;
    for window in [1u64, 3] {
        for step in 0..steps as u64 {
            let kv = if (step + window) % 2 == 0 {
                KvBackendKind::Paged
            } else {
                KvBackendKind::Token
            };
            let preemption = if step % 3 == 0 {
                PreemptionMode::Swap
            } else {
                PreemptionMode::Recompute
            };
            let sp = params(kv, MemoryPoolKind::Arena, preemption);
            let plan = FaultPlan {
                kv_exhausted_steps: (step..step + window).collect(),
                ..Default::default()
            };
            let what = format!("{plan:?} on {kv:?}/{preemption:?}");
            let mut s = Session::new(m.model.clone(), sp.clone()).unwrap();
            s.inject_faults(plan.clone());
            let outcomes = run_all(&mut s, &workload());
            let counts = s.injected_faults();
            assert!(counts.kv_exhaustions >= 1, "{what}: {counts:?}");
            let errors = check_outcomes(&what, &outcomes, &reference, "could not place it");
            // At most one head failure per exhausted step.
            assert!(errors as u64 <= window, "{what}: {errors} errors");
            preempted_runs += (s.stats().preemptions > 0) as usize;
            drop(s);
            // And the full check that the session keeps serving.
            run_with_faults(&m, &sp, plan, &reference);
        }
    }
    assert!(
        preempted_runs > steps,
        "exhaustion rarely met running requests ({preempted_runs} runs preempted)"
    );
}

/// Several faults of every kind in one run, with cancellations in between.
#[test]
fn mixed_faults_and_cancellations_keep_the_contract() {
    let m = default_tiny();
    let (reference, _) = reference(&m);
    for seed in 0..12u64 {
        let mut rng = TestRng::new(500 + seed);
        let kv = if seed % 2 == 0 {
            KvBackendKind::Paged
        } else {
            KvBackendKind::Token
        };
        let preemption = if seed % 3 == 0 {
            PreemptionMode::Swap
        } else {
            PreemptionMode::Recompute
        };
        let mut sp = params(kv, MemoryPoolKind::Slab, preemption);
        sp.kv_capacity_tokens = rng.range(80, 200);
        let mut pick = |n: usize| -> Vec<u64> { (0..n).map(|_| rng.range(0, 40) as u64).collect() };
        let plan = FaultPlan {
            pool_failure_steps: pick(2),
            kv_exhausted_steps: pick(4),
            forward_error_steps: pick(2),
            swap_out_failure_steps: pick(3),
            swap_in_failure_steps: pick(3),
        };
        let what = format!("seed {seed}: {plan:?}");
        let mut s = Session::new(m.model.clone(), sp).unwrap();
        s.inject_faults(plan.clone());
        let mut log = EventLog::default();
        let mut ids = vec![];
        let mut cancelled = vec![];
        for round in 0..60 {
            if round % 4 == 0 {
                let reqs = workload();
                let r = &reqs[rng.range(0, reqs.len())];
                let id = s.add_request(r.clone()).unwrap();
                log.expect(id);
                ids.push(id);
            }
            if rng.chance(0.1) {
                let id = ids[rng.range(0, ids.len())];
                let active = s.is_active(id);
                assert_eq!(s.cancel(id).is_ok(), active, "{what}");
                if active {
                    cancelled.push(id);
                }
            }
            log.record(s.step().unwrap());
            s.check_invariants()
                .unwrap_or_else(|e| panic!("{what}: step {}: {e}", log.steps));
        }
        drain(&mut s, &mut log, 10_000);
        spend_plan(&mut s, &plan);
        for id in &ids {
            match log.get(*id).finish.as_ref().unwrap() {
                FinishReason::Cancelled => assert!(cancelled.contains(id), "{what}"),
                FinishReason::Length | FinishReason::Error(_) => {}
                other => panic!("{what}: request {id} ended with {other:?}"),
            }
        }
        let after = run_all(&mut s, &workload()[..2]);
        for (o, r) in after.iter().zip(&reference) {
            assert_eq!(o.tokens, r.tokens, "{what}: output after the faults");
        }
    }
}

/// Through the C ABI: a failed forward pass and a pool failure become
/// `NI_FINISH_ERROR` events with the message; `ni_session_step` itself
/// succeeds, nothing aborts, and the session serves the next requests.
#[test]
fn faults_through_the_c_abi_end_requests_with_error_events() {
    use ffi_common::{add_tokens, ok, run_to_completion, stats};
    use nanoinfer::ffi::*;
    let dir = TempDir::new("faults-c");
    write_tiny_llama(dir.path(), &TinySpec::default());
    let path = std::ffi::CString::new(dir.path().to_str().unwrap()).unwrap();
    let mut model = std::ptr::null_mut();
    // SAFETY: valid pointers; NULL params = defaults.
    ok(unsafe { ni_model_load(path.as_ptr(), std::ptr::null(), &mut model) });
    let mut p = ffi_common::session_params();
    p.kv_capacity_tokens = 256;
    p.max_seqs = 2;
    let mut session = std::ptr::null_mut();
    // SAFETY: valid pointers.
    ok(unsafe { ni_session_create(model, &p, &mut session) });
    let prompts = random_prompts(3, 4, 4, 20, 128);
    let plan = FaultPlan {
        forward_error_steps: vec![1],
        pool_failure_steps: vec![4],
        kv_exhausted_steps: vec![6],
        ..Default::default()
    };
    // SAFETY: a live session handle.
    unsafe { debug_inject_faults(session, plan) }.unwrap();
    let ids: Vec<u64> = prompts.iter().map(|p| add_tokens(session, p, 6)).collect();
    let results = run_to_completion(session);
    let mut errors = 0;
    for id in &ids {
        let c = &results[id];
        match c.finish {
            NI_FINISH_LENGTH => assert_eq!(c.tokens.len(), 6),
            NI_FINISH_ERROR => {
                let msg = c.error.as_deref().expect("an error event has a message");
                assert!(
                    msg.contains("injected fault") || msg.contains("cannot allocate"),
                    "{msg}"
                );
                errors += 1;
            }
            other => panic!("request {id} ended with {other}"),
        }
    }
    assert!(errors >= 2, "both forward faults should hit requests");
    let st = stats(session);
    assert_eq!((st.running, st.waiting, st.kv_used_tokens), (0, 0, 0));
    assert_eq!(
        st.kv_free_tokens + st.kv_cached_tokens,
        st.kv_capacity_tokens
    );
    // Still serving.
    let id = add_tokens(session, &prompts[0], 6);
    let again = run_to_completion(session);
    assert_eq!(again[&id].finish, NI_FINISH_LENGTH);
    assert_eq!(again[&id].tokens.len(), 6);
    // SAFETY: created above, freed once; NULL is refused, not dereferenced.
    unsafe {
        assert!(debug_inject_faults(std::ptr::null_mut(), FaultPlan::default()).is_err());
        ni_session_free(session);
        ni_model_free(model);
    }
}

/// Seven requests for the swap tests: five random ones, and two that share
/// a 24-token prefix with the first (so a swapped request can come back
/// with part of its KV supplied by the prefix cache).
fn swap_workload() -> Vec<RequestParams> {
    let mut reqs = workload();
    let prefix = reqs[0].prompt[..24.min(reqs[0].prompt.len())].to_vec();
    for (i, tail) in random_prompts(12, 2, 4, 12, 128).into_iter().enumerate() {
        let mut prompt = prefix.clone();
        prompt.extend(tail);
        reqs.push(request(prompt, 10 + 3 * i as u32));
    }
    reqs
}

/// A KV cache just large enough for the largest request, with swap
/// preemption: most steps preempt, swap out or swap in.
fn swap_params(kv: KvBackendKind, reqs: &[RequestParams]) -> SessionParams {
    let need = reqs
        .iter()
        .map(|r| r.prompt.len() + r.sampling.max_tokens as usize)
        .max()
        .unwrap();
    SessionParams {
        kv_capacity_tokens: need + 8,
        ..params(kv, MemoryPoolKind::Arena, PreemptionMode::Swap)
    }
}

/// Runs `reqs` under `plan` (event contract and idle checks in `run_all`);
/// every request must finish with its solo output and no swapped KV may be
/// left in host memory. The session then serves again, still under the
/// plan, with the same results.
fn run_swap_plan(
    m: &Arc<Model>,
    sp: &SessionParams,
    plan: FaultPlan,
    reqs: &[RequestParams],
    reference: &[Outcome],
) -> (
    nanoinfer::engine::FaultCounts,
    nanoinfer::engine::SessionStats,
) {
    let what = format!(
        "{:?}, prefix caching {}: {plan:?}",
        sp.kv_backend, sp.prefix_caching
    );
    let mut s = Session::new(m.clone(), sp.clone()).unwrap();
    s.inject_faults(plan);
    for round in 0..2 {
        let outcomes = run_all(&mut s, reqs);
        for (i, (o, r)) in outcomes.iter().zip(reference).enumerate() {
            assert_eq!(
                o.finish,
                Some(FinishReason::Length),
                "{what}: round {round}: request {i}"
            );
            assert_eq!(
                o.tokens, r.tokens,
                "{what}: round {round}: request {i} differs from running alone"
            );
        }
        assert_eq!(
            s.swapped_host_tokens(),
            0,
            "{what}: swapped KV left in host memory at idle"
        );
    }
    (s.injected_faults(), s.stats())
}

/// A swap-out or swap-in that fails (the copy breaking off midway, the
/// slots of a failed swap-in left holding NaN) at any step, or at every
/// step: the request's KV is recomputed instead, so every request still
/// ends with exactly one terminal event and its solo output; nothing leaks
/// (KV at idle, host swap space) and the session keeps serving.
#[test]
fn swap_failures_at_any_step_fall_back_to_recompute() {
    let m = default_tiny();
    let reqs = swap_workload();
    let reference: Vec<Outcome> = reqs.iter().map(|r| run_alone(&m.model, r)).collect();
    let (paged, token) = (KvBackendKind::Paged, KvBackendKind::Token);
    for (kv, prefix_caching) in [(paged, true), (token, true), (paged, false), (token, false)] {
        let sp = SessionParams {
            prefix_caching,
            ..swap_params(kv, &reqs)
        };
        let (_, clean) = run_swap_plan(&m.model, &sp, FaultPlan::default(), &reqs, &reference);
        assert!(
            clean.swapped_out_tokens > 0 && clean.swapped_in_tokens > 0,
            "{kv:?}: the workload does not swap: {clean:?}"
        );
        let steps = clean.steps / 2;
        let every: Vec<u64> = (0..4 * clean.steps).collect();
        let mut plans = vec![];
        for step in 0..steps {
            plans.push(FaultPlan {
                swap_out_failure_steps: vec![step],
                ..Default::default()
            });
            plans.push(FaultPlan {
                swap_in_failure_steps: vec![step],
                ..Default::default()
            });
        }
        plans.push(FaultPlan {
            swap_out_failure_steps: every.clone(),
            ..Default::default()
        });
        plans.push(FaultPlan {
            swap_in_failure_steps: every.clone(),
            ..Default::default()
        });
        plans.push(FaultPlan {
            swap_out_failure_steps: every.clone(),
            swap_in_failure_steps: every.clone(),
            ..Default::default()
        });
        let (mut out_hit, mut in_hit) = (0, 0);
        for plan in plans {
            let all_out = plan.swap_out_failure_steps.len() > 1;
            let all_in = plan.swap_in_failure_steps.len() > 1;
            let (counts, st) = run_swap_plan(&m.model, &sp, plan.clone(), &reqs, &reference);
            out_hit += (counts.swap_out_failures > 0) as usize;
            in_hit += (counts.swap_in_failures > 0) as usize;
            // Every swap-out failed: nothing was ever swapped in.
            if all_out {
                assert!(counts.swap_out_failures > 0, "{kv:?} {plan:?}");
                assert_eq!(st.swapped_out_tokens, 0, "{kv:?} {plan:?}");
                assert_eq!(st.swapped_in_tokens, 0, "{kv:?} {plan:?}");
            }
            if all_in && !all_out {
                assert!(counts.swap_in_failures > 0, "{kv:?} {plan:?}");
                assert_eq!(st.swapped_in_tokens, 0, "{kv:?} {plan:?}");
            }
        }
        eprintln!(
            "{kv:?}, prefix caching {prefix_caching}: {steps} steps, {} tokens swapped out, {} in; \
             swap-out faults hit {out_hit} runs, swap-in faults {in_hit}",
            clean.swapped_out_tokens, clean.swapped_in_tokens
        );
        assert!(
            out_hit >= 3 && in_hit >= 3,
            "{kv:?}: swaps rarely met the faults"
        );
    }
}
