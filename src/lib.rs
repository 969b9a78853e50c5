//! NanoInfer: an embeddable LLM inference engine.
//!
//! Layers (nothing imports upwards): `ffi` → `engine` → `sampling`, `tokenizer`,
//! `kv` → `model` → `backend` → `memory` → `tensor`. See docs/DESIGN.md
//! for the architecture, what is built and what is the target.

pub mod backend;
pub mod engine;
pub mod error;
pub mod ffi;
pub mod kv;
pub mod limits;
pub mod memory;
pub mod model;
pub mod sampling;
pub mod sysinfo;
pub mod tensor;
pub mod tokenizer;
pub mod untrusted_file;

pub use error::{Error, ErrorKind, Result};
