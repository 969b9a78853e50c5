//! Matrix multiplication `out = x · Wᵀ` with weights in HF layout
//! `[out_features, in_features]` (F32, F16, BF16 or Q8_0) and f32 activations.
//!
//! Few activation rows (decode, small batches): a register tile of up to 4
//! activation rows × 4 weight rows accumulates 16 dot products at once, so
//! each weight vector loaded feeds 4 FMAs. Many rows (prefill) on AVX-512: the
//! packed GEMM of `gemm.rs`. Dense weights repacked at load
//! ([`Matrix::into_cpu_layout`]) run the kernels of `packed_kernels.rs`
//! (BF16 through `bf16_kernels.rs`) for any number of rows instead. Q8_0 weights: the int8 kernels of
//! `q8_kernels.rs`; int4 weights (AWQ/GPTQ) the kernels of `q4_kernels.rs`
//! (act-order weights get their inputs permuted first). Work is split over output-column blocks, so several
//! weights (q/k/v or gate/up) run as one parallel job writing side by side
//! into one output row.

use super::bf16::{PackedBf16, BLOCK_ROWS as BF16_BLOCK_ROWS};
use super::bf16_hw::{bf16_hw_blocks, emulate_amx_rounding, round_to_bf16, with_acts, Bf16Acts};
use super::bf16_kernels::bf16_blocks;
use super::elem::{Bf16, WeightElem, F16};
use super::f16_packed::PackedF16;
use super::f32_packed::PackedF32;
use super::gemm;
use super::isa::{isa, Isa};
use super::packed::BLOCK_ROWS as PACKED_BLOCK_ROWS;
use super::packed_kernels::packed_blocks;
use super::q4::{Q4Acts, Q4Matrix};
use super::q4_kernels::q4_blocks;
use super::q8::{Q8Matrix, QActs, BLOCK_ROWS};
use super::q8_kernels::{q8_blocks, q8_isa};
use super::threadpool::ThreadPool;
use crate::tensor::fp8::Fp8Rows;
use crate::tensor::HostSlice;
use crate::{Error, ErrorKind, Result};
use std::cell::RefCell;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

pub enum MatrixData {
    F32(HostSlice<f32>),
    F16(HostSlice<F16>),
    BF16(HostSlice<Bf16>),
    /// F32 repacked for the kernels (see [`PackedF32`]); made once at load
    /// by [`Matrix::into_cpu_layout`].
    F32Packed(PackedF32),
    /// F16 repacked for the kernels (see [`PackedF16`]), like `F32Packed`.
    F16Packed(PackedF16),
    /// BF16 repacked for the kernels (see [`PackedBf16`]), like `F32Packed`.
    BF16Packed(PackedBf16),
    /// Int8 weights with per-group scales (see [`Q8Matrix`]).
    Q8_0(Q8Matrix),
    /// Int4 weights with per-group scales and zeros (see [`Q4Matrix`]).
    Q4(Q4Matrix),
    /// FP8 (E4M3) codes with scales, as loaded; [`Matrix::into_cpu_layout`]
    /// dequantizes them to F32 (the CPU has no FP8 kernel).
    Fp8(Fp8Rows),
}

/// A weight matrix `[rows = out_features, cols = in_features]`, row-major.
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: MatrixData,
}

