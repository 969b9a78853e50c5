//! aarch64 NEON int4 (AWQ/GPTQ) kernels over the packed layout of
//! [`Q4Matrix`] (`q4_kernels.rs` schedules them). A packed step is 16
//! rows × 8 inputs (64 bytes): the low nibbles are inputs `k..k+4`, the
//! high nibbles `k+4..k+8`, so `v & 0xF` and `v >> 4` are two ready 4-row ×
//! 4-input operands of the 4-byte dot products of `neon_q8.rs` (`sdot`, or
//! widening multiplies: products ≤ 15 · 127). Integer sums are exact per
//! 32-input activation block, and the scales are applied in the scalar
//! kernel's order with the same fused operations, so every path gives the
//! same bits.

use super::neon_q8::{store, IntDot, Sdot, Widen};
use super::q4::{Q4Acts, Q4Matrix, ACT_BLOCK, BLOCK_ROWS, K_STEP};
use std::arch::aarch64::*;

// An activation block is 4 packed steps.
const _: () = assert!(ACT_BLOCK == 4 * K_STEP);

/// Step `kk` (8 inputs) of `NB` blocks from `wbase` (blocks `block_bytes`
/// apart): `[block][low, high nibbles][4 rows]`.
#[inline(always)]
unsafe fn load_step<const NB: usize>(
    wbase: *const u8,
    block_bytes: usize,
    kk: usize,
) -> [[[int8x16_t; 4]; 2]; NB] {
    let low = vdupq_n_u8(0x0F);
    let mut wv = [[[vdupq_n_s8(0); 4]; 2]; NB];
    for (nb, v) in wv.iter_mut().enumerate() {
        let p = wbase.add(nb * block_bytes + kk * 8);
        let [lo, hi] = v;
        for (q, (l, h)) in lo.iter_mut().zip(hi.iter_mut()).enumerate() {
            let b = vld1q_u8(p.add(16 * q));
            *l = vreinterpretq_s8_u8(vandq_u8(b, low));
            *h = vreinterpretq_s8_u8(vshrq_n_u8::<4>(b));
        }
    }
    wv
}

/// `ints[r][nb][q] += lo · x[r] lane L0 + hi · x[r] lane L1`.
#[inline(always)]
unsafe fn dot_step<D: IntDot, const L0: i32, const L1: i32, const MR: usize, const NB: usize>(
    ints: &mut [[[int32x4_t; 4]; NB]; MR],
    wv: &[[[int8x16_t; 4]; 2]; NB],
    x: &[int8x16_t; MR],
) {
    for (row, xr) in ints.iter_mut().zip(x) {
        for (acc, w) in row.iter_mut().zip(wv) {
            for q in 0..4 {
                acc[q] = D::dot::<L0>(acc[q], w[0][q], *xr);
                acc[q] = D::dot::<L1>(acc[q], w[1][q], *xr);
            }
        }
    }
}

