//! Speculative decoding through the C ABI: a session with n-gram lookup or
//! a draft model gives the tokens of a plain session, counts its drafts in
//! `ni_session_stats`, honours `disable_speculation`, refuses bad settings
//! by name, and reads no speculative field from a caller of an older
//! struct size.

mod ffi_common;

use ffi_common::*;
use nanoinfer::ffi::*;
use std::ptr;

/// A prompt whose answer quotes it: prompt lookup drafts well.
fn prompt() -> Vec<u32> {
    tokenize(
        shared_model(),
        "Copy this sentence: the quick brown fox jumps over the lazy dog. \
         Copy this sentence: the quick brown fox jumps over the lazy dog. \
         Copy this sentence: the quick brown fox",
    )
}

fn session_with(edit: impl FnOnce(&mut ni_session_params)) -> Result<*mut ni_session, ni_status> {
    let mut p = session_params();
    edit(&mut p);
    let mut s = ptr::null_mut();
    // SAFETY: valid pointers.
    match unsafe { ni_session_create(shared_model(), &p, &mut s) } {
        NI_OK => Ok(s),
        e => Err(e),
    }
}

fn generate(s: *mut ni_session, disable_speculation: bool) -> Vec<u32> {
    let p = prompt();
    let mut r = request_params();
    r.prompt_tokens = p.as_ptr();
    r.n_prompt_tokens = p.len();
    r.max_tokens = 24;
    r.ignore_eos = true;
    r.disable_speculation = disable_speculation;
    let mut id = 0;
    // SAFETY: the pointers in `r` outlive the call.
    ok(unsafe { ni_session_add_request(s, &r, &mut id) });
    run_to_completion(s).remove(&id).unwrap().tokens
}

#[test]
fn speculative_sessions_give_the_plain_tokens() {
    let plain = {
        let s = session_with(|_| {}).unwrap();
        let t = generate(s, false);
        assert_eq!(stats(s).spec_verifications, 0);
        // SAFETY: created above, freed once.
        unsafe { ni_session_free(s) };
        t
    };
    let ngram = |p: &mut ni_session_params| {
        p.speculative_method = NI_SPECULATIVE_NGRAM;
        p.num_speculative_tokens = 5;
    };
    let draft = |p: &mut ni_session_params| {
        p.speculative_method = NI_SPECULATIVE_DRAFT;
        // The model drafting for itself: every draft is kept.
        p.draft_model = shared_model();
    };
    for (what, edit) in [("ngram", &ngram as &Edit), ("draft", &draft)] {
        let s = session_with(edit).unwrap();
        assert_eq!(generate(s, false), plain, "{what}");
        let st = stats(s);
        assert!(
            st.spec_verifications > 0
                && st.spec_accepted_tokens > 0
                && st.spec_draft_tokens >= st.spec_accepted_tokens,
            "{what}: {} drafted, {} kept, {} verifications",
            st.spec_draft_tokens,
            st.spec_accepted_tokens,
            st.spec_verifications
        );
        // An opted-out request drafts nothing.
        assert_eq!(generate(s, true), plain, "{what}");
        assert_eq!(stats(s).spec_verifications, st.spec_verifications, "{what}");
        // SAFETY: created above, freed once.
        unsafe { ni_session_free(s) };
    }
}

/// A change to the session params.
type Edit = dyn Fn(&mut ni_session_params);

#[test]
fn bad_speculative_settings_are_refused_by_name() {
    let cases: [(&Edit, &str); 4] = [
        (&|p| p.speculative_method = 9, "speculative_method"),
        (
            &|p| p.speculative_method = NI_SPECULATIVE_DRAFT,
            "draft_model",
        ),
        (
            &|p| {
                p.speculative_method = NI_SPECULATIVE_NGRAM;
                p.num_speculative_tokens = 17;
            },
            "num_speculative_tokens",
        ),
        (
            &|p| {
                p.speculative_method = NI_SPECULATIVE_NGRAM;
                p.ngram_min = 5;
                p.ngram_max = 3;
            },
            "min_n",
        ),
    ];
    for (edit, needle) in cases {
        let status = session_with(edit).expect_err("refused");
        assert_err(status, NI_ERR_INVALID_ARGUMENT, &[needle]);
    }
}

#[test]
fn older_struct_sizes_do_not_read_the_speculative_fields() {
    // A session params struct of the older size: speculation stays off.
    let s = session_with(|p| {
        p.struct_size = std::mem::offset_of!(ni_session_params, speculative_method) as u32;
        p.speculative_method = NI_SPECULATIVE_NGRAM;
    })
    .unwrap();
    generate(s, false);
    assert_eq!(stats(s).spec_verifications, 0);
    // SAFETY: created above, freed once.
    unsafe { ni_session_free(s) };
    // A request params struct of the older size cannot opt out.
    let s = session_with(|p| p.speculative_method = NI_SPECULATIVE_NGRAM).unwrap();
    let p = prompt();
    let mut r = request_params();
    r.struct_size = std::mem::offset_of!(ni_request_params, disable_speculation) as u32;
    r.prompt_tokens = p.as_ptr();
    r.n_prompt_tokens = p.len();
    r.max_tokens = 24;
    r.ignore_eos = true;
    r.disable_speculation = true; // past the old struct's end: must not be read
    let mut id = 0;
    // SAFETY: the pointers in `r` outlive the call.
    ok(unsafe { ni_session_add_request(s, &r, &mut id) });
    run_to_completion(s);
    assert!(stats(s).spec_verifications > 0);
    // Stats of an older size are still filled.
    let mut old = ni_session_stats {
        struct_size: std::mem::offset_of!(ni_session_stats, spec_draft_tokens) as u32,
        ..stats(s)
    };
    old.spec_draft_tokens = 7;
    // SAFETY: valid handle; `old` has room for the size it names.
    ok(unsafe { ni_session_get_stats(s, &mut old) });
    assert_eq!(
        old.spec_draft_tokens, 7,
        "a field past the older size was written"
    );
    // SAFETY: created above, freed once.
    unsafe { ni_session_free(s) };
}
