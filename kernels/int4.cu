// Int4 weights (AWQ / GPTQ, W4A16): the fused decode products.
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

#include "common.cuh"
#include "int4.cuh"

#if NI_F16
#define W4_MAGIC 0x6400u
#define W4_ONE2 0x3c003c00u
#define W4_FMA2 "fma.rn.f16x2 %0, %1, %2, %3;"
#else
#define W4_MAGIC 0x4300u
#define W4_ONE2 0x3f803f80u
#define W4_FMA2 "fma.rn.bf16x2 %0, %1, %2, %3;"
#endif
// Warps of a block (a template parameter W: 8, 4 or 2): they split the
// inputs of one unit. The fewer, the more chunks each warp streams and the
// fewer waves the grid runs, as long as the blocks still fill the SMs'
// 16 warp slots (CudaDevice::w4_mm picks W by the number of units). H100,
// 8B shapes, one row, µs for W = 8 / 4 / 2: gate/up (896 units) 27.3 /
// 26.0 / 25.3; 6144 x 4096 (384 units) 9.2 / 7.7 / 9.7; o and down (256
// units) 6.0 / 6.5 and 13.6 / 16.9 for 8 / 4.

#define W4_OUT_ACT 0       // y[r, row] in the activation dtype
#define W4_OUT_F32 1       // y[r, row] as f32 (an int4 LM head's logits)
#define W4_OUT_RESIDUAL 2  // y[r, row] += the product: a residual add (as GEMV_OUT_RESIDUAL)
#define W4_OUT_SWIGLU 3    // out[r, j] = silu(gate) * up; tile pair (j, inter + j)
#define W4_OUT_QKV 4       // qkv_pair_store: bias, RoPE, q row / k, v cache
#define W4_OUT_QKV_FP8 5   // the same with an FP8 KV cache
// A norm handoff (decode batches of at most W4_HANDOFF_ROWS rows): the o and
// down products (W4_OUT_RESIDUAL with xs) also write x · nw and add the
// squares of x into sums[r]; the next paired product reads xs as its rows
// and applies rsqrt(sums[r] / k + eps) to its sums (w4_mm's `sums`).
#define W4_HANDOFF_ROWS 8
// The sums are fixed point, W4_SQ_ONE a unit, in 64 bits: integer adds give
// the same sum in whatever order the blocks add (float atomics made decode
// steps differ from run to run). Up to 1.7e13, an RMS of 65 536 over 4096
// inputs (f16's whole range); each add is off by at most half a unit, far
// below any eps.
#define W4_SQ_ONE 0x1p20f
__device__ __forceinline__ unsigned long long w4_sq_fixed(float sq) { return __float2ull_rn(sq * W4_SQ_ONE); }
__device__ __forceinline__ float w4_sq_float(unsigned long long s) { return __ull2float_rn(s) * (1.f / W4_SQ_ONE); }

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

// −(MAGIC + z) in both halves: z (the high half of sz) into both, then
// the sign and exponent bits.
__device__ __forceinline__ unsigned w4_neg_zero(unsigned sz) {
    return __byte_perm(sz, 0, 0x3232) | ((0x8000u | W4_MAGIC) * 0x10001u);
}

// (v & 0x000f000f) | m in one LOP3 with m in a register.
__device__ __forceinline__ unsigned w4_nibbles(unsigned v, unsigned m) {
    unsigned d;
    asm("lop3.b32 %0, %1, 0x000f000f, %2, 0xea;" : "=r"(d) : "r"(v), "r"(m));
    return d;
}

