//! A fuzz smoke test on stable: the parser fuzz targets' code
//! (fuzz/fuzz_targets/parsers_driver.rs, included with `#[path]`) over
//! their committed seeds and seeded random mutations of them (bit flips,
//! inserted/deleted/duplicated ranges, splices of two seeds, truncation).
//! No coverage guidance: this catches regressions of the targets'
//! properties in CI, while `scripts/fuzz.sh` searches with libFuzzer.
//! A failing input is saved to the temp directory and named in the failure.
//! (The engine and sharded-index targets have their own stable tests:
//! engine_fuzz_logic, safetensors_index_fuzz_logic.)

#[path = "../fuzz/fuzz_targets/parsers_driver.rs"]
mod parsers_driver;

use nanoinfer::sampling::rng::SplitMix64;
use std::cell::Cell;
use std::path::PathBuf;
use std::sync::Once;

thread_local! {
    /// True while a target runs: panics the library catches itself
    /// (tokenizers, minijinja) are not printed.
    static IN_TARGET: Cell<bool> = const { Cell::new(false) };
}

fn quiet_caught_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !IN_TARGET.with(Cell::get) {
                default(info);
            }
        }));
    });
}

fn seeds(target: &str) -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(target);
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    assert!(!paths.is_empty(), "no seeds in {}", dir.display());
    paths.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

/// Bytes that often matter to parsers.
const INTERESTING: &[u8] = b"\0\xff\x7f\x80{}[]\":,\\0123456789-.eE\n ";

fn mutate(rng: &mut SplitMix64, data: &mut Vec<u8>, other: &[u8]) {
    for _ in 0..1 + rng.below(4) {
        let len = data.len();
        match rng.below(7) {
            0 if len > 0 => {
                let i = rng.below(len);
                data[i] ^= 1 << rng.below(8);
            }
            1 => {
                let b = if rng.below(2) == 0 {
                    INTERESTING[rng.below(INTERESTING.len())]
                } else {
                    rng.next_u64() as u8
                };
                data.insert(rng.below(len + 1), b);
            }
            2 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(32));
                data.drain(i..i + n);
            }
            3 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(32));
                let chunk = data[i..i + n].to_vec();
                let at = rng.below(len + 1);
                data.splice(at..at, chunk);
            }
            4 if !other.is_empty() => {
                // Splice: our head, the other seed's tail.
                let cut = rng.below(len + 1);
                let from = rng.below(other.len());
                data.truncate(cut);
                data.extend_from_slice(&other[from..]);
            }
            5 if len > 0 => data.truncate(rng.below(len)),
            _ if len > 0 => {
                let i = rng.below(len);
                data[i] = INTERESTING[rng.below(INTERESTING.len())];
            }
            _ => data.push(rng.next_u64() as u8),
        }
    }
}

/// Runs `run` over the seeds of `target`, then `n` mutations of them.
fn smoke(target: &str, n: usize, run: fn(&[u8])) {
    quiet_caught_panics();
    let seeds = seeds(target);
    let mut rng = SplitMix64::new(target.len() as u64 * 1_000_003);
    let inputs = seeds.iter().cloned().chain((0..n).map(|i| {
        let mut d = seeds[i % seeds.len()].clone();
        let other = &seeds[rng.below(seeds.len())];
        mutate(&mut rng, &mut d, other);
        d
    }));
    for (i, data) in inputs.enumerate() {
        IN_TARGET.with(|c| c.set(true));
        let r = std::panic::catch_unwind(|| run(&data));
        IN_TARGET.with(|c| c.set(false));
        if let Err(payload) = r {
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            let path = std::env::temp_dir().join(format!("fuzz-smoke-{target}-{i}"));
            std::fs::write(&path, &data).unwrap();
            panic!(
                "{target}: input {i} failed: {msg}\nsaved to {} (reproduce: \
                 cargo +nightly fuzz run {target} <that file>)",
                path.display()
            );
        }
    }
}

#[test]
fn safetensors() {
    smoke("safetensors", 20_000, parsers_driver::safetensors);
}

#[test]
fn config_json() {
    smoke("config_json", 20_000, parsers_driver::config_json);
}

#[test]
fn tokenizer_json() {
    smoke("tokenizer_json", 2000, parsers_driver::tokenizer_json);
}

#[test]
fn tokenizer_text() {
    smoke("tokenizer_text", 1000, parsers_driver::tokenizer_text);
}

#[test]
fn stream_detok() {
    smoke("stream_detok", 10_000, parsers_driver::stream_detok);
}

#[test]
fn chat_template() {
    smoke("chat_template", 5000, parsers_driver::chat_template);
}

#[test]
fn state_file() {
    // The committed seeds are the files the current format writes
    // (NANOINFER_BLESS=1 rewrites them after a format change).
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/state_file");
    for (name, bytes) in parsers_driver::state_file_seeds() {
        let path = dir.join(name);
        if std::env::var_os("NANOINFER_BLESS").is_some() {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &bytes).unwrap();
        }
        let committed = std::fs::read(&path).unwrap_or_default();
        assert!(
            committed == bytes,
            "{} is stale: run with NANOINFER_BLESS=1",
            path.display()
        );
    }
    smoke("state_file", 20_000, parsers_driver::state_file);
}
