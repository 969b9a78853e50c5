//! Misuse of the C ABI (issue 3, point 8), through the exported functions:
//! every case gets a status and a message, nothing crashes, and the session
//! stays usable afterwards.

mod ffi_common;

use ffi_common::*;
use nanoinfer::ffi::*;
use std::ffi::{c_char, CString};
use std::ptr;

#[test]
fn null_handles_and_out_params_are_refused() {
    let model = shared_model();
    let session = create_session(model);
    let mut out_model = ptr::without_provenance_mut::<ni_model>(0x1);
    let mut out_session = ptr::without_provenance_mut::<ni_session>(0x1);
    let mut id = 77u64;
    let mut toks = ptr::without_provenance_mut::<u32>(0x1);
    let mut n = 5usize;
    let mut text = ptr::without_provenance_mut::<c_char>(0x1);
    let path = CString::new(model_dir().to_str().unwrap()).unwrap();
    let req = request_params();
    // SAFETY: NULL and valid pointers only; the library must reject the NULLs.
    unsafe {
        assert_err(
            ni_model_load(ptr::null(), ptr::null(), &mut out_model),
            NI_ERR_INVALID_ARGUMENT,
            &["path"],
        );
        assert_err(
            ni_model_load(path.as_ptr(), ptr::null(), ptr::null_mut()),
            NI_ERR_INVALID_ARGUMENT,
            &["out_model"],
        );
        assert_err(
            ni_model_get_info(ptr::null(), ptr::null_mut()),
            NI_ERR_INVALID_ARGUMENT,
            &["model"],
        );
        assert_err(
            ni_model_get_info(model, ptr::null_mut()),
            NI_ERR_INVALID_ARGUMENT,
            &["out_info"],
        );
        assert_err(
            ni_tokenize(ptr::null(), c"hi".as_ptr(), 2, false, &mut toks, &mut n),
            NI_ERR_INVALID_ARGUMENT,
            &["model"],
        );
        assert_err(
            ni_tokenize(model, ptr::null(), 2, false, &mut toks, &mut n),
            NI_ERR_INVALID_ARGUMENT,
            &["text", "NULL"],
        );
        assert_err(
            ni_tokenize(model, c"hi".as_ptr(), 2, false, ptr::null_mut(), &mut n),
            NI_ERR_INVALID_ARGUMENT,
            &["out_tokens"],
        );
        assert_err(
            ni_tokenize(model, c"hi".as_ptr(), 2, false, &mut toks, ptr::null_mut()),
            NI_ERR_INVALID_ARGUMENT,
            &["out_count"],
        );
        assert_err(
            ni_detokenize(model, ptr::null(), 3, false, &mut text, ptr::null_mut()),
            NI_ERR_INVALID_ARGUMENT,
            &["tokens"],
        );
        assert_err(
            ni_detokenize(
                model,
                [1u32].as_ptr(),
                1,
                false,
                ptr::null_mut(),
                ptr::null_mut(),
            ),
            NI_ERR_INVALID_ARGUMENT,
            &["out_text"],
        );
        assert_err(
            ni_apply_chat_template(model, ptr::null(), 1, true, &mut text, ptr::null_mut()),
            NI_ERR_INVALID_ARGUMENT,
            &["messages"],
        );
        let bad_msg = ni_chat_message {
            role: ptr::null(),
            content: c"x".as_ptr(),
        };
        assert_err(
            ni_apply_chat_template(model, &bad_msg, 1, true, &mut text, ptr::null_mut()),
            NI_ERR_INVALID_ARGUMENT,
            &["messages[0].role"],
        );
        assert_err(
            ni_session_create(ptr::null(), ptr::null(), &mut out_session),
            NI_ERR_INVALID_ARGUMENT,
            &["model"],
        );
        assert_err(
            ni_session_create(model, ptr::null(), ptr::null_mut()),
            NI_ERR_INVALID_ARGUMENT,
            &["out_session"],
        );
        assert_err(
            ni_session_add_request(ptr::null_mut(), &req, &mut id),
            NI_ERR_INVALID_ARGUMENT,
            &["session"],
        );
        assert_err(
            ni_session_add_request(session, ptr::null(), &mut id),
            NI_ERR_INVALID_ARGUMENT,
            &["request"],
        );
        let mut r = request_params();
        r.prompt_tokens = [1u32, 2].as_ptr();
        r.n_prompt_tokens = 2;
        assert_err(
            ni_session_add_request(session, &r, ptr::null_mut()),
            NI_ERR_INVALID_ARGUMENT,
            &["out_id"],
        );
        assert_err(
            ni_session_step(ptr::null_mut(), ptr::null_mut()),
            NI_ERR_INVALID_ARGUMENT,
            &["session"],
        );
        assert_err(
            ni_session_step(session, ptr::null_mut()),
            NI_ERR_INVALID_ARGUMENT,
            &["output"],
        );
        assert_err(
            ni_session_cancel(ptr::null_mut(), 1),
            NI_ERR_INVALID_ARGUMENT,
            &["session"],
        );
        assert_err(
            ni_session_get_stats(ptr::null_mut(), ptr::null_mut()),
            NI_ERR_INVALID_ARGUMENT,
            &["session"],
        );
        assert_err(
            ni_session_get_stats(session, ptr::null_mut()),
            NI_ERR_INVALID_ARGUMENT,
            &["out_stats"],
        );
        assert_err(
            ni_step_output_create(ptr::null_mut()),
            NI_ERR_INVALID_ARGUMENT,
            &["out_output"],
        );
        assert!(!ni_session_has_work(ptr::null_mut()));
        assert_eq!(ni_step_output_count(ptr::null()), 0);
        assert!(ni_step_output_events(ptr::null()).is_null());
        // Free functions accept NULL.
        ni_model_free(ptr::null_mut());
        ni_session_free(ptr::null_mut());
        ni_step_output_free(ptr::null_mut());
        ni_string_free(ptr::null_mut());
        ni_tokens_free(ptr::null_mut());
        ni_model_params_init(ptr::null_mut());
        ni_session_params_init(ptr::null_mut());
        ni_request_params_init(ptr::null_mut());
    }
    // Out-parameters are untouched on failure.
    assert_eq!(out_model as usize, 0x1);
    assert_eq!(out_session as usize, 0x1);
    assert_eq!((id, n, toks as usize, text as usize), (77, 5, 0x1, 0x1));
    assert_usable(session);
    // SAFETY: created above, freed once.
    unsafe { ni_session_free(session) };
}