// The A fragment (q − z) of one packed word; zg, zg8: w4_neg_zero of rows g, g + 8.
// m: the magic pair, held in a register (see w4_stream).
__device__ __forceinline__ void w4_fragment(unsigned w, unsigned zg, unsigned zg8, unsigned (&a)[4], unsigned m) {
    a[0] = fma2_raw(w4_nibbles(w, m), W4_ONE2, zg);
    a[1] = fma2_raw(w4_nibbles(w >> 4, m), W4_ONE2, zg8);
    a[2] = fma2_raw(w4_nibbles(w >> 8, m), W4_ONE2, zg);
    a[3] = fma2_raw(w4_nibbles(w >> 12, m), W4_ONE2, zg8);
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


// acc += part · the group's scales (sz of rows g, g + 8), then part = 0.
__device__ __forceinline__ void w4_scale_add(float (&part)[4], unsigned sz, unsigned sz8, float (&acc)[4]) {
    const float sg = f16_bits_to_f(sz & 0xffffu), sg8 = f16_bits_to_f(sz8 & 0xffffu);
    acc[0] += part[0] * sg;
    acc[1] += part[1] * sg;
    acc[2] += part[2] * sg8;
    acc[3] += part[3] * sg8;
    part[0] = part[1] = part[2] = part[3] = 0.f;
}

// One chunk of a warp in registers: the weights of each tile, the
// lane's activation runs of each 8-row activation tile, and the
// scales/zeros of rows g and g + 8 for the chunk's first and (group 32)
// second group.
template <int T, int NT>
struct W4Chunk {
    uint4 w[T];
    uint4 x[NT][2];
    unsigned sz[T][2][2];
};

// Chunks per warp in the register ring (weights run that many minus one
// ahead of the MMAs) for T tiles per unit and NT activation tiles: the
// most each kernel's register budget (W4_BLOCKS_PER_SM) holds without
// spilling. NANOINFER_CUDA_DEFINES=-DW4_RING_<T>_<NT>=.. overrides one.
#ifndef W4_RING_1_1
#define W4_RING_1_1 4
#endif
#ifndef W4_RING_2_1
#define W4_RING_2_1 3
#endif
#ifndef W4_RING_1_2
#define W4_RING_1_2 2
#endif
#ifndef W4_RING_2_2
#define W4_RING_2_2 2
#endif
#ifndef W4_RING_1_4
#define W4_RING_1_4 1
#endif
#ifndef W4_RING_2_4
#define W4_RING_2_4 2
#endif
#define W4_RING(T, NT) \
    ((NT) == 1 ? ((T) == 1 ? W4_RING_1_1 : W4_RING_2_1) \
     : (NT) == 2 ? ((T) == 1 ? W4_RING_1_2 : W4_RING_2_2) : ((T) == 1 ? W4_RING_1_4 : W4_RING_2_4))

#ifndef W4_WEIGHTS_NO_L1
#define W4_WEIGHTS_NO_L1 1
#endif
// 16 bytes of streamed weights: read once, so they are not allocated in L1,
// where they would evict the activations every unit rereads.
__device__ __forceinline__ uint4 w4_load_weights(const uint4* p) {
#if W4_WEIGHTS_NO_L1
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
#else
    return __ldg(p);
#endif
}

// A chunk's weights and scales/zeros (which never depend on the previous
// kernel) and its activation runs.
template <int T, int NT, bool G32>
__device__ __forceinline__ void w4_fetch_weights(W4Chunk<T, NT>& ch, const uint4* const (&wp)[T],
                                                 const unsigned* const (&szt)[T], int c, unsigned group_magic) {
    const int gi = w4_group_of(c * W4_CHUNK, group_magic);
#pragma unroll
    for (int i = 0; i < T; i++) {
        ch.w[i] = w4_load_weights(wp[i]);
        ch.sz[i][0][0] = __ldg(szt[i] + gi * 16);
        ch.sz[i][0][1] = __ldg(szt[i] + gi * 16 + 8);
        if (G32) {
            ch.sz[i][1][0] = __ldg(szt[i] + gi * 16 + 16);
            ch.sz[i][1][1] = __ldg(szt[i] + gi * 16 + 24);
        }
    }
}
// STAGED: xp points into shared memory (rows normed by w4_norm_rows).
template <int T, int NT, bool STAGED>
__device__ __forceinline__ void w4_fetch_acts(W4Chunk<T, NT>& ch, const uint4* xp, const int (&xoff)[NT]) {
#pragma unroll
    for (int j = 0; j < NT; j++) {
        ch.x[j][0] = STAGED ? xp[xoff[j]] : load_act16(xp + xoff[j]);
        ch.x[j][1] = STAGED ? xp[xoff[j] + 4] : load_act16(xp + xoff[j] + 4);
    }
}

// acc += one chunk's products, each group's f32 sums scaled once. G32:
// the chunk's halves are groups of their own.
template <int T, int NT, bool G32>
__device__ __forceinline__ void w4_chunk_mma(const W4Chunk<T, NT>& ch, float (&acc)[T][NT][4], unsigned magic) {
#pragma unroll
    for (int i = 0; i < T; i++) {
        float part[NT][4];
#pragma unroll
        for (int j = 0; j < NT; j++) part[j][0] = part[j][1] = part[j][2] = part[j][3] = 0.f;
#pragma unroll
        for (int s = 0; s < 4; s++) {
            const int h = G32 && s >= 2;
            if (G32 && s == 2)
#pragma unroll
                for (int j = 0; j < NT; j++) w4_scale_add(part[j], ch.sz[i][0][0], ch.sz[i][0][1], acc[i][j]);
            const unsigned w = s == 0 ? ch.w[i].x : s == 1 ? ch.w[i].y : s == 2 ? ch.w[i].z : ch.w[i].w;
            unsigned a[4];
            w4_fragment(w, w4_neg_zero(ch.sz[i][h][0]), w4_neg_zero(ch.sz[i][h][1]), a, magic);
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const uint4 xq = ch.x[j][s >> 1];
                mma16816(part[j], a, (s & 1) ? xq.z : xq.x, (s & 1) ? xq.w : xq.y);
            }
        }
#pragma unroll
        for (int j = 0; j < NT; j++) w4_scale_add(part[j], ch.sz[i][G32][0], ch.sz[i][G32][1], acc[i][j]);
    }
}

