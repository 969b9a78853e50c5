//! Calibrated int4 quantization (AWQ activation-aware scaling, GPTQ with
//! act-order) of SmolLM2 at group 128: perplexity on the golden text
//! against transformers' F32 figure and against round-to-nearest of the same
//! format; the checkpoints load through the ordinary int4 loaders. The
//! calibration text is tests/data/calib.txt, never the evaluation text.

mod common;

use common::*;
use nanoinfer::engine::eval::perplexity;
use nanoinfer::model::{QuantMode, WeightDType};
use nanoinfer::quantize::calib::Calibration;
use nanoinfer::quantize::{quantize_checkpoint_with, QuantizeOptions};
use std::path::Path;

fn ppl_of(dir: &Path, text: &str, add_special: bool, max_tokens: usize) -> f64 {
    let model = load_quantized(dir, WeightDType::Auto, QuantMode::None);
    assert_eq!(model.decoder.weight_dtype_name(), "int4");
    let mut tokens = model
        .tokenizer()
        .unwrap()
        .encode(text, add_special)
        .unwrap();
    tokens.truncate(max_tokens);
    perplexity(&model, &tokens).unwrap()
}

/// The calibrated quantizers run on the reproducible kernels, so these
/// figures are the same on every CPU and `NANOINFER_ISA` (checked by
/// `calibrated_checkpoints_are_the_same_on_every_isa`): F32 28.825; AWQ g128
/// round-to-nearest 36.153 (+25.4 %), calibrated on 512 tokens 32.5 (+13 %);
/// GPTQ symmetric g128 round-to-nearest 39.011 (+35.3 %), GPTQ with
/// act-order on the 1757 tokens of the calibration text 35.425 (+22.9 %).
/// GPTQ's result is chaotic in its inputs: perturbing the damping by ±1 %
/// moves it anywhere in 34.6–38.8 (docs/quantization-determinism.md), which is
/// why the serving kernels' ISA-dependent sums once gave 34.7 on AVX-512 and
/// 38.7 on AVX2. The 5 % target for AWQ is not met (see
/// BENCHMARKS.md "Quality": the checkpoint's weights are the dequantized
/// Q4_1 GGUF, already on a group-32 4-bit grid). The bounds guard the
/// figures with a small margin.
#[test]
fn smollm2_calibrated_g128_perplexity() {
    let g = golden("smollm2.json");
    let p = &g["perplexity"];
    let want = p["ppl"].as_f64().unwrap();
    let text = std::fs::read_to_string(repo_path(p["file"].as_str().unwrap())).unwrap();
    let add_special = p["add_special_tokens"].as_bool().unwrap();
    let max_tokens = p["max_tokens"].as_u64().unwrap() as usize;
    let src = smollm2_dir("");
    let calib_path = repo_path("tests/data/calib.txt");
    let mut report = Vec::new();
    for (label, mode, calib_tokens, act_order, bound) in [
        (
            "awq",
            QuantMode::Awq {
                group_size: 128,
                lm_head: false,
            },
            512,
            false,
            1.16,
        ),
        (
            "gptq",
            QuantMode::Gptq {
                group_size: 128,
                sym: true,
                lm_head: false,
            },
            2048,
            true,
            1.25,
        ),
    ] {
        let rtn_dir = scratch_dir(&format!("calib-{label}-rtn"));
        quantize_checkpoint_with(&src, &rtn_dir, mode, &QuantizeOptions::default()).unwrap();
        let rtn = ppl_of(&rtn_dir, &text, add_special, max_tokens);
        std::fs::remove_dir_all(&rtn_dir).unwrap();

        let mut opts = QuantizeOptions {
            calibration: Some(Calibration::from_file(&src, &calib_path, calib_tokens).unwrap()),
            threads: 2,
            ..Default::default()
        };
        opts.gptq.act_order = act_order;
        let out = scratch_dir(&format!("calib-{label}"));
        let r = quantize_checkpoint_with(&src, &out, mode, &opts).unwrap();
        assert_eq!(r.quantized, 30 * 7);
        assert!(r.calibration_tokens >= 512.min(calib_tokens));
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(config["quantization_config"]["quant_method"], label);
        if label == "gptq" {
            assert_eq!(config["quantization_config"]["desc_act"], act_order);
        }
        let ppl = ppl_of(&out, &text, add_special, max_tokens);
        std::fs::remove_dir_all(&out).unwrap();
        report.push(format!(
            "{label} g128 RTN {rtn:.3} ({:+.1}%), calibrated on {} tokens {ppl:.3} ({:+.1}%)",
            100.0 * (rtn / want - 1.0),
            r.calibration_tokens,
            100.0 * (ppl / want - 1.0)
        ));
        assert!(
            ppl < rtn,
            "{label}: calibrated {ppl} vs round-to-nearest {rtn}"
        );
        assert!(
            ppl / want < bound,
            "{label} g128 calibrated perplexity {ppl} vs f32 transformers {want}"
        );
    }
    eprintln!(
        "SmolLM2 perplexity, f32 transformers {want}: {}",
        report.join("; ")
    );
}

