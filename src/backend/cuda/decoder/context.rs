//! One session's state on the GPU ([`CudaForward`]): its KV cache and
//! workspace, the step inputs it uploads, CUDA graphs of decode steps,
//! launches that overlap the host, and where a step's result goes.

use super::ops::enqueue;

use super::workspace::Workspace;
use super::{
    CudaModel, ACT_BYTES, ARGMAX_SPLITS, ATTN_BLOCKS_PER_SM, ATTN_GROUP, MAX_SPLITS,
    MIN_SPLIT_POSITIONS,
};
use crate::backend::cuda::{self, DeviceBuffer, Graph, KArg, PendingIds};
use crate::forward::{DeviceSampling, ForwardBatch, KvCacheDType, MaskFill};
use crate::memory::{DevicePool, MemoryPoolKind, WorkspaceStats};
use crate::{bail_arg, Error, ErrorKind, Result};
use std::collections::HashMap;
use std::sync::Arc;

/// One session's KV cache and workspace on the GPU.
pub struct CudaForward {
    pub(super) model: Arc<CudaModel>,
    pub(super) slots: usize,
    pub(super) max_rows: usize,
    pub(super) max_logits_rows: usize,
    /// Ids the device may choose (`ContextShape::choosable_ids`).
    pub(super) sample_vocab: usize,
    /// `[layer][k | v][slot][kv_heads * head_dim]` of the activation dtype,
    /// or of fp8 bytes (`kv_dtype`).
    pub(super) kv: DeviceBuffer<u16>,
    pub(super) kv_dtype: KvCacheDType,
    pub(super) ws: Workspace,
    /// Swap staging, allocated on first use.
    pub(super) staging: Option<DeviceBuffer<u16>>,
    /// Host side of `ws.inputs`.
    pub(super) host: Vec<u32>,
    /// Encoded sampling records of this step, and their device copy
    /// (grown on demand).
    pub(super) sampling_words: Vec<u32>,
    pub(super) sampling_params: Option<DeviceBuffer<u32>>,
    /// Captured decode steps by padded batch size and attention splits
    /// (see `run`).
    pub(super) graphs: HashMap<(usize, usize), Graph>,
    pub(super) use_graphs: bool,
    /// Argmax ids of launched steps on their way to the host (allocated
    /// at the first launch).
    pub(super) pending: Option<PendingIds>,
    /// Rows of argmax ids the last forward left in `ws.argmax` when it was
    /// a launch (`ForwardContext::launch`), which a chained launch may read.
    pub(super) launched_ids: Option<usize>,
    /// `ForwardContext::overlaps_steps` (NANOINFER_CUDA_OVERLAP=0: off).
    pub(super) overlap: bool,
    /// Where `kv` and `ws` come from (each buffer holds it too, so it
    /// outlives them). Swap staging and a grown `ws.inputs` come from the
    /// driver: rare, and a buddy region has no room planned for them.
    pub(super) pool: Arc<dyn DevicePool>,
    pub(super) pool_kind: MemoryPoolKind,
    /// The analytic workspace size.
    pub(super) planned_bytes: usize,
}

impl Drop for CudaForward {
    fn drop(&mut self) {
        if self.pending.as_ref().is_some_and(|p| !p.is_empty()) {
            // A launched step may still use the buffers freed after this.
            let _ = self.model.dev.synchronize();
        }
    }
}

