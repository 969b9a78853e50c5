//! The request fields chat and completions share, parsed from JSON and
//! checked into the engine's `SamplingParams`. Every refusal names the
//! field it is about.

use super::error::ApiError;
use crate::engine_loop::MAX_CHOICES;
use crate::options::RequestDefaults;
use nanoinfer::engine::Constraint;
use nanoinfer::sampling::params::{
    LOGIT_BIAS_LIMIT, MAX_LOGPROBS, MAX_REPETITION_PENALTY, MAX_STOP_STRINGS, MAX_STOP_STRING_BYTES,
};
use nanoinfer::sampling::SamplingParams;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use std::collections::HashMap;

/// Parses a request body into the endpoint's own fields and the common
/// ones, naming the field of a type error. (Two passes over one parsed
/// value rather than `#[serde(flatten)]`, which loses the field's name.)
pub fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<(T, CommonFields), ApiError> {
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    }
    Ok((typed(&value)?, typed(&value)?))
}

fn typed<T: DeserializeOwned>(value: &serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ApiError::bad_request(format!("bad request body: {inner}"))
        } else {
            ApiError::invalid(path.clone(), format!("`{path}`: {inner}"))
        }
    })
}

#[derive(Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// `stop`: one string or a list of them.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

/// Fields both endpoints take: OpenAI's, then the engine's extra sampling
/// options (as vLLM takes them).
#[derive(Deserialize, Default)]
pub struct CommonFields {
    pub model: Option<String>,
    pub n: Option<u32>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub stop: Option<StopField>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub logit_bias: Option<HashMap<String, f32>>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub response_format: Option<serde_json::Value>,
    pub tools: Option<serde_json::Value>,
    pub tool_choice: Option<serde_json::Value>,
    pub functions: Option<serde_json::Value>,
    // The engine's extras.
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub min_tokens: Option<u32>,
    pub ignore_eos: Option<bool>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub priority: Option<i32>,
    /// `false` keeps this request from drafting tokens when the server
    /// speculates (`--speculative`).
    pub speculative: Option<bool>,
    // vLLM's structured-output extras.
    pub guided_json: Option<serde_json::Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
}

/// What the common fields ask of the response.
pub struct Shape {
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
}

impl CommonFields {
    /// Refuses what this server does not do, rather than ignoring it.
    pub fn refuse_unsupported(&self) -> Result<(), ApiError> {
        if self.tools.as_ref().is_some_and(|t| !t.is_null())
            || self.functions.as_ref().is_some_and(|t| !t.is_null())
        {
            return Err(ApiError::unsupported(
                "tools",
                "tool calling is not supported by this server",
            ));
        }
        if let Some(choice) = &self.tool_choice {
            if !(choice.is_null() || choice == "none") {
                return Err(ApiError::unsupported(
                    "tool_choice",
                    "tool calling is not supported by this server",
                ));
            }
        }
        Ok(())
    }

