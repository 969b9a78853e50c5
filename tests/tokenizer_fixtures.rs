//! Tokenizer tests on the small committed fixtures (no model download needed):
//! goldens from the Python `tokenizers` library, error paths, config edge cases
//! and the streaming detokenizer.

mod tokenizer_util;

use nanoinfer::tokenizer::{ChatMessage, StreamDetokenizer, Tokenizer};
use nanoinfer::ErrorKind;
use std::fs;
use tokenizer_util::*;

fn bytelevel() -> Tokenizer {
    Tokenizer::from_dir(&fixture_dir("bytelevel")).unwrap()
}

fn spm() -> Tokenizer {
    Tokenizer::from_dir(&fixture_dir("spm")).unwrap()
}

fn chat(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
    pairs
        .iter()
        .map(|(r, c)| ChatMessage::new(*r, *c))
        .collect()
}

// ---- goldens -------------------------------------------------------------

#[test]
fn bytelevel_fixture_matches_python_tokenizers() {
    let golden = load_json(&fixture_dir("goldens_bytelevel.json"));
    assert_no_mismatches("bytelevel", &golden_mismatches(&bytelevel(), &golden));
}

#[test]
fn spm_fixture_matches_python_tokenizers() {
    let golden = load_json(&fixture_dir("goldens_spm.json"));
    assert_no_mismatches("spm", &golden_mismatches(&spm(), &golden));
}

// ---- loading and errors --------------------------------------------------

#[test]
fn missing_directory_names_tokenizer_json() {
    let dir = scratch_dir("missing").join("nope");
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert_eq!(err.kind, ErrorKind::Io);
    assert!(err.message.contains("tokenizer.json"), "{}", err.message);
}

#[test]
fn malformed_tokenizer_json_is_invalid_model() {
    let dir = scratch_dir("bad_tokenizer_json");
    fs::write(dir.join("tokenizer.json"), "{\"model\": 12}").unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidModel);
    assert!(err.message.contains("tokenizer.json"), "{}", err.message);
}

#[test]
fn malformed_config_names_the_file() {
    let dir = fixture_copy("bytelevel", "bad_config_json");
    fs::write(dir.join("tokenizer_config.json"), "{ not json").unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidModel);
    assert!(
        err.message.contains("tokenizer_config.json"),
        "{}",
        err.message
    );

    fs::write(dir.join("tokenizer_config.json"), r#"{"chat_template": 7}"#).unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(err.message.contains("chat_template"), "{}", err.message);

    fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": {"lstrip": false}}"#,
    )
    .unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(
        err.message.contains("eos_token") && err.message.contains("content"),
        "{}",
        err.message
    );

    fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"bos_token": "<not-a-token>"}"#,
    )
    .unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(
        err.message.contains("bos_token") && err.message.contains("<not-a-token>"),
        "{}",
        err.message
    );

    fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"add_bos_token": "yes"}"#,
    )
    .unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(err.message.contains("add_bos_token"), "{}", err.message);

    fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"chat_template": [{"name": "default"}]}"#,
    )
    .unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(err.message.contains("chat_template"), "{}", err.message);
}

#[test]
fn template_syntax_error_fails_at_load() {
    let dir = fixture_copy("bytelevel", "bad_template");
    fs::write(
        dir.join("chat_template.jinja"),
        "{% for m in messages %}{{ m.content }}",
    )
    .unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidModel);
    assert!(
        err.message.contains("chat_template.jinja") && err.message.contains("does not compile"),
        "{}",
        err.message
    );
}

