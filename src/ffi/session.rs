//! Session handles: create, add requests, cancel, stats, free.

use super::args;
use super::boundary::{ffi_call, ffi_value};
use super::log::{emit, NI_LOG_INFO, NI_LOG_WARN};
use super::model::ni_model;
use super::request::{self, ni_request_params};
use super::status::ni_status;
use crate::engine::{
    Canceller, Model, PreemptionMode, SchedulePolicyKind, Session, SessionParams,
    SpeculativeMethod, SpeculativeParams,
};
use crate::kv::{KvBackendKind, KvCacheDType};
use crate::memory::{BudgetSource, MemoryPoolKind};
use crate::{bail_arg, Error, Result};
use std::sync::{Arc, Mutex, MutexGuard};

/// KV cache manager.
pub type ni_kv_backend = u32;
/// vLLM-style paged blocks with hash-chained prefix reuse (default).
pub const NI_KV_BACKEND_PAGED: ni_kv_backend = 0;
/// SGLang-style token pool with a radix-tree prefix cache.
pub const NI_KV_BACKEND_TOKEN: ni_kv_backend = 1;

/// Where a session's memory comes from: the CPU forward's per-step
/// temporaries (`NI_MEMORY_POOL_SYSTEM`, `_CPU_ARENA`, `_CPU_SLAB`), or a GPU
/// session's workspace and KV cache (`NI_MEMORY_POOL_CUDA_*`). A pool of the
/// other kind of device fails `ni_session_create` with
/// `NI_ERR_INVALID_ARGUMENT`.
pub type ni_memory_pool = u32;
/// The device's default: the CPU arena on the CPU, the CUDA stream-ordered
/// pool on a GPU.
pub const NI_MEMORY_POOL_DEFAULT: ni_memory_pool = 0;
/// The system allocator: every temporary is a fresh allocation (the baseline).
pub const NI_MEMORY_POOL_SYSTEM: ni_memory_pool = 1;
/// One region sized up front from the model and the session limits, bump
/// allocation, reset every step: no allocator calls once the session exists.
/// A step larger than planned resizes it explicitly (logged).
pub const NI_MEMORY_POOL_CPU_ARENA: ni_memory_pool = 2;
/// Power-of-two size classes (16 B to 512 KiB) with free lists; larger
/// blocks go to the system allocator.
pub const NI_MEMORY_POOL_CPU_SLAB: ni_memory_pool = 3;
/// GPU: a stream-ordered CUDA memory pool of the session's own
/// (cudaMallocAsync-style, on the compute stream); destroyed, and its memory
/// returned to the driver, with the session.
pub const NI_MEMORY_POOL_CUDA_STREAM: ni_memory_pool = 4;
/// GPU: a buddy allocator over one device allocation sized for the
/// session's workspace and KV cache, made once at creation.
pub const NI_MEMORY_POOL_CUDA_BUDDY: ni_memory_pool = 5;

/// Scheduling policy.
pub type ni_schedule_policy = u32;
/// First come, first served (default).
pub const NI_SCHEDULE_FCFS: ni_schedule_policy = 0;
/// Lower `priority` first; waiting requests age so nothing starves.
pub const NI_SCHEDULE_PRIORITY: ni_schedule_policy = 1;

/// What happens to a running request when KV memory runs out.
pub type ni_preemption_mode = u32;
/// Free its KV and recompute it when resumed (default).
pub const NI_PREEMPTION_RECOMPUTE: ni_preemption_mode = 0;
/// Copy its KV to host memory and back when resumed.
pub const NI_PREEMPTION_SWAP: ni_preemption_mode = 1;

/// What a session's KV cache stores.
pub type ni_kv_cache_dtype = u32;
/// The model's activation dtype (CUDA: bf16 or f16; CPU: f32).
pub const NI_KV_CACHE_DTYPE_AUTO: ni_kv_cache_dtype = 0;
/// FP8 e4m3, unscaled (vLLM's `kv_cache_dtype="fp8"`): half the bytes of a
/// 16-bit cache, so twice the tokens per byte. CUDA only; a CPU model
/// refuses it with `NI_ERR_UNSUPPORTED`.
pub const NI_KV_CACHE_DTYPE_FP8: ni_kv_cache_dtype = 1;

/// Speculative decoding method (`ni_session_params.speculative_method`).
pub type ni_speculative_method = u32;
/// No speculation (default).
pub const NI_SPECULATIVE_NONE: ni_speculative_method = 0;
/// Prompt lookup: drafts the tokens that followed the latest earlier
/// occurrence of the request's last n tokens (`ngram_min..=ngram_max`).
pub const NI_SPECULATIVE_NGRAM: ni_speculative_method = 1;
/// A draft model (`draft_model`) with the target's vocabulary decodes
/// greedily a few tokens ahead; its KV shares the session's budget.
pub const NI_SPECULATIVE_DRAFT: ni_speculative_method = 2;

