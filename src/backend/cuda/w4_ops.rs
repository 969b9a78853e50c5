//! Int4 (W4A16) projections on the device: the fused MMA kernels of
//! `kernels/int4.cu` for small batches, and dequantization to the
//! activation dtype for cuBLAS on large ones.

use super::kernels::{Kernel, Kernels};
use super::w4::{W4Host, CHUNK, TILE_ROWS};
use super::{cuda_error, CudaDevice, DeviceBuffer, KArg, Staging};
use crate::{Error, ErrorKind, Result};
use cudarc::driver::sys::CUfunction_attribute;

/// An int4 matrix on the device, in the layout of [`W4Host`].
pub struct W4Matrix {
    pub rows: usize,
    pub cols: usize,
    pub group: usize,
    words: DeviceBuffer<u32>,
    sz: DeviceBuffer<u32>,
    /// GPTQ act-order: the activations are gathered through it first.
    perm: Option<DeviceBuffer<u32>>,
}

impl W4Matrix {
    /// Uploads parts stacked row-wise (each part's rows are whole tiles, so
    /// stacking is concatenation); all parts share `cols` and `group`.
    pub fn upload(
        dev: &CudaDevice,
        parts: &[W4Host],
        mut staging: Option<&mut Staging>,
    ) -> Result<W4Matrix> {
        let first = &parts[0];
        if let Some(p) = parts
            .iter()
            .find(|p| p.cols != first.cols || p.group != first.group)
        {
            crate::bail_model!(
                "int4 matrices stacked for one projection differ: [{}, {}] group {} and [{}, {}] group {}",
                first.rows,
                first.cols,
                first.group,
                p.rows,
                p.cols,
                p.group
            );
        }
        if parts.iter().any(|p| p.perm != first.perm) {
            crate::bail_model!(
                "int4 matrices stacked for one projection have different act-order (g_idx) \
                 permutations; they share their input, so the CUDA kernels need one"
            );
        }
        let perm = match &first.perm {
            Some(p) => {
                let mut buf = dev.alloc::<u32>(p.len())?;
                dev.upload(p, &mut buf)?;
                Some(buf)
            }
            None => None,
        };
        let n_words: usize = parts.iter().map(|p| p.words.len()).sum();
        let n_sz: usize = parts.iter().map(|p| p.sz.len()).sum();
        let mut words = dev.alloc::<u32>(n_words)?;
        let mut sz = dev.alloc::<u32>(n_sz)?;
        let (mut wo, mut so) = (0, 0);
        for p in parts {
            dev.upload_with(staging.as_deref_mut(), &p.words, &mut words, wo)?;
            dev.upload_with(staging.as_deref_mut(), &p.sz, &mut sz, so)?;
            wo += p.words.len();
            so += p.sz.len();
        }
        Ok(W4Matrix {
            rows: parts.iter().map(|p| p.rows).sum(),
            cols: first.cols,
            group: first.group,
            words,
            sz,
            perm,
        })
    }

    pub fn bytes(&self) -> usize {
        self.words.bytes() + self.sz.bytes() + self.perm.as_ref().map_or(0, |p| p.bytes())
    }

    pub fn has_perm(&self) -> bool {
        self.perm.is_some()
    }

    pub(super) fn words_ptr(&self) -> u64 {
        self.words.ptr()
    }

    pub(super) fn sz_ptr(&self) -> u64 {
        self.sz.ptr()
    }

    /// Where weight rows from `first` (a multiple of 16: whole tiles) start
    /// in the words and in the scales/zeros: each 16-row tile holds 512
    /// bytes of words per 64-input chunk and 64 bytes of scales/zeros per
    /// group.
    pub(super) fn rows_from(&self, first: usize) -> (u64, u64) {
        let tile = (first / 16) as u64;
        let (chunks, groups) = (
            (self.cols / 64) as u64,
            self.cols.div_ceil(self.group) as u64,
        );
        (
            self.words_ptr() + tile * chunks * 512,
            self.sz_ptr() + tile * groups * 64,
        )
    }

