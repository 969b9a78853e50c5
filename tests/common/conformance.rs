//! The op conformance suite of the device seam (`backend::layer_ops`): one
//! test body that every backend runs, against an independent f64 forward
//! written here from the architecture's definition.
//!
//! A backend fuses and defers inside its ops, so an op is checked where its
//! result is observable through the engine's contract (`ForwardContext`):
//! the keys and values written into the cache (`save_kv`) and the logits.
//! Each case zeroes projections to isolate ops:
//!
//! | isolate | zeroed | layer 1's keys/values then check | the logits check |
//! |---|---|---|---|
//! | `Head` | o, down | (embed again) | embed, final norm, LM head |
//! | `Attention` | down | attend, o product + residual, next norm, qkv | + final norm, head |
//! | `Mlp` | o | post norm, gate/up + SwiGLU, down + residual | + final norm, head |
//! | `Whole` | nothing | every op | every op |
//!
//! Layer 0's keys and values always check embed, the input norm, the QKV
//! product (its bias, the q/k norms), RoPE and the cache write.
//!
//! The steps mix what the backends run differently: a prefill of several
//! sequences, a batch of a decode row, a chunk continuing a prefix and a
//! fresh prompt, and a decode-only batch (which a GPU replays as a graph),
//! over paged and token-slot KV mappings with scattered slots.

use super::dequant::dequantized_copy;
use nanoinfer::engine::Model;
use nanoinfer::forward::{AttnSeq, KvMapping};
use nanoinfer::memory::MemoryPoolKind;
use nanoinfer::model::safetensors::WeightFiles;
use nanoinfer::model::{ContextShape, ForwardBatch, ModelConfig, QuantMode};
use nanoinfer::sampling::rng::SplitMix64;
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// The architecture family of a case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Untied LM head, no biases.
    Llama,
    /// q/k/v biases, tied LM head.
    Qwen2,
    /// q/k norms, biases on q/k/v/o (`attention_bias`), head_dim ≠ hidden / heads.
    Qwen3,
}

/// Which projections a case zeroes (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolate {
    Head,
    Attention,
    Mlp,
    Whole,
}

impl Isolate {
    pub const ALL: [Isolate; 4] = [
        Isolate::Head,
        Isolate::Attention,
        Isolate::Mlp,
        Isolate::Whole,
    ];

    /// The ops this case checks beyond layer 0's cache write.
    fn ops(self) -> &'static str {
        match self {
            Isolate::Head => "embed, final norm, LM head",
            Isolate::Attention => "attend, o product + residual, norm",
            Isolate::Mlp => "post norm, gate/up + SwiGLU, down + residual",
            Isolate::Whole => "the whole layer program",
        }
    }
}

/// A model shape of the suite.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub family: Family,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
}

/// The shapes every backend runs: GQA 2:1 and 4:1, head_dim 32 and 64.
pub fn shapes() -> [Shape; 3] {
    [
        Shape {
            family: Family::Llama,
            hidden: 128,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            intermediate: 256,
            vocab: 160,
        },
        Shape {
            family: Family::Qwen2,
            hidden: 256,
            heads: 4,
            kv_heads: 1,
            head_dim: 64,
            intermediate: 512,
            vocab: 192,
        },
        Shape {
            family: Family::Qwen3,
            hidden: 128,
            heads: 8,
            kv_heads: 2,
            head_dim: 32,
            intermediate: 384,
            vocab: 160,
        },
    ]
}

const LAYERS: usize = 2;
const EPS: f64 = 1e-6;
const THETA: f64 = 10000.0;

