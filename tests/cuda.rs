//! CUDA backend against transformers on the same GPU.
//!
//! The GPU tests need reference models made there by
//! `scripts/cuda_fixtures.py OUT_DIR` and `NANOINFER_CUDA_FIXTURES=OUT_DIR`;
//! without it (CI has no GPU) they return early and say so. Run them on a GPU
//! machine from the release test binary:
//! `NANOINFER_CUDA_FIXTURES=/tmp/fx ./cuda-<hash> --test-threads 1`.

mod common;

use common::dequant::{dequantized_copy, dequantized_copy_as, DenseDType};
use nanoinfer::backend::cuda::{
    sampling::{sample_logits, sample_logits_after, sample_logits_masked},
    w4_packed_blocks, w4_packed_rows, ActDType, CudaDevice, GemmDType, KArg, W4GemmBlocks, W4Host,
    W4Matrix, W4Norm, W4Out, W4_PACKED_THREADS,
};
use nanoinfer::backend::Device;
use nanoinfer::engine::{
    Event, Model, ModelParams, RequestParams, Session, SessionParams, SpeculativeParams,
};
use nanoinfer::forward::{e4m3_from_f32, e4m3_to_f32};
use nanoinfer::kv::{KvBackendKind, KvCacheDType};
use nanoinfer::memory::MemoryPoolKind;
use nanoinfer::model::{QuantMode, WeightDType};
use nanoinfer::quantize::calib::Calibration;
use nanoinfer::quantize::gptq::GptqOptions;
use nanoinfer::quantize::{quantize_checkpoint, quantize_checkpoint_with, QuantizeOptions};
use nanoinfer::sampling::rng::SplitMix64;
use nanoinfer::sampling::{mask_words, DeviceSampling, Sampler, SamplingParams};
use nanoinfer::ErrorKind;
use serde_json::Value;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

const MODELS: &[&str] = &["llama3", "qwen2", "qwen3"];

fn fixtures() -> Option<PathBuf> {
    match std::env::var_os("NANOINFER_CUDA_FIXTURES") {
        Some(d) => Some(PathBuf::from(d)),
        None => {
            eprintln!("NANOINFER_CUDA_FIXTURES is not set: GPU test skipped");
            None
        }
    }
}

fn load(dir: &std::path::Path) -> Arc<Model> {
    load_as(dir, WeightDType::Auto)
}

fn load_as(dir: &std::path::Path, dtype: WeightDType) -> Arc<Model> {
    let params = ModelParams {
        device: Device::Cuda(0),
        dtype,
        ..Default::default()
    };
    Arc::new(Model::load(dir, &params, None).unwrap_or_else(|e| panic!("{}: {e}", dir.display())))
}

fn golden(dir: &std::path::Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Tokens and per-step top logprobs of one request.
#[derive(Debug, Clone, Default, PartialEq)]
struct Output {
    tokens: Vec<u32>,
    top: Vec<Vec<(u32, f32)>>,
}

fn sampling(n: u32, logprobs: u32) -> SamplingParams {
    SamplingParams {
        max_tokens: n,
        min_tokens: n,
        logprobs,
        ..Default::default()
    }
}

/// Runs every request to completion in one session; outputs in input order.
fn run(model: &Arc<Model>, params: SessionParams, reqs: &[RequestParams]) -> Vec<Output> {
    run_with_stats(model, params, reqs).0
}

fn run_with_stats(
    model: &Arc<Model>,
    params: SessionParams,
    reqs: &[RequestParams],
) -> (Vec<Output>, nanoinfer::engine::SessionStats) {
    let mut s = Session::new(model.clone(), params).expect("session");
    let ids: Vec<u64> = reqs
        .iter()
        .map(|r| s.add_request(r.clone()).unwrap())
        .collect();
    let mut out: HashMap<u64, Output> = HashMap::new();
    let mut finished = 0;
    while s.has_work() {
        for Event {
            request_id,
            tokens,
            logprobs,
            finish,
            ..
        } in s.step().expect("step")
        {
            let o = out.entry(request_id).or_default();
            o.tokens.extend(tokens);
            o.top.extend(logprobs.into_iter().map(|l| l.top));
            if let Some(f) = finish {
                assert!(
                    matches!(f, nanoinfer::engine::FinishReason::Length),
                    "request {request_id} ended with {f:?}"
                );
                finished += 1;
            }
        }
        s.check_invariants().expect("invariants");
    }
    assert_eq!(finished, reqs.len(), "every request ends exactly once");
    let st = s.stats();
    assert_eq!(st.kv.used_slots, 0, "KV leaked: {:?}", st.kv);
    (ids.iter().map(|id| out.remove(id).unwrap()).collect(), st)
}

fn requests(gold: &Value, n: u32) -> Vec<RequestParams> {
    gold["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| RequestParams {
            prompt: ids(p),
            sampling: sampling(n, 5),
            ..Default::default()
        })
        .collect()
}

/// transformers' output for prompt `i` of a golden file.
fn reference(gold: &Value, i: usize) -> Output {
    Output {
        tokens: ids(&gold["tokens"][i]),
        top: gold["top"][i]
            .as_array()
            .unwrap()
            .iter()
            .map(|step| {
                step.as_array()
                    .unwrap()
                    .iter()
                    .map(|e| (e[0].as_u64().unwrap() as u32, e[1].as_f64().unwrap() as f32))
                    .collect()
            })
            .collect(),
    }
}

/// How far apart two greedy runs of the same prompt may be: bf16 logits
/// (transformers rounds them to a step of 1/16 near |x| ~ 10) and
/// batch-shape-dependent GEMM rounding flip near-ties, nothing more.
const NEAR_TIE: f32 = 0.25;

/// vLLM's check_logprobs_close, tightened: identical tokens until the first
/// divergence; there each side's token must be in the other's top-5 *and*
/// within NEAR_TIE of the other's best logprob (a near-tie, not a wrong
/// model). Chosen-token logprobs before the divergence must agree within
/// NEAR_TIE. Returns the number of identical leading tokens.
fn check_near(what: &str, a: &Output, b: &Output) -> usize {
    check_near_within(what, a, b, NEAR_TIE)
}

fn check_near_within(what: &str, a: &Output, b: &Output, near_tie: f32) -> usize {
    for (t, (&x, &y)) in a.tokens.iter().zip(&b.tokens).enumerate() {
        let lp = |o: &Output, tok: u32| o.top[t].iter().find(|e| e.0 == tok).map(|e| e.1);
        if x != y {
            let (Some(a_y), Some(b_x)) = (lp(a, y), lp(b, x)) else {
                panic!(
                    "{what}: step {t} diverges ({x} vs {y}) outside each other's top-5: {:?} vs {:?}",
                    a.top[t], b.top[t]
                );
            };
            let gap_a = lp(a, x).unwrap() - a_y;
            let gap_b = lp(b, y).unwrap() - b_x;
            assert!(
                gap_a < near_tie && gap_b < near_tie,
                "{what}: step {t} diverges ({x} vs {y}) by more than a near-tie: gaps {gap_a}, {gap_b}"
            );
            return t;
        }
        let d = (lp(a, x).unwrap() - lp(b, y).unwrap()).abs();
        assert!(
            d < near_tie,
            "{what}: step {t} logprob of {x} differs by {d}"
        );
    }
    a.tokens.len().min(b.tokens.len())
}

#[test]
fn greedy_matches_transformers_bf16() {
    let Some(fx) = fixtures() else { return };
    for name in MODELS {
        let dir = fx.join(name);
        let gold = golden(&dir);
        let model = load(&dir);
        eprintln!("{name}: {}", model.decoder.summary());
        let n = ids(&gold["tokens"][0]).len() as u32;
        let outs = run(&model, SessionParams::default(), &requests(&gold, n));
        let matched: Vec<usize> = outs
            .iter()
            .enumerate()
            .map(|(i, o)| check_near(&format!("{name} prompt {i}"), o, &reference(&gold, i)))
            .collect();
        eprintln!("{name}: greedy tokens identical to transformers for {matched:?} of {n} steps");
        // Every divergence was checked to be a near-tie; they should still be rare.
        let total: usize = matched.iter().sum();
        assert!(
            3 * total >= matched.len() * n as usize,
            "{name}: too few tokens identical to transformers: {matched:?} of {n}"
        );
    }
}

#[test]
fn f16_activations_match_transformers_within_near_ties() {
    let Some(fx) = fixtures() else { return };
    for name in MODELS {
        let dir = fx.join(name);
        let gold = golden(&dir);
        let model = load_as(&dir, WeightDType::F16);
        assert_eq!(model.decoder.weight_dtype_name(), "f16");
        let n = ids(&gold["tokens"][0]).len() as u32;
        let outs = run(&model, SessionParams::default(), &requests(&gold, n));
        let matched: Vec<usize> = outs
            .iter()
            .enumerate()
            .map(|(i, o)| {
                // f16 against a bf16 reference: both dtypes' rounding adds up.
                let what = format!("{name} f16 prompt {i}");
                check_near_within(&what, o, &reference(&gold, i), 2.0 * NEAR_TIE)
            })
            .collect();
        eprintln!("{name} f16: identical to transformers bf16 for {matched:?} of {n} steps");
    }
}

/// A Llama-3-8B-shaped random bf16 model (`scripts/cuda_bench_hf.py
/// --make-8b DIR --golden DIR`, then `NANOINFER_CUDA_8B=DIR`).
#[test]
fn eight_b_shape_matches_transformers() {
    let Some(dir) = std::env::var_os("NANOINFER_CUDA_8B").map(PathBuf::from) else {
        eprintln!("NANOINFER_CUDA_8B is not set: GPU test skipped");
        return;
    };
    let gold = golden(&dir);
    let model = load(&dir);
    eprintln!("8B shape: {}", model.decoder.summary());
    let n = ids(&gold["tokens"][0]).len() as u32;
    let outs = run(&model, SessionParams::default(), &requests(&gold, n));
    let matched: Vec<usize> = outs
        .iter()
        .enumerate()
        .map(|(i, o)| check_near(&format!("8B prompt {i}"), o, &reference(&gold, i)))
        .collect();
    eprintln!("8B shape: greedy tokens identical to transformers for {matched:?} of {n} steps");
}

