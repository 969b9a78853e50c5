//! config.json text. Parsing either fails or yields a config whose derived
//! quantities are usable without panicking (RoPE frequencies, sizes).
#![no_main]

use libfuzzer_sys::fuzz_target;
use nanoinfer::model::ModelConfig;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(c) = ModelConfig::from_json(text) else {
        return;
    };
    assert!(c.num_heads > 0 && c.num_kv_heads > 0 && c.head_dim > 0);
    assert!(c.num_heads % c.num_kv_heads == 0, "{c:?}");
    assert!(c.vocab_size > 0 && c.hidden_size > 0 && c.num_layers > 0);
    // Bounded so that a huge but valid head_dim does not exhaust memory here.
    if c.head_dim <= 1 << 16 {
        let f = c.rope_inv_freq();
        assert_eq!(f.len(), c.head_dim / 2);
    }
    std::hint::black_box(format!("{c:?}"));
});
