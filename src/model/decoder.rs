//! The decoder-only transformer shared by Llama, Qwen2 and Qwen3:
//! embedding → N × (RMSNorm, GQA attention with RoPE, RMSNorm, SwiGLU MLP) →
//! RMSNorm → LM head, computed for a `ForwardBatch` of mixed sequences.

use super::config::ModelConfig;
use super::quant::{QuantMethod, QuantMode};
use super::runner::{validate_batch, NON_FINITE_ROW};
use super::weights::{WeightDType, WeightSource};
use super::workspace::{ForwardWorkspace, StepBuffers};
use crate::backend::cpu::attention::{attention, AttnShape};
use crate::backend::cpu::ops::{add_in_place, apply_rope, rms_norm, rms_norm_in_place, silu_mul};
use crate::backend::cpu::turns::Turn;
use crate::backend::cpu::{matmul, Matrix, MatrixData, ThreadPool};
use crate::forward::{check_stop, ForwardBatch, StepStop};
use crate::kv::KvStorage;
use crate::tensor::finite::first_non_finite;
use crate::{bail_arg, Result};
use std::cell::Cell;

struct Layer {
    input_norm: Vec<f32>,
    q: Matrix,
    k: Matrix,
    v: Matrix,
    /// q, k and v biases concatenated, when the architecture has them.
    qkv_bias: Option<Vec<f32>>,
    o: Matrix,
    o_bias: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    post_norm: Vec<f32>,
    gate: Matrix,
    up: Matrix,
    down: Matrix,
}

impl Layer {
    /// Bytes of the layer's projection matrices.
    fn matrix_bytes(&self) -> usize {
        [
            &self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down,
        ]
        .iter()
        .map(|m| m.size_in_bytes())
        .sum()
    }
}

pub struct Decoder {
    pub config: ModelConfig,
    embed: Matrix,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    /// None when tied to the embedding.
    lm_head: Option<Matrix>,
    inv_freq: Vec<f32>,
}

/// The attention geometry of a model.
pub(crate) fn attn_shape(c: &ModelConfig) -> AttnShape {
    AttnShape {
        n_heads: c.num_heads,
        n_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        scale: 1.0 / (c.head_dim as f32).sqrt(),
    }
}

impl Decoder {
    /// Loads the weights; `quant` quantizes the dense linear layers (and the
    /// LM head when its method says so) at load.
    pub fn load(
        config: ModelConfig,
        src: &dyn WeightSource,
        dtype: WeightDType,
        quant: QuantMode,
    ) -> Result<Decoder> {
        let method = quant.method()?;
        let method = method.as_deref();
        let c = &config;
        // An int4 checkpoint's layers load as stored; `quant` still applies
        // to the layers it keeps dense (e.g. a Q8_0 LM head).
        let stored = c.quantization.as_ref().map(|q| q as &dyn QuantMethod);
        let (d, hd) = (c.hidden_size, c.head_dim);
        let (nq, nkv) = (c.num_heads * hd, c.num_kv_heads * hd);
        let linear = |name: &str, rows: usize, cols: usize| {
            load_linear(src, name, rows, cols, dtype, stored, method)
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            let qkv_bias = if c.qkv_bias {
                let mut b = src.vector(&format!("{p}.self_attn.q_proj.bias"), nq)?;
                b.extend(src.vector(&format!("{p}.self_attn.k_proj.bias"), nkv)?);
                b.extend(src.vector(&format!("{p}.self_attn.v_proj.bias"), nkv)?);
                Some(b)
            } else {
                None
            };
            let opt = |name: &str, len: usize, on: bool| -> Result<Option<Vec<f32>>> {
                if on {
                    src.vector(&format!("{p}.{name}"), len).map(Some)
                } else {
                    Ok(None)
                }
            };
            let inter = c.intermediate_size;
            layers.push(Layer {
                input_norm: src.vector(&format!("{p}.input_layernorm.weight"), d)?,
                q: linear(&format!("{p}.self_attn.q_proj.weight"), nq, d)?,
                k: linear(&format!("{p}.self_attn.k_proj.weight"), nkv, d)?,
                v: linear(&format!("{p}.self_attn.v_proj.weight"), nkv, d)?,
                qkv_bias,
                o: linear(&format!("{p}.self_attn.o_proj.weight"), d, nq)?,
                o_bias: opt("self_attn.o_proj.bias", d, c.o_bias)?,
                q_norm: opt("self_attn.q_norm.weight", hd, c.qk_norm)?,
                k_norm: opt("self_attn.k_norm.weight", hd, c.qk_norm)?,
                post_norm: src.vector(&format!("{p}.post_attention_layernorm.weight"), d)?,
                gate: linear(&format!("{p}.mlp.gate_proj.weight"), inter, d)?,
                up: linear(&format!("{p}.mlp.up_proj.weight"), inter, d)?,
                down: linear(&format!("{p}.mlp.down_proj.weight"), d, inter)?,
            });
        }
        let embed_name = "model.embed_tokens.weight";
        let head_method = method.filter(|m| m.quantizes_lm_head());
        let lm_head = if has_own_lm_head(src, c, stored) {
            Some(load_linear(
                src,
                "lm_head.weight",
                c.vocab_size,
                d,
                dtype,
                stored,
                head_method,
            )?)
        } else if head_method.is_some() {
            // Tied: the head gets its own quantized copy, lookups stay dense.
            Some(load_linear(
                src,
                embed_name,
                c.vocab_size,
                d,
                dtype,
                None,
                head_method,
            )?)
        } else {
            None
        };
        let embed = src.matrix(embed_name, c.vocab_size, d, dtype)?;
        // Repacked only when it doubles as the LM head (lookups read either layout).
        let embed = if lm_head.is_none() {
            embed.into_cpu_layout()?
        } else {
            embed
        };
        Ok(Decoder {
            embed,
            layers,
            final_norm: src.vector("model.norm.weight", d)?,
            lm_head,
            inv_freq: config.rope_inv_freq(),
            config,
        })
    }

