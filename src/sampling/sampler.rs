//! The per-request CPU sampler: runs the stage chain of `processors` on one
//! row of logits and draws a token with the request's own RNG stream.

use super::candidates::CandidateSet;
use super::grammar::{GrammarMask, MaskStats};
use super::history::TokenHistory;
use super::params::{SamplingParams, SamplingPlan};
use super::processors::{
    apply_logit_bias, apply_presence_frequency_penalty, apply_repetition_penalty,
    apply_temperature, argmax, log_sum_exp, suppress_tokens,
};
use super::rng::Rng;
use crate::forward::{DeviceSampling, RowSampling};
use crate::{bail_arg, Result};

/// One sampled token.
///
/// Log-probabilities are `log_softmax` of the *processed* logits: after
/// penalties, logit bias, suppression and temperature (no temperature when
/// greedy), but before top-k / top-p / min-p truncation. So they describe the
/// distribution the truncation was applied to, are comparable across
/// truncation settings, and a suppressed token has -inf.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    pub token: u32,
    /// Log-probability of `token`; NaN when the request asked for no logprobs.
    pub logprob: f32,
    /// The `logprobs` most likely tokens, best first (ties by lowest id);
    /// empty when the request asked for none.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Per-request sampler. Create one per request; it keeps the RNG stream, the
/// incremental token history for penalties and all scratch buffers, so once
/// warm (after the first call) `sample` does not allocate unless logprobs are
/// requested (then only the returned `top_logprobs` vector).
#[derive(Debug, Clone)]
pub struct Sampler {
    plan: SamplingPlan,
    logit_bias: Vec<(u32, f32)>,
    logprobs: usize,
    max_tokens: usize,
    rng: Rng,
    history: Option<TokenHistory>,
    candidates: CandidateSet,
    /// The request's structured-output grammar: the first stage.
    grammar: Option<GrammarMask>,
}

impl Sampler {
    /// `params` should have passed `validate`; invalid values never panic but
    /// give unspecified choices. A request with `seed: Some(s)` draws from its
    /// own stream seeded by `s`; otherwise from `fallback_seed`.
    pub fn new(params: &SamplingParams, fallback_seed: u64) -> Self {
        Sampler {
            plan: params.plan(),
            logit_bias: params.logit_bias.clone(),
            logprobs: params.logprobs as usize,
            max_tokens: params.max_tokens as usize,
            rng: Rng::seed_from_u64(params.seed.unwrap_or(fallback_seed)),
            history: None,
            candidates: CandidateSet::new(),
            grammar: None,
        }
    }

    /// Constrains every token this sampler picks to `grammar`.
    pub fn set_grammar(&mut self, grammar: GrammarMask) {
        self.grammar = Some(grammar);
    }

    /// The state of the RNG stream the next draw comes from.
    pub fn rng_state(&self) -> [u64; 4] {
        self.rng.state()
    }

    /// Continues the RNG stream of a saved sampler (see `rng_state`).
    pub fn resume_rng(&mut self, state: [u64; 4]) {
        self.rng = Rng::from_state(state);
    }

    pub fn has_grammar(&self) -> bool {
        self.grammar.is_some()
    }

    /// Computes the grammar's mask for the next token ahead of `sample`
    /// (see `GrammarMask::prepare`); false when there is no grammar.
    pub fn prepare_grammar(&mut self) -> bool {
        self.grammar.as_mut().map(GrammarMask::prepare).is_some()
    }

    /// The grammar's mask counters since the last call (zero without one).
    pub fn take_mask_stats(&mut self) -> MaskStats {
        self.grammar
            .as_mut()
            .map(GrammarMask::take_stats)
            .unwrap_or_default()
    }

    /// True when a grammar constrains this request and the output so far
    /// does not complete it.
    pub fn grammar_unfinished(&mut self) -> bool {
        self.grammar.as_mut().is_some_and(|g| !g.is_complete())
    }

    pub fn plan(&self) -> &SamplingPlan {
        &self.plan
    }

