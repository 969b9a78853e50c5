//! The CPU's [`LayerOps`]: each op runs at once on the thread pool, over
//! f32 activations in the step's workspace buffers and f32 KV storage.

use super::attention::{attention, AttnShape};
use super::ops::{add_in_place, apply_rope, rms_norm, rms_norm_in_place, silu_mul};
use super::workspace::StepBuffers;
use super::{matmul, Matrix, ThreadPool};
use crate::backend::layer_ops::{
    Activations, DecoderDims, DecoderWeights, LayerKv, LayerOps, LayerWeights, LmHead,
    WeightFormats,
};
use crate::forward::{check_stop, ForwardBatch};
use crate::Result;

/// A projection on the CPU: its parts stacked by rows (q, k and v stay
/// three matrices; `matmul` writes their outputs side by side, as one
/// product over the stacked matrix would).
pub struct CpuLinear {
    pub parts: Vec<Matrix>,
}

impl CpuLinear {
    /// `f` over the parts as `matmul` takes them, without allocating (a
    /// decode step must not touch the allocator).
    pub fn with_parts<R>(&self, f: impl FnOnce(&[&Matrix]) -> R) -> R {
        match self.parts.as_slice() {
            [a] => f(&[a]),
            [a, b] => f(&[a, b]),
            [a, b, c] => f(&[a, b, c]),
            parts => f(&parts.iter().collect::<Vec<_>>()),
        }
    }

    pub fn size_in_bytes(&self) -> usize {
        self.parts.iter().map(Matrix::size_in_bytes).sum()
    }

    /// The weight format's name ("f32", "bf16", "q8_0", ...).
    pub fn dtype_name(&self) -> &'static str {
        self.parts.first().map_or("f32", |m| m.dtype_name())
    }
}

/// The CPU's weight formats: projections as [`CpuLinear`], vectors and
/// the RoPE frequencies as f32, the embedding table as a [`Matrix`].
pub struct CpuFormats;

impl WeightFormats for CpuFormats {
    type Weight = CpuLinear;
    type Vector = Vec<f32>;
    type Embedding = Matrix;
    type Rope = Vec<f32>;
}

/// A decoder's weights on the CPU.
pub type CpuWeights = DecoderWeights<CpuFormats>;

impl From<&DecoderDims> for AttnShape {
    fn from(d: &DecoderDims) -> Self {
        AttnShape {
            n_heads: d.heads,
            n_kv_heads: d.kv_heads,
            head_dim: d.head_dim,
            scale: d.attn_scale(),
        }
    }
}

/// One CPU forward step: the batch, its KV cache and workspace, and where
/// the logits go.
pub struct CpuLayerOps<'s, 'b> {
    pub pool: &'s ThreadPool,
    pub dims: &'s DecoderDims,
    pub batch: &'s ForwardBatch<'b>,
    pub kv: &'s mut dyn LayerKv,
    pub ws: &'s mut StepBuffers<'b>,
    /// `[logits_rows, vocab]`.
    pub logits: &'s mut [f32],
}

impl CpuLayerOps<'_, '_> {
    fn rows(&self) -> usize {
        self.batch.tokens.len()
    }

    /// cos/sin of every row's position, `[rows, head_dim/2]` each.
    fn rope_tables(&mut self, inv_freq: &[f32]) {
        let half = inv_freq.len();
        for s in self.batch.seqs {
            for i in 0..s.len {
                let row = s.start + i;
                let pos = (s.context_len + i) as f32;
                for (j, &f) in inv_freq.iter().enumerate() {
                    let angle = f * pos;
                    self.ws.cos[row * half + j] = angle.cos();
                    self.ws.sin[row * half + j] = angle.sin();
                }
            }
        }
    }
}

impl LayerOps for CpuLayerOps<'_, '_> {
    type Formats = CpuFormats;
    /// The normed rows are in the workspace's `normed` buffer.
    type Normed = ();

    fn embed(&mut self, w: &CpuWeights) -> Result<()> {
        let d = self.dims.hidden;
        for (row, &tok) in self.batch.tokens.iter().enumerate() {
            w.embed
                .row_to_f32(tok as usize, &mut self.ws.hidden[row * d..(row + 1) * d]);
        }
        self.rope_tables(&w.rope);
        Ok(())
    }

    fn norm(&mut self, _index: usize, weight: &Vec<f32>, _reader: &CpuLinear) -> Result<()> {
        let n = self.rows() * self.dims.hidden;
        rms_norm(
            &self.ws.hidden[..n],
            weight,
            self.dims.rms_norm_eps,
            &mut self.ws.normed[..n],
        );
        Ok(())
    }