#[test]
fn config_is_optional() {
    let dir = scratch_dir("no_config");
    fs::copy(
        fixture_dir("bytelevel/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    assert!(!tok.has_chat_template());
    assert_eq!(tok.bos_token_id(), None);
    assert_eq!(tok.eos_token_id(), None);
    let err = tok
        .apply_chat_template(&chat(&[("user", "hi")]), true)
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidArgument);
    assert!(err.message.contains("no chat template"), "{}", err.message);
    // Special tokens come from tokenizer.json's added tokens, not from the config.
    assert_eq!(tok.encode("<|im_end|>", false).unwrap(), vec![2]);
}

#[test]
fn chat_template_jinja_takes_precedence() {
    let dir = fixture_copy("bytelevel", "template_jinja");
    fs::write(
        dir.join("chat_template.json"),
        r#"{"chat_template": "json:{{ messages|length }}"}"#,
    )
    .unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(
        tok.apply_chat_template(&chat(&[("user", "a")]), false)
            .unwrap(),
        "json:1"
    );

    fs::write(
        dir.join("chat_template.jinja"),
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}\n",
    )
    .unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let out = tok
        .apply_chat_template(&chat(&[("user", "a"), ("assistant", "b")]), true)
        .unwrap();
    assert_eq!(out, "<user>a<assistant>b");
    assert!(tok
        .chat_template()
        .unwrap()
        .origin()
        .ends_with("chat_template.jinja"));
}

#[test]
fn named_templates_use_default_or_fail_clearly() {
    let tok = spm();
    assert!(tok.has_chat_template());
    let out = tok
        .apply_chat_template(&chat(&[("user", "Hi")]), true)
        .unwrap();
    assert_eq!(out, "<s>[INST] Hi [/INST]");

    let dir = fixture_copy("spm", "no_default_template");
    fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"bos_token": "<s>", "chat_template": [{"name": "rag", "template": "x"}, {"name": "tool_use", "template": "y"}]}"#,
    )
    .unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    assert!(!tok.has_chat_template());
    let err = tok
        .apply_chat_template(&chat(&[("user", "Hi")]), true)
        .unwrap_err();
    assert!(
        err.message.contains("rag") && err.message.contains("default"),
        "{}",
        err.message
    );
}

#[test]
fn template_exceptions_are_invalid_argument() {
    let tok = spm();
    let err = tok
        .apply_chat_template(&chat(&[("user", "a"), ("user", "b")]), true)
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidArgument);
    assert!(
        err.message.contains("Conversation roles must alternate"),
        "{}",
        err.message
    );
    assert!(
        err.message.contains("tokenizer_config.json"),
        "{}",
        err.message
    );
}

#[test]
fn special_tokens_and_ids() {
    let tok = bytelevel();
    assert_eq!(tok.bos_token_id(), Some(1));
    assert_eq!(tok.eos_token_id(), Some(2));
    assert_eq!(tok.token_id("<|im_end|>"), Some(2));
    assert_eq!(tok.token_id("<tool_call>"), Some(320));
    assert_eq!(tok.token_id("definitely not a token"), None);
    assert_eq!(tok.id_to_token(2).as_deref(), Some("<|im_end|>"));
    assert!(tok.is_special_id(2) && !tok.is_special_id(320));
    assert_eq!(tok.vocab_size(), 321);
    let special = tok.special_tokens();
    assert_eq!(special.bos.as_deref(), Some("<|im_start|>"));
    assert_eq!(special.unk.as_deref(), Some("<|endoftext|>"));
    assert_eq!(special.additional, vec!["<|im_start|>", "<|im_end|>"]);

    // A non-special added token survives skip_special_tokens; special ones do not.
    let ids = tok
        .encode("<|im_start|><tool_call>x<|im_end|>", false)
        .unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), "<tool_call>x");
    assert_eq!(
        tok.decode(&ids, false).unwrap(),
        "<|im_start|><tool_call>x<|im_end|>"
    );
}

#[test]
fn decode_rejects_ids_outside_the_vocab() {
    let tok = bytelevel();
    let n = tok.vocab_size() as u32;
    assert!(tok.decode(&[n - 1], false).is_ok());
    for bad in [n, n + 1, u32::MAX] {
        let err = tok.decode(&[5, bad], false).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidArgument);
        assert!(
            err.message.contains(&bad.to_string()) && err.message.contains(&n.to_string()),
            "{}",
            err.message
        );
    }
    assert_eq!(tok.decode(&[], true).unwrap(), "");
}

