//! `nanoinfer bench`: prompt-processing and decode throughput with
//! llama-bench's semantics, so the two tools' numbers compare directly.
//!
//! - pp<P>: one forward over a P-token prompt of random valid token ids
//!   (fixed seed), logits for the last row only.
//! - tg<N>: N single-token decode steps starting from an empty context
//!   (positions 0..N), each computing the logits of its token; the next token
//!   is random, not sampled, as in llama-bench.
//!
//! Each test runs once to warm up, then `--repetitions` times; the report is
//! the mean and sample standard deviation of the per-run tokens/s (what
//! llama-bench's `avg_ts`/`stddev_ts` are).
//!
//! With `--num-requests` it measures serving instead (see `serve_bench`).

use crate::args::Args;
use crate::serve_bench;
use crate::session_opts::{
    kv_cache_dtype, load_model, memory_pool, quant_mode, MODEL_OPTS, SESSION_OPTS,
};
use nanoinfer::engine::eval::SingleSequence;
use nanoinfer::engine::Model;
use nanoinfer::kv::KvCacheDType;
use nanoinfer::memory::MemoryPoolKind;
use nanoinfer::model::ModelConfig;
use nanoinfer::sampling::rng::SplitMix64;
use serde_json::json;
use std::time::Instant;

pub const FLAGS: &[&str] = &["json", "no-prefix-cache", "host-sampling"];
const OPTS: &[&str] = &[
    "n-prompt",
    "n-gen",
    "n-depth",
    "repetitions",
    "seed",
    "memory-pool",
    "kv-cache-dtype",
];

/// llama-bench's short options, mapped to the long ones `Args` understands.
const SHORT: &[(&str, &str)] = &[
    ("-p", "--n-prompt"),
    ("-n", "--n-gen"),
    ("-r", "--repetitions"),
    ("-t", "--threads"),
    ("-d", "--n-depth"),
    ("-m", "--model"),
];

/// Rewrites llama-bench style short options (`-p 512`) as long ones.
pub fn expand_short_options(argv: &[String]) -> Vec<String> {
    argv.iter()
        .map(|a| {
            SHORT
                .iter()
                .find(|(s, _)| s == a)
                .map_or_else(|| a.clone(), |(_, long)| long.to_string())
        })
        .collect()
}

/// Most repetitions of each measurement: enough for stable figures, and a
/// typo cannot keep the command running for days.
const MAX_REPETITIONS: usize = 1000;

#[derive(Debug)]
struct Settings {
    n_prompt: usize,
    n_gen: usize,
    /// tg starts after this many cached tokens (llama-bench's -d).
    n_depth: usize,
    repetitions: usize,
    seed: u64,
}

fn settings(a: &Args) -> Result<Settings, String> {
    a.check_known(&[MODEL_OPTS, FLAGS, OPTS].concat())?;
    quant_mode(a)?;
    memory_pool(a)?;
    let s = Settings {
        n_prompt: a.parse_or("n-prompt", 512)?,
        n_gen: a.parse_or("n-gen", 128)?,
        n_depth: a.parse_or("n-depth", 0)?,
        repetitions: a.parse_or("repetitions", 3)?,
        seed: a.parse_or("seed", 1234)?,
    };
    if s.repetitions == 0 || s.repetitions > MAX_REPETITIONS {
        return Err(format!(
            "--repetitions must be in 1..={MAX_REPETITIONS}, got {}",
            s.repetitions
        ));
    }
    Ok(s)
}

