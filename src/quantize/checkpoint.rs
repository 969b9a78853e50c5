//! Offline quantization (route A's writer): reads a dense F32/F16/BF16 model
//! directory and writes a quantized copy — the linear layers' weights in the
//! method's format, embeddings, norms and biases unchanged, the LM head as
//! the method's policy says (a tied head is written as its own
//! `lm_head.weight`), config and tokenizer files copied.

use super::awq::{awq_layer, AwqOptions};
use super::calib::{CalibForward, Calibration, LayerWeights, Linear};
use super::gptq::{gptq_layer, GptqOptions};
use crate::backend::cpu::ThreadPool;
use crate::model::config::ModelConfig;
use crate::model::quant::{method_from_metadata, ExportTensor, QuantMethod, QuantMode};
use crate::model::quant_int4::{Int4, Int4Format};
use crate::model::safetensors::WeightFiles;
use crate::tensor::DType;
use crate::{bail_arg, untrusted_file, Error, Result};
use std::collections::HashMap;
use std::path::Path;

/// What [`quantize_checkpoint`] did.
#[derive(Debug, Clone, Default)]
pub struct QuantizeReport {
    /// Matrices written quantized.
    pub quantized: usize,
    /// Tensors copied unchanged.
    pub kept: usize,
    /// Other files copied (config, tokenizer, ...).
    pub files_copied: usize,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// Calibration tokens the int4 quantizer used (0: round-to-nearest).
    pub calibration_tokens: usize,
}

/// How [`quantize_checkpoint_with`] quantizes.
#[derive(Debug, Clone, Default)]
pub struct QuantizeOptions {
    /// Calibration tokens: with `awq`, activation-aware scaling and
    /// clipping; with `gptq`, GPTQ. `None`: round-to-nearest.
    pub calibration: Option<Calibration>,
    pub awq: AwqOptions,
    /// GPTQ's damping and act-order (act-order needs calibration).
    pub gptq: GptqOptions,
    /// Threads of the calibrated quantizers (0: all cores).
    pub threads: usize,
}

const EMBEDDING: &str = "model.embed_tokens.weight";
const LM_HEAD: &str = "lm_head.weight";

/// Writes `out_dir/model.safetensors` (plus copies of the other files of
/// `model_dir`) quantized with `mode` by round-to-nearest.
pub fn quantize_checkpoint(
    model_dir: &Path,
    out_dir: &Path,
    mode: QuantMode,
) -> Result<QuantizeReport> {
    quantize_checkpoint_with(model_dir, out_dir, mode, &QuantizeOptions::default())
}

