//! Model loading and the decoder forward pass.

pub mod safetensors;
mod safetensors_header;
mod safetensors_json;
mod safetensors_view;
