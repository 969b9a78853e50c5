//! Shared helpers for the tokenizer integration tests.
#![allow(dead_code)]

use nanoinfer::tokenizer::{ChatMessage, StreamDetokenizer, Tokenizer};
use serde_json::Value as Json;
use std::path::{Path, PathBuf};

pub fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A committed fixture directory under tests/data/tokenizer/.
pub fn fixture_dir(name: &str) -> PathBuf {
    manifest_dir().join("tests/data/tokenizer").join(name)
}

pub fn load_json(path: &Path) -> Json {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{} is not valid JSON: {e}", path.display()))
}

/// A fresh, empty directory for one test.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("tokenizer_tests")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A scratch copy of a fixture directory, to modify.
pub fn fixture_copy(fixture: &str, name: &str) -> PathBuf {
    let dir = scratch_dir(name);
    for entry in std::fs::read_dir(fixture_dir(fixture)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    dir
}

/// The real SmolLM2 model directory; panics (does not skip) when it is missing.
pub fn model_dir() -> PathBuf {
    let dir = std::env::var_os("NANOINFER_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest_dir().join("models/SmolLM2-135M-Instruct"));
    assert!(
        dir.join("tokenizer.json").is_file(),
        "{}/tokenizer.json not found: run `python3 scripts/fetch_model.py` first \
         (or set NANOINFER_MODEL_DIR to a SmolLM2-135M-Instruct directory)",
        dir.display()
    );
    dir
}

pub fn ids(value: &Json) -> Vec<u32> {
    value
        .as_array()
        .expect("id list")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect()
}

pub fn messages(value: &Json) -> Vec<ChatMessage> {
    value
        .as_array()
        .expect("message list")
        .iter()
        .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect()
}

/// Streams `ids` one at a time; returns the deltas and what `flush` gave.
pub fn stream(tok: &Tokenizer, ids: &[u32], skip_special_tokens: bool) -> (Vec<String>, String) {
    let mut det = StreamDetokenizer::new(skip_special_tokens);
    let mut deltas = Vec::with_capacity(ids.len());
    for &id in ids {
        deltas.push(det.push(tok, id).unwrap());
        assert!(
            det.window_len() <= 16,
            "detokenizer window grew to {}",
            det.window_len()
        );
    }
    let rest = det.flush();
    (deltas, rest)
}

/// Compares a tokenizer against a golden file written by
/// scripts/make_tokenizer_goldens.py; returns every mismatch.
pub fn golden_mismatches(tok: &Tokenizer, golden: &Json) -> Vec<String> {
    let mut bad = Vec::new();
    let mut check = |ok: bool, what: String| {
        if !ok {
            bad.push(what)
        }
    };
    let vocab_size = golden["vocab_size"].as_u64().unwrap() as usize;
    check(
        tok.vocab_size() == vocab_size,
        format!("vocab_size {} != {vocab_size}", tok.vocab_size()),
    );
    let want_id = |key: &str| golden[key].as_u64().map(|v| v as u32);
    check(
        tok.bos_token_id() == want_id("bos_token_id"),
        format!("bos id {:?}", tok.bos_token_id()),
    );
    check(
        tok.eos_token_id() == want_id("eos_token_id"),
        format!("eos id {:?}", tok.eos_token_id()),
    );
    for id in ids(&golden["special_ids"]) {
        check(tok.is_special_id(id), format!("id {id} should be special"));
    }

    for case in golden["encode"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let plain = ids(&case["ids"]);
        let with_special = ids(&case["ids_with_special"]);
        let got = tok.encode(text, false).unwrap();
        check(
            got == plain,
            format!("encode({text:?}, false) = {got:?}, want {plain:?}"),
        );
        let got = tok.encode(text, true).unwrap();
        check(
            got == with_special,
            format!("encode({text:?}, true) = {got:?}, want {with_special:?}"),
        );

        for (list, skip) in [
            (&plain, true),
            (&plain, false),
            (&with_special, true),
            (&with_special, false),
        ] {
            let want = tok.decode(list, skip).unwrap();
            let (deltas, rest) = stream(tok, list, skip);
            let joined = deltas.concat() + &rest;
            check(
                joined == want,
                format!("stream({text:?}, skip={skip}) = {joined:?}, want {want:?}"),
            );
            let broken = deltas.iter().chain([&rest]).any(|d| d.contains('\u{FFFD}'));
            check(
                !broken,
                format!("stream({text:?}) emitted U+FFFD: {deltas:?} + {rest:?}"),
            );
        }
    }

    for case in golden["decode"].as_array().unwrap() {
        let list = ids(&case["ids"]);
        let skip = case["skip_special_tokens"].as_bool().unwrap();
        let want = case["text"].as_str().unwrap();
        let got = tok.decode(&list, skip).unwrap();
        check(
            got == want,
            format!("decode({list:?}, {skip}) = {got:?}, want {want:?}"),
        );
    }

    for case in golden["chat"].as_array().unwrap() {
        let msgs = messages(&case["messages"]);
        let gen = case["add_generation_prompt"].as_bool().unwrap();
        let got = tok.apply_chat_template(&msgs, gen);
        match (&got, case.get("text").and_then(Json::as_str)) {
            (Ok(got), Some(want)) => check(
                got == want,
                format!("chat({msgs:?}, {gen}) = {got:?}, want {want:?}"),
            ),
            (Err(e), Some(want)) => check(
                false,
                format!("chat({msgs:?}, {gen}) failed: {e}; want {want:?}"),
            ),
            (Ok(got), None) => check(
                false,
                format!(
                    "chat({msgs:?}, {gen}) = {got:?}, want an error {}",
                    case["error"]
                ),
            ),
            (Err(_), None) => {}
        }
    }
    bad
}

pub fn assert_no_mismatches(what: &str, bad: &[String]) {
    assert!(
        bad.is_empty(),
        "{what}: {} mismatches:\n{}",
        bad.len(),
        bad.join("\n")
    );
}
