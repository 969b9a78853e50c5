//! `ni_session_step` and the step output it fills.

use super::args;
use super::boundary::{ffi_call, ffi_value};
use super::session::ni_session;
use super::status::ni_status;
use crate::engine::{Event, FinishReason, Usage};
use crate::Result;
use std::ffi::{c_char, CString};

/// Why a request ended (`NI_FINISH_NONE` while it is still running).
pub type ni_finish_reason = u32;
/// The request is still running; more events follow.
pub const NI_FINISH_NONE: ni_finish_reason = 0;
/// An end-of-sequence token of the model was generated.
pub const NI_FINISH_EOS: ni_finish_reason = 1;
/// One of the request's stop token ids was generated (`stop_token_id`).
pub const NI_FINISH_STOP_TOKEN: ni_finish_reason = 2;
/// One of the request's stop strings matched (`stop_string_index`).
pub const NI_FINISH_STOP_STRING: ni_finish_reason = 3;
/// `max_tokens` or the model's context length was reached.
pub const NI_FINISH_LENGTH: ni_finish_reason = 4;
/// The request was cancelled with `ni_session_cancel`.
pub const NI_FINISH_CANCELLED: ni_finish_reason = 5;
/// The request failed; `error_message` says why (e.g. "non-finite logits:
/// ..." when the model's weights overflow to NaN or infinity for this
/// request; it ends without emitting a token for that step).
pub const NI_FINISH_ERROR: ni_finish_reason = 6;
/// As `NI_FINISH_LENGTH`, for a structured-output request
/// (`ni_request_params.constraint_kind`) whose output was not yet a full
/// match when it ran out of tokens (a JSON object still open, a regex not
/// yet matched). Only constrained requests end this way, so a caller that
/// sets no constraint never sees it.
pub const NI_FINISH_LENGTH_UNFINISHED: ni_finish_reason = 7;

/// One of the top alternatives at a generated position.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ni_top_logprob {
    pub token: u32,
    pub logprob: f32,
}

/// Log-probability of a generated token and its top alternatives (most
/// likely first), after the request's logits processing.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ni_token_logprob {
    pub token: u32,
    pub logprob: f32,
    pub top: *const ni_top_logprob,
    pub n_top: usize,
}

/// What one request used, reported once, with its terminal event (see
/// `ni_event.usage`), so callers need not re-tokenize or time requests.
/// Owned by the `ni_step_output`. Later versions may append fields; read it
/// through the pointer.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ni_usage {
    /// Tokens of the prompt: `n_prompt_tokens`, or `prompt_text` as the
    /// request tokenized it (the count `ni_tokenize` gives for the same
    /// text and `add_special_tokens`).
    pub prompt_tokens: u64,
    /// Prompt tokens whose KV came from the prefix cache instead of being
    /// computed (OpenAI's `prompt_tokens_details.cached_tokens`): the cached
    /// prefix found when the request was first admitted, a whole number of
    /// KV blocks (`ni_session_stats.kv_block_size`) below `prompt_tokens`
    /// (the last prompt token is always computed). 0 with prefix caching
    /// off and for a request that ended before it was admitted. A
    /// preemption does not change it: a request resumed later (by
    /// recompute or swap) keeps the figure of its first admission, however
    /// much of its prompt is computed again or found cached then.
    pub cached_prompt_tokens: u64,
    /// Tokens the request generated: the sum of `n_tokens` over all of its
    /// events, this one included.
    pub generated_tokens: u64,
    /// Nanoseconds from the start of the `ni_session_add_request` call that
    /// queued the request to the end of the step (the `ni_session_step`
    /// call, just before it fills its output) that returned the request's
    /// first generated token; 0 when it generated none.
    pub time_to_first_token_ns: u64,
    /// Nanoseconds from the start of the `ni_session_add_request` call to
    /// the end of the step that returned this terminal event (for a
    /// cancelled request, the first step after `ni_session_cancel`). Never
    /// 0, and never below `time_to_first_token_ns`.
    pub total_time_ns: u64,
}

impl From<Usage> for ni_usage {
    fn from(u: Usage) -> ni_usage {
        ni_usage {
            prompt_tokens: u.prompt_tokens as u64,
            cached_prompt_tokens: u.cached_prompt_tokens as u64,
            generated_tokens: u.generated_tokens as u64,
            time_to_first_token_ns: u.time_to_first_token_ns,
            total_time_ns: u.total_time_ns,
        }
    }
}

