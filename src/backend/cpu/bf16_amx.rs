//! AMX-BF16 kernel over packed BF16 weights: `out[r, c] = Σ_j bf16(x[r, j]) ·
//! w[c, j]` with `tdpbf16ps`, f32 accumulation.
//!
//! [`PackedBf16`] already is AMX's B-tile layout: 16 consecutive lines of a
//! row block (input pairs `p .. p+16`) are one 1 KiB tile of 16 rows × 64
//! bytes, row `p` holding the 16 outputs' values of inputs `(2p, 2p+1)`. The
//! A tile is 16 activation rows × 32 BF16 inputs of [`Bf16Acts`] (its rows
//! padded to 16 and its inputs to 32 with zeros). Every tile is 16 rows × 64
//! bytes, so one configuration serves all: C tiles `tmm0..3` (2 × 2: 32
//! rows × 32 columns), A tiles `tmm4, 5`, B tiles `tmm6, 7`, the whole `k`
//! loop inside. The last, partial, 32 inputs of a block are copied into a
//! zero-padded tile once per call (the packed matrix has no padding pairs to
//! read); partial C tiles (rows past `m`, columns past the weight's rows) go
//! through a scratch tile.
//!
//! Stable Rust has no AMX intrinsics: the instructions are inline `asm!`
//! behind the [`Tiles`] trait, which a scalar model ([`tests`]) also
//! implements, so the tiling is tested on CPUs without AMX.

use super::bf16::{Line, PackedBf16, BLOCK_ROWS};
use super::bf16_hw::Bf16Acts;
use std::mem::MaybeUninit;

/// Tile bytes per row, and the bytes of a chunk of 32 inputs of one A row.
const TILE_ROW_BYTES: usize = 64;
/// Rows of every tile (activation rows of A and C, input pairs of B).
const TILE_ROWS: usize = 16;
/// Input pairs of one k step (one B tile).
const STEP_PAIRS: usize = TILE_ROWS;
/// Row blocks per column group: their last partial B tiles are copied once
/// per group, the group's weights (≤ 8 × k × 32 bytes) stay in L2 while
/// every row tile passes over them, and each pair of A tiles is read from L2
/// once and then from L1 by the group's other column pairs.
const GROUP_BLOCKS: usize = 8;

/// The tile registers' operations (AMX instructions, or a scalar model).
/// Tiles are 16 rows × 64 bytes.
pub(crate) trait Tiles {
    /// Tile `T` = 0.
    unsafe fn zero<const T: u8>(&mut self);
    /// Tile `T` = 16 rows of 64 bytes at `p`, `stride` bytes apart.
    unsafe fn load<const T: u8>(&mut self, p: *const u8, stride: usize);
    /// `C[i][j] += Σ_p A[i].bf16[2p + h] · B[p].bf16[2j + h]`, `h` in 0, 1.
    unsafe fn dot<const C: u8, const A: u8, const B: u8>(&mut self);
    /// Tile `T` to 16 rows of 64 bytes at `p`, `stride` bytes apart.
    unsafe fn store<const T: u8>(&mut self, p: *mut u8, stride: usize);
}

/// The AMX instructions. The tiles must be configured as [`TILE_CONFIG`].
#[cfg(target_arch = "x86_64")]
struct Amx;

#[cfg(target_arch = "x86_64")]
impl Tiles for Amx {
    #[inline(always)]
    unsafe fn zero<const T: u8>(&mut self) {
        // SAFETY (all four): the caller runs on an AMX-BF16 CPU with the
        // tiles configured; loads and stores touch exactly 16 rows of 64
        // bytes at `p + i·stride`, which the caller guarantees are valid.
        std::arch::asm!("tilezero tmm{t}", t = const T, options(nostack, preserves_flags));
    }
    #[inline(always)]
    unsafe fn load<const T: u8>(&mut self, p: *const u8, stride: usize) {
        std::arch::asm!(
            "tileloadd tmm{t}, [{p} + {s}*1]",
            t = const T, p = in(reg) p, s = in(reg) stride,
            options(nostack, preserves_flags)
        );
    }
    #[inline(always)]
    unsafe fn dot<const C: u8, const A: u8, const B: u8>(&mut self) {
        std::arch::asm!(
            "tdpbf16ps tmm{c}, tmm{a}, tmm{b}",
            c = const C, a = const A, b = const B,
            options(nostack, preserves_flags)
        );
    }
    #[inline(always)]
    unsafe fn store<const T: u8>(&mut self, p: *mut u8, stride: usize) {
        std::arch::asm!(
            "tilestored [{p} + {s}*1], tmm{t}",
            t = const T, p = in(reg) p, s = in(reg) stride,
            options(nostack, preserves_flags)
        );
    }
}

