//! Causal grouped-query attention over the slot-indexed KV cache.
//!
//! Each batch row (one token of one sequence) attends to positions
//! `0..=pos` of its own sequence, read through the sequence's `KvMapping`, so
//! the same kernel serves prefill chunks, decode steps and mixed batches over
//! both the paged and the token KV layouts.

#[cfg(target_arch = "x86_64")]
use super::attention_block;
use super::attention_block::ROW_BLOCK;
use super::attention_row;
use super::isa::{isa, Isa};
use super::ops::softmax_in_place;
use super::threadpool::ThreadPool;
use super::vector::{axpy, dot};
use crate::forward::AttnSeq;
use once_cell::sync::Lazy;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};

pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: each task writes one (row, head) slice of the output, disjoint from all others.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Through a method, so closures capture the whole (Sync) wrapper.
    fn get(self) -> *mut f32 {
        self.0
    }
}

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Grows every pool thread's decode scratch for rows that see up to
/// `max_positions` positions. Which thread runs which (row, head) task
/// changes from step to step, so without this a warm decode step could
/// still allocate on a thread meeting a longer context for the first time.
pub fn reserve_decode_scratch(pool: &ThreadPool, shape: &AttnShape, max_positions: usize) {
    let group = shape.n_heads / shape.n_kv_heads.max(1);
    pool.broadcast(&|| {
        SCORES.with(|s| attention_row::reserve_to(&mut s.borrow_mut(), group * max_positions));
        attention_row::reserve_offsets(max_positions);
    });
}