impl Matrix {
    pub fn dtype_name(&self) -> &'static str {
        match self.data {
            MatrixData::F32(_) | MatrixData::F32Packed(_) => "f32",
            MatrixData::F16(_) | MatrixData::F16Packed(_) => "f16",
            MatrixData::BF16(_) | MatrixData::BF16Packed(_) => "bf16",
            MatrixData::Q8_0(_) => "q8_0",
            MatrixData::Q4(_) => "int4",
            MatrixData::Fp8(_) => "fp8",
        }
    }

    /// Row `r` widened to f32 into `out` (used for embedding lookups).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let range = r * self.cols..(r + 1) * self.cols;
        match &self.data {
            MatrixData::F32(d) => out.copy_from_slice(&d[range]),
            MatrixData::F16(d) => widen(&d[range], out),
            MatrixData::BF16(d) => widen(&d[range], out),
            MatrixData::F32Packed(p) => p.row_to_f32(r, out),
            MatrixData::F16Packed(p) => p.row_to_f32(r, out),
            MatrixData::BF16Packed(p) => p.row_to_f32(r, out),
            MatrixData::Q8_0(q) => q.row_to_f32(r, out),
            MatrixData::Q4(q) => q.row_to_f32(r, out),
            MatrixData::Fp8(q) => q.row_to_f32(r, out),
        }
    }

    /// Bytes a full pass over the weights reads.
    pub fn size_in_bytes(&self) -> usize {
        match &self.data {
            MatrixData::F32(_) => self.rows * self.cols * 4,
            MatrixData::F16(_) | MatrixData::BF16(_) => self.rows * self.cols * 2,
            MatrixData::F32Packed(p) => p.size_in_bytes(),
            MatrixData::F16Packed(p) => p.size_in_bytes(),
            MatrixData::BF16Packed(p) => p.size_in_bytes(),
            MatrixData::Q8_0(q) => q.size_in_bytes(),
            MatrixData::Q4(q) => q.size_in_bytes(),
            MatrixData::Fp8(q) => q.size_in_bytes(),
        }
    }

    /// The matrix in the layout the CPU kernels read fastest: dense (F32,
    /// F16, BF16) weights are repacked (a copy; the mapped checkpoint is no
    /// longer referenced), quantized ones are returned as they are. Call
    /// once at load, for CPU inference only (other backends read the
    /// unpacked variants directly).
    pub fn into_cpu_layout(self) -> Result<Matrix> {
        let Matrix { rows, cols, data } = self;
        let data = match data {
            MatrixData::F32(d) => MatrixData::F32Packed(PackedF32::pack(rows, cols, &d)?),
            MatrixData::F16(d) => MatrixData::F16Packed(PackedF16::pack(rows, cols, &d)?),
            MatrixData::BF16(d) => MatrixData::BF16Packed(PackedBf16::pack(rows, cols, &d)?),
            MatrixData::Fp8(q) => {
                MatrixData::F32Packed(PackedF32::pack(rows, cols, &fp8_to_f32(&q)?)?)
            }
            other => other,
        };
        Ok(Matrix { rows, cols, data })
    }
}

/// The values of FP8 weights as an F32 matrix.
fn fp8_to_f32(q: &Fp8Rows) -> Result<Vec<f32>> {
    let mut w = Vec::new();
    w.try_reserve_exact(q.rows * q.cols).map_err(|_| {
        Error::new(
            ErrorKind::OutOfMemory,
            format!(
                "no memory to dequantize a [{}, {}] fp8 matrix to f32",
                q.rows, q.cols
            ),
        )
    })?;
    w.resize(q.rows * q.cols, 0.0);
    for (r, row) in w.chunks_exact_mut(q.cols.max(1)).enumerate() {
        q.row_to_f32(r, row);
    }
    Ok(w)
}

fn widen<W: WeightElem>(src: &[W], out: &mut [f32]) {
    for (o, s) in out.iter_mut().zip(src) {
        *o = s.to_f32();
    }
}

/// A raw output pointer shared by tasks that write disjoint columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every task writes a disjoint set of output elements (see `matmul`).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Through a method, so closures capture the whole (Sync) wrapper.
    fn get(self) -> *mut f32 {
        self.0
    }
}

const MAX_SEGMENTS: usize = 4;
// Column blocks of every task start a packed block of either format.
const _: () = assert!(PACKED_BLOCK_ROWS == BLOCK_ROWS && gemm::NR.is_multiple_of(BLOCK_ROWS));
/// Activation rows from which dense weights go through the packed GEMM.
const GEMM_MIN_ROWS: usize = 8;

thread_local! {
    /// Quantized activations of the current int8 matmul (caller's thread).
    static QACTS: RefCell<QActs> = RefCell::new(QActs::default());
    /// Quantized activations of the current int4 matmul (caller's thread).
    static Q4ACTS: RefCell<Q4Acts> = RefCell::new(Q4Acts::default());
    /// Activations permuted for an act-order int4 weight.
    static PERMUTED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The activations each kind of quantized weight multiplies.
#[derive(Clone, Copy, Default)]
struct Acts<'a> {
    q8: Option<&'a QActs>,
    q4: Option<&'a Q4Acts>,
    /// BF16 activations when packed BF16 weights run a BF16 hardware path.
    bf16: Option<&'a Bf16Acts>,
}

fn as_q4(w: &Matrix) -> Option<&Q4Matrix> {
    match &w.data {
        MatrixData::Q4(q) => Some(q),
        _ => None,
    }
}

