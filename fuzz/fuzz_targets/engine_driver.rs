//! The logic of the `session_ops`, `request_params` and `constraints` fuzz
//! targets, shared with the normal test suite (tests/engine_fuzz_logic.rs
//! includes this file and runs it over seeded random inputs, so CI runs it
//! on stable).
//!
//! Each reads the fuzz input as a stream of bytes (zeros once it runs out)
//! and drives a real `Session` on a tiny model.

#![allow(dead_code)] // each target uses part of it

use nanoinfer::engine::{
    FaultPlan, FinishReason, Model, PreemptionMode, RequestId, RequestParams, SchedulePolicyKind,
    Session, SessionParams, SpeculativeMethod, SpeculativeParams,
};
use nanoinfer::kv::KvBackendKind;
use nanoinfer::memory::MemoryPoolKind;
use nanoinfer::sampling::SamplingParams;
use nanoinfer::ErrorKind;
use std::collections::HashMap;
use std::sync::Arc;

/// The model the targets drive: tests/data/tiny-llama3 (vocab 256, no EOS,
/// 512 positions), F32, one thread.
pub fn load_model(repo_root: &std::path::Path) -> Arc<Model> {
    let dir = repo_root.join("tests/data/tiny-llama3");
    let params = nanoinfer::engine::ModelParams {
        dtype: nanoinfer::model::WeightDType::F32,
        threads: 1,
        ..Default::default()
    };
    Arc::new(
        Model::load(&dir, &params, None)
            .unwrap_or_else(|e| panic!("loading {}: {e}", dir.display())),
    )
}

/// Reads the input byte by byte; zeros once it is exhausted.
pub struct Input<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Input { data, pos: 0 }
    }
    pub fn done(&self) -> bool {
        self.pos >= self.data.len()
    }
    pub fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    /// In `lo..hi` (`hi > lo`).
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.u16() as usize % (hi - lo)
    }
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.u8() as usize % items.len()]
    }
    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }
    /// Any f32 bit pattern one time in eight (NaN, infinities,
    /// subnormals), otherwise one of the parameter's `typical` values.
    pub fn f32(&mut self, typical: &[f32]) -> f32 {
        if self.u8() >= 224 {
            f32::from_bits(self.u32())
        } else {
            self.pick(typical)
        }
    }
}

/// Event contract bookkeeping: at most one event per request per step,
/// nothing after the terminal event, nothing for unknown requests, usage
/// on the terminal event only and agreeing with the tokens delivered.
#[derive(Default)]
struct Log {
    tokens: HashMap<RequestId, Vec<u32>>,
    finish: HashMap<RequestId, FinishReason>,
}

impl Log {
    fn expect(&mut self, id: RequestId) {
        assert!(self.tokens.insert(id, vec![]).is_none(), "id {id} reused");
    }
    fn record(&mut self, events: Vec<nanoinfer::engine::Event>) {
        let mut seen = std::collections::HashSet::new();
        for ev in events {
            let id = ev.request_id;
            assert!(seen.insert(id), "two events for {id} in one step");
            let toks = self
                .tokens
                .get_mut(&id)
                .unwrap_or_else(|| panic!("event for unknown request {id}"));
            assert!(
                !self.finish.contains_key(&id),
                "event for {id} after its terminal event"
            );
            toks.extend_from_slice(&ev.tokens);
            assert_eq!(ev.usage.is_some(), ev.finish.is_some(), "usage of {id}");
            if let Some(u) = ev.usage {
                assert_eq!(u.generated_tokens, toks.len(), "{id}: {u:?}");
                assert_eq!(
                    u.time_to_first_token_ns > 0,
                    !toks.is_empty(),
                    "{id}: {u:?}"
                );
                assert!(
                    u.total_time_ns >= u.time_to_first_token_ns.max(1),
                    "{id}: {u:?}"
                );
                assert!(u.cached_prompt_tokens < u.prompt_tokens, "{id}: {u:?}");
            }
            if let Some(f) = ev.finish {
                self.finish.insert(id, f);
            }
        }
    }
}