    /// The act-order permutation, or 0 (none).
    pub(super) fn perm_ptr(&self) -> u64 {
        self.perm.as_ref().map_or(0, |p| p.ptr())
    }
}

/// What an int4 product does with its result (W4_OUT_* of kernels/int4.cu).
#[derive(Debug, Clone, Copy)]
pub enum W4Out {
    /// `y[rows, n]` in the activation dtype.
    Act { y: u64 },
    /// `y[rows, n]` as f32: an int4 LM head's logits.
    F32 { y: u64 },
    /// `y[rows, n] += the product`: a residual add, rounded as the norm
    /// kernel's fused add rounds; with a handoff, also the next norm's
    /// input (see [`W4Handoff`]).
    Residual { y: u64, handoff: Option<W4Handoff> },
    /// `out[rows, inter] = silu(gate) * up` of a stacked `[gate; up]`.
    SwiGlu { out: u64 },
    /// A stacked `[q; k; v]`: bias, RoPE, q into the QKV rows, k and v into
    /// the cache slots (see `qkv_pair_store` in kernels/decoder.cu).
    Qkv(QkvEpilogue),
}

/// A residual add that hands the next RMSNorm to the next product (decode
/// batches of at most [`HANDOFF_ROWS`] rows): besides the residual it writes
/// `x · next_norm` to `xs` and adds each row's sum of squares of x into
/// `sums` (zero before; 64-bit fixed point, `W4_SQ_ONE` in int4.cu, so that
/// the sum does not depend on the blocks' order), so the next paired product multiplies `xs` and
/// applies the rows' rstd at the end ([`W4Norm::Sums`]) instead of norming
/// the residual itself.
#[derive(Debug, Clone, Copy)]
pub struct W4Handoff {
    pub xs: u64,
    pub next_norm: u64,
    pub sums: u64,
}

/// How a paired product norms its rows (RMSNorm) on the fly.
#[derive(Debug, Clone, Copy)]
pub enum W4Norm {
    /// The rows are the product's input as they are.
    None,
    /// Residual rows the product norms with `weight` and stages itself
    /// (`w4_norm_fits`).
    Stage { weight: u64, eps: f32 },
    /// Rows a [`W4Handoff`] wrote, with their sums of squares in `sums`.
    /// The product also zeroes `clear` (HANDOFF_ROWS sums: those the next
    /// handoff adds into).
    Sums { sums: u64, eps: f32, clear: u64 },
}

/// W4_HANDOFF_ROWS of kernels/int4.cu: the most rows a norm handoff takes.
pub const HANDOFF_ROWS: usize = 8;

/// The QKV epilogue's buffers and shape (all zero for other epilogues).
#[derive(Debug, Clone, Copy, Default)]
pub struct QkvEpilogue {
    pub qkv: u64,
    pub bias: u64,
    pub rope_cs: u64,
    pub slots: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    /// The caches hold fp8 (W4_OUT_QKV_FP8).
    pub kv_fp8: bool,
    pub nq: usize,
    pub nkv: usize,
    pub head_dim: usize,
}

/// Activation rows one block of the widest kernel covers (8 per n-tile).
const MAX_ROWS_PER_BLOCK: usize = 32;
/// W4_NORM_MAX_ROWS of kernels/int4.cu: the most rows the normed kernel
/// (`w4_mm_t2_n1_norm`, one 8-row activation tile) stages.
const NORM_MAX_ROWS: usize = 8;
/// W4_STAGE_PAD of kernels/int4.cu, in 16-byte units.
const STAGE_PAD: usize = 4;
/// Dynamic shared memory the normed kernel may take: 8 staged rows of 4096
/// inputs (66 KB), within the 99 KB a block may opt in to on sm_80+.
const NORM_SMEM_MAX: usize = 72 << 10;
// With the kernel's static reduction buffer (8 KB) beside it.
const _: () = assert!(NORM_SMEM_MAX + (8 << 10) <= 99 << 10);
/// Warp slots of an SM the int4 kernels' register budget fills (≤ 128
/// registers a thread: two blocks of 8 warps, four of 4, eight of 2).
const WARPS_PER_SM: usize = 16;

