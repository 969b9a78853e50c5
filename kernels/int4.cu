// Int4 weights (AWQ / GPTQ, W4A16): appended to decoder.cu at build time,
// so it uses that file's helpers (raw16, to_f/from_f, mma16816, ...).
//
// Packed layout (written by src/backend/cuda/w4.rs): weight rows in tiles
// of 16, inputs in chunks of 64. Tile `rt`, chunk `c` is 32 lanes × one
// uint4 (512 bytes) at `(rt * chunks + c) * 32 + lane`. Word s of lane
// (g = lane / 4, t = lane % 4) holds k-step s as the m16n8k16 A fragment
// wants it: nibble p at bits 4p,
//   p0 (row g, k 2t)     p4 (row g, k 2t+1)     p1 (row g+8, k 2t)   p5 (g+8, 2t+1)
//   p2 (row g, k 2t+8)   p6 (row g, k 2t+9)     p3 (row g+8, 2t+8)   p7 (g+8, 2t+9)
// so `(w >> 4i) & 0x000f000f` is fragment register i, one nibble per half.
// The MMA's k rows are a permutation of the chunk's inputs: for lane quad t,
// k rows (2t, 2t+1) of step s are inputs 32(s/2) + 8t + 4(s%2) + {0, 1}
// and rows (2t+8, 2t+9) the next two, so a lane's activations for the
// chunk are the two 16-byte runs at 8t and 32 + 8t (and a k-step stays in
// one 32-input group). src/backend/cuda/w4.rs packs to match.
// Scales and zeros: `sz[rt][group][16 rows]`, a u32 of f16 scale bits | zero << 16.
//
// The product: OR-ing a nibble q into the mantissa of the 16-bit float MAGIC
// (128 in bf16, 1024 in f16) gives MAGIC + q exactly; one fma with
// −(MAGIC + z) gives q − z, exact, the A operand of the MMA. Each group's
// partial sums (f32) are then scaled by the group's f32 scale: more
// accurate than rounding dequantized weights to 16 bits first.

#if NI_F16
#define W4_MAGIC 0x6400u
#define W4_ONE2 0x3c003c00u
#define W4_FMA2 "fma.rn.f16x2 %0, %1, %2, %3;"
#else
#define W4_MAGIC 0x4300u
#define W4_ONE2 0x3f803f80u
#define W4_FMA2 "fma.rn.bf16x2 %0, %1, %2, %3;"
#endif
#define W4_WARPS 8   // warps of a block; they split the inputs of one unit
#define W4_CHUNK 64  // inputs per chunk

#define W4_OUT_ACT 0       // y[r, row] in the activation dtype
#define W4_OUT_SWIGLU 3    // out[r, j] = silu(gate) * up; tile pair (j, inter + j)
#define W4_OUT_QKV 4       // qkv_pair_store: bias, RoPE, q row / k, v cache

