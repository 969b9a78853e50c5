//! `nanoinfer generate`: one or many prompts through one session.

use crate::args::Args;
use crate::session_opts::{
    load_model, sampling_params, session_params, speculation_summary, MODEL_OPTS, SAMPLING_OPTS,
    SESSION_OPTS,
};
use nanoinfer::engine::{
    Constraint, Event, FinishReason, RequestParams, Session, TokenLogprob, Usage,
};
use nanoinfer::tokenizer::ChatMessage;
use nanoinfer::untrusted_file;
use serde_json::json;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

pub const FLAGS: &[&str] = &[
    "chat",
    "json",
    "ignore-eos",
    "no-prefix-cache",
    "host-sampling",
];

struct Output {
    prompt_ids: Vec<u32>,
    output_ids: Vec<u32>,
    text: String,
    logprobs: Vec<TokenLogprob>,
    finish: Option<FinishReason>,
    /// From the terminal event; its times are the timings reported.
    usage: Usage,
}

pub fn run(a: &Args) -> Result<(), String> {
    let known: Vec<&str> = [
        MODEL_OPTS,
        SESSION_OPTS,
        SAMPLING_OPTS,
        FLAGS,
        &["prompt", "prompts-file", "prompt-ids"],
        CONSTRAINT_OPTS,
        STATE_OPTS,
    ]
    .concat();
    a.check_known(&known)?;
    let json_out = a.flag("json");
    let sampling = sampling_params(a)?;
    let session_params = session_params(a)?;
    let model = load_model(a)?;
    let prompts = prompt_ids(a, &model)?;
    let constraint = constraint(a)?;

    let save_state = a.get("save-state").map(Path::new);
    let load_state = a.get("load-state").map(Path::new);
    if prompts.len() > 1 && (save_state.is_some() || load_state.is_some()) {
        return Err("--save-state and --load-state take one conversation: give one prompt".into());
    }

    let mut session = Session::new(model.clone(), session_params).map_err(|e| e.to_string())?;
    if !json_out {
        eprintln!("[{}]", session.stats().memory);
    }
    if let Some(dir) = a.get("load-prefix-cache") {
        let r = session
            .load_prefix_cache(Path::new(dir))
            .map_err(|e| format!("--load-prefix-cache: {e}"))?;
        if !json_out {
            eprintln!(
                "[prefix cache: {} cached tokens loaded from {dir}, {} left out]",
                r.tokens, r.skipped_tokens
            );
        }
    }
    let mut ids = Vec::new();
    for p in &prompts {
        let req = RequestParams {
            prompt: p.clone(),
            sampling: sampling.clone(),
            constraint: constraint.clone(),
            retain_state: save_state.is_some(),
            ..Default::default()
        };
        let added = match load_state {
            Some(path) => session
                .restore_request_file(path, req)
                .map_err(|e| format!("--load-state: {e}")),
            None => session.add_request(req).map_err(|e| e.to_string()),
        };
        ids.push(added?);
    }
    let mut outputs: Vec<Output> = prompts
        .iter()
        .map(|p| Output {
            prompt_ids: p.clone(),
            output_ids: vec![],
            text: String::new(),
            logprobs: vec![],
            finish: None,
            usage: Usage::default(),
        })
        .collect();
    let stream = !json_out && prompts.len() == 1;
    let start = Instant::now();
    let mut stdout = std::io::stdout().lock();
    while session.has_work() {
        let events = session.step().map_err(|e| e.to_string())?;
        for ev in events {
            let idx = ids
                .iter()
                .position(|&i| i == ev.request_id)
                .expect("event for a known request");
            record(&mut outputs[idx], ev, stream, &mut stdout);
        }
    }
    if stream {
        let _ = writeln!(stdout);
    }
    if let Some(path) = save_state {
        session
            .save_state_file(ids[0], path)
            .map_err(|e| format!("--save-state: {e}"))?;
    }
    if let Some(dir) = a.get("save-prefix-cache") {
        let r = session
            .save_prefix_cache(Path::new(dir))
            .map_err(|e| format!("--save-prefix-cache: {e}"))?;
        if !json_out {
            eprintln!("[prefix cache: {} cached tokens saved to {dir}]", r.tokens);
        }
    }
    let load_ms = model.load_ms;
    for o in &outputs {
        if let Some(FinishReason::Error(msg)) = &o.finish {
            return Err(msg.clone());
        }
        if json_out {
            let _ = writeln!(stdout, "{}", to_json(o, load_ms));
        } else if !stream {
            let _ = writeln!(stdout, "{}\n", o.text);
        }
    }
    if !json_out {
        let total_out: usize = outputs.iter().map(|o| o.output_ids.len()).sum();
        let prompt: usize = outputs.iter().map(|o| o.usage.prompt_tokens).sum();
        let cached: usize = outputs.iter().map(|o| o.usage.cached_prompt_tokens).sum();
        let ttft = match &outputs[..] {
            [o] => format!(
                ", TTFT {:.0} ms",
                o.usage.time_to_first_token_ns as f64 / 1e6
            ),
            _ => String::new(),
        };
        let secs = start.elapsed().as_secs_f64();
        let mib = |b: Option<usize>| b.map_or(0.0, |b| b as f64 / (1u64 << 20) as f64);
        eprintln!(
            "[{} prompt(s) of {prompt} tokens ({cached} cached), {total_out} tokens in {:.2}s{ttft}, \
             load {:.0} ms, peak RSS {:.1} MiB, RSS {:.1} MiB]",
            outputs.len(),
            secs,
            load_ms,
            mib(nanoinfer::sysinfo::peak_rss_bytes()),
            mib(nanoinfer::sysinfo::rss_bytes())
        );
        if session.params().speculative.is_some() {
            eprintln!("[{}]", speculation_summary(&session.stats()));
        }
    }
    Ok(())
}

