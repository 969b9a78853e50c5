//! Sampling controls through the session: seeded reproducibility inside
//! batches, stop strings on real detokenized text, logprobs, validation.

mod common;

use common::*;
use nanoinfer::engine::{Event, FinishReason, Model, RequestParams, Session, SessionParams};
use nanoinfer::model::WeightDType;
use nanoinfer::sampling::SamplingParams;
use std::collections::HashMap;
use std::sync::Arc;

/// One request's tokens, text, finish reason and events.
type Outcome = (Vec<u32>, String, Option<FinishReason>, Vec<Event>);

fn run_all(model: &Arc<Model>, reqs: &[RequestParams]) -> Vec<Outcome> {
    let params = SessionParams {
        kv_capacity_tokens: 4096,
        ..Default::default()
    };
    let mut session = Session::new(model.clone(), params).unwrap();
    let ids: Vec<u64> = reqs
        .iter()
        .map(|r| session.add_request(r.clone()).unwrap())
        .collect();
    let mut out: HashMap<u64, Outcome> = HashMap::new();
    while session.has_work() {
        for ev in session.step().unwrap() {
            let e = out.entry(ev.request_id).or_default();
            assert!(e.2.is_none(), "event after the terminal event");
            e.0.extend(&ev.tokens);
            e.1.push_str(&ev.text);
            e.2.clone_from(&ev.finish);
            e.3.push(ev);
        }
    }
    session.check_invariants().unwrap();
    ids.iter()
        .map(|id| out.remove(id).expect("every request has events"))
        .collect()
}

fn sampled(prompt: Vec<u32>, seed: Option<u64>, max_tokens: u32) -> RequestParams {
    let sampling = SamplingParams {
        temperature: 1.0,
        top_p: 0.95,
        seed,
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    };
    RequestParams {
        prompt,
        sampling,
        ..Default::default()
    }
}

#[test]
fn same_seed_same_tokens_whatever_the_batch_and_different_seeds_differ() {
    let model = load_model(&repo_path("tests/data/tiny-llama3"), WeightDType::F32);
    let alone = run_all(&model, &[sampled(vec![1, 2, 3], Some(42), 24)]);
    let batch = run_all(
        &model,
        &[
            sampled(vec![9, 8, 7, 6, 5], None, 30),
            sampled(vec![1, 2, 3], Some(42), 24),
            sampled(vec![4; 20], Some(7), 10),
        ],
    );
    assert_eq!(
        alone[0].0, batch[1].0,
        "seeded request changed when batched"
    );
    let other_seed = run_all(&model, &[sampled(vec![1, 2, 3], Some(43), 24)]);
    assert_ne!(
        alone[0].0, other_seed[0].0,
        "different seeds gave identical samples"
    );
    let again = run_all(&model, &[sampled(vec![1, 2, 3], Some(42), 24)]);
    assert_eq!(alone[0].0, again[0].0);
}

#[test]
fn logprobs_are_reported_per_token() {
    let model = load_model(&repo_path("tests/data/tiny-qwen3"), WeightDType::F32);
    let mut req = sampled(vec![3, 1, 4, 1, 5], Some(1), 8);
    req.sampling.logprobs = 3;
    let out = run_all(&model, &[req]);
    let lps: Vec<_> = out[0].3.iter().flat_map(|e| e.logprobs.clone()).collect();
    assert_eq!(lps.len(), 8);
    for (lp, tok) in lps.iter().zip(&out[0].0) {
        assert_eq!(lp.token, *tok);
        assert!(lp.logprob <= 0.0 && lp.logprob.is_finite());
        assert_eq!(lp.top.len(), 3);
        assert!(
            lp.top.windows(2).all(|w| w[0].1 >= w[1].1),
            "top logprobs sorted"
        );
        assert!(lp.top[0].1 >= lp.logprob - 1e-6);
    }
}

#[test]
fn stop_strings_cut_real_text_and_name_the_stop() {
    let model = load_model(&smollm2_dir(""), WeightDType::Auto);
    let tok = model.tokenizer().unwrap();
    let prompt = tok
        .encode(
            "The capital of France is Paris. The capital of Germany is",
            false,
        )
        .unwrap();
    let greedy = |stops: Vec<String>| RequestParams {
        prompt: prompt.clone(),
        sampling: SamplingParams {
            max_tokens: 24,
            stop_strings: stops,
            ..Default::default()
        },
        ..Default::default()
    };
    let free = &run_all(&model, &[greedy(vec![])])[0];
    let full = free.1.clone();
    // Stop on a piece of the text that spans token boundaries.
    let cut = full.find("Berlin").expect("the model names Berlin") + 3;
    let stop = full[cut - 3..cut + 2].to_string();
    let out = &run_all(&model, &[greedy(vec!["zzz-never".into(), stop.clone()])])[0];
    assert_eq!(out.2, Some(FinishReason::StopString(1)));
    assert_eq!(
        out.1,
        full[..cut - 3],
        "text must end right before the stop string {stop:?}"
    );
    assert!(!out.1.contains(&stop));
}

#[test]
fn invalid_sampling_is_refused_naming_the_parameter() {
    let model = load_model(&repo_path("tests/data/tiny-qwen2"), WeightDType::F32);
    let mut session = Session::new(
        model,
        SessionParams {
            kv_capacity_tokens: 256,
            ..Default::default()
        },
    )
    .unwrap();
    let cases: Vec<(SamplingParams, &str)> = vec![
        (
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            },
            "temperature",
        ),
        (
            SamplingParams {
                temperature: -0.5,
                ..Default::default()
            },
            "temperature",
        ),
        (
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            "top_p",
        ),
        (
            SamplingParams {
                top_p: 1.5,
                ..Default::default()
            },
            "top_p",
        ),
        (
            SamplingParams {
                top_k: -1,
                ..Default::default()
            },
            "top_k",
        ),
        (
            SamplingParams {
                min_p: 2.0,
                ..Default::default()
            },
            "min_p",
        ),
        (
            SamplingParams {
                logit_bias: vec![(100_000, 1.0)],
                ..Default::default()
            },
            "logit_bias",
        ),
        (
            SamplingParams {
                logprobs: 21,
                ..Default::default()
            },
            "logprobs",
        ),
        (
            SamplingParams {
                max_tokens: 0,
                ..Default::default()
            },
            "max_tokens",
        ),
        (
            SamplingParams {
                stop_strings: vec!["x".into()],
                max_tokens: 4,
                ..Default::default()
            },
            "tokenizer",
        ),
    ];
    for (sampling, name) in cases {
        let err = session
            .add_request(RequestParams {
                prompt: vec![1, 2],
                sampling,
                ..Default::default()
            })
            .unwrap_err();
        assert!(err.message.contains(name), "error {err} should name {name}");
    }
    assert!(!session.has_work(), "a refused request must not be queued");
}
