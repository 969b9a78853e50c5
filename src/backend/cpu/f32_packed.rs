//! F32 weights repacked once (at load) for the kernels of
//! `packed_kernels.rs` (the layout of [`Packed`], with F32 lines as
//! follows): one 64-byte line per input, holding that input's weight for
//! the 16 rows of a block, so a line is already one f32 vector of 16
//! output columns.

use super::packed::{Packed, PackedElem, BLOCK_ROWS};

#[cfg(target_arch = "aarch64")]
use std::arch::aarch64::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// One input for the 16 rows of a block.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub struct F32Line(pub(crate) [f32; BLOCK_ROWS]);

/// A `[rows, cols]` F32 matrix in the packed layout described above.
pub type PackedF32 = Packed<f32>;

impl PackedElem for f32 {
    const NAME: &'static str = "F32";
    const INPUTS: usize = 1;
    // 12 rows instead of 8: a third less L2 traffic for the weight lines
    // per FMA (measured 5-8% faster matmuls at 512 rows).
    const TILE_ROWS: usize = 12;
    // Its lines are twice as many per FMA as BF16's: fetching the next
    // blocks (already in L2) into L1 as well measured 10-15% slower.
    const PREFILL_PREFETCH: bool = false;
    type Line = F32Line;

    #[inline]
    fn get(line: &F32Line, row: usize, _sub: usize) -> f32 {
        line.0[row]
    }

    #[inline]
    fn set(line: &mut F32Line, row: usize, _sub: usize, v: f32) {
        line.0[row] = v;
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn widen512(v: __m512i) -> [__m512; 2] {
        let v = _mm512_castsi512_ps(v);
        [v, v]
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn widen256(line: *const F32Line, h: usize) -> [__m256; 2] {
        let v = _mm256_load_ps((line as *const f32).add(8 * h));
        [v, v]
    }

    #[cfg(target_arch = "aarch64")]
    #[inline]
    unsafe fn widen_neon(line: *const F32Line) -> [[float32x4_t; 4]; 2] {
        let p = line as *const f32;
        let v = [0, 1, 2, 3].map(|q| vld1q_f32(p.add(4 * q)));
        [v, v]
    }
}
