//! Options shared by commands: model loading, session shape and sampling.

use crate::args::Args;
use nanoinfer::engine::{
    Model, ModelParams, SessionParams, SessionStats, SpeculativeMethod, SpeculativeParams,
};
use nanoinfer::kv::{KvBackendKind, KvCacheDType};
use nanoinfer::memory::MemoryPoolKind;
use nanoinfer::model::QuantMode;
use nanoinfer::sampling::SamplingParams;
use std::path::PathBuf;
use std::sync::Arc;

pub const MODEL_OPTS: &[&str] = &[
    "model",
    "device",
    "threads",
    "dtype",
    "quant",
    "quant-group-size",
    "quant-lm-head",
    "quant-sym",
];
pub const SESSION_OPTS: &[&str] = &[
    "kv-backend",
    "block-size",
    "kv-capacity",
    "gpu-memory-utilization",
    "memory-utilization",
    "memory-pool",
    "kv-cache-dtype",
    "max-batched-tokens",
    "max-seqs",
    "prefill-chunk",
    "policy",
    "preemption",
    "no-prefix-cache",
    "host-sampling",
    "speculative",
    "draft-model",
    "draft-quant",
    "num-speculative",
    "speculative-max-batch",
    "ngram-min",
    "ngram-max",
];
pub const SAMPLING_OPTS: &[&str] = &[
    "max-tokens",
    "temperature",
    "top-k",
    "top-p",
    "min-p",
    "repetition-penalty",
    "presence-penalty",
    "frequency-penalty",
    "seed",
    "stop",
    "logprobs",
    "ignore-eos",
    "min-tokens",
];

pub fn load_model(a: &Args) -> Result<Arc<Model>, String> {
    let dir = PathBuf::from(a.get("model").ok_or("--model DIR is required")?);
    let params = ModelParams {
        dtype: a.parse_or("dtype", nanoinfer::model::WeightDType::Auto)?,
        threads: a.parse_or("threads", 0)?,
        quant: quant_mode(a)?,
        device: a.parse_or("device", nanoinfer::backend::Device::Cpu)?,
    };
    Model::load(&dir, &params, None)
        .map(Arc::new)
        .map_err(|e| e.to_string())
}

/// `--speculative ngram|draft [--num-speculative N] [--speculative-max-batch N]`,
/// with `--ngram-min N --ngram-max N` for prompt lookup and
/// `--draft-model DIR [--draft-quant none|q8_0|awq|gptq]` for a draft model
/// (loaded on the target's device and threads; quantized at load with its
/// LM head, which is a large part of a small model's weight reads).
fn speculative_params(a: &Args) -> Result<Option<SpeculativeParams>, String> {
    let method = a.get("speculative");
    let draft_dir = a.get("draft-model");
    let k = a.parse_or("num-speculative", 0usize)?;
    let method = match method {
        None => {
            let stray = ["draft-model", "draft-quant", "num-speculative", "ngram-min"];
            if let Some(o) = stray.iter().find(|o| a.get(o).is_some()) {
                return Err(format!("--{o} needs --speculative ngram|draft"));
            }
            return Ok(None);
        }
        Some("ngram") => {
            if draft_dir.is_some() {
                return Err("--draft-model needs --speculative draft".into());
            }
            SpeculativeMethod::Ngram {
                min_n: a.parse_or("ngram-min", 2)?,
                max_n: a.parse_or("ngram-max", 4)?,
            }
        }
        Some("draft") => {
            let dir = draft_dir.ok_or("--speculative draft needs --draft-model DIR")?;
            let params = ModelParams {
                dtype: a.parse_or("dtype", nanoinfer::model::WeightDType::Auto)?,
                threads: a.parse_or("threads", 0)?,
                quant: a.parse_or("draft-quant", QuantMode::None)?.with_lm_head(),
                device: a.parse_or("device", nanoinfer::backend::Device::Cpu)?,
            };
            let draft = Model::load(std::path::Path::new(dir), &params, None)
                .map_err(|e| format!("--draft-model {dir}: {e}"))?;
            SpeculativeMethod::Draft(Arc::new(draft))
        }
        Some(other) => {
            return Err(format!(
                "--speculative must be ngram or draft, got `{other}`"
            ))
        }
    };
    Ok(Some(SpeculativeParams {
        method,
        num_speculative_tokens: k,
        max_batch: a.parse_or("speculative-max-batch", 0)?,
    }))
}

