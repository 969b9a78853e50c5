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

    /// The consumer warpgroups, and for two of them a producer warpgroup
    /// (kernels/int4_gemm.cu: warp-specialized blocks).
    fn block_threads(self) -> usize {
        self.threads() + if self.warpgroups == 2 { 128 } else { 0 }
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
    /// Default: the plan a cost model expects to be fastest (see
    /// [`W4Gemm::plan`]). `stream_k: false`
    /// (`NANOINFER_CUDA_W4_STREAM_K=0`): never a tile split among blocks
    /// (stream-K or split-K).
    Auto { stream_k: bool },
    /// `1` (narrow), `2` (wide) or `3` (tall): always that shape, one block
    /// per tile, for measurements.
    Fixed(BlockShape),
    /// `4` (wide) or `5` (tall): stream-K with that shape wherever the
    /// kernel takes it, for measurements.
    StreamK(BlockShape),
    /// `6`: tall blocks in whole waves, then narrow ones (see
    /// [`Plan::TallThenNarrow`]) wherever both have tiles, for measurements.
    TallThenNarrow,
    /// `7`: tall blocks splitting each tile's chunks evenly (see
    /// [`split_k`]) wherever they fit in a wave, for measurements.
    SplitK,
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

impl Launch {
    /// One block per tile of `rows` activation rows × `n` weight rows.
    fn per_tile(shape: BlockShape, rows: usize, n: usize) -> Launch {
        Launch {
            shape,
            blocks: shape.tiles(rows, n),
        }
    }
}

/// A product's launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Plan {
    /// One launch over every weight row.
    One(Launch),
    /// Tall blocks, one per tile, over the first `tall_rows` weight rows
    /// (whole waves of them), then narrow blocks, one per tile, over the
    /// rest: a last wave of tall tiles that would leave most SMs idle runs
    /// as narrow tiles, which take 0.6 of a tall tile's time (H100, gate/up
    /// at 512 rows: 3 waves + 104 narrow tiles instead of 3.4 waves).
    TallThenNarrow { tall_rows: usize },
}

impl Plan {
    /// The launches of a product of `n` weight rows, each with the weight
    /// rows it takes (first, count).
    fn launches(self, rows: usize, n: usize) -> [Option<(Launch, usize, usize)>; 2] {
        match self {
            Plan::One(launch) => [Some((launch, 0, n)), None],
            Plan::TallThenNarrow { tall_rows } => {
                let narrow_rows = n - tall_rows;
                [
                    Some((Launch::per_tile(TALL, rows, tall_rows), 0, tall_rows)),
                    Some((
                        Launch::per_tile(NARROW, rows, narrow_rows),
                        tall_rows,
                        narrow_rows,
                    )),
                ]
            }
        }
    }
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
    /// Tall blocks in whole waves, then narrow blocks over the remaining
    /// weight rows (where there are both).
    TallThenNarrow,
    /// Tall blocks, 2–4 a tile, each taking an equal share of its chunks
    /// (where they fit in one wave).
    TallSplitK,
}

impl W4Gemm {
    pub(super) fn for_device(arch: (i32, i32)) -> W4Gemm {
        if arch != (9, 0) {
            return W4Gemm::Off;
        }
        let blocks = match crate::tuning::var("NANOINFER_CUDA_W4_GEMM").as_deref() {
            Some("0") => return W4Gemm::Off,
            Some("narrow") => W4GemmBlocks::Narrow,
            Some("wide") => W4GemmBlocks::Wide,
            Some("tall") => W4GemmBlocks::Tall,
            Some("wide-stream-k") => W4GemmBlocks::WideStreamK,
            Some("tall-stream-k") => W4GemmBlocks::TallStreamK,
            Some("tall-then-narrow") => W4GemmBlocks::TallThenNarrow,
            Some("tall-split-k") => W4GemmBlocks::TallSplitK,
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
            W4GemmBlocks::TallThenNarrow => W4Gemm::TallThenNarrow,
            W4GemmBlocks::TallSplitK => W4Gemm::SplitK,
        }
    }

