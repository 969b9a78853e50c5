//! Model handles: load, inspect, free.

use super::args;
use super::boundary::{ffi_call, ffi_value};
use super::log::{emit, NI_LOG_INFO};
use super::status::ni_status;
use crate::backend::Device;
use crate::engine::{Model, ModelParams};
use crate::model::{QuantMode, WeightDType};
use crate::{bail_arg, Result};
use std::ffi::{c_char, c_void, CString};
use std::path::PathBuf;
use std::sync::Arc;

/// Compute device.
pub type ni_device = u32;
/// The CPU backend (SIMD kernels, a thread pool per model).
pub const NI_DEVICE_CPU: ni_device = 0;
/// An NVIDIA GPU (`device_index` picks it). The CUDA driver, NVRTC and
/// cuBLAS are loaded at run time: without them, or without a device,
/// `ni_model_load` fails with `NI_ERR_UNSUPPORTED` naming what is missing.
pub const NI_DEVICE_CUDA: ni_device = 1;

/// Weight data type.
pub type ni_dtype = u32;
/// Keep the checkpoint's dtype (zero-copy from the file where possible).
pub const NI_DTYPE_AUTO: ni_dtype = 0;
pub const NI_DTYPE_F32: ni_dtype = 1;
pub const NI_DTYPE_F16: ni_dtype = 2;
pub const NI_DTYPE_BF16: ni_dtype = 3;

/// Online weight quantization at load time.
pub type ni_quant = u32;
/// Keep the checkpoint's weights (a quantized checkpoint still loads quantized).
pub const NI_QUANT_NONE: ni_quant = 0;
/// Int8 weights with one f32 scale per `quant_group_size` inputs of a row
/// (the CLI's `--quant q8_0`). Embeddings and norms stay in higher precision.
pub const NI_QUANT_Q8_0: ni_quant = 1;
/// Int4 AWQ round-to-nearest (asymmetric, scale and zero per
/// `quant_group_size` inputs, default 128; the CLI's `--quant awq`). Runs on
/// the CPU and CUDA int4 kernels; the LM head and embeddings stay dense.
pub const NI_QUANT_AWQ: ni_quant = 2;
/// Int4 GPTQ-format symmetric round-to-nearest (the CLI's `--quant gptq`).
pub const NI_QUANT_GPTQ: ni_quant = 3;
/// FP8 E4M3 with one scale per 128 × 128 block (the CLI's `--quant fp8`);
/// the LM head and embeddings stay dense. The CPU computes with the
/// dequantized values; CUDA keeps the FP8 codes (decode GEMVs read them,
/// larger batches dequantize for cuBLAS).
pub const NI_QUANT_FP8: ni_quant = 4;

/// Reports load progress in [0, 1]; return false to cancel the load (which
/// then fails with `NI_ERR_CANCELLED`). Called on the loading thread, during
/// `ni_model_load` only.
pub type ni_progress_callback =
    Option<unsafe extern "C" fn(progress: f32, user_data: *mut c_void) -> bool>;

/// How to load a model. Fill with `ni_model_params_init`, then change fields.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ni_model_params {
    /// `sizeof(ni_model_params)`, set by `ni_model_params_init`.
    pub struct_size: u32,
    /// `NI_DEVICE_*`; default `NI_DEVICE_CPU`.
    pub device: ni_device,
    /// Device ordinal for GPU devices; ignored on CPU. Default 0.
    pub device_index: i32,
    /// `NI_DTYPE_*`; default `NI_DTYPE_AUTO`.
    pub dtype: ni_dtype,
    /// Threads for the CPU kernels; 0 (default) = all available cores. At
    /// most 4 × the cores available to the process (never less than 16,
    /// never more than 1024): more is `NI_ERR_INVALID_ARGUMENT`, refused
    /// before the weights load. A thread the system refuses to start is
    /// `NI_ERR_OUT_OF_MEMORY`, the threads already started being stopped.
    pub n_threads: u32,
    /// Optional progress callback; default NULL.
    pub progress: ni_progress_callback,
    /// Passed to `progress` unchanged.
    pub progress_user_data: *mut c_void,
    /// `NI_QUANT_*`: quantize the dense F32/F16/BF16 weights at load; default
    /// `NI_QUANT_NONE`. Appended after ABI 1's first release: a caller built
    /// with the older, smaller struct still loads (unquantized).
    pub quant: ni_quant,
    /// Inputs per scale: for `NI_QUANT_Q8_0` a positive multiple of 4, 0
    /// (default) = 32; for `NI_QUANT_AWQ`/`NI_QUANT_GPTQ` 32, 64 or 128, 0 =
    /// 128. Ignored for `NI_QUANT_NONE` and `NI_QUANT_FP8`.
    pub quant_group_size: u32,
    /// Whether `NI_QUANT_Q8_0` quantizes the LM head too (a tied head gets its
    /// own int8 copy); default true, as the CLI does.
    pub quant_lm_head: bool,
}

