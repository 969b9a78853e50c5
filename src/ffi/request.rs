//! `ni_request_params`: what `ni_session_add_request` takes, and its
//! conversion into the engine's `RequestParams`.

use super::args;
use super::boundary::ffi_value;
use super::text::{chat_messages, ni_chat_message};
use crate::engine::grammar::{MAX_CHOICES, MAX_CONSTRAINT_BYTES};
use crate::engine::{Constraint, Model, RequestParams};
use crate::sampling::params::{MAX_STOP_STRINGS, MAX_STOP_STRING_BYTES};
use crate::sampling::SamplingParams;
use crate::tokenizer::EncodeOptions;
use crate::{bail_arg, Result};
use std::ffi::c_char;

/// A bias added to one token's logit.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ni_logit_bias {
    pub token: u32,
    /// In [-100, 100]; -100 effectively bans the token.
    pub bias: f32,
}

/// One generation request. Fill with `ni_request_params_init`, then set the
/// prompt and change what you need. All arrays and strings are copied by
/// `ni_session_add_request`; they need to live only during that call.
///
/// The prompt is exactly one of: token ids (`prompt_tokens`); text
/// (`prompt_text`, tokenized with the model's tokenizer); or a conversation
/// (`messages`, rendered with the model's chat template and tokenized). Only
/// `messages` keeps text from users from becoming control tokens: their
/// contents and roles stay plain text while the template's own special
/// tokens stay special. `prompt_text` reads special-token text as special
/// tokens unless `parse_special` is false. Sampling runs the fixed
/// chain repetition penalty → presence/frequency penalty → logit bias →
/// temperature → top-k → top-p → min-p → draw. Invalid values are rejected by
/// `ni_session_add_request` with `NI_ERR_INVALID_ARGUMENT` and a message
/// naming the parameter.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ni_request_params {
    /// `sizeof(ni_request_params)`, set by `ni_request_params_init`.
    pub struct_size: u32,
    /// Prompt token ids (NULL with `n_prompt_tokens` 0 when `prompt_text` is
    /// used); at most the model's context length.
    pub prompt_tokens: *const u32,
    pub n_prompt_tokens: usize,
    /// Prompt text, `prompt_text_len` bytes of UTF-8 (no NUL needed); NULL
    /// when `prompt_tokens` is used. Text longer than the context length ×
    /// the tokenizer's longest token in bytes cannot fit and is refused
    /// before it is tokenized.
    pub prompt_text: *const c_char,
    pub prompt_text_len: usize,
    /// Tokenize `prompt_text` with the tokenizer's special tokens (e.g. BOS).
    /// Default false: right for text from `ni_apply_chat_template`. Must be
    /// false with `messages` (the chat template writes its own).
    pub add_special_tokens: bool,
    /// Most tokens to generate, >= 1. Default 256.
    pub max_tokens: u32,
    /// EOS and stop tokens are suppressed until this many were generated. Default 0.
    pub min_tokens: u32,
    /// 0 = greedy (default); otherwise logits are divided by it. Finite, >= 0.
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 = off (default). >= 0.
    pub top_k: i32,
    /// Nucleus sampling mass in (0, 1]; 1 = off (default).
    pub top_p: f32,
    /// Drop tokens below min_p times the top probability, in [0, 1]; 0 = off (default).
    pub min_p: f32,
    /// HF repetition penalty over prompt + output, in (0, 10]; 1 = off (default).
    pub repetition_penalty: f32,
    /// OpenAI presence penalty in [-2, 2]; 0 = off (default).
    pub presence_penalty: f32,
    /// OpenAI frequency penalty in [-2, 2]; 0 = off (default).
    pub frequency_penalty: f32,
    /// Per-token logit biases (distinct ids in the vocabulary, so at most
    /// `vocab_size` entries).
    pub logit_bias: *const ni_logit_bias,
    pub n_logit_bias: usize,
    /// Seed of the request's own random stream when `use_seed` is true, so the
    /// same request gives the same tokens regardless of other requests.
    /// Otherwise (default) the stream is seeded from the session's seed.
    pub seed: u64,
    pub use_seed: bool,
    /// Token ids that end generation (the stop token is emitted); at most
    /// `vocab_size` entries.
    pub stop_token_ids: *const u32,
    pub n_stop_token_ids: usize,
    /// NUL-terminated UTF-8 stop strings (at most 16, each 1-256 bytes). A
    /// match ends generation; the stop text itself is not emitted.
    pub stop_strings: *const *const c_char,
    pub n_stop_strings: usize,
    /// Keep generating after an end-of-sequence token. Default false.
    pub ignore_eos: bool,
    /// Number of top alternatives (0-20) to return with each token's logprob;
    /// 0 (default) returns no logprobs.
    pub logprobs: u32,
    /// Scheduling priority under `NI_SCHEDULE_PRIORITY`: lower is more urgent.
    /// Default 0.
    pub priority: i32,
    /// Requests share cached prompt prefixes only with requests of the same
    /// salt (tenant isolation). Default 0.
    pub cache_salt: u64,
    /// Read special-token text in `prompt_text` (e.g. `<|im_end|>`) as those
    /// special tokens. Default true, because text rendered by
    /// `ni_apply_chat_template` holds the template's turn markers as text and
    /// needs them read as tokens. The risk: whatever user text was pasted
    /// into such a prompt can then close its turn and forge system or
    /// assistant turns. Prefer `messages`, which protects message text; set
    /// false for raw user text, which is then tokenized as ordinary text
    /// (transformers' `split_special_tokens=True`). Callers built before this
    /// field existed get true.
    pub parse_special: bool,
    /// The prompt as a conversation of `n_messages` messages (NULL with 0
    /// otherwise), rendered with the model's chat template and tokenized as
    /// `ni_tokenize_chat` does: special-token text inside the messages stays
    /// plain text. Roles and contents are copied during the call.
    pub messages: *const ni_chat_message,
    pub n_messages: usize,
    /// With `messages`: end the prompt with the assistant turn's opening, so
    /// that the model answers. Default true.
    pub add_generation_prompt: bool,
    /// Structured output: with `constraint_kind` `NI_CONSTRAINT_JSON_SCHEMA`,
    /// `NI_CONSTRAINT_REGEX` or `NI_CONSTRAINT_GRAMMAR` (llguidance's Lark
    /// dialect), the NUL-terminated schema, regex or grammar (at most 1 MiB).
    /// Every generated token keeps the text a prefix of a match; it ends
    /// (`NI_FINISH_EOS`) only on a full match, and `NI_FINISH_LENGTH_UNFINISHED`
    /// when `max_tokens` runs out before one. Copied during the call.
    pub constraint: *const c_char,
    /// With `NI_CONSTRAINT_CHOICE`: `n_choices` NUL-terminated strings, the
    /// output being exactly one of them.
    pub choices: *const *const c_char,
    pub n_choices: usize,
    /// Which of the above applies; `NI_CONSTRAINT_NONE` (default): none.
    /// A bad schema, regex or grammar fails `ni_session_add_request` with
    /// `NI_ERR_INVALID_ARGUMENT` naming the problem.
    pub constraint_kind: ni_constraint_kind,
    /// Unused, 0. It fills the padding that ended the struct before
    /// `retain_state`, so that field starts past the older struct's end and
    /// an older caller's padding bytes are never read as it.
    pub reserved0: u32,
    /// Keep the request's state (tokens, KV, sampler position) when it
    /// ends, so `ni_session_save_state` can save it afterwards; freed by
    /// `ni_session_release_state` or with the session. Default false (a
    /// running request can be saved without it).
    pub retain_state: bool,
    /// Unused, 0: fills the padding that ended the struct before
    /// `disable_speculation` (see `reserved0`).
    pub reserved1: [u8; 7],
    /// Never draft tokens for this request, even when the session
    /// speculates (`ni_session_params.speculative_method`). Default false.
    pub disable_speculation: bool,
}

