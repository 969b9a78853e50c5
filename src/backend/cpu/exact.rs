//! Reproducible kernels: the same bits on every x86-64 CPU and under every
//! `NANOINFER_ISA`, for work whose result is an artifact rather than a step
//! of serving. Calibrated quantization (GPTQ, AWQ) writes a checkpoint from
//! a chain of rounding decisions that amplifies any difference in its
//! inputs: with the serving kernels, whose summation order follows the
//! vector width, the same model and text gave checkpoints 12 % apart in
//! perplexity on AVX2 and AVX-512 machines.
//!
//! How: f32 data, products and sums in f64. The product of two f32 values is
//! exact in f64, so a fused multiply-add and a multiply then add give the same
//! bits; every sum runs over [`LANES`] partial sums in a fixed order (element
//! `k` goes to lane `k % LANES`) closed by a fixed tree. The bodies are plain
//! Rust (no contraction, no reassociation) compiled once per vector width:
//! run-time dispatch picks how wide the same arithmetic runs, never a
//! different arithmetic. `exp`, `sin` and `cos` are polynomials here, since
//! the C library picks its own variants by CPU.

use super::ThreadPool;
use std::sync::Mutex;

/// ln 2 in two parts: the high part has 32 significant bits, so `k·LN2_HI`
/// is exact for every exponent `k` (fdlibm's split).
const LN2_HI: f64 = 0.693_147_180_369_123_8;
const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
/// Partial sums per reduction.
const LANES: usize = 8;
/// Rows of `x` and of `w` per matmul tile (2 × 4 accumulators of `LANES`).
const TILE_X: usize = 2;
const TILE_W: usize = 4;
/// Rows of `x` per pool task.
const ROWS_PER_TASK: usize = 16;

/// The fixed reduction tree of the lanes.
#[inline(always)]
fn close(acc: &[f64; LANES]) -> f64 {
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// `Σ a[k]·b[k]` of f64 slices over [`LANES`] lanes.
#[inline(always)]
pub fn dot64(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len().min(b.len());
    let full = n / LANES * LANES;
    let mut acc = [0f64; LANES];
    for k in (0..full).step_by(LANES) {
        for l in 0..LANES {
            acc[l] += a[k + l] * b[k + l];
        }
    }
    for (l, k) in (full..n).enumerate() {
        acc[l] += a[k] * b[k];
    }
    close(&acc)
}

/// `out[i][j] = Σ_k x[i][k]·w[j][k]` for the rows of `x` given, tile by tile.
#[inline(always)]
fn matmul_rows_body(x: &[f64], w: &[f64], k: usize, n: usize, out: &mut [f32]) {
    let m = x.len() / k;
    let full = k / LANES * LANES;
    let mut i = 0;
    while i < m {
        let ti = TILE_X.min(m - i);
        let mut j = 0;
        while j < n {
            let tj = TILE_W.min(n - j);
            if ti == TILE_X && tj == TILE_W {
                let mut acc = [[[0f64; LANES]; TILE_W]; TILE_X];
                for kk in (0..full).step_by(LANES) {
                    for (a, accr) in acc.iter_mut().enumerate() {
                        let xr = &x[(i + a) * k + kk..(i + a) * k + kk + LANES];
                        for (b, acc) in accr.iter_mut().enumerate() {
                            let wr = &w[(j + b) * k + kk..(j + b) * k + kk + LANES];
                            for l in 0..LANES {
                                acc[l] += xr[l] * wr[l];
                            }
                        }
                    }
                }
                for (a, accr) in acc.iter_mut().enumerate() {
                    for (b, acc) in accr.iter_mut().enumerate() {
                        for (l, kk) in (full..k).enumerate() {
                            acc[l] += x[(i + a) * k + kk] * w[(j + b) * k + kk];
                        }
                        out[(i + a) * n + j + b] = close(acc) as f32;
                    }
                }
            } else {
                for a in 0..ti {
                    for b in 0..tj {
                        let xr = &x[(i + a) * k..(i + a + 1) * k];
                        let wr = &w[(j + b) * k..(j + b + 1) * k];
                        out[(i + a) * n + j + b] = dot64(xr, wr) as f32;
                    }
                }
            }
            j += tj;
        }
        i += ti;
    }
}

/// Defines `fn NAME(args) -> R` that runs `BODY(args)` (an
/// `#[inline(always)]` function) compiled for the widest vectors this CPU
/// has (under `NANOINFER_ISA`). `BODY` must be plain arithmetic that any
/// width computes alike (the bodies of the reproducible kernels): the width
/// changes speed, not bits.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty = $body:path) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                use $crate::backend::cpu::isa::{isa, Isa};
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) -> $ret {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($arg: $ty),*) -> $ret {
                    $body($($arg),*)
                }
                match isa() {
                    // SAFETY: the ISA was detected at run time.
                    Isa::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: as above (AVX2 is detected with FMA and F16C).
                    Isa::Avx2Fma => return unsafe { avx2($($arg),*) },
                    Isa::Scalar | Isa::Neon => {}
                }
            }
            $body($($arg),*)
        }
    };
}
pub(crate) use multiversion;

