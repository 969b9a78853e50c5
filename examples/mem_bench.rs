//! Memory-subsystem benchmarks (issue 6). T1 (allocator micro-benchmark)
//! is `cargo bench --bench alloc`; this binary covers the model-level ones:
//!
//! ```text
//! # T2: cold and hot load, mmap (Model::load) vs reading the files into the heap
//! cargo run --release --example mem_bench -- load DIR [--dtype auto|f32|bf16] [--reps 5]
//! # T3: engine step speed per memory pool, and the share of step time spent
//! #     acquiring (and zeroing) the step's temporaries
//! cargo run --release --example mem_bench -- decode DIR [--dtype f32] [--pools arena,slab,system]
//!     [--requests 4] [--prompt-len 128] [--tokens 64] [--threads 2]
//! # T6: RSS of a process holding the model (run two at once to see shared pages)
//! cargo run --release --example mem_bench -- rss DIR [--dtype f32] [--hold SECS]
//! ```
//! `scripts/mem_bench.sh` runs all of them.

use nanoinfer::engine::{Event, Model, ModelParams, RequestParams, Session, SessionParams};
use nanoinfer::memory::MemoryPoolKind;
use nanoinfer::model::WeightDType;
use nanoinfer::sampling::SamplingParams;
use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

type Res<T> = Result<T, String>;

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let result = match argv.first().map(String::as_str) {
        Some("load") => opts(&argv[1..]).and_then(|o| load(&o)),
        Some("decode") => opts(&argv[1..]).and_then(|o| decode(&o)),
        Some("rss") => opts(&argv[1..]).and_then(|o| rss(&o)),
        _ => Err("usage: mem_bench load|decode|rss DIR [options] (see the file's docs)".into()),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

struct Opts {
    dir: PathBuf,
    kv: HashMap<String, String>,
}

impl Opts {
    fn get<T: std::str::FromStr>(&self, name: &str, default: T) -> Res<T> {
        match self.kv.get(name) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| format!("bad --{name} `{v}`")),
        }
    }
    fn dtype(&self) -> Res<WeightDType> {
        self.kv.get("dtype").map_or(Ok(WeightDType::Auto), |v| {
            v.parse().map_err(|e: nanoinfer::Error| e.message)
        })
    }
    fn model_params(&self) -> Res<ModelParams> {
        Ok(ModelParams {
            dtype: self.dtype()?,
            threads: self.get("threads", 0)?,
            ..Default::default()
        })
    }
}

fn opts(args: &[String]) -> Res<Opts> {
    let dir = args.first().ok_or("the model directory is required")?;
    let mut kv = HashMap::new();
    let mut it = args[1..].iter();
    while let Some(a) = it.next() {
        let name = a.strip_prefix("--").ok_or(format!("unexpected `{a}`"))?;
        let value = it.next().ok_or(format!("--{name} needs a value"))?;
        kv.insert(name.to_string(), value.clone());
    }
    Ok(Opts {
        dir: PathBuf::from(dir),
        kv,
    })
}

fn safetensors_files(dir: &Path) -> Res<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!("no .safetensors file in {}", dir.display()));
    }
    Ok(files)
}

