//! Arbitrary text through the test tokenizers: encoding gives ids inside
//! the vocabulary, and streaming those ids through the detokenizer one at a
//! time gives exactly the text of decoding them at once, unless that text
//! holds U+FFFD: a literal U+FFFD cannot be told from an incomplete
//! character by its text, so a run of them longer than the detokenizer's
//! hold window may come out differently (see TESTING.md).
#![no_main]

mod common;

use libfuzzer_sys::fuzz_target;
use nanoinfer::tokenizer::StreamDetokenizer;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    for tok in common::tokenizers() {
        for special in [false, true] {
            let ids = tok
                .encode(&text, special)
                .expect("valid UTF-8 always encodes");
            for &id in &ids {
                assert!((id as usize) < tok.vocab_size());
            }
            for skip in [true, false] {
                let whole = tok.decode(&ids, skip).expect("own ids decode");
                let mut stream = StreamDetokenizer::new(skip);
                let mut streamed = String::new();
                for &id in &ids {
                    streamed.push_str(&stream.push(tok, id).expect("own ids stream"));
                    assert!(
                        stream.window_len() <= 16,
                        "window grew to {}",
                        stream.window_len()
                    );
                }
                streamed.push_str(&stream.flush());
                if !whole.contains('\u{FFFD}') {
                    assert_eq!(streamed, whole, "text {text:?} ids {ids:?} skip {skip}");
                }
            }
        }
    }
});
