//! Int4 checkpoints: AWQ (GEMM layout) and GPTQ, as written by AutoAWQ /
//! GPTQModel / AutoGPTQ and read by transformers, chosen by
//! `quantization_config` in config.json. A linear layer `X.weight` is stored
//! as `X.qweight`, `X.qzeros`, `X.scales` (and GPTQ's `X.g_idx`); layers
//! left dense (`modules_to_not_convert`, the LM head) keep `X.weight`.
//! Dequantization is `w = (q − z) · s` per group of `group_size` inputs.
//!
//! **AWQ** (`quant_method: "awq"`, `version: "gemm"`, `zero_point: true`):
//! - `qweight` I32 `[in, out/8]`: word `(i, c)` holds `q[8c + ORDER[p], i]`
//!   in bits `4p..4p+4`, `ORDER = [0, 2, 4, 6, 1, 3, 5, 7]`; unpacking reads
//!   column `8c + j` from nibble `[0, 4, 1, 5, 2, 6, 3, 7][j]`.
//! - `qzeros` I32 `[groups, out/8]`, same packing; `z` is stored as is.
//! - `scales` F16 `[groups, out]`.
//!
//! **GPTQ** (`quant_method: "gptq"`, `bits: 4`):
//! - `qweight` I32 `[in/8, out]`: word `(r, o)` holds `q[o, 8r + p]` in bits
//!   `4p..4p+4` (packed along the inputs, in order).
//! - `qzeros` I32 `[groups, out/8]`: word `(g, c)` holds the zero of output
//!   `8c + p` in bits `4p..4p+4`.
//! - `scales` F16 `[groups, out]`; `g_idx` I32 `[in]`: the group of each
//!   input (`i / group_size` unless `desc_act`, act-order).
//! - Zero convention: the original format (`checkpoint_format: "gptq"`, the
//!   default; GPTQ v1) stores `z − 1` (AutoGPTQ's packer subtracts one and
//!   its kernels, transformers/optimum and GPTQModel's v1→v2 conversion add
//!   it back), so symmetric 4-bit checkpoints store 7 for `z = 8`.
//!   GPTQModel's `checkpoint_format: "gptq_v2"` stores `z` itself. Both load.
//!   `sym: true` means `z = 8` everywhere (we still read the stored zeros).
//!
//! `groups = ceil(in / group_size)`: the last group may be partial. (GPTQ
//! defines it so; AWQ's tools require `in % group_size == 0`, so an AWQ
//! checkpoint with a partial group — e.g. ours of SmolLM2, in = 576, at
//! group 128 — loads here and in readers that slice `repeat_interleave`d
//! scales, but not in AutoAWQ's kernels.) GPTQ `group_size: -1` is one group
//! per row.
//!
//! Our writer ([`Int4::export`]) does round-to-nearest per group: AWQ the way
//! AutoAWQ's `pseudo_quantize_tensor` does (min/max range, zero clamped to
//! 0..=15), GPTQ the way its `Quantizer` does (sym: `s = 2·max|w| / 15`,
//! `z = 8`; asym: range widened to include 0, and for the v1 format the zero
//! clamped to ≥ 1 so that `z − 1` is a valid nibble). Scales are rounded to
//! f16 before the weights are quantized with them.

use super::quant::{check_matrix_len, ExportTensor, QuantMethod};
use super::safetensors::WeightFiles;
use crate::backend::cpu::q4::{groups_per_row, ACT_BLOCK};
use crate::backend::cpu::{Matrix, MatrixData, Q4Matrix};
use crate::{bail_arg, bail_model, Error, Result};
use serde_json::{json, Value};
use std::collections::HashMap;

/// Column order of the nibbles AWQ packs into one int32 (nibble `p` holds column `ORDER[p]`).
pub const AWQ_ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];
/// Nibble that holds column `j` of an AWQ int32.
pub const AWQ_REVERSE_ORDER: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int4Format {
    /// AutoAWQ GEMM layout.
    Awq,
    /// GPTQ; `v2`: zeros stored without GPTQ v1's −1.
    Gptq { sym: bool, desc_act: bool, v2: bool },
}

