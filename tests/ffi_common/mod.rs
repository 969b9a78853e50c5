//! Helpers for the C ABI tests: they call the exported functions exactly as
//! a C program would.
#![allow(dead_code)]

use nanoinfer::ffi::*;
use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;
use std::ptr;
use std::sync::OnceLock;

pub fn model_dir() -> PathBuf {
    let dir = std::env::var_os("NANOINFER_MODEL").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct"),
        PathBuf::from,
    );
    assert!(
        dir.join("config.json").exists(),
        "default model missing at {}: run `python3 scripts/fetch_model.py`",
        dir.display()
    );
    dir
}

pub fn last_error() -> String {
    // SAFETY: ni_last_error never returns NULL and the string lives until the next failing call.
    unsafe { CStr::from_ptr(ni_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// Asserts a failed call: the status and that the thread's message mentions every needle.
#[track_caller]
pub fn assert_err(status: ni_status, expected: ni_status, needles: &[&str]) {
    assert_eq!(
        status,
        expected,
        "expected status {expected}, got {status} ({})",
        last_error()
    );
    let msg = last_error();
    for n in needles {
        assert!(msg.contains(n), "message {msg:?} should mention {n:?}");
    }
}

#[track_caller]
pub fn ok(status: ni_status) {
    assert_eq!(status, NI_OK, "call failed: {}", last_error());
}

pub fn load_model() -> *mut ni_model {
    load_model_at(&model_dir())
}

/// The model in `dir` through `ni_model_load`, 2 kernel threads.
pub fn load_model_at(dir: &std::path::Path) -> *mut ni_model {
    let (status, _, model) = try_load_model_at(dir);
    ok(status);
    assert!(!model.is_null());
    model
}

/// `ni_model_load` of `dir` with 2 kernel threads: (status, last error,
/// model handle or null).
#[allow(dead_code)]
pub fn try_load_model_at(dir: &std::path::Path) -> (ni_status, String, *mut ni_model) {
    let path = CString::new(dir.to_str().unwrap()).unwrap();
    let mut params = std::mem::MaybeUninit::<ni_model_params>::uninit();
    let mut model = ptr::null_mut();
    // SAFETY: valid pointers; params is initialised by ni_model_params_init.
    let status = unsafe {
        ni_model_params_init(params.as_mut_ptr());
        let mut params = params.assume_init();
        params.n_threads = 2;
        ni_model_load(path.as_ptr(), &params, &mut model)
    };
    (status, last_error(), model)
}

struct SharedModel(*mut ni_model);
// SAFETY: a model handle may be used from any thread (documented).
unsafe impl Send for SharedModel {}
unsafe impl Sync for SharedModel {}

/// One model for the whole test binary (never freed).
pub fn shared_model() -> *mut ni_model {
    static MODEL: OnceLock<SharedModel> = OnceLock::new();
    MODEL.get_or_init(|| SharedModel(load_model())).0
}

pub fn session_params() -> ni_session_params {
    let mut p = std::mem::MaybeUninit::<ni_session_params>::uninit();
    // SAFETY: init fills the whole struct.
    unsafe {
        ni_session_params_init(p.as_mut_ptr());
        let mut p = p.assume_init();
        p.kv_capacity_tokens = 4096;
        p
    }
}

pub fn create_session(model: *mut ni_model) -> *mut ni_session {
    let params = session_params();
    let mut s = ptr::null_mut();
    // SAFETY: valid pointers.
    ok(unsafe { ni_session_create(model, &params, &mut s) });
    s
}

pub fn request_params() -> ni_request_params {
    let mut p = std::mem::MaybeUninit::<ni_request_params>::uninit();
    // SAFETY: init fills the whole struct.
    unsafe {
        ni_request_params_init(p.as_mut_ptr());
        p.assume_init()
    }
}

pub fn tokenize(model: *mut ni_model, text: &str) -> Vec<u32> {
    let mut toks = ptr::null_mut();
    let mut n = 0usize;
    // SAFETY: valid pointers; the array is freed below.
    unsafe {
        ok(ni_tokenize(
            model,
            text.as_ptr().cast(),
            text.len(),
            false,
            &mut toks,
            &mut n,
        ));
        let v = if n == 0 {
            vec![]
        } else {
            std::slice::from_raw_parts(toks, n).to_vec()
        };
        ni_tokens_free(toks);
        v
    }
}

/// Adds a greedy token-prompt request.
pub fn add_tokens(session: *mut ni_session, prompt: &[u32], max_tokens: u32) -> u64 {
    let mut r = request_params();
    r.prompt_tokens = prompt.as_ptr();
    r.n_prompt_tokens = prompt.len();
    r.max_tokens = max_tokens;
    let mut id = 0;
    // SAFETY: valid pointers that outlive the call.
    ok(unsafe { ni_session_add_request(session, &r, &mut id) });
    id
}

/// A generated token, its logprob and the top alternatives.
pub type Logprob = (u32, f32, Vec<(u32, f32)>);

/// What one request produced, collected from its events.
#[derive(Debug, Default, Clone)]
pub struct Collected {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: ni_finish_reason,
    pub stop_string_index: i32,
    pub error: Option<String>,
    pub logprobs: Vec<Logprob>,
    pub events: usize,
    /// The terminal event's usage (`collect` checks that exactly that
    /// event has one).
    pub usage: Option<ni_usage>,
}

/// Steps until the session is idle; returns each request's output by id.
pub fn run_to_completion(session: *mut ni_session) -> std::collections::BTreeMap<u64, Collected> {
    let mut out = ptr::null_mut();
    let mut results = std::collections::BTreeMap::<u64, Collected>::new();
    // SAFETY: valid handles; events are read before the next step.
    unsafe {
        ok(ni_step_output_create(&mut out));
        let mut steps = 0;
        while ni_session_has_work(session) {
            steps += 1;
            assert!(steps < 100_000, "session never became idle");
            ok(ni_session_step(session, out));
            collect(out, &mut results);
        }
        ni_step_output_free(out);
    }
    results
}

/// Appends the events of `out` to `results`.
///
/// # Safety
/// `out` must be a live step output.
pub unsafe fn collect(
    out: *const ni_step_output,
    results: &mut std::collections::BTreeMap<u64, Collected>,
) {
    // SAFETY: forwarded contract.
    let n = unsafe { ni_step_output_count(out) };
    // SAFETY: forwarded contract.
    let evs = unsafe { ni_step_output_events(out) };
    if n == 0 {
        assert!(evs.is_null());
        return;
    }
    // SAFETY: the library documents `n` valid events at `evs`.
    for ev in unsafe { std::slice::from_raw_parts(evs, n) } {
        let c = results.entry(ev.request_id).or_default();
        assert_eq!(
            c.finish, NI_FINISH_NONE,
            "event after the terminal event of {}",
            ev.request_id
        );
        c.events += 1;
        // SAFETY: pointers documented valid until the next step.
        unsafe {
            if ev.n_tokens > 0 {
                c.tokens
                    .extend_from_slice(std::slice::from_raw_parts(ev.tokens, ev.n_tokens));
            }
            assert!(!ev.text.is_null());
            assert_eq!(*ev.text.add(ev.text_len), 0, "text is NUL-terminated");
            let bytes = std::slice::from_raw_parts(ev.text.cast::<u8>(), ev.text_len);
            c.text
                .push_str(std::str::from_utf8(bytes).expect("event text is UTF-8"));
            for i in 0..ev.n_logprobs {
                let l = &*ev.logprobs.add(i);
                let top = (0..l.n_top)
                    .map(|j| {
                        let t = &*l.top.add(j);
                        (t.token, t.logprob)
                    })
                    .collect();
                c.logprobs.push((l.token, l.logprob, top));
            }
            if !ev.error_message.is_null() {
                c.error = Some(cstr(ev.error_message));
            }
            assert_eq!(
                ev.usage.is_null(),
                ev.finish_reason == NI_FINISH_NONE,
                "usage comes with the terminal event of {} only",
                ev.request_id
            );
            c.usage = ev.usage.as_ref().copied();
        }
        c.finish = ev.finish_reason;
        c.stop_string_index = ev.stop_string_index;
    }
}

/// # Safety
/// `p` must be a valid NUL-terminated string.
pub unsafe fn cstr(p: *const c_char) -> String {
    // SAFETY: forwarded contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

pub fn stats(session: *mut ni_session) -> ni_session_stats {
    // SAFETY: all-zero is a valid ni_session_stats.
    let mut st: ni_session_stats = unsafe { std::mem::zeroed() };
    st.struct_size = size_of::<ni_session_stats>() as u32;
    // SAFETY: valid pointers.
    ok(unsafe { ni_session_get_stats(session, &mut st) });
    st
}

/// The session is usable: a fresh greedy request runs to a terminal event
/// and all KV is released at idle.
pub fn assert_usable(session: *mut ni_session) {
    let id = add_tokens(session, &[1, 2, 3, 4], 3);
    let r = run_to_completion(session);
    let c = &r[&id];
    assert_eq!(c.finish, NI_FINISH_LENGTH, "{c:?}");
    assert_eq!(c.tokens.len(), 3);
    let st = stats(session);
    assert_eq!((st.running, st.waiting, st.kv_used_tokens), (0, 0, 0));
}
