//! Speculative decoding: greedy output identical to decoding without it (on
//! the transformers goldens), seeded sampling identical, unseeded sampling
//! with the same distribution (two-sample chi-square), and the event and KV
//! contracts under load with cancels and preemption.

mod common;
#[path = "engine_common/mod.rs"]
mod engine_common;

use common::{ids, load_model, load_quantized};
use engine_common::{
    drain, run_all, smollm2_dir, tiny_model, EventLog, Outcome, TestRng, TinySpec,
};
use nanoinfer::engine::{
    Model, PreemptionMode, RequestParams, Session, SessionParams, SpeculativeMethod,
    SpeculativeParams,
};
use nanoinfer::kv::KvBackendKind;
use nanoinfer::model::{QuantMode, WeightDType};
use nanoinfer::sampling::SamplingParams;
use nanoinfer::tokenizer::ChatMessage;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::Arc;

const BACKENDS: [KvBackendKind; 2] = [KvBackendKind::Paged, KvBackendKind::Token];

fn spec_session(
    model: &Arc<Model>,
    kv: KvBackendKind,
    spec: Option<SpeculativeParams>,
    capacity: usize,
) -> Session {
    let params = SessionParams {
        kv_backend: kv,
        block_size: 4,
        kv_capacity_tokens: capacity,
        speculative: spec.map(|s| SpeculativeParams { max_batch: 64, ..s }),
        ..Default::default()
    };
    Session::new(model.clone(), params).unwrap()
}

fn smollm2_int4_draft() -> Arc<Model> {
    load_quantized(
        &smollm2_dir(),
        WeightDType::Auto,
        QuantMode::Awq {
            group_size: 64,
            lm_head: false,
        },
    )
}

/// A chat prompt that asks SmolLM2 to copy a passage: the output quotes
/// its input, where prompt lookup drafts well.
fn copy_prompt(model: &Model) -> Vec<u32> {
    let passage = "The quick brown fox jumps over the lazy dog. Pack my box with five \
                   dozen liquor jugs. How vexingly quick daft zebras jump! The five \
                   boxing wizards jump quickly.";
    let tok = model.tokenizer().unwrap();
    let text = format!("Repeat the following text exactly, word for word:\n\n{passage}");
    let rendered = tok
        .apply_chat_template(
            &[ChatMessage {
                role: "user".into(),
                content: text,
            }],
            true,
        )
        .unwrap();
    tok.encode(&rendered, false).unwrap()
}

