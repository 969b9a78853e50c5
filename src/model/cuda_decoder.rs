//! The decoder on a CUDA GPU: the same architecture as `decoder.rs`
//! (Llama / Qwen2 / Qwen3), weights and activations in bf16 or f16 with f32
//! accumulation, dense projections through cuBLAS, everything else in
//! `kernels/decoder.cu`. q/k/v and gate/up are fused into one matrix each at
//! load, so a layer is four GEMMs. Int4 (AWQ/GPTQ) projections stay packed
//! and run through `kernels/int4.cu` for batches up to `w4_mma_rows` rows,
//! through the tensor-core GEMM of `kernels/int4_gemm.cu` above that on
//! sm_90, and are dequantized for cuBLAS on other GPUs.

use super::quant::{QuantMethod, QuantMode};
use super::runner::{validate_batch, ContextShape, DeviceDecoder, ForwardContext, KvBudget};
use super::workspace::WorkspaceStats;
use super::{ForwardBatch, ModelConfig, WeightDType, WeightSource};
use crate::backend::cpu::{Matrix, MatrixData, ThreadPool};
use crate::backend::cuda::{
    create_device_pool, ActDType, CudaDevice, DeviceBuffer, GemmDType, GemvFamily, GemvOut, Graph,
    KArg, PendingIds, QkvEpilogue, Staging, W4Handoff, W4Host, W4Matrix, W4Norm, W4Out,
    BUDDY_MIN_BLOCK, DEVICE_ALIGN, HANDOFF_ROWS,
};
use crate::backend::{cuda, Device};
use crate::forward::AttnSeq;
use crate::forward::{e4m3_from_f32, e4m3_to_f32};
use crate::kv::{KvCacheDType, KvMapping};
use crate::memory::buddy::BuddyAllocator;
use crate::memory::{DeviceMemory, DevicePool, MemoryPoolKind};
use crate::sampling::{DeviceSampling, MaskFill};
use crate::{bail_arg, Error, ErrorKind, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// A projection's weights `[rows, cols]` on the device.
enum Weight {
    /// Row-major in the activation dtype (the HF layout).
    Dense(DeviceBuffer<u16>),
    Int4(W4Matrix),
}

impl Weight {
    fn int4(&self) -> Option<&W4Matrix> {
        match self {
            Weight::Int4(w) => Some(w),
            Weight::Dense(_) => None,
        }
    }

    fn dense(&self) -> Option<&DeviceBuffer<u16>> {
        match self {
            Weight::Dense(b) => Some(b),
            Weight::Int4(_) => None,
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Weight::Dense(b) => b.bytes(),
            Weight::Int4(w) => w.bytes(),
        }
    }
}

struct Layer {
    input_norm: DeviceBuffer<u16>,
    /// `[q | k | v]` rows: `[nq + 2 nkv, d]`.
    qkv: Weight,
    qkv_bias: Option<DeviceBuffer<u16>>,
    o: Weight,
    o_bias: Option<DeviceBuffer<u16>>,
    q_norm: Option<DeviceBuffer<u16>>,
    k_norm: Option<DeviceBuffer<u16>>,
    post_norm: DeviceBuffer<u16>,
    /// `[gate | up]` rows: `[2 inter, d]`.
    gate_up: Weight,
    down: Weight,
}

impl Layer {
    fn projections(&self) -> [&Weight; 4] {
        [&self.qkv, &self.o, &self.gate_up, &self.down]
    }
}

pub struct CudaDecoder {
    dev: Arc<CudaDevice>,
    ordinal: usize,
    config: ModelConfig,
    embed: DeviceBuffer<u16>,
    /// None when tied to the embedding (a quantized head is always its own
    /// copy).
    lm_head: Option<Weight>,
    final_norm: DeviceBuffer<u16>,
    layers: Vec<Layer>,
    inv_freq: DeviceBuffer<f32>,
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
    /// product): decode steps may hand norms over (`CudaForward::norm_handoff`;
    /// NANOINFER_CUDA_W4_HANDOFF=0 turns it off).
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
}

/// How rows of a prompt chunk attend (decode rows use `attention_decode_mma`
/// or `attention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PrefillKernel {
    /// Tensor-core flash attention over tiles of 64 rows (sm_80+, head_dim
    /// 64 or 128; NANOINFER_CUDA_FLASH=0 turns it off).
    Flash,
    /// Tiles of 16 rows sharing key blocks in shared memory, CUDA cores
    /// (head_dim <= 128; NANOINFER_CUDA_TILES=0 turns tiles off).
    Tiles,
    /// Row by row through the decode kernel.
    Rows,
}