/// `sizeof(ni_model_params)` before the `quant*` fields were appended; such
/// callers are still accepted (see `args::params_versioned`).
pub(crate) const NI_MODEL_PARAMS_SIZE_V1: usize = std::mem::offset_of!(ni_model_params, quant);

impl Default for ni_model_params {
    fn default() -> Self {
        ni_model_params {
            struct_size: size_of::<ni_model_params>() as u32,
            device: NI_DEVICE_CPU,
            device_index: 0,
            dtype: NI_DTYPE_AUTO,
            n_threads: 0,
            progress: None,
            progress_user_data: std::ptr::null_mut(),
            quant: NI_QUANT_NONE,
            quant_group_size: 0,
            quant_lm_head: true,
        }
    }
}

/// A loaded model (weights, tokenizer, kernel thread pool). Immutable after
/// loading: one model may be used by any number of sessions and text calls
/// on any threads at once.
pub struct ni_model {
    pub(crate) model: Arc<Model>,
    architecture: CString,
}

/// Facts about a loaded model, filled by `ni_model_get_info`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ni_model_info {
    /// Set to `sizeof(ni_model_info)` before calling `ni_model_get_info`.
    pub struct_size: u32,
    /// HuggingFace architecture name, e.g. `"LlamaForCausalLM"`. Owned by the
    /// model; valid until `ni_model_free`.
    pub architecture: *const c_char,
    /// Rows of the embedding / logits: one past the largest token id.
    pub vocab_size: u32,
    /// Longest sequence (prompt + generated tokens) the model supports;
    /// `UINT32_MAX` when config.json gives more (every size field here
    /// saturates at `UINT32_MAX` instead of wrapping).
    pub context_length: u32,
    pub n_layers: u32,
    pub hidden_size: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    /// Beginning-of-sequence token id, or -1 when the model has none.
    pub bos_token_id: i64,
    /// Token ids that end generation. Owned by the model; valid until `ni_model_free`.
    pub eos_token_ids: *const u32,
    pub n_eos_token_ids: usize,
    /// Whether the directory had a tokenizer.json (text calls need one).
    pub has_tokenizer: bool,
    /// Whether the tokenizer has a usable chat template.
    pub has_chat_template: bool,
}

/// A size as `ni_model_info` reports it: saturated, not truncated.
fn saturate(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn weight_dtype(d: ni_dtype) -> Result<WeightDType> {
    Ok(match d {
        NI_DTYPE_AUTO => WeightDType::Auto,
        NI_DTYPE_F32 => WeightDType::F32,
        NI_DTYPE_F16 => WeightDType::F16,
        NI_DTYPE_BF16 => WeightDType::BF16,
        _ => bail_arg!("model params: dtype {d} is not an NI_DTYPE_* value"),
    })
}

#[cfg(unix)]
fn path_from_bytes(bytes: &[u8]) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::OsStr::from_bytes(bytes).into()
}

#[cfg(not(unix))]
fn path_from_bytes(bytes: &[u8]) -> PathBuf {
    String::from_utf8_lossy(bytes).into_owned().into()
}

fn int4_group(p: &ni_model_params) -> usize {
    match p.quant_group_size {
        0 => crate::model::quant::INT4_DEFAULT_GROUP_SIZE,
        g => g as usize,
    }
}

fn quant_mode(p: &ni_model_params) -> Result<QuantMode> {
    Ok(match p.quant {
        NI_QUANT_NONE => QuantMode::None,
        NI_QUANT_Q8_0 => QuantMode::Q8_0 {
            group_size: match p.quant_group_size {
                0 => crate::model::quant::DEFAULT_GROUP_SIZE,
                g => g as usize,
            },
            lm_head: p.quant_lm_head,
        },
        NI_QUANT_AWQ => QuantMode::Awq {
            group_size: int4_group(p),
            lm_head: false,
        },
        NI_QUANT_GPTQ => QuantMode::Gptq {
            group_size: int4_group(p),
            sym: true,
            lm_head: false,
        },
        NI_QUANT_FP8 => QuantMode::Fp8 { lm_head: false },
        q => bail_arg!("model params: quant {q} is not an NI_QUANT_* value"),
    })
}

/// Fills `params` with the defaults (CPU, dtype auto, all cores, no
/// progress callback, no quantization) and sets `struct_size`. NULL is a no-op.
///
/// Thread-safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn ni_model_params_init(params: *mut ni_model_params) {
    ffi_value("ni_model_params_init", (), || {
        if let Ok(p) = args::out_ptr(params, "params") {
            // SAFETY: non-NULL and aligned (checked); the caller provides room for the struct.
            unsafe { p.write(ni_model_params::default()) };
        }
    })
}

