//! `config.json` of a HuggingFace causal LM, validated into `ModelConfig`.

use super::arch::{self, Family, LayoutSettings};
use super::quant::StoredQuant;
use crate::{bail_model, untrusted_file, Error, Result};
use serde_json::Value;
use std::path::Path;

/// A model's architecture family (`model::arch`).
#[derive(Debug, Clone, Copy)]
pub struct Architecture(&'static Family);

impl Architecture {
    pub fn hf_name(self) -> &'static str {
        self.0.hf_name
    }
}

impl PartialEq for Architecture {
    fn eq(&self, other: &Self) -> bool {
        self.hf_name() == other.hf_name()
    }
}

impl Eq for Architecture {}

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    Linear {
        factor: f32,
    },
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: f32,
    },
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v projections (the family's layout, `model::arch`).
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE.
    pub qk_norm: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// A quantized checkpoint's format (int4, FP8), from `quantization_config`.
    pub quantization: Option<StoredQuant>,
}

/// Bounds on config.json's sizes, far above any released model (the widest
/// have hidden_size 16k-25k, 128 heads of 256, 160 layers, 256k tokens) and
/// far below what overflows the arithmetic that sizes buffers from them.
pub const MAX_WIDTH: usize = 1 << 20;
pub const MAX_HEADS: usize = 1 << 14;
pub const MAX_HEAD_DIM: usize = 1 << 14;
pub const MAX_LAYERS: usize = 1 << 14;
/// Token ids are 32-bit.
pub const MAX_VOCAB: usize = 1 << 28;
/// Nothing is allocated per position of the context (the KV capacity is the
/// session's), so only the arithmetic on positions needs a bound.
pub const MAX_POSITIONS: usize = 1 << 48;
/// 4.4 T weights: more than any host's memory at one byte each.
pub const MAX_PARAMETERS: usize = 1 << 42;

fn get_usize(v: &Value, key: &str) -> Result<Option<usize>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| {
                Error::invalid_model(format!(
                    "config.json: `{key}` must be a non-negative integer, got {x}"
                ))
            }),
    }
}

fn req_usize(v: &Value, key: &str) -> Result<usize> {
    match get_usize(v, key)? {
        Some(0) => bail_model!("config.json: `{key}` must be positive"),
        Some(n) => Ok(n),
        None => bail_model!("config.json: missing `{key}`"),
    }
}

fn get_f32(v: &Value, key: &str) -> Result<Option<f32>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => match x.as_f64() {
            // Finite as f64 but past f32's range (1e300) would become infinity.
            Some(f) if (f as f32).is_finite() => Ok(Some(f as f32)),
            _ => bail_model!("config.json: `{key}` must be a finite number, got {x}"),
        },
    }
}

fn get_bool(v: &Value, key: &str) -> Result<Option<bool>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(x) => bail_model!("config.json: `{key}` must be true or false, got {x}"),
    }
}

/// Token ids given as an integer or a list of integers.
pub fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        // Ids past u32 are dropped, not wrapped onto real tokens.
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .map(|x| vec![x])
            .unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect(),
        _ => vec![],
    }
}

fn parse_rope_scaling(v: Option<&Value>) -> Result<RopeScaling> {
    let Some(obj) = v.filter(|v| !v.is_null()) else {
        return Ok(RopeScaling::None);
    };
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let factor = || -> Result<f32> {
        match get_f32(obj, "factor")? {
            Some(f) if f > 0.0 => Ok(f),
            _ => bail_model!("config.json: rope scaling `{kind}` needs a positive `factor`"),
        }
    };
    Ok(match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: factor()? },
        "llama3" => {
            // Each is a divisor of the scaled wavelengths: zero or negative
            // turns the frequencies into NaN or flips their sign.
            let need = |k: &str| -> Result<f32> {
                match get_f32(obj, k)? {
                    Some(f) if f > 0.0 => Ok(f),
                    Some(f) => bail_model!("config.json: llama3 rope scaling `{k}` must be positive, got {f}"),
                    None => bail_model!("config.json: llama3 rope scaling needs `{k}`"),
                }
            };
            let (low, high) = (need("low_freq_factor")?, need("high_freq_factor")?);
            if high <= low {
                bail_model!("config.json: llama3 rope scaling needs high_freq_factor > low_freq_factor");
            }
            RopeScaling::Llama3 {
                factor: factor()?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position: need("original_max_position_embeddings")?,
            }
        }
        other => bail_model!("config.json: rope scaling type `{other}` is not supported (supported: default, linear, llama3)"),
    })
}

