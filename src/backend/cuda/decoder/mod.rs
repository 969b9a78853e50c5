//! The decoder on a CUDA GPU: the model's weights resident on one device
//! ([`CudaModel`]), the per-session state that runs forwards there
//! ([`CudaForward`]: KV cache, workspace, CUDA graphs, overlapped steps,
//! swap), and the ops the layer program calls ([`CudaLayerOps`]).
//! Weights and activations are bf16 or f16 with f32 accumulation; dense
//! projections run through cuBLAS (or the GEMV kernels for decode rows),
//! everything else through `kernels/decoder.cu`. q/k/v and gate/up are one
//! matrix each, so a layer is four products. Int4 (AWQ/GPTQ) projections
//! stay packed and run through `kernels/int4.cu` for batches up to
//! `w4_mma_rows` rows, through the tensor-core GEMM of
//! `kernels/int4_gemm.cu` above that on sm_90, and are dequantized for
//! cuBLAS on other GPUs.

mod context;
mod kv_swap;
mod ops;
mod workspace;

pub use context::CudaForward;
pub use ops::CudaLayerOps;

use super::{
    create_device_pool, CudaDevice, DeviceBuffer, GemvWeight, W4Matrix, W8Matrix, BUDDY_MIN_BLOCK,
    DEVICE_ALIGN, HANDOFF_ROWS,
};
use crate::backend::layer_ops::{DecoderDims, DecoderWeights, WeightFormats};
use crate::backend::{cuda, ContextShape, Device, KvBudget};
use crate::forward::{AttnSeq, ForwardBatch, KvCacheDType, KvMapping};
use crate::memory::buddy::BuddyAllocator;
use crate::memory::{DeviceMemory, DevicePool, MemoryPoolKind};
use crate::{Error, ErrorKind, Result};
use std::collections::HashMap;
use std::sync::Arc;
use workspace::{Workspace, WorkspaceSizes};

/// A projection's weights `[rows, cols]` on the device.
pub enum CudaWeight {
    /// Row-major in the activation dtype (the HF layout).
    Dense(DeviceBuffer<u16>),
    Int4(W4Matrix),
    /// FP8 (E4M3) codes with per-row group scales.
    Fp8(W8Matrix),
}

impl CudaWeight {
    pub fn int4(&self) -> Option<&W4Matrix> {
        match self {
            CudaWeight::Int4(w) => Some(w),
            _ => None,
        }
    }

    pub fn dense(&self) -> Option<&DeviceBuffer<u16>> {
        match self {
            CudaWeight::Dense(b) => Some(b),
            _ => None,
        }
    }

    pub fn fp8(&self) -> Option<&W8Matrix> {
        match self {
            CudaWeight::Fp8(w) => Some(w),
            _ => None,
        }
    }

    /// The operand of the GEMV kernels (dense and FP8 weights have them).
    pub fn gemv_weight(&self) -> Option<GemvWeight<'_>> {
        match self {
            CudaWeight::Dense(b) => Some(GemvWeight::Act(b.ptr())),
            CudaWeight::Fp8(m) => Some(GemvWeight::Fp8(m)),
            CudaWeight::Int4(_) => None,
        }
    }

    pub fn bytes(&self) -> usize {
        match self {
            CudaWeight::Dense(b) => b.bytes(),
            CudaWeight::Int4(w) => w.bytes(),
            CudaWeight::Fp8(w) => w.bytes(),
        }
    }
}

/// The CUDA backend's weight formats: projections dense or int4, vectors
/// and the embedding table in the activation dtype, RoPE frequencies f32.
pub struct CudaFormats;

impl WeightFormats for CudaFormats {
    type Weight = CudaWeight;
    type Vector = DeviceBuffer<u16>;
    type Embedding = DeviceBuffer<u16>;
    type Rope = DeviceBuffer<f32>;
}

/// A decoder's weights on a GPU.
pub type CudaWeights = DecoderWeights<CudaFormats>;

