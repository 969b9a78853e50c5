//! Tokenizer tests on the real SmolLM2-135M-Instruct tokenizer, against goldens
//! from the Python `tokenizers` library and Jinja2 (scripts/make_tokenizer_goldens.py).
//! The model directory must exist: run `python3 scripts/fetch_model.py`.

mod tokenizer_util;

use nanoinfer::tokenizer::{ChatMessage, StreamDetokenizer, Tokenizer};
use tokenizer_util::*;

fn smollm2() -> Tokenizer {
    let dir = model_dir();
    Tokenizer::from_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot load the tokenizer in {}: {e}", dir.display()))
}

#[test]
fn smollm2_matches_goldens() {
    let tok = smollm2();
    let golden = load_json(&manifest_dir().join("tests/data/goldens/tokenizer_smollm2.json"));
    assert!(golden["encode"].as_array().unwrap().len() >= 30);
    assert!(golden["chat"].as_array().unwrap().len() >= 8);
    assert_no_mismatches("SmolLM2", &golden_mismatches(&tok, &golden));
}

#[test]
fn smollm2_special_tokens() {
    let tok = smollm2();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.token_id("<|im_start|>"), tok.bos_token_id());
    assert_eq!(tok.token_id("<|im_end|>"), tok.eos_token_id());
    assert!(tok.eos_token_id().is_some());
    assert!(tok.has_chat_template());
    let eos = tok.eos_token_id().unwrap();
    assert!(tok.is_special_id(eos));
    assert!(tok.decode(&[tok.vocab_size() as u32], false).is_err());
}

#[test]
fn smollm2_chat_prompt_round_trips() {
    let tok = smollm2();
    let msgs = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi 👋"),
    ];
    let prompt = tok.apply_chat_template(&msgs, true).unwrap();
    assert!(prompt.ends_with("<|im_start|>assistant\n"), "{prompt:?}");
    let ids = tok.encode(&prompt, false).unwrap();
    assert_eq!(
        ids[0],
        tok.bos_token_id().unwrap(),
        "<|im_start|> must be one special token"
    );
    assert_eq!(tok.decode(&ids, false).unwrap(), prompt);
    assert_eq!(
        tok.decode(&ids, true).unwrap(),
        "system\nBe brief.\nuser\nHi 👋\nassistant\n"
    );
}

#[test]
fn smollm2_stream_emits_whole_characters() {
    let tok = smollm2();
    let text = "Emoji 🧪🎉, CJK 漢字テキスト, accents naïve — done.";
    let ids = tok.encode(text, false).unwrap();
    let mut det = StreamDetokenizer::default();
    let mut out = String::new();
    let mut held = 0;
    for &id in &ids {
        let delta = det.push(&tok, id).unwrap();
        assert!(
            !delta.contains('\u{FFFD}'),
            "partial character emitted: {delta:?}"
        );
        held += delta.is_empty() as usize;
        out += &delta;
    }
    out += &det.flush();
    assert_eq!(out, text);
    assert!(held > 0, "some tokens should hold partial characters");
}
