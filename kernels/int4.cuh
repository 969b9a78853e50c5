// What the int4 kernels (int4.cu) and the int4 GEMM (int4_gemm.cu) share
// of the packed weight layout.
#ifndef NI_INT4_CUH
#define NI_INT4_CUH

#define W4_CHUNK 64  // inputs per chunk

// input / group without a division: group_magic = ⌈2³² / group⌉ (exact
// for inputs < 2³² / group).
__device__ __forceinline__ unsigned w4_group_magic(int group) { return 0xffffffffu / (unsigned)group + 1u; }
__device__ __forceinline__ int w4_group_of(int input, unsigned group_magic) {
    return (int)__umulhi((unsigned)input, group_magic);
}

#endif  // NI_INT4_CUH
