//! The C ABI used as intended: results through the exported functions match
//! the engine's own API, callbacks fire, and the documented threading works.

mod ffi_common;

use ffi_common::*;
use nanoinfer::engine::{FaultPlan, Model, ModelParams, RequestParams, Session, SessionParams};
use nanoinfer::ffi::*;
use std::ffi::{c_char, c_void, CStr};
use std::ptr;
use std::sync::{Arc, Mutex};

#[test]
fn versions_and_status_names() {
    // SAFETY: static strings.
    unsafe {
        assert_eq!(cstr(ni_version()), env!("CARGO_PKG_VERSION"));
        assert_eq!(ni_abi_version(), NI_ABI_VERSION);
        assert_eq!(cstr(ni_status_name(NI_OK)), "NI_OK");
        assert_eq!(cstr(ni_status_name(NI_ERR_PANIC)), "NI_ERR_PANIC");
        assert_eq!(cstr(ni_status_name(-5)), "NI_ERR_UNKNOWN");
    }
}

#[test]
fn model_info_describes_the_default_model() {
    let model = shared_model();
    // SAFETY: zeroed is a valid ni_model_info; pointers are read while the model lives.
    unsafe {
        let mut info: ni_model_info = std::mem::zeroed();
        info.struct_size = size_of::<ni_model_info>() as u32;
        ok(ni_model_get_info(model, &mut info));
        assert_eq!(cstr(info.architecture), "LlamaForCausalLM");
        assert_eq!(info.vocab_size, 49152);
        assert_eq!(info.context_length, 8192);
        assert_eq!(
            (
                info.n_layers,
                info.hidden_size,
                info.n_heads,
                info.n_kv_heads,
                info.head_dim
            ),
            (30, 576, 9, 3, 64)
        );
        assert_eq!(info.bos_token_id, 1);
        let eos = std::slice::from_raw_parts(info.eos_token_ids, info.n_eos_token_ids);
        assert_eq!(eos, [2]);
        assert!(info.has_tokenizer && info.has_chat_template);
    }
}

#[test]
fn text_functions_round_trip() {
    let model = shared_model();
    let text = "Hello, wörld! 你好";
    let ids = tokenize(model, text);
    assert!(!ids.is_empty());
    let mut out = ptr::null_mut();
    let mut len = 0usize;
    // SAFETY: valid pointers; strings freed with ni_string_free.
    unsafe {
        ok(ni_detokenize(
            model,
            ids.as_ptr(),
            ids.len(),
            false,
            &mut out,
            &mut len,
        ));
        assert_eq!(
            std::slice::from_raw_parts(out.cast::<u8>(), len),
            text.as_bytes()
        );
        assert_eq!(cstr(out), text);
        ni_string_free(out);

        let msgs = [
            ni_chat_message {
                role: c"system".as_ptr(),
                content: c"Be brief.".as_ptr(),
            },
            ni_chat_message {
                role: c"user".as_ptr(),
                content: c"Hi there".as_ptr(),
            },
        ];
        let mut chat = ptr::null_mut();
        ok(ni_apply_chat_template(
            model,
            msgs.as_ptr(),
            msgs.len(),
            true,
            &mut chat,
            ptr::null_mut(),
        ));
        let rendered = cstr(chat);
        ni_string_free(chat);
        assert_eq!(
            rendered,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
        );
        // Empty text tokenizes to an empty, NULL array.
        let mut toks = ptr::without_provenance_mut::<u32>(0x1);
        let mut n = 9usize;
        ok(ni_tokenize(
            model,
            c"".as_ptr(),
            0,
            false,
            &mut toks,
            &mut n,
        ));
        assert!(toks.is_null());
        assert_eq!(n, 0);
    }
}

