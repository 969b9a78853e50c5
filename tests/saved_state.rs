//! Saved conversations and prefix caches on SmolLM2 (CPU): a conversation
//! saved from a finished or a running request and continued in another
//! session (of the other KV backend) gives exactly the tokens and text of
//! the uninterrupted run, greedy and seeded sampled; only the positions the
//! state lacks are computed; foreign, corrupt and oversized states are
//! refused with nothing queued; a saved prefix cache warm-starts a new
//! session. tests/cli_state.rs runs the same across processes.

mod engine_common;

use engine_common::*;
use nanoinfer::engine::{
    FinishReason, Model, ModelParams, RequestId, RequestParams, Session, SessionParams,
};
use nanoinfer::kv::KvBackendKind;
use nanoinfer::model::WeightDType;
use nanoinfer::sampling::SamplingParams;
use nanoinfer::tokenizer::ChatMessage;
use nanoinfer::ErrorKind;
use std::sync::{Arc, OnceLock};

const BACKENDS: [KvBackendKind; 2] = [KvBackendKind::Paged, KvBackendKind::Token];

fn smollm2() -> Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let params = ModelParams {
                dtype: WeightDType::F32,
                threads: 2,
                ..Default::default()
            };
            Arc::new(Model::load(&smollm2_dir(), &params, None).expect("SmolLM2 loads"))
        })
        .clone()
}

fn session(model: &Arc<Model>, kv_backend: KvBackendKind) -> Session {
    Session::new(
        model.clone(),
        SessionParams {
            kv_backend,
            kv_capacity_tokens: 4096,
            ..Default::default()
        },
    )
    .expect("session")
}

fn chat(model: &Model, text: &str) -> Vec<u32> {
    let tok = model.tokenizer().expect("tokenizer");
    tok.encode_chat(&[ChatMessage::new("user", text)], true, 4096)
        .expect("chat prompt")
}

/// Greedy, or sampled with a seed and penalties that count the output (so
/// a continuation must also carry where its output started).
fn sampling(sampled: bool, max_tokens: u32) -> SamplingParams {
    let mut s = SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    };
    if sampled {
        s.temperature = 0.9;
        s.top_p = 0.95;
        s.presence_penalty = 0.4;
        s.frequency_penalty = 0.2;
        s.seed = Some(1234);
    }
    s
}

fn with_sampling(prompt: Vec<u32>, sampling: SamplingParams) -> RequestParams {
    RequestParams {
        prompt,
        sampling,
        ..Default::default()
    }
}

/// Runs `id` (already added) and everything else in `s` to the end.
fn finish(s: &mut Session, id: RequestId) -> Outcome {
    let mut log = EventLog::default();
    log.expect(id);
    drain(s, &mut log, 100_000);
    log.get(id).clone()
}

fn run(s: &mut Session, req: RequestParams) -> (RequestId, Outcome) {
    let id = s.add_request(req).expect("add_request");
    (id, finish(s, id))
}

const FIRST: u32 = 20;
const MORE: u32 = 20;

#[test]
fn a_finished_conversation_continues_exactly_as_the_uninterrupted_run() {
    let model = smollm2();
    let prompt = chat(&model, "Write a short story about a lighthouse keeper.");
    for sampled in [false, true] {
        let whole = run(
            &mut session(&model, KvBackendKind::Paged),
            with_sampling(prompt.clone(), sampling(sampled, FIRST + MORE)),
        )
        .1;
        for [from, to] in [BACKENDS, [BACKENDS[1], BACKENDS[0]]] {
            let mut first = session(&model, from);
            let (id, part) = run(
                &mut first,
                RequestParams {
                    retain_state: true,
                    ..with_sampling(prompt.clone(), sampling(sampled, FIRST))
                },
            );
            assert_eq!(part.tokens[..], whole.tokens[..FIRST as usize]);
            assert_eq!(first.retained_states(), 1);
            let state = first.save_state_bytes(id).expect("save a retained state");
            first.release_state(id).expect("release");
            assert_eq!(first.retained_states(), 0);
            assert!(first.save_state_bytes(id).is_err(), "released state saved");
            drop(first);

            let mut second = session(&model, to);
            let id = second
                .restore_request_bytes(&state, with_sampling(Vec::new(), sampling(sampled, MORE)))
                .expect("restore");
            let rest = finish(&mut second, id);
            let what = format!("sampled {sampled}, {from:?} -> {to:?}");
            assert_eq!(
                rest.tokens[..],
                whole.tokens[FIRST as usize..],
                "{what}: continuation tokens"
            );
            assert_eq!(part.text.clone() + &rest.text, whole.text, "{what}: text");
            let stats = second.stats();
            assert_eq!(
                stats.prefill_tokens, 1,
                "{what}: only the last token is computed, the rest restored"
            );
            let usage = rest.usage.expect("usage");
            assert_eq!(usage.prompt_tokens, prompt.len() + FIRST as usize);
            assert_eq!(usage.cached_prompt_tokens, usage.prompt_tokens - 1);
            assert_eq!(usage.generated_tokens, MORE as usize);
        }
    }
}