    fn qkv_rope_kv_write(
        &mut self,
        layer: usize,
        _x: (),
        w: &LayerWeights<CpuFormats>,
    ) -> Result<()> {
        let (rows, dims) = (self.rows(), self.dims);
        let (hd, nq, nkv) = (dims.head_dim, dims.q_width(), dims.kv_width());
        let width = dims.qkv_width();
        let ws = &mut *self.ws;
        let qkv = &mut ws.qkv[..rows * width];
        w.qkv
            .with_parts(|parts| matmul(self.pool, ws.normed, rows, parts, qkv));
        let half = hd / 2;
        for (row, r) in qkv.chunks_exact_mut(width).enumerate() {
            if let Some(b) = &w.qkv_bias {
                add_in_place(r, b);
            }
            let (q, rest) = r.split_at_mut(nq);
            let k = &mut rest[..nkv];
            if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
                rms_norm_in_place(q, qn, dims.rms_norm_eps);
                rms_norm_in_place(k, kn, dims.rms_norm_eps);
            }
            let cos = &ws.cos[row * half..(row + 1) * half];
            let sin = &ws.sin[row * half..(row + 1) * half];
            apply_rope(q, hd, cos, sin);
            apply_rope(k, hd, cos, sin);
        }
        let (keys, values) = self.kv.layer_mut(layer);
        for s in self.batch.seqs {
            for i in 0..s.len {
                let r = &qkv[(s.start + i) * width..(s.start + i + 1) * width];
                let slot = s.kv.slot(s.context_len + i);
                keys[slot * nkv..(slot + 1) * nkv].copy_from_slice(&r[nq..nq + nkv]);
                values[slot * nkv..(slot + 1) * nkv].copy_from_slice(&r[nq + nkv..]);
            }
        }
        Ok(())
    }

    fn attend(&mut self, layer: usize) -> Result<()> {
        let (rows, dims) = (self.rows(), self.dims);
        let (keys, values) = self.kv.layer_mut(layer);
        attention(
            self.pool,
            &AttnShape::from(dims),
            self.batch.seqs,
            &self.ws.qkv[..rows * dims.qkv_width()],
            dims.qkv_width(),
            keys,
            values,
            &mut self.ws.attn[..rows * dims.q_width()],
            self.batch.stop.map(|s| s.cancel),
        );
        Ok(())
    }

    fn add_product(
        &mut self,
        x: Activations,
        w: &CpuLinear,
        bias: Option<&Vec<f32>>,
        _next_norm: Option<(usize, &Vec<f32>)>,
    ) -> Result<()> {
        let (rows, d) = (self.rows(), self.dims.hidden);
        let ws = &mut *self.ws;
        let input: &[f32] = match x {
            Activations::Attention => ws.attn,
            Activations::SwiGlu => ws.act,
        };
        let proj = &mut ws.proj[..rows * d];
        w.with_parts(|parts| matmul(self.pool, input, rows, parts, proj));
        if let Some(b) = bias {
            proj.chunks_exact_mut(d).for_each(|r| add_in_place(r, b));
        }
        add_in_place(&mut ws.hidden[..rows * d], proj);
        Ok(())
    }

    fn gate_up_swiglu(&mut self, _x: (), gate_up: &CpuLinear, _down: &CpuLinear) -> Result<()> {
        let (rows, inter) = (self.rows(), self.dims.intermediate);
        let ws = &mut *self.ws;
        let gu = &mut ws.gate_up[..rows * 2 * inter];
        gate_up.with_parts(|parts| matmul(self.pool, ws.normed, rows, parts, gu));
        swiglu_rows(self.pool, gu, inter, &mut ws.act[..rows * inter]);
        Ok(())
    }

    fn logits(&mut self, final_norm: &Vec<f32>, head: LmHead<'_, CpuFormats>) -> Result<()> {
        let n_out = self.batch.logits_rows.len();
        if n_out == 0 {
            return Ok(());
        }
        let (d, vocab) = (self.dims.hidden, self.dims.vocab);
        let ws = &mut *self.ws;
        for (i, &row) in self.batch.logits_rows.iter().enumerate() {
            ws.selected[i * d..(i + 1) * d].copy_from_slice(&ws.hidden[row * d..(row + 1) * d]);
        }
        rms_norm(
            &ws.selected[..n_out * d],
            final_norm,
            self.dims.rms_norm_eps,
            &mut ws.normed[..n_out * d],
        );
        let logits = &mut self.logits[..n_out * vocab];
        match head {
            LmHead::Own(w) => {
                w.with_parts(|parts| matmul(self.pool, ws.normed, n_out, parts, logits))
            }
            LmHead::Tied(table) => matmul(self.pool, ws.normed, n_out, &[table], logits),
        }
        Ok(())
    }

    fn poll_stop(&self) -> Result<()> {
        check_stop(self.batch.stop)
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
