//! Turns a submission's events into the HTTP response: one JSON body, or
//! server-sent events as tokens arrive. What differs between chat and
//! completions (object names, choice and logprob shapes) is a [`Format`].

use super::error::ApiError;
use crate::engine_loop::{finish_reason_name, Submission};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use nanoinfer::engine::{FinishReason, Model, TokenLogprob, Usage};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;

/// How one endpoint shapes its JSON.
pub trait Format: Send + Sync + 'static {
    /// `object` of a whole response and of a streamed chunk.
    fn object(&self, stream: bool) -> &'static str;
    /// Prefix of the response id.
    fn id_prefix(&self) -> &'static str;
    /// The delta a stream opens each choice with (chat: the role).
    fn opening_delta(&self, index: usize) -> Option<Value>;
    /// One choice: its text (or this chunk's), logprobs and finish reason.
    fn choice(
        &self,
        index: usize,
        text: &str,
        logprobs: Option<Value>,
        finish: Option<&str>,
        stream: bool,
    ) -> Value;
    /// The logprobs of `tokens`; `offset` is the length of the choice's
    /// text before them.
    fn logprobs(&self, model: &Model, tokens: &[TokenLogprob], offset: usize) -> Value;
}

/// The response's fixed parts.
pub struct Reply<F: Format> {
    pub format: F,
    pub model: Arc<Model>,
    pub model_name: String,
    /// Choices per prompt (`n`).
    pub n: usize,
    /// Prompt tokens of each prompt, in order.
    pub prompt_tokens: Vec<usize>,
    /// Text put before each prompt's choices (`echo`), per prompt.
    pub echo: Vec<String>,
    pub logprobs: bool,
    pub timeout: Option<Duration>,
}

