//! Incremental detokenization for streaming output.
//!
//! Decoding one token at a time is wrong in two ways: a token may hold only part of
//! a UTF-8 character (byte-level BPE, byte fallback), and decoders change text at
//! the edges (SentencePiece drops the leading space of a sequence). Following vLLM,
//! we decode a small window twice, `ids[prefix..read]` (already emitted) and
//! `ids[prefix..]`, and emit only what the second adds to the first, holding it back
//! while it ends in U+FFFD (an incomplete character). Both decodes start at the same
//! token, so edge effects cancel. After each emission the window slides forward and
//! old ids are dropped, so a step costs O(window), not O(sequence length).

use super::hf::Tokenizer;
use crate::Result;

const REPLACEMENT: char = '\u{FFFD}';

/// Tokens held back waiting for a character to complete before giving up and
/// emitting U+FFFD. A UTF-8 character has at most 4 bytes, so valid text only
/// reaches this with a chain of 8 tokens that each end inside a character (byte-level
/// merges can straddle characters; real tokenizers chain 2 or 3 at most).
const MAX_HELD: usize = 8;

/// Turns a stream of token ids into text deltas; one per request.
#[derive(Debug, Clone)]
pub struct StreamDetokenizer {
    /// The window: `ids[..read]` were emitted (kept as context), `ids[read..]` not
    /// yet. Never longer than 2 * MAX_HELD.
    ids: Vec<u32>,
    read: usize,
    /// Text of `ids[read..]` as decoded in the last step (may end in U+FFFD),
    /// what `flush` returns.
    held_text: String,
    skip_special_tokens: bool,
}

impl Default for StreamDetokenizer {
    /// Skips special tokens, as chat output usually wants.
    fn default() -> Self {
        Self::new(true)
    }
}

/// The part of `new` after `prefix`. Decoders may rewrite the text they
/// already produced; then, like vLLM, skip as many characters as `prefix` has.
fn suffix_after<'a>(new: &'a str, prefix: &str) -> &'a str {
    if let Some(rest) = new.strip_prefix(prefix) {
        return rest;
    }
    match new.char_indices().nth(prefix.chars().count()) {
        Some((at, _)) => &new[at..],
        None => "",
    }
}

impl StreamDetokenizer {
    pub fn new(skip_special_tokens: bool) -> Self {
        StreamDetokenizer {
            ids: Vec::new(),
            read: 0,
            held_text: String::new(),
            skip_special_tokens,
        }
    }

    /// A detokenizer whose output continues text that `earlier` decodes
    /// to: its last tokens are the first window's context, so the first
    /// delta carries the spacing it would have had in one stream.
    pub fn after(skip_special_tokens: bool, tok: &Tokenizer, earlier: &[u32]) -> Self {
        let mut d = Self::new(skip_special_tokens);
        let shown = |id: &&u32| !(skip_special_tokens && tok.is_special_id(**id));
        d.ids
            .extend(earlier.iter().rev().filter(shown).take(MAX_HELD));
        d.ids.reverse();
        d.read = d.ids.len();
        d
    }

    /// Adds one generated token and returns the text it completes (often empty
    /// while a multi-byte character is still incomplete). Fails on an id outside
    /// the vocabulary, leaving the state unchanged.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        tok.check_id(id)?;
        if self.skip_special_tokens && tok.is_special_id(id) {
            return Ok(String::new());
        }
        self.ids.push(id);
        let prefix_text = tok.decode_unchecked(&self.ids[..self.read], false)?;
        let new_text = tok.decode_unchecked(&self.ids, false)?;
        let delta = suffix_after(&new_text, &prefix_text);
        if !delta.is_empty() && !new_text.ends_with(REPLACEMENT) {
            let delta = delta.to_string();
            self.commit();
            return Ok(delta);
        }
        if self.ids.len() - self.read < MAX_HELD {
            self.held_text = delta.to_string();
            return Ok(String::new());
        }
        // Held too long: invalid bytes, or a long chain of tokens that each end
        // inside a character. Emit what decodes, replacement characters included.
        let delta = delta.to_string();
        self.commit();
        Ok(delta)
    }

    /// Marks all ids as emitted: the ones emitted in this step become the next
    /// window's context and older ids are dropped.
    fn commit(&mut self) {
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        self.held_text.clear();
    }

    /// Returns what is still held back at the end of the stream (an incomplete
    /// character comes out as U+FFFD) and resets the detokenizer.
    pub fn flush(&mut self) -> String {
        let rest = std::mem::take(&mut self.held_text);
        self.ids.clear();
        self.read = 0;
        rest
    }

    /// Number of ids currently kept for decoding (context plus held back).
    pub fn window_len(&self) -> usize {
        self.ids.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffix_after_handles_rewrites() {
        assert_eq!(suffix_after("hello world", "hello"), " world");
        assert_eq!(suffix_after("héllo", "hello"), "");
        assert_eq!(suffix_after("a.b c", "a b"), " c");
        assert_eq!(suffix_after("ab", "abc"), "");
    }
}
