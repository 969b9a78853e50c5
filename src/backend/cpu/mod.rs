//! CPU backend: SIMD kernels with runtime feature detection and a persistent
//! thread pool.

pub mod attention;
// The kernels of these modules are x86-64 only (AVX-512, AMX, VNNI,
// AVX-512 BF16); elsewhere only their shared helpers are used.
#[cfg_attr(
    not(target_arch = "x86_64"),
    allow(dead_code, unused_imports, unused_macros)
)]
mod attention_block;
#[cfg(target_arch = "x86_64")]
mod attention_block_avx2;
#[cfg_attr(
    not(target_arch = "x86_64"),
    allow(dead_code, unused_imports, unused_macros)
)]
mod attention_row;
pub mod bf16;
#[cfg_attr(
    not(target_arch = "x86_64"),
    allow(dead_code, unused_imports, unused_macros)
)]
pub mod bf16_amx;
#[cfg_attr(
    not(target_arch = "x86_64"),
    allow(dead_code, unused_imports, unused_macros)
)]
pub mod bf16_dot;
pub mod bf16_hw;
pub mod bf16_kernels;
pub mod elem;
pub mod exact;
pub mod f16_packed;
pub mod f32_packed;
#[cfg_attr(
    not(target_arch = "x86_64"),
    allow(dead_code, unused_imports, unused_macros)
)]
mod gemm;
pub mod isa;
pub mod layer_ops;
pub mod matmul;
#[cfg(target_arch = "aarch64")]
mod neon_packed;
#[cfg(target_arch = "aarch64")]
mod neon_q4;
#[cfg(target_arch = "aarch64")]
mod neon_q8;
#[cfg(target_arch = "aarch64")]
mod neon_vector;
pub mod ops;
pub mod packed;
pub mod packed_kernels;
pub mod q4;
pub mod q4_kernels;
pub mod q8;
pub mod q8_kernels;
pub mod threadpool;
pub mod turns;
pub mod vector;
mod vector_avx2;
pub mod workspace;

pub use bf16::PackedBf16;
pub use f16_packed::PackedF16;
pub use f32_packed::PackedF32;
pub use layer_ops::{CpuFormats, CpuLayerOps, CpuLinear, CpuWeights};
pub use matmul::{matmul, Matrix, MatrixData};
pub use q4::Q4Matrix;
pub use q8::Q8Matrix;
pub use threadpool::ThreadPool;
pub use workspace::{ForwardWorkspace, StepBuffers, WorkspacePlan};
