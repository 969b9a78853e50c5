// W4A16 GEMM on Hopper tensor cores, for int4 batches above the fused
// kernels' rows (prefill chunks, serving steps that carry prompt chunks):
// y[rows, n] = x[rows, k] · wᵀ. It replaces dequantizing w to the
// activation dtype for cuBLAS, which writes and rereads 2 bytes per weight
// on every pass. It reads int4.cu's packed layout (int4.cuh).
//
// wgmma computes yᵀ. The weights are its A operand, from registers: the
// packed layout of int4.cu already is the m16n8k16 A fragment, and wgmma's
// register A fragment is that layout per warp (warp w of a warpgroup holds
// rows 16w..16w + 15 of the 64). A lane dequantizes its word straight into
// it. 128 activation rows are the B operand, from shared memory.
//
// The activations are first packed (w4_gemm_pack_x, or the norm or SwiGLU
// kernel before the product: add_rms_norm_w4g, silu_mul_w4g) into the
// image of the B operand's shared memory, so each stage is one bulk copy:
// per block of 128 rows and chunk of 64 inputs, 16 KB of 128-byte rows
// whose 16-byte pieces are XOR-swizzled by row % 8 (wgmma's 128-byte
// swizzle), the inputs in the MMA k order of the packed weights (a
// permutation of the chunk, int4.cu), gathered through the act-order
// permutation if there is one, and rows past the batch zero.
//
// Numerics: the operands are f16 whatever the activation dtype. Each weight
// is (q − z)·s rounded once to f16 (bf16 holds only 8 of the f16 scale's 11
// bits: rounding it twice exactly cost a third more dequantization work),
// the activations are converted to f16 by the packing (exact within its
// range, clamped to ±65504), the products are summed in f32 and each
// output rounded once to the activation dtype. For bf16 models that is
// closer to the exact product than w4_dequant's bf16 weights
// (tests/cuda.rs, int4_gemm_matches_the_exact_product).
//
// Block: WGS warpgroups of 64 weight rows, times NT = 128 or 256
// activation rows (two 64-row wgmmas per warpgroup, 128 accumulator
// registers, were slower). With 256 (the "tall" block, WGS = 2), each
// warpgroup's dequantized weights feed one wgmma per 128-row half, which
// halves the dequantization per product. Shared memory holds S stages
// (W4G_STAGES, or W4G_STAGES_TALL for 256 rows) of one chunk each:
// activations (16 KB per 128 rows), packed weights (512 bytes per 16-row
// tile) and the scales/zeros of the chunk's two 32-input halves (128 bytes
// per tile), brought S − 3 chunks ahead (up to S by a producer warpgroup;
// the activations by a bulk copy per 128 rows, the rest by cp.async), with
// a pair of mbarriers per stage. Each chunk's wgmmas are one commit group;
// a warpgroup dequantizes chunk c + 1 into its second register set while
// the tensor cores run chunk c.
//
// Tiles (NT activation rows × one block's weight rows) are shared out
// either one per block or by stream-K (w4g_range_start): one block per SM,
// each taking an equal run of all tiles' chunks, so that a partial last
// wave or fewer tiles than SMs leave no SM idle; with G a multiple of the
// tiles, that is split-K (each tile's chunks evenly among G / tiles
// blocks). A block's run is cut into pieces at tile boundaries; the pieces
// of a tile split among blocks are added up by the last to finish
// (w4g_split_end). The host plans the launches per product
// (src/backend/cuda/w4_gemm.rs).
//
// Blocks of two warpgroups are warp-specialized: a third warpgroup, the
// producer, issues every load and `setmaxnreg`s down to 40 registers; the
// two consumers (232 registers) only wait for chunks, dequantize and run
// the wgmmas, as cuBLAS's Hopper kernels split the work (H100: 4–20 %
// faster than consumers loading their own stages). Four consumers would
// get too few registers, so wide blocks load their own.
//
// y[token, feature] is at y[token · ldy + feature] (ldy ≥ n: the host may
// run a product's weight rows as two launches, into columns of one y).
// grid = G blocks (one per tile, or one per SM for stream-K: see
// w4g_range_start), block = 128·WGS (+ 128: the producer), dynamic
// shared memory = S · stage bytes + 1 KB (alignment). `partials` (2·G
// slots of NT / 4 float2 per consumer thread), `counters` (one per tile)
// and `ready` (one per slot), both zero, serve tiles that stream-K splits
// among blocks.

#include "common.cuh"
#include "int4.cuh"

