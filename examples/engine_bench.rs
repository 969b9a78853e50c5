//! Serving-engine benchmark: aggregate decode throughput at several
//! concurrencies, and time to first token of requests sharing a long prefix
//! with prefix caching on and off.
//!
//! ```text
//! cargo run --release --example engine_bench -- --model DIR [--threads 2] [--dtype bf16]
//!     [--device cpu|cuda] [--quant none|awq|gptq|q8_0] [--concurrency 1,4,16,64] [--decode-tokens 64] [--prompt-len 16]
//!     [--prefix-requests 32] [--prefix-len 1000] [--suffix-len 16] [--skip-decode] [--skip-prefix]
//!     [--offline N [--max-batched-tokens N] [--max-seqs N]] [--sampling greedy|device|host]
//!     [--kv-cache-dtype auto|fp8]
//! ```
//! `--sampling device|host` samples with temperature 0.8, top-k 50, top-p 0.95
//! and repetition penalty 1.1 on the device (a GPU) or on the host.
//! `--offline N` adds N requests of `--prompt-len` prompt and `--decode-tokens`
//! output tokens at once and reports output tokens per second of wall time
//! until the last one finishes (vLLM's offline throughput), then exits. Its
//! steps default to the session's automatic shape (`StepShape`: 512 tokens
//! and 64 sequences on the CPU, 8192 and 256 on a GPU), prefill chunks as
//! large as a step.
//! Prompts are seeded random token ids: speed does not depend on their text.

use nanoinfer::engine::{Model, ModelParams, RequestId, RequestParams, Session, SessionParams};
use nanoinfer::kv::KvCacheDType;
use nanoinfer::sampling::SamplingParams;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone)]
struct Opts {
    model: PathBuf,
    threads: usize,
    dtype: String,
    device: String,
    /// Quantization at load (`QuantMode` syntax).
    quant: String,
    concurrency: Vec<usize>,
    decode_tokens: u32,
    prompt_len: usize,
    prefix_requests: usize,
    prefix_len: usize,
    suffix_len: usize,
    skip_decode: bool,
    skip_prefix: bool,
    /// Offline throughput: this many requests added at once, run to the end.
    offline: usize,
    /// Step shape of `--offline` (0: the session's automatic one).
    max_batched_tokens: usize,
    max_seqs: usize,
    /// Build a random-weight model with this directory's config.json
    /// instead of loading `model` (same shapes, so the same speed).
    random_from: Option<PathBuf>,
    /// `greedy`, or `device` / `host`: temperature 0.8, top-k 50, top-p
    /// 0.95 and repetition penalty 1.1, sampled on the device or the host.
    sampling: String,
    kv_cache_dtype: KvCacheDType,
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts {
        model: PathBuf::from("models/SmolLM2-135M-Instruct"),
        threads: 2,
        dtype: "bf16".into(),
        device: "cpu".into(),
        quant: "none".into(),
        concurrency: vec![1, 4, 16, 64],
        decode_tokens: 64,
        prompt_len: 16,
        prefix_requests: 32,
        prefix_len: 1000,
        suffix_len: 16,
        skip_decode: false,
        skip_prefix: false,
        offline: 0,
        max_batched_tokens: 0,
        max_seqs: 0,
        random_from: None,
        sampling: "greedy".into(),
        kv_cache_dtype: KvCacheDType::Auto,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        if flag == "--skip-decode" || flag == "--skip-prefix" {
            o.skip_decode |= flag == "--skip-decode";
            o.skip_prefix |= flag == "--skip-prefix";
            i += 1;
            continue;
        }
        let v = args.get(i + 1).ok_or(format!("{flag} needs a value"))?;
        let num = |v: &str| v.parse::<usize>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag {
            "--model" => o.model = PathBuf::from(v),
            "--random-from" => o.random_from = Some(PathBuf::from(v)),
            "--threads" => o.threads = num(v)?,
            "--dtype" => o.dtype = v.clone(),
            "--device" => o.device = v.clone(),
            "--quant" => o.quant = v.clone(),
            "--concurrency" => o.concurrency = v.split(',').map(num).collect::<Result<_, _>>()?,
            "--decode-tokens" => o.decode_tokens = num(v)? as u32,
            "--prompt-len" => o.prompt_len = num(v)?,
            "--prefix-requests" => o.prefix_requests = num(v)?,
            "--prefix-len" => o.prefix_len = num(v)?,
            "--suffix-len" => o.suffix_len = num(v)?,
            "--offline" => o.offline = num(v)?,
            "--max-batched-tokens" => o.max_batched_tokens = num(v)?,
            "--max-seqs" => o.max_seqs = num(v)?,
            "--kv-cache-dtype" => o.kv_cache_dtype = v.parse()?,
            "--sampling" if ["greedy", "device", "host"].contains(&v.as_str()) => {
                o.sampling = v.clone()
            }
            _ => return Err(format!("unknown option {flag}")),
        }
        i += 2;
    }
    Ok(o)
}

