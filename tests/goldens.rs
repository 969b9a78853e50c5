//! NanoInfer against HuggingFace transformers: greedy token ids, top-5 logits
//! and perplexity from goldens made by scripts/make_goldens.py.

mod common;

use common::smollm2::*;
use common::*;
use nanoinfer::engine::{Model, RequestParams, Session, SessionParams};
use nanoinfer::model::WeightDType;
use nanoinfer::sampling::SamplingParams;
use nanoinfer::tokenizer::ChatMessage;

/// All cases at once through a continuously batched session.
fn check_batched_session(model: &std::sync::Arc<Model>, cases: &[Case], params: SessionParams) {
    let mut session = Session::new(model.clone(), params).unwrap();
    let mut ids = Vec::new();
    for c in cases {
        let sampling = SamplingParams {
            max_tokens: c.output.len() as u32,
            ignore_eos: true,
            ..Default::default()
        };
        ids.push(
            session
                .add_request(RequestParams {
                    prompt: c.prompt.clone(),
                    sampling,
                    ..Default::default()
                })
                .unwrap(),
        );
    }
    let mut outputs = vec![Vec::new(); cases.len()];
    while session.has_work() {
        for ev in session.step().unwrap() {
            let i = ids.iter().position(|&x| x == ev.request_id).unwrap();
            outputs[i].extend(ev.tokens);
        }
    }
    for (c, out) in cases.iter().zip(outputs) {
        assert_eq!(
            out, c.output,
            "{}: batched session output differs from transformers",
            c.name
        );
    }
    session.check_invariants().unwrap();
}

fn tiny(arch: &str) {
    let g = golden(&format!("tiny-{arch}.json"));
    let model = load_model(
        &repo_path(&format!("tests/data/tiny-{arch}")),
        WeightDType::F32,
    );
    let cases = cases(&g);
    check_greedy_and_logits(&model, &cases, 1e-3);
    let params = SessionParams {
        kv_capacity_tokens: 1024,
        block_size: 4,
        prefill_chunk_size: 7,
        ..Default::default()
    };
    check_batched_session(&model, &cases, params);
}

#[test]
fn tiny_llama3_matches_transformers() {
    tiny("llama3");
}

#[test]
fn tiny_qwen2_matches_transformers() {
    tiny("qwen2");
}

#[test]
fn tiny_qwen3_matches_transformers() {
    tiny("qwen3");
}

#[test]
fn smollm2_tokenizer_and_chat_template_give_transformers_prompt_ids() {
    let g = golden("smollm2.json");
    let model = load_model(&smollm2_dir(""), WeightDType::Auto);
    let tok = model.tokenizer().unwrap();
    let add_special = g["add_special_tokens"].as_bool().unwrap_or(false);
    for c in g["cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        let got = if c["chat"].as_bool().unwrap() {
            let rendered = tok
                .apply_chat_template(
                    &[ChatMessage {
                        role: "user".into(),
                        content: text.into(),
                    }],
                    true,
                )
                .unwrap();
            assert_eq!(
                rendered,
                c["rendered"].as_str().unwrap(),
                "chat rendering of {text:?}"
            );
            tok.encode(&rendered, false).unwrap()
        } else {
            tok.encode(text, add_special).unwrap()
        };
        assert_eq!(got, ids(&c["prompt_ids"]), "prompt ids of {text:?}");
    }
}

#[test]
fn smollm2_f32_matches_transformers() {
    let g = golden("smollm2.json");
    let model = load_model(&smollm2_dir(""), WeightDType::Auto);
    let cases = cases(&g);
    check_greedy_and_logits(&model, &cases, 1e-3);
    check_batched_session(
        &model,
        &cases,
        SessionParams {
            kv_capacity_tokens: 8192,
            ..Default::default()
        },
    );

    assert_eq!(
        perplexity_tokens(&model, &g).len() as u64,
        g["perplexity"]["n_tokens"].as_u64().unwrap()
    );
    let (ppl, want) = perplexity_vs_golden(&model, &g);
    assert!(
        (ppl - want).abs() / want < 0.005,
        "perplexity {ppl} vs transformers {want}"
    );
}

#[test]
fn smollm2_bf16_weights_stay_close() {
    let g = golden("smollm2.json");
    let model = load_model(&smollm2_dir("-bf16"), WeightDType::Auto);
    assert_eq!(model.decoder.weight_dtype_name(), "bf16");
    let cases = cases(&g);
    let same = cases_keeping_first_ids(&model, &cases, 16);
    assert!(
        same * 4 >= cases.len() * 3,
        "only {same}/{} prompts kept their first 16 greedy tokens in bf16",
        cases.len()
    );

    let (ppl, want) = perplexity_vs_golden(&model, &g);
    assert!(
        (ppl - want).abs() / want < 0.02,
        "bf16 perplexity {ppl} vs f32 transformers {want}"
    );
}