#define W4G_TOKENS 128                   // activation rows per wgmma (its N) and per packed block
#define W4G_X_BYTES (W4G_TOKENS * 128)  // one chunk of them: 128 rows × 64 inputs × 2 bytes
#define W4G_PIECES 5                     // most tiles a block's run touches (MAX_PIECES of w4_gemm.rs)
#ifndef W4G_STAGES
#define W4G_STAGES 8
#endif
#ifndef W4G_STAGES_TALL  // blocks of 256 activation rows: 37 KB a stage
#define W4G_STAGES_TALL 6
#endif
// Chunks loaded ahead of the one being multiplied: a stage is refilled once
// every warp is done with the chunk W4G_STAGES − W4G_AHEAD before, so warps
// may drift that many chunks apart.
#ifndef W4G_AHEAD
#define W4G_AHEAD (W4G_STAGES - 3)
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define W4G_WGMMA 1  // compiled for sm_90a: the kernels exist
#else
#define W4G_WGMMA 0  // other targets: the kernels trap; the host never launches them
#endif

#if NI_F16
#define W4G_CVT2 "cvt.rn.f16x2.f32 %0, %1, %2;"
#else
#define W4G_CVT2 "cvt.rn.bf16x2.f32 %0, %1, %2;"
#endif

// Two floats rounded to the activation dtype, `lo` in the low half.
__device__ __forceinline__ unsigned w4g_pack2(float lo, float hi) {
    unsigned d;
    asm(W4G_CVT2 : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// f16 arithmetic on pairs (the GEMM's operands are f16 for either activation dtype).
__device__ __forceinline__ unsigned w4g_fma2(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
// (v & mask) | 1024.0 (f16) in both halves, in one LOP3.
__device__ __forceinline__ unsigned w4g_nibbles(unsigned v, unsigned mask) {
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(v), "r"(mask), "r"(0x64006400u));
    return d;
}

#if W4G_WGMMA
__device__ __forceinline__ void w4g_mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// One arrival that also expects `bytes` of bulk copies to land.
__device__ __forceinline__ void w4g_mbar_expect(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void w4g_mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// `bytes` (a multiple of 16) from global to shared memory, completing on `bar`.
__device__ __forceinline__ void w4g_bulk(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void w4g_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void w4g_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void w4g_wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ uint4 w4g_lds16(unsigned addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}
__device__ __forceinline__ unsigned w4g_lds4(unsigned addr) {
    unsigned v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

// Shared-memory matrix descriptor of a K-major B tile with the 128-byte
// swizzle: rows of 128 bytes, 8-row groups 1024 bytes apart (the stride
// offset); the leading offset is unused for this layout. `addr` must be
// 1024-aligned plus the k-step's 32-byte offset. (Without the swizzle, in
// 128-byte core matrices, the same GEMM ran at half the speed.)
__device__ __forceinline__ unsigned long long w4g_desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3ffffu) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) | (1ull << 62);
}

// d[64 rows, 128] += a (registers, 64 × 16) · b (shared memory, 16 × 128).
__device__ __forceinline__ void w4g_mma(float (&d)[64], const unsigned (&a)[4], unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
        "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, "
        "%39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, "
        "%58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
          "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
          "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
          "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),
          "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
          "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
          "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// Keeps the compiler from moving accumulator accesses across the
// asynchronous wgmmas that own them.
template <int N>
__device__ __forceinline__ void w4g_fence_acc(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}
#endif  // W4G_WGMMA

// The dequantization operands of one row's group, as f16 pairs: the scale
// and −(MAGIC + z) for a nibble in bits 0-3 (MAGIC = 1024) or, scaled by
// 1/16, in bits 4-7 (MAGIC = 64).
struct W4GGroup {
    unsigned s, negz;
};
__device__ __forceinline__ W4GGroup w4g_group_low(unsigned sz) {
    const unsigned z = (sz >> 16) & 0xfu;
    return {(sz & 0xffffu) * 0x10001u, (0xe400u | z) * 0x10001u};
}
__device__ __forceinline__ W4GGroup w4g_group_high(unsigned sz) {
    const unsigned z = (sz >> 16) & 0xfu;
    return {(sz & 0xffffu) * 0x10001u, (0xd400u + 16 * z) * 0x10001u};
}

// The A fragments (f16) of one packed word (k-step): q − z exact from one
// LOP3 and one fma, then times the scale, rounded once. Rows g (nibbles in
// bits 0-3 of each byte pair: p0/p4, p2/p6 after >> 8) and g + 8 (bits
// 4-7: p1/p5, p3/p7) take their nibbles without a shift each.
__device__ __forceinline__ void w4g_fragment(unsigned w, W4GGroup rg, W4GGroup rg8, unsigned (&a)[4]) {
    const unsigned ONE = 0x3c003c00u, SIXTEENTH = 0x2c002c00u, NEG0 = 0x80008000u, w8 = w >> 8;
    a[0] = w4g_fma2(w4g_fma2(w4g_nibbles(w, 0x000f000fu), ONE, rg.negz), rg.s, NEG0);
    a[1] = w4g_fma2(w4g_fma2(w4g_nibbles(w, 0x00f000f0u), SIXTEENTH, rg8.negz), rg8.s, NEG0);
    a[2] = w4g_fma2(w4g_fma2(w4g_nibbles(w8, 0x000f000fu), ONE, rg.negz), rg.s, NEG0);
    a[3] = w4g_fma2(w4g_fma2(w4g_nibbles(w8, 0x00f000f0u), SIXTEENTH, rg8.negz), rg8.s, NEG0);
}

// Stream-K: the grid's G blocks share out the I = tiles · chunks
// iterations (a tile: one 128-row block of activations × one block of
// weight rows; an iteration: one chunk of a tile). Block b takes
// [⌊b·I/G⌋, ⌊(b + 1)·I/G⌋), tile after tile (tile t is activation block
// t % row_blocks of weight block t / row_blocks, so a weight block's tiles
// run one after the other and its weights come from L2 after the first).
// With G = the number of tiles every block owns one tile (the plain grid);
// with G = the SMs, a short last wave or fewer tiles than SMs no longer
// leave SMs idle. (32-bit arithmetic: 64-bit divisions are calls. The host
// keeps I · G below 2³¹ where G is not the number of tiles.)
__device__ __forceinline__ int w4g_range_start(int b, int iters) { return b * iters / (int)gridDim.x; }
// The block whose range holds iteration i: the largest b with
// ⌊b·I/G⌋ ≤ i, i.e. ⌈(i + 1)·G / I⌉ − 1.
__device__ __forceinline__ int w4g_block_of(int i, int iters) {
    return ((i + 1) * (int)gridDim.x + iters - 1) / iters - 1;
}

// Where this thread's output pair p = 2i + hh of a tile goes: y[token
// m0 + 8i + 2t + odd][features 16·rt + g − odd + 8hh, +1] (t = lane % 4,
// g = lane / 4, odd = g % 2; see the epilogue of w4_gemm).
__device__ __forceinline__ void w4g_store_pair(raw16* y, int ldy, int rows, int m0, int rt, int p, float lo, float hi) {
    const int lane = threadIdx.x & 31, g = lane >> 2, odd = g & 1;
    const int token = m0 + 8 * (p >> 1) + 2 * (lane & 3) + odd, feature = rt * 16 + g - odd + 8 * (p & 1);
    if (rt >= 0 && token < rows) *(unsigned*)(y + (size_t)token * ldy + feature) = w4g_pack2(lo, hi);
}

// A tile split among blocks b0..b1 (pieces: the block's range starts or
// ends inside the tile). Each piece first leaves its f32 sums in shared
// memory (`own`: 32 float2 per thread, over the stages, which the block no
// longer reads) and counts itself in counters[tile]. Every piece but the
// last to count copies them to its block's slot of `partials` (2b for the
// piece its range starts with, 2b + 1 for the one it ends with) and sets
// the slot's `ready` flag. The last waits for those flags (their pieces
// have counted, so they are running and do not wait for anything), adds
// all pieces up in block order, its own from shared memory (so the result
// does not depend on which was last), stores the tile and resets the
// counter and flags for the next launch. Out of line: the chunk loop keeps
// its registers.
template <int THREADS, int PAIRS>
__device__ __forceinline__ float2* w4g_slot(float* partials, int slot) {
    return (float2*)partials + (size_t)slot * PAIRS * THREADS + threadIdx.x;
}
__device__ __forceinline__ int w4g_slot_of(int b, int tile_first, int iters) {
    return 2 * b + (w4g_range_start(b, iters) < tile_first);
}
__device__ __forceinline__ float2 w4g_lds_f2(unsigned addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr));
    return v;
}

// Barrier 1 among a block's THREADS consumer threads (every thread unless
// a producer warpgroup loads the stages, which __syncthreads would also
// wait for).
template <int THREADS>
__device__ __forceinline__ void w4g_sync() {
    asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
}

template <int THREADS, int PAIRS>
__device__ __noinline__ void w4g_split_end(raw16* y, int ldy, int rows, int m0, int rt, int tile, int chunks,
                                           int iters, float* partials, unsigned* counters, unsigned* ready,
                                           unsigned own) {
    __shared__ int w4g_last_piece;
    const int tile_first = tile * chunks, me = blockIdx.x;
    const int b0 = w4g_block_of(tile_first, iters), b1 = w4g_block_of(tile_first + chunks - 1, iters);
    own += threadIdx.x * 8;
    w4g_sync<THREADS>();
    if (threadIdx.x == 0) w4g_last_piece = atomicAdd(counters + tile, 1u) == (unsigned)(b1 - b0);
    w4g_sync<THREADS>();
    if (!w4g_last_piece) {
        const int slot = w4g_slot_of(me, tile_first, iters);
        float2* mine = w4g_slot<THREADS, PAIRS>(partials, slot);
#pragma unroll
        for (int p = 0; p < PAIRS; p++) mine[p * THREADS] = w4g_lds_f2(own + p * THREADS * 8);
        __threadfence();
        w4g_sync<THREADS>();
        if (threadIdx.x == 0) asm volatile("st.release.gpu.global.u32 [%0], 1;" ::"l"(ready + slot) : "memory");
    } else {
        if (threadIdx.x == 0) {
            for (int b = b0; b <= b1; b++) {
                if (b == me) continue;
                const unsigned* flag = ready + w4g_slot_of(b, tile_first, iters);
                unsigned set = 0;
                while (!set) asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(set) : "l"(flag) : "memory");
            }
        }
        w4g_sync<THREADS>();
        __threadfence();
        // Half a slot's loads at once (16 per thread): one after the other,
        // each waiting for the last, they took longer than the products;
        // all 32 at once spilled.
#pragma unroll
        for (int h = 0; h < PAIRS; h += 16) {
            float2 v[16];
#pragma unroll
            for (int p = 0; p < 16; p++) v[p] = make_float2(0.f, 0.f);
            for (int b = b0; b <= b1; b++) {
                float2 part[16];
                if (b == me) {
#pragma unroll
                    for (int p = 0; p < 16; p++) part[p] = w4g_lds_f2(own + (h + p) * THREADS * 8);
                } else {
                    const float2* slot = w4g_slot<THREADS, PAIRS>(partials, w4g_slot_of(b, tile_first, iters));
#pragma unroll
                    for (int p = 0; p < 16; p++) part[p] = __ldcg(slot + (h + p) * THREADS);
                }
#pragma unroll
                for (int p = 0; p < 16; p++) {
                    v[p].x += part[p].x;
                    v[p].y += part[p].y;
                }
            }
#pragma unroll
            for (int p = 0; p < 16; p++) w4g_store_pair(y, ldy, rows, m0, rt, h + p, v[p].x, v[p].y);
        }
        if (threadIdx.x == 0) {
            counters[tile] = 0u;
            for (int b = b0; b <= b1; b++)
                if (b != me) ready[w4g_slot_of(b, tile_first, iters)] = 0u;
        }
    }
    w4g_sync<THREADS>();  // before the next piece's loads overwrite `own`, and w4g_last_piece is written again
}