/// Shape of a session. Fill with `ni_session_params_init`, then change fields.
///
/// KV capacity is taken from the first non-zero of `kv_capacity_tokens`,
/// `kv_memory_bytes`, `kv_memory_fraction`, `memory_utilization`; when all
/// are 0 the engine picks a budget (CPU: a quarter of available memory, at
/// most 2 GiB; GPU: 90% of device memory minus weights and temporaries).
/// The KV cache is allocated once, at creation; `ni_session_get_stats`
/// reports the resulting budget.
///
/// Fields are only ever appended: a caller built against an older header
/// (a smaller `struct_size`) gets the defaults for the fields it lacks.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ni_session_params {
    /// `sizeof(ni_session_params)`, set by `ni_session_params_init`.
    pub struct_size: u32,
    /// `NI_KV_BACKEND_*`; default paged.
    pub kv_backend: ni_kv_backend,
    /// `NI_MEMORY_POOL_*`; default `NI_MEMORY_POOL_DEFAULT`.
    pub memory_pool: ni_memory_pool,
    /// Tokens per KV block (paged backend), 1-1024. Default 16.
    pub block_size: u32,
    /// KV capacity in tokens; 0 = use the byte budget. At most 2^31 - 1
    /// (`NI_ERR_INVALID_ARGUMENT` beyond).
    pub kv_capacity_tokens: u64,
    /// KV budget in bytes; 0 = use the fraction. An explicit capacity or
    /// budget whose KV cache plus step workspace exceeds the memory the
    /// process may use now (the least of MemAvailable, its cgroup's memory
    /// limit minus usage and RLIMIT_AS minus its address space) fails
    /// `ni_session_create` with `NI_ERR_OUT_OF_MEMORY`, naming the field.
    pub kv_memory_bytes: u64,
    /// KV budget as a fraction (0, 1] of the memory available now; 0 = automatic.
    pub kv_memory_fraction: f32,
    /// Token budget of one step (prefill chunks + decode tokens). 0 (the
    /// default) = automatic: 512 on the CPU, 8192 on a GPU. At most 2^20.
    pub max_batched_tokens: u32,
    /// Most requests in one step. 0 (the default) = automatic: 64 on the
    /// CPU, 256 on a GPU. At most 65536.
    pub max_seqs: u32,
    /// Longest prefill piece of one request in one step. 0 (the default) =
    /// the step's token budget. At most 2^20.
    pub prefill_chunk_size: u32,
    /// `NI_SCHEDULE_*`; default FCFS.
    pub policy: ni_schedule_policy,
    /// Steps a waiting request needs to gain one priority level. Default 64.
    pub aging_steps: u64,
    /// Reuse KV of shared prompt prefixes. Default true.
    pub prefix_caching: bool,
    /// `NI_PREEMPTION_*`; default recompute.
    pub preemption: ni_preemption_mode,
    /// Seeds the random stream of requests without their own seed. Default 0.
    pub seed: u64,
    /// KV budget as a fraction (0, 1] of the device's total memory minus the
    /// weights minus the planned step workspace (vLLM's
    /// `gpu_memory_utilization`), on the CPU too, where it never exceeds the
    /// memory available now; 0 = automatic. Default 0. (Appended in a later version: see `struct_size`.)
    pub memory_utilization: f32,
    /// `NI_KV_CACHE_DTYPE_*`; default `NI_KV_CACHE_DTYPE_AUTO` (0). Appended
    /// later, into what was the struct's tail padding, so `sizeof` did not
    /// change: a caller built against the older header that filled the struct
    /// with `ni_session_params_init` (or zeroed it) gets the default, and a
    /// value that is not an `NI_KV_CACHE_DTYPE_*` is refused.
    pub kv_cache_dtype: ni_kv_cache_dtype,
    /// Speculative decoding: `NI_SPECULATIVE_*`; default none. Greedy
    /// output is identical to decoding without it and sampled output has
    /// the same distribution (a seeded request draws the same tokens); a
    /// request may opt out (`ni_request_params.disable_speculation`).
    /// (Appended in a later version, with the fields below: see `struct_size`.)
    pub speculative_method: ni_speculative_method,
    /// Most tokens a request drafts per step, 1-16; 0 (default) = the
    /// method's default (8 for n-gram lookup, 4 for a draft model).
    pub num_speculative_tokens: u32,
    /// With `NI_SPECULATIVE_DRAFT`: the draft model, on the target's device
    /// and with its tokenizer (checked at `ni_session_create`; a draft with
    /// another vocabulary fails with `NI_ERR_INVALID_ARGUMENT`). The session
    /// holds its own reference: the handle may be freed after creation.
    pub draft_model: *const ni_model,
    /// No request drafts in a step with more running requests than this
    /// (a large batch gains nothing from it); 0 (default) = 4, the
    /// measured crossover.
    pub speculative_max_batch: u32,
    /// With `NI_SPECULATIVE_NGRAM`: the n-gram lengths tried, longest first.
    /// Defaults 2 and 4; 1 <= ngram_min <= ngram_max <= 64.
    pub ngram_min: u32,
    pub ngram_max: u32,
}