#[test]
fn uninitialised_or_mismatched_struct_sizes_are_refused() {
    let model = shared_model();
    let mut s = ptr::null_mut();
    let mut params = session_params();
    params.struct_size = 0;
    // SAFETY: valid pointers.
    unsafe {
        assert_err(
            ni_session_create(model, &params, &mut s),
            NI_ERR_INVALID_ARGUMENT,
            &["struct_size", "ni_*_params_init"],
        );
        params.struct_size = 8;
        assert_err(
            ni_session_create(model, &params, &mut s),
            NI_ERR_INVALID_ARGUMENT,
            &["struct_size is 8", "NI_ABI_VERSION"],
        );
        let mut info: ni_model_info = std::mem::zeroed();
        assert_err(
            ni_model_get_info(model, &mut info),
            NI_ERR_INVALID_ARGUMENT,
            &["struct_size", "sizeof"],
        );
    }
    assert!(s.is_null());
}

#[test]
fn out_of_range_enum_values_are_refused() {
    let model = shared_model();
    let mut s = ptr::null_mut();
    for (field, set) in [
        (
            "kv_backend",
            (|p: &mut ni_session_params| p.kv_backend = 9) as fn(&mut ni_session_params),
        ),
        ("policy", |p| p.policy = 9),
        ("preemption", |p| p.preemption = 9),
        ("memory_pool", |p| p.memory_pool = 99),
        ("kv_memory_fraction", |p| p.kv_memory_fraction = f32::NAN),
        ("memory_utilization", |p| p.memory_utilization = 1.5),
        ("block_size", |p| p.block_size = 0),
    ] {
        let mut params = session_params();
        set(&mut params);
        // SAFETY: valid pointers.
        let st = unsafe { ni_session_create(model, &params, &mut s) };
        assert_err(st, NI_ERR_INVALID_ARGUMENT, &[field]);
    }
    assert!(s.is_null());
}

