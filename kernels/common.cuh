// Helpers every kernel source shares: the 16-bit activation type and its
// conversions, reductions, programmatic-launch waits, FP8 KV encoding, the
// residual-adding norm row, the QKV epilogue, tensor-core fragments and
// asynchronous copies. Each kernel source includes it and compiles on its
// own (the library resolves the include before NVRTC sees the source).
#ifndef NI_COMMON_CUH
#define NI_COMMON_CUH

typedef unsigned short raw16;
#define NI_INF __int_as_float(0x7f800000)

#if NI_F16
__device__ __forceinline__ float to_f(raw16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}
__device__ __forceinline__ raw16 from_f(float f) {
    raw16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#else
__device__ __forceinline__ float to_f(raw16 x) { return __uint_as_float(((unsigned)x) << 16); }
__device__ __forceinline__ raw16 from_f(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (raw16)0x7fc0;  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);                              // round to nearest even
    return (raw16)(u >> 16);
}
#endif

// Rounds to the activation dtype and back.
__device__ __forceinline__ float rnd(float x) { return to_f(from_f(x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Reduces over the block (blockDim.x a multiple of 32) with `warp_op`, a
// warp-wide reduction whose identity is `none`; every thread gets the result.
template <typename T, typename WarpOp>
__device__ T block_reduce(T v, T none, WarpOp warp_op) {
    __shared__ T partial[32];
    v = warp_op(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    return warp_op(lane < (int)(blockDim.x >> 5) ? partial[lane] : none);
}

__device__ float block_sum(float v) {
    return block_reduce(v, 0.f, [](float x) { return warp_sum(x); });
}

// Programmatic dependent launch (sm_90+). Kernels are launched so that the
// next one may start while this one drains: small kernels let their
// dependents launch at once, GEMVs once their weights are read
// (grid_dep_launch), and every kernel waits for the previous
// kernel to complete, memory included, before it reads or writes anything
// that kernel touches (grid_dep_wait). Both are no-ops on older GPUs and in
// plain launches.
__device__ __forceinline__ void grid_dep_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dep_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// 16 bytes of what the previous kernel wrote (activations), for kernels
// that may be launched while it drains. Its writes are visible after
// grid_dep_wait to ordinary loads, but not to the non-coherent read-only
// path (ld.global.nc / __ldg, for data constant over the kernel's life):
// with programmatic launch that path returned stale rows. ld.global.ca
// still keeps them in L1 for the warps and blocks that reread them.
__device__ __forceinline__ uint4 load_act16(const void* p) {
    return __ldca((const uint4*)p);
}
// Kernel prologue for kernels that read their inputs right away.
#define GRID_DEP_ENTER() \
    grid_dep_launch();   \
    grid_dep_wait()

// Rotate-half RoPE of one pair (x1 in the first half of the head, x2 in the
// second), rounding where transformers does in the activation dtype.
__device__ __forceinline__ void rope_rotate(float& x1, float& x2, float c, float s) {
    const float y1 = rnd(x1 * c) - rnd(x2 * s);
    const float y2 = rnd(x2 * c) + rnd(x1 * s);
    x1 = y1;
    x2 = y2;
}

// silu(gate) * up, gate and up already in the activation dtype.
__device__ __forceinline__ float silu_mul_f(float gate, float up) {
    return rnd(gate / (1.f + __expf(-gate))) * up;
}

// Eight 16-bit values of a 16-byte load, as floats.
__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = to_f((raw16)(u[i] & 0xffffu));
        f[2 * i + 1] = to_f((raw16)(u[i] >> 16));
    }
}

// Two values as one 32-bit 32-bit register, `lo` in the low half.
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    return (unsigned)from_f(lo) | ((unsigned)from_f(hi) << 16);
}

// ---- The FP8 KV cache ----
// A KV cache of `fp8` elements holds OCP e4m3fn bytes (sign, 4 exponent
// bits of bias 7, 3 mantissa bits; largest 448, no infinities), unscaled
// (vLLM's fp8 cache with scale 1): half the bytes of a 16-bit cache. Stores
// round the activation-dtype value to nearest even and saturate at ±448;
// loads widen exactly. The kernels that read or write the cache are
// templates over its element type, `raw16` or `fp8`.
typedef unsigned char fp8;

// The e4m3 byte of f without the sm_89+ instruction (same results).
__device__ __forceinline__ unsigned e4m3_soft(float f) {
    const unsigned sign = (__float_as_uint(f) >> 24) & 0x80u;
    float a = fabsf(f);
    if (a != a) return sign | 0x7fu;  // NaN
    a = fminf(a, 448.f);
    if (a < 0.015625f)  // below 2^-6: the subnormal steps of 2^-9 (8 steps = 0x08, the smallest normal)
        return sign | (unsigned)__float2int_rn(a * 512.f);
    unsigned v = __float_as_uint(a);
    v += 0x7ffffu + ((v >> 20) & 1u);  // round to 3 mantissa bits, nearest even
    return sign | ((((v >> 23) - 120u) << 3) | ((v >> 20) & 7u));
}

// Two values as e4m3 bytes, `lo` in the low byte.
__device__ __forceinline__ unsigned short e4m3x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (unsigned short)(e4m3_soft(lo) | (e4m3_soft(hi) << 8));
#endif
}

