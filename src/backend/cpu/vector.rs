//! Small vector kernels with SIMD dispatch: dot product, axpy, exp, softmax, SiLU·mul.

use super::isa::{isa, Isa};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Σ a[i]·b[i] over the common length.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    match isa() {
        // SAFETY: the ISA was detected at run time; both slices hold n elements.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { dot_avx512(a.as_ptr(), b.as_ptr(), n) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { super::vector_avx2::dot(a.as_ptr(), b.as_ptr(), n) },
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { super::neon_vector::dot(a.as_ptr(), b.as_ptr(), n) },
        _ => a[..n].iter().zip(&b[..n]).map(|(x, y)| x * y).sum(),
    }
}

/// y[i] += alpha · x[i].
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    match isa() {
        // SAFETY: the ISA was detected at run time; both slices hold n elements.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { axpy_avx512(alpha, x.as_ptr(), y.as_mut_ptr(), n) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { super::vector_avx2::axpy(alpha, x.as_ptr(), y.as_mut_ptr(), n) },
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { super::neon_vector::axpy(alpha, x.as_ptr(), y.as_mut_ptr(), n) },
        _ => {
            for (yi, xi) in y[..n].iter_mut().zip(&x[..n]) {
                *yi += alpha * xi;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_avx512(a: *const f32, b: *const f32, n: usize) -> f32 {
    let mut acc0 = _mm512_setzero_ps();
    let mut acc1 = _mm512_setzero_ps();
    let mut i = 0;
    while i + 32 <= n {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a.add(i)), _mm512_loadu_ps(b.add(i)), acc0);
        acc1 = _mm512_fmadd_ps(
            _mm512_loadu_ps(a.add(i + 16)),
            _mm512_loadu_ps(b.add(i + 16)),
            acc1,
        );
        i += 32;
    }
    if i + 16 <= n {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a.add(i)), _mm512_loadu_ps(b.add(i)), acc0);
        i += 16;
    }
    let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    while i < n {
        s += *a.add(i) * *b.add(i);
        i += 1;
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpy_avx512(alpha: f32, x: *const f32, y: *mut f32, n: usize) {
    let av = _mm512_set1_ps(alpha);
    let mut i = 0;
    while i + 16 <= n {
        let yv = _mm512_fmadd_ps(av, _mm512_loadu_ps(x.add(i)), _mm512_loadu_ps(y.add(i)));
        _mm512_storeu_ps(y.add(i), yv);
        i += 16;
    }
    while i < n {
        *y.add(i) += alpha * *x.add(i);
        i += 1;
    }
}

/// e^x for each lane: a few ulp from libm above -87, exactly 0 below.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
/// # Safety
/// AVX-512F must be available.
pub unsafe fn exp512(x: __m512) -> __m512 {
    // Below -87 the result is a denormal or 0: return exactly 0 (softmax of -inf).
    let keep = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(-87.0));
    let x = _mm512_max_ps(x, _mm512_set1_ps(-87.0));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    // r = x - n·ln2 in two steps (Cody–Waite) keeps r exact to ~1 ulp.
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_145_75), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428_606_8e-6), r);
    let mut p = _mm512_set1_ps(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n))
}

/// `x[i] = exp(x[i] - max)`; returns `1 / Σ x[i]`.
///
/// # Safety
/// AVX-512F must be available; `x` must not be empty.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub unsafe fn softmax_unnormalized(x: &mut [f32]) -> f32 {
    let n = x.len();
    let full = n / 16 * 16;
    let tail_mask: __mmask16 = ((1u32 << (n - full)) - 1) as u16;
    let p = x.as_mut_ptr();
    let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i < full {
        mx = _mm512_max_ps(mx, _mm512_loadu_ps(p.add(i)));
        i += 16;
    }
    mx = _mm512_max_ps(
        mx,
        _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), tail_mask, p.add(full)),
    );
    let m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    let mut sum = _mm512_setzero_ps();
    i = 0;
    while i < full {
        let e = exp512(_mm512_sub_ps(_mm512_loadu_ps(p.add(i)), m));
        _mm512_storeu_ps(p.add(i), e);
        sum = _mm512_add_ps(sum, e);
        i += 16;
    }
    if tail_mask != 0 {
        let e = exp512(_mm512_sub_ps(
            _mm512_maskz_loadu_ps(tail_mask, p.add(full)),
            m,
        ));
        _mm512_mask_storeu_ps(p.add(full), tail_mask, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail_mask, e));
    }
    1.0 / _mm512_reduce_add_ps(sum)
}

