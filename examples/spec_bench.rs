//! Speculative decoding against plain decoding, in one run: the decode
//! speed of each input-grounded prompt (copying, correcting or editing a
//! given text, where prompt lookup drafts well) alone in a session (batch
//! 1), plainly, with n-gram lookup and with a draft model (by default an
//! int4 copy of the target, quantized at load); then, with `--batches`,
//! the output throughput of that many copies of the prompt set at once,
//! plain against n-gram, to find where speculation stops paying.
//!
//! ```text
//! cargo run --release --example spec_bench -- --model DIR [--threads 2]
//!     [--device cpu|cuda] [--dtype auto] [--draft-model DIR] [--draft-quant awq]
//!
//! The draft's LM head is quantized with its layers (int4 for awq/gptq).
//!     [--k 0] [--max-tokens 128] [--rounds 3] [--batches 1,2,4,8] [--shapes-only 1]
//!
//! `--shapes-only 1` prints only the target's forward times of verify
//! shapes against batches of decodes.
//!
//! `--k 0` is each method's default. The configurations take turns,
//! prompt by prompt, `--rounds` times; the figures are the medians over
//! the rounds of each configuration's decode rate over all prompts.
//! ```

use nanoinfer::engine::{
    Model, ModelParams, RequestParams, Session, SessionParams, SpeculativeParams,
};
use nanoinfer::forward::{AttnSeq, ForwardBatch, KvMapping};
use nanoinfer::model::{ContextShape, QuantMode};
use nanoinfer::sampling::SamplingParams;
use nanoinfer::tokenizer::ChatMessage;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

const PROMPTS: &[&str] = &[
    "Repeat the following text exactly, word for word:\n\nThe history of the Roman Empire begins \
     with the founding of the city of Rome in 753 BC. Over the following centuries Rome grew from \
     a small settlement into a republic, and in 27 BC Augustus became the first emperor. The \
     empire reached its greatest extent under Trajan in 117 AD, stretching from Britain to \
     Mesopotamia.",
    "Correct the spelling mistakes in this paragraph and return the whole corrected paragraph:\n\n\
     The quick brown fox jumpd over the lazy dog. Every mornig the dog slept in the sun while \
     the fox ran throught the forrest looking for food. One day the fox decided to play a trick \
     on the dog, but the dog was not as lazy as he looked.",
    "Rewrite this Python function with the variable `x` renamed to `count`. Return the whole \
     function:\n\ndef tally(items):\n    x = 0\n    for item in items:\n        if item.valid:\n\
     \x20           x = x + 1\n    print(\"valid items:\", x)\n    return x\n",
    "Here is a shopping list: apples, bread, milk, eggs, butter, cheese, tomatoes, onions, \
     garlic, rice, pasta, olive oil. Write the list again as a numbered list, one item per line.",
];

struct Args {
    model: PathBuf,
    threads: usize,
    device: nanoinfer::backend::Device,
    dtype: nanoinfer::model::WeightDType,
    draft_model: Option<PathBuf>,
    draft_quant: QuantMode,
    k: usize,
    max_tokens: u32,
    rounds: usize,
    shapes_only: bool,
    batches: Vec<usize>,
}

