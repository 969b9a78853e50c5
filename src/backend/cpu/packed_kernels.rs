//! Kernels over the packed layout of [`Packed`]: `out[r, c] = Σ_j
//! x[r, j] · w[c, j]` with f32 activations and accumulation, for every
//! [`PackedElem`] (F32, BF16, F16).
//!
//! One register tile is up to 8 (F32: 12) activation rows × 2 blocks (16
//! columns each); more rows run as groups of at most that many (8 × 32
//! measured faster than 16 × 16 at 16 rows: 16 broadcasts per 32 FMAs
//! instead of 32). Each 64-byte line (16 columns × `INPUTS` inputs) is
//! widened once and feeds an FMA per activation row and input, with the
//! activation broadcast from memory; outputs come out as whole vectors, so
//! no horizontal sums. Decode (1 row) streams the weights once, front to
//! back; batched decode and prefill reuse every widened vector across all
//! rows of the tile. AVX2: up to 4 rows × 1 block, each line as two halves
//! of 8 rows. Scalar fallback for the rest.

#[cfg(target_arch = "x86_64")]
use super::f32_packed::F32Line;
use super::isa::Isa;
use super::packed::{Packed, PackedElem, BLOCK_ROWS, MAX_TILE_ROWS};

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// `out[r, b·16 + j] = Σ_k x[r, k] · w[b·16 + j, k]` for rows `r < m` and the
/// weight rows of blocks `b0..b1`.
///
/// # Safety
/// `isa` must be supported by the CPU; `x` holds at least `m · w.cols`
/// values; `out` points at an `[m, stride]` buffer whose columns
/// `b0·16 .. min(b1·16, w.rows)` belong to this call.
#[allow(clippy::too_many_arguments)]
pub unsafe fn packed_blocks<E: PackedElem>(
    isa: Isa,
    x: &[f32],
    m: usize,
    w: &Packed<E>,
    b0: usize,
    b1: usize,
    out: *mut f32,
    stride: usize,
) {
    debug_assert!(x.len() >= m * w.cols && b1 <= w.rows.div_ceil(BLOCK_ROWS));
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2Fma && E::INPUTS > 1 && m.div_ceil(AVX2_TILE_ROWS) > FEW_GROUPS {
        return widened_panels(x, m, w, b0, b1, out, stride);
    }
    let k = w.cols;
    let max_rows = match isa {
        Isa::Avx512 => E::TILE_ROWS.min(MAX_TILE_ROWS),
        Isa::Avx2Fma => AVX2_TILE_ROWS,
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => super::neon_packed::TILE_ROWS,
        _ => 4,
    };
    // AVX2 pairs blocks for one row only: two weight streams in flight
    // instead of one (see `tile_avx2_two_blocks`).
    let pair_blocks = isa == Isa::Avx512 || (isa == Isa::Avx2Fma && m == 1);
    let run = |r: usize, mr: usize, b: usize, nb: usize, ahead: (usize, usize)| {
        let t = Tile::<E> {
            ahead,
            x: x.as_ptr().add(r * k),
            k,
            w: w.block_ptr(b),
            steps: w.steps,
            out: out.add(r * stride + b * BLOCK_ROWS),
            stride,
            valid: (w.rows - b * BLOCK_ROWS).min(nb * BLOCK_ROWS),
        };
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => dispatch_avx512(mr, nb, t),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma if nb == 2 => tile_avx2_two_blocks(t),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => dispatch_avx2(mr, t),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => super::neon_packed::tile(mr, neon_tile(t)),
            _ => tile_scalar(mr, t),
        }
    };
    schedule_tiles(m, max_rows, b0, b1, pair_blocks, E::PREFILL_PREFETCH, run);
}

/// F32 lines of one panel: at most this many (128 KiB, so a panel stays in
/// L2 while every row group of the prompt meets it).
#[cfg(target_arch = "x86_64")]
const PANEL_LINES: usize = 2048;