/// An int4 checkpoint format with its group size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Int4 {
    pub format: Int4Format,
    /// Inputs per group; `None`: one group per row (GPTQ `group_size: -1`).
    pub group: Option<usize>,
    /// The LM head is int4 too (GPTQ's `lm_head: true`, as GPTQModel writes
    /// it; AWQ keeps it dense). A tied head gets its own int4 copy.
    pub lm_head: bool,
}

fn check_group(group: i64, allow_per_row: bool) -> Result<Option<usize>> {
    if group == -1 && allow_per_row {
        return Ok(None);
    }
    if group <= 0 || group % ACT_BLOCK as i64 != 0 {
        bail_arg!(
            "int4 group size must be a positive multiple of {ACT_BLOCK} (32, 64, 128){}, got {group}",
            if allow_per_row { " or -1" } else { "" }
        );
    }
    Ok(Some(group as usize))
}

impl Int4 {
    pub fn awq(group: usize) -> Result<Int4> {
        Ok(Int4 {
            format: Int4Format::Awq,
            group: check_group(group as i64, false)?,
            lm_head: false,
        })
    }

    /// GPTQ v1 format without act-order, as our writer produces it.
    pub fn gptq(group: usize, sym: bool) -> Result<Int4> {
        Ok(Int4 {
            format: Int4Format::Gptq {
                sym,
                desc_act: false,
                v2: false,
            },
            group: check_group(group as i64, true)?,
            lm_head: false,
        })
    }

    /// The same format with the LM head quantized too, or not.
    pub fn with_lm_head(self, lm_head: bool) -> Int4 {
        Int4 { lm_head, ..self }
    }

