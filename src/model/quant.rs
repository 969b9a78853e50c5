//! The weights seam: how a linear layer's matrix is quantized, stored in a
//! checkpoint and loaded (vLLM's `QuantizationConfig` in small).
//!
//! A [`QuantMethod`] is picked either from a checkpoint's `__metadata__`
//! (`{"quantization": "q8_0", "group_size": "32"}`, route A) or from
//! [`QuantMode`] in the model params (route B: quantize F32/F16/BF16 weights
//! at load). Embeddings and norms always stay in higher precision; whether
//! the LM head is quantized is the method's policy. New formats (AWQ/GPTQ
//! int4, FP8) add an implementation and a name in [`method_from_metadata`].

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
}

pub const DEFAULT_GROUP_SIZE: usize = 32;

impl QuantMode {
    /// Q8_0 with group 32 and a quantized LM head.
    pub const Q8_0_DEFAULT: QuantMode = QuantMode::Q8_0 {
        group_size: DEFAULT_GROUP_SIZE,
        lm_head: true,
    };

    /// The method this mode quantizes with, `None` for [`QuantMode::None`].
    pub fn method(self) -> Result<Option<Box<dyn QuantMethod>>> {
        Ok(match self {
            QuantMode::None => None,
            QuantMode::Q8_0 {
                group_size,
                lm_head,
            } => Some(Box::new(Q8_0::new(group_size, lm_head)?)),
        })
    }
}

impl std::str::FromStr for QuantMode {
    type Err = crate::Error;
    /// `none` or `q8_0` (group 32, LM head quantized).
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "none" | "" => Ok(QuantMode::None),
            "q8_0" | "q8" => Ok(QuantMode::Q8_0_DEFAULT),
            _ => bail_arg!("quantization `{s}` is not supported (supported: none, q8_0)"),
        }
    }
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
