//! Shared helpers for the engine integration tests: a tiny random-weight
//! Llama model written to a temp dir, session drivers that check the event
//! contract, and reference runs of one request alone.
#![allow(dead_code)]

use nanoinfer::engine::{
    Event, FinishReason, Model, ModelParams, RequestId, RequestParams, Session, SessionParams,
    Usage,
};
use nanoinfer::kv::KvBackendKind;
use nanoinfer::model::WeightDType;
use nanoinfer::sampling::SamplingParams;
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Shape of the generated model.
#[derive(Debug, Clone)]
pub struct TinySpec {
    pub seed: u64,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub max_positions: usize,
    /// Written as `eos_token_id` when set (otherwise the model has no EOS).
    pub eos: Option<u32>,
}

impl Default for TinySpec {
    fn default() -> Self {
        TinySpec {
            seed: 7,
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            intermediate: 128,
            vocab: 128,
            max_positions: 2048,
            eos: None,
        }
    }
}

/// SplitMix64: a tiny deterministic generator for weights and test inputs.
#[derive(Clone)]
pub struct TestRng(u64);

impl TestRng {
    pub fn new(seed: u64) -> Self {
        TestRng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo) as u64) as usize
    }
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
    /// Approximately normal (sum of uniforms), scaled by `std`.
    pub fn normal(&mut self, std: f32) -> f32 {
        let s: f64 = (0..4)
            .map(|_| (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
            .sum();
        ((s - 2.0) * (3.0f64).sqrt()) as f32 * std
    }
    pub fn tokens(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|_| self.range(0, vocab) as u32).collect()
    }
}

/// A directory removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("nanoinfer-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating a temp dir");
        TempDir(dir)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes config.json + model.safetensors of a random Llama model into `dir`.
/// Weights are larger than a trained init so logits are peaked and greedy
/// decoding depends strongly on the context.
pub fn write_tiny_llama(dir: &Path, spec: &TinySpec) {
    let hd = spec.hidden / spec.heads;
    let mut config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": false,
        "torch_dtype": "float32",
    });
    if let Some(eos) = spec.eos {
        config["eos_token_id"] = eos.into();
    }
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config).unwrap(),
    )
    .unwrap();

    let mut rng = TestRng::new(spec.seed);
    let (d, inter, v) = (spec.hidden, spec.intermediate, spec.vocab);
    let (nq, nkv) = (spec.heads * hd, spec.kv_heads * hd);
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, std: f32, rng: &mut TestRng| {
        let n: usize = shape.iter().product();
        let data = if std == 0.0 {
            vec![1.0; n]
        } else {
            (0..n).map(|_| rng.normal(std)).collect()
        };
        tensors.push((name, shape, data));
    };
    let w = 1.0 / (d as f32).sqrt();
    add(
        "model.embed_tokens.weight".into(),
        vec![v, d],
        1.0,
        &mut rng,
    );
    for l in 0..spec.layers {
        let p = format!("model.layers.{l}");
        add(
            format!("{p}.input_layernorm.weight"),
            vec![d],
            0.0,
            &mut rng,
        );
        add(
            format!("{p}.self_attn.q_proj.weight"),
            vec![nq, d],
            3.0 * w,
            &mut rng,
        );
        add(
            format!("{p}.self_attn.k_proj.weight"),
            vec![nkv, d],
            3.0 * w,
            &mut rng,
        );
        add(
            format!("{p}.self_attn.v_proj.weight"),
            vec![nkv, d],
            2.0 * w,
            &mut rng,
        );
        add(
            format!("{p}.self_attn.o_proj.weight"),
            vec![d, nq],
            2.0 * w,
            &mut rng,
        );
        add(
            format!("{p}.post_attention_layernorm.weight"),
            vec![d],
            0.0,
            &mut rng,
        );
        add(
            format!("{p}.mlp.gate_proj.weight"),
            vec![inter, d],
            2.0 * w,
            &mut rng,
        );
        add(
            format!("{p}.mlp.up_proj.weight"),
            vec![inter, d],
            2.0 * w,
            &mut rng,
        );
        add(
            format!("{p}.mlp.down_proj.weight"),
            vec![d, inter],
            2.0 / (inter as f32).sqrt(),
            &mut rng,
        );
    }
    add("model.norm.weight".into(), vec![d], 0.0, &mut rng);
    add("lm_head.weight".into(), vec![v, d], 4.0 * w, &mut rng);

    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, data)| (n, s, data.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// A loaded tiny model; its directory lives as long as this value.
pub struct TinyModel {
    pub model: Arc<Model>,
    _dir: TempDir,
}

impl std::ops::Deref for TinyModel {
    type Target = Arc<Model>;
    fn deref(&self) -> &Arc<Model> {
        &self.model
    }
}

pub fn tiny_model(spec: &TinySpec) -> TinyModel {
    let dir = TempDir::new("tiny-llama");
    write_tiny_llama(dir.path(), spec);
    let params = ModelParams {
        dtype: WeightDType::F32,
        threads: 1,
        ..Default::default()
    };
    let model = Model::load(dir.path(), &params, None).expect("loading the tiny model");
    TinyModel {
        model: Arc::new(model),
        _dir: dir,
    }
}

pub fn default_tiny() -> TinyModel {
    tiny_model(&TinySpec::default())
}

pub fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ..Default::default()
    }
}