// The product loop of a warp: chunks warp, warp + W, ... through
// a register ring, with running pointers and no bounds checks but in
// the last round, so the loop is little more than the loads, the nibble
// conversion and the MMAs. `after_wait` runs once the previous kernel is
// complete, before the first activation is read (the norm prologue).
template <int T, int NT, int W, bool G32, bool STAGED, typename AfterWait>
__device__ __forceinline__ void w4_stream(const uint4* const (&wt)[T], const unsigned* const (&szt)[T],
                                          const uint4* const (&xr)[NT], int warp, int chunks,
                                          unsigned group_magic, float (&acc)[T][NT][4],
                                          AfterWait after_wait) {
    constexpr int R = W4_RING(T, NT);
    const int n = chunks > warp ? (chunks - warp + W - 1) / W : 0;
    const uint4* wp[T];
#pragma unroll
    for (int i = 0; i < T; i++) wp[i] = wt[i] + (size_t)warp * 32;
    // Activation tile j's run is at xp + xoff[j] (uint4 units).
    const uint4* xp = xr[0] + warp * (W4_CHUNK / 8);
    int xoff[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) xoff[j] = (int)(xr[j] - xr[0]);
    int c = warp;
    W4Chunk<T, NT> ring[R];
    // The magic pair in a register: as an immediate it would take LOP3's
    // one immediate slot, and ptxas would re-materialize the nibble mask
    // before every LOP3 instead.
    unsigned magic;
    asm volatile("mov.b32 %0, %1;" : "=r"(magic) : "n"(W4_MAGIC | (W4_MAGIC << 16)));
    auto fetch_weights = [&](W4Chunk<T, NT>& ch) {
        w4_fetch_weights<T, NT, G32>(ch, wp, szt, c, group_magic);
#pragma unroll
        for (int i = 0; i < T; i++) wp[i] += W * 32;
        c += W;
    };
    auto fetch_acts = [&](W4Chunk<T, NT>& ch) {
        w4_fetch_acts<T, NT, STAGED>(ch, xp, xoff);
        xp += W * (W4_CHUNK / 8);
    };
    // The first weights are requested before waiting for the previous
    // kernel (programmatic launch), the activations after. Weights run
    // R - 1 chunks ahead of the MMAs; the activations (from L1/L2) of
    // several rows only one, which leaves the registers to the weights.
    constexpr int XA = NT == 1 || R == 1 ? R - 1 : 1;
#pragma unroll
    for (int r = 0; r < R - 1; r++)
        if (r < n) fetch_weights(ring[r]);
    grid_dep_wait();
    after_wait();
#pragma unroll
    for (int r = 0; r < XA; r++)
        if (r < n) fetch_acts(ring[r]);
    int i0 = 0;
    for (; i0 + 2 * R - 1 <= n; i0 += R) {  // every fetch of the round is in range
#pragma unroll
        for (int r = 0; r < R; r++) {
            fetch_weights(ring[(r + R - 1) % R]);
            fetch_acts(ring[(r + XA) % R]);
            w4_chunk_mma<T, NT, G32>(ring[r], acc, magic);
        }
    }
#pragma unroll
    for (int r = 0; r < 2 * R - 1; r++) {  // the rest: fewer than 2R - 1 chunks
        if (i0 + r + R - 1 < n) fetch_weights(ring[(r + R - 1) % R]);
        if (i0 + r + XA < n) fetch_acts(ring[(r + XA) % R]);
        if (i0 + r < n) w4_chunk_mma<T, NT, G32>(ring[r % R], acc, magic);
    }
}