/// What happened to one request during one step. Every pointer points into
/// the `ni_step_output` and is valid until the next `ni_session_step` into
/// it or `ni_step_output_free`.
///
/// A request gets at most one event per step and exactly one event with
/// `finish_reason != NI_FINISH_NONE` over its life (after which its id is
/// no longer active).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ni_event {
    pub request_id: u64,
    /// Tokens generated this step (usually one; none for a prefill-only step
    /// or a cancellation). NULL when `n_tokens` is 0.
    pub tokens: *const u32,
    pub n_tokens: usize,
    /// UTF-8 text that became final this step: multi-byte characters are
    /// complete and stop strings are removed. NUL-terminated; `text_len`
    /// bytes (the text itself may contain NUL bytes). Never NULL.
    pub text: *const c_char,
    pub text_len: usize,
    /// One entry per token when the request asked for logprobs, else NULL / 0.
    pub logprobs: *const ni_token_logprob,
    pub n_logprobs: usize,
    /// `NI_FINISH_*`.
    pub finish_reason: ni_finish_reason,
    /// The stop token for `NI_FINISH_STOP_TOKEN`, else 0.
    pub stop_token_id: u32,
    /// Index into the request's stop strings for `NI_FINISH_STOP_STRING`, else -1.
    pub stop_string_index: i32,
    /// NUL-terminated message for `NI_FINISH_ERROR`, else NULL.
    pub error_message: *const c_char,
    /// The request's usage on its terminal event (whatever the finish
    /// reason, cancellations and errors included); NULL on every other event.
    pub usage: *const ni_usage,
}

/// Owned data behind one `ni_event`. Heap buffers do not move when this
/// struct moves, so the event's pointers stay valid.
struct EventData {
    tokens: Vec<u32>,
    /// Text plus a terminating NUL.
    text: Vec<u8>,
    logprobs: Vec<ni_token_logprob>,
    /// Backing storage of `logprobs[i].top` (only read through those pointers).
    _tops: Vec<Vec<ni_top_logprob>>,
    error: Option<CString>,
    /// Boxed so `ni_event.usage` stays valid when this struct moves.
    usage: Option<Box<ni_usage>>,
}

/// Library-owned results of `ni_session_step`. Create one with
/// `ni_step_output_create`, reuse it for every step, free it with
/// `ni_step_output_free`. Not tied to a session.
pub struct ni_step_output {
    data: Vec<EventData>,
    events: Vec<ni_event>,
}

impl ni_step_output {
    fn fill(&mut self, events: Vec<Event>) {
        self.events.clear();
        self.data.clear();
        for ev in events {
            let mut text = ev.text.into_bytes();
            text.push(0);
            let tops: Vec<Vec<ni_top_logprob>> = ev
                .logprobs
                .iter()
                .map(|l| {
                    l.top
                        .iter()
                        .map(|&(token, logprob)| ni_top_logprob { token, logprob })
                        .collect()
                })
                .collect();
            let logprobs = ev
                .logprobs
                .iter()
                .zip(&tops)
                .map(|(l, top)| ni_token_logprob {
                    token: l.token,
                    logprob: l.logprob,
                    top: if top.is_empty() {
                        std::ptr::null()
                    } else {
                        top.as_ptr()
                    },
                    n_top: top.len(),
                })
                .collect();
            let error = match &ev.finish {
                Some(FinishReason::Error(m)) => {
                    Some(CString::new(m.replace('\0', "\\0")).unwrap_or_default())
                }
                _ => None,
            };
            self.data.push(EventData {
                tokens: ev.tokens,
                text,
                logprobs,
                _tops: tops,
                error,
                usage: ev.usage.map(|u| Box::new(u.into())),
            });
            let d = self.data.last().expect("just pushed");
            let (finish_reason, stop_token_id, stop_string_index) = match ev.finish {
                None => (NI_FINISH_NONE, 0, -1),
                Some(FinishReason::Eos) => (NI_FINISH_EOS, 0, -1),
                Some(FinishReason::StopToken(t)) => (NI_FINISH_STOP_TOKEN, t, -1),
                Some(FinishReason::StopString(i)) => (NI_FINISH_STOP_STRING, 0, i as i32),
                Some(FinishReason::Length) => (NI_FINISH_LENGTH, 0, -1),
                Some(FinishReason::LengthUnfinished) => (NI_FINISH_LENGTH_UNFINISHED, 0, -1),
                Some(FinishReason::Cancelled) => (NI_FINISH_CANCELLED, 0, -1),
                Some(FinishReason::Error(_)) => (NI_FINISH_ERROR, 0, -1),
            };
            self.events.push(ni_event {
                request_id: ev.request_id,
                tokens: if d.tokens.is_empty() {
                    std::ptr::null()
                } else {
                    d.tokens.as_ptr()
                },
                n_tokens: d.tokens.len(),
                text: d.text.as_ptr().cast(),
                text_len: d.text.len() - 1,
                logprobs: if d.logprobs.is_empty() {
                    std::ptr::null()
                } else {
                    d.logprobs.as_ptr()
                },
                n_logprobs: d.logprobs.len(),
                finish_reason,
                stop_token_id,
                stop_string_index,
                error_message: d.error.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
                usage: d.usage.as_deref().map_or(std::ptr::null(), |u| u),
            });
        }
    }
}

