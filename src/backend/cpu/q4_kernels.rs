//! Int4 weights × int8 activations over the packed layout of [`Q4Matrix`]:
//! AVX-512 VNNI (`vpdpbusd` on the unpacked nibbles, 16 output columns per
//! instruction), AVX2 (`vpmaddubsw`, i16 sums over one 32-input activation
//! block) and scalar. Integer dot products are exact per 32-input activation
//! block; the activation scale is applied per block, the weight scale and
//! zero once per group: `Σ_g s·Σ_b d_b·Σ q·x + m·Σ_b d_b·Σx`.

#[cfg(target_arch = "x86_64")]
use super::q4::K_STEP;
use super::q4::{Q4Acts, Q4Matrix, ACT_BLOCK, BLOCK_ROWS};
use super::q8_kernels::Q8Isa;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// The int4 kernels share the int8 kernels' ISA choice (VNNI, AVX2, scalar).
pub type Q4Isa = Q8Isa;

pub use super::q8_kernels::{available_q8_isas as available_q4_isas, q8_isa as q4_isa};

#[cfg(target_arch = "aarch64")]
use super::neon_q4::{micro_sdot, micro_widen};
use super::q8_kernels::dispatch;
#[cfg(target_arch = "x86_64")]
use super::q8_kernels::{store_acc256, store_acc512};

/// `out[r, b·16 + j] = Σ_k w[b·16 + j, k] · x[r, k]` (dequantized weights,
/// quantized activations) for rows `r < a.m` and weight-row blocks `b0..b1`.
///
/// # Safety
/// `isa` must be supported by the CPU; `a` must be quantized with `w.kp`
/// (in `w`'s input order); `out` points at an `[a.m, stride]` buffer whose
/// columns `b0·16 .. min(b1·16, w.rows)` may be written by this call.
pub unsafe fn q4_blocks(
    isa: Q4Isa,
    a: &Q4Acts,
    w: &Q4Matrix,
    b0: usize,
    b1: usize,
    out: *mut f32,
    stride: usize,
) {
    debug_assert_eq!(a.kp, w.kp);
    let m = a.m;
    let (mr_max, nb_max) = match (m, isa) {
        // NEON: 12 vectors (i32 sums, block and group f32 sums) per row and block.
        (1, Q4Isa::Neon | Q4Isa::NeonDot) => (1, 2),
        (_, Q4Isa::Neon | Q4Isa::NeonDot) => (2, 1),
        (1, _) => (1, 4),
        _ => (4, 2),
    };
    let mut r = 0;
    while r < m {
        let mr = (m - r).min(mr_max);
        let mut b = b0;
        while b < b1 {
            let nb = if b1 - b >= nb_max {
                nb_max
            } else if b1 - b >= 2 && mr == 1 {
                2
            } else {
                1
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
                _ => micro_scalar(mr, a, r, w, b, op, stride, valid),
            }
            b += nb;
        }
        r += mr;
    }
}

