//! The `safetensors_index` fuzz target's logic, shared with the normal test
//! suite (tests/safetensors_index_fuzz_logic.rs includes this file with
//! `#[path]`, so it also runs on stable).
//!
//! An input describes a sharded model directory:
//!
//! ```text
//! input := config_selector(1 byte) index_json (SEP shard)*
//! shard := flags(1 byte) data_len(u32 LE) [header_len(u64 LE) if flags & 1] header
//! ```
//!
//! `index_json` becomes `model.safetensors.index.json`; shard `i` (from 1,
//! at most `MAX_SHARDS`) becomes `model-0000i-of-0000n.safetensors`: the
//! 8-byte header length (the true one unless the input gives its own), the
//! header bytes, and `data_len` bytes of data (at most 1 MiB) in a pattern
//! that reads as small finite numbers in every float dtype. The config
//! selector picks one of the tiny test models' `config.json` (or none).
//!
//! Properties: opening the directory returns an error or weights that agree
//! exactly with the index (checked against serde_json's reading of it) and
//! lie inside their files; each shard opened alone lists exactly the
//! tensors the index maps to it; typed accessors agree with the shapes.
//! With a config, loading the model returns an error or a model that runs
//! one decode step.
#![allow(dead_code)] // each user takes part of it

use nanoinfer::engine::{Model, ModelParams, RequestParams, Session, SessionParams};
use nanoinfer::model::safetensors::{WeightFiles, INDEX_FILE};
use nanoinfer::sampling::SamplingParams;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Separates the index from the shards and the shards from each other.
pub const SEP: &[u8] = b"|SHARD|";
pub const MAX_SHARDS: usize = 8;
pub const MAX_DATA: usize = 1 << 20;
/// The configs a selector byte picks from (`selector % 4`; 0 = no config).
pub const CONFIGS: [&str; 3] = ["tiny-llama3", "tiny-qwen2", "tiny-qwen3"];

/// What one input did, for the stable test's statistics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    pub opened: bool,
    pub tensors: usize,
    pub model_loaded: bool,
}

/// One decoded shard part.
pub struct ShardPart<'a> {
    pub header_len: Option<u64>,
    pub data_len: usize,
    pub header: &'a [u8],
}

/// Splits an input into (config selector, index JSON, shard parts).
pub fn decode(data: &[u8]) -> (u8, &[u8], Vec<ShardPart<'_>>) {
    let Some((&selector, rest)) = data.split_first() else {
        return (0, &[], vec![]);
    };
    let mut parts = split(rest, SEP);
    let index = parts.remove(0);
    let shards = parts
        .into_iter()
        .take(MAX_SHARDS)
        .map(|p| {
            let flags = p.first().copied().unwrap_or(0);
            let mut rest = p.get(1..).unwrap_or(&[]);
            let mut take = |n: usize| -> u64 {
                let mut b = [0u8; 8];
                let k = n.min(rest.len());
                b[..k].copy_from_slice(&rest[..k]);
                rest = &rest[k..];
                u64::from_le_bytes(b)
            };
            let data_len = (take(4) as usize).min(MAX_DATA);
            let header_len = (flags & 1 == 1).then(|| take(8));
            ShardPart {
                header_len,
                data_len,
                header: rest,
            }
        })
        .collect();
    (selector, index, shards)
}

/// The inverse of `decode` (used to build seeds).
pub fn encode(selector: u8, index: &[u8], shards: &[ShardPart<'_>]) -> Vec<u8> {
    let mut out = vec![selector];
    out.extend_from_slice(index);
    for s in shards {
        out.extend_from_slice(SEP);
        out.push(s.header_len.is_some() as u8);
        out.extend_from_slice(&(s.data_len as u32).to_le_bytes());
        if let Some(n) = s.header_len {
            out.extend_from_slice(&n.to_le_bytes());
        }
        out.extend_from_slice(s.header);
    }
    out
}

fn split<'a>(data: &'a [u8], sep: &[u8]) -> Vec<&'a [u8]> {
    let mut parts = vec![];
    let mut start = 0;
    let mut i = 0;
    while i + sep.len() <= data.len() {
        if &data[i..i + sep.len()] == sep {
            parts.push(&data[start..i]);
            i += sep.len();
            start = i;
        } else {
            i += 1;
        }
    }
    parts.push(&data[start..]);
    parts
}

pub fn shard_name(i: usize, n: usize) -> String {
    format!("model-{i:05}-of-{n:05}.safetensors")
}

/// Bytes 00 3C repeated: 0.0078 as bf16 or f32 pairs, 1.0 as f16.
fn pattern(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| if i % 2 == 0 { 0x00 } else { 0x3c })
        .collect()
}

/// Writes the directory `data` describes into `dir` (emptied first).
pub fn write_dir(repo_root: &Path, dir: &Path, data: &[u8]) -> Option<&'static str> {
    let (selector, index, shards) = decode(data);
    if dir.exists() {
        std::fs::remove_dir_all(dir).expect("empty the scratch directory");
    }
    std::fs::create_dir_all(dir).expect("create the scratch directory");
    std::fs::write(dir.join(INDEX_FILE), index).unwrap();
    for (i, s) in shards.iter().enumerate() {
        let mut file = s
            .header_len
            .unwrap_or(s.header.len() as u64)
            .to_le_bytes()
            .to_vec();
        file.extend_from_slice(s.header);
        file.extend_from_slice(&pattern(s.data_len));
        std::fs::write(dir.join(shard_name(i + 1, shards.len())), file).unwrap();
    }
    let config = match selector % 4 {
        0 => None,
        k => Some(CONFIGS[k as usize - 1]),
    };
    if let Some(name) = config {
        let src = repo_root.join("tests/data").join(name).join("config.json");
        std::fs::copy(&src, dir.join("config.json"))
            .unwrap_or_else(|e| panic!("{}: {e}", src.display()));
    }
    config
}