/// Issue 10's GPU quality target at full size: the Llama-3-8B-shaped model
/// (`NANOINFER_CUDA_8B`, as above) quantized to an AWQ g128 checkpoint, the
/// format of the int4 speed figures, against the same weights dequantized
/// into a bf16 model. Greedy tokens and logprobs of six prompts (the golden's
/// two and four seeded random ones of 16–512 tokens), 32 steps each: the
/// first token identical, then within near-ties as in
/// `int4_matches_the_same_weights_dequantized`, and the chosen tokens'
/// logprobs before each divergence within `2 × NEAR_TIE`; prints how many
/// leading tokens are identical and the largest logprob difference before
/// the first divergence. (The second token is not required to agree: with
/// random weights over 128 256 tokens it flips at a near-tie on some
/// freshly generated models, before the device seam as after it; see
/// docs/benchmarks-log.md.)
#[test]
fn int4_eight_b_shape_matches_the_same_weights_dequantized() {
    let Some(dir) = std::env::var_os("NANOINFER_CUDA_8B").map(PathBuf::from) else {
        eprintln!("NANOINFER_CUDA_8B is not set: GPU test skipped");
        return;
    };
    const STEPS: u32 = 32;
    let tmp = std::env::temp_dir().join(format!("ni-cuda-int4-8b-{}", std::process::id()));
    let q = tmp.join("awq-g128");
    let mode = QuantMode::Awq {
        group_size: 128,
        lm_head: false,
    };
    quantize_checkpoint(&dir, &q, mode).unwrap();
    let int4 = load(&q);
    assert_eq!(int4.decoder.weight_dtype_name(), "int4");
    let method = int4.config().quantization.expect("an int4 checkpoint");
    let dense_dir = tmp.join("dense");
    dequantized_copy_as(
        &q,
        int4.config(),
        method.method(),
        &dense_dir,
        DenseDType::BF16,
    );
    let dense = load(&dense_dir);
    eprintln!("8B int4: {}", int4.decoder.summary());
    let gold = golden(&dir);
    let mut reqs = requests(&gold, STEPS);
    let mut rng = SplitMix64::new(10);
    for len in [16, 64, 128, 512] {
        let prompt = (0..len).map(|_| 3 + rng.below(120_000) as u32).collect();
        reqs.push(RequestParams {
            prompt,
            sampling: sampling(STEPS, 5),
            ..Default::default()
        });
    }
    let got = run(&int4, SessionParams::default(), &reqs);
    let want = run(&dense, SessionParams::default(), &reqs);
    // Random weights spread the logits thinly over 128 256 tokens, so near-
    // ties are common: the first tokens must agree, later ones may flip at a
    // near-tie (checked by `check_near_within`, with the same margin).
    let near = 2.0 * NEAR_TIE;
    let mut matched = Vec::new();
    let mut worst = Vec::new();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let same = check_near_within(&format!("8B int4 prompt {i}"), g, w, near);
        let lp = |o: &Output, t: usize| o.top[t].iter().find(|e| e.0 == o.tokens[t]).unwrap().1;
        let diff = (0..same)
            .map(|t| (lp(g, t) - lp(w, t)).abs())
            .fold(0f32, f32::max);
        matched.push(same);
        worst.push(diff);
    }
    eprintln!(
        "8B int4 (AWQ g128) against the same weights in bf16: identical leading tokens \
         {matched:?} of {STEPS}; largest chosen-token logprob difference before each \
         divergence {worst:.3?}"
    );
    assert!(
        matched.iter().all(|&m| m >= 1),
        "8B int4: the first tokens differ: {matched:?}"
    );
    assert!(
        worst.iter().all(|&d| d <= near),
        "8B int4: chosen-token logprobs differ by more than {near}: {worst:?}"
    );
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// Int4 checkpoints written by our quantizer (AWQ group 128, asymmetric
/// GPTQ group 32, and act-order GPTQ group 64 calibrated on seeded random
/// tokens: its activations are gathered through `g_idx`'s permutation),
/// loaded as stored, against the same weights dequantized
/// into a bf16 model: greedy tokens and logprobs within near-ties (twice
/// the margin of bf16 against transformers). The
/// int4 kernels compute `Σ (q − z)·x` per group and scale in f32, the dense
/// model multiplies weights rounded to bf16, so the two round differently.
/// The first step (all six prompts, 320 rows) runs through the int4 GEMM
/// on sm_90 (weights rounded to f16, f32 sums; elsewhere dequantization to
/// bf16 and cuBLAS), its inputs packed by the norms and SwiGLU before it
/// (bit for bit as a packing pass packs them), the decode steps and the chunked run (≤ 32 rows) through the
/// int4 MMA kernels (8, 16 and 32-row builds); decode steps of ≤ 8 rows
/// (six prompts, or one alone) norm the residual inside the QKV and
/// gate/up kernels and add into it in the o and down kernels, except
/// act-order weights.
#[test]
fn int4_matches_the_same_weights_dequantized() {
    let Some(fx) = fixtures() else { return };
    let tmp = std::env::temp_dir().join(format!("ni-cuda-int4-{}", std::process::id()));
    for name in MODELS {
        let dir = fx.join(name);
        let gold = golden(&dir);
        let act_order = QuantizeOptions {
            calibration: Some(Calibration {
                seqs: vec![(0..256).map(|i| 3 + (i * 7919 % 4000) as u32).collect()],
            }),
            gptq: GptqOptions {
                damp: 0.01,
                act_order: true,
            },
            ..Default::default()
        };
        for (label, mode, opts) in [
            (
                "awq-g128",
                QuantMode::Awq {
                    group_size: 128,
                    lm_head: false,
                },
                None,
            ),
            (
                "gptq-g32",
                QuantMode::Gptq {
                    group_size: 32,
                    sym: false,
                    lm_head: false,
                },
                None,
            ),
            (
                "gptq-act-order-g64",
                QuantMode::Gptq {
                    group_size: 64,
                    sym: true,
                    lm_head: false,
                },
                Some(&act_order),
            ),
            // The LM head in int4 too (GPTQ's `lm_head: true`).
            (
                "gptq-g128-int4-head",
                QuantMode::Gptq {
                    group_size: 128,
                    sym: true,
                    lm_head: true,
                },
                None,
            ),
        ] {
            let q = tmp.join(format!("{name}-{label}"));
            match opts {
                None => quantize_checkpoint(&dir, &q, mode).map(|_| ()),
                Some(o) => quantize_checkpoint_with(&dir, &q, mode, o).map(|_| ()),
            }
            .unwrap();
            let int4 = load(&q);
            assert_eq!(int4.decoder.weight_dtype_name(), "int4");
            let head = if label.ends_with("int4-head") {
                "int4"
            } else {
                "bf16"
            };
            assert_eq!(int4.decoder.lm_head_dtype_name(), head);
            let method = int4.config().quantization.expect("an int4 checkpoint");
            let dense_dir = tmp.join(format!("{name}-{label}-dense"));
            dequantized_copy(&q, int4.config(), method.method(), &dense_dir);
            let dense = load_as(&dense_dir, WeightDType::BF16);
            eprintln!("{name} {label}: {}", int4.decoder.summary());
            let reqs = requests(&gold, 16);
            let got = run(&int4, SessionParams::default(), &reqs);
            let want = run(&dense, SessionParams::default(), &reqs);
            // The first step's norms and SwiGLU write the int4 GEMM's
            // packed input themselves (act-order weights excepted): the
            // same bits as packing rows in a pass of its own. And int4 runs
            // are reproducible bit for bit (decode steps' norm handoffs add
            // their sums of squares in fixed point, in any order).
            std::env::set_var("NANOINFER_CUDA_W4_PACKED_INPUTS", "0");
            let packing_pass = load(&q);
            std::env::remove_var("NANOINFER_CUDA_W4_PACKED_INPUTS");
            let got_packing_pass = run(&packing_pass, SessionParams::default(), &reqs);
            for (i, (a, b)) in got.iter().zip(&got_packing_pass).enumerate() {
                let step =
                    (0..a.top.len()).find(|&t| a.tokens[t] != b.tokens[t] || a.top[t] != b.top[t]);
                assert!(
                    step.is_none(),
                    "{name} {label} prompt {i}: a run with a packing pass differs from step \
                     {step:?} on (step 0: the packed inputs; later: not reproducible): {:?} \
                     against {:?}",
                    step.map(|t| &a.top[t]),
                    step.map(|t| &b.top[t])
                );
            }
            let chunked = SessionParams {
                prefill_chunk_size: 7,
                max_batched_tokens: 32,
                ..Default::default()
            };
            let got_chunked = run(&int4, chunked, &reqs);
            // One request alone: one-row decode steps.
            let got_alone = run(&int4, SessionParams::default(), &reqs[..1]);
            let mut matched = Vec::new();
            // Weights not rounded to bf16 on one side: twice the bf16 margin.
            let near = 2.0 * NEAR_TIE;
            // Chunked prefill also changes the batch shapes (as in
            // `batched_equals_single_and_kv_layouts_agree`): one margin more.
            let near_chunked = near + NEAR_TIE;
            for (i, w) in want.iter().enumerate() {
                let what = format!("{name} {label} prompt {i}");
                matched.push(check_near_within(&what, &got[i], w, near));
                let chunked = &got_chunked[i];
                check_near_within(&format!("{what} chunked"), chunked, w, near_chunked);
            }
            check_near_within(
                &format!("{name} {label} alone"),
                &got_alone[0],
                &want[0],
                near,
            );
            eprintln!(
                "{name} {label}: identical to the dequantized model for {matched:?} of 16 steps"
            );
            // On sm_90 the prefill's weights are rounded to f16, the dense
            // model's to bf16, so in these random models near-ties flip from
            // the first steps on: the floor only catches a model that
            // diverges at once. With f16 activations both sides hold the
            // same f16 weights (below, a third).
            let total: usize = matched.iter().sum();
            assert!(
                8 * total >= matched.len() * 16,
                "{name} {label}: too few tokens identical: {matched:?}"
            );
            // f16 activations (the kernels' other build: 1024.0 magic, f16 MMAs).
            let int4_f16 = load_as(&q, WeightDType::F16);
            let dense_f16 = load_as(&dense_dir, WeightDType::F16);
            let got = run(&int4_f16, SessionParams::default(), &reqs);
            let want = run(&dense_f16, SessionParams::default(), &reqs);
            let matched: Vec<usize> = want
                .iter()
                .enumerate()
                .map(|(i, w)| {
                    let what = format!("{name} {label} f16 prompt {i}");
                    check_near_within(&what, &got[i], w, near)
                })
                .collect();
            eprintln!("{name} {label} f16: identical for {matched:?} of 16 steps");
            let total: usize = matched.iter().sum();
            assert!(
                3 * total >= matched.len() * 16,
                "{name} {label} f16: too few tokens identical: {matched:?}"
            );
        }
    }
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// FP8 weights (`quantize --method fp8`: E4M3, 128 × 128 blocks) on the GPU
/// against the same weights dequantized into a dense checkpoint, on every
/// fixture: 16 prompts batched (prefill and decode batches above the
/// GEMV's rows dequantize for cuBLAS) and each prompt alone (decode steps
/// through the FP8 GEMVs) give the dense model's greedy ids up to
/// near-ties; `--quant fp8` at load gives the offline checkpoint's tokens
/// bit for bit; an FP8 LM head (`lm_head: true`) stays near too.
#[test]
fn fp8_matches_the_same_weights_dequantized() {
    let Some(fx) = fixtures() else { return };
    let tmp = std::env::temp_dir().join(format!("ni-cuda-fp8-{}", std::process::id()));
    for name in MODELS {
        let dir = fx.join(name);
        let reqs = requests(&golden(&dir), 16);
        for lm_head in [false, true] {
            let label = if lm_head { "fp8-head" } else { "fp8" };
            let q = tmp.join(format!("{name}-{label}"));
            quantize_checkpoint(&dir, &q, QuantMode::Fp8 { lm_head }).unwrap();
            let fp8 = load(&q);
            assert_eq!(fp8.decoder.weight_dtype_name(), "fp8");
            eprintln!("{name} {label}: {}", fp8.decoder.summary());
            let method = fp8.config().quantization.expect("an fp8 checkpoint");
            let dense_dir = tmp.join(format!("{name}-{label}-dense"));
            dequantized_copy(&q, fp8.config(), method.method(), &dense_dir);
            let dense = load_as(&dense_dir, WeightDType::BF16);
            let got = run(&fp8, SessionParams::default(), &reqs);
            let want = run(&dense, SessionParams::default(), &reqs);
            for (i, r) in reqs.iter().enumerate() {
                check_near(
                    &format!("{name} {label} prompt {i} batched"),
                    &got[i],
                    &want[i],
                );
                let alone = run(&fp8, SessionParams::default(), std::slice::from_ref(r));
                check_near(
                    &format!("{name} {label} prompt {i} alone"),
                    &alone[0],
                    &want[i],
                );
            }
            if !lm_head {
                let params = ModelParams {
                    device: Device::Cuda(0),
                    quant: QuantMode::Fp8 { lm_head },
                    ..Default::default()
                };
                let online = Arc::new(Model::load(&dir, &params, None).unwrap());
                assert_eq!(
                    run(&online, SessionParams::default(), &reqs),
                    got,
                    "{name}: --quant fp8 at load differs from the offline checkpoint"
                );
            }
        }
    }
    std::fs::remove_dir_all(&tmp).ok();
}

#[test]
fn batched_equals_single_and_kv_layouts_agree() {
    let Some(fx) = fixtures() else { return };
    for name in MODELS {
        let dir = fx.join(name);
        let model = load(&dir);
        let reqs = requests(&golden(&dir), 16);
        let paged = run(&model, SessionParams::default(), &reqs);
        let token = SessionParams {
            kv_backend: KvBackendKind::Token,
            ..Default::default()
        };
        assert_eq!(
            run(&model, token, &reqs),
            paged,
            "{name}: token and paged KV differ"
        );
        // Without logprobs, greedy rows are decoded on the GPU (argmax
        // kernel, no logits copied): the same tokens as the host sampler.
        let plain: Vec<RequestParams> = reqs
            .iter()
            .cloned()
            .map(|mut r| {
                r.sampling.logprobs = 0;
                r
            })
            .collect();
        let plain_out = run(&model, SessionParams::default(), &plain);
        for (i, (a, b)) in plain_out.iter().zip(&paged).enumerate() {
            assert_eq!(
                a.tokens, b.tokens,
                "{name} prompt {i}: GPU argmax differs from the host sampler"
            );
        }
        // Steady greedy decoding overlaps its steps (the GPU default): each
        // step is launched before the last one's ids reach the host, its
        // tokens fed on the device. The same tokens as one step at a time.
        let steady: Vec<RequestParams> = plain
            .iter()
            .cloned()
            .map(|mut r| {
                r.sampling.min_tokens = 0;
                r.sampling.ignore_eos = true;
                r
            })
            .collect();
        check_overlapped_steps(name, &model, &steady);
        // Small chunks: prefill split across steps and mixed with decodes.
        let chunked = SessionParams {
            prefill_chunk_size: 7,
            max_batched_tokens: 32,
            ..Default::default()
        };
        let chunked_out = run(&model, chunked, &reqs);
        // Other batch shapes round differently in bf16: equal up to near-ties.
        for (i, r) in reqs.iter().enumerate() {
            let alone = run(&model, SessionParams::default(), std::slice::from_ref(r));
            check_near(
                &format!("{name} prompt {i} batched vs alone"),
                &paged[i],
                &alone[0],
            );
            check_near(
                &format!("{name} prompt {i} chunked vs not"),
                &chunked_out[i],
                &paged[i],
            );
        }
    }
}

/// Speculative decoding on the GPU, n-gram lookup and a draft model (the
/// model itself, so long drafts are kept), both KV backends: with logprobs
/// (host sampling) the tokens agree with transformers up to near-ties; plain
/// greedy rows (argmax on the device, verify steps replayed from CUDA
/// graphs) agree with transformers as often as plain decoding does.
#[test]
fn speculative_greedy_matches_transformers() {
    let Some(fx) = fixtures() else { return };
    for name in MODELS {
        let dir = fx.join(name);
        let gold = golden(&dir);
        let model = load(&dir);
        let n = ids(&gold["tokens"][0]).len() as u32;
        let with_logprobs = requests(&gold, n);
        let refs = with_logprobs.len();
        let greedy: Vec<RequestParams> = with_logprobs
            .iter()
            .cloned()
            .map(|mut r| {
                r.sampling = SamplingParams {
                    max_tokens: n,
                    ignore_eos: true,
                    ..Default::default()
                };
                r
            })
            .collect();
        for kv in [KvBackendKind::Paged, KvBackendKind::Token] {
            // (method, whether it must draft: random weights do not repeat
            // their prompt, so prompt lookup finds little; the model
            // drafting for itself always drafts, and its drafts are kept)
            for (spec, drafts_itself) in [
                (SpeculativeParams::ngram(4), false),
                (SpeculativeParams::draft(model.clone(), 4), true),
            ] {
                let what = format!("{name} {kv:?} {:?}", spec.method);
                let params = SessionParams {
                    kv_backend: kv,
                    speculative: Some(SpeculativeParams {
                        max_batch: 64,
                        ..spec
                    }),
                    ..Default::default()
                };
                let (outs, st) = run_with_stats(&model, params.clone(), &with_logprobs);
                for (i, o) in outs.iter().enumerate().take(refs) {
                    check_near(&format!("{what} prompt {i}"), o, &reference(&gold, i));
                }
                let (outs, st2) = run_with_stats(&model, params, &greedy);
                let matched: Vec<usize> = (0..refs)
                    .map(|i| {
                        let want = reference(&gold, i).tokens;
                        outs[i]
                            .tokens
                            .iter()
                            .zip(&want)
                            .take_while(|(a, b)| a == b)
                            .count()
                    })
                    .collect();
                eprintln!(
                    "speculative {what}: {} of {} drafts kept; greedy identical to transformers for {matched:?} of {n}",
                    st.spec_accepted_tokens + st2.spec_accepted_tokens,
                    st.spec_draft_tokens + st2.spec_draft_tokens
                );
                if drafts_itself {
                    assert!(
                        st.spec_accepted_tokens > 0 && st2.spec_accepted_tokens > 0,
                        "{what}"
                    );
                }
                let total: usize = matched.iter().sum();
                assert!(
                    3 * total >= matched.len() * n as usize,
                    "{what}: too few tokens identical to transformers: {matched:?} of {n}"
                );
            }
        }
    }
}

#[test]
fn seeded_sampling_is_reproducible_and_swap_preemption_is_lossless() {
    let Some(fx) = fixtures() else { return };
    let dir = fx.join("llama3");
    let model = load(&dir);
    let gold = golden(&dir);
    let reqs: Vec<RequestParams> = requests(&gold, 20)
        .into_iter()
        .enumerate()
        .map(|(i, mut r)| {
            r.sampling.temperature = 0.8;
            r.sampling.top_p = 0.9;
            r.sampling.seed = Some(100 + i as u64);
            r
        })
        .collect();
    let a = run(&model, SessionParams::default(), &reqs);
    let b = run(&model, SessionParams::default(), &reqs);
    assert_eq!(a, b, "seeded sampling on CUDA is not reproducible");
    // A KV cache too small for all requests at once forces preemptions; swap
    // must bring back exactly the same KV, so greedy outputs do not change.
    let greedy = requests(&gold, 20);
    let roomy = run(&model, SessionParams::default(), &greedy);
    let tight = SessionParams {
        block_size: 16,
        ..Default::default()
    };
    check_swap_is_lossless(&model, tight, &greedy, &roomy, "swap preemption");
}

/// Runs `reqs` in a 320-token cache with swap preemption (the rest of the
/// session as `params`): it must swap, and every output must match `roomy`,
/// the same requests run with room to spare.
fn check_swap_is_lossless(
    model: &Arc<Model>,
    params: SessionParams,
    reqs: &[RequestParams],
    roomy: &[Output],
    what: &str,
) {
    let tight = SessionParams {
        kv_capacity_tokens: 320,
        preemption: nanoinfer::engine::PreemptionMode::Swap,
        ..params
    };
    let (swapped, st) = run_with_stats(model, tight, reqs);
    assert!(
        st.preemptions > 0 && st.swapped_in_tokens > 0,
        "{what}: the tight cache should have swapped: {st:?}"
    );
    for (i, (x, y)) in roomy.iter().zip(&swapped).enumerate() {
        check_near(&format!("prompt {i} {what}"), y, x);
    }
}

/// Logits rows with the shapes sampling meets: peaked and flat rows, and
/// rows rounded to steps of 1/4 so that many tokens tie.
fn random_logits(rng: &mut SplitMix64, rows: usize, vocab: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * vocab);
    for r in 0..rows {
        let scale = [4.0f32, 1.0, 0.3][r % 3];
        let ties = r % 4 == 3;
        for _ in 0..vocab {
            // Sum of uniforms: roughly normal.
            let z = (0..4)
                .map(|_| rng.below(1 << 20) as f32 / (1 << 20) as f32)
                .sum::<f32>()
                - 2.0;
            let l = z * scale * 3.0;
            out.push(if ties { (l * 4.0).round() / 4.0 } else { l });
        }
    }
    out
}

