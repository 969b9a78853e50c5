//! The `quantize` tooling: calibrated int4 (AWQ scale search, GPTQ error
//! feedback) and checkpoint writing, used by the CLI's `quantize` command.
//! It sits above the model layer and nothing in the serving path imports
//! it: loading a quantized checkpoint, or quantizing round-to-nearest at
//! load time, lives in `model::quant*`.

pub mod awq;
pub mod calib;
pub mod checkpoint;
pub mod gptq;
pub mod linalg;

pub use checkpoint::{
    quantize_checkpoint, quantize_checkpoint_with, QuantizeOptions, QuantizeReport,
};
