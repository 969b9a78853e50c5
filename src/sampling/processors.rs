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
//! (see `candidates`) so that the sampler never masks or sorts the
//! whole vocabulary when a few candidates survive; `apply_top_k` & co. are the
//! masking forms (HF warper semantics: dropped tokens become -inf) built on the
//! same code.

use super::candidates::CandidateSet;
use super::history::TokenHistory;
use super::math;

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
    math::argmax(logits)
}

/// `ln(sum(exp(logits)))`: the normalizer of `log_softmax`.
pub fn log_sum_exp(logits: &[f32]) -> f32 {
    math::log_sum_exp(logits)
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
}