// The block's dynamic shared memory: S stages (activations, the weight
// tiles' packed words, their scales/zeros), then a `full` and an `empty`
// mbarrier per stage. A block takes WGS · 64 weight rows and NT (128 or
// 256) activation rows; with 256, each warpgroup's dequantized weights
// feed two wgmmas, which halves the dequantization per product.
template <int WGS, int NT>
struct W4GStages {
    static_assert(NT == W4G_TOKENS || NT == 2 * W4G_TOKENS, "blocks of 128 or 256 activation rows");
    static constexpr int HALVES = NT / W4G_TOKENS;  // 128-row activation blocks (wgmmas per k-step)
    static constexpr int PAIRS = 32 * HALVES;       // output pairs per thread
    static constexpr int S = HALVES == 1 ? W4G_STAGES : W4G_STAGES_TALL;
    static constexpr int AHEAD = S - (W4G_STAGES - W4G_AHEAD);
    // A warp loads chunk i + AHEAD before it releases chunk i − 1's stage:
    // one stage less between them and it would wait for itself.
    static_assert(S - AHEAD >= 2, "stages refilled at least two chunks behind");
    static constexpr int TILES = 4 * WGS;  // 16-row weight tiles per block
    static constexpr int X_BYTES = HALVES * W4G_X_BYTES;
    static constexpr int W_BYTES = TILES * 512;
    static constexpr int SZ_BYTES = TILES * 2 * 64;  // 16 rows × two halves per tile
    static constexpr int STAGE = X_BYTES + W_BYTES + SZ_BYTES;
    static_assert(STAGE % 1024 == 0, "stages keep the activation tiles 1024-aligned");
    unsigned smem, full, empty;

