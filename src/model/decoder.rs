//! The decoder on the CPU: its weights in the CPU backend's formats, loaded
//! through the shared loader, and the forward entry points that run the
//! one layer program (`transformer.rs`) over the CPU's ops.

use super::config::ModelConfig;
use super::quant::{QuantMethod, QuantMode, StoredQuant};
use super::runner::NON_FINITE_ROW;
use super::transformer;
use super::weight_upload::{load_decoder, HeadSource, Projection, WeightUpload};
use super::weights::{WeightDType, WeightSource};
use crate::backend::cpu::turns::Turn;
use crate::backend::cpu::{
    CpuFormats, CpuLayerOps, CpuLinear, CpuWeights, ForwardWorkspace, Matrix, MatrixData,
    StepBuffers, ThreadPool,
};
use crate::backend::DecoderDims;
use crate::forward::{check_stop, ForwardBatch, StepStop};
use crate::kv::KvStorage;
use crate::tensor::finite::first_non_finite;
use crate::{bail_arg, Result};
use std::cell::Cell;

pub struct Decoder {
    pub config: ModelConfig,
    dims: DecoderDims,
    weights: CpuWeights,
    /// The linear layers hold FP8 values, dequantized to F32 for the
    /// kernels: reported as "fp8" (saved state must not mistake them for
    /// the F32 checkpoint they may have been quantized from).
    fp8_layers: bool,
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
        // An int4 checkpoint's layers load as stored; `quant` still applies
        // to the layers it keeps dense (e.g. a Q8_0 LM head).
        let stored = config.quantization.as_ref().map(StoredQuant::method);
        let mut up = CpuUpload {
            src,
            dtype,
            stored,
            method: method.as_deref(),
        };
        let weights = load_decoder(&config, src, stored, method.as_deref(), &mut up)?;
        let fp8_layers = matches!(quant, QuantMode::Fp8 { .. })
            || matches!(config.quantization, Some(StoredQuant::Fp8(_)));
        Ok(Decoder {
            dims: config.dims(),
            weights,
            config,
            fp8_layers,
        })
    }

    /// Bytes of weight data one decode step streams (for bandwidth reports).
    pub fn weight_bytes(&self) -> usize {
        let w = &self.weights;
        let layer_bytes: usize = w.layers.iter().map(layer_matrix_bytes).sum();
        // The embedding table is streamed only when it doubles as the LM head;
        // otherwise a step reads one row per token.
        layer_bytes
            + w.lm_head
                .as_ref()
                .map_or(w.embed.size_in_bytes(), CpuLinear::size_in_bytes)
    }

    /// Bytes the weights occupy (every matrix and vector, the embedding
    /// table and a tied LM head once): the budget report's weight figure.
    pub fn resident_bytes(&self) -> usize {
        let w = &self.weights;
        let layers: usize = w
            .layers
            .iter()
            .map(|l| layer_matrix_bytes(l) + l.vectors().map(|v| v.len() * 4).sum::<usize>())
            .sum();
        layers
            + w.embed.size_in_bytes()
            + w.lm_head.as_ref().map_or(0, CpuLinear::size_in_bytes)
            + (w.final_norm.len() + w.rope.len()) * 4
    }

    /// The linear layers' weight format ("f32", "bf16", "q8_0", ...).
    pub fn weight_dtype_name(&self) -> &'static str {
        if self.fp8_layers {
            return "fp8";
        }
        match self.weights.layers.first() {
            Some(l) => l.qkv.dtype_name(),
            None => self.weights.embed.dtype_name(),
        }
    }

    /// The LM head's weight format.
    pub fn lm_head_dtype_name(&self) -> &'static str {
        match &self.weights.lm_head {
            Some(h) => h.dtype_name(),
            None => self.weights.embed.dtype_name(),
        }
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
    /// first index of the largest of the first `choosable` logits of
    /// `batch.logits_rows[i]`, or [`NON_FINITE_ROW`] when they hold a NaN
    /// or infinity. The logits stay in the workspace.
    pub fn forward_argmax(
        &self,
        pool: &ThreadPool,
        batch: &ForwardBatch<'_>,
        kv: &mut KvStorage,
        ws: &mut ForwardWorkspace,
        ids: &mut [u32],
        choosable: usize,
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
            let row = &row[..choosable.min(vocab)];
            *id = match first_non_finite(row) {
                Some(_) => NON_FINITE_ROW,
                None => first_argmax(row),
            };
        }
        Ok(())
    }

    /// The layer program over the CPU's ops, on a validated batch and
    /// buffers sized for it. Fails only when `batch.stop` is raised.
    fn run<'b>(
        &self,
        pool: &ThreadPool,
        batch: &ForwardBatch<'b>,
        kv: &mut KvStorage,
        ws: &mut StepBuffers<'b>,
        logits: &mut [f32],
    ) -> Result<()> {
        let mut ops = CpuLayerOps {
            pool,
            dims: &self.dims,
            batch,
            kv,
            ws,
            logits,
        };
        transformer::forward(&mut ops, &self.weights)
    }

    fn validate(&self, batch: &ForwardBatch<'_>, kv: &KvStorage, logits_len: usize) -> Result<()> {
        let c = &self.config;
        if kv.num_layers != c.num_layers
            || kv.kv_heads != c.num_kv_heads
            || kv.head_dim != c.head_dim
        {
            bail_arg!("KV storage shape does not match the model");
        }
        batch.validate(
            c.vocab_size,
            c.max_position_embeddings,
            kv.num_slots,
            logits_len,
        )
    }
}