#[test]
fn add_bos_token_applies_when_post_processor_adds_nothing() {
    // The byte-level post-processor adds no tokens: the config's flags decide.
    let dir = fixture_copy("bytelevel", "add_bos");
    fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": true, "add_eos_token": true}"#,
    )
    .unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let plain = tok.encode("hello", false).unwrap();
    let with = tok.encode("hello", true).unwrap();
    assert_eq!(with.first(), Some(&1));
    assert_eq!(with.last(), Some(&2));
    assert_eq!(&with[1..with.len() - 1], plain.as_slice());

    // The Llama-style post-processor already adds <s>: never twice.
    let tok = spm();
    let with = tok.encode("hello", true).unwrap();
    assert_eq!(with.iter().filter(|&&id| id == 1).count(), 1);
    assert_eq!(with[0], 1);
    assert_eq!(&with[1..], tok.encode("hello", false).unwrap().as_slice());
}

#[test]
fn tokenizer_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    let tok = std::sync::Arc::new(bytelevel());
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let tok = tok.clone();
            std::thread::spawn(move || {
                let text = format!("thread {i} says hello");
                let ids = tok.encode(&text, false).unwrap();
                assert_eq!(tok.decode(&ids, false).unwrap(), text);
                tok.apply_chat_template(&[ChatMessage::new("user", text)], true)
                    .unwrap()
            })
        })
        .collect();
    for h in handles {
        assert!(h.join().unwrap().ends_with("<|im_start|>assistant\n"));
    }
}

// ---- streaming detokenizer -----------------------------------------------

#[test]
fn stream_holds_partial_characters() {
    let tok = spm();
    // "😀" is four byte-fallback tokens after "▁".
    let ids = tok.encode("a 😀 b", false).unwrap();
    let mut det = StreamDetokenizer::default();
    let deltas: Vec<String> = ids.iter().map(|&id| det.push(&tok, id).unwrap()).collect();
    assert_eq!(deltas.concat() + &det.flush(), "a 😀 b");
    assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')), "{deltas:?}");
    assert!(
        deltas.contains(&"😀".to_string()),
        "emoji should come out whole: {deltas:?}"
    );
    let empty = deltas.iter().filter(|d| d.is_empty()).count();
    assert!(
        empty >= 3,
        "the first three emoji bytes must be held back: {deltas:?}"
    );
}

#[test]
fn stream_keeps_leading_spaces_that_suffix_decoding_drops() {
    // SentencePiece-style decoding strips the first space of a sequence: decoding
    // each token alone would lose every space between words.
    let tok = spm();
    let ids = tok.encode("the cat sat on the mat", false).unwrap();
    let alone: String = ids
        .iter()
        .map(|&id| tok.decode(&[id], true).unwrap())
        .collect();
    assert_ne!(
        alone, "the cat sat on the mat",
        "fixture should exercise the Strip decoder"
    );
    let (deltas, rest) = stream(&tok, &ids, true);
    assert_eq!(deltas.concat() + &rest, "the cat sat on the mat");
}

#[test]
fn stream_special_tokens_skipped_or_kept() {
    let tok = bytelevel();
    let ids = tok
        .encode("<|im_start|>assistant\nHi!<|im_end|>", false)
        .unwrap();
    let (deltas, rest) = stream(&tok, &ids, true);
    assert_eq!(deltas.concat() + &rest, "assistant\nHi!");
    assert_eq!(deltas[0], "", "a skipped special token yields no text");
    let (deltas, rest) = stream(&tok, &ids, false);
    assert_eq!(
        deltas.concat() + &rest,
        "<|im_start|>assistant\nHi!<|im_end|>"
    );
}

#[test]
fn stream_rejects_bad_ids_without_losing_state() {
    let tok = spm();
    let ids = tok.encode("hello 😀", false).unwrap();
    let mut det = StreamDetokenizer::default();
    let mut out = String::new();
    for (i, &id) in ids.iter().enumerate() {
        if i == ids.len() - 2 {
            let err = det.push(&tok, tok.vocab_size() as u32 + 7).unwrap_err();
            assert_eq!(err.kind, ErrorKind::InvalidArgument);
        }
        out += &det.push(&tok, id).unwrap();
    }
    out += &det.flush();
    assert_eq!(out, "hello 😀");
}