    /// The structured-output constraint the request asks for, with the
    /// field it came from (for errors): `response_format` (`json_object`,
    /// `json_schema`) or one of vLLM's `guided_*` fields, at most one.
    pub fn constraint(&self) -> Result<Option<(Constraint, &'static str)>, ApiError> {
        let mut found: Vec<(Constraint, &'static str)> = Vec::new();
        if let Some(format) = self.response_format.as_ref().filter(|f| !f.is_null()) {
            let param = "response_format";
            match format.get("type").and_then(|t| t.as_str()) {
                Some("text") => {}
                Some("json_object") => found.push((
                    Constraint::JsonSchema(r#"{"type": "object"}"#.into()),
                    param,
                )),
                Some("json_schema") => {
                    let schema = format
                        .get("json_schema")
                        .and_then(|j| j.get("schema"))
                        .ok_or_else(|| {
                            ApiError::invalid(
                                "response_format.json_schema.schema",
                                "`response_format` of type json_schema needs `json_schema.schema`",
                            )
                        })?;
                    found.push((Constraint::JsonSchema(schema.to_string()), param));
                }
                other => {
                    return Err(ApiError::invalid(
                        "response_format.type",
                        format!(
                        "`response_format.type` must be text, json_object or json_schema, got {}",
                        other.map_or("nothing".to_string(), |o| format!("`{o}`"))
                    ),
                    ))
                }
            }
        }
        if let Some(schema) = &self.guided_json {
            let text = match schema {
                serde_json::Value::String(s) => s.clone(),
                v => v.to_string(),
            };
            found.push((Constraint::JsonSchema(text), "guided_json"));
        }
        if let Some(r) = &self.guided_regex {
            found.push((Constraint::Regex(r.clone()), "guided_regex"));
        }
        if let Some(c) = &self.guided_choice {
            found.push((Constraint::Choice(c.clone()), "guided_choice"));
        }
        if let Some(g) = &self.guided_grammar {
            found.push((Constraint::Lark(g.clone()), "guided_grammar"));
        }
        if found.len() > 1 {
            return Err(ApiError::invalid(
                found[1].1,
                format!(
                    "give one structured-output field, not {}",
                    found.iter().map(|f| f.1).collect::<Vec<_>>().join(" and ")
                ),
            ));
        }
        Ok(found.pop())
    }

    pub fn shape(&self) -> Result<Shape, ApiError> {
        let n = self.n.unwrap_or(1) as usize;
        if !(1..=MAX_CHOICES).contains(&n) {
            return Err(ApiError::invalid(
                "n",
                format!("`n` must be between 1 and {MAX_CHOICES}, got {n}"),
            ));
        }
        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(ApiError::invalid(
                "stream_options",
                "`stream_options` is only allowed with `stream: true`",
            ));
        }
        Ok(Shape {
            n,
            stream,
            include_usage: self
                .stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
        })
    }

    /// The engine's sampling parameters for a prompt of `prompt_len`
    /// tokens, `logprobs` top alternatives per token (0: none) and at most
    /// `token_limit` tokens of prompt and output together.
    pub fn sampling(
        &self,
        defaults: &RequestDefaults,
        vocab: usize,
        prompt_len: usize,
        token_limit: usize,
        logprobs: u32,
        prompt_param: &str,
    ) -> Result<SamplingParams, ApiError> {
        let temperature = self.temperature.unwrap_or(defaults.temperature);
        check_range("temperature", temperature, 0.0, 2.0)?;
        let top_p = self.top_p.unwrap_or(defaults.top_p);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("`top_p` must be in (0, 1], got {top_p}"),
            ));
        }
        let presence = self.presence_penalty.unwrap_or(0.0);
        check_range("presence_penalty", presence, -2.0, 2.0)?;
        let frequency = self.frequency_penalty.unwrap_or(0.0);
        check_range("frequency_penalty", frequency, -2.0, 2.0)?;
        let min_p = self.min_p.unwrap_or(defaults.min_p);
        check_range("min_p", min_p, 0.0, 1.0)?;
        let repetition = self
            .repetition_penalty
            .unwrap_or(defaults.repetition_penalty);
        check_range(
            "repetition_penalty",
            repetition,
            f32::MIN_POSITIVE,
            MAX_REPETITION_PENALTY,
        )?;
        let top_k = self.top_k.unwrap_or(defaults.top_k);
        if top_k < -1 {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` must be -1 or 0 (off) or positive, got {top_k}"),
            ));
        }
        if logprobs > MAX_LOGPROBS {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("at most {MAX_LOGPROBS} top logprobs, got {logprobs}"),
            ));
        }

        let stop_strings = match &self.stop {
            None => vec![],
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(v)) => v.clone(),
        };
        if stop_strings.len() > MAX_STOP_STRINGS {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "at most {MAX_STOP_STRINGS} stop strings, got {}",
                    stop_strings.len()
                ),
            ));
        }
        if let Some(s) = stop_strings
            .iter()
            .find(|s| s.is_empty() || s.len() > MAX_STOP_STRING_BYTES)
        {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "a stop string must be 1 to {MAX_STOP_STRING_BYTES} bytes, got {} bytes",
                    s.len()
                ),
            ));
        }

        let mut logit_bias = Vec::new();
        for (key, &bias) in self.logit_bias.iter().flatten() {
            let param = format!("logit_bias.{key}");
            let id: u32 = key.trim().parse().map_err(|_| {
                ApiError::invalid(
                    param.clone(),
                    format!("`logit_bias` keys are token ids, got `{key}`"),
                )
            })?;
            if id as usize >= vocab {
                return Err(ApiError::invalid(
                    param,
                    format!("token id {id} is outside the vocabulary (size {vocab})"),
                ));
            }
            check_range(&param, bias, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)?;
            logit_bias.push((id, bias));
        }
        logit_bias.sort_by_key(|&(id, _)| id);

        let stop_token_ids = self.stop_token_ids.clone().unwrap_or_default();
        if let Some(&bad) = stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid(
                "stop_token_ids",
                format!("token id {bad} is outside the vocabulary (size {vocab})"),
            ));
        }

        if prompt_len >= token_limit {
            return Err(ApiError::context_length(
                prompt_param,
                format!(
                    "This model's maximum context length is {token_limit} tokens, and the prompt has {prompt_len}: \
                     shorten it to leave room for at least one generated token"
                ),
            ));
        }
        let room = (token_limit - prompt_len) as u32;
        let (max_param, asked) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) => ("max_completion_tokens", Some(m)),
            (None, m) => ("max_tokens", m),
        };
        let max_tokens = match asked.or(defaults.max_tokens) {
            Some(0) => {
                return Err(ApiError::invalid(
                    max_param,
                    format!("`{max_param}` must be at least 1"),
                ))
            }
            Some(m) if m > room => {
                return Err(ApiError::context_length(
                    max_param,
                    format!(
                        "This model's maximum context length is {token_limit} tokens. However, you requested \
                         {} tokens ({prompt_len} in the prompt, {m} for the completion). Reduce the prompt or `{max_param}`",
                        prompt_len as u64 + m as u64
                    ),
                ));
            }
            Some(m) => m,
            None => room,
        };
        let min_tokens = self.min_tokens.unwrap_or(0);
        if min_tokens > max_tokens {
            return Err(ApiError::invalid(
                "min_tokens",
                format!("`min_tokens` ({min_tokens}) must not exceed the maximum ({max_tokens})"),
            ));
        }
        Ok(SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty: repetition,
            presence_penalty: presence,
            frequency_penalty: frequency,
            logit_bias,
            seed: self.seed.map(|s| s as u64).or(defaults.seed),
            max_tokens,
            min_tokens,
            stop_token_ids,
            stop_strings,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            logprobs,
        })
    }
}

fn check_range(param: &str, v: f32, lo: f32, hi: f32) -> Result<(), ApiError> {
    if v.is_finite() && v >= lo && v <= hi {
        Ok(())
    } else {
        Err(ApiError::invalid(
            param,
            format!("`{param}` must be between {lo} and {hi}, got {v}"),
        ))
    }
}

/// The seed of choice `i` of a seeded request: each choice its own stream
/// of random numbers, all reproducible.
pub fn seed_for_choice(seed: Option<u64>, i: usize) -> Option<u64> {
    seed.map(|s| s.wrapping_add(i as u64))
}