/// The layer program a forward runs over the ops, handed down by the model
/// (the backend does not know the architecture).
pub type LayerProgram = fn(&mut CudaLayerOps<'_>, &CudaWeights) -> Result<()>;

/// How a weight upload went, for the model's summary line.
#[derive(Debug, Clone, Copy)]
pub struct LoadReport {
    /// Bytes of weights on the device.
    pub resident_bytes: usize,
    pub seconds: f64,
    /// Whether the weights came through pinned staging buffers.
    pub pinned: bool,
}

pub struct CudaModel {
    dev: Arc<CudaDevice>,
    ordinal: usize,
    dims: DecoderDims,
    /// The model's context length (the profiling forward's sequences stay
    /// within it).
    max_positions: usize,
    /// A tied LM head is the embedding table; a quantized head is always
    /// its own copy.
    weights: CudaWeights,
    /// The layer program the forward runs over the ops (`CudaLayerOps`).
    program: LayerProgram,
    /// Bytes of weights on the device.
    resident_bytes: usize,
    load_seconds: f64,
    /// Whether the weights came through pinned staging buffers.
    load_pinned: bool,
    prefill: PrefillKernel,
    /// Whether decode rows attend on tensor cores (`attention_decode_mma`).
    decode_mma: bool,
    /// Int4 projections of batches up to this many rows run through the
    /// int4 kernels (weights read once per 32 rows); larger batches take
    /// the int4 GEMM or dequantize for cuBLAS (NANOINFER_CUDA_W4_MMA_ROWS).
    w4_mma_rows: usize,
    /// Larger int4 batches up to this many rows take the int4 GEMM (sm_90),
    /// larger ones dequantize for cuBLAS (NANOINFER_CUDA_W4_GEMM_ROWS).
    w4_gemm_rows: usize,
    /// Every projection int4 and no q/k norms (their QKV is not one fused
    /// product): decode steps may hand norms over (`CudaForward::norm_handoff`).
    w4_handoff: bool,
    /// The norms and SwiGLU before int4 GEMM products write the GEMM's
    /// packed activations themselves instead of rows that it then packs
    /// (`CudaForward::product_input`; NANOINFER_CUDA_W4_PACKED_INPUTS=0
    /// turns it off).
    w4_packed_inputs: bool,
    /// Elements of the largest int4 projection (the dequantization scratch).
    w4_max_elems: usize,
    /// Widest input of an int4 projection (the int4 GEMM's packed activations).
    w4_max_cols: usize,
    /// Widest input of an act-order int4 projection (0: none), for the
    /// gathered-activation scratch.
    w4_perm_cols: usize,
    /// Elements of the largest FP8 matrix (0 without any).
    fp8_max_elems: usize,
}

impl CudaModel {
    /// Refuses a geometry the kernels do not handle, before any upload.
    pub fn check_dims(d: &DecoderDims) -> Result<()> {
        if d.hidden > MAX_HIDDEN || !d.hidden.is_multiple_of(8) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "hidden_size {} is not supported on CUDA (a multiple of 8, at most {MAX_HIDDEN})",
                    d.hidden
                ),
            ));
        }
        if !matches!(d.head_dim, 32 | 64 | 128 | 256) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "head_dim {} is not supported on CUDA (32, 64, 128 or 256)",
                    d.head_dim
                ),
            ));
        }
        Ok(())
    }

    /// The model over weights uploaded to `dev` (device `ordinal`), its
    /// kernels chosen for that GPU; forwards run `program`.
    pub fn new(
        dev: Arc<CudaDevice>,
        ordinal: usize,
        dims: DecoderDims,
        max_positions: usize,
        weights: CudaWeights,
        load: LoadReport,
        program: LayerProgram,
    ) -> CudaModel {
        // The largest `f` over the int4 projections (0 without any).
        let int4_max = |f: fn(&W4Matrix) -> usize| {
            weights
                .layers
                .iter()
                .flat_map(|l| l.projections())
                .filter_map(|w| w.int4().map(f))
                .max()
                .unwrap_or(0)
        };
        // FP8 products above the GEMV's rows dequantize into the same scratch.
        let fp8_max_elems = weights
            .layers
            .iter()
            .flat_map(|l| l.projections())
            .chain([&weights.lm_head].into_iter().flatten())
            .filter_map(|w| w.fp8().map(|m| m.rows * m.cols))
            .max()
            .unwrap_or(0);
        let w4_max_elems = int4_max(|m| m.rows * m.cols);
        let w4_max_cols = int4_max(|m| m.cols);
        let w4_perm_cols = int4_max(|m| if m.has_perm() { m.cols } else { 0 });
        let w4_mma_rows = cuda::env_number(
            "NANOINFER_CUDA_W4_MMA_ROWS",
            if dev.w4_gemm_available() {
                W4_MMA_ROWS_BEFORE_GEMM
            } else {
                W4_MMA_ROWS_BEFORE_DEQUANT
            },
        );
        let w4_gemm_rows = cuda::env_number("NANOINFER_CUDA_W4_GEMM_ROWS", DEFAULT_W4_GEMM_ROWS);
        let w4_packed_inputs = cuda::switch_on("NANOINFER_CUDA_W4_PACKED_INPUTS");
        let w4_handoff = weights.layers.iter().all(|l| {
            l.q_norm.is_none()
                && l.projections()
                    .iter()
                    .all(|w| matches!(w, CudaWeight::Int4(_)))
        });
        CudaModel {
            prefill: PrefillKernel::choose(dev.arch, dims.head_dim),
            decode_mma: decode_mma_fits(dev.arch, &dims),
            dev,
            ordinal,
            dims,
            max_positions,
            weights,
            program,
            resident_bytes: load.resident_bytes,
            load_seconds: load.seconds,
            load_pinned: load.pinned,
            w4_mma_rows,
            w4_gemm_rows,
            w4_handoff,
            w4_packed_inputs,
            w4_max_elems,
            w4_max_cols,
            w4_perm_cols,
            fp8_max_elems,
        }
    }
}

