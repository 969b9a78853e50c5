//! Dense weights repacked once (at load) for the kernels of
//! `packed_kernels.rs`, generic over the element type.
//!
//! Rows go in blocks of 16 (the output columns of one 512-bit vector of
//! f32), and a block is a sequence of 64-byte lines, each holding the 16
//! rows' weights for [`PackedElem::INPUTS`] consecutive inputs (1 for F32,
//! 2 for BF16/F16; how they sit in the line is the element's choice, see
//! `bf16.rs`, `f32_packed.rs`, `f16_packed.rs`). One aligned load gives a
//! line, widened to `INPUTS` f32 vectors of 16 output columns each: no
//! per-row streams, no horizontal sums, and the matrix is read front to
//! back in one sequential stream.

use super::elem::WeightElem;
use crate::{bail_arg, Result};

#[cfg(target_arch = "aarch64")]
use std::arch::aarch64::float32x4_t;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Rows of a packed block (one 512-bit vector of f32 outputs).
pub const BLOCK_ROWS: usize = 16;

/// The most activation rows of an AVX-512 register tile (12 rows × 2
/// blocks: 24 accumulators, 4 weight vectors, 2 broadcasts of 32 registers).
pub const MAX_TILE_ROWS: usize = 12;

/// A weight element type with a packed 64-byte line layout.
pub trait PackedElem: WeightElem {
    /// The format's name in messages ("F32", "BF16", "F16").
    const NAME: &'static str;
    /// Consecutive inputs one line holds for the 16 rows of a block.
    const INPUTS: usize;
    /// Up to this many activation rows share a register tile (AVX-512;
    /// at most [`MAX_TILE_ROWS`]).
    const TILE_ROWS: usize = 8;
    /// Whether prefill tiles prefetch the next blocks' lines as they read
    /// their own (see `packed_kernels.rs`).
    const PREFILL_PREFETCH: bool = true;
    /// One 64-byte, 64-aligned line.
    type Line: Copy + Default + Send + Sync + 'static;

    /// The weight of block row `row`, input `sub` (< `INPUTS`) of the line.
    fn get(line: &Self::Line, row: usize, sub: usize) -> Self;
    /// Stores the weight of block row `row`, input `sub` into the line.
    fn set(line: &mut Self::Line, row: usize, sub: usize, v: Self);

    /// The line's inputs as f32 vectors of the block's 16 rows (entries
    /// `INPUTS..` are unspecified).
    ///
    /// # Safety
    /// AVX-512F must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen512(v: __m512i) -> [__m512; 2];

    /// Rows `8h..8h + 8` of the line's inputs as f32 vectors (entries
    /// `INPUTS..` are unspecified).
    ///
    /// # Safety
    /// `line` must be readable and 64-aligned; AVX2 and F16C must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen256(line: *const Self::Line, h: usize) -> [__m256; 2];

    /// The line's inputs as f32 vectors, `[input][rows 4q..4q + 4]`
    /// (entries `INPUTS..` are unspecified), for the kernels of
    /// `neon_packed.rs`.
    ///
    /// # Safety
    /// `line` must be readable and 64-aligned.
    #[cfg(target_arch = "aarch64")]
    unsafe fn widen_neon(line: *const Self::Line) -> [[float32x4_t; 4]; 2];
}

/// A `[rows, cols]` matrix in the packed layout described above.
pub struct Packed<E: PackedElem> {
    pub rows: usize,
    pub cols: usize,
    /// Lines per block: `cols / INPUTS` rounded up (padding inputs are 0).
    pub(crate) steps: usize,
    /// `[row_block][step]`; padding rows are 0.
    pub(crate) lines: Vec<E::Line>,
}

impl<E: PackedElem> Packed<E> {
    /// Packs a row-major `[rows, cols]` matrix.
    pub fn pack(rows: usize, cols: usize, w: &[E]) -> Result<Packed<E>> {
        if w.len() != rows * cols {
            bail_arg!(
                "{} matrix [{rows}, {cols}] needs {} values, got {}",
                E::NAME,
                rows * cols,
                w.len()
            );
        }
        let steps = cols.div_ceil(E::INPUTS);
        let blocks = rows.div_ceil(BLOCK_ROWS);
        let mut lines = vec![E::Line::default(); blocks * steps];
        for (b, block) in lines.chunks_mut(steps.max(1)).enumerate().take(blocks) {
            let r0 = b * BLOCK_ROWS;
            for i in 0..BLOCK_ROWS.min(rows - r0) {
                let row = &w[(r0 + i) * cols..(r0 + i + 1) * cols];
                for (line, inputs) in block.iter_mut().zip(row.chunks(E::INPUTS)) {
                    for (s, &v) in inputs.iter().enumerate() {
                        E::set(line, i, s, v);
                    }
                }
            }
        }
        Ok(Packed {
            rows,
            cols,
            steps,
            lines,
        })
    }

