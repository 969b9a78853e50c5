//! A serving session: continuous batching over one model and one KV cache.
//!
//! Every `step` schedules work under a token budget (running requests first,
//! one decode token or one prefill chunk each, then waiting requests by
//! policy; see `schedule`), runs one forward pass over the mixed batch,
//! samples the rows that completed their known tokens and reports
//! per-request events (see `output`). Running out of KV room preempts the
//! least urgent running request (recompute or swap); it never fails a
//! request.

mod output;
mod overlap;
mod schedule;
mod speculate;
mod state;

pub use state::{PrefixCacheReport, PREFIX_CACHE_FILE};

use super::cancel::Canceller;
use super::faults::{FaultCounts, FaultPlan, FaultState};
use super::grammar::GrammarCompiler;
use super::model::Model;
use super::policy::{create_policy, RankInput, SchedulePolicy, SchedulePolicyKind};
use super::request::{Constraint, Event, FinishReason, RequestId, RequestParams, Usage};
use super::speculative::{SpecState, SpeculativeParams};
use super::state_file::SavedSequence;
use crate::backend::Device;
use crate::forward::AttnSeq;
use crate::kv::{
    create_kv_backend, physical_slots, KvBackendKind, KvCacheBackend, KvCacheDType, KvStats,
};
use crate::memory::{
    check_fits, try_with_capacity, utilization_kv_bytes, zeroed_f32, BudgetSource, DeviceMemory,
    MemoryBudget, MemoryPoolKind, PoolFaultSwitch,
};
use crate::model::{ContextShape, ForwardContext, HostLaunches, WorkspaceStats};
use crate::sampling::{DeviceSampling, GrammarMask, Rng, Sampler, StopMatcher};
use crate::tokenizer::StreamDetokenizer;
use crate::{bail_arg, Error, ErrorKind, Result};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptionMode {
    /// Free the victim's KV and recompute it when it is resumed.
    Recompute,
    /// Copy the victim's KV to host memory and back when it is resumed.
    Swap,
}

impl std::str::FromStr for PreemptionMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "recompute" => PreemptionMode::Recompute,
            "swap" => PreemptionMode::Swap,
            _ => bail_arg!("preemption mode `{s}` is not supported (supported: recompute, swap)"),
        })
    }
}

#[derive(Debug, Clone)]
pub struct SessionParams {
    pub kv_backend: KvBackendKind,
    /// Tokens per block (paged backend).
    pub block_size: usize,
    /// KV capacity in tokens; 0 = derive from `kv_memory_bytes`.
    pub kv_capacity_tokens: usize,
    /// KV budget in bytes when `kv_capacity_tokens` is 0; 0 = automatic.
    pub kv_memory_bytes: usize,
    /// With an automatic budget on a GPU: the fraction of device memory
    /// weights + temporaries + KV cache may use.
    pub gpu_memory_utilization: f32,
    /// When neither `kv_capacity_tokens` nor `kv_memory_bytes` is set and
    /// this is in (0, 1]: the KV cache gets this fraction of the device's
    /// total memory minus the weights minus the planned workspace peak
    /// (vLLM's `gpu_memory_utilization` rule), on the CPU too (never more
    /// than is available now). 0 = the device's automatic budget (CPU: a
    /// quarter of available memory, at most 2 GiB; GPU: `gpu_memory_utilization`).
    pub memory_utilization: f32,
    /// Where the session's device memory comes from: the CPU step
    /// workspace (arena, slab, system) or, on a GPU, the workspace and the
    /// KV cache (cuda-stream, cuda-buddy). `None` = the device's default
    /// (arena on the CPU, cuda-stream on a GPU); a pool of the other kind
    /// of device is refused.
    pub memory_pool: Option<MemoryPoolKind>,
    /// Token budget of one step (prefill chunks + decode tokens). 0 =
    /// automatic: 512 on the CPU, 8192 on a GPU ([`StepShape`]).
    pub max_batched_tokens: usize,
    /// Sequences in one step. 0 = automatic: 64 on the CPU, 256 on a GPU.
    pub max_seqs: usize,
    /// Longest prefill piece of one request in one step. 0 = the step's
    /// token budget.
    pub prefill_chunk_size: usize,
    pub policy: SchedulePolicyKind,
    /// Steps a waiting request needs to gain one priority level.
    pub aging_steps: u64,
    pub prefix_caching: bool,
    pub preemption: PreemptionMode,
    /// Seeds the session RNG that unseeded requests draw from.
    pub seed: u64,
    /// Sample on the device when it can (a GPU): only token ids come back
    /// instead of logits rows. Requests that ask for logprobs are sampled on
    /// the host. Off: the host samples every row that is not plain greedy.
    pub device_sampling: bool,
    /// What the KV cache stores: the activation dtype (`Auto`) or FP8
    /// (CUDA only; twice the tokens per byte).
    pub kv_cache_dtype: KvCacheDType,
    /// Launch a plain-greedy decode step before the previous step's tokens
    /// reach the host, the device feeding them in (see `overlap`), so a GPU
    /// does not idle while the host reports a step. `None` = where the
    /// device gains from it (a GPU; `NANOINFER_CUDA_OVERLAP=0` turns it
    /// off there). Events are the same either way.
    pub overlap_steps: Option<bool>,
    /// Speculative decoding: requests in decode draft tokens that the next
    /// step verifies (see `engine::speculative`). `None` = off.
    pub speculative: Option<SpeculativeParams>,
}

