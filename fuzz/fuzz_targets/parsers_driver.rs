//! The bodies of the parser fuzz targets (safetensors, config_json,
//! tokenizer_json, tokenizer_text, stream_detok, chat_template, state_file), shared with
//! the normal test suite: tests/fuzz_seeds_smoke.rs includes this file with
//! `#[path]` and runs each over its committed seeds and mutations of them on
//! stable, so CI checks the same properties without a fuzzer.
#![allow(dead_code)] // each target uses one function

#[path = "common/mod.rs"]
mod common;

use nanoinfer::model::safetensors::WeightFiles;
use nanoinfer::model::ModelConfig;
use nanoinfer::tokenizer::{
    ChatMessage, ChatTemplate, SpecialTokens, StreamDetokenizer, Tokenizer,
};

const TEXTS: [&str; 3] = [
    "Hello, wörld! 12 你好",
    " <|im_start|>user\nhi<|im_end|>",
    "",
];

/// A whole safetensors file: header length, JSON header, data section.
/// Opening must either fail with an error or give tensors whose views lie
/// inside the file and whose typed accessors agree with their shapes.
pub fn safetensors(data: &[u8]) {
    let path = common::scratch_dir().join("model.safetensors");
    std::fs::write(&path, data).unwrap();
    let Ok(files) = WeightFiles::open_file(&path) else {
        return;
    };
    let names: Vec<String> = files.tensor_names().map(str::to_string).collect();
    assert_eq!(names.len(), files.len());
    for name in &names {
        let info = files.info(name).expect("listed tensor has info");
        assert!(info.byte_len <= data.len());
        let Some(view) = files.get(name) else {
            continue; // a dtype the reader lists but does not view
        };
        let numel: usize = view.shape.iter().product();
        assert_eq!(view.numel(), numel, "{name}");
        assert_eq!(view.bytes.len(), numel * view.dtype.size_in_bytes());
        // Typed access reads every byte (zero-copy or copied when misaligned).
        if let Ok(v) = view.to_f32() {
            assert_eq!(v.len(), numel);
            std::hint::black_box(v.iter().fold(0u32, |a, x| a ^ x.to_bits()));
        }
        if let Ok(v) = view.as_i32() {
            assert_eq!(v.len(), numel);
        }
        if let Ok(v) = view.as_i8() {
            assert_eq!(v.len(), numel);
        }
        let _ = files.require(name, view.shape);
    }
    std::hint::black_box(files.metadata().len());
}

/// config.json text. Parsing either fails or yields a config whose derived
/// quantities are usable without panicking (RoPE frequencies, sizes).
pub fn config_json(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(c) = ModelConfig::from_json(text) else {
        return;
    };
    assert!(c.num_heads > 0 && c.num_kv_heads > 0 && c.head_dim > 0);
    assert!(c.num_heads % c.num_kv_heads == 0, "{c:?}");
    assert!(c.vocab_size > 0 && c.hidden_size > 0 && c.num_layers > 0);
    // Bounded so that a huge but valid head_dim does not exhaust memory here.
    if c.head_dim <= 1 << 16 {
        let f = c.rope_inv_freq();
        assert_eq!(f.len(), c.head_dim / 2);
    }
    std::hint::black_box(format!("{c:?}"));
}

/// A model directory's tokenizer files: `tokenizer.json`, then optionally
/// (after a NUL byte) `tokenizer_config.json`. Loading either fails with an
/// error or gives a tokenizer that encodes, decodes, streams and renders its
/// chat template without panicking, and whose ids are inside its vocabulary.
pub fn tokenizer_json(data: &[u8]) {
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
}

/// Arbitrary text through the test tokenizers: encoding gives ids inside
/// the vocabulary, and streaming those ids through the detokenizer one at a
/// time gives exactly the text of decoding them at once, unless that text
/// holds U+FFFD: a literal U+FFFD cannot be told from an incomplete
/// character by its text, so a run of them longer than the detokenizer's
/// hold window may come out differently (see TESTING.md).
pub fn tokenizer_text(data: &[u8]) {
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
}