/// Steps until idle (bounded), checking invariants after every step.
fn drain(s: &mut Session, log: &mut Log) {
    let mut n = 0;
    while s.has_work() {
        log.record(s.step().expect("step"));
        s.check_invariants().expect("invariants while draining");
        n += 1;
        assert!(n < 100_000, "session never became idle: {:?}", s.stats());
    }
    s.check_invariants().expect("invariants at idle");
    let st = s.stats();
    assert_eq!(
        (st.running, st.waiting, st.kv.used_slots),
        (0, 0, 0),
        "{st:?}"
    );
    assert_eq!(
        st.kv.free_slots + st.kv.evictable_slots,
        st.kv.total_slots,
        "KV leaked at idle: {:?}",
        st.kv
    );
}

/// Stateful target: session settings, an optional fault plan, then random
/// add / step / cancel operations. Checks after every operation the
/// session's invariants and KV bounds; at the end that every accepted
/// request got exactly one terminal event of an allowed kind, nothing
/// leaked, and the session still gives a greedy request the output it has
/// in a fresh session.
pub fn session_ops(model: &Arc<Model>, data: &[u8]) {
    let vocab = model.config().vocab_size;
    let mut inp = Input::new(data);
    let capacity = inp.range(24, 300);
    let params = SessionParams {
        kv_backend: inp.pick(&[KvBackendKind::Paged, KvBackendKind::Token]),
        block_size: inp.pick(&[1, 2, 4, 16]),
        kv_capacity_tokens: capacity,
        max_batched_tokens: inp.range(1, 96),
        max_seqs: inp.range(1, 9),
        prefill_chunk_size: inp.pick(&[1, 3, 8, 16, 64]),
        policy: inp.pick(&[SchedulePolicyKind::Fcfs, SchedulePolicyKind::Priority]),
        aging_steps: inp.range(1, 20) as u64,
        prefix_caching: inp.bool(),
        preemption: inp.pick(&[PreemptionMode::Recompute, PreemptionMode::Swap]),
        memory_pool: inp.pick(&[
            None,
            Some(MemoryPoolKind::Slab),
            Some(MemoryPoolKind::System),
        ]),
        seed: inp.u8() as u64,
        overlap_steps: Some(inp.bool()),
        speculative: inp.bool().then(|| SpeculativeParams {
            method: SpeculativeMethod::Ngram {
                min_n: inp.range(1, 3),
                max_n: 3,
            },
            num_speculative_tokens: inp.range(1, 5),
            max_batch: inp.range(1, 9),
        }),
        ..Default::default()
    };
    let faulty = inp.u8() < 64;
    let plan = if faulty {
        let steps = |n: usize, inp: &mut Input| -> Vec<u64> {
            (0..n).map(|_| inp.range(0, 64) as u64).collect()
        };
        // Pool faults only on the arena (the CPU default): it fails inside itself, while the
        // slab and system pools pass the impossible size to the system
        // allocator, which ASan and libFuzzer's malloc limit report as a
        // crash (tests/engine_faults.rs covers those pools).
        let pool_faults = if params.memory_pool.is_none() {
            inp.range(0, 3)
        } else {
            0
        };
        FaultPlan {
            pool_failure_steps: steps(pool_faults, &mut inp),
            kv_exhausted_steps: steps(inp.range(0, 6), &mut inp),
            forward_error_steps: steps(inp.range(0, 3), &mut inp),
            swap_out_failure_steps: steps(inp.range(0, 4), &mut inp),
            swap_in_failure_steps: steps(inp.range(0, 4), &mut inp),
        }
    } else {
        FaultPlan::default()
    };
    let cfg = format!("{params:?} {plan:?}");
    let mut s = Session::new(model.clone(), params).expect("valid session params");
    s.inject_faults(plan.clone());
    // A few shared prefixes so the prefix cache gets hits.
    let prefixes: Vec<Vec<u32>> = (0..2)
        .map(|_| {
            let n = inp.range(1, 40);
            (0..n).map(|_| inp.u8() as u32 % vocab as u32).collect()
        })
        .collect();
    let mut log = Log::default();
    let mut accepted: Vec<(RequestId, RequestParams)> = vec![];
    let mut cancelled = std::collections::HashSet::new();
    while !inp.done() {
        match inp.u8() % 9 {
            0..=2 => {
                let mut prompt = if inp.bool() {
                    prefixes[inp.range(0, prefixes.len())].clone()
                } else {
                    vec![]
                };
                let extra = inp.range(0, 48);
                prompt.extend((0..extra).map(|_| inp.u8() as u32 % vocab as u32));
                let max_tokens = inp.range(1, 40) as u32;
                let greedy = inp.bool();
                let stop_token_ids = if inp.u8() < 32 {
                    vec![inp.u8() as u32 % vocab as u32]
                } else {
                    vec![]
                };
                let r = RequestParams {
                    prompt,
                    sampling: SamplingParams {
                        max_tokens,
                        temperature: if greedy { 0.0 } else { 0.8 },
                        top_k: if greedy { 0 } else { 20 },
                        seed: (!greedy && inp.bool()).then(|| inp.u8() as u64),
                        stop_token_ids,
                        ..Default::default()
                    },
                    priority: inp.range(0, 5) as i32 - 2,
                    cache_salt: inp.u8() as u64 % 2,
                    disable_speculation: inp.u8() < 64,
                    constraint: None,
                    retain_state: inp.u8() < 64,
                };
                let fits = !r.prompt.is_empty() && r.prompt.len() + max_tokens as usize <= capacity;
                match s.add_request(r.clone()) {
                    Ok(id) => {
                        assert!(fits, "{cfg}: request accepted that cannot fit: {r:?}");
                        log.expect(id);
                        accepted.push((id, r));
                    }
                    Err(e) => {
                        assert!(!fits, "{cfg}: fitting request refused: {e}");
                        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
                    }
                }
            }
            3 if !accepted.is_empty() => {
                let (id, _) = accepted[inp.range(0, accepted.len())];
                let active = s.is_active(id);
                let res = s.cancel(id);
                assert_eq!(res.is_ok(), active, "{cfg}: cancel of {id}");
                if res.is_ok() {
                    cancelled.insert(id);
                }
            }
            4 if !accepted.is_empty() => {
                // Save a request (active, or kept when it ended) and
                // continue it as a new request.
                let (id, _) = accepted[inp.range(0, accepted.len())];
                let active = s.is_active(id);
                match s.save_state_bytes(id) {
                    Ok(bytes) => {
                        let max_tokens = inp.range(1, 20) as u32;
                        let r = RequestParams {
                            sampling: SamplingParams {
                                max_tokens,
                                ..Default::default()
                            },
                            retain_state: inp.bool(),
                            ..Default::default()
                        };
                        match s.restore_request_bytes(&bytes, r.clone()) {
                            Ok(new) => {
                                log.expect(new);
                                accepted.push((new, r));
                            }
                            // The saved tokens plus max_tokens may not fit.
                            Err(e) => assert!(
                                e.kind == ErrorKind::InvalidArgument
                                    && e.message.contains("exceeds"),
                                "{cfg}: restoring {id}'s state: {e}"
                            ),
                        }
                        if inp.bool() {
                            let _ = s.release_state(id);
                        }
                    }
                    Err(e) => {
                        assert!(!active, "{cfg}: saving active request {id}: {e}");
                        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{cfg}: {e}");
                    }
                }
            }
            _ => log.record(s.step().expect("step")),
        }
        s.check_invariants()
            .unwrap_or_else(|e| panic!("{cfg}: invariant violated: {e}"));
        let st = s.stats();
        assert!(st.kv.used_slots <= st.kv.total_slots, "{cfg}: {st:?}");
        assert!(st.running <= s.params().max_seqs, "{cfg}: {st:?}");
    }
    drain(&mut s, &mut log);
    for (id, r) in &accepted {
        let toks = &log.tokens[id];
        let f = log
            .finish
            .get(id)
            .unwrap_or_else(|| panic!("{cfg}: request {id} got no terminal event"));
        assert!(toks.len() <= r.sampling.max_tokens as usize, "{cfg}");
        assert!(toks.iter().all(|&t| (t as usize) < vocab), "{cfg}");
        match f {
            FinishReason::Length => assert_eq!(toks.len(), r.sampling.max_tokens as usize),
            FinishReason::StopToken(t) => {
                assert!(r.sampling.stop_token_ids.contains(t), "{cfg}");
                assert_eq!(toks.last(), Some(t), "{cfg}");
            }
            FinishReason::Cancelled => assert!(cancelled.contains(id), "{cfg}"),
            FinishReason::Error(msg) => {
                assert!(faulty, "{cfg}: request {id} failed without a fault: {msg}")
            }
            other => panic!("{cfg}: request {id} ended with {other:?}"),
        }
    }
    // Past the plan's steps, the session serves like a fresh one.
    let last = plan.last_step();
    while s.stats().steps <= last {
        assert!(s.step().expect("idle step").is_empty());
    }
    let probe = RequestParams {
        prompt: prefixes[0].clone(),
        sampling: SamplingParams {
            max_tokens: 4.min(capacity - prefixes[0].len()).max(1) as u32,
            ..Default::default()
        },
        ..Default::default()
    };
    if probe.prompt.len() + probe.sampling.max_tokens as usize > capacity {
        return;
    }
    let id = s.add_request(probe.clone()).expect("probe request");
    log.expect(id);
    drain(&mut s, &mut log);
    let mut fresh = Session::new(
        model.clone(),
        SessionParams {
            kv_capacity_tokens: 512,
            ..Default::default()
        },
    )
    .unwrap();
    let mut flog = Log::default();
    let fid = fresh.add_request(probe).unwrap();
    flog.expect(fid);
    drain(&mut fresh, &mut flog);
    assert_eq!(
        log.tokens[&id],
        flog.tokens[&fid],
        "{cfg}: the session's output after the run differs from a fresh session's (finish {:?}, fresh {:?})",
        log.finish.get(&id),
        flog.finish.get(&fid)
    );
}