#[test]
fn model_freed_while_session_lives_is_kept_alive() {
    let model = load_model();
    let a = create_session(model);
    let b = create_session(model);
    // SAFETY: each handle is freed exactly once; the sessions keep the model alive.
    unsafe { ni_model_free(model) };
    let prompt = [1u32, 2, 3, 4, 5];
    let ia = add_tokens(a, &prompt, 4);
    let ib = add_tokens(b, &prompt, 4);
    let ra = run_to_completion(a);
    // SAFETY: as above.
    unsafe { ni_session_free(a) };
    let rb = run_to_completion(b);
    assert_eq!(
        ra[&ia].tokens, rb[&ib].tokens,
        "same greedy output from both sessions"
    );
    assert_eq!(ra[&ia].tokens.len(), 4);
    // SAFETY: as above.
    unsafe { ni_session_free(b) };
}

#[test]
fn handles_sharing_a_model_are_freed_independently_in_any_order() {
    // Two model handles of the same directory, sessions on each, freed interleaved.
    let m1 = load_model();
    let m2 = load_model();
    let s1 = create_session(m1);
    let s2 = create_session(m2);
    let s3 = create_session(m1);
    // SAFETY: every handle is live and freed exactly once.
    unsafe {
        ni_session_free(s1);
        ni_model_free(m1);
        assert_usable(s3);
        ni_model_free(m2);
        assert_usable(s2);
        ni_session_free(s3);
        ni_session_free(s2);
    }
}

#[test]
fn invalid_utf8_is_refused_everywhere() {
    let model = shared_model();
    let session = create_session(model);
    let bad = b"ok \xff\xfe bad";
    let mut toks = ptr::null_mut();
    let mut n = 0usize;
    let mut id = 0u64;
    // SAFETY: valid pointers and lengths.
    unsafe {
        assert_err(
            ni_tokenize(
                model,
                bad.as_ptr().cast(),
                bad.len(),
                false,
                &mut toks,
                &mut n,
            ),
            NI_ERR_INVALID_ARGUMENT,
            &["text", "UTF-8", "offset 3"],
        );
        let mut r = request_params();
        r.prompt_text = bad.as_ptr().cast();
        r.prompt_text_len = bad.len();
        assert_err(
            ni_session_add_request(session, &r, &mut id),
            NI_ERR_INVALID_ARGUMENT,
            &["prompt_text", "UTF-8"],
        );
        let bad_stop = b"\xc3\0";
        let stops = [c"fine".as_ptr(), bad_stop.as_ptr().cast::<c_char>()];
        let mut r = request_params();
        r.prompt_tokens = [1u32, 2].as_ptr();
        r.n_prompt_tokens = 2;
        r.stop_strings = stops.as_ptr();
        r.n_stop_strings = 2;
        assert_err(
            ni_session_add_request(session, &r, &mut id),
            NI_ERR_INVALID_ARGUMENT,
            &["stop_strings[1]", "UTF-8"],
        );
        let bad_content = b"\xe2\x82\0";
        let msg = ni_chat_message {
            role: c"user".as_ptr(),
            content: bad_content.as_ptr().cast(),
        };
        let mut text = ptr::null_mut();
        assert_err(
            ni_apply_chat_template(model, &msg, 1, true, &mut text, ptr::null_mut()),
            NI_ERR_INVALID_ARGUMENT,
            &["messages[0].content", "UTF-8"],
        );
    }
    assert!(toks.is_null());
    assert_eq!(id, 0);
    assert_usable(session);
    // SAFETY: freed once.
    unsafe { ni_session_free(session) };
}