__device__ __forceinline__ unsigned fma2_raw(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm(W4_FMA2 : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ float f16_bits_to_f(unsigned h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
}

// −(MAGIC + z) in both halves.
__device__ __forceinline__ unsigned w4_neg_zero(unsigned sz) {
    const unsigned z = 0x8000u | W4_MAGIC | ((sz >> 16) & 0xfu);
    return z | (z << 16);
}

// The A fragment (q − z) of one packed word; zg, zg8: w4_neg_zero of rows g, g + 8.
__device__ __forceinline__ void w4_fragment(unsigned w, unsigned zg, unsigned zg8, unsigned (&a)[4]) {
    const unsigned m = W4_MAGIC | (W4_MAGIC << 16);
    a[0] = fma2_raw((w & 0x000f000fu) | m, W4_ONE2, zg);
    a[1] = fma2_raw(((w >> 4) & 0x000f000fu) | m, W4_ONE2, zg8);
    a[2] = fma2_raw(((w >> 8) & 0x000f000fu) | m, W4_ONE2, zg);
    a[3] = fma2_raw(((w >> 12) & 0x000f000fu) | m, W4_ONE2, zg8);
}

// The first weight row of each of the T tiles of unit u, and for QKV units
// the rotary frequency of the first row (−1 for v columns).
template <int T>
__device__ __forceinline__ void w4_unit_rows(int u, int mode, int inter, int nq, int nkv, int hd,
                                             int (&row0)[T], int& freq0) {
    freq0 = -1;
    if (T == 1) {
        row0[0] = 16 * u;
        return;
    }
    if (mode == W4_OUT_SWIGLU) {
        row0[0] = 16 * u;
        row0[T - 1] = inter + 16 * u;
        return;
    }
    // QKV: rope units pair tile (head, f0) with (head, f0 + hd / 2); then
    // pairs of adjacent v tiles.
    const int half = hd / 2, per_head = half / 16, rope_units = (nq + nkv) / hd * per_head;
    if (u < rope_units) {
        freq0 = (u % per_head) * 16;
        row0[0] = (u / per_head) * hd + freq0;
        row0[T - 1] = row0[0] + half;
    } else {
        row0[0] = nq + nkv + 32 * (u - rope_units);
        row0[T - 1] = row0[0] + 16;
    }
}

#ifndef W4_D  // NANOINFER_CUDA_DEFINES=-DW4_D=.. overrides it
#define W4_D 2  // chunks per pipeline stage of a warp
#endif

// One pipeline stage of a warp: W4_D chunks' weights, their (first
// group's) scales/zeros for rows g and g + 8, and the lane's activations.
template <int T, int NT>
struct W4Stage {
    uint4 w[W4_D][T];
    uint4 x[W4_D][NT][2];
    unsigned sz[W4_D][T][2];
};

// input / group without a division: group_magic = 2³² / group + 1 (exact
// for inputs < 2³² / group).
__device__ __forceinline__ int w4_group_of(int input, unsigned group_magic) {
    return (int)__umulhi((unsigned)input, group_magic);
}

template <int T, int NT>
__device__ __forceinline__ void w4_load(W4Stage<T, NT>& st, int c0, int chunks, unsigned group_magic,
                                        const uint4* const (&wt)[T], const unsigned* const (&szt)[T],
                                        const uint4* const (&xr)[NT], const bool (&live)[NT]) {
#pragma unroll
    for (int d = 0; d < W4_D; d++) {
        const int c = c0 + d * W4_WARPS;
        if (c >= chunks) break;
        const int gi = w4_group_of(c * W4_CHUNK, group_magic);
#pragma unroll
        for (int i = 0; i < T; i++) {
            st.w[d][i] = __ldg(wt[i] + (size_t)c * 32);
            st.sz[d][i][0] = __ldg(szt[i] + gi * 16);
            st.sz[d][i][1] = __ldg(szt[i] + gi * 16 + 8);
        }
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const uint4 zero = make_uint4(0, 0, 0, 0);
            st.x[d][j][0] = live[j] ? __ldg(xr[j] + c * (W4_CHUNK / 8)) : zero;
            st.x[d][j][1] = live[j] ? __ldg(xr[j] + c * (W4_CHUNK / 8) + 4) : zero;
        }
    }
}

// acc += the stage's products; part holds each group's unscaled sums.
template <int T, int NT>
__device__ __forceinline__ void w4_compute(W4Stage<T, NT>& st, int c0, int chunks, bool group32,
                                           const unsigned* const (&szt)[T],
                                           float (&acc)[T][NT][4], float (&part)[T][NT][4]) {
#pragma unroll
    for (int d = 0; d < W4_D; d++) {
        const int c = c0 + d * W4_WARPS;
        if (c >= chunks) break;
        // −(MAGIC + z) of rows g and g + 8, once per group rather than per
        // k-step at one n-tile; the wider kernels' accumulators leave no
        // registers for it, so they recompute it.
        unsigned nz[T][2];
#pragma unroll
        for (int s = 0; s < 4; s++) {
            if (s == 2 && group32) {  // the chunk's second 32-input group
                const int gi = c * 2 + 1;
#pragma unroll
                for (int i = 0; i < T; i++) {
                    st.sz[d][i][0] = __ldg(szt[i] + gi * 16);
                    st.sz[d][i][1] = __ldg(szt[i] + gi * 16 + 8);
                }
            }
            if (NT == 1 && (s == 0 || (s == 2 && group32))) {
#pragma unroll
                for (int i = 0; i < T; i++) {
                    nz[i][0] = w4_neg_zero(st.sz[d][i][0]);
                    nz[i][1] = w4_neg_zero(st.sz[d][i][1]);
                }
            }
#pragma unroll
            for (int i = 0; i < T; i++) {
                const uint4 wq4 = st.w[d][i];
                const unsigned w = s == 0 ? wq4.x : s == 1 ? wq4.y : s == 2 ? wq4.z : wq4.w;
                unsigned a[4];
                if (NT == 1)
                    w4_fragment(w, nz[i][0], nz[i][1], a);
                else
                    w4_fragment(w, w4_neg_zero(st.sz[d][i][0]), w4_neg_zero(st.sz[d][i][1]), a);
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    const uint4 xq = st.x[d][j][s >> 1];
                    const unsigned b0 = (s & 1) ? xq.z : xq.x, b1 = (s & 1) ? xq.w : xq.y;
                    mma16816(part[i][j], a, b0, b1);
                }
            }
            if (s == 3 || (s == 1 && group32)) {
#pragma unroll
                for (int i = 0; i < T; i++) {
                    const float sg = f16_bits_to_f(st.sz[d][i][0] & 0xffffu);
                    const float sg8 = f16_bits_to_f(st.sz[d][i][1] & 0xffffu);
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        acc[i][j][0] += part[i][j][0] * sg;
                        acc[i][j][1] += part[i][j][1] * sg;
                        acc[i][j][2] += part[i][j][2] * sg8;
                        acc[i][j][3] += part[i][j][3] * sg8;
                        part[i][j][0] = part[i][j][1] = part[i][j][2] = part[i][j][3] = 0.f;
                    }
                }
            }
        }
    }
}

