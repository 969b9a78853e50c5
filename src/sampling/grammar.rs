//! A request's grammar as a sampling stage: before any other stage, every
//! token the grammar does not allow next gets -inf; after sampling, the
//! chosen token advances the grammar. The grammar engine is llguidance; the
//! engine layer compiles a request's constraint into the `Matcher` (that
//! needs the tokenizer) and hands it here.

use crate::{Error, Result};
use llguidance::toktrie::SimpleVob;
use llguidance::Matcher;
use std::time::{Duration, Instant};

/// Wall time one mask may take. llguidance's per-token fuel (lexer fuel,
/// Earley items) does not count every kind of work: a Lark grammar of a few
/// thousand alternative lexemes spends 100-200 ms a token in lexeme-set
/// operations without spending fuel. A slower mask fails its request (once
/// computed: llguidance cannot interrupt one); typical JSON Schema masks
/// take 50-150 µs on a 49k vocabulary.
pub const MASK_TIME_BUDGET: Duration = Duration::from_millis(50);

/// Masks computed since the counters were last taken (`take_stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MaskStats {
    pub masks: u64,
    pub time_ns: u64,
    /// Masks that took longer than `MASK_TIME_BUDGET` (each failed its
    /// request).
    pub over_budget: u64,
}

#[derive(Clone)]
pub struct GrammarMask {
    matcher: Matcher,
    /// The mask for the next token, computed ahead by `prepare` (while the
    /// forward runs); `apply` computes it when it is not there.
    prepared: Option<std::result::Result<SimpleVob, String>>,
    stats: MaskStats,
}

impl std::fmt::Debug for GrammarMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarMask").finish_non_exhaustive()
    }
}

/// llguidance's errors carry a dump of the parser state after the first
/// line; the caller gets the first line.
fn grammar_error(what: &str, e: impl std::fmt::Display) -> Error {
    let text = e.to_string();
    let first = text.lines().next().unwrap_or("unknown error");
    Error::invalid_arg(format!("structured output: {what}: {first}"))
}

/// Sets the logits of the tokens `mask` forbids to -inf.
fn forbid(mask: &SimpleVob, logits: &mut [f32]) {
    let n = logits.len();
    mask.iter_unset_entries(|i| {
        if i < n {
            logits[i] = f32::NEG_INFINITY;
        }
    });
}

/// `GrammarMask::pack` of `mask`: the bits of the tokens below `n` that
/// `forbid` leaves alone.
fn pack(mask: &SimpleVob, n: usize, out: &mut [u32]) {
    out.fill(0);
    let known = mask.len().min(n);
    let whole = known / 32;
    out[..whole].copy_from_slice(&mask.as_slice()[..whole]);
    for t in whole * 32..n {
        if t >= known || mask.is_allowed(t as u32) {
            out[t / 32] |= 1 << (t % 32);
        }
    }
}

/// Fails when `mask` allows none of the first `n` tokens.
fn allows_any(mask: &SimpleVob, n: usize) -> Result<()> {
    let mut any = false;
    mask.iter_set_entries(|i| any |= i < n);
    if !any {
        return Err(Error::invalid_arg(
            "structured output: the grammar allows no token of this model's vocabulary here",
        ));
    }
    Ok(())
}

impl GrammarMask {
    pub fn new(matcher: Matcher) -> GrammarMask {
        GrammarMask {
            matcher,
            prepared: None,
            stats: MaskStats::default(),
        }
    }

    /// Computes the next token's mask now, for `apply` to use. It depends
    /// only on the tokens consumed so far, so it can run on another thread
    /// while the forward computes the logits.
    pub fn prepare(&mut self) {
        if self.prepared.is_none() {
            self.prepared = Some(self.compute());
        }
    }

    /// The next token's mask, timed against `MASK_TIME_BUDGET`.
    fn compute(&mut self) -> std::result::Result<SimpleVob, String> {
        let started = Instant::now();
        let mask = self.matcher.compute_mask_or_eos();
        let took = started.elapsed();
        self.stats.masks += 1;
        self.stats.time_ns += took.as_nanos() as u64;
        if took > MASK_TIME_BUDGET {
            self.stats.over_budget += 1;
            return Err(format!(
                "the mask took {:.0} ms, over the budget of {} ms per token; simplify the \
                 constraint",
                took.as_secs_f64() * 1e3,
                MASK_TIME_BUDGET.as_millis()
            ));
        }
        mask.map_err(|e| e.to_string())
    }

