//! Int4 weights (AWQ / GPTQ checkpoints, RTN at load): `w = (q − z) · s` with
//! `q, z ∈ [0, 15]` and one scale and zero per `group` consecutive inputs of
//! a row, plus the per-32 int8 quantization of activations they multiply.
//!
//! [`Q4Matrix`] keeps the weights repacked for the kernels, still 4 bits
//! each: rows in blocks of 16, and inside a block, for every 8 consecutive
//! inputs, the 16 rows' 8 nibbles side by side (64 bytes, one AVX-512
//! register). Row `j`'s 4 bytes hold inputs `k..k+4` in their low nibbles and
//! `k+4..k+8` in their high nibbles, so `v & 0xF` and `(v >> 4) & 0xF` are two
//! ready `vpdpbusd` operands (16 rows × 4 inputs each, unsigned, no offset).
//! Per row and group the kernels need `s` and `m = −z · s`:
//! `Σ w·x = s · Σ q·x + m · Σ x`.
//!
//! GPTQ's act-order (`desc_act`) checkpoints list a row's groups by `g_idx`
//! rather than in input order; they are loaded with the inputs permuted so
//! that groups are contiguous, and the activations are permuted the same way
//! before the product ([`Q4Matrix::perm`]).

use crate::{bail_arg, Result};

/// Rows of a packed block (one 512-bit vector of i32 outputs).
pub const BLOCK_ROWS: usize = 16;
/// Inputs per packed step (64 bytes per block).
pub const K_STEP: usize = 8;
/// Inputs per activation scale; groups are multiples of it.
pub const ACT_BLOCK: usize = 32;

/// A `[rows, cols]` int4 weight matrix with per-group scales and zeros, packed for the kernels.
pub struct Q4Matrix {
    pub rows: usize,
    pub cols: usize,
    /// Inputs per scale/zero (a multiple of [`ACT_BLOCK`]).
    pub group: usize,
    /// `cols` rounded up to a multiple of [`ACT_BLOCK`] (padding weights are 0).
    pub(crate) kp: usize,
    pub(crate) n_groups: usize,
    /// `[row_block][kp/8][16 rows][4 bytes]`, two nibbles per byte.
    pub(crate) packed: Vec<u8>,
    /// `[row_block][group][16 rows]`; 0 for padding rows.
    pub(crate) scales: Vec<f32>,
    /// `[row_block][group][16 rows]`: `−z · s`.
    pub(crate) mins: Vec<f32>,
    /// Act-order: packed input `i` is original input `perm[i]`.
    pub(crate) perm: Option<Vec<u32>>,
}

/// Groups per row for `cols` inputs (the last may be partial).
pub fn groups_per_row(cols: usize, group: usize) -> usize {
    cols.div_ceil(group)
}

/// Byte offset and shift of weight `(r, c)` (packed input order) in a packed matrix.
#[inline]
fn nibble_at(kp: usize, r: usize, c: usize) -> (usize, u32) {
    let (b, j) = (r / BLOCK_ROWS, r % BLOCK_ROWS);
    let (step, t) = (c / K_STEP, c % K_STEP);
    let idx = b * kp * BLOCK_ROWS / 2 + step * 64 + j * 4 + (t % 4);
    (idx, if t < 4 { 0 } else { 4 })
}

