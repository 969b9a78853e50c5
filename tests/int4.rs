//! Int4 AWQ/GPTQ checkpoints: the loaders dequantize exactly what the
//! reference unpacking (scripts/int4_golden.py, numpy) says; the kernels
//! agree with the dequantized weights; offline checkpoints equal
//! quantization at load; malformed checkpoints fail naming the tensor; and
//! perplexity of round-to-nearest SmolLM2 against the F32 golden.

mod common;

use common::checkpoint_edit::{self, Tensors};
use common::dequant::{dequantized_copy, rows_of};
use common::smollm2::perplexity_tokens;
use common::*;
use nanoinfer::backend::cpu::{matmul, MatrixData, ThreadPool};
use nanoinfer::engine::eval::{greedy_with_logits, perplexity};
use nanoinfer::engine::{Model, ModelParams};
use nanoinfer::model::quant_int4::Int4;
use nanoinfer::model::safetensors::WeightFiles;
use nanoinfer::model::{QuantMethod, QuantMode, WeightDType};
use nanoinfer::quantize::quantize_checkpoint;
use nanoinfer::tensor::DType;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn scratch_dir(tag: &str) -> PathBuf {
    common::scratch_dir(&format!("int4-{tag}"))
}

fn load(dir: &Path, quant: QuantMode) -> Arc<Model> {
    load_quantized(dir, WeightDType::Auto, quant)
}

fn fixture_method(dir: &Path) -> Int4 {
    let text = std::fs::read_to_string(dir.join("quantization_config.json")).unwrap();
    Int4::from_config(&serde_json::from_str(&text).unwrap()).unwrap()
}

