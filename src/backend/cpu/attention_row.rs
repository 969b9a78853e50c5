//! Decode attention on AVX-512: one query row and head over its causal
//! window. The query and the output accumulator live in registers (head_dim
//! up to 128), so each key costs one vector of FMAs and a horizontal sum and
//! each value one vector of FMAs, with no calls or stores per position.

use super::attention::AttnShape;
#[cfg(target_arch = "x86_64")]
use super::vector::softmax_unnormalized;
use crate::forward::AttnSeq;
use crate::forward::KvMapping;
use std::cell::RefCell;

thread_local! {
    /// Element offsets of the positions' K/V vectors for the current row.
    static OFFSETS: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// Grows this thread's position offsets to hold `positions` entries.
pub fn reserve_offsets(positions: usize) {
    OFFSETS.with(|o| reserve_to(&mut o.borrow_mut(), positions));
}

/// Ensures `v` can hold `n` elements without reallocating.
pub fn reserve_to<T>(v: &mut Vec<T>, n: usize) {
    v.reserve(n.saturating_sub(v.len()));
}

/// `out[p] = slot(p) · kv_width + offset` for `p < n`, walking the block
/// table once instead of dividing per position.
fn fill_offsets(
    kv: &KvMapping<'_>,
    n: usize,
    kv_width: usize,
    offset: usize,
    out: &mut Vec<usize>,
) {
    out.clear();
    match *kv {
        KvMapping::Blocks { table, block_size } => {
            for &b in table {
                if out.len() == n {
                    break;
                }
                let first = b as usize * block_size;
                let take = block_size.min(n - out.len());
                out.extend((first..first + take).map(|s| s * kv_width + offset));
            }
        }
        KvMapping::Slots(slots) => {
            out.extend(slots[..n].iter().map(|&s| s as usize * kv_width + offset));
        }
    }
    assert_eq!(
        out.len(),
        n,
        "KV mapping covers fewer positions than attended"
    );
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Largest head_dim (in 16-float chunks) with a register kernel.
pub const MAX_CHUNKS: usize = 8;

/// Whether [`row`] handles this head_dim.
pub fn supported(head_dim: usize) -> bool {
    head_dim.is_multiple_of(16) && head_dim / 16 <= MAX_CHUNKS && head_dim > 0
}

/// `out = softmax(scale · q·K[0..=pos]) · V[0..=pos]` for one row and head.
///
/// # Safety
/// AVX-512F must be available; [`supported`]`(shape.head_dim)`; `q` and
/// `out` point at `head_dim` floats; every position `0..=pos` of `seq` maps
/// to a slot inside `keys`/`values` (`[slots, n_kv_heads · head_dim]`).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn row(
    shape: &AttnShape,
    seq: &AttnSeq<'_>,
    kv_head: usize,
    pos: usize,
    q: *const f32,
    keys: &[f32],
    values: &[f32],
    scores: &mut Vec<f32>,
    out: *mut f32,
) {
    let args = (shape, seq, kv_head, pos, q, keys, values, scores, out);
    match shape.head_dim / 16 {
        1 => row_chunks::<1>(args),
        2 => row_chunks::<2>(args),
        3 => row_chunks::<3>(args),
        4 => row_chunks::<4>(args),
        5 => row_chunks::<5>(args),
        6 => row_chunks::<6>(args),
        7 => row_chunks::<7>(args),
        _ => row_chunks::<8>(args),
    }
}

#[cfg(target_arch = "x86_64")]
type RowArgs<'s, 'a, 'b> = (
    &'a AttnShape,
    &'a AttnSeq<'b>,
    usize,
    usize,
    *const f32,
    &'a [f32],
    &'a [f32],
    &'s mut Vec<f32>,
    *mut f32,
);

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn row_chunks<const C: usize>(
    (shape, seq, kv_head, pos, q, keys, values, scores, out): RowArgs<'_, '_, '_>,
) {
    let hd = 16 * C;
    let kv_width = shape.n_kv_heads * hd;
    let offset = kv_head * hd;
    let mut qv = [_mm512_setzero_ps(); C];
    for (c, v) in qv.iter_mut().enumerate() {
        *v = _mm512_loadu_ps(q.add(16 * c));
    }
    // Taken out of (and put back into) the thread-local rather than used in
    // a closure, which would not inherit this function's target features.
    let mut offsets = OFFSETS.with(|o| std::mem::take(&mut *o.borrow_mut()));
    fill_offsets(&seq.kv, pos + 1, kv_width, offset, &mut offsets);
    scores.clear();
    scores.reserve(pos + 1);
    for &base in offsets.iter() {
        let k = keys[base..base + hd].as_ptr();
        let mut a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
        for (c, v) in qv.iter().enumerate().skip(1) {
            a = _mm512_fmadd_ps(*v, _mm512_loadu_ps(k.add(16 * c)), a);
        }
        scores.push(_mm512_reduce_add_ps(a) * shape.scale);
    }
    let inv_sum = softmax_unnormalized(scores);
    let mut acc = [_mm512_setzero_ps(); C];
    for (&w, &base) in scores.iter().zip(offsets.iter()) {
        let v = values[base..base + hd].as_ptr();
        let wv = _mm512_set1_ps(w);
        for (c, a) in acc.iter_mut().enumerate() {
            *a = _mm512_fmadd_ps(wv, _mm512_loadu_ps(v.add(16 * c)), *a);
        }
    }
    let s = _mm512_set1_ps(inv_sum);
    for (c, a) in acc.iter().enumerate() {
        _mm512_storeu_ps(out.add(16 * c), _mm512_mul_ps(*a, s));
    }
    OFFSETS.with(|o| *o.borrow_mut() = offsets);
}

