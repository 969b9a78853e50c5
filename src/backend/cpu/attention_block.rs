//! Prefill attention on AVX-512: one task takes a block of query rows of one
//! sequence and one KV head (with all the query heads that share it). The
//! keys of the causal window are gathered once, transposed, so a query's
//! scores for 16 positions come out of one vector of FMAs; softmax uses a
//! vectorized exp and the weighted sum of values runs over whole vectors.
//! The query heads of a row that share the KV head (up to [`MAX_QUERIES`]
//! at once) go through the keys and values together: each key or value
//! vector loaded feeds an FMA per head, and the heads' accumulators are
//! independent FMA chains.

use super::attention::{AttnSeq, AttnShape};
#[cfg(target_arch = "x86_64")]
use super::vector::softmax_unnormalized;
use std::cell::RefCell;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Query rows per task.
pub const ROW_BLOCK: usize = 16;

/// Query heads of one row that share a pass over the keys and values.
const MAX_QUERIES: usize = 4;

#[derive(Default)]
struct Scratch {
    /// `[head_dim][positions]`, positions padded to a multiple of 16.
    keys_t: Vec<f32>,
    /// `[positions][head_dim]`.
    values: Vec<f32>,
    scores: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Computes rows `first..last` (offsets within `seq`) of query heads
/// `kv_head·group .. (kv_head+1)·group`.
///
/// # Safety
/// AVX-512F must be available; `head_dim % 16 == 0`; `q`, `keys`, `values`
/// hold what `attention` checked; `out` points at the `[rows, n_heads·head_dim]`
/// output, and the (row, head) slices of this block belong to this call.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
pub unsafe fn block(
    shape: &AttnShape,
    seq: &AttnSeq<'_>,
    kv_head: usize,
    first: usize,
    last: usize,
    q: &[f32],
    q_stride: usize,
    keys: &[f32],
    values: &[f32],
    out: *mut f32,
) {
    let (h, kvh, hd) = (shape.n_heads, shape.n_kv_heads, shape.head_dim);
    let group = h / kvh;
    let kv_width = kvh * hd;
    let n_pos = seq.context_len + last; // positions 0..n_pos are visible to the last row
    let padded = n_pos.div_ceil(16) * 16;
    SCRATCH.with(|s| {
        let s = &mut *s.borrow_mut();
        s.keys_t.resize(hd * padded, 0.0);
        s.values.resize(n_pos * hd, 0.0);
        s.scores.resize(MAX_QUERIES * padded, 0.0);
        // Keys transposed 16 positions × 16 dims at a time; positions past
        // n_pos (None) come out as the zero padding the score kernels read.
        let kt = s.keys_t.as_mut_ptr();
        let mut rows: [Option<&[f32]>; 16] = [None; 16];
        for p0 in (0..padded).step_by(16) {
            for (j, row) in rows.iter_mut().enumerate() {
                let p = p0 + j;
                *row = (p < n_pos).then(|| {
                    let base = seq.kv.slot(p) * kv_width + kv_head * hd;
                    s.values[p * hd..(p + 1) * hd].copy_from_slice(&values[base..base + hd]);
                    &keys[base..base + hd]
                });
            }
            for d0 in (0..hd).step_by(16) {
                // SAFETY: hd % 16 == 0 and p0 + 16 <= padded, so the 16
                // rows `d0..d0 + 16` of columns `p0..p0 + 16` lie in keys_t.
                transpose16(&rows, d0, kt.add(d0 * padded + p0), padded);
            }
        }
        for i in first..last {
            let row = seq.start + i;
            let visible = seq.context_len + i + 1;
            let mut head = kv_head * group;
            while head < (kv_head + 1) * group {
                // Heads `head..head + n` are `hd` apart in the query and output rows.
                let n = ((kv_head + 1) * group - head).min(MAX_QUERIES);
                let queries = Queries {
                    q: q.as_ptr().add(row * q_stride + head * hd),
                    out: out.add(row * h * hd + head * hd),
                    hd,
                    padded,
                    visible,
                };
                match n {
                    1 => scores::<1>(queries, &s.keys_t, shape.scale, &mut s.scores),
                    2 => scores::<2>(queries, &s.keys_t, shape.scale, &mut s.scores),
                    3 => scores::<3>(queries, &s.keys_t, shape.scale, &mut s.scores),
                    _ => scores::<4>(queries, &s.keys_t, shape.scale, &mut s.scores),
                }
                let mut inv_sums = [0f32; MAX_QUERIES];
                for (j, inv) in inv_sums.iter_mut().enumerate().take(n) {
                    *inv = softmax_unnormalized(&mut s.scores[j * padded..j * padded + visible]);
                }
                match n {
                    1 => weighted_sum::<1>(queries, &s.scores, &s.values, &inv_sums),
                    2 => weighted_sum::<2>(queries, &s.scores, &s.values, &inv_sums),
                    3 => weighted_sum::<3>(queries, &s.scores, &s.values, &inv_sums),
                    _ => weighted_sum::<4>(queries, &s.scores, &s.values, &inv_sums),
                }
                head += n;
            }
        }
    });
}

/// `out[d·stride + j] = rows[j][d0 + d]` for `d, j < 16` (0 where `rows[j]`
/// is `None`): one 16 × 16 block, transposed in registers.
///
/// # Safety
/// AVX-512F must be available; every row holds `d0 + 16` values; `out`
/// points at 16 rows of 16 writable floats, `stride` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose16(rows: &[Option<&[f32]>; 16], d0: usize, out: *mut f32, stride: usize) {
    let r: [__m512; 16] = std::array::from_fn(|j| match rows[j] {
        Some(row) => _mm512_loadu_ps(row[d0..d0 + 16].as_ptr()),
        None => _mm512_setzero_ps(),
    });
    // t[2g], t[2g+1]: rows 2g, 2g+1 interleaved (dims 4k, 4k+1 / 4k+2, 4k+3 of lane k).
    let t: [__m512; 16] = std::array::from_fn(|i| {
        let (a, b) = (r[i & !1], r[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_ps(a, b)
        } else {
            _mm512_unpackhi_ps(a, b)
        }
    });
    // u[4g + i]: lane k holds dim 4k + i of rows 4g..4g + 4.
    let u: [__m512; 16] = std::array::from_fn(|n| {
        let (g, i) = (n / 4, n % 4);
        let (a, b) = (t[4 * g + i / 2], t[4 * g + 2 + i / 2]);
        if i % 2 == 0 {
            _mm512_shuffle_ps::<0x44>(a, b)
        } else {
            _mm512_shuffle_ps::<0xEE>(a, b)
        }
    });
    // v[8h + i], v[8h + 4 + i]: dims (i, 8 + i) and (4 + i, 12 + i) of rows 8h..8h + 8.
    let v: [__m512; 16] = std::array::from_fn(|n| {
        let (h, hi, i) = (n / 8, (n / 4) % 2, n % 4);
        let (a, b) = (u[8 * h + i], u[8 * h + 4 + i]);
        if hi == 0 {
            _mm512_shuffle_f32x4::<0x88>(a, b)
        } else {
            _mm512_shuffle_f32x4::<0xDD>(a, b)
        }
    });
    // Dim d: i = d % 4, from v[i + 4·((d / 4) % 2)] and the same of rows 8..16.
    for d in 0..16 {
        let n = d % 4 + 4 * ((d / 4) % 2);
        let w = if d < 8 {
            _mm512_shuffle_f32x4::<0x88>(v[n], v[8 + n])
        } else {
            _mm512_shuffle_f32x4::<0xDD>(v[n], v[8 + n])
        };
        _mm512_storeu_ps(out.add(d * stride), w);
    }
}

/// `Q` query heads of one row: query `j` at `q + j·hd`, its output at
/// `out + j·hd`, its scores at `scores[j·padded..]`; positions `0..visible`.
#[derive(Clone, Copy)]
struct Queries {
    q: *const f32,
    out: *mut f32,
    hd: usize,
    padded: usize,
    visible: usize,
}

/// `scores[j·padded + p] = scale · q_j · k_p` for `j < Q`, `p < visible`
/// (whole 16-blocks are written).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn scores<const Q: usize>(qs: Queries, keys_t: &[f32], scale: f32, out: &mut [f32]) {
    let end = qs.visible.div_ceil(16) * 16;
    let mut p = 0;
    while p + 64 <= end {
        score_chunk::<Q, 4>(qs, keys_t, p, scale, out);
        p += 64;
    }
    match (end - p) / 16 {
        3 => score_chunk::<Q, 3>(qs, keys_t, p, scale, out),
        2 => score_chunk::<Q, 2>(qs, keys_t, p, scale, out),
        1 => score_chunk::<Q, 1>(qs, keys_t, p, scale, out),
        _ => {}
    }
}

