//! Causal grouped-query attention over the slot-indexed KV cache.
//!
//! Each batch row (one token of one sequence) attends to positions
//! `0..=pos` of its own sequence, read through the sequence's `KvMapping`, so
//! the same kernel serves prefill chunks, decode steps and mixed batches over
//! both the paged and the token KV layouts.

use super::ops::softmax_in_place;
use super::threadpool::ThreadPool;
use super::vector::{axpy, dot};
use crate::kv::KvMapping;
use std::cell::RefCell;

/// One sequence's rows in the batch.
#[derive(Clone, Copy)]
pub struct AttnSeq<'a> {
    /// First batch row of this sequence.
    pub start: usize,
    /// Number of rows (new tokens) of this sequence.
    pub len: usize,
    /// Tokens already in the KV cache before these rows (position of the first row).
    pub context_len: usize,
    pub kv: KvMapping<'a>,
}

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

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `out[row, h] = Σ_p softmax(q[row,h]·K[p]·scale) V[p]` over the causal window.
/// `q` has rows of stride `q_stride` whose first `n_heads * head_dim` values
/// are the query; `out` is `[rows, n_heads * head_dim]`; `keys`/`values` are
/// one layer of the KV storage, `[slots, n_kv_heads * head_dim]`.
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
    pool.run(rows * h, &|task| {
        let (row, head) = (task / h, task % h);
        let seq = seqs
            .iter()
            .find(|s| row >= s.start && row < s.start + s.len)
            .expect("row belongs to a sequence");
        let pos = seq.context_len + (row - seq.start);
        let kv_head = head / group;
        let qv = &q[row * q_stride + head * hd..row * q_stride + (head + 1) * hd];
        let out_ptr = out_ptr;
        // SAFETY: (row, head) is unique to this task, so this slice is written by nobody else.
        let ov =
            unsafe { std::slice::from_raw_parts_mut(out_ptr.0.add(row * q_width + head * hd), hd) };
        SCORES.with(|scores| {
            let mut scores = scores.borrow_mut();
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
    });
}
