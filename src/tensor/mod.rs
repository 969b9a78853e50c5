//! Element types and host buffers.

pub mod buffer;
pub mod dtype;

pub use buffer::HostSlice;
pub use dtype::DType;