    __device__ __forceinline__ W4GStages() {
        extern __shared__ unsigned char w4g_smem[];
        smem = (smem_u32(w4g_smem) + 1023u) & ~1023u;
        full = smem + S * STAGE;
        empty = full + 8 * S;
    }
};

// A block's piece of a tile: chunks [c0, c0 + len) of tile ⌊it / chunks⌋
// from iteration `it` on, up to the tile's end or `last`.
template <int WGS, int NT>
struct W4GPiece {
    int tile, c0, len, row_block, tile0, tiles, x_blocks;
    __device__ __forceinline__ W4GPiece(int it, int last, int chunks, int rows, int n) {
        using L = W4GStages<WGS, NT>;
        const int row_blocks = (rows + NT - 1) / NT;
        tile = it / chunks;
        c0 = it - tile * chunks;
        len = min(chunks - c0, last - it);
        row_block = tile % row_blocks;
        tile0 = tile / row_blocks * L::TILES;
        tiles = min(L::TILES, n / 16 - tile0);  // this block's real weight tiles
        // Packed 128-row activation blocks of this tile (the second half of
        // a 256-row block past the batch is not copied: its stale products
        // only reach outputs that are never stored).
        x_blocks = min(L::HALVES, (rows + W4G_TOKENS - 1) / W4G_TOKENS - row_block * L::HALVES);
    }
};

