//! AVX-512 BF16 kernel over packed BF16 weights: `out[r, c] = Σ_j
//! bf16(x[r, j]) · w[c, j]` with `vdpbf16ps`, f32 accumulation.
//!
//! Each 64-byte line of [`PackedBf16`] (16 outputs × inputs `(2p, 2p+1)`)
//! is one `vdpbf16ps` operand as loaded; the other is an activation row's
//! pair `(2p, 2p+1)` of [`Bf16Acts`] broadcast as one 32-bit value. So one
//! instruction does the 32 multiply-adds the f32 kernels of
//! `bf16_kernels.rs` need two widenings and two FMAs for. Register tiles and
//! loop orders are theirs: up to 8 rows × 2 blocks, row groups of nearly
//! equal size, blocks outside for few groups (batched decode, with the
//! groups sharing the prefetch of the next blocks) and inside for many
//! (prefill).
//!
//! The kernel is written over the [`DotOps`] trait, which a scalar model
//! ([`tests`]) also implements, so the tiling is tested on CPUs without
//! AVX-512 BF16.

use super::bf16::{Line, PackedBf16, BLOCK_ROWS};
use super::bf16_hw::Bf16Acts;
use super::packed_kernels::schedule_tiles;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// The vector operations of the kernel (AVX-512 BF16, or a scalar model).
pub(crate) trait DotOps {
    /// 16 f32 accumulators.
    type Acc: Copy;
    /// One line: 16 × 2 BF16 weights.
    type W: Copy;
    /// One BF16 pair, broadcast.
    type X: Copy;
    unsafe fn zero() -> Self::Acc;
    unsafe fn load(line: *const Line) -> Self::W;
    /// The 32-bit pair at `pair` (4-byte aligned).
    unsafe fn broadcast(pair: *const u16) -> Self::X;
    /// `acc[i] + w[i].even · x.even + w[i].odd · x.odd`.
    unsafe fn dot(acc: Self::Acc, w: Self::W, x: Self::X) -> Self::Acc;
    unsafe fn add(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// The first `valid` (1..=16) lanes to `out`.
    unsafe fn store(out: *mut f32, v: Self::Acc, valid: usize);
    unsafe fn prefetch(line: *const Line);
    /// Runs [`tile`] with these operations, `R` rows × `NB` blocks (a
    /// function of its own, compiled for the operations' instruction set).
    unsafe fn tile<const R: usize, const NB: usize>(t: Tile);
}

/// `out[r, b·16 + j] = Σ_k bf16(x[r, k]) · w[b·16 + j, k]` for rows `r < a.m`
/// and the weight rows of blocks `b0..b1`, on AVX-512 BF16.
///
/// # Safety
/// The CPU runs AVX-512 BF16 ([`super::isa::has_avx512_bf16`]); `a` was
/// converted with `k == w.cols`; `out` points at an `[a.m, stride]` buffer
/// whose columns `b0·16 .. min(b1·16, w.rows)` belong to this call.
pub unsafe fn dot_blocks(
    a: &Bf16Acts,
    w: &PackedBf16,
    b0: usize,
    b1: usize,
    out: *mut f32,
    stride: usize,
) {
    #[cfg(target_arch = "x86_64")]
    dot_blocks_with::<Avx512Bf16>(a, w, b0, b1, out, stride);
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!(
        "AVX-512 BF16 is never detected off x86_64: {a:p} {w:p} {b0} {b1} {out:p} {stride}"
    );
}

/// How far ahead (in lines of one block) the 1–2 row tiles prefetch.
const PREFETCH_LINES: usize = 32;
/// Most activation rows of one register tile.
const MAX_ROWS: usize = 8;

/// The kernel's loops over any [`DotOps`].
///
/// # Safety
/// As [`dot_blocks`], with `O`'s instructions available.
pub(crate) unsafe fn dot_blocks_with<O: DotOps>(
    a: &Bf16Acts,
    w: &PackedBf16,
    b0: usize,
    b1: usize,
    out: *mut f32,
    stride: usize,
) {
    debug_assert!(a.k == w.cols && b1 <= w.rows.div_ceil(BLOCK_ROWS));
    let m = a.m;
    if m == 0 {
        return;
    }
    let run = |r: usize, mr: usize, b: usize, nb: usize, ahead: (usize, usize)| {
        let t = Tile {
            ahead,
            x: a.row_ptr(r),
            x_stride: a.stride,
            pairs: w.steps,
            w: w.block_ptr(b),
            out: out.add(r * stride + b * BLOCK_ROWS),
            stride,
            valid: (w.rows - b * BLOCK_ROWS).min(nb * BLOCK_ROWS),
        };
        dispatch::<O>(mr, nb, t);
    };
    schedule_tiles(m, MAX_ROWS, b0, b1, true, true, run);
}

unsafe fn dispatch<O: DotOps>(mr: usize, nb: usize, t: Tile) {
    match (mr, nb) {
        (1, 2) => O::tile::<1, 2>(t),
        (2, 2) => O::tile::<2, 2>(t),
        (3, 2) => O::tile::<3, 2>(t),
        (4, 2) => O::tile::<4, 2>(t),
        (5, 2) => O::tile::<5, 2>(t),
        (6, 2) => O::tile::<6, 2>(t),
        (7, 2) => O::tile::<7, 2>(t),
        (_, 2) => O::tile::<8, 2>(t),
        (1, _) => O::tile::<1, 1>(t),
        (2, _) => O::tile::<2, 1>(t),
        (3, _) => O::tile::<3, 1>(t),
        (4, _) => O::tile::<4, 1>(t),
        (5, _) => O::tile::<5, 1>(t),
        (6, _) => O::tile::<6, 1>(t),
        (7, _) => O::tile::<7, 1>(t),
        _ => O::tile::<8, 1>(t),
    }
}

/// One register tile's operands: rows of BF16 pairs from `x` (`x_stride`
/// values apart), blocks of lines from `w` (`pairs` lines apart), `valid`
/// output columns of `out` (`stride` apart). Tiles of more than 2 rows
/// prefetch line `p` of the `ahead.1` blocks from block `ahead.0` (counted
/// from `w`) as they read their own line `p`.
#[derive(Clone, Copy)]
pub(crate) struct Tile {
    ahead: (usize, usize),
    x: *const u16,
    x_stride: usize,
    pairs: usize,
    w: *const Line,
    out: *mut f32,
    stride: usize,
    valid: usize,
}

/// `R` rows × `NB` blocks. Small tiles alternate two accumulators per
/// output vector (even and odd pairs) so enough dot chains run in parallel.
#[inline(always)]
pub(crate) unsafe fn tile<O: DotOps, const R: usize, const NB: usize>(t: Tile) {
    let odd = usize::from(R * NB <= 4);
    let mut acc = [[[O::zero(); 2]; NB]; R];
    let mut p = 0;
    while p + 2 <= t.pairs {
        pair_step::<O, R, NB>(&mut acc, &t, p, 0);
        pair_step::<O, R, NB>(&mut acc, &t, p + 1, odd);
        p += 2;
    }
    if p < t.pairs {
        pair_step::<O, R, NB>(&mut acc, &t, p, 0);
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (n, a) in acc_r.iter().enumerate() {
            let v = if odd == 1 { O::add(a[0], a[1]) } else { a[0] };
            let valid = t.valid.saturating_sub(n * BLOCK_ROWS).min(BLOCK_ROWS);
            O::store(t.out.add(r * t.stride + n * BLOCK_ROWS), v, valid);
        }
    }
}

/// Pair `p` of every row into accumulator set `s`.
#[inline(always)]
unsafe fn pair_step<O: DotOps, const R: usize, const NB: usize>(
    acc: &mut [[[O::Acc; 2]; NB]; R],
    t: &Tile,
    p: usize,
    s: usize,
) {
    let mut wv = [O::load(t.w.add(p)); NB];
    for (n, v) in wv.iter_mut().enumerate() {
        // Few rows are bound by memory: ask for the stream early. More
        // rows: fetch the same line of the next blocks, spreading their
        // reads over this tile's work.
        if R <= 2 {
            O::prefetch(t.w.wrapping_add(n * t.pairs + p + PREFETCH_LINES));
        } else if n < t.ahead.1 {
            O::prefetch(t.w.wrapping_add((t.ahead.0 + n) * t.pairs + p));
        }
        if n > 0 {
            *v = O::load(t.w.add(n * t.pairs + p));
        }
    }
    for (r, acc_r) in acc.iter_mut().enumerate() {
        let x = O::broadcast(t.x.add(r * t.x_stride + 2 * p));
        for (a, v) in acc_r.iter_mut().zip(&wv) {
            a[s] = O::dot(a[s], *v, x);
        }
    }
}

/// The AVX-512 BF16 instructions.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Avx512Bf16;

#[cfg(target_arch = "x86_64")]
impl DotOps for Avx512Bf16 {
    type Acc = __m512;
    type W = __m512bh;
    type X = __m512bh;
    #[inline]
    #[target_feature(enable = "avx512bf16,avx512f")]
    unsafe fn zero() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline]
    #[target_feature(enable = "avx512bf16,avx512f")]
    unsafe fn load(line: *const Line) -> __m512bh {
        // SAFETY: both are 64 bytes of plain bits.
        std::mem::transmute::<__m512i, __m512bh>(_mm512_load_si512(line as *const __m512i))
    }
    #[inline]
    #[target_feature(enable = "avx512bf16,avx512f")]
    unsafe fn broadcast(pair: *const u16) -> __m512bh {
        let v = _mm512_set1_epi32((pair as *const i32).read());
        // SAFETY: both are 64 bytes of plain bits.
        std::mem::transmute::<__m512i, __m512bh>(v)
    }
    #[inline]
    #[target_feature(enable = "avx512bf16,avx512f")]
    unsafe fn dot(acc: __m512, w: __m512bh, x: __m512bh) -> __m512 {
        _mm512_dpbf16_ps(acc, w, x)
    }
    #[inline]
    #[target_feature(enable = "avx512bf16,avx512f")]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512bf16,avx512f")]
    unsafe fn store(out: *mut f32, v: __m512, valid: usize) {
        let mask = ((1u32 << valid) - 1) as __mmask16;
        _mm512_mask_storeu_ps(out, mask, v);
    }
    #[inline]
    #[target_feature(enable = "avx512bf16,avx512f")]
    unsafe fn prefetch(line: *const Line) {
        _mm_prefetch::<_MM_HINT_T0>(line as *const i8);
    }
    unsafe fn tile<const R: usize, const NB: usize>(t: Tile) {
        tile_avx512_bf16::<R, NB>(t)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512bf16,avx512f")]
unsafe fn tile_avx512_bf16<const R: usize, const NB: usize>(t: Tile) {
    tile::<Avx512Bf16, R, NB>(t)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::bf16_hw::testing::{check_grid, shapes};
    use super::super::bf16_hw::{bf16_to_f32, Bf16Path};
    use super::*;

    /// `vdpbf16ps` as the SDM writes it (odd product, then even, each an
    /// f32 multiply-add), denormals kept.
    pub(crate) struct Model;

    impl DotOps for Model {
        type Acc = [f32; 16];
        type W = [u32; 16];
        type X = u32;
        unsafe fn zero() -> [f32; 16] {
            [0.0; 16]
        }
        unsafe fn load(line: *const Line) -> [u32; 16] {
            let l = &(*line).0;
            std::array::from_fn(|i| u32::from(l[2 * i]) | (u32::from(l[2 * i + 1]) << 16))
        }
        unsafe fn broadcast(pair: *const u16) -> u32 {
            assert_eq!(pair as usize % 4, 0, "pairs are 4-byte aligned");
            u32::from(*pair) | (u32::from(*pair.add(1)) << 16)
        }
        unsafe fn dot(acc: [f32; 16], w: [u32; 16], x: u32) -> [f32; 16] {
            let half = |v: u32, h: u32| bf16_to_f32((v >> (16 * h)) as u16);
            std::array::from_fn(|i| {
                let s = acc[i] + half(w[i], 1) * half(x, 1);
                s + half(w[i], 0) * half(x, 0)
            })
        }
        unsafe fn add(a: [f32; 16], b: [f32; 16]) -> [f32; 16] {
            std::array::from_fn(|i| a[i] + b[i])
        }
        unsafe fn store(out: *mut f32, v: [f32; 16], valid: usize) {
            assert!((1..=16).contains(&valid), "store of {valid} lanes");
            std::ptr::copy_nonoverlapping(v.as_ptr(), out, valid);
        }
        unsafe fn prefetch(_: *const Line) {}
        unsafe fn tile<const R: usize, const NB: usize>(t: Tile) {
            tile::<Model, R, NB>(t)
        }
    }

    /// The tiling (row groups, both loop orders, block pairs and tails, odd
    /// pair counts) on the scalar model: runs on any CPU.
    #[test]
    fn bf16_dot_tiling_on_model_matches_reference() {
        let kernel = |a: &Bf16Acts, w: &PackedBf16, b0, b1, out, stride| {
            // SAFETY: the model needs no hardware; buffers come from `check`.
            unsafe { dot_blocks_with::<Model>(a, w, b0, b1, out, stride) }
        };
        check_grid("avx512bf16 model", &kernel, &shapes(20_000_000));
    }

    /// The AVX-512 BF16 instructions (Zen 4+, Cooper Lake, Sapphire
    /// Rapids+), every shape of the grid.
    #[test]
    fn bf16_dot_avx512bf16_matches_reference() {
        if !super::super::bf16_hw::available(Bf16Path::Dot) {
            println!("skipped: no AVX512-BF16");
            return;
        }
        let kernel = |a: &Bf16Acts, w: &PackedBf16, b0, b1, out, stride| {
            // SAFETY: AVX-512 BF16 is available (checked above); buffers come
            // from `check`.
            unsafe { dot_blocks(a, w, b0, b1, out, stride) }
        };
        check_grid("avx512bf16", &kernel, &shapes(usize::MAX));
    }
}