/// Greedy generation straight through the engine, for comparison.
fn engine_generate(
    prompts: &[Vec<u32>],
    max_tokens: u32,
    ignore_eos: bool,
) -> Vec<(Vec<u32>, String)> {
    let params = ModelParams {
        threads: 2,
        ..Default::default()
    };
    let model = Arc::new(Model::load(&model_dir(), &params, None).unwrap());
    let mut session = Session::new(
        model,
        SessionParams {
            kv_capacity_tokens: 4096,
            ..Default::default()
        },
    )
    .unwrap();
    let mut ids = vec![];
    for p in prompts {
        let mut r = RequestParams {
            prompt: p.clone(),
            ..Default::default()
        };
        r.sampling.max_tokens = max_tokens;
        r.sampling.ignore_eos = ignore_eos;
        ids.push(session.add_request(r).unwrap());
    }
    let mut out = vec![(vec![], String::new()); prompts.len()];
    while session.has_work() {
        for ev in session.step().unwrap() {
            let i = ids.iter().position(|&x| x == ev.request_id).unwrap();
            out[i].0.extend(ev.tokens);
            out[i].1.push_str(&ev.text);
        }
    }
    out
}

#[test]
fn concurrent_requests_match_the_engine_api() {
    let model = shared_model();
    let session = create_session(model);
    let texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time",
    ];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| tokenize(model, t)).collect();
    let mut ids = vec![];
    for t in texts {
        let mut r = request_params();
        r.prompt_text = t.as_ptr().cast();
        r.prompt_text_len = t.len();
        r.max_tokens = 12;
        let mut id = 0;
        // SAFETY: valid pointers.
        ok(unsafe { ni_session_add_request(session, &r, &mut id) });
        ids.push(id);
    }
    assert_eq!(ids, [1, 2, 3]);
    let got = run_to_completion(session);
    let want = engine_generate(&prompts, 12, false);
    for (i, id) in ids.iter().enumerate() {
        let c = &got[id];
        assert_eq!(c.tokens, want[i].0, "tokens of prompt {i}");
        assert_eq!(c.text, want[i].1, "text of prompt {i}");
        assert_eq!(c.finish, NI_FINISH_LENGTH);
        assert_eq!(c.tokens.len(), 12);
    }
    let st = stats(session);
    assert_eq!((st.running, st.waiting, st.kv_used_tokens), (0, 0, 0));
    assert!(st.decode_tokens + st.prefill_tokens > 0);
    assert_eq!(st.kv_capacity_tokens, 4096);
    // SAFETY: freed once.
    unsafe { ni_session_free(session) };
}

#[test]
fn stop_strings_logprobs_and_seeds_come_through() {
    let model = shared_model();
    let session = create_session(model);
    let prompt = tokenize(model, "List three colors: red, green,");
    let base = add_tokens(session, &prompt, 16);
    let base = run_to_completion(session).remove(&base).unwrap();
    let text = base.text.clone();
    assert!(text.chars().count() > 6, "{text:?}");
    // Stop at a piece of the text the greedy run produced.
    let start = text.char_indices().nth(3).unwrap().0;
    let end = text.char_indices().nth(6).unwrap().0;
    let stop = std::ffi::CString::new(&text[start..end]).unwrap();
    let stops = [c"never-matches-xyz".as_ptr(), stop.as_ptr()];
    let mut r = request_params();
    r.prompt_tokens = prompt.as_ptr();
    r.n_prompt_tokens = prompt.len();
    r.max_tokens = 16;
    r.stop_strings = stops.as_ptr();
    r.n_stop_strings = 2;
    r.logprobs = 3;
    let mut id = 0;
    // SAFETY: valid pointers.
    ok(unsafe { ni_session_add_request(session, &r, &mut id) });
    let c = run_to_completion(session).remove(&id).unwrap();
    assert_eq!(c.finish, NI_FINISH_STOP_STRING);
    assert_eq!(c.stop_string_index, 1);
    assert_eq!(c.text, text[..text.find(stop.to_str().unwrap()).unwrap()]);
    assert_eq!(c.logprobs.len(), c.tokens.len());
    for (i, (tok, lp, top)) in c.logprobs.iter().enumerate() {
        assert_eq!(*tok, c.tokens[i]);
        assert!(*lp <= 0.0);
        assert_eq!(top.len(), 3);
        // Greedy: the sampled token is the most likely one.
        assert_eq!(top[0].0, *tok);
        assert!(top.windows(2).all(|w| w[0].1 >= w[1].1));
    }

    // Seeded sampling is reproducible; the session seed covers unseeded requests.
    let sample = |seed: u64| {
        let mut r = request_params();
        r.prompt_tokens = prompt.as_ptr();
        r.n_prompt_tokens = prompt.len();
        r.max_tokens = 10;
        r.temperature = 1.0;
        r.seed = seed;
        r.use_seed = true;
        let mut id = 0;
        // SAFETY: valid pointers.
        ok(unsafe { ni_session_add_request(session, &r, &mut id) });
        run_to_completion(session).remove(&id).unwrap().tokens
    };
    assert_eq!(sample(7), sample(7));
    let distinct: std::collections::HashSet<Vec<u32>> = (0..4).map(sample).collect();
    assert!(distinct.len() > 1, "different seeds should not all agree");
    // SAFETY: freed once.
    unsafe { ni_session_free(session) };
}