/// One sampling configuration per stage of the chain, and all of them
/// together: what the GPU sampler tests run over random logits.
fn stage_cases() -> Vec<(&'static str, SamplingParams)> {
    let with = |f: &dyn Fn(&mut SamplingParams)| {
        let mut p = SamplingParams::default();
        f(&mut p);
        p
    };
    vec![
        (
            "greedy + penalties + bias",
            with(&|p| {
                p.repetition_penalty = 1.3;
                p.presence_penalty = 0.5;
                p.frequency_penalty = 0.3;
                p.logit_bias = vec![(5, 3.0), (17, -100.0)];
            }),
        ),
        ("temperature", with(&|p| p.temperature = 0.9)),
        (
            "top-k 40",
            with(&|p| {
                p.temperature = 1.0;
                p.top_k = 40;
            }),
        ),
        (
            "top-p 0.9",
            with(&|p| {
                p.temperature = 0.8;
                p.top_p = 0.9;
            }),
        ),
        (
            "min-p 0.05",
            with(&|p| {
                p.temperature = 1.1;
                p.min_p = 0.05;
            }),
        ),
        // More candidates than the kernel sorts in shared memory: the
        // radix selection over the whole row.
        (
            "top-k 6000",
            with(&|p| {
                p.temperature = 1.0;
                p.top_k = 6000;
            }),
        ),
        (
            "top-p 0.999",
            with(&|p| {
                p.temperature = 1.5;
                p.top_p = 0.999;
            }),
        ),
        (
            "all stages",
            with(&|p| {
                p.temperature = 0.7;
                p.top_k = 200;
                p.top_p = 0.95;
                p.min_p = 0.02;
                p.repetition_penalty = 1.2;
                p.frequency_penalty = 0.2;
                p.logit_bias = vec![(3, 1.0)];
            }),
        ),
    ]
}