/// How rows of a prompt chunk attend (decode rows use `attention_decode_mma`
/// or `attention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PrefillKernel {
    /// Tensor-core flash attention over tiles of 64 rows (sm_80+, head_dim
    /// 64 or 128; NANOINFER_CUDA_FLASH=0 turns it off).
    Flash,
    /// Tiles of 16 rows sharing key blocks in shared memory, CUDA cores
    /// (head_dim <= 128).
    Tiles,
    /// Row by row through the decode kernel.
    Rows,
}

impl PrefillKernel {
    fn choose(arch: (i32, i32), head_dim: usize) -> Self {
        if head_dim > TILE_HD_MAX {
            PrefillKernel::Rows
        } else if cuda::switch_on("NANOINFER_CUDA_FLASH")
            && arch.0 >= 8
            && matches!(head_dim, 64 | 128)
        {
            PrefillKernel::Flash
        } else {
            PrefillKernel::Tiles
        }
    }

    /// Rows per tile (must match FA_ROWS / TILE_ROWS of kernels/decoder.cu).
    fn tile_rows(self) -> usize {
        match self {
            PrefillKernel::Flash => 64,
            PrefillKernel::Tiles => 16,
            PrefillKernel::Rows => 0,
        }
    }
}

/// Tensor-core decode attention needs sm_80+, head_dim 64 or 128 and at most
/// DA_GROUP_MAX query heads per kv head (NANOINFER_CUDA_DECODE_MMA=0 turns it
/// off).
fn decode_mma_fits(arch: (i32, i32), d: &DecoderDims) -> bool {
    cuda::switch_on("NANOINFER_CUDA_DECODE_MMA")
        && arch.0 >= 8
        && matches!(d.head_dim, 64 | 128)
        && d.heads / d.kv_heads <= DA_GROUP_MAX
}

/// `CudaModel::w4_mma_rows` where the int4 GEMM takes larger batches
/// (sm_90). The GEMM's time is flat up to 128 rows (one block of
/// activation rows); the int4 kernels' grows with their passes over the
/// weights (32, 16 or 8 rows each). H100, 8B shapes (docs/benchmarks-log.md), prefill
/// tok/s: 48 tokens 7 916 through the int4 kernels (a 32- and a 16-row
/// pass) against 6 796 through the GEMM; 64 tokens 8 865 (two 32-row
/// passes) against 9 053; 128 tokens 9 483 against 17 459 (bf16 16 644).
const W4_MMA_ROWS_BEFORE_GEMM: usize = 48;
/// `CudaModel::w4_mma_rows` where larger batches dequantize for cuBLAS,
/// which writes and rereads 2 bytes a weight: up to four passes of the int4
/// kernels are cheaper.
const W4_MMA_ROWS_BEFORE_DEQUANT: usize = 128;
/// See `CudaModel::w4_gemm_rows`: where the int4 GEMM stops beating
/// dequantization + cuBLAS (H100, 8B shapes: 14 % faster per gate/up
/// product at 512 rows, 7 % slower at 2048).
const DEFAULT_W4_GEMM_ROWS: usize = 1024;