    /// Picks the next token from `logits` (one row, the vocabulary).
    ///
    /// `prompt` and `output` are the request's full token history; they must
    /// only grow between calls (the history is updated incrementally, and
    /// rebuilt if it shrank or its last token changed). `suppress` lists ids to
    /// forbid for this step (the engine passes EOS + stop ids while the output
    /// is shorter than `min_tokens`).
    ///
    /// On return `logits` holds the processed logits (see `SampledToken`).
    /// Errors only on an empty `logits` row.
    /// Whether `sample` reduces to the argmax of the raw logits: no
    /// temperature, penalties, bias or logprobs (min_tokens suppression is
    /// the caller's to check). Such rows may be decoded on the device.
    pub fn is_plain_greedy(&self) -> bool {
        self.plan.temperature.is_none()
            && !self.plan.needs_history()
            && self.logit_bias.is_empty()
            && self.logprobs == 0
            && self.grammar.is_none()
    }

    pub fn sample(
        &mut self,
        logits: &mut [f32],
        prompt: &[u32],
        output: &[u32],
        suppress: &[u32],
    ) -> Result<SampledToken> {
        if logits.is_empty() {
            bail_arg!("sample: the logits row is empty");
        }
        // The grammar's mask comes before every other stage, so penalties,
        // bias and temperature only ever weigh tokens it allows, and
        // logprobs are those of the constrained distribution.
        if let Some(g) = self.grammar.as_mut() {
            g.apply(logits)?;
        }
        self.apply_penalties(logits, prompt, output);
        apply_logit_bias(logits, &self.logit_bias);
        suppress_tokens(logits, suppress);

        let token = match self.plan.temperature {
            None => argmax(logits),
            Some(t) => {
                apply_temperature(logits, t);
                self.draw(logits)
            }
        };

        if let Some(g) = self.grammar.as_mut() {
            g.consume(token)?;
        }
        let (logprob, top_logprobs) = if self.logprobs > 0 {
            let lse = log_sum_exp(logits);
            let mut top = Vec::with_capacity(self.logprobs);
            self.candidates.top_n(logits, self.logprobs, &mut top);
            for (_, l) in top.iter_mut() {
                *l -= lse;
            }
            (logits[token as usize] - lse, top)
        } else {
            (f32::NAN, Vec::new())
        };
        Ok(SampledToken {
            token,
            logprob,
            top_logprobs,
        })
    }

    fn apply_penalties(&mut self, logits: &mut [f32], prompt: &[u32], output: &[u32]) {
        let plan = self.plan;
        let Some(history) = self.synced_history(logits.len(), prompt, output) else {
            return;
        };
        if let Some(p) = plan.repetition_penalty {
            apply_repetition_penalty(logits, p, history);
        }
        if let Some((presence, frequency)) = plan.presence_frequency {
            apply_presence_frequency_penalty(logits, presence, frequency, history);
        }
    }

    /// The token history brought up to `prompt` + `output`, when a penalty
    /// needs it.
    fn synced_history(
        &mut self,
        vocab: usize,
        prompt: &[u32],
        output: &[u32],
    ) -> Option<&TokenHistory> {
        if !self.plan.needs_history() {
            return None;
        }
        if !matches!(&self.history, Some(h) if h.vocab_size() == vocab) {
            let mut h = TokenHistory::new(
                vocab,
                self.plan.repetition_penalty.is_some(),
                self.plan.presence_frequency.is_some(),
            );
            // Distinct tokens are bounded by the request's length.
            let out_cap = self.max_tokens.max(output.len());
            h.reserve(prompt.len() + out_cap, out_cap);
            self.history = Some(h);
        }
        let history = self.history.as_mut()?;
        history.sync(prompt, output);
        Some(history)
    }

    /// Whether `sample` for this request can run on a device through
    /// `push_device_row` (everything but logprobs, which need the row
    /// here). A grammar's row also needs its mask (`pack_grammar_mask`)
    /// after the forward starts.
    pub fn samples_on_device(&self) -> bool {
        self.logprobs == 0
    }

