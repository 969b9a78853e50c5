//! The device seam between the engine and a decoder: a model's weights
//! resident on one device (`DeviceDecoder`), and the per-session state that
//! runs forwards on it (`ForwardContext`: KV storage + workspace). The
//! engine drives both through `ForwardBatch` and host logits only, so the
//! same scheduler runs on the CPU and on CUDA.

use super::decoder::Decoder;
use super::ModelConfig;
use crate::backend::cpu::attention::{reserve_decode_scratch, AttnShape};
use crate::backend::cpu::{ForwardWorkspace, ThreadPool, WorkspacePlan};
use crate::backend::Device;
pub use crate::backend::{ContextShape, KvBudget};
use crate::forward::ForwardBatch;
use crate::kv::{KvCacheDType, KvStorage};
use crate::memory::{utilization_kv_bytes, DeviceMemory, WorkspaceStats};
use crate::sampling::{DeviceSampling, MaskFill};
use crate::{bail_arg, Error, Result};
use std::sync::Arc;

/// A decoder's weights on one device. Shared by sessions through `Arc`.
pub trait DeviceDecoder: Send + Sync {
    fn config(&self) -> &ModelConfig;
    fn device(&self) -> Device;
    /// The linear layers' weight format ("f32", "bf16", "q8_0", ...).
    fn weight_dtype_name(&self) -> &'static str;
    /// The LM head's weight format.
    fn lm_head_dtype_name(&self) -> &'static str {
        self.weight_dtype_name()
    }
    /// Bytes of weight data one decode step streams (for bandwidth reports).
    fn weight_bytes(&self) -> usize;
    /// Host threads the kernels run on (1 for a GPU: one launching thread).
    fn threads(&self) -> usize;
    /// Bytes of KV data one slot holds across all layers with a cache of
    /// `dtype`; an error names a type this decoder cannot store.
    fn kv_bytes_per_slot(&self, dtype: KvCacheDType) -> Result<usize>;
    /// KV budget when the session gives none: what the device can spare
    /// after the weights and the temporaries of a context of `shape` (its
    /// `kv_slots` ignored). A GPU measures the temporaries with a profiling
    /// forward on a temporary context.
    fn default_kv_budget(self: Arc<Self>, shape: &ContextShape) -> Result<KvBudget>;
    /// The memory facts of a budget report for a context of `shape`. The
    /// default knows only the weights.
    fn memory(&self, shape: &ContextShape) -> DeviceMemory {
        let _ = shape;
        DeviceMemory {
            weights_bytes: self.weight_bytes(),
            ..DeviceMemory::default()
        }
    }
    /// One line for logs: device, dtype, weight size, load speed.
    fn summary(&self) -> String;
    /// Allocates a session's KV storage and workspace.
    fn new_context(self: Arc<Self>, shape: &ContextShape) -> Result<Box<dyn ForwardContext>>;
}

/// One session's device state.
/// The id `forward_argmax` reports for a logits row that is not finite.
pub const NON_FINITE_ROW: u32 = u32::MAX;