impl Default for SessionParams {
    fn default() -> Self {
        SessionParams {
            kv_backend: KvBackendKind::Paged,
            block_size: 16,
            kv_capacity_tokens: 0,
            kv_memory_bytes: 0,
            gpu_memory_utilization: ContextShape::DEFAULT_MEMORY_UTILIZATION,
            memory_utilization: 0.0,
            memory_pool: None,
            max_batched_tokens: 0,
            max_seqs: 0,
            prefill_chunk_size: 0,
            policy: SchedulePolicyKind::Fcfs,
            aging_steps: 64,
            prefix_caching: true,
            preemption: PreemptionMode::Recompute,
            seed: 0,
            device_sampling: true,
            kv_cache_dtype: KvCacheDType::Auto,
            overlap_steps: None,
            speculative: None,
        }
    }
}

/// The size of an engine step when [`SessionParams`] leaves it automatic.
/// On the CPU a step's time grows with its tokens, so small steps keep
/// decode latency even. A GPU needs large steps to keep its tensor cores
/// busy: offline, 1 000 requests of 512 + 256 tokens of a Llama-3-8B shape
/// on an H100 give 5 320 output tok/s at the CPU's shape and 8 535 at the
/// GPU's, with 28.8 ms per output token (BENCHMARKS.md "GPU serving";
/// the CPU-shape figure is in docs/benchmarks-log.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepShape {
    pub max_batched_tokens: usize,
    pub max_seqs: usize,
}

impl StepShape {
    pub const CPU: StepShape = StepShape {
        max_batched_tokens: 512,
        max_seqs: 64,
    };
    pub const GPU: StepShape = StepShape {
        max_batched_tokens: 8192,
        max_seqs: 256,
    };

    pub fn for_device(gpu: bool) -> StepShape {
        if gpu {
            StepShape::GPU
        } else {
            StepShape::CPU
        }
    }
}

impl SessionParams {
    /// These parameters with every automatic (0) step size replaced by
    /// the device's: a prefill chunk of 0 becomes the step's token budget.
    pub fn with_step_shape(mut self, gpu: bool) -> SessionParams {
        let auto = StepShape::for_device(gpu);
        if self.max_batched_tokens == 0 {
            self.max_batched_tokens = auto.max_batched_tokens;
        }
        if self.max_seqs == 0 {
            self.max_seqs = auto.max_seqs;
        }
        if self.prefill_chunk_size == 0 {
            self.prefill_chunk_size = self.max_batched_tokens;
        }
        self
    }
}

/// Counters and occupancy for monitoring and tests.
#[derive(Debug, Clone, Default)]
pub struct SessionStats {
    pub running: usize,
    pub waiting: usize,
    pub kv: KvStats,
    /// Usable KV slots: the KV manager's figure (the requested capacity
    /// rounded up to whole blocks). A single request is still limited to
    /// the requested capacity.
    pub kv_capacity_tokens: usize,
    /// How the KV capacity was decided and what memory holds (fixed at creation).
    pub memory: MemoryBudget,
    /// The step workspace's figures (CPU contexts).
    pub workspace: Option<WorkspaceStats>,
    pub steps: u64,
    /// Rows computed as prefill: prompt chunks, and prompt + generated
    /// tokens recomputed after a recompute preemption.
    pub prefill_tokens: u64,
    /// Rows computed as decode (the token sampled in the previous step).
    pub decode_tokens: u64,
    /// Tokens whose KV was taken from the prefix cache at admission instead
    /// of being computed.
    pub prefix_cached_tokens: u64,
    /// Admissions that reused at least one cached token.
    pub prefix_hits: u64,
    pub preemptions: u64,
    /// Tokens whose KV was copied to host memory by swap preemptions.
    pub swapped_out_tokens: u64,
    /// Tokens whose KV was copied back from host memory.
    pub swapped_in_tokens: u64,
    /// Wall time spent in `step` in all, and in the device's forward calls
    /// (which include the device's own input upload and the wait for its
    /// results); the difference is the engine's host work: scheduling,
    /// batch assembly, sampling on the host, events.
    pub step_time_ns: u64,
    pub forward_time_ns: u64,
    /// Forwards launched behind the previous one, their tokens fed by the
    /// device (`SessionParams::overlap_steps`).
    pub chained_steps: u64,
    /// Structured-output masks computed (one per constrained request per
    /// sampled token), the wall time spent on them (summed over the threads
    /// that computed them), and those over `sampling::MASK_TIME_BUDGET`
    /// (each failed its request).
    pub constraint_masks: u64,
    pub constraint_mask_time_ns: u64,
    pub constraint_masks_over_budget: u64,
    /// Speculative decoding: tokens drafted and verified, the drafted tokens
    /// the target kept, and the (request, step) verifications; each
    /// verification also yields one token of the target's own, so a
    /// verifying step gives `1 + accepted / verifications` tokens on average.
    pub spec_draft_tokens: u64,
    pub spec_accepted_tokens: u64,
    pub spec_verifications: u64,
}

