//! The forward contract: what the engine hands a model's forward pass for
//! one step and what the backends compute it from. The engine, the model
//! and every backend depend on this module; it depends on none of them, so
//! a backend never learns about the engine's scheduling or KV managers.
//!
//! - [`ForwardBatch`]: the rows of one step, sequence by sequence
//!   ([`AttnSeq`]), where each sequence's keys and values live
//!   ([`KvMapping`]) and which rows want logits;
//! - [`DeviceSampling`]: how those rows are sampled when the device samples;
//! - [`KvCacheDType`]: what the KV cache stores;
//! - [`StepStop`]: how a running forward learns to stop early.

mod device_sampling;
mod kv_cache_dtype;
mod stop;

pub use device_sampling::{mask_words, DeviceSampling, MaskFill, RowSampling};
pub use kv_cache_dtype::{e4m3_from_f32, e4m3_to_f32, KvCacheDType, E4M3_MAX};
pub use stop::{check_stop, StepStop};

/// What the engine hands the model for one step.
pub struct ForwardBatch<'a> {
    /// Token ids of all rows, sequence after sequence.
    pub tokens: &'a [u32],
    /// Per sequence: its rows, cached context length and KV mapping.
    pub seqs: &'a [AttnSeq<'a>],
    /// Rows whose logits are wanted, in output order (usually each
    /// sequence's last row when its prompt is complete).
    pub logits_rows: &'a [usize],
    /// Polled between and inside layers (CPU); a raised stop ends the
    /// forward with `ErrorKind::Cancelled`. `None` runs to the end.
    pub stop: Option<&'a StepStop<'a>>,
}

impl ForwardBatch<'_> {
    /// Checks the batch against a model of `vocab` tokens and
    /// `max_positions` positions, a KV cache of `num_slots` slots and room
    /// for `logits_len` logits: what a backend needs to hold for its
    /// kernels to stay in bounds.
    pub fn validate(
        &self,
        vocab: usize,
        max_positions: usize,
        num_slots: usize,
        logits_len: usize,
    ) -> crate::Result<()> {
        use crate::bail_arg;
        let rows = self.tokens.len();
        if let Some(&bad) = self.tokens.iter().find(|&&t| t as usize >= vocab) {
            bail_arg!("token id {bad} is outside the vocabulary (size {vocab})");
        }
        let mut next = 0;
        for s in self.seqs {
            if s.start != next || s.len == 0 {
                bail_arg!("forward batch sequences must be contiguous and non-empty");
            }
            next += s.len;
            let end = s.context_len + s.len;
            if end > s.kv.capacity() {
                bail_arg!(
                    "sequence needs {end} KV positions but only {} are allocated",
                    s.kv.capacity()
                );
            }
            if end > max_positions {
                bail_arg!("position {end} exceeds the model's context length {max_positions}");
            }
            if (0..end).any(|p| s.kv.slot(p) >= num_slots) {
                bail_arg!("KV mapping points outside the cache ({num_slots} slots)");
            }
        }
        if next != rows {
            bail_arg!("forward batch sequences cover {next} rows, batch has {rows}");
        }
        if self.logits_rows.iter().any(|&r| r >= rows) {
            bail_arg!("logits row out of range");
        }
        if logits_len < self.logits_rows.len() * vocab {
            bail_arg!("logits buffer too small");
        }
        Ok(())
    }
}

/// One sequence's rows in the batch.
#[derive(Clone, Copy)]
pub struct AttnSeq<'a> {
    /// First batch row of this sequence.
    pub start: usize,
    /// Number of rows (new tokens) of this sequence.
    pub len: usize,
    /// Tokens already in the KV cache before these rows (position of the first row).
    pub context_len: usize,
    pub kv: KvMapping<'a>,
}

/// How a sequence's logical positions map onto physical KV slots.
#[derive(Debug, Clone, Copy)]
pub enum KvMapping<'a> {
    /// Paged: position `p` lives in slot `table[p / block_size] * block_size + p % block_size`.
    Blocks { table: &'a [u32], block_size: usize },
    /// Token pool: position `p` lives in slot `slots[p]`.
    Slots(&'a [u32]),
}

impl KvMapping<'_> {
    /// Physical slot of logical position `pos`.
    #[inline]
    pub fn slot(&self, pos: usize) -> usize {
        match *self {
            KvMapping::Blocks { table, block_size } => {
                table[pos / block_size] as usize * block_size + pos % block_size
            }
            KvMapping::Slots(slots) => slots[pos] as usize,
        }
    }

    /// Number of positions the mapping can address.
    pub fn capacity(&self) -> usize {
        match *self {
            KvMapping::Blocks { table, block_size } => table.len() * block_size,
            KvMapping::Slots(slots) => slots.len(),
        }
    }
}
