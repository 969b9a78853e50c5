//! Prefill attention on AVX-512: one task takes a block of query rows of one
//! sequence and one KV head (with all the query heads that share it). The
//! keys of the causal window are gathered once, transposed, so a query's
//! scores for 16 positions come out of one vector of FMAs; softmax uses a
//! vectorized exp and the weighted sum of values runs over whole vectors.

use super::attention::{AttnSeq, AttnShape};
#[cfg(target_arch = "x86_64")]
use super::vector::softmax_unnormalized;
use std::cell::RefCell;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Query rows per task.
pub const ROW_BLOCK: usize = 16;

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
        s.scores.resize(padded, 0.0);
        for p in 0..n_pos {
            let base = seq.kv.slot(p) * kv_width + kv_head * hd;
            let k = &keys[base..base + hd];
            for (d, &v) in k.iter().enumerate() {
                *s.keys_t.get_unchecked_mut(d * padded + p) = v;
            }
            s.values[p * hd..(p + 1) * hd].copy_from_slice(&values[base..base + hd]);
        }
        for d in 0..hd {
            s.keys_t[d * padded + n_pos..(d + 1) * padded].fill(0.0);
        }
        for i in first..last {
            let row = seq.start + i;
            let visible = seq.context_len + i + 1;
            for head in kv_head * group..(kv_head + 1) * group {
                let qv = q.as_ptr().add(row * q_stride + head * hd);
                scores(
                    qv,
                    hd,
                    &s.keys_t,
                    padded,
                    visible,
                    shape.scale,
                    &mut s.scores,
                );
                let inv_sum = softmax_unnormalized(&mut s.scores[..visible]);
                weighted_sum(
                    &s.scores[..visible],
                    &s.values,
                    hd,
                    inv_sum,
                    out.add(row * h * hd + head * hd),
                );
            }
        }
    });
}

/// `scores[p] = scale · q · k_p` for `p < visible` (whole 16-blocks are written).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn scores(
    q: *const f32,
    hd: usize,
    keys_t: &[f32],
    padded: usize,
    visible: usize,
    scale: f32,
    out: &mut [f32],
) {
    let kt = keys_t.as_ptr();
    let scale_v = _mm512_set1_ps(scale);
    let mut p = 0;
    while p + 64 <= visible.div_ceil(16) * 16 {
        let mut acc = [_mm512_setzero_ps(); 4];
        for d in 0..hd {
            let qd = _mm512_set1_ps(*q.add(d));
            let row = kt.add(d * padded + p);
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(qd, _mm512_loadu_ps(row.add(16 * j)), *a);
            }
        }
        for (j, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(p + 16 * j), _mm512_mul_ps(*a, scale_v));
        }
        p += 64;
    }
    while p < visible {
        let mut acc = _mm512_setzero_ps();
        for d in 0..hd {
            acc = _mm512_fmadd_ps(
                _mm512_set1_ps(*q.add(d)),
                _mm512_loadu_ps(kt.add(d * padded + p)),
                acc,
            );
        }
        _mm512_storeu_ps(out.as_mut_ptr().add(p), _mm512_mul_ps(acc, scale_v));
        p += 16;
    }
}

/// `out = inv_sum · Σ_p w[p] · values[p]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn weighted_sum(w: &[f32], values: &[f32], hd: usize, inv_sum: f32, out: *mut f32) {
    let v = values.as_ptr();
    let mut d0 = 0;
    while d0 < hd {
        let width = (hd - d0).min(64) / 16;
        let mut acc = [_mm512_setzero_ps(); 4];
        for (p, &wp) in w.iter().enumerate() {
            let wv = _mm512_set1_ps(wp);
            let row = v.add(p * hd + d0);
            for (j, a) in acc.iter_mut().enumerate().take(width) {
                *a = _mm512_fmadd_ps(wv, _mm512_loadu_ps(row.add(16 * j)), *a);
            }
        }
        let s = _mm512_set1_ps(inv_sum);
        for (j, a) in acc.iter().enumerate().take(width) {
            _mm512_storeu_ps(out.add(d0 + 16 * j), _mm512_mul_ps(*a, s));
        }
        d0 += width * 16;
    }
}