/// [`scores`] for positions `p..p + 16·W`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn score_chunk<const Q: usize, const W: usize>(
    qs: Queries,
    keys_t: &[f32],
    p: usize,
    scale: f32,
    out: &mut [f32],
) {
    debug_assert!(keys_t.len() >= qs.hd * qs.padded && out.len() >= Q * qs.padded);
    let kt = keys_t.as_ptr();
    let mut acc = [[_mm512_setzero_ps(); W]; Q];
    for d in 0..qs.hd {
        let row = kt.add(d * qs.padded + p);
        let k: [__m512; W] = std::array::from_fn(|j| _mm512_loadu_ps(row.add(16 * j)));
        for (j, acc_j) in acc.iter_mut().enumerate() {
            let qd = _mm512_set1_ps(*qs.q.add(j * qs.hd + d));
            for (a, kv) in acc_j.iter_mut().zip(k) {
                *a = _mm512_fmadd_ps(qd, kv, *a);
            }
        }
    }
    let scale_v = _mm512_set1_ps(scale);
    for (j, acc_j) in acc.iter().enumerate() {
        for (w, a) in acc_j.iter().enumerate() {
            let o = out.as_mut_ptr().add(j * qs.padded + p + 16 * w);
            _mm512_storeu_ps(o, _mm512_mul_ps(*a, scale_v));
        }
    }
}

