//! Element types and host buffers.

pub mod buffer;
pub mod dtype;
pub mod finite;
pub mod fp8;

pub use buffer::HostSlice;
pub use dtype::DType;