    /// The weight at row `r`, input `j` (both in range).
    #[inline]
    pub fn get(&self, r: usize, j: usize) -> E {
        let (b, i) = (r / BLOCK_ROWS, r % BLOCK_ROWS);
        E::get(
            &self.lines[b * self.steps + j / E::INPUTS],
            i,
            j % E::INPUTS,
        )
    }

    /// Row `r` widened to f32 into `out` (embedding lookups of a tied table).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        for (j, o) in out[..self.cols].iter_mut().enumerate() {
            *o = self.get(r, j).to_f32();
        }
    }

    /// Bytes a full pass over the weights reads (padding included).
    pub fn size_in_bytes(&self) -> usize {
        self.lines.len() * std::mem::size_of::<E::Line>()
    }

    /// The lines of row block `b`.
    #[inline]
    pub(crate) fn block_ptr(&self, b: usize) -> *const E::Line {
        debug_assert!(b < self.rows.div_ceil(BLOCK_ROWS));
        // SAFETY: block `b` exists, so `b * steps` is within `lines` (or its end).
        unsafe { self.lines.as_ptr().add(b * self.steps) }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::backend::cpu::elem::{Bf16, F16};

    /// `v` rounded to `E` (exactly representable test values).
    pub(crate) trait FromF32: PackedElem {
        fn from_f32(v: f32) -> Self;
    }
    impl FromF32 for f32 {
        fn from_f32(v: f32) -> f32 {
            v
        }
    }
    impl FromF32 for Bf16 {
        fn from_f32(v: f32) -> Bf16 {
            Bf16(half::bf16::from_f32(v).to_bits())
        }
    }
    impl FromF32 for F16 {
        fn from_f32(v: f32) -> F16 {
            F16(half::f16::from_f32(v).to_bits())
        }
    }

    fn round_trips<E: FromF32>() {
        assert_eq!(std::mem::size_of::<E::Line>(), 64);
        assert_eq!(std::mem::align_of::<E::Line>(), 64);
        for &(rows, cols) in &[(1, 1), (3, 5), (16, 2), (17, 33), (40, 576)] {
            let w: Vec<E> = (0..rows * cols)
                .map(|i| E::from_f32(i as f32 * 0.5 - 7.0))
                .collect();
            let p = Packed::pack(rows, cols, &w).unwrap();
            let lines = cols.div_ceil(E::INPUTS);
            assert_eq!(p.size_in_bytes(), rows.div_ceil(16) * lines * 64);
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                p.row_to_f32(r, &mut row);
                for (j, v) in row.iter().enumerate() {
                    assert_eq!(*v, w[r * cols + j].to_f32(), "[{rows}, {cols}] at {r},{j}");
                }
            }
            // Padding rows and inputs are zero.
            let last = p.lines.last().unwrap();
            for i in 0..16 {
                for s in 0..E::INPUTS {
                    let pad_row = rows % 16 != 0 && i >= rows % 16;
                    let pad_input = (lines - 1) * E::INPUTS + s >= cols;
                    if pad_row || pad_input {
                        assert_eq!(
                            E::get(last, i, s).to_f32(),
                            0.0,
                            "[{rows}, {cols}] pad {i},{s}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn packing_round_trips_rows_of_odd_shapes() {
        round_trips::<f32>();
        round_trips::<Bf16>();
        round_trips::<F16>();
    }

    #[test]
    fn wrong_length_is_an_error() {
        let err = Packed::pack(2, 3, &[Bf16(0); 5]).err().unwrap();
        assert!(
            err.to_string()
                .contains("BF16 matrix [2, 3] needs 6 values, got 5"),
            "{err}"
        );
        let err = Packed::pack(2, 3, &[0f32; 7]).err().unwrap();
        assert!(
            err.to_string()
                .contains("F32 matrix [2, 3] needs 6 values, got 7"),
            "{err}"
        );
    }
}
