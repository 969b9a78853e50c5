//! What a caller submits (`RequestParams`) and what the session reports back
//! (`Event`, `FinishReason`, `Usage`).

use crate::sampling::SamplingParams;

pub type RequestId = u64;

/// A generation request. The prompt is token ids; text prompts are
/// tokenized by the caller-facing layers (CLI, C ABI) before this point.
#[derive(Debug, Clone, Default)]
pub struct RequestParams {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Lower is more urgent (vLLM convention). Only the priority policy uses it.
    pub priority: i32,
    /// Requests share cached prefixes only with requests of the same salt.
    pub cache_salt: u64,
    /// Structured output: every generated token keeps the output a prefix
    /// of something this constraint matches, and end-of-sequence comes only
    /// once it is a full match.
    pub constraint: Option<Constraint>,
    /// Keep the request's state (tokens, KV, sampler) in host memory when
    /// it ends, so `Session::save_state` can still save it; freed by
    /// `Session::release_state`. A running request can be saved without it.
    pub retain_state: bool,
    /// Never draft tokens for this request, even when the session
    /// speculates (`SessionParams::speculative`).
    pub disable_speculation: bool,
}

/// What a structured-output request's text must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Constraint {
    /// A JSON Schema (the schema's JSON text).
    JsonSchema(String),
    /// A regular expression the whole output matches.
    Regex(String),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

impl Constraint {
    /// The name errors give it (the CLI's and the server's field names).
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonSchema(_) => "json_schema",
            Constraint::Regex(_) => "regex",
            Constraint::Lark(_) => "grammar",
            Constraint::Choice(_) => "choice",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token of the model was generated.
    Eos,
    /// One of the request's stop token ids was generated.
    StopToken(u32),
    /// Stop string number `i` of the request matched.
    StopString(usize),
    /// `max_tokens` or the model's context length was reached.
    Length,
    /// Like `Length`, for a structured-output request whose output was not
    /// yet a full match of its constraint (a JSON object still open...).
    LengthUnfinished,
    /// The caller cancelled the request.
    Cancelled,
    /// The request failed; the message says why.
    Error(String),
}

impl FinishReason {
    /// The OpenAI-style short name ("stop", "length", "cancelled", "error").
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Eos | FinishReason::StopToken(_) | FinishReason::StopString(_) => "stop",
            FinishReason::Length | FinishReason::LengthUnfinished => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Error(_) => "error",
        }
    }
}

/// Log-probability of a generated token and its top alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// What one request used, reported with its terminal event so callers need
/// not re-tokenize or time requests themselves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Tokens of the prompt the request was added with.
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV the prefix cache supplied when the request was
    /// first admitted, so they were not computed for it (OpenAI's
    /// `prompt_tokens_details.cached_tokens`). A whole number of the KV
    /// manager's blocks, at most `prompt_tokens - 1` (the last prompt token
    /// is always computed); 0 with prefix caching off or for a request that
    /// ended before admission. Fixed at the first admission: resuming after
    /// a preemption (recompute or swap) neither adds the prefix found then
    /// nor subtracts what is computed again.
    pub cached_prompt_tokens: usize,
    /// Tokens the request's events carried, all of them together.
    pub generated_tokens: usize,
    /// Nanoseconds from adding the request to the end of the step that
    /// reported its first generated token; 0 when it generated none.
    pub time_to_first_token_ns: u64,
    /// Nanoseconds from adding the request to the end of the step that
    /// reported its terminal event (for a cancellation: the step after the
    /// cancel, which delivers it).
    pub total_time_ns: u64,
}

/// What happened to one request during one step. A request gets at most one
/// event per step, and exactly one event with `finish` set over its life.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub request_id: RequestId,
    /// Tokens generated this step (usually one; none for a pure prefill chunk).
    pub tokens: Vec<u32>,
    /// Text that became final this step (UTF-8 complete, stop strings removed).
    pub text: String,
    /// One entry per token when the request asked for logprobs.
    pub logprobs: Vec<TokenLogprob>,
    pub finish: Option<FinishReason>,
    /// The request's usage: set on the terminal event only.
    pub usage: Option<Usage>,
}
