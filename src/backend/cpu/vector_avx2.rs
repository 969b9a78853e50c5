//! AVX2 + FMA versions of the small vector kernels of `vector.rs` (dot
//! product, axpy, exp, softmax, SiLU·mul): on CPUs without AVX-512 these
//! carry attention, the norms and the MLP activation, which as plain
//! loops cost more than the matrix products of a small model's prefill
//! (a serial f32 sum does not vectorize, and libm's exp is a call per
//! value). The polynomial and range reduction are `exp512`'s, so both
//! paths round alike.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Sum of the 8 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn reduce_add(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// Largest of the 8 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn reduce_max(v: __m256) -> f32 {
    let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)))
}

/// Σ a[i]·b[i] for i < n.
///
/// # Safety
/// AVX2 and FMA must be available; `a` and `b` hold `n` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot(a: *const f32, b: *const f32, n: usize) -> f32 {
    // Four chains cover the FMA latency (4 cycles, 2 ports would want 8;
    // the loads bound a dot product first).
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (j, acc) in acc.iter_mut().enumerate() {
            let o = i + 8 * j;
            *acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(o)), _mm256_loadu_ps(b.add(o)), *acc);
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), acc[0]);
        i += 8;
    }
    let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut s = reduce_add(sum);
    while i < n {
        s += *a.add(i) * *b.add(i);
        i += 1;
    }
    s
}

/// y[i] += alpha · x[i] for i < n.
///
/// # Safety
/// AVX2 and FMA must be available; `x` and `y` hold `n` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn axpy(alpha: f32, x: *const f32, y: *mut f32, n: usize) {
    let av = _mm256_set1_ps(alpha);
    let mut i = 0;
    while i + 8 <= n {
        let yv = _mm256_fmadd_ps(av, _mm256_loadu_ps(x.add(i)), _mm256_loadu_ps(y.add(i)));
        _mm256_storeu_ps(y.add(i), yv);
        i += 8;
    }
    while i < n {
        *y.add(i) += alpha * *x.add(i);
        i += 1;
    }
}

/// e^x for each lane: a few ulp from libm in [-87, 88], exactly 0 below
/// -87, e^88 (finite) above 88.
///
/// # Safety
/// AVX2 and FMA must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn exp256(x: __m256) -> __m256 {
    let keep = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(-87.0));
    // Clamped so that 2^n below stays a normal number (n in -126..=127).
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.0)),
        _mm256_set1_ps(88.0),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    // r = x - n·ln2 in two steps (Cody–Waite), as `exp512`.
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_145_75), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428_606_8e-6), r);
    let mut p = _mm256_set1_ps(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    // 2^n from its exponent bits.
    let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)))
}

/// The last `n % 8` values of `p[..n]` as a vector, `fill` past them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn load_tail(p: *const f32, n: usize, fill: f32) -> ([f32; 8], usize) {
    let full = n / 8 * 8;
    let mut t = [fill; 8];
    std::ptr::copy_nonoverlapping(p.add(full), t.as_mut_ptr(), n - full);
    (t, full)
}

/// `x[i] = exp(x[i] - max)`; returns `1 / Σ x[i]`.
///
/// # Safety
/// AVX2 and FMA must be available; `x` must not be empty.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn softmax_unnormalized(x: &mut [f32]) -> f32 {
    let n = x.len();
    let p = x.as_mut_ptr();
    let (tail, full) = load_tail(p, n, f32::NEG_INFINITY);
    let mut mx = _mm256_loadu_ps(tail.as_ptr());
    let mut i = 0;
    while i < full {
        mx = _mm256_max_ps(mx, _mm256_loadu_ps(p.add(i)));
        i += 8;
    }
    let m = _mm256_set1_ps(reduce_max(mx));
    let mut sum = _mm256_setzero_ps();
    i = 0;
    while i < full {
        let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), m));
        _mm256_storeu_ps(p.add(i), e);
        sum = _mm256_add_ps(sum, e);
        i += 8;
    }
    if full < n {
        // The -inf padding becomes exactly 0.
        let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(tail.as_ptr()), m));
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), e);
        std::ptr::copy_nonoverlapping(out.as_ptr(), p.add(full), n - full);
        sum = _mm256_add_ps(sum, e);
    }
    1.0 / reduce_add(sum)
}

/// o[i] = silu(g[i]) · u[i] for i < n / 8 · 8; returns how many it wrote.
///
/// # Safety
/// AVX2 and FMA must be available; the three pointers hold `n` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn silu_mul(g: *const f32, u: *const f32, o: *mut f32, n: usize) -> usize {
    let one = _mm256_set1_ps(1.0);
    let mut i = 0;
    while i + 8 <= n {
        let gv = _mm256_loadu_ps(g.add(i));
        let e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        let s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        _mm256_storeu_ps(o.add(i), _mm256_mul_ps(s, _mm256_loadu_ps(u.add(i))));
        i += 8;
    }
    i
}

