//! Blocked GEMM for prefill (many activation rows) on AVX-512: a column
//! block of the weights is packed (and widened from F16/BF16 once) into
//! k-major panels of 32 columns, then an 8 × 32 register tile of outer
//! products runs over every activation row. Panels of `KC` inputs fit in L1
//! next to the 8 activation rows they meet.

use super::elem::WeightElem;
use std::cell::RefCell;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Output columns per panel (two 512-bit vectors).
pub const NR: usize = 32;
/// Activation rows per register tile.
const MR: usize = 8;
/// Inputs per packed panel (32 · 192 · 4 B = 24 KiB).
const KC: usize = 192;

thread_local! {
    static PANELS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `out[r, c] = Σ_j x[r, j] · w[c, j]` for `r < m`, `c0 <= c < c1`.
///
/// # Safety
/// AVX-512F must be available; `x` holds `m * k` values, `w` at least
/// `c1 * k`; `out` points at an `[m, stride]` buffer whose columns `c0..c1`
/// belong to this call.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_block<W: WeightElem>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
    c0: usize,
    c1: usize,
    out: *mut f32,
    stride: usize,
) {
    let n_panels = (c1 - c0).div_ceil(NR);
    PANELS.with(|buf| {
        let mut buf = buf.borrow_mut();
        if buf.len() < n_panels * KC * NR {
            buf.resize(n_panels * KC * NR, 0.0);
        }
        let mut kb = 0;
        while kb < k {
            let kc = KC.min(k - kb);
            for p in 0..n_panels {
                let panel = &mut buf[p * KC * NR..(p + 1) * KC * NR];
                for j in 0..NR {
                    let col = c0 + p * NR + j;
                    if col < c1 {
                        let src = &w[col * k + kb..col * k + kb + kc];
                        for (kk, v) in src.iter().enumerate() {
                            *panel.get_unchecked_mut(kk * NR + j) = v.to_f32();
                        }
                    } else {
                        for kk in 0..kc {
                            panel[kk * NR + j] = 0.0;
                        }
                    }
                }
            }
            let mut r = 0;
            while r < m {
                let mr = (m - r).min(MR);
                for p in 0..n_panels {
                    let col = c0 + p * NR;
                    let valid = (c1 - col).min(NR);
                    let args = (
                        x.as_ptr().add(r * k + kb),
                        k,
                        buf.as_ptr().add(p * KC * NR),
                        kc,
                        out.add(r * stride + col),
                        stride,
                        valid,
                        kb > 0,
                    );
                    match mr {
                        8 => micro::<8>(args),
                        7 => micro::<7>(args),
                        6 => micro::<6>(args),
                        5 => micro::<5>(args),
                        4 => micro::<4>(args),
                        3 => micro::<3>(args),
                        2 => micro::<2>(args),
                        _ => micro::<1>(args),
                    }
                }
                r += mr;
            }
            kb += kc;
        }
    });
}

type MicroArgs = (
    *const f32,
    usize,
    *const f32,
    usize,
    *mut f32,
    usize,
    usize,
    bool,
);

/// `out[MR, valid] (+)= x[MR, kc] · panel[kc, 32]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn micro<const R: usize>((x, ldx, panel, kc, out, ldo, valid, accumulate): MicroArgs) {
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    for kk in 0..kc {
        let b0 = _mm512_loadu_ps(panel.add(kk * NR));
        let b1 = _mm512_loadu_ps(panel.add(kk * NR + 16));
        for (r, a) in acc.iter_mut().enumerate() {
            let xv = _mm512_set1_ps(*x.add(r * ldx + kk));
            a[0] = _mm512_fmadd_ps(xv, b0, a[0]);
            a[1] = _mm512_fmadd_ps(xv, b1, a[1]);
        }
    }
    let m0: __mmask16 = if valid >= 16 {
        0xffff
    } else {
        (1u32 << valid) as u16 - 1
    };
    let m1: __mmask16 = if valid >= 32 {
        0xffff
    } else if valid <= 16 {
        0
    } else {
        (1u32 << (valid - 16)) as u16 - 1
    };
    for (r, a) in acc.iter().enumerate() {
        let o = out.add(r * ldo);
        let (mut v0, mut v1) = (a[0], a[1]);
        if accumulate {
            v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, o));
            v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, o.add(16)));
        }
        _mm512_mask_storeu_ps(o, m0, v0);
        _mm512_mask_storeu_ps(o.add(16), m1, v1);
    }
}
