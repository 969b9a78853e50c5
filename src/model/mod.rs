//! Model loading and the decoder forward pass.

pub mod safetensors;