/// Asks the kernel to drop the files' clean pages from the page cache
/// (`POSIX_FADV_DONTNEED`: no root needed; pages another process maps stay).
fn drop_cache(files: &[PathBuf]) {
    for f in files {
        if let Ok(file) = File::open(f) {
            // SAFETY: a valid open descriptor; the call only records advice.
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
    }
}

/// Fraction of the files' pages in the page cache (mincore).
fn cached_fraction(files: &[PathBuf]) -> f64 {
    let (mut resident, mut total) = (0usize, 0usize);
    for f in files {
        let Ok(file) = File::open(f) else { continue };
        let len = file.metadata().map_or(0, |m| m.len() as usize);
        if len == 0 {
            continue;
        }
        // SAFETY: a read-only shared mapping of an open file, unmapped below;
        // mincore only reads the page tables.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            );
            if p == libc::MAP_FAILED {
                continue;
            }
            let pages = len.div_ceil(4096);
            let mut vec = vec![0u8; pages];
            if libc::mincore(p, len, vec.as_mut_ptr()) == 0 {
                resident += vec.iter().filter(|&&b| b & 1 == 1).count();
                total += pages;
            }
            libc::munmap(p, len);
        }
    }
    if total == 0 {
        0.0
    } else {
        resident as f64 / total as f64
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// T2.
fn load(o: &Opts) -> Res<()> {
    let files = safetensors_files(&o.dir)?;
    let bytes: u64 = files
        .iter()
        .map(|f| std::fs::metadata(f).map_or(0, |m| m.len()))
        .sum();
    let reps: usize = o.get("reps", 5)?;
    let params = o.model_params()?;
    let load_model = || -> Res<(f64, Model)> {
        let start = Instant::now();
        let m = Model::load(&o.dir, &params, None).map_err(|e| e.to_string())?;
        Ok((ms(start.elapsed()), m))
    };
    let read_heap = || -> Res<f64> {
        let start = Instant::now();
        let mut total = 0;
        for f in &files {
            total += std::hint::black_box(std::fs::read(f).map_err(|e| e.to_string())?).len();
        }
        assert_eq!(total as u64, bytes);
        Ok(ms(start.elapsed()))
    };
    println!(
        "model {} ({:.1} MB of safetensors), {reps} repetitions, median ms",
        o.dir.display(),
        bytes as f64 / 1e6
    );
    let (mut cold_mmap, mut cold_read, mut cached_after_drop) = (vec![], vec![], vec![]);
    let mut dtype = "";
    for _ in 0..reps {
        drop_cache(&files);
        cached_after_drop.push(cached_fraction(&files));
        let (t, m) = load_model()?;
        dtype = m.decoder.weight_dtype_name();
        cold_mmap.push(t);
        drop(m);
        drop_cache(&files);
        cold_read.push(read_heap()?);
    }
    read_heap()?;
    let (mut hot_mmap, mut hot_read) = (vec![], vec![]);
    for _ in 0..reps {
        hot_mmap.push(load_model()?.0);
        hot_read.push(read_heap()?);
    }
    // Where the time goes, stage by stage (median of the reps).
    let (mut cold_stages, mut hot_stages): (Vec<[f64; 5]>, Vec<[f64; 5]>) = (vec![], vec![]);
    for _ in 0..reps {
        drop_cache(&files);
        cold_stages.push(load_stages(&o.dir, &params)?);
        hot_stages.push(load_stages(&o.dir, &params)?);
    }
    let stage = |v: &[[f64; 5]], i: usize| median(v.iter().map(|s| s[i]).collect());
    let weights_only = |v: &[[f64; 5]]| stage(v, 0) + stage(v, 1) + stage(v, 2);
    println!(
        "page cache after POSIX_FADV_DONTNEED: {:.0}% resident (100% = the drop was refused or the pages are mapped elsewhere)",
        median(cached_after_drop) * 100.0
    );
    println!("| load ({dtype} weights) | cold ms | hot ms |");
    println!("| --- | ---: | ---: |");
    println!(
        "| Model::load (mmap, zero-copy where the dtype is stored) | {:.1} | {:.1} |",
        median(cold_mmap),
        median(hot_mmap)
    );
    println!(
        "| weights only: config + open/mmap + Decoder::load | {:.1} | {:.1} |",
        weights_only(&cold_stages),
        weights_only(&hot_stages)
    );
    println!(
        "| tokenizer.json (part of Model::load) | {:.1} | {:.1} |",
        stage(&cold_stages, 4),
        stage(&hot_stages, 4)
    );
    println!(
        "| read the files into the heap (fs::read only, no model built) | {:.1} | {:.1} |",
        median(cold_read),
        median(hot_read)
    );
    Ok(())
}

/// Hot-load stages of `Model::load` on the CPU, timed one by one (ms).
fn load_stages(dir: &Path, params: &ModelParams) -> Res<[f64; 5]> {
    let e = |e: nanoinfer::Error| e.to_string();
    let t = Instant::now();
    let config = nanoinfer::model::ModelConfig::from_dir(dir).map_err(e)?;
    let config_ms = ms(t.elapsed());
    let t = Instant::now();
    let weights = nanoinfer::model::loader::open_weights(dir).map_err(e)?;
    let open_ms = ms(t.elapsed());
    let t = Instant::now();
    let decoder =
        nanoinfer::model::Decoder::load(config, &weights, params.dtype, params.quant).map_err(e)?;
    weights.finish_loading();
    let weights_ms = ms(t.elapsed());
    let t = Instant::now();
    let pool = nanoinfer::backend::cpu::ThreadPool::new(2);
    let pool_ms = ms(t.elapsed());
    let t = Instant::now();
    let tokenizer = nanoinfer::tokenizer::Tokenizer::from_dir(dir).map_err(e)?;
    let tokenizer_ms = ms(t.elapsed());
    drop((decoder, pool, tokenizer, weights));
    Ok([config_ms, open_ms, weights_ms, pool_ms, tokenizer_ms])
}

/// T3.
fn decode(o: &Opts) -> Res<()> {
    let params = ModelParams {
        threads: o.get("threads", 2)?,
        ..o.model_params()?
    };
    let model = Arc::new(Model {
        tokenizer: None, // token ids only: measure the engine, not detokenization
        ..Model::load(&o.dir, &params, None).map_err(|e| e.to_string())?
    });
    let requests: usize = o.get("requests", 4)?;
    let prompt_len: usize = o.get("prompt-len", 128)?;
    let tokens: u32 = o.get("tokens", 64)?;
    let rounds: usize = o.get("rounds", 2)?;
    let pools: Vec<MemoryPoolKind> =
        o.kv.get("pools")
            .map_or("arena,slab,system", String::as_str)
            .split(',')
            .map(|p| p.parse().map_err(|e: nanoinfer::Error| e.message))
            .collect::<Res<_>>()?;
    let vocab = model.config().vocab_size as u64;
    println!(
        "{} ({}), {} threads: {requests} concurrent greedy requests, {prompt_len}-token prompts \
         (one prefill step each), {tokens} tokens each; best of {rounds} rounds",
        o.dir.display(),
        model.decoder.weight_dtype_name(),
        model.threads()
    );
    println!(
        "| pool | decode tok/s | decode step ms | acquire µs/decode step (share) | system allocs/decode step | prefill tok/s | acquire µs/prefill step (share) |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for pool in pools {
        let mut best: Option<Measured> = None;
        for round in 0..rounds {
            let m = run_pool(
                &model,
                pool,
                requests,
                prompt_len,
                tokens,
                vocab,
                round as u64,
            )?;
            if best.as_ref().is_none_or(|b| m.decode_s < b.decode_s) {
                best = Some(m);
            }
        }
        let m = best.expect("at least one round");
        let share = |ns: u64, s: f64| ns as f64 / 1e9 / s * 100.0;
        println!(
            "| {pool} | {:.1} | {:.2} | {:.1} ({:.2}%) | {:.1} | {:.1} | {:.1} ({:.2}%) |",
            m.decode_tokens as f64 / m.decode_s,
            m.decode_s * 1e3 / m.decode_steps as f64,
            m.decode_acquire_ns as f64 / 1e3 / m.decode_steps as f64,
            share(m.decode_acquire_ns, m.decode_s),
            m.decode_sys_allocs as f64 / m.decode_steps as f64,
            m.prefill_tokens as f64 / m.prefill_s,
            m.prefill_acquire_ns as f64 / 1e3 / m.prefill_steps.max(1) as f64,
            share(m.prefill_acquire_ns, m.prefill_s),
        );
    }
    Ok(())
}

#[derive(Default)]
struct Measured {
    decode_tokens: u64,
    decode_steps: u64,
    decode_s: f64,
    decode_acquire_ns: u64,
    decode_sys_allocs: u64,
    prefill_tokens: u64,
    prefill_steps: u64,
    prefill_s: f64,
    prefill_acquire_ns: u64,
}

fn run_pool(
    model: &Arc<Model>,
    pool: MemoryPoolKind,
    requests: usize,
    prompt_len: usize,
    tokens: u32,
    vocab: u64,
    seed: u64,
) -> Res<Measured> {
    let params = SessionParams {
        kv_capacity_tokens: requests * (prompt_len + tokens as usize) + 64,
        max_seqs: requests,
        max_batched_tokens: requests * prompt_len,
        prefill_chunk_size: prompt_len,
        memory_pool: Some(pool),
        prefix_caching: false,
        ..Default::default()
    };
    let mut session = Session::new(model.clone(), params).map_err(|e| e.to_string())?;
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for _ in 0..requests {
        let prompt = (0..prompt_len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state % vocab) as u32
            })
            .collect();
        session
            .add_request(RequestParams {
                prompt,
                sampling: SamplingParams {
                    max_tokens: tokens,
                    temperature: 0.0,
                    ignore_eos: true,
                    ..Default::default()
                },
                ..Default::default()
            })
            .map_err(|e| e.to_string())?;
    }
    let mut events: Vec<Event> = Vec::new();
    let mut m = Measured::default();
    while session.has_work() {
        let before = session.stats();
        let start = Instant::now();
        session.step_into(&mut events).map_err(|e| e.to_string())?;
        let spent = start.elapsed().as_secs_f64();
        let after = session.stats();
        let (wb, wa) = (
            before.workspace.unwrap_or_default(),
            after.workspace.unwrap_or_default(),
        );
        let acquire = wa.acquire_ns - wb.acquire_ns;
        let prefill = after.prefill_tokens - before.prefill_tokens;
        let decoded = after.decode_tokens - before.decode_tokens;
        if prefill > 0 {
            m.prefill_tokens += prefill;
            m.prefill_steps += 1;
            m.prefill_s += spent;
            m.prefill_acquire_ns += acquire;
        } else if decoded > 0 {
            m.decode_tokens += decoded;
            m.decode_steps += 1;
            m.decode_s += spent;
            m.decode_acquire_ns += acquire;
            m.decode_sys_allocs +=
                wa.pool_stats.system_allocations - wb.pool_stats.system_allocations;
        }
    }
    Ok(m)
}

