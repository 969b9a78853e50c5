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

#[test]
fn request_params_over_random_inputs() {
    let m = model();
    let n = 3000;
    let mut accepted = 0;
    for (i, data) in inputs(2, n, 0, 300).iter().enumerate() {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            engine_driver::request_params(&m, data)
        }));
        accepted += *r
            .as_ref()
            .unwrap_or_else(|_| panic!("input {i} failed: {data:?}")) as usize;
    }
    // Both sides of validation are exercised.
    assert!(
        accepted > n / 20 && accepted < n - n / 20,
        "{accepted} of {n} accepted"
    );
    eprintln!("request_params: {accepted} of {n} random requests accepted");
}

#[test]
fn constraints_over_random_inputs() {
    let m = engine_driver::load_model_with_tokenizer(Path::new(env!("CARGO_MANIFEST_DIR")));
    let n = 600;
    let mut accepted = 0;
    for (i, data) in inputs(3, n, 0, 80).iter().enumerate() {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            engine_driver::constraints(&m, data)
        }));
        accepted += *r
            .as_ref()
            .unwrap_or_else(|_| panic!("input {i} failed: {data:?}")) as usize;
    }
    // Both refusals and accepted constraints are exercised.
    assert!(
        accepted > n / 20 && accepted < n - n / 20,
        "{accepted} of {n} accepted"
    );
    eprintln!("constraints: {accepted} of {n} random constraints accepted");
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
