//! A sharded model directory: `model.safetensors.index.json`, the shards'
//! headers (data synthesized) and optionally a config. See
//! `index_driver` (the same logic runs in the normal test suite:
//! tests/safetensors_index_fuzz_logic.rs).
#![no_main]

mod common;
mod index_driver;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = common::scratch_dir().join("index");
    index_driver::check(&common::repo_root(), &dir, data);
});