#[test]
fn golden_fixtures_dequantize_exactly_and_multiply_right() {
    let pool = ThreadPool::new(2);
    for case in ["awq-g32", "gptq-g32", "gptq_v2-g64"] {
        let dir = repo_path(&format!("tests/data/int4/{case}"));
        let method = fixture_method(&dir);
        let files = WeightFiles::open(&dir).unwrap();
        let expected = WeightFiles::open_file(&dir.join("expected.safetensors")).unwrap();
        let mut names: Vec<&str> = expected.tensor_names().collect();
        names.sort_unstable();
        assert_eq!(names.len(), 2, "{case}");
        for name in names {
            let view = expected.get(name).unwrap();
            assert_eq!(view.dtype, DType::F32);
            let (rows, cols) = (view.shape[0], view.shape[1]);
            let want = view.to_f32().unwrap();
            assert!(method.stored_in(&files, name));
            let m = method.load(&files, name, rows, cols).unwrap();
            assert_eq!(m.dtype_name(), "int4");
            // Packed (these tiny layers are mostly padding: 16-row blocks,
            // 32-input steps; SmolLM2's layers take 0.56 bytes per weight).
            assert!(m.size_in_bytes() < rows * cols * 2, "{case} {name}");
            let got = rows_of(&m);
            for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{case} {name} [{}, {}]: {g} vs reference {w}",
                    i / cols,
                    i % cols
                );
            }
            // The kernels (act-order permutation included) against f64 on
            // the reference weights; activations are int8 per 32 inputs.
            for m_rows in [1usize, 5] {
                let x: Vec<f32> = (0..m_rows * cols)
                    .map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0)
                    .collect();
                let mut out = vec![0f32; m_rows * rows];
                matmul(&pool, &x, m_rows, &[&m], &mut out);
                for r in 0..m_rows {
                    let xr = &x[r * cols..(r + 1) * cols];
                    for c in 0..rows {
                        let wr = &want[c * cols..(c + 1) * cols];
                        let exact: f64 =
                            xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum();
                        let bound: f64 = wr.iter().map(|v| v.abs() as f64).sum::<f64>() / 127.0;
                        let diff = (out[r * rows + c] as f64 - exact).abs();
                        assert!(
                            diff <= bound,
                            "{case} {name} m={m_rows} ({r},{c}): {} vs {exact}",
                            out[r * rows + c]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn offline_checkpoints_equal_quantization_at_load() {
    let src = repo_path("tests/data/tiny-llama3");
    for (mode, qm) in [
        (
            QuantMode::Awq {
                group_size: 32,
                lm_head: false,
            },
            "awq",
        ),
        (
            QuantMode::Gptq {
                group_size: 64,
                sym: true,
                lm_head: false,
            },
            "gptq",
        ),
        (
            QuantMode::Gptq {
                group_size: 32,
                sym: false,
                lm_head: false,
            },
            "gptq",
        ),
        // GPTQ's `lm_head: true`: the LM head in int4 as well.
        (
            QuantMode::Gptq {
                group_size: 32,
                sym: true,
                lm_head: true,
            },
            "gptq",
        ),
    ] {
        let head = matches!(mode, QuantMode::Gptq { lm_head: true, .. });
        let out = scratch_dir(&format!("tiny-{qm}"));
        let report = quantize_checkpoint(&src, &out, mode).unwrap();
        assert_eq!(
            report.quantized,
            2 * 7 + head as usize,
            "7 linear layers per block, and the head when asked"
        );
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(config["quantization_config"]["quant_method"], qm);
        if qm == "gptq" {
            assert_eq!(config["quantization_config"]["lm_head"], head);
        }
        let files = WeightFiles::open(&out).unwrap();
        let p = "model.layers.0.mlp.down_proj";
        assert!(!files.contains(&format!("{p}.weight")));
        let qw = files.get(&format!("{p}.qweight")).unwrap();
        // down_proj: out 64, in 128.
        let want_shape: &[usize] = if qm == "awq" { &[128, 8] } else { &[16, 64] };
        assert_eq!((qw.dtype, qw.shape), (DType::I32, want_shape));
        assert_eq!(files.get(&format!("{p}.scales")).unwrap().dtype, DType::F16);
        assert_eq!(files.contains(&format!("{p}.g_idx")), qm == "gptq");

        {
            let files = WeightFiles::open(&out).unwrap();
            assert_eq!(files.contains("lm_head.qweight"), head);
            assert_eq!(files.contains("lm_head.weight"), !head);
        }
        let offline = load(&out, QuantMode::None);
        let online = load(&src, mode);
        assert_eq!(offline.decoder.weight_dtype_name(), "int4");
        let head_dtype = if head { "int4" } else { "f32" };
        assert_eq!(offline.decoder.lm_head_dtype_name(), head_dtype);
        assert_eq!(online.decoder.lm_head_dtype_name(), head_dtype);
        let prompt: Vec<u32> = (0..20).map(|i| (i * 37 + 5) % 200).collect();
        let (ids_a, logits_a) = greedy_with_logits(&offline, &prompt, 6).unwrap();
        let (ids_b, logits_b) = greedy_with_logits(&online, &prompt, 6).unwrap();
        assert_eq!(ids_a, ids_b);
        assert_eq!(logits_a, logits_b, "{mode:?}: route A and B must agree");
        // A quantized checkpoint cannot be quantized again.
        let again = quantize_checkpoint(&out, &scratch_dir("again"), mode).unwrap_err();
        assert!(again.to_string().contains("already quantized"), "{again}");
        std::fs::remove_dir_all(&out).unwrap();
    }
}

/// Rewrites `dir/model.safetensors` with `edit` applied to its tensors.
fn rewrite(dir: &Path, edit: impl Fn(&mut Tensors)) {
    checkpoint_edit::rewrite(dir, |t, _| edit(t));
}

fn set_qc(dir: &Path, f: impl Fn(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(&mut v["quantization_config"]);
    std::fs::write(&path, v.to_string()).unwrap();
}

type Edit = fn(&Path);

#[test]
fn malformed_int4_checkpoints_fail_naming_the_tensor() {
    let src = repo_path("tests/data/tiny-qwen3");
    let params = ModelParams {
        threads: 1,
        ..Default::default()
    };
    const UP: &str = "model.layers.0.mlp.up_proj";
    let cases: [(&str, QuantMode, Edit); 7] = [
        (
            "but no `model.layers.0.mlp.up_proj.scales`",
            QuantMode::Awq {
                group_size: 32,
                lm_head: false,
            },
            |d| rewrite(d, |t| t.retain(|x| x.0 != format!("{UP}.scales"))),
        ),
        (
            "tensor 'model.layers.0.mlp.up_proj.qzeros' has shape",
            QuantMode::Awq {
                group_size: 32,
                lm_head: false,
            },
            |d| {
                rewrite(d, |t| {
                    let z = t
                        .iter_mut()
                        .find(|x| x.0 == format!("{UP}.qzeros"))
                        .unwrap();
                    z.2 = vec![z.2[0] * z.2[1]];
                })
            },
        ),
        (
            // A float qweight of random bits: refused as non-finite or by dtype, naming it.
            "tensor 'model.layers.0.mlp.up_proj.qweight' ",
            QuantMode::Awq {
                group_size: 32,
                lm_head: false,
            },
            |d| {
                rewrite(d, |t| {
                    let w = t
                        .iter_mut()
                        .find(|x| x.0 == format!("{UP}.qweight"))
                        .unwrap();
                    w.1 = safetensors::Dtype::F32;
                })
            },
        ),
        (
            // group 64 in config, tensors written with group 32: scales disagree.
            "tensor 'model.layers.0.self_attn.q_proj.qzeros' has shape [2, ",
            QuantMode::Awq {
                group_size: 32,
                lm_head: false,
            },
            |d| set_qc(d, |q| q["group_size"] = 64.into()),
        ),
        (
            "model.layers.0.mlp.up_proj.g_idx",
            QuantMode::Gptq {
                group_size: 32,
                sym: true,
                lm_head: false,
            },
            |d| {
                rewrite(d, |t| {
                    let g = t.iter_mut().find(|x| x.0 == format!("{UP}.g_idx")).unwrap();
                    g.3[0..4].copy_from_slice(&9i32.to_le_bytes());
                })
            },
        ),
        (
            "AWQ version `gemv` is not supported",
            QuantMode::Awq {
                group_size: 32,
                lm_head: false,
            },
            |d| set_qc(d, |q| q["version"] = "gemv".into()),
        ),
        (
            "with 8 bits is not supported",
            QuantMode::Gptq {
                group_size: 32,
                sym: true,
                lm_head: false,
            },
            |d| set_qc(d, |q| q["bits"] = 8.into()),
        ),
    ];
    for (i, (want, mode, edit)) in cases.into_iter().enumerate() {
        let out = scratch_dir(&format!("bad{i}"));
        quantize_checkpoint(&src, &out, mode).unwrap();
        edit(&out);
        assert_load_fails(&out, &params, want);
        std::fs::remove_dir_all(&out).unwrap();
    }
}

/// Perplexity of SmolLM2 quantized with round-to-nearest (group 128), AWQ
/// and GPTQ format, against transformers' F32 figure (28.825). The issue's
/// target is within 5% for AWQ-RTN g128; this checkpoint's weights are the
/// dequantized Q4_1 GGUF (already 4-bit on a group-32 grid), and RTN onto a
/// second, coarser grid lands at about +25% (see BENCHMARKS.md), so the test
/// guards those figures and that the int4 kernels add ≤ 1% over the same
/// dequantized weights in F32 — it does not meet the 5% target. The
/// calibrated quantizers (`--calib`: AWQ scaling, GPTQ) get closer, +13.0%
/// and +20.5%, still short of 5%: see tests/int4_calib.rs.
#[test]
fn smollm2_rtn_g128_perplexity() {
    let g = golden("smollm2.json");
    let p = &g["perplexity"];
    let want = p["ppl"].as_f64().unwrap();
    let src = smollm2_dir("");
    let mut report = Vec::new();
    // Guards at the measured +25% (AWQ) and +35% (GPTQ symmetric) plus margin.
    for (mode, label, bound) in [
        (
            QuantMode::Awq {
                group_size: 128,
                lm_head: false,
            },
            "awq",
            1.30,
        ),
        (
            QuantMode::Gptq {
                group_size: 128,
                sym: true,
                lm_head: false,
            },
            "gptq",
            1.40,
        ),
    ] {
        let out = scratch_dir(&format!("smollm2-{label}"));
        quantize_checkpoint(&src, &out, mode).unwrap();
        let model = load(&out, QuantMode::None);
        assert_eq!(model.decoder.weight_dtype_name(), "int4");
        let tokens = perplexity_tokens(&model, &g);
        let ppl = perplexity(&model, &tokens).unwrap();
        report.push(format!(
            "{label} g128 {ppl:.3} ({:+.1}%)",
            100.0 * (ppl / want - 1.0)
        ));
        if label == "awq" {
            let deq = scratch_dir("smollm2-awq-f32");
            let method = model.config().quantization.expect("int4 checkpoint");
            dequantized_copy(&out, model.config(), method.method(), &deq);
            let dense = load(&deq, QuantMode::None);
            assert_eq!(dense.decoder.weight_dtype_name(), "f32");
            let ppl_dense = perplexity(&dense, &tokens).unwrap();
            report.push(format!("awq dequantized to f32 {ppl_dense:.3}"));
            assert!(
                (ppl - ppl_dense).abs() / ppl_dense < 0.01,
                "int4 kernels {ppl} vs the same weights in f32 {ppl_dense}"
            );
            std::fs::remove_dir_all(&deq).unwrap();
        }
        assert!(
            ppl / want < bound,
            "{label} g128 perplexity {ppl} vs f32 transformers {want}"
        );
        std::fs::remove_dir_all(&out).unwrap();
    }
    eprintln!(
        "SmolLM2 perplexity, f32 transformers {want}: {}",
        report.join(", ")
    );
}

#[test]
fn int4_matrix_reports_int4() {
    // The public enum carries the int4 variant (used by the decoder's reports).
    let m = Int4::awq(32).unwrap();
    let w: Vec<f32> = (0..32 * 64).map(|i| (i % 17) as f32 / 17.0 - 0.5).collect();
    let mat = m.quantize(32, 64, &w).unwrap();
    assert!(matches!(mat.data, MatrixData::Q4(_)));
}
