//! A loaded model: decoder weights, tokenizer (when the directory has one),
//! generation settings and the thread pool its kernels run on. Shared by
//! sessions through `Arc`.

use crate::backend::cpu::ThreadPool;
use crate::backend::Device;
use crate::model::config::token_ids;
use crate::model::fingerprint::model_fingerprint;
use crate::model::{CpuDecoder, Decoder, DeviceDecoder, ModelConfig, QuantMode, WeightDType};
use crate::tokenizer::Tokenizer;
use crate::{untrusted_file, Error, Result};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// Reports load progress in [0, 1]; returning false cancels the load.
pub type ProgressFn<'a> = &'a mut dyn FnMut(f32) -> bool;

#[derive(Debug, Clone)]
pub struct ModelParams {
    pub dtype: WeightDType,
    /// Threads for the kernels; 0 = all available cores. At most
    /// `limits::max_threads()` (4 × the available cores, 16 to 1024).
    pub threads: usize,
    /// Quantize dense weights at load (a quantized checkpoint loads quantized regardless).
    pub quant: QuantMode,
    pub device: Device,
}

impl Default for ModelParams {
    fn default() -> Self {
        ModelParams {
            dtype: WeightDType::Auto,
            threads: 0,
            quant: QuantMode::None,
            device: Device::Cpu,
        }
    }
}

pub struct Model {
    pub decoder: Arc<dyn DeviceDecoder>,
    pub tokenizer: Option<Tokenizer>,
    /// Token ids that end generation (generation_config.json, else config.json, else tokenizer).
    pub eos_token_ids: Vec<u32>,
    /// Ids that may be generated: the model's vocabulary, cut to the ids
    /// the tokenizer has a token for (checkpoints pad `vocab_size` past the
    /// tokenizer; those rows are never sampled).
    pub sample_vocab: usize,
    /// Identity of the loaded model for saved state (see `model::fingerprint`).
    pub fingerprint: u128,
    pub load_ms: f64,
}

impl Model {
    pub fn load(
        dir: &Path,
        params: &ModelParams,
        progress: Option<ProgressFn<'_>>,
    ) -> Result<Model> {
        let start = Instant::now();
        let mut progress = progress;
        let mut report = |f: f32| -> Result<()> {
            let keep_going = match progress.as_mut() {
                Some(cb) => cb(f),
                None => true,
            };
            if keep_going {
                Ok(())
            } else {
                Err(Error::new(
                    crate::ErrorKind::Cancelled,
                    "model load cancelled by the progress callback",
                ))
            }
        };
        if !dir.is_dir() {
            return Err(Error::new(
                crate::ErrorKind::Io,
                format!("model directory {} does not exist", dir.display()),
            ));
        }
        report(0.0)?;
        let config = ModelConfig::from_dir(dir)?;
        let weights = crate::model::loader::open_weights(dir)?;
        report(0.1)?;
        let decoder: Arc<dyn DeviceDecoder> = match params.device {
            Device::Cpu => {
                // Threads first: a bad count fails before the weights load.
                let pool = ThreadPool::try_new(crate::limits::resolve_threads(params.threads)?)?;
                let decoder = Decoder::load(config, &weights, params.dtype, params.quant)?;
                Arc::new(CpuDecoder { decoder, pool })
            }
            Device::Cuda(ordinal) => {
                crate::model::cuda::load(ordinal, config, &weights, params.dtype, params.quant)?
            }
        };
        let fingerprint =
            model_fingerprint(decoder.config(), &weights, decoder.weight_dtype_name());
        weights.finish_loading();
        report(0.9)?;
        let tokenizer = if dir.join("tokenizer.json").exists() {
            Some(Tokenizer::from_dir(dir)?)
        } else {
            None
        };
        let vocab = decoder.config().vocab_size;
        let sample_vocab = match &tokenizer {
            Some(t) => tokenizer_coverage(dir, t, vocab)?,
            None => vocab,
        };
        let eos_token_ids = eos_ids(dir, decoder.config(), tokenizer.as_ref())?;
        report(1.0)?;
        Ok(Model {
            decoder,
            tokenizer,
            eos_token_ids,
            sample_vocab,
            fingerprint,
            load_ms: start.elapsed().as_secs_f64() * 1e3,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        self.decoder.config()
    }

    /// Host threads the kernels run on.
    pub fn threads(&self) -> usize {
        self.decoder.threads()
    }

    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer.as_ref().ok_or_else(|| {
            Error::invalid_arg(
                "this model directory has no tokenizer.json; pass token ids instead of text",
            )
        })
    }
}

/// Padding past the tokenizer that is accepted (and masked out of
/// sampling): released checkpoints pad by under 3% (Qwen2: 151936 rows,
/// 151665 tokens; DeepSeek: 102400, 100015). A tokenizer that covers
/// much less belongs to another model.
const MAX_PADDED_FRACTION: usize = 8;

/// The ids the model may generate, `vocab` cut to the tokenizer's coverage;
/// refuses a tokenizer that covers far less than the model, or whose
/// special ids index past the embedding.
fn tokenizer_coverage(dir: &Path, tok: &Tokenizer, vocab: usize) -> Result<usize> {
    let file = dir.join("tokenizer.json");
    let covered = tok.covered_ids().min(vocab);
    if vocab - covered > vocab / MAX_PADDED_FRACTION {
        return Err(Error::invalid_model(format!(
            "{}: the tokenizer has tokens for ids 0..{covered} (vocabulary of {} ids) but \
             config.json's vocab_size is {vocab}: it does not belong to this model",
            file.display(),
            tok.vocab_size()
        )));
    }
    for (name, id) in [
        ("bos_token", tok.bos_token_id()),
        ("eos_token", tok.eos_token_id()),
    ] {
        if let Some(id) = id.filter(|&id| id as usize >= vocab) {
            return Err(Error::invalid_model(format!(
                "{}: {name} has id {id}, outside the model's vocabulary (config.json vocab_size {vocab})",
                file.display()
            )));
        }
    }
    Ok(covered)
}

/// EOS ids from generation_config.json, else config.json (checked against
/// the vocabulary with the rest of it), else the tokenizer's.
fn eos_ids(dir: &Path, config: &ModelConfig, tokenizer: Option<&Tokenizer>) -> Result<Vec<u32>> {
    let path = dir.join("generation_config.json");
    // An unreadable generation config only loses its EOS ids, as a missing one does.
    let from_gen = untrusted_file::read_text(&path, untrusted_file::MAX_CONFIG_BYTES)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .map(|v| token_ids(v.get("eos_token_id")))
        .unwrap_or_default();
    let vocab = config.vocab_size;
    if let Some(bad) = from_gen.iter().find(|&&id| id as usize >= vocab) {
        return Err(Error::invalid_model(format!(
            "{}: `eos_token_id` {bad} is outside the vocabulary (config.json vocab_size {vocab})",
            path.display()
        )));
    }
    if !from_gen.is_empty() {
        return Ok(from_gen);
    }
    if !config.eos_token_ids.is_empty() {
        return Ok(config.eos_token_ids.clone());
    }
    Ok(tokenizer
        .and_then(|t| t.eos_token_id())
        .into_iter()
        .collect())
}