/// [`quantize_checkpoint`] with options: calibrated AWQ / GPTQ.
pub fn quantize_checkpoint_with(
    model_dir: &Path,
    out_dir: &Path,
    mode: QuantMode,
    opts: &QuantizeOptions,
) -> Result<QuantizeReport> {
    let calibrated = match (&opts.calibration, mode) {
        (None, _) => {
            if opts.gptq.act_order {
                bail_arg!("GPTQ act-order needs calibration data");
            }
            None
        }
        (
            Some(_),
            QuantMode::Awq {
                group_size,
                lm_head,
            },
        ) => Some(Int4::awq(group_size)?.with_lm_head(lm_head)),
        (
            Some(_),
            QuantMode::Gptq {
                group_size,
                sym,
                lm_head,
            },
        ) => {
            let mut f = Int4::gptq(group_size, sym)?.with_lm_head(lm_head);
            f.format = Int4Format::Gptq {
                sym,
                desc_act: opts.gptq.act_order,
                v2: false,
            };
            Some(f)
        }
        (Some(_), _) => bail_arg!("calibration applies to the int4 methods (awq, gptq) only"),
    };
    let method: Box<dyn QuantMethod> = match calibrated {
        Some(f) => Box::new(f),
        None => match mode.method()? {
            Some(m) => m,
            None => bail_arg!("choose a quantization method (q8_0, awq, gptq)"),
        },
    };
    if method.name() == "awq" && method.quantizes_lm_head() {
        bail_arg!(
            "AWQ checkpoints keep the LM head dense (their format has no int4 head); \
             use gptq for an int4 LM head (`lm_head: true`)"
        );
    }
    let same = match (model_dir.canonicalize(), out_dir.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same {
        bail_arg!(
            "the output directory must differ from the model directory ({})",
            model_dir.display()
        );
    }
    let config = ModelConfig::from_dir(model_dir)?;
    if let Some(q) = &config.quantization {
        bail_arg!(
            "{} is already quantized ({} in config.json)",
            model_dir.display(),
            q.method().name()
        );
    }
    let files = WeightFiles::open(model_dir)?;
    if let Some(m) = method_from_metadata(files.metadata())? {
        bail_arg!(
            "{} is already quantized ({})",
            model_dir.display(),
            m.name()
        );
    }
    std::fs::create_dir_all(out_dir)
        .map_err(|e| Error::io(format!("cannot create {}", out_dir.display()), e))?;
    let mut report = QuantizeReport {
        bytes_in: files.shards().iter().map(|s| s.file_len() as u64).sum(),
        ..Default::default()
    };
    let mut replaced = match (&calibrated, &opts.calibration) {
        (Some(format), Some(calib)) => {
            report.calibration_tokens = calib.tokens();
            calibrated_tensors(&files, &config, format, calib, opts)?
        }
        _ => HashMap::new(),
    };
    report.files_copied = copy_side_files(model_dir, out_dir)?;
    if let Some(qc) = method.quantization_config() {
        write_quantization_config(model_dir, out_dir, qc)?;
    }

    let mut names: Vec<&str> = files.tensor_names().collect();
    names.sort_unstable();
    let mut out: Vec<ExportTensor> = Vec::with_capacity(names.len() + 64);
    for name in names {
        if let Some((tensors, quantized)) = replaced.remove(name) {
            out.extend(tensors);
            if quantized {
                report.quantized += 1;
            } else {
                report.kept += 1;
            }
            continue;
        }
        let view = files.get(name).expect("listed tensor exists");
        let quantize = view.shape.len() == 2
            && name.ends_with(".weight")
            && name != EMBEDDING
            && (name != LM_HEAD || method.quantizes_lm_head());
        if quantize {
            let (rows, cols) = (view.shape[0], view.shape[1]);
            out.extend(method.export(name, rows, cols, &view.to_f32()?)?);
            report.quantized += 1;
        } else {
            out.push(ExportTensor {
                name: name.to_string(),
                dtype: st_dtype(view.dtype),
                shape: view.shape.to_vec(),
                bytes: view.bytes.to_vec(),
            });
            report.kept += 1;
        }
    }
    if config.tie_word_embeddings && !files.contains(LM_HEAD) && method.quantizes_lm_head() {
        let view = files.require(EMBEDDING, &[config.vocab_size, config.hidden_size])?;
        out.extend(method.export(
            LM_HEAD,
            config.vocab_size,
            config.hidden_size,
            &view.to_f32()?,
        )?);
        report.quantized += 1;
    }

    let views = out
        .iter()
        .map(|t| {
            safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.bytes)
                .map(|v| (t.name.clone(), v))
                .map_err(|e| Error::internal(format!("tensor {}: {e}", t.name)))
        })
        .collect::<Result<Vec<_>>>()?;
    let path = out_dir.join("model.safetensors");
    safetensors::tensor::serialize_to_file(views, Some(method.metadata()), &path).map_err(|e| {
        Error::new(
            crate::ErrorKind::Io,
            format!("cannot write {}: {e}", path.display()),
        )
    })?;
    report.bytes_out = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    Ok(report)
}