impl SessionStats {
    /// Tokens a speculating request got per verifying step (drafted tokens
    /// kept, plus the target's own); 0 before the first verification.
    pub fn spec_mean_accepted_length(&self) -> f64 {
        if self.spec_verifications == 0 {
            return 0.0;
        }
        1.0 + self.spec_accepted_tokens as f64 / self.spec_verifications as f64
    }
}

struct Request {
    params: RequestParams,
    /// Prompt followed by generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Where the sampler's output history starts (penalties count the
    /// output from here): `prompt_len`, or for a restored conversation
    /// continued without new tokens, its original prompt's length.
    history_start: usize,
    /// The sampler's RNG state before the draw of a launched step whose
    /// token has not been reported (overlapped steps): a saved state
    /// resumes from there.
    flight_rng: Option<[u64; 4]>,
    /// Tokens whose KV is in the cache.
    computed: usize,
    /// True between `kv.begin` and `kv.release`: exactly the running requests.
    in_kv: bool,
    /// KV of positions `0..n` saved by a swap preemption, as `(n, data)`.
    swapped: Option<(usize, Vec<f32>)>,
    sampler: Sampler,
    detok: Option<StreamDetokenizer>,
    stop: StopMatcher,
    rank: RankInput,
    /// When the request arrived: its usage times count from here.
    added: Instant,
    /// Nanoseconds from `added` to the end of the step that reported its
    /// first token; `None` until then.
    first_token_ns: Option<u64>,
    /// The prefix-cache hit of its first admission; `None` before it.
    cached_prompt_tokens: Option<usize>,
    /// Drafted tokens this step verifies after its last known token
    /// (rows past the plan's count); empty between steps.
    draft: Vec<u32>,
    /// How many tokens it drafts next.
    spec: SpecState,
}

pub struct Session {
    model: Arc<Model>,
    params: SessionParams,
    kv: Box<dyn KvCacheBackend>,
    /// KV storage and workspace on the model's device.
    ctx: Box<dyn ForwardContext>,
    capacity_tokens: usize,
    budget: MemoryBudget,
    /// `[max_seqs, vocab]`: one row per sequence that samples this step.
    logits: Vec<f32>,
    policy: Box<dyn SchedulePolicy>,
    requests: HashMap<RequestId, Request>,
    waiting: Vec<RequestId>,
    running: Vec<RequestId>,
    /// Terminal events of requests cancelled between steps.
    pending: Vec<Event>,
    rng: Rng,
    next_id: RequestId,
    next_arrival: u64,
    stats: SessionStats,
    /// Scratch reused across steps.
    scratch: StepScratch,
    /// Test-only fault injection (`inject_faults`); `None` in normal use.
    faults: Option<Box<FaultState>>,
    /// Arms a workspace pool failure in the context (see `FaultPlan`).
    pool_fault: PoolFaultSwitch,
    /// Overlapped steps are on (`SessionParams::overlap_steps`).
    overlap: bool,
    /// The step launched last, whose ids have not been collected.
    in_flight: Option<overlap::InFlight>,
    /// Cancels from other threads, and the running forward's stop flag.
    canceller: Canceller,
    /// The app's abort check, polled by the running forward.
    abort: Option<AbortCheck>,
    /// Structured output's compiler, built at the first constrained request.
    grammar: Option<GrammarCompiler>,
    /// States of ended requests that asked for `retain_state`, until
    /// `release_state` (the error when keeping one failed).
    retained: HashMap<RequestId, Result<SavedSequence>>,
    /// Speculative decoding, when on.
    spec: Option<speculate::Speculation>,
}

/// An app's check that aborts a running step when it returns true (see
/// [`Session::set_abort_check`]).
pub type AbortCheck = Box<dyn Fn() -> bool + Send + Sync>;

/// How a step turns its logits rows into tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum TokensFrom {
    /// The host samples every row from its logits.
    #[default]
    HostSampler,
    /// Every row is plain greedy: the device returned the argmax ids.
    DeviceArgmax,
    /// The device sampled the rows `device_sampling` describes and returned
    /// the logits of its `host_rows`, which the host samples.
    DeviceSampler,
}

#[derive(Default)]
struct StepScratch {
    /// The batch's sequences; empty between steps (see `run_forward`).
    seqs: Vec<AttnSeq<'static>>,
    /// Scheduling order of the running requests.
    order: Vec<RequestId>,
    /// Events handed back by `step_into`, recycled with their buffers.
    spare_events: Vec<Event>,
    /// (request, arrival) of each terminal event not yet returned by
    /// `step_into`, whose usage times are stamped when it returns.
    ended: Vec<(RequestId, Instant)>,
    /// Where this step's tokens come from.
    tokens_from: TokensFrom,
    /// Token ids the device chose (`TokensFrom::DeviceArgmax`/`DeviceSampler`).
    device_tokens: Vec<u32>,
    /// The rows' sampling when the device samples them.
    device_sampling: DeviceSampling,
    /// A plan buffer for the step launched behind the current one.
    spare_plan: Vec<(RequestId, usize)>,
    /// `SessionParams::device_sampling`.
    allow_device_sampling: bool,
    /// (request, rows to compute) in batch order; logits rows follow it.
    plan: Vec<(RequestId, usize)>,
    tokens: Vec<u32>,
    logits_rows: Vec<usize>,
    suppress: Vec<u32>,
    /// Cancels taken from the `Canceller`, being applied.
    cancels: Vec<RequestId>,
}