// SAFETY: the only pointer, `draft_model`, is a model handle, and models
// are shared between threads by design (`ni_model` is `Send + Sync`); the
// struct itself is plain data the library copies.
unsafe impl Send for ni_session_params {}

/// `struct_size` of `ni_session_params` before `memory_utilization`.
pub(crate) const NI_SESSION_PARAMS_SIZE_V1: usize =
    std::mem::offset_of!(ni_session_params, memory_utilization);
/// `struct_size` of `ni_session_params` before the speculative fields.
pub(crate) const NI_SESSION_PARAMS_SIZE_V2: usize =
    std::mem::offset_of!(ni_session_params, speculative_method);

const _: () = assert!(
    NI_SESSION_PARAMS_SIZE_V2 == std::mem::offset_of!(ni_session_params, kv_cache_dtype) + 4,
    "the speculative fields must start where the struct ended before them"
);

impl Default for ni_session_params {
    fn default() -> Self {
        let d = SessionParams::default();
        ni_session_params {
            struct_size: size_of::<ni_session_params>() as u32,
            kv_backend: match d.kv_backend {
                KvBackendKind::Paged => NI_KV_BACKEND_PAGED,
                KvBackendKind::Token => NI_KV_BACKEND_TOKEN,
            },
            memory_pool: NI_MEMORY_POOL_DEFAULT,
            block_size: d.block_size as u32,
            kv_capacity_tokens: d.kv_capacity_tokens as u64,
            kv_memory_bytes: d.kv_memory_bytes as u64,
            kv_memory_fraction: 0.0,
            max_batched_tokens: d.max_batched_tokens as u32,
            max_seqs: d.max_seqs as u32,
            prefill_chunk_size: d.prefill_chunk_size as u32,
            policy: match d.policy {
                SchedulePolicyKind::Fcfs => NI_SCHEDULE_FCFS,
                SchedulePolicyKind::Priority => NI_SCHEDULE_PRIORITY,
            },
            aging_steps: d.aging_steps,
            prefix_caching: d.prefix_caching,
            preemption: match d.preemption {
                PreemptionMode::Recompute => NI_PREEMPTION_RECOMPUTE,
                PreemptionMode::Swap => NI_PREEMPTION_SWAP,
            },
            seed: d.seed,
            memory_utilization: d.memory_utilization,
            kv_cache_dtype: match d.kv_cache_dtype {
                KvCacheDType::Auto => NI_KV_CACHE_DTYPE_AUTO,
                KvCacheDType::Fp8E4m3 => NI_KV_CACHE_DTYPE_FP8,
            },
            speculative_method: NI_SPECULATIVE_NONE,
            num_speculative_tokens: 0,
            draft_model: std::ptr::null(),
            speculative_max_batch: 0,
            ngram_min: 2,
            ngram_max: 4,
        }
    }
}

fn to_usize(v: u64, what: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| {
        Error::invalid_arg(format!("session params: {what} {v} does not fit in memory"))
    })
}

/// The speculative decoding `p` asks for.
///
/// # Safety
/// `p.draft_model` is NULL or a live model handle.
unsafe fn speculative(p: &ni_session_params) -> Result<Option<SpeculativeParams>> {
    let method = match p.speculative_method {
        NI_SPECULATIVE_NONE => return Ok(None),
        NI_SPECULATIVE_NGRAM => SpeculativeMethod::Ngram {
            min_n: p.ngram_min as usize,
            max_n: p.ngram_max as usize,
        },
        NI_SPECULATIVE_DRAFT => {
            if p.draft_model.is_null() {
                bail_arg!("session params: NI_SPECULATIVE_DRAFT needs draft_model");
            }
            // SAFETY: non-NULL; a live handle per the contract.
            let m = unsafe { args::handle(p.draft_model, "params.draft_model")? };
            SpeculativeMethod::Draft(m.model.clone())
        }
        v => bail_arg!("session params: speculative_method {v} is not an NI_SPECULATIVE_* value"),
    };
    let params = SpeculativeParams {
        method,
        num_speculative_tokens: p.num_speculative_tokens as usize,
        max_batch: p.speculative_max_batch as usize,
    };
    params
        .validate()
        .map_err(|e| Error::invalid_arg(format!("session params: {}", e.message)))?;
    Ok(Some(params))
}

