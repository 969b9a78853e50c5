//! The weights seam: how a linear layer's matrix is quantized, stored in a
//! checkpoint and loaded (vLLM's `QuantizationConfig` in small).
//!
//! A [`QuantMethod`] is picked either from a checkpoint's `__metadata__`
//! (`{"quantization": "q8_0", "group_size": "32"}`, route A) or from
//! [`QuantMode`] in the model params (route B: quantize F32/F16/BF16 weights
//! at load). Embeddings and norms always stay in higher precision; whether
//! the LM head is quantized is the method's policy. Int4 AWQ/GPTQ
//! checkpoints (see `quant_int4.rs`) are named by config.json's
//! `quantization_config` instead (their own convention), parsed into
//! [`ModelConfig::quantization`](super::ModelConfig), as are FP8 checkpoints
//! (`quant_fp8.rs`). A new format adds an implementation and a name here.

use super::quant_fp8::Fp8;
use super::quant_int4::Int4;
use super::quant_q8::Q8_0;
use super::safetensors::WeightFiles;
use crate::backend::cpu::Matrix;
use crate::{bail_arg, bail_model, Result};
use std::collections::HashMap;

/// Online quantization requested by the model params.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QuantMode {
    /// Keep the checkpoint's weights (a quantized checkpoint still loads quantized).
    #[default]
    None,
    /// Int8 weights, one f32 scale per `group_size` inputs of a row.
    Q8_0 {
        group_size: usize,
        /// Quantize the LM head too (a tied head gets its own int8 copy; the
        /// embedding table stays dense).
        lm_head: bool,
    },
    /// Int4 round-to-nearest in AWQ's convention (min/max range per group).
    /// Checkpoints: `nanoinfer quantize --method awq`. `lm_head`: the LM
    /// head in int4 too (at load only: AWQ checkpoints keep it dense).
    Awq { group_size: usize, lm_head: bool },
    /// Int4 round-to-nearest in GPTQ's convention (sym: `z = 8`); `lm_head`:
    /// the LM head in int4 too (GPTQ's `lm_head: true`).
    Gptq {
        group_size: usize,
        sym: bool,
        lm_head: bool,
    },
    /// FP8 E4M3 with 128 × 128 block scales (transformers' FineGrainedFP8
    /// layout); `lm_head`: the LM head in FP8 too. The CPU computes with
    /// the dequantized values.
    Fp8 { lm_head: bool },
}

pub const DEFAULT_GROUP_SIZE: usize = 32;
/// Group size of `--quant awq|gptq` unless told otherwise.
pub const INT4_DEFAULT_GROUP_SIZE: usize = 128;

impl QuantMode {
    /// Q8_0 with group 32 and a quantized LM head.
    pub const Q8_0_DEFAULT: QuantMode = QuantMode::Q8_0 {
        group_size: DEFAULT_GROUP_SIZE,
        lm_head: true,
    };

    /// This mode with the LM head quantized too (int4 for AWQ/GPTQ, int8
    /// for Q8_0): the choice for a draft model, whose head is a large part
    /// of its weight reads.
    pub fn with_lm_head(self) -> QuantMode {
        match self {
            QuantMode::None => QuantMode::None,
            QuantMode::Q8_0 { group_size, .. } => QuantMode::Q8_0 {
                group_size,
                lm_head: true,
            },
            QuantMode::Awq { group_size, .. } => QuantMode::Awq {
                group_size,
                lm_head: true,
            },
            QuantMode::Gptq {
                group_size, sym, ..
            } => QuantMode::Gptq {
                group_size,
                sym,
                lm_head: true,
            },
            QuantMode::Fp8 { .. } => QuantMode::Fp8 { lm_head: true },
        }
    }

    /// The method this mode quantizes with, `None` for [`QuantMode::None`].
    pub fn method(self) -> Result<Option<Box<dyn QuantMethod>>> {
        Ok(match self {
            QuantMode::None => None,
            QuantMode::Q8_0 {
                group_size,
                lm_head,
            } => Some(Box::new(Q8_0::new(group_size, lm_head)?)),
            QuantMode::Awq {
                group_size,
                lm_head,
            } => Some(Box::new(Int4::awq(group_size)?.with_lm_head(lm_head))),
            QuantMode::Gptq {
                group_size,
                sym,
                lm_head,
            } => Some(Box::new(Int4::gptq(group_size, sym)?.with_lm_head(lm_head))),
            QuantMode::Fp8 { lm_head } => Some(Box::new(Fp8::blockwise(lm_head))),
        })
    }
}