/// Extra KV slots of the profiling context beyond one per row (and the
/// reserved slot 0): a block's worth, as a session would have.
const PROFILE_EXTRA_SLOTS: usize = 16;

/// Decode attention blocks to aim for per SM (two are resident at a time);
/// the (row, head, split) partials hold twice that many query heads' worth.
const ATTN_BLOCKS_PER_SM: usize = 8;
/// A split of the context gets at least this many positions (four rounds
/// of the kernel's 8 warps × 4 positions).
const MIN_SPLIT_POSITIONS: usize = 128;
const MAX_SPLITS: usize = 64;
/// 32 * ATTN_WARPS and ATTN_GROUP of kernels/decoder.cu.
const ATTN_THREADS: u32 = 256;
const ATTN_GROUP: usize = 4;
/// 32 * DA_WARPS and DA_GROUP_MAX of kernels/decoder.cu.
const DA_THREADS: u32 = 128;
const DA_GROUP_MAX: usize = 8;
/// 32 * TILE_WARPS (= 32 * FA_WARPS) and TILE_HD_MAX of kernels/decoder.cu.
const TILE_THREADS: u32 = 128;
/// Bytes of an activation (bf16 or f16), and of a `KvCacheDType::Auto` cache element.
const ACT_BYTES: usize = 2;
/// ARGMAX_SPLITS of kernels/decoder.cu.
const ARGMAX_SPLITS: usize = 32;
/// 8 × NORM_VECS of kernels/decoder.cu: add_rms_norm keeps a row in
/// registers, at most this many values per thread of a 1024-thread block,
/// in runs of eight.
const NORM_PER_THREAD: usize = 16;
const MAX_HIDDEN: usize = NORM_PER_THREAD * 1024;

/// Threads of an add_rms_norm block: one run of eight values each (two
/// above 8192), at least 256 (its sum of squares keeps the order of the
/// kernel's 256-thread blocks).
fn norm_threads(hidden: usize) -> u32 {
    (hidden.div_ceil(8).next_multiple_of(32)).clamp(256, 1024) as u32
}
const TILE_HD_MAX: usize = 128;

impl CudaModel {
    fn attn_partials(&self) -> usize {
        2 * ATTN_GROUP * ATTN_BLOCKS_PER_SM * self.dev.sm_count
    }

    fn workspace_sizes(&self, shape: &ContextShape) -> WorkspaceSizes {
        let c = &self.dims;
        let (r, l) = (shape.max_rows.max(1), shape.max_logits_rows.max(1));
        let (d, hd, inter) = (c.hidden, c.head_dim, c.intermediate);
        let (nq, nkv) = (c.q_width(), c.kv_width());
        WorkspaceSizes {
            act16: [
                r * d,
                r * d,
                r * (nq + 2 * nkv),
                r * nq,
                r * d,
                r * 2 * inter,
                r * inter,
                l * d,
            ],
            f32s: [
                l * c.vocab,
                self.attn_partials() * hd,
                self.attn_partials() * 2,
                r * hd,
                // Two sets of 64-bit fixed-point sums (W4_SQ_ONE, int4.cu).
                2 * 2 * HANDOFF_ROWS,
            ],
            // Tokens, write slots, positions, table offsets, logits rows and
            // the slot lists: one entry per cached position, plus room for
            // shared prefixes (grown on demand past that).
            inputs: 5 * r + l + shape.kv_slots + 4096,
            w4_scratch: self.w4_scratch_elems(r),
            w4_x: r * self.w4_perm_cols,
        }
    }

    /// Whether a batch of `rows` rows runs its int4 projections through
    /// the int4 GEMM.
    fn w4_gemm_takes(&self, rows: usize) -> bool {
        rows > self.w4_mma_rows && rows <= self.w4_gemm_rows && self.dev.w4_gemm_available()
    }