#[allow(clippy::too_many_arguments)]
unsafe fn micro_scalar(
    mr: usize,
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
    for r in 0..mr {
        let row = r0 + r;
        let x = &a.q[row * kp..(row + 1) * kp];
        for col in 0..valid {
            let wr = blk * BLOCK_ROWS + col;
            let mut sum = 0f32;
            for gi in 0..ng {
                let (k0, k1) = (gi * g, ((gi + 1) * g).min(kp));
                let (mut dot, mut xsum) = (0f32, 0f32);
                for ab in k0 / ACT_BLOCK..k1 / ACT_BLOCK {
                    let mut isum = 0i32;
                    let k0 = ab * ACT_BLOCK;
                    for (kk, &xv) in x[k0..k0 + ACT_BLOCK].iter().enumerate() {
                        isum += w.q(wr, k0 + kk) as i32 * xv as i32;
                    }
                    dot = (isum as f32).mul_add(a.scales[row * nab + ab], dot);
                    xsum += a.sums[row * nab + ab];
                }
                sum = dot.mul_add(w.scale(wr, gi), sum);
                sum = w.min(wr, gi).mul_add(xsum, sum);
            }
            *out.add(r * stride + col) = sum;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn micro_vnni<const MR: usize, const NB: usize>(
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
    // Bytes per packed block of 16 rows.
    let bstride = kp * BLOCK_ROWS / 2;
    let wbase = w.packed.as_ptr().add(blk * bstride);
    let sbase = w.scales.as_ptr().add(blk * ng * BLOCK_ROWS);
    let mbase = w.mins.as_ptr().add(blk * ng * BLOCK_ROWS);
    let xbase = a.q.as_ptr().add(r0 * kp);
    let dbase = a.scales.as_ptr().add(r0 * nab);
    let ubase = a.sums.as_ptr().add(r0 * nab);
    let low = _mm512_set1_epi8(0x0F);
    let mut acc = [[_mm512_setzero_ps(); NB]; MR];
    for gi in 0..ng {
        let (k0, k1) = (gi * g, ((gi + 1) * g).min(kp));
        let mut gacc = [[_mm512_setzero_ps(); NB]; MR];
        let mut xsum = [0f32; MR];
        let mut kb = k0;
        while kb < k1 {
            let mut ints = [[_mm512_setzero_si512(); NB]; MR];
            for kk in (kb..kb + ACT_BLOCK).step_by(K_STEP) {
                let mut lo = [_mm512_setzero_si512(); NB];
                let mut hi = [_mm512_setzero_si512(); NB];
                for nb in 0..NB {
                    let v = _mm512_loadu_si512(wbase.add(nb * bstride + kk * 8) as *const _);
                    lo[nb] = _mm512_and_si512(v, low);
                    hi[nb] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                }
                for (r, row) in ints.iter_mut().enumerate() {
                    let xp = xbase.add(r * kp + kk) as *const i32;
                    let xl = _mm512_set1_epi32(xp.read_unaligned());
                    let xh = _mm512_set1_epi32(xp.add(1).read_unaligned());
                    for nb in 0..NB {
                        row[nb] = _mm512_dpbusd_epi32(row[nb], lo[nb], xl);
                        row[nb] = _mm512_dpbusd_epi32(row[nb], hi[nb], xh);
                    }
                }
            }
            let ab = kb / ACT_BLOCK;
            for r in 0..MR {
                let d = _mm512_set1_ps(*dbase.add(r * nab + ab));
                xsum[r] += *ubase.add(r * nab + ab);
                for nb in 0..NB {
                    gacc[r][nb] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints[r][nb]), d, gacc[r][nb]);
                }
            }
            kb += ACT_BLOCK;
        }
        for nb in 0..NB {
            let s = _mm512_loadu_ps(sbase.add((nb * ng + gi) * BLOCK_ROWS));
            let mn = _mm512_loadu_ps(mbase.add((nb * ng + gi) * BLOCK_ROWS));
            for r in 0..MR {
                acc[r][nb] = _mm512_fmadd_ps(gacc[r][nb], s, acc[r][nb]);
                acc[r][nb] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[r]), acc[r][nb]);
            }
        }
    }
    store_acc512(&acc, out, stride, valid);
}

