//! The `safetensors_index` fuzz target's logic
//! (fuzz/fuzz_targets/index_driver.rs, included with `#[path]`) on stable:
//! over the committed seeds and over seeded random mutations of them.
//! `scripts/fuzz.sh` runs the same code under libFuzzer.
//!
//! The seeds are made here from the committed tiny models (their real
//! headers, split into shards with a Hugging Face style index):
//! `NANOINFER_BLESS=1 cargo test --release --test safetensors_index_fuzz_logic`
//! rewrites fuzz/seeds/safetensors_index/.

#[path = "../fuzz/fuzz_targets/index_driver.rs"]
mod index_driver;

use index_driver::{encode, shard_name, ShardPart};
use nanoinfer::sampling::rng::SplitMix64;
use serde_json::{json, Map, Value};
use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn scratch(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("nanoinfer-index-fuzz-{tag}-{}", std::process::id()))
}

/// A tensor's name and shape.
type Tensor = (String, Vec<u64>);

/// The tensors of a committed tiny model, sorted by name.
fn real_tensors(model: &str) -> Vec<Tensor> {
    let bytes = std::fs::read(
        root()
            .join("tests/data")
            .join(model)
            .join("model.safetensors"),
    )
    .expect("committed tiny model");
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header
        .into_iter()
        .filter(|(k, _)| k != "__metadata__")
        .map(|(k, v)| {
            let shape = v["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect();
            (k, shape)
        })
        .collect()
}

/// A shard header holding `tensors` in `dtype`, offsets packed in order;
/// returns (header JSON, data bytes).
fn shard_header(tensors: &[Tensor], dtype: &str, meta: bool) -> (Vec<u8>, usize) {
    let size = match dtype {
        "F32" => 4,
        _ => 2,
    };
    let mut h = Map::new();
    if meta {
        h.insert("__metadata__".into(), json!({"format": "pt"}));
    }
    let mut off = 0u64;
    for (name, shape) in tensors {
        let len = shape.iter().product::<u64>() * size;
        h.insert(
            name.clone(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + len]}),
        );
        off += len;
    }
    (serde_json::to_vec(&Value::Object(h)).unwrap(), off as usize)
}

/// One seed: `model`'s tensors in `n` shards of `dtype`, an index mapping
/// each to its shard, then `tweak` applied to (index map, shard lists).
struct SeedSpec {
    name: &'static str,
    model: &'static str,
    config: u8,
    shards: usize,
    dtype: &'static str,
    tweak: fn(&mut Map<String, Value>, &mut Vec<Vec<Tensor>>),
}

fn make_seed(s: &SeedSpec) -> Vec<u8> {
    let tensors = real_tensors(s.model);
    let per = tensors.len().div_ceil(s.shards);
    let mut lists: Vec<Vec<Tensor>> = tensors.chunks(per).map(|c| c.to_vec()).collect();
    let mut map = Map::new();
    for (i, list) in lists.iter().enumerate() {
        for (name, _) in list {
            map.insert(name.clone(), json!(shard_name(i + 1, lists.len())));
        }
    }
    (s.tweak)(&mut map, &mut lists);
    let headers: Vec<(Vec<u8>, usize)> = lists
        .iter()
        .enumerate()
        .map(|(i, l)| shard_header(l, s.dtype, i == 0))
        .collect();
    let total: usize = headers.iter().map(|h| h.1).sum();
    let index = json!({"metadata": {"total_size": total}, "weight_map": map});
    let index = serde_json::to_vec_pretty(&index).unwrap();
    let parts: Vec<ShardPart> = headers
        .iter()
        .map(|(h, data)| ShardPart {
            header_len: None,
            data_len: *data,
            header: h,
        })
        .collect();
    encode(s.config, &index, &parts)
}

