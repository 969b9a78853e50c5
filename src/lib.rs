//! NanoInfer: an embeddable LLM inference engine.
//!
//! Layers, top to bottom (a module imports only from layers below it;
//! `tests/layering.rs` holds the order and enforces it): `ffi` → `engine` →
//! `quantize` (the CLI's calibration tooling) → `model` → `kv`, `sampling`, `tokenizer` → `backend` → `memory` →
//! `forward` (the contract of a forward pass) → `tensor` → base utilities.
//! See docs/DESIGN.md for the architecture, what is built and what is the
//! target.

pub mod backend;
pub mod engine;
pub mod error;
pub mod ffi;
pub mod forward;
pub mod kv;
pub mod limits;
pub mod memory;
pub mod model;
pub mod quantize;
pub mod sampling;
pub mod sysinfo;
pub mod tensor;
pub mod tokenizer;
pub mod tuning;
pub mod untrusted_file;

pub use error::{Error, ErrorKind, Result};