    /// From config.json's `quantization_config`; `Ok(None)` for other methods
    /// handled elsewhere (none yet), errors for malformed or unsupported ones.
    pub fn from_config(q: &Value) -> Result<Int4> {
        let ctx = |e: Error| {
            Error::invalid_model(format!("config.json quantization_config: {}", e.message))
        };
        let method = q
            .get("quant_method")
            .and_then(Value::as_str)
            .ok_or_else(|| {
                Error::invalid_model("config.json quantization_config has no `quant_method`")
            })?
            .to_ascii_lowercase();
        let int = |keys: &[&str]| -> Result<Option<i64>> {
            for k in keys {
                match q.get(*k) {
                    None | Some(Value::Null) => continue,
                    Some(v) => {
                        return v.as_i64().map(Some).ok_or_else(|| {
                            Error::invalid_model(format!(
                                "config.json quantization_config: `{k}` must be an integer, got {v}"
                            ))
                        })
                    }
                }
            }
            Ok(None)
        };
        let boolean = |key: &str, default: bool| -> Result<bool> {
            match q.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Bool(b)) => Ok(*b),
                Some(v) => bail_model!(
                    "config.json quantization_config: `{key}` must be true or false, got {v}"
                ),
            }
        };
        let string = |keys: &[&str]| -> Option<String> {
            keys.iter()
                .find_map(|k| q.get(*k).and_then(Value::as_str))
                .map(str::to_ascii_lowercase)
        };
        if method != "awq" && method != "gptq" {
            return Err(Error::unsupported(format!(
                "config.json quantization_config: quant_method `{method}` is not supported (supported: awq, gptq, fp8)"
            )));
        }
        let bits = int(&["bits", "w_bit"])?.unwrap_or(4);
        if bits != 4 {
            return Err(Error::unsupported(format!(
                "config.json quantization_config: {method} with {bits} bits is not supported (4 only)"
            )));
        }
        let group = int(&["group_size", "q_group_size"])?.ok_or_else(|| {
            Error::invalid_model(format!(
                "config.json quantization_config ({method}) has no `group_size`"
            ))
        })?;
        match method.as_str() {
            "awq" => {
                let version = string(&["version"]).unwrap_or_else(|| "gemm".into());
                if version != "gemm" {
                    return Err(Error::unsupported(format!(
                        "config.json quantization_config: AWQ version `{version}` is not supported (gemm only)"
                    )));
                }
                if !boolean("zero_point", true)? {
                    return Err(Error::unsupported(
                        "config.json quantization_config: AWQ without zero_point is not supported",
                    ));
                }
                Ok(Int4 {
                    format: Int4Format::Awq,
                    group: check_group(group, false).map_err(ctx)?,
                    lm_head: false,
                })
            }
            "gptq" => {
                let v2 = match string(&["checkpoint_format", "format"]).as_deref() {
                    None | Some("gptq") => false,
                    Some("gptq_v2") => true,
                    Some(other) => {
                        return Err(Error::unsupported(format!(
                            "config.json quantization_config: GPTQ checkpoint_format `{other}` is not supported (gptq, gptq_v2)"
                        )))
                    }
                };
                Ok(Int4 {
                    format: Int4Format::Gptq {
                        sym: boolean("sym", true)?,
                        desc_act: boolean("desc_act", false)?,
                        v2,
                    },
                    group: check_group(group, true).map_err(ctx)?,
                    lm_head: boolean("lm_head", false)?,
                })
            }
            _ => unreachable!("checked above"),
        }
    }

    /// Inputs per group of a matrix with `cols` inputs.
    pub fn group_for(&self, cols: usize) -> usize {
        self.group.unwrap_or(cols)
    }

    /// The kernel's group (a multiple of 32; a per-row group covers the padding).
    fn kernel_group(&self, cols: usize) -> usize {
        self.group
            .unwrap_or_else(|| cols.div_ceil(ACT_BLOCK) * ACT_BLOCK)
    }

    fn label(&self) -> &'static str {
        match self.format {
            Int4Format::Awq => "AWQ",
            Int4Format::Gptq { .. } => "GPTQ",
        }
    }

    /// Scale (rounded to f16) and zero of a group whose weights span `lo..=hi`,
    /// in this format's round-to-nearest convention.
    pub fn group_params(&self, lo: f32, hi: f32) -> Result<(f32, u8)> {
        if !lo.is_finite() || !hi.is_finite() {
            bail_arg!("weights must be finite to quantize");
        }
        let (scale, zero) = match self.format {
            Int4Format::Awq => {
                let s = f16_round(((hi - lo).max(1e-5)) / 15.0)?;
                (s, (-(lo / s).round_ties_even()).clamp(0.0, 15.0))
            }
            Int4Format::Gptq { sym: true, .. } => {
                let amax = lo.abs().max(hi.abs());
                let amax = if amax == 0.0 { 1.0 } else { amax };
                (f16_round(2.0 * amax / 15.0)?, 8.0)
            }
            Int4Format::Gptq { sym: false, v2, .. } => {
                let (lo, hi) = (lo.min(0.0), hi.max(0.0));
                let (lo, hi) = if lo == 0.0 && hi == 0.0 {
                    (-1.0, 1.0)
                } else {
                    (lo, hi)
                };
                let s = f16_round((hi - lo) / 15.0)?;
                let zmin = if v2 { 0.0 } else { 1.0 };
                (s, (-(lo / s).round_ties_even()).clamp(zmin, 15.0))
            }
        };
        Ok((scale, zero as u8))
    }

    /// Round-to-nearest of `[rows, cols]` weights: `(q [rows, cols], zeros
    /// [rows, groups], scales [rows, groups] as f16 bits)`.
    pub fn rtn(&self, rows: usize, cols: usize, w: &[f32]) -> Result<(Vec<u8>, Vec<u8>, Vec<u16>)> {
        let r = self.rtn_weights(rows, cols, w)?;
        Ok((r.q, r.zeros, r.scales))
    }

    /// [`Int4::rtn`] as [`Int4Weights`].
    pub fn rtn_weights(&self, rows: usize, cols: usize, w: &[f32]) -> Result<Int4Weights> {
        check_matrix_len("matrix", rows, cols, w)?;
        let group = self.group_for(cols);
        let ng = groups_per_row(cols, group);
        let mut q = vec![0u8; rows * cols];
        let mut zeros = vec![0u8; rows * ng];
        let mut scales = vec![0u16; rows * ng];
        for r in 0..rows {
            for g in 0..ng {
                let (c0, c1) = (g * group, ((g + 1) * group).min(cols));
                let wg = &w[r * cols + c0..r * cols + c1];
                let lo = wg.iter().fold(f32::INFINITY, |a, &v| a.min(v));
                let hi = wg.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                let (scale, zero) = self.group_params(lo, hi)?;
                zeros[r * ng + g] = zero;
                scales[r * ng + g] = half::f16::from_f32(scale).to_bits();
                for (o, &v) in q[r * cols + c0..r * cols + c1].iter_mut().zip(wg) {
                    *o = quantize_value(v, scale, zero);
                }
            }
        }
        Ok(Int4Weights {
            rows,
            cols,
            group,
            q,
            zeros,
            scales,
            g_idx: None,
        })
    }

    /// The checkpoint tensors of quantized weights `w` of layer `name`
    /// (`X.weight`): `X.qweight`, `X.qzeros`, `X.scales` (and GPTQ's `X.g_idx`).
    pub fn pack(&self, name: &str, w: &Int4Weights) -> Result<Vec<ExportTensor>> {
        let p = prefix(name);
        let (rows, cols, group) = (w.rows, w.cols, w.group);
        if !rows.is_multiple_of(8) {
            bail_arg!(
                "{name}: {} packs 8 outputs per int32, out_features {rows} is not a multiple of 8",
                self.label()
            );
        }
        let ng = groups_per_row(cols, group);
        if group != self.group_for(cols)
            || w.q.len() != rows * cols
            || w.zeros.len() != rows * ng
            || w.scales.len() != rows * ng
            || w.g_idx.as_ref().is_some_and(|g| g.len() != cols)
        {
            bail_arg!("{name}: quantized weights do not match [{rows}, {cols}] with group {group}");
        }
        let (q, z, s) = (&w.q, &w.zeros, &w.scales);
        let (qweight, qzeros) = match self.format {
            Int4Format::Awq => {
                let qw: Vec<i32> = (0..cols)
                    .flat_map(|i| {
                        (0..rows / 8).map(move |c| pack8(|p| q[(8 * c + AWQ_ORDER[p]) * cols + i]))
                    })
                    .collect();
                let qz: Vec<i32> = (0..ng)
                    .flat_map(|g| {
                        (0..rows / 8).map(move |c| pack8(|p| z[(8 * c + AWQ_ORDER[p]) * ng + g]))
                    })
                    .collect();
                ((qw, vec![cols, rows / 8]), (qz, vec![ng, rows / 8]))
            }
            Int4Format::Gptq { v2, .. } => {
                if !cols.is_multiple_of(8) {
                    bail_arg!("{name}: GPTQ packs 8 inputs per int32, in_features {cols} is not a multiple of 8");
                }
                let qw: Vec<i32> = (0..cols / 8)
                    .flat_map(|r8| (0..rows).map(move |o| pack8(|p| q[o * cols + 8 * r8 + p])))
                    .collect();
                let off = if v2 { 0 } else { 1 };
                let qz: Vec<i32> = (0..ng)
                    .flat_map(|g| {
                        (0..rows / 8).map(move |c| pack8(|p| z[(8 * c + p) * ng + g] - off))
                    })
                    .collect();
                ((qw, vec![cols / 8, rows]), (qz, vec![ng, rows / 8]))
            }
        };
        // scales [groups, out]
        let st: Vec<u8> = (0..ng)
            .flat_map(|g| (0..rows).flat_map(move |o| s[o * ng + g].to_le_bytes()))
            .collect();
        let mut out = vec![
            ExportTensor {
                name: format!("{p}.qweight"),
                dtype: safetensors::Dtype::I32,
                shape: qweight.1,
                bytes: i32_bytes(&qweight.0),
            },
            ExportTensor {
                name: format!("{p}.qzeros"),
                dtype: safetensors::Dtype::I32,
                shape: qzeros.1,
                bytes: i32_bytes(&qzeros.0),
            },
            ExportTensor {
                name: format!("{p}.scales"),
                dtype: safetensors::Dtype::F16,
                shape: vec![ng, rows],
                bytes: st,
            },
        ];
        if let Int4Format::Gptq { .. } = self.format {
            let g_idx: Vec<i32> = match &w.g_idx {
                Some(g) => g.clone(),
                None => (0..cols).map(|i| (i / group) as i32).collect(),
            };
            out.push(ExportTensor {
                name: format!("{p}.g_idx"),
                dtype: safetensors::Dtype::I32,
                shape: vec![cols],
                bytes: i32_bytes(&g_idx),
            });
        }
        Ok(out)
    }

    /// The kernel matrix of RTN-quantized weights (what loading the exported
    /// checkpoint gives).
    fn matrix_of(
        &self,
        rows: usize,
        cols: usize,
        q: &[u8],
        zeros: &[u8],
        scales: &[f32],
        perm: Option<Vec<u32>>,
    ) -> Result<Matrix> {
        let m =
            Q4Matrix::from_quantized(rows, cols, self.kernel_group(cols), q, zeros, scales, perm)?;
        Ok(Matrix {
            rows,
            cols,
            data: MatrixData::Q4(m),
        })
    }
}