/// `out[r, col_offset(w) + c] = Σ_j x[r, j] · w[c, j]` for every weight `w` in
/// `weights` (all with `cols == k`), `r < m`. `out` is `[m, Σ rows]` row-major.
/// Q8_0 weights (all of one group size) multiply int8-quantized activations.
pub fn matmul(pool: &ThreadPool, x: &[f32], m: usize, weights: &[&Matrix], out: &mut [f32]) {
    assert!(
        !weights.is_empty() && weights.len() <= MAX_SEGMENTS,
        "1..=4 weights per matmul"
    );
    let k = weights[0].cols;
    assert!(
        weights.iter().all(|w| w.cols == k),
        "weights disagree on in_features"
    );
    let n_total: usize = weights.iter().map(|w| w.rows).sum();
    assert!(
        x.len() >= m * k && out.len() >= m * n_total,
        "matmul buffers too small"
    );
    if m == 0 {
        return;
    }
    if weights
        .iter()
        .any(|w| as_q4(w).is_some_and(|q| q.perm().is_some()))
    {
        // Act-order int4: each weight with a permutation multiplies its own
        // permuted activations, so the weights run one by one.
        let mut offset = 0;
        for w in weights {
            match as_q4(w).and_then(|q| q.perm()) {
                Some(perm) => PERMUTED.with(|p| {
                    let mut p = p.borrow_mut();
                    p.clear();
                    for r in 0..m {
                        let xr = &x[r * k..(r + 1) * k];
                        p.extend(perm.iter().map(|&i| xr[i as usize]));
                    }
                    matmul_quantized(pool, &p, m, &[w], out, offset, n_total);
                }),
                None => matmul_quantized(pool, x, m, &[w], out, offset, n_total),
            }
            offset += w.rows;
        }
    } else {
        matmul_quantized(pool, x, m, weights, out, 0, n_total);
    }
}

/// Quantizes the activations the weights need, then runs them; columns
/// `offset..offset + Σ rows` of `out` (`[m, stride]`).
fn matmul_quantized(
    pool: &ThreadPool,
    x: &[f32],
    m: usize,
    weights: &[&Matrix],
    out: &mut [f32],
    offset: usize,
    stride: usize,
) {
    let k = weights[0].cols;
    let q8_group = weights.iter().find_map(|w| match &w.data {
        MatrixData::Q8_0(q) => Some(q.group),
        _ => None,
    });
    if let Some(group) = q8_group {
        assert!(
            weights.iter().all(|w| match &w.data {
                MatrixData::Q8_0(q) => q.group == group,
                _ => true,
            }),
            "Q8_0 weights of one matmul must share a group size"
        );
    }
    let has_q4 = weights.iter().any(|w| as_q4(w).is_some());
    QACTS.with(|qa| {
        Q4ACTS.with(|q4a| {
            let mut qa = qa.borrow_mut();
            let mut q4a = q4a.borrow_mut();
            let mut acts = Acts::default();
            if let Some(group) = q8_group {
                qa.quantize(x, m, k, group);
                acts.q8 = Some(&*qa);
            }
            if has_q4 {
                q4a.quantize(x, m, k);
                acts.q4 = Some(&*q4a);
            }
            let packed_bf16 = weights
                .iter()
                .any(|w| matches!(w.data, MatrixData::BF16Packed(_)));
            let rounded;
            let x = if packed_bf16 && emulate_amx_rounding(m) {
                rounded = round_to_bf16(&x[..m * k]);
                &rounded[..]
            } else {
                x
            };
            with_acts(x, m, k, packed_bf16, |bf16| {
                let acts = Acts { bf16, ..acts };
                matmul_with(pool, x, m, weights, out, offset, stride, acts);
            });
        })
    });
}