fn seed_specs() -> Vec<SeedSpec> {
    fn none(_: &mut Map<String, Value>, _: &mut Vec<Vec<Tensor>>) {}
    vec![
        SeedSpec {
            name: "llama3-2-shards-f32",
            model: "tiny-llama3",
            config: 1,
            shards: 2,
            dtype: "F32",
            tweak: none,
        },
        SeedSpec {
            name: "qwen2-3-shards-bf16",
            model: "tiny-qwen2",
            config: 2,
            shards: 3,
            dtype: "BF16",
            tweak: none,
        },
        SeedSpec {
            name: "qwen3-2-shards-f16",
            model: "tiny-qwen3",
            config: 3,
            shards: 2,
            dtype: "F16",
            tweak: none,
        },
        SeedSpec {
            name: "llama3-1-shard-no-config",
            model: "tiny-llama3",
            config: 0,
            shards: 1,
            dtype: "F32",
            tweak: none,
        },
        SeedSpec {
            name: "missing-shard",
            model: "tiny-llama3",
            config: 1,
            shards: 2,
            dtype: "F32",
            tweak: |map, _| {
                let k = map.keys().next().unwrap().clone();
                map.insert(k, json!(shard_name(3, 3)));
            },
        },
        SeedSpec {
            name: "tensor-in-two-shards",
            model: "tiny-qwen2",
            config: 2,
            shards: 2,
            dtype: "BF16",
            tweak: |_, lists| {
                let t = lists[0][0].clone();
                lists[1].push(t);
            },
        },
        SeedSpec {
            name: "unlisted-tensor",
            model: "tiny-qwen3",
            config: 3,
            shards: 2,
            dtype: "F32",
            tweak: |map, lists| {
                let name = lists[1][0].0.clone();
                map.remove(&name);
            },
        },
        SeedSpec {
            name: "wrong-shape",
            model: "tiny-llama3",
            config: 1,
            shards: 2,
            dtype: "F32",
            // Same size, one more dimension: the loader's shape check refuses it.
            tweak: |_, lists| lists[1][0].1.push(1),
        },
    ]
}

fn seed_dir() -> PathBuf {
    root().join("fuzz/seeds/safetensors_index")
}

#[test]
fn committed_seeds_match_the_generator() {
    let dir = seed_dir();
    let bless = std::env::var_os("NANOINFER_BLESS").is_some();
    if bless {
        std::fs::create_dir_all(&dir).unwrap();
    }
    for s in seed_specs() {
        let path = dir.join(format!("seed-{}", s.name));
        let seed = make_seed(&s);
        if bless {
            std::fs::write(&path, &seed).unwrap();
        } else {
            let committed = std::fs::read(&path).unwrap_or_else(|e| {
                panic!(
                    "{}: {e} (NANOINFER_BLESS=1 makes the seeds)",
                    path.display()
                )
            });
            assert!(
                committed == seed,
                "{} is stale (NANOINFER_BLESS=1 remakes it)",
                path.display()
            );
        }
    }
}

/// Every committed seed (and any crash input added there as a regression)
/// passes; the real ones load and run, the broken ones are refused.
#[test]
fn committed_seeds_pass() {
    let dir = scratch("seeds");
    let mut n = 0;
    let mut entries: Vec<PathBuf> = std::fs::read_dir(seed_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        let data = std::fs::read(&path).unwrap();
        let o = index_driver::check(&root(), &dir, &data);
        let name = path.file_name().unwrap().to_str().unwrap();
        let whole = ["llama3-2", "qwen2-3", "qwen3-2"]
            .iter()
            .any(|p| name.contains(p));
        if whole {
            assert!(o.opened && o.model_loaded, "{name}: {o:?}");
        }
        if ["missing", "two-shards", "unlisted"]
            .iter()
            .any(|p| name.contains(p))
        {
            assert!(!o.opened, "{name} opened");
        }
        if name.contains("wrong-shape") {
            assert!(o.opened && !o.model_loaded, "{name}: {o:?}");
        }
        if name.contains("no-config") {
            assert!(o.opened && o.tensors == 21, "{name}: {o:?}");
        }
        n += 1;
    }
    assert!(n >= 8, "{n} seeds");
    std::fs::remove_dir_all(&dir).ok();
}