#[test]
fn bad_prompts_are_refused_and_nothing_is_queued() {
    let model = shared_model();
    let session = create_session(model);
    let mut id = 0u64;
    let long: Vec<u32> = (0..8193).map(|i| (i % 1000) as u32 + 10).collect();
    // SAFETY: valid pointers and lengths.
    unsafe {
        // Empty: neither field, tokens with length 0, empty text.
        let r = request_params();
        assert_err(
            ni_session_add_request(session, &r, &mut id),
            NI_ERR_INVALID_ARGUMENT,
            &["prompt is empty"],
        );
        let mut r = request_params();
        r.prompt_text = c"".as_ptr();
        assert_err(
            ni_session_add_request(session, &r, &mut id),
            NI_ERR_INVALID_ARGUMENT,
            &["prompt is empty"],
        );
        // Both prompt kinds at once.
        let mut r = request_params();
        r.prompt_text = c"hi".as_ptr();
        r.prompt_text_len = 2;
        r.prompt_tokens = [1u32].as_ptr();
        r.n_prompt_tokens = 1;
        assert_err(
            ni_session_add_request(session, &r, &mut id),
            NI_ERR_INVALID_ARGUMENT,
            &["exactly one of"],
        );
        // NULL tokens with a length.
        let mut r = request_params();
        r.n_prompt_tokens = 4;
        assert_err(
            ni_session_add_request(session, &r, &mut id),
            NI_ERR_INVALID_ARGUMENT,
            &["prompt_tokens is NULL", "4"],
        );
        // Token ids outside the vocabulary.
        let mut r = request_params();
        let bad = [1u32, 49152, 3];
        r.prompt_tokens = bad.as_ptr();
        r.n_prompt_tokens = bad.len();
        assert_err(
            ni_session_add_request(session, &r, &mut id),
            NI_ERR_INVALID_ARGUMENT,
            &["49152", "vocabulary"],
        );
        let mut text = ptr::null_mut();
        assert_err(
            ni_detokenize(
                model,
                bad.as_ptr(),
                bad.len(),
                false,
                &mut text,
                ptr::null_mut(),
            ),
            NI_ERR_INVALID_ARGUMENT,
            &["49152"],
        );
        assert!(text.is_null());
        // Longer than the context.
        let mut r = request_params();
        r.prompt_tokens = long.as_ptr();
        r.n_prompt_tokens = long.len();
        assert_err(
            ni_session_add_request(session, &r, &mut id),
            NI_ERR_INVALID_ARGUMENT,
            &["8193", "context length 8192"],
        );
        // Fits the context but not the session's KV capacity (4096 tokens).
        r.n_prompt_tokens = 5000;
        r.max_tokens = 1;
        assert_err(
            ni_session_add_request(session, &r, &mut id),
            NI_ERR_INVALID_ARGUMENT,
            &["KV capacity"],
        );
    }
    assert_eq!(id, 0);
    assert!(
        // SAFETY: live handle.
        !unsafe { ni_session_has_work(session) },
        "nothing was queued"
    );
    assert_usable(session);
    // SAFETY: freed once.
    unsafe { ni_session_free(session) };
}

