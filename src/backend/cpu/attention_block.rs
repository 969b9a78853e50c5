//! Prefill attention on AVX-512 and AVX2: one task takes a block of query rows of one
//! sequence and one KV head (with all the query heads that share it). The
//! keys of the causal window are gathered once, transposed, so a query's
//! scores for 16 positions come out of one vector of FMAs; softmax uses a
//! vectorized exp and the weighted sum of values runs over whole vectors.
//! The query heads of a row that share the KV head (up to [`MAX_QUERIES`]
//! at once) go through the keys and values together: each key or value
//! vector loaded feeds an FMA per head, and the heads' accumulators are
//! independent FMA chains. The orchestration here is shared; the vector
//! kernels come from a [`BlockKernels`] (AVX-512 here, AVX2 in
//! `attention_block_avx2.rs`).

use super::attention::AttnShape;
#[cfg(target_arch = "x86_64")]
use super::vector::softmax_unnormalized;
#[cfg(target_arch = "x86_64")]
use super::vector_avx2;
use crate::forward::AttnSeq;
use std::cell::RefCell;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Query rows per task.
pub const ROW_BLOCK: usize = 16;

/// Query heads of one row that share a pass over the keys and values.
pub(super) const MAX_QUERIES: usize = 4;

/// Positions per chunk of keys or values that all queries of a block meet
/// in turn (64 × head_dim 64 × 4 B = 16 KiB).
const POS_CHUNK: usize = 64;

/// `$f::<Q, W>(args)` for `Q = n`, `W = w` (1 to 4 each; more counts as 4).
macro_rules! dispatch_qw {
    ($f:ident, $n:expr, $w:expr, ($($a:expr),*)) => {
        match ($n, $w) {
            (1, 1) => $f::<1, 1>($($a),*),
            (1, 2) => $f::<1, 2>($($a),*),
            (1, 3) => $f::<1, 3>($($a),*),
            (1, _) => $f::<1, 4>($($a),*),
            (2, 1) => $f::<2, 1>($($a),*),
            (2, 2) => $f::<2, 2>($($a),*),
            (2, 3) => $f::<2, 3>($($a),*),
            (2, _) => $f::<2, 4>($($a),*),
            (3, 1) => $f::<3, 1>($($a),*),
            (3, 2) => $f::<3, 2>($($a),*),
            (3, 3) => $f::<3, 3>($($a),*),
            (3, _) => $f::<3, 4>($($a),*),
            (_, 1) => $f::<4, 1>($($a),*),
            (_, 2) => $f::<4, 2>($($a),*),
            (_, 3) => $f::<4, 3>($($a),*),
            _ => $f::<4, 4>($($a),*),
        }
    };
}

/// The vector kernels of one instruction set that [`block`] runs on.
///
/// # Safety
/// Every method requires its instruction set; the argument contracts are
/// those of the AVX-512 kernels below ([`transpose16`], [`score_chunk`],
/// [`sum_chunk`]), for `n` (1..=[`MAX_QUERIES`]) queries and `w` (1..=4)
/// groups of 16 positions or dimensions.
pub(super) trait BlockKernels {
    unsafe fn transpose16(rows: &[Option<&[f32]>; 16], d0: usize, out: *mut f32, stride: usize);
    #[allow(clippy::too_many_arguments)]
    unsafe fn score(
        n: usize,
        w: usize,
        qs: Queries,
        keys_t: &[f32],
        p: usize,
        scale: f32,
        out: &mut [f32],
    );
    #[allow(clippy::too_many_arguments)]
    unsafe fn sum(
        n: usize,
        w: usize,
        qs: Queries,
        scores: &[f32],
        values: &[f32],
        span: (usize, usize),
        d0: usize,
    );
    /// `x[i] = exp(x[i] - max)`; returns `1 / Σ x[i]`.
    unsafe fn softmax_unnormalized(x: &mut [f32]) -> f32;
}

/// The AVX-512F kernels of this file.
#[cfg(target_arch = "x86_64")]
pub(super) struct Avx512;

