//! The int4 tensor-core GEMM of `kernels/int4_gemm.cu` (sm_90, wgmma):
//! int4 batches above the fused kernels' rows multiplied straight from the
//! packed weights, instead of dequantizing them for cuBLAS first.

use super::kernels::{Kernel, Kernels};
use super::w4_ops::W4Matrix;
use super::{cuda_error, CudaDevice, KArg};
use crate::Result;
use cudarc::driver::sys::CUfunction_attribute;

/// W4G_TOKENS of kernels/int4_gemm.cu: activation rows per packed block.
const PACKED_ROWS: usize = 128;

/// A block shape of the GEMM: `warpgroups` of 64 weight rows each, times
/// `tokens` activation rows (128 or 256).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct BlockShape {
    warpgroups: usize,
    tokens: usize,
}

/// 128 weight rows a block, and 256 (more warps to hide the
/// dequantization, the activations reused twice as often). H100, 8B
/// shapes, TFLOP/s at 512 / 2048 rows: gate/up 541 / 558 and 540 / 644,
/// down 496 / 521 and 330 / 618 (down has only 64 wide blocks at 512 rows).
/// Blocks of two warpgroups of 128 rows each were slower than both.
const NARROW: BlockShape = BlockShape {
    warpgroups: 2,
    tokens: 128,
};
const WIDE: BlockShape = BlockShape {
    warpgroups: 4,
    tokens: 128,
};
/// Two warpgroups of 64 weight rows × 256 activation rows: each
/// dequantized weight feeds two wgmmas. H100, one block per tile, 8B
/// shapes: gate/up at 512 / 1 024 / 2 048 rows 200 / 345 / 687–706 µs
/// against wide blocks' 225 / 388 / 756–823, down at 1 024 179 against 197
/// (the same tile counts).
const TALL: BlockShape = BlockShape {
    warpgroups: 2,
    tokens: 256,
};
const SHAPES: [BlockShape; 3] = [NARROW, WIDE, TALL];

impl BlockShape {
    fn weight_rows(self) -> usize {
        64 * self.warpgroups
    }

    fn threads(self) -> usize {
        128 * self.warpgroups
    }

    /// W4G_STAGES (W4G_STAGES_TALL for 256 activation rows) of
    /// kernels/int4_gemm.cu.
    fn stages(self) -> usize {
        if self.tokens == 256 {
            6
        } else {
            8
        }
    }

    /// Dynamic shared memory: the stages (activations, packed weights,
    /// scales/zeros), 1 KB to align them and their two mbarriers each.
    fn smem_bytes(self) -> usize {
        let tiles = self.weight_rows() / 16;
        self.stages() * (self.tokens * 128 + tiles * (512 + 128) + 16) + 1024
    }

    /// Bytes of one block's partial sums (a stream-K slot): two f32 per
    /// thread and output pair, `tokens / 4` pairs.
    fn slot_bytes(self) -> usize {
        self.threads() * self.tokens / 4 * 8
    }

    fn tiles(self, rows: usize, n: usize) -> usize {
        rows.div_ceil(self.tokens) * n.div_ceil(self.weight_rows())
    }

    fn kernel(self, kernels: &Kernels) -> &Kernel {
        match self {
            WIDE => &kernels.w4_gemm_wg4,
            TALL => &kernels.w4_gemm_wg2_t256,
            _ => &kernels.w4_gemm_wg2,
        }
    }
}

/// Which blocks the GEMM runs (`NANOINFER_CUDA_W4_GEMM`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum W4Gemm {
    /// `0`, or not sm_90: int4 batches dequantize for cuBLAS.
    Off,
    /// Default: the launch a cost model expects to be fastest (see
    /// [`W4Gemm::launch`]). `stream_k: false`
    /// (`NANOINFER_CUDA_W4_STREAM_K=0`): never stream-K.
    Auto { stream_k: bool },
    /// `1` (narrow), `2` (wide) or `3` (tall): always that shape, one block
    /// per tile, for measurements.
    Fixed(BlockShape),
    /// `4` (wide) or `5` (tall): stream-K with that shape wherever the
    /// kernel takes it, for measurements.
    StreamK(BlockShape),
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

