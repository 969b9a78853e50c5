//! NanoInfer against HuggingFace transformers: greedy token ids, top-5 logits
//! and perplexity from goldens made by scripts/make_goldens.py.

mod common;

use common::*;
use nanoinfer::engine::eval::{greedy_with_logits, perplexity};
use nanoinfer::engine::{Model, RequestParams, Session, SessionParams};
use nanoinfer::model::WeightDType;
use nanoinfer::sampling::SamplingParams;
use nanoinfer::tokenizer::ChatMessage;
use serde_json::Value;

struct Case {
    name: String,
    prompt: Vec<u32>,
    output: Vec<u32>,
    top_logits: Vec<Vec<(u32, f32)>>,
}

fn cases(g: &Value) -> Vec<Case> {
    g["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().unwrap_or("?").to_string(),
            prompt: ids(&c["prompt_ids"]),
            output: ids(&c["output_ids"]),
            top_logits: c["top_logits"]
                .as_array()
                .expect("top_logits")
                .iter()
                .map(|step| {
                    step.as_array()
                        .expect("step")
                        .iter()
                        .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap() as f32))
                        .collect()
                })
                .collect(),
        })
        .collect()
}

/// Greedy ids identical for every step, top-k logits within `rel`.
fn check_greedy_and_logits(model: &Model, cases: &[Case], rel: f32) {
    for case in cases {
        let (out, rows) = greedy_with_logits(model, &case.prompt, case.output.len()).unwrap();
        assert_eq!(
            out, case.output,
            "{}: greedy ids differ from transformers",
            case.name
        );
        for (step, (row, want)) in rows.iter().zip(&case.top_logits).enumerate() {
            for &(id, logit) in want {
                let got = row[id as usize];
                assert!(
                    close(got, logit, rel),
                    "{} step {step} token {id}: logit {got} vs transformers {logit}",
                    case.name
                );
            }
        }
    }
}

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

    let p = &g["perplexity"];
    let text = std::fs::read_to_string(repo_path(p["file"].as_str().unwrap())).unwrap();
    let mut tokens = model
        .tokenizer()
        .unwrap()
        .encode(&text, p["add_special_tokens"].as_bool().unwrap())
        .unwrap();
    tokens.truncate(p["max_tokens"].as_u64().unwrap() as usize);
    assert_eq!(tokens.len() as u64, p["n_tokens"].as_u64().unwrap());
    let ppl = perplexity(&model, &tokens).unwrap();
    let want = p["ppl"].as_f64().unwrap();
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
    let mut same = 0;
    for c in &cases {
        let (out, _) = greedy_with_logits(&model, &c.prompt, 16).unwrap();
        same += usize::from(out == c.output[..16]);
    }
    assert!(
        same * 4 >= cases.len() * 3,
        "only {same}/{} prompts kept their first 16 greedy tokens in bf16",
        cases.len()
    );

    let p = &g["perplexity"];
    let text = std::fs::read_to_string(repo_path(p["file"].as_str().unwrap())).unwrap();
    let mut tokens = model.tokenizer().unwrap().encode(&text, false).unwrap();
    tokens.truncate(p["max_tokens"].as_u64().unwrap() as usize);
    let ppl = perplexity(&model, &tokens).unwrap();
    let want = p["ppl"].as_f64().unwrap();
    assert!(
        (ppl - want).abs() / want < 0.02,
        "bf16 perplexity {ppl} vs f32 transformers {want}"
    );
}