#[allow(clippy::too_many_arguments)]
fn matmul_with(
    pool: &ThreadPool,
    x: &[f32],
    m: usize,
    weights: &[&Matrix],
    out: &mut [f32],
    offset: usize,
    n_total: usize,
    acts: Acts<'_>,
) {
    let k = weights[0].cols;
    let n_here: usize = weights.iter().map(|w| w.rows).sum();
    assert!(offset + n_here <= n_total && out.len() >= m * n_total);
    let isa = isa();
    let use_gemm = isa == Isa::Avx512
        && m >= GEMM_MIN_ROWS
        && weights.iter().any(|w| {
            matches!(
                w.data,
                MatrixData::F32(_) | MatrixData::F16(_) | MatrixData::BF16(_)
            )
        });
    let block = if use_gemm {
        gemm::NR
    } else if let Some(b) = acts
        .bf16
        .and_then(|a| a.column_block(n_here, pool.threads()))
    {
        b
    } else {
        column_block(n_here, pool.threads())
    };
    let mut first_task = [0usize; MAX_SEGMENTS + 1];
    let mut col_offset = [0usize; MAX_SEGMENTS];
    for (i, w) in weights.iter().enumerate() {
        first_task[i + 1] = first_task[i] + w.rows.div_ceil(block);
        col_offset[i] = if i == 0 {
            offset
        } else {
            col_offset[i - 1] + weights[i - 1].rows
        };
    }
    let n_tasks = first_task[weights.len()];
    let out_ptr = OutPtr(out.as_mut_ptr());
    let q8isa = q8_isa();
    pool.run(n_tasks, &|task| {
        let seg = (0..weights.len())
            .find(|&s| task < first_task[s + 1])
            .unwrap_or(0);
        let w = weights[seg];
        let c0 = (task - first_task[seg]) * block;
        let c1 = (c0 + block).min(w.rows);
        // SAFETY: columns [col_offset+c0, col_offset+c1) of every row belong to
        // this task alone; x and w bounds were checked by `matmul`; `block`
        // is a multiple of the Q8 block height, so c0 starts a packed block.
        unsafe {
            let out_base = out_ptr.get().add(col_offset[seg]);
            match &w.data {
                #[cfg(target_arch = "x86_64")]
                MatrixData::F32(d) if use_gemm => {
                    gemm::gemm_block(x, m, k, d, c0, c1, out_base, n_total)
                }
                #[cfg(target_arch = "x86_64")]
                MatrixData::F16(d) if use_gemm => {
                    gemm::gemm_block(x, m, k, d, c0, c1, out_base, n_total)
                }
                #[cfg(target_arch = "x86_64")]
                MatrixData::BF16(d) if use_gemm => {
                    gemm::gemm_block(x, m, k, d, c0, c1, out_base, n_total)
                }
                MatrixData::F32(d) => run_block(isa, x, m, k, d, c0, c1, out_base, n_total),
                MatrixData::F16(d) => run_block(isa, x, m, k, d, c0, c1, out_base, n_total),
                MatrixData::BF16(d) => run_block(isa, x, m, k, d, c0, c1, out_base, n_total),
                MatrixData::F32Packed(p) => {
                    let (b0, b1) = (c0 / BLOCK_ROWS, c1.div_ceil(BLOCK_ROWS));
                    packed_blocks(isa, x, m, p, b0, b1, out_base, n_total)
                }
                MatrixData::F16Packed(p) => {
                    let (b0, b1) = (c0 / BLOCK_ROWS, c1.div_ceil(BLOCK_ROWS));
                    packed_blocks(isa, x, m, p, b0, b1, out_base, n_total)
                }
                MatrixData::BF16Packed(p) => {
                    let (b0, b1) = (c0 / BF16_BLOCK_ROWS, c1.div_ceil(BF16_BLOCK_ROWS));
                    match acts.bf16 {
                        Some(a) => bf16_hw_blocks(a, p, b0, b1, out_base, n_total),
                        None => bf16_blocks(isa, x, m, p, b0, b1, out_base, n_total),
                    }
                }
                MatrixData::Q8_0(q) => {
                    let qa = acts.q8.expect("activations quantized for Q8_0 weights");
                    let (b0, b1) = (c0 / BLOCK_ROWS, c1.div_ceil(BLOCK_ROWS));
                    q8_blocks(q8isa, qa, q, b0, b1, out_base, n_total)
                }
                MatrixData::Q4(q) => {
                    let qa = acts.q4.expect("activations quantized for int4 weights");
                    let (b0, b1) = (c0 / BLOCK_ROWS, c1.div_ceil(BLOCK_ROWS));
                    q4_blocks(q8isa, qa, q, b0, b1, out_base, n_total)
                }
                // Loaded weights are packed as F32; this serves a product
                // over an unpacked matrix (tools, tests) row by row.
                MatrixData::Fp8(q) => fp8_columns(x, m, q, c0, c1, out_base, n_total),
            }
        }
    });
}

/// Columns `c0..c1` of `x · qᵀ` for FP8 weights, one weight row at a time.
///
/// # Safety
/// `out` points at a `[m, out_stride]` buffer whose columns `c0..c1` may be
/// written; `x` holds `m · q.cols` values.
unsafe fn fp8_columns(
    x: &[f32],
    m: usize,
    q: &Fp8Rows,
    c0: usize,
    c1: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let k = q.cols;
    let mut row = vec![0f32; k];
    for c in c0..c1.min(q.rows) {
        q.row_to_f32(c, &mut row);
        for r in 0..m {
            let dot: f32 = x[r * k..(r + 1) * k]
                .iter()
                .zip(&row)
                .map(|(a, b)| a * b)
                .sum();
            *out.add(r * out_stride + c) = dot;
        }
    }
}

/// Columns per task for the dot-product kernels: about 16 tasks per thread,
/// a multiple of the Q8 block height.
fn column_block(n_total: usize, threads: usize) -> usize {
    let target = n_total / (threads * 16).max(1);
    (target.div_ceil(BLOCK_ROWS) * BLOCK_ROWS).clamp(BLOCK_ROWS, 64)
}