// Staged rows are padded by 64 bytes: the two rows a quarter-warp reads
// fall on different shared-memory banks.
#define W4_STAGE_PAD 4  // uint4
#define W4_NORM_MAX_ROWS 8

// staged[r] = rmsnorm(x[r]) * nw for the block's `nrows` (≤ W4_NORM_MAX_ROWS)
// rows of k inputs, rounded as add_rms_norm rounds, row stride k / 8 +
// W4_STAGE_PAD uint4. Every thread of the block takes part.
template <int W>
__device__ void w4_norm_rows(const raw16* x, const raw16* nw, float eps, int k, int nrows,
                             uint4* staged) {
    __shared__ float part[W4_NORM_MAX_ROWS][W];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, kv = k / 8;
    const int stride = kv + W4_STAGE_PAD;
    for (int r = 0; r < nrows; r++) {
        float ss = 0.f;
        for (int c = threadIdx.x; c < kv; c += blockDim.x) {
            float f[8];
            unpack8(load_act16((const uint4*)(x + (size_t)r * k) + c), f);
#pragma unroll
            for (int e = 0; e < 8; e++) ss += f[e] * f[e];
        }
        ss = warp_sum(ss);
        if (lane == 0) part[r][warp] = ss;
    }
    __syncthreads();
    for (int r = 0; r < nrows; r++) {
        float ss = 0.f;
#pragma unroll
        for (int w = 0; w < W; w++) ss += part[r][w];
        const float rstd = rsqrtf(ss / k + eps);
        for (int c = threadIdx.x; c < kv; c += blockDim.x) {
            float f[8], g[8];
            unpack8(load_act16((const uint4*)(x + (size_t)r * k) + c), f);
            unpack8(__ldg((const uint4*)nw + c), g);
            unsigned o[4];
#pragma unroll
            for (int e = 0; e < 4; e++)
                o[e] = pack2(g[2 * e] * rnd(f[2 * e] * rstd), g[2 * e + 1] * rnd(f[2 * e + 1] * rstd));
            staged[(size_t)r * stride + c] = make_uint4(o[0], o[1], o[2], o[3]);
        }
    }
    __syncthreads();
}

// *o += v, rounded as the norm kernel's fused add rounds; returns the new *o.
__device__ __forceinline__ float w4_add_residual(raw16* o, float v) {
    const raw16 sum = from_f(to_f(*o) + rnd(v));
    *o = sum;
    return to_f(sum);
}