impl ModelConfig {
    pub fn from_dir(dir: &Path) -> Result<ModelConfig> {
        let path = dir.join("config.json");
        let text = untrusted_file::read_text(&path, untrusted_file::MAX_CONFIG_BYTES)?;
        Self::from_json(&text)
    }

    pub fn from_json(text: &str) -> Result<ModelConfig> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| Error::invalid_model(format!("config.json is not valid JSON: {e}")))?;
        if !v.is_object() {
            bail_model!("config.json must be a JSON object");
        }
        let arch_name = v
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .ok_or_else(|| Error::invalid_model("config.json: missing `architectures`"))?;
        let Some(family) = arch::family(arch_name) else {
            return Err(Error::unsupported(format!(
                "architecture `{arch_name}` is not supported (supported: {})",
                arch::supported()
            )));
        };
        if let Some(act) = v.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                return Err(Error::unsupported(format!(
                    "hidden_act `{act}` is not supported (supported: silu)"
                )));
            }
        }
        if get_bool(&v, "mlp_bias")? == Some(true) {
            return Err(Error::unsupported("mlp_bias = true is not supported"));
        }
        if get_bool(&v, "use_sliding_window")? == Some(true) {
            return Err(Error::unsupported(
                "use_sliding_window = true is not supported",
            ));
        }
        let quantization = match v.get("quantization_config").filter(|q| !q.is_null()) {
            Some(q) => Some(StoredQuant::from_config(q)?),
            None => None,
        };
        let hidden_size = req_usize(&v, "hidden_size")?;
        let num_heads = req_usize(&v, "num_attention_heads")?;
        let num_kv_heads = get_usize(&v, "num_key_value_heads")?.unwrap_or(num_heads);
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            bail_model!("config.json: num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})");
        }
        let head_dim = match get_usize(&v, "head_dim")? {
            Some(d) => d,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => bail_model!("config.json: hidden_size {hidden_size} is not divisible by num_attention_heads {num_heads}"),
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            bail_model!("config.json: head_dim must be even and positive, got {head_dim}");
        }
        // transformers 5 moves rope settings into `rope_parameters`.
        let rope_params = v.get("rope_parameters").filter(|p| p.is_object());
        let rope_theta = match rope_params {
            Some(p) => get_f32(p, "rope_theta")?,
            None => None,
        }
        .or(get_f32(&v, "rope_theta")?)
        .unwrap_or(10000.0);
        if rope_theta <= 0.0 {
            bail_model!("config.json: rope_theta must be positive, got {rope_theta}");
        }
        let rope_scaling = parse_rope_scaling(rope_params.or(v.get("rope_scaling")))?;
        let layout = (family.layout)(LayoutSettings {
            attention_bias: get_bool(&v, "attention_bias")?.unwrap_or(false),
        });
        let eps = get_f32(&v, "rms_norm_eps")?.unwrap_or(1e-6);
        // RMSNorm divides by sqrt(mean(x²) + eps): zero makes an all-zero
        // row NaN, negative makes small rows NaN.
        if eps <= 0.0 {
            bail_model!("config.json: rms_norm_eps must be positive, got {eps}");
        }
        let config = ModelConfig {
            architecture: Architecture(family),
            vocab_size: req_usize(&v, "vocab_size")?,
            hidden_size,
            intermediate_size: req_usize(&v, "intermediate_size")?,
            num_layers: req_usize(&v, "num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings: get_usize(&v, "max_position_embeddings")?.unwrap_or(2048),
            tie_word_embeddings: get_bool(&v, "tie_word_embeddings")?.unwrap_or(false),
            qkv_bias: layout.qkv_bias,
            o_bias: layout.o_bias,
            qk_norm: layout.qk_norm,
            bos_token_id: token_ids(v.get("bos_token_id")).first().copied(),
            eos_token_ids: token_ids(v.get("eos_token_id")),
            quantization,
        };
        config.check_sizes()?;
        config.check_token_ids()?;
        // Extreme but finite settings (a subnormal rope_theta) still
        // overflow the frequencies.
        if let Some(f) = config
            .rope_inv_freq()
            .iter()
            .find(|f| !f.is_finite() || **f <= 0.0)
        {
            bail_model!(
                "config.json: rope_theta {rope_theta} and rope scaling {:?} give a rotary frequency of {f}",
                config.rope_scaling
            );
        }
        Ok(config)
    }

    /// Refuses sizes no machine could hold before anything is allocated by
    /// them: each within its bound, and the parameter count computed
    /// without overflow.
    fn check_sizes(&self) -> Result<()> {
        let bounds = [
            ("hidden_size", self.hidden_size, MAX_WIDTH),
            ("intermediate_size", self.intermediate_size, MAX_WIDTH),
            ("num_attention_heads", self.num_heads, MAX_HEADS),
            ("num_key_value_heads", self.num_kv_heads, MAX_HEADS),
            ("head_dim", self.head_dim, MAX_HEAD_DIM),
            ("num_hidden_layers", self.num_layers, MAX_LAYERS),
            ("vocab_size", self.vocab_size, MAX_VOCAB),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                MAX_POSITIONS,
            ),
        ];
        for (key, value, max) in bounds {
            if value > max {
                bail_model!("config.json: `{key}` is {value}, above the limit of {max}");
            }
        }
        if self.max_position_embeddings == 0 {
            bail_model!("config.json: `max_position_embeddings` must be positive");
        }
        match self.parameter_count() {
            Some(n) if n <= MAX_PARAMETERS => Ok(()),
            n => bail_model!(
                "config.json: hidden_size {}, intermediate_size {}, {} heads of head_dim {}, \
                 {} layers and vocab_size {} make {} parameters, above the limit of {MAX_PARAMETERS}",
                self.hidden_size,
                self.intermediate_size,
                self.num_heads,
                self.head_dim,
                self.num_layers,
                self.vocab_size,
                n.map_or("more than 2^64".to_string(), |n| n.to_string())
            ),
        }
    }

    /// Weights the configuration implies (projections and embedding tables;
    /// norms and biases are negligible), `None` on overflow.
    pub fn parameter_count(&self) -> Option<usize> {
        let d = self.hidden_size;
        let nq = self.num_heads.checked_mul(self.head_dim)?;
        let nkv = self.num_kv_heads.checked_mul(self.head_dim)?;
        let attn = nq.checked_mul(2)?.checked_add(nkv.checked_mul(2)?)?;
        let mlp = self.intermediate_size.checked_mul(3)?;
        let per_layer = d.checked_mul(attn.checked_add(mlp)?)?;
        let tables = if self.tie_word_embeddings { 1 } else { 2 };
        let embed = self.vocab_size.checked_mul(d)?.checked_mul(tables)?;
        per_layer.checked_mul(self.num_layers)?.checked_add(embed)
    }

    /// Special ids that name no row of the embedding would index past it.
    fn check_token_ids(&self) -> Result<()> {
        let vocab = self.vocab_size;
        let ids = self.bos_token_id.iter().map(|&id| ("bos_token_id", id));
        let ids = ids.chain(self.eos_token_ids.iter().map(|&id| ("eos_token_id", id)));
        for (key, id) in ids {
            if id as usize >= vocab {
                bail_model!(
                    "config.json: `{key}` {id} is outside the vocabulary (vocab_size {vocab})"
                );
            }
        }
        Ok(())
    }

    /// Inverse frequencies of the rotary embedding, scaled as configured
    /// (transformers' `_compute_default_rope_parameters` / `_compute_llama3_parameters`).
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let base = self.rope_theta as f64;
        let inv: Vec<f64> = (0..d / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f64 / d as f64))
            .collect();
        match self.rope_scaling {
            RopeScaling::None => inv.iter().map(|&f| f as f32).collect(),
            RopeScaling::Linear { factor } => {
                inv.iter().map(|&f| (f / factor as f64) as f32).collect()
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                let (factor, low, high, old) = (
                    factor as f64,
                    low_freq_factor as f64,
                    high_freq_factor as f64,
                    original_max_position as f64,
                );
                let low_wavelen = old / low;
                let high_wavelen = old / high;
                inv.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        let scaled = if wavelen > low_wavelen { f / factor } else { f };
                        let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                        if medium {
                            let smooth = (old / wavelen - low) / (high - low);
                            ((1.0 - smooth) * scaled / factor + smooth * scaled) as f32
                        } else {
                            scaled as f32
                        }
                    })
                    .collect()
            }
        }
    }
}