/// The int4 GEMM's blocks, for tests and measurements: chosen per product
/// (the default), or always one shape, one block per tile or by stream-K.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum W4GemmBlocks {
    Auto,
    /// 128 weight rows × 128 activation rows.
    Narrow,
    /// 256 weight rows × 128 activation rows.
    Wide,
    /// 128 weight rows × 256 activation rows.
    Tall,
    /// Wide blocks, one per SM, by stream-K (where the kernel takes it).
    WideStreamK,
    /// Tall blocks, one per SM, by stream-K (where the kernel takes it).
    TallStreamK,
}

impl W4Gemm {
    pub(super) fn for_device(arch: (i32, i32)) -> W4Gemm {
        if arch != (9, 0) {
            return W4Gemm::Off;
        }
        let blocks = match std::env::var("NANOINFER_CUDA_W4_GEMM").as_deref() {
            Ok("0") => return W4Gemm::Off,
            Ok("1") => W4GemmBlocks::Narrow,
            Ok("2") => W4GemmBlocks::Wide,
            Ok("3") => W4GemmBlocks::Tall,
            Ok("4") => W4GemmBlocks::WideStreamK,
            Ok("5") => W4GemmBlocks::TallStreamK,
            _ => W4GemmBlocks::Auto,
        };
        W4Gemm::with_blocks(blocks)
    }

    fn with_blocks(blocks: W4GemmBlocks) -> W4Gemm {
        match blocks {
            W4GemmBlocks::Auto => W4Gemm::Auto {
                stream_k: super::switch_on("NANOINFER_CUDA_W4_STREAM_K"),
            },
            W4GemmBlocks::Narrow => W4Gemm::Fixed(NARROW),
            W4GemmBlocks::Wide => W4Gemm::Fixed(WIDE),
            W4GemmBlocks::Tall => W4Gemm::Fixed(TALL),
            W4GemmBlocks::WideStreamK => W4Gemm::StreamK(WIDE),
            W4GemmBlocks::TallStreamK => W4Gemm::StreamK(TALL),
        }
    }

    /// The launch of `y[rows, n] = x[rows, k] · wᵀ` on `sm_count` SMs.
    /// Auto takes the cheapest of: one block per tile, wide blocks once
    /// they fill 70 % of the SMs, else narrow ones (H100, 512 rows: QKV's
    /// 96 wide blocks beat its 192 narrow ones, 413 against 333 TFLOP/s;
    /// o's 64 do not); one tall block per tile; stream-K, one wide or tall
    /// block per SM taking an equal share of all tiles' chunks.
    fn launch(self, rows: usize, n: usize, k: usize, sm_count: usize) -> Launch {
        let chunks = k / 64;
        let per_tile = |shape: BlockShape| Launch {
            shape,
            blocks: shape.tiles(rows, n),
        };
        let stream_k = |shape: BlockShape| {
            stream_k_blocks(shape.tiles(rows, n), chunks, sm_count)
                .map(|blocks| Launch { shape, blocks })
        };
        match self {
            W4Gemm::Fixed(shape) => per_tile(shape),
            W4Gemm::StreamK(shape) => stream_k(shape).unwrap_or(per_tile(shape)),
            W4Gemm::Auto { stream_k: allowed } => {
                let square = if 10 * WIDE.tiles(rows, n) >= 7 * sm_count {
                    WIDE
                } else {
                    NARROW
                };
                let cost = |launch: Launch| {
                    let (shape, tiles) = (launch.shape, launch.shape.tiles(rows, n));
                    if launch.blocks == tiles {
                        let waves = tiles.div_ceil(sm_count) as f64;
                        shape.per_tile_cost(waves, chunks as f64)
                    } else {
                        let range = (tiles * chunks).div_ceil(launch.blocks) as f64;
                        range * shape.chunk_cost() + STREAM_K_COST
                    }
                };
                // Tall blocks only where every tile is split among blocks:
                // with several tiles a block they lost to one tall block
                // per tile (gate/up at 512 rows: 213 against 199 µs).
                let streamed = [WIDE, TALL].map(|shape| {
                    let fits = shape == WIDE || shape.tiles(rows, n) < sm_count;
                    (allowed && fits).then(|| stream_k(shape)).flatten()
                });
                [Some(per_tile(square)), Some(per_tile(TALL))]
                    .into_iter()
                    .chain(streamed)
                    .flatten()
                    .min_by(|a, b| cost(*a).total_cmp(&cost(*b)))
                    .expect("one block per tile is always a candidate")
            }
            W4Gemm::Off => unreachable!("no launch without the GEMM"),
        }
    }
}