/// The index as serde_json reads it: tensor → shard file name.
fn weight_map(index: &[u8]) -> BTreeMap<String, String> {
    let v: serde_json::Value = serde_json::from_slice(index)
        .unwrap_or_else(|e| panic!("an index the loader accepted is not JSON to serde_json: {e}"));
    let map = v["weight_map"]
        .as_object()
        .expect("an accepted index has a weight_map object");
    map.iter()
        .map(|(k, v)| {
            let shard = v.as_str().expect("accepted weight_map values are strings");
            (k.clone(), shard.to_string())
        })
        .collect()
}

/// Runs one input in `dir` (a directory this driver may empty and fill).
pub fn check(repo_root: &Path, dir: &Path, data: &[u8]) -> Outcome {
    let config = write_dir(repo_root, dir, data);
    let mut outcome = Outcome::default();
    let files = match WeightFiles::open(dir) {
        Ok(f) => f,
        Err(e) => {
            assert!(!e.message.is_empty());
            return outcome;
        }
    };
    outcome.opened = true;
    outcome.tensors = files.len();
    let index = std::fs::read(dir.join(INDEX_FILE)).unwrap();
    let map = weight_map(&index);

    // The tensors are exactly the index's, each in the shard it names.
    let names: BTreeSet<&str> = files.tensor_names().collect();
    let listed: BTreeSet<&str> = map.keys().map(String::as_str).collect();
    assert_eq!(names, listed, "tensors differ from the index's weight_map");
    let shard_files: BTreeSet<PathBuf> = map.values().map(|s| dir.join(s)).collect();
    let opened: BTreeSet<PathBuf> = files.shards().iter().map(|s| s.path().into()).collect();
    assert_eq!(opened, shard_files, "opened shards differ from the index's");
    assert_eq!(
        files.shards().len(),
        shard_files.len(),
        "a shard opened twice"
    );
    for (name, shard) in &map {
        let info = files.info(name).expect("listed tensor has info");
        assert_eq!(
            info.file,
            dir.join(shard),
            "{name} served from another file"
        );
        let len = std::fs::metadata(info.file).unwrap().len() as usize;
        assert!(
            info.byte_len <= len,
            "{name}: {} bytes in a {len}-byte file",
            info.byte_len
        );
        check_view(&files, name);
    }

    // Each shard alone holds exactly what the index maps to it.
    for path in &shard_files {
        let alone = WeightFiles::open_file(path).unwrap_or_else(|e| {
            panic!("{} opened in the index but not alone: {e}", path.display())
        });
        let mine: BTreeSet<&str> = map
            .iter()
            .filter(|(_, s)| dir.join(s) == *path)
            .map(|(n, _)| n.as_str())
            .collect();
        let got: BTreeSet<&str> = alone.tensor_names().collect();
        assert_eq!(got, mine, "{}", path.display());
    }
    drop(files);

    if config.is_some() {
        outcome.model_loaded = load_and_step(dir);
    }
    outcome
}

/// Typed access to tensor `name` agrees with its shape and reads every byte.
fn check_view(files: &WeightFiles, name: &str) {
    let Some(view) = files.get(name) else {
        return; // a dtype the reader lists but does not view
    };
    let numel: usize = view.shape.iter().product();
    assert_eq!(view.numel(), numel, "{name}");
    assert_eq!(
        view.bytes.len(),
        numel * view.dtype.size_in_bytes(),
        "{name}"
    );
    if let Ok(v) = view.to_f32() {
        assert_eq!(v.len(), numel);
        std::hint::black_box(v.iter().fold(0u32, |a, x| a ^ x.to_bits()));
    }
    if let Ok(v) = view.as_u16() {
        assert_eq!(v.len(), numel);
    }
    if let Ok(v) = view.as_i8() {
        assert_eq!(v.len(), numel);
    }
    let _ = files.require(name, view.shape);
}

/// Loads the model in `dir`; if that works, one prompt runs to its end.
fn load_and_step(dir: &Path) -> bool {
    let params = ModelParams {
        threads: 1,
        ..Default::default()
    };
    let Ok(model) = Model::load(dir, &params, None) else {
        return false;
    };
    let sp = SessionParams {
        kv_capacity_tokens: 16,
        max_batched_tokens: 16,
        max_seqs: 1,
        ..Default::default()
    };
    let mut s = Session::new(std::sync::Arc::new(model), sp).expect("a session on a loaded model");
    let id = s
        .add_request(RequestParams {
            prompt: vec![1, 2, 3],
            sampling: SamplingParams {
                max_tokens: 2,
                ..Default::default()
            },
            ..Default::default()
        })
        .expect("a valid request");
    let mut finished = false;
    for _ in 0..8 {
        for ev in s.step().expect("step") {
            assert_eq!(ev.request_id, id);
            if let Some(f) = ev.finish {
                assert!(!finished, "two terminal events");
                finished = true;
                std::hint::black_box(f);
            }
        }
    }
    assert!(finished, "the request did not finish");
    true
}
