//! The int4 tensor-core GEMM of `kernels/int4_gemm.cu` (sm_90, wgmma):
//! int4 batches above the fused kernels' rows multiplied straight from the
//! packed weights, instead of dequantizing them for cuBLAS first.

use super::kernels::{Kernel, Kernels};
use super::w4_ops::W4Matrix;
use super::{cuda_error, CudaDevice, KArg};
use crate::Result;
use cudarc::driver::sys::CUfunction_attribute;

/// W4G_TOKENS of kernels/int4_gemm.cu: activation rows per block.
const BLOCK_ROWS: usize = 128;
/// W4G_STAGES of kernels/int4_gemm.cu.
const STAGES: usize = 8;

/// A block shape of the GEMM: `warpgroups` of 64 weight rows each (kernel
/// `w4_gemm_wg{warpgroups}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct BlockShape {
    warpgroups: usize,
}

/// 128 weight rows a block, and 256 (more warps to hide the
/// dequantization, the activations reused twice as often). H100, 8B
/// shapes, TFLOP/s at 512 / 2048 rows: gate/up 541 / 558 and 540 / 644,
/// down 496 / 521 and 330 / 618 (down has only 64 wide blocks at 512 rows).
/// Blocks of two warpgroups of 128 rows each were slower than both.
const NARROW: BlockShape = BlockShape { warpgroups: 2 };
const WIDE: BlockShape = BlockShape { warpgroups: 4 };
const SHAPES: [BlockShape; 2] = [NARROW, WIDE];

impl BlockShape {
    fn weight_rows(self) -> usize {
        64 * self.warpgroups
    }

    /// Dynamic shared memory: the stages (activations, packed weights,
    /// scales/zeros), 1 KB to align them and their two mbarriers each.
    fn smem_bytes(self) -> usize {
        let tiles = self.weight_rows() / 16;
        STAGES * (BLOCK_ROWS * 128 + tiles * (512 + 128) + 16) + 1024
    }

    fn kernel(self, kernels: &Kernels) -> &Kernel {
        if self == WIDE {
            &kernels.w4_gemm_wg4
        } else {
            &kernels.w4_gemm_wg2
        }
    }
}

/// Which blocks the GEMM runs (`NANOINFER_CUDA_W4_GEMM`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum W4Gemm {
    /// `0`, or not sm_90: int4 batches dequantize for cuBLAS.
    Off,
    /// Default: wide blocks once they fill 70 % of the SMs (H100, 512
    /// rows: QKV's 96 wide blocks beat its 192 narrow ones, 413 against
    /// 333 TFLOP/s; o's 64 do not).
    Auto,
    /// `1` (narrow) or `2` (wide): always that shape, for measurements.
    Fixed(BlockShape),
}

impl W4Gemm {
    pub(super) fn for_device(arch: (i32, i32)) -> W4Gemm {
        if arch != (9, 0) {
            return W4Gemm::Off;
        }
        match std::env::var("NANOINFER_CUDA_W4_GEMM").as_deref() {
            Ok("0") => W4Gemm::Off,
            Ok("1") => W4Gemm::Fixed(NARROW),
            Ok("2") => W4Gemm::Fixed(WIDE),
            _ => W4Gemm::Auto,
        }
    }

    fn shape(self, rows: usize, n: usize, sm_count: usize) -> BlockShape {
        let wide_blocks = rows.div_ceil(BLOCK_ROWS) * n.div_ceil(WIDE.weight_rows());
        match self {
            W4Gemm::Fixed(s) => s,
            _ if 10 * wide_blocks >= 7 * sm_count => WIDE,
            _ => NARROW,
        }
    }
}

/// Elements of the packed activations of `rows` rows of `cols` inputs
/// (the scratch [`CudaDevice::w4_gemm`] takes): rows padded to whole blocks.
pub fn w4_gemm_scratch_elems(rows: usize, cols: usize) -> usize {
    rows.div_ceil(BLOCK_ROWS) * BLOCK_ROWS * cols
}

