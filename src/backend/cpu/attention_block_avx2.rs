//! The AVX2 + FMA kernels of blocked prefill attention (`attention_block.rs`
//! holds the orchestration and the AVX-512 kernels).
//!
//! A 16-wide group of positions or dimensions is two 8-wide vectors here.
//! With 16 ymm registers a kernel call holds at most `Q · V` accumulators,
//! `Q` broadcasts and one loaded vector, so a chunk of `V` vectors is
//! split into parts of at most [`parts_of`] vectors for `Q` queries (3
//! queries: 12 accumulators, the 4 × 4 of AVX-512 would need 32).

use super::attention_block::Queries;
use std::arch::x86_64::*;

/// Most 8-wide vectors one call takes for `q` queries.
fn parts_of(q: usize) -> usize {
    match q {
        1 => 8,
        2 => 6,
        3 => 4,
        _ => 2,
    }
}

/// `$f::<Q, V>(args)` for `Q = q` (1 to 4) and `V = v` (1 to `parts_of(q)`).
macro_rules! dispatch_qv {
    ($f:ident, $q:expr, $v:expr, ($($a:expr),*)) => {
        match ($q, $v) {
            (1, 1) => $f::<1, 1>($($a),*),
            (1, 2) => $f::<1, 2>($($a),*),
            (1, 3) => $f::<1, 3>($($a),*),
            (1, 4) => $f::<1, 4>($($a),*),
            (1, 5) => $f::<1, 5>($($a),*),
            (1, 6) => $f::<1, 6>($($a),*),
            (1, 7) => $f::<1, 7>($($a),*),
            (1, _) => $f::<1, 8>($($a),*),
            (2, 1) => $f::<2, 1>($($a),*),
            (2, 2) => $f::<2, 2>($($a),*),
            (2, 3) => $f::<2, 3>($($a),*),
            (2, 4) => $f::<2, 4>($($a),*),
            (2, 5) => $f::<2, 5>($($a),*),
            (2, _) => $f::<2, 6>($($a),*),
            (3, 1) => $f::<3, 1>($($a),*),
            (3, 2) => $f::<3, 2>($($a),*),
            (3, 3) => $f::<3, 3>($($a),*),
            (3, _) => $f::<3, 4>($($a),*),
            (_, 1) => $f::<4, 1>($($a),*),
            _ => $f::<4, 2>($($a),*),
        }
    };
}

/// `out[d·stride + j] = rows[j][d0 + d]` for `d, j < 16` (0 where `rows[j]`
/// is `None`), as four 8 × 8 transposes in registers.
///
/// # Safety
/// AVX2 must be available; every row holds `d0 + 16` values; `out` points
/// at 16 rows of 16 writable floats, `stride` apart.
#[target_feature(enable = "avx2")]
pub unsafe fn transpose16(rows: &[Option<&[f32]>; 16], d0: usize, out: *mut f32, stride: usize) {
    for jb in [0, 8] {
        for db in [0, 8] {
            let r: [__m256; 8] = std::array::from_fn(|i| match rows[jb + i] {
                Some(row) => _mm256_loadu_ps(row[d0 + db..d0 + db + 8].as_ptr()),
                None => _mm256_setzero_ps(),
            });
            // t[2g], t[2g+1]: rows 2g, 2g+1 interleaved (dims 0,1,4,5 / 2,3,6,7).
            let t: [__m256; 8] = std::array::from_fn(|i| {
                let (a, b) = (r[i & !1], r[i | 1]);
                if i % 2 == 0 {
                    _mm256_unpacklo_ps(a, b)
                } else {
                    _mm256_unpackhi_ps(a, b)
                }
            });
            // s[4g + c]: dims c and c + 4 of rows 4g..4g + 4.
            let s: [__m256; 8] = std::array::from_fn(|n| {
                let (g, c) = (n / 4, n % 4);
                let (a, b) = (t[4 * g + c / 2], t[4 * g + 2 + c / 2]);
                if c % 2 == 0 {
                    _mm256_shuffle_ps::<0x44>(a, b)
                } else {
                    _mm256_shuffle_ps::<0xEE>(a, b)
                }
            });
            for d in 0..8 {
                let (a, b) = (s[d % 4], s[4 + d % 4]);
                let col = if d < 4 {
                    _mm256_permute2f128_ps::<0x20>(a, b)
                } else {
                    _mm256_permute2f128_ps::<0x31>(a, b)
                };
                _mm256_storeu_ps(out.add((db + d) * stride + jb), col);
            }
        }
    }
}

