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
        // Through a raw pointer: stores into the Vec would make the
        // compiler reload its pointer for every element.
        let kt = s.keys_t.as_mut_ptr();
        for p in 0..n_pos {
            let base = seq.kv.slot(p) * kv_width + kv_head * hd;
            let k = &keys[base..base + hd];
            for (d, &v) in k.iter().enumerate() {
                // SAFETY: d < hd and p < n_pos <= padded, within hd · padded.
                *kt.add(d * padded + p) = v;
            }
            s.values[p * hd..(p + 1) * hd].copy_from_slice(&values[base..base + hd]);
        }
        for d in 0..hd {
            s.keys_t[d * padded + n_pos..(d + 1) * padded].fill(0.0);
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