    /// The int4 scratch of batches of up to `r` rows: the GEMM's packed
    /// activations and/or the dequantized weights of the largest projection.
    /// FP8 weights add the dequantized largest FP8 matrix whenever a batch
    /// can exceed the GEMV's rows.
    fn w4_scratch_elems(&self, r: usize) -> usize {
        let fp8 = if self.dev.gemv_fits(r, 16) {
            0
        } else {
            self.fp8_max_elems
        };
        if r <= self.w4_mma_rows || self.w4_max_elems == 0 {
            return fp8;
        }
        // Batches of up to `gemm_rows` rows take the GEMM, larger ones dequantize.
        let gemm_rows = r.min(self.w4_gemm_rows);
        let gemm = if self.w4_gemm_takes(gemm_rows) {
            self.dev.w4_gemm_scratch_elems(gemm_rows, self.w4_max_cols)
        } else {
            0
        };
        let dequant = if self.w4_gemm_takes(r) {
            0
        } else {
            self.w4_max_elems
        };
        gemm.max(dequant).max(fp8)
    }

    fn workspace_bytes(&self, shape: &ContextShape) -> usize {
        let s = self.workspace_sizes(shape);
        (s.act16.iter().sum::<usize>() + s.w4_scratch + s.w4_x) * 2
            + s.f32s.iter().sum::<usize>() * 4
            + s.inputs * 4
    }

    /// Allocates the workspace of a context of `shape` from `pool`.
    fn new_workspace(&self, shape: &ContextShape, pool: &Arc<dyn DevicePool>) -> Result<Workspace> {
        let s = self.workspace_sizes(shape);
        let dev = &self.dev;
        let a = |i: usize| dev.alloc_in::<u16>(pool, s.act16[i]);
        Ok(Workspace {
            hidden: a(0)?,
            normed: a(1)?,
            qkv: a(2)?,
            attn: a(3)?,
            delta: a(4)?,
            gate_up: a(5)?,
            act: a(6)?,
            head_in: a(7)?,
            logits: dev.alloc_in::<f32>(pool, s.f32s[0])?,
            part_o: dev.alloc_in::<f32>(pool, s.f32s[1])?,
            part_ml: dev.alloc_in::<f32>(pool, s.f32s[2])?,
            rope_cs: dev.alloc_in::<f32>(pool, s.f32s[3])?,
            norm_sums: dev.alloc_in::<f32>(pool, s.f32s[4])?,
            inputs: dev.alloc_in::<u32>(pool, s.inputs)?,
            argmax: dev.alloc_in::<u32>(pool, shape.max_logits_rows.max(1))?,
            argmax_part: dev.alloc_in::<u64>(pool, shape.max_logits_rows.max(1) * ARGMAX_SPLITS)?,
            w4_scratch: match s.w4_scratch {
                0 => None,
                n => Some(dev.alloc_in::<u16>(pool, n)?),
            },
            w4_x: match s.w4_x {
                0 => None,
                n => Some(dev.alloc_in::<u16>(pool, n)?),
            },
        })
    }

    /// 16-bit words of a context's KV buffer.
    fn kv_words(&self, shape: &ContextShape) -> usize {
        shape.kv_slots * self.kv_slot_bytes(shape.kv_dtype) / 2
    }

    /// Bytes one KV slot holds across all layers in a cache of `dtype`.
    fn kv_slot_bytes(&self, dtype: KvCacheDType) -> usize {
        let c = &self.dims;
        2 * c.layers * c.kv_width() * dtype.element_bytes(ACT_BYTES)
    }

    /// The device pool of a context of `shape`: a `CudaBuddy` is sized for
    /// exactly what `create_context` allocates from it (the KV buffer, then
    /// the workspace), a `CudaStreamPool` grows on demand.
    fn new_pool(&self, shape: &ContextShape) -> Result<Arc<dyn DevicePool>> {
        let kind = shape.memory_pool;
        kind.check_device(true, &Device::Cuda(self.ordinal).to_string())?;
        let capacity = if kind == MemoryPoolKind::CudaBuddy {
            let mut sizes = vec![self.kv_words(shape).max(1) * 2];
            sizes.extend(
                self.workspace_sizes(shape)
                    .buffer_bytes(shape.max_logits_rows),
            );
            let requests: Vec<_> = sizes.into_iter().map(|b| (b, DEVICE_ALIGN)).collect();
            BuddyAllocator::capacity_for(&requests, BUDDY_MIN_BLOCK)?
        } else {
            0
        };
        create_device_pool(&self.dev, kind, capacity)
    }