/// `out[j·padded + p'] = scale · q_j · k_{p'}` for the `q` queries `j` and
/// positions `p' in p..p + 8·v`.
///
/// # Safety
/// AVX2 and FMA must be available; `1 <= q <= 4`; `p + 8·v <= qs.padded`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn score(
    q: usize,
    v: usize,
    qs: Queries,
    keys_t: &[f32],
    p: usize,
    scale: f32,
    out: &mut [f32],
) {
    let mut done = 0;
    while done < v {
        let part = (v - done).min(parts_of(q));
        let at = p + 8 * done;
        dispatch_qv!(score_part, q, part, (qs, keys_t, at, scale, &mut *out));
        done += part;
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn score_part<const Q: usize, const V: usize>(
    qs: Queries,
    keys_t: &[f32],
    p: usize,
    scale: f32,
    out: &mut [f32],
) {
    assert!(p + 8 * V <= qs.padded && keys_t.len() >= qs.hd * qs.padded);
    assert!(out.len() >= (Q - 1) * qs.padded + p + 8 * V);
    let kt = keys_t.as_ptr();
    let mut acc = [[_mm256_setzero_ps(); V]; Q];
    for d in 0..qs.hd {
        let row = kt.add(d * qs.padded + p);
        let qd: [__m256; Q] =
            std::array::from_fn(|j| _mm256_broadcast_ss(&*qs.q.add(j * qs.hd + d)));
        for i in 0..V {
            let k = _mm256_loadu_ps(row.add(8 * i));
            for (acc_j, qj) in acc.iter_mut().zip(qd) {
                acc_j[i] = _mm256_fmadd_ps(qj, k, acc_j[i]);
            }
        }
    }
    let scale_v = _mm256_set1_ps(scale);
    for (j, acc_j) in acc.iter().enumerate() {
        for (i, a) in acc_j.iter().enumerate() {
            let o = out.as_mut_ptr().add(j * qs.padded + p + 8 * i);
            _mm256_storeu_ps(o, _mm256_mul_ps(*a, scale_v));
        }
    }
}

/// `out_j[d0..d0 + 8·v] (+)= Σ_{p in span} scores[j·padded + p] ·
/// values[p][d0..]` for the `q` queries `j`, accumulating onto `out_j`
/// after the first chunk (`span.0 > 0`).
///
/// # Safety
/// AVX2 and FMA must be available; `1 <= q <= 4`; `d0 + 8·v <= qs.hd`;
/// the `q` outputs of `qs` are writable.
pub unsafe fn sum(
    q: usize,
    v: usize,
    qs: Queries,
    scores: &[f32],
    values: &[f32],
    span: (usize, usize),
    d0: usize,
) {
    let mut done = 0;
    while done < v {
        let part = (v - done).min(parts_of(q));
        let at = d0 + 8 * done;
        dispatch_qv!(sum_part, q, part, (qs, scores, values, span, at));
        done += part;
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn sum_part<const Q: usize, const V: usize>(
    qs: Queries,
    scores: &[f32],
    values: &[f32],
    (p0, p1): (usize, usize),
    d0: usize,
) {
    assert!(values.len() >= p1 * qs.hd && scores.len() >= (Q - 1) * qs.padded + p1);
    assert!(d0 + 8 * V <= qs.hd);
    let (v, w) = (values.as_ptr(), scores.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); V]; Q];
    if p0 > 0 {
        for (j, acc_j) in acc.iter_mut().enumerate() {
            for (i, a) in acc_j.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(qs.out.add(j * qs.hd + d0 + 8 * i));
            }
        }
    }
    for p in p0..p1 {
        let row = v.add(p * qs.hd + d0);
        let wp: [__m256; Q] =
            std::array::from_fn(|j| _mm256_broadcast_ss(&*w.add(j * qs.padded + p)));
        for i in 0..V {
            let x = _mm256_loadu_ps(row.add(8 * i));
            for (acc_j, wj) in acc.iter_mut().zip(wp) {
                acc_j[i] = _mm256_fmadd_ps(wj, x, acc_j[i]);
            }
        }
    }
    for (j, acc_j) in acc.iter().enumerate() {
        for (i, a) in acc_j.iter().enumerate() {
            _mm256_storeu_ps(qs.out.add(j * qs.hd + d0 + 8 * i), *a);
        }
    }
}
