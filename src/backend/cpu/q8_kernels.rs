//! Q8_0 × int8-activation kernels over the packed layout of [`Q8Matrix`]:
//! AVX-512 VNNI (`vpdpbusd`), AVX2 (`vpmaddubsw` with the sign trick) and
//! scalar. Each group's integer dot products are exact; the f32 scales are
//! applied once per group, as one fused multiply-add on every path: the
//! next product quantizes these outputs to int8, so a last-bit difference
//! between paths becomes a different rounding of some activations
//! (docs/quantization-determinism.md).

use super::q8::{Q8Matrix, QActs, BLOCK_ROWS, K_STEP};

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Q8Isa {
    Scalar,
    Avx2,
    Vnni,
    /// aarch64 NEON, widening multiplies.
    Neon,
    /// aarch64 NEON with `sdot`.
    NeonDot,
}

/// The best Q8 kernel this CPU runs (follows `NANOINFER_ISA` like the dense kernels).
pub fn q8_isa() -> Q8Isa {
    use super::isa::{has_dotprod, has_vnni, isa, Isa};
    match isa() {
        Isa::Avx512 if has_vnni() => Q8Isa::Vnni,
        Isa::Avx512 | Isa::Avx2Fma => Q8Isa::Avx2,
        Isa::Neon if has_dotprod() => Q8Isa::NeonDot,
        Isa::Neon => Q8Isa::Neon,
        Isa::Scalar => Q8Isa::Scalar,
    }
}

/// Which kernels can run here (for tests).
pub fn available_q8_isas() -> Vec<Q8Isa> {
    let mut v = vec![Q8Isa::Scalar];
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            v.push(Q8Isa::Avx2);
        }
        if super::isa::has_vnni() {
            v.push(Q8Isa::Vnni);
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        v.push(Q8Isa::Neon);
        if std::arch::is_aarch64_feature_detected!("dotprod") {
            v.push(Q8Isa::NeonDot);
        }
    }
    v
}

/// Calls `$f::<MR, NB>` for the row/block tile shape: shared by the Q8_0 and
/// int4 kernels.
macro_rules! dispatch {
    ($f:ident, $mr:expr, $nb:expr, $($arg:expr),*) => {
        match ($mr, $nb) {
            (1, 4) => $f::<1, 4>($($arg),*),
            (1, 2) => $f::<1, 2>($($arg),*),
            (2, 2) => $f::<2, 2>($($arg),*),
            (3, 2) => $f::<3, 2>($($arg),*),
            (4, 2) => $f::<4, 2>($($arg),*),
            (1, _) => $f::<1, 1>($($arg),*),
            (2, _) => $f::<2, 1>($($arg),*),
            (3, _) => $f::<3, 1>($($arg),*),
            _ => $f::<4, 1>($($arg),*),
        }
    };
}
pub(super) use dispatch;

#[cfg(target_arch = "aarch64")]
use super::neon_q8::{micro_sdot, micro_widen};