/// Computes columns `c0..c1` for all rows, in tiles of ≤4 rows × 4 columns.
///
/// # Safety
/// `w` holds at least `c1 * k` elements, `x` at least `m * k`, and `out`
/// points at a `[m, out_stride]` buffer whose columns `c0..c1` may be written.
#[allow(clippy::too_many_arguments)]
unsafe fn run_block<W: WeightElem>(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
    c0: usize,
    c1: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let mut r = 0;
    while r < m {
        let mr = (m - r).min(4);
        let mut c = c0;
        while c < c1 {
            // One activation row (decode): 8 weight rows in flight per tile.
            let nr = if mr == 1 && c1 - c >= 8 {
                8
            } else if c1 - c >= 4 {
                4
            } else {
                1
            };
            let xp = x.as_ptr().add(r * k);
            let wp = w.as_ptr().add(c * k);
            let op = out.add(r * out_stride + c);
            tile(isa, mr, nr, xp, wp, k, op, out_stride);
            c += nr;
        }
        r += mr;
    }
}

macro_rules! dispatch_tile {
    ($f:ident, $mr:expr, $nr:expr, $($arg:expr),*) => {
        match ($mr, $nr) {
            (1, 8) => $f::<W, 1, 8>($($arg),*),
            (1, 4) => $f::<W, 1, 4>($($arg),*),
            (2, 4) => $f::<W, 2, 4>($($arg),*),
            (3, 4) => $f::<W, 3, 4>($($arg),*),
            (4, 4) => $f::<W, 4, 4>($($arg),*),
            (1, _) => $f::<W, 1, 1>($($arg),*),
            (2, _) => $f::<W, 2, 1>($($arg),*),
            (3, _) => $f::<W, 3, 1>($($arg),*),
            _ => $f::<W, 4, 1>($($arg),*),
        }
    };
}

/// # Safety
/// `x` has `mr` rows of `k`, `w` has `nr` rows of `k`, `out` has `mr` rows
/// (stride `out_stride`) with `nr` writable columns.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn tile<W: WeightElem>(
    isa: Isa,
    mr: usize,
    nr: usize,
    x: *const f32,
    w: *const W,
    k: usize,
    out: *mut f32,
    out_stride: usize,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => dispatch_tile!(tile_avx512, mr, nr, x, w, k, out, out_stride),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => dispatch_tile!(tile_avx2, mr, nr, x, w, k, out, out_stride),
        _ => dispatch_tile!(tile_scalar, mr, nr, x, w, k, out, out_stride),
    }
}

/// Finishes the `k % width` tail of each dot product in scalar code.
#[inline(always)]
unsafe fn tail<W: WeightElem, const MR: usize, const NR: usize>(
    sums: &mut [[f32; NR]; MR],
    x: *const f32,
    w: *const W,
    k: usize,
    from: usize,
) {
    for (r, row) in sums.iter_mut().enumerate() {
        for (c, s) in row.iter_mut().enumerate() {
            for j in from..k {
                *s += *x.add(r * k + j) * (*w.add(c * k + j)).to_f32();
            }
        }
    }
}

#[inline(always)]
unsafe fn store<const MR: usize, const NR: usize>(
    sums: &[[f32; NR]; MR],
    out: *mut f32,
    stride: usize,
) {
    for (r, row) in sums.iter().enumerate() {
        for (c, s) in row.iter().enumerate() {
            *out.add(r * stride + c) = *s;
        }
    }
}

