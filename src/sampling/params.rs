//! Per-request sampling parameters, their validation, and the resolved
//! `SamplingPlan` (which stages are active) that a sampler executes.

use crate::{bail_arg, Result};

/// Temperatures below this are treated as greedy (as in vLLM): dividing by a
/// near-zero temperature would only overflow the logits.
pub const GREEDY_TEMPERATURE_EPS: f32 = 1e-5;
/// Largest accepted repetition penalty.
pub const MAX_REPETITION_PENALTY: f32 = 10.0;
/// Presence and frequency penalties must lie in [-LIMIT, LIMIT] (OpenAI's range).
pub const PRESENCE_FREQUENCY_LIMIT: f32 = 2.0;
/// Logit biases must lie in [-LIMIT, LIMIT] (OpenAI's range; -100 effectively bans).
pub const LOGIT_BIAS_LIMIT: f32 = 100.0;
pub const MAX_STOP_STRINGS: usize = 16;
pub const MAX_STOP_STRING_BYTES: usize = 256;
pub const MAX_LOGPROBS: u32 = 20;

/// What a request asks of the sampler. `Default` is greedy decoding of up to
/// 256 tokens with every other stage off.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy (argmax); otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (and ties with the k-th); 0 = off.
    pub top_k: i32,
    /// Nucleus: keep the smallest prefix of the sorted distribution whose mass
    /// reaches `top_p`; 1 = off.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the top one; 0 = off.
    pub min_p: f32,
    /// HF semantics: for each distinct token seen in prompt + output, positive
    /// logits are divided by it and negative ones multiplied; 1 = off.
    pub repetition_penalty: f32,
    /// OpenAI semantics over output tokens: subtracted once from every token
    /// that occurred in the output.
    pub presence_penalty: f32,
    /// OpenAI semantics over output tokens: subtracted once per occurrence.
    pub frequency_penalty: f32,
    /// Added to the logit of each listed token (after penalties).
    pub logit_bias: Vec<(u32, f32)>,
    /// Own reproducible RNG stream; `None` uses the engine's fallback seed.
    pub seed: Option<u64>,
    pub max_tokens: u32,
    /// EOS and stop tokens are suppressed until this many tokens were generated.
    pub min_tokens: u32,
    pub stop_token_ids: Vec<u32>,
    pub stop_strings: Vec<String>,
    pub ignore_eos: bool,
    /// Number of top alternatives to return (0-20); when > 0 the sampled
    /// token's logprob is returned too.
    pub logprobs: u32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
            max_tokens: 256,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
            logprobs: 0,
        }
    }
}