/// Warps of each block of an int4 product of `units` units (`W` of
/// kernels/int4.cu's `w4_mm`): the fewest that still fill the SMs. Fewer
/// warps per unit stream longer runs each in fewer waves, but blocks of 4
/// only pay once 8-warp blocks take more than one wave, and blocks of 2
/// once they fill at least 3/4 of the warp slots in one (H100, 8B shapes:
/// gate/up, 896 units, 2 warps; 384 units 4; o and down, 256, 8).
fn block_warps(units: usize, sm_count: usize) -> u32 {
    let slots = WARPS_PER_SM * sm_count;
    let warps_of = |warps_per_block: usize| units * warps_per_block;
    if 4 * warps_of(2) >= 3 * slots {
        2
    } else if warps_of(8) > slots {
        4
    } else {
        8
    }
}
/// Warps of the normed (staging) kernel, `w4_mm_t2_n1_norm`.
const STAGED_KERNEL_WARPS: u32 = 8;
/// W4_DQ_CHUNKS of kernels/int4.cu.
const DEQUANT_CHUNKS: usize = 8;

/// Shared memory the normed kernel stages `rows` rows of `k` inputs in.
fn norm_stage_bytes(rows: usize, k: usize) -> usize {
    rows * (k / 8 + STAGE_PAD) * 16
}

/// Whether `rows` rows of `k` inputs can be normed and staged by the
/// normed kernel (`w4_norm_fits` without the permutation check).
fn norm_staging_fits(rows: usize, k: usize) -> bool {
    rows <= NORM_MAX_ROWS && norm_stage_bytes(rows, k) <= NORM_SMEM_MAX
}

/// Lets the normed kernel take more than the default 48 KB of dynamic
/// shared memory (called once, when the kernels are loaded).
pub(super) fn allow_norm_staging(kernels: &Kernels) -> Result<()> {
    kernels
        .w4_mm_t2_n1_norm
        .func
        .set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            NORM_SMEM_MAX as i32,
        )
        .map_err(|e| cuda_error("raising w4_mm_t2_n1_norm's shared memory limit", e))
}

impl CudaDevice {
    /// Whether a paired product (QKV, gate/up) of `rows` rows by `w` can
    /// take residual rows and norm them itself (`w4_mm`'s `norm`): a
    /// decode batch small enough to stage, and no act-order permutation
    /// (the norm weight is in the activations' order, not the packed one).
    pub fn w4_norm_fits(&self, rows: usize, w: &W4Matrix) -> bool {
        w.perm.is_none() && norm_staging_fits(rows, w.cols)
    }