#[cfg(target_arch = "x86_64")]
thread_local! {
    static PANEL: std::cell::RefCell<Vec<F32Line>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Prefill of BF16/F16 weights on AVX2: a panel of blocks is widened to
/// F32 lines once, then every row group runs the F32 tile over it. Widening
/// inside the 6-row tile costs a shift or conversion per 6 FMAs and, for
/// BF16, the raw line's register: with 12 accumulators that spilled, and
/// BF16 prefill ran at 0.7x of F32.
///
/// # Safety
/// That of [`packed_blocks`], with AVX2, FMA and F16C available.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn widened_panels<E: PackedElem>(
    x: &[f32],
    m: usize,
    w: &Packed<E>,
    b0: usize,
    b1: usize,
    out: *mut f32,
    stride: usize,
) {
    let k = w.cols;
    let per_panel = (PANEL_LINES / k.max(1)).max(1);
    PANEL.with(|panel| {
        let panel = &mut *panel.borrow_mut();
        let mut p0 = b0;
        while p0 < b1 {
            let p1 = (p0 + per_panel).min(b1);
            panel.resize((p1 - p0) * k, F32Line::default());
            for b in p0..p1 {
                widen_block::<E>(w.block_ptr(b), k, panel[(b - p0) * k..].as_mut_ptr());
            }
            let run = |r: usize, mr: usize, b: usize, _nb: usize, _ahead: (usize, usize)| {
                let t = Tile::<f32> {
                    ahead: (0, 0),
                    x: x.as_ptr().add(r * k),
                    k,
                    w: panel.as_ptr().add(b * k),
                    steps: k,
                    out: out.add(r * stride + (p0 + b) * BLOCK_ROWS),
                    stride,
                    valid: (w.rows - (p0 + b) * BLOCK_ROWS).min(BLOCK_ROWS),
                };
                dispatch_avx2(mr, t)
            };
            schedule_tiles(m, AVX2_TILE_ROWS, 0, p1 - p0, false, false, run);
            p0 = p1;
        }
    });
}

/// The `k` inputs of one block's lines as `k` F32 lines at `dst`.
///
/// # Safety
/// AVX2 and F16C must be available; `src` holds the block's
/// `k.div_ceil(INPUTS)` lines, `dst` room for `k` lines.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_block<E: PackedElem>(src: *const E::Line, k: usize, dst: *mut F32Line) {
    for j in 0..k {
        let (line, sub) = (src.add(j / E::INPUTS), j % E::INPUTS);
        let d = dst.add(j) as *mut f32;
        for h in 0..2 {
            let v = match sub {
                0 => E::widen256(line, h)[0],
                _ => E::widen256(line, h)[1],
            };
            _mm256_store_ps(d.add(8 * h), v);
        }
    }
}

/// The AVX2 tile for `mr` (1 to [`AVX2_TILE_ROWS`]) rows.
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn dispatch_avx2<E: PackedElem>(mr: usize, t: Tile<E>) {
    match mr {
        1 => tile_avx2::<E, 1>(t),
        2 => tile_avx2::<E, 2>(t),
        3 => tile_avx2::<E, 3>(t),
        4 => tile_avx2::<E, 4>(t),
        5 => tile_avx2_tall::<E, 5>(t),
        _ => tile_avx2_tall::<E, 6>(t),
    }
}

/// Runs a call's register tiles over activation rows `0..m` and weight
/// blocks `b0..b1` in the order that keeps them in cache, as
/// `run(first_row, rows, block, blocks, ahead)`: row groups of at most
/// `max_rows`, of nearly equal size (12 rows: 6 + 6, not 8 + 4), and two
/// blocks per tile where `pair_blocks` (one at the end). `ahead` is what
/// the tile prefetches: (distance in lines of `blocks` blocks, its share).
pub(crate) fn schedule_tiles(
    m: usize,
    max_rows: usize,
    b0: usize,
    b1: usize,
    pair_blocks: bool,
    prefill_prefetch: bool,
    mut run: impl FnMut(usize, usize, usize, usize, (usize, usize)),
) {
    let groups = m.div_ceil(max_rows);
    let group_rows = |g: usize| {
        let r0 = g * m / groups;
        (r0, (g + 1) * m / groups - r0)
    };
    let nb_at = |b: usize| if pair_blocks && b1 - b >= 2 { 2 } else { 1 };
    if groups <= FEW_GROUPS {
        // Batched decode: all rows meet each block while it is in L1, and
        // the tiles prefetch the next blocks, so reading the weights from
        // memory overlaps the FMAs of every group. The groups share that
        // prefetch (with 2 groups, each fetches one of 2 blocks): if the
        // first group fetched it all, its pass would be bound by memory and
        // the next groups' passes would leave memory idle. With several
        // groups it runs a few block steps ahead (measured faster, see
        // GROUP_PREFETCH_STEPS).
        let steps = if groups > 1 { GROUP_PREFETCH_STEPS } else { 1 };
        let mut b = b0;
        while b < b1 {
            let nb = nb_at(b);
            for g in 0..groups {
                let (r, mr) = group_rows(g);
                let (first, end) = (g * nb / groups, (g + 1) * nb / groups);
                run(r, mr, b, nb, (steps * nb + first, end - first));
            }
            b += nb;
        }
    } else {
        // Prefill: a group's activations stay in L1 while it meets every
        // block of this call (which stay in L2 for the next group).
        for g in 0..groups {
            let (r, mr) = group_rows(g);
            let mut b = b0;
            while b < b1 {
                let nb = nb_at(b);
                let ahead = if prefill_prefetch { nb } else { 0 };
                run(r, mr, b, nb, (nb, ahead));
                b += nb;
            }
        }
    }
}