impl SamplingParams {
    /// Checks every parameter against its documented range; the error names
    /// the parameter and the offending value.
    pub fn validate(&self, vocab_size: usize) -> Result<()> {
        let t = self.temperature;
        if !t.is_finite() || t < 0.0 {
            bail_arg!("temperature must be a finite number >= 0, got {t}");
        }
        if self.top_k < 0 {
            bail_arg!("top_k must be >= 0 (0 = off), got {}", self.top_k);
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            bail_arg!("top_p must be in (0, 1] (1 = off), got {p}");
        }
        let m = self.min_p;
        if !(0.0..=1.0).contains(&m) {
            bail_arg!("min_p must be in [0, 1] (0 = off), got {m}");
        }
        let r = self.repetition_penalty;
        if !(r > 0.0 && r <= MAX_REPETITION_PENALTY) {
            bail_arg!(
                "repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}] (1 = off), got {r}"
            );
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-PRESENCE_FREQUENCY_LIMIT..=PRESENCE_FREQUENCY_LIMIT).contains(&v) {
                bail_arg!(
                    "{name} must be in [-{PRESENCE_FREQUENCY_LIMIT}, {PRESENCE_FREQUENCY_LIMIT}], got {v}"
                );
            }
        }
        self.validate_logit_bias(vocab_size)?;
        for &id in &self.stop_token_ids {
            if id as usize >= vocab_size {
                bail_arg!(
                    "stop_token_ids: token id {id} is out of range (vocab size {vocab_size})"
                );
            }
        }
        self.validate_stop_strings()?;
        if self.logprobs > MAX_LOGPROBS {
            bail_arg!(
                "logprobs must be in [0, {MAX_LOGPROBS}], got {}",
                self.logprobs
            );
        }
        if self.max_tokens == 0 {
            bail_arg!("max_tokens must be >= 1, got 0");
        }
        if self.min_tokens > self.max_tokens {
            bail_arg!(
                "min_tokens ({}) must not exceed max_tokens ({})",
                self.min_tokens,
                self.max_tokens
            );
        }
        Ok(())
    }

    fn validate_logit_bias(&self, vocab_size: usize) -> Result<()> {
        if self.logit_bias.len() > vocab_size {
            bail_arg!(
                "logit_bias has {} entries, more than the {vocab_size} distinct ids of the vocabulary",
                self.logit_bias.len()
            );
        }
        for &(id, bias) in &self.logit_bias {
            if id as usize >= vocab_size {
                bail_arg!("logit_bias: token id {id} is out of range (vocab size {vocab_size})");
            }
            if !(-LOGIT_BIAS_LIMIT..=LOGIT_BIAS_LIMIT).contains(&bias) {
                bail_arg!(
                    "logit_bias: bias for token {id} must be in [-{LOGIT_BIAS_LIMIT}, {LOGIT_BIAS_LIMIT}], got {bias}"
                );
            }
        }
        let mut ids: Vec<u32> = self.logit_bias.iter().map(|&(id, _)| id).collect();
        ids.sort_unstable();
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            bail_arg!("logit_bias: token id {} is listed more than once", w[0]);
        }
        Ok(())
    }

    fn validate_stop_strings(&self) -> Result<()> {
        let n = self.stop_strings.len();
        if n > MAX_STOP_STRINGS {
            bail_arg!("stop_strings: at most {MAX_STOP_STRINGS} allowed, got {n}");
        }
        for (i, s) in self.stop_strings.iter().enumerate() {
            if s.is_empty() {
                bail_arg!("stop_strings[{i}] is empty");
            }
            if s.len() > MAX_STOP_STRING_BYTES {
                bail_arg!(
                    "stop_strings[{i}] is {} bytes long, at most {MAX_STOP_STRING_BYTES} allowed",
                    s.len()
                );
            }
        }
        Ok(())
    }

    /// Fills `out` with the ids to pass as `Sampler::sample`'s `suppress`
    /// when `output_len` tokens were generated so far: while
    /// `output_len < min_tokens`, the EOS ids (unless `ignore_eos`) and the
    /// stop token ids; otherwise nothing (as vLLM's min_tokens).
    pub fn min_tokens_suppression(&self, eos_ids: &[u32], output_len: usize, out: &mut Vec<u32>) {
        out.clear();
        if output_len >= self.min_tokens as usize {
            return;
        }
        if !self.ignore_eos {
            out.extend_from_slice(eos_ids);
        }
        out.extend_from_slice(&self.stop_token_ids);
    }

    /// Resolves which processing stages are active.
    pub fn plan(&self) -> SamplingPlan {
        SamplingPlan::from_params(self)
    }
}

/// The active stages of the fixed processing chain, with their parameters
/// (a stage that is off is `None`). This is the whole per-request description a
/// sampler implementation needs besides logit bias and the token history, so a
/// batched device sampler can consume the same plan.
///
/// Order (see `processors`): repetition penalty → presence/frequency penalty →
/// logit bias → min_tokens suppression → temperature → top-k → top-p → min-p →
/// draw. With `temperature == None` the token is the argmax after suppression.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingPlan {
    pub repetition_penalty: Option<f32>,
    /// (presence, frequency)
    pub presence_frequency: Option<(f32, f32)>,
    /// `None` = greedy.
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
}