impl Q4Matrix {
    /// Packs row-major quantized weights `q` (`[rows, cols]`, values 0..=15)
    /// with zeros `[rows, n_groups]` (0..=15) and scales `[rows, n_groups]`.
    /// `perm`: act-order, `q`'s column `i` multiplies input `perm[i]` (groups
    /// are contiguous in `q`'s order).
    pub fn from_quantized(
        rows: usize,
        cols: usize,
        group: usize,
        q: &[u8],
        zeros: &[u8],
        scales: &[f32],
        perm: Option<Vec<u32>>,
    ) -> Result<Q4Matrix> {
        if group == 0 || !group.is_multiple_of(ACT_BLOCK) {
            bail_arg!("int4 group size must be a positive multiple of {ACT_BLOCK} (32, 64, 128, ...), got {group}");
        }
        let n_groups = groups_per_row(cols, group);
        if q.len() != rows * cols || zeros.len() != rows * n_groups || scales.len() != zeros.len() {
            bail_arg!(
                "int4 matrix [{rows}, {cols}] group {group} needs {} weights and {} scales and zeros, got {}, {} and {}",
                rows * cols,
                rows * n_groups,
                q.len(),
                scales.len(),
                zeros.len()
            );
        }
        if let Some(bad) = q.iter().chain(zeros).find(|&&v| v > 15) {
            bail_arg!("int4 values must be in 0..=15, found {bad}");
        }
        if let Some(bad) = scales.iter().find(|s| !s.is_finite()) {
            bail_arg!("int4 scales must be finite, found {bad}");
        }
        if let Some(p) = &perm {
            let mut seen = vec![false; cols];
            if p.len() != cols
                || p.iter().any(|&i| {
                    (i as usize) >= cols || std::mem::replace(&mut seen[i as usize], true)
                })
            {
                bail_arg!("int4 input permutation must be a permutation of 0..{cols}");
            }
        }
        let kp = cols.div_ceil(ACT_BLOCK) * ACT_BLOCK;
        let blocks = rows.div_ceil(BLOCK_ROWS);
        let mut packed = vec![0u8; blocks * kp * BLOCK_ROWS / 2];
        let mut ps = vec![0f32; blocks * n_groups * BLOCK_ROWS];
        let mut pm = vec![0f32; blocks * n_groups * BLOCK_ROWS];
        for r in 0..rows {
            for (c, &v) in q[r * cols..(r + 1) * cols].iter().enumerate() {
                let (idx, shift) = nibble_at(kp, r, c);
                packed[idx] |= v << shift;
            }
            let (b, j) = (r / BLOCK_ROWS, r % BLOCK_ROWS);
            for g in 0..n_groups {
                let (s, z) = (scales[r * n_groups + g], zeros[r * n_groups + g]);
                ps[(b * n_groups + g) * BLOCK_ROWS + j] = s;
                pm[(b * n_groups + g) * BLOCK_ROWS + j] = -(z as f32) * s;
            }
        }
        Ok(Q4Matrix {
            rows,
            cols,
            group,
            kp,
            n_groups,
            packed,
            scales: ps,
            mins: pm,
            perm,
        })
    }

    /// Quantized value of weight `(r, c)` in packed input order.
    pub fn q(&self, r: usize, c: usize) -> u8 {
        let (idx, shift) = nibble_at(self.kp, r, c);
        (self.packed[idx] >> shift) & 0xF
    }

    /// Scale of group `g` of row `r`.
    pub fn scale(&self, r: usize, g: usize) -> f32 {
        let (b, j) = (r / BLOCK_ROWS, r % BLOCK_ROWS);
        self.scales[(b * self.n_groups + g) * BLOCK_ROWS + j]
    }

    /// `−z · s` of group `g` of row `r`.
    pub fn min(&self, r: usize, g: usize) -> f32 {
        let (b, j) = (r / BLOCK_ROWS, r % BLOCK_ROWS);
        self.mins[(b * self.n_groups + g) * BLOCK_ROWS + j]
    }

    /// Row `r` dequantized into `out` (`cols` values, original input order):
    /// `(q − z) · s`, exact in f32 for f16 scales.
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        for c in 0..self.cols {
            let g = c / self.group;
            let v = self.q(r, c) as f32 * self.scale(r, g) + self.min(r, g);
            let dst = self.perm.as_ref().map_or(c, |p| p[c] as usize);
            out[dst] = v;
        }
    }

    /// Bytes the kernels stream per full pass (nibbles + scales + mins).
    pub fn size_in_bytes(&self) -> usize {
        self.packed.len() + (self.scales.len() + self.mins.len()) * 4
    }

    pub fn n_groups(&self) -> usize {
        self.n_groups
    }

    /// Act-order permutation of the inputs, if any.
    pub fn perm(&self) -> Option<&[u32]> {
        self.perm.as_deref()
    }
}