/// With several row groups, how many block steps ahead the prefetch runs
/// (16 rows on 2 threads, BF16: 1 step ahead 27 ms of matmuls per decode
/// step, 3–4 steps ahead 24–25 ms; one group keeps 1).
const GROUP_PREFETCH_STEPS: usize = 4;

/// Up to this many row groups, blocks go in the outer loop.
const FEW_GROUPS: usize = 4;

/// One register tile's operands: `mr` activation rows from `x` (stride
/// `k`), blocks of lines from `w` (`steps` lines apart), `valid` output
/// columns of `out` (stride `stride`). Tiles of more than 2 rows prefetch
/// line `p` of the `ahead.1` blocks from block `ahead.0` (counted from `w`)
/// as they read their own line `p`.
struct Tile<E: PackedElem> {
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    ahead: (usize, usize),
    x: *const f32,
    k: usize,
    w: *const E::Line,
    steps: usize,
    out: *mut f32,
    stride: usize,
    valid: usize,
}

impl<E: PackedElem> Clone for Tile<E> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<E: PackedElem> Copy for Tile<E> {}

/// The operands of a one-block NEON tile (`neon_packed.rs`).
#[cfg(target_arch = "aarch64")]
fn neon_tile<E: PackedElem>(t: Tile<E>) -> super::neon_packed::Tile<E> {
    let Tile {
        x,
        k,
        w,
        out,
        stride,
        valid,
        ..
    } = t;
    super::neon_packed::Tile {
        x,
        k,
        w,
        out,
        stride,
        valid,
    }
}

unsafe fn tile_scalar<E: PackedElem>(mr: usize, t: Tile<E>) {
    for r in 0..mr {
        let x = t.x.add(r * t.k);
        for c in 0..t.valid {
            let (n, i) = (c / BLOCK_ROWS, c % BLOCK_ROWS);
            let lines = t.w.add(n * t.steps);
            let mut s = 0f32;
            for j in 0..t.k {
                let line = &*lines.add(j / E::INPUTS);
                s += *x.add(j) * E::get(line, i, j % E::INPUTS).to_f32();
            }
            *t.out.add(r * t.stride + c) = s;
        }
    }
}

/// How far ahead (in 64-byte lines of one block) the few-row tiles prefetch.
#[cfg(target_arch = "x86_64")]
const PREFETCH_LINES: usize = 32;