impl SamplingPlan {
    pub fn from_params(p: &SamplingParams) -> Self {
        let greedy = p.temperature.is_nan() || p.temperature < GREEDY_TEMPERATURE_EPS;
        SamplingPlan {
            repetition_penalty: (p.repetition_penalty != 1.0).then_some(p.repetition_penalty),
            presence_frequency: (p.presence_penalty != 0.0 || p.frequency_penalty != 0.0)
                .then_some((p.presence_penalty, p.frequency_penalty)),
            temperature: (!greedy).then_some(p.temperature),
            top_k: (p.top_k > 0).then_some(p.top_k as usize),
            top_p: (p.top_p < 1.0).then_some(p.top_p),
            min_p: (p.min_p > 0.0).then_some(p.min_p),
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature.is_none()
    }

    /// Whether the token history (seen set / output counts) is needed.
    pub fn needs_history(&self) -> bool {
        self.repetition_penalty.is_some() || self.presence_frequency.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    fn err(p: &SamplingParams) -> String {
        let e = p.validate(100).expect_err("expected a validation error");
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        e.message
    }

    fn with(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p
    }

    #[test]
    fn default_is_valid_and_greedy() {
        let p = SamplingParams::default();
        p.validate(100).unwrap();
        let plan = p.plan();
        assert!(plan.is_greedy());
        assert!(!plan.needs_history());
        assert_eq!(plan.top_k, None);
        assert_eq!(plan.top_p, None);
        assert_eq!(plan.min_p, None);
    }

    #[test]
    fn errors_name_parameter_and_value() {
        let cases: Vec<(SamplingParams, &[&str])> = vec![
            (with(|p| p.temperature = f32::NAN), &["temperature", "NaN"]),
            (
                with(|p| p.temperature = f32::INFINITY),
                &["temperature", "inf"],
            ),
            (with(|p| p.temperature = -0.5), &["temperature", "-0.5"]),
            (with(|p| p.top_k = -1), &["top_k", "-1"]),
            (with(|p| p.top_p = 0.0), &["top_p", "0"]),
            (with(|p| p.top_p = 1.5), &["top_p", "1.5"]),
            (with(|p| p.top_p = f32::NAN), &["top_p", "NaN"]),
            (with(|p| p.min_p = -0.1), &["min_p", "-0.1"]),
            (with(|p| p.min_p = 1.1), &["min_p", "1.1"]),
            (
                with(|p| p.repetition_penalty = 0.0),
                &["repetition_penalty", "0"],
            ),
            (
                with(|p| p.repetition_penalty = f32::NAN),
                &["repetition_penalty", "NaN"],
            ),
            (
                with(|p| p.repetition_penalty = 11.0),
                &["repetition_penalty", "11"],
            ),
            (
                with(|p| p.presence_penalty = 2.5),
                &["presence_penalty", "2.5"],
            ),
            (
                with(|p| p.frequency_penalty = -3.0),
                &["frequency_penalty", "-3"],
            ),
            (
                with(|p| p.frequency_penalty = f32::NAN),
                &["frequency_penalty", "NaN"],
            ),
            (
                with(|p| p.logit_bias = vec![(100, 1.0)]),
                &["logit_bias", "100"],
            ),
            (
                with(|p| p.logit_bias = vec![(3, f32::INFINITY)]),
                &["logit_bias", "inf"],
            ),
            (
                with(|p| p.logit_bias = vec![(3, f32::NAN)]),
                &["logit_bias", "NaN"],
            ),
            (
                with(|p| p.logit_bias = vec![(3, 1.0), (3, 2.0)]),
                &["logit_bias", "3"],
            ),
            (
                with(|p| p.stop_token_ids = vec![5, 100]),
                &["stop_token_ids", "100"],
            ),
            (
                with(|p| p.stop_strings = vec!["x".into(); 17]),
                &["stop_strings", "17"],
            ),
            (
                with(|p| p.stop_strings = vec!["a".into(), String::new()]),
                &["stop_strings[1]"],
            ),
            (
                with(|p| p.stop_strings = vec!["y".repeat(257)]),
                &["stop_strings[0]", "257"],
            ),
            (with(|p| p.logprobs = 21), &["logprobs", "21"]),
            (with(|p| p.max_tokens = 0), &["max_tokens", "0"]),
            (
                with(|p| {
                    p.min_tokens = 10;
                    p.max_tokens = 5
                }),
                &["min_tokens", "10", "max_tokens", "5"],
            ),
        ];
        for (p, needles) in cases {
            let msg = err(&p);
            for n in needles {
                assert!(msg.contains(n), "message {msg:?} should contain {n:?}");
            }
        }
    }

    #[test]
    fn boundary_values_are_accepted() {
        let p = with(|p| {
            p.temperature = 2.0;
            p.top_k = 1000;
            p.top_p = 1.0;
            p.min_p = 1.0;
            p.repetition_penalty = MAX_REPETITION_PENALTY;
            p.presence_penalty = -2.0;
            p.frequency_penalty = 2.0;
            p.logit_bias = vec![(0, -100.0), (99, 100.0)];
            p.stop_strings = vec!["z".repeat(256); 16];
            p.logprobs = 20;
            p.max_tokens = 3;
            p.min_tokens = 3;
        });
        p.validate(100).unwrap();
    }

    #[test]
    fn plan_resolves_active_stages() {
        let p = with(|p| {
            p.temperature = 0.7;
            p.top_k = 5;
            p.top_p = 0.9;
            p.min_p = 0.05;
            p.repetition_penalty = 1.2;
            p.frequency_penalty = 0.5;
        });
        let plan = p.plan();
        assert_eq!(plan.temperature, Some(0.7));
        assert_eq!(plan.top_k, Some(5));
        assert_eq!(plan.top_p, Some(0.9));
        assert_eq!(plan.min_p, Some(0.05));
        assert_eq!(plan.repetition_penalty, Some(1.2));
        assert_eq!(plan.presence_frequency, Some((0.0, 0.5)));
        assert!(with(|p| p.temperature = 1e-6).plan().is_greedy());
    }
}
