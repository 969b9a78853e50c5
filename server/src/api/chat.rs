//! `POST /v1/chat/completions`: messages rendered with the model's chat
//! template (message text stays text: special-token strings in it cannot
//! open or close turns), then generated like a completion.

use super::error::ApiError;

use super::respond::{token_text, Format, Reply};
use super::{App, Parsed};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::Response;
use nanoinfer::engine::{Model, TokenLogprob};
use nanoinfer::tokenizer::ChatMessage;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

#[derive(Deserialize)]
struct ChatRequest {
    messages: Vec<Message>,
    logprobs: Option<bool>,
    top_logprobs: Option<u32>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: Option<Content>,
}

/// A message's content: text, or a list of parts of which only text is
/// supported.
#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Value>),
}

/// The message list as the chat template takes it.
fn chat_messages(messages: &[Message]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must hold at least one message",
        ));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match m.role.as_str() {
                "system" | "user" | "assistant" => m.role.clone(),
                // OpenAI's newer name for system instructions.
                "developer" => "system".to_string(),
                other => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].role"),
                        format!(
                        "role `{other}` is not supported (system, developer, user or assistant)"
                    ),
                    ))
                }
            };
            let content = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, part) in parts.iter().enumerate() {
                        match (part.get("type").and_then(Value::as_str), part.get("text")) {
                            (Some("text"), Some(Value::String(t))) => text.push_str(t),
                            (kind, _) => {
                                return Err(ApiError::invalid(
                                    format!("messages[{i}].content[{j}]"),
                                    format!(
                                        "content part of type {} is not supported: only text parts",
                                        kind.unwrap_or("(missing)")
                                    ),
                                ))
                            }
                        }
                    }
                    text
                }
            };
            Ok(ChatMessage { role, content })
        })
        .collect()
}

pub async fn chat_completions(
    State(app): State<Arc<App>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let parsed: Parsed<ChatRequest> = app.parse(body)?;
    let (req, c, shape) = (&parsed.req, &parsed.common, &parsed.shape);
    let want_logprobs = req.logprobs.unwrap_or(false);
    if req.top_logprobs.is_some() && !want_logprobs {
        return Err(ApiError::invalid(
            "top_logprobs",
            "`top_logprobs` needs `logprobs: true`",
        ));
    }
    let messages = chat_messages(&req.messages)?;
    let model = app.engine.model.clone();
    let limit = app.engine.facts.request_token_limit;
    let tok = model.tokenizer().map_err(|e| {
        ApiError::invalid(
            "messages",
            format!("chat needs the model's tokenizer: {}", e.message),
        )
    })?;
    let text_bytes: usize = messages.iter().map(|m| m.content.len()).sum();
    // Refused before the template copies it and the tokenizer reads it.
    if text_bytes > tok.max_text_bytes(limit) {
        return Err(ApiError::context_length(
            "messages",
            format!(
                "the messages hold {text_bytes} bytes of text, more than this model's context of {limit} tokens can take"
            ),
        ));
    }
    let prompt = tok.encode_chat(&messages, true, limit).map_err(|e| {
        if e.message.contains("context length") {
            ApiError::context_length("messages", e.message)
        } else {
            ApiError::invalid(
                "messages",
                format!("the chat template failed: {}", e.message),
            )
        }
    })?;
    // `logprobs: true` alone gives the chosen token's logprob; the engine
    // reports at least one top entry, which is shown only when asked for.
    let top = req.top_logprobs.unwrap_or(0);
    let engine_logprobs = if want_logprobs { top.max(1) } else { 0 };
    let sampling = c.sampling(
        &app.opts.defaults,
        model.config().vocab_size,
        prompt.len(),
        limit,
        engine_logprobs,
        "messages",
    )?;
    let requests = parsed.choices(&prompt, &sampling).collect();
    let sub = parsed.submit(&app, requests).await?;
    let reply = Reply {
        format: ChatFormat {
            top_logprobs: top as usize,
        },
        model,
        model_name: app.opts.model_name.clone(),
        n: shape.n,
        prompt_tokens: vec![prompt.len()],
        echo: vec![String::new()],
        logprobs: want_logprobs,
        timeout: app.opts.request_timeout,
    };
    Ok(reply.respond(sub, shape.stream, shape.include_usage).await)
}

struct ChatFormat {
    top_logprobs: usize,
}

impl Format for ChatFormat {
    fn object(&self, stream: bool) -> &'static str {
        if stream {
            "chat.completion.chunk"
        } else {
            "chat.completion"
        }
    }

    fn id_prefix(&self) -> &'static str {
        "chatcmpl"
    }

    fn opening_delta(&self, index: usize) -> Option<Value> {
        Some(json!({
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": Value::Null,
            "finish_reason": Value::Null,
        }))
    }

    fn choice(
        &self,
        index: usize,
        text: &str,
        logprobs: Option<Value>,
        finish: Option<&str>,
        stream: bool,
    ) -> Value {
        let (key, body) = if stream {
            let delta = if text.is_empty() {
                json!({})
            } else {
                json!({"content": text})
            };
            ("delta", delta)
        } else {
            ("message", json!({"role": "assistant", "content": text}))
        };
        json!({
            "index": index,
            key: body,
            "logprobs": logprobs,
            "finish_reason": finish,
        })
    }

    fn logprobs(&self, model: &Model, tokens: &[TokenLogprob], _offset: usize) -> Value {
        let entry = |id: u32, logprob: f32| {
            let (token, bytes) = token_text(model, id);
            json!({"token": token, "logprob": logprob, "bytes": bytes})
        };
        let content: Vec<Value> = tokens
            .iter()
            .map(|t| {
                let mut e = entry(t.token, t.logprob);
                e["top_logprobs"] = t
                    .top
                    .iter()
                    .take(self.top_logprobs)
                    .map(|&(id, lp)| entry(id, lp))
                    .collect();
                e
            })
            .collect();
        json!({"content": content})
    }
}