/// A few libFuzzer-like mutations, plus structure-aware ones (digits in the
/// JSON, the explicit header length flag, the data length, whole parts).
fn mutate(rng: &mut SplitMix64, data: &mut Vec<u8>) {
    for _ in 0..1 + rng.below(4) {
        let len = data.len();
        match rng.below(9) {
            0 if len > 0 => {
                let i = rng.below(len);
                data[i] ^= 1 << rng.below(8);
            }
            1 => {
                let i = rng.below(len + 1);
                data.insert(i, rng.next_u64() as u8);
            }
            2 if len > 1 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(64));
                data.drain(i..i + n);
            }
            3 => {
                // A digit changes: offsets, shapes, sizes.
                let digits: Vec<usize> = (0..len).filter(|&i| data[i].is_ascii_digit()).collect();
                if !digits.is_empty() {
                    let i = digits[rng.below(digits.len())];
                    data[i] = b'0' + rng.below(10) as u8;
                }
            }
            4 => {
                // A JSON token from elsewhere in the input is copied over.
                let quotes: Vec<usize> = (0..len).filter(|&i| data[i] == b'"').collect();
                if quotes.len() >= 4 {
                    let a = quotes[rng.below(quotes.len() - 1)];
                    let b = quotes[rng.below(quotes.len() - 1)];
                    let end = quotes.iter().find(|&&q| q > a).copied().unwrap();
                    let token = data[a..=end].to_vec();
                    let bend = quotes.iter().find(|&&q| q > b).copied().unwrap();
                    data.splice(b..=bend, token);
                }
            }
            5 => {
                // A shard's flags/data length/header length rewritten.
                let seps = sep_positions(data);
                if !seps.is_empty() {
                    let at = seps[rng.below(seps.len())] + index_driver::SEP.len();
                    for k in 0..1 + rng.below(13) {
                        if at + k < data.len() {
                            data[at + k] = rng.next_u64() as u8;
                        }
                    }
                }
            }
            6 => {
                // A whole part dropped or duplicated.
                let seps = sep_positions(data);
                if !seps.is_empty() {
                    let k = rng.below(seps.len());
                    let end = seps.get(k + 1).copied().unwrap_or(data.len());
                    let part = data[seps[k]..end].to_vec();
                    if rng.below(2) == 0 {
                        data.drain(seps[k]..end);
                    } else {
                        data.extend_from_slice(&part);
                    }
                }
            }
            7 => {
                data[0] = rng.next_u64() as u8;
            }
            _ if len > 0 => {
                let i = rng.below(len);
                data.truncate(i.max(1));
            }
            _ => {}
        }
        if data.is_empty() {
            data.push(0);
        }
    }
}

fn sep_positions(data: &[u8]) -> Vec<usize> {
    let sep = index_driver::SEP;
    (0..data.len().saturating_sub(sep.len() - 1))
        .filter(|&i| &data[i..i + sep.len()] == sep)
        .collect()
}

/// 1,500 mutated seeds: no panic; some still open and load.
#[test]
fn mutated_seeds_never_panic() {
    let dir = scratch("mutated");
    let seeds: Vec<Vec<u8>> = seed_specs().iter().map(make_seed).collect();
    let mut rng = SplitMix64::new(7);
    let (mut opened, mut loaded, n) = (0, 0, 1500);
    for i in 0..n {
        let mut data = seeds[i % seeds.len()].clone();
        mutate(&mut rng, &mut data);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            index_driver::check(&root(), &dir, &data)
        }));
        let o = r.unwrap_or_else(|_| {
            let path = std::env::temp_dir().join(format!("index-fuzz-failure-{i}"));
            std::fs::write(&path, &data).unwrap();
            panic!("input {i} failed; saved to {}", path.display())
        });
        opened += o.opened as usize;
        loaded += o.model_loaded as usize;
    }
    eprintln!("safetensors_index: {n} mutated inputs, {opened} opened, {loaded} loaded a model");
    // Most mutations break a header or the index; enough survive to reach
    // the checks on opened weights and loaded models.
    assert!(
        opened >= n / 100 && opened < n / 2,
        "{opened} of {n} opened"
    );
    assert!(loaded > 0, "no mutated input loaded a model");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn decode_inverts_encode() {
    let parts = [
        ShardPart {
            header_len: None,
            data_len: 12,
            header: b"{}",
        },
        ShardPart {
            header_len: Some(1 << 40),
            data_len: 0,
            header: b"{\"a\":1}",
        },
    ];
    let data = encode(2, b"{\"weight_map\":{}}", &parts);
    let (sel, index, got) = index_driver::decode(&data);
    assert_eq!((sel, index), (2, &b"{\"weight_map\":{}}"[..]));
    assert_eq!(got.len(), 2);
    for (a, b) in got.iter().zip(&parts) {
        assert_eq!(
            (a.header_len, a.data_len, a.header),
            (b.header_len, b.data_len, b.header)
        );
    }
}