/// `out[r, b·16 + j] = Σ_g sw·sx·Σ q_w q_x` for rows `r < a.m` and the
/// weight rows of blocks `b0..b1`.
///
/// # Safety
/// `isa` must be supported by the CPU; `a` must be quantized with `w`'s
/// group size and `kp`; `out` points at an `[a.m, stride]` buffer whose
/// columns `b0·16 .. min(b1·16, w.rows)` may be written by this call.
pub unsafe fn q8_blocks(
    isa: Q8Isa,
    a: &QActs,
    w: &Q8Matrix,
    b0: usize,
    b1: usize,
    out: *mut f32,
    stride: usize,
) {
    debug_assert!(a.kp == w.kp && a.group == w.group && a.n_groups == w.n_groups);
    let m = a.m;
    let (mr_max, nb_max) = match (m, isa) {
        (1, Q8Isa::Neon | Q8Isa::NeonDot) => (1, 2),
        (1, _) => (1, 4),
        // 4 × 2 blocks would hold 16 integer accumulators: more than AVX2's
        // 16 registers once the weights and temporaries are counted.
        (_, Q8Isa::Avx2) => (4, 1),
        // NEON: 16 i32 and 16 f32 accumulators per 4 × 1 tile.
        (_, Q8Isa::Neon | Q8Isa::NeonDot) => (4, 1),
        _ => (4, 2),
    };
    let mut r = 0;
    while r < m {
        let mr = (m - r).min(mr_max);
        let mut b = b0;
        while b < b1 {
            let nb = match b1 - b {
                left if left >= nb_max => nb_max,
                // Decode tasks hold 2-3 blocks: on AVX2 two blocks per tile
                // keep twice the loads in flight (measured on Zen 3; the
                // VNNI path keeps its tuned 4-or-1).
                left if left >= 2 && nb_max >= 2 && isa == Q8Isa::Avx2 => 2,
                _ => 1,
            };
            let valid = (w.rows - b * BLOCK_ROWS).min(nb * BLOCK_ROWS);
            let op = out.add(r * stride + b * BLOCK_ROWS);
            match isa {
                #[cfg(target_arch = "x86_64")]
                Q8Isa::Vnni => dispatch!(micro_vnni, mr, nb, a, r, w, b, op, stride, valid),
                #[cfg(target_arch = "x86_64")]
                Q8Isa::Avx2 => dispatch!(micro_avx2, mr, nb, a, r, w, b, op, stride, valid),
                #[cfg(target_arch = "aarch64")]
                Q8Isa::NeonDot => dispatch!(micro_sdot, mr, nb, a, r, w, b, op, stride, valid),
                #[cfg(target_arch = "aarch64")]
                Q8Isa::Neon => dispatch!(micro_widen, mr, nb, a, r, w, b, op, stride, valid),
                _ => micro_scalar(mr, nb, a, r, w, b, op, stride, valid),
            }
            b += nb;
        }
        r += mr;
    }
}

/// Writes `acc` (MR rows × NB·16 columns) keeping only the first `valid` columns.
#[inline(always)]
pub(super) unsafe fn store_rows<const MR: usize, const NB: usize>(
    acc: &[[[f32; BLOCK_ROWS]; NB]; MR],
    out: *mut f32,
    stride: usize,
    valid: usize,
) {
    for (r, row) in acc.iter().enumerate() {
        let flat = row.as_ptr() as *const f32;
        std::ptr::copy_nonoverlapping(flat, out.add(r * stride), valid);
    }
}

/// Stores AVX-512 accumulators (MR rows × NB blocks of 16 columns), keeping
/// the first `valid` columns: the tail of the Q8_0 and int4 micro-kernels.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn store_acc512<const MR: usize, const NB: usize>(
    acc: &[[__m512; NB]; MR],
    out: *mut f32,
    stride: usize,
    valid: usize,
) {
    if valid == NB * BLOCK_ROWS {
        for (r, acc_row) in acc.iter().enumerate() {
            for (nb, v) in acc_row.iter().enumerate() {
                _mm512_storeu_ps(out.add(r * stride + nb * BLOCK_ROWS), *v);
            }
        }
    } else {
        let mut tmp = [[[0f32; BLOCK_ROWS]; NB]; MR];
        for (t_row, acc_row) in tmp.iter_mut().zip(acc.iter()) {
            for (t, v) in t_row.iter_mut().zip(acc_row.iter()) {
                _mm512_storeu_ps(t.as_mut_ptr(), *v);
            }
        }
        store_rows(&tmp, out, stride, valid);
    }
}

/// As `store_acc512`, for AVX2 accumulators (two 8-lane halves per block).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn store_acc256<const MR: usize, const NB: usize>(
    acc: &[[[__m256; 2]; NB]; MR],
    out: *mut f32,
    stride: usize,
    valid: usize,
) {
    let mut tmp = [[[0f32; BLOCK_ROWS]; NB]; MR];
    for (t_row, acc_row) in tmp.iter_mut().zip(acc.iter()) {
        for (t, v) in t_row.iter_mut().zip(acc_row.iter()) {
            _mm256_storeu_ps(t.as_mut_ptr(), v[0]);
            _mm256_storeu_ps(t.as_mut_ptr().add(8), v[1]);
        }
    }
    store_rows(&tmp, out, stride, valid);
}

