//! Incremental token bookkeeping for the penalties: the set of distinct tokens
//! seen in prompt + output (repetition penalty) and per-token counts over the
//! output (presence/frequency). Dense arrays over the vocabulary plus a list of
//! the touched ids, so applying a penalty costs O(distinct tokens), and each
//! new token costs O(1).

/// Token history of one request. Ids outside the vocabulary are ignored.
#[derive(Debug, Clone)]
pub struct TokenHistory {
    vocab_size: usize,
    track_seen: bool,
    track_counts: bool,
    /// Bitset over the vocabulary: seen in prompt or output.
    seen: Vec<u64>,
    seen_list: Vec<u32>,
    /// Occurrences in the output, per token.
    counts: Vec<u32>,
    counted_list: Vec<u32>,
    /// How much of the caller's prompt/output `sync` has ingested, plus the
    /// last ingested token of each to detect a caller that rewrote history.
    prompt_len: usize,
    output_len: usize,
    last_prompt: Option<u32>,
    last_output: Option<u32>,
}

impl TokenHistory {
    /// `track_seen`: keep the prompt+output set; `track_counts`: keep output
    /// counts. Memory is only taken for what is tracked.
    pub fn new(vocab_size: usize, track_seen: bool, track_counts: bool) -> Self {
        TokenHistory {
            vocab_size,
            track_seen,
            track_counts,
            seen: if track_seen {
                vec![0; vocab_size.div_ceil(64)]
            } else {
                Vec::new()
            },
            seen_list: Vec::new(),
            counts: if track_counts {
                vec![0; vocab_size]
            } else {
                Vec::new()
            },
            counted_list: Vec::new(),
            prompt_len: 0,
            output_len: 0,
            last_prompt: None,
            last_output: None,
        }
    }

    /// Reserves room for `seen` distinct prompt+output tokens and `output`
    /// distinct output tokens (each capped at the vocabulary size), so that
    /// later observations do not allocate.
    pub fn reserve(&mut self, seen: usize, output: usize) {
        if self.track_seen {
            let want = seen.min(self.vocab_size);
            self.seen_list
                .reserve(want.saturating_sub(self.seen_list.len()));
        }
        if self.track_counts {
            let want = output.min(self.vocab_size);
            self.counted_list
                .reserve(want.saturating_sub(self.counted_list.len()));
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn mark_seen(&mut self, token: u32) {
        if !self.track_seen || token as usize >= self.vocab_size {
            return;
        }
        let (word, bit) = (token as usize / 64, 1u64 << (token % 64));
        if self.seen[word] & bit == 0 {
            self.seen[word] |= bit;
            self.seen_list.push(token);
        }
    }

    /// Records a prompt token (seen set only).
    pub fn observe_prompt(&mut self, token: u32) {
        self.mark_seen(token);
    }

    /// Records a generated token (seen set and output counts).
    pub fn observe_output(&mut self, token: u32) {
        self.mark_seen(token);
        if self.track_counts && (token as usize) < self.vocab_size {
            let c = &mut self.counts[token as usize];
            if *c == 0 {
                self.counted_list.push(token);
            }
            *c += 1;
        }
    }

    /// Brings the history up to date with the request's full `prompt` and
    /// `output`, ingesting only what was appended since the last call. If the
    /// caller's history shrank or its last ingested token changed (e.g. a
    /// rollback), it is rebuilt from scratch.
    pub fn sync(&mut self, prompt: &[u32], output: &[u32]) {
        let consistent = prompt.len() >= self.prompt_len
            && output.len() >= self.output_len
            && (self.prompt_len == 0 || Some(prompt[self.prompt_len - 1]) == self.last_prompt)
            && (self.output_len == 0 || Some(output[self.output_len - 1]) == self.last_output);
        if !consistent {
            self.clear();
        }
        for &t in &prompt[self.prompt_len..] {
            self.observe_prompt(t);
        }
        for &t in &output[self.output_len..] {
            self.observe_output(t);
        }
        self.prompt_len = prompt.len();
        self.output_len = output.len();
        self.last_prompt = prompt.last().copied();
        self.last_output = output.last().copied();
    }

    /// Forgets everything (keeps the allocations).
    pub fn clear(&mut self) {
        for &t in &self.seen_list {
            self.seen[t as usize / 64] = 0;
        }
        self.seen_list.clear();
        for &t in &self.counted_list {
            self.counts[t as usize] = 0;
        }
        self.counted_list.clear();
        self.prompt_len = 0;
        self.output_len = 0;
        self.last_prompt = None;
        self.last_output = None;
    }

    /// Distinct tokens seen in prompt + output, in first-seen order (empty
    /// when the seen set is not tracked).
    pub fn seen_tokens(&self) -> &[u32] {
        &self.seen_list
    }

    /// `(token, occurrences in the output)` for every distinct output token
    /// (empty when counts are not tracked).
    pub fn output_counts(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.counted_list
            .iter()
            .map(|&t| (t, self.counts[t as usize]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(h: &TokenHistory) -> Vec<(u32, u32)> {
        let mut v: Vec<_> = h.output_counts().collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn incremental_sync_matches_full_rebuild() {
        let prompt = [5u32, 7, 5, 130, 9];
        let output = [7u32, 7, 3, 9, 3, 7];
        let mut inc = TokenHistory::new(128, true, true);
        for n in 0..=output.len() {
            inc.sync(&prompt, &output[..n]);
        }
        let mut full = TokenHistory::new(128, true, true);
        full.sync(&prompt, &output);
        let mut a = inc.seen_tokens().to_vec();
        let mut b = full.seen_tokens().to_vec();
        a.sort_unstable();
        b.sort_unstable();
        // 130 is out of the vocabulary and ignored.
        assert_eq!(a, vec![3, 5, 7, 9]);
        assert_eq!(a, b);
        assert_eq!(counts(&inc), vec![(3, 2), (7, 3), (9, 1)]);
        assert_eq!(counts(&inc), counts(&full));
    }

    #[test]
    fn rewritten_history_is_rebuilt() {
        let mut h = TokenHistory::new(16, true, true);
        h.sync(&[1], &[2, 3]);
        h.sync(&[1], &[2, 4]); // last token changed
        assert_eq!(counts(&h), vec![(2, 1), (4, 1)]);
        h.sync(&[1], &[2]); // shrank
        assert_eq!(counts(&h), vec![(2, 1)]);
        let mut seen = h.seen_tokens().to_vec();
        seen.sort_unstable();
        assert_eq!(seen, vec![1, 2]);
    }

    #[test]
    fn untracked_parts_stay_empty() {
        let mut h = TokenHistory::new(16, false, true);
        h.sync(&[1, 2], &[3]);
        assert!(h.seen_tokens().is_empty());
        assert_eq!(counts(&h), vec![(3, 1)]);
        let mut h = TokenHistory::new(16, true, false);
        h.sync(&[1, 2], &[3]);
        assert_eq!(h.output_counts().count(), 0);
        assert_eq!(h.seen_tokens().len(), 3);
    }
}