fn record(o: &mut Output, ev: Event, stream: bool, out: &mut impl Write) {
    o.output_ids.extend_from_slice(&ev.tokens);
    o.logprobs.extend(ev.logprobs);
    if stream {
        let _ = out.write_all(ev.text.as_bytes());
        let _ = out.flush();
    }
    o.text.push_str(&ev.text);
    if let Some(usage) = ev.usage {
        o.usage = usage;
    }
    if ev.finish.is_some() {
        o.finish = ev.finish;
    }
}

fn to_json(o: &Output, load_ms: f64) -> serde_json::Value {
    let u = &o.usage;
    let done_at = u.total_time_ns as f64 / 1e9;
    let ttft = match u.time_to_first_token_ns {
        0 => done_at,
        ns => ns as f64 / 1e9,
    };
    let decode_secs = done_at - ttft;
    let decoded = o.output_ids.len().saturating_sub(1);
    let mut v = json!({
        "prompt_ids": o.prompt_ids,
        "output_ids": o.output_ids,
        "text": o.text,
        "finish_reason": o.finish.as_ref().map_or("length", |f| f.as_str()),
        "usage": {
            "prompt_tokens": u.prompt_tokens,
            "cached_prompt_tokens": u.cached_prompt_tokens,
            "generated_tokens": u.generated_tokens,
            "time_to_first_token_ns": u.time_to_first_token_ns,
            "total_time_ns": u.total_time_ns,
        },
        "timings": {
            "load_ms": load_ms,
            "ttft_ms": ttft * 1e3,
            "prefill_tokens_per_s": if ttft > 0.0 { o.prompt_ids.len() as f64 / ttft } else { 0.0 },
            "decode_tokens_per_s": if decode_secs > 0.0 { decoded as f64 / decode_secs } else { 0.0 },
        }
    });
    if o.finish == Some(FinishReason::LengthUnfinished) {
        // Cut off by max_tokens inside a structure it had not closed.
        v["unfinished_structure"] = json!(true);
    }
    if let Some(FinishReason::StopString(i)) = &o.finish {
        v["stop_index"] = json!(i);
    }
    if !o.logprobs.is_empty() {
        v["logprobs"] = o
            .logprobs
            .iter()
            .map(|l| json!({"token": l.token, "logprob": l.logprob, "top": l.top.iter().map(|(t, p)| json!([t, p])).collect::<Vec<_>>()}))
            .collect();
    }
    v
}

const CONSTRAINT_OPTS: &[&str] = &["json-schema", "regex", "grammar", "choice"];

