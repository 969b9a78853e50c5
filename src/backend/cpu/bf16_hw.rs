//! BF16 hardware paths for packed BF16 weights ([`PackedBf16`]) with several
//! activation rows: AMX tiles (`bf16_amx.rs`) from [`AMX_MIN_ROWS`] rows,
//! AVX-512 BF16 dot products (`bf16_dot.rs`) from [`DOT_MIN_ROWS`]. Both
//! multiply activations rounded to BF16 (round to nearest even, as llama.cpp
//! does for BF16 weights) and accumulate in f32. Fewer rows (decode) stay on
//! the f32 kernels of `bf16_kernels.rs`: they are bound by memory, and exact
//! in the activations.
//!
//! The activations are converted once per matmul into [`Bf16Acts`], which
//! every task of the pool then reads.

use super::bf16::PackedBf16;
use super::isa::{has_amx_bf16, has_avx512_bf16};
#[cfg(target_arch = "x86_64")]
use super::isa::{isa, Isa};
use std::cell::RefCell;

/// Which hardware kernel a matmul's packed BF16 weights run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Path {
    /// AMX-BF16 tiles (`tdpbf16ps`).
    Amx,
    /// AVX-512 BF16 (`vdpbf16ps`).
    Dot,
}

/// Activation rows from which AMX runs (one full 16-row tile).
pub const AMX_MIN_ROWS: usize = 16;
/// Activation rows from which AVX-512 BF16 runs: below, the f32 kernels are
/// bound by memory too, so rounding the activations would buy nothing. Only
/// on CPUs without AMX: on a Sapphire Rapids-class Xeon `vdpbf16ps` ran at
/// 0.6–0.7× the f32 kernels (8 × 32 register tiles, 16 and 512 rows), while
/// AMD's Zen 4 does twice the multiply-adds per `vdpbf16ps` as per FMA.
pub const DOT_MIN_ROWS: usize = 4;

/// Whether this CPU (and its switches) runs `path`.
pub fn available(path: Bf16Path) -> bool {
    match path {
        Bf16Path::Amx => has_amx_bf16(),
        Bf16Path::Dot => has_avx512_bf16(),
    }
}

#[cfg(test)]
thread_local! {
    /// Tests and benchmarks: the path this thread's matmuls take (`Some(None)`:
    /// the f32 kernels), if available, instead of the one chosen by rows.
    static FORCED: std::cell::Cell<Option<Option<Bf16Path>>> = const { std::cell::Cell::new(None) };
}

