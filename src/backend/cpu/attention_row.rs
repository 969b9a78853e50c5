//! Decode attention on AVX-512: one query row and head over its causal
//! window. The query and the output accumulator live in registers (head_dim
//! up to 128), so each key costs one vector of FMAs and a horizontal sum and
//! each value one vector of FMAs, with no calls or stores per position.

use super::attention::{AttnSeq, AttnShape};
#[cfg(target_arch = "x86_64")]
use super::vector::softmax_unnormalized;
use crate::kv::KvMapping;
use std::cell::RefCell;

thread_local! {
    /// Element offsets of the positions' K/V vectors for the current row.
    static OFFSETS: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
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

#[cfg(test)]
mod tests {
    use super::*;

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
