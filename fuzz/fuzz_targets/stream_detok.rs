//! Arbitrary id sequences (little-endian u16, reduced modulo 1.25 x the
//! vocabulary so that some are out of range) through the streaming
//! detokenizer: out-of-range ids are refused without changing the state,
//! the window stays bounded, and without U+FFFD the streamed text equals
//! the one-shot decode of the accepted ids.
#![no_main]

mod common;

use libfuzzer_sys::fuzz_target;
use nanoinfer::tokenizer::StreamDetokenizer;

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let toks = common::tokenizers();
    let tok = &toks[sel as usize % toks.len()];
    let skip = sel & 0x80 != 0;
    let bound = tok.vocab_size() + tok.vocab_size() / 4;
    let mut stream = StreamDetokenizer::new(skip);
    let mut accepted = vec![];
    let mut streamed = String::new();
    for pair in rest.chunks_exact(2) {
        let id = (u16::from_le_bytes([pair[0], pair[1]]) as usize % bound) as u32;
        match stream.push(tok, id) {
            Ok(delta) => {
                accepted.push(id);
                streamed.push_str(&delta);
            }
            Err(_) => assert!(tok.check_id(id).is_err(), "valid id {id} refused"),
        }
        assert!(
            stream.window_len() <= 16,
            "window grew to {}",
            stream.window_len()
        );
    }
    streamed.push_str(&stream.flush());
    let whole = tok.decode(&accepted, skip).expect("accepted ids decode");
    if !whole.contains('\u{FFFD}') && !streamed.contains('\u{FFFD}') {
        assert_eq!(streamed, whole, "ids {accepted:?}");
    }
});