multiversion!(fn matmul_rows(x: &[f64], w: &[f64], k: usize, n: usize, out: &mut [f32]) -> () = matmul_rows_body);

/// Calls `f(i, chunk)` for the `chunk_len`-long chunks of `out` on the
/// pool's threads; the first error wins.
pub fn par_chunks(
    pool: &ThreadPool,
    out: &mut [f32],
    chunk_len: usize,
    f: &(dyn Fn(usize, &mut [f32]) -> crate::Result<()> + Sync),
) -> crate::Result<()> {
    let chunks: Vec<std::sync::Mutex<&mut [f32]>> = out
        .chunks_mut(chunk_len.max(1))
        .map(std::sync::Mutex::new)
        .collect();
    let failure = std::sync::Mutex::new(None);
    pool.run(chunks.len(), &|i| {
        let mut chunk = chunks[i].lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = f(i, &mut chunk) {
            *failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
        }
    });
    match failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// `v` widened to f64.
pub fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&a| f64::from(a)).collect()
}

/// `out = x · wᵀ` (`x`: `[m, k]`, `w`: `[n, k]`, `out`: `[m, n]`), the same
/// bits on every CPU and for any number of threads.
pub fn matmul(pool: &ThreadPool, x: &[f32], k: usize, w: &[f32], out: &mut [f32]) {
    let m = x.len().checked_div(k).unwrap_or(0);
    let n = w.len().checked_div(k).unwrap_or(0);
    assert!(
        x.len() == m * k && w.len() == n * k && out.len() == m * n,
        "exact matmul: [{m}, {k}] · [{n}, {k}]ᵀ does not fit the buffers"
    );
    if m == 0 || n == 0 {
        out.fill(0.0);
        return;
    }
    let (x64, w64) = (widen(x), widen(w));
    let chunks: Vec<Mutex<&mut [f32]>> =
        out.chunks_mut(ROWS_PER_TASK * n).map(Mutex::new).collect();
    pool.run(chunks.len(), &|t| {
        let mut rows = chunks[t].lock().unwrap_or_else(|e| e.into_inner());
        let r0 = t * ROWS_PER_TASK;
        let r1 = r0 + rows.len() / n;
        matmul_rows(&x64[r0 * k..r1 * k], &w64, k, n, &mut rows);
    });
}

/// `xᵀ x` of `x` (`[n, cols]`), `[cols, cols]`.
pub fn gram(pool: &ThreadPool, x: &[f32], n: usize, cols: usize) -> Vec<f32> {
    let mut xt = vec![0f32; n * cols];
    for r in 0..n {
        for c in 0..cols {
            xt[c * n + r] = x[r * cols + c];
        }
    }
    let mut out = vec![0f32; cols * cols];
    matmul(pool, &xt, n, &xt, &mut out);
    out
}