impl std::str::FromStr for QuantMode {
    type Err = crate::Error;
    /// `none`, `q8_0` (group 32, LM head quantized), `awq` or `gptq` (int4,
    /// group 128, GPTQ symmetric; LM head dense), `fp8` (E4M3, 128 × 128
    /// blocks; LM head dense).
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "none" | "" => Ok(QuantMode::None),
            "q8_0" | "q8" => Ok(QuantMode::Q8_0_DEFAULT),
            "awq" | "int4" => Ok(QuantMode::Awq {
                group_size: INT4_DEFAULT_GROUP_SIZE,
                lm_head: false,
            }),
            "gptq" => Ok(QuantMode::Gptq {
                group_size: INT4_DEFAULT_GROUP_SIZE,
                sym: true,
                lm_head: false,
            }),
            "fp8" => Ok(QuantMode::Fp8 { lm_head: false }),
            _ => {
                bail_arg!(
                    "quantization `{s}` is not supported (supported: none, q8_0, awq, gptq, fp8)"
                )
            }
        }
    }
}

/// The format config.json's `quantization_config` names: int4 (AWQ, GPTQ)
/// or FP8.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredQuant {
    Int4(Int4),
    Fp8(Fp8),
}

impl StoredQuant {
    /// Parses `quantization_config` by its `quant_method`.
    pub fn from_config(q: &serde_json::Value) -> Result<StoredQuant> {
        match q.get("quant_method").and_then(serde_json::Value::as_str) {
            Some(m) if m.eq_ignore_ascii_case("fp8") => Ok(StoredQuant::Fp8(Fp8::from_config(q)?)),
            _ => Ok(StoredQuant::Int4(Int4::from_config(q)?)),
        }
    }

    pub fn method(&self) -> &dyn QuantMethod {
        match self {
            StoredQuant::Int4(m) => m,
            StoredQuant::Fp8(m) => m,
        }
    }
}

/// Refuses `w` unless it holds exactly the `rows × cols` values of matrix
/// `name`.
pub fn check_matrix_len(name: &str, rows: usize, cols: usize, w: &[f32]) -> Result<()> {
    if w.len() != rows * cols {
        bail_arg!(
            "{name}: [{rows}, {cols}] needs {} values, got {}",
            rows * cols,
            w.len()
        );
    }
    Ok(())
}

/// One tensor to write into a quantized checkpoint.
pub struct ExportTensor {
    pub name: String,
    pub dtype: safetensors::Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// A weight quantization format.
pub trait QuantMethod: Send + Sync {
    /// Its `quantization` metadata value, e.g. `q8_0`.
    fn name(&self) -> &'static str;
    /// `__metadata__` entries of a checkpoint in this format.
    fn metadata(&self) -> HashMap<String, String>;
    /// Whether the LM head is quantized too.
    fn quantizes_lm_head(&self) -> bool;
    /// Route B: the kernel matrix for a row-major f32 `[rows, cols]` matrix.
    fn quantize(&self, rows: usize, cols: usize, w: &[f32]) -> Result<Matrix>;
    /// Offline: the checkpoint tensors that store `name` (`[rows, cols]`).
    fn export(&self, name: &str, rows: usize, cols: usize, w: &[f32]) -> Result<Vec<ExportTensor>>;
    /// Route A: loads `name` as stored by [`export`](Self::export).
    fn load(&self, files: &WeightFiles, name: &str, rows: usize, cols: usize) -> Result<Matrix>;
    /// Whether `files` stores weight `name` in this format (rather than dense).
    fn stored_in(&self, files: &WeightFiles, name: &str) -> bool {
        files.contains(name)
    }
    /// config.json's `quantization_config` of a checkpoint in this format,
    /// for formats that are named there rather than in `__metadata__`.
    fn quantization_config(&self) -> Option<serde_json::Value> {
        None
    }
}

/// The method a checkpoint was quantized with, from its `__metadata__`
/// (`None` for a dense checkpoint).
pub fn method_from_metadata(
    meta: &HashMap<String, String>,
) -> Result<Option<Box<dyn QuantMethod>>> {
    let Some(name) = meta.get("quantization") else {
        return Ok(None);
    };
    match name.to_ascii_lowercase().as_str() {
        "q8_0" => {
            let group = meta.get("group_size").ok_or_else(|| {
                crate::Error::invalid_model("q8_0 checkpoint metadata has no `group_size`")
            })?;
            let group: usize = group.parse().map_err(|_| {
                crate::Error::invalid_model(format!(
                    "q8_0 checkpoint metadata `group_size` is `{group}`, not a positive integer"
                ))
            })?;
            let lm_head = meta.get("lm_head").is_none_or(|v| v == "q8_0");
            Ok(Some(Box::new(Q8_0::new(group, lm_head).map_err(|e| {
                crate::Error::invalid_model(format!("q8_0 checkpoint metadata: {e}"))
            })?)))
        }
        other => {
            bail_model!("checkpoint quantization `{other}` is not supported (supported: q8_0)")
        }
    }
}
