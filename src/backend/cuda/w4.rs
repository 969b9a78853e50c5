//! Int4 weights repacked for the GPU kernels of `kernels/int4.cu`: rows in
//! tiles of 16, inputs in chunks of 64, each chunk of a tile 32 lanes × 16
//! bytes laid out so that one lane's word `s` is the m16n8k16 A fragment of
//! k-step `s` (the nibble map is in kernels/int4.cu). Inside a chunk the
//! MMA's k order is a permutation of the inputs chosen so that each lane's
//! activations are two 16-byte runs (see [`chunk_input`]). Scales and zeros
//! per tile, group and row: `f16 scale bits | zero << 16`.
//!
//! Host-only code: the layout is built and checked without a GPU.

use crate::backend::cpu::q4::BLOCK_ROWS;
use crate::backend::cpu::Q4Matrix;
use crate::{bail_arg, Result};

/// Weight rows per tile (the MMA's M).
pub const TILE_ROWS: usize = 16;
/// Inputs per packed chunk (one uint4 per lane).
pub const CHUNK: usize = 64;
const _: () = assert!(TILE_ROWS == BLOCK_ROWS);

/// A `[rows, cols]` int4 matrix in the kernels' layout, on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct W4Host {
    pub rows: usize,
    pub cols: usize,
    /// Inputs per scale/zero: 32 or a multiple of 64.
    pub group: usize,
    /// `[tile][chunk][lane][4]`.
    pub words: Vec<u32>,
    /// `[tile][group][16]`.
    pub sz: Vec<u32>,
    /// GPTQ act-order: packed input `i` multiplies activation `perm[i]`.
    pub perm: Option<Vec<u32>>,
}

/// The input (offset in its chunk) that k-step `s` feeds lane quad `t`'s
/// fragment pair `j` (0: MMA k rows 2t, 2t+1; 1: 2t+8, 2t+9), element `e`:
/// lane `t` reads inputs 8t..8t+8 for k-steps 0, 1 and 32+8t..32+8t+8 for
/// k-steps 2, 3, so a k-step never straddles a 32-input group.
pub fn chunk_input(s: usize, t: usize, j: usize, e: usize) -> usize {
    32 * (s >> 1) + 8 * t + 4 * (s & 1) + 2 * j + e
}

/// (row offset in the tile, input offset in the chunk) of nibble `p` of
/// word `s` of lane `lane`: nibble p holds fragment register p % 4 (rows g,
/// g+8, g, g+8 for pairs 0, 0, 1, 1), element p / 4.
fn nibble_position(lane: usize, s: usize, p: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    let q = p % 4;
    (g + (q & 1) * 8, chunk_input(s, t, q >> 1, p / 4))
}

/// Why a matrix cannot take the GPU int4 path, if it cannot.
fn unsupported_reason(m: &Q4Matrix) -> Option<String> {
    if !m.rows.is_multiple_of(TILE_ROWS) || !m.cols.is_multiple_of(CHUNK) {
        return Some(format!(
            "int4 matrix [{}, {}] on CUDA needs rows a multiple of {TILE_ROWS} and inputs a multiple of {CHUNK}",
            m.rows, m.cols
        ));
    }
    if m.group != 32 && !m.group.is_multiple_of(CHUNK) {
        return Some(format!(
            "int4 group size {} on CUDA must be 32 or a multiple of {CHUNK}",
            m.group
        ));
    }
    None
}

impl W4Host {
    /// Repacks `m` (row tiles of 16 in both layouts, so each tile is packed
    /// independently).
    pub fn pack(m: &Q4Matrix) -> Result<W4Host> {
        if let Some(why) = unsupported_reason(m) {
            bail_arg!("{why}");
        }
        let (tiles, chunks, groups) = (m.rows / TILE_ROWS, m.cols / CHUNK, m.n_groups());
        let mut words = vec![0u32; tiles * chunks * 32 * 4];
        let mut sz = vec![0u32; tiles * groups * TILE_ROWS];
        for rt in 0..tiles {
            for c in 0..chunks {
                for lane in 0..32 {
                    for s in 0..4 {
                        let word = (0..8).fold(0u32, |acc, p| {
                            let (dr, dk) = nibble_position(lane, s, p);
                            acc | (m.q(rt * TILE_ROWS + dr, c * CHUNK + dk) as u32) << (4 * p)
                        });
                        words[((rt * chunks + c) * 32 + lane) * 4 + s] = word;
                    }
                }
            }
            for g in 0..groups {
                for j in 0..TILE_ROWS {
                    let r = rt * TILE_ROWS + j;
                    let (scale, min) = (m.scale(r, g), m.min(r, g));
                    // min = −z·s with an integer z in 0..=15: exact to recover.
                    let zero = if scale > 0.0 {
                        (-min / scale).round().clamp(0.0, 15.0) as u32
                    } else {
                        0
                    };
                    let bits = half::f16::from_f32(scale).to_bits() as u32;
                    sz[(rt * groups + g) * TILE_ROWS + j] = bits | zero << 16;
                }
            }
        }
        Ok(W4Host {
            rows: m.rows,
            cols: m.cols,
            group: m.group,
            words,
            sz,
            perm: m.perm().map(<[u32]>::to_vec),
        })
    }