/// `Σ a[k]·b[k]` of f32 slices, in f64.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f64 {
    let n = a.len().min(b.len());
    let full = n / LANES * LANES;
    let mut acc = [0f64; LANES];
    for k in (0..full).step_by(LANES) {
        for l in 0..LANES {
            acc[l] += f64::from(a[k + l]) * f64::from(b[k + l]);
        }
    }
    for (l, k) in (full..n).enumerate() {
        acc[l] += f64::from(a[k]) * f64::from(b[k]);
    }
    close(&acc)
}

/// `y[i] += alpha · x[i]` in f32 (each element on its own: any vector width
/// gives the same bits, and Rust never fuses the multiply and the add).
#[inline(always)]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

/// RMSNorm of each `weight.len()`-wide row: `out = w · x / rms(x)`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let inv = 1.0 / (dot(xr, xr) / d as f64 + f64::from(eps)).sqrt();
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = (f64::from(w) * (f64::from(v) * inv)) as f32;
        }
    }
}

/// [`rms_norm`] in place.
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    for xr in x.chunks_exact_mut(d) {
        let inv = 1.0 / (dot(xr, xr) / d as f64 + f64::from(eps)).sqrt();
        for (v, &w) in xr.iter_mut().zip(weight) {
            *v = (f64::from(w) * (f64::from(*v) * inv)) as f32;
        }
    }
}

/// `out[i] = silu(gate[i]) · up[i]`.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let g = f64::from(g);
        *o = (g / (1.0 + exp(-g)) * f64::from(u)) as f32;
    }
}

/// `e^x` to within a few ulps of f64, by the same arithmetic on every CPU.
pub fn exp(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    if x > 709.78 {
        return f64::INFINITY;
    }
    if x < -745.0 {
        return 0.0;
    }
    // x = k·ln 2 + r, |r| ≤ ln 2 / 2.
    let k = (x * std::f64::consts::LOG2_E).round();
    let r = (x - k * LN2_HI) - k * LN2_LO;
    // Taylor to r¹³/13!: the remainder is below 2⁻⁵⁵ for |r| ≤ 0.35.
    let mut p = 1.0 / 6_227_020_800.0;
    for d in [
        479_001_600.0,
        39_916_800.0,
        3_628_800.0,
        362_880.0,
        40_320.0,
        5_040.0,
        720.0,
        120.0,
        24.0,
        6.0,
        2.0,
        1.0,
        1.0,
    ] {
        p = p * r + 1.0 / d;
    }
    // 2^k as two factors, each a normal power of two, so that subnormal
    // results (k down to -1075) are reached without an out-of-range exponent.
    let k = k as i64;
    let (k1, k2) = (k / 2, k - k / 2);
    p * pow2(k1) * pow2(k2)
}

/// `ln x` to within a few ulps of f64 (NaN for negative `x`), by the same
/// arithmetic on every CPU.
pub fn ln(x: f64) -> f64 {
    if x.is_nan() || x < 0.0 {
        return f64::NAN;
    }
    if x == 0.0 {
        return f64::NEG_INFINITY;
    }
    if x.is_infinite() {
        return x;
    }
    // Subnormals: scale into the normal range first.
    let (x, bias) = if x < f64::MIN_POSITIVE {
        (x * pow2(54), -54)
    } else {
        (x, 0)
    };
    let bits = x.to_bits();
    let mut e = ((bits >> 52) & 0x7ff) as i64 - 1023 + bias;
    let mut m = f64::from_bits((bits & ((1u64 << 52) - 1)) | (1023u64 << 52));
    if m > std::f64::consts::SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    // ln m = 2·atanh(s), s = (m − 1)/(m + 1), |s| ≤ 0.172: terms to s²³.
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let mut p = 0.0;
    for d in (1..=23).rev().step_by(2) {
        p = p * s2 + 1.0 / d as f64;
    }
    let e = e as f64;
    (e * LN2_HI + 2.0 * s * p) + e * LN2_LO
}

/// `x^y` of f32 values through [`exp`] and [`ln`] (`x` ≥ 0).
pub fn powf(x: f32, y: f32) -> f32 {
    if y == 0.0 {
        return 1.0;
    }
    exp(f64::from(y) * ln(f64::from(x))) as f32
}

fn pow2(k: i64) -> f64 {
    f64::from_bits(((k + 1023) as u64) << 52)
}