/// Every SmolLM2 golden case at once, greedy, with speculation by each
/// method on each KV backend: exactly transformers' ids, and drafted tokens
/// were kept along the way.
#[test]
fn greedy_speculation_gives_the_transformers_goldens() {
    let g: Value = serde_json::from_str(
        &std::fs::read_to_string(engine_common::repo_path("tests/data/goldens/smollm2.json"))
            .unwrap(),
    )
    .unwrap();
    let model = load_model(&smollm2_dir(), WeightDType::Auto);
    let draft = smollm2_int4_draft();
    let cases: Vec<(Vec<u32>, Vec<u32>)> = g["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (ids(&c["prompt_ids"]), ids(&c["output_ids"])))
        .collect();
    let reqs: Vec<RequestParams> = cases
        .iter()
        .map(|(prompt, out)| RequestParams {
            prompt: prompt.clone(),
            sampling: SamplingParams {
                max_tokens: out.len() as u32,
                ignore_eos: true,
                ..Default::default()
            },
            ..Default::default()
        })
        .collect();
    for kv in BACKENDS {
        for spec in [
            SpeculativeParams::ngram(4),
            SpeculativeParams::draft(draft.clone(), 4),
        ] {
            let what = format!("{kv:?} {:?}", spec.method);
            let mut s = spec_session(&model, kv, Some(spec), 4096);
            let outs = run_all(&mut s, &reqs);
            for ((_, want), got) in cases.iter().zip(&outs) {
                assert_eq!(&got.tokens, want, "{what}: differs from transformers");
            }
            let st = s.stats();
            assert!(
                st.spec_accepted_tokens > 0 && st.spec_verifications > 0,
                "{what}: nothing was drafted and kept: {st:?}"
            );
            assert_eq!(s.draft_kv_used_slots(), 0, "{what}: draft KV leaked");
        }
    }
}

/// An input-grounded prompt: greedy output is unchanged, and prompt lookup
/// keeps more than one token per step on average.
#[test]
fn copying_prompt_is_unchanged_and_drafts_are_kept() {
    let model = load_model(&smollm2_dir(), WeightDType::Auto);
    let req = RequestParams {
        prompt: copy_prompt(&model),
        sampling: SamplingParams {
            max_tokens: 48,
            ..Default::default()
        },
        ..Default::default()
    };
    let plain = run_all(
        &mut spec_session(&model, KvBackendKind::Paged, None, 4096),
        std::slice::from_ref(&req),
    );
    for kv in BACKENDS {
        let mut s = spec_session(&model, kv, Some(SpeculativeParams::ngram(6)), 4096);
        let spec = run_all(&mut s, std::slice::from_ref(&req));
        assert_eq!(spec[0].tokens, plain[0].tokens, "{kv:?}");
        assert_eq!(spec[0].text, plain[0].text, "{kv:?}");
        let st = s.stats();
        assert!(
            st.spec_mean_accepted_length() > 2.0,
            "{kv:?}: copying should keep drafts: {st:?}"
        );
        assert!(
            st.steps < plain[0].tokens.len() as u64,
            "{kv:?}: {} steps for {} tokens",
            st.steps,
            plain[0].tokens.len()
        );
    }
}

/// Seeded sampling through every logits processor draws the same tokens
/// (and log-probabilities) with and without speculation.
#[test]
fn seeded_sampling_is_identical_with_speculation() {
    let model = load_model(&smollm2_dir(), WeightDType::Auto);
    let prompt = copy_prompt(&model);
    let reqs: Vec<RequestParams> = (0..6u64)
        .map(|seed| RequestParams {
            prompt: prompt.clone(),
            sampling: SamplingParams {
                temperature: 0.7,
                top_k: 40,
                top_p: 0.95,
                min_p: 0.02,
                repetition_penalty: 1.05,
                presence_penalty: 0.1,
                frequency_penalty: 0.1,
                logit_bias: vec![(13, -1.0)],
                seed: Some(seed),
                max_tokens: 40,
                logprobs: if seed % 2 == 0 { 2 } else { 0 },
                ..Default::default()
            },
            ..Default::default()
        })
        .collect();
    let plain = run_all(
        &mut spec_session(&model, KvBackendKind::Paged, None, 4096),
        &reqs,
    );
    for kv in BACKENDS {
        let mut s = spec_session(&model, kv, Some(SpeculativeParams::ngram(4)), 4096);
        let spec = run_all(&mut s, &reqs);
        for (a, b) in plain.iter().zip(&spec) {
            assert_eq!(a.tokens, b.tokens, "{kv:?}");
        }
        assert!(s.stats().spec_accepted_tokens > 0, "{:?}", s.stats());
    }
}

/// Unseeded sampling: the tokens that follow drafted positions have the
/// same distribution with and without speculation. Two independent samples
/// of 1 200 requests each on a tiny model that drafts for itself (greedy
/// drafts, kept with the probability the sampler gives them: many are kept
/// and many rejected); for the second to fourth tokens, the two-sample
/// chi-square over the four commonest tokens and the rest must stay under
/// 18.47, the 0.1 % critical value for 4 degrees of freedom.
#[test]
fn unseeded_sampling_distribution_is_unchanged() {
    let model = tiny_model(&TinySpec::default());
    let prompt = vec![5u32, 9, 17, 33, 28, 18];
    let sampling = SamplingParams {
        temperature: 0.7,
        max_tokens: 4,
        ..Default::default()
    };
    let run = |spec: Option<SpeculativeParams>, seed: u64| {
        let params = SessionParams {
            kv_capacity_tokens: 8192,
            max_seqs: 32,
            seed,
            speculative: spec.map(|s| SpeculativeParams { max_batch: 64, ..s }),
            ..Default::default()
        };
        let mut s = Session::new(model.model.clone(), params).unwrap();
        let reqs = vec![
            RequestParams {
                prompt: prompt.clone(),
                sampling: sampling.clone(),
                ..Default::default()
            };
            1200
        ];
        let outs = run_all(&mut s, &reqs);
        (outs, s.stats())
    };
    let (plain, _) = run(None, 1);
    let (spec, st) = run(Some(SpeculativeParams::draft(model.model.clone(), 2)), 2);
    assert!(
        st.spec_accepted_tokens > 300 && st.spec_draft_tokens > st.spec_accepted_tokens + 300,
        "the test needs both kept and rejected drafts: {st:?}"
    );
    let mut worst = 0.0f64;
    for pos in 1..4 {
        let mut freq: HashMap<u32, usize> = HashMap::new();
        for o in &plain {
            *freq.entry(o.tokens[pos]).or_default() += 1;
        }
        let mut common: Vec<(usize, u32)> = freq.iter().map(|(&t, &c)| (c, t)).collect();
        common.sort_unstable_by(|a, b| b.cmp(a));
        let common: Vec<u32> = common.iter().take(4).map(|&(_, t)| t).collect();
        let category = |t: u32| common.iter().position(|&c| c == t).unwrap_or(common.len());
        let counts = |outs: &[Outcome]| {
            let mut c = vec![0f64; common.len() + 1];
            for o in outs {
                c[category(o.tokens[pos])] += 1.0;
            }
            c
        };
        let (a, b) = (counts(&plain), counts(&spec));
        let mut chi2 = 0.0;
        for (x, y) in a.iter().zip(&b) {
            if x + y > 0.0 {
                // Two-sample chi-square with equal sample sizes.
                chi2 += (x - y).powi(2) / (x + y);
            }
        }
        worst = worst.max(chi2);
        assert!(
            chi2 < 18.47,
            "token {pos}: chi-square {chi2:.2}, plain {a:?} vs speculative {b:?}"
        );
    }
    eprintln!(
        "worst chi-square {worst:.2} (critical 18.47); drafted {}, kept {}",
        st.spec_draft_tokens, st.spec_accepted_tokens
    );
}

/// 64 concurrent requests, half of them opting out, with random cancels, on
/// a KV cache small enough to preempt (recompute and swap), both backends,
/// n-gram and a draft model (the target itself, so drafts are kept): every
/// request ends once, no KV is left, greedy outputs equal a plain run's.
#[test]
fn load_with_cancels_and_preemption_keeps_the_contracts() {
    let model = tiny_model(&TinySpec::default());
    let mut rng = TestRng::new(42);
    let reqs: Vec<RequestParams> = (0..64)
        .map(|i| {
            let period = rng.range(2, 6);
            let pattern = rng.tokens(period, 128);
            let len = rng.range(8, 40);
            RequestParams {
                prompt: pattern.iter().cycle().take(len).copied().collect(),
                sampling: SamplingParams {
                    max_tokens: rng.range(4, 40) as u32,
                    temperature: if i % 3 == 0 { 0.8 } else { 0.0 },
                    seed: Some(i),
                    ..Default::default()
                },
                disable_speculation: i % 2 == 1,
                ..Default::default()
            }
        })
        .collect();
    let plain = run_all(
        &mut spec_session(&model, KvBackendKind::Paged, None, 8192),
        &reqs,
    );
    for kv in BACKENDS {
        for preemption in [PreemptionMode::Recompute, PreemptionMode::Swap] {
            for spec in [
                SpeculativeParams::ngram(3),
                SpeculativeParams::draft(model.model.clone(), 3),
            ] {
                let what = format!("{kv:?} {preemption:?} {:?}", spec.method);
                let params = SessionParams {
                    kv_backend: kv,
                    block_size: 4,
                    kv_capacity_tokens: 256,
                    preemption,
                    speculative: Some(SpeculativeParams {
                        max_batch: 64,
                        ..spec
                    }),
                    ..Default::default()
                };
                let mut s = Session::new(model.model.clone(), params).unwrap();
                let mut log = EventLog::default();
                let mut ids = Vec::new();
                for r in &reqs {
                    let id = s.add_request(r.clone()).unwrap();
                    log.expect(id);
                    ids.push(id);
                }
                let mut cancelled = HashMap::new();
                let mut steps = 0;
                while s.has_work() {
                    if rng.chance(0.15) {
                        let i = rng.range(0, ids.len());
                        if s.cancel(ids[i]).is_ok() {
                            cancelled.insert(ids[i], i);
                        }
                    }
                    log.record(s.step().unwrap());
                    s.check_invariants()
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    steps += 1;
                    assert!(steps < 100_000, "{what}: no progress");
                }
                drain(&mut s, &mut log, 10);
                assert_eq!(s.draft_kv_used_slots(), 0, "{what}: draft KV leaked");
                let st = s.stats();
                assert!(st.preemptions > 0, "{what}: nothing was preempted: {st:?}");
                assert!(st.spec_accepted_tokens > 0, "{what}: {st:?}");
                for (i, id) in ids.iter().enumerate() {
                    let got = log.get(*id);
                    if cancelled.contains_key(id) {
                        // A cancelled request's tokens are a prefix of the plain run's.
                        assert!(plain[i].tokens.starts_with(&got.tokens), "{what}");
                    } else {
                        assert_eq!(got.tokens, plain[i].tokens, "{what}: request {i}");
                    }
                }
            }
        }
    }
}

#[test]
fn a_draft_model_with_another_vocabulary_is_refused() {
    let target = tiny_model(&TinySpec::default());
    let other = tiny_model(&TinySpec {
        vocab: 96,
        ..TinySpec::default()
    });
    let params = SessionParams {
        kv_capacity_tokens: 4096,
        speculative: Some(SpeculativeParams::draft(other.model.clone(), 4)),
        ..Default::default()
    };
    let err = Session::new(target.model.clone(), params).err().unwrap();
    assert!(err.message.contains("vocabulary"), "{}", err.message);
    for (k, min_n, max_n) in [(17, 2, 4), (4, 0, 4), (4, 3, 2)] {
        let params = SessionParams {
            kv_capacity_tokens: 4096,
            speculative: Some(SpeculativeParams {
                method: SpeculativeMethod::Ngram { min_n, max_n },
                num_speculative_tokens: k,
                max_batch: 0,
            }),
            ..Default::default()
        };
        let err = Session::new(target.model.clone(), params).err().unwrap();
        assert!(
            err.message.contains("num_speculative_tokens") || err.message.contains("min_n"),
            "{}",
            err.message
        );
    }
}
