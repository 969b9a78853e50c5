//! Strict safetensors reader over a shared read-only mmap.