/// Tensors written by the calibrated int4 quantizers, by checkpoint name:
/// `(tensors, quantized)`: every block's linears (packed), and for AWQ the
/// norms (and v biases) the scales were folded into, in F32.
fn calibrated_tensors(
    files: &WeightFiles,
    config: &ModelConfig,
    format: &Int4,
    calib: &Calibration,
    opts: &QuantizeOptions,
) -> Result<HashMap<String, (Vec<ExportTensor>, bool)>> {
    let pool = ThreadPool::try_new(crate::limits::resolve_threads(opts.threads)?)?;
    let fwd = CalibForward::new(config, &pool, calib);
    let mut h = fwd.embed(files, calib)?;
    let awq = matches!(format.format, Int4Format::Awq);
    let mut out = HashMap::new();
    for i in 0..config.num_layers {
        let mut l = LayerWeights::load(files, config, i)?;
        let quantized = if awq {
            awq_layer(&fwd, config, format, &opts.awq, &mut l, &mut h)?.0
        } else {
            gptq_layer(&fwd, config, format, &opts.gptq, &mut l, &mut h)?
        };
        for (li, q) in Linear::ALL.iter().zip(&quantized) {
            let name = li.weight_name(i);
            let tensors = format.pack(&name, q)?;
            out.insert(name, (tensors, true));
        }
        if awq {
            let p = format!("model.layers.{i}");
            let mut vectors = vec![
                ("input_layernorm.weight", &l.input_norm),
                ("post_attention_layernorm.weight", &l.post_norm),
            ];
            if let Some(b) = &l.v_bias {
                vectors.push(("self_attn.v_proj.bias", b));
            }
            for (name, v) in vectors {
                let name = format!("{p}.{name}");
                let t = ExportTensor {
                    name: name.clone(),
                    dtype: safetensors::Dtype::F32,
                    shape: vec![v.len()],
                    bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                };
                out.insert(name, (vec![t], false));
            }
        }
    }
    Ok(out)
}

/// `out_dir/config.json` = the model's config.json with `quantization_config` set.
fn write_quantization_config(
    model_dir: &Path,
    out_dir: &Path,
    qc: serde_json::Value,
) -> Result<()> {
    let src = model_dir.join("config.json");
    let text = untrusted_file::read_text(&src, untrusted_file::MAX_CONFIG_BYTES)?;
    let mut v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::invalid_model(format!("config.json is not valid JSON: {e}")))?;
    let obj = v
        .as_object_mut()
        .ok_or_else(|| Error::invalid_model("config.json must be a JSON object"))?;
    obj.insert("quantization_config".to_string(), qc);
    let dst = out_dir.join("config.json");
    let text = serde_json::to_string_pretty(&v).expect("JSON value serializes");
    std::fs::write(&dst, text + "\n").map_err(|e| Error::io(dst.display(), e))
}

fn st_dtype(d: DType) -> safetensors::Dtype {
    match d {
        DType::F32 => safetensors::Dtype::F32,
        DType::F16 => safetensors::Dtype::F16,
        DType::BF16 => safetensors::Dtype::BF16,
        DType::I8 => safetensors::Dtype::I8,
        DType::I32 => safetensors::Dtype::I32,
        DType::F8E4M3 => safetensors::Dtype::F8_E4M3,
    }
}

/// Copies the regular files of `from` other than weights (config, tokenizer,
/// generation config, chat template).
fn copy_side_files(from: &Path, to: &Path) -> Result<usize> {
    let entries = std::fs::read_dir(from)
        .map_err(|e| Error::io(format!("cannot list {}", from.display()), e))?;
    let mut n = 0;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(format!("cannot list {}", from.display()), e))?;
        let name = entry.file_name();
        let name_str = name.to_string_lossy();
        let is_weights =
            name_str.ends_with(".safetensors") || name_str.ends_with(".safetensors.index.json");
        if is_weights || !entry.path().is_file() {
            continue;
        }
        std::fs::copy(entry.path(), to.join(&name)).map_err(|e| {
            Error::io(
                format!("cannot copy {} to {}", entry.path().display(), to.display()),
                e,
            )
        })?;
        n += 1;
    }
    Ok(n)
}