impl PrefillKernel {
    fn choose(arch: (i32, i32), head_dim: usize) -> Self {
        if !cuda::switch_on("NANOINFER_CUDA_TILES") || head_dim > TILE_HD_MAX {
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

/// Uploads weights tensor by tensor, converting to the activation dtype on
/// the host where the checkpoint differs (zero-copy views otherwise); int4
/// projections are repacked for the int4 kernels.
struct Uploader<'a> {
    dev: &'a CudaDevice,
    src: &'a (dyn WeightSource + Sync),
    act: ActDType,
    /// The int4 format config.json names (projections load as stored).
    stored: Option<&'a dyn QuantMethod>,
    /// Quantization applied at load (`--quant awq|gptq`).
    method: Option<&'a dyn QuantMethod>,
    /// Pinned buffers the weights go through (None: plain pageable copies).
    staging: Option<Staging>,
    bytes: usize,
}

/// One projection part on the host, ready to upload.
enum HostPart {
    Dense(Matrix),
    Int4(W4Host),
}

impl Uploader<'_> {
    fn target(&self) -> WeightDType {
        match self.act {
            ActDType::BF16 => WeightDType::BF16,
            ActDType::F16 => WeightDType::F16,
        }
    }

    /// Weight `name` as stored, quantized at load, or dense.
    fn host_part(&self, name: &str, rows: usize, cols: usize) -> Result<HostPart> {
        self.host_part_as(name, rows, cols, self.stored, self.method)
    }

    /// `host_part` with these formats (the LM head's may differ).
    fn host_part_as(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        stored: Option<&dyn QuantMethod>,
        method: Option<&dyn QuantMethod>,
    ) -> Result<HostPart> {
        let m = super::decoder::linear_matrix(
            self.src,
            name,
            rows,
            cols,
            self.target(),
            stored,
            method,
        )?;
        match m.data {
            MatrixData::Q4(q) => W4Host::pack(&q)
                .map(HostPart::Int4)
                .map_err(|e| Error::new(ErrorKind::Unsupported, format!("{name}: {}", e.message))),
            MatrixData::BF16(_) | MatrixData::F16(_) => Ok(HostPart::Dense(m)),
            _ => Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{name}: {} weights are not supported on CUDA (bf16, f16, f32 converted at load, or int4 AWQ/GPTQ)",
                    m.dtype_name()
                ),
            )),
        }
    }

    /// The host parts of several projections, `jobs[i]` = its parts
    /// `(name, rows)` over `cols` inputs, made on all cores (int4 repacking
    /// and quantization at load are CPU-heavy).
    fn host_parts(
        &self,
        pool: &ThreadPool,
        jobs: &[(Vec<(String, usize)>, usize)],
    ) -> Result<Vec<Vec<HostPart>>> {
        let flat: Vec<(&str, usize, usize)> = jobs
            .iter()
            .flat_map(|(parts, cols)| parts.iter().map(move |(n, r)| (n.as_str(), *r, *cols)))
            .collect();
        let results: Vec<Mutex<Option<Result<HostPart>>>> =
            flat.iter().map(|_| Mutex::new(None)).collect();
        pool.run(flat.len(), &|i| {
            let (name, rows, cols) = flat[i];
            *results[i].lock().unwrap_or_else(|p| p.into_inner()) =
                Some(self.host_part(name, rows, cols));
        });
        let mut results = results.into_iter().map(|m| {
            m.into_inner()
                .unwrap_or_else(|p| p.into_inner())
                .expect("every job ran")
        });
        jobs.iter()
            .map(|(parts, _)| {
                parts
                    .iter()
                    .map(|_| results.next().expect("one per part"))
                    .collect()
            })
            .collect()
    }

    /// Parts stacked row-wise into one device matrix: all int4 or all dense.
    fn stack(
        &mut self,
        names: &[(String, usize)],
        cols: usize,
        parts: Vec<HostPart>,
    ) -> Result<Weight> {
        let w = if parts.iter().all(|p| matches!(p, HostPart::Int4(_))) {
            let hosts: Vec<W4Host> = parts
                .into_iter()
                .map(|p| match p {
                    HostPart::Int4(h) => h,
                    HostPart::Dense(_) => unreachable!("all int4"),
                })
                .collect();
            Weight::Int4(W4Matrix::upload(self.dev, &hosts, self.staging.as_mut())?)
        } else if parts.iter().all(|p| matches!(p, HostPart::Dense(_))) {
            let total: usize = names.iter().map(|p| p.1).sum();
            let mut buf = self.dev.alloc::<u16>(total * cols)?;
            let mut offset = 0;
            for p in &parts {
                let HostPart::Dense(m) = p else {
                    unreachable!("all dense")
                };
                let bits = raw_bits(m);
                self.dev
                    .upload_with(self.staging.as_mut(), bits, &mut buf, offset)?;
                offset += bits.len();
            }
            Weight::Dense(buf)
        } else {
            let list: Vec<&str> = names.iter().map(|n| n.0.as_str()).collect();
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{} are fused into one projection on CUDA and must be all int4 or all dense",
                    list.join(", ")
                ),
            ));
        };
        self.bytes += w.bytes();
        Ok(w)
    }

    /// The LM head unless it is the embedding table: as stored, or int4
    /// when the method quantizes heads (a tied head gets its own copy).
    fn lm_head(&mut self, c: &ModelConfig) -> Result<Option<Weight>> {
        let (v, d) = (c.vocab_size, c.hidden_size);
        let method = self.method.filter(|m| m.quantizes_lm_head());
        let name = if super::decoder::has_own_lm_head(self.src, c, self.stored) {
            "lm_head.weight"
        } else if method.is_some() {
            "model.embed_tokens.weight"
        } else {
            return Ok(None);
        };
        let part = self.host_part_as(name, v, d, self.stored, method)?;
        let head = self.stack(&[(name.to_string(), v)], d, vec![part])?;
        if let Weight::Int4(m) = &head {
            if m.has_perm() {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    "an act-order (desc_act) int4 LM head is not supported on CUDA",
                ));
            }
        }
        Ok(Some(head))
    }

    /// A dense `[rows, cols]` matrix (embeddings, LM head).
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<DeviceBuffer<u16>> {
        let m = self.src.matrix(name, rows, cols, self.target())?;
        if !matches!(m.data, MatrixData::BF16(_) | MatrixData::F16(_)) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{name}: {} weights are not supported on CUDA here",
                    m.dtype_name()
                ),
            ));
        }
        let bits = raw_bits(&m);
        let mut buf = self.dev.alloc::<u16>(bits.len())?;
        self.dev
            .upload_with(self.staging.as_mut(), bits, &mut buf, 0)?;
        self.bytes += buf.bytes();
        Ok(buf)
    }

    /// 1-D tensors concatenated.
    fn vectors(&mut self, parts: &[(&str, usize)]) -> Result<DeviceBuffer<u16>> {
        let mut host = Vec::new();
        for &(name, len) in parts {
            host.extend(self.src.vector(name, len)?);
        }
        let mut buf = self.dev.alloc::<u16>(host.len())?;
        self.dev.upload(&self.act.encode(&host), &mut buf)?;
        self.bytes += buf.bytes();
        Ok(buf)
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<DeviceBuffer<u16>> {
        self.vectors(&[(name, len)])
    }

    fn optional(&mut self, name: &str, len: usize, on: bool) -> Result<Option<DeviceBuffer<u16>>> {
        if on {
            self.vector(name, len).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// The raw 16-bit values of a bf16 or f16 matrix (empty for others).
fn raw_bits(m: &Matrix) -> &[u16] {
    match &m.data {
        // SAFETY: Bf16 and F16 are repr(transparent) over u16.
        MatrixData::BF16(v) => unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len()) },
        // SAFETY: as above.
        MatrixData::F16(v) => unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len()) },
        _ => &[],
    }
}

/// The activation dtype: f16 when asked for, else bf16 (F32 checkpoints are
/// converted at load).
fn act_dtype(dtype: WeightDType) -> Result<ActDType> {
    match dtype {
        WeightDType::F16 => Ok(ActDType::F16),
        WeightDType::BF16 | WeightDType::Auto => Ok(ActDType::BF16),
        WeightDType::F32 => Err(Error::new(
            ErrorKind::Unsupported,
            "the CUDA backend computes in bf16 or f16; use dtype bf16, f16 or auto",
        )),
    }
}

/// Layers whose projections are prepared on the host at once (bounds the
/// host memory of converted or repacked weights).
const LOAD_LAYERS_AT_ONCE: usize = 4;

/// Loads the model onto CUDA device `ordinal`; `quant` quantizes dense
/// projections to int4 at load (AWQ/GPTQ round-to-nearest).
pub fn load(
    ordinal: usize,
    config: ModelConfig,
    src: &(dyn WeightSource + Sync),
    dtype: WeightDType,
    quant: QuantMode,
) -> Result<Arc<dyn DeviceDecoder>> {
    let act = act_dtype(dtype)?;
    let c = &config;
    if c.hidden_size > MAX_HIDDEN || !c.hidden_size.is_multiple_of(8) {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "hidden_size {} is not supported on CUDA (a multiple of 8, at most {MAX_HIDDEN})",
                c.hidden_size
            ),
        ));
    }
    if !matches!(c.head_dim, 32 | 64 | 128 | 256) {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "head_dim {} is not supported on CUDA (32, 64, 128 or 256)",
                c.head_dim
            ),
        ));
    }
    if src.contains("model.layers.0.self_attn.q_proj.weight_scale") {
        return Err(Error::new(
            ErrorKind::Unsupported,
            "q8_0 checkpoints are not supported on CUDA (int4 AWQ/GPTQ and 16-bit ones are)",
        ));
    }
    if matches!(quant, QuantMode::Q8_0 { .. }) {
        return Err(Error::new(
            ErrorKind::Unsupported,
            "q8_0 quantization is not supported on CUDA (use awq or gptq for int4)",
        ));
    }
    let method = quant.method()?;
    let dev = CudaDevice::open(ordinal, act)?;
    if (method.is_some() || c.quantization.is_some()) && dev.arch.0 < 8 {
        // kernels/int4.cu multiplies on tensor cores (mma.sync m16n8k16).
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "int4 weights need a GPU of compute capability 8.0 or newer; {} is {}.{}",
                dev.name, dev.arch.0, dev.arch.1
            ),
        ));
    }
    let start = Instant::now();
    let mut up = Uploader {
        dev: &dev,
        src,
        act,
        stored: c.quantization.as_ref().map(|q| q as &dyn QuantMethod),
        method: method.as_deref(),
        // NANOINFER_CUDA_PINNED=0: plain pageable copies (for comparison).
        staging: if cuda::switch_on("NANOINFER_CUDA_PINNED") {
            dev.staging()
        } else {
            None
        },
        bytes: 0,
    };
    let (d, hd, inter) = (c.hidden_size, c.head_dim, c.intermediate_size);
    let (nq, nkv) = (c.num_heads * hd, c.num_kv_heads * hd);
    let pool = ThreadPool::try_new(crate::limits::resolve_threads(0)?)?;
    let mut layers = Vec::with_capacity(c.num_layers);
    for first in (0..c.num_layers).step_by(LOAD_LAYERS_AT_ONCE) {
        let span = first..(first + LOAD_LAYERS_AT_ONCE).min(c.num_layers);
        let jobs: Vec<(Vec<(String, usize)>, usize)> = span
            .clone()
            .flat_map(|i| {
                let n = |s: &str| format!("model.layers.{i}.{s}");
                [
                    (
                        vec![
                            (n("self_attn.q_proj.weight"), nq),
                            (n("self_attn.k_proj.weight"), nkv),
                            (n("self_attn.v_proj.weight"), nkv),
                        ],
                        d,
                    ),
                    (vec![(n("self_attn.o_proj.weight"), d)], nq),
                    (
                        vec![
                            (n("mlp.gate_proj.weight"), inter),
                            (n("mlp.up_proj.weight"), inter),
                        ],
                        d,
                    ),
                    (vec![(n("mlp.down_proj.weight"), d)], inter),
                ]
            })
            .collect();
        let mut host = up.host_parts(&pool, &jobs)?.into_iter();
        let mut jobs = jobs.iter();
        for i in span {
            let mut next = || {
                let (names, cols) = jobs.next().expect("four jobs per layer");
                up.stack(names, *cols, host.next().expect("four jobs per layer"))
            };
            let (qkv, o, gate_up, down) = (next()?, next()?, next()?, next()?);
            let n = |s: &str| format!("model.layers.{i}.{s}");
            let qkv_bias = if c.qkv_bias {
                Some(up.vectors(&[
                    (&n("self_attn.q_proj.bias"), nq),
                    (&n("self_attn.k_proj.bias"), nkv),
                    (&n("self_attn.v_proj.bias"), nkv),
                ])?)
            } else {
                None
            };
            layers.push(Layer {
                input_norm: up.vector(&n("input_layernorm.weight"), d)?,
                qkv,
                qkv_bias,
                o,
                o_bias: up.optional(&n("self_attn.o_proj.bias"), d, c.o_bias)?,
                q_norm: up.optional(&n("self_attn.q_norm.weight"), hd, c.qk_norm)?,
                k_norm: up.optional(&n("self_attn.k_norm.weight"), hd, c.qk_norm)?,
                post_norm: up.vector(&n("post_attention_layernorm.weight"), d)?,
                gate_up,
                down,
            });
        }
    }
    let embed = up.matrix("model.embed_tokens.weight", c.vocab_size, d)?;
    let lm_head = up.lm_head(c)?;
    let final_norm = up.vector("model.norm.weight", d)?;
    let mut inv_freq = dev.alloc::<f32>(hd / 2)?;
    dev.upload(&c.rope_inv_freq(), &mut inv_freq)?;
    dev.synchronize()?;
    let resident_bytes = up.bytes;
    let load_pinned = up.staging.is_some();
    // The largest `f` over the int4 projections (0 without any).
    let int4_max = |f: fn(&W4Matrix) -> usize| {
        layers
            .iter()
            .flat_map(|l| l.projections())
            .filter_map(|w| w.int4().map(f))
            .max()
            .unwrap_or(0)
    };
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
    let w4_handoff = cuda::switch_on("NANOINFER_CUDA_W4_HANDOFF")
        && layers.iter().all(|l| {
            l.q_norm.is_none() && l.projections().iter().all(|w| matches!(w, Weight::Int4(_)))
        });
    Ok(Arc::new(CudaDecoder {
        dev: dev.clone(),
        ordinal,
        embed,
        lm_head,
        final_norm,
        layers,
        inv_freq,
        resident_bytes,
        load_seconds: start.elapsed().as_secs_f64(),
        load_pinned,
        prefill: PrefillKernel::choose(dev.arch, config.head_dim),
        decode_mma: decode_mma_fits(dev.arch, &config),
        w4_mma_rows,
        w4_gemm_rows,
        w4_handoff,
        w4_packed_inputs,
        w4_max_elems,
        w4_max_cols,
        w4_perm_cols,
        config,
    }))
}