    /// Bytes of weight data one decode step streams (for bandwidth reports).
    pub fn weight_bytes(&self) -> usize {
        let layer_bytes: usize = self.layers.iter().map(Layer::matrix_bytes).sum();
        // The embedding table is streamed only when it doubles as the LM head;
        // otherwise a step reads one row per token.
        layer_bytes + self.lm_head.as_ref().unwrap_or(&self.embed).size_in_bytes()
    }

    /// Bytes the weights occupy (every matrix and vector, the embedding
    /// table and a tied LM head once): the budget report's weight figure.
    pub fn resident_bytes(&self) -> usize {
        let vec_bytes = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, |v| v.len() * 4);
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.matrix_bytes()
                    + (l.input_norm.len() + l.post_norm.len()) * 4
                    + vec_bytes(&l.qkv_bias)
                    + vec_bytes(&l.o_bias)
                    + vec_bytes(&l.q_norm)
                    + vec_bytes(&l.k_norm)
            })
            .sum();
        layers
            + self.embed.size_in_bytes()
            + self.lm_head.as_ref().map_or(0, |m| m.size_in_bytes())
            + (self.final_norm.len() + self.inv_freq.len()) * 4
    }

    /// The linear layers' weight format ("f32", "bf16", "q8_0", ...).
    pub fn weight_dtype_name(&self) -> &'static str {
        self.layers
            .first()
            .map_or(&self.embed, |l| &l.q)
            .dtype_name()
    }

    /// The LM head's weight format.
    pub fn lm_head_dtype_name(&self) -> &'static str {
        self.lm_head.as_ref().unwrap_or(&self.embed).dtype_name()
    }

    /// Runs the batch, writes its keys/values into `kv` and the logits of
    /// `batch.logits_rows` into `logits` (`[logits_rows.len(), vocab]`).
    /// Every temporary comes from `ws`.
    pub fn forward(
        &self,
        pool: &ThreadPool,
        batch: &ForwardBatch<'_>,
        kv: &mut KvStorage,
        ws: &mut ForwardWorkspace,
        logits: &mut [f32],
    ) -> Result<()> {
        self.validate(batch, kv, logits.len())?;
        let _turn = take_turn(pool, batch.stop)?;
        let mut b = ws.step(batch.tokens.len(), batch.logits_rows.len(), 0)?;
        self.run(pool, batch, kv, &mut b, logits)
    }

    /// Like `forward`, for plain greedy decoding: writes `ids[i]` = the
    /// first index of the largest logit of `batch.logits_rows[i]`, or
    /// [`NON_FINITE_ROW`] when that row holds a NaN or infinity. The
    /// logits stay in the workspace.
    pub fn forward_argmax(
        &self,
        pool: &ThreadPool,
        batch: &ForwardBatch<'_>,
        kv: &mut KvStorage,
        ws: &mut ForwardWorkspace,
        ids: &mut [u32],
    ) -> Result<()> {
        let vocab = self.config.vocab_size;
        let n_out = batch.logits_rows.len();
        if ids.len() < n_out {
            bail_arg!(
                "argmax output has {} entries for {n_out} logits rows",
                ids.len()
            );
        }
        self.validate(batch, kv, n_out * vocab)?;
        let _turn = take_turn(pool, batch.stop)?;
        let mut b = ws.step(batch.tokens.len(), n_out, n_out * vocab)?;
        let logits = std::mem::take(&mut b.logits);
        self.run(pool, batch, kv, &mut b, logits)?;
        for (id, row) in ids.iter_mut().zip(logits.chunks_exact(vocab)) {
            *id = match first_non_finite(row) {
                Some(_) => NON_FINITE_ROW,
                None => first_argmax(row),
            };
        }
        Ok(())
    }

    /// The forward itself, on a validated batch and buffers sized for it.
    /// Fails only when `batch.stop` is raised.
    fn run(
        &self,
        pool: &ThreadPool,
        batch: &ForwardBatch<'_>,
        kv: &mut KvStorage,
        ws: &mut StepBuffers<'_>,
        logits: &mut [f32],
    ) -> Result<()> {
        let c = &self.config;
        let rows = batch.tokens.len();
        let (d, hd, inter) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (nq, nkv) = (c.num_heads * hd, c.num_kv_heads * hd);
        let qkv_width = nq + 2 * nkv;

        for (row, &tok) in batch.tokens.iter().enumerate() {
            self.embed
                .row_to_f32(tok as usize, &mut ws.hidden[row * d..(row + 1) * d]);
        }
        self.rope_tables(batch, ws);

        let shape = attn_shape(c);
        for (li, layer) in self.layers.iter().enumerate() {
            // Polled three times a layer (attention, then the two halves of
            // the MLP, are its costly parts) so a stop takes effect well
            // within one layer's time.
            check_stop(batch.stop)?;
            rms_norm(
                &ws.hidden[..rows * d],
                &layer.input_norm,
                c.rms_norm_eps,
                &mut ws.normed[..rows * d],
            );
            let qkv = &mut ws.qkv[..rows * qkv_width];
            matmul(pool, ws.normed, rows, &[&layer.q, &layer.k, &layer.v], qkv);
            for row in 0..rows {
                let r = &mut qkv[row * qkv_width..(row + 1) * qkv_width];
                if let Some(b) = &layer.qkv_bias {
                    add_in_place(r, b);
                }
                let (q, rest) = r.split_at_mut(nq);
                let k = &mut rest[..nkv];
                if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                    rms_norm_in_place(q, qn, c.rms_norm_eps);
                    rms_norm_in_place(k, kn, c.rms_norm_eps);
                }
                let half = hd / 2;
                let (cos, sin) = (
                    &ws.cos[row * half..(row + 1) * half],
                    &ws.sin[row * half..(row + 1) * half],
                );
                apply_rope(q, hd, cos, sin);
                apply_rope(k, hd, cos, sin);
            }
            let (keys, values) = kv.layer_mut(li);
            for s in batch.seqs {
                for i in 0..s.len {
                    let r = &qkv[(s.start + i) * qkv_width..(s.start + i + 1) * qkv_width];
                    let slot = s.kv.slot(s.context_len + i);
                    keys[slot * nkv..(slot + 1) * nkv].copy_from_slice(&r[nq..nq + nkv]);
                    values[slot * nkv..(slot + 1) * nkv].copy_from_slice(&r[nq + nkv..]);
                }
            }
            attention(
                pool,
                &shape,
                batch.seqs,
                qkv,
                qkv_width,
                keys,
                values,
                &mut ws.attn[..rows * nq],
                batch.stop.map(|s| s.cancel),
            );
            check_stop(batch.stop)?;
            matmul(pool, ws.attn, rows, &[&layer.o], &mut ws.proj[..rows * d]);
            if let Some(b) = &layer.o_bias {
                ws.proj[..rows * d]
                    .chunks_exact_mut(d)
                    .for_each(|r| add_in_place(r, b));
            }
            add_in_place(&mut ws.hidden[..rows * d], &ws.proj[..rows * d]);

            rms_norm(
                &ws.hidden[..rows * d],
                &layer.post_norm,
                c.rms_norm_eps,
                &mut ws.normed[..rows * d],
            );
            matmul(
                pool,
                ws.normed,
                rows,
                &[&layer.gate, &layer.up],
                &mut ws.gate_up[..rows * 2 * inter],
            );
            swiglu_rows(
                pool,
                &ws.gate_up[..rows * 2 * inter],
                inter,
                &mut ws.act[..rows * inter],
            );
            check_stop(batch.stop)?;
            matmul(pool, ws.act, rows, &[&layer.down], &mut ws.proj[..rows * d]);
            add_in_place(&mut ws.hidden[..rows * d], &ws.proj[..rows * d]);
        }

        let n_out = batch.logits_rows.len();
        if n_out > 0 {
            for (i, &row) in batch.logits_rows.iter().enumerate() {
                ws.selected[i * d..(i + 1) * d].copy_from_slice(&ws.hidden[row * d..(row + 1) * d]);
            }
            rms_norm(
                &ws.selected[..n_out * d],
                &self.final_norm,
                c.rms_norm_eps,
                &mut ws.normed[..n_out * d],
            );
            let head = self.lm_head.as_ref().unwrap_or(&self.embed);
            matmul(
                pool,
                ws.normed,
                n_out,
                &[head],
                &mut logits[..n_out * c.vocab_size],
            );
        }
        Ok(())
    }

    fn validate(&self, batch: &ForwardBatch<'_>, kv: &KvStorage, logits_len: usize) -> Result<()> {
        let c = &self.config;
        if kv.num_layers != c.num_layers
            || kv.kv_heads != c.num_kv_heads
            || kv.head_dim != c.head_dim
        {
            bail_arg!("KV storage shape does not match the model");
        }
        validate_batch(c, batch, kv.num_slots, logits_len)
    }

    /// cos/sin of every row's position, `[rows, head_dim/2]` each.
    fn rope_tables(&self, batch: &ForwardBatch<'_>, ws: &mut StepBuffers<'_>) {
        let half = self.inv_freq.len();
        for s in batch.seqs {
            for i in 0..s.len {
                let row = s.start + i;
                let pos = (s.context_len + i) as f32;
                for (j, &f) in self.inv_freq.iter().enumerate() {
                    let angle = f * pos;
                    ws.cos[row * half + j] = angle.cos();
                    ws.sin[row * half + j] = angle.sin();
                }
            }
        }
    }
}