struct SessionPtr(*mut ni_session);
// SAFETY: sessions are internally serialized; cancel/stats may come from any thread (documented).
unsafe impl Send for SessionPtr {}

#[test]
fn cancel_and_stats_from_other_threads_while_stepping() {
    let model = shared_model();
    let session = create_session(model);
    let prompt = tokenize(model, "Tell me a long story about a dragon.");
    // The raw prompt makes the model stop at once; generate past EOS.
    let add = |max_tokens| {
        let mut r = request_params();
        r.prompt_tokens = prompt.as_ptr();
        r.n_prompt_tokens = prompt.len();
        r.max_tokens = max_tokens;
        r.ignore_eos = true;
        let mut id = 0;
        // SAFETY: valid pointers.
        ok(unsafe { ni_session_add_request(session, &r, &mut id) });
        id
    };
    let keep = add(20);
    let victim = add(200);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let s = SessionPtr(session);
        let stop = stop.clone();
        std::thread::spawn(move || {
            let s = s;
            let mut reads = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let st = stats(s.0);
                assert!(st.running + st.waiting <= 2);
                reads += 1;
            }
            reads
        })
    };
    let mut out = ptr::null_mut();
    let mut results = std::collections::BTreeMap::new();
    // SAFETY: live handles; the output is used by this thread only.
    unsafe {
        ok(ni_step_output_create(&mut out));
        let mut cancelled = false;
        while ni_session_has_work(session) {
            ok(ni_session_step(session, out));
            collect(out, &mut results);
            let c: &Collected = &results[&victim];
            if !cancelled && c.tokens.len() >= 3 {
                let s = SessionPtr(session);
                let h = std::thread::spawn(move || {
                    let s = s;
                    ni_session_cancel(s.0, victim)
                });
                ok(h.join().unwrap());
                cancelled = true;
            }
        }
        ni_step_output_free(out);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(watcher.join().unwrap() > 0);
    assert_eq!(results[&victim].finish, NI_FINISH_CANCELLED, "{results:?}");
    assert!(results[&victim].tokens.len() < 200);
    assert_eq!(results[&keep].finish, NI_FINISH_LENGTH);
    assert_eq!(results[&keep].tokens.len(), 20);
    let want = engine_generate(&[prompt], 20, true);
    assert_eq!(
        results[&keep].tokens, want[0].0,
        "the cancellation does not disturb the other request"
    );
    // SAFETY: freed once.
    unsafe { ni_session_free(session) };
}

static LOGS: Mutex<Vec<(ni_log_level, String)>> = Mutex::new(Vec::new());

