//! Model directories whose numbers make garbage: config values that cannot
//! compute (eps <= 0, absurd sizes, ids outside the vocabulary), NaN and
//! infinity in the weights, finite weights that overflow in the forward, a
//! tokenizer that does not cover the model, a context length past 2^32.
//! Each goes through the Rust API, the C ABI and the CLI: refused at load
//! with the file and field or tensor named, or, when the garbage appears
//! only at run time, the affected requests end with one error event while
//! the rest of the batch completes and no KV is left held.

mod common;
mod ffi_common;

use nanoinfer::engine::model::{Model, ModelParams};
use nanoinfer::engine::request::{Event, FinishReason, RequestParams};
use nanoinfer::engine::{Session, SessionParams};
use nanoinfer::ffi::*;
use nanoinfer::memory::MemoryPoolKind;
use nanoinfer::sampling::SamplingParams;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Every load and run here is of a tiny model: seconds at most.
const TIME_LIMIT: Duration = Duration::from_secs(20);

/// A token whose embedding row is the only one with a non-zero column 0.
const POISON: u32 = 5;

/// A fresh copy of tests/data/tiny-llama3 (files copied, so they can be edited).
fn tiny_copy(name: &str) -> PathBuf {
    let src = common::repo_path("tests/data/tiny-llama3");
    let dir = std::env::temp_dir().join(format!("ni-garbage-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    dir
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let path = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
}

/// Rewrites the F32 values of tensor `name` in `dir/model.safetensors`;
/// `edit` gets the values and the shape.
fn edit_tensor(dir: &Path, name: &str, edit: impl FnOnce(&mut [f32], &[usize])) {
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let t = &header[name];
    assert_eq!(t["dtype"], "F32", "{name}");
    let shape: Vec<usize> = common::ids(&t["shape"])
        .iter()
        .map(|&x| x as usize)
        .collect();
    let off = common::ids(&t["data_offsets"]);
    let range = 8 + n + off[0] as usize..8 + n + off[1] as usize;
    let mut vals: Vec<f32> = bytes[range.clone()]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    edit(&mut vals, &shape);
    let data: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    bytes[range].copy_from_slice(&data);
    std::fs::write(&path, bytes).unwrap();
}

fn rust_load(dir: &Path) -> nanoinfer::Result<Model> {
    let params = ModelParams {
        threads: 2,
        ..Default::default()
    };
    let start = Instant::now();
    let r = Model::load(dir, &params, None);
    assert!(
        start.elapsed() < TIME_LIMIT,
        "load took {:?}",
        start.elapsed()
    );
    r
}

/// `nanoinfer generate` on token ids: (exit code, stdout, stderr).
fn cli_generate(dir: &Path, ids: &str) -> (i32, String, String) {
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_nanoinfer"))
        .args(["generate", "--model", dir.to_str().unwrap()])
        .args(["--prompt-ids", ids, "--max-tokens", "4", "--threads", "2"])
        .output()
        .unwrap();
    assert!(
        start.elapsed() < TIME_LIMIT,
        "CLI took {:?}",
        start.elapsed()
    );
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Loading `dir` fails everywhere with InvalidModel naming every needle.
fn assert_refused(dir: &Path, needles: &[&str]) {
    let check = |msg: &str, via: &str| {
        for n in needles {
            assert!(msg.contains(n), "{via}: {msg:?} should mention {n:?}");
        }
    };
    let err = match rust_load(dir) {
        Ok(_) => panic!("{} loads; expected {needles:?}", dir.display()),
        Err(e) => e,
    };
    assert_eq!(
        err.kind,
        nanoinfer::ErrorKind::InvalidModel,
        "{}",
        err.message
    );
    check(&err.message, "Rust API");
    let (status, msg, model) = ffi_common::try_load_model_at(dir);
    assert!(model.is_null());
    assert_eq!(status, NI_ERR_INVALID_MODEL, "{msg}");
    check(&msg, "C ABI");
    let (code, _, stderr) = cli_generate(dir, "1,2,3");
    assert_eq!(code, 1, "{stderr}");
    check(&stderr, "CLI");
}

#[test]
fn config_values_that_make_garbage_are_refused() {
    let cases: Vec<(&str, Value, &str)> = vec![
        ("rms_norm_eps", 0.0.into(), "rms_norm_eps"),
        ("rms_norm_eps", (-1.0).into(), "rms_norm_eps"),
        ("rms_norm_eps", 1e39.into(), "rms_norm_eps"),
        ("rope_theta", 0.0.into(), "rope_theta"),
        ("rope_theta", 1e-44.into(), "rope_theta"),
        ("hidden_size", (1u64 << 62).into(), "hidden_size"),
        ("vocab_size", (1u64 << 40).into(), "vocab_size"),
        ("intermediate_size", 0.into(), "intermediate_size"),
        ("num_hidden_layers", 1_000_000.into(), "num_hidden_layers"),
        (
            "max_position_embeddings",
            0.into(),
            "max_position_embeddings",
        ),
        ("eos_token_id", 256.into(), "eos_token_id"),
    ];
    for (i, (key, value, needle)) in cases.into_iter().enumerate() {
        let dir = tiny_copy(&format!("config-{i}"));
        edit_config(&dir, |v| v[key] = value);
        assert_refused(&dir, &["config.json", needle]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
    let dir = tiny_copy("config-rope-factor");
    edit_config(&dir, |v| {
        v["rope_scaling"]["low_freq_factor"] = (-1.0).into()
    });
    assert_refused(&dir, &["config.json", "low_freq_factor"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn non_finite_weights_are_refused_naming_the_tensor() {
    let cases = [
        ("model.layers.1.mlp.down_proj.weight", f32::NAN),
        ("model.norm.weight", f32::INFINITY),
        ("model.embed_tokens.weight", f32::NEG_INFINITY),
    ];
    for (i, (tensor, bad)) in cases.into_iter().enumerate() {
        let dir = tiny_copy(&format!("weights-{i}"));
        edit_tensor(&dir, tensor, |v, _| v[v.len() / 2 + 1] = bad);
        assert_refused(&dir, &["model.safetensors", tensor, "non-finite"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// Finite weights that overflow in the forward of prompts holding
/// `POISON`: its embedding row alone has a non-zero column 0, and the
/// first layer's v projection reads that column with weight 1e38 (finite;
/// times the normalized activation it is infinity), so the value vectors
/// of those prompts, and every logit computed from them, are not finite.
fn overflowing_model(name: &str) -> PathBuf {
    let dir = tiny_copy(name);
    edit_tensor(&dir, "model.embed_tokens.weight", |v, shape| {
        let d = shape[1];
        for row in 0..shape[0] {
            v[row * d] = if row == POISON as usize { 1.0 } else { 0.0 };
        }
    });
    edit_tensor(
        &dir,
        "model.layers.0.self_attn.v_proj.weight",
        |v, shape| {
            for row in 0..shape[0] {
                v[row * shape[1]] = 1e38;
            }
        },
    );
    dir
}

fn request(prompt: &[u32], temperature: f32, logprobs: u32) -> RequestParams {
    RequestParams {
        prompt: prompt.to_vec(),
        sampling: SamplingParams {
            temperature,
            logprobs,
            max_tokens: 6,
            ignore_eos: true,
            seed: Some(7),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Runs `reqs` in one session to idle; returns each request's events.
fn run(model: &Arc<Model>, reqs: &[RequestParams]) -> Vec<Vec<Event>> {
    let mut s = Session::new(model.clone(), SessionParams::default()).unwrap();
    let ids: Vec<u64> = reqs
        .iter()
        .map(|r| s.add_request(r.clone()).unwrap())
        .collect();
    let mut events: BTreeMap<u64, Vec<Event>> = BTreeMap::new();
    let start = Instant::now();
    while s.has_work() {
        assert!(start.elapsed() < TIME_LIMIT, "session did not finish");
        for e in s.step().unwrap() {
            events.entry(e.request_id).or_default().push(e);
        }
        s.check_invariants().unwrap();
    }
    let st = s.stats();
    assert_eq!((st.running, st.waiting, st.kv.used_slots), (0, 0, 0));
    ids.iter()
        .map(|id| events.remove(id).unwrap_or_default())
        .collect()
}

fn terminal(events: &[Event]) -> &FinishReason {
    let finished: Vec<_> = events.iter().filter_map(|e| e.finish.as_ref()).collect();
    assert_eq!(finished.len(), 1, "{events:?}");
    assert!(
        events.last().unwrap().finish.is_some(),
        "terminal event is last"
    );
    finished[0]
}

#[test]
fn overflow_at_run_time_ends_only_the_affected_requests() {
    let dir = overflowing_model("overflow");
    let model = Arc::new(rust_load(&dir).expect("finite weights load, however large"));
    let poisoned = [1, POISON, 3];
    let clean = [1, 2, 3];
    // Mixed batch: the host samples every row (greedy, sampled, logprobs).
    let reqs = [
        request(&poisoned, 0.0, 0),
        request(&poisoned, 0.8, 0),
        request(&poisoned, 0.0, 3),
        request(&clean, 0.0, 2),
        request(&clean, 0.8, 0),
    ];
    let out = run(&model, &reqs);
    for (i, ev) in out.iter().enumerate() {
        match terminal(ev) {
            FinishReason::Error(m) if i < 3 => {
                assert!(m.contains("non-finite logits"), "{m}");
                assert!(ev.iter().all(|e| e.tokens.is_empty()), "{ev:?}");
            }
            FinishReason::Length if i >= 3 => {
                let n: usize = ev.iter().map(|e| e.tokens.len()).sum();
                assert_eq!(n, 6);
            }
            other => panic!("request {i}: {other:?}"),
        }
    }
    // Plain greedy only: the ids come from the forward's argmax.
    let out = run(
        &model,
        &[request(&poisoned, 0.0, 0), request(&clean, 0.0, 0)],
    );
    assert!(matches!(terminal(&out[0]), FinishReason::Error(m) if m.contains("non-finite logits")));
    assert_eq!(terminal(&out[1]), &FinishReason::Length);

    // The C ABI: one NI_FINISH_ERROR event with the message, the other completes.
    let (status, msg, m) = ffi_common::try_load_model_at(&dir);
    assert_eq!(status, NI_OK, "{msg}");
    let s = ffi_common::create_session(m);
    let bad = ffi_common::add_tokens(s, &poisoned, 4);
    let good = ffi_common::add_tokens(s, &clean, 4);
    let r = ffi_common::run_to_completion(s);
    assert_eq!(r[&bad].finish, NI_FINISH_ERROR, "{:?}", r[&bad]);
    assert!(r[&bad]
        .error
        .as_deref()
        .unwrap()
        .contains("non-finite logits"));
    assert!(r[&bad].tokens.is_empty());
    assert_eq!(r[&good].finish, NI_FINISH_LENGTH);
    ffi_common::assert_usable(s);
    // SAFETY: handles from create/load above, freed once.
    unsafe {
        ni_session_free(s);
        ni_model_free(m);
    }

    // The CLI fails with the message instead of printing token 0 forever.
    let (code, stdout, stderr) = cli_generate(&dir, "1,5,3");
    assert_eq!(code, 1, "{stdout}{stderr}");
    assert!(stderr.contains("non-finite logits"), "{stderr}");
    let (code, _, stderr) = cli_generate(&dir, "1,2,3");
    assert_eq!(code, 0, "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn context_length_past_u32_saturates_in_model_info() {
    let dir = tiny_copy("long-context");
    edit_config(&dir, |v| v["max_position_embeddings"] = (1u64 << 40).into());
    let model = Arc::new(rust_load(&dir).unwrap());
    assert_eq!(model.config().max_position_embeddings, 1 << 40);
    let out = run(&model, &[request(&[1, 2, 3], 0.0, 0)]);
    assert_eq!(terminal(&out[0]), &FinishReason::Length);

    let (status, msg, m) = ffi_common::try_load_model_at(&dir);
    assert_eq!(status, NI_OK, "{msg}");
    // SAFETY: all-zero is a valid ni_model_info; struct_size set as documented.
    let mut info: ni_model_info = unsafe { std::mem::zeroed() };
    info.struct_size = std::mem::size_of::<ni_model_info>() as u32;
    // SAFETY: valid pointers.
    assert_eq!(unsafe { ni_model_get_info(m, &mut info) }, NI_OK);
    assert_eq!(info.context_length, u32::MAX);
    assert_eq!(
        (info.vocab_size, info.n_layers, info.hidden_size),
        (256, 2, 64)
    );
    let s = ffi_common::create_session(m);
    ffi_common::assert_usable(s);
    // SAFETY: handles from above, freed once.
    unsafe {
        ni_session_free(s);
        ni_model_free(m);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The default model with tokenizer.json cut to the ids below `keep`
/// (merges that need a removed token go too).
fn truncated_tokenizer(name: &str, keep: u64) -> PathBuf {
    let src = common::smollm2_dir("");
    let dir = std::env::temp_dir().join(format!("ni-garbage-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "tokenizer.json" {
            let target = std::fs::canonicalize(entry.path()).unwrap();
            std::os::unix::fs::symlink(target, dir.join(entry.file_name())).unwrap();
        }
    }
    let text = std::fs::read_to_string(src.join("tokenizer.json")).unwrap();
    let mut tok: Value = serde_json::from_str(&text).unwrap();
    let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
    vocab.retain(|_, id| id.as_u64().unwrap() < keep);
    let kept: std::collections::HashSet<String> = vocab.keys().cloned().collect();
    let merges = tok["model"]["merges"].as_array_mut().unwrap();
    merges.retain(|m| {
        let (a, b) = match m {
            Value::String(s) => s
                .split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string())),
            Value::Array(p) => Some((p[0].as_str().unwrap().into(), p[1].as_str().unwrap().into())),
            _ => None,
        }
        .unwrap();
        kept.contains(&a) && kept.contains(&b) && kept.contains(&format!("{a}{b}"))
    });
    std::fs::write(
        dir.join("tokenizer.json"),
        serde_json::to_string(&tok).unwrap(),
    )
    .unwrap();
    dir
}

#[test]
fn tokenizer_that_does_not_cover_the_model() {
    // Far too small: another model's tokenizer. Refused, both sizes named.
    let dir = truncated_tokenizer("tok-small", 20_000);
    let err = rust_load(&dir).err().expect("refused");
    for n in ["tokenizer.json", "20000", "49152"] {
        assert!(err.message.contains(n), "{}", err.message);
    }
    let (status, msg, m) = ffi_common::try_load_model_at(&dir);
    assert!(m.is_null());
    assert_eq!(status, NI_ERR_INVALID_MODEL, "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();

    // Padding past the tokenizer (as Qwen2 ships): loads, and the ids it
    // lacks are never sampled, even when biased to win.
    let keep = 49_000;
    let dir = truncated_tokenizer("tok-padded", keep);
    let model = Arc::new(rust_load(&dir).expect("padded vocabulary loads"));
    assert_eq!(model.sample_vocab, keep as usize);
    let mut reqs = vec![request(&[1, 2, 3], 0.0, 2), request(&[1, 2, 3], 1.0, 0)];
    for r in &mut reqs {
        r.sampling.logit_bias = vec![(49_100, 100.0), (49_151, 100.0)];
    }
    for ev in run(&model, &reqs) {
        assert_eq!(terminal(&ev), &FinishReason::Length);
        let tokens: Vec<u32> = ev.iter().flat_map(|e| e.tokens.clone()).collect();
        assert!(tokens.iter().all(|&t| (t as u64) < keep), "{tokens:?}");
        let text: String = ev.iter().map(|e| e.text.as_str()).collect();
        assert!(!text.is_empty());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A word-level tokenizer.json with tokens for ids `0..n` only.
fn write_word_tokenizer(dir: &Path, n: u32) {
    let vocab: serde_json::Map<String, Value> =
        (0..n).map(|i| (format!("w{i}"), Value::from(i))).collect();
    let tok = serde_json::json!({
        "version": "1.0",
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"},
        "pre_tokenizer": {"type": "Whitespace"},
        "decoder": null,
        "added_tokens": [],
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
}

#[test]
fn a_context_chooses_only_ids_the_tokenizer_covers() {
    let dir = tiny_copy("choosable");
    let model = Arc::new(rust_load(&dir).unwrap());
    common::choosable::check_choosable_ids(&model, MemoryPoolKind::default_for(false));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn plain_greedy_never_emits_padding_ids() {
    // The padded head row 255 is made to win the first step (ten times the
    // winning row), as a Qwen-style checkpoint's untrained padding rows can:
    // without a tokenizer every id is choosable and 255 comes out; with one
    // that covers ids 0..250, greedy decoding takes the best id it covers.
    let dir = tiny_copy("padded-greedy");
    let prompt = [1, 2, 3];
    let first = |dir: &Path| {
        let model = Arc::new(rust_load(dir).unwrap());
        let ev = run(&model, &[request(&prompt, 0.0, 0)]).remove(0);
        assert_eq!(terminal(&ev), &FinishReason::Length);
        let tokens: Vec<u32> = ev.iter().flat_map(|e| e.tokens.clone()).collect();
        let text: String = ev.iter().map(|e| e.text.as_str()).collect();
        (tokens, text)
    };
    let (plain, _) = first(&dir);
    let winner = plain[0] as usize;
    assert!(winner < 250, "{plain:?}");
    edit_tensor(&dir, "lm_head.weight", |w, shape| {
        let h = shape[1];
        let row: Vec<f32> = w[winner * h..(winner + 1) * h].to_vec();
        for (d, s) in w[255 * h..256 * h].iter_mut().zip(row) {
            *d = 10.0 * s;
        }
    });
    let (unlimited, _) = first(&dir);
    assert_eq!(
        unlimited[0], 255,
        "the padding row does not win: {unlimited:?}"
    );
    write_word_tokenizer(&dir, 250);
    let (limited, text) = first(&dir);
    assert_eq!(limited[0] as usize, winner, "{limited:?}");
    assert!(limited.iter().all(|&t| t < 250), "{limited:?}");
    assert!(text.starts_with(&format!("w{winner}")), "{text:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}
