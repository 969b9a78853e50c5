//! Offline quantization (route A's writer): reads a dense F32/F16/BF16 model
//! directory and writes a quantized copy — the linear layers' weights in the
//! method's format, embeddings, norms and biases unchanged, the LM head as
//! the method's policy says (a tied head is written as its own
//! `lm_head.weight`), config and tokenizer files copied.

use super::config::ModelConfig;
use super::quant::{method_from_metadata, ExportTensor, QuantMethod, QuantMode};
use super::safetensors::WeightFiles;
use crate::tensor::DType;
use crate::{bail_arg, Error, Result};
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
}

const EMBEDDING: &str = "model.embed_tokens.weight";
const LM_HEAD: &str = "lm_head.weight";

/// Writes `out_dir/model.safetensors` (plus copies of the other files of
/// `model_dir`) quantized with `mode`.
pub fn quantize_checkpoint(
    model_dir: &Path,
    out_dir: &Path,
    mode: QuantMode,
) -> Result<QuantizeReport> {
    let Some(method) = mode.method()? else {
        bail_arg!("choose a quantization method (q8_0, awq, gptq)");
    };
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
            q.name()
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
    report.files_copied = copy_side_files(model_dir, out_dir)?;
    if let Some(qc) = method.quantization_config() {
        write_quantization_config(model_dir, out_dir, qc)?;
    }

    let mut names: Vec<&str> = files.tensor_names().collect();
    names.sort_unstable();
    let mut out: Vec<ExportTensor> = Vec::with_capacity(names.len() + 64);
    for name in names {
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

/// `out_dir/config.json` = the model's config.json with `quantization_config` set.
fn write_quantization_config(
    model_dir: &Path,
    out_dir: &Path,
    qc: serde_json::Value,
) -> Result<()> {
    let src = model_dir.join("config.json");
    let text = std::fs::read_to_string(&src).map_err(|e| Error::io(src.display(), e))?;
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