/// out[i] = silu(gate[i]) · up[i] = gate[i] / (1 + e^-gate[i]) · up[i].
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = gate.len().min(up.len()).min(out.len());
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx512 {
        // SAFETY: AVX-512F detected; all three slices hold n elements.
        unsafe { silu_mul_avx512(gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), n) };
        done = n / 16 * 16;
    }
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx2Fma {
        // SAFETY: AVX2 and FMA detected; all three slices hold n elements.
        done = unsafe {
            super::vector_avx2::silu_mul(gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), n)
        };
    }
    #[cfg(target_arch = "aarch64")]
    if isa() == Isa::Neon {
        // SAFETY: NEON detected; all three slices hold n elements.
        done = unsafe {
            super::neon_vector::silu_mul(gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), n)
        };
    }
    for i in done..n {
        let g = gate[i];
        out[i] = g / (1.0 + (-g).exp()) * up[i];
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_mul_avx512(g: *const f32, u: *const f32, o: *mut f32, n: usize) {
    let one = _mm512_set1_ps(1.0);
    let mut i = 0;
    while i + 16 <= n {
        let gv = _mm512_loadu_ps(g.add(i));
        // g > 87: e^-g is 0 and silu(g) = g; g < -88.7: e^-g is inf and silu(g) = -0.
        let e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        let s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
        _mm512_storeu_ps(o.add(i), _mm512_mul_ps(s, _mm512_loadu_ps(u.add(i))));
        i += 16;
    }
}

/// Numerically stable softmax in place.
pub fn softmax_in_place(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx512 && !x.is_empty() {
        // SAFETY: AVX-512F detected.
        unsafe {
            let inv = softmax_unnormalized(x);
            for v in x.iter_mut() {
                *v *= inv;
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx2Fma && !x.is_empty() {
        // SAFETY: AVX2 and FMA detected.
        let inv = unsafe { super::vector_avx2::softmax_unnormalized(x) };
        for v in x.iter_mut() {
            *v *= inv;
        }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if isa() == Isa::Neon && !x.is_empty() {
        // SAFETY: NEON detected; `x` is not empty.
        let inv = unsafe { super::neon_vector::softmax_unnormalized(x) };
        for v in x.iter_mut() {
            *v *= inv;
        }
        return;
    }
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_and_axpy_match_scalar() {
        for n in [0usize, 1, 15, 16, 33, 64, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!((dot(&a, &b) - want).abs() < 1e-4);
            let mut y = b.clone();
            axpy(0.5, &a, &mut y);
            for i in 0..n {
                assert!((y[i] - (b[i] + 0.5 * a[i])).abs() < 1e-6);
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod exp_tests {
    use super::*;

    #[test]
    fn exp_matches_libm() {
        if !is_x86_feature_detected!("avx512f") {
            return;
        }
        let xs: Vec<f32> = (0..1440).map(|i| -(i as f32) * 0.06).collect();
        for chunk in xs.chunks(16) {
            let mut out = [0f32; 16];
            // SAFETY: AVX-512F checked above; chunk has 16 values.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr(), exp512(_mm512_loadu_ps(chunk.as_ptr()))) };
            for (x, e) in chunk.iter().zip(out) {
                let want = x.exp();
                assert!(
                    (e - want).abs() <= 4e-7 * want + 1e-38,
                    "exp({x}) = {e}, want {want}"
                );
            }
        }
    }
}

#[cfg(test)]
mod activation_tests {
    use super::*;

    #[test]
    fn silu_mul_and_softmax_match_scalar() {
        let n = 53;
        let g: Vec<f32> = (0..n).map(|i| (i as f32 - 26.0) * 0.7).collect();
        let u: Vec<f32> = (0..n).map(|i| (i as f32 * 0.3).cos()).collect();
        let mut out = vec![0f32; n];
        silu_mul(&g, &u, &mut out);
        for i in 0..n {
            let want = g[i] / (1.0 + (-g[i]).exp()) * u[i];
            assert!(
                (out[i] - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{i}: {} vs {want}",
                out[i]
            );
        }
        let mut x = g.clone();
        softmax_in_place(&mut x);
        let mx = g.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = g.iter().map(|v| (v - mx).exp()).sum();
        for i in 0..n {
            let want = (g[i] - mx).exp() / sum;
            assert!((x[i] - want).abs() <= 1e-6, "{i}: {} vs {want}", x[i]);
        }
    }
}