#[allow(clippy::too_many_arguments)]
unsafe fn micro_scalar(
    mr: usize,
    nb: usize,
    a: &QActs,
    r0: usize,
    w: &Q8Matrix,
    blk: usize,
    out: *mut f32,
    stride: usize,
    valid: usize,
) {
    let (kp, ng, g) = (w.kp, w.n_groups, w.group);
    for r in 0..mr {
        let x = &a.q[(r0 + r) * kp..(r0 + r + 1) * kp];
        for col in 0..valid {
            let (b, j) = (blk + col / BLOCK_ROWS, col % BLOCK_ROWS);
            let wb = &w.packed[b * kp * BLOCK_ROWS..(b + 1) * kp * BLOCK_ROWS];
            let mut sum = 0f32;
            for gi in 0..ng {
                let mut isum = 0i32;
                for kk in gi * g..((gi + 1) * g).min(kp) {
                    let wq = wb[(kk / K_STEP) * K_STEP * BLOCK_ROWS + j * K_STEP + kk % K_STEP]
                        as i32
                        - 128;
                    isum += wq * x[kk] as i32;
                }
                let sw = w.scales[(b * ng + gi) * BLOCK_ROWS + j];
                sum = (isum as f32).mul_add(sw * a.scales[(r0 + r) * ng + gi], sum);
            }
            *out.add(r * stride + col) = sum;
        }
    }
    let _ = nb;
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn micro_vnni<const MR: usize, const NB: usize>(
    a: &QActs,
    r0: usize,
    w: &Q8Matrix,
    blk: usize,
    out: *mut f32,
    stride: usize,
    valid: usize,
) {
    let (kp, ng, g) = (w.kp, w.n_groups, w.group);
    let wbase = w.packed.as_ptr().add(blk * kp * BLOCK_ROWS);
    let sbase = w.scales.as_ptr().add(blk * ng * BLOCK_ROWS);
    let xbase = a.q.as_ptr().add(r0 * kp);
    let mut acc = [[_mm512_setzero_ps(); NB]; MR];
    for gi in 0..ng {
        let (k0, k1) = (gi * g, ((gi + 1) * g).min(kp));
        let mut ints = [[_mm512_setzero_si512(); NB]; MR];
        for (r, row) in ints.iter_mut().enumerate() {
            let bias = _mm512_set1_epi32(*a.bias.get_unchecked((r0 + r) * ng + gi));
            row.iter_mut().for_each(|v| *v = bias);
        }
        let mut kk = k0;
        while kk < k1 {
            let mut wv = [_mm512_setzero_si512(); NB];
            for (nb, v) in wv.iter_mut().enumerate() {
                *v = _mm512_loadu_si512(
                    wbase.add(nb * kp * BLOCK_ROWS + kk * BLOCK_ROWS) as *const _
                );
            }
            for (r, row) in ints.iter_mut().enumerate() {
                let xb = _mm512_set1_epi32((xbase.add(r * kp + kk) as *const i32).read_unaligned());
                for (acc_i, v) in row.iter_mut().zip(wv.iter()) {
                    *acc_i = _mm512_dpbusd_epi32(*acc_i, *v, xb);
                }
            }
            kk += K_STEP;
        }
        let mut sw = [_mm512_setzero_ps(); NB];
        for (nb, v) in sw.iter_mut().enumerate() {
            *v = _mm512_loadu_ps(sbase.add((nb * ng + gi) * BLOCK_ROWS));
        }
        for (r, (acc_row, int_row)) in acc.iter_mut().zip(ints.iter()).enumerate() {
            let sx = _mm512_set1_ps(*a.scales.get_unchecked((r0 + r) * ng + gi));
            for ((f, i), s) in acc_row.iter_mut().zip(int_row.iter()).zip(sw.iter()) {
                *f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(*i), _mm512_mul_ps(*s, sx), *f);
            }
        }
    }
    store_acc512(&acc, out, stride, valid);
}

