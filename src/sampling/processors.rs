//! The logits processing stages, each usable on its own. The sampler applies
//! them in this fixed order:
//!
//! 1. repetition penalty (HF, over distinct prompt + output tokens)
//! 2. presence / frequency penalty (OpenAI, over output tokens)
//! 3. logit bias
//! 4. suppression (EOS / stop ids while `min_tokens` is not reached)
//! 5. temperature (skipped when greedy)
//! 6. top-k, 7. top-p, 8. min-p (truncation)
//! 9. draw
//!
//! Stages 1-5 rewrite logits in place. Truncation is done on a `CandidateSet`
//! (indices into the logits) so that the sampler never masks or sorts the
//! whole vocabulary when a few candidates survive; `apply_top_k` & co. are the
//! masking forms (HF warper semantics: dropped tokens become -inf) built on the
//! same code.

use std::cmp::Ordering;

use super::history::TokenHistory;

/// HF `RepetitionPenaltyLogitsProcessor`: for every distinct token seen in
/// prompt + output, a logit `< 0` is multiplied by `penalty`, otherwise divided.
pub fn apply_repetition_penalty(logits: &mut [f32], penalty: f32, history: &TokenHistory) {
    for &t in history.seen_tokens() {
        if let Some(l) = logits.get_mut(t as usize) {
            *l = if *l < 0.0 { *l * penalty } else { *l / penalty };
        }
    }
}

/// OpenAI presence / frequency penalties over the output tokens:
/// `logit -= count * frequency + (count > 0) * presence`.
pub fn apply_presence_frequency_penalty(
    logits: &mut [f32],
    presence: f32,
    frequency: f32,
    history: &TokenHistory,
) {
    for (t, count) in history.output_counts() {
        if let Some(l) = logits.get_mut(t as usize) {
            *l -= count as f32 * frequency + presence;
        }
    }
}

/// Adds each bias to its token's logit; ids outside the logits are ignored.
pub fn apply_logit_bias(logits: &mut [f32], bias: &[(u32, f32)]) {
    for &(t, b) in bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
}

/// Sets the listed tokens' logits to -inf; ids outside the logits are ignored.
pub fn suppress_tokens(logits: &mut [f32], ids: &[u32]) {
    for &t in ids {
        if let Some(l) = logits.get_mut(t as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// HF `TemperatureLogitsWarper`: divides every logit by `temperature` (> 0).
pub fn apply_temperature(logits: &mut [f32], temperature: f32) {
    for l in logits.iter_mut() {
        *l /= temperature;
    }
}

/// Index of the largest logit, lowest id on ties; NaN entries are skipped.
/// Returns 0 when `logits` is empty or all NaN.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_val = f32::NAN;
    for (i, &l) in logits.iter().enumerate() {
        if l > best_val || (best_val.is_nan() && !l.is_nan()) {
            best = i;
            best_val = l;
        }
    }
    best as u32
}

/// `ln(sum(exp(logits)))`, computed stably in f64.
pub fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return max;
    }
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    (max as f64 + sum.ln()) as f32
}

/// HF `TopKLogitsWarper` (masking form): keeps the `k` largest logits and any
/// tied with the k-th; the rest become -inf. `k == 0` or `k >= len` is a no-op.
pub fn apply_top_k(logits: &mut [f32], k: usize, scratch: &mut CandidateSet) {
    scratch.reset(logits.len());
    scratch.top_k(logits, k);
    scratch.mask(logits);
}

/// HF `TopPLogitsWarper` (masking form): keeps the smallest set of most likely
/// tokens whose probability mass reaches `p` (at least one); the rest -inf.
pub fn apply_top_p(logits: &mut [f32], p: f32, scratch: &mut CandidateSet) {
    scratch.reset(logits.len());
    scratch.top_p(logits, p);
    scratch.mask(logits);
}