/// `(sin a, cos a)` to within a few ulps of f64 for |a| up to ~10⁶, by the
/// same arithmetic on every CPU.
pub fn sin_cos(a: f64) -> (f64, f64) {
    // a = q·π/2 + r with |r| ≤ π/4; π/2 split so that q·HALF_PI_HI is exact
    // for the angles RoPE produces.
    const HALF_PI_HI: f64 = 1.570_796_326_734_125_6;
    const HALF_PI_LO: f64 = 6.077_100_506_506_192e-11;
    let q = (a * std::f64::consts::FRAC_2_PI).round();
    let r = (a - q * HALF_PI_HI) - q * HALF_PI_LO;
    let r2 = r * r;
    // Taylor series to r¹⁷ and r¹⁸: remainders below 2⁻⁵⁵ for |r| ≤ π/4.
    let mut s = 0.0;
    let mut c = 0.0;
    let mut fact = 1.0f64;
    let mut terms_s = [0f64; 9];
    let mut terms_c = [0f64; 10];
    for (i, t) in terms_c.iter_mut().enumerate() {
        // 1/(2i)!
        if i > 0 {
            fact *= (2 * i - 1) as f64 * (2 * i) as f64;
        }
        *t = if i % 2 == 0 { 1.0 } else { -1.0 } / fact;
    }
    fact = 1.0;
    for (i, t) in terms_s.iter_mut().enumerate() {
        // 1/(2i+1)!
        if i > 0 {
            fact *= (2 * i) as f64 * (2 * i + 1) as f64;
        }
        *t = if i % 2 == 0 { 1.0 } else { -1.0 } / fact;
    }
    for &t in terms_s.iter().rev() {
        s = s * r2 + t;
    }
    for &t in terms_c.iter().rev() {
        c = c * r2 + t;
    }
    let (sr, cr) = (s * r, c);
    match (q as i64).rem_euclid(4) {
        0 => (sr, cr),
        1 => (cr, -sr),
        2 => (-sr, -cr),
        _ => (-cr, sr),
    }
}

/// One causal sequence for [`attention`]: rows `start..start + len` of the
/// query, key and value arrays.
#[derive(Clone, Copy, Debug)]
pub struct Span {
    pub start: usize,
    pub len: usize,
}

/// Head layout for [`attention`].
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// Causal attention of each span on its own: `q` rows of stride `q_stride`
/// (the first `n_heads · head_dim` values are the query), `keys`/`values`
/// rows of `n_kv_heads · head_dim`, `out` rows of `n_heads · head_dim`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    pool: &ThreadPool,
    heads: &Heads,
    spans: &[Span],
    q: &[f32],
    q_stride: usize,
    keys: &[f32],
    values: &[f32],
    out: &mut [f32],
) {
    let (h, hd) = (heads.n_heads, heads.head_dim);
    let group = h / heads.n_kv_heads.max(1);
    let (q_width, kv_width) = (h * hd, heads.n_kv_heads * hd);
    let scale = f64::from(heads.scale);
    // One task per (span, head): each writes its own head's columns of its rows.
    let tasks: Vec<(usize, usize)> = (0..spans.len())
        .flat_map(|s| (0..h).map(move |hh| (s, hh)))
        .collect();
    let results: Vec<Mutex<Vec<f32>>> = tasks.iter().map(|_| Mutex::new(Vec::new())).collect();
    pool.run(tasks.len(), &|t| {
        let (s, hh) = tasks[t];
        let Span { start, len } = spans[s];
        let kvh = hh / group.max(1);
        let part = attend_head(
            &q[start * q_stride..],
            q_stride,
            &keys[start * kv_width..],
            &values[start * kv_width..],
            kv_width,
            len,
            hh * hd,
            kvh * hd,
            hd,
            scale,
        );
        *results[t].lock().unwrap_or_else(|e| e.into_inner()) = part;
    });

    for (&(s, hh), part) in tasks.iter().zip(results) {
        let part = part.into_inner().unwrap_or_else(|e| e.into_inner());
        let Span { start, len } = spans[s];
        for i in 0..len {
            out[(start + i) * q_width + hh * hd..][..hd].copy_from_slice(&part[i * hd..][..hd]);
        }
    }
}