fn parse_args() -> Args {
    let mut a = Args {
        model: PathBuf::new(),
        threads: 2,
        device: nanoinfer::backend::Device::Cpu,
        dtype: nanoinfer::model::WeightDType::Auto,
        draft_model: None,
        draft_quant: QuantMode::Awq {
            group_size: 128,
            lm_head: true,
        },
        k: 0,
        max_tokens: 128,
        rounds: 3,
        shapes_only: false,
        batches: Vec::new(),
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    for pair in argv.chunks(2) {
        let v = pair.get(1).cloned().unwrap_or_default();
        match pair[0].as_str() {
            "--model" => a.model = v.into(),
            "--threads" => a.threads = v.parse().expect("--threads"),
            "--device" => a.device = v.parse().expect("--device"),
            "--dtype" => a.dtype = v.parse().expect("--dtype"),
            "--draft-model" => a.draft_model = Some(v.into()),
            "--draft-quant" => {
                a.draft_quant = v
                    .parse::<QuantMode>()
                    .expect("--draft-quant")
                    .with_lm_head()
            }
            "--k" => a.k = v.parse().expect("--k"),
            "--max-tokens" => a.max_tokens = v.parse().expect("--max-tokens"),
            "--rounds" => a.rounds = v.parse().expect("--rounds"),
            "--shapes-only" => a.shapes_only = v == "1",
            "--batches" => {
                a.batches = v
                    .split(',')
                    .map(|b| b.parse().expect("--batches"))
                    .collect()
            }
            other => panic!("unknown argument {other}"),
        }
    }
    assert!(!a.model.as_os_str().is_empty(), "--model DIR is required");
    a
}

/// What one configuration did over the prompts.
#[derive(Default, Clone, Copy)]
struct Run {
    tokens: usize,
    /// Seconds from each request's first token to its last, summed.
    decode_s: f64,
    /// Wall seconds of the whole batch.
    wall_s: f64,
    drafted: u64,
    kept: u64,
    verifications: u64,
}

fn run(
    model: &Arc<Model>,
    prompts: &[Vec<u32>],
    copies: usize,
    spec: Option<SpeculativeParams>,
    max_tokens: u32,
) -> (Run, Vec<Vec<u32>>) {
    let mut s = Session::new(
        model.clone(),
        SessionParams {
            kv_capacity_tokens: 16384,
            speculative: spec,
            ..Default::default()
        },
    )
    .expect("session");
    let mut ids = Vec::new();
    for _ in 0..copies {
        for p in prompts {
            let req = RequestParams {
                prompt: p.clone(),
                sampling: SamplingParams {
                    max_tokens,
                    ..Default::default()
                },
                ..Default::default()
            };
            ids.push(s.add_request(req).expect("request"));
        }
    }
    let start = Instant::now();
    let mut first = vec![None; ids.len()];
    let mut last = vec![0.0; ids.len()];
    let mut out = vec![Vec::new(); ids.len()];
    while s.has_work() {
        for ev in s.step().expect("step") {
            let i = ids.iter().position(|&id| id == ev.request_id).unwrap();
            if !ev.tokens.is_empty() {
                let now = start.elapsed().as_secs_f64();
                first[i].get_or_insert(now);
                last[i] = now;
                out[i].extend_from_slice(&ev.tokens);
            }
        }
    }
    let st = s.stats();
    let r = Run {
        tokens: out.iter().map(|o| o.len().saturating_sub(1)).sum(),
        decode_s: (0..ids.len())
            .map(|i| last[i] - first[i].unwrap_or(last[i]))
            .sum(),
        wall_s: start.elapsed().as_secs_f64(),
        drafted: st.spec_draft_tokens,
        kept: st.spec_accepted_tokens,
        verifications: st.spec_verifications,
    };
    (r, out)
}

/// Times forwards after `context` cached positions: one sequence of a
/// few rows, each row wanting its argmax (as a verify does), or several
/// one-row sequences over the same cached context (a batch of decodes).
struct StepTimer {
    ctx: Box<dyn nanoinfer::model::ForwardContext>,
    context: usize,
    /// Slots `1..=context` hold the context; each sequence's new rows
    /// write `MAX_ROWS` slots of its own after them.
    tokens: Vec<u32>,
}

/// Most rows (or sequences) one timed forward has.
const MAX_ROWS: usize = 17;

impl StepTimer {
    fn new(model: &Arc<Model>, context: usize) -> Self {
        let slots = context + MAX_ROWS * MAX_ROWS + 1;
        let mut shape = ContextShape::new(slots, context.max(64), 64);
        let gpu = model.decoder.device() != nanoinfer::backend::Device::Cpu;
        shape.memory_pool = nanoinfer::memory::MemoryPoolKind::default_for(gpu);
        let ctx = model.decoder.clone().new_context(&shape).expect("context");
        let mut t = StepTimer {
            ctx,
            context,
            tokens: (0..context + MAX_ROWS)
                .map(|i| (i as u32 * 7919) % 1000 + 10)
                .collect(),
        };
        let slots = t.slots(1);
        for from in (0..context).step_by(64) {
            let n = 64.min(context - from);
            t.forward(&[(from, n)], &slots, &[n - 1]);
        }
        t
    }

    /// The slot lists of `seqs` sequences, one after another.
    fn slots(&self, seqs: usize) -> Vec<u32> {
        let c = self.context;
        let mut slots = Vec::new();
        for s in 0..seqs {
            slots.extend(1..=c as u32);
            let own = (c + 1 + s * MAX_ROWS) as u32;
            slots.extend(own..own + MAX_ROWS as u32);
        }
        slots
    }

    /// One forward of sequences `(first position, rows)` over `slots`
    /// (each sequence's own after the shared context).
    fn forward(&mut self, seqs: &[(usize, usize)], slots: &[u32], logits: &[usize]) {
        let mut tokens = Vec::new();
        let mut maps = Vec::new();
        let per = self.context + MAX_ROWS;
        for (s, &(from, n)) in seqs.iter().enumerate() {
            maps.push(AttnSeq {
                start: tokens.len(),
                len: n,
                context_len: from,
                kv: KvMapping::Slots(&slots[s * per..(s + 1) * per]),
            });
            tokens.extend_from_slice(&self.tokens[from..from + n]);
        }
        let batch = ForwardBatch {
            tokens: &tokens,
            seqs: &maps,
            logits_rows: logits,
            stop: None,
        };
        let mut ids = vec![0u32; logits.len()];
        self.ctx.forward_argmax(&batch, &mut ids).expect("forward");
    }

    /// Seconds of one forward of `seqs` sequences of `rows` rows each.
    fn time(&mut self, seqs: usize, rows: usize) -> f64 {
        let slots = self.slots(seqs);
        let all: Vec<usize> = (0..seqs * rows).collect();
        let spans = vec![(self.context, rows); seqs];
        let t = Instant::now();
        self.forward(&spans, &slots, &all);
        t.elapsed().as_secs_f64()
    }
}

/// Median step times of a target decode, a target verify of `k + 1` rows
/// and a draft decode, measured in turns so that noise hits all three.
fn step_times(model: &Arc<Model>, draft: &Arc<Model>, context: usize, k: usize) -> [f64; 3] {
    let mut target = StepTimer::new(model, context);
    let mut drafter = StepTimer::new(draft, context);
    let mut times = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..31 {
        times[0].push(target.time(1, 1));
        times[1].push(target.time(1, k + 1));
        times[2].push(drafter.time(1, 1));
    }
    times.map(median)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Forward times of the target by shape: one sequence of 1 to 16 rows (a
/// verify) against as many one-row sequences (a batch of decodes).
fn verify_shapes(model: &Arc<Model>, context: usize) {
    let mut t = StepTimer::new(model, context);
    println!("\n| rows | one sequence (verify) ms | one-row sequences (decodes) ms |");
    println!("|---:|---:|---:|");
    for rows in [1, 2, 3, 4, 5, 8, 9, 16] {
        let (mut v, mut d) = (Vec::new(), Vec::new());
        for _ in 0..21 {
            v.push(t.time(1, rows));
            d.push(t.time(rows, 1));
        }
        println!(
            "| {rows} | {:.2} | {:.2} |",
            median(v) * 1e3,
            median(d) * 1e3
        );
    }
}

fn main() {
    let a = parse_args();
    let load = |dir: &PathBuf, quant: QuantMode| {
        let params = ModelParams {
            dtype: a.dtype,
            threads: a.threads,
            quant,
            device: a.device,
        };
        Arc::new(Model::load(dir, &params, None).expect("model"))
    };
    let model = load(&a.model, QuantMode::None);
    if a.shapes_only {
        verify_shapes(&model, 160);
        return;
    }
    let draft = load(a.draft_model.as_ref().unwrap_or(&a.model), a.draft_quant);
    let tok = model.tokenizer().expect("tokenizer");
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|text| {
            let chat = [ChatMessage {
                role: "user".into(),
                content: text.to_string(),
            }];
            let rendered = tok.apply_chat_template(&chat, true).expect("template");
            tok.encode(&rendered, false).expect("encode")
        })
        .collect();
    println!(
        "target: {}\ndraft: {}\nk = {}, {} prompts, up to {} tokens each",
        model.decoder.summary(),
        draft.decoder.summary(),
        a.k,
        prompts.len(),
        a.max_tokens
    );
    let configs: Vec<(&str, Option<SpeculativeParams>)> = vec![
        ("plain", None),
        ("ngram", Some(SpeculativeParams::ngram(a.k))),
        ("draft", Some(SpeculativeParams::draft(draft.clone(), a.k))),
    ];
    // Warm-up: first-use costs (page faults, thread start) out of the figures.
    run(&model, &prompts[..1], 1, None, 8);
    let mut plain_out: Vec<Vec<u32>> = Vec::new();
    // rates[config][round], per-prompt tokens/s of the last round.
    let mut rates = vec![Vec::new(); configs.len()];
    let mut kept = vec![(0u64, 0u64); configs.len()];
    let mut verified = vec![0u64; configs.len()];
    let mut diverged = Vec::new();
    let mut per_prompt = vec![vec![0.0; configs.len()]; prompts.len()];
    let mut lengths = vec![0; prompts.len()];
    for _ in 0..a.rounds {
        let mut totals = vec![Run::default(); configs.len()];
        for (pi, p) in prompts.iter().enumerate() {
            for (ci, (name, spec)) in configs.iter().enumerate() {
                let (r, out) = run(
                    &model,
                    std::slice::from_ref(p),
                    1,
                    spec.clone(),
                    a.max_tokens,
                );
                if plain_out.len() == pi {
                    plain_out.push(out[0].clone());
                    lengths[pi] = r.tokens;
                }
                // The tests check identity; a GPU's bf16 rounds differently
                // per batch shape, which flips near-ties of random weights.
                let same = out[0]
                    .iter()
                    .zip(&plain_out[pi])
                    .take_while(|(x, y)| x == y)
                    .count();
                if same < out[0].len().min(plain_out[pi].len()) {
                    diverged.push(format!("{name} prompt {pi} at token {same}"));
                }
                per_prompt[pi][ci] = r.tokens as f64 / r.decode_s;
                let t = &mut totals[ci];
                t.tokens += r.tokens;
                t.decode_s += r.decode_s;
                kept[ci].0 += r.drafted;
                kept[ci].1 += r.kept;
                verified[ci] += r.verifications;
            }
        }
        for (ci, t) in totals.iter().enumerate() {
            rates[ci].push(t.tokens as f64 / t.decode_s);
        }
    }
    println!(
        "\n| batch 1, per prompt (last round) | tokens | plain tok/s | ngram tok/s | draft tok/s |"
    );
    println!("|---|---:|---:|---:|---:|");
    for (pi, r) in per_prompt.iter().enumerate() {
        println!(
            "| prompt {pi} | {} | {:.1} | {:.1} | {:.1} |",
            lengths[pi], r[0], r[1], r[2]
        );
    }
    // Each round's ratio to the plain rate of the same round: the VM's
    // speed drifts between rounds more than within one.
    let ratio = |ci: usize| median((0..a.rounds).map(|r| rates[ci][r] / rates[0][r]).collect());
    let ratios: Vec<f64> = (0..configs.len()).map(ratio).collect();
    println!(
        "\n| batch 1, all prompts ({} rounds) | decode tok/s (median) | range | × plain (median of rounds) | drafts kept |",
        a.rounds
    );
    println!("|---|---:|---:|---:|---:|");
    for (ci, (name, _)) in configs.iter().enumerate() {
        rates[ci].sort_by(f64::total_cmp);
        let rate = median(rates[ci].clone());
        let (lo, hi) = (rates[ci][0], rates[ci][rates[ci].len() - 1]);
        let (drafted, k) = kept[ci];
        let kept = if drafted > 0 {
            format!("{:.0} % of {drafted}", 100.0 * k as f64 / drafted as f64)
        } else {
            "-".into()
        };
        println!(
            "| {name} | {rate:.1} | {lo:.1}-{hi:.1} | {:.2} | {kept} |",
            ratios[ci]
        );
    }
    if !diverged.is_empty() {
        println!("greedy output differs from plain decoding (near-ties): {diverged:?}");
    }
    // What a verifying step costs, and the speedup those step times allow
    // at the acceptance measured above: each verification yields
    // `1 + kept / verifications` tokens for one verify forward plus one
    // draft forward per drafted token.
    let context = prompts.iter().map(Vec::len).max().unwrap_or(64) + 32;
    let k = configs[2].1.as_ref().map_or(4, |s| s.max_k());
    let [t_decode, t_verify, t_draft] = step_times(&model, &draft, context, k);
    println!(
        "\nstep times at {context} positions: decode {:.2} ms, verify of {} rows {:.2} ms ({:.2}x), draft decode {:.2} ms",
        t_decode * 1e3,
        k + 1,
        t_verify * 1e3,
        t_verify / t_decode,
        t_draft * 1e3
    );
    let (drafted, k_kept) = kept[2];
    if verified[2] > 0 {
        let per_step = 1.0 + k_kept as f64 / verified[2] as f64;
        let drafts_per_step = drafted as f64 / verified[2] as f64;
        let ideal = per_step * t_decode / (drafts_per_step * t_draft + t_verify);
        let realized = ratios[2];
        println!(
            "draft: {per_step:.2} tokens per verify, {drafts_per_step:.2} drafted: ideal {ideal:.2}x, realized {realized:.2}x = {:.0} % of ideal",
            100.0 * realized / ideal
        );
    }
    if !a.batches.is_empty() {
        println!("\n| concurrent requests | plain tok/s | ngram tok/s | × plain |");
        println!("|---:|---:|---:|---:|");
        for &b in &a.batches {
            let copies = b.div_ceil(prompts.len());
            let ps = &prompts[..b.min(prompts.len())];
            let spec = SpeculativeParams {
                max_batch: 1 << 20,
                ..SpeculativeParams::ngram(a.k)
            };
            let (p, _) = run(&model, ps, copies, None, a.max_tokens);
            let (s, _) = run(&model, ps, copies, Some(spec), a.max_tokens);
            let (pr, sr) = (p.tokens as f64 / p.wall_s, s.tokens as f64 / s.wall_s);
            println!(
                "| {} | {pr:.1} | {sr:.1} | {:.2} |",
                copies * ps.len(),
                sr / pr
            );
        }
    }
}
