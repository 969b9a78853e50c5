//! Speculative decoding: a proposer guesses the next tokens of a decoding
//! request, and the target model checks the guesses in the same step, each
//! on its own row like a short prefill chunk, so one read of the weights
//! can yield several tokens.
//!
//! Verification samples every row exactly as decoding one token at a time
//! would (same processors, same history, same random draws) and keeps the
//! drafted tokens while they equal what was sampled. Proposals here are
//! single tokens (a point mass), for which that is Leviathan et al.'s
//! rejection sampling: a draft `d` is kept with probability `p(d)`, and a
//! rejected one is replaced by a draw from `p` without `d`. So greedy output
//! is identical to not speculating, sampled output has the target's
//! distribution, and a seeded request draws the same tokens either way.
//!
//! - [`ngram`]: prompt lookup, no extra model;
//! - [`draft`]: a smaller model with the same vocabulary;
//! - [`SpecState`]: how many tokens a request drafts, from its recent
//!   acceptance.

pub mod draft;
pub mod ngram;

use super::model::Model;
use super::request::RequestId;
use crate::{bail_arg, Result};
use std::sync::Arc;

/// How the drafts are made.
#[derive(Clone)]
pub enum SpeculativeMethod {
    /// Prompt lookup: the tokens that followed the latest earlier
    /// occurrence of the request's last `n` tokens (longest `n` in
    /// `min_n..=max_n` first), from its prompt and output.
    Ngram { min_n: usize, max_n: usize },
    /// A draft model whose vocabulary agrees with the target's, decoding
    /// greedily; its KV shares the session's budget.
    Draft(Arc<Model>),
}

impl std::fmt::Debug for SpeculativeMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SpeculativeMethod::Ngram { min_n, max_n } => {
                write!(f, "Ngram {{ min_n: {min_n}, max_n: {max_n} }}")
            }
            SpeculativeMethod::Draft(m) => write!(f, "Draft({})", m.decoder.summary()),
        }
    }
}

/// Speculative decoding for a session.
#[derive(Debug, Clone)]
pub struct SpeculativeParams {
    pub method: SpeculativeMethod,
    /// Most tokens a request drafts per step (1..=`MAX_SPECULATIVE_TOKENS`);
    /// 0 = the method's default ([`SpeculativeParams::max_k`]).
    pub num_speculative_tokens: usize,
    /// No request speculates in a step with more running requests than
    /// this: a large batch already reads each weight once for many rows,
    /// and the drafted rows then cost more than they save. 0 =
    /// [`AUTO_MAX_BATCH`].
    pub max_batch: usize,
}

/// Where speculation stops paying when `max_batch` is 0 (BENCHMARKS.md
/// "Speculative decoding"): on the CPU (SmolLM2, 2 threads) n-gram drafting
/// gave 1.19x at 4 concurrent requests, 1.00x at 8 and 0.75x at 16; on an
/// H200 (8B) a step of up to 16 rows costs what one row does, which 4
/// requests with drafts of 3 stay within. Larger batches may still gain on
/// a GPU when drafts are kept often: set `max_batch` and measure.
pub const AUTO_MAX_BATCH: usize = 4;

/// The longest draft a request may make in one step.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

impl SpeculativeParams {
    pub fn ngram(num_speculative_tokens: usize) -> Self {
        SpeculativeParams {
            method: SpeculativeMethod::Ngram { min_n: 2, max_n: 4 },
            num_speculative_tokens,
            max_batch: 0,
        }
    }

    pub fn draft(model: Arc<Model>, num_speculative_tokens: usize) -> Self {
        SpeculativeParams {
            method: SpeculativeMethod::Draft(model),
            num_speculative_tokens,
            max_batch: 0,
        }
    }

    /// Most tokens a request drafts per step: `num_speculative_tokens`, or
    /// by default 8 for n-gram lookup (a draft costs nothing to make, and
    /// copied text runs long) and 4 for a draft model (each drafted token
    /// costs a draft forward; BENCHMARKS.md "Speculative decoding").
    pub fn max_k(&self) -> usize {
        match (self.num_speculative_tokens, &self.method) {
            (0, SpeculativeMethod::Ngram { .. }) => 8,
            (0, SpeculativeMethod::Draft(_)) => 4,
            (k, _) => k,
        }
    }

    /// `max_batch`, or [`AUTO_MAX_BATCH`] when it is 0.
    pub fn effective_max_batch(&self) -> usize {
        match self.max_batch {
            0 => AUTO_MAX_BATCH,
            n => n,
        }
    }