/// `--save-state FILE`: save the conversation when it ends. `--load-state
/// FILE`: continue a saved conversation, the prompt (optional, tokenized
/// as raw text without BOS: write a chat turn's markers yourself) appended
/// to it. `--save-prefix-cache DIR` / `--load-prefix-cache DIR`: the
/// session's prefix cache after the run / before it.
const STATE_OPTS: &[&str] = &[
    "save-state",
    "load-state",
    "save-prefix-cache",
    "load-prefix-cache",
];

/// `--json-schema FILE | --regex R | --grammar FILE | --choice A --choice B`:
/// structured output, at most one of them.
fn constraint(a: &Args) -> Result<Option<Constraint>, String> {
    let given: Vec<&str> = CONSTRAINT_OPTS
        .iter()
        .copied()
        .filter(|o| a.get(o).is_some())
        .collect();
    if given.len() > 1 {
        return Err(format!(
            "give at most one of --json-schema, --regex, --grammar and --choice (got --{})",
            given.join(", --")
        ));
    }
    let read = |opt: &str, path: &str| {
        untrusted_file::read_text(
            Path::new(path),
            nanoinfer::engine::grammar::MAX_CONSTRAINT_BYTES as u64,
        )
        .map_err(|e| format!("--{opt}: {e}"))
    };
    Ok(match given.first() {
        None => None,
        Some(&"json-schema") => Some(Constraint::JsonSchema(read(
            "json-schema",
            a.get("json-schema").unwrap_or_default(),
        )?)),
        Some(&"grammar") => Some(Constraint::Lark(read(
            "grammar",
            a.get("grammar").unwrap_or_default(),
        )?)),
        Some(&"regex") => Some(Constraint::Regex(
            a.get("regex").unwrap_or_default().to_string(),
        )),
        Some(_) => Some(Constraint::Choice(a.all("choice").to_vec())),
    })
}

fn prompt_ids(a: &Args, model: &nanoinfer::engine::Model) -> Result<Vec<Vec<u32>>, String> {
    if let Some(ids) = a.get("prompt-ids") {
        let parsed: Result<Vec<u32>, _> = ids.split(',').map(|s| s.trim().parse::<u32>()).collect();
        return parsed
            .map(|p| vec![p])
            .map_err(|e| format!("--prompt-ids must be comma-separated token ids: {e}"));
    }
    let mut texts: Vec<String> = a.all("prompt").to_vec();
    if let Some(path) = a.get("prompts-file") {
        let body = untrusted_file::read_text(Path::new(path), untrusted_file::MAX_INPUT_TEXT_BYTES)
            .map_err(|e| format!("--prompts-file: {e}"))?;
        texts.extend(
            body.lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_string),
        );
    }
    let continuing = a.get("load-state").is_some();
    if texts.is_empty() {
        if continuing {
            // The saved conversation goes on where it stopped.
            return Ok(vec![Vec::new()]);
        }
        return Err("give --prompt TEXT, --prompts-file PATH or --prompt-ids".into());
    }
    let tok = model.tokenizer().map_err(|e| e.to_string())?;
    let context = model.config().max_position_embeddings;
    if continuing {
        if a.flag("chat") {
            return Err(
                "--chat renders a whole conversation; with --load-state give the new turn as text, \
                 its chat markers included"
                    .into(),
            );
        }
        return texts
            .iter()
            .map(|t| {
                tok.encode_bounded(t, false, context, "--prompt")
                    .map_err(|e| e.to_string())
            })
            .collect();
    }
    texts
        .iter()
        .map(|t| {
            if t.len() > tok.max_text_bytes(context) {
                // Refused before the template copies it and the tokenizer reads it.
                return tok
                    .encode_bounded(t, true, context, "--prompt")
                    .map_err(|e| e.to_string());
            }
            if a.flag("chat") {
                let msgs = [ChatMessage {
                    role: "user".into(),
                    content: t.clone(),
                }];
                // The prompt is the user's turn: special-token text in it
                // stays text instead of closing the turn.
                tok.encode_chat(&msgs, true, context)
                    .map_err(|e| format!("--prompt (chat-rendered): {e}"))
            } else {
                tok.encode_bounded(t, true, context, "--prompt")
                    .map_err(|e| e.to_string())
            }
        })
        .collect()
}
