//! aarch64 NEON register tiles over the packed layout of [`Packed`] (F32,
//! BF16, F16 weights; `packed_kernels.rs` schedules them): up to 4
//! activation rows × one block of 16 output columns, as 4 vectors of 4 f32
//! per row.
//!
//! Each step takes 4 inputs: one load gives a row's 4 activations, and each
//! widened weight vector meets them through a lane-indexed FMA (`fmla
//! v.4s, w.4s, x.s[l]`), so activations are never broadcast. A step holds
//! 16 accumulators, 8 weight vectors (two inputs at a time) and 4
//! activation vectors: 28 of the 32 vector registers. One- and two-row
//! tiles keep the odd inputs in separate accumulators, so at least 8 FMA
//! chains run in parallel. Lines widen per element ([`PackedElem::widen_neon`]):
//! F32 as is, BF16 by a 16-bit shift (even inputs) or a mask (odd inputs),
//! F16 with `fcvtl`/`fcvtl2` ([`f16x8_to_f32`]).

use super::packed::{PackedElem, BLOCK_ROWS};
use super::packed_kernels::pair_lines;
use std::arch::aarch64::*;
use std::arch::asm;

/// Most activation rows of a NEON tile.
pub(crate) const TILE_ROWS: usize = 4;

/// Eight F16 values (bits) as two f32 vectors: `fcvtl`/`fcvtl2`, through
/// inline assembly because the f16 intrinsics are not stable Rust.
#[inline(always)]
pub(crate) fn f16x8_to_f32(v: uint16x8_t) -> (float32x4_t, float32x4_t) {
    let (lo, hi): (float32x4_t, float32x4_t);
    // SAFETY: two register-to-register conversions of the base aarch64 ISA
    // (every aarch64 CPU has FP16 conversions); no memory is touched.
    unsafe {
        asm!(
            "fcvtl {lo:v}.4s, {v:v}.4h",
            "fcvtl2 {hi:v}.4s, {v:v}.8h",
            v = in(vreg) v,
            lo = out(vreg) lo,
            hi = out(vreg) hi,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    (lo, hi)
}

/// One register tile's operands: rows of `x` (stride `k`), the lines of
/// one block at `w`, `valid` (≤ 16) output columns at `out` (row stride
/// `stride`).
pub(crate) struct Tile<E: PackedElem> {
    pub x: *const f32,
    pub k: usize,
    pub w: *const E::Line,
    pub out: *mut f32,
    pub stride: usize,
    pub valid: usize,
}

/// `mr` (1..=4) rows × 1 block.
///
/// # Safety
/// `x` holds `mr` rows of `k`; `w` the block's `k / INPUTS` (rounded up)
/// lines; `out` has `mr` rows with `valid` writable columns.
pub(crate) unsafe fn tile<E: PackedElem>(mr: usize, t: Tile<E>) {
    match mr {
        1 => tile_rows::<E, 1>(t),
        2 => tile_rows::<E, 2>(t),
        3 => tile_rows::<E, 3>(t),
        _ => tile_rows::<E, 4>(t),
    }
}

/// Inputs `2p, 2p + 1` of the block's 16 rows from the line(s) at `line`
/// (F32: two lines, one input each).
#[inline(always)]
unsafe fn pair<E: PackedElem>(line: *const E::Line) -> [[float32x4_t; 4]; 2] {
    if E::INPUTS == 2 {
        E::widen_neon(line)
    } else {
        [E::widen_neon(line)[0], E::widen_neon(line.add(1))[0]]
    }
}

/// `acc[r][s][q] += w[i][q] · x[r][lane]` for the pair's two inputs `i`
/// (lanes `L0`, `L0 + 1`; input 1 into set `s = ODD`).
#[inline]
#[target_feature(enable = "neon")]
fn fma_pair<const R: usize, const L0: i32, const L1: i32, const ODD: usize>(
    acc: &mut [[[float32x4_t; 4]; 2]; R],
    w: &[[float32x4_t; 4]; 2],
    x: &[float32x4_t; R],
) {
    for (acc_r, &xr) in acc.iter_mut().zip(x) {
        for q in 0..4 {
            acc_r[0][q] = vfmaq_laneq_f32::<L0>(acc_r[0][q], w[0][q], xr);
            acc_r[ODD][q] = vfmaq_laneq_f32::<L1>(acc_r[ODD][q], w[1][q], xr);
        }
    }
}

unsafe fn tile_rows<E: PackedElem, const R: usize>(t: Tile<E>) {
    if R <= 2 {
        tile_body::<E, R, 1>(t)
    } else {
        tile_body::<E, R, 0>(t)
    }
}

/// `R` rows; odd inputs go to accumulator set `ODD` (1: split, 0: shared).
#[inline(always)]
unsafe fn tile_body<E: PackedElem, const R: usize, const ODD: usize>(t: Tile<E>) {
    let zero = vdupq_n_f32(0.0);
    let mut acc = [[[zero; 4]; 2]; R];
    let pair_lines = pair_lines::<E>();
    let quads = t.k / 4;
    for s in 0..quads {
        let mut x = [zero; R];
        for (r, xr) in x.iter_mut().enumerate() {
            *xr = vld1q_f32(t.x.add(r * t.k + 4 * s));
        }
        let line = t.w.add(2 * s * pair_lines);
        let w = pair::<E>(line);
        fma_pair::<R, 0, 1, ODD>(&mut acc, &w, &x);
        let w = pair::<E>(line.add(pair_lines));
        fma_pair::<R, 2, 3, ODD>(&mut acc, &w, &x);
    }
    for j in 4 * quads..t.k {
        let w = E::widen_neon(t.w.add(j / E::INPUTS))[j % E::INPUTS];
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let xr = *t.x.add(r * t.k + j);
            for q in 0..4 {
                acc_r[0][q] = vfmaq_n_f32(acc_r[0][q], w[q], xr);
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        let o = t.out.add(r * t.stride);
        let v = if ODD == 1 {
            [0, 1, 2, 3].map(|q| vaddq_f32(acc_r[0][q], acc_r[1][q]))
        } else {
            acc_r[0]
        };
        if t.valid == BLOCK_ROWS {
            for (q, vq) in v.iter().enumerate() {
                vst1q_f32(o.add(4 * q), *vq);
            }
        } else {
            let mut row = [0f32; BLOCK_ROWS];
            for (q, vq) in v.iter().enumerate() {
                vst1q_f32(row.as_mut_ptr().add(4 * q), *vq);
            }
            std::ptr::copy_nonoverlapping(row.as_ptr(), o, t.valid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversion_matches_half() {
        let bits: Vec<u16> = [
            0.0f32, -0.0, 1.0, -2.5, 65504.0, 6.1e-5, 5.96e-8, 1e-7, 3.0078125,
        ]
        .iter()
        .map(|v| half::f16::from_f32(*v).to_bits())
        .chain([0x7c00, 0xfc00, 0x7e00, 0x0001, 0x03ff, 0x8001, 0x3c01])
        .collect();
        for chunk in bits.chunks(8) {
            let mut v = [0u16; 8];
            v[..chunk.len()].copy_from_slice(chunk);
            let mut out = [0f32; 8];
            // SAFETY: `v` holds 8 values, `out` room for 8.
            unsafe {
                let (lo, hi) = f16x8_to_f32(vld1q_u16(v.as_ptr()));
                vst1q_f32(out.as_mut_ptr(), lo);
                vst1q_f32(out.as_mut_ptr().add(4), hi);
            }
            for (b, o) in v.iter().zip(out) {
                let want = half::f16::from_bits(*b).to_f32();
                assert!(
                    o.to_bits() == want.to_bits() || (o.is_nan() && want.is_nan()),
                    "{b:#06x}: {o} vs {want}"
                );
            }
        }
    }
}