/// Where a forward's result goes.
enum Output<'a> {
    Logits(&'a mut [f32]),
    /// Only each row's argmax: greedy decoding without copying logits.
    Argmax(&'a mut [u32]),
    /// Tokens sampled on the GPU, row `i` as `sampling.rows[i]` says (the
    /// masked rows' masks from the `MaskFill`), and the logits of the rows
    /// the host samples.
    Sample(
        &'a DeviceSampling,
        &'a mut MaskFill<'a>,
        &'a mut [u32],
        &'a mut [f32],
    ),
    /// Each row's argmax, or its sample as `sampling` says (every row on
    /// the device), copied back without waiting (`ForwardContext::launch`);
    /// `chained`: the rows' tokens are the ids the previous launch left in
    /// `ws.argmax`.
    Launch {
        sampling: Option<&'a DeviceSampling>,
        chained: bool,
    },
}

/// Most rows of one sequence in a step replayed from a CUDA graph: a
/// decode row and the drafted tokens of a speculative verify (at most 16).
const GRAPH_SEQ_ROWS: usize = 17;

/// Offsets of the sections of the step-input buffer.
pub(super) struct Inputs {
    /// Rows computed (padded for a graph replay).
    pub(super) rows: usize,
    /// Rows whose logits are computed.
    pub(super) n_out: usize,
    pub(super) tokens: usize,
    pub(super) write_slots: usize,
    pub(super) positions: usize,
    pub(super) table_off: usize,
    pub(super) logits_rows: usize,
    /// `n_tiles` first rows then `n_tiles` row counts of prefill tiles.
    pub(super) tiles: usize,
    pub(super) n_tiles: usize,
    /// Rows that attend through the decode kernel: a list of rows (offset)
    /// when prefill tiles take the others, else all `rows`.
    pub(super) decode_rows: Option<usize>,
    pub(super) n_decode: usize,
    pub(super) slot_list: usize,
}

impl CudaForward {
    pub(super) fn kv_width(&self) -> usize {
        let c = &self.model.dims;
        c.kv_heads * c.head_dim
    }

    /// 16-bit words of one slot of one layer's keys (or values).
    pub(super) fn kv_row_words(&self) -> usize {
        self.kv_width() * self.kv_dtype.element_bytes(ACT_BYTES) / 2
    }

    /// Whether the cache holds fp8 (the kernels' `_fp8` variants and flags).
    pub(super) fn kv_fp8(&self) -> bool {
        self.kv_dtype == KvCacheDType::Fp8E4m3
    }

    /// Device addresses of layer `l`'s key and value caches.
    pub(super) fn layer_kv(&self, l: usize) -> (u64, u64) {
        let per = self.slots * self.kv_row_words();
        (self.kv.at(2 * l * per), self.kv.at((2 * l + 1) * per))
    }

    /// Lays out the step inputs on the host and uploads them. With `pad_to`
    /// (a decode step replayed from a CUDA graph) the batch is padded to that
    /// many rows: dummy rows read token 0 at position 0 and write reserved
    /// slot 0, which no sequence ever maps.
    fn upload_inputs(&mut self, batch: &ForwardBatch<'_>, pad_to: Option<usize>) -> Result<Inputs> {
        let tile_rows = self.model.prefill.tile_rows();
        // A graph's rows all attend through the decode kernel (see `graph_bucket`).
        let tiled = pad_to.is_none() && tile_rows > 0 && batch.seqs.iter().any(|s| s.len > 1);
        let rows = batch.tokens.len();
        let padded = pad_to.unwrap_or(rows);
        let pad = padded - rows;
        let n_out = if pad_to.is_some() {
            padded
        } else {
            batch.logits_rows.len()
        };
        let h = &mut self.host;
        h.clear();
        h.extend_from_slice(batch.tokens);
        h.extend(std::iter::repeat_n(0, pad));
        for s in batch.seqs {
            h.extend((0..s.len).map(|i| s.kv.slot(s.context_len + i) as u32));
        }
        h.extend(std::iter::repeat_n(0, pad));
        for s in batch.seqs {
            h.extend((0..s.len).map(|i| (s.context_len + i) as u32));
        }
        h.extend(std::iter::repeat_n(0, pad));
        let mut off = 0u32;
        for s in batch.seqs {
            h.extend(std::iter::repeat_n(off, s.len));
            off += (s.context_len + s.len) as u32;
        }
        // Dummy rows attend to the one-entry list [0] after the real lists.
        h.extend(std::iter::repeat_n(off, pad));
        if pad_to.is_some() {
            h.extend(0..padded as u32);
        } else {
            h.extend(batch.logits_rows.iter().map(|&r| r as u32));
        }
        // Prefill tiles: runs of up to `tile_rows` rows of one sequence with
        // more than one row, as (first row) list then (row count) list; the
        // one-row sequences (decodes) are listed for the decode kernel.
        let tiles_at = h.len();
        let (mut decode_rows, mut n_decode) = (None, padded);
        if tiled {
            let chunks = || batch.seqs.iter().filter(|s| s.len > 1);
            for s in chunks() {
                h.extend((0..s.len).step_by(tile_rows).map(|i| (s.start + i) as u32));
            }
            for s in chunks() {
                h.extend(
                    (0..s.len)
                        .step_by(tile_rows)
                        .map(|i| tile_rows.min(s.len - i) as u32),
                );
            }
        }
        let n_tiles = (h.len() - tiles_at) / 2;
        if tiled {
            decode_rows = Some(h.len());
            h.extend(
                batch
                    .seqs
                    .iter()
                    .filter(|s| s.len == 1)
                    .map(|s| s.start as u32),
            );
            n_decode = h.len() - decode_rows.unwrap_or(0);
        }
        let slot_list = h.len();
        for s in batch.seqs {
            h.extend((0..s.context_len + s.len).map(|p| s.kv.slot(p) as u32));
        }
        h.push(0);
        if h.len() > self.ws.inputs.len() {
            // More context than ever before: grow (rare, not per step). The
            // captured graphs point at the old buffer.
            self.ws.inputs = self.model.dev.alloc::<u32>(h.len().next_power_of_two())?;
            self.graphs.clear();
        }
        self.model.dev.upload(h, &mut self.ws.inputs)?;
        Ok(Inputs {
            rows: padded,
            n_out,
            tokens: 0,
            write_slots: padded,
            positions: 2 * padded,
            table_off: 3 * padded,
            logits_rows: 4 * padded,
            tiles: tiles_at,
            n_tiles,
            decode_rows,
            n_decode,
            slot_list,
        })
    }

    /// Blocks of the decode attention kernel per (row, split): one per kv
    /// head on tensor cores, else one per ATTN_GROUP query heads of each.
    pub(super) fn attention_blocks(&self) -> usize {
        let c = &self.model.dims;
        if self.model.decode_mma {
            return c.kv_heads;
        }
        c.kv_heads * (c.heads / c.kv_heads).div_ceil(ATTN_GROUP)
    }

    /// Attention splits for this step: enough blocks to fill the GPU when
    /// few rows attend over long contexts (flash-decoding), one otherwise.
    fn attention_splits(&self, rows: usize, longest: usize) -> usize {
        let m = &self.model;
        let heads = m.dims.heads;
        let target = ATTN_BLOCKS_PER_SM * m.dev.sm_count;
        let mut splits = target
            .div_ceil(rows * self.attention_blocks())
            .min(longest.div_ceil(MIN_SPLIT_POSITIONS))
            .clamp(1, MAX_SPLITS);
        while splits > 1 && rows * heads * splits > m.attn_partials() {
            splits -= 1;
        }
        splits
    }

    /// The CUDA-graph bucket of a decode step, if graphs are on and it fits
    /// one: every row sampled, each sequence one row or the few rows of a
    /// speculative verify. Every row attends through the decode kernel over
    /// its own positions (the rows' keys and values are written before
    /// attention), so one graph serves both shapes.
    fn graph_bucket(&self, batch: &ForwardBatch<'_>) -> Option<usize> {
        let rows = batch.tokens.len();
        let decode = batch.seqs.iter().all(|s| s.len <= GRAPH_SEQ_ROWS)
            && batch.logits_rows.len() == rows
            && batch.logits_rows.iter().enumerate().all(|(i, &r)| i == r);
        let bucket = rows.next_power_of_two();
        let fits = bucket <= self.max_rows && bucket <= self.max_logits_rows;
        (self.use_graphs && decode && fits).then_some(bucket)
    }

    fn run(&mut self, batch: &ForwardBatch<'_>, out: Output<'_>) -> Result<()> {
        let dev = self.model.dev.clone();
        let longest = batch
            .seqs
            .iter()
            .map(|s| s.context_len + s.len)
            .max()
            .unwrap_or(1);
        let chained = matches!(out, Output::Launch { chained: true, .. });
        if let Some(bucket) = self.graph_bucket(batch) {
            let inputs = self.upload_inputs(batch, Some(bucket))?;
            if chained {
                self.feed_launched_ids(batch.tokens.len())?;
            }
            let _turn = dev.step_lock.lock().unwrap_or_else(|p| p.into_inner());
            // A graph's splits serve every context up to the next power of
            // two (each row divides its own context among them), so short
            // contexts do not pay for the splits and merge of long ones; a
            // bucket has a graph per context class it has seen (at most
            // log2(MAX_SPLITS) + 1 distinct splits).
            let class = longest.next_power_of_two().min(self.slots);
            let splits = self.attention_splits(bucket, class);
            let key = (bucket, splits);
            if !self.graphs.contains_key(&key) {
                if self.pending.as_ref().is_some_and(|p| !p.is_empty()) {
                    // Captured on an idle stream only (once per key).
                    dev.synchronize()?;
                }
                let graph = dev.capture(|| enqueue(self, &inputs, splits))?;
                self.graphs.insert(key, graph);
            }
            dev.replay(&self.graphs[&key])?;
            return self.read_output(batch.logits_rows.len(), out);
        }
        let inputs = self.upload_inputs(batch, None)?;
        if chained {
            self.feed_launched_ids(batch.tokens.len())?;
        }
        let splits = self.attention_splits(inputs.n_decode.max(1), longest);
        let _turn = dev.step_lock.lock().unwrap_or_else(|p| p.into_inner());
        enqueue(self, &inputs, splits)?;
        self.read_output(batch.logits_rows.len(), out)
    }

    /// Checks `batch` against the model (`logits_len`: the room for its
    /// logits) and against this context's limits.
    fn check_batch(&self, batch: &ForwardBatch<'_>, logits_len: usize) -> Result<()> {
        let vocab = self.model.dims.vocab;
        batch.validate(vocab, self.model.max_positions, self.slots, logits_len)?;
        if batch.tokens.len() > self.max_rows || batch.logits_rows.len() > self.max_logits_rows {
            bail_arg!(
                "forward of {} rows ({} with logits) exceeds the context's limits ({} rows, {} with logits)",
                batch.tokens.len(),
                batch.logits_rows.len(),
                self.max_rows,
                self.max_logits_rows
            );
        }
        Ok(())
    }

    /// Copies the first `n_out` logits rows, or only their argmax ids, to
    /// the host (the step's one synchronization).
    fn read_output(&mut self, n_out: usize, out: Output<'_>) -> Result<()> {
        let dev = self.model.dev.clone();
        let vocab = self.model.dims.vocab;
        self.launched_ids = None;
        match out {
            _ if n_out == 0 => dev.synchronize(),
            Output::Logits(logits) => dev.download(&self.ws.logits, &mut logits[..n_out * vocab]),
            Output::Sample(sampling, masks, ids, logits) => {
                self.enqueue_ids(Some((sampling, masks)), n_out)?;
                dev.download(&self.ws.argmax, &mut ids[..n_out])?;
                let host_rows = logits.chunks_exact_mut(vocab);
                for (&row, host) in sampling.host_rows.iter().zip(host_rows) {
                    dev.download_at(&self.ws.logits, row * vocab, host)?;
                }
                Ok(())
            }
            Output::Argmax(ids) => {
                self.enqueue_ids(None, n_out)?;
                dev.download(&self.ws.argmax, &mut ids[..n_out])
            }
            Output::Launch { sampling, .. } => {
                // `launch` admits no masked row.
                let no_masks: &mut MaskFill<'_> = &mut |_| {};
                self.enqueue_ids(sampling.map(|s| (s, no_masks)), n_out)?;
                let pending = match &mut self.pending {
                    Some(p) => p,
                    slot => slot.insert(dev.pending_ids(self.max_logits_rows)?),
                };
                dev.download_later(&self.ws.argmax, n_out, pending)?;
                self.launched_ids = Some(n_out);
                Ok(())
            }
        }
    }

    /// `ws.argmax[r]` = the token of the first `n_out` logits rows: sampled
    /// as `sampling` says (with the masks `masks` writes), or the first
    /// index of the row's largest logit. The forward is queued by now, so
    /// the host computing the masks overlaps it.
    fn enqueue_ids(
        &mut self,
        sampling: Option<(&DeviceSampling, &mut MaskFill<'_>)>,
        n_out: usize,
    ) -> Result<()> {
        let dev = self.model.dev.clone();
        let vocab = self.model.dims.vocab;
        if let Some((sampling, masks)) = sampling {
            let params = self.upload_sampling(sampling, masks)?;
            let (logits, ids) = (self.ws.logits.ptr(), self.ws.argmax.ptr());
            let columns = (vocab, self.sample_vocab);
            return cuda::sampling::enqueue(&dev, logits, columns, n_out, params, ids);
        }
        dev.launch(
            &dev.kernels.argmax_partial,
            (n_out as u32, ARGMAX_SPLITS as u32, 1),
            256,
            &[
                KArg::Ptr(self.ws.logits.ptr()),
                KArg::I32(vocab as i32),
                KArg::I32(self.sample_vocab as i32),
                KArg::Ptr(self.ws.argmax_part.ptr()),
            ],
        )?;
        dev.launch(
            &dev.kernels.argmax_merge,
            (n_out as u32, 1, 1),
            ARGMAX_SPLITS as u32,
            &[
                KArg::Ptr(self.ws.argmax_part.ptr()),
                KArg::Ptr(self.ws.argmax.ptr()),
            ],
        )
    }

    /// The first `rows` step tokens (`Inputs::tokens`, offset 0) become the
    /// ids the last launch chose, on the stream behind it.
    fn feed_launched_ids(&mut self, rows: usize) -> Result<()> {
        match self.launched_ids {
            Some(n) if n >= rows => {
                self.model
                    .dev
                    .copy_on_device(&self.ws.argmax, 0, &mut self.ws.inputs, 0, rows)
            }
            launched => Err(Error::new(
                ErrorKind::Internal,
                format!(
                    "a chained launch of {rows} rows follows {} ids of a launch",
                    launched.map_or("no".to_string(), |n| n.to_string())
                ),
            )),
        }
    }

    /// Uploads the step's sampling records and masks; returns their device
    /// address.
    fn upload_sampling(
        &mut self,
        sampling: &DeviceSampling,
        masks: &mut MaskFill<'_>,
    ) -> Result<u64> {
        let dev = &self.model.dev;
        let vocab = self.model.dims.vocab;
        cuda::sampling::encode_filled(sampling, vocab, &mut self.sampling_words, masks);
        let words = &self.sampling_words;
        let params = match &mut self.sampling_params {
            Some(b) if b.len() >= words.len() => b,
            slot => slot.insert(dev.alloc::<u32>(words.len().next_power_of_two())?),
        };
        dev.upload(words, params)?;
        Ok(params.ptr())
    }
}

/// The session-facing calls (the model's `ForwardContext` delegates here).
impl CudaForward {
    pub fn forward(&mut self, batch: &ForwardBatch<'_>, logits: &mut [f32]) -> Result<()> {
        self.check_batch(batch, logits.len())?;
        if batch.tokens.is_empty() {
            return Ok(());
        }
        self.run(batch, Output::Logits(logits))
    }

    pub fn forward_argmax(&mut self, batch: &ForwardBatch<'_>, ids: &mut [u32]) -> Result<()> {
        let c = &self.model.dims;
        self.check_batch(batch, batch.logits_rows.len() * c.vocab)?;
        if ids.len() < batch.logits_rows.len() {
            bail_arg!("argmax buffer too small");
        }
        if batch.tokens.is_empty() {
            return Ok(());
        }
        self.run(batch, Output::Argmax(ids))
    }

    pub fn overlaps_steps(&self) -> bool {
        self.overlap
    }

    pub fn launch(
        &mut self,
        batch: &ForwardBatch<'_>,
        sampling: Option<&DeviceSampling>,
        chained: bool,
    ) -> Result<()> {
        let c = &self.model.dims;
        let rows = batch.logits_rows.len();
        self.check_batch(batch, rows * c.vocab)?;
        if batch.tokens.is_empty() {
            bail_arg!("launch of an empty batch");
        }
        if let Some(s) = sampling {
            // A masked row's mask comes after the forward starts, which a
            // launch does not wait for.
            if s.rows.len() != rows || !s.host_rows.is_empty() || s.masked_rows() > 0 {
                bail_arg!(
                    "launch: {} sampling rows ({} on the host, {} masked) for {rows} logits rows; every row samples on the device, unmasked",
                    s.rows.len(),
                    s.host_rows.len(),
                    s.masked_rows()
                );
            }
        }
        self.run(batch, Output::Launch { sampling, chained })
    }

    pub fn collect_ids(&mut self, ids: &mut [u32]) -> Result<()> {
        match &mut self.pending {
            Some(p) => p.wait_oldest(ids),
            None => Err(Error::new(
                ErrorKind::Internal,
                "collect_ids without a launch",
            )),
        }
    }

    pub fn forward_sample(
        &mut self,
        batch: &ForwardBatch<'_>,
        sampling: &DeviceSampling,
        masks: &mut MaskFill<'_>,
        ids: &mut [u32],
        logits: &mut [f32],
    ) -> Result<()> {
        let c = &self.model.dims;
        self.check_batch(batch, batch.logits_rows.len() * c.vocab)?;
        let rows = batch.logits_rows.len();
        let host_rows = sampling.host_rows.len();
        if sampling.rows.len() != rows
            || ids.len() < rows
            || logits.len() < host_rows * c.vocab
            || sampling.host_rows.iter().any(|&r| r >= rows)
        {
            bail_arg!(
                "forward_sample: {} sampling rows, {} ids, {host_rows} host rows and {} logits for {rows} logits rows",
                sampling.rows.len(),
                ids.len(),
                logits.len()
            );
        }
        if batch.tokens.is_empty() {
            return Ok(());
        }
        self.run(batch, Output::Sample(sampling, masks, ids, logits))
    }

    pub fn kv_values_per_slot(&self) -> usize {
        2 * self.model.dims.layers * self.kv_width()
    }

    pub fn workspace_stats(&self) -> Option<WorkspaceStats> {
        Some(WorkspaceStats {
            pool: self.pool_kind,
            planned_bytes: self.planned_bytes,
            pool_stats: self.pool.stats(),
            ..WorkspaceStats::default()
        })
    }
}
