//! Q8_0 int8 weights: one f32 scale per `group` consecutive inputs of a row,
//! `w ≈ scale · q` with `q ∈ [-127, 127]`, and the matching per-group
//! quantization of activations.
//!
//! [`Q8Matrix`] keeps the weights repacked for the kernels: rows in blocks of
//! 16, and inside a block, for every 4 consecutive inputs, the 16 rows' 4
//! bytes side by side (64 bytes, one AVX-512 register). One `vpdpbusd` then
//! advances 16 output columns by 4 inputs each, the outputs come out as
//! contiguous vectors and no horizontal sums are needed. Weights are stored
//! offset by +128 (as u8) because `vpdpbusd` multiplies unsigned by signed
//! bytes; the offset is cancelled on the activation side (see [`QActs`]).

use crate::{bail_arg, Result};

/// Rows of a packed block (one 512-bit vector of i32 outputs).
pub const BLOCK_ROWS: usize = 16;
/// Inputs per packed step (the bytes one i32 lane of `vpdpbusd` sums).
pub const K_STEP: usize = 4;

/// A `[rows, cols]` int8 weight matrix with per-group scales, packed for the kernels.
pub struct Q8Matrix {
    pub rows: usize,
    pub cols: usize,
    /// Inputs per scale.
    pub group: usize,
    /// `cols` rounded up to a multiple of [`K_STEP`] (padding weights are 0).
    pub(crate) kp: usize,
    pub(crate) n_groups: usize,
    /// `[row_block][kp/4][16 rows][4]` as `q + 128`.
    pub(crate) packed: Vec<u8>,
    /// `[row_block][group][16 rows]`; 0 for padding rows.
    pub(crate) scales: Vec<f32>,
}

/// Number of scales per row for `cols` inputs in groups of `group` (the last may be partial).
pub fn groups_per_row(cols: usize, group: usize) -> usize {
    cols.div_ceil(group)
}

/// Quantizes one row: `q[j] = round(x[j] / d_g)`, `d_g = max|x_g| / 127` per group.
pub fn quantize_row(x: &[f32], group: usize, q: &mut [i8], scales: &mut [f32]) {
    for ((xg, qg), d) in x
        .chunks(group)
        .zip(q.chunks_mut(group))
        .zip(scales.iter_mut())
    {
        let amax = xg.iter().fold(0f32, |m, v| m.max(v.abs()));
        *d = amax / 127.0;
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if super::isa::isa() >= super::isa::Isa::Avx2Fma {
            let n = xg.len().min(qg.len());
            // SAFETY: AVX2 and FMA detected (AVX-512 CPUs have them); both
            // slices hold n values.
            done = unsafe { super::vector_avx2::quantize_i8(xg.as_ptr(), inv, qg.as_mut_ptr(), n) };
        }
        #[cfg(target_arch = "aarch64")]
        if super::isa::isa() == super::isa::Isa::Neon {
            let n = xg.len().min(qg.len());
            // SAFETY: NEON detected; both slices hold n values.
            done = unsafe { super::neon_vector::quantize_i8(xg.as_ptr(), inv, qg.as_mut_ptr(), n) };
        }
        for (o, v) in qg[done..].iter_mut().zip(&xg[done..]) {
            *o = (v * inv).round().clamp(-127.0, 127.0) as i8;
        }
    }
}

impl Q8Matrix {
    /// Packs row-major quantized weights `q` (`[rows, cols]`) with scales
    /// `[rows, groups_per_row(cols, group)]`.
    pub fn from_quantized(
        rows: usize,
        cols: usize,
        group: usize,
        q: &[i8],
        scales: &[f32],
    ) -> Result<Q8Matrix> {
        if group == 0 || !group.is_multiple_of(K_STEP) {
            bail_arg!("Q8_0 group size must be a positive multiple of {K_STEP}, got {group}");
        }
        let n_groups = groups_per_row(cols, group);
        if q.len() != rows * cols || scales.len() != rows * n_groups {
            bail_arg!(
                "Q8_0 matrix [{rows}, {cols}] group {group} needs {} weights and {} scales, got {} and {}",
                rows * cols,
                rows * n_groups,
                q.len(),
                scales.len()
            );
        }
        if let Some(bad) = scales.iter().find(|s| !s.is_finite()) {
            bail_arg!("Q8_0 scales must be finite, found {bad}");
        }
        let kp = cols.div_ceil(K_STEP) * K_STEP;
        let blocks = rows.div_ceil(BLOCK_ROWS);
        let mut packed = vec![128u8; blocks * kp * BLOCK_ROWS];
        let mut packed_scales = vec![0f32; blocks * n_groups * BLOCK_ROWS];
        for r in 0..rows {
            let (b, j) = (r / BLOCK_ROWS, r % BLOCK_ROWS);
            let base = b * kp * BLOCK_ROWS;
            for (c, &v) in q[r * cols..(r + 1) * cols].iter().enumerate() {
                let idx = base + (c / K_STEP) * K_STEP * BLOCK_ROWS + j * K_STEP + c % K_STEP;
                packed[idx] = (v as i16 + 128) as u8;
            }
            for g in 0..n_groups {
                packed_scales[(b * n_groups + g) * BLOCK_ROWS + j] = scales[r * n_groups + g];
            }
        }
        Ok(Q8Matrix {
            rows,
            cols,
            group,
            kp,
            n_groups,
            packed,
            scales: packed_scales,
        })
    }