#[cfg(target_arch = "x86_64")]
unsafe fn dispatch_avx512<E: PackedElem>(mr: usize, nb: usize, t: Tile<E>) {
    match (mr, nb) {
        (1, 2) => tile_avx512::<E, 1, 2>(t),
        (2, 2) => tile_avx512::<E, 2, 2>(t),
        (3, 2) => tile_avx512::<E, 3, 2>(t),
        (4, 2) => tile_avx512::<E, 4, 2>(t),
        (5, 2) => tile_avx512::<E, 5, 2>(t),
        (6, 2) => tile_avx512::<E, 6, 2>(t),
        (7, 2) => tile_avx512::<E, 7, 2>(t),
        (8, 2) => tile_avx512::<E, 8, 2>(t),
        (9, 2) => tile_avx512::<E, 9, 2>(t),
        (10, 2) => tile_avx512::<E, 10, 2>(t),
        (11, 2) => tile_avx512::<E, 11, 2>(t),
        (_, 2) => tile_avx512::<E, 12, 2>(t),
        (1, _) => tile_avx512::<E, 1, 1>(t),
        (2, _) => tile_avx512::<E, 2, 1>(t),
        (3, _) => tile_avx512::<E, 3, 1>(t),
        (4, _) => tile_avx512::<E, 4, 1>(t),
        (5, _) => tile_avx512::<E, 5, 1>(t),
        (6, _) => tile_avx512::<E, 6, 1>(t),
        (7, _) => tile_avx512::<E, 7, 1>(t),
        (8, _) => tile_avx512::<E, 8, 1>(t),
        (9, _) => tile_avx512::<E, 9, 1>(t),
        (10, _) => tile_avx512::<E, 10, 1>(t),
        (11, _) => tile_avx512::<E, 11, 1>(t),
        _ => tile_avx512::<E, 12, 1>(t),
    }
}

/// Lines per pair of inputs: 2 for F32, 1 for BF16/F16.
pub(super) const fn pair_lines<E: PackedElem>() -> usize {
    2 / E::INPUTS
}

/// Inputs `2q, 2q+1` of a block's 16 rows, from the line(s) at `line`
/// (F32: two lines, so every tile step covers two inputs whatever the
/// format, and the row addresses of the activations are computed once per
/// two inputs).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn pair512<E: PackedElem>(line: *const E::Line) -> [__m512; 2] {
    let load = |l: *const E::Line| E::widen512(_mm512_load_si512(l as *const _));
    if E::INPUTS == 2 {
        load(line)
    } else {
        [load(line)[0], load(line.add(1))[0]]
    }
}

/// [`pair512`] for rows `8h..8h + 8` (AVX2).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pair256<E: PackedElem>(line: *const E::Line, h: usize) -> [__m256; 2] {
    if E::INPUTS == 2 {
        E::widen256(line, h)
    } else {
        [E::widen256(line, h)[0], E::widen256(line.add(1), h)[0]]
    }
}

/// `R` rows × `NB` blocks, two inputs per step. Small tiles keep the even
/// and odd inputs in separate accumulators so enough FMA chains run in
/// parallel.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512<E: PackedElem, const R: usize, const NB: usize>(t: Tile<E>) {
    let split = R * NB <= 4;
    let odd = usize::from(split);
    let pl = pair_lines::<E>();
    let mut acc = [[[_mm512_setzero_ps(); 2]; NB]; R];
    let pairs = t.k / 2;
    for q in 0..pairs {
        let mut wv = [[_mm512_setzero_ps(); 2]; NB];
        for (n, wn) in wv.iter_mut().enumerate() {
            let p = q * pl;
            for l in 0..pl {
                // Few rows are bound by memory: ask for the stream early.
                // More rows: fetch the same line of the next blocks,
                // spreading their reads over this tile's FMAs.
                if R <= 2 {
                    let ahead = n * t.steps + p + l + PREFETCH_LINES;
                    _mm_prefetch::<_MM_HINT_T0>(t.w.wrapping_add(ahead) as *const i8);
                } else if n < t.ahead.1 {
                    let ahead = (t.ahead.0 + n) * t.steps + p + l;
                    _mm_prefetch::<_MM_HINT_T0>(t.w.wrapping_add(ahead) as *const i8);
                }
            }
            *wn = pair512::<E>(t.w.add(n * t.steps + p));
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let x = t.x.add(r * t.k + 2 * q);
            let (xe, xo) = (_mm512_set1_ps(*x), _mm512_set1_ps(*x.add(1)));
            for n in 0..NB {
                acc_r[n][0] = _mm512_fmadd_ps(xe, wv[n][0], acc_r[n][0]);
                acc_r[n][odd] = _mm512_fmadd_ps(xo, wv[n][1], acc_r[n][odd]);
            }
        }
    }
    if t.k % 2 == 1 {
        // Last input alone: the rest of its line is padding (or, for F32,
        // the next line is not read).
        for n in 0..NB {
            let line = t.w.add(n * t.steps + pairs * pl);
            let we = E::widen512(_mm512_load_si512(line as *const _))[0];
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let xe = _mm512_set1_ps(*t.x.add(r * t.k + t.k - 1));
                acc_r[n][0] = _mm512_fmadd_ps(xe, we, acc_r[n][0]);
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (n, a) in acc_r.iter().enumerate() {
            let v = if split {
                _mm512_add_ps(a[0], a[1])
            } else {
                a[0]
            };
            let valid = t.valid.saturating_sub(n * BLOCK_ROWS).min(BLOCK_ROWS);
            let mask = ((1u32 << valid) - 1) as __mmask16;
            _mm512_mask_storeu_ps(t.out.add(r * t.stride + n * BLOCK_ROWS), mask, v);
        }
    }
}