/// `out[row, h] = Σ_p softmax(q[row,h]·K[p]·scale) V[p]` over the causal window.
/// `q` has rows of stride `q_stride` whose first `n_heads * head_dim` values
/// are the query; `out` is `[rows, n_heads * head_dim]`; `keys`/`values` are
/// one layer of the KV storage, `[slots, n_kv_heads * head_dim]`.
///
/// Once `stop` is raised the tasks not yet started are skipped (their
/// output rows are left as they were): a long prefill's attention is most
/// of a layer's time, and the caller that raised it discards the result.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    pool: &ThreadPool,
    shape: &AttnShape,
    seqs: &[AttnSeq<'_>],
    q: &[f32],
    q_stride: usize,
    keys: &[f32],
    values: &[f32],
    out: &mut [f32],
    stop: Option<&AtomicBool>,
) {
    let rows: usize = seqs.iter().map(|s| s.len).sum();
    let (h, kvh, hd) = (shape.n_heads, shape.n_kv_heads, shape.head_dim);
    let q_width = h * hd;
    let kv_width = kvh * hd;
    let group = h / kvh;
    assert!(
        rows == 0 || q.len() >= (rows - 1) * q_stride + q_width,
        "attention query buffer too small"
    );
    assert!(
        out.len() >= rows * q_width,
        "attention output buffer too small"
    );
    let out_ptr = OutPtr(out.as_mut_ptr());
    let blocked = use_blocks(hd);
    // The decode row kernels are AVX-512 only; on AVX2 decode rows run in
    // blocks too (below). Off x86-64, rows take the generic dot/axpy path.
    #[cfg(target_arch = "x86_64")]
    let row_kernel = blocked && isa() == Isa::Avx512 && attention_row::supported(hd);
    #[cfg(target_arch = "x86_64")]
    let grouped = attention_row::group_supported(hd, group);
    // Without row kernels of the same arithmetic as the blocks (AVX2), every
    // row runs in blocks: a row's result must not depend on how many rows
    // of its sequence share the call (a prefill chunk's length, a decode
    // step, a speculative verify, a recompute), or a request's greedy tokens
    // would change with what is batched beside it.
    #[cfg(target_arch = "x86_64")]
    let rows_in_blocks = !row_kernel;
    #[cfg(not(target_arch = "x86_64"))]
    let rows_in_blocks = false;
    let in_blocks = |s: &AttnSeq<'_>| blocked && (s.len >= ROW_BLOCK || rows_in_blocks);
    // With many decode rows, one task takes all query heads of a KV head,
    // so the K/V vectors they share are read from memory once (by one core).
    let row_tasks: usize = seqs.iter().filter(|s| !in_blocks(s)).map(|s| s.len).sum();
    let heads_per_task = if row_tasks * kvh >= 4 * pool.threads() {
        group
    } else {
        1
    };
    let head_tasks = h / heads_per_task;
    // Tasks: a prefill sequence contributes (kv head, row block) pairs,
    // others one task per (row, head or KV head group).
    let seq_tasks = |s: &AttnSeq<'_>| {
        if in_blocks(s) {
            kvh * s.len.div_ceil(ROW_BLOCK)
        } else {
            s.len * head_tasks
        }
    };
    let n_tasks: usize = seqs.iter().map(seq_tasks).sum();
    pool.run(n_tasks, &|task| {
        if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
            return;
        }
        let mut t = task;
        let seq = seqs
            .iter()
            .find(|s| {
                let n = seq_tasks(s);
                if t < n {
                    true
                } else {
                    t -= n;
                    false
                }
            })
            .expect("task belongs to a sequence");
        if in_blocks(seq) {
            let blocks = seq.len.div_ceil(ROW_BLOCK);
            // Off x86-64 no sequence runs in blocks (`use_blocks`).
            #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
            let (kv_head, b) = (t / blocks, t % blocks);
            #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
            let (first, last) = (b * ROW_BLOCK, ((b + 1) * ROW_BLOCK).min(seq.len));
            #[cfg(target_arch = "x86_64")]
            {
                let block = if isa() == Isa::Avx512 {
                    attention_block::block::<attention_block::Avx512>
                } else {
                    attention_block::block::<attention_block::Avx2>
                };
                // SAFETY: `use_blocks` checked the instruction set (AVX-512F,
                // else AVX2 + FMA) and head_dim; this task alone writes rows
                // first..last of the heads sharing kv_head.
                unsafe {
                    block(
                        shape,
                        seq,
                        kv_head,
                        first,
                        last,
                        q,
                        q_stride,
                        keys,
                        values,
                        out_ptr.get(),
                    )
                };
            }
            return;
        }
        let row = seq.start + t / head_tasks;
        let first_head = (t % head_tasks) * heads_per_task;
        #[cfg(target_arch = "x86_64")]
        if row_kernel && heads_per_task == group && grouped {
            let pos = seq.context_len + (row - seq.start);
            SCORES.with(|scores| {
                // SAFETY: `use_blocks` checked AVX-512F, `group_supported` the
                // shape; the group's query heads are q_width-contiguous in the
                // row, their outputs belong to this task alone, and
                // `row_group` checks every slot against keys/values.
                unsafe {
                    attention_row::row_group(
                        shape,
                        seq,
                        first_head / group,
                        group,
                        pos,
                        q.as_ptr().add(row * q_stride + first_head * hd),
                        keys,
                        values,
                        &mut scores.borrow_mut(),
                        out_ptr.get().add(row * q_width + first_head * hd),
                    )
                }
            });
            return;
        }
        for head in first_head..first_head + heads_per_task {
            let pos = seq.context_len + (row - seq.start);
            let kv_head = head / group;
            let qv = &q[row * q_stride + head * hd..row * q_stride + (head + 1) * hd];
            // SAFETY: (row, head) belongs to this task alone, so this slice is written by nobody else.
            let ov = unsafe {
                std::slice::from_raw_parts_mut(out_ptr.get().add(row * q_width + head * hd), hd)
            };
            SCORES.with(|scores| {
                let mut scores = scores.borrow_mut();
                #[cfg(target_arch = "x86_64")]
                if row_kernel {
                    // SAFETY: `use_blocks` checked AVX-512F, `supported` the head_dim;
                    // qv and ov hold head_dim floats; the KV mapping's slots index
                    // keys/values as in the generic path below (bounds-checked there too).
                    unsafe {
                        attention_row::row(
                            shape,
                            seq,
                            kv_head,
                            pos,
                            qv.as_ptr(),
                            keys,
                            values,
                            &mut scores,
                            ov.as_mut_ptr(),
                        )
                    };
                    return;
                }
                scores.clear();
                scores.extend((0..=pos).map(|p| {
                    let base = seq.kv.slot(p) * kv_width + kv_head * hd;
                    dot(qv, &keys[base..base + hd]) * shape.scale
                }));
                softmax_in_place(&mut scores);
                ov.fill(0.0);
                for (p, &w) in scores.iter().enumerate() {
                    let base = seq.kv.slot(p) * kv_width + kv_head * hd;
                    axpy(w, &values[base..base + hd], ov);
                }
            });
        }
    });
}

