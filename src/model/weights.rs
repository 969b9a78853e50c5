//! Where decoder weights come from: a name → tensor source, converted into the
//! matrix/vector forms the CPU backend computes with.

use super::quant::QuantMethod;
use crate::backend::cpu::Matrix;
use crate::Result;

/// Storage dtype the caller wants weights converted to at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightDType {
    /// Keep the checkpoint's dtype (zero-copy where possible).
    Auto,
    F32,
    F16,
    BF16,
}

impl std::str::FromStr for WeightDType {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "auto" => WeightDType::Auto,
            "f32" | "float32" => WeightDType::F32,
            "f16" | "float16" => WeightDType::F16,
            "bf16" | "bfloat16" => WeightDType::BF16,
            _ => crate::bail_arg!("dtype `{s}` is not supported (supported: auto, f32, f16, bf16)"),
        })
    }
}

/// A source of named tensors with expected shapes.
pub trait WeightSource {
    fn contains(&self, name: &str) -> bool;
    /// A `[rows, cols]` matrix, converted to `dtype`.
    fn matrix(&self, name: &str, rows: usize, cols: usize, dtype: WeightDType) -> Result<Matrix>;
    /// A 1-D tensor of `len` values as f32.
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>>;
    /// Weight `name` (`[rows, cols]`) as stored in the checkpoint format
    /// `method` (int4 AWQ/GPTQ), `None` when it is not stored that way.
    fn quantized(
        &self,
        method: &dyn QuantMethod,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Matrix>> {
        let _ = (method, name, rows, cols);
        Ok(None)
    }
    /// Whether weight `name` is stored in the checkpoint format `method`.
    fn stores_quantized(&self, method: &dyn QuantMethod, name: &str) -> bool {
        let _ = (method, name);
        false
    }
}
