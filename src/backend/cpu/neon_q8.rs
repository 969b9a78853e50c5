//! aarch64 NEON Q8_0 kernels over the packed layout of [`Q8Matrix`]
//! (`q8_kernels.rs` schedules them), and the 4-byte integer dot products
//! they share with the int4 kernels of `neon_q4.rs`.
//!
//! A packed step is 16 rows × 4 inputs (64 bytes): four vectors of 4 rows.
//! [`IntDot::dot`] adds, to each row's i32 lane, the dot product of its 4
//! weight bytes with 4 activation bytes picked by lane from a vector of 16,
//! so one load of activations serves 4 steps. With DotProd that is one
//! `sdot` (by element, through inline assembly: the intrinsics are not
//! stable Rust); without it, `smull`/`smull2` to 16 bits, a pairwise add
//! (two products of at most 127² each fit i16) and `sadalp` into the i32
//! lanes. Both are exact, and the f32 scales are applied as in the scalar
//! kernel (`(Σq·q as f32)·(sw·sx) + acc`, fused), so every path gives the
//! same bits.

use super::q8::{Q8Matrix, QActs, BLOCK_ROWS, K_STEP};
use super::q8_kernels::store_rows;
use std::arch::aarch64::*;
use std::arch::asm;

/// How 4-byte dot products are computed.
pub(crate) trait IntDot {
    /// `acc[i] + Σ_b w[4i + b] · x[4L + b]` for the 4 lanes `i`.
    ///
    /// # Safety
    /// The instructions of the implementation must be available.
    unsafe fn dot<const L: i32>(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t;
}

/// `sdot` (Armv8.2 DotProd).
pub(crate) struct Sdot;

impl IntDot for Sdot {
    #[inline(always)]
    unsafe fn dot<const L: i32>(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
        let mut acc = acc;
        // SAFETY: the caller checked DotProd (`has_dotprod`); registers only.
        asm!(
            ".arch_extension dotprod",
            "sdot {acc:v}.4s, {w:v}.16b, {x:v}.4b[{l}]",
            acc = inout(vreg) acc,
            w = in(vreg) w,
            x = in(vreg) x,
            l = const L,
            options(pure, nomem, nostack, preserves_flags),
        );
        acc
    }
}

/// Plain NEON: widening multiplies.
pub(crate) struct Widen;

impl IntDot for Widen {
    #[inline(always)]
    unsafe fn dot<const L: i32>(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
        let xd = vreinterpretq_s8_s32(vdupq_laneq_s32::<L>(vreinterpretq_s32_s8(x)));
        // Rows 0–1 and 2–3 as 8 products each, then pairs: [r0, r0, r1, r1,
        // r2, r2, r3, r3] (|sum| ≤ 2·127·127 < 2¹⁵), then pairs into i32.
        let lo = vmull_s8(vget_low_s8(w), vget_low_s8(xd));
        let hi = vmull_high_s8(w, xd);
        vpadalq_s16(acc, vpaddq_s16(lo, hi))
    }
}

/// Writes `acc` (MR rows × NB·16 columns), keeping the first `valid` columns.
#[inline(always)]
pub(crate) unsafe fn store<const MR: usize, const NB: usize>(
    acc: &[[[float32x4_t; 4]; NB]; MR],
    out: *mut f32,
    stride: usize,
    valid: usize,
) {
    let mut rows = [[[0f32; BLOCK_ROWS]; NB]; MR];
    for (row, acc_r) in rows.iter_mut().zip(acc) {
        for (dst, a) in row.iter_mut().zip(acc_r) {
            for (q, v) in a.iter().enumerate() {
                vst1q_f32(dst.as_mut_ptr().add(4 * q), *v);
            }
        }
    }
    store_rows(&rows, out, stride, valid);
}

/// One packed step (4 inputs at `kk`) of `NB` blocks from `wbase` (blocks
/// `kp · 16` bytes apart), as signed bytes: `[block][4 rows]`.
#[inline(always)]
unsafe fn load_step<const NB: usize>(
    wbase: *const u8,
    block_bytes: usize,
    kk: usize,
) -> [[int8x16_t; 4]; NB] {
    let flip = vdupq_n_u8(0x80);
    let mut wv = [[vdupq_n_s8(0); 4]; NB];
    for (nb, v) in wv.iter_mut().enumerate() {
        let p = wbase.add(nb * block_bytes + kk * BLOCK_ROWS);
        for (q, vq) in v.iter_mut().enumerate() {
            // Undo the +128 offset: (q + 128) ^ 0x80 == q as a signed byte.
            *vq = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(p.add(16 * q)), flip));
        }
    }
    wv
}

/// `ints[r][nb][q] += w · x[r]` for the step's weights and activation lane `L`.
#[inline(always)]
unsafe fn dot_step<D: IntDot, const L: i32, const MR: usize, const NB: usize>(
    ints: &mut [[[int32x4_t; 4]; NB]; MR],
    wv: &[[int8x16_t; 4]; NB],
    x: &[int8x16_t; MR],
) {
    for (row, xr) in ints.iter_mut().zip(x) {
        for (acc, w) in row.iter_mut().zip(wv) {
            for q in 0..4 {
                acc[q] = D::dot::<L>(acc[q], w[q], *xr);
            }
        }
    }
}

