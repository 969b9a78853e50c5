//! KV cache: the storage (plain per-layer arrays indexed by slot) and the
//! pluggable index managers that hand out slots (`KvCacheBackend`).
//!
//! The manager never touches KV data and the storage never knows about
//! sequences: the engine asks the manager for a sequence's `KvMapping` and
//! hands it, together with `&mut KvStorage`, to the model's forward pass.

pub mod block_pool;
pub mod paged;
pub mod prefix_hash;
pub mod radix;
pub mod storage;
#[cfg(test)]
mod tests;
pub mod token;

pub use crate::forward::{KvCacheDType, KvMapping};
pub use paged::PagedKv;
pub use storage::KvStorage;
pub use token::TokenKv;

/// Engine-wide identifier of a sequence (one per request).
pub type SeqId = u64;

/// Occupancy figures, in tokens (slots), for stats and invariant checks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvStats {
    /// Usable slots (excludes the reserved null block / dummy slot).
    pub total_slots: usize,
    /// Slots on the free list, never holding cached data.
    pub free_slots: usize,
    /// Slots holding cached prefix data that nobody references (evictable).
    pub evictable_slots: usize,
    /// Slots referenced by live sequences.
    pub used_slots: usize,
    /// Allocation granularity (block size for paged, page size for token).
    pub granularity: usize,
    /// Prefix-cache lookups that reused at least one token / total tokens reused.
    pub prefix_hits: u64,
    pub prefix_tokens_reused: u64,
}

/// A run of cached tokens and the slots holding their KV, as
/// [`KvCacheBackend::cached_runs`] lists them: the run continues the tokens
/// of run `parent` (an earlier one), or starts at the root of its salt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedRun {
    pub parent: Option<usize>,
    pub salt: u64,
    pub tokens: Vec<u32>,
    pub slots: Vec<u32>,
}

/// Which manager to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvBackendKind {
    Paged,
    Token,
}

/// A KV slot manager. Implementations: `paged` (vLLM-style block pool with
/// hash-chained prefix reuse) and `token` (SGLang-style token pool with a
/// radix-tree prefix cache). Both must pass the shared suite in `kv::tests`.
///
/// Life of a sequence: `begin` (optionally reusing a cached prefix) →
/// `allocate` before each forward that grows it → `commit` after the forward
/// wrote KV for its tokens → `release` when it finishes, is cancelled or is
/// preempted. Running out of room is never an error: `allocate` returns false
/// and changes nothing, so the scheduler can preempt.
pub trait KvCacheBackend: Send {
    fn kind(&self) -> KvBackendKind;

    /// Registers a new sequence whose full prompt is `tokens`. With prefix
    /// caching on, attaches the longest cached prefix of `tokens[..len-1]`
    /// (at least one token is always left to compute, so the forward yields
    /// logits) and returns its length in tokens; otherwise returns 0.
    /// `salt` isolates tenants: prefixes are only shared between equal salts.
    fn begin(&mut self, seq: SeqId, tokens: &[u32], salt: u64) -> usize;

    /// Makes positions `0..total_tokens` of `seq` addressable. Evicts
    /// unreferenced cached prefixes if needed. Returns false (and changes
    /// nothing) when there is not enough room.
    fn allocate(&mut self, seq: SeqId, total_tokens: usize) -> bool;

    /// Hint after `begin`: `seq` will hold at most `max_tokens` positions.
    /// A manager may size its per-sequence tables once, so that decoding
    /// does not grow them (no heap allocation per step). Allocates no slots.
    fn reserve(&mut self, seq: SeqId, max_tokens: usize) {
        let _ = (seq, max_tokens);
    }

    /// Tells the manager that KV for `tokens` (positions `0..tokens.len()` of
    /// `seq`) is now computed, so full blocks / token runs can enter the
    /// prefix cache.
    fn commit(&mut self, seq: SeqId, tokens: &[u32]);

    /// Shrinks `seq` to positions `0..total_tokens`: the slots past them go
    /// back to the free list (speculative decoding's rejected positions).
    /// `total_tokens` is at least the committed length (slots the prefix
    /// cache took are kept whatever it is); growing is `allocate`'s job.
    fn truncate(&mut self, seq: SeqId, total_tokens: usize);

    /// Drops the sequence. Its slots return to the free list, or stay cached
    /// (evictable) when they are part of the prefix cache.
    fn release(&mut self, seq: SeqId);

    /// The sequence's position → slot mapping (covers at least what was allocated).
    fn mapping(&self, seq: SeqId) -> KvMapping<'_>;

    /// The prefix cache's contents, parents before children: every cached
    /// token reachable from a root, with the slot holding its KV (what a
    /// saved prefix cache holds). Empty with prefix caching off.
    fn cached_runs(&self) -> Vec<CachedRun>;

    /// Slots that `allocate` could still obtain (free + evictable), in tokens.
    fn available_slots(&self) -> usize;

    fn stats(&self) -> KvStats;

    /// Checks internal consistency (ref counts, free lists, no double frees).
    /// Called by tests and debug builds; returns a description of the first violation.
    fn check_invariants(&self) -> std::result::Result<(), String>;
}

/// Builds a manager able to hold `capacity_tokens` tokens and returns it with
/// the number of physical slots the `KvStorage` must have (reserved slots
/// included). Paged: `ceil(capacity / block_size)` blocks plus the null block;
/// a zero `block_size` is treated as 1. Token: `capacity_tokens` slots plus
/// the dummy slot (`block_size` is ignored).
/// Physical slots (reserved ones included) of a manager built by
/// [`create_kv_backend`] with these arguments: what its storage costs.
pub fn physical_slots(kind: KvBackendKind, capacity_tokens: usize, block_size: usize) -> usize {
    match kind {
        KvBackendKind::Paged => {
            let block_size = block_size.max(1);
            (capacity_tokens.div_ceil(block_size) + 1).saturating_mul(block_size)
        }
        KvBackendKind::Token => capacity_tokens.saturating_add(1),
    }
}

pub fn create_kv_backend(
    kind: KvBackendKind,
    capacity_tokens: usize,
    block_size: usize,
    prefix_caching: bool,
) -> (Box<dyn KvCacheBackend>, usize) {
    let made: (Box<dyn KvCacheBackend>, usize) = match kind {
        KvBackendKind::Paged => {
            let block_size = block_size.max(1);
            let kv = PagedKv::new(
                capacity_tokens.div_ceil(block_size) + 1,
                block_size,
                prefix_caching,
            );
            let slots = kv.physical_slots();
            (Box::new(kv), slots)
        }
        KvBackendKind::Token => {
            let kv = TokenKv::new(capacity_tokens, prefix_caching);
            let slots = kv.physical_slots();
            (Box::new(kv), slots)
        }
    };
    debug_assert_eq!(made.1, physical_slots(kind, capacity_tokens, block_size));
    made
}