/// `out_j = inv_sums[j] · Σ_p scores[j·padded + p] · values[p]` for `j < Q`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn weighted_sum<const Q: usize>(
    qs: Queries,
    scores: &[f32],
    values: &[f32],
    inv_sums: &[f32; MAX_QUERIES],
) {
    let mut d0 = 0;
    while d0 < qs.hd {
        let width = (qs.hd - d0).min(64) / 16;
        match width {
            4 => sum_chunk::<Q, 4>(qs, scores, values, inv_sums, d0),
            3 => sum_chunk::<Q, 3>(qs, scores, values, inv_sums, d0),
            2 => sum_chunk::<Q, 2>(qs, scores, values, inv_sums, d0),
            _ => sum_chunk::<Q, 1>(qs, scores, values, inv_sums, d0),
        }
        d0 += width * 16;
    }
}

/// [`weighted_sum`] for dimensions `d0..d0 + 16·W`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_chunk<const Q: usize, const W: usize>(
    qs: Queries,
    scores: &[f32],
    values: &[f32],
    inv_sums: &[f32; MAX_QUERIES],
    d0: usize,
) {
    debug_assert!(values.len() >= qs.visible * qs.hd && scores.len() >= Q * qs.padded);
    let (v, w) = (values.as_ptr(), scores.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); W]; Q];
    for p in 0..qs.visible {
        let row = v.add(p * qs.hd + d0);
        let vv: [__m512; W] = std::array::from_fn(|j| _mm512_loadu_ps(row.add(16 * j)));
        for (j, acc_j) in acc.iter_mut().enumerate() {
            let wp = _mm512_set1_ps(*w.add(j * qs.padded + p));
            for (a, x) in acc_j.iter_mut().zip(vv) {
                *a = _mm512_fmadd_ps(wp, x, *a);
            }
        }
    }
    for (j, acc_j) in acc.iter().enumerate() {
        let s = _mm512_set1_ps(inv_sums[j]);
        for (i, a) in acc_j.iter().enumerate() {
            _mm512_storeu_ps(qs.out.add(j * qs.hd + d0 + 16 * i), _mm512_mul_ps(*a, s));
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::backend::cpu::matmul::tests::pseudo_random;

    #[test]
    fn transpose16_matches_scalar_with_missing_rows() {
        if !is_x86_feature_detected!("avx512f") {
            return;
        }
        let data = pseudo_random(16 * 48, 5);
        for missing in [0usize, 1, 7, 16] {
            let rows: [Option<&[f32]>; 16] =
                std::array::from_fn(|j| (j < 16 - missing).then(|| &data[j * 48..(j + 1) * 48]));
            for d0 in [0, 16, 32] {
                let stride = 21;
                let mut out = vec![f32::NAN; 15 * stride + 16];
                // SAFETY: AVX-512F checked; rows hold 48 >= d0 + 16 values;
                // out holds 16 rows of 16, `stride` apart.
                unsafe { transpose16(&rows, d0, out.as_mut_ptr(), stride) };
                for d in 0..16 {
                    for j in 0..16 {
                        let want = rows[j].map_or(0.0, |r| r[d0 + d]);
                        assert_eq!(
                            out[d * stride + j],
                            want,
                            "missing={missing} d0={d0} [{d}][{j}]"
                        );
                    }
                }
            }
        }
    }
}