/// # Safety
/// `p.draft_model` is NULL or a live model handle.
unsafe fn to_engine(p: &ni_session_params) -> Result<SessionParams> {
    let kv_backend = match p.kv_backend {
        NI_KV_BACKEND_PAGED => KvBackendKind::Paged,
        NI_KV_BACKEND_TOKEN => KvBackendKind::Token,
        v => bail_arg!("session params: kv_backend {v} is not an NI_KV_BACKEND_* value"),
    };
    let memory_pool = match p.memory_pool {
        NI_MEMORY_POOL_DEFAULT => None,
        NI_MEMORY_POOL_SYSTEM => Some(MemoryPoolKind::System),
        NI_MEMORY_POOL_CPU_ARENA => Some(MemoryPoolKind::Arena),
        NI_MEMORY_POOL_CPU_SLAB => Some(MemoryPoolKind::Slab),
        NI_MEMORY_POOL_CUDA_STREAM => Some(MemoryPoolKind::CudaStream),
        NI_MEMORY_POOL_CUDA_BUDDY => Some(MemoryPoolKind::CudaBuddy),
        v => bail_arg!("session params: memory_pool {v} is not an NI_MEMORY_POOL_* value"),
    };
    let mu = p.memory_utilization;
    if !(mu == 0.0 || (mu > 0.0 && mu <= 1.0)) {
        bail_arg!("session params: memory_utilization must be in (0, 1] (0 = automatic), got {mu}");
    }
    let policy = match p.policy {
        NI_SCHEDULE_FCFS => SchedulePolicyKind::Fcfs,
        NI_SCHEDULE_PRIORITY => SchedulePolicyKind::Priority,
        v => bail_arg!("session params: policy {v} is not an NI_SCHEDULE_* value"),
    };
    let preemption = match p.preemption {
        NI_PREEMPTION_RECOMPUTE => PreemptionMode::Recompute,
        NI_PREEMPTION_SWAP => PreemptionMode::Swap,
        v => bail_arg!("session params: preemption {v} is not an NI_PREEMPTION_* value"),
    };
    let kv_cache_dtype = match p.kv_cache_dtype {
        NI_KV_CACHE_DTYPE_AUTO => KvCacheDType::Auto,
        NI_KV_CACHE_DTYPE_FP8 => KvCacheDType::Fp8E4m3,
        v => bail_arg!("session params: kv_cache_dtype {v} is not an NI_KV_CACHE_DTYPE_* value"),
    };
    let f = p.kv_memory_fraction;
    if !(0.0..=1.0).contains(&f) {
        bail_arg!("session params: kv_memory_fraction must be in [0, 1] (0 = automatic), got {f}");
    }
    let mut kv_memory_bytes = to_usize(p.kv_memory_bytes, "kv_memory_bytes")?;
    if p.kv_capacity_tokens == 0 && kv_memory_bytes == 0 && f > 0.0 {
        let available = crate::sysinfo::available_memory_bytes().ok_or_else(|| {
            Error::unsupported("session params: kv_memory_fraction needs the available memory, which this OS does not report; set kv_memory_bytes")
        })?;
        kv_memory_bytes = ((available as f64) * f as f64) as usize;
        if kv_memory_bytes == 0 {
            bail_arg!(
                "session params: kv_memory_fraction {f} of {available} available bytes is 0 bytes"
            );
        }
    }
    Ok(SessionParams {
        kv_backend,
        block_size: p.block_size as usize,
        kv_capacity_tokens: to_usize(p.kv_capacity_tokens, "kv_capacity_tokens")?,
        kv_memory_bytes,
        gpu_memory_utilization: crate::model::ContextShape::DEFAULT_MEMORY_UTILIZATION,
        memory_utilization: mu,
        memory_pool,
        max_batched_tokens: p.max_batched_tokens as usize,
        max_seqs: p.max_seqs as usize,
        prefill_chunk_size: p.prefill_chunk_size as usize,
        policy,
        aging_steps: p.aging_steps,
        prefix_caching: p.prefix_caching,
        preemption,
        seed: p.seed,
        device_sampling: true,
        kv_cache_dtype,
        overlap_steps: None,
        // SAFETY: forwarded contract.
        speculative: unsafe { speculative(p)? },
    })
}

/// A serving session: requests, scheduler and KV cache over one model.
/// Internally serialized by a mutex, so calls from different threads are
/// memory-safe; see each function for what may overlap usefully.
pub struct ni_session {
    /// The model, also reachable without the lock (for tokenizing prompts).
    pub(crate) model: Arc<Model>,
    /// Cancels without the lock, so a cancel never waits for a step.
    pub(crate) canceller: Canceller,
    pub(crate) state: Mutex<SessionState>,
}

pub(crate) struct SessionState {
    pub(crate) session: Session,
    /// Test hook (`ni_debug_force_panic`): the next step panics while locked.
    pub(crate) panic_next_step: bool,
}