#[test]
fn a_running_request_saved_between_steps_continues_exactly() {
    let model = smollm2();
    let prompt = chat(&model, "List five facts about the moon.");
    for sampled in [false, true] {
        for backend in BACKENDS {
            let total = FIRST + MORE;
            let mut s = session(&model, backend);
            let id = s
                .add_request(with_sampling(prompt.clone(), sampling(sampled, total)))
                .unwrap();
            let mut log = EventLog::default();
            log.expect(id);
            // A few steps in: the prompt is computed and some tokens are out.
            while log.get(id).tokens.len() < 7 {
                log.record(s.step().unwrap());
            }
            let done = log.get(id).tokens.len() as u32;
            let state = s.save_state_bytes(id).expect("save a running request");
            drain(&mut s, &mut log, 10_000);
            let whole = log.get(id).clone();

            let mut other = session(&model, backend);
            let rid = other
                .restore_request_bytes(
                    &state,
                    with_sampling(Vec::new(), sampling(sampled, total - done)),
                )
                .unwrap();
            let rest = finish(&mut other, rid);
            assert_eq!(
                rest.tokens[..],
                whole.tokens[done as usize..],
                "sampled {sampled}, {backend:?}: saved after {done} tokens"
            );
        }
    }
}

#[test]
fn a_new_turn_computes_only_the_tokens_it_appends() {
    let model = smollm2();
    let tok = model.tokenizer().unwrap();
    let prompt = chat(&model, "What is the capital of France?");
    let mut first = session(&model, KvBackendKind::Paged);
    let (id, _) = run(
        &mut first,
        RequestParams {
            retain_state: true,
            ..with_sampling(prompt.clone(), sampling(false, 12))
        },
    );
    let state = first.save_state_bytes(id).unwrap();
    let turn = tok
        .encode(
            "<|im_end|>\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n",
            false,
        )
        .unwrap();
    let mut outputs = Vec::new();
    for backend in BACKENDS {
        let mut s = session(&model, backend);
        let id = s
            .restore_request_bytes(&state, with_sampling(turn.clone(), sampling(false, 12)))
            .unwrap();
        let out = finish(&mut s, id);
        assert_eq!(
            s.stats().prefill_tokens as usize,
            turn.len() + 1,
            "{backend:?}: the appended turn and the last saved token are computed"
        );
        let usage = out.usage.unwrap();
        assert_eq!(usage.prompt_tokens, prompt.len() + 12 + turn.len());
        outputs.push(out.tokens);
    }
    assert_eq!(outputs[0], outputs[1], "paged and token backends agree");
}

#[test]
fn foreign_corrupt_and_oversized_states_are_refused_and_nothing_is_queued() {
    let model = smollm2();
    let prompt = chat(&model, "Hello!");
    let mut s = session(&model, KvBackendKind::Paged);
    let (id, _) = run(
        &mut s,
        RequestParams {
            retain_state: true,
            ..with_sampling(prompt, sampling(false, 8))
        },
    );
    let state = s.save_state_bytes(id).unwrap();
    let refuse = |s: &mut Session, bytes: &[u8], want: &str| {
        let e = s
            .restore_request_bytes(bytes, with_sampling(Vec::new(), sampling(false, 4)))
            .expect_err("refused");
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
        assert!(e.message.contains(want), "`{want}` not in: {e}");
        assert!(!s.has_work(), "a refused state queued a request");
        s.check_invariants().unwrap();
    };
    refuse(&mut s, &state[..state.len() / 2], "truncated");
    refuse(&mut s, &state[..10], "truncated");
    refuse(&mut s, b"", "truncated");
    let mut flipped = state.clone();
    let at = flipped.len() - 100;
    flipped[at] ^= 1;
    refuse(&mut s, &flipped, "checksum");
    let mut magic = state.clone();
    magic[0] = b'X';
    refuse(&mut s, &magic, "magic");

    // Another model: a tiny random Llama has another fingerprint.
    let tiny = default_tiny();
    let mut other = Session::new(tiny.model.clone(), SessionParams::default()).unwrap();
    refuse(&mut other, &state, "another model");

    // A session too small for the saved tokens.
    let mut small = Session::new(
        model.clone(),
        SessionParams {
            kv_capacity_tokens: 16,
            ..Default::default()
        },
    )
    .unwrap();
    refuse(&mut small, &state, "more than the 16");
    // Room for the state but not for what the request adds.
    let e = s
        .restore_request_bytes(&state, with_sampling(Vec::new(), sampling(false, 4090)))
        .unwrap_err();
    assert!(e.message.contains("restored conversation"), "{e}");
    assert!(!s.has_work());
}