#[cfg(test)]
thread_local! {
    /// Benchmarks: the AMX path's columns per task, instead of its choice.
    static FORCED_BLOCK: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Forces this thread's AMX matmuls to `block` columns per task (`None`:
/// chosen by size).
#[cfg(test)]
pub(crate) fn force_amx_block(block: Option<usize>) {
    FORCED_BLOCK.with(|f| f.set(block));
}

/// Forces this thread's packed BF16 matmuls onto `path` (`None`: the f32
/// kernels) until called with `auto = true`.
#[cfg(test)]
pub(crate) fn force_path(path: Option<Bf16Path>, auto: bool) {
    FORCED.with(|f| f.set(if auto { None } else { Some(path) }));
}

/// The hardware path for a product with `m` activation rows, if any.
pub fn bf16_path(m: usize) -> Option<Bf16Path> {
    #[cfg(test)]
    if let Some(forced) = FORCED.with(|f| f.get()) {
        return forced.filter(|&p| available(p));
    }
    let amx = has_amx_bf16();
    if m >= AMX_MIN_ROWS && amx {
        Some(Bf16Path::Amx)
    } else if m >= DOT_MIN_ROWS && !amx && has_avx512_bf16() {
        Some(Bf16Path::Dot)
    } else {
        None
    }
}

/// `NANOINFER_BF16_ROUND_ACTS=1`: a product that would take the AMX path if
/// this CPU had it rounds its activations to BF16 first and runs the f32
/// kernels, so a machine without AMX reproduces AMX's numerics (up to the
/// order of the f32 sums), e.g. to measure their perplexity.
pub fn emulate_amx_rounding(m: usize) -> bool {
    static ON: once_cell::sync::Lazy<bool> = once_cell::sync::Lazy::new(|| {
        crate::tuning::var("NANOINFER_BF16_ROUND_ACTS").is_some_and(|v| v == "1")
    });
    *ON && m >= AMX_MIN_ROWS && bf16_path(m).is_none()
}

/// `x` rounded to BF16 and widened back (the values AMX multiplies).
pub fn round_to_bf16(x: &[f32]) -> Vec<f32> {
    x.iter()
        .map(|&v| f32::from_bits(u32::from(to_bf16(v)) << 16))
        .collect()
}

/// 64 bytes of BF16 activations: one AMX tile row, cache-line aligned.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Chunk([u16; 32]);

/// Activations rounded to BF16, row-major, each row zero-padded to
/// `stride` (a multiple of 32) and the rows zero-padded to a multiple of 16,
/// so whole AMX tiles can be read past `k` and `m`. Two consecutive values
/// `(2p, 2p+1)` of a row form the 32-bit pair `vdpbf16ps` broadcasts.
pub struct Bf16Acts {
    pub(crate) path: Bf16Path,
    pub(crate) m: usize,
    pub(crate) k: usize,
    /// BF16 values per row.
    pub(crate) stride: usize,
    data: Vec<Chunk>,
}

impl Bf16Acts {
    fn new(path: Bf16Path) -> Bf16Acts {
        Bf16Acts {
            path,
            m: 0,
            k: 0,
            stride: 0,
            data: Vec::new(),
        }
    }

    /// Rounds the `[m, k]` activations `x` into this buffer.
    pub(crate) fn convert(&mut self, path: Bf16Path, x: &[f32], m: usize, k: usize) {
        assert!(
            x.len() >= m * k,
            "BF16 activations: {} values for [{m}, {k}]",
            x.len()
        );
        self.path = path;
        self.m = m;
        self.k = k;
        self.stride = k.div_ceil(32) * 32;
        let rows = m.div_ceil(16) * 16;
        let chunks = rows * self.stride / 32;
        self.data.clear();
        self.data.resize(chunks, Chunk([0; 32]));
        if k == 0 {
            return;
        }
        let stride = self.stride;
        // SAFETY: `Chunk` is `repr(C)` over `[u16; 32]` (no padding), so the
        // chunks are `chunks * 32` initialized, aligned u16 values.
        let dst = unsafe {
            std::slice::from_raw_parts_mut(self.data.as_mut_ptr() as *mut u16, chunks * 32)
        };
        for (row, src) in dst.chunks_mut(stride).zip(x[..m * k].chunks(k)) {
            convert_row(src, &mut row[..k]);
        }
    }

    /// Output columns per pool task for `n` columns on `threads` threads, if
    /// this path wants its own: AMX reads all the activations once per task,
    /// and re-reads them per 32 columns from L2 instead of L1, so it takes the
    /// widest of 128, 64, 32 columns that still gives every thread a task.
    pub(crate) fn column_block(&self, n: usize, threads: usize) -> Option<usize> {
        if self.path != Bf16Path::Amx {
            return None;
        }
        #[cfg(test)]
        if let Some(b) = FORCED_BLOCK.with(|f| f.get()) {
            return Some(b);
        }
        let block = [128, 64, 32]
            .into_iter()
            .find(|&b| n.div_ceil(b) >= threads)
            .unwrap_or(16);
        Some(block)
    }

    /// The first value of row `r` (rows up to `m` rounded up to 16 exist).
    #[inline]
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn row_ptr(&self, r: usize) -> *const u16 {
        debug_assert!(r * self.stride <= self.data.len() * 32);
        // SAFETY: in bounds by the assertion (or one past the end).
        unsafe { (self.data.as_ptr() as *const u16).add(r * self.stride) }
    }
}

/// f32 to BF16, round to nearest even; NaN stays a (quiet) NaN.
#[inline(always)]
pub(crate) fn to_bf16(v: f32) -> u16 {
    let b = v.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    if v.is_nan() {
        (b >> 16) as u16 | 0x40
    } else {
        rounded
    }
}

#[cfg(test)]
pub(crate) fn bf16_to_f32(v: u16) -> f32 {
    f32::from_bits(u32::from(v) << 16)
}

fn convert_row(src: &[f32], dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx512 {
        // SAFETY: the CPU runs AVX-512 (`isa` checked it).
        return unsafe { convert_row_avx512(src, dst) };
    }
    convert_row_plain(src, dst);
}

#[inline(always)]
fn convert_row_plain(src: &[f32], dst: &mut [u16]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = to_bf16(*s);
    }
}

