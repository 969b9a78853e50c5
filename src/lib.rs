//! NanoInfer: an embeddable LLM inference engine.
//!
//! Layers (nothing imports upwards): `ffi` → `engine` → `sampling`, `tokenizer`,
//! `kv` → `model` → `backend` → `memory` → `tensor`. See DESIGN.md in the
//! shared folder for the target architecture.

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