/// Request validation: arbitrary prompts (ids in and out of the
/// vocabulary), sampling parameters (any f32 bit pattern), stop token ids,
/// stop strings, logit biases, logprobs and lengths. `add_request` accepts
/// exactly what the documented rules allow, refuses the rest with
/// `InvalidArgument` and a message, never panics; an accepted request runs
/// to one terminal event with tokens in the vocabulary and consistent
/// logprobs. Returns whether the request was accepted.
pub fn request_params(model: &Arc<Model>, data: &[u8]) -> bool {
    let c = model.config();
    let vocab = c.vocab_size;
    let capacity = 192;
    let mut inp = Input::new(data);
    // One id in 64 is past the vocabulary.
    let token = |inp: &mut Input| {
        if inp.u8() >= 252 {
            (vocab + inp.u8() as usize % 40) as u32
        } else {
            inp.u16() as u32 % vocab as u32
        }
    };
    let n = inp.range(0, 40);
    let prompt: Vec<u32> = (0..n).map(|_| token(&mut inp)).collect();
    let stop_token_ids: Vec<u32> = (0..inp.range(0, 3)).map(|_| token(&mut inp)).collect();
    let logit_bias: Vec<(u32, f32)> = (0..inp.range(0, 3))
        .map(|_| (token(&mut inp), inp.f32(&[-100.0, -1.0, 0.0, 5.0, 100.0])))
        .collect();
    let stop_strings: Vec<String> = if inp.u8() < 16 {
        let len = inp.range(0, 6);
        let bytes: Vec<u8> = (0..len).map(|_| inp.u8()).collect();
        vec![String::from_utf8_lossy(&bytes).into_owned()]
    } else {
        vec![]
    };
    let sampling = SamplingParams {
        // Mostly valid values, with the edges of each range and a few past them.
        temperature: inp.f32(&[0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 1e-6, 1e6, -1.0]),
        top_k: inp.pick(&[0, 0, 0, 1, 5, 50, 256, 300, i32::MAX, -1]),
        top_p: inp.f32(&[1.0, 1.0, 1.0, 0.9, 0.5, 0.1, 1e-6, 0.999, 0.0, 1.5]),
        min_p: inp.f32(&[0.0, 0.0, 0.0, 0.05, 0.5, 1.0, 1e-6, 0.2, 0.9, -0.1]),
        repetition_penalty: inp.f32(&[1.0, 1.0, 1.0, 1.3, 0.5, 2.0, 1e-3, 1.1, 0.9, 0.0]),
        presence_penalty: inp.f32(&[0.0, 0.0, 0.0, 0.5, -2.0, 2.0, 1.0, -0.5, 0.1, 3.0]),
        frequency_penalty: inp.f32(&[0.0, 0.0, 0.0, 0.5, -2.0, 2.0, 1.0, -0.5, 0.1, 3.0]),
        logit_bias,
        seed: inp.bool().then(|| inp.u8() as u64),
        max_tokens: inp.pick(&[1, 1, 3, 8, 8, 20, 20, 40, 0, 200]),
        min_tokens: inp.pick(&[0, 0, 0, 0, 1, 4, 4, 8, 30]),
        stop_token_ids,
        stop_strings,
        ignore_eos: inp.bool(),
        logprobs: inp.pick(&[0, 0, 0, 1, 5, 20, 20, 21]),
    };
    let req = RequestParams {
        prompt,
        sampling,
        priority: inp.u8() as i32 - 128,
        cache_salt: inp.u8() as u64,
        constraint: None,
        retain_state: false,
        disable_speculation: false,
    };
    let mut s = Session::new(
        model.clone(),
        SessionParams {
            kv_capacity_tokens: capacity,
            max_batched_tokens: 64,
            max_seqs: 4,
            ..Default::default()
        },
    )
    .expect("session");
    let need = req.prompt.len() + req.sampling.max_tokens as usize;
    let valid = !req.prompt.is_empty()
        && req.prompt.iter().all(|&t| (t as usize) < vocab)
        && req.sampling.validate(vocab).is_ok()
        // tiny-llama3 has no tokenizer: stop strings are refused.
        && req.sampling.stop_strings.is_empty()
        && need <= c.max_position_embeddings
        && need <= capacity;
    let what = format!("{req:?}");
    let id = match s.add_request(req.clone()) {
        Ok(id) => {
            assert!(valid, "accepted an invalid request: {what}");
            id
        }
        Err(e) => {
            assert!(!valid, "refused a valid request ({e}): {what}");
            assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}: {what}");
            assert!(!e.message.is_empty());
            assert!(!s.has_work(), "a refused request left work behind");
            return false;
        }
    };
    let mut log = Log::default();
    log.expect(id);
    let mut logprobs = 0;
    let mut steps = 0;
    while s.has_work() {
        let events = s.step().expect("step");
        for ev in &events {
            assert_eq!(ev.request_id, id);
            if req.sampling.logprobs > 0 {
                assert_eq!(ev.logprobs.len(), ev.tokens.len(), "{what}");
                for l in &ev.logprobs {
                    assert!(l.logprob <= 1e-4 || l.logprob.is_nan(), "{what}: {l:?}");
                    assert!(l.top.len() <= req.sampling.logprobs as usize, "{what}");
                    assert!(l.top.iter().all(|&(t, _)| (t as usize) < vocab));
                }
                logprobs += ev.logprobs.len();
            }
        }
        log.record(events);
        steps += 1;
        assert!(steps < 10_000, "never finished: {what}");
    }
    let toks = &log.tokens[&id];
    assert!(toks.iter().all(|&t| (t as usize) < vocab), "{what}");
    if req.sampling.logprobs > 0 {
        assert_eq!(logprobs, toks.len(), "{what}");
    }
    let sp = &req.sampling;
    match &log.finish[&id] {
        FinishReason::Length => assert_eq!(toks.len(), sp.max_tokens as usize, "{what}"),
        FinishReason::StopToken(t) => {
            assert!(sp.stop_token_ids.contains(t), "{what}");
            assert!(toks.len() >= sp.min_tokens as usize, "{what}");
        }
        other => panic!("{what}: ended with {other:?}"),
    }
    s.check_invariants().expect("invariants at idle");
    true
}