/// Whether [`row_group`] handles `group` query heads per KV head of this
/// head_dim (the queries and accumulators of the group fit in registers).
pub fn group_supported(head_dim: usize, group: usize) -> bool {
    matches!((head_dim, group), (64, 2..=4) | (128, 2))
}

/// [`row`] for the `group` query heads that share `kv_head` (consecutive,
/// `head_dim` apart in `q` and `out`): one pass over their keys and one over
/// their values, K and V prefetched ahead. Results are bit-identical to
/// [`row`] per head (same FMA order, same summation tree).
///
/// # Safety
/// As [`row`], for every head of the group; [`group_supported`]`(head_dim,
/// group)`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn row_group(
    shape: &AttnShape,
    seq: &AttnSeq<'_>,
    kv_head: usize,
    group: usize,
    pos: usize,
    q: *const f32,
    keys: &[f32],
    values: &[f32],
    scores: &mut Vec<f32>,
    out: *mut f32,
) {
    let args = (shape, seq, kv_head, pos, q, keys, values, scores, out);
    match (shape.head_dim, group) {
        (64, 2) => group_chunks::<4, 2>(args),
        (64, 3) => group_chunks::<4, 3>(args),
        (64, _) => group_chunks::<4, 4>(args),
        _ => group_chunks::<8, 2>(args),
    }
}

/// Positions ahead that the grouped kernel prefetches K and V.
#[cfg(target_arch = "x86_64")]
const KV_PREFETCH: usize = 6;