    /// The counters since the last call, reset.
    pub fn take_stats(&mut self) -> MaskStats {
        std::mem::take(&mut self.stats)
    }

    /// Forbids (sets to -inf) every token of `logits` the grammar does not
    /// allow next; only end-of-sequence once the grammar is complete. Fails
    /// when the grammar's step budget runs out, the mask took longer than
    /// `MASK_TIME_BUDGET`, or it allows nothing here.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<()> {
        let mask = self.take_mask()?;
        forbid(&mask, logits);
        allows_any(&mask, logits.len())
    }

    /// Writes the next token's mask as `apply` would leave a row of `n`
    /// logits: bit `t % 32` of `out[t / 32]` set when token `t < n` keeps
    /// its logit (the mask's own bits; tokens past the mask, which `apply`
    /// does not touch, allowed). Nothing is allowed when the mask cannot be
    /// computed: `accept` reports why. `out` holds `n.div_ceil(32)` words
    /// or more; those past `n` are cleared.
    pub fn pack(&mut self, n: usize, out: &mut [u32]) {
        self.prepare();
        match &self.prepared {
            Some(Ok(mask)) => pack(mask, n, out),
            _ => out.fill(0),
        }
    }

    /// The grammar's side of a token chosen elsewhere from a row `pack`
    /// masked (`n` logits): fails where `apply` would have failed on that
    /// row, else advances the grammar by `token`.
    pub fn accept(&mut self, n: usize, token: u32) -> Result<()> {
        let mask = self.take_mask()?;
        allows_any(&mask, n)?;
        self.consume(token)
    }

    /// The next token's mask: the prepared one, or computed now.
    fn take_mask(&mut self) -> Result<SimpleVob> {
        match self.prepared.take() {
            Some(m) => m,
            None => self.compute(),
        }
        .map_err(|e| grammar_error("computing the token mask", e))
    }

    /// Advances the grammar by the sampled token.
    pub fn consume(&mut self, token: u32) -> Result<()> {
        // A complete grammar allowed only end-of-sequence: nothing to advance.
        self.prepared = None;
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| grammar_error("advancing the grammar", e))
    }

    /// Whether the output so far is a complete match of the grammar.
    pub fn is_complete(&mut self) -> bool {
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::rng::SplitMix64;

    /// The packed bits are exactly the tokens `apply` leaves finite, for
    /// masks shorter than, as long as and longer than the logits row, with
    /// rows that end inside a word and words of every kind.
    #[test]
    fn packed_masks_allow_what_apply_allows() {
        let mut rng = SplitMix64::new(3);
        for (len, n) in [
            (100, 100),
            (64, 64),
            (70, 100),
            (100, 70),
            (1000, 1003),
            (33, 1),
        ] {
            for density in [0usize, 1, 50, 99, 100] {
                let mut mask = SimpleVob::alloc(len);
                for t in 0..len {
                    if rng.below(100) < density {
                        mask.allow_token(t as u32);
                    }
                }
                // Whole words set and clear.
                if len >= 64 && density == 50 {
                    mask.allow_range(0..=31);
                    (32..64).for_each(|t| mask.disallow_token(t));
                }
                let mut logits = vec![0.0f32; n];
                forbid(&mask, &mut logits);
                let mut words = vec![u32::MAX; n.div_ceil(32) + 1];
                pack(&mask, n, &mut words);
                for (t, &l) in logits.iter().enumerate() {
                    let bit = words[t / 32] >> (t % 32) & 1 == 1;
                    assert_eq!(bit, l == 0.0, "token {t} of {n}, mask of {len}");
                }
                for t in n..words.len() * 32 {
                    assert_eq!(words[t / 32] >> (t % 32) & 1, 0, "token {t} past {n}");
                }
                // `accept` and `apply` fail alike (both ask `allows_any`);
                // where the mask covers the row, exactly when no bit is set.
                if len >= n {
                    let packed_any = words.iter().any(|&w| w != 0);
                    assert_eq!(allows_any(&mask, n).is_ok(), packed_any);
                }
            }
        }
    }
}
