//! `nanoinfer bench --num-requests N`: serving throughput with vLLM's
//! `benchmark_throughput` / `benchmark_serving` shape. N requests of
//! `--input-len` random prompt tokens and `--output-len` generated tokens
//! (EOS ignored) are all ready at the start; at most `--concurrency` of them
//! are in the session at once (0: all, the offline case). Reported: output
//! and total tokens per second of wall time, time to first token and time
//! per output token percentiles over the requests, and the engine's host
//! time per step (step wall time minus the device's forward calls).

use crate::args::Args;
use crate::session_opts::{load_model, session_params};
use nanoinfer::engine::{RequestParams, Session};
use nanoinfer::sampling::rng::SplitMix64;
use nanoinfer::sampling::SamplingParams;
use serde_json::json;
use std::collections::HashMap;
use std::time::Instant;

pub const OPTS: &[&str] = &["num-requests", "input-len", "output-len", "concurrency"];

/// Most requests of one run: their prompts are all made up front.
const MAX_REQUESTS: usize = 100_000;

struct Settings {
    requests: usize,
    input_len: usize,
    output_len: u32,
    concurrency: usize,
    seed: u64,
}

/// Per-request timestamps, seconds since the start.
#[derive(Default, Clone, Copy)]
struct Timing {
    first: Option<f64>,
    last: f64,
    tokens: usize,
}

pub fn run(a: &Args) -> Result<(), String> {
    let s = Settings {
        requests: a.parse_or("num-requests", 0)?,
        input_len: a.parse_or("input-len", 512)?,
        output_len: a.parse_or("output-len", 256)?,
        concurrency: a.parse_or("concurrency", 0)?,
        seed: a.parse_or("seed", 1234)?,
    };
    if s.requests == 0 || s.input_len == 0 || s.output_len == 0 {
        return Err("--num-requests, --input-len and --output-len must be at least 1".into());
    }
    if s.requests > MAX_REQUESTS {
        return Err(format!(
            "--num-requests {} exceeds the limit of {MAX_REQUESTS}",
            s.requests
        ));
    }
    let model = load_model(a)?;
    let vocab = model.config().vocab_size;
    let context = model.config().max_position_embeddings;
    // Every prompt is made up front: refuse lengths no request could have first.
    if s.input_len.saturating_add(s.output_len as usize) > context {
        return Err(format!(
            "--input-len {} + --output-len {} exceeds the model's context length {context}",
            s.input_len, s.output_len
        ));
    }
    let mut session = Session::new(model.clone(), session_params(a)?).map_err(|e| e.to_string())?;
    let mut rng = SplitMix64::new(s.seed);
    let prompts: Vec<Vec<u32>> = (0..s.requests)
        .map(|_| (0..s.input_len).map(|_| rng.below(vocab) as u32).collect())
        .collect();
    let limit = if s.concurrency == 0 {
        s.requests
    } else {
        s.concurrency
    };

    let start = Instant::now();
    let mut next = 0;
    let mut in_flight = 0;
    let mut timing: HashMap<u64, Timing> = HashMap::with_capacity(s.requests);
    let mut done = Vec::with_capacity(s.requests);
    let mut events = Vec::new();
    while done.len() < s.requests {
        while in_flight < limit && next < s.requests {
            let id = session
                .add_request(RequestParams {
                    prompt: prompts[next].clone(),
                    sampling: SamplingParams {
                        max_tokens: s.output_len,
                        ignore_eos: true,
                        ..Default::default()
                    },
                    ..Default::default()
                })
                .map_err(|e| format!("request {next}: {e}"))?;
            timing.insert(id, Timing::default());
            next += 1;
            in_flight += 1;
        }
        session.step_into(&mut events).map_err(|e| e.to_string())?;
        let now = start.elapsed().as_secs_f64();
        for e in &events {
            let t = timing.get_mut(&e.request_id).expect("known request");
            if !e.tokens.is_empty() {
                t.first.get_or_insert(now);
                t.last = now;
                t.tokens += e.tokens.len();
            }
            if let Some(reason) = &e.finish {
                if !matches!(reason, nanoinfer::engine::FinishReason::Length) {
                    return Err(format!("request {} ended with {reason:?}", e.request_id));
                }
                done.push(*t);
                in_flight -= 1;
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let stats = session.stats();
    let shape = session.params();

    let output_tokens: usize = done.iter().map(|t| t.tokens).sum();
    let ttft: Vec<f64> = done.iter().filter_map(|t| t.first).collect();
    let tpot: Vec<f64> = done
        .iter()
        .filter(|t| t.tokens > 1)
        .map(|t| (t.last - t.first.unwrap_or(t.last)) / (t.tokens - 1) as f64)
        .collect();
    let host_us = (stats.step_time_ns - stats.forward_time_ns) as f64 / 1e3 / stats.steps as f64;
    let report = json!({
        "num_requests": s.requests,
        "input_len": s.input_len,
        "output_len": s.output_len,
        "concurrency": s.concurrency,
        "max_seqs": shape.max_seqs,
        "max_batched_tokens": shape.max_batched_tokens,
        "prefill_chunk_size": shape.prefill_chunk_size,
        "duration_s": secs,
        "output_tokens_per_s": output_tokens as f64 / secs,
        "total_tokens_per_s": (output_tokens + s.requests * s.input_len) as f64 / secs,
        "ttft_ms": percentiles_ms(ttft),
        "tpot_ms": percentiles_ms(tpot),
        "steps": stats.steps,
        "chained_steps": stats.chained_steps,
        "preemptions": stats.preemptions,
        "host_us_per_step": host_us,
        "device": model.decoder.summary(),
    });
    if a.flag("json") {
        println!("{report}");
        return Ok(());
    }
    println!("{}", model.decoder.summary());
    println!("{}", stats.memory);
    println!(
        "{} requests x ({} prompt + {} output) tokens, concurrency {}, steps of up to {} sequences \
         and {} tokens: {secs:.2} s, {:.1} output tok/s, {:.1} total tok/s, {} steps ({} overlapped), \
         {} preemptions, host {host_us:.0} us/step",
        s.requests,
        s.input_len,
        s.output_len,
        if s.concurrency == 0 {
            "all".to_string()
        } else {
            s.concurrency.to_string()
        },
        shape.max_seqs,
        shape.max_batched_tokens,
        report["output_tokens_per_s"].as_f64().unwrap_or(0.0),
        report["total_tokens_per_s"].as_f64().unwrap_or(0.0),
        stats.steps,
        stats.chained_steps,
        stats.preemptions
    );
    for key in ["ttft_ms", "tpot_ms"] {
        let p = &report[key];
        println!(
            "{key}: mean {:.2}, p50 {:.2}, p90 {:.2}, p99 {:.2}",
            p["mean"].as_f64().unwrap_or(0.0),
            p["p50"].as_f64().unwrap_or(0.0),
            p["p90"].as_f64().unwrap_or(0.0),
            p["p99"].as_f64().unwrap_or(0.0)
        );
    }
    Ok(())
}

/// Mean and nearest-rank percentiles of `seconds`, in milliseconds.
fn percentiles_ms(mut seconds: Vec<f64>) -> serde_json::Value {
    seconds.sort_by(f64::total_cmp);
    let at = |q: f64| match seconds.len() {
        0 => 0.0,
        n => 1e3 * seconds[((q * n as f64).ceil() as usize).clamp(1, n) - 1],
    };
    let mean = 1e3 * seconds.iter().sum::<f64>() / seconds.len().max(1) as f64;
    json!({"mean": mean, "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)})
}