impl Session {
    /// Opens a session. Where the automatic GPU step shape leaves no room
    /// for the KV cache (a small GPU, a large model), the session falls
    /// back to the CPU's shape before giving up (its step workspace is an
    /// order of magnitude smaller: ~0.1 against ~1.2 GB for an 8B model).
    pub fn new(model: Arc<Model>, params: SessionParams) -> Result<Session> {
        let gpu = model.decoder.device() != Device::Cpu;
        let automatic = params.max_batched_tokens == 0 || params.max_seqs == 0;
        match Session::open(model.clone(), params.clone().with_step_shape(gpu)) {
            Err(e) if gpu && automatic && e.kind == ErrorKind::OutOfMemory => {
                Session::open(model, params.with_step_shape(false))
            }
            opened => opened,
        }
    }

    /// `new` with the step shape resolved.
    fn open(model: Arc<Model>, params: SessionParams) -> Result<Session> {
        let c = model.config();
        let device = model.decoder.device();
        let gpu = device != Device::Cpu;
        if params.block_size == 0 || params.block_size > 1024 {
            bail_arg!("block_size must be in 1..=1024, got {}", params.block_size);
        }
        crate::limits::check_step_shape(
            params.max_batched_tokens,
            params.max_seqs,
            params.prefill_chunk_size,
        )?;
        crate::limits::check_kv_capacity_tokens(params.kv_capacity_tokens)?;
        let target_per_token = model.decoder.kv_bytes_per_slot(params.kv_cache_dtype)?;
        // A draft model keeps KV for the same tokens: its bytes per token
        // come out of the same budget.
        let draft_model = params.speculative.as_ref().and_then(|s| s.draft_model());
        let per_token = match draft_model {
            Some(d) => target_per_token + d.decoder.kv_bytes_per_slot(params.kv_cache_dtype)?,
            None => target_per_token,
        };
        let spec_rows = match &params.speculative {
            Some(s) => {
                s.validate()?;
                s.effective_max_batch().min(params.max_seqs) * s.max_k()
            }
            None => 0,
        };
        let max_logits_rows = params.max_seqs + spec_rows;
        if !(params.gpu_memory_utilization > 0.0 && params.gpu_memory_utilization <= 1.0) {
            bail_arg!(
                "gpu_memory_utilization must be in (0, 1], got {}",
                params.gpu_memory_utilization
            );
        }
        let mu = params.memory_utilization;
        if !(mu == 0.0 || (mu > 0.0 && mu <= 1.0)) {
            bail_arg!("memory_utilization must be in (0, 1] (0 = automatic), got {mu}");
        }
        let pool = params
            .memory_pool
            .unwrap_or(MemoryPoolKind::default_for(gpu));
        pool.check_device(gpu, &device.to_string())?;
        let mut shape = ContextShape::new(0, params.max_batched_tokens, max_logits_rows);
        shape.memory_pool = pool;
        shape.kv_dtype = params.kv_cache_dtype;
        shape.sample_vocab = Some(model.sample_vocab);
        shape.memory_utilization = params.gpu_memory_utilization;
        if mu > 0.0 {
            shape.memory_utilization = mu;
            shape.utilization_budget = true;
        }
        let mut mem = model.decoder.memory(&shape);
        let context = c.max_position_embeddings.min(4096);
        let (source, capacity_tokens) = if params.kv_capacity_tokens > 0 {
            (BudgetSource::Tokens, params.kv_capacity_tokens)
        } else {
            let (source, budget) = if params.kv_memory_bytes > 0 {
                (BudgetSource::Bytes, params.kv_memory_bytes)
            } else {
                let auto = model.decoder.clone().default_kv_budget(&shape)?;
                mem.profiled_peak_bytes = auto.profiled_peak_bytes;
                let source = if shape.utilization_budget {
                    BudgetSource::Utilization
                } else {
                    BudgetSource::Automatic
                };
                (source, auto.bytes)
            };
            let tokens = budget / per_token;
            if tokens < context {
                return Err(Error::new(
                    ErrorKind::OutOfMemory,
                    format!(
                        "KV budget ({}) of {budget} bytes holds {tokens} tokens ({per_token} bytes each), less than \
                         one context of {context} tokens (weights {} bytes, step workspace {} bytes); raise \
                         kv_memory_bytes or memory_utilization, or set kv_capacity_tokens",
                        source.as_str(),
                        mem.weights_bytes,
                        mem.workspace_bytes
                    ),
                ));
            }
            (source, tokens.min(crate::limits::MAX_KV_CAPACITY_TOKENS))
        };
        let slots = physical_slots(params.kv_backend, capacity_tokens, params.block_size);
        let requested = match source {
            BudgetSource::Tokens => format!("kv_capacity_tokens {capacity_tokens}"),
            BudgetSource::Bytes => format!("kv_memory_bytes {}", params.kv_memory_bytes),
            _ => format!("the {} KV budget", source.as_str()),
        };
        check_fits(&mem, &requested, slots.checked_mul(per_token))?;
        let (kv, slots) = create_kv_backend(
            params.kv_backend,
            capacity_tokens,
            params.block_size,
            params.prefix_caching,
        );
        shape.kv_slots = slots;
        let ctx = model.decoder.clone().new_context(&shape)?;
        let spec = match &params.speculative {
            Some(s) => Some(speculate::Speculation::new(
                s,
                &model,
                &shape,
                capacity_tokens,
            )?),
            None => None,
        };
        let logits = zeroed_f32(
            max_logits_rows * c.vocab_size,
            "the logits rows of max_seqs and drafted tokens",
        )?;
        let budget = budget_report(
            &mem,
            &shape,
            source,
            kv.stats(),
            per_token,
            c.max_position_embeddings,
        );
        let mut scratch = StepScratch::default();
        // Room for a full step: no growth on the hot path.
        scratch.seqs.reserve(params.max_seqs);
        scratch.order.reserve(params.max_seqs);
        scratch.plan.reserve(params.max_seqs);
        scratch.spare_plan.reserve(params.max_seqs);
        scratch.logits_rows.reserve(params.max_seqs);
        scratch.device_tokens.reserve(params.max_seqs);
        scratch.allow_device_sampling = params.device_sampling;
        scratch.tokens.reserve(params.max_batched_tokens);
        scratch.spare_events.reserve(params.max_seqs);
        scratch.cancels.reserve(params.max_seqs);
        scratch.ended.reserve(params.max_seqs);
        let overlap = params.overlap_steps.unwrap_or(ctx.overlaps_steps());
        // Overlap asked of a device that computes each forward at once:
        // its launches are computed at once and queued on the host.
        let ctx = if overlap {
            HostLaunches::wrap(ctx)
        } else {
            ctx
        };
        Ok(Session {
            policy: create_policy(params.policy, params.aging_steps),
            rng: Rng::seed_from_u64(params.seed),
            kv,
            ctx,
            capacity_tokens,
            budget,
            logits,
            requests: HashMap::new(),
            waiting: Vec::new(),
            running: Vec::with_capacity(params.max_seqs),
            pending: Vec::new(),
            next_id: 1,
            next_arrival: 0,
            stats: SessionStats::default(),
            scratch,
            faults: None,
            pool_fault: shape.pool_fault.clone(),
            overlap,
            in_flight: None,
            canceller: Canceller::default(),
            grammar: None,
            retained: HashMap::new(),
            spec,
            abort: None,
            model,
            params,
        })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn params(&self) -> &SessionParams {
        &self.params
    }

    /// Validates and queues a request; returns its id. Nothing is queued on error.
    pub fn add_request(&mut self, params: RequestParams) -> Result<RequestId> {
        self.add_request_at(params, Instant::now())
    }

    /// [`add_request`](Session::add_request) for a request that arrived at
    /// `arrived` (e.g. before its prompt was tokenized and the session was
    /// free): the instant its [`Usage`] times count from.
    pub fn add_request_at(&mut self, params: RequestParams, arrived: Instant) -> Result<RequestId> {
        self.add_request_with(params, arrived, None)
    }

    /// Validates and queues a request that continues `restored` (whose
    /// tokens come before `params.prompt`) or, without one, a new request.
    fn add_request_with(
        &mut self,
        params: RequestParams,
        arrived: Instant,
        restored: Option<SavedSequence>,
    ) -> Result<RequestId> {
        let c = self.model.config();
        let vocab = c.vocab_size;
        if params.prompt.is_empty() && restored.is_none() {
            bail_arg!("prompt is empty");
        }
        if let Some(&bad) = params.prompt.iter().find(|&&t| t as usize >= vocab) {
            bail_arg!("prompt token id {bad} is outside the vocabulary (size {vocab})");
        }
        params.sampling.validate(vocab)?;
        if !params.sampling.stop_strings.is_empty() && self.model.tokenizer.is_none() {
            bail_arg!("stop strings need a tokenizer, and this model has none");
        }
        let earlier = restored.as_ref().map_or(0, |r| r.tokens.len());
        let prompt_len = earlier + params.prompt.len();
        let what = if earlier > 0 {
            format!(
                "restored conversation ({earlier} tokens) + prompt ({} tokens)",
                params.prompt.len()
            )
        } else {
            format!("prompt ({prompt_len} tokens)")
        };
        let need = prompt_len + params.sampling.max_tokens as usize;
        if need > c.max_position_embeddings {
            bail_arg!(
                "{what} + max_tokens ({}) exceeds the model's context length {}",
                params.sampling.max_tokens,
                c.max_position_embeddings
            );
        }
        if need > self.capacity_tokens {
            bail_arg!(
                "{what} + max_tokens ({}) exceeds the session's KV capacity of {} tokens; \
                 shorten the prompt, lower max_tokens or raise the KV capacity",
                params.sampling.max_tokens,
                self.capacity_tokens
            );
        }
        let grammar = match &params.constraint {
            Some(c) => Some(self.compile_constraint(c, &params.sampling)?),
            None => None,
        };
        let id = self.next_id;
        self.next_id += 1;
        let fallback_seed = self.rng.next_u64();
        let mut sampler = Sampler::new(&params.sampling, fallback_seed);
        if let Some(g) = grammar {
            sampler.set_grammar(g);
        }
        // Room for every token the request may generate: no growth while decoding.
        let mut tokens = try_with_capacity(need, "the tokens of a request")?;
        let mut history_start = prompt_len;
        let mut swapped = None;
        if let Some(r) = restored {
            tokens.extend_from_slice(&r.tokens);
            if params.prompt.is_empty() {
                // A continuation: the output goes on where it stopped.
                history_start = r.history_start;
            }
            // A seeded continuation goes on with the saved random stream,
            // so it draws what the uninterrupted request would have.
            if params.sampling.seed.is_some() {
                sampler.resume_rng(r.rng);
            }
            // At least one token is left to compute: its logits come next.
            let positions = r.kv_positions.min(prompt_len - 1);
            let mut kv = r.kv;
            kv.truncate(positions * self.ctx.kv_values_per_slot());
            swapped = (positions > 0).then_some((positions, kv));
        }
        tokens.extend_from_slice(&params.prompt);
        let detok = self.model.tokenizer.as_ref().map(|tok| match earlier {
            0 => StreamDetokenizer::new(true),
            // A continuation's text follows the restored tokens' text.
            _ => StreamDetokenizer::after(true, tok, &tokens),
        });
        let req = Request {
            sampler,
            stop: StopMatcher::new(&params.sampling.stop_strings),
            detok,
            tokens,
            prompt_len,
            history_start,
            flight_rng: None,
            computed: 0,
            in_kv: false,
            swapped,
            rank: RankInput {
                priority: params.priority,
                arrival: self.next_arrival,
                arrival_step: self.stats.steps,
            },
            params,
            added: arrived,
            first_token_ns: None,
            cached_prompt_tokens: None,
            draft: Vec::new(),
            spec: SpecState::default(),
        };
        self.next_arrival += 1;
        self.requests.insert(id, req);
        self.waiting.push(id);
        self.canceller.admit(id);
        Ok(id)
    }

    /// The grammar mask for a request's constraint (the compiler is built
    /// on first use: it holds the vocabulary's token trie).
    fn compile_constraint(
        &mut self,
        constraint: &Constraint,
        sampling: &crate::sampling::SamplingParams,
    ) -> Result<GrammarMask> {
        if sampling.ignore_eos {
            bail_arg!("ignore_eos cannot be combined with structured output (the output ends where the constraint does)");
        }
        if sampling.min_tokens > 0 {
            bail_arg!("min_tokens cannot be combined with structured output (the constraint decides the length)");
        }
        if self.grammar.is_none() {
            self.grammar = Some(GrammarCompiler::new(&self.model)?);
        }
        self.grammar
            .as_ref()
            .expect("built above")
            .compile(constraint)
    }

    /// Cancels a waiting or running request and frees its KV at once. Its
    /// terminal event (reason `Cancelled`) is reported by the next `step`.
    /// A request that already got its terminal event cannot be cancelled.
    /// Another thread cancels through [`canceller`](Session::canceller).
    pub fn cancel(&mut self, id: RequestId) -> Result<()> {
        // `forget` fails when another thread's cancel was accepted first.
        if !self.requests.contains_key(&id) || !self.canceller.forget(id) {
            bail_arg!("request {id} is not active (unknown, finished or already cancelled)");
        }
        self.end_cancelled(id);
        Ok(())
    }

    /// A handle that cancels this session's requests from any thread
    /// without waiting for a running step (which it interrupts when the
    /// step holds the request). The session applies those cancels at its
    /// next step, or at once through [`apply_cancels`](Session::apply_cancels).
    pub fn canceller(&self) -> Canceller {
        self.canceller.clone()
    }

    /// Applies the cancels accepted by the [`Canceller`] since the last
    /// step: frees their KV and queues their terminal events.
    pub fn apply_cancels(&mut self) {
        let mut ids = std::mem::take(&mut self.scratch.cancels);
        self.canceller.take_pending(&mut ids);
        for &id in &ids {
            // A request that finished while its cancel was queued already
            // has its terminal event.
            self.end_cancelled(id);
        }
        self.scratch.cancels = ids;
    }

    /// Sets (or, with `None`, clears) the check a running step polls within
    /// every layer; when it returns true the step stops, no request
    /// advances, and `step` fails with `ErrorKind::Cancelled`. Stepping
    /// again runs the same work.
    pub fn set_abort_check(&mut self, check: Option<AbortCheck>) {
        self.abort = check;
    }

    /// Ends active request `id` as cancelled (its event queued in
    /// `pending`); false when it is not active.
    fn end_cancelled(&mut self, id: RequestId) -> bool {
        let Some(req) = self.requests.remove(&id) else {
            return false;
        };
        self.waiting.retain(|&r| r != id);
        self.running.retain(|&r| r != id);
        self.retain_if_asked(id, &req, &FinishReason::Cancelled);
        if req.in_kv {
            self.kv.release(id);
        }
        self.release_draft(id);
        let mut event = self.new_event(id);
        event.finish = Some(FinishReason::Cancelled);
        event.usage = Some(self.usage(id, &req));
        self.pending.push(event);
        true
    }

    /// The most tokens one request may hold, prompt and `max_tokens`
    /// together: the model's context length or the session's KV capacity,
    /// whichever is smaller (`add_request` refuses more).
    pub fn request_token_limit(&self) -> usize {
        self.model
            .config()
            .max_position_embeddings
            .min(self.capacity_tokens)
    }

    /// True while a request is queued or running, or an event is pending.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty() || !self.pending.is_empty()
    }