#[test]
fn calibration_options_are_checked() {
    let src = repo_path("tests/data/tiny-llama3");
    let out = scratch_dir("calib-bad");
    let mut opts = QuantizeOptions::default();
    opts.gptq.act_order = true;
    let gptq = QuantMode::Gptq {
        group_size: 32,
        sym: true,
        lm_head: false,
    };
    let e = quantize_checkpoint_with(&src, &out, gptq, &opts).unwrap_err();
    assert!(e.to_string().contains("act-order needs calibration"), "{e}");
    let calib = Calibration {
        seqs: vec![(0..64).map(|i| (i * 7 + 3) % 250).collect()],
    };
    let opts = QuantizeOptions {
        calibration: Some(calib.clone()),
        ..Default::default()
    };
    let e = quantize_checkpoint_with(&src, &out, QuantMode::Q8_0_DEFAULT, &opts).unwrap_err();
    assert!(e.to_string().contains("int4 methods"), "{e}");
    // Calibrated checkpoints of the tiny model load and run like RTN ones.
    for mode in [
        QuantMode::Awq {
            group_size: 32,
            lm_head: false,
        },
        gptq,
    ] {
        let mut opts = QuantizeOptions {
            calibration: Some(calib.clone()),
            threads: 1,
            ..Default::default()
        };
        opts.gptq.act_order = matches!(mode, QuantMode::Gptq { .. });
        let r = quantize_checkpoint_with(&src, &out, mode, &opts).unwrap();
        assert_eq!((r.quantized, r.calibration_tokens), (14, 64));
        let model = load_quantized(&out, WeightDType::Auto, QuantMode::None);
        assert_eq!(model.decoder.weight_dtype_name(), "int4");
        let prompt: Vec<u32> = (0..20).map(|i| (i * 37 + 5) % 200).collect();
        assert!(perplexity(&model, &prompt).unwrap().is_finite());
        std::fs::remove_dir_all(&out).unwrap();
    }
}

/// The same calibrated checkpoint, byte for byte, under every instruction
/// set this CPU has: the quantizer's arithmetic must not depend on the
/// kernels `NANOINFER_ISA` picks. The ISA is chosen once per process, so
/// each path runs `quantize_tiny_in_this_process` in a child process.
#[test]
fn calibrated_checkpoints_are_the_same_on_every_isa() {
    let mut isas = vec!["scalar"];
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            isas.push("avx2");
        }
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
        {
            isas.push("avx512");
        }
    }
    #[cfg(target_arch = "aarch64")]
    isas.push("neon");
    let mut first: Option<(&str, Vec<Vec<u8>>)> = None;
    for isa in isas {
        let out = scratch_dir(&format!("calib-isa-{isa}"));
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "quantize_tiny_in_this_process", "--ignored"])
            .env("NANOINFER_ISA", isa)
            .env("NANOINFER_CALIB_ISA_OUT", &out)
            .output()
            .unwrap();
        assert!(
            child.status.success(),
            "under {isa}: {}",
            String::from_utf8_lossy(&child.stdout)
        );
        let files: Vec<Vec<u8>> = ["gptq", "awq"]
            .iter()
            .map(|m| std::fs::read(out.join(m).join("model.safetensors")).unwrap())
            .collect();
        std::fs::remove_dir_all(&out).unwrap();
        match &first {
            None => first = Some((isa, files)),
            Some((isa0, f0)) => {
                for (m, (a, b)) in ["gptq", "awq"].iter().zip(f0.iter().zip(&files)) {
                    assert!(
                        a == b,
                        "{m}: the checkpoint under {isa} differs from the one under {isa0}"
                    );
                }
            }
        }
    }
}

/// The child of `calibrated_checkpoints_are_the_same_on_every_isa`: GPTQ
/// (act-order) and AWQ (with clipping) of the tiny Llama under this
/// process's `NANOINFER_ISA`, into `$NANOINFER_CALIB_ISA_OUT/{gptq,awq}`.
#[test]
#[ignore = "run as a child process by calibrated_checkpoints_are_the_same_on_every_isa"]
fn quantize_tiny_in_this_process() {
    let out = std::path::PathBuf::from(std::env::var("NANOINFER_CALIB_ISA_OUT").unwrap());
    let src = repo_path("tests/data/tiny-llama3");
    let calib = Calibration {
        seqs: (0..3)
            .map(|s| (0..150).map(|i| (i * 37 + s * 11 + 3) % 256).collect())
            .collect(),
    };
    for (name, mode) in [
        (
            "gptq",
            QuantMode::Gptq {
                group_size: 32,
                sym: true,
                lm_head: false,
            },
        ),
        (
            "awq",
            QuantMode::Awq {
                group_size: 32,
                lm_head: false,
            },
        ),
    ] {
        let mut opts = QuantizeOptions {
            calibration: Some(calib.clone()),
            threads: 2,
            ..Default::default()
        };
        opts.gptq.act_order = true;
        opts.awq.clip = true;
        quantize_checkpoint_with(&src, &out.join(name), mode, &opts).unwrap();
    }
}