/// Horizontal sums of four vectors, each in the order of
/// `_mm512_reduce_add_ps` (256-bit halves, 128-bit halves, 64-bit halves,
/// neighbours), so a score equals the single-head kernel's bit for bit.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn reduce4(a: &[__m512; 4]) -> [f32; 4] {
    let s01 = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x44>(a[0], a[1]),
        _mm512_shuffle_f32x4::<0xEE>(a[0], a[1]),
    );
    let s23 = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x44>(a[2], a[3]),
        _mm512_shuffle_f32x4::<0xEE>(a[2], a[3]),
    );
    // 128-bit lane i now holds vector i's 256-bit half sums, added in halves.
    let e = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(s01, s23),
        _mm512_shuffle_f32x4::<0xDD>(s01, s23),
    );
    let f = _mm512_add_ps(e, _mm512_permute_ps::<0x4E>(e));
    let g = _mm512_add_ps(f, _mm512_permute_ps::<0xB1>(f));
    let mut lanes = [0f32; 16];
    _mm512_storeu_ps(lanes.as_mut_ptr(), g);
    [lanes[0], lanes[4], lanes[8], lanes[12]]
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn group_chunks<const C: usize, const G: usize>(
    (shape, seq, kv_head, pos, q, keys, values, scores, out): RowArgs<'_, '_, '_>,
) {
    let hd = 16 * C;
    let kv_width = shape.n_kv_heads * hd;
    let n = pos + 1;
    let mut qv = [[_mm512_setzero_ps(); C]; G];
    for (h, qh) in qv.iter_mut().enumerate() {
        for (c, v) in qh.iter_mut().enumerate() {
            *v = _mm512_loadu_ps(q.add(h * hd + 16 * c));
        }
    }
    let mut offsets = OFFSETS.with(|o| std::mem::take(&mut *o.borrow_mut()));
    fill_offsets(&seq.kv, n, kv_width, kv_head * hd, &mut offsets);
    if let Some(&last) = offsets.iter().max() {
        assert!(
            last + hd <= keys.len() && last + hd <= values.len(),
            "KV slot outside the cache"
        );
    }
    let prefetch = |base: *const f32, at: usize, l2: bool| {
        if let Some(&o) = offsets.get(at) {
            for line in 0..hd / 16 {
                let a = base.add(o + 16 * line) as *const i8;
                if l2 {
                    _mm_prefetch::<_MM_HINT_T1>(a);
                } else {
                    _mm_prefetch::<_MM_HINT_T0>(a);
                }
            }
        }
    };
    scores.clear();
    scores.resize(G * n, 0.0);
    let sp = scores.as_mut_ptr();
    let (kp, vp) = (keys.as_ptr(), values.as_ptr());
    for (i, &base) in offsets.iter().enumerate() {
        prefetch(kp, i + KV_PREFETCH, false);
        prefetch(vp, i, true);
        let k = kp.add(base);
        let mut kc = [_mm512_setzero_ps(); C];
        for (c, v) in kc.iter_mut().enumerate() {
            *v = _mm512_loadu_ps(k.add(16 * c));
        }
        let mut a = [_mm512_setzero_ps(); 4];
        for (ah, qh) in a.iter_mut().zip(qv.iter()) {
            *ah = _mm512_mul_ps(qh[0], kc[0]);
            for c in 1..C {
                *ah = _mm512_fmadd_ps(qh[c], kc[c], *ah);
            }
        }
        let sums = reduce4(&a);
        for (h, s) in sums.iter().take(G).enumerate() {
            *sp.add(h * n + i) = s * shape.scale;
        }
    }
    let mut inv_sum = [0f32; G];
    for (h, inv) in inv_sum.iter_mut().enumerate() {
        *inv = softmax_unnormalized(&mut scores[h * n..(h + 1) * n]);
    }
    let sp = scores.as_ptr();
    let mut acc = [[_mm512_setzero_ps(); C]; G];
    for (i, &base) in offsets.iter().enumerate() {
        prefetch(vp, i + KV_PREFETCH, false);
        let v = vp.add(base);
        let mut vc = [_mm512_setzero_ps(); C];
        for (c, x) in vc.iter_mut().enumerate() {
            *x = _mm512_loadu_ps(v.add(16 * c));
        }
        for (h, acc_h) in acc.iter_mut().enumerate() {
            let wv = _mm512_set1_ps(*sp.add(h * n + i));
            for (a, x) in acc_h.iter_mut().zip(vc.iter()) {
                *a = _mm512_fmadd_ps(wv, *x, *a);
            }
        }
    }
    for (h, acc_h) in acc.iter().enumerate() {
        let s = _mm512_set1_ps(inv_sum[h]);
        for (c, a) in acc_h.iter().enumerate() {
            _mm512_storeu_ps(out.add(h * hd + 16 * c), _mm512_mul_ps(*a, s));
        }
    }
    OFFSETS.with(|o| *o.borrow_mut() = offsets);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The grouped kernel gives every head exactly the single-head
    /// kernel's output, for each shape it takes and short to long windows.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn group_kernel_matches_single_head_kernel_bitwise() {
        if !is_x86_feature_detected!("avx512f") {
            return;
        }
        // Values in [-2, 2): wide enough for scores to spread.
        let vals = |n: usize, seed: u32| -> Vec<f32> {
            let unit = crate::backend::cpu::matmul::tests::pseudo_random(n, seed);
            unit.iter().map(|v| 2.0 * v).collect()
        };
        for &(hd, group, kvh) in &[
            (64usize, 2usize, 2usize),
            (64, 3, 3),
            (64, 4, 1),
            (128, 2, 2),
        ] {
            assert!(group_supported(hd, group));
            let shape = AttnShape {
                n_heads: group * kvh,
                n_kv_heads: kvh,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let table: Vec<u32> = vec![5, 0, 3, 9, 1, 7, 2, 8];
            let seq = AttnSeq {
                start: 0,
                len: 1,
                context_len: 0,
                kv: KvMapping::Blocks {
                    table: &table,
                    block_size: 8,
                },
            };
            let keys = vals(80 * kvh * hd, 11);
            let values = vals(80 * kvh * hd, 12);
            let q = vals(group * kvh * hd, 13);
            for pos in [0usize, 4, 16, 39, 63] {
                for kv_head in 0..kvh {
                    let first = kv_head * group * hd;
                    let mut scores = Vec::new();
                    let mut got = vec![f32::NAN; group * hd];
                    // SAFETY: AVX-512F checked; every slot < 80 lies in keys/values.
                    unsafe {
                        row_group(
                            &shape,
                            &seq,
                            kv_head,
                            group,
                            pos,
                            q.as_ptr().add(first),
                            &keys,
                            &values,
                            &mut scores,
                            got.as_mut_ptr(),
                        )
                    };
                    for h in 0..group {
                        let mut want = vec![f32::NAN; hd];
                        // SAFETY: as above.
                        unsafe {
                            row(
                                &shape,
                                &seq,
                                kv_head,
                                pos,
                                q.as_ptr().add(first + h * hd),
                                &keys,
                                &values,
                                &mut scores,
                                want.as_mut_ptr(),
                            )
                        };
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(&got[h * hd..(h + 1) * hd]),
                            bits(&want),
                            "hd={hd} group={group} pos={pos} kv_head={kv_head} head {h}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn offsets_follow_both_mappings() {
        let table = [3u32, 0, 7];
        let blocks = KvMapping::Blocks {
            table: &table,
            block_size: 4,
        };
        let slots: Vec<u32> = (0..10).map(|i| 9 - i).collect();
        let mut out = Vec::new();
        for n in [1, 4, 5, 10, 12] {
            fill_offsets(&blocks, n, 6, 2, &mut out);
            let want: Vec<usize> = (0..n).map(|p| blocks.slot(p) * 6 + 2).collect();
            assert_eq!(out, want, "blocks n={n}");
        }
        fill_offsets(&KvMapping::Slots(&slots), 7, 3, 1, &mut out);
        assert_eq!(out, (0..7).map(|p| (9 - p) * 3 + 1).collect::<Vec<_>>());
    }
}