/// Loads the HuggingFace model directory `path` (NUL-terminated; config.json,
/// *.safetensors, optionally tokenizer.json and generation_config.json).
/// `params` may be NULL for the defaults.
///
/// On success `*out_model` receives a new handle, to be freed with
/// `ni_model_free`; on failure it is left untouched.
/// Thread-safety: any thread; loads may run concurrently.
#[no_mangle]
pub unsafe extern "C" fn ni_model_load(
    path: *const c_char,
    params: *const ni_model_params,
    out_model: *mut *mut ni_model,
) -> ni_status {
    ffi_call("ni_model_load", || {
        // SAFETY: per this function's contract.
        let path_bytes = unsafe { args::cstr_bytes(path, "path")? };
        // SAFETY: per this function's contract.
        let p = unsafe {
            args::params_versioned(
                params,
                ni_model_params::default,
                &[NI_MODEL_PARAMS_SIZE_V1],
                "params",
            )?
        };
        let out = args::out_ptr(out_model, "out_model")?;
        if path_bytes.is_empty() {
            bail_arg!("path is empty");
        }
        let device = match p.device {
            NI_DEVICE_CPU => Device::Cpu,
            NI_DEVICE_CUDA => match usize::try_from(p.device_index) {
                Ok(n) => Device::Cuda(n),
                Err(_) => bail_arg!("model params: device_index {} is negative", p.device_index),
            },
            d => bail_arg!("model params: device {d} is not an NI_DEVICE_* value"),
        };
        let model_params = ModelParams {
            dtype: weight_dtype(p.dtype)?,
            threads: p.n_threads as usize,
            quant: quant_mode(&p)?,
            device,
        };
        let dir = path_from_bytes(path_bytes);
        let model = match p.progress {
            Some(cb) => {
                let user_data = p.progress_user_data;
                // SAFETY: the host installed this callback with this user_data for this call.
                let mut report = |f: f32| unsafe { cb(f, user_data) };
                Model::load(&dir, &model_params, Some(&mut report))?
            }
            None => Model::load(&dir, &model_params, None)?,
        };
        let c = model.config();
        emit(
            NI_LOG_INFO,
            &format!(
                "loaded {} from {}: {} layers, vocab {}, context {}, {} kernel threads, {:.0} ms",
                c.architecture.hf_name(),
                dir.display(),
                c.num_layers,
                c.vocab_size,
                c.max_position_embeddings,
                model.threads(),
                model.load_ms
            ),
        );
        let architecture = CString::new(c.architecture.hf_name()).unwrap_or_default();
        let handle = Box::new(ni_model {
            model: Arc::new(model),
            architecture,
        });
        // SAFETY: out was checked non-NULL and aligned.
        unsafe { out.write(Box::into_raw(handle)) };
        Ok(())
    })
}

/// Releases a model handle. Sessions created from it keep the model alive
/// until they are freed, so the order of `ni_model_free` and
/// `ni_session_free` does not matter. NULL is a no-op.
///
/// Thread-safety: no other call may use this handle during or after this one.
#[no_mangle]
pub unsafe extern "C" fn ni_model_free(model: *mut ni_model) {
    ffi_value("ni_model_free", (), || {
        if !model.is_null() {
            // SAFETY: a non-NULL handle came from Box::into_raw in ni_model_load
            // and is freed once, per the contract.
            drop(unsafe { Box::from_raw(model) });
        }
    })
}

/// Fills `*out_info` (whose `struct_size` the caller has set to
/// `sizeof(ni_model_info)`). Pointers inside stay valid until `ni_model_free`.
/// A size above `UINT32_MAX` (a context length config.json sets past 2^32)
/// reads as `UINT32_MAX`, never as a truncated value.
///
/// Thread-safety: any thread, concurrently with any other use of the model.
#[no_mangle]
pub unsafe extern "C" fn ni_model_get_info(
    model: *const ni_model,
    out_info: *mut ni_model_info,
) -> ni_status {
    ffi_call("ni_model_get_info", || {
        // SAFETY: per this function's contract.
        let m = unsafe { args::handle(model, "model")? };
        let out = args::out_struct(out_info, "out_info")?;
        let c = m.model.config();
        let tok = m.model.tokenizer.as_ref();
        let eos = &m.model.eos_token_ids;
        let info = ni_model_info {
            struct_size: size_of::<ni_model_info>() as u32,
            architecture: m.architecture.as_ptr(),
            vocab_size: saturate(c.vocab_size),
            context_length: saturate(c.max_position_embeddings),
            n_layers: saturate(c.num_layers),
            hidden_size: saturate(c.hidden_size),
            n_heads: saturate(c.num_heads),
            n_kv_heads: saturate(c.num_kv_heads),
            head_dim: saturate(c.head_dim),
            bos_token_id: c
                .bos_token_id
                .or_else(|| tok.and_then(|t| t.bos_token_id()))
                .map_or(-1, i64::from),
            eos_token_ids: if eos.is_empty() {
                std::ptr::null()
            } else {
                eos.as_ptr()
            },
            n_eos_token_ids: eos.len(),
            has_tokenizer: tok.is_some(),
            has_chat_template: tok.is_some_and(|t| t.has_chat_template()),
        };
        // SAFETY: out was checked non-NULL, aligned and of the right size.
        unsafe { out.write(info) };
        Ok(())
    })
}
