//! SmolLM2 on whatever kernel path this machine picks, one test per weight
//! format (F32, BF16, Q8_0, int4), sized for `scripts/test_aarch64.sh`,
//! which runs it on an aarch64 build under qemu user emulation (the NEON
//! kernels, with `sdot`). There the full golden groups (`goldens`,
//! `quant_q8`, `int4`) do not fit CI's time: qemu runs f32 vector
//! arithmetic through soft-float helpers, and the F32 perplexity over the
//! golden's 512 tokens alone took 11 minutes (2 cores). Natively (in
//! `cargo test`) this group takes a few seconds.
//!
//! Against transformers' goldens: greedy ids of the golden's first
//! [`GREEDY_CASES`] prompts for [`GREEDY_STEPS`] steps, with the full
//! groups' rules (F32: ids equal and top-5 logits within 1e-3; BF16: at
//! least 3 in 4 prompts keep their ids; Q8_0: ids follow transformers until
//! a near-tie, logits within 10 %). int4 (AWQ round-to-nearest, group 128)
//! has no greedy rule in the full groups either: on the first prompt it
//! leaves transformers' ids within 8 steps on every path.
//!
//! Perplexity: transformers' golden covers 512 tokens, out of reach here,
//! so the quantized formats are held to the F32 weights on the same path
//! (as `int4` holds its kernels to the same weights in F32), over the first
//! [`PPL_TOKENS`] tokens of the golden's text: int4 below 1.30 × (the full
//! group's bound), Q8_0 within 3 % (the full group: 1.5 % of transformers'
//! figure; over 64 tokens a last-bit change elsewhere in the forward moves
//! it further: measured 66.047 on AVX-512 and AVX2, 66.866 scalar, 65.312
//! NEON, against F32's 66.446 on all four). The F32 forward itself is
//! checked by its greedy logits.

mod common;

use common::smollm2::*;
use common::*;
use nanoinfer::engine::eval::perplexity;
use nanoinfer::engine::Model;
use nanoinfer::model::{QuantMode, WeightDType};
use serde_json::Value;
use std::sync::{Arc, OnceLock};

/// The golden's first prompts that greedy decoding runs.
const GREEDY_CASES: usize = 1;
/// Steps of greedy decoding per prompt.
const GREEDY_STEPS: usize = 8;
/// Tokens of the perplexity text scored.
const PPL_TOKENS: usize = 64;

/// The golden's first [`GREEDY_CASES`] cases, cut to [`GREEDY_STEPS`] steps.
fn short_cases(g: &Value) -> Vec<Case> {
    let mut cases = cases(g);
    cases.truncate(GREEDY_CASES);
    for c in &mut cases {
        c.output.truncate(GREEDY_STEPS);
        c.top_logits.truncate(GREEDY_STEPS);
    }
    cases
}

/// Perplexity over the first [`PPL_TOKENS`] tokens of the golden's text.
fn short_perplexity(model: &Model, g: &Value, label: &str) -> f64 {
    let tokens = perplexity_tokens(model, g);
    let ppl = perplexity(model, &tokens[..PPL_TOKENS]).unwrap();
    eprintln!("{label}: perplexity over {PPL_TOKENS} tokens {ppl:.4}");
    ppl
}

/// The F32 model and its [`short_perplexity`], loaded and computed once
/// by whichever test asks first.
fn f32_reference() -> &'static (Arc<Model>, f64) {
    static REFERENCE: OnceLock<(Arc<Model>, f64)> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let model = load_model(&smollm2_dir(""), WeightDType::Auto);
        assert_eq!(model.decoder.weight_dtype_name(), "f32");
        let ppl = short_perplexity(&model, &golden("smollm2.json"), "f32");
        (model, ppl)
    })
}

#[test]
fn f32_matches_transformers() {
    let g = golden("smollm2.json");
    check_greedy_and_logits(&f32_reference().0, &short_cases(&g), 1e-3);
}

#[test]
fn bf16_stays_close() {
    let g = golden("smollm2.json");
    let model = load_model(&smollm2_dir("-bf16"), WeightDType::Auto);
    assert_eq!(model.decoder.weight_dtype_name(), "bf16");
    let cases = short_cases(&g);
    let same = cases_keeping_first_ids(&model, &cases, GREEDY_STEPS);
    assert!(
        same * 4 >= cases.len() * 3,
        "only {same}/{} prompts kept their first {GREEDY_STEPS} greedy tokens in bf16",
        cases.len()
    );
}

#[test]
fn q8_0_stays_close() {
    let g = golden("smollm2.json");
    let model = load_quantized(&smollm2_dir(""), WeightDType::Auto, QuantMode::Q8_0_DEFAULT);
    assert_eq!(model.decoder.weight_dtype_name(), "q8_0");
    check_greedy_until_near_tie(&model, &short_cases(&g), "q8_0");
    let ppl = short_perplexity(&model, &g, "q8_0");
    let f32 = f32_reference().1;
    assert!(
        (ppl - f32).abs() / f32 < 0.03,
        "q8_0 perplexity over {PPL_TOKENS} tokens {ppl} vs the F32 weights' {f32}"
    );
}

#[test]
fn int4_stays_within_its_bound() {
    let g = golden("smollm2.json");
    let quant = QuantMode::Awq {
        group_size: 128,
        lm_head: false,
    };
    let model = load_quantized(&smollm2_dir(""), WeightDType::Auto, quant);
    assert_eq!(model.decoder.weight_dtype_name(), "int4");
    let ppl = short_perplexity(&model, &g, "int4");
    let f32 = f32_reference().1;
    assert!(
        ppl / f32 < 1.30,
        "int4 (awq g128) perplexity over {PPL_TOKENS} tokens {ppl} vs the F32 weights' {f32}"
    );
}