/// HF `MinPLogitsWarper` (masking form): drops tokens whose probability is
/// below `min_p` times the most likely token's; they become -inf.
pub fn apply_min_p(logits: &mut [f32], min_p: f32, scratch: &mut CandidateSet) {
    scratch.reset(logits.len());
    scratch.min_p(logits, min_p);
    scratch.mask(logits);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    /// Every index of the logits is a candidate; `ids` is unused.
    All,
    /// `ids` sorted by descending logit, ties by ascending id.
    Sorted,
    /// `ids` in no particular order.
    Unsorted,
}

/// The tokens still eligible after truncation, plus reusable scratch. Once its
/// buffers reached the vocabulary size, no method allocates.
#[derive(Debug, Clone)]
pub struct CandidateSet {
    ids: Vec<u32>,
    weights: Vec<f32>,
    order: Order,
    len: usize,
}

impl Default for CandidateSet {
    fn default() -> Self {
        CandidateSet {
            ids: Vec::new(),
            weights: Vec::new(),
            order: Order::All,
            len: 0,
        }
    }
}

/// Descending logit, ascending id on ties (a total order, NaN first).
#[inline]
fn by_logit_desc(logits: &[f32]) -> impl Fn(&u32, &u32) -> Ordering + '_ {
    move |&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    }
}