/// The forward's turn on the pool the sessions of a model share; a stop
/// raised while waiting ends the wait with its error.
fn take_turn<'p>(pool: &'p ThreadPool, stop: Option<&StepStop<'_>>) -> Result<Turn<'p>> {
    let stopped = Cell::new(None);
    let give_up = || match check_stop(stop) {
        Ok(()) => false,
        Err(e) => {
            stopped.set(Some(e));
            true
        }
    };
    pool.take_turn(&give_up)
        .ok_or_else(|| stopped.take().expect("a turn is given up only on a stop"))
}

/// A linear layer's weight in the CPU kernels' layout (see [`linear_matrix`]).
#[allow(clippy::too_many_arguments)]
fn load_linear(
    src: &dyn WeightSource,
    name: &str,
    rows: usize,
    cols: usize,
    dtype: WeightDType,
    stored: Option<&dyn QuantMethod>,
    method: Option<&dyn QuantMethod>,
) -> Result<Matrix> {
    linear_matrix(src, name, rows, cols, dtype, stored, method)?.into_cpu_layout()
}

/// Whether the model has an LM head of its own rather than the embedding
/// table: untied, or a tied checkpoint that stores a quantized copy (GPTQ's
/// `lm_head: true`, our q8_0 writer).
pub(super) fn has_own_lm_head(
    src: &dyn WeightSource,
    c: &ModelConfig,
    stored: Option<&dyn QuantMethod>,
) -> bool {
    const HEAD: &str = "lm_head.weight";
    !c.tie_word_embeddings
        || src.contains(HEAD)
        || stored.is_some_and(|m| m.quantizes_lm_head() && src.stores_quantized(m, HEAD))
}