// Times of the launches, in the time a wide block takes for one chunk
// (H100, the 8B layer's products at 200–1 024 rows, w4_bench; BENCHMARKS,
// sessions 20 and 21). Stream-K pays for its pieces: restarting the stage
// pipeline, writing partial sums and adding them up cost ~30 chunks' time
// per block.
const STREAM_K_COST: f64 = 30.0;

impl BlockShape {
    /// A chunk's time against a wide block's: a narrow block takes 0.65, a
    /// tall one (as many products, half the dequantization) 0.9.
    fn chunk_cost(self) -> f64 {
        match self {
            NARROW => 0.65,
            TALL => 0.9,
            _ => 1.0,
        }
    }

    /// One block per tile, `waves` of them, and the launch's start and end.
    fn per_tile_cost(self, waves: f64, chunks: f64) -> f64 {
        let fixed = match self {
            NARROW => 4.0,
            TALL => 9.0,
            _ => 6.0,
        };
        waves * chunks * self.chunk_cost() + fixed
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
    rows.div_ceil(PACKED_ROWS) * PACKED_ROWS * cols
}

/// Elements (u16) of stream-K's partial sums: two slots per block, one
/// block per SM, each of the largest shape's slot bytes (two bytes an
/// element, so as many elements per block as a slot has bytes).
fn partials_elems(sm_count: usize) -> usize {
    let slot_bytes = SHAPES.map(BlockShape::slot_bytes).into_iter().max();
    sm_count * slot_bytes.expect("SHAPES is not empty")
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

    /// Holds [`CudaDevice::w4_gemm`] to `blocks` (where the GEMM runs).
    pub fn set_w4_gemm_blocks(&mut self, blocks: W4GemmBlocks) {
        if self.w4_gemm_available() {
            self.w4_gemm = W4Gemm::with_blocks(blocks);
        }
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
                launch.shape.threads() as u32,
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
        // H100 (132 SMs), Llama-3-8B's products (w4_bench, sessions 20 and
        // 21; µs). QKV at 1 024 rows: stream-K in wide blocks 103.7 against
        // 117.5 one wide block per tile.
        let auto = W4Gemm::Auto { stream_k: true };
        let wide_sk = Launch {
            shape: WIDE,
            blocks: 132,
        };
        assert_eq!(auto.launch(1024, 6144, 4096, 132), wide_sk);
        // Stream-K in tall blocks where tiles are fewer than SMs (down at
        // 160 / 256 / 512 rows: 71.4 / 73.3 / 113.5 against wide blocks'
        // 72.7 / 74.3 / 118.5); one block per tile against stream-K, and
        // wide or narrow blocks against tall ones.
        let tall_sk = Launch {
            shape: TALL,
            blocks: 132,
        };
        for rows in [160, 256, 512] {
            assert_eq!(
                auto.launch(rows, 4096, 14336, 132),
                tall_sk,
                "down, {rows} rows"
            );
        }
        for (rows, n, k, shape) in [
            (512, 6144, 4096, TALL),   // QKV: 57.9 against 61.2 and 62.2
            (512, 28672, 4096, TALL),  // gate/up: 200.0 against 212.0 (stream-K)
            (512, 4096, 4096, NARROW), // o: 39.4 against 49.1 and 56.7
            (200, 6144, 4096, NARROW), // QKV: 38.8 against 43.4
            (256, 28672, 4096, TALL),  // gate/up: 110.7 against 117.5
            (1024, 28672, 4096, TALL), // gate/up: 344.5 against 387.5 and 391.3
            (1024, 4096, 14336, TALL), // down: 179.2 against 197.4 and 198.6
            (1024, 4096, 4096, TALL),  // o: 60.8 against 64.4
        ] {
            let launch = auto.launch(rows, n, k, 132);
            assert_eq!(launch.shape, shape, "{rows}x{n}x{k}");
            assert_eq!(launch.blocks, shape.tiles(rows, n));
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
    fn without_stream_k_tall_or_wide_blocks_once_they_fill_most_sms() {
        let auto = W4Gemm::Auto { stream_k: false };
        let shape = |rows, n| auto.launch(rows, n, 4096, 132).shape;
        assert_eq!(shape(384, 28672), WIDE); // tall blocks would be 448 for 336 wide ones
        assert_eq!(shape(512, 4096), NARROW);
        assert_eq!(shape(2048, 4096), TALL);
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