/// `MR` rows × `NB` blocks of int4 weights; the arguments of
/// `q4_kernels::q4_blocks`'s tiles.
///
/// # Safety
/// `D`'s instructions are available; the tile lies inside `a`, `w` and `out`
/// as `q4_blocks` ensures.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn micro<D: IntDot, const MR: usize, const NB: usize>(
    a: &Q4Acts,
    r0: usize,
    w: &Q4Matrix,
    blk: usize,
    out: *mut f32,
    stride: usize,
    valid: usize,
) {
    let (kp, ng, g) = (w.kp, w.n_groups, w.group);
    let nab = kp / ACT_BLOCK;
    let block_bytes = kp * BLOCK_ROWS / 2;
    let wbase = w.packed.as_ptr().add(blk * block_bytes);
    let sbase = w.scales.as_ptr().add(blk * ng * BLOCK_ROWS);
    let mbase = w.mins.as_ptr().add(blk * ng * BLOCK_ROWS);
    let xbase = a.q.as_ptr().add(r0 * kp);
    let dbase = a.scales.as_ptr().add(r0 * nab);
    let ubase = a.sums.as_ptr().add(r0 * nab);
    let zero = vdupq_n_f32(0.0);
    let mut acc = [[[zero; 4]; NB]; MR];
    for gi in 0..ng {
        let (k0, k1) = (gi * g, ((gi + 1) * g).min(kp));
        let mut gacc = [[[zero; 4]; NB]; MR];
        let mut xsum = [0f32; MR];
        let mut kb = k0;
        while kb < k1 {
            let mut ints = [[[vdupq_n_s32(0); 4]; NB]; MR];
            // One activation block: 32 bytes per row, 2 vectors of 4 lanes
            // of 4 inputs; step s (inputs kb + 8s ..) reads lanes 2s, 2s+1.
            let mut x = [[vdupq_n_s8(0); MR]; 2];
            for (h, xh) in x.iter_mut().enumerate() {
                for (r, xr) in xh.iter_mut().enumerate() {
                    *xr = vld1q_s8(xbase.add(r * kp + kb + 16 * h));
                }
            }
            let wv = load_step::<NB>(wbase, block_bytes, kb);
            dot_step::<D, 0, 1, MR, NB>(&mut ints, &wv, &x[0]);
            let wv = load_step::<NB>(wbase, block_bytes, kb + K_STEP);
            dot_step::<D, 2, 3, MR, NB>(&mut ints, &wv, &x[0]);
            let wv = load_step::<NB>(wbase, block_bytes, kb + 2 * K_STEP);
            dot_step::<D, 0, 1, MR, NB>(&mut ints, &wv, &x[1]);
            let wv = load_step::<NB>(wbase, block_bytes, kb + 3 * K_STEP);
            dot_step::<D, 2, 3, MR, NB>(&mut ints, &wv, &x[1]);
            let ab = kb / ACT_BLOCK;
            for (r, (g_r, i_r)) in gacc.iter_mut().zip(&ints).enumerate() {
                let d = *dbase.add(r * nab + ab);
                xsum[r] += *ubase.add(r * nab + ab);
                for (gv, iv) in g_r.iter_mut().zip(i_r) {
                    for q in 0..4 {
                        gv[q] = vfmaq_n_f32(gv[q], vcvtq_f32_s32(iv[q]), d);
                    }
                }
            }
            kb += ACT_BLOCK;
        }
        for nb in 0..NB {
            let off = (nb * ng + gi) * BLOCK_ROWS;
            for q in 0..4 {
                let s = vld1q_f32(sbase.add(off + 4 * q));
                let mn = vld1q_f32(mbase.add(off + 4 * q));
                for r in 0..MR {
                    acc[r][nb][q] = vfmaq_f32(acc[r][nb][q], gacc[r][nb][q], s);
                    acc[r][nb][q] = vfmaq_n_f32(acc[r][nb][q], mn, xsum[r]);
                }
            }
        }
    }
    store(&acc, out, stride, valid);
}

/// [`micro`] with `sdot`.
///
/// # Safety
/// As [`micro`]; the CPU has DotProd.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn micro_sdot<const MR: usize, const NB: usize>(
    a: &Q4Acts,
    r0: usize,
    w: &Q4Matrix,
    blk: usize,
    out: *mut f32,
    stride: usize,
    valid: usize,
) {
    micro::<Sdot, MR, NB>(a, r0, w, blk, out, stride, valid)
}

/// [`micro`] with widening multiplies.
///
/// # Safety
/// As [`micro`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn micro_widen<const MR: usize, const NB: usize>(
    a: &Q4Acts,
    r0: usize,
    w: &Q4Matrix,
    blk: usize,
    out: *mut f32,
    stride: usize,
    valid: usize,
) {
    micro::<Widen, MR, NB>(a, r0, w, blk, out, stride, valid)
}
