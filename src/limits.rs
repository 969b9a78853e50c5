//! Upper bounds on the counts and sizes a caller gives that reach an
//! allocation: kernel threads, a session's step shape and KV slots. Each is
//! checked here, once, before anything is allocated, so that a hostile or
//! mistyped value is a clear error naming the field and the limit instead
//! of an abort inside the allocator or the thread spawner.

use crate::{bail_arg, Result};

/// Kernel threads are capped at this many times the cores available to the
/// process: more only adds contention (the workers spin between kernels).
pub const THREADS_PER_CORE: usize = 4;
/// The cap never goes below this (small containers, a restricted affinity
/// mask) ...
pub const MIN_THREAD_CAP: usize = 16;
/// ... nor above this.
pub const MAX_THREADS: usize = 1024;

/// Most requests in one step (`max_seqs`): each costs a logits row of the
/// vocabulary size and per-step scratch, reserved at session creation.
pub const MAX_SEQS: usize = 1 << 16;
/// Most tokens in one step (`max_batched_tokens`) and in one prefill chunk
/// (`prefill_chunk_size`): the step workspace is planned for this many rows.
pub const MAX_BATCHED_TOKENS: usize = 1 << 20;
/// Most KV slots a session may ask for (`kv_capacity_tokens`): slot ids are
/// 32-bit, and a paged cache rounds the capacity up to whole blocks.
pub const MAX_KV_CAPACITY_TOKENS: usize = (u32::MAX as usize) / 2;

/// Cores the process may run on (1 when unknown).
pub fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The most kernel threads a model may ask for on this machine:
/// `THREADS_PER_CORE` × the available cores, within
/// [`MIN_THREAD_CAP`, `MAX_THREADS`].
pub fn max_threads() -> usize {
    available_cores()
        .saturating_mul(THREADS_PER_CORE)
        .clamp(MIN_THREAD_CAP, MAX_THREADS)
}

/// The kernel thread count for a requested `n_threads` (0 = every
/// available core); more than [`max_threads`] is refused.
pub fn resolve_threads(requested: usize) -> Result<usize> {
    if requested == 0 {
        return Ok(available_cores().min(MAX_THREADS));
    }
    let max = max_threads();
    if requested > max {
        bail_arg!(
            "n_threads {requested} exceeds the limit of {max} ({THREADS_PER_CORE} x the {} cores \
             available to this process, at least {MIN_THREAD_CAP}, at most {MAX_THREADS})",
            available_cores()
        );
    }
    Ok(requested)
}

/// Checks a session's step shape (after automatic values were resolved).
pub fn check_step_shape(
    max_batched_tokens: usize,
    max_seqs: usize,
    prefill_chunk_size: usize,
) -> Result<()> {
    for (name, value, max) in [
        ("max_batched_tokens", max_batched_tokens, MAX_BATCHED_TOKENS),
        ("prefill_chunk_size", prefill_chunk_size, MAX_BATCHED_TOKENS),
        ("max_seqs", max_seqs, MAX_SEQS),
    ] {
        if value > max {
            bail_arg!("{name} {value} exceeds the limit of {max}");
        }
    }
    Ok(())
}

/// Checks an explicit KV capacity in tokens.
pub fn check_kv_capacity_tokens(tokens: usize) -> Result<()> {
    if tokens > MAX_KV_CAPACITY_TOKENS {
        bail_arg!(
            "kv_capacity_tokens {tokens} exceeds the limit of {MAX_KV_CAPACITY_TOKENS} (KV slot ids \
             are 32-bit)"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn thread_counts_are_capped() {
        let max = max_threads();
        assert!((MIN_THREAD_CAP..=MAX_THREADS).contains(&max));
        assert_eq!(resolve_threads(max).unwrap(), max);
        assert!(resolve_threads(0).unwrap() >= 1);
        for bad in [max + 1, u32::MAX as usize, usize::MAX] {
            let e = resolve_threads(bad).unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidArgument);
            assert!(e.message.contains("n_threads") && e.message.contains(&max.to_string()));
        }
    }

    #[test]
    fn step_shapes_and_capacities_are_capped() {
        check_step_shape(MAX_BATCHED_TOKENS, MAX_SEQS, MAX_BATCHED_TOKENS).unwrap();
        let e = check_step_shape(1, MAX_SEQS + 1, 1).unwrap_err();
        assert!(e.message.contains("max_seqs"), "{}", e.message);
        let e = check_step_shape(usize::MAX, 1, 1).unwrap_err();
        assert!(e.message.contains("max_batched_tokens"), "{}", e.message);
        let e = check_step_shape(1, 1, usize::MAX).unwrap_err();
        assert!(e.message.contains("prefill_chunk_size"), "{}", e.message);
        check_kv_capacity_tokens(MAX_KV_CAPACITY_TOKENS).unwrap();
        let e = check_kv_capacity_tokens(usize::MAX).unwrap_err();
        assert!(e.message.contains("kv_capacity_tokens"), "{}", e.message);
    }
}