impl CandidateSet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes every one of `vocab_size` tokens a candidate.
    pub fn reset(&mut self, vocab_size: usize) {
        self.order = Order::All;
        self.len = vocab_size;
        self.ids.clear();
    }

    /// Number of candidates.
    pub fn len(&self) -> usize {
        match self.order {
            Order::All => self.len,
            _ => self.ids.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether nothing was truncated yet (all tokens are candidates).
    pub fn is_all(&self) -> bool {
        self.order == Order::All
    }

    /// Candidate ids (meaningless while `is_all()`: then it is empty).
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    fn materialize(&mut self) {
        if self.order == Order::All {
            self.ids.clear();
            self.ids.extend(0..self.len as u32);
            self.order = Order::Unsorted;
        }
    }

    fn sort(&mut self, logits: &[f32]) {
        if self.order != Order::Sorted {
            self.materialize();
            self.ids.sort_unstable_by(by_logit_desc(logits));
            self.order = Order::Sorted;
        }
    }

    /// Keeps the `k` best candidates and any tied with the k-th (HF/vLLM
    /// semantics). Leaves the set sorted. `k == 0` or `k >= len` keeps all.
    pub fn top_k(&mut self, logits: &[f32], k: usize) {
        if k == 0 || k >= self.len() {
            return;
        }
        self.materialize();
        if self.order != Order::Sorted {
            let cmp = by_logit_desc(logits);
            self.ids.select_nth_unstable_by(k - 1, &cmp);
            let kth = logits[self.ids[k - 1] as usize];
            // Everything after k-1 compares >= the k-th; pull exact ties forward.
            let mut keep = k;
            for j in k..self.ids.len() {
                if logits[self.ids[j] as usize] == kth {
                    self.ids.swap(keep, j);
                    keep += 1;
                }
            }
            self.ids.truncate(keep);
            self.ids.sort_unstable_by(&cmp);
            self.order = Order::Sorted;
        } else {
            let kth = logits[self.ids[k - 1] as usize];
            let keep = k + self.ids[k..]
                .iter()
                .take_while(|&&i| logits[i as usize] == kth)
                .count();
            self.ids.truncate(keep);
        }
    }

    /// Keeps the shortest prefix of the candidates (by descending probability,
    /// renormalized over the candidates) whose mass reaches `p`, at least one
    /// token: token i is kept while the mass strictly before it is `< p`, which
    /// is HF's `cumsum(ascending) > 1 - p`. Leaves the set sorted.
    ///
    /// From the full vocabulary it sorts only growing chunks of the best
    /// tokens (partial selection) until the mass is reached.
    pub fn top_p(&mut self, logits: &[f32], p: f32) {
        if self.is_empty() {
            return;
        }
        if self.order == Order::Unsorted {
            self.sort(logits);
        }
        let max = match self.order {
            Order::Sorted => logits[self.ids[0] as usize],
            _ => logits.iter().copied().fold(f32::NEG_INFINITY, f32::max),
        };
        let w = |l: f32| ((l - max) as f64).exp();
        let total: f64 = match self.order {
            Order::Sorted => self.ids.iter().map(|&i| w(logits[i as usize])).sum(),
            _ => logits.iter().map(|&l| w(l)).sum(),
        };
        if !total.is_finite() || max.is_nan() || max == f32::NEG_INFINITY {
            return; // degenerate logits: leave the choice to the draw's fallback
        }
        let target = p as f64 * total;

        if self.order == Order::Sorted {
            let mut cum = 0.0;
            let mut keep = 0;
            for &i in &self.ids {
                if keep > 0 && cum >= target {
                    break;
                }
                cum += w(logits[i as usize]);
                keep += 1;
            }
            self.ids.truncate(keep);
            return;
        }

        self.materialize();
        let cmp = by_logit_desc(logits);
        let n = self.ids.len();
        let (mut done, mut chunk, mut cum) = (0usize, 64usize, 0.0f64);
        loop {
            let end = (done + chunk).min(n);
            let rest = &mut self.ids[done..];
            if end < n {
                rest.select_nth_unstable_by(end - done - 1, &cmp);
            }
            rest[..end - done].sort_unstable_by(&cmp);
            for j in done..end {
                if j > 0 && cum >= target {
                    self.ids.truncate(j);
                    self.order = Order::Sorted;
                    return;
                }
                cum += w(logits[self.ids[j] as usize]);
            }
            done = end;
            if done == n {
                self.order = Order::Sorted;
                return;
            }
            chunk *= 4;
        }
    }

    /// Drops candidates whose probability is below `min_p` times the best
    /// candidate's: keeps `exp(l - l_max) >= min_p`. Keeps sortedness.
    pub fn min_p(&mut self, logits: &[f32], min_p: f32) {
        if self.is_empty() {
            return;
        }
        let max = match self.order {
            Order::Sorted => logits[self.ids[0] as usize],
            Order::Unsorted => self
                .ids
                .iter()
                .map(|&i| logits[i as usize])
                .fold(f32::NEG_INFINITY, f32::max),
            Order::All => logits.iter().copied().fold(f32::NEG_INFINITY, f32::max),
        };
        if max.is_nan() || max == f32::NEG_INFINITY {
            return;
        }
        let keep = |l: f32| (l - max).exp() >= min_p;
        if self.order == Order::All {
            self.ids.clear();
            self.ids
                .extend((0..logits.len() as u32).filter(|&i| keep(logits[i as usize])));
            self.order = Order::Unsorted;
        } else {
            self.ids.retain(|&i| keep(logits[i as usize]));
        }
    }

    /// Draws a candidate with probability proportional to `exp(logit)`, using
    /// `u` uniform in [0, 1). `None` when the weights are degenerate (all
    /// -inf, NaN or overflowing), so the caller can fall back to argmax.
    pub fn draw(&mut self, logits: &[f32], u: f64) -> Option<u32> {
        let max = match self.order {
            Order::Sorted => self.ids.first().map(|&i| logits[i as usize])?,
            Order::Unsorted => self
                .ids
                .iter()
                .map(|&i| logits[i as usize])
                .fold(f32::NEG_INFINITY, f32::max),
            Order::All => logits.iter().copied().fold(f32::NEG_INFINITY, f32::max),
        };
        if !max.is_finite() {
            return None;
        }
        self.weights.clear();
        let mut total = 0.0f64;
        match self.order {
            Order::All => {
                self.weights.extend(logits.iter().map(|&l| (l - max).exp()));
            }
            _ => {
                self.weights
                    .extend(self.ids.iter().map(|&i| (logits[i as usize] - max).exp()));
            }
        }
        // NaN weights (NaN logits) count as zero probability.
        for &w in &self.weights {
            if w > 0.0 {
                total += w as f64;
            }
        }
        if !(total.is_finite() && total > 0.0) {
            return None;
        }
        let target = u * total;
        let id_at = |j: usize| match self.order {
            Order::All => j as u32,
            _ => self.ids[j],
        };
        let mut cum = 0.0f64;
        let mut last_positive = None;
        for (j, &w) in self.weights.iter().enumerate() {
            if w > 0.0 {
                cum += w as f64;
                last_positive = Some(j);
                if cum > target {
                    return Some(id_at(j));
                }
            }
        }
        // Rounding left `cum` just short of `target`: take the last live token.
        last_positive.map(id_at)
    }

    /// Sets every logit that is not a candidate to -inf (the HF masking form).
    /// Leaves the candidate set intact but unsorted.
    pub fn mask(&mut self, logits: &mut [f32]) {
        if self.order == Order::All {
            return;
        }
        self.ids.sort_unstable();
        self.order = Order::Unsorted;
        let mut next = self.ids.iter().copied().peekable();
        for (i, l) in logits.iter_mut().enumerate() {
            if next.peek() == Some(&(i as u32)) {
                next.next();
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    /// The `n` best tokens of the whole `logits` (descending, ties by lowest
    /// id), written into `out` as `(id, logit)`. Uses the set as scratch, so
    /// the candidate set is reset to "all".
    pub fn top_n(&mut self, logits: &[f32], n: usize, out: &mut Vec<(u32, f32)>) {
        out.clear();
        let n = n.min(logits.len());
        if n == 0 {
            return;
        }
        self.ids.clear();
        self.ids.extend(0..logits.len() as u32);
        let cmp = by_logit_desc(logits);
        if n < self.ids.len() {
            self.ids.select_nth_unstable_by(n - 1, &cmp);
        }
        self.ids[..n].sort_unstable_by(&cmp);
        out.extend(self.ids[..n].iter().map(|&i| (i, logits[i as usize])));
        self.reset(logits.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEG: f32 = f32::NEG_INFINITY;

    fn kept(logits: &[f32]) -> Vec<usize> {
        logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, _)| i)
            .collect()
    }

    #[test]
    fn repetition_penalty_hf_semantics() {
        let mut h = TokenHistory::new(6, true, false);
        h.sync(&[1, 2, 1], &[4, 4]);
        let mut l = vec![1.0, 2.0, -2.0, 3.0, 0.0, -1.0];
        apply_repetition_penalty(&mut l, 2.0, &h);
        // Each distinct seen token once: 1 (positive, /2), 2 (negative, *2), 4 (zero).
        assert_eq!(l, vec![1.0, 1.0, -4.0, 3.0, 0.0, -1.0]);
    }

    #[test]
    fn presence_frequency_over_output_only() {
        let mut h = TokenHistory::new(5, false, true);
        h.sync(&[0, 0, 1], &[2, 2, 2, 3]);
        let mut l = vec![0.0; 5];
        apply_presence_frequency_penalty(&mut l, 0.5, 0.25, &h);
        assert_eq!(l, vec![0.0, 0.0, -(0.5 + 3.0 * 0.25), -(0.5 + 0.25), 0.0]);
    }

    #[test]
    fn bias_and_suppression_ignore_out_of_range_ids() {
        let mut l = vec![0.0, 1.0, 2.0];
        apply_logit_bias(&mut l, &[(0, 1.5), (7, 3.0)]);
        suppress_tokens(&mut l, &[2, 9]);
        assert_eq!(l, vec![1.5, 1.0, NEG]);
    }

    #[test]
    fn argmax_ties_and_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.5]), 1);
        assert_eq!(argmax(&[NEG, NEG]), 0);
        assert_eq!(argmax(&[]), 0);
    }

    #[test]
    fn top_k_keeps_ties_with_kth() {
        let mut s = CandidateSet::new();
        let mut l = vec![1.0, 5.0, 3.0, 3.0, 0.0, 3.0];
        apply_top_k(&mut l, 2, &mut s);
        assert_eq!(kept(&l), vec![1, 2, 3, 5]);
        let mut l = vec![1.0, 5.0, 3.0];
        apply_top_k(&mut l, 3, &mut s);
        assert_eq!(kept(&l), vec![0, 1, 2]);
    }

    #[test]
    fn top_p_boundary_and_minimum_one() {
        // probs 0.5, 0.25, 0.125, 0.125 (exactly representable)
        let base: Vec<f32> = [0.5f32, 0.25, 0.125, 0.125]
            .iter()
            .map(|p| p.ln())
            .collect();
        let mut s = CandidateSet::new();
        let mut l = base.clone();
        apply_top_p(&mut l, 0.5, &mut s);
        assert_eq!(kept(&l), vec![0]);
        let mut l = base.clone();
        apply_top_p(&mut l, 0.6, &mut s);
        assert_eq!(kept(&l), vec![0, 1]);
        let mut l = base.clone();
        apply_top_p(&mut l, 1e-6, &mut s);
        assert_eq!(kept(&l), vec![0]);
    }

    #[test]
    fn top_p_on_large_vocab_matches_full_sort() {
        // Mass spread so the partial selection needs several chunks.
        let n = 5000;
        let logits: Vec<f32> = (0..n).map(|i| ((i * 7919) % n) as f32 * 1e-3).collect();
        for p in [0.05f32, 0.3, 0.9, 0.999] {
            let mut s = CandidateSet::new();
            s.reset(n);
            s.top_p(&logits, p);
            // Reference: full sort, then the HF rule.
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            let max = logits[order[0]] as f64;
            let total: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
            let mut cum = 0.0;
            let mut expect = Vec::new();
            for &i in &order {
                if !expect.is_empty() && cum >= p as f64 * total {
                    break;
                }
                cum += (logits[i] as f64 - max).exp();
                expect.push(i as u32);
            }
            assert_eq!(s.ids(), &expect[..], "p = {p}");
        }
    }

    #[test]
    fn min_p_relative_to_max() {
        let mut s = CandidateSet::new();
        let base: Vec<f32> = [0.5f32, 0.2, 0.05, 0.25].iter().map(|p| p.ln()).collect();
        let mut l = base.clone();
        apply_min_p(&mut l, 0.3, &mut s); // threshold 0.15
        assert_eq!(kept(&l), vec![0, 1, 3]);
        let mut l = base;
        apply_min_p(&mut l, 1.0, &mut s);
        assert_eq!(kept(&l), vec![0]);
    }

    #[test]
    fn chained_truncation_on_candidates() {
        let logits: Vec<f32> = vec![0.0, 4.0, 1.0, 3.0, 2.0, 3.5, -1.0, 2.5];
        let mut s = CandidateSet::new();
        s.reset(logits.len());
        s.top_k(&logits, 4); // 1, 5, 3, 7
        assert_eq!(s.ids(), &[1, 5, 3, 7]);
        s.min_p(&logits, (-1.2f32).exp()); // keeps l >= 2.8
        assert_eq!(s.ids(), &[1, 5, 3]);
    }

    #[test]
    fn draw_degenerate_returns_none() {
        let mut s = CandidateSet::new();
        s.reset(3);
        assert_eq!(s.draw(&[NEG, NEG, NEG], 0.5), None);
        assert_eq!(s.draw(&[f32::NAN, 0.0, 0.0], 0.5), Some(2));
        s.reset(2);
        assert_eq!(s.draw(&[f32::INFINITY, 0.0], 0.5), None);
    }

    #[test]
    fn top_n_sorted_with_tie_break() {
        let mut s = CandidateSet::new();
        let mut out = Vec::new();
        s.top_n(&[1.0, 3.0, 2.0, 3.0, 0.0], 3, &mut out);
        assert_eq!(out, vec![(1, 3.0), (3, 3.0), (2, 2.0)]);
        s.top_n(&[1.0, 2.0], 5, &mut out);
        assert_eq!(out, vec![(1, 2.0), (0, 1.0)]);
    }
}