/// What a structured-output request's text must match.
pub type ni_constraint_kind = u32;
pub const NI_CONSTRAINT_NONE: ni_constraint_kind = 0;
pub const NI_CONSTRAINT_JSON_SCHEMA: ni_constraint_kind = 1;
pub const NI_CONSTRAINT_REGEX: ni_constraint_kind = 2;
pub const NI_CONSTRAINT_GRAMMAR: ni_constraint_kind = 3;
pub const NI_CONSTRAINT_CHOICE: ni_constraint_kind = 4;

/// `sizeof(ni_request_params)` before `parse_special` and the chat fields
/// were appended; such callers are still accepted with those fields at their
/// defaults (see `args::params_versioned`).
pub(crate) const NI_REQUEST_PARAMS_SIZE_V1: usize =
    std::mem::offset_of!(ni_request_params, parse_special);

/// `sizeof(ni_request_params)` before the structured-output fields.
pub(crate) const NI_REQUEST_PARAMS_SIZE_V2: usize =
    std::mem::offset_of!(ni_request_params, constraint);

/// `sizeof(ni_request_params)` before `retain_state`.
pub(crate) const NI_REQUEST_PARAMS_SIZE_V3: usize =
    std::mem::offset_of!(ni_request_params, retain_state);

/// `sizeof(ni_request_params)` before `disable_speculation`.
pub(crate) const NI_REQUEST_PARAMS_SIZE_V4: usize =
    std::mem::offset_of!(ni_request_params, disable_speculation);

