//! The model on a CUDA GPU: its weights uploaded through the shared loader
//! into the CUDA backend's formats ([`CudaUpload`]), and the model's
//! device traits over the backend's [`CudaModel`] and [`CudaForward`],
//! whose forwards run the one layer program (`transformer.rs`).

use super::decoder::linear_matrix;
use super::quant::{QuantMethod, QuantMode, StoredQuant};
use super::runner::{ContextShape, DeviceDecoder, ForwardContext, KvBudget};
use super::transformer;
use super::weight_upload::{load_decoder, HeadSource, Projection, WeightUpload};
use super::{ForwardBatch, ModelConfig, WeightDType, WeightSource};
use crate::backend::cpu::{Matrix, MatrixData, ThreadPool};
use crate::backend::cuda::decoder::{CudaFormats, CudaForward, CudaModel, CudaWeight, LoadReport};
use crate::backend::cuda::{
    ActDType, CudaDevice, DeviceBuffer, Staging, W4Host, W4Matrix, W8Matrix,
};
use crate::backend::Device;
use crate::forward::{DeviceSampling, KvCacheDType, MaskFill};
use crate::memory::{DeviceMemory, WorkspaceStats};
use crate::tensor::fp8::Fp8Rows;
use crate::{Error, ErrorKind, Result};
use std::sync::{Arc, Mutex};
use std::time::Instant;

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
    let dims = c.dims();
    CudaModel::check_dims(&dims)?;
    let fp8 = matches!(quant, QuantMode::Fp8 { .. })
        || matches!(c.quantization, Some(StoredQuant::Fp8(_)));
    // FP8 checkpoints name their per-tensor or per-channel scales like Q8_0's.
    if !fp8 && src.contains("model.layers.0.self_attn.q_proj.weight_scale") {
        return Err(Error::new(
            ErrorKind::Unsupported,
            "q8_0 checkpoints are not supported on CUDA (int4 AWQ/GPTQ, FP8 and 16-bit ones are)",
        ));
    }
    if matches!(quant, QuantMode::Q8_0 { .. }) {
        return Err(Error::new(
            ErrorKind::Unsupported,
            "q8_0 quantization is not supported on CUDA (use awq or gptq for int4, or fp8)",
        ));
    }
    let method = quant.method()?;
    let dev = CudaDevice::open(ordinal, act)?;
    let int4 = matches!(quant, QuantMode::Awq { .. } | QuantMode::Gptq { .. })
        || matches!(c.quantization, Some(StoredQuant::Int4(_)));
    if int4 && dev.arch.0 < 8 {
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
    let stored = c.quantization.as_ref().map(StoredQuant::method);
    let mut up = CudaUpload {
        dev: &dev,
        src,
        act,
        stored,
        method: method.as_deref(),
        // None only where pinned memory cannot be had: plain pageable copies.
        staging: dev.staging(),
        pool: ThreadPool::try_new(crate::limits::resolve_threads(0)?)?,
        bytes: 0,
    };
    let weights = load_decoder(c, src, stored, method.as_deref(), &mut up)?;
    dev.synchronize()?;
    let load = LoadReport {
        resident_bytes: up.bytes,
        seconds: start.elapsed().as_secs_f64(),
        pinned: up.staging.is_some(),
    };
    let model = CudaModel::new(
        dev.clone(),
        ordinal,
        dims,
        c.max_position_embeddings,
        weights,
        load,
        |ops, w| transformer::forward(ops, w),
    );
    Ok(Arc::new(CudaDecoder {
        config,
        model: Arc::new(model),
    }))
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

/// Uploads weights tensor by tensor, converting to the activation dtype on
/// the host where the checkpoint differs (zero-copy views otherwise); int4
/// projections are repacked for the int4 kernels.
struct CudaUpload<'a> {
    dev: &'a CudaDevice,
    src: &'a (dyn WeightSource + Sync),
    act: ActDType,
    /// The int4 format config.json names (projections load as stored).
    stored: Option<&'a dyn QuantMethod>,
    /// Quantization applied at load (`--quant awq|gptq`).
    method: Option<&'a dyn QuantMethod>,
    /// Pinned buffers the weights go through (None: plain pageable copies).
    staging: Option<Staging>,
    /// Threads that prepare host parts (int4 repacking and quantization at
    /// load are CPU-heavy).
    pool: ThreadPool,
    bytes: usize,
}