/// The same loop, vectorized by the compiler 16 wide.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn convert_row_avx512(src: &[f32], dst: &mut [u16]) {
    convert_row_plain(src, dst);
}

thread_local! {
    /// Converted activations of the current matmul (caller's thread).
    static ACTS: RefCell<Bf16Acts> = RefCell::new(Bf16Acts::new(Bf16Path::Dot));
}

/// Calls `f` with the `[m, k]` activations `x` converted for the hardware
/// path of `m` rows, when `needed` (some weight is packed BF16) and one
/// applies; with `None` otherwise.
pub(crate) fn with_acts<R>(
    x: &[f32],
    m: usize,
    k: usize,
    needed: bool,
    f: impl FnOnce(Option<&Bf16Acts>) -> R,
) -> R {
    match bf16_path(m).filter(|_| needed) {
        Some(path) => ACTS.with(|a| {
            let mut a = a.borrow_mut();
            a.convert(path, x, m, k);
            f(Some(&*a))
        }),
        None => f(None),
    }
}

/// `out[r, b·16 + j] = Σ_k bf16(x[r, k]) · w[b·16 + j, k]` for rows `r < a.m`
/// and the weight rows of blocks `b0..b1`, on the path `a` was converted for.
///
/// # Safety
/// `a.path` must be available (as [`with_acts`] ensures); `a` was converted
/// with `k == w.cols`; `out` points at an `[a.m, stride]` buffer whose
/// columns `b0·16 .. min(b1·16, w.rows)` belong to this call.
pub unsafe fn bf16_hw_blocks(
    a: &Bf16Acts,
    w: &PackedBf16,
    b0: usize,
    b1: usize,
    out: *mut f32,
    stride: usize,
) {
    debug_assert!(a.k == w.cols && available(a.path));
    match a.path {
        Bf16Path::Amx => super::bf16_amx::amx_blocks(a, w, b0, b1, out, stride),
        Bf16Path::Dot => super::bf16_dot::dot_blocks(a, w, b0, b1, out, stride),
    }
}

