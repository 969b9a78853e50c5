//! FP8 weights (E4M3), named by config.json's `quantization_config` with
//! `quant_method: "fp8"`, in the three scale layouts the common tools write:
//!
//! - **block-wise** (transformers' FineGrainedFP8, DeepSeek-V3, Qwen3-FP8):
//!   `weight_block_size: [bn, bk]`; `X.weight` F8_E4M3 `[rows, cols]` and
//!   `X.weight_scale_inv` `[ceil(rows/bn), ceil(cols/bk)]`, each weight
//!   `q · s` of its block (despite the name, the tools multiply);
//! - **per-tensor** (AutoFP8, vLLM's `fp8` method): `X.weight_scale` of one value;
//! - **per-channel**: `X.weight_scale` of `[rows]` or `[rows, 1]` values.
//!
//! Layers left dense (`modules_to_not_convert`, `ignored_layers`, usually
//! the LM head) are found by their dtype. The activation scheme (dynamic,
//! or static with `X.input_scale`) is for kernels that multiply activations
//! in FP8; none here does, so no input scale is read. Every layout loads as
//! [`Fp8Rows`] (codes and a scale per row and column group): the CPU
//! dequantizes them to F32 when it packs its weights (exactly the values the
//! checkpoint holds, up to f32 rounding of `q · s`), CUDA keeps the codes
//! and its GEMVs scale each chunk's sum.
//!
//! `--quant fp8` and `nanoinfer quantize --method fp8` use 128 × 128 blocks,
//! scale = the block's largest magnitude / 448: the format transformers reads.

use super::quant::{check_matrix_len, ExportTensor, QuantMethod};
use super::safetensors::WeightFiles;
use crate::backend::cpu::{Matrix, MatrixData};
use crate::tensor::dtype::SafetensorsDType;
use crate::tensor::fp8::{f32_to_e4m3, Fp8Rows, E4M3_MAX};
use crate::{bail_model, Error, Result};
use serde_json::{json, Value};
use std::collections::HashMap;

/// Block size of `--quant fp8` and `quantize --method fp8`.
pub const FP8_DEFAULT_BLOCK: usize = 128;

/// Largest block side accepted from a checkpoint's config (a bound for
/// hostile configs; real ones use 128).
const MAX_BLOCK: usize = 1 << 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8 {
    /// `(rows, cols)` of a scale block; `None`: per-tensor or per-channel
    /// scales, told apart by each scale tensor's shape.
    block: Option<(usize, usize)>,
    lm_head: bool,
}

impl Fp8 {
    /// The format of `--quant fp8`: 128 × 128 blocks.
    pub fn blockwise(lm_head: bool) -> Fp8 {
        Fp8 {
            block: Some((FP8_DEFAULT_BLOCK, FP8_DEFAULT_BLOCK)),
            lm_head,
        }
    }

    /// Parses config.json's `quantization_config` (`quant_method: "fp8"`).
    pub fn from_config(q: &Value) -> Result<Fp8> {
        let field = |k: &str| q.get(k).filter(|v| !v.is_null());
        if let Some(fmt) = field("fmt") {
            if fmt.as_str() != Some("e4m3") {
                bail_model!(
                    "config.json quantization_config: fp8 `fmt` {fmt} is not supported (e4m3 only)"
                );
            }
        }
        if let Some(scheme) = field("activation_scheme") {
            if !matches!(scheme.as_str(), Some("dynamic" | "static")) {
                bail_model!("config.json quantization_config: fp8 `activation_scheme` {scheme} is not supported (dynamic, static)");
            }
        }
        let block = match field("weight_block_size") {
            None => None,
            Some(b) => {
                let side = |v: &Value| {
                    v.as_u64()
                        .map(|n| n as usize)
                        .filter(|&n| (1..=MAX_BLOCK).contains(&n))
                };
                match b.as_array().map(|a| a.iter().map(side).collect::<Vec<_>>()) {
                    Some(s) if s.len() == 2 && s.iter().all(Option::is_some) => {
                        Some((s[0].unwrap(), s[1].unwrap()))
                    }
                    _ => bail_model!("config.json quantization_config: fp8 `weight_block_size` must be two integers in 1..={MAX_BLOCK}, got {b}"),
                }
            }
        };
        Ok(Fp8 {
            block,
            lm_head: false,
        })
    }

    /// Codes and block scales of a row-major `[rows, cols]` matrix.
    fn quantize_blocks(&self, rows: usize, cols: usize, w: &[f32]) -> (Vec<u8>, Vec<f32>) {
        let (bn, bk) = self.block.expect("quantizing writes block-wise scales");
        let (br, bc) = (rows.div_ceil(bn), cols.div_ceil(bk));
        let mut scales = vec![0f32; br * bc];
        for r in 0..rows {
            for (j, chunk) in w[r * cols..(r + 1) * cols].chunks(bk).enumerate() {
                let s = &mut scales[block_of(r, j * bk, (bn, bk), bc)];
                *s = chunk.iter().fold(*s, |m, v| m.max(v.abs()));
            }
        }
        // An all-zero block keeps scale 1 (its codes are 0 either way).
        for s in &mut scales {
            *s = if *s > 0.0 { *s / E4M3_MAX } else { 1.0 };
        }
        let mut q = vec![0u8; rows * cols];
        for r in 0..rows {
            let row = &w[r * cols..(r + 1) * cols];
            for (c, (o, &v)) in q[r * cols..(r + 1) * cols].iter_mut().zip(row).enumerate() {
                *o = f32_to_e4m3(v / scales[block_of(r, c, (bn, bk), bc)]);
            }
        }
        (q, scales)
    }