unsafe extern "C" fn record_log(
    level: ni_log_level,
    message: *const c_char,
    user_data: *mut c_void,
) {
    assert_eq!(user_data as usize, 0xabc);
    // SAFETY: the library passes a valid NUL-terminated message.
    let m = unsafe { CStr::from_ptr(message) }
        .to_string_lossy()
        .into_owned();
    LOGS.lock().unwrap().push((level, m));
    // Re-entering the setter from the callback is refused, not deadlocked.
    assert_eq!(ni_set_log_callback(None, ptr::null_mut()), NI_ERR_BUSY);
}

unsafe extern "C" fn record_progress(progress: f32, user_data: *mut c_void) -> bool {
    // SAFETY: user_data is the Vec passed below, used by this thread only.
    let seen = unsafe { &mut *(user_data as *mut Vec<f32>) };
    seen.push(progress);
    true
}

unsafe extern "C" fn cancel_at_half(progress: f32, _user_data: *mut c_void) -> bool {
    progress < 0.5
}

#[test]
fn log_and_progress_callbacks() {
    let path = std::ffi::CString::new(model_dir().to_str().unwrap()).unwrap();
    // SAFETY: valid callbacks and pointers; the log callback is removed at the end.
    unsafe {
        ok(ni_set_log_callback(Some(record_log), 0xabc as *mut c_void));
        let mut seen: Vec<f32> = vec![];
        let mut p = std::mem::MaybeUninit::<ni_model_params>::uninit();
        ni_model_params_init(p.as_mut_ptr());
        let mut p = p.assume_init();
        p.n_threads = 1;
        p.progress = Some(record_progress);
        p.progress_user_data = (&mut seen as *mut Vec<f32>).cast();
        let mut model = ptr::null_mut();
        ok(ni_model_load(path.as_ptr(), &p, &mut model));
        assert_eq!(seen.first(), Some(&0.0));
        assert_eq!(seen.last(), Some(&1.0));
        assert!(seen.windows(2).all(|w| w[0] <= w[1]), "{seen:?}");
        let s = create_session(model);
        ni_session_free(s);
        ni_model_free(model);
        ok(ni_set_log_callback(None, ptr::null_mut()));

        let logs = LOGS.lock().unwrap().clone();
        assert!(
            logs.iter().any(|(l, m)| *l == NI_LOG_INFO
                && m.contains("loaded LlamaForCausalLM")
                && m.contains("1 kernel threads")),
            "{logs:?}"
        );
        assert!(
            logs.iter().any(|(_, m)| m.contains("session created")),
            "{logs:?}"
        );

        p.progress = Some(cancel_at_half);
        let mut m2 = ptr::null_mut();
        assert_err(
            ni_model_load(path.as_ptr(), &p, &mut m2),
            NI_ERR_CANCELLED,
            &["cancelled"],
        );
        assert!(m2.is_null());
    }
}

/// Greedy tokens and first-token logprob of `prompt` on the tiny Llama3
/// model, through the C ABI with `params`.
fn tiny_generate_ffi(params: &ni_model_params, prompt: &[u32]) -> (Vec<u32>, Vec<f32>) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny-llama3");
    let path = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
    let mut model = ptr::null_mut();
    // SAFETY: valid pointers; the handles are freed below.
    unsafe {
        ok(ni_model_load(path.as_ptr(), params, &mut model));
        let session = create_session(model);
        let mut r = request_params();
        r.prompt_tokens = prompt.as_ptr();
        r.n_prompt_tokens = prompt.len();
        r.max_tokens = 12;
        r.logprobs = 1;
        let mut id = 0;
        ok(ni_session_add_request(session, &r, &mut id));
        let got = run_to_completion(session).remove(&id).unwrap();
        ni_session_free(session);
        ni_model_free(model);
        (got.tokens, got.logprobs.iter().map(|l| l.1).collect())
    }
}