/// `ldtilecfg`'s 64-byte operand: palette 1, then bytes per row of each
/// tile (u16 at byte 16 + 2t) and rows (u8 at byte 48 + t); unused tiles
/// and reserved bytes are 0.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

const TILE_CONFIG: TileConfig = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = TILE_ROW_BYTES as u8;
        c[48 + t] = TILE_ROWS as u8;
        t += 1;
    }
    TileConfig(c)
};

/// `out[r, b·16 + j] = Σ_k bf16(x[r, k]) · w[b·16 + j, k]` for rows `r < a.m`
/// and the weight rows of blocks `b0..b1`, on AMX. Configures the tiles of
/// this thread (another user of AMX on it reloads its own configuration)
/// and releases them at the end, so the core can reach its deep idle states.
///
/// # Safety
/// The CPU runs AMX-BF16 and the OS lets this process use it
/// ([`super::isa::has_amx_bf16`]); `a` was converted with `k == w.cols`;
/// `out` points at an `[a.m, stride]` buffer whose columns
/// `b0·16 .. min(b1·16, w.rows)` belong to this call.
#[cfg(target_arch = "x86_64")]
pub unsafe fn amx_blocks(
    a: &Bf16Acts,
    w: &PackedBf16,
    b0: usize,
    b1: usize,
    out: *mut f32,
    stride: usize,
) {
    static CONFIG: TileConfig = TILE_CONFIG;
    // SAFETY: AMX is available (caller); the operand is the 64-byte
    // configuration above (palette 1, 8 tiles of 16 × 64 bytes).
    std::arch::asm!(
        "ldtilecfg [{}]",
        in(reg) &CONFIG as *const TileConfig,
        options(nostack, preserves_flags)
    );
    amx_blocks_with(&mut Amx, a, w, b0, b1, out, stride);
    // SAFETY: AMX is available; returns the tiles to their initial state.
    std::arch::asm!("tilerelease", options(nostack, preserves_flags));
}

/// # Safety
/// Never called: AMX is not detected off x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub unsafe fn amx_blocks(_: &Bf16Acts, _: &PackedBf16, _: usize, _: usize, _: *mut f32, _: usize) {
    unreachable!("AMX is never detected off x86_64")
}

/// A 16 × 16 f32 C tile, or 16 B-tile rows: one 1 KiB tile, aligned.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct TileBuf([Line; TILE_ROWS]);

const ZERO_TILE: TileBuf = TileBuf([Line([0; 2 * BLOCK_ROWS]); TILE_ROWS]);

/// What one 2 × 2 (or smaller) tile job reads and writes.
struct Job {
    /// Row tile `i`'s A data starts at `a + i·16·a_stride`.
    a: *const u8,
    a_stride: usize,
    /// Column tile `j`'s B tiles: `b[j] + s·1024` for full k step `s`.
    b: [*const u8; 2],
    /// Column tile `j`'s last, partial, B tile (if `tail`).
    b_tail: [*const u8; 2],
    full_steps: usize,
    tail: bool,
    /// C tile `(i, j)` goes to `out + i·16·stride + j·16` (f32 elements),
    /// its first `rows[i]` rows and `cols[j]` columns.
    out: *mut f32,
    stride: usize,
    rows: [usize; 2],
    cols: [usize; 2],
}