    /// The matrix of codes `q` with one scale per row and group of
    /// `group_cols` columns (`row_scales`, `[rows, groups]`), checked: a
    /// weight whose value is not finite is an error naming it.
    fn matrix(
        name: &str,
        rows: usize,
        cols: usize,
        q: &[u8],
        row_scales: Vec<f32>,
        group_cols: usize,
    ) -> Result<Matrix> {
        let mut codes = Vec::new();
        codes.try_reserve_exact(q.len()).map_err(|_| {
            Error::new(
                crate::ErrorKind::OutOfMemory,
                format!("no memory for the codes of `{name}` ([{rows}, {cols}] fp8)"),
            )
        })?;
        codes.extend_from_slice(q);
        let m = Fp8Rows {
            rows,
            cols,
            codes,
            scales: row_scales,
            group_cols,
        };
        if let Some(i) = m.first_non_finite() {
            bail_model!(
                "fp8 weight `{name}`: code times scale overflows at element {i} (row {}, column {})",
                i / cols,
                i % cols
            );
        }
        Ok(Matrix {
            rows,
            cols,
            data: MatrixData::Fp8(m),
        })
    }
}

/// Block scales (`[ceil(rows/bn), bc]`) repeated for every row of a block.
fn rows_of_blocks(s: &[f32], rows: usize, bn: usize, bc: usize) -> Vec<f32> {
    (0..rows)
        .flat_map(|r| s[(r / bn) * bc..(r / bn + 1) * bc].iter().copied())
        .collect()
}

/// Index into row-major block scales (`bc` blocks per row of blocks) of
/// weight `(r, c)` under `(bn, bk)` blocks.
fn block_of(r: usize, c: usize, (bn, bk): (usize, usize), bc: usize) -> usize {
    (r / bn) * bc + c / bk
}

fn scale_name(name: &str, blockwise: bool) -> String {
    if blockwise {
        format!("{name}_scale_inv")
    } else {
        format!("{name}_scale")
    }
}

impl QuantMethod for Fp8 {
    fn name(&self) -> &'static str {
        "fp8"
    }

    fn metadata(&self) -> HashMap<String, String> {
        HashMap::new()
    }

    fn quantizes_lm_head(&self) -> bool {
        self.lm_head
    }

    fn quantize(&self, rows: usize, cols: usize, w: &[f32]) -> Result<Matrix> {
        check_matrix_len("fp8 matrix", rows, cols, w)?;
        let (q, scales) = self.quantize_blocks(rows, cols, w);
        let (bn, bk) = self.block.expect("block-wise");
        let row_scales = rows_of_blocks(&scales, rows, bn, cols.div_ceil(bk));
        Fp8::matrix("(at load)", rows, cols, &q, row_scales, bk)
    }

    fn export(&self, name: &str, rows: usize, cols: usize, w: &[f32]) -> Result<Vec<ExportTensor>> {
        check_matrix_len(name, rows, cols, w)?;
        let (bn, bk) = self.block.expect("block-wise");
        let (q, scales) = self.quantize_blocks(rows, cols, w);
        Ok(vec![
            ExportTensor {
                name: name.to_string(),
                dtype: safetensors::Dtype::F8_E4M3,
                shape: vec![rows, cols],
                bytes: q,
            },
            ExportTensor {
                name: scale_name(name, true),
                dtype: safetensors::Dtype::F32,
                shape: vec![rows.div_ceil(bn), cols.div_ceil(bk)],
                bytes: scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
            },
        ])
    }

    fn load(&self, files: &WeightFiles, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let q = files.require(name, &[rows, cols])?;
        let q = q.as_e4m3()?;
        let sname = scale_name(name, self.block.is_some());
        let Some(info) = files.info(&sname) else {
            bail_model!("fp8 checkpoint has `{name}` but no `{sname}`");
        };
        if let Some((bn, bk)) = self.block {
            let (br, bc) = (rows.div_ceil(bn), cols.div_ceil(bk));
            let s = files.require(&sname, &[br, bc])?.to_f32()?;
            return Fp8::matrix(name, rows, cols, q, rows_of_blocks(&s, rows, bn, bc), bk);
        }
        let shape = info.shape.to_vec();
        let s = files.require(&sname, &shape)?.to_f32()?;
        let group = cols.max(1);
        match shape.as_slice() {
            [] | [1] => Fp8::matrix(name, rows, cols, q, vec![s[0]; rows], group),
            [n] | [n, 1] if *n == rows => Fp8::matrix(name, rows, cols, q, s.to_vec(), group),
            other => bail_model!(
                "fp8 scale `{sname}` has shape {other:?}: expected one value (per tensor) or [{rows}] / [{rows}, 1] (per output channel); block-wise scales need `weight_block_size` in quantization_config"
            ),
        }
    }

    /// Stored as FP8 when the tensor's dtype is F8_E4M3 (layers the tool
    /// left out are dense under the same name).
    fn stored_in(&self, files: &WeightFiles, name: &str) -> bool {
        files
            .info(name)
            .is_some_and(|i| i.dtype == SafetensorsDType::F8E4M3)
    }

    fn quantization_config(&self) -> Option<Value> {
        let mut qc = json!({
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
        });
        if let Some((bn, bk)) = self.block {
            qc["weight_block_size"] = json!([bn, bk]);
        }
        if !self.lm_head {
            qc["modules_to_not_convert"] = json!(["lm_head"]);
        }
        Some(qc)
    }
}