// Chunk c of piece `pc` into stage j, once the warps are done with the
// stage's previous chunk, by LOADERS threads (`lt`: this one's index): the
// activations in one bulk copy per 128 rows (loader 0); each tile's
// weights and its scales/zeros of the chunk's two halves by every loader's
// cp.async (small pieces: as bulk copies they were many times slower).
template <int WGS, int NT, int LOADERS>
__device__ __forceinline__ void w4g_load(const W4GStages<WGS, NT>& stages, const W4GPiece<WGS, NT>& pc,
                                         const raw16* __restrict__ xp, const uint4* __restrict__ wq,
                                         const unsigned* __restrict__ sz, int chunks, int groups,
                                         unsigned group_magic, int c, int j, int lt) {
    using L = W4GStages<WGS, NT>;
    constexpr int S = L::S, X_BYTES = L::X_BYTES, W_BYTES = L::W_BYTES, TILES = L::TILES;
    const unsigned st = stages.smem + (j % S) * L::STAGE, bar = stages.full + 8 * (j % S);
    if (j >= S) w4g_mbar_wait(stages.empty + 8 * (j % S), (j / S - 1) & 1);
    if (lt == 0) {
        const raw16* xblock = xp + (size_t)pc.row_block * L::HALVES * chunks * (W4G_X_BYTES / 2);
        w4g_mbar_expect(bar, pc.x_blocks * W4G_X_BYTES);
#pragma unroll
        for (int h = 0; h < L::HALVES; h++)
            if (h < pc.x_blocks)
                w4g_bulk(st + h * W4G_X_BYTES, xblock + ((size_t)h * chunks + c) * (W4G_X_BYTES / 2), W4G_X_BYTES, bar);
    }
#pragma unroll
    for (int q = 0; q < TILES * 32 / LOADERS; q++) {
        const int p = lt + LOADERS * q;  // 16-byte piece p of the weights: tile p / 32, lane p % 32
        if (p < pc.tiles * 32)
            cp_async16_at(st + X_BYTES + p * 16, wq + ((size_t)(pc.tile0 + (p >> 5)) * chunks + c) * 32 + (p & 31), 16);
    }
    if (lt < pc.tiles * 8) {  // piece lt % 4 of half (lt / 4) % 2 of tile lt / 8
        const int gi = w4_group_of(c * W4_CHUNK + 32 * ((lt >> 2) & 1), group_magic);
        const unsigned* src = sz + ((size_t)(pc.tile0 + (lt >> 3)) * groups + gi) * 16 + 4 * (lt & 3);
        cp_async16_at(st + X_BYTES + W_BYTES + lt * 16, src, 16);
    }
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// Barrier 2: a warp-specialized block's producer waits there until the
// consumers are done with a split piece's sums (`own`, over the stages).
template <int THREADS>
__device__ __forceinline__ void w4g_own_free_arrive() {
    asm volatile("bar.arrive 2, %0;" ::"n"(THREADS + 128) : "memory");
}
template <int THREADS>
__device__ __forceinline__ void w4g_own_free_wait() {
    asm volatile("bar.sync 2, %0;" ::"n"(THREADS + 128) : "memory");
}

// Multiplies piece `pc` from stage `seq` on (and with WS = false loads
// it, S − 3 chunks ahead); returns its length.
template <int WGS, int NT, bool WS>
__device__ __forceinline__ int w4g_piece(const W4GPiece<WGS, NT>& pc, const raw16* __restrict__ xp, int rows,
                                         const uint4* __restrict__ wq, const unsigned* __restrict__ sz, int k,
                                         int group, raw16* __restrict__ y, int n, int ldy, float* __restrict__ partials,
                                         unsigned* __restrict__ counters, unsigned* __restrict__ ready, int iters,
                                         int seq) {
#if W4G_WGMMA
    using L = W4GStages<WGS, NT>;
    constexpr int S = L::S, HALVES = L::HALVES, PAIRS = L::PAIRS, THREADS = 128 * WGS;
    constexpr int X_BYTES = L::X_BYTES, W_BYTES = L::W_BYTES, STAGE = L::STAGE;
    const L stages;
    const unsigned smem = stages.smem, full = stages.full, empty = stages.empty;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2;
    const int chunks = k / W4_CHUNK, n_tiles = n / 16, groups = (k + group - 1) / group, len = pc.len;
    const bool g32 = group == 32;
    const unsigned group_magic = w4_group_magic(group);
    auto load = [&](int i) {
        if constexpr (!WS)
            if (i < len)
                w4g_load<WGS, NT, THREADS>(stages, pc, xp, wq, sz, chunks, groups, group_magic, pc.c0 + i, seq + i,
                                           tid);
    };

    float acc[HALVES][64];
#pragma unroll
    for (int h = 0; h < HALVES; h++)
#pragma unroll
        for (int i = 0; i < 64; i++) acc[h][i] = 0.f;
    const int tb = warp;  // this warp's tile: warp w of warpgroup j holds rows 64j + 16w..

#pragma unroll
    for (int i = 0; i < L::AHEAD; i++) load(i);

    // One chunk: wait for its stage, dequantize into `a`, issue its
    // wgmmas, (load chunk i + AHEAD,) wait for chunk i − 1's wgmmas and
    // release that one's stage. Warps only wait for each other through the
    // stages, so warpgroups drift apart and take turns on the tensor cores.
    auto step = [&](int i, unsigned (&a)[4][4]) {
        const int j = seq + i;
        w4g_mbar_wait(full + 8 * (j % S), (j / S) & 1);
        const unsigned st = smem + (j % S) * STAGE;
        const uint4 wv = w4g_lds16(st + X_BYTES + tb * 512 + lane * 16);
        const unsigned szb = st + X_BYTES + W_BYTES + tb * 128 + g * 4;
        const W4GGroup lo = w4g_group_low(w4g_lds4(szb)), lo8 = w4g_group_high(w4g_lds4(szb + 32));
        W4GGroup hi = lo, hi8 = lo8;  // the second half's group: the same unless groups are 32 wide
        if (g32) {
            hi = w4g_group_low(w4g_lds4(szb + 64));
            hi8 = w4g_group_high(w4g_lds4(szb + 96));
        }
        w4g_fragment(wv.x, lo, lo8, a[0]);
        w4g_fragment(wv.y, lo, lo8, a[1]);
        w4g_fragment(wv.z, hi, hi8, a[2]);
        w4g_fragment(wv.w, hi, hi8, a[3]);
        w4g_wgmma_fence();
        // k-step s: bytes 32s.. of each activation row, 128 rows per wgmma
#pragma unroll
        for (int s = 0; s < 4; s++)
#pragma unroll
            for (int h = 0; h < HALVES; h++) w4g_mma(acc[h], a[s], w4g_desc(st + h * W4G_X_BYTES + 32 * s));
        w4g_wgmma_commit();
        load(i + L::AHEAD);
        w4g_wgmma_wait<1>();
        if (i > 0 && lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(empty + 8 * ((j - 1) % S)) : "memory");
    };
    unsigned a0[4][4], a1[4][4];
    int i = 0;
    for (; i + 1 < len; i += 2) {
        step(i, a0);
        step(i + 1, a1);
    }
    if (i < len) step(i, a0);
    w4g_wgmma_wait<0>();
#pragma unroll
    for (int h = 0; h < HALVES; h++) w4g_fence_acc(acc[h]);
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(empty + 8 * ((seq + len - 1) % S)) : "memory");

    // acc[h][4i + 2hh + e] is y[token 128h + 8i + 2t + e][feature 16·rt +
    // g + 8hh]. Lanes g and g ^ 1 swap one value each, so every lane holds
    // two adjacent features of one token (pair p = 32h + 2i + hh): even g
    // token 2t, odd g token 2t + 1. Every thread reads acc on the same
    // path (read on a branch ptxas cannot prove uniform, it makes ptxas
    // serialize the wgmmas); only the stores differ.
    const int m0 = pc.row_block * NT, rt = pc.tile0 + tb < n_tiles ? pc.tile0 + tb : -1;
    const bool odd = g & 1, split = len != chunks;
    if (split) w4g_sync<THREADS>();  // every warp's wgmmas are done with the stages `own` overwrites
#pragma unroll
    for (int p = 0; p < PAIRS; p++) {
        const float v0 = acc[p / 32][2 * (p % 32)], v1 = acc[p / 32][2 * (p % 32) + 1];
        const float other = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
        const float lo = odd ? other : v0, hi = odd ? v1 : other;
        if (split)
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(smem + (p * THREADS + tid) * 8), "f"(lo), "f"(hi) : "memory");
        else
            w4g_store_pair(y, ldy, rows, m0, rt, p, lo, hi);
    }
    if (split) w4g_split_end<THREADS, PAIRS>(y, ldy, rows, m0, rt, pc.tile, chunks, iters, partials, counters, ready, smem);
    return len;
