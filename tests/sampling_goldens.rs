//! The sampling stages against transformers' logits processors
//! (tests/data/goldens/logits_processors.json, written by
//! scripts/make_goldens.py): each stage alone, the HF chain, and the Sampler
//! running the same chain.

use std::collections::HashMap;
use std::path::PathBuf;

use nanoinfer::sampling::processors::{
    apply_min_p, apply_presence_frequency_penalty, apply_repetition_penalty, apply_temperature,
    apply_top_k, apply_top_p,
};
use nanoinfer::sampling::{CandidateSet, Sampler, SamplingParams, TokenHistory};
use serde::Deserialize;

const TOL: f32 = 1e-5;

#[derive(Deserialize)]
struct Golden {
    schema_version: u32,
    masked_value: f32,
    logits: Vec<f32>,
    input_ids: Vec<u32>,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    processor: String,
    params: HashMap<String, f64>,
    output: Vec<f32>,
    #[serde(default)]
    probs: Option<Vec<f32>>,
}

impl Case {
    fn param(&self, key: &str) -> f32 {
        *self
            .params
            .get(key)
            .unwrap_or_else(|| panic!("case {}: missing param {key}", self.name)) as f32
    }
}

fn load() -> Golden {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/goldens/logits_processors.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (generate it with scripts/make_goldens.py)",
            path.display()
        )
    });
    let g: Golden = serde_json::from_str(&text).expect("logits_processors.json does not parse");
    assert_eq!(g.schema_version, 1, "unexpected golden schema version");
    g
}

/// Compares our output with the golden; golden entries at or below the
/// masked value must be -inf here, and vice versa.
fn assert_close(name: &str, ours: &[f32], golden: &[f32], masked: f32) {
    assert_eq!(ours.len(), golden.len(), "{name}: length");
    for (i, (&a, &b)) in ours.iter().zip(golden).enumerate() {
        if b <= masked {
            assert_eq!(
                a,
                f32::NEG_INFINITY,
                "{name}[{i}]: should be masked, got {a}"
            );
        } else {
            assert!(
                (a - b).abs() <= TOL,
                "{name}[{i}]: ours {a} vs transformers {b}"
            );
        }
    }
}

/// History with `input_ids` as the prompt (the repetition penalty's view).
fn prompt_history(g: &Golden) -> TokenHistory {
    let mut h = TokenHistory::new(g.logits.len(), true, false);
    h.sync(&g.input_ids, &[]);
    h
}

#[test]
fn each_stage_matches_transformers() {
    let g = load();
    let masked = g.masked_value * 0.5;
    let mut scratch = CandidateSet::new();
    let mut seen_kinds = Vec::new();
    for case in &g.cases {
        let mut l = g.logits.clone();
        match case.processor.as_str() {
            "repetition_penalty" => {
                apply_repetition_penalty(&mut l, case.param("penalty"), &prompt_history(&g))
            }
            "temperature" => apply_temperature(&mut l, case.param("temperature")),
            "top_k" => apply_top_k(&mut l, case.param("top_k") as usize, &mut scratch),
            "top_p" => apply_top_p(&mut l, case.param("top_p"), &mut scratch),
            "min_p" => apply_min_p(&mut l, case.param("min_p"), &mut scratch),
            "presence_frequency" => {
                // The golden counts the whole history, i.e. treats it as output.
                let mut h = TokenHistory::new(l.len(), false, true);
                h.sync(&[], &g.input_ids);
                let (p, f) = (
                    case.param("presence_penalty"),
                    case.param("frequency_penalty"),
                );
                apply_presence_frequency_penalty(&mut l, p, f, &h);
            }
            "chain" => {
                apply_repetition_penalty(&mut l, case.param("penalty"), &prompt_history(&g));
                apply_temperature(&mut l, case.param("temperature"));
                apply_top_k(&mut l, case.param("top_k") as usize, &mut scratch);
                apply_top_p(&mut l, case.param("top_p"), &mut scratch);
                apply_min_p(&mut l, case.param("min_p"), &mut scratch);
            }
            other => panic!("case {}: unknown processor {other}", case.name),
        }
        assert_close(&case.name, &l, &case.output, masked);
        seen_kinds.push(case.processor.clone());
    }
    for kind in [
        "repetition_penalty",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "presence_frequency",
    ] {
        assert!(
            seen_kinds.iter().any(|k| k == kind),
            "golden has no {kind} case"
        );
    }
}

/// The Sampler with the chain's parameters: its processed logits equal the
/// golden on every surviving token, and it only ever draws survivors, with
/// frequencies following the golden probabilities.
#[test]
fn sampler_runs_the_same_chain() {
    let g = load();
    let masked = g.masked_value * 0.5;
    let case = g
        .cases
        .iter()
        .find(|c| c.processor == "chain")
        .expect("golden has no chain case");
    let params = SamplingParams {
        repetition_penalty: case.param("penalty"),
        temperature: case.param("temperature"),
        top_k: case.param("top_k") as i32,
        top_p: case.param("top_p"),
        min_p: case.param("min_p"),
        seed: Some(1),
        ..SamplingParams::default()
    };
    params.validate(g.logits.len()).unwrap();
    let probs = case.probs.as_ref().expect("chain case has no probs");

    let mut sampler = Sampler::new(&params, 0);
    let mut counts = vec![0usize; g.logits.len()];
    let draws = 20_000;
    for _ in 0..draws {
        let mut row = g.logits.clone();
        let t = sampler
            .sample(&mut row, &g.input_ids, &[], &[])
            .unwrap()
            .token as usize;
        counts[t] += 1;
        for (i, &b) in case.output.iter().enumerate() {
            if b > masked {
                assert!(
                    (row[i] - b).abs() <= TOL,
                    "processed logit {i}: {} vs {b}",
                    row[i]
                );
            }
        }
    }
    for (i, (&c, &p)) in counts.iter().zip(probs).enumerate() {
        assert!(
            p > 0.0 || c == 0,
            "token {i} has golden probability 0 but was drawn {c} times"
        );
        // 6 standard deviations of a binomial: loose, but catches a wrong distribution.
        let sd = (draws as f32 * p * (1.0 - p)).sqrt();
        let expected = draws as f32 * p;
        assert!(
            (c as f32 - expected).abs() <= 6.0 * sd + 1.0,
            "token {i}: drawn {c} times, expected {expected}"
        );
    }
}