/// The tiling over any [`Tiles`]: column groups of up to 4 blocks, row
/// tiles in pairs over them, column tiles in pairs inside.
///
/// # Safety
/// As [`amx_blocks`], with `tiles` usable (configured, for AMX).
pub(crate) unsafe fn amx_blocks_with<T: Tiles>(
    tiles: &mut T,
    a: &Bf16Acts,
    w: &PackedBf16,
    b0: usize,
    b1: usize,
    out: *mut f32,
    stride: usize,
) {
    debug_assert!(a.k == w.cols && b1 <= w.rows.div_ceil(BLOCK_ROWS));
    let full_steps = w.steps / STEP_PAIRS;
    let tail_pairs = w.steps % STEP_PAIRS;
    debug_assert!(a.stride >= (full_steps + usize::from(tail_pairs > 0)) * 2 * STEP_PAIRS);
    let a_stride = a.stride * 2;
    let row_tiles = a.m.div_ceil(TILE_ROWS);
    // Lines past `tail_pairs` stay zero: A's padding inputs are zero too, so
    // nothing but zeros meets them.
    let mut tails = [ZERO_TILE; GROUP_BLOCKS];
    let mut g = b0;
    while g < b1 {
        let gb = (b1 - g).min(GROUP_BLOCKS);
        for (i, t) in tails.iter_mut().enumerate().take(gb) {
            let src = w.block_ptr(g + i).add(full_steps * STEP_PAIRS);
            std::ptr::copy_nonoverlapping(src, t.0.as_mut_ptr(), tail_pairs);
        }
        let mut rt = 0;
        while rt < row_tiles {
            let mt = (row_tiles - rt).min(2);
            let r0 = rt * TILE_ROWS;
            let rows = |i: usize| (a.m - r0).saturating_sub(i * TILE_ROWS).min(TILE_ROWS);
            let mut cb = 0;
            while cb < gb {
                let nt = (gb - cb).min(2);
                let block = g + cb;
                let c0 = block * BLOCK_ROWS;
                let cols = |j: usize| (w.rows - c0).saturating_sub(j * BLOCK_ROWS).min(BLOCK_ROWS);
                let last = cb + nt - 1;
                let job = Job {
                    a: a.row_ptr(r0) as *const u8,
                    a_stride,
                    b: [
                        w.block_ptr(block) as *const u8,
                        w.block_ptr(g + last) as *const u8,
                    ],
                    b_tail: [
                        tails[cb].0.as_ptr() as *const u8,
                        tails[last].0.as_ptr() as *const u8,
                    ],
                    full_steps,
                    tail: tail_pairs > 0,
                    out: out.add(r0 * stride + c0),
                    stride,
                    rows: [rows(0), rows(1)],
                    cols: [cols(0), cols(1)],
                };
                match (mt, nt) {
                    (2, 2) => tile_job::<T, 2, 2>(tiles, &job),
                    (2, _) => tile_job::<T, 2, 1>(tiles, &job),
                    (_, 2) => tile_job::<T, 1, 2>(tiles, &job),
                    _ => tile_job::<T, 1, 1>(tiles, &job),
                }
                cb += nt;
            }
            rt += mt;
        }
        g += gb;
    }
}

/// One k step of `MT × NT` C tiles from A at `a` and B tiles at `b`.
#[inline(always)]
unsafe fn step<T: Tiles, const MT: usize, const NT: usize>(
    tiles: &mut T,
    a: *const u8,
    a_stride: usize,
    b: [*const u8; 2],
) {
    tiles.load::<4>(a, a_stride);
    tiles.load::<6>(b[0], TILE_ROW_BYTES);
    tiles.dot::<0, 4, 6>();
    if NT == 2 {
        tiles.load::<7>(b[1], TILE_ROW_BYTES);
        tiles.dot::<1, 4, 7>();
    }
    if MT == 2 {
        tiles.load::<5>(a.add(TILE_ROWS * a_stride), a_stride);
        tiles.dot::<2, 5, 6>();
        if NT == 2 {
            tiles.dot::<3, 5, 7>();
        }
    }
}

#[inline(always)]
unsafe fn tile_job<T: Tiles, const MT: usize, const NT: usize>(tiles: &mut T, job: &Job) {
    tiles.zero::<0>();
    if NT == 2 {
        tiles.zero::<1>();
    }
    if MT == 2 {
        tiles.zero::<2>();
        if NT == 2 {
            tiles.zero::<3>();
        }
    }
    const STEP_B_BYTES: usize = STEP_PAIRS * TILE_ROW_BYTES;
    const STEP_A_BYTES: usize = 2 * STEP_PAIRS * 2;
    for s in 0..job.full_steps {
        let b = [
            job.b[0].add(s * STEP_B_BYTES),
            job.b[1].add(s * STEP_B_BYTES),
        ];
        step::<T, MT, NT>(tiles, job.a.add(s * STEP_A_BYTES), job.a_stride, b);
    }
    if job.tail {
        let a = job.a.add(job.full_steps * STEP_A_BYTES);
        step::<T, MT, NT>(tiles, a, job.a_stride, job.b_tail);
    }
    // All four tiles are stored before any partial one is copied out, so no
    // call (`memcpy`) runs between tile instructions that depend on each other.
    let mut scratch = MaybeUninit::<[TileBuf; 4]>::uninit();
    let scratch = scratch.as_mut_ptr() as *mut TileBuf;
    store::<T, 0>(tiles, job, 0, 0, scratch);
    if NT == 2 {
        store::<T, 1>(tiles, job, 0, 1, scratch.add(1));
    }
    if MT == 2 {
        store::<T, 2>(tiles, job, 1, 0, scratch.add(2));
        if NT == 2 {
            store::<T, 3>(tiles, job, 1, 1, scratch.add(3));
        }
    }
    for i in 0..MT {
        for j in 0..NT {
            let (rows, cols) = (job.rows[i], job.cols[j]);
            if rows == TILE_ROWS && cols == BLOCK_ROWS {
                continue;
            }
            // SAFETY: `store` wrote this scratch tile (all 16 × 16 values).
            let c = scratch.add(2 * i + j) as *const f32;
            let out = job.out.add(i * TILE_ROWS * job.stride + j * BLOCK_ROWS);
            for r in 0..rows {
                std::ptr::copy_nonoverlapping(c.add(r * BLOCK_ROWS), out.add(r * job.stride), cols);
            }
        }
    }
}