/// Uniform in [-a, a).
fn uniform(rng: &mut SplitMix64, a: f32) -> f32 {
    ((rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 * a
}

/// Writes a random-weight checkpoint of `s` with `isolate`'s projections
/// zeroed into `dir` (F32 tensors).
pub fn write_model(dir: &Path, s: &Shape, isolate: Isolate, seed: u64) {
    let arch = match s.family {
        Family::Llama => ("LlamaForCausalLM", "llama"),
        Family::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
        Family::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
    };
    let config = serde_json::json!({
        "architectures": [arch.0],
        "model_type": arch.1,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "vocab_size": s.vocab,
        "max_position_embeddings": 512,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "hidden_act": "silu",
        "attention_bias": s.family == Family::Qwen3,
        "tie_word_embeddings": s.family == Family::Qwen2,
        "torch_dtype": "float32",
    });
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut rng = SplitMix64::new(seed);
    let (d, hd) = (s.hidden, s.head_dim);
    let (nq, nkv, inter) = (s.heads * hd, s.kv_heads * hd, s.intermediate);
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    // Uniform in ±scale (all zero for scale 0).
    let add =
        |t: &mut Vec<_>, name: String, shape: Vec<usize>, scale: f32, rng: &mut SplitMix64| {
            let n: usize = shape.iter().product();
            let data = (0..n).map(|_| uniform(rng, scale)).collect();
            t.push((name, shape, data));
        };
    // Norm weights around 1, so that a norm applied with the wrong weight
    // (or none) shows.
    let norm = |t: &mut Vec<_>, name: String, n: usize, rng: &mut SplitMix64| {
        let data = (0..n).map(|_| 1.0 + uniform(rng, 0.5)).collect();
        t.push((name, vec![n], data));
    };
    // Scales keep activations O(1) through the layers.
    let w = 1.7 / (d as f32).sqrt();
    let t = &mut tensors;
    add(
        t,
        "model.embed_tokens.weight".into(),
        vec![s.vocab, d],
        1.0,
        &mut rng,
    );
    let zero_o = matches!(isolate, Isolate::Head | Isolate::Mlp);
    let zero_down = matches!(isolate, Isolate::Head | Isolate::Attention);
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        norm(t, format!("{p}.input_layernorm.weight"), d, &mut rng);
        norm(
            t,
            format!("{p}.post_attention_layernorm.weight"),
            d,
            &mut rng,
        );
        for (name, rows) in [("q_proj", nq), ("k_proj", nkv), ("v_proj", nkv)] {
            add(
                t,
                format!("{p}.self_attn.{name}.weight"),
                vec![rows, d],
                w,
                &mut rng,
            );
            if s.family != Family::Llama {
                add(
                    t,
                    format!("{p}.self_attn.{name}.bias"),
                    vec![rows],
                    0.5,
                    &mut rng,
                );
            }
        }
        if s.family == Family::Qwen3 {
            norm(t, format!("{p}.self_attn.q_norm.weight"), hd, &mut rng);
            norm(t, format!("{p}.self_attn.k_norm.weight"), hd, &mut rng);
            // A zeroed o product must add nothing, its bias included.
            let scale = if zero_o { 0.0 } else { 0.5 };
            add(
                t,
                format!("{p}.self_attn.o_proj.bias"),
                vec![d],
                scale,
                &mut rng,
            );
        }
        let o_scale = if zero_o {
            0.0
        } else {
            1.7 / (nq as f32).sqrt()
        };
        add(
            t,
            format!("{p}.self_attn.o_proj.weight"),
            vec![d, nq],
            o_scale,
            &mut rng,
        );
        add(
            t,
            format!("{p}.mlp.gate_proj.weight"),
            vec![inter, d],
            w,
            &mut rng,
        );
        add(
            t,
            format!("{p}.mlp.up_proj.weight"),
            vec![inter, d],
            w,
            &mut rng,
        );
        let down_scale = if zero_down {
            0.0
        } else {
            1.7 / (inter as f32).sqrt()
        };
        add(
            t,
            format!("{p}.mlp.down_proj.weight"),
            vec![d, inter],
            down_scale,
            &mut rng,
        );
    }
    norm(t, "model.norm.weight".into(), d, &mut rng);
    if s.family != Family::Qwen2 {
        add(t, "lm_head.weight".into(), vec![s.vocab, d], w, &mut rng);
    }
    save_f32(dir, tensors);
}

/// Writes `tensors` (name, shape, values) as `dir/model.safetensors` in F32.
fn save_f32(dir: &Path, tensors: Vec<(String, Vec<usize>, Vec<f32>)>) {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, shape, v)| (n, shape, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<_> = bytes
        .iter()
        .map(|(n, shape, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, shape.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::tensor::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// Multiplies tensor `name` of the F32 checkpoint `dir` by `factor` in place.
pub fn scale_tensor(dir: &Path, name: &str, factor: f32) {
    let files = WeightFiles::open(dir).unwrap();
    let mut found = false;
    let tensors = files
        .tensor_names()
        .map(|n| {
            let view = files.get(n).unwrap();
            let mut values = view.to_f32().unwrap().into_owned();
            if n == name {
                values.iter_mut().for_each(|v| *v *= factor);
                found = true;
            }
            (n.to_string(), view.shape.to_vec(), values)
        })
        .collect();
    drop(files);
    assert!(found, "no tensor {name} in {}", dir.display());
    save_f32(dir, tensors);
}

/// Writes an int4 checkpoint of the dense model `dense` (round to nearest,
/// groups of 32) to `int4`, and its dequantized F32 copy (the weights the
/// int4 kernels multiply, the reference's) to `reference`.
pub fn write_int4(dense: &Path, int4: &Path, reference: &Path) {
    let mode = QuantMode::Awq {
        group_size: 32,
        lm_head: false,
    };
    nanoinfer::quantize::quantize_checkpoint(dense, int4, mode).unwrap();
    let c = ModelConfig::from_dir(int4).unwrap();
    let method = mode.method().unwrap().expect("int4 is a quant method");
    dequantized_copy(int4, &c, &*method, reference);
}

/// The f64 reference forward over a checkpoint's F32 tensors.
pub struct Reference {
    c: ModelConfig,
    t: HashMap<String, Vec<f64>>,
}

/// What a forward of one whole sequence leaves: per position, per layer,
/// the cached key and value rows; per position, the logits.
pub struct SequenceTrace {
    /// `[position][layer]` → (k, v), each `kv_heads * head_dim`.
    pub kv: Vec<Vec<(Vec<f64>, Vec<f64>)>>,
    pub logits: Vec<Vec<f64>>,
}

fn rms_norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, g)| v * r * g).collect()
}

/// `y = W x (+ b)` for `W` of `[rows, x.len()]`.
fn product(w: &[f64], x: &[f64], b: Option<&Vec<f64>>) -> Vec<f64> {
    let cols = x.len();
    let mut y: Vec<f64> = w
        .chunks_exact(cols)
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect();
    if let Some(b) = b {
        y.iter_mut().zip(b).for_each(|(y, b)| *y += b);
    }
    y
}

/// HF rotate-half RoPE of one head at `pos`.
fn rope(head: &mut [f64], pos: usize, theta: f64) {
    let half = head.len() / 2;
    for i in 0..half {
        let inv = theta.powf(-((2 * i) as f64) / head.len() as f64);
        let (sin, cos) = (pos as f64 * inv).sin_cos();
        let (a, b) = (head[i], head[i + half]);
        head[i] = a * cos - b * sin;
        head[i + half] = b * cos + a * sin;
    }
}

impl Reference {
    pub fn open(dir: &Path) -> Reference {
        let c = ModelConfig::from_dir(dir).unwrap();
        let files = WeightFiles::open(dir).unwrap();
        let t = files
            .tensor_names()
            .map(|n| {
                let v = files.get(n).unwrap().to_f32().unwrap();
                (n.to_string(), v.iter().map(|&x| f64::from(x)).collect())
            })
            .collect();
        Reference { c, t }
    }

    /// Drops the tensors whose names end in `suffix` (an optional op,
    /// then left out), to show that the suite catches a wrong op.
    /// Returns how many were dropped.
    pub fn leave_out(&mut self, suffix: &str) -> usize {
        let before = self.t.len();
        self.t.retain(|name, _| !name.ends_with(suffix));
        before - self.t.len()
    }

    fn get(&self, name: &str) -> &Vec<f64> {
        self.t
            .get(name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }

    /// The forward of `tokens` as one sequence from position 0.
    pub fn run(&self, tokens: &[u32]) -> SequenceTrace {
        let c = &self.c;
        let (d, hd) = (c.hidden_size, c.head_dim);
        let (heads, kvh) = (c.num_heads, c.num_kv_heads);
        let eps = f64::from(c.rms_norm_eps);
        let theta = f64::from(c.rope_theta);
        let emb = self.get("model.embed_tokens.weight");
        let mut h: Vec<Vec<f64>> = tokens
            .iter()
            .map(|&t| emb[t as usize * d..(t as usize + 1) * d].to_vec())
            .collect();
        let n = tokens.len();
        let mut kv = vec![Vec::new(); n];
        for l in 0..c.num_layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            let bias = |s: &str| self.t.get(&p(s));
            let mut keys = Vec::new();
            let mut values = Vec::new();
            let mut queries = Vec::new();
            for (pos, x) in h.iter().enumerate() {
                let x = rms_norm(x, self.get(&p("input_layernorm.weight")), eps);
                let mut q = product(
                    self.get(&p("self_attn.q_proj.weight")),
                    &x,
                    bias("self_attn.q_proj.bias"),
                );
                let mut k = product(
                    self.get(&p("self_attn.k_proj.weight")),
                    &x,
                    bias("self_attn.k_proj.bias"),
                );
                let v = product(
                    self.get(&p("self_attn.v_proj.weight")),
                    &x,
                    bias("self_attn.v_proj.bias"),
                );
                for (heads, norm) in [
                    (&mut q, "self_attn.q_norm.weight"),
                    (&mut k, "self_attn.k_norm.weight"),
                ] {
                    for head in heads.chunks_exact_mut(hd) {
                        if let Some(w) = self.t.get(&p(norm)) {
                            let normed = rms_norm(head, w, eps);
                            head.copy_from_slice(&normed);
                        }
                        rope(head, pos, theta);
                    }
                }
                kv[pos].push((k.clone(), v.clone()));
                queries.push(q);
                keys.push(k);
                values.push(v);
            }
            let scale = 1.0 / (hd as f64).sqrt();
            for (pos, x) in h.iter_mut().enumerate() {
                let mut attn = vec![0f64; heads * hd];
                for head in 0..heads {
                    let g = head / (heads / kvh);
                    let q = &queries[pos][head * hd..(head + 1) * hd];
                    let scores: Vec<f64> = (0..=pos)
                        .map(|j| {
                            let k = &keys[j][g * hd..(g + 1) * hd];
                            q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() * scale
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for (j, e) in e.iter().enumerate() {
                        let v = &values[j][g * hd..(g + 1) * hd];
                        for i in 0..hd {
                            attn[head * hd + i] += e / sum * v[i];
                        }
                    }
                }
                let o = product(
                    self.get(&p("self_attn.o_proj.weight")),
                    &attn,
                    bias("self_attn.o_proj.bias"),
                );
                x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
                let y = rms_norm(x, self.get(&p("post_attention_layernorm.weight")), eps);
                let gate = product(self.get(&p("mlp.gate_proj.weight")), &y, None);
                let up = product(self.get(&p("mlp.up_proj.weight")), &y, None);
                let act: Vec<f64> = gate
                    .iter()
                    .zip(&up)
                    .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                    .collect();
                let down = product(self.get(&p("mlp.down_proj.weight")), &act, None);
                x.iter_mut().zip(&down).for_each(|(x, o)| *x += o);
            }
        }
        let head = self
            .t
            .get("lm_head.weight")
            .unwrap_or_else(|| self.get("model.embed_tokens.weight"));
        let logits = h
            .iter()
            .map(|x| product(head, &rms_norm(x, self.get("model.norm.weight"), eps), None))
            .collect();
        SequenceTrace { kv, logits }
    }
}

/// One sequence of a conformance run: its tokens, its KV slots and the
/// rows each step feeds.
struct Sequence {
    tokens: Vec<u32>,
    slots: Vec<u32>,
    /// Rows fed by each of the three steps (0: not in that step).
    steps: [usize; 3],
}

/// How a run maps positions onto slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapping {
    /// Blocks of 4 slots, handed out in a scattered order.
    Paged,
    /// A slot per position, scattered.
    Slots,
}

const BLOCK: usize = 4;

/// The worst deviation of a backend from the reference, relative to the
/// largest magnitude of what is compared (per row).
#[derive(Debug, Clone, Copy, Default)]
pub struct Deviation {
    pub layer0_kv: f64,
    pub layer1_kv: f64,
    pub logits: f64,
}

fn worst(rows: impl Iterator<Item = (Vec<f64>, Vec<f64>)>) -> f64 {
    let mut worst = 0f64;
    for (got, want) in rows {
        assert_eq!(got.len(), want.len());
        let scale = want.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
        for (g, w) in got.iter().zip(&want) {
            assert!(g.is_finite(), "a non-finite value");
            worst = worst.max((g - w).abs() / scale);
        }
    }
    worst
}

/// Runs the three conformance steps on `model` (a fresh context on
/// `pool`'s device) and returns its deviation from `reference`.
pub fn run(
    model: &Arc<Model>,
    pool: MemoryPoolKind,
    mapping: Mapping,
    reference: &Reference,
) -> Deviation {
    let c = model.config();
    let vocab = c.vocab_size;
    let mut rng = SplitMix64::new(99);
    // Three sequences: A is prefilled (9 rows), then decoded twice;
    // B prefilled (6), then a chunk of 5, then a decode row; C starts in
    // step 2 (7 rows) and decodes in step 3.
    let plans = [[9, 1, 1], [6, 5, 1], [0, 7, 1]];
    let mut next_block = 0u32;
    let mut seqs: Vec<Sequence> = plans
        .iter()
        .map(|steps| {
            let n: usize = steps.iter().sum();
            let tokens = (0..n).map(|_| rng.below(vocab) as u32).collect();
            Sequence {
                tokens,
                slots: Vec::new(),
                steps: *steps,
            }
        })
        .collect();
    // Scattered slots: blocks (or slots) dealt to the sequences in turn,
    // in a reversed order, slot 0 never used.
    let blocks_needed: usize = seqs.iter().map(|s| s.tokens.len().div_ceil(BLOCK)).sum();
    let total_slots = (blocks_needed + 1) * BLOCK;
    let mut free: Vec<u32> = (1..=blocks_needed as u32).collect();
    let mut free_slots: Vec<u32> = (1..total_slots as u32).rev().collect();
    for s in seqs.iter_mut() {
        match mapping {
            Mapping::Paged => {
                for _ in 0..s.tokens.len().div_ceil(BLOCK) {
                    let b = if next_block.is_multiple_of(2) {
                        free.pop()
                    } else {
                        Some(free.remove(0))
                    };
                    next_block += 1;
                    s.slots.push(b.unwrap());
                }
            }
            Mapping::Slots => {
                for i in 0..s.tokens.len() {
                    let slot = if i % 3 == 0 {
                        free_slots.remove(0)
                    } else {
                        free_slots.pop().unwrap()
                    };
                    s.slots.push(slot);
                }
            }
        }
    }
    fn kv_of(s: &Sequence, mapping: Mapping) -> KvMapping<'_> {
        match mapping {
            Mapping::Paged => KvMapping::Blocks {
                table: &s.slots,
                block_size: BLOCK,
            },
            Mapping::Slots => KvMapping::Slots(&s.slots),
        }
    }
    let max_rows = 16;
    let mut shape = ContextShape::new(total_slots, max_rows, 8);
    shape.memory_pool = pool;
    let mut ctx = model.decoder.clone().new_context(&shape).unwrap();
    let traces: Vec<SequenceTrace> = seqs.iter().map(|s| reference.run(&s.tokens)).collect();
    let mut got_logits = Vec::new();
    let mut want_logits = Vec::new();
    let mut done = vec![0usize; seqs.len()];
    for step in 0..3 {
        let mut tokens = Vec::new();
        let mut attn = Vec::new();
        let mut logits_rows = Vec::new();
        let mut wanted = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            let len = s.steps[step];
            if len == 0 {
                continue;
            }
            let start = tokens.len();
            tokens.extend_from_slice(&s.tokens[done[i]..done[i] + len]);
            attn.push(AttnSeq {
                start,
                len,
                context_len: done[i],
                kv: kv_of(s, mapping),
            });
            // The last row of each sequence, and a middle row of a chunk.
            if len > 2 {
                logits_rows.push(start + len / 2);
                wanted.push((i, done[i] + len / 2));
            }
            logits_rows.push(start + len - 1);
            wanted.push((i, done[i] + len - 1));
        }
        let batch = ForwardBatch {
            tokens: &tokens,
            seqs: &attn,
            logits_rows: &logits_rows,
            stop: None,
        };
        let mut logits = vec![0f32; logits_rows.len() * vocab];
        ctx.forward(&batch, &mut logits).unwrap();
        for (row, &(i, pos)) in wanted.iter().enumerate() {
            let got = &logits[row * vocab..(row + 1) * vocab];
            got_logits.push(got.iter().map(|&v| f64::from(v)).collect::<Vec<f64>>());
            want_logits.push(traces[i].logits[pos].clone());
        }
        for (i, s) in seqs.iter().enumerate() {
            done[i] += s.steps[step];
        }
    }
    let kv_width = c.num_kv_heads * c.head_dim;
    let mut layer_rows: [Vec<(Vec<f64>, Vec<f64>)>; 2] = [Vec::new(), Vec::new()];
    for (s, trace) in seqs.iter().zip(&traces) {
        let slot_of = kv_of(s, mapping);
        let slots: Vec<u32> = (0..s.tokens.len())
            .map(|p| slot_of.slot(p) as u32)
            .collect();
        let mut saved = Vec::new();
        ctx.save_kv(&slots, &mut saved).unwrap();
        let per_slot = 2 * kv_width * c.num_layers;
        for (pos, slot) in saved.chunks_exact(per_slot).enumerate() {
            for (l, rows) in layer_rows.iter_mut().enumerate() {
                let at = l * 2 * kv_width;
                let got: Vec<f64> = slot[at..at + 2 * kv_width]
                    .iter()
                    .map(|&v| f64::from(v))
                    .collect();
                let (k, v) = &trace.kv[pos][l];
                rows.push((got, k.iter().chain(v).copied().collect()));
            }
        }
    }
    let [l0, l1] = layer_rows;
    Deviation {
        layer0_kv: worst(l0.into_iter()),
        layer1_kv: worst(l1.into_iter()),
        logits: worst(got_logits.into_iter().zip(want_logits)),
    }
}