pub fn request(prompt: Vec<u32>, max_tokens: u32) -> RequestParams {
    RequestParams {
        prompt,
        sampling: greedy(max_tokens),
        ..Default::default()
    }
}

pub fn session_params(
    kv: KvBackendKind,
    block_size: usize,
    capacity: usize,
    chunk: usize,
    prefix: bool,
) -> SessionParams {
    SessionParams {
        kv_backend: kv,
        block_size,
        kv_capacity_tokens: capacity,
        prefill_chunk_size: chunk,
        prefix_caching: prefix,
        ..Default::default()
    }
}

/// What one request produced, as collected from its events.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: Option<FinishReason>,
    /// Step index (0-based, counted by the driver) of the first event with a token.
    pub first_token_step: Option<usize>,
    pub finish_step: Option<usize>,
    /// The terminal event's usage.
    pub usage: Option<Usage>,
}

/// Collects events and enforces the event contract: at most one event per
/// request per step, nothing after the terminal event, exactly one terminal
/// event per request by the end, usage on that event only, agreeing with
/// the tokens the events carried.
#[derive(Default)]
pub struct EventLog {
    pub outcomes: HashMap<RequestId, Outcome>,
    pub steps: usize,
}

impl EventLog {
    pub fn expect(&mut self, id: RequestId) {
        assert!(
            self.outcomes.insert(id, Outcome::default()).is_none(),
            "request id {id} reused"
        );
    }

    pub fn record(&mut self, events: Vec<Event>) {
        let step = self.steps;
        self.steps += 1;
        let mut seen = std::collections::HashSet::new();
        for ev in events {
            assert!(
                seen.insert(ev.request_id),
                "two events for request {} in one step",
                ev.request_id
            );
            let o = self
                .outcomes
                .get_mut(&ev.request_id)
                .unwrap_or_else(|| panic!("event for unknown request {}", ev.request_id));
            assert!(
                o.finish.is_none(),
                "event for request {} after its terminal event: {ev:?}",
                ev.request_id
            );
            if !ev.tokens.is_empty() && o.first_token_step.is_none() {
                o.first_token_step = Some(step);
            }
            o.tokens.extend_from_slice(&ev.tokens);
            o.text.push_str(&ev.text);
            assert_eq!(
                ev.usage.is_some(),
                ev.finish.is_some(),
                "usage comes with the terminal event only: {ev:?}"
            );
            if let Some(u) = ev.usage {
                assert_eq!(u.generated_tokens, o.tokens.len(), "{ev:?}");
                assert_eq!(u.time_to_first_token_ns > 0, !o.tokens.is_empty(), "{ev:?}");
                assert!(u.total_time_ns > 0, "{ev:?}");
                assert!(u.time_to_first_token_ns <= u.total_time_ns, "{ev:?}");
                assert!(u.cached_prompt_tokens < u.prompt_tokens, "{ev:?}");
                o.usage = Some(u);
            }
            if let Some(f) = ev.finish {
                o.finish = Some(f);
                o.finish_step = Some(step);
            }
        }
    }