/// Tensor-core decode attention needs sm_80+, head_dim 64 or 128 and at most
/// DA_GROUP_MAX query heads per kv head (NANOINFER_CUDA_DECODE_MMA=0 turns it
/// off).
fn decode_mma_fits(arch: (i32, i32), c: &ModelConfig) -> bool {
    cuda::switch_on("NANOINFER_CUDA_DECODE_MMA")
        && arch.0 >= 8
        && matches!(c.head_dim, 64 | 128)
        && c.num_heads / c.num_kv_heads <= DA_GROUP_MAX
}

/// `CudaDecoder::w4_mma_rows` where the int4 GEMM takes larger batches
/// (sm_90). The GEMM's time is flat up to 128 rows (one block of
/// activation rows); the int4 kernels' grows with their passes over the
/// weights (32, 16 or 8 rows each). H100, 8B shapes (docs/benchmarks-log.md), prefill
/// tok/s: 48 tokens 7 916 through the int4 kernels (a 32- and a 16-row
/// pass) against 6 796 through the GEMM; 64 tokens 8 865 (two 32-row
/// passes) against 9 053; 128 tokens 9 483 against 17 459 (bf16 16 644).
const W4_MMA_ROWS_BEFORE_GEMM: usize = 48;
/// `CudaDecoder::w4_mma_rows` where larger batches dequantize for cuBLAS,
/// which writes and rereads 2 bytes a weight: up to four passes of the int4
/// kernels are cheaper.
const W4_MMA_ROWS_BEFORE_DEQUANT: usize = 128;
/// See `CudaDecoder::w4_gemm_rows`: where the int4 GEMM stops beating
/// dequantization + cuBLAS (H100, 8B shapes: 14 % faster per gate/up
/// product at 512 rows, 7 % slower at 2048).
const DEFAULT_W4_GEMM_ROWS: usize = 1024;

/// Per-session temporaries, sized once for the context's largest step.
struct Workspace {
    hidden: DeviceBuffer<u16>,
    normed: DeviceBuffer<u16>,
    qkv: DeviceBuffer<u16>,
    attn: DeviceBuffer<u16>,
    /// Output of o_proj / down_proj: the residual's next delta.
    delta: DeviceBuffer<u16>,
    gate_up: DeviceBuffer<u16>,
    act: DeviceBuffer<u16>,
    head_in: DeviceBuffer<u16>,
    logits: DeviceBuffer<f32>,
    part_o: DeviceBuffer<f32>,
    part_ml: DeviceBuffer<f32>,
    /// (cos, sin) per row and rotary frequency of this step (rope_table).
    rope_cs: DeviceBuffer<f32>,
    /// Two sets of HANDOFF_ROWS sums of squares for int4 norm handoffs,
    /// used in turn (see `CudaDecoder::norm_handoff`): 64-bit fixed point,
    /// two f32s each.
    norm_sums: DeviceBuffer<f32>,
    /// Step inputs (tokens, slots, positions, tables), uploaded once per step.
    inputs: DeviceBuffer<u32>,
    /// Greedy token ids of the logits rows.
    argmax: DeviceBuffer<u32>,
    /// Per-slice (logit, index) keys of argmax_partial.
    argmax_part: DeviceBuffer<u64>,
    /// Int4 batches above `w4_mma_rows`: the int4 GEMM's packed
    /// activations, or (GPUs without it) the weights dequantized for cuBLAS.
    w4_scratch: Option<DeviceBuffer<u16>>,
    /// Activations gathered for act-order int4 weights.
    w4_x: Option<DeviceBuffer<u16>>,
}

/// Sizes of the workspace buffers in elements, in field order.
struct WorkspaceSizes {
    act16: [usize; 8],
    f32s: [usize; 5],
    inputs: usize,
    w4_scratch: usize,
    w4_x: usize,
}

impl WorkspaceSizes {
    /// Bytes of each buffer `new_workspace` allocates, in its order (keep
    /// the two in step: a `CudaBuddy` is sized by replaying this list).
    fn buffer_bytes(&self, logits_rows: usize) -> Vec<usize> {
        let l = logits_rows.max(1);
        let mut v: Vec<usize> = self.act16.iter().map(|&n| n.max(1) * 2).collect();
        v.extend(self.f32s.iter().map(|&n| n.max(1) * 4));
        v.push(self.inputs.max(1) * 4);
        v.push(l * 4);
        v.push(l * ARGMAX_SPLITS * 8);
        v.extend(
            [self.w4_scratch, self.w4_x]
                .into_iter()
                .filter(|&n| n > 0)
                .map(|n| n * 2),
        );
        v
    }
}

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

impl CudaDecoder {
    fn attn_partials(&self) -> usize {
        2 * ATTN_GROUP * ATTN_BLOCKS_PER_SM * self.dev.sm_count
    }

