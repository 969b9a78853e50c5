//! Weight element types the matmul kernels read, each able to widen to f32
//! in SIMD registers.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

pub trait WeightElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// Loads 16 elements at `p` as f32.
    ///
    /// # Safety
    /// `p..p+16` must be readable; AVX-512F must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> __m512;
    /// Loads 8 elements at `p` as f32.
    ///
    /// # Safety
    /// `p..p+8` must be readable; AVX2, FMA and F16C must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> __m256;
}

impl WeightElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load16(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
}

/// bfloat16 stored as raw bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

/// IEEE half stored as raw bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub struct F16(pub u16);

impl WeightElem for Bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load16(p: *const Bf16) -> __m512 {
        let h = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const Bf16) -> __m256 {
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }
}

impl WeightElem for F16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::from_bits(self.0).to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load16(p: *const F16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const F16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}