/// Quantized weights of one `[rows, cols]` matrix, before packing: what
/// round-to-nearest or a calibrated quantizer (AWQ, GPTQ) produces.
#[derive(Debug, Clone, PartialEq)]
pub struct Int4Weights {
    pub rows: usize,
    pub cols: usize,
    /// Inputs per group (`cols` for one group per row).
    pub group: usize,
    /// `[rows, cols]`, values 0..=15.
    pub q: Vec<u8>,
    /// `[rows, groups]`.
    pub zeros: Vec<u8>,
    /// `[rows, groups]`, f16 bits.
    pub scales: Vec<u16>,
    /// GPTQ act-order: the group of each input; `None`: `i / group`.
    pub g_idx: Option<Vec<i32>>,
}

impl Int4Weights {
    /// Group of input `c`.
    #[inline]
    pub fn group_of(&self, c: usize) -> usize {
        match &self.g_idx {
            Some(g) => g[c] as usize,
            None => c / self.group,
        }
    }

    /// The weights these stand for, `w = (q − z) · s`, `[rows, cols]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let ng = groups_per_row(self.cols, self.group);
        let mut out = vec![0f32; self.rows * self.cols];
        for r in 0..self.rows {
            for c in 0..self.cols {
                let g = r * ng + self.group_of(c);
                let s = half::f16::from_bits(self.scales[g]).to_f32();
                out[r * self.cols + c] =
                    (self.q[r * self.cols + c] as f32 - self.zeros[g] as f32) * s;
            }
        }
        out
    }
}