const _: () = assert!(
    NI_REQUEST_PARAMS_SIZE_V4 == std::mem::offset_of!(ni_request_params, retain_state) + 8,
    "disable_speculation must start where the struct ended before it"
);

const _: () = assert!(
    NI_REQUEST_PARAMS_SIZE_V3 == std::mem::offset_of!(ni_request_params, constraint_kind) + 8,
    "retain_state must start where the struct ended before it"
);

impl args::Appendable for ni_request_params {
    const OLDER_SIZES: &'static [usize] = &[
        NI_REQUEST_PARAMS_SIZE_V1,
        NI_REQUEST_PARAMS_SIZE_V2,
        NI_REQUEST_PARAMS_SIZE_V3,
        NI_REQUEST_PARAMS_SIZE_V4,
    ];
}

impl Default for ni_request_params {
    fn default() -> Self {
        let s = SamplingParams::default();
        ni_request_params {
            struct_size: size_of::<ni_request_params>() as u32,
            prompt_tokens: std::ptr::null(),
            n_prompt_tokens: 0,
            prompt_text: std::ptr::null(),
            prompt_text_len: 0,
            add_special_tokens: false,
            max_tokens: s.max_tokens,
            min_tokens: s.min_tokens,
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            repetition_penalty: s.repetition_penalty,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            logit_bias: std::ptr::null(),
            n_logit_bias: 0,
            seed: 0,
            use_seed: false,
            stop_token_ids: std::ptr::null(),
            n_stop_token_ids: 0,
            stop_strings: std::ptr::null(),
            n_stop_strings: 0,
            ignore_eos: s.ignore_eos,
            logprobs: s.logprobs,
            priority: 0,
            cache_salt: 0,
            parse_special: true,
            messages: std::ptr::null(),
            n_messages: 0,
            add_generation_prompt: true,
            constraint: std::ptr::null(),
            choices: std::ptr::null(),
            n_choices: 0,
            constraint_kind: NI_CONSTRAINT_NONE,
            reserved0: 0,
            retain_state: false,
            reserved1: [0; 7],
            disable_speculation: false,
        }
    }
}

/// Fills `params` with the defaults (greedy, 256 tokens, no stops, priority
/// 0, no prompt) and sets `struct_size`. NULL is a no-op.
///
/// Thread-safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn ni_request_params_init(params: *mut ni_request_params) {
    ffi_value("ni_request_params_init", (), || {
        if let Ok(p) = args::out_ptr(params, "params") {
            // SAFETY: non-NULL and aligned (checked); the caller provides room for the struct.
            unsafe { p.write(ni_request_params::default()) };
        }
    })
}