#[test]
fn gpu_sampler_picks_the_cpu_samplers_tokens() {
    if fixtures().is_none() {
        return;
    }
    let dev = CudaDevice::open(0, ActDType::BF16).expect("CUDA device");
    let cases = stage_cases();
    let mut rng = SplitMix64::new(7);
    let mut report = String::new();
    for vocab in [32_000usize, 151_936] {
        let rows = 48;
        for (name, params) in &cases {
            let logits = random_logits(&mut rng, rows, vocab);
            let mut batch = DeviceSampling::default();
            let mut want = Vec::new();
            for r in 0..rows {
                let prompt: Vec<u32> = (0..50).map(|_| rng.below(vocab) as u32).collect();
                let output: Vec<u32> = (0..30).map(|_| rng.below(64) as u32).collect();
                let suppress = [1u32, 2];
                let row = &logits[r * vocab..(r + 1) * vocab];
                let mut host = Sampler::new(params, 1000 + r as u64);
                let mut processed = row.to_vec();
                want.push(
                    host.sample(&mut processed, &prompt, &output, &suppress)
                        .unwrap()
                        .token,
                );
                Sampler::new(params, 1000 + r as u64)
                    .push_device_row(vocab, &prompt, &output, &suppress, &mut batch);
            }
            // The stages are the same; only exp rounding at a draw's
            // boundary may tip a row to its neighbour.
            let need = if params.temperature == 0.0 {
                rows
            } else {
                rows - 2
            };
            let mut check = |what: &str, got: &[u32], want: &[u32]| {
                let same = got.iter().zip(want).filter(|(a, b)| a == b).count();
                report += &format!("{name} (vocab {vocab}){what}: {same}/{rows} rows agree\n");
                assert!(
                    same >= need,
                    "{name}, vocab {vocab}{what}: GPU {got:?}\nCPU {want:?}"
                );
            };
            let got = sample_logits(&dev, &logits, vocab, &batch).expect("GPU sampling");
            check("", &got, &want);
            let again = sample_logits(&dev, &logits, vocab, &batch).expect("GPU sampling");
            assert_eq!(got, again, "{name}: GPU sampling is not reproducible");
            // Rows launched before their last output token was known
            // (overlapped steps): the kernel counts that token, the id the
            // previous launch left, in the penalties. Half of them repeat an
            // earlier output token, half are new.
            let mut pending = DeviceSampling::default();
            let mut previous = Vec::new();
            let mut want = Vec::new();
            for r in 0..rows {
                let prompt: Vec<u32> = (0..50).map(|_| rng.below(vocab) as u32).collect();
                let mut output: Vec<u32> = (0..30).map(|_| rng.below(64) as u32).collect();
                let last = if r % 2 == 0 {
                    output[rng.below(output.len())]
                } else {
                    1000 + rng.below(vocab - 1000) as u32
                };
                output.push(last);
                let row = &logits[r * vocab..(r + 1) * vocab];
                let mut host = Sampler::new(params, 2000 + r as u64);
                let mut processed = row.to_vec();
                want.push(
                    host.sample(&mut processed, &prompt, &output, &[])
                        .unwrap()
                        .token,
                );
                let mut device = Sampler::new(params, 2000 + r as u64);
                let before = &output[..output.len() - 1];
                device.push_device_row(vocab, &prompt, before, &[], &mut pending);
                device.mark_pending(&mut pending);
                previous.push(last);
            }
            let got = sample_logits_after(&dev, &logits, vocab, &pending, &previous)
                .expect("GPU sampling");
            check(", pending token", &got, &want);
        }
    }
    eprintln!("{report}");
}

/// Row `r`'s allowed tokens, of the shapes grammars give: a few scattered
/// tokens, most of the vocabulary, one token (end-of-sequence once a
/// grammar is complete), a run of neighbouring ids.
fn random_mask(rng: &mut SplitMix64, r: usize, vocab: usize) -> Vec<bool> {
    match r % 4 {
        0 => (0..vocab).map(|_| rng.below(100) == 0).collect(),
        1 => (0..vocab).map(|_| rng.below(10) != 0).collect(),
        2 => (0..vocab).map(|t| t == vocab - 1).collect(),
        _ => {
            let start = rng.below(vocab - 300);
            (0..vocab)
                .map(|t| (start..start + 300).contains(&t))
                .collect()
        }
    }
}

#[test]
fn gpu_sampler_applies_grammar_masks_before_every_stage_like_the_cpu() {
    if fixtures().is_none() {
        return;
    }
    let dev = CudaDevice::open(0, ActDType::BF16).expect("CUDA device");
    let mut cases = vec![("greedy", SamplingParams::default())];
    cases.extend(stage_cases());
    let mut rng = SplitMix64::new(11);
    let mut report = String::new();
    for vocab in [32_000usize, 151_936] {
        let rows = 48;
        for (name, params) in &cases {
            let logits = random_logits(&mut rng, rows, vocab);
            let mut batch = DeviceSampling::default();
            let mut masks = Vec::new();
            let mut want = Vec::new();
            for r in 0..rows {
                let prompt: Vec<u32> = (0..50).map(|_| rng.below(vocab) as u32).collect();
                let output: Vec<u32> = (0..30).map(|_| rng.below(64) as u32).collect();
                let suppress = [1u32, 2];
                let allowed = random_mask(&mut rng, r, vocab);
                // The CPU sampler's grammar stage: -inf for every token the
                // mask forbids, before the others (`GrammarMask::apply`,
                // whose packing a unit test checks bit for bit).
                let mut processed = logits[r * vocab..(r + 1) * vocab].to_vec();
                for (l, &ok) in processed.iter_mut().zip(&allowed) {
                    if !ok {
                        *l = f32::NEG_INFINITY;
                    }
                }
                let mut host = Sampler::new(params, 3000 + r as u64);
                let token = host
                    .sample(&mut processed, &prompt, &output, &suppress)
                    .unwrap()
                    .token;
                assert!(allowed[token as usize], "{name}: the CPU broke its mask");
                want.push(token);
                Sampler::new(params, 3000 + r as u64)
                    .push_device_row(vocab, &prompt, &output, &suppress, &mut batch);
                batch.rows.last_mut().unwrap().masked = true;
                let mut words = vec![0u32; mask_words(vocab)];
                for t in (0..vocab).filter(|&t| allowed[t]) {
                    words[t / 32] |= 1 << (t % 32);
                }
                masks.extend(words);
            }
            let previous = vec![0; rows];
            let got = sample_logits_masked(&dev, &logits, vocab, &batch, &previous, &masks)
                .expect("GPU sampling");
            let same = got.iter().zip(&want).filter(|(a, b)| a == b).count();
            report += &format!("{name} (vocab {vocab}), masked: {same}/{rows} rows agree\n");
            for (r, &t) in got.iter().enumerate() {
                let allowed = masks[r * mask_words(vocab) + t as usize / 32] >> (t % 32) & 1;
                assert_eq!(
                    allowed, 1,
                    "{name}, vocab {vocab}: row {r} got forbidden token {t}"
                );
            }
            // As unmasked: only exp rounding at a draw's boundary may tip
            // a sampled row to its neighbour.
            let need = if params.temperature == 0.0 {
                rows
            } else {
                rows - 2
            };
            assert!(
                same >= need,
                "{name}, vocab {vocab}: GPU {got:?}\nCPU {want:?}"
            );
        }
    }
    eprintln!("{report}");
}

/// A model with a tokenizer for structured output
/// (`NANOINFER_CUDA_GRAMMAR_MODEL`; scripts/cuda_device_run.sh `grammar`
/// makes one): the fixtures have none.
fn grammar_model() -> Option<PathBuf> {
    let dir = std::env::var_os("NANOINFER_CUDA_GRAMMAR_MODEL").map(PathBuf::from);
    if dir.is_none() {
        eprintln!("NANOINFER_CUDA_GRAMMAR_MODEL is not set: GPU structured-output test skipped");
    }
    dir
}

#[test]
fn constrained_rows_sampled_on_the_gpu_match_host_sampling() {
    let Some(dir) = grammar_model() else { return };
    let model = load(&dir);
    let mut report = String::new();
    for greedy in [true, false] {
        check_constrained_on_gpu(&model, greedy, &mut report);
    }
    eprintln!("{report}");
}

/// Constrained requests (a JSON Schema, a regex, choices) in one batch
/// with an unconstrained and a logprobs row, generated with device and with
/// host sampling: the outputs keep their constraints, and greedy ones are
/// the same tokens (the same logits, step for step); seeded sampled ones
/// differ only where exp rounding tips a draw.
fn check_constrained_on_gpu(model: &Arc<Model>, greedy: bool, report: &mut String) {
    use nanoinfer::engine::{Constraint, FinishReason};
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"enum": [1, 2, 3]}},
        "required": ["color", "n"],
        "additionalProperties": false
    });
    let constraints = [
        Constraint::JsonSchema(schema.to_string()),
        Constraint::Regex("[0-9]{4}-[a-f]{2,6}".into()),
        Constraint::Choice(vec!["yes".into(), "no".into(), "maybe not".into()]),
    ];
    let vocab = model.config().vocab_size as u64;
    let reqs: Vec<RequestParams> = (0..24u64)
        .map(|i| RequestParams {
            prompt: (0..20 + i)
                .map(|j| ((i * 131 + j * 7) % (vocab - 10) + 5) as u32)
                .collect(),
            sampling: SamplingParams {
                max_tokens: 48,
                temperature: if greedy { 0.0 } else { 0.8 },
                top_k: if i % 4 == 1 { 20 } else { 0 },
                repetition_penalty: if i % 3 == 0 { 1.2 } else { 1.0 },
                logprobs: if i == 5 { 2 } else { 0 },
                // Unconstrained rows run to max_tokens either way, so the
                // batches stay alike while the constrained rows agree.
                ignore_eos: i % 6 == 3,
                seed: Some(900 + i),
                ..Default::default()
            },
            constraint: (i % 6 != 3).then(|| constraints[i as usize % 3].clone()),
            ..Default::default()
        })
        .collect();
    let generate = |params: SessionParams| {
        let mut s = Session::new(model.clone(), params).expect("session");
        let ids: Vec<u64> = reqs
            .iter()
            .map(|r| s.add_request(r.clone()).unwrap())
            .collect();
        let mut out: HashMap<u64, (Vec<u32>, String, Option<FinishReason>)> = HashMap::new();
        while s.has_work() {
            for ev in s.step().expect("step") {
                let o = out.entry(ev.request_id).or_default();
                o.0.extend(&ev.tokens);
                o.1.push_str(&ev.text);
                o.2 = ev.finish.clone();
            }
        }
        s.check_invariants().expect("invariants");
        ids.iter()
            .map(|id| out.remove(id).unwrap())
            .collect::<Vec<_>>()
    };
    let device = generate(SessionParams::default());
    let host = generate(SessionParams {
        device_sampling: false,
        ..Default::default()
    });
    let (mut agree, mut total) = (0, 0);
    for (i, ((dt, text, finish), (ht, _, _))) in device.iter().zip(&host).enumerate() {
        let r = &reqs[i];
        let Some(c) = &r.constraint else { continue };
        let finish = finish.as_ref().expect("a terminal event");
        match c {
            // Whitespace between JSON tokens is free, so a random model
            // may not close the object within max_tokens.
            Constraint::JsonSchema(_) => match finish {
                FinishReason::Eos => {
                    let v: Value =
                        serde_json::from_str(text).unwrap_or_else(|e| panic!("{text}: {e}"));
                    assert!(jsonschema::is_valid(&schema, &v), "request {i}: {text}");
                }
                FinishReason::LengthUnfinished => {}
                f => panic!("request {i} ended with {f:?}: {text:?}"),
            },
            Constraint::Regex(_) => {
                assert_eq!(finish, &FinishReason::Eos, "request {i}: {text:?}");
                let (digits, hex) = text.split_once('-').expect("a dash");
                assert!(
                    digits.len() == 4 && digits.bytes().all(|b| b.is_ascii_digit()),
                    "{text}"
                );
                assert!(
                    (2..=6).contains(&hex.len()) && hex.bytes().all(|b| (b'a'..=b'f').contains(&b)),
                    "{text}"
                );
            }
            Constraint::Choice(cs) => {
                assert_eq!(finish, &FinishReason::Eos, "request {i}: {text:?}");
                assert!(cs.contains(text), "request {i}: {text}");
            }
            Constraint::Lark(_) => unreachable!(),
        }
        if greedy {
            assert_eq!(dt, ht, "request {i}: greedy on the GPU and on the host");
        }
        total += dt.len();
        agree += dt.iter().zip(ht).take_while(|(a, b)| a == b).count();
    }
    *report += &format!(
        "constrained rows ({}), GPU vs host sampling: {agree}/{total} tokens before the first divergence\n",
        if greedy { "greedy" } else { "sampled" }
    );
    assert!(
        agree * 10 >= total * 9,
        "GPU and host constrained sampling diverge early: {agree}/{total}"
    );
}