/// One line on what speculation did, for the CLI's summaries.
pub fn speculation_summary(s: &SessionStats) -> String {
    let kept = if s.spec_draft_tokens > 0 {
        100.0 * s.spec_accepted_tokens as f64 / s.spec_draft_tokens as f64
    } else {
        0.0
    };
    format!(
        "speculative: {} drafted, {} kept ({kept:.0} %), {:.2} tokens per verifying step",
        s.spec_draft_tokens,
        s.spec_accepted_tokens,
        s.spec_mean_accepted_length()
    )
}

/// `--quant none|q8_0|awq|gptq|fp8 [--quant-group-size 32|64|128] [--quant-lm-head q8_0|int4|fp8|dense]`
/// (the LM head: q8_0 for q8_0 (its default), int4 for awq/gptq, fp8 for
/// fp8 (default dense); `--quant-sym false` makes gptq asymmetric; fp8 has
/// 128 × 128 blocks, no group size).
pub fn quant_mode(a: &Args) -> Result<QuantMode, String> {
    let mode: QuantMode = a.parse_or("quant", QuantMode::None)?;
    let has_options = a.get("quant-group-size").is_some() || a.get("quant-lm-head").is_some();
    let group_size = |default: usize| -> Result<usize, String> {
        let g = a.parse_or("quant-group-size", default)?;
        if ![32, 64, 128].contains(&g) {
            return Err(format!("--quant-group-size must be 32, 64 or 128, got {g}"));
        }
        Ok(g)
    };
    if a.get("quant-sym").is_some() && !matches!(mode, QuantMode::Gptq { .. }) {
        return Err("--quant-sym needs --quant gptq".to_string());
    }
    match mode {
        QuantMode::None if has_options => {
            Err("--quant-group-size and --quant-lm-head need --quant q8_0".to_string())
        }
        QuantMode::None => Ok(mode),
        QuantMode::Fp8 { .. } if a.get("quant-group-size").is_some() => {
            Err("--quant-group-size does not apply to --quant fp8 (128 × 128 blocks)".to_string())
        }
        QuantMode::Fp8 { .. } => Ok(QuantMode::Fp8 {
            lm_head: match a.get("quant-lm-head") {
                None | Some("dense") => false,
                Some("fp8") => true,
                Some(other) => {
                    return Err(format!(
                        "--quant-lm-head must be fp8 or dense with --quant fp8, got `{other}`"
                    ))
                }
            },
        }),
        QuantMode::Awq { group_size: g, .. } => Ok(QuantMode::Awq {
            group_size: group_size(g)?,
            lm_head: int4_lm_head(a)?,
        }),
        QuantMode::Gptq {
            group_size: g, sym, ..
        } => Ok(QuantMode::Gptq {
            group_size: group_size(g)?,
            sym: a.parse_or("quant-sym", sym)?,
            lm_head: int4_lm_head(a)?,
        }),
        QuantMode::Q8_0 {
            group_size,
            lm_head,
        } => {
            let group_size = a.parse_or("quant-group-size", group_size)?;
            if ![32, 64, 128].contains(&group_size) {
                return Err(format!(
                    "--quant-group-size must be 32, 64 or 128, got {group_size}"
                ));
            }
            let lm_head = match a.get("quant-lm-head") {
                None => lm_head,
                Some("q8_0") => true,
                Some("dense") => false,
                Some(other) => {
                    return Err(format!(
                        "--quant-lm-head must be q8_0 or dense, got `{other}`"
                    ))
                }
            };
            Ok(QuantMode::Q8_0 {
                group_size,
                lm_head,
            })
        }
    }
}