// y = x · wᵀ for the rows of T weight tiles (a "unit": one tile, or the
// gate/up or rope pair an epilogue needs together) and up to 8·NT
// activation rows starting at blockIdx.x · 8·NT. The 8 warps take
// interleaved 64-input chunks; their sums are added through shared memory.
// NORM: x holds residual rows; the block stages rmsnorm(x) * nw of its rows
// in dynamic shared memory first (w4_norm_rows) and multiplies those.
template <int T, int NT, int W, bool NORM>
__device__ __forceinline__ void w4_mm(const raw16* x, int rows, const uint4* wq,
                                      const unsigned* sz, int k, int group, int mode, void* y,
                                      int n, const raw16* bias, const float2* cs,
                                      const unsigned* slots, void* k_cache, void* v_cache,
                                      int inter, int nq, int nkv, int hd, const raw16* nw,
                                      float eps, unsigned long long* sums, unsigned long long* sums_zero,
                                      raw16* xs) {
    __shared__ float red[W][T * NT * 4][32];
    extern __shared__ uint4 staged[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int row0[T], freq0;
    w4_unit_rows<T>(blockIdx.y, mode, inter, nq, nkv, hd, row0, freq0);
    const int chunks = k / W4_CHUNK, groups = (k + group - 1) / group;
    const bool group32 = group == 32;
    const unsigned group_magic = w4_group_magic(group);
    const int tok0 = blockIdx.x * 8 * NT;
    const uint4* wt[T];
    const unsigned* szt[T];
#pragma unroll
    for (int i = 0; i < T; i++) {
        wt[i] = wq + (size_t)(row0[i] / 16) * chunks * 32 + lane;
        szt[i] = sz + (size_t)(row0[i] / 16) * groups * 16 + g;
    }
    // This lane's activation runs (B fragments: n = g of each 8-row tile).
    // Lanes past the last row read row 0: their MMA columns are not stored.
    const uint4* xr[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const int r = tok0 + 8 * j + g;
        xr[j] = NORM ? staged + (r < rows ? r - tok0 : 0) * (k / 8 + W4_STAGE_PAD) + t
                     : (const uint4*)(x + (size_t)(r < rows ? r : 0) * k + 8 * t);
    }
    auto norm_prologue = [&]() {
        if (NORM) w4_norm_rows<W>(x + (size_t)tok0 * k, nw, eps, k, min(rows - tok0, 8 * NT), staged);
    };
    float acc[T][NT][4];
#pragma unroll
    for (int i = 0; i < T; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;
    if (group32)
        w4_stream<T, NT, W, true, NORM>(wt, szt, xr, warp, chunks, group_magic, acc, norm_prologue);
    else
        w4_stream<T, NT, W, false, NORM>(wt, szt, xr, warp, chunks, group_magic, acc, norm_prologue);
    grid_dep_launch();
#pragma unroll
    for (int i = 0; i < T; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) red[warp][(i * NT + j) * 4 + e][lane] = acc[i][j][e];
    __syncthreads();
    // A norm handoff's consumer clears the sums the next producer adds into
    // (see W4_OUT_RESIDUAL): every earlier reader of them is complete.
    if (sums_zero && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x < W4_HANDOFF_ROWS)
        sums_zero[threadIdx.x] = 0ull;
    // Warp w finishes fragment registers w, w + W, ... of every tile.
    for (int e = warp; e < NT * 4; e += W) {
        float v[T];
#pragma unroll
        for (int i = 0; i < T; i++) {
            float s = 0.f;
#pragma unroll
            for (int w = 0; w < W; w++) s += red[w][i * NT * 4 + e][lane];
            v[i] = s;
        }
        const int j = e / 4, reg = e % 4;
        const int r = tok0 + 8 * j + 2 * t + (reg & 1);
        const int f = reg < 2 ? g : g + 8;
        if (mode == W4_OUT_RESIDUAL && xs) {
            // The residual add that hands the next norm over: also x · nw
            // (the next norm's weight) into xs and the squares of x into
            // sums[r], one add per row and warp (lanes t share a row).
            float sq = 0.f;
            if (r < rows) {
                const float xn = w4_add_residual((raw16*)y + (size_t)r * n + row0[0] + f, v[0]);
                xs[(size_t)r * n + row0[0] + f] = from_f(xn * to_f(nw[row0[0] + f]));
                sq = xn * xn;
            }
#pragma unroll
            for (int o_ = 4; o_ < 32; o_ <<= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o_);
            if (g == 0 && r < rows) atomicAdd(sums + r, w4_sq_fixed(sq));
            continue;
        }
        if (r >= rows) continue;
        if (sums) {  // the consumer of a norm handoff: rows are x · nw
            const float rstd = rsqrtf(w4_sq_float(__ldcg(sums + r)) / k + eps);
#pragma unroll
            for (int i = 0; i < T; i++) v[i] *= rstd;
        }
        if (mode == W4_OUT_ACT) {
            ((raw16*)y)[(size_t)r * n + row0[0] + f] = from_f(v[0]);
        } else if (mode == W4_OUT_F32) {
            ((float*)y)[(size_t)r * n + row0[0] + f] = v[0];
        } else if (mode == W4_OUT_RESIDUAL) {
            w4_add_residual((raw16*)y + (size_t)r * n + row0[0] + f, v[0]);
        } else if (mode == W4_OUT_SWIGLU) {
            ((raw16*)y)[(size_t)r * inter + row0[0] + f] = from_f(silu_mul_f(rnd(v[0]), rnd(v[T - 1])));
        } else {  // W4_OUT_QKV, W4_OUT_QKV_FP8
            qkv_pair_store(v[0], v[T - 1], r, row0[0] + f, row0[T - 1] + f, freq0 < 0 ? -1 : freq0 + f,
                           bias, (raw16*)y, cs, slots, k_cache, v_cache, nq, nkv, hd,
                           mode == W4_OUT_QKV_FP8);
        }
    }
}

// grid = (ceil(rows / (8 NT)), units), block = 32 * W. Units: n / 16
// tiles (ACT), inter / 16 gate/up pairs (SWIGLU), or the QKV rope
// and v pairs, (nq + 2 nkv) / 32 (QKV).
// Blocks of 8 warps per SM each kernel's register budget must allow (≤ 128
// registers for 16 warps per SM): with half as many warps too few loads
// are in flight to stream the weights. A ring of two chunks of two tiles
// and 32 activation rows needs more. (For one tile, one chunk at a time
// with two blocks per SM measured faster than a ring of two with one:
// 32-row down product 30.3 µs against 42.1.) Blocks of W warps: 8 / W
// times as many. -DW4_BLOCKS_<T>_<NT>=.. overrides one.
#ifndef W4_BLOCKS_1_1
#define W4_BLOCKS_1_1 2
#endif
#ifndef W4_BLOCKS_2_1
#define W4_BLOCKS_2_1 2
#endif
#ifndef W4_BLOCKS_1_2
#define W4_BLOCKS_1_2 2
#endif
#ifndef W4_BLOCKS_2_2
#define W4_BLOCKS_2_2 2
#endif
#ifndef W4_BLOCKS_1_4
#define W4_BLOCKS_1_4 2
#endif
#ifndef W4_BLOCKS_2_4
#define W4_BLOCKS_2_4 1
#endif
#define W4_BLOCKS_PER_SM(T, NT) W4_BLOCKS_##T##_##NT
// w4_mm_t<T>_n<NT> (8 warps), w4_mm_t<T>_n<NT>_w4 and _w2 (4, 2 warps), and with NORM
// w4_mm_t<T>_n<NT>_norm (dynamic shared memory: the block's rows ×
// (k / 8 + W4_STAGE_PAD) × 16 bytes).
#define W4_KERNEL(T, NT, W, NORM, SUFFIX)                                                         \
    extern "C" __global__ void __launch_bounds__(32 * W, W4_BLOCKS_PER_SM(T, NT) * (8 / W))     \
        w4_mm_t##T##_n##NT##SUFFIX(                                                               \
        const raw16* x, int rows, const uint4* wq, const unsigned* sz, int k, int group, int mode, \
        void* y, int n, const raw16* bias, const float2* cs, const unsigned* slots,               \
        void* k_cache, void* v_cache, int inter, int nq, int nkv, int hd, const raw16* nw,        \
        float eps, unsigned long long* sums, unsigned long long* sums_zero, raw16* xs) {          \
        w4_mm<T, NT, W, NORM>(x, rows, wq, sz, k, group, mode, y, n, bias, cs, slots, k_cache,    \
                              v_cache, inter, nq, nkv, hd, nw, eps, sums, sums_zero, xs);         \
    }
// Every unit shape (T tiles, 8·NT rows) in blocks of W warps.
#define W4_KERNEL_SET(W, SUFFIX)       \
    W4_KERNEL(1, 1, W, false, SUFFIX) \
    W4_KERNEL(1, 2, W, false, SUFFIX) \
    W4_KERNEL(1, 4, W, false, SUFFIX) \
    W4_KERNEL(2, 1, W, false, SUFFIX) \
    W4_KERNEL(2, 2, W, false, SUFFIX) \
    W4_KERNEL(2, 4, W, false, SUFFIX)
W4_KERNEL_SET(8, )
W4_KERNEL_SET(4, _w4)
W4_KERNEL_SET(2, _w2)
#undef W4_KERNEL_SET
// The paired products (QKV, gate/up) of decode batches, normed on the fly.
W4_KERNEL(2, 1, 8, true, _norm)
#undef W4_KERNEL

#define W4_DQ_CHUNKS 8  // chunks of one tile per dequantization block (512 inputs)

// out = the dequantized weights `[n, k]` row-major, (q − z) · s rounded once
// to the activation dtype (for cuBLAS on large batches). A warp decodes one
// chunk of one tile. In the layout above a lane's word pair (2h, 2h + 1)
// holds, for each of its rows g and g + 8, the eight inputs
// 32h + 8t .. 32h + 8t + 7, so the lane writes four 16-byte runs; the
// warp's stores fill whole 32-byte sectors.
// grid = (ceil(k / 64 / W4_DQ_CHUNKS), n / 16), block = 32 * W4_DQ_CHUNKS.
extern "C" __global__ void w4_dequant(const uint4* wq, const unsigned* sz, raw16* out, int k,
                                      int group) {
    GRID_DEP_ENTER();
    const int chunks = k / W4_CHUNK, groups = (k + group - 1) / group;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int rt = blockIdx.y, c = blockIdx.x * W4_DQ_CHUNKS + warp;
    if (c >= chunks) return;
    const uint4 v = wq[((size_t)rt * chunks + c) * 32 + lane];
    const unsigned words[4] = {v.x, v.y, v.z, v.w};
    const unsigned* szt = sz + (size_t)rt * groups * 16;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int gi = (c * W4_CHUNK + 32 * h) / group;
#pragma unroll
        for (int hi = 0; hi < 2; hi++) {  // row g, then g + 8: nibbles p = hi, hi + 2
            const int row = g + 8 * hi;
            const unsigned e = szt[gi * 16 + row];
            const float scale = f16_bits_to_f(e & 0xffffu), zero = (float)((e >> 16) & 0xfu);
            unsigned o[4];
#pragma unroll
            for (int s = 0; s < 2; s++) {
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int p = hi + 2 * j;  // inputs +4s + 2j, +4s + 2j + 1
                    const float q0 = (float)((words[2 * h + s] >> (4 * p)) & 0xfu);
                    const float q1 = (float)((words[2 * h + s] >> (4 * p + 16)) & 0xfu);
                    o[2 * s + j] = pack2((q0 - zero) * scale, (q1 - zero) * scale);
                }
            }
            *(uint4*)(out + (size_t)(rt * 16 + row) * k + c * W4_CHUNK + 32 * h + 8 * t) =
                make_uint4(o[0], o[1], o[2], o[3]);
        }
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