#[test]
fn sessions_sample_on_the_gpu_reproducibly_and_like_the_host() {
    let Some(fx) = fixtures() else { return };
    let dir = fx.join("llama3");
    let model = load(&dir);
    let gold = golden(&dir);
    let reqs: Vec<RequestParams> = requests(&gold, 24)
        .into_iter()
        .enumerate()
        .map(|(i, mut r)| {
            let s = &mut r.sampling;
            // Every third request wants logprobs: the host samples it from
            // the logits the device returns, in the same batch.
            s.logprobs = if i % 3 == 0 { 3 } else { 0 };
            s.temperature = 0.9;
            s.top_k = 50;
            s.top_p = 0.9;
            s.repetition_penalty = 1.1;
            s.seed = Some(500 + i as u64);
            r
        })
        .collect();
    let device = run(&model, SessionParams::default(), &reqs);
    let again = run(&model, SessionParams::default(), &reqs);
    assert_eq!(
        device, again,
        "seeded sampling on the GPU is not reproducible"
    );
    let host_params = SessionParams {
        device_sampling: false,
        ..Default::default()
    };
    let host = run(&model, host_params, &reqs);
    for (i, (d, h)) in device.iter().zip(&host).enumerate() {
        if reqs[i].sampling.logprobs > 0 {
            assert_eq!(d.top.len(), d.tokens.len(), "request {i}: logprobs missing");
            assert_eq!(
                d.tokens, h.tokens,
                "request {i}: sampled on the host both times"
            );
        } else {
            assert!(d.top.is_empty(), "request {i} asked for no logprobs");
        }
    }
    let (mut agree, mut total) = (0, 0);
    for (d, h) in device.iter().zip(&host) {
        total += d.tokens.len();
        agree += d
            .tokens
            .iter()
            .zip(&h.tokens)
            .take_while(|(a, b)| a == b)
            .count();
    }
    eprintln!("GPU vs host sampling: {agree}/{total} tokens before the first divergence");
    assert!(
        agree * 10 >= total * 9,
        "GPU and host sampling diverge early: {agree}/{total}"
    );
    // Sampled rows without logprobs overlap their steps (the GPU default):
    // each row draws its uniform as it is launched, and its penalties count
    // the token the device feeds in (repetition 1.1 everywhere, presence and
    // frequency on every other request), so seeded outputs are those of one
    // step at a time.
    let steady: Vec<RequestParams> = reqs
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, mut r)| {
            let s = &mut r.sampling;
            s.logprobs = 0;
            if i % 2 == 1 {
                s.presence_penalty = 0.25;
                s.frequency_penalty = 0.5;
            }
            s.min_tokens = 0;
            s.ignore_eos = true;
            r
        })
        .collect();
    check_overlapped_steps("llama3 sampled", &model, &steady);
}

/// `reqs` with overlapped steps (the GPU default) give the outputs of one
/// step at a time, and steps did chain.
fn check_overlapped_steps(what: &str, model: &Arc<Model>, reqs: &[RequestParams]) {
    let (overlapped, st) = run_with_stats(model, SessionParams::default(), reqs);
    assert!(st.chained_steps > 8, "{what}: {st:?}");
    let one_at_a_time = SessionParams {
        overlap_steps: Some(false),
        ..Default::default()
    };
    let (serial, st) = run_with_stats(model, one_at_a_time, reqs);
    assert_eq!(st.chained_steps, 0);
    assert_eq!(overlapped, serial, "{what}: overlapped steps differ");
}

#[test]
fn long_context_attention_splits_match_the_unsplit_result() {
    let Some(fx) = fixtures() else { return };
    let dir = fx.join("qwen3");
    let model = load(&dir);
    // 3000 tokens: decode steps attend over many splits, prefill over one.
    let prompt: Vec<u32> = (0..3000u32).map(|i| 3 + (i * 7919) % 4000).collect();
    let req = RequestParams {
        prompt: prompt.clone(),
        sampling: sampling(8, 5),
        ..Default::default()
    };
    let decoded = run(&model, SessionParams::default(), std::slice::from_ref(&req));
    // Reference: each continuation token recomputed as part of a prefill
    // (one row per position, few splits) must agree with the decode step.
    let mut full = prompt;
    full.extend(&decoded[0].tokens[..7]);
    let again = RequestParams {
        prompt: full,
        sampling: sampling(1, 5),
        ..Default::default()
    };
    let params = SessionParams {
        prefill_chunk_size: 4096,
        max_batched_tokens: 4096,
        ..Default::default()
    };
    let last = run(&model, params, std::slice::from_ref(&again));
    assert_eq!(
        last[0].tokens[0], decoded[0].tokens[7],
        "decode at 3k context differs from prefill"
    );
}

/// Random int4 weights in the kernels' layout: any bits are valid nibbles,
/// random zero points and f16 scales of 2⁻¹⁰..2⁻⁴.
fn random_w4(rng: &mut SplitMix64, rows: usize, cols: usize, group: usize) -> W4Host {
    let mut next = || rng.next_u64();
    let words = (0..rows * cols / 8).map(|_| next() as u32).collect();
    let sz = (0..rows / 16 * cols.div_ceil(group) * 16)
        .map(|_| {
            let r = next();
            let scale = 2f32.powf(-10.0 + 6.0 * (r % 1000) as f32 / 1000.0);
            half::f16::from_f32(scale).to_bits() as u32 | ((r >> 32) as u32 % 16) << 16
        })
        .collect();
    W4Host {
        rows,
        cols,
        group,
        words,
        sz,
        perm: None,
    }
}