pub fn run(a: &Args) -> Result<(), String> {
    if a.get("num-requests").is_some() {
        a.check_known(&[MODEL_OPTS, SESSION_OPTS, FLAGS, OPTS, serve_bench::OPTS].concat())?;
        return serve_bench::run(a);
    }
    let s = settings(a)?;
    let model = load_model(a)?;
    let c = model.config();
    let longest = s.n_prompt.max(s.n_depth.saturating_add(s.n_gen));
    if longest > c.max_position_embeddings {
        return Err(format!(
            "-p/-n of {longest} tokens exceeds the model's context length {}",
            c.max_position_embeddings
        ));
    }
    let gpu = model.decoder.device() != nanoinfer::backend::Device::Cpu;
    let pool = memory_pool(a)?.unwrap_or(MemoryPoolKind::default_for(gpu));
    let kv_dtype = kv_cache_dtype(a)?;
    let rows = s.n_prompt.max(FILL_CHUNK);
    let mut bench = Bench::new(&model, longest, rows, s.seed, pool, kv_dtype)?;
    let pp = if s.n_prompt > 0 {
        Some(measure(s.repetitions, s.n_prompt, || {
            bench.prompt(s.n_prompt)
        })?)
    } else {
        None
    };
    let tg = if s.n_gen > 0 {
        bench.fill(s.n_depth)?;
        Some(measure(s.repetitions, s.n_gen, || {
            bench.generate(s.n_depth, s.n_gen)
        })?)
    } else {
        None
    };

    let dtype = model.decoder.weight_dtype_name();
    let threads = model.threads();
    let weight_bytes = model.decoder.weight_bytes();
    let mean = |r: &Option<Stats>| r.as_ref().map_or(0.0, |r| r.mean);
    let sd = |r: &Option<Stats>| r.as_ref().map_or(0.0, |r| r.stddev);
    if a.flag("json") {
        println!(
            "{}",
            json!({
                "pp_tokens_per_s": mean(&pp),
                "tg_tokens_per_s": mean(&tg),
                "pp_stddev": sd(&pp),
                "tg_stddev": sd(&tg),
                "n_prompt": s.n_prompt,
                "n_gen": s.n_gen,
                "n_depth": s.n_depth,
                "repetitions": s.repetitions,
                "threads": threads,
                "dtype": dtype,
                "weight_bytes": weight_bytes,
                "device": model.decoder.summary(),
                "params": param_count(c),
                "pp_flops_per_token": pp_flops_per_token(c, s.n_prompt),
            })
        );
        return Ok(());
    }
    println!(
        "model {} ({dtype}, {:.1} M params, {:.1} MB weights), {threads} threads, {} repetitions",
        a.get("model").unwrap_or(""),
        param_count(c) as f64 / 1e6,
        weight_bytes as f64 / 1e6,
        s.repetitions
    );
    println!("{}", model.decoder.summary());
    println!("| test           |              t/s |");
    println!("| -------------- | ---------------: |");
    let depth = match s.n_depth {
        0 => String::new(),
        d => format!(" @ d{d}"),
    };
    for (name, n, r) in [("pp", s.n_prompt, &pp), ("tg", s.n_gen, &tg)] {
        if let Some(r) = r {
            let at = if name == "tg" { depth.as_str() } else { "" };
            println!(
                "| {:<14} | {:>8.2} ± {:>5.2} |",
                format!("{name}{n}{at}"),
                r.mean,
                r.stddev
            );
        }
    }
    Ok(())
}

/// Prefill piece used to fill the cache before tg at depth.
const FILL_CHUNK: usize = 1024;

/// A model with a KV cache of `capacity` contiguous positions and a fixed
/// stream of random token ids.
struct Bench<'m> {
    model: &'m Model,
    seq: SingleSequence,
    logits: Vec<f32>,
    tokens: Vec<u32>,
}

impl<'m> Bench<'m> {
    /// Room for `capacity` positions, forwards of up to `max_rows` tokens.
    fn new(
        model: &'m Model,
        capacity: usize,
        max_rows: usize,
        seed: u64,
        pool: MemoryPoolKind,
        kv_dtype: KvCacheDType,
    ) -> Result<Self, String> {
        let c = model.config();
        let mut rng = SplitMix64::new(seed);
        Ok(Bench {
            model,
            seq: SingleSequence::with_options(
                model,
                capacity,
                max_rows.min(capacity),
                pool,
                kv_dtype,
            )
            .map_err(|e| e.to_string())?,
            logits: vec![0.0; c.vocab_size],
            tokens: (0..capacity)
                .map(|_| rng.below(c.vocab_size) as u32)
                .collect(),
        })
    }

    fn forward(&mut self, tokens: &[u32], context_len: usize) -> Result<(), String> {
        self.seq
            .forward(self.model, tokens, context_len, false, &mut self.logits)
            .map_err(|e| e.to_string())
    }

    fn prompt(&mut self, n: usize) -> Result<(), String> {
        let tokens = self.tokens[..n].to_vec();
        self.forward(&tokens, 0)
    }

