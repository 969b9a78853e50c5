//! What restoring a saved conversation saves: for prompts of `--lengths`
//! tokens (default 1024,8000), the time to the first token when the prompt
//! is computed (prefix caching off, so nothing is reused) against the time
//! to the first token when the conversation is restored from a state file
//! in a fresh session (reading the file, checking it, copying its KV in and
//! computing the one position it lacks), in the same run, `--rounds`
//! times per length (default 2: the first round pays first-use costs).
//! Also the save time and the file size.
//!
//! ```text
//! cargo run --release --example state_bench -- --model DIR [--threads 2]
//!     [--device cpu|cuda] [--lengths 1024,8000] [--rounds 2] [--dir /tmp]
//! ```

use nanoinfer::engine::{Model, ModelParams, RequestId, RequestParams, Session, SessionParams};
use nanoinfer::sampling::rng::SplitMix64;
use nanoinfer::sampling::SamplingParams;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

fn session(model: &Arc<Model>, tokens: usize) -> Session {
    Session::new(
        model.clone(),
        SessionParams {
            kv_capacity_tokens: tokens + 64,
            prefix_caching: false,
            ..Default::default()
        },
    )
    .expect("session")
}

/// Steps until `id` reports its first token; returns the seconds since
/// `from` (the request may still run).
fn first_token(s: &mut Session, id: RequestId, from: Instant) -> f64 {
    loop {
        let events = s.step().expect("step");
        if events
            .iter()
            .any(|e| e.request_id == id && !e.tokens.is_empty())
        {
            return from.elapsed().as_secs_f64();
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let model_dir = PathBuf::from(get("--model").expect("--model DIR"));
    let params = ModelParams {
        threads: get("--threads").map_or(0, |t| t.parse().unwrap()),
        device: get("--device").map_or(nanoinfer::backend::Device::Cpu, |d| d.parse().unwrap()),
        ..Default::default()
    };
    let lengths: Vec<usize> = get("--lengths")
        .unwrap_or_else(|| "1024,8000".into())
        .split(',')
        .map(|c| c.parse().unwrap())
        .collect();
    let dir =
        PathBuf::from(get("--dir").unwrap_or_else(|| std::env::temp_dir().display().to_string()));
    let model = Arc::new(Model::load(&model_dir, &params, None).expect("model"));
    let vocab = model.sample_vocab as u64;
    println!(
        "{:>7} {:>13} {:>9} {:>9} {:>13} {:>8}",
        "tokens", "recompute ms", "save ms", "file MB", "restore ms", "speedup"
    );
    // The first round at a length pays first-use costs (a GPU compiles
    // kernels and tunes GEMMs for new shapes): the later rounds are the figures.
    let rounds: usize = get("--rounds").map_or(2, |r| r.parse().unwrap());
    for &n in lengths.iter().flat_map(|n| std::iter::repeat_n(n, rounds)) {
        let mut rng = SplitMix64::new(n as u64);
        let prompt: Vec<u32> = (0..n).map(|_| (rng.next_u64() % vocab) as u32).collect();
        let request = |prompt: Vec<u32>, max_tokens| RequestParams {
            prompt,
            sampling: SamplingParams {
                max_tokens,
                ignore_eos: true,
                ..Default::default()
            },
            ..Default::default()
        };
        // The prompt computed: the time to its first token; then the
        // conversation saved while it runs.
        let mut s = session(&model, n);
        let started = Instant::now();
        let id = s.add_request(request(prompt.clone(), 2)).unwrap();
        let recompute = first_token(&mut s, id, started);
        let path = dir.join(format!("state_bench_{n}.nistate"));
        let started = Instant::now();
        s.save_state_file(id, &path).expect("save");
        let save = started.elapsed().as_secs_f64();
        drop(s);
        let bytes = std::fs::metadata(&path).unwrap().len();

        let mut fresh = session(&model, n);
        let started = Instant::now();
        let id = fresh
            .restore_request_file(&path, request(Vec::new(), 1))
            .expect("restore");
        let restore = first_token(&mut fresh, id, started);
        let _ = std::fs::remove_file(&path);
        println!(
            "{n:>7} {:>13.1} {:>9.1} {:>9.1} {:>13.1} {:>7.1}x",
            recompute * 1e3,
            save * 1e3,
            bytes as f64 / 1e6,
            restore * 1e3,
            recompute / restore
        );
    }
}
