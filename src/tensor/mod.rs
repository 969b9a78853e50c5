//! Element types and host buffers.

pub mod dtype;

pub use dtype::DType;
