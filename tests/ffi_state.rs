//! Saved conversations and prefix caches through the C ABI: a state saved
//! with `ni_session_save_state` (bytes) or `_file` continues in another
//! session with the uninterrupted run's tokens; bad handles, paths and
//! bytes are errors naming the problem; `retain_state` is not read from a
//! caller of the older struct size.

mod ffi_common;

use ffi_common::*;
use nanoinfer::ffi::*;
use std::ffi::CString;
use std::ptr;

fn prompt() -> Vec<u32> {
    tokenize(
        shared_model(),
        "A painter mixes pigments on a wooden palette before a large canvas. \
         Asked by a student about color theory, she explains that the three primary colors are",
    )
}

/// Runs a greedy request of `max_tokens` with `retain`; returns its id and tokens.
fn run(session: *mut ni_session, retain: bool, max_tokens: u32) -> (u64, Vec<u32>) {
    let p = prompt();
    let mut r = request_params();
    r.prompt_tokens = p.as_ptr();
    r.n_prompt_tokens = p.len();
    r.max_tokens = max_tokens;
    r.ignore_eos = true;
    r.retain_state = retain;
    let mut id = 0;
    // SAFETY: the pointers in `r` outlive the call.
    ok(unsafe { ni_session_add_request(session, &r, &mut id) });
    (id, run_to_completion(session).remove(&id).unwrap().tokens)
}

fn continue_from(
    session: *mut ni_session,
    restore: impl FnOnce(&ni_request_params, &mut u64) -> ni_status,
    max_tokens: u32,
) -> Vec<u32> {
    let mut r = request_params();
    r.max_tokens = max_tokens;
    r.ignore_eos = true;
    let mut id = 0;
    ok(restore(&r, &mut id));
    run_to_completion(session).remove(&id).unwrap().tokens
}

#[test]
fn a_saved_conversation_continues_in_another_session() {
    let model = shared_model();
    let whole = {
        let s = create_session(model);
        let (_, t) = run(s, false, 16);
        // SAFETY: created above, freed once.
        unsafe { ni_session_free(s) };
        t
    };
    let first = create_session(model);
    let (id, part) = run(first, true, 8);
    assert_eq!(part[..], whole[..8]);
    let mut data = ptr::null_mut();
    let mut len = 0usize;
    // SAFETY: valid handle and out-pointers.
    ok(unsafe { ni_session_save_state(first, id, &mut data, &mut len) });
    // SAFETY: the library returned `len` bytes at `data`.
    let bytes = unsafe { std::slice::from_raw_parts(data, len) }.to_vec();
    // SAFETY: returned by ni_session_save_state, freed once.
    unsafe { ni_bytes_free(data) };
    let dir = std::env::temp_dir().join(format!("nanoinfer-ffi-state-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = CString::new(dir.join("c.nistate").to_str().unwrap()).unwrap();
    // SAFETY: valid handle and NUL-terminated path.
    ok(unsafe { ni_session_save_state_file(first, id, file.as_ptr()) });
    // SAFETY: valid handle.
    ok(unsafe { ni_session_release_state(first, id) });
    assert_err(
        // SAFETY: valid handle.
        unsafe { ni_session_release_state(first, id) },
        NI_ERR_INVALID_ARGUMENT,
        &["no state is kept"],
    );
    let cache = CString::new(dir.join("cache").to_str().unwrap()).unwrap();
    let mut saved = 0usize;
    // SAFETY: valid handle, path and out-pointer.
    ok(unsafe { ni_session_save_prefix_cache(first, cache.as_ptr(), &mut saved) });
    // SAFETY: created above, freed once.
    unsafe { ni_session_free(first) };

    let second = create_session(model);
    let rest = continue_from(
        second,
        // SAFETY: `bytes` outlives the call.
        |r, id| unsafe { ni_session_restore_request(second, bytes.as_ptr(), bytes.len(), r, id) },
        8,
    );
    assert_eq!(rest[..], whole[8..]);
    let rest = continue_from(
        second,
        // SAFETY: valid path.
        |r, id| unsafe { ni_session_restore_request_file(second, file.as_ptr(), r, id) },
        8,
    );
    assert_eq!(rest[..], whole[8..]);
    let mut loaded = 0usize;
    // SAFETY: valid handle, path and out-pointer.
    ok(unsafe { ni_session_load_prefix_cache(second, cache.as_ptr(), &mut loaded) });
    assert!(
        saved > 0 && loaded <= saved,
        "saved {saved}, loaded {loaded}"
    );

    // Errors name what is wrong; nothing is queued.
    let mut id = 0;
    assert_err(
        // SAFETY: `bytes` is readable; NULL request means the defaults.
        unsafe { ni_session_restore_request(second, bytes.as_ptr(), 40, ptr::null(), &mut id) },
        NI_ERR_INVALID_ARGUMENT,
        &["truncated"],
    );
    assert_err(
        // SAFETY: NULL data with a length is refused before any read.
        unsafe { ni_session_restore_request(second, ptr::null(), 5, ptr::null(), &mut id) },
        NI_ERR_INVALID_ARGUMENT,
        &["data"],
    );
    let missing = CString::new(dir.join("missing").to_str().unwrap()).unwrap();
    let status =
        // SAFETY: valid handle and path.
        unsafe { ni_session_restore_request_file(second, missing.as_ptr(), ptr::null(), &mut id) };
    assert_ne!(status, NI_OK);
    assert!(last_error().contains("missing"), "{}", last_error());
    assert_err(
        // SAFETY: valid handle.
        unsafe { ni_session_save_state(second, 12345, &mut data, &mut len) },
        NI_ERR_INVALID_ARGUMENT,
        &["12345"],
    );
    // SAFETY: valid handle.
    assert!(!unsafe { ni_session_has_work(second) });
    // SAFETY: created above, freed once.
    unsafe { ni_session_free(second) };
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn older_struct_sizes_do_not_read_retain_state() {
    let v3 = std::mem::offset_of!(ni_request_params, retain_state);
    assert!(v3 < size_of::<ni_request_params>());
    let s = create_session(shared_model());
    let p = prompt();
    let mut r = request_params();
    r.struct_size = v3 as u32;
    r.prompt_tokens = p.as_ptr();
    r.n_prompt_tokens = p.len();
    r.max_tokens = 2;
    r.retain_state = true; // past the old struct's end: must not be read
    let mut id = 0;
    // SAFETY: the pointers in `r` outlive the call.
    ok(unsafe { ni_session_add_request(s, &r, &mut id) });
    run_to_completion(s);
    let mut data = ptr::null_mut();
    let mut len = 0usize;
    assert_err(
        // SAFETY: valid handle and out-pointers.
        unsafe { ni_session_save_state(s, id, &mut data, &mut len) },
        NI_ERR_INVALID_ARGUMENT,
        &["retain_state"],
    );
    // SAFETY: created above, freed once.
    unsafe { ni_session_free(s) };
}
