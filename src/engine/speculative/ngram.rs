//! Prompt lookup (n-gram) drafts: text that quotes or edits its input
//! repeats runs of it, so the tokens that followed the latest earlier
//! occurrence of the last few tokens are a good guess at what comes next.

use super::{Ask, Proposer};

pub struct NgramProposer {
    min_n: usize,
    max_n: usize,
}

impl NgramProposer {
    pub fn new(min_n: usize, max_n: usize) -> Self {
        NgramProposer { min_n, max_n }
    }
}

impl Proposer for NgramProposer {
    fn propose(&mut self, asks: &[Ask<'_>], drafts: &mut [Vec<u32>]) {
        for (ask, draft) in asks.iter().zip(drafts) {
            lookup(ask.tokens, self.min_n, self.max_n, ask.k, draft);
        }
    }
}

/// Appends to `out` up to `k` tokens that followed the latest earlier
/// occurrence of the last `n` tokens of `tokens`, trying the longest `n`
/// in `min_n..=max_n` first.
pub fn lookup(tokens: &[u32], min_n: usize, max_n: usize, k: usize, out: &mut Vec<u32>) {
    let len = tokens.len();
    for n in (min_n..=max_n).rev() {
        if len <= n {
            continue;
        }
        let pattern = &tokens[len - n..];
        // Latest start first; the pattern's own occurrence is excluded.
        let found = (0..len - n).rev().find(|&i| &tokens[i..i + n] == pattern);
        if let Some(i) = found {
            let from = i + n;
            out.extend_from_slice(&tokens[from..(from + k).min(len)]);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::lookup;

    fn draft(tokens: &[u32], k: usize) -> Vec<u32> {
        let mut out = Vec::new();
        lookup(tokens, 2, 3, k, &mut out);
        out
    }

    #[test]
    fn continues_the_latest_match_of_the_longest_ngram() {
        // "1 2 3" occurs at 0 and 5; the latest earlier one continues 8 9.
        let t = [1, 2, 3, 4, 5, 1, 2, 3, 8, 9, 7, 1, 2, 3];
        assert_eq!(draft(&t, 2), [8, 9]);
        assert_eq!(draft(&t, 10), [8, 9, 7, 1, 2, 3]);
        // Only a 2-gram matches: "5 6" ... "5 6".
        assert_eq!(draft(&[5, 6, 7, 1, 5, 6], 3), [7, 1, 5]);
        // A 3-gram match wins over a later 2-gram match.
        assert_eq!(draft(&[1, 2, 3, 9, 4, 2, 3, 8, 1, 2, 3], 1), [9]);
    }

    #[test]
    fn nothing_without_a_match() {
        assert!(draft(&[1, 2, 3, 4], 4).is_empty());
        assert!(draft(&[1, 2], 4).is_empty());
        assert!(draft(&[], 4).is_empty());
        // A 1-gram is below min_n.
        assert!(draft(&[7, 1, 2, 7], 4).is_empty());
    }
}