/// `R` rows × 1 block, each line as two halves (rows 0–7, 8–15), two
/// inputs per step.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2<E: PackedElem, const R: usize>(t: Tile<E>) {
    let split = R <= 2;
    let odd = usize::from(split);
    let pl = pair_lines::<E>();
    let mut acc = [[[_mm256_setzero_ps(); 2]; 2]; R];
    let pairs = t.k / 2;
    // F32 lines go without software prefetch: the hardware prefetcher alone
    // streams them faster (prefetching 32 lines ahead cut one-thread F32
    // decode from 37-38 to 30-33 tok/s). 16-bit lines carry twice the work
    // per line (widening, two FMAs per half), fewer of them are in flight
    // in the out-of-order window, and the stream stalls on the load: asking
    // 16 lines ahead took BF16 decode on the 2-core EPYC from 76 to 83 tok/s
    // (2 threads), 41 to 47 (1 thread) (docs/benchmarks-log.md).
    let prefetch = R <= 2 && E::INPUTS == 2;
    for q in 0..pairs {
        let p = q * pl;
        if prefetch {
            let ahead = t.w.wrapping_add(p + WIDENED_PREFETCH_LINES);
            _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
        }
        let wv = [pair256::<E>(t.w.add(p), 0), pair256::<E>(t.w.add(p), 1)];
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let x = t.x.add(r * t.k + 2 * q);
            let (xe, xo) = (_mm256_broadcast_ss(&*x), _mm256_broadcast_ss(&*x.add(1)));
            for h in 0..2 {
                acc_r[h][0] = _mm256_fmadd_ps(xe, wv[h][0], acc_r[h][0]);
                acc_r[h][odd] = _mm256_fmadd_ps(xo, wv[h][1], acc_r[h][odd]);
            }
        }
    }
    if t.k % 2 == 1 {
        let line = t.w.add(pairs * pl);
        let we = [E::widen256(line, 0)[0], E::widen256(line, 1)[0]];
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let xe = _mm256_broadcast_ss(&*t.x.add(r * t.k + t.k - 1));
            for h in 0..2 {
                acc_r[h][0] = _mm256_fmadd_ps(xe, we[h], acc_r[h][0]);
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        let mut row = [0f32; BLOCK_ROWS];
        for (h, a) in acc_r.iter().enumerate() {
            let v = if split {
                _mm256_add_ps(a[0], a[1])
            } else {
                a[0]
            };
            _mm256_storeu_ps(row.as_mut_ptr().add(8 * h), v);
        }
        std::ptr::copy_nonoverlapping(row.as_ptr(), t.out.add(r * t.stride), t.valid);
    }
}

/// How far ahead (in lines of one block) the AVX2 tile of 1–2 rows
/// prefetches 16-bit weights (12, 16 and 24 measured alike; 0 slower).
#[cfg(target_arch = "x86_64")]
const WIDENED_PREFETCH_LINES: usize = 16;