impl ni_session {
    /// Locks the session. If an earlier call panicked while holding the lock,
    /// the session is reused only when its consistency checks pass.
    /// Fails with `ErrorKind::Busy` on the thread running this session's
    /// abort callback, whose step holds the lock.
    pub(crate) fn lock(&self) -> Result<MutexGuard<'_, SessionState>> {
        super::abort::refuse_inside_callback()?;
        match self.state.lock() {
            Ok(guard) => Ok(guard),
            Err(poisoned) => {
                let guard = poisoned.into_inner();
                if let Err(e) = guard.session.check_invariants() {
                    return Err(Error::internal(format!(
                        "the session is unusable after an internal panic ({e}); free it and create a new one"
                    )));
                }
                self.state.clear_poison();
                drop(guard);
                // Logged without the lock: the callback may call into this session.
                emit(
                    NI_LOG_WARN,
                    "session recovered after an internal panic; its consistency checks pass",
                );
                self.state.lock().map_err(|_| {
                    Error::internal("the session lock was poisoned again during recovery")
                })
            }
        }
    }
}

/// Fills `params` with the defaults and sets `struct_size`. NULL is a no-op.
///
/// Thread-safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn ni_session_params_init(params: *mut ni_session_params) {
    ffi_value("ni_session_params_init", (), || {
        if let Ok(p) = args::out_ptr(params, "params") {
            // SAFETY: non-NULL and aligned (checked); the caller provides room for the struct.
            unsafe { p.write(ni_session_params::default()) };
        }
    })
}

/// Creates a session over `model` (`params` may be NULL for the defaults)
/// and allocates its KV cache. The session holds its own reference to the
/// model: `ni_model_free` may be called before `ni_session_free`.
///
/// On success `*out_session` receives a handle to free with
/// `ni_session_free`. Fails with `NI_ERR_OUT_OF_MEMORY` when a KV budget in
/// bytes (`kv_memory_bytes`, a fraction, or the automatic one) holds fewer
/// tokens than one context: the model's context length, counted as at most
/// 4096 tokens (an explicit `kv_capacity_tokens` may be smaller; requests
/// longer than it are then refused). It also fails so when an explicit KV
/// size does not fit in the memory available to the process (see
/// `kv_memory_bytes`), and with `NI_ERR_INVALID_ARGUMENT` for a size beyond
/// its documented limit.
/// Thread-safety: any thread; several sessions may share one model and be
/// driven from different threads at once (their steps take turns on the
/// model's kernel threads; one session with many requests is faster).
#[no_mangle]
pub unsafe extern "C" fn ni_session_create(
    model: *const ni_model,
    params: *const ni_session_params,
    out_session: *mut *mut ni_session,
) -> ni_status {
    ffi_call("ni_session_create", || {
        // SAFETY: per this function's contract.
        let m = unsafe { args::handle(model, "model")? };
        // SAFETY: per this function's contract.
        let p = unsafe {
            args::params_versioned(
                params,
                ni_session_params::default,
                &[NI_SESSION_PARAMS_SIZE_V1, NI_SESSION_PARAMS_SIZE_V2],
                "params",
            )?
        };
        let out = args::out_ptr(out_session, "out_session")?;
        // SAFETY: per this function's contract (`draft_model`).
        let engine_params = unsafe { to_engine(&p)? };
        let session = Session::new(m.model.clone(), engine_params)?;
        let st = session.stats();
        emit(
            NI_LOG_INFO,
            &format!(
                "session created: {} KV backend, {} tokens of KV capacity, {} tokens per block, {} memory pool; {}",
                p_kv_name(p.kv_backend),
                st.kv_capacity_tokens,
                st.kv.granularity,
                engine_pool_name(&st),
                st.memory
            ),
        );
        let handle = Box::new(ni_session {
            model: m.model.clone(),
            canceller: session.canceller(),
            state: Mutex::new(SessionState {
                session,
                panic_next_step: false,
            }),
        });
        // SAFETY: out was checked non-NULL and aligned.
        unsafe { out.write(Box::into_raw(handle)) };
        Ok(())
    })
}

fn engine_pool_name(st: &crate::engine::SessionStats) -> &'static str {
    st.workspace.map_or("device", |w| w.pool.as_str())
}

fn p_kv_name(k: ni_kv_backend) -> &'static str {
    if k == NI_KV_BACKEND_TOKEN {
        "token"
    } else {
        "paged"
    }
}

/// Frees a session, its KV cache and every request still in it (no events
/// are delivered for them). NULL is a no-op.
///
/// Thread-safety: no other call may use this session during or after this one.
#[no_mangle]
pub unsafe extern "C" fn ni_session_free(session: *mut ni_session) {
    ffi_value("ni_session_free", (), || {
        if !session.is_null() {
            // SAFETY: a non-NULL handle came from Box::into_raw in
            // ni_session_create and is freed once, per the contract.
            drop(unsafe { Box::from_raw(session) });
        }
    })
}

