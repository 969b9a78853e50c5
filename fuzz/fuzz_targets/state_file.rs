//! See `parsers_driver::state_file` (the same logic runs in the normal test
//! suite over the seeds and mutations of them: tests/fuzz_seeds_smoke.rs).
#![no_main]

mod parsers_driver;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    parsers_driver::state_file(data);
});
