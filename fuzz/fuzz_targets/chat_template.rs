//! A chat template (the bytes before the first NUL) rendered with messages
//! (the NUL-separated rest, alternating user / assistant; a fixed
//! conversation when there are none). Compiling and rendering either fail
//! with an error or return text; nothing panics or hangs.
#![no_main]

mod common;

use libfuzzer_sys::fuzz_target;
use nanoinfer::tokenizer::{ChatMessage, ChatTemplate, SpecialTokens};

fuzz_target!(|data: &[u8]| {
    // minijinja 2.24 panics on some slices; ChatTemplate::render catches it.
    common::allow_caught_panics();
    let mut parts = data.split(|&b| b == 0);
    let source = String::from_utf8_lossy(parts.next().unwrap_or_default());
    let mut messages: Vec<ChatMessage> = parts
        .enumerate()
        .map(|(i, c)| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            ChatMessage::new(role, String::from_utf8_lossy(c))
        })
        .collect();
    if messages.is_empty() {
        messages = vec![
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "Hello!"),
            ChatMessage::new("user", "What is 2+2?"),
        ];
    }
    let special = SpecialTokens {
        bos: Some("<s>".into()),
        eos: Some("</s>".into()),
        ..Default::default()
    };
    let Ok(t) = ChatTemplate::new(&source, "fuzz", special) else {
        return;
    };
    for gen in [true, false] {
        let _ = t.render(&messages, gen);
        let _ = t.render(&[], gen);
    }
});
