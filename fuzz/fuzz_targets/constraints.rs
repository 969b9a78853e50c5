//! See `engine_driver::constraints` (the same logic runs in the normal test suite:
//! tests/engine_fuzz_logic.rs).
#![no_main]

mod engine_driver;

use libfuzzer_sys::fuzz_target;
use std::sync::{Arc, OnceLock};

fuzz_target!(|data: &[u8]| {
    static MODEL: OnceLock<Arc<nanoinfer::engine::Model>> = OnceLock::new();
    let model = MODEL.get_or_init(|| {
        engine_driver::load_model_with_tokenizer(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".."),
        )
    });
    engine_driver::constraints(model, data);
});