#else
    return 0;
#endif
}

// A warp-specialized block's producer warpgroup: loads every chunk of the
// block's range [first, last) in turn, pausing after a split piece until
// the consumers have taken its sums out of the stages.
template <int WGS, int NT>
__device__ __forceinline__ void w4g_produce(const raw16* __restrict__ xp, int rows, const uint4* __restrict__ wq,
                                            const unsigned* __restrict__ sz, int k, int group, int n, int first,
                                            int last) {
#if W4G_WGMMA
    const W4GStages<WGS, NT> stages;
    const int chunks = k / W4_CHUNK, groups = (k + group - 1) / group, lt = threadIdx.x - 128 * WGS;
    const unsigned group_magic = w4_group_magic(group);
    for (int it = first, seq = 0; it < last;) {
        const W4GPiece<WGS, NT> pc(it, last, chunks, rows, n);
        for (int i = 0; i < pc.len; i++)
            w4g_load<WGS, NT, 128>(stages, pc, xp, wq, sz, chunks, groups, group_magic, pc.c0 + i, seq + i, lt);
        it += pc.len;
        seq += pc.len;
        if (pc.len != chunks && it < last) w4g_own_free_wait<128 * WGS>();
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// WS: a third warpgroup, the producer, `setmaxnreg`s down and issues
// every load, while the WGS = 2 consumer warpgroups (raised) only wait
// for their chunks, dequantize and run the wgmmas, as cuBLAS's Hopper
// kernels split the work. block = 128·WGS (+ 128 with WS).
template <int WGS, int NT, bool WS>
__device__ __forceinline__ void w4_gemm(const raw16* __restrict__ xp, int rows, const uint4* __restrict__ wq,
                                        const unsigned* __restrict__ sz, int k, int group, raw16* __restrict__ y,
                                        int n, int ldy, float* __restrict__ partials, unsigned* __restrict__ counters,
                                        unsigned* __restrict__ ready) {
    GRID_DEP_ENTER();
#if W4G_WGMMA
    using L = W4GStages<WGS, NT>;
    constexpr int TILES = L::TILES, THREADS = 128 * WGS, LOADERS = WS ? 128 : THREADS;
    // Per stage: `full` completes when its chunk has landed (loader 0's
    // expected bytes of the bulk copies, and every loader's cp.async
    // arrival), `empty` when every consumer warp's wgmmas are done with it.
    // Stages are used in turn across the block's pieces.
    const L stages;
    if (threadIdx.x == 0) {
        for (int i = 0; i < L::S; i++) {
            w4g_mbar_init(stages.full + 8 * i, LOADERS + 1);
            w4g_mbar_init(stages.empty + 8 * i, THREADS / 32);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    // The block's range: one tile (the plain grid), or stream-K's share.
    const int chunks = k / W4_CHUNK, iters = (rows + NT - 1) / NT * ((n / 16 + TILES - 1) / TILES) * chunks;
    const bool whole_tiles = gridDim.x * chunks == iters;
    const int first = whole_tiles ? blockIdx.x * chunks : w4g_range_start(blockIdx.x, iters);
    const int last = whole_tiles ? first + chunks : w4g_range_start(blockIdx.x + 1, iters);
    if constexpr (WS) {
        // Registers: all 64 K of the SM, the producer keeping the fewest it
        // can use. (Four consumers would get 120 each: too few, ptxas
        // serializes their wgmmas.)
        static_assert(WGS == 2, "a producer for two consumer warpgroups");
        constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = (65536 / 128 - PRODUCER_REGS) / WGS / 8 * 8;
        if (threadIdx.x >= THREADS) {
            asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS) : "memory");
            w4g_produce<WGS, NT>(xp, rows, wq, sz, k, group, n, first, last);
            return;
        }
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS) : "memory");
    }
    // At most W4G_PIECES pieces (the host keeps ranges short enough),
    // unrolled: inside a loop over pieces ptxas lacked the registers and
    // serialized the wgmmas.
    int it = first, seq = 0;
#pragma unroll
    for (int p = 0; p < W4G_PIECES; p++) {
        if (it < last) {
            const W4GPiece<WGS, NT> pc(it, last, chunks, rows, n);
            const int len =
                w4g_piece<WGS, NT, WS>(pc, xp, rows, wq, sz, k, group, y, n, ldy, partials, counters, ready, iters, seq);
            it += len;
            seq += len;
            if (WS && len != chunks && it < last) w4g_own_free_arrive<THREADS>();
        }
    }
#else
    __trap();
#endif
}