/// Seeded token ids in 100..vocab (skips the special ids at the start).
fn tokens(seed: &mut u64, n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (100 + (*seed >> 33) as usize % (vocab - 100)) as u32
        })
        .collect()
}

fn request(o: &Opts, prompt: Vec<u32>, max_tokens: u32) -> RequestParams {
    let mut sampling = SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    };
    if o.sampling != "greedy" {
        sampling.temperature = 0.8;
        sampling.top_k = 50;
        sampling.top_p = 0.95;
        sampling.repetition_penalty = 1.1;
    }
    RequestParams {
        prompt,
        sampling,
        ..Default::default()
    }
}

fn session(
    model: &Arc<Model>,
    o: &Opts,
    prefix_caching: bool,
    max_seqs: usize,
    tokens: usize,
) -> Session {
    let params = SessionParams {
        kv_capacity_tokens: tokens.max(8192),
        max_seqs: max_seqs.max(64),
        prefix_caching,
        device_sampling: o.sampling != "host",
        kv_cache_dtype: o.kv_cache_dtype,
        ..Default::default()
    };
    Session::new(model.clone(), params).expect("session")
}

/// Aggregate decode tokens/s with `n` concurrent requests: time and tokens
/// of the steps that computed only decode rows.
fn decode_rate(model: &Arc<Model>, o: &Opts, n: usize) -> (f64, f64) {
    let vocab = model.config().vocab_size;
    let mut s = session(
        model,
        o,
        false,
        n,
        n * (o.prompt_len + o.decode_tokens as usize + 32),
    );
    let mut seed = 42 + n as u64;
    for _ in 0..n {
        s.add_request(request(
            o,
            tokens(&mut seed, o.prompt_len, vocab),
            o.decode_tokens,
        ))
        .unwrap();
    }
    let (mut secs, mut toks, mut batch_sum, mut steps) = (0.0, 0u64, 0usize, 0usize);
    while s.has_work() {
        let before = s.stats();
        let t = Instant::now();
        s.step().unwrap();
        let dt = t.elapsed().as_secs_f64();
        let after = s.stats();
        if after.prefill_tokens == before.prefill_tokens {
            let d = after.decode_tokens - before.decode_tokens;
            secs += dt;
            toks += d;
            batch_sum += d as usize;
            steps += 1;
        }
    }
    (toks as f64 / secs, batch_sum as f64 / steps.max(1) as f64)
}