/// tests/data/tiny-llama3's weights with the byte-level test tokenizer
/// (tests/data/tokenizer/bytelevel: 320 ids, of which the model samples the
/// first 256): structured output needs a tokenizer, and a small vocabulary
/// keeps each input fast. Assembled in a temporary directory of its own
/// per call (tests of one process load it in parallel).
pub fn load_model_with_tokenizer(repo_root: &std::path::Path) -> Arc<Model> {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir =
        std::env::temp_dir().join(format!("nanoinfer-fuzz-tok-{}-{call}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for (from, name) in [
        ("tests/data/tiny-llama3", "config.json"),
        ("tests/data/tiny-llama3", "model.safetensors"),
        ("tests/data/tokenizer/bytelevel", "tokenizer.json"),
        ("tests/data/tokenizer/bytelevel", "tokenizer_config.json"),
    ] {
        std::fs::copy(repo_root.join(from).join(name), dir.join(name))
            .unwrap_or_else(|e| panic!("copying {from}/{name}: {e}"));
    }
    let params = nanoinfer::engine::ModelParams {
        dtype: nanoinfer::model::WeightDType::F32,
        threads: 1,
        ..Default::default()
    };
    let model = Model::load(&dir, &params, None)
        .unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()));
    let _ = std::fs::remove_dir_all(&dir);
    Arc::new(model)
}

