//! `POST /v1/completions`: raw prompts (text or token ids, one or many),
//! `n` choices each.

use super::error::ApiError;

use super::respond::{token_text, Format, Reply};
use super::{App, Parsed};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::Response;
use nanoinfer::engine::{Model, TokenLogprob};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// Prompts of one request, at most (each gets `n` choices).
const MAX_PROMPTS: usize = 64;

#[derive(Deserialize)]
struct CompletionRequest {
    prompt: Option<Prompt>,
    logprobs: Option<u32>,
    echo: Option<bool>,
    suffix: Option<String>,
    best_of: Option<u32>,
}

/// OpenAI's four prompt forms.
#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

/// One prompt: its token ids and the text `echo` puts back.
struct PromptIds {
    ids: Vec<u32>,
    text: String,
}

fn prompts(
    model: &Model,
    prompt: Option<Prompt>,
    limit: usize,
) -> Result<Vec<PromptIds>, ApiError> {
    // Token-id prompts need no tokenizer (a model directory may have none);
    // text prompts do.
    let tok = model.tokenizer().ok();
    let encode = |i: usize, text: String| -> Result<PromptIds, ApiError> {
        let param = if i == usize::MAX {
            "prompt".to_string()
        } else {
            format!("prompt[{i}]")
        };
        let Some(tok) = tok else {
            return Err(ApiError::invalid(
                param,
                "this model directory has no tokenizer.json: send the prompt as token ids",
            ));
        };
        let ids = tok
            .encode_bounded(&text, true, limit, "the prompt")
            .map_err(|e| ApiError::context_length(&param, e.message))?;
        Ok(PromptIds { ids, text })
    };
    let from_ids = |ids: Vec<u32>| -> PromptIds {
        let text = tok
            .and_then(|t| t.decode(&ids, false).ok())
            .unwrap_or_default();
        PromptIds { ids, text }
    };
    let list = match prompt {
        None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(Prompt::Text(t)) => vec![encode(usize::MAX, t)?],
        Some(Prompt::Texts(ts)) => {
            check_count(ts.len())?;
            ts.into_iter()
                .enumerate()
                .map(|(i, t)| encode(i, t))
                .collect::<Result<_, _>>()?
        }
        Some(Prompt::Ids(ids)) => vec![from_ids(ids)],
        Some(Prompt::IdLists(lists)) => {
            check_count(lists.len())?;
            lists.into_iter().map(from_ids).collect()
        }
    };
    let vocab = model.config().vocab_size;
    for (i, p) in list.iter().enumerate() {
        if p.ids.is_empty() {
            return Err(ApiError::invalid(
                format!("prompt[{i}]"),
                "a prompt must not be empty",
            ));
        }
        if let Some(&bad) = p.ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid(
                format!("prompt[{i}]"),
                format!("token id {bad} is outside the vocabulary (size {vocab})"),
            ));
        }
    }
    Ok(list)
}

fn check_count(n: usize) -> Result<(), ApiError> {
    if (1..=MAX_PROMPTS).contains(&n) {
        Ok(())
    } else {
        Err(ApiError::invalid(
            "prompt",
            format!("between 1 and {MAX_PROMPTS} prompts per request, got {n}"),
        ))
    }
}

pub async fn completions(
    State(app): State<Arc<App>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let mut parsed: Parsed<CompletionRequest> = app.parse(body)?;
    let prompt_field = parsed.req.prompt.take();
    let (req, c, shape) = (&parsed.req, &parsed.common, &parsed.shape);
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported(
            "suffix",
            "`suffix` (fill-in-the-middle) is not supported",
        ));
    }
    if req.best_of.is_some_and(|b| b as usize != shape.n) {
        return Err(ApiError::unsupported(
            "best_of",
            "`best_of` other than `n` is not supported",
        ));
    }
    let echo = req.echo.unwrap_or(false);
    if echo && req.logprobs.is_some() {
        return Err(ApiError::unsupported(
            "echo",
            "`echo` with `logprobs` (prompt logprobs) is not supported",
        ));
    }
    let model = app.engine.model.clone();
    let limit = app.engine.facts.request_token_limit;
    let prompts = prompts(&model, prompt_field, limit)?;
    if prompts.len() * shape.n > crate::engine_loop::MAX_CHOICES * 4 {
        return Err(ApiError::invalid(
            "n",
            format!(
                "{} prompts x n {} is more than {} requests",
                prompts.len(),
                shape.n,
                crate::engine_loop::MAX_CHOICES * 4
            ),
        ));
    }
    let top = req.logprobs.unwrap_or(0);
    let want_logprobs = req.logprobs.is_some();
    let mut requests = Vec::with_capacity(prompts.len() * shape.n);
    for (p, prompt) in prompts.iter().enumerate() {
        let param = if prompts.len() == 1 {
            "prompt".to_string()
        } else {
            format!("prompt[{p}]")
        };
        let sampling = c
            .sampling(
                &app.opts.defaults,
                model.config().vocab_size,
                prompt.ids.len(),
                limit,
                if want_logprobs { top.max(1) } else { 0 },
                &param,
            )
            .map_err(|mut e| {
                if e.param.as_deref() == Some("top_logprobs") {
                    e.param = Some("logprobs".into());
                }
                e
            })?;
        requests.extend(parsed.choices(&prompt.ids, &sampling));
    }
    let sub = parsed.submit(&app, requests).await?;
    let reply = Reply {
        format: CompletionFormat {
            top_logprobs: top as usize,
        },
        model,
        model_name: app.opts.model_name.clone(),
        n: shape.n,
        prompt_tokens: prompts.iter().map(|p| p.ids.len()).collect(),
        echo: prompts
            .into_iter()
            .map(|p| if echo { p.text } else { String::new() })
            .collect(),
        logprobs: want_logprobs,
        timeout: app.opts.request_timeout,
    };
    Ok(reply.respond(sub, shape.stream, shape.include_usage).await)
}

struct CompletionFormat {
    top_logprobs: usize,
}

impl Format for CompletionFormat {
    fn object(&self, _stream: bool) -> &'static str {
        "text_completion"
    }

    fn id_prefix(&self) -> &'static str {
        "cmpl"
    }

    fn opening_delta(&self, _index: usize) -> Option<Value> {
        None
    }

    fn choice(
        &self,
        index: usize,
        text: &str,
        logprobs: Option<Value>,
        finish: Option<&str>,
        _stream: bool,
    ) -> Value {
        json!({
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish,
        })
    }

    /// The legacy shape: parallel lists of token strings, their logprobs,
    /// the top alternatives as {token: logprob} and character offsets.
    fn logprobs(&self, model: &Model, tokens: &[TokenLogprob], offset: usize) -> Value {
        let mut texts = Vec::with_capacity(tokens.len());
        let mut lps = Vec::with_capacity(tokens.len());
        let mut tops = Vec::with_capacity(tokens.len());
        let mut offsets = Vec::with_capacity(tokens.len());
        let mut at = offset;
        for t in tokens {
            let (text, _) = token_text(model, t.token);
            offsets.push(at);
            at += text.len();
            texts.push(text);
            lps.push(t.logprob);
            let mut top = Map::new();
            for &(id, lp) in t.top.iter().take(self.top_logprobs) {
                top.insert(token_text(model, id).0, json!(lp));
            }
            tops.push(Value::Object(top));
        }
        json!({"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
    }
}