/// The same through the Rust API with `quant`.
fn tiny_generate_engine(
    quant: nanoinfer::model::QuantMode,
    prompt: &[u32],
) -> (Vec<u32>, Vec<f32>) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny-llama3");
    let params = ModelParams {
        threads: 2,
        quant,
        ..Default::default()
    };
    let model = Arc::new(Model::load(&dir, &params, None).unwrap());
    let mut session = Session::new(
        model,
        SessionParams {
            kv_capacity_tokens: 4096,
            ..Default::default()
        },
    )
    .unwrap();
    let mut r = RequestParams {
        prompt: prompt.to_vec(),
        ..Default::default()
    };
    r.sampling.max_tokens = 12;
    r.sampling.logprobs = 1;
    session.add_request(r).unwrap();
    let (mut toks, mut lps) = (vec![], vec![]);
    while session.has_work() {
        for ev in session.step().unwrap() {
            toks.extend(ev.tokens);
            lps.extend(ev.logprobs.iter().map(|l| l.logprob));
        }
    }
    (toks, lps)
}

#[test]
fn quantization_params_match_the_engine_and_old_struct_sizes_still_load() {
    use nanoinfer::model::QuantMode;
    let prompt = [3u32, 17, 200, 42, 9];
    let mut p = std::mem::MaybeUninit::<ni_model_params>::uninit();
    // SAFETY: init fills the whole struct.
    let defaults = unsafe {
        ni_model_params_init(p.as_mut_ptr());
        p.assume_init()
    };
    assert_eq!(defaults.quant, NI_QUANT_NONE);
    assert_eq!(defaults.quant_group_size, 0);
    assert!(defaults.quant_lm_head);

    let dense = tiny_generate_engine(QuantMode::None, &prompt);
    let q8 = tiny_generate_engine(QuantMode::Q8_0_DEFAULT, &prompt);
    let q8_64 = tiny_generate_engine(
        QuantMode::Q8_0 {
            group_size: 64,
            lm_head: false,
        },
        &prompt,
    );
    assert_ne!(dense.1, q8.1, "Q8_0 must change the logprobs");
    assert_ne!(
        q8.1, q8_64.1,
        "group 64 / dense head differs from the default Q8_0"
    );

    let mut p = defaults;
    p.n_threads = 2;
    assert_eq!(tiny_generate_ffi(&p, &prompt), dense);
    p.quant = NI_QUANT_Q8_0;
    assert_eq!(tiny_generate_ffi(&p, &prompt), q8);
    p.quant_group_size = 64;
    p.quant_lm_head = false;
    assert_eq!(tiny_generate_ffi(&p, &prompt), q8_64);
    // Int4 at load: AWQ (group 128 by default) and symmetric GPTQ.
    let awq = tiny_generate_engine(
        QuantMode::Awq {
            group_size: 128,
            lm_head: false,
        },
        &prompt,
    );
    let gptq_64 = tiny_generate_engine(
        QuantMode::Gptq {
            group_size: 64,
            sym: true,
            lm_head: false,
        },
        &prompt,
    );
    assert_ne!(dense.1, awq.1, "AWQ must change the logprobs");
    p.quant = NI_QUANT_AWQ;
    p.quant_group_size = 0;
    assert_eq!(tiny_generate_ffi(&p, &prompt), awq);
    p.quant = NI_QUANT_GPTQ;
    p.quant_group_size = 64;
    assert_eq!(tiny_generate_ffi(&p, &prompt), gptq_64);
    // FP8 at load (128 x 128 blocks, dense head whatever quant_lm_head says).
    let fp8 = tiny_generate_engine(QuantMode::Fp8 { lm_head: false }, &prompt);
    assert_ne!(dense.1, fp8.1, "FP8 must change the logprobs");
    p.quant = NI_QUANT_FP8;
    p.quant_group_size = 0;
    p.quant_lm_head = true;
    assert_eq!(tiny_generate_ffi(&p, &prompt), fp8);

    // A caller built against the header before the quant fields existed
    // passes the smaller struct_size: accepted, the new fields default.
    // The bytes past its end are garbage here, as they would be in C.
    p.struct_size = std::mem::offset_of!(ni_model_params, quant) as u32;
    assert_eq!(
        p.struct_size, 40,
        "ni_model_params before the quant fields, on 64-bit targets"
    );
    p.quant = 0xdead;
    assert_eq!(tiny_generate_ffi(&p, &prompt), dense);
}