multiversion!(
    #[allow(clippy::too_many_arguments)]
    fn attend_head(q: &[f32], q_stride: usize, keys: &[f32], values: &[f32], kv_width: usize, len: usize, q_off: usize, kv_off: usize, hd: usize, scale: f64) -> Vec<f32> = attend_head_body
);

/// Causal attention of one head over one span (rows from 0), `[len, hd]`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn attend_head_body(
    q: &[f32],
    q_stride: usize,
    keys: &[f32],
    values: &[f32],
    kv_width: usize,
    len: usize,
    q_off: usize,
    kv_off: usize,
    hd: usize,
    scale: f64,
) -> Vec<f32> {
    let mut part = vec![0f32; len * hd];
    let mut p = vec![0f64; len];
    let mut acc = vec![0f64; hd];
    for i in 0..len {
        let qr = &q[i * q_stride + q_off..][..hd];
        let mut m = f64::NEG_INFINITY;
        for (j, pj) in p[..=i].iter_mut().enumerate() {
            let kr = &keys[j * kv_width + kv_off..][..hd];
            *pj = dot(qr, kr) * scale;
            m = m.max(*pj);
        }
        let mut sum = 0.0;
        for pj in &mut p[..=i] {
            *pj = exp(*pj - m);
            sum += *pj;
        }
        acc.fill(0.0);
        for (j, &pj) in p[..=i].iter().enumerate() {
            let vr = &values[j * kv_width + kv_off..][..hd];
            for (a, &v) in acc.iter_mut().zip(vr) {
                *a += pj * f64::from(v);
            }
        }
        for (o, &a) in part[i * hd..(i + 1) * hd].iter_mut().zip(&acc) {
            *o = (a / sum) as f32;
        }
    }
    part
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_sin_cos_match_the_c_library() {
        for i in -2000..=1900 {
            let x = i as f64 * 0.37;
            let (e, want) = (exp(x), x.exp());
            assert!(
                (e - want).abs() <= 4.0 * f64::EPSILON * want,
                "exp({x}) {e} vs {want}"
            );
            let a = i as f64 * 0.731;
            let (s, c) = sin_cos(a);
            assert!((s - a.sin()).abs() < 1e-14, "sin({a}) {s}");
            assert!((c - a.cos()).abs() < 1e-14, "cos({a}) {c}");
        }
        for i in 1..4000 {
            let x = (i as f64 * 0.173).powi(3) * 1e-6;
            assert!(
                (ln(x) - x.ln()).abs() <= 4.0 * f64::EPSILON * x.ln().abs().max(1.0),
                "ln({x})"
            );
        }
        assert_eq!(ln(1.0), 0.0);
        assert!((ln(1e-310) - 1e-310f64.ln()).abs() < 1e-12);
        assert_eq!(powf(2.0, 0.5), 2f32.sqrt());
        assert_eq!(powf(0.0, 0.5), 0.0);
        assert_eq!(exp(-800.0), 0.0);
        assert_eq!(exp(800.0), f64::INFINITY);
        assert!(exp(-744.0) > 0.0 && exp(-744.0) < 1e-320);
    }

    #[test]
    fn matmul_is_the_product_for_any_threads_and_shape() {
        let (m, k, n) = (37, 29, 11);
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 104729) % 997) as f32 / 498.0 - 1.0)
            .collect();
        let mut one = vec![0f32; m * n];
        matmul(&ThreadPool::new(1), &x, k, &w, &mut one);
        let mut two = vec![0f32; m * n];
        matmul(&ThreadPool::new(2), &x, k, &w, &mut two);
        assert_eq!(one, two);
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|c| f64::from(x[i * k + c]) * f64::from(w[j * k + c]))
                    .sum();
                let got = one[i * n + j];
                assert!(
                    (got - want as f32).abs() <= f32::EPSILON * got.abs(),
                    "({i}, {j}): {got} vs {want}"
                );
            }
        }
    }
}
