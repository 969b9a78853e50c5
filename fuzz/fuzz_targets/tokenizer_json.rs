//! A model directory's tokenizer files: `tokenizer.json`, then optionally
//! (after a NUL byte) `tokenizer_config.json`. Loading either fails with an
//! error or gives a tokenizer that encodes, decodes, streams and renders its
//! chat template without panicking, and whose ids are inside its vocabulary.
#![no_main]

mod common;

use libfuzzer_sys::fuzz_target;
use nanoinfer::tokenizer::{ChatMessage, StreamDetokenizer, Tokenizer};

const TEXTS: [&str; 3] = [
    "Hello, wörld! 12 你好",
    " <|im_start|>user\nhi<|im_end|>",
    "",
];

fuzz_target!(|data: &[u8]| {
    // The tokenizers crate panics on some malformed files; Tokenizer catches it.
    common::allow_caught_panics();
    let parts = common::split_nul(data);
    let dir = common::scratch_dir().join("tok");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), parts[0]).unwrap();
    let config = dir.join("tokenizer_config.json");
    match parts.get(1) {
        Some(c) => std::fs::write(&config, c).unwrap(),
        None => {
            let _ = std::fs::remove_file(&config);
        }
    }
    let Ok(tok) = Tokenizer::from_dir(&dir) else {
        return;
    };
    let vocab = tok.vocab_size();
    for text in TEXTS {
        for special in [false, true] {
            let Ok(ids) = tok.encode(text, special) else {
                continue;
            };
            for &id in &ids {
                assert!((id as usize) < vocab, "id {id} outside vocab {vocab}");
                assert!(tok.check_id(id).is_ok());
            }
            let _ = tok.decode(&ids, true);
            let mut stream = StreamDetokenizer::new(true);
            for &id in &ids {
                let _ = stream.push(&tok, id);
            }
            stream.flush();
        }
    }
    assert!(tok.check_id(vocab as u32).is_err());
    if tok.has_chat_template() {
        let _ = tok.apply_chat_template(&[ChatMessage::new("user", "hi")], true);
    }
});