    /// Caches positions `0..depth` (untimed) for tg at depth.
    fn fill(&mut self, depth: usize) -> Result<(), String> {
        for start in (0..depth).step_by(FILL_CHUNK) {
            let tokens = self.tokens[start..depth.min(start + FILL_CHUNK)].to_vec();
            self.forward(&tokens, start)?;
        }
        Ok(())
    }

    /// `n` single-token steps at positions `depth..depth + n`.
    fn generate(&mut self, depth: usize, n: usize) -> Result<(), String> {
        for pos in depth..depth + n {
            let tok = self.tokens[pos];
            self.forward(&[tok], pos)?;
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Stats {
    mean: f64,
    stddev: f64,
}

/// One warm-up run, then `reps` timed runs of `f`, each processing `tokens` tokens.
fn measure(
    reps: usize,
    tokens: usize,
    mut f: impl FnMut() -> Result<(), String>,
) -> Result<Stats, String> {
    f()?;
    let mut rates = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        rates.push(tokens as f64 / t.elapsed().as_secs_f64());
    }
    Ok(stats(&rates))
}

fn stats(xs: &[f64]) -> Stats {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let stddev = if xs.len() > 1 {
        (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
    } else {
        0.0
    };
    Stats { mean, stddev }
}

/// Parameters of the matmuls in the decoder layers.
fn layer_params(c: &ModelConfig) -> usize {
    let (d, nq, nkv) = (
        c.hidden_size,
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
    );
    c.num_layers * (d * nq + 2 * d * nkv + nq * d + 3 * d * c.intermediate_size)
}

/// All matrix parameters (embedding counted once when tied to the LM head).
fn param_count(c: &ModelConfig) -> usize {
    let head = c.vocab_size * c.hidden_size;
    layer_params(c)
        + if c.tie_word_embeddings {
            head
        } else {
            2 * head
        }
}

/// FLOPs per token of a `p`-token prompt forward: the layer matmuls, causal
/// attention (QK^T and PV over the positions each row sees) and the LM head
/// on the last row, spread over the prompt.
fn pp_flops_per_token(c: &ModelConfig, p: usize) -> f64 {
    if p == 0 {
        return 0.0;
    }
    let nq = (c.num_heads * c.head_dim) as f64;
    let avg_ctx = (p as f64 + 1.0) / 2.0;
    let attn = c.num_layers as f64 * 4.0 * nq * avg_ctx;
    let head = 2.0 * (c.vocab_size * c.hidden_size) as f64 / p as f64;
    2.0 * layer_params(c) as f64 + attn + head
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn short_options_map_to_long_ones() {
        let a = expand_short_options(&argv("--model m -p 64 -n 0 -r 5 -t 2 --json"));
        assert_eq!(
            a,
            argv("--model m --n-prompt 64 --n-gen 0 --repetitions 5 --threads 2 --json")
        );
        let parsed = Args::parse(&a, FLAGS).unwrap();
        let s = settings(&parsed).unwrap();
        assert_eq!((s.n_prompt, s.n_gen, s.repetitions), (64, 0, 5));
        assert!(parsed.flag("json"));
    }

    #[test]
    fn settings_reject_bad_values() {
        let parse =
            |s: &str| settings(&Args::parse(&expand_short_options(&argv(s)), FLAGS).unwrap());
        assert!(parse("-r 0").unwrap_err().contains("--repetitions"));
        let bad_quant = parse("--quant q4_0").unwrap_err();
        assert!(
            bad_quant.contains("--quant") && bad_quant.contains("q4_0"),
            "{bad_quant}"
        );
        assert!(parse("--quant q8_0 --quant-group-size 48")
            .unwrap_err()
            .contains("--quant-group-size"));
        assert!(parse("--quant q8_0").is_ok());
        assert!(parse("-p -3").unwrap_err().contains("--n-prompt"));
        assert!(parse("--bogus 1").unwrap_err().contains("--bogus"));
        let d = parse("").unwrap();
        assert_eq!((d.n_prompt, d.n_gen, d.repetitions), (512, 128, 3));
    }

    #[test]
    fn stats_are_mean_and_sample_stddev() {
        let s = stats(&[1.0, 2.0, 3.0, 4.0]);
        assert!((s.mean - 2.5).abs() < 1e-12);
        assert!((s.stddev - (5.0f64 / 3.0).sqrt()).abs() < 1e-12);
        assert_eq!(stats(&[7.0]).stddev, 0.0);
    }
}