/// One projection part on the host, ready to upload.
enum HostPart {
    Dense(Matrix),
    Int4(W4Host),
    Fp8(Fp8Rows),
}

impl HostPart {
    fn into_int4(self) -> Option<W4Host> {
        match self {
            HostPart::Int4(h) => Some(h),
            _ => None,
        }
    }

    fn into_fp8(self) -> Option<Fp8Rows> {
        match self {
            HostPart::Fp8(h) => Some(h),
            _ => None,
        }
    }
}

impl CudaUpload<'_> {
    fn target(&self) -> WeightDType {
        match self.act {
            ActDType::BF16 => WeightDType::BF16,
            ActDType::F16 => WeightDType::F16,
        }
    }

    /// Weight `name` as stored, quantized at load, or dense.
    fn host_part(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        stored: Option<&dyn QuantMethod>,
        method: Option<&dyn QuantMethod>,
    ) -> Result<HostPart> {
        let m = linear_matrix(self.src, name, rows, cols, self.target(), stored, method)?;
        match m.data {
            MatrixData::Q4(q) => W4Host::pack(&q)
                .map(HostPart::Int4)
                .map_err(|e| Error::new(ErrorKind::Unsupported, format!("{name}: {}", e.message))),
            MatrixData::Fp8(q) => Ok(HostPart::Fp8(q)),
            MatrixData::BF16(_) | MatrixData::F16(_) => Ok(HostPart::Dense(m)),
            _ => Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{name}: {} weights are not supported on CUDA (bf16, f16, f32 converted at load, int4 AWQ/GPTQ, or fp8)",
                    m.dtype_name()
                ),
            )),
        }
    }

    /// Parts stacked row-wise into one device matrix: all int4, all FP8 or
    /// all dense.
    fn stack(&mut self, job: &Projection, parts: Vec<HostPart>) -> Result<CudaWeight> {
        let w = if parts.iter().all(|p| matches!(p, HostPart::Int4(_))) {
            let hosts: Vec<W4Host> = parts.into_iter().filter_map(HostPart::into_int4).collect();
            CudaWeight::Int4(W4Matrix::upload(self.dev, &hosts, self.staging.as_mut())?)
        } else if parts.iter().all(|p| matches!(p, HostPart::Fp8(_))) {
            let hosts: Vec<Fp8Rows> = parts.into_iter().filter_map(HostPart::into_fp8).collect();
            let m = W8Matrix::upload(self.dev, &hosts, self.staging.as_mut())
                .map_err(|e| Error::new(e.kind, format!("{}: {}", job.parts[0].0, e.message)))?;
            CudaWeight::Fp8(m)
        } else if parts.iter().all(|p| matches!(p, HostPart::Dense(_))) {
            let total: usize = job.parts.iter().map(|p| p.1).sum();
            let mut buf = self.dev.alloc::<u16>(total * job.cols)?;
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
            CudaWeight::Dense(buf)
        } else {
            let list: Vec<&str> = job.parts.iter().map(|n| n.0.as_str()).collect();
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{} are fused into one projection on CUDA and must be all int4, all fp8 or all dense",
                    list.join(", ")
                ),
            ));
        };
        self.bytes += w.bytes();
        Ok(w)
    }
}