#define W4G_KERNEL(NAME, WGS, NT, WS)                                                                           \
    extern "C" __global__ void __launch_bounds__(128 * (WGS + WS), 1)                                           \
        NAME(const raw16* xp, int rows, const uint4* wq, const unsigned* sz, int k, int group, raw16* y, int n, \
             int ldy, float* partials, unsigned* counters, unsigned* ready) {                                   \
        w4_gemm<WGS, NT, WS>(xp, rows, wq, sz, k, group, y, n, ldy, partials, counters, ready);                 \
    }
W4G_KERNEL(w4_gemm_wg2, 2, 128, true)
W4G_KERNEL(w4_gemm_wg4, 4, 128, false)
W4G_KERNEL(w4_gemm_wg2_t256, 2, 256, true)
#undef W4G_KERNEL

// Two values as f16 (low half first), clamped to its finite range: bf16
// activations beyond ±65504 would otherwise become infinities.
__device__ __forceinline__ unsigned w4g_f16x2(float lo, float hi) {
    unsigned d;
    lo = fminf(fmaxf(lo, -65504.f), 65504.f);
    hi = fminf(fmaxf(hi, -65504.f), 65504.f);
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// Writes stored piece p (0..7) of the 128-byte packed row of `token` and
// chunk c of xp (the GEMM's B layout, see the top of this file), for k
// inputs a row: input i of the row is value(i) (0 for rows past the batch).
// Piece p holds (p ^ token % 8) = kc: MMA k rows 8(kc % 2) .. +7 of k-step
// kc / 2, for lane quad t inputs 32(s / 2) + 8t + 4(s % 2) + 2(kc % 2) +
// {0, 1} of the chunk (s = kc / 2).
template <typename Value>
__device__ __forceinline__ void w4g_write_piece(raw16* xp, int token, int c, int p, int k, Value value) {
    const int r = token % W4G_TOKENS, kc = p ^ (r & 7), s = kc >> 1;
    const int base = c * W4_CHUNK + 32 * (s >> 1) + 4 * (s & 1) + 2 * (kc & 1);
    unsigned out[4];
#pragma unroll
    for (int t = 0; t < 4; t++) out[t] = w4g_f16x2(value(base + 8 * t), value(base + 8 * t + 1));
    const size_t piece = (((size_t)(token / W4G_TOKENS) * (k / W4_CHUNK) + c) * W4G_TOKENS + r) * 8 + p;
    *(uint4*)(xp + piece * 8) = make_uint4(out[0], out[1], out[2], out[3]);
}

// The 16-byte pieces of xp for `rows` rows of k inputs (rows rounded up
// to 128), numbered in their order in memory so that consecutive threads
// write consecutive bytes; w4g_piece_at gives piece id's row (token),
// chunk and stored piece.
__device__ __forceinline__ long long w4g_pieces(int rows, int k) {
    return (long long)((rows + W4G_TOKENS - 1) / W4G_TOKENS) * W4G_TOKENS * k / 8;
}
__device__ __forceinline__ void w4g_piece_at(long long id, int k, int& token, int& c, int& p) {
    // id = ((token block · chunks + chunk) · 128 + row) · 8 + stored piece
    const int r = (id >> 3) % W4G_TOKENS, chunks = k / W4_CHUNK;
    const long long bc = id / (8 * W4G_TOKENS);
    p = id & 7;
    c = bc % chunks;
    token = (int)(bc / chunks) * W4G_TOKENS + r;
}

// xp = x[rows, k] in the GEMM's B layout, rows padded to a multiple of 128
// by zeros; perm (act-order, or null): packed input i is x[·, perm[i]].
// A thread writes one 16-byte piece.
// grid = ceil(w4g_pieces(rows, k) / 256), block = 256.
extern "C" __global__ void w4_gemm_pack_x(const raw16* x, const unsigned* perm, raw16* xp, int rows, int k) {
    GRID_DEP_ENTER();
    const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= w4g_pieces(rows, k)) return;
    int token, c, p;
    w4g_piece_at(id, k, token, c, p);
    const raw16* row = x + (size_t)token * k;
    w4g_write_piece(xp, token, c, p, k, [&](int i) { return token < rows ? to_f(row[perm ? perm[i] : i]) : 0.f; });
}