/// Lets the GEMM kernels take their shared memory (above the default 48 KB).
pub(super) fn allow_gemm_smem(kernels: &Kernels) -> Result<()> {
    for shape in SHAPES {
        shape
            .kernel(kernels)
            .func
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shape.smem_bytes() as i32,
            )
            .map_err(|e| cuda_error("raising the int4 GEMM's shared memory limit", e))?;
    }
    Ok(())
}

impl CudaDevice {
    /// Whether [`CudaDevice::w4_gemm`] runs here.
    pub fn w4_gemm_available(&self) -> bool {
        self.w4_gemm != W4Gemm::Off
    }

    /// `y[rows, w.rows] = x[rows, w.cols] · wᵀ` in the activation dtype,
    /// on the tensor cores, for any number of rows (meant for more than
    /// the fused kernels take; act-order weights gather `x` themselves).
    /// `xp`: scratch of [`w4_gemm_scratch_elems`] elements for the packed
    /// activations.
    pub fn w4_gemm(&self, x: u64, rows: usize, w: &W4Matrix, y: u64, xp: u64) -> Result<()> {
        if !self.w4_gemm_available() {
            return Err(crate::Error::new(
                crate::ErrorKind::Internal,
                "the int4 tensor-core GEMM needs an sm_90 GPU",
            ));
        }
        let shape = self.w4_gemm.shape(rows, w.rows, self.sm_count);
        let f = shape.kernel(&self.kernels);
        let grid = (
            rows.div_ceil(BLOCK_ROWS) as u32,
            w.rows.div_ceil(shape.weight_rows()) as u32,
            1,
        );
        let pack = &self.kernels.w4_gemm_pack_x;
        let threads = w4_gemm_scratch_elems(rows, w.cols) / 8;
        self.timed(
            || format!("{} {rows}x{}", pack.name, w.cols),
            0,
            || {
                self.launch_raw(
                    pack,
                    (threads.div_ceil(256) as u32, 1, 1),
                    256,
                    0,
                    &[
                        KArg::Ptr(x),
                        KArg::Ptr(w.perm_ptr()),
                        KArg::Ptr(xp),
                        KArg::I32(rows as i32),
                        KArg::I32(w.cols as i32),
                    ],
                )
            },
        )?;
        self.launch_product(
            f,
            (rows, w),
            (
                grid,
                128 * shape.warpgroups as u32,
                shape.smem_bytes() as u32,
            ),
            &[
                KArg::Ptr(xp),
                KArg::I32(rows as i32),
                KArg::Ptr(w.words_ptr()),
                KArg::Ptr(w.sz_ptr()),
                KArg::I32(w.cols as i32),
                KArg::I32(w.group as i32),
                KArg::Ptr(y),
                KArg::I32(w.rows as i32),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wide_blocks_once_they_fill_most_sms() {
        // H100 (132 SMs), Llama-3-8B, 512-row prefill: gate/up (28672 rows)
        // has 4 × 112 wide blocks, QKV (6144) 4 × 24, o and down (4096)
        // 4 × 16.
        assert_eq!(W4Gemm::Auto.shape(512, 28672, 132), WIDE);
        assert_eq!(W4Gemm::Auto.shape(512, 6144, 132), WIDE);
        assert_eq!(W4Gemm::Auto.shape(512, 4096, 132), NARROW);
        assert_eq!(W4Gemm::Auto.shape(2048, 4096, 132), WIDE);
        assert_eq!(W4Gemm::Fixed(NARROW).shape(2048, 28672, 132), NARROW);
    }

    #[test]
    fn stages_fit_in_an_sm() {
        // sm_90: 227 KB of shared memory per block.
        assert!(SHAPES.iter().all(|s| s.smem_bytes() <= 227 << 10));
    }
}