/// Activations quantized to int8 per [`ACT_BLOCK`] inputs, with per-block
/// scales and `scale · Σq` (what the weights' zero points multiply).
#[derive(Default)]
pub struct Q4Acts {
    pub(crate) m: usize,
    pub(crate) kp: usize,
    /// `[m, kp]`, zero-padded.
    pub(crate) q: Vec<i8>,
    /// `[m, kp / 32]`.
    pub(crate) scales: Vec<f32>,
    /// `[m, kp / 32]`: `scale · Σ q` over the block.
    pub(crate) sums: Vec<f32>,
}

impl Q4Acts {
    /// Quantizes `m` rows of `k` activations (no allocation once warm).
    pub fn quantize(&mut self, x: &[f32], m: usize, k: usize) {
        let kp = k.div_ceil(ACT_BLOCK) * ACT_BLOCK;
        let nb = kp / ACT_BLOCK;
        self.m = m;
        self.kp = kp;
        self.q.clear();
        self.q.resize(m * kp, 0);
        self.scales.resize(m * nb, 0.0);
        self.sums.resize(m * nb, 0.0);
        for r in 0..m {
            let xr = &x[r * k..(r + 1) * k];
            for (bi, xb) in xr.chunks(ACT_BLOCK).enumerate() {
                let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
                let qb = &mut self.q[r * kp + bi * ACT_BLOCK..r * kp + bi * ACT_BLOCK + xb.len()];
                let mut sum = 0i32;
                for (o, v) in qb.iter_mut().zip(xb) {
                    let qv = (v * inv).round().clamp(-127.0, 127.0) as i8;
                    *o = qv;
                    sum += qv as i32;
                }
                self.scales[r * nb + bi] = d;
                self.sums[r * nb + bi] = d * sum as f32;
            }
            for bi in k.div_ceil(ACT_BLOCK)..nb {
                self.scales[r * nb + bi] = 0.0;
                self.sums[r * nb + bi] = 0.0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_round_trips_every_nibble_scale_and_zero() {
        let (rows, cols, group) = (19, 72, 32);
        let ng = groups_per_row(cols, group);
        let q: Vec<u8> = (0..rows * cols)
            .map(|i| ((i * 7 + i / 5) % 16) as u8)
            .collect();
        let z: Vec<u8> = (0..rows * ng).map(|i| (i % 16) as u8).collect();
        let s: Vec<f32> = (0..rows * ng).map(|i| 0.01 * (i + 1) as f32).collect();
        let m = Q4Matrix::from_quantized(rows, cols, group, &q, &z, &s, None).unwrap();
        assert_eq!(m.kp, 96);
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            m.row_to_f32(r, &mut row);
            for c in 0..cols {
                assert_eq!(m.q(r, c), q[r * cols + c]);
                let g = c / group;
                let want = (q[r * cols + c] as f32 - z[r * ng + g] as f32) * s[r * ng + g];
                assert!(
                    (row[c] - want).abs() <= 1e-6 * want.abs().max(1.0),
                    "({r},{c})"
                );
            }
        }
    }

    #[test]
    fn bad_inputs_are_rejected() {
        assert!(Q4Matrix::from_quantized(1, 32, 32, &[0; 31], &[0], &[1.0], None).is_err());
        assert!(Q4Matrix::from_quantized(1, 32, 32, &[16; 32], &[0], &[1.0], None).is_err());
        assert!(Q4Matrix::from_quantized(1, 32, 48, &[0; 32], &[0], &[1.0], None).is_err());
        assert!(Q4Matrix::from_quantized(1, 32, 32, &[0; 32], &[0], &[f32::NAN], None).is_err());
        let dup = Some(vec![0u32; 32]);
        assert!(Q4Matrix::from_quantized(1, 32, 32, &[0; 32], &[0], &[1.0], dup).is_err());
    }
}
