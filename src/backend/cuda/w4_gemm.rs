//! The int4 tensor-core GEMM of `kernels/int4_gemm.cu` (sm_90, wgmma):
//! int4 batches above the fused kernels' rows multiplied straight from the
//! packed weights, instead of dequantizing them for cuBLAS first.

use super::kernels::{Kernel, Kernels};
use super::w4_ops::W4Matrix;
use super::{cuda_error, CudaDevice, KArg};
use crate::Result;
use cudarc::driver::sys::CUfunction_attribute;

/// W4G_TOKENS of kernels/int4_gemm.cu: activation rows per tile.
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
    /// Default: one block per tile, wide blocks once they fill 70 % of
    /// the SMs (H100, 512 rows: QKV's 96 wide blocks beat its 192 narrow
    /// ones, 413 against 333 TFLOP/s; o's 64 do not), unless stream-K (one
    /// wide block per SM, the chunks of all tiles shared out evenly) is
    /// expected to be faster. `stream_k: false`
    /// (`NANOINFER_CUDA_W4_STREAM_K=0`): never stream-K.
    Auto { stream_k: bool },
    /// `1` (narrow) or `2` (wide): always that shape, one block per tile,
    /// for measurements.
    Fixed(BlockShape),
}

/// Most tiles one block's range may touch (W4G_PIECES of kernels/int4_gemm.cu).
const MAX_PIECES: usize = 5;

/// How a product's tiles are shared out: `blocks` of `shape`, each taking
/// an equal share of the tiles' chunks (one tile each when `blocks` is the
/// number of tiles).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Launch {
    shape: BlockShape,
    blocks: usize,
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
            _ => W4Gemm::Auto {
                stream_k: super::switch_on("NANOINFER_CUDA_W4_STREAM_K"),
            },
        }
    }

    /// The launch of `y[rows, n] = x[rows, k] · wᵀ` on `sm_count` SMs.
    fn launch(self, rows: usize, n: usize, k: usize, sm_count: usize) -> Launch {
        let tiles = |shape: BlockShape| rows.div_ceil(BLOCK_ROWS) * n.div_ceil(shape.weight_rows());
        let per_tile = |shape| Launch {
            shape,
            blocks: tiles(shape),
        };
        match self {
            W4Gemm::Fixed(shape) => per_tile(shape),
            W4Gemm::Auto { stream_k } => {
                let wide = tiles(WIDE);
                let shape = if 10 * wide >= 7 * sm_count {
                    WIDE
                } else {
                    NARROW
                };
                let chunks = k / 64;
                let stream_k = stream_k
                    .then(|| stream_k_blocks(wide, chunks, sm_count))
                    .flatten()
                    .filter(|&blocks| {
                        let range = (wide * chunks).div_ceil(blocks) as f64;
                        let waves = tiles(shape).div_ceil(sm_count) as f64;
                        range + STREAM_K_COST < shape.per_tile_cost(waves, chunks as f64)
                    });
                match stream_k {
                    Some(blocks) => Launch {
                        shape: WIDE,
                        blocks,
                    },
                    None => per_tile(shape),
                }
            }
            W4Gemm::Off => unreachable!("no launch without the GEMM"),
        }
    }
}

// Times of the launches, in the time a wide block takes for one chunk
// (H100, the 8B layer's products at 200–1 024 rows, w4_bench; BENCHMARKS,
// session 20). Stream-K pays for its pieces: restarting the stage pipeline,
// writing partial sums and adding them up cost ~30 chunks' time per block.
const STREAM_K_COST: f64 = 30.0;

impl BlockShape {
    /// One block per tile, `waves` of them: a narrow block takes 0.65 of a
    /// wide one's time per chunk.
    fn per_tile_cost(self, waves: f64, chunks: f64) -> f64 {
        if self == WIDE {
            waves * chunks + 6.0
        } else {
            waves * chunks * 0.65 + 4.0
        }
    }
}

/// Stream-K's grid for `tiles` tiles of `chunks` chunks on `sm_count` SMs,
/// if the kernel can take it: every range within MAX_PIECES tiles, the
/// kernel's 32-bit range arithmetic (up to I·(G + 1), w4g_block_of) in
/// range, and a counter per tile.
fn stream_k_blocks(tiles: usize, chunks: usize, sm_count: usize) -> Option<usize> {
    let iters = tiles * chunks;
    let blocks = sm_count.min(iters);
    let fits = iters.div_ceil(blocks) <= (MAX_PIECES - 1) * chunks
        && iters * (blocks + 1) < i32::MAX as usize
        && tiles <= SPLIT_COUNTERS;
    fits.then_some(blocks)
}

/// Counters of stream-K's split tiles (zeroed once; each launch leaves
/// them zero), followed by [`ready_flags`] flags.
pub(super) const SPLIT_COUNTERS: usize = 4096;

/// Stream-K's flags of partial sums left for another block: two slots per
/// block, one block per SM.
pub(super) fn ready_flags(sm_count: usize) -> usize {
    2 * sm_count
}

/// Elements (u16) of the packed activations of `rows` rows of `cols`
/// inputs: rows padded to whole blocks.
fn packed_elems(rows: usize, cols: usize) -> usize {
    rows.div_ceil(BLOCK_ROWS) * BLOCK_ROWS * cols
}