/// `clamp(round(v / scale) + zero, 0, 15)` (ties to even).
#[inline]
pub fn quantize_value(v: f32, scale: f32, zero: u8) -> u8 {
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    // Clamped first (no result changes: zero is 0..=15), so that adding and
    // subtracting 1.5·2²³ rounds to even exactly; `round_ties_even` is a
    // libm call without SSE4.1, and the calibrated searches call this a lot.
    const MAGIC: f32 = 12_582_912.0;
    let x = (v * inv).clamp(-32.0, 32.0);
    let r = (x + MAGIC) - MAGIC;
    (r + zero as f32).clamp(0.0, 15.0) as u8
}

/// `v` rounded onto the grid of `(scale, zero)`.
#[inline]
pub fn fake_quantize(v: f32, scale: f32, zero: u8) -> f32 {
    (quantize_value(v, scale, zero) as f32 - zero as f32) * scale
}

fn f16_round(v: f32) -> Result<f32> {
    let h = half::f16::from_f32(v);
    if !h.is_finite() {
        bail_arg!("int4 scale {v} does not fit in f16");
    }
    Ok(h.to_f32())
}

/// `X.weight` → `X`.
fn prefix(name: &str) -> &str {
    name.strip_suffix(".weight").unwrap_or(name)
}

fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Packs 8 nibbles (`nib(p)` for p in 0..8) into one int32.
fn pack8(nib: impl Fn(usize) -> u8) -> i32 {
    (0..8).fold(0u32, |acc, p| acc | ((nib(p) as u32 & 0xF) << (4 * p))) as i32
}