    /// A context of `shape`: its pool, KV buffer and workspace.
    pub fn create_context(self: Arc<Self>, shape: &ContextShape) -> Result<CudaForward> {
        let pool = self.new_pool(shape)?;
        // The KV buffer first: a buddy region's largest block.
        let kv = self.dev.alloc_in::<u16>(&pool, self.kv_words(shape))?;
        let ws = self.new_workspace(shape, &pool)?;
        let inputs_len = ws.inputs.len();
        Ok(CudaForward {
            slots: shape.kv_slots,
            max_rows: shape.max_rows,
            max_logits_rows: shape.max_logits_rows,
            sample_vocab: shape.choosable_ids(self.dims.vocab),
            kv,
            kv_dtype: shape.kv_dtype,
            ws,
            staging: None,
            host: Vec::with_capacity(inputs_len),
            sampling_words: Vec::new(),
            sampling_params: None,
            graphs: HashMap::new(),
            use_graphs: !self.dev.profiling() && cuda::switch_on("NANOINFER_CUDA_GRAPHS"),
            pending: None,
            launched_ids: None,
            // Profiling synchronizes every launch: nothing to overlap.
            overlap: !self.dev.profiling() && cuda::switch_on("NANOINFER_CUDA_OVERLAP"),
            pool,
            pool_kind: shape.memory_pool,
            planned_bytes: self.workspace_bytes(shape),
            model: self,
        })
    }

    /// Peak device memory of the temporaries of one forward at `shape`'s
    /// largest batch (vLLM's `profile_run`): a context with a tiny KV
    /// cache runs `max_rows` dummy tokens as up to `max_logits_rows`
    /// sequences, each wanting logits; the device's used memory is read
    /// before and after (nothing is trimmed in between), plus what the
    /// default pool reserved and gave back meanwhile (transient driver-path
    /// buffers), minus the tiny KV. The context is dropped before returning
    /// (its pool, and the memory in it, with it).
    ///
    /// The result can exceed the analytic `workspace_bytes`: the pool
    /// reserves in chunks (the stream pool) or rounds the region (buddy),
    /// the driver counts memory in pages, the first launch of each kernel
    /// loads its module lazily (CUDA_MODULE_LOADING=LAZY), a decode-only
    /// shape instantiates a CUDA graph, and cuBLAS may allocate beyond the
    /// workspace we give it. A session that runs on the same device at the
    /// same time perturbs the measure.
    fn profile_temporaries(self: Arc<Self>, shape: &ContextShape) -> Result<usize> {
        let dev = self.dev.clone();
        let rows = shape.max_rows.max(1);
        let max_pos = self.max_positions.max(1);
        let n_seqs = shape
            .max_logits_rows
            .clamp(1, rows)
            .max(rows.div_ceil(max_pos));
        let mut tiny = shape.clone();
        tiny.kv_slots = rows + 1 + PROFILE_EXTRA_SLOTS;
        let tiny_kv_bytes = self.kv_words(&tiny) * 2;
        let tokens = vec![0u32; rows];
        let slots: Vec<u32> = (1..=rows as u32).collect();
        let (mut seqs, mut logits_rows, mut start) = (Vec::new(), Vec::new(), 0);
        for i in 0..n_seqs {
            let len = rows / n_seqs + usize::from(i < rows % n_seqs);
            seqs.push(AttnSeq {
                start,
                len,
                context_len: 0,
                kv: KvMapping::Slots(&slots[start..start + len]),
            });
            start += len;
            if logits_rows.len() < shape.max_logits_rows.max(1) {
                logits_rows.push(start - 1);
            }
        }
        let batch = ForwardBatch {
            tokens: &tokens,
            seqs: &seqs,
            logits_rows: &logits_rows,
            stop: None,
        };
        let mut logits = vec![0f32; logits_rows.len() * self.dims.vocab];
        let failed = |e: Error| {
            Error::new(
                e.kind,
                format!(
                    "profiling forward of {rows} rows ({} with logits) for the KV budget: {}",
                    logits_rows.len(),
                    e.message
                ),
            )
        };
        dev.release_cached()?;
        dev.reset_default_pool_peaks()?;
        let used_before = dev.used_memory()?;
        let measured = {
            let mut ctx = self.clone().create_context(&tiny).map_err(failed)?;
            ctx.forward(&batch, &mut logits).map_err(failed)?;
            dev.synchronize()?;
            let used_after = dev.used_memory()?;
            let (reserved_now, reserved_high) = dev.default_pool_reserved()?;
            used_after.saturating_sub(used_before)
                + reserved_high.saturating_sub(reserved_now) as usize
        };
        dev.release_cached()?;
        Ok(measured.saturating_sub(tiny_kv_bytes))
    }
}

