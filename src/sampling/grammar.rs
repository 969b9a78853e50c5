//! A request's grammar as a sampling stage: before any other stage, every
//! token the grammar does not allow next gets -inf; after sampling, the
//! chosen token advances the grammar. The grammar engine is llguidance; the
//! engine layer compiles a request's constraint into the `Matcher` (that
//! needs the tokenizer) and hands it here.

use crate::{Error, Result};
use llguidance::toktrie::SimpleVob;
use llguidance::Matcher;

pub struct GrammarMask {
    matcher: Matcher,
    /// The mask for the next token, computed ahead by `prepare` (while the
    /// forward runs); `apply` computes it when it is not there.
    prepared: Option<std::result::Result<SimpleVob, String>>,
}

impl Clone for GrammarMask {
    fn clone(&self) -> Self {
        GrammarMask {
            matcher: self.matcher.clone(),
            prepared: self.prepared.clone(),
        }
    }
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

impl GrammarMask {
    pub fn new(matcher: Matcher) -> GrammarMask {
        GrammarMask {
            matcher,
            prepared: None,
        }
    }

    /// Computes the next token's mask now, for `apply` to use. It depends
    /// only on the tokens consumed so far, so it can run on another thread
    /// while the forward computes the logits.
    pub fn prepare(&mut self) {
        if self.prepared.is_none() {
            self.prepared = Some(
                self.matcher
                    .compute_mask_or_eos()
                    .map_err(|e| e.to_string()),
            );
        }
    }

    /// Forbids (sets to -inf) every token of `logits` the grammar does not
    /// allow next; only end-of-sequence once the grammar is complete. Fails
    /// when the grammar's step budget runs out or it allows nothing here.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<()> {
        let mask = match self.prepared.take() {
            Some(m) => m,
            None => self
                .matcher
                .compute_mask_or_eos()
                .map_err(|e| e.to_string()),
        }
        .map_err(|e| grammar_error("computing the token mask", e))?;
        let mut any = false;
        let n = logits.len();
        mask.iter_unset_entries(|i| {
            if i < n {
                logits[i] = f32::NEG_INFINITY;
            }
        });
        mask.iter_set_entries(|i| any |= i < n);
        if !any {
            return Err(Error::invalid_arg(
                "structured output: the grammar allows no token of this model's vocabulary here",
            ));
        }
        Ok(())
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