#[cfg(target_arch = "x86_64")]
impl BlockKernels for Avx512 {
    unsafe fn transpose16(rows: &[Option<&[f32]>; 16], d0: usize, out: *mut f32, stride: usize) {
        transpose16(rows, d0, out, stride)
    }
    unsafe fn score(
        n: usize,
        w: usize,
        qs: Queries,
        keys_t: &[f32],
        p: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        dispatch_qw!(score_chunk, n, w, (qs, keys_t, p, scale, out))
    }
    unsafe fn sum(
        n: usize,
        w: usize,
        qs: Queries,
        scores: &[f32],
        values: &[f32],
        span: (usize, usize),
        d0: usize,
    ) {
        dispatch_qw!(sum_chunk, n, w, (qs, scores, values, span, d0))
    }
    unsafe fn softmax_unnormalized(x: &mut [f32]) -> f32 {
        softmax_unnormalized(x)
    }
}

/// The AVX2 + FMA kernels of `attention_block_avx2.rs`.
#[cfg(target_arch = "x86_64")]
pub(super) struct Avx2;

#[cfg(target_arch = "x86_64")]
impl BlockKernels for Avx2 {
    unsafe fn transpose16(rows: &[Option<&[f32]>; 16], d0: usize, out: *mut f32, stride: usize) {
        super::attention_block_avx2::transpose16(rows, d0, out, stride)
    }
    unsafe fn score(
        n: usize,
        w: usize,
        qs: Queries,
        keys_t: &[f32],
        p: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        super::attention_block_avx2::score(n, 2 * w, qs, keys_t, p, scale, out)
    }
    unsafe fn sum(
        n: usize,
        w: usize,
        qs: Queries,
        scores: &[f32],
        values: &[f32],
        span: (usize, usize),
        d0: usize,
    ) {
        super::attention_block_avx2::sum(n, 2 * w, qs, scores, values, span, d0)
    }
    unsafe fn softmax_unnormalized(x: &mut [f32]) -> f32 {
        vector_avx2::softmax_unnormalized(x)
    }
}

