//! The `session_ops`, `request_params` and `constraints` fuzz targets' logic
//! (fuzz/fuzz_targets/engine_driver.rs) over seeded random inputs, so that
//! it runs on stable in CI; `scripts/fuzz.sh` runs the same code under
//! libFuzzer with coverage guidance.

#[path = "../fuzz/fuzz_targets/engine_driver.rs"]
mod engine_driver;

use std::path::Path;

/// SplitMix64 bytes: `n` inputs of lengths in `lo..hi`.
fn inputs(seed: u64, n: usize, lo: usize, hi: usize) -> Vec<Vec<u8>> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    (0..n)
        .map(|_| {
            let len = lo + (next() % (hi - lo) as u64) as usize;
            (0..len).map(|_| next() as u8).collect()
        })
        .collect()
}

fn model() -> std::sync::Arc<nanoinfer::engine::Model> {
    engine_driver::load_model(Path::new(env!("CARGO_MANIFEST_DIR")))
}

#[test]
fn session_ops_over_random_inputs() {
    let m = model();
    for (i, data) in inputs(1, 300, 0, 600).iter().enumerate() {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            engine_driver::session_ops(&m, data)
        }));
        assert!(r.is_ok(), "input {i} failed: {data:?}");
    }
}

/// Runs `target` over `n` random inputs (stream `stream`, up to `max_len`
/// bytes); fails on a panic and unless both validation outcomes occur
/// (more than 5 % accepted and more than 5 % refused).
fn both_sides(what: &str, stream: u64, n: usize, max_len: usize, target: impl Fn(&[u8]) -> bool) {
    let mut accepted = 0;
    for (i, data) in inputs(stream, n, 0, max_len).iter().enumerate() {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| target(data)));
        accepted += *r
            .as_ref()
            .unwrap_or_else(|_| panic!("{what}: input {i} failed: {data:?}"))
            as usize;
    }
    assert!(
        accepted > n / 20 && accepted < n - n / 20,
        "{what}: {accepted} of {n} accepted"
    );
    eprintln!("{what}: {accepted} of {n} random inputs accepted");
}

#[test]
fn request_params_over_random_inputs() {
    let m = model();
    both_sides("request_params", 2, 3000, 300, |data| {
        engine_driver::request_params(&m, data)
    });
}

#[test]
fn constraints_over_random_inputs() {
    let m = engine_driver::load_model_with_tokenizer(Path::new(env!("CARGO_MANIFEST_DIR")));
    both_sides("constraints", 3, 600, 80, |data| {
        engine_driver::constraints(&m, data)
    });
}

/// The committed fuzz seeds (and any regression inputs added there) pass.
#[test]
fn committed_seeds_pass() {
    let m = model();
    let tokenized = engine_driver::load_model_with_tokenizer(Path::new(env!("CARGO_MANIFEST_DIR")));
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds");
    for (target, m, run) in [
        (
            "session_ops",
            &m,
            (|m, d| engine_driver::session_ops(m, d)) as fn(&_, &[u8]),
        ),
        ("request_params", &m, |m, d| {
            engine_driver::request_params(m, d);
        }),
        ("constraints", &tokenized, |m, d| {
            engine_driver::constraints(m, d);
        }),
    ] {
        let dir = root.join(target);
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            run(m, &std::fs::read(&path).unwrap());
            n += 1;
        }
        assert!(n > 0, "no seeds in {}", dir.display());
    }
}