#[test]
fn kv_capacity_is_reported_in_whole_blocks() {
    // Found by the C ABI soak: a paged cache of 209 tokens in 16-token blocks
    // has 14 blocks (224 slots) and can hold 224 tokens of several requests,
    // so reporting 209 made kv_used_tokens exceed kv_capacity_tokens.
    let model = shared_model();
    for (backend, block, want) in [
        (NI_KV_BACKEND_PAGED, 16, 224),
        (NI_KV_BACKEND_PAGED, 1, 209),
        (NI_KV_BACKEND_TOKEN, 16, 209),
    ] {
        let mut p = session_params();
        p.kv_backend = backend;
        p.block_size = block;
        p.kv_capacity_tokens = 209;
        let mut s = ptr::null_mut();
        // SAFETY: valid pointers.
        ok(unsafe { ni_session_create(model, &p, &mut s) });
        let st = stats(s);
        assert_eq!(
            st.kv_capacity_tokens, want,
            "backend {backend} block {block}"
        );
        assert_eq!(st.kv_free_tokens + st.kv_cached_tokens, want);
        assert_usable(s);
        // SAFETY: created above, freed once.
        unsafe { ni_session_free(s) };
    }
}

/// A prompt of several KV blocks, so that a prefix-cache hit is visible.
const LONG_PROMPT: &str = "The quick brown fox jumps over the lazy dog while the \
    farmer counts his sheep. Meanwhile, in the city, engineers debate the merits of \
    caching, batching and scheduling for language model inference. Write a summary:";

/// Adds a greedy request for `text` (tokenized by the library, without
/// special tokens).
fn add_text(session: *mut ni_session, text: &str, max_tokens: u32, ignore_eos: bool) -> u64 {
    let mut r = request_params();
    r.prompt_text = text.as_ptr().cast();
    r.prompt_text_len = text.len();
    r.max_tokens = max_tokens;
    r.ignore_eos = ignore_eos;
    let mut id = 0;
    // SAFETY: valid pointers that outlive the call.
    ok(unsafe { ni_session_add_request(session, &r, &mut id) });
    id
}

/// The usage of a finished request, checked against what its events carried.
#[track_caller]
fn checked_usage(c: &Collected, prompt: &[u32]) -> ni_usage {
    let u = c.usage.expect("the terminal event carries usage");
    assert_eq!(u.prompt_tokens, prompt.len() as u64, "{u:?}");
    assert_eq!(u.generated_tokens, c.tokens.len() as u64, "{u:?}");
    assert!(u.total_time_ns > 0, "{u:?}");
    assert!(u.time_to_first_token_ns <= u.total_time_ns, "{u:?}");
    assert_eq!(u.time_to_first_token_ns > 0, !c.tokens.is_empty(), "{u:?}");
    u
}

/// Creates a session with 16-token KV blocks and prefix caching as given.
fn usage_session(model: *mut ni_model, prefix_caching: bool) -> *mut ni_session {
    let mut p = session_params();
    p.block_size = 16;
    p.prefix_caching = prefix_caching;
    let mut s = ptr::null_mut();
    // SAFETY: valid pointers.
    ok(unsafe { ni_session_create(model, &p, &mut s) });
    s
}