/// C tile `C` (row tile `i`, column tile `j`) straight to `out` when whole,
/// else to `scratch` (whose valid part `tile_job` then copies out).
#[inline(always)]
unsafe fn store<T: Tiles, const C: u8>(
    tiles: &mut T,
    job: &Job,
    i: usize,
    j: usize,
    scratch: *mut TileBuf,
) {
    if job.rows[i] == TILE_ROWS && job.cols[j] == BLOCK_ROWS {
        let out = job.out.add(i * TILE_ROWS * job.stride + j * BLOCK_ROWS);
        tiles.store::<C>(out as *mut u8, job.stride * 4);
    } else {
        tiles.store::<C>(scratch as *mut u8, TILE_ROW_BYTES);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::bf16_hw::testing::{check_grid, shapes};
    use super::super::bf16_hw::{bf16_to_f32, Bf16Path};
    use super::*;

    /// The tile registers in memory, with `tdpbf16ps`'s arithmetic as the
    /// SDM writes it (per C element: the even and the odd products summed
    /// in two f32 partial sums over the tile's 16 pairs, then added to C),
    /// denormals kept.
    pub(crate) struct ModelTiles([[u32; 256]; 8]);

    impl ModelTiles {
        pub(crate) fn new() -> ModelTiles {
            ModelTiles([[0; 256]; 8])
        }
    }

    impl Tiles for ModelTiles {
        unsafe fn zero<const T: u8>(&mut self) {
            self.0[T as usize] = [0; 256];
        }
        unsafe fn load<const T: u8>(&mut self, p: *const u8, stride: usize) {
            for r in 0..16 {
                for c in 0..16 {
                    let v = (p.add(r * stride + 4 * c) as *const u32).read_unaligned();
                    self.0[T as usize][r * 16 + c] = v;
                }
            }
        }
        unsafe fn dot<const C: u8, const A: u8, const B: u8>(&mut self) {
            let (a, b) = (self.0[A as usize], self.0[B as usize]);
            let half = |v: u32, h: usize| bf16_to_f32((v >> (16 * h)) as u16);
            let c = &mut self.0[C as usize];
            for m in 0..16 {
                for n in 0..16 {
                    let mut t = [0f32; 2];
                    for k in 0..16 {
                        for (h, th) in t.iter_mut().enumerate() {
                            *th += half(a[m * 16 + k], h) * half(b[k * 16 + n], h);
                        }
                    }
                    c[m * 16 + n] = (f32::from_bits(c[m * 16 + n]) + (t[0] + t[1])).to_bits();
                }
            }
        }
        unsafe fn store<const T: u8>(&mut self, p: *mut u8, stride: usize) {
            for r in 0..16 {
                for c in 0..16 {
                    let v = self.0[T as usize][r * 16 + c];
                    (p.add(r * stride + 4 * c) as *mut u32).write_unaligned(v);
                }
            }
        }
    }

    /// The tiling (row and column tails, partial k steps, column groups,
    /// block ranges) on the scalar model of the tiles: runs on any CPU.
    #[test]
    fn bf16_amx_tiling_on_model_matches_reference() {
        let kernel = |a: &Bf16Acts, w: &PackedBf16, b0, b1, out, stride| {
            // SAFETY: the model needs no hardware; buffers come from `check`.
            unsafe { amx_blocks_with(&mut ModelTiles::new(), a, w, b0, b1, out, stride) }
        };
        check_grid("amx model", &kernel, &shapes(20_000_000));
    }

    /// The AMX instructions (Sapphire Rapids+), every shape of the grid.
    #[test]
    #[cfg_attr(not(target_arch = "x86_64"), allow(clippy::needless_return))]
    fn bf16_amx_matches_reference() {
        if !super::super::bf16_hw::available(Bf16Path::Amx) {
            println!("skipped: no AMX-BF16");
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            let kernel = |a: &Bf16Acts, w: &PackedBf16, b0, b1, out, stride| {
                // SAFETY: AMX is available (checked above); buffers come from `check`.
                unsafe { amx_blocks(a, w, b0, b1, out, stride) }
            };
            check_grid("amx", &kernel, &shapes(usize::MAX));
        }
    }
}