// y = x · wᵀ for the rows of T weight tiles (a "unit": one tile, or the
// gate/up or rope pair an epilogue needs together) and up to 8·NT
// activation rows starting at blockIdx.x · 8·NT. The 8 warps take
// interleaved 64-input chunks, W4_D at a time; their sums are added
// through shared memory.
template <int T, int NT>
__device__ __forceinline__ void w4_mm(const raw16* x, int rows, const uint4* wq,
                                      const unsigned* sz, int k, int group, int mode, void* y,
                                      int n, const raw16* bias, const float2* cs,
                                      const unsigned* slots, raw16* k_cache, raw16* v_cache,
                                      int inter, int nq, int nkv, int hd) {
    __shared__ float red[W4_WARPS][T * NT * 4][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int row0[T], freq0;
    w4_unit_rows<T>(blockIdx.y, mode, inter, nq, nkv, hd, row0, freq0);
    const int chunks = k / W4_CHUNK, groups = (k + group - 1) / group;
    const bool group32 = group == 32;
    const unsigned group_magic = 0xffffffffu / (unsigned)group + 1;
    const int tok0 = blockIdx.x * 8 * NT;
    const uint4* wt[T];
    const unsigned* szt[T];
#pragma unroll
    for (int i = 0; i < T; i++) {
        wt[i] = wq + (size_t)(row0[i] / 16) * chunks * 32 + lane;
        szt[i] = sz + (size_t)(row0[i] / 16) * groups * 16 + g;
    }
    // This lane's activation runs (B fragments: n = g of each 8-row tile).
    const uint4* xr[NT];
    bool live[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const int r = tok0 + 8 * j + g;
        live[j] = r < rows;
        xr[j] = (const uint4*)(x + (size_t)(live[j] ? r : 0) * k + 8 * t);
    }
    grid_dep_wait();
    float acc[T][NT][4], part[T][NT][4];
#pragma unroll
    for (int i = 0; i < T; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = part[i][j][e] = 0.f;

    const int step = W4_WARPS * W4_D;
    if (NT == 1) {
        // Decode: bandwidth-bound, loads of the next stage in flight while
        // computing this one.
        W4Stage<T, NT> next;
        w4_load(next, warp, chunks, group_magic, wt, szt, xr, live);
        for (int c0 = warp; c0 < chunks; c0 += step) {
            W4Stage<T, NT> cur = next;
            if (c0 + step < chunks) w4_load(next, c0 + step, chunks, group_magic, wt, szt, xr, live);
            w4_compute(cur, c0, chunks, group32, szt, acc, part);
        }
    } else {
        // Wider batches need the registers for accumulators: one stage.
        for (int c0 = warp; c0 < chunks; c0 += step) {
            W4Stage<T, NT> cur;
            w4_load(cur, c0, chunks, group_magic, wt, szt, xr, live);
            w4_compute(cur, c0, chunks, group32, szt, acc, part);
        }
    }
    grid_dep_launch();
#pragma unroll
    for (int i = 0; i < T; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) red[warp][(i * NT + j) * 4 + e][lane] = acc[i][j][e];
    __syncthreads();
    // Warp w finishes fragment registers w, w + 8, ... of every tile.
    for (int e = warp; e < NT * 4; e += W4_WARPS) {
        float v[T];
#pragma unroll
        for (int i = 0; i < T; i++) {
            float s = 0.f;
#pragma unroll
            for (int w = 0; w < W4_WARPS; w++) s += red[w][i * NT * 4 + e][lane];
            v[i] = s;
        }
        const int j = e / 4, reg = e % 4;
        const int r = tok0 + 8 * j + 2 * t + (reg & 1);
        const int f = reg < 2 ? g : g + 8;
        if (r >= rows) continue;
        if (mode == W4_OUT_ACT) {
            ((raw16*)y)[(size_t)r * n + row0[0] + f] = from_f(v[0]);
        } else if (mode == W4_OUT_SWIGLU) {
            ((raw16*)y)[(size_t)r * inter + row0[0] + f] = from_f(silu_mul_f(rnd(v[0]), rnd(v[T - 1])));
        } else {  // W4_OUT_QKV
            qkv_pair_store(v[0], v[T - 1], r, row0[0] + f, row0[T - 1] + f, freq0 < 0 ? -1 : freq0 + f,
                           bias, (raw16*)y, cs, slots, k_cache, v_cache, nq, nkv, hd);
        }
    }
}

// grid = (ceil(rows / (8 NT)), units), block = 32 * W4_WARPS. Units: n / 16
// tiles (ACT), inter / 16 gate/up pairs (SWIGLU), or the QKV rope
// and v pairs, (nq + 2 nkv) / 32 (QKV).
// Blocks per SM each kernel's register budget must allow (≤ 128 registers
// for two blocks of 8 warps): with one block per SM too few loads are in
// flight to stream the weights. The widest kernel's accumulators need more.
#ifndef W4_MIN_BLOCKS
#define W4_MIN_BLOCKS 2
#endif
#define W4_BLOCKS_PER_SM(T, NT) ((T) == 2 && (NT) == 4 ? 1 : W4_MIN_BLOCKS)
#define W4_KERNEL(T, NT)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * W4_WARPS, W4_BLOCKS_PER_SM(T, NT))          \
        w4_mm_t##T##_n##NT(                                                                       \
        const raw16* x, int rows, const uint4* wq, const unsigned* sz, int k, int group, int mode, \
        void* y, int n, const raw16* bias, const float2* cs, const unsigned* slots,               \
        raw16* k_cache, raw16* v_cache, int inter, int nq, int nkv, int hd) {                     \
        w4_mm<T, NT>(x, rows, wq, sz, k, group, mode, y, n, bias, cs, slots, k_cache, v_cache,    \
                     inter, nq, nkv, hd);                                                          \
    }
W4_KERNEL(1, 1)
W4_KERNEL(1, 2)
W4_KERNEL(1, 4)
W4_KERNEL(2, 1)
W4_KERNEL(2, 2)
W4_KERNEL(2, 4)
#undef W4_KERNEL

#define W4_DQ_CHUNKS 8  // chunks of one tile per dequantization block (512 inputs)

// out = the dequantized weights `[n, k]` row-major, (q − z) · s rounded once
// to the activation dtype (for cuBLAS on large batches). A block decodes
// W4_DQ_CHUNKS chunks of one tile (one warp each) into shared memory, then
// writes the 16 rows as contiguous 1 KB runs.
// grid = (ceil(k / 64 / W4_DQ_CHUNKS), n / 16), block = 32 * W4_DQ_CHUNKS.
extern "C" __global__ void w4_dequant(const uint4* wq, const unsigned* sz, raw16* out, int n, int k,
                                      int group) {
    __shared__ unsigned tile[16][W4_DQ_CHUNKS * W4_CHUNK / 2 + 4];  // bf16 pairs, padded
    GRID_DEP_ENTER();
    const int chunks = k / W4_CHUNK, groups = (k + group - 1) / group;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int rt = blockIdx.y, c = blockIdx.x * W4_DQ_CHUNKS + warp;
    if (c < chunks) {
        const uint4 v = wq[((size_t)rt * chunks + c) * 32 + lane];
        const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int s = 0; s < 4; s++) {
            const int gi = (c * W4_CHUNK + 32 * (s >> 1)) / group;
#pragma unroll
            for (int p = 0; p < 4; p++) {
                // See the layout above: pair p >> 1 of k-step s of lane quad t.
                const int row = g + (p & 1) * 8;
                const int col = warp * W4_CHUNK + 32 * (s >> 1) + 8 * t + 4 * (s & 1) + 2 * (p >> 1);
                const unsigned e = sz[((size_t)rt * groups + gi) * 16 + row];
                const float scale = f16_bits_to_f(e & 0xffffu), zero = (float)((e >> 16) & 0xfu);
                const float q0 = (float)((words[s] >> (4 * p)) & 0xfu);
                const float q1 = (float)((words[s] >> (4 * p + 16)) & 0xfu);
                tile[row][col / 2] = pack2((q0 - zero) * scale, (q1 - zero) * scale);
            }
        }
    }
    __syncthreads();
    const int cols = min(W4_DQ_CHUNKS, chunks - (int)blockIdx.x * W4_DQ_CHUNKS) * W4_CHUNK;
    const size_t base = (size_t)rt * 16 * k + (size_t)blockIdx.x * W4_DQ_CHUNKS * W4_CHUNK;
    // 16-byte stores: 4 pairs per thread per pass.
    for (int i = threadIdx.x; i < 16 * cols / 8; i += blockDim.x) {
        const int row = i / (cols / 8), q = i % (cols / 8);
        const uint4 v = make_uint4(tile[row][4 * q], tile[row][4 * q + 1], tile[row][4 * q + 2],
                                   tile[row][4 * q + 3]);
        *(uint4*)(out + base + (size_t)row * k + 8 * q) = v;
    }
}

// out[r, i] = x[r, perm[i]]: the activations of act-order (GPTQ desc_act)
// weights in their packed input order. grid = rows, block = 256.
extern "C" __global__ void w4_gather(const raw16* x, const unsigned* perm, raw16* out, int k) {
    GRID_DEP_ENTER();
    const raw16* src = x + (size_t)blockIdx.x * k;
    raw16* dst = out + (size_t)blockIdx.x * k;
    for (int i = threadIdx.x; i < k; i += blockDim.x) dst[i] = src[perm[i]];
}