/// `MR` rows × `NB` blocks of Q8_0 weights; the arguments of
/// `q8_kernels::q8_blocks`'s tiles.
///
/// # Safety
/// `D`'s instructions are available; the tile lies inside `a`, `w` and `out`
/// as `q8_blocks` ensures.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn micro<D: IntDot, const MR: usize, const NB: usize>(
    a: &QActs,
    r0: usize,
    w: &Q8Matrix,
    blk: usize,
    out: *mut f32,
    stride: usize,
    valid: usize,
) {
    let (kp, ng, g) = (w.kp, w.n_groups, w.group);
    let block_bytes = kp * BLOCK_ROWS;
    let wbase = w.packed.as_ptr().add(blk * block_bytes);
    let sbase = w.scales.as_ptr().add(blk * ng * BLOCK_ROWS);
    let xbase = a.q.as_ptr().add(r0 * kp);
    let mut acc = [[[vdupq_n_f32(0.0); 4]; NB]; MR];
    for gi in 0..ng {
        let (k0, k1) = (gi * g, ((gi + 1) * g).min(kp));
        let mut ints = [[[vdupq_n_s32(0); 4]; NB]; MR];
        let mut kk = k0;
        while kk + 4 * K_STEP <= k1 {
            // 16 inputs: one activation load per row, four steps by lane.
            let mut x = [vdupq_n_s8(0); MR];
            for (r, xr) in x.iter_mut().enumerate() {
                *xr = vld1q_s8(xbase.add(r * kp + kk));
            }
            let wv = load_step::<NB>(wbase, block_bytes, kk);
            dot_step::<D, 0, MR, NB>(&mut ints, &wv, &x);
            let wv = load_step::<NB>(wbase, block_bytes, kk + K_STEP);
            dot_step::<D, 1, MR, NB>(&mut ints, &wv, &x);
            let wv = load_step::<NB>(wbase, block_bytes, kk + 2 * K_STEP);
            dot_step::<D, 2, MR, NB>(&mut ints, &wv, &x);
            let wv = load_step::<NB>(wbase, block_bytes, kk + 3 * K_STEP);
            dot_step::<D, 3, MR, NB>(&mut ints, &wv, &x);
            kk += 4 * K_STEP;
        }
        while kk < k1 {
            let mut x = [vdupq_n_s8(0); MR];
            for (r, xr) in x.iter_mut().enumerate() {
                let v = (xbase.add(r * kp + kk) as *const i32).read_unaligned();
                *xr = vreinterpretq_s8_s32(vdupq_n_s32(v));
            }
            let wv = load_step::<NB>(wbase, block_bytes, kk);
            dot_step::<D, 0, MR, NB>(&mut ints, &wv, &x);
            kk += K_STEP;
        }
        for (r, (acc_r, int_r)) in acc.iter_mut().zip(&ints).enumerate() {
            let sx = *a.scales.get_unchecked((r0 + r) * ng + gi);
            for (nb, (f, i)) in acc_r.iter_mut().zip(int_r).enumerate() {
                let sp = sbase.add((nb * ng + gi) * BLOCK_ROWS);
                for q in 0..4 {
                    let s = vmulq_n_f32(vld1q_f32(sp.add(4 * q)), sx);
                    f[q] = vfmaq_f32(f[q], vcvtq_f32_s32(i[q]), s);
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
    a: &QActs,
    r0: usize,
    w: &Q8Matrix,
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
    a: &QActs,
    r0: usize,
    w: &Q8Matrix,
    blk: usize,
    out: *mut f32,
    stride: usize,
    valid: usize,
) {
    micro::<Widen, MR, NB>(a, r0, w, blk, out, stride, valid)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both dot products, every lane, against plain integer sums over the
    /// extreme values (±127, -128 in activations only).
    fn matches_scalar<D: IntDot>() {
        let w: Vec<i8> = (0..16)
            .map(|i| [127, -127, 5, -1][i % 4] * (i as i8 % 3 - 1))
            .collect();
        let x: Vec<i8> = (0..16)
            .map(|i| [-128, 127, -7, 3][i % 4] * ((i / 4) as i8 % 2 * 2 - 1).max(-1))
            .collect();
        let acc0 = [1i32, -2, 3, 1 << 20];
        // SAFETY: 16 bytes each; the caller checked `D`'s instructions.
        let got: [[i32; 4]; 4] = unsafe {
            let (wv, xv) = (vld1q_s8(w.as_ptr()), vld1q_s8(x.as_ptr()));
            let acc = vld1q_s32(acc0.as_ptr());
            let mut out = [[0i32; 4]; 4];
            vst1q_s32(out[0].as_mut_ptr(), D::dot::<0>(acc, wv, xv));
            vst1q_s32(out[1].as_mut_ptr(), D::dot::<1>(acc, wv, xv));
            vst1q_s32(out[2].as_mut_ptr(), D::dot::<2>(acc, wv, xv));
            vst1q_s32(out[3].as_mut_ptr(), D::dot::<3>(acc, wv, xv));
            out
        };
        for (lane, row) in got.iter().enumerate() {
            for (i, &g) in row.iter().enumerate() {
                let want = acc0[i]
                    + (0..4)
                        .map(|b| w[4 * i + b] as i32 * x[4 * lane + b] as i32)
                        .sum::<i32>();
                assert_eq!(g, want, "lane {lane} row {i}");
            }
        }
    }

    #[test]
    fn widening_dot_matches_scalar() {
        matches_scalar::<Widen>();
    }

    #[test]
    fn sdot_matches_scalar_where_the_cpu_has_it() {
        if std::arch::is_aarch64_feature_detected!("dotprod") {
            matches_scalar::<Sdot>();
        } else {
            eprintln!("no DotProd here: sdot not checked");
        }
    }
}