#[test]
fn bad_sampling_values_name_the_parameter() {
    let model = shared_model();
    let session = create_session(model);
    let prompt = [1u32, 2, 3];
    type Case = (&'static str, fn(&mut ni_request_params));
    let cases: Vec<Case> = vec![
        ("max_tokens", |r| r.max_tokens = 0),
        ("temperature", |r| r.temperature = f32::NAN),
        ("temperature", |r| r.temperature = -1.0),
        ("top_p", |r| r.top_p = 0.0),
        ("top_p", |r| r.top_p = 1.5),
        ("top_p", |r| r.top_p = f32::NAN),
        ("top_k", |r| r.top_k = -2),
        ("min_p", |r| r.min_p = 2.0),
        ("repetition_penalty", |r| r.repetition_penalty = 0.0),
        ("presence_penalty", |r| r.presence_penalty = 3.0),
        ("logprobs", |r| r.logprobs = 21),
        ("min_tokens", |r| r.min_tokens = 300),
    ];
    for (name, set) in cases {
        let mut r = request_params();
        r.prompt_tokens = prompt.as_ptr();
        r.n_prompt_tokens = prompt.len();
        set(&mut r);
        let mut id = 0;
        // SAFETY: valid pointers.
        let st = unsafe { ni_session_add_request(session, &r, &mut id) };
        assert_err(st, NI_ERR_INVALID_ARGUMENT, &[name]);
        assert_eq!(id, 0);
    }
    let bias = [ni_logit_bias {
        token: 60000,
        bias: 1.0,
    }];
    let stop_ids = [70000u32];
    let mut r = request_params();
    r.prompt_tokens = prompt.as_ptr();
    r.n_prompt_tokens = prompt.len();
    r.logit_bias = bias.as_ptr();
    r.n_logit_bias = 1;
    let mut id = 0;
    // SAFETY: valid pointers.
    unsafe {
        assert_err(
            ni_session_add_request(session, &r, &mut id),
            NI_ERR_INVALID_ARGUMENT,
            &["logit_bias", "60000"],
        );
        r.n_logit_bias = 0;
        r.logit_bias = ptr::null();
        r.stop_token_ids = stop_ids.as_ptr();
        r.n_stop_token_ids = 1;
        assert_err(
            ni_session_add_request(session, &r, &mut id),
            NI_ERR_INVALID_ARGUMENT,
            &["stop_token_ids", "70000"],
        );
        r.stop_token_ids = ptr::null();
        r.n_stop_token_ids = 0;
        let empty = [c"".as_ptr()];
        r.stop_strings = empty.as_ptr();
        r.n_stop_strings = 1;
        assert_err(
            ni_session_add_request(session, &r, &mut id),
            NI_ERR_INVALID_ARGUMENT,
            &["stop_strings[0]", "empty"],
        );
    }
    assert_usable(session);
    // SAFETY: freed once.
    unsafe { ni_session_free(session) };
}

#[test]
fn cancel_of_unknown_or_finished_ids_is_refused() {
    let model = shared_model();
    let session = create_session(model);
    // SAFETY: live handle throughout.
    unsafe {
        assert_err(
            ni_session_cancel(session, 12345),
            NI_ERR_INVALID_ARGUMENT,
            &["12345", "not active"],
        );
        let id = add_tokens(session, &[1, 2, 3], 2);
        let r = run_to_completion(session);
        assert_eq!(r[&id].finish, NI_FINISH_LENGTH);
        assert_err(
            ni_session_cancel(session, id),
            NI_ERR_INVALID_ARGUMENT,
            &[&id.to_string()],
        );
        // Cancel twice: the first succeeds and yields exactly one terminal event.
        let id = add_tokens(session, &[1, 2, 3], 50);
        ok(ni_session_cancel(session, id));
        assert_err(
            ni_session_cancel(session, id),
            NI_ERR_INVALID_ARGUMENT,
            &["not active"],
        );
        let r = run_to_completion(session);
        assert_eq!(r[&id].finish, NI_FINISH_CANCELLED);
        assert_eq!(r[&id].events, 1);
    }
    assert_usable(session);
    // SAFETY: freed once.
    unsafe { ni_session_free(session) };
}

#[test]
fn forced_panics_become_statuses_and_the_session_survives() {
    let model = shared_model();
    let session = create_session(model);
    let mut out = ptr::null_mut();
    // SAFETY: live handles throughout.
    unsafe {
        // Hooks are off by default.
        assert_err(
            ni_debug_force_panic(ptr::null_mut()),
            NI_ERR_UNSUPPORTED,
            &["NANOINFER_TEST_HOOKS"],
        );
        enable_test_hooks();
        assert_err(
            ni_debug_force_panic(ptr::null_mut()),
            NI_ERR_PANIC,
            &["panic", "ni_debug_force_panic"],
        );

        // A panic inside a step, while the session is locked mid-generation.
        let id = add_tokens(session, &[1, 2, 3, 4], 6);
        ok(ni_step_output_create(&mut out));
        ok(ni_session_step(session, out));
        let first = ni_step_output_count(out);
        ok(ni_debug_force_panic(session));
        assert_err(
            ni_session_step(session, out),
            NI_ERR_PANIC,
            &["ni_session_step", "forced"],
        );
        assert_eq!(
            ni_step_output_count(out),
            first,
            "output keeps its previous contents on failure"
        );
        ni_step_output_free(out);
        // The request continues and finishes normally after the panic.
        let r = run_to_completion(session);
        assert_eq!(r[&id].finish, NI_FINISH_LENGTH);
    }
    assert_usable(session);
    // SAFETY: freed once.
    unsafe { ni_session_free(session) };
}

#[test]
fn errors_are_thread_local() {
    let model = shared_model();
    let mut n = 0usize;
    let mut toks = ptr::null_mut();
    // SAFETY: valid pointers.
    let st = unsafe { ni_tokenize(model, ptr::null(), 1, false, &mut toks, &mut n) };
    assert_err(st, NI_ERR_INVALID_ARGUMENT, &["text"]);
    let other = std::thread::spawn(last_error).join().unwrap();
    assert_eq!(other, "", "another thread sees no error");
    assert!(last_error().contains("text"));
}

#[test]
fn model_load_failures_have_statuses_and_messages() {
    let mut m = ptr::null_mut();
    let missing = c"/nonexistent/nanoinfer-model";
    // SAFETY: valid pointers.
    unsafe {
        assert_err(
            ni_model_load(missing.as_ptr(), ptr::null(), &mut m),
            NI_ERR_IO,
            &["/nonexistent/nanoinfer-model"],
        );
        assert_err(
            ni_model_load(c"".as_ptr(), ptr::null(), &mut m),
            NI_ERR_INVALID_ARGUMENT,
            &["path is empty"],
        );
        let path = CString::new(model_dir().to_str().unwrap()).unwrap();
        let mut p = std::mem::MaybeUninit::<ni_model_params>::uninit();
        ni_model_params_init(p.as_mut_ptr());
        let mut p = p.assume_init();
        p.dtype = 42;
        assert_err(
            ni_model_load(path.as_ptr(), &p, &mut m),
            NI_ERR_INVALID_ARGUMENT,
            &["dtype 42"],
        );
        p.dtype = NI_DTYPE_AUTO;
        p.device = NI_DEVICE_CUDA;
        // This machine has no CUDA driver: a clear error, not a crash.
        assert_err(
            ni_model_load(path.as_ptr(), &p, &mut m),
            NI_ERR_UNSUPPORTED,
            &["CUDA"],
        );
        p.device_index = -1;
        assert_err(
            ni_model_load(path.as_ptr(), &p, &mut m),
            NI_ERR_INVALID_ARGUMENT,
            &["device_index -1"],
        );
        p.device_index = 0;
        p.device = 7;
        assert_err(
            ni_model_load(path.as_ptr(), &p, &mut m),
            NI_ERR_INVALID_ARGUMENT,
            &["device 7"],
        );
    }
    assert!(m.is_null());
}

#[test]
fn bad_quantization_params_are_refused() {
    let path = std::ffi::CString::new(model_dir().to_str().unwrap()).unwrap();
    let mut p = std::mem::MaybeUninit::<ni_model_params>::uninit();
    // SAFETY: init fills the whole struct; valid pointers.
    unsafe {
        ni_model_params_init(p.as_mut_ptr());
        let mut p = p.assume_init();
        let mut model = ptr::null_mut();
        p.quant = 7;
        assert_err(
            ni_model_load(path.as_ptr(), &p, &mut model),
            NI_ERR_INVALID_ARGUMENT,
            &["quant 7", "NI_QUANT_"],
        );
        p.quant = NI_QUANT_Q8_0;
        p.quant_group_size = 30;
        assert_err(
            ni_model_load(path.as_ptr(), &p, &mut model),
            NI_ERR_INVALID_ARGUMENT,
            &["group size", "30"],
        );
        p.quant = NI_QUANT_AWQ;
        p.quant_group_size = 48;
        assert_err(
            ni_model_load(path.as_ptr(), &p, &mut model),
            NI_ERR_INVALID_ARGUMENT,
            &["group size", "48"],
        );
        p.quant = NI_QUANT_Q8_0;
        p.quant_group_size = 0;
        p.struct_size += 8;
        assert_err(
            ni_model_load(path.as_ptr(), &p, &mut model),
            NI_ERR_INVALID_ARGUMENT,
            &["struct_size", "or an older [40]"],
        );
        assert!(model.is_null());
    }
}