/// AVX2 without VNNI: `vpmaddubsw(|x|, sign(w, x))` then `vpmaddwd` by 1
/// gives each i32 lane the 4-byte dot product. Each 64-byte step is two
/// 256-bit halves (rows 0–7 and 8–15 of the block).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn micro_avx2<const MR: usize, const NB: usize>(
    a: &QActs,
    r0: usize,
    w: &Q8Matrix,
    blk: usize,
    out: *mut f32,
    stride: usize,
    valid: usize,
) {
    let (kp, ng, g) = (w.kp, w.n_groups, w.group);
    let wbase = w.packed.as_ptr().add(blk * kp * BLOCK_ROWS);
    let sbase = w.scales.as_ptr().add(blk * ng * BLOCK_ROWS);
    let xbase = a.q.as_ptr().add(r0 * kp);
    let flip = _mm256_set1_epi8(-128);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[[_mm256_setzero_ps(); 2]; NB]; MR];
    for gi in 0..ng {
        let (k0, k1) = (gi * g, ((gi + 1) * g).min(kp));
        let mut ints = [[[_mm256_setzero_si256(); 2]; NB]; MR];
        let mut kk = k0;
        while kk < k1 {
            let mut wv = [[_mm256_setzero_si256(); 2]; NB];
            for (nb, v) in wv.iter_mut().enumerate() {
                let p = wbase.add(nb * kp * BLOCK_ROWS + kk * BLOCK_ROWS) as *const __m256i;
                // Undo the +128 offset: (q + 128) ^ 0x80 == q as a signed byte.
                v[0] = _mm256_xor_si256(_mm256_loadu_si256(p), flip);
                v[1] = _mm256_xor_si256(_mm256_loadu_si256(p.add(1)), flip);
            }
            for (r, row) in ints.iter_mut().enumerate() {
                let xb = _mm256_set1_epi32((xbase.add(r * kp + kk) as *const i32).read_unaligned());
                let xabs = _mm256_abs_epi8(xb);
                for (acc_i, v) in row.iter_mut().zip(wv.iter()) {
                    for h in 0..2 {
                        let prod = _mm256_maddubs_epi16(xabs, _mm256_sign_epi8(v[h], xb));
                        acc_i[h] = _mm256_add_epi32(acc_i[h], _mm256_madd_epi16(prod, ones));
                    }
                }
            }
            kk += K_STEP;
        }
        for (r, (acc_row, int_row)) in acc.iter_mut().zip(ints.iter()).enumerate() {
            let sx = _mm256_set1_ps(*a.scales.get_unchecked((r0 + r) * ng + gi));
            for (nb, (f, i)) in acc_row.iter_mut().zip(int_row.iter()).enumerate() {
                for h in 0..2 {
                    let sw = _mm256_loadu_ps(sbase.add((nb * ng + gi) * BLOCK_ROWS + h * 8));
                    f[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i[h]), _mm256_mul_ps(sw, sx), f[h]);
                }
            }
        }
    }
    store_acc256(&acc, out, stride, valid);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exact integer dot products per group, scales applied in f64.
    fn reference(a: &QActs, w: &Q8Matrix) -> Vec<f32> {
        let mut out = vec![0f32; a.m * w.rows];
        for r in 0..a.m {
            for c in 0..w.rows {
                let mut s = 0f64;
                for gi in 0..w.n_groups {
                    let mut isum = 0i64;
                    for kk in gi * w.group..((gi + 1) * w.group).min(w.cols) {
                        isum += w.q(c, kk) as i64 * a.q[r * a.kp + kk] as i64;
                    }
                    s += isum as f64 * w.scale(c, gi) as f64 * a.scales[r * a.n_groups + gi] as f64;
                }
                out[r * w.rows + c] = s as f32;
            }
        }
        out
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(7);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 4001) as f32 / 1000.0 - 2.0
            })
            .collect()
    }

    #[test]
    fn every_kernel_matches_exact_reference() {
        for &(m, k, n, group) in &[
            (1, 64, 16, 32),
            (1, 576, 67, 32),
            (3, 70, 35, 32),
            (5, 576, 64, 64),
            (9, 576, 40, 128),
            (4, 128, 17, 4),
        ] {
            let w = Q8Matrix::quantize(n, k, group, &values(n * k, 1)).unwrap();
            let mut a = QActs::default();
            a.quantize(&values(m * k, 2), m, k, group);
            let want = reference(&a, &w);
            for isa in available_q8_isas() {
                let mut out = vec![f32::NAN; m * n];
                // SAFETY: the ISA is available; shapes match; all blocks are computed.
                unsafe { q8_blocks(isa, &a, &w, 0, n.div_ceil(BLOCK_ROWS), out.as_mut_ptr(), n) };
                for (i, (g, e)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (g - e).abs() <= 1e-4 * e.abs().max(1.0),
                        "{isa:?} m={m} k={k} n={n} g={group} #{i}: {g} vs {e}"
                    );
                }
            }
        }
    }
}
