//! Q8_0: `X.weight` as I8 `[rows, cols]` and `X.weight_scale` as F32
//! `[rows, ceil(cols / group_size)]`, `w ≈ weight_scale · weight` per group of
//! consecutive inputs (the last group of a row may be shorter).

use super::quant::{check_matrix_len, ExportTensor, QuantMethod};
use super::safetensors::WeightFiles;
use crate::backend::cpu::q8::{groups_per_row, quantize_row, K_STEP};
use crate::backend::cpu::{Matrix, MatrixData, Q8Matrix};
use crate::{bail_arg, Error, Result};
use std::collections::HashMap;

pub struct Q8_0 {
    group: usize,
    lm_head: bool,
}

impl Q8_0 {
    pub fn new(group: usize, lm_head: bool) -> Result<Q8_0> {
        if group == 0 || !group.is_multiple_of(K_STEP) {
            bail_arg!("Q8_0 group size must be a positive multiple of {K_STEP} (e.g. 32, 64, 128), got {group}");
        }
        Ok(Q8_0 { group, lm_head })
    }

    pub fn group_size(&self) -> usize {
        self.group
    }
}

/// Name of the scale tensor of weight `name`.
pub fn scale_name(name: &str) -> String {
    format!("{name}_scale")
}

impl QuantMethod for Q8_0 {
    fn name(&self) -> &'static str {
        "q8_0"
    }

    fn metadata(&self) -> HashMap<String, String> {
        HashMap::from([
            ("quantization".to_string(), "q8_0".to_string()),
            ("group_size".to_string(), self.group.to_string()),
            (
                "lm_head".to_string(),
                if self.lm_head { "q8_0" } else { "dense" }.to_string(),
            ),
        ])
    }

    fn quantizes_lm_head(&self) -> bool {
        self.lm_head
    }

    fn quantize(&self, rows: usize, cols: usize, w: &[f32]) -> Result<Matrix> {
        Ok(Matrix {
            rows,
            cols,
            data: MatrixData::Q8_0(Q8Matrix::quantize(rows, cols, self.group, w)?),
        })
    }

    fn export(&self, name: &str, rows: usize, cols: usize, w: &[f32]) -> Result<Vec<ExportTensor>> {
        check_matrix_len(name, rows, cols, w)?;
        let n_groups = groups_per_row(cols, self.group);
        let mut q = vec![0i8; rows * cols];
        let mut scales = vec![0f32; rows * n_groups];
        for r in 0..rows {
            quantize_row(
                &w[r * cols..(r + 1) * cols],
                self.group,
                &mut q[r * cols..(r + 1) * cols],
                &mut scales[r * n_groups..(r + 1) * n_groups],
            );
        }
        Ok(vec![
            ExportTensor {
                name: name.to_string(),
                dtype: safetensors::Dtype::I8,
                shape: vec![rows, cols],
                bytes: q.into_iter().map(|v| v as u8).collect(),
            },
            ExportTensor {
                name: scale_name(name),
                dtype: safetensors::Dtype::F32,
                shape: vec![rows, n_groups],
                bytes: scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
            },
        ])
    }

    fn load(&self, files: &WeightFiles, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let q = files.require(name, &[rows, cols])?.as_i8()?;
        let sname = scale_name(name);
        if !files.contains(&sname) {
            return Err(Error::invalid_model(format!(
                "q8_0 checkpoint has `{name}` but no `{sname}`"
            )));
        }
        let n_groups = groups_per_row(cols, self.group);
        let scales = files.require(&sname, &[rows, n_groups])?.to_f32()?;
        let packed = Q8Matrix::from_quantized(rows, cols, self.group, &q, &scales)
            .map_err(|e| Error::invalid_model(format!("{name}: {e}")))?;
        Ok(Matrix {
            rows,
            cols,
            data: MatrixData::Q8_0(packed),
        })
    }
}