/// Output tokens/s of `o.offline` requests added at once and run to the end.
fn offline_throughput(model: &Arc<Model>, o: &Opts) {
    let vocab = model.config().vocab_size;
    let per_request = o.prompt_len + o.decode_tokens as usize;
    let params = SessionParams {
        kv_capacity_tokens: 0,
        max_seqs: o.max_seqs,
        max_batched_tokens: o.max_batched_tokens,
        prefix_caching: false,
        device_sampling: o.sampling != "host",
        kv_cache_dtype: o.kv_cache_dtype,
        ..Default::default()
    };
    let mut s = Session::new(model.clone(), params).expect("session");
    println!("{}", s.stats().memory);
    let mut seed = 7;
    let t = Instant::now();
    for _ in 0..o.offline {
        s.add_request(request(
            o,
            tokens(&mut seed, o.prompt_len, vocab),
            o.decode_tokens,
        ))
        .unwrap();
    }
    let mut steps = 0;
    while s.has_work() {
        s.step().unwrap();
        steps += 1;
    }
    let secs = t.elapsed().as_secs_f64();
    let st = s.stats();
    println!(
        "offline: {} requests x ({} prompt + {} output) tokens, max_seqs {}, step budget {}: \
         {:.1} s, {:.0} output tok/s, {:.0} total tok/s, {steps} steps, {} preemptions, KV {} tokens",
        o.offline,
        o.prompt_len,
        o.decode_tokens,
        s.params().max_seqs,
        s.params().max_batched_tokens,
        secs,
        (o.offline * o.decode_tokens as usize) as f64 / secs,
        (o.offline * per_request) as f64 / secs,
        st.preemptions,
        st.kv_capacity_tokens
    );
}

struct PrefixRun {
    all_first_ms: f64,
    sum_ttft_ms: f64,
    computed: u64,
    cached: u64,
}

