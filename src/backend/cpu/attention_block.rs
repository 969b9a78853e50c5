//! Prefill attention on AVX-512: one task takes a block of query rows of one
//! sequence and one KV head (with all the query heads that share it). The
//! keys of the causal window are gathered once, transposed, so a query's
//! scores for 16 positions come out of one vector of FMAs; softmax uses a
//! vectorized exp and the weighted sum of values runs over whole vectors.

use super::attention::{AttnSeq, AttnShape};
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
                scores(qv, hd, &s.keys_t, padded, visible, shape.scale, &mut s.scores);
                let inv_sum = softmax_unnormalized(&mut s.scores[..visible]);
                weighted_sum(&s.scores[..visible], &s.values, hd, inv_sum, out.add(row * h * hd + head * hd));
            }
        }
    });
}

/// `scores[p] = scale · q · k_p` for `p < visible` (whole 16-blocks are written).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn scores(q: *const f32, hd: usize, keys_t: &[f32], padded: usize, visible: usize, scale: f32, out: &mut [f32]) {
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
            acc = _mm512_fmadd_ps(_mm512_set1_ps(*q.add(d)), _mm512_loadu_ps(kt.add(d * padded + p)), acc);
        }
        _mm512_storeu_ps(out.as_mut_ptr().add(p), _mm512_mul_ps(acc, scale_v));
        p += 16;
    }
}

/// `x[i] = exp(x[i] - max)`; returns `1 / Σ x[i]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn softmax_unnormalized(x: &mut [f32]) -> f32 {
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
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), tail_mask, p.add(full)));
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
        let e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail_mask, p.add(full)), m));
        _mm512_mask_storeu_ps(p.add(full), tail_mask, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail_mask, e));
    }
    1.0 / _mm512_reduce_add_ps(sum)
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

/// e^x for each lane (x ≤ 0 here; accurate to a few ulp, 0 below -87).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub unsafe fn exp512(x: __m512) -> __m512 {
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
    _mm512_scalef_ps(p, n)
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
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
                assert!((e - want).abs() <= 4e-7 * want + 1e-38, "exp({x}) = {e}, want {want}");
            }
        }
    }
}
