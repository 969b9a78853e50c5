//! The per-session shape a forward context is sized for, and the automatic
//! KV budget a device finds for it.

use crate::forward::KvCacheDType;
use crate::memory::{MemoryPoolKind, PoolFaultSwitch};

/// Per-session shape limits a context is sized for.
#[derive(Debug, Clone)]
pub struct ContextShape {
    /// KV slots, slot 0 included (it is reserved by the KV managers).
    pub kv_slots: usize,
    /// Most rows (tokens) in one forward.
    pub max_rows: usize,
    /// Most rows wanting logits in one forward.
    pub max_logits_rows: usize,
    /// Fraction of device memory the automatic KV budget may bring the
    /// device's use up to (vLLM's `gpu_memory_utilization`). CUDA always
    /// applies it; the CPU only when `utilization_budget` is set.
    pub memory_utilization: f32,
    /// CPU: size the automatic KV budget by `memory_utilization` (vLLM
    /// semantics) instead of the CPU default (a quarter of available memory,
    /// at most 2 GiB).
    pub utilization_budget: bool,
    /// Where the context's memory comes from: the CPU step workspace, or a
    /// GPU context's workspace and KV cache. Must suit the device (the
    /// session checks; a decoder refuses the other device's pools).
    pub memory_pool: MemoryPoolKind,
    /// What the KV cache stores (a decoder refuses a type it lacks).
    pub kv_dtype: KvCacheDType,
    /// The ids a device may choose when it picks tokens itself (argmax,
    /// sampling): those below this, the tokenizer's coverage, when the
    /// model's vocabulary is padded past its tokenizer (padding rows have
    /// no text). `None`: every logits column.
    pub sample_vocab: Option<usize>,
    /// Fault injection: armed, the context's next step fails inside its
    /// workspace pool. A context without a planned workspace (CUDA) never
    /// fires it.
    pub pool_fault: PoolFaultSwitch,
}

impl ContextShape {
    pub const DEFAULT_MEMORY_UTILIZATION: f32 = 0.9;

    /// How many leading ids of a `vocab`-column logits row a device may
    /// choose.
    pub fn choosable_ids(&self, vocab: usize) -> usize {
        self.sample_vocab.map_or(vocab, |n| n.min(vocab))
    }

    pub fn new(kv_slots: usize, max_rows: usize, max_logits_rows: usize) -> Self {
        ContextShape {
            kv_slots,
            max_rows,
            max_logits_rows,
            memory_utilization: Self::DEFAULT_MEMORY_UTILIZATION,
            utilization_budget: false,
            memory_pool: MemoryPoolKind::default(),
            kv_dtype: KvCacheDType::Auto,
            sample_vocab: None,
            pool_fault: PoolFaultSwitch::default(),
        }
    }
}

/// An automatic KV budget and how it was found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvBudget {
    /// Bytes the KV cache may take.
    pub bytes: usize,
    /// Peak temporaries a profiling forward measured; 0 when the budget
    /// was computed without one.
    pub profiled_peak_bytes: usize,
}