    /// `x[rows, k] · wᵀ` through the int4 MMA kernels, finished as `out`
    /// says. Weights are read once per 32 activation rows (gate/up: per 16,
    /// the blocks of a unit sharing them in L2). With
    /// `norm` (a paired `out`): how the rows are normed on the fly.
    pub fn w4_mm(&self, x: u64, rows: usize, w: &W4Matrix, out: W4Out, norm: W4Norm) -> Result<()> {
        let (paired, mode, y, units, handoff) = match out {
            W4Out::Act { y } => (false, 0, y, w.rows / TILE_ROWS, None),
            W4Out::F32 { y } => (false, 1, y, w.rows / TILE_ROWS, None),
            W4Out::Residual { y, handoff } => (false, 2, y, w.rows / TILE_ROWS, handoff),
            W4Out::SwiGlu { out } => (true, 3, out, w.rows / 2 / TILE_ROWS, None),
            // W4_OUT_QKV, W4_OUT_QKV_FP8
            W4Out::Qkv(e) => {
                let mode = if e.kv_fp8 { 5 } else { 4 };
                (true, mode, e.qkv, w.rows / 2 / TILE_ROWS, None)
            }
        };
        let fits = match norm {
            W4Norm::None => true,
            W4Norm::Stage { .. } => paired && self.w4_norm_fits(rows, w),
            W4Norm::Sums { .. } => paired && rows <= HANDOFF_ROWS,
        };
        if !fits || (handoff.is_some() && rows > HANDOFF_ROWS) {
            return Err(Error::new(
                ErrorKind::Internal,
                format!(
                    "no int4 kernel norms or hands over a norm for {rows} rows of a {}x{} {} product",
                    w.rows,
                    w.cols,
                    if paired { "paired" } else { "single" }
                ),
            ));
        }
        let per_block = match rows {
            0..=8 => 8,
            9..=16 => 16,
            _ => MAX_ROWS_PER_BLOCK,
        };
        // Gate/up above 16 rows: two 16-row blocks per unit (two blocks per SM,
        // sharing the unit's weights through L2) beat one 32-row block (one
        // per SM, its kernel needs 254 registers): 8B shape, 32 rows 50.0
        // against 55.2 µs, 128 rows 182.6 against 185.8. QKV, o and down
        // lose that way (docs/benchmarks-log.md, the int4 decode kernels).
        let per_block = match out {
            W4Out::SwiGlu { .. } => per_block.min(16),
            _ => per_block,
        };
        let kn = &self.kernels;
        let staged = matches!(norm, W4Norm::Stage { .. });
        let warps = if staged {
            STAGED_KERNEL_WARPS
        } else {
            block_warps(units, self.sm_count)
        };
        // The kernel of `per_block` rows (8, 16 or 32) among one family's three.
        let by_rows = |k8, k16, k32| match per_block {
            8 => k8,
            16 => k16,
            _ => k32,
        };
        let f: &Kernel = match (paired, warps) {
            _ if staged => &kn.w4_mm_t2_n1_norm,
            (false, 8) => by_rows(&kn.w4_mm_t1_n1, &kn.w4_mm_t1_n2, &kn.w4_mm_t1_n4),
            (true, 8) => by_rows(&kn.w4_mm_t2_n1, &kn.w4_mm_t2_n2, &kn.w4_mm_t2_n4),
            (false, 4) => by_rows(&kn.w4_mm_t1_n1_w4, &kn.w4_mm_t1_n2_w4, &kn.w4_mm_t1_n4_w4),
            (true, 4) => by_rows(&kn.w4_mm_t2_n1_w4, &kn.w4_mm_t2_n2_w4, &kn.w4_mm_t2_n4_w4),
            (false, _) => by_rows(&kn.w4_mm_t1_n1_w2, &kn.w4_mm_t1_n2_w2, &kn.w4_mm_t1_n4_w2),
            (true, _) => by_rows(&kn.w4_mm_t2_n1_w2, &kn.w4_mm_t2_n2_w2, &kn.w4_mm_t2_n4_w2),
        };
        let e = match out {
            W4Out::Qkv(e) => e,
            _ => QkvEpilogue::default(),
        };
        let (nw, eps, sums, clear, shared) = match (norm, handoff) {
            (W4Norm::Stage { weight, eps }, _) => {
                (weight, eps, 0, 0, norm_stage_bytes(rows, w.cols) as u32)
            }
            (W4Norm::Sums { sums, eps, clear }, _) => (0, eps, sums, clear, 0),
            (W4Norm::None, Some(h)) => (h.next_norm, 0.0, h.sums, 0, 0),
            (W4Norm::None, None) => (0, 0.0, 0, 0, 0),
        };
        let xs = handoff.map_or(0, |h| h.xs);
        let grid = (rows.div_ceil(per_block) as u32, units as u32, 1);
        self.launch_product(
            f,
            (rows, w),
            (grid, 32 * warps, shared),
            &[
                KArg::Ptr(x),
                KArg::I32(rows as i32),
                KArg::Ptr(w.words.ptr()),
                KArg::Ptr(w.sz.ptr()),
                KArg::I32(w.cols as i32),
                KArg::I32(w.group as i32),
                KArg::I32(mode),
                KArg::Ptr(y),
                KArg::I32(w.rows as i32),
                KArg::Ptr(e.bias),
                KArg::Ptr(e.rope_cs),
                KArg::Ptr(e.slots),
                KArg::Ptr(e.k_cache),
                KArg::Ptr(e.v_cache),
                KArg::I32((w.rows / 2) as i32),
                KArg::I32(e.nq as i32),
                KArg::I32(e.nkv as i32),
                KArg::I32(e.head_dim as i32),
                KArg::Ptr(nw),
                KArg::F32(eps),
                KArg::Ptr(sums),
                KArg::Ptr(clear),
                KArg::Ptr(xs),
            ],
        )
    }