/// Arbitrary id sequences (little-endian u16, reduced modulo 1.25 x the
/// vocabulary so that some are out of range) through the streaming
/// detokenizer: out-of-range ids are refused without changing the state,
/// the window stays bounded, and without U+FFFD the streamed text equals
/// the one-shot decode of the accepted ids.
pub fn stream_detok(data: &[u8]) {
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
}

/// A chat template (the bytes before the first NUL) rendered with messages
/// (the NUL-separated rest, alternating user / assistant; a fixed
/// conversation when there are none). Compiling and rendering either fail
/// with an error or return text; nothing panics or hangs.
pub fn chat_template(data: &[u8]) {
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
}

/// What the state-file target's files are read against.
pub fn state_identity() -> nanoinfer::engine::StateIdentity {
    nanoinfer::engine::StateIdentity {
        fingerprint: 0x5eed_f00d,
        kv_format: "cpu auto 32".into(),
        values_per_slot: 4,
        vocab: 100,
        max_tokens: 64,
    }
}

/// Valid files of both kinds for `state_identity`: the target's seeds
/// (tests/fuzz_seeds_smoke.rs checks the committed ones are current).
pub fn state_file_seeds() -> Vec<(&'static str, Vec<u8>)> {
    use nanoinfer::engine::state_file::{write_prefixes, SavedRun, SavedSequence};
    let id = state_identity();
    let seq = SavedSequence {
        tokens: vec![1, 17, 42, 99, 3],
        history_start: 3,
        kv_positions: 4,
        kv: (0..16).map(|v| v as f32 / 8.0 - 1.0).collect(),
        rng: [9, 8, 7, 6],
    };
    let mut sequence = Vec::new();
    seq.write(&id, &mut sequence).unwrap();
    let runs = [
        SavedRun {
            parent: None,
            salt: 0,
            tokens: vec![5, 6, 7],
            kv: vec![0.5; 12],
        },
        SavedRun {
            parent: Some(0),
            salt: 0,
            tokens: vec![8],
            kv: vec![-0.25; 4],
        },
        SavedRun {
            parent: None,
            salt: 11,
            tokens: vec![2, 2],
            kv: vec![1.0; 8],
        },
    ];
    let mut prefixes = Vec::new();
    write_prefixes(&id, runs.len(), &mut prefixes, |i| Ok(runs[i].clone())).unwrap();
    vec![("sequence.nistate", sequence), ("prefixes.nikv", prefixes)]
}

/// A saved conversation or prefix cache (hostile bytes). Reading either
/// fails with an error or yields contents within the identity's limits
/// that write back to the same bytes.
pub fn state_file(data: &[u8]) {
    use nanoinfer::engine::state_file::{read_prefixes, write_prefixes, SavedSequence};
    let id = state_identity();
    let len = data.len() as u64;
    if let Ok(seq) = SavedSequence::read(&mut &data[..], len, &id) {
        assert!(!seq.tokens.is_empty() && seq.tokens.len() <= id.max_tokens);
        assert!(seq.tokens.iter().all(|&t| (t as usize) < id.vocab));
        assert!(seq.kv_positions <= seq.tokens.len() && seq.history_start <= seq.tokens.len());
        assert_eq!(seq.kv.len(), seq.kv_positions * id.values_per_slot);
        assert!(seq.kv.iter().all(|v| v.is_finite()));
        let mut again = Vec::new();
        seq.write(&id, &mut again).unwrap();
        assert_eq!(again, data, "a sequence read back writes other bytes");
    }
    let mut runs = Vec::new();
    let read = read_prefixes(&mut &data[..], len, &id, |run, path| {
        assert!(path.len() <= id.max_tokens && path.ends_with(&run.tokens));
        assert_eq!(run.kv.len(), run.tokens.len() * id.values_per_slot);
        assert!(run.parent.is_none_or(|p| p < runs.len()));
        runs.push(run.clone());
        Ok(())
    });
    if read.is_ok() {
        let mut again = Vec::new();
        write_prefixes(&id, runs.len(), &mut again, |i| Ok(runs[i].clone())).unwrap();
        assert_eq!(again, data, "a prefix cache read back writes other bytes");
    }
}