/// Pieces the constraint texts are built from, per kind: enough structure
/// that many inputs compile, and enough breakage that many do not.
#[rustfmt::skip]
const SCHEMA_PIECES: &[&str] = &[
    "{", "}", "[", "]", ",", ":", "\"type\":", "\"object\"", "\"string\"", "\"integer\"",
    "\"number\"", "\"boolean\"", "\"array\"", "\"null\"", "\"properties\":{\"a\":", "\"items\":",
    "\"enum\":[1,\"x\",null]", "\"const\":\"k\"", "\"minLength\":3", "\"maxLength\":2",
    "\"pattern\":\"^a+$\"", "\"anyOf\":[", "\"oneOf\":[", "\"allOf\":[", "\"$ref\":\"#\"",
    "\"$ref\":\"#/$defs/x\"", "\"$defs\":{\"x\":", "\"required\":[\"a\"]",
    "\"additionalProperties\":false", "\"minimum\":5", "\"maximum\":1", "\"minItems\":2",
    "\"maxItems\":0", "\"format\":\"email\"", "\"x-guidance\":{\"whitespace_flexible\":true}",
    "\"x-guidance\":{\"bogus\":1}", "\"x-guidance\":3", "true", "false", "{}", "\"\\u0000\"",
    "\"multipleOf\":0", "\"uniqueItems\":true", "\"if\":{},\"then\":{}", "\"not\":{}",
];
#[rustfmt::skip]
const REGEX_PIECES: &[&str] = &[
    "a", "b", "[0-9]", "[a-z]", "+", "*", "?", "{2,5}", "{3}", "{0,200}", "(", ")", "|", "\\d",
    "\\w", "\\s", ".", "^", "$", "[^a]", "\\", "(?i)", "\\p{L}", "[", "]", "{", "}", "-", "é",
    "\\n", "(?:", "\\b", "[[:alpha:]]", "\u{0}",
];
#[rustfmt::skip]
const LARK_PIECES: &[&str] = &[
    "start: ", "start: a\n", "a: ", "b: ", "a", "b", "\"x\"", "\"yz\"", "/[a-z]+/", "/[0-9]{1,3}/",
    " | ", "\n", "*", "+", "?", "(", ")", "[", "]", "%ignore \" \"\n", "%import common.NUMBER\n",
    "NUMBER", "%json {}\n", "%json {\"type\":\"integer\"}",
    "%regex {\"substring_words\": \"a b\"}", "A: \"q\"\n", "A", "~ 3", "<[2]>", "%llguidance {}\n",
    "start: start start | \"a\"\n", ":",
];
#[rustfmt::skip]
const CHOICE_PIECES: &[&str] = &[
    "yes", "no", "", "a", "ab", "é", "<|im_end|>", "\n", " ", "\u{0}",
];

