//! See `parsers_driver::tokenizer_json` (the same logic runs in the normal test
//! suite over the seeds and mutations of them: tests/fuzz_seeds_smoke.rs).
#![no_main]

mod common;
mod parsers_driver;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The library catches panics of the crates it wraps (tokenizers,
    // minijinja); let those pass libfuzzer-sys's abort-on-panic hook.
    common::allow_caught_panics();
    parsers_driver::tokenizer_json(data);
});