    pub fn all_finished(&self) -> bool {
        self.outcomes.values().all(|o| o.finish.is_some())
    }

    pub fn get(&self, id: RequestId) -> &Outcome {
        &self.outcomes[&id]
    }
}

/// Steps until the session is idle, checking invariants after every step.
pub fn drain(session: &mut Session, log: &mut EventLog, max_steps: usize) {
    let mut n = 0;
    while session.has_work() {
        let events = session.step().expect("step");
        log.record(events);
        if let Err(e) = session.check_invariants() {
            panic!("invariant violated after step {}: {e}", log.steps);
        }
        n += 1;
        assert!(
            n <= max_steps,
            "session still busy after {max_steps} steps: {:?}",
            session.stats()
        );
    }
    assert!(
        log.all_finished(),
        "idle session left requests without a terminal event"
    );
    assert_idle_clean(session);
}

/// At idle every KV slot is free or evictable, and the manager is consistent.
pub fn assert_idle_clean(session: &Session) {
    session.check_invariants().expect("invariants at idle");
    let s = session.stats();
    assert_eq!((s.running, s.waiting), (0, 0), "session not idle: {s:?}");
    assert_eq!(
        s.kv.free_slots + s.kv.evictable_slots,
        s.kv.total_slots,
        "KV leaked at idle: {:?}",
        s.kv
    );
    assert_eq!(s.kv.used_slots, 0, "KV still used at idle: {:?}", s.kv);
}

/// Adds every request, runs the session to idle, returns outcomes in input order.
pub fn run_all(session: &mut Session, reqs: &[RequestParams]) -> Vec<Outcome> {
    let mut log = EventLog::default();
    let ids: Vec<RequestId> = reqs
        .iter()
        .map(|r| {
            let id = session.add_request(r.clone()).expect("add_request");
            log.expect(id);
            id
        })
        .collect();
    drain(session, &mut log, 1_000_000);
    ids.iter().map(|id| log.get(*id).clone()).collect()
}

/// Output of `req` run alone in a fresh, roomy session (the reference).
pub fn run_alone(model: &Arc<Model>, req: &RequestParams) -> Outcome {
    let params = SessionParams {
        kv_capacity_tokens: 4096,
        prefix_caching: false,
        ..Default::default()
    };
    let mut s = Session::new(model.clone(), params).expect("reference session");
    run_all(&mut s, std::slice::from_ref(req)).remove(0)
}

/// Prompts of assorted lengths in `lo..hi` from a fixed seed.
pub fn random_prompts(seed: u64, n: usize, lo: usize, hi: usize, vocab: usize) -> Vec<Vec<u32>> {
    let mut rng = TestRng::new(seed);
    (0..n)
        .map(|_| {
            let len = rng.range(lo, hi);
            rng.tokens(len, vocab)
        })
        .collect()
}

/// The SmolLM2 directory (`NANOINFER_MODEL_DIR` or `models/SmolLM2-135M-Instruct`);
/// fails, naming the fix, when it is missing (like the golden tests).
pub fn smollm2_dir() -> PathBuf {
    let dir = std::env::var("NANOINFER_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo_path("models/SmolLM2-135M-Instruct"));
    assert!(
        dir.join("model.safetensors").exists(),
        "{} is missing: run `python3 scripts/fetch_model.py` (scripts/test.sh does)",
        dir.display()
    );
    dir
}

pub fn repo_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// A committed tiny transformers-made model under tests/data (F32, 1 thread).
pub fn committed_tiny(name: &str) -> Arc<Model> {
    let dir = repo_path(&format!("tests/data/{name}"));
    let params = ModelParams {
        dtype: WeightDType::F32,
        threads: 1,
        ..Default::default()
    };
    Arc::new(
        Model::load(&dir, &params, None)
            .unwrap_or_else(|e| panic!("loading {}: {e}", dir.display())),
    )
}
