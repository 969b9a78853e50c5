//! Small vector kernels: dot product and axpy with SIMD dispatch.

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