/// AVX2 without VNNI: `vpmaddubsw(nibbles, x)` (unsigned × signed, pairs
/// ≤ 2·15·127) summed in i16 over one 32-input block (≤ 8 pairs ·
/// 1905 < 2¹⁵), then `vpmaddwd` by 1 to i32. Each 64-byte step is two
/// 256-bit halves (rows 0–7 and 8–15 of the block).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn micro_avx2<const MR: usize, const NB: usize>(
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
    let bstride = kp * BLOCK_ROWS / 2;
    let wbase = w.packed.as_ptr().add(blk * bstride);
    let sbase = w.scales.as_ptr().add(blk * ng * BLOCK_ROWS);
    let mbase = w.mins.as_ptr().add(blk * ng * BLOCK_ROWS);
    let xbase = a.q.as_ptr().add(r0 * kp);
    let dbase = a.scales.as_ptr().add(r0 * nab);
    let ubase = a.sums.as_ptr().add(r0 * nab);
    let low = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[[_mm256_setzero_ps(); 2]; NB]; MR];
    for gi in 0..ng {
        let (k0, k1) = (gi * g, ((gi + 1) * g).min(kp));
        let mut gacc = [[[_mm256_setzero_ps(); 2]; NB]; MR];
        let mut xsum = [0f32; MR];
        let mut kb = k0;
        while kb < k1 {
            let mut shorts = [[[_mm256_setzero_si256(); 2]; NB]; MR];
            for kk in (kb..kb + ACT_BLOCK).step_by(K_STEP) {
                let mut lo = [[_mm256_setzero_si256(); 2]; NB];
                let mut hi = [[_mm256_setzero_si256(); 2]; NB];
                for nb in 0..NB {
                    let p = wbase.add(nb * bstride + kk * 8) as *const __m256i;
                    for h in 0..2 {
                        let v = _mm256_loadu_si256(p.add(h));
                        lo[nb][h] = _mm256_and_si256(v, low);
                        hi[nb][h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    }
                }
                for (r, row) in shorts.iter_mut().enumerate() {
                    let xp = xbase.add(r * kp + kk) as *const i32;
                    let xl = _mm256_set1_epi32(xp.read_unaligned());
                    let xh = _mm256_set1_epi32(xp.add(1).read_unaligned());
                    for nb in 0..NB {
                        for h in 0..2 {
                            let p = _mm256_add_epi16(
                                _mm256_maddubs_epi16(lo[nb][h], xl),
                                _mm256_maddubs_epi16(hi[nb][h], xh),
                            );
                            row[nb][h] = _mm256_add_epi16(row[nb][h], p);
                        }
                    }
                }
            }
            let ab = kb / ACT_BLOCK;
            for r in 0..MR {
                let d = _mm256_set1_ps(*dbase.add(r * nab + ab));
                xsum[r] += *ubase.add(r * nab + ab);
                for nb in 0..NB {
                    for h in 0..2 {
                        let i = _mm256_madd_epi16(shorts[r][nb][h], ones);
                        gacc[r][nb][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), d, gacc[r][nb][h]);
                    }
                }
            }
            kb += ACT_BLOCK;
        }
        for nb in 0..NB {
            for h in 0..2 {
                let off = (nb * ng + gi) * BLOCK_ROWS + h * 8;
                let s = _mm256_loadu_ps(sbase.add(off));
                let mn = _mm256_loadu_ps(mbase.add(off));
                for r in 0..MR {
                    acc[r][nb][h] = _mm256_fmadd_ps(gacc[r][nb][h], s, acc[r][nb][h]);
                    acc[r][nb][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum[r]), acc[r][nb][h]);
                }
            }
        }
    }
    store_acc256(&acc, out, stride, valid);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exact integer dot products per activation block, scales applied in f64.
    fn reference(a: &Q4Acts, w: &Q4Matrix) -> Vec<f32> {
        let nab = a.kp / ACT_BLOCK;
        let mut out = vec![0f32; a.m * w.rows];
        for r in 0..a.m {
            for c in 0..w.rows {
                let mut s = 0f64;
                for kk in 0..w.cols {
                    let gi = kk / w.group;
                    let wv = w.q(c, kk) as f64 * w.scale(c, gi) as f64 + w.min(c, gi) as f64;
                    s += wv * a.q[r * a.kp + kk] as f64 * a.scales[r * nab + kk / ACT_BLOCK] as f64;
                }
                out[r * w.rows + c] = s as f32;
            }
        }
        out
    }

    fn values(n: usize, seed: u32) -> Vec<u32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(7);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                s
            })
            .collect()
    }

    #[test]
    fn every_kernel_matches_exact_reference() {
        let shapes: [(usize, usize, usize, usize); 7] = [
            (1, 64, 16, 32),
            (1, 576, 67, 128),
            (1, 576, 96, 64),
            (3, 72, 35, 32),
            (5, 576, 64, 64),
            (9, 576, 40, 128),
            (4, 1536, 33, 128),
        ];
        for (m, k, n, group) in shapes {
            let ng = k.div_ceil(group);
            let q: Vec<u8> = values(n * k, 1).iter().map(|v| (v % 16) as u8).collect();
            let z: Vec<u8> = values(n * ng, 2).iter().map(|v| (v % 16) as u8).collect();
            let s: Vec<f32> = values(n * ng, 3)
                .iter()
                .map(|v| (v % 1000) as f32 / 1e4 + 1e-3)
                .collect();
            let w = Q4Matrix::from_quantized(n, k, group, &q, &z, &s, None).unwrap();
            let x: Vec<f32> = values(m * k, 4)
                .iter()
                .map(|v| (v % 4001) as f32 / 1000.0 - 2.0)
                .collect();
            let mut a = Q4Acts::default();
            a.quantize(&x, m, k);
            let want = reference(&a, &w);
            let scale = want.iter().fold(1f32, |acc, v| acc.max(v.abs()));
            for isa in available_q4_isas() {
                let mut out = vec![f32::NAN; m * n];
                // SAFETY: the ISA is available; shapes match; all blocks are computed.
                unsafe { q4_blocks(isa, &a, &w, 0, n.div_ceil(BLOCK_ROWS), out.as_mut_ptr(), n) };
                for (i, (g, e)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (g - e).abs() <= 2e-5 * scale,
                        "{isa:?} m={m} k={k} n={n} g={group} #{i}: {g} vs {e}"
                    );
                }
            }
        }
    }
}