/// Decode on AVX2: one activation row × 2 blocks, so each thread reads two
/// weight streams at once. One stream per thread left the 2-core EPYC's
/// memory idle between a block's line misses: two took 2-thread decode
/// from 84 to 94 tok/s (BF16) and 53 to 59 (F32) (docs/benchmarks-log.md).
/// The sums run in [`tile_avx2`]'s order (even and odd inputs apart, then
/// added), so a row's bits do not depend on which tile computed it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2_two_blocks<E: PackedElem>(t: Tile<E>) {
    let mut acc = [[[_mm256_setzero_ps(); 2]; 2]; 2];
    let pairs = t.k / 2;
    let pl = pair_lines::<E>();
    // As in `tile_avx2`: 16-bit lines prefetched, F32 lines not (measured
    // here too: F32 59 tok/s without, 49 with).
    let pf = E::INPUTS == 2;
    for q in 0..pairs {
        let xe = _mm256_broadcast_ss(&*t.x.add(2 * q));
        let xo = _mm256_broadcast_ss(&*t.x.add(2 * q + 1));
        for (n, acc_n) in acc.iter_mut().enumerate() {
            let line = t.w.add(n * t.steps + q * pl);
            if pf {
                _mm_prefetch::<_MM_HINT_T0>(line.wrapping_add(WIDENED_PREFETCH_LINES) as *const i8);
            }
            for (h, acc_h) in acc_n.iter_mut().enumerate() {
                let w = pair256::<E>(line, h);
                acc_h[0] = _mm256_fmadd_ps(xe, w[0], acc_h[0]);
                acc_h[1] = _mm256_fmadd_ps(xo, w[1], acc_h[1]);
            }
        }
    }
    if t.k % 2 == 1 {
        let xe = _mm256_broadcast_ss(&*t.x.add(t.k - 1));
        for (n, acc_n) in acc.iter_mut().enumerate() {
            let line = t.w.add(n * t.steps + pairs * pl);
            for (h, acc_h) in acc_n.iter_mut().enumerate() {
                acc_h[0] = _mm256_fmadd_ps(xe, E::widen256(line, h)[0], acc_h[0]);
            }
        }
    }
    for (n, acc_n) in acc.iter().enumerate() {
        let mut row = [0f32; BLOCK_ROWS];
        for (h, a) in acc_n.iter().enumerate() {
            _mm256_storeu_ps(row.as_mut_ptr().add(8 * h), _mm256_add_ps(a[0], a[1]));
        }
        let valid = t.valid.saturating_sub(n * BLOCK_ROWS).min(BLOCK_ROWS);
        std::ptr::copy_nonoverlapping(row.as_ptr(), t.out.add(n * BLOCK_ROWS), valid);
    }
}

/// Most activation rows of an AVX2 tile: 6 rows × 16 columns keep 12
/// accumulators, 2 weight vectors and a broadcast in the 16 ymm registers
/// (the register blocking of BLIS's Haswell kernel), 12 FMAs per 8 loads.
const AVX2_TILE_ROWS: usize = 6;