    /// The launches of `y[rows, n] = x[rows, k] · wᵀ` on `sm_count` SMs.
    /// Auto takes the cheapest of: one narrow, wide or tall block per tile;
    /// tall blocks in whole waves, then narrow ones; stream-K, one wide
    /// block per SM taking an equal share of all tiles' chunks; tall blocks
    /// splitting each tile's chunks evenly.
    fn plan(self, rows: usize, n: usize, k: usize, sm_count: usize) -> Plan {
        let chunks = k / 64;
        let per_tile = |shape| Launch::per_tile(shape, rows, n);
        let stream_k = |shape: BlockShape| {
            stream_k_blocks(shape.tiles(rows, n), chunks, sm_count)
                .map(|blocks| Launch { shape, blocks })
        };
        let tall_then_narrow = || {
            tall_rows_in_whole_waves(rows, n, sm_count)
                .map(|tall_rows| Plan::TallThenNarrow { tall_rows })
        };
        match self {
            W4Gemm::Fixed(shape) => Plan::One(per_tile(shape)),
            W4Gemm::StreamK(shape) => Plan::One(stream_k(shape).unwrap_or(per_tile(shape))),
            W4Gemm::SplitK => {
                Plan::One(split_k(rows, n, chunks, sm_count).unwrap_or(per_tile(TALL)))
            }
            W4Gemm::TallThenNarrow => tall_then_narrow().unwrap_or(Plan::One(per_tile(TALL))),
            W4Gemm::Auto { stream_k: allowed } => {
                // Tall blocks split tiles evenly: stream-K's uneven pieces
                // were slower (down at 512 rows: 100 µs in 128 blocks, two
                // a tile, against 115 in 132).
                let split = [stream_k(WIDE), split_k(rows, n, chunks, sm_count)]
                    .map(|launch| launch.filter(|_| allowed).map(Plan::One));
                SHAPES
                    .map(|shape| Some(Plan::One(per_tile(shape))))
                    .into_iter()
                    .chain(split)
                    .chain([tall_then_narrow()])
                    .flatten()
                    .map(|plan| (plan_cost(plan, rows, n, chunks, sm_count), plan))
                    .min_by(|(a, _), (b, _)| a.total_cmp(b))
                    .expect("one block per tile is always a candidate")
                    .1
            }
            W4Gemm::Off => unreachable!("no launch without the GEMM"),
        }
    }
}

/// Most tall blocks a tile's chunks are split among (split-K).
const MAX_SPLIT: usize = 4;

/// Tall blocks, the most of them (up to MAX_SPLIT) a tile that one wave
/// holds and its `chunks` allow, each taking an equal share of a tile's
/// chunks: stream-K's arithmetic with the ranges on tile boundaries. None
/// where there would not be two a tile.
fn split_k(rows: usize, n: usize, chunks: usize, sm_count: usize) -> Option<Launch> {
    let tiles = TALL.tiles(rows, n);
    let split = (sm_count / tiles).min(MAX_SPLIT).min(chunks);
    (split >= 2 && shares_fit(tiles, chunks, split * tiles)).then_some(Launch {
        shape: TALL,
        blocks: split * tiles,
    })
}

/// The weight rows tall blocks take in whole waves (a multiple of their
/// weight rows), where they are followed by narrow blocks over the rest:
/// None where tall tiles fill no whole wave or exactly fill theirs.
fn tall_rows_in_whole_waves(rows: usize, n: usize, sm_count: usize) -> Option<usize> {
    let row_blocks = rows.div_ceil(TALL.tokens);
    let whole_waves = TALL.tiles(rows, n) / sm_count;
    let tall_rows = whole_waves * sm_count / row_blocks * TALL.weight_rows();
    (tall_rows > 0 && tall_rows < n).then_some(tall_rows)
}

// Times of the launches, in the time a wide block takes for one chunk
// (H100, the 8B layer's products at 256–1 024 rows, w4_bench; the int4 GEMM
// entries of docs/benchmarks-log.md). Stream-K pays for its pieces: restarting the stage
// pipeline, writing partial sums and adding them up cost ~30 chunks' time
// per block; split-K, its pieces on tile boundaries, ~24 (18–27 measured).
const STREAM_K_COST: f64 = 30.0;
const SPLIT_K_COST: f64 = 24.0;

fn plan_cost(plan: Plan, rows: usize, n: usize, chunks: usize, sm_count: usize) -> f64 {
    let launch_cost = |launch: Launch, n: usize| {
        let (shape, tiles) = (launch.shape, launch.shape.tiles(rows, n));
        if launch.blocks == tiles {
            let waves = tiles.div_ceil(sm_count) as f64;
            shape.per_tile_cost(waves, chunks as f64)
        } else if launch.blocks.is_multiple_of(tiles) {
            let share = chunks.div_ceil(launch.blocks / tiles) as f64;
            share * shape.chunk_cost() + SPLIT_K_COST
        } else {
            let range = (tiles * chunks).div_ceil(launch.blocks) as f64;
            range * shape.chunk_cost() + STREAM_K_COST
        }
    };
    let launches = plan.launches(rows, n).into_iter().flatten();
    launches.map(|(launch, _, n)| launch_cost(launch, n)).sum()
}