fn nibble(word: i32, p: usize) -> u8 {
    ((word as u32 >> (4 * p)) & 0xF) as u8
}

impl QuantMethod for Int4 {
    fn name(&self) -> &'static str {
        match self.format {
            Int4Format::Awq => "awq",
            Int4Format::Gptq { .. } => "gptq",
        }
    }

    fn metadata(&self) -> HashMap<String, String> {
        HashMap::from([("format".to_string(), "pt".to_string())])
    }

    fn quantization_config(&self) -> Option<Value> {
        let group = self.group.map_or(-1, |g| g as i64);
        Some(match self.format {
            Int4Format::Awq => json!({
                "quant_method": "awq", "bits": 4, "group_size": group,
                "version": "gemm", "zero_point": true,
                "modules_to_not_convert": null,
            }),
            Int4Format::Gptq { sym, desc_act, v2 } => json!({
                "quant_method": "gptq", "bits": 4, "group_size": group,
                "sym": sym, "desc_act": desc_act, "true_sequential": true,
                "damp_percent": 0.01, "static_groups": false,
                "checkpoint_format": if v2 { "gptq_v2" } else { "gptq" },
                "lm_head": self.lm_head,
            }),
        })
    }

    fn quantizes_lm_head(&self) -> bool {
        self.lm_head
    }

    fn quantize(&self, rows: usize, cols: usize, w: &[f32]) -> Result<Matrix> {
        let (q, z, s) = self.rtn(rows, cols, w)?;
        let s: Vec<f32> = s
            .iter()
            .map(|&b| half::f16::from_bits(b).to_f32())
            .collect();
        self.matrix_of(rows, cols, &q, &z, &s, None)
    }

    fn export(&self, name: &str, rows: usize, cols: usize, w: &[f32]) -> Result<Vec<ExportTensor>> {
        let r = self.rtn_weights(rows, cols, w)?;
        self.pack(name, &r)
    }

    fn stored_in(&self, files: &WeightFiles, name: &str) -> bool {
        files.contains(&format!("{}.qweight", prefix(name)))
    }

    fn load(&self, files: &WeightFiles, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let p = prefix(name);
        let label = self.label();
        let (qw_name, qz_name, s_name) = (
            format!("{p}.qweight"),
            format!("{p}.qzeros"),
            format!("{p}.scales"),
        );
        for n in [&qw_name, &qz_name, &s_name] {
            if !files.contains(n) {
                bail_model!("{label} checkpoint has `{qw_name}` but no `{n}`");
            }
        }
        if !rows.is_multiple_of(8) {
            bail_model!("{label} tensor `{qw_name}`: out_features {rows} is not a multiple of 8");
        }
        let group = self.group_for(cols);
        let ng = groups_per_row(cols, group);
        fn ctx(label: &'static str, what: &'static str) -> impl Fn(Error) -> Error {
            move |e: Error| Error::invalid_model(format!("{label} {what}: {}", e.message))
        }
        let zeros_w = files
            .require(&qz_name, &[ng, rows / 8])
            .and_then(|v| v.as_i32().map(|c| c.into_owned()))
            .map_err(ctx(label, "qzeros [ceil(in/group), out/8]"))?;
        let scales_v = files
            .require(&s_name, &[ng, rows])
            .map_err(ctx(label, "scales [ceil(in/group), out]"))?;
        let scales_t = scales_v.to_f32()?; // [ng, rows]
        let mut q = vec![0u8; rows * cols];
        let mut zeros = vec![0u8; rows * ng];
        let mut scales = vec![0f32; rows * ng];
        for g in 0..ng {
            for o in 0..rows {
                scales[o * ng + g] = scales_t[g * rows + o];
            }
        }
        let mut perm = None;
        match self.format {
            Int4Format::Awq => {
                let qw = files
                    .require(&qw_name, &[cols, rows / 8])
                    .and_then(|v| v.as_i32().map(|c| c.into_owned()))
                    .map_err(ctx(label, "qweight [in, out/8]"))?;
                for i in 0..cols {
                    for c in 0..rows / 8 {
                        let word = qw[i * (rows / 8) + c];
                        for (j, &nib) in AWQ_REVERSE_ORDER.iter().enumerate() {
                            q[(8 * c + j) * cols + i] = nibble(word, nib);
                        }
                    }
                }
                for g in 0..ng {
                    for c in 0..rows / 8 {
                        let word = zeros_w[g * (rows / 8) + c];
                        for (j, &nib) in AWQ_REVERSE_ORDER.iter().enumerate() {
                            zeros[(8 * c + j) * ng + g] = nibble(word, nib);
                        }
                    }
                }
            }
            Int4Format::Gptq { v2, .. } => {
                if !cols.is_multiple_of(8) {
                    bail_model!(
                        "GPTQ tensor `{qw_name}`: in_features {cols} is not a multiple of 8"
                    );
                }
                let qw = files
                    .require(&qw_name, &[cols / 8, rows])
                    .and_then(|v| v.as_i32().map(|c| c.into_owned()))
                    .map_err(ctx(label, "qweight [in/8, out]"))?;
                for r8 in 0..cols / 8 {
                    for o in 0..rows {
                        let word = qw[r8 * rows + o];
                        for pp in 0..8 {
                            q[o * cols + 8 * r8 + pp] = nibble(word, pp);
                        }
                    }
                }
                for g in 0..ng {
                    for c in 0..rows / 8 {
                        let word = zeros_w[g * (rows / 8) + c];
                        for pp in 0..8 {
                            let stored = nibble(word, pp);
                            let z = if v2 { stored } else { stored + 1 };
                            if z > 15 {
                                bail_model!("GPTQ tensor `{qz_name}`: group {g} output {} stores zero 15, i.e. z = 16 in the v1 format (checkpoint_format gptq); is it gptq_v2?", 8 * c + pp);
                            }
                            zeros[(8 * c + pp) * ng + g] = z;
                        }
                    }
                }
                let gi_name = format!("{p}.g_idx");
                if files.contains(&gi_name) {
                    let g_idx = files
                        .require(&gi_name, &[cols])
                        .and_then(|v| v.as_i32().map(|c| c.into_owned()))
                        .map_err(ctx(label, "g_idx [in]"))?;
                    perm = act_order(&g_idx, group, ng).map_err(|e| {
                        Error::invalid_model(format!("GPTQ tensor `{gi_name}`: {e}"))
                    })?;
                }
                if let Some(pm) = &perm {
                    let mut permuted = vec![0u8; cols];
                    for o in 0..rows {
                        let row = &mut q[o * cols..(o + 1) * cols];
                        for (dst, &src) in permuted.iter_mut().zip(pm.iter()) {
                            *dst = row[src as usize];
                        }
                        row.copy_from_slice(&permuted);
                    }
                }
            }
        }
        self.matrix_of(rows, cols, &q, &zeros, &scales, perm)
            .map_err(|e| Error::invalid_model(format!("{label} `{p}`: {}", e.message)))
    }
}