/// `prefix_requests` requests sharing `prefix_len` tokens, all submitted at
/// once, one output token each.
fn prefix_run(model: &Arc<Model>, o: &Opts, caching: bool) -> PrefixRun {
    let vocab = model.config().vocab_size;
    let mut seed = 7;
    let prefix = tokens(&mut seed, o.prefix_len, vocab);
    let mut s = session(model, o, caching, o.prefix_requests, 8192);
    let mut first: HashMap<RequestId, f64> = HashMap::new();
    let start = Instant::now();
    for _ in 0..o.prefix_requests {
        let mut p = prefix.clone();
        p.extend(tokens(&mut seed, o.suffix_len, vocab));
        s.add_request(request(o, p, 1)).unwrap();
    }
    while s.has_work() {
        for ev in s.step().unwrap() {
            if !ev.tokens.is_empty() {
                first
                    .entry(ev.request_id)
                    .or_insert(start.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    let st = s.stats();
    PrefixRun {
        all_first_ms: first.values().cloned().fold(0.0, f64::max),
        sum_ttft_ms: first.values().sum(),
        computed: st.prefill_tokens,
        cached: st.prefix_cached_tokens,
    }
}

/// Writes config.json (copied) + random BF16 weights of a Llama-architecture
/// model into a temp dir and returns it.
fn random_model(config_dir: &std::path::Path) -> PathBuf {
    use safetensors::tensor::{Dtype, TensorView};
    let c = nanoinfer::model::ModelConfig::from_dir(config_dir).expect("config.json");
    assert!(
        c.architecture.hf_name() == "LlamaForCausalLM" && !c.qkv_bias && !c.o_bias,
        "--random-from supports plain Llama configs"
    );
    let dir = std::env::temp_dir().join(format!("engine-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(config_dir.join("config.json"), dir.join("config.json")).unwrap();
    let (d, hd, inter, v) = (c.hidden_size, c.head_dim, c.intermediate_size, c.vocab_size);
    let (nq, nkv) = (c.num_heads * hd, c.num_kv_heads * hd);
    let mut shapes: Vec<(String, Vec<usize>)> =
        vec![("model.embed_tokens.weight".into(), vec![v, d])];
    for l in 0..c.num_layers {
        let p = format!("model.layers.{l}");
        shapes.push((format!("{p}.input_layernorm.weight"), vec![d]));
        shapes.push((format!("{p}.self_attn.q_proj.weight"), vec![nq, d]));
        shapes.push((format!("{p}.self_attn.k_proj.weight"), vec![nkv, d]));
        shapes.push((format!("{p}.self_attn.v_proj.weight"), vec![nkv, d]));
        shapes.push((format!("{p}.self_attn.o_proj.weight"), vec![d, nq]));
        shapes.push((format!("{p}.post_attention_layernorm.weight"), vec![d]));
        shapes.push((format!("{p}.mlp.gate_proj.weight"), vec![inter, d]));
        shapes.push((format!("{p}.mlp.up_proj.weight"), vec![inter, d]));
        shapes.push((format!("{p}.mlp.down_proj.weight"), vec![d, inter]));
    }
    shapes.push(("model.norm.weight".into(), vec![d]));
    if !c.tie_word_embeddings {
        shapes.push(("lm_head.weight".into(), vec![v, d]));
    }
    let mut seed = 1u64;
    let data: Vec<Vec<u8>> = shapes
        .iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            (0..n)
                .flat_map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let x = if name.ends_with("norm.weight") {
                        1.0
                    } else {
                        ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
                    };
                    half::bf16::from_f32(x).to_le_bytes()
                })
                .collect()
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = shapes
        .iter()
        .zip(&data)
        .map(|((n, s), b)| {
            (
                n.clone(),
                TensorView::new(Dtype::BF16, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}

fn main() {
    let o = parse().unwrap_or_else(|e| {
        eprintln!("engine_bench: {e}");
        std::process::exit(2)
    });
    let params = ModelParams {
        dtype: o.dtype.parse().expect("--dtype"),
        threads: o.threads,
        device: o.device.parse().expect("--device"),
        quant: o.quant.parse().expect("--quant"),
    };
    let model_dir = match &o.random_from {
        Some(cfg) => random_model(cfg),
        None => o.model.clone(),
    };
    let model = Arc::new(Model::load(&model_dir, &params, None).expect("loading the model"));
    println!(
        "model {}{} ({} weights), {} threads",
        o.random_from.as_ref().unwrap_or(&o.model).display(),
        if o.random_from.is_some() {
            " shapes, random weights"
        } else {
            ""
        },
        model.decoder.weight_dtype_name(),
        o.threads
    );
    if o.offline > 0 {
        offline_throughput(&model, &o);
        return;
    }
    // Warm-up: fault in the weights and start the pool.
    decode_rate(
        &model,
        &Opts {
            decode_tokens: 8,
            ..o.clone()
        },
        1,
    );

    if !o.skip_decode {
        println!(
            "\n| concurrent requests | aggregate decode tok/s | avg decode batch | vs 1 request |"
        );
        println!("|---:|---:|---:|---:|");
        let mut base = None;
        for &n in &o.concurrency {
            let (rate, batch) = decode_rate(&model, &o, n);
            let b = *base.get_or_insert(rate);
            println!("| {n} | {rate:.1} | {batch:.1} | {:.2}x |", rate / b);
        }
    }
    if !o.skip_prefix {
        println!(
            "\n{} requests sharing a {}-token prefix (+{} own tokens), 1 output token each:\n",
            o.prefix_requests, o.prefix_len, o.suffix_len
        );
        println!("| prefix caching | all first tokens (ms) | sum of TTFT (ms) | prefill tokens computed | tokens from cache |");
        println!("|---|---:|---:|---:|---:|");
        let mut runs = Vec::new();
        for caching in [true, false] {
            let r = prefix_run(&model, &o, caching);
            println!(
                "| {} | {:.0} | {:.0} | {} | {} |",
                if caching { "on" } else { "off" },
                r.all_first_ms,
                r.sum_ttft_ms,
                r.computed,
                r.cached
            );
            runs.push(r);
        }
        println!(
            "\nspeed-up with caching: {:.1}x (all first tokens), {:.1}x (sum of TTFT)",
            runs[1].all_first_ms / runs[0].all_first_ms,
            runs[1].sum_ttft_ms / runs[0].sum_ttft_ms
        );
    }
}