    /// Writes the grammar's mask for the row `push_device_row` appended
    /// (see `GrammarMask::pack`; `n`: the logits `sample` would get).
    pub fn pack_grammar_mask(&mut self, n: usize, out: &mut [u32]) {
        if let Some(g) = self.grammar.as_mut() {
            g.pack(n, out);
        }
    }

    /// The grammar's side of `token`, sampled on a device from a row this
    /// sampler pushed: fails where `sample` would have failed on the
    /// grammar, else advances it.
    pub fn accept_device_token(&mut self, n: usize, token: u32) -> Result<()> {
        match self.grammar.as_mut() {
            Some(g) => g.accept(n, token),
            None => Ok(()),
        }
    }

    /// Appends this step's row to `batch`: what `sample` would do to a
    /// logits row of `vocab` entries, for a device to run. Draws the row's
    /// uniform from the request's stream exactly when `sample` would.
    pub fn push_device_row(
        &mut self,
        vocab: usize,
        prompt: &[u32],
        output: &[u32],
        suppress: &[u32],
        batch: &mut DeviceSampling,
    ) {
        let plan = self.plan;
        let (mut repeated, mut penalized) = (0..0, 0..0);
        if let Some(history) = self.synced_history(vocab, prompt, output) {
            repeated = batch.push_edits(history.seen_tokens().iter().map(|&t| (t, 0.0)));
            if let Some((presence, frequency)) = plan.presence_frequency {
                penalized = batch.push_edits(
                    history
                        .output_counts()
                        .map(|(t, count)| (t, count as f32 * frequency + presence)),
                );
            }
        }
        let biased = batch.push_edits(self.logit_bias.iter().copied());
        let suppressed = batch.push_edits(suppress.iter().map(|&t| (t, 0.0)));
        batch.rows.push(RowSampling {
            repetition_penalty: plan.repetition_penalty,
            temperature: plan.temperature,
            top_k: plan.top_k,
            top_p: plan.top_p,
            min_p_floor: plan.min_p.map(f32::ln),
            u: if plan.temperature.is_some() {
                self.rng.next_f64()
            } else {
                0.0
            },
            repeated,
            penalized,
            biased,
            suppressed,
            pending: None,
            masked: self.grammar.is_some(),
        });
    }

    /// Marks the row `push_device_row` just appended as launched before this
    /// request's previous token is known (overlapped steps; see
    /// `RowSampling::pending`): its lists were made from the tokens before
    /// that one.
    pub fn mark_pending(&self, batch: &mut DeviceSampling) {
        if let Some(row) = batch.rows.last_mut() {
            row.pending = Some(self.plan.presence_frequency.unwrap_or((0.0, 0.0)));
        }
    }

    /// Truncation (top-k → top-p → min-p) on the candidate set, then the draw.
    fn draw(&mut self, logits: &[f32]) -> u32 {
        let c = &mut self.candidates;
        c.reset(logits.len());
        if let Some(k) = self.plan.top_k {
            c.top_k(logits, k);
        }
        if let Some(p) = self.plan.top_p {
            c.top_p(logits, p);
        }
        if let Some(m) = self.plan.min_p {
            c.min_p(logits, m);
        }
        let u = self.rng.next_f64();
        c.draw(logits, u).unwrap_or_else(|| argmax(logits))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fixed logits used by the statistical tests (distinct values).
    const LOGITS: [f32; 12] = [
        2.0, 1.5, 1.0, 0.8, 0.5, 0.3, 0.0, -0.2, -0.5, -1.0, -1.5, -3.0,
    ];
    const DRAWS: usize = 100_000;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p
    }

