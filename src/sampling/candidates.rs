//! Truncation (top-k, top-p, min-p) and the draw, on a set of candidate
//! tokens rather than on masked logits, so a step never sorts the whole
//! vocabulary when few tokens survive.
//!
//! Candidates are packed `u64` keys: the high half is the logit's bits mapped
//! to an order where ascending key = descending logit, the low half is the
//! token id. Sorting keys ascending therefore orders by descending logit with
//! ties by lowest id, using plain integer compares.

use super::math;

/// High half of a key: ascending order of this = descending order of `l`
/// (NaN first, then +inf ... -inf, with -0.0 after +0.0, like `total_cmp`).
#[inline(always)]
fn desc_bits(l: f32) -> u32 {
    let b = l.to_bits();
    let asc = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    !asc
}

#[inline(always)]
fn pack(l: f32, id: u32) -> u64 {
    ((desc_bits(l) as u64) << 32) | id as u64
}

#[inline(always)]
fn id_of(key: u64) -> u32 {
    key as u32
}

#[inline(always)]
fn logit_of(key: u64) -> f32 {
    let asc = !((key >> 32) as u32);
    f32::from_bits(if asc >> 31 == 1 {
        asc & 0x7fff_ffff
    } else {
        !asc
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    /// Every token of the row is a candidate; `keys` is unused.
    All,
    /// `keys` ascending (descending logit, ties by lowest id).
    Sorted,
    /// `keys` in no particular order.
    Unsorted,
}

/// The tokens still eligible after truncation, plus reusable scratch. Once
/// its buffers reached the vocabulary size, no method allocates.
#[derive(Debug, Clone)]
pub struct CandidateSet {
    keys: Vec<u64>,
    weights: Vec<f32>,
    order: Order,
    len: usize,
}

impl Default for CandidateSet {
    fn default() -> Self {
        CandidateSet {
            keys: Vec::new(),
            weights: Vec::new(),
            order: Order::All,
            len: 0,
        }
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
        self.keys.clear();
    }

    /// Number of candidates.
    pub fn len(&self) -> usize {
        match self.order {
            Order::All => self.len,
            _ => self.keys.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether nothing was truncated yet (all tokens are candidates).
    pub fn is_all(&self) -> bool {
        self.order == Order::All
    }

    /// Candidate ids: best first once top-k or top-p ran, otherwise in no
    /// particular order; all ids `0..len` while `is_all()`.
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        let all = if self.is_all() {
            0..self.len as u32
        } else {
            0..0
        };
        all.chain(self.keys.iter().map(|&k| id_of(k)))
    }

    fn materialize(&mut self, logits: &[f32]) {
        if self.order == Order::All {
            self.keys.clear();
            self.keys
                .extend(logits.iter().enumerate().map(|(i, &l)| pack(l, i as u32)));
            self.order = Order::Unsorted;
        }
    }

    /// Max logit among the candidates (NaN ignored).
    fn max_logit(&self, logits: &[f32]) -> f32 {
        let key_logits = self.keys.iter().map(|&k| logit_of(k));
        match self.order {
            Order::All => math::max(logits),
            // NaN keys sort first; the first other key is the max.
            Order::Sorted => key_logits
                .into_iter()
                .find(|l| !l.is_nan())
                .unwrap_or(f32::NEG_INFINITY),
            Order::Unsorted => key_logits.fold(f32::NEG_INFINITY, f32::max),
        }
    }

    /// Keeps the `k` best candidates and any tied with the k-th (HF / vLLM
    /// semantics). Leaves the set sorted. `k == 0` or `k >= len` keeps all.
    pub fn top_k(&mut self, logits: &[f32], k: usize) {
        if k == 0 || k >= self.len() {
            return;
        }
        if self.order == Order::Sorted {
            let kth = logit_of(self.keys[k - 1]);
            let ties = self.keys[k..]
                .iter()
                .take_while(|&&key| logit_of(key) == kth)
                .count();
            self.keys.truncate(k + ties);
            return;
        }
        self.materialize(logits);
        self.keys.select_nth_unstable(k - 1);
        let kth = logit_of(self.keys[k - 1]);
        // Everything after k-1 is no better than the k-th; pull exact ties forward.
        let mut keep = k;
        for j in k..self.keys.len() {
            if logit_of(self.keys[j]) == kth {
                self.keys.swap(keep, j);
                keep += 1;
            }
        }
        self.keys.truncate(keep);
        self.keys.sort_unstable();
        self.order = Order::Sorted;
    }

    /// Keeps the shortest best-first prefix of the candidates whose
    /// probability mass (renormalized over the candidates) reaches `p`, at
    /// least one token: token i is kept while the mass strictly before it is
    /// `< p`, which is HF's `cumsum(ascending) > 1 - p`. Leaves the set sorted.
    ///
    /// From the full vocabulary, tokens with weight below `(1 - p) * total / V`
    /// are dropped first (together they hold less than `1 - p`, so they all lie
    /// in the removed tail), then growing chunks of the rest are selected and
    /// sorted until the mass is reached.
    pub fn top_p(&mut self, logits: &[f32], p: f32) {
        if self.is_empty() {
            return;
        }
        let max = self.max_logit(logits);
        if !max.is_finite() {
            return; // degenerate row: leave the choice to the draw's fallback
        }
        let total = match self.order {
            Order::All => math::sum_exp(logits, max),
            _ => self
                .keys
                .iter()
                .map(|&k| math::exp_approx(logit_of(k) - max) as f64)
                .sum(),
        };
        if !(total.is_finite() && total > 0.0) {
            return;
        }
        let target = p as f64 * total;

        if self.order == Order::All {
            // The margin keeps rounding from dropping a token right at the bound.
            let floor = ((1.0 - p as f64) * total / logits.len() as f64).ln() as f32 - 1e-3;
            self.keys.clear();
            self.keys.extend(
                logits
                    .iter()
                    .enumerate()
                    .filter(|&(_, &l)| l - max >= floor)
                    .map(|(i, &l)| pack(l, i as u32)),
            );
            self.order = Order::Unsorted;
        }

        let weight = |key: u64| math::exp_approx(logit_of(key) - max) as f64;
        let n = self.keys.len();
        let (mut done, mut chunk, mut cum) = (0usize, 64usize, 0.0f64);
        if self.order == Order::Sorted {
            chunk = n;
        }
        while done < n {
            let end = (done + chunk).min(n);
            if self.order != Order::Sorted {
                let rest = &mut self.keys[done..];
                if end < n {
                    rest.select_nth_unstable(end - done - 1);
                }
                rest[..end - done].sort_unstable();
            }
            for j in done..end {
                if j > 0 && cum >= target {
                    self.keys.truncate(j);
                    self.order = Order::Sorted;
                    return;
                }
                cum += weight(self.keys[j]);
            }
            done = end;
            chunk *= 4;
        }
        self.order = Order::Sorted;
    }

    /// Drops candidates whose probability is below `min_p` times the best
    /// candidate's, i.e. keeps `l - l_max >= ln(min_p)`. Keeps the order.
    pub fn min_p(&mut self, logits: &[f32], min_p: f32) {
        if self.is_empty() {
            return;
        }
        let max = self.max_logit(logits);
        if !max.is_finite() {
            return;
        }
        let floor = min_p.ln();
        if self.order == Order::All {
            self.keys.clear();
            self.keys.extend(
                logits
                    .iter()
                    .enumerate()
                    .filter(|&(_, &l)| l - max >= floor)
                    .map(|(i, &l)| pack(l, i as u32)),
            );
            self.order = Order::Unsorted;
        } else {
            self.keys.retain(|&k| logit_of(k) - max >= floor);
        }
    }

    /// Draws a candidate with probability proportional to `exp(logit)`, using
    /// `u` uniform in [0, 1). `None` when the weights are degenerate (all
    /// -inf, NaN or overflowing), so the caller can fall back to argmax.
    pub fn draw(&mut self, logits: &[f32], u: f64) -> Option<u32> {
        let max = self.max_logit(logits);
        if !max.is_finite() {
            return None;
        }
        let total = match self.order {
            Order::All => math::exp_into(logits, max, &mut self.weights),
            _ => {
                self.weights.clear();
                let w = self
                    .keys
                    .iter()
                    .map(|&k| math::exp_approx(logit_of(k) - max));
                self.weights.extend(w);
                self.weights.iter().map(|&w| w as f64).sum()
            }
        };
        if !(total.is_finite() && total > 0.0) {
            return None;
        }
        let target = u * total;
        let id_at = |j: usize| match self.order {
            Order::All => j as u32,
            _ => id_of(self.keys[j]),
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

    /// Sets every logit that is not a candidate to -inf (the HF masking
    /// form). Leaves the candidate set intact but unsorted.
    pub fn mask(&mut self, logits: &mut [f32]) {
        if self.order == Order::All {
            return;
        }
        self.keys.sort_unstable_by_key(|&k| id_of(k));
        self.order = Order::Unsorted;
        let mut next = self.keys.iter().map(|&k| id_of(k)).peekable();
        for (i, l) in logits.iter_mut().enumerate() {
            if next.peek() == Some(&(i as u32)) {
                next.next();
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    /// The `n` best tokens of the whole row (best first, ties by lowest id),
    /// written into `out` as `(id, logit)`. Uses the set as scratch: the
    /// candidate set is reset to "all" afterwards.
    pub fn top_n(&mut self, logits: &[f32], n: usize, out: &mut Vec<(u32, f32)>) {
        out.clear();
        let n = n.min(logits.len());
        if n > 0 {
            self.order = Order::All;
            self.materialize(logits);
            if n < self.keys.len() {
                self.keys.select_nth_unstable(n - 1);
            }
            self.keys[..n].sort_unstable();
            out.extend(self.keys[..n].iter().map(|&k| (id_of(k), logit_of(k))));
        }
        self.reset(logits.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEG: f32 = f32::NEG_INFINITY;

    fn ids(s: &CandidateSet) -> Vec<u32> {
        s.ids().collect()
    }

    #[test]
    fn key_order_and_roundtrip() {
        let vals = [
            f32::NAN,
            f32::INFINITY,
            3.5,
            1.0,
            0.0,
            -0.0,
            -1e-30,
            -2.0,
            NEG,
        ];
        let keys: Vec<u64> = vals
            .iter()
            .enumerate()
            .map(|(i, &l)| pack(l, i as u32))
            .collect();
        let mut sorted = keys.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, keys, "ascending keys must be descending logits");
        for (&k, &v) in keys.iter().zip(&vals) {
            assert_eq!(logit_of(k).to_bits(), v.to_bits());
        }
        assert!(pack(1.0, 3) < pack(1.0, 4), "ties break by lowest id");
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
            // Reference: full sort, then the HF rule, in f64.
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
            assert_eq!(ids(&s), expect, "p = {p}");
        }
    }

    #[test]
    fn top_p_floor_prefilter_on_peaked_row() {
        let mut logits = vec![-10.0f32; 1000];
        logits[10] = 5.0;
        logits[20] = 4.0;
        logits[30] = 3.0;
        let mut s = CandidateSet::new();
        s.reset(logits.len());
        s.top_p(&logits, 0.9);
        assert_eq!(ids(&s), vec![10, 20]);
    }

    #[test]
    fn chained_truncation_on_candidates() {
        let logits: Vec<f32> = vec![0.0, 4.0, 1.0, 3.0, 2.0, 3.5, -1.0, 2.5];
        let mut s = CandidateSet::new();
        s.reset(logits.len());
        s.top_k(&logits, 4);
        assert_eq!(ids(&s), vec![1, 5, 3, 7]);
        s.min_p(&logits, (-1.2f32).exp()); // keeps l >= 2.8
        assert_eq!(ids(&s), vec![1, 5, 3]);
        s.top_k(&logits, 2);
        assert_eq!(ids(&s), vec![1, 5]);
        s.top_p(&logits, 0.5);
        assert_eq!(ids(&s), vec![1]);
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
    fn draw_covers_the_unit_interval() {
        let logits = [0.0f32, 0.0, 0.0, 0.0];
        let mut s = CandidateSet::new();
        s.reset(4);
        assert_eq!(s.draw(&logits, 0.0), Some(0));
        assert_eq!(s.draw(&logits, 0.26), Some(1));
        assert_eq!(s.draw(&logits, 0.99), Some(3));
        assert_eq!(s.draw(&logits, 1.0), Some(3)); // rounding fallback
    }

    #[test]
    fn top_n_sorted_with_tie_break() {
        let mut s = CandidateSet::new();
        let mut out = Vec::new();
        s.top_n(&[1.0, 3.0, 2.0, 3.0, 0.0], 3, &mut out);
        assert_eq!(out, vec![(1, 3.0), (3, 3.0), (2, 2.0)]);
        s.top_n(&[1.0, 2.0], 5, &mut out);
        assert_eq!(out, vec![(1, 2.0), (0, 1.0)]);
        assert!(s.is_all());
    }
}