/// What the model layer's `DeviceDecoder` asks of a GPU model.
impl CudaModel {
    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }
    pub fn weight_dtype_name(&self) -> &'static str {
        if self.w4_max_elems > 0 {
            "int4"
        } else if self.fp8_max_elems > 0 {
            "fp8"
        } else {
            self.dev.act.name()
        }
    }
    pub fn lm_head_dtype_name(&self) -> &'static str {
        match self.weights.lm_head {
            Some(CudaWeight::Int4(_)) => "int4",
            Some(CudaWeight::Fp8(_)) => "fp8",
            _ => self.dev.act.name(),
        }
    }
    pub fn weight_bytes(&self) -> usize {
        let c = &self.dims;
        // Per step: every layer and the LM head, not the embedding table.
        let embed = c.vocab * c.hidden * 2;
        let tied = self.weights.lm_head.is_none();
        self.resident_bytes - if tied { 0 } else { embed }
    }
    pub fn kv_bytes_per_slot(&self, dtype: KvCacheDType) -> Result<usize> {
        Ok(self.kv_slot_bytes(dtype))
    }
    pub fn default_kv_budget(self: Arc<Self>, shape: &ContextShape) -> Result<KvBudget> {
        let (free, total) = self.dev.memory_info()?;
        let allowed = (total as f64 * shape.memory_utilization as f64) as usize;
        let used = total - free;
        let analytic = self.workspace_bytes(shape);
        let profiled = self.clone().profile_temporaries(shape)?;
        // Never below the plan: the measure rounds to the driver's pages.
        let temporaries = profiled.max(analytic);
        let bytes = allowed.checked_sub(used + temporaries).ok_or_else(|| {
            Error::new(
                ErrorKind::OutOfMemory,
                format!(
                    "no GPU memory left for the KV cache: {:.2} GiB allowed ({:.0}% of {:.2} GiB), {:.2} GiB in use \
                     (weights {:.2} GiB), {:.2} GiB of step temporaries (profiled; {:.2} GiB planned)",
                    gib(allowed),
                    shape.memory_utilization * 100.0,
                    gib(total),
                    gib(used),
                    gib(self.resident_bytes),
                    gib(temporaries),
                    gib(analytic)
                ),
            )
        })?;
        Ok(KvBudget {
            bytes,
            profiled_peak_bytes: profiled,
        })
    }
    pub fn memory(&self, shape: &ContextShape) -> DeviceMemory {
        // Unknown (0) only if the driver cannot answer, which the session's
        // budget computation would already have reported.
        let (available, total) = self.dev.memory_info().unwrap_or((0, 0));
        DeviceMemory {
            total_bytes: total,
            available_bytes: available,
            weights_bytes: self.resident_bytes,
            workspace_bytes: self.workspace_bytes(shape),
            profiled_peak_bytes: 0,
        }
    }
    pub fn summary(&self) -> String {
        format!(
            "{} (sm_{}{}, {} SMs), {} weights, {} activations, {:.2} GB of weights loaded in {:.2} s ({:.2} GB/s{})",
            self.dev.name,
            self.dev.arch.0,
            self.dev.arch.1,
            self.dev.sm_count,
            self.weight_dtype_name(),
            self.dev.act.name(),
            self.resident_bytes as f64 / 1e9,
            self.load_seconds,
            self.resident_bytes as f64 / 1e9 / self.load_seconds.max(1e-9),
            if self.load_pinned {
                ", pinned staging"
            } else {
                ""
            }
        )
    }
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}