/// Test support shared by the AMX and AVX-512 BF16 kernel tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use crate::backend::cpu::elem::Bf16;
    use crate::backend::cpu::matmul::tests::pseudo_random;

    /// A kernel under test: `(acts, w, b0, b1, out, stride)`.
    pub type Kernel = dyn Fn(&Bf16Acts, &PackedBf16, usize, usize, *mut f32, usize);

    /// Activation rows, inputs and outputs the kernels are checked on.
    pub const MS: [usize; 10] = [1, 2, 15, 16, 17, 31, 32, 33, 100, 512];
    pub const KS: [usize; 7] = [2, 30, 32, 64, 576, 1536, 33];
    pub const NS: [usize; 5] = [16, 17, 48, 576, 1536];

    /// A random `[n, k]` BF16 matrix, packed, and its values as f32.
    pub fn weights(n: usize, k: usize, seed: u32) -> (PackedBf16, Vec<f32>) {
        let w: Vec<Bf16> = pseudo_random(n * k, seed)
            .iter()
            .map(|v| Bf16(to_bf16(*v)))
            .collect();
        let f = w.iter().map(|b| bf16_to_f32(b.0)).collect();
        (PackedBf16::pack(n, k, &w).unwrap(), f)
    }

    /// `(Σ_j bf16(x[r, j]) · w[c, j], Σ_j |…|)` in f64, `[m, n]` row-major.
    pub fn reference(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<(f64, f64)> {
        let xb: Vec<f64> = x[..m * k]
            .iter()
            .map(|v| bf16_to_f32(to_bf16(*v)) as f64)
            .collect();
        let wd: Vec<f64> = w.iter().map(|v| *v as f64).collect();
        let mut out = Vec::with_capacity(m * n);
        for r in 0..m {
            let xr = &xb[r * k..(r + 1) * k];
            for c in 0..n {
                let wr = &wd[c * k..(c + 1) * k];
                let (mut s, mut a) = (0f64, 0f64);
                for (xv, wv) in xr.iter().zip(wr) {
                    s += xv * wv;
                    a += (xv * wv).abs();
                }
                out.push((s, a));
            }
        }
        out
    }

    /// Runs `kernel(acts, w, b0, b1, out, stride)` on a block range that
    /// leaves the first columns untouched (and on all blocks), checking every
    /// written value against `want` (relative to Σ|terms|, 1e-5·√k) and that
    /// the other columns were not written.
    #[allow(clippy::too_many_arguments)]
    pub fn check(
        name: &str,
        kernel: &Kernel,
        x: &[f32],
        m: usize,
        k: usize,
        p: &PackedBf16,
        n: usize,
        want: &[(f64, f64)],
    ) {
        let mut acts = Bf16Acts::new(Bf16Path::Dot);
        acts.convert(Bf16Path::Dot, x, m, k);
        let blocks = n.div_ceil(16);
        let tol = 1e-5 * (k as f64).sqrt();
        let ranges = if blocks > 1 {
            vec![(0, blocks), (1, blocks)]
        } else {
            vec![(0, blocks)]
        };
        for (b0, b1) in ranges {
            // One spare column each side of every row: nothing may land there.
            let stride = n + 2;
            let mut out = vec![f32::NAN; m * stride + 2];
            kernel(&acts, p, b0, b1, out[1..].as_mut_ptr(), stride);
            for r in 0..m {
                for c in 0..stride {
                    let got = out[1 + r * stride + c];
                    if c < b0 * 16 || c >= n {
                        assert!(got.is_nan(), "{name} m={m} k={k} n={n}: wrote [{r},{c}]");
                        continue;
                    }
                    let (s, a) = want[r * n + c];
                    assert!(
                        (got as f64 - s).abs() <= tol * a.max(1e-30),
                        "{name} m={m} k={k} n={n} blocks {b0}..{b1} [{r},{c}]: {got} vs {s}"
                    );
                }
            }
            assert!(
                out[0].is_nan() && out[m * stride + 1].is_nan(),
                "{name}: wrote outside"
            );
        }
    }

    /// Every (m, k, n) of the grid, with at most `max_macs` multiply-adds.
    pub fn shapes(max_macs: usize) -> Vec<(usize, usize, usize)> {
        let mut v = Vec::new();
        for &n in &NS {
            for &k in &KS {
                for &m in &MS {
                    if m * k * n <= max_macs {
                        v.push((m, k, n));
                    }
                }
            }
        }
        v
    }

    /// Runs `check` for every shape of `shapes`, one weight matrix per (k, n).
    pub fn check_grid(name: &str, kernel: &Kernel, shapes: &[(usize, usize, usize)]) {
        let mut last: Option<((usize, usize), PackedBf16, Vec<f32>)> = None;
        for &(m, k, n) in shapes {
            if last.as_ref().is_none_or(|l| l.0 != (k, n)) {
                let (p, f) = weights(n, k, (k * 31 + n) as u32);
                last = Some(((k, n), p, f));
            }
            let (_, p, w) = last.as_ref().unwrap();
            let x = pseudo_random(m * k, (m * 7 + k) as u32);
            let want = reference(&x, m, k, w, n);
            check(name, kernel, &x, m, k, p, n, &want);
        }
    }

    /// Through `matmul` and the pool: packed BF16 segments side by side with
    /// an f32 one, on each hardware path this CPU has.
    #[test]
    fn bf16_hw_matmul_segments_match_reference() {
        use crate::backend::cpu::{matmul, Matrix, MatrixData, ThreadPool};
        use crate::tensor::HostSlice;
        let paths: Vec<Bf16Path> = [Bf16Path::Dot, Bf16Path::Amx]
            .into_iter()
            .filter(|&p| available(p))
            .collect();
        if paths.is_empty() {
            println!("skipped: no AVX512-BF16 or AMX-BF16");
            return;
        }
        let pool = ThreadPool::new(3);
        let k = 100;
        let (pa, wa) = weights(40, k, 11);
        let (pb, wb) = weights(17, k, 12);
        let wc = pseudo_random(24 * k, 13);
        let mats = [
            Matrix {
                rows: 40,
                cols: k,
                data: MatrixData::BF16Packed(pa),
            },
            Matrix {
                rows: 17,
                cols: k,
                data: MatrixData::BF16Packed(pb),
            },
            Matrix {
                rows: 24,
                cols: k,
                data: MatrixData::F32(HostSlice::from_vec(wc.clone())),
            },
        ];
        let n = 40 + 17 + 24;
        let runs = paths.iter().flat_map(|&p| match p {
            Bf16Path::Amx => vec![(p, None), (p, Some(16)), (p, Some(128))],
            Bf16Path::Dot => vec![(p, None)],
        });
        for (path, block) in runs {
            force_path(Some(path), false);
            force_amx_block(block);
            for m in [4usize, 16, 17, 40, 100] {
                let x = pseudo_random(m * k, m as u32);
                let mut out = vec![f32::NAN; m * n];
                matmul(&pool, &x, m, &[&mats[0], &mats[1], &mats[2]], &mut out);
                let (ra, rb) = (reference(&x, m, k, &wa, 40), reference(&x, m, k, &wb, 17));
                for r in 0..m {
                    for c in 0..n {
                        let got = out[r * n + c] as f64;
                        let (want, tol) = match c {
                            0..40 => (ra[r * 40 + c].0, 1e-5 * 10.0 * ra[r * 40 + c].1),
                            40..57 => (rb[r * 17 + c - 40].0, 1e-5 * 10.0 * rb[r * 17 + c - 40].1),
                            _ => {
                                let w = &wc[(c - 57) * k..(c - 56) * k];
                                let s = (0..k).map(|j| x[r * k + j] as f64 * w[j] as f64).sum();
                                (s, 1e-3)
                            }
                        };
                        assert!(
                            (got - want).abs() <= tol,
                            "{path:?} {block:?} m={m} [{r},{c}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
        force_path(None, true);
        force_amx_block(None);
    }

    #[test]
    fn bf16_rounding_is_nearest_even() {
        for (v, want) in [
            (1.0f32, 0x3f80u16),
            (f32::from_bits(0x3f80_8000), 0x3f80), // tie, even stays
            (f32::from_bits(0x3f81_8000), 0x3f82), // tie, odd rounds up
            (f32::from_bits(0x3f80_8001), 0x3f81),
            (f32::from_bits(0x3f80_7fff), 0x3f80),
            (-2.5, 0xc020),
            (f32::INFINITY, 0x7f80),
            (f32::MAX, 0x7f80),
        ] {
            assert_eq!(to_bf16(v), want, "{v:e}");
        }
        assert!(bf16_to_f32(to_bf16(f32::NAN)).is_nan());
        assert!(bf16_to_f32(to_bf16(f32::from_bits(0x7f80_0001))).is_nan());
        for v in crate::backend::cpu::matmul::tests::pseudo_random(1000, 3) {
            assert_eq!(to_bf16(v), half::bf16::from_f32(v).to_bits(), "{v}");
        }
    }

    #[test]
    fn bf16_acts_are_padded_with_zeros() {
        let (m, k) = (17, 33);
        let x = pseudo_random(m * k, 5);
        let mut a = Bf16Acts::new(Bf16Path::Dot);
        // A bigger conversion first: padding must not keep its values.
        a.convert(Bf16Path::Amx, &pseudo_random(40 * 70, 6), 40, 70);
        a.convert(Bf16Path::Dot, &x, m, k);
        assert_eq!((a.m, a.k, a.stride, a.path), (m, k, 64, Bf16Path::Dot));
        for r in 0..32 {
            // SAFETY: rows up to 32 (m rounded up to 16) of `stride` values exist.
            let row = unsafe { std::slice::from_raw_parts(a.row_ptr(r), a.stride) };
            for (j, v) in row.iter().enumerate() {
                let want = if r < m && j < k {
                    to_bf16(x[r * k + j])
                } else {
                    0
                };
                assert_eq!(*v, want, "[{r},{j}]");
            }
        }
    }
}

/// Timing, not a check: `cargo test --release --lib bench_bf16_hw --
/// --ignored --nocapture` (`BENCH_THREADS=2` (a list), `BENCH_ROWS=512,16`,
/// `BENCH_AMX_BLOCKS=32,64`: AMX again at these columns per task).
/// SmolLM2-135M's matrices through `matmul`, on the f32 kernels, AVX-512
/// BF16 and AMX (those this CPU has), in GFLOP/s. The same weights are
/// reused, so all but the LM head (56 MB) stay in cache.
#[cfg(test)]
mod bench {
    use super::testing::weights;
    use super::*;
    use crate::backend::cpu::{matmul, Matrix, MatrixData, ThreadPool};
    use std::time::Instant;

    fn list(var: &str, default: &str) -> Vec<usize> {
        std::env::var(var)
            .unwrap_or_else(|_| default.into())
            .split(',')
            .filter(|v| !v.trim().is_empty())
            .map(|v| v.trim().parse().expect("a list of numbers"))
            .collect()
    }

    /// Median seconds per `matmul` of `m` rows by `mat`.
    fn time(pool: &ThreadPool, mat: &Matrix, m: usize) -> f64 {
        let x = crate::backend::cpu::matmul::tests::pseudo_random(m * mat.cols, 2);
        let mut out = vec![0f32; m * mat.rows];
        let flops = 2.0 * (m * mat.rows * mat.cols) as f64;
        let reps = ((2e10 / flops) as usize).clamp(3, 200);
        matmul(pool, &x, m, &[mat], &mut out);
        let mut times: Vec<f64> = (0..5)
            .map(|_| {
                let start = Instant::now();
                for _ in 0..reps {
                    matmul(pool, &x, m, &[mat], &mut out);
                }
                start.elapsed().as_secs_f64() / reps as f64
            })
            .collect();
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        times[times.len() / 2]
    }

    #[test]
    #[ignore]
    fn bench_bf16_hw() {
        let shapes = [
            ("q/o 576x576", 576, 576),
            ("k_proj 192x576", 192, 576),
            ("gate/up 1536x576", 1536, 576),
            ("down 576x1536", 576, 1536),
            ("lm_head 49152x576", 49152, 576),
        ];
        let mats: Vec<(&str, Matrix)> = shapes
            .iter()
            .map(|&(name, n, k)| {
                let data = MatrixData::BF16Packed(weights(n, k, 1).0);
                (
                    name,
                    Matrix {
                        rows: n,
                        cols: k,
                        data,
                    },
                )
            })
            .collect();
        // (label, path, AMX columns per task)
        let mut runs: Vec<(String, Option<Bf16Path>, Option<usize>)> =
            vec![("f32".into(), None, None)];
        for (name, p) in [("avx512bf16", Bf16Path::Dot), ("amx", Bf16Path::Amx)] {
            if available(p) {
                runs.push((name.into(), Some(p), None));
            } else {
                println!("{name}: not available on this CPU");
            }
        }
        if available(Bf16Path::Amx) {
            for b in list("BENCH_AMX_BLOCKS", "") {
                runs.push((format!("amx/{b}"), Some(Bf16Path::Amx), Some(b)));
            }
        }
        for threads in list("BENCH_THREADS", "2") {
            let pool = ThreadPool::new(threads);
            println!("{threads} threads, GFLOP/s:");
            for &m in &list("BENCH_ROWS", "512,16") {
                for (name, mat) in &mats {
                    let flops = 2.0 * (m * mat.rows * mat.cols) as f64;
                    let mut line = format!("m={m:>4} {name:>18}:");
                    for (label, path, block) in &runs {
                        force_path(*path, false);
                        force_amx_block(*block);
                        let t = time(&pool, mat, m);
                        line += &format!(" {label} {:.0}", flops / t / 1e9);
                    }
                    force_path(None, true);
                    force_amx_block(None);
                    println!("{line}");
                }
            }
        }
    }
}