/// Creates an empty step output; `*out_output` receives a handle to free
/// with `ni_step_output_free`.
///
/// Thread-safety: any thread. One output must not be used by two threads at once.
#[no_mangle]
pub unsafe extern "C" fn ni_step_output_create(out_output: *mut *mut ni_step_output) -> ni_status {
    ffi_call("ni_step_output_create", || {
        let out = args::out_ptr(out_output, "out_output")?;
        let handle = Box::new(ni_step_output {
            data: Vec::new(),
            events: Vec::new(),
        });
        // SAFETY: out was checked non-NULL and aligned.
        unsafe { out.write(Box::into_raw(handle)) };
        Ok(())
    })
}

/// Frees a step output and every event in it. NULL is a no-op.
///
/// Thread-safety: no other call may use this output during or after this one.
#[no_mangle]
pub unsafe extern "C" fn ni_step_output_free(output: *mut ni_step_output) {
    ffi_value("ni_step_output_free", (), || {
        if !output.is_null() {
            // SAFETY: a non-NULL handle came from Box::into_raw in
            // ni_step_output_create and is freed once, per the contract.
            drop(unsafe { Box::from_raw(output) });
        }
    })
}

/// Number of events in `output` (0 for NULL).
///
/// Thread-safety: any thread not concurrently stepping into this output.
#[no_mangle]
pub unsafe extern "C" fn ni_step_output_count(output: *const ni_step_output) -> usize {
    // SAFETY: per this function's contract.
    ffi_value("ni_step_output_count", 0, || {
        unsafe { output.as_ref() }.map_or(0, |o| o.events.len())
    })
}

/// The events of the last step, an array of `ni_step_output_count(output)`
/// entries (NULL when there are none or `output` is NULL). Valid until the
/// next `ni_session_step` into `output` or `ni_step_output_free`.
///
/// Thread-safety: any thread not concurrently stepping into this output.
#[no_mangle]
pub unsafe extern "C" fn ni_step_output_events(output: *const ni_step_output) -> *const ni_event {
    ffi_value("ni_step_output_events", std::ptr::null(), || {
        // SAFETY: per this function's contract.
        match unsafe { output.as_ref() } {
            Some(o) if !o.events.is_empty() => o.events.as_ptr(),
            _ => std::ptr::null(),
        }
    })
}

fn step(session: &ni_session) -> Result<Vec<Event>> {
    let mut state = session.lock()?;
    if std::mem::take(&mut state.panic_next_step) {
        panic!("forced by ni_debug_force_panic (testing only)");
    }
    state.session.step()
}

/// Runs one engine step: schedules waiting and running requests under the
/// session's token budget, runs one forward pass over the batch, samples,
/// and replaces the contents of `output` with this step's events (possibly
/// none). Call it while `ni_session_has_work` is true.
///
/// On a GPU, steady decoding overlaps its steps: the call may launch the
/// next step before it returns this one's events, so the device keeps
/// working between calls. The events are the same as without the overlap.
///
/// A step that the abort callback stops (`ni_session_set_abort_callback`)
/// fails with `NI_ERR_CANCELLED`; a cancel of one of its requests stops it
/// too, but the step then succeeds with the cancelled request's terminal
/// event. On failure `output` keeps its previous contents.
/// Thread-safety: drive one session from one thread at a time (calls are
/// serialized; concurrent steps would only wait for each other).
/// `ni_session_cancel` may be called from any thread and never waits;
/// `ni_session_add_request` and `ni_session_get_stats` may be called from
/// other threads and wait until the step ends. Different sessions may step
/// in parallel.
#[no_mangle]
pub unsafe extern "C" fn ni_session_step(
    session: *mut ni_session,
    output: *mut ni_step_output,
) -> ni_status {
    ffi_call("ni_session_step", || {
        // SAFETY: per this function's contract.
        let s = unsafe { args::handle(session, "session")? };
        let out = args::out_ptr(output, "output")?;
        let events = step(s)?;
        // SAFETY: `out` is a live output handle not used by another thread (contract).
        unsafe { &mut *out }.fill(events);
        Ok(())
    })
}