/// Validates `request` and queues it; on success `*out_id` receives its id
/// (ids start at 1 and are never reused within a session). Nothing is queued
/// on failure: `NI_ERR_INVALID_ARGUMENT` names the bad parameter (empty
/// prompt, token id outside the vocabulary, prompt + max_tokens beyond the
/// context length or the KV capacity, NaN temperature, top_p outside
/// (0, 1], ...).
///
/// Thread-safety: any thread; serialized with other calls on this session
/// (it waits for a running `ni_session_step`).
#[no_mangle]
pub unsafe extern "C" fn ni_session_add_request(
    session: *mut ni_session,
    request: *const ni_request_params,
    out_id: *mut u64,
) -> ni_status {
    ffi_call("ni_session_add_request", || {
        // The request's usage times count from the caller's call, so they
        // include tokenizing its text and waiting for a running step.
        let arrived = std::time::Instant::now();
        // SAFETY: per this function's contract.
        let s = unsafe { args::handle(session, "session")? };
        if request.is_null() {
            bail_arg!("request is NULL");
        }
        // SAFETY: per this function's contract.
        let p = unsafe { args::params(request, ni_request_params::default, "request")? };
        let out = args::out_ptr(out_id, "out_id")?;
        // SAFETY: the pointers inside the request follow its documented contract.
        let engine_request = unsafe { request::to_engine(&p, &s.model)? };
        let id = s.lock()?.session.add_request_at(engine_request, arrived)?;
        // SAFETY: out was checked non-NULL and aligned.
        unsafe { out.write(id) };
        Ok(())
    })
}

/// Cancels a waiting or running request. Its terminal event (finish reason
/// `NI_FINISH_CANCELLED`) is delivered by the next `ni_session_step`. An
/// unknown, finished or already cancelled id fails with
/// `NI_ERR_INVALID_ARGUMENT` and changes nothing.
///
/// Never waits for a running step. When no step is running the request's
/// KV is freed before this returns. A step running now that computes the
/// request stops within one layer of the model (milliseconds, also in a
/// long prompt's prefill; the other requests of that step are computed
/// again by the next step), and the step returns the terminal event. A
/// request whose cancel succeeded always ends `NI_FINISH_CANCELLED`, even
/// when the running step had completed it.
///
/// Thread-safety: any thread, at any time, also from the abort callback.
#[no_mangle]
pub unsafe extern "C" fn ni_session_cancel(session: *mut ni_session, request_id: u64) -> ni_status {
    ffi_call("ni_session_cancel", || {
        // SAFETY: per this function's contract.
        let s = unsafe { args::handle(session, "session")? };
        s.canceller.cancel(request_id)?;
        // Without a running step, free the request's KV now. A step that
        // holds the lock applies the cancel itself.
        if let Ok(mut state) = s.state.try_lock() {
            state.session.apply_cancels();
        }
        Ok(())
    })
}