#[test]
fn int4_gemm_matches_the_exact_product() {
    if fixtures().is_none() {
        return;
    }
    for act in [ActDType::BF16, ActDType::F16] {
        let mut dev = CudaDevice::open(0, act).expect("CUDA device");
        if !dev.w4_gemm_available() {
            eprintln!(
                "{}: no int4 tensor-core GEMM on this GPU: skipped",
                dev.name
            );
            return;
        }
        let mut rng = SplitMix64::new(11);
        // (weight rows, inputs, group, activation rows), each with the
        // blocks chosen per product and with every block shape, one block per
        // tile and by stream-K (which splits tiles among blocks): partial
        // blocks of weight rows (8208 rows: 2 × 128 rows a warpgroup; 208:
        // 1 ×) and of activation rows (tall blocks of 256 with one or both
        // 128-row halves partial), one-chunk inputs, groups of 32, 64 and
        // 128. 400 × 14336 at 129 rows runs stream-K on an H100: 4 tiles of
        // 224 chunks shared out by 132 blocks, ~33 pieces a tile. 8208 × 256
        // at 640 rows runs tall blocks then narrow ones: a wave of 132 tall
        // tiles (44 blocks of weight rows × 3), then the other 21 blocks of
        // weight rows (the last partial) as 105 narrow tiles. Split-K: 300
        // rows of 384 × 512 in 24 blocks (6 tiles, 8 chunks: 2 a block),
        // 400 × 14336 at 129 rows in 16. 48 rows: one partial block of
        // activation rows (on sm_90 batches from 49 rows take the GEMM).
        for (n, k, group, rows) in [
            (8208, 256, 64, 640),
            (208, 192, 32, 129),
            (384, 512, 128, 300),
            (128, 64, 32, 1000),
            (400, 14336, 128, 129),
            (4096, 4096, 128, 48),
        ] {
            let host = random_w4(&mut rng, n, k, group);
            let w = W4Matrix::upload(&dev, std::slice::from_ref(&host), None).unwrap();
            let xs: Vec<u16> = act.encode(
                &(0..rows * k)
                    .map(|_| (rng.next_u64() % 2001) as f32 / 1000.0 - 1.0)
                    .collect::<Vec<f32>>(),
            );
            let mut x = dev.alloc::<u16>(rows * k).unwrap();
            dev.upload(&xs, &mut x).unwrap();
            let (mut y, y_cublas, dense, xp) = (
                dev.alloc::<u16>(rows * n).unwrap(),
                dev.alloc::<u16>(rows * n).unwrap(),
                dev.alloc::<u16>(n * k).unwrap(),
                dev.alloc::<u16>(dev.w4_gemm_scratch_elems(rows, k))
                    .unwrap(),
            );
            dev.w4_dequant(&w, dense.ptr()).unwrap();
            dev.gemm(
                x.ptr(),
                dense.ptr(),
                y_cublas.ptr(),
                rows,
                n,
                k,
                GemmDType::Act,
            )
            .unwrap();
            let download = |dev: &CudaDevice, b: &nanoinfer::backend::cuda::DeviceBuffer<u16>| {
                let mut v = vec![0u16; rows * n];
                dev.download(b, &mut v).unwrap();
                v.iter().map(|&bits| act.decode(bits)).collect::<Vec<f32>>()
            };
            let cublas = download(&dev, &y_cublas);
            let mut runs = Vec::new();
            for blocks in [
                W4GemmBlocks::Auto,
                W4GemmBlocks::Narrow,
                W4GemmBlocks::Wide,
                W4GemmBlocks::Tall,
                W4GemmBlocks::WideStreamK,
                W4GemmBlocks::TallStreamK,
                W4GemmBlocks::TallThenNarrow,
                W4GemmBlocks::TallSplitK,
            ] {
                Arc::get_mut(&mut dev)
                    .expect("the test holds the device's only reference")
                    .set_w4_gemm_blocks(blocks);
                // NaN everywhere first: an output no block writes fails.
                dev.upload(&vec![0xffffu16; rows * n], &mut y).unwrap();
                dev.w4_gemm(x.ptr(), rows, &w, y.ptr(), xp.ptr()).unwrap();
                let got = download(&dev, &y);
                // Stream-K splits some of these products' tiles among
                // blocks; the sums of a split tile are added in a fixed
                // order, and the launch leaves its counters ready for the next.
                dev.w4_gemm(x.ptr(), rows, &w, y.ptr(), xp.ptr()).unwrap();
                let again = download(&dev, &y);
                assert!(
                    got.iter()
                        .zip(&again)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{n}x{k} g{group}, {rows} rows, {blocks:?}: a second run differs"
                );
                runs.push((blocks, got));
            }
            // The exact product of the stored activations and (q − z)·s, and
            // Σ|x·w| (what rounding the weights can move it by).
            let xf: Vec<f64> = xs.iter().map(|&b| act.decode(b) as f64).collect();
            let wf: Vec<Vec<f32>> = (0..n).map(|r| host.row_to_f32(r)).collect();
            let (exact, magnitude): (Vec<f64>, Vec<f64>) = (0..rows * n)
                .map(|i| {
                    let (xr, wr) = (&xf[i / n * k..][..k], &wf[i % n]);
                    xr.iter().zip(wr).fold((0.0, 0.0), |(s, m), (a, &b)| {
                        (s + a * b as f64, m + (a * b as f64).abs())
                    })
                })
                .unzip();
            let rms = (exact.iter().map(|v| v * v).sum::<f64>() / exact.len() as f64).sqrt();
            assert!(rms > 0.0, "{n}x{k} g{group}: the product is all zeros");
            let max_err = |v: &[f32]| {
                v.iter()
                    .zip(&exact)
                    .map(|(&a, b)| (a as f64 - b).abs() / rms)
                    .fold(0.0, f64::max)
            };
            // The GEMM multiplies f16 weights, each within 2⁻¹¹ of (q − z)·s, sums
            // in f32 and rounds each output once to the activation dtype.
            let half_ulp = if act == ActDType::BF16 {
                1.0 / 256.0
            } else {
                1.0 / 2048.0
            };
            for (blocks, got) in &runs {
                let bad: Vec<usize> = (0..got.len())
                    .filter(|&i| {
                        let bound =
                            half_ulp * exact[i].abs() + (1.0 / 2048.0 + 1e-5) * magnitude[i];
                        let err = (got[i] as f64 - exact[i]).abs();
                        err.is_nan() || err > bound * 1.01 + 1e-9
                    })
                    .collect();
                eprintln!(
                    "{} {n}x{k} g{group}, {rows} rows, {blocks:?}: max error / rms {:.2e} \
                     (dequantize + cuBLAS {:.2e})",
                    act.name(),
                    max_err(got),
                    max_err(&cublas)
                );
                assert!(
                    bad.is_empty(),
                    "{} {n}x{k} g{group}, {rows} rows, {blocks:?}: {} of {} outputs off the exact \
                     product (first: row {}, column {}: {} against {})",
                    act.name(),
                    bad.len(),
                    got.len(),
                    bad[0] / n,
                    bad[0] % n,
                    got[bad[0]],
                    exact[bad[0]]
                );
            }
            // The fused kernel's f32 output (an int4 LM head's logits), for
            // batches it takes: only the f32 sums' rounding.
            if rows <= 48 {
                let yf = dev.alloc::<f32>(rows * n).unwrap();
                let out = W4Out::F32 { y: yf.ptr() };
                dev.w4_mm(x.ptr(), rows, &w, out, W4Norm::None).unwrap();
                let mut got = vec![0f32; rows * n];
                dev.download(&yf, &mut got).unwrap();
                let bad = (0..got.len())
                    .filter(|&i| {
                        let err = (got[i] as f64 - exact[i]).abs();
                        err.is_nan() || err > 1e-4 * magnitude[i] + 1e-9
                    })
                    .count();
                eprintln!(
                    "{} {n}x{k} g{group}, {rows} rows, f32 out: max error / rms {:.2e}",
                    act.name(),
                    max_err(&got)
                );
                assert_eq!(bad, 0, "{n}x{k} g{group}, {rows} rows: f32 outputs off");
            }
        }
    }
}

/// The kernels before int4 GEMM products write its packed input
/// themselves (`add_rms_norm_w4g`, `silu_mul_w4g`): bit for bit what
/// `add_rms_norm` or `silu_mul` then `w4_gemm_pack_x` write, zero rows past
/// the batch included (their bytes start as 0xff).
#[test]
fn int4_gemm_inputs_packed_by_the_norm_and_swiglu_match_the_packing_pass() {
    if fixtures().is_none() {
        return;
    }
    for act in [ActDType::BF16, ActDType::F16] {
        let dev = CudaDevice::open(0, act).expect("CUDA device");
        if !dev.w4_gemm_available() {
            return;
        }
        let k = &dev.kernels;
        let mut rng = SplitMix64::new(5);
        let mut random = |n: usize, scale: f32| {
            let v: Vec<f32> = (0..n)
                .map(|_| ((rng.next_u64() % 2001) as f32 / 1000.0 - 1.0) * scale)
                .collect();
            act.encode(&v)
        };
        let upload = |v: &[u16]| {
            let mut b = dev.alloc::<u16>(v.len()).unwrap();
            dev.upload(v, &mut b).unwrap();
            b
        };
        let download = |b: &nanoinfer::backend::cuda::DeviceBuffer<u16>| {
            let mut v = vec![0u16; b.len()];
            dev.download(b, &mut v).unwrap();
            v
        };
        let poisoned = |n: usize| upload(&vec![0xffffu16; n]);
        // Packs `rows` rows of `cols` at x the kernels' way, into a fresh buffer.
        let pack = |x: u64, rows: usize, cols: usize| {
            let xp = poisoned(w4_packed_rows(rows) * cols);
            dev.launch(
                &k.w4_gemm_pack_x,
                (w4_packed_blocks(rows, cols), 1, 1),
                W4_PACKED_THREADS,
                &[
                    KArg::Ptr(x),
                    KArg::Ptr(0),
                    KArg::Ptr(xp.ptr()),
                    KArg::I32(rows as i32),
                    KArg::I32(cols as i32),
                ],
            )
            .unwrap();
            download(&xp)
        };
        let check = |what: &str, fused: &[u16], pass: &[u16]| {
            let diff = fused.iter().zip(pass).position(|(a, b)| a != b);
            assert!(
                diff.is_none(),
                "{} {what}: element {} is {:#06x} packed in the kernel, {:#06x} by a packing pass",
                act.name(),
                diff.unwrap_or(0),
                fused[diff.unwrap_or(0)],
                pass[diff.unwrap_or(0)]
            );
        };
        // 200 and 256 rows: a partial block of 128 and whole ones.
        for (rows, d, inter) in [(200, 4096, 1024), (256, 2048, 14336)] {
            let (residual, delta, weight) =
                (random(rows * d, 4.0), random(rows * d, 1.0), random(d, 1.0));
            for with_delta in [false, true] {
                let (res_rows, res_fused) = (upload(&residual), upload(&residual));
                let (delta, weight) = (upload(&delta), upload(&weight));
                let delta_ptr = if with_delta { delta.ptr() } else { 0 };
                let normed = poisoned(rows * d);
                dev.launch(
                    &k.add_rms_norm,
                    (rows as u32, 1, 1),
                    512,
                    &[
                        KArg::Ptr(res_rows.ptr()),
                        KArg::Ptr(delta_ptr),
                        KArg::Ptr(0),
                        KArg::Ptr(weight.ptr()),
                        KArg::Ptr(normed.ptr()),
                        KArg::I32(d as i32),
                        KArg::F32(1e-5),
                    ],
                )
                .unwrap();
                let xp = poisoned(w4_packed_rows(rows) * d);
                dev.launch(
                    &k.add_rms_norm_w4g,
                    (w4_packed_rows(rows) as u32, 1, 1),
                    512,
                    &[
                        KArg::Ptr(res_fused.ptr()),
                        KArg::Ptr(delta_ptr),
                        KArg::Ptr(weight.ptr()),
                        KArg::Ptr(xp.ptr()),
                        KArg::I32(rows as i32),
                        KArg::I32(d as i32),
                        KArg::F32(1e-5),
                    ],
                )
                .unwrap();
                let what = format!("norm of {rows} x {d}, delta {with_delta}");
                check(&what, &download(&xp), &pack(normed.ptr(), rows, d));
                check(
                    &format!("{what}: residual"),
                    &download(&res_fused),
                    &download(&res_rows),
                );
            }
            let gate_up = upload(&random(rows * 2 * inter, 6.0));
            let act_rows = poisoned(rows * inter);
            dev.launch(
                &k.silu_mul,
                (inter.div_ceil(8 * 256) as u32, rows as u32, 1),
                256,
                &[
                    KArg::Ptr(gate_up.ptr()),
                    KArg::Ptr(act_rows.ptr()),
                    KArg::I32(inter as i32),
                ],
            )
            .unwrap();
            let xp = poisoned(w4_packed_rows(rows) * inter);
            dev.launch(
                &k.silu_mul_w4g,
                (w4_packed_blocks(rows, inter), 1, 1),
                W4_PACKED_THREADS,
                &[
                    KArg::Ptr(gate_up.ptr()),
                    KArg::Ptr(xp.ptr()),
                    KArg::I32(rows as i32),
                    KArg::I32(inter as i32),
                ],
            )
            .unwrap();
            let what = format!("SwiGLU of {rows} x {inter}");
            check(&what, &download(&xp), &pack(act_rows.ptr(), rows, inter));
        }
    }
}

#[test]
fn tensor_core_decode_attention_matches_the_cuda_core_kernel() {
    let Some(fx) = fixtures() else { return };
    // Contexts that end mid-way through a 16-key step, one of several
    // splits (700 tokens) and a batch of them: head_dim 64 and 128.
    let prompt = |len: u32, salt: u32| -> Vec<u32> {
        (0..len)
            .map(|i| 3 + (i * 7919 + salt * 104_729) % 4000)
            .collect()
    };
    let reqs: Vec<RequestParams> = [(5, 1), (37, 2), (700, 3), (130, 4)]
        .iter()
        .map(|&(len, salt)| RequestParams {
            prompt: prompt(len, salt),
            sampling: sampling(12, 5),
            ..Default::default()
        })
        .collect();
    for name in ["llama3", "qwen3"] {
        let dir = fx.join(name);
        let mma = run(&load(&dir), SessionParams::default(), &reqs);
        std::env::set_var("NANOINFER_CUDA_DECODE_MMA", "0");
        let simt_model = load(&dir);
        std::env::remove_var("NANOINFER_CUDA_DECODE_MMA");
        let simt = run(&simt_model, SessionParams::default(), &reqs);
        for (i, (a, b)) in mma.iter().zip(&simt).enumerate() {
            let same = check_near(&format!("{name} request {i}"), a, b);
            eprintln!("{name} request {i}: {same}/12 identical tokens");
        }
        // One request alone: the single-row (most splits) path.
        let alone = run(&load(&dir), SessionParams::default(), &reqs[2..3]);
        check_near(&format!("{name} alone"), &alone[0], &simt[2]);
    }
}

