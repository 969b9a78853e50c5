//! BF16 weights repacked once (at load) for the kernels of `bf16_kernels.rs`
//! (the layout of [`Packed`], with BF16 lines as follows).
//!
//! For every pair of consecutive inputs `(2p, 2p+1)`, a block's 16 rows'
//! two BF16 values side by side: one 64-byte line per pair, each 32-bit
//! lane holding row `i`'s input `2p` in its low half and `2p+1` in its high
//! half. One aligned load then gives 32 weights, and two single-op
//! widenings (`lane << 16` for the even input, `lane & 0xffff0000` for the
//! odd one) give two f32 vectors of 16 output columns each.

use super::elem::Bf16;
pub use super::packed::BLOCK_ROWS;
use super::packed::{Packed, PackedElem};

#[cfg(target_arch = "aarch64")]
use std::arch::aarch64::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// One pair of inputs for the 16 rows of a block: `[row][2]` BF16 bits.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub struct Line(pub(crate) [u16; 2 * BLOCK_ROWS]);

/// A `[rows, cols]` BF16 matrix in the packed layout described above.
pub type PackedBf16 = Packed<Bf16>;

impl PackedElem for Bf16 {
    const NAME: &'static str = "BF16";
    const INPUTS: usize = 2;
    type Line = Line;

    #[inline]
    fn get(line: &Line, row: usize, sub: usize) -> Bf16 {
        Bf16(line.0[2 * row + sub])
    }

    #[inline]
    fn set(line: &mut Line, row: usize, sub: usize, v: Bf16) {
        line.0[2 * row + sub] = v.0;
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn widen512(v: __m512i) -> [__m512; 2] {
        let hi = _mm512_set1_epi32(0xffff_0000u32 as i32);
        [
            _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(v, hi)),
        ]
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn widen256(line: *const Line, h: usize) -> [__m256; 2] {
        let hi = _mm256_set1_epi32(0xffff_0000u32 as i32);
        let v = _mm256_load_si256((line as *const __m256i).add(h));
        [
            _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(v, hi)),
        ]
    }

    #[cfg(target_arch = "aarch64")]
    #[inline]
    unsafe fn widen_neon(line: *const Line) -> [[float32x4_t; 4]; 2] {
        let p = line as *const u32;
        let v = [0, 1, 2, 3].map(|q| vld1q_u32(p.add(4 * q)));
        let hi = vdupq_n_u32(0xffff_0000);
        [
            v.map(|v| vreinterpretq_f32_u32(vshlq_n_u32::<16>(v))),
            v.map(|v| vreinterpretq_f32_u32(vandq_u32(v, hi))),
        ]
    }
}