pub trait ForwardContext: Send {
    /// Runs the batch, writes its keys/values into the KV storage and the
    /// logits of `batch.logits_rows` into `logits` (`[logits_rows.len(), vocab]`).
    fn forward(&mut self, batch: &ForwardBatch<'_>, logits: &mut [f32]) -> Result<()>;
    /// Like `forward`, for callers that need only each logits row's argmax
    /// (plain greedy decoding): writes `ids[i]` = the first index of the
    /// largest logit of `batch.logits_rows[i]`, or [`NON_FINITE_ROW`] for
    /// a row holding a NaN or infinity. A GPU never copies the logits to
    /// the host for this.
    fn forward_argmax(&mut self, batch: &ForwardBatch<'_>, ids: &mut [u32]) -> Result<()>;
    /// Whether the engine should launch a decode step's successor before
    /// the step's ids reach the host (`launch` with `chained`). A device
    /// that queues work (a GPU) then runs the next step while the host
    /// reports the last one, instead of idling between them; the CPU
    /// computes each launch at once and gains nothing (`false`).
    fn overlaps_steps(&self) -> bool {
        false
    }
    /// Starts a forward over `batch` that chooses each logits row's id on
    /// the device, its argmax (`forward_argmax`) or, with `sampling`, as
    /// `forward_sample` does with every row on the device and none masked
    /// (a mask comes after the forward starts); returns without
    /// waiting. `collect_ids` hands out each launch's ids, oldest first. At
    /// most two launches are outstanding. With `chained`, row `i` of
    /// `batch` takes as its token the id the previous launch chose for its
    /// row `i` (`batch.tokens` are placeholders), so it can be launched
    /// before those ids reach the host; no other forward may run in between.
    ///
    /// A device that computes each forward at once does not implement
    /// this: the engine wraps its context in
    /// [`HostLaunches`](super::host_launches::HostLaunches) when it wants
    /// launches from it.
    fn launch(
        &mut self,
        batch: &ForwardBatch<'_>,
        sampling: Option<&DeviceSampling>,
        chained: bool,
    ) -> Result<()> {
        let _ = (batch, sampling, chained);
        Err(Error::unsupported(
            "this context runs each forward at once; it has no launch queue",
        ))
    }
    /// Waits for the oldest outstanding launch and writes its ids to `ids`.
    fn collect_ids(&mut self, ids: &mut [u32]) -> Result<()> {
        let _ = ids;
        bail_arg!("collect_ids without a launch")
    }
    /// Whether `forward_sample` runs here: the device samples its logits
    /// rows itself. The CPU samples in the engine (`false`).
    fn samples_on_device(&self) -> bool {
        false
    }
    /// Like `forward`, sampling logits row `i` on the device as
    /// `sampling.rows[i]` says and writing the token to `ids[i]`; the rows
    /// of `sampling.host_rows` are not sampled but their logits copied to
    /// `logits`, one after the other. `masks` is asked for the masked
    /// rows' masks once the forward is under way (see `MaskFill`). A
    /// sampled row holding a NaN or infinity gets [`NON_FINITE_ROW`].
    fn forward_sample(
        &mut self,
        batch: &ForwardBatch<'_>,
        sampling: &DeviceSampling,
        masks: &mut MaskFill<'_>,
        ids: &mut [u32],
        logits: &mut [f32],
    ) -> Result<()> {
        let _ = (batch, sampling, masks, ids, logits);
        Err(Error::unsupported("this device samples on the host"))
    }
    /// Values `save_kv` writes per slot (keys and values of every layer).
    fn kv_values_per_slot(&self) -> usize;
    /// Appends the KV of `slots` to `out` (slot after slot) as f32: swap-out.
    fn save_kv(&mut self, slots: &[u32], out: &mut Vec<f32>) -> Result<()>;
    /// Inverse of `save_kv`: swap-in.
    fn restore_kv(&mut self, slots: &[u32], data: &[f32]) -> Result<()>;
    /// The step workspace's figures, where the context has a planned one.
    fn workspace_stats(&self) -> Option<WorkspaceStats> {
        None
    }
}

/// The CPU decoder and the thread pool its kernels run on.
pub struct CpuDecoder {
    pub decoder: Decoder,
    pub pool: ThreadPool,
}

/// Default CPU KV budget: a quarter of available memory, at most 2 GiB.
fn default_cpu_kv_budget() -> usize {
    let available = crate::sysinfo::available_memory_bytes().unwrap_or(4 << 30);
    (available / 4).min(2 << 30)
}

impl CpuDecoder {
    /// The workspace plan of a context of `shape`.
    pub fn workspace_plan(&self, shape: &ContextShape) -> WorkspacePlan {
        WorkspacePlan::new(
            &self.decoder.config.dims(),
            shape.max_rows,
            shape.max_logits_rows,
        )
    }
}

impl DeviceDecoder for CpuDecoder {
    fn config(&self) -> &ModelConfig {
        &self.decoder.config
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn weight_dtype_name(&self) -> &'static str {
        self.decoder.weight_dtype_name()
    }
    fn lm_head_dtype_name(&self) -> &'static str {
        self.decoder.lm_head_dtype_name()
    }
    fn weight_bytes(&self) -> usize {
        self.decoder.weight_bytes()
    }
    fn threads(&self) -> usize {
        self.pool.threads()
    }
    fn kv_bytes_per_slot(&self, dtype: KvCacheDType) -> Result<usize> {
        check_cpu_kv_dtype(dtype)?;
        let c = &self.decoder.config;
        Ok(KvStorage::bytes_per_slot(
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
        ))
    }
    fn default_kv_budget(self: Arc<Self>, shape: &ContextShape) -> Result<KvBudget> {
        if shape.utilization_budget {
            let (bytes, limited) =
                utilization_kv_bytes(&self.memory(shape), shape.memory_utilization)?;
            if limited {
                crate::memory::log(&format!(
                    "KV budget lowered to the memory available now: {:.1} MiB",
                    bytes as f64 / (1u64 << 20) as f64
                ));
            }
            return Ok(KvBudget {
                bytes,
                profiled_peak_bytes: 0,
            });
        }
        Ok(KvBudget {
            bytes: default_cpu_kv_budget(),
            profiled_peak_bytes: 0,
        })
    }
    fn memory(&self, shape: &ContextShape) -> DeviceMemory {
        DeviceMemory {
            total_bytes: crate::sysinfo::total_memory_bytes().unwrap_or(0),
            available_bytes: crate::sysinfo::available_memory_bytes().unwrap_or(0),
            weights_bytes: self.decoder.resident_bytes(),
            // The plan's peak plus the host logits rows the engine keeps.
            workspace_bytes: self.workspace_plan(shape).peak_bytes()
                + shape.max_logits_rows * self.decoder.config.vocab_size * 4,
            profiled_peak_bytes: 0,
        }
    }
    fn summary(&self) -> String {
        format!(
            "cpu, {} threads, {} weights, {:.1} MB streamed per token",
            self.pool.threads(),
            self.decoder.weight_dtype_name(),
            self.decoder.weight_bytes() as f64 / 1e6
        )
    }
    fn new_context(self: Arc<Self>, shape: &ContextShape) -> Result<Box<dyn ForwardContext>> {
        shape.memory_pool.check_device(false, "cpu")?;
        check_cpu_kv_dtype(shape.kv_dtype)?;
        let c = &self.decoder.config;
        let storage = KvStorage::new(c.num_layers, shape.kv_slots, c.num_kv_heads, c.head_dim)?;
        let ws = ForwardWorkspace::new(
            shape.memory_pool,
            self.workspace_plan(shape),
            shape.pool_fault.clone(),
        )?;
        let max_positions = shape.kv_slots.min(c.max_position_embeddings);
        reserve_decode_scratch(&self.pool, &AttnShape::from(&c.dims()), max_positions);
        Ok(Box::new(CpuContext {
            sample_vocab: shape.choosable_ids(c.vocab_size),
            model: self,
            storage,
            ws,
        }))
    }
}

/// The CPU keeps f32 keys and values only.
fn check_cpu_kv_dtype(dtype: KvCacheDType) -> Result<()> {
    match dtype {
        KvCacheDType::Auto => Ok(()),
        KvCacheDType::Fp8E4m3 => Err(Error::unsupported(format!(
            "KV cache dtype {dtype} is supported on CUDA only; the CPU stores keys and values as f32 (use auto)"
        ))),
    }
}

struct CpuContext {
    model: Arc<CpuDecoder>,
    storage: KvStorage,
    ws: ForwardWorkspace,
    /// Ids `forward_argmax` may choose (`ContextShape::choosable_ids`).
    sample_vocab: usize,
}

impl ForwardContext for CpuContext {
    fn forward(&mut self, batch: &ForwardBatch<'_>, logits: &mut [f32]) -> Result<()> {
        let m = &*self.model;
        m.decoder
            .forward(&m.pool, batch, &mut self.storage, &mut self.ws, logits)
    }
    fn forward_argmax(&mut self, batch: &ForwardBatch<'_>, ids: &mut [u32]) -> Result<()> {
        let m = &*self.model;
        let (storage, ws) = (&mut self.storage, &mut self.ws);
        m.decoder
            .forward_argmax(&m.pool, batch, storage, ws, ids, self.sample_vocab)
    }
    fn workspace_stats(&self) -> Option<WorkspaceStats> {
        Some(self.ws.stats())
    }
    fn kv_values_per_slot(&self) -> usize {
        self.storage.slot_width() * 2 * self.storage.num_layers
    }
    fn save_kv(&mut self, slots: &[u32], out: &mut Vec<f32>) -> Result<()> {
        for &s in slots {
            self.storage.read_slot(s as usize, out);
        }
        Ok(())
    }
    fn restore_kv(&mut self, slots: &[u32], data: &[f32]) -> Result<()> {
        let per = self.kv_values_per_slot();
        if data.len() != slots.len() * per {
            bail_arg!(
                "restore_kv: {} values for {} slots",
                data.len(),
                slots.len()
            );
        }
        for (i, &s) in slots.iter().enumerate() {
            self.storage
                .write_slot(s as usize, &data[i * per..(i + 1) * per]);
        }
        Ok(())
    }
}