    /// True when `id` was accepted and has not yet been finished or cancelled.
    pub fn is_active(&self, id: RequestId) -> bool {
        self.requests.contains_key(&id)
    }

    pub fn stats(&self) -> SessionStats {
        let mut s = self.stats.clone();
        s.running = self.running.len();
        s.waiting = self.waiting.len();
        s.kv = self.kv.stats();
        s.kv_capacity_tokens = s.kv.total_slots;
        s.memory = self.budget.clone();
        s.workspace = self.ctx.workspace_stats();
        s
    }

    /// Checks the KV manager's invariants, the request queues and, when idle,
    /// that every slot is free or evictable. Used by tests and debug builds.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.kv.check_invariants()?;
        if self.running.len() > self.params.max_seqs {
            return Err(format!(
                "{} running requests exceed max_seqs {}",
                self.running.len(),
                self.params.max_seqs
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for (queue, ids, in_kv) in [
            ("running", &self.running, true),
            ("waiting", &self.waiting, false),
        ] {
            for id in ids {
                if !seen.insert(*id) {
                    return Err(format!("request {id} is queued twice"));
                }
                let Some(r) = self.requests.get(id) else {
                    return Err(format!("{queue} request {id} is unknown"));
                };
                if r.in_kv != in_kv {
                    return Err(format!("{queue} request {id} has in_kv = {}", r.in_kv));
                }
                if r.computed > r.tokens.len() || (!in_kv && r.computed != 0) {
                    return Err(format!(
                        "{queue} request {id} claims {} computed tokens of {}",
                        r.computed,
                        r.tokens.len()
                    ));
                }
                if in_kv && self.kv.mapping(*id).capacity() < r.computed {
                    return Err(format!(
                        "running request {id} has less KV than its {} computed tokens",
                        r.computed
                    ));
                }
                if in_kv && r.swapped.is_some() {
                    return Err(format!("running request {id} still holds swapped-out KV"));
                }
            }
        }
        if seen.len() != self.requests.len() {
            return Err(format!(
                "{} requests tracked but {} queued",
                self.requests.len(),
                seen.len()
            ));
        }
        if self.running.is_empty() {
            let s = self.kv.stats();
            if s.used_slots != 0 || s.free_slots + s.evictable_slots != s.total_slots {
                return Err(format!("no request runs but KV is held: {s:?}"));
            }
        }
        Ok(())
    }

    /// Advances every scheduled request by one engine step and returns the
    /// events of this step (possibly none).
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        self.step_into(&mut events)?;
        Ok(events)
    }

    /// Like [`step`](Session::step), writing this step's events into
    /// `events`. The events already in `events` are taken back and reused
    /// (their token, text and logprob buffers keep their capacity), so a
    /// caller that passes the same vector every step lets a warm decode step
    /// run without heap allocations (greedy sampling, no detokenizer, no
    /// logprobs; see tests/engine_zero_alloc.rs).
    ///
    /// Fails only with `ErrorKind::Cancelled`, when the abort check stopped
    /// the step (see [`set_abort_check`](Session::set_abort_check)): no
    /// request advanced, and the events this step had gathered are
    /// delivered by the next one.
    pub fn step_into(&mut self, events: &mut Vec<Event>) -> Result<()> {
        let started = Instant::now();
        self.scratch.spare_events.append(events);
        self.apply_cancels();
        events.append(&mut self.pending);
        if let Some(f) = self.faults.as_mut() {
            f.begin_step(self.stats.steps);
        }
        // A step launched by the last call is this call's step (a request
        // gets at most one event per call); the next one is launched behind
        // it when the running requests allow.
        let ran = match self.in_flight.take() {
            Some(flight) => {
                self.advance(flight, events);
                Ok(())
            }
            None => self.schedule_and_run(events),
        };
        if let Err(aborted) = ran {
            self.pending.append(events);
            return Err(aborted);
        }
        self.stamp_usage(events, Instant::now());
        self.stats.steps += 1;
        self.stats.step_time_ns += started.elapsed().as_nanos() as u64;
        if cfg!(debug_assertions) {
            if let Err(e) = self.check_invariants() {
                panic!("session invariant violated: {e}");
            }
        }
        Ok(())
    }

    /// Plans a step and runs it (or launches it, then lands it). A forward
    /// stopped for a cancel is dropped (nobody advances) and the cancels are
    /// applied; one stopped by the abort check fails the step.
    fn schedule_and_run(&mut self, events: &mut Vec<Event>) -> Result<()> {
        self.schedule(events);
        if !self.scratch.plan.is_empty() {
            self.warm_drafts();
            let injected = self.faults.as_mut().and_then(|f| {
                let step = self.stats.steps;
                let error = f.take_forward_error(step);
                // Armed only for a pass that runs (it would fire later).
                if error.is_none() && f.take_pool_failure(step) {
                    self.pool_fault.arm();
                }
                error
            });
            let (result, interrupted_by_cancel) = match injected {
                Some(e) => (Err(e), false),
                None => self.run_forward(),
            };
            match result {
                Ok(false) => self.finish_step(events),
                Ok(true) => {
                    let flight = self.launched();
                    self.advance(flight, events)
                }
                Err(e) if e.kind == ErrorKind::Cancelled => {
                    self.scratch.plan.clear();
                    if !interrupted_by_cancel {
                        return Err(e);
                    }
                    self.apply_cancels();
                    events.append(&mut self.pending);
                }
                Err(e) => self.fail_scheduled(&e, events),
            }
        }
        Ok(())
    }

    /// TESTING ONLY: raises the faults of `plan` at the steps it names
    /// (replacing any earlier plan). See [`FaultPlan`].
    #[doc(hidden)]
    pub fn inject_faults(&mut self, plan: FaultPlan) {
        self.faults = Some(Box::new(FaultState::new(plan)));
    }

    /// TESTING ONLY: the faults raised so far under the current plan.
    #[doc(hidden)]
    pub fn injected_faults(&self) -> FaultCounts {
        self.faults.as_ref().map(|f| f.counts).unwrap_or_default()
    }

    /// TESTING ONLY: KV tokens that swapped-out requests hold in host memory.
    #[doc(hidden)]
    pub fn swapped_host_tokens(&self) -> usize {
        let held = self.requests.values().filter_map(|r| r.swapped.as_ref());
        held.map(|(n, _)| n).sum()
    }

    /// `kv.allocate`, unless an injected fault says the cache is exhausted.
    fn kv_allocate(&mut self, id: RequestId, total: usize) -> bool {
        if let Some(f) = self.faults.as_mut() {
            if f.kv_allocation_fails() {
                return false;
            }
        }
        self.kv.allocate(id, total)
    }

    /// An empty event for `id`, recycled from an earlier step when one is spare.
    fn new_event(&mut self, id: RequestId) -> Event {
        match self.scratch.spare_events.pop() {
            Some(mut e) => {
                e.request_id = id;
                e.tokens.clear();
                e.text.clear();
                e.logprobs.clear();
                e.finish = None;
                e.usage = None;
                e
            }
            None => Event {
                request_id: id,
                tokens: Vec::new(),
                text: String::new(),
                logprobs: Vec::new(),
                finish: None,
                usage: None,
            },
        }
    }

    /// The usage of request `id`, which ends now. Its total time (and the
    /// first token's, when this event carries it) is stamped by
    /// `stamp_usage` when `step_into` returns the event.
    fn usage(&mut self, id: RequestId, req: &Request) -> Usage {
        self.scratch.ended.push((id, req.added));
        Usage {
            prompt_tokens: req.prompt_len,
            cached_prompt_tokens: req.cached_prompt_tokens.unwrap_or(0),
            generated_tokens: req.tokens.len() - req.prompt_len,
            time_to_first_token_ns: req.first_token_ns.unwrap_or(0),
            total_time_ns: 0,
        }
    }

    /// Stamps the usage times of the events `step_into` is about to return
    /// at `now`: the first token of a request that had none yet, and the
    /// total time of every terminal event.
    fn stamp_usage(&mut self, events: &mut [Event], now: Instant) {
        // At least 1 ns, so that 0 keeps meaning "no token".
        let since = |t: Instant| (now.saturating_duration_since(t).as_nanos() as u64).max(1);
        for ev in events.iter_mut() {
            if let Some(usage) = ev.usage.as_mut() {
                let ended = &mut self.scratch.ended;
                let i = ended.iter().position(|&(id, _)| id == ev.request_id);
                debug_assert!(i.is_some(), "terminal event without an arrival");
                let Some(i) = i else { continue };
                usage.total_time_ns = since(ended.swap_remove(i).1);
                if usage.generated_tokens > 0 && usage.time_to_first_token_ns == 0 {
                    usage.time_to_first_token_ns = usage.total_time_ns;
                }
            } else if !ev.tokens.is_empty() {
                if let Some(req) = self.requests.get_mut(&ev.request_id) {
                    req.first_token_ns.get_or_insert_with(|| since(req.added));
                }
            }
        }
        // Anything left belongs to events a panicking step never returned.
        self.scratch.ended.clear();
    }
}

/// The budget report of a new session.
fn budget_report(
    mem: &DeviceMemory,
    shape: &ContextShape,
    source: BudgetSource,
    kv: KvStats,
    per_token: usize,
    context: usize,
) -> MemoryBudget {
    let block = kv.granularity.max(1);
    let utilization = source == BudgetSource::Utilization;
    let kv_blocks = kv.total_slots / block;
    MemoryBudget {
        source,
        utilization: if utilization {
            shape.memory_utilization
        } else {
            0.0
        },
        total_bytes: mem.total_bytes,
        available_bytes: mem.available_bytes,
        weights_bytes: mem.weights_bytes,
        workspace_bytes: mem.workspace_bytes,
        profiled_peak_bytes: mem.profiled_peak_bytes,
        kv_bytes: shape.kv_slots * per_token,
        kv_bytes_per_token: per_token,
        kv_dtype: shape.kv_dtype,
        kv_block_size: block,
        kv_blocks,
        kv_tokens: kv.total_slots,
        context_tokens: context,
        max_full_context_seqs: kv_blocks / context.div_ceil(block).max(1),
        limited_by_available: utilization
            && mem.total_bytes > 0
            && utilization_kv_bytes(mem, shape.memory_utilization).is_ok_and(|(_, l)| l),
    }
}