/// Copies the caller's request into engine parameters, tokenizing a text
/// prompt. Range checks of sampling values are left to the engine, which
/// names the parameter in its error.
///
/// # Safety
/// Every pointer in `p` must honour its documented contract.
pub(crate) unsafe fn to_engine(p: &ni_request_params, model: &Model) -> Result<RequestParams> {
    let context = model.config().max_position_embeddings;
    let vocab = model.config().vocab_size;
    // Counts are checked before anything is copied or tokenized; the
    // engine's own checks (ranges, duplicates, prompt + max_tokens against
    // the context and the KV capacity) follow on the copies.
    for (name, n, limit, max) in [
        (
            "n_prompt_tokens",
            p.n_prompt_tokens,
            "the model's context length",
            context,
        ),
        ("n_logit_bias", p.n_logit_bias, "the vocabulary size", vocab),
        (
            "n_stop_token_ids",
            p.n_stop_token_ids,
            "the vocabulary size",
            vocab,
        ),
        (
            "n_stop_strings",
            p.n_stop_strings,
            "the limit of",
            MAX_STOP_STRINGS,
        ),
    ] {
        if n > max {
            bail_arg!("request.{name} is {n}, more than {limit} {max}");
        }
    }
    // SAFETY: forwarded contract.
    let prompt = unsafe { prompt(p, model, context)? };
    // SAFETY: forwarded contract.
    let bias = unsafe { args::slice(p.logit_bias, p.n_logit_bias, "request.logit_bias")? };
    // SAFETY: forwarded contract.
    let stop_ids = unsafe {
        args::slice(
            p.stop_token_ids,
            p.n_stop_token_ids,
            "request.stop_token_ids",
        )?
    };
    // SAFETY: forwarded contract.
    let stop_ptrs =
        unsafe { args::slice(p.stop_strings, p.n_stop_strings, "request.stop_strings")? };
    let mut stop_strings = Vec::with_capacity(stop_ptrs.len());
    for (i, &s) in stop_ptrs.iter().enumerate() {
        let what = format!("request.stop_strings[{i}]");
        // SAFETY: each entry is a NUL-terminated string (contract).
        let bytes = unsafe { args::cstr_bytes(s, &what)? };
        if bytes.len() > MAX_STOP_STRING_BYTES {
            bail_arg!(
                "{what} is {} bytes long, at most {MAX_STOP_STRING_BYTES} allowed",
                bytes.len()
            );
        }
        // SAFETY: as above.
        stop_strings.push(unsafe { args::cstr(s, &what)? }.to_string());
    }
    Ok(RequestParams {
        prompt,
        sampling: SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            logit_bias: bias.iter().map(|b| (b.token, b.bias)).collect(),
            seed: p.use_seed.then_some(p.seed),
            max_tokens: p.max_tokens,
            min_tokens: p.min_tokens,
            stop_token_ids: stop_ids.to_vec(),
            stop_strings,
            ignore_eos: p.ignore_eos,
            logprobs: p.logprobs,
        },
        priority: p.priority,
        cache_salt: p.cache_salt,
        // SAFETY: forwarded contract.
        constraint: unsafe { constraint(p)? },
        retain_state: p.retain_state,
        disable_speculation: p.disable_speculation,
    })
}