unsafe fn tile_scalar<W: WeightElem, const MR: usize, const NR: usize>(
    x: *const f32,
    w: *const W,
    k: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let mut sums = [[0f32; NR]; MR];
    tail::<W, MR, NR>(&mut sums, x, w, k, 0);
    store(&sums, out, out_stride);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn tile_avx512<W: WeightElem, const MR: usize, const NR: usize>(
    x: *const f32,
    w: *const W,
    k: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); NR]; MR];
    let kv = k / 16 * 16;
    let mut j = 0;
    while j < kv {
        let mut wv = [_mm512_setzero_ps(); NR];
        for (c, v) in wv.iter_mut().enumerate() {
            *v = W::load16(w.add(c * k + j));
        }
        for (r, acc_row) in acc.iter_mut().enumerate() {
            let xv = _mm512_loadu_ps(x.add(r * k + j));
            for (a, v) in acc_row.iter_mut().zip(wv.iter()) {
                *a = _mm512_fmadd_ps(xv, *v, *a);
            }
        }
        j += 16;
    }
    let mut sums = [[0f32; NR]; MR];
    for (s_row, a_row) in sums.iter_mut().zip(acc.iter()) {
        for (s, a) in s_row.iter_mut().zip(a_row.iter()) {
            *s = _mm512_reduce_add_ps(*a);
        }
    }
    tail::<W, MR, NR>(&mut sums, x, w, k, kv);
    store(&sums, out, out_stride);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2<W: WeightElem, const MR: usize, const NR: usize>(
    x: *const f32,
    w: *const W,
    k: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); NR]; MR];
    let kv = k / 8 * 8;
    let mut j = 0;
    while j < kv {
        let mut wv = [_mm256_setzero_ps(); NR];
        for (c, v) in wv.iter_mut().enumerate() {
            *v = W::load8(w.add(c * k + j));
        }
        for (r, acc_row) in acc.iter_mut().enumerate() {
            let xv = _mm256_loadu_ps(x.add(r * k + j));
            for (a, v) in acc_row.iter_mut().zip(wv.iter()) {
                *a = _mm256_fmadd_ps(xv, *v, *a);
            }
        }
        j += 8;
    }
    let mut sums = [[0f32; NR]; MR];
    for (s_row, a_row) in sums.iter_mut().zip(acc.iter()) {
        for (s, a) in s_row.iter_mut().zip(a_row.iter()) {
            *s = hsum256(*a);
        }
    }
    tail::<W, MR, NR>(&mut sums, x, w, k, kv);
    store(&sums, out, out_stride);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn hsum256(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_hadd_ps(s, s);
    let s = _mm_hadd_ps(s, s);
    _mm_cvtss_f32(s)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn reference(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for r in 0..m {
            for c in 0..n {
                out[r * n + c] = (0..k)
                    .map(|j| x[r * k + j] as f64 * w[c * k + j] as f64)
                    .sum::<f64>() as f32;
            }
        }
        out
    }

    /// Deterministic values in [-1, 1) (xorshift), shared by the kernel tests.
    pub(crate) fn pseudo_random(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2000) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// The activations packed BF16 weights multiply: rounded to bf16 when
    /// this CPU runs a BF16 hardware path for `m` rows.
    fn bf16_hw_input(x: &[f32], m: usize) -> Vec<f32> {
        match super::super::bf16_hw::bf16_path(m) {
            Some(_) => x
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_f32())
                .collect(),
            None => x.to_vec(),
        }
    }

    #[test]
    fn matches_reference_for_all_dtypes_and_shapes() {
        let pool = ThreadPool::new(2);
        for &(m, k, n) in &[
            (1, 64, 8),
            (3, 37, 5),
            (5, 576, 67),
            (9, 16, 4),
            (4, 200, 130),
            (20, 400, 70),
            (8, 576, 33),
            (13, 193, 96),
            (64, 577, 50),
        ] {
            let x = pseudo_random(m * k, 1);
            let w = pseudo_random(n * k, 2);
            let want = reference(&x, m, k, &w, n);
            let bf: Vec<Bf16> = w
                .iter()
                .map(|v| Bf16(half::bf16::from_f32(*v).to_bits()))
                .collect();
            let hf: Vec<F16> = w
                .iter()
                .map(|v| F16(half::f16::from_f32(*v).to_bits()))
                .collect();
            let bf_f32: Vec<f32> = bf.iter().map(|b| b.to_f32()).collect();
            let hf_f32: Vec<f32> = hf.iter().map(|h| h.to_f32()).collect();
            let cases = [
                (
                    MatrixData::F32(HostSlice::from_vec(w.clone())),
                    want.clone(),
                ),
                (
                    MatrixData::F32Packed(PackedF32::pack(n, k, &w).unwrap()),
                    want.clone(),
                ),
                (
                    MatrixData::F16Packed(PackedF16::pack(n, k, &hf).unwrap()),
                    reference(&x, m, k, &hf_f32, n),
                ),
                (
                    MatrixData::BF16Packed(PackedBf16::pack(n, k, &bf).unwrap()),
                    reference(&bf16_hw_input(&x, m), m, k, &bf_f32, n),
                ),
                (
                    MatrixData::BF16(HostSlice::from_vec(bf)),
                    reference(&x, m, k, &bf_f32, n),
                ),
                (
                    MatrixData::F16(HostSlice::from_vec(hf)),
                    reference(&x, m, k, &hf_f32, n),
                ),
            ];
            for (data, want) in cases {
                let mat = Matrix {
                    rows: n,
                    cols: k,
                    data,
                };
                let mut out = vec![0.0; m * n];
                matmul(&pool, &x, m, &[&mat], &mut out);
                for (a, b) in out.iter().zip(&want) {
                    assert!(
                        (a - b).abs() < 1e-3,
                        "{} m={m} k={k} n={n}: {a} vs {b}",
                        mat.dtype_name()
                    );
                }
            }
        }
    }

    #[test]
    fn cpu_layout_packs_dense_weights_and_keeps_their_rows() {
        let (n, k) = (21, 10);
        let w = pseudo_random(n * k, 9);
        let dense = [
            MatrixData::F32(HostSlice::from_vec(w.clone())),
            MatrixData::F16(HostSlice::from_vec(
                w.iter()
                    .map(|v| F16(half::f16::from_f32(*v).to_bits()))
                    .collect(),
            )),
            MatrixData::BF16(HostSlice::from_vec(
                w.iter()
                    .map(|v| Bf16(half::bf16::from_f32(*v).to_bits()))
                    .collect(),
            )),
        ];
        for data in dense {
            let raw = Matrix {
                rows: n,
                cols: k,
                data,
            };
            let mut want = vec![vec![0f32; k]; n];
            for (r, row) in want.iter_mut().enumerate() {
                raw.row_to_f32(r, row);
            }
            let name = raw.dtype_name();
            let packed = raw.into_cpu_layout().unwrap();
            assert!(
                matches!(
                    packed.data,
                    MatrixData::F32Packed(_) | MatrixData::F16Packed(_) | MatrixData::BF16Packed(_)
                ),
                "{name} was not packed"
            );
            assert_eq!(packed.dtype_name(), name);
            // 2 row blocks of 16; F32 one line per input, F16/BF16 per pair.
            let lines = if name == "f32" { k } else { k.div_ceil(2) };
            assert_eq!(packed.size_in_bytes(), 2 * lines * 64, "{name}");
            let mut row = vec![0f32; k];
            for (r, want) in want.iter().enumerate() {
                packed.row_to_f32(r, &mut row);
                assert_eq!(&row, want, "{name} row {r}");
            }
        }
        let q = Matrix {
            rows: 16,
            cols: 32,
            data: MatrixData::Q8_0(Q8Matrix::quantize(16, 32, 32, &pseudo_random(512, 3)).unwrap()),
        };
        assert!(matches!(
            q.into_cpu_layout().unwrap().data,
            MatrixData::Q8_0(_)
        ));
    }

    #[test]
    fn segments_write_side_by_side() {
        let pool = ThreadPool::new(2);
        let (m, k) = (3, 48);
        let x = pseudo_random(m * k, 3);
        let wa = pseudo_random(10 * k, 4);
        let wb = pseudo_random(6 * k, 5);
        let a = Matrix {
            rows: 10,
            cols: k,
            data: MatrixData::F32(HostSlice::from_vec(wa.clone())),
        };
        let b = Matrix {
            rows: 6,
            cols: k,
            data: MatrixData::F32(HostSlice::from_vec(wb.clone())),
        };
        let mut out = vec![0.0; m * 16];
        matmul(&pool, &x, m, &[&a, &b], &mut out);
        let ra = reference(&x, m, k, &wa, 10);
        let rb = reference(&x, m, k, &wb, 6);
        for r in 0..m {
            for c in 0..10 {
                assert!((out[r * 16 + c] - ra[r * 10 + c]).abs() < 1e-4);
            }
            for c in 0..6 {
                assert!((out[r * 16 + 10 + c] - rb[r * 6 + c]).abs() < 1e-4);
            }
        }
    }

    #[test]
    fn q8_segments_match_dequantized_reference() {
        let pool = ThreadPool::new(2);
        let k = 96;
        let wa = pseudo_random(40 * k, 6);
        let wb = pseudo_random(24 * k, 7);
        let qa = Q8Matrix::quantize(40, k, 32, &wa).unwrap();
        let qb = Q8Matrix::quantize(24, k, 32, &wb).unwrap();
        let deq = |q: &Q8Matrix, n: usize| {
            let mut v = vec![0f32; n * k];
            for r in 0..n {
                q.row_to_f32(r, &mut v[r * k..(r + 1) * k]);
            }
            v
        };
        let (da, db) = (deq(&qa, 40), deq(&qb, 24));
        let a = Matrix {
            rows: 40,
            cols: k,
            data: MatrixData::Q8_0(qa),
        };
        let b = Matrix {
            rows: 24,
            cols: k,
            data: MatrixData::Q8_0(qb),
        };
        for m in [1usize, 3, 17] {
            let x = pseudo_random(m * k, 8);
            let mut out = vec![0.0; m * 64];
            matmul(&pool, &x, m, &[&a, &b], &mut out);
            let (ra, rb) = (reference(&x, m, k, &da, 40), reference(&x, m, k, &db, 24));
            for r in 0..m {
                // Activation rounding: |err| <= Σ|w|·d_x/2 ≈ 96 · 0.5 · (1/127) / 2.
                for c in 0..40 {
                    assert!(
                        (out[r * 64 + c] - ra[r * 40 + c]).abs() < 0.2,
                        "m={m} a {r},{c}"
                    );
                }
                for c in 0..24 {
                    assert!(
                        (out[r * 64 + 40 + c] - rb[r * 24 + c]).abs() < 0.2,
                        "m={m} b {r},{c}"
                    );
                }
            }
        }
    }
}

