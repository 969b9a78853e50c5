//! Small dense linear algebra for the calibrated quantizers: Gram matrices
//! of activations (from the reproducible kernels), Cholesky factors and the
//! upper Cholesky factor of an inverse (GPTQ's `Hinv`). Row-major; the
//! factorizations run in f64 in a fixed order, so they give the same bits on
//! every CPU.

pub use crate::backend::cpu::exact::gram;
use crate::backend::cpu::exact::{dot64, multiversion};
use crate::{bail_arg, Result};

/// `y[i] += alpha · x[i]` in f64.
#[inline(always)]
fn axpy64(alpha: f64, x: &[f64], y: &mut [f64]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

multiversion!(
    /// Lower `L` with `L Lᵀ = a` (`a` symmetric positive definite, `[n, n]`), in f64.
    pub fn cholesky(a: &[f64], n: usize) -> Result<Vec<f64>> = cholesky_body
);

#[inline(always)]
fn cholesky_body(a: &[f64], n: usize) -> Result<Vec<f64>> {
    let mut l = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..=i {
            let s = a[i * n + j] - dot64(&l[i * n..i * n + j], &l[j * n..j * n + j]);
            if i == j {
                if s.is_nan() || s <= 0.0 {
                    bail_arg!("matrix is not positive definite (pivot {i} is {s})");
                }
                l[i * n + i] = s.sqrt();
            } else {
                l[i * n + j] = s / l[j * n + j];
            }
        }
    }
    Ok(l)
}

multiversion!(
    /// The inverse of lower-triangular `l` (`[n, n]`), lower triangular, in f64.
    pub fn invert_lower(l: &[f64], n: usize) -> Vec<f64> = invert_lower_body
);

#[inline(always)]
fn invert_lower_body(l: &[f64], n: usize) -> Vec<f64> {
    let mut x = vec![0f64; n * n];
    let mut acc = vec![0f64; n];
    for i in 0..n {
        acc[..i].fill(0.0);
        for k in 0..i {
            let lik = l[i * n + k];
            if lik != 0.0 {
                axpy64(lik, &x[k * n..k * n + k + 1], &mut acc[..k + 1]);
            }
        }
        let inv = 1.0 / l[i * n + i];
        for j in 0..i {
            x[i * n + j] = -acc[j] * inv;
        }
        x[i * n + i] = inv;
    }
    x
}

/// Upper `U` with `Uᵀ U = h⁻¹` (what GPTQ gets from
/// `cholesky(cholesky_inverse(cholesky(H)), upper=True)`), by one Cholesky
/// and one triangular inverse: with `J` the reversal, `J h J = L Lᵀ` gives
/// `h = (J L J)(J L J)ᵀ`, so `U = (J L J)⁻¹ = J L⁻¹ J`.
///
/// In f64: a Hessian of calibration activations damped by 1 % of its mean
/// diagonal has a condition number up to ~100 × its order, so an f32
/// factorization carries errors of ~1 % in `U`, and those errors (different
/// for every summation order) decide which way GPTQ rounds each weight.
pub fn inverse_upper_cholesky(h: &[f64], n: usize) -> Result<Vec<f32>> {
    let mut rev = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..n {
            rev[i * n + j] = h[(n - 1 - i) * n + (n - 1 - j)];
        }
    }
    let linv = invert_lower(&cholesky(&rev, n)?, n);
    let mut u = vec![0f32; n * n];
    for i in 0..n {
        for j in i..n {
            u[i * n + j] = linv[(n - 1 - i) * n + (n - 1 - j)] as f32;
        }
    }
    Ok(u)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::ThreadPool;

    fn random_spd(n: usize, seed: u64) -> Vec<f64> {
        let mut state = seed;
        let mut rnd = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        let m = 3 * n;
        let x: Vec<f32> = (0..m * n).map(|_| rnd()).collect();
        let pool = ThreadPool::new(1);
        let mut g = gram(&pool, &x, m, n);
        for i in 0..n {
            g[i * n + i] += 0.1;
        }
        g.into_iter().map(f64::from).collect()
    }

    #[test]
    fn gram_is_x_transpose_x() {
        let (n, cols) = (7, 5);
        let x: Vec<f32> = (0..n * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let g = gram(&ThreadPool::new(2), &x, n, cols);
        for a in 0..cols {
            for b in 0..cols {
                let want: f32 = (0..n).map(|r| x[r * cols + a] * x[r * cols + b]).sum();
                assert!((g[a * cols + b] - want).abs() < 1e-4, "({a},{b})");
            }
        }
    }

    #[test]
    fn inverse_upper_cholesky_factors_the_inverse() {
        let n = 37;
        let h = random_spd(n, 5);
        let u = inverse_upper_cholesky(&h, n).unwrap();
        // Upper triangular with a positive diagonal, and (Uᵀ U) h = I.
        for i in 0..n {
            assert!(u[i * n + i] > 0.0);
            for j in 0..i {
                assert_eq!(u[i * n + j], 0.0);
            }
        }
        for i in 0..n {
            for j in 0..n {
                let mut v = 0f64;
                for k in 0..n {
                    let hinv_ik: f64 = (0..n)
                        .map(|m| u[m * n + i] as f64 * u[m * n + k] as f64)
                        .sum();
                    v += hinv_ik * h[k * n + j];
                }
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((v - want).abs() < 1e-3, "({i},{j}): {v}");
            }
        }
        let mut bad = h.clone();
        bad[0] = -1.0;
        assert!(cholesky(&bad, n).is_err());
    }
}
