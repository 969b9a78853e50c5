//! What structured output costs: C requests constrained by a nested JSON
//! Schema (an object with arrays and enums) against the same C requests
//! unconstrained, made to generate exactly as many tokens each, in the same
//! run, alternating, medians of `--rounds` (default 3). Reports the time per
//! step and the host's share of it (the grammar mask is host work): the
//! slowdown, and the extra host time per step and per token.
//!
//! ```text
//! cargo run --release --example grammar_bench -- --model DIR [--threads 2]
//!     [--device cpu|cuda] [--concurrency 1,64]
//! ```

use nanoinfer::engine::{
    Constraint, Model, ModelParams, RequestId, RequestParams, Session, SessionParams,
};
use nanoinfer::sampling::SamplingParams;
use nanoinfer::tokenizer::ChatMessage;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

const SCHEMA: &str = r#"{"type": "object", "properties": {
  "name": {"type": "string", "maxLength": 40},
  "languages": {"type": "array", "items": {"enum": ["rust", "go", "python", "c"]}, "maxItems": 4},
  "team": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
      "person": {"type": "string", "maxLength": 30},
      "role": {"enum": ["lead", "dev", "qa"]}}, "required": ["person", "role"]}},
  "stars": {"type": "integer", "minimum": 0}},
 "required": ["name", "languages", "team", "stars"]}"#;

struct Run {
    tokens: Vec<usize>,
    steps: u64,
    step_ns: u64,
    forward_ns: u64,
}

fn run(model: &Arc<Model>, gpu: bool, reqs: Vec<RequestParams>) -> Run {
    let mut s = Session::new(model.clone(), SessionParams::default().with_step_shape(gpu)).unwrap();
    let before = s.stats();
    let ids: Vec<RequestId> = reqs
        .into_iter()
        .map(|r| s.add_request(r).unwrap())
        .collect();
    let mut tokens: HashMap<RequestId, usize> = HashMap::new();
    while s.has_work() {
        for e in s.step().unwrap() {
            *tokens.entry(e.request_id).or_default() += e.tokens.len();
            if let Some(nanoinfer::engine::FinishReason::Error(m)) = &e.finish {
                panic!("request failed: {m}");
            }
        }
    }
    let st = s.stats();
    Run {
        tokens: ids.iter().map(|id| tokens[id]).collect(),
        steps: st.steps - before.steps,
        step_ns: st.step_time_ns - before.step_time_ns,
        forward_ns: st.forward_time_ns - before.forward_time_ns,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let model_dir = PathBuf::from(get("--model").expect("--model DIR"));
    let params = ModelParams {
        threads: get("--threads").map_or(0, |t| t.parse().unwrap()),
        device: get("--device").map_or(nanoinfer::backend::Device::Cpu, |d| d.parse().unwrap()),
        ..Default::default()
    };
    let concurrency: Vec<usize> = get("--concurrency")
        .unwrap_or_else(|| "1,64".into())
        .split(',')
        .map(|c| c.parse().unwrap())
        .collect();
    let gpu = params.device != nanoinfer::backend::Device::Cpu;
    let model = Arc::new(Model::load(&model_dir, &params, None).unwrap());
    let tok = model.tokenizer().unwrap();
    let prompt = tok
        .encode_chat(
            &[ChatMessage::new(
                "user",
                "Describe a small software project as JSON: its name, languages, team and stars.",
            )],
            true,
            4096,
        )
        .unwrap();
    let request = |seed: u64, max_tokens: u32, constrained: bool| RequestParams {
        prompt: prompt.clone(),
        sampling: SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            max_tokens,
            ignore_eos: !constrained,
            ..Default::default()
        },
        constraint: constrained.then(|| Constraint::JsonSchema(SCHEMA.into())),
        ..Default::default()
    };
    println!("{}", model.decoder.summary());
    println!(
        "| requests | constrained: ms/step, host µs/step | plain, same tokens: ms/step, host µs/step \
         | step time ratio - 1 | extra host time / plain step | mask µs per token |"
    );
    println!("|---:|---|---|---:|---:|---:|");
    let rounds: usize = get("--rounds").map_or(3, |r| r.parse().unwrap());
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for &c in &concurrency {
        // Alternating rounds, medians: step times on a shared VM vary more
        // between runs than the mask costs.
        let (mut cs, mut ps, mut ch, mut ph, mut mask) = (vec![], vec![], vec![], vec![], vec![]);
        for _ in 0..rounds {
            let constrained = run(
                &model,
                gpu,
                (0..c as u64).map(|i| request(i, 256, true)).collect(),
            );
            let plain = run(
                &model,
                gpu,
                constrained
                    .tokens
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| request(i as u64, n as u32, false))
                    .collect(),
            );
            assert_eq!(plain.tokens, constrained.tokens);
            let per_step = |r: &Run| r.step_ns as f64 / r.steps as f64 / 1e6;
            let host_us = |r: &Run| (r.step_ns - r.forward_ns) as f64 / r.steps as f64 / 1e3;
            let total_tokens: usize = constrained.tokens.iter().sum();
            cs.push(per_step(&constrained));
            ps.push(per_step(&plain));
            ch.push(host_us(&constrained));
            ph.push(host_us(&plain));
            mask.push(
                ((constrained.step_ns - constrained.forward_ns) as f64
                    - (plain.step_ns - plain.forward_ns) as f64)
                    / 1e3
                    / total_tokens as f64,
            );
        }
        let (cs, ps, ch, ph) = (median(cs), median(ps), median(ch), median(ph));
        println!(
            "| {c} | {cs:.2}, {ch:.0} | {ps:.2}, {ph:.0} | {:+.1} % | {:+.1} % | {:.0} |",
            100.0 * (cs / ps - 1.0),
            100.0 * (ch - ph) / 1e3 / ps,
            median(mask)
        );
    }
}
