//! Overlapped steps (`SessionParams::overlap_steps`): a greedy decode step
//! launched before the previous step's ids reach the host gives the same
//! events as stepping one forward at a time, through EOS, stop ids, length
//! limits, min_tokens, sampled neighbours, arrivals and cancels. The CPU
//! computes each launch at once, so these tests run the engine's chaining
//! on the CPU; tests/cuda.rs runs it on a GPU.

mod engine_common;

use engine_common::*;
use nanoinfer::engine::{FinishReason, RequestId, RequestParams, Session, SessionParams};
use nanoinfer::sampling::SamplingParams;
use std::collections::HashMap;

const EOS: u32 = 3;

fn params(overlap: bool) -> SessionParams {
    SessionParams {
        kv_capacity_tokens: 2048,
        max_seqs: 6,
        max_batched_tokens: 64,
        overlap_steps: Some(overlap),
        ..Default::default()
    }
}

/// Greedy requests that end every way a chained row can be cut short, and
/// a sampled one that keeps its steps from chaining while it runs.
fn workload(vocab: usize) -> Vec<RequestParams> {
    let prompts = random_prompts(41, 8, 3, 40, vocab);
    prompts
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| {
            let mut r = request(prompt, [5, 40, 17, 1, 60, 33, 2, 25][i]);
            match i {
                1 => r.sampling.ignore_eos = true,
                2 => r.sampling.stop_token_ids = vec![7, 11, 19],
                4 => r.sampling.min_tokens = 12,
                5 => {
                    r.sampling = SamplingParams {
                        temperature: 0.8,
                        top_p: 0.9,
                        seed: Some(5),
                        max_tokens: 9,
                        ..Default::default()
                    }
                }
                _ => {}
            }
            r
        })
        .collect()
}

#[test]
fn overlapped_steps_give_the_events_of_plain_steps() {
    let m = tiny_model(&TinySpec {
        eos: Some(EOS),
        vocab: 24,
        ..Default::default()
    });
    let reqs = workload(24);
    let mut plain = Session::new(m.model.clone(), params(false)).unwrap();
    let expected = run_all(&mut plain, &reqs);
    assert_eq!(plain.stats().chained_steps, 0);
    let mut overlapped = Session::new(m.model.clone(), params(true)).unwrap();
    let got = run_all(&mut overlapped, &reqs);
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(
            (&g.tokens, &g.finish),
            (&e.tokens, &e.finish),
            "request {i}"
        );
    }
    let ends: Vec<_> = expected.iter().map(|o| o.finish.clone().unwrap()).collect();
    assert!(ends.contains(&FinishReason::Eos), "{ends:?}");
    assert!(ends.contains(&FinishReason::Length), "{ends:?}");
    let s = overlapped.stats();
    assert!(
        s.chained_steps > 20,
        "few steps chained ({} of {})",
        s.chained_steps,
        s.steps
    );
    // Rows computed for requests that had ended are dropped, not counted.
    assert_eq!(s.decode_tokens, plain.stats().decode_tokens);
}

/// Requests arriving and cancelled while a chained step is in flight: the
/// cancelled one ends once (Cancelled), the others give their outputs run
/// alone, and no KV is left held.
#[test]
fn arrivals_and_cancels_while_a_step_is_in_flight() {
    let m = tiny_model(&TinySpec {
        vocab: 32,
        ..Default::default()
    });
    let prompts = random_prompts(9, 6, 4, 30, 32);
    let reqs: Vec<RequestParams> = prompts.into_iter().map(|p| request(p, 30)).collect();
    let mut s = Session::new(m.model.clone(), params(true)).unwrap();
    let mut log = EventLog::default();
    let mut ids: HashMap<usize, RequestId> = HashMap::new();
    let add =
        |s: &mut Session, log: &mut EventLog, ids: &mut HashMap<usize, RequestId>, i: usize| {
            let id = s.add_request(reqs[i].clone()).unwrap();
            log.expect(id);
            ids.insert(i, id);
        };
    for i in 0..3 {
        add(&mut s, &mut log, &mut ids, i);
    }
    let mut cancelled = None;
    let mut step = 0;
    while s.has_work() {
        let chained = s.stats().chained_steps;
        log.record(s.step().unwrap());
        s.check_invariants().unwrap();
        step += 1;
        let in_flight = s.stats().chained_steps > chained;
        match step {
            // A chained step of all three is in flight: cancel one of them.
            6 => {
                assert!(in_flight, "step 6 left no chained step in flight");
                s.cancel(ids[&1]).unwrap();
                cancelled = Some(ids[&1]);
            }
            // Arrivals end the chain; later ones join mid-decode.
            9 | 14 => {
                assert!(in_flight, "step {step} left no chained step in flight");
                add(&mut s, &mut log, &mut ids, if step == 9 { 3 } else { 4 });
            }
            20 => {
                add(&mut s, &mut log, &mut ids, 5);
                s.cancel(ids[&5]).unwrap();
            }
            _ => {}
        }
        assert!(step < 500, "session still busy: {:?}", s.stats());
    }
    assert!(log.all_finished());
    assert_idle_clean(&s);
    let cancelled = cancelled.unwrap();
    assert_eq!(log.get(cancelled).finish, Some(FinishReason::Cancelled));
    assert_eq!(log.get(ids[&5]).finish, Some(FinishReason::Cancelled));
    for (i, r) in reqs.iter().enumerate() {
        let id = ids[&i];
        if id == cancelled || i == 5 {
            continue;
        }
        let alone = run_alone(&m.model, r);
        let got = log.get(id);
        assert_eq!(
            (&got.tokens, &got.finish),
            (&alone.tokens, &alone.finish),
            "request {i}"
        );
    }
}
