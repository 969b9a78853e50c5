//! F16 weights repacked once (at load) for the kernels of
//! `packed_kernels.rs` (the layout of [`Packed`], with F16 lines as
//! follows): one 64-byte line per pair of inputs `(2p, 2p+1)`, the 16
//! rows' input `2p` in the first 32 bytes and input `2p+1` in the second,
//! so each half converts (`vcvtph2ps`) into one f32 vector of 16 output
//! columns.

use super::elem::F16;
use super::packed::{Packed, PackedElem, BLOCK_ROWS};

#[cfg(target_arch = "aarch64")]
use std::arch::aarch64::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// One pair of inputs for the 16 rows of a block: `[input][row]` F16 bits.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub struct F16Line(pub(crate) [u16; 2 * BLOCK_ROWS]);

/// A `[rows, cols]` F16 matrix in the packed layout described above.
pub type PackedF16 = Packed<F16>;

impl PackedElem for F16 {
    const NAME: &'static str = "F16";
    const INPUTS: usize = 2;
    type Line = F16Line;

    #[inline]
    fn get(line: &F16Line, row: usize, sub: usize) -> F16 {
        F16(line.0[sub * BLOCK_ROWS + row])
    }

    #[inline]
    fn set(line: &mut F16Line, row: usize, sub: usize, v: F16) {
        line.0[sub * BLOCK_ROWS + row] = v.0;
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn widen512(v: __m512i) -> [__m512; 2] {
        [
            _mm512_cvtph_ps(_mm512_castsi512_si256(v)),
            _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(v)),
        ]
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen256(line: *const F16Line, h: usize) -> [__m256; 2] {
        let p = line as *const __m128i;
        [
            _mm256_cvtph_ps(_mm_load_si128(p.add(h))),
            _mm256_cvtph_ps(_mm_load_si128(p.add(2 + h))),
        ]
    }

    #[cfg(target_arch = "aarch64")]
    #[inline]
    unsafe fn widen_neon(line: *const F16Line) -> [[float32x4_t; 4]; 2] {
        let p = line as *const u16;
        let (a0, a1) = super::neon_packed::f16x8_to_f32(vld1q_u16(p));
        let (a2, a3) = super::neon_packed::f16x8_to_f32(vld1q_u16(p.add(8)));
        let (b0, b1) = super::neon_packed::f16x8_to_f32(vld1q_u16(p.add(16)));
        let (b2, b3) = super::neon_packed::f16x8_to_f32(vld1q_u16(p.add(24)));
        [[a0, a1, a2, a3], [b0, b1, b2, b3]]
    }
}