/// A linear layer's weight: as stored (quantized checkpoints stay
/// quantized; `stored` is the int4 format config.json names), else
/// quantized by `method` when there is one, else dense in `dtype`.
#[allow(clippy::too_many_arguments)]
pub(super) fn linear_matrix(
    src: &dyn WeightSource,
    name: &str,
    rows: usize,
    cols: usize,
    dtype: WeightDType,
    stored: Option<&dyn QuantMethod>,
    method: Option<&dyn QuantMethod>,
) -> Result<Matrix> {
    if let Some(stored) = stored {
        if let Some(m) = src.quantized(stored, name, rows, cols)? {
            return Ok(m);
        }
    }
    let Some(method) = method else {
        return src.matrix(name, rows, cols, dtype);
    };
    let m = src.matrix(name, rows, cols, WeightDType::F32)?;
    match &m.data {
        MatrixData::F32(w) => method.quantize(rows, cols, w),
        _ => Ok(m),
    }
}

/// act[r] = silu(gate[r]) · up[r] for rows of `[gate | up]`, split over threads.
fn swiglu_rows(pool: &ThreadPool, gate_up: &[f32], inter: usize, act: &mut [f32]) {
    let rows = act.len() / inter;
    let per_task = 8;
    let tasks = rows.div_ceil(per_task);
    let act_ptr = ActPtr(act.as_mut_ptr());
    pool.run(tasks, &|t| {
        for r in t * per_task..((t + 1) * per_task).min(rows) {
            let (g, u) = gate_up[r * 2 * inter..(r + 1) * 2 * inter].split_at(inter);
            // SAFETY: row r of `act` is written by this task only.
            let out =
                unsafe { std::slice::from_raw_parts_mut(act_ptr.get().add(r * inter), inter) };
            silu_mul(g, u, out);
        }
    });
}

