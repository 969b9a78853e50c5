//! CPU backend: SIMD kernels with runtime feature detection, persistent thread pool.
