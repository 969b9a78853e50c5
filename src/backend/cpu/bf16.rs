//! BF16 weights repacked once (at load) for the kernels of `bf16_kernels.rs`.
//!
//! Rows go in blocks of 16 (the output columns of one 512-bit vector) and,
//! inside a block, for every pair of consecutive inputs `(2p, 2p+1)`, the
//! 16 rows' two BF16 values side by side: one 64-byte line per pair, each
//! 32-bit lane holding row `i`'s input `2p` in its low half and `2p+1` in
//! its high half. One aligned load then gives 32 weights, and two single-op
//! widenings (`lane << 16` for the even input, `lane & 0xffff0000` for the
//! odd one) give two f32 vectors of 16 output columns each: no per-row
//! streams, no horizontal sums, and the matrix is read front to back in one
//! sequential stream.

use super::elem::{Bf16, WeightElem};
use crate::{bail_arg, Result};

/// Rows of a packed block (one 512-bit vector of f32 outputs).
pub const BLOCK_ROWS: usize = 16;

/// One pair of inputs for the 16 rows of a block: `[row][2]` BF16 bits.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Line(pub(crate) [u16; 2 * BLOCK_ROWS]);

/// A `[rows, cols]` BF16 matrix in the packed layout described above.
pub struct PackedBf16 {
    pub rows: usize,
    pub cols: usize,
    /// Input pairs per row: `cols / 2` rounded up (a padding input is 0).
    pub(crate) pairs: usize,
    /// `[row_block][pair]`; padding rows are 0.
    pub(crate) lines: Vec<Line>,
}

impl PackedBf16 {
    /// Packs a row-major `[rows, cols]` BF16 matrix.
    pub fn pack(rows: usize, cols: usize, w: &[Bf16]) -> Result<PackedBf16> {
        if w.len() != rows * cols {
            bail_arg!(
                "BF16 matrix [{rows}, {cols}] needs {} values, got {}",
                rows * cols,
                w.len()
            );
        }
        let pairs = cols.div_ceil(2);
        let blocks = rows.div_ceil(BLOCK_ROWS);
        let mut lines = vec![Line([0; 2 * BLOCK_ROWS]); blocks * pairs];
        for (b, block) in lines.chunks_mut(pairs.max(1)).enumerate().take(blocks) {
            let r0 = b * BLOCK_ROWS;
            for i in 0..BLOCK_ROWS.min(rows - r0) {
                let row = &w[(r0 + i) * cols..(r0 + i + 1) * cols];
                for (line, two) in block.iter_mut().zip(row.chunks(2)) {
                    line.0[2 * i] = two[0].0;
                    if let Some(odd) = two.get(1) {
                        line.0[2 * i + 1] = odd.0;
                    }
                }
            }
        }
        Ok(PackedBf16 {
            rows,
            cols,
            pairs,
            lines,
        })
    }

    /// The weight at row `r`, input `j` (both in range).
    #[inline]
    pub fn get(&self, r: usize, j: usize) -> Bf16 {
        let (b, i) = (r / BLOCK_ROWS, r % BLOCK_ROWS);
        Bf16(self.lines[b * self.pairs + j / 2].0[2 * i + j % 2])
    }

    /// Row `r` widened to f32 into `out` (embedding lookups of a tied table).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        for (j, o) in out[..self.cols].iter_mut().enumerate() {
            *o = self.get(r, j).to_f32();
        }
    }

    /// Bytes a full pass over the weights reads (padding included).
    pub fn size_in_bytes(&self) -> usize {
        self.lines.len() * std::mem::size_of::<Line>()
    }

    /// The lines of row block `b`.
    #[inline]
    pub(crate) fn block_ptr(&self, b: usize) -> *const Line {
        debug_assert!(b < self.rows.div_ceil(BLOCK_ROWS));
        // SAFETY: block `b` exists, so `b * pairs` is within `lines` (or its end).
        unsafe { self.lines.as_ptr().add(b * self.pairs) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf(v: f32) -> Bf16 {
        Bf16(half::bf16::from_f32(v).to_bits())
    }

    #[test]
    fn packing_round_trips_rows_of_odd_shapes() {
        for &(rows, cols) in &[(1, 1), (3, 5), (16, 2), (17, 33), (40, 576)] {
            let w: Vec<Bf16> = (0..rows * cols).map(|i| bf(i as f32 * 0.5 - 7.0)).collect();
            let p = PackedBf16::pack(rows, cols, &w).unwrap();
            assert_eq!(p.size_in_bytes(), rows.div_ceil(16) * cols.div_ceil(2) * 64);
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                p.row_to_f32(r, &mut row);
                for (j, v) in row.iter().enumerate() {
                    assert_eq!(*v, w[r * cols + j].to_f32(), "[{rows}, {cols}] at {r},{j}");
                }
            }
            // Padding rows and inputs are zero.
            let last = p.lines.last().unwrap();
            if rows % 16 != 0 {
                assert!(last.0[2 * (rows % 16)..].iter().all(|&v| v == 0));
            }
            if cols % 2 == 1 {
                assert!((0..16).all(|i| last.0[2 * i + 1] == 0));
            }
        }
    }

    #[test]
    fn wrong_length_is_an_error() {
        let err = PackedBf16::pack(2, 3, &[bf(1.0); 5]).err().unwrap();
        assert!(err.to_string().contains("needs 6 values, got 5"), "{err}");
    }
}