#[test]
fn usage_reports_prompt_cached_and_generated_tokens_and_times() {
    let model = shared_model();
    let prompt = tokenize(model, LONG_PROMPT);
    assert!(prompt.len() > 40, "{} tokens", prompt.len());
    // Every full block of the prompt but the last token's is reused.
    let cached = ((prompt.len() - 1) / 16 * 16) as u64;

    let session = usage_session(model, true);
    let first = add_text(session, LONG_PROMPT, 8, true);
    let r = run_to_completion(session);
    let u = checked_usage(&r[&first], &prompt);
    assert_eq!(
        (u.cached_prompt_tokens, u.generated_tokens),
        (0, 8),
        "{u:?}"
    );
    assert!(u.time_to_first_token_ns < u.total_time_ns, "{u:?}");

    // The same prompt again, and at once two copies of it: each finds the
    // prompt's blocks in the cache.
    let again = add_text(session, LONG_PROMPT, 3, true);
    let r = run_to_completion(session);
    let u = checked_usage(&r[&again], &prompt);
    assert_eq!((u.cached_prompt_tokens, u.generated_tokens), (cached, 3));
    assert!(cached > 0 && cached.is_multiple_of(stats(session).kv_block_size));
    // A token prompt reports the same counts as its text.
    let by_tokens = add_tokens(session, &prompt, 1);
    let r = run_to_completion(session);
    let u = checked_usage(&r[&by_tokens], &prompt);
    assert_eq!((u.cached_prompt_tokens, u.generated_tokens), (cached, 1));
    // Its only token came with the terminal event: the first token's time is the total.
    assert_eq!(u.time_to_first_token_ns, u.total_time_ns);
    // SAFETY: freed once.
    unsafe { ni_session_free(session) };

    let session = usage_session(model, false);
    for _ in 0..2 {
        let id = add_text(session, LONG_PROMPT, 4, true);
        let u = checked_usage(&run_to_completion(session)[&id], &prompt);
        assert_eq!(
            (u.cached_prompt_tokens, u.generated_tokens),
            (0, 4),
            "{u:?}"
        );
    }
    // SAFETY: freed once.
    unsafe { ni_session_free(session) };
}

#[test]
fn usage_comes_with_cancelled_and_failed_requests() {
    let model = shared_model();
    let prompt = tokenize(model, LONG_PROMPT);
    let cached = ((prompt.len() - 1) / 16 * 16) as u64;
    let session = usage_session(model, true);
    let warm = add_text(session, LONG_PROMPT, 2, true);
    checked_usage(&run_to_completion(session)[&warm], &prompt);

    let mut out = ptr::null_mut();
    // SAFETY: valid pointer.
    ok(unsafe { ni_step_output_create(&mut out) });
    let mut results = std::collections::BTreeMap::new();
    let step = |results: &mut std::collections::BTreeMap<u64, Collected>| {
        // SAFETY: live handles; events are read before the next step.
        unsafe {
            ok(ni_session_step(session, out));
            collect(out, results);
        }
    };

    // Cancelled while waiting: never admitted, nothing generated.
    let waiting = add_text(session, LONG_PROMPT, 50, true);
    // SAFETY: live session.
    ok(unsafe { ni_session_cancel(session, waiting) });
    // Cancelled while running, after a few tokens.
    let running = add_text(session, LONG_PROMPT, 50, true);
    while results
        .get(&running)
        .is_none_or(|c: &Collected| c.tokens.len() < 3)
    {
        step(&mut results);
    }
    // SAFETY: live session.
    ok(unsafe { ni_session_cancel(session, running) });
    step(&mut results);
    let c = &results[&waiting];
    assert_eq!(c.finish, NI_FINISH_CANCELLED);
    let u = checked_usage(c, &prompt);
    assert_eq!(
        (u.cached_prompt_tokens, u.generated_tokens),
        (0, 0),
        "{u:?}"
    );
    let c = &results[&running];
    assert_eq!(c.finish, NI_FINISH_CANCELLED);
    let u = checked_usage(c, &prompt);
    assert_eq!(u.cached_prompt_tokens, cached, "{u:?}");
    assert_eq!(u.generated_tokens, 3, "{u:?}");

    // Failed by the forward pass: one request at its first step (admitted
    // with its cached prefix, nothing generated), one after two tokens.
    let early = add_text(session, LONG_PROMPT, 50, true);
    let other = add_text(session, "Count to ten: one, two,", 50, true);
    let late_prompt = tokenize(model, "Count to ten: one, two,");
    let next = stats(session).steps;
    let plan = FaultPlan {
        forward_error_steps: vec![next],
        ..Default::default()
    };
    // SAFETY: a live session handle.
    unsafe { debug_inject_faults(session, plan) }.unwrap();
    step(&mut results);
    let c = &results[&early];
    assert_eq!(c.finish, NI_FINISH_ERROR, "{c:?}");
    let u = checked_usage(c, &prompt);
    assert_eq!((u.cached_prompt_tokens, u.generated_tokens), (cached, 0));
    assert_eq!(
        results[&other].finish, NI_FINISH_ERROR,
        "{:?}",
        results[&other]
    );
    let late = add_tokens(session, &late_prompt, 50);
    while results.get(&late).is_none_or(|c| c.tokens.len() < 2) {
        step(&mut results);
    }
    let plan = FaultPlan {
        forward_error_steps: vec![stats(session).steps],
        ..Default::default()
    };
    // SAFETY: a live session handle.
    unsafe { debug_inject_faults(session, plan) }.unwrap();
    step(&mut results);
    let c = &results[&late];
    assert_eq!(c.finish, NI_FINISH_ERROR, "{c:?}");
    let u = checked_usage(c, &late_prompt);
    assert_eq!(u.generated_tokens, 2, "{u:?}");
    // SAFETY: freed once each.
    unsafe {
        ni_step_output_free(out);
        ni_session_free(session);
    }
}