// Two e4m3 bytes, at bits 8..15 and 24..31 of t (the other bits are
// ignored), as two activation-dtype values, the first in the low half.
// Exact: the byte's exponent and mantissa bits move into the 16-bit
// format's fields, and a multiply by a power of two corrects the exponent
// bias (subnormals included; half-precision arithmetic keeps them).
__device__ __forceinline__ unsigned e4m3x2_widen(unsigned t) {
#if NI_F16
    const unsigned bits = (t & 0x80008000u) | ((t & 0x7f007f00u) >> 1);
    unsigned r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(bits), "r"(0x5c005c00u));  // 2^(15 - 7)
    return r;
#else
    const unsigned bits = (t & 0x80008000u) | ((t & 0x7f007f00u) >> 4);
#if __CUDA_ARCH__ >= 800
    unsigned r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;"  // bits * 2^(127 - 7) + (-0)
        : "=r"(r)
        : "r"(bits), "r"(0x7b807b80u), "r"(0x80008000u));
    return r;
#else
    return pack2(to_f((raw16)bits) * 0x1p120f, to_f((raw16)(bits >> 16)) * 0x1p120f);
#endif
#endif
}
// Bytes 2i and 2i + 1 of w, widened.
__device__ __forceinline__ unsigned e4m3_pair(unsigned w, int i) {
    return e4m3x2_widen(__byte_perm(w, 0, i ? 0x3020u : 0x1000u));
}
// Byte i of a and byte i of b, widened (a's in the low half).
__device__ __forceinline__ unsigned e4m3_cross(unsigned a, unsigned b, int i) {
    return e4m3x2_widen(__byte_perm(a, b, ((4u + i) << 12) | ((unsigned)i << 4)));
}

// Element access of a KV cache of either type.
__device__ __forceinline__ raw16 kv_raw16(raw16 x) { return x; }
__device__ __forceinline__ raw16 kv_raw16(fp8 x) { return (raw16)e4m3x2_widen((unsigned)x << 8); }
__device__ __forceinline__ void kv_store(raw16* p, float v) { *p = from_f(v); }
// From the activation-dtype value, as a 16-bit cache holds it (transformers
// rounds a key to bf16, then to fp8; one rounding straight from f32 can differ).
__device__ __forceinline__ void kv_store(fp8* p, float v) { *p = (fp8)e4m3x2(rnd(v), 0.f); }
// Eight consecutive elements as one load (16 bytes of raw16, 8 of fp8) and
// their values.
template <typename KV>
struct KvRun;
template <>
struct KvRun<raw16> {
    typedef uint4 type;
};
template <>
struct KvRun<fp8> {
    typedef uint2 type;
};
// Eight e4m3 bytes, widened to eight activation-dtype values in order.
__device__ __forceinline__ uint4 e4m3x8_widen(uint2 v) {
    return make_uint4(e4m3_pair(v.x, 0), e4m3_pair(v.x, 1), e4m3_pair(v.y, 0), e4m3_pair(v.y, 1));
}
__device__ __forceinline__ void kv_unpack8(uint4 v, float* f) { unpack8(v, f); }
__device__ __forceinline__ void kv_unpack8(uint2 v, float* f) { unpack8(e4m3x8_widen(v), f); }

#define NORM_VECS 2          // 16-byte runs a thread keeps: d <= 8 * NORM_VECS * blockDim.x (the host checks)
#define NORM_MAX_D (8 * 1024 * NORM_VECS)

// add_rms_norm's row: residual row r (+ delta, written back if
// `write_back`) rounded into `values` and v; returns rstd. Every thread of
// the block calls it.
__device__ __forceinline__ float add_rms_norm_row(raw16* residual, const raw16* delta, size_t r, bool write_back, int d,
                                                  float eps, raw16* values, float (&v)[NORM_VECS][8]) {
    uint4* x = (uint4*)(residual + r * d);
    const uint4* dx = delta ? (const uint4*)(delta + r * d) : 0;
    const int dv = d / 8;
#pragma unroll
    for (int j = 0; j < NORM_VECS; j++) {
        const int i = threadIdx.x + j * blockDim.x;
#pragma unroll
        for (int e = 0; e < 8; e++) v[j][e] = 0.f;
        if (i < dv) {
            uint4 run = x[i];
            unpack8(run, v[j]);
            if (dx) {
                float f[8];
                unpack8(dx[i], f);
#pragma unroll
                for (int e = 0; e < 8; e++) v[j][e] = rnd(v[j][e] + f[e]);
                run = make_uint4(pack2(v[j][0], v[j][1]), pack2(v[j][2], v[j][3]), pack2(v[j][4], v[j][5]),
                                 pack2(v[j][6], v[j][7]));
                if (write_back) x[i] = run;
            }
            ((uint4*)values)[i] = run;
        }
    }
    __syncthreads();
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float a = to_f(values[i]);
        ss += a * a;  // the old kernel's expression (and so its fused multiply-add)
    }
    return rsqrtf(block_sum(ss) / d + eps);
}