/// Structured-output constraints (JSON Schema, regex, Lark grammar,
/// choices) built from pieces of each syntax or from raw bytes. A bad one
/// is refused by `add_request` with `InvalidArgument` and a message naming
/// the constraint kind, never a panic or a hang; an accepted one runs to a
/// terminal event (a full match, the length limit, or a structured-output
/// error of that request only: a mask over its time budget, a grammar that
/// allows no token of the model; never a token the mask allowed that the
/// grammar then refuses), a choice's text is one of the choices,
/// and the session serves a plain request afterwards. Returns whether the
/// request was accepted.
pub fn constraints(model: &Arc<Model>, data: &[u8]) -> bool {
    use nanoinfer::engine::Constraint;
    let vocab = model.config().vocab_size;
    let mut inp = Input::new(data);
    let kind = inp.u8() % 4;
    let max_tokens = inp.range(1, 16) as u32;
    let sampled = inp.bool();
    let seed = inp.u8() as u64;
    let raw = inp.u8() < 64;
    let mut texts: Vec<String> = Vec::new();
    if raw {
        // The rest of the input as text; choices split at '|'.
        let rest: Vec<u8> = std::iter::from_fn(|| (!inp.done()).then(|| inp.u8())).collect();
        let text = String::from_utf8_lossy(&rest).into_owned();
        texts = if kind == 3 {
            text.split('|').map(str::to_string).collect()
        } else {
            vec![text]
        };
    } else {
        let pieces = [SCHEMA_PIECES, REGEX_PIECES, LARK_PIECES, CHOICE_PIECES][kind as usize];
        let n = inp.range(0, 24);
        for _ in 0..n {
            let piece = inp.pick(pieces);
            // Choices: a new one per piece, or the piece glued onto the
            // last; the other kinds are one text.
            match texts.last_mut() {
                Some(last) if kind != 3 || inp.bool() => last.push_str(piece),
                _ => texts.push(piece.to_string()),
            }
        }
    }
    let constraint = match kind {
        0 => Constraint::JsonSchema(texts.concat()),
        1 => Constraint::Regex(texts.concat()),
        2 => Constraint::Lark(texts.concat()),
        _ => Constraint::Choice(texts),
    };
    let mut s = Session::new(
        model.clone(),
        SessionParams {
            kv_capacity_tokens: 256,
            ..Default::default()
        },
    )
    .expect("session");
    // Ids the model has (the tokenizer's merges are past its 256).
    let prompt = vec![40, 80, 120];
    let req = RequestParams {
        prompt: prompt.clone(),
        sampling: SamplingParams {
            max_tokens,
            temperature: if sampled { 1.0 } else { 0.0 },
            seed: Some(seed),
            ..Default::default()
        },
        constraint: Some(constraint.clone()),
        ..Default::default()
    };
    let what = format!("{constraint:?}");
    let started = std::time::Instant::now();
    let mut log = Log::default();
    let accepted = match s.add_request(req) {
        Ok(id) => {
            log.expect(id);
            drain(&mut s, &mut log);
            let toks = &log.tokens[&id];
            assert!(toks.iter().all(|&t| (t as usize) < vocab), "{what}");
            match &log.finish[&id] {
                FinishReason::Eos => {
                    if let Constraint::Choice(choices) = &constraint {
                        let text = model
                            .tokenizer()
                            .unwrap()
                            .decode(&toks[..toks.len() - 1], false)
                            .unwrap();
                        assert!(choices.contains(&text), "{what}: {text:?}");
                    }
                }
                FinishReason::Length | FinishReason::LengthUnfinished => {
                    assert_eq!(toks.len(), max_tokens as usize, "{what}")
                }
                // A token the mask allowed always advances the grammar.
                FinishReason::Error(msg) => assert!(
                    msg.starts_with("structured output: ")
                        && !msg.contains("advancing the grammar"),
                    "{what}: {msg}"
                ),
                other => panic!("{what}: ended with {other:?}"),
            }
            true
        }
        Err(e) => {
            assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}: {what}");
            assert!(
                e.message.contains(constraint.kind()),
                "the message does not name the {}: {e}: {what}",
                constraint.kind()
            );
            assert!(!s.has_work(), "a refused request left work behind");
            false
        }
    };
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "{what} took {:?}",
        started.elapsed()
    );
    // The session serves a plain request afterwards.
    let id = s
        .add_request(RequestParams {
            prompt,
            sampling: SamplingParams {
                max_tokens: 2,
                ..Default::default()
            },
            ..Default::default()
        })
        .expect("plain request");
    log.expect(id);
    drain(&mut s, &mut log);
    assert!(
        matches!(log.finish[&id], FinishReason::Length | FinishReason::Eos),
        "{what}: plain request after it: {:?}",
        log.finish[&id]
    );
    accepted
}