#[test]
fn cuda_device_errors_are_clear() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny-llama3");
    let params = ModelParams {
        device: Device::Cuda(0),
        ..Default::default()
    };
    match Model::load(&dir, &params, None) {
        Err(e) if fixtures_present() => panic!("CUDA load failed on a GPU machine: {e}"),
        Err(e) => {
            assert!(
                matches!(e.kind, ErrorKind::Unsupported | ErrorKind::InvalidArgument),
                "{e:?}"
            );
            assert!(e.message.contains("CUDA"), "error should name CUDA: {e}");
        }
        // A GPU is present: the load must also have produced a usable model.
        Ok(m) => assert_eq!(m.decoder.device(), Device::Cuda(0)),
    }
    let bad = ModelParams {
        device: Device::Cuda(99),
        ..Default::default()
    };
    let e = Model::load(&dir, &bad, None)
        .err()
        .expect("device 99 does not exist");
    assert!(e.message.contains("CUDA"), "{e}");
    assert!(
        "cuda:x".parse::<Device>().is_err()
            && "cuda:1".parse::<Device>().unwrap() == Device::Cuda(1)
    );
}

fn fixtures_present() -> bool {
    std::env::var_os("NANOINFER_CUDA_FIXTURES").is_some()
}

/// Device memory in use (total − free) on GPU 0, after the device's work
/// drained and its default stream-ordered pool gave back what it caches.
fn device_used_bytes() -> usize {
    use cudarc::driver::{result, sys, CudaContext};
    let ctx = CudaContext::new(0).expect("CUDA context");
    ctx.synchronize().expect("cuCtxSynchronize");
    let mut pool = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the device handle lives as long as `ctx`.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
        .result()
        .expect("default pool");
    // SAFETY: the default pool lives as long as the device.
    unsafe { result::mem_pool::trim_to(pool, 0) }.expect("trim");
    let (free, total) = ctx.mem_get_info().expect("cuMemGetInfo");
    total - free
}

fn with_pool(pool: MemoryPoolKind) -> SessionParams {
    SessionParams {
        memory_pool: Some(pool),
        kv_capacity_tokens: 4096,
        ..Default::default()
    }
}

#[test]
fn device_pools_give_the_default_tokens_and_return_their_memory() {
    let Some(fx) = fixtures() else { return };
    const MIB: usize = 1 << 20;
    for name in MODELS {
        let dir = fx.join(name);
        let model = load(&dir);
        let reqs = requests(&golden(&dir), 12);
        let plain = SessionParams {
            kv_capacity_tokens: 4096,
            ..Default::default()
        };
        // Also warms up: modules load lazily on first launch and stay.
        let (reference, st) = run_with_stats(&model, plain, &reqs);
        let ws = st.workspace.expect("a CUDA session reports its pool");
        assert_eq!(ws.pool, MemoryPoolKind::CudaStream, "the GPU default");
        for pool in MemoryPoolKind::GPU {
            let before = device_used_bytes();
            let (out, st) = run_with_stats(&model, with_pool(pool), &reqs);
            assert_eq!(out, reference, "{name}: {pool} changes the output");
            let ws = st.workspace.unwrap();
            assert_eq!(ws.pool, pool);
            // The KV buffer and the workspace come from the pool.
            assert!(
                ws.pool_stats.live_allocations >= 10,
                "{name} {pool}: {ws:?}"
            );
            assert!(
                ws.pool_stats.used_bytes >= st.memory.kv_bytes,
                "{name} {pool}: {ws:?} vs {:?}",
                st.memory
            );
            assert!(ws.pool_stats.capacity_bytes >= ws.pool_stats.used_bytes);
            let after = device_used_bytes();
            assert!(
                after <= before + 4 * MIB,
                "{name} {pool}: {:.1} MiB in use before the session, {:.1} MiB after it ended",
                before as f64 / MIB as f64,
                after as f64 / MIB as f64
            );
        }
    }
}

#[test]
fn buddy_pool_stats_track_the_session() {
    let Some(fx) = fixtures() else { return };
    let dir = fx.join("llama3");
    let model = load(&dir);
    let mut s = Session::new(model.clone(), with_pool(MemoryPoolKind::CudaBuddy)).unwrap();
    let ws = s.stats().workspace.unwrap();
    let p = ws.pool_stats;
    assert_eq!(ws.pool, MemoryPoolKind::CudaBuddy);
    assert_eq!(p.system_allocations, 1, "one region, allocated once: {p:?}");
    assert!(p.live_allocations >= 10 && p.live_allocations as u64 == p.total_allocations);
    assert!(p.used_bytes <= p.capacity_bytes && p.peak_bytes == p.used_bytes);
    // Sized for the session: the KV cache and the workspace, little more.
    let kv = s.stats().memory.kv_bytes;
    assert!(
        p.used_bytes >= kv + ws.planned_bytes,
        "{p:?}, KV {kv}, {ws:?}"
    );
    // Buddy blocks are aligned to their size, so the region can hold gaps
    // between a session's buffers, but never as much again as they use.
    assert!(
        p.capacity_bytes < 2 * p.used_bytes,
        "region too large: {p:?}"
    );
    for r in requests(&golden(&dir), 8) {
        s.add_request(r).unwrap();
    }
    while s.has_work() {
        s.step().unwrap();
    }
    // Nothing allocated per step.
    assert_eq!(s.stats().workspace.unwrap().pool_stats, p);
    drop(s);

    // The same pools used directly: live while buffers exist, empty after.
    use nanoinfer::backend::cuda::{create_device_pool, ActDType, CudaDevice};
    let dev = CudaDevice::open(0, ActDType::BF16).unwrap();
    for kind in MemoryPoolKind::GPU {
        let pool = create_device_pool(&dev, kind, 8 << 20).unwrap();
        let data: Vec<u32> = (0..100_000).collect();
        let mut bufs = Vec::new();
        for n in [100_000usize, 3, 70_000, 1] {
            bufs.push(dev.alloc_in::<u32>(&pool, n).unwrap());
        }
        assert_eq!(pool.stats().live_allocations, 4, "{kind}");
        assert!(bufs.iter().all(|b| b.is_pooled() && b.ptr() % 256 == 0));
        dev.upload(&data, &mut bufs[0]).unwrap();
        dev.upload_at(&data[..10], &mut bufs[2], 5).unwrap();
        let mut back = vec![0u32; 100_000];
        dev.download(&bufs[0], &mut back).unwrap();
        assert_eq!(back, data, "{kind}: round trip");
        let mut back = vec![7u32; 20];
        dev.download(&bufs[2], &mut back).unwrap();
        assert_eq!(&back[..5], &[0; 5], "{kind}: pool buffers start zeroed");
        assert_eq!(&back[5..15], &data[..10]);
        if kind == MemoryPoolKind::CudaBuddy {
            // 8 MiB: the first buffer fits, a second one of 8 MiB does not.
            let e = dev.alloc_in::<u8>(&pool, 8 << 20).err().unwrap();
            assert_eq!(e.kind, ErrorKind::OutOfMemory, "{e}");
        }
        bufs.clear();
        dev.synchronize().unwrap();
        let st = pool.stats();
        assert_eq!(
            (st.live_allocations, st.used_bytes),
            (0, 0),
            "{kind}: {st:?}"
        );
        assert_eq!(st.total_allocations, 4);
    }
}

#[test]
fn automatic_budget_is_profiled_and_fits() {
    let Some(fx) = fixtures() else { return };
    for name in MODELS {
        let dir = fx.join(name);
        let model = load(&dir);
        for pool in MemoryPoolKind::GPU {
            let params = SessionParams {
                memory_pool: Some(pool),
                ..Default::default()
            };
            let (out, st) = run_with_stats(&model, params, &requests(&golden(&dir), 4));
            let m = &st.memory;
            assert_eq!(m.source, nanoinfer::memory::BudgetSource::Automatic);
            assert!(
                m.profiled_peak_bytes >= m.workspace_bytes && m.workspace_bytes > 0,
                "{name} {pool}: {m}"
            );
            assert!(m.to_string().contains("profiled peak"), "{m}");
            assert!(m.kv_bytes > 0 && out.iter().all(|o| o.tokens.len() == 4));
            // An explicit budget skips profiling.
            let explicit = SessionParams {
                memory_pool: Some(pool),
                kv_memory_bytes: 256 << 20,
                ..Default::default()
            };
            let s = Session::new(model.clone(), explicit).unwrap();
            assert_eq!(s.stats().memory.profiled_peak_bytes, 0);
        }
    }
}

#[test]
fn pools_of_the_other_device_are_refused() {
    // CPU model, GPU pool: runs everywhere.
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny-llama3");
    let cpu = Arc::new(Model::load(&dir, &ModelParams::default(), None).unwrap());
    for pool in MemoryPoolKind::GPU {
        let e = Session::new(cpu.clone(), with_pool(pool)).err().unwrap();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert!(
            e.message.contains(pool.as_str()) && e.message.contains("cpu"),
            "{e}"
        );
    }
    let Some(fx) = fixtures() else { return };
    let gpu = load(&fx.join("llama3"));
    for pool in MemoryPoolKind::CPU {
        let e = Session::new(gpu.clone(), with_pool(pool)).err().unwrap();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert!(
            e.message.contains(pool.as_str()) && e.message.contains("cuda:0"),
            "{e}"
        );
    }
}

fn fp8_kv() -> SessionParams {
    SessionParams {
        kv_cache_dtype: KvCacheDType::Fp8E4m3,
        ..Default::default()
    }
}

/// The logits of the last of `tokens`, prefilled in a fresh context.
fn last_logits(model: &Arc<Model>, tokens: &[u32]) -> Vec<f32> {
    use nanoinfer::forward::AttnSeq;
    use nanoinfer::kv::KvMapping;
    use nanoinfer::model::{ContextShape, ForwardBatch};
    let n = tokens.len();
    let mut shape = ContextShape::new(n + 1, n, 1);
    shape.memory_pool = MemoryPoolKind::default_for(true);
    let mut ctx = model.decoder.clone().new_context(&shape).unwrap();
    let slots: Vec<u32> = (1..=n as u32).collect();
    let seqs = [AttnSeq {
        start: 0,
        len: n,
        context_len: 0,
        kv: KvMapping::Slots(&slots),
    }];
    let batch = ForwardBatch {
        tokens,
        seqs: &seqs,
        logits_rows: &[n - 1],
        stop: None,
    };
    let mut logits = vec![0f32; model.config().vocab_size];
    ctx.forward(&batch, &mut logits).unwrap();
    logits
}