/// `q[j] = clamp(round(x[j] · inv), ±127)` for j < n / 8 · 8, rounding
/// halves away from zero exactly as `f32::round` (the scalar quantizer's
/// rounding, so both give the same bytes); returns how many it wrote.
///
/// # Safety
/// AVX2 and FMA must be available; `x` and `q` hold `n` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn quantize_i8(x: *const f32, inv: f32, q: *mut i8, n: usize) -> usize {
    let scale = _mm256_set1_ps(inv);
    let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    let sign = _mm256_set1_ps(-0.0);
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    let mut i = 0;
    while i + 8 <= n {
        let v = _mm256_mul_ps(_mm256_loadu_ps(x.add(i)), scale);
        // x - trunc(x) is exact, so comparing it with 0.5 decides ties as
        // round() does, without the 0.49999997 error of adding 0.5.
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
        let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(v, t));
        let up = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half), one);
        let r = _mm256_add_ps(t, _mm256_or_ps(up, _mm256_and_ps(v, sign)));
        // NaN becomes 0, as `f32 as i8` makes it.
        let r = _mm256_and_ps(
            _mm256_min_ps(_mm256_max_ps(r, lo), hi),
            _mm256_cmp_ps::<_CMP_ORD_Q>(v, v),
        );
        let w = _mm256_cvtps_epi32(r);
        // 8 × i32 → 8 × i8: pack to i16 then i8 within lanes, then gather
        // the two lanes' 4 bytes.
        let p16 = _mm256_packs_epi32(w, w);
        let p8 = _mm256_packs_epi16(p16, p16);
        let bytes = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
        _mm_storel_epi64(q.add(i) as *mut __m128i, _mm256_castsi256_si128(bytes));
        i += 8;
    }
    i
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    fn have() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }

    #[test]
    fn dot_and_axpy_match_the_plain_loops() {
        if !have() {
            return;
        }
        for n in [0usize, 1, 7, 8, 9, 31, 32, 33, 64, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(x * y)).sum();
            // SAFETY: AVX2/FMA checked; both hold n values.
            let got = unsafe { dot(a.as_ptr(), b.as_ptr(), n) };
            assert!(
                (f64::from(got) - want).abs() < 1e-5,
                "n {n}: {got} vs {want}"
            );
            let mut y = b.clone();
            // SAFETY: as above.
            unsafe { axpy(0.5, a.as_ptr(), y.as_mut_ptr(), n) };
            for i in 0..n {
                assert_eq!(y[i], 0.5f32.mul_add(a[i], b[i]), "n {n}, {i}");
            }
        }
    }

    #[test]
    fn quantize_i8_rounds_as_the_scalar_quantizer() {
        if !have() {
            return;
        }
        let mut x: Vec<f32> = (0..4096).map(|i| (i as f32 - 2048.0) * 0.0625).collect();
        // Ties, the float just below a tie, out-of-range and signed zeros.
        x.extend([
            0.5,
            -0.5,
            1.5,
            -2.5,
            0.499_999_97,
            -0.499_999_97,
            300.0,
            -300.0,
            0.0,
            -0.0,
        ]);
        x.extend([
            126.5,
            -126.5,
            127.49,
            8_388_609.0,
            f32::MIN_POSITIVE,
            1.0e-30,
        ]);
        while !x.len().is_multiple_of(8) {
            x.push(3.5);
        }
        for inv in [1.0f32, 0.37, 3.0] {
            let mut got = vec![0i8; x.len()];
            // SAFETY: AVX2/FMA checked; both hold x.len() values.
            let done = unsafe { quantize_i8(x.as_ptr(), inv, got.as_mut_ptr(), x.len()) };
            assert_eq!(done, x.len());
            for (j, (&v, &g)) in x.iter().zip(&got).enumerate() {
                let want = (v * inv).round().clamp(-127.0, 127.0) as i8;
                assert_eq!(g, want, "{j}: {v} · {inv}");
            }
        }
    }

    #[test]
    fn exp_matches_libm() {
        if !have() {
            return;
        }
        let xs: Vec<f32> = (0..1480).map(|i| 88.0 - (i as f32) * 0.06).collect();
        for chunk in xs.chunks_exact(8) {
            let mut out = [0f32; 8];
            // SAFETY: AVX2/FMA checked; chunk has 8 values.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), exp256(_mm256_loadu_ps(chunk.as_ptr()))) };
            for (x, e) in chunk.iter().zip(out) {
                let want = if *x < -87.0 { 0.0 } else { x.exp() };
                assert!(
                    (e - want).abs() <= 4e-7 * want + 1e-38,
                    "exp({x}) = {e}, want {want}"
                );
            }
        }
    }

    #[test]
    fn softmax_and_silu_match_the_plain_loops() {
        if !have() {
            return;
        }
        for n in [1usize, 5, 8, 13, 53] {
            let g: Vec<f32> = (0..n).map(|i| (i as f32 - 26.0) * 0.7).collect();
            let mut x = g.clone();
            if n > 1 {
                x[n / 2] = f32::NEG_INFINITY;
            }
            let mut e = x.clone();
            // SAFETY: AVX2/FMA checked; not empty.
            let inv = unsafe { softmax_unnormalized(&mut e) };
            let mx = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = x.iter().map(|v| (v - mx).exp()).sum();
            assert!((inv - 1.0 / sum).abs() <= 1e-5 / sum, "n {n}");
            for i in 0..n {
                let want = (x[i] - mx).exp();
                assert!(
                    (e[i] - want).abs() <= 1e-6,
                    "n {n}, {i}: {} vs {want}",
                    e[i]
                );
            }
            let u: Vec<f32> = (0..n).map(|i| (i as f32 * 0.3).cos()).collect();
            let mut out = vec![0f32; n];
            // SAFETY: AVX2/FMA checked; all hold n values.
            let done = unsafe { silu_mul(g.as_ptr(), u.as_ptr(), out.as_mut_ptr(), n) };
            assert_eq!(done, n / 8 * 8);
            for i in 0..done {
                let want = g[i] / (1.0 + (-g[i]).exp()) * u[i];
                assert!((out[i] - want).abs() <= 1e-5 * want.abs().max(1.0), "{i}");
            }
        }
    }
}