impl ModelConfig {
    /// The geometry the backends compute with.
    pub fn dims(&self) -> crate::backend::DecoderDims {
        crate::backend::DecoderDims {
            hidden: self.hidden_size,
            heads: self.num_heads,
            kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            intermediate: self.intermediate_size,
            vocab: self.vocab_size,
            layers: self.num_layers,
            rms_norm_eps: self.rms_norm_eps,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOL: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":576,"intermediate_size":1536,
        "num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,"vocab_size":49152,
        "rms_norm_eps":1e-5,"rope_theta":100000.0,"tie_word_embeddings":true,"eos_token_id":2,"bos_token_id":1,
        "hidden_act":"silu","max_position_embeddings":8192}"#;

    #[test]
    fn parses_llama() {
        let c = ModelConfig::from_json(SMOL).unwrap();
        assert_eq!(c.architecture.hf_name(), "LlamaForCausalLM");
        assert_eq!((c.head_dim, c.num_kv_heads), (64, 3));
        assert!(c.tie_word_embeddings && !c.qkv_bias && !c.qk_norm);
        assert_eq!(c.eos_token_ids, vec![2]);
    }

    #[test]
    fn rejects_unsupported_architecture_listing_supported() {
        let e = ModelConfig::from_json(&SMOL.replace("LlamaForCausalLM", "GPT2LMHeadModel"))
            .unwrap_err();
        assert!(
            e.message.contains("GPT2LMHeadModel") && e.message.contains("Qwen3ForCausalLM"),
            "{e}"
        );
    }

    #[test]
    fn rejects_bad_values() {
        let e = ModelConfig::from_json(
            &SMOL.replace("\"num_key_value_heads\":3", "\"num_key_value_heads\":4"),
        )
        .unwrap_err();
        assert!(e.message.contains("num_key_value_heads"), "{e}");
        let e = ModelConfig::from_json(&SMOL.replace("\"hidden_size\":576,", "")).unwrap_err();
        assert!(e.message.contains("hidden_size"), "{e}");
        let e = ModelConfig::from_json(&SMOL.replace("silu", "gelu")).unwrap_err();
        assert!(e.message.contains("gelu"), "{e}");
        let e = ModelConfig::from_json(&SMOL.replace("100000.0", "1e300")).unwrap_err();
        assert!(e.message.contains("rope_theta"), "{e}");
        let c = ModelConfig::from_json(
            &SMOL.replace("\"eos_token_id\":2", "\"eos_token_id\":[4294967298,2]"),
        )
        .unwrap();
        assert_eq!(
            c.eos_token_ids,
            vec![2],
            "an id past u32 must not wrap to 2"
        );
    }

    #[test]
    fn rejects_values_that_make_garbage() {
        let cases = [
            (
                "\"rms_norm_eps\":1e-5",
                "\"rms_norm_eps\":0",
                "rms_norm_eps",
            ),
            (
                "\"rms_norm_eps\":1e-5",
                "\"rms_norm_eps\":-1",
                "rms_norm_eps",
            ),
            (
                "\"rms_norm_eps\":1e-5",
                "\"rms_norm_eps\":1e39",
                "rms_norm_eps",
            ),
            ("100000.0", "-5", "rope_theta"),
            ("100000.0", "1e-44", "rope_theta"),
            ("\"hidden_size\":576", "\"hidden_size\":0", "hidden_size"),
            (
                "\"hidden_size\":576",
                "\"hidden_size\":18446744073709551615",
                "hidden_size",
            ),
            (
                "\"vocab_size\":49152",
                "\"vocab_size\":4294967296",
                "vocab_size",
            ),
            ("\"vocab_size\":49152", "\"vocab_size\":0", "vocab_size"),
            (
                "\"num_hidden_layers\":30",
                "\"num_hidden_layers\":16385",
                "num_hidden_layers",
            ),
            (
                "\"num_hidden_layers\":30",
                // A later duplicate key wins.
                "\"num_hidden_layers\":10000,\"intermediate_size\":1048576",
                "parameters",
            ),
            (
                "\"max_position_embeddings\":8192",
                "\"max_position_embeddings\":0",
                "max_position_embeddings",
            ),
            (
                "\"max_position_embeddings\":8192",
                "\"max_position_embeddings\":1e20",
                "max_position_embeddings",
            ),
            (
                "\"eos_token_id\":2",
                "\"eos_token_id\":49152",
                "eos_token_id",
            ),
            (
                "\"bos_token_id\":1",
                "\"bos_token_id\":[60000]",
                "bos_token_id",
            ),
            (
                "\"num_key_value_heads\":3",
                "\"num_key_value_heads\":0",
                "num_key_value_heads",
            ),
        ];
        for (from, to, field) in cases {
            let text = SMOL.replace(from, to);
            assert_ne!(text, SMOL, "{from}");
            let e = ModelConfig::from_json(&text).unwrap_err();
            assert!(
                e.message.contains("config.json") && e.message.contains(field),
                "{to}: {e}"
            );
        }
        let scaled = |inner: &str| {
            SMOL.replace(
                "\"rope_theta\":100000.0,",
                &format!("\"rope_theta\":100000.0,\"rope_scaling\":{{{inner}}},"),
            )
        };
        for bad in [
            r#""rope_type":"linear","factor":0"#,
            r#""rope_type":"linear","factor":-2"#,
            r#""rope_type":"llama3","factor":8,"low_freq_factor":0,"high_freq_factor":4,"original_max_position_embeddings":8192"#,
            r#""rope_type":"llama3","factor":8,"low_freq_factor":1,"high_freq_factor":4,"original_max_position_embeddings":-1"#,
        ] {
            let e = ModelConfig::from_json(&scaled(bad)).unwrap_err();
            assert!(
                e.message.contains("config.json") && e.message.contains("rope"),
                "{bad}: {e}"
            );
        }
        // A long context is not refused: nothing is sized by it.
        let long = SMOL.replace("8192}", "1099511627776}");
        assert_eq!(
            ModelConfig::from_json(&long)
                .unwrap()
                .max_position_embeddings,
            1 << 40
        );
    }

    #[test]
    fn rope_parameters_of_transformers_5() {
        let text = SMOL.replace(
            "\"rope_theta\":100000.0,",
            "\"rope_parameters\":{\"rope_type\":\"llama3\",\"rope_theta\":500000.0,\"factor\":8.0,\"low_freq_factor\":1.0,\"high_freq_factor\":4.0,\"original_max_position_embeddings\":8192},",
        );
        let c = ModelConfig::from_json(&text).unwrap();
        assert_eq!(c.rope_theta, 500000.0);
        assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { .. }));
        let inv = c.rope_inv_freq();
        // Highest frequency untouched, lowest divided by the factor.
        assert!((inv[0] - 1.0).abs() < 1e-7);
        let plain = 1.0 / 500000f64.powf(62.0 / 64.0);
        assert!(((inv[31] as f64) - plain / 8.0).abs() < 1e-12);
    }
}