/// Counters and occupancy of a session, filled by `ni_session_get_stats`.
/// KV figures are in tokens; `kv_block_size` is the allocation granularity
/// (block size for paged, 1 for the token pool), so blocks = tokens / it.
///
/// Fields are only ever appended. A caller built against an older header
/// sets the older `struct_size` and gets the fields it knows.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ni_session_stats {
    /// Set to `sizeof(ni_session_stats)` before calling `ni_session_get_stats`.
    pub struct_size: u32,
    /// Requests scheduled in the KV cache / waiting for admission.
    pub running: u64,
    pub waiting: u64,
    /// Usable KV capacity: the requested capacity rounded up to whole blocks
    /// (so `kv_used_tokens + kv_free_tokens + kv_cached_tokens` never exceeds
    /// it). A single request is still limited to the requested capacity.
    pub kv_capacity_tokens: u64,
    pub kv_block_size: u64,
    /// Slots referenced by live requests.
    pub kv_used_tokens: u64,
    /// Slots on the free list.
    pub kv_free_tokens: u64,
    /// Slots holding reusable cached prefixes nobody references (evictable).
    pub kv_cached_tokens: u64,
    /// Engine steps run.
    pub steps: u64,
    /// Prompt tokens computed / tokens decoded.
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    /// Prefix-cache lookups that reused at least one token, and tokens reused.
    pub prefix_cache_hits: u64,
    pub prefix_cache_tokens_reused: u64,
    /// Running requests preempted for KV room, and tokens swapped to host memory.
    pub preemptions: u64,
    pub swapped_out_tokens: u64,
    // --- memory budget, fixed at session creation (appended; see `struct_size`) ---
    /// How the KV capacity was chosen: `NI_BUDGET_*`.
    pub memory_budget_source: ni_budget_source,
    /// `NI_MEMORY_POOL_*` the session uses (never `NI_MEMORY_POOL_DEFAULT`:
    /// the device's default resolved).
    pub memory_pool: ni_memory_pool,
    /// Device memory in total and available at creation (0 when unknown).
    pub memory_total_bytes: u64,
    pub memory_available_bytes: u64,
    /// Bytes of the model's weights.
    pub memory_weights_bytes: u64,
    /// Planned peak of the step workspace plus the logits rows.
    pub memory_workspace_bytes: u64,
    /// Bytes of the KV cache, and of one token's KV across all layers.
    pub kv_memory_bytes: u64,
    pub kv_bytes_per_token: u64,
    /// Usable KV blocks (`kv_capacity_tokens / kv_block_size`).
    pub kv_blocks: u64,
    /// The model's context length, and how many sequences of that length fit at once.
    pub context_tokens: u64,
    pub max_full_context_seqs: u64,
    /// The utilization fraction applied (`NI_BUDGET_UTILIZATION`), else 0.
    pub memory_utilization: f32,
    /// True when a utilization budget was lowered to the memory available now.
    pub memory_limited_by_available: bool,
    // --- workspace figures, current (appended) ---
    /// Bytes the step workspace's pool holds now, and its peak use.
    pub workspace_capacity_bytes: u64,
    pub workspace_peak_bytes: u64,
    /// Times the pool asked the system allocator for memory (an arena: once,
    /// plus one per explicit resize).
    pub workspace_system_allocations: u64,
    /// Explicit arena resizes (steps larger than planned).
    pub workspace_resizes: u64,
    // --- profiled budget (appended) ---
    /// Peak temporaries measured by the profiling forward of a GPU's
    /// automatic KV budget (0 when the budget was not profiled); compare
    /// with the planned `memory_workspace_bytes`.
    pub memory_profiled_peak_bytes: u64,
    // --- speculative decoding (appended; see `struct_size`) ---
    /// Tokens drafted and verified, the drafted tokens kept, and the
    /// (request, step) verifications: a verifying step gives a request
    /// `1 + spec_accepted_tokens / spec_verifications` tokens on average.
    pub spec_draft_tokens: u64,
    pub spec_accepted_tokens: u64,
    pub spec_verifications: u64,
}

/// `struct_size` of `ni_session_stats` before the memory budget fields.
pub(crate) const NI_SESSION_STATS_SIZE_V1: usize =
    std::mem::offset_of!(ni_session_stats, memory_budget_source);
/// `struct_size` of `ni_session_stats` before `memory_profiled_peak_bytes`.
pub(crate) const NI_SESSION_STATS_SIZE_V2: usize =
    std::mem::offset_of!(ni_session_stats, memory_profiled_peak_bytes);
/// `struct_size` of `ni_session_stats` before the speculative counters.
pub(crate) const NI_SESSION_STATS_SIZE_V3: usize =
    std::mem::offset_of!(ni_session_stats, spec_draft_tokens);

/// How a session's KV capacity was chosen.
pub type ni_budget_source = u32;
/// The device's automatic budget.
pub const NI_BUDGET_AUTOMATIC: ni_budget_source = 0;
/// `kv_capacity_tokens`.
pub const NI_BUDGET_TOKENS: ni_budget_source = 1;
/// `kv_memory_bytes` (or `kv_memory_fraction` of the memory available then).
pub const NI_BUDGET_BYTES: ni_budget_source = 2;
/// `memory_utilization`.
pub const NI_BUDGET_UTILIZATION: ni_budget_source = 3;

/// Fills `*out_stats`, whose `struct_size` the caller has set to
/// `sizeof(ni_session_stats)` (or the size of an older version of the
/// struct: only those fields are written).
///
/// Thread-safety: any thread; serialized with other calls on this session
/// (it waits for a running `ni_session_step`).
#[no_mangle]
pub unsafe extern "C" fn ni_session_get_stats(
    session: *mut ni_session,
    out_stats: *mut ni_session_stats,
) -> ni_status {
    ffi_call("ni_session_get_stats", || {
        // SAFETY: per this function's contract.
        let s = unsafe { args::handle(session, "session")? };
        let out = args::out_ptr(out_stats, "out_stats")?;
        // SAFETY: non-NULL and aligned (checked); output structs start with a u32 the caller sets.
        let size = unsafe { out.cast::<u32>().read() } as usize;
        let full = size_of::<ni_session_stats>();
        let older = [
            NI_SESSION_STATS_SIZE_V1,
            NI_SESSION_STATS_SIZE_V2,
            NI_SESSION_STATS_SIZE_V3,
        ];
        if size != full && !older.contains(&size) {
            bail_arg!(
                "out_stats->struct_size is {size}; set it to sizeof(ni_session_stats) ({full}, or \
                 one of {older:?} for an older header) before the call"
            );
        }
        let st = s.lock()?.session.stats();
        let mut stats = c_stats(&st);
        stats.struct_size = size as u32;
        // SAFETY: out is non-NULL, aligned and (per struct_size) has room for
        // `size` bytes, a prefix of `ni_session_stats` ending on a field
        // boundary; `stats` is a distinct local.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (&stats as *const ni_session_stats).cast::<u8>(),
                out.cast::<u8>(),
                size,
            )
        };
        Ok(())
    })
}