/// T6: RSS of this process once the model is loaded (and, with
/// `--forward N`, has run one N-token forward, so every weight page is
/// touched), split by kind; printed again after `--hold SECS`.
fn rss(o: &Opts) -> Res<()> {
    let hold: f64 = o.get("hold", 0.0)?;
    let forward: usize = o.get("forward", 0)?;
    let start = Instant::now();
    let model = Model::load(&o.dir, &o.model_params()?, None).map_err(|e| e.to_string())?;
    let load_ms = ms(start.elapsed());
    if forward > 0 {
        let mut seq = nanoinfer::engine::eval::SingleSequence::new(&model, forward, forward)
            .map_err(|e| e.to_string())?;
        let tokens: Vec<u32> = (0..forward as u32).map(|t| t * 7 % 1000).collect();
        let mut logits = Vec::new();
        seq.forward(&model, &tokens, 0, false, &mut logits)
            .map_err(|e| e.to_string())?;
    }
    let report = |when: &str| {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
        let field = |text: &str, key: &str| -> f64 {
            text.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| {
                    l[key.len()..]
                        .trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<f64>()
                        .ok()
                })
                .map_or(f64::NAN, |kib| kib / 1024.0)
        };
        println!(
            "pid {} {when}: RSS {:.1} MiB (anon {:.1}, file {:.1}); shared with other processes \
             {:.1} MiB, private {:.1} MiB; peak RSS {:.1} MiB",
            std::process::id(),
            field(&status, "VmRSS:"),
            field(&status, "RssAnon:"),
            field(&status, "RssFile:"),
            field(&rollup, "Shared_Clean:") + field(&rollup, "Shared_Dirty:"),
            field(&rollup, "Private_Clean:") + field(&rollup, "Private_Dirty:"),
            field(&status, "VmHWM:"),
        );
    };
    report(&format!(
        "loaded {} ({}, {:.1} MB of weights) in {load_ms:.1} ms{}",
        o.dir.display(),
        model.decoder.weight_dtype_name(),
        model.decoder.weight_bytes() as f64 / 1e6,
        if forward > 0 {
            format!(", ran a {forward}-token forward")
        } else {
            String::new()
        }
    ));
    if hold > 0.0 {
        std::thread::sleep(Duration::from_secs_f64(hold));
        report("after the hold");
    }
    drop(model);
    Ok(())
}