// silu_mul into the GEMM's B layout (down's input without a packing pass):
// xp = silu(gate) · up of gate_up [rows, 2·inter], each value rounded to
// the activation dtype as silu_mul rounds it. grid and block as
// w4_gemm_pack_x's for k = inter.
extern "C" __global__ void silu_mul_w4g(const raw16* gate_up, raw16* xp, int rows, int inter) {
    GRID_DEP_ENTER();
    const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= w4g_pieces(rows, inter)) return;
    int token, c, p;
    w4g_piece_at(id, inter, token, c, p);
    const raw16* g = gate_up + (size_t)token * 2 * inter;
    w4g_write_piece(xp, token, c, p, inter, [&](int i) {
        return token < rows ? rnd(silu_mul_f(to_f(g[i]), to_f(g[inter + i]))) : 0.f;
    });
}

// add_rms_norm (no row list) into the GEMM's B layout (QKV's and gate/up's
// input without a packing pass): each value rounded as add_rms_norm rounds
// it. grid = rows rounded up to 128 (blocks past the batch write zeros),
// block = add_rms_norm's.
extern "C" __global__ void add_rms_norm_w4g(raw16* residual, const raw16* delta, const raw16* w, raw16* xp,
                                            int rows, int d, float eps) {
    __shared__ __align__(16) raw16 values[NORM_MAX_D];
    GRID_DEP_ENTER();
    const int token = blockIdx.x;
    float rstd = 0.f;
    if (token < rows) {  // the same for the whole block
        float v[NORM_VECS][8];
        rstd = add_rms_norm_row(residual, delta, token, delta != 0, d, eps, values, v);
    }
    for (int piece = threadIdx.x; piece < d / 8; piece += blockDim.x)
        w4g_write_piece(xp, token, piece / 8, piece % 8, d, [&](int i) {
            return token < rows ? rnd(rms_normed(to_f(w[i]), to_f(values[i]), rstd)) : 0.f;
        });
}