/// Elements (u16) of stream-K's partial sums: two slots per block of f32
/// sums, 64 per thread of the widest block.
fn partials_elems(sm_count: usize) -> usize {
    2 * sm_count * 64 * 128 * WIDE.warpgroups * 2
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

    /// Elements (u16) of the scratch [`CudaDevice::w4_gemm`] takes for
    /// `rows` rows of `cols` inputs: the packed activations, then
    /// stream-K's partial sums.
    pub fn w4_gemm_scratch_elems(&self, rows: usize, cols: usize) -> usize {
        packed_elems(rows, cols) + partials_elems(self.sm_count)
    }

    /// `y[rows, w.rows] = x[rows, w.cols] · wᵀ` in the activation dtype,
    /// on the tensor cores, for any number of rows (meant for more than
    /// the fused kernels take; act-order weights gather `x` themselves).
    /// `scratch`: [`CudaDevice::w4_gemm_scratch_elems`] elements.
    pub fn w4_gemm(&self, x: u64, rows: usize, w: &W4Matrix, y: u64, scratch: u64) -> Result<()> {
        if !self.w4_gemm_available() {
            return Err(crate::Error::new(
                crate::ErrorKind::Internal,
                "the int4 tensor-core GEMM needs an sm_90 GPU",
            ));
        }
        let launch = self.w4_gemm.launch(rows, w.rows, w.cols, self.sm_count);
        let f = launch.shape.kernel(&self.kernels);
        let pack = &self.kernels.w4_gemm_pack_x;
        let packed = packed_elems(rows, w.cols);
        let partials = scratch + 2 * packed as u64;
        self.timed(
            || format!("{} {rows}x{}", pack.name, w.cols),
            0,
            || {
                self.launch_raw(
                    pack,
                    ((packed / 8).div_ceil(256) as u32, 1, 1),
                    256,
                    0,
                    &[
                        KArg::Ptr(x),
                        KArg::Ptr(w.perm_ptr()),
                        KArg::Ptr(scratch),
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
                (launch.blocks as u32, 1, 1),
                128 * launch.shape.warpgroups as u32,
                launch.shape.smem_bytes() as u32,
            ),
            &[
                KArg::Ptr(scratch),
                KArg::I32(rows as i32),
                KArg::Ptr(w.words_ptr()),
                KArg::Ptr(w.sz_ptr()),
                KArg::I32(w.cols as i32),
                KArg::I32(w.group as i32),
                KArg::Ptr(y),
                KArg::I32(w.rows as i32),
                KArg::Ptr(partials),
                KArg::Ptr(self.split_counters.ptr()),
                KArg::Ptr(self.split_counters.ptr() + 4 * SPLIT_COUNTERS as u64),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_k_where_it_was_measured_faster() {
        // H100 (132 SMs), Llama-3-8B's products (w4_bench, session 20; µs
        // with one block per tile against stream-K).
        let auto = W4Gemm::Auto { stream_k: true };
        let sk = Launch {
            shape: WIDE,
            blocks: 132,
        };
        for (rows, n, k) in [
            (512, 28672, 4096), // gate/up: 221.6 against 211.4
            (512, 4096, 14336), // down: 123.1 against 118.7
            (200, 4096, 14336), // down: 118.1 against 73.0
            (1024, 6144, 4096), // QKV: 117.5 against 103.7
        ] {
            assert_eq!(auto.launch(rows, n, k, 132), sk, "{rows}x{n}x{k}");
        }
        for (rows, n, k, shape) in [
            (512, 6144, 4096, WIDE),   // QKV: 60.2 against 62.2
            (512, 4096, 4096, NARROW), // o: 39.4 against 49.1
            (200, 6144, 4096, NARROW), // QKV: 38.8 against 43.4
            (1024, 28672, 4096, WIDE), // gate/up: 380.2 against 391.3
            (1024, 4096, 14336, WIDE), // down: 197.2 against 198.6
        ] {
            let launch = auto.launch(rows, n, k, 132);
            assert_eq!(launch.shape, shape, "{rows}x{n}x{k}");
            assert_eq!(launch.blocks, rows.div_ceil(128) * n / shape.weight_rows());
        }
    }

    #[test]
    fn stream_k_ranges_the_kernel_takes() {
        // A block per chunk where the chunks are fewer than the SMs.
        assert_eq!(stream_k_blocks(2, 3, 132), Some(6));
        // Ranges of more than MAX_PIECES tiles: one block per tile.
        assert_eq!(stream_k_blocks(6 * 132, 64, 132), None);
        assert_eq!(stream_k_blocks(4 * 132, 64, 132), Some(132));
    }

    #[test]
    fn without_stream_k_wide_blocks_once_they_fill_most_sms() {
        let auto = W4Gemm::Auto { stream_k: false };
        let shape = |rows, n| auto.launch(rows, n, 4096, 132).shape;
        assert_eq!(shape(512, 28672), WIDE);
        assert_eq!(shape(512, 6144), WIDE);
        assert_eq!(shape(512, 4096), NARROW);
        assert_eq!(shape(2048, 4096), WIDE);
        assert_eq!(
            W4Gemm::Fixed(NARROW).launch(2048, 28672, 4096, 132).shape,
            NARROW
        );
    }

    #[test]
    fn stages_fit_in_an_sm() {
        // sm_90: 227 KB of shared memory per block.
        assert!(SHAPES.iter().all(|s| s.smem_bytes() <= 227 << 10));
    }
}