#[derive(Clone, Copy)]
struct ActPtr(*mut f32);
// SAFETY: tasks write disjoint rows.
unsafe impl Send for ActPtr {}
unsafe impl Sync for ActPtr {}

impl ActPtr {
    /// Through a method, so closures capture the whole (Sync) wrapper.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Index of the first largest value (NaNs never win; a NaN in front, with
/// nothing compared against it, is returned as 0).
pub(crate) fn first_argmax(row: &[f32]) -> u32 {
    // The result of the plain scan `if x > row[best] { best = i }`, in two
    // passes that vectorize: the largest value, then its first index.
    const LANES: usize = 16;
    match row.first() {
        None => return 0,
        Some(x) if x.is_nan() => return 0,
        _ => {}
    }
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for c in chunks {
        let c: &[f32; LANES] = c.try_into().expect("exact chunk");
        for (m, &x) in lanes.iter_mut().zip(c) {
            // A select, not a branch, so the loop becomes vector max ops.
            *m = if x > *m { x } else { *m };
        }
    }
    let best = lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    // row[0] is not NaN, so `best` >= row[0] and occurs in the row.
    let chunks = row.chunks_exact(LANES);
    let tail_start = row.len() - chunks.remainder().len();
    for (ci, c) in chunks.enumerate() {
        let c: &[f32; LANES] = c.try_into().expect("exact chunk");
        if c.iter().fold(false, |hit, &x| hit | (x == best)) {
            let i = c.iter().position(|&x| x == best).unwrap_or(0);
            return (ci * LANES + i) as u32;
        }
    }
    let i = row[tail_start..].iter().position(|&x| x == best);
    (tail_start + i.unwrap_or(0)) as u32
}

#[cfg(test)]
mod tests {
    use super::first_argmax;

    /// The plain scan the vectorized version must reproduce.
    fn scan(row: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &x) in row.iter().enumerate() {
            if x > row[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_matches_the_plain_scan() {
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        let mut cases: Vec<Vec<f32>> = vec![
            vec![],
            vec![1.0],
            vec![nan, 5.0, 7.0],
            vec![-inf, -inf],
            vec![-inf, nan, -inf],
            vec![-0.0, 0.0, 0.0],
            vec![-1.0, 0.0, -0.0],
            vec![3.0, nan, 3.0, inf, 2.0, inf],
        ];
        let mut s = 12345u32;
        for len in [15usize, 16, 17, 33, 100, 49152] {
            let row: Vec<f32> = (0..len)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 17;
                    s ^= s << 5;
                    // Few distinct values, so ties are common.
                    (s % 50) as f32 - 25.0
                })
                .collect();
            let mut with_nan = row.clone();
            with_nan[len / 2] = nan;
            cases.push(row);
            cases.push(with_nan);
        }
        for row in &cases {
            assert_eq!(
                first_argmax(row),
                scan(row),
                "{:?}",
                &row[..row.len().min(20)]
            );
        }
    }
}