/// Loads a case's model from its dense checkpoint (see `check_backend`).
pub type LoadCase<'a> = dyn Fn(&Path, &Path) -> (Arc<Model>, std::path::PathBuf) + 'a;

/// Runs every shape × isolation × mapping on the backend `load` gives and
/// checks each deviation against `tolerance`; `label` names the backend
/// and weight format in failures. `load(dense, scratch)` loads the model
/// of dense checkpoint `dense` (writing any derived checkpoint under
/// `scratch`) and returns it with the checkpoint its reference reads.
pub fn check_backend(
    label: &str,
    scratch: &Path,
    pool: MemoryPoolKind,
    tolerance: f64,
    load: &LoadCase<'_>,
) -> Vec<String> {
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for (k, s) in shapes().iter().enumerate() {
        for (j, isolate) in Isolate::ALL.into_iter().enumerate() {
            let case = scratch.join(format!("{k}-{j}"));
            let dense = case.join("dense");
            write_model(&dense, s, isolate, 1000 + (k * 10 + j) as u64);
            let (model, reference_dir) = load(&dense, &case);
            let reference = Reference::open(&reference_dir);
            for mapping in [Mapping::Paged, Mapping::Slots] {
                let dev = run(&model, pool, mapping, &reference);
                let what = format!(
                    "{label} {:?} {isolate:?} ({}) {mapping:?}",
                    s.family,
                    isolate.ops()
                );
                report.push(format!(
                    "{what}: layer-0 KV {:.2e}, layer-1 KV {:.2e}, logits {:.2e}",
                    dev.layer0_kv, dev.layer1_kv, dev.logits
                ));
                for (part, v) in [
                    ("layer 0 keys/values", dev.layer0_kv),
                    ("layer 1 keys/values", dev.layer1_kv),
                    ("logits", dev.logits),
                ] {
                    // NaN fails too.
                    if v.is_nan() || v > tolerance {
                        failures.push(format!(
                            "{what}: {part} deviate by {v:.3e} (> {tolerance:.1e})"
                        ));
                    }
                }
            }
            let _ = std::fs::remove_dir_all(&case);
        }
    }
    assert!(
        failures.is_empty(),
        "{}\n\nall cases:\n{}",
        failures.join("\n"),
        report.join("\n")
    );
    report
}