impl WeightUpload for CudaUpload<'_> {
    type Formats = CudaFormats;

    fn projections(&mut self, jobs: &[Projection]) -> Result<Vec<CudaWeight>> {
        // Every part of every job prepared on all cores, then uploaded in order.
        let flat: Vec<(&str, usize, usize)> = jobs
            .iter()
            .flat_map(|j| j.parts.iter().map(move |(n, r)| (n.as_str(), *r, j.cols)))
            .collect();
        let results: Vec<Mutex<Option<Result<HostPart>>>> =
            flat.iter().map(|_| Mutex::new(None)).collect();
        let this = &*self;
        this.pool.run(flat.len(), &|i| {
            let (name, rows, cols) = flat[i];
            *results[i].lock().unwrap_or_else(|p| p.into_inner()) =
                Some(this.host_part(name, rows, cols, this.stored, this.method));
        });
        let mut results = results.into_iter().map(|m| {
            m.into_inner()
                .unwrap_or_else(|p| p.into_inner())
                .expect("every job ran")
        });
        let mut out = Vec::with_capacity(jobs.len());
        for job in jobs {
            let parts = job
                .parts
                .iter()
                .map(|_| results.next().expect("one per part"))
                .collect::<Result<Vec<_>>>()?;
            out.push(self.stack(job, parts)?);
        }
        Ok(out)
    }

    fn vector(&mut self, parts: &[(&str, usize)]) -> Result<DeviceBuffer<u16>> {
        let mut host = Vec::new();
        for &(name, len) in parts {
            host.extend(self.src.vector(name, len)?);
        }
        let mut buf = self.dev.alloc::<u16>(host.len())?;
        self.dev.upload(&self.act.encode(&host), &mut buf)?;
        self.bytes += buf.bytes();
        Ok(buf)
    }

    fn lm_head(&mut self, h: &HeadSource<'_>) -> Result<CudaWeight> {
        let part = self.host_part(h.name, h.rows, h.cols, h.stored, h.method)?;
        let job = Projection {
            parts: vec![(h.name.to_string(), h.rows)],
            cols: h.cols,
        };
        let head = self.stack(&job, vec![part])?;
        if let CudaWeight::Int4(m) = &head {
            if m.has_perm() {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    "an act-order (desc_act) int4 LM head is not supported on CUDA",
                ));
            }
        }
        Ok(head)
    }

    fn embedding(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
        _is_head: bool,
    ) -> Result<DeviceBuffer<u16>> {
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

    fn rope(&mut self, inv_freq: &[f32]) -> Result<DeviceBuffer<f32>> {
        let mut buf = self.dev.alloc::<f32>(inv_freq.len())?;
        self.dev.upload(inv_freq, &mut buf)?;
        Ok(buf)
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

/// A model on a GPU, as the engine sees it.
struct CudaDecoder {
    config: ModelConfig,
    model: Arc<CudaModel>,
}

impl DeviceDecoder for CudaDecoder {
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn device(&self) -> Device {
        self.model.device()
    }
    fn weight_dtype_name(&self) -> &'static str {
        self.model.weight_dtype_name()
    }
    fn lm_head_dtype_name(&self) -> &'static str {
        self.model.lm_head_dtype_name()
    }
    fn weight_bytes(&self) -> usize {
        self.model.weight_bytes()
    }
    fn threads(&self) -> usize {
        1
    }
    fn kv_bytes_per_slot(&self, dtype: KvCacheDType) -> Result<usize> {
        self.model.kv_bytes_per_slot(dtype)
    }
    fn default_kv_budget(self: Arc<Self>, shape: &ContextShape) -> Result<KvBudget> {
        self.model.clone().default_kv_budget(shape)
    }
    fn memory(&self, shape: &ContextShape) -> DeviceMemory {
        self.model.memory(shape)
    }
    fn summary(&self) -> String {
        self.model.summary()
    }
    fn new_context(self: Arc<Self>, shape: &ContextShape) -> Result<Box<dyn ForwardContext>> {
        let ctx = self.model.clone().create_context(shape)?;
        Ok(Box::new(CudaContext { ctx }))
    }
}

/// One session's state on the GPU (the backend checks every batch).
struct CudaContext {
    ctx: CudaForward,
}

impl ForwardContext for CudaContext {
    fn forward(&mut self, batch: &ForwardBatch<'_>, logits: &mut [f32]) -> Result<()> {
        self.ctx.forward(batch, logits)
    }
    fn forward_argmax(&mut self, batch: &ForwardBatch<'_>, ids: &mut [u32]) -> Result<()> {
        self.ctx.forward_argmax(batch, ids)
    }
    fn overlaps_steps(&self) -> bool {
        self.ctx.overlaps_steps()
    }
    fn launch(
        &mut self,
        batch: &ForwardBatch<'_>,
        sampling: Option<&DeviceSampling>,
        chained: bool,
    ) -> Result<()> {
        self.ctx.launch(batch, sampling, chained)
    }
    fn collect_ids(&mut self, ids: &mut [u32]) -> Result<()> {
        self.ctx.collect_ids(ids)
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
        self.ctx.forward_sample(batch, sampling, masks, ids, logits)
    }
    fn kv_values_per_slot(&self) -> usize {
        self.ctx.kv_values_per_slot()
    }
    fn workspace_stats(&self) -> Option<WorkspaceStats> {
        self.ctx.workspace_stats()
    }
    fn save_kv(&mut self, slots: &[u32], out: &mut Vec<f32>) -> Result<()> {
        self.ctx.save_kv(slots, out)
    }
    fn restore_kv(&mut self, slots: &[u32], data: &[f32]) -> Result<()> {
        self.ctx.restore_kv(slots, data)
    }
}