#[derive(Default)]
struct Scratch {
    /// `[head_dim][positions]`, positions padded to a multiple of 16.
    keys_t: Vec<f32>,
    /// `[positions][head_dim]`.
    values: Vec<f32>,
    /// `[query][positions]` of the block's queries (row-major by row, then head).
    scores: Vec<f32>,
    /// `1 / Σ exp` per query.
    inv_sums: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Computes rows `first..last` (offsets within `seq`) of query heads
/// `kv_head·group .. (kv_head+1)·group`.
///
/// # Safety
/// `K`'s instruction set must be available; `head_dim % 16 == 0`; `q`, `keys`, `values`
/// hold what `attention` checked; `out` points at the `[rows, n_heads·head_dim]`
/// output, and the (row, head) slices of this block belong to this call.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn block<K: BlockKernels>(
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
                K::transpose16(&rows, d0, kt.add(d0 * padded + p0), padded);
            }
        }
        // Every query of the block meets a chunk of keys (then of values)
        // while it is in L1: scores chunk by chunk, softmax per query, then
        // the weighted sums chunk by chunk, accumulated in `out`.
        let n_queries = (last - first) * group;
        s.scores.resize(n_queries * padded, 0.0);
        s.inv_sums.resize(n_queries, 0.0);
        // Row i's passes of up to MAX_QUERIES heads: (index of the pass's
        // first query in the block, heads in the pass, their queries).
        let passes = |i: usize| {
            let row = seq.start + i;
            (0..group).step_by(MAX_QUERIES).map(move |h0| {
                let head = kv_head * group + h0;
                let qs = Queries {
                    q: q.as_ptr().add(row * q_stride + head * hd),
                    out: out.add(row * h * hd + head * hd),
                    hd,
                    padded,
                };
                ((i - first) * group + h0, (group - h0).min(MAX_QUERIES), qs)
            })
        };
        for p0 in (0..padded).step_by(POS_CHUNK) {
            for i in first..last {
                let end = (seq.context_len + i + 1).div_ceil(16) * 16;
                if p0 >= end {
                    continue;
                }
                let w = (end.min(p0 + POS_CHUNK) - p0) / 16;
                for (j, n, qs) in passes(i) {
                    let sc = &mut s.scores[j * padded..];
                    K::score(n, w, qs, &s.keys_t, p0, shape.scale, sc);
                }
            }
        }
        for i in first..last {
            let visible = seq.context_len + i + 1;
            for j in (i - first) * group..(i - first + 1) * group {
                let sc = &mut s.scores[j * padded..j * padded + visible];
                s.inv_sums[j] = K::softmax_unnormalized(sc);
            }
        }
        for p0 in (0..n_pos).step_by(POS_CHUNK) {
            for i in first..last {
                let visible = seq.context_len + i + 1;
                if p0 >= visible {
                    continue;
                }
                for (j, n, qs) in passes(i) {
                    let span = (p0, visible.min(p0 + POS_CHUNK));
                    let mut d0 = 0;
                    while d0 < hd {
                        let w = (hd - d0).min(64) / 16;
                        let sc = &s.scores[j * padded..];
                        K::sum(n, w, qs, sc, &s.values, span, d0);
                        d0 += w * 16;
                    }
                }
            }
        }
        for i in first..last {
            let row = out.add((seq.start + i) * h * hd + kv_head * group * hd);
            for (hj, &inv) in s.inv_sums[(i - first) * group..][..group]
                .iter()
                .enumerate()
            {
                for d in 0..hd {
                    *row.add(hj * hd + d) *= inv;
                }
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

/// Query heads of one row: query `j` at `q + j·hd`, its output at
/// `out + j·hd`, its scores `padded` apart.
#[derive(Clone, Copy)]
pub(super) struct Queries {
    pub(super) q: *const f32,
    pub(super) out: *mut f32,
    pub(super) hd: usize,
    pub(super) padded: usize,
}

/// `scores[j·padded + p] = scale · q_j · k_p` for the `Q` queries `j` and
/// positions `p..p + 16·W`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn score_chunk<const Q: usize, const W: usize>(
    qs: Queries,
    keys_t: &[f32],
    p: usize,
    scale: f32,
    out: &mut [f32],
) {
    assert!(keys_t.len() >= qs.hd * qs.padded && out.len() >= (Q - 1) * qs.padded + p + 16 * W);
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

/// `out_j[d0..d0 + 16·W] (+)= Σ_{p in span} scores[j·padded + p] ·
/// values[p][d0..]` for the `Q` queries `j`, accumulating onto `out_j`
/// after the first chunk (`span.0 > 0`); the softmax scaling comes later.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_chunk<const Q: usize, const W: usize>(
    qs: Queries,
    scores: &[f32],
    values: &[f32],
    (p0, p1): (usize, usize),
    d0: usize,
) {
    assert!(values.len() >= p1 * qs.hd && scores.len() >= (Q - 1) * qs.padded + p1);
    assert!(d0 + 16 * W <= qs.hd);
    let (v, w) = (values.as_ptr(), scores.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); W]; Q];
    if p0 > 0 {
        for (j, acc_j) in acc.iter_mut().enumerate() {
            for (i, a) in acc_j.iter_mut().enumerate() {
                *a = _mm512_loadu_ps(qs.out.add(j * qs.hd + d0 + 16 * i));
            }
        }
    }
    for p in p0..p1 {
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
        for (i, a) in acc_j.iter().enumerate() {
            _mm512_storeu_ps(qs.out.add(j * qs.hd + d0 + 16 * i), *a);
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::backend::cpu::matmul::tests::pseudo_random;

    #[test]
    fn transpose16_matches_scalar_with_missing_rows() {
        if is_x86_feature_detected!("avx512f") {
            check_transpose16::<Avx512>();
        }
        if is_x86_feature_detected!("avx2") {
            check_transpose16::<Avx2>();
        }
    }

    fn check_transpose16<K: BlockKernels>() {
        let data = pseudo_random(16 * 48, 5);
        for missing in [0usize, 1, 7, 16] {
            let rows: [Option<&[f32]>; 16] =
                std::array::from_fn(|j| (j < 16 - missing).then(|| &data[j * 48..(j + 1) * 48]));
            for d0 in [0, 16, 32] {
                let stride = 21;
                let mut out = vec![f32::NAN; 15 * stride + 16];
                // SAFETY: the caller checked K's instruction set; rows hold
                // 48 >= d0 + 16 values; out holds 16 rows of 16, `stride` apart.
                unsafe { K::transpose16(&rows, d0, out.as_mut_ptr(), stride) };
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