    /// Quantizes a row-major f32 matrix.
    pub fn quantize(rows: usize, cols: usize, group: usize, w: &[f32]) -> Result<Q8Matrix> {
        if w.len() != rows * cols {
            bail_arg!(
                "matrix [{rows}, {cols}] needs {} values, got {}",
                rows * cols,
                w.len()
            );
        }
        if group == 0 {
            bail_arg!("Q8_0 group size must be positive");
        }
        let n_groups = groups_per_row(cols, group);
        let mut q = vec![0i8; rows * cols];
        let mut scales = vec![0f32; rows * n_groups];
        for r in 0..rows {
            quantize_row(
                &w[r * cols..(r + 1) * cols],
                group,
                &mut q[r * cols..(r + 1) * cols],
                &mut scales[r * n_groups..(r + 1) * n_groups],
            );
        }
        Q8Matrix::from_quantized(rows, cols, group, &q, &scales)
    }

    /// Quantized value of weight `(r, c)`.
    pub fn q(&self, r: usize, c: usize) -> i8 {
        let (b, j) = (r / BLOCK_ROWS, r % BLOCK_ROWS);
        let idx =
            b * self.kp * BLOCK_ROWS + (c / K_STEP) * K_STEP * BLOCK_ROWS + j * K_STEP + c % K_STEP;
        (self.packed[idx] as i16 - 128) as i8
    }

    /// Scale of group `g` of row `r`.
    pub fn scale(&self, r: usize, g: usize) -> f32 {
        let (b, j) = (r / BLOCK_ROWS, r % BLOCK_ROWS);
        self.scales[(b * self.n_groups + g) * BLOCK_ROWS + j]
    }

    /// Row `r` dequantized into `out` (`cols` values).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        for (c, o) in out[..self.cols].iter_mut().enumerate() {
            *o = self.q(r, c) as f32 * self.scale(r, c / self.group);
        }
    }

    /// Bytes the kernels stream per full pass (weights + scales).
    pub fn size_in_bytes(&self) -> usize {
        self.packed.len() + self.scales.len() * 4
    }

    pub fn n_groups(&self) -> usize {
        self.n_groups
    }
}

/// Activations quantized per group to int8, with per-group scales and the
/// `-128 · Σq` correction that cancels the weights' +128 offset under VNNI.
#[derive(Default)]
pub struct QActs {
    pub(crate) m: usize,
    pub(crate) kp: usize,
    pub(crate) group: usize,
    pub(crate) n_groups: usize,
    /// `[m, kp]`, zero-padded.
    pub(crate) q: Vec<i8>,
    /// `[m, n_groups]`.
    pub(crate) scales: Vec<f32>,
    /// `[m, n_groups]`: `-128 · Σ q` over the group.
    pub(crate) bias: Vec<i32>,
}

impl QActs {
    /// Quantizes `m` rows of `k` activations in groups of `group` (no allocation once warm).
    pub fn quantize(&mut self, x: &[f32], m: usize, k: usize, group: usize) {
        let kp = k.div_ceil(K_STEP) * K_STEP;
        let n_groups = groups_per_row(k, group);
        self.m = m;
        self.kp = kp;
        self.group = group;
        self.n_groups = n_groups;
        self.q.clear();
        self.q.resize(m * kp, 0);
        self.scales.resize(m * n_groups, 0.0);
        self.bias.resize(m * n_groups, 0);
        for r in 0..m {
            let q = &mut self.q[r * kp..r * kp + k];
            let s = &mut self.scales[r * n_groups..(r + 1) * n_groups];
            quantize_row(&x[r * k..(r + 1) * k], group, q, s);
            for (b, qg) in self.bias[r * n_groups..(r + 1) * n_groups]
                .iter_mut()
                .zip(q.chunks(group))
            {
                *b = -128 * qg.iter().map(|&v| v as i32).sum::<i32>();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_row_bounds_error_by_half_a_step() {
        let x: Vec<f32> = (0..100).map(|i| ((i * 37) % 23) as f32 - 11.3).collect();
        let mut q = vec![0i8; 100];
        let mut s = vec![0f32; groups_per_row(100, 32)];
        quantize_row(&x, 32, &mut q, &mut s);
        assert_eq!(s.len(), 4);
        for (j, (&v, &qv)) in x.iter().zip(&q).enumerate() {
            let d = s[j / 32];
            assert!((v - qv as f32 * d).abs() <= d * 0.5 + 1e-6);
        }
        assert!(q.iter().any(|&v| v == 127 || v == -127));
    }

    #[test]
    fn packing_round_trips_every_weight_and_scale() {
        let (rows, cols, group) = (19, 70, 32);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 255) as f32 / 31.0 - 4.0)
            .collect();
        let m = Q8Matrix::quantize(rows, cols, group, &w).unwrap();
        assert_eq!(m.n_groups(), 3);
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            m.row_to_f32(r, &mut row);
            for c in 0..cols {
                let d = m.scale(r, c / group);
                assert!(
                    (row[c] - w[r * cols + c]).abs() <= d * 0.5 + 1e-6,
                    "({r},{c})"
                );
            }
        }
    }

    #[test]
    fn zero_rows_quantize_to_zero_scale() {
        let m = Q8Matrix::quantize(2, 8, 4, &[0.0; 16]).unwrap();
        assert_eq!(m.scale(1, 1), 0.0);
        assert_eq!(m.q(1, 7), 0);
    }

    #[test]
    fn bad_shapes_are_rejected() {
        assert!(Q8Matrix::from_quantized(2, 8, 4, &[0; 15], &[1.0; 4]).is_err());
        assert!(Q8Matrix::from_quantized(2, 8, 4, &[0; 16], &[1.0; 3]).is_err());
        assert!(Q8Matrix::from_quantized(2, 8, 6, &[0; 16], &[1.0; 4]).is_err());
        assert!(Q8Matrix::from_quantized(1, 4, 4, &[0; 4], &[f32::NAN]).is_err());
    }
}