/// Timing, not a check: `cargo test --release --lib bench_bf16_layouts --
/// --ignored --nocapture` (`bench_f32_layouts`, `bench_f16_layouts` alike;
/// `BENCH_ROWS=1,16`, `BENCH_HEAD=0|1`). SmolLM2-135M's matrices (30 layers
/// and the LM head, which is left out by default above 16 rows as in
/// prefill; 269 MB per layout in BF16, so nothing stays cached) as raw and
/// packed, interleaved, 2 threads.
#[cfg(test)]
mod bench {
    use super::*;
    use std::time::Instant;

    /// `rows × cols` random weights of about ±0.01, as `dtype`.
    fn random(seed: &mut u32, rows: usize, cols: usize, dtype: &str) -> Matrix {
        let w: Vec<f32> = (0..rows * cols)
            .map(|_| {
                *seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
                ((*seed >> 9) % 2000) as f32 / 1e5
            })
            .collect();
        let data = match dtype {
            "f32" => MatrixData::F32(HostSlice::from_vec(w)),
            "bf16" => MatrixData::BF16(HostSlice::from_vec(
                w.iter()
                    .map(|v| Bf16(half::bf16::from_f32(*v).to_bits()))
                    .collect(),
            )),
            _ => MatrixData::F16(HostSlice::from_vec(
                w.iter()
                    .map(|v| F16(half::f16::from_f32(*v).to_bits()))
                    .collect(),
            )),
        };
        Matrix { rows, cols, data }
    }