    /// Launches the int4 product kernel `f` of `rows` rows by `w` (timed
    /// under its shape when profiling): `(grid, threads, shared bytes)`.
    pub(super) fn launch_product(
        &self,
        f: &Kernel,
        (rows, w): (usize, &W4Matrix),
        (grid, block, shared): ((u32, u32, u32), u32, u32),
        args: &[KArg],
    ) -> Result<()> {
        self.timed(
            || format!("{} {rows}x{}x{}", f.name, w.rows, w.cols),
            w.bytes(),
            || self.launch_raw(f, grid, block, shared, args),
        )
    }

    /// The activations `w` multiplies: `x` itself, or for act-order weights
    /// `x[rows, cols]` gathered through the permutation into `scratch`.
    pub fn w4_input(&self, x: u64, rows: usize, w: &W4Matrix, scratch: u64) -> Result<u64> {
        let Some(perm) = &w.perm else { return Ok(x) };
        self.launch(
            &self.kernels.w4_gather,
            (rows as u32, 1, 1),
            256,
            &[
                KArg::Ptr(x),
                KArg::Ptr(perm.ptr()),
                KArg::Ptr(scratch),
                KArg::I32(w.cols as i32),
            ],
        )?;
        Ok(scratch)
    }

    /// Writes `w` dequantized (`[rows, cols]`, activation dtype) to `out`.
    pub fn w4_dequant(&self, w: &W4Matrix, out: u64) -> Result<()> {
        let blocks = (w.cols / CHUNK).div_ceil(DEQUANT_CHUNKS);
        let f = &self.kernels.w4_dequant;
        self.timed(
            || format!("{} {}x{}", f.name, w.rows, w.cols),
            w.bytes() + w.rows * w.cols * 2,
            || {
                self.launch_raw(
                    f,
                    (blocks as u32, (w.rows / TILE_ROWS) as u32, 1),
                    32 * DEQUANT_CHUNKS as u32,
                    0,
                    &[
                        KArg::Ptr(w.words.ptr()),
                        KArg::Ptr(w.sz.ptr()),
                        KArg::Ptr(out),
                        KArg::I32(w.cols as i32),
                        KArg::I32(w.group as i32),
                    ],
                )
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_have_the_fewest_warps_that_fill_the_sms() {
        // H100 (132 SMs, 2112 warp slots), Llama-3-8B: gate/up 896 units,
        // a 6144-row single product 384, QKV 192, o and down 256.
        assert_eq!(block_warps(896, 132), 2);
        assert_eq!(block_warps(384, 132), 4);
        assert_eq!(block_warps(192, 132), 8);
        assert_eq!(block_warps(256, 132), 8);
        // The edges: one wave of 8-warp blocks; 3/4 of the slots in 2-warp blocks.
        assert_eq!(block_warps(264, 132), 8);
        assert_eq!(block_warps(265, 132), 4);
        assert_eq!(block_warps(791, 132), 4);
        assert_eq!(block_warps(792, 132), 2);
    }

    #[test]
    fn decode_batches_of_8b_shapes_stage_their_normed_rows() {
        // Llama-3-8B / Qwen2.5-7B hidden sizes: every decode batch the
        // kernel takes (one 8-row tile) fits next to its 8 KB of sums.
        for k in [4096, 3584] {
            assert!((1..=NORM_MAX_ROWS).all(|rows| norm_staging_fits(rows, k)));
            assert!(!norm_staging_fits(NORM_MAX_ROWS + 1, k));
        }
        assert_eq!(norm_stage_bytes(1, 4096), 8256);
        // 70B's 8192: four rows fit, more fall back to the norm kernel.
        assert!(norm_staging_fits(4, 8192));
        assert!(!norm_staging_fits(5, 8192));
    }
}
