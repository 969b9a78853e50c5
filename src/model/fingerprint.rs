//! A model's identity for saved state: two directories hold the same model
//! when their architecture, numerics settings and weights agree.
//!
//! Hashing every weight byte would read a whole 8B checkpoint (16 GB) at
//! every load, and size + mtime changes with every copy of a directory. So
//! the fingerprint covers every tensor's name, dtype and shape, and three
//! 64-byte windows of its data (start, middle, end): a fine-tune changes the
//! weights of the layers it touches everywhere, so two checkpoints of one
//! architecture differ in the windows, while a copy of a directory keeps its
//! fingerprint. It is not a security boundary: a state file is parsed as
//! hostile input whatever its fingerprint says.

use super::config::ModelConfig;
use super::safetensors::WeightFiles;
use xxhash_rust::xxh3::Xxh3;

/// Bytes of each sampled window of a tensor's data.
const WINDOW: usize = 64;

/// The fingerprint of the model in `weights` with `config`, loaded with
/// linear layers of `weight_dtype` (a model quantized at load computes
/// something else than the same checkpoint unquantized).
pub fn model_fingerprint(config: &ModelConfig, weights: &WeightFiles, weight_dtype: &str) -> u128 {
    let mut h = Xxh3::new();
    let text = |h: &mut Xxh3, s: &str| {
        h.update(&(s.len() as u64).to_le_bytes());
        h.update(s.as_bytes());
    };
    text(&mut h, "nanoinfer model fingerprint v1");
    text(&mut h, config.architecture.hf_name());
    text(&mut h, weight_dtype);
    // The numerics config.json sets besides the tensor shapes.
    text(
        &mut h,
        &format!(
        "rms_norm_eps={} rope_theta={} rope_scaling={:?} vocab={} heads={} kv_heads={} head_dim={}",
        config.rms_norm_eps.to_bits(),
        config.rope_theta.to_bits(),
        config.rope_scaling,
        config.vocab_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim
    ),
    );
    for name in weights.tensor_names() {
        let Some(info) = weights.info(name) else {
            continue;
        };
        text(&mut h, name);
        text(&mut h, &format!("{} {:?}", info.dtype, info.shape));
        if let Some(view) = weights.get(name) {
            let bytes = view.bytes;
            let mid = bytes.len() / 2;
            for start in [
                0,
                mid.saturating_sub(WINDOW / 2),
                bytes.len().saturating_sub(WINDOW),
            ] {
                let end = (start + WINDOW).min(bytes.len());
                h.update(&bytes[start..end]);
            }
        }
    }
    h.digest128()
}

/// `fingerprint` as 32 hex digits, for messages.
pub fn fingerprint_hex(fingerprint: u128) -> String {
    format!("{fingerprint:032x}")
}
