//! `nanoinfer quantize`: writes a quantized copy of a dense model directory:
//! `--method q8_0` (our int8 format, named in the safetensors metadata) or
//! `--method awq|gptq` (int4 round-to-nearest checkpoints in AutoAWQ's GEMM /
//! GPTQ's layout with config.json's `quantization_config`; `--group-size`
//! 32|64|128, default 128; `--sym false` for asymmetric GPTQ), or
//! `--method fp8` (E4M3 with 128 × 128 block scales in transformers'
//! FineGrainedFP8 layout).
//! Round-to-nearest unless `--calib FILE` names calibration text: then AWQ
//! searches activation-aware scales and clipping, and GPTQ runs GPTQ
//! (`--act-order` for desc_act), on the first `--calib-tokens N` tokens
//! (default 2048) of the file; `--damp F`: GPTQ's damping (default 0.01);
//! `--awq-clip`: AWQ's clipping search too.

use crate::args::Args;
use crate::session_opts::quant_mode;
use nanoinfer::model::QuantMode;
use nanoinfer::quantize::calib::{Calibration, DEFAULT_CALIB_TOKENS};
use nanoinfer::quantize::{quantize_checkpoint_with, QuantizeOptions};
use serde_json::json;
use std::path::Path;
use std::time::Instant;

pub const FLAGS: &[&str] = &["json", "act-order", "awq-clip"];

pub fn run(a: &Args) -> Result<(), String> {
    a.check_known(
        &[
            FLAGS,
            &[
                "model",
                "out",
                "method",
                "group-size",
                "lm-head",
                "sym",
                "calib",
                "calib-tokens",
                "threads",
                "damp",
            ],
        ]
        .concat(),
    )?;
    let model = a.get("model").ok_or("--model DIR is required")?;
    let out = a.get("out").ok_or("--out DIR is required")?;
    let method = a
        .get("method")
        .ok_or("--method q8_0|awq|gptq|fp8 is required")?;
    // Same option checks as --quant on the other commands.
    let mut forwarded = vec!["--quant".to_string(), method.to_string()];
    for (ours, theirs) in [
        ("group-size", "quant-group-size"),
        ("lm-head", "quant-lm-head"),
        ("sym", "quant-sym"),
    ] {
        if let Some(v) = a.get(ours) {
            forwarded.extend([format!("--{theirs}"), v.to_string()]);
        }
    }
    let mode = quant_mode(&Args::parse(&forwarded, &[])?)?;
    if mode == QuantMode::None {
        return Err("--method must name a quantization (q8_0, awq, gptq, fp8)".to_string());
    }
    let calib_tokens: usize = a.parse_or("calib-tokens", DEFAULT_CALIB_TOKENS)?;
    if a.get("calib").is_none()
        && (a.get("calib-tokens").is_some() || a.flag("act-order") || a.flag("awq-clip"))
    {
        return Err("--calib-tokens, --act-order and --awq-clip need --calib FILE".to_string());
    }
    let start = Instant::now();
    let mut opts = QuantizeOptions {
        threads: a.parse_or("threads", 0)?,
        ..Default::default()
    };
    opts.gptq.act_order = a.flag("act-order");
    opts.awq.clip = a.flag("awq-clip");
    opts.gptq.damp = a.parse_or("damp", opts.gptq.damp)?;
    if let Some(path) = a.get("calib") {
        if !matches!(mode, QuantMode::Awq { .. } | QuantMode::Gptq { .. }) {
            return Err("--calib applies to --method awq|gptq".to_string());
        }
        opts.calibration = Some(
            Calibration::from_file(Path::new(model), Path::new(path), calib_tokens)
                .map_err(|e| e.to_string())?,
        );
    }
    let r = quantize_checkpoint_with(Path::new(model), Path::new(out), mode, &opts)
        .map_err(|e| e.to_string())?;
    let secs = start.elapsed().as_secs_f64();
    if a.flag("json") {
        println!(
            "{}",
            json!({
                "quantized": r.quantized, "kept": r.kept, "files_copied": r.files_copied,
                "bytes_in": r.bytes_in, "bytes_out": r.bytes_out, "seconds": secs,
                "calibration_tokens": r.calibration_tokens,
            })
        );
    } else {
        println!(
            "{model} -> {out}: {} matrices quantized{}, {} tensors kept, {} files copied, {:.1} MB -> {:.1} MB in {secs:.1} s",
            r.quantized,
            if r.calibration_tokens > 0 {
                format!(" (calibrated on {} tokens)", r.calibration_tokens)
            } else {
                " (round-to-nearest)".to_string()
            },
            r.kept,
            r.files_copied,
            r.bytes_in as f64 / 1e6,
            r.bytes_out as f64 / 1e6
        );
    }
    Ok(())
}
