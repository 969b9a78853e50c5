//! Model evaluation without the scheduler: perplexity and greedy decoding
//! with per-step logits, over a private contiguous KV cache.

use super::model::Model;
use crate::forward::AttnSeq;
use crate::kv::{KvCacheDType, KvMapping};
use crate::memory::MemoryPoolKind;
use crate::model::{ContextShape, ForwardBatch, ForwardContext};
use crate::{bail_arg, Result};

/// Rows per forward pass; bounds the logits buffer.
const CHUNK: usize = 128;

/// A single sequence's private KV cache with slots 1..=capacity in order:
/// forwards without the scheduler (evaluation, benchmarks).
pub struct SingleSequence {
    ctx: Box<dyn ForwardContext>,
    slots: Vec<u32>,
    /// Logits rows of the current forward, reused.
    rows: Vec<usize>,
}

impl SingleSequence {
    /// Room for `capacity` positions, forwards of up to `max_rows` tokens.
    pub fn new(model: &Model, capacity: usize, max_rows: usize) -> Result<Self> {
        let gpu = model.decoder.device() != crate::backend::Device::Cpu;
        let pool = MemoryPoolKind::default_for(gpu);
        Self::with_options(model, capacity, max_rows, pool, KvCacheDType::Auto)
    }

    /// Like `new`, taking the step temporaries from a pool of `pool` and
    /// keeping a KV cache of `kv_dtype`.
    pub fn with_options(
        model: &Model,
        capacity: usize,
        max_rows: usize,
        pool: MemoryPoolKind,
        kv_dtype: KvCacheDType,
    ) -> Result<Self> {
        let mut shape = ContextShape::new(capacity + 1, max_rows, max_rows);
        shape.memory_pool = pool;
        shape.kv_dtype = kv_dtype;
        Ok(SingleSequence {
            ctx: model.decoder.clone().new_context(&shape)?,
            slots: (1..=capacity as u32).collect(),
            rows: Vec::new(),
        })
    }

    /// The step workspace's figures (CPU).
    pub fn workspace_stats(&self) -> Option<crate::model::WorkspaceStats> {
        self.ctx.workspace_stats()
    }

    /// Runs `tokens` at positions `context_len..`, writing logits of every
    /// row when `all_logits`, else of the last row only.
    pub fn forward(
        &mut self,
        model: &Model,
        tokens: &[u32],
        context_len: usize,
        all_logits: bool,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let vocab = model.config().vocab_size;
        let rows = &mut self.rows;
        rows.clear();
        if all_logits {
            rows.extend(0..tokens.len());
        } else {
            rows.extend(tokens.len().checked_sub(1));
        }
        logits.resize(rows.len() * vocab, 0.0);
        let seqs = [AttnSeq {
            start: 0,
            len: tokens.len(),
            context_len,
            kv: KvMapping::Slots(&self.slots),
        }];
        let batch = ForwardBatch {
            tokens,
            seqs: &seqs,
            logits_rows: rows,
            stop: None,
        };
        self.ctx.forward(&batch, logits)
    }
}

/// exp of the mean next-token negative log-likelihood over `ids` (what
/// transformers computes with `labels=input_ids`).
pub fn perplexity(model: &Model, ids: &[u32]) -> Result<f64> {
    if ids.len() < 2 {
        bail_arg!("perplexity needs at least 2 tokens, got {}", ids.len());
    }
    let context = model.config().max_position_embeddings;
    if ids.len() > context {
        bail_arg!(
            "perplexity over {} tokens exceeds the model's context length {context}",
            ids.len()
        );
    }
    let vocab = model.config().vocab_size;
    let mut cache = SingleSequence::new(model, ids.len(), CHUNK)?;
    let mut logits = Vec::new();
    let mut nll = 0f64;
    for start in (0..ids.len() - 1).step_by(CHUNK) {
        let len = CHUNK.min(ids.len() - 1 - start);
        cache.forward(model, &ids[start..start + len], start, true, &mut logits)?;
        for r in 0..len {
            let row = &logits[r * vocab..(r + 1) * vocab];
            nll += log_sum_exp(row) - row[ids[start + r + 1] as usize] as f64;
        }
    }
    Ok((nll / (ids.len() - 1) as f64).exp())
}

fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    max + row
        .iter()
        .map(|&v| (v as f64 - max).exp())
        .sum::<f64>()
        .ln()
}

/// Greedy decoding of `n` tokens after `prompt` (no EOS stop), returning the
/// tokens and the logits row each was chosen from.
pub fn greedy_with_logits(
    model: &Model,
    prompt: &[u32],
    n: usize,
) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
    if prompt.is_empty() {
        bail_arg!("prompt is empty");
    }
    let mut cache = SingleSequence::new(model, prompt.len() + n, prompt.len().max(1))?;
    let mut logits = Vec::new();
    let (mut out, mut rows) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let mut pos = 0;
    let mut next: Vec<u32> = prompt.to_vec();
    for _ in 0..n {
        cache.forward(model, &next, pos, false, &mut logits)?;
        pos += next.len();
        let tok = argmax(&logits);
        out.push(tok);
        rows.push(logits.clone());
        next = vec![tok];
    }
    Ok((out, rows))
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}