    fn workspace_sizes(&self, shape: &ContextShape) -> WorkspaceSizes {
        let c = &self.config;
        let (r, l) = (shape.max_rows.max(1), shape.max_logits_rows.max(1));
        let (d, hd, inter) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (nq, nkv) = (c.num_heads * hd, c.num_kv_heads * hd);
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
                l * c.vocab_size,
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
    fn w4_scratch_elems(&self, r: usize) -> usize {
        if r <= self.w4_mma_rows || self.w4_max_elems == 0 {
            return 0;
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
        gemm.max(dequant)
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
        let c = &self.config;
        2 * c.num_layers * c.num_kv_heads * c.head_dim * dtype.element_bytes(ACT_BYTES)
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
    fn create_context(self: Arc<Self>, shape: &ContextShape) -> Result<CudaForward> {
        let pool = self.new_pool(shape)?;
        // The KV buffer first: a buddy region's largest block.
        let kv = self.dev.alloc_in::<u16>(&pool, self.kv_words(shape))?;
        let ws = self.new_workspace(shape, &pool)?;
        let inputs_len = ws.inputs.len();
        Ok(CudaForward {
            slots: shape.kv_slots,
            max_rows: shape.max_rows,
            max_logits_rows: shape.max_logits_rows,
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
        let c = &self.config;
        let rows = shape.max_rows.max(1);
        let max_pos = c.max_position_embeddings.max(1);
        let n_seqs = shape
            .max_logits_rows
            .clamp(1, rows)
            .max(rows.div_ceil(max_pos));
        let mut tiny = *shape;
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
        let mut logits = vec![0f32; logits_rows.len() * c.vocab_size];
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

impl DeviceDecoder for CudaDecoder {
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }
    fn weight_dtype_name(&self) -> &'static str {
        if self.w4_max_elems > 0 {
            "int4"
        } else {
            self.dev.act.name()
        }
    }
    fn lm_head_dtype_name(&self) -> &'static str {
        match self.lm_head {
            Some(Weight::Int4(_)) => "int4",
            _ => self.dev.act.name(),
        }
    }
    fn weight_bytes(&self) -> usize {
        let c = &self.config;
        // Per step: every layer and the LM head, not the embedding table.
        let embed = c.vocab_size * c.hidden_size * 2;
        let tied = self.lm_head.is_none();
        self.resident_bytes - if tied { 0 } else { embed }
    }
    fn threads(&self) -> usize {
        1
    }
    fn kv_bytes_per_slot(&self, dtype: KvCacheDType) -> Result<usize> {
        Ok(self.kv_slot_bytes(dtype))
    }
    fn default_kv_budget(self: Arc<Self>, shape: &ContextShape) -> Result<KvBudget> {
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
    fn memory(&self, shape: &ContextShape) -> DeviceMemory {
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
    fn new_context(self: Arc<Self>, shape: &ContextShape) -> Result<Box<dyn ForwardContext>> {
        Ok(Box::new(self.create_context(shape)?))
    }
    fn summary(&self) -> String {
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

/// One session's KV cache and workspace on the GPU.
struct CudaForward {
    model: Arc<CudaDecoder>,
    slots: usize,
    max_rows: usize,
    max_logits_rows: usize,
    /// `[layer][k | v][slot][kv_heads * head_dim]` of the activation dtype,
    /// or of fp8 bytes (`kv_dtype`).
    kv: DeviceBuffer<u16>,
    kv_dtype: KvCacheDType,
    ws: Workspace,
    /// Swap staging, allocated on first use.
    staging: Option<DeviceBuffer<u16>>,
    /// Host side of `ws.inputs`.
    host: Vec<u32>,
    /// Encoded sampling records of this step, and their device copy
    /// (grown on demand).
    sampling_words: Vec<u32>,
    sampling_params: Option<DeviceBuffer<u32>>,
    /// Captured decode steps by padded batch size and attention splits
    /// (see `run`).
    graphs: HashMap<(usize, usize), Graph>,
    use_graphs: bool,
    /// Argmax ids of launched steps on their way to the host (allocated
    /// at the first launch).
    pending: Option<PendingIds>,
    /// Rows of argmax ids the last forward left in `ws.argmax` when it was
    /// a launch (`ForwardContext::launch`), which a chained launch may read.
    launched_ids: Option<usize>,
    /// `ForwardContext::overlaps_steps` (NANOINFER_CUDA_OVERLAP=0: off).
    overlap: bool,
    /// Where `kv` and `ws` come from (each buffer holds it too, so it
    /// outlives them). Swap staging and a grown `ws.inputs` come from the
    /// driver: rare, and a buddy region has no room planned for them.
    pool: Arc<dyn DevicePool>,
    pool_kind: MemoryPoolKind,
    /// The analytic workspace size.
    planned_bytes: usize,
}

impl Drop for CudaForward {
    fn drop(&mut self) {
        if self.pending.as_ref().is_some_and(|p| !p.is_empty()) {
            // A launched step may still use the buffers freed after this.
            let _ = self.model.dev.synchronize();
        }
    }
}

/// Where a projection's input rows come from.
#[derive(Debug, Clone, Copy)]
enum ProjInput {
    /// Rows already normalized: in `normed`, or packed for the int4 GEMM
    /// in its scratch (`add_rms_norm_w4g`).
    Normed(LinearInput),
    /// The residual stream `hidden`, to normalize with this norm weight.
    Residual(u64),
    /// `normed` written by a norm handoff (`norm_handoff`): x · the norm
    /// weight, each row's sum of squares of x in `sums`; the product also
    /// clears `clear`, the next handoff's sums.
    Handoff { sums: u64, clear: u64 },
}

/// The activations a product multiplies.
#[derive(Debug, Clone, Copy)]
enum LinearInput {
    /// Rows at this address.
    Rows(u64),
    /// Their image packed for the int4 GEMM (as `w4_gemm_pack_x` packs),
    /// in its scratch: written by the kernel before the product.
    W4Packed,
}

impl LinearInput {
    /// The rows' address, for kernels that read rows.
    fn rows(self) -> Result<u64> {
        match self {
            LinearInput::Rows(x) => Ok(x),
            LinearInput::W4Packed => Err(Error::new(
                ErrorKind::Internal,
                "activations packed for the int4 GEMM went to a kernel that reads rows",
            )),
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
struct Inputs {
    /// Rows computed (padded for a graph replay).
    rows: usize,
    /// Rows whose logits are computed.
    n_out: usize,
    tokens: usize,
    write_slots: usize,
    positions: usize,
    table_off: usize,
    logits_rows: usize,
    /// `n_tiles` first rows then `n_tiles` row counts of prefill tiles.
    tiles: usize,
    n_tiles: usize,
    /// Rows that attend through the decode kernel: a list of rows (offset)
    /// when prefill tiles take the others, else all `rows`.
    decode_rows: Option<usize>,
    n_decode: usize,
    slot_list: usize,
}

impl CudaForward {
    fn kv_width(&self) -> usize {
        let c = &self.model.config;
        c.num_kv_heads * c.head_dim
    }

    /// 16-bit words of one slot of one layer's keys (or values).
    fn kv_row_words(&self) -> usize {
        self.kv_width() * self.kv_dtype.element_bytes(ACT_BYTES) / 2
    }

    /// Whether the cache holds fp8 (the kernels' `_fp8` variants and flags).
    fn kv_fp8(&self) -> bool {
        self.kv_dtype == KvCacheDType::Fp8E4m3
    }

    /// Device addresses of layer `l`'s key and value caches.
    fn layer_kv(&self, l: usize) -> (u64, u64) {
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
    fn attention_blocks(&self) -> usize {
        let c = &self.model.config;
        if self.model.decode_mma {
            return c.num_kv_heads;
        }
        c.num_kv_heads * (c.num_heads / c.num_kv_heads).div_ceil(ATTN_GROUP)
    }

    /// Attention splits for this step: enough blocks to fill the GPU when
    /// few rows attend over long contexts (flash-decoding), one otherwise.
    fn attention_splits(&self, rows: usize, longest: usize) -> usize {
        let m = &self.model;
        let heads = m.config.num_heads;
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
                let graph = dev.capture(|| self.enqueue(&inputs, splits))?;
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
        self.enqueue(&inputs, splits)?;
        self.read_output(batch.logits_rows.len(), out)
    }

    /// Checks `batch` against the model (`logits_len`: the room for its
    /// logits) and against this context's limits.
    fn check_batch(&self, batch: &ForwardBatch<'_>, logits_len: usize) -> Result<()> {
        validate_batch(&self.model.config, batch, self.slots, logits_len)?;
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
        let vocab = self.model.config.vocab_size;
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
        let vocab = self.model.config.vocab_size;
        if let Some((sampling, masks)) = sampling {
            let params = self.upload_sampling(sampling, masks)?;
            let (logits, ids) = (self.ws.logits.ptr(), self.ws.argmax.ptr());
            return cuda::sampling::enqueue(&dev, logits, vocab, n_out, params, ids);
        }
        dev.launch(
            &dev.kernels.argmax_partial,
            (n_out as u32, ARGMAX_SPLITS as u32, 1),
            256,
            &[
                KArg::Ptr(self.ws.logits.ptr()),
                KArg::I32(vocab as i32),
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
        let vocab = self.model.config.vocab_size;
        cuda::sampling::encode_filled(sampling, vocab, &mut self.sampling_words, masks);
        let words = &self.sampling_words;
        let params = match &mut self.sampling_params {
            Some(b) if b.len() >= words.len() => b,
            slot => slot.insert(dev.alloc::<u32>(words.len().next_power_of_two())?),
        };
        dev.upload(words, params)?;
        Ok(params.ptr())
    }

    /// `out[j] = rmsnorm(hidden[r] (+= delta[r])) * w` for `n` output rows;
    /// `rows` (a device list, or `KArg::Ptr(0)`) maps output rows to input rows.
    fn add_rms_norm(&self, n: u32, delta: u64, rows: KArg, w: u64, out: u64) -> Result<()> {
        let c = &self.model.config;
        self.model.dev.launch(
            &self.model.dev.kernels.add_rms_norm,
            (n, 1, 1),
            norm_threads(c.hidden_size),
            &[
                KArg::Ptr(self.ws.hidden.ptr()),
                KArg::Ptr(delta),
                rows,
                KArg::Ptr(w),
                KArg::Ptr(out),
                KArg::I32(c.hidden_size as i32),
                KArg::F32(c.rms_norm_eps),
            ],
        )
    }

    /// `w`'s int4 matrix when a batch of `rows` rows runs through the int4
    /// kernels.
    fn w4_direct<'w>(&self, w: &'w Weight, rows: usize) -> Option<&'w W4Matrix> {
        w.int4().filter(|_| rows <= self.model.w4_mma_rows)
    }

    /// The scratch of int4 batches above the fused kernels' rows.
    fn w4_scratch(&self) -> Result<u64> {
        let scratch = self.ws.w4_scratch.as_ref().ok_or_else(|| {
            Error::new(
                ErrorKind::Internal,
                "int4 batch above the kernel limit without its scratch",
            )
        })?;
        Ok(scratch.ptr())
    }

    /// The activations `m` multiplies (gathered for act-order weights).
    fn w4_input(&self, x: u64, rows: usize, m: &W4Matrix) -> Result<u64> {
        let scratch = self.ws.w4_x.as_ref().map_or(0, |b| b.ptr());
        self.model.dev.w4_input(x, rows, m, scratch)
    }

    /// `y = x · wᵀ (+ bias)` in the activation dtype.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        &self,
        x: LinearInput,
        w: &Weight,
        bias: Option<&DeviceBuffer<u16>>,
        y: u64,
        rows: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        let dev = &self.model.dev;
        match (w, x) {
            (Weight::Int4(m), LinearInput::W4Packed) if self.model.w4_gemm_takes(rows) => {
                dev.w4_gemm_packed(rows, m, y, self.w4_scratch()?)?
            }
            (Weight::Int4(m), LinearInput::Rows(x)) if self.model.w4_gemm_takes(rows) => {
                dev.w4_gemm(x, rows, m, y, self.w4_scratch()?)?
            }
            (Weight::Dense(b), x) => dev.gemm(x.rows()?, b.ptr(), y, rows, n, k, GemmDType::Act)?,
            (Weight::Int4(m), x) => {
                let x = self.w4_input(x.rows()?, rows, m)?;
                if rows <= self.model.w4_mma_rows {
                    dev.w4_mm(x, rows, m, W4Out::Act { y }, W4Norm::None)?
                } else {
                    let dense = self.w4_scratch()?;
                    dev.w4_dequant(m, dense)?;
                    dev.gemm(x, dense, y, rows, n, k, GemmDType::Act)?
                }
            }
        }
        match bias {
            None => Ok(()),
            Some(b) => dev.launch(
                &dev.kernels.add_bias,
                (rows as u32, 1, 1),
                256,
                &[KArg::Ptr(y), KArg::Ptr(b.ptr()), KArg::I32(n as i32)],
            ),
        }
    }

    /// Whether a step of `rows` rows runs the residual stream through the
    /// projections: QKV and gate/up read the residual and norm it on the
    /// fly, o and down add their output into it (every projection a GEMV
    /// or an int4 MMA kernel that can, no o_proj bias to add).
    fn residual_in_projections(&self, rows: usize) -> bool {
        let m = &*self.model;
        let (c, dev) = (&m.config, &*m.dev);
        let (d, nq, inter) = (c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size);
        let norms = |w: &Weight, k: usize| match w {
            Weight::Dense(_) => dev.gemv_fits(rows, k),
            Weight::Int4(q) => self.w4_direct(w, rows).is_some() && dev.w4_norm_fits(rows, q),
        };
        let adds = |w: &Weight, k: usize| match w {
            Weight::Dense(_) => dev.gemv_fits(rows, k),
            Weight::Int4(_) => self.w4_direct(w, rows).is_some(),
        };
        !c.o_bias
            && m.layers.iter().all(|l| {
                norms(&l.qkv, d) && adds(&l.o, nq) && norms(&l.gate_up, d) && adds(&l.down, inter)
            })
    }

    /// `hidden[rows, n] += x · wᵀ`: the o and down projections when the
    /// residual stream runs through the projections; with `handoff` (int4
    /// only, see `norm_handoff`) also the next norm's input.
    fn add_to_residual(
        &self,
        x: u64,
        w: &Weight,
        (rows, n, k): (usize, usize, usize),
        handoff: Option<W4Handoff>,
    ) -> Result<()> {
        let dev = &self.model.dev;
        let y = self.ws.hidden.ptr();
        match w {
            Weight::Dense(b) if handoff.is_none() => {
                dev.gemv(x, b.ptr(), y, (rows, n, k), GemvOut::ResidualAdd, None)
            }
            Weight::Dense(_) => Err(Error::new(
                ErrorKind::Internal,
                "a norm handoff needs int4 o and down projections",
            )),
            Weight::Int4(m) => {
                let x = self.w4_input(x, rows, m)?;
                dev.w4_mm(x, rows, m, W4Out::Residual { y, handoff }, W4Norm::None)
            }
        }
    }

    /// Whether a decode step of `rows` rows that keeps the residual stream
    /// in the projections (`residual_in_projections`) also hands each norm
    /// from the residual-adding product (o, down) to the next paired
    /// product (gate/up, the next layer's QKV): the int4 kernels'
    /// [`W4Handoff`], so those multiply ready rows instead of norming the
    /// residual themselves (H100, 8B shape: int4 decode +5-6 %).
    fn norm_handoff(&self, rows: usize) -> bool {
        self.model.w4_handoff && rows <= HANDOFF_ROWS
    }

    /// Sums of squares set `i % 2` (norm `i` of the step: 2·layer for the
    /// input norm, 2·layer + 1 for the post-attention norm).
    fn norm_sums(&self, i: usize) -> u64 {
        self.ws.norm_sums.ptr() + ((i % 2) * HANDOFF_ROWS * 8) as u64
    }

    /// The rows an int4 paired product reads and how it norms them.
    fn w4_projection_input(
        &self,
        input: ProjInput,
        rows: usize,
        m: &W4Matrix,
    ) -> Result<(u64, W4Norm)> {
        let eps = self.model.config.rms_norm_eps;
        if let ProjInput::Handoff { sums, clear } = input {
            return Ok((self.ws.normed.ptr(), W4Norm::Sums { sums, eps, clear }));
        }
        let (x, norm) = self.projection_input(input, rows, self.model.dev.w4_norm_fits(rows, m))?;
        let norm = norm.map_or(W4Norm::None, |(weight, eps)| W4Norm::Stage { weight, eps });
        Ok((self.w4_input(x.rows()?, rows, m)?, norm))
    }

    /// The rows a projection reads (x) and the norm it applies on the fly:
    /// only the GEMV and small-batch int4 kernels can norm on the fly, so
    /// otherwise the residual is normed into `normed` first.
    fn projection_input(
        &self,
        input: ProjInput,
        rows: usize,
        fused: bool,
    ) -> Result<(LinearInput, Option<(u64, f32)>)> {
        let ws = &self.ws;
        match input {
            ProjInput::Normed(x) => Ok((x, None)),
            ProjInput::Handoff { .. } => Err(Error::new(
                ErrorKind::Internal,
                "a norm handoff goes to int4 paired products only",
            )),
            ProjInput::Residual(nw) if fused => Ok((
                LinearInput::Rows(ws.hidden.ptr()),
                Some((nw, self.model.config.rms_norm_eps)),
            )),
            ProjInput::Residual(nw) => {
                self.add_rms_norm(rows as u32, 0, KArg::Ptr(0), nw, ws.normed.ptr())?;
                Ok((LinearInput::Rows(ws.normed.ptr()), None))
            }
        }
    }

    /// q, k, v of the input rows: q (with RoPE) into the QKV rows, k (with
    /// RoPE) and v into the layer's cache slots. Decode batches of models
    /// without q/k norms take one fused GEMV for all of it.
    fn qkv_rope_kv_write(
        &self,
        layer: &Layer,
        inputs: &Inputs,
        (kc, vc): (u64, u64),
        input: ProjInput,
    ) -> Result<()> {
        let m = &*self.model;
        let (dev, c, ws) = (&*m.dev, &m.config, &self.ws);
        let k = &dev.kernels;
        let (rows, d, hd) = (inputs.rows, c.hidden_size, c.head_dim);
        let r32 = rows as u32;
        let (nq, nkv) = (c.num_heads * hd, c.num_kv_heads * hd);
        let qkv_w = nq + 2 * nkv;
        let inp = |o: usize| KArg::Ptr(ws.inputs.at(o));
        if let Some(m) = self
            .w4_direct(&layer.qkv, rows)
            .filter(|_| layer.q_norm.is_none())
        {
            let (x, norm) = self.w4_projection_input(input, rows, m)?;
            let epilogue = QkvEpilogue {
                qkv: ws.qkv.ptr(),
                bias: layer.qkv_bias.as_ref().map_or(0, |b| b.ptr()),
                rope_cs: ws.rope_cs.ptr(),
                slots: ws.inputs.at(inputs.write_slots),
                k_cache: kc,
                v_cache: vc,
                kv_fp8: self.kv_fp8(),
                nq,
                nkv,
                head_dim: hd,
            };
            return dev.w4_mm(x, rows, m, W4Out::Qkv(epilogue), norm);
        }
        let fused = layer
            .qkv
            .dense()
            .filter(|_| dev.gemv_fits(rows, d) && layer.q_norm.is_none());
        let (x, norm) = self.projection_input(input, rows, fused.is_some())?;
        let (nw, eps) = norm.unwrap_or((0, 0.0));
        if let Some(qkv) = fused {
            return dev.launch_gemv(
                GemvFamily::QkvRope,
                qkv_w / 2,
                (rows, qkv_w, d),
                &[
                    KArg::Ptr(x.rows()?),
                    KArg::Ptr(qkv.ptr()),
                    KArg::Ptr(layer.qkv_bias.as_ref().map_or(0, |b| b.ptr())),
                    KArg::Ptr(ws.qkv.ptr()),
                    KArg::Ptr(ws.rope_cs.ptr()),
                    inp(inputs.write_slots),
                    KArg::Ptr(kc),
                    KArg::Ptr(vc),
                    KArg::I32(nq as i32),
                    KArg::I32(nkv as i32),
                    KArg::I32(hd as i32),
                    KArg::I32(d as i32),
                    KArg::I32(rows as i32),
                    KArg::Ptr(nw),
                    KArg::F32(eps),
                    KArg::I32(self.kv_fp8() as i32),
                ],
            );
        }
        self.linear(
            x,
            &layer.qkv,
            layer.qkv_bias.as_ref(),
            ws.qkv.ptr(),
            rows,
            qkv_w,
            d,
        )?;
        if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
            for (w, offset, heads) in [(qn, 0, c.num_heads), (kn, nq, c.num_kv_heads)] {
                dev.launch(
                    &k.head_rms_norm,
                    (r32, heads as u32, 1),
                    32,
                    &[
                        KArg::Ptr(ws.qkv.ptr()),
                        KArg::Ptr(w.ptr()),
                        KArg::I32(qkv_w as i32),
                        KArg::I32(offset as i32),
                        KArg::I32(hd as i32),
                        KArg::F32(c.rms_norm_eps),
                    ],
                )?;
            }
        }
        // q and k heads are adjacent in the fused row: one pass over both.
        dev.launch(
            &k.rope,
            (r32, 1, 1),
            256,
            &[
                KArg::Ptr(ws.qkv.ptr()),
                KArg::Ptr(ws.rope_cs.ptr()),
                KArg::I32(qkv_w as i32),
                KArg::I32((c.num_heads + c.num_kv_heads) as i32),
                KArg::I32(hd as i32),
            ],
        )?;
        let kv_write = if self.kv_fp8() {
            &k.kv_write_fp8
        } else {
            &k.kv_write
        };
        dev.launch(
            kv_write,
            (r32, 1, 1),
            256,
            &[
                KArg::Ptr(ws.qkv.ptr()),
                KArg::I32(qkv_w as i32),
                KArg::I32(nq as i32),
                KArg::I32((nq + nkv) as i32),
                inp(inputs.write_slots),
                KArg::Ptr(kc),
                KArg::Ptr(vc),
                KArg::I32(nkv as i32),
            ],
        )
    }

    /// Attention of every row into `attn`: prompt chunks through the
    /// prefill kernel by tiles, the decode rows through the split decode
    /// kernel (and the merge of its splits).
    fn attend(&self, inputs: &Inputs, (kc, vc): (u64, u64), splits: usize) -> Result<()> {
        let m = &*self.model;
        let (dev, c, ws) = (&*m.dev, &m.config, &self.ws);
        let k = &dev.kernels;
        let hd = c.head_dim;
        let qkv_w = (c.num_heads + 2 * c.num_kv_heads) * hd;
        let scale = 1.0 / (hd as f32).sqrt();
        let inp = |o: usize| KArg::Ptr(ws.inputs.at(o));
        if inputs.n_tiles > 0 {
            let kernel = match (m.prefill, self.kv_fp8()) {
                (PrefillKernel::Flash, false) => &k.attention_flash,
                (PrefillKernel::Flash, true) => &k.attention_flash_fp8,
                (_, false) => &k.attention_tiles,
                (_, true) => &k.attention_tiles_fp8,
            };
            dev.launch(
                kernel,
                (c.num_heads as u32, inputs.n_tiles as u32, 1),
                TILE_THREADS,
                &[
                    KArg::Ptr(ws.qkv.ptr()),
                    KArg::I32(qkv_w as i32),
                    KArg::Ptr(kc),
                    KArg::Ptr(vc),
                    inp(inputs.slot_list),
                    inp(inputs.table_off),
                    inp(inputs.positions),
                    inp(inputs.tiles),
                    inp(inputs.tiles + inputs.n_tiles),
                    KArg::I32(c.num_heads as i32),
                    KArg::I32(c.num_kv_heads as i32),
                    KArg::I32(hd as i32),
                    KArg::F32(scale),
                    KArg::Ptr(ws.attn.ptr()),
                ],
            )?;
        }
        if inputs.n_decode == 0 {
            return Ok(());
        }
        let row_list = inputs.decode_rows.map_or(KArg::Ptr(0), inp);
        let n_decode = inputs.n_decode as u32;
        let (kernel, threads) = match (m.decode_mma, self.kv_fp8()) {
            (true, false) => (&k.attention_decode_mma, DA_THREADS),
            (true, true) => (&k.attention_decode_mma_fp8, DA_THREADS),
            (false, false) => (&k.attention, ATTN_THREADS),
            (false, true) => (&k.attention_fp8, ATTN_THREADS),
        };
        dev.launch(
            kernel,
            (self.attention_blocks() as u32, n_decode, splits as u32),
            threads,
            &[
                KArg::Ptr(ws.qkv.ptr()),
                KArg::I32(qkv_w as i32),
                KArg::Ptr(kc),
                KArg::Ptr(vc),
                inp(inputs.slot_list),
                inp(inputs.table_off),
                inp(inputs.positions),
                KArg::I32(c.num_heads as i32),
                KArg::I32(c.num_kv_heads as i32),
                KArg::I32(hd as i32),
                KArg::F32(scale),
                KArg::Ptr(ws.attn.ptr()),
                KArg::Ptr(ws.part_o.ptr()),
                KArg::Ptr(ws.part_ml.ptr()),
                row_list,
            ],
        )?;
        if splits == 1 {
            return Ok(());
        }
        dev.launch(
            &k.attn_merge,
            (c.num_heads as u32, n_decode, 1),
            hd as u32,
            &[
                KArg::Ptr(ws.part_o.ptr()),
                KArg::Ptr(ws.part_ml.ptr()),
                KArg::I32(c.num_heads as i32),
                KArg::I32(hd as i32),
                KArg::I32(splits as i32),
                KArg::Ptr(ws.attn.ptr()),
                row_list,
            ],
        )
    }

    /// `act = silu(x · gateᵀ) * (x · upᵀ)`: one fused GEMV for decode
    /// batches, else a GEMM into `gate_up` and the SwiGLU kernel. `act`:
    /// rows, or packed for down's int4 GEMM (only the SwiGLU kernel packs).
    fn gate_up_swiglu(
        &self,
        layer: &Layer,
        rows: usize,
        input: ProjInput,
        act: LinearInput,
    ) -> Result<()> {
        let m = &*self.model;
        let (dev, c, ws) = (&*m.dev, &m.config, &self.ws);
        let (d, inter) = (c.hidden_size, c.intermediate_size);
        if let Some(m) = self.w4_direct(&layer.gate_up, rows) {
            let (x, norm) = self.w4_projection_input(input, rows, m)?;
            return dev.w4_mm(x, rows, m, W4Out::SwiGlu { out: act.rows()? }, norm);
        }
        let fused = layer.gate_up.dense().filter(|_| dev.gemv_fits(rows, d));
        let (x, norm) = self.projection_input(input, rows, fused.is_some())?;
        if let Some(gate_up) = fused {
            let (nw, eps) = norm.unwrap_or((0, 0.0));
            return dev.launch_gemv(
                GemvFamily::SwiGlu,
                inter,
                (rows, 2 * inter, d),
                &[
                    KArg::Ptr(x.rows()?),
                    KArg::Ptr(gate_up.ptr()),
                    KArg::Ptr(act.rows()?),
                    KArg::I32(inter as i32),
                    KArg::I32(d as i32),
                    KArg::I32(rows as i32),
                    KArg::Ptr(nw),
                    KArg::F32(eps),
                ],
            );
        }
        self.linear(
            x,
            &layer.gate_up,
            None,
            ws.gate_up.ptr(),
            rows,
            2 * inter,
            d,
        )?;
        let gate_up = KArg::Ptr(ws.gate_up.ptr());
        match act {
            LinearInput::Rows(out) => dev.launch(
                &dev.kernels.silu_mul,
                (inter.div_ceil(8 * 256) as u32, rows as u32, 1),
                256,
                &[gate_up, KArg::Ptr(out), KArg::I32(inter as i32)],
            ),
            LinearInput::W4Packed => dev.launch(
                &dev.kernels.silu_mul_w4g,
                (cuda::w4_packed_blocks(rows, inter), 1, 1),
                cuda::W4_PACKED_THREADS,
                &[
                    gate_up,
                    KArg::Ptr(self.w4_scratch()?),
                    KArg::I32(rows as i32),
                    KArg::I32(inter as i32),
                ],
            ),
        }
    }

    /// Where the kernel before product `w` of a `rows`-row step writes
    /// its input: rows at `rows_at`, or packed for the int4 GEMM when `w`
    /// runs there (weights without act-order, which gather their rows).
    fn product_input(&self, w: &Weight, rows: usize, rows_at: u64) -> LinearInput {
        let m = &*self.model;
        let packs =
            m.w4_packed_inputs && m.w4_gemm_takes(rows) && w.int4().is_some_and(|q| !q.has_perm());
        if packs {
            LinearInput::W4Packed
        } else {
            LinearInput::Rows(rows_at)
        }
    }

    /// The residual add (of `delta`, if not 0) and norm before product
    /// `w`: into `normed`, or packed for the int4 GEMM (`product_input`).
    fn norm_before(&self, w: &Weight, rows: usize, delta: u64, norm: u64) -> Result<ProjInput> {
        let ws = &self.ws;
        let (dev, c) = (&*self.model.dev, &self.model.config);
        let normed = self.product_input(w, rows, ws.normed.ptr());
        match normed {
            LinearInput::Rows(out) => {
                self.add_rms_norm(rows as u32, delta, KArg::Ptr(0), norm, out)?
            }
            LinearInput::W4Packed => dev.launch(
                &dev.kernels.add_rms_norm_w4g,
                (cuda::w4_packed_rows(rows) as u32, 1, 1),
                norm_threads(c.hidden_size),
                &[
                    KArg::Ptr(ws.hidden.ptr()),
                    KArg::Ptr(delta),
                    KArg::Ptr(norm),
                    KArg::Ptr(self.w4_scratch()?),
                    KArg::I32(rows as i32),
                    KArg::I32(c.hidden_size as i32),
                    KArg::F32(c.rms_norm_eps),
                ],
            )?,
        }
        Ok(ProjInput::Normed(normed))
    }

    /// Enqueues one forward over the uploaded inputs on the stream (no host
    /// synchronization: it may be captured into a graph).
    fn enqueue(&self, inputs: &Inputs, splits: usize) -> Result<()> {
        let m = &*self.model;
        let dev = &*m.dev;
        let k = &dev.kernels;
        let c = &m.config;
        let ws = &self.ws;
        let rows = inputs.rows;
        let r32 = rows as u32;
        let n_out = inputs.n_out;
        let (d, hd, inter) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let nq = c.num_heads * hd;
        let inp = |o: usize| KArg::Ptr(ws.inputs.at(o));

        dev.launch(
            &k.rope_table,
            (r32, 1, 1),
            64,
            &[
                inp(inputs.positions),
                KArg::Ptr(m.inv_freq.ptr()),
                KArg::I32((hd / 2) as i32),
                KArg::Ptr(ws.rope_cs.ptr()),
            ],
        )?;
        dev.launch(
            &k.embed,
            (r32, 1, 1),
            256,
            &[
                KArg::Ptr(m.embed.ptr()),
                inp(inputs.tokens),
                KArg::Ptr(ws.hidden.ptr()),
                KArg::I32(d as i32),
            ],
        )?;
        // Decode batches keep the residual stream in the projections: each
        // norm is applied by the projection that reads it, and the o / down
        // products add their output into the residual. Other batches run
        // norm kernels with the residual add fused in, and cuBLAS.
        let in_projections = self.residual_in_projections(rows);
        let handoff = in_projections && self.norm_handoff(rows);
        if handoff {
            // The sums the first handoff (layer 0's o) adds into.
            // SAFETY: the workspace buffer outlives the step.
            unsafe { dev.zero(ws.norm_sums.ptr(), ws.norm_sums.bytes()) }?;
        }
        // Norm i's input when handed off by the product before it (norm 0,
        // layer 0's input norm, follows the embedding: normed by QKV itself).
        let norm_input = |i: usize, weight: u64| {
            if handoff && i > 0 {
                ProjInput::Handoff {
                    sums: self.norm_sums(i),
                    clear: self.norm_sums(i + 1),
                }
            } else {
                ProjInput::Residual(weight)
            }
        };
        // What the product before norm i hands over (the next norm's weight).
        let hand_to = |i: usize, next_norm: u64| {
            handoff.then(|| W4Handoff {
                xs: ws.normed.ptr(),
                next_norm,
                sums: self.norm_sums(i),
            })
        };
        for (li, layer) in m.layers.iter().enumerate() {
            let (kc, vc) = self.layer_kv(li);
            if in_projections {
                let input = norm_input(2 * li, layer.input_norm.ptr());
                self.qkv_rope_kv_write(layer, inputs, (kc, vc), input)?;
                self.attend(inputs, (kc, vc), splits)?;
                let post = hand_to(2 * li + 1, layer.post_norm.ptr());
                self.add_to_residual(ws.attn.ptr(), &layer.o, (rows, d, nq), post)?;
                let post_input = norm_input(2 * li + 1, layer.post_norm.ptr());
                let act = LinearInput::Rows(ws.act.ptr());
                self.gate_up_swiglu(layer, rows, post_input, act)?;
                let next = m
                    .layers
                    .get(li + 1)
                    .and_then(|n| hand_to(2 * li + 2, n.input_norm.ptr()));
                self.add_to_residual(ws.act.ptr(), &layer.down, (rows, d, inter), next)?;
                continue;
            }
            // Residual add of the previous layer's MLP output, fused with this norm.
            let delta = if li == 0 { 0 } else { ws.delta.ptr() };
            let input = self.norm_before(&layer.qkv, rows, delta, layer.input_norm.ptr())?;
            self.qkv_rope_kv_write(layer, inputs, (kc, vc), input)?;
            self.attend(inputs, (kc, vc), splits)?;
            self.linear(
                LinearInput::Rows(ws.attn.ptr()),
                &layer.o,
                layer.o_bias.as_ref(),
                ws.delta.ptr(),
                rows,
                d,
                nq,
            )?;
            let post = layer.post_norm.ptr();
            let input = self.norm_before(&layer.gate_up, rows, ws.delta.ptr(), post)?;
            let act = self.product_input(&layer.down, rows, ws.act.ptr());
            self.gate_up_swiglu(layer, rows, input, act)?;
            self.linear(act, &layer.down, None, ws.delta.ptr(), rows, d, inter)?;
        }
        if n_out == 0 {
            return Ok(());
        }
        // Last residual add (unless the GEMVs did it) and the final norm, for
        // the rows that want logits only.
        self.add_rms_norm(
            n_out as u32,
            if in_projections { 0 } else { ws.delta.ptr() },
            inp(inputs.logits_rows),
            m.final_norm.ptr(),
            ws.head_in.ptr(),
        )?;
        let head = match &m.lm_head {
            Some(Weight::Int4(h)) => {
                let y = ws.logits.ptr();
                return dev.w4_mm(ws.head_in.ptr(), n_out, h, W4Out::F32 { y }, W4Norm::None);
            }
            Some(Weight::Dense(h)) => h,
            None => &m.embed,
        };
        dev.gemm(
            ws.head_in.ptr(),
            head.ptr(),
            ws.logits.ptr(),
            n_out,
            c.vocab_size,
            d,
            GemmDType::F32,
        )
    }

    /// Gathers (`to_host`) or scatters the KV of `slots`, layer by layer,
    /// through a device staging buffer; `host` is `[slot][layer][k | v]`
    /// in the cache's 16-bit words (two values each in an fp8 cache).
    fn copy_slots(&mut self, slots: &[u32], host: &mut [u16], to_host: bool) -> Result<()> {
        let c = &self.model.config;
        let (n, w, layers) = (slots.len(), self.kv_row_words(), c.num_layers);
        let dev = self.model.dev.clone();
        if self
            .staging
            .as_ref()
            .is_none_or(|s| s.len() < n * 2 * w + n)
        {
            self.staging = Some(dev.alloc::<u16>((n * 2 * w + n).next_power_of_two())?);
        }
        let mut idx = dev.alloc::<u32>(n)?;
        dev.upload(slots, &mut idx)?;
        let mut staged = vec![0u16; n * 2 * w];
        let _turn = dev.step_lock.lock().unwrap_or_else(|p| p.into_inner());
        for l in 0..layers {
            if !to_host {
                for (s, chunk) in staged.chunks_mut(2 * w).enumerate() {
                    chunk.copy_from_slice(
                        &host[(s * layers + l) * 2 * w..(s * layers + l + 1) * 2 * w],
                    );
                }
                dev.upload(&staged, self.staging.as_mut().expect("allocated above"))?;
            }
            let (kc, vc) = self.layer_kv(l);
            let staging = self.staging.as_ref().expect("allocated above");
            dev.launch(
                &dev.kernels.kv_copy_slots,
                (n as u32, 1, 1),
                128,
                &[
                    KArg::Ptr(kc),
                    KArg::Ptr(vc),
                    KArg::Ptr(idx.ptr()),
                    KArg::Ptr(staging.ptr()),
                    KArg::I32(w as i32),
                    KArg::I32(to_host as i32),
                ],
            )?;
            if to_host {
                dev.download(staging, &mut staged)?;
                for (s, chunk) in staged.chunks(2 * w).enumerate() {
                    host[(s * layers + l) * 2 * w..(s * layers + l + 1) * 2 * w]
                        .copy_from_slice(chunk);
                }
            }
        }
        dev.synchronize()
    }

    /// The values of the cache's words (`copy_slots`' layout).
    fn decode_kv_words(&self, words: &[u16], out: &mut Vec<f32>) {
        if self.kv_fp8() {
            out.extend(words.iter().flat_map(|w| w.to_le_bytes()).map(e4m3_to_f32));
        } else {
            let act = self.model.dev.act;
            out.extend(words.iter().map(|&b| act.decode(b)));
        }
    }

    /// The cache's words of `values` (exact for values read by `decode_kv_words`).
    fn encode_kv_words(&self, values: &[f32]) -> Vec<u16> {
        if self.kv_fp8() {
            values
                .chunks(2)
                .map(|p| u16::from_le_bytes([e4m3_from_f32(p[0]), e4m3_from_f32(p[1])]))
                .collect()
        } else {
            self.model.dev.act.encode(values)
        }
    }
}

impl ForwardContext for CudaForward {
    fn forward(&mut self, batch: &ForwardBatch<'_>, logits: &mut [f32]) -> Result<()> {
        self.check_batch(batch, logits.len())?;
        if batch.tokens.is_empty() {
            return Ok(());
        }
        self.run(batch, Output::Logits(logits))
    }

    fn forward_argmax(&mut self, batch: &ForwardBatch<'_>, ids: &mut [u32]) -> Result<()> {
        let c = &self.model.config;
        self.check_batch(batch, batch.logits_rows.len() * c.vocab_size)?;
        if ids.len() < batch.logits_rows.len() {
            bail_arg!("argmax buffer too small");
        }
        if batch.tokens.is_empty() {
            return Ok(());
        }
        self.run(batch, Output::Argmax(ids))
    }

    fn overlaps_steps(&self) -> bool {
        self.overlap
    }

    fn launch(
        &mut self,
        batch: &ForwardBatch<'_>,
        sampling: Option<&DeviceSampling>,
        chained: bool,
    ) -> Result<()> {
        let c = &self.model.config;
        let rows = batch.logits_rows.len();
        self.check_batch(batch, rows * c.vocab_size)?;
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

    fn collect_ids(&mut self, ids: &mut [u32]) -> Result<()> {
        match &mut self.pending {
            Some(p) => p.wait_oldest(ids),
            None => Err(Error::new(
                ErrorKind::Internal,
                "collect_ids without a launch",
            )),
        }
    }

    fn samples_on_device(&self) -> bool {
        true
    }

    fn forward_sample(
        &mut self,
        batch: &ForwardBatch<'_>,
        sampling: &DeviceSampling,
        masks: &mut MaskFill<'_>,
        ids: &mut [u32],
        logits: &mut [f32],
    ) -> Result<()> {
        let c = &self.model.config;
        self.check_batch(batch, batch.logits_rows.len() * c.vocab_size)?;
        let rows = batch.logits_rows.len();
        let host_rows = sampling.host_rows.len();
        if sampling.rows.len() != rows
            || ids.len() < rows
            || logits.len() < host_rows * c.vocab_size
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

    fn kv_values_per_slot(&self) -> usize {
        2 * self.model.config.num_layers * self.kv_width()
    }

    fn workspace_stats(&self) -> Option<WorkspaceStats> {
        Some(WorkspaceStats {
            pool: self.pool_kind,
            planned_bytes: self.planned_bytes,
            pool_stats: self.pool.stats(),
            ..WorkspaceStats::default()
        })
    }

    fn save_kv(&mut self, slots: &[u32], out: &mut Vec<f32>) -> Result<()> {
        let n = slots.len() * self.kv_values_per_slot();
        // A host that cannot hold the swapped KV gets an error (the engine
        // recomputes instead), not an abort.
        let no_memory = |_| {
            Error::new(
                ErrorKind::OutOfMemory,
                format!("no host memory for {n} swapped KV values"),
            )
        };
        let words = slots.len() * 2 * self.model.config.num_layers * self.kv_row_words();
        let mut bits = Vec::new();
        bits.try_reserve_exact(words).map_err(no_memory)?;
        bits.resize(words, 0u16);
        out.try_reserve(n).map_err(no_memory)?;
        self.copy_slots(slots, &mut bits, true)?;
        self.decode_kv_words(&bits, out);
        Ok(())
    }

    fn restore_kv(&mut self, slots: &[u32], data: &[f32]) -> Result<()> {
        if data.len() != slots.len() * self.kv_values_per_slot() {
            bail_arg!(
                "restore_kv: {} values for {} slots",
                data.len(),
                slots.len()
            );
        }
        let mut bits = self.encode_kv_words(data);
        self.copy_slots(slots, &mut bits, false)
    }
}