#[test]
fn states_are_kept_only_when_asked_and_also_for_cancelled_requests() {
    let model = smollm2();
    let prompt = chat(&model, "Count to ten.");
    let mut s = session(&model, KvBackendKind::Token);
    let (plain, _) = run(&mut s, with_sampling(prompt.clone(), sampling(false, 4)));
    let e = s.save_state_bytes(plain).unwrap_err();
    assert!(e.message.contains("retain_state"), "{e}");
    assert!(s.release_state(plain).is_err());

    let id = s
        .add_request(RequestParams {
            retain_state: true,
            ..with_sampling(prompt.clone(), sampling(false, 64))
        })
        .unwrap();
    let mut log = EventLog::default();
    log.expect(id);
    while log.get(id).tokens.len() < 3 {
        log.record(s.step().unwrap());
    }
    s.cancel(id).unwrap();
    drain(&mut s, &mut log, 100);
    assert_eq!(log.get(id).finish, Some(FinishReason::Cancelled));
    let generated = log.get(id).tokens.len();
    let state = s
        .save_state_bytes(id)
        .expect("a cancelled request's state is kept");
    let rid = s
        .restore_request_bytes(&state, with_sampling(Vec::new(), sampling(false, 5)))
        .unwrap();
    let rest = finish(&mut s, rid);
    let whole = run(
        &mut s,
        with_sampling(prompt, sampling(false, generated as u32 + 5)),
    )
    .1;
    assert_eq!(rest.tokens[..], whole.tokens[generated..]);
    s.release_state(id).unwrap();
    assert_eq!(s.retained_states(), 0);
}

#[test]
fn a_saved_prefix_cache_warm_starts_a_new_session() {
    let model = smollm2();
    let tok = model.tokenizer().unwrap();
    let system = "You are a meticulous assistant for a shipping company. ".repeat(12);
    let question = |q: &str| {
        tok.encode_chat(
            &[
                ChatMessage::new("system", &system),
                ChatMessage::new("user", q),
            ],
            true,
            4096,
        )
        .unwrap()
    };
    let first_q = question("Where is my parcel?");
    let later_q = question("How do I return an item?");
    for (from, to) in [
        (KvBackendKind::Paged, KvBackendKind::Paged),
        (KvBackendKind::Token, KvBackendKind::Token),
        (KvBackendKind::Token, KvBackendKind::Paged),
        (KvBackendKind::Paged, KvBackendKind::Token),
    ] {
        let what = format!("{from:?} -> {to:?}");
        let dir = TempDir::new("prefix-cache");
        let mut a = session(&model, from);
        run(&mut a, with_sampling(first_q.clone(), sampling(false, 8)));
        let saved = a.save_prefix_cache(dir.path()).expect("save prefix cache");
        assert!(saved.tokens >= first_q.len() - 16, "{what}: {saved:?}");
        let reference = run(&mut a, with_sampling(later_q.clone(), sampling(false, 8))).1;
        drop(a);

        let mut b = session(&model, to);
        let loaded = b.load_prefix_cache(dir.path()).expect("load prefix cache");
        assert!(
            loaded.tokens >= saved.tokens - 16,
            "{what}: {loaded:?} of {saved:?}"
        );
        assert_eq!(b.stats().kv.used_slots, 0, "{what}: loading holds no KV");
        b.check_invariants().unwrap();
        let out = run(&mut b, with_sampling(later_q.clone(), sampling(false, 8))).1;
        let cached = out.usage.as_ref().unwrap().cached_prompt_tokens;
        let shared = first_q
            .iter()
            .zip(&later_q)
            .take_while(|(x, y)| x == y)
            .count();
        assert!(
            cached + 16 > shared,
            "{what}: {cached} cached tokens, {shared} shared with the saved prompt"
        );
        // With the same cached length the same rows are computed over the
        // same KV: the same tokens. (Another length computes a different
        // number of rows in one pass, which may round differently.)
        if cached == reference.usage.as_ref().unwrap().cached_prompt_tokens {
            assert_eq!(
                out.tokens, reference.tokens,
                "{what}: same output as the saving session"
            );
        }

        // A corrupt file changes nothing.
        let file = dir.path().join(nanoinfer::engine::PREFIX_CACHE_FILE);
        let mut bytes = std::fs::read(&file).unwrap();
        let at = bytes.len() / 2;
        bytes[at] ^= 0x10;
        std::fs::write(&file, &bytes).unwrap();
        let mut c = session(&model, to);
        let e = c.load_prefix_cache(dir.path()).unwrap_err();
        assert!(e.message.contains("prefix_cache.nikv"), "{e}");
        assert_eq!(
            c.stats().kv.evictable_slots,
            0,
            "{what}: corrupt file loaded"
        );
    }
}