fn c_stats(st: &crate::engine::SessionStats) -> ni_session_stats {
    let m = &st.memory;
    let ws = st.workspace;
    let pool_stats = ws.map(|w| w.pool_stats).unwrap_or_default();
    ni_session_stats {
        struct_size: size_of::<ni_session_stats>() as u32,
        running: st.running as u64,
        waiting: st.waiting as u64,
        // The KV manager's slots, not the requested figure: a paged cache
        // rounds the request up to whole blocks (found by the C ABI soak:
        // used 224 > capacity 209 with 16-token blocks).
        kv_capacity_tokens: st.kv_capacity_tokens as u64,
        kv_block_size: st.kv.granularity as u64,
        kv_used_tokens: st.kv.used_slots as u64,
        kv_free_tokens: st.kv.free_slots as u64,
        kv_cached_tokens: st.kv.evictable_slots as u64,
        steps: st.steps,
        prefill_tokens: st.prefill_tokens,
        decode_tokens: st.decode_tokens,
        prefix_cache_hits: st.kv.prefix_hits,
        prefix_cache_tokens_reused: st.kv.prefix_tokens_reused,
        preemptions: st.preemptions,
        swapped_out_tokens: st.swapped_out_tokens,
        memory_budget_source: match m.source {
            BudgetSource::Automatic => NI_BUDGET_AUTOMATIC,
            BudgetSource::Tokens => NI_BUDGET_TOKENS,
            BudgetSource::Bytes => NI_BUDGET_BYTES,
            BudgetSource::Utilization => NI_BUDGET_UTILIZATION,
        },
        memory_pool: match ws.map(|w| w.pool) {
            None => NI_MEMORY_POOL_DEFAULT,
            Some(MemoryPoolKind::Arena) => NI_MEMORY_POOL_CPU_ARENA,
            Some(MemoryPoolKind::Slab) => NI_MEMORY_POOL_CPU_SLAB,
            Some(MemoryPoolKind::System) => NI_MEMORY_POOL_SYSTEM,
            Some(MemoryPoolKind::CudaStream) => NI_MEMORY_POOL_CUDA_STREAM,
            Some(MemoryPoolKind::CudaBuddy) => NI_MEMORY_POOL_CUDA_BUDDY,
        },
        memory_total_bytes: m.total_bytes as u64,
        memory_available_bytes: m.available_bytes as u64,
        memory_weights_bytes: m.weights_bytes as u64,
        memory_workspace_bytes: m.workspace_bytes as u64,
        kv_memory_bytes: m.kv_bytes as u64,
        kv_bytes_per_token: m.kv_bytes_per_token as u64,
        kv_blocks: m.kv_blocks as u64,
        context_tokens: m.context_tokens as u64,
        max_full_context_seqs: m.max_full_context_seqs as u64,
        memory_utilization: m.utilization,
        memory_limited_by_available: m.limited_by_available,
        workspace_capacity_bytes: pool_stats.capacity_bytes as u64,
        workspace_peak_bytes: pool_stats.peak_bytes as u64,
        workspace_system_allocations: pool_stats.system_allocations,
        workspace_resizes: ws.map_or(0, |w| w.resizes),
        memory_profiled_peak_bytes: m.profiled_peak_bytes as u64,
        spec_draft_tokens: st.spec_draft_tokens,
        spec_accepted_tokens: st.spec_accepted_tokens,
        spec_verifications: st.spec_verifications,
    }
}

/// Whether the session has requests that still need `ni_session_step`
/// (waiting, running, or with an undelivered terminal event). False for NULL
/// and for a session that is unusable after an internal panic.
///
/// Thread-safety: any thread; serialized with other calls on this session.
#[no_mangle]
pub unsafe extern "C" fn ni_session_has_work(session: *mut ni_session) -> bool {
    ffi_value("ni_session_has_work", false, || {
        // SAFETY: per this function's contract.
        let Ok(s) = (unsafe { args::handle(session, "session") }) else {
            return false;
        };
        s.lock().map(|st| st.session.has_work()).unwrap_or(false)
    })
}

// Handles are used from several threads (see the thread-safety notes).
const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ni_session>();
    assert_send_sync::<ni_model>();
};