/// `R` (5–6) rows × 1 block, one input at a time: each input's 16 weights
/// as two halves, each activation broadcast once and used twice. Taller
/// than [`tile_avx2`], whose two inputs per step would need more
/// registers than AVX2 has at this height.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2_tall<E: PackedElem, const R: usize>(t: Tile<E>) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    // Input `sub` of line `l`: `sub` must be a constant after unrolling, or
    // the widening computes every input of the line and selects one through
    // memory (BF16 prefill ran at 0.6x of F32 that way).
    let input = |acc: &mut [[__m256; 2]; R], l: usize, sub: usize| {
        let line = t.w.add(l);
        // Widening the line's other input too is dead code the compiler drops.
        let w = [E::widen256(line, 0)[sub], E::widen256(line, 1)[sub]];
        let j = l * E::INPUTS + sub;
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let x = _mm256_broadcast_ss(&*t.x.add(r * t.k + j));
            acc_r[0] = _mm256_fmadd_ps(x, w[0], acc_r[0]);
            acc_r[1] = _mm256_fmadd_ps(x, w[1], acc_r[1]);
        }
    };
    let full = t.k / E::INPUTS;
    for l in 0..full {
        for sub in 0..E::INPUTS {
            input(&mut acc, l, sub);
        }
    }
    for sub in 0..t.k % E::INPUTS {
        input(&mut acc, full, sub);
    }
    for (r, acc_r) in acc.iter().enumerate() {
        let mut row = [0f32; BLOCK_ROWS];
        _mm256_storeu_ps(row.as_mut_ptr(), acc_r[0]);
        _mm256_storeu_ps(row.as_mut_ptr().add(8), acc_r[1]);
        std::ptr::copy_nonoverlapping(row.as_ptr(), t.out.add(r * t.stride), t.valid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::elem::{Bf16, F16};
    use crate::backend::cpu::matmul::tests::pseudo_random;
    use crate::backend::cpu::packed::tests::FromF32;

    pub(crate) fn isas() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                v.push(Isa::Avx2Fma);
            }
            if is_x86_feature_detected!("avx512f") {
                v.push(Isa::Avx512);
            }
        }
        #[cfg(target_arch = "aarch64")]
        v.push(Isa::Neon);
        v
    }

    /// Every tile shape (1..=12 rows, 1 or 2 blocks, partial blocks, odd
    /// `k`), both loop orders (≤ 4 and > 4 row groups), against an f64
    /// reference, for every ISA this CPU runs; a block range in the middle
    /// leaves the other columns untouched.
    fn matches_reference<E: FromF32>() {
        for &(n, k) in &[
            (1, 1),
            (5, 3),
            (16, 2),
            (33, 7),
            (40, 64),
            (64, 577),
            (70, 96),
        ] {
            let w: Vec<E> = pseudo_random(n * k, 2)
                .iter()
                .map(|v| E::from_f32(*v))
                .collect();
            let p = Packed::pack(n, k, &w).unwrap();
            let blocks = n.div_ceil(BLOCK_ROWS);
            for m in [
                1usize, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 16, 17, 20, 23, 37, 61, 72,
            ] {
                let x = pseudo_random(m * k, m as u32 + 7);
                for isa in isas() {
                    for (b0, b1) in [(0, blocks), (blocks / 2, blocks)] {
                        let mut out = vec![f32::NAN; m * n];
                        // SAFETY: `isa` runs here; buffers sized as required.
                        unsafe { packed_blocks(isa, &x, m, &p, b0, b1, out.as_mut_ptr(), n) };
                        for r in 0..m {
                            for c in 0..n {
                                let got = out[r * n + c];
                                if c < b0 * BLOCK_ROWS {
                                    assert!(got.is_nan(), "{} {isa:?} wrote column {c}", E::NAME);
                                    continue;
                                }
                                let want = (0..k)
                                    .map(|j| x[r * k + j] as f64 * w[c * k + j].to_f32() as f64)
                                    .sum::<f64>();
                                assert!(
                                    (got as f64 - want).abs() < 1e-4 * (k as f64).sqrt(),
                                    "{} {isa:?} m={m} n={n} k={k} [{r},{c}]: {got} vs {want}",
                                    E::NAME
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// A decode row's columns come out bit for bit the same whether its
    /// block ran alone or paired with a neighbour (AVX2 pairs them).
    fn one_row_bits_do_not_depend_on_block_pairing<E: FromF32>() {
        let (n, k) = (80, 131);
        let w: Vec<E> = pseudo_random(n * k, 3)
            .iter()
            .map(|v| E::from_f32(*v))
            .collect();
        let p = Packed::pack(n, k, &w).unwrap();
        let x = pseudo_random(k, 11);
        for isa in isas() {
            let mut whole = vec![0f32; n];
            // SAFETY: `isa` runs here; buffers sized as required.
            unsafe { packed_blocks(isa, &x, 1, &p, 0, n / BLOCK_ROWS, whole.as_mut_ptr(), n) };
            for b in 0..n / BLOCK_ROWS {
                let mut alone = vec![0f32; n];
                // SAFETY: as above.
                unsafe { packed_blocks(isa, &x, 1, &p, b, b + 1, alone.as_mut_ptr(), n) };
                let cols = b * BLOCK_ROWS..(b + 1) * BLOCK_ROWS;
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&whole[cols.clone()]),
                    bits(&alone[cols]),
                    "{} {isa:?} block {b}",
                    E::NAME
                );
            }
        }
    }

    #[test]
    fn one_row_bits_do_not_depend_on_block_pairing_for_any_format() {
        one_row_bits_do_not_depend_on_block_pairing::<f32>();
        one_row_bits_do_not_depend_on_block_pairing::<Bf16>();
        one_row_bits_do_not_depend_on_block_pairing::<F16>();
    }

    #[test]
    fn f32_matches_reference_for_all_tile_shapes() {
        matches_reference::<f32>();
    }

    #[test]
    fn bf16_matches_reference_for_all_tile_shapes() {
        matches_reference::<Bf16>();
    }

    #[test]
    fn f16_matches_reference_for_all_tile_shapes() {
        matches_reference::<F16>();
    }
}