impl BlockShape {
    /// A chunk's time against a wide block's: a narrow block takes 0.52, a
    /// tall one (twice the products, the same dequantization) 0.86.
    fn chunk_cost(self) -> f64 {
        match self {
            NARROW => 0.52,
            TALL => 0.86,
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
/// if the kernel can take it: every range within MAX_PIECES tiles, and
/// [`shares_fit`].
fn stream_k_blocks(tiles: usize, chunks: usize, sm_count: usize) -> Option<usize> {
    let blocks = sm_count.min(tiles * chunks);
    let fits = (tiles * chunks).div_ceil(blocks) <= (MAX_PIECES - 1) * chunks;
    (fits && shares_fit(tiles, chunks, blocks)).then_some(blocks)
}

/// Whether `blocks` can share out `tiles` tiles of `chunks` chunks (stream-K
/// or split-K): the kernel's 32-bit range arithmetic (up to I·(G + 1),
/// w4g_block_of) in range, and a counter per tile.
fn shares_fit(tiles: usize, chunks: usize, blocks: usize) -> bool {
    tiles * chunks * (blocks + 1) < i32::MAX as usize && tiles <= SPLIT_COUNTERS
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
    w4_packed_rows(rows) * cols
}

/// `rows` rounded up to the packed activations' blocks of rows: the grid of
/// `add_rms_norm_w4g` (its blocks past `rows` write the zero rows).
pub fn w4_packed_rows(rows: usize) -> usize {
    rows.div_ceil(PACKED_ROWS) * PACKED_ROWS
}

/// Threads a block of the kernels that write one packed 16-byte piece
/// each (`w4_gemm_pack_x`, `silu_mul_w4g`).
pub const W4_PACKED_THREADS: u32 = 256;

/// Blocks of those kernels for `rows` rows of `cols` inputs.
pub fn w4_packed_blocks(rows: usize, cols: usize) -> u32 {
    (packed_elems(rows, cols) / 8).div_ceil(W4_PACKED_THREADS as usize) as u32
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

    fn w4_gemm_available_or_err(&self) -> Result<()> {
        if self.w4_gemm_available() {
            return Ok(());
        }
        Err(crate::Error::new(
            crate::ErrorKind::Internal,
            "the int4 tensor-core GEMM needs an sm_90 GPU",
        ))
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
        self.w4_gemm_available_or_err()?;
        let pack = &self.kernels.w4_gemm_pack_x;
        self.timed(
            || format!("{} {rows}x{}", pack.name, w.cols),
            0,
            || {
                self.launch_raw(
                    pack,
                    (w4_packed_blocks(rows, w.cols), 1, 1),
                    W4_PACKED_THREADS,
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
        self.w4_gemm_launch(rows, w, y, scratch)
    }

    /// [`CudaDevice::w4_gemm`] of activations a kernel before it already
    /// wrote into the start of `scratch` as `w4_gemm_pack_x` writes them
    /// (`add_rms_norm_w4g`, `silu_mul_w4g`: weights without act-order).
    pub fn w4_gemm_packed(&self, rows: usize, w: &W4Matrix, y: u64, scratch: u64) -> Result<()> {
        self.w4_gemm_available_or_err()?;
        if w.has_perm() {
            return Err(crate::Error::new(
                crate::ErrorKind::Internal,
                "act-order int4 weights gather their own activations (w4_gemm)",
            ));
        }
        self.w4_gemm_launch(rows, w, y, scratch)
    }

    /// The GEMM's launches over the packed activations in `scratch`.
    fn w4_gemm_launch(&self, rows: usize, w: &W4Matrix, y: u64, scratch: u64) -> Result<()> {
        let plan = self.w4_gemm.plan(rows, w.rows, w.cols, self.sm_count);
        let partials = scratch + 2 * packed_elems(rows, w.cols) as u64;
        // `launch` over weight rows [first, first + n): its tiles' words
        // and scales/zeros, and its columns of y.
        let run = |launch: Launch, first: usize, n: usize| {
            let (words, sz) = w.rows_from(first);
            self.launch_product(
                launch.shape.kernel(&self.kernels),
                (rows, w),
                (
                    (launch.blocks as u32, 1, 1),
                    launch.shape.block_threads() as u32,
                    launch.shape.smem_bytes() as u32,
                ),
                &[
                    KArg::Ptr(scratch),
                    KArg::I32(rows as i32),
                    KArg::Ptr(words),
                    KArg::Ptr(sz),
                    KArg::I32(w.cols as i32),
                    KArg::I32(w.group as i32),
                    KArg::Ptr(y + 2 * first as u64),
                    KArg::I32(n as i32),
                    KArg::I32(w.rows as i32),
                    KArg::Ptr(partials),
                    KArg::Ptr(self.split_counters.ptr()),
                    KArg::Ptr(self.split_counters.ptr() + 4 * SPLIT_COUNTERS as u64),
                ],
            )
        };
        for (launch, first, n) in plan.launches(rows, w.rows).into_iter().flatten() {
            run(launch, first, n)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(shape: BlockShape, blocks: usize) -> Plan {
        Plan::One(Launch { shape, blocks })
    }

    #[test]
    fn plans_where_they_were_measured_fastest() {
        // H100 (132 SMs), Llama-3-8B's products (w4_bench, the int4 GEMM
        // entries of docs/benchmarks-log.md; µs, the next fastest measured after).
        let auto = W4Gemm::Auto { stream_k: true };
        let (qkv, o, gate_up, down) = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336));
        for (rows, (n, k), plan) in [
            // Narrow blocks, one a tile: QKV at 256 rows 33.6 against 40.3
            // split-K; o at 256 and 512 34.0 / 35.1 against 35.6 / 40.0.
            (256, qkv, launch(NARROW, 96)),
            (256, o, launch(NARROW, 64)),
            (512, o, launch(NARROW, 128)),
            // Tall blocks, one a tile: QKV at 512 rows 51.0 against 63.4;
            // gate/up at 256 99.0 against 121.1 narrow; o at 1 024 55.0
            // against 66.4; down at 1 024 181–194 against 231 narrow.
            (512, qkv, launch(TALL, 96)),
            (256, gate_up, launch(TALL, 224)),
            (1024, o, launch(TALL, 128)),
            (1024, down, launch(TALL, 128)),
            // Tall blocks split 4 and 2 ways: down at 256 rows 64.8
            // against 73.2 stream-K; at 512 100–107 against 114.5.
            (256, down, launch(TALL, 128)),
            (512, down, launch(TALL, 128)),
            // Tall then narrow: gate/up at 512 rows 181–197 against 192–209
            // tall; QKV at 1 024 91.3 against 94.0 narrow.
            (512, gate_up, Plan::TallThenNarrow { tall_rows: 25344 }),
            (1024, qkv, Plan::TallThenNarrow { tall_rows: 4224 }),
            // Stream-K in wide blocks: QKV at 768 rows 80.6 against 94.5
            // narrow; gate/up at 384 163–165 against 183 narrow.
            (768, qkv, launch(WIDE, 132)),
            (384, gate_up, launch(WIDE, 132)),
        ] {
            assert_eq!(auto.plan(rows, n, k, 132), plan, "{rows} rows of {n}x{k}");
        }
    }

    #[test]
    fn split_k_within_one_wave_and_the_chunks() {
        // 32 tall tiles: 4 blocks a tile; 64: 2; 96: none.
        assert_eq!(
            split_k(256, 4096, 64, 132),
            Some(Launch {
                shape: TALL,
                blocks: 128
            })
        );
        assert_eq!(
            split_k(512, 4096, 64, 132),
            Some(Launch {
                shape: TALL,
                blocks: 128
            })
        );
        assert_eq!(split_k(512, 6144, 64, 132), None);
        // Never more blocks a tile than chunks.
        assert_eq!(
            split_k(100, 256, 3, 132),
            Some(Launch {
                shape: TALL,
                blocks: 6
            })
        );
    }

    #[test]
    fn tall_then_narrow_only_with_a_partial_wave() {
        // gate/up at 512 rows: 448 tall tiles; 3 waves are 198 weight blocks.
        assert_eq!(tall_rows_in_whole_waves(512, 28672, 132), Some(198 * 128));
        // Fewer tiles than a wave; exactly two waves (132 blocks × 2 rows).
        assert_eq!(tall_rows_in_whole_waves(512, 4096, 132), None);
        assert_eq!(tall_rows_in_whole_waves(512, 132 * 128, 132), None);
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
    fn without_stream_k_one_block_a_tile_or_tall_then_narrow() {
        let auto = W4Gemm::Auto { stream_k: false };
        let plan = |rows, n| auto.plan(rows, n, 4096, 132);
        assert_eq!(plan(384, 28672), launch(WIDE, 336)); // 2.5 waves; tall: 3.4
        assert_eq!(plan(512, 4096), launch(NARROW, 128));
        assert_eq!(plan(2048, 4096), launch(TALL, 256));
        assert_eq!(
            W4Gemm::Fixed(NARROW).plan(2048, 28672, 4096, 132),
            launch(NARROW, 3584)
        );
    }

    #[test]
    fn stages_fit_in_an_sm() {
        // sm_90: 227 KB of shared memory per block.
        assert!(SHAPES.iter().all(|s| s.smem_bytes() <= 227 << 10));
    }
}