/// `--quant-lm-head int4|dense` of `--quant awq|gptq` (default dense).
fn int4_lm_head(a: &Args) -> Result<bool, String> {
    match a.get("quant-lm-head") {
        None | Some("dense") => Ok(false),
        Some("int4") => Ok(true),
        Some(other) => Err(format!(
            "--quant-lm-head must be int4 or dense with --quant awq|gptq, got `{other}`"
        )),
    }
}

pub fn session_params(a: &Args) -> Result<SessionParams, String> {
    let d = SessionParams::default();
    let kv_backend = match a.get("kv-backend").unwrap_or("paged") {
        "paged" => KvBackendKind::Paged,
        "token" => KvBackendKind::Token,
        other => {
            return Err(format!(
                "--kv-backend must be paged or token, got `{other}`"
            ))
        }
    };
    Ok(SessionParams {
        kv_backend,
        block_size: a.parse_or("block-size", d.block_size)?,
        kv_capacity_tokens: a.parse_or("kv-capacity", d.kv_capacity_tokens)?,
        gpu_memory_utilization: a.parse_or("gpu-memory-utilization", d.gpu_memory_utilization)?,
        memory_utilization: a.parse_or("memory-utilization", d.memory_utilization)?,
        memory_pool: memory_pool(a)?,
        max_batched_tokens: a.parse_or("max-batched-tokens", d.max_batched_tokens)?,
        max_seqs: a.parse_or("max-seqs", d.max_seqs)?,
        prefill_chunk_size: a.parse_or("prefill-chunk", d.prefill_chunk_size)?,
        policy: a.parse_or("policy", d.policy)?,
        preemption: a.parse_or("preemption", d.preemption)?,
        prefix_caching: !a.flag("no-prefix-cache"),
        seed: a.parse_or("seed", d.seed)?,
        device_sampling: !a.flag("host-sampling"),
        kv_cache_dtype: kv_cache_dtype(a)?,
        speculative: speculative_params(a)?,
        ..d
    })
}

/// `--kv-cache-dtype auto|fp8` (default auto: the activation dtype).
pub fn kv_cache_dtype(a: &Args) -> Result<KvCacheDType, String> {
    a.parse_or("kv-cache-dtype", KvCacheDType::Auto)
}

/// `--memory-pool arena|slab|system|cuda-stream|cuda-buddy` (default: the
/// device's, arena on the CPU and cuda-stream on a GPU).
pub fn memory_pool(a: &Args) -> Result<Option<MemoryPoolKind>, String> {
    a.get("memory-pool")
        .map(|v| {
            v.parse()
                .map_err(|e: nanoinfer::Error| format!("--memory-pool: {}", e.message))
        })
        .transpose()
}

pub fn sampling_params(a: &Args) -> Result<SamplingParams, String> {
    let d = SamplingParams::default();
    Ok(SamplingParams {
        temperature: a.parse_or("temperature", d.temperature)?,
        top_k: a.parse_or("top-k", d.top_k)?,
        top_p: a.parse_or("top-p", d.top_p)?,
        min_p: a.parse_or("min-p", d.min_p)?,
        repetition_penalty: a.parse_or("repetition-penalty", d.repetition_penalty)?,
        presence_penalty: a.parse_or("presence-penalty", d.presence_penalty)?,
        frequency_penalty: a.parse_or("frequency-penalty", d.frequency_penalty)?,
        seed: a
            .get("seed")
            .map(|s| s.parse().map_err(|e| format!("invalid --seed `{s}`: {e}")))
            .transpose()?,
        max_tokens: a.parse_or("max-tokens", d.max_tokens)?,
        min_tokens: a.parse_or("min-tokens", d.min_tokens)?,
        stop_strings: a.all("stop").to_vec(),
        ignore_eos: a.flag("ignore-eos"),
        logprobs: a.parse_or("logprobs", d.logprobs)?,
        ..d
    })
}