/// The cached keys and values of slots 1..=n after forwarding `tokens`
/// (a prefill of all but the last token, then a one-row decode step: the
/// two ways the QKV projection writes the cache) into a fresh context
/// keeping a cache of `dtype`.
fn cached_kv(model: &Arc<Model>, tokens: &[u32], dtype: KvCacheDType) -> Vec<f32> {
    use nanoinfer::forward::AttnSeq;
    use nanoinfer::kv::KvMapping;
    use nanoinfer::model::{ContextShape, ForwardBatch};
    let n = tokens.len();
    let mut shape = ContextShape::new(n + 1, n, n);
    shape.memory_pool = MemoryPoolKind::default_for(true);
    shape.kv_dtype = dtype;
    let mut ctx = model.decoder.clone().new_context(&shape).unwrap();
    let slots: Vec<u32> = (1..=n as u32).collect();
    let vocab = model.config().vocab_size;
    let mut logits = vec![0f32; vocab];
    for (start, len) in [(0, n - 1), (n - 1, 1)] {
        let seqs = [AttnSeq {
            start: 0,
            len,
            context_len: start,
            kv: KvMapping::Slots(&slots),
        }];
        let batch = ForwardBatch {
            tokens: &tokens[start..start + len],
            seqs: &seqs,
            logits_rows: &[len - 1],
            stop: None,
        };
        ctx.forward(&batch, &mut logits).unwrap();
    }
    let mut kv = Vec::new();
    ctx.save_kv(&slots, &mut kv).unwrap();
    kv
}

/// An FP8 KV cache holds exactly the e4m3 rounding (nearest even) of what a
/// 16-bit cache holds, from every writer: the prefill path, the fused
/// decode projection and the int4 epilogue; the Rust encoder
/// (`kv::cache_dtype`) is the reference for the device's. Layer 0 only: the
/// later layers' keys and values depend on attention over the rounded ones.
fn check_fp8_cache_contents(name: &str, model: &Arc<Model>) {
    let tokens: Vec<u32> = (0..40u32).map(|i| 3 + (i * 7919) % 4000).collect();
    let c = model.config();
    let per_slot = 2 * c.num_layers * c.num_kv_heads * c.head_dim;
    let layer0 = |kv: Vec<f32>| -> Vec<f32> {
        kv.chunks(per_slot)
            .flat_map(|slot| slot[..2 * c.num_kv_heads * c.head_dim].to_vec())
            .collect()
    };
    let wide = layer0(cached_kv(model, &tokens, KvCacheDType::Auto));
    let narrow = layer0(cached_kv(model, &tokens, KvCacheDType::Fp8E4m3));
    assert_eq!(wide.len(), narrow.len());
    let mut nonzero = 0;
    for (i, (&w, &f)) in wide.iter().zip(&narrow).enumerate() {
        let want = e4m3_to_f32(e4m3_from_f32(w));
        assert!(
            want.to_bits() == f.to_bits(),
            "{name}: cached value {i} is {f}, the e4m3 rounding of {w} is {want}"
        );
        nonzero += usize::from(f != 0.0);
    }
    assert!(nonzero > wide.len() / 2, "{name}: the cache is mostly zero");
}

#[test]
fn fp8_kv_cache_matches_transformers_with_fp8_kv() {
    let Some(fx) = fixtures() else { return };
    for name in MODELS {
        let dir = fx.join(name);
        let gold: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden_fp8kv.json")).unwrap())
                .unwrap();
        let model = load(&dir);
        check_fp8_cache_contents(name, &model);
        let n = ids(&gold["tokens"][0]).len() as u32;
        let reqs = requests(&gold, n);
        let outs = run(&model, fp8_kv(), &reqs);
        let matched: Vec<usize> = outs
            .iter()
            .enumerate()
            .map(|(i, o)| {
                check_near(
                    &format!("{name} prompt {i} fp8 KV"),
                    o,
                    &reference(&gold, i),
                )
            })
            .collect();
        eprintln!("{name}: fp8 KV greedy tokens identical to transformers (fp8 KV) for {matched:?} of {n} steps");
        let total: usize = matched.iter().sum();
        assert!(
            3 * total >= matched.len() * n as usize,
            "{name}: too few tokens identical to transformers: {matched:?} of {n}"
        );
        // Token and paged KV address the same bytes.
        let token = SessionParams {
            kv_backend: KvBackendKind::Token,
            ..fp8_kv()
        };
        assert_eq!(
            run(&model, token, &reqs),
            outs,
            "{name}: fp8 token and paged KV differ"
        );
    }
    let dir = fx.join("llama3");
    let reqs = requests(&golden(&dir), 20);
    // The int4 QKV epilogue writes the cache too.
    let int4 = Arc::new(
        Model::load(
            &dir,
            &ModelParams {
                device: Device::Cuda(0),
                quant: QuantMode::Awq {
                    group_size: 128,
                    lm_head: false,
                },
                ..Default::default()
            },
            None,
        )
        .unwrap(),
    );
    check_fp8_cache_contents("llama3 int4", &int4);
    // Swap preemption moves fp8 bytes out and back losslessly.
    let model = load(&dir);
    let roomy = run(&model, fp8_kv(), &reqs);
    check_swap_is_lossless(&model, fp8_kv(), &reqs, &roomy, "fp8 swap preemption");
    // The same bytes hold twice the tokens.
    let budget = |kv_cache_dtype| {
        let params = SessionParams {
            kv_memory_bytes: 64 << 20,
            kv_cache_dtype,
            ..Default::default()
        };
        Session::new(model.clone(), params)
            .unwrap()
            .stats()
            .kv_capacity_tokens
    };
    let (wide, narrow) = (budget(KvCacheDType::Auto), budget(KvCacheDType::Fp8E4m3));
    assert!(
        narrow >= 2 * wide - 16,
        "fp8 holds {narrow} tokens, bf16 {wide}"
    );
    // The CUDA-core decode kernel reads fp8 like the tensor-core one, over
    // many splits and contexts that end mid-step (head_dim 64 and 128).
    let long: Vec<RequestParams> = [(5u32, 1u32), (700, 3), (130, 4)]
        .iter()
        .map(|&(len, salt)| RequestParams {
            prompt: (0..len)
                .map(|i| 3 + (i * 7919 + salt * 104_729) % 4000)
                .collect(),
            sampling: sampling(12, 5),
            ..Default::default()
        })
        .collect();
    for name in ["llama3", "qwen3"] {
        let dir = fx.join(name);
        let mma = run(&load(&dir), fp8_kv(), &long);
        std::env::set_var("NANOINFER_CUDA_DECODE_MMA", "0");
        let simt_model = load(&dir);
        std::env::remove_var("NANOINFER_CUDA_DECODE_MMA");
        let simt = run(&simt_model, fp8_kv(), &long);
        for (i, (a, b)) in mma.iter().zip(&simt).enumerate() {
            check_near(&format!("{name} request {i} fp8 mma vs cuda cores"), a, b);
        }
    }
}

/// The op conformance suite (`common/conformance.rs`, which
/// `tests/op_conformance.rs` runs on the CPU) on the GPU: the same cases
/// against the same f64 reference, with BF16 and F16 activations and
/// int4 weights. Tolerances are about three times the worst deviation
/// measured on an H200 (BF16 1.55e-2, F16 2.0e-3, int4 1.52e-2).
#[test]
fn gpu_ops_match_the_f64_reference_of_the_conformance_suite() {
    use common::conformance::{check_backend, write_int4};
    if fixtures().is_none() {
        return;
    }
    let pool = MemoryPoolKind::default_for(true);
    let scratch = std::env::temp_dir().join(format!("ni-cuda-conformance-{}", std::process::id()));
    let mut report = Vec::new();
    for (label, dtype, tolerance) in [
        ("cuda-bf16", WeightDType::BF16, 4.5e-2),
        ("cuda-f16", WeightDType::F16, 6e-3),
    ] {
        let load = |dense: &std::path::Path, _: &std::path::Path| {
            (load_as(dense, dtype), dense.to_path_buf())
        };
        report.extend(check_backend(label, &scratch, pool, tolerance, &load));
    }
    let load = |dense: &std::path::Path, case: &std::path::Path| {
        let (packed, reference) = (case.join("int4"), case.join("dequantized"));
        write_int4(dense, &packed, &reference);
        (load_as(&packed, WeightDType::BF16), reference)
    };
    report.extend(check_backend("cuda-int4", &scratch, pool, 4.5e-2, &load));
    eprintln!("{}", report.join("\n"));
    let _ = std::fs::remove_dir_all(&scratch);
}

/// A model whose f16 activations overflow (finite weights: layer 0's value
/// projection scaled by 4e5, to at most 6.0e4 in f16, so the values it
/// computes pass f16's 65 504; the norms' outputs may stay f32 inside a
/// fused projection, so overflowing only there would not be certain)
/// makes NaN logits on the GPU. Greedy rows (argmax on the device) and
/// sampled rows (the device sampler) are marked non-finite, and each
/// request ends with one error event naming the cause, as on the CPU;
/// nothing is emitted from the garbage row and no KV is leaked.
#[test]
fn non_finite_gpu_logits_end_the_request_with_an_error() {
    use common::conformance::{scale_tensor, shapes, write_model, Isolate};
    use nanoinfer::engine::FinishReason;
    if fixtures().is_none() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("ni-cuda-overflow-{}", std::process::id()));
    write_model(&dir, &shapes()[0], Isolate::Whole, 3);
    scale_tensor(&dir, "model.layers.0.self_attn.v_proj.weight", 4e5);
    let model = load_as(&dir, WeightDType::F16);
    // The premise: the forward itself overflows.
    let prompt: Vec<u32> = (0..5).map(|t| 3 + t * 7).collect();
    let logits = last_logits(&model, &prompt);
    let bad = logits.iter().filter(|v| !v.is_finite()).count();
    eprintln!(
        "overflowing f16 model: {bad} of {} logits non-finite",
        logits.len()
    );
    assert!(bad > 0, "the model does not overflow: {:?}", &logits[..8]);
    for temperature in [0.0, 1.0] {
        let mut s = Session::new(model.clone(), SessionParams::default()).expect("session");
        for i in 0..3u32 {
            let mut sampling = sampling(4, 0);
            sampling.temperature = temperature;
            let prompt = (0..5 + i).map(|t| 3 + t * 7).collect();
            s.add_request(RequestParams {
                prompt,
                sampling,
                ..Default::default()
            })
            .unwrap();
        }
        let mut ended = 0;
        while s.has_work() {
            for e in s.step().expect("step") {
                assert!(
                    e.tokens.is_empty(),
                    "temperature {temperature}: tokens from a NaN row: {:?}",
                    e.tokens
                );
                match e.finish {
                    Some(FinishReason::Error(msg)) => {
                        assert!(msg.contains("non-finite logits"), "{msg}");
                        ended += 1;
                    }
                    None => {}
                    Some(other) => panic!("temperature {temperature}: ended with {other:?}"),
                }
            }
        }
        assert_eq!(ended, 3, "temperature {temperature}");
        assert_eq!(s.stats().kv.used_slots, 0, "KV leaked");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A vocabulary padded past its tokenizer: the device argmax and sampler
/// choose only among the ids the tokenizer covers (`common/choosable.rs`).
#[test]
fn gpu_chooses_only_ids_the_tokenizer_covers() {
    let Some(fx) = fixtures() else { return };
    for name in MODELS {
        let model = load(&fx.join(name));
        common::choosable::check_choosable_ids(&model, MemoryPoolKind::default_for(true));
    }
}