    /// Row `r` dequantized from the packed layout, `(q − z) · s` in f32 (what
    /// the kernels compute; a check of the layout without a GPU), in the
    /// original input order.
    pub fn row_to_f32(&self, r: usize) -> Vec<f32> {
        let (chunks, groups) = (self.cols / CHUNK, self.cols.div_ceil(self.group));
        let (rt, j) = (r / TILE_ROWS, r % TILE_ROWS);
        let mut out = vec![0f32; self.cols];
        for c in 0..chunks {
            for lane in 0..32 {
                for s in 0..4 {
                    let word = self.words[((rt * chunks + c) * 32 + lane) * 4 + s];
                    for p in 0..8 {
                        let (dr, dk) = nibble_position(lane, s, p);
                        if dr != j {
                            continue;
                        }
                        let col = c * CHUNK + dk;
                        let e = self.sz[(rt * groups + col / self.group) * TILE_ROWS + j];
                        let scale = half::f16::from_bits(e as u16).to_f32();
                        let q = (word >> (4 * p)) & 0xF;
                        let dst = self.perm.as_ref().map_or(col, |p| p[col] as usize);
                        out[dst] = (q as f32 - (e >> 16 & 0xF) as f32) * scale;
                    }
                }
            }
        }
        out
    }

    /// Device bytes (packed weights, scales and zeros).
    pub fn bytes(&self) -> usize {
        (self.words.len() + self.sz.len()) * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random_q4(rows: usize, cols: usize, group: usize, seed: u64) -> Q4Matrix {
        random_q4_perm(rows, cols, group, seed, None)
    }

    fn random_q4_perm(
        rows: usize,
        cols: usize,
        group: usize,
        seed: u64,
        perm: Option<Vec<u32>>,
    ) -> Q4Matrix {
        let mut state = seed;
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as u32
        };
        let ng = cols.div_ceil(group);
        let q: Vec<u8> = (0..rows * cols).map(|_| (next() % 16) as u8).collect();
        let zeros: Vec<u8> = (0..rows * ng).map(|_| (next() % 16) as u8).collect();
        let scales: Vec<f32> = (0..rows * ng)
            .map(|_| half::f16::from_f32((next() % 1000) as f32 * 1e-4 + 1e-3).to_f32())
            .collect();
        Q4Matrix::from_quantized(rows, cols, group, &q, &zeros, &scales, perm).unwrap()
    }

    #[test]
    fn packed_rows_dequantize_like_the_cpu_matrix() {
        for (rows, cols, group) in [(16, 64, 32), (48, 192, 64), (32, 256, 128), (16, 576, 576)] {
            let m = random_q4(rows, cols, group, rows as u64 * 31 + cols as u64);
            let w = W4Host::pack(&m).unwrap();
            assert_eq!(w.words.len(), rows * cols / 8);
            let mut want = vec![0f32; cols];
            for r in 0..rows {
                m.row_to_f32(r, &mut want);
                assert_eq!(
                    w.row_to_f32(r),
                    want,
                    "row {r} of [{rows}, {cols}] g{group}"
                );
            }
        }
    }

    #[test]
    fn act_order_rows_dequantize_in_the_original_input_order() {
        let (rows, cols) = (32, 128);
        let perm: Vec<u32> = (0..cols as u32)
            .map(|i| (i * 37 + 5) % cols as u32)
            .collect();
        let m = random_q4_perm(rows, cols, 32, 9, Some(perm.clone()));
        let w = W4Host::pack(&m).unwrap();
        assert_eq!(w.perm.as_deref(), Some(&perm[..]));
        let mut want = vec![0f32; cols];
        for r in 0..rows {
            m.row_to_f32(r, &mut want);
            assert_eq!(w.row_to_f32(r), want);
        }
    }

    #[test]
    fn fragment_nibbles_cover_each_input_once_and_steps_keep_to_32_input_groups() {
        let mut seen = [[0u8; CHUNK]; TILE_ROWS];
        for lane in 0..32 {
            for s in 0..4 {
                for p in 0..8 {
                    let (r, k) = nibble_position(lane, s, p);
                    seen[r][k] += 1;
                    assert_eq!(k / 32, s / 2, "k-step {s} reads input {k}");
                }
            }
        }
        assert!(seen.iter().flatten().all(|&n| n == 1));
        // A lane's inputs are two runs of 8: 8t.. and 32 + 8t..
        for t in 0..4 {
            let mut ks: Vec<usize> = (0..4)
                .flat_map(|s| (0..4).map(move |je| chunk_input(s, t, je / 2, je % 2)))
                .collect();
            ks.sort();
            let want: Vec<usize> = (8 * t..8 * t + 8).chain(32 + 8 * t..40 + 8 * t).collect();
            assert_eq!(ks, want);
        }
    }

    #[test]
    fn shapes_the_kernels_cannot_take_are_refused() {
        let odd_rows = random_q4(8, 64, 32, 1);
        assert!(W4Host::pack(&odd_rows)
            .unwrap_err()
            .to_string()
            .contains("multiple of 16"));
        let odd_cols = random_q4(16, 96, 32, 2);
        assert!(W4Host::pack(&odd_cols)
            .unwrap_err()
            .to_string()
            .contains("multiple of 64"));
        let g96 = random_q4(16, 192, 96, 3);
        assert!(unsupported_reason(&g96).unwrap().contains("group size 96"));
    }
}