#[test]
fn cached_prompt_tokens_are_those_of_the_first_admission_across_preemptions() {
    // A preempted request that is resumed finds its own blocks in the
    // prefix cache (recompute) or restores them (swap); neither counts as
    // cached prompt: the figure stays that of its first admission.
    let model = shared_model();
    let prompt = tokenize(model, LONG_PROMPT);
    let cached = ((prompt.len() - 1) / 16 * 16) as u64;
    for mode in [NI_PREEMPTION_RECOMPUTE, NI_PREEMPTION_SWAP] {
        for warm in [false, true] {
            let mut p = session_params();
            p.block_size = 16;
            p.preemption = mode;
            let mut session = ptr::null_mut();
            // SAFETY: valid pointers.
            ok(unsafe { ni_session_create(model, &p, &mut session) });
            if warm {
                add_text(session, LONG_PROMPT, 1, true);
                run_to_completion(session);
            }
            let id = add_text(session, LONG_PROMPT, 12, true);
            let start = stats(session).steps;
            let plan = FaultPlan {
                // The prefill, two decode steps, then the cache is "full".
                kv_exhausted_steps: vec![start + 3],
                ..Default::default()
            };
            // SAFETY: a live session handle.
            unsafe { debug_inject_faults(session, plan) }.unwrap();
            let hits_before = stats(session).prefix_cache_hits;
            let r = run_to_completion(session);
            let st = stats(session);
            assert_eq!(st.preemptions, 1, "mode {mode}");
            if mode == NI_PREEMPTION_RECOMPUTE {
                assert_eq!(
                    st.prefix_cache_hits - hits_before,
                    1 + u64::from(warm),
                    "the resumed request found its own prefix"
                );
            }
            let u = checked_usage(&r[&id], &prompt);
            let want = if warm { cached } else { 0 };
            assert_eq!(u.cached_prompt_tokens, want, "mode {mode}, warm {warm}");
            assert_eq!(u.generated_tokens, 12);
            // SAFETY: freed once.
            unsafe { ni_session_free(session) };
        }
    }
}