/// Bytes of a layer's projection matrices.
fn layer_matrix_bytes(l: &crate::backend::LayerWeights<CpuFormats>) -> usize {
    l.projections().iter().map(|w| w.size_in_bytes()).sum()
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

/// The CPU's side of loading: every matrix in the CPU kernels' layout.
struct CpuUpload<'a> {
    src: &'a dyn WeightSource,
    dtype: WeightDType,
    stored: Option<&'a dyn QuantMethod>,
    method: Option<&'a dyn QuantMethod>,
}

impl WeightUpload for CpuUpload<'_> {
    type Formats = CpuFormats;

    fn projections(&mut self, jobs: &[Projection]) -> Result<Vec<CpuLinear>> {
        jobs.iter()
            .map(|job| {
                let parts = job
                    .parts
                    .iter()
                    .map(|(name, rows)| {
                        linear_matrix(
                            self.src,
                            name,
                            *rows,
                            job.cols,
                            self.dtype,
                            self.stored,
                            self.method,
                        )?
                        .into_cpu_layout()
                    })
                    .collect::<Result<_>>()?;
                Ok(CpuLinear { parts })
            })
            .collect()
    }

    fn vector(&mut self, parts: &[(&str, usize)]) -> Result<Vec<f32>> {
        let mut v = Vec::new();
        for &(name, len) in parts {
            v.extend(self.src.vector(name, len)?);
        }
        Ok(v)
    }

    fn lm_head(&mut self, h: &HeadSource<'_>) -> Result<CpuLinear> {
        let m = linear_matrix(
            self.src, h.name, h.rows, h.cols, self.dtype, h.stored, h.method,
        )?;
        Ok(CpuLinear {
            parts: vec![m.into_cpu_layout()?],
        })
    }

    fn embedding(&mut self, name: &str, rows: usize, cols: usize, is_head: bool) -> Result<Matrix> {
        let embed = self.src.matrix(name, rows, cols, self.dtype)?;
        // Repacked only when it doubles as the LM head (lookups read either layout).
        if is_head {
            embed.into_cpu_layout()
        } else {
            Ok(embed)
        }
    }

    fn rope(&mut self, inv_freq: &[f32]) -> Result<Vec<f32>> {
        Ok(inv_freq.to_vec())
    }
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