/// The structured-output constraint `p` asks for.
///
/// # Safety
/// `p.constraint` and `p.choices` must honour their documented contract.
unsafe fn constraint(p: &ni_request_params) -> Result<Option<Constraint>> {
    let text = |what: &str| -> Result<String> {
        if p.constraint.is_null() {
            bail_arg!("request.constraint is NULL, and {what} needs the text");
        }
        // SAFETY: a NUL-terminated string (contract).
        let bytes = unsafe { args::cstr_bytes(p.constraint, "request.constraint")? };
        if bytes.len() > MAX_CONSTRAINT_BYTES {
            bail_arg!(
                "request.constraint is {} bytes long, at most {MAX_CONSTRAINT_BYTES} allowed",
                bytes.len()
            );
        }
        // SAFETY: as above.
        Ok(unsafe { args::cstr(p.constraint, "request.constraint")? }.to_string())
    };
    Ok(match p.constraint_kind {
        NI_CONSTRAINT_NONE => None,
        NI_CONSTRAINT_JSON_SCHEMA => {
            Some(Constraint::JsonSchema(text("NI_CONSTRAINT_JSON_SCHEMA")?))
        }
        NI_CONSTRAINT_REGEX => Some(Constraint::Regex(text("NI_CONSTRAINT_REGEX")?)),
        NI_CONSTRAINT_GRAMMAR => Some(Constraint::Lark(text("NI_CONSTRAINT_GRAMMAR")?)),
        NI_CONSTRAINT_CHOICE => {
            if p.n_choices > MAX_CHOICES {
                bail_arg!(
                    "request.n_choices is {}, more than the limit of {MAX_CHOICES}",
                    p.n_choices
                );
            }
            // SAFETY: `n_choices` string pointers (contract).
            let ptrs = unsafe { args::slice(p.choices, p.n_choices, "request.choices")? };
            let mut choices = Vec::with_capacity(ptrs.len());
            let mut total = 0usize;
            for (i, &c) in ptrs.iter().enumerate() {
                let what = format!("request.choices[{i}]");
                // SAFETY: each entry is a NUL-terminated string (contract).
                let bytes = unsafe { args::cstr_bytes(c, &what)? };
                total += bytes.len();
                if total > MAX_CONSTRAINT_BYTES {
                    bail_arg!("request.choices hold more than {MAX_CONSTRAINT_BYTES} bytes");
                }
                // SAFETY: as above.
                choices.push(unsafe { args::cstr(c, &what)? }.to_string());
            }
            Some(Constraint::Choice(choices))
        }
        other => bail_arg!("request.constraint_kind {other} is not a NI_CONSTRAINT_* value"),
    })
}

/// The prompt's token ids from whichever of the three prompt forms is set.
///
/// # Safety
/// The prompt pointers in `p` must honour their documented contract.
unsafe fn prompt(p: &ni_request_params, model: &Model, context: usize) -> Result<Vec<u32>> {
    let has_tokens = !p.prompt_tokens.is_null() || p.n_prompt_tokens != 0;
    // A length without text is a caller's bug, refused by `args::text`.
    let has_text = !p.prompt_text.is_null() || p.prompt_text_len != 0;
    let has_messages = !p.messages.is_null() || p.n_messages != 0;
    if usize::from(has_tokens) + usize::from(has_text) + usize::from(has_messages) > 1 {
        bail_arg!("request: set exactly one of prompt_tokens, prompt_text and messages");
    }
    if has_text {
        // SAFETY: forwarded contract.
        let text = unsafe { args::text(p.prompt_text, p.prompt_text_len, "request.prompt_text")? };
        let options = EncodeOptions {
            add_special_tokens: p.add_special_tokens,
            parse_special: p.parse_special,
        };
        return model.tokenizer()?.encode_bounded_with(
            text,
            options,
            context,
            "request.prompt_text",
        );
    }
    if has_messages {
        if p.add_special_tokens {
            bail_arg!(
                "request.add_special_tokens applies to prompt_text only: with messages the chat \
                 template writes the special tokens"
            );
        }
        // SAFETY: forwarded contract.
        let messages = unsafe { chat_messages(p.messages, p.n_messages, "request.messages")? };
        return model
            .tokenizer()?
            .encode_chat(&messages, p.add_generation_prompt, context);
    }
    // SAFETY: forwarded contract.
    Ok(
        unsafe { args::slice(p.prompt_tokens, p.n_prompt_tokens, "request.prompt_tokens")? }
            .to_vec(),
    )
}