    fn bench_layouts(dtype: &str) {
        let pool = ThreadPool::new(2);
        let (d, inter, layers, vocab) = (576, 1536, 30, 49152);
        let rows: Vec<usize> = std::env::var("BENCH_ROWS")
            .unwrap_or_else(|_| "1,16".into())
            .split(',')
            .map(|v| v.parse().unwrap())
            .collect();
        let head = std::env::var("BENCH_HEAD").ok();
        // Per layer: qkv (960 × 576), o (576 × 576), gate+up (2 × 1536 × 576), down (576 × 1536).
        let mut shapes = Vec::new();
        for _ in 0..layers {
            shapes.push(vec![(960, d)]);
            shapes.push(vec![(d, d)]);
            shapes.push(vec![(inter, d), (inter, d)]);
            shapes.push(vec![(d, inter)]);
        }
        for &m in &rows {
            let with_head = head.as_deref().map_or(m <= 16, |h| h == "1");
            let mut all_shapes = shapes.clone();
            if with_head {
                all_shapes.push(vec![(vocab, d)]);
            }
            let mut seed = 1u32;
            let all: Vec<Vec<(Matrix, Matrix)>> = all_shapes
                .iter()
                .map(|ws| {
                    ws.iter()
                        .map(|&(r, c)| {
                            let s0 = seed;
                            let raw = random(&mut seed, r, c, dtype);
                            let packed =
                                random(&mut { s0 }, r, c, dtype).into_cpu_layout().unwrap();
                            (raw, packed)
                        })
                        .collect()
                })
                .collect();
            let bytes: usize = all.iter().flatten().map(|(r, _)| r.size_in_bytes()).sum();
            let params: usize = all.iter().flatten().map(|(r, _)| r.rows * r.cols).sum();
            let x: Vec<f32> = (0..m * inter).map(|i| (i % 7) as f32 * 0.1).collect();
            let mut out = vec![0f32; m * if with_head { vocab } else { 2 * inter }];
            let mut times = [Vec::new(), Vec::new()];
            for rep in 0..6 {
                for (which, t) in times.iter_mut().enumerate() {
                    let start = Instant::now();
                    for ws in &all {
                        let ms: Vec<&Matrix> = ws
                            .iter()
                            .map(|p| if which == 0 { &p.0 } else { &p.1 })
                            .collect();
                        matmul(&pool, &x, m, &ms, &mut out);
                    }
                    if rep > 0 {
                        t.push(start.elapsed().as_secs_f64());
                    }
                }
            }
            for (name, t) in ["raw", "packed"].iter().zip(&mut times) {
                t.sort_by(|a, b| a.partial_cmp(b).unwrap());
                let med = t[t.len() / 2];
                println!(
                    "{dtype} m={m:>3} {name:>6}: {:.2} ms per pass (median of {}, min {:.2}), {:.1} GB/s, {:.1} GFLOP/s",
                    med * 1e3,
                    t.len(),
                    t[0] * 1e3,
                    bytes as f64 / med / 1e9,
                    2.0 * m as f64 * params as f64 / med / 1e9
                );
            }
        }
    }

    #[test]
    #[ignore]
    fn bench_bf16_layouts() {
        bench_layouts("bf16");
    }

    #[test]
    #[ignore]
    fn bench_f32_layouts() {
        bench_layouts("f32");
    }

    #[test]
    #[ignore]
    fn bench_f16_layouts() {
        bench_layouts("f16");
    }
}
