//! Element types and host buffers.

pub mod buffer;
pub mod dtype;
pub mod finite;

pub use buffer::HostSlice;
pub use dtype::DType;