/// Whether prefill chunks take the blocked path (AVX-512 or AVX2).
fn use_blocks(head_dim: usize) -> bool {
    static SIMPLE: Lazy<bool> = Lazy::new(|| crate::tuning::var("NANOINFER_ATTN_SIMPLE").is_some());
    matches!(isa(), Isa::Avx512 | Isa::Avx2Fma) && head_dim.is_multiple_of(16) && !*SIMPLE
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forward::KvMapping;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(3);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// Causal GQA attention in f64, straight from the definition.
    #[allow(clippy::too_many_arguments)]
    /// Runs `attention` and compares every output with `reference`.
    fn check_against_reference(
        pool: &ThreadPool,
        shape: &AttnShape,
        seqs: &[AttnSeq<'_>],
        q: &[f32],
        keys: &[f32],
        vals: &[f32],
        rows: usize,
    ) {
        let (h, kvh, hd) = (shape.n_heads, shape.n_kv_heads, shape.head_dim);
        let mut out = vec![f32::NAN; rows * h * hd];
        attention(pool, shape, seqs, q, h * hd, keys, vals, &mut out, None);
        let want = reference(shape, seqs, q, keys, vals, rows);
        for (i, (a, b)) in out.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() < 1e-5,
                "h={h} kvh={kvh} hd={hd} #{i}: {a} vs {b}"
            );
        }
    }

    fn reference(
        shape: &AttnShape,
        seqs: &[AttnSeq<'_>],
        q: &[f32],
        keys: &[f32],
        vals: &[f32],
        rows: usize,
    ) -> Vec<f32> {
        let (h, kvh, hd) = (shape.n_heads, shape.n_kv_heads, shape.head_dim);
        let mut out = vec![0f32; rows * h * hd];
        for s in seqs {
            for i in 0..s.len {
                let row = s.start + i;
                for head in 0..h {
                    let kh = head / (h / kvh);
                    let qv = &q[row * h * hd + head * hd..][..hd];
                    let sc: Vec<f64> = (0..=s.context_len + i)
                        .map(|p| {
                            let k = &keys[s.kv.slot(p) * kvh * hd + kh * hd..][..hd];
                            qv.iter()
                                .zip(k)
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum::<f64>()
                                * shape.scale as f64
                        })
                        .collect();
                    let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = sc.iter().map(|v| (v - mx).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for d in 0..hd {
                        let v: f64 = e
                            .iter()
                            .enumerate()
                            .map(|(p, w)| w * vals[s.kv.slot(p) * kvh * hd + kh * hd + d] as f64)
                            .sum();
                        out[row * h * hd + head * hd + d] = (v / sum) as f32;
                    }
                }
            }
        }
        out
    }

    /// Enough decode rows that each task takes a whole KV head group (also
    /// through the paged mapping); hd 24 takes the generic path.
    #[test]
    fn many_decode_rows_match_reference() {
        let pool = ThreadPool::new(2);
        for &(h, kvh, hd) in &[(9usize, 3usize, 64usize), (4, 2, 32), (6, 2, 24)] {
            let shape = AttnShape {
                n_heads: h,
                n_kv_heads: kvh,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let tables: Vec<Vec<u32>> = (0..8u32).map(|i| vec![i + 1, 20 - i, 9 + i]).collect();
            let seqs: Vec<AttnSeq<'_>> = tables
                .iter()
                .enumerate()
                .map(|(i, t)| AttnSeq {
                    start: i,
                    len: 1,
                    context_len: 3 * i + 2,
                    kv: KvMapping::Blocks {
                        table: t,
                        block_size: 8,
                    },
                })
                .collect();
            let rows = seqs.len();
            let q = values(rows * h * hd, 4);
            let keys = values(200 * kvh * hd, 5);
            let vals = values(200 * kvh * hd, 6);
            check_against_reference(&pool, &shape, &seqs, &q, &keys, &vals, rows);
        }
    }

    #[test]
    fn prefill_blocks_and_decode_rows_match_reference() {
        let pool = ThreadPool::new(2);
        for &(h, kvh, hd) in &[(9usize, 3usize, 64usize), (4, 2, 32), (2, 1, 24)] {
            let shape = AttnShape {
                n_heads: h,
                n_kv_heads: kvh,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            // Sequence A: 37-row prefill after 5 cached tokens, scattered slots; B: one decode row.
            let slots_a: Vec<u32> = (0..42).map(|i| (i * 7 % 97) as u32 + 1).collect();
            let slots_b: Vec<u32> = (0..20).map(|i| 100 + i as u32).collect();
            let seqs = [
                AttnSeq {
                    start: 0,
                    len: 37,
                    context_len: 5,
                    kv: KvMapping::Slots(&slots_a),
                },
                AttnSeq {
                    start: 37,
                    len: 1,
                    context_len: 19,
                    kv: KvMapping::Slots(&slots_b),
                },
            ];
            let rows = 38;
            let q = values(rows * h * hd, 1);
            let keys = values(130 * kvh * hd, 2);
            let vals = values(130 * kvh * hd, 3);
            check_against_reference(&pool, &shape, &seqs, &q, &keys, &vals, rows);
        }
    }

    /// A row's output does not depend on how its sequence's rows are split
    /// into calls (one 40-row prefill; chunks of 1, 5, 16 and 18 rows; 40
    /// decode steps), bit for bit: a request's greedy tokens must not change
    /// with what the scheduler batches beside it. The AVX-512 decode row
    /// kernels sum in another order than the blocks, so there only rows in
    /// blocks (chunks of 16 or more) are compared.
    #[test]
    fn rows_are_bitwise_independent_of_how_calls_split_them() {
        let pool = ThreadPool::new(2);
        #[cfg(target_arch = "x86_64")]
        let exact_rows = |len: usize| {
            len >= ROW_BLOCK || !(isa() == Isa::Avx512 && attention_row::supported(64))
        };
        #[cfg(not(target_arch = "x86_64"))]
        let exact_rows = |_: usize| true;
        for &(h, kvh, hd) in &[(9usize, 3usize, 64usize), (4, 2, 32)] {
            let shape = AttnShape {
                n_heads: h,
                n_kv_heads: kvh,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let (context, total) = (3, 43);
            let slots: Vec<u32> = (0..total).map(|i| (i * 11 % 97) as u32 + 2).collect();
            let width = h * hd;
            let q = values((total - context) * width, 7);
            let keys = values(100 * kvh * hd, 8);
            let vals = values(100 * kvh * hd, 9);
            // Rows context..total in calls of the given lengths.
            let run = |lens: &[usize]| {
                let mut out = vec![f32::NAN; (total - context) * width];
                let mut first = 0;
                for &len in lens {
                    let seq = AttnSeq {
                        start: 0,
                        len,
                        context_len: context + first,
                        kv: KvMapping::Slots(&slots),
                    };
                    let rows = first * width..(first + len) * width;
                    attention(
                        &pool,
                        &shape,
                        &[seq],
                        &q[rows.clone()],
                        width,
                        &keys,
                        &vals,
                        &mut out[rows],
                        None,
                    );
                    first += len;
                }
                assert_eq!(first, total - context);
                out
            };
            let whole = run(&[40]);
            for lens in [vec![1, 5, 16, 18], vec![1; 40], vec![20, 20]] {
                let split = run(&lens);
                let mut first = 0;
                for &len in &lens {
                    if exact_rows(len) {
                        let rows = first * width..(first + len) * width;
                        assert!(
                            whole[rows.clone()]
                                .iter()
                                .zip(&split[rows])
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "hd={hd}: rows {first}..{} differ when run in calls of {lens:?}",
                            first + len
                        );
                    }
                    first += len;
                }
            }
        }
    }

    /// Prefill windows past 64 positions (whole and partial 64-position
    /// chunks of scores), groups of 1 to 5 query heads per KV head (passes
    /// of up to 4 heads and a remainder), head_dim 80 (a 16-wide remainder
    /// in the weighted sum).
    #[test]
    fn prefill_blocks_cover_long_windows_and_head_groups() {
        let pool = ThreadPool::new(2);
        for &(h, kvh, hd) in &[
            (9usize, 3usize, 64usize),
            (10, 2, 32),
            (4, 4, 16),
            (8, 2, 80),
        ] {
            let shape = AttnShape {
                n_heads: h,
                n_kv_heads: kvh,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let slots: Vec<u32> = (0..150).map(|i| (i * 11 % 151) as u32).collect();
            let seqs = [AttnSeq {
                start: 0,
                len: 131,
                context_len: 17,
                kv: KvMapping::Slots(&slots),
            }];
            let rows = 131;
            let q = values(rows * h * hd, 7);
            let keys = values(151 * kvh * hd, 8);
            let vals = values(151 * kvh * hd, 9);
            check_against_reference(&pool, &shape, &seqs, &q, &keys, &vals, rows);
        }
    }
}