    fn softmax64(logits: &[f32], t: f64) -> Vec<f64> {
        let max = logits
            .iter()
            .map(|&l| l as f64 / t)
            .fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = logits.iter().map(|&l| (l as f64 / t - max).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    }

    /// Zeroes the excluded tokens and renormalizes.
    fn restrict(probs: &[f64], keep: &[bool]) -> Vec<f64> {
        let s: f64 = probs
            .iter()
            .zip(keep)
            .filter(|(_, &k)| k)
            .map(|(p, _)| p)
            .sum();
        probs
            .iter()
            .zip(keep)
            .map(|(p, &k)| if k { p / s } else { 0.0 })
            .collect()
    }

    fn counts(p: &SamplingParams, seed: u64) -> Vec<usize> {
        let mut s = Sampler::new(p, seed);
        let mut c = vec![0usize; LOGITS.len()];
        let mut row = LOGITS;
        for _ in 0..DRAWS {
            row.copy_from_slice(&LOGITS);
            c[s.sample(&mut row, &[], &[], &[]).unwrap().token as usize] += 1;
        }
        c
    }

    /// Chi-square goodness of fit at p = 0.001 (Wilson-Hilferty quantile);
    /// tokens with zero expected probability must never be drawn.
    fn assert_fits(observed: &[usize], expected: &[f64]) {
        let n: usize = observed.iter().sum();
        let mut chi2 = 0.0;
        let mut df = 0usize;
        for (i, (&o, &p)) in observed.iter().zip(expected).enumerate() {
            if p == 0.0 {
                assert_eq!(o, 0, "token {i} has probability 0 but was drawn {o} times");
                continue;
            }
            let e = p * n as f64;
            assert!(
                e >= 5.0,
                "test setup: expected count {e} too small for chi-square"
            );
            chi2 += (o as f64 - e).powi(2) / e;
            df += 1;
        }
        let df = (df - 1) as f64;
        let z = 3.090; // upper 0.001 quantile of N(0, 1)
        let h = 2.0 / (9.0 * df);
        let critical = df * (1.0 - h + z * h.sqrt()).powi(3);
        assert!(
            chi2 < critical,
            "chi2 {chi2:.2} >= critical {critical:.2} (df {df}); observed {observed:?}"
        );
    }

    fn top_p_keep(probs: &[f64], p: f64) -> Vec<bool> {
        let mut order: Vec<usize> = (0..probs.len()).collect();
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
        let mut keep = vec![false; probs.len()];
        let mut cum = 0.0;
        for &i in &order {
            if cum >= p {
                break;
            }
            keep[i] = true;
            cum += probs[i];
        }
        keep
    }

    #[test]
    fn temperature_sampling_matches_softmax() {
        let p = params(|p| p.temperature = 0.8);
        assert_fits(&counts(&p, 1), &softmax64(&LOGITS, 0.8));
        let p = params(|p| p.temperature = 1.0);
        assert_fits(&counts(&p, 2), &softmax64(&LOGITS, 1.0));
    }

    #[test]
    fn top_k_sampling_matches_truncated_distribution() {
        let p = params(|p| {
            p.temperature = 1.0;
            p.top_k = 4;
        });
        let keep: Vec<bool> = (0..LOGITS.len()).map(|i| i < 4).collect();
        assert_fits(&counts(&p, 3), &restrict(&softmax64(&LOGITS, 1.0), &keep));
    }

    #[test]
    fn top_p_sampling_matches_truncated_distribution() {
        let p = params(|p| {
            p.temperature = 1.2;
            p.top_p = 0.7;
        });
        let probs = softmax64(&LOGITS, 1.2);
        let keep = top_p_keep(&probs, 0.7);
        assert!(
            keep.iter().filter(|&&k| k).count() > 2,
            "test setup keeps too little"
        );
        assert_fits(&counts(&p, 4), &restrict(&probs, &keep));
    }

    #[test]
    fn min_p_sampling_matches_truncated_distribution() {
        let p = params(|p| {
            p.temperature = 1.0;
            p.min_p = 0.2;
        });
        let probs = softmax64(&LOGITS, 1.0);
        let keep: Vec<bool> = probs.iter().map(|&q| q >= 0.2 * probs[0]).collect();
        assert_eq!(keep.iter().filter(|&&k| k).count(), 5);
        assert_fits(&counts(&p, 5), &restrict(&probs, &keep));
    }

    #[test]
    fn chained_truncation_matches_distribution() {
        let p = params(|p| {
            p.temperature = 1.5;
            p.top_k = 8;
            p.top_p = 0.85;
            p.min_p = 0.1;
        });
        let probs = softmax64(&LOGITS, 1.5);
        let k_keep: Vec<bool> = (0..LOGITS.len()).map(|i| i < 8).collect();
        let after_k = restrict(&probs, &k_keep);
        let p_keep = top_p_keep(&after_k, 0.85);
        let after_p = restrict(&after_k, &p_keep);
        let m_keep: Vec<bool> = after_p
            .iter()
            .map(|&q| q > 0.0 && q >= 0.1 * after_p[0])
            .collect();
        let expected = restrict(&after_p, &m_keep);
        assert!(expected.iter().filter(|&&q| q > 0.0).count() >= 3);
        assert_fits(&counts(&p, 6), &expected);
    }

    fn run(p: &SamplingParams, fallback: u64, steps: usize) -> Vec<u32> {
        let mut s = Sampler::new(p, fallback);
        let mut out = Vec::new();
        let mut rng = Rng::seed_from_u64(99);
        for _ in 0..steps {
            let mut row: Vec<f32> = (0..64).map(|_| rng.next_f32() * 4.0).collect();
            let t = s.sample(&mut row, &[1, 2, 3], &out, &[]).unwrap().token;
            out.push(t);
        }
        out
    }

    #[test]
    fn same_seed_same_sequence_different_seed_differs() {
        let p = params(|p| {
            p.temperature = 1.0;
            p.top_p = 0.95;
            p.repetition_penalty = 1.1;
            p.frequency_penalty = 0.3;
            p.seed = Some(1234);
        });
        let a = run(&p, 1, 200);
        assert_eq!(a, run(&p, 2, 200), "explicit seed must ignore the fallback");
        let other = params(|q| {
            *q = p.clone();
            q.seed = Some(1235);
        });
        assert_ne!(a, run(&other, 1, 200));
        let unseeded = params(|q| {
            *q = p.clone();
            q.seed = None;
        });
        assert_eq!(run(&unseeded, 7, 200), run(&unseeded, 7, 200));
        assert_ne!(run(&unseeded, 7, 200), run(&unseeded, 8, 200));
    }

    #[test]
    fn logprob_is_log_softmax_of_processed_logits() {
        let p = params(|p| {
            p.temperature = 0.7;
            p.top_k = 10;
            p.repetition_penalty = 1.3;
            p.presence_penalty = 0.5;
            p.frequency_penalty = 0.25;
            p.logit_bias = vec![(3, 2.0), (4, -1.0)];
            p.logprobs = 5;
            p.seed = Some(11);
        });
        let mut rng = Rng::seed_from_u64(5);
        let raw: Vec<f32> = (0..50).map(|_| rng.next_f32() * 6.0 - 3.0).collect();
        let prompt = [1u32, 2, 2];
        let output = [2u32, 7, 7, 7];
        let suppress = [9u32];

        // Independent processing, straight from the documented semantics.
        let mut expect = raw.clone();
        for t in [1usize, 2, 7] {
            expect[t] = if expect[t] < 0.0 {
                expect[t] * 1.3
            } else {
                expect[t] / 1.3
            };
        }
        expect[2] -= 0.5 + 0.25;
        expect[7] -= 0.5 + 3.0 * 0.25;
        expect[3] += 2.0;
        expect[4] -= 1.0;
        expect[9] = f32::NEG_INFINITY;
        for l in expect.iter_mut() {
            *l /= 0.7;
        }
        let max = expect.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = max
            + expect
                .iter()
                .map(|&l| (l as f64 - max).exp())
                .sum::<f64>()
                .ln();
        let logp = |i: usize| (expect[i] as f64 - lse) as f32;

        let mut s = Sampler::new(&p, 0);
        for _ in 0..20 {
            let mut row = raw.clone();
            let out = s.sample(&mut row, &prompt, &output, &suppress).unwrap();
            for (a, b) in row.iter().zip(&expect) {
                assert!(
                    a == b || (a - b).abs() < 1e-5,
                    "processed logits differ: {a} vs {b}"
                );
            }
            assert!((out.logprob - logp(out.token as usize)).abs() < 1e-5);
            assert_eq!(out.top_logprobs.len(), 5);
            let mut order: Vec<usize> = (0..expect.len()).collect();
            order.sort_by(|&a, &b| expect[b].total_cmp(&expect[a]));
            for (k, &(id, lp)) in out.top_logprobs.iter().enumerate() {
                assert_eq!(id as usize, order[k]);
                assert!((lp - logp(id as usize)).abs() < 1e-5);
            }
            assert_ne!(out.token, 9);
        }
    }

    #[test]
    fn no_logprobs_requested_gives_nan_and_empty() {
        let mut s = Sampler::new(&SamplingParams::default(), 0);
        let out = s.sample(&mut [0.0, 1.0], &[], &[], &[]).unwrap();
        assert_eq!(out.token, 1);
        assert!(out.logprob.is_nan());
        assert!(out.top_logprobs.is_empty());
    }

    #[test]
    fn greedy_ties_pick_lowest_id_and_logprob() {
        let p = params(|p| p.logprobs = 2);
        let mut s = Sampler::new(&p, 0);
        let out = s.sample(&mut [0.0, 2.0, 1.0, 2.0], &[], &[], &[]).unwrap();
        assert_eq!(out.token, 1);
        let lse = (1.0f64 + 2.0 * 2f64.exp() + 1f64.exp()).ln();
        assert!((out.logprob as f64 - (2.0 - lse)).abs() < 1e-6);
        assert_eq!(
            out.top_logprobs.iter().map(|x| x.0).collect::<Vec<_>>(),
            vec![1, 3]
        );
    }

    #[test]
    fn greedy_sees_penalties_and_bias() {
        let p = params(|p| p.repetition_penalty = 2.0);
        let mut s = Sampler::new(&p, 0);
        // 3.0 / 2 = 1.5 < 2.0
        assert_eq!(
            s.sample(&mut [0.0, 3.0, 2.0], &[1], &[], &[])
                .unwrap()
                .token,
            2
        );
        let p = params(|p| p.logit_bias = vec![(0, 5.0)]);
        let mut s = Sampler::new(&p, 0);
        assert_eq!(
            s.sample(&mut [0.0, 3.0, 2.0], &[], &[], &[]).unwrap().token,
            0
        );
    }

    #[test]
    fn suppressed_tokens_are_never_chosen() {
        let mut s = Sampler::new(&SamplingParams::default(), 0);
        assert_eq!(
            s.sample(&mut [0.0, 9.0, 1.0], &[], &[], &[1])
                .unwrap()
                .token,
            2
        );
        let p = params(|p| p.temperature = 1.0);
        let mut s = Sampler::new(&p, 3);
        for _ in 0..2000 {
            let mut row = LOGITS;
            let t = s.sample(&mut row, &[], &[], &[0, 1]).unwrap().token;
            assert!(t >= 2);
        }
    }

    #[test]
    fn degenerate_rows_do_not_panic() {
        let p = params(|p| {
            p.temperature = 1.0;
            p.top_p = 0.5;
            p.min_p = 0.1;
        });
        let mut s = Sampler::new(&p, 0);
        let neg = f32::NEG_INFINITY;
        assert_eq!(s.sample(&mut [neg, neg], &[], &[], &[]).unwrap().token, 0);
        assert_eq!(
            s.sample(&mut [f32::NAN, 1.0], &[], &[], &[]).unwrap().token,
            1
        );
        assert!(s.sample(&mut [], &[], &[], &[]).is_err());
        // Everything suppressed.
        assert_eq!(
            s.sample(&mut [1.0, 2.0], &[], &[], &[0, 1]).unwrap().token,
            0
        );
    }

    #[test]
    fn min_tokens_keeps_eos_and_stop_ids_away() {
        let (eos, stop) = (0u32, 1u32);
        let p = params(|p| {
            p.min_tokens = 4;
            p.stop_token_ids = vec![stop];
        });
        let mut s = Sampler::new(&p, 0);
        let mut out = Vec::new();
        let mut suppress = Vec::new();
        // EOS dominates, then the stop id, then token 2.
        let row = [5.0f32, 4.0, 3.0, 0.0];
        for _ in 0..6 {
            p.min_tokens_suppression(&[eos], out.len(), &mut suppress);
            let t = s
                .sample(&mut row.clone(), &[], &out, &suppress)
                .unwrap()
                .token;
            out.push(t);
        }
        assert_eq!(out, vec![2, 2, 2, 2, eos, eos]);

        let ignore = params(|q| {
            *q = p.clone();
            q.ignore_eos = true;
        });
        ignore.min_tokens_suppression(&[eos], 0, &mut suppress);
        assert_eq!(suppress, vec![stop]);
        p.min_tokens_suppression(&[eos], 4, &mut suppress);
        assert!(suppress.is_empty());
    }

    /// Applies a device row's edits and temperature the way the device
    /// kernel does (kernels/sampling.cu, stages 1-5).
    fn apply_device_row(logits: &mut [f32], row: &RowSampling, edits: &[(u32, f32)]) {
        for &(t, _) in &edits[row.repeated.clone()] {
            let p = row.repetition_penalty.unwrap();
            let l = &mut logits[t as usize];
            *l = if *l < 0.0 { *l * p } else { *l / p };
        }
        for &(t, v) in &edits[row.penalized.clone()] {
            logits[t as usize] -= v;
        }
        for &(t, v) in &edits[row.biased.clone()] {
            logits[t as usize] += v;
        }
        for &(t, _) in &edits[row.suppressed.clone()] {
            logits[t as usize] = f32::NEG_INFINITY;
        }
        if let Some(t) = row.temperature {
            logits.iter_mut().for_each(|l| *l /= t);
        }
    }

    #[test]
    fn device_rows_reproduce_the_stages_and_the_rng_stream() {
        let p = params(|p| {
            p.temperature = 0.7;
            p.top_k = 5;
            p.top_p = 0.8;
            p.min_p = 0.05;
            p.repetition_penalty = 1.3;
            p.presence_penalty = 0.4;
            p.frequency_penalty = 0.25;
            p.logit_bias = vec![(3, 1.5), (3, -0.5), (9, 2.0)];
        });
        let (mut host, mut device) = (Sampler::new(&p, 42), Sampler::new(&p, 42));
        let mut rng = Rng::seed_from_u64(42);
        let prompt = [1u32, 2, 2, 7];
        let mut output = vec![7u32, 4, 4, 4];
        let mut batch = DeviceSampling::default();
        for step in 0..5 {
            let suppress: &[u32] = if step < 2 { &[0, 11] } else { &[] };
            let mut processed = LOGITS;
            let sampled = host
                .sample(&mut processed, &prompt, &output, suppress)
                .unwrap();
            batch.clear();
            device.push_device_row(LOGITS.len(), &prompt, &output, suppress, &mut batch);
            let row = &batch.rows[0];
            let mut replay = LOGITS;
            apply_device_row(&mut replay, row, &batch.edits);
            assert_eq!(replay, processed, "step {step}");
            assert_eq!(row.u, rng.next_f64(), "step {step}: one uniform per draw");
            assert_eq!(row.top_k, Some(5));
            assert_eq!(row.min_p_floor, Some(0.05f32.ln()));
            output.push(sampled.token);
        }
        // Greedy rows draw nothing.
        let mut greedy = Sampler::new(&params(|p| p.repetition_penalty = 1.1), 42);
        batch.clear();
        greedy.push_device_row(LOGITS.len(), &prompt, &output, &[], &mut batch);
        assert_eq!((batch.rows[0].temperature, batch.rows[0].u), (None, 0.0));
        // Logprobs need the logits row on the host.
        assert!(device.samples_on_device());
        assert!(!Sampler::new(&params(|p| p.logprobs = 2), 0).samples_on_device());
    }
}