/// The input permutation that makes `g_idx`'s groups contiguous, `None` when
/// they already are (`g_idx[i] = i / group`). Each group must have `group`
/// members (the last the rest), as GPTQ's act-order produces.
fn act_order(
    g_idx: &[i32],
    group: usize,
    ng: usize,
) -> std::result::Result<Option<Vec<u32>>, String> {
    let cols = g_idx.len();
    if let Some((i, &g)) = g_idx
        .iter()
        .enumerate()
        .find(|&(_, &g)| g < 0 || g as usize >= ng)
    {
        return Err(format!("input {i} names group {g}, outside 0..{ng}"));
    }
    if g_idx
        .iter()
        .enumerate()
        .all(|(i, &g)| g as usize == i / group)
    {
        return Ok(None);
    }
    let mut perm: Vec<u32> = (0..cols as u32).collect();
    perm.sort_by_key(|&i| g_idx[i as usize]);
    for (pos, &i) in perm.iter().enumerate() {
        if g_idx[i as usize] as usize != pos / group {
            return Err(format!(
                "group {} does not have {group} inputs (act-order needs groups of exactly group_size)",
                g_idx[i as usize]
            ));
        }
    }
    Ok(Some(perm))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn act_order_permutation_groups_inputs() {
        assert_eq!(act_order(&[0, 0, 1, 1], 2, 2).unwrap(), None);
        assert_eq!(
            act_order(&[1, 0, 1, 0], 2, 2).unwrap(),
            Some(vec![1, 3, 0, 2])
        );
        assert!(act_order(&[1, 1, 1, 0], 2, 2).is_err());
        assert!(act_order(&[0, 0, 2, 1], 2, 2).is_err());
    }

    #[test]
    fn config_parsing() {
        let awq = Int4::from_config(&json!({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "GEMM", "zero_point": true})).unwrap();
        assert_eq!(awq, Int4::awq(128).unwrap());
        let g = Int4::from_config(&json!({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": true, "sym": false, "checkpoint_format": "gptq_v2"})).unwrap();
        assert_eq!(
            g.format,
            Int4Format::Gptq {
                sym: false,
                desc_act: true,
                v2: true
            }
        );
        assert_eq!(g.group, None);
        for (bad, want) in [
            (
                json!({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}),
                "gemv",
            ),
            (
                json!({"quant_method": "gptq", "bits": 8, "group_size": 128}),
                "8 bits",
            ),
            (
                json!({"quant_method": "awq", "bits": 4, "group_size": 100}),
                "multiple of 32",
            ),
            (json!({"quant_method": "awq", "bits": 4}), "no `group_size`"),
            (
                json!({"quant_method": "bitsandbytes"}),
                "`bitsandbytes` is not supported (supported: awq, gptq, fp8)",
            ),
            (
                json!({"quant_method": "gptq", "group_size": 32, "checkpoint_format": "marlin"}),
                "marlin",
            ),
        ] {
            let e = Int4::from_config(&bad).unwrap_err().to_string();
            assert!(e.contains(want), "{bad}: {e}");
        }
    }

    #[test]
    fn quantize_value_rounds_half_to_even_and_clamps() {
        for i in -4000..4000 {
            let v = i as f32 * 0.0625 + (i % 7) as f32 * 1e-3;
            for (scale, zero) in [(0.5f32, 8u8), (0.125, 0), (1.0, 15), (3.0e-4, 3)] {
                let want = ((v / scale).round_ties_even() + zero as f32).clamp(0.0, 15.0) as u8;
                let inv = 1.0 / scale;
                let want_inv = ((v * inv).round_ties_even() + zero as f32).clamp(0.0, 15.0) as u8;
                assert_eq!(
                    quantize_value(v, scale, zero),
                    want_inv,
                    "{v} / {scale} + {zero}"
                );
                assert!(want.abs_diff(want_inv) <= 1);
            }
        }
        assert_eq!(quantize_value(2.5, 1.0, 0), 2);
        assert_eq!(quantize_value(3.5, 1.0, 0), 4);
        assert_eq!(quantize_value(-1e30, 1.0, 8), 0);
    }

    #[test]
    fn rtn_error_is_at_most_half_a_step() {
        let (rows, cols) = (8, 96);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 251) as f32 / 50.0 - 2.3)
            .collect();
        for m in [
            Int4::awq(32).unwrap(),
            Int4::gptq(64, true).unwrap(),
            Int4::gptq(32, false).unwrap(),
        ] {
            let (q, z, s) = m.rtn(rows, cols, &w).unwrap();
            let g = m.group_for(cols);
            let ng = groups_per_row(cols, g);
            for r in 0..rows {
                for c in 0..cols {
                    let gi = r * ng + c / g;
                    let s = half::f16::from_bits(s[gi]).to_f32();
                    let deq = (q[r * cols + c] as f32 - z[gi] as f32) * s;
                    // GPTQ sym clips the top half-step (its range is −8..7).
                    let tol = if matches!(m.format, Int4Format::Gptq { sym: true, .. }) {
                        s
                    } else {
                        0.5 * s
                    };
                    assert!(
                        (deq - w[r * cols + c]).abs() <= tol * 1.001 + 1e-6,
                        "{m:?} ({r},{c})"
                    );
                }
            }
        }
    }
}
