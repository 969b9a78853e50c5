//! Structured output through the C ABI: the `constraint` fields of
//! `ni_request_params`, their errors, and callers of the older struct size.

mod ffi_common;

use ffi_common::*;
use nanoinfer::ffi::*;
use std::ffi::{c_char, CString};
use std::ptr;

/// Runs one request built by `fill` on the chat prompt `question`.
fn run(question: &str, fill: impl FnOnce(&mut ni_request_params)) -> Result<Collected, String> {
    let model = shared_model();
    let session = create_session(model);
    let role = CString::new("user").unwrap();
    let content = CString::new(question).unwrap();
    let messages = [ni_chat_message {
        role: role.as_ptr(),
        content: content.as_ptr(),
    }];
    let mut r = request_params();
    r.messages = messages.as_ptr();
    r.n_messages = 1;
    r.max_tokens = 120;
    fill(&mut r);
    let mut id = 0;
    // SAFETY: the pointers in `r` outlive the call.
    let status = unsafe { ni_session_add_request(session, &r, &mut id) };
    let result = if status == NI_OK {
        Ok(run_to_completion(session).remove(&id).unwrap())
    } else {
        Err(last_error())
    };
    // SAFETY: created above, freed once.
    unsafe { ni_session_free(session) };
    result
}

#[test]
fn json_schema_regex_grammar_and_choice_constrain_the_output() {
    let schema = CString::new(
        r#"{"type":"object","properties":{"name":{"type":"string","maxLength":30},"age":{"type":"integer","minimum":0,"maximum":120}},"required":["name","age"],"additionalProperties":false}"#,
    )
    .unwrap();
    let out = run("Give a person's name and age as JSON.", |r| {
        r.constraint_kind = NI_CONSTRAINT_JSON_SCHEMA;
        r.constraint = schema.as_ptr();
    })
    .unwrap();
    assert_eq!(out.finish, NI_FINISH_EOS, "{}", out.text);
    let v: serde_json::Value = serde_json::from_str(&out.text).unwrap();
    assert!(
        v["name"].is_string() && (0..=120).contains(&v["age"].as_i64().unwrap()),
        "{v}"
    );

    let regex = CString::new(r"[0-9]{4}-[0-9]{2}-[0-9]{2}").unwrap();
    let out = run("When did it happen?", |r| {
        r.constraint_kind = NI_CONSTRAINT_REGEX;
        r.constraint = regex.as_ptr();
    })
    .unwrap();
    assert!(
        regex::Regex::new(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")
            .unwrap()
            .is_match(&out.text),
        "{}",
        out.text
    );

    let grammar =
        CString::new("start: \"color: \" COLOR\nCOLOR: \"red\" | \"green\" | \"blue\"\n").unwrap();
    let out = run("Name a color.", |r| {
        r.constraint_kind = NI_CONSTRAINT_GRAMMAR;
        r.constraint = grammar.as_ptr();
        r.temperature = 1.0;
        r.use_seed = true;
        r.seed = 3;
    })
    .unwrap();
    assert!(
        ["color: red", "color: green", "color: blue"].contains(&out.text.as_str()),
        "{}",
        out.text
    );

    let choices = [
        CString::new("alpha").unwrap(),
        CString::new("beta").unwrap(),
    ];
    let ptrs: Vec<*const c_char> = choices.iter().map(|c| c.as_ptr()).collect();
    let out = run("Pick one.", |r| {
        r.constraint_kind = NI_CONSTRAINT_CHOICE;
        r.choices = ptrs.as_ptr();
        r.n_choices = ptrs.len();
    })
    .unwrap();
    assert!(out.text == "alpha" || out.text == "beta", "{}", out.text);

    // Cut off inside the object: the C ABI says the structure is unfinished.
    let out = run("Give a person's name and age as JSON.", |r| {
        r.constraint_kind = NI_CONSTRAINT_JSON_SCHEMA;
        r.constraint = schema.as_ptr();
        r.max_tokens = 3;
    })
    .unwrap();
    assert_eq!(out.finish, NI_FINISH_LENGTH_UNFINISHED);
    // A full match cut exactly at max_tokens is plain length.
    let out = run("Pick a digit.", |r| {
        r.constraint_kind = NI_CONSTRAINT_REGEX;
        r.constraint = c"[0-9]".as_ptr();
        r.max_tokens = 1;
    })
    .unwrap();
    assert_eq!(out.finish, NI_FINISH_LENGTH, "{}", out.text);
}

#[test]
fn bad_constraints_are_clear_errors() {
    let bad_json = CString::new("{nope").unwrap();
    let err = run("x", |r| {
        r.constraint_kind = NI_CONSTRAINT_JSON_SCHEMA;
        r.constraint = bad_json.as_ptr();
    })
    .unwrap_err();
    assert!(err.contains("json_schema is not valid JSON"), "{err}");
    let err = run("x", |r| r.constraint_kind = NI_CONSTRAINT_REGEX).unwrap_err();
    assert!(err.contains("request.constraint is NULL"), "{err}");
    let err = run("x", |r| r.constraint_kind = 99).unwrap_err();
    assert!(err.contains("constraint_kind 99"), "{err}");
    let err = run("x", |r| {
        r.constraint_kind = NI_CONSTRAINT_CHOICE;
        r.n_choices = 1 << 40;
    })
    .unwrap_err();
    assert!(err.contains("request.n_choices"), "{err}");
}

#[test]
fn older_struct_sizes_read_no_constraint() {
    let v2 = std::mem::offset_of!(ni_request_params, constraint);
    assert!(v2 < size_of::<ni_request_params>());
    let out = run("Say hi.", |r| {
        r.struct_size = v2 as u32;
        r.max_tokens = 4;
        // Past the old struct's end: must not be read.
        r.constraint_kind = 77;
        r.constraint = ptr::without_provenance(0x10);
    })
    .unwrap();
    assert_eq!(out.tokens.len(), 4);
    let d = request_params();
    assert_eq!(d.constraint_kind, NI_CONSTRAINT_NONE);
    assert!(d.constraint.is_null() && d.choices.is_null() && d.n_choices == 0);
}