#[test]
fn stream_invalid_bytes_come_out_as_replacement_chars() {
    let tok = spm();
    let cont = tok.token_id("<0x80>").unwrap(); // a lone continuation byte
    let lead = tok.token_id("<0xE2>").unwrap(); // a 3-byte lead byte
    let a = tok.encode("a", false).unwrap();
    let mut ids = a.clone();
    ids.extend(std::iter::repeat_n(cont, 40));
    ids.extend(&a);
    ids.push(lead);
    let mut det = StreamDetokenizer::default();
    let mut out = String::new();
    for &id in &ids {
        out += &det.push(&tok, id).unwrap();
        assert!(
            det.window_len() <= 16,
            "window grew to {}",
            det.window_len()
        );
    }
    let rest = det.flush();
    assert_eq!(
        rest, "\u{FFFD}",
        "the incomplete lead byte is flushed as U+FFFD"
    );
    out += &rest;
    assert_eq!(out, tok.decode(&ids, false).unwrap());
    assert!(out.starts_with('a') && out.contains('\u{FFFD}'));
    assert_eq!(det.flush(), "", "flush resets");
}

#[test]
fn stream_window_stays_small_on_long_sequences() {
    let tok = bytelevel();
    let golden = load_json(&fixture_dir("goldens_bytelevel.json"));
    let text: String = golden["encode"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    let text = text.repeat(20);
    let ids = tok.encode(&text, false).unwrap();
    assert!(ids.len() > 20_000, "{}", ids.len());
    let (deltas, rest) = stream(&tok, &ids, false); // asserts window <= 16 at every step
    assert_eq!(deltas.concat() + &rest, tok.decode(&ids, false).unwrap());
}

#[test]
fn a_tokenizer_json_that_panics_the_tokenizers_crate_is_an_error() {
    // Found by fuzz/tokenizer_json: tokenizers 0.22 `expect`s while
    // deserializing a malformed "decoder" (e.g. a non-object); loading must
    // fail with an error, not unwind into the caller.
    let dir = std::env::temp_dir().join(format!("nanoinfer-tok-panic-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(
        &fs::read_to_string(fixture_dir("spm").join("tokenizer.json")).unwrap(),
    )
    .unwrap();
    for decoder in [
        serde_json::json!(7),
        serde_json::json!([1, 2]),
        serde_json::json!("x"),
    ] {
        json["decoder"] = decoder;
        fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
        let err = Tokenizer::from_dir(&dir).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidModel, "{err}");
        assert!(err.message.contains("tokenizer.json"), "{err}");
    }
    // The fuzzer's input: a syntax error inside a nested decoder.
    let text = fs::read_to_string(fixture_dir("spm").join("tokenizer.json")).unwrap();
    let broken = text.replacen(
        r#"{"type":"ByteFallback"}"#,
        r#"{Q"type":"ByteFallback"}"#,
        1,
    );
    assert_ne!(broken, text);
    fs::write(dir.join("tokenizer.json"), broken).unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidModel, "{err}");
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_post_processor_naming_ids_without_tokens_is_refused_at_load() {
    // Found by fuzz/tokenizer_json: a template post-processor whose BOS id
    // has no token encoded every prompt with it. Refused at load, naming
    // the file and the id (the committed fuzz seed covers an id inside the
    // vocabulary's range that has no token).
    let dir = std::env::temp_dir().join(format!("nanoinfer-tok-missing-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(
        &fs::read_to_string(fixture_dir("spm").join("tokenizer.json")).unwrap(),
    )
    .unwrap();
    json["post_processor"]["special_tokens"]["<s>"]["ids"] = serde_json::json!([100_000]);
    fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidModel, "{err}");
    for needle in ["tokenizer.json", "100000", "no token"] {
        assert!(err.message.contains(needle), "{err}");
    }
    fs::remove_dir_all(&dir).unwrap();
}
