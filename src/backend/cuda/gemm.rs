//! Dense projections through cuBLAS: `y = x · wᵀ` with 16-bit inputs and f32
//! accumulation (tensor cores where the shape allows).

use super::{cuda_error, ActDType};
use crate::Result;
use cudarc::cublas::{result, sys, CudaBlas};

/// Element type of a GEMM output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmDType {
    /// The activation dtype.
    Act,
    F32,
}

fn data_type(act: ActDType) -> sys::cudaDataType {
    match act {
        ActDType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        ActDType::F16 => sys::cudaDataType::CUDA_R_16F,
    }
}

/// Row-major `y[rows, n] = x[rows, k] · w[n, k]ᵀ`. In cuBLAS's column-major
/// view that is `yᵀ[n, rows] = op_T(w)[n, k] · xᵀ[k, rows]`, with w seen as
/// a `[k, n]` column-major matrix of leading dimension k.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_xwt(
    blas: &CudaBlas,
    act: ActDType,
    x: u64,
    w: u64,
    y: u64,
    rows: usize,
    n: usize,
    k: usize,
    out: GemmDType,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let alpha = 1.0f32;
    let beta = 0.0f32;
    let t = data_type(act);
    let y_type = match out {
        GemmDType::Act => t,
        GemmDType::F32 => sys::cudaDataType::CUDA_R_32F,
    };
    // SAFETY: x, w and y are live device allocations of at least
    // rows*k, n*k and rows*n elements (the callers size them from the same
    // shapes); alpha/beta point to host f32s, cuBLAS's default pointer mode.
    unsafe {
        result::gemm_ex(
            *blas.handle(),
            sys::cublasOperation_t::CUBLAS_OP_T,
            sys::cublasOperation_t::CUBLAS_OP_N,
            n as i32,
            rows as i32,
            k as i32,
            (&alpha as *const f32).cast(),
            w as *const _,
            t,
            k as i32,
            x as *const _,
            t,
            k as i32,
            (&beta as *const f32).cast(),
            y as *mut _,
            y_type,
            n as i32,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| cuda_error(&format!("cublasGemmEx ({rows}x{k} · {n}x{k}ᵀ)"), e))
}