    /// The draft model, for the draft method.
    pub fn draft_model(&self) -> Option<&Arc<Model>> {
        match &self.method {
            SpeculativeMethod::Draft(m) => Some(m),
            SpeculativeMethod::Ngram { .. } => None,
        }
    }

    pub fn validate(&self) -> Result<()> {
        let k = self.num_speculative_tokens;
        if k > MAX_SPECULATIVE_TOKENS {
            bail_arg!(
                "num_speculative_tokens must be in 1..={MAX_SPECULATIVE_TOKENS} (0 = the method's default), got {k}"
            );
        }
        if let SpeculativeMethod::Ngram { min_n, max_n } = self.method {
            if min_n == 0 || min_n > max_n || max_n > 64 {
                bail_arg!("n-gram lookup needs 1 <= min_n <= max_n <= 64, got {min_n}..={max_n}");
            }
        }
        Ok(())
    }
}

/// One request asking for a draft.
pub struct Ask<'a> {
    pub id: RequestId,
    /// The request's tokens: prompt and output, the last not yet computed.
    pub tokens: &'a [u32],
    /// Most tokens to draft; 0 asks a proposer with a model of its own to
    /// catch up on `tokens` (a prompt the target is computing), so that
    /// its first draft does not wait for it.
    pub k: usize,
}

/// Makes drafts for a step's speculating requests.
pub trait Proposer: Send {
    /// Writes into `drafts[i]` (empty on entry) at most `asks[i].k` tokens
    /// guessed to follow `asks[i].tokens`. A proposer that cannot draft for
    /// a request (no match, no room) leaves its draft empty.
    fn propose(&mut self, asks: &[Ask<'_>], drafts: &mut [Vec<u32>]);

    /// Forgets request `id` (it ended or was preempted): frees what the
    /// proposer holds for it.
    fn release(&mut self, id: RequestId) {
        let _ = id;
    }

    /// The proposer's own KV slots in use (0 without a cache).
    fn kv_used_slots(&self) -> usize {
        0
    }
}

/// How many tokens a request drafts next: one more after a step that kept
/// every draft, one more than it kept after a step that did not; after
/// three steps in a row that kept none it pauses for 1, 2, 4, ... steps
/// (at most 16), so a request whose text the proposer cannot guess costs
/// almost nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct SpecState {
    k: usize,
    misses: u32,
    pause: u32,
}

impl SpecState {
    /// Tokens to draft this step (0 while paused); counts a paused step.
    pub fn next_k(&mut self, max_k: usize) -> usize {
        if self.pause > 0 {
            self.pause -= 1;
            return 0;
        }
        if self.k == 0 {
            self.k = max_k;
        }
        self.k.min(max_k)
    }

    /// The outcome of a verified draft of `proposed` tokens.
    pub fn record(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        if accepted == proposed {
            self.k = proposed + 1;
        } else {
            self.k = accepted + 1;
        }
        if accepted == 0 {
            self.misses += 1;
            if self.misses >= 3 {
                self.pause = 1 << (self.misses - 3).min(4);
            }
        } else {
            self.misses = 0;
        }
    }
}

/// The proposer for `params`.
pub(crate) fn create_proposer(
    params: &SpeculativeParams,
    target: &Model,
    draft_context: impl FnOnce(&Arc<Model>) -> Result<draft::DraftContext>,
) -> Result<Box<dyn Proposer>> {
    params.validate()?;
    Ok(match &params.method {
        SpeculativeMethod::Ngram { min_n, max_n } => {
            Box::new(ngram::NgramProposer::new(*min_n, *max_n))
        }
        SpeculativeMethod::Draft(model) => {
            draft::check_vocabulary(target, model)?;
            Box::new(draft::DraftProposer::new(
                model.clone(),
                target.sample_vocab,
                draft_context(model)?,
            ))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adaptive_k_grows_shrinks_and_pauses() {
        let mut s = SpecState::default();
        assert_eq!(s.next_k(4), 4);
        s.record(4, 4);
        assert_eq!(s.next_k(4), 4, "never above the maximum");
        s.record(4, 1);
        assert_eq!(s.next_k(4), 2);
        for _ in 0..3 {
            let k = s.next_k(4);
            s.record(k, 0);
        }
        assert_eq!(s.next_k(4), 0, "paused after three misses");
        assert_eq!(s.next_k(4), 1);
        s.record(1, 0);
        assert_eq!((s.next_k(4), s.next_k(4), s.next_k(4)), (0, 0, 1));
        s.record(1, 1);
        assert_eq!(s.next_k(4), 2, "a hit ends the pauses");
        s.record(2, 0);
        assert_eq!(s.next_k(4), 1);
    }
}