/// A unique, unguessable-enough id for responses (not a secret).
fn response_id(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!(
        "{prefix}-{nanos:x}{:06x}",
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The per-choice state gathered from events.
#[derive(Default, Clone)]
struct ChoiceState {
    text: String,
    logprobs: Vec<TokenLogprob>,
    finish: Option<FinishReason>,
    usage: Usage,
}

impl<F: Format> Reply<F> {
    fn usage(&self, choices: &[ChoiceState]) -> Value {
        let prompt: usize = self.prompt_tokens.iter().sum();
        let cached: usize = choices
            .iter()
            .step_by(self.n)
            .map(|c| c.usage.cached_prompt_tokens)
            .sum();
        let completion: usize = choices.iter().map(|c| c.usage.generated_tokens).sum();
        json!({
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        })
    }

    fn deadline(&self) -> Option<Instant> {
        self.timeout.map(|t| Instant::now() + t)
    }

    /// The answer to the request: streamed or whole.
    pub async fn respond(self, sub: Submission, stream: bool, include_usage: bool) -> Response {
        if stream {
            self.stream(sub, include_usage).into_response()
        } else {
            match self.collect(sub).await {
                Ok(body) => axum::Json(body).into_response(),
                Err(e) => e.into_response(),
            }
        }
    }

    async fn collect(self, mut sub: Submission) -> Result<Value, ApiError> {
        let deadline = self.deadline();
        let mut choices = vec![ChoiceState::default(); sub.ids.len()];
        loop {
            let next = match deadline {
                Some(d) => match tokio::time::timeout_at(d, sub.next()).await {
                    Ok(e) => e,
                    Err(_) => {
                        sub.cancel();
                        return Err(ApiError::timeout(self.timeout_secs()));
                    }
                },
                None => sub.next().await,
            };
            let Some(event) = next else { break };
            let c = &mut choices[sub.index_of(event.request_id)];
            c.text.push_str(&event.text);
            c.logprobs.extend(event.logprobs);
            if let Some(u) = event.usage {
                c.usage = u;
            }
            if event.finish.is_some() {
                c.finish = event.finish;
            }
        }
        if let Some(FinishReason::Error(msg)) = choices
            .iter()
            .filter_map(|c| c.finish.as_ref())
            .find(|f| matches!(f, FinishReason::Error(_)))
        {
            return Err(ApiError::internal(format!("generation failed: {msg}")));
        }
        let body_choices: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let echo = &self.echo[i / self.n];
                let text = format!("{echo}{}", c.text);
                let logprobs = self
                    .logprobs
                    .then(|| self.format.logprobs(&self.model, &c.logprobs, echo.len()));
                let finish = c.finish.as_ref().map_or("length", finish_reason_name);
                self.format.choice(i, &text, logprobs, Some(finish), false)
            })
            .collect();
        Ok(json!({
            "id": response_id(self.format.id_prefix()),
            "object": self.format.object(false),
            "created": unix_now(),
            "model": self.model_name,
            "choices": body_choices,
            "usage": self.usage(&choices),
            "system_fingerprint": Value::Null,
        }))
    }

    fn timeout_secs(&self) -> f64 {
        self.timeout.map_or(0.0, |t| t.as_secs_f64())
    }

    /// Server-sent events. A task forwards the engine's events; when the
    /// client goes away the task sees its channel close and cancels the
    /// requests at once, before their next token.
    fn stream(self, mut sub: Submission, include_usage: bool) -> impl IntoResponse {
        let (tx, rx) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
        tokio::spawn(async move {
            let id = response_id(self.format.id_prefix());
            let created = unix_now();
            let chunk = |choices: Vec<Value>, usage: Option<Value>| -> SseEvent {
                let mut body = json!({
                    "id": id,
                    "object": self.format.object(true),
                    "created": created,
                    "model": self.model_name,
                    "choices": choices,
                    "system_fingerprint": Value::Null,
                });
                if include_usage {
                    body["usage"] = usage.unwrap_or(Value::Null);
                }
                SseEvent::default().data(body.to_string())
            };
            let mut choices = vec![ChoiceState::default(); sub.ids.len()];
            // Chat opens every choice with the role; completions with echo
            // open with the prompt.
            for (i, choice) in choices.iter_mut().enumerate() {
                let opening = match self.format.opening_delta(i) {
                    Some(delta) => Some(delta),
                    None if !self.echo[i / self.n].is_empty() => {
                        Some(
                            self.format
                                .choice(i, &self.echo[i / self.n], None, None, true),
                        )
                    }
                    None => None,
                };
                if let Some(choice) = opening {
                    if tx.send(Ok(chunk(vec![choice], None))).await.is_err() {
                        return; // dropping `sub` cancels
                    }
                }
                choice.text = self.echo[i / self.n].clone();
            }
            let deadline = self.deadline();
            loop {
                let next = tokio::select! {
                    _ = tx.closed() => return, // the client left: `sub` drops and cancels
                    e = next_before(&mut sub, deadline) => e,
                };
                let event = match next {
                    Ok(Some(e)) => e,
                    Ok(None) => break,
                    Err(()) => {
                        sub.cancel();
                        let err = ApiError::timeout(self.timeout_secs());
                        let _ = tx
                            .send(Ok(SseEvent::default().data(err.body().to_string())))
                            .await;
                        return;
                    }
                };
                let i = sub.index_of(event.request_id);
                let c = &mut choices[i];
                if let Some(u) = event.usage {
                    c.usage = u;
                }
                if let Some(FinishReason::Error(msg)) = &event.finish {
                    let err = ApiError::internal(format!("generation failed: {msg}"));
                    let _ = tx
                        .send(Ok(SseEvent::default().data(err.body().to_string())))
                        .await;
                    return;
                }
                let finish = event.finish.as_ref().map(finish_reason_name);
                if event.text.is_empty() && finish.is_none() && event.logprobs.is_empty() {
                    continue;
                }
                let logprobs = (self.logprobs && !event.logprobs.is_empty()).then(|| {
                    self.format
                        .logprobs(&self.model, &event.logprobs, c.text.len())
                });
                c.text.push_str(&event.text);
                let choice = self.format.choice(i, &event.text, logprobs, finish, true);
                if tx.send(Ok(chunk(vec![choice], None))).await.is_err() {
                    return;
                }
            }
            if include_usage {
                let usage = self.usage(&choices);
                if tx.send(Ok(chunk(vec![], Some(usage)))).await.is_err() {
                    return;
                }
            }
            let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
        });
        Sse::new(ReceiverStream::new(rx)).keep_alive(KeepAlive::default())
    }
}

/// The submission's next event, or `Err` once `deadline` passes.
async fn next_before(
    sub: &mut Submission,
    deadline: Option<Instant>,
) -> Result<Option<nanoinfer::engine::Event>, ()> {
    match deadline {
        Some(d) => tokio::time::timeout_at(d, sub.next()).await.map_err(|_| ()),
        None => Ok(sub.next().await),
    }
}

/// The text of one token as the logprob entries show it, and its bytes.
pub fn token_text(model: &Model, id: u32) -> (String, Vec<u8>) {
    let text = model
        .tokenizer()
        .ok()
        .and_then(|t| t.decode(&[id], false).ok())
        .unwrap_or_default();
    let bytes = text.as_bytes().to_vec();
    (text, bytes)
}