// One output of add_rms_norm: weight g times the input value a normed.
__device__ __forceinline__ float rms_normed(float g, float a, float rstd) { return g * rnd(a * rstd); }

#define GEMV_OUT_ACT 0       // y in the activation dtype
#define GEMV_OUT_F32 1       // y in f32 (logits)
#define GEMV_OUT_RESIDUAL 2  // y (activation dtype) += the product: a residual add

// The end of the QKV projection for one output pair of row r: bias, RoPE
// and the store. (a, b) is a rope pair of a q or k head (b = a + hd / 2,
// rotary frequency freq) or two v columns (freq < 0); q goes to the QKV
// rows (stride nq + 2 * nkv), k and v to slot slots[r] of the caches.
__device__ __forceinline__ void qkv_pair_store(float ya, float yb, int r, int a, int b, int freq,
                                               const raw16* bias, raw16* qkv, const float2* cs,
                                               const unsigned* slots, void* k_cache,
                                               void* v_cache, int nq, int nkv, int hd, bool kv_fp8) {
    ya = rnd(ya);
    yb = rnd(yb);
    if (bias) {
        ya = rnd(ya + to_f(bias[a]));
        yb = rnd(yb + to_f(bias[b]));
    }
    if (freq >= 0) {
        const float2 a_cs = cs[(size_t)r * (hd / 2) + freq];
        rope_rotate(ya, yb, a_cs.x, a_cs.y);
    }
    if (a < nq) {
        raw16* row = qkv + (size_t)r * (nq + 2 * nkv);
        row[a] = from_f(ya);
        row[b] = from_f(yb);
    } else {
        const bool is_k = a < nq + nkv;
        const size_t at = (size_t)slots[r] * nkv + a - (is_k ? nq : nq + nkv);
        void* cache = is_k ? k_cache : v_cache;
        if (kv_fp8) {
            kv_store((fp8*)cache + at, ya);
            kv_store((fp8*)cache + at + b - a, yb);
        } else {
            kv_store((raw16*)cache + at, ya);
            kv_store((raw16*)cache + at + b - a, yb);
        }
    }
}

// d += a · b on tensor cores: a 16x16 (row-major fragment), b 16x8
// (column-major fragment), f32 accumulators.
#if NI_F16
#define MMA_16816 "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#else
#define MMA_16816 "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#endif
__device__ __forceinline__ void mma16816_rows(float& d0, float& d1, float& d2, float& d3,
                                              unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                              unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(MMA_16816 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    mma16816_rows(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1);
}
// The same product when rows 8..15 of A are zero: only the accumulators of
// rows 0..7 (d[0], d[1]) are kept.
__device__ __forceinline__ void mma16816_top(float (&d)[2], const unsigned (&a)[4], unsigned b0,
                                             unsigned b1) {
    float unused2 = 0.f, unused3 = 0.f;
    mma16816_rows(d[0], d[1], unused2, unused3, a[0], 0u, a[2], 0u, b0, b1);
}

// Shared-memory staging for the flash tiles (sm_80+): 16-byte asynchronous
// copies (zero-filled when src_bytes is 0) and 8x8 fragment loads.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// dst: a shared-memory address (smem_u32).
__device__ __forceinline__ void cp_async16_at(unsigned dst, const void* src, int src_bytes) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
#endif
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    cp_async16_at(smem_u32(dst), src, src_bytes);
}
__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
__device__ __forceinline__ void cp_async_wait_all() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group 0;" ::: "memory");
#endif
}
// Four 8x8 16-bit matrices; lane l gives the row address of matrix l / 8
// and gets, of each matrix, row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1
// (with TRANS: column l / 4, rows 2 (l % 4) and 2 (l % 4) + 1).
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
#if __CUDA_ARCH__ >= 800
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(smem_u32(row)));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(smem_u32(row)));
#endif
}

// Orders (value, index) pairs by value, then by the smaller index, as one
// unsigned 64-bit key; 0 is below every key of a real value.
__device__ __forceinline__ unsigned long long argmax_key(float v, int i) {
    unsigned u = __float_as_uint(v);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)u << 32) | (0xffffffffu - (unsigned)i);
}

__device__ __forceinline__ unsigned long long warp_max_u64(unsigned long long v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, v, o);
        v = other > v ? other : v;
    }
    return v;
}

#endif  // NI_COMMON_CUH
